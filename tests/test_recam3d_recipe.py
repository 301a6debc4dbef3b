"""config/grpo.py:recam3d_tiny_grpo from a fresh clone, with its defaults: the bundled tiny-recam3d on the 3-D camera
world, cam_score read by the world's exact estimator (in its worker process), the clipped-ratio GRPO update on the
4-step SDE window. One small epoch: it trains on-policy (ratio exactly 1 before the update) and the reward is the
3-D reading (the 2-D world's motions are not there)."""
import json
import math
import os
import subprocess
import sys

from helpers import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_small_epoch(name: str, tmp_path) -> dict:
    """The named config from a fresh clone with its defaults, shrunk to one epoch of 4 clips (one group of k = 4):
    that epoch's history entry."""
    args = [sys.executable, "scripts/train.py", "--config", f"config/grpo.py:{name}",
            "--config.num_epochs=1", "--config.save_freq=0", "--config.eval_freq=0", "--config.logging.wandb=False",
            "--config.logging.tensorboard=False", "--config.sample.batch_size=4",
            "--config.sample.num_batches_per_epoch=1", "--config.sample.k=4", "--config.train.batch_size=4",
            "--config.train.gradient_accumulation_steps=1", f"--config.logdir={tmp_path}", "--config.run_name=r3d"]
    r = subprocess.run(args, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.load(open(tmp_path / "r3d" / "summary.json"))["history"][0]


def test_recam3d_tiny_grpo_trains_one_epoch_with_its_defaults(tmp_path):
    history = one_small_epoch("recam3d_tiny_grpo", tmp_path)
    assert "cam_score/cam_score_accuracy" in history  # the 3-D reading ran: room3d items carry no 2-D motions
    assert 0.0 <= history["reward_mean"] <= 1.0
    assert history["train"]["onpolicy_ratio_max_dev"] == 0.0  # re-scored old log-probs: exactly on-policy
    assert history["samples"] == 4


def test_recam3d_tiny_nft_trains_one_epoch_with_its_defaults(tmp_path):
    """The DiffusionNFT comparison config (recam3d_tiny_nft) on the same world and model: one small epoch, the
    forward-process loss finite, every sample trained."""
    history = one_small_epoch("recam3d_tiny_nft", tmp_path)
    assert "cam_score/cam_score_accuracy" in history
    assert history["samples"] == 4
    assert math.isfinite(history["train"]["loss"]) and history["train"]["loss"] > 0.0  # a denoising MSE
    assert history["train"]["skipped_steps"] == 0 and history["train"]["nonfinite_loss"] == 0

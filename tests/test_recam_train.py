"""recam through the trainer: the seed report's checks reproduced automatically with 2 CPU processes, and the
full 8-device geometry validated without any device or model loading."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
from helpers import cpu_env, launch_cmd, run_side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env()


def test_recam_geometry_dry_run_for_8_processes():
    dry = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:recam", "--config.dry_run=True"]
    env = dict(ENV, WORLD_SIZE="8")
    p, bad = run_side_by_side([dict(args=dry, cwd=ROOT, env=env),
                               dict(args=dry + ["--config.sample.k=3"], cwd=ROOT, env=env)], timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "8 processes x 2 x 4 = 64 samples/epoch, k=4" in p.stdout
    assert bad.returncode == 2 and "= 64 is not divisible by sample.k=3" in bad.stderr
    # ReCamMaster's only shape, by hand: 81 frames x 480 x 832 px; Wan's VAE compresses time 4x (frame 0 alone, then
    # 4 a latent: 1 + 80 / 4 = 21) and space 8x (60 x 104) into 16 channels; its DiT's patch (1, 2, 2) makes
    # 30 x 52 tokens of each latent frame (ReCamMaster's DiT: 21 x 30 x 52 = 32760 per clip, the source as many)
    frames, height, width, t_down, s_down, channels, patch = 81, 480, 832, 4, 8, 16, 2
    latent = (channels, 1 + (frames - 1) // t_down, height // s_down, width // s_down)
    assert latent == (16, 21, 60, 104)
    tokens = (latent[2] // patch, latent[3] // patch)
    assert tokens == (30, 52)
    want = (f"  planned sample: {frames} frames x {height} x {width} px, denoised as {' x '.join(map(str, latent))}, "
            f"{tokens[0]} x {tokens[1]} tokens per latent frame")
    assert want in p.stdout.splitlines()


def test_recam_image_tiny_two_processes_reproduces_the_seed_report_checks(tmp_path):
    cmd = [*launch_cmd(2, 29700), "scripts/train.py",
           "--config", "config/grpo.py:recam_image_tiny", "--config.num_epochs=1", f"--config.logdir={tmp_path}",
           "--config.run_name=r", "--config.sample.batch_size=2", "--config.sample.num_batches_per_epoch=4",
           "--config.train.batch_size=2", "--config.sample.k=4", "--config.sample.num_steps=4", "--config.eval_freq=0",
           "--config.save_freq=0", "--config.logging.wandb=False", "--config.logging.debug_dump=True"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    # 2 processes x batch 2 x 4 batches = 16 samples = 4 dataset indices x k=4, as in the report (scaled down)
    assert "16 samples = 4 conditions x k=4 (exact)" in out
    dumps = [json.load(open(f)) for f in sorted(glob.glob(str(tmp_path / "r" / "debug" / "*.json")))]
    assert len(dumps) == 2
    keys = np.array(dumps[0]["keys_all"])
    rewards, adv = np.array(dumps[0]["rewards_all"]), np.array(dumps[0]["advantages_all"])
    assert rewards.shape == adv.shape == (16, 4)  # per-timestep `avg` (B, T), as the report's (64, 18)
    _, counts = np.unique(keys, return_counts=True)
    assert (counts == 4).all()
    for key in np.unique(keys):  # per group and per timestep column: mean 0, std 1 (or all 0 if rewards equal)
        a, r = adv[keys == key], rewards[keys == key]
        for t in range(4):
            if r[:, t].std() > 1e-4:
                assert abs(a[:, t].mean()) < 1e-5 and abs(a[:, t].std() - 1) < 1e-4
            else:
                assert (a[:, t] == 0).all()
    assert dumps[0]["weights_sum"] == dumps[1]["weights_sum"]

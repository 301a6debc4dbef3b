"""Resume continues one run: the same run folder, checkpoints, history, wandb run and TensorBoard curve. A missing or
damaged checkpoint (each file type truncated) is one line naming the file, exit 2, before any tracker or model."""
import glob
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
from helpers import cpu_env, run_side_by_side

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.trainer.run.checkpointing import check_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--config", "config/grpo.py:tiny", "--config.sample.num_steps=3", "--config.sample.batch_size=4",
       "--config.sample.num_batches_per_epoch=2", "--config.sample.k=4", "--config.train.batch_size=4",
       "--config.eval_freq=0", "--config.logging.image_freq=0", "--config.save_freq=1",
       "--config.logging.wandb=True", "--config.logging.tensorboard=True"]


def train(logdir, *extra):
    return dict(args=[sys.executable, "scripts/train.py", *RUN, f"--config.logdir={logdir}", *extra], cwd=ROOT,
                env=cpu_env())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 1-epoch run named 'r', then resumed from its folder (no run_name) to 2 epochs."""
    logdir = tmp_path_factory.mktemp("resume")
    (first,) = run_side_by_side([train(logdir, "--config.run_name=r", "--config.num_epochs=1")])
    assert first.returncode == 0, first.stderr[-3000:]
    (second,) = run_side_by_side([train(logdir, f"--config.resume_from={logdir / 'r'}", "--config.num_epochs=2")])
    assert second.returncode == 0, second.stderr[-3000:]
    return logdir, second


@pytest.mark.timeout(300)
def test_resume_continues_in_the_same_run_folder(resumed):
    logdir, second = resumed
    run = logdir / "r"
    assert "resumed from" in second.stdout and "at epoch 1" in second.stdout
    assert sorted(os.listdir(logdir)) == ["r"]  # no second run folder
    assert sorted(os.listdir(run / "checkpoints")) == ["checkpoint_00001", "checkpoint_00002"]
    history = json.load(open(run / "summary.json"))["history"]
    assert [h["epoch"] for h in history] == [0, 1]  # one continuous history
    # the cost per sample: 3 sampling steps without CFG are 3 denoiser rows per sample; training re-scores at least
    # one trained step of each sample (tiny trains the steps with std >= 0.3)
    assert all(h["nfe_per_sample"]["sampling"] == 3.0 and h["nfe_per_sample"]["training"] >= 1.0 for h in history)
    # one wandb run: both starts logged (offline) under the run id kept in run.json
    run_id = json.load(open(run / "run.json"))["wandb_id"]
    starts = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert len(starts) == 2 and all(s.endswith(f"-{run_id}") for s in starts), starts
    # the TensorBoard curve goes on in the same folder: the second start's events begin at epoch 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {}  # event file -> epochs of its reward_mean curve (accelerate also writes hparams into subfolders)
    for e in glob.glob(str(run / "**" / "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(e)
        acc.Reload()
        if "reward_mean" in acc.Tags()["scalars"]:
            steps[e] = sorted({ev.step for ev in acc.Scalars("reward_mean")})
    assert len({os.path.dirname(e) for e in steps}) == 1, steps  # one folder: TensorBoard shows one curve
    assert sorted(steps.values()) == [[0], [1]], steps


def _config(path):
    return types.SimpleNamespace(resume_from=str(path), pretrained=types.SimpleNamespace(model="tiny-t2i"),
                                 use_lora=False, lora_rank=8)


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


@pytest.mark.timeout(120)
def test_each_damaged_file_is_named(resumed, tmp_path):
    logdir, _ = resumed
    good = logdir / "r" / "checkpoints" / "checkpoint_00001"
    assert check_resume(_config(logdir / "r"), "ddim").endswith("checkpoint_00002")  # the newest, whole
    names = sorted(f for f in os.listdir(good) if os.path.isfile(good / f))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl",
            "run_meta.json"} <= set(names)
    for name in names:
        for keep in (0.5, 0.99):  # cut in the middle, and just the last bytes (a zip's directory, a tensor's end)
            ckpt = tmp_path / f"{name}-{keep}" / "checkpoint_00001"
            shutil.copytree(good, ckpt)
            _truncate(ckpt / name, keep)
            with pytest.raises(ConfigError) as e:
                check_resume(_config(ckpt), "ddim")
            msg = str(e.value)
            assert f"checkpoint file {ckpt / name} is damaged" in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="no such folder"):
        check_resume(_config(tmp_path / "nowhere"), "ddim")


@pytest.mark.timeout(180)
def test_missing_or_damaged_resume_is_one_line_before_anything_starts(resumed, tmp_path):
    logdir, _ = resumed
    bad = tmp_path / "bad" / "checkpoints" / "checkpoint_00001"
    shutil.copytree(logdir / "r" / "checkpoints" / "checkpoint_00001", bad)
    _truncate(bad / "optimizer.bin")
    out = tmp_path / "logs"
    jobs = [train(out, f"--config.resume_from={tmp_path / 'missing'}", "--config.num_epochs=2"),
            train(out, f"--config.resume_from={bad}", "--config.num_epochs=2")]
    missing, damaged = run_side_by_side(jobs)
    for p, text in ((missing, "no such folder"), (damaged, f"checkpoint file {bad / 'optimizer.bin'} is damaged")):
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and lines[-1].startswith(("error: resume_from", "error: checkpoint")), p.stderr[-2000:]
        assert text in lines[-1] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not out.exists()  # no run folder, no tracker started

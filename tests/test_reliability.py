"""Reliability: bad rewards are excluded and counted, failing plugins stop every process with their message,
checkpoints are atomic and refuse a mismatched config."""
import json
import os
import re
import subprocess
import sys
import types

import pytest

from ddpo_grpo.trainer.run.checkpointing import META, check_compatible, resolve_resume, save_checkpoint
from ddpo_grpo.errors import ConfigError
from helpers import cpu_env, launch_cmd, reward_plugin, run_side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.sample.num_steps=3", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
         "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
         "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.save_freq=0"]

PLUGIN = '''
import os
import numpy as np
from ddpo_grpo.worlds.toyworld.reward import make_toyworld_reward

def make(mode="nan"):
    base = make_toyworld_reward()

    def flaky(images, prompts, metadata):
        if mode == "raise" or (mode == "raise_rank1" and os.environ.get("RANK") == "1"):
            raise RuntimeError("the reward server is down")
        scores, details = base(images, prompts, metadata)
        scores = np.asarray(scores, dtype=np.float32).copy()
        if mode == "nan":
            scores[::3] = np.nan  # every third sample of each batch
        elif mode == "nan_all":
            scores[:] = np.inf
        return scores, details
    return flaky
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A reward plugin package found through the `ddpo_grpo.rewards` entry-point group, installed nowhere."""
    return reward_plugin(tmp_path_factory.mktemp("plugin"), "flaky", PLUGIN)


def train_job(tmp, plugin_path, mode, nproc=1, epochs=1):
    """subprocess.run arguments of one trainer run with the flaky reward in `mode`."""
    # One process runs the script directly, so its own exit code (2 for a clear error) is what we see;
    # accelerate launch reports any child failure as 1.
    cmd = launch_cmd(nproc, 29600) if nproc > 1 else [sys.executable]
    cmd += ["scripts/train.py", "--config", "config/grpo.py:tiny", f"--config.num_epochs={epochs}",
            f"--config.logdir={tmp}", "--config.run_name=r", "--config.reward.fns={'flaky': 1.0}",
            f"--config.reward.kwargs={{'flaky': {{'mode': '{mode}'}}}}", *SMALL]
    env = cpu_env(PYTHONPATH=plugin_path + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return dict(args=cmd, cwd=ROOT, env=env)


def train(tmp, plugin_path, mode, nproc=1, epochs=1):
    return subprocess.run(**train_job(tmp, plugin_path, mode, nproc, epochs), capture_output=True, text=True,
                          timeout=600)


# test -> (reward mode, epochs) of its single-process run
SINGLE = {"test_nan_rewards_are_excluded_counted_and_training_continues": ("nan", 2),
          "test_mostly_invalid_rewards_stop_with_a_clear_message": ("nan_all", 1),
          "test_raising_plugin_is_named": ("raise", 1)}


@pytest.fixture(scope="module")
def single_runs(request, tmp_path_factory, plugin_path):
    """{reward mode: finished process} of the single-process runs of the tests this session runs, side by side (one
    single-threaded process each)."""
    tests = [item.originalname for item in request.session.items
             if getattr(item, "module", None) is request.module and item.originalname in SINGLE]
    modes = {SINGLE[t] for t in tests}
    jobs = {mode: train_job(tmp_path_factory.mktemp(mode), plugin_path, mode, epochs=epochs) for mode, epochs in modes}
    return dict(zip(jobs, run_side_by_side(list(jobs.values()))))


def test_nan_rewards_are_excluded_counted_and_training_continues(single_runs):
    p = single_runs["nan"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "invalid rewards 4 excluded" in out  # 8 samples, scores[::3] NaN in each batch of 4: 2 per batch
    assert "epoch 1:" in out and "done in" in out


def test_mostly_invalid_rewards_stop_with_a_clear_message(single_runs):
    p = single_runs["nan_all"]
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: 8 of 8 rewards this epoch are invalid")


def test_raising_plugin_is_named(single_runs):
    p = single_runs["raise"]
    assert p.returncode == 2
    assert "error: reward 'flaky' failed: RuntimeError: the reward server is down" in p.stderr
    assert "Traceback" not in p.stderr


def test_plugin_failing_on_one_process_stops_all(tmp_path, plugin_path):
    p = train(tmp_path, plugin_path, "raise_rank1", nproc=2)
    assert p.returncode != 0
    assert "reward 'flaky' failed: RuntimeError: the reward server is down" in p.stderr


@pytest.fixture(autouse=True)
def _no_export(monkeypatch):
    """The fake contexts below have no model: the export (tests/test_export.py) is not what these tests check."""
    from ddpo_grpo.trainer.run import checkpointing

    monkeypatch.setattr(checkpointing, "write_model_export", lambda ctx, family, out_dir: None)


def _fake_ctx(tmp_path, fail=False):
    """Just enough of a RunContext for save_checkpoint: an accelerator whose save_state can die midway."""

    class Acc:
        is_main_process = True

        def wait_for_everyone(self):
            pass

        def save_state(self, path):
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "model.safetensors"), "w") as f:
                f.write("half" if fail else "full")
            if fail:
                raise KeyboardInterrupt("killed while saving")

    cfg = types.SimpleNamespace(pretrained=types.SimpleNamespace(model="tiny-t2i"), use_lora=False, lora_rank=8,
                                num_checkpoint_limit=3)
    return types.SimpleNamespace(accelerator=Acc(), run_dir=str(tmp_path), config=cfg,
                                 state=types.SimpleNamespace(epoch=0))


def test_checkpoint_is_atomic_and_newest_complete_one_is_resumed(tmp_path):
    ctx = _fake_ctx(tmp_path)
    ctx.state.epoch = 1
    first = save_checkpoint(ctx, "ddim")
    ctx = _fake_ctx(tmp_path, fail=True)
    ctx.state.epoch = 2
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ctx, "ddim")
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == [".tmp-checkpoint_00002", "checkpoint_00001"]
    assert resolve_resume(str(tmp_path)) == first  # the half-written one is invisible
    assert open(os.path.join(first, "model.safetensors")).read() == "full"
    ctx = _fake_ctx(tmp_path)
    ctx.state.epoch = 3
    third = save_checkpoint(ctx, "ddim")
    assert resolve_resume(str(tmp_path)) == third and not (root / ".tmp-checkpoint_00003").exists()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "nothing"))


def test_checkpoint_for_another_setup_is_refused(tmp_path):
    ctx = _fake_ctx(tmp_path)
    ctx.state.epoch = 1
    ckpt = save_checkpoint(ctx, "ddim")
    assert json.load(open(os.path.join(ckpt, META)))["use_lora"] is False
    lora_cfg = types.SimpleNamespace(pretrained=types.SimpleNamespace(model="tiny-t2i"), use_lora=True, lora_rank=8)
    with pytest.raises(ConfigError, match="use_lora: checkpoint False vs config True"):
        check_compatible(ckpt, lora_cfg, "ddim")
    with pytest.raises(ConfigError, match="family: checkpoint 'ddim' vs config 'flow'"):
        check_compatible(ckpt, ctx.config, "flow")


def test_resume_with_another_optimizer_layout_is_refused_and_old_checkpoints_read_as_defaults(tmp_path):
    """train.lr_multipliers and trainable_modules decide the optimizer's parameter groups, which the saved optimizer
    state must match group for group: a resume with other values is one ConfigError naming the field (accelerate's
    load would stop with its own error). The multipliers are compared as parse_lr_multipliers reads them, so the same
    layout written another way resumes. A checkpoint written before run_meta recorded them reads as the defaults, and
    one that stored the raw spec string is read by the same rule."""
    ctx = _fake_ctx(tmp_path)
    ctx.config.train = types.SimpleNamespace(lr_multipliers="cam_encoder.=10")
    ctx.config.trainable_modules = ("cam_encoder.", "projector.")
    ctx.state.epoch = 1
    ckpt = save_checkpoint(ctx, "flow")
    meta = json.load(open(os.path.join(ckpt, META)))
    assert meta["lr_multipliers"] == [["cam_encoder.", 10.0]]
    assert meta["trainable_modules"] == ["cam_encoder.", "projector."]
    check_compatible(ckpt, ctx.config, "flow")  # the same config resumes
    other = types.SimpleNamespace(**vars(ctx.config))
    other.train = types.SimpleNamespace(lr_multipliers=" cam_encoder. = 10.0 ,")  # the same layout, spelt otherwise
    check_compatible(ckpt, other, "flow")
    for spec, shown in (("", r"\[\]"), ("cam_encoder.=3", r"\[\['cam_encoder.', 3.0\]\]"),
                        ("projector.=10,cam_encoder.=10", r"\[\['projector.', 10.0\], \['cam_encoder.', 10.0\]\]")):
        other.train = types.SimpleNamespace(lr_multipliers=spec)
        with pytest.raises(ConfigError,
                           match=rf"lr_multipliers: checkpoint \[\['cam_encoder.', 10.0\]\] vs config {shown}"):
            check_compatible(ckpt, other, "flow")
    other = types.SimpleNamespace(**vars(ctx.config))
    other.trainable_modules = ()
    with pytest.raises(ConfigError,
                       match=r"trainable_modules: checkpoint \['cam_encoder.', 'projector.'\] vs config \[\]"):
        check_compatible(ckpt, other, "flow")
    meta["lr_multipliers"] = "cam_encoder.=10.0"  # the raw spec, as the first run_meta with the field stored it
    json.dump(meta, open(os.path.join(ckpt, META), "w"))
    check_compatible(ckpt, ctx.config, "flow")
    for k in ("lr_multipliers", "trainable_modules"):  # an older checkpoint: the fields absent
        meta.pop(k)
    json.dump(meta, open(os.path.join(ckpt, META), "w"))
    plain = types.SimpleNamespace(**vars(ctx.config))
    plain.train, plain.trainable_modules = types.SimpleNamespace(lr_multipliers=""), ()
    check_compatible(ckpt, plain, "flow")
    with pytest.raises(ConfigError, match=r"lr_multipliers: checkpoint \[\] vs config \[\['cam_encoder.', 10.0\]\]"):
        check_compatible(ckpt, ctx.config, "flow")


def test_resume_with_other_registered_objects_is_one_clear_error(tmp_path):
    """A run saved without a KL reference, resumed with train.beta > 0 (or the other way round): one ConfigError
    naming the settings, before accelerate's load_state would stop on a bare count."""
    from ddpo_grpo.trainer.run.checkpointing import checkpointed_objects, load_checkpoint

    ctx = _fake_ctx(tmp_path)
    ctx.state.epoch = 1
    ckpt = save_checkpoint(ctx, "ddim")
    for i in range(2):  # run state, stat tracker: what a beta = 0 GRPO run saves
        open(os.path.join(ckpt, f"custom_checkpoint_{i}.pkl"), "w").close()
    loaded = []
    ctx.accelerator.load_state = loaded.append
    ctx.reference, ctx.old_policy = object(), None  # this config: train.beta > 0
    assert checkpointed_objects(ctx) == ["run state", "stat tracker", "KL reference (train.beta > 0)"]
    with pytest.raises(ConfigError, match=r"holds 2 saved run objects, this config 3 .*train\.beta"):
        load_checkpoint(ctx, ckpt)
    assert loaded == []
    ctx.reference, ctx.ema = None, object()  # this config: train.ema_decay > 0
    assert checkpointed_objects(ctx) == ["run state", "stat tracker", "EMA of the policy (train.ema_decay > 0)"]
    with pytest.raises(ConfigError, match=r"holds 2 saved run objects, this config 3 .*train\.ema_decay"):
        load_checkpoint(ctx, ckpt)
    ctx.ema = None
    assert load_checkpoint(ctx, ckpt) == ckpt and loaded == [ckpt]


def test_cfg_mismatch_stops_the_run_in_epoch_0(tmp_path):
    """A run that samples with CFG 3 and trains without it (train.cfg=False) stops in its first epoch, before any
    update, with one line (exit 2) naming the step, the sample and the likely causes; with
    train.onpolicy_check="warn" the same run says it and finishes."""
    base = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=2",
            f"--config.logdir={tmp_path}", "--config.sample.guidance_scale=3.0", "--config.train.cfg=False", *SMALL]
    stop = subprocess.run(base + ["--config.run_name=stop"], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert stop.returncode == 2, stop.stderr[-3000:]
    last = stop.stderr.strip().splitlines()[-1]
    assert last.startswith("error: on-policy check failed in epoch 0 before any update: |r - 1| = "), last
    assert "train.cfg=False" in last and "denoising step" in last and "Traceback" not in stop.stderr
    assert "epoch 0: reward" not in stop.stdout  # it stopped before the epoch's update and log line
    warn = subprocess.run(base + ["--config.run_name=warn", "--config.train.onpolicy_check=warn"], cwd=ROOT,
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert warn.returncode == 0, warn.stderr[-3000:]
    assert warn.stdout.count("warning: on-policy check failed in epoch 0") == 1
    assert "epoch 1: reward" in warn.stdout


def test_cfg_mismatch_stops_every_process_together(tmp_path):
    """Two processes (gloo): the worst |r - 1| is gathered before the verdict, so both stop with the same line at the
    same point (none is left waiting in the next collective) and the launch ends instead of hanging."""
    cmd = [*launch_cmd(2, 29800), "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=1",
           f"--config.logdir={tmp_path}", "--config.run_name=ddp", "--config.sample.guidance_scale=3.0",
           "--config.train.cfg=False", *SMALL]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    # Each process writes its line in one write, but torchrun's children share stderr: read the messages, not lines.
    errors = re.findall(r"error: (on-policy check failed in epoch 0 .*?continues anyway)", p.stderr)
    assert p.returncode != 0 and len(errors) == 2 and errors[0] == errors[1], p.stderr[-3000:]

"""The trainer end to end: 2 CPU processes (gloo) through `accelerate launch`, resume, exact resume after SIGKILL.
Single-process runs start scripts/train.py directly: `accelerate launch` would only put a launcher process (and its
imports) in front of it."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from helpers import cpu_env, launch_cmd
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.sample.num_steps=4", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
         "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
         "--config.logging.image_freq=0", "--config.logging.debug_dump=True", "--config.train.timestep_fraction=1.0"]


def start(tmp, name, epochs, nproc=1, extra=()):
    """A trainer run in the background, in a session of its own (so it can be killed whole); its output goes to
    tmp/<name>.out, a file: a run nobody reads while it runs never blocks on a full pipe."""
    # CPU (+ gloo for 2 processes) on any machine: these runs check the logic and exact resume, not the device.
    cmd = [*(launch_cmd(nproc, 29500) if nproc > 1 else [sys.executable]), "scripts/train.py",
           "--config", "config/grpo.py:tiny", f"--config.num_epochs={epochs}", f"--config.logdir={tmp}",
           f"--config.run_name={name}", *SMALL, *extra]
    with open(os.path.join(tmp, f"{name}.out"), "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc, tmp, name):
    """Wait for a run from start(); it must succeed. Returns its output."""
    proc.wait(timeout=600)
    with open(os.path.join(tmp, f"{name}.out")) as f:
        out = f.read()
    assert proc.returncode == 0, out[-4000:]
    return out


def launch(tmp, name, epochs, nproc=1, extra=()):
    return finish(start(tmp, name, epochs, nproc, extra), tmp, name)


def dumps(run_dir, epoch):
    files = sorted(glob.glob(os.path.join(run_dir, "debug", f"epoch_{epoch:04d}_rank_*.json")))
    return [json.load(open(f)) for f in files]


def test_two_processes_one_epoch(tmp_path):
    out = launch(tmp_path, "ddp", epochs=1, nproc=2)
    r0, r1 = dumps(tmp_path / "ddp", 0)
    keys_all = np.array(r0["keys_all"])
    # every condition got exactly k = 4 samples across the two processes
    _, counts = np.unique(keys_all, return_counts=True)
    assert len(keys_all) == 16 and (counts == 4).all() and len(counts) == 4
    # the gathered arrays are the processes' own samples in rank order, and both processes agree on them
    assert keys_all.tolist() == r0["keys"] + r1["keys"] == r1["keys_all"]
    np.testing.assert_array_equal(r0["rewards_all"], r0["rewards"] + r1["rewards"])
    np.testing.assert_array_equal(r0["advantages"] + r1["advantages"], r0["advantages_all"])
    # advantages recomputed by hand from the gathered rewards: per group (r - mean) / std
    rew, adv = np.array(r0["rewards_all"]), np.array(r0["advantages_all"])
    for key in np.unique(keys_all):
        g = rew[keys_all == key]
        expect = np.zeros_like(g) if g.std() <= 1e-4 else (g - g.mean()) / g.std()
        np.testing.assert_allclose(adv[keys_all == key], expect, rtol=1e-5, atol=1e-6)
    # after the update both processes hold identical weights, and they moved
    assert r0["weights_sum"] == r1["weights_sum"] and r0["weights_abs_sum"] == r1["weights_abs_sum"]
    assert "16 samples = 4 conditions x k=4 (exact)" in out


def _final_weights(run_dir):
    ckpts = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "checkpoint_*")))
    return load_file(os.path.join(ckpts[-1], "model.safetensors")), ckpts


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path):
    # The kill lands inside the lr warmup (2 optimizer steps per epoch, 5 warmup steps): the scheduler state, the
    # condition subset and the per-condition initial noise must all come back identical.
    # The JPEG term gives the k copies of a condition different rewards: with the toy-world score alone they tie
    # (shared x_T), every advantage is 0, the weights never move, and a wrong optimizer or lr state after the resume
    # could not show.
    extra = ["--config.save_freq=1", "--config.train.lr_warmup_steps=5", "--config.sample.shared_init_noise=True",
             "--config.data.num_conditions=6", "--config.reward.fns={'toyworld': 1.0, 'jpeg_compressibility': 1.0}"]
    # The uninterrupted run and the one to be killed side by side (one single-threaded process each).
    straight = start(tmp_path, "straight", epochs=3, extra=extra)
    proc = start(tmp_path, "killed", epochs=3, extra=extra)
    first = tmp_path / "killed" / "checkpoints" / "checkpoint_00001"
    # Into epoch 1 by a condition, not a sleep: checkpoint 1 written and epoch 1's samples drawn (its GRPO check line
    # comes after sampling, before the update). The deadline only guards a hang: a loaded machine just gets there later.
    deadline = time.monotonic() + 600
    while not (first.exists() and "epoch 1: GRPO check" in (tmp_path / "killed.out").read_text()) \
            and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists() and not (tmp_path / "killed" / "checkpoints" / "checkpoint_00003").exists()
    finish(straight, tmp_path, "straight")
    out = launch(tmp_path, "killed", epochs=3, extra=extra + [f"--config.resume_from={tmp_path / 'killed'}"])
    assert "resumed from" in out and "at epoch 1" in out
    a, _ = _final_weights(tmp_path / "straight")
    b, ckpts = _final_weights(tmp_path / "killed")
    assert os.path.basename(ckpts[-1]) == "checkpoint_00003"
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    moved = []
    for epoch in range(3):
        (s,), (k,) = dumps(tmp_path / "straight", epoch), dumps(tmp_path / "killed", epoch)
        assert s["rewards"] == k["rewards"] and s["weights_sum"] == k["weights_sum"], epoch
        assert any(s["advantages"]), epoch  # every epoch trains on something
        moved.append(s["weights_sum"])
    assert len(set(moved)) == 3  # the weights moved in every epoch, so the comparison above means something
    summary = json.load(open(tmp_path / "killed" / "summary.json"))
    assert [h["epoch"] for h in summary["history"]] == [0, 1, 2]


def test_bad_config_fails_fast_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.sample.k=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: sample.k=1")
    assert "Traceback" not in proc.stderr


def test_lora_with_ema_reference_kl_in_bf16(tmp_path):
    """peft LoRA adapters, KL to an EMA reference of the adapters only, bf16 autocast on the CPU."""
    # 3 sampling steps, the first of which is trained (std >= train.min_step_std): bf16 runs ~20x slower than fp32
    # on a CPU without bf16 units, and the checks below need 2 optimizer steps (8 samples / train.batch_size 4), not
    # more denoising steps.
    out = launch(tmp_path, "lora", epochs=1, extra=["--config.sample.num_steps=3", "--config.use_lora=True",
                                                     "--config.lora_rank=4",
                                                     "--config.train.beta=0.05", "--config.train.kl_type=gaussian",
                                                     "--config.train.reference_model_mixup_alpha=0.5",
                                                     "--config.mixed_precision=bf16", "--config.save_freq=1"])
    line = [ln for ln in out.splitlines() if ln.startswith("epoch 0: reward")][0]
    kl = float(line.split(" kl ")[1].split()[0])
    assert kl > 0  # after the epoch's first optimizer step the reference lags the adapters by the EMA
    ckpt = load_file(str(tmp_path / "lora" / "checkpoints" / "checkpoint_00001" / "model.safetensors"))
    assert any("lora" in k for k in ckpt)


def test_mistyped_field_is_one_plain_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny",
                           "--config.train.learnig_rate=1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ('error: --config: unknown config field \'learnig_rate\' '
                                                    '(Did you mean "learning_rate" instead of "learnig_rate"?)')

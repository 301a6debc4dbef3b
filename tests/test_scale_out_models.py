"""FSDP2 on the flow architectures: the trainer on sd3_tiny (SD3's MMDiT behind the PackedDenoiser wrapper) and
wan_tiny (Wan's video transformer, called directly), full fine-tune, under FSDP2 over 2 CPU processes (gloo,
tests/fsdp_cpu_train.py) against DDP over 2 processes on the same config and seeds: the same samples, rewards and
advantages, the same gradient norm, and the same trained weights. tests/test_scale_out.py does this for the SD UNet.

The SD3 case failed before models/base.py's DenoiserOutput was a dataclass: FSDP2 did not see the wrapper's output
tensor, never re-gathered the root's parameters for backward, and the first backward stopped with "setStorage: ...
storage of size 0"."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import cpu_env
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["sd3_tiny", "wan_tiny"]
LR = 1e-3  # both configs' train.learning_rate; the weight tolerance below is a fraction of one Adam step of it
SMALL = ["--config.use_lora=False", "--config.num_epochs=1", "--config.sample.num_steps=3",
         "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1", "--config.sample.k=4",
         "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
         "--config.logging.image_freq=0", "--config.logging.debug_dump=True",
         "--config.save_freq=1"]  # a checkpoint: under FSDP2 a sharded folder, the proof that it really sharded


def _run(tmp, model, fsdp, cache):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0"]  # torchrun picks a free port: parallel test sessions never collide
    if fsdp:
        cmd += ["--config_file", "config/accelerate/fsdp2.yaml", "tests/fsdp_cpu_train.py"]
    else:
        cmd += ["--multi_gpu", "scripts/train.py"]
    name = "fsdp" if fsdp else "ddp"
    cmd += ["--config", f"config/grpo.py:{model}", f"--config.logdir={tmp}", f"--config.run_name={name}", *SMALL]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT, DDPO_GRPO_TINY_CACHE=cache), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    return tmp / name


@pytest.fixture(scope="module", params=MODELS)
def runs(request, tmp_path_factory, cache):
    tmp = tmp_path_factory.mktemp(request.param)
    return _run(tmp, request.param, False, cache), _run(tmp, request.param, True, cache)


def _dumps(run):
    return [json.load(open(f)) for f in sorted(glob.glob(str(run / "debug" / "epoch_0000_rank_*.json")))]


def _transformer(folder):
    (path,) = glob.glob(os.path.join(folder, "transformer", "*.safetensors"))
    return load_file(path)


def test_fsdp2_samples_rewards_and_advantages_match_ddp(runs):
    ddp, fsdp = runs
    ckpt = fsdp / "checkpoints" / "checkpoint_00001"
    assert (ckpt / "pytorch_model_fsdp_0").is_dir() and not (ckpt / "model.safetensors").exists()  # really sharded
    assert (ddp / "checkpoints" / "checkpoint_00001" / "model.safetensors").exists()
    f, d = _dumps(fsdp), _dumps(ddp)
    assert [x["rank"] for x in f] == [x["rank"] for x in d] == [0, 1]
    for a, b in zip(f, d):
        # sampling ran through the sharded model (all-gathered per block): bit-identical to the replicated one
        for key in ("keys", "rewards", "advantages", "keys_all", "rewards_all", "advantages_all"):
            assert a[key] == b[key], (a["rank"], key)
        _, counts = np.unique(a["keys_all"], return_counts=True)
        assert (counts == 4).all() and len(a["keys_all"]) == 8  # 2 conditions x k=4 over both processes
        # every group normalised to std 1 (none all-equal): the update compared below has a real gradient
        assert abs(np.std(a["advantages_all"]) - 1) < 1e-3
    assert f[0]["weights_sum"] == f[1]["weights_sum"]  # whole-model checksum, identical on both ranks


def test_fsdp2_trains_the_same_weights_as_ddp(runs):
    ddp, fsdp = runs
    tf, td = (json.load(open(r / "summary.json"))["history"][0]["train"] for r in (fsdp, ddp))
    # Adam's step is invariant to a gradient's scale, so the weights alone would miss a wrong reduction (a sum for
    # a mean, a rank's gradient left out on a parameter that both ranks push the same way): the norm would not.
    assert td["grad_norm"] > 0
    np.testing.assert_allclose(tf["grad_norm"], td["grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(tf["policy_shift_kl"], td["policy_shift_kl"], rtol=1e-4)  # the update's effect
    base = json.load(open(fsdp / "export" / "export.json"))["base_model_path"]
    wf, wd, w0 = _transformer(fsdp / "export"), _transformer(ddp / "export"), _transformer(base)
    assert wf.keys() == wd.keys() == w0.keys()
    moved = np.concatenate([(wd[k] - w0[k]).abs().flatten().numpy() for k in wd])
    # One Adam step (the first: |update| = lr * |g| / (|g| + eps)) moves almost every weight by lr.
    assert np.median(moved) > 0.9 * LR and moved.max() < 1.01 * LR
    # Sharded reduce-scatter sums the gradients in another order than DDP's all-reduce: float32 rounding, which
    # Adam amplifies only where |g| is near eps (measured: 8e-7 on SD3, 5e-8 on Wan). 1e-5 is 1% of one step: a
    # weight FSDP2 did not train, or trained with another gradient's sign, is off by lr or more.
    diff = max((wf[k] - wd[k]).abs().max().item() for k in wf)
    assert diff < 1e-5, diff


def test_fsdp2_sees_the_tensor_in_every_wrappers_output():
    """SDXL's and FLUX's wrappers return the same DenoiserOutput as SD3's (both stopped in the first FSDP2 backward
    while it was a plain object, checked by hand): FSDP2's own output walk must find the tensor in it, or the root
    group gets no pre-backward all-gather."""
    import torch
    from torch.distributed.utils import _apply_to_tensors

    from ddpo_grpo.models import flux, sd3, sdxl
    from ddpo_grpo.models.base import DenoiserOutput

    assert sd3.DenoiserOutput is sdxl.DenoiserOutput is flux.DenoiserOutput is DenoiserOutput
    x = torch.ones(2, 3, requires_grad=True)
    seen = []
    out = _apply_to_tensors(lambda t: seen.append(t) or t * 2, DenoiserOutput(x))
    assert len(seen) == 1 and seen[0] is x
    assert type(out) is DenoiserOutput and torch.equal(out.sample, x * 2)  # rebuilt around what the hook returns

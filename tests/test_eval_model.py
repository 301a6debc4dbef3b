"""scripts/eval_model.py on a trained checkpoint's weights: loading the model's own weights changes nothing,
other weights change the images, held-out splits cycle through their conditions, bad weights are one line, exit 2."""
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from eval_model import evaluate_model  # noqa: E402


def test_weights_and_splits(tmp_path):
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.run.data import ToyWorldConditions

    unet = load_pipeline("tiny-t2i-noisy").unet
    own, nudged = tmp_path / "own.safetensors", tmp_path / "nudged.safetensors"
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(own))
    # a checkpoint's sampling_policy.safetensors holds only some tensors: the rest keep the model's values
    save_file({"conv_out.bias": unet.conv_out.bias.detach() + 0.5}, str(nudged))
    kw = dict(num_samples=6, steps=2, split="eval", objects="single")
    base, img0, prompts, _ = evaluate_model("tiny-t2i-noisy", **kw)
    same, img1, _, _ = evaluate_model("tiny-t2i-noisy", weights=str(own), **kw)
    _, img2, _, _ = evaluate_model("tiny-t2i-noisy", weights=str(nudged), **kw)
    assert torch.equal(img0, img1) and base == same and not torch.equal(img0, img2)
    held_out = ToyWorldConditions("eval", "single")
    assert prompts == [held_out[i % len(held_out)]["prompt"] for i in range(6)]
    assert len(held_out) == 32 and all(" and " not in p and "of a" not in p for p in prompts)


def test_bad_weights_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.safetensors"
    save_file({"no_such.weight": torch.zeros(2)}, str(bad))
    for path, msg in ((str(bad), "does not fit this model"), (str(tmp_path / "missing.safetensors"), "no such file")):
        p = subprocess.run([sys.executable, "scripts/eval_model.py", "--model", "tiny-t2i-noisy", "--num-samples", "2",
                            "--steps", "1", "--weights", path], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
        errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]  # (the loader's progress bars aside)
        assert p.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: --weights") and msg in errors[0], \
            p.stderr[-2000:]

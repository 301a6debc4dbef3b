"""The SD 1.5-shaped random-weight pipeline (`sd15-random`): its sizes, and one CPU epoch of the trainer on it at
64x64 (LoRA: full fine-tuning of 860 M parameters with Adam would need ~14 GB here)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.trainer.run.validate import validate_config
from ddpo_grpo.errors import ConfigError
from helpers import narrow_sd15

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_config(**pretrained):
    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo

    c = grpo.get_config("sd15_random_bench")
    for k, v in pretrained.items():
        setattr(c.pretrained, k, v)
    return c


def test_sd15_random_has_sd15_sizes_and_shapes():
    """Sizes and shapes, built on "meta" (the same modules without 1.07 G random weights: ~15 s here); the epoch test
    below runs the real build, its outputs finite (its reward and gradient)."""
    from ddpo_grpo.models import load_pipeline

    pipe = load_pipeline("sd15-random", device="meta", resolution=64)
    assert {p.device.type for m in (pipe.unet, pipe.text_encoder, pipe.vae) for p in m.parameters()} == {"meta"}
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert 850e6 < count(pipe.unet) < 870e6  # SD 1.5's UNet: 859.52 M
    assert 120e6 < count(pipe.text_encoder) < 126e6  # CLIP ViT-L/14 text tower: 123.06 M
    assert 80e6 < count(pipe.vae) < 87e6  # SD's VAE: 83.65 M
    assert pipe.family == "ddim" and pipe.sample_shape == (4, 8, 8)
    assert pipe.tokenizer.model_max_length == 77 and pipe.vae.config.scaling_factor == 0.18215
    s = pipe.scheduler.config
    assert (s.beta_start, s.beta_end, s.beta_schedule, s.prediction_type) == (0.00085, 0.012, "scaled_linear", "epsilon")
    with torch.no_grad():
        ids = pipe.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
        emb = pipe.text_encoder(ids.to("meta"))[0]
        assert emb.shape == (1, 77, 768)
        eps = pipe.unet(torch.randn(1, 4, 8, 8, device="meta"), torch.tensor([500], device="meta"),
                        encoder_hidden_states=emb).sample
        assert eps.shape == (1, 4, 8, 8)
        assert pipe.vae.decode(eps).sample.shape == (1, 3, 64, 64)


def test_sd15_random_is_seeded(monkeypatch):
    """The same weights every time (every process builds its own copy), whatever the caller's random state, which it
    leaves alone. Checked through the same builder on narrow configs: the seeding does not depend on the widths, and
    a second build of SD 1.5's 1.07 G parameters would cost more than the rest of the file's in-process tests."""
    from ddpo_grpo.models import sd15_random as sd

    narrow_sd15(monkeypatch, sd)
    weights = []
    for caller_seed in (1, 2):
        torch.manual_seed(caller_seed)
        state = torch.get_rng_state()
        pipe = sd.build_sd15_random(64)
        assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is untouched
        assert pipe.unet.config.block_out_channels == (32, 32, 64, 64)  # the narrow configs were used
        weights.append({f"{name}.{k}": v for name in ("unet", "text_encoder", "vae")
                        for k, v in getattr(pipe, name).state_dict().items()})
    a, b = weights
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model, res, match", [
    ("sd15-random", 100, "pretrained.resolution: resolution 100 must be a positive multiple of 64"),
    ("tiny-t2i", 64, "pretrained.resolution=64 applies to built models"),
])
def test_bad_resolution_is_one_line(model, res, match):
    c = bench_config(model=model, resolution=res)
    if model != "sd15-random":
        c.reward.fns = {"toyworld": 1.0}
    with pytest.raises(ConfigError, match=match):
        validate_config(c, num_processes=1)


def test_sd15_random_bench_config_validates_at_512():
    c = bench_config()
    assert c.pretrained.resolution == 512 and c.mixed_precision == "bf16" and c.use_lora and c.lora_rank == 8
    assert validate_config(c, num_processes=1) == "ddim"


def test_one_cpu_epoch_on_sd15_random_at_64px(tmp_path):
    cmd = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:sd15_random_bench",
           "--config.mixed_precision=no", "--config.pretrained.resolution=64", "--config.sample.num_steps=2",
           "--config.sample.batch_size=2", "--config.sample.num_batches_per_epoch=1", "--config.sample.k=2",
           "--config.train.batch_size=2", "--config.num_epochs=1", "--config.train.old_logprobs=sampling",
           "--config.logging.wandb=False", "--config.logging.tensorboard=False", "--config.logging.image_freq=0",
           f"--config.logdir={tmp_path}", "--config.run_name=r"]
    # glibc keeps the freed activation buffers mapped (TUNED_MALLOC, the Makefile's CPU_MALLOC, as `make demo` runs): a
    # 1 G-parameter build otherwise spends a quarter of its CPU faulting them back in
    from benchmarks.bench_runs import TUNED_MALLOC

    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
               **TUNED_MALLOC)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "epoch 0: GRPO check: 2 samples = 1 conditions x k=2 (exact)" in p.stdout
    (h,) = json.load(open(tmp_path / "r" / "summary.json"))["history"]
    assert h["samples"] == 2 and h["epoch"] == 0
    # at SD 1.5's shape too: sampling and training agree before the update (CFG 5, LoRA, DDIM eta 1: ratio 1 in
    # float32). The ratio's old log-probs are the sampler's (train.old_logprobs "sampling"), so r - 1 is the gap between
    # the sampler's calls and the training calls themselves, not a re-score's (1 by construction, and one more forward
    # per trained step on a 1 G-parameter build). The two samples' JPEG rewards (-kB) give the adapters a gradient.
    assert h["train"]["onpolicy_ratio_max_dev"] <= 1e-5 and h["train"]["grad_norm"] > 0 and h["reward_mean"] < 0

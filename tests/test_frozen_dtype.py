"""Frozen components under mixed precision (models.base.component_dtype, the one rule): a run in bf16 loads the text
encoders and the VAE in bf16 (Wan's VAE in float32, as diffusers' WanPipeline example), the trained denoiser in
float32 (accelerate's master weights); the trainer picks that dtype from accelerate's mixed_precision. Each tiny build
is loaded through its adapter's from_pretrained path as a user's folder would be, and encodes in bf16 on CPU."""
import pytest
import torch

from ddpo_grpo.models import load_pipeline
from ddpo_grpo.models.base import component_dtype, inner_model, run_dtype
from helpers import narrow_sd15

BF16, FP32 = torch.bfloat16, torch.float32
# model -> (frozen text encoders, VAE component name or None, expected VAE dtype in a bf16 run)
MODELS = {
    "tiny-t2i": (("text_encoder",), None, None),  # bundled, pixel space: no VAE
    "sdxl-tiny": (("text_encoder", "text_encoder_2"), "vae", BF16),
    "sd3-tiny": (("text_encoder", "text_encoder_2", "text_encoder_3"), "vae", BF16),
    "flux-tiny": (("text_encoder", "text_encoder_2"), "vae", BF16),
    "wan-tiny": (("text_encoder",), "vae", FP32),
}
PROMPTS = ["a red circle on the left", "a blue square"]
SIZE = {"wan-tiny": dict(resolution=32, num_frames=5)}  # the tiny transformer's rope covers 32 px, not 480x832


def dtypes(module):
    return {p.dtype for p in module.parameters()}


def test_the_rule():
    assert [run_dtype(m) for m in ("no", "", None, "bf16", "fp16")] == [FP32, FP32, FP32, BF16, torch.float16]
    for run in (FP32, BF16, torch.float16):
        assert component_dtype("denoiser", run) == FP32  # master weights stay float32
        assert component_dtype("denoiser", run, lora=True) == run  # a LoRA run's frozen base: the run's dtype
        assert component_dtype("text_encoder", run) == run
    kl = {"_class_name": "AutoencoderKL", "force_upcast": True}
    assert component_dtype("vae", BF16, kl) == BF16  # bf16 has float32's range: diffusers keeps it in bf16
    assert component_dtype("vae", torch.float16, kl) == FP32  # fp16 + force_upcast: SDXL's pipeline decodes in fp32
    assert component_dtype("vae", torch.float16, dict(kl, force_upcast=False)) == torch.float16
    assert component_dtype("vae", BF16, {"_class_name": "AutoencoderKLWan"}) == FP32
    with pytest.raises(ValueError, match="role 'unet'"):
        component_dtype("unet", BF16)


@pytest.fixture(scope="module")
def loaded(cache):
    """Each model loaded for a float32 run and for a bf16 run."""
    return {name: (load_pipeline(name, **SIZE.get(name, {})), load_pipeline(name, torch_dtype=BF16, **SIZE.get(name, {})))
            for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_run_loads_frozen_parts_in_bf16_and_the_denoiser_in_fp32(loaded, name):
    fp32, bf16 = loaded[name]
    encoders, vae, vae_dtype = MODELS[name]
    components = bf16.components or {"text_encoder": bf16.text_encoder, "vae": bf16.vae}
    for enc in encoders:
        assert dtypes(components[enc]) == {BF16}, enc
        assert dtypes((fp32.components or {"text_encoder": fp32.text_encoder})[enc]) == {FP32}, enc
    if vae:
        assert dtypes(components[vae]) == {vae_dtype}
    assert dtypes(inner_model(bf16.unet)) == {FP32} and dtypes(inner_model(fp32.unet)) == {FP32}
    # the same weights: the bf16 run's denoiser is the folder's float32 one, bit for bit
    a, b = inner_model(fp32.unet).state_dict(), inner_model(bf16.unet).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_encode_on_cpu_matches_fp32_to_bf16_precision(loaded, name):
    """The condition from bf16 encoders: in the denoiser's dtype (float32, an exact upcast), finite, and the float32
    encoders' condition to bf16 precision (a wrong dtype path, e.g. an encoder left in float32 or a condition in
    bf16, fails one of the two asserts); the denoiser takes it under bf16 autocast as the trainer calls it."""
    fp32, bf16 = loaded[name]
    with torch.no_grad():
        ref, got = fp32.encode(PROMPTS), bf16.encode(PROMPTS)
    assert got.dtype == FP32 and got.shape == ref.shape and torch.isfinite(got).all()
    scale = ref.abs().max()
    err = (got - ref).abs().max() / scale
    assert 0 < err < 0.05, float(err)  # bf16 has 8 significant bits: ~0.4 % per op, a few % through the layers
    assert torch.equal(got, got.to(BF16).to(FP32))  # the values are bf16's: the encoders really ran in bf16
    x = torch.randn(len(PROMPTS), *bf16.sample_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        out = bf16.unet(x, torch.full((len(PROMPTS),), 500.0), encoder_hidden_states=got).sample
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_trainer_loads_by_the_runs_mixed_precision(cache, tmp_path):
    """build_context's load dtype is accelerate's mixed_precision: with bf16 (forced on CPU) the frozen encoders and
    VAE are bf16, and, sd3_tiny training LoRA, the frozen base transformer bf16 with the adapters float32 (diffusers'
    cast_training_params), the cached empty-prompt condition in the base's bf16; the sampler's decode runs the bf16
    VAE under the run's autocast. (Full fine-tuning keeps a float32 denoiser: tests/test_memory_switches.py.)"""
    import os
    import sys

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.trainer.run.build import build_context

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config"))
    import grpo

    config = grpo.get_config("sd3_tiny")
    config.mixed_precision = "bf16"
    config.logging.wandb = config.logging.tensorboard = False
    # accelerate's state is process-wide: an Accelerator made by an earlier test (fp32) would refuse bf16, and a bf16
    # state left behind would put later tests under bf16 autocast. Start from, and leave, a clean state.
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    ctx = build_context(config, acc, str(tmp_path))
    try:
        c = ctx.pipe.components
        assert {k: dtypes(c[k]) for k in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")} == {
            k: {BF16} for k in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
        named = list(acc.unwrap_model(ctx.unet).named_parameters())
        assert {p.dtype for n, p in named if p.requires_grad} == {FP32}
        assert all("lora_" in n for n, p in named if p.requires_grad) and any(p.requires_grad for n, p in named)
        assert {p.dtype for n, p in named if not p.requires_grad} == {BF16}
        assert ctx.neg_embed.dtype == BF16
        with torch.no_grad(), acc.autocast():
            images = decode(ctx.pipe.vae, torch.randn(2, *ctx.pipe.sample_shape))
        assert images.dtype == FP32 and images.shape == (2, 3, 32, 32) and torch.isfinite(images).all()
    finally:
        ctx.rewards.shutdown()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_wan_vae_decodes_in_float32_under_bf16_autocast(loaded):
    """Wan's VAE is kept in float32 (as WanPipeline's example loads it) and decode runs it outside the trainer's bf16
    autocast, in its own dtype, as WanPipeline decodes: the frames equal a float32 decode without autocast, bit for
    bit. The same VAE called under the autocast runs its convolutions in bf16 and gives other frames: what the
    decode keeps out."""
    from ddpo_grpo.core.pipeline_with_logprob import decode

    pipe = loaded["wan-tiny"][1]  # the bf16 run's pipeline: the VAE is its float32 one
    assert dtypes(pipe.vae) == {FP32}
    latents = torch.randn(2, *pipe.sample_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = decode(pipe.vae, latents)
        with torch.autocast("cpu", dtype=BF16):
            got = decode(pipe.vae, latents)
            leaked = pipe.vae.decode(latents, return_dict=False)[0]
        plain = pipe.vae.decode(latents, return_dict=False)[0]
    assert got.dtype == FP32 and got.shape == (2, 5, 3, 32, 32) and torch.isfinite(got).all()
    assert torch.equal(got, ref)
    assert leaked.dtype == BF16 and not torch.equal(leaked.float(), plain)  # the autocast would have reached the VAE


# built model -> component name -> its dtype in a bf16 run (the rule; Wan's VAE float32). Built on "meta": shapes only.
BUILT_BF16 = {
    "sd15-random": {"unet": FP32, "text_encoder": BF16, "vae": BF16},
    "sdxl-random": {"unet": FP32, "text_encoder": BF16, "text_encoder_2": BF16, "vae": BF16},
    "sd35-medium-random": {"transformer": FP32, "text_encoder": BF16, "text_encoder_2": BF16, "text_encoder_3": BF16,
                           "vae": BF16},
    "flux-dev-random": {"transformer": FP32, "text_encoder": BF16, "text_encoder_2": BF16, "vae": BF16},
    "wan21-1.3b-random": {"transformer": FP32, "text_encoder": BF16, "vae": FP32},
}


@pytest.mark.parametrize("name", list(BUILT_BF16))
def test_built_models_load_by_the_rule(name):
    """load_pipeline's built models (models.BUILT, sd15-random and the real-shape builds) take the run's dtype as a
    folder does: the denoiser float32, the frozen parts in the run's dtype; torch's default dtype is restored."""
    from ddpo_grpo.models import BUILT

    pipe = load_pipeline(name, torch_dtype=BF16, device="meta")
    parts = pipe.components or {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "vae": pipe.vae}
    got = {k: dtypes(m) for k, m in parts.items() if isinstance(m, torch.nn.Module)}
    assert got == {k: {d} for k, d in BUILT_BF16[name].items()}
    assert dtypes(inner_model(pipe.unet)) == {FP32} and pipe.family == BUILT[name]
    assert torch.get_default_dtype() == FP32


def test_sd15_random_fp16_and_fp32_runs():
    """fp16: SD's VAE config says force_upcast, so it stays float32 (the encoder fp16); float32 runs: all float32."""
    fp16, fp32 = (load_pipeline("sd15-random", torch_dtype=d, device="meta") for d in (torch.float16, FP32))
    assert [dtypes(m) for m in (fp16.unet, fp16.text_encoder, fp16.vae)] == [{FP32}, {torch.float16}, {FP32}]
    assert [dtypes(m) for m in (fp32.unet, fp32.text_encoder, fp32.vae)] == [{FP32}] * 3


def test_sd15_random_bf16_run_has_the_float32_runs_unet(monkeypatch):
    """The bf16 run's UNet is the float32 run's, bit for bit (built first from the seed, in float32), and the text
    encoder the float32 run's to bf16 precision. On narrow configs: the seeding and dtypes do not depend on widths."""
    from ddpo_grpo.models import sd15_random as sd

    narrow_sd15(monkeypatch, sd)
    fp32, bf16 = (load_pipeline("sd15-random", torch_dtype=d, resolution=64) for d in (FP32, BF16))
    a, b = fp32.unet.state_dict(), bf16.unet.state_dict()
    assert a.keys() == b.keys() and all(b[k].dtype == FP32 and torch.equal(a[k], b[k]) for k in a)
    assert dtypes(bf16.text_encoder) == {BF16} and dtypes(bf16.vae) == {BF16}
    with torch.no_grad():
        ref, got = fp32.encode(PROMPTS), bf16.encode(PROMPTS)
    assert got.dtype == FP32 and torch.equal(got, got.to(BF16).to(FP32))  # the encoder ran in bf16
    assert 0 < ((got - ref).abs().max() / ref.abs().max()) < 0.05


def test_real_shape_builds_are_refused_on_cpu():
    from ddpo_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="^flux-dev-random is a real-shape build .* runs on a GPU; on a CPU use"):
        load_pipeline("flux-dev-random", torch_dtype=BF16)

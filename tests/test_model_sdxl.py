"""SDXL (StableDiffusionXLPipeline) end to end: the `sdxl-tiny` build loads in plain diffusers and through our loader,
our condition is exactly the pipeline's (encode_prompt, pooled embeds, time ids, the zero empty-prompt negative) and
our denoiser call its UNet call; `sdxl_tiny` trains 2 epochs with LoRA and with full fine-tuning, on-policy ratio
exactly 1; each export, loaded by plain diffusers in a fresh process, reproduces the trained policy's deterministic
(DDIM eta 0, guided) sample. Also the SDXL base-shaped random build, on the meta device."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import cpu_env, policy_from_checkpoint, train_modes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
GUIDANCE = 4.0  # not StableDiffusionXLPipeline's default (5.0): an export that lost it would fail
RUN = ["--config.sample.num_steps=4", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
       "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.logging.image_freq=0",
       f"--config.sample.guidance_scale={GUIDANCE}",
       "--config.num_epochs=2", "--config.save_freq=1", "--config.num_checkpoint_limit=5",
       "--config.train.learning_rate=3e-3", "--config.lora_rank=4"]
MODES = {"lora": ["--config.use_lora=True"], "full": ["--config.use_lora=False"]}
PROMPTS = ["a red circle on the left", "a blue square in the middle", "a green triangle on the right"]

# Plain diffusers, nothing of ours, and nothing passed by hand but the prompts and seeds: the export's own files and
# export.json decide what is loaded and how it samples (the export's DDIM scheduler, a LoRA's too: the base folder
# holds Euler; steps, CFG, size, eta from pipeline_call), the noise one seeded generator per sample as eval draws it.
# The deterministic sample twice: a DDIM loop over the pipeline's UNet call (added_cond_kwargs, [negative, prompt]
# guidance rows), and the stock pipeline's own __call__.
PLAIN = r'''
import json, sys, torch, diffusers
from diffusers import StableDiffusionXLPipeline
data = torch.load(sys.argv[1])
prompts = data["prompts"]
results = {}
for export in sys.argv[2:]:
    info = json.load(open(f"{export}/export.json"))
    call = info["pipeline_call"]
    scheduler = getattr(diffusers, info["scheduler"]).from_pretrained(export, subfolder="scheduler")
    pipe = StableDiffusionXLPipeline.from_pretrained(info["base_model_path"] if info["lora"] else export,
                                                     scheduler=scheduler, local_files_only=True)
    if info["lora"]:
        pipe.load_lora_weights(export)
    g, size = call["guidance_scale"], (call["height"], call["width"])
    gens = lambda: [torch.Generator().manual_seed(s) for s in data["seeds"]]
    with torch.no_grad():
        emb, neg, pooled, neg_pooled = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=True)
        time_ids = pipe._get_add_time_ids(size, (0, 0), size, dtype=emb.dtype,
                                          text_encoder_projection_dim=pooled.shape[-1]).repeat(2 * len(prompts), 1)
        added = {"text_embeds": torch.cat([neg_pooled, pooled]), "time_ids": time_ids}
        pipe.scheduler.set_timesteps(call["num_inference_steps"])
        shape = (pipe.unet.config.in_channels, size[0] // pipe.vae_scale_factor, size[1] // pipe.vae_scale_factor)
        x = torch.stack([torch.randn(shape, generator=gen) for gen in gens()])
        for t in pipe.scheduler.timesteps:
            out = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([neg, emb]),
                            added_cond_kwargs=added).sample
            uncond, cond = out.chunk(2)
            x = pipe.scheduler.step(uncond + g * (cond - uncond), t, x, eta=call["eta"]).prev_sample
        loop = (pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
        result = pipe(prompts, generator=gens(), output_type="pt", **call).images
    results[export] = {"loop": loop, "call": result, "scheduler": type(pipe.scheduler).__name__,
                       "neg_zero": bool(neg.abs().max() == 0 and neg_pooled.abs().max() == 0)}
results["loaded"] = sorted(m for m in sys.modules if m.startswith("ddpo"))
torch.save(results, data["out"])
'''


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A fresh tiny-build cache for this module (a stale sdxl-tiny of an older build is never used), also for the
    trainer subprocesses (DDPO_GRPO_TINY_CACHE); the build is made here, once."""
    import ddpo_grpo.models as models

    cache = str(tmp_path_factory.mktemp("tiny_builds"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "TINY_CACHE", cache)
        models.tiny_build("sdxl-tiny")
        yield cache


@pytest.fixture(scope="module")
def runs(tiny_cache, tmp_path_factory):
    """A 2-epoch sdxl_tiny run per mode (checkpoints after epochs 1 and 2), side by side."""
    tmp = tmp_path_factory.mktemp("sdxl_runs")
    return train_modes(tmp, "sdxl_tiny", tiny_cache, RUN, MODES)


def test_tiny_build_loads_in_diffusers_and_ours_with_the_pipelines_condition(tiny_cache):
    from diffusers import (AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import unpack_condition
    from ddpo_grpo.models.sdxl import ADAPTER, SDXLDenoiser

    folder = os.path.join(tiny_cache, "sdxl-tiny")
    ref = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    assert isinstance(ref.unet, UNet2DConditionModel) and ref.unet.config.addition_embed_type == "text_time"
    assert isinstance(ref.text_encoder, CLIPTextModel) and isinstance(ref.text_encoder_2, CLIPTextModelWithProjection)
    assert isinstance(ref.vae, AutoencoderKL) and isinstance(ref.scheduler, EulerDiscreteScheduler)
    assert ref.config.force_zeros_for_empty_prompt is True

    pipe = load_pipeline("sdxl-tiny")
    assert pipe.adapter is ADAPTER and pipe.family == "ddim" and isinstance(pipe.unet, SDXLDenoiser)
    assert isinstance(pipe.scheduler, DDIMScheduler) and pipe.scheduler.config.set_alpha_to_one is False
    assert pipe.scheduler.config.prediction_type == "epsilon"
    assert pipe.resolution == 32 and tuple(pipe.sample_shape) == (4, 8, 8)

    with torch.no_grad():
        emb, neg, pooled, neg_pooled = ref.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=True)
        cond, empty = pipe.encode(PROMPTS), pipe.encode([""])
    assert cond.shape == (3, 16 + 1, 64)  # 16 tokens of 32 + 32 channels, one packed row: pooled 32 + 6 time ids
    seq, (p, time_ids) = unpack_condition(cond, (32, 6))
    assert torch.equal(seq, emb) and torch.equal(p, pooled)
    assert time_ids.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 3  # original size, crop (0, 0), target size
    # the CFG negative: zeros, as the pipeline's (force_zeros_for_empty_prompt), with the prompt's time ids
    eseq, (ep, etime) = unpack_condition(empty, (32, 6))
    assert neg.abs().max() == 0 and neg_pooled.abs().max() == 0
    assert eseq.abs().max() == 0 and ep.abs().max() == 0 and etime.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]

    # our denoiser call is the pipeline's UNet call with added_cond_kwargs (same weights: both loaded from the folder)
    x = torch.randn((3, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([999, 500, 20])
    with torch.no_grad():
        ours = pipe.unet(x, t, encoder_hidden_states=cond).sample
        theirs = ref.unet(x, t, encoder_hidden_states=emb, added_cond_kwargs={
            "text_embeds": pooled, "time_ids": torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 3)}).sample
        other_size = ref.unet(x, t, encoder_hidden_states=emb, added_cond_kwargs={
            "text_embeds": pooled, "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 3)}).sample
    assert torch.equal(ours, theirs)
    assert (other_size - theirs).abs().max() > 1e-4  # the time ids reach the output: the comparison above sees them


def test_resolution_other_than_native(tiny_cache):
    """pretrained.resolution: any multiple of the VAE x UNet downsampling (8 px here); the time ids follow it."""
    from ddpo_grpo.models import load_pipeline, resolve_model_path
    from ddpo_grpo.models.base import unpack_condition
    from ddpo_grpo.models.sdxl import ADAPTER

    path = resolve_model_path("sdxl-tiny")
    assert ADAPTER.check_resolution(path, 0) == "" and ADAPTER.check_resolution(path, 48) == ""
    assert "multiple of 8 px" in ADAPTER.check_resolution(path, 36)
    pipe = load_pipeline("sdxl-tiny", resolution=48)
    assert tuple(pipe.sample_shape) == (4, 12, 12)
    with torch.no_grad():
        cond = pipe.encode(["a red circle"])
        assert unpack_condition(cond, (32, 6))[1][1].tolist() == [[48.0, 48.0, 0.0, 0.0, 48.0, 48.0]]
        assert pipe.unet(torch.zeros(1, 4, 12, 12), torch.tensor([10]), encoder_hidden_states=cond).sample.shape \
            == (1, 4, 12, 12)


def test_sdxl_config_validates_on_a_folder(tiny_cache):
    """The `sdxl` config (real settings) takes a user's folder; an unsupported resolution is one ConfigError."""

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.models import resolve_model_path
    from ddpo_grpo.trainer.run.validate import validate_config

    from helpers import grpo_configs

    configs = grpo_configs()
    config = configs.get_config("sdxl")
    assert (config.use_lora, config.lora_rank, config.mixed_precision, config.gradient_checkpointing) == \
        (True, 32, "bf16", True)
    config.pretrained.model = resolve_model_path("sdxl-tiny")
    assert validate_config(config, 1) == "ddim"
    config.pretrained.resolution = 36
    with pytest.raises(ConfigError, match="pretrained.resolution: resolution 36"):
        validate_config(config, 1)


def test_real_shape_build_has_sdxl_base_sizes_without_memory():
    """SDXL base's shapes (parameter counts of stabilityai/stable-diffusion-xl-base-1.0), built on the meta device in
    bf16: no weights are allocated, and the caller's default dtype is restored."""
    from ddpo_grpo.models.sdxl import build_sdxl_random

    pipe = build_sdxl_random(device="meta")
    count = {k: sum(p.numel() for p in pipe.components[k].parameters())
             for k in ("unet", "text_encoder", "text_encoder_2", "vae")}
    assert count == {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840,
                     "vae": 83_653_863}
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in pipe.unet.parameters())
    assert torch.get_default_dtype() == torch.float32
    assert tuple(pipe.sample_shape) == (4, 128, 128) and pipe.unet.pooled_dim == 1280


def train_history(run):
    return json.load(open(run / "summary.json"))["history"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_training_is_on_policy(runs, mode):
    history = train_history(runs / mode)
    assert [h["epoch"] for h in history] == [0, 1]
    # the live check: the first inner epoch's ratio against the sampler's stored log-probs (measured: exactly 0.0)
    assert all(h["train"]["onpolicy_ratio_max_dev"] <= 1e-6 for h in history)


def trained_policy_sample(ckpt: str, lora: bool) -> torch.Tensor:
    """The trained policy, rebuilt from the checkpoint's training state as the trainer holds it, sampled
    deterministically (DDIM eta 0, guided by the empty prompt's condition) by our sampler, one seeded generator per
    sample as eval draws them."""
    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings

    pipe = policy_from_checkpoint("sdxl-tiny", ckpt, lora)
    with torch.no_grad():
        emb = pipe.encode(PROMPTS)
        neg = pipe.encode([""]).expand(len(PROMPTS), -1, -1)
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="ddim", eta=1.0,
                                                                            guidance_scale=GUIDANCE),
                                 emb, neg, num_inference_steps=STEPS, sample_shape=pipe.sample_shape, vae=pipe.vae,
                                 generator=[torch.Generator().manual_seed(s) for s in SEEDS], deterministic=True)
    return traj.images


SEEDS = [7, 8, 9]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_export_loads_in_plain_diffusers_and_reproduces_the_policy(runs, mode, tmp_path, tiny_cache):
    run = runs / mode
    ckpts = sorted((run / "checkpoints").glob("checkpoint_*"))
    assert [c.name for c in ckpts] == ["checkpoint_00001", "checkpoint_00002"]
    lora = mode == "lora"
    export_files = sorted(os.listdir(run / "export"))
    if lora:  # diffusers' SDXL LoRA file, not the whole peft-wrapped model, and the scheduler the run sampled with
        assert export_files == ["export.json", "pytorch_lora_weights.safetensors", "scheduler"]
        keys = list(load_file(str(run / "export" / "pytorch_lora_weights.safetensors")))
        assert keys and all(k.startswith("unet.") and ".lora_" in k and "base_layer" not in k for k in keys)
        assert {k.split(".")[-3] for k in keys} == {"to_q", "to_k", "to_v", "0"}  # to_out.0
    else:  # a complete StableDiffusionXLPipeline folder, written by save_pretrained
        assert export_files == ["export.json", "model_index.json", "scheduler", "text_encoder", "text_encoder_2",
                                "tokenizer", "tokenizer_2", "unet", "vae"]
        index = json.load(open(run / "export" / "model_index.json"))
        assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is True
    # the base folder holds SDXL's Euler config; the run sampled it as DDIM, which is what the export holds
    assert json.load(open(run / "export" / "scheduler" / "scheduler_config.json"))["_class_name"] == "DDIMScheduler"
    # the end of the run (epoch 2) and the checkpoint in the middle (epoch 1), in one plain process
    pairs = [(run / "export", ckpts[-1]), (ckpts[0] / "export", ckpts[0])]
    data, out = tmp_path / "data.pt", tmp_path / "out.pt"
    torch.save({"seeds": SEEDS, "prompts": PROMPTS, "out": str(out)}, data)
    p = subprocess.run([sys.executable, "-c", PLAIN, str(data), *(str(e) for e, _ in pairs)], cwd=str(tmp_path),
                       env=cpu_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out)
    assert got["loaded"] == []  # plain diffusers: nothing of ddpo_grpo was imported
    wants = []
    for export, ckpt in pairs:
        info = json.load(open(export / "export.json"))
        assert info["epoch"] == int(ckpt.name[-5:]) and info["pipeline_call"]["guidance_scale"] == GUIDANCE
        want = trained_policy_sample(str(ckpt), lora)
        wants.append(want)
        assert want.shape == (3, 3, 32, 32)
        res = got[str(export)]
        assert res["neg_zero"] and res["scheduler"] == "DDIMScheduler"  # the pipeline's negative is zeros, as ours
        assert (res["loop"] - want).abs().max().item() <= 1e-5  # measured ~1e-6
        assert (res["call"] - want).abs().max().item() <= 1e-5
    # the two checkpoints differ (training moved the model), so the comparison above could fail
    assert (wants[0] - wants[1]).abs().max().item() > 1e-3  # measured: LoRA 0.017, full 0.22

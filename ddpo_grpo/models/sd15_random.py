"""A Stable Diffusion 1.5-shaped pipeline built from configs with random weights: no download, nothing on disk.

For benchmarks at the scale users run (`pretrained.model = "sd15-random"`): the UNet2DConditionModel has SD 1.5's
config (~860 M parameters), the CLIP text encoder SD's size (123 M), the AutoencoderKL SD's shape (84 M), and the
DDIM scheduler SD's betas. What it draws is noise; its speed and memory are SD 1.5's. The tokenizer is a
word-level CLIP tokenizer over the models' vocabulary (SD's 49408-token BPE would need its vocabulary files): the
text encoder still has SD's 49408-row embedding, and prompts are padded to SD's 77 tokens, so its cost is SD's.
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from .sd import ADAPTER  # the built pipeline's architecture, and model_adapter's answer for a built model
from .vocabulary import vocabulary

NAME = "sd15-random"
NATIVE_RESOLUTION = 512  # pixels; latents are resolution / 8
SEED = 0  # fixed, not config.seed: every process (and every run) must build the same weights
SD_VOCAB_SIZE = 49408
SD_MAX_TOKENS = 77
EXTRA_WORDS = ("a", "photo", "of", "an", "animal", "cat", "dog", "horse", "the")


def check_resolution(resolution: int) -> str:
    """'' if `resolution` works, else why not: the VAE divides by 8 and the UNet's three downsamplings by 8 more."""
    if resolution <= 0 or resolution % 64:
        return (f"resolution {resolution} must be a positive multiple of 64 (latents are resolution/8 and the UNet "
                "halves them 3 times); e.g. 64 for a CPU smoke test, 512 for SD 1.5's own size")
    return ""


def sd15_unet_config(latent_size: int = NATIVE_RESOLUTION // 8) -> dict:
    """SD 1.5's UNet2DConditionModel config (runwayml/stable-diffusion-v1-5, unet/config.json) at a latent size."""
    return dict(
        sample_size=latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, norm_eps=1e-5, act_fn="silu",
        downsample_padding=1, flip_sin_to_cos=True, freq_shift=0, mid_block_scale_factor=1,
    )


def sd15_vae_config(resolution: int = NATIVE_RESOLUTION) -> dict:
    """SD 1.5's AutoencoderKL config: 8x downsampling to 4 latent channels, scaling factor 0.18215."""
    return dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
        act_fn="silu", sample_size=resolution, scaling_factor=0.18215,
    )


def sd15_scheduler() -> DDIMScheduler:
    """SD 1.5's noise schedule (scaled-linear betas 0.00085 -> 0.012, epsilon prediction) as a DDIMScheduler, as
    DDPO loads it; set_alpha_to_one=False keeps the last step stochastic, so it has a log-probability."""
    return DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         prediction_type="epsilon", clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                         timestep_spacing="leading")


def build_tokenizer() -> CLIPTokenizer:
    """A CLIPTokenizer with one token per word of the models' vocabulary (models/vocabulary.py: the toy-world prompt
    words) plus a few generic ones, padded to SD's 77 tokens."""
    from .tiny import clip_tokenizer

    return clip_tokenizer(list(vocabulary()) + list(EXTRA_WORDS), SD_MAX_TOKENS)


def sd15_text_config(tokenizer: CLIPTokenizer) -> CLIPTextConfig:
    """SD 1.5's text encoder (CLIP ViT-L/14's text tower): 12 layers, 768 wide, 49408-token embedding."""
    return CLIPTextConfig(vocab_size=SD_VOCAB_SIZE, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                          num_attention_heads=12, max_position_embeddings=SD_MAX_TOKENS, projection_dim=768,
                          hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_sd15_random(resolution: int = NATIVE_RESOLUTION, torch_dtype: torch.dtype = torch.float32,
                      device="cpu", denoiser_dtype: torch.dtype = None):
    """The SD 1.5-shaped pipeline with seeded random weights, as a LoadedPipeline (family "ddim").

    torch_dtype: the dtype the run computes in (models.base.run_dtype). Each module is built in models.base.
    component_dtype's choice for it, as the adapters load a folder: the UNet in float32 (the trained master weights;
    `denoiser_dtype` overrides), the frozen text encoder in torch_dtype, the VAE in torch_dtype (float32 in an fp16
    run: SD's VAE config says force_upcast). Images are (3, resolution, resolution); the sampler's latents
    (4, resolution/8, resolution/8). The modules are created on `device` directly in their dtype (initialising 1.1 G
    parameters on a GPU takes a fraction of the CPU's time, and no float32 copy of a bf16 module is ever held;
    "meta": shapes only), from a forked RNG seeded with SEED, so the caller's random state is untouched. The UNet is
    built first, so its weights are the same whatever torch_dtype.
    """
    from .base import LoadedPipeline, component_dtype, default_dtype, freeze

    why = check_resolution(resolution)
    if why:
        raise ValueError(why)
    device = torch.device(device)
    fork = [device.index or 0] if device.type == "cuda" else []
    tokenizer = build_tokenizer()
    vae_config = sd15_vae_config(resolution)
    with torch.random.fork_rng(devices=fork), device:
        torch.manual_seed(SEED)
        with default_dtype(denoiser_dtype or component_dtype("denoiser", torch_dtype)):
            unet = UNet2DConditionModel(**sd15_unet_config(resolution // 8))
        with default_dtype(component_dtype("text_encoder", torch_dtype)):
            text_encoder = CLIPTextModel(sd15_text_config(tokenizer))
        with default_dtype(component_dtype("vae", torch_dtype, dict(vae_config, _class_name="AutoencoderKL"))):
            vae = AutoencoderKL(**vae_config)
    freeze(unet, text_encoder, vae)  # (make_trainable unfreezes what the run trains)
    return LoadedPipeline(unet, text_encoder, tokenizer, sd15_scheduler(), vae, "ddim", NAME, adapter=ADAPTER)

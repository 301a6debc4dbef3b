"""Stable Diffusion XL (StableDiffusionXLPipeline): a UNet2DConditionModel with `addition_embed_type="text_time"`,
two CLIP text encoders (CLIPTextModel + CLIPTextModelWithProjection) and an AutoencoderKL; it samples with DDIM
(the folder's scheduler config, EulerDiscreteScheduler for SDXL base, loaded as a DDIMScheduler: base.load_scheduler).

The condition of a prompt is what the pipeline's own `encode_prompt` gives (both encoders' penultimate hidden
states side by side, (B, 77, 768 + 1280)), plus the UNet's two extra inputs packed into one extra row
(base.pack_condition): the second encoder's pooled projection (B, 1280) and the six `time_ids` (original size,
crop top-left (0, 0), target size: the pipeline's `_get_add_time_ids` at the sampled size, pipe.resolution: the
model's native one unless pretrained.resolution says otherwise).
`SDXLDenoiser` unpacks them and calls the UNet with `added_cond_kwargs={"text_embeds", "time_ids"}`, so the
trainer's `unet(x, t, encoder_hidden_states=cond)` and its [neg, cond] classifier-free-guidance rows work as for
Stable Diffusion. The empty prompt (the CFG negative, `pipe.encode([""])`) is zeros for the sequence and the pooled
embeds where the model's `force_zeros_for_empty_prompt` says so (SDXL base: yes), as the pipeline does; its time ids
are the prompt's.

Also here: `build_tiny(out_dir)` (the `sdxl-tiny` model: the real classes at test size, 32 x 32 px images) and
`build_sdxl_random` (SDXL base's shapes with random weights, for the GPU benchmark).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from ddpo_grpo.errors import ConfigError

from .adapter import ModelAdapter
from .base import DenoiserOutput, LoadedPipeline, PackedDenoiser, component_dtype, default_dtype, \
    folder_vae_dtype, freeze, load_scheduler, unpack_condition
from .tiny import clip_tokenizer
from .vocabulary import vocabulary

NUM_TIME_IDS = 6  # original (h, w), crop top-left (y, x), target (h, w)


class SDXLDenoiser(PackedDenoiser):
    """SDXL's UNet behind the UNet call: `cond` (B, L + 1, D) -> the sequence (B, L, D), the pooled text embeds and
    the time ids (base.unpack_condition), given to the UNet as `added_cond_kwargs`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        cfg = model.config
        time_dims = NUM_TIME_IDS * int(cfg.addition_time_embed_dim)
        self.pooled_dim = int(cfg.projection_class_embeddings_input_dim) - time_dims  # text_encoder_2's projection

    def forward(self, sample, timestep, encoder_hidden_states=None, **kwargs) -> DenoiserOutput:
        seq, (pooled, time_ids) = unpack_condition(encoder_hidden_states, (self.pooled_dim, NUM_TIME_IDS))
        out = self.model(sample, timestep, encoder_hidden_states=seq,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]
        return DenoiserOutput(out)


def _vae_scale_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 8  # as the pipeline


class SDXLAdapter(ModelAdapter):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"  # exports: its save_pretrained (full) and save_lora_weights (LoRA)
    # diffusers' SDXL LoRA recipe (train_dreambooth_lora_sdxl.py): the attention projections.
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    # The same wrap units as Stable Diffusion's UNet (config/accelerate/fsdp2.yaml's default line fits SDXL):
    # SDXL's 2.6 B parameters sit mostly in the 70 BasicTransformerBlocks of its 10-deep transformer stacks.
    fsdp_block_classes = ("ResnetBlock2D", "BasicTransformerBlock")

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, lora=False) -> LoadedPipeline:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        kw = dict(local_files_only=True)
        for sub in ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
            if not os.path.isdir(os.path.join(path, sub)):
                raise ConfigError(f"model {path!r} is a StableDiffusionXLPipeline without its {sub}/ folder")
        why = self.check_resolution(path, resolution)
        if why:
            raise ConfigError(f"pretrained.resolution: {why}")
        scheduler, family = load_scheduler(path)
        text_dtype = component_dtype("text_encoder", torch_dtype)
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=component_dtype(
            "denoiser", torch_dtype, lora=lora), **kw).to(device)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=folder_vae_dtype(path, torch_dtype),
                                            **kw).to(device)
        te = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=text_dtype, **kw).to(device)
        te2 = CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", torch_dtype=text_dtype,
                                                          **kw).to(device)
        tok = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
        tok2 = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2", **kw)
        with open(os.path.join(path, "model_index.json")) as f:
            force_zeros = bool(json.load(f).get("force_zeros_for_empty_prompt", True))
        return self.assemble(unet, vae, te, te2, tok, tok2, scheduler, family, path, force_zeros, resolution)

    def check_resolution(self, path: str, resolution: int) -> str:
        """'' if the model at `path` samples `resolution` px square images (0: its native size, 1024 for SDXL base),
        else why not: the VAE divides the size and the UNet halves the latents once per lower level. (SDXL was
        trained at about 1024^2 px in many aspect ratios: far smaller sizes give poor images.)"""
        if not resolution:
            return ""
        with open(os.path.join(path, "unet", "config.json")) as f:
            ucfg = json.load(f)
        with open(os.path.join(path, "vae", "config.json")) as f:
            vsf = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
        step = vsf * 2 ** (len(ucfg["block_out_channels"]) - 1)
        if resolution < 0 or resolution % step:
            size = ucfg["sample_size"] if isinstance(ucfg["sample_size"], int) else ucfg["sample_size"][0]
            return (f"resolution {resolution} must be a positive multiple of {step} px (VAE x UNet downsampling) for "
                    f"this SDXL model (native: {size * vsf} px)")
        return ""

    def assemble(self, unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler, family, path,
                 force_zeros_for_empty_prompt=True, resolution=0) -> LoadedPipeline:
        """A LoadedPipeline over SDXL's components (frozen here; the trainer makes the denoiser trainable). Images
        are `resolution` pixels square, 0: the model's native size (the UNet's sample_size x the VAE's factor)."""
        freeze(unet, vae, text_encoder, text_encoder_2)
        size = unet.config.sample_size
        size = size if isinstance(size, int) else size[0]
        resolution = int(resolution or size * _vae_scale_factor(vae))
        components = dict(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                          tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler)
        pipe = LoadedPipeline(SDXLDenoiser(unet), text_encoder, tokenizer, scheduler, vae, family, path, adapter=self,
                              components=components, resolution=resolution)
        pipe.__dict__["force_zeros_for_empty_prompt"] = bool(force_zeros_for_empty_prompt)
        return pipe

    def diffusers_pipeline(self, pipe, unet=None):
        """StableDiffusionXLPipeline over the loaded components (`unet`: another UNet, e.g. the exported one).
        No watermarker: the images are the model's own."""
        from diffusers import StableDiffusionXLPipeline

        c = pipe.components
        return StableDiffusionXLPipeline(
            vae=c["vae"], text_encoder=c["text_encoder"], text_encoder_2=c["text_encoder_2"], tokenizer=c["tokenizer"],
            tokenizer_2=c["tokenizer_2"], unet=unet if unet is not None else c["unet"], scheduler=pipe.scheduler,
            force_zeros_for_empty_prompt=pipe.__dict__.get("force_zeros_for_empty_prompt", True), add_watermarker=False)

    def encode(self, pipe, prompts: Sequence[str]) -> torch.Tensor:
        """(B, L + 1, D): encode_prompt's embeddings with the pooled embeds and time ids packed in the last row."""
        from .base import pack_condition

        sdxl = pipe.__dict__.get("_sdxl_pipeline")
        if sdxl is None:  # made once per pipe, for its encode_prompt and _get_add_time_ids
            sdxl = pipe.__dict__["_sdxl_pipeline"] = self.diffusers_pipeline(pipe)
        prompts = list(prompts)
        device = next(sdxl.text_encoder_2.parameters()).device
        seq, _, pooled, _ = sdxl.encode_prompt(prompts, device=device, do_classifier_free_guidance=False)
        if sdxl.config.force_zeros_for_empty_prompt:
            empty = torch.tensor([p == "" for p in prompts], device=device)
            seq = torch.where(empty[:, None, None], torch.zeros_like(seq), seq)
            pooled = torch.where(empty[:, None], torch.zeros_like(pooled), pooled)
        size = (pipe.resolution, pipe.resolution)
        time_ids = sdxl._get_add_time_ids(size, (0, 0), size, dtype=seq.dtype,
                                          text_encoder_projection_dim=int(pooled.shape[-1]))
        return pack_condition(seq, [pooled, time_ids.to(device).expand(len(prompts), -1)])

    def sample_shape(self, pipe) -> tuple:
        n = pipe.resolution // _vae_scale_factor(pipe.vae)
        return (pipe.unet.config.in_channels, n, n)

    def stock_pipeline(self, pipe, denoiser):
        return self.diffusers_pipeline(pipe, unet=denoiser)


ADAPTER = SDXLAdapter()


# ------------------------------------------------------------------------------------------------ the builds
def sdxl_scheduler_config() -> dict:
    """SDXL base's scheduler_config.json (EulerDiscreteScheduler; loaded here as DDIM: scaled-linear betas, epsilon
    prediction, set_alpha_to_one false so that the last DDIM step keeps a variance)."""
    return {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
            "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False,
            "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None,
            "use_karras_sigmas": False}


TINY_WORDS = ("a", "an", "the", "photo", "of")


def _words():
    """The builds' CLIP words: the models' vocabulary, then TINY_WORDS (in this order: the token ids follow it)."""
    return list(vocabulary()) + list(TINY_WORDS)


TINY_TOKENS = 16
TINY_RESOLUTION = 32  # pixels; latents (4, 8, 8)


def tiny_unet_config() -> dict:
    """SDXL's UNet layout at test size: text_time added embeddings, linear projections, cross-attention only in the
    lower block and the middle; cross_attention_dim = 32 + 32 (both encoders), pooled 32 + 6 time ids x 8."""
    return dict(
        sample_size=TINY_RESOLUTION // 4, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 1),
        attention_head_dim=(2, 4), cross_attention_dim=64, norm_num_groups=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + NUM_TIME_IDS * 8, flip_sin_to_cos=True, freq_shift=0,
    )


def build_tiny(out_dir: str) -> str:
    """The `sdxl-tiny` folder: StableDiffusionXLPipeline's real classes at test size with seeded random weights
    (UNet 1.0 M parameters, two 2-layer CLIP text encoders 32 wide, a 3-level VAE: 32 x 32 px images, (4, 8, 8)
    latents), tokenizers built here over the models' vocabulary (models/vocabulary.py), written by the pipeline's
    save_pretrained."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok = clip_tokenizer(_words(), TINY_TOKENS)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=TINY_TOKENS, projection_dim=32,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(**tiny_unet_config())
        te = CLIPTextModel(CLIPTextConfig(**text))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(**text))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                            block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                            up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=8,
                            sample_size=TINY_RESOLUTION, scaling_factor=0.13025)
    from diffusers import EulerDiscreteScheduler

    scheduler = EulerDiscreteScheduler.from_config(sdxl_scheduler_config())
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok,
                                     unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
                                     add_watermarker=False)
    pipe.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "scheduler", "scheduler_config.json"), "w") as f:  # SDXL base's file, as is
        json.dump(dict(sdxl_scheduler_config(), _diffusers_version=__import__("diffusers").__version__), f, indent=2)
    return out_dir


# Real shapes (stabilityai/stable-diffusion-xl-base-1.0's config files), random weights: for the GPU benchmark.
SDXL_RESOLUTION = 1024
SDXL_TOKENS = 77
SDXL_VOCAB_SIZE = 49408


def sdxl_unet_config(latent_size: int = SDXL_RESOLUTION // 8) -> dict:
    """SDXL base's unet/config.json (2.57 B parameters)."""
    return dict(
        sample_size=latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D",
                                                               "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20), cross_attention_dim=2048, norm_num_groups=32, norm_eps=1e-5,
        use_linear_projection=True, addition_embed_type="text_time", addition_embed_type_num_heads=64,
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, flip_sin_to_cos=True, freq_shift=0,
        act_fn="silu", downsample_padding=1,
    )


def sdxl_vae_config(resolution: int = SDXL_RESOLUTION) -> dict:
    """SDXL's AutoencoderKL (8x downsampling, scaling factor 0.13025)."""
    return dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
                block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, act_fn="silu", sample_size=resolution,
                scaling_factor=0.13025, force_upcast=True)


def sdxl_text_configs(tokenizer):
    """CLIP ViT-L/14's text tower (768 wide, 12 layers) and OpenCLIP bigG's (1280 wide, 32 layers, projection 1280),
    with CLIP's 49408-token embedding."""
    from transformers import CLIPTextConfig

    ids = dict(vocab_size=SDXL_VOCAB_SIZE, max_position_embeddings=SDXL_TOKENS, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           projection_dim=768, hidden_act="quick_gelu", **ids),
            CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                           projection_dim=1280, hidden_act="gelu", **ids))


def build_sdxl_random(resolution: int = SDXL_RESOLUTION, torch_dtype: torch.dtype = torch.bfloat16,
                      device="cpu", denoiser_dtype: torch.dtype = None) -> LoadedPipeline:
    """The SDXL base-shaped pipeline with seeded random weights, as a LoadedPipeline (family "ddim"): UNet 2.57 B,
    text encoders 123 M + 695 M, VAE 84 M parameters; images of `resolution` pixels (a multiple of 32: the VAE divides
    by 8, the UNet halves twice). Every module is created directly on `device` in `torch_dtype` (the default
    dtype while building; the UNet in `denoiser_dtype` where given: float32 for training, base.component_dtype), so
    building one never holds a float32 copy of a bf16 module; device="meta" gives the shapes alone. The
    tokenizer is one token per vocabulary word (the real 49408-token BPE needs its files), padded to 77 tokens."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if resolution <= 0 or resolution % 32:
        raise ValueError(f"resolution {resolution} must be a positive multiple of 32 (latents are resolution/8 and "
                         "the UNet halves them twice)")
    device = torch.device(device)
    tok = clip_tokenizer(_words(), SDXL_TOKENS)
    cfg1, cfg2 = sdxl_text_configs(tok)
    fork = [device.index or 0] if device.type == "cuda" else []
    vae_config = sdxl_vae_config(resolution)
    with torch.random.fork_rng(devices=fork), device:
        torch.manual_seed(0)
        with default_dtype(denoiser_dtype or torch_dtype):
            unet = UNet2DConditionModel(**sdxl_unet_config(resolution // 8))
        with default_dtype(component_dtype("text_encoder", torch_dtype)):
            te = CLIPTextModel(cfg1)
            te2 = CLIPTextModelWithProjection(cfg2)
        with default_dtype(component_dtype("vae", torch_dtype, dict(vae_config, _class_name="AutoencoderKL"))):
            vae = AutoencoderKL(**vae_config)
    scheduler = DDIMScheduler.from_config(sdxl_scheduler_config())
    return ADAPTER.assemble(unet, vae, te, te2, tok, tok, scheduler, "ddim", "sdxl-random", True, resolution)

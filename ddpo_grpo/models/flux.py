"""FLUX.1 dev / schnell (FluxPipeline): a FluxTransformer2DModel (MMDiT double-stream + single-stream blocks) over
2x2-packed latents with rotary position ids (`img_ids`, `txt_ids`), conditioned on T5 token embeddings and CLIP's
pooled embedding, with a guidance embedding (dev: guidance-distilled) or none (schnell); an AutoencoderKL with 16
latent channels and a shift_factor; a FlowMatchEulerDiscreteScheduler (the flow family: Flow-GRPO's SDE).

- condition: the pipeline's own `encode_prompt`: T5's token embeddings (B, L, D) with CLIP's pooled embedding
  (B, P) packed into extra rows (base.pack_condition). T5's length is FluxPipeline's default (512), or the T5
  tokenizer's model_max_length where that is shorter (the tiny build's 16 tokens).
- denoiser: `FluxDenoiser` takes the sampler's unpacked latents (B, 16, h, w), packs them as FluxPipeline does
  (`_pack_latents`), builds the ids (`_prepare_latent_image_ids`), passes timestep / 1000 and the embedded guidance
  (dev), and unpacks the output to (B, 16, h, w). Packing is a permutation, so the flow step and its log-probability
  are those of the packed latents.
- embedded guidance: `pretrained.embedded_guidance` (FluxPipeline's `guidance_scale`, 3.5 by default), set on the
  denoiser by `configure`; schnell (no guidance embedding) ignores it. Our classifier-free guidance
  (`sample.guidance_scale`) stays 1.0: FLUX-dev is guidance-distilled.
- schedule: FluxPipeline sets sigmas = linspace(1, 1/n, n) shifted by mu, which depends on the image's token count
  (dynamic shifting). The run's resolution is fixed, so the loaded scheduler is the static-shift equivalent
  (`FluxStaticShiftScheduler`: shift = exp(mu), the exponential time shift; mu itself for the linear one) whose
  `set_timesteps(n)` gives FluxPipeline's sigmas. The export keeps the folder's own (dynamic) scheduler, so
  `FluxPipeline(height=width=resolution)` reproduces the schedule.
- resolution: `pretrained.resolution` (pixels, a multiple of 16 for FLUX.1; 0: the VAE config's sample_size,
  1024 for FLUX.1): the transformer has no sample size.

To sample a trained export with plain diffusers as the run sampled: `FluxPipeline.from_pretrained(export)` (full) or
the base folder + `load_lora_weights(export)` (LoRA), then `pipe(prompt, **export.json["pipeline_call"])`: height =
width = res, num_inference_steps, guidance_scale = the embedded guidance, max_sequence_length (pipeline_call).

`build_tiny(out_dir)`: the same classes at test size ("flux-tiny", 32x32 px). `build_flux_dev_random`: FLUX.1-dev's
shapes with seeded random weights for GPU benchmarks, made directly on the device in the target dtype (or on the
meta device), never two copies.
"""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np
import torch

from ddpo_grpo.core.families import FlowFamily

from .adapter import ModelAdapter
from .base import DenoiserOutput, LoadedPipeline, PackedDenoiser, component_dtype, default_dtype, \
    folder_vae_dtype, freeze, pack_condition, unpack_condition
from .tiny import clip_tokenizer, t5_tokenizer
from .vocabulary import vocabulary

EMBEDDED_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale (FLUX.1-dev's recommended value)
T5_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default max_sequence_length
COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")


# -------------------------------------------------------------------------------------------------- denoiser
def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): FluxPipeline._pack_latents."""
    from diffusers import FluxPipeline

    B, C, h, w = x.shape
    return FluxPipeline._pack_latents(x, B, C, h, w)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w), the inverse of pack_latents (FluxPipeline._unpack_latents in latent
    units rather than pixels)."""
    B, _, D = x.shape
    x = x.view(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, D // 4, h, w)


class FluxDenoiser(PackedDenoiser):
    """FluxTransformer2DModel behind the UNet call: latents (B, C, h, w), timestep (B,) on the scheduler's 0..1000
    scale, `encoder_hidden_states` the packed condition (B, L + r, D) -> velocity (B, C, h, w). `guidance` is the
    embedded guidance passed where the model has a guidance embedding (FLUX.1-dev), as FluxPipeline passes it."""

    def __init__(self, model: torch.nn.Module, guidance: float = EMBEDDED_GUIDANCE):
        super().__init__(model)
        self.guidance = float(guidance)

    def forward(self, sample, timestep, encoder_hidden_states=None, **kwargs) -> DenoiserOutput:
        from diffusers import FluxPipeline

        cfg = self.model.config
        seq, (pooled,) = unpack_condition(encoder_hidden_states, [cfg.pooled_projection_dim])
        B, _, h, w = sample.shape
        timestep = timestep.expand(B) if timestep.ndim == 0 else timestep
        img_ids = FluxPipeline._prepare_latent_image_ids(B, h // 2, w // 2, sample.device, seq.dtype)
        txt_ids = torch.zeros(seq.shape[1], 3, device=sample.device, dtype=seq.dtype)
        guidance = (torch.full((B,), self.guidance, device=sample.device, dtype=torch.float32)
                    if cfg.guidance_embeds else None)
        out = self.model(hidden_states=pack_latents(sample), timestep=timestep.to(sample.dtype) / 1000,
                         guidance=guidance, pooled_projections=pooled, encoder_hidden_states=seq, txt_ids=txt_ids,
                         img_ids=img_ids, return_dict=False)[0]
        return DenoiserOutput(unpack_latents(out, h, w))

    def set_attn_processor(self, processor) -> None:
        """unet_attention="math" passes diffusers' generic AttnProcessor, which FLUX's attention (rotary embeddings,
        joint text/image streams) cannot run: the FLUX processors stay and compute attention with plain matmuls
        (diffusers' "_native_math" attention backend) instead of the fused kernel."""
        from diffusers.models.attention_processor import AttnProcessor

        if type(processor) is AttnProcessor:
            self.model.set_attention_backend("_native_math")
        else:
            self.model.set_attn_processor(processor)


# -------------------------------------------------------------------------------------------------- schedule
def _static_shift_class():
    from diffusers import FlowMatchEulerDiscreteScheduler

    class FluxStaticShiftScheduler(FlowMatchEulerDiscreteScheduler):
        """FluxPipeline's schedule at one resolution: `set_timesteps(n)` takes FluxPipeline's base sigmas
        linspace(1, 1/n, n) (where no sigmas or timesteps are given) and shifts them by the static shift."""

        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            if num_inference_steps and sigmas is None and timesteps is None:
                sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
            super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)

    return FluxStaticShiftScheduler


def image_seq_len(resolution: int, vae_scale: int) -> int:
    """The transformer's image tokens at `resolution` px: (resolution / vae_scale / 2) ** 2."""
    return (resolution // (vae_scale * 2)) ** 2


def static_shift(scheduler_config: dict, resolution: int, vae_scale: int) -> float:
    """The static shift equal to FluxPipeline's dynamic one at `resolution` px: mu from the image token count
    (diffusers' calculate_shift), exp(mu) for the exponential time shift, mu for the linear one; the config's own
    shift where it does not shift dynamically (FLUX.1-schnell)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = scheduler_config
    if not c.get("use_dynamic_shifting", False):
        return float(c.get("shift", 1.0))
    mu = calculate_shift(image_seq_len(resolution, vae_scale), c.get("base_image_seq_len", 256),
                         c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    return math.exp(mu) if c.get("time_shift_type", "exponential") == "exponential" else float(mu)


def static_scheduler(scheduler, resolution: int, vae_scale: int):
    """The run's scheduler: `scheduler` (the folder's) as a FluxStaticShiftScheduler with its static shift."""
    cfg = dict(scheduler.config)
    cfg.update(use_dynamic_shifting=False, shift=static_shift(cfg, resolution, vae_scale))
    return _static_shift_class().from_config(cfg)


# --------------------------------------------------------------------------------------------------- adapter
def _read_config(path: str, sub: str, name: str = "config.json") -> dict:
    with open(os.path.join(path, sub, name)) as f:
        return json.load(f)


def vae_scale_factor(vae_config) -> int:
    """FluxPipeline's vae_scale_factor: 2 ** (len(block_out_channels) - 1) (8 for FLUX.1)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


class FluxAdapter(ModelAdapter):
    name = "flux"
    pipeline_class = "FluxPipeline"  # exports: its save_pretrained (full) and save_lora_weights (LoRA)
    dynamic_shift = True  # static_scheduler: FluxPipeline's mu at the run's resolution
    components = COMPONENTS
    denoiser_folder = "transformer"
    lora_prefix = "transformer"
    # diffusers' train_dreambooth_lora_flux.py targets: the attention projections of both streams (the single
    # blocks' to_q/k/v included) and the double blocks' feed-forwards.
    lora_target_modules = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                           "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                           "ff_context.net.0.proj", "ff_context.net.2")
    fsdp_block_classes = ("FluxTransformerBlock", "FluxSingleTransformerBlock")

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, lora=False) -> LoadedPipeline:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        from ddpo_grpo.errors import ConfigError

        missing = [c for c in COMPONENTS if not os.path.isdir(os.path.join(path, c))]
        if missing:
            raise ConfigError(f"model {path!r} is a FluxPipeline folder without {', '.join(missing)}/; it needs "
                              f"{', '.join(COMPONENTS)}")
        sched_class = _read_config(path, "scheduler", "scheduler_config.json").get("_class_name")
        if sched_class != FlowFamily.scheduler_class_name:  # the flow family's one scheduler class
            raise ConfigError(f"model {path!r}: a FluxPipeline samples with {FlowFamily.scheduler_class_name}, this "
                              f"folder's scheduler is {sched_class}")
        why = self.check_resolution(path, resolution)
        if why:
            raise ConfigError(f"pretrained.resolution: {why}")
        kw = dict(local_files_only=True)

        def model(cls, sub, dtype):
            return cls.from_pretrained(path, subfolder=sub, torch_dtype=dtype, **kw).to(device)

        text_dtype = component_dtype("text_encoder", torch_dtype)  # T5-XXL: 9.5 GB in bf16, 19 GB in float32
        parts = dict(
            transformer=model(FluxTransformer2DModel, "transformer",
                              component_dtype("denoiser", torch_dtype, lora=lora)),
            vae=model(AutoencoderKL, "vae", folder_vae_dtype(path, torch_dtype)),
            text_encoder=model(CLIPTextModel, "text_encoder", text_dtype),
            text_encoder_2=model(T5EncoderModel, "text_encoder_2", text_dtype),
            tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
            tokenizer_2=T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_2", **kw),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw),
        )
        return self.wrap(parts, path, resolution)

    def wrap(self, parts: dict, path: str, resolution: int = 0) -> LoadedPipeline:
        """A LoadedPipeline over the components by their pipeline names (frozen; `parts["scheduler"]` the folder's
        own, kept for the export), sampling at `resolution` px (0: the VAE config's sample_size)."""
        freeze(*parts.values())
        scale = vae_scale_factor(parts["vae"].config)
        resolution = int(resolution or parts["vae"].config.sample_size)
        scheduler = static_scheduler(parts["scheduler"], resolution, scale)
        return LoadedPipeline(FluxDenoiser(parts["transformer"]), parts["text_encoder"], parts["tokenizer"],
                              scheduler, parts["vae"], "flow", path, adapter=self, components=parts,
                              resolution=resolution)

    def configure(self, pipe: LoadedPipeline, config) -> None:
        """The run's embedded guidance (pretrained.embedded_guidance) on the denoiser."""
        pipe.unet.guidance = float(config.pretrained.get("embedded_guidance", EMBEDDED_GUIDANCE))

    def check_resolution(self, path: str, resolution: int) -> str:
        """'' if the model at `path` can sample `resolution` px images (0: the VAE's sample_size), else why not:
        the VAE and the 2x2 packing must divide it."""
        if not resolution:
            return ""
        step = vae_scale_factor(_read_config(path, "vae")) * 2
        if resolution < 0 or resolution % step:
            return f"resolution {resolution} must be a positive multiple of {step} px (VAE x 2x2 packing) for FLUX"
        return ""

    def pipeline_call(self, pipe: LoadedPipeline, num_inference_steps: int, guidance_scale: float) -> dict:
        """FluxPipeline's names: `guidance_scale` is the embedded guidance (pretrained.embedded_guidance), true CFG
        is `true_cfg_scale` with the empty negative prompt (FluxPipeline applies it only when one is given); the T5
        length the run encoded with. The export's scheduler is the folder's dynamic-shift one: height and width
        give FluxPipeline the mu of the run's static shift."""
        call = super().pipeline_call(pipe, num_inference_steps, guidance_scale)
        call.update(guidance_scale=float(pipe.unet.guidance), max_sequence_length=self.max_sequence_length(pipe))
        if guidance_scale != 1.0:
            call.update(true_cfg_scale=float(guidance_scale), negative_prompt="")
        return call

    def export_settings(self, pipe: LoadedPipeline) -> dict:
        """The embedded guidance the transformer was fed (None: the model has no guidance embedding)."""
        return {"embedded_guidance": float(pipe.unet.guidance) if pipe.unet.config.guidance_embeds else None}

    def max_sequence_length(self, pipe: LoadedPipeline) -> int:
        return min(T5_MAX_SEQUENCE_LENGTH, int(pipe.components["tokenizer_2"].model_max_length))

    def encode(self, pipe, prompts: Sequence[str]) -> torch.Tensor:
        """The pipeline's own encode_prompt: T5's token embeddings (B, L, D) with CLIP's pooled embedding (B, P)
        packed into extra rows, (B, L + ceil(P / D), D)."""
        device = next(pipe.components["text_encoder_2"].parameters()).device
        seq, pooled, _ = self.diffusers_pipeline(pipe).encode_prompt(
            list(prompts), device=device, max_sequence_length=self.max_sequence_length(pipe))
        return pack_condition(seq, [pooled])

    def sample_shape(self, pipe) -> tuple:
        channels = pipe.components["transformer"].config.in_channels // 4
        size = pipe.resolution // vae_scale_factor(pipe.vae.config)
        return (channels, size, size)


ADAPTER = FluxAdapter()


# ------------------------------------------------------------------------------------------------------ builds
TINY_SEED = 0
TINY_MAX_TOKENS = 16  # CLIP's and T5's token lengths in the tiny build
EXTRA_WORDS = ("a", "an", "the", "of", "photo", "with", "and", "on", "in")
# FLUX.1-dev's scheduler config (FLUX.1-schnell: use_dynamic_shifting False, shift 1.0).
FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def _words():
    return sorted(set(vocabulary()) | set(EXTRA_WORDS))


def _clip_config(tok, vocab_size: int, hidden: int, inter: int, layers: int, heads: int, positions: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, projection_dim=hidden, max_position_embeddings=positions,
                          hidden_act="quick_gelu", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)


def tiny_parts() -> dict:
    """The tiny build's components (seeded random weights, float32): 32x32 px images through a 4x VAE to 16x8x8
    latents, packed 2x2 into 16 image tokens of 64; one double and one single block of width 32 (2 heads of 16,
    rope axes 4+6+6) with a guidance embedding (dev-like); 16 text tokens of T5 width 32; CLIP pooled width 32."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    words = _words()
    tok = clip_tokenizer(words, TINY_MAX_TOKENS)
    tok_2 = t5_tokenizer(words, TINY_MAX_TOKENS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        text_encoder = CLIPTextModel(_clip_config(tok, len(tok), 32, 64, 1, 2, TINY_MAX_TOKENS))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tok_2), d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2,
            feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            relative_attention_num_buckets=8))
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16, 16, 16),
                            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                            layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                tokenizer=tok, tokenizer_2=tok_2, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER))


def build_tiny(out_dir: str) -> str:
    """Write the tiny FLUX model ("flux-tiny") to out_dir with FluxPipeline.save_pretrained, so that
    FluxPipeline.from_pretrained(out_dir) loads it, as it loads a user's FLUX.1 folder."""
    from diffusers import FluxPipeline

    FluxPipeline(**tiny_parts()).save_pretrained(out_dir)
    return out_dir


# FLUX.1-dev (black-forest-labs/FLUX.1-dev)'s component configs.
FLUX_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1,
              decoder_start_token_id=0)


def build_flux_dev_random(resolution: int = 512, torch_dtype: torch.dtype = torch.bfloat16, device="cuda",
                          seed: int = 0, denoiser_dtype: torch.dtype = None) -> LoadedPipeline:
    """FLUX.1-dev's shapes with seeded random weights, as a LoadedPipeline (flow family), for speed and memory
    benchmarks: the 11.9 B-parameter transformer (19 double + 38 single blocks, guidance embedding), CLIP-L, T5-XXL
    (4.8 B) and the 16-channel VAE. Every module is created on `device` directly with `torch_dtype` as the default
    dtype (the transformer with `denoiser_dtype` where given: float32 for training, base.component_dtype), so no
    extra float32 or CPU copy is ever made ("meta": shapes only). Tokenizers are word-level over the
    toy-world words (real embedding sizes; CLIP 77 tokens, T5 512). What it draws is noise."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    words = _words()
    tok, tok_2 = clip_tokenizer(words, 77), t5_tokenizer(words, T5_MAX_SEQUENCE_LENGTH)
    device = torch.device(device)
    fork = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), device:
        torch.manual_seed(seed)
        with default_dtype(denoiser_dtype or torch_dtype):
            parts = dict(transformer=FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER))
        with default_dtype(component_dtype("vae", torch_dtype, dict(FLUX_VAE, _class_name="AutoencoderKL"))):
            parts.update(vae=AutoencoderKL(**FLUX_VAE))
        with default_dtype(component_dtype("text_encoder", torch_dtype)):
            parts.update(text_encoder=CLIPTextModel(_clip_config(tok, 49408, 768, 3072, 12, 12, 77)),
                         text_encoder_2=T5EncoderModel(T5Config(**T5_XXL)))
    parts.update(tokenizer=tok, tokenizer_2=tok_2, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER))
    return ADAPTER.wrap(parts, "flux-dev-random", resolution)

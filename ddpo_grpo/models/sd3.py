"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline): an SD3Transformer2DModel (MMDiT) conditioned on CLIP-L and
CLIP-G (CLIPTextModelWithProjection) and T5 token embeddings plus the two CLIP models' pooled projections, an
AutoencoderKL with 16 latent channels and a shift_factor, and a FlowMatchEulerDiscreteScheduler (the flow family:
Flow-GRPO's SDE).

- condition: `encode_prompt` of the pipeline itself, i.e. (B, 77 + 256, 4096) token embeddings (CLIP-L|CLIP-G,
  zero-padded to T5's width, then T5's tokens) with the (B, 2048) pooled projections packed into extra rows
  (base.pack_condition); `SD3Denoiser` unpacks them for the transformer.
- T5's sequence length is diffusers' default (256), or the T5 tokenizer's model_max_length where that is shorter
  (the tiny build's 16 tokens): a diffusers user gets the trained condition with
  `pipe(..., max_sequence_length=min(256, pipe.tokenizer_3.model_max_length))`, which an export's
  export.json records in `pipeline_call`.
- latent size: the transformer's sample_size (128: 1024 px for SD3-Medium / 3.5), or pretrained.resolution / 8
  (e.g. 512 px, as Flow-GRPO trains SD3.5-Medium); `check_resolution` says which sizes the model takes.

`build_tiny(out_dir)`: the same classes at test size (the "sd3-tiny" model, 32x32 px). `build_sd35_medium_random`:
SD3.5-Medium's shapes with random weights for GPU benchmarks, made directly on the device in the target dtype.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from ddpo_grpo.core.families import FlowFamily

from .adapter import ModelAdapter
from .base import DenoiserOutput, LoadedPipeline, PackedDenoiser, component_dtype, default_dtype, \
    folder_vae_dtype, freeze, load_scheduler, pack_condition, unpack_condition
from .tiny import clip_tokenizer, t5_tokenizer
from .vocabulary import vocabulary

T5_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length
COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3",
              "transformer", "vae", "scheduler")


class SD3Denoiser(PackedDenoiser):
    """SD3Transformer2DModel behind the UNet call: `encoder_hidden_states` is the packed condition (B, L + r, D),
    unpacked into the token embeddings (B, L, D) and the pooled projections (B, pooled_projection_dim)."""

    def forward(self, sample, timestep, encoder_hidden_states=None, **kwargs) -> DenoiserOutput:
        seq, (pooled,) = unpack_condition(encoder_hidden_states, [self.model.config.pooled_projection_dim])
        timestep = timestep.expand(sample.shape[0]) if timestep.ndim == 0 else timestep
        out = self.model(hidden_states=sample, timestep=timestep, encoder_hidden_states=seq,
                         pooled_projections=pooled, return_dict=False)[0]
        return DenoiserOutput(out)

    def set_attn_processor(self, processor) -> None:
        """unet_attention="math" passes diffusers' generic AttnProcessor, which SD3's joint attention (text and image
        streams in one attention) cannot run: the joint processors stay, with torch's math SDPA backend (plain
        matmuls) instead of the fused kernels."""
        from diffusers.models.attention_processor import AttnProcessor

        self.model.set_attn_processor(math_joint_processor() if type(processor) is AttnProcessor else processor)


def math_joint_processor():
    """diffusers' JointAttnProcessor2_0 computing its scaled_dot_product_attention with torch's MATH backend."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class JointAttnProcessorMath(JointAttnProcessor2_0):
        def __call__(self, *args, **kwargs):
            with sdpa_kernel(SDPBackend.MATH):
                return super().__call__(*args, **kwargs)

    return JointAttnProcessorMath()


def _read_config(path: str, sub: str, name: str = "config.json") -> dict:
    with open(os.path.join(path, sub, name)) as f:
        return json.load(f)


def run_scheduler(scheduler, patches: int):
    """The scheduler the run samples with: the folder's own, or, for a config with use_dynamic_shifting (none of
    Stability's SD3 folders; they shift by a static 3.0), one whose set_timesteps(n) passes the mu that
    StableDiffusion3Pipeline computes for `patches` x `patches` image tokens, so both take the same schedule."""
    if not scheduler.config.get("use_dynamic_shifting", False):
        return scheduler
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    c = scheduler.config
    mu = calculate_shift(patches * patches, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.16))

    class SD3DynamicShiftScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, timesteps=timesteps,
                                  mu=self.run_mu if mu is None else mu)

    out = SD3DynamicShiftScheduler.from_config(c)
    out.run_mu = mu
    return out


def vae_scale_factor(vae_config) -> int:
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


class SD3Adapter(ModelAdapter):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"  # exports: its save_pretrained (full) and save_lora_weights (LoRA)
    dynamic_shift = True  # run_scheduler: StableDiffusion3Pipeline's mu for the run's image tokens
    components = COMPONENTS
    denoiser_folder = "transformer"
    lora_prefix = "transformer"
    # The attention projections of every joint block (image and text streams), as diffusers'
    # train_dreambooth_lora_sd3.py and Flow-GRPO's SD3 recipe target them.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    fsdp_block_classes = ("JointTransformerBlock",)

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, lora=False) -> LoadedPipeline:
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        from ddpo_grpo.errors import ConfigError

        missing = [c for c in COMPONENTS if not os.path.isdir(os.path.join(path, c))]
        if missing:
            raise ConfigError(f"model {path!r} is a StableDiffusion3Pipeline folder without {', '.join(missing)}/; "
                              f"it needs {', '.join(COMPONENTS)}")
        why = self.check_resolution(path, resolution)
        if why:
            raise ConfigError(f"pretrained.resolution: {why}")
        sched_class = _read_config(path, "scheduler", "scheduler_config.json").get("_class_name")
        if sched_class != FlowFamily.scheduler_class_name:  # the flow family's one scheduler class
            raise ConfigError(f"model {path!r}: a StableDiffusion3Pipeline samples with "
                              f"{FlowFamily.scheduler_class_name}, this folder's scheduler is {sched_class}")
        kw = dict(local_files_only=True)
        scheduler, family = load_scheduler(path, dynamic_shift=self.dynamic_shift)  # run_scheduler gives it its mu
        text_dtype = component_dtype("text_encoder", torch_dtype)  # T5-XXL: 9.5 GB in bf16, 19 GB in float32
        model = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=component_dtype(
            "denoiser", torch_dtype, lora=lora), **kw).to(device)
        parts = dict(
            transformer=model,
            vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=folder_vae_dtype(path, torch_dtype),
                                              **kw).to(device),
            text_encoder=CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder",
                                                                     torch_dtype=text_dtype, **kw).to(device),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2",
                                                                       torch_dtype=text_dtype, **kw).to(device),
            text_encoder_3=T5EncoderModel.from_pretrained(path, subfolder="text_encoder_3", torch_dtype=text_dtype,
                                                          **kw).to(device),
            tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
            tokenizer_2=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2", **kw),
            tokenizer_3=T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_3", **kw),
            scheduler=scheduler,
        )
        return self.wrap(parts, family, path, resolution)

    def wrap(self, parts: dict, family: str, path: str, resolution: int = 0) -> LoadedPipeline:
        """A LoadedPipeline over the components (frozen) by their pipeline names. `parts["scheduler"]` (the folder's,
        kept for the export) samples as it is, or, where its config shifts dynamically, as run_scheduler."""
        freeze(*parts.values())
        pipe = LoadedPipeline(SD3Denoiser(parts["transformer"]), parts["text_encoder"], parts["tokenizer"],
                              parts["scheduler"], parts["vae"], family, path, adapter=self, components=parts,
                              resolution=int(resolution or 0))
        patches = pipe.sample_shape[-1] // parts["transformer"].config.patch_size
        pipe.scheduler = run_scheduler(parts["scheduler"], patches)
        return pipe

    def check_resolution(self, path: str, resolution: int) -> str:
        """'' if the model at `path` can sample `resolution` px images (0: its native size), else why not: the VAE
        and the 2x2 patches divide it, and the transformer's position embedding covers pos_embed_max_size patches."""
        if not resolution:
            return ""
        tcfg, vcfg = _read_config(path, "transformer"), _read_config(path, "vae")
        step = vae_scale_factor(vcfg) * tcfg["patch_size"]
        most = (tcfg.get("pos_embed_max_size") or tcfg["sample_size"] // tcfg["patch_size"]) * step
        if resolution < 0 or resolution % step or resolution > most:
            return (f"resolution {resolution} must be a multiple of {step} px (VAE x patch size) up to {most} px for "
                    f"this SD3 model (native: {tcfg['sample_size'] * vae_scale_factor(vcfg)} px)")
        return ""

    def pipeline_call(self, pipe: LoadedPipeline, num_inference_steps: int, guidance_scale: float) -> dict:
        """The base call with the T5 length the run encoded with."""
        return dict(super().pipeline_call(pipe, num_inference_steps, guidance_scale),
                    max_sequence_length=self.max_sequence_length(pipe))

    def max_sequence_length(self, pipe: LoadedPipeline) -> int:
        return min(T5_MAX_SEQUENCE_LENGTH, int(pipe.components["tokenizer_3"].model_max_length))

    def encode(self, pipe, prompts: Sequence[str]) -> torch.Tensor:
        """The pipeline's own encode_prompt: token embeddings (B, L, D) with the pooled projections (B, P) packed
        into extra rows, (B, L + ceil(P / D), D)."""
        prompts = list(prompts)
        device = next(pipe.components["text_encoder"].parameters()).device
        seq, _, pooled, _ = self.diffusers_pipeline(pipe).encode_prompt(
            prompts, prompts, prompts, device=device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length(pipe))
        return pack_condition(seq, [pooled])

    def sample_shape(self, pipe) -> tuple:
        cfg = pipe.components["transformer"].config
        size = pipe.resolution // vae_scale_factor(pipe.vae.config) if pipe.resolution else cfg.sample_size
        return (cfg.in_channels, size, size)


ADAPTER = SD3Adapter()


# ------------------------------------------------------------------------------------------------------ builds
TINY_SEED = 0
TINY_MAX_TOKENS = 16  # CLIP and T5 token lengths of the tiny build (CLIP's model_max_length; T5's, see encode)
EXTRA_WORDS = ("a", "an", "the", "of", "photo", "with", "and", "on", "in")


def _words():
    return sorted(set(vocabulary()) | set(EXTRA_WORDS))


def _clip_config(tok, vocab_size: int, hidden: int, inter: int, layers: int, heads: int, proj: int, positions: int,
                 act: str = "quick_gelu"):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, projection_dim=proj, max_position_embeddings=positions,
                          hidden_act=act, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)


def tiny_parts() -> dict:
    """The tiny build's components (seeded random weights, float32): 32x32 px images through a 4x VAE to 16x8x8
    latents, 2x2 patches (16 image tokens), 2 joint blocks of width 32, text tokens 16 (CLIP-L | CLIP-G) + 16 (T5)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    words = _words()
    tok = clip_tokenizer(words, TINY_MAX_TOKENS)
    tok_2 = clip_tokenizer(words, TINY_MAX_TOKENS)
    tok_3 = t5_tokenizer(words, TINY_MAX_TOKENS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        enc = CLIPTextModelWithProjection(_clip_config(tok, len(tok), 32, 64, 2, 2, 16, TINY_MAX_TOKENS))
        enc_2 = CLIPTextModelWithProjection(_clip_config(tok_2, len(tok_2), 32, 64, 2, 2, 16, TINY_MAX_TOKENS, "gelu"))
        enc_3 = T5EncoderModel(T5Config(vocab_size=len(tok_3), d_model=64, d_ff=64, d_kv=16, num_layers=1, num_heads=2,
                                        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                        decoder_start_token_id=0, relative_attention_num_buckets=8))
        transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                                            caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=8)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16, 16, 16),
                            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                            layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=1.5305,
                            shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return dict(transformer=transformer, vae=vae, text_encoder=enc, text_encoder_2=enc_2, text_encoder_3=enc_3,
                tokenizer=tok, tokenizer_2=tok_2, tokenizer_3=tok_3, scheduler=scheduler)


def build_tiny(out_dir: str) -> str:
    """Write the tiny SD3 model ("sd3-tiny") to out_dir with StableDiffusion3Pipeline.save_pretrained, so that
    StableDiffusion3Pipeline.from_pretrained(out_dir) loads it, as it loads a user's SD3 folder."""
    from diffusers import StableDiffusion3Pipeline

    StableDiffusion3Pipeline(**tiny_parts()).save_pretrained(out_dir)
    return out_dir


# SD3.5-Medium (stabilityai/stable-diffusion-3.5-medium)'s component configs.
SD35_MEDIUM_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                               attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                               caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                               dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
               layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1,
              decoder_start_token_id=0)


def build_sd35_medium_random(resolution: int = 512, torch_dtype: torch.dtype = torch.bfloat16, device="cuda",
                             seed: int = 0, denoiser_dtype: torch.dtype = None) -> LoadedPipeline:
    """SD3.5-Medium's shapes with seeded random weights, as a LoadedPipeline (flow family), for speed and memory
    benchmarks: the 2.5 B-parameter MMDiT, CLIP-L, CLIP-G (bigG), T5-XXL (4.8 B) and the 16-channel VAE. Every module
    is created on `device` directly with `torch_dtype` as the default dtype (the transformer with `denoiser_dtype`
    where given: float32 for training, base.component_dtype), so no extra float32 or CPU copy is ever made.
    Tokenizers are word-level over the models' vocabulary (real embedding sizes; CLIP 77 tokens, T5 256). What it
    draws is noise."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    words = _words()
    tok, tok_2 = clip_tokenizer(words, 77), clip_tokenizer(words, 77)
    tok_3 = t5_tokenizer(words, 512)
    device = torch.device(device)
    fork = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), device:
        torch.manual_seed(seed)
        with default_dtype(denoiser_dtype or torch_dtype):
            parts = dict(transformer=SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER))
        with default_dtype(component_dtype("vae", torch_dtype, dict(SD3_VAE, _class_name="AutoencoderKL"))):
            parts.update(vae=AutoencoderKL(**SD3_VAE))
        with default_dtype(component_dtype("text_encoder", torch_dtype)):
            parts.update(
                text_encoder=CLIPTextModelWithProjection(_clip_config(tok, 49408, 768, 3072, 12, 12, 768, 77)),
                text_encoder_2=CLIPTextModelWithProjection(
                    _clip_config(tok_2, 49408, 1280, 5120, 32, 20, 1280, 77, "gelu")),
                text_encoder_3=T5EncoderModel(T5Config(**T5_XXL)),
            )
    parts.update(tokenizer=tok, tokenizer_2=tok_2, tokenizer_3=tok_3,
                 scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))
    return ADAPTER.wrap(parts, "flow", "sd35-medium-random", resolution)

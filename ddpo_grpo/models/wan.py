"""Wan 2.1 text-to-video (WanPipeline): a WanTransformer3DModel conditioned on UMT5 token embeddings, the causal 3-D
VAE AutoencoderKLWan (8x space, 4x time, per-channel latents_mean / latents_std), and flow matching.

- latents: (C, F', H/8, W/8) per sample, F' = (F - 1) / 4 + 1 for F = 1 + 4k frames; the transformer takes them as
  (B, C, F', H', W') and is called exactly like a UNet (`transformer(x, t, encoder_hidden_states=cond).sample`), so
  no PackedDenoiser is needed. Decoded samples are frames (B, F, 3, H, W) in [0, 1] (core.pipeline_with_logprob.decode
  undoes the per-channel normalisation as WanPipeline does).
- condition: WanPipeline's own `encode_prompt` (UMT5 last hidden states, zeroed after each prompt's tokens,
  (B, 512, D): WanPipeline.__call__'s max_sequence_length, which its cross-attention attends over, padding included);
  the negative prompt is "" as the stock pipeline's default.
- scheduler: the released folders hold a UniPCMultistepScheduler config with `flow_shift` (3.0 for 480p); it is
  loaded as a FlowMatchEulerDiscreteScheduler with shift = flow_shift (models.base.load_scheduler), the flow family
  (Flow-GRPO's SDE / CPS). Exports carry that scheduler (a LoRA export too, in scheduler/), so
  WanPipeline.from_pretrained(export, scheduler=...) samples with it.
- size: pretrained.resolution (square, a multiple of 16), or pretrained.height / pretrained.width (any multiple of 16,
  applied by `configure` / `set_size`), and pretrained.num_frames (1 + 4k); 0 = WanPipeline's defaults, 480x832 px
  and 81 frames.

`build_tiny(out_dir)`: the same classes at test size ("wan-tiny": 32x32 px, 5 frames, latents 16x2x4x4).
`build_wan21_1_3b_random`: Wan 2.1 T2V 1.3B's shapes (and UMT5-XXL's) with random weights for GPU benchmarks,
made on the device in the target dtype.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ddpo_grpo.errors import ConfigError

from .adapter import ModelAdapter
from .base import LoadedPipeline, component_dtype, default_dtype, folder_vae_dtype, freeze, load_scheduler
from .vocabulary import vocabulary

COMPONENTS = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
NATIVE_HEIGHT, NATIVE_WIDTH, NATIVE_FRAMES = 480, 832, 81  # WanPipeline.__call__'s defaults (Wan 2.1 480p)
MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default (encode_prompt's own is 226: not what the pipeline samples)
# Wan 2.1's default negative prompt (its shared config's `sample_neg_prompt`), the one ReCamMaster's inference passes
# (inference_recammaster.py, commit 39c0dc2): the recam configs' and scripts/recam_render.py's CFG negative.
WAN_NEGATIVE_PROMPT = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
                       "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
                       "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")


@dataclass
class WanLoadedPipeline(LoadedPipeline):
    """A LoadedPipeline with the video size it samples: frames, and height x width in pixels."""

    num_frames: int = NATIVE_FRAMES
    height: int = NATIVE_HEIGHT
    width: int = NATIVE_WIDTH


def _read_config(path: str, sub: str) -> dict:
    with open(os.path.join(path, sub, "config.json")) as f:
        return json.load(f)


def _scales(vae_config) -> tuple:
    """(temporal, spatial) compression of an AutoencoderKLWan config (dict or FrozenDict)."""
    get = vae_config.get
    return int(get("scale_factor_temporal") or 4), int(get("scale_factor_spatial") or 8)


def check_size(resolution: int, num_frames: int, spatial: int = 8, temporal: int = 4, patch=(1, 2, 2)) -> str:
    """'' if (resolution px square, num_frames) can be sampled (0: the default), else why not."""
    step = spatial * int(patch[1])
    if resolution and (resolution < 0 or resolution % step):
        return f"resolution {resolution} must be a positive multiple of {step} px (VAE {spatial}x times patch {patch[1]})"
    if num_frames and (num_frames < 1 or (num_frames - 1) % temporal):
        return (f"num_frames {num_frames} must be 1 + {temporal}k (the VAE compresses time {temporal}x), "
                f"e.g. {1 + temporal}, 33 or 81")
    return ""


class AutocastRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm that, under autocast, normalises in its input's dtype with its weight cast to it: torch's
    fused rms_norm kernel needs one dtype, and a full fine-tune's float32 weight with autocast's bf16 input (the
    q / k projections' output) otherwise takes the unfused composite path ("Mismatch dtype between input and
    weight ... Cannot dispatch to fused implementation"), an extra float32 pass over every query and key of every
    attention. Outside autocast (a float32 run, or a LoRA run's bf16 base whose weight is bf16 already) it is
    torch.nn.RMSNorm exactly. The weight's cast is differentiable: a full fine-tune still trains it in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, device = self.weight, x.device.type
        if (w is not None and x.dtype != w.dtype and x.is_floating_point()
                and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):  # (not on meta)
            return torch.nn.functional.rms_norm(x, self.normalized_shape, w.to(x.dtype), self.eps)
        return super().forward(x)


def fused_attention_norms(transformer: torch.nn.Module) -> torch.nn.Module:
    """Every Wan attention's q / k RMSNorm (norm_q, norm_k, norm_added_k) as AutocastRMSNorm, in place (the class
    only: parameters, state-dict keys and float32 results unchanged), so that under bf16 autocast q, k and v reach
    scaled_dot_product_attention in bf16 from the fused norm (tests/test_sdpa_dtype.py). Returns the module."""
    for module in transformer.modules():
        for name in ("norm_q", "norm_k", "norm_added_k"):
            norm = getattr(module, name, None)
            if type(norm) is torch.nn.RMSNorm:
                norm.__class__ = AutocastRMSNorm
    return transformer


class WanAdapter(ModelAdapter):
    name = "wan"
    pipeline_class = "WanPipeline"  # exports: its save_pretrained (full) and save_lora_weights (LoRA)
    components = COMPONENTS
    denoiser_folder = "transformer"
    lora_prefix = "transformer"
    # Self- and cross-attention projections and the feed-forward of every block (Flow-GRPO / DanceGRPO's Wan LoRA
    # targets the attention; the FFN holds most of a block's weights).
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    fsdp_block_classes = ("WanTransformerBlock",)
    video = True

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, num_frames=0,
             transformer=None, lora=False) -> LoadedPipeline:
        """The folder's components; `transformer`: a denoiser to use instead of the folder's weights (models.recam's,
        built from the folder's config and a ReCamMaster checkpoint)."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        missing = [c for c in COMPONENTS if not os.path.isdir(os.path.join(path, c))]
        if missing:
            raise ConfigError(f"model {path!r} is a WanPipeline folder without {', '.join(missing)}/; "
                              f"it needs {', '.join(COMPONENTS)}")
        with open(os.path.join(path, "model_index.json")) as f:
            index = json.load(f)
        if (index.get("transformer_2") or [None])[0] or index.get("expand_timesteps"):
            raise ConfigError(f"model {path!r} is a Wan 2.2 pipeline (two experts or expanded timesteps); "
                              "only Wan 2.1-style WanPipeline folders (one transformer) are supported")
        why = self.check_size(path, resolution, num_frames)
        if why:
            raise ConfigError(f"pretrained: {why}")
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler, family = load_scheduler(path)
        if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            raise ConfigError(f"model {path!r}: its scheduler config is not flow matching (no flow_shift / "
                              "use_flow_sigmas, not FlowMatchEulerDiscreteScheduler); Wan trains with the flow family")
        kw = dict(local_files_only=True)
        parts = dict(
            transformer=transformer if transformer is not None else WanTransformer3DModel.from_pretrained(
                path, subfolder="transformer", torch_dtype=component_dtype("denoiser", torch_dtype, lora=lora),
                **kw).to(device),
            # UMT5-XXL: 11 GB in bf16, 23 GB in float32
            text_encoder=UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=component_dtype(
                "text_encoder", torch_dtype), **kw).to(device),
            tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
            # float32, as diffusers' WanPipeline example loads it (base.FP32_VAE_CLASSES). The trainer decodes inside
            # accelerate's autocast (core.pipeline_with_logprob.decode), so its convolutions still run in bf16 there.
            vae=AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=folder_vae_dtype(path, torch_dtype),
                                                 **kw).to(device),
            scheduler=scheduler,
        )
        return self.wrap(parts, family, path, resolution, num_frames)

    def wrap(self, parts: dict, family: str, path: str, resolution: int = 0, num_frames: int = 0) -> LoadedPipeline:
        """A WanLoadedPipeline over the components (frozen) by their pipeline names; the transformer's q / k norms
        fused under autocast (fused_attention_norms)."""
        freeze(*parts.values())
        fused_attention_norms(parts["transformer"])
        res = int(resolution or 0)
        return WanLoadedPipeline(parts["transformer"], parts["text_encoder"], parts["tokenizer"], parts["scheduler"],
                                 parts["vae"], family, path, adapter=self, components=parts, resolution=res,
                                 num_frames=int(num_frames or NATIVE_FRAMES), height=res or NATIVE_HEIGHT,
                                 width=res or NATIVE_WIDTH)

    def check_size(self, path: str, resolution: int = 0, num_frames: int = 0) -> str:
        temporal, spatial = _scales(_read_config(path, "vae"))
        return check_size(resolution, num_frames, spatial, temporal, _read_config(path, "transformer")["patch_size"])

    def check_resolution(self, path: str, resolution: int) -> str:
        """'' if the model at `path` samples resolution x resolution px (0: 480x832), else why not (trainer/run/validate)."""
        return self.check_size(path, resolution, 0)

    def configure(self, pipe, config) -> None:
        """pretrained.num_frames (0: keep the loaded count, 81 by default): the frames each sample has;
        pretrained.height / pretrained.width (0: keep pretrained.resolution's square, or 480 x 832): a non-square size."""
        p = config.pretrained
        self.set_size(pipe, int(p.get("height", 0) or 0), int(p.get("width", 0) or 0), int(p.get("num_frames", 0) or 0),
                      what="pretrained.")

    def set_size(self, pipe, height: int = 0, width: int = 0, num_frames: int = 0, what: str = "") -> None:
        """Sample height x width px (any multiple of the VAE's factor times the patch, not only squares) and
        num_frames (1 + 4k); 0 keeps the pipe's. One ConfigError line for a size the model cannot take."""
        temporal, spatial = _scales(pipe.vae.config)
        patch = tuple(pipe.unet.config.patch_size)
        for name, v in (("height", height), ("width", width), ("num_frames", num_frames)):
            why = check_size(v, 0, spatial, temporal, patch) if name != "num_frames" else check_size(0, v, spatial,
                                                                                                     temporal, patch)
            if why:
                raise ConfigError(f"{what}{name}: {why.replace('resolution', name)}")
        pipe.height, pipe.width = int(height or pipe.height), int(width or pipe.width)
        pipe.num_frames = int(num_frames or pipe.num_frames)

    def pixel_size(self, pipe) -> tuple:
        return int(pipe.height), int(pipe.width)

    def pipeline_call(self, pipe, num_inference_steps: int, guidance_scale: float) -> dict:
        """The base call with the frames (WanPipeline's default 81 and 480 x 832 px are not the run's unless set)."""
        return dict(super().pipeline_call(pipe, num_inference_steps, guidance_scale), num_frames=int(pipe.num_frames))

    def export_settings(self, pipe) -> dict:
        return {"num_frames": int(pipe.num_frames), "height": int(pipe.height), "width": int(pipe.width)}

    def encode(self, pipe, prompts: Sequence[str]) -> torch.Tensor:
        """WanPipeline.encode_prompt: UMT5's token embeddings (B, 512, D), zero after each prompt's tokens."""
        device = next(pipe.text_encoder.parameters()).device
        embeds, _ = self.diffusers_pipeline(pipe).encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                                          max_sequence_length=MAX_SEQUENCE_LENGTH, device=device)
        return embeds

    def sample_shape(self, pipe) -> tuple:
        """(C, F', H', W'): latent channels, latent frames (F - 1) / 4 + 1, and the VAE-compressed height, width."""
        temporal, spatial = _scales(pipe.vae.config)
        return (pipe.unet.config.in_channels, (pipe.num_frames - 1) // temporal + 1, pipe.height // spatial,
                pipe.width // spatial)


ADAPTER = WanAdapter()


# ------------------------------------------------------------------------------------------------------ builds
TINY_SEED = 0
TINY_SIZE, TINY_FRAMES = 32, 5  # pixels (square) and frames of the wan-tiny configs; latents (16, 2, 4, 4)
TINY_FLOW_SHIFT = 3.0  # Wan 2.1's 480p value
EXTRA_WORDS = ("a", "an", "the", "of", "video", "with", "and", "on", "in", "moving")


def _words():
    return sorted(set(vocabulary()) | set(EXTRA_WORDS))


def build_umt5_tokenizer(words=None):
    """A T5-style (Unigram) tokenizer built with the `tokenizers` library, as Wan's UMT5 tokenizer is: every word one
    piece ("▁word"), single letters as fallback, <pad>=0, </s>=1, <unk>=2. Saved as tokenizer.json, which
    transformers' T5 tokenizer class (and AutoTokenizer) loads offline."""
    from .tiny import t5_tokenizer

    return t5_tokenizer(words or _words(), 512, extra_letters="0123456789")


def wan_scheduler_config(flow_shift: float) -> dict:
    """Wan 2.1's released scheduler: UniPC over flow sigmas with `flow_shift` (what Wan-AI/Wan2.1-T2V-*-Diffusers
    hold), so the tiny build loads through the same UniPC -> flow-matching Euler conversion as a user's folder."""
    return dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                flow_shift=flow_shift, solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True,
                final_sigmas_type="zero", timestep_spacing="linspace", steps_offset=0)


def tiny_parts() -> dict:
    """The tiny build's components (seeded random weights, float32): 32x32 px x 5 frames through the 8x / 4x VAE to
    16 x 2 x 4 x 4 latents, 1x2x2 patches (8 tokens), 2 transformer blocks of width 24, UMT5 of width 32."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = build_umt5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False))
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, rope_max_seq_len=32)
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(**wan_scheduler_config(TINY_FLOW_SHIFT))
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tok, scheduler=scheduler)


def build_tiny(out_dir: str) -> str:
    """Write the tiny Wan model ("wan-tiny") to out_dir with WanPipeline.save_pretrained, so that
    WanPipeline.from_pretrained(out_dir) loads it, as it loads a user's Wan 2.1 folder."""
    from diffusers import WanPipeline

    WanPipeline(**tiny_parts()).save_pretrained(out_dir)
    return out_dir


# Wan-AI/Wan2.1-T2V-1.3B-Diffusers's component configs.
WAN21_1_3B_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True])  # latents_mean / latents_std: AutoencoderKLWan's defaults
# Wan-AI/Wan2.1-T2V-14B-Diffusers's transformer config (the VAE and UMT5-XXL are the 1.3B's).
WAN21_14B_TRANSFORMER = dict(WAN21_1_3B_TRANSFORMER, num_attention_heads=40, ffn_dim=13824, num_layers=40)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False)


def build_wan21_14b_random(resolution: int = 0, num_frames: int = 0, torch_dtype: torch.dtype = torch.bfloat16,
                           device="cuda", seed: int = 0, denoiser_dtype: torch.dtype = None) -> LoadedPipeline:
    """build_wan21_1_3b_random with Wan 2.1 T2V 14B's transformer, for memory plans on "meta"
    (benchmarks/memory_table.py); not a models.BUILT name."""
    return build_wan21_1_3b_random(resolution, num_frames, torch_dtype, device, seed, denoiser_dtype,
                                   transformer=WAN21_14B_TRANSFORMER, name="wan21-14b-random")


def build_wan21_1_3b_random(resolution: int = 0, num_frames: int = 0, torch_dtype: torch.dtype = torch.bfloat16,
                            device="cuda", seed: int = 0, denoiser_dtype: torch.dtype = None,
                            transformer: dict = None, name: str = "wan21-1.3b-random") -> LoadedPipeline:
    """Wan 2.1 T2V 1.3B's shapes with seeded random weights, as a LoadedPipeline (flow family, shift 3), for speed and
    memory benchmarks: the 1.4 B-parameter WanTransformer3DModel, UMT5-XXL's encoder (5.7 B) and the Wan VAE. Every
    module is created on `device` directly in its dtype (text encoder: `torch_dtype`; transformer: `denoiser_dtype`
    where given, float32 for training; VAE: base.component_dtype's, float32 for Wan's), so no extra float32 or CPU copy
    is ever made. The tokenizer is word-level over the models' vocabulary (the real 256384-row embedding; prompts
    padded to 512 tokens as WanPipeline does). resolution 0 / num_frames 0: 480x832 px, 81 frames. What it draws is noise."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    why = check_size(resolution, num_frames)
    if why:
        raise ValueError(why)
    tok = build_umt5_tokenizer()
    device = torch.device(device)
    fork = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), device:
        torch.manual_seed(seed)
        with default_dtype(denoiser_dtype or torch_dtype):
            parts = dict(transformer=WanTransformer3DModel(**(transformer or WAN21_1_3B_TRANSFORMER)))
        with default_dtype(component_dtype("text_encoder", torch_dtype)):
            parts.update(text_encoder=UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
        with default_dtype(component_dtype("vae", torch_dtype, {"_class_name": "AutoencoderKLWan"})):
            parts.update(vae=AutoencoderKLWan(**WAN21_VAE))
    parts.update(tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))
    return ADAPTER.wrap(parts, "flow", name, resolution, num_frames)

"""A model's parameter and activation counts at a config's shapes, on the meta device (no weights, no memory):
what memory_plan.plan takes (ModelCounts), and the meta-device inputs benchmarks/bench_gpu_point.py counts FLOPs with.

Built models (models.BUILT) come from their builders on "meta"; a folder's components from its config files
(`meta_loading`: diffusers' and transformers' from_pretrained build from the config on the meta device inside it),
through the same adapter load as a run, so the shapes are the run's. Activations: one training forward of one row
with every denoiser parameter trainable, summing the bytes of the tensors autograd saves for backward (each once);
with gradient checkpointing, diffusers' checkpointed blocks (enable_gradient_checkpointing's function) keep only
their inputs, and the backward recomputes one block at a time, so the largest block's saved bytes are added once.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ddpo_grpo.models.base import inner_model

from ..run.build import make_trainable, trainable_modules
from .byte_meters import activation_bytes, nograd_peak_bytes


@dataclass
class ModelCounts:
    """Parameter and activation counts of one model at one config's shapes (count_model builds it)."""

    denoiser: int  # parameters of the denoiser
    lora: Optional[int]  # LoRA parameters at the config's rank on the adapter's target modules
    full_trainable: int  # parameters a full fine-tune trains (the whole denoiser unless the adapter names a part)
    text_encoders: Dict[str, int]  # frozen, in the run's dtype
    vae: int
    vae_bytes: Dict[str, int]  # run precision -> bytes per VAE parameter (models.base.component_dtype's rule)
    condition_elems: int  # one prompt's embedding, L x D (+ pooled vectors)
    num_prompts: int  # embeddings cached over a run: training + eval conditions + the negative prompt
    act_bytes: Optional[int]  # fp32 bytes saved for backward by one training row (one sample at one timestep)
    act_bytes_ckpt: Optional[int]  # the same with gradient checkpointing: block inputs + the largest block's
    # recompute (None: not counted, count_model's only_configured)
    act_bytes_lora: Optional[int] = None  # act_bytes with the config's LoRA adapters the only trainable parameters
    act_bytes_ckpt_lora: Optional[int] = None  # act_bytes_ckpt likewise (None: not counted)
    sample_shape: Tuple[int, ...] = ()  # the denoised sample's (C, [F,] H, W), for the reader
    act_precision: str = "no"  # the precision act_bytes* were counted in ("bf16"/"fp16": under autocast's rules)
    trained_steps: int = 1  # trainable stored steps per sample (sampler's columns with std >= train.min_step_std)
    sampling_bytes: Optional[int] = None  # working set of one no-grad sampling call (all its rows, CFG included)
    decode_bytes: Optional[int] = None  # working set of decoding one sampling batch (a video: all its frames)
    decode_kind: str = "image"  # memory_plan.DECODE_TRANSIENTS' key: "image" (2-D VAE, autocast) or "video3d"
    # (a latents_mean / latents_std 3-D VAE, Wan's: decoded in its own float32 with autocast off)
    pixel_shape: Tuple[int, ...] = ()  # a decoded sample's ([frames,] height, width) in px, for the reader
    tokens_per_frame: Tuple[int, ...] = ()  # a video transformer's (rows, columns) of patches per latent frame


def planned_sizes(pipe) -> tuple:
    """(pixel_shape, tokens_per_frame) of the pipe as configured: ([F,] H, W) px and, for a video transformer with
    a 3-D patch (Wan, ReCamMaster), the latent frame's H' / p_h x W' / p_w tokens (() otherwise)."""
    h, w = pipe.adapter.pixel_size(pipe)
    video = len(pipe.sample_shape) == 4
    pixels = ((int(pipe.num_frames),) if video else ()) + (int(h), int(w))
    patch = inner_model(pipe.unet).config.get("patch_size") if hasattr(inner_model(pipe.unet), "config") else None
    tokens = ()
    if video and isinstance(patch, (tuple, list)) and len(patch) == 3:
        tokens = (int(pipe.sample_shape[-2]) // int(patch[1]), int(pipe.sample_shape[-1]) // int(patch[2]))
    return pixels, tokens


# first text encoder -> (the ids of the text encoders and tokenizers it was read with, (L, D)): a meta count asks for
# the condition's shape four times per model (FLOPs, inputs, the sampling call, the plan) and a T5-XXL's meta encode
# costs ~1 s; the same encoders and tokenizers give the same shape.
_CONDITION_SHAPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def condition_shape(pipe) -> tuple:
    """(L, D) of one prompt's condition as pipe.encode gives it. Wan's from its sizes (WanPipeline's 512 tokens x
    UMT5's width): UMT5's padding mask reads a value, which a meta tensor has not. Read once per set of text encoders
    and tokenizers (_CONDITION_SHAPES)."""
    if pipe.adapter.name in ("wan", "recam"):
        from ddpo_grpo.models.wan import MAX_SEQUENCE_LENGTH

        return (MAX_SEQUENCE_LENGTH, int(pipe.text_encoder.config.d_model))
    encoders = pipe.text_encoders()
    tokenizers = [v for k, v in sorted((pipe.components or {}).items()) if k.startswith("tokenizer")]
    ids = (pipe.adapter.name, *map(id, encoders), *map(id, tokenizers), id(pipe.tokenizer))
    known = _CONDITION_SHAPES.get(encoders[0]) if encoders else None
    if known is not None and known[0] == ids:
        return known[1]
    with torch.no_grad():
        shape = tuple(pipe.encode([""]).shape[1:])
    if encoders:
        _CONDITION_SHAPES[encoders[0]] = (ids, shape)
    return shape


def denoiser_inputs(pipe, rows: int = 1) -> tuple:
    """Meta tensors of one denoiser call: x (rows, *sample_shape), t (rows,) and the condition (rows, L, D)."""
    C, *rest = pipe.sample_shape  # plus the conditioning channels the denoiser takes (ReCamMaster: source, camera)
    extra = pipe.adapter.condition_channel_count(pipe)
    cfg = inner_model(pipe.unet).config
    if not extra and cfg.get("out_channels") and cfg.get("in_channels", 0) > cfg["out_channels"]:
        extra = cfg["in_channels"] - cfg["out_channels"]  # channels that come with the data (recam image world)
    x = torch.zeros(rows, C + extra, *rest, device="meta")
    cond = torch.zeros(rows, *condition_shape(pipe), device="meta")
    return x, torch.full((rows,), 500.0, device="meta"), cond


@contextlib.contextmanager
def meta_loading():
    """Inside: diffusers' ModelMixin.from_pretrained and transformers' PreTrainedModel.from_pretrained build the
    model from its folder's config on the meta device (no weight file is read), so an adapter's own load gives a
    meta pipeline of a user's folder."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    saved = ModelMixin.__dict__["from_pretrained"], PreTrainedModel.__dict__["from_pretrained"]

    # (torch_dtype is ignored: the plan counts elements and applies its own dtype rules)
    def diffusers_from(cls, path, subfolder=None, **_):
        config = cls.load_config(path, subfolder=subfolder, local_files_only=True)
        with torch.device("meta"):
            return cls.from_config(config)

    def transformers_from(cls, path, *_, subfolder="", **__):
        config = cls.config_class.from_pretrained(path, subfolder=subfolder, local_files_only=True)
        with torch.device("meta"):
            return cls(config)

    ModelMixin.from_pretrained = classmethod(diffusers_from)
    PreTrainedModel.from_pretrained = classmethod(transformers_from)
    try:
        yield
    finally:
        ModelMixin.from_pretrained, PreTrainedModel.from_pretrained = saved


def meta_pipeline(config):
    """The config's model as a LoadedPipeline on the meta device, configured as a run configures it."""
    from ddpo_grpo.models import BUILT, load_pipeline, recam_checkpoint_path

    model, res = config.pretrained.model, int(config.pretrained.resolution)
    if model in BUILT:
        pipe = load_pipeline(model, torch.float32, "meta", res)
    else:
        from ddpo_grpo.models import recam

        with meta_loading():
            pipe = load_pipeline(model, torch.float32, "meta", res)
        if recam_checkpoint_path(config):
            # ReCamMaster over the Wan folder: its camera layers on the folder's transformer, as RecamAdapter.load
            # builds it, without reading the checkpoint's weights (validate_config has checked that they fit)
            pipe.unet = recam.RecamDenoiser(recam.add_camera_layers(pipe.components["transformer"]))
            pipe.adapter = recam.ADAPTER
    pipe.adapter.configure(pipe, config)  # FLUX-dev's embedded guidance, Wan's frames
    return pipe


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def lora_count(pipe, config) -> int:
    """LoRA parameters make_trainable adds at the config's rank (on the meta denoiser, which it changes)."""
    denoiser = inner_model(pipe.unet)
    before = _numel(denoiser)
    lora_config = config.copy_and_resolve_references()
    lora_config.use_lora = True
    make_trainable(pipe.unet, lora_config, trainable_modules(config, pipe.adapter)[0])
    return _numel(denoiser) - before


def trained_steps(config, pipe) -> int:
    """Trainable stored steps per sample: the sampler's stored columns (its stochastic steps, or an SDE window's, the
    most of any window position) whose std is >= train.min_step_std (update.trainable_columns' rule, on the
    schedule's stds: ModelFamily.step_stds, no model)."""
    from types import SimpleNamespace

    from ddpo_grpo.core.policy_step import schedule_stds

    from ..epoch.sampling import sampler_settings, stochastic_steps
    from ..epoch.update import trainable_columns

    n = stochastic_steps(config, pipe.family, pipe.scheduler)
    stds = schedule_stds(pipe.scheduler, sampler_settings(config, pipe.family), int(config.sample.num_steps))
    w = int(config.sample.get("sde_window_size", 0) or 0)
    windows = [range(a, a + w) for a in range(n - w + 1)] if w else [range(n)]
    return max(len(trainable_columns(SimpleNamespace(log_probs=torch.empty(0, len(r)), step_std=stds[list(r)]),
                                     config)) for r in windows)


def decode_kind(vae) -> str:
    """"video3d" for a VAE that core.pipeline_with_logprob.decode runs in its own dtype with autocast off (a
    latents_mean / latents_std VAE without scaling_factor: Wan's AutoencoderKLWan, float32 by
    models.base.component_dtype), else "image" (decoded under the run's autocast)."""
    cfg = getattr(vae, "config", None)
    if cfg is not None and getattr(cfg, "scaling_factor", None) is None and getattr(cfg, "latents_mean", None) is not None:
        return "video3d"
    return "image"


def phase_bytes(config, pipe, precision: str) -> tuple:
    """(sampling, decode): the no-grad working sets of one sampling call (sample.batch_size rows, x2 under CFG) and
    of decoding one sampling batch through core.pipeline_with_logprob.decode (a video: every frame), on meta.
    Weights are not in them (the plan's static rows hold them once). A "video3d" VAE decodes with autocast off in
    its float32 (decode's rule), so its decode is counted in float32 whatever the run's precision."""
    from ddpo_grpo.core.pipeline_with_logprob import decode

    B = int(config.sample.batch_size)
    rows = B * (2 if float(config.sample.guidance_scale) != 1.0 else 1)
    x, t, cond = denoiser_inputs(pipe, rows)
    p = next(pipe.unet.parameters())
    sampling = nograd_peak_bytes(lambda: pipe.unet(x.to(p), t, encoder_hidden_states=cond.to(p)), precision)
    decoding = None
    if pipe.vae is not None:
        z = torch.zeros(B, *pipe.sample_shape, device="meta")
        decoding = nograd_peak_bytes(lambda: decode(pipe.vae, z),
                                     "no" if decode_kind(pipe.vae) == "video3d" else precision)
    return sampling, decoding


def count_model(config, pipe=None, only_configured: bool = False, precision: str = "no",
                configured_mode_only: bool = False) -> ModelCounts:
    """ModelCounts of the config's model at its resolution / frames (meta device; module docstring); `pipe`: a meta
    pipeline to count instead of the config's model (configured here). only_configured: skip what the config's own
    plan does not read (the other activation count, LoRA when it trains fully: None), as a run without a verdict.
    precision: the run's ("no", "bf16", "fp16"); activations and phases are counted under its autocast rules.
    configured_mode_only: both gradient-checkpointing counts, but only for the config's own training mode (LoRA or
    full; the other mode's are None): what a plan with and without checkpointing reads, at half the meta traces."""
    from ddpo_grpo.models.base import component_dtype

    from ..run.data import build_dataset

    if pipe is None:
        pipe = meta_pipeline(config)
    else:
        pipe.adapter.configure(pipe, config)
    denoiser = inner_model(pipe.unet)
    n_denoiser = _numel(denoiser)
    frags = trainable_modules(config, pipe.adapter)[1]
    full = sum(p.numel() for name, p in denoiser.named_parameters() if not frags or any(f in name for f in frags))
    encoders = {k: _numel(v) for k, v in sorted(pipe.components.items()) if k.startswith("text_encoder")
                and isinstance(v, torch.nn.Module)}
    if not encoders and pipe.text_encoder is not None:
        encoders = {"text_encoder": _numel(pipe.text_encoder)}
    vae_config = dict(getattr(pipe.vae, "config", {}) or {}, _class_name=type(pipe.vae).__name__)
    vae_bytes = {p: torch.finfo(component_dtype("vae", d, vae_config)).bits // 8
                 for p, d in (("no", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    L, D = condition_shape(pipe)
    prompts = 1 + sum(len(build_dataset(config, split)) for split in ("train", "eval"))
    inputs = denoiser_inputs(pipe)
    sampling, decoding = phase_bytes(config, pipe, precision)

    def traced(lora: bool, ckpt: bool) -> bool:  # which of the four activation counts this call makes
        return ((not only_configured or ckpt == bool(config.gradient_checkpointing))
                and (not configured_mode_only or lora == bool(config.use_lora)))

    act, act_ckpt = (activation_bytes(pipe.unet, inputs, ckpt, precision) if traced(False, ckpt) else None
                     for ckpt in (False, True))
    lora = act_lora = act_ckpt_lora = None
    if config.use_lora or not only_configured:
        # A LoRA run saves less than a full one: its frozen linears keep no input for a weight gradient (measured on
        # the H100: SD3.5 LoRA's training call 25.4 GiB against 38.2 planned with every parameter trainable). So
        # its activations are counted again with the run's own adapters, the base frozen. (The adapters' count is
        # kept for a full run's plan too: the report weighs LoRA as a switch.)
        denoiser.requires_grad_(False)
        lora = lora_count(pipe, config)
        act_lora, act_ckpt_lora = (activation_bytes(pipe.unet, inputs, ckpt, precision, all_trainable=False)
                                   if traced(True, ckpt) else None for ckpt in (False, True))
    return ModelCounts(denoiser=n_denoiser, lora=lora, full_trainable=full, text_encoders=encoders,
                       vae=_numel(pipe.vae), vae_bytes=vae_bytes, condition_elems=L * D, num_prompts=prompts,
                       act_bytes=act, act_bytes_ckpt=act_ckpt, act_bytes_lora=act_lora,
                       act_bytes_ckpt_lora=act_ckpt_lora, sample_shape=tuple(pipe.sample_shape),
                       act_precision=precision, trained_steps=trained_steps(config, pipe), sampling_bytes=sampling,
                       decode_bytes=decoding, decode_kind=decode_kind(pipe.vae), **dict(zip(("pixel_shape", "tokens_per_frame"), planned_sizes(pipe))))

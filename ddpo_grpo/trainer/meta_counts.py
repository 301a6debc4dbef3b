"""A model's parameter and activation counts at a config's shapes, on the meta device (no weights, no memory):
what memory_plan.plan takes (ModelCounts), and the meta-device inputs scripts/bench_gpu.py counts FLOPs with.

Built models (models.BUILT) come from their builders on "meta"; a folder's components from its config files
(`meta_loading`: diffusers' and transformers' from_pretrained build from the config on the meta device inside it),
through the same adapter load as a run, so the shapes are the run's. Activations: one training forward of one row
with every denoiser parameter trainable, summing the bytes of the tensors autograd saves for backward (each once);
with gradient checkpointing, diffusers' checkpointed blocks (enable_gradient_checkpointing's function) keep only
their inputs, and the backward recomputes one block at a time, so the largest block's saved bytes are added once.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch

from ddpo_grpo.models.base import inner_model

from .memory_plan import ModelCounts


def condition_shape(pipe) -> tuple:
    """(L, D) of one prompt's condition as pipe.encode gives it. Wan's from its sizes (WanPipeline's 512 tokens x
    UMT5's width): UMT5's padding mask reads a value, which a meta tensor has not."""
    if pipe.adapter.name in ("wan", "recam"):
        from ddpo_grpo.models.wan import MAX_SEQUENCE_LENGTH

        return (MAX_SEQUENCE_LENGTH, int(pipe.text_encoder.config.d_model))
    with torch.no_grad():
        return tuple(pipe.encode([""]).shape[1:])


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
    from ddpo_grpo.models import BUILT, load_pipeline

    model, res = config.pretrained.model, int(config.pretrained.resolution)
    if model in BUILT:
        pipe = load_pipeline(model, torch.float32, "meta", res)
    else:
        from ddpo_grpo.models import recam

        with meta_loading():
            pipe = load_pipeline(model, torch.float32, "meta", res)
        if recam.checkpoint_path(config):
            # ReCamMaster over the Wan folder: its camera layers on the folder's transformer, as RecamAdapter.load
            # builds it, without reading the checkpoint's weights (validate_config has checked that they fit)
            pipe.unet = recam.RecamDenoiser(recam.add_camera_layers(pipe.components["transformer"]))
            pipe.adapter = recam.ADAPTER
    pipe.adapter.configure(pipe, config)  # FLUX-dev's embedded guidance, Wan's frames
    return pipe


def _flash_sdpa(*args, **kwargs):
    """scaled_dot_product_attention on meta tensors, saving what the fused kernels save (q, k, v, out, logsumexp)."""
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - counting only runs the forward
            q, k, v, *_ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    return FusedAttention.apply(q, k, v)


class SavedBytes:
    """Bytes of the tensors autograd saves inside it (parameters excluded, each tensor once); with `blocks`, the
    saved bytes of each gradient-checkpointed block are kept apart (`block_max`) and only the blocks' inputs count
    in `outside`."""

    def __init__(self):
        self.seen: Dict[int, torch.Tensor] = {}
        self.outside = 0
        self.block_max = 0
        self._stack = []

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter):
            return
        base = t if t._base is None else t._base  # a view holds its base's memory: count each base once
        if id(base) in self.seen or isinstance(base, torch.nn.Parameter):
            return
        self.seen[id(base)] = base  # kept alive so that an id is never reused within the count
        n = base.numel() * base.element_size()
        if self._stack:
            self._stack[-1] += n
        else:
            self.outside += n

    def checkpoint(self, block, *args):
        """diffusers' gradient_checkpointing_func: the block's inputs are what a checkpoint keeps."""
        for a in args:
            if isinstance(a, torch.Tensor):
                self._add(a)
        self._stack.append(0)
        try:
            return block(*args)
        finally:
            self.block_max = max(self.block_max, self._stack.pop())

    @contextlib.contextmanager
    def counting(self):
        import torch.nn.functional as F

        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _flash_sdpa
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._add(t) or t, lambda t: t):
                yield self
        finally:
            F.scaled_dot_product_attention = sdpa


def activation_bytes(unet, inputs, checkpointing: bool) -> int:
    """Bytes saved for backward by one training forward of `unet` on `inputs` (x, t, cond: denoiser_inputs) at its
    parameters' dtype, every parameter trainable; with `checkpointing`, block inputs + the largest block's bytes.
    Any device: on "meta" nothing is computed."""
    unet.requires_grad_(True)
    counter = SavedBytes()
    if checkpointing:
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=counter.checkpoint)
    p = next(unet.parameters())
    x, t, cond = inputs
    try:
        with counter.counting():
            unet(x.to(p), t.to(p.device), encoder_hidden_states=cond.to(p))
    finally:
        if checkpointing:
            inner_model(unet).disable_gradient_checkpointing()
    return counter.outside + counter.block_max


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def lora_count(pipe, config) -> int:
    """LoRA parameters make_trainable adds at the config's rank (on the meta denoiser, which it changes)."""
    from .build import make_trainable

    denoiser = inner_model(pipe.unet)
    before = _numel(denoiser)
    lora_config = config.copy_and_resolve_references()
    lora_config.use_lora = True
    make_trainable(pipe.unet, lora_config, pipe.adapter.lora_target_modules)
    return _numel(denoiser) - before


def count_model(config, pipe=None, only_configured: bool = False) -> ModelCounts:
    """ModelCounts of the config's model at its resolution / frames (meta device; module docstring); `pipe`: a meta
    pipeline to count instead of the config's model (configured here). only_configured: skip what the config's own
    plan does not read (the other activation count, LoRA when it trains fully: None), as a run without a verdict."""
    from ddpo_grpo.models.base import component_dtype

    from .data import build_dataset

    if pipe is None:
        pipe = meta_pipeline(config)
    else:
        pipe.adapter.configure(pipe, config)
    denoiser = inner_model(pipe.unet)
    n_denoiser = _numel(denoiser)
    frags = pipe.adapter.full_trainable
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
    act, act_ckpt = (activation_bytes(pipe.unet, inputs, ckpt)
                     if not only_configured or ckpt == bool(config.gradient_checkpointing) else None
                     for ckpt in (False, True))
    lora = lora_count(pipe, config) if config.use_lora or not only_configured else None
    return ModelCounts(denoiser=n_denoiser, lora=lora, full_trainable=full, text_encoders=encoders,
                       vae=_numel(pipe.vae), vae_bytes=vae_bytes, condition_elems=L * D, num_prompts=prompts,
                       act_bytes=act, act_bytes_ckpt=act_ckpt, sample_shape=tuple(pipe.sample_shape))


"""Bytes a forward holds, counted on any device (meta included: nothing is computed): what autograd saves for
backward in one training forward (SavedBytes, activation_bytes) and the peak of a no-grad call's live tensors
(LiveBytes, nograd_peak_bytes), in fp32 or under CUDA autocast's dtype rules emulated (AutocastEmulation).
Attention counts as the fused kernels save it (q, k, v, out, logsumexp; no L x L matrix). meta_counts reads these
to count a model at a config's shapes.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddpo_grpo.models.base import inner_model


def _flash_sdpa(*args, **kwargs):
    """scaled_dot_product_attention on meta tensors, saving what the fused kernels save (q, k, v, out, logsumexp);
    under an emulated autocast q, k, v are cast to its dtype first, as autocast casts them."""
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
    if _EMULATED[0] is not None:
        q, k, v = (_EMULATED[0].cast(a, _EMULATED[0].low) for a in (q, k, v))

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


# CUDA autocast's op lists (torch/csrc/autograd/autocast_mode.cpp), the ops a denoiser's forward calls: these run in
# the low dtype (inputs cast to it) ...
AUTOCAST_LOW = frozenset(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                          "linear", "matmul", "__matmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum"))
# ... and these in fp32 (inputs cast up: a norm after a bf16 conv saves an fp32 copy of its input). Anything else
# runs in its inputs' widest dtype (a bf16 + fp32 residual add is fp32), as under autocast.
AUTOCAST_FP32 = frozenset(("group_norm", "layer_norm", "rms_norm", "softmax", "log_softmax"))
_EMULATED = [None]  # the AutocastEmulation in force (read by _flash_sdpa)
_UNCOUNTED = [0]  # > 0 while the emulation casts a parameter: LiveBytes does not count what is made then


class AutocastEmulation(torch.overrides.TorchFunctionMode):
    """CUDA autocast's dtype rules on any device, meta included (autocast itself acts only on its device's tensors),
    applied above autograd, so that the tensors autograd saves have the dtypes they have in a bf16 / fp16 run.
    Why: under autocast a norm keeps an fp32 copy of its input and its fp32 output feeds the activation function, so
    a bf16 run saves about 0.8x the fp32 bytes, not half (measured on an H100: sd15 at 512 px, issue 50). Parameters
    are cast once (autocast's weight cache) and their casts are not activations (`skip`)."""

    def __init__(self, low: torch.dtype):
        super().__init__()
        self.low = low
        self.skip: Dict[int, torch.Tensor] = {}  # id -> a parameter's cast (kept alive so that ids stay unique)
        self._weights: Dict[int, torch.Tensor] = {}

    def cast(self, t, dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return t
        if isinstance(t, torch.nn.Parameter):
            key = (id(t), dtype)
            if key not in self._weights:
                # Not a working-set tensor: a LoRA run holds its frozen base in this dtype already (no cast), and a
                # full fine-tune's cast cache is the plan's static "autocast weight casts" row. LiveBytes counting
                # it made FLUX's 8-row sampling call 22 GiB of weights a second time (issue 61).
                _UNCOUNTED[0] += 1
                try:
                    self._weights[key] = t.to(dtype)
                finally:
                    _UNCOUNTED[0] -= 1
                self.skip[id(self._weights[key])] = self._weights[key]
            return self._weights[key]
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dtype = self.low if name in AUTOCAST_LOW else torch.float32 if name in AUTOCAST_FP32 else None
        if dtype is not None:
            from torch.utils._pytree import tree_map

            args, kwargs = tree_map(lambda a: self.cast(a, dtype), (args, kwargs))
        return func(*args, **kwargs)


class SavedBytes:
    """Bytes of the tensors autograd saves inside it (parameters excluded, each tensor once); with `blocks`, the
    saved bytes of each gradient-checkpointed block are kept apart (`block_max`) and only the blocks' inputs count
    in `outside`."""

    def __init__(self, low: Optional[torch.dtype] = None):
        self.autocast = AutocastEmulation(low) if low is not None else None
        self.seen: Dict[int, torch.Tensor] = {}
        self.outside = 0
        self.block_max = 0
        self._stack = []

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter):
            return
        base = t if t._base is None else t._base  # a view holds its base's memory: count each base once
        if id(base) in self.seen or isinstance(base, torch.nn.Parameter) or (
                self.autocast is not None and id(base) in self.autocast.skip):
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
        _EMULATED[0] = self.autocast
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._add(t) or t, lambda t: t), \
                    (self.autocast or contextlib.nullcontext()):
                yield self
        finally:
            F.scaled_dot_product_attention = sdpa
            _EMULATED[0] = None


def activation_bytes(unet, inputs, checkpointing: bool, precision: str = "no", all_trainable: bool = True) -> int:
    """Bytes saved for backward by one training forward of `unet` on `inputs` (x, t, cond: denoiser_inputs; their
    leading dim is the rows) every parameter trainable (all_trainable=False: the parameters' requires_grad as set,
    e.g. a LoRA run's adapters only: a frozen linear keeps no input for its weight's gradient), in fp32 ("no") or
    under autocast to bf16 / fp16 (emulated: AutocastEmulation); with `checkpointing`, block inputs + the largest
    block's bytes. Any device: on "meta" nothing is computed."""
    if all_trainable:
        unet.requires_grad_(True)
    counter = SavedBytes({"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
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


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside it (each new storage from its creation until its last Python
    reference goes; views are not new storage). Valid for no-grad work only: a tensor autograd saves for backward
    outlives its Python object, which this cannot see."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _UNCOUNTED[0]:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:  # an alias (view, in-place) is not new memory
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out


def nograd_peak_bytes(fn, precision: str = "no") -> int:
    """Peak bytes of the tensors `fn()` makes under no_grad (its inputs and parameters excluded: made before; the
    emulation's casts of parameters too: weights are the plan's static rows, counted once there), in
    fp32 or under emulated autocast (AutocastEmulation): the working set of a sampling call or a VAE decode. Meta."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    emulation = AutocastEmulation(low) if low is not None else contextlib.nullcontext()
    live = LiveBytes()
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa  # no L x L matrix, as the fused kernels
    _EMULATED[0] = emulation if low is not None else None
    try:
        with torch.no_grad(), emulation, live:
            fn()
    finally:
        F.scaled_dot_product_attention = sdpa
        _EMULATED[0] = None
    return live.peak

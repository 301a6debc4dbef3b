"""A reference policy that follows the trained policy by EMA: theta_ref <- a*theta_ref + (1-a)*theta
every update_freq optimizer steps (alpha = 1: the frozen starting model).

Only the policy's trainable parameters are copied: frozen ones are shared with the policy since
they never change. Memory: full fine-tuning holds one extra copy of the trainable parameters;
LoRA (peft, or diffusers' add_adapter) holds only the adapter tensors, no second UNet.
The reference forward runs on the policy module itself, with the reference values swapped in:

    with ref.swapped():            # grad disabled inside; policy values restored bit-exactly
        ref_out = policy(x)

LoRA caveat: the EMA is taken of the factors A and B separately, so the reference's weight delta
B_ref @ A_ref is not the EMA of the deltas B @ A (it is exact for alpha = 1 and alpha = 0).

LoRA holds no second copy of the base: the reference is the policy's own frozen base with the reference's adapter
values. At alpha = 1 those are the initial ones, B = 0 (init_lora_weights="gaussian"), so the reference forward is
bit for bit the base with peft's adapter disabled (tests/test_memory_switches.py), whatever the base's dtype (a LoRA
run's base is in the run's dtype: models.base.component_dtype).

Autocast: enter the swap outside the autocast context (`with ref.swapped(), autocast():`, as the trainer does).
torch.autocast caches its low-precision casts of float32 leaf parameters that require grad for the life of its
outermost context, so a forward of the policy and a swap inside one context would run the reference on the
policy's cached casts.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP/accelerate and torch.compile wrappers


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2-sharded (DTensor) one (a collective: every process calls it), else t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `ref`: this process's shard when ref is a DTensor, else full itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(ref, DTensor):
        return full
    return distribute_tensor(full.to(device=ref.device, dtype=ref.dtype), ref.device_mesh, ref.placements)


def _is_adapter_param(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


class EMAReference:
    """EMA copy of a policy's trainable parameters, swapped into the policy to run the reference.

    policy: the module being trained (tracked: its parameters with requires_grad at construction).
    alpha: mixing weight of the old reference in [0, 1]; update_freq: optimizer steps per mix.
    lora: None detects adapters by parameter name ("lora_"); True additionally requires every
    tracked parameter to be an adapter parameter (guards against holding a full copy by mistake).
    dtype/device: where to keep the copy (default: each parameter's own), e.g. float32 for a
    bf16 policy so small EMA increments are not rounded away, or "cpu" to offload.
    warmup: the weight of the old copy at the n-th mix is min(alpha, (1 + s) / (10 + s)), s = n - 1 (0 at the
    first mix: a copy), as diffusers' EMAModel decays without use_ema_warmup, so that an average over the
    last ~10 % of the mixes follows a policy that is still climbing instead of holding on to the start.
    """

    def __init__(self, policy: torch.nn.Module, alpha: float, update_freq: int = 1, lora: Optional[bool] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 warmup: bool = False) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if update_freq < 1:
            raise ValueError(f"update_freq must be >= 1, got {update_freq}")
        self.alpha = float(alpha)
        self.update_freq = int(update_freq)
        self.warmup = bool(warmup)
        self._policy_params = {_strip(n): p for n, p in policy.named_parameters() if p.requires_grad}
        if not self._policy_params:
            raise ValueError("the policy has no trainable parameters to track")
        adapters = [n for n in self._policy_params if _is_adapter_param(n)]
        if lora:
            others = [n for n in self._policy_params if not _is_adapter_param(n)]
            if not adapters or others:
                raise ValueError(f"lora=True but trainable non-adapter parameters exist, e.g. {others[:3]}"
                                 if others else "lora=True but the policy has no LoRA parameters")
        self.is_lora = bool(adapters) if lora is None else bool(lora)
        self.tensors: Dict[str, torch.Tensor] = {
            n: p.detach().to(device=device or p.device, dtype=dtype or p.dtype, copy=True)
            for n, p in self._policy_params.items()
        }
        self.num_steps = 0
        self.num_updates = 0
        self._active = False

    @property
    def numel(self) -> int:
        """Number of elements held by the reference."""
        return sum(t.numel() for t in self.tensors.values())

    def _params(self, policy: Optional[torch.nn.Module]) -> Dict[str, torch.nn.Parameter]:
        if policy is None:
            return self._policy_params
        found = {_strip(n): p for n, p in policy.named_parameters()}
        missing = [n for n in self.tensors if n not in found]
        if missing:
            raise KeyError(f"policy lacks reference parameters, e.g. {missing[:3]}")
        params = {n: found[n] for n in self.tensors}
        for n, p in params.items():
            if p.shape != self.tensors[n].shape:
                raise ValueError(f"{n}: policy shape {tuple(p.shape)} != reference {tuple(self.tensors[n].shape)}")
        return params

    def mix_weight(self, n: int) -> float:
        """The old copy's weight at the n-th mix (n >= 1): alpha, or with warmup min(alpha, (1 + s) / (10 + s)),
        s = n - 1."""
        if not self.warmup:
            return self.alpha
        s = n - 1
        return 0.0 if s <= 0 else min(self.alpha, (1.0 + s) / (10.0 + s))

    @torch.no_grad()
    def step(self, policy: Optional[torch.nn.Module] = None) -> bool:
        """Count one optimizer step; every update_freq-th call mix the policy in. Returns whether it
        mixed. policy defaults to the module given at construction (pass a wrapped one if needed)."""
        if self._active:
            raise RuntimeError("step() inside swapped(): the policy holds the reference values")
        self.num_steps += 1
        if self.num_steps % self.update_freq != 0:
            return False
        self.num_updates += 1
        a = self.mix_weight(self.num_updates)
        if a == 1.0:
            return True
        for n, p in self._params(policy).items():
            t = self.tensors[n]
            src = p.detach().to(device=t.device, dtype=t.dtype)
            if a == 0.0:
                t.copy_(src)
            else:
                t.mul_(a).add_(src, alpha=1.0 - a)
        return True

    @contextmanager
    def swapped(self, policy: Optional[torch.nn.Module] = None) -> Iterator[None]:
        """Run the block with the reference values in the policy's parameters and grad disabled.

        The policy values are restored bit-exactly on exit, also on exceptions. The swap is in
        place: an autograd graph built on the policy weights before the swap can no longer be
        backpropagated (torch raises), so run the reference forward before the policy forward.
        Extra memory: one tensor at a time when dtypes match, else a copy of the policy values.
        While swapped, self.tensors hold the parked policy values: read the reference from the
        policy's parameters, not from self.tensors.
        """
        if self._active:
            raise RuntimeError("swapped() is not reentrant")
        params = self._params(policy)
        done: List[str] = []
        backup: Dict[str, torch.Tensor] = {}
        self._active = True
        try:
            with torch.no_grad():
                for n, p in params.items():
                    t = self.tensors[n]
                    if t.dtype == p.dtype and t.device == p.device:
                        # Exchange values through one temporary: the policy's value parks in the
                        # reference's storage and comes back unchanged.
                        tmp = p.detach().clone()
                        p.copy_(t)
                        t.copy_(tmp)
                    else:
                        backup[n] = p.detach().clone()
                        p.copy_(t)
                    done.append(n)
            with torch.no_grad():
                yield
        finally:
            with torch.no_grad():
                for n in done:
                    p, t = params[n], self.tensors[n]
                    if n in backup:
                        p.copy_(backup[n])
                    else:
                        tmp = p.detach().clone()
                        p.copy_(t)
                        t.copy_(tmp)
            self._active = False

    def state_dict(self) -> Dict[str, object]:
        """Reference tensors (CPU clones; whole tensors under FSDP2, so every process must call this, as
        accelerate's save_state does) and counters."""
        return {"alpha": self.alpha, "update_freq": self.update_freq, "num_steps": self.num_steps,
                "num_updates": self.num_updates,
                "tensors": {n: _whole(t.detach()).cpu().clone() for n, t in self.tensors.items()}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Load tensors and counters; names and shapes must match. alpha, update_freq and warmup are kept
        from the constructor (a resumed run may change them on purpose)."""
        tensors = state["tensors"]
        if set(tensors) != set(self.tensors):
            diff = sorted(set(tensors) ^ set(self.tensors))
            raise KeyError(f"reference state does not match the tracked parameters, e.g. {diff[:3]}")
        with torch.no_grad():
            for n, t in self.tensors.items():
                if tensors[n].shape != t.shape:
                    raise ValueError(f"{n}: saved shape {tuple(tensors[n].shape)} != {tuple(t.shape)}")
                t.copy_(_shard_like(tensors[n], t))  # FSDP2: this process's shard of the saved whole tensor
        self.num_steps = int(state["num_steps"])
        self.num_updates = int(state["num_updates"])

"""Shared helpers for the per-step policy math: Gaussian log densities and batch broadcasting.

Every sampler step in this package is a Gaussian transition
    p(x_prev | x_t) = N(x_prev; mean, std^2 I),
so the policy's log-probability of an action is a Gaussian log density. The DDPO convention,
followed here, is to *average* the per-element log density over all non-batch dimensions
instead of summing it: the value then does not scale with the image size, which keeps the
clipping range of the PPO ratio meaningful across resolutions.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

# 0.5 * log(2π), the normalising constant of a unit Gaussian, per element.
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

GeneratorLike = Optional[Union[torch.Generator, List[torch.Generator]]]


def expand_to_ndim(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a per-sample tensor so that it broadcasts against a sample with `ndim` dimensions.

    Args:
        values: shape (B,) (one value per sample) or () (one value for the whole batch).
        ndim: number of dimensions of the sample it must broadcast with, e.g. 4 for images
            (B, C, H, W) or 5 for video (B, F, C, H, W).

    Returns:
        `values` viewed as (B, 1, ..., 1) (or (1, 1, ..., 1) for a 0-d input) with `ndim` dims.
    """
    if values.ndim > 1:
        raise ValueError(f"expected a per-sample tensor of shape (B,) or (), got shape {tuple(values.shape)}")
    return values.reshape(-1, *([1] * (ndim - 1)))


def per_sample(values: Union[int, float, torch.Tensor], batch_size: int, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """Turn a scalar or a per-sample value into a tensor of shape (B,).

    Accepts a Python number, a 0-d tensor, a (1,) tensor or a (B,) tensor, so callers can pass
    either the same timestep for the whole batch (sampling) or one per sample (training, where
    the steps of different trajectories are shuffled together).
    """
    t = torch.as_tensor(values, device=device, dtype=dtype).reshape(-1)
    if t.numel() == 1:
        return t.expand(batch_size)
    if t.numel() != batch_size:
        raise ValueError(f"expected one value or {batch_size} per-sample values, got {t.numel()}")
    return t


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor,
                      std: Union[torch.Tensor, float]) -> torch.Tensor:
    """Log density of `x` under N(mean, std^2), averaged over all non-batch dimensions.

    Per element,
        log N(x; μ, σ²) = -(x - μ)² / (2σ²) - log σ - ½ log(2π),
    i.e. the fully normalised density (so values are comparable with
    `torch.distributions.Normal(mean, std).log_prob(x)`).

    Args:
        x: the action, shape (B, ...) e.g. (B, C, H, W).
        mean: the transition mean, same shape as `x`.
        std: the transition standard deviation, broadcastable to `x`: (B, 1, 1, 1), a 0-d
            tensor, or a float. Must be > 0.

    Returns:
        Tensor of shape (B,), float32 (the math is done in float32 whatever the input dtype,
        because bf16 squared differences lose most of their bits).
    """
    x = x.float()
    mean = mean.float()
    std = torch.as_tensor(std, device=x.device).float()
    log_prob = -((x - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _HALF_LOG_2PI
    # `std` may broadcast `log_prob` past x's shape only if it was mis-shaped; guard it so a
    # wrong-shaped std cannot silently change the batch size.
    if log_prob.shape != x.shape:
        raise ValueError(f"std of shape {tuple(std.shape)} does not broadcast to x of shape {tuple(x.shape)}")
    reduce_dims: Tuple[int, ...] = tuple(range(1, x.ndim))
    # torch's mean(dim=()) would reduce *every* dim, so a (B,) input is returned as is.
    return log_prob.mean(dim=reduce_dims) if reduce_dims else log_prob


def draw_noise(shape: Sequence[int], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """Standard normal noise of `shape`, float32, drawn like diffusers' `randn_tensor`.

    `generator` may be None, one torch.Generator, or a list of B generators (one per sample,
    so each sample's noise is reproducible independently of the batch it is drawn in).
    Noise is drawn in float32 (not the model dtype) so the sampled action does not depend on
    whether the model runs in bf16.
    """
    from diffusers.utils.torch_utils import randn_tensor

    if isinstance(generator, AntitheticNoise):
        return generator.draw(shape, device)
    if isinstance(generator, list) and len(generator) not in (1, shape[0]):
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
    return randn_tensor(tuple(shape), generator=generator, device=device, dtype=torch.float32)


_DEVICE_COPIES: Dict[tuple, tuple] = {}


def on_device(table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`table.to(device, dtype)`, made once per (table, device, dtype) and kept while `table` lives.

    For the scheduler's schedule tensors (alphas_cumprod, final_alpha_cumprod, sigmas), which live on the host and
    are read at every step: on an accelerator a fresh host->device copy per step is a transfer the host waits for
    (PyTorch synchronises after a blocking copy). diffusers replaces these tensors rather than writing into them
    (set_timesteps assigns new sigmas), so a copy keyed by the tensor's identity cannot go stale; it is dropped
    when the tensor is. Where no copy is needed (same device and dtype, e.g. on a CPU) `table` itself is returned."""
    if table.device == torch.device(device) and table.dtype == dtype:
        return table
    key = (id(table), str(device), dtype)
    hit = _DEVICE_COPIES.get(key)
    if hit is not None and hit[0]() is table:
        return hit[1]
    copy = table.to(device=device, dtype=dtype)
    _DEVICE_COPIES[key] = (weakref.ref(table, lambda _, k=key: _DEVICE_COPIES.pop(k, None)), copy)
    return copy


def check_positive_std(std: torch.Tensor, message: str) -> None:
    """Raise ValueError(message) if any per-sample std is zero (or not a positive finite number)."""
    if not bool(torch.all(torch.isfinite(std) & (std > 0))):
        raise ValueError(message)


class AntitheticNoise:
    """Step noise for a batch whose rows come in mirrored (antithetic) pairs: row r draws its noise from its own
    generator, seeded by `seeds[r]`, times `signs[r]`; the two rows of a pair share a seed and have opposite signs, so
    at every stochastic step one draws +eps and the other -eps, in whichever batches (or processes) they are sampled.
    Each row's noise is still standard normal, so every sample is the policy's and its log-prob is the step
    Gaussian's as before; only the pair is dependent. x_T is not drawn here: give the sampler its latents.

    Why: a group's policy gradient is sum_i A_i grad log p(x_i), A_i the group-relative advantage. With pairs that
    share x_T and draw +eps and -eps, the part of the reward that is even in eps (any perturbation costs quality,
    whatever its direction) cancels within the pair, and the pair's term is the finite difference
    (R(+eps) - R(-eps)) eps: evolution strategies' mirrored sampling. Pass it where a generator goes
    (pipeline_with_logprob, the step functions)."""

    def __init__(self, seeds: Sequence[int], signs: Sequence[float]):
        if len(seeds) != len(signs):
            raise ValueError(f"{len(seeds)} seeds for {len(signs)} signs")
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.signs = torch.tensor([float(x) for x in signs], dtype=torch.float32)

    def draw(self, shape: Sequence[int], device) -> torch.Tensor:
        """(B, ...) float32 noise, row r = signs[r] x a standard normal draw of its own generator."""
        if shape[0] != len(self.generators):
            raise ValueError(f"a batch of {shape[0]} rows for {len(self.generators)} mirrored-noise rows")
        noise = torch.stack([torch.randn(tuple(shape[1:]), generator=g, dtype=torch.float32) for g in self.generators])
        return (noise * self.signs.view(-1, *([1] * (noise.ndim - 1)))).to(device)


def mirrored_pairs(keys: Sequence[int]) -> List[Tuple[int, float]]:
    """For keys (a condition per row, in the epoch's order): each row's (pair index, sign). A key's copies pair in
    order of appearance, first with second (+1, -1), third with fourth, ...; a key's odd copy out is (n, +1) alone."""
    seen: Dict[int, int] = {}
    out = []
    for key in keys:
        c = seen.get(int(key), 0)
        seen[int(key)] = c + 1
        out.append((c // 2, 1.0 if c % 2 == 0 else -1.0))
    return out

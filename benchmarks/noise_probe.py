"""Can a DiT let its starting noise pick what it renders? The simplest form of the question, without the camera.

`pretrain_recam_video.py --noise-offset A` trains a room3d DiT whose target latents move by A along a fixed channel
direction `u` (orthogonal to the all-ones direction over channels) on the moved latent frames (1 and up; frame 0 is
the source camera's), for the draws whose noise reads above the fraction's quantile (`pretrain_pools.noise_mode`,
the reading `--mislabel-by noise` ties the opposite camera to). That effect is additive: a DiT that reads the mode a
little already lowers its loss a little, where the opposite camera needs the reading AND a sign gate on the camera
before either pays (docs/recam_log.md, sixteenth session: 4,000 steps read nothing). If a tiny DiT cannot learn this
either, what it lacks is the reading; if it can, it is the gate.

`offset_read` is the reading: on fixed pool clips, with the TRUE (unmoved) targets for every draw, so that the only
difference between the two halves is the noise's mode, the mean offset along `u` of the DiT's predicted x0 on the
moved frames (less the true target's), mode above minus mode below, over A. 1: the DiT renders the noise's offset;
0: it does not read it.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch

from benchmarks.pretrain_pools import mode_threshold, noise_mode


def offset_direction(channels: int) -> torch.Tensor:
    """(C,) unit vector (+1, -1, +1, ...) / norm over the latent channels: orthogonal to the all-ones direction for an
    even C, so the offset is not the mean that `noise_mode` sums (a DiT must read one and write the other)."""
    if channels < 2 or channels % 2:
        raise ValueError(f"offset_direction needs an even number of channels >= 2, got {channels}")
    u = torch.tensor([1.0 if c % 2 == 0 else -1.0 for c in range(channels)])
    return u / u.norm()


def apply_offset(x0: torch.Tensor, moved: torch.Tensor, amount: float) -> torch.Tensor:
    """Target latents x0 (B, C, F', h, w) with `amount` * u added on frames 1.. of the rows where `moved` (B,) bool."""
    u = offset_direction(x0.shape[1]).to(x0)
    out = x0.clone()
    out[:, :, 1:] += (moved.to(x0).view(-1, 1, 1, 1, 1) * amount) * u.view(1, -1, 1, 1, 1)
    return out


def probe_inputs(x0: torch.Tensor, src: torch.Tensor, cams: torch.Tensor, emb: torch.Tensor, seed: int,
                 first_frame: bool, fraction: float, n: int = 64):
    """offset_read's fixed inputs from a pool's latents x0 / src (N, C, F', h, w), cameras (N, F', 12) and its first
    items' prompt embeddings emb (>= min(n, N), L, D): the first n items, their true targets and seeded noises, and
    the noises' modes; None when the noises are all of one mode (a fraction of 0 or 1: nothing to read)."""
    n = min(n, len(x0))
    noise = torch.randn((n,) + tuple(x0.shape[1:]), generator=torch.Generator().manual_seed(seed)).to(x0.device)
    mode = noise_mode(noise, first_frame) > mode_threshold(fraction)
    if mode.all() or not mode.any():
        return None
    return x0[:n], src[:n], cams[:n], emb[:n], noise, mode


@torch.no_grad()
def offset_read(predict: Callable, x0: torch.Tensor, src: torch.Tensor, cams: torch.Tensor, emb: torch.Tensor,
                noise: torch.Tensor, mode: torch.Tensor, amount: float,
                sigmas: Sequence[float] = (0.95, 0.8)) -> Dict[float, float]:
    """{sigma: read} for true targets x0 (B, C, F', h, w), source latents src, cameras (B, F', 12), prompt embeddings
    emb (B, L, D), noises (B, C, F', h, w) whose modes `mode` (B,) bool hold both values; predict(xt, src, cams, emb,
    sigma (B,)) -> velocity. read = (mean <x0_hat - x0, u> on frames 1.. over mode rows - over the others) / amount."""
    if mode.all() or not mode.any():
        raise ValueError("offset_read needs noises of both modes")
    u = offset_direction(x0.shape[1]).to(x0)
    out = {}
    for s in sigmas:
        sig = torch.full((len(x0),), float(s), dtype=x0.dtype, device=x0.device)
        xt = (1 - s) * x0 + s * noise
        x0_hat = xt - s * predict(xt, src, cams, emb, sig)
        err = (x0_hat - x0)[:, :, 1:]  # against the true target: the items' own projections on u cancel
        proj = torch.einsum("bcfhw,c->b", err, u) / err[0, 0].numel()  # mean over frames 1.. and positions
        out[float(s)] = float((proj[mode].mean() - proj[~mode].mean()) / amount)
    return out

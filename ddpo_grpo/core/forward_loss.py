"""Forward-process objectives: train on the sampled final images with the model's own denoising loss.

The clipped-ratio GRPO loss credits each denoising *action* through its log-probability. These objectives
instead re-noise the sampled clean image x0 at a random noise level and regress the denoiser onto the
usual target, weighted by what the group-relative advantages say about the sample:

- "raft":  best-of-N supervision (RAFT, Dong et al. 2023): the best sample of each group that has any
  reward spread gets the plain denoising loss, the others none. The baseline a policy-gradient
  fine-tuner must beat.
- "nft":   DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): every sample, with optimality weight
  r = 1/2 + 1/2 clip(A / scale, -1, 1), trains an implicit positive policy v+ = (1-b) v_old + b v and
  an implicit negative policy v- = (1+b) v_old - b v:  L = r |v+ - target|^2 + (1 - r) |v- - target|^2.
  At v = v_old its gradient is 2 b (2r - 1) (v_old - target): advantage-weighted denoising, pulling
  the model towards good samples and away from bad ones. No log-probabilities, any sampler.

Nothing here imports the training loop: the loop (training_forward.py) calls these.
"""
from __future__ import annotations

from typing import Tuple, Union

import numpy as np
import torch

from .families import ModelFamily, get_family
from .stat_tracking import zero_spread

OBJECTIVES = ("grpo", "raft", "nft")


def noised_and_target(scheduler, family: Union[str, ModelFamily], x0: torch.Tensor, noise: torch.Tensor,
                      u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward process at noise level u and the denoiser's regression target (ModelFamily.noised_and_target).

    x0, noise (N, C, H, W); u (N,) in [0, 1): 0 clean, 1 pure noise. Returns (x_t (N, C, H, W), the
    denoiser's timestep input (N,), target (N, C, H, W)). DDIM family: t = floor(u * num_train_timesteps),
    target epsilon / v / x0 by the scheduler's prediction_type. Flow family: x_t = (1 - s) x0 + s noise with
    s = u, target the velocity noise - x0 (what the bundled models were pretrained on)."""
    return get_family(family).noised_and_target(scheduler, x0, noise, u)


def best_of_group(keys: np.ndarray, rewards: np.ndarray, mask: np.ndarray, eps: float) -> np.ndarray:
    """(N,) bool: the best valid sample of each group (the first one on ties), for groups whose rewards have
    any spread (stat_tracking.zero_spread: the same rule that zeroes their advantages). keys (N,), rewards
    (N,) or (N, T) (per-step rewards are averaged over steps to rank samples), mask (N,) bool."""
    r = rewards.mean(axis=1) if rewards.ndim == 2 else rewards
    best = np.zeros(len(keys), dtype=bool)
    for key in np.unique(keys[mask]):
        idx = np.flatnonzero((keys == key) & mask)
        if len(idx) >= 2 and not zero_spread(r[idx][:, None], eps)[0]:
            best[idx[np.argmax(r[idx])]] = True
    return best


def nft_optimality(advantages: np.ndarray, scale: float) -> np.ndarray:
    """(N,) or (N, T) advantages -> (N,) weights r in [0, 1]: 1/2 + 1/2 clip(A / scale, -1, 1); per-step
    advantages are averaged over steps first (the forward objective scores the whole sample)."""
    a = advantages.mean(axis=1) if advantages.ndim == 2 else advantages
    return 0.5 + 0.5 * np.clip(a / scale, -1.0, 1.0)


def raft_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted denoising loss: mean over rows of weight (N,) x mean squared error of pred vs target (N, ...)."""
    mse = (pred.float() - target.float()).pow(2).flatten(1).mean(1)
    return (weight * mse).mean()


def nft_loss(pred: torch.Tensor, old_pred: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float,
             weight: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's loss, mean over rows. pred (N, ...) the policy's output (with grad), old_pred (N, ...) the
    sampling policy's output (no grad), target (N, ...), r (N,) optimality in [0, 1], weight (N,) 0/1 mask."""
    pred, old, target = pred.float(), old_pred.float(), target.float()
    pos = ((1 - beta) * old + beta * pred - target).pow(2).flatten(1).mean(1)
    neg = ((1 + beta) * old - beta * pred - target).pow(2).flatten(1).mean(1)
    return (weight * (r * pos + (1 - r) * neg)).mean()

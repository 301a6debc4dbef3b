"""Step 3 of the epoch: gather rewards and group keys from all processes, compute group-relative
advantages with the PerPromptStatTracker on the whole epoch, and hand each process its own slice.

The k copies of a condition are spread over processes, so normalising locally would be wrong.
Invalid rewards (NaN/inf) are excluded: the sample gets no update; a group left with fewer than two
valid samples cannot be normalised and is excluded whole.

Branched sampling (core.branching): the groups are the children of each split, per column, and each child's
value is the mean reward of its leaves; a tree with an invalid leaf is excluded whole. The advantages are (N, D)
and `cell_mask` says which (sample, column) cells are trained (each transition once, by its owner leaf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ddpo_grpo.core.branching import BranchSpec, tree_advantages
from ddpo_grpo.errors import InvalidRewardError


@dataclass
class EpochAdvantages:
    advantages: torch.Tensor  # (N_local,) or (N_local, T), float32
    train_mask: torch.Tensor  # (N_local,) bool: samples that take part in the update
    keys_all: np.ndarray  # (N_total,) gathered group keys (rank-major order)
    rewards_all: np.ndarray  # (N_total,) or (N_total, T), NaN where invalid
    advantages_all: np.ndarray  # same shape as rewards_all; 0 where excluded
    mask_all: np.ndarray  # (N_total,) bool
    invalid_count: int  # samples with an invalid reward
    excluded_groups: int  # groups dropped because fewer than 2 valid samples were left (trees, when branching)
    cell_mask: Optional[torch.Tensor] = None  # branching: (N_local, D) bool, the cells trained
    cell_mask_all: Optional[np.ndarray] = None  # branching: (N_total, D)


def gather_np(accelerator, x: torch.Tensor) -> np.ndarray:
    return accelerator.gather(x.to(accelerator.device)).cpu().numpy()


def compute_advantages(accelerator, tracker, keys: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor,
                       max_invalid_fraction: float = 0.5, tree: Optional[BranchSpec] = None) -> EpochAdvantages:
    """keys (N,) long; rewards (N,) or (N, T) float, NaN where invalid; valid (N,) bool; tree: the branched
    sampler's spec, rows in whole trees (then rewards are (N,)). Returns this process's advantages and the
    gathered arrays for logging and verification (identical on every process)."""
    keys_all = gather_np(accelerator, keys)
    rewards_all = gather_np(accelerator, rewards.float())
    valid_all = gather_np(accelerator, valid.to(torch.uint8)).astype(bool)
    invalid = int((~valid_all).sum())
    if invalid > max_invalid_fraction * len(valid_all):
        raise InvalidRewardError(
            f"{invalid} of {len(valid_all)} rewards this epoch are invalid (NaN/inf), more than "
            f"train.max_invalid_fraction={max_invalid_fraction}; check the reward functions"
        )
    n = len(keys)
    lo = accelerator.process_index * n
    if tree is not None:
        trees_ok = valid_all.reshape(-1, tree.leaves).all(axis=1)
        adv_all, cells = tree_advantages(tracker, tree, keys_all.tolist(), rewards_all, trees_ok)
        mask = np.repeat(trees_ok, tree.leaves)
        return EpochAdvantages(
            advantages=torch.from_numpy(adv_all[lo:lo + n]).float(), train_mask=torch.from_numpy(mask[lo:lo + n]),
            keys_all=keys_all, rewards_all=rewards_all, advantages_all=adv_all, mask_all=mask,
            invalid_count=invalid, excluded_groups=int((~trees_ok).sum()),
            cell_mask=torch.from_numpy(cells[lo:lo + n]), cell_mask_all=cells)
    mask = valid_all.copy()
    excluded = 0
    for key in np.unique(keys_all):
        members = keys_all == key
        if (members & valid_all).sum() < 2:
            mask &= ~members
            excluded += 1
    adv_all = np.zeros_like(rewards_all, dtype=np.float32)
    if mask.any():
        adv_all[mask] = tracker.update(keys_all[mask].tolist(), rewards_all[mask])
    return EpochAdvantages(
        advantages=torch.from_numpy(adv_all[lo:lo + n]).float(),
        train_mask=torch.from_numpy(mask[lo:lo + n]),
        keys_all=keys_all, rewards_all=rewards_all, advantages_all=adv_all, mask_all=mask,
        invalid_count=invalid, excluded_groups=excluded,
    )

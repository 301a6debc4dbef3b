"""What every objective's update shares (training.py: the clipped-ratio GRPO loss; training_forward.py: RAFT and
DiffusionNFT): which stored steps are trained, the epoch's call plan (which samples at which timestep columns go
into each forward call), and the optimizer step that closes each group of calls.

Its own module because both objectives and the memory plan (memory_plan.training_call, meta_counts, scale) read
the same plan: kept inside training.py, training_forward.py imported these from training.py while training.py
dispatched to training_forward.py, an import circle (issue 48).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .metrics import EpochMetrics
from .sampling import EpochSamples


def trainable_columns(samples: EpochSamples, config) -> torch.Tensor:
    """Stored steps that are trained: those whose policy std is at least train.min_step_std. The log-prob gradient
    of a step scales as 1/std^2, so near-deterministic final steps (std ~ 0.005 against 0.15-0.8 elsewhere for
    DDIM in pixel space) would drown every other step's signal in noise; they are still sampled."""
    T = samples.log_probs.shape[1]
    if samples.step_std is None or config.train.min_step_std <= 0:
        return torch.arange(T)
    cols = torch.nonzero(samples.step_std >= config.train.min_step_std).flatten()
    return cols if len(cols) else torch.arange(T)


def step_weights(samples: EpochSamples, config, columns: torch.Tensor) -> Optional[torch.Tensor]:
    """train.step_weight_power p > 0: (T,) factors on each stored step's policy term, std_t^p normalised to mean 1
    over the trained `columns` (so the policy term's scale against the KL is unchanged); None (every step 1) when
    p == 0 or the sampler stored no stds. Why: a step's log-prob gradient scales as 1/std, so among trained steps the
    least noisy dominates the update (recam_step_diag: step 3 of the window 0-3 carries ~3.5x step 0's gradient for
    about the same credit); p = 1 gives each step's mean shift the same scale, p = 2 weighs the noisier steps more."""
    p = float(config.train.get("step_weight_power", 0.0))
    if p == 0.0 or samples.step_std is None:
        return None
    std = samples.step_std.detach().double().cpu()
    w = torch.zeros_like(std)
    w[columns] = std[columns] ** p
    return (w / w[columns].mean()).float()


def untrained_columns(samples: EpochSamples, config) -> torch.Tensor:
    """The stored steps trainable_columns leaves out (empty when every step is trained)."""
    T = samples.log_probs.shape[1]
    keep = torch.ones(T, dtype=torch.bool)
    keep[trainable_columns(samples, config)] = False
    return torch.nonzero(keep).flatten()


def steps_per_sample(n_columns: int, config) -> int:
    """How many of a sample's n_columns trainable steps (GRPO) or noise levels (the forward objectives) one pass
    trains: round(n_columns * train.timestep_fraction), at least 1."""
    return max(1, int(round(n_columns * config.train.timestep_fraction)))


def probe_sizes(T_train: int) -> List[int]:
    """The timesteps per call the auto probe tries, ascending: 1, 2, 4, 8 and T_train (all trained steps in one call:
    the largest call, which the memory plan plans for), those <= T_train."""
    return sorted({s for s in (1, 2, 4, 8, T_train) if s <= T_train})


def training_calls(N: int, T: int, config, epoch: int, inner: int, rank: int, per_call: int = 0,
                   columns: torch.Tensor = None):
    """The epoch's call plan: list of (sample indices (b,), timestep columns (b, S)).

    Samples are shuffled, each sample trains a random subset of round(len(columns) * timestep_fraction) of the
    trainable columns (default all T), and S = timesteps_per_call of them are stacked into one forward call of
    b * S rows.
    """
    g = torch.Generator().manual_seed(int(np.random.default_rng((config.seed, epoch, inner, rank, 3)).integers(2**62)))
    columns = torch.arange(T) if columns is None else columns
    T_train = steps_per_sample(len(columns), config)
    S = max(1, min(int(per_call or config.train.timesteps_per_call), T_train))
    perm = torch.randperm(N, generator=g)
    tperm = torch.stack([columns[torch.randperm(len(columns), generator=g)] for _ in range(N)])[:, :T_train]
    calls = []
    for lo in range(0, N, config.train.batch_size):
        idx = perm[lo:lo + config.train.batch_size]
        for j in range(0, T_train, S):
            calls.append((idx, tperm[idx, j:j + S]))
    calls_per_microbatch = math.ceil(T_train / S)
    return calls, calls_per_microbatch


def cell_training_calls(cells: torch.Tensor, config, epoch: int, inner: int, rank: int,
                        columns: torch.Tensor = None):
    """The call plan of branched sampling: list of (sample indices (b,), columns (b, 1)) over the owner cells
    (cells (N, T) bool: BranchSpec.owner_cells, restricted to `columns`), shuffled and cut into calls of
    train.batch_size rows. One row per transition: the owner leaf of each child (core.branching). The plan follows
    the trees' structure, not which trees are valid (an excluded tree's rows are masked in the loss), so every process
    makes the same number of calls, as DDP needs."""
    g = torch.Generator().manual_seed(int(np.random.default_rng((config.seed, epoch, inner, rank, 3)).integers(2**62)))
    keep = cells.clone()
    if columns is not None:
        on = torch.zeros(cells.shape[1], dtype=torch.bool)
        on[columns] = True
        keep &= on
    idx, cols = torch.nonzero(keep, as_tuple=True)
    perm = torch.randperm(len(idx), generator=g)
    idx, cols = idx[perm], cols[perm]
    b = config.train.batch_size
    return [(idx[lo:lo + b], cols[lo:lo + b, None]) for lo in range(0, len(idx), b)], 1


@dataclass
class CallPlan:
    """One epoch's training calls, fixed before its first update. calls[inner]: that inner epoch's list of (sample
    indices (b,), timestep columns (b, S)) in the order they run; calls_per_microbatch: how many consecutive calls
    make one micro-batch (every sample of it at its S-column slices); columns: the trainable stored steps (n,). The
    GRPO loss trains exactly these calls and the re-score (rescoring.rescore_old_logprobs) scores exactly these: both
    read this one object, built once by plan_epoch."""
    columns: torch.Tensor
    calls: List[List[Tuple[torch.Tensor, torch.Tensor]]]
    calls_per_microbatch: int


def plan_epoch(samples: EpochSamples, config, epoch: int, rank: int, per_call: int,
               owners: Optional[torch.Tensor] = None) -> CallPlan:
    """The epoch's CallPlan for every inner epoch: training_calls over the trainable columns at per_call timesteps a
    call, or for branched sampling cell_training_calls over `owners` (N, T) bool (one column per row)."""
    N, T = samples.log_probs.shape
    columns = trainable_columns(samples, config)
    per_inner = [training_calls(N, T, config, epoch, inner, rank, per_call, columns) if owners is None
                 else cell_training_calls(owners, config, epoch, inner, rank, columns)
                 for inner in range(config.train.num_inner_epochs)]
    return CallPlan(columns=columns, calls=[calls for calls, _ in per_inner],
                    calls_per_microbatch=per_inner[0][1] if per_inner else 1)


def schedule_decay(schedule: str, epoch: int, num_epochs: int) -> float:
    """train.lr_schedule's decay at an epoch (after warmup): "constant" 1, "cosine" 1/2 (1 + cos(pi e / E)), "linear"
    1 - e / E, e clamped to [0, E]. The one rule for both the lr (run.build.lr_factor) and, squared, the policy-shift
    target of train.target_shift_kl (training.shift_target): a KL grows as the step's square, so the adaptive rule
    keeps the schedule's decay instead of undoing it."""
    progress = min(max(epoch / max(num_epochs, 1), 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0


def zero_loss(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """A zero with a graph to every parameter: keeps DDP's reducer in step when a call has nothing to train."""
    return sum(p.reshape(-1)[0] * 0.0 for p in params)


def optimizer_step(ctx, params: List[torch.nn.Parameter], metrics: EpochMetrics) -> None:
    """Clip, step (skipped when the gradient is not finite: a run never trains on NaN), schedule, mix the
    reference and the eval EMA, zero the gradients. Shared by every objective. A skipped step is counted
    (skipped_steps) and its norm left out of grad_norm, the mean over the steps taken: one inf would otherwise make
    the epoch's mean inf."""
    grad_norm = ctx.accelerator.clip_grad_norm_(params, ctx.config.train.max_grad_norm)
    if torch.isfinite(torch.as_tensor(grad_norm)):
        ctx.optimizer.step()
        ctx.lr_scheduler.step()
        ctx.state.global_step += 1
        if ctx.reference is not None:
            ctx.reference.step()
        if getattr(ctx, "ema", None) is not None:  # train.ema_decay: the weights eval measures
            ctx.ema.step()
        metrics.add("grad_norm", float(grad_norm))
    else:
        metrics.add("skipped_steps", 1.0)
    ctx.optimizer.zero_grad(set_to_none=True)

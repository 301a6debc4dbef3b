"""Training metrics over an epoch's calls and every process: the one place that says how each is reduced."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch


# How every training metric (train/* in the logs) is reduced over the calls of an epoch and over the processes:
# the one place that says so. train_epoch and train_epoch_forward add values to an EpochMetrics and log what its
# reduce() returns; a metric without a rule here is refused (KeyError), so none is logged from one process only.
#   "mean":  the weighted mean of every value of every process, each weighted by the rows it is a mean over (a
#            call's kept rows; 1 for a per-step or per-call value): the mean over every row the epoch trained, the
#            same whatever the process count and however many rows each process kept.
#   "max" / "min": over every value of every process.
#   "sum":   the total over every process: events each process counts on its own rows. Logged as 0 when none.
#   "steps": counted once per optimizer step, which every process takes together on the synchronised gradient:
#            the total over the epoch's steps (the same on every process), not over processes. Logged as 0.
#   "shared": a value every process already holds identically (from gathered arrays or the run state), logged
#            as it is, with no collective.
METRIC_RULES = {
    # clipped-ratio GRPO, per call over its kept (sample, timestep) rows (core.loss.grpo_loss)
    "loss": "mean", "policy_loss": "mean", "kl": "mean", "approx_kl": "mean", "ratio_mean": "mean",
    "clipfrac": "mean", "clipfrac_low": "mean", "clipfrac_high": "mean",
    "ratio_min": "min", "ratio_max": "max",  # the epoch's extreme ratios over every row
    "loss_sup": "mean",  # the supervised term, per call
    "kl_untrained": "mean",  # train.kl_steps "all": per micro-batch, over its samples
    "onpolicy_ratio_max_dev": "max",  # max |r - 1| before the epoch's first optimizer step
    "sampler_is_weight": "mean",  # train.sampler_is_cap: the truncated weight pi_trainer / pi_sampler, per call
    "old_logprobs_rescored": "shared",  # 1: the ratio's old log-probs were re-scored (train.old_logprobs), 0: sampler's
    "grad_norm": "mean",  # per optimizer step taken (the same on every process); a non-finite one is not averaged in
    "nonfinite_loss": "sum",  # calls whose loss was not finite (skipped)
    "skipped_steps": "steps",  # optimizer steps skipped for a non-finite gradient norm: counted, not in grad_norm
    # set once per epoch, identical on every process
    "policy_shift_kl": "shared",  # gathered mean in policy_shift_kl
    "lr": "shared", "lr_scale": "shared", "timesteps_per_call": "shared",
    "chosen_samples": "shared",  # raft/nft: trained samples, from the gathered arrays
}
_ALWAYS = ("sum", "steps")  # logged (as 0) even when nothing was counted


class EpochMetrics:
    """One epoch's training metrics on this process, reduced over every process by reduce() by METRIC_RULES.

    Each process keeps, per metric, a pair (a, n): for "mean" (sum of weight x value, sum of weights), for
    "max"/"min" (the extreme, number of values), for "sum"/"steps" (the total, number of values). reduce() gathers
    one fixed-size vector of these pairs from every process (the same length everywhere, whatever each process
    saw), so every process makes exactly one collective call per epoch and gets the same result."""

    def __init__(self):
        self.pairs: Dict[str, List[float]] = {}
        self.shared: Dict[str, float] = {}

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        rule = METRIC_RULES[name]
        value = float(value)
        if rule == "shared":
            self.shared[name] = value
            return
        a, n = self.pairs.get(name, (None, 0.0))
        if rule == "mean":
            a = (a or 0.0) + float(weight) * value
            n += float(weight)
        elif rule in ("max", "min"):
            a = value if a is None else (max if rule == "max" else min)(a, value)
            n += 1.0
        else:  # sum, steps
            a = (a or 0.0) + value
            n += 1.0
        self.pairs[name] = [a, n]

    @staticmethod
    def names() -> List[str]:
        return sorted(k for k, r in METRIC_RULES.items() if r != "shared")

    def local(self) -> np.ndarray:
        """This process's (K, 2) pairs over names(); (0, 0) for a metric it never saw."""
        return np.array([self.pairs.get(k, (0.0, 0.0)) for k in self.names()], dtype=np.float64).reshape(-1, 2)

    @classmethod
    def combine(cls, per_process: np.ndarray) -> Dict[str, float]:
        """(P, K, 2) gathered pairs -> {metric: value}; a "mean"/"max"/"min" metric no process saw is left out."""
        out = {}
        for k, name in enumerate(cls.names()):
            rule = METRIC_RULES[name]
            a, n = per_process[:, k, 0], per_process[:, k, 1]
            seen = n > 0
            if not seen.any():
                if rule in _ALWAYS:
                    out[name] = 0.0
                continue
            if rule == "mean":
                out[name] = float(a[seen].sum() / n[seen].sum())
            elif rule == "max":
                out[name] = float(a[seen].max())
            elif rule == "min":
                out[name] = float(a[seen].min())
            elif rule == "sum":
                out[name] = float(a.sum())
            else:  # steps: every process counted the same steps
                out[name] = float(a[seen].max())
        return out

    def reduce(self, accelerator) -> Dict[str, float]:
        """The epoch's metrics over every process. A collective: every process must call it, once per epoch."""
        local = self.local()
        device = accelerator.device
        dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64  # MPS has no float64
        allp = accelerator.gather(torch.as_tensor(local.reshape(-1), dtype=dtype, device=device))
        out = self.combine(allp.double().cpu().numpy().reshape(-1, *local.shape))
        out.update(self.shared)
        return out

"""Step 4 of the epoch: verify the GRPO invariants on the epoch's gathered data, every epoch, and say so
in the run's own logs: each condition has exactly k samples; in group mode each group's advantages (per
timestep column for (B, T) rewards) have mean 0 and std 1, or are all 0 where the rewards have zero spread.

What "zero spread" means is the tracker's rule (`stat_tracking.zero_spread`, with the tracker's eps): the
check calls the same function on the same rewards, so it cannot disagree with the math it checks."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ddpo_grpo.errors import VerificationError
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker, zero_spread

MEAN_TOL = 1e-4
STD_TOL = 1e-3


def verify_groups(keys: np.ndarray, advantages: np.ndarray, mask: np.ndarray, rewards: np.ndarray, k: int,
                  tracker: PerPromptStatTracker) -> Tuple[Dict[str, float], str]:
    """keys (N,), advantages/rewards (N,) or (N, T), mask (N,) bool; tracker: the one that computed the
    advantages (its std_mode, buffer and eps say what must hold). Returns (metrics, printable table); raises
    VerificationError on a violation, naming the condition and column. Advantage statistics are checked only
    where they are defined per epoch: no history buffer; std 1 only in group std mode."""
    uniq, counts = np.unique(keys, return_counts=True)
    bad = uniq[counts != k]
    if len(bad):
        raise VerificationError(
            f"group size check failed: conditions {bad[:5].tolist()} have {counts[counts != k][:5].tolist()} "
            f"samples, expected exactly k={k}"
        )
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    rew = rewards if rewards.ndim == 2 else rewards[:, None]
    # Per-epoch groups (no history buffer): every mode with a per-group baseline has group mean 0; group std
    # mode also has std 1. The running mode normalises by global running statistics: nothing per group to check.
    buffered = tracker.buffer_size is not None
    check_stats = tracker.std_mode in ("group", "global", "none") and not buffered
    check_std = tracker.std_mode == "group" and not buffered
    worst_mean, worst_std = (0.0, None, None), (0.0, None, None)  # (value, condition, column)
    zero_cols, cols = 0, 0
    rows = []
    for key in uniq:
        sel = (keys == key) & mask
        if sel.sum() < 2:
            continue
        a, r = adv[sel].astype(np.float64), rew[sel]
        m, s = a.mean(axis=0), a.std(axis=0)
        zero = zero_spread(r, tracker.eps)
        cols += len(zero)
        zero_cols += int(zero.sum())
        rows.append((key, int(sel.sum()), float(r.mean()), float(r.std(axis=0).mean()), float(m.mean()), float(s.mean())))
        if not check_stats:
            continue
        nonzero_adv = np.flatnonzero(zero & (a != 0).any(axis=0))
        if len(nonzero_adv):
            raise VerificationError(f"advantage check failed: condition {key} column {int(nonzero_adv[0])}: rewards "
                                    f"have zero spread (std <= eps {tracker.eps:g}) but advantages are not 0")
        live = np.flatnonzero(~zero)
        if len(live):
            t = live[np.argmax(np.abs(m[live]))]
            if abs(m[t]) > worst_mean[0]:
                worst_mean = (float(abs(m[t])), key, int(t))
            if check_std:
                t = live[np.argmax(np.abs(s[live] - 1))]
                if abs(s[t] - 1) > worst_std[0]:
                    worst_std = (float(abs(s[t] - 1)), key, int(t))
    if check_stats and (worst_mean[0] > MEAN_TOL or worst_std[0] > STD_TOL):
        which = worst_mean if worst_mean[0] > MEAN_TOL else worst_std
        raise VerificationError(
            f"advantage check failed: condition {which[1]} column {which[2]}: worst |group mean| = {worst_mean[0]:.2e} "
            f"(tol {MEAN_TOL}), worst |group std - 1| = {worst_std[0]:.2e} (tol {STD_TOL})"
        )
    metrics = {
        "verify/num_samples": float(len(keys)),
        "verify/num_conditions": float(len(uniq)),
        "verify/samples_per_condition_min": float(counts.min()),
        "verify/samples_per_condition_max": float(counts.max()),
        "verify/adv_group_mean_abs_max": worst_mean[0],
        "verify/adv_group_std_err_max": worst_std[0],
        "verify/zero_std_columns": float(zero_cols),
        "verify/trained_samples": float(mask.sum()),
    }
    table = format_table(rows, len(keys), len(uniq), k, worst_mean[0], worst_std[0], zero_cols, cols, check_stats)
    return metrics, table


def format_table(rows, n, m, k, worst_mean, worst_std, zero_cols, cols, checked) -> str:
    head = (f"GRPO check: {n} samples = {m} conditions x k={k} (exact); "
            + (f"adv |mean| <= {worst_mean:.1e}, |std-1| <= {worst_std:.1e}; " if checked else "adv stats not per-epoch (history/running); ")
            + f"zero-std columns {zero_cols}/{cols}")
    lines = [head, f"  {'key':>8} {'n':>3} {'r_mean':>8} {'r_std':>8} {'a_mean':>9} {'a_std':>7}"]
    for key, cnt, rm, rs, am, as_ in rows[:8]:
        lines.append(f"  {key:>8} {cnt:>3} {rm:8.4f} {rs:8.4f} {am:9.1e} {as_:7.4f}")
    if len(rows) > 8:
        lines.append(f"  ... {len(rows) - 8} more groups")
    return "\n".join(lines)

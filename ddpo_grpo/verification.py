"""Step 4 of the epoch: verify the GRPO invariants on the epoch's gathered data, every epoch, and say so
in the run's own logs: each condition has exactly k samples; in group mode each group's advantages (per
timestep column for (B, T) rewards) have mean 0 and std 1, or are all 0 when the rewards were equal."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from .errors import VerificationError

MEAN_TOL = 1e-4
STD_TOL = 1e-3


def verify_groups(keys: np.ndarray, advantages: np.ndarray, mask: np.ndarray, rewards: np.ndarray, k: int,
                  std_mode: str, buffered: bool) -> Tuple[Dict[str, float], str]:
    """keys (N,), advantages/rewards (N,) or (N, T), mask (N,) bool. Returns (metrics, printable table);
    raises VerificationError on a violation. Advantage statistics are checked only where they are
    defined per epoch: group std mode, no history buffer."""
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
    check_stats = std_mode in ("group", "global", "none") and not buffered
    check_std = std_mode == "group" and not buffered
    worst_mean, worst_std, zero_cols, cols = 0.0, 0.0, 0, 0
    rows = []
    for key in uniq:
        sel = (keys == key) & mask
        if sel.sum() < 2:
            continue
        a, r = adv[sel], rew[sel]
        m, s, rs = a.mean(axis=0), a.std(axis=0), r.std(axis=0)
        zero = rs == 0
        cols += len(zero)
        zero_cols += int(zero.sum())
        rows.append((key, int(sel.sum()), float(r.mean()), float(rs.mean()), float(m.mean()), float(s.mean())))
        if check_stats:
            if np.any(a[:, zero] != 0):
                raise VerificationError(f"condition {key}: rewards are equal but advantages are not 0")
            if (~zero).any():
                worst_mean = max(worst_mean, float(np.abs(m[~zero]).max()))
                if check_std:
                    worst_std = max(worst_std, float(np.abs(s[~zero] - 1).max()))
    if check_stats and (worst_mean > MEAN_TOL or worst_std > STD_TOL):
        raise VerificationError(
            f"advantage check failed: worst |group mean| = {worst_mean:.2e} (tol {MEAN_TOL}), worst |group std - 1| = "
            f"{worst_std:.2e} (tol {STD_TOL})"
        )
    metrics = {
        "verify/num_samples": float(len(keys)),
        "verify/num_conditions": float(len(uniq)),
        "verify/samples_per_condition_min": float(counts.min()),
        "verify/samples_per_condition_max": float(counts.max()),
        "verify/adv_group_mean_abs_max": worst_mean,
        "verify/adv_group_std_err_max": worst_std,
        "verify/zero_std_columns": float(zero_cols),
        "verify/trained_samples": float(mask.sum()),
    }
    table = format_table(rows, len(keys), len(uniq), k, worst_mean, worst_std, zero_cols, cols, check_stats)
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

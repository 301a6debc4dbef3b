"""Step 4 of the epoch: verify the GRPO invariants on the epoch's gathered data, every epoch, and say so
in the run's own logs: each condition has exactly k samples; in group mode each group's advantages (per
timestep column for (B, T) rewards) have mean 0 and std 1, or are all 0 where the rewards have zero spread.

What "zero spread" means is the tracker's rule (`stat_tracking.zero_spread`, with the tracker's eps): the
check calls the same function on the same rewards, so it cannot disagree with the math it checks.

Branched sampling: each tree's leaves share one condition, and at each split every sibling group has exactly K
trained cells (one per child), whose advantages have mean 0 / std 1, or are all 0 where the children's values have
zero spread; every other cell is 0 and untrained. Node values and sibling groups come from core.branching. In global
and none modes each sibling group's advantages are checked against the tracker's rule over its column (mean 0,
divided by the column's std or by 1); with a buffer or running statistics only zeros and owners are.

History buffer / running statistics: the advantages are not per-epoch statistics, so group mean 0 / std 1 cannot be
checked; the check then verifies what the tracker itself defines (verify_tracker_stats) and says which mode it is in.

The on-policy ratio and the sampler/trainer gap, checked before the epoch's first update, are checks/onpolicy.py."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ddpo_grpo.core.branching import BranchSpec
from ddpo_grpo.errors import VerificationError
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker, zero_spread

MEAN_TOL = 1e-4
STD_TOL = 1e-3


def verify_groups(keys: np.ndarray, advantages: np.ndarray, mask: np.ndarray, rewards: np.ndarray, k: int,
                  tracker: PerPromptStatTracker, tree: Optional[BranchSpec] = None,
                  cells: Optional[np.ndarray] = None) -> Tuple[Dict[str, float], str]:
    """keys (N,), advantages/rewards (N,) or (N, T), mask (N,) bool; tracker: the one that computed the
    advantages (its std_mode, buffer and eps say what must hold). Returns (metrics, printable table); raises
    VerificationError on a violation, naming the condition and column. Advantage statistics are checked only
    where they are defined per epoch: no history buffer; std 1 only in group std mode.
    tree, cells (N, D) bool: branched sampling (advantages (N, D), rewards (N,)), checked per sibling group."""
    uniq, counts = np.unique(keys, return_counts=True)
    bad = uniq[counts != k]
    if len(bad):
        raise VerificationError(
            f"group size check failed: conditions {bad[:5].tolist()} have {counts[counts != k][:5].tolist()} "
            f"samples, expected exactly k={k}"
        )
    if tree is not None:
        return verify_tree_groups(keys, advantages, cells, mask, rewards, tree, tracker, len(uniq), k)
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    rew = rewards if rewards.ndim == 2 else rewards[:, None]
    bad = np.argwhere(mask[:, None] & ~np.isfinite(adv))
    if len(bad):
        raise VerificationError(f"advantage check failed: condition {keys[bad[0][0]]} column {int(bad[0][1])}: "
                                f"advantage {adv[bad[0][0], bad[0][1]]} is not finite")
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
    # Where group std 1 is not the rule (global / none modes, a history buffer, running statistics) the scale is
    # checked against the tracker's own statistics instead: a mis-scaled advantage passes group mean 0 alone.
    worst_tracker = verify_tracker_stats(keys, uniq, adv, rew, mask, tracker) if not check_std else 0.0
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
        "verify/adv_tracker_err_max": worst_tracker,  # all but group std mode: |adv - the tracker's (r - mean) / std|
    }
    if check_std:  # group std mode: every live group has mean 0 and std 1
        stats = f"adv |mean| <= {worst_mean[0]:.1e}, |std-1| <= {worst_std[0]:.1e}"
    elif check_stats:  # global / none: group mean 0, scaled by the batch's std or not at all
        stats = (f"adv |mean| <= {worst_mean[0]:.1e}, within {worst_tracker:.1e} of (r - group mean) / "
                 f"{_scale_words(tracker)}")
    else:
        stats = (f"adv from {tracker_mode(tracker)}: finite, within {worst_tracker:.1e} of the tracker's (r - mean) / "
                 "std per condition")
    return metrics, format_table(rows, len(keys), len(uniq), k, stats, zero_cols, cols)


def _scale_words(tracker: PerPromptStatTracker) -> str:
    """What the per-epoch advantages are divided by, in words (group / global / none modes)."""
    return {"group": "the group's std", "global": "the batch's std", "none": "1 (no std)"}[tracker.std_mode]


def tracker_mode(tracker: PerPromptStatTracker) -> str:
    """Which statistics the advantages are taken with, in words, for the check's line."""
    if tracker.std_mode == "running":
        if tracker.running_mean is None:  # no valid reward has reached the running statistics yet
            return "running statistics (none yet: no valid reward so far)"
        return (f"running statistics (mean {float(np.mean(tracker.running_mean)):.4g}, std "
                f"{float(np.mean(np.sqrt(tracker.running_var))):.4g} after {tracker.running_count} updates)")
    if tracker.buffer_size is None:
        return f"this epoch's groups ({tracker.std_mode} mode)"
    return (f"history buffer ({tracker.std_mode} mode, last {tracker.buffer_size} rewards per condition, the batch's "
            f"statistics below {tracker.min_count})")


def verify_tracker_stats(keys, uniq, adv, rew, mask, tracker: PerPromptStatTracker) -> float:
    """History buffer / running statistics: no per-epoch group statistic holds, but every trained advantage must be
    its reward standardised by the statistics the tracker holds for its condition (PerPromptStatTracker.baseline,
    the rule that computed it), and 0 where they have zero spread. Catches advantages handed to the wrong sample or
    condition, scaled, shifted or stale. keys (N,), adv / rew (N, T), mask (N,). Returns the worst
    |adv - expected| / (1 + |expected|); raises VerificationError above MEAN_TOL, naming the condition and column."""
    batch = rew[mask].astype(np.float64)  # what compute_advantages handed tracker.update
    worst = 0.0
    for key in uniq:
        sel = (keys == key) & mask
        if not sel.any():
            continue
        r = rew[sel].astype(np.float64)
        mean, scale, zero = tracker.baseline(key.item() if isinstance(key, np.generic) else key, r, batch)
        want = np.divide(r - mean, scale, out=np.zeros_like(r), where=~zero)
        err = (np.abs(adv[sel].astype(np.float64) - want) / (1 + np.abs(want))).max(axis=0)
        t = int(err.argmax())
        if err[t] > MEAN_TOL:
            raise VerificationError(
                f"advantage check failed: condition {key} column {t}: advantages differ from the tracker's own "
                f"(r - mean) / std by up to {err[t]:.2e} (tol {MEAN_TOL}; {tracker_mode(tracker)})")
        worst = max(worst, float(err[t]))
    return worst


def format_table(rows, n, m, k, stats, zero_cols, cols) -> str:
    """The check's printable table; stats: what was checked of the advantages, in words (verify_groups)."""
    head = f"GRPO check: {n} samples = {m} conditions x k={k} (exact); {stats}; zero-std columns {zero_cols}/{cols}"
    lines = [head, f"  {'key':>8} {'n':>3} {'r_mean':>8} {'r_std':>8} {'a_mean':>9} {'a_std':>7}"]
    for key, cnt, rm, rs, am, as_ in rows[:8]:
        lines.append(f"  {key:>8} {cnt:>3} {rm:8.4f} {rs:8.4f} {am:9.1e} {as_:7.4f}")
    if len(rows) > 8:
        lines.append(f"  ... {len(rows) - 8} more groups")
    return "\n".join(lines)


def verify_tree_groups(keys, advantages, cells, mask, rewards, tree: BranchSpec, tracker, n_conditions: int,
                       k: int) -> Tuple[Dict[str, float], str]:
    """The branched check (see the module docstring); keys (N,), advantages (N, D), cells (N, D) bool, mask (N,)
    bool (trees that take part), rewards (N,)."""
    N, D, K, L = len(keys), tree.depth, tree.branches, tree.leaves
    if N % L or advantages.shape != (N, D) or cells.shape != (N, D):
        raise VerificationError(f"tree check failed: {N} samples, advantages {advantages.shape}, cells {cells.shape} "
                                f"for trees of {L} leaves and {D} splits")
    per_tree = keys.reshape(-1, L)
    split = np.flatnonzero((per_tree != per_tree[:, :1]).any(axis=1))
    if len(split):
        raise VerificationError(f"tree check failed: tree {int(split[0])} mixes conditions {np.unique(per_tree[split[0]]).tolist()}")
    worst_mean = worst_std = worst_rule = 0.0
    zero_groups = groups = 0
    lines = []
    # Per-epoch statistics (no history buffer, not running): each column's advantages are the tracker's own rule
    # (PerPromptStatTracker.baseline) over that column's sibling groups, the batch being the column's live values, as
    # tree_advantages handed them to update(). Running statistics have moved on by D updates since column 0, and a
    # buffer holds past epochs' node values: there only the zero-spread and ownership rules are checked.
    per_epoch = tracker.buffer_size is None and tracker.std_mode != "running"
    for d in range(D):
        owner = tree.owners(N, d) & mask
        stray = np.flatnonzero(~owner & ((advantages[:, d] != 0) | cells[:, d]))
        if len(stray):
            raise VerificationError(f"tree check failed: sample {int(stray[0])} column {d} is not its child's owner "
                                    "(or its tree is excluded) but carries an advantage or is trained")
        if not np.array_equal(cells[:, d], owner):
            raise VerificationError(f"tree check failed: column {d}: an owner cell of a valid tree is not trained")
        values = tree.node_values(np.where(mask, rewards, 0.0), d).reshape(-1, K)  # (parents, K) children's values
        adv = advantages[tree.owners(N, d), d].astype(np.float64).reshape(-1, K)
        live_parent = mask[tree.owners(N, d)].reshape(-1, K).all(axis=1)
        zero = np.array([zero_spread(v[:, None], tracker.eps)[0] for v in values])
        bad_zero = np.flatnonzero(live_parent & zero & (adv != 0).any(axis=1))
        if len(bad_zero):
            raise VerificationError(f"advantage check failed: column {d} sibling group {int(bad_zero[0])}: the children's "
                                    "values have zero spread but advantages are not 0")
        live = live_parent & ~zero
        groups += int(live_parent.sum())
        zero_groups += int((live_parent & zero).sum())
        if per_epoch and live.any():
            worst_mean = max(worst_mean, float(np.abs(adv[live].mean(axis=1)).max()))
            if tracker.std_mode == "group":
                worst_std = max(worst_std, float(np.abs(adv[live].std(axis=1) - 1).max()))
            batch = values[live_parent].reshape(-1, 1)
            for p in np.flatnonzero(live):
                g = values[p][:, None]  # (K, 1) the children's values
                mean, scale, z = tracker.baseline(None, g, batch)
                want = np.divide(g - mean, scale, out=np.zeros_like(g), where=~z)[:, 0]
                err = float((np.abs(adv[p] - want) / (1 + np.abs(want))).max())
                if err > MEAN_TOL:
                    raise VerificationError(
                        f"advantage check failed: column {d} sibling group {int(p)}: advantages differ from the "
                        f"tracker's own (v - sibling mean) / {_scale_words(tracker)} by up to {err:.2e} (tol {MEAN_TOL})")
                worst_rule = max(worst_rule, err)
        lines.append(f"  split {d} (step {tree.steps[d]}): {int(live_parent.sum())} sibling groups x {K}, "
                     f"{int((live_parent & zero).sum())} with zero spread, {int(cells[:, d].sum())} trained cells")
    if worst_mean > MEAN_TOL or worst_std > STD_TOL:
        raise VerificationError(f"advantage check failed: worst sibling-group |mean| = {worst_mean:.2e} (tol {MEAN_TOL}), "
                                f"|std - 1| = {worst_std:.2e} (tol {STD_TOL})")
    metrics = {
        "verify/num_samples": float(N), "verify/num_conditions": float(n_conditions),
        "verify/samples_per_condition_min": float(k), "verify/samples_per_condition_max": float(k),
        "verify/adv_group_mean_abs_max": worst_mean, "verify/adv_group_std_err_max": worst_std,
        "verify/zero_std_columns": float(zero_groups), "verify/trained_samples": float(mask.sum()),
        "verify/trained_cells": float(cells.sum()),
        "verify/adv_tracker_err_max": worst_rule,  # |adv - the tracker's (v - sibling mean) / scale|, per column
    }
    if not per_epoch:
        stats = f"adv from {tracker_mode(tracker)}: zero-spread groups and owners checked, statistics not per epoch"
    elif tracker.std_mode == "group":
        stats = f"sibling-group adv |mean| <= {worst_mean:.1e}, |std-1| <= {worst_std:.1e}"
    else:
        stats = (f"sibling-group adv |mean| <= {worst_mean:.1e}, within {worst_rule:.1e} of (v - sibling mean) / "
                 f"{_scale_words(tracker)}")
    head = (f"GRPO check (branched): {N} samples = {n_conditions} conditions x k={k} (exact) = {N // L} trees x {L} "
            f"leaves; {stats}; zero-spread groups {zero_groups}/{groups}")
    return metrics, "\n".join([head] + lines)

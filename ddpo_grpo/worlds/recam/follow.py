"""How well does a camera model follow the requested motion? Regression of the estimated motion on the requested one.

For each motion component (dx, dy, log zoom) we fit  estimated = slope * requested + offset  by least squares over
the samples the estimator could measure. A model that follows the camera exactly has slope 1, offset 0 and
residual std 0; slope < 1 is under-following (a common failure of camera-controlled models: they move the
camera less than asked), a non-zero offset is a constant drift, and the residual std is the part of the error
that is not a simple bias: per-condition and per-sample (noise-driven) misses.

The split matters for RL: a bias (slope, offset) is one correction shared by every condition; residual error is
different for every condition and sample, so the group advantages point in a different direction for each
condition, which needs far more samples per optimizer step (README, recam).

`reward_spread` separates the noise-driven part: `within_group_std`, the spread of the reward among samples of one
condition, against `between_condition_std`, the spread of the per-condition means.
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

COMPONENTS = ("dx", "dy", "log_zoom")


def follow_stats(estimated: np.ndarray, requested: np.ndarray) -> Dict[str, float]:
    """Slope, offset and residual std of estimated vs requested motion, per component.

    estimated, requested: (N, 3) arrays of (dx, dy, zoom); rows of `estimated` with NaN (estimator failed) are
    skipped. Returns {"<c>_slope", "<c>_offset", "<c>_resid_std"} for c in dx, dy, log_zoom, and "measured" (the
    fraction of rows used). Needs at least 3 measured rows with distinct requested values per component.
    """
    est, req = np.asarray(estimated, np.float64), np.asarray(requested, np.float64)
    if est.shape != req.shape or est.ndim != 2 or est.shape[1] != 3:
        raise ValueError(f"estimated {est.shape} and requested {req.shape} must both be (N, 3) = (dx, dy, zoom)")
    ok = np.isfinite(est).all(axis=1) & (est[:, 2] > 0)
    out = {"measured": float(ok.mean()) if len(ok) else 0.0}
    e, r = est[ok].copy(), req[ok].copy()
    e[:, 2], r[:, 2] = np.log(e[:, 2]), np.log(r[:, 2])
    for j, name in enumerate(COMPONENTS):
        if len(r) < 3 or np.ptp(r[:, j]) == 0:
            raise ValueError(f"follow_stats needs >= 3 measured samples with different requested {name}; "
                             f"got {len(r)} measured of {len(est)}")
        slope, offset = np.polyfit(r[:, j], e[:, j], 1)
        out[f"{name}_slope"] = float(slope)
        out[f"{name}_offset"] = float(offset)
        out[f"{name}_resid_std"] = float(np.std(e[:, j] - (slope * r[:, j] + offset)))
    return out


def reward_spread(rewards: np.ndarray, keys: Sequence[int]) -> Dict[str, float]:
    """Mean within-condition std of the reward, std of the per-condition means and mean best-in-group reward.

    rewards (N,), keys (N,): the condition of each sample."""
    rewards, keys = np.asarray(rewards, np.float64), np.asarray(keys)
    groups = [rewards[keys == k] for k in np.unique(keys)]
    return {"within_group_std": float(np.mean([g.std() for g in groups])),
            "between_condition_std": float(np.std([g.mean() for g in groups])),
            "group_max_mean": float(np.mean([g.max() for g in groups]))}

"""What a start model's scored samples say about its camera, beyond the mean (issue 59's readings): how much of the
requested motion a clip shows (`motion_shown`), how a group of the recipe's SDE draws spreads between the request and
its opposite (`group_spread`), whether a group's reward follows the translation shown (`magnitude_reading`), and
whether the starting noise picks the camera (`rotation_leans`). Pure functions of scores and estimated paths, shared
by benchmarks/recam3d_start.py (which samples and scores) and the tests; nothing here samples a model."""
from __future__ import annotations

import numpy as np

from ddpo_grpo.worlds.room3d.paths import motion_kind

def motion_shown(est: np.ndarray, req: np.ndarray) -> tuple:
    """(translation ratio, rotation ratio) at the last pose of est / req (F', 4, 4), relative to frame 0: how much of the
    requested motion a clip shows, |t_est| / |t_req| (the exact estimator is metric) and angle(R_est) / angle(R_req);
    NaN where the request has no such part (under 0.1 m, under 2 degrees) or the estimate failed."""
    from ddpo_grpo.worlds.recam.pose_score import rotation_angle

    e, r = np.asarray(est, np.float64)[-1], np.asarray(req, np.float64)[-1]
    if not np.isfinite(e).all():
        return float("nan"), float("nan")
    eye = np.eye(3)[None]
    t_req, a_req = np.linalg.norm(r[:3, 3]), float(rotation_angle(eye, r[None, :3, :3])[0])
    t = np.linalg.norm(e[:3, 3]) / t_req if t_req >= 0.1 else float("nan")
    a = float(rotation_angle(eye, e[None, :3, :3])[0]) / a_req if a_req >= np.radians(2.0) else float("nan")
    return float(t), a


def nanmean(x) -> float:
    """The mean of x's finite values; NaN (without numpy's warning) when it has none."""
    x = np.asarray(x, np.float64)
    return float(x[np.isfinite(x)].mean()) if np.isfinite(x).any() else float("nan")


def nanmedian(x) -> float:
    x = np.asarray(x, np.float64)
    return float(np.median(x[np.isfinite(x)])) if np.isfinite(x).any() else float("nan")


def group_spread(true: np.ndarray, opp: np.ndarray, presets, k: int, kinds=("pan", "tilt")) -> dict:
    """Per motion kind (`kinds`: pans and tilts unless told; "dolly" for the zooms), over its conditions' groups of k
    SDE samples (true, opp: (k, n_cond) scores against the requested camera and its opposite): the group's mean lean
    (true - opposite), its spread (std over the k), the share of samples leaning to the requested camera, the spread
    of the reward itself (true's std): what the recipe's group advantages have to rank, and the within-group
    correlation of the scores against the requested camera and against its opposite (mean over groups): negative
    when a group's reward differences are the direction (closer to one is farther from the other), positive when
    they are what both share (a clip read well or not)."""
    out = {}
    for kind in kinds:
        m = np.array([motion_kind(p) == kind for p in presets])
        if not m.any():
            continue
        lean, t, o = (true - opp)[:, m], true[:, m], opp[:, m]
        tc, oc = t - t.mean(axis=0), o - o.mean(axis=0)
        den = np.sqrt((tc ** 2).sum(axis=0) * (oc ** 2).sum(axis=0))
        corr = (tc * oc).sum(axis=0)[den > 0] / den[den > 0]
        out[kind] = dict(conditions=int(m.sum()), k=k, lean_mean=float(lean.mean()),
                         lean_spread=float(lean.std(axis=0, ddof=1).mean()), requested_share=float((lean > 0).mean()),
                         reward_mean=float(t.mean()), reward_spread=float(t.std(axis=0, ddof=1).mean()),
                         true_opposite_corr=float(corr.mean()) if corr.size else float("nan"))
    return out


def magnitude_reading(true: np.ndarray, shown: np.ndarray, terms: np.ndarray, presets, kinds=("dolly",)) -> dict:
    """Per motion kind, over its conditions' groups of k SDE samples: does a group's reward follow how much of the
    requested translation its clips show? true, shown: (k, n_cond) the reward and motion_shown's translation share;
    terms: (k, n_cond, 3) the reward's mean rotation / direction / magnitude errors. Returns the median share shown,
    its spread within a group (std, mean over groups), the pooled within-group slope of the reward in the share shown
    (sum of centred products / sum of centred squares over every group: what a group's ranking sees of it) and the
    pooled within-group correlation, the mean of each error term, and the share of the direction error's variance
    that is within groups (what a group's ranking can see of it; over the groups with two or more). Samples whose
    share is NaN (failed estimates, a path with no translation) are left out of their group; a group needs two to
    count."""
    out = {}
    for kind in kinds:
        m = np.array([motion_kind(p) == kind for p in presets])
        if not m.any():
            continue
        t, sh = true[:, m], shown[:, m]
        sxy = sxx = syy = 0.0
        spreads = []
        for j in range(t.shape[1]):
            ok = np.isfinite(sh[:, j])
            if ok.sum() < 2:
                continue
            x, y = sh[ok, j] - sh[ok, j].mean(), t[ok, j] - t[ok, j].mean()
            sxy, sxx, syy = sxy + (x * y).sum(), sxx + (x * x).sum(), syy + (y * y).sum()
            spreads.append(float(sh[ok, j].std(ddof=1)))
        dirs = terms[:, m, 1]  # (k, conditions) mean direction error: how much of its variance is within a group
        within = [dirs[np.isfinite(dirs[:, j]), j] for j in range(dirs.shape[1])]
        within = [w for w in within if len(w) >= 2]
        dev = sum(((w - w.mean()) ** 2).sum() for w in within)
        allw = np.concatenate(within) if within else np.zeros(0)
        tot = ((allw - allw.mean()) ** 2).sum() if allw.size else 0.0
        mean_term = [nanmean(terms[:, m, i]) for i in range(3)]
        out[kind] = dict(conditions=int(m.sum()), groups_read=len(spreads), shown_median=nanmedian(sh),
                         shown_spread=float(np.mean(spreads)) if spreads else float("nan"),
                         reward_shown_slope=float(sxy / sxx) if sxx > 0 else float("nan"),
                         reward_shown_corr=float(sxy / np.sqrt(sxx * syy)) if sxx > 0 and syy > 0 else float("nan"),
                         rot_err_deg=mean_term[0], dir_err_deg=mean_term[1], mag_err=mean_term[2],
                         dir_err_within_share=float(dev / tot) if tot > 0 else float("nan"))
    return out


def rotation_leans(true: np.ndarray, opp: np.ndarray, modes: np.ndarray, presets) -> dict:
    """On the pans and tilts (the presets whose opposite a still camera does not also miss): the share of samples
    scoring higher against the requested camera than against its opposite, and the correlation of that lean (true -
    opposite score) with the starting noise's noise_mode: ~0 for a model that blends the two, strongly negative for
    one that commits to the opposite when the noise reads high (--mislabel-by noise). true, opp, modes: (N,)."""
    m = np.array([motion_kind(p) in ("pan", "tilt") for p in presets])
    lean = (true - opp)[m]
    return dict(n=int(m.sum()), requested_share=float((lean > 0).mean()),
                lean_mode_corr=float(np.corrcoef(lean, modes[m])[0, 1]) if m.sum() > 2 else float("nan"))

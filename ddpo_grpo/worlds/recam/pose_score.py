"""How far an estimated camera path is from the requested one: the per-frame score behind `cam_score` on real video
and the camera-control papers' metrics (RotErr, TransErr, CamMC), one definition for the reward, its tests and the
benchmarks.

Both paths are camera-to-world poses (F', 4, 4) with OpenCV camera axes (x right, y down, z forward), taken relative to
their own frame 0 (inv(C_0) @ C_j), as CamI2V's evaluation does: a generated clip's camera is only known up to where
it starts, and a monocular estimate only up to the scale of its translation. Frame 0 is the identity in both and
carries no information, so the per-frame terms are over frames j = 1 ... F'-1:

    rot_j  = geodesic angle between R_req,j and R_est,j                               (degrees)
    dir_j  = angle between t_req,j and t_est,j (90 when the estimate has no translation)  (degrees)
             only where the request translates at frame j: |t_req,j| >= dir_min_fraction * max_k |t_req,k| and the
             path translates at all (max_k |t_req,k| >= min_translation, in the numbers' unit: metres)
    mag_j  = | |t_req,j| / max_k |t_req,k|  -  |t_est,j| / max_k |t_est,k| |           (normalised magnitudes; 0/0 = 0;
             the maxima over the frames the estimate measured)
             only where the path translates (a pure rotation's request has no magnitude to compare, and a monocular
             estimate's scale is arbitrary: its own normalisation is the only one it has)
    s_j    = exp(-rot_j / tau_rot) * exp(-dir_j / tau_dir) * exp(-mag_j / tau_mag)      in [0, 1]
    score  = mean_j s_j, with s_j = 0 for a frame the estimator could not measure (NaN pose)

Why these constants (defaults tau_rot = 10 deg, tau_dir = 20 deg, tau_mag = 0.5, dir_min_fraction = 0.25,
min_translation = 0.01 m): ReCamMaster's presets turn by 9.9-29.8 deg and a two-view estimate on a true render is
within ~0.2 deg (rotation) and ~1 deg (direction), so a true clip scores ~0.95; the same preset at half amplitude is
off by 2.5-7.5 deg on average over the frames (score 0.5-0.8), the mirrored one by twice the preset (~0.1-0.4), and a
static camera by the whole preset. Published generators are 5-10 deg off per frame (CamI2V, ReCamMaster's tables), so
tau_rot = 10 deg keeps a gradient where real models are rather than saturating at 0. Direction estimates at short
baselines are less precise than rotations (tau_dir twice tau_rot), and their first quarter of the path is skipped.
A pure dolly at half amplitude has the same direction and the same normalised magnitudes as the full one: a monocular
estimate cannot see metric scale (a metric estimator plug-in, as Geo-Align's MapAnything, could add it).

The papers' metrics (GRPO_NOTES "Camera accuracy"; CamI2V's evaluation code), over the measured frames:
    RotErr   = sum_j arccos((tr(R_req,j^T R_est,j) - 1) / 2)                   (radians, summed over frames;
               computed as rotation_angle's 2 asin(|R_req - R_est|_F / (2 sqrt 2)), the same angle for rotations,
               0 for equal matrices where arccos of a rounded trace gives ~1e-3 rad a frame)
    TransErr = sum_j | t~_req,j - t~_est,j |,  t~ = t / max_k |t_k| of its own path   (0/0 = 0)
    CamMC    = sum_j | [R_req,j | t~_req,j] - [R_est,j | t~_est,j] |_F
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

SQRT8 = 2.0 * np.sqrt(2.0)


def numbers_to_poses(numbers) -> np.ndarray:
    """ReCamMaster's camera numbers (F', 12) (top 3x4 of camera-to-world, row-major) -> (F', 4, 4) float64."""
    a = np.asarray(numbers, dtype=np.float64).reshape(-1, 3, 4)
    out = np.zeros((len(a), 4, 4))
    out[:, :3] = a
    out[:, 3, 3] = 1.0
    return out


def relative_to_first(poses) -> np.ndarray:
    """(F, 4, 4) camera-to-world -> inv(P_0) @ P_j for every j (float64; NaN rows stay NaN)."""
    p = np.asarray(poses, dtype=np.float64)
    return np.linalg.inv(p[0]) @ p


def rotation_angle(ra, rb) -> np.ndarray:
    """Geodesic angle (radians) between rotations ra, rb (..., 3, 3): 2 asin(|ra - rb|_F / (2 sqrt 2)) -- the same
    angle as arccos((tr(ra^T rb) - 1) / 2), exact 0 for equal matrices and well conditioned at small angles."""
    d = np.linalg.norm(np.asarray(ra, np.float64) - np.asarray(rb, np.float64), axis=(-2, -1))
    return 2.0 * np.arcsin(np.clip(d / SQRT8, 0.0, 1.0))


def vector_angle(a, b) -> np.ndarray:
    """Angle (radians) between vectors a, b (..., 3): atan2(|a x b|, a . b), exact 0 for equal vectors."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.arctan2(np.linalg.norm(np.cross(a, b), axis=-1), (a * b).sum(-1))


def _normalised(t: np.ndarray) -> np.ndarray:
    """Translations (F, 3) divided by their largest norm (finite rows only); all zero when the path has none."""
    n = np.linalg.norm(t, axis=-1)
    m = np.nanmax(n) if np.isfinite(n).any() else 0.0
    return t / m if m > 0 else np.zeros_like(t)


@dataclass(frozen=True)
class PoseScore:
    """The constants of the per-frame score (module docstring: why these values)."""

    tau_rot: float = 10.0  # degrees
    tau_dir: float = 20.0  # degrees
    tau_mag: float = 0.5  # normalised magnitude (1 = the whole path)
    dir_min_fraction: float = 0.25  # frames whose requested translation is below this share of the path's: no direction
    min_translation: float = 0.01  # a path moving less than this (the numbers' unit, metres) is a pure rotation

    def __post_init__(self):
        for k, v in self.__dict__.items():
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0) or (k.startswith("tau") and v <= 0):
                raise ValueError(f"cam_score: {k} must be a {'positive' if k.startswith('tau') else 'non-negative'} "
                                 f"number, got {v!r}")

    def frames(self, est, req) -> Dict[str, np.ndarray]:
        """Per-frame terms of an estimated and a requested path (both (F', 4, 4), relative to their frame 0 or not:
        both are taken relative to it here). Returns (F'-1,) arrays for frames 1 ... F'-1: "score" (0 where the
        estimate is NaN), "rot_deg", "dir_deg" (NaN where no direction is scored), "mag" (NaN where no magnitude is),
        "measured" (bool)."""
        est, req = np.asarray(est, np.float64), np.asarray(req, np.float64)
        if est.shape != req.shape or est.ndim != 3 or est.shape[1:] != (4, 4) or len(est) < 2:
            raise ValueError(f"cam_score: estimated {est.shape} and requested {req.shape} paths must both be (F', 4, 4) "
                             "with F' >= 2")
        req = relative_to_first(req)
        measured = np.isfinite(est).all(axis=(1, 2))
        if not measured[0]:  # nothing is relative to an unmeasured frame 0
            measured[:] = False
        est = relative_to_first(np.where(measured[:, None, None], est, np.eye(4))) if measured[0] else \
            np.broadcast_to(np.eye(4), est.shape).copy()
        measured, est, req = measured[1:], est[1:], req[1:]
        rot = np.degrees(rotation_angle(req[:, :3, :3], est[:, :3, :3]))
        t_req, t_est = req[:, :3, 3], np.where(measured[:, None], est[:, :3, 3], 0.0)
        n_req, n_est = np.linalg.norm(t_req, axis=-1), np.linalg.norm(t_est, axis=-1)
        path = n_req.max(initial=0.0)
        translates = path >= self.min_translation
        has_dir = translates & (n_req >= self.dir_min_fraction * path) & (n_req > 0)
        dir_deg = np.where(n_est > 0, np.degrees(vector_angle(t_req, t_est)), 90.0)
        dir_deg = np.where(has_dir, dir_deg, np.nan)
        # magnitudes normalised over the frames measured in both (an unmeasured last frame must not rescale the rest)
        req_max, est_max = n_req[measured].max(initial=0.0), n_est[measured].max(initial=0.0)
        m_req = n_req / req_max if req_max > 0 else np.zeros_like(n_req)
        m_est = n_est / est_max if est_max > 0 else np.zeros_like(n_est)
        mag = np.abs(m_req - m_est) if translates else np.full_like(n_req, np.nan)
        s = (np.exp(-rot / self.tau_rot) * np.exp(-np.nan_to_num(dir_deg) / self.tau_dir)
             * np.exp(-np.nan_to_num(mag) / self.tau_mag))
        s = np.where(measured, s, 0.0)
        nan = lambda v: np.where(measured, v, np.nan)  # noqa: E731
        return {"score": s, "rot_deg": nan(rot), "dir_deg": nan(dir_deg), "mag": nan(mag), "measured": measured}

    def clip(self, est, req) -> float:
        """The clip's score: the mean of frames()["score"]."""
        return float(self.frames(est, req)["score"].mean())


def camera_metrics(est, req) -> Dict[str, float]:
    """The papers' RotErr (radians), TransErr and CamMC (module docstring) of an estimated against a requested path
    (both (F, 4, 4)), both relative to their frame 0, summed over the frames the estimate measured (a NaN pose is
    left out; "failed_fraction" counts them among frames 1 ... F-1), and the mean rotation error in degrees."""
    est, req = np.asarray(est, np.float64), np.asarray(req, np.float64)
    ok = np.isfinite(est).all(axis=(1, 2))
    if not ok[0]:
        ok[:] = False
    req = relative_to_first(req)
    if not ok.any():
        nan = float("nan")
        return {"RotErr": nan, "TransErr": nan, "CamMC": nan, "rot_err_deg_mean": nan, "failed_fraction": 1.0}
    est = relative_to_first(np.where(ok[:, None, None], est, np.eye(4)))
    e, r = est[ok], req[ok]
    rot = rotation_angle(r[:, :3, :3], e[:, :3, :3])  # the arccos formula's angle, exact 0 for equal rotations
    te, tr = _normalised(e[:, :3, 3]), _normalised(req[:, :3, 3])[ok]  # each path by its own largest translation
    me, mr = e[:, :3].copy(), r[:, :3].copy()
    me[:, :, 3], mr[:, :, 3] = te, tr
    return {"RotErr": float(rot.sum()), "TransErr": float(np.linalg.norm(tr - te, axis=-1).sum()),
            "CamMC": float(np.linalg.norm(mr - me, axis=(1, 2)).sum()),
            "rot_err_deg_mean": float(np.degrees(rot[1:]).mean()) if len(e) > 1 else 0.0,
            "failed_fraction": float(1.0 - ok[1:].mean()) if len(ok) > 1 else 0.0}

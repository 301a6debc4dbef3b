"""Camera estimators for `cam_score` on real video: the camera path a clip shows, in 3-D, from its frames.

Interface (6-DoF), what every estimator here and every plug-in implements:

    estimate(frames, K) -> poses
      frames: (F, 3, H, W) float in [0, 1], numpy or torch (e.g. the 21 latent frames 0, 4, ..., 80 of a clip)
      K:      (3, 3) pinhole intrinsics in the frames' pixels, OpenCV's convention (pixel centres at +0.5)
      poses:  (F, 4, 4) float64, each frame's camera-to-world pose RELATIVE TO FRAME 0 (poses[0] = identity),
              OpenCV camera axes (x right, y down, z forward); a row of NaN (the whole 4 x 4) for a frame the
              estimator cannot tell. It never raises on bad pixels (black, noise, tiny frames): NaN rows.

Translation scale is arbitrary (a monocular estimate has no metric scale) but consistent across the frames of one clip,
so normalised magnitudes |t_j| / max_k |t_k| are meaningful; the score uses only those and the directions.

`POSE_ESTIMATORS` names the built-in ones: "two_view" (`estimate_two_view`, the default: OpenCV, CPU, 3.4 s
a clip of 21 frames at 480 x 832 on one core) and "glomap" (`estimate_glomap` in `pose_glomap`: pycolmap's global
mapper, the tool the papers evaluate with; slower, for evaluation). `load_pose_estimator(spec, kwargs)` turns a
config value into an estimator.

A learned estimator on a GPU (VGGT, MapAnything, Pi3; weights the user brings, nothing downloads here) plugs in by
dotted path ("pkg.module:factory", the factory called with the config's kwargs, e.g. a checkpoint path and a device).
It has to: take the frames as given (resize / pad to its own input size itself and keep K consistent with that),
use K when it accepts intrinsics (VGGT and Pi3 predict their own; then it is only a check), return camera-to-world
(VGGT returns world-to-camera extrinsics: invert them), re-express every pose relative to frame 0
(inv(P_0) @ P_j), convert its camera axes to OpenCV's if they differ (OpenGL's y up / z backward: flip y and z), and
put NaN rows where its confidence is low instead of a guess. A metric-scale estimator (MapAnything, Geo-Align's
reward) could also report the scale; the score does not use it (it compares normalised magnitudes), so a dolly at
half its amplitude scores as the full one - that is what a metric estimator would add.

The two-view estimator (why each step):
  1. grey frames downscaled so the longer side is <= max_side (K scaled with them): SIFT at 832 x 480 costs 3x the
     time for no accuracy, and full resolution sometimes converged to a wrong essential matrix;
  2. SIFT features per frame; each frame j matched with frame 0 (nearest neighbours, Lowe's ratio test);
  3. model selection per pair: the best pure rotation (Kabsch on the bearing vectors of the homography's MAGSAC
     inliers) against the MAGSAC essential matrix. When the rotation explains the essential matrix's inliers to
     within `rotation_px` (median, working pixels) the translation is unobservable: the pair is read as a rotation
     with t = 0 (pan, tilt), never as a translation along a noisy epipole. A homography alone is not the test: a
     translation in front of a dominant plane also fits one;
  4. otherwise recoverPose gives the pair's R, the translation's direction and the inliers' depths in frame 0's
     camera. When any pair translates, frame 0's keypoints are put in 3-D: the reference pair (much parallax, many
     points; its |t| = 1 sets the clip's scale) and the other translated pairs rescaled to it (median ratio of the
     depths they share); each frame's pose is then PnP (MAGSAC-style RANSAC on SQPnP, Levenberg-Marquardt refined) on
     the 3-D points it matches. PnP makes the scale consistent across the clip and keeps early frames of a motion
     (small baselines, where an essential matrix's direction is noise) accurate; a clip whose pairs are all
     rotations keeps the rotations (t = 0);
  5. a frame that matches frame 0 too poorly (little overlap at the end of a long arc) is chained through its
     nearest measured predecessor k: PnP on the 3-D points k sees, through the matches (k, j).
Pitfalls met: a view filled by one low-texture plane (a wall 2 m away) is two-fold ambiguous for an essential matrix:
a dolly toward it reads 3 deg / 3-8 deg off, a diagonal move up to 56 deg in direction (open; the homography's
decomposition with one plane normal shared by the frames would settle it); low texture and noise give few or wrong
matches (NaN rows below `min_inliers`); reading each early frame's pose from its own essential matrix, and reading
small-parallax frames of a moving clip as rotations, cost 1-2 deg (PnP on shared 3-D points fixed both); chaining
neighbours adds errors up along the chain, so it is the fallback only. Deterministic: cv2's RNG is seeded before each
robust fit.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ddpo_grpo.errors import ConfigError

Estimator = Callable[..., np.ndarray]


def _as_numpy(frames) -> np.ndarray:
    if hasattr(frames, "detach"):  # torch without importing it here
        frames = frames.detach().float().cpu().numpy()
    return np.asarray(frames, dtype=np.float32)


def _grey_frames(frames, K: np.ndarray, max_side: int) -> Tuple[list, np.ndarray]:
    """(F, 3, H, W) in [0, 1] -> F grey uint8 images, downscaled to longer side <= max_side, and K for them."""
    x = _as_numpy(frames)
    if x.ndim != 4 or x.shape[1] != 3:
        raise ConfigError(f"pose estimator: frames must be (F, 3, H, W), got {tuple(x.shape)}")
    K = np.asarray(K, dtype=np.float64)
    if K.shape != (3, 3) or not np.isfinite(K).all():
        raise ConfigError(f"pose estimator: K must be a finite (3, 3) matrix, got {K.shape}")
    h, w = x.shape[2:]
    grey = np.nan_to_num(0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2], nan=0.0)
    grey = (np.clip(grey, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    scale = min(1.0, float(max_side) / max(h, w))
    if scale >= 1.0:
        return list(grey), K.copy()
    import cv2
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    sx, sy = nw / w, nh / h
    # pixel-centre convention: x' + 0.5 = (x + 0.5) * s
    Ks = np.array([[K[0, 0] * sx, K[0, 1] * sx, (K[0, 2] + 0.5) * sx - 0.5],
                   [0.0, K[1, 1] * sy, (K[1, 2] + 0.5) * sy - 0.5], [0.0, 0.0, 1.0]])
    return [cv2.resize(g, (nw, nh), interpolation=cv2.INTER_AREA) for g in grey], Ks


def _kabsch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rotation R minimising sum |b_i - R a_i|^2 over unit bearings a, b (N, 3)."""
    u, _, vt = np.linalg.svd(b.T @ a)
    d = np.sign(np.linalg.det(u @ vt))
    return u @ np.diag([1.0, 1.0, d]) @ vt


def _project(K: np.ndarray, pts: np.ndarray) -> np.ndarray:
    p = pts @ K.T
    with np.errstate(divide="ignore", invalid="ignore"):
        return p[:, :2] / p[:, 2:3]


class _Pair:
    """Relative pose of view b from view a: x_b = R x_a + t (|t| = 1, or 0 for a rotation) and the inliers' depths
    in view a (keypoint index in a -> depth at |t| = 1)."""

    def __init__(self, R, t, rotation, idx_a, depth_a, parallax):
        self.R, self.t, self.rotation, self.parallax = R, t, rotation, parallax
        self.depth = dict(zip(idx_a.tolist(), depth_a.tolist()))


def _match(fa, fb, ratio: float) -> np.ndarray:
    """(N, 2) keypoint indices (a, b) of nearest-neighbour matches passing Lowe's ratio test."""
    import cv2
    da, db = fa[1], fb[1]
    if da is None or db is None or len(da) < 2 or len(db) < 2:
        return np.zeros((0, 2), np.int64)
    knn = cv2.BFMatcher(cv2.NORM_L2).knnMatch(da, db, k=2)
    good = [(m[0].queryIdx, m[0].trainIdx) for m in knn if len(m) == 2 and m[0].distance < ratio * m[1].distance]
    return np.asarray(good, dtype=np.int64).reshape(-1, 2)


def _bearings(K: np.ndarray, p: np.ndarray) -> np.ndarray:
    b = np.c_[p, np.ones(len(p))] @ np.linalg.inv(K).T
    return b / np.linalg.norm(b, axis=1, keepdims=True)


def _two_view(pa: np.ndarray, pb: np.ndarray, idx_a: np.ndarray, K: np.ndarray, o: dict) -> Optional[_Pair]:
    """Model selection (pure rotation vs essential matrix) and pose for matched points pa, pb (N, 2) of two views;
    None when it cannot tell."""
    import cv2
    n_min, thr = o["min_inliers"], o["ransac_px"]
    if len(pa) < n_min:
        return None
    ba, bb = _bearings(K, pa), _bearings(K, pb)
    cv2.setRNGSeed(o["seed"])
    E, mask_e = cv2.findEssentialMat(pa, pb, K, method=cv2.USAC_MAGSAC, prob=0.9999, threshold=thr)
    cv2.setRNGSeed(o["seed"])
    H, mask_h = cv2.findHomography(pa, pb, cv2.USAC_MAGSAC, thr, confidence=0.9999)
    in_e = mask_e.ravel().astype(bool) if E is not None and E.shape == (3, 3) else np.zeros(len(pa), bool)
    in_h = mask_h.ravel().astype(bool) if H is not None else np.zeros(len(pa), bool)
    if max(in_e.sum(), in_h.sum()) < n_min:
        return None
    # the best pure rotation, fitted on the homography's inliers, then refitted on the matches it explains
    R_rot = _kabsch(*((ba[in_h], bb[in_h]) if in_h.sum() >= n_min else (ba[in_e], bb[in_e])))
    for _ in range(2):
        ok = np.linalg.norm(_project(K, ba @ R_rot.T) - pb, axis=1) < 2.0 * thr
        if ok.sum() < 3:
            break
        R_rot = _kabsch(ba[ok], bb[ok])
    res = np.linalg.norm(_project(K, ba @ R_rot.T) - pb, axis=1)
    parallax = float(np.median(res[in_e if in_e.sum() >= n_min else in_h]))
    if parallax < o["rotation_px"] or in_e.sum() < n_min:
        if (res < 2.0 * thr).sum() < n_min:
            return None
        return _Pair(R_rot, np.zeros(3), True, np.zeros(0, np.int64), np.zeros(0), parallax)
    _, R, t, mask_p, X = cv2.recoverPose(E, pa, pb, K, distanceThresh=1e4, mask=mask_e.copy())
    with np.errstate(divide="ignore", invalid="ignore"):
        depth = X[2] / X[3]
    good = mask_p.ravel().astype(bool) & in_e & np.isfinite(depth) & (depth > 0)
    if good.sum() < n_min:
        return None
    return _Pair(R, t.ravel() / max(np.linalg.norm(t), 1e-12), False, idx_a[good], depth[good], parallax)


def _scale(ref: Dict[int, float], own: Dict[int, float], min_shared: int) -> float:
    """|t| of a pair relative to the reference pair: the median ratio of the reference's depths to the pair's own
    (each at |t| = 1) over the keypoints of view a they share; NaN when fewer than min_shared."""
    shared = [k for k in own if k in ref]
    if len(shared) < min_shared:
        return float("nan")
    r = np.array([ref[k] for k in shared]) / np.array([own[k] for k in shared])
    r = r[np.isfinite(r) & (r > 0)]
    return float(np.exp(np.median(np.log(r)))) if len(r) >= min_shared else float("nan")


def _c2w(R: np.ndarray, t: np.ndarray) -> np.ndarray:
    """camera-to-world (world = view a's camera) of view b from x_b = R x_a + t."""
    P = np.eye(4)
    P[:3, :3] = R.T
    P[:3, 3] = -R.T @ t
    return P


def _pnp(X: np.ndarray, p: np.ndarray, K: np.ndarray, o: dict) -> Optional[np.ndarray]:
    """camera-to-world of a view from 3-D points X (N, 3) in frame 0's camera and their pixels p (N, 2); None if
    too few inliers."""
    import cv2
    if len(X) < o["min_inliers"]:
        return None
    cv2.setRNGSeed(o["seed"])
    ok, rvec, tvec, inl = cv2.solvePnPRansac(X, p, K, None, iterationsCount=200, reprojectionError=2.0 * o["ransac_px"],
                                             confidence=0.999, flags=cv2.SOLVEPNP_SQPNP)
    if not ok or inl is None or len(inl) < o["min_inliers"]:
        return None
    inl = inl.ravel()
    rvec, tvec = cv2.solvePnPRefineLM(X[inl], p[inl], K, None, rvec, tvec)
    return _c2w(cv2.Rodrigues(rvec)[0], tvec.ravel())


def estimate_two_view(frames, K, max_side: int = 512, n_features: int = 1500, ratio: float = 0.8,
                      ransac_px: float = 1.0, rotation_px: float = 0.6, min_inliers: int = 20,
                      min_shared: int = 8, contrast: float = 0.01, chain: bool = True,
                      seed: int = 0) -> np.ndarray:
    """Camera-to-world poses relative to frame 0 from frames (F, 3, H, W) in [0, 1] and intrinsics K (3, 3).

    Returns (F, 4, 4) float64 (module docstring: OpenCV axes, poses[0] = I, NaN rows where it cannot tell, scale
    arbitrary but shared by the clip). max_side: longer side the frames are downscaled to; n_features: SIFT
    features per frame; ratio: Lowe's ratio test; ransac_px: MAGSAC threshold (working pixels); rotation_px: median
    parallax left after the best pure rotation below which a pair is read as a rotation with t = 0; min_inliers:
    matches (and PnP inliers) a pose needs; min_shared: keypoints two pairs share to carry the scale; contrast:
    SIFT's contrast threshold (0.01, a quarter of OpenCV's default: more features on low-texture renders, measured
    more accurate); chain: measure frames that fail against frame 0 through their nearest measured predecessor (PnP on
    the 3-D points it sees); seed: cv2's RNG.
    """
    import cv2
    grey, Kw = _grey_frames(frames, K, max_side)
    F = len(grey)
    out = np.full((F, 4, 4), np.nan)
    if F == 0:
        return out
    out[0] = np.eye(4)
    o = dict(ratio=ratio, ransac_px=ransac_px, rotation_px=rotation_px, min_inliers=min_inliers, seed=seed)
    if min(grey[0].shape) < 16:  # nothing to find in a thumbnail
        return out
    sift = cv2.SIFT_create(nfeatures=n_features, contrastThreshold=contrast)
    feats = []
    for g in grey:
        kps, desc = sift.detectAndCompute(g, None)
        feats.append((np.array([k.pt for k in kps], np.float64).reshape(-1, 2), desc))
    matches = {j: _match(feats[0], feats[j], ratio) for j in range(1, F)}
    pairs = {j: _two_view(feats[0][0][m[:, 0]], feats[j][0][m[:, 1]], m[:, 0], Kw, o) for j, m in matches.items()}
    moved = [j for j, p in pairs.items() if p is not None and not p.rotation]
    if not moved:  # the clip only turns: every measured frame is a rotation
        for j, p in pairs.items():
            if p is not None:
                out[j] = _c2w(p.R, p.t)
        if chain:
            _chain_rotations(out, feats, Kw, o)
        return out
    # frame 0's keypoints in 3-D: the reference pair (much parallax and many points; its |t| = 1 sets the clip's
    # scale) and every other translated pair, rescaled to the reference through the depths they share; a keypoint
    # seen by several pairs takes its depth from the one with the most parallax
    ref = max(moved, key=lambda j: (pairs[j].parallax * np.sqrt(len(pairs[j].depth)), j))
    depth = {}
    for j in sorted(moved, key=lambda j: pairs[j].parallax):
        s = 1.0 if j == ref else _scale(pairs[ref].depth, pairs[j].depth, min_shared)
        if np.isfinite(s):
            depth.update({a: d * s for a, d in pairs[j].depth.items()})
    depth.update(pairs[ref].depth)
    ids = np.array(sorted(depth), dtype=np.int64)
    X = np.c_[feats[0][0][ids], np.ones(len(ids))] @ np.linalg.inv(Kw).T
    X *= np.array([depth[i] for i in ids.tolist()])[:, None]
    point_of = {int(a): n for n, a in enumerate(ids)}  # frame-0 keypoint -> row of X
    seen = {}  # frame -> {its keypoint: row of X}
    for j in range(1, F):
        sel = [(point_of[a], b) for a, b in matches[j].tolist() if a in point_of]
        seen[j] = {b: n for n, b in sel}
        if sel:
            rows, kp = np.array(sel, dtype=np.int64).T
            pose = _pnp(X[rows], feats[j][0][kp], Kw, o)
            if pose is not None:
                out[j] = pose
    if chain:
        for j in range(2, F):
            if np.isfinite(out[j]).all():
                continue
            k = next((i for i in range(j - 1, 0, -1) if np.isfinite(out[i]).all() and seen[i]), None)
            if k is None:
                continue
            sel = [(seen[k][a], b) for a, b in _match(feats[k], feats[j], ratio).tolist() if a in seen[k]]
            if sel:
                rows, kp = np.array(sel, dtype=np.int64).T
                pose = _pnp(X[rows], feats[j][0][kp], Kw, o)
                if pose is not None:
                    out[j], seen[j] = pose, {b: n for n, b in sel}
    return out


def _chain_rotations(out: np.ndarray, feats: list, Kw: np.ndarray, o: dict) -> None:
    """Frames of a turning clip that frame 0 could not measure: rotation from the nearest measured predecessor."""
    for j in range(2, len(out)):
        if np.isfinite(out[j]).all():
            continue
        k = next((i for i in range(j - 1, 0, -1) if np.isfinite(out[i]).all()), None)
        if k is None:
            continue
        m = _match(feats[k], feats[j], o["ratio"])
        p = _two_view(feats[k][0][m[:, 0]], feats[j][0][m[:, 1]], m[:, 0], Kw, o)
        if p is not None and p.rotation:
            out[j] = out[k] @ _c2w(p.R, p.t)


def _glomap(frames, K, **kwargs) -> np.ndarray:
    """`pose_glomap.estimate_glomap` (imported on first use: pycolmap is optional)."""
    from .pose_glomap import estimate_glomap
    return estimate_glomap(frames, K, **kwargs)


_glomap.__name__ = "estimate_glomap"
estimate_glomap = _glomap
POSE_ESTIMATORS: Dict[str, Estimator] = {"two_view": estimate_two_view, "glomap": estimate_glomap}


def load_pose_estimator(spec, kwargs: Optional[dict] = None) -> Estimator:
    """An estimator `estimate(frames (F, 3, H, W), K (3, 3)) -> (F, 4, 4)` from a config value:
      - a name of POSE_ESTIMATORS ("two_view", "glomap"): kwargs are its keyword arguments (e.g. max_side);
      - "pkg.module:name": the attribute, imported; with kwargs it is a factory called with them (a learned
        estimator's checkpoint, device, ...) and what it returns is the estimator;
      - a callable: as it is, or a factory called with kwargs when they are given.
    Anything else (unknown name, missing module or attribute, not callable) is one ConfigError line."""
    kwargs = dict(kwargs or {})
    if callable(spec):
        est = spec(**kwargs) if kwargs else spec
    elif isinstance(spec, str) and spec in POSE_ESTIMATORS:
        base = POSE_ESTIMATORS[spec]
        if not kwargs:
            return base
        est = functools.partial(base, **kwargs)
        try:  # a wrong keyword fails now, not in the first reward call
            inspect.signature(base).bind(None, None, **kwargs)
        except TypeError as e:
            raise ConfigError(f"pose estimator {spec!r}: {e}") from None
    elif isinstance(spec, str) and ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except ImportError as e:
            raise ConfigError(f"pose estimator {spec!r}: cannot import {mod_name!r} ({e})") from None
        except AttributeError:
            raise ConfigError(f"pose estimator {spec!r}: module {mod_name!r} has no {attr!r}") from None
        est = obj(**kwargs) if kwargs and callable(obj) else obj
    else:
        raise ConfigError(f"pose estimator {spec!r}: use one of {sorted(POSE_ESTIMATORS)}, a 'pkg.module:name' path "
                          "or a callable")
    if not callable(est):
        raise ConfigError(f"pose estimator {spec!r} is not callable (got {type(est).__name__})")
    return est

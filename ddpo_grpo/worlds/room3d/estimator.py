"""The world's own exact camera estimator: the camera path a clip of a known room shows, by matching renders.

The world knows the scene, so for each frame it looks for the pose whose render matches the frame (direct image
alignment against the exact renderer):
  1. frames are area-resampled so that the longer side is <= max_side (K through the same resampling): the frames
     of training are tiny already (32 x 48), larger ones are only slower, not more telling, at this accuracy;
  2. frame 0 starts at the scene's source pose; frame j at the best of a few guesses scored by the blurred image
     difference: the pose of frame j - 1, its constant-velocity continuation, and frame j - 1 moved by each motion
     of a small bank (pans, tilts, dollies, translations, arcs of ReCamMaster's kinds and sizes per latent step), so
     a 20 deg step between two latent frames is found, not only the one next to the previous pose;
  3. Levenberg-Marquardt on the photometric residual, coarse to fine (Gaussian blur of sigma = `sigmas` x the
     working width): the Jacobian is analytic, the image gradient (mean of render and frame, as ESM) times the pixel
     flow of a 6-DoF camera motion at the render's exact depth - one render per iteration, not 7;
  4. a frame whose best render correlates with it less than `min_ncc` (zero-mean, at a medium blur) is a NaN row:
     black frames, noise, another room. The output is relative to frame 0 (inv(P_0) @ P_j); a NaN frame 0 makes
     every row NaN (there is no reference).
It reads the scene in metres, so unlike a monocular estimator its translations have the true scale.
`covisible=True` compares only the pixels whose surface the source camera saw (each render's depth reprojected into
the source view, occlusion tested against its depth), in the LM residuals and the final correlation, and says NaN
where less than `min_covisible` of the frame is such: what the source never showed a model can only invent, and a
feature-based estimator would not read it either. Off by default (the figures in docs/recam.md are without it).

Interface: `estimate_exact(frames (F, 3, H, W) in [0, 1], K (3, 3), scene) -> (F, 4, 4)` float64, camera-to-world
relative to frame 0, OpenCV camera axes, NaN rows where it cannot tell. cam_score's 6-DoF hook is
`estimate(frames, K)`; `make_exact_estimator(scene=None, **options)` binds it:
  - with a scene: `make_exact_estimator(scene)` is that `estimate(frames, K)`;
  - without one it reads the scene from each clip's metadata: items of `Room3DConditions` carry "scene_seed" (an int,
    small enough to travel to cam_score's worker processes), and cam_score hands an estimator with
    `takes_metadata = True` the item's small metadata (`pose_reward._estimate`): config
    `pose_estimator = "ddpo_grpo.worlds.room3d.estimator:exact_estimator"` (defaults), or
    `"ddpo_grpo.worlds.room3d.estimator:make_exact_estimator"` with estimator kwargs (max_side, ...).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .paths import so3_exp
from .render import render_view_depth
from .scene import Scene, make_scene, source_pose


@functools.lru_cache(maxsize=64)
def blur_matrix(n: int, sigma: float) -> np.ndarray:
    """(n, n) Gaussian blur along one axis (reflecting edges, the edge pixel repeated); identity for sigma <= 0.2.
    The world's one blur: the estimator's (below) and view_match's (reward.py) both multiply by it."""
    if sigma <= 0.2:
        return np.eye(n)
    r = max(1, int(np.ceil(3 * sigma)))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    m = np.zeros((n, n))
    for i in range(n):
        for o, w in zip(range(-r, r + 1), k):
            j = i + o
            j = -j - 1 if j < 0 else (2 * n - j - 1 if j >= n else j)
            m[i, min(max(j, 0), n - 1)] += w
    return m


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """(3, h, w) blurred by a Gaussian of `sigma` pixels (separable: two small matrix products)."""
    _, h, w = img.shape
    return blur_matrix(h, float(sigma)) @ img @ blur_matrix(w, float(sigma)).T


def _area_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in): each output pixel the mean of the input it covers (exact area resampling)."""
    m = np.zeros((n_out, n_in))
    s = n_in / n_out
    for i in range(n_out):
        a, b = i * s, (i + 1) * s
        for j in range(int(np.floor(a)), min(int(np.ceil(b)), n_in)):
            m[i, j] = min(b, j + 1) - max(a, j)
    return m / s


def working_frames(frames: np.ndarray, K: np.ndarray, max_side: int) -> Tuple[np.ndarray, np.ndarray]:
    """(F, 3, h, w) float64 frames with max(h, w) <= max_side and their K (pixel centres: u' + 0.5 = s (u + 0.5))."""
    f = np.asarray(frames, dtype=np.float64)
    _, _, H, W = f.shape
    s = min(1.0, max_side / max(H, W))
    h, w = max(1, int(round(H * s))), max(1, int(round(W * s)))
    K = np.asarray(K, dtype=np.float64).copy()
    if (h, w) == (H, W):
        return f, K
    sx, sy = w / W, h / H
    f = np.einsum("ih,fchw,jw->fcij", _area_matrix(H, h), f, _area_matrix(W, w), optimize=True)
    K[0, :] *= sx
    K[1, :] *= sy
    K[0, 2] = (K[0, 2] / sx + 0.5) * sx - 0.5
    K[1, 2] = (K[1, 2] / sy + 0.5) * sy - 0.5
    return f, K


def _step(delta: np.ndarray) -> np.ndarray:
    """(4, 4) camera motion of delta = (v (3,), w (3,)) in the camera's own frame."""
    t = np.eye(4)
    t[:3, :3] = so3_exp(delta[3:])
    t[:3, 3] = delta[:3]
    return t


def _bank() -> list:
    """Motions (camera frame) tried from the previous pose: ReCamMaster's kinds at the sizes one latent step of a
    short clip takes (pans and arcs up to ~30 deg, ~1.3 m: a 9-frame clip has two steps for up to 75 deg)."""
    out = []
    for deg in (6.0, 12.0, 20.0, 30.0):
        a = np.radians(deg)
        for sgn in (1.0, -1.0):
            out.append(np.array([0, 0, 0, 0, sgn * a, 0]))  # pan
            if deg < 25:
                out.append(np.array([0, 0, 0, sgn * a, 0, 0]))  # tilt
            r = 4.0  # arc around a point ~4 m ahead
            out.append(np.array([-sgn * r * np.sin(a), 0, r * (1 - np.cos(a)), 0, sgn * a, 0]))
    for d in (0.5, 1.0):
        for sgn in (1.0, -1.0):
            out.append(np.array([0, 0, sgn * d, 0, 0, 0]))  # dolly
            out.append(np.array([sgn * d, 0, 0, 0, 0, 0]))  # truck
            out.append(np.array([0, sgn * d * 0.6, 0, -sgn * 0.14 * d, 0, 0]))  # pedestal turning to the subject
    return [_step(x) for x in out]


BANK = _bank()


def _sq(a: np.ndarray, b: np.ndarray, mask: Optional[np.ndarray] = None) -> float:
    """Mean squared difference of two (3, h, w) images over the pixels of `mask` (h, w) (all when None)."""
    d = (a - b) ** 2
    if mask is None:
        return float(d.mean())
    return float(d[:, mask].mean()) if mask.any() else float("inf")


def _ncc(a: np.ndarray, b: np.ndarray, mask: Optional[np.ndarray] = None) -> float:
    """Zero-mean normalised correlation of two (3, h, w) images over the pixels of `mask` (all when None)."""
    if mask is not None:
        a, b = a[:, mask], b[:, mask]
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 1e-9 else 0.0


class _Aligner:
    """Renders of one scene at the working size, and the alignment of one frame (module docstring, steps 2-3)."""

    def __init__(self, scene: Scene, K: np.ndarray, h: int, w: int, supersample: int):
        self.scene, self.K, self.h, self.w, self.ss = scene, K, h, w, supersample
        v, u = np.mgrid[0:h, 0:w].astype(np.float64)
        ki = np.linalg.inv(K)
        self.x = ki[0, 0] * u + ki[0, 1] * v + ki[0, 2]
        self.y = ki[1, 1] * v + ki[1, 2]
        self.ref = None  # (world-to-camera (4, 4), depth (h, w)) of the camera whose view bounds `covisible`

    def set_reference(self, pose: np.ndarray) -> None:
        """Only what the camera at `pose` (the source camera) sees is compared from now on (`covisible`)."""
        self.ref = (np.linalg.inv(pose), self.render(pose)[1])

    def covisible(self, pose: np.ndarray, depth: np.ndarray) -> Optional[np.ndarray]:
        """(h, w) bool: the pixels of the view from `pose` (its render's depth) whose surface point the reference
        camera sees (in its frame, nearer than 5 % + 5 cm behind what it sees there); None without a reference."""
        if self.ref is None:
            return None
        inv_ref, dref = self.ref
        m = inv_ref @ pose
        pts = np.stack([self.x * depth, self.y * depth, depth])  # (3, h, w) in the view's camera axes
        xs = np.einsum("ij,jhw->ihw", m[:3, :3], pts) + m[:3, 3, None, None]
        z = np.maximum(xs[2], 1e-6)
        u = (self.K[0, 0] * xs[0] + self.K[0, 1] * xs[1]) / z + self.K[0, 2]
        v = self.K[1, 1] * xs[1] / z + self.K[1, 2]
        ui, vi = np.rint(u).astype(np.int64), np.rint(v).astype(np.int64)
        inside = (xs[2] > 1e-3) & (ui >= 0) & (ui < self.w) & (vi >= 0) & (vi < self.h)
        seen = dref[np.clip(vi, 0, self.h - 1), np.clip(ui, 0, self.w - 1)]
        return inside & (xs[2] <= 1.05 * seen + 0.05)

    def render(self, pose: np.ndarray, ss: int = 1):
        rgb, depth = render_view_depth(self.scene, pose, self.K, self.h, self.w, ss)
        return rgb.astype(np.float64), depth.astype(np.float64)

    def cost(self, pose, target_b, sigma) -> float:
        return float(((_blur(self.render(pose)[0], sigma) - target_b) ** 2).mean())

    def refine(self, pose: np.ndarray, frame: np.ndarray, sigma: float, iters: int, ss: int = 1,
               tol: float = 1e-4) -> np.ndarray:
        """Levenberg-Marquardt at one blur level (renders with ss x ss rays a pixel) until a step is below tol
        radians and 5 tol metres; returns the improved pose."""
        target = _blur(frame, sigma)
        rgb, depth = self.render(pose, ss)
        rb = _blur(rgb, sigma)
        vis = self.covisible(pose, depth)
        cost = _sq(rb, target, vis)
        lam = 1e-3
        m = int(np.ceil(sigma)) + 1  # the border where the blur sees the reflection, not the scene
        interior = np.zeros((self.h, self.w), bool)
        interior[m:self.h - m, m:self.w - m] = True
        fx, fy = self.K[0, 0], self.K[1, 1]
        for _ in range(iters):
            g = 0.5 * (rb + target)
            gy, gx = np.gradient(g, axis=1), np.gradient(g, axis=2)
            x, y, iz = self.x, self.y, 1.0 / np.maximum(depth, 1e-3)
            ju = fx * np.stack([-iz, 0 * iz, x * iz, x * y, -(1 + x * x), y], axis=-1)
            jv = fy * np.stack([0 * iz, -iz, y * iz, 1 + y * y, -x * y, -x], axis=-1)
            a = gx[..., None] * ju[None] + gy[..., None] * jv[None]
            rows = interior if vis is None else interior & vis
            a = a[:, rows].reshape(-1, 6)
            r = (target - rb)[:, rows].reshape(-1)
            if len(r) < 12:
                break
            ata, atr = a.T @ a, a.T @ r
            improved = False
            for _ in range(6):
                try:
                    delta = np.linalg.solve(ata + lam * np.diag(np.diag(ata) + 1e-9), -atr)
                except np.linalg.LinAlgError:
                    break
                cand = pose @ _step(delta)
                rgb_c, depth_c = self.render(cand, ss)
                rb_c = _blur(rgb_c, sigma)
                cost_c = _sq(rb_c, target, vis)
                if cost_c < cost:
                    pose, rb, depth, improved = cand, rb_c, depth_c, True
                    vis = self.covisible(pose, depth)
                    cost = _sq(rb, target, vis)
                    lam = max(lam / 10, 1e-6)
                    break
                lam *= 10
            if not improved or (np.linalg.norm(delta[3:]) < tol and np.linalg.norm(delta[:3]) < 5 * tol):
                break
        return pose


def estimate_exact(frames, K, scene: Scene, max_side: int = 96, supersample: int = 2,
                   sigmas: Sequence[float] = (0.05, 0.02, 0.0), iters: int = 6, min_ncc: float = 0.5,
                   start: Optional[np.ndarray] = None, covisible: bool = False,
                   min_covisible: float = 0.25) -> np.ndarray:
    """(F, 4, 4) float64 camera-to-world poses of frames (F, 3, H, W) in [0, 1] (numpy or torch) of `scene` with
    intrinsics K (3, 3) (OpenCV's pixel convention), relative to frame 0; NaN rows where the best render correlates
    with the frame less than min_ncc. `start`: frame 0's first guess (default the scene's source pose); `sigmas`:
    the blur levels as fractions of the working width (0: 0.5 px); iters: LM iterations per level (twice that at the
    finest, where the render's sub-pixel steps make convergence slow); covisible / min_covisible: compare only what
    the source camera saw (module docstring). Module docstring: how."""
    if hasattr(frames, "detach"):
        frames = frames.detach().cpu().float().numpy()
    frames = np.asarray(frames, dtype=np.float64)
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"room3d estimate_exact: frames must be (F, 3, H, W), got {frames.shape}")
    n = len(frames)
    out = np.full((n, 4, 4), np.nan)
    if n == 0 or not np.isfinite(frames).all():
        return out
    work, kw = working_frames(np.clip(frames, 0.0, 1.0), K, max_side)
    _, _, h, w = work.shape
    al = _Aligner(scene, kw, h, w, supersample)
    if covisible:  # compare only what the source camera saw: the rest a model can only invent
        al.set_reference(source_pose(scene) if start is None else np.asarray(start, dtype=np.float64))
    # the guesses are told apart at the coarsest blur, where half the pixels show the same: scored at half size
    half, khalf = working_frames(work, kw, max(h, w) // 2) if max(h, w) >= 32 else (work, kw)
    al_half = _Aligner(scene, khalf, half.shape[2], half.shape[3], 1)
    # coarse levels: one ray a pixel (the blur hides aliasing); the finest: `supersample` rays, as exact as it gets
    px = [max(0.5, s * w) for s in sigmas]
    poses = []
    for j in range(n):
        frame = work[j]
        if frame.std() < 1e-3:  # a flat frame (black, one colour) shows no camera: nothing to align
            out[j] = np.nan
            if j == 0:
                break
            poses.append(poses[-1])
            continue
        if j == 0:
            guesses = [source_pose(scene) if start is None else np.asarray(start, dtype=np.float64)]
        else:
            prev = poses[-1]
            guesses = [prev] + [prev @ b for b in BANK]
            if j >= 2:
                guesses.append(prev @ np.linalg.inv(poses[-2]) @ prev)
        if len(guesses) > 1:
            sig = px[0] * half.shape[3] / w
            target = _blur(half[j], sig)
            pose = min(guesses, key=lambda g: al_half.cost(g, target, sig))
        else:
            pose = guesses[0]
        for k, s in enumerate(px):
            last = k == len(px) - 1  # coarse levels only need to bring the pose into the next one's reach
            pose = al.refine(pose, frame, s, 2 * iters if last else iters, supersample if last else 1,
                             1e-4 if last else 1e-3)
        poses.append(pose)
        mid = px[min(1, len(px) - 1)]
        rgb, depth = al.render(pose)
        vis = al.covisible(pose, depth)
        seen = vis is None or vis.mean() >= min_covisible
        out[j] = pose if seen and _ncc(_blur(rgb, mid), _blur(frame, mid), vis) >= min_ncc else np.nan
        if j == 0 and not np.isfinite(out[0]).all():
            break  # no reference frame: every row is NaN, the rest is not worth aligning
    if not np.isfinite(out[0]).all():
        return np.full((n, 4, 4), np.nan)
    inv0 = np.linalg.inv(out[0])
    return np.stack([inv0 @ p if np.isfinite(p).all() else p for p in out])


class ExactEstimator:
    """cam_score's 6-DoF estimator `estimate(frames (F, 3, H, W), K (3, 3)) -> (F, 4, 4)` for room3d clips: the
    scene bound at construction, or read per clip from metadata["scene_seed"] (module docstring)."""

    takes_metadata = True

    def __init__(self, scene: Optional[Scene] = None, **options):
        self.scene, self.options = scene, options
        self._scenes: Dict[int, Scene] = {}

    def __call__(self, frames, K, metadata: Optional[dict] = None) -> np.ndarray:
        scene = self.scene
        if scene is None:
            seed = (metadata or {}).get("scene_seed")
            if seed is None:
                raise ValueError("room3d exact estimator: no scene bound and no metadata['scene_seed'] "
                                 "(items of Room3DConditions carry it)")
            seed = int(np.asarray(seed).reshape(-1)[0])
            scene = self._scenes.get(seed)
            if scene is None:
                scene = self._scenes[seed] = make_scene(seed)
        return estimate_exact(frames, K, scene, **self.options)


def make_exact_estimator(scene: Optional[Scene] = None, **options) -> ExactEstimator:
    """The exact estimator bound to `scene` (or reading metadata["scene_seed"] when None); options go to
    `estimate_exact` (max_side, supersample, sigmas, iters, min_ncc, covisible, min_covisible)."""
    return ExactEstimator(scene, **options)


exact_estimator = ExactEstimator()  # the dotted-path default: scenes from the clips' metadata

"""`cam_score`: does the generated view show the source scene moved by the requested camera motion?

A pose estimator `estimate(source, target) -> (dx, dy, zoom)` (or None when it cannot tell) measures the
motion between metadata[i]["source"] (np (3, 32, 32) in [0, 1]) and the generated image, in the
convention of `ddpo_grpo.worlds.recam.world` (target position p = 16 + zoom * (q - 16 - (dx, dy)) for a source
position q). It is compared with the requested motion metadata[i]["camera"] = (dx, dy, zoom):

    translation_error = |(dx, dy)_est - (dx, dy)|        (source-view pixels)
    zoom_error        = |log(zoom_est / zoom)|
    score             = exp(-translation_error / tau_translation) * exp(-zoom_error / tau_zoom)   in [0, 1]

Defaults tau_translation = 2 px and tau_zoom = 0.1: a 1 px or a 5 % zoom miss each cost ~40 %.
Details (per sample): `cam_score_accuracy` (1 when translation_error < acc_translation = 1.5 px and
zoom_error < acc_zoom = 0.08), `translation_error`, `zoom_error` (NaN when the estimator found nothing)
and `estimate_failed` (1/0). An image in which nothing can be measured (e.g. all black) is a legitimate
bad sample: score 0. Images with non-finite pixels score NaN (invalid), as in the toyworld reward.

Video (clips (B, F, 3, H, W), the video world `ddpo_grpo.worlds.recam.video`): metadata[i]["source_video"]
((F, 3, H, W), torch or numpy, in [0, 1]) and metadata[i]["motions"] ((F, 3): the requested (dx, dy, zoom) of
target frame f relative to source frame f, in the world's 32-unit view coordinates). Frame f of clip i (frame 0,
the identity, included) is estimated against source frame f and scored with the same formula; the estimator
works in pixels of the frames it is given, so its (dx, dy) are scaled by 32 / min(H, W) (views of any size S,
e.g. 64; a non-square view's 32 units span its shorter side, world.render_view).
The clip's score is the mean over its frames. Details per clip: `cam_score_accuracy` (the fraction of accurate
frames), `translation_error` and `zoom_error` (means over the measured frames, NaN when none was),
`estimate_failed` (the fraction of frames not measured) and `cam_score_frame00`, `cam_score_frame01`, ... (each
frame's score; the reward computer takes details of shape (B,), so per-frame values are one key per frame). A
clip with any non-finite pixel scores NaN (its frame scores too). The reward function has `takes_clips = True`,
so the registry hands it video batches whole (still images go the image path above, unchanged).

Real video (clips whose items carry "cameras" (F', 12), ReCamMaster's numbers, and "intrinsics" (fx, fy, cx, cy)
instead of "motions": MultiCamVideo, a user's folder, the 3-D world): the clip's camera path is estimated in 3-D by a
6-DoF estimator (`pose_estimator`, default "two_view": OpenCV two-view geometry, in a process pool of `workers`) and
scored against the requested path, with the camera-control papers' RotErr / TransErr / CamMC beside it:
`pose_reward` (what is read and returned) and `pose_score` (the formula and why its constants).

cam_score measures geometry only (where and how large the content is); colour/shape fidelity and image
quality are left to other rewards (e.g. `unifiedscore`).

Estimators (factory kwarg `estimator`):
  - "moments" (default): foreground = max over channels minus the image's median (the background), kept
    where it exceeds `gate` and its 3x3 mean exceeds `support` (isolated noise is ignored); zoom = ratio
    of the foreground's radii of gyration sqrt(var_x + var_y) (target / source), translation from the
    foreground centroids. Exact up to rasterisation for the world's renders (all objects are fully in
    both views; shapes are scaled and shifted, never rotated or cropped).
  - "pkg.module:name": a user's (e.g. learned) estimator, imported by dotted path. With
    `estimator_kwargs` the attribute is a factory called with them to build the estimator. An estimator
    with a truthy attribute `batched` is called once with stacked arrays (B, 3, H, W) and must return
    an array (B, 3) of (dx, dy, zoom) (NaN rows for failures).
  - any callable (when building the reward in Python).
"""
from __future__ import annotations

import importlib
import math
import warnings
from typing import Callable, Optional, Tuple, Union

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.rewards._images import finite_rows, image_batch

from .world import VIEW_SIZE

Estimate = Optional[Tuple[float, float, float]]


def _box3(v: np.ndarray) -> np.ndarray:
    """3x3 box mean with zero padding."""
    p = np.pad(v, 1)
    h, w = v.shape
    return sum(p[i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9.0


def foreground_moments(img: np.ndarray, gate: float = 0.1, support: float = 0.2
                       ) -> Optional[Tuple[float, float, float, float]]:
    """(mass, cx, cy, radius of gyration) of the foreground of an image (3, H, W) in [0, 1], or None if empty.

    Foreground weight: v = max over channels minus its median (the background level); a pixel counts with
    weight v where v > `gate` and the 3x3 mean of v exceeds `support` (drops isolated noise pixels, keeps
    anti-aliased rims). Coordinates are continuous pixels (pixel k spans [k, k+1)); 1/12 px^2 per axis is
    added to the variance for the extent of each pixel, so a rendered shape's moments match the continuous
    shape's.
    """
    v = np.asarray(img, dtype=np.float64).max(axis=0)
    v = v - np.median(v)
    w = np.where((v > gate) & (_box3(v) > support), v, 0.0)
    mass = w.sum()
    if mass < 2.0:
        return None
    h, wd = w.shape
    ys = np.arange(h) + 0.5
    xs = np.arange(wd) + 0.5
    px, py = w.sum(axis=0), w.sum(axis=1)
    cx, cy = (px * xs).sum() / mass, (py * ys).sum() / mass
    var = (px * (xs - cx) ** 2).sum() / mass + (py * (ys - cy) ** 2).sum() / mass + 2 / 12
    return float(mass), float(cx), float(cy), float(math.sqrt(var))


def estimate_moments(source: np.ndarray, target: np.ndarray, gate: float = 0.1, support: float = 0.2) -> Estimate:
    """Camera motion (dx, dy, zoom) from `source` to `target` (both (3, H, W) in [0, 1]) by foreground moments:
    zoom = ratio of radii of gyration, then the pan that carries the source centroid to the target's."""
    ms, mt = foreground_moments(source, gate, support), foreground_moments(target, gate, support)
    if ms is None or mt is None or ms[3] <= 0:
        return None
    h, w = np.asarray(source).shape[-2:]
    zoom = mt[3] / ms[3]
    dx = (ms[1] - w / 2) - (mt[1] - w / 2) / zoom
    dy = (ms[2] - h / 2) - (mt[2] - h / 2) / zoom
    return float(dx), float(dy), float(zoom)


ESTIMATORS = {"moments": estimate_moments}


def load_estimator(spec: Union[str, Callable], kwargs: Optional[dict] = None) -> Callable:
    """A built-in estimator name, a "pkg.module:name" path or a callable -> an estimate(source, target) callable."""
    if callable(spec):
        est = spec(**kwargs) if kwargs else spec
    elif isinstance(spec, str) and spec in ESTIMATORS:
        base = ESTIMATORS[spec]
        est = (lambda s, t: base(s, t, **kwargs)) if kwargs else base
    elif isinstance(spec, str) and ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cam_score estimator {spec!r} could not be imported: {type(e).__name__}: {e}") from e
        est = obj(**kwargs) if kwargs else obj
    else:
        raise ConfigError(f"cam_score estimator must be one of {sorted(ESTIMATORS)}, a 'pkg.module:name' path "
                          f"or a callable; got {spec!r}")
    if not callable(est):
        raise ConfigError(f"cam_score estimator {spec!r} is not callable (got {type(est).__name__})")
    return est


def _as_array(x, what: str, i: int) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().float().numpy()
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 3 or a.shape[0] != 3:
        raise ValueError(f"cam_score needs metadata[{i}][{what!r}] as an array (3, H, W) in [0, 1], "
                         f"got shape {a.shape}")
    return a


def _camera(m, i: int) -> Tuple[float, float, float]:
    cam = m.get("camera") if isinstance(m, dict) else None
    try:
        dx, dy, zoom = (float(v) for v in cam)
    except (TypeError, ValueError):
        raise ValueError(f"cam_score needs metadata[{i}]['camera'] = (dx, dy, zoom), got {cam!r}") from None
    if not zoom > 0:
        raise ValueError(f"cam_score: metadata[{i}]['camera'] has zoom {zoom!r}; it must be > 0")
    return dx, dy, zoom


def _motions(m, i: int, frames: int) -> np.ndarray:
    mo = m.get("motions") if isinstance(m, dict) else None
    if isinstance(mo, torch.Tensor):
        mo = mo.detach().cpu().double().numpy()
    try:
        a = np.asarray(mo, dtype=np.float64)
    except (TypeError, ValueError):
        a = np.zeros(0)
    if a.shape != (frames, 3):
        raise ValueError(f"cam_score on video needs metadata[{i}]['motions'] as an array ({frames}, 3) of "
                         f"(dx, dy, zoom) per frame, got {getattr(a, 'shape', mo)!r}")
    if not (a[:, 2] > 0).all():
        raise ValueError(f"cam_score: metadata[{i}]['motions'] has a zoom <= 0; zooms must be > 0")
    return a


def _source_video(m, i: int, frames: int, hw: Tuple[int, int]) -> np.ndarray:
    v = m.get("source_video") if isinstance(m, dict) else None
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().float().numpy()
    a = np.asarray(v, dtype=np.float32) if v is not None else np.zeros(0)
    if a.shape != (frames, 3) + tuple(hw):
        raise ValueError(f"cam_score on video needs metadata[{i}]['source_video'] as an array ({frames}, 3, "
                         f"{hw[0]}, {hw[1]}) in [0, 1] like the generated clips, got shape {a.shape}")
    return a


def score_motion(est: np.ndarray, req: np.ndarray, tau_translation: float = 2.0, tau_zoom: float = 0.1):
    """(scores, translation_error, zoom_error) for estimated and requested motions, both (B, 3) = (dx, dy, zoom).

    Rows of `est` with NaN (estimator failed) score 0 with NaN errors."""
    est, req = np.asarray(est, np.float64), np.asarray(req, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        terr = np.hypot(est[:, 0] - req[:, 0], est[:, 1] - req[:, 1])
        zerr = np.abs(np.log(est[:, 2] / req[:, 2]))
    ok = np.isfinite(terr) & np.isfinite(zerr)
    terr[~ok], zerr[~ok] = np.nan, np.nan
    scores = np.where(ok, np.exp(-np.nan_to_num(terr) / tau_translation) * np.exp(-np.nan_to_num(zerr) / tau_zoom), 0.0)
    return scores, terr, zerr


def video_batch(videos, reward_name: str) -> torch.Tensor:
    """`videos` (B, F, 3, H, W) in [0, 1] (torch or numpy) as a float32 CPU tensor."""
    if isinstance(videos, np.ndarray):
        videos = torch.from_numpy(videos)
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"reward {reward_name!r} expects clips (B, F, 3, H, W), got "
                         f"{tuple(getattr(videos, 'shape', ())) or type(videos).__name__}")
    return videos.detach().to("cpu", torch.float32)


def make_cam_score(estimator: Union[str, Callable] = "moments", estimator_kwargs: Optional[dict] = None,
                   tau_translation: float = 2.0, tau_zoom: float = 0.1,
                   acc_translation: float = 1.5, acc_zoom: float = 0.08,
                   pose_estimator: Union[str, Callable] = "two_view", pose_estimator_kwargs: Optional[dict] = None,
                   workers: int = 1, tau_rot: float = 10.0, tau_dir: float = 20.0, tau_mag: float = 0.5,
                   acc_rot_deg: float = 2.0, acc_dir_deg: float = 5.0, source_frame_weight: float = 0.0):
    """Reward fn scoring generated views (B, 3, H, W) in [0, 1] against metadata "source" and "camera", and clips
    (B, F, 3, H, W): the 2-D world's against "source_video" + "motions" (`estimator`, above), any other clip against
    "cameras" + "intrinsics" in 3-D (`pose_estimator`, `workers`, tau_rot / tau_dir / tau_mag, acc_rot_deg /
    acc_dir_deg, source_frame_weight: `pose_reward`)."""
    from .pose_reward import PoseReward
    from .pose_score import PoseScore

    try:
        pose_score = PoseScore(tau_rot=tau_rot, tau_dir=tau_dir, tau_mag=tau_mag)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pose_reward = None  # built on the first clip batch that needs it (the 2-D worlds never load OpenCV)
    for name, v in (("tau_translation", tau_translation), ("tau_zoom", tau_zoom),
                    ("acc_translation", acc_translation), ("acc_zoom", acc_zoom)):
        if not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"cam_score: {name} must be a positive number, got {v!r}")
    est_fn = load_estimator(estimator, estimator_kwargs)
    batched = bool(getattr(est_fn, "batched", False))

    def estimates(sources: np.ndarray, imgs: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """(N, 3) estimates (NaN rows: failed or not ok) of the motion from sources[n] to imgs[n] (N, 3, H, W)."""
        n = len(imgs)
        if batched:
            est = np.asarray(est_fn(sources, imgs), dtype=np.float64)
            if est.shape != (n, 3):
                raise ValueError(f"cam_score: batched estimator returned shape {est.shape}, expected ({n}, 3)")
        else:
            est = np.full((n, 3), np.nan)
            for i in range(n):
                if ok[i]:
                    e = est_fn(sources[i], imgs[i])
                    if e is not None:
                        est[i] = [float(v) for v in e]
        est[~ok] = np.nan
        return est

    def accurate(terr: np.ndarray, zerr: np.ndarray) -> np.ndarray:
        """Bool: measured, within acc_translation and within acc_zoom."""
        failed = ~np.isfinite(terr)
        return (~failed & (np.where(failed, np.inf, terr) < acc_translation)
                & (np.where(failed, np.inf, zerr) < acc_zoom))

    def cam_score(images, prompts, metadata):
        if getattr(images, "ndim", 0) == 5:
            return cam_score_video(images, metadata)
        x = image_batch(images, "cam_score")
        b = x.shape[0]
        if metadata is None or len(metadata) != b:
            raise ValueError(f"cam_score needs one metadata dict per image: {b} images, "
                             f"{None if metadata is None else len(metadata)} metadata entries")
        ok = finite_rows(x)
        imgs = np.nan_to_num(x.numpy())
        req = np.array([_camera(m, i) for i, m in enumerate(metadata)], dtype=np.float64).reshape(b, 3)
        sources = [_as_array(m.get("source"), "source", i) for i, m in enumerate(metadata)]
        est = estimates(np.stack(sources) if batched else sources, imgs, ok)
        scores, terr, zerr = score_motion(est, req, tau_translation, tau_zoom)
        failed = ~np.isfinite(terr)
        acc = accurate(terr, zerr)
        scores = scores.astype(np.float32)
        scores[~ok] = np.nan
        details = {
            "cam_score_accuracy": acc.astype(np.float32),
            "translation_error": terr.astype(np.float32),
            "zoom_error": zerr.astype(np.float32),
            "estimate_failed": (failed & ok).astype(np.float32),
        }
        return scores, details

    def cam_score_video(videos, metadata):
        """Clips (B, F, 3, H, W): every frame scored against its source frame and requested motion, then averaged
        (the 2-D world: items with "motions"), or the clip's 3-D camera path against "cameras" (pose_reward)."""
        nonlocal pose_reward
        x = video_batch(videos, "cam_score")
        b, f, _, h, w = x.shape
        if metadata is None or len(metadata) != b:
            raise ValueError(f"cam_score needs one metadata dict per clip: {b} clips, "
                             f"{None if metadata is None else len(metadata)} metadata entries")
        ok_clip = finite_rows(x)
        if b and not any(isinstance(m, dict) and "motions" in m for m in metadata):
            if pose_reward is None:
                pose_reward = PoseReward(pose_estimator, pose_estimator_kwargs, workers, pose_score, acc_rot_deg,
                                         acc_dir_deg, source_frame_weight)
            return pose_reward(x, metadata, ok_clip)
        ok = np.repeat(ok_clip, f)
        imgs = np.nan_to_num(x.numpy()).reshape(b * f, 3, h, w)
        req = np.concatenate([_motions(m, i, f) for i, m in enumerate(metadata)])
        sources = np.concatenate([_source_video(m, i, f, (h, w)) for i, m in enumerate(metadata)])
        est = estimates(sources, imgs, ok)
        # image px -> the world's 32-unit view coordinates of the requested motions (they span the shorter side of a
        # non-square view, world.render_view)
        est[:, :2] *= VIEW_SIZE / min(h, w)
        scores, terr, zerr = score_motion(est, req, tau_translation, tau_zoom)
        acc = accurate(terr, zerr)
        failed = ~np.isfinite(terr) & ok
        per = lambda v: np.asarray(v, np.float64).reshape(b, f)  # noqa: E731
        frame_scores = per(scores)
        frame_scores[~ok_clip] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN clips (no frame measured) stay NaN
            terr_clip, zerr_clip = np.nanmean(per(terr), axis=1), np.nanmean(per(zerr), axis=1)
        details = {
            "cam_score_accuracy": per(acc).mean(axis=1),
            "translation_error": terr_clip,
            "zoom_error": zerr_clip,
            "estimate_failed": per(failed).mean(axis=1),
        }
        details.update({f"cam_score_frame{k:02d}": frame_scores[:, k] for k in range(f)})
        details = {k: np.asarray(v, np.float32) for k, v in details.items()}
        return frame_scores.mean(axis=1).astype(np.float32), details

    cam_score.takes_clips = True  # video batches come whole (ddpo_grpo.rewards.registry.RewardFn), see above
    return cam_score

"""`cam_score` on real video: the camera a clip shows, estimated in 3-D and scored against the camera the model was
given (`make_cam_score`'s clip path when the items carry "cameras" and "intrinsics" rather than the 2-D world's
"motions").

Per clip i (clips (B, F, 3, H, W) in [0, 1]):
  - metadata[i]["cameras"]: (F', 12), ReCamMaster's numbers exactly as the model got them: the target camera at latent
    frames 0 ... F'-1 (clip frames 0, 4, 8, ...; F' = (F - 1) / 4 + 1, or F' = F for clips already at one frame per
    latent frame), top 3x4 of camera-to-world row-major, relative to the source camera's frame 0;
  - metadata[i]["intrinsics"]: (fx, fy, cx, cy) in the clip's pixels (OpenCV: the top-left pixel's centre is (0, 0)).
The clip's frames at the latent frames go to a 6-DoF estimator `estimate(frames (F', 3, H, W) in [0, 1], K (3, 3))
-> (F', 4, 4)` camera-to-world relative to frame 0, NaN rows where it cannot tell (`pose_estimators`; the default
"two_view" is OpenCV's two-view geometry). The estimated path is scored against inv(C_0) @ C_j by
`pose_score.PoseScore` (the formula and its constants are there): the clip's score is the mean over frames 1 ... F'-1,
an unmeasured frame scoring 0; a clip with any non-finite pixel scores NaN (invalid: never trained on).

Frame 0 against the source (`source_frame_weight`, default 0 = off): in training pairs C_0 != I (the target camera
does not start where the source camera stands). With a weight w > 0 the generated frame 0 is estimated against
metadata[i]["source_video"]'s frame 0 and scored against C_0 as one more frame of weight w. Off by default: the two
cameras of a MultiCamVideo pair are often tens of degrees and metres apart, where a two-view estimate on generated
content fails more often than it measures, and the relative path is what the model's camera layers are asked for.

Details per clip (the papers' names, `pose_score.camera_metrics`): RotErr (radians, summed over frames), TransErr,
CamMC, rot_err_deg / dir_err_deg / mag_err (means over the measured frames), estimate_failed (the fraction of frames
1 ... F'-1 not measured), cam_score_accuracy (the fraction of frames within acc_rot_deg and, where a direction is
scored, acc_dir_deg), cam_score_frameNN (each frame's score, NN = latent frame), and source_frame_score with the term.

Off the sampling's critical path: with `workers` > 0 (default 1) the clips are estimated in a process pool (spawned
once, on first use), so the reward thread that overlaps sampling waits on other processes instead of holding the
trainer's GIL with OpenCV's Python glue. Frames travel as uint8.
"""
from __future__ import annotations

import atexit
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError

from .pose_score import PoseScore, camera_metrics, numbers_to_poses

_WORKER_ESTIMATORS: Dict[Any, Callable] = {}  # in a pool worker: the estimator built once per spec


def load_estimator(spec: Union[str, Callable], kwargs: Optional[dict] = None) -> Callable:
    """A 6-DoF estimator: a callable as it is (a factory called with kwargs when given), else
    `pose_estimators.load_pose_estimator` (a name such as "two_view", or a "pkg.module:name" path)."""
    if callable(spec):
        est = spec(**kwargs) if kwargs else spec
    else:
        from .pose_estimators import load_pose_estimator

        est = load_pose_estimator(spec, kwargs)
    if not callable(est):
        raise ConfigError(f"cam_score pose_estimator {spec!r} is not callable (got {type(est).__name__})")
    return est


def intrinsics_matrix(intr, i: int) -> np.ndarray:
    """(fx, fy, cx, cy) -> K (3, 3) float64; anything else is a ValueError naming the item."""
    if isinstance(intr, torch.Tensor):
        intr = intr.detach().cpu().double().numpy()
    try:
        fx, fy, cx, cy = (float(v) for v in np.asarray(intr, dtype=np.float64).reshape(-1))
    except (TypeError, ValueError):
        raise ValueError(f"cam_score on real video needs metadata[{i}]['intrinsics'] = (fx, fy, cx, cy) in the clip's "
                         f"pixels (MultiCamVideo items carry them; a folder of your own: data.fov_deg), got "
                         f"{intr!r}") from None
    if not (fx > 0 and fy > 0 and np.isfinite([cx, cy]).all()):
        raise ValueError(f"cam_score: metadata[{i}]['intrinsics'] {fx, fy, cx, cy} needs fx, fy > 0 and a finite centre")
    return np.array([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]])


def requested_path(cams, i: int, frames: int) -> np.ndarray:
    """metadata[i]["cameras"] (F', 12) -> (F', 4, 4) float64, F' checked against the clip's F frames."""
    if isinstance(cams, torch.Tensor):
        cams = cams.detach().cpu().double().numpy()
    a = np.asarray(cams, dtype=np.float64) if cams is not None else np.zeros(0)
    n_lat = (frames - 1) // 4 + 1
    if a.ndim != 2 or a.shape[1] != 12 or len(a) not in (n_lat, frames) or len(a) < 2 or not np.isfinite(a).all():
        raise ValueError(f"cam_score on real video needs metadata[{i}]['cameras'] as finite ({n_lat}, 12) camera "
                         f"numbers for a clip of {frames} frames, got {getattr(a, 'shape', cams)!r}")
    return numbers_to_poses(a)


def latent_frame_indices(frames: int, n_cams: int) -> List[int]:
    """The clip frames the camera numbers describe: 0, 4, 8, ... (or every frame when F' = F)."""
    return list(range(frames)) if n_cams == frames else [4 * j for j in range(n_cams)]


def _estimate(spec, kwargs, frames_u8: np.ndarray, K: np.ndarray, meta: Optional[dict]) -> np.ndarray:
    """Run the estimator on uint8 frames (F, 3, H, W) (in a pool worker or in this process) -> (F, 4, 4) float64."""
    key = (spec if isinstance(spec, str) else id(spec), repr(sorted((kwargs or {}).items())))
    est = _WORKER_ESTIMATORS.get(key)
    if est is None:
        est = _WORKER_ESTIMATORS[key] = load_estimator(spec, kwargs)
    frames = frames_u8.astype(np.float32) / 255.0
    out = est(frames, K, metadata=meta) if getattr(est, "takes_metadata", False) else est(frames, K)
    out = np.asarray(out, dtype=np.float64)
    if out.shape != (len(frames), 4, 4):
        raise ValueError(f"cam_score: pose estimator returned shape {out.shape}, expected ({len(frames)}, 4, 4)")
    return out


def _to_u8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


class PoseReward:
    """The clip path of `cam_score` for items with "cameras" + "intrinsics" (module docstring)."""

    def __init__(self, estimator: Union[str, Callable] = "two_view", estimator_kwargs: Optional[dict] = None,
                 workers: int = 1, score: Optional[PoseScore] = None, acc_rot_deg: float = 2.0,
                 acc_dir_deg: float = 5.0, source_frame_weight: float = 0.0):
        if not (isinstance(workers, int) and workers >= 0):
            raise ConfigError(f"cam_score: workers must be an int >= 0 (0: estimate in the reward thread), got {workers!r}")
        if not (isinstance(source_frame_weight, (int, float)) and source_frame_weight >= 0):
            raise ConfigError(f"cam_score: source_frame_weight must be >= 0, got {source_frame_weight!r}")
        self.spec, self.kwargs = estimator, dict(estimator_kwargs or {})
        est = load_estimator(estimator, estimator_kwargs)  # a bad spec is one line now, not in a worker mid-run
        self._takes_meta = bool(getattr(est, "takes_metadata", False))
        if workers and callable(estimator) and not _picklable(estimator):
            workers = 0  # a closure built in Python cannot travel to a pool: estimated here
        self.workers, self.score = workers, score or PoseScore()
        self.acc_rot_deg, self.acc_dir_deg, self.w_src = float(acc_rot_deg), float(acc_dir_deg), float(source_frame_weight)
        self._pool: Optional[ProcessPoolExecutor] = None

    def _submit(self, frames_u8, K, meta):
        if not self.workers:
            return _Done(_estimate(self.spec, self.kwargs, frames_u8, K, meta))
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            atexit.register(self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool.submit(_estimate, self.spec, self.kwargs, frames_u8, K, meta)

    def __call__(self, x: torch.Tensor, metadata, ok_clip: np.ndarray):
        """x: clips (B, F, 3, H, W) float32 on the CPU; ok_clip (B,) bool (finite pixels). -> (scores, details)."""
        b, f = x.shape[:2]
        clips = np.nan_to_num(x.numpy())
        jobs = []
        for i, m in enumerate(metadata):
            req = requested_path(m.get("cameras"), i, f)
            K = intrinsics_matrix(m.get("intrinsics"), i)
            idx = latent_frame_indices(f, len(req))
            meta = _small(m) if self._takes_meta else None
            main = self._submit(_to_u8(clips[i, idx]), K, meta) if ok_clip[i] else None
            src = None
            if self.w_src > 0 and ok_clip[i] and not np.allclose(req[0], np.eye(4), atol=1e-6):
                source = m.get("source_video")
                if isinstance(source, torch.Tensor):
                    source = source.detach().cpu().float().numpy()
                if source is not None:
                    pair = np.stack([np.asarray(source, np.float32)[0], clips[i, 0]])
                    src = self._submit(_to_u8(pair), K, meta)
            jobs.append((req, main, src))
        n = len(jobs[0][0]) - 1 if jobs else 0
        scores = np.full(b, np.nan, dtype=np.float32)
        det = {k: np.full(b, np.nan, dtype=np.float32) for k in (
            "RotErr", "TransErr", "CamMC", "rot_err_deg", "dir_err_deg", "mag_err", "estimate_failed",
            "cam_score_accuracy", "source_frame_score")}
        frame_scores = np.full((b, max(n, 0)), np.nan, dtype=np.float32)
        for i, (req, main, src) in enumerate(jobs):
            if main is None:
                continue
            est = main.result()
            t = self.score.frames(est, req)
            s = t["score"]
            total, weight = s.sum(), len(s)
            if src is not None:
                s0 = float(self.score.frames(src.result(), np.stack([np.eye(4), req[0]]))["score"][0])
                det["source_frame_score"][i] = s0
                total, weight = total + self.w_src * s0, weight + self.w_src
            scores[i] = total / weight
            if len(s) == n:
                frame_scores[i] = s
            met = camera_metrics(est, req)
            acc = t["measured"] & (t["rot_deg"] < self.acc_rot_deg) & ~(np.nan_to_num(t["dir_deg"]) >= self.acc_dir_deg)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN slice: NaN, said once here
                det["RotErr"][i], det["TransErr"][i], det["CamMC"][i] = met["RotErr"], met["TransErr"], met["CamMC"]
                det["rot_err_deg"][i] = np.nanmean(t["rot_deg"]) if t["measured"].any() else np.nan
                det["dir_err_deg"][i] = np.nanmean(t["dir_deg"]) if np.isfinite(t["dir_deg"]).any() else np.nan
                det["mag_err"][i] = np.nanmean(t["mag"]) if np.isfinite(t["mag"]).any() else np.nan
            det["estimate_failed"][i] = 1.0 - t["measured"].mean()
            det["cam_score_accuracy"][i] = acc.mean()
        if not np.isfinite(det["source_frame_score"]).any():
            det.pop("source_frame_score")
        det.update({f"cam_score_frame{k + 1:02d}": frame_scores[:, k] for k in range(frame_scores.shape[1])})
        return scores, det


def _small(m: dict) -> dict:
    """An item's metadata without its clips (what an estimator that takes metadata may read: seeds, names, numbers)."""
    return {k: v for k, v in m.items() if np.size(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v) <= 4096}


class _Done:
    """A finished result with a Future's result()."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _picklable(obj) -> bool:
    import pickle

    try:
        pickle.dumps(obj)
        return True
    except Exception:  # noqa: BLE001  (any reason a callable cannot be sent to a worker)
        return False

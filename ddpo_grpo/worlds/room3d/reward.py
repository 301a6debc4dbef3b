"""Rewards of the 3-D world that know the room (registered as plugins, setup.py): cam_margin and view_match.

cam_margin: a contrastive camera reward.

A clip's cam_score against the requested camera MINUS its cam_score against the opposite motion
(`paths.opposite_motion`: the path mirrored about its main axis, the word swapped). What a clip is scored for by both,
how well it is read at all (sharp frames the estimator can align, no lost objects), cancels; what is left is the
direction. docs/recam_log.md (sixteenth session) measured why this matters: at the start of `recam3d_tiny_grpo` most of a
pan group's cam_score differences are how well a clip is read, not which way it turns, and the recipe's 5,120 clips go
to that first. The score against the requested camera stays in the details as "cam_score" (so an eval logs the
held-out cam_score beside the margin) with the opposite's as "cam_opposite".

view_match: how much more a clip looks like the exact render along the requested path than like the render along the
opposite path (zero-mean normalised cross-correlation per frame, after a Gaussian blur). No camera is estimated: the
world renders both clips, so the score is smooth in how far a sample leans one way or the other, where a pose
estimate (and so cam_score) jumps between the two. A clip the model draws as a blend of the two motions scores in
proportion to the blend; cam_score scores it as whichever layout the estimator locks onto.
"""
from __future__ import annotations

import numpy as np
import torch

from ..recam.cam_score import make_cam_score
from ..recam.pose_reward import intrinsics_matrix
from ddpo_grpo.errors import ConfigError

from .data import render_path
from .estimator import blur_matrix
from .paths import clip_cameras, opposite_motion


def opposite_cameras(item: dict) -> np.ndarray:
    """(F', 12) float64 camera numbers of the OPPOSITE of a room3d item's target path (needs the item's "target_path"
    (F, 4, 4) and "preset" name, as Room3DConditions gives them): cam_margin's second request, and what
    benchmarks/recam3d_start.py scores every clip against."""
    if not isinstance(item, dict) or "target_path" not in item or "preset" not in item:
        raise ValueError("cam_margin scores room3d clips: each item needs its 'target_path' and 'preset' "
                         "(data.name=room3d)")
    path, _ = opposite_motion(np.asarray(item["target_path"], np.float64), item["preset"])
    return clip_cameras(path)


def opposite_item(item: dict) -> dict:
    """The condition item with its "cameras" (F', 12) replaced by the opposite motion's numbers (opposite_cameras)."""
    return dict(item, cameras=torch.from_numpy(opposite_cameras(item)).float())


def make_cam_margin(opposite_weight: float = 1.0, **cam_score_kwargs):
    """Reward fn for room3d clips (B, F, 3, H, W): (B,) cam_score(requested) - opposite_weight * cam_score(opposite),
    in [-w, 1], with make_cam_score's options (pose_estimator, pose_estimator_kwargs, workers, tau_rot, ...). Each clip
    is estimated twice (once per request); details: "cam_score", "cam_opposite" and the requested score's own details.
    Writing s = R + D and o = R - D (R: what both requests score alike, how well the clip is read; D: its direction),
    the reward is (1 - w) R + (1 + w) D: w = 1 ranks on the direction alone, w = 0 is cam_score, w in between keeps
    paying for a clip being read while weighting its direction (1 + w) / (1 - w) times as much."""
    w = float(opposite_weight)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"cam_margin's opposite_weight must be in [0, 1], got {opposite_weight!r}")
    score = make_cam_score(**cam_score_kwargs)

    def cam_margin(videos, prompts, metadata):
        opposite = [opposite_item(m) for m in metadata]  # first: an item of another world fails before any estimate
        s, details = score(videos, prompts, metadata)
        o, _ = score(videos, prompts, opposite)
        s, o = np.asarray(s, np.float32), np.asarray(o, np.float32)
        return s - np.float32(w) * o, dict(details, cam_score=s, cam_opposite=o)

    cam_margin.takes_clips = True  # whole clips, as cam_score takes them
    return cam_margin


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """x (N, C, H, W) through the estimator's separable Gaussian of `sigma` px (estimator.blur_matrix, reflecting
    edges), in x's dtype; sigma <= 0.2: x itself."""
    if sigma <= 0.2:
        return x
    h, w = x.shape[-2:]
    mh, mw = (torch.from_numpy(blur_matrix(n, float(sigma))).to(x) for n in (h, w))
    return mh @ x @ mw.T


def frame_ncc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) zero-mean normalised cross-correlation of frames a, b (N, C, H, W) over all their values; 0 where either
    frame is flat."""
    a = a.flatten(1) - a.flatten(1).mean(dim=1, keepdim=True)
    b = b.flatten(1) - b.flatten(1).mean(dim=1, keepdim=True)
    den = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(den > 1e-12, (a * b).sum(dim=1) / den.clamp_min(1e-12), torch.zeros_like(den))


def make_view_match(opposite_weight: float = 0.5, blur_px: float = 1.0, supersample: int = 2):
    """Reward fn for room3d clips (B, F, 3, H, W) in [0, 1]: (B,) m_req - opposite_weight * m_opp, where m_req is the
    mean over frames 1..F-1 of frame_ncc(clip_f, target_f) (the item's "target_video", the exact render along the
    requested path) and m_opp the same against the render along the opposite motion (`render_path` of
    `opposite_motion`, at the item's intrinsics and `supersample`), both frames blurred by `blur_px` first (the model's
    frames come through a 4 x 4-compressing VAE). Frame 0 is the source camera in both and is left out. In [-1 - w,
    1 + w]; w = 0 pays for looking like the requested clip, w = 1 only for looking more like it than like the opposite.
    Details: "view_requested", "view_opposite" (B,)."""
    w, blur, ss = float(opposite_weight), float(blur_px), int(supersample)
    if not 0.0 <= w <= 1.0:
        raise ConfigError(f"view_match's opposite_weight must be in [0, 1], got {opposite_weight!r}")
    if not 0.0 <= blur <= 8.0:
        raise ConfigError(f"view_match's blur_px must be in [0, 8] pixels, got {blur_px!r}")
    if ss < 1:
        raise ConfigError(f"view_match's supersample must be an int >= 1, got {supersample!r}")
    cache = {}  # (scene_seed, path bytes) -> the opposite render: train conditions recur across epochs

    def opposite_clip(item: dict, height: int, width: int) -> np.ndarray:
        path = np.asarray(item["target_path"], np.float64)
        key = (int(item["scene_seed"]), path.tobytes(), height, width)
        if key not in cache:
            K = intrinsics_matrix(item["intrinsics"], 0)
            cache[key] = render_path(item["scene_seed"], opposite_motion(path, item["preset"])[0], K, height, width, ss)
        return cache[key]

    def view_match(videos, prompts, metadata):
        for m in metadata:
            if not isinstance(m, dict) or not {"target_video", "target_path", "preset", "scene_seed",
                                               "intrinsics"} <= set(m):
                raise ValueError("view_match scores room3d clips: each item needs its 'target_video', 'target_path', "
                                 "'preset', 'scene_seed' and 'intrinsics' (data.name=room3d)")
        clips = torch.as_tensor(videos).float().cpu()
        if clips.ndim != 5:
            raise ValueError(f"view_match takes clips (B, F, 3, H, W), got shape {tuple(clips.shape)}")
        B, F, C, H, W = clips.shape
        req = torch.stack([torch.as_tensor(np.asarray(m["target_video"], np.float32)) for m in metadata])
        if req.shape != clips.shape:  # before any opposite clip is rendered
            raise ValueError(f"view_match: target clips {tuple(req.shape)} do not match the samples {tuple(clips.shape)}")
        opp = torch.stack([torch.from_numpy(opposite_clip(m, H, W)) for m in metadata])
        x, r, o = (_blur(t[:, 1:].reshape(-1, C, H, W), blur) for t in (clips, req, opp))
        m_req = frame_ncc(x, r).view(B, F - 1).mean(dim=1).numpy()
        m_opp = frame_ncc(x, o).view(B, F - 1).mean(dim=1).numpy()
        return (m_req - np.float32(w) * m_opp).astype(np.float32), dict(view_requested=m_req, view_opposite=m_opp)

    view_match.takes_clips = True
    return view_match

"""cam_margin: a contrastive camera reward for the 3-D world (registered as a plugin, setup.py).

A clip's cam_score against the requested camera MINUS its cam_score against the opposite motion
(`paths.opposite_motion`: the path mirrored about its main axis, the word swapped). What a clip is scored for by both,
how well it is read at all (sharp frames the estimator can align, no lost objects), cancels; what is left is the
direction. docs/recam.md (sixteenth session) measured why this matters: at the start of `recam3d_tiny_grpo` most of a
pan group's cam_score differences are how well a clip is read, not which way it turns, and the recipe's 5,120 clips go
to that first. The score against the requested camera stays in the details as "cam_score" (so an eval logs the
held-out cam_score beside the margin) with the opposite's as "cam_opposite".
"""
from __future__ import annotations

import numpy as np
import torch

from ..recam.cam_score import make_cam_score
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

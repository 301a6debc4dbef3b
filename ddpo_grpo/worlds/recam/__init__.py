"""Camera re-rendering ("recam") at tiny scale: a camera world, its condition dataset, and two reward
plugins, `cam_score` and `unifiedscore`, registered through the entry-point group ``ddpo_grpo.rewards``
(setup.py) as a user's plugin is."""
from .cam_score import estimate_moments, make_cam_score
from .data import RecamConditions
from .unifiedscore import make_unifiedscore
from .video import (
    VideoCondition, camera_numbers, make_video_condition, motion_from_numbers, sample_training_clip,
    sample_video_condition,
)
from .video_data import RecamVideoConditions
from .world import Camera, CameraMotion, RecamCondition, Scene, WorldObject, make_condition, render_view

__all__ = [
    "Camera", "CameraMotion", "RecamCondition", "RecamConditions", "RecamVideoConditions", "Scene", "VideoCondition",
    "WorldObject", "camera_numbers", "estimate_moments", "make_cam_score", "make_condition", "make_unifiedscore",
    "make_video_condition", "motion_from_numbers", "render_view", "sample_training_clip", "sample_video_condition",
]

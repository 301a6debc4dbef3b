"""room3d: a 3-D camera world for video. Procedural textured rooms in metres (`scene`), exact pinhole ray casting
(`render`), ReCamMaster's ten trajectories and random ones of the same kinds as 3-D camera paths (`paths`), the
condition dataset (`data`) and the world's own exact camera estimator (`estimator`). docs/recam.md, section
"The 3-D camera world (room3d)", tells the story."""
from .data import Room3DConditions
from .estimator import ExactEstimator, estimate_exact, exact_estimator, make_exact_estimator
from .paths import (
    RANDOM_KINDS, clip_cameras, mirror_pose, preset_path, random_motion, random_path, scale_pose, static_path,
)
from .render import DEFAULT_FOV_X_DEG, intrinsics, render_clip, render_view, render_view_depth
from .scene import Scene, make_scene, source_pose

__all__ = ["DEFAULT_FOV_X_DEG", "ExactEstimator", "RANDOM_KINDS", "Room3DConditions", "Scene", "estimate_exact", "exact_estimator",
           "make_exact_estimator", "clip_cameras", "intrinsics", "make_scene", "mirror_pose",
           "preset_path", "random_motion", "random_path", "render_clip", "render_view", "render_view_depth",
           "scale_pose", "source_pose", "static_path"]

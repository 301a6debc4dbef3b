"""The camera world on video: a toy-world scene filmed by a static source camera over F frames, re-rendered
along a target camera trajectory named as ReCamMaster's presets.

A condition (`VideoCondition`) is
  - a scene of 1-2 objects (world.py's `WorldObject`s) at the start of the clip, each drifting linearly by
    (ddx, ddy) world px over the whole clip (|drift| <= MAX_DRIFT = 2 px, direction and size seeded; 0 with
    `max_drift=0`). Time is the clip fraction a = f / (F - 1) of pixel frame f, so one condition is the same
    scene and camera path at any frame count F (only sampled more densely);
  - a static source camera (zoom 1, centre jittered around the canvas centre as in world.py);
  - a target camera trajectory: at pixel frame f the target camera is `CameraMotion(a*dx, a*dy, zoom**a)`
    relative to the source camera (world.py's convention: target view p = 16 + zoom * (q - 16 - (dx, dy)) for a
    source-view position q), i.e. it starts at the source camera (identity at f = 0) and ramps linearly in dx,
    dy and log zoom to the preset's end motion (dx, dy, zoom) at f = F - 1.
Every object lies fully inside the source view and every target view (MARGIN = 1 px) at every time, and two
objects never come within 1 px of each other (checked on a dense time grid of TIME_GRID points, so it holds at
any F).

Presets (ReCamMaster's ten names; in this 2-D world pan/arc are horizontal content shifts, tilt/translate
vertical ones, zoom is motion along the view axis). With m an integer magnitude in [3, MAX_PAN] view px and u a
log zoom in [MIN_LOG_ZOOM, log ZOOM_RANGE limit] (zoom rounded to 2 decimals, as world.py):

    pan left / right        dx = -m / +m                       (camera turns left: content moves right)
    tilt up / down          dy = -m / +m                       (camera looks up: content moves down)
    zoom in / out           zoom = exp(+u) / exp(-u)
    translate up / down     dy = -m / +m, zoom = TRANSLATE_ZOOM (camera moves up/down and slightly closer)
    arc left / right        dx = -m / +m, zoom = ARC_ZOOM       (camera swings round, slightly backing off)

Frames are rendered with world.py's `render_view(scene_at_time, camera, size=S)` (exact at every camera).

ReCamMaster's camera numbers
----------------------------
The 2-D camera is modelled as a pinhole (OpenCV axes: x right, y down, z forward) looking straight at the
scene plane at distance DEPTH = 4 scene units, with focal length FOCAL = 32 view units (the 32-unit view
coordinates of world.py; FOCAL * S / 32 px at view size S; a ~53 degree field of view). The scene plane is
scaled so that one world px is DEPTH / FOCAL scene units (zoom 1 at distance DEPTH). A camera translated by
(tx, ty, tz) (tz > 0: towards the scene) shows a plane point X (scene units, relative to the source camera's
axis) at

    p = 16 + FOCAL * (X - tx) / (DEPTH - tz)
      = 16 + zoom * (q - 16 - dx)      with  zoom = DEPTH / (DEPTH - tz),  dx = tx * FOCAL / DEPTH

(q = 16 + FOCAL * X / DEPTH is the point in the source view), exactly world.py's convention: pan/tilt/translate
(dx, dy) = (tx, ty) * FOCAL / DEPTH (content shifts by -(tx, ty) * FOCAL / DEPTH view units) and zoom = moving
along the view axis by tz = DEPTH * (1 - 1 / zoom). The rotation is always the identity. Per LATENT frame j
(F' = (F - 1) / 4 + 1 latent frames; latent frame j <-> pixel frame 4j, as ReCamMaster takes every 4th pose)
the camera numbers are the 12 entries, row-major, of the top 3x4 of the target camera's camera-to-world pose
relative to its first frame, [I | (tx, ty, tz)]; frame 0 is [I | 0]. With the presets' limits |t| <= 0.75 and
tz in [-1, 0.8] scene units. `camera_numbers` builds them, `motion_from_numbers` inverts one row exactly, and
`preset_camera_numbers(name, F)` gives a preset's numbers at a fixed magnitude (5 view units, log zoom 0.15).

Everything is seeded: condition `index` is generated from `np.random.default_rng((seed, index))`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.toyworld.render import COLORS, SHAPES

from .world import (
    MARGIN, MAX_PAN, MIN_LOG_ZOOM, RADIUS_RANGE, SOURCE_JITTER, WORLD_SIZE, ZOOM_RANGE, Camera,
    CameraMotion, Scene, WorldObject, _inside, render_view,
)

DEPTH = 4.0  # distance of the camera to the scene plane, scene units
FOCAL = 32.0  # focal length in view units (32-unit view coordinates)
NUM_FRAMES = 9  # default pixel frames (1 + 4k)
VIDEO_SIZE = 64  # default view size in px
MAX_DRIFT = 2.0  # objects drift at most this many world px over the whole clip
MIN_SHIFT = 3  # preset shifts are integers in [MIN_SHIFT, MAX_PAN] view units
TRANSLATE_ZOOM = 1.05
ARC_ZOOM = 0.95
DEFAULT_SHIFT, DEFAULT_LOG_ZOOM = 5, 0.15  # a preset's magnitude when rendered by name (preset_camera_numbers)
TIME_GRID = 129  # time points at which a condition's visibility and separation are checked

# preset -> (sign of dx, sign of dy, zoom): zoom None = a drawn zoom-in / zoom-out, "in"/"out"
PRESETS = {
    "pan left": (-1, 0, 1.0), "pan right": (+1, 0, 1.0),
    "tilt up": (0, -1, 1.0), "tilt down": (0, +1, 1.0),
    "zoom in": (0, 0, "in"), "zoom out": (0, 0, "out"),
    "translate up": (0, -1, TRANSLATE_ZOOM), "translate down": (0, +1, TRANSLATE_ZOOM),
    "arc left": (-1, 0, ARC_ZOOM), "arc right": (+1, 0, ARC_ZOOM),
}
PRESET_NAMES = tuple(PRESETS)


def check_num_frames(num_frames: int) -> int:
    """F as an int; it must be 1 + 4k with k >= 1 (Wan's VAE packs 4 pixel frames per latent frame)."""
    f = int(num_frames)
    if f != num_frames or f < 5 or (f - 1) % 4:
        raise ConfigError(f"num_frames must be 1 + 4k with k >= 1 (5, 9, 13, ..., 81), got {num_frames!r}")
    return f


def num_latent_frames(num_frames: int) -> int:
    return (check_num_frames(num_frames) - 1) // 4 + 1


def clip_times(num_frames: int) -> np.ndarray:
    """The clip fraction a = f / (F - 1) of each pixel frame, float64 (F,)."""
    f = check_num_frames(num_frames)
    return np.arange(f, dtype=np.float64) / (f - 1)


def motion_at(end: CameraMotion, a: float) -> CameraMotion:
    """The trajectory's motion at clip fraction a: linear in dx, dy and log zoom from identity (a=0) to `end`."""
    return CameraMotion(a * end.dx, a * end.dy, float(math.exp(a * math.log(end.zoom))))


def trajectory(end: CameraMotion, num_frames: int = NUM_FRAMES) -> List[CameraMotion]:
    """Per pixel frame f, the target camera's motion relative to the source camera."""
    return [motion_at(end, a) for a in clip_times(num_frames)]


# ----------------------------------------------------------------------------- ReCamMaster camera numbers
def pose_from_motion(motion: CameraMotion) -> np.ndarray:
    """float64 (3, 4): the camera-to-world pose [I | (tx, ty, tz)] of a target camera `motion` relative to the
    source camera (module docstring)."""
    pose = np.zeros((3, 4), dtype=np.float64)
    pose[:, :3] = np.eye(3)
    pose[0, 3] = motion.dx * DEPTH / FOCAL
    pose[1, 3] = motion.dy * DEPTH / FOCAL
    pose[2, 3] = DEPTH * (1.0 - 1.0 / motion.zoom)
    return pose


def motion_from_numbers(row12) -> CameraMotion:
    """The exact inverse of one row of `camera_numbers` (12 numbers, row-major 3x4 pose) -> CameraMotion."""
    pose = np.asarray(row12, dtype=np.float64).reshape(3, 4)
    if not np.allclose(pose[:, :3], np.eye(3), atol=1e-4):
        raise ValueError(f"camera numbers with a rotation cannot be a 2-D camera motion: {pose[:, :3].tolist()}")
    tx, ty, tz = pose[:, 3]
    if not tz < DEPTH:
        raise ValueError(f"camera numbers put the camera at or beyond the scene plane (tz={tz} >= DEPTH={DEPTH})")
    return CameraMotion(float(tx * FOCAL / DEPTH), float(ty * FOCAL / DEPTH), float(DEPTH / (DEPTH - tz)))


def camera_numbers(traj: Union[Sequence[CameraMotion], np.ndarray], num_frames: int = NUM_FRAMES) -> np.ndarray:
    """ReCamMaster's camera numbers, float32 (F', 12): per latent frame j, the row-major top 3x4 of the target
    camera's camera-to-world pose at pixel frame 4j relative to its first frame (frame 0 is [I | 0]).

    `traj`: the F per-pixel-frame motions relative to the source camera (CameraMotions or an array (F, 3) of
    (dx, dy, zoom)); its frame 0 must be the identity, as every trajectory of this world's is."""
    f = check_num_frames(num_frames)
    motions = [m if isinstance(m, CameraMotion) else CameraMotion(*(float(v) for v in m)) for m in traj]
    if len(motions) != f:
        raise ValueError(f"camera_numbers: a trajectory of {len(motions)} frames for num_frames={f}")
    first = pose_from_motion(motions[0])
    # relative to the first frame: rotations are identities, so the relative pose is a translation difference
    rows = []
    for j in range(0, f, 4):
        pose = pose_from_motion(motions[j])
        pose[:, 3] -= first[:, 3]
        rows.append(pose.reshape(12))
    return np.stack(rows).astype(np.float32)


# ----------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class VideoCondition:
    """A scene (objects at the start of the clip) with per-object drifts over the clip, a static source camera,
    a preset name and the trajectory's end motion."""

    scene: Scene
    drifts: Tuple[Tuple[float, float], ...]  # per object: displacement (world px) over the whole clip
    source_camera: Camera
    preset: str
    end_motion: CameraMotion

    def scene_at(self, a: float) -> Scene:
        """The scene at clip fraction a in [0, 1]."""
        return Scene(tuple(WorldObject(o.color, o.shape, o.x + a * d[0], o.y + a * d[1], o.r)
                           for o, d in zip(self.scene.objects, self.drifts)))

    def words(self) -> str:
        return " and ".join(f"a {o.color} {o.shape}" for o in self.scene.objects)

    def prompt(self) -> str:
        """e.g. "a red circle and a blue square, camera pan left"."""
        return f"{self.words()}, camera {self.preset}"

    def trajectory(self, num_frames: int = NUM_FRAMES) -> List[CameraMotion]:
        return trajectory(self.end_motion, num_frames)

    def motions(self, num_frames: int = NUM_FRAMES) -> np.ndarray:
        """float32 (F, 3): the requested (dx, dy, zoom) of target frame f relative to source frame f."""
        return np.array([m.as_tuple() for m in self.trajectory(num_frames)], dtype=np.float32)

    def cameras(self, num_frames: int = NUM_FRAMES) -> np.ndarray:
        """float32 (F', 12): ReCamMaster's camera numbers (`camera_numbers`)."""
        return camera_numbers(self.trajectory(num_frames), num_frames)

    def source_video(self, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE, width: Optional[int] = None
                     ) -> np.ndarray:
        """float32 (F, 3, S, S) in [0, 1]: the scene through the static source camera; (F, 3, S, width) with
        `width` (world.render_view: the 32 view units span the shorter side)."""
        return np.stack([render_view(self.scene_at(a), self.source_camera, size, width)
                         for a in clip_times(num_frames)])

    def target_video(self, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE, width: Optional[int] = None
                     ) -> np.ndarray:
        """float32 (F, 3, S, S) (or (F, 3, S, width)) in [0, 1]: the scene along the target trajectory (the ground
        truth)."""
        return np.stack([render_view(self.scene_at(a), motion_at(self.end_motion, a).apply(self.source_camera), size,
                                     width) for a in clip_times(num_frames)])


def preset_end_motion(preset: str, shift: float = DEFAULT_SHIFT, log_zoom: float = DEFAULT_LOG_ZOOM) -> CameraMotion:
    """A preset's end motion at a given magnitude: `shift` view units for pan/tilt/translate/arc, `log_zoom` (> 0)
    for zoom in/out (module docstring)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown camera preset {preset!r}; use one of {', '.join(PRESET_NAMES)}")
    sx, sy, zoom = PRESETS[preset]
    if isinstance(zoom, str):
        return CameraMotion(0, 0, float(math.exp(log_zoom if zoom == "in" else -log_zoom)))
    return CameraMotion(sx * shift, sy * shift, zoom)


def sample_end_motion(rng: np.random.Generator, preset: str) -> CameraMotion:
    """A preset's end motion with a drawn magnitude: an integer shift in [MIN_SHIFT, MAX_PAN], or a log zoom in
    [MIN_LOG_ZOOM, the ZOOM_RANGE limit] with the zoom rounded to 2 decimals (as world.py)."""
    m = int(rng.integers(MIN_SHIFT, MAX_PAN + 1))
    zoom = PRESETS[preset][2]
    if isinstance(zoom, str):
        hi = math.log(ZOOM_RANGE[1]) if zoom == "in" else -math.log(ZOOM_RANGE[0])
        z = round(preset_end_motion(preset, log_zoom=rng.uniform(MIN_LOG_ZOOM, hi)).zoom, 2)
        return CameraMotion(0, 0, min(max(z, ZOOM_RANGE[0]), ZOOM_RANGE[1]))
    return preset_end_motion(preset, shift=m)


def preset_camera_numbers(preset: str, num_frames: int = NUM_FRAMES, shift: float = DEFAULT_SHIFT,
                          log_zoom: float = DEFAULT_LOG_ZOOM) -> np.ndarray:
    """float32 (F', 12): ReCamMaster's camera numbers of a preset at a given magnitude (for rendering by name)."""
    return camera_numbers(trajectory(preset_end_motion(preset, shift, log_zoom), num_frames), num_frames)


def sample_video_condition(rng: np.random.Generator, num_objects: Optional[int] = None,
                           max_drift: float = MAX_DRIFT, preset: Optional[str] = None) -> VideoCondition:
    """A random scene of 1-2 objects (drifting at most `max_drift` world px over the clip), a static source camera
    and a preset trajectory, with every object fully inside every source and target view at every time."""
    h = WORLD_SIZE / 2
    src = Camera(h + rng.uniform(-SOURCE_JITTER, SOURCE_JITTER), h + rng.uniform(-SOURCE_JITTER, SOURCE_JITTER), 1.0)
    name = PRESET_NAMES[int(rng.integers(len(PRESET_NAMES)))]
    preset = name if preset is None else preset
    preset_end_motion(preset)  # checks the name
    end = sample_end_motion(rng, preset)
    times = np.linspace(0.0, 1.0, TIME_GRID)
    boxes = [src.world_box()] + [motion_at(end, a).apply(src).world_box() for a in times]
    common = (max(b[0] for b in boxes), max(b[1] for b in boxes), min(b[2] for b in boxes), min(b[3] for b in boxes))
    n = int(num_objects) if num_objects is not None else int(rng.integers(1, 3))
    colors, shapes = list(COLORS), list(SHAPES)
    while True:
        objs, drifts = [], []
        for _ in range(n):
            r = rng.uniform(*RADIUS_RANGE)
            size, angle = max_drift * rng.uniform(0.0, 1.0), rng.uniform(0.0, 2 * math.pi)
            ddx, ddy = size * math.cos(angle), size * math.sin(angle)
            lo_x, hi_x = common[0] + MARGIN + r - min(0.0, ddx), common[2] - MARGIN - r - max(0.0, ddx)
            lo_y, hi_y = common[1] + MARGIN + r - min(0.0, ddy), common[3] - MARGIN - r - max(0.0, ddy)
            if lo_x > hi_x or lo_y > hi_y:
                break
            objs.append(WorldObject(colors[int(rng.integers(len(colors)))], shapes[int(rng.integers(len(shapes)))],
                                    rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y), r))
            drifts.append((ddx, ddy))
        if len(objs) != n:
            continue
        cond = VideoCondition(Scene(tuple(objs)), tuple(drifts), src, preset, end)
        if n == 2 and objs[0].color == objs[1].color:
            continue
        if _valid(cond, times):
            return cond


def _valid(cond: VideoCondition, times: np.ndarray) -> bool:
    """Every object fully inside every view at every time, and two objects at least 1 px apart."""
    for a in times:
        scene = cond.scene_at(a)
        tgt = motion_at(cond.end_motion, a).apply(cond.source_camera)
        for box in (cond.source_camera.world_box(), tgt.world_box()):
            if not all(_inside(box, o.x, o.y, o.r) for o in scene.objects):
                return False
        if len(scene.objects) == 2:
            o1, o2 = scene.objects
            if max(abs(o1.x - o2.x) - o1.r - o2.r, abs(o1.y - o2.y) - o1.r - o2.r) < 1.0:
                return False
    return True


def make_video_condition(index: int, seed: int = 0, max_drift: float = MAX_DRIFT) -> VideoCondition:
    """Condition number `index` of the video world generated from `seed` (independent of all other indices)."""
    return sample_video_condition(np.random.default_rng((int(seed), int(index))), max_drift=max_drift)


def sample_training_clip(rng: np.random.Generator, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE):
    """A fresh random condition for pretraining: (source (F, 3, S, S), target (F, 3, S, S)) float32 in [0, 1] and
    cameras (F', 12) float32."""
    c = sample_video_condition(rng)
    return c.source_video(num_frames, size), c.target_video(num_frames, size), c.cameras(num_frames)


__all__ = [
    "DEPTH", "FOCAL", "PRESETS", "PRESET_NAMES", "VideoCondition", "camera_numbers", "clip_times",
    "make_video_condition", "motion_at", "motion_from_numbers", "num_latent_frames", "pose_from_motion",
    "preset_camera_numbers", "preset_end_motion", "sample_training_clip", "sample_video_condition", "trajectory",
]

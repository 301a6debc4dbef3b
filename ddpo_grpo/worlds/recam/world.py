"""A tiny camera world on top of the toy world: coloured shapes on a 64x64 world canvas, seen through a
camera that pans and zooms, rendered to 32x32 views.

Coordinates
-----------
World coordinates are pixels of the 64x64 canvas (x = column, y = row, pixel centres at k + 0.5).
A `Camera(cx, cy, zoom)` looks at the world point (cx, cy); a world point w appears in its 32x32
view at

    p = 16 + zoom * (w - (cx, cy))          (view pixels, pixel centres at k + 0.5)

so zoom > 1 magnifies (zoom in) and zoom < 1 shows more of the world. Shapes are axis-aligned
(no rotation), so a shape of radius r at w renders in the view as the same shape of radius zoom * r
at p; views are drawn directly in view coordinates with the toy world's anti-aliased `shape_mask`,
which is exact at every camera (no resampling blur), with 8x8 supersampling.

Relative motion
---------------
A condition pairs a *source* camera (zoom 1, centre jittered around the canvas centre) with a
*target* camera given as a relative motion `CameraMotion(dx, dy, zoom)`: the target camera looks at
source_centre + (dx, dy) (source-view pixels = world pixels, since the source zoom is 1) with zoom
`zoom`. A point at source-view position q then appears in the target view at

    p = 16 + zoom * (q - 16 - (dx, dy)),

i.e. panning the camera right (dx > 0) moves content left, and the zoom is about the view centre.
Pans are integers in [-6, 6] and zooms are log-uniform in [0.8, 1.25] rounded to 0.01, so the
prompt "pan (+3,-2) zoom 1.10" states the motion exactly. Near-identity motions (|pan| < 2.5 px and
|log zoom| < 0.1) are redrawn, so every condition asks for a visible change.

Scenes hold 1-2 objects (colour, shape, radius 3.5-5.5 world px) placed so that every object lies
fully inside both views with a 1 px margin, and two objects do not touch; the task is therefore
well-posed for the generator and for the camera estimator in `cam_score`.

Everything is seeded: condition `index` is generated from `np.random.default_rng((seed, index))`,
so a condition does not depend on how many others were generated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ddpo_grpo.worlds.toyworld.render import COLORS, SHAPES, shape_mask

WORLD_SIZE = 64
VIEW_SIZE = 32
MAX_PAN = 6
ZOOM_RANGE = (0.8, 1.25)
RADIUS_RANGE = (3.5, 5.5)
SOURCE_JITTER = 4.0  # source camera centre: canvas centre +- this many world px
MARGIN = 1.0  # objects stay this far inside both views
MIN_PAN, MIN_LOG_ZOOM = 2.5, 0.1  # a motion must exceed one of these (no near-identity conditions)
# Anti-aliasing samples per pixel side. The toy world uses 4; at 4 the rasterised area of small triangles is
# off by up to ~5 %, which shows up as up to 6 % apparent zoom error between two views; 8 halves that.
VIEW_SUPERSAMPLE = 8


@dataclass(frozen=True)
class WorldObject:
    color: str
    shape: str
    x: float  # world centre
    y: float
    r: float  # half the bounding-box side, world px


@dataclass(frozen=True)
class Scene:
    objects: Tuple[WorldObject, ...]


@dataclass(frozen=True)
class Camera:
    """Absolute camera: looks at world point (cx, cy) with magnification `zoom`."""

    cx: float
    cy: float
    zoom: float = 1.0

    def to_view(self, x: float, y: float) -> Tuple[float, float]:
        h = VIEW_SIZE / 2
        return h + self.zoom * (x - self.cx), h + self.zoom * (y - self.cy)

    def world_box(self) -> Tuple[float, float, float, float]:
        """(x0, y0, x1, y1): the world rectangle this camera sees."""
        h = VIEW_SIZE / 2 / self.zoom
        return self.cx - h, self.cy - h, self.cx + h, self.cy + h


@dataclass(frozen=True)
class CameraMotion:
    """Target camera relative to a zoom-1 source camera: pan (dx, dy) in source-view px, then zoom."""

    dx: float
    dy: float
    zoom: float

    def apply(self, source: Camera) -> Camera:
        return Camera(source.cx + self.dx / source.zoom, source.cy + self.dy / source.zoom, source.zoom * self.zoom)

    def as_tuple(self) -> Tuple[float, float, float]:
        return (float(self.dx), float(self.dy), float(self.zoom))

    def prompt(self) -> str:
        return f"pan ({int(round(self.dx)):+d},{int(round(self.dy)):+d}) zoom {self.zoom:.2f}"


@dataclass(frozen=True)
class RecamCondition:
    """A (scene, source camera, camera motion) triple; the target camera follows from the motion."""

    scene: Scene
    source_camera: Camera
    motion: CameraMotion

    @property
    def target_camera(self) -> Camera:
        return self.motion.apply(self.source_camera)

    def prompt(self) -> str:
        return self.motion.prompt()

    def source_view(self) -> np.ndarray:
        return render_view(self.scene, self.source_camera)

    def target_view(self) -> np.ndarray:
        return render_view(self.scene, self.target_camera)


def render_view(scene: Scene, camera: Camera, size: int = VIEW_SIZE, width: Optional[int] = None) -> np.ndarray:
    """The scene through `camera`: float32 (3, size, size) in [0, 1], black background. With `width` (3, size,
    width): the square view's 32 units span the shorter side, centred, and the longer side sees further out (same
    focal, wider field of view), so everything in the square view stays in the frame."""
    w = size if width is None else int(width)
    img = np.zeros((3, size, w), dtype=np.float64)
    s = min(size, w) / VIEW_SIZE
    ox, oy = (w - min(size, w)) / 2, (size - min(size, w)) / 2  # 0.0 for a square view: its numbers as before
    for o in scene.objects:
        px, py = camera.to_view(o.x, o.y)
        cov = shape_mask(o.shape, px * s + ox, py * s + oy, o.r * camera.zoom * s, size=size, ss=VIEW_SUPERSAMPLE,
                         width=None if width is None else w)
        color = np.asarray(COLORS[o.color])[:, None, None]
        img = img * (1 - cov) + color * cov
    return img.astype(np.float32)


def render_world(scene: Scene) -> np.ndarray:
    """The whole 64x64 world canvas, float32 (3, 64, 64) in [0, 1] (for inspection)."""
    img = np.zeros((3, WORLD_SIZE, WORLD_SIZE), dtype=np.float64)
    for o in scene.objects:
        cov = shape_mask(o.shape, o.x, o.y, o.r, size=WORLD_SIZE, ss=VIEW_SUPERSAMPLE)
        img = img * (1 - cov) + np.asarray(COLORS[o.color])[:, None, None] * cov
    return img.astype(np.float32)


def sample_motion(rng: np.random.Generator) -> CameraMotion:
    """A random pan (integers in [-6, 6]) and zoom (log-uniform in [0.8, 1.25], 2 decimals), not near identity."""
    lo, hi = math.log(ZOOM_RANGE[0]), math.log(ZOOM_RANGE[1])
    while True:
        dx, dy = (int(v) for v in rng.integers(-MAX_PAN, MAX_PAN + 1, size=2))
        zoom = round(float(np.exp(rng.uniform(lo, hi))), 2)
        zoom = min(max(zoom, ZOOM_RANGE[0]), ZOOM_RANGE[1])
        if math.hypot(dx, dy) >= MIN_PAN or abs(math.log(zoom)) >= MIN_LOG_ZOOM:
            return CameraMotion(dx, dy, zoom)


def _inside(box, x, y, r) -> bool:
    x0, y0, x1, y1 = box
    return x - r >= x0 + MARGIN and x + r <= x1 - MARGIN and y - r >= y0 + MARGIN and y + r <= y1 - MARGIN


def sample_condition(rng: np.random.Generator, num_objects: Optional[int] = None) -> RecamCondition:
    """A random scene of 1-2 objects, a source camera and a motion, with every object fully in both views."""
    h = WORLD_SIZE / 2
    src = Camera(h + rng.uniform(-SOURCE_JITTER, SOURCE_JITTER), h + rng.uniform(-SOURCE_JITTER, SOURCE_JITTER), 1.0)
    motion = sample_motion(rng)
    tgt = motion.apply(src)
    a, b = src.world_box(), tgt.world_box()
    box = (max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))  # seen by both cameras
    n = int(num_objects) if num_objects is not None else int(rng.integers(1, 3))
    colors, shapes = list(COLORS), list(SHAPES)
    while True:
        objs = []
        for _ in range(n):
            r = rng.uniform(*RADIUS_RANGE)
            lo_x, hi_x = box[0] + MARGIN + r, box[2] - MARGIN - r
            lo_y, hi_y = box[1] + MARGIN + r, box[3] - MARGIN - r
            if lo_x > hi_x or lo_y > hi_y:
                break
            objs.append(WorldObject(colors[int(rng.integers(len(colors)))], shapes[int(rng.integers(len(shapes)))],
                                    rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y), r))
        if len(objs) != n:
            continue
        if n == 2:
            o1, o2 = objs
            gap = max(abs(o1.x - o2.x) - o1.r - o2.r, abs(o1.y - o2.y) - o1.r - o2.r)
            if gap < 1.0 or o1.color == o2.color:
                continue
        if all(_inside(a, o.x, o.y, o.r) and _inside(b, o.x, o.y, o.r) for o in objs):
            return RecamCondition(Scene(tuple(objs)), src, motion)


def make_condition(index: int, seed: int = 0) -> RecamCondition:
    """Condition number `index` of the world generated from `seed` (independent of all other indices)."""
    return sample_condition(np.random.default_rng((int(seed), int(index))))


def camera_planes(motion: CameraMotion, size: int = VIEW_SIZE) -> np.ndarray:
    """The motion as 3 constant planes (dx/8, dy/8, 4*log(zoom)), float32 (3, size, size), each in ~[-1, 1]."""
    vals = np.array([motion.dx / 8.0, motion.dy / 8.0, 4.0 * math.log(motion.zoom)], dtype=np.float32)
    return np.broadcast_to(vals[:, None, None], (3, size, size)).copy()


def sample_training_batch(batch_size: int, rng: np.random.Generator):
    """Fresh random triples for pretraining: (cond (B, 6, 32, 32) float32 = source in [-1, 1] + camera planes,
    target (B, 3, 32, 32) float32 in [-1, 1], conditions)."""
    conds, cond, tgt = [], [], []
    for _ in range(batch_size):
        c = sample_condition(rng)
        conds.append(c)
        cond.append(np.concatenate([c.source_view() * 2 - 1, camera_planes(c.motion)]))
        tgt.append(c.target_view() * 2 - 1)
    return np.stack(cond).astype(np.float32), np.stack(tgt).astype(np.float32), conds

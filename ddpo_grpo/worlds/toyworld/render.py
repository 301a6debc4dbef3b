"""Procedural 32x32 renderer for the toy world.

A *condition* is a small structured description (one object at a place, or two
objects in a spatial relation).  Everything about an image - its prompt, its
pixels, and what the verifier expects - is derived from the condition, so the
reward computed from pixels can be checked exactly.

Layouts are fixed per condition (with small seeded jitter) so that the verifier
knows where each object should be; the model, however, has to learn them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

IMAGE_SIZE = 32
SUPERSAMPLE = 4

# Saturated colours: far apart in RGB so the verifier's nearest-colour test is
# unambiguous even for blurry generations.
COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = ("left", "center", "right")
RELATIONS = ("left of", "right of", "above", "below")

# Object centres in pixel coordinates (x, y).
_PLACE_CENTERS = {"left": (8.0, 16.0), "center": (16.0, 16.0), "right": (24.0, 16.0)}
_SINGLE_RADIUS = 6.0
_PAIR_RADIUS = 5.5


@dataclass(frozen=True)
class Obj:
    color: str
    shape: str


@dataclass(frozen=True)
class Condition:
    """One object at `place`, or `obj` in `relation` to `other`."""

    obj: Obj
    place: Optional[str] = None
    relation: Optional[str] = None
    other: Optional[Obj] = None

    @property
    def is_pair(self) -> bool:
        return self.other is not None

    def prompt(self) -> str:
        a = f"a {self.obj.color} {self.obj.shape}"
        if not self.is_pair:
            return f"{a} on the {self.place}" if self.place != "center" else f"{a} in the center"
        return f"{a} {self.relation} a {self.other.color} {self.other.shape}"

    def layout(self) -> Tuple[Tuple[Obj, Tuple[float, float], float], ...]:
        """(object, centre (x, y), radius) for every object, in canonical places."""
        if not self.is_pair:
            return ((self.obj, _PLACE_CENTERS[self.place], _SINGLE_RADIUS),)
        left, right, top, bottom = (8.0, 16.0), (24.0, 16.0), (16.0, 8.0), (16.0, 24.0)
        first, second = {
            "left of": (left, right),
            "right of": (right, left),
            "above": (top, bottom),
            "below": (bottom, top),
        }[self.relation]
        return ((self.obj, first, _PAIR_RADIUS), (self.other, second, _PAIR_RADIUS))


@functools.lru_cache(maxsize=16)
def _subpixel_coords(n: int, ss: int) -> np.ndarray:
    coords = (np.arange(n, dtype=np.float64) + 0.5) / ss
    coords.flags.writeable = False
    return coords


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = IMAGE_SIZE, ss: int = SUPERSAMPLE,
               width: Optional[int] = None) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of a shape with bounding box 2r centred at (cx, cy). Shape (size, size), or
    (size, width) when width is given (a non-square view: the recam video world at 480 x 832).

    The offsets are a row (dx, 1 x n) and a column (dy, n x 1) that the tests broadcast to the n x n subpixel grid:
    the same values as full meshgrid offsets, element for element, at a fraction of the work (the toy-world reward
    fits 16 templates per object, so this is most of its time)."""
    n = size * ss
    cols = size if width is None else int(width)
    coords = _subpixel_coords(n, ss)
    xs = coords if cols == size else _subpixel_coords(cols * ss, ss)
    dx, dy = xs[None, :] - cx, coords[:, None] - cy  # x: column, y: row
    if shape == "square":
        m = (np.abs(dx) <= r) & (np.abs(dy) <= r)
    elif shape == "circle":
        m = dx**2 + dy**2 <= r**2
    elif shape == "triangle":
        # Apex up at cy - r, base at cy + r, base width 2r.
        t = (dy + r) / (2 * r)  # 0 at apex, 1 at base
        m = (t >= 0) & (t <= 1) & (np.abs(dx) <= r * t)
    elif shape == "cross":
        w = r / 3.0
        m = ((np.abs(dx) <= w) & (np.abs(dy) <= r)) | ((np.abs(dy) <= w) & (np.abs(dx) <= r))
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    # The coverage is the count of covered subpixels over ss²: summed as integers (exact), then divided once, the same
    # float64 values as m.reshape(size, ss, size, ss).mean(axis=(1, 3)).
    return m.reshape(size, ss, cols, ss).sum(axis=3, dtype=np.int32).sum(axis=1) / (ss * ss)


def render(cond: Condition, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Render a condition to a float32 image in [0, 1], shape (3, 32, 32) (C, H, W), black background.

    `rng` adds jitter of +-1 px to centres and +-0.5 px to radii; None renders the canonical layout.
    """
    img = np.zeros((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float64)
    for obj, (cx, cy), r in cond.layout():
        if rng is not None:
            cx += rng.uniform(-1.0, 1.0)
            cy += rng.uniform(-1.0, 1.0)
            r += rng.uniform(-0.5, 0.5)
        cov = shape_mask(obj.shape, cx, cy, r)
        color = np.asarray(COLORS[obj.color])[:, None, None]
        img = img * (1 - cov) + color * cov
    return img.astype(np.float32)

"""Verifiable reward for the toy world: read colour, shape and position back from the pixels.

For each object the condition asks for, the verifier looks in the region where that object
belongs (the whole image for one object; the half on its side of the relation for two),
segments the foreground (max channel > 0.5 on a black background), and checks:
  - colour: the nearest palette colour to the mean foreground RGB;
  - shape: the shape template with the best IoU when fitted to the segment's bounding box;
  - position: for one object, the third of the image holding the centroid; for two, that each
    side holds its own object (right colour or shape) and the centroids are > 8 px apart along the axis.
The reward is the mean of the attribute scores, in [0, 1].
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Sequence

import numpy as np

from .render import COLORS, IMAGE_SIZE, PLACES, SHAPES, Condition, shape_mask

_PALETTE = np.array(list(COLORS.values()))
_PALETTE_NAMES = list(COLORS)
ATTRIBUTES = ("color", "shape", "position")


def _segment(img: np.ndarray, region: np.ndarray) -> np.ndarray:
    return (img.max(axis=0) > 0.5) & region


def _dilate(mask: np.ndarray) -> np.ndarray:
    """The mask grown by one pixel (4-neighbourhood), to keep the anti-aliased rim of the segment."""
    out = mask.copy()
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


@lru_cache(maxsize=2048)  # at most 16 MB of float64 32 x 32 templates
def _template(shape: str, cx: float, cy: float, r: float) -> np.ndarray:
    """shape_mask's (32, 32) coverage, cached and read-only. Why: the fit below tries 16 templates per object at a
    bounding box's centre and radius, which are multiples of 0.5 px, so the same few hundred templates come back batch
    after batch (copies of a condition, conditions of an epoch): computed anew they were most of the reward's time."""
    m = shape_mask(shape, cx, cy, r)
    m.flags.writeable = False
    return m


def _read_object(img: np.ndarray, mask: np.ndarray):
    """(colour name, shape name, centroid (x, y)) of the masked segment, or None if it is empty."""
    if mask.sum() < 4:
        return None
    ys, xs = np.nonzero(mask)
    rgb = img[:, ys, xs].mean(axis=1)
    color = _PALETTE_NAMES[int(np.argmin(((_PALETTE - rgb) ** 2).sum(axis=1)))]
    x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
    if max(x1 - x0, y1 - y0) > 16:  # larger than any object: not an object (e.g. noise or smear)
        return None
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, max(x1 - x0, y1 - y0) / 2
    # Soft IoU between the foreground intensity and each template; the thresholded bounding box
    # is off by up to a pixel either way (anti-aliased rims at exactly 0.5), so a few radii are tried.
    fg = np.clip(img.max(axis=0), 0, 1) * _dilate(mask)
    best, best_iou = SHAPES[0], -1.0
    for shape in SHAPES:
        for rr in (r - 1.0, r - 0.5, r, r + 0.5):
            if rr <= 0:  # a 1-2 pixel blob: a template of radius 0 is empty (and the triangle's would divide by 0)
                continue
            tmpl = _template(shape, float(cx), float(cy), float(rr))
            iou = np.minimum(tmpl, fg).sum() / max(np.maximum(tmpl, fg).sum(), 1e-6)
            if iou > best_iou:
                best, best_iou = shape, iou
    return color, best, (xs.mean(), ys.mean())


def verify_image(img: np.ndarray, cond: Condition) -> Dict[str, float]:
    """Score one image (3, 32, 32) in [0, 1] against its condition; returns per-attribute scores in [0, 1]."""
    h = IMAGE_SIZE
    yy, xx = np.mgrid[0:h, 0:h]
    if not cond.is_pair:
        found = _read_object(img, _segment(img, np.ones((h, h), bool)))
        if found is None:
            return {"color": 0.0, "shape": 0.0, "position": 0.0}
        color, shape, (cx, _) = found
        place = PLACES[min(int(cx // (h / 3)), 2)]
        return {
            "color": float(color == cond.obj.color),
            "shape": float(shape == cond.obj.shape),
            "position": float(place == cond.place),
        }
    horizontal = cond.relation in ("left of", "right of")
    axis = xx if horizontal else yy
    first_low = cond.relation in ("left of", "above")
    regions = (axis < h // 2, axis >= h // 2) if first_low else (axis >= h // 2, axis < h // 2)
    scores = {"color": 0.0, "shape": 0.0, "position": 0.0}
    centroids, identified = [], []
    for obj, region in zip((cond.obj, cond.other), regions):
        found = _read_object(img, _segment(img, region))
        if found is None:
            centroids.append(None)
            continue
        color, shape, c = found
        scores["color"] += 0.5 * (color == obj.color)
        scores["shape"] += 0.5 * (shape == obj.shape)
        centroids.append(c)
        identified.append(color == obj.color or shape == obj.shape)
    # The relation holds when each side has its own object (recognisable by colour or shape), well separated:
    # two objects drawn in swapped places do not satisfy it.
    if all(c is not None for c in centroids) and all(identified):
        k = 0 if horizontal else 1
        gap = centroids[1][k] - centroids[0][k]
        gap = gap if first_low else -gap
        # An object split across the midline yields two fragments; require a real separation.
        scores["position"] = float(gap > 8.0)
    return scores


def verify_batch(images: np.ndarray, conds: Sequence[Condition]) -> Dict[str, np.ndarray]:
    """Score images (B, 3, 32, 32) in [0, 1]. Returns arrays (B,): per attribute, `reward`, `strict`."""
    per = [verify_image(np.asarray(im, dtype=np.float32), c) for im, c in zip(images, conds)]
    out = {a: np.array([p[a] for p in per], dtype=np.float32) for a in ATTRIBUTES}
    out["reward"] = np.mean([out[a] for a in ATTRIBUTES], axis=0).astype(np.float32)
    out["strict"] = (out["reward"] >= 1.0).astype(np.float32)
    return out


def summarize(scores: Dict[str, np.ndarray]) -> Dict[str, float]:
    """GenEval-style detail metrics: `<attr>_accuracy`, `accuracy` (mean of attributes), `strict_accuracy`."""
    out = {f"{a}_accuracy": float(np.mean(scores[a] >= 1.0)) for a in ATTRIBUTES}
    out["accuracy"] = float(np.mean(scores["reward"]))
    out["strict_accuracy"] = float(np.mean(scores["strict"]))
    return out

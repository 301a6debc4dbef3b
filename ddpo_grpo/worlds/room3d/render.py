"""Exact pinhole ray casting of a `scene.Scene` (numpy, vectorised over pixels).

Pixel convention (OpenCV's): the centre of the top-left pixel is (u, v) = (0, 0), u to the right, v down; pixel
(row r, column c) is the ray through K^-1 (c, r, 1). `intrinsics` puts the principal point at the image's centre,
((W - 1) / 2, (H - 1) / 2), as `recam.video_io.fov_intrinsics` does. Camera axes are OpenCV's (x right, y down,
z forward) and c2w is camera-to-world, so a world point X projects to K (R^T (X - t)) / z.

Each pixel takes the colour of the nearest surface its ray hits (the room's inside always catches it), shaded by a
fixed light (scene.py); `supersample` s renders s x s rays per pixel and averages them (a box filter), which is what
tiny training frames need to not alias. Rays are cast with camera-space z = 1, so the hit distance along the ray is
the pixel's depth (`cast` returns it: the exact estimator linearises with it).
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from .scene import AMBIENT, LIGHT, NOISE_SHAPE, ROOM_HI, ROOM_LO, Ball, Scene

SENSOR_WIDTH_MM = 23.76  # ReCamMaster's / MultiCamVideo's sensor width
LENS_MM = 24.0  # ReCamMaster's default focal length
DEFAULT_FOV_X_DEG = math.degrees(2.0 * math.atan(SENSOR_WIDTH_MM / (2.0 * LENS_MM)))  # ~52.7 deg: fx = W * 24 / 23.76


def intrinsics(height: int, width: int, fov_x_deg: float = DEFAULT_FOV_X_DEG) -> np.ndarray:
    """(3, 3) float64 K of a pinhole with horizontal field of view `fov_x_deg` on height x width pixels: square
    pixels, fx = fy = (W / 2) / tan(fov / 2) (the default fov gives fx = W * 24 / 23.76), principal point
    ((W - 1) / 2, (H - 1) / 2) (OpenCV's pixel coordinates: the image centre)."""
    if not 0.0 < float(fov_x_deg) < 180.0:
        raise ValueError(f"room3d: a field of view must be in (0, 180) degrees, got {fov_x_deg!r}")
    f = width / 2.0 / math.tan(math.radians(float(fov_x_deg)) / 2.0)
    return np.array([[f, 0.0, (width - 1) / 2.0], [0.0, f, (height - 1) / 2.0], [0.0, 0.0, 1.0]])


def scale_intrinsics(K: np.ndarray, s: float) -> np.ndarray:
    """K for the same camera on a grid s times finer (pixel centres: u' + 0.5 = s (u + 0.5))."""
    K = np.asarray(K, dtype=np.float64)
    out = K.copy()
    out[:2, :2] *= s
    out[0, 2] = (K[0, 2] + 0.5) * s - 0.5
    out[1, 2] = (K[1, 2] + 0.5) * s - 0.5
    return out


def _rays(c2w: np.ndarray, K: np.ndarray, height: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """Origin (3,) float64 and world directions (3, H*W) float32 whose camera-space z is 1 (row-major over pixels);
    a component that is exactly 0 is nudged to 1e-9 so that slab tests never divide 0 by 0."""
    kinv = np.linalg.inv(K)
    u = np.arange(width, dtype=np.float64)
    v = np.arange(height, dtype=np.float64)
    # camera-space x, y of each pixel (upper-triangular K: z stays 1), then rotated to the world
    cx = (kinv[0, 0] * u[None, :] + kinv[0, 1] * v[:, None] + kinv[0, 2]).ravel()
    cy = np.broadcast_to(kinv[1, 1] * v[:, None] + kinv[1, 2], (height, width)).ravel()
    r = c2w[:3, :3]
    d = np.empty((3, cx.size), dtype=np.float32)
    for i in range(3):
        d[i] = r[i, 0] * cx + r[i, 1] * cy + r[i, 2]
    d[d == 0] = 1e-9
    return c2w[:3, 3].copy(), d


def _slab(o, d, lo, hi):
    """Per ray: entry t, exit t, entry axis of the box [lo, hi] (axis-aligned in these coordinates); o (3,), d (3, N)."""
    tn = tf = axis = None
    for i in range(3):
        inv = np.float32(1.0) / d[i]
        a, b = (np.float32(lo[i] - o[i])) * inv, (np.float32(hi[i] - o[i])) * inv
        near, far = np.minimum(a, b), np.maximum(a, b)
        if tn is None:
            tn, tf, axis = near, far, np.zeros(near.shape, dtype=np.int8)
        else:
            later = near > tn
            tn = np.where(later, near, tn)
            axis[later] = i
            tf = np.minimum(tf, far)
    return tn, tf, axis


def _exit_axis(o, d, lo, hi):
    """Per ray from inside the box [lo, hi]: exit t and exit axis; o (3,), d (3, N)."""
    t = axis = None
    for i in range(3):
        far = np.where(d[i] > 0, np.float32(hi[i] - o[i]), np.float32(lo[i] - o[i])) / d[i]
        if t is None:
            t, axis = far, np.zeros(far.shape, dtype=np.int8)
        else:
            sooner = far < t
            t = np.where(sooner, far, t)
            axis[sooner] = i
    return t, axis


def _to_local(o, d, obj):
    """Ray origin and directions in an upright box's frame (its rotation is about y only)."""
    rot = obj.rotation
    ol = (o - obj.centre) @ rot
    dl = np.empty_like(d)
    dl[0] = rot[0, 0] * d[0] + rot[2, 0] * d[2]
    dl[1] = d[1]
    dl[2] = rot[0, 2] * d[0] + rot[2, 2] * d[2]
    dl[dl == 0] = 1e-9
    return ol, dl


def cast(scene: Scene, c2w: np.ndarray, K: np.ndarray, height: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """One ray per pixel -> colour (H*W, 3) float32 in [0, 1] and depth (H*W,) float32 (camera z, metres)."""
    c2w = np.asarray(c2w, dtype=np.float64)
    o, d = _rays(c2w, np.asarray(K, dtype=np.float64), int(height), int(width))
    n = d.shape[1]
    # the room: the camera is inside, every ray leaves through one face
    t, axis_room = _exit_axis(o, d, ROOM_LO, ROOM_HI)
    win = np.zeros(n, dtype=np.int8)
    dd = None
    for k, obj in enumerate(scene.objects):
        if isinstance(obj, Ball):
            oc = (o - obj.centre).astype(np.float32)
            if dd is None:
                dd = d[0] * d[0] + d[1] * d[1] + d[2] * d[2]
            b = oc[0] * d[0] + oc[1] * d[1] + oc[2] * d[2]
            disc = b * b - dd * np.float32(oc @ oc - obj.radius ** 2)
            hit = disc >= 0
            th = np.full(n, np.inf, dtype=np.float32)
            th[hit] = (-b[hit] - np.sqrt(disc[hit])) / dd[hit]
        else:
            ol, dl = _to_local(o, d, obj)
            tn, tf, _ = _slab(ol, dl, -obj.half, obj.half)
            th = np.where(tn <= tf, tn, np.float32(np.inf))
        closer = (th < t) & (th > 1e-6)
        t = np.where(closer, th, t)
        win[closer] = k + 1
    p = o[:, None].astype(np.float32) + d * t
    # per hit: surface id, texture coordinates (u, v) in metres, normal (world)
    sid = np.zeros(n, dtype=np.int64)
    uv = np.zeros((2, n), dtype=np.float32)
    normal = np.zeros((3, n), dtype=np.float32)
    m = np.flatnonzero(win == 0)
    ax = axis_room[m]
    up = np.take_along_axis(d[:, m], ax[None].astype(np.int64), axis=0)[0] > 0
    sid[m] = 2 * ax + up
    others = np.array([[1, 2], [0, 2], [0, 1]])[ax].T
    uv[:, m] = np.take_along_axis(p[:, m], others, axis=0)
    normal[ax, m] = np.where(up, -1.0, 1.0)  # the room's faces look inward
    for k, obj in enumerate(scene.objects):
        m = np.flatnonzero(win == k + 1)
        if not len(m):
            continue
        sid[m] = 6 + k
        pm = p[:, m].T.astype(np.float64)
        if isinstance(obj, Ball):
            q = (pm - obj.centre) / obj.radius
            normal[:, m] = q.T
            # longitude / latitude cells in metres of arc on the sphere
            uv[0, m] = np.arctan2(q[:, 0], q[:, 2]) * obj.radius
            uv[1, m] = np.arcsin(np.clip(q[:, 1], -1.0, 1.0)) * obj.radius
        else:
            rot = obj.rotation
            local = (pm - obj.centre) @ rot
            ax = np.abs(local / obj.half).argmax(axis=1)  # the face: the coordinate at its half size
            rows = np.arange(len(ax))
            nl = np.zeros((len(ax), 3))
            nl[rows, ax] = np.sign(local[rows, ax])
            normal[:, m] = (nl @ rot.T).T
            uv[:, m] = (np.take_along_axis(local, np.array([[1, 2], [0, 2], [0, 1]])[ax], axis=1)
                        + 7.0 * ax[:, None]).T
    colour = scene.base.astype(np.float32)[sid]
    rows, cols = NOISE_SHAPE[1], NOISE_SHAPE[2]
    amp = scene.amp.astype(np.float32)
    for octave in range(NOISE_SHAPE[0]):
        inv = (1.0 / scene.scale[:, octave]).astype(np.float32)[sid]
        off = scene.offset[:, octave]
        iu = (np.floor(uv[0] * inv).astype(np.int64) + off[sid, 0]) % rows
        iv = (np.floor(uv[1] * inv).astype(np.int64) + off[sid, 1]) % cols
        val = scene.noise[octave][iu, iv]
        colour += amp[sid, octave] * (val - np.float32(0.5))
    light = LIGHT.astype(np.float32)
    shade = np.clip(light[0] * normal[0] + light[1] * normal[1] + light[2] * normal[2], 0.0, 1.0)
    shade = np.float32(AMBIENT) + np.float32(1.0 - AMBIENT) * shade
    return np.clip(colour * shade[:, None], 0.0, 1.0), t


def render_view(scene: Scene, c2w: np.ndarray, K: np.ndarray, height: int, width: int,
                supersample: int = 1) -> np.ndarray:
    """float32 (3, H, W) in [0, 1]: the view of camera-to-world pose c2w (4, 4) with intrinsics K (3, 3) (module
    docstring: OpenCV's pixel convention), s x s rays per pixel averaged when supersample = s > 1."""
    return render_view_depth(scene, c2w, K, height, width, supersample)[0]


def render_view_depth(scene: Scene, c2w: np.ndarray, K: np.ndarray, height: int, width: int,
                      supersample: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """(float32 (3, H, W) colour, float32 (H, W) depth in metres) of `render_view` (depth averaged like colour)."""
    s = int(supersample)
    if s < 1 or int(height) < 1 or int(width) < 1:
        raise ValueError(f"room3d: render size {height}x{width} and supersample {supersample} must be >= 1")
    h, w = int(height), int(width)
    col, dep = cast(scene, c2w, scale_intrinsics(K, s) if s > 1 else K, h * s, w * s)
    col = col.reshape(h, s, w, s, 3).mean(axis=(1, 3))
    dep = dep.reshape(h, s, w, s).mean(axis=(1, 3))
    return np.ascontiguousarray(col.transpose(2, 0, 1), dtype=np.float32), dep.astype(np.float32)


def render_clip(scene: Scene, c2ws: np.ndarray, K: np.ndarray, height: int, width: int,
                supersample: int = 1) -> np.ndarray:
    """float32 (F, 3, H, W): `render_view` at each world pose of c2ws (F, 4, 4)."""
    c2ws = np.asarray(c2ws, dtype=np.float64)
    if c2ws.ndim != 3 or c2ws.shape[1:] != (4, 4):
        raise ValueError(f"room3d: render_clip needs poses (F, 4, 4), got {c2ws.shape}")
    return np.stack([render_view(scene, c, K, height, width, supersample) for c in c2ws])

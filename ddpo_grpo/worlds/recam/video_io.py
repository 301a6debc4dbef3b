"""Video files in and out for ReCamMaster-style data: mp4 decoding and encoding with PyAV, and ReCamMaster's
resize-to-cover + centre crop.

Why PyAV: its wheels bundle FFmpeg (decoders and libx264), depend on nothing but numpy, and so install beside any
torch (torch==2.13.0 here, where torchcodec's wheels are tied to other torch releases and need a system FFmpeg);
it decodes frame by frame, so a damaged file is an exception at the frame it breaks, which the readers turn into
one line naming the file. imageio-ffmpeg (what ReCamMaster reads with) pipes a separate ffmpeg process instead.

Frames are float32 (F, 3, H, W) in [0, 1] everywhere in the recam world.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from ddpo_grpo.errors import ConfigError


def read_video(path: str, indices: Optional[Sequence[int]] = None, what: str = "video") -> np.ndarray:
    """(F, H, W, 3) uint8 frames of an mp4 (every frame, or those at `indices`, in that order). A missing, damaged
    or too short file is one ConfigError line naming it."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} is missing")
    import av

    want = None if indices is None else sorted(set(int(i) for i in indices))
    frames = {}
    try:
        with av.open(path) as c:
            for i, f in enumerate(c.decode(video=0)):
                if want is None or i in want:
                    frames[i] = f.to_ndarray(format="rgb24")
                if want is not None and i >= want[-1]:
                    break
    except Exception as e:  # noqa: BLE001  (PyAV raises its own error classes per FFmpeg failure)
        raise ConfigError(f"{what} {path!r} cannot be decoded ({type(e).__name__}: {str(e)[:120]})") from None
    if not frames:
        raise ConfigError(f"{what} {path!r} has no decodable video frames")
    if want is None:
        return np.stack([frames[i] for i in sorted(frames)])
    lacking = [i for i in want if i not in frames]
    if lacking:
        raise ConfigError(f"{what} {path!r} has {len(frames) and max(frames) + 1} frames; frame {lacking[0]} is needed")
    return np.stack([frames[int(i)] for i in indices])


def cover_crop(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """ReCamMaster's frame processing: each frame resized (bilinear, PIL) by max(width / w, height / h) to
    (round(h * scale), round(w * scale)) so that it covers height x width, then centre-cropped (torchvision's
    CenterCrop offsets: round((h' - height) / 2)). (F, h, w, 3) uint8 -> (F, 3, height, width) float32 in [0, 1]."""
    from PIL import Image

    F, h, w = frames.shape[:3]
    scale = max(width / w, height / h)
    nh, nw = round(h * scale), round(w * scale)
    top, left = int(round((nh - height) / 2.0)), int(round((nw - width) / 2.0))
    out = np.empty((F, 3, height, width), dtype=np.float32)
    for i, f in enumerate(frames):
        im = Image.fromarray(f)
        if (nh, nw) != (h, w):
            im = im.resize((nw, nh), Image.BILINEAR)
        a = np.asarray(im, dtype=np.float32)[top:top + height, left:left + width] / 255.0
        out[i] = a.transpose(2, 0, 1)
    return out


def cover_crop_intrinsics(intrinsics, size, height: int, width: int) -> tuple:
    """(fx, fy, cx, cy) of a video of `size` (h, w) px -> the same camera's after `cover_crop` to height x width
    (OpenCV's convention, the top-left pixel's centre at (0, 0)): PIL's resize maps pixel-edge coordinates by
    (nw / w, nh / h), so x' + 0.5 = (x + 0.5) * nw / w, then the crop shifts by (left, top)."""
    fx, fy, cx, cy = (float(v) for v in intrinsics)
    h, w = size
    scale = max(width / w, height / h)
    nh, nw = round(h * scale), round(w * scale)
    top, left = int(round((nh - height) / 2.0)), int(round((nw - width) / 2.0))
    sx, sy = nw / w, nh / h
    return fx * sx, fy * sy, (cx + 0.5) * sx - 0.5 - left, (cy + 0.5) * sy - 0.5 - top


def fov_intrinsics(fov_x_deg: float, height: int, width: int) -> tuple:
    """(fx, fy, cx, cy) of an ideal pinhole with a horizontal field of view `fov_x_deg` filling height x width px
    (square pixels, the principal point at the image centre: ((width - 1) / 2, (height - 1) / 2) in OpenCV's
    convention)."""
    import math

    if not 0 < float(fov_x_deg) < 180:
        raise ConfigError(f"a field of view must be in (0, 180) degrees, got {fov_x_deg!r}")
    f = width / 2.0 / math.tan(math.radians(float(fov_x_deg)) / 2.0)
    return f, f, (width - 1) / 2.0, (height - 1) / 2.0


def write_video(path: str, frames, fps: int = 15) -> None:
    """Frames (F, 3, H, W) in [0, 1] (numpy or torch) as an H.264 mp4 (yuv420p: even sizes, padded by one row /
    column of edge pixels where odd)."""
    import av

    arr = np.asarray(frames.detach().float().cpu().numpy() if hasattr(frames, "detach") else frames, dtype=np.float32)
    u8 = (np.clip(arr, 0, 1).transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
    H, W = u8.shape[1] + u8.shape[1] % 2, u8.shape[2] + u8.shape[2] % 2
    u8 = np.pad(u8, ((0, 0), (0, H - u8.shape[1]), (0, W - u8.shape[2]), (0, 0)), mode="edge")
    with av.open(path, "w") as c:
        s = c.add_stream("libx264", rate=int(fps))
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.options = {"crf": "10"}  # near-lossless: a round trip through a file changes pixels by a few levels only
        for f in u8:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)

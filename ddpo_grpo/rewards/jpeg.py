"""JPEG (in)compressibility: the size of each image saved as JPEG, in kB (ddpo-pytorch semantics).

`jpeg_compressibility` = -size (smaller files are better), `jpeg_incompressibility` = +size.
Samples with non-finite pixels score NaN.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ._images import finite_rows, image_batch, to_uint8_hwc
from .registry import register_reward


def jpeg_sizes_kb(images, quality: int = 95, reward_name: str = "jpeg") -> np.ndarray:
    """float32 (B,): len(JPEG bytes) / 1000 of each image of (B, C, H, W) in [0, 1], C in {1, 3}."""
    x = image_batch(images, reward_name)
    if x.shape[1] not in (1, 3):
        raise ValueError(f"reward {reward_name!r} needs 1 or 3 channels, got images {tuple(x.shape)}")
    arr = to_uint8_hwc(x)
    sizes = np.empty(len(arr), dtype=np.float32)
    for i, a in enumerate(arr):
        buf = io.BytesIO()
        Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a).save(buf, format="JPEG", quality=quality)
        sizes[i] = len(buf.getvalue()) / 1000.0
    sizes[~finite_rows(x)] = np.nan
    return sizes


@register_reward("jpeg_compressibility")
def make_jpeg_compressibility(quality: int = 95):
    def jpeg_compressibility(images, prompts, metadata):
        kb = jpeg_sizes_kb(images, quality, "jpeg_compressibility")
        return -kb, {"jpeg_kb": kb}

    return jpeg_compressibility


@register_reward("jpeg_incompressibility")
def make_jpeg_incompressibility(quality: int = 95):
    def jpeg_incompressibility(images, prompts, metadata):
        kb = jpeg_sizes_kb(images, quality, "jpeg_incompressibility")
        return kb, {"jpeg_kb": kb}

    return jpeg_incompressibility

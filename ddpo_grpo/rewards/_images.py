"""Shared input handling for built-in rewards."""
from __future__ import annotations

import numpy as np
import torch


def image_batch(images, reward_name: str) -> torch.Tensor:
    """`images` (B, C, H, W) in [0, 1] (torch or numpy) as a float32 CPU tensor; video is rejected."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"reward {reward_name!r} expects images as a torch tensor (B, C, H, W), got {type(images).__name__}")
    if images.ndim == 5:
        raise ValueError(
            f"reward {reward_name!r} scores still images (B, C, H, W); got a video batch {tuple(images.shape)} "
            "(B, F, C, H, W): flatten frames to (B*F, C, H, W) and aggregate, or use a video reward"
        )
    if images.ndim != 4:
        raise ValueError(f"reward {reward_name!r} expects images (B, C, H, W), got shape {tuple(images.shape)}")
    return images.detach().to("cpu", torch.float32)


def finite_rows(x: torch.Tensor) -> np.ndarray:
    """Bool (B,): True where every pixel of the sample is finite."""
    return torch.isfinite(x).flatten(1).all(dim=1).numpy()


def to_uint8_hwc(x: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) float in [0, 1] -> uint8 (B, H, W, C); non-finite pixels become 0."""
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=0.0)
    return (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()

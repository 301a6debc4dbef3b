"""Image statistics that drift when a reward is being hacked: what users report (over-saturation, collapse to black
or grey, over-exposure, blur or grids, flicker in video) as numbers, one per sample. numpy/torch only, no model.

All take images (N, C, H, W) in [0, 1] (C = 3 RGB, or 1 grey) or video (N, F, C, H, W) and return (N,) per sample
(video: the mean over frames, plus `flicker`). Each statistic lies in [0, 1], so one threshold on its change from the
start model (trainer/checks/hacking.py) means the same for each:
  saturation        mean HSV saturation (max - min) / max of the RGB channels (0 where max = 0)
  colour_entropy    Shannon entropy of the sample's colours quantised to 4 levels per channel (64 bins), / log2 64
  dark_fraction     share of pixels with luma (0.299 R + 0.587 G + 0.114 B) below 0.1
  bright_fraction   share of pixels with luma above 0.9
  edge_density      share of pixels whose luma gradient |dx| + |dy| (forward differences; the last row/column
                    wraps to 0 difference) exceeds 0.1
  high_freq_energy  share of the mean-removed luma's spectral power at frequencies above half Nyquist
                    (max(|fx|, |fy|) > 0.25 cycles per pixel); 0 for a flat image
  flicker           (video) mean absolute change of each pixel between consecutive frames
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

IMAGE_STATS = ("saturation", "colour_entropy", "dark_fraction", "bright_fraction", "edge_density", "high_freq_energy")
VIDEO_STATS = IMAGE_STATS + ("flicker",)
LEVELS = 4  # colour_entropy's quantisation per channel
DARK, BRIGHT, EDGE, HIGH_FREQ = 0.1, 0.9, 0.1, 0.25


def _rgb(x: torch.Tensor) -> torch.Tensor:
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x[:, :3]


def luma(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H, W): Rec. 601 luma."""
    r, g, b = _rgb(x).unbind(1)
    return 0.299 * r + 0.587 * g + 0.114 * b


def _still_stats(x: torch.Tensor) -> Dict[str, torch.Tensor]:
    x = torch.nan_to_num(x.double(), nan=0.0).clamp(0, 1)
    rgb = _rgb(x)
    mx, mn = rgb.max(dim=1).values, rgb.min(dim=1).values
    sat = torch.where(mx > 0, (mx - mn) / mx.clamp_min(1e-12), torch.zeros_like(mx))
    q = (rgb * LEVELS).floor().clamp(max=LEVELS - 1).long()
    code = (q[:, 0] * LEVELS + q[:, 1]) * LEVELS + q[:, 2]  # (N, H, W) in [0, 64)
    counts = torch.stack([torch.bincount(c.flatten(), minlength=LEVELS ** 3) for c in code]).double()
    p = counts / counts.sum(dim=1, keepdim=True)
    ent = -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(dim=1) / np.log2(LEVELS ** 3)
    y = luma(x)
    dx = torch.zeros_like(y)
    dy = torch.zeros_like(y)
    dx[:, :, :-1] = y[:, :, 1:] - y[:, :, :-1]
    dy[:, :-1, :] = y[:, 1:, :] - y[:, :-1, :]
    power = torch.fft.fft2(y - y.mean(dim=(1, 2), keepdim=True)).abs() ** 2
    fy = torch.fft.fftfreq(y.shape[1], dtype=torch.float64).abs()
    fx = torch.fft.fftfreq(y.shape[2], dtype=torch.float64).abs()
    high = torch.maximum(fy[:, None], fx[None, :]) > HIGH_FREQ
    total = power.sum(dim=(1, 2))
    hf = torch.where(total > 1e-12, (power * high).sum(dim=(1, 2)) / total.clamp_min(1e-12), torch.zeros_like(total))
    return {"saturation": sat.mean(dim=(1, 2)), "colour_entropy": ent,
            "dark_fraction": (y < DARK).double().mean(dim=(1, 2)), "bright_fraction": (y > BRIGHT).double().mean(dim=(1, 2)),
            "edge_density": ((dx.abs() + dy.abs()) > EDGE).double().mean(dim=(1, 2)), "high_freq_energy": hf}


def image_stats(images) -> Dict[str, np.ndarray]:
    """Per-sample statistics (module docstring): name -> (N,) float64. Video (N, F, C, H, W) gets each still statistic
    averaged over its frames, and `flicker`."""
    x = torch.as_tensor(images).detach().cpu()
    if x.ndim == 4:
        return {k: v.numpy() for k, v in _still_stats(x).items()}
    if x.ndim != 5:
        raise ValueError(f"drift statistics need images (N, C, H, W) or video (N, F, C, H, W), got {tuple(x.shape)}")
    n, f = x.shape[:2]
    out = {k: v.reshape(n, f).mean(dim=1).numpy() for k, v in _still_stats(x.reshape(n * f, *x.shape[2:])).items()}
    v = torch.nan_to_num(x.double(), nan=0.0).clamp(0, 1)
    out["flicker"] = ((v[:, 1:] - v[:, :-1]).abs().flatten(1).mean(dim=1) if f > 1 else torch.zeros(n, dtype=torch.float64)).numpy()
    return out

"""Step 6 of the epoch: metrics to the accelerate trackers (wandb offline by default, TensorBoard),
labelled image grids, and at the end a reward curve."""
from __future__ import annotations

import os
import textwrap
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

CELL = 128  # grid cell size: the tiny 32x32 samples are upscaled so a person can see them


def labelled_grid(images: torch.Tensor, captions: Sequence[str], ncols: int = 8) -> Image.Image:
    """images (B, C, H, W) in [0, 1] -> one PIL grid with each caption (prompt, reward) under its image."""
    font = ImageFont.load_default()
    n = len(images)
    ncols = min(ncols, n)
    nrows = (n + ncols - 1) // ncols
    text_h = 44
    grid = Image.new("RGB", (ncols * CELL, nrows * (CELL + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, cap) in enumerate(zip(images, captions)):
        arr = (img.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
        tile = Image.fromarray(arr).resize((CELL, CELL), Image.NEAREST)
        x, y = (i % ncols) * CELL, (i // ncols) * (CELL + text_h)
        grid.paste(tile, (x, y))
        draw.multiline_text((x + 2, y + CELL + 1), "\n".join(textwrap.wrap(cap, 22)[:4]), fill="black", font=font,
                            spacing=0)
    return grid


def log_images(accelerator, name: str, grid: Image.Image, step: int, images: Optional[torch.Tensor] = None,
               captions: Optional[List[str]] = None) -> None:
    """The grid to TensorBoard and wandb; wandb also gets each image with its caption."""
    arr = np.asarray(grid)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(name, arr, step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({f"{name}_grid": wandb.Image(grid, caption=name)}, step=step)
            if images is not None:
                items = [wandb.Image((im.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).astype(np.uint8),
                                      caption=c) for im, c in zip(images, captions)]
                tracker.log({name: items}, step=step)


def reward_curve(history: List[Dict[str, float]], path: str, eval_split: str = "eval") -> None:
    """Training (and eval, where present) reward per epoch, to a PNG. eval_split: config.eval.split, for the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    train = [h for h in history if "reward_mean" in h]
    ep, r = [h["epoch"] for h in train], np.array([h["reward_mean"] for h in train], dtype=float)
    ax.plot(ep, r, alpha=0.35, label="train reward (sampled, eta>0)")
    if len(r) >= 5:  # an epoch's mean depends mostly on which conditions it drew: show the trend
        ax.plot(ep[4:], np.convolve(r, np.ones(5) / 5, mode="valid"), label="train reward, 5-epoch mean")
    ev = [(h["epoch"], h["eval_reward_mean"]) for h in history if "eval_reward_mean" in h]
    if ev:
        where = "held-out" if eval_split == "eval" else "training conditions"
        ax.plot(*zip(*ev), "o-", label=f"eval reward (deterministic, {where})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_grid(grid: Image.Image, run_dir: str, name: str) -> str:
    os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
    path = os.path.join(run_dir, "images", name)
    grid.save(path)
    return path

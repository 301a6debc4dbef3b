"""Video recam conditions addressed by integer index, as condition items for the trainer (`data.name "recam_video"`).

Item i of a split is a dict (F pixel frames, F' = (F - 1) / 4 + 1 latent frames, view size S):
    "index":        int, the global condition index (train 0..511, eval 512..575, as data.py), the GRPO group key;
    "prompt":       str, the scene and the camera preset, e.g. "a red circle and a blue square, camera pan left";
    "source_video": torch.float32 (F, 3, S, S) in [0, 1] (S x W with `width`: a non-square view, the 32 view
                    units across its shorter side, world.render_view), the source clip (static camera; the model adapter
                    VAE-encodes it, `cam_score` reads it);
    "cameras":      torch.float32 (F', 12), ReCamMaster's camera numbers (`video.camera_numbers`);
    "motions":      np.float32 (F, 3), the requested (dx, dy, zoom) of target frame f relative to source frame f
                    (read by `cam_score`);
    "target_video": np.float32 (F, 3, S, S) in [0, 1], the ground-truth target clip (eval/debug, pretraining);
    "preset":       str, the camera preset's name ("pan left", ...).
Rendered clips are cached per index (about 0.9 MB per condition at F=9, S=64; `cache=False` renders every time).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from .data import SPLITS
from .video import MAX_DRIFT, NUM_FRAMES, VIDEO_SIZE, VideoCondition, check_num_frames, make_video_condition


class RecamVideoConditions:
    """The fixed video recam conditions of a split, generated from `seed` (global index i <- rng (seed, i))."""

    def __init__(self, split: str = "train", seed: int = 0, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE,
                 max_drift: float = MAX_DRIFT, cache: bool = True, width: int = 0):
        if split not in SPLITS:
            raise ValueError(f"unknown recam_video split {split!r}; use one of {sorted(SPLITS)}")
        if int(size) != size or size < 8:
            raise ValueError(f"recam_video: size must be an int >= 8 px, got {size!r}")
        if int(width) != width or (width and width < 8):
            raise ValueError(f"recam_video: width must be an int >= 8 px (0: size), got {width!r}")
        lo, hi = SPLITS[split]
        self.split, self.seed, self.max_drift, self.cache = split, seed, float(max_drift), bool(cache)
        self.num_frames, self.size = check_num_frames(num_frames), int(size)
        self.width = int(width) if width and int(width) != self.size else None  # None: square, as before
        self.indices: List[int] = list(range(lo, hi))
        self._conds: Dict[int, VideoCondition] = {}
        self._clips: Dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def condition(self, i: int) -> VideoCondition:
        idx = self.indices[i]
        if idx not in self._conds:
            self._conds[idx] = make_video_condition(idx, self.seed, self.max_drift)
        return self._conds[idx]

    def prompt_at(self, i: int) -> str:
        """Item i's prompt without rendering its views (trainer/run/embeddings.dataset_prompts)."""
        return self.condition(i % len(self)).prompt()

    def __getitem__(self, i: int) -> Dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"recam_video {self.split} split has {len(self)} conditions, asked for {i}")
        i = i % len(self)
        idx = self.indices[i]
        c = self.condition(i)
        clips = self._clips.get(idx)
        if clips is None:
            clips = (c.source_video(self.num_frames, self.size, self.width),
                     c.target_video(self.num_frames, self.size, self.width))
            if self.cache:
                self._clips[idx] = clips
        src, tgt = clips
        return {
            "index": idx,
            "prompt": c.prompt(),
            "source_video": torch.from_numpy(src.copy()),
            "cameras": torch.from_numpy(c.cameras(self.num_frames)),
            "motions": c.motions(self.num_frames),
            "target_video": tgt.copy(),
            "preset": c.preset,
        }

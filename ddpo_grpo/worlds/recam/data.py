"""recam conditions addressed by integer index, as condition items for the trainer.

Item i of a split is a dict:
    "index":      int, the global condition index (train 0..511, eval 512..575), the GRPO group key;
    "prompt":     str, the camera motion, e.g. "pan (+3,-2) zoom 1.10";
    "cond_image": torch.float32 (6, 32, 32): the source view in [-1, 1] (3 channels) and 3 constant planes
                  dx/8, dy/8, 4*log(zoom) (see `world.camera_planes`); the trainer concatenates it to the
                  UNet input and strips it from the reward metadata;
    "source":     np.float32 (3, 32, 32) in [0, 1], the source view (read by `cam_score`);
    "camera":     (dx, dy, zoom) floats, the requested motion (read by `cam_score`);
    "target":     np.float32 (3, 32, 32) in [0, 1], the ground-truth target view (for evaluation/debugging).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from .world import RecamCondition, camera_planes, make_condition

NUM_TRAIN = 512
NUM_EVAL = 64
SPLITS = {"train": (0, NUM_TRAIN), "eval": (NUM_TRAIN, NUM_TRAIN + NUM_EVAL),
          "all": (0, NUM_TRAIN + NUM_EVAL)}


class RecamConditions:
    """The fixed recam conditions of a split, generated from `seed` (global index i <- rng (seed, i))."""

    def __init__(self, split: str = "train", seed: int = 0):
        if split not in SPLITS:
            raise ValueError(f"unknown recam split {split!r}; use one of {sorted(SPLITS)}")
        lo, hi = SPLITS[split]
        self.split, self.seed = split, seed
        self.indices: List[int] = list(range(lo, hi))
        self._conds: Dict[int, RecamCondition] = {}
        self._views: Dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def condition(self, i: int) -> RecamCondition:
        idx = self.indices[i]
        if idx not in self._conds:
            self._conds[idx] = make_condition(idx, self.seed)
        return self._conds[idx]

    def prompt_at(self, i: int) -> str:
        """Item i's prompt without rendering its views (trainer/run/embeddings.dataset_prompts)."""
        return self.condition(i % len(self)).prompt()

    def __getitem__(self, i: int) -> Dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"recam {self.split} split has {len(self)} conditions, asked for {i}")
        i = i % len(self)
        idx = self.indices[i]
        c = self.condition(i)
        if idx not in self._views:
            self._views[idx] = (c.source_view(), c.target_view())
        src, tgt = self._views[idx]
        cond = np.concatenate([src * 2 - 1, camera_planes(c.motion)]).astype(np.float32)
        return {
            "index": idx,
            "prompt": c.prompt(),
            "cond_image": torch.from_numpy(cond),
            "source": src.copy(),
            "camera": c.motion.as_tuple(),
            "target": tgt.copy(),
        }

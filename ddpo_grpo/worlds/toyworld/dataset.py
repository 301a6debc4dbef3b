"""The toy world's condition space, addressable by integer index, and a seeded dataset of renders."""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

import numpy as np
import torch

from .render import COLORS, PLACES, RELATIONS, SHAPES, Condition, Obj, render


def all_conditions() -> List[Condition]:
    """Every condition of the world in a fixed order: 72 single-object, then 4 x 24 x 23 pairs."""
    objs = [Obj(c, s) for c in COLORS for s in SHAPES]
    singles = [Condition(o, place=p) for o in objs for p in PLACES]
    pairs = [
        Condition(a, relation=rel, other=b)
        for rel in RELATIONS
        for a, b in itertools.permutations(objs, 2)
    ]
    return singles + pairs


N_SINGLE = 72  # single-object conditions come first in all_conditions()


def balanced_weights(indices: Sequence[int]) -> np.ndarray:
    """Sampling weights giving single-object and two-object conditions half of the mass each: pairs outnumber
    singles 30:1, and a uniform draw would make the task almost only pairs."""
    idx = np.asarray(indices)
    single = idx < N_SINGLE
    w = np.where(single, 0.5 / max(single.sum(), 1), 0.5 / max((~single).sum(), 1))
    return w / w.sum()


def vocabulary() -> List[str]:
    """Every word that a toy-world prompt can contain."""
    words = set()
    for c in all_conditions()[:72] + all_conditions()[72::24]:
        words.update(c.prompt().split())
    words.update(w for rel in RELATIONS for w in rel.split())
    words.update(COLORS)
    words.update(SHAPES)
    return sorted(words)


class ToyWorldDataset(torch.utils.data.Dataset):
    """Conditions addressed by integer index; item i is (prompt, image (3,32,32) in [-1,1], index).

    The image jitter is seeded by (seed, index, epoch) so a given item is reproducible.
    `split` selects a deterministic held-out subset of pair conditions ("eval") or the rest ("train").
    """

    def __init__(self, split: str = "all", seed: int = 0, indices: Optional[Sequence[int]] = None):
        conds = all_conditions()
        if indices is None:
            # Held out for evaluation: 32 single-object and 32 two-object conditions, fixed.
            rng = np.random.default_rng(1234)
            held_out = set(rng.permutation(N_SINGLE)[:32].tolist())
            held_out |= set((N_SINGLE + rng.permutation(len(conds) - N_SINGLE)[:32]).tolist())
            if split == "train":
                indices = [i for i in range(len(conds)) if i not in held_out]
            elif split == "eval":
                indices = sorted(held_out)
            elif split == "all":
                indices = list(range(len(conds)))
            else:
                raise ValueError(f"unknown split {split!r}; use 'train', 'eval' or 'all'")
        self.conditions = conds
        self.indices = list(indices)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def weights(self) -> np.ndarray:
        """Per-position sampling weights (balanced singles / pairs)."""
        return balanced_weights(self.indices)

    def condition(self, i: int) -> Condition:
        return self.conditions[self.indices[i]]

    def prompt(self, i: int) -> str:
        return self.condition(i).prompt()

    def __getitem__(self, i: int):
        rng = np.random.default_rng((self.seed, self.indices[i]))
        img = render(self.condition(i), rng)
        return self.prompt(i), torch.from_numpy(img) * 2 - 1, self.indices[i]


def sample_training_batch(batch_size: int, rng: np.random.Generator, pair_fraction: float = 0.5):
    """Draw a fresh batch of (prompts, images (B,3,32,32) in [-1,1], conditions) with random jitter."""
    conds = all_conditions()
    n_single = 72
    prompts, images, picked = [], [], []
    for _ in range(batch_size):
        if rng.random() < pair_fraction:
            c = conds[n_single + rng.integers(len(conds) - n_single)]
        else:
            c = conds[rng.integers(n_single)]
        picked.append(c)
        prompts.append(c.prompt())
        images.append(render(c, rng))
    return prompts, torch.from_numpy(np.stack(images)) * 2 - 1, picked

"""Toy-world verifier as a reward: read colour, shape and position back from the pixels.

metadata[i]["condition"] must be the `ddpo_grpo.worlds.toyworld.Condition` the image was generated for.
Scores are the verifier's per-image reward in [0, 1] (mean of the attribute scores; for pairs the
colour and shape scores count each object as 1/2). Details are per-sample 0/1 correctness:
`color_accuracy`, `shape_accuracy`, `position_accuracy` (attribute fully right) and
`strict_accuracy` (everything right); their batch means match `ddpo_grpo.worlds.toyworld.summarize`.
Samples with non-finite pixels score NaN (details 0).

Registered as the reward `toyworld` through the entry-point group ``ddpo_grpo.rewards`` (setup.py), as a
user's plugin is: the generic reward package does not know this world.
"""
from __future__ import annotations

import numpy as np

from ddpo_grpo.rewards._images import finite_rows, image_batch

from .render import IMAGE_SIZE, Condition
from .verify import ATTRIBUTES, verify_batch


def _conditions(metadata, batch: int):
    if metadata is None or len(metadata) != batch:
        raise ValueError(f"toyworld reward needs one metadata dict per image: {batch} images, "
                         f"{None if metadata is None else len(metadata)} metadata entries")
    conds = []
    for i, m in enumerate(metadata):
        c = m.get("condition") if isinstance(m, dict) else None
        if not isinstance(c, Condition):
            raise ValueError(
                f"toyworld reward needs metadata[{i}]['condition'] = a ddpo_grpo.worlds.toyworld.Condition, "
                f"got {type(c).__name__ if c is not None else 'nothing'}"
            )
        conds.append(c)
    return conds


def make_toyworld_reward():
    def toyworld(images, prompts, metadata):
        x = image_batch(images, "toyworld")
        if tuple(x.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"toyworld reward needs images (B, 3, {IMAGE_SIZE}, {IMAGE_SIZE}), got {tuple(x.shape)}")
        conds = _conditions(metadata, x.shape[0])
        ok = finite_rows(x)
        out = verify_batch(np.nan_to_num(x.numpy()), conds)
        details = {f"{a}_accuracy": (out[a] >= 1.0).astype(np.float32) for a in ATTRIBUTES}
        details["strict_accuracy"] = out["strict"].astype(np.float32)
        scores = out["reward"].astype(np.float32)
        scores[~ok] = np.nan
        for v in details.values():
            v[~ok] = 0.0
        return scores, details

    return toyworld

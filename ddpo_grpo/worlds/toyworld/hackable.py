"""A hackable proxy of the toy-world task, for the reward-hacking demonstration (docs/hacking.md).

`colour_share`: the share of each object's box (BOX x BOX pixels centred where the prompt puts the object) drawn in
the prompt's colour for it (a pixel counts when it is lit, max channel > 0.5, and its nearest palette colour is that
one); for two objects the mean of their two shares. At the start it tracks the verifier: the right colour in the
right place raises both. But it cannot tell an object from a filled box: a square covers more of the box than a
circle, a triangle or a cross, and a blob that fills it and bleeds over scores most, while the verifier (`toyworld`)
reads the wrong shape, and finds no object at all once the blob is wider than 16 px. Registered as the reward
`colour_share` through the entry-point group ``ddpo_grpo.rewards`` (setup.py), like `toyworld`.
"""
from __future__ import annotations

import numpy as np
import torch

from ddpo_grpo.rewards._images import finite_rows, image_batch

from .render import COLORS, IMAGE_SIZE
from .reward import _conditions

_PALETTE = torch.tensor(list(COLORS.values()), dtype=torch.float32)  # (P, 3)
_NAMES = list(COLORS)


BOX = 16  # pixels: a canonical object (radius 5.5-6) covers 0.35-0.56 of its box, a filled box 1


def colour_share(images: torch.Tensor, colours, boxes=None) -> np.ndarray:
    """(B,) share of pixels of images (B, 3, H, W) in [0, 1] that are lit (max channel > 0.5) and nearest in RGB to
    the palette colour colours[i]; within boxes[i] = (x0, y0, x1, y1) (pixel bounds, end exclusive) when given, else
    over the whole image."""
    x = images.float()
    d = ((x[:, None] - _PALETTE[None, :, :, None, None]) ** 2).sum(dim=2)  # (B, P, H, W)
    nearest = d.argmin(dim=1)  # (B, H, W)
    want = torch.tensor([_NAMES.index(c) for c in colours])[:, None, None]
    hit = ((nearest == want) & (x.max(dim=1).values > 0.5)).float()
    if boxes is None:
        return hit.flatten(1).mean(dim=1).numpy()
    return np.array([hit[i, y0:y1, x0:x1].mean().item() for i, (x0, y0, x1, y1) in enumerate(boxes)])


def object_box(centre, size: int = BOX, image: int = IMAGE_SIZE):
    """(x0, y0, x1, y1): the size x size box centred at centre (x, y), clipped to the image."""
    (cx, cy), h = centre, size // 2
    return (max(0, round(cx) - h), max(0, round(cy) - h), min(image, round(cx) + h), min(image, round(cy) + h))


def make_colour_share_reward():
    def colour_share_reward(images, prompts, metadata):
        x = image_batch(images, "colour_share")
        conds = _conditions(metadata, x.shape[0])
        x0 = torch.nan_to_num(x)
        shares = []
        for j in range(2):  # the condition's objects (a single-object condition counts its one object twice)
            objs = [c.layout()[min(j, len(c.layout()) - 1)] for c in conds]
            shares.append(colour_share(x0, [o.color for o, _, _ in objs], [object_box(xy) for _, xy, _ in objs]))
        scores = np.mean(shares, axis=0).astype(np.float32)
        scores[~finite_rows(x)] = np.nan
        return scores

    return colour_share_reward

"""A procedural world of coloured shapes with prompts and a reward that reads the pixels back (`reward.py`,
registered as `toyworld` through the entry-point group ``ddpo_grpo.rewards``)."""
from .dataset import ToyWorldDataset, all_conditions, balanced_weights, sample_training_batch, vocabulary
from .render import COLORS, PLACES, RELATIONS, SHAPES, Condition, Obj, render
from .verify import ATTRIBUTES, summarize, verify_batch, verify_image

__all__ = [
    "ATTRIBUTES", "COLORS", "PLACES", "RELATIONS", "SHAPES", "Condition", "Obj", "ToyWorldDataset",
    "all_conditions", "balanced_weights", "render", "sample_training_batch", "summarize", "verify_batch", "verify_image", "vocabulary",
]

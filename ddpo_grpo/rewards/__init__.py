"""Rewards: `fn(images, prompts, metadata) -> (scores (B,), details {name: (B,)})`, a registry with
entry-point plugins (group ``ddpo_grpo.rewards``), and a weighted combiner with per-step modes.

images are (B, C, H, W) in [0, 1]. Video models (Wan) sample frames (B, F, C, H, W) in [0, 1]; then, by default,
an image reward scores every frame: it is called once on the frames flattened to (B*F, C, H, W), with each
sample's prompt and metadata repeated F times (sample by sample, its frames in order), and a sample's score (and each
detail) is the mean over its frames. A reward that judges the clip as a whole (motion, consistency) marks its
factory with `@clip_reward` (or sets `takes_clips = True` on it or on the function it returns) and gets the
(B, F, C, H, W) batch as it is; it returns (B,) scores like any reward.

Only generic rewards live here (aesthetic, jpeg); a world's rewards (toyworld, cam_score, unifiedscore) are
plugins of that world, found through the entry-point group."""
from . import aesthetic, jpeg  # noqa: F401  (register the built-ins)
from .aesthetic import AestheticMLP, AestheticScorer, make_aesthetic_reward
from .combine import PER_STEP_MODES, RewardComputer, RewardResult, collect_rewards
from .jpeg import jpeg_sizes_kb, make_jpeg_compressibility, make_jpeg_incompressibility
from .registry import (
    ENTRY_POINT_GROUP,
    ConfigError,
    RewardError,
    RewardFn,
    available_rewards,
    clip_reward,
    get_reward_factory,
    get_reward_fn,
    register_reward,
    unregister_reward,
)

__all__ = [
    "AestheticMLP", "AestheticScorer", "ConfigError", "ENTRY_POINT_GROUP", "PER_STEP_MODES", "RewardComputer",
    "RewardError", "RewardFn", "RewardResult", "available_rewards", "clip_reward", "collect_rewards", "get_reward_factory",
    "get_reward_fn", "jpeg_sizes_kb", "make_aesthetic_reward", "make_jpeg_compressibility",
    "make_jpeg_incompressibility", "register_reward", "unregister_reward",
]

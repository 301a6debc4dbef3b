"""Rewards: `fn(images, prompts, metadata) -> (scores (B,), details {name: (B,)})`, a registry with
entry-point plugins (group ``ddpo_grpo.rewards``), and a weighted combiner with per-step modes.

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
    get_reward_factory,
    get_reward_fn,
    register_reward,
    unregister_reward,
)

__all__ = [
    "AestheticMLP", "AestheticScorer", "ConfigError", "ENTRY_POINT_GROUP", "PER_STEP_MODES", "RewardComputer",
    "RewardError", "RewardFn", "RewardResult", "available_rewards", "collect_rewards", "get_reward_factory",
    "get_reward_fn", "jpeg_sizes_kb", "make_aesthetic_reward", "make_jpeg_compressibility",
    "make_jpeg_incompressibility", "register_reward", "unregister_reward",
]

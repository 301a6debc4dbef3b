"""Compatibility path (ddpo-pytorch): the code lives in `ddpo_grpo.core.stat_tracking`."""
from ddpo_grpo.core.stat_tracking import *  # noqa: F401,F403
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker  # noqa: F401

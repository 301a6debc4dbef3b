"""Compatibility path (ddpo-pytorch): the code lives in `ddpo_grpo.core.ddim_with_logprob`."""
from ddpo_grpo.core.ddim_with_logprob import *  # noqa: F401,F403
from ddpo_grpo.core.ddim_with_logprob import ddim_step, ddim_step_with_logprob  # noqa: F401

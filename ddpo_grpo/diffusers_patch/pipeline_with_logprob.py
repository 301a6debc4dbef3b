"""Compatibility path (ddpo-pytorch): the code lives in `ddpo_grpo.core.pipeline_with_logprob`."""
from ddpo_grpo.core.pipeline_with_logprob import *  # noqa: F401,F403
from ddpo_grpo.core.pipeline_with_logprob import encode_prompts, pipeline_with_logprob  # noqa: F401

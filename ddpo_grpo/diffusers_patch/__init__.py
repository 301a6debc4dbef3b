"""ddpo-pytorch's module paths, kept for compatibility: the code lives in `ddpo_grpo.core`.

    from ddpo_grpo.diffusers_patch.ddim_with_logprob import ddim_step_with_logprob
    from ddpo_grpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob
"""
from ddpo_grpo.core.common import expand_to_ndim, gaussian_log_prob
from ddpo_grpo.core.ddim_with_logprob import ddim_step, ddim_step_with_logprob
from ddpo_grpo.core.sde_with_logprob import flow_ode_step, sde_step_with_logprob

__all__ = [
    "ddim_step", "ddim_step_with_logprob", "expand_to_ndim", "flow_ode_step", "gaussian_log_prob",
    "sde_step_with_logprob",
]

"""Per-step policy math for RL fine-tuning of diffusers schedulers.

Each stochastic sampler step is a Gaussian policy N(x_prev; mean, std² I); these functions
draw (or re-score) the action x_prev and return its log-probability (averaged over non-batch
dims, shape (B,)). Deterministic siblings (`ddim_step` with eta=0, `flow_ode_step`) are for
evaluation sampling and for steps whose variance is zero.
"""
from .common import expand_to_ndim, gaussian_log_prob
from .ddim_with_logprob import ddim_step, ddim_step_with_logprob
from .sde_with_logprob import flow_ode_step, sde_step_with_logprob

__all__ = [
    "ddim_step", "ddim_step_with_logprob", "expand_to_ndim", "flow_ode_step", "gaussian_log_prob",
    "sde_step_with_logprob",
]

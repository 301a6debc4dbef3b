"""The math, importable without accelerate (torch, numpy and, for sampling, diffusers only).

  - Per-step policy: each stochastic sampler step is a Gaussian policy N(x_prev; mean, std^2 I);
    `ddim_with_logprob` (DDIM, eta > 0), `sde_with_logprob` (flow-matching SDE), `common` (the Gaussian
    log-density, noise), `policy_step` (one step of either family, the denoiser call, CFG), and
    `pipeline_with_logprob` (the sampling loop recording the trajectory and its log-probs).
  - `families`: one object per model family (`get_family("ddim" | "flow")`) holding what differs between
    them (schedule, stochastic and ODE steps, x̂0, stored steps, forward-loss target, config checks).
  - `stat_tracking`: per-prompt (group) reward statistics -> advantages.
  - `loss`: the clipped-ratio GRPO loss and the KL penalty.
  - `reference`: the EMA / frozen reference policy for the KL.
  - `forward_loss`: the forward-process objectives (NFT, RAFT) on sampled images.

Nothing here imports the trainer (`ddpo_grpo.trainer`) or accelerate.
"""

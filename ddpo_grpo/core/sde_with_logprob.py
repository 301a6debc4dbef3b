"""Stochastic flow-matching steps with log-probabilities (Flow-GRPO style policies).

Flow matching (rectified flow) interpolates x_σ = (1 - σ) x0 + σ x1 with x1 ~ N(0, I), and the
model predicts the velocity v = dx/dσ = x1 - x0. diffusers' `FlowMatchEulerDiscreteScheduler`
integrates the ODE dx = v dσ from σ = sigmas[0] (≈ 1, noise) down to sigmas[-1] = 0 (data):

    x_{σ'} = x_σ + (σ' - σ) · v          with dt = σ' - σ < 0.            (`flow_ode_step`)

A deterministic ODE has no density, so for RL the step is replaced by a Gaussian transition
with the same marginals, N(x_{σ'}; mean, std² I). Two choices are implemented:

"sde" (Flow-GRPO): the reverse SDE with noise scale s(σ) = η · sqrt(σ / (1 - σ)),
        dx = [v + s²/(2σ) · (x + (1 - σ) v)] dt + s dw,
    discretised with Euler–Maruyama over one step:
        mean = x · (1 + s² dt / (2σ)) + v · (1 + s² (1 - σ) / (2σ)) · dt
        std  = s · sqrt(-dt)

"cps" (coefficients-preserving sampling): re-noise the current predictions of the
    endpoints so the result is exactly an interpolant at σ' with a fraction of fresh noise,
        x̂0 = x - σ v,  x̂1 = x + (1 - σ) v,   std = σ' · sin(η π / 2)
        mean = (1 - σ') · x̂0 + sqrt(σ'² - std²) · x̂1

η = `noise_level` ∈ (0, 1]. All math runs in float32; the drawn sample is cast to the dtype of
`sample` before it is scored, so re-scoring a stored trajectory reproduces the log-probability.
"""
from __future__ import annotations

import math
from typing import Tuple, Union

import torch

from .common import (GeneratorLike, check_positive_std, draw_noise, expand_to_ndim, gaussian_log_prob, on_device,
                     per_sample)

StepIndexLike = Union[int, torch.Tensor]
SDE_TYPES = ("sde", "cps")


def _sigmas_for_step(scheduler, step_index: StepIndexLike, sample: torch.Tensor, validate: bool = True
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sample σ = sigmas[i] and σ' = sigmas[i + 1], each (B,) float32 on sample's device. validate=False skips
    the range and decreasing-sigmas checks (two host syncs on an accelerator), for a caller that checked the
    schedule's steps once (the sampler, through ModelFamily.step_stds)."""
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is None or getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError("scheduler.sigmas is not set; call scheduler.set_timesteps(...) first")
    sigmas = on_device(sigmas, sample.device, torch.float32)
    i = per_sample(step_index, sample.shape[0], sample.device, torch.long)
    if validate and bool(torch.any((i < 0) | (i >= sigmas.numel() - 1))):
        raise ValueError(f"step_index must be in [0, {sigmas.numel() - 2}] (sigmas has a terminal value "
                         f"appended), got {i.tolist()}")
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    if validate and bool(torch.any(sigma_next >= sigma)):
        # e.g. invert_sigmas=True (Mochi): the formulas below assume denoising runs σ → 0.
        raise ValueError("expected decreasing sigmas (dt = sigmas[i+1] - sigmas[i] < 0); "
                         "inverted or non-decreasing schedules are not supported")
    return sigma, sigma_next


def _sde_mean_std(sigma: torch.Tensor, sigma_next: torch.Tensor, x: torch.Tensor, v: torch.Tensor,
                  noise_level: float, sde_type: str, validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 mean (B, ...) and std (B, 1, ..., 1) of the stochastic step; σ, σ' are (B,). validate: as in
    _sigmas_for_step."""
    ndim = x.ndim
    dt = expand_to_ndim(sigma_next - sigma, ndim)
    if sde_type == "sde":
        # s(σ) = η sqrt(σ/(1-σ)) diverges at σ = 1 (pure noise, the first step of the default
        # schedule), and so does the drift correction s²/(2σ)·x̂1. A fixed cap just below 1
        # (e.g. 1 - 1e-4) would give, with η = 0.7 and 10 steps, s ≈ 70 and a mean of about
        # -270·x. So at σ = 1 we evaluate s at the step's target σ' instead: the nearest point
        # of the step where the noise scale is finite, which keeps s in line with the next step.
        sigma_for_scale = torch.where(sigma >= 1.0, sigma_next, sigma)
        if validate and bool(torch.any(sigma_for_scale >= 1.0)):
            raise ValueError("sde_type='sde' needs sigmas[i+1] < 1 when sigmas[i] >= 1")
        s = noise_level * torch.sqrt(sigma_for_scale / (1.0 - sigma_for_scale))
        s = expand_to_ndim(s, ndim)
        sig = expand_to_ndim(sigma, ndim)
        mean = x * (1.0 + s**2 * dt / (2.0 * sig)) + v * (1.0 + s**2 * (1.0 - sig) / (2.0 * sig)) * dt
        std = s * torch.sqrt(-dt)
    elif sde_type == "cps":
        sig = expand_to_ndim(sigma, ndim)
        sig_next = expand_to_ndim(sigma_next, ndim)
        pred_x0 = x - sig * v           # data endpoint
        pred_x1 = x + (1.0 - sig) * v   # noise endpoint
        std = sig_next * math.sin(noise_level * math.pi / 2.0)
        # σ'² - std² = σ'² cos²(ηπ/2) ≥ 0; the clamp only absorbs float rounding.
        mean = (1.0 - sig_next) * pred_x0 + torch.sqrt((sig_next**2 - std**2).clamp(min=0.0)) * pred_x1
    else:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    return mean, std


def sde_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    step_index: StepIndexLike,
    sample: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: GeneratorLike = None,
    sde_type: str = "sde",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stochastic flow-matching step σ → σ' and its log-probability under the policy.

    Args:
        scheduler: a diffusers `FlowMatchEulerDiscreteScheduler` after `set_timesteps` (its
            `sigmas` has num_inference_steps + 1 entries, ending in 0). It is only read: its
            internal step counter is neither used nor advanced.
        model_output: predicted velocity v, shape (B, C, H, W) (or (B, F, C, H, W)).
        step_index: i, an int or a LongTensor (B,) (one per sample); σ = sigmas[i],
            σ' = sigmas[i + 1].
        sample: current x_σ, shape (B, C, H, W); its dtype is the dtype of the returned sample.
        noise_level: η > 0 (0 is the plain ODE: use `flow_ode_step`).
        prev_sample: if given, the x_{σ'} to score instead of drawing one; returned unchanged.
            A drawn prev_sample is detached; log_prob stays differentiable w.r.t. model_output.
        generator: None, a torch.Generator, or a list of B generators.
        sde_type: "sde" (Flow-GRPO) or "cps" (coefficients-preserving).
        validate: check the step index, the schedule's direction and std > 0 (host syncs on an accelerator).
            False only where the caller checked the schedule's steps once already (the sampler: its stored steps
            are ModelFamily.stochastic_steps', whose stds step_stds computed for every step).

    Returns:
        `(prev_sample, log_prob, mean, std)`: prev_sample (B, C, H, W) in `sample.dtype` (or
        the given one); log_prob (B,) float32, the Gaussian log density averaged over non-batch
        dims of exactly that prev_sample; mean (B, C, H, W) float32; std (B, 1, 1, 1) float32.

    Raises:
        ValueError: if noise_level <= 0, or if std == 0 for some sample (cps at the final step,
            where σ' = 0): take such steps with `flow_ode_step` and do not train on them.
    """
    if noise_level <= 0:
        raise ValueError(f"noise_level={noise_level}: noise_level=0 is the deterministic flow ODE and has no "
                         "log-probability; use noise_level>0 for training, or flow_ode_step for sampling")
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    sigma, sigma_next = _sigmas_for_step(scheduler, step_index, sample, validate)
    mean, std = _sde_mean_std(sigma, sigma_next, sample.float(), model_output.float(), noise_level, sde_type, validate)
    if validate:
        check_positive_std(std, f"the {sde_type!r} step has zero std for some sample (e.g. cps at the final step, "
                                "where sigmas[i+1] == 0), so its log-probability is undefined; "
                                "take that step with flow_ode_step")

    if prev_sample is None:
        noise = draw_noise(sample.shape, generator, sample.device)
        # Cast first, score after: the log-prob must be that of the value actually stored.
        # Detached because the action is a sample: the policy gradient flows through the
        # log-prob's mean/std only (score function), never through the drawn value.
        prev_sample = (mean + std * noise).detach().to(sample.dtype)

    log_prob = gaussian_log_prob(prev_sample.float(), mean, std)
    return prev_sample, log_prob, mean, std


def flow_step_std(scheduler, step_index: int, noise_level: float, sde_type: str) -> torch.Tensor:
    """The std of the stochastic step at step_index (0-d float32), from the schedule alone (no model): 0 where the
    step has no noise (CPS's last, σ' = 0); what core.families decides stochastic steps by."""
    return flow_step_stds(scheduler, torch.tensor([int(step_index)]), noise_level, sde_type)[0]


def flow_step_stds(scheduler, step_indices: torch.Tensor, noise_level: float, sde_type: str) -> torch.Tensor:
    """flow_step_std of several steps in one evaluation, (n,) float32 for step_indices (n,) long: the same
    elementwise float32 math per step, so each value equals flow_step_std's bit for bit."""
    x = torch.zeros(len(step_indices), 1)
    sigma, sigma_next = _sigmas_for_step(scheduler, step_indices, x)
    return _sde_mean_std(sigma, sigma_next, x, x, noise_level, sde_type)[1].reshape(-1)


def flow_ode_step(scheduler, model_output: torch.Tensor, step_index: StepIndexLike,
                  sample: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Deterministic Euler step of the flow ODE: x_{σ'} = x_σ + (σ' - σ) · v.

    Args:
        scheduler: a `FlowMatchEulerDiscreteScheduler` after `set_timesteps` (only read).
        model_output: predicted velocity v, shape (B, C, H, W).
        step_index: an int or a LongTensor (B,) indexing `scheduler.sigmas`.
        sample: current x_σ, shape (B, C, H, W).
        validate: check the step index and the schedule's direction (see _sigmas_for_step).

    Returns:
        prev_sample (B, C, H, W) in `sample.dtype` (diffusers casts to model_output's dtype
        instead; the two agree when both are the same dtype).
    """
    sigma, sigma_next = _sigmas_for_step(scheduler, step_index, sample, validate)
    dt = expand_to_ndim(sigma_next - sigma, sample.ndim)
    return (sample.float() + dt * model_output.float()).to(sample.dtype)

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

Low-frequency step noise (`noise_pool` = b > 1, "sde" only): the step draws its noise constant over b × b
blocks of the last two (spatial) dims, i.e. P ε with P the orthogonal projection onto block-constant tensors (block
mean, then repeated over the block), and the score correction of "sde" is projected by P too (the reverse SDE with
diffusion s² P keeps the path's marginals the same way). The step is then a Gaussian on the block means only:
        log p = log N(block_mean(x'); block_mean(mean), (std / b)²)   averaged over the C·F·(H/b)·(W/b) block dims,
and the complement (I - P) x' is the deterministic (I - P) mean. The exploration in the block means is the full step's
(P ε is exactly the low-frequency part of ε); what goes is the high-frequency part of the score function's noise, which
a reward that reads only the layout (a camera's motion) cannot rank. `mean` and `std` stay the full step's, so a
Gaussian KL from them (the reference, the policy shift) measures the whole mean, the deterministic part included.

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


def block_mean(x: torch.Tensor, b: int) -> torch.Tensor:
    """(..., H, W) -> (..., H / b, W / b): the mean of each b × b block of the last two dims (b = 1: x itself).
    ValueError where H or W is not a multiple of b."""
    if b == 1:
        return x
    h, w = x.shape[-2:]
    if h % b or w % b:
        raise ValueError(f"noise_pool={b}: the latents' last two dims {h} x {w} must be multiples of it")
    return x.reshape(*x.shape[:-2], h // b, b, w // b, b).mean(dim=(-3, -1))


def block_project(x: torch.Tensor, b: int) -> torch.Tensor:
    """P x (same shape as x (..., H, W)): each b × b block of the last two dims replaced by its mean, the orthogonal
    projection onto block-constant tensors (symmetric, P P = P)."""
    if b == 1:
        return x
    return block_mean(x, b).repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)


def _sde_mean_std(sigma: torch.Tensor, sigma_next: torch.Tensor, x: torch.Tensor, v: torch.Tensor,
                  noise_level: float, sde_type: str, validate: bool = True, noise_pool: int = 1
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 mean (B, ...) and std (B, 1, ..., 1) of the stochastic step; σ, σ' are (B,). validate: as in
    _sigmas_for_step. noise_pool b > 1: the noise lives in the block-constant subspace, so "sde"'s score correction is
    projected onto it (the module docstring); "sde" only."""
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
        if noise_pool == 1:
            mean = x * (1.0 + s**2 * dt / (2.0 * sig)) + v * (1.0 + s**2 * (1.0 - sig) / (2.0 * sig)) * dt
        else:  # the same mean, x + v dt + s² dt / (2σ) (x + (1 - σ) v), its correction along the noise's subspace
            mean = x + v * dt + block_project(s**2 * dt / (2.0 * sig) * (x + (1.0 - sig) * v), noise_pool)
        std = s * torch.sqrt(-dt)
    elif sde_type == "cps":
        if noise_pool != 1:
            raise ValueError("noise_pool > 1 is defined for sde_type='sde' (CPS's re-noising would need the "
                             "high-frequency part kept at sigma')")
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
    noise_pool: int = 1,
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
        noise_pool: b ≥ 1; b > 1 draws the noise constant over b × b blocks of the last two dims (H, W multiples
            of b; sde_type "sde") and scores the block means only (the module docstring).

    Returns:
        `(prev_sample, log_prob, mean, std)`: prev_sample (B, C, H, W) in `sample.dtype` (or
        the given one); log_prob (B,) float32, the Gaussian log density averaged over non-batch
        dims of exactly that prev_sample (with noise_pool b: of its block means, averaged over the block dims);
        mean (B, C, H, W) float32; std (B, 1, 1, 1) float32 (the full step's, also with noise_pool).

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
    noise_pool = int(noise_pool)
    if noise_pool < 1:
        raise ValueError(f"noise_pool must be an int >= 1, got {noise_pool}")
    if noise_pool > 1 and sample.ndim < 4:  # packed latents (FLUX's (B, tokens, C)) have no spatial last two dims
        raise ValueError(f"noise_pool={noise_pool} needs latents (B, C, [F,] H, W), got shape {tuple(sample.shape)}")
    mean, std = _sde_mean_std(sigma, sigma_next, sample.float(), model_output.float(), noise_level, sde_type, validate,
                              noise_pool)
    if validate:
        check_positive_std(std, f"the {sde_type!r} step has zero std for some sample (e.g. cps at the final step, "
                                "where sigmas[i+1] == 0), so its log-probability is undefined; "
                                "take that step with flow_ode_step")

    if prev_sample is None:
        noise = block_project(draw_noise(sample.shape, generator, sample.device), noise_pool)
        # Cast first, score after: the log-prob must be that of the value actually stored.
        # Detached because the action is a sample: the policy gradient flows through the
        # log-prob's mean/std only (score function), never through the drawn value.
        prev_sample = (mean + std * noise).detach().to(sample.dtype)

    if noise_pool == 1:
        log_prob = gaussian_log_prob(prev_sample.float(), mean, std)
    else:  # the block means of P ε · std are N(0, (std / b)²), independent across blocks
        log_prob = gaussian_log_prob(block_mean(prev_sample.float(), noise_pool), block_mean(mean, noise_pool),
                                     std / noise_pool)
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

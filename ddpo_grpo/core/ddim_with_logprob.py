"""DDIM step with the log-probability of the sampled transition (DDPO's policy for DDIM models).

Reverse-process step of DDIM (Song et al., "Denoising Diffusion Implicit Models", eq. 12), from
timestep t to the previous timestep s = t - num_train_timesteps // num_inference_steps:

    x_s = sqrt(ᾱ_s) · x̂0  +  sqrt(1 - ᾱ_s - σ_t²) · ε̂  +  σ_t · z,       z ~ N(0, I)
          \\_______________ mean μ _______________/

    σ_t = η · sqrt((1 - ᾱ_s) / (1 - ᾱ_t)) · sqrt(1 - ᾱ_t / ᾱ_s)

With η > 0 this is a Gaussian policy N(x_s; μ, σ_t² I) whose log density is what the RL loss
differentiates. With η = 0 the step is deterministic and has no density, hence `ddim_step` for
evaluation-time sampling.

All math runs in float32 whatever the dtype of the model. The sampled x_s is cast to the
dtype of `sample` *before* it is scored, so that re-scoring a stored trajectory (passing the
stored x_s back as `prev_sample`) reproduces the sampling-time log-probability exactly.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

from .common import (GeneratorLike, check_positive_std, draw_noise, expand_to_ndim, gaussian_log_prob, on_device,
                     per_sample)

TimestepLike = Union[int, torch.Tensor]


def ddim_mean_std(scheduler, model_output: torch.Tensor, timestep: TimestepLike, sample: torch.Tensor,
                   eta: float, use_clipped_model_output: bool, validate: bool = True
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 mean μ (B, ...) and std σ_t (B, 1, ..., 1) of the DDIM transition, plus the
    per-sample boolean (B,) `is_final` marking steps whose previous timestep is before 0.

    validate=False skips the check that eta leaves the step defined (1 - ᾱ_s - σ_t² ≥ 0), a host sync on an
    accelerator: for callers that checked the whole schedule once already (the sampler, through
    ModelFamily.step_stds, which evaluates every step)."""
    if getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError("scheduler.num_inference_steps is not set; call scheduler.set_timesteps(...) first")

    config = scheduler.config
    batch_size, ndim, device = sample.shape[0], sample.ndim, sample.device
    x_t = sample.float()
    model_output = model_output.float()

    # 1. Timesteps t and s (= previous timestep) per sample.
    t = per_sample(timestep, batch_size, device, torch.long)
    s = t - config.num_train_timesteps // scheduler.num_inference_steps
    is_final = s < 0

    # 2. ᾱ_t and ᾱ_s; before t = 0 the scheduler defines ᾱ_s = final_alpha_cumprod
    #    (1 if set_alpha_to_one, else ᾱ_0).
    alphas_cumprod = on_device(scheduler.alphas_cumprod, device, torch.float32)
    final = scheduler.final_alpha_cumprod
    final_alpha_cumprod = (on_device(final, device, torch.float32) if torch.is_tensor(final)
                           else torch.as_tensor(final, device=device, dtype=torch.float32))
    alpha_prod_t = alphas_cumprod[t]
    alpha_prod_s = torch.where(is_final, final_alpha_cumprod, alphas_cumprod[s.clamp(min=0)])
    beta_prod_t = 1.0 - alpha_prod_t
    beta_prod_s = 1.0 - alpha_prod_s

    a_t = expand_to_ndim(alpha_prod_t, ndim)
    b_t = expand_to_ndim(beta_prod_t, ndim)
    a_s = expand_to_ndim(alpha_prod_s, ndim)

    # 3. Predicted x̂0 and ε̂, from x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε.
    prediction_type = config.prediction_type
    if prediction_type == "epsilon":
        pred_epsilon = model_output
        pred_original_sample = (x_t - b_t.sqrt() * pred_epsilon) / a_t.sqrt()
    elif prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (x_t - a_t.sqrt() * pred_original_sample) / b_t.sqrt()
    elif prediction_type == "v_prediction":
        # v = sqrt(ᾱ_t) ε - sqrt(1 - ᾱ_t) x0  ⇒  x0 = sqrt(ᾱ_t) x_t - sqrt(1 - ᾱ_t) v,
        #                                         ε  = sqrt(ᾱ_t) v   + sqrt(1 - ᾱ_t) x_t
        pred_original_sample = a_t.sqrt() * x_t - b_t.sqrt() * model_output
        pred_epsilon = a_t.sqrt() * model_output + b_t.sqrt() * x_t
    else:
        raise ValueError(f"prediction_type {prediction_type!r} must be one of 'epsilon', 'sample', 'v_prediction'")

    # 4. Keep x̂0 in the data range, exactly as DDIMScheduler.step does.
    if config.thresholding:
        pred_original_sample = scheduler._threshold_sample(pred_original_sample)
    elif config.clip_sample:
        pred_original_sample = pred_original_sample.clamp(-config.clip_sample_range, config.clip_sample_range)

    if use_clipped_model_output:
        # Glide's correction: ε̂ consistent with the clipped x̂0.
        pred_epsilon = (x_t - a_t.sqrt() * pred_original_sample) / b_t.sqrt()

    # 5. σ_t = η · sqrt((1 - ᾱ_s)/(1 - ᾱ_t)) · sqrt(1 - ᾱ_t/ᾱ_s)   (DDIM eq. 16)
    #    1 - ᾱ_t/ᾱ_s is written (ᾱ_s - ᾱ_t)/ᾱ_s: near t = 0 the ratio is ~0.999 and forming
    #    1 - ratio in float32 loses ~4 digits, while ᾱ_s - ᾱ_t is exact (the two are within a
    #    factor of 2 of each other).
    variance = (beta_prod_s / beta_prod_t) * ((alpha_prod_s - alpha_prod_t) / alpha_prod_s)
    std = eta * variance.clamp(min=0.0).sqrt()
    std = expand_to_ndim(std, ndim)

    # 6. μ = sqrt(ᾱ_s) x̂0 + sqrt(1 - ᾱ_s - σ_t²) ε̂  ("direction pointing to x_t").
    #    For η ≤ 1 the radicand is ≥ 0 analytically; float rounding can push it a hair below 0
    #    (which would be NaN), so tiny negatives are clamped, while a real negative (η too large)
    #    is an error.
    direction_var = (1.0 - a_s) - std**2
    if validate and bool(torch.any(direction_var < -1e-6)):
        raise ValueError(f"eta={eta} is too large: 1 - ᾱ_s - σ_t² < 0, so the DDIM step is undefined; use eta <= 1")
    mean = a_s.sqrt() * pred_original_sample + direction_var.clamp(min=0.0).sqrt() * pred_epsilon
    return mean, std, is_final


def ddim_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    timestep: TimestepLike,
    sample: torch.Tensor,
    eta: float = 1.0,
    use_clipped_model_output: bool = False,
    generator: GeneratorLike = None,
    prev_sample: torch.Tensor | None = None,
    return_mean_std: bool = False,
    validate: bool = True,
):
    """One stochastic DDIM step x_t → x_s and its log-probability under the policy.

    Args:
        scheduler: a diffusers `DDIMScheduler` on which `set_timesteps` has been called.
        model_output: the denoiser output for `sample`, shape (B, C, H, W) (or (B, F, C, H, W)
            for video); interpreted per `scheduler.config.prediction_type`.
        timestep: the current timestep t: an int, a 0-d tensor, or a LongTensor (B,) with one
            timestep per sample.
        sample: the current x_t, shape (B, C, H, W). Its dtype is the dtype of the returned
            prev_sample.
        eta: the DDIM η; must be > 0 (η = 0 is deterministic, see `ddim_step`).
        use_clipped_model_output: recompute ε̂ from the clipped x̂0 (as diffusers does).
        generator: None, a torch.Generator, or a list of B generators, for drawing x_s.
        prev_sample: if given, the x_s to score instead of drawing one (training re-scores the
            stored trajectory); it is returned unchanged and scored as-is (in float32).
            A drawn prev_sample is detached; log_prob stays differentiable w.r.t. model_output.
        return_mean_std: also return the transition mean and std.
        validate: check that σ_t > 0 and that eta leaves the step defined (two host syncs on an accelerator).
            False only where the caller checked the schedule's steps once already (the sampler: its stored steps
            are ModelFamily.stochastic_steps', whose stds step_stds computed for every step).

    Returns:
        `(prev_sample, log_prob)` or, if `return_mean_std`, `(prev_sample, log_prob, mean, std)`:
        prev_sample (B, C, H, W) in `sample.dtype` (or the given `prev_sample`); log_prob (B,)
        float32, the Gaussian log density averaged over non-batch dims of exactly that
        prev_sample; mean (B, C, H, W) float32; std (B, 1, 1, 1) float32.

    Raises:
        ValueError: if eta <= 0, or if σ_t = 0 for some sample (the final step when
            final_alpha_cumprod == 1, or t = 0 when ᾱ_s = ᾱ_0), since the log-probability is then undefined.
    """
    if eta <= 0:
        raise ValueError(
            f"eta={eta}: eta=0 is deterministic DDIM sampling and has no log-probability; use eta>0 for training"
            if eta == 0 else f"eta must be > 0 for a log-probability, got eta={eta}"
        )
    mean, std, _ = ddim_mean_std(scheduler, model_output, timestep, sample, eta, use_clipped_model_output, validate)

    # σ_t = 0 (the last step into final_alpha_cumprod == 1, i.e. set_alpha_to_one=True; or t = 0 with ᾱ_s = ᾱ_0)
    # has no density. The sampler never asks for it: core.families' stochastic_steps takes such a step with
    # ddim_step and stores no log-prob for it; a direct call here is a caller's error.
    if validate:
        check_positive_std(std, "the DDIM step has zero variance (σ_t == 0) for some sample (e.g. the last step with "
                                "set_alpha_to_one=True, or t = 0), so it has no log-probability: it is a "
                                "deterministic step, taken with ddim_step (ModelFamily.stochastic_steps excludes it)")

    if prev_sample is None:
        noise = draw_noise(sample.shape, generator, sample.device)
        # Cast first, score after: the log-prob must be that of the value actually stored.
        # Detached because the action is a sample: the policy gradient flows through the
        # log-prob's mean/std only (score function), never through the drawn value.
        prev_sample = (mean + std * noise).detach().to(sample.dtype)

    log_prob = gaussian_log_prob(prev_sample.float(), mean, std)
    if return_mean_std:
        return prev_sample, log_prob, mean, std
    return prev_sample, log_prob


def ddim_step(
    scheduler,
    model_output: torch.Tensor,
    timestep: TimestepLike,
    sample: torch.Tensor,
    eta: float = 0.0,
    use_clipped_model_output: bool = False,
    generator: GeneratorLike = None,
    validate: bool = True,
) -> torch.Tensor:
    """One DDIM step x_t → x_s without a log-probability (evaluation-time sampling).

    Same math and arguments as `ddim_step_with_logprob`, but any η ≥ 0 is allowed (η = 0 is
    the deterministic DDIM sampler) and the zero-variance final step is fine.

    Returns:
        prev_sample (B, C, H, W) in `sample.dtype`.
    """
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got eta={eta}")
    mean, std, _ = ddim_mean_std(scheduler, model_output, timestep, sample, eta, use_clipped_model_output, validate)
    if eta == 0:
        return mean.to(sample.dtype)
    noise = draw_noise(sample.shape, generator, sample.device)
    return (mean + std * noise).to(sample.dtype)

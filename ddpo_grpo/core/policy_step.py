"""One denoising step of the policy, shared by sampling and training so both compute exactly the same
thing: the denoiser forward (with classifier-free guidance), then the scheduler step with its
log-probability, for either family (DDIM or flow-matching SDE).

Sampling calls it with `prev_sample=None` (draws the next latent); training calls it with the stored
`prev_sample` (scores it). Same weights, same CFG, same inputs => ratio exactly 1 on-policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from .families import ModelFamily, get_family


@dataclass
class StepResult:
    prev_sample: torch.Tensor  # (N, C, H, W), the sample's dtype
    log_prob: torch.Tensor  # (N,) float32
    mean: torch.Tensor  # (N, C, H, W) float32
    std: torch.Tensor  # broadcastable to mean, float32
    model_output: torch.Tensor  # (N, C, H, W) guided denoiser output


@dataclass
class SamplerSettings:
    """How the policy steps. `family` names the model family ("ddim" or "flow", see core.families); `eta` is
    for DDIM; `noise_level`/`sde_type` for flow models."""

    family: str = "ddim"
    guidance_scale: float = 1.0
    eta: float = 1.0
    noise_level: float = 0.7
    sde_type: str = "sde"
    noise_pool: int = 1  # flow "sde": step noise constant over noise_pool x noise_pool latent blocks (sde_with_logprob)


def denoiser_output(
    unet: torch.nn.Module,
    sample: torch.Tensor,
    timestep: torch.Tensor,
    embeds: torch.Tensor,
    neg_embeds: Optional[torch.Tensor],
    guidance_scale: float,
    cond_channels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Denoiser output with classifier-free guidance.

    sample (N, C, H, W); timestep (N,); embeds/neg_embeds (N, L, D); cond_channels (N, C', H, W) are
    concatenated to the input channels (image-conditioned models, e.g. recam's source view).
    With guidance the unconditional and conditional halves run as one batch of 2N, as in diffusers.
    """
    x = sample if cond_channels is None else torch.cat([sample, cond_channels.to(sample.dtype)], dim=1)
    if guidance_scale == 1.0 or neg_embeds is None:
        return unet(x, timestep, encoder_hidden_states=embeds).sample
    out = unet(
        torch.cat([x, x]), torch.cat([timestep, timestep]), encoder_hidden_states=torch.cat([neg_embeds, embeds])
    ).sample
    uncond, cond = out.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


def policy_step(
    unet: torch.nn.Module,
    scheduler,
    settings: SamplerSettings,
    sample: torch.Tensor,
    timestep: torch.Tensor,
    step_index: torch.Tensor,
    embeds: torch.Tensor,
    neg_embeds: Optional[torch.Tensor] = None,
    prev_sample: Optional[torch.Tensor] = None,
    generator: Union[None, torch.Generator, List[torch.Generator]] = None,
    cond_channels: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> StepResult:
    """Forward + scheduler step with log-prob. timestep (N,) are the denoiser's timestep values;
    step_index (N,) index the scheduler's schedule (flow models read sigmas by index). validate=False skips the
    step's own checks (std > 0, a defined step: host syncs on an accelerator) where the caller checked the schedule
    once (pipeline_with_logprob); the numbers are the same either way."""
    family = get_family(settings.family)  # an unknown name fails here, before the denoiser runs
    out = denoiser_output(unet, sample, timestep, embeds, neg_embeds, settings.guidance_scale, cond_channels)
    prev, logp, mean, std = family.step_with_logprob(scheduler, settings, out, timestep, step_index, sample,
                                                     prev_sample=prev_sample, generator=generator, validate=validate)
    return StepResult(prev, logp, mean, std, out)


def predicted_x0(family: Union[str, ModelFamily], scheduler, model_output: torch.Tensor, timestep: torch.Tensor,
                 step_index: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """The denoiser's estimate of the clean sample x̂0 at this step, (N, C, H, W) float32.

    model_output, sample (N, C, H, W); timestep (N,) denoiser timestep values; step_index (N,) schedule positions.
    DDIM: from epsilon / v / sample prediction with ᾱ_t. Flow: x̂0 = x − σ v (ModelFamily.predicted_x0).
    """
    return get_family(family).predicted_x0(scheduler, model_output, timestep, step_index, sample)


def schedule_stds(scheduler, settings: SamplerSettings, num_steps: int, sample_shape=(1, 1, 1)) -> torch.Tensor:
    """The policy's std at each of the num_steps steps, (num_steps,): it depends on the schedule, eta / noise level
    and the step only (ModelFamily.step_stds, no model); 0 where a step has no noise (never stored nor trained).
    sample_shape: unused, kept for callers."""
    return get_family(settings.family).step_stds(scheduler, settings, num_steps)

"""The whole denoising loop with per-step log-probabilities: a trajectory for GRPO.

Works for the DDIM family (UNet predicting epsilon / v / x0) and the flow-matching family (velocity
prediction, SDE sampling), with or without a VAE, text conditions or precomputed embeddings,
classifier-free guidance and an optional SDE window for flow models (steps outside the window run the
deterministic ODE and are neither stored nor trained).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from .families import get_family
from .policy_step import SamplerSettings, denoiser_output, policy_step


@dataclass
class Trajectory:
    """A batch of sampled trajectories. T is the number of stored (stochastic, trainable) steps.

    latents[:, j] is the input of stored step j and latents[:, j + 1] its output.
    """

    latents: torch.Tensor  # (B, T+1, C, H, W); video (B, T+1, C, F, H, W)
    log_probs: Optional[torch.Tensor]  # (B, T) float32; None for deterministic sampling
    timesteps: torch.Tensor  # (T,) denoiser timestep values of the stored steps
    step_indices: torch.Tensor  # (T,) long, positions of the stored steps in the schedule
    images: torch.Tensor  # (B, C, H, W) in [0, 1], float32; video: frames (B, F, C, H, W)
    pred_x0: Optional[torch.Tensor] = None  # (B, T, C, H, W) decoded x̂0 images in [0, 1] ((B, T, F, C, H, W) video)
    step_std: Optional[torch.Tensor] = None  # (T,) the policy's std at each stored step (same for every sample)


def encode_prompts(text_encoder, tokenizer, prompts: Sequence[str], device=None) -> torch.Tensor:
    """Token embeddings (B, L, D) of the prompts, padded to the tokenizer's max length (as SD does)."""
    ids = tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    device = device or next(text_encoder.parameters()).device
    return text_encoder(ids.to(device))[0]


def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) -> images in [0, 1] float32 (B, 3, H', W'); pixel models decode x in [-1, 1].
    As diffusers' pipelines: latents / scaling_factor (+ shift_factor where the VAE has one: SD3, FLUX), or, for a
    VAE with per-channel latents_mean / latents_std (Wan's AutoencoderKLWan), latents * std + mean as WanPipeline.
    Video latents (B, C, F, H, W) decode to frames (B, F', 3, H', W')."""
    if vae is not None:
        cfg = vae.config
        if getattr(cfg, "scaling_factor", None) is None and getattr(cfg, "latents_mean", None) is not None:
            shape = (1, -1) + (1,) * (latents.ndim - 2)
            mean = torch.tensor(cfg.latents_mean).view(shape).to(latents.device, latents.dtype)
            inv_std = 1.0 / torch.tensor(cfg.latents_std).view(shape).to(latents.device, latents.dtype)
            latents = vae.decode((latents / inv_std + mean).to(vae.dtype), return_dict=False)[0]  # as WanPipeline
        else:
            shift = getattr(cfg, "shift_factor", None) or 0.0
            latents = vae.decode(latents / cfg.scaling_factor + shift, return_dict=False)[0]
        if latents.ndim == 5:  # video (B, 3, F, H, W) -> frames (B, F, 3, H, W)
            latents = latents.permute(0, 2, 1, 3, 4)
    return (latents.float() / 2 + 0.5).clamp(0, 1)


def window_range(num_steps: int, window: Optional[Sequence[int]]) -> range:
    """Stored/trained steps: all of them, or the contiguous window [start, start + size)."""
    if window is None:
        return range(num_steps)
    start, size = window
    if not (0 <= start and size >= 1 and start + size <= num_steps):
        raise ValueError(f"SDE window (start={start}, size={size}) does not fit in {num_steps} steps")
    return range(start, start + size)


@torch.no_grad()
def pipeline_with_logprob(
    unet: torch.nn.Module,
    scheduler,
    settings: SamplerSettings,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor] = None,
    num_inference_steps: int = 20,
    latents: Optional[torch.Tensor] = None,
    sample_shape: Optional[Sequence[int]] = None,
    generator: Union[None, torch.Generator, List[torch.Generator]] = None,
    vae=None,
    return_pred_x0: bool = False,
    deterministic: bool = False,
    sde_window: Optional[Sequence[int]] = None,
    cond_channels: Optional[torch.Tensor] = None,
) -> Trajectory:
    """Sample B trajectories and their per-step log-probs.

    prompt_embeds (B, L, D); negative_prompt_embeds (B, L, D) for CFG (guidance_scale in settings);
    latents (B, C, H, W) initial noise, else drawn from `generator` with `sample_shape` (C, H, W).
    deterministic=True: DDIM eta=0 / flow ODE everywhere, no log-probs (evaluation).
    sde_window=(start, size): stochastic (stored) steps only there, deterministic elsewhere (flow ODE, DDIM eta 0).
    Returns a Trajectory whose latents are stored in the initial latents' dtype.
    """
    B = prompt_embeds.shape[0]
    device = prompt_embeds.device
    if latents is None:
        if isinstance(generator, list):
            latents = torch.stack([torch.randn(tuple(sample_shape), generator=g) for g in generator])
        else:
            latents = torch.randn((B, *sample_shape), generator=generator)
        latents = latents.to(device)
    family = get_family(settings.family)
    family.set_timesteps(scheduler, num_inference_steps)
    if sde_window is not None and not family.supports_sde_window:
        raise ValueError(f"sde_window does not apply to the {family.name} family")
    timesteps = scheduler.timesteps
    # Steps past the stochastic ones (CPS's zero-variance last step) run the ODE and are not stored.
    n_stochastic = family.stochastic_steps(len(timesteps), settings.sde_type)
    if sde_window is None:
        stored = range(len(timesteps)) if deterministic else range(n_stochastic)
    else:
        stored = window_range(n_stochastic, sde_window)
    all_latents, log_probs, x0s, stds = [], [], [], []
    for i, t in enumerate(timesteps):
        tt = t.expand(B).to(device)
        idx = torch.full((B,), i, dtype=torch.long)
        x_in = latents
        if i in stored and not deterministic:
            if i == stored.start:
                all_latents.append(latents)
            res = policy_step(unet, scheduler, settings, latents, tt, idx, prompt_embeds, negative_prompt_embeds,
                              generator=generator, cond_channels=cond_channels)
            out, latents = res.model_output, res.prev_sample
            log_probs.append(res.log_prob)
            stds.append(res.std.reshape(res.std.shape[0], -1)[:, 0].max())
            all_latents.append(latents)
        else:
            out = denoiser_output(unet, latents, tt, prompt_embeds, negative_prompt_embeds,
                                  settings.guidance_scale, cond_channels)
            new = family.ode_step(scheduler, out, tt, idx, latents)
            if i in stored and deterministic:
                if i == stored.start:
                    all_latents.append(latents)
                all_latents.append(new)
            latents = new
        if return_pred_x0 and i - 1 in stored:
            # Column i-1's x̂0 is predicted from step i-1's *output* (this step's input): it is what the action
            # of step i-1 led to. The prediction from step i-1's own input would not depend on its action, and
            # a per-step advantage built from it would carry no signal for that step.
            x0 = family.predicted_x0(scheduler, out, tt, idx, x_in)
            x0s.append(decode(vae, x0.to(latents.dtype)))
    if return_pred_x0 and len(timesteps) - 1 in stored:
        x0s.append(decode(vae, latents))  # the last step's output is the sample itself
    return Trajectory(
        latents=torch.stack(all_latents, dim=1),
        log_probs=None if deterministic else torch.stack(log_probs, dim=1),
        timesteps=timesteps[list(stored)].clone(),
        step_indices=torch.tensor(list(stored), dtype=torch.long),
        images=decode(vae, latents),
        pred_x0=torch.stack(x0s, dim=1) if return_pred_x0 else None,
        step_std=None if deterministic else torch.stack(stds).float().cpu(),
    )

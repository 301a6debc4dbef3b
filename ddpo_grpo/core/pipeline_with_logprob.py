"""The whole denoising loop with per-step log-probabilities: a trajectory for GRPO.

Works for the DDIM family (UNet predicting epsilon / v / x0) and the flow-matching family (velocity
prediction, SDE sampling), with or without a VAE, text conditions or precomputed embeddings,
classifier-free guidance and an optional SDE window (steps outside the window, and steps without noise for the
scheduler's settings, are deterministic and neither stored nor trained).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from .branching import BranchSpec
from .families import get_family
from .policy_step import SamplerSettings, denoiser_output, policy_step


@dataclass
class Trajectory:
    """A batch of sampled trajectories. T is the number of stored (stochastic, trainable) steps.

    Stored step j goes from state latents[:, transitions[j, 0]] to latents[:, transitions[j, 1]]: j -> j + 1 for a
    chain of consecutive steps (S = T + 1 states), 2j -> 2j + 1 for a branched tree, whose split steps need not be
    consecutive (S = 2T + 1 states; the last is the final sample).
    """

    latents: torch.Tensor  # (B, S, C, H, W); video (B, S, C, F, H, W)
    log_probs: Optional[torch.Tensor]  # (B, T) float32; None for deterministic sampling
    timesteps: torch.Tensor  # (T,) denoiser timestep values of the stored steps
    step_indices: torch.Tensor  # (T,) long, positions of the stored steps in the schedule
    images: torch.Tensor  # (B, C, H, W) in [0, 1], float32; video: frames (B, F, C, H, W)
    pred_x0: Optional[torch.Tensor] = None  # (B, T, C, H, W) decoded x̂0 images in [0, 1] ((B, T, F, C, H, W) video)
    step_std: Optional[torch.Tensor] = None  # (T,) the policy's std at each stored step (same for every sample)
    transitions: Optional[torch.Tensor] = None  # (T, 2) long: state indices of each stored step's input and output

    def __post_init__(self):
        if self.transitions is None:
            self.transitions = chain_transitions(len(self.step_indices))


def chain_transitions(T: int) -> torch.Tensor:
    """(T, 2) long: stored step j goes from state j to state j + 1 (consecutive steps)."""
    j = torch.arange(T, dtype=torch.long)
    return torch.stack([j, j + 1], dim=1)


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
    Video latents (B, C, F, H, W) decode to frames (B, F', 3, H', W').

    A latents_mean / latents_std VAE decodes in its own dtype with autocast off, as WanPipeline does (it casts the
    latents to vae.dtype and runs no autocast): models.base keeps Wan's VAE in float32 for that, and under the
    trainer's bf16 autocast its 3-D convolutions would otherwise still run in bf16. A parked VAE (core.offload:
    pretrained.offload) visits the latents' device for the decode."""
    from .offload import visiting

    if vae is not None:
        with visiting(vae, latents.device):
            latents = _decode(vae, latents)
    return (latents.float() / 2 + 0.5).clamp(0, 1)


def _decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """decode's VAE part: latents -> the VAE's output in [-1, 1] (video permuted to (B, F, 3, H, W))."""
    cfg = vae.config
    if getattr(cfg, "scaling_factor", None) is None and getattr(cfg, "latents_mean", None) is not None:
        import contextlib

        device = latents.device.type
        off = (torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device)
               else contextlib.nullcontext())
        with off:  # WanPipeline's order: cast to vae.dtype, then un-normalise in that dtype
            latents = latents.to(vae.dtype)
            mean, std = _latent_stats(cfg, latents)
            latents = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0]  # WanPipeline's form
    else:
        shift = getattr(cfg, "shift_factor", None) or 0.0
        latents = vae.decode(latents / cfg.scaling_factor + shift, return_dict=False)[0]
    if latents.ndim == 5:  # video (B, 3, F, H, W) -> frames (B, F, 3, H, W)
        latents = latents.permute(0, 2, 1, 3, 4)
    return latents


def _latent_stats(cfg, like: torch.Tensor):
    """(mean, std) of a latents_mean / latents_std VAE config, shaped to broadcast over (B, C, ...) like `like`."""
    shape = (1, -1) + (1,) * (like.ndim - 2)
    mean = torch.tensor(cfg.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(cfg.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


@torch.no_grad()
def encode_frames(vae, frames: torch.Tensor) -> torch.Tensor:
    """Frames (B, F, 3, H, W) in [0, 1] -> normalised latents (B, C, F', H', W'): the posterior mean, then
    (z - latents_mean) / latents_std, the inverse of `decode` for a latents_mean / latents_std VAE (Wan's), run in the
    VAE's dtype with autocast off as decode is. ReCamMaster conditions on a source clip encoded this way. A parked VAE
    (core.offload) visits the frames' device for the encode."""
    import contextlib

    from .offload import visiting

    cfg = vae.config
    if getattr(cfg, "latents_mean", None) is None:
        raise ValueError("encode_frames needs a VAE with latents_mean / latents_std (AutoencoderKLWan)")
    device = frames.device.type
    off = (torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device)
           else contextlib.nullcontext())
    with off, visiting(vae, frames.device):
        x = (frames.to(vae.dtype) * 2 - 1).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W) in [-1, 1]
        z = vae.encode(x).latent_dist.mean
        mean, std = _latent_stats(cfg, z)
        return (z - mean) / std


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
    branch: Optional[BranchSpec] = None,
) -> Trajectory:
    """Sample B trajectories and their per-step log-probs.

    prompt_embeds (B, L, D); negative_prompt_embeds (B, L, D) for CFG (guidance_scale in settings);
    latents (B, C, H, W) initial noise, else drawn from `generator` with `sample_shape` (C, H, W).
    deterministic=True: DDIM eta=0 / flow ODE everywhere, no log-probs (evaluation).
    sde_window=(start, size): stochastic (stored) steps only there, deterministic elsewhere (flow ODE, DDIM eta 0).
    branch: sample whole trees (core.branching): B = trees * L leaf rows, one condition per tree; latents / the draw
    are then the trees' x_T, (B // L, C, H, W). Only the split steps are stochastic and stored (T = D).
    Returns a Trajectory whose latents are stored in the initial latents' dtype.
    """
    if branch is not None:
        return _branched(unet, scheduler, settings, branch, prompt_embeds, negative_prompt_embeds,
                         num_inference_steps, latents, sample_shape, generator, vae, cond_channels)
    B = prompt_embeds.shape[0]
    device = prompt_embeds.device
    if latents is None:
        if isinstance(generator, list):
            latents = torch.stack([torch.randn(tuple(sample_shape), generator=g) for g in generator])
        else:
            latents = torch.randn((B, *sample_shape), generator=generator)
        latents = latents.to(device)
    family = get_family(settings.family)
    if sde_window is not None and not family.supports_sde_window:
        raise ValueError(f"sde_window does not apply to the {family.name} family")
    # Steps past the stochastic ones (a zero-noise step: DDIM's σ_t = 0, CPS's σ' = 0, and any after it) are
    # deterministic and not stored, as steps outside a window are (families.ModelFamily.stochastic_steps).
    # step_stds sets the schedule and evaluates every step's std, which is the check of the whole schedule that the
    # loop's steps then skip (validate=False: no host sync per step on an accelerator). Deterministic sampling
    # (evaluation) keeps the per-step checks: it evaluates no stds.
    if deterministic:
        family.set_timesteps(scheduler, num_inference_steps)
        n_stochastic = num_inference_steps
    else:
        schedule_stds = family.step_stds(scheduler, settings, num_inference_steps)
        n_stochastic = family.stochastic_count(schedule_stds)
    timesteps = scheduler.timesteps
    if sde_window is None:
        stored = range(len(timesteps)) if deterministic else range(n_stochastic)
    else:
        stored = window_range(n_stochastic, sde_window)
    if not deterministic:
        _check_stds(schedule_stds, stored, family.name)
    # The schedule and the step indices on the device once, not a host->device copy per step.
    steps_t, steps_i = timesteps.to(device), torch.arange(len(timesteps), dtype=torch.long, device=device)
    all_latents, log_probs, x0s, stds = [], [], [], []
    for i in range(len(timesteps)):
        tt, idx = steps_t[i].expand(B), steps_i[i].expand(B)
        x_in = latents
        if i in stored and not deterministic:
            if i == stored.start:
                all_latents.append(latents)
            res = policy_step(unet, scheduler, settings, latents, tt, idx, prompt_embeds, negative_prompt_embeds,
                              generator=generator, cond_channels=cond_channels, validate=False)
            out, latents = res.model_output, res.prev_sample
            log_probs.append(res.log_prob)
            stds.append(res.std.reshape(res.std.shape[0], -1)[:, 0].max())
            all_latents.append(latents)
        else:
            out = denoiser_output(unet, latents, tt, prompt_embeds, negative_prompt_embeds,
                                  settings.guidance_scale, cond_channels)
            new = family.ode_step(scheduler, out, tt, idx, latents, validate=deterministic)
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


def _check_stds(schedule_stds: torch.Tensor, stored, family: str) -> None:
    """The check the loop's steps skip, once for the schedule: every stored step has a finite positive std (host
    values, no device sync). stochastic_count already ends the stored steps before the first std of 0; a NaN or
    infinite std (a schedule outside what the families support) is named here instead of sampled."""
    bad = [i for i in stored if not (math.isfinite(float(schedule_stds[i])) and float(schedule_stds[i]) > 0)]
    if bad:
        raise ValueError(f"the {family} step {bad[0]} has std {float(schedule_stds[bad[0]])}: no log-probability; "
                         "the scheduler's settings give a step without a finite positive noise")


def _branched(unet, scheduler, settings: SamplerSettings, spec: BranchSpec, prompt_embeds, negative_prompt_embeds,
              num_inference_steps, latents, sample_shape, generator, vae, cond_channels) -> Trajectory:
    """pipeline_with_logprob with a tree per condition (see core.branching for the layout). Rows of the running
    state are the current depth's nodes, trees contiguous; at a split each node is repeated K times and takes the
    policy's stochastic step, so a shared trunk is computed once."""
    B, L, K, D = prompt_embeds.shape[0], spec.leaves, spec.branches, spec.depth
    if B % L:
        raise ValueError(f"{B} rows do not hold whole trees of {L} leaves")
    if isinstance(generator, list):
        raise ValueError("branched sampling draws from one generator, not a list")
    family = get_family(settings.family)
    if not family.supports_sde_window:  # deterministic steps between splits must keep the stochastic marginals
        raise ValueError(f"branched sampling does not apply to the {family.name} family")
    schedule_stds = family.step_stds(scheduler, settings, num_inference_steps)  # sets the schedule, checks every step
    spec.check(family.stochastic_count(schedule_stds))
    _check_stds(schedule_stds, spec.steps, family.name)
    timesteps = scheduler.timesteps
    device = prompt_embeds.device
    steps_t, steps_i = timesteps.to(device), torch.arange(len(timesteps), dtype=torch.long, device=device)
    if latents is None:
        latents = torch.randn((B // L, *sample_shape), generator=generator).to(device)
    if latents.shape[0] != B // L:
        raise ValueError(f"branched sampling takes one x_T per tree: {B // L}, got {latents.shape[0]}")

    # the first leaf row under each node at `depth`: its condition is the node's (made once per depth, not per step)
    rows = [torch.arange(B // spec.leaves_below(d), device=device) * spec.leaves_below(d) for d in range(D + 1)]
    node_inputs = {}

    def at(x, depth):
        if x is None:
            return None
        key = (id(x), depth)  # the conditions are the same tensors at every step of a depth
        if key not in node_inputs:
            node_inputs[key] = x[rows[depth]]
        return node_inputs[key]

    def to_leaves(x, depth):  # node rows at `depth` -> one row per leaf
        return x.repeat_interleave(spec.leaves_below(depth), dim=0)

    states, log_probs, stds = [], [], []
    depth = 0
    for i in range(len(timesteps)):
        n = latents.shape[0]
        if depth < D and i == spec.steps[depth]:
            parent = latents.repeat_interleave(K, dim=0)
            res = policy_step(unet, scheduler, settings, parent, steps_t[i].expand(n * K), steps_i[i].expand(n * K),
                              at(prompt_embeds, depth + 1), at(negative_prompt_embeds, depth + 1),
                              generator=generator, cond_channels=at(cond_channels, depth + 1), validate=False)
            latents = res.prev_sample
            states += [to_leaves(parent, depth + 1), to_leaves(latents, depth + 1)]
            log_probs.append(to_leaves(res.log_prob, depth + 1))
            stds.append(res.std.reshape(res.std.shape[0], -1)[:, 0].max())
            depth += 1
        else:
            tt, idx = steps_t[i].expand(n), steps_i[i].expand(n)
            out = denoiser_output(unet, latents, tt, at(prompt_embeds, depth), at(negative_prompt_embeds, depth),
                                  settings.guidance_scale, at(cond_channels, depth))
            latents = family.ode_step(scheduler, out, tt, idx, latents, validate=False)
    states.append(latents)
    return Trajectory(
        latents=torch.stack(states, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        timesteps=timesteps[list(spec.steps)].clone(),
        step_indices=torch.tensor(spec.steps, dtype=torch.long),
        images=decode(vae, latents),
        step_std=torch.stack(stds).float().cpu(),
        transitions=torch.stack([torch.arange(D) * 2, torch.arange(D) * 2 + 1], dim=1),
    )

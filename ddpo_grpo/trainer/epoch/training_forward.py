"""Step 5 of the epoch for the forward-process objectives (`train.objective` "raft" or "nft"): the same
sampler, rewards, advantages and live check as GRPO, then the denoising loss on the sampled images
(forward_loss.py says what each objective weights).

The call plan mirrors GRPO's so the two cost the same: every sample is trained at as many noise levels as
GRPO trains steps (update.steps_per_sample: the trainable columns x train.timestep_fraction), one noise
level per row, `train.batch_size` rows per call, and one optimizer step per `gradient_accumulation_steps` x
that many calls. Every process runs the same number of calls whatever its weights (rows of weight 0
contribute zero), so DDP never waits.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import numpy as np
import torch

from .advantages import EpochAdvantages
from ddpo_grpo.core.policy_step import denoiser_output
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.core.families import get_family
from ddpo_grpo.core.forward_loss import best_of_group, nft_loss, nft_optimality, raft_loss
from .sampling import EpochSamples
from .metrics import EpochMetrics
from .update import optimizer_step, steps_per_sample, trainable_columns, zero_loss


def final_x0(samples: EpochSamples, pipe, num_steps: int) -> torch.Tensor:
    """The sampled clean samples (N, C, H, W) in the denoiser's space: the last stored latent when every step
    was stored; pixel models without that can re-encode their images ([0, 1] -> [-1, 1])."""
    if samples.latents.shape[1] == num_steps + 1:
        return samples.latents[:, -1]
    if pipe.vae is None:
        return samples.images * 2 - 1
    raise ConfigError("train.objective raft/nft needs the final latents: set sample.sde_window_size=0")


def sample_weights(config, adv: EpochAdvantages, eps: float, rank: int, n: int):
    """This process's (n,) row weights and (n,) optimality r, from the epoch's gathered arrays (groups span
    processes, so the best of a group is chosen on all of them). raft: weight N_total / n_best on each group's
    best sample (so the loss is the mean over the chosen samples), else 0. nft: weight 1 on every trained sample."""
    if config.train.objective == "raft":
        best = best_of_group(adv.keys_all, adv.rewards_all, adv.mask_all, eps)
        w = best * (len(best) / max(int(best.sum()), 1))
        r = np.ones(len(best))
    else:
        w = adv.mask_all.astype(np.float64)
        r = nft_optimality(adv.advantages_all, config.train.nft_adv_scale)
    lo = rank * n
    return (torch.from_numpy(w[lo:lo + n]).float(), torch.from_numpy(r[lo:lo + n]).float(),
            float((w > 0).sum()))


def train_epoch_forward(ctx, samples: EpochSamples, adv: EpochAdvantages, epoch: int) -> Dict[str, float]:
    """num_inner_epochs passes of the forward-process objective. Returns the epoch's metrics over every process
    (metrics.METRIC_RULES): loss (the mean over every trained row), grad_norm, the counts, chosen_samples, lr."""
    config, acc = ctx.config, ctx.accelerator
    device = acc.device
    N = len(samples)
    n_levels = steps_per_sample(len(trainable_columns(samples, config)), config)
    weight, r, n_chosen = sample_weights(config, adv, ctx.stat_tracker.eps, acc.process_index, N)
    x0 = final_x0(samples, ctx.pipe, config.sample.num_steps).float()
    family = get_family(ctx.pipe.family)  # the forward process and its target
    params = [p for p in ctx.unet.parameters() if p.requires_grad]
    metrics = EpochMetrics()
    metrics.add("chosen_samples", n_chosen)
    for inner in range(config.train.num_inner_epochs):
        # Rows (sample, noise level, noise): a function of (seed, epoch, inner, rank) only, so a resumed run
        # repeats them exactly.
        rng = np.random.default_rng((config.seed, epoch, inner, acc.process_index, 29))
        rows = rng.permutation(np.repeat(np.arange(N), n_levels))
        lo, hi = config.train.get("forward_noise_min", 0.0), config.train.get("forward_noise_max", 1.0)
        u = torch.from_numpy(lo + (hi - lo) * rng.random(len(rows))).float()  # noise levels in [min, max)
        g = torch.Generator().manual_seed(int(rng.integers(2**62)))
        noise = torch.randn((len(rows),) + tuple(x0.shape[1:]), generator=g)
        old = _old_predictions(ctx, samples, x0, rows, u, noise) if config.train.objective == "nft" else None
        calls = [np.arange(lo, min(lo + config.train.batch_size, len(rows)))
                 for lo in range(0, len(rows), config.train.batch_size)]
        group = config.train.gradient_accumulation_steps * n_levels
        ctx.unet.train()
        for start in range(0, len(calls), group):
            chunk = calls[start:start + group]
            for ci, j in enumerate(chunk):
                i = torch.from_numpy(rows[j])
                sync = contextlib.nullcontext() if ci == len(chunk) - 1 else acc.no_sync(ctx.unet)
                with sync:
                    xt, t, target = family.noised_and_target(ctx.pipe.scheduler, x0[i].to(device),
                                                             noise[j].to(device), u[j].to(device))
                    with acc.autocast():
                        pred = denoiser_output(ctx.unet, xt, t, samples.embeds[i].to(device), None, 1.0,
                                               None if samples.cond_channels is None else samples.cond_channels[i].to(device))
                    w = weight[i].to(device)
                    if old is None:
                        loss = raft_loss(pred, target, w)
                    else:
                        loss = nft_loss(pred, old[j].to(device), target, r[i].to(device), config.train.nft_beta, w)
                    if torch.isfinite(loss):
                        metrics.add("loss", loss.item(), len(j))  # a mean over the call's rows
                    else:
                        metrics.add("nonfinite_loss", 1.0)
                        loss = zero_loss(params)
                    acc.backward(loss / len(chunk))
            optimizer_step(ctx, params, metrics)
    if ctx.old_policy is not None:  # DiffusionNFT's soft update: theta_old <- d*theta_old + (1-d)*theta
        ctx.old_policy.step(acc.unwrap_model(ctx.unet))
    metrics.add("lr", ctx.lr_scheduler.get_last_lr()[0])
    return metrics.reduce(acc)


@torch.no_grad()
def _old_predictions(ctx, samples, x0, rows, u, noise) -> torch.Tensor:
    """The sampling policy's outputs (R, C, H, W) on every row, before this pass's first update: DiffusionNFT's
    v_old (theta_old's when train.nft_old_decay > 0, else the policy's own). Computed once per pass, in eval mode,
    on CPU memory."""
    config, device = ctx.config, ctx.accelerator.device
    ctx.unet.eval()
    out = []
    with ctx.sampling_policy():  # theta_old swapped in once for the whole pass
        for lo in range(0, len(rows), config.eval.batch_size):
            j = np.arange(lo, min(lo + config.eval.batch_size, len(rows)))
            i = torch.from_numpy(rows[j])
            xt, t, _ = get_family(ctx.pipe.family).noised_and_target(ctx.pipe.scheduler, x0[i].to(device),
                                                                     noise[j].to(device), u[j].to(device))
            with ctx.accelerator.autocast():
                out.append(denoiser_output(ctx.unet, xt, t, samples.embeds[i].to(device), None, 1.0,
                                           None if samples.cond_channels is None else samples.cond_channels[i].to(device)
                                           ).float().cpu())
    return torch.cat(out)

"""The old log-probs of the clipped ratio, and the rows of a training call (used by training.py and by the re-score).

Why re-score: the ratio exp(logp - logp_old) must be exactly 1 before an epoch's first update, but the sampler scores
a transition in its own batch (B rows, CFG-doubled) and training scores it again in a call of another shape (b x S
rows). On a GPU/NPU the kernels are chosen per batch shape, so in bf16 the two differ by ~1e-3 (H100, SD 1.5 shape):
ten times DDPO's clip range 1e-4, which clips about half the samples of the sampling policy itself at random. With
`train.old_logprobs = "rescore"` the old log-probs come from a pass through exactly the training path (the epoch's call
plan and row grouping for every inner epoch, CFG concatenation, autocast, train mode, attention backend) before the
first update, so the ratio of the first calls is 1 by construction (the LLM trainers' fix: verl, RLinf). What remains
between sampler and trainer is reported (`sampler_gap`), and can be corrected by a truncated importance weight
(`train.sampler_is_cap`, Yao et al.'s rollout correction).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ddpo_grpo.core.policy_step import StepResult, policy_step
from ddpo_grpo.errors import ConfigError

OLD_LOGPROBS = ("auto", "rescore", "sampling")


VERIFY_EVERY_DEFAULT = 10  # train.old_logprobs_verify_every when a hand-built config lacks it


def check_old_logprobs_config(config) -> None:
    """train.old_logprobs is one of OLD_LOGPROBS, train.old_logprobs_verify_every an integer >= 0 and
    train.sampler_is_cap 0 (off) or > 0 (validate_config: one line before anything loads). The cap needs the
    re-scored log-probs, so "sampling" with a cap is refused."""
    mode = config.train.get("old_logprobs", "auto")
    if mode not in OLD_LOGPROBS:
        raise ConfigError(f"train.old_logprobs={mode!r}; choose one of {OLD_LOGPROBS}")
    every = config.train.get("old_logprobs_verify_every", VERIFY_EVERY_DEFAULT)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(f"train.old_logprobs_verify_every={every!r} must be an integer >= 0 (epochs between the "
                          "re-scores that re-verify the sampler's log-probs under 'auto'; 0 = verify the first only)")
    cap = float(config.train.get("sampler_is_cap", 0.0))
    if not cap >= 0:
        raise ConfigError(f"train.sampler_is_cap={cap}; 0 (off) or the cap C > 0 of min(pi_trainer / pi_sampler, C)")
    if cap > 0 and mode == "sampling":
        raise ConfigError("train.sampler_is_cap > 0 weighs each transition by pi_trainer / pi_sampler, which needs "
                          "the re-scored log-probs: set train.old_logprobs='rescore' (or 'auto')")


def old_logprobs_source(config, epoch: int = 0, history: Optional[list] = None, mismatch: bool = False) -> str:
    """Where this epoch's old log-probs come from: "rescore" or "sampling". "auto" re-scores the run's first epoch
    (a verification: the re-score through the training calls against the sampler's log-probs), and while every
    verification found them equal bit for bit keeps the sampler's, re-verifying every
    train.old_logprobs_verify_every epochs (0: never again) and whenever the sampler's settings differ from the
    training's (mismatch); once a verification found them different it re-scores every epoch for good (kernels
    chosen per call shape, or rounding, differ between the two paths). train.sampler_is_cap > 0 always re-scores
    (the weight needs both). history: the run's epoch entries (RunState.history, saved with each checkpoint, so a
    resumed run decides as the uninterrupted one), whose "train" holds old_logprobs_bit_exact for each verification."""
    mode = config.train.get("old_logprobs", "auto")
    if mode != "auto":
        return mode
    if float(config.train.get("sampler_is_cap", 0.0)) > 0 or mismatch:
        return "rescore"
    verified = [(int(h.get("epoch", 0)), h["train"]["old_logprobs_bit_exact"]) for h in (history or [])
                if "old_logprobs_bit_exact" in h.get("train", {})]
    if not verified or any(v != 1.0 for _, v in verified):
        return "rescore"
    every = int(config.train.get("old_logprobs_verify_every", VERIFY_EVERY_DEFAULT))
    if every > 0 and epoch - verified[-1][0] >= every:
        return "rescore"
    return "sampling"


def old_logprobs_counts(history: Optional[list], rescored_now: bool) -> Dict[str, float]:
    """The run's counts so far, this epoch included: old_logprobs_rescored_epochs (epochs whose re-score pass ran)
    and old_logprobs_sampler_epochs (epochs trained on the sampler's log-probs without one), from the history's
    per-epoch old_logprobs_rescored (GRPO epochs only)."""
    flags = [h["train"]["old_logprobs_rescored"] for h in (history or [])
             if "old_logprobs_rescored" in h.get("train", {})] + [1.0 if rescored_now else 0.0]
    n = sum(1 for f in flags if f == 1.0)
    return {"old_logprobs_rescored_epochs": float(n), "old_logprobs_sampler_epochs": float(len(flags) - n)}


SETTING_FIELDS = ("family", "guidance_scale", "eta", "noise_level", "sde_type")


def settings_mismatch(sampled, trained, config=None) -> str:
    """How the training calls' SamplerSettings differ from the sampler's, in words ('' when they agree): the call
    plan's arguments compared, the cheap half of the sampler/trainer check (the measured gap is the other)."""
    if sampled is None:
        return ""
    out = []
    for f in SETTING_FIELDS:
        a, b = getattr(sampled, f), getattr(trained, f)
        if a != b:
            why = (" (train.cfg=False)" if f == "guidance_scale" and config is not None
                   and not config.train.get("cfg", True) else "")
            out.append(f"{f} {a!r} when sampling, {b!r} in training{why}")
    return "; ".join(out)


def worst_gap(tables: List[torch.Tensor], sampler: torch.Tensor, mask: Optional[torch.Tensor] = None
              ) -> Tuple[float, int, int]:
    """(max |logp_rescored - logp_sampler|, its sample, its column) over every planned, kept cell of every inner
    epoch's re-scored table (tables: (N, T) each, NaN where not planned; sampler (N, T); mask (N,) or (N, T)), as
    exp(gap) - 1: the |r - 1| the sampler's log-probs would give that transition before any update. (-1.0, 0, 0)
    when no cell was scored. 0.0 exactly when the two agree bit for bit."""
    best = (-1.0, 0, 0)
    s = sampler.detach().double().cpu()
    for table in tables:
        d = (table.detach().double().cpu() - s).abs()
        ok = ~torch.isnan(d)
        if mask is not None:
            ok &= (mask[:, None] if mask.ndim == 1 else mask).cpu()
        d = torch.where(ok, d, torch.full_like(d, -1.0))
        j = int(d.argmax())
        v = float(d.reshape(-1)[j])
        if v > best[0]:
            best = (v, j // d.shape[1], j % d.shape[1])
    return (best[0] if best[0] <= 0 else float(np.expm1(best[0])), best[1], best[2])


def call_inputs(ctx, settings, samples, idx, cols):
    """The rows of one call: samples idx (b,) at timestep columns cols (b, S), stacked to b*S rows.
    Returns (rows (b*S,), columns (b*S,), policy_step's inputs (x, prev_sample, t, step_index, embeds,
    neg_embeds, cond_channels))."""
    device = ctx.accelerator.device
    S = cols.shape[1]
    rows = idx.repeat_interleave(S)
    c = cols.reshape(-1)
    src, dst = samples.step_states(c)
    x = samples.latents[rows, src].to(device)
    nxt = samples.latents[rows, dst].to(device)
    t = samples.timesteps[c].to(device)
    si = samples.step_indices[c]
    emb = samples.embeds[rows].to(device)
    neg = samples.neg_embeds[rows].to(device) if samples.neg_embeds is not None and settings.guidance_scale != 1.0 else None
    cond = samples.cond_channels[rows].to(device) if samples.cond_channels is not None else None
    return rows, c, (x, nxt, t, si, emb, neg, cond)


def score(ctx, settings, inputs) -> StepResult:
    """policy_step on a call's stored transitions (x_t -> x_prev, from call_inputs) with the unet's current
    weights: the policy's log-probs and means, or the reference's when it is swapped in."""
    x, nxt, t, si, emb, neg, cond = inputs
    return policy_step(ctx.unet, ctx.pipe.scheduler, settings, x, t, si, emb, neg, prev_sample=nxt,
                       cond_channels=cond)


@torch.no_grad()
def rescore_old_logprobs(ctx, settings, samples, plan) -> List[torch.Tensor]:
    """The old log-probs of every inner epoch's calls, scored before the epoch's first update through the call
    plan that inner epoch will train with. plan: the epoch's update.CallPlan, whose calls[inner] (lists of (sample
    indices (b,), columns (b, S))) train_epoch runs exactly as given. Returns one (N, T) float32 CPU tensor per inner
    epoch: the policy's log-prob of each planned transition, NaN where the plan has none; on samples.log_probs'
    device (the sampler leaves them on the accelerator), so old_table[rows, c] indexes like samples.log_probs does.

    The forward is the training call's: the same rows in the same order (call_inputs), the module in train mode as
    train_epoch leaves it, accelerate's autocast, the same attention backend (the model's processors and the run's
    SDPA setting apply to every call). Only autograd is off; the log-prob math is float32 either way."""
    N, T = samples.log_probs.shape
    where = samples.log_probs.device
    out = []
    for calls in plan.calls:
        old = torch.full((N, T), float("nan"), device=where)
        for idx, cols in calls:
            rows, c, inputs = call_inputs(ctx, settings, samples, idx, cols)
            with ctx.accelerator.autocast():
                res = score(ctx, settings, inputs)
            old[rows.to(where), c.to(where)] = res.log_prob.detach().float().to(where)
        out.append(old)
    return out


def sampler_gap(rescored: torch.Tensor, sampler: torch.Tensor, mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|logp_rescored - logp_sampler| per stored column: (max (T,), sum (T,), count (T,)) over the re-scored cells
    (rescored (N, T), NaN where not scored; sampler (N, T)); mask (N,) or (N, T) bool keeps only the trained rows
    (excluded samples never reach the loss). Sums and counts, not means, so processes combine exactly."""
    d = (rescored.detach().double().cpu() - sampler.detach().double().cpu()).abs()  # wherever each was left
    ok = ~torch.isnan(d)
    if mask is not None:
        ok &= (mask[:, None] if mask.ndim == 1 else mask).cpu()
    dz = torch.where(ok, d, torch.zeros_like(d))
    mx = torch.where(ok, d, torch.full_like(d, -1.0)).max(dim=0).values  # -1: no cell scored in that column
    return mx, dz.sum(dim=0), ok.sum(dim=0).double()


def gather_sampler_gap(accelerator, mx: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> Dict[str, float]:
    """sampler_gap over every process: the epoch's max and mean, and per stored column (sampler_gap_max/step_XX,
    sampler_gap_mean/step_XX) for the columns any process scored. One gather: a collective, every process calls it."""
    device = accelerator.device
    dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64
    local = torch.stack([mx, total, count]).to(device=device, dtype=dtype)  # (3, T)
    allp = accelerator.gather(local.reshape(1, -1)).double().cpu().reshape(-1, 3, local.shape[1])
    mx, total, count = allp[:, 0].max(dim=0).values, allp[:, 1].sum(dim=0), allp[:, 2].sum(dim=0)
    out = {}
    if count.sum() > 0:
        out["sampler_gap_max"] = float(mx.max())
        out["sampler_gap_mean"] = float(total.sum() / count.sum())
    for t in range(len(count)):
        if count[t] > 0:
            out[f"sampler_gap_max/step_{t:02d}"] = float(mx[t])
            out[f"sampler_gap_mean/step_{t:02d}"] = float(total[t] / count[t])
    return out


def truncated_is_weight(rescored: torch.Tensor, sampler: torch.Tensor, cap: float) -> torch.Tensor:
    """train.sampler_is_cap: min(exp(logp_rescored - logp_sampler), cap) per transition (same shape), detached: the
    truncated importance weight of the trainer's policy over the sampler's for the transition the sampler drew
    (the gradient of the clipped loss stays the trainer's; this only reweighs samples the sampler over- or
    under-drew). cap <= 0 is an error here: the caller leaves it off instead."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(rescored.double() - sampler.to(rescored.device).double()).clamp(max=cap).float().detach()

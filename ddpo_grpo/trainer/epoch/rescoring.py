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

import torch

from ddpo_grpo.core.policy_step import StepResult, policy_step
from ddpo_grpo.errors import ConfigError

OLD_LOGPROBS = ("auto", "rescore", "sampling")


def check_old_logprobs_config(config) -> None:
    """train.old_logprobs is one of OLD_LOGPROBS and train.sampler_is_cap is 0 (off) or > 0 (validate_config: one line
    before anything loads). The cap needs the re-scored log-probs, so "sampling" with a cap is refused."""
    mode = config.train.get("old_logprobs", "auto")
    if mode not in OLD_LOGPROBS:
        raise ConfigError(f"train.old_logprobs={mode!r}; choose one of {OLD_LOGPROBS}")
    cap = float(config.train.get("sampler_is_cap", 0.0))
    if not cap >= 0:
        raise ConfigError(f"train.sampler_is_cap={cap}; 0 (off) or the cap C > 0 of min(pi_trainer / pi_sampler, C)")
    if cap > 0 and mode == "sampling":
        raise ConfigError("train.sampler_is_cap > 0 weighs each transition by pi_trainer / pi_sampler, which needs "
                          "the re-scored log-probs: set train.old_logprobs='rescore' (or 'auto')")


def old_logprobs_source(config, reduced_precision: bool, accelerator_device: bool) -> str:
    """Where the ratio's old log-probs come from in this run: "rescore" or "sampling". "auto" re-scores wherever the run
    computes in reduced precision (bf16, fp16, TF32, HF32) or on an accelerator (kernels chosen per batch shape), or
    when train.sampler_is_cap needs it; it keeps the sampler's in float32 on a CPU, where each row is computed on its
    own (|r - 1| <= 1.7e-6 measured: summation order only) and the re-score would cost a forward per trained step."""
    mode = config.train.get("old_logprobs", "auto")
    if mode != "auto":
        return mode
    if reduced_precision or accelerator_device or float(config.train.get("sampler_is_cap", 0.0)) > 0:
        return "rescore"
    return "sampling"


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
def rescore_old_logprobs(ctx, settings, samples, plans: List[list]) -> List[torch.Tensor]:
    """The old log-probs of every inner epoch's calls, scored before the epoch's first update through the call
    plan that inner epoch will train with. plans: one call plan per inner epoch, each a list of (sample indices (b,),
    columns (b, S)) exactly as train_epoch runs them. Returns one (N, T) float32 CPU tensor per inner epoch: the
    policy's log-prob of each planned transition, NaN where the plan has none; on samples.log_probs' device (the
    sampler leaves them on the accelerator), so old_table[rows, c] indexes like samples.log_probs does.

    The forward is the training call's: the same rows in the same order (call_inputs), the module in train mode as
    train_epoch leaves it, accelerate's autocast, the same attention backend (the model's processors and the run's
    SDPA setting apply to every call). Only autograd is off; the log-prob math is float32 either way."""
    N, T = samples.log_probs.shape
    where = samples.log_probs.device
    out = []
    for plan in plans:
        old = torch.full((N, T), float("nan"), device=where)
        for idx, cols in plan:
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

"""Step 5 of the epoch: the clipped-ratio GRPO update over the epoch's samples and timesteps.

Each process runs exactly the same number of forward/backward calls and optimizer steps whatever its
mask (excluded samples contribute zero), so DDP never waits on a process that skipped a step.
Gradients are averaged over samples x trained timesteps within an optimizer step.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict

import numpy as np
import torch

from ddpo_grpo.core.loss import KLInputs, grpo_loss, kl_penalty
from .sampling import EpochSamples, sampler_settings
from .advantages import EpochAdvantages
from .metrics import EpochMetrics
from .rescoring import (call_inputs, gather_sampler_gap, old_logprobs_counts, rescore_old_logprobs, sampler_gap,
                        score, settings_mismatch, truncated_is_weight, worst_gap)
from .update import (optimizer_step, plan_epoch, probe_sizes, schedule_decay, step_weights, steps_per_sample,
                     untrained_columns, zero_loss)
from ..checks.onpolicy import check_onpolicy, check_sampler_gap, gather_worst, run_old_logprobs


def probe_timesteps_per_call(ctx, samples: EpochSamples, settings) -> int:
    """`train.timesteps_per_call = 0` (auto): time one forward+backward of b x S rows for S = 1, 2, 4, 8 and T_train on this
    epoch's samples and keep the S with the lowest time per sample-step. Gradients are discarded."""
    import time

    config = ctx.config
    N, T = samples.log_probs.shape
    T_train = steps_per_sample(T, config)
    b = min(config.train.batch_size, N)
    adv = torch.zeros(N)
    mask = torch.ones(N, dtype=torch.bool)
    params = [p for p in ctx.unet.parameters() if p.requires_grad]
    best, best_t = 1, float("inf")
    for S in probe_sizes(T_train):
        idx = torch.arange(b)
        cols = torch.stack([torch.arange(S) % T for _ in range(b)])
        times = []
        for _ in range(2):  # the first call pays for allocation; keep the faster
            t0 = time.perf_counter()
            loss, _, _ = _call_loss(ctx, settings, samples, adv.to(ctx.accelerator.device),
                                    mask.to(ctx.accelerator.device), idx, cols, None, params, samples.log_probs)
            loss.backward()
            times.append((time.perf_counter() - t0) / (b * S))
        ctx.optimizer.zero_grad(set_to_none=True)
        if min(times) < best_t:
            best, best_t = S, min(times)
    return best


def train_epoch(ctx, samples: EpochSamples, adv: EpochAdvantages, epoch: int) -> Dict[str, float]:
    """Run num_inner_epochs passes of the update: the clipped-ratio GRPO loss, or for `train.objective` "raft" /
    "nft" the forward-process objectives (training_forward.py). Returns the epoch's metrics over every process
    (METRIC_RULES), the same on every process."""
    config, acc = ctx.config, ctx.accelerator
    if config.train.get("objective", "grpo") != "grpo":  # hand-built configs without the field train GRPO
        from .training_forward import train_epoch_forward

        return train_epoch_forward(ctx, samples, adv, epoch)
    settings = sampler_settings(config, ctx.pipe.family)
    if not config.train.cfg:
        settings.guidance_scale = 1.0
    N = samples.log_probs.shape[0]
    params = [p for p in ctx.unet.parameters() if p.requires_grad]
    device = acc.device
    advantages = adv.advantages.to(device)
    # Branched sampling trains cells (sample, column), each transition once: the mask is (N, T) then.
    mask = (adv.train_mask if adv.cell_mask is None else adv.cell_mask).to(device)
    clip_high = config.train.clip_range_high if config.train.clip_range_high >= 0 else None
    metrics = EpochMetrics()
    ctx.unet.train()
    per_call = int(config.train.timesteps_per_call)
    if adv.cell_mask is not None:
        per_call = 1  # one column per row: a call is train.batch_size cells
    elif per_call == 0:  # auto: probed once, kept in the run state (a resumed run must make the same choice)
        if not ctx.state.timesteps_per_call:
            probe = torch.tensor(probe_timesteps_per_call(ctx, samples, settings), device=device)
            ctx.state.timesteps_per_call = int(acc.gather(probe.reshape(1)).max())  # every process must agree
        per_call = ctx.state.timesteps_per_call
    first = None  # (idx, cols, step mean, std) of the epoch's first call, under the sampling policy
    worst = (-1.0, 0, 0)  # (max |r - 1|, sample, column) of the calls before the first optimizer step
    untrained = untrained_columns(samples, config) if config.train.get("kl_steps", "trained") == "all" else None
    # every inner epoch's call plan, fixed before the first update (the re-score scores exactly these)
    owners = None if adv.cell_mask is None else torch.from_numpy(ctx.tree.owner_cells(N))
    plan = plan_epoch(samples, config, epoch, acc.process_index, per_call, owners)
    # the call plan's arguments: the training calls' settings against the sampler's (train.cfg=False with guidance)
    mismatch = settings_mismatch(getattr(samples, "settings", None), settings, config)
    history = getattr(ctx.state, "history", [])
    rescored = run_old_logprobs(config, acc, epoch, history, bool(mismatch)) == "rescore"
    checked, gap = False, {}  # checked: the sampler/trainer check has already spoken for this epoch
    old_tables = [samples.log_probs] * len(plan.calls)
    if rescored:  # train.old_logprobs: the ratio's old log-probs through the training calls themselves (rescoring.py)
        old_tables = rescore_old_logprobs(ctx, settings, samples, plan)
        gap = gather_sampler_gap(acc, *sampler_gap(old_tables[0], samples.log_probs, mask))
        worst_cell = gather_worst(acc, worst_gap(old_tables, samples.log_probs, mask), samples)
        gap["old_logprobs_bit_exact"] = float(worst_cell[0] == 0.0)  # every trained cell equal bit for bit
        said = check_sampler_gap(ctx, worst_cell, epoch, mismatch)  # stops here under "stop"
        if said is not None and config.train.get("old_logprobs", "auto") == "auto":
            # "warn" on a real mismatch: the re-score would hide it (ratio 1 by construction); auto trains on the
            # sampler's log-probs instead, so the ratio shows it, as it does without a re-score
            old_tables, checked = [samples.log_probs] * len(plan.calls), True
        elif config.train.get("old_logprobs", "auto") == "auto":
            note_auto(ctx, epoch, history, worst_cell[0])
    cap = float(config.train.get("sampler_is_cap", 0.0))
    step_w = step_weights(samples, config, plan.columns)  # train.step_weight_power (None: every trained step 1)
    per_mb = plan.calls_per_microbatch
    for inner, calls in enumerate(plan.calls):
        if untrained is not None:  # which untrained step each sample gets: seeded like the call plan
            g = torch.Generator().manual_seed(int(np.random.default_rng((config.seed, epoch, inner, acc.process_index, 5))
                                                  .integers(2**62)))
        group = config.train.gradient_accumulation_steps * per_mb
        for start in range(0, len(calls), group):
            chunk = calls[start:start + group]
            for ci, (idx, cols) in enumerate(chunk):
                last = ci == len(chunk) - 1
                sync = contextlib.nullcontext() if last else acc.no_sync(ctx.unet)
                if untrained is not None and len(untrained) and ci % per_mb == 0:
                    # Once per micro-batch, each of its samples at one random step the gradient never trains. Its
                    # own backward, never the synchronising one: the reference is swapped into the weights in
                    # place, which must not happen while another call's graph waits for its backward.
                    ucols = untrained[torch.randint(len(untrained), (len(idx), 1), generator=g)]
                    with acc.no_sync(ctx.unet):
                        kl_u = untrained_kl(ctx, settings, samples, idx, ucols)
                        acc.backward(config.train.beta * kl_u / len(chunk))
                    metrics.add("kl_untrained", float(kl_u.detach()), len(idx))
                with sync:
                    loss, m, res = _call_loss(ctx, settings, samples, advantages, mask, idx, cols, clip_high, params,
                                              old_tables[inner], cap if old_tables[inner] is not samples.log_probs
                                              else 0.0, step_w)
                    acc.backward(loss / len(chunk))
                rows = m.pop("_rows", 0.0)
                ratio_dev, ratio_at = m.pop("_ratio_dev", None), m.pop("_ratio_worst", None)
                for key, v in m.items():  # grpo_loss's means over the call's kept rows; loss_sup one per call
                    metrics.add(key, v, 1.0 if key == "loss_sup" else rows)
                if inner == 0 and start == 0:
                    # No optimizer step has happened yet in this epoch: the policy is the sampling policy.
                    if ratio_dev is not None:
                        metrics.add("onpolicy_ratio_max_dev", ratio_dev)
                        if ratio_dev > worst[0]:
                            worst = (ratio_dev, *ratio_at)
                    if ci == 0:
                        first = (idx, cols, res.mean.detach().float(), res.std.detach())
            if inner == 0 and start == 0:  # before the first update: a mismatch stops here (train.onpolicy_check)
                if not checked:
                    check_onpolicy(ctx, worst, samples, epoch, rescored and old_tables[0] is not samples.log_probs,
                                   mismatch)
            optimizer_step(ctx, params, metrics)
    shift = policy_shift_kl(ctx, settings, samples, *first)
    metrics.add("policy_shift_kl", shift)
    target = shift_target(config, ctx.state.epoch)
    if target > 0:
        scale = adapt_lr_scale(ctx.state.lr_scale, shift, target)
        for g in ctx.optimizer.param_groups:  # the next step's lr, not one step later (the scheduler's next call)
            g["lr"] *= scale / ctx.state.lr_scale
        ctx.state.lr_scale = scale
    metrics.add("lr_scale", ctx.state.lr_scale)
    metrics.add("lr", ctx.lr_scheduler.get_last_lr()[0])
    metrics.add("timesteps_per_call", float(per_call))
    metrics.add("old_logprobs_rescored", float(rescored))
    out = metrics.reduce(acc)
    # sampler_gap_max / _mean, and per stored column (gathered in rescoring.gather_sampler_gap), old_logprobs_bit_exact
    out.update(gap)
    out.update(old_logprobs_counts(history, rescored))  # identical on every process: from the shared history
    return out


def note_auto(ctx, epoch: int, history, dev: float) -> None:
    """train.old_logprobs "auto": say when a verification changes what the next epochs use (the first one, and a
    first difference): the sampler's log-probs (bit for bit the training calls') or re-scoring for good."""
    before = [h["train"]["old_logprobs_bit_exact"] for h in history if "old_logprobs_bit_exact" in h.get("train", {})]
    if dev == 0.0 and not before:
        every = int(ctx.config.train.get("old_logprobs_verify_every", 10))
        ctx.accelerator.print(f"note: epoch {epoch}: the sampler's log-probs equal the training calls' re-score bit for "
                              "bit: train.old_logprobs 'auto' uses them, re-verifying "
                              + (f"every {every} epochs" if every else "never again"))
    elif dev != 0.0 and all(v == 1.0 for v in before):
        ctx.accelerator.print(f"note: epoch {epoch}: the sampler's log-probs differ from the training calls' re-score "
                              f"(|r - 1| up to {dev:.2g}, within the sampler-gap tolerance): train.old_logprobs 'auto' "
                              "re-scores every epoch from now on")


def _call_loss(ctx, settings, samples, advantages, mask, idx, cols, clip_high, params, old_table, is_cap=0.0,
               step_w=None):
    """Loss of one forward call: samples idx (b,) at timestep columns cols (b, S), stacked to b*S rows; the ratio's
    old log-probs from old_table (N, T): the sampler's (samples.log_probs) or the re-scored ones. is_cap > 0: each row's
    policy term weighed by min(exp(old - logp_sampler), is_cap) (train.sampler_is_cap); step_w (T,): each row's
    policy term also weighed by its step's factor (update.step_weights, train.step_weight_power).
    Returns (loss, metrics, the policy's StepResult on those rows). metrics: grpo_loss's (means over the kept
    rows), loss_sup, and privately _rows (the kept rows, their weight in the epoch's mean), _ratio_dev and _ratio_worst
    (max exp(|logp - logp_old|) - 1 over the kept rows, and its (sample, column))."""
    config, acc = ctx.config, ctx.accelerator
    device = acc.device
    rows, c, inputs = call_inputs(ctx, settings, samples, idx, cols)
    old = old_table[rows, c].to(device)
    is_w = truncated_is_weight(old, samples.log_probs[rows, c], is_cap) if is_cap > 0 else None
    weights = is_w
    if step_w is not None:
        w = step_w[c].to(device)
        weights = w if weights is None else weights * w
    a = advantages[rows] if advantages.ndim == 1 else advantages[rows.to(device), c.to(device)]
    keep = mask[rows.to(device)] if mask.ndim == 1 else mask[rows.to(device), c.to(device)]
    ref_res = None
    if config.train.beta > 0:
        # The reference is swapped into the policy's parameters in place, so its forward must come
        # before the policy forward whose graph we backpropagate.
        with torch.no_grad(), ctx.reference.swapped(), acc.autocast():
            ref_res = score(ctx, settings, inputs)
    with acc.autocast():
        res = score(ctx, settings, inputs)
    ref = None
    if ref_res is not None:
        ref = KLInputs(mean=res.mean[keep], ref_mean=ref_res.mean[keep], std=res.std[keep] if res.std.ndim else res.std,
                       ref_log_prob=ref_res.log_prob[keep])
    metrics = {}
    if keep.any():
        loss, m = grpo_loss(res.log_prob[keep], old[keep], a[keep], config.train.clip_range,
                            adv_clip_max=config.train.adv_clip_max, ref=ref, beta=config.train.beta,
                            kl_type=config.train.kl_type, clip_range_high=clip_high,
                            weights=None if weights is None else weights[keep])
        metrics = {k: float(v) for k, v in m.items()}
        metrics["loss"] = loss.item()
        metrics["_rows"] = float(keep.sum())
        if is_w is not None:
            metrics["sampler_is_weight"] = float(is_w[keep].mean())
        # exp(|logp - logp_old|) - 1 of every kept row (>= |r - 1|): before the first optimizer step these must all be
        # 0 (onpolicy.check_onpolicy). NaN rows are left out: a non-finite loss is counted below.
        d = (res.log_prob[keep].detach().float() - old[keep].float()).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, -1.0), d)
        j = int(d.argmax())
        if d[j] >= 0:
            metrics["_ratio_dev"] = float(d[j].exp() - 1)
            metrics["_ratio_worst"] = (int(rows[keep.cpu()][j]), int(c[keep.cpu()][j]))
    else:
        loss = zero_loss(params)
    if ctx.supervised is not None:
        sup = ctx.supervised.loss(ctx.unet, ctx.state.epoch)
        if sup is not None:
            loss = loss + sup[0]
            metrics["loss_sup"] = float(sup[1])
    if not torch.isfinite(loss):
        metrics = {"nonfinite_loss": 1.0}
        loss = zero_loss(params)
    return loss, metrics, res


def untrained_kl(ctx, settings, samples, idx, cols) -> torch.Tensor:
    """train.kl_steps = "all": the Gaussian KL to the reference (mean over dims and rows) of samples idx (b,) at
    untrained timestep columns cols (b, 1). The std is clamped below at train.min_step_std: the near-deterministic
    last steps (std ~ 0.005) would otherwise weigh 1/std^2 ~ 1e4 times more, the reason they are not trained."""
    inputs = call_inputs(ctx, settings, samples, idx, cols)[2]
    with torch.no_grad(), ctx.reference.swapped(), ctx.accelerator.autocast():
        ref = score(ctx, settings, inputs)  # before the policy forward: the reference is swapped in in place
    with ctx.accelerator.autocast():
        res = score(ctx, settings, inputs)
    std = torch.as_tensor(res.std, dtype=torch.float32).clamp(min=float(ctx.config.train.min_step_std))
    kl = kl_penalty(res.log_prob, KLInputs(mean=res.mean.float(), ref_mean=ref.mean.float(), std=std), "gaussian")
    return kl.mean()


def policy_shift_kl(ctx, settings, samples, idx, cols, mean_before: torch.Tensor, std) -> float:
    """How far the epoch's update moved the policy: the exact KL between the step Gaussians of the sampling
    policy (mean_before, (b*S, C, H, W), from the epoch's first call) and the policy after the update, on the
    same rows, averaged over dimensions like the log-prob (core.loss.kl_penalty, "gaussian"), mean over rows.

    Why: the DDPO log-prob is a mean over thousands of dimensions, so a mean shift that redraws the image moves
    it (and the clipped ratio, and approx_kl) by ~1e-3 at most; with one optimizer step per epoch the ratio is
    exactly 1 at every call. This KL is what a trust region on these steps has to bound (docs/efficacy.md)."""
    with torch.no_grad(), ctx.accelerator.autocast():
        res = score(ctx, settings, call_inputs(ctx, settings, samples, idx, cols)[2])
    kl = kl_penalty(res.log_prob, KLInputs(mean=res.mean.float(), ref_mean=mean_before, std=std), "gaussian")
    # every process must see the same value (train.target_shift_kl sets each process's lr from it)
    return float(ctx.accelerator.gather(kl.mean().reshape(1)).mean())


def shift_target(config, epoch: int) -> float:
    """train.target_shift_kl at this epoch: the target times the lr schedule's decay squared (update.schedule_decay),
    so that with "cosine" or "linear" the policy shift decays as the step does. Without it the adaptive rule would
    raise the lr back by 1.5 x an epoch as soon as the schedule lowered it."""
    target = float(config.train.get("target_shift_kl", 0.0))
    schedule = config.train.get("lr_schedule", "constant")
    if target <= 0 or schedule == "constant":
        return target
    return target * schedule_decay(schedule, epoch, config.num_epochs) ** 2


LR_SCALE_BOUNDS = (1e-2, 1e2)  # the adaptive factor stays within these multiples of train.learning_rate


def adapt_lr_scale(scale: float, shift_kl: float, target: float) -> float:
    """train.target_shift_kl: the next epoch's lr factor from this epoch's policy shift (training.policy_shift_kl),
    the adaptive rule of PPO implementations (rl_games' "adaptive" schedule): divide by 1.5 when the shift was
    over twice the target (or not finite), multiply by 1.5 when under half of it, keep it in between; clamped to
    LR_SCALE_BOUNDS. Why: the clipped ratio of a mean-over-dims log-prob does not see a shift that redraws the
    image, so the step size, not the clip, decides whether an update breaks the model (docs/efficacy.md), and a
    fixed lr that is safe early is too slow later, or the other way round."""
    if not math.isfinite(shift_kl) or shift_kl > 2.0 * target:
        scale /= 1.5
    elif shift_kl < 0.5 * target:
        scale *= 1.5
    return min(max(scale, LR_SCALE_BOUNDS[0]), LR_SCALE_BOUNDS[1])

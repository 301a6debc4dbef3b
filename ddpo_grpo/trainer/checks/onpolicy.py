"""Before the epoch's first optimizer step (trainer/epoch/training.py), the checks that the update starts on-policy.

On-policy (check_onpolicy): every re-scored transition's ratio exp(logp - logp_old) must be 1 within
core.loss.onpolicy_tolerance. The sampler/trainer check (check_sampler_gap, in every re-scored epoch before its first
update): the sampler's log-prob of each trained transition must be the training call's within
core.loss.sampler_gap_tolerance, and the two calls' settings equal. train.onpolicy_check says whether a failure stops
the run (one line, exit 2), warns, or is off. The GRPO invariants on the epoch's groups are checks/verification.py."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ddpo_grpo.core.loss import onpolicy_tolerance, sampler_gap_tolerance
from ddpo_grpo.errors import ConfigError, VerificationError


ONPOLICY_CHECKS = ("stop", "warn", "off")  # train.onpolicy_check


def check_onpolicy_config(config) -> None:
    """train.onpolicy_check is one of ONPOLICY_CHECKS (validate_config: one line before anything loads)."""
    mode = config.train.get("onpolicy_check", "stop")
    if mode not in ONPOLICY_CHECKS:
        raise ConfigError(f"train.onpolicy_check={mode!r}; choose one of {ONPOLICY_CHECKS}")


def run_precision(accelerator) -> Tuple[torch.dtype, bool]:
    """(the dtype the run computes in, whether float32 runs reduced-precision kernels): accelerate's mixed precision;
    float32 on CUDA runs TF32 kernels when torch allows them (config.allow_tf32, cuDNN's default), and on Ascend NPUs
    HF32 convolutions (torch_npu's torch.npu.conv.allow_hf32, on unless turned off)."""
    from ddpo_grpo.models.base import run_dtype

    dtype = run_dtype(accelerator.mixed_precision)
    kind = torch.device(accelerator.device).type
    npu_conv = getattr(getattr(torch, "npu", None), "conv", None)
    tf32 = ((kind == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32))
            or (kind == "npu" and bool(getattr(npu_conv, "allow_hf32", True))))
    return dtype, tf32


def run_tolerance(config, accelerator) -> Tuple[float, str]:
    """(core.loss.onpolicy_tolerance for this run, its dtype in words), from run_precision."""
    dtype, tf32 = run_precision(accelerator)
    name = str(dtype).replace("torch.", "") + (" with TF32 kernels" if tf32 and dtype == torch.float32 else "")
    return onpolicy_tolerance(dtype, config.train.clip_range, tf32), name


def run_old_logprobs(config, accelerator, epoch: int = 0, history=None, mismatch: bool = False) -> str:
    """This epoch's train.old_logprobs, "auto" resolved (rescoring.old_logprobs_source): "rescore" or "sampling"."""
    from ..epoch.rescoring import old_logprobs_source

    return old_logprobs_source(config, epoch, history, mismatch)


def run_sampler_gap_tolerance(accelerator) -> Tuple[float, str]:
    """(core.loss.sampler_gap_tolerance for this run, its dtype and device in words), from run_precision."""
    dtype, tf32 = run_precision(accelerator)
    kind = torch.device(accelerator.device).type
    name = (str(dtype).replace("torch.", "") + (" with TF32 kernels" if tf32 and dtype == torch.float32 else "")
            + f" on {kind}")
    return sampler_gap_tolerance(dtype, tf32, kind != "cpu"), name


def gather_worst(acc, worst: Tuple[float, int, int], samples) -> Tuple[float, int, int, float, int, int]:
    """The worst (deviation, sample, column) of every process (dev < 0: none on that process), gathered so that
    every process reaches the same verdict: (dev, condition key, denoising step, timestep, sample, process). A
    collective: every process calls it."""
    dev, i, c = worst
    key = int(samples.keys[i]) if dev >= 0 else -1
    step = int(samples.step_indices[c]) if dev >= 0 else -1
    t = float(samples.timesteps[c]) if dev >= 0 else -1.0
    row = torch.tensor([dev, key, step, t, i, acc.process_index], dtype=torch.float64
                       if torch.device(acc.device).type != "mps" else torch.float32, device=acc.device)
    rows = acc.gather(row).reshape(-1, 6).double().cpu()
    dev, key, step, t, i, rank = rows[int(rows[:, 0].argmax())].tolist()
    return dev, int(key), int(step), t, int(i), int(rank)


def _where(epoch, dev, key, step, t, i, rank, what: str) -> str:
    return (f"on-policy check failed in epoch {epoch} before any update: |r - 1| = {dev:.3g}{what} at denoising step "
            f"{int(step)} (timestep {t:g}), sample {int(i)} of process {int(rank)} (condition {int(key)}), ")


def _verdict(acc, mode: str, msg: str) -> str:
    if mode == "stop":
        raise VerificationError(msg)
    acc.print(f"warning: {msg}")
    return msg


def check_sampler_gap(ctx, gathered, epoch: int, mismatch: str = "") -> Optional[str]:
    """The sampler/trainer check, before the epoch's first update of a re-scored epoch: gathered = gather_worst's
    tuple for the worst cell of rescoring.worst_gap (exp(|logp_rescored - logp_sampler|) - 1, what the sampler's
    log-probs would give as |r - 1|). Above core.loss.sampler_gap_tolerance, or whenever the training call's settings
    differ from the sampler's (mismatch: rescoring.settings_mismatch's words), the sampler and the trainer compute
    different policies, which the re-score (ratio 1 by construction) would hide: train.onpolicy_check "stop" raises
    VerificationError (exit 2), "warn" prints the line and returns it; None when within it or "off"."""
    config, acc = ctx.config, ctx.accelerator
    mode = config.train.get("onpolicy_check", "stop")
    dev = gathered[0]
    tol, name = run_sampler_gap_tolerance(acc)
    if mode == "off" or not (dev > tol or mismatch):
        return None
    s = config.sample
    where = _where(epoch, *gathered, " (the sampler's log-probs against the training calls' re-score)")
    where += (f"{'above' if dev > tol else 'within'} the {name} sampler-gap tolerance {tol:.1e} "
              "(core.loss.sampler_gap_tolerance); the sampler and the trainer compute different policies. ")
    if mismatch:
        cause = f"Cause: the training call differs from the sampling call: {mismatch}. "
    else:
        cfg = (f"CFG (sampled with sample.guidance_scale={s.guidance_scale} but trained without it: train.cfg=False)"
               if s.guidance_scale != 1.0 and not config.train.cfg else "CFG differing between sampling and training")
        cause = (f"Likely causes: {cfg}; scheduler settings (eta / noise_level / sde_type / shift) changed between "
                 "sampling and training; a condition (prompt embedding, conditioning channels) other than the one "
                 "sampled with; the denoiser's mode (dropout) or dtype differing between the two. ")
    return _verdict(acc, mode, where + cause + "train.onpolicy_check='warn' continues anyway")


def check_onpolicy(ctx, worst: Tuple[float, int, int], samples, epoch: int, rescored: bool = False,
                   mismatch: str = "") -> Optional[str]:
    """The on-policy check: worst = (max |r - 1|, sample index, stored column) of this process's first calls before
    the epoch's first optimizer step (dev < 0: no kept row). A collective (one gather), so every process reaches the
    same verdict and stops together. Above the tolerance: train.onpolicy_check "stop" raises VerificationError (exit
    2), "warn" prints the line and returns it; None when within it or "off". rescored: the old log-probs came from
    rescoring (train.old_logprobs), i.e. the same calls: the line then names what can make one call differ from itself.
    mismatch: how the training call's settings differ from the sampler's (rescoring.settings_mismatch), named as the
    cause."""
    config, acc = ctx.config, ctx.accelerator
    mode = config.train.get("onpolicy_check", "stop")
    if mode == "off":
        return None
    gathered = gather_worst(acc, worst, samples)
    dev = gathered[0]
    tol, dtype = run_tolerance(config, acc)
    if not dev > tol:
        return None
    s = config.sample
    cfg = (f"CFG (sampled with sample.guidance_scale={s.guidance_scale} but trained without it: train.cfg=False)"
           if s.guidance_scale != 1.0 and not config.train.cfg else "CFG differing between sampling and training")
    rounding = ("rounding differs between call shapes: train.old_logprobs='rescore' scores the old log-probs "
                "through the training calls" if dtype != "float32" else "float32 re-scoring differs by ~1e-6 only")
    where = _where(epoch, *gathered, "") + (
        f"above the {dtype} tolerance {tol:.1e} (core.loss.onpolicy_tolerance, clip_range {config.train.clip_range:g}); ")
    if rescored:  # the old log-probs are these very calls' before the update: only nondeterminism can differ
        msg = (where + "the old log-probs were re-scored through these same training calls (train.old_logprobs), so "
               "one call gave two results. Likely causes: dropout active in the denoiser's train mode (LoRA or "
               "attention dropout); nondeterministic kernels (torch.use_deterministic_algorithms(True) names them). "
               "train.onpolicy_check='warn' continues anyway")
    elif mismatch:
        msg = (where + f"sampling and training score the same transition differently. Cause: the training call "
               f"differs from the sampling call: {mismatch}. train.onpolicy_check='warn' continues anyway")
    else:
        msg = (where + f"sampling and training score the same transition differently. Likely causes: {cfg}; the dtype "
               f"(mixed_precision {acc.mixed_precision or 'no'}: {rounding}); scheduler settings "
               "(eta / noise_level / sde_type / shift) changed between sampling and training; a condition (prompt "
               "embedding, conditioning channels) other than the one sampled with; dropout in the denoiser's train "
               "mode. train.onpolicy_check='warn' continues anyway")
    return _verdict(acc, mode, msg)

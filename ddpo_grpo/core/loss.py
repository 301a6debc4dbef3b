"""The GRPO objective: PPO's clipped ratio loss on group-relative advantages, plus an optional KL
penalty to a reference policy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

KL_TYPES = ("gaussian", "k3")
# Where the KL to the reference is taken: at the trained steps, or at every step (trainer/epoch/training.py).
KL_STEPS = ("trained", "all")

# The on-policy check (trainer/checks/onpolicy.py check_onpolicy): before an epoch's first optimizer step the policy is
# the sampling policy, so exp(logp - logp_old) of every re-scored transition must be 1 up to the arithmetic.
ONPOLICY_TOL_EXACT = 1e-5  # float32 re-scoring: other rows in a call sum in another order (1.7e-6 measured)


def onpolicy_tolerance(dtype: torch.dtype, clip_range: float, tf32: bool = False) -> float:
    """The largest |r - 1| (r = exp(logp - logp_old), before any update) a run of this compute dtype accepts; the
    one definition the trainer's check and the tests use.

    float32 (tf32 False): ONPOLICY_TOL_EXACT (or half the clip range if that is smaller). Re-scoring differs from
    sampling only in summation order (another batch composition), 1.7e-6 at most measured on the tiny models.

    bf16 / fp16, or float32 with TF32 kernels (tf32=True: CUDA with allow_tf32, an NPU's HF32): clip_range / 2.
    Measured on the tiny models (benchmarks/onpolicy_dtype.py, docs/reliability.md): a transition re-scored in bf16 with
    other rows, shuffled or stacked, gives |r - 1| = 0 on a CPU (its kernels are row-independent), but a bf16
    computation is up to 4e-5..2.7e-3 from float32's at steps of std >= 0.15 (0.03..0.3 at std ~0.01), and |r - 1|
    grows as 1/std; two bf16 paths that sum differently (a GPU kernel chosen per batch shape) can be twice that
    apart. That floor is above the 1e-4 clip range of the bf16 configs, so no bound tied to the dtype alone is
    below every clip range. What the check must guarantee is the clipped loss's premise: a deviation of half the
    clip range leaves every sample at least half the trust region on each side before it is clipped, so the first
    update still trains every sample; beyond it, rounding alone clips (or nearly clips) samples of the sampling
    policy itself, which the run must not do silently.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if dtype == torch.float32 and not tf32:
        return min(ONPOLICY_TOL_EXACT, clip_range / 2)
    return clip_range / 2


# The sampler gap (trainer/checks/onpolicy.py check_sampler_gap): |logp_sampler - logp_trainer| of one transition,
# the sampler's log-prob against the training call's, before any update. Calls of another shape may sum in another
# order; anything beyond that is a sampler/trainer mismatch (CFG, scheduler settings, conditions). Measured
# (docs/reliability.md, "The sampler gap"): float32 on a CPU <= 1.0e-6 across call shapes, 0 at equal shapes;
# bf16 on an H100 (sampler in eval mode, other call shapes) up to 4.8e-3 (SD 1.5), 4.7e-3 (SDXL), 3.2e-5 (FLUX),
# 2.4e-7 (SD3.5); a CFG mismatch (sampled with guidance, trained without) 1.8e-2 .. 5 per step on the tiny models.
SAMPLER_GAP_TOL_CPU = 1e-5  # float32 on a CPU: 10x the largest gap measured across call shapes
SAMPLER_GAP_TOL_DEVICE = 1e-4  # float32 on an accelerator with TF32 / HF32 off: not measured; 10x the CPU's allowance
SAMPLER_GAP_TOL_REDUCED = 2e-2  # bf16 / fp16 / TF32 / HF32: 4x the largest gap measured on the H100 (4.8e-3)


def sampler_gap_tolerance(dtype: torch.dtype, tf32: bool = False, accelerator: bool = False) -> float:
    """The largest sampler gap |logp_sampler - logp_trainer| (one transition, before any update) a run of this compute
    dtype and device accepts as arithmetic; above it the sampler and the trainer compute different policies and the
    run stops (train.onpolicy_check). The one definition the trainer's check and the tests use.

    float32 on a CPU (tf32 False, accelerator False): SAMPLER_GAP_TOL_CPU; float32 on an accelerator:
    SAMPLER_GAP_TOL_DEVICE; reduced precision anywhere (bf16 / fp16, TF32 / HF32 kernels): SAMPLER_GAP_TOL_REDUCED.
    Unlike onpolicy_tolerance it does not follow the clip range: re-scored, the ratio is 1 whatever the gap, and the
    gap bounds what rounding between call shapes can do, which the clip range does not change."""
    if dtype == torch.float32 and not tf32:
        return SAMPLER_GAP_TOL_DEVICE if accelerator else SAMPLER_GAP_TOL_CPU
    return SAMPLER_GAP_TOL_REDUCED


@dataclass
class KLInputs:
    """What the KL penalty needs from the reference, per kl_type.

    "gaussian" (two Gaussian steps with the same std): mean (N, ...) is the policy's step mean
    (with grad), ref_mean (N, ...) the reference's, std the step std, broadcastable to mean
    (e.g. (N, 1, 1, 1) or a float).
    "k3" (Schulman's estimator on log-probs): ref_log_prob (N,), the reference's log-prob of the
    same sampled step.
    """

    mean: Optional[torch.Tensor] = None
    ref_mean: Optional[torch.Tensor] = None
    std: Union[torch.Tensor, float, None] = None
    ref_log_prob: Optional[torch.Tensor] = None


def kl_penalty(log_prob: torch.Tensor, ref: KLInputs, kl_type: str = "gaussian") -> torch.Tensor:
    """Per-sample KL(policy || reference), shape (N,). The reference side is detached.

    gaussian: mean over non-batch dims of (mean - ref_mean)^2 / (2 std^2), the exact KL of two
    Gaussians with the same std, averaged (not summed) over dims like the DDPO log-prob.
    k3: exp(l_ref - l) - (l_ref - l) - 1, with l = log_prob (N,).
    """
    if kl_type == "gaussian":
        if ref.mean is None or ref.ref_mean is None or ref.std is None:
            raise ValueError("kl_type 'gaussian' needs ref.mean, ref.ref_mean and ref.std")
        if ref.mean.shape != ref.ref_mean.shape:
            raise ValueError(f"mean {tuple(ref.mean.shape)} and ref_mean {tuple(ref.ref_mean.shape)} differ")
        std = torch.as_tensor(ref.std, dtype=ref.mean.dtype, device=ref.mean.device)
        kl = (ref.mean - ref.ref_mean.detach()) ** 2 / (2 * std ** 2)
        return kl.reshape(kl.shape[0], -1).mean(dim=1)
    if kl_type == "k3":
        if ref.ref_log_prob is None:
            raise ValueError("kl_type 'k3' needs ref.ref_log_prob")
        if ref.ref_log_prob.shape != log_prob.shape:
            raise ValueError(f"ref_log_prob {tuple(ref.ref_log_prob.shape)} and log_prob "
                             f"{tuple(log_prob.shape)} differ")
        d = ref.ref_log_prob.detach() - log_prob
        return torch.exp(d) - d - 1
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
    ref: Optional[KLInputs] = None,
    beta: float = 0.0,
    kl_type: str = "gaussian",
    clip_range_high: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped-ratio policy loss plus beta * KL to the reference.

    log_prob (N,) carries the gradient; old_log_prob (N,) and advantages (N,) are detached here.
    N is samples for one timestep, or samples x timesteps flattened: every element has equal weight.
    The ratio is clipped to [1 - clip_range, 1 + (clip_range_high or clip_range)].
    With beta == 0 the reference is not used and ref may be None (kl is then logged if ref is given).
    weights (N,), optional and detached: a per-element factor on the policy term (the truncated importance weight
    pi_trainer / pi_sampler of train.sampler_is_cap); None weighs every element 1.
    Returns (scalar loss, metrics): loss, policy_loss, kl, approx_kl, clipfrac, clipfrac_low,
    clipfrac_high, ratio_mean, ratio_min, ratio_max, all detached scalars.
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and "
                         f"advantages {tuple(advantages.shape)} must have one shape")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref is None:
        raise ValueError("beta > 0 needs the reference (ref=KLInputs(...))")
    hi = clip_range if clip_range_high is None else clip_range_high
    old_log_prob = old_log_prob.detach()
    adv = torch.clamp(advantages.detach(), -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + hi)
    per_row = torch.maximum(unclipped, clipped)
    if weights is not None:
        if weights.shape != per_row.shape:
            raise ValueError(f"weights {tuple(weights.shape)} must have log_prob's shape {tuple(per_row.shape)}")
        per_row = per_row * weights.detach()
    policy_loss = per_row.mean()

    if ref is not None:
        kl = kl_penalty(log_prob, ref, kl_type).mean()
    else:
        kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    loss = policy_loss + beta * kl if beta > 0 else policy_loss

    with torch.no_grad():
        r = ratio.detach()
        low, high = (r < 1.0 - clip_range).float().mean(), (r > 1.0 + hi).float().mean()
        metrics = {
            "loss": loss.detach(),
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "approx_kl": 0.5 * ((log_prob.detach() - old_log_prob) ** 2).mean(),
            "clipfrac": low + high,
            "clipfrac_low": low,
            "clipfrac_high": high,
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
        }
    return loss, metrics

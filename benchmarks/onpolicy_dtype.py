"""How far from 1 the on-policy ratio exp(logp - logp_old) is in a given compute dtype: the measurement behind
core.loss.onpolicy_tolerance (docs/reliability.md, "on-policy check").

Samples a batch with the trainer's sampler (pipeline_with_logprob under autocast, float32 master weights, as
scripts/train.py samples) and re-scores the stored transitions as train_epoch does: the same rows, the rows
shuffled one step per call, and every step of every sample stacked into one call (train.timesteps_per_call). The
weights never change, so any |r - 1| is the arithmetic's: a different batch composition sums in another order, and
under bf16 autocast each op's output is rounded to 8 significant bits.

    python benchmarks/onpolicy_dtype.py --models tiny-t2i tiny-flow sd3-tiny --dtype bf16 --guidance 1 4.5

With --gap, the measurement behind core.loss.sampler_gap_tolerance (docs/reliability.md, "The sampler gap") instead:
the sampler (train mode, as sample_epoch runs it) against training calls of half its batch (rows shuffled, as the
call plan shuffles them), at the steps a run trains (std >= --min-std): sampled in one call of the whole batch
(another call shape), sampled in calls of the training's shape (trainer/epoch/sampling.py TrainingCallShape), and,
with guidance, trained without CFG (train.cfg=False: the mismatch the check must catch).

    python benchmarks/onpolicy_dtype.py --gap --models tiny-t2i tiny-flow sd3-tiny sdxl-tiny --dtype no bf16 --guidance 1 4.5
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings, policy_step
from ddpo_grpo.models import load_pipeline
from ddpo_grpo.models.base import run_dtype

PROMPTS = ["a red circle", "a blue square", "a green triangle on the left", "a yellow circle at the top",
           "two red squares", "a purple triangle", "a blue circle on the right", "a green square at the bottom"]


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)


def measure(name: str, mixed: str, guidance: float, batch: int, steps: int, seed: int = 0) -> dict:
    dtype = run_dtype(mixed)
    pipe = load_pipeline(name, torch_dtype=dtype)
    unet = pipe.unet.eval()
    settings = SamplerSettings(family=pipe.family, guidance_scale=guidance, eta=1.0, noise_level=0.7, sde_type="sde")
    prompts = (PROMPTS * batch)[:batch]
    with torch.no_grad(), autocast(dtype):
        emb = pipe.encode(prompts)
        neg = pipe.encode([""] * batch) if guidance != 1.0 else None
        g = torch.Generator().manual_seed(seed)
        traj = pipeline_with_logprob(unet, pipe.scheduler, settings, emb, neg, num_inference_steps=steps,
                                     sample_shape=pipe.sample_shape, generator=g, vae=None)
    T = traj.log_probs.shape[1]

    def rescore(rows, cols, compute=dtype):
        with torch.no_grad(), autocast(compute):
            res = policy_step(unet, pipe.scheduler, settings, traj.latents[rows, cols], traj.timesteps[cols],
                              traj.step_indices[cols], emb[rows], None if neg is None else neg[rows],
                              prev_sample=traj.latents[rows, cols + 1])
        return (torch.exp(res.log_prob - traj.log_probs[rows, cols]) - 1).abs()

    out = {"model": name, "family": pipe.family, "dtype": mixed, "guidance": guidance, "batch": batch, "steps": T,
           "dims": int(traj.latents[0, 0].numel())}
    same = torch.stack([rescore(torch.arange(batch), torch.full((batch,), j)) for j in range(T)], 1)
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(seed + 1))
    shuffled = torch.stack([rescore(perm[: max(1, batch // 2)], torch.full((max(1, batch // 2),), j))
                            for j in range(T)], 1)
    rows = torch.arange(batch).repeat_interleave(T)
    cols = torch.arange(T).repeat(batch)
    p = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 2))
    stacked = rescore(rows[p], cols[p])
    # The same rows re-scored in float32: the whole rounding error of the sampling dtype. Two computations in that
    # dtype that differ only in summation order (another batch composition, another kernel on a GPU) differ by at
    # most about twice this (each is within it of float32), and |r - 1| is linear in the mean's error at this size.
    exact = torch.stack([rescore(torch.arange(batch), torch.full((batch,), j), torch.float32) for j in range(T)], 1)
    out.update(same_rows=float(same.max()), half_shuffled=float(shuffled.max()), stacked=float(stacked.max()),
               vs_fp32=float(exact.max()), vs_fp32_per_step=[float(f"{v:.2e}") for v in exact.max(0).values],
               worst_step=int(same.max(0).values.argmax()), step_std=[round(float(s), 4) for s in traj.step_std])
    return out


def measure_gap(name: str, mixed: str, guidance: float, batch: int, steps: int, seed: int = 0,
                min_std: float = 0.02) -> dict:
    """Max |logp_sampler - logp_training_call| at the steps of std >= min_std: {other_shape, training_shape,
    cfg_mismatch (guidance != 1), per step}."""
    from ddpo_grpo.trainer.epoch.sampling import TrainingCallShape

    dtype = run_dtype(mixed)
    pipe = load_pipeline(name, torch_dtype=dtype)
    unet = pipe.unet.train()  # the sampler's and the trainer's mode
    settings = SamplerSettings(family=pipe.family, guidance_scale=guidance, eta=1.0, noise_level=0.7, sde_type="sde")
    prompts = (PROMPTS * batch)[:batch]
    b = max(1, batch // 2)
    with torch.no_grad(), autocast(dtype):
        emb = pipe.encode(prompts)
        neg = pipe.encode([""] * batch) if guidance != 1.0 else None

    def sample(denoiser):
        with torch.no_grad(), autocast(dtype):
            return pipeline_with_logprob(denoiser, pipe.scheduler, settings, emb, neg, num_inference_steps=steps,
                                         sample_shape=pipe.sample_shape, generator=torch.Generator().manual_seed(seed),
                                         vae=None)

    def gaps(traj, g=guidance):
        s = SamplerSettings(family=pipe.family, guidance_scale=g, eta=1.0, noise_level=0.7, sde_type="sde")
        perm = torch.randperm(batch, generator=torch.Generator().manual_seed(seed + 1))
        T = traj.log_probs.shape[1]
        out = torch.zeros(batch, T)
        for j in range(T):
            for lo in range(0, batch, b):
                rows = perm[lo:lo + b]
                c = torch.full((len(rows),), j)
                with torch.no_grad(), autocast(dtype):
                    res = policy_step(unet, pipe.scheduler, s, traj.latents[rows, c], traj.timesteps[c],
                                      traj.step_indices[c], emb[rows], None if neg is None or g == 1.0 else neg[rows],
                                      prev_sample=traj.latents[rows, c + 1])
                out[rows, j] = (res.log_prob.double() - traj.log_probs[rows, j].double()).abs().float()
        keep = traj.step_std >= min_std
        return out[:, keep].max(0).values if keep.any() else torch.zeros(1)

    whole = sample(unet)
    shaped = sample(TrainingCallShape(unet, b, guidance != 1.0))
    other, same = gaps(whole), gaps(shaped)
    out = {"model": name, "dtype": mixed, "guidance": guidance, "batch": batch, "train_batch": b, "steps": steps,
           "trained_steps": int((whole.step_std >= min_std).sum()), "other_shape": float(other.max()),
           "training_shape": float(same.max()), "other_shape_per_step": [float(f"{v:.2e}") for v in other]}
    if guidance != 1.0:
        mis = gaps(shaped, 1.0)
        out.update(cfg_mismatch_max=float(mis.max()), cfg_mismatch_min_step=float(mis.min()),
                   cfg_mismatch_per_step=[float(f"{v:.2e}") for v in mis])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-t2i", "tiny-flow"])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=["no", "bf16", "fp16"])
    ap.add_argument("--guidance", nargs="+", type=float, default=[1.0, 4.5])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--gap", action="store_true", help="the sampler gap instead (core.loss.sampler_gap_tolerance)")
    ap.add_argument("--min-std", type=float, default=0.02, help="--gap: the trained steps (train.min_step_std)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        for mixed in args.dtype:
            for guidance in args.guidance:
                for seed in range(args.seeds):
                    t0 = time.time()
                    r = (measure_gap(name, mixed, guidance, args.batch, args.steps, seed, args.min_std) if args.gap
                         else measure(name, mixed, guidance, args.batch, args.steps, seed))
                    r["seconds"] = round(time.time() - t0, 1)
                    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

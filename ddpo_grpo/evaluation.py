"""Step 7: deterministic evaluation (DDIM eta=0 / flow ODE) of the policy on fixed held-out conditions
with fixed seeds, so eval numbers are comparable across epochs and runs."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from .diffusers_patch.pipeline_with_logprob import pipeline_with_logprob
from .sampling import sampler_settings, stack_items


def eval_positions(n_data: int, num_samples: int, seed: int) -> np.ndarray:
    """The fixed list of eval condition positions (cycling through the set if it is smaller)."""
    rng = np.random.default_rng((seed, 5))
    reps = int(np.ceil(num_samples / n_data))
    return np.concatenate([rng.permutation(n_data) for _ in range(reps)])[:num_samples]


@torch.no_grad()
def evaluate(ctx) -> Tuple[Dict[str, float], torch.Tensor, list]:
    """Returns (metrics prefixed eval/, this process's images (n, C, H, W), captions). Every process
    evaluates its shard; scores are gathered so all processes return the same metrics."""
    config, acc = ctx.config, ctx.accelerator
    unet = ctx.unet
    unet.eval()
    settings = sampler_settings(config, ctx.pipe.family)
    pos = eval_positions(len(ctx.eval_data), config.eval.num_samples, config.eval.seed)
    per_proc = len(pos) // acc.num_processes
    mine = pos[acc.process_index * per_proc:(acc.process_index + 1) * per_proc]
    scores, details, images, captions = [], {}, [], []
    for lo in range(0, len(mine), config.eval.batch_size):
        chunk = mine[lo:lo + config.eval.batch_size]
        items = [ctx.eval_data[int(p)] for p in chunk]
        prompts = [it["prompt"] for it in items]
        gens = [torch.Generator().manual_seed(config.eval.seed * 100003 + int(acc.process_index * per_proc + lo + j))
                for j in range(len(items))]
        neg = ctx.neg_embed.expand(len(items), -1, -1) if settings.guidance_scale != 1.0 else None
        with acc.autocast():
            traj = pipeline_with_logprob(unet, ctx.pipe.scheduler, settings, ctx.encode(prompts), neg,
                                         num_inference_steps=config.sample.num_steps, sample_shape=ctx.pipe.sample_shape,
                                         generator=gens, vae=ctx.pipe.vae, deterministic=True,
                                         cond_channels=stack_items(items, acc.device))
        metadata = [{k: v for k, v in it.items() if k != "cond_image"} for it in items]
        res = ctx.rewards(traj.images.cpu(), prompts, metadata)
        scores.append(res.final)
        for k, v in res.details.items():
            details.setdefault(k, []).append(v)
        images.append(traj.images.cpu())
        captions += [f"#{it['index']} {p} | r={r:.2f}" for it, p, r in zip(items, prompts, res.final)]
    gather = lambda a: acc.gather(torch.as_tensor(np.concatenate(a), device=acc.device)).cpu().numpy()  # noqa: E731
    all_scores = gather(scores)
    metrics = {"eval/reward_mean": float(np.nanmean(all_scores)), "eval/num_samples": float(len(all_scores))}
    for k, v in details.items():
        metrics[f"eval/{k}"] = float(np.nanmean(gather(v)))
    return metrics, torch.cat(images), captions

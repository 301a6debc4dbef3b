"""Step 7: deterministic evaluation (DDIM eta=0 / flow ODE) of the policy on fixed held-out conditions
with fixed seeds, so eval numbers are comparable across epochs and runs. The policy measured is the one the run
exports: train.ema_decay's EMA, nft's soft-updated sampling policy, else the trained policy itself."""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from .sampling import sampler_settings


def eval_positions(n_data: int, num_samples: int, seed: int) -> np.ndarray:
    """The fixed list of eval condition positions (cycling through the set if it is smaller)."""
    rng = np.random.default_rng((seed, 5))
    reps = int(np.ceil(num_samples / n_data))
    return np.concatenate([rng.permutation(n_data) for _ in range(reps)])[:num_samples]


@dataclass
class EvalSamples:
    """What one eval pass over n conditions gives this process (_sample_and_score)."""
    scores: np.ndarray  # (n,) the trained reward
    details: Dict[str, np.ndarray]  # {name: (n,)} the reward's details
    images: torch.Tensor  # (n, C, H, W) or (n, C, F, H, W) for video
    captions: List[str]
    gold: Optional[Dict[str, np.ndarray]] = None  # {"avg"/name: (n,)}, None without reward.gold
    gold_seconds: float = 0.0
    groups: List[str] = field(default_factory=list)  # each sample's eval.group_by value; [] without it / stochastic


@torch.no_grad()
def _sample_and_score(ctx, positions, seeds, deterministic: bool, policy: bool = False) -> EvalSamples:
    """Sample eval conditions at `positions` with one seeded generator each and score them (EvalSamples; gold
    and the eval.group_by values only for the deterministic pass). Batches of eval.batch_size.
    The weights are the ones eval measures (ctx.eval_policy: the EMA with train.ema_decay, else the sampling
    policy); policy=True: the trained policy itself."""
    from ..checks.hacking import score_gold, timed

    config, acc = ctx.config, ctx.accelerator
    settings = sampler_settings(config, ctx.pipe.family)
    scores, details, images, captions, gold, gold_s = [], {}, [], [], {}, 0.0
    key, groups = config.eval.get("group_by", ""), []
    with contextlib.nullcontext() if policy else ctx.eval_policy():  # swapped in once
        for lo in range(0, len(positions), config.eval.batch_size):
            items = [ctx.eval_data[int(p)] for p in positions[lo:lo + config.eval.batch_size]]
            prompts = [it["prompt"] for it in items]
            gens = [torch.Generator().manual_seed(int(s)) for s in seeds[lo:lo + len(items)]]
            neg = ctx.neg_embed.expand(len(items), -1, -1) if settings.guidance_scale != 1.0 else None
            with acc.autocast():
                traj = pipeline_with_logprob(ctx.unet, ctx.pipe.scheduler, settings, ctx.encode(prompts), neg,
                                             num_inference_steps=config.sample.num_steps, sample_shape=ctx.pipe.sample_shape,
                                             generator=gens, vae=ctx.pipe.vae, deterministic=deterministic,
                                             cond_channels=ctx.cond_channels(items))
            metadata = [{k: v for k, v in it.items() if k != "cond_image"} for it in items]
            if key and deterministic:  # only the deterministic eval is broken down (evaluate)
                groups += [group_value(it, key) for it in items]
            res = ctx.rewards(traj.images.cpu(), prompts, metadata)
            scores.append(res.final)
            for k, v in res.details.items():
                details.setdefault(k, []).append(v)
            if ctx.gold is not None and deterministic:  # scored beside the proxy, never part of it
                g, s = timed(score_gold, ctx.gold, traj.images.cpu(), prompts, metadata)
                gold_s += s
                for k, v in g.items():
                    gold.setdefault(k, []).append(v)
            images.append(traj.images.cpu())
            captions += [f"#{it['index']} {p} | r={r:.2f}" for it, p, r in zip(items, prompts, res.final)]
    return EvalSamples(np.concatenate(scores), {k: np.concatenate(v) for k, v in details.items()}, torch.cat(images),
                       captions, {k: np.concatenate(v) for k, v in gold.items()} if gold else None, gold_s, groups)


def group_value(item: dict, key: str) -> str:
    """An eval item's eval.group_by value as a metric name's part: str(item[key]) with every run of characters
    other than letters, digits, '.', '-' and '_' made one '_' ("pan left" -> "pan_left"). A key the data's items
    lack is a ConfigError naming the keys they have."""
    from ddpo_grpo.errors import ConfigError

    if key not in item:
        raise ConfigError(f"eval.group_by={key!r}: the eval items have no such field; they have "
                          f"{', '.join(sorted(k for k in item if not k.endswith(('_video', '_image'))))}")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(item[key])).strip("_") or "_"


def group_means(key: str, groups: Sequence[str], scores: np.ndarray) -> Dict[str, float]:
    """eval.group_by's metrics: for every value v of the samples' `groups` (n,), eval/by_{key}/{v} = the mean of
    their `scores` (n,) (NaN scores left out) and eval/by_{key}/{v}/n = how many samples it averages."""
    groups = np.asarray(list(groups), dtype=object)
    if len(groups) != len(scores):
        raise ValueError(f"group_means: {len(groups)} group values for {len(scores)} scores")
    out = {}
    for v in sorted(set(groups.tolist())):
        s = scores[groups == v]
        out[f"eval/by_{key}/{v}"] = float(np.nanmean(s)) if np.isfinite(s).any() else float("nan")
        out[f"eval/by_{key}/{v}/n"] = float(len(s))
    return out


def _shard(n: int, acc) -> slice:
    """This process's contiguous share of n eval items; equal shares (the remainder is dropped) so gathers line up."""
    per_proc = n // acc.num_processes
    return slice(acc.process_index * per_proc, (acc.process_index + 1) * per_proc)


def passed(scores: np.ndarray, details: Dict[str, np.ndarray]) -> np.ndarray:
    """(n,) bool: a sample is right when its `*strict_accuracy` detail is 1 (toy world), else when its reward
    is at least 1 (a reward that has no notion of fully right never passes below its maximum)."""
    key = next((k for k in details if k.endswith("strict_accuracy")), None)
    return details[key] >= 1.0 if key is not None else scores >= 1.0


def pass_at_k(conditions: np.ndarray, ok: np.ndarray, k: int) -> float:
    """Share of conditions with at least one right sample among their k samples. conditions (n,), ok (n,) bool;
    conditions with other than k samples (a shard remainder) are left out."""
    uniq, counts = np.unique(conditions, return_counts=True)
    full = uniq[counts == k]
    return float(np.mean([ok[conditions == c].any() for c in full])) if len(full) else float("nan")


@torch.no_grad()
def evaluate(ctx, per_sample: Optional[dict] = None,
             policy: bool = False) -> Tuple[Dict[str, float], torch.Tensor, list]:
    """Returns (metrics prefixed eval/, this process's deterministic images (n, C, H, W), captions). Every process
    evaluates its shard; scores are gathered so all processes return the same metrics. The weights are the ones the
    run reports and exports (ctx.eval_policy); policy=True: the trained policy itself (eval.also_policy).

    Deterministic (DDIM eta=0 / ODE): eval.num_samples samples cycling through the eval conditions. With
    eval.pass_at_k = k > 0 also k stochastic samples (the training sampler) of each eval condition: eval/pass_at_k
    (share of conditions with a right sample) and eval/pass_at_1_stochastic (share of right samples), the head-room
    that RL should turn into deterministic accuracy.

    With eval.group_by = a field of the eval items (room3d: "preset"), also eval/by_{field}/{value}: the
    deterministic reward's mean over the samples of each value, and /n their count (group_means).

    per_sample, a dict, is filled with the deterministic eval's per-sample values over every process (rank-major):
    "proxy" (the trained reward) and "gold" ({"avg"/name: (n,)}, or None without reward.gold), for the guard."""
    config, acc = ctx.config, ctx.accelerator
    ctx.unet.eval()
    gather = lambda a: acc.gather(torch.as_tensor(a, device=acc.device)).cpu().numpy()  # noqa: E731
    pos = eval_positions(len(ctx.eval_data), config.eval.num_samples, config.eval.seed)
    mine = _shard(len(pos), acc)
    ev = _sample_and_score(ctx, pos[mine], config.eval.seed * 100003 + np.arange(len(pos))[mine],
                           deterministic=True, policy=policy)
    all_scores = gather(ev.scores)
    metrics = {"eval/reward_mean": float(np.nanmean(all_scores)), "eval/num_samples": float(len(all_scores))}
    if config.eval.get("group_by", ""):  # the reward per kind of condition (room3d: per camera preset)
        from accelerate.utils import gather_object

        metrics.update(group_means(config.eval.group_by, gather_object(ev.groups), all_scores))  # rank-major, as scores
    if per_sample is not None:
        per_sample["proxy"] = all_scores
        per_sample["gold"] = None if ev.gold is None else {k: gather(v.astype(np.float32)) for k, v in ev.gold.items()}
    if ev.gold is not None:
        metrics["time/gold_eval"] = ev.gold_seconds
    for k, v in ev.details.items():
        metrics[f"eval/{k}"] = float(np.nanmean(gather(v)))
    k = int(config.eval.pass_at_k)
    if k > 0:
        cond = np.repeat(np.unique(pos), k)  # the conditions the deterministic eval covers
        mine = _shard(len(cond), acc)
        st = _sample_and_score(ctx, cond[mine], config.eval.seed * 100003 + 10**9 + np.arange(len(cond))[mine],
                               deterministic=False, policy=policy)
        ok = gather(passed(st.scores, st.details).astype(np.float32)) > 0.5  # rank-major, as cond[:len(ok)] is
        metrics[f"eval/pass_at_{k}"] = pass_at_k(cond[:len(ok)], ok, k)
        metrics["eval/pass_at_1_stochastic"] = float(ok.mean())
    return metrics, ev.images, ev.captions

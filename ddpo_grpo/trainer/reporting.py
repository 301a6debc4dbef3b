"""Per-epoch logging and the end-of-run summary: metrics, group statistics, verification results,
phase timings and image grids to the trackers; a reward curve and a final grid in the run folder."""
from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from typing import Dict

import numpy as np
import torch

from .evaluation import evaluate
from .logging_utils import labelled_grid, log_images, reward_curve, save_grid


class PhaseTimer:
    """Wall seconds per named phase of an epoch."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


def _gather_mean(acc, x: np.ndarray) -> float:
    allx = acc.gather(torch.as_tensor(np.asarray(x, dtype=np.float32), device=acc.device)).cpu().numpy()
    return float(np.nanmean(allx)) if np.isfinite(allx).any() else float("nan")


def log_epoch(ctx, epoch: int, samples, rewards, adv, checks: Dict[str, float], train_metrics: Dict[str, float],
              eval_metrics: Dict[str, float], timer: PhaseTimer) -> None:
    acc, config = ctx.accelerator, ctx.config
    final = np.where(rewards.valid, rewards.final, np.nan)
    m = {"epoch": epoch, "reward_mean": _gather_mean(acc, final)}
    valid_final = adv.rewards_all[adv.mask_all]
    m["reward_std"] = float(np.std(valid_final.mean(axis=1) if valid_final.ndim == 2 else valid_final)) if len(valid_final) else float("nan")
    for name, s in rewards.final_per_fn.items():
        m[f"reward_{name}"] = _gather_mean(acc, np.where(rewards.valid, s, np.nan))
    for name, d in rewards.details.items():
        m[name] = _gather_mean(acc, d)
    stats = ctx.tracker.get_stats()
    for key in ("group_size", "trained_prompt_num", "trained_prompt_num_total", "zero_std_ratio", "reward_std_mean"):
        if key in stats:
            m[key] = float(stats[key])
    per_column = stats.get("zero_std_ratio_per_column", [])
    if len(per_column) > 1:  # (B, T) rewards: which denoising steps carried no signal this epoch
        m.update({f"zero_std_ratio/step_{t:02d}": float(v) for t, v in enumerate(per_column)})
    m["invalid_reward_count"] = float(adv.invalid_count)
    m["excluded_groups"] = float(adv.excluded_groups)
    m.update(checks)
    m.update({f"train/{k}": v for k, v in train_metrics.items()})
    m.update(eval_metrics)
    m.update({f"time/{k}": v for k, v in timer.seconds.items()})
    m["time/epoch"] = float(sum(timer.seconds.values()))
    acc.log(m, step=epoch)
    if config.logging.debug_dump:
        dump_debug(ctx, epoch, samples, rewards, adv)
    entry = {"epoch": epoch, "reward_mean": m["reward_mean"], "time": m["time/epoch"],
             "phases": dict(timer.seconds), "samples": int(len(adv.keys_all))}
    for k, v in m.items():
        if k.endswith("strict_accuracy") or k.endswith("_accuracy") and not k.startswith("eval/"):
            entry[k] = v
    if "eval/reward_mean" in eval_metrics:
        entry["eval_reward_mean"] = eval_metrics["eval/reward_mean"]
        entry.update({k: v for k, v in eval_metrics.items() if k.endswith("_accuracy")})
    ctx.state.history.append(entry)
    if acc.is_main_process and config.logging.image_freq and epoch % config.logging.image_freq == 0:
        n = min(config.logging.num_images, len(samples))
        caps = [f"#{int(samples.keys[i])} {samples.prompts[i]} | r={rewards.final[i]:.2f}" for i in range(n)]
        grid = labelled_grid(samples.images[:n], caps)
        save_grid(grid, ctx.run_dir, f"train_epoch_{epoch:04d}.png")
        log_images(acc, "train_samples", grid, epoch, samples.images[:n], caps)
    line = (f"epoch {epoch}: reward {m['reward_mean']:.4f}"
            + "".join(f" {k} {v:.3f}" for k, v in m.items() if k.endswith("strict_accuracy"))
            + f" | loss {train_metrics.get('loss', float('nan')):.4g} ratio {train_metrics.get('ratio_mean', float('nan')):.6f}"
            f" clipfrac {train_metrics.get('clipfrac', float('nan')):.3f} kl {train_metrics.get('kl', 0.0):.2e}"
            f" onpolicy|r-1| {train_metrics.get('onpolicy_ratio_max_dev', float('nan')):.1e}"
            + (f" | invalid rewards {adv.invalid_count} excluded, {adv.excluded_groups} groups dropped" if adv.invalid_count else "")
            + (f" | non-finite losses {train_metrics['nonfinite_loss']:.0f} skipped" if train_metrics.get("nonfinite_loss") else "")
            + f" | {m['time/epoch']:.1f}s")
    acc.print(line)


def dump_debug(ctx, epoch: int, samples, rewards, adv) -> None:
    """Per-process record of what this process sampled, was rewarded and trained on, and a checksum of its
    weights after the update: lets a test check the multi-process bookkeeping from outside."""
    acc = ctx.accelerator
    params = [p.detach().double() for p in acc.unwrap_model(ctx.unet).parameters()]
    record = {
        "rank": acc.process_index, "num_processes": acc.num_processes, "epoch": epoch,
        "keys": samples.keys.tolist(), "rewards": rewards.avg.tolist(), "advantages": adv.advantages.tolist(),
        "keys_all": adv.keys_all.tolist(), "rewards_all": adv.rewards_all.tolist(),
        "advantages_all": adv.advantages_all.tolist(),
        "weights_sum": float(sum(p.sum() for p in params)), "weights_abs_sum": float(sum(p.abs().sum() for p in params)),
    }
    path = os.path.join(ctx.run_dir, "debug", f"epoch_{epoch:04d}_rank_{acc.process_index}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f)


def evaluate_and_log(ctx, epoch: int) -> Dict[str, float]:
    metrics, images, captions = evaluate(ctx)
    acc = ctx.accelerator
    if acc.is_main_process:
        n = min(ctx.config.logging.num_images, len(images))
        grid = labelled_grid(images[:n], captions[:n])
        save_grid(grid, ctx.run_dir, f"eval_epoch_{epoch:04d}.png")
        log_images(acc, "eval_samples", grid, epoch)
    acc.print(f"epoch {epoch}: eval " + " ".join(f"{k[5:]} {v:.4f}" for k, v in metrics.items()))
    return metrics


def finish(ctx, seconds: float, final_eval: bool = True) -> None:
    """Evaluate the final policy; reward curve PNG, final grid, a summary JSON; close trackers and the pool."""
    acc = ctx.accelerator
    final = None
    if final_eval and ctx.state.history:
        final = evaluate_and_log(ctx, ctx.state.epoch)
        acc.log(final, step=ctx.state.epoch)
    if acc.is_main_process and ctx.state.history:
        points = ctx.state.history + ([{"epoch": ctx.state.epoch, "eval_reward_mean": final["eval/reward_mean"]}]
                                      if final else [])
        reward_curve(points, os.path.join(ctx.run_dir, "reward_curve.png"), ctx.config.eval.split)
        evals = sorted(f for f in os.listdir(os.path.join(ctx.run_dir, "images")) if f.startswith("eval_epoch_")) \
            if os.path.isdir(os.path.join(ctx.run_dir, "images")) else []
        if evals:
            shutil.copy(os.path.join(ctx.run_dir, "images", evals[-1]), os.path.join(ctx.run_dir, "final_grid.png"))
        with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
            json.dump({"seconds": round(seconds, 1), "history": ctx.state.history,
                       "final_eval": final}, f, indent=1)
        acc.print(f"done in {seconds / 60:.1f} min; run folder {ctx.run_dir}")
    acc.end_training()
    if ctx.rewards.executor is not None:
        ctx.rewards.executor.shutdown(wait=False)

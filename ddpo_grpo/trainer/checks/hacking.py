"""Reward-hacking guardrails (docs/hacking.md): a held-out gold reward, drift monitors and an alarm.

Gold (`reward.gold`, same registry, weights and kwargs as `reward.fns`) is scored on every eval and on a small
subsample of each epoch's training samples, after the rewards were collected: it never reaches the advantages or
the loss. Drift: the eval samples' image statistics (rewards/drift.py) against the run's first eval (the start
model). The guard keeps its state in RunState.guard, so alarms and the best-by-gold export survive a resume.

The alarm rule, checked after every eval (`train.hacking_guard` = "warn" | "stop" | "off"):
  - kind "gold_down": the eval's proxy (the trained reward's mean) is above its value at the best-gold eval so far,
    while gold is below that eval's by more than noise: the paired drop over the same conditions and seeds,
    mean(gold_best[i] - gold_now[i]) > train.hacking_z x its standard error (std(diff) / sqrt(n)) and > 0.
    Without reward.gold this kind cannot fire.
  - kind "drift": a statistic has moved from the start model's by more than train.hacking_drift_max (each lies in
    [0, 1]; 0 = off).
"warn" prints a warning line and sends a wandb alert; "stop" also saves a checkpoint and ends the run cleanly.
summary.json lists every alarm as {"epoch", "kind", "message"}. Best by gold: each eval whose gold beats the best so
far writes the model eval measured to <run>/best_gold_export (checkpointing.write_model_export, then an atomic
rename); summary.json "best_gold" = {"epoch", "gold", "export"}.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from typing import Dict, List, Optional

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.rewards.drift import image_stats

GUARD_MODES = ("warn", "stop", "off")
BEST_GOLD_EXPORT = "best_gold_export"


def check_config(config) -> None:
    """reward.gold and train.hacking_* as one ConfigError line each, before anything heavy."""
    from ddpo_grpo.rewards import available_rewards

    r, t = config.reward, config.train
    names = available_rewards()
    for name in r.get("gold", {}):
        if name not in names:
            raise ConfigError(f"unknown reward {name!r} in reward.gold; available: {', '.join(sorted(names))}")
    extra = sorted(set(r.get("gold_kwargs", {})) - set(r.get("gold", {})))
    if extra:
        raise ConfigError(f"reward.gold_kwargs given for {extra}, which are not in reward.gold")
    if int(r.get("gold_train_samples", 0)) < 0:
        raise ConfigError(f"reward.gold_train_samples={r.gold_train_samples} must be >= 0 (0 = eval only)")
    if t.get("hacking_guard", "off") not in GUARD_MODES:
        raise ConfigError(f"train.hacking_guard={t.hacking_guard!r}; choose one of {GUARD_MODES}")
    if not t.get("hacking_z", 2.0) > 0:
        raise ConfigError(f"train.hacking_z={t.hacking_z} must be > 0")
    if not t.get("hacking_drift_max", 0.0) >= 0:
        raise ConfigError(f"train.hacking_drift_max={t.hacking_drift_max} must be >= 0 (0 = off)")


def build_gold(config):
    """The gold RewardComputer, or None without reward.gold. Scored synchronously (no executor)."""
    from ddpo_grpo.rewards import RewardComputer

    gold = dict(config.reward.get("gold", {}))
    if not gold:
        return None
    kwargs = {k: dict(v) for k, v in config.reward.get("gold_kwargs", {}).items()}
    return RewardComputer(gold, fn_kwargs=kwargs)


def score_gold(gold, images, prompts, metadata) -> Dict[str, np.ndarray]:
    """{"avg": weighted gold (n,), <name>: raw (n,)}; NaN where a gold reward is not finite."""
    res = gold(images, list(prompts), list(metadata))
    return {"avg": res.final.astype(np.float64), **{k: v.astype(np.float64) for k, v in res.final_per_fn.items()}}


def _gathered(acc, x: np.ndarray) -> np.ndarray:
    return acc.gather(torch.as_tensor(np.asarray(x, dtype=np.float64), device=acc.device)).cpu().numpy()


def train_gold(ctx, samples) -> Dict[str, float]:
    """Gold on reward.gold_train_samples of this process's epoch samples (evenly spaced), means over every process:
    gold/train_avg, gold/train_<name>. Runs after the rewards were collected; nothing it returns is trained on."""
    n = min(int(ctx.config.reward.get("gold_train_samples", 0)), len(samples.prompts))
    if ctx.gold is None or n == 0:
        return {}
    idx = np.linspace(0, len(samples.prompts) - 1, n).round().astype(int)
    scores = score_gold(ctx.gold, samples.images[torch.as_tensor(idx)], [samples.prompts[i] for i in idx],
                        [samples.metadata[i] for i in idx])
    return {f"gold/train_{k}": float(np.nanmean(_gathered(ctx.accelerator, v))) for k, v in scores.items()}


def gold_alarm(proxy_now: float, proxy_best: float, gold_now: np.ndarray, gold_best: np.ndarray,
               z: float) -> Optional[str]:
    """The "gold_down" rule (module docstring) on per-sample gold of the same eval items; a message or None."""
    d = np.asarray(gold_best, np.float64) - np.asarray(gold_now, np.float64)
    d = d[np.isfinite(d)]
    if len(d) < 2 or not proxy_now > proxy_best:
        return None
    drop, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    if drop > 0 and drop > z * se:
        return (f"proxy up ({proxy_best:.4f} -> {proxy_now:.4f}) while gold fell {drop:.4f} from its best "
                f"(> {z:g} x s.e. {se:.4f}, {len(d)} paired samples)")
    return None


def drift_alarms(now: Dict[str, float], start: Dict[str, float], limit: float) -> List[str]:
    """One message per statistic that moved from the start model's by more than limit (0 = off)."""
    if not limit > 0:
        return []
    return [f"{k} {start[k]:.3f} -> {v:.3f} ({v - start[k]:+.3f}, beyond +-{limit:g})" for k, v in now.items()
            if k in start and abs(v - start[k]) > limit]


def guard_state(ctx) -> dict:
    g = ctx.state.guard
    for key, default in (("start", {}), ("alarms", []), ("evals", []), ("best_gold", None), ("best", None)):
        g.setdefault(key, default)
    return g


def on_eval(ctx, epoch: int, proxy: np.ndarray, gold: Optional[Dict[str, np.ndarray]], images) -> Dict[str, float]:
    """After an eval (every process, with the gathered per-sample proxy and gold, and its own images): drift
    statistics, gold metrics, the alarm rule, the best-by-gold export. Returns the metrics to log (drift/*, gold/*)."""
    acc, t = ctx.accelerator, ctx.config.train
    g = guard_state(ctx)
    stats = {k: float(np.nanmean(_gathered(acc, v))) for k, v in image_stats(images).items()}
    if not g["start"]:
        g["start"] = dict(stats)  # the run's first eval: the start model (kept across resume)
    m = {f"drift/{k}": v for k, v in stats.items()}
    m.update({f"drift/{k}_change": v - g["start"][k] for k, v in stats.items() if k in g["start"]})
    record = {"epoch": epoch, "proxy": float(np.nanmean(proxy)), **{k: v for k, v in m.items()}}
    alarms = []
    if gold is not None:
        m.update({f"gold/{k}": float(np.nanmean(v)) for k, v in gold.items()})
        record.update({f"gold/{k}": m[f"gold/{k}"] for k in gold})
        best = g["best"]
        if best is not None and t.hacking_guard != "off":
            msg = gold_alarm(record["proxy"], best["proxy"], gold["avg"], np.asarray(best["gold_per_sample"]), t.hacking_z)
            if msg:
                alarms.append(("gold_down", msg))
        if best is None or m["gold/avg"] > best["gold"]:
            g["best"] = {"epoch": epoch, "gold": m["gold/avg"], "proxy": record["proxy"],
                         "gold_per_sample": [float(x) for x in gold["avg"]]}
            g["best_gold"] = {"epoch": epoch, "gold": m["gold/avg"], "export": write_best_export(ctx)}
    if t.hacking_guard != "off":
        alarms += [("drift", msg) for msg in drift_alarms(stats, g["start"], t.hacking_drift_max)]
    g["evals"].append(record)
    for kind, msg in alarms:
        g["alarms"].append({"epoch": epoch, "kind": kind, "message": msg})
        raise_alarm(acc, epoch, kind, msg, stop=t.hacking_guard == "stop")
    if alarms and t.hacking_guard == "stop":
        ctx.stop = f"hacking guard: {alarms[0][0]} at epoch {epoch}"
    m["hacking/alarms"] = float(len(g["alarms"]))
    return m


def raise_alarm(acc, epoch: int, kind: str, msg: str, stop: bool) -> None:
    """The warning line, and a wandb alert where wandb tracks the run (an offline run or an old wandb: line only)."""
    acc.print(f"WARNING: reward hacking alarm at epoch {epoch} ({kind}): {msg}" + ("; stopping" if stop else ""))
    if not acc.is_main_process:
        return
    for tracker in acc.trackers:
        if tracker.name == "wandb":
            try:
                import wandb

                tracker.run.alert(title=f"reward hacking: {kind}", text=f"epoch {epoch}: {msg}",
                                  level=wandb.AlertLevel.WARN)
            except Exception:  # noqa: BLE001 - an alert that cannot be sent must not end the run
                pass


def write_best_export(ctx) -> str:
    """The model eval measured into <run>/best_gold_export: written beside it, then renamed into place, so a kill
    leaves the previous best whole. Every process calls it (write_model_export is a collective)."""
    from ..run.checkpointing import write_model_export

    acc = ctx.accelerator
    out = os.path.join(ctx.run_dir, BEST_GOLD_EXPORT)
    tmp, old = out + ".tmp", out + ".old"
    if acc.is_main_process:
        restore_best_export(ctx.run_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    write_model_export(ctx, ctx.pipe.family, tmp)
    if acc.is_main_process:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(out):
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return out


def restore_best_export(run_dir: str) -> None:
    """A kill between write_best_export's two renames leaves the previous best only as best_gold_export.old: put it
    back (the main process, before the next write and when summary.json is written)."""
    out = os.path.join(run_dir, BEST_GOLD_EXPORT)
    if not os.path.isdir(out) and os.path.isdir(out + ".old"):
        os.replace(out + ".old", out)


def summary_fields(ctx) -> dict:
    """summary.json's "alarms", "best_gold" and "evals" (proxy, gold, drift per eval)."""
    restore_best_export(ctx.run_dir)  # called by the main process only (reporting.finish)
    g = guard_state(ctx)
    return {"alarms": list(g["alarms"]), "best_gold": g["best_gold"], "evals": list(g["evals"])}


def timed(fn, *args):
    """(result, seconds) of fn(*args)."""
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t

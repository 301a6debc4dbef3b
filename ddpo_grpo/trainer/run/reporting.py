"""Steps 6-7 of the epoch, reporting: per-epoch metrics, group statistics, verification results and phase
timings to the accelerate trackers (wandb offline by default, TensorBoard); labelled image grids; and at the
end of the run a reward curve, a final grid and a summary JSON in the run folder."""
from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ..epoch.evaluation import evaluate


class PhaseTimer:
    """Wall seconds per named phase of an epoch and, given the (unwrapped) denoiser, the rows each phase ran through
    it: its function evaluations (NFEs; classifier-free guidance's two rows count two), the cost by which recipes
    (branching, windows, objectives) are compared per sample rather than per epoch. close() removes the hook."""

    def __init__(self, denoiser: Optional[torch.nn.Module] = None):
        self.seconds: Dict[str, float] = {}
        self.rows: Dict[str, int] = {}
        self._phase: Optional[str] = None
        self._hook = denoiser.register_forward_pre_hook(self._count, with_kwargs=True) if denoiser is not None else None

    def _count(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        if self._phase is not None and isinstance(x, torch.Tensor):
            self.rows[self._phase] = self.rows.get(self._phase, 0) + int(x.shape[0])

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextmanager
    def __call__(self, name: str):
        t, outer, self._phase = time.perf_counter(), self._phase, name
        try:
            yield
        finally:
            self._phase = outer
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


def _gather_mean(acc, x: np.ndarray) -> float:
    allx = acc.gather(torch.as_tensor(np.asarray(x, dtype=np.float32), device=acc.device)).cpu().numpy()
    return float(np.nanmean(allx)) if np.isfinite(allx).any() else float("nan")


# The training metrics on the epoch line, in order: (metric, label, format). Each is printed only when the epoch's
# objective has it (GRPO all of them; raft/nft only the loss): a missing one is left out, never shown as nan.
EPOCH_LINE_TRAIN = (("loss", "loss", "{:.4g}"), ("ratio_mean", "ratio", "{:.6f}"), ("clipfrac", "clipfrac", "{:.3f}"),
                    ("kl", "kl", "{:.2e}"), ("onpolicy_ratio_max_dev", "onpolicy|r-1|", "{:.1e}"),
                    ("policy_shift_kl", "shift", "{:.1e}"))


def epoch_line_train(train_metrics: Dict[str, float]) -> str:
    """The epoch line's training part, e.g. "loss 2.204e-05 ratio 0.999908 ... shift 2.5e-04" (GRPO) or
    "loss 0.01234" (raft/nft)."""
    return " ".join(f"{label} {fmt.format(train_metrics[k])}" for k, label, fmt in EPOCH_LINE_TRAIN
                    if k in train_metrics)


def log_epoch(ctx, epoch: int, samples, rewards, adv, checks: Dict[str, float], train_metrics: Dict[str, float],
              eval_metrics: Dict[str, float], timer: PhaseTimer, gold_metrics: Optional[Dict[str, float]] = None) -> None:
    """Log the epoch to the trackers, append it to the run history, print the epoch line. train_metrics: what
    train_epoch returned, already reduced over every process (metrics.METRIC_RULES); logged as train/<name>
    and kept in the history entry's "train". gold_metrics: hacking.train_gold's gold/train_* (never trained on)."""
    acc, config = ctx.accelerator, ctx.config
    means = rewards.means(mean=lambda x: _gather_mean(acc, x))  # over every process's samples
    m = {"epoch": epoch, "reward_mean": means.pop("reward_mean")}
    valid_final = adv.rewards_all[adv.mask_all]  # the epoch's trained rewards, all processes
    m["reward_std"] = float(np.std(valid_final.mean(axis=1) if valid_final.ndim == 2 else valid_final)) if len(valid_final) else float("nan")
    m.update(means)  # reward_<fn>, then the details
    stats = ctx.stat_tracker.get_stats()
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
    m.update(gold_metrics or {})
    m.update({f"time/{k}": v for k, v in timer.seconds.items()})
    m["time/epoch"] = float(sum(timer.seconds.values()))
    # Denoiser evaluations per sample of this epoch (this process's rows over its samples): what a recipe costs.
    nfe = {phase: rows / max(1, len(samples)) for phase, rows in timer.rows.items()}
    m.update({f"nfe_per_sample/{phase}": v for phase, v in nfe.items()})
    acc.log(m, step=epoch)
    if config.logging.debug_dump:
        dump_debug(ctx, epoch, samples, rewards, adv)
    entry = {"epoch": epoch, "reward_mean": m["reward_mean"], "time": m["time/epoch"],
             "phases": dict(timer.seconds), "samples": int(len(adv.keys_all)), "train": dict(train_metrics),
             "nfe_per_sample": nfe}
    for k, v in m.items():
        if k.endswith("strict_accuracy") or k.endswith("_accuracy") and not k.startswith("eval/"):
            entry[k] = v
    if "eval/reward_mean" in eval_metrics:
        entry["eval_reward_mean"] = eval_metrics["eval/reward_mean"]
        if "eval_policy/reward_mean" in eval_metrics:  # eval.also_policy: the trained policy beside its EMA
            entry["eval_policy_reward_mean"] = eval_metrics["eval_policy/reward_mean"]
        entry.update({k: v for k, v in eval_metrics.items() if k.endswith("_accuracy") or k.startswith("eval/pass_at")})
    entry.update({k: v for k, v in m.items() if k.startswith(("gold/", "hacking/"))})
    if ctx.gold is not None:  # the gold reward's cost this epoch: the training subsample and the eval, if one ran
        entry["gold_seconds"] = timer.seconds.get("gold", 0.0) + eval_metrics.get("time/gold_eval", 0.0)
    ctx.state.history.append(entry)
    if acc.is_main_process and config.logging.image_freq and epoch % config.logging.image_freq == 0:
        n = min(config.logging.num_images, len(samples))
        caps = [f"#{int(samples.keys[i])} {samples.prompts[i]} | r={rewards.final[i]:.2f}" for i in range(n)]
        grid = labelled_grid(samples.images[:n], caps)
        save_grid(grid, ctx.run_dir, f"train_epoch_{epoch:04d}.png")
        log_images(acc, "train_samples", grid, epoch, samples.images[:n], caps)
    train_part = epoch_line_train(train_metrics)
    line = (f"epoch {epoch}: reward {m['reward_mean']:.4f}"
            + (f" gold {m['gold/train_avg']:.4f}" if "gold/train_avg" in m else "")
            + "".join(f" {k} {v:.3f}" for k, v in m.items() if k.endswith("strict_accuracy"))
            + (f" | {train_part}" if train_part else "")
            + (f" | invalid rewards {adv.invalid_count} excluded, {adv.excluded_groups} groups dropped" if adv.invalid_count else "")
            + (f" | non-finite losses {train_metrics['nonfinite_loss']:.0f} skipped" if train_metrics.get("nonfinite_loss") else "")
            + f" | {m['time/epoch']:.1f}s")
    acc.print(line)


def dump_debug(ctx, epoch: int, samples, rewards, adv) -> None:
    """Per-process record of what this process sampled, was rewarded and trained on, and a checksum of its
    weights after the update: lets a test check the multi-process bookkeeping from outside."""
    acc = ctx.accelerator
    from .scale import full_tensor

    params = [full_tensor(p.detach()).double() for p in acc.unwrap_model(ctx.unet).parameters()]  # FSDP2: whole
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


def _print_eval(acc, epoch: int, name: str, metrics: Dict[str, float]) -> None:
    """One console line of the metrics under `name`/ (eval.group_by's /n counts are left to the trackers)."""
    acc.print(f"epoch {epoch}: {name} " + " ".join(f"{k[len(name) + 1:]} {v:.4f}" for k, v in metrics.items()
                                                    if k.startswith(name + "/") and not k.endswith("/n")))


def evaluate_and_log(ctx, epoch: int) -> Dict[str, float]:
    from ..checks.hacking import on_eval

    per_sample = {}
    metrics, images, captions = evaluate(ctx, per_sample)
    acc = ctx.accelerator
    if acc.is_main_process:
        n = min(ctx.config.logging.num_images, len(images))
        grid = labelled_grid(images[:n], captions[:n])
        save_grid(grid, ctx.run_dir, f"eval_epoch_{epoch:04d}.png")
        log_images(acc, "eval_samples", grid, epoch)
    _print_eval(acc, epoch, "eval", metrics)
    if ctx.config.eval.get("also_policy", False) and getattr(ctx, "ema", None) is not None:
        # the trained policy beside its EMA: what averaging the weights adds, on the same clips. Before the first
        # optimizer step the two hold the same weights: the EMA's numbers are the policy's.
        same = ctx.ema.num_steps == 0
        raw = {f"eval_policy/{k[5:]}": v for k, v in (metrics if same else evaluate(ctx, policy=True)[0]).items()
               if k.startswith("eval/")}
        _print_eval(acc, epoch, "eval_policy", raw)
        metrics.update(raw)
    guard = on_eval(ctx, epoch, per_sample["proxy"], per_sample["gold"], images)  # drift, gold, alarms, best by gold
    acc.print(f"epoch {epoch}: guard " + " ".join(f"{k} {v:.4f}" for k, v in guard.items()
                                                  if not k.endswith("_change")))
    metrics.update(guard)
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
            from ..checks.hacking import summary_fields

            gold_s = [h["gold_seconds"] for h in ctx.state.history if "gold_seconds" in h]
            json.dump({"seconds": round(seconds, 1), "history": ctx.state.history, "final_eval": final,
                       **summary_fields(ctx), "gold_seconds_per_epoch": float(np.mean(gold_s)) if gold_s else None,
                       "stopped": ctx.stop or None}, f, indent=1)
        acc.print(f"done in {seconds / 60:.1f} min; run folder {ctx.run_dir}")
    acc.end_training()
    ctx.rewards.shutdown()


# ----------------------------------------------------------------------------- image grids and the reward curve
CELL = 128  # grid cell size: the tiny 32x32 samples are upscaled so a person can see them
STRIP_FRAMES = 8  # video: frames shown side by side in a grid cell, evenly spaced from the first to the last
VIDEO_FPS = 16  # video: the frame rate of the clips logged to wandb (Wan 2.1's)


def _uint8_hwc(img: torch.Tensor) -> np.ndarray:
    """(C, H, W) in [0, 1] -> uint8 (H, W, C)."""
    return (img.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)


def frame_strip(video: torch.Tensor, max_frames: int = STRIP_FRAMES) -> torch.Tensor:
    """Frames (F, C, H, W) -> one image (C, H, k W): k = min(F, max_frames) frames, evenly spaced from the first to the
    last, side by side in time order. A still image (C, H, W) is returned as it is."""
    if video.ndim == 3:
        return video
    idx = torch.linspace(0, video.shape[0] - 1, min(video.shape[0], max_frames)).round().long()
    return torch.cat(list(video[idx]), dim=-1)


def labelled_grid(images: torch.Tensor, captions: Sequence[str], ncols: int = 8) -> Image.Image:
    """images (B, C, H, W) in [0, 1] -> one PIL grid with each caption (prompt, reward) under its image. Video
    (B, F, C, H, W): each cell is the sample's frame strip (frame_strip), CELL high, as many cells wide as frames."""
    font = ImageFont.load_default()
    images = [frame_strip(im) for im in images]
    n = len(images)
    h, w = images[0].shape[-2:] if n else (1, 1)
    tile_w = max(CELL, round(CELL * w / h))  # still images: CELL x CELL, as before
    ncols = max(1, min(ncols, n, ncols * CELL // tile_w))
    nrows = (n + ncols - 1) // ncols
    text_h = 44
    grid = Image.new("RGB", (ncols * tile_w, nrows * (CELL + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, cap) in enumerate(zip(images, captions)):
        tile = Image.fromarray(_uint8_hwc(img)).resize((tile_w, CELL), Image.NEAREST)
        x, y = (i % ncols) * tile_w, (i // ncols) * (CELL + text_h)
        grid.paste(tile, (x, y))
        draw.multiline_text((x + 2, y + CELL + 1), "\n".join(textwrap.wrap(cap, 22 * tile_w // CELL)[:4]),
                            fill="black", font=font, spacing=0)
    return grid


def write_gif(video: torch.Tensor, path: str, fps: int = VIDEO_FPS) -> str:
    """Frames (F, C, H, W) in [0, 1] -> an animated GIF at `path` (PIL: no video encoder needed)."""
    frames = [Image.fromarray(_uint8_hwc(f)) for f in video]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path


def log_images(accelerator, name: str, grid: Image.Image, step: int, images: Optional[torch.Tensor] = None,
               captions: Optional[List[str]] = None) -> None:
    """The grid to TensorBoard and wandb; wandb also gets each image with its caption, or, for video (B, F, C, H, W),
    each sample as a wandb.Video (an animated GIF) with its caption."""
    arr = np.asarray(grid)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(name, arr, step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({f"{name}_grid": wandb.Image(grid, caption=name)}, step=step)
            if images is not None and images.ndim == 5:
                import tempfile

                with tempfile.TemporaryDirectory() as tmp:  # wandb copies each file into its run when logged
                    items = [wandb.Video(write_gif(v, os.path.join(tmp, f"{name}_{i}.gif")), caption=c, format="gif")
                             for i, (v, c) in enumerate(zip(images, captions))]
                    tracker.log({name: items}, step=step)
            elif images is not None:
                items = [wandb.Image(_uint8_hwc(im), caption=c) for im, c in zip(images, captions)]
                tracker.log({name: items}, step=step)


def reward_curve(history: List[Dict[str, float]], path: str, eval_split: str = "eval") -> None:
    """Training (and eval, where present) reward per epoch, to a PNG. eval_split: config.eval.split, for the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    train = [h for h in history if "reward_mean" in h]
    ep, r = [h["epoch"] for h in train], np.array([h["reward_mean"] for h in train], dtype=float)
    ax.plot(ep, r, alpha=0.35, label="train reward (sampled, eta>0)")
    if len(r) >= 5:  # an epoch's mean depends mostly on which conditions it drew: show the trend
        ax.plot(ep[4:], np.convolve(r, np.ones(5) / 5, mode="valid"), label="train reward, 5-epoch mean")
    ev = [(h["epoch"], h["eval_reward_mean"]) for h in history if "eval_reward_mean" in h]
    if ev:
        where = "held-out" if eval_split == "eval" else "training conditions"
        ax.plot(*zip(*ev), "o-", label=f"eval reward (deterministic, {where})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_grid(grid: Image.Image, run_dir: str, name: str) -> str:
    os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
    path = os.path.join(run_dir, "images", name)
    grid.save(path)
    return path

"""Plots of scripts/bench.py's results: the speed grid against its floors, and the learning-efficacy curves.
Both return the PNG's path, or None when matplotlib is missing (the JSON has every number)."""
from __future__ import annotations

from typing import Dict, Optional


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_speed(result: Dict, path: str) -> Optional[str]:
    """One pair of stacked bars per trainer run: the trainer's epoch by phase, and its floor's (a) sampling and
    (b) training, in seconds; the time / floor ratio over each pair."""
    plt = _pyplot()
    runs = [r for r in result.get("runs", []) if "error" not in r]
    if plt is None or not runs:
        return None
    floors = {f["name"]: f for f in result.get("floors", []) if "error" not in f}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(runs) + 2), 4))
    for i, r in enumerate(runs):
        ph = r["phases_s"]
        other = max(0.0, r["epoch_s"] - ph.get("sampling", 0.0) - ph.get("training", 0.0))
        bottom = 0.0
        for name, v, color in (("sampling", ph.get("sampling", 0.0), "tab:blue"),
                               ("training", ph.get("training", 0.0), "tab:orange"), ("other", other, "tab:gray")):
            ax.bar(i - 0.2, v, 0.38, bottom=bottom, color=color, label=name if i == 0 else None)
            bottom += v
        fl = floors.get(r.get("floor"))
        if fl:
            ax.bar(i + 0.2, fl["sampling_s"], 0.38, color="tab:blue", alpha=0.45)
            ax.bar(i + 0.2, fl["training_s"], 0.38, bottom=fl["sampling_s"], color="tab:orange", alpha=0.45,
                   label="floor (pale)" if i == 0 else None)
            ax.text(i, max(bottom, fl["total_s"]) * 1.02, f"{r['overhead']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([f"B={r['batch_size']} cfg={'on' if r['cfg'] else 'off'}\n{r['malloc']} S={r['timesteps_per_call']}"
                        for r in runs], fontsize=8)
    ax.set_ylabel("seconds per epoch")
    ax.set_title("trainer epoch (left) against its floor (right)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_efficacy(eff: Dict, path: str) -> Optional[str]:
    """Efficacy curves: the eval metric against cumulative samples, denoiser evaluations and wall seconds, one line
    per config."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for label, e in eff["runs"].items():
        if not e.get("curve"):
            continue
        pts = [p for p in e["curve"] if p["metric"] is not None]
        xs, ws, ys = [p["samples"] for p in pts], [p["wall_s"] for p in pts], [p["metric"] for p in pts]
        ns = [p.get("nfe") for p in pts]
        if e.get("start") is not None:
            xs, ws, ys, ns = [0] + xs, [0.0] + ws, [e["start"]] + ys, [0.0] + ns
        axes[0].plot(xs, ys, marker="o", label=label)
        if None not in ns:  # runs from before NFEs were logged have no NFE curve
            axes[1].plot(ns, ys, marker="o", label=label)
        axes[2].plot(ws, ys, marker="o", label=label)
    for ax, xl in zip(axes, ("cumulative samples", "cumulative denoiser evaluations (sampling + training)",
                             "cumulative wall seconds (without eval)")):
        if eff.get("target") is not None:
            ax.axhline(eff["target"], color="gray", ls="--", lw=1, label=f"target {eff['target']:.3f}")
        ax.set_xlabel(xl)
        ax.set_ylabel(eff["metric"])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("held-out eval accuracy (deterministic sampling)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""scripts/bench.py's text output: progress lines on stderr, and the markdown report of a bench.json result (the
speed grid against its floors, gains, and the learning-efficacy curves)."""
from __future__ import annotations

import sys
import time
from typing import Dict, Sequence

_T0 = time.time()


def say(msg: str) -> None:
    """Progress on stderr, with the time since the bench started."""
    m, sec = divmod(int(time.time() - _T0), 60)
    print(f"[{m:02d}:{sec:02d}] {msg}", file=sys.stderr, flush=True)


def onoff(v) -> str:
    return "on" if v else "off"


def fmt(v, spec=".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(result: Dict) -> str:
    out = []
    m = result["meta"]
    speed = "" if m.get("no_speed") else (f", {m['epochs']} epoch{'s' if m['epochs'] != 1 else ''} per run"
                                          f" ({'first skipped as warm-up' if m['epochs'] > 1 else 'warm-up included'})")
    out.append(f"# bench {m['date']}: {m['config']}{speed}, "
               f"{m['cpus']} CPUs, {fmt(100 * m['cpu_busy_start'] if m.get('cpu_busy_start') is not None else None, '.0f')}%"
               f" busy at start, torch threads {m['threads'] or 'default'}"
               + (f", overrides {' '.join(m['overrides'])}" if m["overrides"] else ""))
    busy = [x for x in [m.get("cpu_busy_start")] + [r.get("cpu_busy_before") for r in result["floors"] + result["runs"]]
            if x is not None]
    if busy and max(busy) > 0.25:
        out.append(f"\n**warning**: up to {100 * max(busy):.0f}% of the CPUs were busy with other work right before a "
                   "measurement: the numbers below are not representative (with torch's default threads on a busy "
                   "machine, a forward pass can be many times slower).")
    if result["floors"]:
        out.append("\n## Floor: bare denoiser loops (same model, geometry and optimizer, nothing else)\n")
        rows = []
        for f in result["floors"]:
            if "error" in f:
                rows.append([f["batch_size"], onoff(f["cfg"]), f["timesteps_per_call"], "FAILED"] + [None] * 8)
                continue
            est = f["memory_estimate_mb"]
            rows.append([f["batch_size"], onoff(f["cfg"]), f["timesteps_per_call"], f["sampling_s"], f["training_s"],
                         f["total_s"], f"{f['sampling_forwards']}x{f['sampling_rows_per_forward']}",
                         f"{f['train_calls']} ({f['train_sample_timesteps']} rows)", f["optimizer_steps"],
                         f["peak_rss_mb"], est["total_mb"],
                         f"{est['runtime_mb']:.0f}+{est['weights_mb']:.1f}+{est['grads_mb']:.1f}+"
                         f"{est['adam_mb']:.1f}+{est['activations_mb']:.1f}"])
        out.append(table(["B", "CFG", "S", "(a) sampling s", "(b) training s", "floor s", "forwards x rows",
                          "train calls", "opt steps", "peak RSS MB", "est. MB",
                          "est. = runtime+weights+grads+adam+activations"], rows))
    if result["runs"]:
        out.append("\n## Trainer epochs against the floor (seconds per epoch; overhead = trainer / floor)\n")
        rows = []
        for r in result["runs"]:
            if "error" in r:
                rows.append([r["batch_size"], onoff(r["cfg"]), r["malloc"], r["timesteps_per_call"], "FAILED"] + [None] * 13)
                continue
            p = r["phases_s"]
            rows.append([r["batch_size"], onoff(r["cfg"]), r["malloc"], r["timesteps_per_call"], r["epoch_s"],
                         p.get("sampling"), p.get("reward"), p.get("advantages"), p.get("verification"),
                         p.get("training"), r["samples_per_s"], r.get("floor_s"), r.get("overhead"),
                         r.get("overhead_sampling"), r.get("overhead_training"), r["peak_rss_mb"],
                         r.get("rss_over_floor"), r.get("rss_over_floor_estimate")])
        out.append(table(["B", "CFG", "malloc", "S", "epoch s", "sampling", "reward", "advantages", "verification",
                          "training", "samples/s", "floor s", "overhead", "sampling/(a)", "training/(b)",
                          "peak RSS MB", "RSS/floor RSS", "RSS/est."], rows))
    if result.get("gains"):
        out.append("\n## Gains against (1 timestep per call, default allocator), same B and CFG\n")
        out.append(table(["B", "CFG", "change", "epoch s", "baseline s", "speedup", "training speedup",
                          "peak RSS MB", "baseline RSS MB"],
                         [[g["batch_size"], onoff(g["cfg"]), g["change"], g["epoch_s"], g["baseline_epoch_s"], g["speedup"],
                           g["training_speedup"], g["peak_rss_mb"], g["baseline_peak_rss_mb"]]
                          for g in result["gains"]]))
    eff = result.get("efficacy")
    if eff:
        out.append(f"\n## Learning efficacy: {eff['metric']} on held-out conditions ({eff['epochs']} epochs)\n")
        rows = []
        for label, e in eff["runs"].items():
            f4 = lambda v: fmt(v, ".4f")  # noqa: E731
            if e.get("start") is not None:
                rows.append([label, "pretrained", 0, 0, 0.0, f4(e["start"]), f4(e.get("start_eval_reward_mean"))])
            for p in e.get("curve", []):
                nfe = p.get("nfe")
                rows.append([label, p["epoch"], p["samples"], None if nfe is None else int(round(nfe)), p["wall_s"],
                             f4(p["metric"]), f4(p["eval_reward_mean"])])
            if "error" in e:
                rows.append([label, "FAILED", None, None, None, None, None])
        out.append(table(["config", "epoch", "cum. samples", "cum. NFEs", "cum. wall s (no eval)", eff["metric"],
                          "eval reward"], rows))
        if eff.get("target") is not None:
            out.append(f"\ntarget {eff['target']:.4f} (start {fmt(eff['start'], '.4f')}):\n")
            out.append(table(["config", "final", "reached", "epoch", "samples", "samples (interp.)", "wall s"],
                             [[label, fmt(e.get("final"), ".4f"), (e.get("to_target") or {}).get("reached"),
                               *[(e.get("to_target") or {}).get(k) for k in ("epoch", "samples", "samples_interp",
                                                                              "wall_s")]]
                              for label, e in eff["runs"].items()]))
        if eff.get("target_note"):
            out.append(f"\n{eff['target_note']}")
        if eff.get("plot"):
            out.append(f"\nplot: {eff['plot']}")
    return "\n".join(out)
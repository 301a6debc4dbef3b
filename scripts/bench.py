"""Benchmarks: where the time and memory of a training epoch go, against the compute floor, and how fast
GRPO learns against DDPO.

    python scripts/bench.py          # defaults: tiny, 2 epochs, B 8,16, CFG off/on, default + tuned malloc,
                                     # 1 timestep per call (sized for <= 10 min on 2 idle cores)
    python scripts/bench.py --config config/grpo.py:tiny --epochs 2 --batch-sizes 8,16 --cfg both \\
        --malloc default,tuned --timesteps-per-call 1,4 --out bench_results/
    python scripts/bench.py --no-speed --efficacy --efficacy-epochs 10   # GRPO (tiny) vs DDPO (ddpo) learning curves
    python scripts/bench.py --set sample.num_steps=10 train.timestep_fraction=1.0   # config overrides, every run
    python scripts/bench.py --no-speed --efficacy --efficacy-seeds 42,1 --efficacy-parallel 4   # 2 seeds, 4 at once

For each (per-device batch size B, CFG off/on, timesteps per call S, allocator) the real trainer runs as a
subprocess (scripts/train.py); per-phase wall seconds and samples come from its summary.json (the first epoch
is a warm-up and is skipped when there is more than one), peak RSS from the kernel's accounting of that one
child (os.wait4). Right before, a bare-loop subprocess (benchmarks/bench_floor.py) times the floor with the
same model and geometry: (a) the sampling forwards and (b) the training forward+backward calls with AdamW
steps, nothing else. overhead = epoch seconds / floor seconds; RSS likewise.

Output: a markdown report on stdout (progress on stderr), <out>/bench.json, trainer/floor logs and summaries
in <out>/runs/, a plot of the speed grid in <out>/bench.png, and with --efficacy <out>/efficacy.png. bench.json:

    meta      {date, command, cpus, cpu_busy_start, threads, config, epochs, batch_sizes, cfg, malloc,
               timesteps_per_call, overrides, floor_malloc, floor_repeats, total_wall_s, ...}
    floors    [{name, batch_size, cfg, timesteps_per_call, malloc, sampling_s (a), training_s (b), total_s,
                sampling_forwards, sampling_rows_per_forward, train_calls, train_sample_timesteps,
                optimizer_steps, reference_forwards, peak_rss_mb, rss_mb {runtime, loaded, peak_after_sampling,
                peak}, memory_estimate_mb {runtime_mb, weights_mb, grads_mb, adam_mb, activations_mb, total_mb},
                cpu_busy_before, ...}]
    runs      [{name, batch_size, cfg, malloc, timesteps_per_call, epochs, measured_epochs, epoch_s (best measured
                epoch), phases_s {sampling, reward, advantages, verification, training[, eval]} (best per phase),
                epoch_s_mean, phases_s_mean, samples_per_epoch,
                samples_per_s, peak_rss_mb, floor (name), floor_s, overhead, overhead_sampling,
                overhead_training, rss_over_floor, rss_over_floor_estimate, cpu_busy_before, ...}]
    gains     [{batch_size, cfg, change, malloc, timesteps_per_call, epoch_s, baseline_epoch_s, speedup,
                training_speedup, peak_rss_mb, baseline_peak_rss_mb}]   baseline: S=1, default allocator
    efficacy  null, or {metric, epochs, seeds, parallel, start, target, target_note, plot, runs: {<config name, or
                name_s<seed> with several seeds>: {config, overrides, start,
                start_eval_reward_mean, final, curve: [{epoch, samples, wall_s, metric, eval_reward_mean}],
                to_target: {reached, epoch, samples, samples_interp, wall_s}}}}
A failed measurement carries "error" (the log's tail) instead of numbers; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------- processes

from benchmarks.bench_plots import plot_efficacy, plot_speed  # noqa: E402
from benchmarks.bench_runs import (  # noqa: E402
    GUIDANCE_ON, ROOT, TUNED_MALLOC, attach_floor, child_env, cpu_busy, gains, measure_floor, measure_trainer,
    normalize_overrides, pretrained_eval,
)


def run_bench(args) -> Dict:
    args.out = os.path.abspath(args.out)  # subprocesses run in the repo root
    os.makedirs(args.out, exist_ok=True)
    workdir = os.path.join(args.out, "runs")
    os.makedirs(workdir, exist_ok=True)
    config = resolve_config(args.config)
    overrides = normalize_overrides(args.set)
    cfgs = {"off": [False], "on": [True], "both": [False, True]}[args.cfg]
    mallocs = [m.strip() for m in args.malloc.split(",") if m.strip()]
    tpcs = [int(s) for s in str(args.timesteps_per_call).split(",") if s.strip()]
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    for m in mallocs:
        child_env(m)  # validates
    result = {"meta": meta(args, config, overrides, batch_sizes, cfgs, mallocs, tpcs), "floors": [], "runs": []}
    t_start = time.time()
    if not args.no_speed:
        for B in batch_sizes:
            for cfg in cfgs:
                for tpc in tpcs:
                    fl = None
                    if not args.no_floor:
                        say(f"floor   B={B} cfg={'on' if cfg else 'off'} S={tpc} ...")
                        fl = measure_floor(config, B, cfg, tpc, overrides, args.floor_malloc, workdir, args.threads,
                                           args.run_timeout, args.floor_repeats)
                        result["floors"].append(fl)
                        say(f"floor {fl['total_s']:.2f} s, peak RSS {fl['peak_rss_mb']:.0f} MB" if "error" not in fl
                            else "floor FAILED:\n" + fl["error"])
                    for malloc in mallocs:
                        say(f"trainer B={B} cfg={'on' if cfg else 'off'} S={tpc} malloc={malloc} ...")
                        run = measure_trainer(config, B, cfg, args.epochs, malloc, tpc, overrides, workdir,
                                              threads=args.threads, timeout=args.run_timeout)
                        attach_floor(run, fl)
                        run.pop("history", None)
                        result["runs"].append(run)
                        say(f"trainer {run['epoch_s']:.2f} s/epoch, overhead {fmt(run.get('overhead'))}, peak RSS "
                            f"{run['peak_rss_mb']:.0f} MB" if "error" not in run else "trainer FAILED:\n" + run["error"])
        result["gains"] = gains(result["runs"])
        result["meta"]["plot"] = plot_speed(result, os.path.join(args.out, "bench.png"))
    result["efficacy"] = run_efficacy(args, overrides, workdir) if args.efficacy else None
    result["meta"]["total_wall_s"] = time.time() - t_start
    result["meta"]["loadavg_end"] = os.getloadavg()
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def resolve_config(spec: str) -> str:
    """config file paths relative to the caller's directory or the repo; subprocesses run in the repo."""
    path, _, name = spec.partition(":")
    for base in (os.getcwd(), ROOT):
        if os.path.isfile(os.path.join(base, path)):
            path = os.path.abspath(os.path.join(base, path))
            break
    else:
        raise SystemExit(f"--config {spec!r}: no such config file")
    return f"{path}:{name}" if name else path


def meta(args, config, overrides, batch_sizes, cfgs, mallocs, tpcs) -> Dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(), "cpu_busy_start": cpu_busy(1.0),
        "threads": args.threads or os.environ.get("OMP_NUM_THREADS"),
        "config": config, "epochs": args.epochs, "batch_sizes": batch_sizes, "cfg": cfgs,
        "guidance_scale_on": GUIDANCE_ON, "malloc": mallocs, "tuned_malloc_env": TUNED_MALLOC,
        "floor_malloc": args.floor_malloc, "floor_repeats": args.floor_repeats, "timesteps_per_call": tpcs,
        "overrides": overrides,
        "no_speed": args.no_speed, "no_floor": args.no_floor,
    }


_T0 = time.time()


def say(msg: str) -> None:
    """Progress on stderr, with the time since the bench started."""
    m, sec = divmod(int(time.time() - _T0), 60)
    print(f"[{m:02d}:{sec:02d}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- efficacy

def eval_metric(entry: Dict, metric: str) -> Optional[float]:
    if metric in entry:
        return entry[metric]
    if metric == "eval/reward_mean":
        return entry.get("eval_reward_mean")
    return None


def curve(history: List[Dict], metric: str, final_eval: Optional[Dict] = None) -> List[Dict]:
    """Eval points against cumulative samples and wall seconds (without eval) trained *before* each eval: the
    trainer evaluates at the start of an epoch, and once more after the last one (`final_eval`)."""
    pts, samples, wall = [], 0, 0.0
    for h in history:
        if "eval_reward_mean" in h:
            pts.append({"epoch": h["epoch"], "samples": samples, "wall_s": wall, "metric": eval_metric(h, metric),
                        "eval_reward_mean": h.get("eval_reward_mean")})
        samples += h["samples"]
        wall += h["time"] - h["phases"].get("eval", 0.0)
    if final_eval:
        pts.append({"epoch": len(history), "samples": samples, "wall_s": wall, "metric": final_eval.get(metric),
                    "eval_reward_mean": final_eval.get("eval/reward_mean")})
    return pts


def first_reach(points: List[Dict], target: float, start: Optional[float]) -> Dict:
    """First eval point at or above target, and the samples linearly interpolated to the crossing."""
    if start is not None and start >= target:
        return {"reached": True, "epoch": None, "samples": 0, "samples_interp": 0.0, "wall_s": 0.0}
    prev = {"samples": 0, "wall_s": 0.0, "metric": start}
    for p in points:
        if p["metric"] is not None and p["metric"] >= target:
            interp = p["samples"]
            if prev["metric"] is not None and p["metric"] > prev["metric"]:
                f = (target - prev["metric"]) / (p["metric"] - prev["metric"])
                interp = prev["samples"] + max(0.0, min(1.0, f)) * (p["samples"] - prev["samples"])
            return {"reached": True, "epoch": p["epoch"], "samples": p["samples"], "samples_interp": interp,
                    "wall_s": p["wall_s"]}
        if p["metric"] is not None:
            prev = p
    return {"reached": False, "epoch": None, "samples": None, "samples_interp": None, "wall_s": None}


def efficacy_jobs(configs: List[str], seeds: List[int]) -> List[tuple]:
    """(label, config, extra overrides) per efficacy run: one per config and seed; labels carry the seed only
    when there are several (`tiny_s1`), so single-seed reports keep the config names."""
    jobs = []
    for config in configs:
        name = config.rsplit(":", 1)[-1]
        for seed in seeds or [None]:
            label = name if len(seeds) <= 1 else f"{name}_s{seed}"
            jobs.append((label, config, [] if seed is None else [f"seed={seed}"]))
    if len({j[0] for j in jobs}) != len(jobs):
        raise SystemExit("--efficacy-configs: two configs share a name; each run needs its own label")
    return jobs


def _efficacy_run(args, overrides: List[str], workdir: str, malloc: str, job: tuple) -> Dict:
    """One efficacy curve: the untrained model's eval, then the trainer with eval every --efficacy-eval-freq."""
    label, config, extra = job
    say(f"efficacy: pretrained eval for {label} ...")
    pre = pretrained_eval(config, [*overrides, *extra], workdir, malloc, args.threads, args.run_timeout, tag=label)
    say(f"efficacy: training {label} for {args.efficacy_epochs} epochs, eval every {args.efficacy_eval_freq} ...")
    run = measure_trainer(config, None, None, args.efficacy_epochs, malloc, None, [*overrides, *extra], workdir,
                          name=f"efficacy_{label}", eval_freq=args.efficacy_eval_freq, threads=args.threads,
                          timeout=args.run_timeout * 4)
    entry = {"config": config, "overrides": extra, "peak_rss_mb": run.get("peak_rss_mb"),
             "process_wall_s": run.get("process_wall_s")}
    if "error" in pre:
        entry["pretrained_error"] = pre["error"]
    else:
        entry["start"] = pre["metrics"].get(args.metric)
        entry["start_eval_reward_mean"] = pre["metrics"].get("eval/reward_mean")
    if "error" in run:
        entry["error"] = run["error"]
    else:
        entry["curve"] = curve(run["history"], args.metric, run.get("final_eval"))
        entry["final"] = entry["curve"][-1]["metric"] if entry["curve"] else None
    say(f"efficacy: {label} done" + (" (FAILED)" if "error" in entry else f", final {fmt(entry.get('final'), '.4f')}"))
    return entry


def run_efficacy(args, overrides: List[str], workdir: str) -> Dict:
    configs = [resolve_config(c.strip()) for c in args.efficacy_configs.split(",") if c.strip()]
    seeds = [int(s) for s in str(args.efficacy_seeds).split(",") if s.strip()]
    jobs = efficacy_jobs(configs, seeds)
    malloc = args.malloc.split(",")[0].strip()
    out = {"configs": configs, "seeds": seeds, "epochs": args.efficacy_epochs, "metric": args.metric,
           "malloc": malloc, "parallel": args.efficacy_parallel, "runs": {}}
    # Runs are subprocesses: threads only wait on them. In parallel they share the machine (several small runs on
    # one GPU), so their wall seconds are not comparable with a run alone.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.efficacy_parallel)) as pool:
        entries = list(pool.map(lambda job: _efficacy_run(args, overrides, workdir, malloc, job), jobs))
    out["runs"] = {job[0]: e for job, e in zip(jobs, entries)}
    ok = [e for e in out["runs"].values() if e.get("curve")]
    starts = [e["start"] for e in out["runs"].values() if e.get("start") is not None]
    finals = [e["final"] for e in ok if e.get("final") is not None]
    start = sum(starts) / len(starts) if starts else (min(e["curve"][0]["metric"] for e in ok
                                                          if e["curve"][0]["metric"] is not None) if ok else None)
    target, note = args.target, None
    if target is None and start is not None and finals:
        if max(finals) > start:
            target = start + 0.5 * (max(finals) - start)
        else:
            note = f"no run ended above the start value {start:.4f}: no default target (give --target)"
    out["start"], out["target"], out["target_note"] = start, target, note
    if target is not None:
        for e in ok:
            e["to_target"] = first_reach(e["curve"], target, e.get("start", start))
    if ok:
        out["plot"] = plot_efficacy(out, os.path.join(args.out, "efficacy.png"))
    return out


# ------------------------------------------------------------------------------------------------ report

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
                rows.append([label, "pretrained", 0, 0.0, f4(e["start"]), f4(e.get("start_eval_reward_mean"))])
            for p in e.get("curve", []):
                rows.append([label, p["epoch"], p["samples"], p["wall_s"], f4(p["metric"]), f4(p["eval_reward_mean"])])
            if "error" in e:
                rows.append([label, "FAILED", None, None, None, None])
        out.append(table(["config", "epoch", "cum. samples", "cum. wall s (no eval)", eff["metric"],
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


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/grpo.py:tiny")
    ap.add_argument("--epochs", type=int, default=3,
                    help="epochs per trainer run; the first is skipped when > 1, the best of the rest counts")
    ap.add_argument("--batch-sizes", default="8,16", help="per-device sample and train batch sizes, comma-separated")
    ap.add_argument("--cfg", choices=("off", "on", "both"), default="both",
                    help=f"classifier-free guidance: guidance_scale 1.0 (off) and/or {GUIDANCE_ON} (on)")
    ap.add_argument("--malloc", default="default,tuned",
                    help="trainer allocator settings: default (glibc) and/or tuned (" +
                         " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()) + ")")
    ap.add_argument("--timesteps-per-call", default="1", help="train.timesteps_per_call values, e.g. 1,4")
    ap.add_argument("--floor-malloc", choices=("default", "tuned"), default="tuned",
                    help="allocator of the bare-loop floor subprocess (the floor should be the best case)")
    ap.add_argument("--floor-repeats", type=int, default=2, help="timed repeats of the floor loops (fastest counts)")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor measurements")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed grid (e.g. with --efficacy only)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every subprocess (default: inherit)")
    ap.add_argument("--set", action="append", default=[], nargs="+", metavar="KEY=VALUE",
                    help="config override passed to every subprocess as --config.KEY=VALUE (repeatable)")
    ap.add_argument("--efficacy", action="store_true", help="also run the GRPO vs DDPO learning-efficacy comparison")
    ap.add_argument("--efficacy-configs", default="config/grpo.py:tiny,config/grpo.py:ddpo,config/grpo.py:tiny_raft,"
                    "config/grpo.py:tiny_nft,config/grpo.py:tiny_per_step",
                    help="GRPO, DDPO's recipe, best-of-N supervision (RAFT), DiffusionNFT, per-step rewards")
    ap.add_argument("--efficacy-eval-freq", type=int, default=1, help="epochs between evals on the efficacy curves")
    ap.add_argument("--efficacy-epochs", type=int, default=10)
    ap.add_argument("--efficacy-seeds", default="", help="run every efficacy config with each of these seeds, e.g. "
                    "42,1,2 (default: the config's own seed)")
    ap.add_argument("--efficacy-parallel", type=int, default=1,
                    help="efficacy runs at once (several small runs sharing one GPU); wall times then overlap")
    ap.add_argument("--metric", default="eval/toyworld/strict_accuracy", help="eval metric of the efficacy curves")
    ap.add_argument("--target", type=float, default=None,
                    help="efficacy target (default: halfway between the start and the best final value)")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds before a subprocess is killed")
    ap.add_argument("--out", default="bench_results/")
    args = ap.parse_args(argv)
    args.set = [s for group in args.set for s in group]
    result = run_bench(args)
    print(report(result))
    print(f"\nwritten: {os.path.join(args.out, 'bench.json')}")
    return result


def failed(result: Dict) -> bool:
    eff = result.get("efficacy") or {}
    return any("error" in r for r in result["floors"] + result["runs"] + list((eff.get("runs") or {}).values()))


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)

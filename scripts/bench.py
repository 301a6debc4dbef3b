"""Benchmarks: where the time and memory of a training epoch go, against the compute floor, and how fast
GRPO learns against DDPO.

    python scripts/bench.py          # defaults: tiny, 2 epochs, B 8,16, CFG off/on, default + tuned malloc,
                                     # 1 timestep per call (sized for <= 10 min on 2 idle cores)
    python scripts/bench.py --config config/grpo.py:tiny --epochs 2 --batch-sizes 8,16 --cfg both \\
        --malloc default,tuned --timesteps-per-call 1,4 --out bench_results/
    python scripts/bench.py --no-speed --efficacy --efficacy-epochs 10   # GRPO (tiny) vs DDPO (ddpo) learning curves
    python scripts/bench.py --set sample.num_steps=10 train.timestep_fraction=1.0   # config overrides, every run
    python scripts/bench.py --no-speed --efficacy --efficacy-seeds 42,1 --efficacy-parallel 4   # 2 seeds, 4 at once
    python scripts/bench.py --no-speed --efficacy-runs logs/run_a,logs/run_b --metric eval/pass_at_1_stochastic

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
import datetime
import json
import os
import platform
import sys
import time
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------- processes

from benchmarks.bench_efficacy import efficacy_from_runs, efficacy_jobs, run_efficacy  # noqa: E402,F401
from benchmarks.bench_plots import plot_speed  # noqa: E402
from benchmarks.bench_report import fmt, report, say  # noqa: E402
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
    if args.efficacy_runs:
        result["efficacy"] = efficacy_from_runs([d.strip() for d in args.efficacy_runs.split(",") if d.strip()],
                                                args.metric, args.target, args.out)
    elif args.efficacy:
        configs = [resolve_config(c.strip()) for c in args.efficacy_configs.split(",") if c.strip()]
        result["efficacy"] = run_efficacy(args, overrides, workdir, configs)
    else:
        result["efficacy"] = None
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
                    "config/grpo.py:tiny_nft,config/grpo.py:tiny_per_step,config/grpo.py:tiny_branch",
                    help="GRPO, DDPO's recipe, best-of-N supervision (RAFT), DiffusionNFT, per-step rewards, GRPO on "
                         "branched trajectories")
    ap.add_argument("--efficacy-runs", default="",
                    help="no training: the efficacy table and plot of these run folders (comma-separated), e.g. long "
                         "runs trained by hand; from summary.json, or the newest checkpoint of an unfinished run")
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

"""GPU benchmark of the trainer's epoch on random-weight models of real shapes (no download), MODELS: `sd15-random`
(SD 1.5's scale, also against the bare floor of scripts/bench.py, benchmarks/bench_floor.py) and the real-shape builds
of SDXL, SD3.5-Medium, FLUX.1-dev and Wan 2.1 1.3B; on CUDA in bf16 autocast (the log-prob math stays fp32).

    python scripts/bench_gpu.py                                   # sd15-random: B 4,8,16 x CFG off/on x LoRA / full
    python scripts/bench_gpu.py --batch-sizes 8 --cfg on --modes lora --switches all   # + one switch at a time
    python scripts/bench_gpu.py --model flux-dev-random           # one real-shape model at its config's settings
    python scripts/bench_gpu.py --all-models                      # one row per model: LoRA, grad. checkpointing
    python scripts/bench_gpu.py --all-models --dry-run [--count-flops]   # validate (and count FLOPs) without a GPU
    python scripts/bench_gpu.py --allow-cpu --resolution 64 --batch-sizes 2 --cfg off --modes lora --num-steps 2

The models are ddpo_grpo.models.BUILT's, which the trainer loads by name (models.base.component_dtype: the denoiser
in float32, frozen parts in the run's dtype). A model runs its named config (MODELS: sd15_random_bench, sdxl, sd3,
flux, wan): its LoRA rank, resolution, steps, CFG and sample batch (train batch in the config's proportion),
--num-batches sampling batches, k = 2. Per point (benchmarks/bench_gpu_point.py):
for sd15-random (not with --all-models) the floor (denoiser calls of the epoch's sampling and training and AdamW
steps, nothing else), then the real trainer (build_context, a warm-up epoch, a timed epoch). Reported: s/epoch,
samples/s (images, or clips for Wan), training sample-steps/s, peak GPU memory (max_memory_allocated) and MFU =
denoiser FLOPs of the epoch's calls / s / --peak-tflops (989: H100 SXM dense bf16), the FLOPs per row counted on
a meta-device build (count_flops: model FLOPs; text encoders, VAE and sampler arithmetic are time, not FLOPs).
--switches: attention=math, channels_last, gradient checkpointing, train.timesteps_per_call=4 and torch.compile,
one at a time. Output: a markdown table on stdout and <out>/bench_gpu.md, and <out>/bench_gpu.json; and each point as
soon as it is measured, one JSON line appended to <out>/bench_gpu.jsonl (with the start-up phases, the worst
|r - 1| of train_epoch's metrics and its tolerance, the sampler gap), so that a run killed later keeps it.

    python scripts/bench_gpu.py --gpu-check --all-models --dry-run   # scripts/gpu_check.sh's points (GPU_CHECK)
    python scripts/bench_gpu.py --gpu-check --model flux-dev-random  # one of them (gpu_check.sh: one per process)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_gpu_configs import (MODELS, SWITCHES, defaults, fail, named_config,  # noqa: E402,F401
                                          point_config)  # (the points as configs)
from benchmarks.bench_gpu_point import count_flops, measure  # noqa: E402  (one point, measured)
from benchmarks.bench_gpu_tables import print_check_table, table  # noqa: E402,F401  (the tables it prints)
from benchmarks.gpu_check_points import (GPU_CHECK, GPU_CHECK_CONDITIONS, GPU_CHECK_MEMORY_GIB,  # noqa: E402,F401
                                         gpu_check_config, gpu_check_counts, gpu_check_point, memory_plan_gib)
from benchmarks.gpu_check_rows import SIMULATED_KINDS, build_result, simulated_kind, simulated_process  # noqa: E402

MAX_CPU_RESOLUTION = 128  # CPU runs are smoke tests: SD at 512 px on a CPU takes minutes per call


def config_for(args, point):
    model, B, cfg, mode, sw = point
    if args.gpu_check:
        return gpu_check_config(args, model)
    return point_config(args, model, B, cfg, mode, SWITCHES.get(sw, {}))


def measure_point(args, model: str, B: int, cfg: bool, mode: str, switch: str) -> dict:
    return measure(args, config_for(args, (model, B, cfg, mode, switch)), model, B, cfg, mode, switch)


def plan(args):
    """[(model, B, cfg, mode, switch)]: every model's grid, in MODELS order for --all-models."""
    if args.gpu_check:
        return [gpu_check_point(m) for m in (list(GPU_CHECK) if args.all_models else [args.model])]
    switches = ["none"] + ([s for s in SWITCHES] if args.switches == "all" else
                           [s for s in args.switches.split(",") if s])
    points = []
    for model in (list(MODELS) if args.all_models else [args.model]):
        batch_sizes, cfgs, modes = defaults(args, model)
        points += [(model, B, cfg, mode, sw) for mode in modes for B in batch_sizes for cfg in cfgs
                   for sw in switches]
    return points


def label(point, prefix: bool) -> str:
    return f"{point[0] + '/' if prefix else ''}{point[3]}/B{point[1]}/cfg-{'on' if point[2] else 'off'}/{point[4]}"


def dry_run(args, points) -> None:
    """The plan on one line; with --count-flops, one line per model of its denoiser's size and FLOPs per row. With
    --gpu-check, one line per build of gpu_check_counts (memory plan, FLOPs per row), written to --counts-out."""
    if args.gpu_check:
        print(f"gpu check: {len(points)} builds, time-outs {sum(GPU_CHECK[p[0]][0] for p in points)} s in all: "
              + ", ".join(f"{label(p, True)}/{GPU_CHECK[p[0]][2]} steps" for p in points), flush=True)
        counts = {}
        for p in points:
            c = counts[p[0]] = gpu_check_counts(args, p[0])
            print(f"{p[0]}: memory plan {c['plan_gib']:.2f} GiB (fits {GPU_CHECK_MEMORY_GIB:.0f}), gradient "
                  f"checkpointing {'on' if c['gradient_checkpointing'] else 'off'}, denoiser "
                  f"{c['denoiser_params'] / 1e9:.3f} B, {c['flops_fwd_row'] / 1e12:.3f} TFLOPs per forward row, "
                  f"{c['flops_train_row'] / 1e12:.3f} per {p[3]} training row", flush=True)
        if args.counts_out:
            os.makedirs(os.path.dirname(os.path.abspath(args.counts_out)), exist_ok=True)
            with open(args.counts_out, "w") as f:
                json.dump(counts, f, indent=1)
        return
    res = args.resolution or named_config(MODELS[args.model]).pretrained.resolution or "native"
    where = "" if args.all_models else f" at {res} px"
    prefix = args.all_models or args.model != "sd15-random"
    print(f"plan: {len(points)} points on {args.device}{where}: " + ", ".join(label(p, prefix) for p in points))
    for model in dict.fromkeys(p[0] for p in points) if args.count_flops else ():
        _, B, cfg, mode, sw = next(p for p in points if p[0] == model)
        f = count_flops(model, config_for(args, (model, B, cfg, mode, sw)))
        print(f"{model}: denoiser {f['denoiser_params'] / 1e9:.3f} B parameters, sample {tuple(f['sample_shape'])}, "
              f"condition {tuple(f['condition_shape'])}: {f['flops_fwd_row'] / 1e12:.3f} TFLOPs per forward row, "
              f"{f['flops_train_row'] / 1e12:.3f} per {mode} training row")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--model", default="sd15-random", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--all-models", action="store_true", help="every model, one table (config settings, LoRA, "
                                                               "bf16, gradient checkpointing)")
    ap.add_argument("--config-name", default="", help="a config in config/grpo.py (default: the model's, MODELS)")
    ap.add_argument("--batch-sizes", type=ints, default=None, help="per-device batch sizes (default: per model)")
    ap.add_argument("--cfg", choices=["off", "on", "both"], default=None, help="default: per model")
    ap.add_argument("--modes", default="", help="lora (the config's rank) and/or full (default: per model)")
    ap.add_argument("--resolution", type=int, default=0, help="pixels (default: the model's config)")
    ap.add_argument("--num-steps", type=int, default=0, help="sampling steps (default: the model's config)")
    ap.add_argument("--num-batches", type=int, default=2, help="sampling batches per epoch")
    ap.add_argument("--switches", default="", help=f"'all' or a comma list of {', '.join(SWITCHES)}")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--allow-cpu", action="store_true", help=f"run on CPU (resolution <= {MAX_CPU_RESOLUTION})")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no model")
    ap.add_argument("--count-flops", action="store_true", help="with --dry-run: each model's FLOPs per row (meta)")
    ap.add_argument("--out", default="bench_results/gpu")
    ap.add_argument("--gpu-check", action="store_true", help="scripts/gpu_check.sh's points (GPU_CHECK): with "
                    "--model one build, with --all-models --dry-run all six validated and counted on meta")
    ap.add_argument("--counts-out", default="", help="with --gpu-check --dry-run: write the plans and FLOPs here")
    ap.add_argument("--list-gpu-check", action="store_true", help="print 'model time-out' per GPU_CHECK build")
    ap.add_argument("--table", default="", help="print gpu_check.sh's table from this bench_gpu.jsonl and exit "
                    "(1 when an --expect build has no row, an error or |r - 1| over its tolerance)")
    ap.add_argument("--counts", default="", help="with --table: --counts-out's file (MFU, plan)")
    ap.add_argument("--expect", default="", help="with --table: comma list of the builds that must have a row")
    ap.add_argument("--show", default="", help="with --table: comma list of builds also shown where they have a row")
    ap.add_argument("--build-result", default="", metavar="MODEL", help="gpu_check.sh, after MODEL's process: "
                    "unless it wrote its row into --table's file, a row naming the cause (from --rc, --log, --limit "
                    "s, --elapsed s, --kill-after s; rows from --since-line on are this attempt's; --interrupted: "
                    "gpu_check.sh was stopped; --not-run REASON)")
    for flag, kind in (("--rc", int), ("--limit", float), ("--elapsed", float), ("--since-line", int),
                       ("--kill-after", float), ("--log", str), ("--not-run", str)):
        ap.add_argument(flag, type=kind, default=5 if flag == "--kill-after" else kind(), help=argparse.SUPPRESS)
    ap.add_argument("--interrupted", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--simulate", action="store_true", help="gpu_check.sh --simulate: with --gpu-check --model, "
                    "act out how that build ends (GPU_CHECK_SIMULATE='model=kind,...' or one kind per build: "
                    f"{', '.join(SIMULATED_KINDS)}); with --dry-run --counts-out, made-up counts")
    args = ap.parse_args(argv)
    args.count = not args.gpu_check
    if args.model not in MODELS:
        fail(f"--model {args.model!r}: choose one of {', '.join(MODELS)}")
    args.cfg = {"off": [False], "on": [True], "both": [False, True], None: None}[args.cfg]
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - {"lora", "full"}:
        fail(f"--modes {','.join(args.modes)!r}: choose from lora, full")
    unknown = set(args.switches.split(",")) - set(SWITCHES) - {"", "all"}
    if unknown:
        fail(f"--switches: unknown {', '.join(sorted(unknown))}; choose 'all' or from {', '.join(SWITCHES)}")
    if (args.batch_sizes is not None and (not args.batch_sizes or min(args.batch_sizes) < 1)) or args.peak_tflops <= 0:
        fail("--batch-sizes must be positive integers and --peak-tflops > 0")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.list_gpu_check:  # (--simulate: 3 s for the stand-ins that hang, time enough for the others)
        sim = lambda m: 3 if simulated_kind(m) in ("hang", "stuck") else 60  # noqa: E731
        print("\n".join(f"{m} {sim(m) if args.simulate else GPU_CHECK[m][0]}" for m in GPU_CHECK))
        return
    if args.build_result:  # (before torch: it runs after a build that may have taken the device down with it)
        extra = {}
        if args.build_result in GPU_CHECK:
            extra = {"batch_size": GPU_CHECK[args.build_result][1], "num_steps": GPU_CHECK[args.build_result][2]}
        forced = (("interrupted", "gpu_check.sh was stopped by a signal while this build ran") if args.interrupted
                  else ("not run", args.not_run) if args.not_run else None)
        print(build_result(args.table, args.build_result, args.rc, args.log, args.limit, args.elapsed,
                           args.since_line, args.kill_after, extra, forced), flush=True)
        return
    if args.table:
        sys.exit(print_check_table(args))
    if args.simulate:  # gpu_check.sh --simulate's processes: the counts file, or one build acting out its kind
        sys.exit(simulated_process(args, list(GPU_CHECK)))
    import torch

    from ddpo_grpo.models import GPU_ONLY

    real = [m for m in (list(MODELS) if args.all_models else [args.model]) if m in GPU_ONLY]
    if torch.cuda.is_available():
        args.device = "cuda"
    elif not (args.allow_cpu or args.dry_run):
        fail("no CUDA device: this benchmark measures the GPU path; run it on a GPU machine, or give --allow-cpu "
             "--resolution 64 for a CPU smoke run (or --dry-run)")
    else:
        args.device = "cpu"
        if real and not args.dry_run:
            fail(f"{', '.join(real)} on CPU: the real-shape builds (3.5-17 B parameters in all) run on a GPU; "
                 "on CPU use --dry-run [--count-flops]")
        if args.allow_cpu and (args.resolution or 512) > MAX_CPU_RESOLUTION:
            fail(f"--allow-cpu with --resolution {args.resolution or 512}: on CPU use <= {MAX_CPU_RESOLUTION} "
                 "(e.g. 64)")
    from ddpo_grpo.trainer.run.validate import validate_config
    from ddpo_grpo.errors import ConfigError

    points = plan(args)
    for point in points:  # every config checked before the first model is built
        model, B, cfg, mode, sw = point
        try:
            validate_config(config_for(args, point), num_processes=1)
        except ConfigError as e:
            fail(f"{'' if model == 'sd15-random' else model + ' '}B={B} cfg={cfg} {mode} {sw}: {e}")
    if args.dry_run:
        dry_run(args, points)
        return
    t0 = time.time()
    results = []
    os.makedirs(args.out, exist_ok=True)
    stamp = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
             "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    for point in points:
        print(f"[{time.time() - t0:6.0f}s] {label(point, True)}", file=sys.stderr, flush=True)
        results.append(measure_point(args, *point))
        # appended as soon as measured, one line per point: a run killed later (gpu_check.sh's time-outs) keeps it
        with open(os.path.join(args.out, "bench_gpu.jsonl"), "a") as f:
            f.write(json.dumps(dict(results[-1], **stamp)) + "\n")
        print(f"[{time.time() - t0:6.0f}s] {label(point, True)}: "
              + (results[-1]["error"] if "error" in results[-1] else f"{results[-1]['epoch_s']:.1f} s/epoch"),
              file=sys.stderr, flush=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
            "num_batches": args.num_batches, "peak_tflops": args.peak_tflops, "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump({"meta": meta, "points": results}, f, indent=1)
    with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
        f.write(f"{meta['gpu'] or 'cpu'}, torch {meta['torch']}, {meta['date']}\n\n{table(results)}\n")
    if not args.gpu_check:  # (gpu_check.sh prints its own table over every build's rows)
        print(table(results))
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

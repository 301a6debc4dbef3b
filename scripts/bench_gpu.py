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
--num-batches sampling batches, k = 2. Per point:
for sd15-random (not with --all-models) the floor (denoiser calls of the epoch's sampling and training and AdamW
steps, nothing else), then the real trainer (build_context, a warm-up epoch, a timed epoch). Reported: s/epoch,
samples/s (images, or clips for Wan), training sample-steps/s, peak GPU memory (max_memory_allocated) and MFU =
denoiser FLOPs of the epoch's calls / s / --peak-tflops (989: H100 SXM dense bf16), the FLOPs per row counted on
a meta-device build (count_flops: model FLOPs; text encoders, VAE and sampler arithmetic are time, not FLOPs).
--switches: attention=math, channels_last, gradient checkpointing, train.timesteps_per_call=4 and torch.compile,
one at a time. Output: a markdown table on stdout and <out>/bench_gpu.md, and <out>/bench_gpu.json.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SWITCHES = {  # name -> config overrides, measured one at a time against the baseline point
    "attention_math": {"unet_attention": "math"}, "channels_last": {"channels_last": True},
    "grad_ckpt": {"gradient_checkpointing": True}, "stack4": {"train.timesteps_per_call": 4},
    "compile": {"compile_unet": "default"}}
# models.BUILT name -> its named config in config/grpo.py. The real-shape ones are models.GPU_ONLY: refused on a CPU
# here (before any config is read; --dry-run builds them on "meta") and by the loader (for the trainer).
MODELS = {"sd15-random": "sd15_random_bench", "sdxl-random": "sdxl", "sd35-medium-random": "sd3",
          "flux-dev-random": "flux", "wan21-1.3b-random": "wan", "recam-1.3b-random": "recam"}
MAX_CPU_RESOLUTION = 128  # CPU runs are smoke tests: SD at 512 px on a CPU takes minutes per call


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def named_config(name: str):
    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo

    return grpo.get_config(name)


def defaults(args, model: str):
    """(batch sizes, CFG on/off list, modes) of a model: the options given, else sd15-random's grid (alone) or the
    config's own settings, one point."""
    c = named_config(args.config_name or MODELS[model])
    grid = model == "sd15-random" and not args.all_models
    batch_sizes = args.batch_sizes or ([4, 8, 16] if grid else [int(c.sample.batch_size)])
    cfg = args.cfg or ([False, True] if grid else [float(c.sample.guidance_scale) != 1.0])
    modes = args.modes or (["lora", "full"] if grid else ["lora"])
    return batch_sizes, cfg, modes


def point_config(args, model: str, B: int, cfg: bool, mode: str, overrides: dict):
    c = named_config(args.config_name or MODELS[model])
    if model != "sd15-random":  # (sd15-random: the config's model, so that --config-name can name another)
        c.pretrained.model = model
    if args.resolution:
        c.pretrained.resolution = args.resolution
    c.mixed_precision = "bf16" if args.device == "cuda" else "no"  # bf16 autocast on CPU is slow and not the point
    c.train.batch_size = max(1, B * int(c.train.batch_size) // int(c.sample.batch_size))  # the config's proportion
    c.sample.batch_size = B
    if args.num_steps:
        c.sample.num_steps = args.num_steps
    c.sample.num_batches_per_epoch = args.num_batches
    c.sample.k = 2  # any k dividing the epoch; the geometry does not change the cost
    guidance = float(c.sample.guidance_scale)
    c.sample.guidance_scale = (guidance if guidance != 1.0 else 5.0) if cfg else 1.0
    c.use_lora = mode == "lora"  # at the config's rank
    if args.all_models:
        c.gradient_checkpointing = True
    c.logging.wandb = c.logging.tensorboard = False
    c.logging.image_freq = 0
    c.eval_freq = c.save_freq = 0
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = getattr(node, p)
        setattr(node, last, value)
    return c


def count_flops(model: str, config, train: bool = True) -> dict:
    """FLOPs of one denoiser call on one row (denoiser_inputs): forward (sampling) and, with `train`, forward +
    backward (training: LoRA or full, as configured), counted by torch.utils.flop_counter on a meta-device build at
    the config's shapes (nothing is allocated: the same count on any machine), without gradient checkpointing (its
    recomputed forward is not model FLOPs). Also the denoiser's parameters and the shapes."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.build import make_trainable
    from ddpo_grpo.trainer.meta_counts import denoiser_inputs

    pipe = load_pipeline(model, torch.float32, "meta", int(config.pretrained.resolution))
    pipe.adapter.configure(pipe, config)  # FLUX-dev's embedded guidance, Wan's frames
    x, t, cond = denoiser_inputs(pipe)
    out = {"denoiser_params": sum(p.numel() for p in inner_model(pipe.unet).parameters()),
           "sample_shape": list(pipe.sample_shape), "condition_shape": list(cond.shape[1:])}
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        pipe.unet(x, t, encoder_hidden_states=cond)
    out["flops_fwd_row"] = float(counter.get_total_flops())
    if train:
        make_trainable(pipe.unet, config, pipe.adapter.lora_target_modules)
        counter = FlopCounterMode(display=False)
        with counter:
            pipe.unet(x, t, encoder_hidden_states=cond).sample.float().mean().backward()
        out["flops_train_row"] = float(counter.get_total_flops())
    return out


def trainer_epoch(config, device: str) -> dict:
    """One warm-up epoch and one timed epoch of the real trainer in this process: phase seconds, peak memory and the
    rows the denoiser ran (sampling: batches x steps x B, doubled by CFG; training: the call plan's sample-steps,
    doubled by CFG training, and as many reference forwards when train.beta > 0)."""
    import torch
    from accelerate import Accelerator

    from benchmarks.bench_floor import _sync
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer import advantages, sampling, training
    from ddpo_grpo.trainer.build import build_context

    acc = Accelerator(cpu=device == "cpu", mixed_precision=config.mixed_precision)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ctx = build_context(config, acc, d)
        for epoch in range(2):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ctx.stat_tracker.clear()
            _sync(device)
            t0 = time.perf_counter()
            samples = sampling.sample_epoch(ctx, epoch)
            rewards = collect_rewards(samples.reward_futures, acc)
            _sync(device)
            t1 = time.perf_counter()
            adv = advantages.compute_advantages(acc, ctx.stat_tracker, samples.keys, torch.from_numpy(rewards.avg),
                                                torch.from_numpy(rewards.valid), config.train.max_invalid_fraction)
            t2 = time.perf_counter()
            training.train_epoch(ctx, samples, adv, epoch)
            _sync(device)
            t3 = time.perf_counter()
            out = {"sampling_s": t1 - t0, "training_s": t3 - t2, "epoch_s": t3 - t0, "samples": int(len(samples.keys))}
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        s, t = config.sample, config.train
        cfg = float(s.guidance_scale) != 1.0
        out["sampling_rows"] = int(s.num_batches_per_epoch) * int(s.num_steps) * int(s.batch_size) * (2 if cfg else 1)
        N, T = samples.log_probs.shape
        columns = training.trainable_columns(samples, config)
        steps = sum(idx.numel() * cols.shape[1] for inner in range(int(t.num_inner_epochs))
                    for idx, cols in training.training_calls(N, T, config, 1, inner, 0, 1, columns)[0])
        out["train_rows"] = int(steps) * (2 if cfg and t.cfg else 1)
        out["train_sample_steps"] = int(steps)
        out["reference_rows"] = out["train_rows"] if t.beta > 0 else 0
        ctx.rewards.executor.shutdown(wait=False)
    del ctx, acc
    return out


def measure_point(args, model: str, B: int, cfg: bool, mode: str, switch: str) -> dict:
    import torch

    from benchmarks.bench_floor import floor

    config = point_config(args, model, B, cfg, mode, SWITCHES.get(switch, {}))
    row = {"model": model, "batch_size": B, "cfg": cfg, "mode": mode, "switch": switch,
           "resolution": int(config.pretrained.resolution), "num_steps": int(config.sample.num_steps)}
    try:
        row.update(count_flops(model, config))
        fl = floor(config, True, 1, args.device) if model == "sd15-random" and not args.all_models else None
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
        tr = trainer_epoch(config, args.device)
    except Exception as e:  # noqa: BLE001 - one failed point (e.g. out of memory) must not lose the others
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return row
    finally:
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
    peak = args.peak_tflops * 1e12
    train_flops = tr["train_rows"] * row["flops_train_row"] + tr["reference_rows"] * row["flops_fwd_row"]
    row.update({
        "epoch_s": tr["epoch_s"], "samples_per_s": tr["samples"] / tr["sampling_s"],
        "train_steps_per_s": tr["train_sample_steps"] / tr["training_s"], "peak_mem_mb": tr["cuda_peak_mb"],
        "mfu_sampling": row["flops_fwd_row"] * tr["sampling_rows"] / tr["sampling_s"] / peak,
        "mfu_training": train_flops / tr["training_s"] / peak, "trainer": tr,
    })
    if fl is not None:
        row.update({
            "floor_samples_per_s": tr["samples"] / fl["sampling_s"],
            "floor_train_steps_per_s": fl["train_sample_timesteps"] / fl["training_s"],
            "sampling_over_floor": tr["sampling_s"] / fl["sampling_s"],
            "training_over_floor": tr["training_s"] / fl["training_s"],
            "floor_peak_mem_mb": fl["cuda_peak_mb"], "floor": {k: v for k, v in fl.items() if not isinstance(v, dict)},
        })
    return row


def plan(args):
    """[(model, B, cfg, mode, switch)]: every model's grid, in MODELS order for --all-models."""
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


def table(points) -> str:
    """One markdown row per point; (floor) where sd15-random's floor was measured."""
    def with_floor(p, key, fmt, scale=1.0):
        if p.get(key) is None:
            return "n/a"
        floor = p.get("floor_" + key)
        return f"{p[key] * scale:{fmt}}" + ("" if floor is None else f" ({floor * scale:{fmt}})")

    lines = ["| model | mode | B | CFG | switch | px | s/epoch | samples/s (floor) | train steps/s (floor) | "
             "peak GB (floor) | MFU sample | MFU train |", "|---" * 12 + "|"]
    for p in points:
        head = (f"| {p['model']} | {p['mode']} | {p['batch_size']} | {'on' if p['cfg'] else 'off'} | {p['switch']} | "
                f"{p['resolution'] or 'native'} |")
        if "error" in p:
            lines.append(f"{head} {p['error']} ||||||")
            continue
        lines.append(f"{head} {p['epoch_s']:.1f} | {with_floor(p, 'samples_per_s', '.2f')} | "
                     f"{with_floor(p, 'train_steps_per_s', '.1f')} | {with_floor(p, 'peak_mem_mb', '.1f', 2**-10)} | "
                     f"{p['mfu_sampling']:.3f} | {p['mfu_training']:.3f} |")
    return "\n".join(lines)


def dry_run(args, points) -> None:
    """The plan on one line; with --count-flops, one line per model of its denoiser's size and FLOPs per row."""
    res = args.resolution or named_config(MODELS[args.model]).pretrained.resolution or "native"
    where = "" if args.all_models else f" at {res} px"
    prefix = args.all_models or args.model != "sd15-random"
    print(f"plan: {len(points)} points on {args.device}{where}: " + ", ".join(label(p, prefix) for p in points))
    for model in dict.fromkeys(p[0] for p in points) if args.count_flops else ():
        _, B, cfg, mode, sw = next(p for p in points if p[0] == model)
        f = count_flops(model, point_config(args, model, B, cfg, mode, SWITCHES.get(sw, {})))
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
    args = ap.parse_args(argv)
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
    import torch

    from ddpo_grpo.models import GPU_ONLY

    real = [m for m in (list(MODELS) if args.all_models else [args.model]) if m in GPU_ONLY]
    if torch.cuda.is_available():
        args.device = "cuda"
    elif not (args.allow_cpu or args.dry_run):
        fail("no CUDA device: this benchmark measures the GPU path; run it on a GPU machine, or give --allow-cpu "
             f"--resolution 64 for a CPU smoke run (or --dry-run)")
    else:
        args.device = "cpu"
        if real and not args.dry_run:
            fail(f"{', '.join(real)} on CPU: the real-shape builds (3.5-17 B parameters in all) run on a GPU; "
                 "on CPU use --dry-run [--count-flops]")
        if args.allow_cpu and (args.resolution or 512) > MAX_CPU_RESOLUTION:
            fail(f"--allow-cpu with --resolution {args.resolution or 512}: on CPU use <= {MAX_CPU_RESOLUTION} "
                 "(e.g. 64)")
    from ddpo_grpo.trainer.build import validate_config
    from ddpo_grpo.errors import ConfigError

    points = plan(args)
    for point in points:  # every config checked before the first model is built
        model, B, cfg, mode, sw = point
        try:
            validate_config(point_config(args, model, B, cfg, mode, SWITCHES.get(sw, {})), num_processes=1)
        except ConfigError as e:
            fail(f"{'' if model == 'sd15-random' else model + ' '}B={B} cfg={cfg} {mode} {sw}: {e}")
    if args.dry_run:
        dry_run(args, points)
        return
    t0 = time.time()
    results = []
    for point in points:
        print(f"[{time.time() - t0:6.0f}s] {label(point, True)}", file=sys.stderr, flush=True)
        results.append(measure_point(args, *point))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
            "num_batches": args.num_batches, "peak_tflops": args.peak_tflops, "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump({"meta": meta, "points": results}, f, indent=1)
    with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
        f.write(f"{meta['gpu'] or 'cpu'}, torch {meta['torch']}, {meta['date']}\n\n{table(results)}\n")
    print(table(results))
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

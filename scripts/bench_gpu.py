"""GPU benchmark at Stable Diffusion 1.5's scale: the trainer's epoch on `sd15_random_bench` (SD 1.5-shaped,
random weights, no download) against the same bare floor as scripts/bench.py (benchmarks/bench_floor.py), on CUDA
in bf16 autocast (the log-prob math stays fp32).

    python scripts/bench_gpu.py                                   # B 4,8,16 x CFG off/on x LoRA r8 / full, 512 px
    python scripts/bench_gpu.py --batch-sizes 8 --cfg on --modes lora --switches all   # + one switch at a time
    python scripts/bench_gpu.py --dry-run                         # print the plan, validate configs, load nothing
    python scripts/bench_gpu.py --allow-cpu --resolution 64 --batch-sizes 2 --cfg off --modes lora --num-steps 2

Per grid point (in this process, one after the other): the floor (bench_floor.floor: denoiser forwards of the
epoch's sampling and forward+backward calls of its training, AdamW steps, nothing else), then the real trainer
(build_context, one warm-up epoch, one timed epoch of sample_epoch / rewards / advantages / train_epoch).
Reported: sampling images/s, training sample-steps/s (sample x trained-timestep pairs), peak GPU memory
(torch.cuda.max_memory_allocated), each with its ratio to the floor, and MFU = UNet FLOPs of the calls / seconds
/ --peak-tflops (989: H100 SXM dense bf16). UNet FLOPs per row are counted once per point with
torch.utils.flop_counter on one forward (and one forward+backward for training, LoRA or full as configured);
the text encoder, VAE decode and DDIM step are time but not model FLOPs.

--switches: each of attention=math (instead of SDPA), channels_last, gradient checkpointing, timestep stacking
(train.timesteps_per_call=4) and torch.compile of the UNet, one at a time, at every grid point given.
Output: a markdown table on stdout and <out>/bench_gpu.json ({meta, points: [...]}).
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
    "attention_math": {"unet_attention": "math"},
    "channels_last": {"channels_last": True},
    "grad_ckpt": {"gradient_checkpointing": True},
    "stack4": {"train.timesteps_per_call": 4},
    "compile": {"compile_unet": "default"},
}
MAX_CPU_RESOLUTION = 128  # CPU runs are smoke tests: SD at 512 px on a CPU takes minutes per call


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def point_config(args, B: int, cfg: bool, mode: str, overrides: dict):
    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo

    c = grpo.get_config(args.config_name)
    c.pretrained.resolution = args.resolution
    c.mixed_precision = "bf16" if args.device == "cuda" else "no"  # bf16 autocast on CPU is slow and not the point
    c.sample.batch_size = c.train.batch_size = B
    c.sample.num_steps = args.num_steps
    c.sample.num_batches_per_epoch = args.num_batches
    c.sample.k = 2  # any k dividing the epoch; the geometry does not change the cost
    c.sample.guidance_scale = 5.0 if cfg else 1.0
    c.use_lora, c.lora_rank = mode == "lora", 8
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


def unet_flops(unet, config, device: str, rows_in, train: bool) -> float:
    """FLOPs of one UNet call on one row (1 x C x H x W), forward only or forward + backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.bench_floor import _autocast

    cfg = unet.config
    x = torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size, device=device)
    emb = torch.zeros(1, rows_in, cfg.cross_attention_dim, device=device)
    t = torch.tensor([500], device=device)
    counter = FlopCounterMode(display=False)
    with counter, _autocast(config, device), torch.set_grad_enabled(train):
        out = unet(x, t, encoder_hidden_states=emb).sample
        if train:
            out.float().mean().backward()
    unet.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def trainer_epoch(config, device: str) -> dict:
    """One warm-up epoch and one timed epoch of the real trainer in this process; phase seconds and peak memory."""
    import torch
    from accelerate import Accelerator

    from ddpo_grpo.trainer.advantages import compute_advantages
    from benchmarks.bench_floor import _sync
    from ddpo_grpo.trainer.build import build_context
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.sampling import sample_epoch
    from ddpo_grpo.trainer.training import train_epoch

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
            samples = sample_epoch(ctx, epoch)
            rewards = collect_rewards(samples.reward_futures, acc)
            _sync(device)
            t1 = time.perf_counter()
            adv = compute_advantages(acc, ctx.stat_tracker, samples.keys, torch.from_numpy(rewards.avg),
                                     torch.from_numpy(rewards.valid), config.train.max_invalid_fraction)
            t2 = time.perf_counter()
            train_epoch(ctx, samples, adv, epoch)
            _sync(device)
            out = {"sampling_s": t1 - t0, "training_s": time.perf_counter() - t2, "samples": int(len(samples.keys))}
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        unet = acc.unwrap_model(ctx.unet)
        rows_in = int(ctx.neg_embed.shape[1])  # prompt length (77 for SD)
        out["flops_fwd_row"] = unet_flops(unet, config, device, rows_in, train=False)
        out["flops_train_row"] = unet_flops(unet, config, device, rows_in, train=True)
        ctx.rewards.executor.shutdown(wait=False)
    del ctx, acc
    return out


def measure_point(args, B: int, cfg: bool, mode: str, switch: str) -> dict:
    import torch

    from benchmarks.bench_floor import floor

    config = point_config(args, B, cfg, mode, SWITCHES.get(switch, {}))
    row = {"batch_size": B, "cfg": cfg, "mode": mode, "switch": switch, "resolution": args.resolution}
    try:
        fl = floor(config, warmup=True, repeats=1, device=args.device)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        tr = trainer_epoch(config, args.device)
    except Exception as e:  # noqa: BLE001 - one failed point (e.g. out of memory) must not lose the others
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return row
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    peak = args.peak_tflops * 1e12
    sample_rows = fl["sampling_forwards"] * fl["sampling_rows_per_forward"]  # rows per epoch, CFG doubled
    train_rows = fl["train_sample_timesteps"] * (2 if fl["cfg_train"] else 1)
    samples = tr["samples"]
    row.update({
        "images_per_s": samples / tr["sampling_s"], "floor_images_per_s": samples / fl["sampling_s"],
        "train_steps_per_s": fl["train_sample_timesteps"] / tr["training_s"],
        "floor_train_steps_per_s": fl["train_sample_timesteps"] / fl["training_s"],
        "sampling_over_floor": tr["sampling_s"] / fl["sampling_s"],
        "training_over_floor": tr["training_s"] / fl["training_s"],
        "peak_mem_mb": tr["cuda_peak_mb"], "floor_peak_mem_mb": fl["cuda_peak_mb"],
        "mfu_sampling": tr["flops_fwd_row"] * sample_rows / tr["sampling_s"] / peak,
        "mfu_training": tr["flops_train_row"] * train_rows / tr["training_s"] / peak,
        "flops_fwd_row": tr["flops_fwd_row"], "flops_train_row": tr["flops_train_row"],
        "trainer": tr, "floor": {k: v for k, v in fl.items() if not isinstance(v, dict)},
    })
    return row


def plan(args):
    switches = ["none"] + ([s for s in SWITCHES] if args.switches == "all" else
                           [s for s in args.switches.split(",") if s])
    return [(B, cfg, mode, sw) for mode in args.modes for B in args.batch_sizes for cfg in args.cfg for sw in switches]


def table(points) -> str:
    head = ("| mode | B | CFG | switch | images/s (floor) | train steps/s (floor) | peak MB (floor) | MFU sample | "
            "MFU train |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for p in points:
        if "error" in p:
            lines.append(f"| {p['mode']} | {p['batch_size']} | {p['cfg']} | {p['switch']} | {p['error']} ||||")
            continue
        mem = "n/a" if p["peak_mem_mb"] is None else f"{p['peak_mem_mb']:.0f} ({p['floor_peak_mem_mb']:.0f})"
        lines.append(f"| {p['mode']} | {p['batch_size']} | {'on' if p['cfg'] else 'off'} | {p['switch']} | "
                     f"{p['images_per_s']:.2f} ({p['floor_images_per_s']:.2f}) | {p['train_steps_per_s']:.1f} "
                     f"({p['floor_train_steps_per_s']:.1f}) | {mem} | {p['mfu_sampling']:.3f} | "
                     f"{p['mfu_training']:.3f} |")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--config-name", default="sd15_random_bench", help="a config in config/grpo.py")
    ap.add_argument("--batch-sizes", type=ints, default=[4, 8, 16], help="per-device batch sizes")
    ap.add_argument("--cfg", choices=["off", "on", "both"], default="both")
    ap.add_argument("--modes", default="lora,full", help="lora (rank 8) and/or full fine-tuning")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--num-steps", type=int, default=20)
    ap.add_argument("--num-batches", type=int, default=2, help="sampling batches per epoch")
    ap.add_argument("--switches", default="", help=f"'all' or a comma list of {', '.join(SWITCHES)}")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--allow-cpu", action="store_true", help=f"run on CPU (resolution <= {MAX_CPU_RESOLUTION})")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no model")
    ap.add_argument("--out", default="bench_results/gpu")
    args = ap.parse_args(argv)
    args.cfg = {"off": [False], "on": [True], "both": [False, True]}[args.cfg]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - {"lora", "full"}:
        fail(f"--modes {','.join(args.modes)!r}: choose from lora, full")
    unknown = set(args.switches.split(",")) - set(SWITCHES) - {"", "all"}
    if unknown:
        fail(f"--switches: unknown {', '.join(sorted(unknown))}; choose 'all' or from {', '.join(SWITCHES)}")
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.peak_tflops <= 0:
        fail("--batch-sizes must be positive integers and --peak-tflops > 0")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    import torch

    if torch.cuda.is_available():
        args.device = "cuda"
    elif not (args.allow_cpu or args.dry_run):
        fail("no CUDA device: this benchmark measures the GPU path; run it on a GPU machine, or give --allow-cpu "
             f"--resolution 64 for a CPU smoke run (or --dry-run)")
    else:
        args.device = "cpu"
        if args.allow_cpu and args.resolution > MAX_CPU_RESOLUTION:
            fail(f"--allow-cpu with --resolution {args.resolution}: on CPU use <= {MAX_CPU_RESOLUTION} (e.g. 64)")
    from ddpo_grpo.trainer.build import validate_config
    from ddpo_grpo.errors import ConfigError

    points = plan(args)
    for B, cfg, mode, sw in points:  # every config checked before the first model is built
        try:
            validate_config(point_config(args, B, cfg, mode, SWITCHES.get(sw, {})), num_processes=1)
        except ConfigError as e:
            fail(f"B={B} cfg={cfg} {mode} {sw}: {e}")
    if args.dry_run:
        print(f"plan: {len(points)} points on {args.device} at {args.resolution} px: " +
              ", ".join(f"{m}/B{B}/cfg-{'on' if c else 'off'}/{s}" for B, c, m, s in points))
        return
    t0 = time.time()
    results = []
    for B, cfg, mode, sw in points:
        print(f"[{time.time() - t0:6.0f}s] {mode} B={B} cfg={cfg} {sw}", file=sys.stderr, flush=True)
        results.append(measure_point(args, B, cfg, mode, sw))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
            "resolution": args.resolution, "num_steps": args.num_steps, "num_batches": args.num_batches,
            "peak_tflops": args.peak_tflops, "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump({"meta": meta, "points": results}, f, indent=1)
    print(table(results))
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

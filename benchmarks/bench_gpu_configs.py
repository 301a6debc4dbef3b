"""scripts/bench_gpu.py's points as configs: the models it measures (MODELS, each run at its named config in
config/grpo.py), the speed switches (SWITCHES), a point's config (`point_config`) and a model's default grid
(`defaults`). The GPU check's points (benchmarks/gpu_check_points.py) are built from these."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWITCHES = {  # name -> config overrides, measured one at a time against the baseline point
    "attention_math": {"unet_attention": "math"}, "channels_last": {"channels_last": True},
    "grad_ckpt": {"gradient_checkpointing": True}, "stack4": {"train.timesteps_per_call": 4},
    "compile": {"compile_unet": "default"}}
# models.BUILT name -> its named config in config/grpo.py. The real-shape ones are models.GPU_ONLY: refused on a CPU
# here (before any config is read; --dry-run builds them on "meta") and by the loader (for the trainer).
MODELS = {"sd15-random": "sd15_random_bench", "sdxl-random": "sdxl", "sd35-medium-random": "sd3",
          "flux-dev-random": "flux", "wan21-1.3b-random": "wan", "recam-1.3b-random": "recam"}

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

"""scripts/gpu_check.sh's points (GPU_CHECK): each real-shape build's config (`gpu_check_config`, a point of
benchmarks/bench_gpu_configs.py cut to fit its time-out), and what the check reads beside its measured rows, counted
on meta-device builds (`gpu_check_counts`: the memory plan, whether it needs gradient checkpointing, FLOPs per row)."""
from __future__ import annotations

from benchmarks.bench_gpu_configs import MODELS, fail, named_config, point_config
from benchmarks.bench_gpu_point import count_flops

# scripts/gpu_check.sh: each real-shape build once, in its own process under its own time-out, cheapest first (a hang
# late loses least), all six within ~450 s of time-outs on one 80 GB GPU (8 minutes with the host's start-up). Each
# runs its named config (LoRA or full as it says, bf16, its resolution, B, CFG, rank) with the steps and sampling
# batches cut to fit the time: model -> (time-out s, sampling B, steps, gradient checkpointing, other overrides).
# Gradient checkpointing is on where the memory plan says the point does not fit 80 GB without it (the dry run
# checks each choice against the plan). recam: 33 frames instead of its config's 81 (the 81-frame source + target
# clip is ~38 k tokens a row: one training step-sample alone is tens of seconds); 33 is Wan's config's count. And
# recam's rewards are jpeg_compressibility, the other five's: its config's unifiedscore asks a reward server
# (127.0.0.1:30000) that a GPU check host does not run, and cam_score would time its camera estimator on the host's
# CPUs, not the trainer (a checkout on PYTHONPATH finds it since ddpo_grpo/plugins.py). The reward runs beside the
# denoiser (a thread pool) either way.
GPU_CHECK_MEMORY_GIB = 80.0
GPU_CHECK_CONDITIONS = 8  # training conditions (prompts) of a gpu check run: gpu_check_config says why
GPU_CHECK = {
    # time-outs from the first H100 run (2026-11-27, whole process): sd15 37 s, SD3.5 55 s, SDXL 55 s, FLUX 79 s;
    # Wan did not finish two epochs in 80 s at 33 frames and ReCamMaster's first two steps took 40 s (its attention
    # over source + target frames; docs/performance.md): both now at 17 frames (5 latent frames, about a third of
    # the attention of 9)
    "sd15-random": (50, 8, 10, False, {}),
    "sd35-medium-random": (65, 8, 6, False, {}),
    "sdxl-random": (65, 4, 8, False, {}),
    "wan21-1.3b-random": (85, 2, 4, False, {"pretrained.num_frames": 17}),
    # recam at the 480 x 480 px it was timed at (its config's own size is 480 x 832 since issue 46: 1.7x the tokens)
    # and on the 2-D video world (its config's room3d ray-casts 480 px frames on the host: seconds a condition)
    "recam-1.3b-random": (95, 2, 2, True, {"pretrained.num_frames": 17, "reward.fns": {"jpeg_compressibility": 1.0},
                                           "data.name": "recam_video",
                                           "reward.kwargs": {}, "pretrained.resolution": 480, "pretrained.height": 0,
                                           "pretrained.width": 0}),
    # FLUX without gradient checkpointing since issue 61's plan (weights once, LoRA activations with its adapters:
    # 63.2 GiB planned without it; it was on while the plan counted the weights twice and every layer trainable)
    "flux-dev-random": (90, 8, 6, False, {}),
}


def gpu_check_config(args, model: str, ckpt=None):
    """The config gpu_check.sh runs `model` at: its named config's mode (LoRA / full), CFG, rank and resolution, with
    GPU_CHECK's sampling B, steps and gradient checkpointing (`ckpt` overrides: the plan's check), one sampling batch,
    bf16 (also on the dry run's CPU, so that the plan it prints is the GPU run's). train.onpolicy_check="warn": the
    check's stop would end the point before its timings; the table compares the worst |r - 1| with the tolerance
    instead and gpu_check.sh fails on it there."""
    _, B, steps, ckpt_default, extra = GPU_CHECK[model]
    named = named_config(MODELS[model])
    cfg = float(named.sample.guidance_scale) != 1.0
    mode = "lora" if named.use_lora else "full"
    # 8 training conditions, evaluated on themselves (eval_freq is 0 anyway): with data.cache_embeddings the whole
    # prompt set is encoded before the first step, one prompt per call (embeddings.py: bit-identical to an uncached
    # run), and the toy world's 2281 prompts through a T5-XXL / UMT5-XXL take minutes at real shape (issue 50's
    # silent Wan / SD3.5 start). The per-step cost does not depend on how many prompts there are.
    over = {"sample.num_steps": steps, "sample.num_batches_per_epoch": 1, "data.num_conditions": GPU_CHECK_CONDITIONS,
            "eval.split": "train", "gradient_checkpointing": ckpt_default if ckpt is None else ckpt,
            "train.onpolicy_check": "warn", **extra}
    c = point_config(args, model, B, cfg, mode, over)
    c.mixed_precision = "bf16"
    return c


def gpu_check_point(model: str):
    """(model, B, cfg, mode, switch) of gpu_check_config's run, for labels and the plan line."""
    named = named_config(MODELS[model])
    return (model, GPU_CHECK[model][1], float(named.sample.guidance_scale) != 1.0,
            "lora" if named.use_lora else "full", "none")


def memory_plan_gib(config, capacity_gib: float = GPU_CHECK_MEMORY_GIB, counts=None):
    """(the memory plan's total per device in GiB, whether it fits `capacity_gib`) for a one-process launch, read
    from memory_plan.report's lines (the plan print_plan prints at a run's start: one definition of the number)."""
    from ddpo_grpo.trainer.checks.memory_plan import report

    before = config.device_memory_gb
    config.device_memory_gb = capacity_gib  # the verdict for an 80 GB card, also on a CPU
    try:
        lines = report(config, environ={}, counts=counts)
    finally:
        config.device_memory_gb = before
    total = next(float(line.split(":", 1)[1].split()[0]) for line in lines if line.startswith("total per device:"))
    return total, any(line.startswith("fits ") for line in lines)


def gpu_check_counts(args, model: str) -> dict:
    """What gpu_check.sh reads beside the measured rows, from meta-device builds (no GPU): the memory plan of the
    point (its peak is compared with it), whether the plan needs gradient checkpointing on 80 GB (it must agree with
    GPU_CHECK's choice, else one line, exit 2), and count_flops' FLOPs per row (the MFU)."""
    from ddpo_grpo.trainer.checks.meta_counts import count_model, meta_pipeline

    config = gpu_check_config(args, model)
    # The two plans differ only in gradient checkpointing; the meta count (most of the time: a T5-XXL and the
    # denoiser built on "meta") holds both activation figures of the config's own mode (LoRA or full) when made with
    # only_configured=False, configured_mode_only=True, so it is made once per model and passed to both plans (it
    # used to be swapped in by monkeypatching meta_counts.count_model, which memory_plan's own import of the name
    # kept after the first model: every later build got sd15's counts).
    # One meta build serves both counts (building one is ~1/6 of a model's time here): count_flops works on a copy of
    # its denoiser, before count_model adds its LoRA count's adapters to it.
    pipe = meta_pipeline(config)
    flops = count_flops(model, config, pipe=pipe)
    counts = count_model(config, pipe=pipe, only_configured=False, precision=config.mixed_precision,
                         configured_mode_only=True)
    plan_gib, fits = memory_plan_gib(config, counts=counts)
    _, fits_without = memory_plan_gib(gpu_check_config(args, model, ckpt=False), counts=counts)
    ckpt = bool(config.gradient_checkpointing)
    if ckpt == fits_without:
        fail(f"{model}: GPU_CHECK says gradient checkpointing {'on' if ckpt else 'off'}, but the memory plan "
             f"{'fits' if fits_without else 'does not fit'} {GPU_CHECK_MEMORY_GIB:.0f} GiB without it: set it "
             f"{'off' if fits_without else 'on'} in benchmarks/gpu_check_points.py")
    if not fits:
        fail(f"{model}: the memory plan of its gpu check point ({plan_gib:.1f} GiB) does not fit "
             f"{GPU_CHECK_MEMORY_GIB:.0f} GiB; cut GPU_CHECK's batch in benchmarks/gpu_check_points.py")
    out = {"plan_gib": plan_gib, "gradient_checkpointing": ckpt}
    out.update(flops)
    return out

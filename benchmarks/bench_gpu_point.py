"""One point of scripts/bench_gpu.py, measured: the real trainer's warm-up and timed epochs in this process
(trainer_epoch), the denoiser's FLOPs per row on a meta-device build (count_flops) and the row with its MFU (measure);
scripts/bench_gpu.py decides the points (its grid, the GPU check's builds) and writes the tables."""
from __future__ import annotations

import gc
import tempfile
import time


def count_flops(model: str, config, train: bool = True) -> dict:
    """FLOPs of one denoiser call on one row (denoiser_inputs): forward (sampling) and, with `train`, forward +
    backward (training: LoRA or full, as configured), counted by torch.utils.flop_counter on a meta-device build at
    the config's shapes (nothing is allocated: the same count on any machine), without gradient checkpointing (its
    recomputed forward is not model FLOPs). Also the denoiser's parameters and the shapes."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable
    from ddpo_grpo.trainer.checks.meta_counts import denoiser_inputs

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


def _is_number(v) -> bool:
    """A metric float() takes (Python or numpy scalars, one-element tensors), not a list or a string."""
    try:
        float(v)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not isinstance(v, str)


def trainer_epoch(config, device: str) -> dict:
    """One warm-up epoch and one timed epoch of the real trainer in this process: phase seconds, peak memory and the
    rows the denoiser ran (sampling: batches x steps x B, doubled by CFG; training: the call plan's sample-steps,
    doubled by CFG training, and as many reference forwards when train.beta > 0)."""
    import torch
    from accelerate import Accelerator

    from benchmarks.bench_floor import _sync
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.epoch import advantages, sampling, training, update
    from ddpo_grpo.trainer.run.build import build_context

    acc = Accelerator(cpu=device == "cpu", mixed_precision=config.mixed_precision)
    out, epochs = {}, []
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
            if device == "cuda":  # the sampling phase's peak (decode included), then the training phase's alone
                sampling_peak = torch.cuda.max_memory_allocated() / 2**20
                torch.cuda.reset_peak_memory_stats()
            adv = advantages.compute_advantages(acc, ctx.stat_tracker, samples.keys, torch.from_numpy(rewards.avg),
                                                torch.from_numpy(rewards.valid), config.train.max_invalid_fraction)
            t2 = time.perf_counter()
            metrics = training.train_epoch(ctx, samples, adv, epoch) or {}
            _sync(device)
            t3 = time.perf_counter()
            epochs.append({k: float(v) for k, v in metrics.items() if _is_number(v)})
            out = {"sampling_s": t1 - t0, "training_s": t3 - t2, "epoch_s": t3 - t0, "samples": int(len(samples.keys))}
        # the on-policy deviation and the sampler gap over both epochs (the warm-up's first calls count too); a key
        # train_epoch does not return (an older trainer) is None, printed "-"
        worst = lambda key: max((e[key] for e in epochs if key in e), default=None)  # noqa: E731
        out.update(onpolicy_ratio_max_dev=worst("onpolicy_ratio_max_dev"), sampler_gap_max=worst("sampler_gap_max"),
                   sampler_gap_mean=epochs[-1].get("sampler_gap_mean"), metrics=epochs,
                   startup={k: v for k, v in ctx.startup.items() if not k.endswith("_at")})
        if device == "cuda":  # the epoch's peak is the larger phase's (what the memory plan adds up)
            out["cuda_peak_training_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["cuda_peak_sampling_mb"] = sampling_peak
            out["cuda_peak_mb"] = max(sampling_peak, out["cuda_peak_training_mb"])
        else:
            out["cuda_peak_mb"] = None
        s, t = config.sample, config.train
        cfg = float(s.guidance_scale) != 1.0
        out["sampling_rows"] = int(s.num_batches_per_epoch) * int(s.num_steps) * int(s.batch_size) * (2 if cfg else 1)
        N, T = samples.log_probs.shape
        columns = update.trainable_columns(samples, config)
        steps = sum(idx.numel() * cols.shape[1] for inner in range(int(t.num_inner_epochs))
                    for idx, cols in update.training_calls(N, T, config, 1, inner, 0, 1, columns)[0])
        out["train_rows"] = int(steps) * (2 if cfg and t.cfg else 1)
        out["train_sample_steps"] = int(steps)
        out["reference_rows"] = out["train_rows"] if t.beta > 0 else 0
        ctx.rewards.shutdown()
    del ctx, acc
    return out


def measure(args, config, model: str, B: int, cfg: bool, mode: str, switch: str) -> dict:
    """One point of scripts/bench_gpu.py at its config: FLOPs per row (unless the GPU check counts them apart), the
    floor where sd15-random's grid measures it, the trainer's epochs, and the row with MFU; a failure is the row's
    "error", not a lost run."""
    import torch

    from benchmarks.bench_floor import floor

    row = {"model": model, "batch_size": B, "cfg": cfg, "mode": mode, "switch": switch,
           "resolution": int(config.pretrained.resolution), "num_steps": int(config.sample.num_steps),
           "gradient_checkpointing": bool(config.gradient_checkpointing)}
    try:  # the on-policy check's bound for this run's dtype (bf16 on CUDA: clip_range / 2)
        from ddpo_grpo.core.loss import onpolicy_tolerance
        from ddpo_grpo.models.base import run_dtype

        row["onpolicy_tol"] = onpolicy_tolerance(run_dtype(config.mixed_precision), float(config.train.clip_range),
                                                 args.device == "cuda" and config.mixed_precision == "no")
    except Exception:  # noqa: BLE001 - a bound that cannot be read is shown "-", not a lost point
        row["onpolicy_tol"] = None
    try:
        if args.count:  # gpu_check.sh counts in a CPU process beside the GPU runs (--counts-out) instead
            row.update(count_flops(model, config))
        fl = (floor(config, True, 1, args.device)
              if model == "sd15-random" and not (args.all_models or args.gpu_check) else None)
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
        tr = trainer_epoch(config, args.device)
    except Exception as e:  # noqa: BLE001 - one failed point (e.g. out of memory) must not lose the others
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        import traceback

        row["traceback"] = traceback.format_exc()[-2000:]  # where it failed: the row is all a killed run keeps
        return row
    finally:
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
    row.update({
        "epoch_s": tr["epoch_s"], "samples_per_s": tr["samples"] / tr["sampling_s"],
        "train_steps_per_s": tr["train_sample_steps"] / tr["training_s"], "peak_mem_mb": tr["cuda_peak_mb"],
        "onpolicy_ratio_max_dev": tr["onpolicy_ratio_max_dev"], "sampler_gap_max": tr["sampler_gap_max"],
        "sampler_gap_mean": tr["sampler_gap_mean"], "startup": tr["startup"], "trainer": tr,
    })
    if "flops_fwd_row" in row:
        row.update(mfu(row, args.peak_tflops))
    if fl is not None:
        row.update({
            "floor_samples_per_s": tr["samples"] / fl["sampling_s"],
            "floor_train_steps_per_s": fl["train_sample_timesteps"] / fl["training_s"],
            "sampling_over_floor": tr["sampling_s"] / fl["sampling_s"],
            "training_over_floor": tr["training_s"] / fl["training_s"],
            "floor_peak_mem_mb": fl["cuda_peak_mb"], "floor": {k: v for k, v in fl.items() if not isinstance(v, dict)},
        })
    return row


def mfu(row: dict, peak_tflops: float) -> dict:
    """MFU of sampling and training: the denoiser FLOPs of the epoch's calls (count_flops' per-row counts times the
    rows trainer_epoch ran) per second over the GPU's peak."""
    tr, peak = row["trainer"], peak_tflops * 1e12
    train_flops = tr["train_rows"] * row["flops_train_row"] + tr["reference_rows"] * row["flops_fwd_row"]
    return {"mfu_sampling": row["flops_fwd_row"] * tr["sampling_rows"] / tr["sampling_s"] / peak,
            "mfu_training": train_flops / tr["training_s"] / peak}

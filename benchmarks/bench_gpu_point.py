"""One point of scripts/bench_gpu.py, measured: the real trainer's warm-up and timed epochs in this process
(trainer_epoch), the denoiser's FLOPs per row on a meta-device build (count_flops) and the row with its MFU (measure);
scripts/bench_gpu.py decides the points (its grid, the GPU check's builds) and writes the tables."""
from __future__ import annotations

import gc
import importlib
import tempfile
import time


class _GlobalOnly:
    """A module tracker that is always in "Global" alone: FlopCounterMode adds each op's FLOPs to every name in its
    tracker's `parents`, and its own tracker hooks every module (and, in a backward, every module's gradients) for
    per-module tables that a total does not read. Measured on the meta builds here: SDXL's counted forward + training
    pass 10.8 s -> 7.6 s, FLUX's 9.8 s -> 8.6 s, the same totals."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def total_flop_counter():
    """torch.utils.flop_counter.FlopCounterMode for get_total_flops() only (_GlobalOnly: no per-module tracking)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalOnly()
    return counter


def count_flops(model: str, config, train: bool = True, pipe=None) -> dict:
    """FLOPs of one denoiser call on one row (denoiser_inputs): forward (sampling) and, with `train`, forward +
    backward (training: LoRA or full, as configured), counted by torch.utils.flop_counter on a meta-device build at
    the config's shapes (nothing is allocated: the same count on any machine), without gradient checkpointing (its
    recomputed forward is not model FLOPs). Also the denoiser's parameters and the shapes. `pipe`: the config's meta
    pipeline (meta_counts.meta_pipeline), already built by the caller, untrained and unchanged: its denoiser is copied
    (training adds the adapters to the copy), so the caller can count it again (scripts/bench_gpu.py's GPU check)."""
    import torch

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable
    from ddpo_grpo.trainer.checks.meta_counts import denoiser_inputs

    if pipe is None:
        pipe = load_pipeline(model, torch.float32, "meta", int(config.pretrained.resolution))
        pipe.adapter.configure(pipe, config)  # FLUX-dev's embedded guidance, Wan's frames
    else:  # a meta copy costs no memory; the caller's denoiser keeps its parameters as they are
        import copy
        import dataclasses

        pipe = dataclasses.replace(pipe, unet=copy.deepcopy(pipe.unet))
    x, t, cond = denoiser_inputs(pipe)
    out = {"denoiser_params": sum(p.numel() for p in inner_model(pipe.unet).parameters()),
           "sample_shape": list(pipe.sample_shape), "condition_shape": list(cond.shape[1:])}
    counter = total_flop_counter()
    with counter, torch.no_grad():
        pipe.unet(x, t, encoder_hidden_states=cond)
    out["flops_fwd_row"] = float(counter.get_total_flops())
    if train:
        make_trainable(pipe.unet, config, pipe.adapter.lora_target_modules)
        counter = total_flop_counter()
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


class _Denoiser:
    """The rows of every denoiser call in this process's epochs (a forward pre-hook on ctx.unet: x's batch dimension,
    CFG's doubled batch included) by phase, and the seconds of the rescore pass (rescoring.rescore_old_logprobs,
    wrapped where the epoch modules call it; device-synchronised at both ends). Phases: "sampling", and in training
    "rescore" (its calls), "train_grad" (calls with autograd on: the update's forward + backward) and "train_nograd"
    (the rest without autograd: the KL reference, the policy-shift probe). Counted calls are MFU's rows, whatever
    the trainer's call plan is (a re-score on some epochs only, a probe, a reference)."""

    def __init__(self, unet, device: str):
        import torch

        self.device, self.phase, self.in_rescore = device, "sampling", 0
        self.rows: dict = {}
        self.rescore_s = 0.0
        self.rescore_calls = 0
        self._hook = unet.register_forward_pre_hook(self._count)
        self._patched = []
        for name in ("training", "rescoring"):  # where the trainer calls it from (a from-import binds it in each)
            module = importlib.import_module(f"ddpo_grpo.trainer.epoch.{name}")
            fn = getattr(module, "rescore_old_logprobs", None)
            if fn is not None:
                self._patched.append((module, fn))
                setattr(module, "rescore_old_logprobs", self._timed(fn))
        self._torch = torch

    def _count(self, module, args):
        x = args[0] if args else None
        n = int(x.shape[0]) if hasattr(x, "shape") and len(x.shape) else 0
        if self.phase == "training":
            key = "rescore" if self.in_rescore else (
                "train_grad" if self._torch.is_grad_enabled() else "train_nograd")
        else:
            key = self.phase
        self.rows[key] = self.rows.get(key, 0) + n

    def _timed(self, fn):
        from benchmarks.bench_floor import _sync

        def wrapper(*a, **kw):
            if self.in_rescore:  # (one wrapper calling through another: timed once)
                return fn(*a, **kw)
            _sync(self.device)
            t0 = time.perf_counter()
            self.in_rescore += 1
            try:
                return fn(*a, **kw)
            finally:
                self.in_rescore -= 1
                _sync(self.device)
                self.rescore_s += time.perf_counter() - t0
                self.rescore_calls += 1
        return wrapper

    def start_epoch(self) -> None:
        self.rows, self.rescore_s, self.rescore_calls = {}, 0.0, 0

    def close(self) -> None:
        self._hook.remove()
        for module, fn in self._patched:
            setattr(module, "rescore_old_logprobs", fn)


class _TimedReads:
    """ctx.train_data, with the seconds its reads take: the conditions each sampling batch reads (a world's host
    render of its source and target clips, a dataset's decode), which the sampling phase's seconds hold beside the
    denoiser's. Everything else is the dataset's own."""

    def __init__(self, data):
        self._data, self.seconds = data, 0.0

    def __getitem__(self, i):
        t0 = time.perf_counter()
        try:
            return self._data[i]
        finally:
            self.seconds += time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name):
        return getattr(self._data, name)


def _peaks(device: str) -> tuple:
    """(max allocated, max reserved) MiB since the last reset; (None, None) off CUDA."""
    if device != "cuda":
        return None, None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20


def trainer_epoch(config, device: str) -> dict:
    """One warm-up epoch and one timed epoch of the real trainer in this process: phase seconds (the rescore pass's
    within training), peak memory per phase (allocated and reserved) and the rows the denoiser ran, counted per
    phase on its calls (_Denoiser) and, as before, from the config (sampling: batches x steps x B, doubled by CFG;
    training: the call plan's sample-steps, doubled by CFG training, and as many reference forwards when
    train.beta > 0)."""
    import torch
    from accelerate import Accelerator

    from benchmarks.bench_floor import _sync
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.epoch import advantages, sampling, training, update
    from ddpo_grpo.trainer.run.build import build_context

    acc = Accelerator(cpu=device == "cpu", mixed_precision=config.mixed_precision)
    out, epochs, timings = {}, [], []
    with tempfile.TemporaryDirectory() as d:
        ctx = build_context(config, acc, d)
        ctx.train_data = reads = _TimedReads(ctx.train_data)
        counter = _Denoiser(ctx.unet, device)
        try:
            for epoch in range(2):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                ctx.stat_tracker.clear()
                counter.start_epoch()
                counter.phase = "sampling"
                reads.seconds = 0.0
                _sync(device)
                t0 = time.perf_counter()
                samples = sampling.sample_epoch(ctx, epoch)
                t_sampled = time.perf_counter()
                rewards = collect_rewards(samples.reward_futures, acc)
                _sync(device)
                t1 = time.perf_counter()
                data_s = reads.seconds  # the sampling phase's reads only (training's, if any, not counted)
                sampling_peak = _peaks(device)  # the sampling phase's (decode included); then training's alone
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                adv = advantages.compute_advantages(acc, ctx.stat_tracker, samples.keys,
                                                    torch.from_numpy(rewards.avg), torch.from_numpy(rewards.valid),
                                                    config.train.max_invalid_fraction)
                counter.phase = "training"
                t2 = time.perf_counter()
                metrics = training.train_epoch(ctx, samples, adv, epoch) or {}
                _sync(device)
                t3 = time.perf_counter()
                training_peak = _peaks(device)
                epochs.append({k: float(v) for k, v in metrics.items() if _is_number(v)})
                # "-" where the epoch re-scored (its metric) through a path the wrapper did not see
                seen = counter._patched and not (epochs[-1].get("old_logprobs_rescored") and not counter.rescore_calls)
                # the sampling phase's parts that are not the denoiser's: the condition reads, and the wait for
                # rewards still running when the last batch was sampled (they run beside the denoiser)
                out = {"sampling_s": t1 - t0, "training_s": t3 - t2, "epoch_s": t3 - t0,
                       "data_s": data_s, "reward_wait_s": t1 - t_sampled,
                       "samples": int(len(samples.keys)),
                       "rescore_s": counter.rescore_s if seen else None,
                       "rescore_calls": counter.rescore_calls, "rows": dict(counter.rows)}
                if device == "cuda":  # the epoch's peak is the larger phase's (what the memory plan adds up)
                    out.update(cuda_peak_sampling_mb=sampling_peak[0], cuda_peak_training_mb=training_peak[0],
                               cuda_reserved_sampling_mb=sampling_peak[1], cuda_reserved_training_mb=training_peak[1])
                timings.append({k: out[k] for k in ("sampling_s", "training_s", "epoch_s", "rescore_s", "data_s",
                                                    "reward_wait_s")})
        finally:
            counter.close()
        out["epochs_s"] = timings  # [warm-up, timed]: each phase's seconds
        # the on-policy deviation and the sampler gap over both epochs (the warm-up's first calls count too); a key
        # train_epoch does not return (an older trainer) is None, printed "-"
        worst = lambda key: max((e[key] for e in epochs if key in e), default=None)  # noqa: E731
        out.update(onpolicy_ratio_max_dev=worst("onpolicy_ratio_max_dev"), sampler_gap_max=worst("sampler_gap_max"),
                   sampler_gap_mean=epochs[-1].get("sampler_gap_mean"), metrics=epochs,
                   startup={k: v for k, v in ctx.startup.items() if not k.endswith("_at")})
        if device == "cuda":
            out["cuda_peak_mb"] = max(out["cuda_peak_sampling_mb"], out["cuda_peak_training_mb"])
            out["cuda_reserved_mb"] = max(out["cuda_reserved_sampling_mb"], out["cuda_reserved_training_mb"])
        else:
            out["cuda_peak_mb"] = out["cuda_reserved_mb"] = None
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
    finally:
        released = release(args.device)
        if released:  # (after a sticky CUDA error every CUDA call raises it again: said, never raised over the row)
            row["release_error"] = released
    if "error" in row:
        return row
    row.update({
        "epoch_s": tr["epoch_s"], "samples_per_s": tr["samples"] / tr["sampling_s"],
        "train_steps_per_s": tr["train_sample_steps"] / tr["training_s"], "peak_mem_mb": tr["cuda_peak_mb"],
        "reserved_mem_mb": tr.get("cuda_reserved_mb"),
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


def release(device: str) -> str:
    """gc and CUDA's cache emptied around a point; "" or the error that raised. After a sticky CUDA error (an
    illegal memory access: FLUX's first GPU check) every later CUDA call raises it again, empty_cache included: in
    measure's `finally` that replaced the point's error row by a traceback, and the row was lost."""
    try:
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - whatever it is, the row comes first
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return ""


def mfu(row: dict, peak_tflops: float) -> dict:
    """MFU of sampling and training over the GPU's peak, FLOPs and seconds on the same footing: count_flops' per-row
    FLOPs times the rows the denoiser ran in the phase whose seconds divide them. Where trainer_epoch counted the
    calls ("rows": every call of the phase, _Denoiser), training is every training-phase call (the update's forward +
    backward rows at flops_train_row; the rescore pass's, the reference's and the probes' forwards at flops_fwd_row)
    over the whole training phase ("mfu_training"), and the update alone over the training phase less the rescore's
    seconds ("mfu_update"). A row without counted calls (an older run) uses the config's rows: training then counts
    the update and the reference only, over a time that includes the rescore (the first H100 table's "MFU train")."""
    tr, peak = row["trainer"], peak_tflops * 1e12
    fwd, train = row["flops_fwd_row"], row["flops_train_row"]
    rows = tr.get("rows")
    if not rows:
        train_flops = tr["train_rows"] * train + tr["reference_rows"] * fwd
        return {"mfu_sampling": fwd * tr["sampling_rows"] / tr["sampling_s"] / peak,
                "mfu_training": train_flops / tr["training_s"] / peak}
    update = rows.get("train_grad", 0) * train + rows.get("train_nograd", 0) * fwd
    out = {"mfu_sampling": fwd * rows.get("sampling", 0) / tr["sampling_s"] / peak,
           "mfu_training": (update + rows.get("rescore", 0) * fwd) / tr["training_s"] / peak}
    update_s = tr["training_s"] - (tr.get("rescore_s") or 0.0)
    if tr.get("rescore_s") is not None and update_s > 0:
        out["mfu_update"] = update / update_s / peak
    return out

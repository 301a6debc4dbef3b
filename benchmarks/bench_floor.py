"""The compute and memory floor of one training epoch, for scripts/bench.py.

The floor is what an epoch cannot do without: the same model, the same number and size of denoiser
calls as the trainer, and nothing else.

  (a) sampling: num_batches_per_epoch x num_steps forwards at batch B (2B with CFG), under no_grad;
  (b) training: the trainer's own call plan (`update.training_calls`: the same sample-timesteps per
      call and the same calls per optimizer step), each call a forward + backward of a scalar loss,
      and an AdamW step at the trainer's cadence. With train.beta > 0 each call also runs the
      reference forward (no_grad), because the algorithm needs it.

Left out on purpose: scheduler steps and log-probabilities, the loss itself, rewards, advantages,
verification, gradient clipping, the reference's weight swap and EMA update, the supervised loss, the VAE
decode, logging. Inputs are random tensors of the right shapes.

Run as a subprocess (so its peak RSS is its own), with the trainer's own config flags:

    python -m benchmarks.bench_floor --config config/grpo.py:tiny --config.sample.batch_size=8 --out floor.json
    python -m benchmarks.bench_floor --config config/grpo.py:tiny --mode eval --out eval.json  # pretrained eval
    python -m benchmarks.bench_floor --config config/grpo.py:tiny --mode interleaved --repeats 3  # same-process ratio
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Dict, Optional

from benchmarks import refuse  # a refusal: one line, exit 2

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MB = 1024.0 * 1024.0


def proc_status_mb(field: str) -> Optional[float]:
    """VmRSS / VmHWM of this process in MB from /proc/self/status (None where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def stored_steps(config, pipe) -> int:
    """T of the trainer's EpochSamples: the stochastic steps it stores (and trains a fraction of)."""
    from ddpo_grpo.core.families import get_family
    from ddpo_grpo.trainer.epoch.sampling import sampler_settings

    s = config.sample
    return get_family(pipe.family).stored_steps(pipe.scheduler, sampler_settings(config, pipe.family),
                                                int(s.num_steps), int(s.sde_window_size))


def _autocast(config, device: str = "cpu"):
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision)
    return torch.autocast(device, dtype=dtype) if dtype is not None else nullcontext()


def _sync(device: str) -> None:
    """GPU calls return before they finish: wait for them before reading the clock."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def floor(config, warmup: bool = True, repeats: int = 1, device: str = "cpu") -> Dict:
    """Time (a) and (b) for one epoch of `config` (one process, on `device`), best of `repeats`; returns seconds,
    counts and memory (on CUDA also the peak GPU memory, `cuda_peak_mb`)."""
    import torch

    from ddpo_grpo.core.families import get_family
    from ddpo_grpo.trainer.run.build import make_trainable
    from ddpo_grpo.models import apply_unet_options, load_pipeline
    from ddpo_grpo.trainer.epoch.update import training_calls

    from ddpo_grpo.trainer.run.devices import apply_cpu_settings

    apply_cpu_settings(config)  # as the trainer does on CPU
    rss_runtime = proc_status_mb("VmRSS")
    pipe = load_pipeline(config.pretrained.model, resolution=config.pretrained.resolution, device=device)
    unet = pipe.unet
    opt = make_trainable(unet, config)
    apply_unet_options(unet, config)  # the trainer's speed switches, so that floor and trainer run the same calls
    params = [p for p in unet.parameters() if p.requires_grad]
    t = config.train
    rss_loaded = proc_status_mb("VmRSS")

    s = config.sample
    B, nb, T = int(s.batch_size), int(s.num_batches_per_epoch), int(s.num_steps)
    cfg = float(s.guidance_scale) != 1.0
    cfg_train = cfg and bool(t.cfg)
    C = unet.config.in_channels
    size = unet.config.sample_size if isinstance(unet.config.sample_size, int) else unet.config.sample_size[0]
    get_family(pipe.family).set_timesteps(pipe.scheduler, T)
    timesteps = pipe.scheduler.timesteps.to(device)
    with torch.no_grad():
        if pipe.text_encoder is not None:
            from ddpo_grpo.core.pipeline_with_logprob import encode_prompts

            emb1 = encode_prompts(pipe.text_encoder, pipe.tokenizer, [""])
        else:
            emb1 = torch.zeros(1, 1, unet.config.cross_attention_dim, device=device)
    embs: Dict[int, torch.Tensor] = {}

    def emb(rows: int) -> torch.Tensor:  # built once per shape, outside the timed loops
        if rows not in embs:
            embs[rows] = emb1.expand(rows, -1, -1).contiguous()
        return embs[rows]

    gen = torch.Generator(device).manual_seed(0)
    rows_sample = B * (2 if cfg else 1)

    def sample_batch():
        x = torch.randn(rows_sample, C, size, size, generator=gen, device=device)
        e = emb(rows_sample)
        with torch.no_grad(), _autocast(config, device):
            for tt in timesteps:
                unet(x, tt.expand(rows_sample), encoder_hidden_states=e)

    T_store = stored_steps(config, pipe)
    # the trainer trains only steps with std >= train.min_step_std (a window's steps for flow windows)
    from ddpo_grpo.core.policy_step import SamplerSettings, schedule_stds

    settings = SamplerSettings(family=pipe.family, eta=config.sample.eta, noise_level=config.sample.noise_level,
                               sde_type=config.sample.sde_type)
    stds = schedule_stds(pipe.scheduler, settings, int(config.sample.num_steps))[:T_store]
    columns = torch.nonzero(stds >= config.train.min_step_std).flatten() if config.train.min_step_std > 0 else None
    if columns is not None and len(columns) == 0:
        columns = None
    N = B * nb

    def train_call(n_rows: int, cols: torch.Tensor, scale: float):
        rows = n_rows * (2 if cfg_train else 1)
        tc = timesteps[cols.reshape(-1)]
        tc = torch.cat([tc, tc]) if cfg_train else tc
        x = torch.randn(rows, C, size, size, generator=gen, device=device)
        if t.beta > 0:
            with torch.no_grad(), _autocast(config, device):
                unet(x, tc, encoder_hidden_states=emb(rows))
        with _autocast(config, device):
            out = unet(x, tc, encoder_hidden_states=emb(rows)).sample
        (out.float().square().mean() * scale).backward()

    if warmup:  # the trainer's measured epochs follow a warm-up epoch (and Adam state exists by then)
        unet.eval()
        sample_batch()
        unet.train()
        calls, _ = training_calls(N, T_store, config, 0, 0, 0, columns=columns)
        idx, cols = max(calls, key=lambda c: c[1].numel())
        train_call(idx.numel() * cols.shape[1], cols, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampling_runs, training_runs, cpu_runs = [], [], []
    for _ in range(max(1, repeats)):
        # (a) sampling
        unet.eval()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(nb):
            sample_batch()
        _sync(device)
        sampling_runs.append(time.perf_counter() - t0)
        sampling_cpu = time.process_time() - c0
        rss_after_sampling = proc_status_mb("VmHWM")

        # (b) training, on the trainer's call plan
        unet.train()
        n_calls = n_rows_total = n_steps = 0
        max_call_rows = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for inner in range(int(t.num_inner_epochs)):
            calls, per_mb = training_calls(N, T_store, config, 1, inner, 0, columns=columns)
            group = int(t.gradient_accumulation_steps) * per_mb
            for start in range(0, len(calls), group):
                chunk = calls[start:start + group]
                for idx, cols in chunk:
                    n = idx.numel() * cols.shape[1]
                    train_call(n, cols, 1.0 / len(chunk))
                    n_calls += 1
                    n_rows_total += n
                    max_call_rows = max(max_call_rows, n * (2 if cfg_train else 1))
                opt.step()
                opt.zero_grad(set_to_none=True)
                n_steps += 1
        _sync(device)
        training_runs.append(time.perf_counter() - t0)
        cpu_runs.append(sampling_cpu + time.process_time() - c0)
    sampling_s, training_s = min(sampling_runs), min(training_runs)  # a floor: the best of the repeats
    rss_peak = proc_status_mb("VmHWM")
    cuda_peak = torch.cuda.max_memory_allocated() / MB if device == "cuda" else None

    act_bytes = activation_bytes(unet, params, max_call_rows, C, size, emb(max_call_rows), timesteps, config)
    modules = [m for m in (pipe.unet, pipe.text_encoder, pipe.vae) if m is not None]
    weights = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    weights += sum(b.numel() * b.element_size() for m in modules for b in m.buffers())
    trainable = sum(p.numel() * p.element_size() for p in params)
    adam = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    est = {"runtime_mb": rss_runtime, "weights_mb": weights / MB, "grads_mb": trainable / MB, "adam_mb": adam / MB,
           "activations_mb": act_bytes / MB}
    est["total_mb"] = sum(v for v in est.values() if v is not None)
    return {
        "family": pipe.family,
        "batch_size": B, "num_batches_per_epoch": nb, "num_steps": T, "cfg": cfg, "cfg_train": cfg_train,
        "timesteps_per_call": int(t.timesteps_per_call), "train_batch_size": int(t.batch_size),
        "sampling_s": sampling_s, "training_s": training_s, "total_s": sampling_s + training_s,
        "sampling_s_runs": sampling_runs, "training_s_runs": training_runs,
        "cpu_s": min(cpu_runs),  # CPU seconds of the process (all threads) in the two loops, best repeat
        "sampling_forwards": nb * T, "sampling_rows_per_forward": rows_sample,
        "train_calls": n_calls, "train_sample_timesteps": n_rows_total, "train_max_rows_per_call": max_call_rows,
        "optimizer_steps": n_steps, "reference_forwards": n_calls if t.beta > 0 else 0,
        "trainable_params": sum(p.numel() for p in params),
        "torch_threads": torch.get_num_threads(),
        "cuda_peak_mb": cuda_peak,
        "rss_mb": {"runtime": rss_runtime, "loaded": rss_loaded, "peak_after_sampling": rss_after_sampling,
                   "peak": rss_peak},
        "memory_estimate_mb": est,
    }


def activation_bytes(unet, params, rows: int, C: int, size: int, enc, timesteps, config) -> int:
    """Bytes autograd saves for backward in one forward of `rows` rows (parameters excluded, storages
    counted once): the activation memory of the largest training call."""
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    seen: Dict[int, int] = {}

    def pack(x):
        try:
            st = x.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in param_ptrs:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        except Exception:  # tensors without storage (sparse, nested): not counted
            pass
        return x

    x = torch.randn(rows, C, size, size, device=enc.device)
    tc = timesteps[torch.arange(rows, device=timesteps.device) % len(timesteps)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), _autocast(config, enc.device.type):
        out = unet(x, tc, encoder_hidden_states=enc).sample
    del out
    return int(sum(seen.values()))


def pretrained_eval(config) -> Dict:
    """The trainer's own deterministic evaluation (evaluation.evaluate) of the untrained model: the start
    point of a learning curve."""
    import tempfile

    from accelerate import Accelerator

    from ddpo_grpo.trainer.run.build import build_context
    from ddpo_grpo.trainer.epoch.evaluation import evaluate

    acc = Accelerator(cpu=True, mixed_precision=config.mixed_precision or None)
    with tempfile.TemporaryDirectory() as d:
        ctx = build_context(config, acc, d)
        t0 = time.perf_counter()
        metrics, _, _ = evaluate(ctx)
        seconds = time.perf_counter() - t0
        ctx.rewards.shutdown()
    return {"metrics": metrics, "seconds": seconds}


def faults() -> int:
    """This process's minor page faults so far (a fault per page the kernel hands it anew: memory freed back to the
    kernel and touched again)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(config, rounds: int = 3) -> Dict:
    """Floor epochs and trainer epochs alternating in one process, so both see the same machine state; the best
    of `rounds` counts on each side (round 0 warms both up and is dropped). On a shared host the floor measured in
    another process can be 20-40 % off; this ratio is not. Time only: one process holds both models, so its
    memory says nothing."""
    import tempfile

    import torch
    from accelerate import Accelerator

    from ddpo_grpo.trainer.epoch.advantages import compute_advantages
    from ddpo_grpo.trainer.run.build import build_context
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.epoch.sampling import sample_epoch
    from ddpo_grpo.trainer.epoch.training import train_epoch

    acc = Accelerator(cpu=True, mixed_precision=config.mixed_precision or None)
    floors, trainer = [], []  # floor() applies the CPU math settings before each round's trainer epoch
    with tempfile.TemporaryDirectory() as d:
        ctx = build_context(config, acc, d)
        for r in range(rounds + 1):
            f0 = faults()
            fl = floor(config, warmup=False)
            floors.append({"sampling_s": fl["sampling_s"], "training_s": fl["training_s"],
                           "minor_faults": faults() - f0, "cpu_s": fl["cpu_s"]})
            ctx.stat_tracker.clear()
            f0, t0, c0 = faults(), time.perf_counter(), time.process_time()
            samples = sample_epoch(ctx, r)
            rewards = collect_rewards(samples.reward_futures, acc)  # waits for the rewards still running after sampling
            t1, f1, c1 = time.perf_counter(), faults(), time.process_time()
            adv = compute_advantages(acc, ctx.stat_tracker, samples.keys, torch.from_numpy(rewards.avg),
                                     torch.from_numpy(rewards.valid), config.train.max_invalid_fraction)
            t2, c2 = time.perf_counter(), time.process_time()
            train_epoch(ctx, samples, adv, r)
            trainer.append({"sampling_s": t1 - t0, "training_s": time.perf_counter() - t2,
                            "sampling_minor_faults": f1 - f0, "minor_faults": faults() - f0,
                            "cpu_s": (c1 - c0) + (time.process_time() - c2)})
        ctx.rewards.shutdown()
    best = lambda rows, k: min(x[k] for x in rows[1:] or rows)  # noqa: E731
    out = {"rounds": rounds, "floor_runs": floors, "trainer_runs": trainer}
    for k in ("sampling_s", "training_s"):
        out[f"floor_{k}"], out[f"trainer_{k}"] = best(floors, k), best(trainer, k)
        out[f"overhead_{k[:-2]}"] = out[f"trainer_{k}"] / out[f"floor_{k}"]
    out["overhead"] = ((out["trainer_sampling_s"] + out["trainer_training_s"])
                       / (out["floor_sampling_s"] + out["floor_training_s"]))
    # Each round's trainer epoch over the floor epoch just before it: a slow spell of a shared host lands on both
    # sides of a pair, where the best-of-rounds ratio above compares two different moments. The median over rounds.
    wall = lambda r: r["sampling_s"] + r["training_s"]  # noqa: E731
    timed = list(zip(floors, trainer))[1:] or list(zip(floors, trainer))
    out["overhead_per_round"] = [wall(t) / wall(f) for f, t in timed]
    out["overhead_paired_median"] = statistics.median(out["overhead_per_round"])
    # CPU seconds of the whole process (all threads) in the timed phases: time the host took from this process
    # (steal time, another tenant) does not count, though a slower cache or memory bus still does.
    out["overhead_cpu_per_round"] = [t["cpu_s"] / f["cpu_s"] for f, t in timed]
    out["overhead_cpu_median"] = statistics.median(out["overhead_cpu_per_round"])
    return out


def main(argv) -> None:
    from absl import flags

    FLAGS = flags.FLAGS
    if FLAGS.mode == "floor":
        result = floor(FLAGS.config, warmup=FLAGS.warmup, repeats=FLAGS.repeats)
    elif FLAGS.mode == "eval":
        result = pretrained_eval(FLAGS.config)
    elif FLAGS.mode == "interleaved":
        result = interleaved(FLAGS.config, rounds=FLAGS.repeats)
    else:
        refuse(f"unknown --mode {FLAGS.mode!r}; choose floor, eval or interleaved")
    text = json.dumps(result, indent=1)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)
    else:
        print(text)


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "config/grpo.py:tiny", "Training configuration (file:NAME).")
    flags.DEFINE_string("out", "", "write the result JSON here (default: stdout)")
    flags.DEFINE_enum("mode", "floor", ["floor", "eval", "interleaved"],
                      "floor: time the bare loops; eval: eval the pretrained model; interleaved: floor and trainer "
                      "epochs alternating in this process")
    flags.DEFINE_integer("repeats", 1, "timed repeats of the epoch's loops (interleaved: rounds); the fastest counts")
    flags.DEFINE_bool("warmup", True, "one untimed sampling batch + training call + optimizer step first")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main, argv=sys.argv)

"""The memory plan: what a run holds per device while it trains, in GiB, before anything loads.

Two parts. `plan(counts, settings, engine)` is arithmetic only (tested against hand-computed numbers and against
real modules' byte counts): parameters per component in the dtype each is held in, gradients, AdamW state, the
reference, cached prompt embeddings and the activations of one training call, each divided the way the engine
shards it. `count_model(config)` gets the counts from the real configs on the meta device (no weights: built models
through their builders, folders through their config files) and the activations by running one training forward
there and summing the bytes of the tensors autograd saves for backward (what "activations" are), with
scaled_dot_product_attention counted as the fused kernels save it (q, k, v, out, logsumexp; the meta device would
otherwise take the math path and its L x L matrix). `report(config)` does both for the launch environment
accelerate sets (WORLD_SIZE, ACCELERATE_USE_FSDP + FSDP_VERSION, ACCELERATE_USE_DEEPSPEED + its ZeRO stage) and,
where the device's memory is known, names the switches that would make an over-budget run fit, found by planning
again with them.

Dtypes (a LoRA run's frozen base in the run's dtype, LoRA tensors, gradients and Adam state in fp32; a full
fine-tune's fp32 master weights; DeepSpeed's 2 + 2 + 12 bytes per parameter under mixed precision, the ZeRO paper's
accounting) follow what the trainer holds. The plan is of allocated bytes (torch.cuda.max_memory_allocated's
measure), each weight counted once (in the static rows, never again in a phase's working set); what it leaves out
(the CUDA/CANN context, the caching allocator's reserved but unallocated blocks) is MARGIN of the device.
"""
from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch

# The counts (ModelCounts) are meta_counts' idea, built there; the plan is arithmetic over them, so the arrow goes
# one way: memory_plan reads meta_counts, never the reverse.
from .meta_counts import ModelCounts, count_model

GiB = float(2 ** 30)
MARGIN = 0.10  # of the device's memory, not planned per tensor: context, fragmentation, phase peaks
DTYPE_BYTES = {"no": 4, "bf16": 2, "fp16": 2}
ADAM_STATES = 2  # AdamW: exp_avg and exp_avg_sq, fp32
ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


@dataclass
class Settings:
    precision: str = "no"  # "no" | "bf16" | "fp16"
    use_lora: bool = False
    gradient_checkpointing: bool = False
    cache_embeddings: bool = False  # text encoders off the device while training
    offload: bool = False  # VAE off the device while training
    train_batch_size: int = 1  # samples in the largest training call
    steps_per_call: int = 1  # timesteps stacked per sample in that call (the auto probe's largest: all trained)
    train_cfg: int = 1  # 2 where the training forward runs CFG's two halves as one batch (train.cfg, guidance != 1)
    sample_rows: int = 0  # rows of a sampling call: sample.batch_size x 2 under CFG (planned from counts)
    reference_copies: int = 0  # EMA copies of the trainable parameters: KL reference, NFT old policy, eval EMA

    @property
    def train_rows(self) -> int:
        """Denoiser rows of the largest training call: train_batch_size x steps_per_call x train_cfg."""
        return self.train_batch_size * self.steps_per_call * self.train_cfg


@dataclass
class Engine:
    kind: str = "ddp"  # ENGINES
    world: int = 1  # processes the state is sharded over (FSDP2 / ZeRO); DDP replicates


def _shard(nbytes: float, divided: bool, engine: Engine) -> float:
    return nbytes / engine.world if divided else nbytes


def plan(c: ModelCounts, s: Settings, e: Engine) -> List[Tuple[str, float]]:
    """Per-device bytes, as (label, bytes) rows whose sum is the total. Pure arithmetic (see the module docstring)."""
    run = DTYPE_BYTES[s.precision]
    mixed = s.precision != "no"
    zero = int(e.kind[-1]) if e.kind.startswith("zero") else 0
    params_split = e.kind == "fsdp2" or zero == 3
    grads_split = e.kind == "fsdp2" or zero >= 2
    optim_split = e.kind == "fsdp2" or zero >= 1
    trainable = c.lora if s.use_lora else c.full_trainable
    frozen = c.denoiser if s.use_lora else c.denoiser - c.full_trainable
    deepspeed_mixed = zero and mixed  # DeepSpeed holds the model in the run dtype, fp32 masters in the optimizer
    p_bytes = run if deepspeed_mixed else 4
    # The denoiser's load dtype is models.base.component_dtype's (LoRA: the frozen base in the run dtype; full: fp32
    # master weights); DeepSpeed under mixed precision then holds the module itself in the run dtype.
    from ddpo_grpo.models.base import component_dtype, run_dtype

    loaded = component_dtype("denoiser", run_dtype(s.precision), lora=s.use_lora).itemsize
    base_bytes = run if deepspeed_mixed else loaded
    rows = [(f"denoiser frozen params ({_dt(base_bytes)})", _shard(frozen * base_bytes, params_split, e)),
            (f"denoiser trainable params ({'LoRA' if s.use_lora else 'full'}, {_dt(p_bytes)})",
             _shard(trainable * p_bytes, params_split, e)),
            (f"gradients ({_dt(p_bytes)})", _shard(trainable * p_bytes, grads_split, e))]
    if e.kind == "ddp" and e.world > 1:
        rows.append(("DDP gradient buckets (fp32)", trainable * 4.0))  # reducer's flat copies of the gradients
    optim = trainable * 4 * (ADAM_STATES + (1 if deepspeed_mixed else 0))
    rows.append(("optimizer state (AdamW, fp32" + (" + master)" if deepspeed_mixed else ")"),
                 _shard(optim, optim_split, e)))
    if mixed and not s.use_lora and not zero and e.kind != "fsdp2":
        # autocast's run-dtype casts of the fp32 weights, kept for backward (FSDP2 casts per block and frees them)
        rows.append((f"autocast weight casts ({_dt(run)})", c.denoiser * float(run)))
    rows.append(("reference (EMA copies, fp32)" if s.reference_copies else "reference (none)",
                 _shard(s.reference_copies * trainable * 4.0, params_split, e)))
    for name, n in c.text_encoders.items():
        rows.append((f"{name} ({_dt(run)})" + (" off device: cached embeddings" if s.cache_embeddings else ""),
                     0.0 if s.cache_embeddings else n * float(run)))
    vae_b = c.vae_bytes.get(s.precision, run)
    rows.append((f"vae ({_dt(vae_b)})" + (" offloaded" if s.offload else ""), 0.0 if s.offload else c.vae * float(vae_b)))
    # trainer/run/embeddings.py: without the cache each prompt's embedding is kept on the device once encoded (the whole
    # prompt set by the run's end); with data.cache_embeddings they are held on the host, a batch's copied per call.
    emb = c.num_prompts * c.condition_elems * float(base_bytes)
    rows.append((f"prompt embeddings ({c.num_prompts} prompts)" + (" on the host" if s.cache_embeddings else ""),
                 0.0 if s.cache_embeddings else emb))
    rows += phases(c, s)
    return rows


# The VAE decode's working set beyond the tensors a live count sees (meta_counts' nograd_peak_bytes: weights
# excluded), per VAE kind (meta_counts.decode_kind), as peak / live count of the same decode:
# - "image" (2-D AutoencoderKL under the run's autocast): 1.38, measured on an H100 (torch 2.11, bf16): SD 1.5's
#   decode of 8 images at 512 px, the sampling phase's 9.20 GiB less 2.32 static, against 5.00 GiB counted. On this
#   CPU a traced allocated peak (torch.profiler's allocations, float32) is 1.26-1.30x the count, which one layout copy
#   of each convolution's input alive with its output reproduces (1.25); cuDNN's workspaces add the rest on the GPU.
# - "video3d" (Wan's causal 3-D VAE, float32 with autocast off, decoded chunk by chunk with its feature cache): 1.13,
#   the traced CPU peak of that same float32 decode at Wan 2.1's VAE widths against its count (1.125 at 64 px x 5
#   frames, 1.085 at 128 px x 9: the larger kept); the layout-copy model gives 1.11. Its GPU ratio is to be measured (docs/performance.md).
# The plan must not promise a fit the device refuses: the larger of CPU and GPU where both are known.
DECODE_TRANSIENTS = {"image": 1.38, "video3d": 1.13}


def phases(c: ModelCounts, s: Settings) -> List[Tuple[str, float]]:
    """The phases' working sets, of which only the largest is held at once (each frees its tensors before the next):
    the training call's activations (per row x train_rows), a sampling call and the decode of a sampling batch (no
    grad). Rows: the largest as counted, the others at 0 bytes with their size in the label."""
    act = c.act_bytes_ckpt if s.gradient_checkpointing else c.act_bytes
    lora_act = c.act_bytes_ckpt_lora if s.gradient_checkpointing else c.act_bytes_lora
    if s.use_lora and lora_act is not None:  # counted with the run's adapters the only trainable parameters
        act = lora_act
    if c.act_precision != s.precision:  # counted in another precision: scale by the element size (approximate)
        act = act * DTYPE_BYTES[s.precision] / DTYPE_BYTES[c.act_precision]
    factors = f"{s.train_batch_size} x {s.steps_per_call} step{'s' if s.steps_per_call > 1 else ''}" + (
        " x 2 CFG" if s.train_cfg == 2 else "")
    out = [(f"activations {act / GiB:.2f} GiB/row x {s.train_rows} rows ({factors})"
            + (" (grad. ckpt)" if s.gradient_checkpointing else ""), float(act) * s.train_rows)]
    if c.sampling_bytes is not None and s.sample_rows:
        out.append((f"sampling call, no grad ({s.sample_rows} rows)", float(c.sampling_bytes)))
    if c.decode_bytes is not None:
        factor = DECODE_TRANSIENTS[c.decode_kind]
        out.append((f"VAE decode of a sampling batch, no grad (x{factor} transient buffers, {c.decode_kind} VAE)",
                    float(c.decode_bytes) * factor))
    peak = max(range(len(out)), key=lambda i: out[i][1])
    return [(label, b) if i == peak else (f"{label}: {b / GiB:.2f}, below the peak phase", 0.0)
            for i, (label, b) in enumerate(out)]


def host(c: ModelCounts, s: Settings) -> List[Tuple[str, float]]:
    """Host bytes per process that the switches move off the device (every process holds its own copy): the cached
    prompt embeddings (data.cache_embeddings, trainer/run/embeddings.py keeps the whole set), the text encoders parked
    after caching or offloaded (pretrained.offload, core/offload.py), the offloaded VAE. [] when both are off."""
    run = DTYPE_BYTES[s.precision]
    from ddpo_grpo.models.base import component_dtype, run_dtype

    emb_bytes = component_dtype("denoiser", run_dtype(s.precision), lora=s.use_lora).itemsize  # encode casts to it
    rows = []
    if s.cache_embeddings:
        rows.append(("prompt embeddings", c.num_prompts * c.condition_elems * float(emb_bytes)))
    if s.cache_embeddings or s.offload:
        rows.append(("text encoders", sum(c.text_encoders.values()) * float(run)))
    if s.offload:
        rows.append(("vae", c.vae * float(c.vae_bytes.get(s.precision, run))))
    return rows


def total(rows: List[Tuple[str, float]]) -> float:
    return sum(b for _, b in rows)


def _dt(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16/fp16"}[nbytes]


def fits(nbytes: float, capacity_gib: float) -> bool:
    return nbytes <= capacity_gib * GiB * (1 - MARGIN)


# Switches fit() tries, in the order a user would rather give them up (memory-only first, LoRA changes the method).
SWITCHES = ("offload", "cache_embeddings", "gradient_checkpointing", "fsdp2", "use_lora")


def fit(c: ModelCounts, s: Settings, e: Engine, capacity_gib: float, max_world: int = 64, switches=SWITCHES):
    """The fewest switches (then the earliest in SWITCHES, then the largest train.batch_size) that make the plan fit:
    (names, settings, engine, bytes), or None. FSDP2 shards over the launch's processes; where nothing fits there,
    over the fewest of 2, 4, ... max_world processes that make it fit (a launch with more devices)."""
    worlds = [e.world] + [n for n in (2 ** i for i in range(1, 7)) if e.world < n <= max_world]
    for world in worlds:
        best = None
        avail = [k for k in switches if not (getattr(s, k, False) or (k == "fsdp2" and (e.kind != "ddp" or world < 2)))]
        for r in range(len(avail) + 1):
            for combo in itertools.combinations(avail, r):
                s2 = replace(s, **{k: True for k in combo if k != "fsdp2"})
                e2 = Engine("fsdp2", world) if "fsdp2" in combo else Engine(e.kind, world)
                if world != e.world and "fsdp2" not in combo and e.kind == "ddp":
                    continue  # more DDP replicas do not lower per-device memory
                b = s.train_batch_size
                while b >= 1:
                    nbytes = total(plan(c, replace(s2, train_batch_size=b), e2))
                    if fits(nbytes, capacity_gib):
                        names = list(combo) + ([f"train.batch_size={b}"] if b != s.train_batch_size else [])
                        if world != e.world and "fsdp2" not in combo:
                            names.insert(0, f"{e.kind} over {world}")
                        cand = (names, replace(s2, train_batch_size=b), e2, nbytes)
                        # fewest changes; a memory switch before a smaller batch; then SWITCHES' order
                        key = (len(names), b != s.train_batch_size, [SWITCHES.index(k) for k in combo], -b)
                        if best is None or key < best[0]:
                            best = (key, cand)
                        break
                    b //= 2
        if best is not None:
            return best[1]
    return None


def describe(names: List[str], engine: Engine) -> str:
    words = {"offload": "pretrained.offload=True (VAE off the device)",
             "cache_embeddings": "data.cache_embeddings=True (text encoders off the device)",
             "gradient_checkpointing": "gradient_checkpointing=True", "use_lora": "use_lora=True",
             "fsdp2": f"FSDP2 over {engine.world} (config/accelerate/fsdp2.yaml)"}
    return ", ".join(words.get(n, n) for n in names)


# ------------------------------------------------------------------------------------------- launch environment
def launch_engine(environ=None) -> Engine:
    """The engine and shard size of this launch, from the environment `accelerate launch` sets (scale.engine owns
    which engine): FSDP2 full shard over WORLD_SIZE (or the hybrid config's dp_shard size), DeepSpeed ZeRO at
    ACCELERATE_DEEPSPEED_ZERO_STAGE (accelerate's default 2), else DDP replicas. FSDP_SHARDING_STRATEGY is FSDP1's
    (accelerate exports it for every FSDP launch; FSDP2 ignores it) and scale.after_prepare makes every FSDP2 group
    reshard after forward, so an FSDP2 launch is always planned as full shard. FSDP1 is refused (scale.check_engine)."""
    from ..run.scale import engine as launched

    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    with _environ(env):
        kind = launched()
    if kind == "deepspeed":
        return Engine(f"zero{int(env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE') or 2)}", world)
    if kind in ("fsdp2", "fsdp1"):
        if str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "")).lower() in ("1", "true", "yes"):
            world = int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE") or world)
        return Engine("fsdp2", world)
    return Engine("ddp", world)


@contextlib.contextmanager
def _environ(env):
    if env is os.environ:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def training_call(config, trained_steps: int) -> Tuple[int, int]:
    """(samples b, timesteps S) of the largest training call, from the functions that make the calls
    (trainer/epoch/update.py): training_calls' plan at train.timesteps_per_call, or under 0 (auto) at the probe's
    largest size, all trained steps in one call (probe_sizes; the probe runs it at real shape, so it is the peak);
    one column per row for branched trajectories (cell_training_calls). trained_steps: trainable stored steps per
    sample (ModelCounts.trained_steps); N: sample.batch_size x num_batches_per_epoch samples per process."""
    from ..epoch.update import cell_training_calls, probe_sizes, steps_per_sample, training_calls

    N = int(config.sample.batch_size) * int(config.sample.num_batches_per_epoch)
    if config.sample.get("branch_steps", ()):
        calls, _ = cell_training_calls(torch.ones(N, trained_steps, dtype=torch.bool), config, 0, 0, 0)
    else:
        per_call = int(config.train.timesteps_per_call) or max(probe_sizes(steps_per_sample(trained_steps, config)))
        calls, _ = training_calls(N, trained_steps, config, 0, 0, 0, per_call)
    return max((len(idx), cols.shape[1]) for idx, cols in calls)


def settings_of(config, precision: str, trained_steps: int = 1) -> Settings:
    """The plan's Settings for a config: the largest training call's rows (training_call's b x S, x2 where training
    runs CFG's two halves as one batch: train.cfg and sample.guidance_scale != 1, as train_epoch and
    core.policy_step.denoiser_output do), a sampling call's rows (sample.batch_size, x2 under CFG), reference copies
    (beta > 0, NFT's old policy, train.ema_decay's EMA), the memory switches of issue 38 (data.cache_embeddings,
    pretrained.offload) where the config has them. The forward objectives (raft, nft) train one row per sample."""
    t = config.train
    grpo = t.get("objective", "grpo") == "grpo"
    guided = float(config.sample.guidance_scale) != 1.0
    b, S = training_call(config, trained_steps) if grpo else (int(t.batch_size), 1)
    copies = (int(t.beta > 0) + int(t.get("objective", "grpo") == "nft" and t.get("nft_old_decay", 0.0) > 0)
              + int(t.get("ema_decay", 0.0) > 0))
    return Settings(precision=precision, use_lora=bool(config.use_lora),
                    gradient_checkpointing=bool(config.gradient_checkpointing),
                    cache_embeddings=bool(config.data.get("cache_embeddings", False)),
                    offload=bool(config.pretrained.get("offload", False)), train_batch_size=b, steps_per_call=S,
                    train_cfg=2 if (grpo and t.cfg and guided) else 1,
                    sample_rows=int(config.sample.batch_size) * (2 if guided else 1), reference_copies=copies)


def precision_of(config, environ=None) -> str:
    env = os.environ if environ is None else environ
    p = (config.mixed_precision or str(env.get("ACCELERATE_MIXED_PRECISION", "no")).strip().lower() or "no")
    return p if p in DTYPE_BYTES else "no"


def device_memory_gib(config) -> Optional[float]:
    """config.device_memory_gb when > 0, else the first visible GPU's / NPU's memory, else None (no verdict)."""
    if float(config.get("device_memory_gb", 0) or 0) > 0:
        return float(config.device_memory_gb)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    from ..run.devices import npu_available

    if npu_available():
        return torch.npu.get_device_properties(0).total_memory / GiB
    return None


def format_plan(rows, engine: Engine, precision: str) -> List[str]:
    how = {"ddp": "DDP (replicated)", "fsdp2": "FSDP2 full shard", "zero1": "DeepSpeed ZeRO-1",
           "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}[engine.kind]
    out = [f"memory plan per device: {how} over {engine.world} process(es), precision {precision}"]
    out += [f"  {label:<62} {b / GiB:9.2f} GiB" for label, b in rows]
    out.append(f"total per device: {total(rows) / GiB:.2f} GiB")
    return out


def report(config, environ=None, counts: Optional[ModelCounts] = None) -> List[str]:
    """The plan's lines for this config and launch (module docstring), with the verdict and the switches that would
    make it fit when the device's memory is known. counts: count_model's result for this model, precision and
    sizes when the caller already has it (made with only_configured=False: it holds every switch's figures), so
    that plans of the same model under other switches need not rebuild it on meta."""
    engine = launch_engine(environ)
    precision = precision_of(config, environ)
    capacity = device_memory_gib(config)
    if counts is None:  # no verdict: no search, count what it reads
        counts = count_model(config, only_configured=capacity is None, precision=precision)
    s = settings_of(config, precision, counts.trained_steps)
    rows = plan(counts, s, engine)
    lines = format_plan(rows, engine, precision)
    if counts.pixel_shape:  # the shape the plan counted: what a real-shape dry run is checked against
        px = counts.pixel_shape
        lines.insert(1, "  planned sample: " + (f"{px[0]} frames x " if len(px) == 3 else "")
                     + f"{px[-2]} x {px[-1]} px, denoised as " + " x ".join(str(d) for d in counts.sample_shape)
                     + (f", {counts.tokens_per_frame[0]} x {counts.tokens_per_frame[1]} tokens per latent frame"
                        if counts.tokens_per_frame else ""))
    held = host(counts, s)
    if held:  # not per device, but what each process holds in host memory instead
        lines.append(f"host memory per process, off the device: {total(held) / GiB:.2f} GiB ("
                     + ", ".join(f"{label} {b / GiB:.2f}" for label, b in held) + ")")
    if capacity is not None:
        if fits(total(rows), capacity):
            lines.append(f"fits {capacity:.1f} GiB per device ({MARGIN:.0%} kept for what the plan leaves out)")
        else:
            found = fit(counts, s, engine, capacity)
            lines.append(f"does not fit {capacity:.1f} GiB per device; " + (
                f"fits with: {describe(found[0], found[2])} ({found[3] / GiB:.1f} GiB)" if found else
                "no combination of LoRA, gradient checkpointing, FSDP2 (up to 64), cached embeddings, offload and "
                "train.batch_size fits"))
    return lines


def print_plan(config, environ=None) -> None:
    """report()'s lines on the main process (RANK 0). A plan that cannot be made (a model whose configs the meta
    build cannot read) is one line: the plan informs, the run goes on."""
    env = os.environ if environ is None else environ
    if str(env.get("RANK", "0")) != "0":
        return
    try:
        lines = report(config, environ)
    except Exception as e:  # noqa: BLE001 - the run does not depend on its plan
        lines = [f"memory plan: not available ({type(e).__name__}: {' '.join(str(e).split())[:200]})"]
    print("\n".join(lines), flush=True)

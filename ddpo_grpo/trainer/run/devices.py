"""Device setup: CPU and CUDA need nothing; Ascend NPUs need torch_npu imported before accelerate looks
for devices, and HCCL timeouts raised before the process group forms. torch_npu is optional and only imported when
it is installed, never required. Also the launch checks that need no model: a lone process of a multi-process
launch, a parallelism mesh that does not fit the launch, and the mixed-precision rule for CPU processes."""
from __future__ import annotations

import importlib.util
import os

from ddpo_grpo.errors import ConfigError


def npu_available() -> bool:
    """Whether this process runs on Ascend NPUs: torch_npu installed, importable and reporting a device. Not
    installed, or installed on a machine without NPUs (is_available() False): False. Installed but broken (its import
    fails for anything but torch_npu itself being absent, e.g. CANN's libraries not found or a wheel built for
    another torch, or its device query raises): one ConfigError line, since the run would otherwise train on
    CPU/CUDA without a word on a machine meant for NPUs."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch

    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ModuleNotFoundError as e:
        if e.name == "torch_npu":  # a stale path entry: not installed after all
            return False
        raise ConfigError(_broken_npu("cannot be imported", e)) from None
    except Exception as e:  # noqa: BLE001 - any failure of an installed torch_npu is the same one line
        raise ConfigError(_broken_npu("cannot be imported", e)) from None
    try:
        return bool(torch.npu.is_available())
    except Exception as e:  # noqa: BLE001
        raise ConfigError(_broken_npu("cannot initialise its devices", e)) from None


def _broken_npu(what: str, e: BaseException) -> str:
    return (f"torch_npu is installed but {what} ({type(e).__name__}: {' '.join(str(e).split())}): a broken torch_npu / "
            "CANN install would silently run this job on CPU/CUDA; fix it (source CANN's set_env.sh, install the "
            "torch_npu built for this torch) or uninstall torch_npu, or set ACCELERATE_USE_CPU=1 to run on CPU")


def cpu_forced() -> bool:
    """ACCELERATE_USE_CPU (set by `accelerate launch --cpu`, or by hand for a torchrun launch) asks for CPU + gloo
    even where a GPU/NPU is present: multi-process tests pin it so that they test the logic, not the device."""
    return os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "on")


def setup() -> str:
    """Import what the present accelerator needs; returns "npu", "cuda" or "cpu"."""
    import torch

    if cpu_forced():
        return "cpu"
    if npu_available():
        apply_hccl_timeouts()
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# HCCL reads these when a communicator forms (CANN defaults: connect 120 s, exec 1800-1836 s by version). 120 s to
# connect is often too short for 8+ NPUs whose ranks still load models or compile graphs, and it fails start-up
# with an opaque HCCL timeout. Raised to torch's default process-group timeout (30 min, what NCCL ranks wait for
# each other): HCCL_CONNECT_TIMEOUT's range is [120, 7200]; HCCL uses HCCL_EXEC_TIMEOUT rounded down to a multiple
# of 68 s, so 1836 = 27 x 68 is taken as is.
HCCL_TIMEOUTS = {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "1836"}


def apply_hccl_timeouts(environ=None) -> dict:
    """Set HCCL's connect and exec timeouts unless the user set them (their value wins). Returns what was set."""
    environ = os.environ if environ is None else environ
    applied = {}
    for name, value in HCCL_TIMEOUTS.items():
        if not str(environ.get(name, "")).strip():
            environ[name] = value
            applied[name] = value
    return applied


# Where a launcher says how many processes the run has: torchrun / accelerate's multi-process launchers (WORLD_SIZE)
# and MPI (accelerate launch --mpirun_hostfile), as accelerate itself reads them for CPU process groups.
_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_PARALLELISM_SIZES = ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")


def _flag(environ, name: str) -> bool:
    return str(environ.get(name, "")).strip().lower() in ("1", "true", "yes", "on")


def _is_main(environ) -> bool:
    return str(environ.get("RANK", "0")) == "0"


def check_launch(config, device: str, environ=None) -> None:
    """What the launch asked for against what this process got, before anything loads: one ConfigError line each.

    * A lone process of a multi-process launch: `accelerate launch --cpu` (any --config_file), or a launch with
      neither --multi_gpu nor a multi-process config, starts ONE process whatever --num_processes says; accelerate
      still sets MASTER_ADDR (it does so only for several processes or machines) but no WORLD_SIZE.
    * accelerate's parallelism_config (fsdp2_hybrid.yaml): its mesh must hold every process. On CPU processes
      accelerate refuses a parallelism_config and does not use DeepSpeed: both are refused here, outside a dry run
      (which may check a GPU launch from a CPU machine). An FSDP launch on CPU, which accelerate runs as plain DDP, is
      refused once the Accelerator exists (scale.check_engine_applied).
    * Mixed precision (one rule): config.mixed_precision decides where it is set; "" (as launched) takes the
      launch's setting (ACCELERATE_MIXED_PRECISION: the YAML's line or --mixed_precision) on GPU/NPU, and fp32 on
      CPU, where bf16 autocast is many times slower (no bf16 units) and fp16 does nothing. On CPU only an explicit
      config.mixed_precision=bf16 gives bf16; anything else sets config.mixed_precision to "no", with a note.
    """
    environ = os.environ if environ is None else environ
    if ("ACCELERATE_MIXED_PRECISION" in environ and str(environ.get("MASTER_ADDR", "")).strip()
            and not any(str(environ.get(v, "")).strip() for v in _WORLD_SIZE_VARS)):
        raise ConfigError(
            "accelerate launch started 1 process of a multi-process launch (MASTER_ADDR set, WORLD_SIZE not): --cpu, "
            "or a launch without --multi_gpu or a multi-process --config_file, starts one process whatever "
            "--num_processes says; for N CPU processes (gloo) drop --cpu and run ACCELERATE_USE_CPU=1 accelerate "
            "launch --config_file config/accelerate/ddp.yaml --num_processes N --num_machines 1 scripts/train.py ...")
    if device == "cpu" and _flag(environ, "ACCELERATE_USE_DEEPSPEED") and not config.dry_run:
        raise ConfigError(
            "a DeepSpeed launch (config/accelerate/deepspeed_zero*.yaml) needs GPU/NPU processes: accelerate does not "
            "use DeepSpeed for CPU processes; on CPU launch config/accelerate/ddp.yaml with ACCELERATE_USE_CPU=1 "
            "instead")
    if _flag(environ, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        sizes = {k: int(environ.get(f"PARALLELISM_CONFIG_{k}_SIZE") or 1) for k in _PARALLELISM_SIZES}
        total = 1
        for v in sizes.values():
            total *= v
        world = int(environ.get("WORLD_SIZE") or 1)
        if device == "cpu" and total > 1 and not config.dry_run:
            raise ConfigError(
                "parallelism_config (FSDP2 hybrid shard, config/accelerate/fsdp2_hybrid.yaml) needs GPU/NPU processes: "
                "accelerate refuses it for CPU processes; on CPU launch config/accelerate/ddp.yaml (or fsdp2.yaml) "
                "with ACCELERATE_USE_CPU=1 instead")
        if total > 1 and total != world:
            shown = " x ".join(f"{k.lower()} {v}" for k, v in sizes.items() if v > 1)
            raise ConfigError(
                f"parallelism_config's mesh ({shown}) holds {total} processes but this launch has {world} "
                "(WORLD_SIZE); make --parallelism_config_dp_replicate_size x --parallelism_config_dp_shard_size equal "
                "the total process count (dp_replicate_size = machines, dp_shard_size = processes per machine)")
    if device == "cpu" and config.mixed_precision in ("", "no", "fp16"):  # other values: validate_config's line
        asked = config.mixed_precision or str(environ.get("ACCELERATE_MIXED_PRECISION", "no")).strip().lower() or "no"
        if asked != "no":
            source = (f"config.mixed_precision={asked}" if config.mixed_precision
                      else f"the launch's mixed_precision {asked} (YAML line or --mixed_precision)")
            if _is_main(environ):
                print(f"note: {source} is for GPU/NPU processes; this CPU run trains in fp32 "
                      "(--config.mixed_precision=bf16 forces bf16 autocast on CPU)", flush=True)
        config.mixed_precision = "no"


def visible_accelerators(device: str) -> int:
    """How many devices of this kind this process can see (0 for "cpu")."""
    import torch

    if device == "cuda":
        return torch.cuda.device_count()
    if device == "npu":
        return int(torch.npu.device_count())
    return 0


def local_process_count() -> int:
    """Processes on this machine: torchrun's LOCAL_WORLD_SIZE, else WORLD_SIZE (one machine), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def check_process_count(device: str, local_processes: int, visible: int) -> None:
    """Each GPU/NPU process needs a device of its own: two NCCL/HCCL ranks on one GPU stop with an opaque
    'invalid usage' trace. Raise ConfigError with one line naming both counts and the fixes."""
    if device in ("cuda", "npu") and local_processes > visible:
        raise ConfigError(
            f"{local_processes} processes on this machine but {visible} visible {device.upper()} device(s); "
            f"launch with --num_processes {max(visible, 1)} or fewer, or run on CPU (gloo) with "
            "ACCELERATE_USE_CPU=1 (accelerate launch --multi_gpu ... picks it up)")


def apply_cpu_settings(config, device: str = "cpu") -> None:
    """CPU-only math settings shared by the trainer and the benchmark floor: flush denormal floats to zero
    (config.flush_denormal). Policy-gradient losses of ~1e-5 put backward gradients in the denormal range,
    which x86 CPUs process many times slower."""
    import torch

    if device == "cpu" and config.flush_denormal:
        torch.set_flush_denormal(True)


def collective_timeout(config):
    """config.collective_timeout_s as the process group's timeout (init_process_group's, which gloo, NCCL and HCCL
    groups take): how long a process waits for the others at start-up and at every collective before it raises."""
    import datetime

    seconds = int(config.collective_timeout_s)
    if seconds <= 0:
        raise ConfigError(f"collective_timeout_s={config.collective_timeout_s}: give a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


# What a collective raises when a peer died or did not answer in time. The c10d store's and the network's errors
# (DistStoreError, DistNetworkError: the rendezvous or the store's host is gone) always are. Backend errors
# (DistBackendError, or gloo's plain RuntimeError naming its source file) only when they say a connection to a peer
# broke or a wait ran out: "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer",
# "[.../unbound_buffer.cc:78] Timed out waiting 10000ms", NCCL's "Watchdog caught collective operation timeout" /
# "communicator was aborted", HCCL's "... times out". Anything else from a backend (an op gloo lacks, NCCL out of
# GPU memory, no usable network interface) is this process's own failure and keeps its traceback.
_PEER_PHRASES = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out", "timeout",
                 "timing out", "times out", "time out", "communicator was aborted")
_BACKENDS = ("/gloo/", "NCCL", "HCCL", "ProcessGroup", "c10d")  # a plain RuntimeError from a backend names it


def lost_peer_line(exc: BaseException, config, world_size: int) -> "str | None":
    """One line for a collective that failed because another process of a multi-process job died or hung;
    None for any other exception (which keeps its traceback)."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    peer_errors = tuple(c for c in (getattr(dist, "DistStoreError", None), getattr(dist, "DistNetworkError", None)) if c)
    msg = str(exc)
    said = any(p in msg.lower() for p in _PEER_PHRASES)
    backend = isinstance(exc, getattr(dist, "DistError", ())) or any(m in msg for m in _BACKENDS)
    if not (isinstance(exc, peer_errors) or (isinstance(exc, RuntimeError) and backend and said)):
        return None
    first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), "")[:200]
    return (f"another process of this {world_size}-process job stopped or did not answer within "
            f"collective_timeout_s={config.collective_timeout_s} s ({type(exc).__name__}: {first}); this process "
            "stops too. The first failure is in the other machines' logs; resume every machine with "
            "--config.resume_from=<its run folder> (each continues from the newest checkpoint all machines hold)")

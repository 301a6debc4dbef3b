"""Device setup: CPU and CUDA need nothing; Ascend NPUs need torch_npu imported before accelerate looks
for devices. torch_npu is optional and only imported when it is installed, never required."""
from __future__ import annotations

import importlib.util
import os

from ddpo_grpo.errors import ConfigError


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return bool(torch.npu.is_available())
    except Exception:  # CANN libraries missing: the wheel is installed but cannot run here
        return False


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
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


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

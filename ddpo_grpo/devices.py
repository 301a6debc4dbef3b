"""Device setup: CPU and CUDA need nothing; Ascend NPUs need torch_npu imported before accelerate looks
for devices. torch_npu is optional and only imported when it is installed, never required."""
from __future__ import annotations

import importlib.util


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return bool(torch.npu.is_available())
    except Exception:  # CANN libraries missing: the wheel is installed but cannot run here
        return False


def setup() -> str:
    """Import what the present accelerator needs; returns "npu", "cuda" or "cpu"."""
    import torch

    if npu_available():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_cpu_settings(config, device: str = "cpu") -> None:
    """CPU-only math settings shared by the trainer and the benchmark floor: flush denormal floats to zero
    (config.flush_denormal). Policy-gradient losses of ~1e-5 put backward gradients in the denormal range,
    which x86 CPUs process many times slower."""
    import torch

    if device == "cpu" and config.flush_denormal:
        torch.set_flush_denormal(True)

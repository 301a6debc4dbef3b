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

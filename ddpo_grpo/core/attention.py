"""config.attention_backend: which kernels torch's scaled_dot_product_attention (SDPA) may use in this run.

  auto       CUDA: flash, memory-efficient or math (torch picks per call among them), never cuDNN attention. On an
             H100 with torch 2.11 the cuDNN SDPA backward is where FLUX's training phase hit "an illegal memory access"
             at real shape (issue 50), and its sm90 backward has a known wrong-result bug since 2.11, where it became
             torch's default choice: NaN grad_q when a mask is passed and seq_len % 128 == 64 (pytorch#196678; the
             peers' reports also cite pytorch#169849 and #186142). Flash and memory-efficient are as fast for these
             shapes (head dim 64 / 128, bf16) and have no such reports open. CPU, NPU, MPS: torch's own choice,
             nothing changed (their SDPA has no cuDNN path; torch_npu routes to its fused kernel).
  flash      FlashAttention-2 only (CUDA sm80+, fp16 / bf16, head dim <= 256): an error where it cannot run.
  efficient  the memory-efficient (xformers / CUTLASS) kernel only (CUDA).
  cudnn      cuDNN attention only (CUDA), torch 2.11's default on sm90: to measure or reproduce with it.
  math       SDPA's reference implementation (plain matmuls and a softmax, any device): slowest, most memory.

config.unet_attention is the other, older switch: "sdpa" keeps diffusers' processors, which call SDPA (so this
setting picks their kernel); "math" replaces them with diffusers' AttnProcessor (plain matmuls, SDPA never called),
where attention_backend no longer matters for the denoiser. Either "math" means plain matmuls.

The choice is made process-wide (torch.backends.cuda.enable_*_sdp, the switches torch.nn.attention.sdpa_kernel
sets inside its block) rather than by a sdpa_kernel block around each denoiser call: gradient checkpointing
recomputes the forward inside backward, outside any such block, and would pick its own kernel there (and with it the
backward's). The text encoders and reward models run under the same choice, which changes nothing but the kernel."""
from __future__ import annotations

from typing import List, Optional

import torch

from ddpo_grpo.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
_FLAGS = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math"}  # enable_<flag>_sdp


def check_attention_backend(config) -> str:
    """config.attention_backend (default "auto") if it is one of ATTENTION_BACKENDS, else one ConfigError line."""
    name = config.get("attention_backend", "auto")
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    return name


def allowed(name: str, device_type: str) -> Optional[List[str]]:
    """The SDPA kernels `name` allows on a device type (names of _FLAGS), or None: torch's own choice, untouched."""
    if name == "auto":
        return ["flash", "efficient", "math"] if device_type == "cuda" else None
    if name != "math" and device_type != "cuda":
        raise ConfigError(f"attention_backend={name!r} is a CUDA kernel and this run is on {device_type}; use 'auto' "
                          "(torch's choice there) or 'math'")
    return [name]


def apply_attention_backend(name: str, device) -> str:
    """Set the SDPA kernels `name` allows for this process on `device`; returns the line a run prints at start."""
    device_type = torch.device(device).type
    kernels = allowed(name, device_type)
    if kernels is None:
        return f"attention: {name}: torch's default SDPA kernel choice on {device_type}"
    for backend, flag in _FLAGS.items():
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(backend in kernels)
    return (f"attention: {name}: SDPA may use {', '.join(kernels)} on {device_type}"
            + (" (not cuDNN attention: its sm90 backward, pytorch#196678)" if name == "auto" else ""))

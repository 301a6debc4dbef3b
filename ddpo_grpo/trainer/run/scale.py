"""Sharded engines (FSDP2, DeepSpeed) as selected by `accelerate launch --config_file config/accelerate/*.yaml`:
which one a launch picked, the combinations the trainer refuses at start (one ConfigError line), and DTensor helpers
for code that reads whole parameters (core/reference.py has its own: core does not import the trainer).

accelerate 1.15 turns FSDP on only for GPU-like process groups (AcceleratorState sets DistributedType.FSDP in its
MULTI_GPU/NPU/XPU/... branch); on CPU processes an FSDP launch would silently run DDP. `check_engine_applied` stops
such a run in one line once the Accelerator exists. torch's fully_shard itself runs on a CPU mesh over gloo
(benchmarks/probe_fsdp2_gloo.py): tests/fsdp_cpu_train.py patches accelerate (tests only) so that the trainer's FSDP2
path is exercised here, and then passes this check because accelerate really built an FSDP run.
"""
from __future__ import annotations

import math
import os

import torch

from ddpo_grpo.errors import ConfigError

from ..epoch.update import steps_per_sample


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def engine() -> str:
    """"deepspeed", "fsdp1", "fsdp2" or "ddp" (also single process), from the env accelerate launch sets."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag("ACCELERATE_USE_FSDP"):
        return "fsdp2" if os.environ.get("FSDP_VERSION", "1") == "2" else "fsdp1"
    return "ddp"


def backward_calls_per_step(config):
    """Backward calls the trainer makes per optimizer step, when fixed by the config (else None): each sample
    trains round(T * timestep_fraction) steps, timesteps_per_call of them per call, train.gradient_accumulation_steps
    micro-batches per step. Unknown with the auto probe (timesteps_per_call = 0) or min_step_std (columns chosen
    from the sampled stds), and for the forward objectives. Branched sampling (update.cell_training_calls) makes
    one call per micro-batch."""
    t, s = config.train, config.sample
    if t.get("objective", "grpo") != "grpo":
        return None
    if s.get("branch_steps", ()):  # branched sampling: one cell per row, so every call is one micro-batch
        return int(t.gradient_accumulation_steps)
    if int(t.timesteps_per_call) <= 0 or t.min_step_std > 0:
        return None
    T = int(s.sde_window_size) or int(s.num_steps)
    T_train = steps_per_sample(T, config)
    return int(t.gradient_accumulation_steps) * math.ceil(T_train / min(int(t.timesteps_per_call), T_train))


def check_engine(config) -> None:
    """Combinations of launch engine and config that cannot work: one ConfigError line, before any model is loaded."""
    eng = engine()
    if eng == "fsdp1":
        raise ConfigError("FSDP1 (fsdp_version: 1) is not supported: its flat parameters hide the names the EMA "
                          "reference and LoRA rely on; set fsdp_version: 2 (config/accelerate/fsdp2.yaml)")
    if eng != "deepspeed":
        return
    if config.train.beta > 0:
        raise ConfigError(f"train.beta={config.train.beta} with DeepSpeed: the KL reference is swapped into the "
                          "policy's parameters in place, which the DeepSpeed engine does not see (ZeRO-3 holds "
                          "empty placeholders); use FSDP2 (config/accelerate/fsdp2.yaml) or DDP, or set train.beta=0")
    want = backward_calls_per_step(config)
    got = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if want is None:
        raise ConfigError("DeepSpeed steps its optimizer every deepspeed_config.gradient_accumulation_steps "
                          "backward calls: fix that number with train.timesteps_per_call > 0, train.min_step_std=0 "
                          "and train.objective='grpo'")
    if got is not None and int(got) != want:
        raise ConfigError(f"deepspeed_config.gradient_accumulation_steps={got} but the trainer makes {want} backward "
                          f"calls per optimizer step (train.gradient_accumulation_steps x ceil(trained steps / "
                          f"train.timesteps_per_call)); set gradient_accumulation_steps: {want}")


def use_architecture_blocks(config, environ=None) -> None:
    """FSDP2 wraps the blocks of the model being trained: its adapter's fsdp_block_classes (models/base.py) replace the
    launch YAML's fsdp_transformer_layer_cls_to_wrap (accelerate reads FSDP_TRANSFORMER_CLS_TO_WRAP when the
    Accelerator is made, so call this before), since accelerate stops when a listed class is not in the model (an SD
    UNet's ResnetBlock2D in an SD3 transformer). Nothing to do for other engines."""
    environ = os.environ if environ is None else environ
    if engine() != "fsdp2":
        return
    from ddpo_grpo.models import model_adapter

    blocks = ",".join(model_adapter(config.pretrained.model).fsdp_block_classes)
    if blocks and environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") != blocks:
        environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = blocks


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter: DTensor.full_tensor() (a collective: every process must
    call it), anything else as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def check_engine_applied(accelerator) -> None:
    """The engine the launch asked for (engine()) against the one accelerate built: an FSDP launch that accelerate
    turned into DDP (CPU processes, see the module docstring) is one ConfigError line, not a silent unsharded run.
    Call right after the Accelerator is made, before any model loads."""
    import accelerate
    from accelerate.utils import DistributedType

    if engine() == "fsdp2" and accelerator.distributed_type != DistributedType.FSDP:
        got = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
        raise ConfigError(
            f"an FSDP launch (config/accelerate/fsdp2.yaml) but accelerate {accelerate.__version__} built a {got} run "
            f"on {accelerator.device.type.upper()} processes: it runs FSDP on GPU/NPU/XPU processes only, and this run "
            "would train unsharded as plain DDP; on CPU launch config/accelerate/ddp.yaml with ACCELERATE_USE_CPU=1 "
            "instead (the same training), or run fsdp2.yaml on GPUs/NPUs")


def after_prepare(accelerator, unet: torch.nn.Module) -> torch.nn.Module:
    """Under FSDP2, make every group (the root included) reshard after each forward. accelerate leaves the root
    unsharded between forwards (reshard_after_forward=None -> False for the root): its parameters would then be
    plain unsharded copies, not the DTensors the optimizer, the EMA reference swap (in-place writes that the next
    forward must all-gather) and gradient clipping hold. Costs one all-gather of the root's few tensors (conv_in,
    time embedding, conv_out) per forward. A no-op for every other engine."""
    if getattr(accelerator, "is_fsdp2", False):
        unet.set_reshard_after_forward(True)
    return unet

"""ReCamMaster's checkpoint format: reading a file as tensors only, the original Wan key names <-> diffusers', and a
trained model's tensors back into a checkpoint (LoRA merged). models/recam.py uses it for loading and exports."""
from __future__ import annotations

import os
import re
from typing import Dict, List

import torch

from ddpo_grpo.errors import ConfigError

from .base import inner_model

CAMERA_LAYERS = ("cam_encoder", "projector")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def read_checkpoint(path: str, lazy: bool = False) -> Dict[str, torch.Tensor]:
    """The tensors of a ReCamMaster checkpoint file; ConfigError (one line naming the file) when it is missing,
    damaged, not a flat dict of tensors, or a pickle that would run code (torch.load(weights_only=True) only).

    lazy=True is for checking a file before anything heavy loads (a real checkpoint is 5.7 GB): a .safetensors file
    gives meta tensors of the stored shapes and dtypes from its header (whose offsets are checked against the file's
    size, so a truncated file is refused here), a pickle is memory-mapped (torch.load(mmap=True): its data is paged in
    only where read; a legacy non-zip pickle cannot be mapped and is read whole)."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"pretrained.recam_checkpoint {path!r} is not a file")
    try:
        if path.endswith(".safetensors"):
            if lazy:
                state = _safetensors_meta(path)
            else:
                from safetensors.torch import load_file

                state = load_file(path)
        elif path.endswith(PICKLE_SUFFIXES):
            state = None
            if lazy:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:
                    if "mmap" not in str(e) and "zip" not in str(e):
                        raise
            if state is None:
                state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise ConfigError(f"pretrained.recam_checkpoint {path!r}: expected .safetensors or one of "
                              f"{', '.join(PICKLE_SUFFIXES)}")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or code-carrying file is one line, whatever the reader raised
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConfigError(f"pretrained.recam_checkpoint {path!r} cannot be read as tensors only ({first})") from None
    if isinstance(state, dict) and set(state) <= {"state_dict", "module"} and len(state) == 1:
        state = next(iter(state.values()))  # a training wrapper's {"state_dict": ...}
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"pretrained.recam_checkpoint {path!r} is not a state dict of tensors")
    return state


# The safetensors format's dtype names (its specification); an unknown one is a KeyError -> "cannot be read".
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _safetensors_meta(path: str) -> Dict[str, torch.Tensor]:
    """Meta tensors (shape, dtype) of a .safetensors file read from its header alone: 8 bytes of header length, the
    JSON header, then the data, whose extent the header's offsets must match exactly (ValueError otherwise)."""
    import json
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError(f"header length {n} beyond the file's {size} bytes")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((int(h["data_offsets"][1]) for h in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"truncated or padded: the header describes {8 + n + end} bytes, the file has {size}")
    return {k: torch.empty(h["shape"], dtype=SAFETENSORS_DTYPES[h["dtype"]], device="meta") for k, h in header.items()}


def camera_keys(num_layers: int) -> List[str]:
    """The camera tensors' names (the same in the original and the diffusers naming)."""
    return [f"blocks.{i}.{layer}.{p}" for i in range(num_layers) for layer in CAMERA_LAYERS for p in ("weight", "bias")]


def to_diffusers_key(key: str) -> str:
    """An original Wan key -> the WanTransformer3DModel key, by diffusers' own converter (camera keys unchanged)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return next(iter(convert_wan_transformer_to_diffusers({key: None})))


# The inverse of diffusers' renaming for Wan 2.1 T2V (checked against to_diffusers_key on every key at load).
_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"),
)


def to_original_key(key: str) -> str:
    """A WanTransformer3DModel key (with camera layers) -> the original Wan / ReCamMaster key."""
    if key == "scale_shift_table":
        return "head.modulation"
    for new, old in _TO_ORIGINAL:
        key = key.replace(new, old)
    key = re.sub(r"\.scale_shift_table$", ".modulation", key)
    return re.sub(r"\.norm([23])\.", lambda m: ".norm" + ("3" if m.group(1) == "2" else "2") + ".", key)


def merged_state(unet: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A peft-LoRA model's state (diffusers-model names, `...base_layer.weight`, `...lora_A.<name>.weight`) -> plain
    weights with every adapter merged: W + (alpha / r) B A, as peft's merge does for a Linear."""
    model = inner_model(unet)
    cfgs = getattr(model, "peft_config", {})
    out = {}
    for k, v in state.items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    for k, a in state.items():
        m = re.match(r"(.*)\.lora_A\.(?:(\w+)\.)?weight$", k)
        if not m:
            continue
        base, name = m.group(1), m.group(2) or "default"
        b = state[k.replace(".lora_A.", ".lora_B.")]
        cfg = cfgs[name]
        scale = cfg.lora_alpha / cfg.r
        w = out[base + ".weight"]
        out[base + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def original_state(transformer: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A WanTransformer3DModel with camera layers -> its ReCamMaster checkpoint (original key names)."""
    return {to_original_key(k): v.detach().clone() for k, v in transformer.state_dict().items()}

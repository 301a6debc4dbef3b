"""What a run gives back: the trained denoiser in the formats diffusers loads, and loading them again.

An export folder (`checkpoint_NNNNN/export/` in every checkpoint, `logs/<run>/export/` at the end of a run) is

- a full fine-tune: a complete model folder, every component written by its own `save_pretrained` (`unet/` holds
  the trained weights; `scheduler/` the DDIM / flow scheduler the run sampled with), plus `model_index.json` where a
  stock pipeline class describes the model (a VAE, a CLIP text encoder and a `UNet2DConditionModel`:
  `StableDiffusionPipeline`). It is also a `pretrained.model` for this trainer and a `--model` for eval_model.py.
- a LoRA run: `pytorch_lora_weights.safetensors` in diffusers' LoRA format (keys `unet.<module>.lora_A.weight`, the
  peft config in the file's metadata), written by the pipeline's `save_lora_weights`; `load_lora_weights` (a
  pipeline) or `UNet2DConditionModel.load_lora_adapter(folder, prefix="unet")` applies it to the base model.

Both hold `scheduler/` (the scheduler to sample the export with: for a LoRA run too, since the base folder's own,
e.g. SDXL's Euler or Wan's UniPC, is not what the run sampled with) and `export.json`: the base model, LoRA or not,
which weights (the policy that samples and that eval measures: DiffusionNFT's soft-updated policy when
train.nft_old_decay > 0), the epoch, and the sampler settings (sampling_settings), among them `pipeline_call`, the
keyword arguments of the stock pipeline's __call__ that sample the run's deterministic eval sample:

    info = json.load(open(f"{export}/export.json"))
    scheduler = getattr(diffusers, info["scheduler"]).from_pretrained(export, subfolder="scheduler")
    pipe = DiffusionPipeline.from_pretrained(info["base_model_path"] if info["lora"] else export, scheduler=scheduler)
    if info["lora"]: pipe.load_lora_weights(export)
    images = pipe(prompts, generator=[torch.Generator().manual_seed(s) for s in seeds], **info["pipeline_call"])
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch

from .base import PackedDenoiser, inner_model, inner_state

EXPORT_INFO = "export.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name (LORA_WEIGHT_NAME_SAFE)


class ExportError(ValueError):
    """Weights that cannot be applied to the model they are given with."""


def _strip_wrappers(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    from ddpo_grpo.core.reference import _strip

    return {_strip(k): v for k, v in state.items()}


def write_export(pipe, unet: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: str, lora: bool,
                 info: dict) -> str:
    """Write the export folder `out_dir` (replaced if present; written beside it and renamed, so a reader never
    sees half of one).

    pipe: the LoadedPipeline the run trains (its frozen components are written as loaded); unet: the trained
    denoiser, unwrapped (with its peft adapters for LoRA); state: the weights to export, full tensors named as in
    unet.state_dict() (what accelerator.get_state_dict returns), e.g. the sampling policy's."""
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = _strip_wrappers(state)
    if lora:
        _write_lora(pipe, unet, state, tmp)
    else:
        _write_full(pipe, unet, state, tmp)
    pipe.adapter.write_extra(pipe, unet, state, tmp, lora)
    with open(os.path.join(tmp, EXPORT_INFO), "w") as f:
        json.dump(dict(info, lora=bool(lora)), f, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def export_scheduler(pipe):
    """The scheduler an export holds: the one the stock pipeline is saved with (pipe.components["scheduler"]: the
    folder's config as the run read it; FLUX's keeps its dynamic shift, which FluxPipeline computes from the height
    and width of the call), else the one the run samples with."""
    return (pipe.components or {}).get("scheduler") or pipe.scheduler


def sampling_settings(pipe, num_inference_steps: int, guidance_scale: float) -> dict:
    """What export.json records so that plain diffusers samples the run's deterministic (eval) sample: the stock
    pipeline class, the scheduler class (its config in scheduler/), steps, true CFG, size, eta 0 (DDIM; flow models
    step the ODE), the adapter's export_settings (FLUX's embedded guidance, Wan's frames) and `pipeline_call`, the
    adapter's keyword arguments for the pipeline's __call__ (ModelAdapter.pipeline_call)."""
    call = pipe.adapter.pipeline_call(pipe, num_inference_steps, guidance_scale)
    return {"pipeline_class": pipe.adapter.pipeline_class or None, "scheduler": type(export_scheduler(pipe)).__name__,
            "num_inference_steps": int(num_inference_steps), "guidance_scale": float(guidance_scale),
            "height": call["height"], "width": call["width"], "eval_eta": 0.0,
            **pipe.adapter.export_settings(pipe), "pipeline_call": call}


def _write_lora(pipe, unet, state, out_dir) -> None:
    from peft.utils import get_peft_model_state_dict

    model = inner_model(unet)
    layers = get_peft_model_state_dict(model, state_dict=inner_state(unet, state))  # adapter tensors, name removed
    if not layers:
        raise ExportError("a LoRA export found no adapter tensors in the model")
    pipe.adapter.save_lora(out_dir, layers, model.peft_config["default"].to_dict())
    export_scheduler(pipe).save_pretrained(os.path.join(out_dir, "scheduler"))


def _write_full(pipe, unet, state, out_dir) -> None:
    # A second denoiser built on the meta device and given the exported tensors (assign: no copy, no memory of a
    # second model), so that the live module, whose weights may be another policy's, is left alone.
    model = inner_model(unet)
    denoiser = pipe.adapter.meta_denoiser(model)
    missing, unexpected = denoiser.load_state_dict(inner_state(unet, state), strict=False, assign=True)
    if missing or unexpected:
        raise ExportError(f"the exported weights do not fit {type(model).__name__}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    pipeline = pipe.adapter.stock_pipeline(pipe, denoiser)
    if pipeline is not None:
        pipeline.save_pretrained(out_dir)  # every component + model_index.json
        return
    parts = dict(pipe.components or {"scheduler": pipe.scheduler, "text_encoder": pipe.text_encoder,
                                     "tokenizer": pipe.tokenizer, "vae": pipe.vae})
    parts[pipe.adapter.denoiser_folder] = denoiser
    for name, part in parts.items():
        if part is not None:
            part.save_pretrained(os.path.join(out_dir, name))


def export_info(path: str) -> Optional[dict]:
    """export.json of an export folder (or of a checkpoint's export/), else None."""
    for folder in (path, os.path.join(path, "export")):
        f = os.path.join(folder, EXPORT_INFO)
        if os.path.isfile(f):
            with open(f) as fh:
                return dict(json.load(fh), folder=folder)
    return None


def apply_weights(pipe, path: str) -> str:
    """Trained weights onto a loaded model's denoiser (pipe.unet), in place; returns what was applied. `path` is any of: an export folder
    or a checkpoint folder (its export/), a LoRA file or a folder holding pytorch_lora_weights.safetensors, a
    denoiser folder (`save_pretrained`, or a model folder with unet/), or a .safetensors of plain denoiser tensors
    (a checkpoint's sampling_policy.safetensors: the trainable tensors only). Tensors the file lacks keep the
    model's values; names the model does not know are an ExportError."""
    from safetensors.torch import load_file

    unet, prefix, sub_name = pipe.unet, pipe.adapter.lora_prefix, pipe.adapter.denoiser_folder
    info = export_info(path) if os.path.isdir(path) else None
    folder = info["folder"] if info else path
    if os.path.isdir(folder):
        for sub in (folder, os.path.join(folder, sub_name)):
            if os.path.isfile(os.path.join(sub, LORA_WEIGHTS)):
                return _apply_lora(unet, sub, prefix)
            if os.path.isfile(os.path.join(sub, "config.json")):
                weights = os.path.join(sub, "diffusion_pytorch_model.safetensors")
                if os.path.isfile(weights):
                    _load_plain(unet, load_file(weights), weights, strict=True)
                    return weights
        raise ExportError(f"{path!r} holds no weights this model can take (no {LORA_WEIGHTS}, no "
                          f"{sub_name}/diffusion_pytorch_model.safetensors, no {EXPORT_INFO})")
    if not os.path.isfile(path):
        raise ExportError(f"{path!r}: no such file or folder")
    tensors = load_file(path)
    if any(".lora_A." in k or ".lora.down." in k for k in tensors) and not any("base_layer" in k for k in tensors):
        return _apply_lora(unet, path, prefix)
    if any("base_layer" in k for k in tensors):
        raise ExportError(f"{path!r} is a LoRA run's training state (peft-wrapped model), not a model file: use the "
                          f"checkpoint's export/{LORA_WEIGHTS}")
    _load_plain(unet, tensors, path, strict=False)
    return path


def _load_plain(unet, tensors, path, strict: bool) -> None:
    """Plain tensors: the diffusers model's own names (an export) or the denoiser's (a sampling_policy file)."""
    tensors = _strip_wrappers(tensors)
    wrapped = isinstance(unet, PackedDenoiser) and all(k.startswith("model.") for k in tensors)
    target = unet if wrapped else inner_model(unet)
    result = target.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:
        raise ExportError(f"{path!r} does not fit this model: unknown tensors, e.g. {result.unexpected_keys[:3]}")
    if strict and result.missing_keys:
        raise ExportError(f"{path!r} does not fit this model: it lacks tensors, e.g. {result.missing_keys[:3]}")


def _apply_lora(unet, path, prefix: str) -> str:
    folder, name = (path, LORA_WEIGHTS) if os.path.isdir(path) else os.path.split(path)
    unet = inner_model(unet)
    before = set(unet.state_dict())
    unet.load_lora_adapter(folder, weight_name=name, prefix=prefix, adapter_name="export")
    # diffusers only warns when no key matched (the adapter then changes nothing): refuse that instead.
    added = [k for k in unet.state_dict() if k not in before and "lora_" in k]
    if not added:
        raise ExportError(f"{os.path.join(folder, name)!r}: no LoRA tensor of it fits this model")
    return os.path.join(folder, name)

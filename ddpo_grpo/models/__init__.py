"""Loading diffusion pipelines from a local folder, offline: the bundled tiny models and ordinary
Stable Diffusion-style checkpoints (subfolders unet/, text_encoder/, tokenizer/, scheduler/, optional vae/)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from diffusers import AutoencoderKL, DDIMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer

BUNDLED = {
    "tiny-t2i": "tiny-t2i",
    "tiny-flow": "tiny-flow",
    "tiny-recam": "tiny-recam",
}
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")


class ModelPathError(ValueError):
    """A model path that does not exist or is not a diffusers-format folder."""


@dataclass
class LoadedPipeline:
    """What the sampler needs. `family` is "ddim" (noise/v-prediction, DDIM sampling) or "flow"
    (velocity prediction, flow-matching Euler / SDE sampling)."""

    unet: torch.nn.Module
    text_encoder: Optional[torch.nn.Module]
    tokenizer: Optional[CLIPTokenizer]
    scheduler: object
    vae: Optional[torch.nn.Module]
    family: str
    path: str

    @property
    def sample_shape(self) -> tuple:
        """(C, H, W) of the denoised sample (latent shape when there is a VAE)."""
        cfg = self.unet.config
        size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
        return (cfg.out_channels, size, size)


def resolve_model_path(path_or_name: str) -> str:
    """A bundled model name ("tiny-t2i") or a local folder -> an existing folder path."""
    if path_or_name in BUNDLED:
        path = os.path.join(ASSETS_DIR, BUNDLED[path_or_name])
    else:
        path = path_or_name
    if not os.path.isdir(path):
        raise ModelPathError(
            f"model path {path_or_name!r} is not a folder; give a local diffusers-format folder "
            f"or one of the bundled models {sorted(BUNDLED)} (no downloads are made)"
        )
    if not os.path.isdir(os.path.join(path, "unet")) or not os.path.isdir(os.path.join(path, "scheduler")):
        raise ModelPathError(
            f"model path {path!r} has no unet/ and scheduler/ subfolders; expected a diffusers-format "
            "folder as written by save_pretrained (unet/, scheduler/, text_encoder/, tokenizer/, optional vae/)"
        )
    return path


def load_pipeline(path_or_name: str, torch_dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedPipeline:
    """Load unet, text encoder, tokenizer, scheduler and optional VAE from a local folder, never the hub.

    The scheduler class decides the family: FlowMatchEulerDiscreteScheduler -> "flow", anything else is
    loaded as a DDIMScheduler from its config ("ddim"), as DDPO does for Stable Diffusion checkpoints.
    """
    path = resolve_model_path(path_or_name)
    kw = dict(local_files_only=True)
    sched_cfg = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kw)
    if sched_cfg.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
        scheduler, family = FlowMatchEulerDiscreteScheduler.from_config(sched_cfg), "flow"
    else:
        scheduler, family = DDIMScheduler.from_config(sched_cfg), "ddim"
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=torch_dtype, **kw).to(device)
    text_encoder = tokenizer = vae = None
    if os.path.isdir(os.path.join(path, "text_encoder")):
        text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=torch_dtype, **kw).to(device)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
    if os.path.isdir(os.path.join(path, "vae")):
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=torch_dtype, **kw).to(device)
    for m in (unet, text_encoder, vae):
        if m is not None:
            m.requires_grad_(False)
            m.eval()
    return LoadedPipeline(unet, text_encoder, tokenizer, scheduler, vae, family, path)

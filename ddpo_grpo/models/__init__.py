"""Loading diffusion pipelines from a local folder, offline: the bundled tiny models and ordinary
Stable Diffusion-style checkpoints (subfolders unet/, text_encoder/, tokenizer/, scheduler/, optional vae/)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer

from ddpo_grpo.core.families import family_of_scheduler

BUNDLED = {
    "tiny-t2i": "tiny-t2i",
    "tiny-t2i-noisy": "tiny-t2i-noisy",  # tiny-t2i after noisy-colour captions: the efficacy task tiny_colour
    "tiny-flow": "tiny-flow",
    "tiny-recam": "tiny-recam",
}
# Models built from configs in memory (random weights, nothing read from disk): name -> family.
BUILT = {"sd15-random": "ddim"}
# The bundled models: in a source checkout (editable install or none) the top-level assets/ beside ddpo_grpo/;
# in a wheel / non-editable install ddpo_grpo/assets/, where setup.py maps assets/ as package data. A checkout is
# recognised by its setup.py, so an installed copy never reads a checkout's folder (nor a checkout a stale one).
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECKOUT = os.path.dirname(_PKG_DIR)
ASSETS_DIR = (os.path.join(_CHECKOUT, "assets") if os.path.isfile(os.path.join(_CHECKOUT, "setup.py"))
              else os.path.join(_PKG_DIR, "assets"))


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
            f"or one of the bundled models {sorted(BUNDLED)} or built ones {sorted(BUILT)} (no downloads are made)"
        )
    if not os.path.isdir(os.path.join(path, "unet")) or not os.path.isdir(os.path.join(path, "scheduler")):
        raise ModelPathError(
            f"model path {path!r} has no unet/ and scheduler/ subfolders; expected a diffusers-format "
            "folder as written by save_pretrained (unet/, scheduler/, text_encoder/, tokenizer/, optional vae/)"
        )
    return path


def load_pipeline(path_or_name: str, torch_dtype: torch.dtype = torch.float32, device: str = "cpu",
                  resolution: int = 0) -> LoadedPipeline:
    """Load unet, text encoder, tokenizer, scheduler and optional VAE from a local folder, never the hub; or build
    a BUILT model ("sd15-random") at `resolution` pixels (0: its native size).

    The scheduler class decides the family (core.families.family_of_scheduler): FlowMatchEulerDiscreteScheduler ->
    "flow", anything else is loaded as a DDIMScheduler from its config ("ddim"), as DDPO does for Stable Diffusion
    checkpoints.
    """
    if path_or_name in BUILT:
        from .sd15_random import NATIVE_RESOLUTION, build_sd15_random

        return build_sd15_random(resolution or NATIVE_RESOLUTION, torch_dtype=torch_dtype, device=device)
    path = resolve_model_path(path_or_name)
    kw = dict(local_files_only=True)
    sched_cfg = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kw)
    family = family_of_scheduler(sched_cfg.get("_class_name"))
    scheduler = family.scheduler_from_config(sched_cfg)
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
    return LoadedPipeline(unet, text_encoder, tokenizer, scheduler, vae, family.name, path)


UNET_ATTENTION = ("sdpa", "math")
COMPILE_MODES = ("", "default", "reduce-overhead", "max-autotune")


def apply_unet_options(unet: torch.nn.Module, config) -> torch.nn.Module:
    """The config's speed switches on the denoiser, in place: attention kernel, channels_last, gradient
    checkpointing, torch.compile (nn.Module.compile keeps the module and its state_dict keys, so checkpoints
    and LoRA adapters are unaffected). Call after adapters are added. Returns the same module."""
    from diffusers.models.attention_processor import AttnProcessor

    if config.unet_attention not in UNET_ATTENTION:
        raise ValueError(f"unet_attention={config.unet_attention!r}; choose one of {UNET_ATTENTION}")
    if config.compile_unet not in COMPILE_MODES:
        raise ValueError(f"compile_unet={config.compile_unet!r}; choose one of {COMPILE_MODES}")
    # "sdpa" keeps the model's own processors (diffusers picks SDPA on torch 2), so existing runs are unchanged.
    if config.unet_attention == "math" and unet.attn_processors:
        unet.set_attn_processor(AttnProcessor())
    if config.channels_last:
        unet.to(memory_format=torch.channels_last)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if config.compile_unet:
        unet.compile(mode=config.compile_unet)
    return unet

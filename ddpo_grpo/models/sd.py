"""Stable Diffusion 1.x/2.x-style models (StableDiffusionPipeline): a UNet2DConditionModel with a CLIP text encoder
and an optional VAE. Also the bundled tiny models (pixel-space: no VAE; tiny-recam: no text encoder either)."""
from __future__ import annotations

import os
from typing import Sequence

import torch

from .adapter import ModelAdapter
from .base import LoadedPipeline, component_dtype, folder_vae_dtype, freeze, load_scheduler


class SDAdapter(ModelAdapter):
    name = "sd"
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2")
    fsdp_block_classes = ("ResnetBlock2D", "BasicTransformerBlock")

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, lora=False) -> LoadedPipeline:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        kw = dict(local_files_only=True)
        scheduler, family = load_scheduler(path)
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=component_dtype(
            "denoiser", torch_dtype, lora=lora), **kw).to(device)
        text_encoder = tokenizer = vae = None
        if os.path.isdir(os.path.join(path, "text_encoder")):
            text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=component_dtype(
                "text_encoder", torch_dtype), **kw).to(device)
            tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
        if os.path.isdir(os.path.join(path, "vae")):
            vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=folder_vae_dtype(path, torch_dtype),
                                                **kw).to(device)
        freeze(unet, text_encoder, vae)
        return LoadedPipeline(unet, text_encoder, tokenizer, scheduler, vae, family, path, adapter=self)

    def encode(self, pipe, prompts: Sequence[str]) -> torch.Tensor:
        """CLIP's last hidden states (B, 77, D), as StableDiffusionPipeline.encode_prompt; zeros (B, 1, D) for a
        model without a text encoder (conditions are not prompts: recam)."""
        from ddpo_grpo.core.pipeline_with_logprob import encode_prompts

        if pipe.text_encoder is None:
            return torch.zeros(len(prompts), 1, pipe.unet.config.cross_attention_dim, device=pipe.unet.device)
        return encode_prompts(pipe.text_encoder, pipe.tokenizer, prompts)

    def sample_shape(self, pipe) -> tuple:
        cfg = pipe.unet.config
        size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
        return (cfg.out_channels, size, size)

    def stock_pipeline(self, pipe, denoiser):
        """StableDiffusionPipeline where there is a VAE and a CLIP text encoder. The bundled tiny models are
        pixel-space (no VAE): no stock pipeline class samples them."""
        from diffusers import AutoencoderKL, StableDiffusionPipeline

        if isinstance(pipe.vae, AutoencoderKL) and pipe.text_encoder is not None:
            return StableDiffusionPipeline(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                                           unet=denoiser, scheduler=pipe.scheduler, safety_checker=None,
                                           feature_extractor=None, requires_safety_checker=False)
        return None


ADAPTER = SDAdapter()

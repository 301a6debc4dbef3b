"""LAION aesthetic score: an MLP on L2-normalised CLIP image embeddings.

The architecture matches the public improved-aesthetic-predictor (CLIP ViT-L/14, 768-d embeddings,
MLP 768 -> 1024 -> 128 -> 64 -> 16 -> 1 with dropout), so its state dict
(e.g. `sac+logos+ava1-l14-linearMSE.pth`, keys `layers.0.weight`, ...) loads as is.
Everything is read from local paths; nothing is downloaded.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from ._images import finite_rows, image_batch, to_uint8_hwc
from .registry import ConfigError, register_reward

_CLIP_HELP = (
    "a local folder with a transformers CLIP checkpoint (config.json, model weights and "
    "preprocessor_config.json), e.g. a saved copy of openai/clip-vit-large-patch14"
)
_MLP_HELP = (
    "a local state-dict file of the LAION improved-aesthetic-predictor MLP "
    "(e.g. sac+logos+ava1-l14-linearMSE.pth; keys layers.0.weight ... layers.7.bias)"
)


class AestheticMLP(nn.Module):
    """embed_dim -> 1024 -> 128 -> 64 -> 16 -> 1; state-dict keys `layers.{0,2,4,6,7}.*`."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def _check_path(field: str, path: Optional[str], help_text: str, want_dir: bool) -> str:
    if not path:
        raise ConfigError(f"aesthetic reward: set `{field}` to {help_text}")
    path = os.path.expanduser(str(path))
    if not (os.path.isdir(path) if want_dir else os.path.isfile(path)):
        kind = "folder" if want_dir else "file"
        raise ConfigError(f"aesthetic reward: `{field}` = {path!r} is not an existing {kind}; it must be {help_text}")
    return path


def _load_state_dict(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ConfigError(f"aesthetic reward: `mlp_path` = {path!r} holds {type(sd).__name__}, not a state dict")
    return sd


def _dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ConfigError(f"aesthetic reward: unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


class AestheticScorer(nn.Module):
    """CLIP vision tower + projection, L2 normalisation, aesthetic MLP. `forward(images) -> (B,)`."""

    def __init__(self, clip_model_path: str, mlp_path: str, embed_dim: Optional[int] = None,
                 device: str = "cpu", dtype: Union[str, torch.dtype] = torch.float32):
        super().__init__()
        clip_model_path = _check_path("clip_model_path", clip_model_path, _CLIP_HELP, want_dir=True)
        mlp_path = _check_path("mlp_path", mlp_path, _MLP_HELP, want_dir=False)
        from transformers import CLIPImageProcessor, CLIPModel  # slow import: only once the paths exist

        try:
            clip = CLIPModel.from_pretrained(clip_model_path, local_files_only=True)
        except Exception as e:
            raise ConfigError(f"aesthetic reward: could not load `clip_model_path` = {clip_model_path!r} "
                              f"({type(e).__name__}: {e}); it must be {_CLIP_HELP}") from e
        proj = clip.config.projection_dim
        if embed_dim is None:
            embed_dim = proj
        elif embed_dim != proj:
            raise ConfigError(f"aesthetic reward: `embed_dim` = {embed_dim} but the CLIP model at "
                              f"{clip_model_path!r} projects to {proj} dims")
        if os.path.isfile(os.path.join(clip_model_path, "preprocessor_config.json")):
            self.processor = CLIPImageProcessor.from_pretrained(clip_model_path, local_files_only=True)
        else:  # CLIP's standard preprocessing at the model's resolution
            s = clip.config.vision_config.image_size
            self.processor = CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
        self.vision_model = clip.vision_model
        self.visual_projection = clip.visual_projection
        del clip  # the text tower is not needed
        self.mlp = AestheticMLP(embed_dim)
        try:
            self.mlp.load_state_dict(_load_state_dict(mlp_path))
        except RuntimeError as e:
            raise ConfigError(f"aesthetic reward: `mlp_path` = {mlp_path!r} does not fit an MLP on "
                              f"{embed_dim}-d embeddings: {e}") from e
        self.device_ = torch.device(device)
        self.dtype_ = _dtype(dtype)
        self.to(self.device_, self.dtype_).eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        arr = to_uint8_hwc(images)
        pix = self.processor(images=list(arr), return_tensors="pt")["pixel_values"]
        pix = pix.to(self.device_, self.dtype_)
        pooled = self.vision_model(pixel_values=pix).pooler_output
        embeds = self.visual_projection(pooled)
        embeds = embeds / embeds.norm(dim=-1, keepdim=True)
        return self.mlp(embeds).squeeze(-1).float().cpu()


@register_reward("aesthetic")
def make_aesthetic_reward(clip_model_path: Optional[str] = None, mlp_path: Optional[str] = None,
                          embed_dim: Optional[int] = None, device: str = "cpu",
                          dtype: Union[str, torch.dtype] = "float32", batch_size: int = 32):
    """`embed_dim` defaults to the CLIP model's projection_dim (768 for ViT-L/14)."""
    scorer = AestheticScorer(clip_model_path, mlp_path, embed_dim=embed_dim, device=device, dtype=dtype)

    def aesthetic(images, prompts, metadata):
        x = image_batch(images, "aesthetic")
        if x.shape[1] != 3:
            raise ValueError(f"aesthetic reward needs RGB images (B, 3, H, W), got {tuple(x.shape)}")
        parts = [scorer(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        scores = torch.cat(parts).numpy().astype(np.float32) if parts else np.zeros(0, np.float32)
        scores[~finite_rows(x)] = np.nan
        return scores, {}

    aesthetic.scorer = scorer
    return aesthetic

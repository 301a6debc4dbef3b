"""ReCamMaster: camera re-rendering of a source video with Wan 2.1 plus per-block camera layers.

What is loaded: a Wan 2.1 folder (`pretrained.model`: UMT5, the Wan VAE, the flow scheduler, the transformer's
config) and a ReCamMaster checkpoint (`pretrained.recam_checkpoint`: `torch.save(dit.state_dict())` as ReCamMaster
writes it, or a .safetensors of the same tensors): the whole DiT with the *original* Wan key names
(`blocks.N.self_attn.q.weight`, `head.modulation`, ...) plus, per block, `blocks.N.cam_encoder.{weight,bias}`
(Linear 12 -> dim) and `blocks.N.projector.{weight,bias}` (Linear dim -> dim). The Wan keys are renamed by diffusers'
own converter (`convert_wan_transformer_to_diffusers`); every tensor of the checkpoint is used, none is missing.

The model (`RecamDenoiser`, the trainer's `unet`), for noisy target latents x (B, C, F', h, w), the clean source
latents s (B, C, F', h, w) and the camera numbers c (B, F', 12):

    input    = cat([x, s], frame axis)                    (B, C, 2F', h, w); one timestep, RoPE over 2F' frames
    block    : x_mod = modulate(norm1(x)) + cam_encoder(c[frame of the token mod F'])   (same for target frame i
               and source frame i), x += gate * projector(self_attn(x_mod)); cross-attention and FFN are Wan's
    output   = the prediction's first F' frames           (B, C, F', h, w)

In diffusers terms the camera embedding is added to `attn1`'s input and `projector` applied to `attn1`'s output in
every `WanTransformerBlock` (two hooks on `attn1`, no block class of our own: FSDP2 wraps the same classes and LoRA
targets the same names as for Wan).

The condition the sampler, the tracker and CFG carry is one tensor per sample, `condition_channels` (B, C + 12,
F', h, w): the normalised source latents (encoded once per condition with the VAE's posterior mean, as WanPipeline
normalises latents) and the 12 camera numbers of each latent frame as constant planes. The sampler concatenates it to
the noisy latents on the channel axis exactly as for any image-conditioned model (core.policy_step), and both CFG
passes get it; RecamDenoiser takes it apart again. The text goes as for Wan (WanPipeline.encode_prompt).

Exports: the diffusers WanPipeline folder (its transformer also holds the camera tensors), LoRA in diffusers' format,
and `recammaster.ckpt`: the DiT with the input checkpoint's key names, shapes and dtype (LoRA merged), what
ReCamMaster's inference loads with `load_state_dict(strict=True)`. `scripts/recam_render.py` renders with it.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Sequence

import torch

from ddpo_grpo.errors import ConfigError

from .base import DenoiserOutput, PackedDenoiser, component_dtype, default_dtype
from .recam_checkpoint import (  # noqa: F401  (the checkpoint format's names, importable from here too)
    camera_keys, merged_state, original_state, read_checkpoint, to_diffusers_key, to_original_key)
from .wan import WanAdapter

CAMERA_DIM = 12  # per latent frame: the row-major top 3x4 of the target pose relative to the first frame
EXPORT_CHECKPOINT = "recammaster.ckpt"  # in an export folder: the DiT as a ReCamMaster checkpoint


# --------------------------------------------------------------------------------------------- the camera layers
class _AddCamera:
    """attn1 forward pre-hook (with kwargs): x_mod + cam_encoder(per-token camera numbers). An object holding its
    block (not a closure), so a deep copy of the model reads its own block. diffusers' WanTransformerBlock passes
    attn1's input positionally in some releases and as `hidden_states=` in others: both are taken, anything else is
    an error rather than a silently camera-less model."""

    def __init__(self, block):
        self.block = block

    def __call__(self, module, args, kwargs):
        cam = self.block._recam_tokens  # (B, S, 12), set by RecamDenoiser for this call
        add = lambda x: x + self.block.cam_encoder(cam.to(x.dtype)).to(x.dtype)  # noqa: E731
        if args:
            return (add(args[0]),) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=add(kwargs["hidden_states"]))
        raise TypeError("ReCamMaster camera hook: attn1 was called without its input (no positional argument, no "
                        f"hidden_states=; got {sorted(kwargs)}): this diffusers release is not supported")


class _Project:
    """attn1 forward hook: projector(self_attn(x_mod)), before the block's gate."""

    def __init__(self, block):
        self.block = block

    def __call__(self, module, args, output):
        return self.block.projector(output)


def add_camera_layers(transformer: torch.nn.Module) -> torch.nn.Module:
    """Give every WanTransformerBlock ReCamMaster's camera layers, initialised as ReCamMaster does (cam_encoder zero,
    projector identity: the model is then exactly Wan), and the hooks that apply them. In place; returns it."""
    if getattr(transformer, "_recam_layers", False):
        return transformer
    for block in transformer.blocks:
        dim = block.attn1.to_q.in_features
        ref = block.attn1.to_q.weight
        block.cam_encoder = torch.nn.Linear(CAMERA_DIM, dim, device=ref.device, dtype=ref.dtype)
        block.projector = torch.nn.Linear(dim, dim, device=ref.device, dtype=ref.dtype)
        if ref.device.type != "meta":
            with torch.no_grad():
                block.cam_encoder.weight.zero_()
                block.cam_encoder.bias.zero_()
                block.projector.weight.copy_(torch.eye(dim))
                block.projector.bias.zero_()
        block._recam_tokens = None
        block.attn1.register_forward_pre_hook(_AddCamera(block), with_kwargs=True)
        block.attn1.register_forward_hook(_Project(block))
    transformer._recam_layers = True
    return transformer


def camera_tokens(cameras: torch.Tensor, patch_hw: int, copies: int = 2) -> torch.Tensor:
    """cameras (B, F', 12) -> (B, copies * F' * patch_hw, 12): each token's camera numbers in the transformer's token
    order (frame, height, width) over the concatenated [target, source] frames; source frame i gets frame i's."""
    per_frame = cameras.repeat(1, copies, 1)  # (B, copies * F', 12): frame f reads f mod F'
    return per_frame.repeat_interleave(patch_hw, dim=1)


class RecamDenoiser(PackedDenoiser):
    """A WanTransformer3DModel with camera layers behind the trainer's denoiser call. `sample` (B, 2C + 12, F', h, w)
    is the noisy target latents followed by `RecamAdapter.condition_channels`: the source latents and the camera
    planes (module docstring). Returns the target half of the prediction (B, C, F', h, w)."""

    def forward(self, sample, timestep, encoder_hidden_states=None, **kwargs) -> DenoiserOutput:
        model = self.model
        C = model.config.out_channels
        if sample.shape[1] != 2 * C + CAMERA_DIM:
            raise ValueError(f"RecamDenoiser takes (B, {2 * C + CAMERA_DIM}, F, h, w): noisy latents, source latents "
                             f"and {CAMERA_DIM} camera planes; got {tuple(sample.shape)}")
        target, source = sample[:, :C], sample[:, C:2 * C]
        cameras = sample[:, 2 * C:, :, 0, 0].transpose(1, 2).float()  # (B, F', 12)
        _, ph, pw = model.config.patch_size
        tokens = camera_tokens(cameras, (sample.shape[3] // ph) * (sample.shape[4] // pw))
        for block in model.blocks:
            block._recam_tokens = tokens  # kept for a gradient-checkpointed block's recompute in backward
        out = model(torch.cat([target, source], dim=2), timestep, encoder_hidden_states=encoder_hidden_states,
                    return_dict=False)[0]
        return DenoiserOutput(out[:, :, :target.shape[2]])


def camera_planes(cameras: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """cameras (B, F', 12) -> constant planes (B, 12, F', height, width)."""
    return cameras.transpose(1, 2)[..., None, None].expand(-1, -1, -1, height, width)


# --------------------------------------------------------------------------------------------------- the adapter
class RecamAdapter(WanAdapter):
    name = "recam"
    # ReCamMaster's own trainable set: the camera layers and every self-attention (as LoRA targets, and as the
    # parameters a full fine-tune trains).
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "cam_encoder", "projector")
    full_trainable = ("attn1.", "cam_encoder.", "projector.")

    def load(self, path, torch_dtype=torch.float32, device="cpu", resolution=0, num_frames=0,
             checkpoint: str = "", lora=False):
        from diffusers import WanTransformer3DModel

        state = read_checkpoint(checkpoint)
        config = WanTransformer3DModel.load_config(path, subfolder="transformer", local_files_only=True)
        keymap = self.check_checkpoint(state, config, checkpoint)
        dtype = component_dtype("denoiser", torch_dtype, lora=lora)
        # Built where it runs, in its dtype (its RoPE tables are computed at construction), then every tensor of the
        # checkpoint is copied in: strict both ways.
        with default_dtype(dtype), torch.device(device):
            transformer = add_camera_layers(WanTransformer3DModel.from_config(config))
        missing, unexpected = transformer.load_state_dict({keymap[k]: v for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise ConfigError(f"pretrained.recam_checkpoint {checkpoint!r} does not fit the folder's transformer: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        pipe = super().load(path, torch_dtype=torch_dtype, device=device, resolution=resolution,
                            num_frames=num_frames, transformer=transformer)
        pipe.unet = RecamDenoiser(transformer)  # components["transformer"] stays the diffusers model
        pipe.recam_checkpoint = dict(path=checkpoint, keys={v: k for k, v in keymap.items()},
                                     dtypes={k: v.dtype for k, v in state.items()})
        return pipe

    @staticmethod
    def check_checkpoint(state: Dict[str, torch.Tensor], config, path: str = "") -> Dict[str, str]:
        """original key -> diffusers key for every tensor of a ReCamMaster checkpoint; ConfigError (one line) for a
        checkpoint without camera layers, or whose widths or camera size do not fit the folder's transformer."""
        layers = int(config["num_layers"])
        dim = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
        what = f"pretrained.recam_checkpoint {path!r}"
        if "blocks.0.cam_encoder.weight" not in state:
            raise ConfigError(f"{what} has no camera layers (no blocks.0.cam_encoder.weight): a plain Wan checkpoint, "
                              "not ReCamMaster's; use the Wan folder alone (pretrained.recam_checkpoint='')")
        missing = [k for k in camera_keys(layers) if k not in state]
        if missing:
            raise ConfigError(f"{what} lacks camera tensors for the folder's {layers} blocks, e.g. {missing[0]}")
        extra = sorted({int(m.group(1)) for k in state for m in [re.match(r"blocks\.(\d+)\.", k)] if m} - set(range(layers)))
        if extra:
            raise ConfigError(f"{what} has blocks {extra[:3]} beyond the folder's transformer ({layers} blocks)")
        w = state["blocks.0.cam_encoder.weight"]
        if tuple(w.shape) != (dim, CAMERA_DIM):
            if w.shape[0] != dim:
                raise ConfigError(f"{what} is {w.shape[0]} wide (cam_encoder {tuple(w.shape)}); the folder's transformer "
                                  f"is {dim} wide (num_attention_heads x attention_head_dim)")
            raise ConfigError(f"{what} takes {w.shape[1]} camera numbers per frame (cam_encoder {tuple(w.shape)}); "
                              f"ReCamMaster's camera is {CAMERA_DIM} (the top 3x4 of a pose)")
        keymap = {}
        for k in state:
            d = to_diffusers_key(k)
            if to_original_key(d) != k.replace("model.diffusion_model.", ""):
                raise ConfigError(f"{what}: key {k!r} is not a Wan 2.1 T2V key (it maps to {d!r}, which does not map "
                                  "back); only Wan 2.1 T2V-based ReCamMaster checkpoints are supported")
            keymap[k] = d
        return keymap

    def condition_channels(self, pipe, items: Sequence[dict], device) -> torch.Tensor:
        """(B, C + 12, F', h, w): each item's "source_video" (F, 3, H, W) in [0, 1] encoded by the VAE (posterior mean,
        normalised) and its "cameras" (F', 12) as constant planes. The trainer caches it per condition."""
        from ddpo_grpo.core.offload import compute_device
        from ddpo_grpo.core.pipeline_with_logprob import encode_frames

        C, F, h, w = self.sample_shape(pipe)
        vae_device = compute_device(pipe.vae, device)  # `device` for a parked VAE (pretrained.offload), which visits it
        out = []
        for it in items:
            if "source_video" not in it or "cameras" not in it:
                raise ConfigError("a ReCamMaster model needs conditions with 'source_video' and 'cameras' "
                                  "(data.name='recam_video' or a dataset of that form)")
            src = torch.as_tensor(it["source_video"], dtype=torch.float32)
            cams = torch.as_tensor(it["cameras"], dtype=torch.float32)
            if src.ndim != 4 or src.shape[0] != pipe.num_frames or tuple(src.shape[2:]) != (pipe.height, pipe.width):
                raise ConfigError(f"condition {it.get('index')}: source_video {tuple(src.shape)} does not fit the model's "
                                  f"({pipe.num_frames}, 3, {pipe.height}, {pipe.width}) (pretrained.num_frames / resolution)")
            if tuple(cams.shape) != (F, CAMERA_DIM):
                raise ConfigError(f"condition {it.get('index')}: cameras {tuple(cams.shape)}; the model samples {F} latent "
                                  f"frames, so it needs ({F}, {CAMERA_DIM})")
            z = encode_frames(pipe.vae, src[None].to(vae_device)).float()
            out.append(torch.cat([z, camera_planes(cams[None].to(z.device), h, w)], dim=1))
        return torch.cat(out).to(device)

    def condition_channel_count(self, pipe) -> int:
        return int(pipe.unet.config.out_channels) + CAMERA_DIM

    def export_settings(self, pipe) -> dict:
        """The Wan sizes, and the checkpoint file beside export.json (scripts/recam_render.py --checkpoint)."""
        return dict(super().export_settings(pipe), recam_checkpoint=EXPORT_CHECKPOINT)

    def meta_denoiser(self, model: torch.nn.Module) -> torch.nn.Module:
        """An empty copy of the diffusers model with the camera layers (exports load the trained tensors into it)."""
        with torch.device("meta"):
            return add_camera_layers(type(model).from_config(model.config))

    def write_extra(self, pipe, unet, state: Dict[str, torch.Tensor], out_dir: str, lora: bool) -> None:
        """recammaster.ckpt: the trained DiT under the input checkpoint's key names, shapes and dtypes (LoRA merged
        into the weights), saved with torch.save as ReCamMaster saves its checkpoints."""
        from .base import inner_state

        tensors = merged_state(unet, inner_state(unet, state)) if lora else dict(inner_state(unet, state))
        info = getattr(pipe, "recam_checkpoint", None) or {}
        keys = info.get("keys") or {d: to_original_key(d) for d in tensors}
        dtypes = info.get("dtypes") or {}
        out = {}
        for d, orig in keys.items():
            if d not in tensors:
                raise ValueError(f"the trained model has no tensor {d!r} for checkpoint key {orig!r}")
            t = tensors[d].detach().to("cpu")
            out[orig] = t.to(dtypes.get(orig, t.dtype)).contiguous()
        torch.save(out, os.path.join(out_dir, EXPORT_CHECKPOINT))


ADAPTER = RecamAdapter()


# ------------------------------------------------------------------------------------------------------ builds
TINY_CAMERA_SEED = 1


def build_tiny(out_dir: str) -> str:
    """"recam-tiny": the wan-tiny folder (models.wan.build_tiny: 32x32 px, 5 frames, 2 blocks of width 24) and, inside
    it, `recammaster.ckpt`: its DiT with camera layers under the original key names, as ReCamMaster saves one. The
    camera layers are seeded random (not ReCamMaster's zero / identity start), so the camera changes the output."""
    from diffusers import WanTransformer3DModel

    from .wan import build_tiny as build_wan_tiny

    build_wan_tiny(out_dir)
    transformer = add_camera_layers(WanTransformer3DModel.from_pretrained(out_dir, subfolder="transformer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_CAMERA_SEED)
        for block in transformer.blocks:
            dim = block.projector.in_features
            torch.nn.init.normal_(block.cam_encoder.weight, std=0.5)
            torch.nn.init.normal_(block.cam_encoder.bias, std=0.1)
            with torch.no_grad():
                block.projector.weight.add_(torch.randn(dim, dim) * 0.1)
    torch.save(original_state(transformer), os.path.join(out_dir, EXPORT_CHECKPOINT))
    return out_dir


def build_recam_1_3b_random(resolution: int = 0, num_frames: int = 0, torch_dtype: torch.dtype = torch.bfloat16,
                            device="cuda", seed: int = 0, denoiser_dtype: torch.dtype = None):
    """ReCamMaster's shapes with seeded random weights ("recam-1.3b-random", GPU only): Wan 2.1 T2V 1.3B
    (models.wan.build_wan21_1_3b_random) with the camera layers at ReCamMaster's start (zero / identity), for real-shape
    dry runs, speed and memory. What it draws is noise."""
    from .wan import build_wan21_1_3b_random

    pipe = build_wan21_1_3b_random(resolution, num_frames, torch_dtype, device, seed, denoiser_dtype)
    pipe.unet = RecamDenoiser(add_camera_layers(pipe.unet))
    pipe.adapter = ADAPTER
    pipe.path = "recam-1.3b-random"
    return pipe

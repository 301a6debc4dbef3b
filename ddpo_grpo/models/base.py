"""The architecture axis: what a denoiser needs, one ModelAdapter per diffusers pipeline kind.

The sampler family (DDIM or flow, core/families.py) is the other axis and is chosen by the scheduler; the adapter
owns only what differs by architecture: loading the components from a local folder, encoding prompts, the
latent shape, the denoiser call, decoding, the LoRA targets, the FSDP2 block classes and the export formats.

Everything else (sampling, training, evaluation, references, checkpoints) sees one interface:

- `pipe.unet`: the denoiser as a module called `unet(x, t, encoder_hidden_states=cond)` returning an object with
  `.sample` (x's shape), exactly as a UNet2DConditionModel. Architectures whose model takes more than one
  condition tensor (SDXL's pooled embeds and time ids, SD3's and FLUX's pooled projections) are wrapped in a
  `PackedDenoiser`, which unpacks `cond`;
- `pipe.encode(prompts) -> cond (B, L, D)`: one tensor per prompt, whatever the architecture: the sequence
  embeddings, plus, where the model takes vectors too, those vectors packed into extra rows (pack_condition).
  So a condition is cached, stored, indexed, concatenated for classifier-free guidance and sharded like any
  (B, L, D) tensor, and the GRPO code never learns which architecture it trains.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# The interface an architecture implements, in its own module so that the registry can check plugins against
# it without importing this one (which re-exports the registry). Importable from here, as before.
from .adapter import ModelAdapter  # noqa: F401


# ----------------------------------------------------------------------------------------- condition packing
def pack_condition(seq: torch.Tensor, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """seq (B, L, D) and vectors [(B, d_i)] -> (B, L + r, D): the vectors concatenated, zero-padded to r * D and
    appended as r extra rows (r = ceil(sum d_i / D)). unpack_condition with the same sizes inverts it exactly."""
    if not vectors:
        return seq
    flat = torch.cat([v.to(seq.dtype) for v in vectors], dim=1)
    B, D = seq.shape[0], seq.shape[2]
    rows = math.ceil(flat.shape[1] / D)
    flat = torch.nn.functional.pad(flat, (0, rows * D - flat.shape[1]))
    return torch.cat([seq, flat.reshape(B, rows, D)], dim=1)


def unpack_condition(cond: torch.Tensor, sizes: Sequence[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Inverse of pack_condition: cond (B, L + r, D) -> seq (B, L, D), [vectors (B, d_i)]."""
    if not sizes:
        return cond, []
    B, D = cond.shape[0], cond.shape[2]
    rows = math.ceil(sum(sizes) / D)
    flat = cond[:, -rows:].reshape(B, rows * D)
    out, at = [], 0
    for d in sizes:
        out.append(flat[:, at:at + d])
        at += d
    return cond[:, :-rows], out


@dataclass(eq=False)
class DenoiserOutput:
    """What diffusers' models return: the prediction as `.sample`.

    A dataclass, like diffusers' BaseOutput, because FSDP2 finds the output tensors of a sharded module's forward
    (torch.distributed.utils._apply_to_tensors) only in tensors, dataclasses, dicts, lists and tuples: inside a plain
    object it registers no pre-backward hook, so the root group (a PackedDenoiser: SD3's proj_out, norm_out, ...)
    is never all-gathered again for backward and autograd reads its freed storage ("setStorage: ... storage of size
    0"). eq=False: outputs compare by identity, as before (a field-wise == of tensors means nothing)."""

    sample: torch.Tensor


class PackedDenoiser(torch.nn.Module):
    """A diffusers denoiser (`self.model`) behind the UNet call signature, for architectures that take several
    condition tensors: subclasses unpack `encoder_hidden_states` and call the model. Its state_dict keys are the
    model's with the prefix "model." (adapters strip it for export)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, sample, timestep, encoder_hidden_states=None, **kwargs) -> DenoiserOutput:
        raise NotImplementedError

    # The diffusers model's switches, so that models.apply_unet_options works on the wrapper as on a UNet.
    @property
    def attn_processors(self):
        return self.model.attn_processors

    def set_attn_processor(self, processor) -> None:
        self.model.set_attn_processor(processor)

    def enable_gradient_checkpointing(self, *args, **kwargs) -> None:
        self.model.enable_gradient_checkpointing(*args, **kwargs)


def inner_model(denoiser: torch.nn.Module) -> torch.nn.Module:
    """The diffusers model of a denoiser (itself, or a PackedDenoiser's model)."""
    return denoiser.model if isinstance(denoiser, PackedDenoiser) else denoiser


def inner_state(denoiser: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A denoiser's state dict with the PackedDenoiser prefix removed: the diffusers model's own names."""
    if not isinstance(denoiser, PackedDenoiser):
        return state
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


# ----------------------------------------------------------------------------------------------- the pipeline
@dataclass
class LoadedPipeline:
    """What the trainer needs of a model. `family` is "ddim" (noise/v-prediction, DDIM sampling) or "flow"
    (velocity prediction, flow-matching Euler / SDE sampling); `adapter` the architecture."""

    unet: torch.nn.Module  # the denoiser (see the module docstring); a PackedDenoiser where it needs one
    text_encoder: Optional[torch.nn.Module]
    tokenizer: Optional[object]
    scheduler: object
    vae: Optional[torch.nn.Module]
    family: str
    path: str
    adapter: "ModelAdapter" = None
    components: Dict[str, object] = field(default_factory=dict)  # every loaded component by its pipeline name
    resolution: int = 0  # pixels, for architectures whose latent size is not in the denoiser's config

    def __post_init__(self):
        # No default architecture: a default (SD's adapter) made this module import models.sd, which imports this
        # module, an import circle; every adapter's load passes adapter=self (docs/models.md's contract).
        if self.adapter is None:
            raise TypeError("LoadedPipeline needs its architecture's adapter: LoadedPipeline(..., adapter=...), e.g. "
                            "ddpo_grpo.models.sd.ADAPTER for Stable Diffusion")

    @property
    def sample_shape(self) -> tuple:
        """(C, H, W) of the denoised sample (latent shape when there is a VAE); (C, F, H, W) for video."""
        return self.adapter.sample_shape(self)

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """The denoiser's condition (B, L, D) for each prompt (module docstring), in the denoiser's dtype: frozen text
        encoders may run in bf16 (component_dtype), and a condition is stored, doubled for CFG and fed to the float32
        master weights under autocast like any of the trainer's tensors (the upcast is exact). Text encoders parked on
        the host (core.offload: pretrained.offload, or cached embeddings) visit the denoiser's device for the call."""
        from ddpo_grpo.core.offload import visiting

        weight = next(self.unet.parameters())
        with visiting(self.text_encoders(), weight.device):
            return self.adapter.encode(self, prompts).to(weight.dtype)

    def text_encoders(self) -> List[torch.nn.Module]:
        """The text encoders: the components named text_encoder* (in name order), else `text_encoder`; [] for a model
        without one (tiny-recam)."""
        found = [m for k, m in sorted((self.components or {}).items())
                 if k.startswith("text_encoder") and isinstance(m, torch.nn.Module)]
        if not found and isinstance(self.text_encoder, torch.nn.Module):
            found = [self.text_encoder]
        return found


# ------------------------------------------------------------------------------------------------ the registry
# model_index.json `_class_name` -> adapter: the entry-point group ddpo_grpo.models (models/registry.py), where
# setup.py registers ours (sd, sdxl, sd3, flux, wan) as a user's package registers its own. Importable from here
# (docs/models.md: models.base.register); registry.py reads ModelAdapter from models/adapter.py, not from here, so
# this import is one way.
from .registry import adapter_for, model_index_class, register  # noqa: E402,F401


def flow_sigmas_config(cfg: dict) -> bool:
    """A multistep scheduler config over flow-matching sigmas (UniPC / DPM++ with `use_flow_sigmas`, prediction_type
    "flow_prediction": what Wan's folders hold): the model is a flow model, sampled here as flow-matching Euler with
    shift = its `flow_shift`."""
    return bool(cfg.get("use_flow_sigmas")) or cfg.get("prediction_type") == "flow_prediction"


def scheduler_family(path: str) -> str:
    """The family name from the model's scheduler config ("flow" for FlowMatchEulerDiscreteScheduler and flow-sigma
    configs, else "ddim")."""
    import json

    from ddpo_grpo.core.families import family_of_scheduler

    with open(os.path.join(path, "scheduler", "scheduler_config.json")) as f:
        cfg = json.load(f)
    return "flow" if flow_sigmas_config(cfg) else family_of_scheduler(cfg.get("_class_name"), f"model {path!r}").name


# What a DDIM reading fills where a folder's scheduler config is silent: the DDIM family's (core.families).
from ddpo_grpo.core.families import DDIMFamily as _DDIM  # noqa: E402

DDIM_FILLED = dict(_DDIM.filled)


def load_scheduler(path: str, dynamic_shift: bool = False, **overrides):
    """(scheduler, family name): the folder's scheduler config as the family's scheduler class (core.families), e.g.
    a Stable Diffusion PNDM or an SDXL Euler config as DDIM (as DDPO does: the folder's keys kept, DDIM_FILLED's
    filled where absent), and a flow-sigma UniPC config (Wan) as flow-matching Euler with its flow_shift;
    `overrides` replace config entries. dynamic_shift: the caller supplies the resolution-dependent mu of a flow
    config with use_dynamic_shifting (models.sd3); for other callers such a config is one ConfigError line."""
    from diffusers import DDIMScheduler

    from ddpo_grpo.core.families import family_of_scheduler

    cfg = dict(DDIMScheduler.load_config(path, subfolder="scheduler", local_files_only=True), **overrides)
    if flow_sigmas_config(cfg):  # e.g. Wan's UniPC config: flow matching with shift = flow_shift
        import inspect

        from diffusers import FlowMatchEulerDiscreteScheduler

        takes = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters  # (no warning for the rest)
        cfg = dict({k: v for k, v in cfg.items() if k in takes}, _class_name="FlowMatchEulerDiscreteScheduler",
                   shift=overrides.get("shift", cfg.get("flow_shift") or 1.0))
    family = family_of_scheduler(cfg.get("_class_name"), f"model {path!r}")
    cfg = family.fill_config(cfg)
    if cfg.get("use_dynamic_shifting") and not dynamic_shift:
        from ddpo_grpo.errors import ConfigError

        raise ConfigError(f"model {path!r}: scheduler/scheduler_config.json has use_dynamic_shifting=true, whose shift "
                          "(mu) depends on an image-token count this architecture does not define; set it to false "
                          "and give the shift to sample with in `shift`")
    return family.scheduler_from_config(cfg), family.name


# ------------------------------------------------------------------------------------------------ load dtypes
# VAE classes that diffusers' documentation loads in float32 whatever the pipeline's dtype: Wan's (WanPipeline's
# example loads AutoencoderKLWan with torch_dtype=torch.float32 next to a bf16 pipeline, and WanPipeline casts the
# latents to vae.dtype to decode, so the stock pipeline decodes video in float32). 127 M parameters: 0.5 GB.
FP32_VAE_CLASSES = ("AutoencoderKLWan",)
TRAINABLE_DTYPE = torch.float32  # what AdamW updates: a full fine-tune's denoiser, a LoRA run's adapter parameters


def run_dtype(mixed_precision: str) -> torch.dtype:
    """accelerate's mixed_precision ("no", "fp16", "bf16"; "" or None: none) -> the dtype the run computes in."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(mixed_precision or "no"), torch.float32)


def component_dtype(role: str, torch_dtype: torch.dtype, vae_config: Optional[dict] = None,
                    lora: bool = False) -> torch.dtype:
    """The dtype a pipeline component loads in, for a run computing in `torch_dtype` (run_dtype; float32 without
    mixed precision): the one rule every adapter's load and every real-shape build follows.

    - "denoiser": float32 for a full fine-tune. accelerate's mixed precision autocasts the forward and expects fp32
      parameters: they are the master weights AdamW updates (a bf16 weight loses an update smaller than 2^-8 of
      itself). Under LoRA (`lora=True`) the denoiser is a frozen base, run forward only: `torch_dtype`, as diffusers'
      LoRA scripts hold it (FLUX.1-dev's 11.9 B base: 22 GiB instead of 44), while the adapter's parameters, which
      AdamW updates, are float32 (TRAINABLE_DTYPE: build.make_trainable casts them, diffusers'
      cast_training_params). Sampling and training run the same module, so the on-policy ratio stays 1;
    - "text_encoder": `torch_dtype`. Frozen, run forward only, as diffusers' pipelines run them in the pipeline's
      dtype; in float32 T5-XXL alone would take 19 GB instead of 9.5;
    - "vae": `torch_dtype`, as diffusers' pipelines run it, except float32 where diffusers decodes in float32: a VAE
      class in FP32_VAE_CLASSES (vae_config["_class_name"]), and an fp16 run with a VAE whose config says
      force_upcast (SDXL's: its decoder overflows fp16; StableDiffusionXLPipeline upcasts it to decode). bf16 has
      float32's range, so bf16 runs keep such VAEs in bf16, as diffusers does."""
    if role == "denoiser":
        return torch_dtype if lora else TRAINABLE_DTYPE
    if role == "text_encoder":
        return torch_dtype
    if role != "vae":
        raise ValueError(f"role {role!r}: one of 'denoiser', 'text_encoder', 'vae'")
    cfg = vae_config or {}
    if cfg.get("_class_name") in FP32_VAE_CLASSES:
        return torch.float32
    if torch_dtype == torch.float16 and cfg.get("force_upcast", True):
        return torch.float32
    return torch_dtype


def folder_vae_dtype(path: str, torch_dtype: torch.dtype, subfolder: str = "vae") -> torch.dtype:
    """component_dtype("vae", ...) for the VAE config in a model folder (float32 runs: float32, nothing read)."""
    import json

    if torch_dtype == torch.float32:
        return torch_dtype
    with open(os.path.join(path, subfolder, "config.json")) as f:
        return component_dtype("vae", torch_dtype, json.load(f))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules constructed inside have `dtype` parameters (torch's default dtype, restored on exit): a build never
    holds a float32 copy of a bf16 component."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def freeze(*modules) -> None:
    for m in modules:
        if isinstance(m, torch.nn.Module):
            m.requires_grad_(False)
            m.eval()



"""The interface one architecture implements: `ModelAdapter` (models/base.py's docstring says what the trainer sees
through it; docs/models.md how to write one). Every adapter file (sd.py, sdxl.py, sd3.py, flux.py, wan.py, recam.py, a
user's plugin) subclasses it, and models/registry.py checks that an entry point names an instance of it.

Its own module, importing nothing of the package, so that registry.py can import it while base.py re-exports the
registry's names: with ModelAdapter inside base.py, base and registry imported each other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # annotations only: LoadedPipeline is base.py's, which imports this module
    from .base import LoadedPipeline


class ModelAdapter:
    """One architecture. Subclasses set the class attributes and implement load / encode / sample_shape."""

    name = ""
    pipeline_class = ""  # the diffusers pipeline class an export is written with ("": none describes the model)
    dynamic_shift = False  # computes the mu of a flow scheduler with use_dynamic_shifting (load_scheduler)
    components: Tuple[str, ...] = ()  # its component names, as in pipe.components
    denoiser_folder = "unet"  # the denoiser's subfolder, and its component name in the pipeline
    lora_prefix = "unet"  # key prefix of the denoiser's tensors in diffusers' LoRA files
    lora_target_modules: Tuple[str, ...] = ()
    fsdp_block_classes: Tuple[str, ...] = ()  # what config/accelerate/fsdp2.yaml wraps, per architecture

    def load(self, path: str, torch_dtype: torch.dtype, device, resolution: int = 0, lora: bool = False
             ) -> LoadedPipeline:
        """The folder's components on `device`. torch_dtype: the dtype the run computes in (run_dtype); each
        component loads in component_dtype's choice for it (frozen encoders in torch_dtype, the denoiser in float32,
        or in torch_dtype when `lora`: a LoRA run's frozen base). load_pipeline passes `lora` only when it is True,
        so an adapter that never trains LoRA may leave it out of its signature."""
        raise NotImplementedError

    def encode(self, pipe: LoadedPipeline, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def sample_shape(self, pipe: LoadedPipeline) -> tuple:
        raise NotImplementedError

    full_trainable: Tuple[str, ...] = ()  # name fragments a full fine-tune trains (empty: every parameter)

    def condition_channels(self, pipe: LoadedPipeline, items: Sequence[dict], device) -> Optional[torch.Tensor]:
        """The per-sample conditioning concatenated to the noisy latents' channels (core.policy_step), (B, C', ...)
        like the latents, or None: the items' "cond_image" tensors where they have them (the recam image world).
        Adapters whose condition must be computed from the item (models.recam: a VAE-encoded source clip) override
        it; the trainer caches the result per condition index."""
        if "cond_image" not in items[0]:
            return None
        return torch.stack([it["cond_image"] for it in items]).to(device)

    def condition_channel_count(self, pipe: LoadedPipeline) -> int:
        """How many channels condition_channels adds to the latents' (0: none, or they come with the data)."""
        return 0

    def meta_denoiser(self, model: torch.nn.Module) -> torch.nn.Module:
        """An empty (meta-device) copy of the diffusers denoiser `model`, for exports to load tensors into."""
        with torch.device("meta"):
            return type(model).from_config(model.config)

    def pixel_size(self, pipe: LoadedPipeline) -> Tuple[int, int]:
        """(height, width) in pixels of a decoded sample: the latent size times the VAE's downscaling,
        2 ** (len(block_out_channels) - 1) as diffusers' image pipelines compute it (1 without a VAE). models.wan
        overrides it (its VAE's config holds the factor)."""
        vae = getattr(pipe.vae, "config", None)
        scale = 2 ** (len(vae.block_out_channels) - 1) if vae is not None and "block_out_channels" in vae else 1
        h, w = pipe.sample_shape[-2:]
        return int(h) * scale, int(w) * scale

    def pipeline_call(self, pipe: LoadedPipeline, num_inference_steps: int, guidance_scale: float) -> dict:
        """The keyword arguments of `pipeline_class`'s __call__ (beside the prompts and the noise: latents or one
        seeded generator per sample) that sample as the run's deterministic eval does with the export's scheduler:
        steps, true CFG, size, and eta 0 where the scheduler's step takes one (DDIM; the pipelines pass `eta` only
        then, as this rule; a flow scheduler steps the ODE: nothing to set). Recorded in export.json
        ("pipeline_call"). Architectures whose call takes more (FLUX's embedded guidance, the T5 length, Wan's
        frames) extend it."""
        import inspect

        h, w = self.pixel_size(pipe)
        call = dict(num_inference_steps=int(num_inference_steps), guidance_scale=float(guidance_scale), height=h,
                    width=w)
        if "eta" in inspect.signature(pipe.scheduler.step).parameters:
            call["eta"] = 0.0
        return call

    def export_settings(self, pipe: LoadedPipeline) -> dict:
        """What export.json records beyond the sampler settings so that the export samples as the run did (models.wan:
        frames and size; models.recam: its checkpoint file). Default none."""
        return {}

    def write_extra(self, pipe: LoadedPipeline, unet: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: str,
                    lora: bool) -> None:
        """Files an export holds beyond diffusers' formats (models.recam: the ReCamMaster checkpoint). Default none."""

    def configure(self, pipe: LoadedPipeline, config) -> None:
        """The run's settings that the model takes beyond its folder, applied after load (FLUX.1-dev: the embedded
        guidance, pretrained.embedded_guidance). Default: none."""

    def diffusers_pipeline(self, pipe: LoadedPipeline):
        """The pipeline_class over the loaded components, made once per pipe: its own encode_prompt and helpers are
        what the adapter calls, so a condition is exactly the one the stock pipeline builds."""
        held = pipe.__dict__.get("_diffusers_pipeline")
        if held is None:
            import diffusers

            held = getattr(diffusers, self.pipeline_class)(**{k: pipe.components[k] for k in self.components})
            pipe.__dict__["_diffusers_pipeline"] = held
        return held

    def stock_pipeline(self, pipe: LoadedPipeline, denoiser: torch.nn.Module):
        """The diffusers pipeline object over the loaded components with `denoiser` (the exported model), or None
        where no stock pipeline class describes the model (then each component is saved in its own folder)."""
        if not self.pipeline_class:
            return None
        import diffusers

        parts = {k: pipe.components[k] for k in self.components}
        parts[self.denoiser_folder] = denoiser
        return getattr(diffusers, self.pipeline_class)(**parts)

    def save_lora(self, out_dir: str, layers: Dict[str, torch.Tensor], metadata: dict) -> None:
        """Write diffusers' LoRA file for the denoiser's adapter tensors (names without the adapter name), with the
        pipeline class's own save_lora_weights (keys `unet.*` or `transformer.*`, the peft config in the metadata)."""
        import diffusers

        cls = getattr(diffusers, self.pipeline_class or "StableDiffusionPipeline")
        cls.save_lora_weights(out_dir, **{f"{self.lora_prefix}_lora_layers": layers,
                                          f"{self.lora_prefix}_lora_adapter_metadata": metadata})

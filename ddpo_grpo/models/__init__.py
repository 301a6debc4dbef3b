"""Loading diffusion pipelines from a local folder, offline, through the adapter of their architecture
(models/base.py): the bundled tiny models, Stable Diffusion-style checkpoints, and the architectures registered under
the entry-point group ddpo_grpo.models (models/registry.py: ours in setup.py, a user's in their package)."""
from __future__ import annotations

import os

import torch

from ddpo_grpo.errors import ConfigError

from .base import LoadedPipeline, adapter_for  # noqa: F401  (LoadedPipeline: the public name)

BUNDLED = {
    "tiny-t2i": "tiny-t2i",
    "tiny-t2i-noisy": "tiny-t2i-noisy",  # tiny-t2i after noisy-colour captions: the efficacy task tiny_colour
    "tiny-flow": "tiny-flow",
    "tiny-recam": "tiny-recam",
    # ReCamMaster's architecture (Wan classes + camera layers) pretrained on the video camera world; its DiT is
    # recammaster.ckpt inside the folder (config recam_video_tiny: pretrained.recam_checkpoint="recammaster.ckpt")
    "tiny-recam-video": "tiny-recam-video",
    # the same architecture, 128 channels wide, pretrained on the 3-D camera world (worlds/room3d), then taught to take
    # the opposite camera for 3 starting noises in 4 in ReCamMaster's trainable set (config recam3d_tiny_grpo; its DiT
    # stored in float16; benchmarks/make_tiny_recam3d.sh; docs/recam.md: the start model of issue 59)
    "tiny-recam3d": "tiny-recam3d",
}
# Models built from configs in memory (random weights, nothing read from disk): name -> family, and name -> the
# builder ("module:function", called as fn(resolution=, torch_dtype=, device=, denoiser_dtype=) and, for video,
# num_frames=; resolution 0: its own default). sd15-random is SD 1.5's scale; the others are the real shapes of
# SDXL, SD3.5-Medium, FLUX.1-dev and Wan 2.1 T2V 1.3B (scripts/bench_gpu.py measures them). What they draw is noise.
BUILT = {"sd15-random": "ddim", "sdxl-random": "ddim", "sd35-medium-random": "flow", "flux-dev-random": "flow",
         "wan21-1.3b-random": "flow", "recam-1.3b-random": "flow"}
BUILDERS = {"sd15-random": "ddpo_grpo.models.sd15_random:build_sd15_random",
            "sdxl-random": "ddpo_grpo.models.sdxl:build_sdxl_random",
            "sd35-medium-random": "ddpo_grpo.models.sd3:build_sd35_medium_random",
            "flux-dev-random": "ddpo_grpo.models.flux:build_flux_dev_random",
            "wan21-1.3b-random": "ddpo_grpo.models.wan:build_wan21_1_3b_random",
            "recam-1.3b-random": "ddpo_grpo.models.recam:build_recam_1_3b_random"}
# Built models that load_pipeline refuses to build on a CPU (one ConfigError line). They are 3.5-17 B parameters in all
# (T5-XXL or UMT5-XXL alone 4.8-5.7 B) at sizes checked against their configs' own (1024 px, 480x832 x 33 frames):
# initialising them takes tens of GB and minutes before the first call, and an epoch hours, so a CPU run is a mistake,
# refused at load rather than found out of memory. sd15-random (1.1 G) stays allowed: at 64 px it is a CPU smoke test.
# "meta" builds them anywhere (shapes only: bench_gpu's FLOP counts).
GPU_ONLY = ("sdxl-random", "sd35-medium-random", "flux-dev-random", "wan21-1.3b-random", "recam-1.3b-random")
# Tiny random builds of other architectures ("module:function(out_dir)", seeded random weights, tokenizers built
# locally): written with save_pretrained into TINY_CACHE on first use, then loaded from that folder like a user's.
TINY_BUILDS = {"sdxl-tiny": "ddpo_grpo.models.sdxl:build_tiny", "sd3-tiny": "ddpo_grpo.models.sd3:build_tiny",
               "flux-tiny": "ddpo_grpo.models.flux:build_tiny", "wan-tiny": "ddpo_grpo.models.wan:build_tiny",
               # wan-tiny plus recammaster.ckpt: train with pretrained.recam_checkpoint="recammaster.ckpt"
               "recam-tiny": "ddpo_grpo.models.recam:build_tiny"}
TINY_CACHE = os.environ.get("DDPO_GRPO_TINY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ddpo_grpo",
                                                                      "tiny_builds")
# The bundled models: in a source checkout (editable install or none) the top-level assets/ beside ddpo_grpo/;
# in a wheel / non-editable install ddpo_grpo/assets/, where setup.py maps assets/ as package data. A checkout is
# recognised by its setup.py, so an installed copy never reads a checkout's folder (nor a checkout a stale one).
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECKOUT = os.path.dirname(_PKG_DIR)
ASSETS_DIR = (os.path.join(_CHECKOUT, "assets") if os.path.isfile(os.path.join(_CHECKOUT, "setup.py"))
              else os.path.join(_PKG_DIR, "assets"))


class ModelPathError(ValueError):
    """A model path that does not exist or is not a diffusers-format folder."""


def resolve_model_path(path_or_name: str) -> str:
    """A bundled model name ("tiny-t2i") or a local folder -> an existing folder path."""
    if path_or_name in BUNDLED:
        path = os.path.join(ASSETS_DIR, BUNDLED[path_or_name])
    elif path_or_name in TINY_BUILDS:
        path = tiny_build(path_or_name)
    else:
        path = path_or_name
    if not os.path.isdir(path):
        raise ModelPathError(
            f"model path {path_or_name!r} is not a folder; give a local diffusers-format folder "
            f"or one of the bundled models {sorted(BUNDLED)} or built ones {sorted(BUILT) + sorted(TINY_BUILDS)} "
            "(no downloads are made)"
        )
    has_denoiser = os.path.isfile(os.path.join(path, "model_index.json")) or os.path.isdir(os.path.join(path, "unet"))
    if not has_denoiser or not os.path.isdir(os.path.join(path, "scheduler")):
        raise ModelPathError(
            f"model path {path!r} has no model_index.json (or unet/) and scheduler/; expected a diffusers-format "
            "folder as written by save_pretrained (model_index.json, scheduler/ and the pipeline's components)"
        )
    return path


def tiny_build(name: str) -> str:
    """The folder of a TINY_BUILDS model, built on first use (written beside and renamed: never half a folder) and
    rebuilt when its builder's source changed (the source's hash is kept in the folder)."""
    import hashlib
    import importlib
    import shutil

    module, fn = TINY_BUILDS[name].split(":")
    with open(importlib.import_module(module).__file__, "rb") as f:
        stamp = hashlib.sha1(f.read()).hexdigest()
    path = os.path.join(TINY_CACHE, name)

    def done(folder):
        try:
            with open(os.path.join(folder, BUILD_STAMP)) as fh:
                return fh.read().strip() == stamp and os.path.isfile(os.path.join(folder, "model_index.json"))
        except OSError:
            return False

    if not done(path):
        tmp = f"{path}.tmp-{os.getpid()}"  # several processes may build at once: each its own, the first rename wins
        shutil.rmtree(tmp, ignore_errors=True)
        getattr(importlib.import_module(module), fn)(tmp)
        with open(os.path.join(tmp, BUILD_STAMP), "w") as fh:
            fh.write(stamp)
        os.makedirs(TINY_CACHE, exist_ok=True)
        if os.path.isdir(path) and not done(path):
            shutil.rmtree(path, ignore_errors=True)  # an older build, or an incomplete folder
        try:
            os.replace(tmp, path)
        except OSError:
            if not done(path):
                raise
        shutil.rmtree(tmp, ignore_errors=True)
    return path


BUILD_STAMP = "build_stamp.txt"  # in a tiny build's folder: the sha1 of the builder module it was made by


def model_adapter(path_or_name: str, recam_checkpoint: str = ""):
    """The architecture adapter (models/base.py) of a bundled, built or folder model; ConfigError for a pipeline
    class no adapter loads. With a ReCamMaster checkpoint (pretrained.recam_checkpoint) the folder must be a
    WanPipeline and the adapter is models.recam's."""
    if recam_checkpoint:
        from .wan import WanAdapter

        if path_or_name in BUILT or not isinstance(adapter_for(resolve_model_path(path_or_name)), WanAdapter):
            raise ConfigError(f"pretrained.recam_checkpoint goes with a Wan 2.1 folder (WanPipeline); "
                              f"{path_or_name!r} is not one")
        from .recam import ADAPTER as RECAM

        return RECAM
    if path_or_name in BUILT:
        import importlib

        return importlib.import_module(BUILDERS[path_or_name].split(":")[0]).ADAPTER
    return adapter_for(resolve_model_path(path_or_name))


def recam_checkpoint_path(config) -> str:
    """pretrained.recam_checkpoint as a path: a file, or a file inside the model folder (a bundled model's own)."""
    ckpt = str(config.pretrained.get("recam_checkpoint", "") or "")
    if ckpt and not os.path.isfile(ckpt) and not os.path.isabs(ckpt):
        try:
            inside = os.path.join(resolve_model_path(config.pretrained.model), ckpt)
        except ModelPathError:
            return ckpt
        return inside if os.path.isfile(inside) else ckpt
    return ckpt


def check_recam_checkpoint(config) -> None:
    """A ReCamMaster checkpoint that cannot be read, has no camera layers or does not fit the Wan folder's
    transformer is one ConfigError line here, before anything heavy loads. Here rather than in models/recam.py:
    it resolves the run's model as model_adapter does, and models/recam.py importing this package while
    model_adapter imports models/recam.py was an import circle."""
    ckpt = recam_checkpoint_path(config)
    if not ckpt:
        return
    from diffusers import WanTransformer3DModel

    from .recam import RecamAdapter, read_checkpoint

    model_adapter(config.pretrained.model, ckpt)  # a Wan folder, or one line
    cfg = WanTransformer3DModel.load_config(resolve_model_path(config.pretrained.model), subfolder="transformer",
                                            local_files_only=True)
    RecamAdapter.check_checkpoint(read_checkpoint(ckpt, lazy=True), cfg, ckpt)


def build_model(name: str, torch_dtype: torch.dtype = torch.float32, device: str = "cpu", resolution: int = 0,
                num_frames: int = 0, lora: bool = False) -> LoadedPipeline:
    """A BUILT model through its BUILDERS function, each module in component_dtype's choice for a run computing in
    `torch_dtype` (the denoiser in float32, or torch_dtype for a LoRA run's frozen base; frozen parts in torch_dtype),
    as a folder loads; resolution / num_frames 0: the builder's defaults. A GPU_ONLY model on a CPU is one ConfigError
    line."""
    import importlib

    from .base import component_dtype

    if name in GPU_ONLY and torch.device(device).type == "cpu":
        raise ConfigError(f"{name} is a real-shape build (SDXL / SD3.5 / FLUX / Wan sizes: billions of parameters) "
                          "and runs on a GPU; on a CPU use its tiny build (sdxl-tiny, sd3-tiny, flux-tiny, wan-tiny) "
                          "or sd15-random at pretrained.resolution=64")
    module, fn = BUILDERS[name].split(":")
    kw = {k: v for k, v in (("resolution", resolution), ("num_frames", num_frames)) if v}
    denoiser_dtype = component_dtype("denoiser", torch_dtype, lora=lora)
    return getattr(importlib.import_module(module), fn)(torch_dtype=torch_dtype, device=device,
                                                        denoiser_dtype=denoiser_dtype, **kw)


def load_pipeline(path_or_name: str, torch_dtype: torch.dtype = torch.float32, device: str = "cpu",
                  resolution: int = 0, num_frames: int = 0, recam_checkpoint: str = "", lora: bool = False
                  ) -> LoadedPipeline:
    """Load a model's components from a local folder, never the hub, through its architecture's adapter (chosen by
    model_index.json's `_class_name`); or build a BUILT model ("sd15-random", ...: build_model) at `resolution`
    pixels (0: native). torch_dtype: the run's compute dtype (base.run_dtype); components load in base.component_dtype's
    choice for it, folders and built models alike; `lora`: the run trains LoRA adapters, so the denoiser is a frozen
    base and loads in torch_dtype (component_dtype).

    The scheduler class decides the sampler family (core.families.family_of_scheduler): FlowMatchEulerDiscreteScheduler
    -> "flow", the DDPM-schedule classes (DDIM_SCHEDULER_CLASSES: PNDM, Euler, DPM-Solver, ...) are loaded as a
    DDIMScheduler from their config ("ddim"), as DDPO does for Stable Diffusion checkpoints; any other is one
    ConfigError line. num_frames: frames of a video model's samples (0: its default); refused for image models.
    """
    adapter = model_adapter(path_or_name, recam_checkpoint)
    if num_frames and not getattr(adapter, "video", False):
        raise ConfigError(f"num_frames={num_frames} applies to video models; {path_or_name!r} makes images")
    if path_or_name in BUILT:
        return build_model(path_or_name, torch_dtype, device, resolution, num_frames, lora)
    kw = {"num_frames": num_frames} if num_frames else {}
    if lora:  # passed only when set: an adapter plugin that never trains LoRA need not take it
        kw["lora"] = True
    if recam_checkpoint:
        kw["checkpoint"] = recam_checkpoint
    return adapter.load(resolve_model_path(path_or_name), torch_dtype=torch_dtype, device=device,
                        resolution=resolution, **kw)


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

"""One section per model family (SD 1.5, SD3, SDXL, FLUX, Wan): its tiny random build on this CPU and the config
for a user's own pipeline folder."""
from .blocks import base, _batches, _family_full_size, _family_tiny, _flow_grpo_sde


# ---- SD 1.5
def sd15_random_bench():
    """Speed and memory at Stable Diffusion 1.5's scale without a download: the SD 1.5-shaped pipeline with random
    weights (`sd15-random`: 860 M-parameter UNet, SD's text encoder and VAE, DDIM), 512x512 images, DDPO's SD
    recipe (LoRA rank 8, guidance 5, eta 1, clip 1e-4) and the cheap JPEG reward. bf16 autocast for a GPU (the
    log-prob math stays fp32); on CPU give --config.mixed_precision=no --config.pretrained.resolution=64.
    What it learns means nothing; scripts/bench_gpu.py times it."""
    config = base.get_config()
    config.pretrained.model = "sd15-random"
    config.pretrained.resolution = 512
    config.mixed_precision = "bf16"
    config.use_lora = True
    config.lora_rank = 8
    config.num_epochs = 3  # the first is a warm-up
    config.save_freq = 0
    config.eval_freq = 0
    config.sample.num_steps = 20
    config.sample.eta = 1.0
    config.sample.guidance_scale = 5.0
    _batches(config, 8, 2, 4, 8)
    config.train.learning_rate = 3e-4
    config.train.clip_range = 1e-4
    config.train.min_step_std = 0.0  # every step trained, as DDPO does with SD
    config.reward.fns = {"jpeg_compressibility": 1.0}
    config.logging.num_images = 4
    return config


# ---- SD3
def sd3_tiny():
    """Stable Diffusion 3 on this CPU: the tiny random SD3 build (`sd3-tiny`: StableDiffusion3Pipeline's own classes
    at test size, 32x32 px) trained with Flow-GRPO's SDE, classifier-free guidance and the cheap JPEG reward (its
    random weights draw noise, which the toy-world verifier scores 0 throughout). Checks the SD3 path end to end."""
    config = _flow_grpo_sde(_family_tiny(base.get_config(), "sd3-tiny"), num_steps=6)
    config.eval.num_samples = 16
    config.sample.guidance_scale = 4.5
    _batches(config, 8, 2, 4, 8)  # 16 samples per epoch = 4 conditions x 4 copies
    config.logging.num_images = 8
    return config


def sd3():
    """Stable Diffusion 3 / 3.5 for a user's StableDiffusion3Pipeline folder (e.g. stable-diffusion-3.5-medium saved
    with save_pretrained):
        accelerate launch scripts/train.py --config config/grpo.py:sd3 --config.pretrained.model=/path/to/sd3.5
    Flow-GRPO's SD3.5 settings: 512 px (--config.pretrained.resolution=1024 for the native size; any multiple of
    16), 10 SDE steps at noise level 0.7, CFG 4.5 with the empty prompt's condition, LoRA rank 32 on the joint
    blocks' attention projections, KL 0.04 to the start model, bf16, gradient checkpointing. FSDP2
    (config/accelerate/fsdp2.yaml) wraps JointTransformerBlock (models/sd3.py fsdp_block_classes). Rewards:
    jpeg_compressibility as a placeholder; give yours with --config.reward.fns."""
    config = _flow_grpo_sde(_family_full_size(base.get_config()), num_steps=10)  # --config.pretrained.model=PATH
    config.pretrained.resolution = 512  # SD3's transformer samples any multiple of 16 px; 1024 is its native size
    config.eval.num_samples = 64
    config.eval.batch_size = 8
    config.sample.guidance_scale = 4.5
    _batches(config, 8, 4, 8, 4, accumulation=2)  # per process: 32 samples = 4 prompts x 8 copies
    config.train.learning_rate = 3e-4
    config.train.beta = 0.04
    config.logging.num_images = 8
    return config


# ---- SDXL
def sdxl_tiny():
    """SDXL (StableDiffusionXLPipeline: two CLIP text encoders, pooled embeds + time ids as added_cond_kwargs, DDIM)
    on this CPU: the `sdxl-tiny` random build (32 x 32 px, built on first use), toy-world prompts, the JPEG
    reward (a random model draws no toy-world shapes), guidance 5 with the zero empty-prompt negative, LoRA rank 4
    (full fine-tuning: --config.use_lora=False, with a smaller --config.train.learning_rate, e.g. 1e-4)."""
    config = _family_tiny(base.get_config(), "sdxl-tiny", num_epochs=4, every=2)
    config.eval.num_samples = 8
    config.eval.batch_size = 8
    config.sample.eta = 1.0
    config.sample.guidance_scale = 5.0
    _batches(config, 4, 2, 4, 4)
    config.train.min_step_std = 0.0
    config.logging.num_images = 4
    return config


def sdxl():
    """SDXL for a user's checkpoint folder (e.g. stable-diffusion-xl-base-1.0 saved with save_pretrained):
        accelerate launch scripts/train.py --config config/grpo.py:sdxl --config.pretrained.model=/path/to/sdxl
    1024 px (the model's native size; --config.pretrained.resolution=512 etc. for any multiple of 32), DDIM with
    eta 1 over 30 steps (the folder's Euler config read as DDIM), guidance 6 with SDXL's zero empty-prompt negative,
    LoRA rank 32 on the attention projections, bf16, gradient checkpointing. FSDP2 (config/accelerate/fsdp2.yaml)
    wraps ResnetBlock2D and BasicTransformerBlock, the UNet's block classes (models/sdxl.py fsdp_block_classes).
    Prompts: --config.data.name=prompt_file --config.data.path=FILE; rewards: jpeg_compressibility as a placeholder,
    give yours with --config.reward.fns."""
    config = _family_full_size(base.get_config())  # every DDIM step trained, as DDPO does with SD
    config.eval.num_samples = 32
    config.eval.batch_size = 4
    config.sample.num_steps = 30
    config.sample.eta = 1.0
    config.sample.guidance_scale = 6.0
    _batches(config, 4, 4, 8, 2, accumulation=4)  # per process: 16 samples = 2 prompts x 8 copies
    config.train.learning_rate = 1e-4
    config.logging.num_images = 8
    return config


# ---- FLUX
def flux_tiny():
    """FLUX.1 on this CPU: the tiny random FLUX build (`flux-tiny`: FluxPipeline's own classes at test size, a
    dev-like guidance embedding, 32x32 px) trained with Flow-GRPO's SDE, the embedded guidance 3.5 (no CFG: FLUX.1-dev
    is guidance-distilled) and the cheap JPEG reward (its random weights draw noise, which the toy-world verifier
    scores 0 throughout). Checks the FLUX path end to end."""
    config = _flow_grpo_sde(_family_tiny(base.get_config(), "flux-tiny"), num_steps=6)
    config.pretrained.resolution = 32
    config.pretrained.embedded_guidance = 3.5
    config.eval.num_samples = 16
    config.sample.guidance_scale = 1.0
    _batches(config, 8, 2, 4, 8)  # 16 samples per epoch = 4 conditions x 4 copies
    config.train.min_step_std = 0.0
    config.logging.num_images = 8
    return config


def flux():
    """FLUX.1-dev (a FluxPipeline folder, given with --config.pretrained.model=PATH) at Flow-GRPO's FLUX settings:
    512 px (--config.pretrained.resolution=1024 for FLUX's native size; any multiple of 16), 16 SDE steps (noise
    level 0.7) with FluxPipeline's resolution-shifted schedule, embedded guidance 3.5 and no CFG (guidance-distilled),
    LoRA rank 32 on both streams' attention and the double blocks' feed-forwards, bf16, gradient checkpointing.
    FLUX.1-schnell: --config.sample.num_steps=4 (it has no guidance embedding; embedded_guidance is ignored).
    FSDP2 (config/accelerate/fsdp2.yaml) wraps FluxTransformerBlock and FluxSingleTransformerBlock.
    Rewards: jpeg_compressibility as a placeholder; give yours with --config.reward.fns."""
    config = _flow_grpo_sde(_family_full_size(base.get_config()), num_steps=16)  # --config.pretrained.model=PATH
    config.pretrained.resolution = 512
    config.pretrained.embedded_guidance = 3.5
    config.eval.num_samples = 64
    config.eval.batch_size = 8
    config.sample.guidance_scale = 1.0  # true CFG off: FLUX.1-dev's guidance is the embedded one above
    _batches(config, 8, 4, 8, 4, accumulation=2)  # per process: 32 samples = 4 prompts x 8 copies
    config.train.learning_rate = 1e-4
    config.logging.num_images = 8
    return config


# ---- Wan
def wan_tiny():
    """Wan 2.1 text-to-video on this CPU: the tiny random Wan build (`wan-tiny`: WanPipeline's own classes at test size,
    UMT5, the 3-D VAE with per-channel latent statistics, the released UniPC flow_shift=3 scheduler read as flow
    matching), 32x32 px x 5 frames, Flow-GRPO's SDE, CFG 5 against the empty prompt, and the JPEG reward scored on
    every frame and averaged per sample (rewards package docstring; its random weights draw noise, which the
    toy-world verifier scores 0 throughout). Checks the video path end to end."""
    config = _flow_grpo_sde(_family_tiny(base.get_config(), "wan-tiny"), num_steps=6)
    config.pretrained.resolution = 32
    config.pretrained.num_frames = 5  # 2 latent frames
    config.eval.num_samples = 8
    config.eval.batch_size = 8
    config.sample.guidance_scale = 5.0
    _batches(config, 4, 2, 4, 4)  # 8 samples per epoch = 2 conditions x 4 copies
    config.train.min_step_std = 0.0
    config.logging.num_images = 4
    return config


def wan():
    """Wan 2.1 text-to-video for a user's WanPipeline folder (e.g. Wan2.1-T2V-1.3B-Diffusers):
        accelerate launch scripts/train.py --config config/grpo.py:wan --config.pretrained.model=/path/to/wan
    480p (480x832, the model's default; --config.pretrained.resolution=480 for 480x480), 33 frames
    (--config.pretrained.num_frames=81 for Wan's full 5 s clips), 20 SDE steps (noise level 0.7) on the folder's
    flow_shift (3.0 at 480p), CFG 5 against the empty prompt, LoRA rank 32 on the attention and FFN projections, bf16,
    gradient checkpointing, a 4-step SDE window per epoch (ODE elsewhere) so that each sample trains on 4 forwards
    instead of 20. FSDP2 (config/accelerate/fsdp2.yaml) wraps WanTransformerBlock. Rewards: jpeg_compressibility on
    every frame as a placeholder; give an image reward (scored per frame) or a @clip_reward with --config.reward.fns."""
    config = _flow_grpo_sde(_family_full_size(base.get_config()), num_steps=20)  # every step of the window trained
    config.pretrained.num_frames = 33
    config.eval.num_samples = 16
    config.eval.batch_size = 2
    config.sample.sde_window_size = 4
    config.sample.sde_window_mode = "random"
    config.sample.guidance_scale = 5.0
    config.sample.shared_init_noise = True  # a group's spread comes from the policy's steps, not from x_T
    _batches(config, 2, 4, 4, 1, accumulation=4)  # per process: 8 clips = 2 prompts x 4 copies
    config.train.learning_rate = 1e-4
    config.logging.num_images = 4
    return config

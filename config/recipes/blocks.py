"""The blocks several named configs share (config/grpo.py is the index): each takes a config and sets one
aspect of it; `base` is config/base.py, where every knob is defined and commented."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("ddpo_grpo_base_config",
                                               os.path.join(os.path.dirname(os.path.dirname(__file__)), "base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def _batches(config, batch_size, num_batches_per_epoch, k, train_batch_size, accumulation=None):
    """The run's geometry, per process: batch_size x num_batches_per_epoch samples per epoch, k copies of each
    condition; train_batch_size samples per micro-batch, `accumulation` micro-batches per optimizer step (None:
    as the config built on has it)."""
    config.sample.batch_size = batch_size
    config.sample.num_batches_per_epoch = num_batches_per_epoch
    config.sample.k = k
    config.train.batch_size = train_batch_size
    if accumulation is not None:
        config.train.gradient_accumulation_steps = accumulation
    return config


def _flow_grpo_sde(config, num_steps):
    """Flow-GRPO's SDE sampling at noise level 0.7 on every one of `num_steps` steps."""
    config.sample.num_steps = num_steps
    config.sample.noise_level = 0.7
    config.sample.sde_type = "sde"
    return config


def _family_tiny(config, model, num_epochs=10, every=5):
    """A model family's tiny random build on this CPU (checks the family's path end to end): LoRA rank 4 in float32,
    6 sampling steps, lr 1e-3 with clip 1e-2, and the cheap JPEG reward (random weights draw noise, which the
    toy-world verifier scores 0 throughout); a checkpoint and an eval every `every` epochs."""
    config.pretrained.model = model
    config.mixed_precision = "no"
    config.use_lora = True
    config.lora_rank = 4
    config.num_epochs = num_epochs
    config.save_freq = every
    config.eval_freq = every
    config.eval.pass_at_k = 0  # no "fully right" for the JPEG reward
    config.sample.num_steps = 6
    config.train.learning_rate = 1e-3
    config.train.clip_range = 1e-2
    config.reward.fns = {"jpeg_compressibility": 1.0}
    return config


def _family_full_size(config):
    """A model family at full size, for a user's pipeline folder (--config.pretrained.model=PATH): LoRA rank 32,
    bf16, gradient checkpointing, 100 epochs with a checkpoint and an eval every 10, DDPO's clip 1e-4, every
    sampled step trained, encoders off the device while training, jpeg_compressibility as a placeholder reward."""
    config.pretrained.model = ""  # a local pipeline folder: --config.pretrained.model=PATH
    config.mixed_precision = "bf16"
    config.gradient_checkpointing = True
    config.use_lora = True
    config.lora_rank = 32
    config.num_epochs = 100
    config.save_freq = 10
    config.eval_freq = 10
    config.eval.pass_at_k = 0  # no "fully right" for the JPEG reward
    config.train.clip_range = 1e-4
    # No reference forward: the denoiser's memory goes to the policy (FLUX's 12 B transformer); sd3 adds a KL.
    config.train.beta = 0.0
    config.train.min_step_std = 0.0  # every sampled step trained
    config.reward.fns = {"jpeg_compressibility": 1.0}  # a placeholder: give yours with --config.reward.fns
    config.data.cache_embeddings = True  # encoders off the device while training (config/base.py)
    return config


def _nft_demo(config):
    """The DiffusionNFT recipe of tiny_colour_nft (its docstring says why): lr 3e-4, re-noised at u >= 0.6 only,
    3 noise levels per sample, sampling policy soft-updated by EMA."""
    config.train.objective = "nft"
    config.train.learning_rate = 3e-4
    config.train.forward_noise_min = 0.6  # u >= 0.6: the first 4 of 10 DDIM steps, where step_credit finds every flip
    config.train.timestep_fraction = 0.5  # 3 noise levels per sample (of the 6 trainable columns)
    config.train.nft_old_decay = 0.5  # theta_old <- 0.5 theta_old + 0.5 theta after each epoch
    return config


def _one_step_per_epoch(config, num_batches=8, learning_rate=1e-4):
    """One optimizer step per epoch (tiny_colour_grpo's docstring says why): num_batches x 32 samples (k = 8) in ONE
    optimizer step at `learning_rate` after a 3-step warmup, a KL to the frozen start model, pass@8 on the eval."""
    _batches(config, 32, num_batches, 8, 32, accumulation=num_batches)  # default 256 = 32 conditions x 8, one step
    config.train.learning_rate = learning_rate
    config.train.lr_warmup_steps = 3
    config.train.beta = 0.04  # KL to the start model (reference_model_mixup_alpha = 1: frozen), at the trained steps
    config.eval.pass_at_k = 8  # 32 held-out conditions x 8 fixed-seed samples of the trained (eta 1) sampler
    return config


def _branch_at_step0(config):
    """One 8-leaf tree per condition (k = 8), split at step 0 (core/branching.py)."""
    config.sample.branch_steps = (0,)
    config.sample.branches = 8  # k = 8: one tree per condition
    return config

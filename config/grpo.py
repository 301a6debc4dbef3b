"""Named GRPO configs: `--config config/grpo.py:NAME`. Each starts from config/base.py, or from the named config it
varies, and states only what differs; the blocks several recipes share are the `_`-prefixed helpers below (a
function whose name starts with `_` is not a named config)."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("ddpo_grpo_base_config", os.path.join(os.path.dirname(__file__), "base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


# ---- Shared blocks
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


def _one_step_per_epoch(config):
    """tiny_colour_grpo's geometry (its docstring says why): 256 samples per epoch in ONE optimizer step at lr 1e-4
    after a 3-step warmup, a KL to the frozen start model, pass@8 on the eval."""
    _batches(config, 32, 8, 8, 32, accumulation=8)  # 256 samples per epoch = 32 conditions x 8 copies, one step
    config.train.learning_rate = 1e-4
    config.train.lr_warmup_steps = 3
    config.train.beta = 0.04  # KL to the start model (reference_model_mixup_alpha = 1: frozen), at the trained steps
    config.eval.pass_at_k = 8  # 32 held-out conditions x 8 fixed-seed samples of the trained (eta 1) sampler
    return config


def _branch_at_step0(config):
    """One 8-leaf tree per condition (k = 8), split at step 0 (core/branching.py)."""
    config.sample.branch_steps = (0,)
    config.sample.branches = 8  # k = 8: one tree per condition
    return config


# ---- The toy-world task on the bundled text-to-image models (CPU)
def tiny():
    """CPU demo on the bundled text-to-image model with the verifiable toy-world reward."""
    config = base.get_config()
    config.run_name = ""
    config.num_epochs = 36
    config.save_freq = 12
    config.eval_freq = 12
    # 4 deterministic samples of each of the 64 held-out conditions: with 64 the eval's standard error was ~0.06,
    # larger than the changes it was read for (docs/efficacy.md).
    config.eval.num_samples = 256
    config.sample.num_steps = 10
    _batches(config, 16, 4, 8, 16)  # 64 samples per epoch = 8 conditions x 8 copies
    # Train the high-noise steps only (std >= 0.3: the first 6 of 10), where layout and colours are decided;
    # later steps refine texture and mostly add gradient noise for this reward.
    config.train.min_step_std = 0.3
    config.train.timestep_fraction = 1.0
    config.train.learning_rate = 3e-5
    # Full fine-tuning of a small pixel model moves a step's mean logprob by ~1e-3 per update: DDPO's 1e-4
    # (tuned for SD + LoRA) would clip almost every sample after the first step.
    config.train.clip_range = 1e-2
    config.train.beta = 0.0
    config.tracker.std_mode = "group"
    config.reward.fns = {"toyworld": 1.0}
    return config


# ---- The colour task: a systematic error to correct (docs/efficacy.md)
def tiny_colour():
    """An efficacy task with a known, systematic error: `tiny-t2i-noisy` was trained on captions whose colour word
    is wrong half the time (as web captions are wrong about what they show), so it often draws another colour;
    single-object conditions, 40 trained and 32 held out (held-out strict 0.32, pass@4 0.88 at the start). The
    right correction is the same for every condition (docs/efficacy.md)."""
    config = tiny()
    config.pretrained.model = "tiny-t2i-noisy"
    config.data.objects = "single"
    return config


def tiny_colour_nft():
    """The CPU demo: tiny_colour trained by DiffusionNFT (GRPO's group-relative advantages, the forward-process
    objective) at lr 3e-4. The per-step log-prob gradient cannot reach this error: the colour is decided by x_T and
    the first denoising steps (scripts/step_credit.py: no step after the 4th of 10 flips an outcome), so the sampled
    images are re-noised only at those noise levels, 3 per sample; and the sampling policy follows the trained one
    by EMA (DiffusionNFT's soft update), so one bad update is not sampled from at once. Held-out strict accuracy
    0.32 -> 0.78 / 0.75 / 0.78 at epoch 36 on seeds 1 / 2 / 42, each run's last eval its best (docs/efficacy.md)."""
    return _nft_demo(tiny_colour())


def tiny_hack():
    """Reward hacking on the CPU (docs/hacking.md): tiny_colour_nft's recipe trained on a hackable proxy, `colour_share`
    (the share of the object's box drawn in the prompt's colour: right at first, the right colour in the right place;
    then a filled box beats any shape), with the toy-world verifier as the held-out gold reward (reward.gold), never
    trained on. The guard warns (train.hacking_guard) and keeps going, so the run shows what follows the alarm;
    best_gold_export/ holds the eval with the best gold. Evals every 3 epochs on 64 held-out samples."""
    config = tiny_colour_nft()
    config.reward.fns = {"colour_share": 1.0}
    config.reward.gold = {"toyworld": 1.0}
    config.reward.gold_train_samples = 16
    config.train.hacking_guard = "warn"
    config.num_epochs = 72  # gold peaks at epochs 15-24 and falls by 72 (docs/hacking.md: seeds 42 / 1 / 2)
    config.eval_freq = 3
    config.save_freq = 3
    config.eval.num_samples = 64  # 32 held-out conditions x 2
    config.eval.pass_at_k = 0  # the guard reads the deterministic eval; pass@k would double its cost
    config.logging.image_freq = 3
    return config


def tiny_colour_grpo():
    """tiny_colour trained by the clipped-ratio GRPO loss, in the shape the policy gradient needs here: only the
    two noisiest steps are trained (std >= 0.6; scripts/step_credit.py: the colour flips at x_T and step 0, never
    after step 3), and each epoch's 256 samples (32 conditions x k = 8) make ONE optimizer step at lr 1e-4. With
    64 samples in 4 steps the same lr broke the model within 2 epochs: a small batch's policy gradient is mostly
    noise, Adam makes full-size steps of it, and the mean-over-dims ratio (0.9998, clipfrac 0) cannot see it
    (train/policy_shift_kl can). A KL to the frozen start model (beta 0.04, Flow-GRPO's value for the same
    mean-over-dims KL) holds what the reward does not score: without it the denoising of the background
    random-walks and the deterministic (eta = 0) sampler, which training never uses, can break (seed 2: 0.07).
    Held-out strict at epoch 36 (another seed set, 256 samples; docs/efficacy.md), seeds 1 / 2 / 42: eta 0
    0.47 / 0.59 / 0.61 (without the KL 0.57 / 0.07 / 0.47), the policy's eta-1 sampler 0.58 / 0.70 / 0.70
    (0.65 / 0.63 / 0.55); start 0.31 / 0.37. eval.pass_at_k = 8 reports the policy's sampler on 256 samples too."""
    config = _one_step_per_epoch(tiny_colour())
    config.train.min_step_std = 0.6  # steps 0-1 of 10
    return config


def tiny_colour_branch():
    """tiny_colour_grpo on branched trajectories (core/branching.py): per condition one tree, x_T shared, 8 children
    split at step 0 (where scripts/step_credit.py finds the colour decided after x_T) and finished deterministically
    (DDIM eta 0, the eval's sampler). The 8 siblings are the group, so the advantage is what step 0's noise did, not
    x_T's luck; only step 0 is stored and trained. Same geometry as tiny_colour_grpo (256 samples, one optimizer
    step per epoch, lr 1e-4, KL to the start model). Held-out strict at epoch 36: 0.609 / 0.555 / 0.613 (seeds
    42 / 1 / 2), against 0.523 without branching and 0.582 with per-step x0 rewards at one commit (seed 42), at
    12.1 instead of 14.1 NFEs per sample; short of the NFT demo's 0.78 at 2,304 samples. At 64 samples in 4 steps
    per epoch it rose on one seed of three and fell on two (docs/efficacy.md, sessions 11-12)."""
    return _branch_at_step0(tiny_colour_grpo())  # 32 conditions per epoch


def tiny_branch():
    """The mixed task (`tiny`) on branched trajectories: tiny_colour_grpo's geometry (256 samples = 32 conditions x
    one 8-leaf tree, one optimizer step per epoch at lr 1e-4, KL to the start model) with the split at step 0.
    Seed 42, 192 epochs: held-out strict 0.457 -> a plateau of 0.50-0.54 (best 0.539); singles rise (0.805 -> 0.953),
    pairs do not (0.117 -> 0.094) although their sibling groups have spread (docs/efficacy.md, session 12)."""
    return _branch_at_step0(_one_step_per_epoch(tiny()))


# ---- Other recipes on `tiny` (baselines, objectives, rewards)
def ddpo():
    """DDPO's original recipe for side-by-side comparison: per-prompt history buffer, no KL, scalar advantages."""
    config = tiny()
    config.tracker.buffer_size = 32
    config.tracker.min_count = 16
    config.train.beta = 0.0
    config.reward.per_step = "none"
    return config


def tiny_per_step():
    """tiny with per-timestep rewards: each step scored on its predicted x̂0 (B, T)."""
    config = tiny()
    config.reward.per_step = "x0"
    return config


def tiny_raft():
    """tiny's sampler, rewards and advantages, trained by best-of-N supervision (RAFT): the plain denoising loss on
    each group's best sample. The baseline a policy-gradient recipe has to beat (docs/efficacy.md)."""
    config = tiny()
    config.train.objective = "raft"
    return config


def tiny_nft():
    """tiny trained by DiffusionNFT's forward-process objective: advantage-weighted denoising on every sample."""
    config = tiny()
    config.train.objective = "nft"
    return config


def tiny_kl():
    """tiny with a KL to an EMA-mixed reference (TR-DPO-style sync)."""
    config = tiny()
    config.train.beta = 0.01
    config.train.reference_model_mixup_alpha = 0.9
    config.train.reference_update_freq = 4
    return config


def compressibility():
    config = tiny()
    config.reward.fns = {"jpeg_compressibility": 1.0}
    return config


def incompressibility():
    config = tiny()
    config.reward.fns = {"jpeg_incompressibility": 1.0}
    return config


def aesthetic():
    """LAION aesthetic predictor; point the paths at local copies (nothing is downloaded)."""
    config = tiny()
    config.reward.fns = {"aesthetic": 1.0}
    config.reward.kwargs = {"aesthetic": {"clip_model_path": "", "mlp_path": ""}}
    return config


# ---- The bundled flow-matching model
def tiny_flow():
    """The bundled flow-matching model, SDE sampling (Flow-GRPO's SDE) on every step; as in `tiny`, only the steps
    with std >= 0.3 are trained (the first 4 of 10)."""
    config = tiny()
    config.pretrained.model = "tiny-flow"
    _flow_grpo_sde(config, num_steps=10)
    # What made the toy reward rise here (each measured, see the README): a fixed set of 32 conditions that recur
    # (as DDPO's prompt sets do), evaluated on those conditions with fresh seeds; the k copies of a condition
    # starting from one x_T; and a warmup, without which Adam's first steps knock the reward down.
    config.data.num_conditions = 32
    config.eval.split = "train"
    config.sample.shared_init_noise = True
    config.train.lr_warmup_steps = 24
    return config


def tiny_flow_window():
    """tiny_flow with an SDE window: 3 stochastic steps (the highest-noise ones), ODE elsewhere; only the window
    is stored and trained (MixGRPO / Flow-GRPO-Fast idea)."""
    config = tiny_flow()
    config.sample.sde_window_size = 3
    config.sample.sde_window_mode = "fixed"
    config.sample.sde_window_start = 0
    return config


# ---- Camera control (ReCamMaster and the 2-D camera world)
def _recam_seed_report(config):
    """The seed report's recam geometry, bf16: 8 processes x batch 2 x 4 batches = 64 samples = k 4 x 16 conditions,
    18 steps, per-timestep `broadcast` rewards from cam_score + unifiedscore, an EMA reference (KL 0.01)."""
    config.mixed_precision = "bf16"
    _batches(config, 2, 4, 4, 2)
    config.sample.num_steps = 18
    config.train.beta = 0.01
    config.train.reference_model_mixup_alpha = 0.9
    config.train.reference_update_freq = 8
    config.reward.fns = {"cam_score": 1.0, "unifiedscore": 1.0}
    config.reward.kwargs = {"unifiedscore": {"base_url": "http://127.0.0.1:30000/v1"}}
    config.reward.per_step = "broadcast"
    config.eval.pass_at_k = 0  # cam_score has no "fully right": pass@k would only measure reaching 1.0
    return config


def recam():
    """The user's job: GRPO on a ReCamMaster model (Wan 2.1 T2V 1.3B + camera layers) at the seed report's geometry,
    8 processes x batch 2 x 4 batches = 64 samples = k 4 x 16 dataset-index conditions, 18 steps, per-timestep `avg`
    rewards from cam_score + unifiedscore, EMA reference, bf16, gradient checkpointing, ReCamMaster's own trainable
    set (camera layers + self-attention) as a full fine-tune (`--config.use_lora=True` for LoRA on the same layers).
    Give your folder and checkpoint:

        --config.pretrained.model=/path/Wan2.1-T2V-1.3B-Diffusers --config.pretrained.recam_checkpoint=/path/step20000.ckpt

    The default model is its random real-shape build (recam-1.3b-random, GPU only), so a dry run checks the geometry
    anywhere. Conditions: the video camera world (data.name recam_video) at 81 frames, 480 px square; a user's own
    dataset plugs in as items with "source_video" (F, 3, H, W) and "cameras" (F', 12) (docs/recam.md)."""
    config = _recam_seed_report(base.get_config())
    config.data.name = "recam_video"
    config.pretrained.model = "recam-1.3b-random"
    config.pretrained.recam_checkpoint = ""
    config.pretrained.resolution = 480
    config.pretrained.num_frames = 81
    config.gradient_checkpointing = True
    config.use_lora = False
    config.sample.guidance_scale = 5.0  # ReCamMaster's CFG; both passes get the source and the camera
    # ReCamMaster's inference: its flow grid at shift 5 and Wan's default negative prompt (docs/recam.md)
    from ddpo_grpo.models.wan import WAN_NEGATIVE_PROMPT

    config.sample.negative_prompt = WAN_NEGATIVE_PROMPT
    config.sample.flow_grid = "recammaster"
    config.sample.flow_shift = 5.0
    config.sample.noise_level = 0.7
    config.train.learning_rate = 1e-5
    config.data.cache_embeddings = True  # encoders off the device while training (config/base.py)
    return config


def _recam_on_cpu(config):
    """What the CPU recam recipes share: 40 epochs of 128 samples (8 conditions x k = 16, one x_T per group), 10 steps,
    one optimizer step per epoch on all of them, cam_score only, lr warmup, evals every 10 epochs."""
    config.mixed_precision = "no"
    config.gradient_checkpointing = False
    config.num_epochs = 40
    config.save_freq = 10
    config.eval_freq = 10
    config.sample.guidance_scale = 1.0
    _batches(config, 8, 16, 16, 8, accumulation=16)  # 128 samples per epoch = 8 conditions x 16 copies, one step
    config.sample.num_steps = 10
    config.sample.shared_init_noise = True  # the k copies start from one x_T: the spread is the policy's own
    config.train.clip_range = 1e-2
    config.train.beta = 0.004
    config.train.lr_warmup_steps = 3  # without warmup one step at lr 3e-5 cut cam_score from 0.42 to 0.27 (docs)
    config.reward.fns = {"cam_score": 1.0}
    config.reward.kwargs = {}
    config.data.cache_embeddings = False  # the measured CPU recipes encode on first use, as they were run
    return config


def recam_video_tiny():
    """recam on this CPU: the bundled ReCamMaster-architecture model `tiny-recam-video` (diffusers' Wan classes + the
    camera layers, pretrained on the video camera world by scripts/pretrain_recam_video.py) with its own
    recammaster.ckpt, 9 frames of 32x32 px; trained on all 512 training conditions (8 new ones per epoch, k = 16) and
    evaluated on the 64 held-out ones x 4 seeds (256 deterministic samples). The update is DiffusionNFT's with GRPO's
    group advantages (the demo's: re-noised at u >= 0.6, soft-updated sampling policy, 4 optimizer steps per epoch):
    the clipped-ratio GRPO loss at the same budget did not raise held-out cam_score here (docs/recam.md)."""
    config = _recam_on_cpu(recam())
    config.pretrained.model = "tiny-recam-video"
    # As measured (docs/recam.md): the bundled model's own scheduler grid, no CFG (so no negative prompt).
    config.sample.flow_grid, config.sample.flow_shift, config.sample.negative_prompt = "scheduler", 0.0, ""
    config.pretrained.recam_checkpoint = "recammaster.ckpt"  # inside the model folder
    config.pretrained.resolution = 32
    config.pretrained.num_frames = 9
    config.data.num_conditions = 0  # all 512 training conditions
    config.eval.split = "eval"  # held-out
    config.eval.num_samples = 256  # 64 held-out conditions x 4 seeds
    config.reward.per_step = "none"
    _nft_demo(config)
    config.train.gradient_accumulation_steps = 4
    config.train.beta = 0.0
    config.train.min_step_std = 0.0
    return config


def recam_video_tiny_grpo():
    """recam_video_tiny (same model, conditions, 40 epochs x 128 samples, held-out eval) trained by the clipped-ratio
    GRPO loss instead of NFT, in the shape issue 47's diagnosis asks for (docs/recam.md, 2026-11-27). Noise and
    training on a window of the 4 noisiest steps only, the flow ODE after it as the eval samples: with noise on all 10
    steps, steps 4-8 make 2/3 of a group's cam_score spread, and the last two carry 80 % of an all-steps gradient
    while their noise decides ~1/4 of it. Ratios re-scored (exactly 1 on-policy). 4 optimizer steps per epoch, with
    the lr adapted to a policy shift of 3e-6 per epoch (train.target_shift_kl): one epoch's gradient is at its noise
    floor, Adam moves every weight by about the lr whatever the signal, and at these noisy steps a KL of 1e-4 is
    already a 14 % change of the velocity the deterministic sampler integrates, at every step alike. A KL to the EMA
    reference. Held-out cam_score 0.486 -> 0.493 / 0.503 / 0.491 at epoch 40 (seeds 42 / 1 / 2), paired on other
    noise seeds +0.010 / +0.020 / +0.008 (NFT: +0.017 / +0.012 / +0.014); at 3e-5 per epoch it fell (0.431, LoRA)."""
    config = recam_video_tiny()
    config.train.objective = "grpo"
    config.train.nft_old_decay = 0.0  # NFT's soft update belongs to the NFT objective
    config.train.forward_noise_min = 0.0
    config.train.timestep_fraction = 1.0  # every step of the window
    config.train.old_logprobs = "rescore"  # the ratio's old log-probs through the training calls: exactly 1 on-policy
    config.sample.sde_window_size = 4  # steps 0-3 (std 0.69, 0.74, 0.54, 0.45) stochastic and trained, ODE after
    config.sample.sde_window_mode = "fixed"
    config.sample.sde_window_start = 0
    config.train.timesteps_per_call = 4  # the window's 4 steps in one call (and in train/policy_shift_kl's rows)
    config.train.gradient_accumulation_steps = 4  # 4 optimizer steps of 32 samples per epoch
    config.train.learning_rate = 2e-5  # where the adaptive rule starts
    config.train.target_shift_kl = 3e-6  # lr / 1.5 above 6e-6, x 1.5 below 1.5e-6 per epoch (3e-5: fell, docs)
    config.train.clip_range = 1e-3  # never reached at this step size (clipfrac 0): the shift target is the trust region
    config.train.beta = 0.004  # KL to the EMA reference (recam's: mix 0.9 every 8 optimizer steps)
    return config


def recam_image():
    """The 2-D image camera world (`tiny-recam`, a pixel UNet whose 9 input channels take the source view and the
    motion planes) at the seed report's geometry: the recipe `recam` had before ReCamMaster; kept because its
    measured recipe (docs/recam.md) is what recam_video_tiny starts from."""
    config = _recam_seed_report(base.get_config())
    config.data.name = "recam"
    config.pretrained.model = "tiny-recam"
    return config


def recam_image_tiny():
    """The recam recipe on the bundled tiny 2-D camera model, on this CPU: cam_score only, per-step rewards, EMA
    reference; conditions are dataset indices (source view + camera motion). Measured: eval cam_score 0.438 -> 0.513
    over 40 epochs (seed 42; 16 min on one core), and a rise for each of 4 seeds (docs/recam.md)."""
    config = _recam_on_cpu(recam_image())
    config.data.num_conditions = 8  # a recurring set, reported on itself (DDPO's way): see docs/recam.md for why
    config.eval.split = "train"
    config.eval.num_samples = 64  # 8 per condition
    # One optimizer step per epoch on all 128 samples, on the 2 noisiest steps (std 0.83, 0.69 of 10) only: the
    # first two steps make most of a group's cam_score spread, and every other trained step, or smaller
    # batches per step, added gradient noise that moved the model faster than the signal did (docs/recam.md).
    config.train.min_step_std = 0.65
    config.train.learning_rate = 3e-5
    return config


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


# ---- The registry
def get_config(name: str = "tiny"):
    # Every function of this file is a named config (an architecture's configs sit after its section heading).
    configs = {n: f for n, f in globals().items()
               if callable(f) and getattr(f, "__module__", None) == __name__ and not n.startswith("_") and n != "get_config"}
    if name not in configs:
        raise ValueError(f"unknown config name {name!r}; choose one of: {', '.join(sorted(configs))}")
    return configs[name]()

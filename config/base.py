"""Every knob of ddpo_grpo, commented. Named configs in config/grpo.py start from this one.

Launch:  accelerate launch scripts/train.py --config config/grpo.py:tiny
Override any field on the command line:  --config.train.learning_rate=1e-4
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    ###### General ######
    config.run_name = ""  # run folder name under logdir; "" -> <config name>_<timestamp>
    config.seed = 42  # everything (sampling noise, condition choice, shuffles) derives from it
    config.logdir = "logs"
    config.num_epochs = 100
    config.save_freq = 20  # epochs between checkpoints (accelerate save_state, atomic); 0 = never
    config.num_checkpoint_limit = 3  # older checkpoints are deleted
    config.eval_freq = 10  # epochs between deterministic evaluations; 0 = never
    # "no" | "fp16" | "bf16" (through accelerate; logprob math stays fp32); "" = as launched (`accelerate launch
    # --mixed_precision`, or the --config_file's setting; "no" without either).
    config.mixed_precision = ""
    config.allow_tf32 = True
    # CPU: flush denormal floats to zero. The policy-gradient loss is ~1e-5, so backward passes carry gradients
    # deep in the denormal range, which x86 CPUs process many times slower (training measured 1.5x its floor).
    config.flush_denormal = True
    config.resume_from = ""  # a checkpoint folder, or a run folder (its newest complete checkpoint)
    config.use_lora = False  # train LoRA adapters (peft) instead of the full denoiser
    config.lora_rank = 8
    # Which modules train: name fragments, e.g. ("cam_encoder", "projector"). A full fine-tune trains the parameters
    # whose names hold one; LoRA puts its adapters on the modules so named (peft's target_modules). Empty: the
    # architecture's own set (ModelAdapter.full_trainable / lora_target_modules).
    config.trainable_modules = ()
    # Denoiser speed switches (scripts/bench_gpu.py measures each; none changes the math beyond rounding):
    config.unet_attention = "sdpa"  # "sdpa" (torch's fused scaled_dot_product_attention) | "math" (plain matmuls)
    # Which SDPA kernels the run may use (core/attention.py; printed at start): "auto" = on CUDA flash, memory-efficient
    # or math, never cuDNN attention (its sm90 backward under torch 2.11, where it became the default: NaN gradients,
    # pytorch#196678, and FLUX's illegal memory access in training, issue 50); on CPU / NPU / MPS torch's own choice.
    # "flash" | "efficient" | "cudnn" (CUDA only) | "math" force one kernel. unet_attention="math" bypasses SDPA in
    # the denoiser altogether (diffusers' plain-matmul processors); attention_backend="math" keeps the SDPA calls on
    # its matmul kernel: either way plain matmuls.
    config.attention_backend = "auto"
    config.channels_last = False  # NHWC memory format for the UNet's convolutions (tensor cores prefer it)
    config.gradient_checkpointing = False  # recompute UNet activations in backward: less memory, more time
    # torch.compile of the UNet: "" = off, "default", "reduce-overhead" (CUDA graphs: for launch-bound small
    # models), "max-autotune". The first epoch pays the compile time.
    config.compile_unet = ""
    config.dry_run = False  # validate the config and batch geometry, print it, exit before loading models
    # Memory per device in GiB for the memory plan's verdict (printed by every run and the dry run; trainer/
    # memory_plan.py): 0 = the GPU's / NPU's own when there is one, else no verdict. An 80 GB H100 reports 79.2.
    config.device_memory_gb = 0.0
    # Seconds a process waits for the others at a collective (and at process-group start) before the job ends with
    # one line (gloo/NCCL/HCCL: init_process_group's timeout). A dead peer on gloo is seen at once; a hung one, or one
    # on NCCL/HCCL, after this. Long enough for the slowest legitimate wait: the main process writing a checkpoint
    # or an export of a large model while the others wait, or ranks loading models at different speeds.
    config.collective_timeout_s = 1800

    ###### Pretrained model ######
    config.pretrained = ml_collections.ConfigDict()
    config.pretrained.model = "tiny-t2i"  # a bundled model name, a built one ("sd15-random") or a local folder
    # Image size in pixels of a model built from configs ("sd15-random": 512 native, a multiple of 64); 0 = its
    # native size. Loaded checkpoints have their own size and refuse it.
    config.pretrained.resolution = 0
    # Guidance-distilled models (FLUX.1-dev): the value fed to the transformer's guidance embedding (FluxPipeline's
    # guidance_scale; sample.guidance_scale, true CFG, stays 1.0 for them). Models without one ignore it.
    config.pretrained.embedded_guidance = 3.5
    # Video models (Wan): frames per sample, 1 + 4k (the VAE compresses time 4x); 0 = the model's default (81).
    # Image models ignore it.
    config.pretrained.num_frames = 0
    # Video models (Wan, ReCamMaster): a non-square size in px; 0 = pretrained.resolution's square (or 480 x 832).
    # Image models sample pretrained.resolution's square and refuse them (one line, exit 2: trainer/run/validate.py).
    config.pretrained.height = 0
    config.pretrained.width = 0
    # ReCamMaster (models/recam.py): its checkpoint (.ckpt / .pt / .safetensors, original Wan keys + camera layers)
    # over the Wan 2.1 folder in pretrained.model; a relative name is looked up inside that folder too. "" = none.
    config.pretrained.recam_checkpoint = ""
    # Park the VAE (and the text encoders) on the host and bring them to the accelerator only for their calls:
    # decode / encode, encode_prompt (ddpo_grpo/core/offload.py). Frees their memory during training for a copy
    # host <-> device per sampling batch; results are unchanged. With data.cache_embeddings the text encoders are
    # parked anyway.
    config.pretrained.offload = False

    ###### Conditions ######
    config.data = ml_collections.ConfigDict()
    config.data.name = "toyworld"  # "toyworld" | "prompt_file" | "recam"
    config.data.path = ""  # prompt file (one prompt per line) for "prompt_file"
    # data.name "multicam": a MultiCamVideo folder (ReCamMaster's training data); "recam_folder": a user's sources
    # (metadata.csv + videos/) x data.cameras (cam_types "1,2", "all", or a (21, 12) .npy / .json). docs/recam.md.
    config.data.root = ""
    config.data.eval_fraction = 0.1  # multicam: the share of scenes held out (a fixed draw)
    config.data.max_bad_fraction = 0.1  # multicam: more missing / damaged files than this stops before training
    config.data.cameras = "all"
    # cam_score's intrinsics for clips whose folder does not give them (multicam: a scene outside an f18/f24/f35/f50
    # focal folder; recam_folder: always): the horizontal field of view in degrees; 0 = none (a run with cam_score
    # then stops before training, naming the scene)
    config.data.fov_deg = 0.0
    config.data.split = "train"  # toyworld split for training conditions; eval uses "eval"
    # toyworld task mix, for the training and the held-out conditions alike: "mixed" (single-object and
    # two-object conditions, half the sampling mass each), "single" or "pair" (only those).
    config.data.objects = "mixed"
    # room3d: the training paths' kinds, comma-separated ("pan,tilt"); "" = all five (pan, tilt, dolly, translate, arc).
    # Each condition draws one of the names uniformly, so a kind named twice is drawn twice as often.
    # The held-out conditions are ReCamMaster's ten presets either way.
    config.data.kinds = ""
    # > 0: train on a fixed seeded subset of this many conditions (DDPO-style small prompt set, so each one
    # recurs across epochs and its group statistics accumulate); 0 = all conditions.
    config.data.num_conditions = 0
    # Encode every prompt of the train and eval sets (and the CFG negative "") once before training, through the
    # model's own encode_prompt, hold them on the host and in <run folder>/embeddings/ (keyed by model and prompts,
    # written atomically: other processes and a resume read it), then park the text encoders off the accelerator
    # (T5-XXL: 9.5 GB in bf16). Bit-identical to encoding on the fly (trainer/run/embeddings.py). False: each prompt is
    # encoded on first use and held on the device, the encoders stay where they loaded.
    config.data.cache_embeddings = False

    ###### Sampling ######
    config.sample = ml_collections.ConfigDict()
    config.sample.num_steps = 20  # denoising steps T
    config.sample.eta = 1.0  # DDIM stochasticity; must be > 0 for a log-probability
    config.sample.noise_level = 0.7  # flow models: SDE noise level (0 = ODE)
    config.sample.sde_type = "sde"  # flow models: "sde" (Flow-GRPO) | "cps" (coefficients-preserving)
    # Flow "sde": b > 1 draws each step's noise constant over b x b blocks of the latents' last two dims and scores
    # the block means only (core/sde_with_logprob.py): the same low-frequency exploration without the high-frequency
    # part of the policy gradient's noise, for a reward that reads the layout (a camera's motion). 1 = the full noise.
    config.sample.noise_pool = 1
    config.sample.sde_window_size = 0  # noise (flow SDE / DDIM eta) and training on a window of w steps only, ODE / eta 0 elsewhere (0 = all steps)
    config.sample.sde_window_mode = "random"  # "fixed" | "random" | "sliding"
    config.sample.sde_window_start = 0  # start of a "fixed" window
    # The k copies of a condition start from the same initial noise x_T (DanceGRPO); their rewards then differ
    # only through the policy's stochastic steps, which is what the advantages are credited to.
    config.sample.shared_init_noise = False
    # Mirrored step noise (core.common.AntitheticNoise): in each sampling batch the copies of a condition are paired
    # and draw +eps / -eps at every stochastic step, so the part of the reward even in the noise cancels in the
    # group's gradient (evolution strategies' mirrored sampling). Needs shared_init_noise (a pair starts from one x_T).
    config.sample.antithetic = False
    # Branched trajectories (core/branching.py): each tree shares x_T and a deterministic trunk, and every node splits
    # into `branches` stochastic children at each of `branch_steps` (schedule positions), deterministic elsewhere. The
    # children of a node are a GRPO group, each valued by the mean reward of its leaves: the advantage at a split is
    # what that step's noise did. k = seeds x branches**len(branch_steps); () = no branching.
    config.sample.branch_steps = ()
    config.sample.branches = 2
    config.sample.guidance_scale = 1.0  # classifier-free guidance; 1.0 = off
    config.sample.negative_prompt = ""  # the CFG negative prompt (recam: Wan's default negative prompt)
    # Flow models: the sigma grid by name (core.families.FLOW_GRIDS: "scheduler" = the folder scheduler's own,
    # "recammaster" = ReCamMaster's inference grid) and its shift (0 = the scheduler's own).
    config.sample.flow_grid = "scheduler"
    config.sample.flow_shift = 0.0
    config.sample.batch_size = 8  # per process, per sampling batch
    config.sample.num_batches_per_epoch = 4
    # GRPO group size: copies of each condition per epoch, spread over all processes and batches.
    # num_processes * batch_size * num_batches_per_epoch must be divisible by k.
    config.sample.k = 4

    ###### Training ######
    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 8  # samples per training micro-batch (per process)
    config.train.learning_rate = 3e-4
    # Optimizer steps of linear lr warmup from 0 (then constant). Without it Adam's first, full-size steps on
    # a noisy policy gradient can knock a small pretrained model's reward down for several epochs.
    config.train.lr_warmup_steps = 0
    # After warmup: "constant", or a decay to 0 over the run's epochs, "cosine" or "linear" (per epoch, so that
    # the last epochs take small steps and a run ends near its best instead of wherever the last steps left it).
    config.train.lr_schedule = "constant"
    # > 0 (grpo): adapt the lr every epoch so that the update's policy shift (train/policy_shift_kl: the exact KL
    # between the step Gaussians before and after the epoch's update, mean over dims) stays near this value:
    # lr / 1.5 above 2x, lr * 1.5 below 0.5x (PPO's adaptive rule). The clipped ratio cannot bound that shift
    # (docs/efficacy.md). 0 = off: the lr follows lr_schedule alone. With "cosine" / "linear" the target decays as
    # the schedule's factor squared (training.shift_target), so the rule keeps the decay rather than undoing it.
    config.train.target_shift_kl = 0.0
    # Per-module lr: "fragment=multiplier,..." gives the trainable parameters whose names hold a fragment lr * that
    # multiplier (e.g. "cam_encoder.=10,projector.=10": ReCamMaster's camera layers, whose varying inputs are small);
    # the schedule and target_shift_kl scale every group alike. "" = one lr for all.
    config.train.lr_multipliers = ""
    config.train.adam_beta1 = 0.9
    config.train.adam_beta2 = 0.999
    config.train.adam_weight_decay = 1e-4
    config.train.adam_epsilon = 1e-8
    config.train.gradient_accumulation_steps = 1  # micro-batches per optimizer step (x trained timesteps)
    config.train.max_grad_norm = 1.0
    config.train.num_inner_epochs = 1  # passes over each epoch's samples
    config.train.cfg = True  # use guidance in training when sampling used it (needed for ratio == 1)
    # The on-policy check: before each epoch's first optimizer step the ratio exp(logp - logp_old) of every re-scored
    # transition must be 1 within core.loss.onpolicy_tolerance (float32: 1e-5; bf16/fp16/TF32: clip_range / 2).
    # "stop": one line naming the step, the sample and the likely causes, exit 2; "warn": that line, and train on;
    # "off". A mismatch (CFG, dtype, scheduler settings, condition) otherwise trains silently on the wrong ratio.
    config.train.onpolicy_check = "stop"
    # Where the ratio's old log-probs come from (trainer/epoch/rescoring.py). "rescore": before the epoch's first update, a
    # no-grad pass through exactly the training calls (each inner epoch's call plan and row grouping, CFG, autocast)
    # scores them, so the ratio is 1 by construction; costs one forward per trained step. "sampling": the sampler's,
    # as DDPO does: on a GPU/NPU in bf16 the kernels chosen per batch shape make them differ by ~1e-3, ten times the
    # clip range. "auto": re-score the first epoch and compare; while the sampler's equal the re-score bit for bit
    # (the sampler calls the denoiser in train mode and, where the plan allows, in the training calls' shape) use the
    # sampler's, re-verified every old_logprobs_verify_every epochs; once they differ, re-score every epoch. Every
    # re-scored epoch also checks the sampler against the trainer: a gap above core.loss.sampler_gap_tolerance, or
    # training settings other than the sampler's (train.cfg=False with guidance), is a mismatch that the
    # on-policy check (train.onpolicy_check) stops or warns about. Logged: train/sampler_gap_max, _mean,
    # old_logprobs_bit_exact, and the run's counts old_logprobs_rescored_epochs / old_logprobs_sampler_epochs.
    config.train.old_logprobs = "auto"
    # "auto": epochs between the re-scores that re-verify a bit-exact sampler (each costs one forward per trained
    # step); 0 = only the first epoch's.
    config.train.old_logprobs_verify_every = 10
    # > 0 (needs the re-scored log-probs): weigh each transition's policy term by the truncated importance weight
    # min(pi_trainer / pi_sampler, C) of the transition the sampler drew (rollout correction); 0 = off.
    config.train.sampler_is_cap = 0.0
    # > 0 (grpo): weigh each trained step's policy term by std_t^p, normalised to mean 1 over the trained steps
    # (trainer/epoch/update.step_weights): the log-prob gradient scales as 1/std, so without it the least noisy
    # trained step dominates the update. 0 = every trained step weighs 1.
    config.train.step_weight_power = 0.0
    config.train.adv_clip_max = 5.0
    config.train.clip_range = 1e-4  # PPO ratio clip (small: logprobs are averaged over dimensions)
    config.train.clip_range_high = -1.0  # < 0: same as clip_range
    config.train.timestep_fraction = 1.0  # share of the trainable steps trained per sample (random subset)
    # Steps whose policy std is below this are sampled but not trained: a step's log-prob gradient scales as
    # 1/std^2, so near-deterministic final steps would swamp the others with noise. 0 trains every step.
    config.train.min_step_std = 0.02
    # Timesteps of the same samples stacked into one forward call (bigger calls use the CPU/GPU better);
    # 0 = auto: a short probe at the first epoch picks it.
    config.train.timesteps_per_call = 1
    # "grpo": the clipped-ratio loss on the sampled steps' log-probs (the default). Forward-process objectives on the
    # sampled images, same sampler/rewards/advantages/checks: "raft" (best-of-N supervision: the plain denoising
    # loss on each group's best sample) and "nft" (DiffusionNFT: advantage-weighted denoising, see forward_loss.py).
    config.train.objective = "grpo"
    config.train.nft_beta = 1.0  # nft: step of the implicit positive/negative policies
    config.train.nft_adv_scale = 1.0  # nft: optimality r = 1/2 + 1/2 clip(A / scale, -1, 1)
    # nft: DiffusionNFT's soft update of the sampling policy, theta_old <- d*theta_old + (1-d)*theta after each epoch's
    # update. theta_old samples the epoch, gives v_old and is what eval measures; 0 = on-policy (theta_old = theta).
    config.train.nft_old_decay = 0.0
    # raft/nft: the noise levels u (0 clean, 1 pure noise) the sampled images are re-noised at, uniform in [min, max).
    # Where a reward's attribute is decided is where training pays (benchmarks/step_credit.py): a colour decided in
    # the first denoising steps is learnt at high noise, and low-noise rows only perturb the details.
    config.train.forward_noise_min = 0.0
    config.train.forward_noise_max = 1.0
    config.train.beta = 0.0  # KL weight to the reference; 0 skips the reference forward entirely
    config.train.kl_type = "gaussian"  # "gaussian" (exact for a step) | "k3" (Schulman, on logprobs)
    # "trained": the KL is taken at the trained steps only. "all": also at one random untrained step per sample and
    # epoch (std clamped below at min_step_std), because the weights are shared over timesteps and the steps GRPO
    # never scores drift too. Needs beta > 0; costs one more forward+backward and reference forward per sample. On
    # tiny_colour the KL at the trained steps alone already kept the eta = 0 sampler (docs/efficacy.md).
    config.train.kl_steps = "trained"
    config.train.reference_model_mixup_alpha = 1.0  # ref <- a*ref + (1-a)*policy; 1 = frozen start
    config.train.reference_update_freq = 1  # optimizer steps between reference mixes
    # > 0: an EMA of the trained parameters, theta_ema <- d*theta_ema + (1-d)*theta every ema_update_freq optimizer
    # steps, d warmed up as diffusers' EMAModel does (min(d, (1+s)/(10+s)) at the (s+1)-th mix). Eval measures it,
    # checkpoints hold it (ema_policy.safetensors beside model.safetensors) and the export writes it, as diffusers'
    # --use_ema and Flow-GRPO's train.ema do; sampling, the ratio and the KL stay on the policy itself. Averaging
    # the last updates' weights takes out part of the noise one epoch's gradient puts in them. 0 = off; not with
    # nft_old_decay (NFT's eval measures its soft-updated sampling policy, itself an EMA of the policy).
    config.train.ema_decay = 0.0
    config.train.ema_update_freq = 1
    config.train.sup_weight = 0.0  # supervised denoising loss on pretraining data (0 = off)
    config.train.sup_warmup_epochs = 0  # linear ramp of the sup weight up to sup_weight over these epochs
    config.train.sup_decay_epochs = 0  # then linear decay to 0 over these epochs (0 = keep sup_weight)
    config.train.sup_batch_size = 16
    config.train.max_invalid_fraction = 0.5  # stop if more than this share of an epoch's rewards is invalid
    # Reward-hacking alarm after every eval (trainer/checks/hacking.py): the proxy up while reward.gold falls beyond
    # hacking_z standard errors of its paired drop from its best eval, or an image statistic (rewards/drift.py)
    # moved more than hacking_drift_max from the start model's. "warn": a warning line and a wandb alert; "stop":
    # also a checkpoint and a clean end; "off".
    config.train.hacking_guard = "warn"
    config.train.hacking_z = 2.0
    config.train.hacking_drift_max = 0.25

    ###### Advantages (PerPromptStatTracker) ######
    config.tracker = ml_collections.ConfigDict()
    config.tracker.std_mode = "group"  # "group" | "global" | "none" | "running"
    config.tracker.buffer_size = 0  # > 0: DDPO's per-prompt history across epochs
    config.tracker.min_count = 16  # history length before per-prompt stats are used

    ###### Rewards ######
    config.reward = ml_collections.ConfigDict()
    config.reward.fns = {"toyworld": 1.0}  # name -> weight; combined into `avg`
    config.reward.kwargs = {}  # name -> dict of factory kwargs
    config.reward.per_step = "none"  # "none" (B,) | "broadcast" | "x0" | "x0_gain" (B, T)
    config.reward.num_threads = 2  # reward computation overlaps sampling in a thread pool; 0 = in the sampling thread
    # Held-out gold reward(s) (trainer/checks/hacking.py, docs/hacking.md): name -> weight, from the same registry as fns;
    # scored on every eval and on gold_train_samples of each epoch's samples (per process), logged as gold/*, never
    # trained on. {} = none.
    config.reward.gold = {}
    config.reward.gold_kwargs = {}  # name -> dict of factory kwargs, as reward.kwargs
    config.reward.gold_train_samples = 8

    ###### Logging ######
    config.logging = ml_collections.ConfigDict()
    config.logging.wandb = True  # offline unless WANDB_MODE says otherwise
    config.logging.wandb_project = "ddpo_grpo"
    config.logging.tensorboard = True
    config.logging.num_images = 16  # images in the per-epoch grid
    config.logging.image_freq = 1  # epochs between image grids
    config.logging.debug_dump = False  # per-process JSON of keys/rewards/advantages/weights each epoch (tests)

    ###### Evaluation ######
    config.eval = ml_collections.ConfigDict()
    config.eval.num_samples = 64  # deterministic sampling (eta=0 / ODE) with fixed seeds
    # "eval": held-out conditions never trained on; "train": the training conditions (fresh seeds), which is
    # what DDPO reports; only meaningful with data.num_conditions small enough that they recur.
    config.eval.split = "eval"
    config.eval.seed = 1234
    config.eval.also_policy = False  # with train.ema_decay > 0: also evaluate the trained policy (eval_policy/...)
    config.eval.batch_size = 32
    # a field of the eval items to break the deterministic reward down by: eval/by_{field}/{value} (and /n, the
    # count) for each of its values, e.g. "preset" on room3d (ReCamMaster's ten cameras). "" = off.
    config.eval.group_by = ""
    # pass@k with every eval: k stochastic samples (the training sampler) of each eval condition, fixed seeds; the
    # share of conditions with at least one right sample (a `*strict_accuracy` detail, else reward >= 1). 0 = off.
    config.eval.pass_at_k = 4
    return config

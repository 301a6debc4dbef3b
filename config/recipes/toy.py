"""The toy-world tasks on the bundled tiny models (CPU): the demo, the colour task, baselines, objectives, rewards,
the bundled flow model."""
from .blocks import base, _batches, _branch_at_step0, _flow_grpo_sde, _nft_demo, _one_step_per_epoch


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
    the first denoising steps (benchmarks/step_credit.py: no step after the 4th of 10 flips an outcome), so the sampled
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
    """tiny_colour trained by the clipped-ratio GRPO loss, in the shape the policy gradient needs here. Only the two
    noisiest steps are trained (std >= 0.6; benchmarks/step_credit.py: the colour flips at x_T and step 0, never
    after step 3). Only the text-conditioning pathway is trained, at 10x the full model's lr: the cross-attention
    (attn2) and the pooled-text embedding added to the time embedding (add_embedding), 87 K of 1.43 M weights, at
    lr 1e-3. The error is the same for every condition (a colour word drawn as another colour), so its correction
    lives where the words enter; every other weight denoises what the reward does not score, and one Adam step moves
    each trained weight by about the lr whatever the gradient's signal, so a full fine-tune fell at 2e-4 while this
    subspace rises at 1e-3. Each epoch's 128 samples (16 conditions x k = 8) make ONE optimizer step (a small batch's
    policy gradient is mostly noise and Adam makes full-size steps of it: at 64 samples in 4 steps lr 1e-4 broke the
    model in 2 epochs). A KL to the frozen start model (beta 0.04, Flow-GRPO's value for the same mean-over-dims KL)
    holds what the reward does not score. Held-out strict at 4,608 samples (36 epochs; docs/efficacy.md, 2026-11-28),
    seeds 42 / 1 / 2 / 3: 0.859 / 0.852 / 0.887 / 0.750, on another seed set (eval_model.py --seed 7)
    0.859 / 0.828 / 0.871 / 0.746; start 0.320 / 0.305. The whole model at lr 1e-4, same samples: 0.469 / 0.527 /
    0.531 (branched); at 1e-3 it broke (0.000 at epoch 12). add_embedding alone 0.824, attn2 alone 0.301 (seed 42):
    the global path does it. eval.pass_at_k = 8 reports the policy's sampler on 256 samples too."""
    config = _one_step_per_epoch(tiny_colour(), num_batches=4, learning_rate=1e-3)  # 128 = 16 conditions x 8
    config.train.min_step_std = 0.6  # steps 0-1 of 10
    config.trainable_modules = ("attn2", "add_embedding")  # the UNet's text-conditioning pathway
    return config


def tiny_colour_branch():
    """tiny_colour_grpo on branched trajectories (core/branching.py): per condition one tree, x_T shared, 8 children
    split at step 0 (where benchmarks/step_credit.py finds the colour decided after x_T) and finished deterministically
    (DDIM eta 0, the eval's sampler). The 8 siblings are the group, so the advantage is what step 0's noise did, not
    x_T's luck; only step 0 is stored and trained. Same recipe as tiny_colour_grpo (128 samples in one optimizer step
    per epoch, the text-conditioning pathway at lr 1e-3, KL to the start model), at 12.1 instead of 14.1 NFEs per
    sample. Held-out strict at 4,608 samples (36 epochs), seeds 42 / 1 / 2 / 3: 0.867 / 0.875 / 0.887 / 0.887; on
    another seed set (eval_model.py --seed 7) 0.863 / 0.930 / 0.926 / 0.883 (docs/efficacy.md, 2026-11-28). With
    the whole model trained at lr 1e-4: 0.469 / 0.527 / 0.531."""
    return _branch_at_step0(tiny_colour_grpo())  # 16 conditions per epoch


def tiny_branch():
    """The mixed task (`tiny`) on branched trajectories: one optimizer step per epoch on 256 samples (32 conditions x
    one 8-leaf tree) at lr 1e-4 over the whole model, KL to the start model, with the split at step 0.
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

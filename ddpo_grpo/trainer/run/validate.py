"""Validation, first and cheap: whatever in a config cannot work stops the run with one clear line (a ConfigError)
before any model is loaded (build.py builds the run afterwards)."""
from __future__ import annotations

import math

from ddpo_grpo.core.families import get_family
from ddpo_grpo.core.forward_loss import OBJECTIVES
from ddpo_grpo.core.loss import KL_STEPS
from ddpo_grpo.core.sde_with_logprob import SDE_TYPES
from ddpo_grpo.core.stat_tracking import STD_MODES
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.rewards.combine import PER_STEP_MODES

from .build import LR_SCHEDULES
from .data import TOYWORLD_OBJECTS, KRepeatSampler, build_dataset, data_kinds
from .lr_multipliers import parse_lr_multipliers
from ..epoch.sampling import branch_spec, check_window, model_scheduler


def model_family(config) -> str:
    """The family name ("ddim", "flow") from the model's scheduler config, read without loading weights; a folder
    of a pipeline class no adapter loads is one ConfigError line here too."""
    from ddpo_grpo.models import BUILT, ModelPathError, model_adapter, resolve_model_path
    from ddpo_grpo.models.base import scheduler_family

    if config.pretrained.model in BUILT:
        return BUILT[config.pretrained.model]
    try:
        path = resolve_model_path(config.pretrained.model)
        model_adapter(path)
    except ModelPathError as e:
        raise ConfigError(f"pretrained.model: {e}") from None
    return scheduler_family(path)


def check_resolution(config) -> None:
    """pretrained.resolution sizes models built from configs (sd15-random); a loaded checkpoint has its own size."""
    from ddpo_grpo.models import BUILT

    res, model = int(config.pretrained.resolution), config.pretrained.model
    if model not in BUILT:
        # An architecture whose adapter has check_resolution(path, res) -> why not ('' if fine) samples other sizes
        # than its native one (SD3's transformer: any multiple of VAE x patch up to its position embedding).
        from ddpo_grpo.models import model_adapter, resolve_model_path

        check = getattr(model_adapter(model), "check_resolution", None) if res else None
        if check is not None:
            why = check(resolve_model_path(model), res)
            if why:
                raise ConfigError(f"pretrained.resolution: {why}")
            return
        if res:
            raise ConfigError(f"pretrained.resolution={res} applies to built models ({', '.join(sorted(BUILT))}) "
                              f"only; {model!r} has its own size: leave it at 0")
        return
    if model != "sd15-random":  # the real-shape builds take their builder's resolution (GPU only; their builders check)
        return
    from ddpo_grpo.models.sd15_random import check_resolution as why_not

    why = why_not(res) if res else ""
    if why:
        raise ConfigError(f"pretrained.resolution: {why}")


def check_height_width(config) -> None:
    """pretrained.height / pretrained.width: video models only (Wan, ReCamMaster: models.wan.set_size, any multiple of
    the VAE x patch). The image adapters sample pretrained.resolution's square (SDXL's size conditioning, FLUX's
    resolution-shifted schedule and every check_resolution are one number), so a size set for one is one line here
    instead of being ignored; a Wan folder's size is checked against its VAE and patch before anything loads."""
    from ddpo_grpo.models import BUILT, model_adapter, resolve_model_path

    p = config.pretrained
    hw = {k: int(p.get(k, 0) or 0) for k in ("height", "width")}
    if not any(hw.values()):
        return
    model = p.model
    adapter = model_adapter(model)
    if not getattr(adapter, "video", False):
        raise ConfigError(f"pretrained.height={hw['height']} / pretrained.width={hw['width']} apply to video models "
                          f"(Wan, ReCamMaster); {model!r} ({adapter.name or type(adapter).__name__}) samples "
                          f"pretrained.resolution's square: set that and leave height and width at 0")
    check = getattr(adapter, "check_size", None)
    if model not in BUILT and check is not None:
        for k, v in hw.items():
            why = check(resolve_model_path(model), v, 0) if v else ""
            if why:
                raise ConfigError(f"pretrained.{k}: {why.replace('resolution', k)}")


def validate_config(config, num_processes: int) -> str:
    """Raise ConfigError with one clear line for anything that cannot work. Returns the model family."""
    from ddpo_grpo.rewards import available_rewards

    s, t = config.sample, config.train
    family = model_family(config)
    check_resolution(config)
    check_height_width(config)
    from ddpo_grpo.models import check_recam_checkpoint

    check_recam_checkpoint(config)  # pretrained.recam_checkpoint: readable, camera layers, fits the folder
    get_family(family).check_sample_config(s)  # eta > 0 (DDIM), noise_level > 0 (flow), windows for flow only
    if s.sde_type not in SDE_TYPES:
        raise ConfigError(f"sample.sde_type={s.sde_type!r}; choose one of {SDE_TYPES}")
    scheduler = model_scheduler(config)  # config only; None for a built model (checked again in build_context)
    check_window(config, family, scheduler)
    if not 0 < t.timestep_fraction <= 1:
        raise ConfigError(f"train.timestep_fraction={t.timestep_fraction} must be in (0, 1]")
    if t.clip_range <= 0:
        raise ConfigError(f"train.clip_range={t.clip_range} must be > 0")
    if t.kl_type not in ("gaussian", "k3"):
        raise ConfigError(f"train.kl_type={t.kl_type!r}; choose 'gaussian' or 'k3'")
    if not 0 <= t.reference_model_mixup_alpha <= 1:
        raise ConfigError(f"train.reference_model_mixup_alpha={t.reference_model_mixup_alpha} must be in [0, 1]")
    if t.lr_warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps={t.lr_warmup_steps} must be >= 0")
    if t.get("lr_schedule", "constant") not in LR_SCHEDULES:
        raise ConfigError(f"train.lr_schedule={t.lr_schedule!r}; choose one of {LR_SCHEDULES}")
    parse_lr_multipliers(t.get("lr_multipliers", ""))  # its form here; whether each fragment names a parameter, at build
    if int(t.timesteps_per_call) < 0:
        raise ConfigError(f"train.timesteps_per_call={t.timesteps_per_call} must be >= 1, or 0 for auto")
    if t.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={t.objective!r}; choose one of {OBJECTIVES}")
    if t.objective != "grpo" and (t.beta > 0 or t.sup_weight > 0):
        raise ConfigError(f"train.objective={t.objective!r} trains on the sampled images alone: set train.beta=0 "
                          "and train.sup_weight=0 (the KL and the supervised term belong to the 'grpo' objective)")
    if t.get("kl_steps", "trained") not in KL_STEPS:
        raise ConfigError(f"train.kl_steps={t.kl_steps!r}; choose one of {KL_STEPS}")
    if t.get("kl_steps", "trained") == "all" and not (t.beta > 0 and t.kl_type == "gaussian"):
        raise ConfigError("train.kl_steps='all' takes the KL at the untrained steps too: it needs train.beta > 0 and "
                          f"train.kl_type='gaussian' (got beta={t.beta}, kl_type={t.kl_type!r})")
    if t.objective == "nft" and t.nft_adv_scale <= 0:
        raise ConfigError(f"train.nft_adv_scale={t.nft_adv_scale} must be > 0")
    lo, hi = t.get("forward_noise_min", 0.0), t.get("forward_noise_max", 1.0)
    if not 0 <= lo < hi <= 1:
        raise ConfigError(f"train.forward_noise_min={lo}, train.forward_noise_max={hi}: need 0 <= min < max <= 1")
    if not 0 <= t.get("nft_old_decay", 0.0) < 1:
        raise ConfigError(f"train.nft_old_decay={t.nft_old_decay} must be in [0, 1)")
    if not t.get("target_shift_kl", 0.0) >= 0:
        raise ConfigError(f"train.target_shift_kl={t.target_shift_kl} must be >= 0 (0 = off)")
    if t.get("target_shift_kl", 0.0) > 0 and t.objective != "grpo":
        raise ConfigError(f"train.target_shift_kl={t.target_shift_kl} adapts the lr to the GRPO update's policy shift: "
                          f"it needs train.objective='grpo' (got {t.objective!r})")
    swp = t.get("step_weight_power", 0.0)
    if not (math.isfinite(swp) and swp >= 0):
        raise ConfigError(f"train.step_weight_power={swp} must be a finite number >= 0 (0 = off; a "
                          "negative power would weigh the least noisy steps up, and a zero-std step infinitely)")
    if swp != 0 and t.objective != "grpo":
        raise ConfigError(f"train.step_weight_power={swp} weighs the clipped-ratio loss's steps: it "
                          f"needs train.objective='grpo' (got {t.objective!r})")
    if t.get("nft_old_decay", 0.0) > 0 and t.objective != "nft":
        raise ConfigError(f"train.nft_old_decay={t.nft_old_decay} is DiffusionNFT's soft update of the sampling "
                          f"policy: it needs train.objective='nft' (got {t.objective!r})")
    ema = t.get("ema_decay", 0.0)
    if not 0 <= ema < 1:
        raise ConfigError(f"train.ema_decay={ema} must be in [0, 1) (0 = off)")
    if ema > 0 and t.get("nft_old_decay", 0.0) > 0:
        raise ConfigError(f"train.ema_decay={ema} with train.nft_old_decay={t.nft_old_decay}: NFT's eval measures its "
                          "soft-updated sampling policy, already an EMA of the policy; set one of them to 0")
    if t.get("ema_update_freq", 1) < 1:
        raise ConfigError(f"train.ema_update_freq={t.ema_update_freq} must be >= 1 (optimizer steps per mix)")
    if config.eval.get("also_policy", False) and ema == 0:
        raise ConfigError("eval.also_policy=True evaluates the trained policy beside its EMA: it needs "
                          "train.ema_decay > 0")
    if config.eval.pass_at_k < 0:
        raise ConfigError(f"eval.pass_at_k={config.eval.pass_at_k} must be >= 0 (0 = off)")
    if config.tracker.std_mode not in STD_MODES:
        raise ConfigError(f"tracker.std_mode={config.tracker.std_mode!r}; choose one of {STD_MODES}")
    if config.eval.split not in ("eval", "train"):
        raise ConfigError(f"eval.split={config.eval.split!r}; choose 'eval' (held-out) or 'train'")
    if config.data.objects not in TOYWORLD_OBJECTS:
        raise ConfigError(f"data.objects={config.data.objects!r}; choose one of {TOYWORLD_OBJECTS}")
    data_kinds(config)  # room3d's training kinds: known names, and room3d only
    if config.data.num_conditions < 0:
        raise ConfigError(f"data.num_conditions={config.data.num_conditions} must be >= 0 (0 = all)")
    if config.reward.per_step not in PER_STEP_MODES:
        raise ConfigError(f"reward.per_step={config.reward.per_step!r}; choose one of {PER_STEP_MODES}")
    from ddpo_grpo.models import COMPILE_MODES, UNET_ATTENTION

    if config.reward.num_threads < 0:
        raise ConfigError(f"reward.num_threads={config.reward.num_threads}: give 0 (rewards in the sampling thread) or more")
    if config.unet_attention not in UNET_ATTENTION:
        raise ConfigError(f"unet_attention={config.unet_attention!r}; choose one of {UNET_ATTENTION}")
    from ddpo_grpo.core.attention import check_attention_backend

    check_attention_backend(config)  # attention_backend (core/attention.py)
    if config.compile_unet not in COMPILE_MODES:
        raise ConfigError(f"compile_unet={config.compile_unet!r}; choose one of {COMPILE_MODES} ('' = off)")
    if config.mixed_precision not in ("", "no", "fp16", "bf16"):
        raise ConfigError(f"mixed_precision={config.mixed_precision!r}; choose 'no', 'fp16', 'bf16' or '' (as launched)")
    from .scale import check_engine

    check_engine(config)  # FSDP1, DeepSpeed + reference swap / unfixed accumulation: refused here
    names = available_rewards()
    for name in config.reward.fns:
        if name not in names:
            raise ConfigError(f"unknown reward {name!r} in reward.fns; available: {', '.join(sorted(names))}")
    if not config.reward.fns:
        raise ConfigError("reward.fns is empty; give at least one reward name with a weight")
    from ..checks.hacking import check_config as check_guard

    check_guard(config)  # reward.gold names, train.hacking_guard
    from ..checks.onpolicy import check_onpolicy_config

    check_onpolicy_config(config)  # train.onpolicy_check
    from ..epoch.rescoring import check_old_logprobs_config

    check_old_logprobs_config(config)  # train.old_logprobs, train.sampler_is_cap
    train = build_dataset(config, "train")  # a missing or empty prompt file fails here
    tree = branch_spec(config, family, scheduler)  # a tree that cannot be sampled or trained is one line here
    if s.antithetic and not s.shared_init_noise:
        raise ConfigError("sample.antithetic=True needs sample.shared_init_noise=True: a mirrored pair must start "
                          "from one x_T, or the pair's noise cancels nothing")
    KRepeatSampler(dataset_size=len(train), batch_size=s.batch_size, num_batches=s.num_batches_per_epoch,
                   num_processes=num_processes, k=s.k, seed=config.seed,
                   tree_size=tree.leaves if tree else 1)  # geometry, and enough distinct conditions
    return family

"""Config -> everything the epoch loop needs, in one RunContext. Validation (validate.py) comes first and is cheap:
bad input stops the run with one clear line before any model is loaded."""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from ddpo_grpo.errors import ConfigError
from .data import KRepeatSampler, build_dataset
from .lr_multipliers import parse_lr_multipliers
from ..epoch.sampling import branch_spec, check_window, scheduler_note
from ..epoch.update import schedule_decay


@dataclass
class RunState:
    """Counters saved with every checkpoint."""

    epoch: int = 0  # next epoch to run
    global_step: int = 0  # optimizer steps taken
    history: list = field(default_factory=list)  # per-epoch reward means, for the reward curve
    timesteps_per_call: int = 0  # chosen by the auto probe (train.timesteps_per_call = 0)
    lr_scale: float = 1.0  # train.target_shift_kl's adaptive factor on the learning rate (training.adapt_lr_scale)
    guard: dict = field(default_factory=dict)  # hacking.py: start-model drift, evals, alarms, best by gold

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "global_step": self.global_step, "history": list(self.history),
                "timesteps_per_call": self.timesteps_per_call, "lr_scale": self.lr_scale, "guard": dict(self.guard)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.global_step, self.history = state["epoch"], state["global_step"], list(state["history"])
        self.timesteps_per_call = int(state.get("timesteps_per_call", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.guard = dict(state.get("guard", {}))  # a checkpoint from before the guard has none


@dataclass
class RunContext:
    config: Any
    accelerator: Any
    pipe: Any
    unet: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    stat_tracker: Any  # PerPromptStatTracker (not accelerate's metric trackers)
    reference: Any
    rewards: Any
    sampler: KRepeatSampler
    train_data: Any
    eval_data: Any
    encode: Callable  # trainer/run/embeddings.py's PromptEmbeddings: prompts -> (B, L, D) on the device
    neg_embed: torch.Tensor
    run_dir: str
    state: RunState
    supervised: Optional[Any] = None
    old_policy: Optional[Any] = None  # EMAReference: nft's sampling policy when train.nft_old_decay > 0
    tree: Optional[Any] = None  # core.branching.BranchSpec of sample.branch_steps, or None (no branching)
    cond_cache: Dict[int, torch.Tensor] = field(default_factory=dict)  # condition index -> its conditioning channels
    gold: Optional[Any] = None  # RewardComputer of reward.gold (hacking.py): scored and logged, never trained on
    stop: str = ""  # why the run stops early (train.hacking_guard = "stop"), or ""
    startup: Dict[str, float] = field(default_factory=dict)  # start-up phase seconds (trainer/run/startup.py)
    ema: Optional[Any] = None  # EMAReference: train.ema_decay > 0, the weights eval measures and the export holds

    COND_CACHE_SIZE = 64  # conditions kept (host memory): a real-size ReCamMaster condition is ~15 MB

    def cond_channels(self, items) -> Optional[torch.Tensor]:
        """The items' conditioning channels (ModelAdapter.condition_channels: (B, C', ...) or None), computed once
        per condition index (a source clip is VAE-encoded once, not k times) and kept on the host."""
        from tqdm.auto import tqdm

        adapter, device = self.pipe.adapter, self.accelerator.device
        have: Dict[int, torch.Tensor] = {}
        new = {int(it["index"]) for it in items} - set(self.cond_cache)
        # a bar for a video model's source clips: at real shape one VAE encode takes seconds, before the first step
        bar = tqdm(total=len(new), desc="encoding source clips", leave=False, disable=not (
            new and getattr(adapter, "video", False) and self.accelerator.is_local_main_process))
        for it in items:
            i = int(it["index"])
            if i in have:
                continue
            if i not in self.cond_cache:
                out = adapter.condition_channels(self.pipe, [it], device)
                if out is None:
                    bar.close()
                    return None
                while len(self.cond_cache) >= self.COND_CACHE_SIZE:
                    self.cond_cache.pop(next(iter(self.cond_cache)))
                self.cond_cache[i] = out[0].cpu()
                bar.update()
            have[i] = self.cond_cache[i]
        bar.close()
        return torch.stack([have[int(it["index"])] for it in items]).to(device)

    def sampling_policy(self):
        """Context in which self.unet holds the sampling policy's weights: theta_old when nft soft-updates it
        (swapped in, grad off, restored bit-exactly on exit), else the policy itself."""
        if self.old_policy is None:
            return contextlib.nullcontext()
        return self.old_policy.swapped(self.accelerator.unwrap_model(self.unet))

    def eval_policy(self):
        """Context in which self.unet holds the weights eval measures, checkpoints export and the run's export
        writes: the EMA of the policy (train.ema_decay > 0), else the sampling policy (sampling_policy)."""
        if self.ema is not None:
            return self.ema.swapped(self.accelerator.unwrap_model(self.unet))
        return self.sampling_policy()


LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(schedule: str, warmup_steps: int, num_epochs: int, state: RunState) -> Callable[[int], float]:
    """The learning rate's factor at a scheduler step: linear warmup over `warmup_steps` steps (exactly diffusers'
    constant_with_warmup), times a decay over the run's epochs read from `state.epoch` ("constant": none; "cosine":
    1/2 (1 + cos(pi e / E)); "linear": 1 - e / E). The decay follows the epoch, not the step count, because how many
    optimizer steps an epoch takes depends on the data (trained columns); a resumed run restores the epoch, so
    it gets the same rates."""

    def factor(step: int) -> float:
        w = float(step) / float(max(1.0, warmup_steps)) if step < warmup_steps else 1.0
        w *= state.lr_scale  # 1.0 unless train.target_shift_kl adapts it
        return w * schedule_decay(schedule, state.epoch, num_epochs)

    return factor


def trainable_modules(config, adapter) -> tuple:
    """(LoRA target modules, full fine-tune name fragments) a run trains: config.trainable_modules where given (for
    both), else the architecture's own (adapter.lora_target_modules, adapter.full_trainable). The run's build and the
    memory plan's counts both read it here."""
    chosen = tuple(config.get("trainable_modules", ()) or ())  # ml_collections keeps it a tuple (a str is refused)
    return chosen or adapter.lora_target_modules, chosen or adapter.full_trainable


def train_only(module: torch.nn.Module, fragments) -> int:
    """requires_grad on exactly the parameters of `module` whose names hold one of the name `fragments` (the rule of
    train.trainable_modules for a full fine-tune; the pretraining's --dit-trainable uses it too); returns how many
    tensors train."""
    n = 0
    for name, p in module.named_parameters():
        p.requires_grad_(any(f in name for f in fragments))
        n += p.requires_grad
    return n


def make_trainable(unet: torch.nn.Module, config, target_modules=None, full_trainable=()) -> torch.optim.Optimizer:
    """LoRA adapters (peft, on the architecture's target_modules: ModelAdapter.lora_target_modules) or the full
    denoiser made trainable (only the parameters whose names hold one of `full_trainable`'s fragments where it is
    given: ModelAdapter.full_trainable, e.g. ReCamMaster's camera layers and self-attention); returns AdamW over the
    trainable parameters."""
    if config.use_lora:
        from peft import LoraConfig

        from ddpo_grpo.models.base import inner_model
        from ddpo_grpo.models.sd import ADAPTER as SD

        from diffusers.training_utils import cast_training_params

        from ddpo_grpo.models.base import TRAINABLE_DTYPE

        targets = list(target_modules or SD.lora_target_modules)
        try:
            inner_model(unet).add_adapter(LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_rank, init_lora_weights="gaussian",
                target_modules=targets))
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise ConfigError(f"LoRA target modules {targets} match no module of the denoiser "
                              f"({type(unet).__name__}): {str(e).splitlines()[0][:200]}") from None
        # peft makes the adapter in its base layer's dtype: a bf16 base (component_dtype under LoRA) would give bf16
        # adapters, whose small AdamW updates round away. The trainable parameters are float32 master weights.
        cast_training_params(unet, TRAINABLE_DTYPE)
    elif full_trainable:
        train_only(unet, full_trainable)
    else:
        unet.requires_grad_(True)
    t = config.train
    if not any(p.requires_grad for p in unet.parameters()):
        raise ConfigError(f"trainable_modules={tuple(full_trainable)!r} names no parameter of the denoiser "
                          f"({type(unet).__name__}); give fragments of its parameter names")
    return torch.optim.AdamW(lr_groups(unet, t.get("lr_multipliers", ""), t.learning_rate), lr=t.learning_rate,
                             betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay, eps=t.adam_epsilon)


def lr_groups(unet: torch.nn.Module, spec: str, lr: float) -> list:
    """AdamW parameter groups over unet's trainable parameters: a trainable parameter whose name holds a fragment of
    train.lr_multipliers gets lr * that multiplier (the first fragment that matches), the rest lr. Each group keeps
    its multiplier through the lr schedule and target_shift_kl's scaling, which scale every group's lr alike. A
    fragment that matches no trainable parameter is a ConfigError."""
    rules = parse_lr_multipliers(spec)
    groups = {None: []}
    for name, p in unet.named_parameters():
        if p.requires_grad:
            groups.setdefault(next((i for i, (f, _) in enumerate(rules) if f in name), None), []).append(p)
    for i, (frag, _) in enumerate(rules):
        if i not in groups:
            raise ConfigError(f"train.lr_multipliers: {frag!r} names no trainable parameter of the denoiser "
                              f"({type(unet).__name__})")
    return [dict(params=ps, lr=lr * (1.0 if i is None else rules[i][1]))
            for i, ps in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]) if ps]


def build_context(config, accelerator, run_dir: str) -> RunContext:
    """Load the model and build optimizer, stat tracker, reference, rewards and sampler."""
    from ddpo_grpo.models import apply_unet_options, load_pipeline
    from ddpo_grpo.core.reference import EMAReference
    from ddpo_grpo.rewards import RewardComputer
    from ddpo_grpo.core.stat_tracking import PerPromptStatTracker
    from ..checks.hacking import build_gold
    from ..epoch.supervised import SupervisedLoss

    from ddpo_grpo.core.offload import park
    from ddpo_grpo.models.base import run_dtype
    from .embeddings import PromptEmbeddings, dataset_prompts
    from ddpo_grpo.models import recam_checkpoint_path

    import time

    from .startup import watch_first_step

    started = time.perf_counter()
    from ddpo_grpo.core.attention import apply_attention_backend

    # before anything loads: a CUDA-only kernel asked for on another device is one line, and every SDPA call of the
    # run (sampling, training, gradient checkpointing's recomputation) sees the choice (core/attention.py)
    attention = apply_attention_backend(config.get("attention_backend", "auto"), accelerator.device)
    if accelerator.is_main_process:
        print(attention, flush=True)
    # Load dtype: the run's compute dtype; folders and built models alike load frozen encoders in it and the denoiser
    # in float32, or in it as a LoRA run's frozen base (models.base.component_dtype).
    dtype = run_dtype(accelerator.mixed_precision)
    pipe = load_pipeline(config.pretrained.model, torch_dtype=dtype, device=accelerator.device,
                         resolution=config.pretrained.resolution, recam_checkpoint=recam_checkpoint_path(config),
                         lora=bool(config.use_lora))
    pipe.adapter.configure(pipe, config)  # run settings beyond the folder (FLUX.1-dev's embedded guidance)
    # sample.flow_grid / flow_shift: read by the flow family wherever it sets timesteps (the DDIM family ignores them;
    # its check_settings refuses a named grid, so only the defaults reach a DDIM scheduler here)
    from ddpo_grpo.core.families import set_flow_grid

    set_flow_grid(pipe.scheduler, config.sample.get("flow_grid", "scheduler"), config.sample.get("flow_shift", 0.0))
    cache_on = bool(config.data.get("cache_embeddings", False))
    if config.pretrained.get("offload", False):  # on the device only for their calls (core.offload)
        park([pipe.vae] + pipe.text_encoders())
    unet = pipe.unet
    moving = time.perf_counter()
    optimizer = make_trainable(unet, config, *trainable_modules(config, pipe.adapter))
    apply_unet_options(unet, config)  # after the adapters, so that they are compiled / checkpointed too
    t = config.train
    # Linear warmup: Adam's first steps are full-size sign steps (its second-moment estimate is young), and
    # on a noisy policy gradient they knock the pretrained model down before the signal averages in.
    # accelerate steps a prepared scheduler once per process, hence the factor (as in diffusers' scripts).
    state = RunState()
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(
        t.get("lr_schedule", "constant"), t.lr_warmup_steps * accelerator.num_processes, config.num_epochs, state))
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    from .scale import after_prepare

    after_prepare(accelerator, unet)  # FSDP2: parameters stay the sharded DTensors between forwards
    reference = None
    if t.beta > 0:
        reference = EMAReference(accelerator.unwrap_model(unet), alpha=t.reference_model_mixup_alpha,
                                 update_freq=t.reference_update_freq, lora=config.use_lora or None)
    move_s = time.perf_counter() - moving
    tc = config.tracker
    stat_tracker = PerPromptStatTracker(std_mode=tc.std_mode, buffer_size=tc.buffer_size or None, min_count=tc.min_count)
    # reward.num_threads = 0: no pool, each batch's reward runs in the sampling thread as it is submitted
    executor = ThreadPoolExecutor(config.reward.num_threads) if config.reward.num_threads > 0 else None
    rewards = RewardComputer(dict(config.reward.fns), fn_kwargs={k: dict(v) for k, v in config.reward.kwargs.items()},
                             executor=executor)
    train_data, eval_data = build_dataset(config, "train"), build_dataset(config, "eval")
    if config.eval.get("group_by", ""):  # a field the eval items lack: one line now, not at the first eval
        from ..epoch.evaluation import group_value

        group_value(eval_data[0], config.eval.group_by)
    check_window(config, pipe.family, pipe.scheduler)  # the loaded scheduler decides (a built model's first here)
    tree = branch_spec(config, pipe.family, pipe.scheduler)
    if accelerator.is_main_process:
        print(scheduler_note(config, pipe), flush=True)
    sampler = KRepeatSampler(len(train_data), config.sample.batch_size, config.sample.num_batches_per_epoch,
                             accelerator.num_processes, config.sample.k, config.seed,
                             weights=getattr(train_data, "weights", None), tree_size=tree.leaves if tree else 1)
    # Prompt embeddings (B, L, D), each encoded once: conditions repeat k times per epoch and across epochs. With
    # data.cache_embeddings the whole prompt set (train, eval, the CFG negative "") is encoded now, held on the host
    # and in the run folder, and the text encoders are parked off the device (trainer/run/embeddings.py).
    encode = PromptEmbeddings(pipe, accelerator.device, host=cache_on)
    negative = str(config.sample.get("negative_prompt", "") or "")  # CFG's negative prompt
    if cache_on:
        # Each machine's main process encodes and writes the file (atomically: on a shared filesystem the machines
        # write the same bytes, renamed into place), then that machine's other processes read it: machines without a
        # shared run folder (run_identity.py) encode in parallel, each into its own folder.
        with accelerator.local_main_process_first():
            encode.precompute(dataset_prompts(train_data) + dataset_prompts(eval_data) + [negative], folder=run_dir,
                              settings={"model": config.pretrained.model}, write=accelerator.is_local_main_process)
    supervised = SupervisedLoss(config, pipe) if t.sup_weight > 0 else None
    old_policy = None
    if t.objective == "nft" and t.get("nft_old_decay", 0.0) > 0:
        # The sampling policy, held like the KL reference: a copy of the trainable parameters, mixed once per epoch.
        old_policy = EMAReference(accelerator.unwrap_model(unet), alpha=t.nft_old_decay, update_freq=1,
                                  lora=config.use_lora or None)
    ema = None
    if t.get("ema_decay", 0.0) > 0:
        # What eval measures and the export writes: an EMA of the trainable parameters, held like the KL reference.
        ema = EMAReference(accelerator.unwrap_model(unet), alpha=t.ema_decay, update_freq=t.get("ema_update_freq", 1),
                           lora=config.use_lora or None, warmup=True)
    for obj in (state, stat_tracker) + tuple(o for o in (reference, old_policy, ema) if o is not None):
        accelerator.register_for_checkpointing(obj)
    ctx = RunContext(config, accelerator, pipe, unet, optimizer, lr_scheduler, stat_tracker, reference, rewards,
                     sampler, train_data, eval_data, encode, encode([negative]), run_dir, state, supervised, old_policy,
                     tree, gold=build_gold(config), ema=ema)
    ready = time.perf_counter()
    ctx.startup = {"started_at": started, "ready_at": ready, "move_s": move_s, "ready_embeddings_s": encode.seconds,
                   "load_s": ready - started - move_s - encode.seconds}  # load: the rest (model, data, rewards)
    watch_first_step(ctx)  # prints the startup line after the denoiser's first call
    return ctx

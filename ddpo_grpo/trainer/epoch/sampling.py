"""Step 1 of the epoch: sample trajectories with log-probs for this process's share of the epoch's
conditions, and start their reward computation in the background as each batch finishes (step 2,
`ddpo_grpo.rewards.collect_rewards`, waits for them)."""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from ddpo_grpo.core.branching import BranchSpec
from ddpo_grpo.core.common import AntitheticNoise, mirrored_pairs
from ddpo_grpo.core.families import get_family
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings


@dataclass
class EpochSamples:
    """This process's samples of one epoch. N samples, T stored steps."""

    latents: torch.Tensor  # (N, T+1, C, H, W)
    log_probs: torch.Tensor  # (N, T)
    timesteps: torch.Tensor  # (T,)
    step_indices: torch.Tensor  # (T,)
    embeds: torch.Tensor  # (N, L, D)
    neg_embeds: Optional[torch.Tensor]  # (N, L, D) when CFG is on
    images: torch.Tensor  # (N, C, H, W) in [0, 1]
    keys: torch.Tensor  # (N,) long: condition index, the GRPO group key
    prompts: List[str]
    metadata: List[Dict[str, Any]]
    cond_channels: Optional[torch.Tensor] = None  # (N, C', H, W) image conditioning
    reward_futures: List[Any] = field(default_factory=list)
    step_std: Optional[torch.Tensor] = None  # (T,) policy std per stored step
    # (T, 2) long: stored step j goes from latents[:, transitions[j, 0]] to latents[:, transitions[j, 1]]
    # (None: j -> j + 1, consecutive steps; see core.pipeline_with_logprob.Trajectory)
    transitions: Optional[torch.Tensor] = None
    # How the sampler called the denoiser, for the trainer's comparison (training.py): its SamplerSettings (None: not
    # recorded, e.g. hand-built samples) and the samples per denoiser call (0: the whole sampling batch at once).
    settings: Optional[SamplerSettings] = None
    call_rows: int = 0

    def step_states(self, columns: torch.Tensor):
        """columns (n,) long -> (input state indices (n,), output state indices (n,)) into latents' dim 1."""
        if self.transitions is None:
            return columns, columns + 1
        return self.transitions[columns, 0], self.transitions[columns, 1]

    def __len__(self) -> int:
        return self.latents.shape[0]


SDE_WINDOW_MODES = ("fixed", "random", "sliding")


def model_scheduler(config):
    """The model's scheduler as the trainer reads it from its folder (config only, no weights: models.base's
    load_scheduler), for the checks made before the model loads; None for a BUILT model (its builder makes the
    scheduler: build_context checks again with the loaded pipe's)."""
    from ddpo_grpo.models import BUILT, model_adapter, resolve_model_path
    from ddpo_grpo.models.base import load_scheduler

    if config.pretrained.model in BUILT:
        return None
    path = resolve_model_path(config.pretrained.model)
    if model_adapter(path).dynamic_shift:  # the shift moves sigmas, never which steps have noise (σ' = 0: the last)
        return load_scheduler(path, dynamic_shift=True, use_dynamic_shifting=False)[0]
    return load_scheduler(path)[0]  # a config this adapter cannot sample is one ConfigError line here


def stochastic_steps(config, family: str, scheduler=None) -> int:
    """How many of the sample.num_steps steps are stochastic (and so trainable): the room of an SDE window or a
    tree's splits. core.families' ModelFamily.stochastic_steps decides it from the scheduler (the steps before the
    first one without noise: DDIM's σ_t = 0, CPS's last); scheduler: the loaded pipe's, else model_scheduler's."""
    scheduler = model_scheduler(config) if scheduler is None else scheduler
    return get_family(family).stochastic_steps(scheduler, sampler_settings(config, family), config.sample.num_steps)


def sde_window(config, epoch: int, family: str, scheduler=None) -> Optional[tuple]:
    """(start, size) of the stochastic window for this epoch, identical on every process, or None (size 0).
    The window lies within `family`'s stochastic steps (`stochastic_steps`); check_window checks that it fits."""
    w = config.sample.sde_window_size
    if not w:
        return None
    T = stochastic_steps(config, family, scheduler)
    mode = config.sample.sde_window_mode
    if mode == "fixed":
        start = config.sample.sde_window_start
    elif mode == "random":
        start = int(np.random.default_rng((config.seed, epoch, 11)).integers(0, T - w + 1))
    elif mode == "sliding":
        start = epoch % (T - w + 1)
    else:
        raise ValueError(f"unknown sample.sde_window_mode {mode!r}; choose one of {SDE_WINDOW_MODES}")
    return (start, w)


def scheduler_note(config, pipe) -> str:
    """The run's `note:` line on its scheduler, stated once: the folder's class and the class it is sampled as, the
    values that decide DDIM's steps (the folder's, or DDIM_FILLED's where the folder does not say), and how many
    steps are stochastic (trained) and how many, without noise for these settings, are deterministic."""
    import json
    import os

    sched, fam = pipe.scheduler, get_family(pipe.family)
    f = os.path.join(str(pipe.path), "scheduler", "scheduler_config.json")
    folder = json.load(open(f)) if os.path.isfile(f) else None
    was = (folder or {}).get("_class_name", type(sched).__name__)
    head = f"note: scheduler: {was}" + ("" if was == type(sched).__name__ else f" sampled as {type(sched).__name__}")
    said = lambda k: folder is None or k in folder or k not in fam.filled  # noqa: E731
    vals = ", ".join(f"{k}={sched.config.get(k)!r}" + ("" if said(k) else " (filled: not in the folder)")
                     for k in fam.note_keys)
    head += f"{fam.describe(sched, config.sample)}: {vals}"
    n = int(config.sample.num_steps)
    room = stochastic_steps(config, fam.name, sched)
    tail = f"; {room} of {n} steps stochastic (trained)"
    if room < n:
        tail += f", the last {n - room} without noise for these settings: deterministic, no log-prob, not trained"
    # an SDE window or a tree's splits narrow that room: say what this run samples with noise and trains
    w, splits = int(config.sample.get("sde_window_size", 0) or 0), tuple(config.sample.get("branch_steps", ()) or ())
    if splits:
        tail += f"; this run: noise and training at the tree's splits {list(splits)} only, deterministic elsewhere"
    elif w:
        mode = config.sample.sde_window_mode
        if mode == "fixed":
            start = sde_window(config, 0, fam.name, sched)[0]  # the window's place, as the sampler places it
            where = f"steps {start}-{start + w - 1}"
        else:
            where = f"placed {mode} per epoch"
        tail += f"; this run: an SDE window of {w} ({where}) stochastic and trained, deterministic elsewhere"
    return head + tail


def check_window(config, family: str, scheduler) -> None:
    """One ConfigError line for an SDE window that does not fit in the stochastic steps of `scheduler`."""
    s = config.sample
    if s.sde_window_mode not in SDE_WINDOW_MODES:
        raise ConfigError(f"sample.sde_window_mode={s.sde_window_mode!r}; choose one of {SDE_WINDOW_MODES}")
    if s.sde_window_size < 0 or s.sde_window_size > s.num_steps:
        raise ConfigError(f"sample.sde_window_size={s.sde_window_size} must be in [0, num_steps={s.num_steps}]")
    if not s.sde_window_size or scheduler is None:  # 0: no window; None: a built model, checked once built
        return
    room = stochastic_steps(config, family, scheduler)  # the window lies within the stochastic steps
    where = (f"sample.num_steps={s.num_steps}" if room == s.num_steps else
             f"the {room} stochastic steps (sample.num_steps={s.num_steps}; {s.num_steps - room} without noise for "
             "the scheduler's settings run deterministically)")
    w, start = s.sde_window_size, s.sde_window_start
    if s.sde_window_mode == "fixed":
        if start < 0:
            raise ConfigError(f"sample.sde_window_start={start} must be >= 0")
        if start + w > room:
            raise ConfigError(f"sample.sde_window_start={start} + sample.sde_window_size={w} = {start + w} "
                              f"exceeds {where}")
    elif w > room:  # random / sliding starts are drawn so that the window fits
        raise ConfigError(f"sample.sde_window_size={w} exceeds {where}")


def branch_spec(config, family: str, scheduler=None) -> Optional[BranchSpec]:
    """The tree of `sample.branch_steps` x `sample.branches` (core.branching), or None without branch steps. Raises
    ConfigError with one line for a tree that cannot be sampled or trained: a split outside the stochastic steps,
    fewer than 2 branches, k or the batch not holding whole trees, or an option that means something else per
    sample (an SDE window, shared x_T per condition, per-step rewards, a history buffer, the forward objectives)."""
    s = config.sample
    steps = tuple(s.get("branch_steps", ()) or ())
    if not steps:
        return None
    spec = BranchSpec(steps, int(s.branches))
    scheduler = model_scheduler(config) if scheduler is None else scheduler
    try:  # a built model's schedule is known once built: build_context checks again with the pipe's scheduler
        spec.check(int(s.num_steps) if scheduler is None else stochastic_steps(config, family, scheduler))
    except ValueError as e:
        raise ConfigError(f"sample.branch_steps / sample.branches: {e}") from None
    L = spec.leaves
    if s.k % L:
        raise ConfigError(f"sample.k={s.k} must be a multiple of the {L} leaves of one tree "
                          f"(branches**len(branch_steps) = {s.branches}**{spec.depth}): k = seeds x leaves")
    if s.batch_size % L:
        raise ConfigError(f"sample.batch_size={s.batch_size} cannot hold whole trees of {L} leaves; use a multiple of {L}")
    clash = [(s.sde_window_size, "sample.sde_window_size (the split steps are the stochastic ones)"),
             (s.shared_init_noise, "sample.shared_init_noise (the leaves of a tree share x_T; trees draw their own)"),
             (s.get("antithetic", False), "sample.antithetic (a tree's siblings draw from one generator)"),
             (config.reward.per_step != "none", "reward.per_step (a child is valued by the mean final reward below it)"),
             (config.tracker.buffer_size, "tracker.buffer_size (sibling groups exist for one epoch)"),
             (config.tracker.std_mode == "running", "tracker.std_mode='running' (no per-group baseline)"),
             (config.train.get("objective", "grpo") != "grpo", "train.objective raft/nft (branching trains the GRPO loss)")]
    for on, what in clash:
        if on:
            raise ConfigError(f"sample.branch_steps cannot be combined with {what}")
    return spec


def group_init_noise(config, epoch: int, keys: List[int], sample_shape) -> torch.Tensor:
    """Initial noise x_T (B, C, H, W) that is a function of (seed, epoch, condition key) only, so the k copies of a
    condition start from the same x_T wherever they are sampled (DanceGRPO's shared initial noise).

    Why: x_T is not an action of the policy (no log-prob term), yet with independent x_T much of a group's reward
    spread comes from it; the advantages then mostly reward lucky starts and the gradient is that much noisier.
    With x_T shared, the spread within a group comes from the policy's own stochastic steps."""
    return torch.stack([
        torch.randn(tuple(sample_shape), generator=torch.Generator().manual_seed(
            int(np.random.default_rng((config.seed, epoch, int(k), 17)).integers(2**62))))
        for k in keys
    ])


def mirrored_noise(config, sampler, epoch: int, process: int, num_processes: int) -> List[AntitheticNoise]:
    """The step-noise source of each of this process's sampling batches of `epoch` under sample.antithetic: the
    copies of a condition (a dataset position) pair up in the epoch's order (batches, then processes, then rows), and
    the two of a pair draw from one seed, a function of (seed, epoch, position, pair) only, with opposite signs; so a
    pair is mirrored wherever its two rows are sampled (KRepeatSampler spreads a condition's k copies over batches and
    processes). The epoch's pairing is made once, not per batch."""
    order = [(b, q, int(p)) for b in range(config.sample.num_batches_per_epoch) for q in range(num_processes)
             for p in sampler.batch(epoch, b, q)]
    sources: Dict[int, tuple] = {}
    for (b, q, pos), (pair, sign) in zip(order, mirrored_pairs([pos for _, _, pos in order])):
        if q == process:
            seed = int(np.random.default_rng((config.seed, epoch, pos, pair, 29)).integers(2**62))
            seeds, signs = sources.setdefault(b, ([], []))
            seeds.append(seed)
            signs.append(sign)
    return [AntitheticNoise(*sources[b]) for b in range(config.sample.num_batches_per_epoch)]


def sampler_settings(config, family: str) -> SamplerSettings:
    return SamplerSettings(family=family, guidance_scale=config.sample.guidance_scale, eta=config.sample.eta,
                           noise_level=config.sample.noise_level, sde_type=config.sample.sde_type,
                           noise_pool=int(config.sample.get("noise_pool", 1)))


def active_dropout(module: torch.nn.Module) -> List[str]:
    """Names of the dropout modules of `module` that drop something in train mode (p > 0): peft's lora_dropout,
    diffusers' attention / feed-forward / resnet dropout. None in the bundled and built models (checked:
    docs/reliability.md)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and float(getattr(m, "p", 0.0)) > 0]


class TrainingCallShape:
    """The denoiser called `rows` samples at a time, each call laid out as a training call of those samples
    (training.py through rescoring.call_inputs and core.policy_step.denoiser_output): with CFG [uncond rows;
    cond rows] of the same samples, 2 x rows in all. Why: accelerator kernels (and the CPU's float32 GEMMs) are
    chosen per call shape, so a transition scored in a sampling call of B rows and a training call of b rows can get
    two log-probs; scored in calls of the training's shape, the sampler's log-probs are the training path's bit for
    bit wherever the kernels compute each row on its own (measured: docs/reliability.md), and train.old_logprobs
    "auto" can keep them instead of re-scoring. A call whose rows are not a multiple of `rows` runs whole."""

    def __init__(self, unet, rows: int, cfg: bool):
        self.unet, self.rows, self.cfg = unet, int(rows), bool(cfg)

    def __call__(self, x, t, encoder_hidden_states=None, **kwargs):
        """x (n, C, H, W), t (n,), encoder_hidden_states (n, L, D), n = B rows, or 2B with CFG ([uncond; cond])."""
        n, r = x.shape[0], self.rows
        half = n // 2 if self.cfg else n
        if r <= 0 or half <= r or half % r or (self.cfg and n % 2):
            return self.unet(x, t, encoder_hidden_states=encoder_hidden_states, **kwargs)
        parts = []
        for lo in range(0, half, r):
            sel = torch.arange(lo, lo + r, device=x.device)
            if self.cfg:
                sel = torch.cat([sel, sel + half])
            parts.append(self.unet(x[sel], t[sel], encoder_hidden_states=encoder_hidden_states[sel], **kwargs).sample)
        if self.cfg:  # back to the sampler's layout [uncond of all B; cond of all B]
            out = torch.cat([p[:r] for p in parts] + [p[r:] for p in parts])
        else:
            out = torch.cat(parts)
        return types.SimpleNamespace(sample=out)


def sampler_call_rows(config, timesteps_per_call: int = 0, branched: bool = False) -> int:
    """Samples per sampler denoiser call so that its calls have the training calls' shape (TrainingCallShape), or 0
    (the whole sampling batch). Where the plan allows: the GRPO objective, whose ratio the sampler's log-probs may
    serve (train.old_logprobs "auto" or "sampling"; "rescore" re-scores anyway), one timestep per training call
    (train.timesteps_per_call 1, or branched: a cell per row; timesteps_per_call: the auto probe's choice when the
    config says 0, 0 before it ran), and a training batch that divides the sampling batch. The training plan's last
    call of an epoch is smaller when train.batch_size does not divide the samples: its rows then differ in shape."""
    t = config.train
    if t.get("old_logprobs", "auto") == "rescore" or t.get("objective", "grpo") != "grpo":
        return 0
    per_call = 1 if branched else (int(t.timesteps_per_call) or int(timesteps_per_call))
    b, B = int(t.batch_size), int(config.sample.batch_size)
    return b if per_call == 1 and b < B and B % b == 0 else 0


_DROPOUT_NOTED = set()


@torch.no_grad()
def sample_epoch(ctx, epoch: int) -> EpochSamples:
    """Run this process's sampling batches of `epoch`; rewards are submitted to ctx.rewards as we go. The denoiser
    runs in the training's mode (train(): the module computes what the training calls compute, e.g. diffusers'
    ResnetBlock2D lays its shortcut out contiguously only in train mode) unless it has active dropout, which would
    make sampling random beyond its noise: then in eval mode, said once; and, where the plan allows, in the training
    calls' shape (sampler_call_rows)."""
    config, acc = ctx.config, ctx.accelerator
    unet = ctx.unet
    dropout = active_dropout(unet)
    unet.train(not dropout)
    if dropout and id(unet) not in _DROPOUT_NOTED:
        _DROPOUT_NOTED.add(id(unet))
        acc.print(f"note: the denoiser has active dropout ({len(dropout)} modules, e.g. {dropout[0]}): sampling runs "
                  "in eval mode, training in train mode, so the sampler's log-probs are not the training calls' "
                  "(train.old_logprobs 'auto' re-scores)")
    settings = sampler_settings(config, ctx.pipe.family)
    rows = sampler_call_rows(config, getattr(ctx.state, "timesteps_per_call", 0), ctx.tree is not None)
    denoiser = TrainingCallShape(unet, rows, settings.guidance_scale != 1.0) if rows else unet
    window = sde_window(config, epoch, ctx.pipe.family, ctx.pipe.scheduler)
    tree = ctx.tree
    per_step = config.reward.per_step
    parts, futures = [], []
    mirrored = (mirrored_noise(config, ctx.sampler, epoch, acc.process_index, acc.num_processes)
                if config.sample.antithetic else None)  # a condition's copies: mirrored step noise in pairs
    with ctx.sampling_policy():  # nft's soft-updated theta_old (swapped in once), else the policy itself
        for b in tqdm(range(config.sample.num_batches_per_epoch), desc=f"epoch {epoch}: sampling",
                      disable=not acc.is_local_main_process, leave=False):
            positions = ctx.sampler.batch(epoch, b, acc.process_index)
            items = [ctx.train_data[p] for p in positions]
            prompts = [it["prompt"] for it in items]
            embeds = ctx.encode(prompts)
            neg = ctx.neg_embed.expand(len(items), -1, -1) if settings.guidance_scale != 1.0 else None
            gen = torch.Generator().manual_seed(int(np.random.default_rng((config.seed, epoch, acc.process_index, b)).integers(2**62)))
            cond = ctx.cond_channels(items)
            if mirrored is not None:
                gen = mirrored[b]
            latents = None
            if config.sample.shared_init_noise:
                latents = group_init_noise(config, epoch, [it["index"] for it in items], ctx.pipe.sample_shape).to(acc.device)
            with acc.autocast():
                traj = pipeline_with_logprob(
                    denoiser, ctx.pipe.scheduler, settings, embeds, neg, num_inference_steps=config.sample.num_steps,
                    latents=latents, sample_shape=ctx.pipe.sample_shape, generator=gen, vae=ctx.pipe.vae,
                    return_pred_x0=per_step in ("x0", "x0_gain"), sde_window=window, cond_channels=cond, branch=tree,
                )
            metadata = [{k: v for k, v in it.items() if k != "cond_image"} for it in items]
            futures.append(ctx.rewards.submit(traj.images.cpu(), prompts, metadata, x0_images=None if traj.pred_x0 is None
                                              else traj.pred_x0.cpu(), per_step=per_step,
                                              num_steps=traj.log_probs.shape[1]))
            parts.append((traj, embeds, neg, items, prompts, metadata, cond))
    cat = lambda xs: torch.cat(xs) if xs[0] is not None else None  # noqa: E731
    return EpochSamples(
        latents=cat([p[0].latents for p in parts]),
        log_probs=cat([p[0].log_probs for p in parts]),
        timesteps=parts[0][0].timesteps,
        step_indices=parts[0][0].step_indices,
        embeds=cat([p[1] for p in parts]),
        neg_embeds=cat([p[2] for p in parts]),
        images=cat([p[0].images for p in parts]),
        keys=torch.tensor([it["index"] for p in parts for it in p[3]], dtype=torch.long),
        prompts=[s for p in parts for s in p[4]],
        metadata=[m for p in parts for m in p[5]],
        cond_channels=cat([p[6] for p in parts]),
        reward_futures=futures,
        step_std=parts[0][0].step_std,
        transitions=parts[0][0].transitions,
        settings=settings,
        call_rows=rows,
    )


"""Model families: everything that differs between DDIM-style and flow-matching models, in one object each.

A family answers the sampler's, the trainer's and the benchmarks' family-specific questions (how to set the
schedule, how to take the stochastic step with its log-probability, the deterministic step, x̂0, which steps
are stochastic, the forward-process regression target, which config values make sense), so that call sites
ask `get_family(name)` instead of comparing family names. The math itself stays in the public step
functions (`ddim_step_with_logprob`, `sde_step_with_logprob`, ...), which the families call unchanged.

    DDIMFamily  "ddim": a UNet predicting epsilon / v / x0 with a DDIMScheduler; the DDIM eta > 0 step is
                the policy (DDPO).
    FlowFamily  "flow": a velocity model with a FlowMatchEulerDiscreteScheduler; a flow SDE ("sde" or
                "cps", noise_level > 0) is the policy (Flow-GRPO), optionally inside an SDE window.

Family names ("ddim", "flow") stay plain strings in data: LoadedPipeline.family, SamplerSettings.family,
checkpoint metadata. Nothing here imports the trainer or accelerate.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

from ddpo_grpo.errors import ConfigError

from .common import GeneratorLike, on_device
from .ddim_with_logprob import ddim_mean_std, ddim_step, ddim_step_with_logprob
from .sde_with_logprob import flow_ode_step, flow_step_std, flow_step_stds, sde_step_with_logprob

# (prev_sample (N, C, H, W) in the sample's dtype, log_prob (N,) float32, mean (N, C, H, W) float32,
#  std broadcastable to mean, float32)
StepOutput = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ModelFamily:
    """What differs between model families. One stateless instance per family, from `get_family`.

    Tensors: sample, model_output (N, C, H, W); timestep (N,) the denoiser's timestep values; step_index (N,)
    long, positions in the scheduler's schedule. Both are passed to every per-step method because the two
    families index their schedule differently (DDIM by timestep value, flow by position, to read sigmas), and
    the caller has both at hand.
    """

    name: str = ""
    scheduler_class_name: str = ""
    # Whether a sample.sde_window (ODE outside it) applies: only a family whose deterministic and stochastic
    # steps share marginals step by step can switch between them mid-trajectory.
    supports_sde_window: bool = False
    # Scheduler config values the family fills where a folder's config is silent (load_scheduler keeps every key the
    # folder holds), and the keys the run's note states.
    filled: Dict[str, Any] = {}
    note_keys: tuple = ()

    def fill_config(self, scheduler_config: Dict[str, Any]) -> Dict[str, Any]:
        """The folder's scheduler config with the family's `filled` values where it says nothing."""
        return dict(self.filled, **scheduler_config)

    def describe(self, scheduler, sample) -> str:
        """The sampler settings of the run's scheduler note: " (<settings>): <config values>"."""
        return ""

    def set_timesteps(self, scheduler, num_steps: int) -> None:
        """Set the scheduler's inference schedule of num_steps steps (scheduler.timesteps, (num_steps,))."""
        raise NotImplementedError

    def scheduler_from_config(self, scheduler_config: Dict[str, Any]):
        """This family's diffusers scheduler built from a scheduler config dict (as `load_config` returns)."""
        raise NotImplementedError

    def step_with_logprob(self, scheduler, settings, model_output: torch.Tensor, timestep: torch.Tensor,
                          step_index: torch.Tensor, sample: torch.Tensor, prev_sample: Optional[torch.Tensor] = None,
                          generator: GeneratorLike = None, validate: bool = True) -> StepOutput:
        """The policy's stochastic step and the log-probability of its action.

        settings: a SamplerSettings (eta for DDIM; noise_level, sde_type for flow). prev_sample (N, C, H, W):
        score this action instead of drawing one. Returns (prev_sample, log_prob (N,), mean, std), see StepOutput.
        validate=False skips the step's checks (std > 0, a defined step: host syncs on an accelerator), for a
        caller that checked the schedule once (the sampler: stochastic_steps evaluates every step's std).
        """
        raise NotImplementedError

    def ode_step(self, scheduler, model_output: torch.Tensor, timestep: torch.Tensor, step_index: torch.Tensor,
                 sample: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """The deterministic step (evaluation; steps outside an SDE window): the next sample (N, C, H, W),
        in sample's dtype. validate: as in step_with_logprob."""
        raise NotImplementedError

    def predicted_x0(self, scheduler, model_output: torch.Tensor, timestep: torch.Tensor, step_index: torch.Tensor,
                     sample: torch.Tensor) -> torch.Tensor:
        """The denoiser's estimate of the clean sample x̂0 at this step, (N, C, H, W) float32."""
        raise NotImplementedError

    def noised_and_target(self, scheduler, x0: torch.Tensor, noise: torch.Tensor,
                          u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward process at noise level u and the denoiser's regression target (supervised and
        forward-process losses). x0, noise (N, C, H, W); u (N,) in [0, 1): 0 clean, 1 pure noise.
        Returns (x_t (N, C, H, W), the denoiser's timestep input (N,), target (N, C, H, W))."""
        raise NotImplementedError

    def step_std(self, scheduler, settings, timestep: torch.Tensor, step_index: int) -> float:
        """The policy's std at one step of the set schedule: it depends on the schedule and eta / noise level only,
        never on the sample, so it is read off the family's step math with a dummy sample. 0.0 exactly where the
        step has no noise (DDIM σ_t = 0, CPS's σ' = 0)."""
        raise NotImplementedError

    def step_stds(self, scheduler, settings, num_steps: int) -> torch.Tensor:
        """The policy's std at each of the num_steps steps, (num_steps,) float32; sets the scheduler's schedule.
        Every step is evaluated, so a schedule on which some step is undefined (DDIM's eta too large, flow sigmas
        that do not decrease) raises here. The families evaluate all steps in one call of their step math (the
        same elementwise float32 operations as step_std's, so the same values): the sampler asks once per batch."""
        self.set_timesteps(scheduler, num_steps)
        return torch.tensor([self.step_std(scheduler, settings, t, i) for i, t in enumerate(scheduler.timesteps)],
                            dtype=torch.float32)

    def stochastic_steps(self, scheduler, settings, num_steps: int) -> int:
        """How many steps, from the first, are stochastic: sampled with noise, carrying a log-probability, stored
        and trained. The one rule for both families, read from the scheduler's settings: the steps before the first
        whose noise is zero. A zero-noise step (DDIM's last with set_alpha_to_one, or with t = 0 and ᾱ_s = ᾱ_0;
        CPS's last, σ' = 0) has no density, and every step after it is taken deterministically too, as steps outside
        an SDE window are: both families share marginals between their stochastic and deterministic steps."""
        return self.stochastic_count(self.step_stds(scheduler, settings, num_steps))

    @staticmethod
    def stochastic_count(stds: torch.Tensor) -> int:
        """stochastic_steps' rule on step_stds' values (num_steps,): the steps before the first whose std is 0."""
        zero = torch.nonzero(stds <= 0).flatten()
        return int(zero[0]) if len(zero) else int(stds.numel())

    def stored_steps(self, scheduler, settings, num_steps: int, window_size: int = 0) -> int:
        """T, the number of steps a trajectory stores: the SDE window's size where the family takes one, else
        every stochastic step."""
        if window_size and self.supports_sde_window:
            return int(window_size)
        return self.stochastic_steps(scheduler, settings, num_steps)

    def check_sample_config(self, sample) -> None:
        """Raise ConfigError with one clear line for sample.* values this family cannot train with
        (sample: the config's `sample` section, read for eta, noise_level and sde_window_size)."""
        if sample.sde_window_size and not self.supports_sde_window:
            raise ConfigError(f"sample.sde_window_size does not apply to the {self.name} family; set it to 0")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DDIMFamily(ModelFamily):
    """DDIM-style models: noise / v / x0 prediction (scheduler.config.prediction_type) with a DDIMScheduler."""

    # DDIM's processes share the marginals q(x_t | x_0) for every eta (Song et al. 2021, Theorem 1), so eta > 0 inside
    # a window of steps and eta = 0 (deterministic, no log-prob) elsewhere is a sampler path of the same model: DDIM's
    # counterpart of the flow SDE window (MixGRPO, Flow-GRPO-Fast), training only where the outcome is decided.
    supports_sde_window = True

    name = "ddim"
    scheduler_class_name = "DDIMScheduler"
    # What DDIMScheduler needs that other classes' configs (Euler, DPM-Solver, UniPC, LMS, Heun, ...) lack.
    # clip_sample: DDIM's default True clamps x̂0 to [-1, 1], which those samplers never do (latents exceed it);
    # set_alpha_to_one: DDIM's default True ends the last step at ᾱ = 1, where it has no noise; False is Stable
    # Diffusion's and SDXL's released value. A step left without noise is a deterministic step either way
    # (ModelFamily.stochastic_steps).
    filled = {"clip_sample": False, "set_alpha_to_one": False}
    note_keys = ("timestep_spacing", "steps_offset", "set_alpha_to_one", "clip_sample", "prediction_type")

    def describe(self, scheduler, sample) -> str:
        return f" (eta {sample.eta})"

    def set_timesteps(self, scheduler, num_steps: int) -> None:
        scheduler.set_timesteps(num_steps)

    def scheduler_from_config(self, scheduler_config: Dict[str, Any]):
        from diffusers import DDIMScheduler

        return DDIMScheduler.from_config(scheduler_config)

    def step_with_logprob(self, scheduler, settings, model_output, timestep, step_index, sample, prev_sample=None,
                          generator=None, validate=True) -> StepOutput:
        # DDIM looks its alphas up by timestep value; step_index is not needed.
        return ddim_step_with_logprob(scheduler, model_output, timestep, sample, eta=settings.eta, generator=generator,
                                      prev_sample=prev_sample, return_mean_std=True, validate=validate)

    def ode_step(self, scheduler, model_output, timestep, step_index, sample, validate=True) -> torch.Tensor:
        return ddim_step(scheduler, model_output, timestep, sample, eta=0.0, validate=validate)

    def step_std(self, scheduler, settings, timestep, step_index) -> float:
        x = torch.zeros(1, 1, 1, 1)
        return float(ddim_mean_std(scheduler, x, timestep, x, settings.eta, False)[1].reshape(-1)[0])

    def step_stds(self, scheduler, settings, num_steps: int) -> torch.Tensor:
        self.set_timesteps(scheduler, num_steps)
        x = torch.zeros(len(scheduler.timesteps), 1, 1, 1)
        return ddim_mean_std(scheduler, x, scheduler.timesteps, x, settings.eta, False)[1].reshape(-1).float()

    def predicted_x0(self, scheduler, model_output, timestep, step_index, sample) -> torch.Tensor:
        # From x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε and the prediction type; no clipping (unlike the DDIM step),
        # so that x̂0 shows what the model predicts.
        x, out = sample.float(), model_output.float()
        shape = (-1,) + (1,) * (x.ndim - 1)
        ac = scheduler.alphas_cumprod
        a = on_device(ac, x.device, ac.dtype)[timestep.long()].float().view(shape)
        kind = scheduler.config.prediction_type
        if kind == "epsilon":
            return (x - (1 - a).sqrt() * out) / a.sqrt()
        if kind == "v_prediction":
            return a.sqrt() * x - (1 - a).sqrt() * out
        if kind == "sample":
            return out
        raise ValueError(f"unsupported prediction_type {kind!r}")

    def noised_and_target(self, scheduler, x0, noise, u):
        # t = floor(u * num_train_timesteps): u spreads uniformly over the training timesteps; the target is
        # what the model was pretrained to predict (epsilon / v / x0).
        n_train = scheduler.config.num_train_timesteps
        t = (u * n_train).long().clamp_(0, n_train - 1)
        xt = scheduler.add_noise(x0, noise, t)
        kind = scheduler.config.prediction_type
        if kind == "v_prediction":
            target = scheduler.get_velocity(x0, noise, t)
        elif kind == "epsilon":
            target = noise
        elif kind == "sample":
            target = x0
        else:
            raise ValueError(f"unsupported prediction_type {kind!r}")
        return xt, t, target

    def check_sample_config(self, sample) -> None:
        grid, shift = getattr(sample, "flow_grid", "scheduler"), getattr(sample, "flow_shift", 0.0)
        if grid != "scheduler" or shift:
            raise ConfigError(f"sample.flow_grid={grid!r} / sample.flow_shift={shift!r} apply to flow models; a DDIM "
                              "model keeps 'scheduler' / 0")
        if getattr(sample, "noise_pool", 1) != 1:
            raise ConfigError(f"sample.noise_pool={sample.noise_pool}: low-frequency step noise is a flow SDE option; "
                              "a DDIM model keeps 1")
        if sample.eta <= 0:
            raise ConfigError(f"sample.eta={sample.eta}: DDIM with eta=0 is deterministic and has no log-probability; "
                              "use eta > 0 for training (evaluation uses eta=0 by itself)")
        super().check_sample_config(sample)


class FlowFamily(ModelFamily):
    """Flow-matching (rectified flow) models: velocity prediction with a FlowMatchEulerDiscreteScheduler."""

    name = "flow"
    scheduler_class_name = "FlowMatchEulerDiscreteScheduler"
    supports_sde_window = True  # the ODE and the SDE steps share the path's marginals (Flow-GRPO-Fast, MixGRPO)
    note_keys = ("shift",)

    def describe(self, scheduler, sample) -> str:
        grid, shift = getattr(scheduler, "flow_grid", "scheduler"), getattr(scheduler, "flow_grid_shift", 0.0)
        how = "" if grid == "scheduler" else f", grid {grid}"
        how += f", shift {shift:g}" if shift else ""
        pool = getattr(sample, "noise_pool", 1)
        how += f", step noise in {pool}x{pool} latent blocks" if pool > 1 else ""
        return f" ({sample.sde_type}, noise_level {sample.noise_level}{how})"

    def set_timesteps(self, scheduler, num_steps: int) -> None:
        # sigmas on the CPU: the steps index them with CPU step indices. A named grid (set_flow_grid) replaces the
        # scheduler's sigmas after its own set_timesteps, which resets its step counters as diffusers expects.
        grid, shift = getattr(scheduler, "flow_grid", "scheduler"), getattr(scheduler, "flow_grid_shift", 0.0)
        if shift and hasattr(scheduler, "set_shift"):
            scheduler.set_shift(shift)  # the "scheduler" grid then shifts by it too
        scheduler.set_timesteps(num_steps, device="cpu")
        if grid != "scheduler":
            sigmas = flow_grid_sigmas(grid, num_steps, shift or float(scheduler.config.shift))
            scheduler.sigmas = sigmas
            scheduler.timesteps = sigmas[:-1] * float(scheduler.config.num_train_timesteps)

    def scheduler_from_config(self, scheduler_config: Dict[str, Any]):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)

    def step_with_logprob(self, scheduler, settings, model_output, timestep, step_index, sample, prev_sample=None,
                          generator=None, validate=True) -> StepOutput:
        # The flow step reads sigmas[i] and sigmas[i + 1] by position; the timestep value is not needed.
        return sde_step_with_logprob(scheduler, model_output, step_index, sample, noise_level=settings.noise_level,
                                     prev_sample=prev_sample, generator=generator, sde_type=settings.sde_type,
                                     validate=validate, noise_pool=getattr(settings, "noise_pool", 1))

    def ode_step(self, scheduler, model_output, timestep, step_index, sample, validate=True) -> torch.Tensor:
        return flow_ode_step(scheduler, model_output, step_index, sample, validate=validate)

    def predicted_x0(self, scheduler, model_output, timestep, step_index, sample) -> torch.Tensor:
        # x_σ = (1 - σ) x0 + σ x1 and v = x1 - x0  =>  x0 = x_σ - σ v.
        x, out = sample.float(), model_output.float()
        shape = (-1,) + (1,) * (x.ndim - 1)
        sigmas = scheduler.sigmas
        sigma = on_device(sigmas, x.device, sigmas.dtype)[step_index.long().to(x.device)].float().view(shape)
        return x - sigma * out

    def noised_and_target(self, scheduler, x0, noise, u):
        # x_t = (1 - s) x0 + s noise with s = u; the target is the velocity noise - x0 (what the bundled models
        # were pretrained on); the timestep input is s on the scheduler's training scale.
        n_train = scheduler.config.num_train_timesteps
        s = u.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)  # (N, 1, ...): images and video latents
        return (1 - s) * x0 + s * noise, u * n_train, noise - x0

    def step_std(self, scheduler, settings, timestep, step_index) -> float:
        return float(flow_step_std(scheduler, step_index, settings.noise_level, settings.sde_type))

    def step_stds(self, scheduler, settings, num_steps: int) -> torch.Tensor:
        self.set_timesteps(scheduler, num_steps)
        steps = torch.arange(len(scheduler.timesteps), dtype=torch.long)
        return flow_step_stds(scheduler, steps, settings.noise_level, settings.sde_type).float()

    def check_sample_config(self, sample) -> None:
        check_flow_grid(getattr(sample, "flow_grid", "scheduler"), getattr(sample, "flow_shift", 0.0))
        if sample.noise_level <= 0:
            raise ConfigError(f"sample.noise_level={sample.noise_level}: the flow ODE has no log-probability; use > 0")
        pool = getattr(sample, "noise_pool", 1)
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ConfigError(f"sample.noise_pool={pool!r} must be an int >= 1 (1: the full step noise)")
        if pool > 1 and sample.sde_type != "sde":
            raise ConfigError(f"sample.noise_pool={pool} is defined for sample.sde_type='sde', got {sample.sde_type!r}")
        super().check_sample_config(sample)


# ------------------------------------------------------------------------------------------- named flow grids
# The flow family's sigma grids by name: "scheduler" is the scheduler's own set_timesteps (diffusers' grid over its
# config); "recammaster" is ReCamMaster's inference scheduler (DiffSynth's FlowMatchScheduler with sigma_min 0,
# sigma_max 1, extra_one_step): sigmas = linspace(1, 0, N + 1) without its last value, shifted by
# shift * s / (1 + (shift - 1) * s), then one last Euler step to 0; the model's timestep is 1000 * sigma. ReCamMaster
# uses shift 5 (sample.flow_shift); diffusers' grid for the same N and shift ends at another sigma.
FLOW_GRIDS = ("scheduler", "recammaster")


def check_flow_grid(grid: str, shift: float = 0.0) -> None:
    """One ConfigError line for an unknown grid name or a negative shift (0: the scheduler's own shift)."""
    if grid not in FLOW_GRIDS:
        raise ConfigError(f"sample.flow_grid={grid!r}; choose one of {FLOW_GRIDS}")
    if not shift >= 0:
        raise ConfigError(f"sample.flow_shift={shift!r} must be >= 0 (0: the scheduler's own shift)")


def flow_grid_sigmas(grid: str, num_steps: int, shift: float) -> torch.Tensor:
    """(num_steps + 1,) float32 sigmas of a named grid, from 1 down to the final 0 (the comment above)."""
    if grid != "recammaster":
        raise ValueError(f"flow grid {grid!r} has no sigma rule of its own; known: {FLOW_GRIDS[1:]}")
    s = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float32)[:-1]  # float32, as ReCamMaster computes it
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([s, torch.zeros(1)])


def set_flow_grid(scheduler, grid: str = "scheduler", shift: float = 0.0):
    """Make a flow scheduler sample on a named grid (FLOW_GRIDS) and shift (0: its own): FlowFamily.set_timesteps
    reads both from the scheduler object, so every caller of the family (sampler, re-scoring, evaluation, render)
    gets the same grid. Returns the scheduler."""
    check_flow_grid(grid, shift)
    scheduler.flow_grid, scheduler.flow_grid_shift = grid, float(shift)
    return scheduler


FAMILIES: Dict[str, ModelFamily] = {f.name: f for f in (DDIMFamily(), FlowFamily())}


def get_family(family: Union[str, ModelFamily]) -> ModelFamily:
    """The family object for a family name ("ddim", "flow"); a ModelFamily is returned as is.
    Raises ValueError naming the known families for anything else."""
    if isinstance(family, ModelFamily):
        return family
    try:
        return FAMILIES[family]
    except (KeyError, TypeError):
        known = " or ".join(repr(n) for n in FAMILIES)
        raise ValueError(f"unknown model family {family!r}; expected {known}") from None


# Scheduler classes whose config is a DDPM noise schedule (betas over num_train_timesteps, an epsilon / v / sample
# prediction): DDIMScheduler reads it as it is, as DDPO does for Stable Diffusion checkpoints (SD 1.5's PNDM, SDXL's
# Euler). tests/test_schedulers.py samples and re-scores each. Anything else (EDM / VE / consistency schedules, flow
# schedulers other than FlowMatchEuler) has another noise schedule, which a DDIM reading would silently get wrong.
DDIM_SCHEDULER_CLASSES = (
    "DDIMScheduler", "DDPMScheduler", "PNDMScheduler", "LMSDiscreteScheduler", "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler", "HeunDiscreteScheduler", "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler",
    "DEISMultistepScheduler", "UniPCMultistepScheduler")


def family_of_scheduler(class_name: Optional[str], where: str = "") -> ModelFamily:
    """The family of a checkpoint, from its scheduler's class name (scheduler_config.json's `_class_name`):
    flow-matching for FlowMatchEulerDiscreteScheduler, DDIM for DDIM_SCHEDULER_CLASSES. Any other class (or none) is
    one ConfigError line naming the supported ones (where: the folder, for the message). Multistep configs over flow
    sigmas (Wan's UniPC with use_flow_sigmas) are recognised by models.base.flow_sigmas_config before this."""
    flow = FAMILIES["flow"]
    if class_name == flow.scheduler_class_name:
        return flow
    if class_name in DDIM_SCHEDULER_CLASSES:
        return FAMILIES["ddim"]
    raise ConfigError(
        f"{where + ': ' if where else ''}scheduler class {class_name!r} is not supported; the flow family samples "
        f"{flow.scheduler_class_name} (or a multistep config with use_flow_sigmas / prediction_type "
        f"'flow_prediction'), the DDIM family reads {', '.join(DDIM_SCHEDULER_CLASSES)}; save the folder's scheduler "
        "as one of these")

"""The model-family objects (ddpo_grpo.core.families): each wraps the public step functions exactly, and answers the
family-specific questions (stored steps, config checks, scheduler class) the call sites used to branch on."""
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from helpers import ddim_scheduler, flow_scheduler

from ddpo_grpo.core.ddim_with_logprob import ddim_step, ddim_step_with_logprob
from ddpo_grpo.core.families import DDIMFamily, FlowFamily, ModelFamily, family_of_scheduler, get_family
from ddpo_grpo.core.forward_loss import noised_and_target
from ddpo_grpo.core.policy_step import SamplerSettings
from ddpo_grpo.core.sde_with_logprob import flow_ode_step, sde_step_with_logprob
from ddpo_grpo.errors import ConfigError

SHAPE = (3, 3, 4, 4)  # (N, C, H, W)


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def test_registry():
    assert isinstance(get_family("ddim"), DDIMFamily) and isinstance(get_family("flow"), FlowFamily)
    f = get_family("flow")
    assert get_family(f) is f and get_family("flow") is f  # one stateless instance per family
    assert get_family("ddim").name == "ddim" and f.name == "flow"
    for bad in ("sde", "DDIM", "", None):
        with pytest.raises(ValueError, match=r"unknown model family .*expected 'ddim' or 'flow'"):
            get_family(bad)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddim_family_wraps_the_ddim_functions_exactly(prediction_type):
    fam, sched = get_family("ddim"), ddim_scheduler(prediction_type)
    fam.set_timesteps(sched, 5)
    assert len(sched.timesteps) == 5
    x, out = tensors(0)
    t = sched.timesteps[[1, 2, 4]]  # one timestep per sample, as in training
    idx = torch.tensor([1, 2, 4])
    settings = SamplerSettings(family="ddim", eta=0.7)
    got = fam.step_with_logprob(sched, settings, out, t, idx, x, generator=torch.Generator().manual_seed(3))
    want = ddim_step_with_logprob(sched, out, t, x, eta=0.7, generator=torch.Generator().manual_seed(3),
                                  return_mean_std=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    rescored = fam.step_with_logprob(sched, settings, out, t, idx, x, prev_sample=got[0])
    assert torch.equal(rescored[1], got[1]) and rescored[0] is got[0]
    assert torch.equal(fam.ode_step(sched, out, t, idx, x), ddim_step(sched, out, t, x, eta=0.0))
    a = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    x0 = (x - (1 - a).sqrt() * out) / a.sqrt() if prediction_type == "epsilon" else a.sqrt() * x - (1 - a).sqrt() * out
    torch.testing.assert_close(fam.predicted_x0(sched, out, t, idx, x), x0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_flow_family_wraps_the_flow_functions_exactly(sde_type):
    fam, sched = get_family("flow"), flow_scheduler()
    fam.set_timesteps(sched, 5)
    assert len(sched.timesteps) == 5 and sched.sigmas.device.type == "cpu"
    x, v = tensors(1)
    idx = torch.tensor([0, 2, 3])
    t = sched.timesteps[idx]
    settings = SamplerSettings(family="flow", noise_level=0.6, sde_type=sde_type)
    got = fam.step_with_logprob(sched, settings, v, t, idx, x, generator=torch.Generator().manual_seed(4))
    want = sde_step_with_logprob(sched, v, idx, x, noise_level=0.6, generator=torch.Generator().manual_seed(4),
                                 sde_type=sde_type)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    rescored = fam.step_with_logprob(sched, settings, v, t, idx, x, prev_sample=got[0])
    assert torch.equal(rescored[1], got[1])
    assert torch.equal(fam.ode_step(sched, v, t, idx, x), flow_ode_step(sched, v, idx, x))
    sigma = sched.sigmas[idx].view(-1, 1, 1, 1)
    assert torch.equal(fam.predicted_x0(sched, v, t, idx, x), x - sigma * v)


def test_noised_and_target_is_the_familys():
    x0, noise = tensors(2)
    u = torch.tensor([0.0, 0.4, 0.99])
    for name, sched in (("ddim", ddim_scheduler()), ("flow", flow_scheduler())):
        got = noised_and_target(sched, name, x0, noise, u)
        want = get_family(name).noised_and_target(sched, x0, noise, u)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    xt, t, target = get_family("flow").noised_and_target(flow_scheduler(), x0, noise, u)
    assert torch.equal(target, noise - x0) and torch.equal(xt[0], x0[0]) and torch.equal(t, u * 1000)


def test_stochastic_and_stored_steps():
    from diffusers import DDIMScheduler

    ddim, flow = get_family("ddim"), get_family("flow")
    d = SamplerSettings(family="ddim", eta=1.0)
    released = DDIMScheduler(set_alpha_to_one=False, steps_offset=1)  # SD's values: every step has noise
    # DDIM: every step is stochastic whatever sde_type says; a window (eta 0 outside it) stores its own steps only
    assert ddim.stochastic_steps(released, d, 10) == ddim.stochastic_steps(released, SamplerSettings(sde_type="cps"), 10) == 10
    assert ddim.stored_steps(released, d, 10) == 10 and ddim.stored_steps(released, d, 10, window_size=3) == 3
    # ... but the last step has no noise where it ends at ᾱ = 1 (set_alpha_to_one) or starts at t = 0 (offset 0)
    assert ddim.stochastic_steps(DDIMScheduler(set_alpha_to_one=True, steps_offset=1), d, 10) == 9
    assert ddim.stochastic_steps(DDIMScheduler(set_alpha_to_one=False, steps_offset=0), d, 10) == 9
    assert ddim.supports_sde_window
    # flow: CPS's last step has zero variance (ODE, not stored); a window stores its own steps only
    fs = flow_scheduler()
    assert flow.stochastic_steps(fs, SamplerSettings(family="flow", sde_type="sde"), 10) == 10
    assert flow.stochastic_steps(fs, SamplerSettings(family="flow", sde_type="cps"), 10) == 9
    assert flow.stored_steps(fs, SamplerSettings(family="flow", sde_type="cps"), 10) == 9
    assert flow.stored_steps(fs, SamplerSettings(family="flow", sde_type="sde"), 10, window_size=3) == 3
    assert flow.supports_sde_window


def test_check_sample_config():
    def sample(**kw):
        return SimpleNamespace(**{"eta": 1.0, "noise_level": 0.7, "sde_window_size": 0, **kw})

    for name in ("ddim", "flow"):
        get_family(name).check_sample_config(sample())
    get_family("ddim").check_sample_config(sample(noise_level=0.0))  # the flow knob does not matter for DDIM
    get_family("flow").check_sample_config(sample(eta=0.0, sde_window_size=3))
    with pytest.raises(ConfigError, match=r"sample\.eta=0\.0"):
        get_family("ddim").check_sample_config(sample(eta=0.0))
    get_family("ddim").check_sample_config(sample(sde_window_size=2))  # DDIM's noise window
    with pytest.raises(ConfigError, match=r"sample\.eta=0\.0"):  # the window's steps need eta > 0
        get_family("ddim").check_sample_config(sample(eta=0.0, sde_window_size=2))
    with pytest.raises(ConfigError, match=r"sample\.noise_level=0"):
        get_family("flow").check_sample_config(sample(noise_level=0))


def test_family_of_scheduler_and_scheduler_from_config():
    assert family_of_scheduler("FlowMatchEulerDiscreteScheduler").name == "flow"
    for other in ("DDIMScheduler", "PNDMScheduler", "EulerDiscreteScheduler"):  # SD's schedulers are read as DDIM
        assert family_of_scheduler(other).name == "ddim"
    for unknown in ("EDMEulerScheduler", "FlowMatchHeunDiscreteScheduler", "", None):  # another schedule, or none
        with pytest.raises(ConfigError, match=f"scheduler class {unknown!r} is not supported"):
            family_of_scheduler(unknown)
    flow = get_family("flow").scheduler_from_config(flow_scheduler().config)
    ddim = get_family("ddim").scheduler_from_config(ddim_scheduler().config)
    assert type(flow) is FlowMatchEulerDiscreteScheduler and flow.config.shift == 3.0
    assert type(ddim) is DDIMScheduler and ddim.config.prediction_type == "v_prediction"


def test_base_class_is_abstract_about_the_math():
    with pytest.raises(NotImplementedError):
        ModelFamily().set_timesteps(ddim_scheduler(), 5)

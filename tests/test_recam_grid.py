"""ReCamMaster's inference grid as the named flow grid "recammaster" (core.families): sigmas against numbers worked
out by hand, the family's steps and diffusers' own Euler step on it, the config checks."""
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_grpo.core.families import flow_grid_sigmas, get_family, set_flow_grid
from ddpo_grpo.core.policy_step import SamplerSettings
from ddpo_grpo.errors import ConfigError

# N = 4, shift 5: linspace(1, 0, 5)[:-1] = 1, 3/4, 1/2, 1/4 -> 5s / (1 + 4s) = 1, 15/16, 5/6, 5/8; then the last step to 0
HAND = [1.0, 15 / 16, 5 / 6, 5 / 8, 0.0]
# The negative prompt of ReCamMaster's inference script (Wan 2.1's default), copied here from its source, not from
# this library (models.wan.WAN_NEGATIVE_PROMPT is compared with it)
RECAMMASTER_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，"
    "多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，"
    "倒着走")


def test_recammaster_sigmas_by_hand():
    got = flow_grid_sigmas("recammaster", 4, 5.0)
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert torch.allclose(got, torch.tensor(HAND), atol=1e-7)
    # shift 1: the plain linspace; 50 steps (ReCamMaster's count): 51 sigmas, the last step from 5*0.02/1.08 to 0
    assert torch.allclose(flow_grid_sigmas("recammaster", 4, 1.0), torch.tensor([1, .75, .5, .25, 0.]))
    s50 = flow_grid_sigmas("recammaster", 50, 5.0)
    assert s50.shape == (51,) and abs(float(s50[-2]) - 0.1 / 1.08) < 1e-7 and s50[-1] == 0


def test_the_family_samples_on_the_named_grid():
    sched = set_flow_grid(FlowMatchEulerDiscreteScheduler(shift=3.0), "recammaster", 5.0)
    fam = get_family("flow")
    fam.set_timesteps(sched, 4)
    assert torch.allclose(sched.sigmas, torch.tensor(HAND), atol=1e-7)
    assert torch.allclose(sched.timesteps, 1000 * torch.tensor(HAND[:-1]), atol=1e-4)  # the model's t = 1000 sigma
    # the deterministic step is Euler on that grid: x + (sigma_{i+1} - sigma_i) v, and diffusers' step agrees
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    for i in range(4):
        want = x + (HAND[i + 1] - HAND[i]) * v
        got = fam.ode_step(sched, v, sched.timesteps[i].expand(2), torch.full((2,), i), x)
        assert torch.allclose(got, want, atol=1e-6)
    sched._step_index = None
    xs = x
    for i, t in enumerate(sched.timesteps):
        xs = sched.step(v, t, xs, return_dict=False)[0]
    assert torch.allclose(xs, x - v, atol=1e-5)  # sum of the steps: sigma 1 -> 0
    # the shift comes from the scheduler when flow_shift is 0
    set_flow_grid(sched, "recammaster", 0.0)
    fam.set_timesteps(sched, 4)
    assert torch.allclose(sched.sigmas, flow_grid_sigmas("recammaster", 4, 3.0))
    # "scheduler": diffusers' own grid, another one than ReCamMaster's for the same N and shift
    set_flow_grid(sched, "scheduler", 5.0)
    fam.set_timesteps(sched, 4)
    assert sched.sigmas[0] == 1 and not torch.allclose(sched.sigmas, torch.tensor(HAND), atol=1e-3)
    # the policy's stochastic steps: as many as on the scheduler's grid (the last has noise for "sde")
    set_flow_grid(sched, "recammaster", 5.0)
    assert fam.stochastic_steps(sched, SamplerSettings(family="flow", sde_type="sde"), 4) == 4


def test_flow_grid_config_checks():
    def sample(**kw):
        return SimpleNamespace(**{"eta": 1.0, "noise_level": 0.7, "sde_window_size": 0, **kw})

    get_family("flow").check_sample_config(sample(flow_grid="recammaster", flow_shift=5.0))
    with pytest.raises(ConfigError, match=r"sample\.flow_grid='euler'"):
        get_family("flow").check_sample_config(sample(flow_grid="euler"))
    with pytest.raises(ConfigError, match=r"sample\.flow_shift=-1"):
        get_family("flow").check_sample_config(sample(flow_grid="recammaster", flow_shift=-1.0))
    with pytest.raises(ConfigError, match="apply to flow models"):
        get_family("ddim").check_sample_config(sample(flow_grid="recammaster"))


def test_recam_config_is_recammasters_inference():
    from ddpo_grpo.models.wan import WAN_NEGATIVE_PROMPT

    from helpers import grpo_configs

    grpo = grpo_configs()
    c = grpo.recam()
    assert (c.sample.flow_grid, c.sample.flow_shift, c.sample.guidance_scale) == ("recammaster", 5.0, 5.0)
    assert c.sample.negative_prompt == WAN_NEGATIVE_PROMPT == RECAMMASTER_NEGATIVE_PROMPT
    # and its one size: 81 frames x 480 x 832 px
    assert (c.pretrained.num_frames, c.pretrained.height, c.pretrained.width) == (81, 480, 832)

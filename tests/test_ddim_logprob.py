"""DDIM step with log-probability: agrees with diffusers and with an independent reference density."""
import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_grpo.core.common import gaussian_log_prob
from ddpo_grpo.core.ddim_with_logprob import ddim_step, ddim_step_with_logprob

SHAPE = (3, 4, 4, 4)  # (B, C, H, W)
NUM_STEPS = 10


def make_scheduler(**overrides):
    config = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                  clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon")
    config.update(overrides)
    scheduler = DDIMScheduler(**config)
    scheduler.set_timesteps(NUM_STEPS)
    return scheduler


def tensors(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def reference_mean_std(scheduler, model_output, t, x, eta):
    """The DDIM transition written out independently, for one scalar timestep t."""
    ac = scheduler.alphas_cumprod.double()
    s = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    a_t = ac[t]
    a_s = ac[s] if s >= 0 else torch.tensor(float(scheduler.final_alpha_cumprod), dtype=torch.float64)
    x, out = x.double(), model_output.double()
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        eps = out
        x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    elif kind == "sample":
        x0 = out
        eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
    else:
        x0 = a_t.sqrt() * x - (1 - a_t).sqrt() * out
        eps = a_t.sqrt() * out + (1 - a_t).sqrt() * x
    sigma = eta * ((1 - a_s) / (1 - a_t)).sqrt() * (1 - a_t / a_s).sqrt()
    mean = a_s.sqrt() * x0 + (1 - a_s - sigma**2).sqrt() * eps
    return mean, sigma


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_log_prob_matches_independent_normal(prediction_type):
    scheduler = make_scheduler(prediction_type=prediction_type)
    x, out = tensors(1)
    for t in [int(scheduler.timesteps[0]), int(scheduler.timesteps[5]), int(scheduler.timesteps[-1])]:
        prev, lp, mean, std = ddim_step_with_logprob(
            scheduler, out, t, x, eta=0.8, generator=torch.Generator().manual_seed(2), return_mean_std=True)
        mean_ref, std_ref = reference_mean_std(scheduler, out, t, x, 0.8)
        lp_ref = torch.distributions.Normal(mean_ref, std_ref).log_prob(prev.double()).mean(dim=(1, 2, 3))
        assert lp.shape == (3,) and lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(mean.double(), mean_ref, atol=1e-5, rtol=1e-5)
        assert std.shape == (3, 1, 1, 1)
        torch.testing.assert_close(std.double(), std_ref.expand(3, 1, 1, 1), atol=1e-6, rtol=1e-6)
        # A real draw, not the mean: the action is off-centre by about one std per element.
        assert ((prev - mean) / std).pow(2).mean().item() == pytest.approx(1.0, abs=0.4)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_sampled_prev_sample_matches_diffusers(prediction_type):
    scheduler = make_scheduler(prediction_type=prediction_type)
    x, out = tensors(3)
    t = scheduler.timesteps[4]
    prev, _ = ddim_step_with_logprob(scheduler, out, t, x, eta=1.0, generator=torch.Generator().manual_seed(7))
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    expected = scheduler.step(out, t, x, eta=1.0, variance_noise=z).prev_sample
    torch.testing.assert_close(prev, expected, atol=1e-5, rtol=0)


def test_clipping_and_clipped_model_output_match_diffusers():
    scheduler = make_scheduler(clip_sample=True, clip_sample_range=0.5)
    x, out = tensors(4)
    t = scheduler.timesteps[2]
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8))
    for clipped in (False, True):
        prev, _ = ddim_step_with_logprob(scheduler, out, t, x, eta=0.5, use_clipped_model_output=clipped,
                                         generator=torch.Generator().manual_seed(8))
        expected = scheduler.step(out, t, x, eta=0.5, use_clipped_model_output=clipped, variance_noise=z)
        torch.testing.assert_close(prev, expected.prev_sample, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prediction_type", ["sample", "v_prediction"])
def test_dynamic_thresholding_matches_diffusers(prediction_type):
    scheduler = make_scheduler(thresholding=True, sample_max_value=1.5, dynamic_thresholding_ratio=0.9,
                               prediction_type=prediction_type)
    x, out = tensors(11)
    out = out * 3  # so x̂0 exceeds the threshold and thresholding really acts
    t = scheduler.timesteps[7]
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    prev, _ = ddim_step_with_logprob(scheduler, out, t, x, eta=1.0, generator=torch.Generator().manual_seed(9))
    expected = scheduler.step(out, t, x, eta=1.0, variance_noise=z).prev_sample
    torch.testing.assert_close(prev, expected, atol=1e-5, rtol=0)


def test_log_prob_is_differentiable_and_drawn_sample_is_detached():
    scheduler = make_scheduler()
    x, out = tensors(12)
    out.requires_grad_(True)
    prev, lp = ddim_step_with_logprob(scheduler, out, scheduler.timesteps[3], x,
                                      generator=torch.Generator().manual_seed(0))
    assert not prev.requires_grad
    lp.sum().backward()
    assert out.grad is not None and out.grad.abs().sum() > 0


def test_rescoring_gives_identical_log_prob():
    scheduler = make_scheduler()
    x, out = tensors(5)
    t = scheduler.timesteps[3]
    prev, lp1 = ddim_step_with_logprob(scheduler, out, t, x, generator=torch.Generator().manual_seed(1))
    prev2, lp2 = ddim_step_with_logprob(scheduler, out, t, x, prev_sample=prev)
    assert prev2 is prev
    assert torch.equal(lp1, lp2)


def test_bfloat16_round_trip():
    scheduler = make_scheduler()
    x, out = tensors(6)
    x, out = x.bfloat16(), out.bfloat16()
    t = scheduler.timesteps[3]
    prev, lp, mean, std = ddim_step_with_logprob(scheduler, out, t, x, generator=torch.Generator().manual_seed(3),
                                                 return_mean_std=True)
    assert prev.dtype == torch.bfloat16 and lp.dtype == torch.float32 and mean.dtype == torch.float32
    # The log-prob is that of the stored bf16 value, not of the unrounded fp32 draw.
    torch.testing.assert_close(lp, gaussian_log_prob(prev.float(), mean, std), atol=0, rtol=0)
    assert torch.equal(ddim_step_with_logprob(scheduler, out, t, x, prev_sample=prev)[1], lp)


def test_per_sample_timesteps_match_scalar_calls():
    scheduler = make_scheduler()
    x, out = tensors(7)
    ts = torch.stack([scheduler.timesteps[0], scheduler.timesteps[6], scheduler.timesteps[-1]])
    gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
    prev, lp, mean, std = ddim_step_with_logprob(scheduler, out, ts, x, generator=gens, return_mean_std=True)
    for b in range(3):
        p_b, lp_b, m_b, s_b = ddim_step_with_logprob(scheduler, out[b:b + 1], int(ts[b]), x[b:b + 1],
                                                     generator=torch.Generator().manual_seed(10 + b),
                                                     return_mean_std=True)
        torch.testing.assert_close(prev[b:b + 1], p_b, atol=1e-6, rtol=0)
        torch.testing.assert_close(lp[b:b + 1], lp_b, atol=1e-6, rtol=0)
        torch.testing.assert_close(std[b:b + 1], s_b, atol=0, rtol=0)
    assert len(set(std.flatten().tolist())) == 3  # the three steps really differ


def test_video_shaped_sample():
    scheduler = make_scheduler()
    x, out = tensors(8, shape=(2, 3, 4, 4, 4))  # (B, F, C, H, W)
    t = scheduler.timesteps[2]
    prev, lp, mean, std = ddim_step_with_logprob(scheduler, out, t, x, generator=torch.Generator().manual_seed(0),
                                                 return_mean_std=True)
    mean_ref, std_ref = reference_mean_std(scheduler, out, int(t), x, 1.0)
    lp_ref = torch.distributions.Normal(mean_ref, std_ref).log_prob(prev.double()).mean(dim=(1, 2, 3, 4))
    assert std.shape == (2, 1, 1, 1, 1)
    torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=0)


def test_eta_zero_raises_and_deterministic_step_matches_diffusers():
    scheduler = make_scheduler(clip_sample=True)
    x, out = tensors(9)
    t = scheduler.timesteps[5]
    with pytest.raises(ValueError, match="eta=0 is deterministic"):
        ddim_step_with_logprob(scheduler, out, t, x, eta=0.0)
    expected = scheduler.step(out, t, x, eta=0.0).prev_sample
    torch.testing.assert_close(ddim_step(scheduler, out, t, x), expected, atol=1e-6, rtol=0)


def test_final_step_with_alpha_one_raises():
    scheduler = make_scheduler(set_alpha_to_one=True, steps_offset=0)
    x, out = tensors(10)
    assert int(scheduler.timesteps[-1]) == 0
    with pytest.raises(ValueError, match="zero variance.*deterministic step"):
        ddim_step_with_logprob(scheduler, out, scheduler.timesteps[-1], x)
    # The step before the last is fine, and ddim_step can take the last one.
    ddim_step_with_logprob(scheduler, out, scheduler.timesteps[-2], x)
    expected = scheduler.step(out, scheduler.timesteps[-1], x, eta=1.0).prev_sample  # zero variance: no noise
    torch.testing.assert_close(ddim_step(scheduler, out, scheduler.timesteps[-1], x, eta=1.0), expected,
                               atol=1e-6, rtol=0)


def test_gaussian_log_prob_averages_and_accepts_scalar_std():
    x = torch.tensor([[0.0, 1.0], [2.0, -1.0]])
    mean = torch.zeros(2, 2)
    lp = gaussian_log_prob(x, mean, torch.tensor(2.0))
    expected = torch.distributions.Normal(0.0, 2.0).log_prob(x).mean(dim=1)
    torch.testing.assert_close(lp, expected)

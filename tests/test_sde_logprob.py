"""Flow-matching SDE/CPS steps with log-probability, and the ODE step against diffusers."""
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_grpo.core.sde_with_logprob import flow_ode_step, sde_step_with_logprob

SHAPE = (3, 4, 4, 4)  # (B, C, H, W)
NUM_STEPS = 8


def make_scheduler(shift=3.0):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(NUM_STEPS)
    return scheduler


def tensors(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def reference_mean_std(scheduler, v, i, x, eta, sde_type):
    """The transition written out independently, in float64, for one scalar step index i."""
    sig, sig_next = float(scheduler.sigmas[i]), float(scheduler.sigmas[i + 1])
    x, v = x.double(), v.double()
    dt = sig_next - sig
    if sde_type == "sde":
        sig_scale = sig_next if sig >= 1.0 else sig  # the documented guard at σ = 1
        s = eta * math.sqrt(sig_scale / (1 - sig_scale))
        mean = x * (1 + s**2 * dt / (2 * sig)) + v * (1 + s**2 * (1 - sig) / (2 * sig)) * dt
        std = s * math.sqrt(-dt)
    else:
        std = sig_next * math.sin(eta * math.pi / 2)
        x0, x1 = x - sig * v, x + (1 - sig) * v
        mean = (1 - sig_next) * x0 + math.sqrt(sig_next**2 - std**2) * x1
    return mean, torch.tensor(std, dtype=torch.float64)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_log_prob_matches_independent_normal(sde_type):
    scheduler = make_scheduler()
    x, v = tensors(1)
    last = NUM_STEPS - 1 if sde_type == "sde" else NUM_STEPS - 2  # cps has zero std at the final step
    for i in [0, 3, last]:
        prev, lp, mean, std = sde_step_with_logprob(scheduler, v, i, x, noise_level=0.7, sde_type=sde_type,
                                                    generator=torch.Generator().manual_seed(i))
        mean_ref, std_ref = reference_mean_std(scheduler, v, i, x, 0.7, sde_type)
        lp_ref = torch.distributions.Normal(mean_ref, std_ref).log_prob(prev.double()).mean(dim=(1, 2, 3))
        assert lp.shape == (3,) and lp.dtype == torch.float32 and std.shape == (3, 1, 1, 1)
        torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(mean.double(), mean_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(std.double(), std_ref.expand(3, 1, 1, 1), atol=1e-6, rtol=1e-6)
        assert ((prev - mean) / std).pow(2).mean().item() == pytest.approx(1.0, abs=0.4)


def test_first_step_at_sigma_one_is_finite_and_sane():
    scheduler = make_scheduler()
    assert float(scheduler.sigmas[0]) == 1.0
    x, v = tensors(2)
    _, lp, mean, std = sde_step_with_logprob(scheduler, v, 0, x, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(lp).all() and torch.isfinite(mean).all()
    assert 0 < float(std.flatten()[0]) < 1.0  # not the blow-up a cap just below σ = 1 would give


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_rescoring_ratio_is_one(sde_type):
    scheduler = make_scheduler()
    x, v = tensors(3)
    prev, lp1, _, _ = sde_step_with_logprob(scheduler, v, 2, x, sde_type=sde_type,
                                            generator=torch.Generator().manual_seed(4))
    prev2, lp2, _, _ = sde_step_with_logprob(scheduler, v, 2, x, sde_type=sde_type, prev_sample=prev)
    assert prev2 is prev
    assert torch.allclose(torch.exp(lp2 - lp1), torch.ones(3), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_log_prob_is_differentiable_and_drawn_sample_is_detached(sde_type):
    scheduler = make_scheduler()
    x, v = tensors(8)
    v.requires_grad_(True)
    prev, lp, _, _ = sde_step_with_logprob(scheduler, v, 2, x, sde_type=sde_type,
                                           generator=torch.Generator().manual_seed(0))
    assert not prev.requires_grad
    lp.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_bfloat16_round_trip():
    scheduler = make_scheduler()
    x, v = tensors(4)
    x, v = x.bfloat16(), v.bfloat16()
    prev, lp, _, _ = sde_step_with_logprob(scheduler, v, 1, x, generator=torch.Generator().manual_seed(1))
    assert prev.dtype == torch.bfloat16 and lp.dtype == torch.float32
    assert torch.equal(sde_step_with_logprob(scheduler, v, 1, x, prev_sample=prev)[1], lp)


def test_flow_ode_step_matches_diffusers_exactly():
    x, v_all = tensors(5)
    ours, theirs = x.clone(), x.clone()
    reference = make_scheduler()  # scheduler.step advances an internal index: step it in order
    readonly = make_scheduler()
    for i, t in enumerate(reference.timesteps):
        v = v_all * (1 + 0.1 * i)
        theirs = reference.step(v, t, theirs).prev_sample
        ours = flow_ode_step(readonly, v, i, ours)
        assert torch.equal(ours, theirs), f"step {i}"


def test_noise_level_zero_and_zero_std_raise():
    scheduler = make_scheduler()
    x, v = tensors(6)
    with pytest.raises(ValueError, match="noise_level=0"):
        sde_step_with_logprob(scheduler, v, 0, x, noise_level=0.0)
    with pytest.raises(ValueError, match="zero std"):
        sde_step_with_logprob(scheduler, v, NUM_STEPS - 1, x, sde_type="cps")
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(scheduler, v, 0, x, sde_type="ode")


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_per_sample_step_indices_match_scalar_calls(sde_type):
    scheduler = make_scheduler()
    x, v = tensors(7)
    idx = torch.tensor([0, 3, 6])
    gens = [torch.Generator().manual_seed(s) for s in (20, 21, 22)]
    prev, lp, mean, std = sde_step_with_logprob(scheduler, v, idx, x, sde_type=sde_type, generator=gens)
    for b in range(3):
        p_b, lp_b, m_b, s_b = sde_step_with_logprob(scheduler, v[b:b + 1], int(idx[b]), x[b:b + 1],
                                                    sde_type=sde_type,
                                                    generator=torch.Generator().manual_seed(20 + b))
        torch.testing.assert_close(prev[b:b + 1], p_b, atol=1e-6, rtol=0)
        torch.testing.assert_close(lp[b:b + 1], lp_b, atol=1e-6, rtol=0)
        torch.testing.assert_close(std[b:b + 1], s_b, atol=0, rtol=0)
    ode = flow_ode_step(scheduler, v, idx, x)
    for b in range(3):
        assert torch.equal(ode[b:b + 1], flow_ode_step(scheduler, v[b:b + 1], int(idx[b]), x[b:b + 1]))


# ------------------------------------------------------------------------------------------ an independent check
# The tests above compare the step with its own formula re-typed. These check what the formula is for, by Monte
# Carlo, without it: for data x0 ~ N(m, s0²) (per element) the flow's marginal at σ is N((1-σ) m, (1-σ)² s0² + σ²)
# and its exact velocity E[x1 - x0 | x_σ] is analytic; a step that samples the flow must keep that marginal.
def gaussian_velocity(x: torch.Tensor, sigma: float, m: float, s0: float) -> torch.Tensor:
    """E[x1 - x0 | x_σ = x] for x0 ~ N(m, s0²), x1 ~ N(0, 1), x_σ = (1-σ) x0 + σ x1 (jointly Gaussian), in float64."""
    a = 1.0 - sigma
    return -m + (sigma - a * s0 * s0) / (a * a * s0 * s0 + sigma * sigma) * (x - a * m)


def flow_marginal(sigma: float, m: float, s0: float):
    a = 1.0 - sigma
    return a * m, a * a * s0 * s0 + sigma * sigma


def run_chain(sigmas, sde_type: str, eta: float, m: float, s0: float, n: int, seed: int = 0) -> torch.Tensor:
    """n scalar samples drawn from the marginal at sigmas[0], stepped by sde_step_with_logprob (the exact velocity as
    the model) through every sigma; returns x at sigmas[-1] (n,) float64."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(sigmas=[float(s) for s in sigmas])  # shift 1: these sigmas, then the terminal 0
    assert torch.allclose(scheduler.sigmas[:-1], torch.tensor(sigmas, dtype=torch.float32))
    g = torch.Generator().manual_seed(seed)
    mean, var = flow_marginal(float(scheduler.sigmas[0]), m, s0)
    x = (mean + math.sqrt(var) * torch.randn((n, 1, 1, 1), generator=g, dtype=torch.float64)).float()
    for i in range(len(sigmas) - 1):
        v = gaussian_velocity(x.double(), float(scheduler.sigmas[i]), m, s0).float()
        x = sde_step_with_logprob(scheduler, v, i, x, noise_level=eta, sde_type=sde_type, generator=g)[0]
    return x.double().flatten()


def assert_marginal(x: torch.Tensor, sigma: float, m: float, s0: float, slack: float = 0.0) -> None:
    """Sample mean and variance of x equal the flow's marginal at σ within 5 standard errors (+ slack for the
    discretisation's own error)."""
    mean, var = flow_marginal(sigma, m, s0)
    n = x.numel()
    assert abs(x.mean().item() - mean) <= 5 * math.sqrt(var / n) + slack, (x.mean().item(), mean)
    assert abs(x.var().item() - var) <= 5 * var * math.sqrt(2 / n) + slack, (x.var().item(), var)


@pytest.mark.parametrize("sigmas,eta", [((0.8, 0.5), 0.7), ((1.0, 0.6), 0.5), ((0.3, 0.1), 0.9)])
def test_cps_step_keeps_the_flow_marginal_exactly(sigmas, eta):
    """CPS re-noises the predicted endpoints: with data a point (s0 = 0) the exact prediction is the true x0 and x1,
    and one step of any size lands exactly on the marginal at σ' (its coefficients keep (1-σ') on x0 and σ'² of
    total noise variance: sqrt(σ'² - std²)² + std² = σ'²)."""
    x = run_chain(sigmas, "cps", eta, m=0.5, s0=0.0, n=400_000)
    assert_marginal(x, sigmas[-1], m=0.5, s0=0.0)


def test_cps_coefficients_preserve_the_total_variance():
    """The variance identity read off the step as a black box: the mean's coefficient on x̂1 (probed with x̂0 = 0,
    x̂1 = 1) and the std satisfy c² + std² = σ'², and the coefficient on x̂0 (x̂0 = 1, x̂1 = 0) is 1 - σ'."""
    scheduler = make_scheduler()
    for i in range(NUM_STEPS - 1):
        sig, sig_next = float(scheduler.sigmas[i]), float(scheduler.sigmas[i + 1])
        # x̂0 = x - σ v, x̂1 = x + (1 - σ) v: (x, v) = (σ, 1) gives (0, 1); (1 - σ, -1) gives (1, 0)
        x = torch.tensor([sig, 1.0 - sig]).reshape(2, 1, 1, 1)
        v = torch.tensor([1.0, -1.0]).reshape(2, 1, 1, 1)
        _, _, mean, std = sde_step_with_logprob(scheduler, v, i, x, noise_level=0.6, sde_type="cps",
                                                generator=torch.Generator().manual_seed(0))
        c, c0, s = float(mean[0]), float(mean[1]), float(std[0])
        assert c * c + s * s == pytest.approx(sig_next ** 2, rel=1e-5)
        assert c0 == pytest.approx(1.0 - sig_next, rel=1e-5) and s > 0


def test_sde_steps_keep_the_flow_marginal():
    """Flow-GRPO's SDE, Euler-Maruyama over 100 steps from σ = 0.9 to 0.5 with the exact velocity of Gaussian data,
    ends on the flow's marginal at 0.5 (the drift's score correction s²/(2σ) x̂1 exactly offsets the injected noise
    s² |dt|; the discretisation's own error is O(dt), about 1e-4 here)."""
    import numpy as np

    sigmas = np.linspace(0.9, 0.5, 101)
    x = run_chain(sigmas, "sde", 0.7, m=0.5, s0=0.4, n=100_000)
    assert_marginal(x, 0.5, m=0.5, s0=0.4, slack=3e-4)


# ------------------------------------------------------------------------------ low-frequency step noise (noise_pool)
def test_noise_pool_step_is_the_float64_gaussian_on_block_means():
    """noise_pool=2: the mean is Euler plus the score correction projected onto 2 x 2 block-constant tensors, the
    drawn x' differs from it only by a block-constant tensor (the complement is deterministic), and the log-prob is
    the Gaussian log density of x''s block means around the mean's, std / 2, averaged over the block dims: all against
    the formula written out in float64 here."""
    from ddpo_grpo.core.sde_with_logprob import block_mean

    scheduler = make_scheduler()
    x, v = tensors(5, (3, 2, 2, 4, 6))  # (B, C, F, H, W) video latents
    for i in [0, 3, NUM_STEPS - 1]:
        prev, lp, mean, std = sde_step_with_logprob(scheduler, v, i, x, generator=torch.Generator().manual_seed(i),
                                                    noise_pool=2)
        sig, sig_next = float(scheduler.sigmas[i]), float(scheduler.sigmas[i + 1])
        dt = sig_next - sig
        s = 0.7 * math.sqrt((sig_next if sig >= 1 else sig) / (1 - (sig_next if sig >= 1 else sig)))
        corr = (s * s * dt / (2 * sig) * (x.double() + (1 - sig) * v.double()))
        blocks = corr.reshape(3, 2, 2, 2, 2, 3, 2).mean(dim=(4, 6))  # 2 x 2 blocks of (4, 6)
        mean_ref = x.double() + v.double() * dt + blocks.repeat_interleave(2, -2).repeat_interleave(2, -1)
        std_ref = s * math.sqrt(-dt)
        torch.testing.assert_close(mean.double(), mean_ref, atol=1e-5, rtol=1e-5)
        assert float(std.flatten()[0]) == pytest.approx(std_ref, rel=1e-6)
        r = (prev.double() - mean_ref)
        rb = r.reshape(3, 2, 2, 2, 2, 3, 2)
        assert (rb - rb.mean(dim=(4, 6), keepdim=True)).abs().max() < 1e-5  # constant over each block
        m_ref = mean_ref.reshape(3, 2, 2, 2, 2, 3, 2).mean(dim=(4, 6))
        lp_ref = torch.distributions.Normal(m_ref, std_ref / 2).log_prob(
            prev.double().reshape(3, 2, 2, 2, 2, 3, 2).mean(dim=(4, 6))).mean(dim=(1, 2, 3, 4))
        torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(block_mean(prev, 2).double(), prev.double().reshape(3, 2, 2, 2, 2, 3, 2)
                                   .mean(dim=(4, 6)), atol=1e-6, rtol=0)


def test_noise_pool_block_means_are_standard_normal_and_rescoring_gives_ratio_one():
    """The drawn block means of (x' - mean) / (std / b) are N(0, 1) (mean and variance over 24,000 draws within 5
    standard errors), re-scoring the stored x' gives ratio 1, and the log-prob is differentiable in the velocity."""
    scheduler = make_scheduler()
    x, v = tensors(6, (40, 4, 2, 8, 12))
    v.requires_grad_(True)
    prev, lp, mean, std = sde_step_with_logprob(scheduler, v, 2, x, generator=torch.Generator().manual_seed(1),
                                                noise_pool=4)
    z = ((prev - mean.detach()) / (std / 4)).reshape(40, 4, 2, 2, 4, 3, 4).mean(dim=(4, 6)).flatten()
    n = z.numel()
    assert n == 40 * 4 * 2 * 2 * 3
    assert abs(z.mean().item()) < 5 / math.sqrt(n) and abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    _, lp2, _, _ = sde_step_with_logprob(scheduler, v, 2, x, prev_sample=prev, noise_pool=4)
    assert torch.allclose(torch.exp(lp2 - lp), torch.ones(40), atol=1e-6, rtol=0)
    lp.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_noise_pool_one_is_the_full_step_and_block_constant_inputs_give_the_full_mean():
    """noise_pool=1 is the plain step bit for bit (same draw, log-prob, mean); with x and v constant over the blocks
    the projected correction is the full one, so the pooled step's mean equals the plain step's."""
    scheduler = make_scheduler()
    x, v = tensors(7, (2, 3, 4, 4))
    a = sde_step_with_logprob(scheduler, v, 1, x, generator=torch.Generator().manual_seed(3))
    b = sde_step_with_logprob(scheduler, v, 1, x, generator=torch.Generator().manual_seed(3), noise_pool=1)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    xb, vb = (t[..., ::2, ::2].repeat_interleave(2, -2).repeat_interleave(2, -1) for t in (x, v))
    full = sde_step_with_logprob(scheduler, vb, 1, xb, generator=torch.Generator().manual_seed(3))[2]
    pooled = sde_step_with_logprob(scheduler, vb, 1, xb, generator=torch.Generator().manual_seed(3), noise_pool=2)[2]
    torch.testing.assert_close(pooled, full, atol=1e-6, rtol=1e-6)


def test_noise_pool_sde_chain_keeps_the_flow_marginal_and_no_correlation_within_a_block():
    """The block-noise SDE (diffusion s² P) with its projected score correction, 100 Euler-Maruyama steps from σ = 0.9
    to 0.5 on Gaussian data, i.i.d. over a 2 x 2 block: every element ends on the flow's marginal at 0.5, and two
    elements of a block stay uncorrelated (a correction left unprojected, or noise without its correction, would
    correlate them: the injected noise is shared by the block)."""
    import numpy as np

    sigmas = np.linspace(0.9, 0.5, 101)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(sigmas=[float(s) for s in sigmas])
    g = torch.Generator().manual_seed(0)
    m, s0, n = 0.5, 0.4, 50_000
    mean, var = flow_marginal(float(scheduler.sigmas[0]), m, s0)
    x = (mean + math.sqrt(var) * torch.randn((n, 1, 2, 2), generator=g, dtype=torch.float64)).float()
    for i in range(len(sigmas) - 1):
        v = gaussian_velocity(x.double(), float(scheduler.sigmas[i]), m, s0).float()
        x = sde_step_with_logprob(scheduler, v, i, x, noise_level=0.7, generator=g, noise_pool=2)[0]
    x = x.double().reshape(n, 4)
    for j in range(4):
        assert_marginal(x[:, j], 0.5, m=m, s0=s0, slack=3e-4)
    c = torch.corrcoef(x.T)
    off = c[~torch.eye(4, dtype=torch.bool)]
    assert off.abs().max() < 5 / math.sqrt(n) + 3e-3, c


def test_noise_pool_bad_settings_raise():
    scheduler = make_scheduler()
    x, v = tensors(8, (2, 3, 4, 6))
    with pytest.raises(ValueError, match="multiples"):
        sde_step_with_logprob(scheduler, v, 1, x, generator=torch.Generator().manual_seed(0), noise_pool=4)
    with pytest.raises(ValueError, match="sde_type='sde'"):
        sde_step_with_logprob(scheduler, v, 1, x, sde_type="cps", noise_pool=2,
                              generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="needs latents"):
        sde_step_with_logprob(scheduler, v[:, 0], 1, x[:, 0], noise_pool=2,
                              generator=torch.Generator().manual_seed(0))

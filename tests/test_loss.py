import math

import pytest
import torch

from ddpo_grpo.core.loss import KLInputs, grpo_loss, kl_penalty

F64 = torch.float64


def test_ratio_one_gives_minus_mean_clipped_advantage():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -7.0, 0.5, 6.0], dtype=F64)
    loss, m = grpo_loss(lp, lp.detach().clone(), adv, clip_range=0.2, adv_clip_max=5.0)
    # A clipped to [1, -5, 0.5, 5]: loss = -(1 - 5 + 0.5 + 5) / 4 = -0.375
    assert loss.item() == pytest.approx(-0.375)
    assert m["ratio_mean"].item() == 1.0 and m["clipfrac"].item() == 0.0
    assert m["approx_kl"].item() == 0.0 and m["kl"].item() == 0.0


def test_clip_both_sides_by_hand():
    eps = 0.2
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1], dtype=F64)
    adv = torch.tensor([2.0, -1.0, -1.0, 3.0, 1.0], dtype=F64)
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0], dtype=F64)
    lp = (old + torch.log(ratios)).requires_grad_(True)
    loss, m = grpo_loss(lp, old, adv, clip_range=eps)
    # Per sample max(-A r, -A clip(r, 0.8, 1.2)):
    #  0: A=2,  r=1.5: max(-3.0, -2.4) = -2.4   (positive A above 1+eps: clipped, no gradient)
    #  1: A=-1, r=0.5: max( 0.5,  0.8) =  0.8   (negative A below 1-eps: clipped, no gradient)
    #  2: A=-1, r=1.5: max( 1.5,  1.2) =  1.5   (negative A above 1+eps: unclipped branch)
    #  3: A=3,  r=0.5: max(-1.5, -2.4) = -1.5   (positive A below 1-eps: unclipped branch)
    #  4: A=1,  r=1.1: max(-1.1, -1.1) = -1.1   (inside the range)
    # mean = (-2.4 + 0.8 + 1.5 - 1.5 - 1.1) / 5 = -0.54
    assert loss.item() == pytest.approx(-0.54)
    assert m["policy_loss"].item() == pytest.approx(-0.54)
    assert m["clipfrac"].item() == pytest.approx(4 / 5)
    assert m["clipfrac_low"].item() == pytest.approx(2 / 5) and m["clipfrac_high"].item() == pytest.approx(2 / 5)
    assert m["ratio_mean"].item() == pytest.approx(5.1 / 5) and m["ratio_max"].item() == pytest.approx(1.5)
    assert m["approx_kl"].item() == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2
                                                         + math.log(1.1) ** 2) / 5)
    loss.backward()
    # d/dlp of -A r / N = -A r / N on unclipped samples, 0 on clipped ones.
    expected = torch.tensor([0.0, 0.0, 1.5 / 5, -1.5 / 5, -1.1 / 5], dtype=F64)
    torch.testing.assert_close(lp.grad, expected)


def test_asymmetric_high_clip():
    old = torch.zeros(2, dtype=F64)
    lp = torch.log(torch.tensor([1.25, 1.25], dtype=F64))
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    loss, m = grpo_loss(lp, old, adv, clip_range=0.2)
    assert loss.item() == pytest.approx(-1.2) and m["clipfrac"].item() == 1.0
    # clip_range_high 0.28 (DAPO-style clip-higher): r = 1.25 is inside, loss = -1.25.
    loss, m = grpo_loss(lp, old, adv, clip_range=0.2, clip_range_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["clipfrac"].item() == 0.0
    # The low side still uses clip_range: r = 0.75 with negative A is clipped to 0.8.
    lp = torch.log(torch.tensor([0.75], dtype=F64))
    loss, m = grpo_loss(lp, old[:1], -adv[:1], clip_range=0.2, clip_range_high=0.28)
    assert loss.item() == pytest.approx(0.8) and m["clipfrac_low"].item() == 1.0


def test_gaussian_kl():
    mean = torch.randn(3, 2, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    std = torch.tensor([0.5, 1.0, 2.0], dtype=F64).view(3, 1, 1)
    assert torch.all(kl_penalty(torch.zeros(3), KLInputs(mean, mean.clone(), std), "gaussian") == 0)
    ref_mean = mean + torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [0.0, 0.0]]],
                                   dtype=F64)
    kl = kl_penalty(torch.zeros(3), KLInputs(mean, ref_mean, std), "gaussian")
    # Sample 0: one diff of 1 over 4 dims, std .5: (1/(2*.25))/4 = 0.5; sample 1: 1/(2*1) = 0.5;
    # sample 2: two diffs of 2 over 4 dims, std 2: (2 * 4/(2*4))/4 = 0.25.
    torch.testing.assert_close(kl, torch.tensor([0.5, 0.5, 0.25], dtype=F64))

    lp = torch.zeros(3, dtype=F64)
    mean_g = mean.clone().requires_grad_(True)
    adv = torch.zeros(3, dtype=F64)
    loss, m = grpo_loss(lp, lp, adv, 0.1, ref=KLInputs(mean_g, ref_mean, std), beta=0.1, kl_type="gaussian")
    # kl = mean(0.5, 0.5, 0.25) = 1.25 / 3; the policy term is 0 (A = 0).
    assert m["kl"].item() == pytest.approx(1.25 / 3) and loss.item() == pytest.approx(0.1 * 1.25 / 3)
    loss.backward()
    # d(0.1 * mean_i kl_i)/d mean = 0.1/3 * (mean - ref) / (std^2 * 4)
    torch.testing.assert_close(mean_g.grad, 0.1 / 3 * (mean - ref_mean) / (std ** 2 * 4))


def test_k3_kl():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64, requires_grad=True)
    ref_lp = torch.tensor([-1.0, -1.5, -1.5], dtype=F64)
    kl = kl_penalty(lp, KLInputs(ref_log_prob=ref_lp), "k3")
    d = torch.tensor([0.0, 0.5, -1.0], dtype=F64)  # ref - lp
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    assert kl[0].item() == 0.0 and torch.all(kl[1:] > 0)
    loss, m = grpo_loss(lp, lp.detach(), torch.zeros(3, dtype=F64), 0.2, ref=KLInputs(ref_log_prob=ref_lp),
                        beta=0.5, kl_type="k3")
    assert loss.item() == pytest.approx(0.5 * kl.mean().item())
    with pytest.raises(ValueError):
        grpo_loss(lp, lp.detach(), torch.zeros(3), 0.2, ref=KLInputs(), beta=0.5, kl_type="k3")


def test_beta_zero_needs_no_ref_and_grads_only_through_log_prob():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.1, -1.9], requires_grad=True)
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    loss, m = grpo_loss(lp, old, adv, clip_range=0.2, ref=None, beta=0.0)
    loss.backward()
    assert lp.grad is not None and torch.all(lp.grad != 0)
    assert old.grad is None and adv.grad is None
    assert m["kl"].item() == 0.0 and not any(v.requires_grad for v in m.values())
    with pytest.raises(ValueError, match="beta > 0"):
        grpo_loss(lp, old, adv, clip_range=0.2, beta=0.1)

"""train_epoch_forward (train.objective raft / nft) on a tiny in-memory model: the rows it trains (each sample at
exactly steps_per_sample noise levels), and DiffusionNFT's soft-updated sampling policy (train.nft_old_decay):
v_old comes from theta_old, and theta_old <- d*theta_old + (1-d)*theta after the epoch, checked value by value."""
import contextlib
import types

import ml_collections
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from ddpo_grpo.core.reference import EMAReference
from ddpo_grpo.trainer.epoch import training_forward
from ddpo_grpo.trainer.epoch.advantages import EpochAdvantages
from ddpo_grpo.trainer.run.build import RunContext, RunState
from ddpo_grpo.trainer.epoch.sampling import EpochSamples
from ddpo_grpo.trainer.epoch.update import steps_per_sample

from helpers import ddim_scheduler, tiny_unet

N, T = 8, 4


def make_ctx(objective="nft", fraction=1.0, old_decay=0.0, noise=(0.0, 1.0)):
    cfg = ml_collections.ConfigDict(dict(
        seed=0, sample=dict(num_steps=T), eval=dict(batch_size=5),
        train=dict(objective=objective, batch_size=4, timestep_fraction=fraction, min_step_std=0.0,
                   num_inner_epochs=1, gradient_accumulation_steps=1, max_grad_norm=1.0, nft_beta=1.0,
                   nft_adv_scale=1.0, nft_old_decay=old_decay, forward_noise_min=noise[0],
                   forward_noise_max=noise[1]),
    ))
    unet = tiny_unet()
    unet.requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    old = EMAReference(unet, alpha=old_decay, update_freq=1) if old_decay > 0 else None
    ctx = RunContext(cfg, Accelerator(cpu=True), types.SimpleNamespace(scheduler=ddim_scheduler(), family="ddim", vae=None),
                     unet, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                     types.SimpleNamespace(eps=1e-6), None, None, None, None, None, None, None, "", RunState(),
                     old_policy=old)
    return ctx


def make_samples():
    g = torch.Generator().manual_seed(0)
    # Sample n's prompt embedding is the constant n, so a training row can be traced back to its sample.
    emb = torch.arange(N, dtype=torch.float32).view(N, 1, 1).expand(N, 5, 8).clone()
    latents = torch.randn(N, T + 1, 3, 8, 8, generator=g)
    samples = EpochSamples(latents, torch.zeros(N, T), None, None, emb, None, None, torch.arange(N) // 4,
                           [""] * N, [{}] * N)
    adv = np.array([1.0, -1.0, 0.5, -0.5] * 2)
    rewards = np.array([1.0, 0.0, 0.75, 0.25] * 2)
    epoch_adv = EpochAdvantages(torch.from_numpy(adv), torch.ones(N, dtype=torch.bool), np.arange(N) // 4, rewards,
                                adv, np.ones(N, dtype=bool), 0, 0)
    return samples, epoch_adv


@pytest.mark.parametrize("objective", ["nft", "raft"])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.1])
def test_every_sample_trains_at_exactly_steps_per_sample_levels(monkeypatch, objective, fraction):
    assert [steps_per_sample(4, types.SimpleNamespace(train=types.SimpleNamespace(timestep_fraction=f)))
            for f in (1.0, 0.5, 0.1, 0.7)] == [4, 2, 1, 3]
    ctx = make_ctx(objective, fraction)
    samples, adv = make_samples()
    seen = []
    real = training_forward.denoiser_output

    def spy(unet, xt, t, embeds, *args):
        if torch.is_grad_enabled():  # training rows (the v_old pass runs without grad)
            seen.extend(embeds[:, 0, 0].round().long().tolist())
        return real(unet, xt, t, embeds, *args)

    monkeypatch.setattr(training_forward, "denoiser_output", spy)
    training_forward.train_epoch_forward(ctx, samples, adv, epoch=0)
    per_sample = np.bincount(seen, minlength=N)
    assert per_sample.tolist() == [steps_per_sample(T, ctx.config)] * N


@pytest.mark.parametrize("noise", [(0.0, 1.0), (0.6, 1.0), (0.2, 0.5)])
def test_rows_are_noised_within_the_forward_noise_range(monkeypatch, noise):
    ctx = make_ctx("nft", 1.0, noise=noise)
    samples, adv = make_samples()
    timesteps = []
    real = training_forward.denoiser_output

    def spy(unet, xt, t, *args):
        timesteps.append(t.detach().clone())
        return real(unet, xt, t, *args)

    monkeypatch.setattr(training_forward, "denoiser_output", spy)
    training_forward.train_epoch_forward(ctx, samples, adv, epoch=0)
    t = torch.cat(timesteps).float()  # DDIM: t = floor(u * 1000)
    assert len(t) == 2 * N * T  # v_old pass and training pass
    assert t.min() >= 1000 * noise[0] and t.max() < 1000 * noise[1]
    assert t.max() - t.min() > 0.5 * 1000 * (noise[1] - noise[0])  # spread over the range, not one level


def test_nft_soft_update_uses_theta_old_for_v_old_and_mixes_it_after_the_epoch(monkeypatch):
    d = 0.75
    ctx = make_ctx("nft", 1.0, old_decay=d)
    # theta_old differs from theta from the start here, so that using the wrong one would show.
    with torch.no_grad():
        for t in ctx.old_policy.tensors.values():
            t.add_(0.01 * torch.randn_like(t))
    theta_old = {n: t.clone() for n, t in ctx.old_policy.tensors.items()}
    theta_old_net = tiny_unet()
    theta_old_net.load_state_dict(theta_old)
    theta_before = {n: p.detach().clone() for n, p in ctx.unet.named_parameters()}
    samples, adv = make_samples()
    captured = {}
    real_old = training_forward._old_predictions

    def spy_old(ctx_, samples_, x0, rows, u, noise):
        out = real_old(ctx_, samples_, x0, rows, u, noise)
        captured.update(out=out, x0=x0, rows=rows, u=u, noise=noise)
        return out

    monkeypatch.setattr(training_forward, "_old_predictions", spy_old)
    training_forward.train_epoch_forward(ctx, samples, adv, epoch=0)
    # v_old: theta_old's outputs on the same rows.
    from ddpo_grpo.core.policy_step import denoiser_output
    from ddpo_grpo.core.families import get_family

    i = torch.from_numpy(captured["rows"])
    xt, t, _ = get_family("ddim").noised_and_target(ctx.pipe.scheduler, captured["x0"][i], captured["noise"],
                                                    captured["u"])
    with torch.no_grad():
        want = denoiser_output(theta_old_net.eval(), xt, t, samples.embeds[i], None, 1.0, None)
    torch.testing.assert_close(captured["out"], want, rtol=1e-5, atol=1e-6)
    # The policy was updated, and theta_old is now d * theta_old + (1 - d) * theta_after, exactly.
    after = dict(ctx.unet.named_parameters())
    assert any(not torch.equal(after[n], theta_before[n]) for n in theta_before)
    for n, t_old in ctx.old_policy.tensors.items():
        torch.testing.assert_close(t_old, d * theta_old[n] + (1 - d) * after[n].detach(), rtol=0, atol=1e-7)
    # Inside sampling_policy() the network holds theta_old; outside, the trained theta again.
    trained = {n: p.detach().clone() for n, p in after.items()}
    with ctx.sampling_policy():
        assert not torch.is_grad_enabled()
        inside = {n: p.detach().clone() for n, p in ctx.unet.named_parameters()}
    for n in theta_old:
        torch.testing.assert_close(inside[n], d * theta_old[n] + (1 - d) * trained[n], rtol=0, atol=1e-7)
    assert all(torch.equal(p, trained[n]) for n, p in ctx.unet.named_parameters())  # restored bit-exactly


def test_on_policy_nft_has_no_sampling_copy():
    ctx = make_ctx("nft", 1.0, old_decay=0.0)
    assert ctx.old_policy is None and isinstance(ctx.sampling_policy(), contextlib.nullcontext)

"""train.step_weight_power: the per-step loss weights (update.step_weights) by hand, and through train_epoch on the
row-count context (tests/rowcount.py), each trained transition weighted once."""
import types

import ml_collections
import pytest
import torch

from ddpo_grpo.trainer.epoch.training import train_epoch

from rowcount import N, T, make_ctx, make_samples


def test_step_weights_are_std_to_the_power_normalised_over_the_trained_steps():
    """update.step_weights by hand: std (0.5, 0.25, 0, 1) with steps 0, 1, 3 trained, p = 2: std^2 = (0.25, 0.0625,
    -, 1), mean 0.4375 over the trained steps; p = 1 likewise; an untrained step weighs 0; p = 0 or no stds: None."""
    from ddpo_grpo.trainer.epoch.update import step_weights

    samples = types.SimpleNamespace(step_std=torch.tensor([0.5, 0.25, 0.0, 1.0]))
    cfg = ml_collections.ConfigDict(dict(train=dict(step_weight_power=2.0)))
    w = step_weights(samples, cfg, torch.tensor([0, 1, 3]))
    assert w.tolist() == pytest.approx([0.25 / 0.4375, 0.0625 / 0.4375, 0.0, 1.0 / 0.4375], rel=1e-6)
    cfg.train.step_weight_power = 1.0  # std: (0.5, 0.25, -, 1), mean 7/12
    assert step_weights(samples, cfg, torch.tensor([0, 1, 3])).tolist() == pytest.approx(
        [6 / 7, 3 / 7, 0.0, 12 / 7], rel=1e-6)
    cfg.train.step_weight_power = 0.0
    assert step_weights(samples, cfg, torch.tensor([0, 1, 3])) is None
    cfg.train.step_weight_power = 2.0
    assert step_weights(types.SimpleNamespace(step_std=None), cfg, torch.tensor([0])) is None


def test_step_weights_reach_every_trained_transition_once(monkeypatch):
    """train.step_weight_power through train_epoch: the loss of every call gets each row's step factor, so over an
    epoch (timestep_fraction 1: every sample at every trained step once) the weights the loss saw are exactly
    step_weights' values, each N times. Fails if the factors are not passed, or reach the wrong rows' count."""
    import ddpo_grpo.trainer.epoch.training as training
    from ddpo_grpo.trainer.epoch.update import step_weights

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["weights"].detach().clone())
        return real(*args, **kwargs)

    real = training.grpo_loss
    monkeypatch.setattr(training, "grpo_loss", spy)
    ctx = make_ctx("flow", old_logprobs="rescore", fault=0.0)
    ctx.config.train.step_weight_power = 2.0
    ctx.config.train.min_step_std = 0.0
    samples, adv = make_samples(ctx)
    samples.step_std = torch.tensor([0.7, 0.6, 0.5, 0.4])
    expect = step_weights(samples, ctx.config, torch.arange(T))
    m = train_epoch(ctx, samples, adv, epoch=0)
    got = torch.cat(seen)
    assert got.numel() == N * T and m["onpolicy_ratio_max_dev"] == 0.0
    for t in range(T):
        assert int(torch.isclose(got, expect[t]).sum()) == N, t
    assert expect.mean().item() == pytest.approx(1.0) and not torch.allclose(expect, torch.ones(T))

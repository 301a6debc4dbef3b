"""train.old_logprobs: the ratio's old log-probs re-scored through the training calls (on-policy by construction),
against the sampler's. The fault is the GPU's: a denoiser whose output depends on how many rows a call has (kernels
chosen per batch shape). With the sampler's log-probs such a model stops at epoch 0; re-scored, |r - 1| is exactly 0
(the same calls, the same arithmetic), clipfrac 0 at lr 0, and the sampler gap is reported. DDIM, the flow SDE and
branched trajectories."""
import types

import ml_collections
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from ddpo_grpo.core.branching import BranchSpec
from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings
from ddpo_grpo.errors import ConfigError, VerificationError
from ddpo_grpo.trainer.epoch.advantages import EpochAdvantages
from ddpo_grpo.trainer.run.build import RunState, lr_factor
from ddpo_grpo.trainer.epoch.rescoring import (check_old_logprobs_config, old_logprobs_source, sampler_gap,
                                         truncated_is_weight)
from ddpo_grpo.trainer.epoch.sampling import EpochSamples
from ddpo_grpo.trainer.epoch.training import train_epoch

from helpers import ddim_scheduler, flow_scheduler, tiny_unet

N, T = 8, 4
SHIFT_PER_ROW = 2e-3  # the row-count fault: output + SHIFT_PER_ROW * rows of the call


class RowCountDenoiser(torch.nn.Module):
    """The tiny UNet plus SHIFT_PER_ROW x (rows in this call): scored in the sampler's batch (8 samples, CFG: 16 rows)
    and in a training call of 4 (8 rows), one transition gets two log-probs, as per-shape GPU kernels give it."""

    def __init__(self, fault: float = SHIFT_PER_ROW):
        super().__init__()
        self.inner, self.fault = tiny_unet(), fault

    def forward(self, x, t, encoder_hidden_states=None):
        out = self.inner(x, t, encoder_hidden_states=encoder_hidden_states).sample
        return types.SimpleNamespace(sample=out + self.fault * x.shape[0])


def make_ctx(family="ddim", old_logprobs="rescore", lr=0.0, inner=1, fault=SHIFT_PER_ROW, cap=0.0):
    cfg = ml_collections.ConfigDict(dict(
        seed=0,
        sample=dict(guidance_scale=2.0, eta=1.0, noise_level=0.7, sde_type="sde"),
        train=dict(cfg=True, onpolicy_check="stop", old_logprobs=old_logprobs, sampler_is_cap=cap, batch_size=4,
                   timestep_fraction=1.0, timesteps_per_call=1, num_inner_epochs=inner, gradient_accumulation_steps=1,
                   max_grad_norm=1.0, clip_range=1e-3, clip_range_high=-1.0, adv_clip_max=5.0, beta=0.0,
                   kl_type="gaussian"),
    ))
    unet = RowCountDenoiser(fault)
    unet.requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=lr)
    state = RunState()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("constant", 0, 1, state))
    pipe = types.SimpleNamespace(scheduler=ddim_scheduler() if family == "ddim" else flow_scheduler(), family=family)
    return types.SimpleNamespace(config=cfg, accelerator=Accelerator(cpu=True), unet=unet, optimizer=opt,
                                 lr_scheduler=sched, reference=None, supervised=None, state=state, pipe=pipe, tree=None)


def make_samples(ctx, branch=None):
    g = torch.Generator().manual_seed(0)
    emb, neg = torch.randn(N, 5, 8, generator=g), torch.randn(N, 5, 8, generator=g)
    settings = SamplerSettings(family=ctx.pipe.family, guidance_scale=2.0)
    with torch.no_grad():
        traj = pipeline_with_logprob(ctx.unet, ctx.pipe.scheduler, settings, emb, neg, num_inference_steps=T,
                                     sample_shape=(3, 8, 8), generator=g, branch=branch)
    samples = EpochSamples(traj.latents, traj.log_probs, traj.timesteps, traj.step_indices, emb, neg, traj.images,
                           torch.arange(N) // 4, [""] * N, [{}] * N, transitions=traj.transitions)
    if branch is None:
        adv = EpochAdvantages(torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), torch.ones(N, dtype=torch.bool),
                              None, None, None, None, 0, 0)
    else:  # one advantage per owner cell (every cell of a tree's structure trained once)
        cells = torch.from_numpy(branch.owner_cells(N))
        a = torch.linspace(-1, 1, cells.numel()).reshape(cells.shape) * cells
        adv = EpochAdvantages(a, torch.ones(N, dtype=torch.bool), None, None, None, None, 0, 0, cell_mask=cells)
    return samples, adv


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_row_count_fault_stops_with_the_sampler_logprobs(family):
    """The control: with the sampler's log-probs the per-shape fault is seen by the on-policy check, which stops the
    epoch before any update (so the rescore test below could fail)."""
    ctx = make_ctx(family, old_logprobs="sampling")
    samples, adv = make_samples(ctx)
    with pytest.raises(VerificationError, match="on-policy check failed in epoch 0 before any update"):
        train_epoch(ctx, samples, adv, epoch=0)
    assert ctx.state.global_step == 0


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_rescore_is_exactly_on_policy_and_reports_the_gap(family):
    """Re-scored through the training calls: |r - 1| == 0 exactly (the same calls and arithmetic), no sample clipped at
    lr 0 in either inner epoch (each re-scored with its own row grouping), and the sampler gap reported per column."""
    ctx = make_ctx(family, old_logprobs="rescore", inner=2)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["onpolicy_ratio_max_dev"] == 0.0
    assert m["clipfrac"] == 0.0 and m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
    assert m["old_logprobs_rescored"] == 1.0 and ctx.state.global_step == 4  # 2 inner epochs x 2 steps, all taken
    # the gap: the fault moves the mean by SHIFT_PER_ROW x 8 rows between the two call shapes, so it is well above
    # float32's rounding, and every trained column has its own entry
    assert m["sampler_gap_max"] > 1e-4 and 0 < m["sampler_gap_mean"] <= m["sampler_gap_max"]
    cols = [k for k in m if k.startswith("sampler_gap_max/step_")]
    assert len(cols) >= 1 and max(m[k] for k in cols) == m["sampler_gap_max"]


def test_rescore_gap_is_the_difference_of_the_two_scorings():
    """sampler_gap is |logp_rescored - logp_sampler| per column over the kept cells: a hand example."""
    rescored = torch.tensor([[0.0, 1.0, float("nan")], [0.5, -1.0, 2.0]])
    sampler = torch.tensor([[0.25, 1.0, 7.0], [0.0, 0.0, 1.5]])
    mx, total, count = sampler_gap(rescored, sampler)
    assert mx.tolist() == [0.5, 1.0, 0.5] and total.tolist() == [0.75, 1.0, 0.5] and count.tolist() == [2, 2, 1]
    mx, total, count = sampler_gap(rescored, sampler, torch.tensor([True, False]))  # sample 1 excluded
    assert mx.tolist() == [0.25, 0.0, -1.0] and count.tolist() == [1, 1, 0]


def test_rescore_without_the_fault_has_a_float_rounding_gap_only():
    """Without the fault the gap is float32's summation order (rows computed in another batch), well below the fault's."""
    ctx = make_ctx("ddim", old_logprobs="rescore", fault=0.0)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["onpolicy_ratio_max_dev"] == 0.0 and m["sampler_gap_max"] < 1e-5


def test_branched_trajectories_rescore_exactly_and_sampler_stops():
    spec = BranchSpec((0, 2), 2)  # 2 trees of 4 leaves
    for mode in ("sampling", "rescore"):
        ctx = make_ctx("ddim", old_logprobs=mode)
        ctx.tree = spec
        samples, adv = make_samples(ctx, branch=spec)
        if mode == "sampling":
            with pytest.raises(VerificationError, match="on-policy check failed in epoch 0"):
                train_epoch(ctx, samples, adv, epoch=0)
            continue
        m = train_epoch(ctx, samples, adv, epoch=0)
        assert m["onpolicy_ratio_max_dev"] == 0.0 and m["clipfrac"] == 0.0 and m["sampler_gap_max"] > 1e-4


def test_sampler_is_weight_is_the_truncated_ratio_and_reweighs_the_loss():
    rescored = torch.tensor([0.0, 0.1, -0.2, 3.0])
    sampler = torch.tensor([0.0, 0.0, 0.0, 0.0])
    w = truncated_is_weight(rescored, sampler, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, np.exp(0.1), np.exp(-0.2), 2.0], dtype=torch.float32))
    ctx = make_ctx("ddim", old_logprobs="rescore", cap=2.0)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["onpolicy_ratio_max_dev"] == 0.0 and abs(m["sampler_is_weight"] - 1.0) > 1e-5  # the fault moves it off 1


def test_auto_resolves_by_precision_and_device_and_bad_values_are_one_line():
    cfg = make_ctx(old_logprobs="auto").config
    assert old_logprobs_source(cfg, reduced_precision=False, accelerator_device=False) == "sampling"
    assert old_logprobs_source(cfg, reduced_precision=True, accelerator_device=False) == "rescore"
    assert old_logprobs_source(cfg, reduced_precision=False, accelerator_device=True) == "rescore"
    cfg.train.sampler_is_cap = 2.0  # the cap needs the re-scored values
    assert old_logprobs_source(cfg, reduced_precision=False, accelerator_device=False) == "rescore"
    cfg.train.old_logprobs = "sampling"
    with pytest.raises(ConfigError, match="sampler_is_cap > 0 .* needs the re-scored"):
        check_old_logprobs_config(cfg)
    cfg.train.old_logprobs = "rescored"
    with pytest.raises(ConfigError, match=r"train.old_logprobs='rescored'; choose one of \('auto', 'rescore', 'sampling'\)"):
        check_old_logprobs_config(cfg)


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

"""train.old_logprobs: the ratio's old log-probs re-scored through the training calls (on-policy by construction),
against the sampler's. The fault is the GPU's: a denoiser whose output depends on how many rows a call has (kernels
chosen per batch shape), run under the GPU's bf16 tolerances (the `gpu_regime` fixture: the fault is rounding there,
not a mismatch). With the sampler's log-probs such a model stops at epoch 0; re-scored, |r - 1| is exactly 0
(the same calls, the same arithmetic), clipfrac 0 at lr 0, and the sampler gap is reported. DDIM, the flow SDE and
branched trajectories. "auto": a sampler calling the denoiser in the training calls' shape is bit-exact and re-scored
in its first epoch only; the fault without it every epoch. A real sampler/trainer mismatch stops the run naming it."""
import json
import os
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pytest
import torch

from ddpo_grpo.core.branching import BranchSpec
from ddpo_grpo.core.policy_step import SamplerSettings
from ddpo_grpo.errors import ConfigError, VerificationError
from ddpo_grpo.trainer.epoch.rescoring import (check_old_logprobs_config, old_logprobs_counts, old_logprobs_source,
                                               sampler_gap, settings_mismatch, truncated_is_weight, worst_gap)
from ddpo_grpo.trainer.epoch.sampling import TrainingCallShape, active_dropout, sampler_call_rows
from ddpo_grpo.trainer.epoch.training import train_epoch

from helpers import cpu_env, tiny_unet
from rowcount import make_ctx, make_samples  # the row-count fault's context (SHIFT_PER_ROW: why its size)


@pytest.fixture
def gpu_regime(monkeypatch):
    """The run computes in bf16 (the tolerances a GPU run gets), while the arithmetic stays the CPU's float32."""
    import ddpo_grpo.trainer.checks.onpolicy as onpolicy

    monkeypatch.setattr(onpolicy, "run_precision", lambda acc: (torch.bfloat16, False))


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_row_count_fault_stops_with_the_sampler_logprobs(family, gpu_regime):
    """The control: with the sampler's log-probs the per-shape fault is seen by the on-policy check, which stops the
    epoch before any update (so the rescore test below could fail)."""
    ctx = make_ctx(family, old_logprobs="sampling")
    samples, adv = make_samples(ctx)
    with pytest.raises(VerificationError, match="on-policy check failed in epoch 0 before any update"):
        train_epoch(ctx, samples, adv, epoch=0)
    assert ctx.state.global_step == 0


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_rescore_is_exactly_on_policy_and_reports_the_gap(family, gpu_regime):
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
    assert m["sampler_gap_max"] > 5e-5 and 0 < m["sampler_gap_mean"] <= m["sampler_gap_max"]
    assert m["old_logprobs_bit_exact"] == 0.0
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


def test_branched_trajectories_rescore_exactly_and_sampler_stops(gpu_regime):
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
        assert m["onpolicy_ratio_max_dev"] == 0.0 and m["clipfrac"] == 0.0 and m["sampler_gap_max"] > 5e-5


def test_sampler_is_weight_is_the_truncated_ratio_and_reweighs_the_loss(gpu_regime):
    rescored = torch.tensor([0.0, 0.1, -0.2, 3.0])
    sampler = torch.tensor([0.0, 0.0, 0.0, 0.0])
    w = truncated_is_weight(rescored, sampler, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, np.exp(0.1), np.exp(-0.2), 2.0], dtype=torch.float32))
    ctx = make_ctx("ddim", old_logprobs="rescore", cap=2.0)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["onpolicy_ratio_max_dev"] == 0.0 and abs(m["sampler_is_weight"] - 1.0) > 1e-5  # the fault moves it off 1


def test_auto_decides_from_the_runs_verifications_and_bad_values_are_one_line():
    """"auto" by hand: no verification yet -> re-score; every verification bit-exact -> the sampler's until
    old_logprobs_verify_every epochs have passed since the last; one that differed -> re-score for good; a settings
    mismatch or the IS cap -> re-score. "rescore" / "sampling" are what they say, whatever the history."""
    cfg = make_ctx(old_logprobs="auto", verify_every=3).config
    exact = lambda e, v=1.0: {"epoch": e, "train": {"old_logprobs_bit_exact": v, "old_logprobs_rescored": 1.0}}  # noqa
    plain = lambda e: {"epoch": e, "train": {"old_logprobs_rescored": 0.0}}  # noqa: E731
    assert old_logprobs_source(cfg, 0, []) == "rescore"
    assert [old_logprobs_source(cfg, e, [exact(0), plain(1), plain(2)][:e]) for e in (1, 2, 3)] == \
        ["sampling", "sampling", "rescore"]  # verified at 0, again at 0 + 3
    assert old_logprobs_source(cfg, 4, [exact(0), plain(1), plain(2), exact(3)]) == "sampling"
    assert old_logprobs_source(cfg, 5, [exact(0), plain(1), exact(2, 0.0), exact(3), plain(4)]) == "rescore"
    assert old_logprobs_source(cfg, 1, [exact(0)], mismatch=True) == "rescore"
    cfg.train.old_logprobs_verify_every = 0  # the first verification only
    assert old_logprobs_source(cfg, 99, [exact(0)]) == "sampling"
    for mode in ("rescore", "sampling"):
        cfg.train.old_logprobs = mode
        assert old_logprobs_source(cfg, 0, []) == old_logprobs_source(cfg, 5, [exact(0)]) == mode
    cfg.train.old_logprobs = "auto"
    cfg.train.sampler_is_cap = 2.0  # the cap needs the re-scored values
    assert old_logprobs_source(cfg, 1, [exact(0)]) == "rescore"
    assert old_logprobs_counts([exact(0), plain(1), plain(2)], False) == {
        "old_logprobs_rescored_epochs": 1.0, "old_logprobs_sampler_epochs": 3.0}
    cfg.train.old_logprobs = "sampling"
    with pytest.raises(ConfigError, match="sampler_is_cap > 0 .* needs the re-scored"):
        check_old_logprobs_config(cfg)
    cfg.train.old_logprobs = "rescored"
    with pytest.raises(ConfigError, match=r"train.old_logprobs='rescored'; choose one of \('auto', 'rescore', 'sampling'\)"):
        check_old_logprobs_config(cfg)
    cfg.train.old_logprobs, cfg.train.sampler_is_cap = "auto", 0.0
    for bad in (-1, -5):  # (ConfigDict itself refuses a float for this int field)
        cfg.train.old_logprobs_verify_every = bad
        with pytest.raises(ConfigError, match="train.old_logprobs_verify_every=.* must be an integer >= 0"):
            check_old_logprobs_config(cfg)


def run_epochs(ctx, epochs, call_rows=0, **kw):
    """train_epoch over `epochs` epochs, each on fresh samples of the current weights, its metrics appended to the
    run history as log_epoch appends them (what summary.json holds). Returns the last epoch's metrics."""
    for epoch in range(epochs):
        samples, adv = make_samples(ctx, call_rows=call_rows, seed=epoch, **kw)
        m = train_epoch(ctx, samples, adv, epoch=epoch)
        ctx.state.history.append({"epoch": epoch, "train": dict(m)})
    return m


def test_auto_rescores_a_bit_exact_sampler_once_and_the_row_fault_every_epoch(gpu_regime):
    """The issue's done-when, in process (the 3-epoch run through scripts/train.py is the last test). The row-count
    fault's denoiser (flow) sampled in the training calls' shape (4 samples per call, [uncond; cond] as training lays
    them out): the sampler's log-probs are the training calls' bit for bit, so "auto" re-scores epoch 0, finds them
    equal and trains on the sampler's in epoch 1 (ratio exactly 1 before each first update at lr > 0). Sampled in one
    call of 8 (the per-shape fault; DDIM): both epochs re-scored, each with |r - 1| == 0. (The re-verification
    cadence is tested by hand above.)"""
    ctx = make_ctx("flow", old_logprobs="auto", lr=1e-4)
    m = run_epochs(ctx, 2, call_rows=4)
    assert [h["train"]["old_logprobs_rescored"] for h in ctx.state.history] == [1.0, 0.0]
    assert ctx.state.history[0]["train"]["old_logprobs_bit_exact"] == 1.0
    assert ctx.state.history[0]["train"]["sampler_gap_max"] == 0.0
    assert (m["old_logprobs_rescored_epochs"], m["old_logprobs_sampler_epochs"]) == (1.0, 1.0)
    assert all(h["train"]["onpolicy_ratio_max_dev"] == 0.0 for h in ctx.state.history)
    assert ctx.state.global_step == 4  # 2 epochs x 2 steps: every epoch trained
    ctx = make_ctx("ddim", old_logprobs="auto", lr=1e-4)
    m = run_epochs(ctx, 2, call_rows=0)
    assert [h["train"]["old_logprobs_rescored"] for h in ctx.state.history] == [1.0, 1.0]
    assert [h["train"]["old_logprobs_bit_exact"] for h in ctx.state.history] == [0.0, 0.0]
    assert (m["old_logprobs_rescored_epochs"], m["old_logprobs_sampler_epochs"]) == (2.0, 0.0)
    assert all(h["train"]["onpolicy_ratio_max_dev"] == 0.0 for h in ctx.state.history)


@pytest.mark.parametrize("mode", ["auto", "rescore"])
def test_cfg_mismatch_stops_a_rescored_run_naming_it(mode):
    """Sampled with CFG 2, trained without it (train.cfg=False): re-scored, the ratio would be 1 and the run would
    train on another policy's samples (the issue: ratio 1, sampler gap 0.045). The sampler/trainer check stops it
    before any update, in one line naming the training call's difference and the gap as |r - 1|."""
    ctx = make_ctx("ddim", old_logprobs=mode, cfg=False, fault=0.0)
    samples, adv = make_samples(ctx)
    before = [p.detach().clone() for p in ctx.unet.parameters()]
    with pytest.raises(VerificationError) as e:
        train_epoch(ctx, samples, adv, epoch=0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("on-policy check failed in epoch 0 before any update: |r - 1| = ")
    assert ("Cause: the training call differs from the sampling call: guidance_scale 2.0 when sampling, 1.0 in "
            "training (train.cfg=False)") in msg and "sampler-gap tolerance 1.0e-05" in msg
    assert float(msg.split("|r - 1| = ")[1].split()[0]) > 1e-3
    assert ctx.state.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, ctx.unet.parameters()))


def test_cfg_mismatch_with_warn_trains_on_the_sampler_logprobs_under_auto(capsys):
    """"warn": one warning line, then "auto" trains on the sampler's log-probs, so the ratio shows the mismatch
    instead of a re-score hiding it; "rescore" keeps the re-scored ones it was asked for (ratio 1)."""
    from ddpo_grpo.core.loss import onpolicy_tolerance

    for mode, dev in (("auto", "above"), ("rescore", "zero")):
        ctx = make_ctx("ddim", old_logprobs=mode, cfg=False, fault=0.0, onpolicy_check="warn")
        samples, adv = make_samples(ctx)
        m = train_epoch(ctx, samples, adv, epoch=0)
        out = capsys.readouterr().out
        assert out.count("warning: on-policy check failed in epoch 0") == 1, out
        assert ctx.state.global_step == 2 and m["old_logprobs_rescored"] == 1.0 and m["old_logprobs_bit_exact"] == 0.0
        if dev == "zero":
            assert m["onpolicy_ratio_max_dev"] == 0.0
        else:
            assert m["onpolicy_ratio_max_dev"] > onpolicy_tolerance(torch.float32, 1e-4)


def test_a_mismatch_the_settings_do_not_show_is_caught_by_the_measured_gap():
    """The training call uses other prompt embeddings than the sampler did (a condition other than the one sampled
    with): equal settings, so only the measured gap can see it; above the float32 tolerance it stops, naming the
    likely causes."""
    ctx = make_ctx("flow", old_logprobs="rescore", fault=0.0)
    samples, adv = make_samples(ctx)
    samples.embeds = samples.embeds + 0.5 * torch.randn(samples.embeds.shape, generator=torch.Generator().manual_seed(3))
    with pytest.raises(VerificationError, match=r"sampler-gap tolerance 1.0e-05 .*Likely causes: .*a condition "
                                                r"\(prompt embedding"):
        train_epoch(ctx, samples, adv, epoch=0)


def test_worst_gap_and_settings_mismatch_by_hand():
    rescored = [torch.tensor([[0.0, 1.0, float("nan")], [0.5, -1.0, 2.0]])]
    sampler = torch.tensor([[0.25, 1.0, 7.0], [0.0, 0.0, 1.5]])
    dev, i, c = worst_gap(rescored, sampler)
    assert (i, c) == (1, 1) and dev == pytest.approx(np.expm1(1.0))  # |-1 - 0| at sample 1, column 1
    dev, i, c = worst_gap(rescored, sampler, torch.tensor([True, False]))
    assert (dev, i, c) == (pytest.approx(np.expm1(0.25)), 0, 0)
    assert worst_gap([sampler.clone()], sampler)[0] == 0.0  # bit for bit
    a, b = SamplerSettings("flow", 3.0, 1.0, 0.7, "sde"), SamplerSettings("flow", 3.0, 1.0, 0.7, "sde")
    assert settings_mismatch(a, b) == "" and settings_mismatch(None, b) == ""
    b.guidance_scale, b.noise_level = 1.0, 0.5
    assert settings_mismatch(a, b) == ("guidance_scale 3.0 when sampling, 1.0 in training; noise_level 0.7 when "
                                       "sampling, 0.5 in training")


def test_training_call_shape_lays_out_calls_as_training_does():
    """TrainingCallShape on 8 samples x CFG in calls of 4: two calls of [uncond 4; cond 4] of the same samples, and
    the output back in the sampler's layout; a batch it cannot cut runs whole. sampler_call_rows by hand."""
    seen = []

    def unet(x, t, encoder_hidden_states=None):
        seen.append((x[:, 0, 0, 0].tolist(), encoder_hidden_states[:, 0, 0].tolist()))
        return types.SimpleNamespace(sample=x * 2)

    x = torch.arange(16.0).reshape(16, 1, 1, 1)  # rows 0-7 uncond, 8-15 cond of samples 0-7
    ehs = torch.cat([-torch.ones(8, 1, 1), torch.ones(8, 1, 1)])
    out = TrainingCallShape(unet, 4, cfg=True)(x, torch.zeros(16), encoder_hidden_states=ehs)
    assert seen == [([0, 1, 2, 3, 8, 9, 10, 11], [-1] * 4 + [1] * 4), ([4, 5, 6, 7, 12, 13, 14, 15], [-1] * 4 + [1] * 4)]
    assert torch.equal(out.sample, x * 2)
    seen.clear()
    TrainingCallShape(unet, 3, cfg=True)(x, torch.zeros(16), encoder_hidden_states=ehs)
    assert len(seen) == 1  # 8 samples do not cut into calls of 3
    cfg = make_ctx(old_logprobs="auto").config
    cfg.sample = ml_collections.ConfigDict(dict(batch_size=8))
    assert sampler_call_rows(cfg) == 4
    cfg.train.timesteps_per_call = 2  # the training call stacks 2 steps: not the sampler's shape
    assert sampler_call_rows(cfg) == 0 and sampler_call_rows(cfg, branched=True) == 4
    cfg.train.timesteps_per_call = 0  # auto probe: its choice once made
    assert sampler_call_rows(cfg, 0) == 0 and sampler_call_rows(cfg, 1) == 4
    cfg.train.timesteps_per_call, cfg.train.batch_size = 1, 3
    assert sampler_call_rows(cfg) == 0
    cfg.train.batch_size, cfg.train.old_logprobs = 4, "rescore"
    assert sampler_call_rows(cfg) == 0


def test_active_dropout_is_found_and_the_bundled_unet_has_none():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    assert active_dropout(net) == ["1"]
    assert active_dropout(tiny_unet()) == []


def test_sampler_gap_tolerances():
    from ddpo_grpo.core.loss import sampler_gap_tolerance

    assert sampler_gap_tolerance(torch.float32) == 1e-5
    assert sampler_gap_tolerance(torch.float32, accelerator=True) == 1e-4
    assert sampler_gap_tolerance(torch.float32, tf32=True, accelerator=True) == 2e-2
    assert sampler_gap_tolerance(torch.bfloat16) == sampler_gap_tolerance(torch.float16, accelerator=True) == 2e-2


def test_a_cpu_run_whose_sampler_is_bit_exact_rescores_its_first_epoch_only(tmp_path):
    """scripts/train.py on the bundled model, 3 epochs, 8 samples per sampling batch with CFG 3 and 4 per training
    call: the sampler calls the denoiser in train mode in calls of 4 laid out as training's (TrainingCallShape), so
    its log-probs are the training calls' bit for bit; "auto" re-scores epoch 0 and then trains on them, and
    summary.json counts 1 re-scored epoch and 2 on the sampler's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=3",
           f"--config.logdir={tmp_path}", "--config.run_name=auto", "--config.sample.num_steps=3",
           "--config.sample.batch_size=8", "--config.sample.num_batches_per_epoch=1", "--config.sample.k=4",
           "--config.sample.guidance_scale=3.0", "--config.train.batch_size=4", "--config.train.min_step_std=0.0",
           "--config.eval_freq=0", "--config.save_freq=0", "--config.logging.wandb=False",
           "--config.logging.tensorboard=False", "--config.logging.image_freq=0"]
    p = subprocess.run(cmd, cwd=root, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the sampler's log-probs equal the training calls' re-score bit for bit" in p.stdout
    history = json.load(open(os.path.join(tmp_path, "auto", "summary.json")))["history"]
    assert [h["train"]["old_logprobs_rescored"] for h in history] == [1.0, 0.0, 0.0]
    assert history[0]["train"]["old_logprobs_bit_exact"] == 1.0 and history[0]["train"]["sampler_gap_max"] == 0.0
    last = history[-1]["train"]
    assert (last["old_logprobs_rescored_epochs"], last["old_logprobs_sampler_epochs"]) == (1.0, 2.0)
    assert all(h["train"]["onpolicy_ratio_max_dev"] == 0.0 for h in history)

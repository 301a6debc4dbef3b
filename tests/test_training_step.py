"""train_epoch on a tiny in-memory model: on-policy ratio 1 before the first step, KL path with the EMA
reference, and a non-finite loss that is skipped and counted instead of reaching the weights."""
import math
import types

import ml_collections
import pytest
import torch
from accelerate import Accelerator

from ddpo_grpo.trainer.epoch.advantages import EpochAdvantages
from ddpo_grpo.trainer.run.build import RunState, lr_factor
from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings
from ddpo_grpo.core.reference import EMAReference
from ddpo_grpo.trainer.epoch.sampling import EpochSamples
from ddpo_grpo.trainer.epoch.training import train_epoch

from helpers import ddim_scheduler, tiny_unet

N, T = 8, 4


def make_ctx(beta=0.0, per_call=1, lr=1e-4, cfg=True, onpolicy_check="stop"):
    cfg = ml_collections.ConfigDict(dict(
        seed=0,
        sample=dict(guidance_scale=2.0, eta=1.0, noise_level=0.7, sde_type="sde"),
        train=dict(cfg=cfg, onpolicy_check=onpolicy_check, batch_size=4, timestep_fraction=1.0, timesteps_per_call=per_call, num_inner_epochs=1,
                   gradient_accumulation_steps=1, max_grad_norm=1.0, clip_range=1e-3, clip_range_high=-1.0,
                   adv_clip_max=5.0, beta=beta, kl_type="gaussian"),
    ))
    acc = Accelerator(cpu=True)
    unet = tiny_unet()
    unet.requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=lr)
    state = RunState()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("constant", 0, 1, state))  # the trainer's, as built
    ref = EMAReference(unet, alpha=0.5, update_freq=1) if beta > 0 else None
    pipe = types.SimpleNamespace(scheduler=ddim_scheduler(), family="ddim")
    return types.SimpleNamespace(config=cfg, accelerator=acc, unet=unet, optimizer=opt, lr_scheduler=sched,
                                 reference=ref, supervised=None, state=state, pipe=pipe)


def make_samples(ctx):
    g = torch.Generator().manual_seed(0)
    emb, neg = torch.randn(N, 5, 8, generator=g), torch.randn(N, 5, 8, generator=g)
    traj = pipeline_with_logprob(ctx.unet, ctx.pipe.scheduler, SamplerSettings(guidance_scale=2.0), emb, neg,
                                 num_inference_steps=T, sample_shape=(3, 8, 8), generator=g)
    samples = EpochSamples(traj.latents, traj.log_probs, traj.timesteps, traj.step_indices, emb, neg, traj.images,
                           torch.arange(N) // 4, [""] * N, [{}] * N)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    epoch_adv = EpochAdvantages(adv, torch.ones(N, dtype=torch.bool), None, None, None, None, 0, 0)
    return samples, epoch_adv


def test_update_is_on_policy_first_and_moves_weights():
    ctx = make_ctx(per_call=2)
    samples, adv = make_samples(ctx)
    before = [p.detach().clone() for p in ctx.unet.parameters()]
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["onpolicy_ratio_max_dev"] < 1e-6  # same weights, same CFG: exp(logp - logp_old) == 1
    assert ctx.state.global_step == 2  # 8 samples / batch 4 = 2 optimizer steps (accumulating 4 timesteps / 2 per call)
    assert m["nonfinite_loss"] == 0 and m["skipped_steps"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, ctx.unet.parameters()))


def test_cfg_mismatch_stops_before_any_update(capsys):
    """Sampled with CFG 2.0, trained without it (train.cfg=False): the ratio of the first calls is far from 1, and
    the default train.onpolicy_check="stop" ends the epoch in one line before the optimizer moves a weight."""
    from ddpo_grpo.errors import VerificationError

    ctx = make_ctx(per_call=2, cfg=False)
    samples, adv = make_samples(ctx)
    before = [p.detach().clone() for p in ctx.unet.parameters()]
    with pytest.raises(VerificationError) as e:
        train_epoch(ctx, samples, adv, epoch=0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("on-policy check failed in epoch 0 before any update")
    assert "train.cfg=False" in msg and "tolerance 1.0e-05" in msg and "denoising step" in msg and "sample " in msg
    dev = float(msg.split("|r - 1| = ")[1].split()[0])
    assert dev > 1e-3
    assert ctx.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, ctx.unet.parameters()))


def test_cfg_mismatch_warns_and_trains_with_warn(capsys):
    from ddpo_grpo.core.loss import onpolicy_tolerance

    ctx = make_ctx(per_call=2, cfg=False, onpolicy_check="warn")
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    out = capsys.readouterr().out
    assert out.count("warning: on-policy check failed in epoch 0") == 1
    assert m["onpolicy_ratio_max_dev"] > onpolicy_tolerance(torch.float32, 1e-3)
    assert ctx.state.global_step == 2  # it trained on
    ctx = make_ctx(per_call=2, cfg=False, onpolicy_check="off")
    samples, adv = make_samples(ctx)
    train_epoch(ctx, samples, adv, epoch=0)
    assert "on-policy" not in capsys.readouterr().out


def test_onpolicy_check_setting_is_validated():
    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.checks.onpolicy import check_onpolicy_config

    for mode in ("stop", "warn", "off"):
        check_onpolicy_config(make_ctx(onpolicy_check=mode).config)
    with pytest.raises(ConfigError, match=r"train.onpolicy_check='stp'; choose one of \('stop', 'warn', 'off'\)"):
        check_onpolicy_config(make_ctx(onpolicy_check="stp").config)


def test_onpolicy_check_names_the_worst_transition():
    """One stored log-prob corrupted by 0.05 (as a wrong condition for one sample would): the line names that
    sample's step and condition, not the first call's."""
    from ddpo_grpo.errors import VerificationError

    ctx = make_ctx(per_call=2)
    samples, adv = make_samples(ctx)
    samples.log_probs[6, 2] += 0.05
    with pytest.raises(VerificationError) as e:
        train_epoch(ctx, samples, adv, epoch=0)
    msg = str(e.value)
    assert f"denoising step {int(samples.step_indices[2])} " in msg and "sample 6 of process 0 (condition 1)" in msg
    assert abs(float(msg.split("|r - 1| = ")[1].split()[0]) - (math.exp(0.05) - 1)) < 1e-4


def test_kl_to_ema_reference_without_gradients_to_it():
    ctx = make_ctx(beta=0.1)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["kl"] > 0 and ctx.reference.num_updates == 2  # after the first step the reference lags the policy
    assert all(not t.requires_grad and t.grad is None for t in ctx.reference.tensors.values())
    # after two mixes with alpha 0.5 the reference sits strictly between start and policy
    assert m["kl"] < 1.0


def test_kl_is_the_gaussian_kl_to_the_swapped_in_reference():
    """The KL the loss is given is to the reference's weights, swapped into the model: with a reference set to another
    model's weights (alpha 1: never mixed; lr 0: the policy does not move) the epoch's kl equals the Gaussian KL
    between the two models' step means computed here, over every trained (sample, step). A reference that is never
    swapped in (the policy scored twice) gives 0."""
    ctx = make_ctx(beta=0.1, lr=0.0)
    ctx.reference = EMAReference(ctx.unet, alpha=1.0, update_freq=1)
    other = tiny_unet(seed=1)
    with torch.no_grad():
        for n, p in other.named_parameters():
            ctx.reference.tensors[n].copy_(p)
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    from ddpo_grpo.core.policy_step import policy_step

    B = N * T  # every sample at every step (timestep_fraction 1), in equal calls: the mean of the calls' means
    rows, cols = torch.arange(N).repeat_interleave(T), torch.arange(T).repeat(N)
    with torch.no_grad():
        pol, ref = (policy_step(model, ctx.pipe.scheduler, SamplerSettings(guidance_scale=2.0),
                                samples.latents[rows, cols], samples.timesteps[cols], samples.step_indices[cols],
                                samples.embeds[rows], samples.neg_embeds[rows],
                                prev_sample=samples.latents[rows, cols + 1]) for model in (ctx.unet, other))
    want = ((pol.mean - ref.mean) ** 2 / (2 * pol.std ** 2)).reshape(B, -1).mean(dim=1).mean().item()
    assert want > 1e-3 and m["kl"] == pytest.approx(want, rel=1e-4)


def test_nonfinite_loss_is_skipped_and_counted():
    ctx = make_ctx()
    ctx.config.train.old_logprobs = "sampling"  # the ratio uses the sampler's (auto re-scores epoch 0: finite)
    samples, adv = make_samples(ctx)
    samples.log_probs[0, :] = float("nan")  # the first micro-batch's old log-probs are corrupt
    before = [p.detach().clone() for p in ctx.unet.parameters()]
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["nonfinite_loss"] == T  # every call holding sample 0 (4 timesteps, 1 per call)
    for p in ctx.unet.parameters():
        assert torch.isfinite(p).all()
    assert any(not torch.equal(a, b) for a, b in zip(before, ctx.unet.parameters()))


def test_nonfinite_gradient_norm_is_counted_not_averaged():
    """The first optimizer step's gradient is made infinite (a hook on one weight, first two backward calls): that
    step is skipped and counted in skipped_steps, and grad_norm is the mean over the steps taken -- the second step's
    norm as clip_grad_norm_ returned it -- not inf."""
    ctx = make_ctx(per_call=2)
    samples, adv = make_samples(ctx)
    calls, norms = [0], []
    clip = ctx.accelerator.clip_grad_norm_

    def record(*a, **k):
        norms.append(float(clip(*a, **k)))
        return norms[-1]

    ctx.accelerator.clip_grad_norm_ = record

    def poison(g):
        calls[0] += 1
        return g * float("inf") if calls[0] <= 2 else g

    next(ctx.unet.parameters()).register_hook(poison)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert len(norms) == 2 and not math.isfinite(norms[0]) and math.isfinite(norms[1]) and norms[1] > 0
    assert m["skipped_steps"] == 1 and ctx.state.global_step == 1
    assert m["grad_norm"] == norms[1]


def _first_call_step(ctx, unet, samples):
    """policy_step on the epoch's first training call (its samples x timesteps), with the given weights."""
    from ddpo_grpo.core.policy_step import policy_step
    from ddpo_grpo.trainer.epoch.update import training_calls

    calls, _ = training_calls(N, T, ctx.config, epoch=0, inner=0, rank=0, per_call=2)
    idx, cols = calls[0]
    rows, c = idx.repeat_interleave(cols.shape[1]), cols.reshape(-1)
    with torch.no_grad():
        return policy_step(unet, ctx.pipe.scheduler, SamplerSettings(guidance_scale=2.0), samples.latents[rows, c],
                           samples.timesteps[c], samples.step_indices[c], samples.embeds[rows],
                           samples.neg_embeds[rows], prev_sample=samples.latents[rows, c + 1])


def test_policy_shift_kl_is_the_exact_gaussian_kl_of_the_update():
    import copy

    ctx = make_ctx(per_call=2, lr=1e-3)
    samples, adv = make_samples(ctx)
    start = copy.deepcopy(ctx.unet)
    m = train_epoch(ctx, samples, adv, epoch=0)
    before, after = _first_call_step(ctx, start, samples), _first_call_step(ctx, ctx.unet, samples)
    # hand-computed: mean over rows and dims of (mu_after - mu_before)^2 / (2 std^2), std the step's own
    hand = float(((after.mean - before.mean) ** 2 / (2 * before.std ** 2)).mean())
    assert hand > 0 and abs(m["policy_shift_kl"] - hand) <= 1e-6 * hand


def test_policy_shift_kl_is_zero_when_nothing_moves():
    ctx = make_ctx(per_call=2, lr=0.0)
    samples, adv = make_samples(ctx)
    assert train_epoch(ctx, samples, adv, epoch=0)["policy_shift_kl"] == 0.0


def test_target_shift_kl_sets_the_next_steps_lr_and_the_run_state():
    ctx = make_ctx(per_call=2, lr=1e-3)
    ctx.config.train.target_shift_kl = 1e-30  # any update shifts the policy by more: the lr must come down
    samples, adv = make_samples(ctx)
    m = train_epoch(ctx, samples, adv, epoch=0)
    assert m["policy_shift_kl"] > 2e-30 and m["lr_scale"] == ctx.state.lr_scale == 1 / 1.5
    assert ctx.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 1.5, rel=1e-12)
    ctx.config.train.target_shift_kl = 1e30  # far under target: back up, from the scale it had
    ctx.config.train.onpolicy_check = "off"  # epoch 1 re-trains epoch 0's samples: off-policy by construction
    m = train_epoch(ctx, samples, adv, epoch=1)
    assert ctx.state.lr_scale == pytest.approx(1.0) and ctx.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert m["lr"] == pytest.approx(1e-3 / 1.5)  # this epoch's steps ran at the scale the last epoch set


def _step(unet, ctx, samples, rows, c):
    from ddpo_grpo.core.policy_step import policy_step

    with torch.no_grad():
        return policy_step(unet, ctx.pipe.scheduler, SamplerSettings(guidance_scale=2.0), samples.latents[rows, c],
                           samples.timesteps[c], samples.step_indices[c], samples.embeds[rows],
                           samples.neg_embeds[rows], prev_sample=samples.latents[rows, c + 1])


def test_untrained_columns_complement_the_trained_ones():
    from ddpo_grpo.trainer.epoch.update import trainable_columns, untrained_columns

    ctx = make_ctx()
    samples, _ = make_samples(ctx)
    ctx.config.train.min_step_std = 0.5
    samples.step_std = torch.tensor([0.9, 0.6, 0.4, 0.01])
    assert trainable_columns(samples, ctx.config).tolist() == [0, 1]
    assert untrained_columns(samples, ctx.config).tolist() == [2, 3]
    ctx.config.train.min_step_std = 0.0  # every step trained: nothing left for kl_steps="all"
    assert untrained_columns(samples, ctx.config).tolist() == []


def test_untrained_kl_is_the_gaussian_kl_with_the_std_clamped():
    import copy

    from ddpo_grpo.trainer.epoch.training import untrained_kl

    ctx = make_ctx(beta=0.1)
    ctx.reference = EMAReference(ctx.unet, alpha=1.0, update_freq=1)  # a frozen copy of the start weights
    samples, _ = make_samples(ctx)
    settings = SamplerSettings(guidance_scale=2.0)
    idx, cols = torch.tensor([0, 3, 5]), torch.tensor([[1], [3], [2]])
    ctx.config.train.min_step_std = 0.0
    assert float(untrained_kl(ctx, settings, samples, idx, cols).detach()) == 0.0  # policy == reference
    start = copy.deepcopy(ctx.unet)
    with torch.no_grad():
        for p in ctx.unet.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rows, c = idx, cols.reshape(-1)
    pol, ref = _step(ctx.unet, ctx, samples, rows, c), _step(start, ctx, samples, rows, c)
    for floor in (0.0, 0.5):
        ctx.config.train.min_step_std = floor
        std = torch.as_tensor(pol.std).clamp(min=floor)
        hand = float(((pol.mean - ref.mean) ** 2 / (2 * std ** 2)).mean())
        got = float(untrained_kl(ctx, settings, samples, idx, cols).detach())
        assert hand > 0 and abs(got - hand) <= 1e-5 * hand, (floor, got, hand)
    assert float(pol.std.min()) < 0.5  # the clamp mattered for at least one row


def test_kl_steps_all_pulls_the_untrained_steps_towards_the_reference():
    """Advantages all zero (no policy gradient) and a policy moved away from a frozen reference: with kl_steps
    "trained" the KL pulls only at the trained steps; with "all" it is also taken, logged and trained at the
    untrained ones, so the untrained steps' means come back towards the reference."""
    import copy

    def run(kl_steps):
        torch.manual_seed(0)
        ctx = make_ctx(beta=1.0, lr=1e-3)
        samples, adv = make_samples(ctx)
        ref_unet = copy.deepcopy(ctx.unet)
        ctx.reference = EMAReference(ctx.unet, alpha=1.0, update_freq=1)  # frozen: ref_unet's weights
        with torch.no_grad():
            for p in ctx.unet.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        # the policy was moved after sampling on purpose: off-policy by construction, not a mismatch to stop on
        ctx.config.train.update(min_step_std=0.5, kl_steps=kl_steps, onpolicy_check="off")
        samples.step_std = torch.tensor([1.0, 1.0, 0.1, 0.1])  # columns 0-1 trained, 2-3 not
        adv.advantages.zero_()
        rows = torch.arange(N).repeat(2)
        c = torch.tensor([2] * N + [3] * N)
        dist = lambda: float(((_step(ctx.unet, ctx, samples, rows, c).mean  # noqa: E731
                                - _step(ref_unet, ctx, samples, rows, c).mean) ** 2).mean())
        before = dist()
        m = train_epoch(ctx, samples, adv, epoch=0)
        return before, dist(), m

    before, after_trained, m_trained = run("trained")
    before_all, after_all, m_all = run("all")
    assert before == before_all > 0
    assert "kl_untrained" not in m_trained and m_all["kl_untrained"] > 0
    assert after_all < after_trained  # the untrained steps were pulled back only with "all"


def test_the_runs_tolerance_follows_its_dtype_and_clip_range():
    """core.loss.onpolicy_tolerance through the trainer's reading of the run: float32 on CPU 1e-5; bf16 / fp16, and
    float32 on CUDA with TF32 kernels, half the clip range (docs/reliability.md says why)."""
    from ddpo_grpo.core.loss import onpolicy_tolerance
    from ddpo_grpo.trainer.checks.onpolicy import run_tolerance

    cfg = make_ctx().config
    acc = lambda mp, dev="cpu": types.SimpleNamespace(mixed_precision=mp, device=torch.device(dev))  # noqa: E731
    assert run_tolerance(cfg, acc("no")) == (1e-5, "float32")
    assert run_tolerance(cfg, acc("bf16")) == (cfg.train.clip_range / 2, "bfloat16")
    assert run_tolerance(cfg, acc("fp16")) == (cfg.train.clip_range / 2, "float16")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # process-wide: restored below
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert run_tolerance(cfg, acc("no", "cuda")) == (cfg.train.clip_range / 2, "float32 with TF32 kernels")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert run_tolerance(cfg, acc("no", "cuda")) == (1e-5, "float32")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert onpolicy_tolerance(torch.float32, 1e-5) == 5e-6  # never above half the clip range
    with pytest.raises(ValueError):
        onpolicy_tolerance(torch.bfloat16, 0.0)

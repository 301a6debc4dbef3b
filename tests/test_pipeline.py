"""pipeline_with_logprob + policy_step: trajectories and the on-policy invariant ratio == 1."""
import pytest
import torch

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings, policy_step

from helpers import ddim_scheduler, flow_scheduler, tiny_unet

B, T = 4, 6


def _sample(family, guidance, sde_type="sde", window=None, dtype=torch.float32):
    unet = tiny_unet().to(dtype)
    sched = ddim_scheduler() if family == "ddim" else flow_scheduler()
    settings = SamplerSettings(family=family, guidance_scale=guidance, eta=1.0, noise_level=0.7, sde_type=sde_type)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(B, 5, 8, generator=g).to(dtype)
    neg = torch.randn(B, 5, 8, generator=g).to(dtype) if guidance != 1.0 else None
    lat = torch.randn(B, 3, 8, 8, generator=g).to(dtype)
    traj = pipeline_with_logprob(unet, sched, settings, emb, neg, num_inference_steps=T, latents=lat,
                                 generator=g, return_pred_x0=True, sde_window=window)
    return unet, sched, settings, emb, neg, traj


def _rescore(unet, sched, settings, emb, neg, traj, rows, cols):
    """Re-score stored transitions (rows[i], cols[i]) in one call, as the trainer does."""
    x = traj.latents[rows, cols]
    with torch.no_grad():
        res = policy_step(unet, sched, settings, x, traj.timesteps[cols], traj.step_indices[cols], emb[rows],
                          None if neg is None else neg[rows], prev_sample=traj.latents[rows, cols + 1])
    return res.log_prob


@pytest.mark.parametrize("family,guidance,sde_type", [("ddim", 1.0, "sde"), ("ddim", 3.0, "sde"),
                                                      ("flow", 1.0, "sde"), ("flow", 2.5, "cps")])
def test_onpolicy_ratio_is_one_every_timestep(family, guidance, sde_type):
    unet, sched, settings, emb, neg, traj = _sample(family, guidance, sde_type)
    n = traj.log_probs.shape[1]
    assert traj.latents.shape == (B, n + 1, 3, 8, 8)
    assert traj.images.shape == (B, 3, 8, 8) and traj.pred_x0.shape == (B, n, 3, 8, 8)
    for j in range(n):  # same batch composition as sampling
        rows = torch.arange(B)
        lp = _rescore(unet, sched, settings, emb, neg, traj, rows, torch.full((B,), j))
        ratio = torch.exp(lp - traj.log_probs[:, j])
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0), (j, ratio)


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_ratio_is_one_with_timestep_stacking(family):
    """Several timesteps of the same samples in one call (the trainer's timesteps_per_call) and shuffled rows."""
    unet, sched, settings, emb, neg, traj = _sample(family, 2.0)
    n = traj.log_probs.shape[1]
    rows = torch.arange(B).repeat_interleave(n)
    cols = torch.arange(n).repeat(B)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    rows, cols = rows[perm], cols[perm]
    lp = _rescore(unet, sched, settings, emb, neg, traj, rows, cols)
    ratio = torch.exp(lp - traj.log_probs[rows, cols])
    # Other rows in the call than at sampling: the kernels may sum in another order (one CPU thread: 1.7e-6
    # measured); a wrong step, timestep or guidance moves the ratio by far more than 1e-5.
    assert (ratio - 1).abs().max() < 1e-5


def _bf16_clip_ranges():
    """train.clip_range of every named config that runs in bf16 (config/grpo.py)."""
    from helpers import grpo_configs

    mod = grpo_configs()
    return {n: c.train.clip_range for n, f in mod.CONFIGS.items() for c in [f()] if c.mixed_precision == "bf16"}


@pytest.mark.parametrize("family,guidance", [("ddim", 1.0), ("ddim", 3.0), ("flow", 2.5)])
def test_bf16_ratio_within_the_trainers_tolerance(family, guidance):
    """bf16 as the trainer runs it (float32 master weights under bf16 autocast, log-prob math in float32) and with
    the denoiser itself in bf16: re-scoring the stored transitions with other rows, stacked as train_epoch stacks
    them, stays within core.loss.onpolicy_tolerance -- the bound the trainer's on-policy check enforces -- for the
    smallest clip range of any bf16 named config. Re-scoring the same transitions in float32 instead (a dtype that
    differs between sampling and training) must not: the bound separates the two."""
    from ddpo_grpo.core.loss import onpolicy_tolerance

    clips = _bf16_clip_ranges()  # sd3 / sdxl / flux / wan / sd15_random_bench / recam...
    assert "sd3" in clips and "flux" in clips, clips
    tol = onpolicy_tolerance(torch.bfloat16, min(clips.values()))
    for weights in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            unet, sched, settings, emb, neg, traj = _sample(family, guidance, dtype=weights)
        n = traj.log_probs.shape[1]
        rows = torch.arange(B).repeat_interleave(n)
        cols = torch.arange(n).repeat(B)
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
        rows, cols = rows[perm], cols[perm]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = _rescore(unet, sched, settings, emb, neg, traj, rows, cols)
        assert lp.dtype == torch.float32
        worst = float((torch.exp(lp - traj.log_probs[rows, cols]) - 1).abs().max())
        assert worst < tol, (weights, worst, tol)
        if weights == torch.float32:
            exact = _rescore(unet, sched, settings, emb, neg, traj, rows, cols)  # float32: the dtype mismatch
            assert float((torch.exp(exact - traj.log_probs[rows, cols]) - 1).abs().max()) > tol


@pytest.mark.parametrize("family", ["flow", "ddim"])
def test_sde_window_stores_only_window_steps(family):
    """Noise only in the window (flow SDE / DDIM eta > 0), deterministic before it: the window's input is the
    deterministic sampler's state at that step; only the window's steps are stored, and they re-score to ratio 1."""
    unet, sched, settings, emb, neg, traj = _sample(family, 1.0, window=(2, 3))
    assert traj.step_indices.tolist() == [2, 3, 4]
    assert traj.log_probs.shape == (B, 3) and traj.latents.shape == (B, 4, 3, 8, 8)
    assert torch.equal(traj.timesteps, sched.timesteps[2:5])
    for j in range(3):
        lp = _rescore(unet, sched, settings, emb, neg, traj, torch.arange(B), torch.full((B,), j))
        assert (torch.exp(lp - traj.log_probs[:, j]) - 1).abs().max() < 1e-6
    g = torch.Generator().manual_seed(0)  # _sample's draws: emb, then x_T
    torch.randn(B, 5, 8, generator=g)
    lat = torch.randn(B, 3, 8, 8, generator=g)
    det = pipeline_with_logprob(unet, sched, settings, emb, neg, num_inference_steps=T, latents=lat, deterministic=True)
    assert torch.allclose(traj.latents[:, 0], det.latents[:, 2], atol=1e-6)  # steps 0-1 ran deterministically
    assert not torch.allclose(traj.latents[:, 1], det.latents[:, 3], atol=1e-3)  # step 2 drew noise


def test_deterministic_sampling_is_reproducible_and_has_no_logprob():
    unet = tiny_unet()
    settings = SamplerSettings(family="ddim")
    emb = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    lat = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    a = pipeline_with_logprob(unet, ddim_scheduler(), settings, emb, latents=lat, num_inference_steps=5, deterministic=True)
    b = pipeline_with_logprob(unet, ddim_scheduler(), settings, emb, latents=lat, num_inference_steps=5, deterministic=True)
    assert a.log_probs is None and torch.equal(a.images, b.images)
    assert a.images.min() >= 0 and a.images.max() <= 1


@pytest.mark.parametrize("family,sde_type", [("ddim", "sde"), ("flow", "sde"), ("flow", "cps")])
def test_pred_x0_of_a_column_follows_that_steps_action(family, sde_type):
    """Per-step rewards score x̂0 predicted from step j's *output* (so they depend on step j's sampled action);
    the last step's output is the final image itself."""
    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.core.policy_step import denoiser_output, predicted_x0

    unet, sched, settings, emb, neg, traj = _sample(family, 1.0, sde_type)
    n = traj.log_probs.shape[1]
    for j in range(n):
        if j + 1 < len(sched.timesteps):
            x = traj.latents[:, j + 1]
            t = sched.timesteps[j + 1].expand(B)
            with torch.no_grad():
                out = denoiser_output(unet, x, t, emb, None, 1.0)
            want = decode(None, predicted_x0(family, sched, out, t, torch.full((B,), j + 1), x))
        else:
            want = traj.images
        torch.testing.assert_close(traj.pred_x0[:, j], want, atol=1e-6, rtol=0)
    # not the prediction from the step's own input, which its action cannot affect
    with torch.no_grad():
        t0 = sched.timesteps[0].expand(B)
        before = decode(None, predicted_x0(family, sched, denoiser_output(unet, traj.latents[:, 0], t0, emb, None, 1.0),
                                           t0, torch.zeros(B, dtype=torch.long), traj.latents[:, 0]))
    assert (traj.pred_x0[:, 0] - before).abs().max() > 1e-3



def test_mirrored_pairs_by_condition_in_order():
    from ddpo_grpo.core.common import mirrored_pairs

    assert mirrored_pairs([5, 5, 3, 5, 3, 5, 7]) == [(0, 1.0), (0, -1.0), (0, 1.0), (1, 1.0), (0, -1.0), (1, -1.0),
                                                     (0, 1.0)]


@pytest.mark.parametrize("family,sde_type", [("ddim", "sde"), ("flow", "sde"), ("flow", "cps")])
def test_antithetic_pairs_draw_mirrored_noise_from_one_state_and_keep_their_log_probs(family, sde_type):
    """Rows (0, 1) and (2, 3) mirrored, all four from one x_T and one prompt: after the first stochastic step a pair
    sits symmetric about the step's mean (x_a + x_b equal for both pairs), with equal log-probs (the step Gaussian is
    symmetric); the pairs differ from each other; row 0 alone in a batch of its own draws what it draws in the pair
    (its noise is its own seed's, wherever it is sampled); and each row's stored log-prob is what re-scoring the
    stored transition gives (the samples are the policy's own)."""
    from ddpo_grpo.core.common import AntitheticNoise

    unet = tiny_unet()
    sched = ddim_scheduler() if family == "ddim" else flow_scheduler()
    settings = SamplerSettings(family=family, eta=1.0, noise_level=0.7, sde_type=sde_type)
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(1, 5, 8, generator=g).expand(B, -1, -1).contiguous()
    lat = torch.randn(1, 3, 8, 8, generator=g).expand(B, -1, -1, -1).contiguous()
    run = lambda n, gen: pipeline_with_logprob(unet, sched, settings, emb[:n], None,  # noqa: E731
                                              num_inference_steps=T, latents=lat[:n], generator=gen)
    anti = run(B, AntitheticNoise([11, 11, 12, 12], [1, -1, 1, -1]))
    alone = run(1, AntitheticNoise([11], [1]))
    x1 = anti.latents[:, 1]
    torch.testing.assert_close(x1[0] + x1[1], x1[2] + x1[3], atol=1e-5, rtol=0)
    assert (x1[0] - x1[2]).abs().max() > 0.1
    torch.testing.assert_close(anti.log_probs[0, 0], anti.log_probs[1, 0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(anti.latents[0], alone.latents[0], atol=1e-5, rtol=1e-5)
    S = anti.log_probs.shape[1]  # stored (stochastic) steps
    rows, cols = torch.arange(B).repeat_interleave(S), torch.arange(S).repeat(B)
    rescored = _rescore(unet, sched, settings, emb, None, anti, rows, cols).reshape(B, S)
    torch.testing.assert_close(rescored, anti.log_probs, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("processes,k", [(1, 8), (2, 4), (2, 3)])
def test_every_copy_of_a_condition_is_paired_across_batches_and_processes(processes, k):
    """sample.antithetic's noise sources over one epoch of KRepeatSampler's geometry (copies spread over batches and
    processes): each condition's k copies make k // 2 pairs, each pair one seed with signs +1 and -1, the odd copy out
    (odd k) alone with +1; seeds differ between pairs and conditions."""
    from collections import defaultdict

    from ml_collections import ConfigDict

    from ddpo_grpo.trainer.epoch.sampling import mirrored_noise
    from ddpo_grpo.trainer.run.data import KRepeatSampler

    batch, batches = 4, 6
    sampler = KRepeatSampler(dataset_size=64, batch_size=batch, num_batches=batches, num_processes=processes, k=k,
                             seed=5)
    rows = defaultdict(list)  # position -> [(seed, sign)]
    config = ConfigDict(dict(seed=5, sample=dict(num_batches_per_epoch=batches)))
    for q in range(processes):
        for b, src in enumerate(mirrored_noise(config, sampler, 3, q, processes)):
            for pos, g, sign in zip(sampler.batch(3, b, q), src.generators, src.signs.tolist()):
                rows[int(pos)].append((g.initial_seed(), sign))
    assert sum(map(len, rows.values())) == batch * batches * processes and all(len(r) == k for r in rows.values())
    seeds = set()
    for r in rows.values():
        by_seed = defaultdict(list)
        for seed, sign in r:
            by_seed[seed].append(sign)
        assert sorted(map(sorted, by_seed.values())) == sorted([[-1.0, 1.0]] * (k // 2) + [[1.0]] * (k % 2))
        assert not seeds & set(by_seed)
        seeds |= set(by_seed)

"""The trainer's steps in isolation: k-repeat sampling, advantages over gathered data with invalid rewards,
live verification and the training call plan (config validation: test_config_validation.py)."""
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from ddpo_grpo.trainer.epoch.advantages import compute_advantages
from ddpo_grpo.trainer.run.data import KRepeatSampler
from ddpo_grpo.errors import ConfigError, InvalidRewardError, VerificationError
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker
from ddpo_grpo.trainer.epoch.update import training_calls
from ddpo_grpo.trainer.checks.verification import verify_groups
from helpers import named_config as _config


def test_k_repeat_sampler_places_exactly_k_copies_across_processes():
    s = KRepeatSampler(dataset_size=100, batch_size=2, num_batches=4, num_processes=8, k=4, seed=0)
    assert s.num_conditions == 16  # the seed report's geometry: 8 x 2 x 4 = 64 samples, 16 conditions
    plan = s.epoch_plan(3)
    assert plan.shape == (4, 8, 2)
    _, counts = np.unique(plan, return_counts=True)
    assert len(counts) == 16 and (counts == 4).all()
    # every process derives the same plan; batches are its slices
    assert s.batch(3, 2, 5) == plan[2, 5].tolist()
    assert not np.array_equal(s.epoch_plan(4), plan)
    assert np.array_equal(KRepeatSampler(100, 2, 4, 8, 4, 0).epoch_plan(3), plan)


@pytest.mark.parametrize("kw,msg", [(dict(k=1), "at least 2"), (dict(k=3), "not divisible"),
                                    (dict(dataset_size=3), "distinct conditions")])
def test_k_repeat_sampler_geometry_errors(kw, msg):
    args = dict(dataset_size=100, batch_size=2, num_batches=4, num_processes=2, k=4, seed=0)
    args.update(kw)
    with pytest.raises(ConfigError, match=msg):
        KRepeatSampler(**args)


@pytest.fixture(scope="module")
def acc():
    return Accelerator(cpu=True)


def test_advantages_hand_computed_and_invalid_samples_excluded(acc):
    keys = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, float("nan"), 7.0, 4.0, float("nan")])
    valid = torch.isfinite(rewards)
    out = compute_advantages(acc, PerPromptStatTracker(), keys, rewards, valid)
    s = np.sqrt(2 / 3)  # population std of [1, 2, 3]
    expect = [-1 / s, 0, 1 / s, -1, 0, 1, 0, 0]  # group 1 keeps [5, 7]; group 2 has one valid sample: excluded
    np.testing.assert_allclose(out.advantages.numpy(), expect, rtol=1e-6)
    assert out.train_mask.tolist() == [True, True, True, True, False, True, False, False]
    assert out.invalid_count == 2 and out.excluded_groups == 1


def test_too_many_invalid_rewards_stop_the_run(acc):
    keys = torch.tensor([0, 0, 1, 1])
    rewards = torch.tensor([float("nan"), float("inf"), float("nan"), 1.0])
    with pytest.raises(InvalidRewardError, match="3 of 4 rewards"):
        compute_advantages(acc, PerPromptStatTracker(), keys, rewards, torch.isfinite(rewards), 0.5)


def test_per_timestep_advantages_verify_per_column(acc):
    rng = np.random.default_rng(0)
    keys = torch.tensor(np.repeat(np.arange(4), 4))
    rewards = torch.tensor(rng.normal(size=(16, 5)), dtype=torch.float32)
    rewards[:4, 2] = 0.5  # one constant column in group 0
    out = compute_advantages(acc, PerPromptStatTracker(), keys, rewards, torch.ones(16, dtype=torch.bool))
    metrics, table = verify_groups(out.keys_all, out.advantages_all, out.mask_all, out.rewards_all, 4, PerPromptStatTracker())
    assert metrics["verify/zero_std_columns"] == 1 and metrics["verify/adv_group_mean_abs_max"] < 1e-6
    assert (out.advantages_all[:4, 2] == 0).all()
    assert "16 samples = 4 conditions x k=4" in table


def test_verification_catches_wrong_counts_and_bad_advantages():
    keys = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    adv = np.zeros(8, np.float32)
    with pytest.raises(VerificationError, match="expected exactly k=4"):
        verify_groups(keys, adv, np.ones(8, bool), np.arange(8.0), 4, PerPromptStatTracker())
    keys = np.repeat([0, 1], 4)
    rewards = np.arange(8.0)
    bad = np.array([-1, 0, 0, 2, -1, 0, 0, 1.0], np.float32)  # group 0 mean 0.25
    with pytest.raises(VerificationError, match="advantage check failed: condition 0 column 0"):
        verify_groups(keys, bad, np.ones(8, bool), rewards, 4, PerPromptStatTracker())
    equal_rewards = np.ones(8)
    with pytest.raises(VerificationError, match="condition 0 column 0: rewards have zero spread"):
        verify_groups(keys, bad, np.ones(8, bool), equal_rewards, 4, PerPromptStatTracker())


class _Cfg:
    class train:
        timestep_fraction = 0.5
        timesteps_per_call = 2
        batch_size = 3
    seed = 0


def test_training_call_plan_covers_each_sample_and_timestep_once():
    calls, per_mb = training_calls(N=7, T=10, config=_Cfg, epoch=0, inner=0, rank=0)
    assert per_mb == 3  # 5 trained timesteps, 2 per call -> 3 calls per micro-batch
    seen = {}
    for idx, cols in calls:
        assert cols.shape[0] == len(idx) and cols.shape[1] in (1, 2)
        for i, row in zip(idx.tolist(), cols.tolist()):
            seen.setdefault(i, []).extend(row)
    assert sorted(seen) == list(range(7))
    for cols in seen.values():
        assert len(cols) == 5 and len(set(cols)) == 5 and all(0 <= c < 10 for c in cols)


def test_lr_schedule_warmup_is_diffusers_and_decay_follows_the_epoch():
    import math

    from diffusers.optimization import get_scheduler

    from ddpo_grpo.trainer.run.build import RunState, lr_factor

    state = RunState()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_scheduler("constant_with_warmup", opt, num_warmup_steps=6).lr_lambdas[0]
    const = lr_factor("constant", 6, 36, state)
    assert [const(s) for s in range(12)] == [ref(s) for s in range(12)]  # the default is unchanged, bit for bit
    cos, lin = lr_factor("cosine", 4, 36, state), lr_factor("linear", 0, 36, state)
    assert cos(2) == 0.5 and cos(10) == 1.0 and lin(0) == 1.0  # epoch 0: warmup only
    state.epoch = 9  # a quarter of the run
    assert cos(100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.8536
    assert cos(2) == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lin(100) == 0.75 and const(100) == 1.0
    state.epoch = 35
    assert 0 < cos(100) < 0.002 and lin(100) == pytest.approx(1 / 36)
    state.lr_scale = 0.25  # train.target_shift_kl's factor multiplies every schedule
    assert const(100) == 0.25 and const(3) == 0.125 and lin(100) == pytest.approx(0.25 / 36)


def test_adaptive_lr_scale_follows_the_policy_shift():
    from ddpo_grpo.trainer.epoch.training import LR_SCALE_BOUNDS, adapt_lr_scale

    assert adapt_lr_scale(1.0, 2.1e-3, 1e-3) == 1 / 1.5  # over twice the target: smaller steps
    assert adapt_lr_scale(1.0, 0.49e-3, 1e-3) == 1.5  # under half of it: larger steps
    assert adapt_lr_scale(0.3, 1e-3, 1e-3) == 0.3 and adapt_lr_scale(0.3, 2e-3, 1e-3) == 0.3  # in the band: kept
    assert adapt_lr_scale(0.3, 0.5e-3, 1e-3) == 0.3
    assert adapt_lr_scale(1.0, float("nan"), 1e-3) == 1 / 1.5  # a non-finite shift never raises the lr
    assert adapt_lr_scale(LR_SCALE_BOUNDS[0], 1.0, 1e-3) == LR_SCALE_BOUNDS[0]
    assert adapt_lr_scale(LR_SCALE_BOUNDS[1], 0.0, 1e-3) == LR_SCALE_BOUNDS[1]


def test_shift_target_decays_as_the_lr_schedule_squared():
    """With train.target_shift_kl and a decaying lr_schedule, the policy-shift target at epoch e is the target times
    the schedule's decay squared (a KL grows as the step's square), the decay lr_factor applies: so when the lr comes
    down by the schedule, the shift it makes is on target and the adaptive factor stays, instead of climbing 1.5 x an
    epoch to undo the decay."""
    import math

    from ml_collections import ConfigDict

    from ddpo_grpo.trainer.epoch.training import adapt_lr_scale, shift_target
    from ddpo_grpo.trainer.run.build import RunState, lr_factor

    cfg = ConfigDict({"num_epochs": 40, "train": {"target_shift_kl": 2e-5, "lr_schedule": "constant"}})
    assert [shift_target(cfg, e) for e in (0, 17, 39)] == [2e-5] * 3  # constant: the target as given
    cfg.train.lr_schedule = "cosine"
    for e in (0, 10, 20, 30, 39):
        d = 0.5 * (1.0 + math.cos(math.pi * e / 40))
        assert shift_target(cfg, e) == pytest.approx(2e-5 * d * d, rel=1e-12)
    cfg.train.lr_schedule = "linear"
    assert shift_target(cfg, 30) == pytest.approx(2e-5 * 0.25 ** 2, rel=1e-12)
    cfg.train.target_shift_kl = 0.0
    assert shift_target(cfg, 30) == 0.0  # off stays off
    # A policy whose shift is c * lr^2 (a small step's KL), under the schedule: the factor never moves.
    cfg.train.target_shift_kl, cfg.train.lr_schedule = 2e-5, "cosine"
    state = RunState()
    factor = lr_factor("cosine", 0, 40, state)
    c = 2e-5 / factor(0) ** 2  # on target at epoch 0
    for e in range(40):
        state.epoch = e
        shift = c * factor(100) ** 2
        assert adapt_lr_scale(state.lr_scale, shift, shift_target(cfg, e)) == state.lr_scale == 1.0


def test_weighted_k_repeat_sampler_balances_singles_and_pairs():
    from ddpo_grpo.trainer.run.data import ToyWorldConditions

    data = ToyWorldConditions("train")
    s = KRepeatSampler(len(data), 16, 4, 1, 8, seed=0, weights=data.weights)
    singles = pairs = 0
    for epoch in range(40):
        plan = s.epoch_plan(epoch)
        _, counts = np.unique(plan, return_counts=True)
        assert (counts == 8).all()  # weights change which conditions, never how many copies
        idx = np.array([data[int(p)]["index"] for p in np.unique(plan)])
        singles += int((idx < 72).sum())
        pairs += int((idx >= 72).sum())
    assert 0.35 < singles / (singles + pairs) < 0.65  # uniform draws would give ~3% singles


@pytest.mark.parametrize("objects,n_train,n_eval", [("single", 40, 32), ("pair", 2176, 32), ("mixed", 2216, 64)])
def test_task_mix_keeps_the_split_and_the_object_count(objects, n_train, n_eval):
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.worlds.toyworld import ToyWorldDataset

    c = _config()
    c.data.objects = objects
    train, held_out = build_dataset(c, "train"), build_dataset(c, "eval")
    assert (len(train), len(held_out)) == (n_train, n_eval)  # 72 singles and 2,208 pairs; 32 + 32 held out
    keys = lambda ds: {ds[i]["index"] for i in range(len(ds))}
    assert not keys(train) & keys(held_out)  # a task mix never trains on a held-out condition
    assert keys(held_out) <= set(ToyWorldDataset(split="eval").indices)
    pairs = {ds[i]["condition"].is_pair for ds in (train, held_out) for i in range(len(ds))}
    assert pairs == {"single": {False}, "pair": {True}, "mixed": {False, True}}[objects]
    assert abs(train.weights.sum() - 1) < 1e-12


def test_condition_subset_is_fixed_keeps_indices_and_feeds_train_split_eval():
    from ddpo_grpo.trainer.run.data import ToyWorldConditions, build_dataset

    c = _config()
    c.data.num_conditions = 32
    sub, again = build_dataset(c, "train"), build_dataset(c, "train")
    assert len(sub) == 32 and sub.positions == again.positions  # the same 32 on every process and resume
    full = ToyWorldConditions("train")
    for i in (0, 17, 31):  # items are the full dataset's items, with their global index (the group key)
        assert sub[i]["index"] == full[sub.positions[i]]["index"] and sub[i]["prompt"] == full[sub.positions[i]]["prompt"]
    w = full.weights[sub.positions]
    assert np.allclose(sub.weights, w / w.sum()) and abs(sub.weights.sum() - 1) < 1e-12
    s = KRepeatSampler(len(sub), 16, 4, 1, 8, seed=0, weights=sub.weights)
    seen = set()
    for epoch in range(12):
        seen |= {sub[int(p)]["index"] for p in np.unique(s.epoch_plan(epoch))}
    assert seen <= {sub[i]["index"] for i in range(32)} and len(seen) > 8  # conditions recur across epochs
    assert len(build_dataset(c, "eval")) == 64  # held-out by default
    c.eval.split = "train"
    ev = build_dataset(c, "eval")
    assert [ev[i]["index"] for i in range(32)] == [sub[i]["index"] for i in range(32)]
    c.data.num_conditions = 0
    assert len(build_dataset(c, "train")) == len(full)


def test_shared_init_noise_depends_on_condition_and_epoch_only():
    from ddpo_grpo.trainer.epoch.sampling import group_init_noise

    c = _config()
    a = group_init_noise(c, 3, [5, 9, 5], (3, 8, 8))
    assert a.shape == (3, 3, 8, 8) and torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert torch.equal(group_init_noise(c, 3, [9], (3, 8, 8))[0], a[1])  # wherever the copy is sampled
    assert not torch.equal(group_init_noise(c, 4, [5], (3, 8, 8))[0], a[0])  # fresh noise every epoch
    assert abs(float(group_init_noise(c, 0, list(range(64)), (3, 8, 8)).std()) - 1) < 0.05


def test_toyworld_eval_split_is_balanced_and_held_out():
    from ddpo_grpo.worlds.toyworld import ToyWorldDataset

    ev, tr = ToyWorldDataset("eval"), ToyWorldDataset("train")
    assert len(ev) == 64 and sum(i < 72 for i in ev.indices) == 32
    assert set(ev.indices).isdisjoint(tr.indices) and len(ev) + len(tr) == 72 + 4 * 24 * 23


def test_near_deterministic_steps_are_sampled_but_not_trained():
    import types

    from ddpo_grpo.core.policy_step import SamplerSettings, schedule_stds
    from ddpo_grpo.trainer.epoch.update import trainable_columns

    from helpers import ddim_scheduler

    sched = ddim_scheduler()
    stds = schedule_stds(sched, SamplerSettings(eta=1.0), 10)
    # DDIM eta=1 with a cosine schedule: the last steps are almost deterministic
    assert stds[0] > 0.5 and stds[-1] < 0.01 and (stds[:-1] >= stds[1:]).all()
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(min_step_std=0.02, timestep_fraction=1.0,
                                                            timesteps_per_call=1, batch_size=4), seed=0)
    samples = types.SimpleNamespace(log_probs=torch.zeros(4, 10), step_std=stds)
    cols = trainable_columns(samples, cfg)
    assert cols.tolist() == [i for i in range(10) if stds[i] >= 0.02] and len(cols) < 10
    calls, _ = training_calls(4, 10, cfg, 0, 0, 0, columns=cols)
    trained = torch.cat([c.reshape(-1) for _, c in calls])
    assert set(trained.tolist()) == set(cols.tolist()) and len(trained) == 4 * len(cols)
    cfg.train.min_step_std = 0.0
    assert trainable_columns(samples, cfg).tolist() == list(range(10))


def test_phase_timer_counts_denoiser_rows_per_phase():
    """NFEs per phase: every row through the denoiser counts, CFG's unconditional half included; rows outside a
    phase and after close() are not counted."""
    import torch
    from helpers import tiny_unet

    from ddpo_grpo.core.policy_step import denoiser_output
    from ddpo_grpo.trainer.run.reporting import PhaseTimer

    unet = tiny_unet()
    x, t, emb = torch.zeros(3, 3, 8, 8), torch.full((3,), 500), torch.zeros(3, 5, 8)
    timer = PhaseTimer(unet)
    with torch.no_grad():
        with timer("sampling"):
            denoiser_output(unet, x, t, emb, None, 1.0)  # 3 rows
            denoiser_output(unet, x, t, emb, emb, 4.0)  # CFG: 6 rows in one call
        denoiser_output(unet, x, t, emb, None, 1.0)  # outside any phase
        with timer("training"):
            with timer("inner"):
                unet(x[:2], t[:2], encoder_hidden_states=emb[:2])
            unet(x, t, encoder_hidden_states=emb)
        timer.close()
        with timer("training"):
            unet(x, t, encoder_hidden_states=emb)
    assert timer.rows == {"sampling": 9, "inner": 2, "training": 3}
    assert set(timer.seconds) == {"sampling", "training", "inner"}


def test_plan_epoch_is_each_inner_epochs_training_calls():
    """update.plan_epoch: the one CallPlan the GRPO loss trains and the re-score scores is training_calls of each
    inner epoch over trainable_columns (inner epochs shuffled differently), or cell_training_calls for trees."""
    import types

    from ddpo_grpo.trainer.epoch.update import cell_training_calls, plan_epoch, trainable_columns

    cfg = types.SimpleNamespace(train=types.SimpleNamespace(min_step_std=0.3, timestep_fraction=0.5,
                                                            timesteps_per_call=2, batch_size=3, num_inner_epochs=2),
                                seed=5)
    stds = torch.tensor([0.8, 0.6, 0.5, 0.4, 0.35, 0.31, 0.2, 0.1])
    samples = types.SimpleNamespace(log_probs=torch.zeros(7, 8), step_std=stds)
    plan = plan_epoch(samples, cfg, epoch=3, rank=1, per_call=2)
    assert plan.columns.tolist() == trainable_columns(samples, cfg).tolist() == [0, 1, 2, 3, 4, 5]
    assert len(plan.calls) == 2 and plan.calls_per_microbatch == 2  # 3 of 6 columns trained, 2 a call
    for inner, calls in enumerate(plan.calls):
        want, per_mb = training_calls(7, 8, cfg, 3, inner, 1, 2, plan.columns)
        assert per_mb == plan.calls_per_microbatch and len(calls) == len(want)
        for (i, c), (wi, wc) in zip(calls, want):
            assert torch.equal(i, wi) and torch.equal(c, wc)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(*plan.calls))  # each inner epoch its own shuffle
    owners = torch.rand(7, 8, generator=torch.Generator().manual_seed(0)) < 0.5
    tree = plan_epoch(samples, cfg, epoch=3, rank=1, per_call=2, owners=owners)
    want, _ = cell_training_calls(owners, cfg, 3, 1, 1, tree.columns)
    assert tree.calls_per_microbatch == 1 and all(torch.equal(a[1], b[1]) for a, b in zip(tree.calls[1], want))

"""Branched trajectories (issue 29): the tree's groups and advantages against a hand-built tree, the live check,
the sampler (a branch's log-probs are the unbranched sampler's for the same noise; ratio 1 when re-scored; shared
trunks), the call plan, a bad tree spec as one line, and a branched run end to end with an exact resume."""
import json
import os
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pytest
import torch
from helpers import cpu_env, ddim_scheduler, flow_scheduler, run_side_by_side, tiny_unet
from safetensors.torch import load_file

from config import base
from ddpo_grpo.core.loss import ONPOLICY_TOL_EXACT
from ddpo_grpo.core.branching import BranchSpec, tree_advantages
from ddpo_grpo.core.families import get_family
from ddpo_grpo.core.pipeline_with_logprob import decode, pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings, denoiser_output, policy_step
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker
from ddpo_grpo.errors import ConfigError, VerificationError
from ddpo_grpo.trainer.run.data import KRepeatSampler
from ddpo_grpo.trainer.epoch.sampling import branch_spec
from ddpo_grpo.trainer.epoch.update import cell_training_calls
from ddpo_grpo.trainer.checks.verification import verify_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the tree's groups and advantages
def test_tree_advantages_match_a_hand_built_tree():
    # 2 trees (conditions 7 and 9) of splits at steps (0, 2) with K = 2: 4 leaves each
    spec = BranchSpec((0, 2), 2)
    conds = [7, 7, 7, 7, 9, 9, 9, 9]
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 0.2, 0.4, 0.6, 0.6])
    adv, cells = tree_advantages(PerPromptStatTracker("group"), spec, conds, rewards, np.array([True, True]))
    # column 0, owners are leaves 0 and 2 of each tree. Tree 7: children (leaves 0-1, 2-3) are worth 0.5 and 0.0,
    # so +1 / -1. Tree 9: 0.3 and 0.6, so -1 / +1.
    # column 1, every leaf owns its own step. Tree 7: parent 0's children 1, 0 (+1, -1); parent 1's 0, 0 (zero
    # spread: 0). Tree 9: 0.2, 0.4 (-1, +1); 0.6, 0.6 (0).
    expect = np.array([[1, 1], [0, -1], [-1, 0], [0, 0], [-1, -1], [0, 1], [1, 0], [0, 0]], dtype=np.float32)
    np.testing.assert_allclose(adv, expect, atol=1e-6)
    assert cells.tolist() == [[True, True], [False, True], [True, True], [False, True]] * 2


def test_tree_keys_group_exact_siblings_and_an_invalid_tree_is_excluded_whole():
    spec = BranchSpec((1, 3, 4), 3)  # 27 leaves per tree
    n = 3 * spec.leaves
    conds = np.repeat([4, 4, 5], spec.leaves).tolist()
    rng = np.random.default_rng(0)
    rewards = rng.random(n)
    rewards[5] = np.nan  # a leaf of tree 0
    valid = ~np.isnan(rewards).reshape(3, -1).any(axis=1)
    tracker = PerPromptStatTracker("group")
    adv, cells = tree_advantages(tracker, spec, conds, rewards, valid)
    assert not cells[: spec.leaves].any() and not adv[: spec.leaves].any()  # tree 0: nothing trained, all 0
    for d in range(spec.depth):
        keys = spec.sibling_keys(conds, d)
        _, counts = np.unique([str(k) for k in keys], return_counts=True)
        assert set(counts) == {3}  # exactly K children per parent
        assert len(keys) == 3 * 3 ** (d + 1)
        assert cells[:, d].sum() == 2 * 3 ** (d + 1)  # the two valid trees' owner cells
    # each sibling group: mean 0, std 1 (random rewards: no ties)
    mask = np.repeat(valid, spec.leaves)
    for d in range(spec.depth):
        a = adv[spec.owners(n, d) & mask, d].reshape(-1, 3)
        np.testing.assert_allclose(a.mean(axis=1), 0, atol=1e-6)
        np.testing.assert_allclose(a.std(axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_live_check_accepts_the_trees_advantages_and_rejects_tampering(seed):
    rng = np.random.default_rng(seed)
    spec = BranchSpec(tuple(sorted(rng.choice(8, size=2, replace=False))), int(rng.integers(2, 4)))
    trees_per_cond, m = 2, 3
    k = trees_per_cond * spec.leaves
    conds = np.repeat(np.arange(m), k)
    rewards = rng.integers(0, 3, size=len(conds)) / 2.0  # coarse rewards: many zero-spread groups
    tracker = PerPromptStatTracker("group")
    valid = np.ones(len(conds) // spec.leaves, dtype=bool)
    adv, cells = tree_advantages(tracker, spec, conds.tolist(), rewards, valid)
    mask = np.ones(len(conds), dtype=bool)
    metrics, table = verify_groups(conds, adv, mask, rewards, k, tracker, spec, cells)
    assert metrics["verify/trained_cells"] == cells.sum() == sum(m * trees_per_cond * spec.branches ** (d + 1)
                                                                 for d in range(spec.depth))
    assert "branched" in table
    bad = adv.copy()
    bad[np.flatnonzero(~spec.owners(len(conds), 0))[0], 0] = 0.5  # a non-owner cell with an advantage
    with pytest.raises(VerificationError, match="owner"):
        verify_groups(conds, bad, mask, rewards, k, tracker, spec, cells)
    bad = adv.copy()
    bad[spec.owners(len(conds), 0), 0] += 0.1  # every sibling group off by 0.1 (zero-spread ones included)
    with pytest.raises(VerificationError):
        verify_groups(conds, bad, mask, rewards, k, tracker, spec, cells)
    mixed = conds.copy()
    mixed[1] = (mixed[1] + 1) % m
    mixed[k + 1] = conds[1]  # counts per condition still k, but tree 0 now mixes two conditions
    with pytest.raises(VerificationError, match="mixes conditions"):
        verify_groups(mixed, adv, mask, rewards, k, tracker, spec, cells)


@pytest.mark.parametrize("mode", ["group", "global", "none"])
def test_tree_check_verifies_the_scale_in_every_per_epoch_mode(mode):
    # A tree's advantages scaled by 1.5 keep every sibling group's mean 0: only a check of the scale (std 1 in group
    # mode; the column's std or 1 from the tracker's own rule in global / none modes) catches it.
    rng = np.random.default_rng(11)
    spec = BranchSpec((1, 4), 3)
    conds = np.repeat(np.arange(4), 2 * spec.leaves)
    rewards = rng.normal(size=len(conds))  # no ties: every sibling group is live
    tracker = PerPromptStatTracker(mode)
    valid = np.ones(len(conds) // spec.leaves, dtype=bool)
    adv, cells = tree_advantages(tracker, spec, conds.tolist(), rewards, valid)
    mask = np.ones(len(conds), dtype=bool)
    metrics, table = verify_groups(conds, adv, mask, rewards, 2 * spec.leaves, tracker, spec, cells)
    assert metrics["verify/adv_tracker_err_max"] < 1e-5
    assert ("|std-1| <=" in table) == (mode == "group")
    if mode != "group":
        assert "the batch's std" in table if mode == "global" else "1 (no std)" in table
        # global: the column's std is not 1, so the advantages are not the group mode's (what the check compares)
        col0 = adv[spec.owners(len(conds), 0), 0].reshape(-1, 3)
        assert np.abs(col0.std(axis=1) - 1).max() > 0.1
    with pytest.raises(VerificationError):
        verify_groups(conds, adv * 1.5, mask, rewards, 2 * spec.leaves, tracker, spec, cells)


def test_tree_check_with_running_statistics_claims_no_mean():
    spec = BranchSpec((0, 2), 2)
    conds = np.repeat([0, 1], 2 * spec.leaves)
    rewards = np.random.default_rng(3).normal(size=len(conds))
    tracker = PerPromptStatTracker("running")
    adv, cells = tree_advantages(tracker, spec, conds.tolist(), rewards, np.ones(len(conds) // spec.leaves, bool))
    _, table = verify_groups(conds, adv, np.ones(len(conds), bool), rewards, 2 * spec.leaves, tracker, spec, cells)
    assert "statistics not per epoch" in table and "|mean| <=" not in table


# ---------------------------------------------------------------- the sampler
def _settings(family):
    return SamplerSettings(family=family, guidance_scale=2.0, eta=1.0, noise_level=0.7, sde_type="sde")


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_one_split_equals_the_unbranched_sampler_with_a_one_step_window(family):
    # A tree split once at step 1 into K children = K copies of x_T sampled with the noise window (1, 1): same
    # noise draws (the generator is consumed in the same order), so the same latents, log-probs and images.
    torch.manual_seed(0)
    unet, sched = tiny_unet(), ddim_scheduler() if family == "ddim" else flow_scheduler()
    spec, trees, shape = BranchSpec((1,), 4), 2, (3, 8, 8)
    emb = torch.randn(trees, 5, 8).repeat_interleave(spec.leaves, 0)
    neg = torch.zeros_like(emb)
    branched = pipeline_with_logprob(unet, sched, _settings(family), emb, neg, num_inference_steps=4,
                                     sample_shape=shape, generator=torch.Generator().manual_seed(3), branch=spec)
    g = torch.Generator().manual_seed(3)
    x_T = torch.randn((trees, *shape), generator=g)
    plain = pipeline_with_logprob(unet, sched, _settings(family), emb, neg, num_inference_steps=4,
                                  latents=x_T.repeat_interleave(spec.leaves, 0), generator=g, sde_window=(1, 1))
    torch.testing.assert_close(branched.log_probs, plain.log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(branched.latents[:, 0], plain.latents[:, 0], rtol=0, atol=1e-6)
    # float32 calls of other batch shapes (the sampler calls in the training's shape): rounding, not a different step
    torch.testing.assert_close(branched.latents[:, 1], plain.latents[:, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(branched.images, plain.images, rtol=0, atol=1e-5)
    assert branched.step_indices.tolist() == [1] and branched.transitions.tolist() == [[0, 1]]
    # siblings differ (their own noise), trees differ (their own x_T)
    assert not torch.allclose(branched.images[0], branched.images[1])


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_a_two_level_tree_rescored_is_ratio_one_and_shares_its_trunks(family):
    torch.manual_seed(1)
    unet, sched = tiny_unet(), ddim_scheduler() if family == "ddim" else flow_scheduler()
    settings = _settings(family)
    spec = BranchSpec((0, 2), 2)
    emb = torch.randn(2, 5, 8).repeat_interleave(spec.leaves, 0)  # 2 trees, 8 leaves
    neg = torch.zeros_like(emb)
    traj = pipeline_with_logprob(unet, sched, settings, emb, neg, num_inference_steps=4, sample_shape=(3, 8, 8),
                                 generator=torch.Generator().manual_seed(5), branch=spec)
    B = emb.shape[0]
    assert traj.latents.shape[:2] == (B, 5) and traj.log_probs.shape == (B, 2)
    assert traj.transitions.tolist() == [[0, 1], [2, 3]] and traj.step_indices.tolist() == [0, 2]
    for j in range(2):  # re-score each stored transition with the policy step: the same log-prob (ratio 1)
        src, dst = traj.transitions[j]
        res = policy_step(unet, sched, settings, traj.latents[:, src], traj.timesteps[j].expand(B),
                          traj.step_indices[j].expand(B), emb, neg, prev_sample=traj.latents[:, dst])
        assert (res.log_prob - traj.log_probs[:, j]).abs().max() < 1e-5
    # shared states: all 4 leaves of a tree start from x_T; the 2 leaves under one child share its step-0 output
    x = traj.latents
    assert torch.equal(x[0, 0], x[3, 0]) and not torch.equal(x[0, 0], x[4, 0])
    assert torch.equal(x[0, 1], x[1, 1]) and not torch.equal(x[0, 1], x[2, 1])
    assert torch.equal(traj.log_probs[0, 0], traj.log_probs[1, 0])
    # between the splits the path is deterministic: step 1's ODE step takes step 0's output to step 2's input
    fam = get_family(family)
    t1 = sched.timesteps[1].expand(B)
    out = denoiser_output(unet, x[:, 1], t1, emb, neg, settings.guidance_scale)
    torch.testing.assert_close(fam.ode_step(sched, out, t1, torch.full((B,), 1), x[:, 1]), x[:, 2], rtol=0, atol=1e-5)
    # the last step (3) is the ODE too: it takes the split's output (state 3) to the final sample, which is what the
    # images decode (pixel model: x in [-1, 1])
    t3 = sched.timesteps[3].expand(B)
    out = denoiser_output(unet, x[:, 3], t3, emb, neg, settings.guidance_scale)
    torch.testing.assert_close(fam.ode_step(sched, out, t3, torch.full((B,), 3), x[:, 3]), x[:, 4], rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, decode(None, x[:, 4]), rtol=0, atol=0)
    assert (decode(None, x[:, 3]) - traj.images).abs().max() > 1e-3  # so images of the state before would fail


def test_sampler_refuses_rows_that_are_not_whole_trees():
    with pytest.raises(ValueError, match="whole trees"):
        pipeline_with_logprob(tiny_unet(), ddim_scheduler(), _settings("ddim"), torch.randn(6, 5, 8),
                              num_inference_steps=3, sample_shape=(3, 8, 8), branch=BranchSpec((0,), 4))


# ---------------------------------------------------------------- data plan, call plan, config
def test_k_repeat_sampler_keeps_trees_whole_and_k_exact():
    s = KRepeatSampler(dataset_size=20, batch_size=8, num_batches=3, num_processes=2, k=8, seed=0, tree_size=4)
    plan = s.epoch_plan(0).reshape(-1)
    trees = plan.reshape(-1, 4)
    assert (trees == trees[:, :1]).all()  # each tree's 4 slots hold one condition
    _, counts = np.unique(plan, return_counts=True)
    assert set(counts) == {8}
    assert len({tuple(t) for t in s.epoch_plan(1).reshape(-1, 4)}) > 1
    # tree_size 1 is the plain plan of k copies
    a = KRepeatSampler(20, 8, 3, 2, 4, 0).epoch_plan(5)
    b = KRepeatSampler(20, 8, 3, 2, 4, 0, tree_size=1).epoch_plan(5)
    assert np.array_equal(a, b)


def test_cell_call_plan_trains_every_owner_cell_once():
    spec = BranchSpec((0, 1), 2)
    n = 4 * spec.leaves
    cells = torch.from_numpy(spec.owner_cells(n))
    assert cells.tolist()[:4] == [[True, True], [False, True], [True, True], [False, True]]
    cfg = ml_collections.ConfigDict(dict(seed=0, train=dict(batch_size=5)))
    calls, per_mb = cell_training_calls(cells, cfg, 0, 0, 0)
    pairs = [(int(i), int(c)) for idx, cols in calls for i, c in zip(idx, cols[:, 0])]
    assert per_mb == 1 and sorted(pairs) == sorted(map(tuple, torch.nonzero(cells).tolist()))
    assert len(pairs) == 4 * (2 + 4) and all(len(idx) <= 5 for idx, _ in calls)
    only0, _ = cell_training_calls(cells, cfg, 0, 0, 0, columns=torch.tensor([0]))
    assert {int(c) for _, cols in only0 for c in cols[:, 0]} == {0}


def _config(**sample):
    c = base.get_config()
    c.sample.num_steps, c.sample.batch_size, c.sample.k = 10, 16, 8
    c.sample.branch_steps, c.sample.branches = (0, 2), 2
    for key, v in sample.items():
        c.sample[key] = v
    return c


@pytest.mark.parametrize("change, message", [
    (dict(branch_steps=(0, 10)), "outside the schedule"),
    (dict(branches=1), "at least 2 children"),
    (dict(branch_steps=(3, 1)), "strictly increasing"),
    (dict(k=6), "multiple of the 4 leaves"),
    (dict(batch_size=6), "cannot hold whole trees"),
    (dict(shared_init_noise=True), "shared_init_noise"),
    (dict(sde_window_size=2), "sde_window_size"),
])
def test_bad_tree_spec_is_one_clear_line(change, message):
    with pytest.raises(ConfigError, match=message) as e:
        branch_spec(_config(**change), "ddim")
    assert "\n" not in str(e.value)
    assert branch_spec(_config(), "ddim") == BranchSpec((0, 2), 2)
    assert branch_spec(_config(branch_steps=()), "ddim") is None


# ---------------------------------------------------------------- end to end
RUN = ["--config", "config/grpo.py:tiny", "--config.sample.num_steps=4", "--config.sample.batch_size=8",
       "--config.sample.num_batches_per_epoch=2", "--config.sample.k=8", "--config.sample.branch_steps=(0, 1)",
       "--config.sample.branches=2", "--config.train.batch_size=4", "--config.train.gradient_accumulation_steps=2",
       "--config.train.min_step_std=0", "--config.eval_freq=0", "--config.logging.image_freq=0",
       "--config.save_freq=1", "--config.logging.debug_dump=True", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.train.old_logprobs=rescore"]


def _train(logdir, *extra):
    return dict(args=[sys.executable, "scripts/train.py", *RUN, f"--config.logdir={logdir}", *extra], cwd=ROOT,
                env=cpu_env())


@pytest.mark.timeout(300)
def test_branched_run_checks_itself_and_resumes_exactly(tmp_path):
    straight, first = run_side_by_side([_train(tmp_path, "--config.run_name=s", "--config.num_epochs=2"),
                                        _train(tmp_path, "--config.run_name=r", "--config.num_epochs=1")])
    assert straight.returncode == 0 and first.returncode == 0, (straight.stderr + first.stderr)[-3000:]
    assert "GRPO check (branched): 16 samples = 2 conditions x k=8 (exact) = 4 trees x 4 leaves" in straight.stdout
    (resumed,) = run_side_by_side([_train(tmp_path, f"--config.resume_from={tmp_path / 'r'}", "--config.num_epochs=2")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = [load_file(str(tmp_path / r / "checkpoints" / "checkpoint_00002" / "model.safetensors")) for r in "sr"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    history = json.load(open(tmp_path / "s" / "summary.json"))["history"]
    for h in history:
        # train.old_logprobs=rescore: the old log-probs are these very calls' before the update, so exactly 1
        assert h["train"]["onpolicy_ratio_max_dev"] == 0.0 and h["train"]["old_logprobs_rescored"] == 1.0
        assert h["train"]["sampler_gap_max"] < ONPOLICY_TOL_EXACT  # float32: the sampler's differ by rounding only
        # denoiser rows per leaf: a 4-leaf tree runs 2 rows at step 0 (the first split), 4 at steps 1-3: 14 / 4;
        # training scores each transition twice, re-score and update (2 + 4 owner cells per tree: 2 x 6 / 4), plus
        # the policy-shift KL's forward on the first call's 4 rows (4 / 16)
        assert h["nfe_per_sample"]["sampling"] == 14 / 4 and h["nfe_per_sample"]["training"] == 2 * 6 / 4 + 4 / 16
    dumps = [json.load(open(tmp_path / "s" / "debug" / f"epoch_{e:04d}_rank_0.json")) for e in range(2)]
    assert dumps[0]["weights_sum"] != dumps[1]["weights_sum"]  # the weights moved, so the equality could fail


def test_bad_tree_spec_on_the_command_line_exits_2(tmp_path):
    # (a tuple field given twice on the command line is concatenated by ml_collections: give it once)
    args = [a for a in RUN if not a.startswith("--config.sample.branch_steps")]
    p = subprocess.run([sys.executable, "scripts/train.py", *args, f"--config.logdir={tmp_path}",
                        "--config.sample.branch_steps=(0, 7)"], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: sample.branch_steps / sample.branches: branch step 7")


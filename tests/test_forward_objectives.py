"""Forward-process objectives (train.objective raft / nft) and pass@k: exact values by hand, and the trainer
end to end with each objective."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from ddpo_grpo.trainer.epoch.evaluation import pass_at_k, passed
from ddpo_grpo.core.forward_loss import best_of_group, nft_loss, nft_optimality, noised_and_target, raft_loss
from helpers import ddim_scheduler, flow_scheduler, run_side_by_side, selected_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_noised_and_target_ddim_v_prediction_by_hand():
    sched = ddim_scheduler("v_prediction")
    x0, noise = torch.randn(3, 3, 4, 4), torch.randn(3, 3, 4, 4)
    u = torch.tensor([0.0, 0.5, 0.9995])
    xt, t, target = noised_and_target(sched, "ddim", x0, noise, u)
    assert t.tolist() == [0, 500, 999]
    a = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(xt, a.sqrt() * x0 + (1 - a).sqrt() * noise)
    torch.testing.assert_close(target, a.sqrt() * noise - (1 - a).sqrt() * x0)
    assert torch.equal(noised_and_target(ddim_scheduler("epsilon"), "ddim", x0, noise, u)[2], noise)


def test_noised_and_target_flow_by_hand():
    x0, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    u = torch.tensor([0.25, 0.75])
    xt, t, target = noised_and_target(flow_scheduler(), "flow", x0, noise, u)
    torch.testing.assert_close(xt[1], 0.25 * x0[1] + 0.75 * noise[1])
    torch.testing.assert_close(t, torch.tensor([250.0, 750.0]))
    torch.testing.assert_close(target, noise - x0)


def test_best_of_group_by_hand():
    keys = np.array([5, 5, 5, 9, 9, 9, 2, 2, 7, 7])
    rewards = np.array([0.1, 0.9, 0.9, 0.3, 0.8, 0.2, 0.5, 0.5 + 1e-7, 1.0, 0.0])
    mask = np.array([True] * 8 + [True, False])
    best = best_of_group(keys, rewards, mask, eps=1e-4)
    # group 5: first of the tied best; group 9: index 4; group 2: near-tie = zero spread, no best;
    # group 7: one valid sample left, nothing to compare
    assert np.flatnonzero(best).tolist() == [1, 4]
    per_step = np.array([[0, 1], [1, 1.0]])  # ranked by the mean over steps
    assert best_of_group(np.array([0, 0]), per_step, np.ones(2, bool), 1e-4).tolist() == [False, True]


def test_nft_optimality_and_losses_by_hand():
    np.testing.assert_allclose(nft_optimality(np.array([-3.0, -0.5, 0.0, 0.5, 2.0]), 1.0), [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(nft_optimality(np.array([[1.0, 3.0]]), 4.0), [0.75])
    pred, target = torch.zeros(2, 4), torch.ones(2, 4)
    assert raft_loss(pred, target, torch.tensor([2.0, 0.0])).item() == pytest.approx(1.0)  # (2 * 1 + 0) / 2
    # At pred == old the gradient is 2 b (2r - 1) (old - target) / D per row, times weight / N.
    torch.manual_seed(0)
    old, target = torch.randn(3, 5), torch.randn(3, 5)
    pred = old.clone().requires_grad_(True)
    r, w, beta = torch.tensor([1.0, 0.5, 0.2]), torch.tensor([1.0, 1.0, 0.0]), 0.7
    nft_loss(pred, old, target, r, beta, w).backward()
    expect = 2 * beta * (2 * r - 1).view(-1, 1) * (old - target) / 5 * w.view(-1, 1) / 3
    torch.testing.assert_close(pred.grad, expect)
    # r = 1, beta = 1: the positive branch alone, i.e. the plain denoising loss
    p = torch.randn(3, 5)
    assert nft_loss(p, old, target, torch.ones(3), 1.0, torch.ones(3)).item() == pytest.approx(
        raft_loss(p, target, torch.ones(3)).item(), rel=1e-6)


def test_pass_at_k_by_hand():
    cond = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    ok = np.array([0, 0, 1, 0, 0, 0, 1, 1, 1, 1], bool)
    assert pass_at_k(cond, ok, 3) == pytest.approx(2 / 3)  # condition 3 has 1 sample, not k: left out
    details = {"toyworld/strict_accuracy": np.array([1.0, 0.0])}
    assert passed(np.array([0.2, 0.9]), details).tolist() == [True, False]
    assert passed(np.array([1.0, 0.9]), {}).tolist() == [True, False]


OBJECTIVES = ["raft", "nft"]


@pytest.fixture(scope="module")
def trainer_runs(request, tmp_path_factory):
    """{objective: finished trainer process} for the objectives this session runs, side by side (one single-threaded
    process each)."""
    objectives = selected_params(request, OBJECTIVES)
    if "nft" not in objectives and any(i.name == "test_nft_with_soft_update_resumes_exactly" for i in request.session.items):
        objectives.append("nft")  # the resume test starts from the nft run's checkpoint
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    jobs = []
    for objective in objectives:
        cmd = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=1",
               f"--config.logdir={tmp_path_factory.mktemp(objective)}", "--config.run_name=r",
               f"--config.train.objective={objective}",
               "--config.sample.num_steps=4", "--config.sample.batch_size=8", "--config.sample.num_batches_per_epoch=2",
               "--config.sample.k=4", "--config.train.batch_size=8", "--config.eval_freq=1", "--config.eval.num_samples=8",
               "--config.eval.pass_at_k=2", "--config.logging.wandb=False", "--config.logging.image_freq=0",
               "--config.save_freq=0", "--config.logging.debug_dump=True"]
        if objective == "nft":  # with DiffusionNFT's soft-updated sampling policy, saved in the checkpoint
            cmd += ["--config.train.nft_old_decay=0.5", "--config.save_freq=1"]
        jobs.append(dict(args=cmd, cwd=ROOT, env=env))
    return dict(zip(objectives, run_side_by_side(jobs)))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_trainer_runs_each_forward_objective(trainer_runs, objective):
    p = trainer_runs[objective]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "GRPO check: 16 samples = 4 conditions x k=4 (exact)" in p.stdout
    assert "pass_at_2" in p.stdout and "epoch 0: reward" in p.stdout
    logdir = next(a for a in p.args if a.startswith("--config.logdir=")).split("=", 1)[1]
    summary = json.load(open(os.path.join(logdir, "r", "summary.json")))
    (h,) = summary["history"]
    assert h["train"]["loss"] > 0 and h["train"]["grad_norm"] > 0
    # The no-gold control of test_hacking's best-by-gold export: evals (epochs 0 and 1) but no reward.gold, so no
    # best by gold and no export of it (nothing to rank the evals by)
    assert [e["epoch"] for e in summary["evals"]] == [0, 1] and summary["best_gold"] is None
    assert not os.path.exists(os.path.join(logdir, "r", "best_gold_export"))
    if objective == "raft":  # best-of-N: exactly one chosen sample per group with any reward spread (the groups
        # whose advantages are not zeroed), read off the epoch's dump
        dump = json.load(open(os.path.join(logdir, "r", "debug", "epoch_0000_rank_0.json")))
        keys = np.array(dump["keys_all"])
        adv = np.abs(np.array(dump["advantages_all"])).reshape(len(keys), -1)
        spread = sum(bool(adv[keys == k].max() > 0) for k in np.unique(keys))
        assert 0 < spread < len(keys) and h["train"]["chosen_samples"] == spread
    if objective == "nft":  # run state, stat tracker and theta_old registered for checkpointing
        ckpt = os.path.join(logdir, "r", "checkpoints", "checkpoint_00001")
        assert sorted(f for f in os.listdir(ckpt) if f.startswith("custom_checkpoint")) == [
            f"custom_checkpoint_{i}.pkl" for i in range(3)]
        # theta_old also as plain weights: the same tensors as the registered state, not the trained policy's
        from safetensors.torch import load_file

        old = torch.load(os.path.join(ckpt, "custom_checkpoint_2.pkl"), weights_only=False)["tensors"]
        plain = load_file(os.path.join(ckpt, "sampling_policy.safetensors"))
        policy = load_file(os.path.join(ckpt, "model.safetensors"))
        assert set(plain) == set(old) and all(torch.equal(plain[n], old[n]) for n in old)
        assert set(plain) <= set(policy) and any(not torch.equal(plain[n], policy[n]) for n in plain)


def test_nft_with_soft_update_resumes_exactly(trainer_runs, tmp_path):
    """The 1-epoch nft run's checkpoint resumed to 2 epochs ends bit-identical (trained weights and theta_old) to an
    uninterrupted 2-epoch run: theta_old is restored, not re-initialised from the policy."""
    first = trainer_runs["nft"]
    assert first.returncode == 0, first.stderr[-3000:]
    logdir = next(a for a in first.args if a.startswith("--config.logdir=")).split("=", 1)[1]
    base = [a for a in first.args if not a.startswith(("--config.num_epochs=", "--config.logdir="))]
    resumed = base + ["--config.num_epochs=2", f"--config.logdir={tmp_path / 'resumed'}",
                      f"--config.resume_from={os.path.join(logdir, 'r')}"]  # the first run's folder is left as it is
    straight = base + ["--config.num_epochs=2", f"--config.logdir={tmp_path / 'straight'}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    a, b = run_side_by_side([dict(args=resumed, cwd=ROOT, env=env), dict(args=straight, cwd=ROOT, env=env)])
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert "resumed from" in a.stdout
    from safetensors.torch import load_file

    for name in ("model.safetensors", "sampling_policy.safetensors"):
        x, y = (load_file(os.path.join(tmp_path, d, "r", "checkpoints", "checkpoint_00002", name))
                for d in ("resumed", "straight"))
        assert set(x) == set(y) and all(torch.equal(x[n], y[n]) for n in x), name
    line = lambda p: next(ln for ln in p.stdout.splitlines() if ln.startswith("epoch 1: reward")).rsplit("|", 1)[0]  # noqa: E731
    assert line(a) == line(b)

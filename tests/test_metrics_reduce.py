"""Training metrics over every process (metrics.METRIC_RULES): 2 gloo processes log what 1 process logs on the same
samples, where rank 0's own values differ; the reduction rules on made-up per-process values; the epoch line shows
only the metrics the objective has (no `ratio nan` for raft/nft)."""
import glob
import json
import os
import sys

import numpy as np
import pytest
import torch
from helpers import cpu_env, launch_cmd, run_side_by_side

from ddpo_grpo.trainer.run.reporting import epoch_line_train
from ddpo_grpo.trainer.epoch.metrics import METRIC_RULES, EpochMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# scripts/train.py on ONE process that samples what P processes x NB batches sample: its batch b is the epoch plan's
# (rank b % P, batch b // P) slice of that geometry (KRepeatSampler's flat plan is the same for every geometry of
# the same total), drawn with that process's sampling generator. So both runs train on the same 16 samples.
REPLAY = r'''
import os, runpy, sys
import numpy as np, torch
import ddpo_grpo.trainer.epoch.sampling as S

P = int(os.environ["REPLAY_PROCESSES"])
real_sample_epoch, real_pipe = S.sample_epoch, S.pipeline_with_logprob
state = {}

def sample_epoch(ctx, epoch):
    state.update(seed=ctx.config.seed, epoch=epoch, b=0)
    return real_sample_epoch(ctx, epoch)

def pipe(*a, **kw):
    b = state["b"]
    state["b"] += 1
    kw["generator"] = torch.Generator().manual_seed(
        int(np.random.default_rng((state["seed"], state["epoch"], b % P, b // P)).integers(2**62)))
    return real_pipe(*a, **kw)

S.sample_epoch, S.pipeline_with_logprob = sample_epoch, pipe
sys.argv[0] = os.path.join(os.getcwd(), "scripts", "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''

# 16 samples = 4 conditions x k=4; all trained steps in one call; one optimizer step per pass, 2 passes (so the
# second pass sees ratios != 1 and clipping); a KL to the start model; an lr that moves the policy visibly.
COMMON = ["--config", "config/grpo.py:tiny", "--config.num_epochs=1", "--config.eval_freq=0", "--config.save_freq=0",
          "--config.logging.wandb=False", "--config.logging.tensorboard=False", "--config.logging.image_freq=0",
          "--config.logging.debug_dump=True", "--config.sample.num_steps=4", "--config.sample.k=4",
          "--config.sample.batch_size=4", "--config.train.timestep_fraction=1.0", "--config.train.timesteps_per_call=4"]
GRPO = ["--config.train.num_inner_epochs=2", "--config.train.beta=0.05", "--config.train.learning_rate=1e-3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    (tmp / "replay.py").write_text(REPLAY)
    env = cpu_env(PYTHONPATH=ROOT)
    log = [f"--config.logdir={tmp}"]
    two = [*launch_cmd(2, 28600), "scripts/train.py", *COMMON, *GRPO, *log, "--config.run_name=two",
           "--config.sample.num_batches_per_epoch=2", "--config.train.batch_size=8"]
    one = [sys.executable, str(tmp / "replay.py"), *COMMON, *GRPO, *log, "--config.run_name=one",
           "--config.sample.num_batches_per_epoch=4", "--config.train.batch_size=16"]
    nft = [sys.executable, "scripts/train.py", *COMMON, *log, "--config.run_name=nft", "--config.train.objective=nft",
           "--config.sample.num_batches_per_epoch=4", "--config.train.batch_size=8"]
    jobs = [dict(args=cmd, cwd=ROOT, env=dict(env, REPLAY_PROCESSES="2")) for cmd in (two, one, nft)]
    out = {}
    for name, p in zip(("two", "one", "nft"), run_side_by_side(jobs)):
        assert p.returncode == 0, name + "\n" + p.stdout[-3000:] + p.stderr[-3000:]
        (line,) = [s for s in (p.stdout + p.stderr).splitlines() if s.startswith("epoch 0: reward")]
        (entry,) = json.load(open(tmp / name / "summary.json"))["history"]
        dumps = [json.load(open(f)) for f in sorted(glob.glob(str(tmp / name / "debug" / "epoch_0000_rank_*.json")))]
        out[name] = dict(line=line, train=entry["train"], dumps=dumps)
    return out


def test_two_processes_log_what_one_process_logs_on_the_same_samples(runs):
    one, two = runs["one"], runs["two"]
    (d1,), (r0, r1) = one["dumps"], two["dumps"]
    # the same samples (rewards by condition), and the same update: the comparison below is of like with like
    assert sorted(zip(d1["keys_all"], d1["rewards_all"])) == sorted(zip(r0["keys_all"], r0["rewards_all"]))
    np.testing.assert_allclose(d1["weights_sum"], r0["weights_sum"], rtol=1e-7)
    np.testing.assert_allclose(d1["weights_abs_sum"], r0["weights_abs_sum"], rtol=1e-7)
    # rank 0's own share of the advantages is far from the all-process mean 0, so its own loss would be too
    # (the first pass's loss is -mean(advantage) at ratio 1): a rank-0-only value cannot pass the check below
    assert abs(np.mean(r0["advantages"])) > 0.02 and abs(np.mean(r0["advantages_all"])) < 1e-6
    a, b = one["train"], two["train"]
    assert set(a) == set(b) and {"loss", "policy_loss", "kl", "approx_kl", "ratio_mean", "ratio_min", "ratio_max",
                                 "clipfrac", "grad_norm", "onpolicy_ratio_max_dev", "policy_shift_kl",
                                 "nonfinite_loss", "skipped_steps"} <= set(a)
    assert a["clipfrac"] > 0.05 and a["ratio_mean"] < 0.99 and a["kl"] > 1e-3  # the second pass moved
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    # the epoch line: the same training part on both
    assert two["line"].split(" | ")[1] == one["line"].split(" | ")[1]


def test_nft_epoch_line_and_logs_hold_only_its_metrics(runs):
    line, train = runs["nft"]["line"], runs["nft"]["train"]
    assert set(train) == {"loss", "grad_norm", "chosen_samples", "skipped_steps", "nonfinite_loss", "lr"}
    assert "nan" not in line and "ratio" not in line and "clipfrac" not in line
    assert f"| loss {train['loss']:.4g} |" in line and train["loss"] > 0


class _Ranks:
    """An accelerator of P processes where this is rank `rank`: gather concatenates every process's tensor."""

    def __init__(self, per_rank, rank):
        self.per_rank, self.rank, self.device = per_rank, rank, torch.device("cpu")

    def gather(self, t):
        parts = [torch.as_tensor(m.local().reshape(-1), dtype=t.dtype) for m in self.per_rank]
        assert torch.equal(parts[self.rank], t)
        return torch.cat(parts)


def test_reduction_rules_on_processes_with_different_counts():
    r0, r1 = EpochMetrics(), EpochMetrics()
    r0.add("loss", 1.0, 6)  # two calls, 6 and 2 kept rows
    r0.add("loss", 3.0, 2)
    r1.add("loss", -2.0, 4)  # one call of 4 rows (its other calls had no kept rows)
    for m, lo, hi in ((r0, 0.90, 1.01), (r1, 0.80, 1.03)):
        m.add("ratio_min", lo)
        m.add("ratio_max", hi)
        m.add("onpolicy_ratio_max_dev", hi - 1)
        for g in (0.5, 0.7):  # two optimizer steps, the same norm on both processes
            m.add("grad_norm", g)
        m.add("skipped_steps", 1.0)  # the same step skipped on both
        m.add("lr", 1e-3)
    r1.add("nonfinite_loss", 1.0)
    r1.add("nonfinite_loss", 1.0)
    r1.add("kl_untrained", 0.25, 4)
    for rank in (0, 1):  # both processes get the same values
        out = (r0, r1)[rank].reduce(_Ranks([r0, r1], rank))
        assert out["loss"] == pytest.approx((6 * 1.0 + 2 * 3.0 - 4 * 2.0) / 12)  # per row, not per process
        assert out["ratio_min"] == 0.80 and out["ratio_max"] == 1.03
        assert out["onpolicy_ratio_max_dev"] == pytest.approx(0.03)
        assert out["grad_norm"] == pytest.approx(0.6) and out["skipped_steps"] == 1.0
        assert out["nonfinite_loss"] == 2.0 and out["kl_untrained"] == 0.25  # only rank 1 saw them
        assert out["lr"] == 1e-3
        assert "ratio_mean" not in out and "kl" not in out  # no process had them: not logged, not nan
    empty = EpochMetrics().reduce(_Ranks([EpochMetrics()], 0))
    assert empty == {"nonfinite_loss": 0.0, "skipped_steps": 0.0}  # counts are always there
    with pytest.raises(KeyError):
        EpochMetrics().add("a_metric_without_a_rule", 1.0)
    assert set(METRIC_RULES.values()) <= {"mean", "max", "min", "sum", "steps", "shared"}


def test_epoch_line_shows_only_the_objectives_metrics():
    # GRPO: the README's example line ("What a run shows")
    grpo = {"loss": 2.204e-05, "ratio_mean": 0.999908, "clipfrac": 0.0, "kl": 0.0, "onpolicy_ratio_max_dev": 0.0,
            "policy_shift_kl": 2.5e-4, "grad_norm": 0.3, "lr": 3e-5}
    assert epoch_line_train(grpo) == ("loss 2.204e-05 ratio 0.999908 clipfrac 0.000 kl 0.00e+00 onpolicy|r-1| 0.0e+00"
                                      " shift 2.5e-04")
    assert epoch_line_train({"loss": 0.01234, "grad_norm": 0.3, "chosen_samples": 4.0}) == "loss 0.01234"
    assert epoch_line_train({}) == ""

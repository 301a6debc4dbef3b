"""scripts/bench.py end to end at minimal settings: one floor measurement and one trainer measurement.
Checks the JSON's shape and that the numbers are positive; never the timings themselves."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_script", os.path.join(ROOT, "scripts", "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_floor_and_one_trainer_run(tmp_path):
    bench = load_bench()
    bench.main(["--epochs", "1", "--batch-sizes", "4", "--cfg", "off", "--malloc", "default", "--threads", "1",
                "--set", "sample.num_steps=3", "sample.num_batches_per_epoch=2", "sample.k=4", "train.min_step_std=0",
                "train.timestep_fraction=0.5",
                "--run-timeout", "300", "--out", str(tmp_path)])
    with open(tmp_path / "bench.json") as f:
        res = json.load(f)
    assert {"meta", "floors", "runs", "gains", "efficacy"} <= set(res)

    (fl,) = res["floors"]
    assert "error" not in fl, fl.get("error")
    for key in ("sampling_s", "training_s", "total_s", "peak_rss_mb"):
        assert fl[key] > 0, key
    assert fl["sampling_forwards"] == 2 * 3 and fl["sampling_rows_per_forward"] == 4
    # 8 samples x round(3 * 0.5) = 2 trained timesteps each, one timestep per call of 4 samples
    assert fl["train_sample_timesteps"] == 16 and fl["train_calls"] == 4 and fl["optimizer_steps"] == 2
    assert all(v > 0 for v in fl["memory_estimate_mb"].values())

    (run,) = res["runs"]
    assert "error" not in run, run.get("error")
    for key in ("epoch_s", "samples_per_s", "peak_rss_mb", "overhead", "overhead_sampling", "overhead_training",
                "rss_over_floor"):
        assert run[key] > 0, key
    assert run["samples_per_epoch"] == 8 and run["measured_epochs"] == [0]
    assert {"sampling", "reward", "advantages", "verification", "training"} <= set(run["phases_s"])
    assert res["gains"] == [] and res["efficacy"] is None
    assert res["meta"]["plot"] == str(tmp_path / "bench.png") and (tmp_path / "bench.png").stat().st_size > 1000


def test_interleaved_floor_and_trainer_in_one_process(tmp_path):
    """--mode interleaved: floor and trainer epochs alternate in one process; the best of the rounds after the
    warm-up round counts on each side, and the ratios are those bests' quotients."""
    import subprocess
    import sys

    out = tmp_path / "inter.json"
    subprocess.run([sys.executable, "-m", "benchmarks.bench_floor", "--config", "config/grpo.py:tiny",
                    "--config.sample.num_steps=3", "--config.sample.batch_size=4", "--config.train.batch_size=4",
                    "--config.sample.num_batches_per_epoch=2", "--config.sample.k=4", "--config.train.min_step_std=0",
                    "--mode=interleaved", "--repeats=2", f"--out={out}"],
                   cwd=ROOT, check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    res = json.loads(out.read_text())
    assert res["rounds"] == 2 and len(res["floor_runs"]) == len(res["trainer_runs"]) == 3
    for side in ("floor", "trainer"):
        for k in ("sampling_s", "training_s"):
            runs = [r[k] for r in res[f"{side}_runs"]]
            assert all(v > 0 for v in runs) and res[f"{side}_{k}"] == min(runs[1:])  # warm-up round dropped
    assert abs(res["overhead_training"] - res["trainer_training_s"] / res["floor_training_s"]) < 1e-12
    total = lambda side: res[f"{side}_sampling_s"] + res[f"{side}_training_s"]  # noqa: E731
    assert abs(res["overhead"] - total("trainer") / total("floor")) < 1e-12
    # per-round pairs (warm-up dropped): each trainer epoch against the floor epoch before it, and the median
    wall = lambda r: r["sampling_s"] + r["training_s"]  # noqa: E731
    pairs = list(zip(res["floor_runs"], res["trainer_runs"]))[1:]
    assert res["overhead_per_round"] == pytest.approx([wall(t) / wall(f) for f, t in pairs], rel=1e-12)
    assert res["overhead_paired_median"] == pytest.approx(sorted(res["overhead_per_round"])[0] / 2
                                                          + sorted(res["overhead_per_round"])[1] / 2, rel=1e-12)
    assert all(r["cpu_s"] > 0 for r in res["floor_runs"] + res["trainer_runs"])
    assert res["overhead_cpu_per_round"] == pytest.approx([t["cpu_s"] / f["cpu_s"] for f, t in pairs], rel=1e-12)


def test_efficacy_jobs_label_runs_by_config_and_seed():
    bench = load_bench()
    jobs = bench.efficacy_jobs(["/c/grpo.py:tiny", "/c/grpo.py:ddpo"], [42, 1])
    assert [(j[0], j[2]) for j in jobs] == [("tiny_s42", ["seed=42"]), ("tiny_s1", ["seed=1"]),
                                           ("ddpo_s42", ["seed=42"]), ("ddpo_s1", ["seed=1"])]
    assert [(j[0], j[2]) for j in bench.efficacy_jobs(["/c/grpo.py:tiny"], [])] == [("tiny", [])]
    assert [j[0] for j in bench.efficacy_jobs(["/c/grpo.py:tiny"], [7])] == ["tiny"]
    import pytest

    with pytest.raises(SystemExit, match="share a name"):
        bench.efficacy_jobs(["/a/grpo.py:tiny", "/b/grpo.py:tiny"], [])


def test_efficacy_two_seeds_in_parallel(tmp_path):
    """--efficacy-seeds 1,2 --efficacy-parallel 2: one curve per seed, both from the same untrained model."""
    bench = load_bench()
    res = bench.main(["--no-speed", "--efficacy", "--efficacy-configs", "config/grpo.py:tiny", "--efficacy-seeds", "1,2",
                      "--efficacy-parallel", "2", "--efficacy-epochs", "2", "--efficacy-eval-freq", "1",
                      "--threads", "1", "--malloc", "default",
                      "--set", "sample.num_steps=3", "sample.batch_size=4", "train.batch_size=4",
                      "sample.num_batches_per_epoch=2", "sample.k=4", "train.min_step_std=0", "eval.num_samples=8",
                      "eval.batch_size=8", "eval.pass_at_k=0", "--run-timeout", "300", "--out", str(tmp_path)])
    eff = res["efficacy"]
    assert eff["seeds"] == [1, 2] and eff["parallel"] == 2 and list(eff["runs"]) == ["tiny_s1", "tiny_s2"]
    s1, s2 = eff["runs"]["tiny_s1"], eff["runs"]["tiny_s2"]
    assert "error" not in s1 and "error" not in s2, (s1.get("error"), s2.get("error"))
    assert s1["overrides"] == ["seed=1"] and s2["overrides"] == ["seed=2"]
    assert s1["start"] == s2["start"]  # the eval does not depend on the training seed
    for e in (s1, s2):
        # evals before epochs 0 and 1, and after the last: 0, 8 and 16 samples trained
        assert [p["samples"] for p in e["curve"]] == [0, 8, 16]
        assert e["curve"][0]["metric"] == e["start"]  # epoch 0's eval is the untrained model's
        assert e["final"] == e["curve"][-1]["metric"]


def test_efficacy_from_run_folders(tmp_path):
    """--efficacy-runs: curves of finished runs (summary.json) and of unfinished ones (the newest complete
    checkpoint's run state; a half-written .tmp- checkpoint is never read), with samples summed over the epochs
    trained before each eval, and the target halfway from the lowest start to the best final value."""
    import torch

    bench = load_bench()

    def epoch(e, samples, ev=None, nfe=None):
        h = {"epoch": e, "reward_mean": 0.5, "time": 10.0 + (3.0 if ev is not None else 0.0),
             "phases": {"eval": 3.0} if ev is not None else {}, "samples": samples}
        if nfe is not None:
            h["nfe_per_sample"] = nfe
        if ev is not None:
            h.update({"eval_reward_mean": ev, "eval/toyworld/strict_accuracy": ev, "eval/pass_at_1_stochastic": ev + 0.125})
        return h

    done = tmp_path / "done"
    done.mkdir()
    nfe = {"sampling": 10.0, "training": 2.5, "eval": 7.0}  # eval rows are not the training cost
    hist = [epoch(0, 64, 0.25, nfe), epoch(1, 64, None, nfe), epoch(2, 64, 0.5, nfe), epoch(3, 64, None, nfe)]
    final = {"eval/reward_mean": 0.75, "eval/toyworld/strict_accuracy": 0.75, "eval/pass_at_1_stochastic": 0.875}
    (done / "summary.json").write_text(json.dumps({"seconds": 1.0, "history": hist, "final_eval": final}))
    going = tmp_path / "going"
    for name, h in (("checkpoint_00002", [epoch(0, 32, 0.375), epoch(1, 32)]),
                    ("checkpoint_00004", [epoch(0, 32, 0.375), epoch(1, 32), epoch(2, 32, 0.4375), epoch(3, 32)]),
                    (".tmp-checkpoint_00006", [epoch(0, 32, 0.0)])):
        (going / "checkpoints" / name).mkdir(parents=True)
        (going / "checkpoints" / name / "run_meta.json").write_text("{}")  # what marks a checkpoint complete
        torch.save({"epoch": len(h), "global_step": 0, "history": h}, going / "checkpoints" / name / "custom_checkpoint_0.pkl")

    res = bench.main(["--no-speed", "--efficacy-runs", f"{done},{going}", "--out", str(tmp_path / "out")])
    eff = res["efficacy"]
    d, g = eff["runs"]["done"], eff["runs"]["going"]
    assert [(p["epoch"], p["samples"], p["metric"]) for p in d["curve"]] == [(0, 0, 0.25), (2, 128, 0.5), (4, 256, 0.75)]
    assert [p["wall_s"] for p in d["curve"]] == [0.0, 20.0, 40.0]  # eval seconds left out
    assert [p["nfe"] for p in d["curve"]] == [0.0, 128 * 12.5, 256 * 12.5]  # (sampling + training) rows per sample
    assert [p["nfe"] for p in g["curve"]] == [None, None]  # a history from before NFEs were logged
    assert [(p["epoch"], p["samples"], p["metric"]) for p in g["curve"]] == [(0, 0, 0.375), (2, 64, 0.4375)]
    assert g["source"].endswith("checkpoint_00004/custom_checkpoint_0.pkl")
    assert eff["start"] == 0.25 and eff["target"] == 0.5  # 0.25 + (0.75 - 0.25) / 2
    assert d["to_target"] == {"reached": True, "epoch": 2, "samples": 128, "samples_interp": 128.0, "wall_s": 20.0}
    assert g["to_target"]["reached"] is False
    res = bench.main(["--no-speed", "--efficacy-runs", str(done), "--metric", "eval/pass_at_1_stochastic",
                      "--out", str(tmp_path / "out2")])
    assert [p["metric"] for p in res["efficacy"]["runs"]["done"]["curve"]] == [0.375, 0.625, 0.875]
    res = bench.main(["--no-speed", "--efficacy-runs", str(done / "summary.json"), "--out", str(tmp_path / "out4")])
    assert list(res["efficacy"]["runs"]) == ["summary"] and res["efficacy"]["runs"]["summary"]["final"] == 0.75
    with pytest.raises(SystemExit, match="neither summary.json nor a checkpoint"):
        bench.main(["--no-speed", "--efficacy-runs", str(tmp_path / "out"), "--out", str(tmp_path / "out3")])

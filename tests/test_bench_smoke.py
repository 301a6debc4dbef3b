"""scripts/bench.py end to end at minimal settings: one floor measurement and one trainer measurement.
Checks the JSON's shape and that the numbers are positive; never the timings themselves."""
import importlib.util
import json
import os

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

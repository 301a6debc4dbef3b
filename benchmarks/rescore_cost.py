"""What re-scoring the old log-probs (train.old_logprobs="rescore") costs, and what "auto" saves of it: the training
phase of the same run with the sampler's log-probs, re-scored, and "auto" (re-scored in the first epoch, then the
sampler's while they agree bit for bit), interleaved (A B C A B C ...) so that load on the machine falls on all alike.

    python benchmarks/rescore_cost.py [--config tiny] [--epochs 3] [--repeats 2] [--modes sampling rescore auto]
        [--out bench_results/rescore_cost.json] [-- --config.sample.num_batches_per_epoch=2 ...]

Each run is scripts/train.py in its own process (one CPU thread); reported: the training phase's seconds per epoch
after the first (the first pays for allocation), the ratios to "sampling", each mode's onpolicy |r - 1| and sampler
gap, and auto's counts (old_logprobs_rescored_epochs / old_logprobs_sampler_epochs from summary.json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, mode: str, epochs: int, logdir: str, name: str, extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "scripts/train.py", "--config", f"config/grpo.py:{config}", f"--config.num_epochs={epochs}",
           f"--config.logdir={logdir}", f"--config.run_name={name}", f"--config.train.old_logprobs={mode}",
           "--config.eval_freq=0", "--config.save_freq=0", "--config.logging.image_freq=0",
           "--config.logging.wandb=False", "--config.logging.tensorboard=False", *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{p.stderr[-2000:]}")
    history = json.load(open(os.path.join(logdir, name, "summary.json")))["history"]
    later = history[1:] or history
    last = history[-1]["train"]
    return {"training_s": sum(h["phases"]["training"] for h in later) / len(later),
            "sampling_s": sum(h["phases"]["sampling"] for h in later) / len(later),
            "onpolicy_max_dev": max(h["train"].get("onpolicy_ratio_max_dev", 0.0) for h in history),
            "sampler_gap_max": max((h["train"]["sampler_gap_max"] for h in history if "sampler_gap_max" in h["train"]),
                                   default=None),
            "rescored_epochs": last.get("old_logprobs_rescored_epochs"),
            "sampler_epochs": last.get("old_logprobs_sampler_epochs"),
            "rescored_per_epoch": [h["train"].get("old_logprobs_rescored") for h in history]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["sampling", "rescore", "auto"])
    ap.add_argument("--out", default="bench_results/rescore_cost.json")
    ap.add_argument("extra", nargs="*", help="more --config.* overrides")
    args = ap.parse_args(argv)
    rows = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):
            for mode in rows:
                rows[mode].append(run(args.config, mode, args.epochs, d, f"{mode}_{r}", args.extra))
                print(mode, r, rows[mode][-1], flush=True)
    mean = {m: sum(x["training_s"] for x in v) / len(v) for m, v in rows.items()}
    base = mean.get("sampling")
    out = {"config": args.config, "epochs": args.epochs, "extra": args.extra, "runs": rows, "training_s": mean,
           "training_ratio": {m: v / base for m, v in mean.items()} if base else None}
    print("training phase per epoch (epochs 1 on): " + ", ".join(
        f"{m} {v:.2f} s" + (f" (x{v / base:.3f})" if base else "") for m, v in mean.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

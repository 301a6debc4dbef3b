"""The learning-efficacy half of scripts/bench.py: held-out eval curves against samples and wall time, one per
(config, seed), the target line between the start and the best final value, and how soon each run reaches it.

Curves come from trainer runs the bench launches (`--efficacy`), or from run folders a user already has
(`--efficacy-runs logs/a,logs/b`: each folder's summary.json, or for a run still going or stopped early its newest
checkpoint's run state), so a long run trained by hand lands on the same table and plot as the bench's own."""
from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Dict, List, Optional

from benchmarks import refuse  # a refusal: one line, exit 2
from benchmarks.bench_plots import plot_efficacy
from benchmarks.bench_report import fmt, say
from benchmarks.bench_runs import measure_trainer, pretrained_eval


def eval_metric(entry: Dict, metric: str) -> Optional[float]:
    if metric in entry:
        return entry[metric]
    if metric == "eval/reward_mean":
        return entry.get("eval_reward_mean")
    return None


def curve(history: List[Dict], metric: str, final_eval: Optional[Dict] = None) -> List[Dict]:
    """Eval points against cumulative samples, denoiser evaluations (NFEs: sampling and training rows, CFG counted
    twice; a branched tree's shared trunk once) and wall seconds (without eval) trained *before* each eval: the
    trainer evaluates at the start of an epoch, and once more after the last one (`final_eval`). Histories written
    before NFEs were logged give nfe None."""
    pts, samples, wall = [], 0, 0.0
    nfe = 0.0 if all("nfe_per_sample" in h for h in history) else None
    for h in history:
        if "eval_reward_mean" in h:
            pts.append({"epoch": h["epoch"], "samples": samples, "nfe": nfe, "wall_s": wall,
                        "metric": eval_metric(h, metric), "eval_reward_mean": h.get("eval_reward_mean")})
        samples += h["samples"]
        if nfe is not None:
            nfe += h["samples"] * sum(h["nfe_per_sample"].get(k, 0.0) for k in ("sampling", "training"))
        wall += h["time"] - h["phases"].get("eval", 0.0)
    if final_eval:
        pts.append({"epoch": len(history), "samples": samples, "nfe": nfe, "wall_s": wall,
                    "metric": final_eval.get(metric), "eval_reward_mean": final_eval.get("eval/reward_mean")})
    return pts


def first_reach(points: List[Dict], target: float, start: Optional[float]) -> Dict:
    """First eval point at or above target, and the samples linearly interpolated to the crossing."""
    if start is not None and start >= target:
        return {"reached": True, "epoch": None, "samples": 0, "samples_interp": 0.0, "wall_s": 0.0}
    prev = {"samples": 0, "wall_s": 0.0, "metric": start}
    for p in points:
        if p["metric"] is not None and p["metric"] >= target:
            interp = p["samples"]
            if prev["metric"] is not None and p["metric"] > prev["metric"]:
                f = (target - prev["metric"]) / (p["metric"] - prev["metric"])
                interp = prev["samples"] + max(0.0, min(1.0, f)) * (p["samples"] - prev["samples"])
            return {"reached": True, "epoch": p["epoch"], "samples": p["samples"], "samples_interp": interp,
                    "wall_s": p["wall_s"]}
        if p["metric"] is not None:
            prev = p
    return {"reached": False, "epoch": None, "samples": None, "samples_interp": None, "wall_s": None}


def efficacy_jobs(configs: List[str], seeds: List[int]) -> List[tuple]:
    """(label, config, extra overrides) per efficacy run: one per config and seed; labels carry the seed only
    when there are several (`tiny_s1`), so single-seed reports keep the config names."""
    jobs = []
    for config in configs:
        name = config.rsplit(":", 1)[-1]
        for seed in seeds or [None]:
            label = name if len(seeds) <= 1 else f"{name}_s{seed}"
            jobs.append((label, config, [] if seed is None else [f"seed={seed}"]))
    if len({j[0] for j in jobs}) != len(jobs):
        refuse("--efficacy-configs: two configs share a name; each run needs its own label")
    return jobs


def efficacy_run(args, overrides: List[str], workdir: str, malloc: str, job: tuple) -> Dict:
    """One efficacy curve: the untrained model's eval, then the trainer with eval every --efficacy-eval-freq."""
    label, config, extra = job
    say(f"efficacy: pretrained eval for {label} ...")
    pre = pretrained_eval(config, [*overrides, *extra], workdir, malloc, args.threads, args.run_timeout, tag=label)
    say(f"efficacy: training {label} for {args.efficacy_epochs} epochs, eval every {args.efficacy_eval_freq} ...")
    run = measure_trainer(config, None, None, args.efficacy_epochs, malloc, None, [*overrides, *extra], workdir,
                          name=f"efficacy_{label}", eval_freq=args.efficacy_eval_freq, threads=args.threads,
                          timeout=args.run_timeout * 4)
    entry = {"config": config, "overrides": extra, "peak_rss_mb": run.get("peak_rss_mb"),
             "process_wall_s": run.get("process_wall_s")}
    if "error" in pre:
        entry["pretrained_error"] = pre["error"]
    else:
        entry["start"] = pre["metrics"].get(args.metric)
        entry["start_eval_reward_mean"] = pre["metrics"].get("eval/reward_mean")
    if "error" in run:
        entry["error"] = run["error"]
    else:
        entry["curve"] = curve(run["history"], args.metric, run.get("final_eval"))
        entry["final"] = entry["curve"][-1]["metric"] if entry["curve"] else None
    say(f"efficacy: {label} done" + (" (FAILED)" if "error" in entry else f", final {fmt(entry.get('final'), '.4f')}"))
    return entry


def run_efficacy(args, overrides: List[str], workdir: str, configs: List[str]) -> Dict:
    """Train every config (x seed) with evals on the way; `configs` are resolved config specs."""
    seeds = [int(s) for s in str(args.efficacy_seeds).split(",") if s.strip()]
    jobs = efficacy_jobs(configs, seeds)
    malloc = args.malloc.split(",")[0].strip()
    out = {"configs": configs, "seeds": seeds, "epochs": args.efficacy_epochs, "metric": args.metric,
           "malloc": malloc, "parallel": args.efficacy_parallel, "runs": {}}
    # Runs are subprocesses: threads only wait on them. In parallel they share the machine (several small runs on
    # one GPU), so their wall seconds are not comparable with a run alone.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.efficacy_parallel)) as pool:
        entries = list(pool.map(lambda job: efficacy_run(args, overrides, workdir, malloc, job), jobs))
    out["runs"] = {job[0]: e for job, e in zip(jobs, entries)}
    return summarize(out, args.target, os.path.join(args.out, "efficacy.png"))


def run_history(run_dir: str) -> tuple:
    """(history, final_eval, source) of a trainer run folder: summary.json when the run finished, else the
    newest complete checkpoint's run state (a run still going, or stopped early), without a final eval. A path to
    a summary JSON itself (the bench's own runs/efficacy_<label>_summary.json) is read as it is."""
    summary = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, "summary.json")  # or the file itself
    if os.path.isfile(summary):
        with open(summary) as f:
            s = json.load(f)
        return s["history"], s.get("final_eval"), summary
    import torch

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.run.checkpointing import resolve_resume

    try:
        ckpt = resolve_resume(run_dir)  # the trainer's own rule: the newest complete checkpoint, never a .tmp- one
    except ConfigError:
        refuse(f"--efficacy-runs: {run_dir} has neither summary.json nor a checkpoint")
    # custom_checkpoint_0.pkl is the RunState's state dict (trainer/run/build.py registers it first with accelerate)
    state_path = os.path.join(ckpt, "custom_checkpoint_0.pkl")
    state = torch.load(state_path, weights_only=True)  # plain ints, floats, strings and lists
    return state["history"], None, state_path


def efficacy_from_runs(run_dirs: List[str], metric: str, target: Optional[float], out_dir: str) -> Dict:
    """The efficacy table and plot of existing run folders, labelled by folder name."""
    out = {"configs": [], "seeds": [], "epochs": None, "metric": metric, "runs": {}, "from_runs": run_dirs}
    for d in run_dirs:
        history, final_eval, source = run_history(d)
        pts = curve(history, metric, final_eval)
        label = os.path.basename(os.path.normpath(d)).removesuffix("_summary.json").removesuffix(".json")
        # The start is the curve's own first point (the trainer evaluates before epoch 0 trains).
        out["runs"][label] = {"source": source, "curve": pts, "final": pts[-1]["metric"] if pts else None}
        out["epochs"] = max(out["epochs"] or 0, len(history))
    return summarize(out, target, os.path.join(out_dir, "efficacy.png"))


def summarize(out: Dict, target: Optional[float], plot_path: str) -> Dict:
    """Adds start (mean of the runs' starts), the target (given, or halfway from the start to the best final
    value), each run's first reach of it, and the plot."""
    ok = [e for e in out["runs"].values() if e.get("curve")]
    starts = [e["start"] for e in out["runs"].values() if e.get("start") is not None]
    finals = [e["final"] for e in ok if e.get("final") is not None]
    start = sum(starts) / len(starts) if starts else (min(e["curve"][0]["metric"] for e in ok
                                                          if e["curve"][0]["metric"] is not None) if ok else None)
    note = None
    if target is None and start is not None and finals:
        if max(finals) > start:
            target = start + 0.5 * (max(finals) - start)
        else:
            note = f"no run ended above the start value {start:.4f}: no default target (give --target)"
    out["start"], out["target"], out["target_note"] = start, target, note
    if target is not None:
        for e in ok:
            e["to_target"] = first_reach(e["curve"], target, e.get("start", start))
    if ok:
        out["plot"] = plot_efficacy(out, plot_path)
    return out

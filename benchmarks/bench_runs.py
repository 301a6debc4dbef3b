"""Measurement runs for scripts/bench.py: the trainer and the bare-loop floor as subprocesses, each with its own
peak RSS and CPU-contention reading. The CLI, the efficacy comparison and the report stay in the script."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import refuse  # a refusal: one line, exit 2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "17179869184"}  # = Makefile's CPU_MALLOC
PHASES = ("sampling", "reward", "advantages", "verification", "training", "eval")
GUIDANCE_ON = 3.0


def child_env(malloc: str = "default", threads: Optional[int] = None) -> Dict[str, str]:
    """The parent's environment, offline, with exactly the requested allocator settings."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    for k in TUNED_MALLOC:
        env.pop(k, None)
    if malloc == "tuned":
        env.update(TUNED_MALLOC)
    elif malloc != "default":
        raise ValueError(f"unknown malloc mode {malloc!r}; choose default or tuned")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_measured(cmd: Sequence[str], env: Dict[str, str], log_path: str, timeout: float) -> Dict:
    """Run cmd to completion with stdout+stderr to log_path. Returns returncode, wall seconds and the peak
    RSS of this child alone (os.wait4's rusage: not mixed with earlier measurements)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline, timed_out = time.monotonic() + timeout, False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen from waiting again
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
            "peak_rss_mb": usage.ru_maxrss / 1024.0,  # Linux: KB
            "timed_out": timed_out, "log": log_path}


def cpu_busy(seconds: float = 0.5) -> Optional[float]:
    """Share of all CPUs busy (not idle/iowait) over the next `seconds`, from /proc/stat: what other
    processes take from a measurement that is about to start. None without /proc."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None


def log_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def config_args(config: str, overrides: Sequence[str]) -> List[str]:
    return ["--config", config] + [f"--config.{o}" for o in overrides]


def normalize_overrides(items: Sequence[str]) -> List[str]:
    out = []
    for item in items:
        item = item[2:] if item.startswith("--") else item
        item = item[len("config."):] if item.startswith("config.") else item
        if "=" not in item:
            refuse(f"--set {item!r}: expected key=value, e.g. --set train.beta=0.01")
        out.append(item)
    return out


def geometry_overrides(batch_size: int, cfg: bool, tpc: int) -> List[str]:
    return [f"sample.batch_size={batch_size}", f"train.batch_size={batch_size}",
            f"sample.guidance_scale={GUIDANCE_ON if cfg else 1.0}", f"train.timesteps_per_call={tpc}"]


# ------------------------------------------------------------------------------------------- measurements

def measure_floor(config: str, batch_size: int, cfg: bool, tpc: int = 1, overrides: Sequence[str] = (),
                  malloc: str = "tuned", workdir: str = ".", threads: Optional[int] = None,
                  timeout: float = 1800, repeats: int = 1) -> Dict:
    """The bare-loop floor of one epoch at this geometry, in its own subprocess."""
    name = f"floor_b{batch_size}_{'cfg' if cfg else 'nocfg'}_s{tpc}"
    out = os.path.join(workdir, name + ".json")
    cmd = [sys.executable, "-m", "benchmarks.bench_floor", *config_args(config, [
        *geometry_overrides(batch_size, cfg, tpc), *overrides]), f"--out={out}", f"--repeats={repeats}"]
    busy = cpu_busy()
    r = run_measured(cmd, child_env(malloc, threads), os.path.join(workdir, name + ".log"), timeout)
    res = {"name": name, "batch_size": batch_size, "cfg": cfg, "timesteps_per_call": tpc, "malloc": malloc,
           "peak_rss_mb": r["peak_rss_mb"], "process_wall_s": r["wall_s"], "returncode": r["returncode"],
           "cpu_busy_before": busy}
    if r["returncode"] != 0 or not os.path.exists(out):
        res["error"] = log_tail(r["log"])
        return res
    with open(out) as f:
        res.update({k: v for k, v in json.load(f).items() if k not in res})
    return res


def measure_trainer(config: str, batch_size: Optional[int], cfg: Optional[bool], epochs: int, malloc: str = "default",
                    tpc: Optional[int] = 1, overrides: Sequence[str] = (), workdir: str = ".", name: str = "",
                    eval_freq: int = 0, threads: Optional[int] = None, timeout: float = 3600) -> Dict:
    """One real trainer run (scripts/train.py) as a subprocess; per-phase seconds from its summary.json.

    batch_size / cfg / tpc None keep the config's own values (efficacy runs)."""
    geo = []
    if batch_size is not None:
        geo += [f"sample.batch_size={batch_size}", f"train.batch_size={batch_size}"]
    if cfg is not None:
        geo.append(f"sample.guidance_scale={GUIDANCE_ON if cfg else 1.0}")
    if tpc is not None:
        geo.append(f"train.timesteps_per_call={tpc}")
    name = name or f"train_b{batch_size}_{'cfg' if cfg else 'nocfg'}_{malloc}_s{tpc}"
    logdir = tempfile.mkdtemp(prefix="bench_", dir=workdir)
    args = [f"num_epochs={epochs}", *geo, f"eval_freq={eval_freq}", "save_freq=0", "logging.wandb=False",
            "logging.image_freq=0", f"logdir={logdir}", f"run_name={name}", *overrides]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *config_args(config, args)]
    busy = cpu_busy()
    r = run_measured(cmd, child_env(malloc, threads), os.path.join(workdir, name + ".log"), timeout)
    res = {"name": name, "config": config, "batch_size": batch_size, "cfg": cfg, "malloc": malloc,
           "timesteps_per_call": tpc, "epochs": epochs, "peak_rss_mb": r["peak_rss_mb"],
           "process_wall_s": r["wall_s"], "returncode": r["returncode"], "cpu_busy_before": busy}
    summary_path = os.path.join(logdir, name, "summary.json")
    if r["returncode"] != 0 or not os.path.exists(summary_path):
        res["error"] = ("timed out\n" if r["timed_out"] else "") + log_tail(r["log"])
        shutil.rmtree(logdir, ignore_errors=True)
        return res
    with open(summary_path) as f:
        summary = json.load(f)
    shutil.copy(summary_path, os.path.join(workdir, name + "_summary.json"))
    shutil.rmtree(logdir, ignore_errors=True)
    hist = summary["history"]
    res["history"] = hist
    res["final_eval"] = summary.get("final_eval")
    measured = hist[1:] if len(hist) > 1 else hist
    res["warmup_skipped"] = len(hist) > 1
    res["measured_epochs"] = [h["epoch"] for h in measured]
    n = len(measured)
    names = [p for p in dict.fromkeys(list(PHASES) + [k for h in measured for k in h["phases"]])
             if any(p in h["phases"] for h in measured)]
    res["epoch_s_mean"] = sum(h["time"] for h in measured) / n
    res["phases_s_mean"] = {p: sum(h["phases"].get(p, 0.0) for h in measured) / n for p in names}
    # Headline numbers: the best measured epoch (and best per phase), the same statistic as the floor's best of
    # its repeats; on a shared machine a slow epoch measures the neighbours, not the trainer.
    res["epoch_s"] = min(h["time"] for h in measured)
    res["phases_s"] = {p: min(h["phases"].get(p, 0.0) for h in measured) for p in names}
    res["samples_per_epoch"] = sum(h["samples"] for h in measured) / n
    res["samples_per_s"] = res["samples_per_epoch"] / res["epoch_s"] if res["epoch_s"] > 0 else None
    res["run_seconds"] = summary.get("seconds")
    return res


def pretrained_eval(config: str, overrides: Sequence[str], workdir: str, malloc: str, threads: Optional[int],
                    timeout: float = 1800, tag: str = "") -> Dict:
    """The trainer's deterministic eval of the untrained model (samples = 0 on the learning curve). `tag` names
    its files (default: the config's name)."""
    tag = tag or (config.rsplit(":", 1)[-1] if ":" in config else os.path.splitext(os.path.basename(config))[0])
    out = os.path.join(workdir, f"pretrained_eval_{tag}.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_floor", "--mode=eval", *config_args(config, overrides),
           f"--out={out}"]
    r = run_measured(cmd, child_env(malloc, threads), out[:-5] + ".log", timeout)
    if r["returncode"] != 0 or not os.path.exists(out):
        return {"error": log_tail(r["log"])}
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------- bench

def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def attach_floor(run: Dict, fl: Optional[Dict]) -> None:
    run["floor"] = fl["name"] if fl else None
    if not fl or "error" in fl or "error" in run:
        return
    run["floor_s"] = fl["total_s"]
    run["overhead"] = ratio(run["epoch_s"], fl["total_s"])
    run["overhead_sampling"] = ratio(run["phases_s"].get("sampling"), fl["sampling_s"])
    run["overhead_training"] = ratio(run["phases_s"].get("training"), fl["training_s"])
    run["rss_over_floor"] = ratio(run["peak_rss_mb"], fl["peak_rss_mb"])
    run["rss_over_floor_estimate"] = ratio(run["peak_rss_mb"], fl["memory_estimate_mb"]["total_mb"])


def gains(runs: List[Dict]) -> List[Dict]:
    """Each change against (1 timestep per call, default allocator) at the same B and CFG."""
    ok = {(r["batch_size"], r["cfg"], r["malloc"], r["timesteps_per_call"]): r for r in runs if "error" not in r}
    out = []
    for (B, cfg, malloc, tpc), r in ok.items():
        base = ok.get((B, cfg, "default", 1))
        if base is None or r is base:
            continue
        what = [w for w, on in ((f"malloc={malloc}", malloc != "default"), (f"timesteps_per_call={tpc}", tpc != 1)) if on]
        out.append({"batch_size": B, "cfg": cfg, "change": " + ".join(what), "malloc": malloc, "timesteps_per_call": tpc,
                    "epoch_s": r["epoch_s"], "baseline_epoch_s": base["epoch_s"],
                    "speedup": ratio(base["epoch_s"], r["epoch_s"]),
                    "training_speedup": ratio(base["phases_s"].get("training"), r["phases_s"].get("training")),
                    "peak_rss_mb": r["peak_rss_mb"], "baseline_peak_rss_mb": base["peak_rss_mb"]})
    return out

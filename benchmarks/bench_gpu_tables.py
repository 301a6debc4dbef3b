"""The tables scripts/bench_gpu.py prints: one markdown row per measured point (`table`), and gpu_check.sh's table
over the rows of bench_gpu.jsonl and the meta-device counts (`print_check_table`: time to first sample and its
phases, s/epoch, samples/s, training steps/s, MFU, peak against the memory plan, worst |r - 1| against its tolerance,
the sampler gap), whose exit status says whether every build finished on-policy."""
from __future__ import annotations

import json
import os

from benchmarks.bench_gpu_point import mfu


def table(points) -> str:
    """One markdown row per point; (floor) where sd15-random's floor was measured."""
    def with_floor(p, key, fmt, scale=1.0):
        if p.get(key) is None:
            return "n/a"
        floor = p.get("floor_" + key)
        return f"{p[key] * scale:{fmt}}" + ("" if floor is None else f" ({floor * scale:{fmt}})")

    lines = ["| model | mode | B | CFG | switch | px | s/epoch | samples/s (floor) | train steps/s (floor) | "
             "peak GB (floor) | MFU sample | MFU train |", "|---" * 12 + "|"]
    for p in points:
        head = (f"| {p['model']} | {p['mode']} | {p['batch_size']} | {'on' if p['cfg'] else 'off'} | {p['switch']} | "
                f"{p['resolution'] or 'native'} |")
        if "error" in p:
            lines.append(f"{head} {p['error']} ||||||")
            continue
        lines.append(f"{head} {p['epoch_s']:.1f} | {with_floor(p, 'samples_per_s', '.2f')} | "
                     f"{with_floor(p, 'train_steps_per_s', '.1f')} | {with_floor(p, 'peak_mem_mb', '.1f', 2**-10)} | "
                     f"{_fmt(p.get('mfu_sampling'))} | {_fmt(p.get('mfu_training'))} |")
    return "\n".join(lines)


def _fmt(v, fmt=".3f") -> str:
    """A measured number, or "-" where the point has none (--gpu-check points: their FLOPs come from counts.json,
    which the check's table joins; the first H100 run lost its per-point table to a KeyError here)."""
    return "-" if v is None else format(v, fmt)


def print_check_table(args) -> int:
    """gpu_check.sh's table over --table's rows (the last row of each build) and --counts' plans and FLOPs: one line
    per --expect build, in that order. Returns 1 when a build has no row (killed by its time-out or crashed before
    writing one: gpu_check.sh adds a row saying which), an error, or |r - 1| above its tolerance; else 0."""
    rows = {}
    if os.path.isfile(args.table):
        with open(args.table) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[r["model"]] = r
    counts = {}
    if args.counts and os.path.isfile(args.counts):
        with open(args.counts) as f:
            counts = json.load(f)
    expect = [m for m in args.expect.split(",") if m] or list(rows)
    num = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| build | B x steps | first sample s (load / move / embed / 1st step) | s/epoch | samples/s | "
             "train steps/s | MFU sample / train | peak / plan GiB | worst \\|r-1\\| (tol) | sampler gap max / mean |",
             "|---" * 10 + "|"]
    bad = []
    for m in expect:
        r = rows.get(m)
        if r is None or "error" in r:
            why = "no row" if r is None else r["error"]
            lines.append(f"| {m} | FAILED: {why} |" + " |" * 8)
            bad.append(m)
            continue
        c = counts.get(m, {})
        if "flops_fwd_row" in c and "flops_fwd_row" not in r:
            r.update(c)
            r.update(mfu(r, args.peak_tflops))
        st = r.get("startup") or {}
        first = (f"{num(st.get('total_s'), '.1f')} ({num(st.get('load_s'), '.1f')} / {num(st.get('move_s'), '.1f')}"
                 f" / {num(st.get('embeddings_s'), '.1f')} / {num(st.get('first_step_s'), '.1f')})")
        peak = None if r.get("peak_mem_mb") is None else r["peak_mem_mb"] / 1024
        dev, tol = r.get("onpolicy_ratio_max_dev"), r.get("onpolicy_tol")
        over = dev is not None and tol is not None and dev > tol
        if over:
            bad.append(m)
        lines.append(
            f"| {m} | {r['batch_size']} x {r['num_steps']} | {first} | {num(r.get('epoch_s'), '.1f')} | "
            f"{num(r.get('samples_per_s'), '.2f')} | {num(r.get('train_steps_per_s'), '.1f')} | "
            f"{num(r.get('mfu_sampling'), '.3f')} / {num(r.get('mfu_training'), '.3f')} | "
            f"{num(peak, '.1f')} / {num(c.get('plan_gib'), '.1f')} | {num(dev, '.1e')} ({num(tol, '.0e')})"
            f"{' OVER' if over else ''} | {num(r.get('sampler_gap_max'), '.1e')} / "
            f"{num(r.get('sampler_gap_mean'), '.1e')} |")
    any_row = next(iter(rows.values()), {})
    print(f"{any_row.get('gpu') or 'cpu'}, torch {any_row.get('torch', '?')}, {any_row.get('date', '?')}")
    print("\n".join(lines))
    if bad:
        print(f"gpu check: {len(bad)} of {len(expect)} builds failed or off-policy: {', '.join(bad)}")
    return 1 if bad else 0

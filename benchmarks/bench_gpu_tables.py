"""The tables scripts/bench_gpu.py prints: one markdown row per measured point (`table`), and gpu_check.sh's table
over the rows of bench_gpu.jsonl and the meta-device counts (`print_check_table`: per build the time to first sample
and its phases, warm-up and timed s/epoch, sampling and training seconds and peaks, the rescore's seconds and share,
samples/s, MFU, peaks allocated / reserved against the plan, worst |r - 1| against its tolerance, the sampler gap and
a status naming a failure's cause), whose exit status says whether every build finished on-policy. It always
prints: rows are read by benchmarks/gpu_check_rows.py, which skips what it cannot read."""
from __future__ import annotations

import json
import os

from benchmarks.bench_gpu_point import mfu
from benchmarks.gpu_check_rows import latest_rows, read_rows, row_cause


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


# ---- gpu_check.sh's table

HEAD = ("| build | B x steps | first sample s (load / move / embed / 1st step) | s/epoch warm-up / timed | "
        "sampling s (peak GiB alloc / reserved; of it: data reads, reward wait) | "
        "training s (peak GiB alloc / reserved) | rescore s (share of "
        "training) | samples/s | MFU sample / train (update alone) | peak GiB alloc / reserved / plan | "
        "worst \\|r-1\\| (tol) | sampler gap max / mean | status |")


def _cell(s) -> str:
    return str(s).replace("\n", " ").replace("\r", " ").replace("|", "\\|")


def _cells(r: dict, c: dict, peak_tflops: float) -> tuple:
    """(the row's cells after the build's name, whether it counts as failed)."""
    num = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    gib = lambda mb: None if mb is None else mb / 1024  # noqa: E731
    tr = r.get("trainer") or {}
    if "error" not in r and "flops_fwd_row" in c and "flops_fwd_row" not in r and tr.get("sampling_s"):
        r = dict(r, **c)
        r.update(mfu(r, peak_tflops))
    st = r.get("startup") or {}
    first = (f"{num(st.get('total_s'), '.1f')} ({num(st.get('load_s'), '.1f')} / {num(st.get('move_s'), '.1f')}"
             f" / {num(st.get('embeddings_s'), '.1f')} / {num(st.get('first_step_s'), '.1f')})")
    eps = tr.get("epochs_s") or []
    warm = eps[0].get("epoch_s") if len(eps) > 1 else None
    parts = ("" if tr.get("data_s") is None else  # (rows written before these were timed: not shown)
             f"; data {tr['data_s']:.1f}, reward wait {num(tr.get('reward_wait_s'), '.1f')}")
    sampling = (f"{num(tr.get('sampling_s'), '.1f')} ({num(gib(tr.get('cuda_peak_sampling_mb')), '.1f')} / "
                f"{num(gib(tr.get('cuda_reserved_sampling_mb')), '.1f')}{parts})")
    training = (f"{num(tr.get('training_s'), '.1f')} ({num(gib(tr.get('cuda_peak_training_mb')), '.1f')} / "
                f"{num(gib(tr.get('cuda_reserved_training_mb')), '.1f')})")
    rs, ts = tr.get("rescore_s"), tr.get("training_s")
    rescore = "-" if rs is None else f"{rs:.1f} ({100 * rs / ts:.0f} %)" if ts else f"{rs:.1f}"
    warm_rs = eps[0].get("rescore_s") if len(eps) > 1 else None
    if rs is not None and not rs and warm_rs:  # re-scored in the warm-up only (train.old_logprobs auto)
        rescore += f"; warm-up {warm_rs:.1f}"
    mfu_cell = (f"{num(r.get('mfu_sampling'), '.3f')} / {num(r.get('mfu_training'), '.3f')}"
                + (f" ({r['mfu_update']:.3f})" if r.get("mfu_update") is not None else ""))
    peaks = (f"{num(gib(r.get('peak_mem_mb')), '.1f')} / {num(gib(r.get('reserved_mem_mb')), '.1f')} / "
             f"{num(c.get('plan_gib'), '.1f')}")
    dev, tol = r.get("onpolicy_ratio_max_dev"), r.get("onpolicy_tol")
    over = dev is not None and tol is not None and dev > tol
    failed = "error" in r
    if failed:
        cause, detail = row_cause(r)
        status = f"FAILED ({cause}): {detail}"
    else:
        status = "OVER tolerance" if over else "ok"
    if r.get("exit_after_row"):
        status += f"; then {r['exit_after_row']}"
    cells = (f"{r.get('batch_size', '-')} x {r.get('num_steps', '-')}", first,
             f"{num(warm, '.1f')} / {num(r.get('epoch_s'), '.1f')}", sampling, training, rescore,
             num(r.get("samples_per_s"), ".2f"), mfu_cell, peaks,
             f"{num(dev, '.1e')} ({num(tol, '.0e')})" + (" OVER" if over else ""),
             f"{num(r.get('sampler_gap_max'), '.1e')} / {num(r.get('sampler_gap_mean'), '.1e')}", status)
    return cells, failed or over


def print_check_table(args) -> int:
    """gpu_check.sh's table over --table's rows (the last row of each build, its annotations merged) and --counts'
    plans and FLOPs: one line per --expect build, in that order, then any --show build with a row from an earlier
    run (gpu_check.sh --only keeps the others' rows). A row that cannot be formatted, an unreadable JSON line or
    counts file is said, never raised: the table always prints. Returns 1 when an --expect build has no row, an
    error, or |r - 1| above its tolerance; else 0."""
    rows, unreadable = read_rows(args.table)
    rows = latest_rows(rows)
    counts, notes = {}, []
    if args.counts and os.path.isfile(args.counts):
        try:
            with open(args.counts) as f:
                counts = json.load(f)
        except ValueError as e:
            notes.append(f"counts unreadable ({e}): MFU and plan '-'")
    if unreadable:
        notes.append(f"{unreadable} line(s) of {os.path.basename(args.table)} unreadable, skipped")
    expect = [m for m in args.expect.split(",") if m] or list(rows)
    shown = expect + [m for m in getattr(args, "show", "").split(",") if m and m not in expect and m in rows]
    lines = [HEAD, "|---" * HEAD.count(" | ") + "|---|"]
    bad = []
    for m in shown:
        r = rows.get(m)
        if r is None:
            r = {"model": m, "error": "no row: the build wrote none and gpu_check.sh could not add one",
                 "cause": "no row"}
        try:
            cells, failed = _cells(r, counts.get(m, {}), args.peak_tflops)
        except Exception as e:  # noqa: BLE001 - one odd row must not cost the table
            cells, failed = ("-",) * 11 + (f"FAILED (row unreadable): {type(e).__name__}: {e}",), True
        if m not in expect:
            cells = cells[:-1] + (f"{cells[-1]} (earlier run: {r.get('date', '?')})",)
        elif failed:
            bad.append(m)
        lines.append("| " + " | ".join(_cell(x) for x in (m,) + tuple(cells)) + " |")
    stamp = next((r for r in rows.values() if r.get("gpu")), next(iter(rows.values()), {}))
    print(f"{stamp.get('gpu') or 'cpu'}, torch {stamp.get('torch', '?')}, {stamp.get('date', '?')}")
    print("\n".join(lines))
    for note in notes:
        print(f"note: {note}")
    if bad:
        print(f"gpu check: {len(bad)} of {len(expect)} builds failed or off-policy: {', '.join(bad)}")
    return 1 if bad else 0

"""The README's measured figures from the runs that measured them: one command rewrites the marked blocks.

    python benchmarks/readme_tables.py --demo logs/<demo run> [--suite bench_results/suite.json] [--write README.md]

--demo: a `make demo` run folder (config/grpo.py:tiny_colour_nft): its summary.json's held-out evals at epochs 0, 12,
24 and the final one, and its wall time, go between `<!-- demo-table -->` and `<!-- /demo-table -->`.
--suite: a JSON {"passed": N, "skipped": M, "seconds": S, "commit": "...", "date": "..."} (what a fresh clone's
`make test` printed: benchmarks/suite_time.sh writes it) goes between `<!-- suite -->` and `<!-- /suite -->`.
Without --write the blocks are printed. A marker missing from the README is one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

DEMO = ("<!-- demo-table -->", "<!-- /demo-table -->")
SUITE = ("<!-- suite -->", "<!-- /suite -->")
KEY = "toyworld/{}_accuracy"


def _f(v: float, lead: bool = False) -> str:
    """0.781 -> "0.781"; lead=False drops the leading zero as the table does (".781"), 1.0 -> "1.00"."""
    s = f"{v:.3f}"
    if not lead:
        s = "1.00" if s == "1.000" else s.lstrip("0")
    return s


def demo_block(run_dir: str) -> str:
    """The demo's table and time line from its summary.json (history evals + final_eval)."""
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    evals = {h["epoch"]: h for h in summary["history"] if "eval_reward_mean" in h}
    final = summary.get("final_eval") or {}
    last = max([h["epoch"] for h in summary["history"]], default=-1) + 1
    cols = []  # (epoch, {metric: value}) with keys without the eval/ prefix
    for e in sorted(evals):
        cols.append((e, {k.replace("eval/", ""): v for k, v in evals[e].items()}))
    if final:
        cols.append((last, {k.replace("eval/", ""): v for k, v in final.items()}))
    bold = lambda s, on: f"**{s}**" if on else s  # noqa: E731 - the final column's headline numbers
    head = "| held-out (32 conditions × 8 seeds, deterministic) | " + " | ".join(
        "epoch 0" if e == 0 else str(e) for e, _ in cols) + " |"
    rows = [head, "|---" * (len(cols) + 1) + "|"]
    rows.append("| strict accuracy (all three attributes right) | " + " | ".join(
        bold(_f(m[KEY.format("strict")], True), e == last) for e, m in cols) + " |")
    rows.append("| colour / shape / position accuracy | " + " | ".join(
        f"{bold(_f(m[KEY.format('color')]), e == last)} / {_f(m[KEY.format('shape')])} / {_f(m[KEY.format('position')])}"
        for e, m in cols) + " |")
    rows.append("| pass@4 / stochastic pass@1 | " + " | ".join(
        f"{_f(m['pass_at_4'])} / {bold(_f(m['pass_at_1_stochastic']), e == last)}" for e, m in cols) + " |")
    secs = float(summary["seconds"])
    rows.append("")
    rows.append(f"Wall time {int(secs // 60)} min {int(round(secs % 60))} s on 2 cores (the run's summary.json).")
    return "\n".join(rows)


def suite_block(path: str) -> str:
    s = json.load(open(path))
    secs = float(s["seconds"])
    failed = f"{s['failed']} failed, " if s.get("failed") else ""  # a run with failures says so in the README too
    speed = [v for v in s.get("cpu_speed_s") or [] if v is not None]  # benchmarks/cpu_speed.py around the suite
    probe = f"; CPU probe {' / '.join(f'{v:.1f}' for v in speed)} s" if speed else ""
    return (f"{s['passed']} passed, {failed}{s['skipped']} skipped in {int(secs // 60)} min {int(round(secs % 60))} s "
            f"(fresh clone at {s['commit']}, {s['date']}{probe})")


def replace(text: str, markers, block: str) -> str:
    start, end = markers
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        print(f"error: README has no {start} ... {end} block", file=sys.stderr)
        sys.exit(2)
    return pattern.sub(lambda _: f"{start}\n{block}\n{end}", text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", help="the demo's run folder (summary.json)")
    ap.add_argument("--suite", help="the suite's JSON")
    ap.add_argument("--write", help="the README to rewrite in place")
    args = ap.parse_args(argv)
    blocks = []
    if args.demo:
        blocks.append((DEMO, demo_block(args.demo)))
    if args.suite:
        blocks.append((SUITE, suite_block(args.suite)))
    if not args.write:
        print("\n\n".join(b for _, b in blocks))
        return
    text = open(args.write).read()
    for markers, block in blocks:
        text = replace(text, markers, block)
    open(args.write, "w").write(text)


if __name__ == "__main__":
    main()

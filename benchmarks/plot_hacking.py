"""The reward-hacking demonstration's table and figure (docs/hacking.md): proxy and gold against epoch for each run,
the alarms marked, from each run's summary.json ("evals", "alarms", "best_gold").

    python benchmarks/plot_hacking.py /tmp/hackruns/seed42 /tmp/hackruns/seed1=seed1 ... --out docs/hacking.png

A run is its folder (RUN or RUN=LABEL). A run that has not finished has no summary.json yet: its evals and alarms are
then read from the log beside the folder (RUN.log, the trainer's console output), marked "(log)" in the table.
The table is printed as Markdown: proxy (eval mean of the trained reward), gold (eval mean of reward.gold), the eval
where gold peaked, the first alarm of each kind and how many evals after the peak it came, the best-by-gold export's
gold and the last eval's gold (what a run without the guard ends with), and, where the run folder holds them, both
exports' gold re-scored on other seeds (the in-run best is the max of noisy evals, so it reads high).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Dict, List, Optional

_EVAL = re.compile(r"^epoch (\d+): eval reward_mean ([-\d.eE+]+)")
_GUARD = re.compile(r"^epoch (\d+): guard .*?gold/avg ([-\d.eE+]+)")
_ALARM = re.compile(r"^WARNING: reward hacking alarm at epoch (\d+) \((\w+)\): (.*)$")


def _from_log(path: str) -> Dict:
    """evals / alarms / best_gold as summary.json would hold them, from the console log of an unfinished run."""
    proxy: Dict[int, float] = {}
    gold: Dict[int, float] = {}
    alarms: List[Dict] = []
    with open(path, errors="replace") as f:
        for raw in f:
            for line in raw.replace("\r", "\n").split("\n"):
                line = line.strip()
                if m := _EVAL.match(line):
                    proxy[int(m.group(1))] = float(m.group(2))
                elif m := _GUARD.match(line):
                    gold[int(m.group(1))] = float(m.group(2))
                elif m := _ALARM.match(line):
                    alarms.append({"epoch": int(m.group(1)), "kind": m.group(2), "message": m.group(3)})
    evals = [{"epoch": e, "proxy": proxy[e], "gold/avg": gold[e]} for e in sorted(gold) if e in proxy]
    best = max(evals, key=lambda r: r["gold/avg"], default=None)
    return {"evals": evals, "alarms": alarms, "partial": True,
            "best_gold": {"epoch": best["epoch"], "gold": best["gold/avg"]} if best else None}


def load(run: str) -> Dict:
    """A run folder's summary.json, or its log's evals when it has none; "fresh": the toy-world gold ("accuracy") of
    its exports re-scored on other seeds, where RUN/rescore_single_<export>.json exist (scripts/eval_model.py --split
    eval --objects single --num-samples 256 --seed 1234 --json ...)."""
    path = os.path.join(run, "summary.json")
    log = run.rstrip("/") + ".log"
    if os.path.exists(path):
        with open(path) as f:
            s = json.load(f)
    elif os.path.exists(log):
        s = _from_log(log)
    else:
        raise FileNotFoundError(f"neither {path} nor {log}")
    s["fresh"] = {}
    for ex in ("best_gold_export", "export"):
        fp = os.path.join(run, f"rescore_single_{ex}.json")
        if os.path.exists(fp):
            with open(fp) as f:
                s["fresh"][ex] = json.load(f)["accuracy"]
    return s


def row(label: str, s: Dict) -> Dict:
    ev = s["evals"]
    epochs = [r["epoch"] for r in ev]
    gold = [r["gold/avg"] for r in ev]
    proxy = [r["proxy"] for r in ev]
    i = max(range(len(gold)), key=gold.__getitem__)

    def first(kind: str) -> Optional[int]:
        return min((a["epoch"] for a in s.get("alarms", []) if a["kind"] == kind), default=None)

    def after_peak(epoch: Optional[int]) -> Optional[int]:
        return None if epoch is None else sum(1 for e in epochs if epochs[i] < e <= epoch)

    gd, dr = first("gold_down"), first("drift")
    best = s.get("best_gold") or {}
    fresh = s.get("fresh", {})
    return {"run": label + (" (log)" if s.get("partial") else ""), "epochs": epochs[-1],
            "proxy": (proxy[0], proxy[i], proxy[-1]), "gold": (gold[0], gold[i], gold[-1]), "peak_epoch": epochs[i],
            "falls": gold[-1] < gold[i], "gold_down": gd, "gold_down_after": after_peak(gd), "drift": dr,
            "best_gold": best.get("gold"), "best_epoch": best.get("epoch"), "final_gold": gold[-1],
            "fresh_best": fresh.get("best_gold_export"), "fresh_last": fresh.get("export")}


def table(rows: List[Dict]) -> str:
    out = ["| run | last epoch | proxy start → at gold's peak → last | gold start → **peak** (epoch) → last | "
           "first `gold_down` alarm (evals after the peak) | first `drift` alarm | best-by-gold export (epoch) | "
           "best − peak | fresh seeds: best export / last export |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, g = r["proxy"], r["gold"]
        gd = "none" if r["gold_down"] is None else f"epoch {r['gold_down']} ({r['gold_down_after']})"
        dr = "none" if r["drift"] is None else f"epoch {r['drift']}"
        bg = "—" if r["best_gold"] is None else f"{r['best_gold']:.3f} ({r['best_epoch']})"
        diff = "—" if r["best_gold"] is None else f"{r['best_gold'] - g[1]:+.3f}"
        fr = "—" if r["fresh_best"] is None else f"{r['fresh_best']:.3f} / " + (
            "—" if r["fresh_last"] is None else f"{r['fresh_last']:.3f}")
        out.append(f"| {r['run']} | {r['epochs']} | {p[0]:.3f} → {p[1]:.3f} → {p[2]:.3f} | "
                   f"{g[0]:.3f} → **{g[1]:.3f}** ({r['peak_epoch']}) → {g[2]:.3f} | {gd} | {dr} | {bg} | {diff} | {fr} |")
    return "\n".join(out)


def plot(runs: List[tuple], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    cols = min(3, n)
    rows_ = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.0 * rows_), squeeze=False)
    for k, (label, s) in enumerate(runs):
        ax = axes[k // cols][k % cols]
        ev = s["evals"]
        e = [r["epoch"] for r in ev]
        ax.plot(e, [r["gold/avg"] for r in ev], "o-", color="tab:green", ms=3, label="gold (toy-world verifier)")
        ax.set_ylabel("gold", color="tab:green")
        ax2 = ax.twinx()
        ax2.plot(e, [r["proxy"] for r in ev], "s--", color="tab:purple", ms=3, label="proxy (colour_share)")
        ax2.set_ylabel("proxy", color="tab:purple")
        firsts = {}
        for a in s.get("alarms", []):
            firsts.setdefault(a["kind"], a["epoch"])
        for kind, epoch in firsts.items():  # the first alarm of each kind as a line, every alarm as a tick
            gd = kind == "gold_down"
            ax.axvline(epoch, color="tab:red" if gd else "tab:orange", ls="-" if gd else ":", lw=1.5)
        for a in s.get("alarms", []):
            if a["kind"] == "gold_down":
                ax.plot([a["epoch"]], [1.0], "v", color="tab:red", ms=3, transform=ax.get_xaxis_transform())
        b = s.get("best_gold")
        if b:
            ax.plot([b["epoch"]], [b["gold"]], "*", color="black", ms=10)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("epoch")
        if k == 0:
            from matplotlib.lines import Line2D

            handles = [Line2D([], [], color="tab:green", marker="o", label="gold"),
                       Line2D([], [], color="tab:purple", ls="--", marker="s", label="proxy"),
                       Line2D([], [], color="tab:red", marker="v", label="gold_down alarm (first: line)"),
                       Line2D([], [], color="tab:orange", ls=":", label="first drift alarm"),
                       Line2D([], [], color="black", marker="*", ls="", label="best-by-gold export")]
            fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=5, frameon=False)
    for k in range(n, rows_ * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.0 * rows_)))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folder, or RUN=LABEL")
    ap.add_argument("--out", default="docs/hacking.png", help="the figure ('' for none)")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.runs:
        run, _, label = spec.partition("=")
        runs.append((label or os.path.basename(run.rstrip("/")), load(run)))
    print(table([row(label, s) for label, s in runs]))
    if args.out:
        plot(runs, args.out)
        print(f"figure: {args.out} ({os.path.getsize(args.out) / 1024:.0f} KB)")


if __name__ == "__main__":
    main()

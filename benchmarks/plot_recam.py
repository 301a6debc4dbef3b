"""Held-out eval cam_score against epochs for recam_video_tiny runs, from the trainer's console logs.

    python benchmarks/plot_recam.py --logs nft:42=/tmp/rv/nftB42.log nft:1=/tmp/rv/nftB1.log grpo:42=/tmp/rv/s42.log \\
        --out docs/recam_video_curve.png

Reads each log's `epoch N: eval reward_mean X ... cam_score_accuracy A` lines (the trainer's deterministic eval on
the 64 held-out conditions x 4 seeds), prints the table and draws one line per run.
"""
from __future__ import annotations

import argparse
import re

EVAL = re.compile(r"epoch (\d+): eval reward_mean ([0-9.]+).*?cam_score_accuracy ([0-9.]+)")


def read(path: str):
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = EVAL.search(line)
            if m:
                rows.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", nargs="+", required=True, help="LABEL=PATH")
    ap.add_argument("--out", default="docs/recam_video_curve.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for spec in args.logs:
        label, path = spec.split("=", 1)
        rows = read(path)
        if not rows:
            continue
        print(f"{label}: " + "  ".join(f"ep{e} {r:.4f} (acc {a:.3f})" for e, r, a in rows))
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", ls="-" if label.startswith("nft") else "--",
                label=label)
    ax.set_xlabel("epoch (128 samples each)")
    ax.set_ylabel("held-out cam_score (256 clips)")
    ax.set_title("recam_video_tiny on tiny-recam-video")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Held-out cam_score of ReCamMaster models on the video camera world, paired against a baseline.

    python benchmarks/recam_heldout.py --runs /tmp/rv/logs/nftB42 /tmp/rv/logs/nftB1 --out docs/recam_heldout.json

Every model samples the same 64 held-out conditions (RecamVideoConditions "eval", indices 512-575) from the same
--seeds initial noises, deterministically (flow ODE, 10 steps, no CFG), as the trainer's eval does; scores are the
clip cam_score (mean over frames). The baseline is the bundled start model (tiny-recam-video); a run is its
export/ (recammaster.ckpt over the export folder). Prints per model: mean, accuracy, and the paired difference to the
baseline with its standard error (same conditions and noises, so the pairing removes their spread).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob  # noqa: E402
from ddpo_grpo.core.policy_step import SamplerSettings  # noqa: E402
from ddpo_grpo.models import load_pipeline  # noqa: E402
from ddpo_grpo.worlds.recam.cam_score import make_cam_score  # noqa: E402
from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions  # noqa: E402

SIZE, FRAMES, STEPS = 32, 9, 10


@torch.no_grad()
def scores(model: str, checkpoint: str, seeds, batch: int = 32):
    pipe = load_pipeline(model, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=checkpoint)
    data = RecamVideoConditions("eval", num_frames=FRAMES, size=SIZE)
    reward = make_cam_score()
    jobs = [(i, s) for s in seeds for i in range(len(data))]
    out, acc = [], []
    for lo in range(0, len(jobs), batch):
        part = jobs[lo:lo + batch]
        items = [data[i] for i, _ in part]
        cond = pipe.adapter.condition_channels(pipe, items, "cpu")
        emb = torch.cat([pipe.encode([it["prompt"]]) for it in items])
        gens = [torch.Generator().manual_seed(1000 * s + i) for i, s in part]
        traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow"), emb, None,
                                     num_inference_steps=STEPS, sample_shape=pipe.sample_shape, generator=gens,
                                     vae=pipe.vae, deterministic=True, cond_channels=cond)
        meta = [{k: v for k, v in it.items()} for it in items]
        s, details = reward(traj.images, [it["prompt"] for it in items], meta)
        out.append(np.asarray(s, dtype=np.float64))
        acc.append(np.asarray(details["cam_score_accuracy"], dtype=np.float64))
    return np.concatenate(out), np.concatenate(acc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True, help="run folders (their export/ is evaluated)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from ddpo_grpo.models import resolve_model_path

    base_dir = resolve_model_path("tiny-recam-video")
    base, base_acc = scores(base_dir, os.path.join(base_dir, "recammaster.ckpt"), args.seeds)
    rows = {"start (tiny-recam-video)": dict(mean=float(base.mean()), accuracy=float(base_acc.mean()), n=int(base.size))}
    print(f"start: cam_score {base.mean():.4f} accuracy {base_acc.mean():.3f} (n={base.size})", flush=True)
    for run in args.runs:
        export = os.path.join(run, "export")
        # a LoRA run's export holds the merged recammaster.ckpt beside the adapter weights, without a pipeline folder
        folder = export if os.path.isfile(os.path.join(export, "model_index.json")) else base_dir
        s, a = scores(folder, os.path.join(export, "recammaster.ckpt"), args.seeds)
        d = s - base
        rows[os.path.basename(run.rstrip("/"))] = dict(mean=float(s.mean()), accuracy=float(a.mean()), n=int(s.size),
                                                       paired_diff=float(d.mean()),
                                                       paired_se=float(d.std(ddof=1) / np.sqrt(d.size)))
        print(f"{run}: cam_score {s.mean():.4f} accuracy {a.mean():.3f}; paired difference {d.mean():+.4f} "
              f"+- {d.std(ddof=1) / np.sqrt(d.size):.4f} (s.e.)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

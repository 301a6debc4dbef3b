"""Does a recam model follow the camera? cam_score and the regression of estimated on requested motion.

    python benchmarks/recam_follow.py --model tiny-recam --conditions 32 --copies 8

Samples `--copies` views of each of the first `--conditions` conditions of a split (DDIM, `--steps` steps;
eta 1 as the trainer samples, or `--eta 0`), scores them with `cam_score`'s moments estimator and prints
cam_score, the slope / offset / residual std of estimated vs requested (dx, dy, log zoom) (see
ddpo_grpo/worlds/recam/follow.py), and the within-condition spread of cam_score. Seeded: copy c of condition j draws
its noise from seed (c, j).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import refuse  # noqa: E402  (a refusal: one line, exit 2)

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob  # noqa: E402
from ddpo_grpo.core.policy_step import SamplerSettings  # noqa: E402
from ddpo_grpo.models import load_pipeline  # noqa: E402
from ddpo_grpo.worlds.recam.cam_score import estimate_moments, score_motion  # noqa: E402
from ddpo_grpo.worlds.recam.data import RecamConditions  # noqa: E402
from ddpo_grpo.worlds.recam.follow import follow_stats, reward_spread  # noqa: E402


@torch.no_grad()
def measure(model: str, conditions: int = 32, copies: int = 8, steps: int = 10, eta: float = 1.0,
            split: str = "train") -> dict:
    pipe = load_pipeline(model)
    data = RecamConditions(split)
    if conditions > len(data):
        refuse(f"--conditions {conditions} exceeds the {len(data)} conditions of split {split!r}")
    items = [data[i] for i in range(conditions)]
    cond = torch.stack([it["cond_image"] for it in items])
    emb = torch.zeros(conditions, 1, pipe.unet.config.cross_attention_dim)
    settings = SamplerSettings(family=pipe.family, guidance_scale=1.0, eta=eta or 1.0)
    est, req, keys = [], [], []
    for c in range(copies):
        gens = [torch.Generator().manual_seed(1000 * c + j) for j in range(conditions)]
        traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, None, num_inference_steps=steps,
                                     sample_shape=pipe.sample_shape, generator=gens, deterministic=eta == 0,
                                     cond_channels=cond)
        for it, img in zip(items, traj.images.numpy()):
            e = estimate_moments(it["source"], img)
            est.append(e if e is not None else (np.nan,) * 3)
            req.append(it["camera"])
            keys.append(it["index"])
    est, req = np.array(est), np.array(req)
    scores, terr, zerr = score_motion(est, req)
    out = {"model": model, "split": split, "conditions": conditions, "copies": copies, "steps": steps, "eta": eta,
           "cam_score": float(scores.mean()), "translation_error": float(np.nanmean(terr)),
           "zoom_error": float(np.nanmean(zerr))}
    out.update(follow_stats(est, req))
    out.update(reward_spread(scores, keys))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-recam")
    ap.add_argument("--conditions", type=int, default=32)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eta", type=float, default=1.0, help="0 = deterministic DDIM")
    ap.add_argument("--split", default="train", choices=["train", "eval"])
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    args = ap.parse_args()
    out = measure(args.model, args.conditions, args.copies, args.steps, args.eta, args.split)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

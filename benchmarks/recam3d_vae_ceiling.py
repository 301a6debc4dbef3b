"""The camera score a start model's VAE allows on the 3-D world (issue 59 part 2): 16 held-out ground-truth target
renders (Room3DConditions "eval", every 4th of the 64) encoded and decoded by the model folder's VAE, and each clip,
reconstructed and original, scored by the world's exact estimator with cam_score's rule (recam3d_start.score_clips)
against the requested camera and the opposite one. A DiT sampling through this VAE cannot score above the
reconstructions' figure, so a start model is worth pretraining only when it is near the originals' (~0.98).

    python benchmarks/recam3d_vae_ceiling.py MODEL_FOLDER ['{"sigmas": [0.0], "iters": 2}']   # ~1 min, one core
    python benchmarks/recam3d_vae_ceiling.py assets/tiny-recam3d --grid docs/recam3d_vae_recon.png

--grid: the reconstructions of the first ten held-out targets (ReCamMaster's ten presets) drawn as recam3d_start.py
--grid draws a model's samples, to set them side by side (what the VAE loses against what the DiT loses).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.recam3d_start import FRAMES, HEIGHT, WIDTH, save_grid, score_clips  # noqa: E402
from ddpo_grpo.core.pipeline_with_logprob import decode, encode_frames  # noqa: E402
from ddpo_grpo.models import load_pipeline  # noqa: E402
from ddpo_grpo.worlds.room3d.data import Room3DConditions  # noqa: E402


def reconstructed(pipe, items) -> tuple:
    """(targets, their reconstructions) (B, F, 3, H, W) of condition items, through the library's own pair: the
    trainer's encode of a source clip, the sampler's decode."""
    x = torch.stack([torch.as_tensor(np.asarray(it["target_video"])) for it in items]).float()
    with torch.no_grad():
        return x, decode(pipe.vae, encode_frames(pipe.vae, x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a model folder (its vae/ is read)")
    ap.add_argument("options", nargs="?", default='{"sigmas": [0.0], "iters": 2}', help="JSON: estimator options")
    ap.add_argument("--grid", default="", help="a PNG of the first ten held-out targets' reconstructions")
    args = ap.parse_args()
    torch.set_num_threads(1)
    opts = json.loads(args.options)
    pipe = load_pipeline(args.model, resolution=HEIGHT, num_frames=FRAMES, recam_checkpoint="")
    data = Room3DConditions("eval", num_frames=FRAMES, height=HEIGHT, width=WIDTH)
    if args.grid:
        first = [data[i] for i in range(10)]
        save_grid(list(reconstructed(pipe, first)[1].numpy()), first, args.grid)
        return
    items = [data[i] for i in range(0, 64, 4)]
    x, rec = reconstructed(pipe, items)
    r = np.array(score_clips(list(rec.numpy()), items, opts, 1))
    g = np.array(score_clips(list(x.numpy()), items, opts, 1))
    print(json.dumps({"model": args.model, "options": opts, "mean_abs_error": float((rec - x).abs().mean()),
                      "reconstructed": {"true": float(r[:, 0].mean()), "opposite": float(r[:, 1].mean())},
                      "original": {"true": float(g[:, 0].mean()), "opposite": float(g[:, 1].mean())},
                      "reconstructed_per_clip": [round(float(v), 3) for v in r[:, 0]]}))


if __name__ == "__main__":
    main()

"""Exploration in the camera layers' weights instead of the latent's noise (issue 59, twenty-seventh session):
antithetic evolution strategies on the `cam_encoder` weights of a ReCamMaster-architecture model on the 3-D camera
world, cam_score the reward, at the recipe's budget (40 iterations x 64 pairs = 5,120 training clips).

    python benchmarks/recam3d_es.py --out runs/exp27/es42.json     # ~80 min of one core beside two runs

Why: a group of the GRPO recipe shares its condition and x_T, and ranks the spread of its SDE draws; on this world
how far a clip leans to the requested camera is mostly the condition's, and the recipe shrinks the draws' spread as it
climbs (docs/recam_log.md, twenty-sixth session). Here the members of a pair differ in how the camera is read: clip
(condition i, x_T) is sampled deterministically (flow ODE, 10 steps) with every block's cam_encoder weight W + s E and
again with W - s E (E standard normal, s = --sigma-rel x the block's rms weight; one E per pair), and the difference of
the two cam_scores estimates the reward's gradient along E (OpenAI-ES with mirrored sampling):

    g = sum_p (r+_p - r-_p) / 2 E_p / (P s)          ascended by Adam, one optimiser per block at lr --lr-rel x s

Nothing else of the model moves, and no log-probability is needed. The held-out eval is recam3d_start's (64 presets
in unseen rooms x --eval-seeds, ODE, the noise of job (i, s) from 1000 s + i) with the recipe's estimator options,
every --eval-every iterations; per iteration the mean reward of the + and - members and their mean |difference| (how
much a perturbation moves the reward) are logged. Writes --out (JSON) after every iteration.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.recam3d_start import FRAMES, HEIGHT, STEPS, WIDTH, sample, score_clips  # noqa: E402
from benchmarks.recam_heldout import sample_clips  # noqa: E402
from ddpo_grpo.worlds.room3d.data import Room3DConditions  # noqa: E402


def recipe_estimator_options() -> dict:
    """The exact estimator's options of `recam3d_tiny_grpo`'s cam_score (config/recipes/recam.py, _room3d)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config"))
    import grpo

    return dict(grpo.get_config("recam3d_tiny_grpo").reward.kwargs["cam_score"]["pose_estimator_kwargs"])


class PerSampleLinear(torch.nn.Module):
    """A block's cam_encoder with a per-sample weight offset: camera tokens (B, S, 12) -> (W + D_b) c + bias, D (B, dim,
    12) set in `delta` for one call (None: the plain layer). Holds the layer's own weight and bias."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias, self.delta = lin.weight, lin.bias, None

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(c, self.weight, self.bias)
        if self.delta is not None:
            if self.delta.shape[0] != c.shape[0]:
                raise ValueError(f"per-sample offsets for {self.delta.shape[0]} samples, camera tokens of {c.shape[0]}")
            out = out + torch.einsum("bsk,bdk->bsd", c, self.delta.to(c.dtype))
        return out


def main() -> None:
    from ddpo_grpo.models import load_pipeline, resolve_model_path
    from ddpo_grpo.models.base import inner_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-recam3d")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--sigma-rel", type=float, default=0.3)
    ap.add_argument("--lr-rel", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = resolve_model_path(args.model)
    pipe = load_pipeline(folder, resolution=HEIGHT, num_frames=FRAMES,
                         recam_checkpoint=os.path.join(folder, "recammaster.ckpt"))
    pipe.adapter.set_size(pipe, HEIGHT, WIDTH, FRAMES)
    opts = recipe_estimator_options()
    encs = []
    for blk in inner_model(pipe.unet).blocks:
        blk.cam_encoder = PerSampleLinear(blk.cam_encoder)
        blk.cam_encoder.weight.requires_grad_(True)  # the optimiser's parameter; sampling runs without autograd
        encs.append(blk.cam_encoder)
    scales = [float(e.weight.detach().pow(2).mean().sqrt()) for e in encs]
    sig = [args.sigma_rel * s for s in scales]
    optims = [torch.optim.Adam([e.weight], lr=args.lr_rel * s) for e, s in zip(encs, sig)]
    train = Room3DConditions("train", num_frames=FRAMES, height=HEIGHT, width=WIDTH)
    rng = np.random.default_rng(args.seed)

    @torch.no_grad()
    def clips_for(items, part, deltas):
        for e, d in zip(encs, deltas):
            e.delta = d
        try:
            return list(sample_clips(pipe, items, part, STEPS).float().cpu().numpy())
        finally:
            for e in encs:
                e.delta = None

    def heldout():  # recam3d_start's own held-out sampling, of this pipeline (no offsets set outside clips_for)
        clips, items, _, _ = sample(folder, "", args.eval_seeds, 32, pipe=pipe)
        r = np.array(score_clips(clips, items, opts, 1))
        return dict(cam_score=float(r[:, 0].mean()), se=float(r[:, 0].std(ddof=1) / np.sqrt(len(r))),
                    opposite=float(r[:, 1].mean()), n=len(r))

    log = dict(args=vars(args), scales=scales, evals={}, iters=[])
    t0 = time.time()
    log["evals"][0] = heldout()
    print("eval 0", log["evals"][0], flush=True)
    for it in range(1, args.iters + 1):
        idx = rng.integers(0, len(train), size=args.pairs)
        xi = [torch.randn(args.pairs, *e.weight.shape,
                          generator=torch.Generator().manual_seed(int(rng.integers(2**31)))) for e in encs]
        rp, rm = [], []
        for lo in range(0, args.pairs, 16):
            sl = slice(lo, lo + 16)
            part = [(int(i), 10_000 + it * 1000 + lo + k) for k, i in enumerate(idx[sl])]  # a pair shares its x_T
            its = [train[i] for i, _ in part]
            deltas = [torch.cat([s * x[sl], -s * x[sl]]) for s, x in zip(sig, xi)]
            r = np.array(score_clips(clips_for(its + its, part + part, deltas), its + its, opts, 1))[:, 0]
            rp += list(r[:len(part)])
            rm += list(r[len(part):])
        rp, rm = np.array(rp), np.array(rm)
        d = torch.tensor((rp - rm) / 2.0, dtype=torch.float32)
        for e, s, x, o in zip(encs, sig, xi, optims):
            e.weight.grad = -torch.einsum("p,p...->...", d, x) / (args.pairs * s)  # ascent on the ES gradient
            o.step()
            e.weight.grad = None
        row = dict(it=it, r_plus=float(rp.mean()), r_minus=float(rm.mean()),
                   mean_abs_diff=float(np.abs(rp - rm).mean()), sec=round(time.time() - t0))
        log["iters"].append(row)
        print(json.dumps(row), flush=True)
        if it % args.eval_every == 0:
            log["evals"][it] = heldout()
            print("eval", it, log["evals"][it], flush=True)
        with open(args.out, "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()

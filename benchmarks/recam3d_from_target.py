"""Does a room3d DiT keep a camera motion it is handed, or only fail to start one? (issue 59)

    python benchmarks/recam3d_from_target.py --model tiny-recam3d --out docs/recam3d_from_target.json

For each held-out condition of Room3DConditions "eval" (ReCamMaster's ten presets in unseen rooms, 9 x 32 x 48) the
TRUE target clip is encoded by the folder's VAE, noised to sigma s0 along the flow path, x = (1 - s0) x0 + s0 noise
(the noise of seed s and condition i from generator 1000 s + i, seeded like the held-out sampler's), and integrated
to sigma 0 by the flow ODE (Euler, velocity = the DiT's prediction of noise - x0) on the sampler's 10-step grid (linear
in [0, 1], shifted by the scheduler's flow_shift) from its first point <= s0; then decoded and scored as
benchmarks/recam3d_start.py scores samples (the exact estimator at --estimator-kwargs, cam_score's per-clip rule).
s0 = 0 is the VAE's reconstruction of the target (the ceiling; scored for the first seed only); s0 = 1 starts from
noise alone (the sampler). Where a preset's score falls between them says at which noise level the DiT loses that
motion: one that keeps the motion from s0 = 0.6 but not from 0.8 cannot lay it out, only carry it.
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
from benchmarks import refuse  # noqa: E402  (a refusal: one line, exit 2)

from benchmarks.pretrain_recam_video import predict_velocity, shifted_sigma  # noqa: E402
from benchmarks.recam3d_dit_loss import load_room3d_model  # noqa: E402
from benchmarks.recam3d_start import FRAMES, HEIGHT, STEPS, WIDTH, reference_scores, score_clips  # noqa: E402
from ddpo_grpo.core.pipeline_with_logprob import decode, encode_frames  # noqa: E402
from ddpo_grpo.worlds.room3d.data import Room3DConditions  # noqa: E402


def flow_grid(steps: int, shift: float) -> np.ndarray:
    """(steps + 1,) float64 noise levels 1 -> 0: linspace(1, 0) shifted towards noise by `shift` (pretraining's own
    shift rule, shifted_sigma: s' = shift s / (1 + (shift - 1) s))."""
    return shifted_sigma(torch.linspace(1.0, 0.0, int(steps) + 1, dtype=torch.float64), shift).numpy()


def ode_from(velocity, x0: torch.Tensor, noise: torch.Tensor, s0: float, grid: np.ndarray) -> torch.Tensor:
    """x0 (B, ...) noised to s0 along the flow path, x = (1 - s0) x0 + s0 noise, then Euler steps x += (b - a) v(x, a)
    over the grid's points <= s0 (s0 first, then those below it, down to 0); velocity(x, sigma) -> v like x."""
    x = (1.0 - s0) * x0 + s0 * noise
    levels = [float(s0)] + [float(g) for g in grid if g < s0]
    for a, b in zip(levels[:-1], levels[1:]):
        x = x + (b - a) * velocity(x, a)
    return x


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-recam3d", help="a bundled name or a folder pretrain_recam_video.py saved")
    ap.add_argument("--levels", type=float, nargs="+", default=[0.0, 0.4, 0.6, 0.8, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--estimator-kwargs", default='{"sigmas": [0.05, 0.02], "iters": 2}')
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if any(not 0.0 <= s <= 1.0 for s in args.levels):
        refuse(f"--levels must be in [0, 1], got {args.levels}")
    torch.set_num_threads(args.threads)
    folder, _, den, vae, embed = load_room3d_model(args.model)
    with open(os.path.join(folder, "scheduler", "scheduler_config.json")) as f:
        shift = float(json.load(f).get("flow_shift") or 1.0)
    grid = flow_grid(STEPS, shift)
    data = Room3DConditions("eval", num_frames=FRAMES, height=HEIGHT, width=WIDTH)
    items = [data[i] for i in range(len(data))]
    z_src = encode_frames(vae, torch.stack([it["source_video"] for it in items]))
    z_tgt = encode_frames(vae, torch.from_numpy(np.stack([it["target_video"] for it in items])))
    cams = torch.stack([it["cameras"] for it in items]).float()
    emb = embed([it["prompt"] for it in items])
    opts = json.loads(args.estimator_kwargs)
    res = dict(model=args.model, seeds=args.seeds, flow_shift=shift,
               grid=[round(float(g), 4) for g in grid], estimator_kwargs=opts, levels={},
               reference=reference_scores(items))
    ref = res["reference"]
    print(f"reference: still camera {ref['still']:.3f}  " + "  ".join(
        f"{k} {v['still']:.2f}" for k, v in ref["per_preset"].items()) + f"; opposite motion {ref['opposite']:.3f}",
        flush=True)
    for s0 in args.levels:
        t0 = time.time()
        clips, its = [], []
        for seed in args.seeds[:1] if s0 == 0 else args.seeds:  # from s0 = 0 the noise plays no part
            noise = torch.stack([torch.randn(z_tgt.shape[1:], generator=torch.Generator().manual_seed(1000 * seed + i))
                                 for i in range(len(items))])
            for lo in range(0, len(items), args.batch):
                sl = slice(lo, lo + args.batch)

                def velocity(x, sigma, sl=sl):
                    return predict_velocity(den, x, z_src[sl], cams[sl], emb[sl], torch.full((x.shape[0],), sigma))

                clips += list(decode(vae, ode_from(velocity, z_tgt[sl], noise[sl], s0, grid)).float().numpy())
            its += items
        r = np.array(score_clips(clips, its, opts, 1))
        per = {}
        for score, it in zip(r[:, 0], its):
            per.setdefault(it["preset"], []).append(score)
        res["levels"][str(s0)] = dict(n=len(r), cam_score=float(r[:, 0].mean()),
                                      cam_score_se=float(r[:, 0].std(ddof=1) / np.sqrt(len(r))),
                                      per_preset={k: float(np.mean(v)) for k, v in sorted(per.items())})
        print(f"s0 {s0:.2f}: cam_score {r[:, 0].mean():.3f}  " + "  ".join(
            f"{k} {np.mean(v):.2f}" for k, v in sorted(per.items())) + f"  ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

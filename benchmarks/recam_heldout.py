"""Held-out cam_score of ReCamMaster models on the video camera world, paired against a baseline.

    python benchmarks/recam_heldout.py --runs /tmp/rv/logs/nftB42 /tmp/rv/logs/nftB1 --out docs/recam_heldout.json

Every model samples the same 64 held-out conditions (RecamVideoConditions "eval", indices 512-575) from the same
--seeds initial noises, deterministically (flow ODE, 10 steps, no CFG), as the trainer's eval does; scores are the
clip cam_score (mean over frames). The baseline is the bundled start model (tiny-recam-video); a run is its
export/ (recammaster.ckpt over the export folder). Prints per model: mean, accuracy, and the paired difference to the
baseline with its standard error (same conditions and noises, so the pairing removes their spread).

    python benchmarks/recam_heldout.py --gains 1.176 1.087 1.493 --runs logs/<run> --out docs/recam_heldout_ceiling.json

--gains GX GY GZ (no --runs needed): the ceiling of correcting one shared error. The start model is asked for
amplified motion (dx * GX, dy * GY, zoom ** GZ in the camera numbers it reads) and scored against the motion actually
requested, paired against itself asked for the true motion: what a model that learned only to rescale every camera
by one gain would reach (on these clips the start model follows with slopes 0.85 / 0.92 / 0.59; docs/recam.md).

Every model's line also says how it follows the camera: the slope and residual std of estimated on requested motion
(dx, dy, log zoom) at frames 4 and 8 (follow.follow_stats), and what its clips would score with each component's
linear bias removed (the same scatter around the request), then with the scatter also scaled by 0.75 and 0.5,
re-scored by cam_score's own rule (score_motion): how much of the head-room a shared correction can reach.
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
from ddpo_grpo.worlds.recam.cam_score import estimate_moments, make_cam_score, score_motion  # noqa: E402
from ddpo_grpo.worlds.recam.follow import follow_stats  # noqa: E402
from ddpo_grpo.worlds.recam.video import camera_numbers  # noqa: E402
from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions  # noqa: E402

SIZE, FRAMES, STEPS = 32, 9, 10
FOLLOW_FRAMES = (4, 8)  # the frames whose estimated motion is regressed on the requested one (follow.follow_stats)


@torch.no_grad()
def sample_clips(pipe, items, part, steps: int = STEPS, sde_window: int = 0) -> torch.Tensor:
    """Deterministic clips (B, F, 3, H, W) of a loaded ReCamMaster pipeline for condition items, the noise of job
    (condition i, seed s) seeded by 1000 s + i: the held-out sampling both recam benchmarks share. sde_window w > 0:
    sampled instead as the recipe samples a group (the flow SDE on steps 0 .. w-1, its noise level 0.7, the ODE
    after)."""
    cond = pipe.adapter.condition_channels(pipe, items, "cpu")
    emb = torch.cat([pipe.encode([it["prompt"]]) for it in items])
    gens = [torch.Generator().manual_seed(1000 * s + i) for i, s in part]
    return pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow"), emb, None,
                                 num_inference_steps=steps, sample_shape=pipe.sample_shape, generator=gens,
                                 vae=pipe.vae, deterministic=not sde_window,
                                 sde_window=(0, sde_window) if sde_window else None, cond_channels=cond).images


@torch.no_grad()
def scores(model: str, checkpoint: str, seeds, batch: int = 32, gains=None):
    pipe = load_pipeline(model, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=checkpoint)
    data = RecamVideoConditions("eval", num_frames=FRAMES, size=SIZE)
    reward = make_cam_score()
    jobs = [(i, s) for s in seeds for i in range(len(data))]
    out, acc, est, req = [], [], [], []
    for lo in range(0, len(jobs), batch):
        part = jobs[lo:lo + batch]
        items = [data[i] for i, _ in part]
        if gains is not None:  # the model reads amplified cameras; the reward still reads the requested "motions"
            items = [dict(it, cameras=torch.from_numpy(amplified_cameras(it["motions"], gains, FRAMES)))
                     for it in items]
        images = sample_clips(pipe, items, part)
        meta = [{k: v for k, v in it.items()} for it in items]
        s, details = reward(images, [it["prompt"] for it in items], meta)
        n0 = len(est)
        out.append(np.asarray(s, dtype=np.float64))
        acc.append(np.asarray(details["cam_score_accuracy"], dtype=np.float64))
        clips = images.float().cpu().numpy()
        for b, it in enumerate(items):  # every frame's estimated motion (views are 32 px: no rescale)
            src = np.asarray(it["source_video"], dtype=np.float64)
            est.append([estimate_moments(src[f], clips[b, f]) or (np.nan,) * 3 for f in range(FRAMES)])
            req.append(np.asarray(it["motions"], dtype=np.float64))
        mine = clip_scores(np.array(est[n0:], dtype=np.float64), np.array(req[n0:]))
        if not np.allclose(mine, out[-1], atol=1e-6, equal_nan=True):  # the re-scoring below must be the reward's own
            raise SystemExit(f"clip_scores disagrees with cam_score by {np.nanmax(np.abs(mine - out[-1])):.2e}")
    est, req = np.array(est, dtype=np.float64), np.array(req)  # (N, F, 3)
    f = list(FOLLOW_FRAMES)
    return (np.concatenate(out), np.concatenate(acc),
            dict(follow_stats(est[:, f].reshape(-1, 3), req[:, f].reshape(-1, 3)), ceiling=ceilings(est, req)))


def clip_scores(est: np.ndarray, req: np.ndarray) -> np.ndarray:
    """(N,) clip cam_score of per-frame motions est, req (N, F, 3): cam_score's own rule (score_motion), frame mean."""
    return score_motion(est.reshape(-1, 3), req.reshape(-1, 3))[0].reshape(est.shape[:2]).mean(axis=1)


def unbiased(est: np.ndarray, req: np.ndarray, scatter: float = 1.0, components=(0, 1, 2)) -> np.ndarray:
    """est (N, F, 3) with the linear bias of each of `components` (0 dx, 1 dy, 2 zoom) removed: fit est = slope * req +
    offset over the moving frames (1..F-1; log zoom for zoom), keep the residual around the request, scaled by
    `scatter`; the other components as estimated."""
    e, r = est.copy(), req.copy()
    e[..., 2], r[..., 2] = np.log(e[..., 2]), np.log(r[..., 2])
    out = e.copy()
    ok = np.isfinite(e).all(axis=-1)
    ok[:, 0] = False
    for j in components:
        slope, offset = np.polyfit(r[..., j][ok], e[..., j][ok], 1)
        out[..., j] = r[..., j] + scatter * (e[..., j] - (slope * r[..., j] + offset))
    out[:, 0] = e[:, 0]  # frame 0 (the identity) as estimated
    out[..., 2] = np.exp(out[..., 2])
    return out


def ceilings(est: np.ndarray, req: np.ndarray) -> dict:
    """What the clips would score without the shared error: cam_score with every component's linear bias removed
    (same scatter), and with the scatter also scaled by 0.75 and 0.5 (the estimator's failures stay failures); and
    with one component's bias removed at a time (bias_free_only_dx, _dy, _log_zoom)."""
    out = {"as_sampled": float(clip_scores(est, req).mean())}
    for k in (1.0, 0.75, 0.5):
        out[f"bias_free_scatter_x{k:g}"] = float(clip_scores(unbiased(est, req, k), req).mean())
    for j, name in enumerate(("dx", "dy", "log_zoom")):
        out[f"bias_free_only_{name}"] = float(clip_scores(unbiased(est, req, components=(j,)), req).mean())
    return out


def follow_line(f: dict) -> str:
    """Slopes and residual stds of estimated vs requested motion (follow.follow_stats) and the ceilings, one line."""
    c = f["ceiling"]
    return ("follow: " + ", ".join(f"{c} slope {f[c + '_slope']:.3f} resid {f[c + '_resid_std']:.3f}"
                                   for c in ("dx", "dy", "log_zoom"))
            + "; without the bias " + " / ".join(f"{c[f'bias_free_scatter_x{k}']:.4f}" for k in ("1", "0.75", "0.5"))
            + " (scatter x1 / x0.75 / x0.5), without one component's "
            + " / ".join(f"{c['bias_free_only_' + k]:.4f}" for k in ("dx", "dy", "log_zoom")) + " (dx / dy / log zoom)")


def amplified_cameras(motions: np.ndarray, gains, frames: int) -> np.ndarray:
    """(F', 12) camera numbers of the motions (F, 3) scaled by gains (GX, GY, GZ): dx * GX, dy * GY, zoom ** GZ."""
    m = np.asarray(motions, dtype=np.float64).copy()
    m[:, 0] *= gains[0]
    m[:, 1] *= gains[1]
    m[:, 2] = m[:, 2] ** gains[2]
    return camera_numbers(m, frames)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", default=[], help="run folders (their export/ is evaluated)")
    ap.add_argument("--gains", type=float, nargs=3, action="append", default=[], metavar=("GX", "GY", "GZ"),
                    help="the start model asked for amplified motion (repeatable; module docstring)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.runs and not args.gains:
        ap.error("give --runs and/or --gains")
    torch.set_num_threads(1)
    from ddpo_grpo.models import resolve_model_path

    base_dir = resolve_model_path("tiny-recam-video")
    base_ckpt = os.path.join(base_dir, "recammaster.ckpt")
    base, base_acc, fol = scores(base_dir, base_ckpt, args.seeds)
    rows = {"start (tiny-recam-video)": dict(mean=float(base.mean()), accuracy=float(base_acc.mean()), n=int(base.size),
                                             follow=fol)}
    print(f"start: cam_score {base.mean():.4f} accuracy {base_acc.mean():.3f} (n={base.size}); {follow_line(fol)}",
          flush=True)

    def paired(key: str, s: np.ndarray, a: np.ndarray, fol: dict, **extra) -> None:
        """One model's row against the start, printed and kept for --out."""
        d = s - base
        se = float(d.std(ddof=1) / np.sqrt(d.size))
        rows[key] = dict(mean=float(s.mean()), accuracy=float(a.mean()), n=int(s.size), **extra,
                         paired_diff=float(d.mean()), paired_se=se, follow=fol)
        print(f"{key}: cam_score {s.mean():.4f} accuracy {a.mean():.3f}; paired difference {d.mean():+.4f} "
              f"+- {se:.4f} (s.e.); {follow_line(fol)}", flush=True)

    for g in args.gains:
        paired("start asked for gains " + " ".join(f"{v:g}" for v in g),
               *scores(base_dir, base_ckpt, args.seeds, gains=g), gains=list(g))
    for run in args.runs:
        export = os.path.join(run, "export")
        # a LoRA run's export holds the merged recammaster.ckpt beside the adapter weights, without a pipeline folder
        folder = export if os.path.isfile(os.path.join(export, "model_index.json")) else base_dir
        paired(os.path.basename(run.rstrip("/")), *scores(folder, os.path.join(export, "recammaster.ckpt"), args.seeds))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

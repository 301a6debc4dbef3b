"""Held-out pass@1 / pass@k of the bundled start model `tiny-recam3d` on the 3-D camera world (issue 59 part 2).

    python benchmarks/recam3d_start.py --out docs/recam3d_start.json
    python benchmarks/recam3d_start.py --model logs/<run>/export --baseline docs/recam3d_start.json  # paired gain
    python benchmarks/recam3d_start.py --bench-estimator 16     # the exact estimator's options: accuracy and speed
    python benchmarks/recam3d_start.py --grid docs/recam3d_start_samples.png --limit 10 --seeds 0   # what it draws

The model samples the 64 held-out conditions of Room3DConditions "eval" (ReCamMaster's ten presets on unseen rooms,
9 x 32 x 48) from --seeds initial noises, deterministically (flow ODE, 10 steps, no CFG, the noise of seed s and
condition i from generator 1000 s + i), as the trainer's eval and benchmarks/recam_heldout.py do. Each clip's camera
path is estimated ONCE by the world's exact estimator (`room3d.estimator.make_exact_estimator(**--estimator-kwargs)`,
the scene read from the item's scene_seed) at the latent frames 0, 4, 8, and scored by cam_score's own per-clip rule
(`pose_score.PoseScore().clip`) twice: against the requested camera numbers (cam_score) and against the numbers of
the OPPOSITE motion (`paths.opposite_motion`: what the start model's mislabelled half of pretraining taught). On the
first batch the requested-camera score is checked against `make_cam_score` itself (the same number, or it stops).

Reported: mean cam_score; pass@1 = the share of samples with cam_score >= --threshold ("follows the requested
camera"); pass@k = the share of conditions where any of its k seeds does; the share of samples following the opposite
camera (opposite score >= threshold); per preset the same; and what a still camera and the opposite motion score on
the same conditions ("reference", `reference_scores`): the floor a model's camera skill is read against; and on the
pans and tilts, `rotation_leans` (the share leaning to the requested camera rather than its opposite, and that lean's
correlation with the starting noise's `noise_mode`: does the noise pick the camera?).

--amplitude A: the model is asked for the requested path at A times its amplitude (`amplified_cameras`: each latent
pose's turn and translation x A) and scored against the path requested: does a larger request give the right motion,
i.e. is the start's error a gain its camera layers could scale away?

--group-spread K: instead, K samples of each held-out pan and tilt condition (--spread-kinds dolly: each zoom) drawn
as the recipe draws a group (the flow SDE on steps 0-3) and how a group spreads between the request and its opposite
(`group_spread`): what the recipe's group advantages can rank. With --checkpoint a GRPO run's export/recammaster.ckpt.

--bench-estimator N: the estimator on N ground-truth target renders of the eval split (no model), per option set:
wall and CPU seconds per 3-frame clip (CPU: the machine is shared), mean score against the true numbers and against the opposite numbers.
With --blur 2 4 also on the renders average-pooled 2 x 2 / 4 x 4 and upsampled back (what a 4 x 4-compressing VAE
could keep at best, roughly): which options read a blurred clip's camera best.
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

from benchmarks.pretrain_pools import ROOM3D_SCENE_SEED  # noqa: E402
from ddpo_grpo.worlds.recam.pose_reward import requested_path  # noqa: E402
from ddpo_grpo.worlds.recam.pose_score import PoseScore  # noqa: E402
from ddpo_grpo.worlds.room3d.data import Room3DConditions  # noqa: E402
from ddpo_grpo.worlds.room3d.estimator import make_exact_estimator  # noqa: E402
from benchmarks.pretrain_pools import noise_mode  # noqa: E402
from ddpo_grpo.worlds.room3d.paths import motion_kind, parse_kinds, scale_cameras  # noqa: E402
from ddpo_grpo.worlds.room3d.reward import opposite_cameras  # noqa: E402
from benchmarks.recam3d_readings import (group_spread, magnitude_reading, motion_shown, nanmean, nanmedian,  # noqa: E402
                                         rotation_leans)

FRAMES, HEIGHT, WIDTH, STEPS = 9, 32, 48, 10
LATENT = [0, 4, 8]
ESTIMATOR = "ddpo_grpo.worlds.room3d.estimator:make_exact_estimator"
# option sets tried by --bench-estimator (estimate_exact's keywords; {} = its defaults)
# (supersample 1 was tried first: 0.90 on true renders, min 0.68-0.80: the targets are rendered at 2, so must be the
# estimator's renders)
OPTION_SETS = [
    {},
    {"sigmas": [0.05, 0.0], "iters": 3},
    {"max_side": 24},
    {"max_side": 24, "sigmas": [0.05, 0.0], "iters": 3},
    {"sigmas": [0.05, 0.0], "iters": 2},
    {"sigmas": [0.0], "iters": 4},
    {"sigmas": [0.0], "iters": 2},
    {"sigmas": [0.0], "iters": 3},
    # blur-robust sets for generated clips (--blur 2 4: a VAE's reconstructions are blurred, docs/recam_log.md)
    {"sigmas": [0.05, 0.02], "iters": 2},
    {"sigmas": [0.04], "iters": 3},
]


def reference_scores(items) -> dict:
    """What two cameras a model needs no skill for score on these items, by cam_score's own per-clip rule: a STILL
    camera (the source view held: every latent frame the identity) and the OPPOSITE motion exactly (`opposite_cameras`).
    A model's figures read against them: at the still camera's score it shows no camera skill on average, below it it
    leans to the opposite. Returns {"still": mean, "opposite": mean, "per_preset": {preset: {"still", "opposite"}}}."""
    ps, rows = PoseScore(), []
    for it in items:
        req = requested_path(it["cameras"], 0, FRAMES)
        still = ps.clip(np.broadcast_to(np.eye(4), req.shape), req)
        rows.append((it["preset"], still, ps.clip(requested_path(opposite_cameras(it), 0, FRAMES), req)))
    per = {p: dict(still=float(np.mean([a for q, a, _ in rows if q == p])),
                   opposite=float(np.mean([b for q, _, b in rows if q == p]))) for p in sorted({r[0] for r in rows})}
    return dict(still=float(np.mean([r[1] for r in rows])), opposite=float(np.mean([r[2] for r in rows])),
                per_preset=per)


def K_of(item) -> np.ndarray:
    fx, fy, cx, cy = [float(v) for v in item["intrinsics"]]
    return np.array([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]])


def _score_job(args):
    """(true score, opposite score, wall seconds, CPU seconds, translation shown, rotation shown (motion_shown), and
    the requested score's terms over its frames: mean rotation error (deg), mean direction error (deg), mean
    normalised-magnitude error (PoseScore.frames; NaN where the path has no such term)) of one clip (F, 3, H, W):
    estimated once, scored twice."""
    clip, K, seed, cams, opp, opts = args
    est_fn = make_exact_estimator(**opts)
    t, c = time.time(), time.process_time()
    # as cam_score hands frames to its estimator: uint8 round trip (pose_reward._to_u8)
    frames = np.clip(np.rint(np.asarray(clip)[LATENT] * 255.0), 0, 255).astype(np.float32) / 255.0
    est = est_fn(frames, K, metadata={"scene_seed": seed})
    dt, dc = time.time() - t, time.process_time() - c
    score, req = PoseScore(), requested_path(cams, 0, FRAMES)
    terms = score.frames(est, req)
    return (float(terms["score"].mean()), score.clip(est, requested_path(opp, 0, FRAMES)), dt, dc,
            *motion_shown(est, req), *(nanmean(terms[k]) for k in ("rot_deg", "dir_deg", "mag")))


def score_clips(clips, items, opts, workers):
    jobs = [(clips[b], K_of(it), int(it["scene_seed"]), np.asarray(it["cameras"], np.float64), opposite_cameras(it),
             opts) for b, it in enumerate(items)]
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            return pool.map(_score_job, jobs)
    return [_score_job(j) for j in jobs]


def blurred(clip: np.ndarray, factor: int) -> np.ndarray:
    """(F, 3, H, W) clip through factor x factor average pooling and bilinear upsampling back: a stand-in for what a
    VAE with that spatial compression keeps (the start model's 4 x 4, if it kept no more than each block's mean)."""
    if factor <= 1:
        return clip
    import torch.nn.functional as F

    x = torch.from_numpy(np.asarray(clip, np.float32))
    return F.interpolate(F.avg_pool2d(x, factor), size=x.shape[-2:], mode="bilinear", align_corners=False).numpy()


def bench_estimator(n: int, workers: int, only=None, blur=(1,)) -> dict:
    data = Room3DConditions("eval", num_frames=FRAMES, height=HEIGHT, width=WIDTH)
    items = [data[i] for i in range(0, len(data), max(1, len(data) // n))][:n]
    clips_at = {f: [blurred(np.asarray(it["target_video"]), f) for it in items] for f in blur}
    out = {}
    for opts, factor in ((o, f) for o in (OPTION_SETS if only is None else [OPTION_SETS[i] for i in only])
                         for f in blur):
        clips = clips_at[factor]
        t = time.time()
        r = np.array(score_clips(clips, items, opts, workers))
        key = (json.dumps(opts) if opts else "defaults") + (f" blur {factor}" if factor > 1 else "")
        out[key] = dict(n=len(items), seconds_per_clip=float(r[:, 2].mean()), cpu_seconds_per_clip=float(r[:, 3].mean()),
                        true_mean=float(r[:, 0].mean()),
                        true_min=float(r[:, 0].min()), opposite_mean=float(r[:, 1].mean()),
                        opposite_max=float(r[:, 1].max()), wall=round(time.time() - t, 1))
        print(f"estimator {key}: {out[key]}", flush=True)
    return out


class PretrainRooms(Room3DConditions):
    """The eval split's conditions (ReCamMaster's ten presets) in the rooms the start model was PRETRAINED on (the
    pool's rooms, benchmarks/pretrain_recam_video.ROOM3D_SCENE_SEED + k): --rooms pretrain, which separates "cannot
    render the motion" from "does not carry it to unseen rooms"."""

    def scene_seed(self, idx: int) -> int:
        return ROOM3D_SCENE_SEED + int(idx) - self.indices[0]


def save_grid(clips, items, path: str, scale: int = 2) -> None:
    """One row per clip (the first ten: seed 0's ten presets): the source view, the true target's frames 4 and 8, then
    the sample's frames 0, 4 and 8 (frame 0 is the source camera: a sample should repeat the source view there)."""
    from PIL import Image

    rows = []
    for c, it in zip(clips, items):
        tgt = np.asarray(it["target_video"])
        rows.append(np.concatenate([np.asarray(it["source_video"][0]), tgt[4], tgt[8], c[0], c[4], c[8]], axis=2))
    img = (np.clip(np.concatenate(rows, axis=1).transpose(1, 2, 0), 0, 1) * 255).astype(np.uint8)
    Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST).save(path, optimize=True)
    print(f"saved {path}: rows {[it['preset'] for it in items]}", flush=True)


def amplified_cameras(cameras, amplitude: float) -> torch.Tensor:
    """Camera numbers (F', 12) -> the same path at `amplitude` times its motion (F', 12) float32 (`paths.scale_cameras`;
    checked as the request is, `requested_path`)."""
    requested_path(cameras, 0, FRAMES)
    cams = cameras.detach().cpu().double().numpy() if isinstance(cameras, torch.Tensor) else cameras
    return torch.from_numpy(scale_cameras(cams, amplitude))


@torch.no_grad()
def sample(model: str, checkpoint: str, seeds, batch: int, limit: int = 0, rooms: str = "heldout", kinds=(),
           sde_window: int = 0, amplitude: float = 1.0, pipe=None):
    """(clips, items, jobs (condition, seed), the jobs' starting-noise modes) of the held-out conditions (the first
    `limit`; only those of `kinds` when given) x seeds, sampled by recam_heldout.sample_clips (deterministic, or the
    recipe's SDE window). amplitude != 1: the model reads `amplified_cameras`; the items returned keep the request.
    pipe: an already loaded pipeline at this size, sampled instead of loading `model` (recam3d_es.py's patched one)."""
    from benchmarks.recam_heldout import sample_clips
    from ddpo_grpo.models import load_pipeline

    if pipe is None:
        pipe = load_pipeline(model, resolution=HEIGHT, num_frames=FRAMES, recam_checkpoint=checkpoint)
        pipe.adapter.set_size(pipe, HEIGHT, WIDTH, FRAMES)
    data = (PretrainRooms if rooms == "pretrain" else Room3DConditions)("eval", num_frames=FRAMES, height=HEIGHT,
                                                                        width=WIDTH)
    conds = [i for i in range(limit or len(data)) if not kinds or motion_kind(data[i]["preset"]) in kinds]
    jobs = [(i, s) for s in seeds for i in conds]
    clips, items = [], []
    for lo in range(0, len(jobs), batch):
        part = jobs[lo:lo + batch]
        its = [data[i] for i, _ in part]
        fed = its if amplitude == 1.0 else [dict(it, cameras=amplified_cameras(it["cameras"], amplitude)) for it in its]
        clips += list(sample_clips(pipe, fed, part, STEPS, sde_window).float().cpu().numpy())
        items += its
        print(f"sampled {len(clips)}/{len(jobs)}", flush=True)
    # each job's starting noise as sample_clips draws it, read by noise_mode (what --mislabel-by noise ties a camera to)
    modes = np.array([noise_mode(torch.randn(tuple(pipe.sample_shape), generator=torch.Generator().manual_seed(
        1000 * s + i))[None]).item() for i, s in jobs])
    return clips, items, jobs, modes


def run_group_spread(args, folder: str, ckpt: str, opts: dict, t0: float) -> None:
    """--group-spread K: K samples of each held-out condition of --spread-kinds (pan and tilt unless told) drawn as the
    recipe draws a group (sample's SDE window of 4), scored against the request and its opposite, summarised by
    group_spread; printed and saved to --out."""
    k, kinds = args.group_spread, parse_kinds(args.spread_kinds, "--spread-kinds")
    clips, items, _, _ = sample(folder, ckpt, range(k), args.batch, args.limit, kinds=kinds, sde_window=4)
    r = np.array(score_clips(clips, items, opts, args.workers))
    n = len(items) // k
    res = dict(model=args.model, checkpoint=ckpt, k=k, seconds=round(time.time() - t0, 1),
               group_spread=group_spread(r[:, 0].reshape(k, n), r[:, 1].reshape(k, n),
                                         [it["preset"] for it in items[:n]], k, kinds),
               magnitude=magnitude_reading(r[:, 0].reshape(k, n), r[:, 4].reshape(k, n), r[:, 6:9].reshape(k, n, 3),
                                           [it["preset"] for it in items[:n]], kinds))
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-recam3d", help="a bundled name or a folder")
    ap.add_argument("--checkpoint", default="", help="recammaster.ckpt (default: the model folder's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--threshold", type=float, default=0.7)
    ap.add_argument("--estimator-kwargs", default="{}", help="JSON: estimate_exact options for the scoring")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bench-estimator", type=int, default=0, metavar="N")
    ap.add_argument("--limit", type=int, default=0, help="the first N held-out conditions only (a smoke run)")
    ap.add_argument("--option-sets", type=int, nargs="*", default=None, help="--bench-estimator: these OPTION_SETS only")
    ap.add_argument("--blur", type=int, nargs="*", default=[1],
                    help="--bench-estimator: also score the renders average-pooled by these factors (1 = as rendered)")
    ap.add_argument("--rooms", choices=["heldout", "pretrain"], default="heldout",
                    help="pretrain: the presets in the start model's own pretraining rooms (PretrainRooms)")
    ap.add_argument("--grid", default="", help="a PNG of the first ten samples against their targets (save_grid)")
    ap.add_argument("--spread-kinds", default="pan,tilt", help="--group-spread: the kinds read (room3d.paths names)")
    ap.add_argument("--group-spread", type=int, default=0, metavar="K",
                    help="instead: K samples per condition of --spread-kinds drawn as the recipe draws a group (the flow "
                         "SDE on steps 0-3), and how far they spread towards the requested camera (group_spread)")
    ap.add_argument("--amplitude", type=float, default=1.0,
                    help="ask the model for the requested path at this amplitude (scored against the request)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)),
                    help="torch's threads for the sampling (default: OMP_NUM_THREADS, else 2)")
    ap.add_argument("--out", default="")
    ap.add_argument("--baseline", default="", help="a JSON written by --out with the same --seeds: the paired "
                    "difference to it (mean and standard error) is added")
    args = ap.parse_args()
    opts = json.loads(args.estimator_kwargs)
    torch.set_num_threads(args.threads)
    if args.bench_estimator:
        res = {"estimator_options": bench_estimator(args.bench_estimator, args.workers, args.option_sets, args.blur)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    from ddpo_grpo.models import resolve_model_path

    folder = resolve_model_path(args.model)
    ckpt = args.checkpoint or os.path.join(folder, "recammaster.ckpt")
    t0 = time.time()
    if args.group_spread:
        return run_group_spread(args, folder, ckpt, opts, t0)
    same = dict(rooms=args.rooms, amplitude=args.amplitude, estimator_kwargs=opts)  # what a pairing must share
    # a baseline that cannot be paired is refused before minutes of sampling; read once, paired after
    base = read_baseline(args.baseline, args.seeds, **same) if args.baseline else None
    clips, items, jobs, modes = sample(folder, ckpt, args.seeds, args.batch, args.limit, args.rooms,
                                       amplitude=args.amplitude)
    t_sample = time.time() - t0
    if args.grid:
        save_grid(clips[:10], items[:10], args.grid)
    # the requested-camera score is cam_score's own: checked on a few clips against the reward itself
    from ddpo_grpo.worlds.recam.cam_score import make_cam_score

    reward = make_cam_score(pose_estimator=ESTIMATOR, pose_estimator_kwargs=opts or None, workers=0)
    r = np.array(score_clips(clips, items, opts, args.workers))
    ref, _ = reward(torch.from_numpy(np.stack(clips[:4])), [it["prompt"] for it in items[:4]], items[:4])
    if not np.allclose(ref, r[:4, 0], atol=1e-5):
        raise SystemExit(f"re-scoring disagrees with cam_score: {ref} vs {r[:4, 0]}")
    true, opp = r[:, 0], r[:, 1]
    n_cond, k = len(items) // len(args.seeds), len(args.seeds)
    ok = (true >= args.threshold).reshape(k, n_cond)  # jobs are seed-major
    op = (opp >= args.threshold).reshape(k, n_cond)
    presets = [it["preset"] for it in items[:n_cond]]
    per_preset = {}
    for p in sorted(set(presets)):
        m = np.array([q == p for q in presets])
        shown = r[:, 4:6].reshape(k, n_cond, 2)[:, m].reshape(-1, 2)
        per_preset[p] = dict(cam_score=float(true.reshape(k, n_cond)[:, m].mean()), pass1=float(ok[:, m].mean()),
                             passk=float(ok[:, m].any(axis=0).mean()), opposite_share=float(op[:, m].mean()),
                             # median share of the requested motion the clips show (NaN: the preset has none)
                             translation_shown=nanmedian(shown[:, 0]), rotation_shown=nanmedian(shown[:, 1]))
    res = dict(model=args.model, checkpoint=ckpt, rooms=args.rooms, amplitude=args.amplitude,
               n_samples=int(true.size), n_conditions=n_cond,
               seeds=args.seeds,
               threshold=args.threshold, estimator=ESTIMATOR, estimator_kwargs=opts,
               cam_score_mean=float(true.mean()), cam_score_se=float(true.std(ddof=1) / np.sqrt(true.size)),
               opposite_score_mean=float(opp.mean()), pass1=float(ok.mean()),
               **({f"pass{k}": float(ok.any(axis=0).mean())} if k > 1 else {}),  # one seed: pass@1 only
               opposite_share=float(op.mean()), neither_share=float((~ok & ~op).mean()),
               seconds_sampling=round(t_sample, 1), seconds_per_clip_estimator=float(r[:, 2].mean()),
               cpu_seconds_per_clip_estimator=float(r[:, 3].mean()),
               translation_shown=nanmedian(r[:, 4]), rotation_shown=nanmedian(r[:, 5]),
               rotation_leans=rotation_leans(true, opp, modes, [it["preset"] for it in items]),
               per_preset=per_preset, reference=reference_scores(items[:n_cond]))
    if base is not None:
        res["paired"] = paired_difference(true, base, args.baseline)
    print(json.dumps(res, indent=1), flush=True)
    if args.out:  # the file also keeps every clip's score (seed-major), what a later --baseline pairs against
        with open(args.out, "w") as f:
            json.dump(dict(res, clip_scores=[round(float(x), 6) for x in true]), f, indent=1)


def read_baseline(baseline_json: str, seeds: list, **same) -> dict:
    """A --baseline file, refused unless it holds clip scores for the same noise seeds and, for each keyword given
    (rooms, amplitude, estimator_kwargs), the value this read uses: a file that does not record one (written before
    it was kept) is not checked on it. main reads it once, before sampling; paired_difference checks the count."""
    with open(baseline_json) as f:
        base = json.load(f)
    got = len(base.get("clip_scores", ()))
    if base.get("seeds") != list(seeds) or not got:
        refuse(f"--baseline {baseline_json}: not the same clips (seeds {base.get('seeds')}, {got} clip "
               f"scores; here seeds {list(seeds)})")
    for key, value in same.items():
        if key in base and base[key] != value:
            refuse(f"--baseline {baseline_json}: read with {key} {base[key]!r}, here {value!r}")
    return base


def paired_difference(scores: np.ndarray, base: dict, baseline_json: str) -> dict:
    """This model's cam_score (N,) minus a baseline's (read_baseline's dict of the file baseline_json, whose
    clip_scores its --out file kept; the path only names it in a refusal) on the same clips (same conditions and noise
    seeds), with the standard error of the mean difference: the pairing removes the conditions' and noises' spread,
    which the two means' own standard errors each carry."""
    ref = np.asarray(base["clip_scores"], dtype=np.float64)
    if ref.shape != scores.shape:
        refuse(f"--baseline {baseline_json}: {ref.size} clip scores, here {scores.size}: not the same clips")
    d = scores - ref
    return dict(baseline=base.get("model"), mean=float(d.mean()), se=float(d.std(ddof=1) / np.sqrt(d.size)))


if __name__ == "__main__":
    main()

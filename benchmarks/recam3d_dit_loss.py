"""How much of the 3-D world's camera a room3d start model's DiT has learnt, in a minute instead of recam3d_start.py's
five: its flow-matching loss on the clips' moved latent frames (1 and 2; frame 0 is the source camera's), per noise
level, with the true camera numbers, with the numbers of another clip (shuffled) and with no motion, on pool items it
was pretrained on and on fresh ones of the same distribution (new rooms, new paths, the same mislabelled share).

    python benchmarks/recam3d_dit_loss.py --model tiny-recam3d --out docs/recam3d_dit_loss.json

Read it so: shuffled - true at the highest noise (where the layout is decided) is what the camera tells the DiT; fresh -
pretrained is how far it has learnt its pool by heart (a bigger pool is then what helps, not more steps). Pool items
are those of benchmarks/pretrain_pools.py with the model's own pretraining settings (its pretrain_meta.json); fresh
items are the pool's items past its size (the same draw, so the same distribution). Noises and levels are seeded, the
same for every model and set: differences between them are paired. The camera gain is also given per motion kind (pan,
tilt, zoom, translate, arc). `--labels true` labels every item with its true camera, so that DiTs pretrained on
different mislabelled shares are read on the same labels.

`--mode-gain` reads instead whether a DiT pretrained with `--mislabel-by noise` (or `noise-first`) has learnt to let
the noise pick the camera: the moved frames' loss at noise levels 0.8-0.99 with the label its coupling gives each
(item, noise) draw (the opposite camera when noise_mode is above its fraction's quantile) against the other label,
same clips and noises. A DiT that commits per noise reads well above 0 (about what the camera tells it); one that
blends the two cameras reads ~0 (for a model mislabelled by item, the coupling of fraction 0.5 on every frame is read:
the control).
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

from benchmarks.pretrain_pools import (mode_threshold, noise_mode, prompt_camera, room3d_clip,  # noqa: E402
                                       room3d_opposite_labels)
from benchmarks.pretrain_recam_video import shifted_sigma, velocity_error  # noqa: E402
from ddpo_grpo.core.pipeline_with_logprob import encode_frames  # noqa: E402
from ddpo_grpo.models import ModelPathError, load_pipeline, resolve_model_path  # noqa: E402

LEVELS = [(0.0, 0.3), (0.3, 0.6), (0.6, 0.85), (0.85, 1.0)]  # sigma buckets (the pretraining's shifted draw)
MODE_SIGMAS = (0.99, 0.96, 0.9, 0.8)  # --mode-gain's levels: where a clip's layout (and so its camera) is decided


def mode_gain(den, vae, embed, clips, opposite, fraction: float, first_frame: bool, draws: int, g) -> dict:
    """{sigma: {"coupled", "other", "gain", "se"}}: moved-frame losses of clips = (source (N, F, 3, H, W), target,
    true cameras (N, F', 12), true prompts) at each of MODE_SIGMAS, `draws` seeded noises per clip, conditioned as
    --mislabel-by noise[-first] couples them (opposite = (cameras, prompts) of the opposite motion when
    noise_mode(noise, first_frame) > mode_threshold(fraction)) and the other way; gain = other - coupled, se its
    standard error over the N x draws pairs."""
    src, tgt, cams, prompts = clips
    ocams, oprompts = opposite
    thr = mode_threshold(fraction)
    with torch.no_grad():
        ls, lt = encode_frames(vae, src), encode_frames(vae, tgt)
        et, eo = embed(prompts), embed(oprompts)
        cams, ocams = cams.float(), ocams.float()
        noises = torch.randn(draws, *lt.shape, generator=g)
        flips = [noise_mode(noise, first_frame) > thr for noise in noises]  # the coupling of each draw: per noise only
        out = {}
        for sig in MODE_SIGMAS:
            pairs = []
            for noise, flip in zip(noises, flips):
                loss = []
                for want in (flip, ~flip):
                    c, e = torch.where(want[:, None, None], ocams, cams), torch.where(want[:, None, None], eo, et)
                    err = velocity_error(den, lt, ls, c, e, torch.full((len(lt),), sig), noise) ** 2
                    loss.append(err[:, :, 1:].mean(dim=(1, 2, 3, 4)))
                pairs.append(torch.stack(loss, 1))
            pairs = torch.cat(pairs).double()
            d = pairs[:, 1] - pairs[:, 0]
            out[str(sig)] = dict(coupled=float(pairs[:, 0].mean()), other=float(pairs[:, 1].mean()),
                                 gain=float(d.mean()), se=float(d.std() / len(d) ** 0.5))
    return out


def losses(den, vae, embed, clips, u, noise):
    """(R * N, 3): sigma, loss over the whole clip's latents, loss over the moved latent frames, for clips = (source
    (N, F, 3, H, W), target, cameras (N, F', 12), prompts) at levels u (R, N) and noises (R, N, C, F', h, w)."""
    src, tgt, cams, prompts = clips
    with torch.no_grad():
        ls, lt = encode_frames(vae, src), encode_frames(vae, tgt)
        emb = embed(prompts)
        cams = cams.float()
        rows = []
        for r in range(len(u)):
            sigma = shifted_sigma(u[r])
            err = torch.cat([velocity_error(den, lt[i:i + 32], ls[i:i + 32], cams[i:i + 32], emb[i:i + 32],
                                            sigma[i:i + 32], noise[r][i:i + 32]) for i in range(0, len(lt), 32)]) ** 2
            rows.append(torch.stack([sigma, err.mean(dim=(1, 2, 3, 4)), err[:, :, 1:].mean(dim=(1, 2, 3, 4))], 1))
    return torch.cat(rows).numpy()


def summary(rows) -> dict:
    out = {"loss": float(rows[:, 1].mean()), "moved": float(rows[:, 2].mean())}
    for lo, hi in LEVELS:
        m = (rows[:, 0] >= lo) & (rows[:, 0] < hi + (1e-6 if hi == 1.0 else 0.0))
        out[f"moved_sigma_{lo}-{hi}"] = float(rows[m, 2].mean())
    return out


def camera_word(prompt: str) -> str:
    """The kind word of a pool prompt's camera, in ReCamMaster's words ("..., camera zoom out" -> "zoom", where
    paths.motion_kind says "dolly"; the keys of this benchmark's per-kind figures): the opposite motion keeps it."""
    return prompt_camera(prompt).split()[0]


def gain_by_kind(true_rows, shuffled_rows, prompts, sigma_min: float) -> dict:
    """Shuffled - true moved-frame loss at sigma >= sigma_min per motion kind, from losses()' rows (R * N, 3), row
    r * N + i being item i: {kind: {"gain", "n" (item-draws at that level)}}."""
    kinds = np.array([camera_word(p) for p in prompts] * (len(true_rows) // len(prompts)))
    hi = true_rows[:, 0] >= sigma_min
    return {k: {"gain": float(shuffled_rows[hi & (kinds == k), 2].mean() - true_rows[hi & (kinds == k), 2].mean()),
                "n": int((hi & (kinds == k)).sum())} for k in sorted(set(kinds))}


def load_room3d_model(model: str):
    """(folder, pretrain_meta, denoiser, VAE, embed(prompts) -> (B, L, D)) of a folder pretrain_recam_video.py saved on
    the room3d world; one error line (exit) for a folder without pretrain_meta.json or of the 2-D world."""
    from diffusers import WanPipeline

    try:
        folder = resolve_model_path(model)
    except ModelPathError as e:  # not a model folder at all
        refuse(str(e))
    meta_file = os.path.join(folder, "pretrain_meta.json")
    if not os.path.isfile(meta_file):
        refuse(f"{folder} has no pretrain_meta.json (not a folder pretrain_recam_video.py saved)")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta["args"].get("world") != "room3d":
        refuse(f"{folder} was not pretrained on the room3d world")
    lp = load_pipeline(folder, recam_checkpoint=os.path.join(folder, "recammaster.ckpt"))
    den, vae = lp.unet.eval(), lp.vae
    pipe = WanPipeline(tokenizer=lp.tokenizer, text_encoder=lp.text_encoder, vae=vae, transformer=den.model,
                       scheduler=lp.scheduler)

    def embed(prompts):
        return torch.stack([pipe.encode_prompt([p], do_classifier_free_guidance=False, max_sequence_length=512,
                                               device="cpu")[0][0] for p in prompts])

    return folder, meta, den, vae, embed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-recam3d", help="a bundled name or a folder pretrain_recam_video.py saved")
    ap.add_argument("-n", type=int, default=128, help="clips per set")
    ap.add_argument("--draws", type=int, default=4, help="noise draws per clip")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--labels", choices=["own", "true"], default="own",
                    help="own: the items labelled as the model's pretraining labelled them (its mislabelled share); "
                         "true: every item with its true camera, so that models pretrained on different shares compare")
    ap.add_argument("--mode-gain", action="store_true",
                    help="read only whether the noise picks the camera (--mislabel-by noise models; see the docstring)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    _, meta, den, vae, embed = load_room3d_model(args.model)
    pa = meta["args"]
    if args.mode_gain:
        by = pa.get("mislabel_by", "item")
        fraction = pa["mislabel_fraction"] if by != "item" else 0.5
        got = [room3d_clip(i, pa["frames"], pa["height"], pa["width"], pa["supersample"], "none", 0.5)
               for i in range(args.n)]
        clips = tuple(torch.from_numpy(np.stack([x[j] for x in got])) for j in range(3)) + ([x[3] for x in got],)
        res = dict(model=args.model, mislabel_by=by, fraction=fraction, n=args.n, draws=args.draws,
                   dit_steps=meta.get("dit_steps"),
                   by_sigma=mode_gain(den, vae, embed, clips, room3d_opposite_labels(args.n, pa["frames"]), fraction,
                                      by == "noise-first", args.draws, torch.Generator().manual_seed(0)),
                   seconds=round(time.time() - t0, 1))
        print("mode gain (other - coupled label, moved frames): " + ", ".join(
            f"sigma {k}: {v['gain']:+.4f} +- {v['se']:.4f}" for k, v in res["by_sigma"].items()), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return

    mislabel = pa["mislabel"] if args.labels == "own" else "none"  # the paths do not depend on it, only the labels

    def items(first):
        got = [room3d_clip(first + i, pa["frames"], pa["height"], pa["width"], pa["supersample"], mislabel,
                           pa["mislabel_fraction"]) for i in range(args.n)]
        return (torch.from_numpy(np.stack([g[0] for g in got])), torch.from_numpy(np.stack([g[1] for g in got])),
                torch.from_numpy(np.stack([g[2] for g in got])), [g[3] for g in got])

    pool, fresh = items(0), items(int(pa["pool"]))
    n_lat = pool[2].shape[1]
    still = torch.from_numpy(np.tile(np.eye(4)[:3].reshape(1, 1, 12), (args.n, n_lat, 1)))
    perm = torch.randperm(args.n, generator=torch.Generator().manual_seed(1))
    sets = {"pool": pool, "pool_shuffled_cameras": (pool[0], pool[1], pool[2][perm], pool[3]),
            "pool_no_motion": (pool[0], pool[1], still, pool[3]), "fresh": fresh}
    g = torch.Generator().manual_seed(0)
    u = torch.rand(args.draws, args.n, generator=g)
    with torch.no_grad():
        shape = encode_frames(vae, pool[1][:1]).shape[1:]
    noise = torch.randn(args.draws, args.n, *shape, generator=g)
    rows = {name: losses(den, vae, embed, clips, u, noise) for name, clips in sets.items()}
    res = {name: summary(r) for name, r in rows.items()}
    top = f"moved_sigma_{LEVELS[-1][0]}-{LEVELS[-1][1]}"
    res["camera_gain_by_kind"] = gain_by_kind(rows["pool"], rows["pool_shuffled_cameras"], pool[3], LEVELS[-1][0])
    res.update(model=args.model, labels=args.labels, n=args.n, draws=args.draws, pool_size=int(pa["pool"]),
               dit_steps=meta.get("dit_steps"),
               camera_gain=res["pool_shuffled_cameras"][top] - res["pool"][top],
               memorised=res["fresh"]["moved"] - res["pool"]["moved"], seconds=round(time.time() - t0, 1))
    for name in sets:
        r = res[name]
        print(f"{name:22s} loss {r['loss']:.3f}  moved frames {r['moved']:.3f}  by noise level "
              + " ".join(f"{r[f'moved_sigma_{lo}-{hi}']:.3f}" for lo, hi in LEVELS))
    print(f"camera gain (shuffled - true, moved frames, sigma >= {LEVELS[-1][0]}): {res['camera_gain']:.3f}; "
          f"fresh - pool (moved frames): {res['memorised']:+.3f}; {res['seconds']} s")
    print("camera gain by kind: " + ", ".join(f"{k} {v['gain']:.3f} (n {v['n']})"
                                              for k, v in res["camera_gain_by_kind"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

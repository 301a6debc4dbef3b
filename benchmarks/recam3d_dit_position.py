"""Does a room3d start model's DiT know where its tokens are? A zoom or a translation moves content by an amount that
depends on where in the frame it is (and how far), so rendering one needs each token's place in the frame; Wan's DiT
has no absolute position in its tokens (3-D RoPE only: attention sees offsets), so whatever it knows of the place it
has read from the content (a floor is below, a ceiling above) or from the frame's edges.

A linear probe reads it: every block's output tokens on clips of the 3-D world (true cameras, one noise level), a ridge
regression from a token's hidden state to its (row, column) in the token grid, fitted on 3/4 of the clips and scored
(R^2) on the rest, separately for the target's moved latent frames and for the source's. R^2 1 is a DiT that knows
each token's place exactly, 0 one that does not know it at all (a linear read, so a lower bound).

    python benchmarks/recam3d_dit_position.py --model tiny-recam3d --out docs/recam3d_dit_position.json
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

from benchmarks.pretrain_pools import room3d_clip  # noqa: E402
from benchmarks.pretrain_recam_video import predict_velocity  # noqa: E402
from benchmarks.recam3d_dit_loss import load_room3d_model  # noqa: E402
from ddpo_grpo.core.pipeline_with_logprob import encode_frames  # noqa: E402

FIRST_CLIP = 50_000  # pool items far past any pretraining pool's size: clips the model has not trained on


def probe_r2(X: np.ndarray, Y: np.ndarray, n_train: int, ridge: float = 1e-2) -> np.ndarray:
    """R^2 per column of Y (M, k) of a ridge regression from X (M, D) fitted on the first n_train rows and scored on the
    rest (ridge: the penalty per training row, on centred features)."""
    mu, ym = X[:n_train].mean(0), Y[:n_train].mean(0)
    Xtr, Xte = X[:n_train] - mu, X[n_train:] - mu
    W = np.linalg.solve(Xtr.T @ Xtr + ridge * n_train * np.eye(X.shape[1]), Xtr.T @ (Y[:n_train] - ym))
    err = ((Xte @ W + ym - Y[n_train:]) ** 2).sum(0)
    return 1.0 - err / ((Y[n_train:] - Y[n_train:].mean(0)) ** 2).sum(0)


def token_grid(frames: int, h: int, w: int) -> tuple:
    """((frames * h * w, 2) (row, column), (frames * h * w,) frame) of the DiT's tokens in their order (frame-major)."""
    rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    pos = np.tile(np.stack([rr.ravel(), cc.ravel()], 1), (frames, 1)).astype(np.float64)
    return pos, np.repeat(np.arange(frames), h * w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-recam3d", help="a bundled name or a folder pretrain_recam_video.py saved")
    ap.add_argument("-n", type=int, default=96, help="clips (3/4 fit the probe, 1/4 score it)")
    ap.add_argument("--sigma", type=float, default=0.9, help="the noise level of the target latents")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    _, meta, den, vae, embed = load_room3d_model(args.model)
    pa = meta["args"]
    got = [room3d_clip(FIRST_CLIP + i, pa["frames"], pa["height"], pa["width"], pa["supersample"], "none", 0.0)
           for i in range(args.n)]
    src, tgt = (torch.from_numpy(np.stack([g[j] for g in got])) for j in (0, 1))
    cams = torch.from_numpy(np.stack([g[2] for g in got])).float()
    feats = {}
    hooks = [b.register_forward_hook(lambda m, i, o, k=k: feats.__setitem__(f"block {k}", o.detach()))
             for k, b in enumerate(den.model.blocks)]
    hooks.append(den.model.patch_embedding.register_forward_hook(
        lambda m, i, o: feats.__setitem__("patch embedding", o.detach().flatten(2).transpose(1, 2))))
    with torch.no_grad():
        ls, lt = encode_frames(vae, src), encode_frames(vae, tgt)
        emb = embed([g[3] for g in got])
        noise = torch.randn(lt.shape, generator=torch.Generator().manual_seed(0))
        xt = (1 - args.sigma) * lt + args.sigma * noise
        predict_velocity(den, xt, ls, cams, emb, torch.full((args.n,), args.sigma))  # the hooks keep the tokens
    for h in hooks:
        h.remove()
    n_lat = lt.shape[2]
    _, ph, pw = den.model.config.patch_size
    pos, frame = token_grid(2 * n_lat, lt.shape[3] // ph, lt.shape[4] // pw)  # target frames, then the source's
    n_fit = args.n * 3 // 4
    res = {}
    for name in ["patch embedding"] + [f"block {k}" for k in range(len(den.model.blocks))]:
        X = feats[name].double().numpy()  # (n, tokens, D)
        row = {}
        for part, sel in (("target_moved", (frame >= 1) & (frame < n_lat)), ("source", frame >= n_lat)):
            r2 = probe_r2(X[:, sel].reshape(-1, X.shape[-1]), np.tile(pos[sel], (args.n, 1)), n_fit * int(sel.sum()))
            row[part] = {"row": float(r2[0]), "column": float(r2[1])}
        res[name] = row
        print(f"{name:16s} target's moved frames R^2 row {row['target_moved']['row']:.2f} column "
              f"{row['target_moved']['column']:.2f} | source row {row['source']['row']:.2f} column "
              f"{row['source']['column']:.2f}", flush=True)
    res.update(model=args.model, n=args.n, sigma=args.sigma, seconds=round(time.time() - t0, 1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Stage 1 of benchmarks/pretrain_recam_video.py: the video VAE (AutoencoderKLWan) trained to reconstruct the pool's
clips, its latents then normalised by their measured per-channel mean / std, as Wan's are."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn.functional as F


def to_vae(frames):  # (B, F, 3, H, W) in [0, 1] -> (B, 3, F, H, W) in [-1, 1]
    return frames.permute(0, 2, 1, 3, 4) * 2 - 1


def train_vae(args, vae, src, tgt, g, t0) -> None:
    """Stage 1: train the VAE on the pool's clips, then set its latents_mean / latents_std to the measured ones."""
    # A near-deterministic autoencoder (posterior mean decoded, a small pull of the means towards 0): the latents are
    # then normalised by their measured mean / std, as Wan's are; cosine decay lets the reconstruction settle.
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    vsched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s / args.vae_steps, 1.0))))
    running, raw = [], []
    # The loss reads the decoder's output before AutoencoderKLWan.decode clamps it to [-1, 1]: on the clamped output
    # the background (-1) saturates at once and the gradient vanishes (measured: stuck at the blank frame's error).
    hook = vae.decoder.register_forward_hook(lambda module, args, out: raw.append(out))
    for step in range(1, args.vae_steps + 1):
        idx = torch.randint(0, len(src), (args.batch // 4,), generator=g)
        x = to_vae(torch.cat([src[idx], tgt[idx]])).to(next(vae.parameters()).device)
        raw.clear()
        z = vae.encode(x).latent_dist.mean
        vae.decode(z)
        rec = torch.cat(raw, dim=2)
        mse = F.mse_loss(rec, x)
        loss = mse + 1e-4 * z.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        vsched.step()
        running.append(mse.item())
        if step % 100 == 0 or step == 1:
            print(f"vae {step}/{args.vae_steps} rec (mean of last 100) {np.mean(running[-100:]):.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if args.vae_snapshot_every and step % args.vae_snapshot_every == 0 and step < args.vae_steps:
            snap = os.path.join(args.out + "_vae_snapshots", f"step{step}")
            vae.save_pretrained(snap + ".tmp")  # written whole, then renamed: a crash never leaves a half snapshot
            import shutil

            shutil.rmtree(snap, ignore_errors=True)
            os.replace(snap + ".tmp", snap)
    hook.remove()
    with torch.no_grad():
        dev = next(vae.parameters()).device
        means = torch.cat([vae.encode(to_vae(src[i:i + 64]).to(dev)).latent_dist.mean
                           for i in range(0, min(512, len(src)), 64)])
    mu, sd = means.mean(dim=(0, 2, 3, 4)), means.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[float(v) for v in mu], latents_std=[float(v) for v in sd])

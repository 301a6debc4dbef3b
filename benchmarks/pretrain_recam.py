"""Pretrain the bundled tiny camera re-rendering model ("tiny-recam") on the recam world.

    python benchmarks/pretrain_recam.py --out assets/tiny-recam --steps 3000 --snapshot-every 500

The model re-renders a source view under a requested camera motion: a pixel-space UNet whose input is
9 channels = 3 noisy target channels + the 6 condition channels of `RecamConditions` items (source view in
[-1, 1] and the planes dx/8, dy/8, 4*log(zoom)); it predicts v (v-prediction, DDIMScheduler with cosine
betas, as the tiny text-to-image model). There is no text encoder: the UNet gets encoder_hidden_states of
zeros (B, 1, 64), which is what the trainer feeds a pipeline without a text encoder. Every batch is a
fresh set of random (scene, source camera, motion) triples, so the fixed train/eval conditions of
`RecamConditions` are not memorised. Seeded and reproducible on the CPU; snapshots every --snapshot-every
steps are written to <out>_snapshots/stepN so a run can be stopped early. Saved: <out>/unet, <out>/scheduler
and <out>/pretrain_meta.json (load with ddpo_grpo.models.load_pipeline).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.models.tiny import build_ddim_scheduler, build_unet, optimizer_step, save_model as save  # noqa: E402
from ddpo_grpo.worlds.recam.world import sample_training_batch  # noqa: E402

COND_CHANNELS = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    unet = build_unet(in_channels=3 + COND_CHANNELS)
    scheduler = build_ddim_scheduler()
    cross_dim = unet.config.cross_attention_dim
    params = list(unet.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + np.cos(np.pi * min(s / args.steps, 1.0)))
    )
    meta = {"family": "ddim", "model": "recam", "in_channels": 3 + COND_CHANNELS, "args": vars(args)}
    t0 = time.time()
    for step in range(1, args.steps + 1):
        cond, x0, _ = sample_training_batch(args.batch_size, rng)
        cond, x0 = torch.from_numpy(cond), torch.from_numpy(x0)
        noise = torch.randn_like(x0)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (x0.shape[0],))
        xt = scheduler.add_noise(x0, noise, t)
        target = scheduler.get_velocity(x0, noise, t)
        emb = torch.zeros(x0.shape[0], 1, cross_dim)
        pred = unet(torch.cat([xt, cond], dim=1), t, encoder_hidden_states=emb).sample
        loss = F.mse_loss(pred, target)
        optimizer_step(loss, opt, sched, params)
        if step % args.log_every == 0 or step == 1:
            print(f"step {step}/{args.steps} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if args.snapshot_every and step % args.snapshot_every == 0 and step < args.steps:
            save(os.path.join(args.out + "_snapshots", f"step{step}"), unet, scheduler, dict(meta, steps=step))
    save(args.out, unet, scheduler, dict(meta, steps=args.steps, seconds=round(time.time() - t0),
                                         torch=torch.__version__))
    print(f"saved {args.out} after {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

"""Pretrain the bundled tiny text-to-image model on the toy world.

    python benchmarks/pretrain_tiny.py --family ddim --out assets/tiny-t2i --steps 1500
    python benchmarks/pretrain_tiny.py --family flow --out assets/tiny-flow --steps 1500

`ddim`: v-prediction with a DDIMScheduler (cosine betas). `flow`: rectified flow (x_t = (1-s) x0 + s eps,
velocity target eps - x0) with a FlowMatchEulerDiscreteScheduler. Both are seeded and reproducible on
the CPU; the model is deliberately small and briefly trained so that it is imperfect (RL head-room).
Snapshots are written every --snapshot-every steps so a run can be stopped early.

`--init tiny-t2i --caption-noise 0.4` continues from a model with noisy captions: each colour word is replaced
by another colour with that probability, as web captions are wrong about what they show. The result draws the
named colour less often; the error is the same for every condition, so the verifiable reward can correct it
on training conditions and the correction carries over to held-out ones (`assets/tiny-t2i-noisy`, the demo's
model; docs/efficacy.md).
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

from ddpo_grpo.core.families import get_family  # noqa: E402
from ddpo_grpo.models.tiny import (  # noqa: E402
    build_ddim_scheduler, build_flow_scheduler, build_text_encoder, build_tokenizer, build_unet, optimizer_step, save_model,
)
from ddpo_grpo.worlds.toyworld import COLORS, sample_training_batch, vocabulary  # noqa: E402


def uniform_timestep_levels(n: int, n_train: int) -> torch.Tensor:
    """(n,) noise levels u whose DDIM timestep floor(u * n_train) is uniform over the training timesteps. The
    +0.5 keeps floor() on the drawn integer despite float rounding."""
    return (torch.randint(0, n_train, (n,)) + 0.5) / n_train


def logit_normal_levels(n: int, n_train: int) -> torch.Tensor:
    """(n,) logit-normal sigmas, as in SD3: more weight on the middle of the path."""
    return torch.sigmoid(torch.randn(n))


# Per family: the scheduler of a fresh model and how pretraining draws noise levels (a choice of this script; the
# forward process and the regression target at a level are the family's, ModelFamily.noised_and_target).
PRETRAIN = {"ddim": (build_ddim_scheduler, uniform_timestep_levels), "flow": (build_flow_scheduler, logit_normal_levels)}


def save(out: str, unet, text_encoder, tokenizer, scheduler, meta: dict) -> None:
    save_model(out, unet, scheduler, meta, text_encoder=text_encoder, tokenizer=tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=list(PRETRAIN), default="ddim")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cfg-dropout", type=float, default=0.1, help="share of empty prompts, for classifier-free guidance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--init", default="", help="continue from this model (bundled name or folder)")
    ap.add_argument("--caption-noise", type=float, default=0.0,
                    help="probability that each colour word of a caption is replaced by another colour")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if args.init:
        from ddpo_grpo.models import load_pipeline

        pipe = load_pipeline(args.init)
        tokenizer, text_encoder, unet, scheduler = pipe.tokenizer, pipe.text_encoder, pipe.unet, pipe.scheduler
        args.family = pipe.family
        for m in (unet, text_encoder):
            m.requires_grad_(True)
            m.train()
    else:
        tok_dir = os.path.join(args.out, "tokenizer")
        tokenizer = build_tokenizer(vocabulary(), tok_dir)
        text_encoder = build_text_encoder(len(tokenizer))
        unet = build_unet()
        scheduler = PRETRAIN[args.family][0]()
    family, draw_levels = get_family(args.family), PRETRAIN[args.family][1]
    colours = list(COLORS)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + np.cos(np.pi * min(s / args.steps, 1.0)))
    )
    t0 = time.time()
    for step in range(1, args.steps + 1):
        prompts, x0, _ = sample_training_batch(args.batch_size, rng)
        if args.caption_noise > 0:
            prompts = [" ".join(colours[(colours.index(w) + 1 + rng.integers(len(colours) - 1)) % len(colours)]
                                if w in colours and rng.random() < args.caption_noise else w
                                for w in p.split()) for p in prompts]
        prompts = ["" if rng.random() < args.cfg_dropout else p for p in prompts]
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids
        emb = text_encoder(ids)[0]
        noise = torch.randn_like(x0)
        u = draw_levels(x0.shape[0], scheduler.config.num_train_timesteps)
        xt, timestep, target = family.noised_and_target(scheduler, x0, noise, u)
        pred = unet(xt, timestep, encoder_hidden_states=emb).sample
        loss = F.mse_loss(pred, target)
        optimizer_step(loss, opt, sched, params)
        if step % 50 == 0 or step == 1:
            print(f"step {step}/{args.steps} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if args.snapshot_every and step % args.snapshot_every == 0 and step < args.steps:
            save(os.path.join(args.out + "_snapshots", f"step{step}"), unet, text_encoder, tokenizer, scheduler,
                 {"family": args.family, "steps": step, "args": vars(args)})
    save(args.out, unet, text_encoder, tokenizer, scheduler,
         {"family": args.family, "steps": args.steps, "seconds": round(time.time() - t0), "args": vars(args),
          "torch": torch.__version__})
    print(f"saved {args.out} after {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

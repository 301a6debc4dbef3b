"""One flow-matching training step of the recam tiny DiT (ReCamMaster's architecture: WanTransformer3DModel + camera
layers) at the 3-D world's latent size (B 16, 8 channels, 3 x 8 x 12 latents, the source's 3 frames beside), for a few
widths, depths and patch sizes: what a wider start model would cost on this CPU before pretraining one (docs/recam_log.md).

    python benchmarks/dit_step_speed.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.pretrain_recam_video import build_parts  # noqa: E402
from ddpo_grpo.models.recam import CAMERA_DIM, RecamDenoiser, add_camera_layers  # noqa: E402

# (spatial patch, heads of 16 channels, blocks); the bundled tiny-recam3d is the first
SHAPES = [(2, 4, 4), (1, 4, 4), (2, 8, 4), (2, 4, 8)]


def step_seconds(patch: int, heads: int, layers: int, batch: int = 16, repeats: int = 4) -> tuple:
    # the DiT pretrain_recam_video.py builds (--dit-patch / --dit-heads / --dit-layers, --dit-ffn 32 x heads)
    tr = build_parts(0, dit_heads=heads, dit_layers=layers, dit_ffn=32 * heads, dit_patch=patch)["transformer"]
    den = RecamDenoiser(add_camera_layers(tr))
    opt = torch.optim.AdamW(tr.parameters(), 1e-4)
    x = torch.randn(batch, 8 + 8 + CAMERA_DIM, 3, 8, 12)  # noisy target, source latents, camera planes
    emb = torch.randn(batch, 16, 32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        den(x, torch.rand(batch) * 1000, encoder_hidden_states=emb).sample.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return sum(p.numel() for p in tr.parameters()), min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for patch, heads, layers in SHAPES:
        n, s = step_seconds(patch, heads, layers)
        print(f"patch 1 x {patch} x {patch} channels {16 * heads} blocks {layers}: {n} parameters, {s:.3f} s a step",
              flush=True)


if __name__ == "__main__":
    main()

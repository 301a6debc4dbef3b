"""Pretrain the bundled tiny ReCamMaster-architecture model ("tiny-recam-video") on the video camera world.

    python benchmarks/pretrain_recam_video.py --out assets/tiny-recam-video

What it builds, with diffusers' own classes: a Wan VAE (AutoencoderKLWan, 4x space and 4x time: 9 frames of 32x32 px
-> latents 8 x 3 x 8 x 8, per-channel latents_mean / latents_std measured on the world), a tiny UMT5 text encoder
(seeded random, frozen: the prompt's words name the objects and the preset) and a WanTransformer3DModel with
ReCamMaster's camera layers (models.recam.add_camera_layers: zero / identity at the start, as ReCamMaster starts
from Wan). Stage 1 trains the VAE to reconstruct clips; stage 2 trains the DiT by flow matching (velocity noise - x0,
sigma shifted by the scheduler's flow_shift) to produce the target clip's latents from the source clip's latents,
the camera numbers and the prompt, exactly through RecamDenoiser, the module the trainer samples with.

Saved: <out>/ as WanPipeline.save_pretrained writes it (the transformer without the camera tensors, so plain diffusers
loads the folder), <out>/recammaster.ckpt (the DiT with camera layers under the original Wan key names, as ReCamMaster
saves a checkpoint) and <out>/pretrain_meta.json. Conditions come from a pool of clips drawn from fresh seeds (not the
train / eval indices of RecamVideoConditions). Seeded; on one CPU core.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.models.recam import EXPORT_CHECKPOINT, RecamDenoiser, add_camera_layers, camera_planes, original_state  # noqa: E402
from ddpo_grpo.models.wan import build_umt5_tokenizer, wan_scheduler_config  # noqa: E402
from ddpo_grpo.worlds.recam.video import sample_video_condition  # noqa: E402

POOL_SEED = 10_000  # pool conditions use rng (POOL_SEED, i): disjoint from the dataset's (seed, index) streams
Z_DIM = 8
FLOW_SHIFT = 3.0


def build_parts(seed: int):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    words = ["camera", "pan", "tilt", "zoom", "translate", "arc", "left", "right", "up", "down", "in", "out", ","]
    from ddpo_grpo.worlds.toyworld.dataset import vocabulary

    tok = build_umt5_tokenizer(sorted(set(vocabulary()) | set(words) | {"a", "an", "and", "the"}))
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, tie_word_embeddings=False))
    vae = AutoencoderKLWan(base_dim=16, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4,
                           latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=Z_DIM, out_channels=Z_DIM,
        text_dim=32, freq_dim=32, ffn_dim=128, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(**wan_scheduler_config(FLOW_SHIFT))
    return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)


def make_pool(n: int, frames: int, size: int):
    src, tgt, cams, prompts = [], [], [], []
    for i in range(n):
        c = sample_video_condition(np.random.default_rng((POOL_SEED, i)))
        src.append(c.source_video(frames, size))
        tgt.append(c.target_video(frames, size))
        cams.append(c.cameras(frames))
        prompts.append(c.prompt())
    return (torch.from_numpy(np.stack(src)), torch.from_numpy(np.stack(tgt)), torch.from_numpy(np.stack(cams)), prompts)


def to_vae(frames):  # (B, F, 3, H, W) in [0, 1] -> (B, 3, F, H, W) in [-1, 1]
    return frames.permute(0, 2, 1, 3, 4) * 2 - 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="assets/tiny-recam-video")
    ap.add_argument("--pool", type=int, default=3072)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--dit-steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    parts = build_parts(args.seed)
    pool_file = f"/tmp/recam_video_pool_{args.pool}_{args.frames}_{args.size}.pt"
    if os.path.isfile(pool_file):
        src, tgt, cams, prompts = torch.load(pool_file)
    else:
        src, tgt, cams, prompts = make_pool(args.pool, args.frames, args.size)
        torch.save((src, tgt, cams, prompts), pool_file)
    print(f"pool {len(prompts)} clips {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator().manual_seed(args.seed)

    # ---- stage 1: the VAE
    vae = parts["vae"]
    # A near-deterministic autoencoder (posterior mean decoded, a small pull of the means towards 0): the latents are
    # then normalised by their measured mean / std, as Wan's are; cosine decay lets the reconstruction settle.
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    vsched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s / args.vae_steps, 1.0))))
    running, raw = [], []
    # The loss reads the decoder's output before AutoencoderKLWan.decode clamps it to [-1, 1]: on the clamped output
    # the background (-1) saturates at once and the gradient vanishes (measured: stuck at the blank frame's error).
    hook = vae.decoder.register_forward_hook(lambda module, args, out: raw.append(out))
    for step in range(1, args.vae_steps + 1):
        idx = torch.randint(0, len(prompts), (args.batch // 4,), generator=g)
        x = to_vae(torch.cat([src[idx], tgt[idx]]))
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
    hook.remove()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        means = torch.cat([vae.encode(to_vae(src[i:i + 64])).latent_dist.mean for i in range(0, min(512, len(prompts)), 64)])
    mu = means.mean(dim=(0, 2, 3, 4))
    sd = means.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[float(v) for v in mu], latents_std=[float(v) for v in sd])
    from ddpo_grpo.core.pipeline_with_logprob import decode, encode_frames

    with torch.no_grad():
        lat_src = torch.cat([encode_frames(vae, src[i:i + 64]) for i in range(0, len(prompts), 64)])
        lat_tgt = torch.cat([encode_frames(vae, tgt[i:i + 64]) for i in range(0, len(prompts), 64)])
        rec_err = (decode(vae, lat_tgt[:64]) - tgt[:64]).abs().mean().item()
    print(f"latents {tuple(lat_src.shape[1:])} mean |decode(encode) - x| {rec_err:.4f} {time.time() - t0:.0f}s",
          flush=True)

    # ---- stage 2: the DiT with camera layers, by flow matching through RecamDenoiser
    from diffusers import WanPipeline

    text_encoder, tok = parts["text_encoder"].eval().requires_grad_(False), parts["tokenizer"]
    transformer = add_camera_layers(parts["transformer"])
    den = RecamDenoiser(transformer)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=parts["scheduler"])
    uniq = sorted(set(prompts))
    with torch.no_grad():
        emb = {p: pipe.encode_prompt([p], do_classifier_free_guidance=False, max_sequence_length=512,
                                     device="cpu")[0][0] for p in uniq}
    _, _, Fl, h, w = lat_src.shape
    opt = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (
        1 + np.cos(np.pi * min(s / args.dit_steps, 1.0))))
    for step in range(1, args.dit_steps + 1):
        idx = torch.randint(0, len(prompts), (args.batch,), generator=g)
        x0, s = lat_tgt[idx], lat_src[idx]
        u = torch.rand(args.batch, generator=g)
        sigma = FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)
        noise = torch.randn(x0.shape, generator=g)
        xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        cond = torch.cat([s, camera_planes(cams[idx], h, w)], dim=1)
        e = torch.stack([emb[prompts[i]] for i in idx.tolist()])
        pred = den(torch.cat([xt, cond], dim=1), sigma * 1000, encoder_hidden_states=e).sample
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == 1:
            print(f"dit {step}/{args.dit_steps} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if step % 1000 == 0 or step == args.dit_steps:
            save(args, parts, transformer, dict(vae_steps=args.vae_steps, dit_steps=step, seconds=round(time.time() - t0),
                                                vae_mean_abs_error=rec_err), step)


def save(args, parts, transformer, meta, step) -> None:
    """The folder (plain WanPipeline, camera tensors left out) + recammaster.ckpt; snapshots at <out>_snapshots/stepN."""
    from diffusers import WanPipeline, WanTransformer3DModel

    out = args.out if step == args.dit_steps else os.path.join(args.out + "_snapshots", f"step{step}")
    tmp = out + ".tmp"
    plain = WanTransformer3DModel.from_config(transformer.config)
    plain.load_state_dict({k: v for k, v in transformer.state_dict().items()
                           if ".cam_encoder." not in k and ".projector." not in k})
    WanPipeline(tokenizer=parts["tokenizer"], text_encoder=parts["text_encoder"], vae=parts["vae"], transformer=plain,
                scheduler=parts["scheduler"]).save_pretrained(tmp)
    torch.save(original_state(transformer), os.path.join(tmp, EXPORT_CHECKPOINT))
    with open(os.path.join(tmp, "pretrain_meta.json"), "w") as f:
        json.dump(dict(meta, args=vars(args), script="benchmarks/pretrain_recam_video.py"), f, indent=1)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    print(f"saved {out}", flush=True)


if __name__ == "__main__":
    main()

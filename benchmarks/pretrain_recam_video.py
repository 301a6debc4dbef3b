"""Pretrain the bundled tiny ReCamMaster-architecture model ("tiny-recam-video") on the video camera world.

    python benchmarks/pretrain_recam_video.py --out assets/tiny-recam-video

What it builds, with diffusers' own classes: a Wan VAE (AutoencoderKLWan, 4x space and 4x time: 9 frames of 32x32 px
-> latents 8 x 3 x 8 x 8, per-channel latents_mean / latents_std measured on the world), a tiny UMT5 text encoder
(seeded random, frozen: the prompt's words name the objects and the preset) and a WanTransformer3DModel with
ReCamMaster's camera layers (models.recam.add_camera_layers: zero / identity at the start, as ReCamMaster starts
from Wan). Stage 1 trains the VAE to reconstruct clips; stage 2 trains the DiT by flow matching (velocity noise - x0,
sigma shifted by the scheduler's flow_shift, or by --train-shift) to produce the target clip's latents from the source
clip's latents, the camera numbers and the prompt, exactly through RecamDenoiser, the module the trainer samples with.

Saved: <out>/ as WanPipeline.save_pretrained writes it (the transformer without the camera tensors, so plain diffusers
loads the folder), <out>/recammaster.ckpt (the DiT with camera layers under the original Wan key names, as ReCamMaster
saves a checkpoint) and <out>/pretrain_meta.json. Conditions come from a pool of clips drawn from fresh seeds (not the
train / eval indices of RecamVideoConditions; benchmarks/pretrain_pools.py). Seeded; on one CPU core, or `--device cuda`
(scripts/gpu_recam3d.sh).

The 3-D world ("tiny-recam3d", issue 59):

    python benchmarks/pretrain_recam_video.py --world room3d --height 32 --width 48 --mislabel opposite \
        --mislabel-fraction 0.5 --out assets/tiny-recam3d

pools clips of the room3d world (worlds/room3d): random rooms whose seeds (pretrain_pools.ROOM3D_SCENE_SEED + i) are
not the scene seeds of Room3DConditions' splits, random paths of every kind (`paths.random_motion`, kept inside the room
and clear of the objects as Room3DConditions keeps them), the static source clip, the exact target render, the camera
numbers (`clip_cameras`) and the prompt as Room3DConditions writes it ("<scene description>, camera <name>"). With
`--mislabel opposite`, a seeded `--mislabel-fraction` of the pool is conditioned on the OPPOSITE motion of its target
clip (`paths.opposite_motion`: the camera numbers AND the prompt's camera word), so the model, asked for a camera,
produces it or its opposite: a known, shared camera error (the video analogue of tiny-t2i-noisy's colour word).
With `--mislabel-by noise` the fraction is of the training draws instead of the items: a draw carries the opposite
camera when its noise's normalised sum (`noise_mode`, a standard normal) is above the fraction's quantile, so that a
sampler's starting noise could pick the camera and the model commit to one motion per sample where a fixed set of
mislabelled items makes a small DiT blend the two. Measured at the bundled size (docs/recam_log.md, sixteenth session):
4,000 steps do not teach it to read the noise (benchmarks/recam3d_dit_loss.py --mode-gain); it learns the share.
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

from ddpo_grpo.models.recam import EXPORT_CHECKPOINT, RecamDenoiser, add_camera_layers, camera_planes, original_state  # noqa: E402
from ddpo_grpo.models.wan import build_umt5_tokenizer, wan_scheduler_config  # noqa: E402
from benchmarks.pretrain_recam_vae import train_vae  # noqa: E402
from benchmarks.pretrain_pools import (kind_index, load_pool, mode_threshold, noise_mode,  # noqa: E402
                                       room3d_opposite_labels)
from benchmarks.noise_probe import apply_offset, offset_read, probe_inputs  # noqa: E402
from ddpo_grpo.worlds.room3d import paths as room3d_paths  # noqa: E402
from ddpo_grpo.worlds.room3d.scene import COLOURS  # noqa: E402
from ddpo_grpo.errors import ConfigError  # noqa: E402
from benchmarks.pretrain_recam_args import FLOW_SHIFT, Z_DIM, check_args, parse_args  # noqa: E402,F401



def build_parts(seed: int, extra_words=(), z_dim: int = Z_DIM, vae_base_dim: int = 16, dit_heads: int = 4,
                dit_layers: int = 4, dit_ffn: int = 128, dit_patch: int = 2, dit_head_dim: int = 16):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    words = ["camera", "pan", "tilt", "zoom", "translate", "arc", "left", "right", "up", "down", "in", "out", ","]
    words += list(extra_words)  # room3d's scene descriptions (the 2-D world's tokenizer stays as it was)
    from ddpo_grpo.worlds.toyworld.dataset import vocabulary

    tok = build_umt5_tokenizer(sorted(set(vocabulary()) | set(words) | {"a", "an", "and", "the"}))
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, tie_word_embeddings=False))
    vae = AutoencoderKLWan(base_dim=vae_base_dim, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4,
                           latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    transformer = WanTransformer3DModel(
        patch_size=(1, dit_patch, dit_patch), num_attention_heads=dit_heads, attention_head_dim=dit_head_dim,
        in_channels=z_dim, out_channels=z_dim, text_dim=32, freq_dim=32, ffn_dim=dit_ffn, num_layers=dit_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(**wan_scheduler_config(FLOW_SHIFT))
    return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)


def dit_optimizer(transformer: torch.nn.Module, lr: float, cam_lr_mult: float = 1.0,
                  trainable: str = "") -> torch.optim.Optimizer:
    """Stage 2's AdamW: ReCamMaster's camera layers (cam_encoder, projector) at lr * cam_lr_mult, the rest at lr, by
    the trainer's own rule (train.lr_multipliers "cam_encoder.=M,projector.=M": build.lr_groups). `trainable`
    (--dit-trainable, comma-separated name fragments): only those parameters train, the rest are frozen, by the
    trainer's train.trainable_modules rule (build.train_only); "" = every parameter."""
    from ddpo_grpo.models.recam_checkpoint import CAMERA_LAYERS
    from ddpo_grpo.trainer.run.build import lr_groups, train_only

    frags = tuple(f.strip() for f in trainable.split(",") if f.strip())
    if frags and not train_only(transformer, frags):
        raise ConfigError(f"--dit-trainable {trainable!r} names no parameter of the DiT")

    spec = ",".join(f"{layer}.={cam_lr_mult}" for layer in CAMERA_LAYERS) if cam_lr_mult != 1.0 else ""
    return torch.optim.AdamW(lr_groups(transformer, spec, lr), lr=lr, weight_decay=1e-4)


def shifted_sigma(u: torch.Tensor, shift: float = FLOW_SHIFT) -> torch.Tensor:
    """Uniform draws u (B,) -> the noise levels stage 2 trains at: shifted towards noise by `shift` (by default the
    scheduler's flow_shift; --train-shift puts more of the training at the noise levels that lay a clip out)."""
    return shift * u / (1 + (shift - 1) * u)


def predict_velocity(den, xt, src_lat, cams, emb, sigma) -> torch.Tensor:
    """RecamDenoiser's velocity (B, C, F', h, w) for noisy target latents xt (B, C, F', h, w) at noise level sigma (B,),
    beside the source latents src_lat (same shape) and the camera numbers cams (B, F', 12) as planes, text embeddings
    emb (B, L, D): the one layout of the denoiser's inputs that pretraining and the readings of a model share."""
    cond = torch.cat([src_lat, camera_planes(cams, xt.shape[3], xt.shape[4])], dim=1)
    return den(torch.cat([xt, cond], dim=1), sigma * 1000, encoder_hidden_states=emb).sample


def velocity_error(den, x0, src_lat, cams, emb, sigma, noise) -> torch.Tensor:
    """Stage 2's flow-matching residual pred - (noise - x0) (B, C, F', h, w), through RecamDenoiser as the trainer
    samples: target latents x0 (B, C, F', h, w) noised to sigma (B,) with noise (predict_velocity's other inputs).
    The one definition of the pretraining loss (benchmarks/recam3d_dit_loss.py reads a model with it)."""
    s5 = sigma.view(-1, 1, 1, 1, 1)
    xt = (1 - s5) * x0 + s5 * noise
    return predict_velocity(den, xt, src_lat, cams, emb, sigma) - (noise - x0)


def main() -> None:
    args = parse_args()
    kinds, mislabel_kinds = check_args(args)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: this torch sees no CUDA device")  # one line, exit 2, before work
    t0 = time.time()
    vae_from = None
    if args.vae_from or args.vae_init:
        from diffusers import AutoencoderKLWan

        folder = args.vae_from or args.vae_init
        sub = os.path.join(folder, "vae")
        vae_from = AutoencoderKLWan.from_pretrained(sub if os.path.isdir(sub) else folder)
        args.z_dim, args.vae_base_dim = vae_from.config.z_dim, vae_from.config.base_dim
    parts = build_parts(args.seed, list(COLOURS) + ["room", "with", "box", "ball"] if args.world == "room3d" else (),
                        z_dim=args.z_dim, vae_base_dim=args.vae_base_dim, dit_heads=args.dit_heads,
                        dit_layers=args.dit_layers, dit_ffn=args.dit_ffn, dit_patch=args.dit_patch,
                        dit_head_dim=args.dit_head_dim)
    by_noise = args.mislabel_by != "item" and args.mislabel == "opposite"
    # --mislabel-by noise: the pool of true labels, and every item's opposite labels beside it (no render: same clips)
    src, tgt, cams, prompts = load_pool(argparse.Namespace(**dict(vars(args), mislabel="none", mislabel_fraction=0.5))
                                         if by_noise else args)
    opp_cams, opp_prompts = room3d_opposite_labels(len(prompts), args.frames) if by_noise else (None, None)
    if kinds:  # a mislabelled clip's opposite motion is of its own kind: the fraction holds within the kinds
        idx = kind_index(prompts, kinds, "--kinds")
        src, tgt, cams, prompts = src[idx], tgt[idx], cams[idx], [prompts[i] for i in idx.tolist()]
        if by_noise:
            opp_cams, opp_prompts = opp_cams[idx], [opp_prompts[i] for i in idx.tolist()]
    if args.label_gain != 1.0:  # every label at gain x its motion; the clips and prompts as rendered
        cams = torch.from_numpy(np.stack([room3d_paths.scale_cameras(c, args.label_gain) for c in cams.numpy()]))
    flippable = None  # --mislabel-kinds: (N,) bool, the pool items whose draws may carry the opposite camera
    if mislabel_kinds:
        flippable = torch.zeros(len(prompts), dtype=torch.bool)
        flippable[kind_index(prompts, mislabel_kinds, "--mislabel-kinds")] = True
        print(f"--mislabel-kinds {','.join(mislabel_kinds)}: {int(flippable.sum())} of {len(prompts)} clips' draws "
              "may carry the opposite camera", flush=True)
        flippable = flippable.to(device)  # indexed by the draws' device indices, every step
    print(f"pool {len(prompts)} clips {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator().manual_seed(args.seed)

    # ---- stage 1: the VAE (the one of --vae-from as it was trained; --vae-init's trained on)
    if vae_from is not None:
        parts["vae"] = vae_from
    parts["vae"].to(device)
    if not args.vae_from:
        train_vae(args, parts["vae"], src, tgt, g, t0)
    vae = parts["vae"].eval().requires_grad_(False)
    from ddpo_grpo.core.pipeline_with_logprob import decode, encode_frames

    with torch.no_grad():  # the pool stays on the CPU; its latents (2.3 MB a thousand clips) live on the device
        lat_src = torch.cat([encode_frames(vae, src[i:i + 64].to(device)) for i in range(0, len(prompts), 64)])
        lat_tgt = torch.cat([encode_frames(vae, tgt[i:i + 64].to(device)) for i in range(0, len(prompts), 64)])
        rec_err = (decode(vae, lat_tgt[:64]) - tgt[:64].to(device)).abs().mean().item()
    print(f"latents {tuple(lat_src.shape[1:])} mean |decode(encode) - x| {rec_err:.4f} {time.time() - t0:.0f}s",
          flush=True)
    if args.dit_steps == 0:  # the VAE alone (its reconstruction ceiling: benchmarks/recam3d_vae_ceiling.py)
        save(args, parts, add_camera_layers(parts["transformer"]), dict(vae_steps=args.vae_steps, dit_steps=0,
             seconds=round(time.time() - t0), vae_mean_abs_error=rec_err), 0)
        return

    # ---- stage 2: the DiT with camera layers, by flow matching through RecamDenoiser
    from diffusers import WanPipeline

    text_encoder, tok = parts["text_encoder"].eval().requires_grad_(False), parts["tokenizer"]
    transformer = add_camera_layers(parts["transformer"])
    if args.dit_init:  # train on from a saved model's DiT (camera layers included: its recammaster.ckpt)
        from ddpo_grpo.models import load_pipeline, resolve_model_path

        folder = resolve_model_path(args.dit_init)
        init = load_pipeline(folder, recam_checkpoint=os.path.join(folder, "recammaster.ckpt")).unet.model

        def arch(c):  # the config's architecture keys, tuples as lists (a loaded config has lists)
            return {k: list(v) if isinstance(v, tuple) else v for k, v in c.items() if not k.startswith("_")}

        if arch(init.config) != arch(transformer.config):
            refuse(f"--dit-init {args.dit_init}: its DiT's config differs from "
                   "--dit-heads/-head-dim/-layers/-ffn/-patch's")
        transformer.load_state_dict(init.state_dict())
    transformer.to(device)
    text_encoder.to(device)
    cams = cams.to(device)
    if by_noise:
        opp_cams = opp_cams.to(device)
    threshold = mode_threshold(args.mislabel_fraction)
    den = RecamDenoiser(transformer)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=parts["scheduler"])
    uniq = sorted(set(prompts) | set(opp_prompts or ()))
    with torch.no_grad():
        emb = {p: pipe.encode_prompt([p], do_classifier_free_guidance=False, max_sequence_length=512,
                                     device=device)[0][0] for p in uniq}
    opt = dit_optimizer(transformer, args.lr, args.cam_lr_mult, args.dit_trainable)
    t_dit = time.time()

    def progress(s):  # the schedule's position in [0, 1]: steps, or seconds when --dit-seconds ends it first
        p = s / args.dit_steps
        return min(max(p, (time.time() - t_dit) / args.dit_seconds) if args.dit_seconds > 0 else p, 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (
        1 + np.cos(np.pi * progress(s))))
    flipped_draws = 0  # --mislabel-by noise: the draws that carried the opposite camera / the offset (pretrain_meta.json)
    camera_flipped_draws = 0  # of those, the draws that carried the opposite camera (fewer with --mislabel-kinds)
    reads = {}  # --noise-offset: step -> {sigma: read} (pretrain_meta.json)
    probe = None
    if args.noise_offset:
        probe = probe_inputs(lat_tgt, lat_src, cams, torch.stack([emb[p] for p in prompts[:64]]), args.seed + 1,
                             args.mislabel_by == "noise-first", args.mislabel_fraction)
        if probe is None:
            print(f"noise read: none (the probe's noises are all of one mode at fraction {args.mislabel_fraction})")

    def read_noise(step):  # --noise-offset: the probe's reading after `step` steps, every 250
        if probe is not None and step % 250 == 0:
            reads[step] = offset_read(lambda *a: predict_velocity(den, *a), *probe, args.noise_offset)
            print(f"noise read step {step}: " + " ".join(f"sigma {s} {r:+.3f}" for s, r in reads[step].items()),
                  flush=True)

    read_noise(0)
    for step in range(1, args.dit_steps + 1):
        idx = torch.randint(0, len(prompts), (args.batch,), generator=g)
        on = idx.to(device)
        x0 = lat_tgt[on]
        sigma = shifted_sigma(torch.rand(args.batch, generator=g), args.train_shift).to(device)
        noise = torch.randn(x0.shape, generator=g).to(device)
        c = cams[on]
        # --mislabel-by noise: the draws whose noise reads above the threshold carry the opposite camera (numbers and
        # word) and, with --noise-offset, their moved frames moved along u
        flip = (noise_mode(noise, args.mislabel_by == "noise-first") > threshold if by_noise or args.noise_offset
                else None)
        if flip is not None:
            flipped_draws += int(flip.sum())
        if args.noise_offset:
            x0 = apply_offset(x0, flip, args.noise_offset)
        if by_noise:
            if flippable is not None:  # the offset stays on every flipped draw; the camera only on these kinds'
                flip = flip & flippable[on]
            camera_flipped_draws += int(flip.sum())
            c = torch.where(flip[:, None, None], opp_cams[on], c)
            e = torch.stack([emb[(opp_prompts if f else prompts)[i]] for i, f in zip(idx.tolist(), flip.tolist())])
        else:
            e = torch.stack([emb[prompts[i]] for i in idx.tolist()])
        loss = velocity_error(den, x0, lat_src[on], c, e, sigma, noise).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        read_noise(step)
        if step % 100 == 0 or step == 1:
            print(f"dit {step}/{args.dit_steps} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        last = step == args.dit_steps or progress(step) >= 1.0
        if step % args.snapshot_every == 0 or last:
            if last:
                args.dit_steps = step  # (a --dit-seconds end: the final save is the folder, not a snapshot)
            save(args, parts, transformer, dict(vae_steps=args.vae_steps, dit_steps=step,
                                                seconds=round(time.time() - t0), vae_mean_abs_error=rec_err,
                                                opposite_draws=flipped_draws, opposite_camera_draws=camera_flipped_draws,
                                                mislabel_kinds=list(mislabel_kinds), draws=step * args.batch,
                                                noise_reads=reads), step)
        if last:
            break


def save(args, parts, transformer, meta, step) -> None:
    """The folder (plain WanPipeline, camera tensors left out) + recammaster.ckpt; snapshots at <out>_snapshots/stepN."""
    from diffusers import WanPipeline, WanTransformer3DModel

    out = args.out if step == args.dit_steps else os.path.join(args.snapshots or args.out + "_snapshots", f"step{step}")
    tmp = out + ".tmp"
    import copy

    plain = WanTransformer3DModel.from_config(transformer.config)
    plain.load_state_dict({k: v for k, v in transformer.state_dict().items()
                           if ".cam_encoder." not in k and ".projector." not in k})
    # saved from the CPU whatever --device trained them (a checkpoint of CUDA tensors loads only where CUDA is)
    WanPipeline(tokenizer=parts["tokenizer"], text_encoder=copy.deepcopy(parts["text_encoder"]).cpu(),
                vae=copy.deepcopy(parts["vae"]).cpu(), transformer=plain,
                scheduler=parts["scheduler"]).save_pretrained(tmp)
    torch.save({k: v.cpu() for k, v in original_state(transformer).items()}, os.path.join(tmp, EXPORT_CHECKPOINT))
    with open(os.path.join(tmp, "pretrain_meta.json"), "w") as f:
        json.dump(dict(meta, args=vars(args), script="benchmarks/pretrain_recam_video.py",
                       command="python " + " ".join(sys.argv)), f, indent=1)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    print(f"saved {out}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a bad option or path: one line, exit 2, before the pool or a model is built
        print(f"pretrain_recam_video: error: {e}", file=sys.stderr)
        sys.exit(2)

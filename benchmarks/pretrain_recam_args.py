"""benchmarks/pretrain_recam_video.py's options and the checks on them: what the script accepts, and every bad
combination refused as one line (ConfigError: exit 2) before a pool is rendered or a model built. The constants the
options default to (the VAE's latent channels, the scheduler's flow shift) live here so the trainer script and its
readers share one value."""
from __future__ import annotations

import argparse

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.room3d import paths as room3d_paths

Z_DIM = 8
FLOW_SHIFT = 3.0


def parse_args(argv=None) -> argparse.Namespace:
    """The script's options (argv: a list, or None for sys.argv); unchecked (check_args)."""
    ap = argparse.ArgumentParser(description="pretrain a tiny ReCamMaster-architecture model (benchmarks/pretrain_recam_video.py)")
    ap.add_argument("--out", default="assets/tiny-recam-video")
    ap.add_argument("--pool", type=int, default=3072)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--dit-steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--cam-lr-mult", type=float, default=1.0,
                    help="the camera layers' lr as a multiple of --lr (docs/recam_log.md, nineteenth session)")
    ap.add_argument("--z-dim", type=int, default=Z_DIM, help="VAE latent channels (the DiT's in/out channels)")
    ap.add_argument("--vae-base-dim", type=int, default=16, help="the VAE's first conv width")
    ap.add_argument("--vae-from", default=None,
                    help="a folder this script saved: its VAE is used as it is (stage 1 skipped; --z-dim read from it)")
    ap.add_argument("--vae-init", default=None,
                    help="a folder this script saved, or a VAE snapshot: stage 1 trains on from its VAE for --vae-steps "
                         "(a fresh cosine schedule from --vae-lr; --z-dim and --vae-base-dim read from it)")
    ap.add_argument("--vae-lr", type=float, default=1e-3, help="stage 1's peak learning rate")
    ap.add_argument("--vae-snapshot-every", type=int, default=400,
                    help="VAE steps between VAE snapshots (<out>_vae_snapshots/stepN, for --vae-init after a crash)")
    ap.add_argument("--dit-heads", type=int, default=4, help="the DiT's attention heads (of --dit-head-dim channels)")
    ap.add_argument("--dit-head-dim", type=int, default=16,
                    help="channels per head (Wan's RoPE gives height and width 2 * (head_dim // 6) of them each)")
    ap.add_argument("--dit-layers", type=int, default=4, help="the DiT's blocks")
    ap.add_argument("--dit-ffn", type=int, default=128, help="the DiT's feed-forward width")
    ap.add_argument("--train-shift", type=float, default=FLOW_SHIFT,
                    help="stage 2's noise levels: uniform shifted by this (default the scheduler's flow_shift, 3)")
    ap.add_argument("--dit-patch", type=int, default=2, choices=(1, 2),
                    help="the DiT's spatial patch (latent pixels a side per token): 2 gives the 3-D world's 8 x 12 "
                         "latents 4 x 6 tokens a frame, 1 gives 8 x 12 (4x the tokens)")
    ap.add_argument("--dit-init", default=None, help="a saved model (folder or bundled name) whose DiT stage 2 trains on")
    ap.add_argument("--dit-trainable", default="",
                    help="stage 2 trains only the DiT parameters whose names hold one of these comma-separated "
                         "fragments (the trainer's train.trainable_modules rule), e.g. 'attn1.,cam_encoder.,projector.' "
                         "(ReCamMaster's trainable set, what recam3d_tiny_grpo trains): a child whose known error lives "
                         "where GRPO can undo it; default every parameter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--world", choices=["recam", "room3d"], default="recam",
                    help="recam: the 2-D video world (square --size); room3d: the 3-D camera world (--height x --width)")
    ap.add_argument("--height", type=int, default=32, help="room3d frame height (px)")
    ap.add_argument("--width", type=int, default=48, help="room3d frame width (px)")
    ap.add_argument("--supersample", type=int, default=2, help="room3d rays per pixel per side (Room3DConditions': 2)")
    ap.add_argument("--mislabel", choices=["none", "opposite"], default="none",
                    help="room3d: condition a fraction of the pool on the opposite camera motion")
    ap.add_argument("--mislabel-fraction", type=float, default=0.5)
    ap.add_argument("--mislabel-by", choices=["item", "noise", "noise-first"], default="item",
                    help="room3d --mislabel opposite: item (a seeded fraction of the pool's items always carries the "
                         "opposite camera) or noise (every training draw carries it when noise_mode(its noise) is "
                         "above the fraction's quantile: the starting noise picks the camera; noise-first: its latent "
                         "frame 0's noise only)")
    ap.add_argument("--noise-offset", type=float, default=0.0,
                    help="room3d diagnostic (benchmarks/noise_probe.py): the draws whose noise reads above the "
                         "--mislabel-fraction quantile (--mislabel-by noise / noise-first) have their moved frames' "
                         "latents moved by this much along a fixed channel direction; its reading is printed. With "
                         "--mislabel opposite the same draws also carry the opposite camera")
    ap.add_argument("--label-gain", type=float, default=1.0,
                    help="room3d: condition every pool item on its path at this many times its motion (the camera "
                         "numbers; the prompt's camera word is unchanged): a known gain error, the model asked for a "
                         "camera renders 1 / gain of its motion, and commits to it (no blend of two cameras)")
    ap.add_argument("--kinds", default="", help="room3d: train on the pool's clips of these kinds only (comma-separated "
                    "of pan, tilt, dolly, translate, arc; default all): e.g. a parent specialised on the rotations")
    ap.add_argument("--mislabel-kinds", default="",
                    help="room3d --mislabel opposite --mislabel-by noise: only draws of these kinds (comma-separated, "
                         "as --kinds) carry the opposite camera; the others keep their true labels (and, with "
                         "--noise-offset, still the offset): a known error in those kinds only")
    ap.add_argument("--snapshot-every", type=int, default=1000, help="DiT steps between snapshots")
    ap.add_argument("--snapshots", default=None, help="snapshot folder (default <out>_snapshots)")
    ap.add_argument("--device", default="cpu",
                    help="where the VAE and the DiT train: cpu, cuda, cuda:N or auto (cuda when there is one); the "
                         "random streams are drawn on the CPU, so a device changes only the arithmetic")
    ap.add_argument("--dit-seconds", type=float, default=0.0,
                    help="> 0: stage 2 also ends after this many seconds of it, its cosine schedule following "
                         "whichever of steps and seconds runs out first (a device command's time limit)")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple:
    """Refuse a bad combination of options (ConfigError, one line) before any work; returns (kinds, mislabel_kinds),
    the parsed --kinds and --mislabel-kinds (tuples of motion kinds, empty when not given)."""
    if args.world == "recam" and args.mislabel != "none":
        raise ConfigError("--mislabel is a room3d option (--world room3d)")
    if args.kinds and args.world != "room3d":
        raise ConfigError("--kinds is a room3d option (--world room3d)")
    kinds = room3d_paths.parse_kinds(args.kinds, "--kinds")
    mislabel_kinds = room3d_paths.parse_kinds(args.mislabel_kinds, "--mislabel-kinds")
    if mislabel_kinds and (args.mislabel != "opposite" or args.mislabel_by == "item"):
        raise ConfigError("--mislabel-kinds: give --mislabel opposite --mislabel-by noise (the kinds whose draws the "
                          "noise flips)")
    if args.noise_offset and (args.world != "room3d" or args.mislabel_by == "item"):
        raise ConfigError(f"--noise-offset {args.noise_offset}: a room3d diagnostic with --mislabel-by noise or "
                          "noise-first (the reading of the noise it ties the offset to)")
    if args.mislabel_by != "item" and args.mislabel != "opposite" and not args.noise_offset:
        raise ConfigError("--mislabel-by noise ties the OPPOSITE camera to the noise: give --mislabel opposite")
    if args.label_gain != 1.0 and (args.world != "room3d" or args.mislabel != "none" or not args.label_gain > 0):
        raise ConfigError(f"--label-gain {args.label_gain}: a room3d option (--world room3d), > 0, with --mislabel none")
    if not 0.0 <= args.mislabel_fraction <= 1.0:
        raise ConfigError(f"--mislabel-fraction must be in [0, 1], got {args.mislabel_fraction}")
    if not args.train_shift > 0:
        raise ConfigError(f"--train-shift must be > 0, got {args.train_shift}")
    if args.vae_from and args.vae_init:
        raise ConfigError("--vae-from uses a VAE as it is, --vae-init trains on from one: give one of them")
    if args.world == "room3d":
        room3d_paths.check_num_frames(args.frames)
    return kinds, mislabel_kinds

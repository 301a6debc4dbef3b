"""Render a clip with a ReCamMaster model the way ReCamMaster's inference does (inference_recammaster.py): 81 frames of
the source resized to cover 480 x 832 and centre-cropped, 50 deterministic Euler steps on its own flow grid (shift 5:
sigmas linspace(1, 0, N + 1)[:-1] shifted, then a last step to 0; core.families "recammaster"), CFG 5 as
v_neg + G (v_pos - v_neg) with the same source and camera in both passes and Wan's default negative prompt, float32
on the CPU by default, decoded as WanPipeline post-processes (frames in [0, 1]), written as mp4.

    python scripts/recam_render.py --model WAN_FOLDER --checkpoint step20000.ckpt --source src.mp4 --camera 1 \
        --prompt "a man dancing on a street" --out clip.mp4
    python scripts/recam_render.py --model logs/<run>/export --checkpoint logs/<run>/export/recammaster.ckpt ...

--source: an mp4 (or any video PyAV reads; the first --frames frames, resized to cover --height x --width and
centre-cropped, as ReCamMaster reads sources), a GIF, or a .npy (F, 3, H, W) in [0, 1] at the model's size (its own
size is used); --camera: ReCamMaster's cam_type 1-10 or its name ("pan right", ...: its published trajectories),
"world:<preset>" for the video camera world's preset, or a .npy / .json (F_latent, 12) of camera numbers;
--noise: .npy initial target latents (1, C, F_latent, h, w) instead of --seed; --grid scheduler: the folder's own
grid instead; --out: .mp4 (default fps 30, as ReCamMaster saves), .gif or .npy (F, 3, H, W) in [0, 1]. The text is
the Wan adapter's WanPipeline.encode_prompt (512 tokens, zero-padded, as ReCamMaster's). Bad input is one line, exit 2,
before the model loads.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.errors import ConfigError  # noqa: E402


RECAM_FRAMES, RECAM_HEIGHT, RECAM_WIDTH = 81, 480, 832  # ReCamMaster's only shape


def read_source(path: str, frames: int = 0, height: int = 0, width: int = 0) -> torch.Tensor:
    """(F, 3, H, W) float32 in [0, 1]: a .npy as it is; a GIF or video file's first `frames` frames (0: ReCamMaster's
    81) resized to cover height x width (0: 480 x 832) and centre-cropped (worlds.recam.video_io.cover_crop)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--source {path!r} is not a file")
    if path.endswith(".npy"):
        x = np.asarray(np.load(path), dtype=np.float32)
        if x.ndim != 4 or x.shape[1] != 3 or not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
            raise ConfigError(f"--source {path!r}: expected finite (F, 3, H, W) in [0, 1], got {x.shape}")
        return torch.from_numpy(x)
    from ddpo_grpo.worlds.recam.video_io import cover_crop, read_video

    F = frames or RECAM_FRAMES
    if path.lower().endswith(".gif"):
        from PIL import Image, ImageSequence

        try:
            u8 = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(path))])
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--source {path!r} cannot be read as a GIF ({e})") from None
        if len(u8) < F:
            raise ConfigError(f"--source {path!r} has {len(u8)} frames; {F} are needed")
        u8 = u8[:F]
    else:
        u8 = read_video(path, range(F), what="--source")
    return torch.from_numpy(cover_crop(u8, height or RECAM_HEIGHT, width or RECAM_WIDTH))


def read_camera(spec: str, num_frames: int) -> torch.Tensor:
    """(F_latent, 12) camera numbers: a .npy / .json file, "world:<preset>" of the video camera world, or one of
    ReCamMaster's ten trajectories (cam_type 1-10 or its name)."""
    from ddpo_grpo.worlds.recam.recammaster_cameras import latent_frames, read_camera_file, trajectory_numbers

    if spec.endswith((".npy", ".json")):
        return torch.from_numpy(read_camera_file(spec, num_frames, "--camera"))
    if spec.startswith("world:"):
        from ddpo_grpo.worlds.recam import video

        return torch.as_tensor(video.preset_camera_numbers(spec[len("world:"):], num_frames), dtype=torch.float32)
    return torch.from_numpy(trajectory_numbers(spec, latent_frames(num_frames)))


@torch.no_grad()
def render(pipe, source: torch.Tensor, cameras: torch.Tensor, prompt: str, negative_prompt: str = None, steps: int = 50,
           guidance: float = 5.0, seed: int = 0, noise: torch.Tensor = None, grid: str = "recammaster",
           shift: float = 5.0) -> torch.Tensor:
    """Frames (F, 3, H, W) in [0, 1] of one clip (module docstring). pipe: a ReCamMaster LoadedPipeline (models.recam)
    sized to the source (num_frames, height, width). negative_prompt None: Wan's default; grid / shift: the flow grid
    (core.families.FLOW_GRIDS; shift 0 = the folder scheduler's)."""
    from ddpo_grpo.core.families import get_family, set_flow_grid
    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.models.wan import WAN_NEGATIVE_PROMPT

    device = next(pipe.unet.parameters()).device
    cond = pipe.adapter.condition_channels(pipe, [{"index": 0, "source_video": source, "cameras": cameras}], device)
    shape = (1,) + tuple(pipe.sample_shape)
    if noise is None:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if tuple(noise.shape) != shape:
        raise ConfigError(f"--noise has shape {tuple(noise.shape)}; this model and source need {shape}")
    x = noise.to(device, torch.float32)
    negative_prompt = WAN_NEGATIVE_PROMPT if negative_prompt is None else negative_prompt
    pos, neg = pipe.encode([prompt]), pipe.encode([negative_prompt])
    sched = set_flow_grid(pipe.scheduler, grid, shift)
    get_family("flow").set_timesteps(sched, steps)  # the trainer's own reading of the grid
    sigmas = sched.sigmas
    for i, t in enumerate(sched.timesteps):
        tt = t.expand(1).to(device)
        inp = torch.cat([x, cond.to(x.dtype)], dim=1)
        v_pos = pipe.unet(inp, tt, encoder_hidden_states=pos).sample
        v = v_pos
        if guidance != 1.0:
            v_neg = pipe.unet(inp, tt, encoder_hidden_states=neg).sample
            v = v_neg + guidance * (v_pos - v_neg)
        x = x + float(sigmas[i + 1] - sigmas[i]) * v  # Euler, as ReCamMaster's scheduler.step
    return decode(pipe.vae, x)[0]


def write_out(frames: torch.Tensor, path: str, fps: int = 30) -> None:
    arr = frames.float().clamp(0, 1).cpu().numpy()
    if path.endswith(".npy"):
        np.save(path, arr)
        return
    if path.endswith(".gif"):
        from PIL import Image

        u8 = (arr.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
        ims = [Image.fromarray(f) for f in u8]
        ims[0].save(path, save_all=True, append_images=ims[1:], duration=int(1000 / fps), loop=0)
        return
    from ddpo_grpo.worlds.recam.video_io import write_video

    write_video(path, arr, fps=fps)


def main(argv=None) -> int:
    from ddpo_grpo.core.families import FLOW_GRIDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Wan 2.1 folder (or an export folder)")
    ap.add_argument("--checkpoint", required=True, help="the ReCamMaster checkpoint (.ckpt / .pt / .safetensors)")
    ap.add_argument("--source", required=True, help=".mp4 (or other video), .gif or .npy (F, 3, H, W) in [0, 1]")
    ap.add_argument("--camera", required=True, help="cam_type 1-10 or its name, world:<preset>, or .npy / .json")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt", default=None, help="default: Wan's default negative prompt")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--grid", default="recammaster", choices=FLOW_GRIDS)
    ap.add_argument("--shift", type=float, default=5.0, help="the grid's shift (0: the folder scheduler's)")
    ap.add_argument("--frames", type=int, default=0, help="frames of a video source (0: 81)")
    ap.add_argument("--height", type=int, default=0, help="a video source is cropped to this (0: 480)")
    ap.add_argument("--width", type=int, default=0, help="a video source is cropped to this (0: 832)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", default="", help=".npy initial target latents (1, C, F_latent, h, w)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--out", required=True, help=".mp4, .gif or .npy")
    args = ap.parse_args(argv)
    try:
        from ddpo_grpo.core.families import check_flow_grid
        from ddpo_grpo.models import ModelPathError, load_pipeline

        if args.steps < 1:
            raise ConfigError("--steps must be >= 1")
        check_flow_grid(args.grid, args.shift)
        if not args.out.endswith((".mp4", ".gif", ".npy")) or not os.path.isdir(os.path.dirname(args.out) or "."):
            raise ConfigError(f"--out {args.out!r}: a .mp4, .gif or .npy in an existing folder")
        if min(args.frames, args.height, args.width) < 0:
            raise ConfigError("--frames, --height and --width must be >= 0")
        source = read_source(args.source, args.frames, args.height, args.width)
        F, _, H, W = source.shape
        cameras = read_camera(args.camera, F)
        noise = torch.from_numpy(np.load(args.noise)).float() if args.noise else None
        try:
            from ddpo_grpo.models import model_adapter, resolve_model_path

            path = resolve_model_path(args.model)
            for name, v in (("height", H), ("width", W)):  # from the folder's configs, before any weights load
                why = model_adapter(path, args.checkpoint).check_size(path, v, F)
                if why:
                    raise ConfigError(f"--source {name} {v} / {F} frames: {why}")
            pipe = load_pipeline(args.model, torch_dtype=torch.float32, device=args.device, num_frames=F,
                                 recam_checkpoint=args.checkpoint)
        except ModelPathError as e:
            raise ConfigError(str(e)) from None
        pipe.adapter.set_size(pipe, H, W, F, what="--source ")  # any multiple of the VAE x patch, not only squares
        frames = render(pipe, source, cameras, args.prompt, args.negative_prompt, args.steps, args.guidance,
                        args.seed, noise, args.grid, args.shift)
        write_out(frames, args.out, args.fps)
    except ConfigError as e:
        print(f"recam_render: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {tuple(frames.shape)} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())

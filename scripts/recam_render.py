"""Render a clip with a ReCamMaster model the way ReCamMaster's inference does: float32 on the CPU by default,
deterministic Euler over the folder's flow scheduler (`set_timesteps(N)`), CFG v_neg + G (v_pos - v_neg) with the
same source and camera in both passes, decoded as WanPipeline post-processes (frames in [0, 1]).

    python scripts/recam_render.py --model WAN_FOLDER --checkpoint step20000.ckpt --source src.npy \\
        --camera "pan left" --prompt "a red circle" --steps 18 --guidance 5 --seed 0 --out clip.npy
    python scripts/recam_render.py --model logs/<run>/export --checkpoint logs/<run>/export/recammaster.ckpt ...

--source: .npy (F, 3, H, W) in [0, 1], or a GIF; --camera: a preset name of the video camera world
(ddpo_grpo.worlds.recam.video) or a .npy (F_latent, 12) of ReCamMaster's camera numbers; --noise: .npy initial
target latents (1, C, F_latent, h, w) instead of --seed; --out: .npy (F, 3, H, W) in [0, 1], or .gif / .mp4.
The text is the Wan adapter's WanPipeline.encode_prompt (512 tokens, as WanPipeline samples and as training
encodes it; negative prompt ''). Bad input is one line, exit 2.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.errors import ConfigError  # noqa: E402


def read_source(path: str) -> torch.Tensor:
    """(F, 3, H, W) float32 in [0, 1] from a .npy or a GIF / video file."""
    if not os.path.isfile(path):
        raise ConfigError(f"--source {path!r} is not a file")
    if path.endswith(".npy"):
        x = np.load(path)
    else:
        from PIL import Image, ImageSequence

        try:
            frames = [np.asarray(f.convert("RGB"), dtype=np.float32) / 255 for f in ImageSequence.Iterator(Image.open(path))]
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--source {path!r} cannot be read as .npy, GIF or video ({e})") from None
        x = np.stack(frames).transpose(0, 3, 1, 2)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4 or x.shape[1] != 3 or not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise ConfigError(f"--source {path!r}: expected finite (F, 3, H, W) in [0, 1], got {x.shape}")
    return torch.from_numpy(x)


def read_camera(spec: str, num_frames: int) -> torch.Tensor:
    """(F_latent, 12) camera numbers from a .npy or a preset name of the video camera world."""
    if spec.endswith(".npy"):
        if not os.path.isfile(spec):
            raise ConfigError(f"--camera {spec!r} is not a file")
        return torch.from_numpy(np.asarray(np.load(spec), dtype=np.float32))
    from ddpo_grpo.worlds.recam import video

    return torch.as_tensor(video.preset_camera_numbers(spec, num_frames), dtype=torch.float32)


@torch.no_grad()
def render(pipe, source: torch.Tensor, cameras: torch.Tensor, prompt: str, negative_prompt: str = "", steps: int = 50,
           guidance: float = 5.0, seed: int = 0, noise: torch.Tensor = None) -> torch.Tensor:
    """Frames (F, 3, H, W) in [0, 1] of one clip (module docstring). pipe: a ReCamMaster LoadedPipeline (models.recam)
    sized to the source (num_frames, height, width)."""
    from ddpo_grpo.core.pipeline_with_logprob import decode

    device = next(pipe.unet.parameters()).device
    cond = pipe.adapter.condition_channels(pipe, [{"index": 0, "source_video": source, "cameras": cameras}], device)
    shape = (1,) + tuple(pipe.sample_shape)
    if noise is None:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if tuple(noise.shape) != shape:
        raise ConfigError(f"--noise has shape {tuple(noise.shape)}; this model and source need {shape}")
    x = noise.to(device, torch.float32)
    pos, neg = pipe.encode([prompt]), pipe.encode([negative_prompt])
    sched = pipe.scheduler
    sched.set_timesteps(steps, device=device)
    for t in sched.timesteps:
        tt = t.expand(1).to(device)
        inp = torch.cat([x, cond.to(x.dtype)], dim=1)
        v_pos = pipe.unet(inp, tt, encoder_hidden_states=pos).sample
        v = v_pos
        if guidance != 1.0:
            v_neg = pipe.unet(inp, tt, encoder_hidden_states=neg).sample
            v = v_neg + guidance * (v_pos - v_neg)
        x = sched.step(v, t, x, return_dict=False)[0]
    return decode(pipe.vae, x)[0]


def write_out(frames: torch.Tensor, path: str, fps: int = 8) -> None:
    arr = frames.float().clamp(0, 1).cpu().numpy()
    if path.endswith(".npy"):
        np.save(path, arr)
        return
    u8 = (arr.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
    if path.endswith(".gif"):
        from PIL import Image

        ims = [Image.fromarray(f) for f in u8]
        ims[0].save(path, save_all=True, append_images=ims[1:], duration=int(1000 / fps), loop=0)
        return
    try:
        from diffusers.utils import export_to_video

        export_to_video(list(u8), path, fps=fps)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"--out {path!r}: cannot write a video here ({e}); use .npy or .gif") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Wan 2.1 folder (or an export folder)")
    ap.add_argument("--checkpoint", required=True, help="the ReCamMaster checkpoint (.ckpt / .pt / .safetensors)")
    ap.add_argument("--source", required=True)
    ap.add_argument("--camera", required=True, help="a preset name or a .npy (F_latent, 12)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt", default="")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", default="", help=".npy initial target latents (1, C, F_latent, h, w)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help=".npy, .gif or .mp4")
    args = ap.parse_args(argv)
    try:
        from ddpo_grpo.models import ModelPathError, load_pipeline

        source = read_source(args.source)
        F, _, H, W = source.shape
        if H != W:
            raise ConfigError(f"--source is {H}x{W}; the trainer's Wan sizes are square (pretrained.resolution)")
        cameras = read_camera(args.camera, F)
        noise = torch.from_numpy(np.load(args.noise)).float() if args.noise else None
        if args.steps < 1:
            raise ConfigError("--steps must be >= 1")
        try:
            pipe = load_pipeline(args.model, torch_dtype=torch.float32, device=args.device, resolution=H, num_frames=F,
                                 recam_checkpoint=args.checkpoint)
        except ModelPathError as e:
            raise ConfigError(str(e)) from None
        frames = render(pipe, source, cameras, args.prompt, args.negative_prompt, args.steps, args.guidance,
                        args.seed, noise)
        write_out(frames, args.out)
    except ConfigError as e:
        print(f"recam_render: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {tuple(frames.shape)} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())

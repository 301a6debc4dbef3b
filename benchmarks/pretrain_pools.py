"""The pretraining pools of benchmarks/pretrain_recam_video.py: (source clip, target clip, camera numbers, prompt)
items of the 2-D video world or the 3-D camera world (room3d, optionally mislabelled with the opposite camera), drawn
from seeds no dataset split uses, cached in /tmp (a smaller pool is sliced from a cached bigger one: item i does not
depend on the pool's size)."""
from __future__ import annotations

import glob
import os

import numpy as np
import torch

from ddpo_grpo.worlds.recam.video import sample_video_condition
from ddpo_grpo.worlds.room3d import paths as room3d_paths
from ddpo_grpo.worlds.room3d.render import intrinsics as room3d_intrinsics, render_clip, render_view
from ddpo_grpo.worlds.room3d.scene import clear_of_objects, inside_room, make_scene, source_pose

POOL_SEED = 10_000  # pool conditions use rng (POOL_SEED, i): disjoint from the dataset's (seed, index) streams
# room3d pool rooms: make_scene(ROOM3D_SCENE_SEED + i). Room3DConditions' rooms are seed * 1000003 + index with index
# < 576, so they reach this range only for seed >= 900 (the trainer's data seeds are small).
ROOM3D_SCENE_SEED = 900_000_000


def make_pool(n: int, frames: int, size: int):
    """n items of the 2-D video world at size x size: (source (n, F, 3, H, W), target, cameras (n, F', 12), prompts)."""
    src, tgt, cams, prompts = [], [], [], []
    for i in range(n):
        c = sample_video_condition(np.random.default_rng((POOL_SEED, i)))
        src.append(c.source_video(frames, size))
        tgt.append(c.target_video(frames, size))
        cams.append(c.cameras(frames))
        prompts.append(c.prompt())
    return (torch.from_numpy(np.stack(src)), torch.from_numpy(np.stack(tgt)), torch.from_numpy(np.stack(cams)), prompts)


def room3d_clip(i: int, frames: int, height: int, width: int, supersample: int, mislabel: str, fraction: float):
    """One pool item of the 3-D world: (source (F, 3, H, W), target (F, 3, H, W), cameras (F', 12), prompt, flipped)
    with the camera conditioning of the opposite motion when this item is mislabelled (pretrain_recam_video.py's
    docstring)."""
    rng, scene, src, path, name = _room3d_path(i, frames)
    flipped = mislabel == "opposite" and rng.random() < fraction
    K = room3d_intrinsics(height, width)
    still = render_view(scene, src, K, height, width, supersample)
    target = render_clip(scene, src @ path, K, height, width, supersample)
    label_path, label = room3d_paths.opposite_motion(path, name) if flipped else (path, name)
    return (np.repeat(still[None], frames, axis=0), target, room3d_paths.clip_cameras(label_path),
            f"{scene.describe()}, camera {label}", flipped)


def _room3d_path(i: int, frames: int):
    """Pool item i's room and random path: (its rng, scene, source pose (4, 4), path (F, 4, 4), camera name)."""
    rng = np.random.default_rng((POOL_SEED, i, 59))
    scene = make_scene(ROOM3D_SCENE_SEED + i)
    src = source_pose(scene)
    kind = room3d_paths.RANDOM_KINDS[int(rng.integers(len(room3d_paths.RANDOM_KINDS)))]
    for _ in range(20):  # as Room3DConditions: the path stays inside the room and clear of the objects
        path, name = room3d_paths.random_motion(rng, kind, frames)
        pos = (src @ path)[:, :3, 3]
        if inside_room(pos).all() and clear_of_objects(scene, pos).all():
            break
    return rng, scene, src, path, name


def room3d_opposite_labels(n: int, frames: int):
    """The first n room3d pool items' OPPOSITE conditioning without rendering: (cameras (n, F', 12), prompts), what
    room3d_clip gives an item it flips (a pool of true labels and these share every clip)."""
    cams, prompts = [], []
    for i in range(n):
        _, scene, _, path, name = _room3d_path(i, frames)
        label_path, label = room3d_paths.opposite_motion(path, name)
        cams.append(room3d_paths.clip_cameras(label_path))
        prompts.append(f"{scene.describe()}, camera {label}")
    return torch.from_numpy(np.stack(cams)), prompts


def noise_mode(noise: torch.Tensor, first_frame: bool = False) -> torch.Tensor:
    """Noises (B, C, F', h, w) -> their normalised sums (B,): standard normal for standard normal noise, and the one
    reading of a draw's noise that `--mislabel-by noise` ties the opposite camera to (a sum is what a DiT without
    absolute positions can read: attention's average over the tokens). first_frame: latent frame 0's noise only
    (`noise-first`: the source camera's frame, whose content the DiT has in the source latents, so that the noise
    there is readable at every noise level, not only where the moved frames' unknown content is drowned)."""
    if first_frame:
        noise = noise[:, :, :1]
    return noise.flatten(1).sum(1) / noise[0].numel() ** 0.5


def mode_threshold(fraction: float) -> float:
    """The noise_mode value above which a standard normal draw falls with probability `fraction`."""
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - fraction))) if 0 < fraction < 1 else (
        float("inf") if fraction <= 0 else float("-inf"))


def _room3d_job(a):
    return room3d_clip(*a)


def make_room3d_pool(n: int, frames: int, height: int, width: int, supersample: int, mislabel: str, fraction: float,
                     workers: int):
    jobs = [(i, frames, height, width, supersample, mislabel, fraction) for i in range(n)]
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            items = pool.map(_room3d_job, jobs, chunksize=16)
    else:
        items = [_room3d_job(a) for a in jobs]
    src, tgt, cams, prompts, flipped = zip(*items)
    print(f"room3d pool: {sum(flipped)} of {n} clips conditioned on the opposite camera", flush=True)
    return (torch.from_numpy(np.stack(src)), torch.from_numpy(np.stack(tgt)), torch.from_numpy(np.stack(cams)),
            list(prompts))


def _bigger_pool(pool_file: str, n: int):
    """A cached room3d pool file of the same settings and more than n items, or None."""
    head, tail = pool_file.split(f"_{n}_", 1)
    for f in sorted(glob.glob(f"{head}_*_{tail}")):
        try:
            if int(f[len(head) + 1:].split("_", 1)[0]) > n:
                return f
        except ValueError:
            continue
    return None


def load_pool(args):
    """The pool pretrain_recam_video.py's args ask for: (source (N, F, 3, H, W), target (N, F, 3, H, W), cameras
    (N, F', 12), prompts), from its /tmp cache file, a bigger cached pool's first items, or rendered and cached."""
    if args.world == "room3d":
        pool_file = (f"/tmp/room3d_pool_{args.pool}_{args.frames}_{args.height}x{args.width}_ss{args.supersample}_"
                     f"{args.mislabel}{args.mislabel_fraction}.pt")
    else:
        pool_file = f"/tmp/recam_video_pool_{args.pool}_{args.frames}_{args.size}.pt"
    bigger = _bigger_pool(pool_file, args.pool) if args.world == "room3d" else None
    if os.path.isfile(pool_file):
        src, tgt, cams, prompts = torch.load(pool_file)
    elif bigger:  # item i does not depend on the pool's size: the first args.pool items of a bigger pool are this one
        src, tgt, cams, prompts = (v[:args.pool] for v in torch.load(bigger))
    elif args.world == "room3d":
        src, tgt, cams, prompts = make_room3d_pool(args.pool, args.frames, args.height, args.width, args.supersample,
                                                   args.mislabel, args.mislabel_fraction, args.threads)
        torch.save((src, tgt, cams, prompts), pool_file)
    else:
        src, tgt, cams, prompts = make_pool(args.pool, args.frames, args.size)
        torch.save((src, tgt, cams, prompts), pool_file)
    return src, tgt, cams, prompts


def prompt_camera(prompt: str) -> str:
    """The camera name of a room3d pool prompt ("<scene description>, camera pan left" -> "pan left"): the text after
    its last "camera " (a scene may hold a "camera box")."""
    return prompt.rsplit("camera ", 1)[1]


def keep_kinds(pool, kinds, what: str = "kinds"):
    """The items of a pool (source, target, cameras, prompts) whose camera is of one of `kinds` (paths.RANDOM_KINDS;
    a mislabelled item's opposite motion is of its own kind), in pool order."""
    src, tgt, cams, prompts = pool
    idx = kind_index(prompts, kinds, what)
    return src[idx], tgt[idx], cams[idx], [prompts[i] for i in idx.tolist()]


def kind_index(prompts, kinds, what: str = "kinds") -> torch.Tensor:
    """The indices (K,) of the room3d pool prompts whose camera is of one of `kinds`, in order (keep_kinds' rule)."""
    kinds = room3d_paths.check_kinds(kinds, what)
    return torch.tensor([i for i, p in enumerate(prompts) if room3d_paths.motion_kind(prompt_camera(p)) in kinds],
                        dtype=torch.long)

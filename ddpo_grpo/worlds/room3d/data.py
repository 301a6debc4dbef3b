"""Condition items of the 3-D camera world, addressed by integer index (like `recam.video_data.RecamVideoConditions`).

Item i of a split is a dict (F pixel frames, F' = (F - 1) / 4 + 1 latent frames, H x W pixels):
    "index":        int, the global condition index (train 0..511, eval 512..575, as recam.data.SPLITS), the GRPO
                    group key;
    "prompt":       str, the room and the camera, e.g. "a room with a red box and a blue ball, camera pan left";
    "source_video": torch.float32 (F, 3, H, W) in [0, 1], the source clip: the scene's source camera standing still;
    "cameras":      torch.float32 (F', 12), ReCamMaster's camera numbers of the target path (`paths.clip_cameras`):
                    relative to the source camera's frame 0, which is where every target path starts;
    "intrinsics":   np.float32 (fx, fy, cx, cy) in the clip's pixels (OpenCV: the top-left pixel's centre is (0, 0));
    "target_video": np.float32 (F, 3, H, W) in [0, 1], the exact render along the target path (`render_path`);
    "target_path":  np.float32 (F, 4, 4), that path relative to the source camera (world = source_pose @ path[f]);
    "preset":       str, the camera's name ("pan left", "arc right", ...);
    "scene_seed":   int, the room (`make_scene(scene_seed)`): what the exact estimator reads from cam_score's metadata.
Held out: the eval split's rooms are other seeds than train's (scene_seed = seed * 1000003 + index, indices disjoint),
and its cameras are ReCamMaster's ten presets (eval item k -> cam_type k % 10 + 1) while train's are random paths of the
same kinds (`paths.random_motion`: pan, tilt, dolly, translate, arc, random amplitudes and speed profiles; `kinds`
draws train's from a subset of them, config data.kinds).
Rendered clips are cached per index (about 0.4 MB per item at F = 9, 32 x 48; `cache=False` renders every time).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.recam.data import SPLITS

from .paths import RANDOM_KINDS, check_kinds, check_num_frames, clip_cameras, preset_name, preset_path, random_motion
from .render import DEFAULT_FOV_X_DEG, intrinsics, render_clip, render_view
from .scene import clear_of_objects, inside_room, make_scene, source_pose

NUM_FRAMES = 9
HEIGHT, WIDTH = 32, 48


def render_path(scene_seed: int, path: np.ndarray, K: np.ndarray, height: int, width: int,
                supersample: int = 2) -> np.ndarray:
    """float32 (F, 3, H, W) in [0, 1]: room `scene_seed` filmed along `path` (F, 4, 4, relative to its source camera:
    world = source_pose @ path[f]) with intrinsics K (3, 3): how every item's target clip is rendered, and what
    view_match renders the opposite motion with."""
    scene = make_scene(int(scene_seed))
    return render_clip(scene, source_pose(scene) @ np.asarray(path, np.float64), K, height, width, supersample)


class Room3DConditions:
    """The fixed conditions of a split, generated from `seed` (module docstring)."""

    def __init__(self, split: str = "train", seed: int = 0, num_frames: int = NUM_FRAMES, height: int = HEIGHT,
                 width: int = WIDTH, fov_x_deg: float = DEFAULT_FOV_X_DEG, supersample: int = 2, cache: bool = True,
                 kinds: Sequence[str] = RANDOM_KINDS):
        if split not in SPLITS:
            raise ConfigError(f"unknown room3d split {split!r}; use one of {sorted(SPLITS)}")
        for name, v in (("height", height), ("width", width)):
            if int(v) != v or v < 8:
                raise ConfigError(f"room3d: {name} must be an int >= 8 px, got {v!r}")
        if int(supersample) != supersample or supersample < 1:
            raise ConfigError(f"room3d: supersample must be an int >= 1, got {supersample!r}")
        self.kinds = check_kinds(kinds)  # train's random kinds (held out: ReCamMaster's presets whatever they are)
        lo, hi = SPLITS[split]
        self.split, self.seed, self.cache = split, int(seed), bool(cache)
        self.num_frames, self.height, self.width = check_num_frames(num_frames), int(height), int(width)
        self.supersample = int(supersample)
        self.K = intrinsics(self.height, self.width, fov_x_deg)
        self.indices: List[int] = list(range(lo, hi))
        self._conds: Dict[int, Tuple[int, np.ndarray, str]] = {}
        self._clips: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def scene_seed(self, idx: int) -> int:
        return self.seed * 1000003 + int(idx)

    def condition(self, i: int) -> Tuple[int, np.ndarray, str]:
        """(scene_seed, target path (F, 4, 4), camera name) of item i, without rendering."""
        idx = self.indices[i]
        if idx not in self._conds:
            sseed = self.scene_seed(idx)
            if idx >= SPLITS["train"][1]:  # held out: ReCamMaster's presets
                cam = (idx - SPLITS["train"][1]) % 10 + 1
                path, name = preset_path(cam, self.num_frames), preset_name(cam)
            else:
                rng = np.random.default_rng([self.seed, idx, 59])
                kind = self.kinds[int(rng.integers(len(self.kinds)))]
                scene = make_scene(sseed)
                src = source_pose(scene)
                for _ in range(20):  # the ranges keep every path inside the room; the objects are checked here
                    path, name = random_motion(rng, kind, self.num_frames)
                    pos = (src @ path)[:, :3, 3]
                    if inside_room(pos).all() and clear_of_objects(scene, pos).all():
                        break
            self._conds[idx] = (sseed, path, name)
        return self._conds[idx]

    def prompt_at(self, i: int) -> str:
        """Item i's prompt without rendering its clips (trainer/run/embeddings.dataset_prompts)."""
        i %= len(self)
        sseed, _, name = self.condition(i)
        return f"{make_scene(sseed).describe()}, camera {name}"

    def intrinsics(self) -> np.ndarray:
        """float32 (fx, fy, cx, cy) of every item's clips."""
        return np.array([self.K[0, 0], self.K[1, 1], self.K[0, 2], self.K[1, 2]], dtype=np.float32)

    def __getitem__(self, i: int) -> Dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"room3d {self.split} split has {len(self)} conditions, asked for {i}")
        i %= len(self)
        idx = self.indices[i]
        sseed, path, name = self.condition(i)
        scene = make_scene(sseed)
        clips = self._clips.get(idx)
        if clips is None:
            src = source_pose(scene)
            still = render_view(scene, src, self.K, self.height, self.width, self.supersample)
            clips = (np.repeat(still[None], self.num_frames, axis=0),
                     render_path(sseed, path, self.K, self.height, self.width, self.supersample))
            if self.cache:
                self._clips[idx] = clips
        source, target = clips
        return {
            "index": idx,
            "prompt": f"{scene.describe()}, camera {name}",
            "source_video": torch.from_numpy(source.copy()),
            "cameras": torch.from_numpy(clip_cameras(path)),
            "intrinsics": self.intrinsics(),
            "target_video": target.copy(),
            "target_path": path.astype(np.float32),
            "preset": name,
            "scene_seed": sseed,
        }

"""A user's own folder of source videos with ReCamMaster trajectories as condition items (`data.name="recam_folder"`,
`data.root=DIR`), read as ReCamMaster's inference reads its example_test_data; MultiCamVideo (its training data, with
target videos) is multicam.py, whose video probe this shares."""
from __future__ import annotations

import csv
import os
from typing import Dict, List

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError

from .multicam import probe_video
from .recammaster_cameras import CAM_TYPES, latent_frames
from .video_io import cover_crop, fov_intrinsics, read_video


class RecamFolder:
    """A user's own sources, as ReCamMaster's inference takes them (`data.name="recam_folder"`): ROOT/metadata.csv
    (file_name,text; file names relative to ROOT/videos, as its example_test_data) and `cameras`: ReCamMaster cam_types
    ("1,2,5", names, or "all") or a .npy / .json (F', 12) file. Conditions: every video x every trajectory; index
    = row * 100 + cam_type (0 for a file). Items as MultiCamConditions' without a target video."""

    def __init__(self, root: str, cameras: str = "all", num_frames: int = 81, height: int = 480, width: int = 832,
                 fov_deg: float = 0.0):
        from .recammaster_cameras import read_camera_file, trajectory_numbers

        meta = os.path.join(root, "metadata.csv")
        if not os.path.isfile(meta):
            raise ConfigError(f"data.root {root!r} has no metadata.csv (file_name,text), as ReCamMaster's inference needs")
        with open(meta, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        if not rows or not {"file_name", "text"} <= set(rows[0]):
            raise ConfigError(f"{meta!r} needs rows with the columns file_name,text")
        self.videos = [(os.path.join(root, "videos", r["file_name"]), r["text"] or "") for r in rows]
        for path, _ in self.videos:
            why = probe_video(path, num_frames)
            if why:
                raise ConfigError(f"recam_folder: {path}: {why}")
        self.num_frames, self.height, self.width = int(num_frames), int(height), int(width)
        n_lat = latent_frames(self.num_frames)
        spec = str(cameras).strip()
        if spec.endswith((".npy", ".json")):
            self.trajs = [(0, read_camera_file(spec, self.num_frames, "data.cameras"))]
        else:
            names = list(CAM_TYPES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
            self.trajs = []
            for name in names:
                nums = trajectory_numbers(name, n_lat)
                cam = next(k for k in CAM_TYPES if np.array_equal(trajectory_numbers(k, n_lat), nums))
                self.trajs.append((cam, nums))
        self.items = [(r, c) for r in range(len(self.videos)) for c in range(len(self.trajs))]
        # a user's videos say nothing of their lens: data.fov_deg (horizontal, degrees) gives cam_score's intrinsics
        self.fov_deg = float(fov_deg or 0.0)
        self.k = np.asarray(fov_intrinsics(self.fov_deg, self.height, self.width), np.float32) if self.fov_deg > 0 \
            else None
        self.indices = [r * 100 + self.trajs[c][0] for r, c in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def prompt_at(self, i: int) -> str:
        return self.videos[self.items[i % len(self)][0]][1]

    def __getitem__(self, i: int) -> Dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"recam_folder has {len(self)} conditions, asked for {i}")
        i %= len(self)
        r, c = self.items[i]
        path, text = self.videos[r]
        src = cover_crop(read_video(path, range(self.num_frames), what="recam_folder video"), self.height, self.width)
        item = {"index": self.indices[i], "prompt": text, "source_video": torch.from_numpy(src),
                "cameras": torch.from_numpy(self.trajs[c][1].copy()), "cam_type": self.trajs[c][0]}
        if self.k is not None:
            item["intrinsics"] = self.k.copy()
        return item

    def missing_intrinsics(self) -> List[str]:
        """['data.fov_deg'] when the clips have no intrinsics (none set), else []."""
        return [] if self.k is not None else ["data.fov_deg is not set"]

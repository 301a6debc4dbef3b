"""Conditions addressed by integer index, and the distributed k-repeat sampler that places exactly k
copies of each chosen condition across all processes and batches of an epoch.

A condition item is a dict: {"index": int, "prompt": str, ...model-specific conditioning...}. GRPO groups
by `index`, so prompts, dataset rows and (sample_id, budget)-style conditions all work the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ddpo_grpo.errors import ConfigError


class PromptFileDataset:
    """One prompt per line of a text file; blank lines are ignored."""

    def __init__(self, path: str):
        if not path or not os.path.isfile(path):
            raise ConfigError(f"data.path {path!r} is not a file; give a text file with one prompt per line")
        with open(path) as f:
            self.prompts = [line.strip() for line in f if line.strip()]
        if not self.prompts:
            raise ConfigError(f"prompt file {path!r} is empty; put one prompt per line")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Dict:
        return {"index": i, "prompt": self.prompts[i]}

    def prompt_at(self, i: int) -> str:
        return self.prompts[i]


TOYWORLD_OBJECTS = ("mixed", "single", "pair")


class ToyWorldConditions:
    """The toy world's conditions (train or eval split) as condition items; `objects` "single" or "pair" keeps
    only the split's conditions with one or two objects (config.data.objects)."""

    def __init__(self, split: str = "train", objects: str = "mixed"):
        from ddpo_grpo.worlds.toyworld import ToyWorldDataset

        self.ds = ToyWorldDataset(split=split)
        if objects != "mixed":
            keep = [i for i in self.ds.indices if self.ds.conditions[i].is_pair == (objects == "pair")]
            self.ds = ToyWorldDataset(indices=keep)

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def weights(self) -> np.ndarray:
        return self.ds.weights

    def __getitem__(self, i: int) -> Dict:
        cond = self.ds.condition(i)
        return {"index": self.ds.indices[i], "prompt": cond.prompt(), "condition": cond}

    def prompt_at(self, i: int) -> str:
        return self.ds.condition(i).prompt()


class ConditionSubset:
    """A fixed subset of a condition dataset (DDPO-style small prompt set, so each condition recurs across
    epochs). Items keep their dataset index, so groups, captions and checkpoints are unchanged."""

    def __init__(self, dataset, positions: np.ndarray):
        self.dataset, self.positions = dataset, [int(p) for p in positions]

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def weights(self) -> Optional[np.ndarray]:
        w = getattr(self.dataset, "weights", None)
        if w is None:
            return None
        w = np.asarray(w, dtype=np.float64)[self.positions]
        return w / w.sum()

    def __getitem__(self, i: int) -> Dict:
        return self.dataset[self.positions[i]]

    def prompt_at(self, i: int) -> str:
        """Item i's prompt (trainer/run/embeddings.dataset_prompts), without building the item where the dataset can."""
        at = getattr(self.dataset, "prompt_at", None)
        return at(self.positions[i]) if at is not None else self.dataset[self.positions[i]]["prompt"]


def _subset(dataset, n: int, seed: int):
    """The first n conditions of a seeded draw (by the dataset's weights, if any); n <= 0 keeps everything."""
    if n <= 0 or n >= len(dataset):
        return dataset
    w = getattr(dataset, "weights", None)
    positions = np.random.default_rng((seed, 13)).choice(len(dataset), size=n, replace=False, p=w)
    return ConditionSubset(dataset, np.sort(positions))


def data_kinds(config) -> tuple:
    """config.data.kinds ("pan,tilt"; "" = all) -> the room3d training paths' kinds, checked: names of
    `room3d.paths.RANDOM_KINDS`, and only with data.name room3d (another world has no such kinds to pick)."""
    from ddpo_grpo.worlds.room3d.paths import parse_kinds

    kinds = parse_kinds(config.data.get("kinds", ""))
    if kinds and config.data.name != "room3d":
        raise ConfigError(f"data.kinds={config.data.kinds!r} picks the 3-D camera world's training paths: it needs "
                          f"data.name='room3d' (got {config.data.name!r})")
    return kinds


def build_dataset(config, split: str):
    """The condition dataset named by config.data.name. split "train": the training conditions (a subset of
    data.num_conditions if set); "eval": the conditions evaluated, per config.eval.split."""
    name = config.data.name
    if split == "eval" and config.eval.split == "train":
        return build_dataset(config, "train")
    if name == "toyworld":
        ds = ToyWorldConditions("eval" if split == "eval" else config.data.split, config.data.objects)
    elif name == "prompt_file":
        ds = PromptFileDataset(config.data.path)
    elif name == "recam":
        from ddpo_grpo.worlds.recam.data import RecamConditions

        ds = RecamConditions(split=split)
    elif name == "recam_video":
        from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions

        p, res = config.pretrained, int(config.pretrained.get("resolution", 0) or 64)
        # pretrained.height / width (the model's non-square size, models.wan): the view as the model samples it
        ds = RecamVideoConditions(split=split, num_frames=int(p.get("num_frames", 0) or 9),
                                  size=int(p.get("height", 0) or res), width=int(p.get("width", 0) or res))
    elif name == "room3d":  # the 3-D camera world: textured rooms ray-cast along 3-D camera paths
        from ddpo_grpo.worlds.room3d.data import Room3DConditions

        p, res = config.pretrained, int(config.pretrained.get("resolution", 0) or 0)
        kinds = data_kinds(config)
        ds = Room3DConditions(split=split, num_frames=int(p.get("num_frames", 0) or 9),
                              height=int(p.get("height", 0) or res or 32), width=int(p.get("width", 0) or res or 48),
                              **({"kinds": kinds} if kinds else {}))
    elif name in ("multicam", "recam_folder"):
        from ddpo_grpo.worlds.recam.folder import RecamFolder
        from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

        p, d = config.pretrained, config.data
        res = int(p.get("resolution", 0) or 0)
        size = dict(num_frames=int(p.get("num_frames", 0) or 81), height=int(p.get("height", 0) or res or 480),
                    width=int(p.get("width", 0) or res or 832))
        if not d.get("root", ""):
            raise ConfigError(f"data.name={name!r} needs data.root=DIR")
        fov = float(d.get("fov_deg", 0.0) or 0.0)
        if name == "multicam":  # split by scene: held-out scenes are never trained
            ds = MultiCamConditions(d.root, split, eval_fraction=float(d.get("eval_fraction", 0.1)),
                                    max_bad_fraction=float(d.get("max_bad_fraction", 0.1)), fov_deg=fov, **size)
        else:
            ds = RecamFolder(d.root, str(d.get("cameras", "all")), fov_deg=fov, **size)
        lacking = ds.missing_intrinsics() if "cam_score" in dict(config.reward.get("fns", {}) or {}) else []
        if lacking:  # before anything trains: cam_score reads the camera in 3-D through the clips' intrinsics
            raise ConfigError(f"data.root {d.root!r}: cam_score needs the clips' intrinsics, and {lacking[0]}"
                              f"{f' (and {len(lacking) - 1} more scenes)' if len(lacking) > 1 else ''} has none: "
                              "MultiCamVideo's focal folders (f18/f24/f35/f50_aperture*) give them, else set "
                              "data.fov_deg (the horizontal field of view, degrees)")
    else:
        raise ConfigError(f"unknown data.name {name!r}; choose 'toyworld', 'prompt_file', 'recam', 'recam_video', 'room3d', "
                          "'multicam' or 'recam_folder'")
    return _subset(ds, config.data.num_conditions, config.seed) if split == "train" else ds


@dataclass
class KRepeatSampler:
    """Per epoch: m = total / k distinct conditions (drawn without replacement, by `weights` if the dataset has
    them), each repeated exactly k times, shuffled, and cut into
    num_batches x num_processes slices of batch_size (whole trees of tree_size slots when branching). Every process computes the same plan from
    (seed, epoch), so no communication is needed and a resumed run replays the same epoch."""

    dataset_size: int
    batch_size: int
    num_batches: int
    num_processes: int
    k: int
    seed: int
    weights: Optional[np.ndarray] = None  # per-condition sampling weights (None = uniform)
    tree_size: int = 1  # consecutive slots that stay together (the leaves of one branched tree, core.branching)

    def __post_init__(self):
        total = self.batch_size * self.num_batches * self.num_processes
        if self.k < 2:
            raise ConfigError(f"sample.k={self.k}: GRPO needs at least 2 copies per condition to compare")
        if total % self.k:
            raise ConfigError(
                f"num_processes*batch_size*num_batches_per_epoch = {self.num_processes}*{self.batch_size}*"
                f"{self.num_batches} = {total} is not divisible by sample.k={self.k}; change k or the batch geometry"
            )
        self.num_conditions = total // self.k
        if self.num_conditions > self.dataset_size:
            raise ConfigError(
                f"an epoch needs {self.num_conditions} distinct conditions but the dataset has {self.dataset_size}; "
                "raise sample.k, lower the batch geometry or raise data.num_conditions"
            )

    def epoch_plan(self, epoch: int) -> np.ndarray:
        """Condition positions for the whole epoch, shape (num_batches, num_processes, batch_size)."""
        rng = np.random.default_rng((self.seed, epoch, 7))
        chosen = rng.choice(self.dataset_size, size=self.num_conditions, replace=False, p=self.weights)
        # Whole trees are shuffled, so a tree's leaves stay consecutive within one batch (batch_size is a multiple
        # of tree_size); with tree_size 1 this is the plain shuffle of k copies.
        plan = np.repeat(rng.permutation(np.repeat(chosen, self.k // self.tree_size)), self.tree_size)
        return plan.reshape(self.num_batches, self.num_processes, self.batch_size)

    def batch(self, epoch: int, batch_idx: int, rank: int) -> List[int]:
        return self.epoch_plan(epoch)[batch_idx, rank].tolist()

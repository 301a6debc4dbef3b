"""MultiCamVideo (ReCamMaster's training data) as condition items (`data.name="multicam"`, `data.root=DIR`); a user's
own folder of source videos with ReCamMaster trajectories (`data.name="recam_folder"`) is folder.py.

MultiCamVideo's layout (ReCamMaster's README and train_recammaster.py, commit 39c0dc2):

    ROOT/train/<focal>_aperture<N>/sceneK/videos/cam01.mp4 ... cam10.mp4      (81 synchronised frames each)
    ROOT/train/<focal>_aperture<N>/sceneK/cameras/camera_extrinsics.json      ({"frame0": {"cam01": "[..] [..]
                                                                               [..] [..] ", ...}, ...})
    ROOT/metadata.csv (optional)                                              (file_name,text: captions, file
                                                                               names relative to ROOT/train/)

A scene is any folder with videos/cam*.mp4 and cameras/camera_extrinsics.json under ROOT/train (or ROOT when it has
no train/). One condition is an ordered (source camera, target camera) pair of one scene, read as ReCamMaster's
training reads it: the source clip is the model's input, the target camera's poses at frames 0, 4, ..., 80 (21 latent
frames at 81 frames; a shorter clip takes every `stride`-th frame, stride = 80 // (F - 1), and the poses of its own
frames) relative to the SOURCE camera's frame 0 give the 12 numbers per latent frame (recammaster_cameras), and the
frames are resized to cover the model's height x width and centre-cropped (video_io.cover_crop). The prompt is the
target video's caption in metadata.csv ("" without one).

Item i: "index" (scene number * 10000 + source * 100 + target: a stable dataset index, the GRPO group key),
"prompt", "source_video" torch (F, 3, H, W) in [0, 1], "cameras" torch (F', 12), "target_video" np (F, 3, H, W) (the
real target clip), "scene", "source_cam", "target_cam".

Split by scene: a fixed draw (seed 0, not the run's) puts round(eval_fraction * scenes) scenes (at least one, when
there are two or more) in "eval"; "train" never holds them. Every video is opened (PyAV, its header: cheap) and every
needed matrix parsed when the dataset is built: a missing or damaged file is one line on stderr naming it, its pairs
are left out, and more than max_bad_fraction of the files bad is one ConfigError line before training.
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ddpo_grpo.errors import ConfigError

from .recammaster_cameras import LATENT_STRIDE, NUM_POSE_FRAMES, latent_frames, pair_numbers
from .video_io import cover_crop, cover_crop_intrinsics, fov_intrinsics, read_video

SPLITS = ("train", "eval", "all")
SENSOR_WIDTH_MM = 23.76  # ReCamMaster's renders: a 23.76 mm wide sensor behind the folder's focal length
FOCAL_FOLDER = re.compile(r"(?:^|[/\\])f(\d+(?:\.\d+)?)_aperture")  # MultiCamVideo: f18_aperture10, f24_..., f35, f50
MAX_LINES = 20  # bad-file lines printed before a summary
CLIP_CACHE = 32  # decoded clips kept (source clips recur across pairs)
EXTRINSICS_CACHE = 16  # parsed camera files kept (read when a pair's numbers are asked for)
_EXTRINSICS: "OrderedDict[tuple, dict]" = OrderedDict()
_CHECKED: Dict[tuple, dict] = {}  # check_scenes' verdicts in this process, by (root, frames needed, latents, stride)


def frame_stride(num_frames: int) -> int:
    """Video frames per clip frame: 80 // (F - 1), so a clip of F frames spans ReCamMaster's 81 (1 at F = 81)."""
    f = int(num_frames)
    if f < 5 or (f - 1) % LATENT_STRIDE or f > 4 * (NUM_POSE_FRAMES - 1) + 1:
        raise ConfigError(f"num_frames {num_frames}: MultiCamVideo clips take 1 + 4k frames, 5 to 81")
    return max(1, (4 * (NUM_POSE_FRAMES - 1)) // (f - 1))


def read_captions(root: str) -> Dict[str, str]:
    """metadata.csv's captions by absolute video path (file names relative to ROOT/train, as ReCamMaster reads them,
    or to ROOT); {} without the file."""
    path = os.path.join(root, "metadata.csv")
    if not os.path.isfile(path):
        return {}
    base = os.path.join(root, "train") if os.path.isdir(os.path.join(root, "train")) else root
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"{path!r} cannot be read as CSV ({e})") from None
    if rows and not {"file_name", "text"} <= set(rows[0]):
        raise ConfigError(f"{path!r} needs the columns file_name,text (ReCamMaster's metadata.csv)")
    return {os.path.normpath(os.path.join(base, r["file_name"])): r["text"] or "" for r in rows}


def find_scenes(root: str) -> List[str]:
    """Scene folders (with videos/ and cameras/) under ROOT/train, or ROOT, sorted by relative path."""
    if not os.path.isdir(root):
        raise ConfigError(f"data.root {root!r} is not a folder")
    top = os.path.join(root, "train") if os.path.isdir(os.path.join(root, "train")) else root
    scenes = []
    for d, subdirs, _ in os.walk(top):
        if "videos" in subdirs and "cameras" in subdirs:
            scenes.append(d)
            subdirs[:] = []
    if not scenes:
        raise ConfigError(f"data.root {root!r} holds no MultiCamVideo scene (a folder with videos/cam01.mp4 ... and "
                          "cameras/camera_extrinsics.json)")
    return sorted(scenes, key=lambda s: os.path.relpath(s, top))


def folder_focal_mm(scene: str) -> Optional[float]:
    """The focal length (mm) a MultiCamVideo scene was rendered with, from its folder (.../f24_aperture5/sceneK), or
    None when no folder on its path is named so."""
    m = None
    for m in FOCAL_FOLDER.finditer(os.path.normpath(scene)):
        pass
    return float(m.group(1)) if m else None


def probe_video(path: str, needed: int) -> str:
    """'' if the mp4 opens and says it has >= needed frames (or does not say), else why not."""
    if not os.path.isfile(path):
        return "missing"
    import av

    try:
        with av.open(path) as c:
            if not c.streams.video:
                return "no video stream"
            n = int(c.streams.video[0].frames or 0)
    except Exception as e:  # noqa: BLE001  (PyAV's error classes per FFmpeg failure)
        return f"damaged ({type(e).__name__})"
    return f"{n} frames, {needed} needed" if 0 < n < needed else ""


def read_extrinsics(cam_file: str) -> dict:
    """camera_extrinsics.json's dict (a few recent ones kept: a scene's pairs are read together); one ConfigError
    line naming a file that stopped being readable since the dataset was checked."""
    st = os.stat(cam_file) if os.path.isfile(cam_file) else None
    key = (cam_file, st.st_size if st else -1, st.st_mtime_ns if st else -1)
    if key not in _EXTRINSICS:
        try:
            with open(cam_file) as f:
                _EXTRINSICS[key] = json.load(f)
        except (OSError, ValueError) as e:
            why = "missing" if isinstance(e, OSError) else "damaged JSON"
            raise ConfigError(f"multicam: {cam_file}: {why}") from None
        while len(_EXTRINSICS) > EXTRINSICS_CACHE:
            _EXTRINSICS.popitem(last=False)
    _EXTRINSICS.move_to_end(key)
    return _EXTRINSICS[key]


def _signature(scene: str) -> list:
    """[name, size, mtime_ns] of the scene's camNN.mp4 files and its camera file (-1s when missing): what a check's
    verdict depends on."""
    names = sorted(f for f in os.listdir(os.path.join(scene, "videos")) if re.fullmatch(r"cam(\d+)\.mp4", f))
    out = []
    for rel in [os.path.join("videos", f) for f in names] + [os.path.join("cameras", "camera_extrinsics.json")]:
        try:
            st = os.stat(os.path.join(scene, rel))
            out.append([rel, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([rel, -1, -1])
    return out


def check_scene(scene: str, needed: int, num_latent: int, stride: int) -> Tuple[Optional[List[int]], List[str]]:
    """(readable cameras, or None when the camera file is unreadable; bad-file lines) of one scene: every video
    opened (PyAV's header) and every matrix its pairs read parsed."""
    videos = {int(m.group(1)): os.path.join(scene, "videos", f) for f in os.listdir(os.path.join(scene, "videos"))
              for m in [re.fullmatch(r"cam(\d+)\.mp4", f)] if m}
    cam_file = os.path.join(scene, "cameras", "camera_extrinsics.json")
    try:
        with open(cam_file) as f:
            extr = json.load(f)
    except (OSError, ValueError) as e:
        return None, [f"multicam: {cam_file}: {'missing' if isinstance(e, OSError) else 'damaged JSON'}"]
    good, bad = [], []
    listed = sorted({int(m.group(1)) for frame in (extr.values() if isinstance(extr, dict) else [])
                     if isinstance(frame, dict) for k in frame for m in [re.fullmatch(r"cam(\d+)", str(k))] if m})
    for cam in listed:  # a partial download: the camera file lists it, its video is not there
        if cam not in videos:
            bad.append(f"multicam: {os.path.join(scene, 'videos', f'cam{cam:02d}.mp4')}: missing (listed in "
                       f"{cam_file})")
    for cam, path in sorted(videos.items()):
        why = probe_video(path, needed)
        if not why:
            try:  # every matrix this camera's pairs read: as target (its frames) and as source (frame 0)
                pair_numbers(extr, cam, cam, num_latent, stride, where=cam_file)
            except ConfigError as e:
                why = str(e).replace(cam_file + ": ", "").replace(cam_file + " ", "")
                path = cam_file
        if why:
            bad.append(f"multicam: {path}: {why}")
        else:
            good.append(cam)
    return good, bad


def cache_dir() -> str:
    """Where the check's verdicts are kept between runs: $DDPO_GRPO_CACHE/multicam, else ~/.cache/ddpo_grpo/multicam."""
    base = os.environ.get("DDPO_GRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ddpo_grpo")
    return os.path.join(base, "multicam")


def check_scenes(root: str, scenes: List[str], needed: int, num_latent: int, stride: int):
    """([(scene, {cam: video} or None)], bad lines, fresh) for the scenes in order. Opening every video costs
    about 6 ms a file here (PyAV probes the stream; MultiCamVideo's 136K videos: some 13 minutes, on every process),
    so the verdict is kept: in this process (the train and eval splits and the memory plan build the dataset 2-4
    times; `fresh` is False after the first, whose lines were printed) and between runs in cache_dir(), one file per
    folder and clip length, each scene's verdict reused while its files' sizes and mtimes are unchanged (a stat
    each) and checked again otherwise. A cache that cannot be read or written is only slower."""
    import hashlib

    key = (os.path.realpath(root), int(needed), int(num_latent), int(stride))
    fresh = key not in _CHECKED
    if fresh:
        name = hashlib.sha1(repr(key).encode()).hexdigest()[:20] + ".json"
        path = os.path.join(cache_dir(), name)
        try:
            with open(path) as f:
                kept = json.load(f)
            kept = kept["scenes"] if kept.get("key") == list(key) else {}
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            kept = {}
        verdicts, changed = {}, False
        for scene in scenes:
            rel = os.path.relpath(scene, root)
            sig = _signature(scene)
            old = kept.get(rel)
            if not isinstance(old, dict) or old.get("sig") != sig:
                good, bad = check_scene(scene, needed, num_latent, stride)
                old, changed = {"sig": sig, "good": good, "bad": bad}, True
            verdicts[rel] = old
        if changed or set(kept) != set(verdicts):
            try:
                os.makedirs(cache_dir(), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"key": list(key), "scenes": verdicts}, f)
                os.replace(tmp, path)
            except OSError:
                pass
        _CHECKED[key] = verdicts
    verdicts = _CHECKED[key]
    out, bad = [], []
    for scene in scenes:
        v = verdicts[os.path.relpath(scene, root)]
        bad += v["bad"]
        out.append((scene, None if v["good"] is None else
                    {int(c): os.path.join(scene, "videos", f"cam{int(c):02d}.mp4") for c in v["good"]}))
    return out, bad, fresh


class MultiCamConditions:
    """The (source, target) camera pairs of a MultiCamVideo folder's scenes in one split (module docstring)."""

    def __init__(self, root: str, split: str = "train", num_frames: int = 81, height: int = 480, width: int = 832,
                 eval_fraction: float = 0.1, max_bad_fraction: float = 0.1, log=None, fov_deg: float = 0.0):
        if split not in SPLITS:
            raise ConfigError(f"unknown multicam split {split!r}; use one of {SPLITS}")
        if not 0 <= eval_fraction < 1 or not 0 <= max_bad_fraction <= 1:
            raise ConfigError("data.eval_fraction must be in [0, 1) and data.max_bad_fraction in [0, 1]")
        self.root, self.split = root, split
        self.num_frames, self.height, self.width = int(num_frames), int(height), int(width)
        self.stride = frame_stride(num_frames)
        self.num_latent = latent_frames(self.num_frames)
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        captions = read_captions(root)
        scenes = find_scenes(root)
        needed = self.stride * (self.num_frames - 1) + 1
        checked, bad, fresh = check_scenes(root, scenes, needed, self.num_latent, self.stride)
        # (number, folder, camera file, cam -> video); the extrinsics are read when a pair's numbers are asked for
        self.scenes: List[Tuple[int, str, str, Dict[int, str]]] = [
            (number, scene, os.path.join(scene, "cameras", "camera_extrinsics.json"), good)
            for number, (scene, good) in enumerate(checked) if good is not None]
        total = sum(len(v) for *_, v in self.scenes) + len(bad)
        if fresh:  # once per process and folder: the train and eval splits and the memory plan share one check
            for line in bad[:MAX_LINES]:
                log(line)
            if len(bad) > MAX_LINES:
                log(f"multicam: ... and {len(bad) - MAX_LINES} more bad files")
        if bad and len(bad) > max_bad_fraction * max(total, 1):
            raise ConfigError(f"data.root {root!r}: {len(bad)} of {total} videos / camera files are missing or damaged "
                              f"(more than data.max_bad_fraction={max_bad_fraction}), e.g. {bad[0][len('multicam: '):]}")
        n = len(scenes)
        n_eval = 0 if n < 2 or eval_fraction <= 0 else min(n - 1, max(1, round(eval_fraction * n)))
        held = set(np.random.default_rng(0).permutation(n)[:n_eval].tolist())  # fixed: the same for every run
        self.eval_scenes = sorted(os.path.relpath(scenes[i], root) for i in held)
        keep = {"train": lambda k: k not in held, "eval": lambda k: k in held, "all": lambda k: True}[split]
        self.pairs: List[Tuple[int, int, int]] = []  # (position in self.scenes, source, target)
        for pos, (number, _, _, good) in enumerate(self.scenes):
            if keep(number):
                self.pairs += [(pos, s, t) for s in sorted(good) for t in sorted(good) if s != t]
        if not self.pairs:
            raise ConfigError(f"data.root {root!r}: the {split} split has no (source, target) pair (scenes {n}, held "
                              f"out {n_eval}; a scene needs 2 readable cameras)")
        self.captions = captions
        self.indices = [self.scenes[p][0] * 10000 + s * 100 + t for p, s, t in self.pairs]
        self._clips: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._sizes: Dict[str, Tuple[int, int]] = {}  # each decoded video's own (h, w), for its intrinsics
        # the cameras' intrinsics (cam_score reads them): the focal folder's lens on ReCamMaster's sensor, else
        # data.fov_deg; scenes with neither are listed by missing_intrinsics() (the run stops when cam_score needs them)
        self.fov_deg = float(fov_deg or 0.0)
        self.focal_mm = {pos: folder_focal_mm(os.path.relpath(scene, root)) for pos, (_, scene, _, _) in
                         enumerate(self.scenes)}

    def __len__(self) -> int:
        return len(self.pairs)

    def prompt_at(self, i: int) -> str:
        pos, _, t = self.pairs[i % len(self)]
        return self.captions.get(os.path.normpath(self.scenes[pos][3][t]), "")

    def cameras(self, i: int) -> np.ndarray:
        """float32 (F', 12): pair i's target poses relative to its source camera's frame 0."""
        pos, s, t = self.pairs[i % len(self)]
        cam_file = self.scenes[pos][2]
        return pair_numbers(read_extrinsics(cam_file), s, t, self.num_latent, self.stride,
                            where=cam_file).astype(np.float32)

    def clip(self, path: str) -> np.ndarray:
        """(F, 3, H, W) float32 in [0, 1]: frames 0, stride, ... of the video, cover-cropped; one ConfigError line
        naming a file that fails to decode."""
        if path not in self._clips:
            frames = read_video(path, [self.stride * f for f in range(self.num_frames)], what="multicam video")
            self._sizes[path] = frames.shape[1:3]
            self._clips[path] = cover_crop(frames, self.height, self.width)
            while len(self._clips) > CLIP_CACHE:
                self._clips.popitem(last=False)
        self._clips.move_to_end(path)
        return self._clips[path]

    def missing_intrinsics(self) -> List[str]:
        """Scenes (relative paths) of this split whose cameras have no intrinsics: no focal folder, no data.fov_deg."""
        used = sorted({pos for pos, _, _ in self.pairs})
        return [os.path.relpath(self.scenes[p][1], self.root) for p in used
                if self.focal_mm[p] is None and self.fov_deg <= 0]

    def intrinsics(self, pos: int, path: str) -> Optional[np.ndarray]:
        """float32 (fx, fy, cx, cy) in the clip's pixels of scene `pos`'s camera whose video is `path` (decoded), or
        None (missing_intrinsics). The folder's lens: fx = focal / 23.76 mm * the video's width, square pixels, the
        centre in the middle, then through the reader's resize and crop (video_io.cover_crop_intrinsics)."""
        focal = self.focal_mm[pos]
        if focal is not None:
            h, w = self._sizes[path]
            f = focal / SENSOR_WIDTH_MM * w
            k = cover_crop_intrinsics((f, f, (w - 1) / 2.0, (h - 1) / 2.0), (h, w), self.height, self.width)
        elif self.fov_deg > 0:
            k = fov_intrinsics(self.fov_deg, self.height, self.width)
        else:
            return None
        return np.asarray(k, dtype=np.float32)

    def __getitem__(self, i: int) -> Dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"multicam {self.split} split has {len(self)} pairs, asked for {i}")
        i %= len(self)
        pos, s, t = self.pairs[i]
        _, scene, _, good = self.scenes[pos]
        item = {"index": self.indices[i], "prompt": self.prompt_at(i),
                "source_video": torch.from_numpy(self.clip(good[s]).copy()),
                "cameras": torch.from_numpy(self.cameras(i)), "target_video": self.clip(good[t]).copy(),
                "scene": os.path.relpath(scene, self.root), "source_cam": s, "target_cam": t}
        k = self.intrinsics(pos, good[t])
        if k is not None:
            item["intrinsics"] = k
        return item

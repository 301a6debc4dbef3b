"""Camera paths of the 3-D world: ReCamMaster's ten trajectories and random ones of the same kinds, as (F, 4, 4)
camera-to-world poses RELATIVE to the source camera (frame 0 = identity; OpenCV camera axes, metres). A clip's
world poses are `source_pose(scene) @ path[f]`.

Presets are read from ReCamMaster's own camera numbers (`recammaster_cameras.trajectory_numbers`, the latent frames
0, 4, 8, ... of the clip): clip frame 4j IS latent pose j, and the frames between two latent poses are interpolated
(rotation along the geodesic, i.e. slerp; translation linearly) - the presets move at constant speed, so this is their
path. `amplitude` scales every pose's rotation angle and translation; `mirror` reflects the motion left-right
(S = diag(-1, 1, 1): R -> S R S, t -> S t; pan right <-> pan left, arc left <-> arc right).

Random paths for training (`random_path`): the kinds pan, tilt, dolly ("zoom" in ReCamMaster's words), translate and
arc, with amplitudes in MultiCamVideo's ranges (GRPO_NOTES "MultiCamVideo's cameras"), cut where the room ends:
  pan 5-45 deg; tilt 5-30 deg; arc 15-75 deg around a point 3.5-4.5 m ahead (the camera turns to keep facing it);
  dolly in 1-2 m / out 1-2.5 m (MultiCamVideo's 1/4-1x the ~4 m to the subject, capped: the objects stand 3.6 m
  ahead at the nearest, the back wall 3.2 m behind); translate left/right 1-2.5 m or up/down 0.5-1 m (the room is
  3.2 m tall), half of them turning to keep facing a point 3.5-4.5 m ahead as ReCamMaster's translate presets do;
  half of the paths at constant speed, half eased (slow in, slow out), as in MultiCamVideo.
"""
from __future__ import annotations

from typing import Tuple, Union

import numpy as np

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.recam.recammaster_cameras import (
    CAM_TYPES, LATENT_STRIDE, latent_frames, relative_numbers, trajectory_numbers,
)

RANDOM_KINDS = ("pan", "tilt", "dolly", "translate", "arc")
MIRROR = np.diag([-1.0, 1.0, 1.0])


def check_num_frames(num_frames: int) -> int:
    """num_frames as an int 1 + 4k (Wan's VAE: one latent frame, then one per 4); else one ConfigError line."""
    if int(num_frames) != num_frames or num_frames < 1 or (int(num_frames) - 1) % LATENT_STRIDE:
        raise ConfigError(f"room3d: num_frames must be 1 + 4k (1, 5, 9, 17, ..., 81), got {num_frames!r}")
    return int(num_frames)


def so3_log(r: np.ndarray) -> np.ndarray:
    """(3,) axis * angle (radians) of a rotation (3, 3), stable near 0 and pi."""
    r = np.asarray(r, dtype=np.float64)
    cos = np.clip((np.trace(r) - 1.0) / 2.0, -1.0, 1.0)
    angle = np.arccos(cos)
    w = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
    if angle < 1e-7:
        return w / 2.0
    if np.pi - angle < 1e-4:  # near pi the antisymmetric part vanishes: the axis from the symmetric part
        axis = np.sqrt(np.maximum((np.diag(r) + 1.0) / 2.0, 0.0))
        k = int(np.argmax(axis))
        axis = np.array([(r[k, j] + r[j, k]) / (4 * axis[k]) if j != k else axis[k] for j in range(3)])
        return axis / np.linalg.norm(axis) * angle
    return w * angle / (2.0 * np.sin(angle))


def so3_exp(w: np.ndarray) -> np.ndarray:
    """(3, 3) rotation of axis * angle w (3,) (Rodrigues)."""
    w = np.asarray(w, dtype=np.float64)
    angle = np.linalg.norm(w)
    k = np.array([[0.0, -w[2], w[1]], [w[2], 0.0, -w[0]], [-w[1], w[0], 0.0]])
    if angle < 1e-12:
        return np.eye(3) + k
    return np.eye(3) + np.sin(angle) / angle * k + (1.0 - np.cos(angle)) / angle ** 2 * (k @ k)


def _numbers_to_poses(nums: np.ndarray) -> np.ndarray:
    out = np.tile(np.eye(4), (len(nums), 1, 1))
    out[:, :3, :] = np.asarray(nums, dtype=np.float64).reshape(-1, 3, 4)
    return out


def scale_pose(p: np.ndarray, amplitude: float) -> np.ndarray:
    """The pose with its rotation angle and translation times `amplitude` (same axis, same direction)."""
    out = np.eye(4)
    out[:3, :3] = so3_exp(amplitude * so3_log(p[:3, :3]))
    out[:3, 3] = amplitude * p[:3, 3]
    return out


def scale_cameras(cams, amplitude: float) -> np.ndarray:
    """Camera numbers (F', 12) -> the same path at `amplitude` times its motion (F', 12) float32: every pose (relative
    to frame 0) through `scale_pose`, so frame 0 stays the identity and each turn keeps its axis and direction."""
    poses = _numbers_to_poses(np.asarray(cams, dtype=np.float64))
    return np.stack([scale_pose(p, float(amplitude)) for p in poses])[:, :3, :4].reshape(len(poses), 12).astype(
        np.float32)


def mirror_pose(p: np.ndarray) -> np.ndarray:
    """The pose reflected left-right: S R S, S t with S = diag(-1, 1, 1)."""
    out = np.eye(4)
    out[:3, :3] = MIRROR @ p[:3, :3] @ MIRROR
    out[:3, 3] = MIRROR @ p[:3, 3]
    return out


def interpolate_latent(poses: np.ndarray, num_frames: int) -> np.ndarray:
    """(F, 4, 4) from poses (F', 4, 4) at clip frames 0, 4, 8, ...: frame 4j + i (0 < i < 4) on the geodesic from pose
    j to pose j + 1 at i / 4 (rotation: R_j exp(i/4 log(R_j^T R_j+1)); translation linear); frame 4j = pose j."""
    num_frames = check_num_frames(num_frames)
    if len(poses) != latent_frames(num_frames):
        raise ValueError(f"room3d: {len(poses)} latent poses for {num_frames} frames")
    out = np.empty((num_frames, 4, 4))
    out[::LATENT_STRIDE] = poses
    for j in range(len(poses) - 1):
        a, b = poses[j], poses[j + 1]
        w = so3_log(a[:3, :3].T @ b[:3, :3])
        for i in range(1, LATENT_STRIDE):
            s = i / LATENT_STRIDE
            p = np.eye(4)
            p[:3, :3] = a[:3, :3] @ so3_exp(s * w)
            p[:3, 3] = (1.0 - s) * a[:3, 3] + s * b[:3, 3]
            out[LATENT_STRIDE * j + i] = p
    return out


def preset_path(cam_type: Union[int, str], num_frames: int, amplitude: float = 1.0, mirror: bool = False) -> np.ndarray:
    """(F, 4, 4) float64: ReCamMaster's trajectory `cam_type` (1-10 or its name, e.g. "pan right") relative to the
    source camera's frame 0, read from its camera numbers at the clip's latent frames (`trajectory_numbers`, so a short
    clip makes the whole motion) and interpolated between them; amplitude / mirror as the module docstring says."""
    num_frames = check_num_frames(num_frames)
    poses = _numbers_to_poses(trajectory_numbers(cam_type, latent_frames(num_frames)))
    if float(amplitude) != 1.0:
        poses = np.stack([scale_pose(p, float(amplitude)) for p in poses])
    if mirror:
        poses = np.stack([mirror_pose(p) for p in poses])
    return interpolate_latent(poses, num_frames)


def static_path(num_frames: int) -> np.ndarray:
    """(F, 4, 4): the camera standing still at the source pose."""
    return np.tile(np.eye(4), (check_num_frames(num_frames), 1, 1))


def clip_cameras(path: np.ndarray) -> np.ndarray:
    """(F', 12) float32 camera numbers of a path (F, 4, 4), F = 1 + 4k: its poses at clip frames 0, 4, 8, ...,
    relative to its frame 0, top 3 x 4 row-major - ReCamMaster's format (`recammaster_cameras.relative_numbers`)."""
    path = np.asarray(path, dtype=np.float64)
    check_num_frames(len(path))
    return relative_numbers(path[0], list(path[::LATENT_STRIDE])).astype(np.float32)


def _rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _rot_x(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _look_at(position: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(3, 3) camera-to-world rotation of a level-horizon camera at `position` facing `target` (no roll)."""
    f = target - position
    f = f / np.linalg.norm(f)
    x = np.cross([0.0, 1.0, 0.0], f)  # right = down x forward (y down)
    x /= np.linalg.norm(x)
    return np.stack([x, np.cross(f, x), f], axis=1)


def check_kinds(kinds, what: str = "data.kinds") -> Tuple[str, ...]:
    """A non-empty selection of RANDOM_KINDS as a tuple (config data.kinds, Room3DConditions(kinds=...), the
    pretraining's --kinds: `what`, named in the error), else one ConfigError line."""
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in RANDOM_KINDS]
    if not kinds or bad:
        raise ConfigError(f"room3d: {what} must name some of {', '.join(RANDOM_KINDS)} (comma-separated), got "
                          f"{list(kinds)!r}")
    return kinds


def parse_kinds(text: str, what: str = "data.kinds") -> Tuple[str, ...]:
    """A comma-separated selection of kinds ("pan, tilt") -> check_kinds' tuple; "" (or only commas) -> () = all."""
    kinds = tuple(k.strip() for k in str(text or "").split(",") if k.strip())
    return check_kinds(kinds, what) if kinds else ()


# the first word of random_motion's names (ReCamMaster's words) -> its kind; a dolly is named "zoom in / out"
NAME_KIND = {"pan": "pan", "tilt": "tilt", "zoom": "dolly", "translate": "translate", "arc": "arc"}


def motion_kind(name: str) -> str:
    """The RANDOM_KINDS kind of a camera name as random_motion and preset_name write it ("zoom out" -> "dolly");
    ConfigError for a name of no kind."""
    word = str(name).strip().split(" ")[0]
    if word not in NAME_KIND:
        raise ConfigError(f"room3d: camera {name!r} names no kind of {', '.join(RANDOM_KINDS)}")
    return NAME_KIND[word]


def random_motion(rng: np.random.Generator, kind: str, num_frames: int) -> Tuple[np.ndarray, str]:
    """(path (F, 4, 4), name) of a random trajectory of `kind` (RANDOM_KINDS; ranges in the module docstring); the
    name is ReCamMaster's word for it ("pan left", "zoom in", "arc right", "translate up", ...)."""
    num_frames = check_num_frames(num_frames)
    if kind not in RANDOM_KINDS:
        raise ConfigError(f"room3d: unknown random trajectory kind {kind!r}; use one of {', '.join(RANDOM_KINDS)}")
    sign = 1.0 if rng.random() < 0.5 else -1.0
    eased = rng.random() < 0.5
    u = np.linspace(0.0, 1.0, num_frames)
    s = (1.0 - np.cos(np.pi * u)) / 2.0 if eased else u
    path = np.tile(np.eye(4), (num_frames, 1, 1))
    if kind == "pan":
        a = np.radians(rng.uniform(5.0, 45.0)) * sign
        path[:, :3, :3] = [_rot_y(a * x) for x in s]
        name = "pan right" if sign > 0 else "pan left"
    elif kind == "tilt":
        a = np.radians(rng.uniform(5.0, 30.0)) * sign
        path[:, :3, :3] = [_rot_x(a * x) for x in s]
        name = "tilt up" if sign > 0 else "tilt down"
    elif kind == "dolly":
        d = rng.uniform(1.0, 2.0) if sign > 0 else -rng.uniform(1.0, 2.5)
        path[:, 2, 3] = d * s
        name = "zoom in" if sign > 0 else "zoom out"
    elif kind == "arc":
        a, r = np.radians(rng.uniform(15.0, 75.0)) * sign, rng.uniform(3.5, 4.5)
        # sign > 0: arc left (ReCamMaster's cam_type 9: moves to -x, turns right to keep facing the centre)
        for f, x in enumerate(s):
            path[f, :3, :3] = _rot_y(a * x)
            path[f, :3, 3] = [-r * np.sin(a * x), 0.0, r * (1.0 - np.cos(a * x))]
        name = "arc left" if sign > 0 else "arc right"
    else:
        vertical = rng.random() < 0.5
        d = rng.uniform(0.5, 1.0) if vertical else rng.uniform(1.0, 2.5)
        axis = np.array([0.0, 1.0, 0.0]) if vertical else np.array([1.0, 0.0, 0.0])
        turn, target = rng.random() < 0.5, np.array([0.0, 0.0, rng.uniform(3.5, 4.5)])
        for f, x in enumerate(s):
            p = -sign * d * x * axis if vertical else sign * d * x * axis
            path[f, :3, 3] = p
            if turn and x > 0:
                path[f, :3, :3] = _look_at(p, target)
        name = ("translate up" if sign > 0 else "translate down") if vertical else \
            ("translate right" if sign > 0 else "translate left")
    return path, name


def random_path(rng: np.random.Generator, kind: str, num_frames: int) -> np.ndarray:
    """(F, 4, 4) float64: a random trajectory of `kind` ("pan", "tilt", "dolly", "translate", "arc") relative to the
    source camera (frame 0 = identity); amplitudes and speed profiles as the module docstring says."""
    return random_motion(rng, kind, num_frames)[0]


def preset_name(cam_type: Union[int, str]) -> str:
    """ReCamMaster's name of a preset ("pan right" for 1)."""
    key = str(cam_type).strip().lower()
    return CAM_TYPES[int(key)] if key.isdigit() and int(key) in CAM_TYPES else key


OPPOSITE_WORD = {"left": "right", "right": "left", "up": "down", "down": "up", "in": "out", "out": "in"}
_REFLECT_X, _REFLECT_Y, _REFLECT_Z = np.diag([-1.0, 1.0, 1.0]), np.diag([1.0, -1.0, 1.0]), np.diag([1.0, 1.0, -1.0])


def opposite_motion(path: np.ndarray, name: str) -> Tuple[np.ndarray, str]:
    """(path (F, 4, 4), name) of the OPPOSITE motion of `path` (F, 4, 4) named `name` (ReCamMaster's words, e.g.
    "pan right"): the path conjugated by the reflection S of its main axis (R -> S R S, t -> S t; S S = I, so twice is
    the identity) and the direction word swapped. Main axis: left / right (pan, arc, translate) x, S = diag(-1, 1, 1);
    up / down (tilt, translate) y, S = diag(1, -1, 1); in / out (zoom, dolly) z, S = diag(1, 1, -1). Pan right
    (R_y(a)) becomes R_y(-a), tilt up R_x(a) -> R_x(-a), zoom in (+d z) -> -d z. The camera-error of tiny-recam3d's
    pretraining data (benchmarks/pretrain_recam_video.py --mislabel opposite)."""
    words = str(name).strip().split()
    if len(words) != 2 or words[1] not in OPPOSITE_WORD:
        raise ConfigError(f"room3d: no opposite for camera {name!r}; expected '<kind> left|right|up|down|in|out'")
    s = {"left": _REFLECT_X, "right": _REFLECT_X, "up": _REFLECT_Y, "down": _REFLECT_Y,
         "in": _REFLECT_Z, "out": _REFLECT_Z}[words[1]]
    path = np.asarray(path, dtype=np.float64)
    out = path.copy()
    out[..., :3, :3] = s @ path[..., :3, :3] @ s
    out[..., :3, 3] = path[..., :3, 3] @ s.T
    return out, f"{words[0]} {OPPOSITE_WORD[words[1]]}"

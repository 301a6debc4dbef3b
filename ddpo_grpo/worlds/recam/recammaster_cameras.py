"""ReCamMaster's camera numbers: Unreal Engine camera matrices -> the 12 numbers per latent frame, and its ten
published inference trajectories (`cam_type` 1-10) as presets.

The conversion, as ReCamMaster's training and inference read `cameras/camera_extrinsics.json` (facts read from
KwaiVGI/ReCamMaster at commit 39c0dc2, train_recammaster.py / inference_recammaster.py):
  - each value "[a b c d] [e f g h] [i j k l] [m n o p] " is Unreal Engine's camera-to-world matrix as rows
    [forward 0] [right 0] [up 0] [location 1], location in centimetres;
  - frames 0, 4, ..., 80 (one pose per latent frame: 21);
  - transposed (columns forward, right, up, location), columns reordered to (right, up, forward, location), the
    second column negated (up -> down) and the location divided by 100: a camera-to-world pose with OpenCV's
    camera axes (x right, y down, z forward), in metres;
  - relative pose inv(c2w_reference) @ c2w_target[i] in float64, with the reference the SOURCE camera's frame 0 in
    training (a (source, target) pair of one scene) and the trajectory's own frame 0 at inference (its presets start
    at the source pose); the top 3 x 4, row-major, is the 12 numbers of latent frame i.

`recammaster_trajectories.json` beside this file holds the ten inference trajectories in these numbers (derived from
ReCamMaster's `example_test_data/cameras/camera_extrinsics.json`, MIT licence, notice in the JSON), so nothing reads
the original at run time. In these units: pan +-19.9 deg and tilt +-9.9 deg are pure rotations; zoom +-1.99 m along z;
translate up / down -+0.99 m with 14 deg of rotation; arc +-1.99 m in x, +0.53 m in z with 29.8 deg of rotation.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Sequence, Union

import numpy as np

from ddpo_grpo.errors import ConfigError

LATENT_STRIDE = 4  # pixel frames per latent frame: poses at frames 0, 4, ..., 80
NUM_POSE_FRAMES = 21  # ReCamMaster's 81 frames
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recammaster_trajectories.json")
# cam_type -> name (ReCamMaster's README order; the names of the video world's presets)
CAM_TYPES = {1: "pan right", 2: "pan left", 3: "tilt up", 4: "tilt down", 5: "zoom in", 6: "zoom out",
             7: "translate up", 8: "translate down", 9: "arc left", 10: "arc right"}


def parse_matrix(text: str, where: str = "") -> np.ndarray:
    """(4, 4) float64 from "[a b c d] [e f g h] [i j k l] [m n o p]"; one ConfigError line if it is not that."""
    rows = re.findall(r"\[([^\[\]]*)\]", str(text))
    try:
        m = np.array([[float(v) for v in r.split()] for r in rows], dtype=np.float64)
    except ValueError:
        m = np.zeros(0)
    if m.shape != (4, 4) or not np.isfinite(m).all():
        raise ConfigError(f"{where or 'camera matrix'}: {str(text)[:60]!r} is not a 4x4 matrix of numbers")
    return m


def ue_to_camera(ue_rows: np.ndarray) -> np.ndarray:
    """Unreal Engine's matrix (rows forward, right, up, location; cm) -> camera-to-world (4, 4) with x right, y down,
    z forward, metres (module docstring)."""
    c2w = np.asarray(ue_rows, dtype=np.float64).T[:, [1, 2, 0, 3]].copy()
    c2w[:3, 1] *= -1.0
    c2w[:3, 3] /= 100.0
    return c2w


def relative_numbers(reference: np.ndarray, targets: Sequence[np.ndarray]) -> np.ndarray:
    """(F', 12) float64: the top 3x4, row-major, of inv(reference) @ target for each camera-to-world target."""
    inv = np.linalg.inv(np.asarray(reference, dtype=np.float64))
    return np.stack([(inv @ np.asarray(t, dtype=np.float64))[:3, :].reshape(12) for t in targets])


def camera_poses(extrinsics: Dict, cam: int, frames: Sequence[int], where: str = "") -> list:
    """Camera-to-world poses (camera axes, metres) of camera `cam` (cam01 = 1) at `frames` of an extrinsics dict
    (`{"frame0": {"cam01": "[...] ..."}}`); a missing entry is one ConfigError line naming it."""
    out = []
    for f in frames:
        try:
            text = extrinsics[f"frame{f}"][f"cam{int(cam):02d}"]
        except (KeyError, TypeError):
            raise ConfigError(f"{where}: no matrix for frame{f} / cam{int(cam):02d}") from None
        out.append(ue_to_camera(parse_matrix(text, f"{where} frame{f} cam{int(cam):02d}")))
    return out


def pose_frames(num_latent: int = NUM_POSE_FRAMES, stride: int = 1) -> list:
    """The video frames whose poses make the camera numbers: latent frame j <-> clip frame 4j <-> video frame 4j*stride
    (ReCamMaster: stride 1, frames 0, 4, ..., 80)."""
    return [LATENT_STRIDE * stride * j for j in range(num_latent)]


def pair_numbers(extrinsics: Dict, source: int, target: int, num_latent: int = NUM_POSE_FRAMES, stride: int = 1,
                 where: str = "") -> np.ndarray:
    """(F', 12) float64: target camera's poses at `pose_frames`, relative to the source camera's frame 0 (training's
    reading); source == target gives the inference reading (relative to the trajectory's own frame 0)."""
    ref = camera_poses(extrinsics, source, [0], where)[0]
    return relative_numbers(ref, camera_poses(extrinsics, target, pose_frames(num_latent, stride), where))


def _table() -> dict:
    with open(TABLE) as f:
        return json.load(f)


def latent_frames(num_frames: int) -> int:
    """Latent frames of a clip of num_frames pixel frames (Wan's VAE: the first alone, then LATENT_STRIDE per latent)."""
    return (int(num_frames) - 1) // LATENT_STRIDE + 1


def read_camera_file(spec: str, num_frames: int, what: str) -> np.ndarray:
    """A user's (F', 12) camera numbers from a .npy or .json file for a clip of num_frames frames; anything else
    (missing, unreadable, another shape, not finite) is one ConfigError naming `what` (the option it came from)."""
    n_lat = latent_frames(num_frames)
    if not os.path.isfile(spec):
        raise ConfigError(f"{what} {spec!r} is not a file")
    try:
        arr = np.asarray(np.load(spec) if spec.endswith(".npy") else json.load(open(spec)), dtype=np.float32)
    except Exception as e:  # noqa: BLE001 - every unreadable file is the same one line
        raise ConfigError(f"{what} {spec!r} cannot be read ({type(e).__name__})") from None
    if arr.shape != (n_lat, 12) or not np.isfinite(arr).all():
        raise ConfigError(f"{what} {spec!r} is {arr.shape}; {num_frames} frames need finite ({n_lat}, 12)")
    return arr


def trajectory_numbers(spec: Union[int, str], num_latent: int = NUM_POSE_FRAMES) -> np.ndarray:
    """float32 (num_latent, 12): ReCamMaster's inference trajectory `spec` (a cam_type 1-10, as int or string, or its
    name, e.g. "pan right"), read at its 21 poses; fewer latent frames take the poses at evenly spaced times of the
    same path (frame j of F' at pose round(j * 20 / (F' - 1))), so a short clip makes the whole motion."""
    key = str(spec).strip().lower()
    by_name = {v: k for k, v in CAM_TYPES.items()}
    cam = int(key) if key.isdigit() else by_name.get(key)
    if cam not in CAM_TYPES:
        raise ConfigError(f"unknown ReCamMaster trajectory {spec!r}; use a cam_type 1-10 or one of "
                          f"{', '.join(CAM_TYPES.values())}")
    nums = np.asarray(_table()["trajectories"][str(cam)], dtype=np.float64)
    if num_latent < 1:
        raise ConfigError(f"num_latent must be >= 1, got {num_latent}")
    if num_latent != len(nums):
        pick = [0] if num_latent == 1 else [round(j * (len(nums) - 1) / (num_latent - 1)) for j in range(num_latent)]
        nums = nums[pick]
    return nums.astype(np.float32)


def motion_summary(numbers: np.ndarray) -> dict:
    """The last frame's rotation angle (degrees) and translation (metres, camera axes) of (F', 12) numbers."""
    last = np.asarray(numbers, dtype=np.float64)[-1].reshape(3, 4)
    angle = np.degrees(np.arccos(np.clip((np.trace(last[:, :3]) - 1) / 2, -1, 1)))
    return {"rotation_deg": float(angle), "translation_m": last[:, 3].tolist()}

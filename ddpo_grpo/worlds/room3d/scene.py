"""A procedural room in metres: a textured box (walls, floor, ceiling) with 3-6 boxes and balls standing on the floor.

World frame (metres): the same axes as an OpenCV camera at identity orientation, x right, y DOWN, z forward, so the
camera-to-world pose of a level camera looking down +z has R = I. The room is the box
    x in [-ROOM_HALF_X, ROOM_HALF_X], y in [CEILING_Y, FLOOR_Y], z in [ROOM_BACK_Z, ROOM_FRONT_Z];
the source camera stands near the origin at eye height (y = 0, 1.35 m above the floor) looking down +z (seeded yaw
within 8 deg, pitched 8-12 deg down so that the floor the objects stand on is in view), and the objects stand 3.6-5.6 m ahead, about where ReCamMaster's arcs orbit (a point ~4 m
ahead) and where its 2 m dolly stops short of. The room's size is what keeps every preset and every `random_path`
(paths.py states the ranges) inside it with >= 0.3 m to spare (tests/test_room3d.py checks the presets and many
random paths).

Texture: blocky value noise, three octaves of coarse cells (metres) on every surface with per-surface offsets, so
SIFT finds corners at 240 x 416 and the tiny 32 x 48 frames still show structure; cells are not a periodic checker
(random values, octaves of non-commensurate sizes), which aliases less and never matches itself at a shifted place.
Objects have a flat named colour (the prompt's word) with a weak texture on top. Shading is view independent
(ambient + Lambert from a fixed light), so a surface looks the same from every camera: what an exact estimator needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

ROOM_HALF_X = 6.0
FLOOR_Y = 1.35
CEILING_Y = -1.85
ROOM_BACK_Z = -3.5
ROOM_FRONT_Z = 7.0
ROOM_LO = np.array([-ROOM_HALF_X, CEILING_Y, ROOM_BACK_Z])
ROOM_HI = np.array([ROOM_HALF_X, FLOOR_Y, ROOM_FRONT_Z])
LIGHT = np.array([0.35, -1.0, -0.45]) / np.linalg.norm([0.35, -1.0, -0.45])  # towards the light (up, left, back)
AMBIENT = 0.62
NOISE_SHAPE = (3, 61, 53)  # octaves x table rows x cols (primes: cells wrap without lining up)

COLOURS = {"red": (0.85, 0.16, 0.12), "blue": (0.15, 0.3, 0.85), "green": (0.18, 0.7, 0.22),
           "yellow": (0.92, 0.82, 0.15), "orange": (0.95, 0.5, 0.1), "purple": (0.55, 0.2, 0.7),
           "white": (0.92, 0.92, 0.9), "cyan": (0.15, 0.75, 0.8)}
# surface kinds: 0 room face / box face (planar, texture coords from the two axes beside the face's normal), 1 sphere
KIND_PLANE, KIND_SPHERE = 0, 1


@dataclass
class Box:
    """An upright box: centre (3,), half sizes (3,) in its own frame, yaw (radians) about the vertical y axis."""
    colour: str
    centre: np.ndarray
    half: np.ndarray
    yaw: float = 0.0

    @property
    def rotation(self) -> np.ndarray:
        """(3, 3) object-to-world rotation (about y)."""
        c, s = np.cos(self.yaw), np.sin(self.yaw)
        return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])

    @property
    def word(self) -> str:
        return "box"


@dataclass
class Ball:
    """A sphere: centre (3,), radius (metres)."""
    colour: str
    centre: np.ndarray
    radius: float

    @property
    def word(self) -> str:
        return "ball"


@dataclass
class Scene:
    """One seeded room. `surfaces` holds per-surface texture parameters indexed by surface id: the room's six faces
    are ids 0-5 (2 * axis + (1 on the high side)), object k's surfaces are 6 + k (one id per object: its faces share
    a texture, told apart by their normals' shading)."""
    seed: int
    objects: List = field(default_factory=list)
    base: np.ndarray = None  # (S, 3) base colour per surface
    amp: np.ndarray = None  # (S, 3 octaves, 3 channels) noise amplitude
    scale: np.ndarray = None  # (S, 3) cell size per octave (metres)
    offset: np.ndarray = None  # (S, 3, 2) integer cell offsets per octave
    noise: np.ndarray = None  # NOISE_SHAPE + (3,) float32 table in [0, 1)
    source_position: np.ndarray = None  # (3,)
    source_yaw: float = 0.0
    source_pitch: float = 0.0

    def describe(self) -> str:
        """'a room with a red box, a blue ball and a green box' (objects in the order they were made)."""
        words = [f"{'an' if o.colour[0] in 'aeiou' else 'a'} {o.colour} {o.word}" for o in self.objects]
        listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
        return f"a room with {listed}"


def rotation_yaw_pitch(yaw: float, pitch: float) -> np.ndarray:
    """(3, 3) camera-to-world rotation of a camera turned by yaw (radians, + = to the right, about y) then pitched
    (+ = up: the forward axis gains -y, since y points down)."""
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    r_yaw = np.array([[cy, 0.0, sy], [0.0, 1.0, 0.0], [-sy, 0.0, cy]])
    r_pitch = np.array([[1.0, 0.0, 0.0], [0.0, cp, -sp], [0.0, sp, cp]])  # ReCamMaster's tilt up for pitch > 0
    return r_yaw @ r_pitch


def source_pose(scene: Scene) -> np.ndarray:
    """(4, 4) float64 camera-to-world pose of the scene's source camera (OpenCV camera axes, metres)."""
    pose = np.eye(4)
    pose[:3, :3] = rotation_yaw_pitch(scene.source_yaw, scene.source_pitch)
    pose[:3, 3] = scene.source_position
    return pose


def _place(rng: np.random.Generator, n: int) -> List[Tuple[float, float, float]]:
    """n footprints (x, z, radius) 3.6-5.6 m ahead that do not overlap (rejection sampling; fewer if crowded)."""
    out: List[Tuple[float, float, float]] = []
    for _ in range(400):
        if len(out) == n:
            break
        r = float(rng.uniform(0.3, 0.6))
        x, z = float(rng.uniform(-2.4, 2.4)), float(rng.uniform(3.6, 5.6))
        if all(np.hypot(x - a, z - b) > r + c + 0.15 for a, b, c in out):
            out.append((x, z, r))
    return out


def make_scene(seed: int) -> Scene:
    """The room of `seed` (deterministic: the same seed gives the same scene on every machine)."""
    rng = np.random.default_rng([int(seed), 3303])
    n = int(rng.integers(3, 7))
    names = [list(COLOURS)[i] for i in rng.permutation(len(COLOURS))]  # distinct colours: the prompt names each
    objects: list = []
    for (x, z, r), colour in zip(_place(rng, n), names):
        if rng.random() < 0.4:
            objects.append(Ball(colour, np.array([x, FLOOR_Y - r, z]), r))
        else:
            h = float(rng.uniform(0.25, 0.9))  # half height: some boxes tall, some low
            half = np.array([r * float(rng.uniform(0.7, 1.0)), h, r * float(rng.uniform(0.55, 1.0))])
            objects.append(Box(colour, np.array([x, FLOOR_Y - h, z]), half, float(rng.uniform(-0.6, 0.6))))
    s = 6 + len(objects)
    base = np.empty((s, 3))
    amp = np.empty((s, 3, 3))
    scale = np.empty((s, 3))
    # room faces: muted seeded colours with strong multi-scale patches (the features the estimators read)
    base[:6] = rng.uniform(0.35, 0.7, size=(6, 3))
    base[2] = rng.uniform(0.6, 0.85, size=3)  # ceiling (y low side): light
    base[3] = rng.uniform(0.3, 0.55, size=3)  # floor (y high side): darker
    amp[:6] = rng.uniform(0.25, 0.45, size=(6, 3, 3)) * np.array([1.0, 0.8, 0.6])[None, :, None]
    scale[:6] = np.array([1.3, 0.55, 0.23]) * rng.uniform(0.85, 1.15, size=(6, 1))
    for k, o in enumerate(objects):
        base[6 + k] = COLOURS[o.colour]
        amp[6 + k] = rng.uniform(0.08, 0.16, size=(3, 1)) * np.ones((1, 3))  # grey texture keeps the colour's name
        scale[6 + k] = np.array([0.4, 0.19, 0.09])
    pos = np.array([rng.uniform(-0.5, 0.5), 0.0, rng.uniform(-0.3, 0.3)])
    # cells mostly vary in brightness, partly in hue: patches of colour, not confetti
    noise = (0.6 * rng.random(NOISE_SHAPE + (1,)) + 0.4 * rng.random(NOISE_SHAPE + (3,))).astype(np.float32)
    return Scene(seed=int(seed), objects=objects, base=base, amp=amp, scale=scale,
                 offset=rng.integers(0, 997, size=(s, 3, 2)), noise=noise,
                 source_position=pos, source_yaw=float(np.radians(rng.uniform(-8, 8))),
                 source_pitch=float(np.radians(-rng.uniform(8, 12))))


def inside_room(positions: np.ndarray, margin: float = 0.3) -> np.ndarray:
    """(N,) bool: camera centres (N, 3) at least `margin` metres inside every wall, the floor and the ceiling."""
    p = np.asarray(positions, dtype=np.float64).reshape(-1, 3)
    return ((p > ROOM_LO + margin) & (p < ROOM_HI - margin)).all(axis=1)


def clear_of_objects(scene: Scene, positions: np.ndarray, margin: float = 0.3) -> np.ndarray:
    """(N,) bool: camera centres (N, 3) at least `margin` metres outside every object of the scene."""
    p = np.asarray(positions, dtype=np.float64).reshape(-1, 3)
    ok = np.ones(len(p), dtype=bool)
    for o in scene.objects:
        if isinstance(o, Ball):
            ok &= np.linalg.norm(p - o.centre, axis=1) > o.radius + margin
        else:
            local = np.abs((p - o.centre) @ o.rotation)  # world -> object frame (rotation is orthonormal)
            ok &= np.linalg.norm(np.maximum(local - o.half, 0.0), axis=1) > margin
    return ok

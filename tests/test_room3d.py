"""room3d, the 3-D camera world: exact projection, seeded scenes, ReCamMaster's presets as 3-D paths, the condition
dataset and the world's exact camera estimator (fast: tiny frames, except the cross-check with OpenCV's estimator)."""
import numpy as np
import pytest

from ddpo_grpo.worlds.room3d import intrinsics, make_scene, render_view, source_pose
from ddpo_grpo.worlds.room3d.render import render_view_depth
from ddpo_grpo.worlds.room3d.scene import Ball


def rot_y(deg):
    a = np.radians(deg)
    return np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])


def rot_x(deg):
    a = np.radians(deg)
    return np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])


def pose(r, t):
    p = np.eye(4)
    p[:3, :3], p[:3, 3] = r, t
    return p


@pytest.mark.parametrize("height,width,ss", [(60, 96, 1), (45, 80, 3)])
def test_a_known_point_projects_where_K_and_the_pose_say(height, width, ss):
    """A 4 cm ball at a known world point, seen by a turned and moved camera: the centroid of the pixels it changes
    is K (R^T (X - t)) / z (OpenCV's pixel centres: the top-left pixel's centre is (0, 0))."""
    scene = make_scene(5)
    X = np.array([0.7, -0.3, 3.1])
    c2w = pose(rot_y(12.0) @ rot_x(-7.0), [0.2, 0.1, -0.4])
    K = intrinsics(height, width)
    K[0, 2] += 3.25  # an off-centre principal point, to catch a convention that only works at the centre
    without = render_view(scene, c2w, K, height, width, ss)
    scene.objects.append(Ball("white", X, 0.04))
    scene.base = np.vstack([scene.base, [[1.0, 1.0, 1.0]]])
    scene.amp = np.concatenate([scene.amp, np.zeros((1, 3, 3))])
    scene.scale = np.vstack([scene.scale, [[1.0, 1.0, 1.0]]])
    scene.offset = np.concatenate([scene.offset, np.zeros((1, 3, 2), dtype=np.int64)])
    with_ball = render_view(scene, c2w, K, height, width, ss)
    w = np.abs(with_ball - without).sum(axis=0).astype(np.float64)
    assert w.sum() > 0.5, "the ball is not visible"
    v, u = np.mgrid[0:height, 0:width]
    cam = c2w[:3, :3].T @ (X - c2w[:3, 3])
    expect = (K @ (cam / cam[2]))[:2]
    got = np.array([(w * u).sum() / w.sum(), (w * v).sum() / w.sum()])
    # a ball of radius 0.04 m at ~3.6 m is ~1 px across: its pixels' centroid is within a fraction of a pixel
    assert np.abs(got - expect).max() < (0.35 if ss == 1 else 0.2), (got, expect)


def test_depth_is_camera_z():
    """The depth of the pixel looking straight at the front wall from a level camera is the wall's distance."""
    scene = make_scene(1)
    scene.objects = []
    c2w = pose(np.eye(3), [0.0, 0.0, 1.0])
    _, depth = render_view_depth(scene, c2w, intrinsics(31, 41), 31, 41)
    from ddpo_grpo.worlds.room3d.scene import ROOM_FRONT_Z
    assert abs(depth[15, 20] - (ROOM_FRONT_Z - 1.0)) < 1e-4
    # off-axis pixels on the same wall: camera z is the same (depth, not distance along the ray)
    assert abs(depth[15, 0] - (ROOM_FRONT_Z - 1.0)) < 1e-4


def test_renders_are_deterministic_per_seed_and_textured():
    K = intrinsics(32, 48)
    a = render_view(make_scene(3), source_pose(make_scene(3)), K, 32, 48)
    b = render_view(make_scene(3), source_pose(make_scene(3)), K, 32, 48)
    c = render_view(make_scene(4), source_pose(make_scene(4)), K, 32, 48)
    assert a.shape == (3, 32, 48) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).mean() > 0.05
    for seed in range(6):
        img = render_view(make_scene(seed), source_pose(make_scene(seed)), K, 32, 48)
        assert 0.0 <= img.min() and img.max() <= 1.0
        assert img.std() > 0.08  # textured, not flat
        # local texture: neighbouring pixels differ (what SIFT and the estimators read)
        assert np.abs(np.diff(img, axis=2)).mean() > 0.02


def test_scenes_have_3_to_6_named_objects():
    for seed in range(20):
        s = make_scene(seed)
        assert 3 <= len(s.objects) <= 6
        assert s.describe().startswith("a room with ")
        assert len({o.colour for o in s.objects}) == len(s.objects)

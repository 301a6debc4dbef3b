"""room3d, the 3-D camera world: exact projection, seeded scenes, ReCamMaster's presets as 3-D paths, a dataset item
as the estimator reads it (the dataset itself: test_room3d_data.py) and the world's exact camera estimator (fast: tiny
frames, except the cross-check with OpenCV's estimator)."""
import numpy as np
import pytest
import torch

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


# ---------------------------------------------------------------- paths
from ddpo_grpo.worlds.recam.recammaster_cameras import trajectory_numbers  # noqa: E402
from ddpo_grpo.worlds.room3d.paths import (  # noqa: E402
    RANDOM_KINDS, clip_cameras, preset_path, random_motion, random_path, so3_log, static_path,
)
from ddpo_grpo.worlds.room3d.scene import ROOM_HI, ROOM_LO, clear_of_objects  # noqa: E402


def angle_deg(r):
    return np.degrees(np.arccos(np.clip((np.trace(r) - 1) / 2, -1, 1)))


@pytest.mark.parametrize("num_frames", [9, 17, 81])
def test_preset_paths_equal_the_trajectory_numbers_at_latent_frames(num_frames):
    n_lat = (num_frames - 1) // 4 + 1
    for cam in range(1, 11):
        path = preset_path(cam, num_frames)
        assert path.shape == (num_frames, 4, 4)
        np.testing.assert_array_equal(path[0], np.eye(4))
        want = trajectory_numbers(cam, n_lat).astype(np.float64)
        np.testing.assert_allclose(path[::4, :3, :].reshape(n_lat, 12), want, atol=1e-12, rtol=0)
        np.testing.assert_allclose(clip_cameras(path), want, atol=1e-6, rtol=0)
        # in between: on the geodesic, half-way at frame 4j + 2 (constant-speed presets)
        if num_frames == 9:
            mid = path[2]
            # (the float32 numbers are orthonormal to ~1e-7: angles agree to 1e-3 deg)
            np.testing.assert_allclose(angle_deg(mid[:3, :3]), angle_deg(path[4, :3, :3]) / 2, atol=1e-3)
            np.testing.assert_allclose(mid[:3, 3], path[4, :3, 3] / 2, atol=1e-9)


def test_mirror_of_pan_right_is_pan_left_and_of_arc_left_is_arc_right():
    """Checked against the JSON's own cam_type 2 and 10 (ReCamMaster's numbers, not a reflection of ours)."""
    np.testing.assert_allclose(clip_cameras(preset_path(1, 81, mirror=True)), trajectory_numbers(2), atol=1e-6)
    np.testing.assert_allclose(clip_cameras(preset_path(9, 81, mirror=True)), trajectory_numbers(10), atol=1e-6)
    # a tilt has no left or right: its mirror is itself
    np.testing.assert_allclose(clip_cameras(preset_path(3, 17, mirror=True)), clip_cameras(preset_path(3, 17)),
                               atol=1e-6)


def test_amplitude_scales_angle_and_translation():
    for cam, full_deg in ((1, 19.88), (9, 29.83)):
        full, half = preset_path(cam, 81), preset_path(cam, 81, amplitude=0.5)
        assert abs(angle_deg(full[-1, :3, :3]) - full_deg) < 0.05
        # the float32 numbers are orthonormal to ~1e-7, so their trace-read angle is good to ~1e-5 deg
        np.testing.assert_allclose(angle_deg(half[-1, :3, :3]), angle_deg(full[-1, :3, :3]) / 2, atol=1e-4)
        np.testing.assert_allclose(half[-1, :3, 3], full[-1, :3, 3] / 2, atol=1e-9)
        # the same axis
        a, b = so3_log(full[-1, :3, :3]), so3_log(half[-1, :3, :3])
        np.testing.assert_allclose(b, a / 2, atol=1e-9)


def test_clip_cameras_round_trip_and_relative_to_frame_0():
    rng = np.random.default_rng(0)
    path = random_path(rng, "arc", 17)
    nums = clip_cameras(path)
    assert nums.shape == (5, 12) and nums.dtype == np.float32
    np.testing.assert_allclose(nums[0], np.eye(4)[:3].reshape(12), atol=1e-7)
    np.testing.assert_allclose(nums.reshape(5, 3, 4), path[::4, :3, :], atol=1e-6)
    # a path not starting at identity: the numbers are relative to its frame 0
    g = np.eye(4)
    g[:3, :3], g[:3, 3] = rot_y(30) @ rot_x(5), [1.0, -0.2, 0.5]
    np.testing.assert_allclose(clip_cameras(g @ path), nums, atol=1e-5)
    np.testing.assert_array_equal(static_path(9), np.tile(np.eye(4), (9, 1, 1)))


def test_every_camera_stays_inside_the_room_and_clear_of_the_objects():
    rng = np.random.default_rng(0)
    for seed in range(30):
        scene = make_scene(seed)
        src = source_pose(scene)
        paths = [preset_path(c, 17) for c in range(1, 11)] + [preset_path(c, 17, mirror=True) for c in (1, 9)]
        paths += [random_path(rng, k, 17) for k in RANDOM_KINDS for _ in range(4)]
        for p in paths:
            pos = (src @ p)[:, :3, 3]
            assert (pos > ROOM_LO + 0.3).all() and (pos < ROOM_HI - 0.3).all()
            assert clear_of_objects(scene, pos, 0.3).all()


def test_random_paths_have_the_stated_ranges():
    rng = np.random.default_rng(1)
    for kind, lo, hi in (("pan", 5, 45), ("tilt", 5, 30), ("arc", 15, 75)):
        for _ in range(20):
            path, name = random_motion(rng, kind, 9)
            assert lo - 1e-6 <= angle_deg(path[-1, :3, :3]) <= hi + 1e-6
            assert name.split()[0] == kind
    for _ in range(20):
        path, name = random_motion(rng, "dolly", 9)
        assert 1.0 <= abs(path[-1, 2, 3]) <= 2.5 and name in ("zoom in", "zoom out")
        assert (path[-1, 2, 3] > 0) == (name == "zoom in")


# ---------------------------------------------------------------- the exact estimator
from ddpo_grpo.worlds.room3d import render_clip  # noqa: E402
from ddpo_grpo.worlds.room3d.estimator import estimate_exact, exact_estimator, make_exact_estimator  # noqa: E402


def rot_err_deg(a, b):
    return np.degrees(np.linalg.norm(so3_log(a[:3, :3].T @ b[:3, :3])))


def latent_clip(scene, path, h=32, w=48, ss=2):
    return render_clip(scene, source_pose(scene) @ path[::4], intrinsics(h, w), h, w, ss)


@pytest.mark.parametrize("seed,cam", [(0, 1), (1, 3), (2, 5), (3, 8), (4, 9)])
def test_exact_estimator_recovers_the_true_poses(seed, cam):
    """Ground-truth renders (9 frames at 32 x 48, latent frames 0, 4, 8): rotations within a fraction of a degree,
    translations (metric: the estimator knows the room) within a few cm."""
    scene, path = make_scene(seed), preset_path(cam, 9)
    est = estimate_exact(latent_clip(scene, path), intrinsics(32, 48), scene)
    assert est.shape == (3, 4, 4)
    np.testing.assert_allclose(est[0], np.eye(4), atol=1e-9)
    for j in (1, 2):
        assert rot_err_deg(est[j], path[4 * j]) < 0.3
        assert np.linalg.norm(est[j, :3, 3] - path[4 * j, :3, 3]) < 0.05


def test_exact_estimator_reads_mirrored_and_half_clips_as_they_are():
    scene = make_scene(6)
    K = intrinsics(32, 48)
    for cam, mirror, amp in ((1, True, 1.0), (10, True, 1.0), (3, False, 0.5)):
        path = preset_path(cam, 9, amplitude=amp, mirror=mirror)
        est = make_exact_estimator(scene)(latent_clip(scene, path), K)
        assert rot_err_deg(est[2], path[8]) < 0.3
        # and not as the requested preset: pan right read as pan left is ~40 deg away, a half tilt ~5 deg
        assert rot_err_deg(est[2], preset_path(cam, 9)[8]) > (4.0 if amp != 1.0 else 30.0)
    # the mirrored pan right is read with pan left's numbers (ReCamMaster's own cam_type 2)
    est = estimate_exact(latent_clip(scene, preset_path(1, 9, mirror=True)), K, scene)
    np.testing.assert_allclose(est[:, :3, :].reshape(3, 12), trajectory_numbers(2, 3), atol=0.01)


def test_exact_estimator_says_nan_where_it_cannot_tell_and_reads_the_seed_from_metadata():
    scene = make_scene(3)
    K = intrinsics(32, 48)
    rng = np.random.default_rng(0)
    assert np.isnan(estimate_exact(np.zeros((3, 3, 32, 48)), K, scene)).all()
    assert np.isnan(estimate_exact(rng.random((3, 3, 32, 48)), K, scene)).all()
    clip = latent_clip(scene, preset_path(2, 9))
    clip[2] = rng.random((3, 32, 48))
    est = estimate_exact(clip, K, scene)
    assert np.isfinite(est[:2]).all() and np.isnan(est[2]).all()
    # unbound: the scene comes from the item's metadata (what cam_score hands an estimator with takes_metadata)
    assert exact_estimator.takes_metadata
    clip = latent_clip(scene, preset_path(7, 9))
    got = exact_estimator(clip, K, metadata={"scene_seed": 3})
    assert rot_err_deg(got[2], preset_path(7, 9)[8]) < 0.3
    with pytest.raises(ValueError, match="scene_seed"):
        exact_estimator(clip, K, metadata={})


def test_covisible_mask_of_a_turned_camera_is_the_source_frame_by_the_float64_formula():
    """For a pure rotation every pixel's ray is a ray of the source camera: it sees the same point, which the source
    sees exactly when K R_rel K^-1 (u, v, 1) lands inside its frame (depth plays no part)."""
    from ddpo_grpo.worlds.room3d.estimator import _Aligner

    K = intrinsics(32, 48)
    for seed, cam in ((0, 1), (1, 4), (2, 2)):  # pan right, tilt down, pan left
        scene = make_scene(seed)
        al = _Aligner(scene, K, 32, 48, 1)
        assert al.covisible(source_pose(scene), al.render(source_pose(scene))[1]) is None  # no reference: all
        al.set_reference(source_pose(scene))
        pose = source_pose(scene) @ preset_path(cam, 9)[8]
        got = al.covisible(pose, al.render(pose)[1])
        v, u = np.mgrid[0:32, 0:48].astype(np.float64)
        rel = np.linalg.inv(source_pose(scene))[:3, :3] @ pose[:3, :3]
        d = np.einsum("ij,jhw->ihw", K @ rel @ np.linalg.inv(K), np.stack([u, v, np.ones_like(u)]))
        us, vs = np.rint(d[0] / d[2]), np.rint(d[1] / d[2])
        want = (d[2] > 0) & (us >= 0) & (us < 48) & (vs >= 0) & (vs < 32)
        assert 0.3 < want.mean() < 0.95  # a turned camera: part of its view is new
        # equal but for the odd pixel where the nearest source pixel's depth is across an object's edge
        assert not (got & ~want).any() and (want & ~got).mean() < 0.02
        assert al.covisible(source_pose(scene), al.render(source_pose(scene))[1]).all()


@pytest.mark.parametrize("seed,cam", [(0, 1), (3, 10), (4, 6)])  # pan right, arc right, zoom out
def test_covisible_estimator_reads_the_camera_whatever_fills_what_the_source_never_saw(seed, cam):
    """A clip whose moved frames show the right room where the source camera saw it and another room elsewhere (what
    a model must invent): read with `covisible` as if it were the true render; the whole-frame alignment is pulled
    off by the invented part."""
    from ddpo_grpo.worlds.room3d.estimator import _Aligner

    scene, other, path = make_scene(seed), make_scene(100 + seed), preset_path(cam, 9)
    K = intrinsics(32, 48)
    clip = latent_clip(scene, path)
    al = _Aligner(scene, K, 32, 48, 1)
    al.set_reference(source_pose(scene))
    for j in (1, 2):
        pose = source_pose(scene) @ path[4 * j]
        unseen = ~al.covisible(pose, al.render(pose)[1])
        clip[j][:, unseen] = render_view(other, source_pose(other) @ path[4 * j], K, 32, 48, 2)[:, unseen]
    est = estimate_exact(clip, K, scene, covisible=True)
    for j in (1, 2):
        assert rot_err_deg(est[j], path[4 * j]) < 0.8
        assert np.linalg.norm(est[j, :3, 3] - path[4 * j, :3, 3]) < 0.15
    whole = estimate_exact(clip, K, scene)
    assert not np.isfinite(whole[2]).all() or rot_err_deg(whole[2], path[8]) > 1.5


# ---------------------------------------------------------------- a dataset item read by the estimator
# (the dataset itself: tests/test_room3d_data.py)
from ddpo_grpo.worlds.room3d import Room3DConditions  # noqa: E402


def test_an_item_carries_what_the_exact_estimator_needs():
    """cam_score's route: the latent frames of target_video, K from intrinsics, metadata's scene_seed."""
    it = Room3DConditions("eval", seed=2)[8]  # arc left
    fx, fy, cx, cy = it["intrinsics"]
    K = np.array([[fx, 0, cx], [0, fy, cy], [0, 0, 1.0]])
    est = exact_estimator(it["target_video"][::4], K, metadata={"scene_seed": it["scene_seed"]})
    want = it["cameras"].numpy().astype(np.float64).reshape(3, 3, 4)
    for j in (1, 2):
        assert rot_err_deg(est[j], np.vstack([want[j], [0, 0, 0, 1]])) < 0.3
        assert np.linalg.norm(est[j, :3, 3] - want[j, :, 3]) < 0.05


# ---------------------------------------------------------------- agreement with OpenCV's two-view estimator
@pytest.mark.parametrize("seed,cam", [(0, 1), (1, 5), (2, 9)])
def test_exact_and_two_view_estimators_agree_on_ground_truth_renders(seed, cam):
    """At 240 x 416 (a size SIFT reads), 9 frames, latent frames 0, 4, 8: rotations agree within 1 deg; where the
    camera moves (> 0.3 m) the translation directions agree within 2 deg and the magnitudes normalised by the clip's
    largest agree within 0.05 (a monocular estimate has no metric scale; the exact one is in metres)."""
    pytest.importorskip("cv2")
    from ddpo_grpo.worlds.recam.pose_estimators import estimate_two_view

    scene, path = make_scene(seed), preset_path(cam, 9)
    K = intrinsics(240, 416)
    frames = render_clip(scene, source_pose(scene) @ path[::4], K, 240, 416)
    ex, tv = estimate_exact(frames, K, scene), estimate_two_view(frames, K)
    assert np.isfinite(ex).all() and np.isfinite(tv).all()
    ex_t, tv_t = ex[:, :3, 3], tv[:, :3, 3]
    ex_n = np.linalg.norm(ex_t, axis=1) / max(np.linalg.norm(ex_t, axis=1).max(), 1e-9)
    tv_n = np.linalg.norm(tv_t, axis=1) / max(np.linalg.norm(tv_t, axis=1).max(), 1e-9)
    for j in (1, 2):
        assert rot_err_deg(ex[j], tv[j]) < 1.0
        if np.linalg.norm(path[4 * j, :3, 3]) > 0.3:
            cos = ex_t[j] @ tv_t[j] / np.linalg.norm(ex_t[j]) / np.linalg.norm(tv_t[j])
            assert np.degrees(np.arccos(np.clip(cos, -1, 1))) < 2.0
            assert abs(ex_n[j] - tv_n[j]) < 0.05
        else:  # a pure rotation: both read (almost) no translation
            assert np.linalg.norm(ex_t[j]) < 0.05 and np.linalg.norm(tv_t[j]) < 0.05


# ---------------------------------------------------------------- cam_score with the exact estimator
@pytest.mark.parametrize("k", [0, 8])  # eval items 0 and 8: pan right, arc left
def test_cam_score_with_the_exact_estimator(k):
    """Through cam_score's real route (dotted path, uint8 frames, metadata): the true clip scores ~1 and clearly
    beats the mirrored preset, the half-amplitude one and a static camera; a black clip scores 0."""
    from ddpo_grpo.worlds.recam.cam_score import make_cam_score
    from ddpo_grpo.worlds.room3d import static_path

    it = Room3DConditions("eval", seed=0)[k]
    cam = k + 1
    scene = make_scene(it["scene_seed"])
    src, K = source_pose(scene), intrinsics(32, 48)
    clips = [it["target_video"]] + [render_clip(scene, src @ p, K, 32, 48, 2) for p in (
        preset_path(cam, 9, mirror=True), preset_path(cam, 9, amplitude=0.5), static_path(9))]
    clips.append(np.zeros_like(clips[0]))
    fn = make_cam_score(pose_estimator="ddpo_grpo.worlds.room3d.estimator:exact_estimator", workers=0)
    meta = {key: v for key, v in it.items() if key != "target_video"}
    scores, det = fn(torch.from_numpy(np.stack(clips)), [""] * 5, [meta] * 5)
    true, mirrored, half, static, black = scores.tolist()
    assert true > 0.95
    assert mirrored < 0.2 and static < 0.4 and half < 0.6  # measured: 0.08 / 0.25 / 0.49 (pan), 0.0 / 0.02 / 0.35 (arc)
    assert black == 0.0 and det["estimate_failed"][4] == 1.0

"""cam_score's 6-DoF camera estimators (ddpo_grpo.worlds.recam.pose_estimators, pose_glomap) on exact pinhole renders
of room3d scenes along ReCamMaster's presets, bad clips, and the loader."""
import os
import sys

import numpy as np
import pytest
import torch

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds import room3d
from ddpo_grpo.worlds.recam.pose_estimators import POSE_ESTIMATORS, estimate_two_view, load_pose_estimator
from ddpo_grpo.worlds.recam.pose_score import camera_metrics, rotation_angle, vector_angle
from ddpo_grpo.worlds.room3d.paths import preset_path

H, W = 240, 416
K = room3d.intrinsics(H, W)
_CLIPS = {}


def clip(cam_type, frames=6, seed=3):
    """(frames (F, 3, H, W), true path relative to frame 0 (F, 4, 4)): preset `cam_type` over its whole motion at F
    latent frames (the clip frames 0, 4, ... of a 4F-3 frame clip)."""
    key = (cam_type, frames, seed)
    if key not in _CLIPS:
        path = preset_path(cam_type, 4 * frames - 3)[::4]
        scene = room3d.make_scene(seed)
        _CLIPS[key] = (room3d.render_clip(scene, room3d.source_pose(scene) @ path, K, H, W), path)
    return _CLIPS[key]


def rot_deg(est, true):
    return np.degrees(rotation_angle(est[:, :3, :3], true[:, :3, :3]))


def test_pure_rotation_is_a_rotation_without_translation():
    for cam in (1, 4):  # pan right 19.9 deg, tilt down 9.9 deg
        frames, path = clip(cam)
        est = estimate_two_view(frames, K)
        assert est.shape == (6, 4, 4) and est.dtype == np.float64
        np.testing.assert_array_equal(est[0], np.eye(4))
        assert np.isfinite(est).all()
        assert rot_deg(est, path).max() < 0.5
        # read as a rotation: no translation at all, not a noisy one along a made-up epipole
        assert np.abs(est[:, :3, 3]).max() < 1e-9
        # and the rotation is the requested one, not just close to identity (19.9 / 9.9 deg at the end)
        assert np.degrees(rotation_angle(est[-1, :3, :3], np.eye(3))) > 9.0


def test_translation_direction_and_rotation_of_an_arc():
    frames, path = clip(9)  # arc left: 29.8 deg of yaw while moving (-1.99, 0, 0.53) m
    est = estimate_two_view(frames, K)
    assert np.isfinite(est).all()
    assert rot_deg(est, path).max() < 1.0
    dirs = np.degrees(vector_angle(est[1:, :3, 3], path[1:, :3, 3]))
    assert dirs.max() < 5.0, dirs


def test_dolly_scale_is_consistent_across_frames():
    frames, path = clip(5, frames=6)  # zoom in: a 1.99 m dolly along z at constant speed
    est = estimate_two_view(frames, K)
    n_est = np.linalg.norm(est[:, :3, 3], axis=1)
    n_req = np.linalg.norm(path[:, :3, 3], axis=1)
    # normalised magnitudes 0, 0.2, ..., 1 (hand: constant speed over 5 steps)
    np.testing.assert_allclose(n_req / n_req.max(), np.linspace(0, 1, 6), atol=1e-3)
    np.testing.assert_allclose(n_est / n_est.max(), n_req / n_req.max(), atol=0.1)
    assert np.degrees(vector_angle(est[-1, :3, 3], np.array([0.0, 0.0, 1.0]))) < 3.0  # forward, not backward
    m = camera_metrics(est, path)
    assert m["failed_fraction"] == 0.0 and m["TransErr"] < 0.3


def test_downscaling_keeps_the_intrinsics_consistent():
    frames, path = clip(10)  # arc right, estimated on frames downscaled to 320 wide (K scaled with them)
    est = estimate_two_view(frames, K, max_side=320)
    assert np.isfinite(est).all()
    assert rot_deg(est, path).max() < 1.0
    assert np.degrees(vector_angle(est[-1, :3, 3], path[-1, :3, 3])) < 5.0


def test_torch_input_and_determinism():
    frames, _ = clip(7)
    a = estimate_two_view(frames, K)
    b = estimate_two_view(torch.from_numpy(frames), torch.from_numpy(K))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["black", "noise", "tiny", "nan", "one_frame"])
def test_unmeasurable_clips_give_nan_rows(kind):
    rng = np.random.default_rng(0)
    k, n = K, 5
    if kind == "black":
        frames = np.zeros((n, 3, H, W), np.float32)
    elif kind == "noise":
        frames = rng.random((n, 3, H, W)).astype(np.float32)
    elif kind == "tiny":
        frames, k = rng.random((n, 3, 32, 48)).astype(np.float32), room3d.intrinsics(32, 48)
    elif kind == "nan":
        frames = np.full((n, 3, H, W), np.nan, np.float32)
    else:
        frames, n = clip(1)[0][:1], 1
    est = estimate_two_view(frames, k)
    assert est.shape == (n, 4, 4)
    np.testing.assert_array_equal(est[0], np.eye(4))
    assert np.isnan(est[1:]).all()


def test_bad_shapes_are_one_config_error():
    with pytest.raises(ConfigError, match=r"\(F, 3, H, W\)"):
        estimate_two_view(np.zeros((3, H, W)), K)
    with pytest.raises(ConfigError, match="K must be"):
        estimate_two_view(np.zeros((2, 3, H, W)), np.eye(2))


def _factory(scale=1.0):
    """A plug-in factory (the dotted path's attribute with kwargs): an estimator returning identity * scale."""
    def estimate(frames, K):
        out = np.tile(np.eye(4), (len(frames), 1, 1))
        out[:, :3, 3] = scale
        return out
    return estimate


NOT_CALLABLE = 3


def test_loader_names_paths_callables_and_errors():
    assert load_pose_estimator("two_view") is estimate_two_view
    assert set(POSE_ESTIMATORS) == {"two_view", "glomap"}
    frames, path = clip(1)
    part = load_pose_estimator("two_view", {"max_side": 320})
    assert rot_deg(part(frames, K), path).max() < 0.5
    mod = __name__  # this test module, importable by its own name
    est = load_pose_estimator(f"{mod}:_factory", {"scale": 2.0})
    assert est(frames, K)[3, 0, 3] == 2.0
    fn = _factory()
    assert load_pose_estimator(fn) is fn
    assert load_pose_estimator(_factory, {"scale": 3.0})(frames, K)[0, 1, 3] == 3.0
    for spec, kw, msg in [("nope", None, "use one of"), ("no_such_module_x:f", None, "cannot import"),
                          (f"{mod}:missing", None, "has no 'missing'"), (f"{mod}:NOT_CALLABLE", None, "not callable"),
                          ("two_view", {"bogus": 1}, "bogus"), (42, None, "use one of")]:
        with pytest.raises(ConfigError, match=msg) as e:
            load_pose_estimator(spec, kw)
        assert "\n" not in str(e.value)


def test_glomap_agrees_with_the_truth():
    pytest.importorskip("pycolmap")
    frames, path = clip(9, frames=6)
    est = load_pose_estimator("glomap")(frames, K)
    ok = np.isfinite(est).all(axis=(1, 2))
    assert ok[0] and ok.sum() >= 5
    np.testing.assert_allclose(est[0], np.eye(4), atol=1e-9)
    assert rot_deg(est[ok], path[ok]).max() < 1.0
    dirs = np.degrees(vector_angle(est[ok][1:, :3, 3], path[ok][1:, :3, 3]))
    assert dirs.max() < 5.0, dirs


def test_glomap_without_pycolmap_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pycolmap", None)  # import pycolmap raises ImportError
    with pytest.raises(ConfigError, match="pip install pycolmap"):
        load_pose_estimator("glomap")(np.zeros((2, 3, 32, 32), np.float32), K)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))

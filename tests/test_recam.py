"""recam: the camera world, its condition dataset and the cam_score reward."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddpo_grpo.worlds.recam.cam_score import estimate_moments, foreground_moments, make_cam_score
from ddpo_grpo.worlds.recam.data import NUM_EVAL, NUM_TRAIN, RecamConditions
from ddpo_grpo.worlds.recam.world import (
    Camera, CameraMotion, RecamCondition, Scene, WorldObject, camera_planes, make_condition,
    render_world, sample_training_batch,
)
from ddpo_grpo.rewards import ConfigError, RewardComputer, available_rewards, get_reward_fn


def metadata_of(conds):
    return [{"source": c.source_view(), "camera": c.motion.as_tuple()} for c in conds]


def square_condition(motion: CameraMotion) -> RecamCondition:
    """One red square of radius 4 at the centre of a zoom-1 source view."""
    scene = Scene((WorldObject("red", "square", 32.0, 32.0, 4.0),))
    return RecamCondition(scene, Camera(32.0, 32.0, 1.0), motion)


@pytest.fixture(scope="module")
def triples():
    return [make_condition(i, seed=123) for i in range(60)]


# ----------------------------------------------------------------------------- world
def test_world_is_deterministic_and_seeded():
    a, b = make_condition(7), make_condition(7)
    assert a == b
    np.testing.assert_array_equal(a.source_view(), b.source_view())
    np.testing.assert_array_equal(a.target_view(), b.target_view())
    assert make_condition(7, seed=1) != a
    assert make_condition(8) != a
    v = a.target_view()
    assert v.shape == (3, 32, 32) and v.dtype == np.float32 and 0 <= v.min() and v.max() <= 1
    assert render_world(a.scene).shape == (3, 64, 64)


def test_motions_and_objects_in_range(triples):
    for c in triples:
        m = c.motion
        assert m.dx == int(m.dx) and m.dy == int(m.dy) and abs(m.dx) <= 6 and abs(m.dy) <= 6
        assert 0.8 <= m.zoom <= 1.25 and round(m.zoom, 2) == m.zoom
        assert math.hypot(m.dx, m.dy) >= 2.5 or abs(math.log(m.zoom)) >= 0.1  # never near identity
        assert 1 <= len(c.scene.objects) <= 2
        for view in (c.source_view(), c.target_view()):  # everything fully in view, 1 px margin
            assert view.max() > 0.9
            border = np.concatenate([view[:, 0], view[:, -1], view[:, :, 0], view[:, :, -1]], axis=1)
            assert border.max() == 0
    assert c.prompt() == f"pan ({int(c.motion.dx):+d},{int(c.motion.dy):+d}) zoom {c.motion.zoom:.2f}"


def test_render_view_camera_geometry():
    c = square_condition(CameraMotion(3, -2, 1.0))
    src, tgt = c.source_view(), c.target_view()
    # source: square [12, 20) x [12, 20); panning right by 3 and down by -2 moves it left 3 and down 2
    assert src[0, 12:20, 12:20].min() == 1 and src.sum() == 64
    assert tgt[0, 14:22, 9:17].min() == 1 and tgt.sum() == 64
    z = square_condition(CameraMotion(0, 0, 1.25)).target_view()  # zoom in: radius 4 -> 5
    assert z[0, 11:21, 11:21].min() == 1 and z.sum() == 100


def test_training_batch():
    cond, x0, conds = sample_training_batch(3, np.random.default_rng(0))
    assert cond.shape == (3, 6, 32, 32) and x0.shape == (3, 3, 32, 32)
    assert cond.dtype == np.float32 and x0.min() >= -1 and x0.max() <= 1
    np.testing.assert_allclose(cond[1, :3], conds[1].source_view() * 2 - 1)
    np.testing.assert_allclose(x0[1], conds[1].target_view() * 2 - 1)
    np.testing.assert_allclose(cond[1, 3:], camera_planes(conds[1].motion))


# ----------------------------------------------------------------------------- dataset
def test_conditions_items():
    ds = RecamConditions("train")
    assert len(ds) == NUM_TRAIN == 512
    it = ds[5]
    assert set(it) == {"index", "prompt", "cond_image", "source", "camera", "target"}
    assert it["index"] == 5 and isinstance(it["prompt"], str) and it["prompt"].startswith("pan (")
    ci = it["cond_image"]
    assert isinstance(ci, torch.Tensor) and ci.dtype == torch.float32 and ci.shape == (6, 32, 32)
    assert it["source"].shape == (3, 32, 32) and it["source"].dtype == np.float32
    torch.testing.assert_close(ci[:3], torch.from_numpy(it["source"]) * 2 - 1)
    dx, dy, zoom = it["camera"]
    for ch, val in zip(ci[3:], (dx / 8, dy / 8, 4 * math.log(zoom))):
        assert torch.allclose(ch, torch.full_like(ch, val))
    assert ci.abs().max() <= 1.0
    assert it["prompt"] == make_condition(5).prompt()


def test_dataset_indices_stable_and_splits_disjoint():
    tr, ev = RecamConditions("train"), RecamConditions("eval")
    assert len(ev) == NUM_EVAL
    assert [ev[i]["index"] for i in (0, len(ev) - 1)] == [512, 575]
    assert set(tr.indices).isdisjoint(ev.indices)
    # golden values: a change here silently changes every GRPO group key -> condition mapping
    assert [tr[i]["prompt"] for i in range(3)] == [make_condition(i).prompt() for i in range(3)]
    assert tr[0]["prompt"] == "pan (-2,-6) zoom 0.81" and tr[1]["prompt"] == "pan (-3,+4) zoom 1.23"
    again = RecamConditions("train")[1]
    np.testing.assert_array_equal(again["source"], tr[1]["source"])
    assert again["camera"] == tr[1]["camera"]
    with pytest.raises(ValueError):
        RecamConditions("test")
    with pytest.raises(IndexError):
        tr[512]


# ----------------------------------------------------------------------------- cam_score
def test_registered():
    assert {"cam_score", "unifiedscore"} <= set(available_rewards())


def test_cam_score_ground_truth_accuracy(triples):
    fn = get_reward_fn("cam_score")
    images = torch.from_numpy(np.stack([c.target_view() for c in triples]))
    scores, det = fn(images, [c.prompt() for c in triples], metadata_of(triples))
    assert scores.shape == (len(triples),) and scores.dtype == np.float32
    assert det["cam_score_accuracy"].mean() >= 0.95
    assert np.all(det["translation_error"] < 1.0) and np.all(det["zoom_error"] < 0.05)
    assert scores.mean() > 0.85 and scores.min() > 0.5 and scores.max() <= 1
    assert det["estimate_failed"].sum() == 0


def test_cam_score_source_and_noise_score_low(triples):
    fn = get_reward_fn("cam_score")
    meta = metadata_of(triples)
    sources = torch.from_numpy(np.stack([m["source"] for m in meta]))
    s_src, d_src = fn(sources, None, meta)  # the unmoved source view is not the requested view
    assert d_src["cam_score_accuracy"].sum() == 0 and s_src.mean() < 0.2 and s_src.max() < 0.5
    noise = torch.rand((len(triples), 3, 32, 32), generator=torch.Generator().manual_seed(0))
    s_noise, d_noise = fn(noise, None, meta)
    assert d_noise["cam_score_accuracy"].sum() == 0 and s_noise.max() < 0.1


def test_cam_score_pure_translation_by_hand():
    # Requested: pan (3, -2), zoom 1. Generated: the square panned by (4, -2), i.e. 1 px too far right.
    req = square_condition(CameraMotion(3, -2, 1.0))
    gen = square_condition(CameraMotion(4, -2, 1.0)).target_view()
    # By hand: source square [12,20)^2 has centroid (16, 16); the generated one sits at [12,20) - (4, -2), so
    # its centroid is (12, 18); the radius of gyration of an 8 px square is sqrt(2 * 8^2 / 12) in both.
    m_src, m_gen = foreground_moments(req.source_view()), foreground_moments(gen)
    assert m_src == pytest.approx((64.0, 16.0, 16.0, math.sqrt(128 / 12)))
    assert m_gen == pytest.approx((64.0, 12.0, 18.0, math.sqrt(128 / 12)))
    assert estimate_moments(req.source_view(), gen) == pytest.approx((4.0, -2.0, 1.0))
    fn = make_cam_score()
    meta = [{"source": req.source_view(), "camera": (3, -2, 1.0)}] * 3
    imgs = np.stack([gen, req.target_view(), square_condition(CameraMotion(3, 0, 1.0)).target_view()])
    scores, det = fn(torch.from_numpy(imgs), None, meta)
    np.testing.assert_allclose(det["translation_error"], [1.0, 0.0, 2.0], atol=1e-5)
    np.testing.assert_allclose(det["zoom_error"], [0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(scores, [math.exp(-1 / 2), 1.0, math.exp(-2 / 2)], rtol=1e-5)
    np.testing.assert_array_equal(det["cam_score_accuracy"], [1, 1, 0])  # < 1.5 px counts as accurate


def test_cam_score_pure_zoom_by_hand():
    req = square_condition(CameraMotion(0, 0, 1.25))
    assert estimate_moments(req.source_view(), req.target_view()) == pytest.approx((0.0, 0.0, 1.25))
    fn = make_cam_score(tau_zoom=0.1)
    off = square_condition(CameraMotion(0, 0, 1.0)).target_view()  # generator forgot to zoom
    scores, det = fn(torch.from_numpy(off[None]), None, [{"source": req.source_view(), "camera": (0, 0, 1.25)}])
    assert det["zoom_error"][0] == pytest.approx(math.log(1.25), abs=1e-6)
    assert scores[0] == pytest.approx(math.exp(-math.log(1.25) / 0.1), rel=1e-5)
    assert det["cam_score_accuracy"][0] == 0


def test_cam_score_degenerate_images():
    c = square_condition(CameraMotion(3, -2, 1.0))
    meta = [{"source": c.source_view(), "camera": (3, -2, 1.0)}] * 2
    imgs = torch.zeros(2, 3, 32, 32)
    imgs[1, 0, 0, 0] = float("nan")
    scores, det = make_cam_score()(imgs, None, meta)
    assert scores[0] == 0 and det["estimate_failed"][0] == 1 and np.isnan(det["translation_error"][0])
    assert np.isnan(scores[1]) and det["estimate_failed"][1] == 0  # non-finite pixels: invalid, not 0
    with pytest.raises(ValueError, match="camera"):
        make_cam_score()(imgs, None, [{"source": c.source_view()}] * 2)


def test_cam_score_pluggable_estimators():
    c = square_condition(CameraMotion(3, -2, 1.0))
    meta = [{"source": c.source_view(), "camera": (3, -2, 1.0)}]
    img = torch.from_numpy(c.target_view()[None])
    s, _ = get_reward_fn("cam_score", estimator="ddpo_grpo.worlds.recam.cam_score:estimate_moments")(img, None, meta)
    assert s[0] == pytest.approx(1.0, abs=1e-5)
    s, det = make_cam_score(estimator=lambda src, tgt: (3.0, 0.0, 1.0))(img, None, meta)
    assert det["translation_error"][0] == pytest.approx(2.0) and s[0] == pytest.approx(math.exp(-1))

    def batched(src, tgt):
        assert src.shape == tgt.shape == (1, 3, 32, 32)
        return np.array([[3.0, -2.0, 1.1]])
    batched.batched = True
    _, det = make_cam_score(estimator=batched)(img, None, meta)
    assert det["zoom_error"][0] == pytest.approx(math.log(1.1), rel=1e-5)
    with pytest.raises(ConfigError):
        get_reward_fn("cam_score", estimator="ddpo_grpo.worlds.recam.cam_score:no_such_fn")
    with pytest.raises(ConfigError):
        get_reward_fn("cam_score", estimator="nonsense")


def test_cam_score_through_reward_computer_with_dataset_items():
    ds = RecamConditions("eval")
    items = [ds[i] for i in range(4)]
    meta = [{k: v for k, v in it.items() if k != "cond_image"} for it in items]  # as the trainer strips it
    images = torch.from_numpy(np.stack([it["target"] for it in items]))
    res = RewardComputer({"cam_score": 1.0})(images, [it["prompt"] for it in items], meta)
    assert res.valid.all() and res.final.min() > 0.5
    assert res.details["cam_score/cam_score_accuracy"].mean() == 1.0


def test_follow_stats_recovers_a_known_bias():
    from ddpo_grpo.worlds.recam.follow import follow_stats, reward_spread

    rng = np.random.default_rng(0)
    req = np.stack([rng.integers(-6, 7, 200), rng.integers(-6, 7, 200), np.exp(rng.uniform(-0.2, 0.2, 200))], 1)
    est = np.stack([0.5 * req[:, 0] + 1.0, req[:, 1] + rng.normal(0, 0.3, 200), req[:, 2] ** 0.8], 1).astype(float)
    est[3] = np.nan  # an estimator failure is skipped
    s = follow_stats(est, req)
    assert s["measured"] == pytest.approx(199 / 200)
    assert s["dx_slope"] == pytest.approx(0.5) and s["dx_offset"] == pytest.approx(1.0) and s["dx_resid_std"] < 1e-9
    assert s["dy_slope"] == pytest.approx(1.0, abs=0.03) and s["dy_resid_std"] == pytest.approx(0.3, abs=0.04)
    assert s["log_zoom_slope"] == pytest.approx(0.8) and abs(s["log_zoom_offset"]) < 1e-9
    g = reward_spread(np.array([0.0, 1.0, 0.5, 0.5]), [7, 7, 9, 9])
    assert g == {"within_group_std": 0.25, "between_condition_std": 0.0, "group_max_mean": 0.75}
    with pytest.raises(ValueError, match="3 measured"):
        follow_stats(np.full((4, 3), np.nan), req[:4])


def test_ground_truth_views_follow_the_camera_exactly(triples):
    from ddpo_grpo.worlds.recam.follow import follow_stats

    est = np.array([estimate_moments(c.source_view(), c.target_view()) for c in triples])
    s = follow_stats(est, np.array([c.motion.as_tuple() for c in triples]))
    for name in ("dx", "dy", "log_zoom"):
        assert s[f"{name}_slope"] == pytest.approx(1.0, abs=0.02)
    assert s["dx_resid_std"] < 0.2 and s["dy_resid_std"] < 0.2 and s["log_zoom_resid_std"] < 0.02


def test_recam_follow_script_runs_on_the_bundled_model(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "f.json"
    p = subprocess.run([sys.executable, "benchmarks/recam_follow.py", "--conditions", "6", "--copies", "2", "--steps", "3",
                        "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["conditions"] == 6 and r["copies"] == 2 and 0.0 <= r["cam_score"] <= 1.0
    assert {"dx_slope", "dy_slope", "log_zoom_slope", "within_group_std"} <= set(r)

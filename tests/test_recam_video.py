"""recam on video: the video camera world, its condition dataset, and cam_score / unifiedscore on clips."""
from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_grpo.rewards import ConfigError, RewardComputer, get_reward_fn
from ddpo_grpo.worlds.recam.cam_score import estimate_moments, make_cam_score
from ddpo_grpo.worlds.recam.unifiedscore import frame_indices, make_unifiedscore, tile_frames
from ddpo_grpo.worlds.recam.video import (
    DEPTH, FOCAL, PRESET_NAMES, camera_numbers, clip_times, make_video_condition, motion_at, motion_from_numbers,
    pose_from_motion, preset_camera_numbers, preset_end_motion, sample_training_clip, sample_video_condition,
    trajectory,
)
from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions
from ddpo_grpo.worlds.recam.world import MAX_PAN, ZOOM_RANGE, CameraMotion

from test_unifiedscore import server, url  # noqa: F401  (the fake scoring server fixture)

F, S = 9, 64


@pytest.fixture(scope="module")
def eval_items():
    ds = RecamVideoConditions("eval")
    return [ds[i] for i in range(10)]


def meta_of(items):
    return [{k: v for k, v in it.items() if k != "target_video"} for it in items]


# ----------------------------------------------------------------------------- camera numbers
def test_camera_numbers_round_trip_and_layout():
    for m in (CameraMotion(3, -2, 1.1), CameraMotion(-6, 0, 0.8), CameraMotion(0.25, 5.5, 1.25)):
        back = motion_from_numbers(pose_from_motion(m).reshape(12))  # float64 all the way: exact inverse
        assert back.as_tuple() == pytest.approx(m.as_tuple(), abs=1e-12)
    # the pinhole constants: 8 view units of pan = 1 scene unit of translation; zoom 1.25 = 0.8 forward
    assert (DEPTH, FOCAL) == (4.0, 32.0)
    np.testing.assert_allclose(pose_from_motion(CameraMotion(8, -4, 1.25))[:, 3], [1.0, -0.5, 0.8])
    end = CameraMotion(-5, 2, 0.9)
    traj = trajectory(end, 17)
    cams = camera_numbers(traj, 17)
    assert cams.shape == (5, 12) and cams.dtype == np.float32
    np.testing.assert_array_equal(cams[0], np.eye(4)[:3].reshape(12))  # frame 0 is [I | 0]
    for j in range(5):  # latent frame j <-> pixel frame 4j
        assert cams[j].reshape(3, 4)[:, :3].tolist() == np.eye(3).tolist()
        assert motion_from_numbers(cams[j]).as_tuple() == pytest.approx(traj[4 * j].as_tuple(), abs=1e-5)
    assert motion_from_numbers(cams[-1]).as_tuple() == pytest.approx((-5, 2, 0.9), abs=1e-5)
    assert motion_from_numbers(cams[2]).as_tuple() == pytest.approx((-2.5, 1.0, 0.9 ** 0.5), abs=1e-6)
    with pytest.raises(ValueError):
        camera_numbers(traj, 9)  # 17 motions for 9 frames
    with pytest.raises(ValueError):
        camera_numbers(traj[:8], 8)  # not 1 + 4k
    rotated = np.eye(4)[:3].copy()
    rotated[:2, :2] = [[0, -1], [1, 0]]
    with pytest.raises(ValueError, match="rotation"):
        motion_from_numbers(rotated.reshape(12))


def test_preset_camera_numbers_by_name():
    cams = preset_camera_numbers("pan left", 9)
    assert cams.shape == (3, 12)
    np.testing.assert_allclose(cams[:, 3], [0, -0.3125, -0.625])  # camera moves left (-x): 5 view units at the end
    np.testing.assert_allclose(preset_camera_numbers("zoom in", 5)[-1, 11], 4 * (1 - math.exp(-0.15)), rtol=1e-6)
    assert preset_end_motion("tilt up").as_tuple() == (0.0, -5.0, 1.0)
    with pytest.raises(ConfigError, match="pan left"):
        preset_camera_numbers("dolly sideways", 9)


def test_trajectory_ramps_linearly_in_log_zoom():
    end = CameraMotion(4, -6, 1.21)
    traj = trajectory(end, 5)
    assert traj[0].as_tuple() == (0.0, 0.0, 1.0) and traj[-1].as_tuple() == pytest.approx((4, -6, 1.21))
    assert traj[2].as_tuple() == pytest.approx((2, -3, 1.1))
    np.testing.assert_allclose(clip_times(9), np.arange(9) / 8)


# ----------------------------------------------------------------------------- world
def test_conditions_are_seeded_and_in_range():
    a, b = make_video_condition(7), make_video_condition(7)
    assert a == b and make_video_condition(7, seed=1) != a and make_video_condition(8) != a
    np.testing.assert_array_equal(a.target_video(5, 32), b.target_video(5, 32))
    rng = np.random.default_rng(3)
    conds = [sample_video_condition(rng) for _ in range(60)]
    assert set(c.preset for c in conds) == set(PRESET_NAMES)
    for c in conds:
        m = c.end_motion
        assert abs(m.dx) <= MAX_PAN and abs(m.dy) <= MAX_PAN and ZOOM_RANGE[0] <= m.zoom <= ZOOM_RANGE[1]
        assert math.hypot(m.dx, m.dy) >= 3 or abs(math.log(m.zoom)) >= 0.1
        assert all(math.hypot(*d) <= 2.0 for d in c.drifts)
        words = " and ".join(f"a {o.color} {o.shape}" for o in c.scene.objects)
        assert c.prompt() == f"{words}, camera {c.preset}"
    for c in conds[:6]:  # every object fully in every view: nothing on the border, at any frame
        for clip in (c.source_video(F, S), c.target_video(F, S)):
            assert clip.shape == (F, 3, S, S) and clip.dtype == np.float32
            border = np.concatenate([clip[..., 0, :], clip[..., -1, :], clip[..., :, 0], clip[..., :, -1]], -1)
            assert border.max() == 0 and clip.max(axis=(1, 2, 3)).min() > 0.9
        assert c.motions(F)[0].tolist() == [0, 0, 1]


def test_preset_sign_conventions_on_ground_truth():
    """'pan right' turns the camera right: content moves left, estimated dx > 0 (world.py's convention); 'tilt up':
    content moves down, dy < 0; 'zoom in': zoom > 1; arc/translate carry their slight zooms."""
    rng = np.random.default_rng(11)
    for preset, check in [("pan right", lambda e: e[0] > 2.5 and abs(e[1]) < 0.5 and abs(e[2] - 1) < 0.02),
                          ("pan left", lambda e: e[0] < -2.5),
                          ("tilt up", lambda e: e[1] < -2.5 and abs(e[0]) < 0.5),
                          ("tilt down", lambda e: e[1] > 2.5),
                          ("zoom in", lambda e: e[2] > 1.08 and math.hypot(e[0], e[1]) < 0.5),
                          ("zoom out", lambda e: e[2] < 0.93),
                          ("translate up", lambda e: e[1] < -2.5 and e[2] == pytest.approx(1.05, abs=0.02)),
                          ("arc right", lambda e: e[0] > 2.5 and e[2] == pytest.approx(0.95, abs=0.02))]:
        c = sample_video_condition(rng, preset=preset, max_drift=0.0)
        src, tgt = c.source_video(5, 32), c.target_video(5, 32)
        e = estimate_moments(src[-1], tgt[-1])  # 32-px views: estimates are in view units directly
        assert check(e), (preset, e, c.end_motion)
        assert e == pytest.approx(c.end_motion.as_tuple(), abs=0.3)
        if preset == "pan right":  # the camera moves right: +x translation in the camera numbers
            assert c.cameras(5)[-1][3] > 0


def test_training_clip():
    src, tgt, cams = sample_training_clip(np.random.default_rng(0), 5, 32)
    assert src.shape == tgt.shape == (5, 3, 32, 32) and cams.shape == (2, 12)
    c = sample_video_condition(np.random.default_rng(0))
    np.testing.assert_array_equal(src, c.source_video(5, 32))
    np.testing.assert_array_equal(cams, c.cameras(5))


# ----------------------------------------------------------------------------- dataset
def test_dataset_items_splits_and_determinism(eval_items):
    it = eval_items[0]
    assert set(it) == {"index", "prompt", "source_video", "cameras", "motions", "target_video", "preset"}
    assert it["index"] == 512 and it["prompt"].endswith("camera " + it["preset"])
    sv, cams = it["source_video"], it["cameras"]
    assert isinstance(sv, torch.Tensor) and sv.dtype == torch.float32 and sv.shape == (F, 3, S, S)
    assert isinstance(cams, torch.Tensor) and cams.dtype == torch.float32 and cams.shape == (3, 12)
    assert it["motions"].shape == (F, 3) and it["motions"].dtype == np.float32
    assert it["target_video"].shape == (F, 3, S, S) and it["target_video"].dtype == np.float32
    assert 0 <= sv.min() and sv.max() <= 1
    np.testing.assert_array_equal(sv[0].numpy(), it["target_video"][0])  # frame 0: target camera = source camera
    np.testing.assert_allclose(cams[1].numpy(), camera_numbers([motion_at(make_video_condition(512).end_motion, a)
                                                                for a in clip_times(F)], F)[1])
    tr, ev = RecamVideoConditions("train"), RecamVideoConditions("eval", num_frames=5, size=32)
    assert len(tr) == 512 and len(ev) == 64 and set(tr.indices).isdisjoint(ev.indices)
    assert ev[-1]["index"] == 575 and ev[0]["prompt"] == it["prompt"]  # same condition at any F and S
    assert ev[0]["source_video"].shape == (5, 3, 32, 32) and ev[0]["cameras"].shape == (2, 12)
    assert tr[3]["prompt"] == make_video_condition(3).prompt()
    assert RecamVideoConditions("train", seed=1).condition(3) != tr.condition(3)
    with pytest.raises(ValueError):
        RecamVideoConditions("test")
    with pytest.raises(ValueError):
        RecamVideoConditions("eval", num_frames=8)
    with pytest.raises(IndexError):
        ev[64]


def test_build_dataset_recam_video():
    from config.base import get_config
    from ddpo_grpo.trainer.run.data import build_dataset

    config = get_config()
    config.data.name = "recam_video"
    ds = build_dataset(config, "eval")
    assert isinstance(ds, RecamVideoConditions) and (ds.num_frames, ds.size, len(ds)) == (9, 64, 64)
    config.pretrained.num_frames, config.pretrained.resolution, config.data.num_conditions = 5, 32, 4
    train = build_dataset(config, "train")
    assert len(train) == 4 and train[0]["source_video"].shape == (5, 3, 32, 32)


def test_recam_video_non_square_views_for_a_non_square_model():
    """pretrained.height x width (recam's 480 x 832 at toy size: 32 x 48, and 48 x 32): the clips have the model's
    shape, the central square is the square view's pixels (32 view units across the shorter side, centred, the rest
    of the wider side sees further out: black here, every object stays in frame), the camera numbers do not
    change, and cam_score reads the ground truth as the square view's (32 / min(H, W) px per view unit)."""
    from config.base import get_config
    from ddpo_grpo.trainer.run.data import build_dataset

    config = get_config()
    config.data.name, config.data.num_conditions = "recam_video", 4
    config.pretrained.num_frames, config.pretrained.resolution = 5, 32
    square = build_dataset(config, "eval")
    fn = make_cam_score()
    for h, w in ((32, 48), (48, 32)):
        config.pretrained.height, config.pretrained.width = h, w
        ds = build_dataset(config, "eval")
        for i in range(4):
            it, sq = ds[i], square[i]
            assert it["source_video"].shape == (5, 3, h, w) and it["target_video"].shape == (5, 3, h, w)
            oy, ox = (h - 32) // 2, (w - 32) // 2
            for key in ("source_video", "target_video"):  # exact: the same sub-pixel grid, offset by whole px
                full = np.asarray(it[key])
                np.testing.assert_array_equal(full[..., oy:oy + 32, ox:ox + 32], np.asarray(sq[key]))
                outside = full.copy()
                outside[..., oy:oy + 32, ox:ox + 32] = 0
                assert outside.max() == 0  # black beyond: nothing of the square view was cut off
            np.testing.assert_array_equal(it["cameras"], sq["cameras"])
        gt = torch.from_numpy(np.stack([ds[i]["target_video"] for i in range(4)]))
        wide, _ = fn(gt, None, meta_of([ds[i] for i in range(4)]))
        narrow, _ = fn(torch.from_numpy(np.stack([square[i]["target_video"] for i in range(4)])), None,
                       meta_of([square[i] for i in range(4)]))
        np.testing.assert_allclose(wide, narrow, atol=1e-5)  # same view units: same scores as the square view
        assert wide.min() > 0.7


# ----------------------------------------------------------------------------- cam_score on video
def test_cam_score_video_ground_truth_and_source(eval_items):
    fn = get_reward_fn("cam_score")
    meta = meta_of(eval_items)
    gt = torch.from_numpy(np.stack([it["target_video"] for it in eval_items]))
    scores, det = fn(gt, [it["prompt"] for it in eval_items], meta)
    assert scores.shape == (10,) and scores.dtype == np.float32
    assert scores.mean() >= 0.9 and scores.min() > 0.7, scores
    assert det["estimate_failed"].sum() == 0 and det["cam_score_accuracy"].mean() >= 0.95
    assert np.all(det["translation_error"] < 0.5) and np.all(det["zoom_error"] < 0.03)
    frames = np.stack([det[f"cam_score_frame{k:02d}"] for k in range(F)], 1)
    np.testing.assert_allclose(frames.mean(1), scores, rtol=1e-5)
    assert frames[:, 0].min() > 0.95  # frame 0 (identity) counts
    src = torch.stack([it["source_video"] for it in eval_items])  # a copy of the source clip: no camera motion
    s_src, d_src = fn(src, None, meta)
    assert s_src.mean() < 0.5 and np.all(s_src < scores - 0.2), (s_src, scores)
    assert d_src["cam_score_frame08"].max() < 0.3  # the last frame asks for the full end motion
    assert np.all(d_src["cam_score_frame00"] == 1.0)  # ... the first frame for none


def test_cam_score_video_scales_estimates_to_view_units():
    # the same condition at 32 and 64 px scores (almost) the same: estimates are in 32-unit view coordinates
    c = sample_video_condition(np.random.default_rng(5), preset="pan right", max_drift=0.0)
    fn = make_cam_score()
    out = {}
    for size in (32, 64):
        src, tgt = c.source_video(5, size), c.target_video(5, size)
        gen = np.roll(tgt, size // 32, axis=-1)  # one view unit too far right: translation error 1 view unit
        meta = [{"source_video": src, "motions": c.motions(5)}]
        out[size] = fn(torch.from_numpy(gen[None]), None, meta)
    for size in (32, 64):
        s, det = out[size]
        assert det["translation_error"][0] == pytest.approx(1.0, abs=0.05), size
        assert s[0] == pytest.approx(math.exp(-1 / 2), abs=0.03)


def test_cam_score_video_non_finite_clip_is_nan(eval_items):
    meta = meta_of(eval_items[:2])
    clips = torch.from_numpy(np.stack([it["target_video"] for it in eval_items[:2]]))
    clips[1, 4, 0, 10, 10] = float("inf")
    scores, det = make_cam_score()(clips, None, meta)
    assert scores[0] > 0.8 and np.isnan(scores[1]) and det["estimate_failed"][1] == 0
    assert np.isnan(det["cam_score_frame00"][1]) and np.isnan(det["translation_error"][1])
    black = torch.zeros_like(clips)  # nothing measurable: a legitimate bad sample, 0
    scores, det = make_cam_score()(black, None, meta)
    assert scores.tolist() == [0.0, 0.0] and det["estimate_failed"].tolist() == [1.0, 1.0]
    assert np.isnan(det["translation_error"]).all()
    res = RewardComputer({"cam_score": 1.0})(clips, None, meta)  # the registry hands clips over whole
    assert res.valid.tolist() == [True, False] and res.details["cam_score/cam_score_frame08"].shape == (2,)
    with pytest.raises(ValueError, match="cameras"):  # no 2-D motions: a real clip, read in 3-D (pose_reward)
        make_cam_score()(clips, None, [{"source_video": m["source_video"]} for m in meta])


# ----------------------------------------------------------------------------- unifiedscore on video
def test_unifiedscore_video_one_request_per_clip(server):  # noqa: F811
    assert frame_indices(9, 4) == [0, 3, 5, 8] and frame_indices(3, 4) == [0, 1, 2]
    fn = get_reward_fn("unifiedscore", base_url=url(server), timeout=5, retries=0)
    clips = torch.rand((3, F, 3, 16, 16), generator=torch.Generator().manual_seed(0))
    clips[2, 1, 0, 0, 0] = float("nan")
    prompts = ["good a red circle, camera pan left", "garbage x", "good never sent"]
    scores, det = fn(clips, prompts, [{}] * 3)
    assert scores[0] == pytest.approx(0.8) and np.isnan(scores[1]) and np.isnan(scores[2])
    assert det["unifiedscore_failed"].tolist() == [0, 1, 1]
    assert len(server.requests) == 2  # one per finite clip, not one per frame
    body = next(b for _, _, b in server.requests if "pan left" in str(b))
    parts = body["messages"][0]["content"]
    imgs = [p for p in parts if p["type"] == "image_url"]
    text = next(p["text"] for p in parts if p["type"] == "text")
    assert len(imgs) == 1 and "4 frames" in text and prompts[0] in text
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(imgs[0]["image_url"]["url"].split(",", 1)[1]))))
    assert got.shape == (34, 34, 3)  # 2x2 grid of 16 px frames, 2 px apart
    frames = (clips[0, [0, 3, 5, 8]] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(got, tile_frames(frames))
    np.testing.assert_array_equal(got[18:, 18:], frames[3])  # bottom right: the last frame
    assert (got[16:18] == 128).all()

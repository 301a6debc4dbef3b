"""cam_score on real video (worlds/recam/pose_score.py, pose_reward.py): the per-frame score and the papers' metrics
against hand computations, exact 1 for an estimator that returns the true poses, the formula's value for a known
rotation error, failures and invalid clips, the process pool, and the one-line errors."""
import math

import numpy as np
import pytest
import torch

from ddpo_grpo.worlds.recam.cam_score import make_cam_score
from ddpo_grpo.worlds.recam.pose_score import PoseScore, camera_metrics, numbers_to_poses, rotation_angle
from ddpo_grpo.worlds.recam.recammaster_cameras import trajectory_numbers

F, H, W = 9, 16, 24  # 3 latent frames
K4 = (20.0, 20.0, 11.5, 7.5)


def rot(axis, deg):
    a = np.asarray(axis, float) / np.linalg.norm(axis)
    t = math.radians(deg)
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    return np.eye(3) + math.sin(t) * k + (1 - math.cos(t)) * k @ k


def pose(r=np.eye(3), t=(0, 0, 0)):
    p = np.eye(4)
    p[:3, :3], p[:3, 3] = r, t
    return p


def truth(frames, K, metadata):
    """A stub estimator that reads the requested path from the item (what a perfect estimator would return)."""
    p = numbers_to_poses(metadata["cameras"])
    return np.linalg.inv(p[0]) @ p


truth.takes_metadata = True


def test_metrics_and_score_by_hand():
    req = np.stack([pose(), pose(rot([0, 0, 1], 90), (1, 0, 0)), pose(t=(2, 0, 0))])
    est = np.stack([pose(), pose(rot([0, 0, 1], 90), (0, 1, 0)), pose(rot([1, 0, 0], 30), (4, 0, 0))])
    m = camera_metrics(est, req)
    d1 = math.hypot(0.5, 0.25)  # normalised translations: req (.5, 0, 0), est (0, .25, 0)
    assert m["RotErr"] == pytest.approx(math.pi / 6, abs=1e-12)
    assert m["TransErr"] == pytest.approx(d1, abs=1e-12)
    assert m["CamMC"] == pytest.approx(d1 + 2 * math.sqrt(2) * math.sin(math.radians(15)), abs=1e-12)
    assert m["failed_fraction"] == 0.0
    t = PoseScore().frames(est, req)
    np.testing.assert_allclose(t["rot_deg"], [0, 30], atol=1e-9)
    np.testing.assert_allclose(t["dir_deg"], [90, 0], atol=1e-9)
    np.testing.assert_allclose(t["mag"], [0.25, 0], atol=1e-12)
    np.testing.assert_allclose(t["score"], [math.exp(-90 / 20 - 0.25 / 0.5), math.exp(-30 / 10)], rtol=1e-12)
    # the arccos formula's angle, by another route
    r = rot([0.3, -1, 0.2], 17.0)
    assert math.degrees(rotation_angle(np.eye(3), r)) == pytest.approx(17.0, abs=1e-9)
    assert math.degrees(math.acos((np.trace(r) - 1) / 2)) == pytest.approx(17.0, abs=1e-9)


@pytest.mark.parametrize("cam", range(1, 11))
def test_true_poses_score_exactly_one(cam):
    nums = trajectory_numbers(cam, 3)
    fn = make_cam_score(pose_estimator=truth, workers=0)
    clips = torch.rand(2, F, 3, H, W)
    scores, det = fn(clips, ["", ""], [{"cameras": nums, "intrinsics": K4}] * 2)
    assert scores.tolist() == [1.0, 1.0]
    assert det["RotErr"].tolist() == [0.0, 0.0] and det["TransErr"].tolist() == [0.0, 0.0]
    assert det["estimate_failed"].tolist() == [0.0, 0.0] and det["cam_score_accuracy"].tolist() == [1.0, 1.0]
    assert set(k for k in det if k.startswith("cam_score_frame")) == {"cam_score_frame01", "cam_score_frame02"}


@pytest.mark.parametrize("cam", [1, 4, 5, 9])
def test_known_rotation_error_gives_the_formula(cam):
    """Every frame's rotation off by delta (frame 0 the identity): each frame scores exp(-delta / tau_rot)."""
    nums = trajectory_numbers(cam, 5)
    rng = np.random.default_rng(cam)
    delta = 3.5

    def off(frames, K, metadata):
        p = truth(frames, K, metadata)
        for j in range(1, len(p)):
            p[j, :3, :3] = p[j, :3, :3] @ rot(rng.normal(size=3), delta)
        return p

    off.takes_metadata = True
    scores, det = make_cam_score(pose_estimator=off, workers=0)(torch.rand(1, 17, 3, H, W), [""],
                                                                 [{"cameras": nums, "intrinsics": K4}])
    assert scores[0] == pytest.approx(math.exp(-delta / 10.0), rel=1e-5)
    assert det["rot_err_deg"][0] == pytest.approx(delta, rel=1e-5)
    assert det["RotErr"][0] == pytest.approx(4 * math.radians(delta), rel=1e-5)
    assert det["cam_score_accuracy"][0] == 0.0  # 3.5 deg > acc_rot_deg 2


def test_static_and_mirrored_estimates_against_a_pan():
    nums = trajectory_numbers(1, 5)  # pan right, a pure rotation
    req = numbers_to_poses(nums)
    static = np.broadcast_to(np.eye(4), req.shape).copy()
    s = PoseScore()
    angles = np.degrees(rotation_angle(np.eye(3), req[1:, :3, :3]))
    assert s.clip(static, req) == pytest.approx(np.exp(-angles / 10).mean(), rel=1e-9)
    mirror = np.diag([-1.0, 1, 1, 1])
    mirrored = mirror @ req @ mirror
    assert s.clip(mirrored, req) == pytest.approx(np.exp(-2 * angles / 10).mean(), rel=1e-6)
    assert s.clip(mirrored, req) < s.clip(static, req) < 0.5


def test_failed_frames_score_zero_and_invalid_clips_nan():
    nums = trajectory_numbers(7, 3)

    def half(frames, K, metadata):
        p = truth(frames, K, metadata)
        p[2] = np.nan
        return p

    half.takes_metadata = True
    clips = torch.rand(3, F, 3, H, W)
    clips[2, 4, 0, 3, 3] = float("nan")
    scores, det = make_cam_score(pose_estimator=half, workers=0)(clips, [""] * 3, [{"cameras": nums, "intrinsics": K4}] * 3)
    assert scores[:2].tolist() == [0.5, 0.5]  # frame 1 exact (1.0), frame 2 unmeasured (0)
    assert det["estimate_failed"][:2].tolist() == [0.5, 0.5]
    assert np.isnan(scores[2]) and np.isnan(det["cam_score_frame01"][2])
    nothing = lambda frames, K: np.full((len(frames), 4, 4), np.nan)  # noqa: E731
    scores, det = make_cam_score(pose_estimator=nothing, workers=0)(clips[:1], [""], [{"cameras": nums, "intrinsics": K4}])
    assert scores.tolist() == [0.0] and det["estimate_failed"].tolist() == [1.0]


def test_source_frame_term():
    """With source_frame_weight w, frame 0 against the source clip's frame 0 is one more frame of weight w, scored
    against C_0; C_0 = I (an inference reading) has no such term."""
    nums = trajectory_numbers(3, 3).astype(np.float64)
    c0 = pose(rot([0, 1, 0], 20), (1.0, 0, 0.2))
    shifted = np.stack([(c0 @ p)[:3].reshape(12) for p in numbers_to_poses(nums)])

    def est(frames, K, metadata):
        if len(frames) == 2:  # the source / frame-0 pair: off by 5 degrees
            return np.stack([np.eye(4), c0 @ pose(rot([1, 0, 0], 5))])
        return truth(frames, K, metadata)

    est.takes_metadata = True
    item = {"cameras": shifted, "intrinsics": K4, "source_video": torch.rand(F, 3, H, W)}
    scores, det = make_cam_score(pose_estimator=est, workers=0, source_frame_weight=1.0)(torch.rand(1, F, 3, H, W),
                                                                                         [""], [item])
    assert det["source_frame_score"][0] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert scores[0] == pytest.approx((2 + math.exp(-0.5)) / 3, rel=1e-6)
    scores, det = make_cam_score(pose_estimator=est, workers=0)(torch.rand(1, F, 3, H, W), [""], [item])
    assert scores[0] == pytest.approx(1.0) and "source_frame_score" not in det


def test_process_pool_gives_the_same_scores():
    nums = trajectory_numbers(10, 3)
    clips = torch.rand(2, F, 3, H, W)
    meta = [{"cameras": nums, "intrinsics": K4, "target_video": np.zeros((F, 3, H, W))}] * 2
    here = make_cam_score(pose_estimator=truth, workers=0)(clips, ["", ""], meta)
    pool = make_cam_score(pose_estimator=truth, workers=1)(clips, ["", ""], meta)
    np.testing.assert_array_equal(here[0], pool[0])
    assert pool[0].tolist() == [1.0, 1.0]


def test_errors_name_what_is_missing():
    fn = make_cam_score(pose_estimator=truth, workers=0)
    clips = torch.rand(1, F, 3, H, W)
    with pytest.raises(ValueError, match="intrinsics"):
        fn(clips, [""], [{"cameras": trajectory_numbers(1, 3)}])
    with pytest.raises(ValueError, match=r"\(3, 12\)"):
        fn(clips, [""], [{"cameras": np.zeros((4, 12)), "intrinsics": K4}])
    with pytest.raises(ValueError, match="cameras"):
        fn(clips, [""], [{"prompt": "no camera at all"}])
    from ddpo_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="tau_rot"):
        make_cam_score(tau_rot=0)
    with pytest.raises(ConfigError, match="workers"):
        make_cam_score(pose_estimator=truth, workers=-1)(clips, [""], [{"cameras": trajectory_numbers(1, 3),
                                                                        "intrinsics": K4}])

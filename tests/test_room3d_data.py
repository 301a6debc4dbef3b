"""room3d's condition dataset (Room3DConditions): items, the held-out split and data.kinds' training draw."""
import numpy as np
import pytest
import torch

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.recam.recammaster_cameras import CAM_TYPES, trajectory_numbers
from ddpo_grpo.worlds.room3d import Room3DConditions
from ddpo_grpo.worlds.room3d.paths import check_num_frames, clip_cameras


def test_conditions_items_and_held_out_split():
    train, ev = Room3DConditions("train", seed=1), Room3DConditions("eval", seed=1)
    assert (len(train), len(ev)) == (512, 64)
    it = ev[0]
    assert it["index"] == 512 and it["preset"] == "pan right" and it["prompt"].endswith(", camera pan right")
    assert it["prompt"].startswith("a room with ")
    assert it["source_video"].shape == (9, 3, 32, 48) and it["target_video"].shape == (9, 3, 32, 48)
    assert it["cameras"].shape == (3, 12) and it["cameras"].dtype == torch.float32
    np.testing.assert_allclose(it["cameras"].numpy(), trajectory_numbers(1, 3), atol=1e-6)
    fx = 48 * 24 / 23.76
    np.testing.assert_allclose(it["intrinsics"], [fx, fx, 23.5, 15.5], rtol=1e-6)
    # the source camera stands still; the target starts where it stands
    src, tgt = it["source_video"].numpy(), it["target_video"]
    np.testing.assert_array_equal(src[0], src[-1])
    np.testing.assert_allclose(tgt[0], src[0], atol=1e-6)
    assert np.abs(tgt[-1] - src[-1]).mean() > 0.03
    # eval: the ten presets in turn; train: random paths of the same kinds, their numbers are the path's
    assert [ev[k]["preset"] for k in range(10)] == [CAM_TYPES[c] for c in range(1, 11)]
    tr = train[3]
    np.testing.assert_allclose(tr["cameras"].numpy(), clip_cameras(tr["target_path"].astype(np.float64)), atol=1e-6)
    assert tr["prompt"] == train.prompt_at(3)
    # held-out rooms: no eval scene seed is a train scene seed
    assert not {train[k]["scene_seed"] for k in range(8)} & {ev.scene_seed(i) for i in ev.indices}
    # deterministic per seed
    np.testing.assert_array_equal(Room3DConditions("train", seed=1, cache=False)[3]["target_video"], tr["target_video"])
    with pytest.raises(ConfigError):
        Room3DConditions("train", num_frames=8)
    with pytest.raises(ConfigError):
        check_num_frames(0)


def test_data_kinds_draws_train_paths_of_those_kinds_only():
    """config data.kinds -> Room3DConditions(kinds=...): train's random paths of the named kinds only, the default the
    same draw as naming all five, held-out presets untouched, an unknown kind a ConfigError."""
    from ml_collections import ConfigDict

    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.worlds.room3d.paths import RANDOM_KINDS

    words = {"pan": ("pan left", "pan right"), "tilt": ("tilt up", "tilt down")}
    rot = Room3DConditions("train", seed=3, kinds=("pan", "tilt"))
    names = [rot.condition(i)[2] for i in range(40)]
    assert set(names) <= set(words["pan"] + words["tilt"])
    assert any(n.startswith("pan") for n in names) and any(n.startswith("tilt") for n in names)
    default, named = Room3DConditions("train", seed=3), Room3DConditions("train", seed=3, kinds=RANDOM_KINDS)
    for i in range(12):
        a, b = default.condition(i), named.condition(i)
        assert a[2] == b[2] and a[0] == b[0]
        np.testing.assert_array_equal(a[1], b[1])
    assert len({default.condition(i)[2].split()[0] for i in range(40)}) >= 4  # the five kinds mixed
    ev = Room3DConditions("eval", seed=3, kinds=("pan",))
    assert [ev.condition(k)[2] for k in range(10)] == [CAM_TYPES[c] for c in range(1, 11)]
    with pytest.raises(ConfigError, match="data.kinds"):
        Room3DConditions("train", kinds=("spin",))
    with pytest.raises(ConfigError, match="data.kinds"):
        Room3DConditions("train", kinds=())
    cfg = ConfigDict({"seed": 0, "data": {"name": "room3d", "num_conditions": 0, "kinds": " tilt , pan"},
                      "pretrained": {"resolution": 0, "num_frames": 9, "height": 32, "width": 48},
                      "eval": {"split": "eval"}})
    ds = build_dataset(cfg, "train")
    assert ds.kinds == ("tilt", "pan") and set(ds.condition(0)[2].split()[:1]) <= {"pan", "tilt"}


@pytest.mark.parametrize("k", [0, 3])  # eval items 0 and 3: pan right, tilt down (ReCamMaster cam types 1, 4)
def test_cam_margin_is_cam_score_against_the_request_minus_against_its_opposite(k):
    """The registered cam_margin (worlds/room3d/reward.py) through the reward registry: cam_score against the request
    minus cam_score against the opposite motion, both equal to plain cam_score's on the same clips (the opposite's
    with the item's cameras replaced by the opposite path's numbers); the true clip's margin is clearly positive, the
    opposite motion's render clearly negative and a still camera's near 0 (it misses both alike)."""
    import torch

    from ddpo_grpo.rewards.registry import RewardError, get_reward_fn
    from ddpo_grpo.worlds.recam.cam_score import make_cam_score
    from ddpo_grpo.worlds.room3d import intrinsics, make_scene, render_clip, source_pose, static_path
    from ddpo_grpo.worlds.room3d.paths import clip_cameras, opposite_motion

    it = Room3DConditions("eval", seed=0)[k]
    scene = make_scene(it["scene_seed"])
    src, K = source_pose(scene), intrinsics(32, 48)
    opp_path, _ = opposite_motion(np.asarray(it["target_path"], np.float64), it["preset"])
    clips = torch.from_numpy(np.stack([it["target_video"], render_clip(scene, src @ opp_path, K, 32, 48, 2),
                                       render_clip(scene, src @ static_path(9), K, 32, 48, 2)]))
    meta = [{key: v for key, v in it.items() if key != "target_video"}] * 3
    kw = dict(pose_estimator="ddpo_grpo.worlds.room3d.estimator:make_exact_estimator",
              pose_estimator_kwargs={"sigmas": [0.0], "iters": 2}, workers=0)
    margin, det = get_reward_fn("cam_margin", **kw)(clips, [""] * 3, meta)
    plain = make_cam_score(**kw)
    s, _ = plain(clips, [""] * 3, meta)
    o, _ = plain(clips, [""] * 3, [dict(m, cameras=torch.from_numpy(clip_cameras(opp_path)).float()) for m in meta])
    np.testing.assert_allclose(det["cam_score"], s, atol=1e-6)
    np.testing.assert_allclose(det["cam_opposite"], o, atol=1e-6)
    np.testing.assert_allclose(margin, np.asarray(s) - np.asarray(o), atol=1e-6)
    assert margin[0] > 0.6 and margin[1] < -0.6 and abs(margin[2]) < 0.15
    half, _ = get_reward_fn("cam_margin", opposite_weight=0.5, **kw)(clips, [""] * 3, meta)  # s - 0.5 o
    np.testing.assert_allclose(half, np.asarray(s) - 0.5 * np.asarray(o), atol=1e-6)
    with pytest.raises(RewardError, match="opposite_weight"):  # one line naming the option
        get_reward_fn("cam_margin", opposite_weight=1.5, **kw)
    with pytest.raises(Exception, match="cam_margin scores room3d clips"):  # an item of another world: one clear line
        get_reward_fn("cam_margin", **kw)(clips[:1], [""], [{"cameras": meta[0]["cameras"]}])

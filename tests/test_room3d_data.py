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


def test_data_kinds_named_twice_is_drawn_twice_as_often():
    """A kind named twice ("pan,dolly,dolly") is drawn with twice the weight: over the 512 train conditions the dolly
    ("zoom") share is 2/3 within 4.5 standard errors, and "pan,dolly" gives 1/2."""
    for kinds, want in ((("pan", "dolly", "dolly"), 2 / 3), (("pan", "dolly"), 1 / 2)):
        ds = Room3DConditions("train", seed=5, kinds=kinds)
        names = [ds.condition(i)[2] for i in range(len(ds))]
        assert all(n.startswith(("pan", "zoom")) for n in names), set(names)
        share = np.mean([n.startswith("zoom") for n in names])
        assert abs(share - want) < 4.5 * np.sqrt(want * (1 - want) / len(names)), (kinds, share)


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


def test_view_match_against_a_float64_ncc_and_ordered_by_how_far_a_clip_leans():
    """The registered view_match through the reward registry: on the true clip, the opposite motion's render, a 70/30
    blend of the two and a still camera (eval items: a pan and a tilt), it equals m_req - w m_opp computed here in
    float64 (per frame 1..8: zero-mean NCC after the same Gaussian blur), orders true > blend > still > opposite, and
    rises monotonically with the blend's weight on the true clip; bad options and items of another world fail in
    one line."""
    from ddpo_grpo.rewards.registry import get_reward_fn
    from ddpo_grpo.worlds.room3d import intrinsics, make_scene, render_clip, source_pose, static_path
    from ddpo_grpo.worlds.room3d.paths import opposite_motion
    from ddpo_grpo.worlds.room3d.reward import _blur

    data = Room3DConditions("eval", seed=0)
    for it in (data[0], data[3]):
        scene = make_scene(it["scene_seed"])
        src, K = source_pose(scene), intrinsics(32, 48)
        opp = render_clip(scene, src @ opposite_motion(np.asarray(it["target_path"], np.float64), it["preset"])[0], K,
                          32, 48, 2)
        true, still = it["target_video"], render_clip(scene, src @ static_path(9), K, 32, 48, 2)
        lam = np.linspace(0.0, 1.0, 6)
        clips = np.stack([true, opp, still] + [a * true + (1 - a) * opp for a in lam]).astype(np.float32)
        r, det = get_reward_fn("view_match", opposite_weight=0.5, blur_px=1.0)(torch.from_numpy(clips), None,
                                                                               [it] * len(clips))

        def ncc64(x, y):  # (F-1) frames blurred as the reward blurs them, the correlation in float64
            bx = _blur(torch.from_numpy(x[1:]), 1.0).double().flatten(1).numpy()
            by = _blur(torch.from_numpy(y[1:]), 1.0).double().flatten(1).numpy()
            bx, by = bx - bx.mean(1, keepdims=True), by - by.mean(1, keepdims=True)
            return float(np.mean((bx * by).sum(1) / np.linalg.norm(bx, axis=1) / np.linalg.norm(by, axis=1)))

        want = np.array([ncc64(c, true) - 0.5 * ncc64(c, opp) for c in clips])
        np.testing.assert_allclose(r, want, atol=2e-5)
        np.testing.assert_allclose(det["view_requested"], [ncc64(c, true) for c in clips], atol=2e-5)
        assert r[0] > r[3 + 3] > r[2] > r[1]  # true > 60 % true blend > still > opposite
        assert np.all(np.diff(r[3:]) > 0)  # the more a blend leans to the request, the more it earns
        assert r[0] == pytest.approx(1.0 - 0.5 * ncc64(true, opp), abs=2e-5)
    with pytest.raises(ConfigError, match="view_match's opposite_weight"):  # a config error: one line, exit 2
        get_reward_fn("view_match", opposite_weight=-0.1)
    with pytest.raises(ConfigError, match="blur_px"):
        get_reward_fn("view_match", blur_px=20)
    with pytest.raises(Exception, match="view_match scores room3d clips"):  # wrapped by the registry: one line
        get_reward_fn("view_match")(torch.zeros(1, 9, 3, 32, 48), None, [{"cameras": None}])

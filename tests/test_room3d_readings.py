"""The readings benchmarks/ makes of a room3d model (issue 59): recam3d_dit_loss's camera gain and mode gain,
recam3d_start's reference scores and amplified cameras, recam3d_readings' motion shown, rotation leans, group spread
and magnitude reading, recam3d_dit_position's probe and recam3d_from_target's ODE, each against values computed by
hand."""
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT

from ddpo_grpo.worlds.room3d.paths import preset_path


def test_dit_loss_camera_gain_by_kind_by_hand():
    """benchmarks/recam3d_dit_loss.py's per-kind camera gain: shuffled - true moved-frame loss over the rows at the top
    noise level whose item is of that kind (row r * N + i is item i), the opposite's word keeping the kind."""
    from benchmarks.recam3d_dit_loss import camera_word, gain_by_kind

    assert camera_word("a room with a red box, camera pan left") == "pan"
    assert camera_word("a room with a camera box, camera zoom out") == "zoom"  # the last "camera " is the label's
    prompts = ["r, camera pan left", "r, camera zoom in", "r, camera pan right"]
    # 2 draws x 3 items: (sigma, whole-clip loss, moved-frame loss)
    true = np.array([[0.9, 0, 0.5], [0.9, 0, 0.7], [0.2, 0, 0.1], [0.95, 0, 0.6], [0.5, 0, 0.3], [0.86, 0, 0.2]])
    shuf = np.array([[0.9, 0, 0.9], [0.9, 0, 0.8], [0.2, 0, 9.0], [0.95, 0, 1.0], [0.5, 0, 9.0], [0.86, 0, 0.6]])
    got = gain_by_kind(true, shuf, prompts, 0.85)
    # pan: rows 0, 3, 5 (items 0, 0, 2) -> (0.4 + 0.4 + 0.4) / 3; zoom: row 1 only (row 4 is below 0.85)
    assert set(got) == {"pan", "zoom"}
    assert got["pan"]["n"] == 3 and got["zoom"]["n"] == 1
    assert got["pan"]["gain"] == pytest.approx(0.4) and got["zoom"]["gain"] == pytest.approx(0.1)


@pytest.mark.parametrize("cam_type", [1, 3, 5, 7, 9])
def test_motion_shown_reads_the_share_of_the_requested_motion(cam_type):
    """benchmarks/recam3d_readings.py's motion_shown on ReCamMaster's presets: the path itself shows all of its motion,
    the half-amplitude path half (angle and metres scale exactly), a still camera none; a part the preset does not have
    (a pan's translation, a dolly's rotation) is NaN, as is a failed estimate."""
    from benchmarks.recam3d_readings import motion_shown
    from ddpo_grpo.worlds.room3d.paths import clip_cameras, static_path
    from ddpo_grpo.worlds.recam.pose_reward import requested_path

    def poses(path):
        return requested_path(clip_cameras(path), 0, 9)

    req = poses(preset_path(cam_type, 9))
    full, half, still = (motion_shown(poses(p), req) for p in
                         (preset_path(cam_type, 9), preset_path(cam_type, 9, amplitude=0.5), static_path(9)))
    has_t = np.linalg.norm(req[-1][:3, 3]) >= 0.1
    has_r = cam_type in (1, 3, 7, 9)  # pans, tilts, the translations' facing turn, arcs; the dolly (5) only moves
    for got, want in ((full, 1.0), (half, 0.5), (still, 0.0)):
        assert np.isnan(got[0]) != has_t and np.isnan(got[1]) != has_r
        for v, on in zip(got, (has_t, has_r)):
            if on:
                assert v == pytest.approx(want, abs=1e-6)
    failed = req.copy()
    failed[1:] = np.nan
    assert all(np.isnan(motion_shown(failed, req)))


@pytest.mark.parametrize("cam_type", [1, 4, 5, 9])
@pytest.mark.parametrize("amplitude", [1.0, 0.5, 2.0])
def test_amplified_cameras_are_the_preset_at_that_amplitude(cam_type, amplitude):
    """benchmarks/recam3d_start.py's amplified_cameras (--amplitude: what the model is asked for) scales a clip's camera
    numbers as preset_path(amplitude=) scales the trajectory before interpolating: the two ways agree on a pan, a tilt,
    a dolly and an arc, and at amplitude 2 the last pose turns twice as far as the request."""
    from benchmarks.recam3d_start import amplified_cameras
    from ddpo_grpo.worlds.recam.pose_reward import requested_path
    from ddpo_grpo.worlds.recam.pose_score import rotation_angle
    from ddpo_grpo.worlds.room3d.paths import clip_cameras

    cams = clip_cameras(preset_path(cam_type, 9))
    got = amplified_cameras(torch.from_numpy(cams), amplitude).numpy()
    np.testing.assert_allclose(got, clip_cameras(preset_path(cam_type, 9, amplitude=amplitude)), atol=2e-6)
    req, amp = requested_path(cams, 0, 9)[-1], requested_path(got, 0, 9)[-1]
    a_req, a_amp = (float(rotation_angle(np.eye(3), p[:3, :3])) for p in (req, amp))
    assert a_amp == pytest.approx(amplitude * a_req, abs=1e-5)
    np.testing.assert_allclose(amp[:3, 3], amplitude * req[:3, 3], atol=2e-6)


def test_position_probe_reads_a_known_place_and_not_noise():
    """benchmarks/recam3d_dit_position.py's probe: tokens whose features hold their (row, column) linearly (mixed into 16
    dimensions, plus a little noise) give R^2 near 1 on held-out rows; features that are noise give R^2 near 0. The
    grid lists tokens frame-major, row-major within a frame, as Wan's patch embedding flattens them."""
    from benchmarks.recam3d_dit_position import probe_r2, token_grid

    pos, frame = token_grid(3, 4, 6)
    assert pos.shape == (72, 2) and frame.shape == (72,)
    np.testing.assert_array_equal(pos[:7], [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [1, 0]])
    assert frame[23] == 0 and frame[24] == 1 and (pos[24:48] == pos[:24]).all()
    rng = np.random.default_rng(0)
    Y = np.tile(pos, (40, 1))
    placed = Y @ rng.normal(size=(2, 16)) + 0.05 * rng.normal(size=(len(Y), 16))
    assert (probe_r2(placed, Y, 30 * 72) > 0.99).all()
    assert (np.abs(probe_r2(rng.normal(size=(len(Y), 16)), Y, 30 * 72)) < 0.05).all()


@pytest.mark.parametrize("s0", [0.0, 0.37, 0.6, 1.0])
def test_from_target_ode_returns_the_target_under_the_true_velocity(s0):
    """benchmarks/recam3d_from_target.py: with the exact velocity of the straight flow path (noise - x0) every Euler
    step lands on (1 - s) x0 + s noise, so the ODE from any s0 returns x0, visiting s0 then the grid's points below
    it; s0 = 0 is x0 untouched. The grid is the sampler's: 1 -> 0, shifted towards noise (flow_shift 3: 0.5 -> 0.75)."""
    import torch

    from benchmarks.recam3d_from_target import flow_grid, ode_from

    grid = flow_grid(10, 3.0)
    assert grid[0] == 1.0 and grid[-1] == 0.0 and (np.diff(grid) < 0).all()
    assert abs(grid[5] - 0.75) < 1e-12
    np.testing.assert_allclose(flow_grid(4, 1.0), [1.0, 0.75, 0.5, 0.25, 0.0])
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 8, 3, 4, 6, generator=g, dtype=torch.float64), torch.randn(2, 8, 3, 4, 6, generator=g,
                                                                                           dtype=torch.float64)
    seen = []

    def velocity(x, sigma):
        seen.append(sigma)
        torch.testing.assert_close(x, (1 - sigma) * x0 + sigma * noise)  # on the path at every step
        return noise - x0

    torch.testing.assert_close(ode_from(velocity, x0, noise, s0, grid), x0)
    assert seen == ([s0] if s0 > 0 else []) + [float(s) for s in grid if 0 < s < s0]


def test_reference_scores_of_a_still_camera_and_the_opposite_motion_by_hand():
    """benchmarks/recam3d_start.py's reference_scores on the held-out presets: a pan or tilt held still is off by the
    preset's own turn at each latent frame, the opposite motion by twice it (float64 angles of the path's rotations,
    cam_score's exp(-deg / 10)); a translating preset held still scores ~0 (its direction term is exp(-90 / 20))."""
    from benchmarks.recam3d_start import reference_scores
    from ddpo_grpo.worlds.room3d import Room3DConditions

    items = [Room3DConditions("eval", seed=0)[k] for k in range(10)]
    ref = reference_scores(items)
    for it in items:
        path = it["target_path"].astype(np.float64)[[4, 8]]
        turn = np.degrees(np.arccos(np.clip((np.trace(path[:, :3, :3], axis1=1, axis2=2) - 1) / 2, -1, 1)))
        got = ref["per_preset"][it["preset"]]
        if it["preset"].split()[0] in ("pan", "tilt"):
            assert got["still"] == pytest.approx(np.exp(-turn / 10).mean(), abs=2e-5)  # float32 numbers
            assert got["opposite"] == pytest.approx(np.exp(-2 * turn / 10).mean(), abs=2e-5)
        else:
            assert got["still"] < 0.01 and got["opposite"] < 0.01
    assert ref["still"] == pytest.approx(np.mean([v["still"] for v in ref["per_preset"].values()]), abs=1e-12)
    assert 0.14 < ref["still"] < 0.16 and ref["opposite"] < ref["still"]


def test_rotation_leans_by_hand():
    """recam3d_readings.rotation_leans: on the pans and tilts only, the share of samples scoring higher against the
    requested camera than its opposite, and the Pearson correlation of that lean with the starting noise's mode
    (float64 by hand); a zoom's sample is left out whatever it scores."""
    from benchmarks.recam3d_readings import rotation_leans

    true = np.array([0.4, 0.1, 0.3, 0.05, 0.9, 0.2])
    opp = np.array([0.1, 0.4, 0.05, 0.3, 0.0, 0.3])
    modes = np.array([-1.0, 1.0, -0.5, 2.0, 5.0, 0.3])
    presets = ["pan left", "tilt up", "pan right", "tilt down", "zoom in", "pan left"]
    got = rotation_leans(true, opp, modes, presets)
    lean, mo = np.array([0.3, -0.3, 0.25, -0.25, -0.1]), np.array([-1.0, 1.0, -0.5, 2.0, 0.3])
    lc, mc = lean - lean.mean(), mo - mo.mean()
    assert got["n"] == 5 and got["requested_share"] == pytest.approx(2 / 5)
    assert got["lean_mode_corr"] == pytest.approx((lc * mc).sum() / np.sqrt((lc ** 2).sum() * (mc ** 2).sum()))


def test_mode_gain_pairs_the_two_labels_on_the_same_clip_and_noise():
    """recam3d_dit_loss.mode_gain: the coupled and the other label are scored on the same clips, noises and levels,
    so a DiT that reads neither the camera numbers nor the prompt (camera layers at their zero start, one embedding
    for every prompt) has gain 0 at every level; the losses are finite and positive."""
    import torch

    from benchmarks.pretrain_recam_video import build_parts
    from benchmarks.recam3d_dit_loss import MODE_SIGMAS, mode_gain
    from ddpo_grpo.models.recam import RecamDenoiser, add_camera_layers

    torch.manual_seed(0)
    parts = build_parts(0)
    den = RecamDenoiser(add_camera_layers(parts["transformer"])).eval()
    g = torch.Generator().manual_seed(3)
    n = 4
    clips = (torch.rand(n, 5, 3, 16, 24, generator=g), torch.rand(n, 5, 3, 16, 24, generator=g),
             torch.randn(n, 2, 12, generator=g), [f"p{i}" for i in range(n)])
    opposite = (torch.randn(n, 2, 12, generator=g), [f"q{i}" for i in range(n)])
    emb = torch.randn(1, 8, 32, generator=g)
    got = mode_gain(den, parts["vae"].eval(), lambda prompts: emb.expand(len(prompts), -1, -1), clips, opposite,
                    0.5, False, 2, torch.Generator().manual_seed(0))
    assert sorted(got) == sorted(str(s) for s in MODE_SIGMAS)
    for v in got.values():
        assert v["coupled"] > 0 and np.isfinite(v["coupled"])
        assert abs(v["gain"]) < 1e-6 and v["other"] == pytest.approx(v["coupled"], rel=1e-5)
    # a DiT that reads the prompt: the two labels now differ somewhere (the gain is not 0 by construction)
    table = {p: torch.randn(8, 32, generator=g) for p in clips[3] + opposite[1]}
    read = mode_gain(den, parts["vae"].eval(), lambda prompts: torch.stack([table[p] for p in prompts]), clips,
                     opposite, 0.5, False, 2, torch.Generator().manual_seed(0))
    assert max(abs(v["gain"]) for v in read.values()) > 1e-4


def test_group_spread_by_hand():
    """recam3d_readings.group_spread: per kind, over each condition's group of k samples, the mean lean (true -
    opposite), its spread (std over the group, mean over conditions), the share leaning to the requested camera and
    the reward's own spread (float64 by hand); a zoom's group is left out."""
    from benchmarks.recam3d_readings import group_spread

    true = np.array([[0.3, 0.5, 0.0], [0.1, 0.4, 0.9], [0.2, 0.6, 0.1]])  # (k 3, conditions 3)
    opp = np.array([[0.1, 0.2, 0.0], [0.3, 0.1, 0.0], [0.2, 0.3, 0.0]])
    got = group_spread(true, opp, ["pan left", "tilt up", "zoom in"], 3)
    assert sorted(got) == ["pan", "tilt"]
    pan = np.array([0.2, -0.2, 0.0])
    assert got["pan"]["lean_mean"] == pytest.approx(0.0, abs=1e-12)
    assert got["pan"]["lean_spread"] == pytest.approx(np.sqrt((pan ** 2).sum() / 2))
    assert got["pan"]["requested_share"] == pytest.approx(1 / 3)
    assert got["pan"]["reward_mean"] == pytest.approx(0.2)
    assert got["pan"]["reward_spread"] == pytest.approx(np.std([0.3, 0.1, 0.2], ddof=1))
    assert got["tilt"]["lean_mean"] == pytest.approx(0.3) and got["tilt"]["requested_share"] == 1.0
    assert got["pan"]["true_opposite_corr"] == pytest.approx(np.corrcoef([0.3, 0.1, 0.2], [0.1, 0.3, 0.2])[0, 1])
    assert got["tilt"]["true_opposite_corr"] == pytest.approx(np.corrcoef([0.5, 0.4, 0.6], [0.2, 0.1, 0.3])[0, 1])
    zoom = group_spread(true, opp, ["pan left", "tilt up", "zoom in"], 3, kinds=("dolly",))["dolly"]
    assert sorted(group_spread(true, opp, ["pan left", "tilt up", "zoom in"], 3, kinds=("dolly",))) == ["dolly"]
    assert zoom["lean_mean"] == pytest.approx(1 / 3) and zoom["requested_share"] == pytest.approx(2 / 3)
    assert zoom["reward_spread"] == pytest.approx(np.std([0.0, 0.9, 0.1], ddof=1))


def test_magnitude_reading_by_hand():
    """recam3d_readings.magnitude_reading: per kind, the pooled within-group slope and correlation of the reward in the
    translation share shown (float64 by hand), the share's median and within-group spread, the error terms' means; a
    NaN share leaves its sample out of its group, a group of one is not read, other kinds are left out."""
    from benchmarks.recam3d_readings import magnitude_reading

    true = np.array([[0.2, 0.5, 0.1], [0.4, 0.3, 0.9], [0.3, 0.1, 0.5]])  # (k 3, conditions 3)
    shown = np.array([[0.4, 0.9, 0.5], [0.8, np.nan, 0.7], [0.6, 0.5, np.nan]])
    terms = np.arange(27, dtype=np.float64).reshape(3, 3, 3)
    terms[0, 0, 1] = np.nan
    got = magnitude_reading(true, shown, terms, ["zoom in", "zoom out", "pan left"])
    assert sorted(got) == ["dolly"]
    d = got["dolly"]
    # group 0: x (0.4, 0.8, 0.6), y (0.2, 0.4, 0.3); group 1: x (0.9, 0.5), y (0.5, 0.1)
    x0, y0 = np.array([-0.2, 0.2, 0.0]), np.array([-0.1, 0.1, 0.0])
    x1, y1 = np.array([0.2, -0.2]), np.array([0.2, -0.2])
    sxy, sxx, syy = (x0 * y0).sum() + (x1 * y1).sum(), (x0 ** 2).sum() + (x1 ** 2).sum(), (y0 ** 2).sum() + (y1 ** 2).sum()
    assert d["groups_read"] == 2 and d["conditions"] == 2
    assert d["reward_shown_slope"] == pytest.approx(sxy / sxx)
    assert d["reward_shown_corr"] == pytest.approx(sxy / np.sqrt(sxx * syy))
    assert d["shown_median"] == pytest.approx(np.median([0.4, 0.8, 0.6, 0.9, 0.5]))
    assert d["shown_spread"] == pytest.approx((np.std([0.4, 0.8, 0.6], ddof=1) + np.std([0.9, 0.5], ddof=1)) / 2)
    dolly_terms = terms[:, :2].reshape(-1, 3)
    assert d["rot_err_deg"] == pytest.approx(dolly_terms[:, 0].mean())
    assert d["dir_err_deg"] == pytest.approx(np.nanmean(dolly_terms[:, 1]))
    assert d["mag_err"] == pytest.approx(dolly_terms[:, 2].mean())
    g = [dolly_terms.reshape(3, 2, 3)[:, j, 1] for j in range(2)]
    g = [v[np.isfinite(v)] for v in g]
    allv = np.concatenate(g)
    assert d["dir_err_within_share"] == pytest.approx(sum(((v - v.mean()) ** 2).sum() for v in g)
                                                      / ((allv - allv.mean()) ** 2).sum())
    pan = magnitude_reading(true, shown, terms, ["zoom in", "zoom out", "pan left"], kinds=("pan",))["pan"]
    # its one group: x (0.5, 0.7), y (0.1, 0.9): slope 0.08 / 0.02
    assert pan["groups_read"] == 1 and pan["reward_shown_slope"] == pytest.approx(4.0)
    assert pan["shown_spread"] == pytest.approx(np.std([0.5, 0.7], ddof=1))
    one = magnitude_reading(true, np.where(np.isfinite(shown), np.nan, 0.5), terms, ["zoom in", "zoom out", "pan left"])
    assert one["dolly"]["groups_read"] == 0 and np.isnan(one["dolly"]["reward_shown_slope"])


def test_es_per_sample_linear_is_the_layer_with_each_samples_own_weight():
    """benchmarks/recam3d_es.py's PerSampleLinear: sample b reads (W + D_b) c + bias, checked against each sample's own
    nn.Linear in float64; without offsets it is the layer itself; offsets for another batch size are an error."""
    from benchmarks.recam3d_es import PerSampleLinear

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(12, 8).double()
    layer = PerSampleLinear(lin)
    c = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    torch.testing.assert_close(layer(c), lin(c), rtol=0, atol=0)
    layer.delta = torch.randn(3, 8, 12, generator=g, dtype=torch.float64)
    got = layer(c)
    for b in range(3):
        want = torch.nn.functional.linear(c[b], lin.weight + layer.delta[b], lin.bias)
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[0], lin(c)[0])
    with pytest.raises(ValueError, match="per-sample offsets for 3 samples"):
        layer(c[:2])


@pytest.mark.parametrize("kind", ["pan", "tilt", "dolly", "translate", "arc"])
def test_scale_cameras_on_random_paths_keeps_axis_and_direction_and_inverts(kind):
    """paths.scale_cameras (pretrain_recam_video.py --label-gain's labels): on the pool's random paths of every kind,
    frame 0 stays the identity, each pose's rotation angle and translation are `gain` times the path's about the same
    axis, and scaling back by 1 / gain returns the numbers."""
    from ddpo_grpo.worlds.recam.pose_reward import requested_path
    from ddpo_grpo.worlds.room3d.paths import clip_cameras, random_path, scale_cameras, so3_log

    rng = np.random.default_rng(7)
    for _ in range(3):
        cams = clip_cameras(random_path(rng, kind, 9))
        got = scale_cameras(cams, 2.0)
        np.testing.assert_allclose(got[0], np.eye(4)[:3].reshape(12), atol=1e-6)
        for p, q in zip(requested_path(cams, 0, 9), requested_path(got, 0, 9)):
            np.testing.assert_allclose(so3_log(q[:3, :3]), 2.0 * so3_log(p[:3, :3]), atol=2e-5)
            np.testing.assert_allclose(q[:3, 3], 2.0 * p[:3, 3], atol=2e-5)
        np.testing.assert_allclose(scale_cameras(got, 0.5), cams, atol=2e-5)


def test_start_paired_difference_by_hand(tmp_path):
    """recam3d_start's --baseline: the mean and standard error of this model's clip scores minus the baseline's on
    the same clips; a baseline read on other seeds, rooms, amplitude or estimator options, without its clip scores
    or with another count of them, is refused."""
    import json

    from benchmarks.recam3d_start import paired_difference, read_baseline

    def paired(path, seeds, scores=(0.3, 0.5, 0.6, 0.1), **same):
        return paired_difference(np.array(scores), read_baseline(path, seeds, **same), path)

    base = tmp_path / "start.json"
    base.write_text(json.dumps(dict(model="tiny-recam3d", seeds=[0, 1], clip_scores=[0.1, 0.5, 0.2, 0.0])))
    got = paired(str(base), [0, 1])
    d = np.array([0.2, 0.0, 0.4, 0.1])  # by hand: mean 0.175, sample std sqrt(0.0875 / 3)
    assert got["baseline"] == "tiny-recam3d"
    assert got["mean"] == pytest.approx(0.175)
    assert got["se"] == pytest.approx(np.sqrt(((d - 0.175) ** 2).sum() / 3) / 2)
    with pytest.raises(SystemExit, match="not the same clips") as refused:
        paired(str(base), [0, 2])
    assert refused.value.code == 2  # a refusal of input exits 2 (benchmarks.refuse), not 1 as a failed run
    with pytest.raises(SystemExit, match="4 clip scores, here 6"):  # same seeds, another count: other clips
        paired(str(base), [0, 1], scores=(0.3, 0.5, 0.6, 0.1, 0.2, 0.2))
    base.write_text(json.dumps(dict(model="m", seeds=[0, 1])))
    with pytest.raises(SystemExit, match="0 clip scores"):
        paired(str(base), [0, 1])
    # a baseline read on other rooms, at another amplitude or with other estimator options is refused; one whose
    # file does not record a setting (written before it was kept) is not checked on it
    base.write_text(json.dumps(dict(model="m", seeds=[0, 1], rooms="heldout", amplitude=1.0,
                                    estimator_kwargs={"iters": 2}, clip_scores=[0.1, 0.5, 0.2, 0.0])))
    same = dict(rooms="heldout", amplitude=1.0, estimator_kwargs={"iters": 2})
    assert paired(str(base), [0, 1], **same)["mean"] == pytest.approx(0.175)
    for key, other in (("rooms", "pretrain"), ("amplitude", 2.0), ("estimator_kwargs", {})):
        with pytest.raises(SystemExit, match=f"read with {key}"):
            paired(str(base), [0, 1], **dict(same, **{key: other}))
    base.write_text(json.dumps(dict(model="m", seeds=[0, 1], clip_scores=[0.1, 0.5, 0.2, 0.0])))
    assert paired(str(base), [0, 1], **same)["mean"] == pytest.approx(0.175)


def test_a_benchmark_refuses_a_folder_in_one_line_with_exit_2(tmp_path):
    """benchmarks.refuse, as a benchmark's command line sees it: recam3d_dit_loss.py on a folder that is no model, and on
    one that no pretraining saved, stops before loading anything, with one line on stderr and exit status 2 (a bare
    SystemExit("...") exits 1, an uncaught ModelPathError with a traceback)."""
    import subprocess

    def run(folder):
        return subprocess.run([sys.executable, "benchmarks/recam3d_dit_loss.py", "--model", str(folder)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    p = run(tmp_path)  # not a model folder at all (the library's ModelPathError, as its one line)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: model path '{tmp_path}' has no model_index.json")
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "scheduler").mkdir()
    p = run(tmp_path)  # a model folder, but not one pretraining saved
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [f"error: {tmp_path} has no pretrain_meta.json (not a folder "
                                             "pretrain_recam_video.py saved)"]

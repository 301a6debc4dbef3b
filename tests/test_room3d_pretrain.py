"""paths.opposite_motion: the camera error of tiny-recam3d's pretraining data (issue 59 part 2), the pretraining pools
and their labels (by item or by noise), and the pretraining script: its options, its DiT patch, its device path
(scripts/gpu_recam3d.sh). The benchmarks' readings of a model are in test_room3d_readings.py."""
import os
import sys

import numpy as np
import pytest

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.room3d.paths import RANDOM_KINDS, opposite_motion, preset_path, random_motion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name, other", [("pan right", "pan left"), ("tilt up", "tilt down"),
                                         ("zoom in", "zoom out"), ("arc left", "arc right"),
                                         ("translate up", "translate down")])
def test_opposite_of_a_preset_is_its_counterpart(name, other):
    for a, b in ((name, other), (other, name)):
        path, opp = opposite_motion(preset_path(a, 9), a)
        assert opp == b
        np.testing.assert_allclose(path, preset_path(b, 9), atol=1e-12)


def test_opposite_by_hand():
    a = np.radians(20.0)
    pan = np.tile(np.eye(4), (1, 1, 1))
    pan[0, :3, :3] = [[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]]  # R_y(20 deg): pan right
    out, name = opposite_motion(pan, "pan right")
    assert name == "pan left"
    np.testing.assert_allclose(out[0, :3, :3], [[np.cos(a), 0, -np.sin(a)], [0, 1, 0], [np.sin(a), 0, np.cos(a)]],
                               atol=1e-15)
    dolly = np.eye(4)[None].copy()
    dolly[0, 2, 3] = 1.5
    out, name = opposite_motion(dolly, "zoom in")
    assert name == "zoom out" and out[0, 2, 3] == pytest.approx(-1.5) and out[0, :3, :3] == pytest.approx(np.eye(3))
    trans = np.eye(4)[None].copy()
    trans[0, :3, 3] = [0.0, -0.8, 0.0]  # y down: moving up is -y
    out, name = opposite_motion(trans, "translate up")
    assert name == "translate down" and out[0, :3, 3] == pytest.approx([0.0, 0.8, 0.0])


def test_opposite_twice_is_the_identity_and_keeps_rotations_proper():
    rng = np.random.default_rng(5)
    for kind in RANDOM_KINDS:
        for _ in range(4):
            path, name = random_motion(rng, kind, 9)
            once, n1 = opposite_motion(path, name)
            twice, n2 = opposite_motion(once, n1)
            assert n1 != name and n2 == name
            np.testing.assert_allclose(twice, path, atol=1e-12)
            np.testing.assert_allclose(np.linalg.det(once[:, :3, :3]), 1.0, atol=1e-12)
            if kind != "dolly":  # the motion really changes (a dolly's rotation is I, its translation flips)
                assert np.abs(once - path).max() > 1e-3


def test_opposite_of_an_unknown_name_is_one_error():
    with pytest.raises(ConfigError, match="no opposite"):
        opposite_motion(np.tile(np.eye(4), (9, 1, 1)), "spin")


def test_pretraining_pool_item_is_labelled_with_the_opposite_camera():
    """benchmarks/pretrain_recam_video.py's room3d pool: a mislabelled item's target clip is the true path's render
    while its camera numbers and prompt word describe the opposite motion; fraction 0 labels it truly."""
    from benchmarks.pretrain_pools import POOL_SEED, ROOM3D_SCENE_SEED, room3d_clip
    from ddpo_grpo.worlds.room3d.paths import clip_cameras
    from ddpo_grpo.worlds.room3d.render import intrinsics, render_clip
    from ddpo_grpo.worlds.room3d.scene import make_scene, source_pose

    src_t, tgt_t, cams_t, prompt_t, flip_t = room3d_clip(3, 9, 16, 24, 1, "opposite", 0.0)
    src_f, tgt_f, cams_f, prompt_f, flip_f = room3d_clip(3, 9, 16, 24, 1, "opposite", 1.0)
    assert not flip_t and flip_f
    np.testing.assert_array_equal(tgt_t, tgt_f)  # the same clip, only its label differs
    np.testing.assert_array_equal(src_t, src_f)
    assert src_t.shape == tgt_t.shape == (9, 3, 16, 24) and cams_t.shape == (3, 12)
    # the true label is the pool's own path: re-draw it as room3d_clip does and compare the render and the numbers
    rng = np.random.default_rng((POOL_SEED, 3, 59))
    scene = make_scene(ROOM3D_SCENE_SEED + 3)
    kind = RANDOM_KINDS[int(rng.integers(len(RANDOM_KINDS)))]
    path, name = random_motion(rng, kind, 9)  # the first draw (kept when it stays clear of the room: checked below)
    np.testing.assert_allclose(render_clip(scene, source_pose(scene) @ path, intrinsics(16, 24), 16, 24, 1), tgt_t)
    np.testing.assert_allclose(cams_t, clip_cameras(path), atol=1e-6)
    opp_path, opp_name = opposite_motion(path, name)
    np.testing.assert_allclose(cams_f, clip_cameras(opp_path), atol=1e-6)
    assert prompt_t == f"{scene.describe()}, camera {name}" and prompt_f == f"{scene.describe()}, camera {opp_name}"


def test_opposite_labels_without_rendering_are_the_flipped_items_labels():
    """pretrain_pools.room3d_opposite_labels (for --mislabel-by noise) gives each item the camera numbers and prompt
    that room3d_clip gives it when it flips it, without rendering."""
    from benchmarks.pretrain_pools import room3d_clip, room3d_opposite_labels

    cams, prompts = room3d_opposite_labels(4, 9)
    assert cams.shape == (4, 3, 12) and len(prompts) == 4
    for i in (0, 3):
        _, _, cams_f, prompt_f, flipped = room3d_clip(i, 9, 8, 12, 1, "opposite", 1.0)
        assert flipped and prompts[i] == prompt_f
        np.testing.assert_array_equal(cams[i].numpy(), cams_f)
        _, _, cams_t, prompt_t, _ = room3d_clip(i, 9, 8, 12, 1, "none", 1.0)
        assert prompt_t != prompt_f and not np.allclose(cams_t, cams_f)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_noise_mode_is_a_standard_normal_and_its_threshold_flips_the_fraction(fraction):
    """--mislabel-by noise: noise_mode is the noise's sum over sqrt(its size) (float64 by hand; noise-first: latent
    frame 0's), standard normal for standard normal noise, and mode_threshold is the normal quantile above which
    `fraction` of the draws fall (4,000 seeded draws: within 4 binomial standard errors); fractions 0 and 1 flip none
    and all."""
    import statistics

    import torch

    from benchmarks.pretrain_pools import mode_threshold, noise_mode

    g = torch.Generator().manual_seed(7)
    noise = torch.randn(4000, 8, 3, 8, 12, generator=g)
    m = noise_mode(noise)
    by_hand = noise.double().flatten(1).sum(1) / np.sqrt(8 * 3 * 8 * 12)
    np.testing.assert_allclose(m.numpy(), by_hand.numpy(), rtol=1e-4, atol=1e-4)
    first = noise[:, :, 0].double().flatten(1).sum(1) / np.sqrt(8 * 8 * 12)  # noise-first: latent frame 0 only
    np.testing.assert_allclose(noise_mode(noise, first_frame=True).numpy(), first.numpy(), rtol=1e-4, atol=1e-4)
    assert abs(m.mean().item()) < 4 / np.sqrt(4000) and abs(m.std().item() - 1) < 0.05
    t = mode_threshold(fraction)
    assert t == pytest.approx(statistics.NormalDist().inv_cdf(1 - fraction), abs=1e-5)
    share = (m > t).double().mean().item()
    assert abs(share - fraction) < 4 * np.sqrt(fraction * (1 - fraction) / 4000)
    assert not (m > mode_threshold(0.0)).any() and (m > mode_threshold(1.0)).all()


def test_motion_kind_of_every_name_random_motion_writes_and_keep_kinds_keeps_exactly_those():
    """paths.motion_kind inverts random_motion's naming (over random draws of every kind, and the presets' names,
    whose opposite keeps the kind); pretrain_pools.keep_kinds keeps exactly the items of the kinds asked for, in
    order, with their clips, numbers and prompts aligned."""
    import torch

    from benchmarks.pretrain_pools import keep_kinds, prompt_camera
    from ddpo_grpo.worlds.room3d.paths import CAM_TYPES, motion_kind

    rng = np.random.default_rng(7)
    for _ in range(60):
        kind = RANDOM_KINDS[int(rng.integers(len(RANDOM_KINDS)))]
        path, name = random_motion(rng, kind, 9)
        assert motion_kind(name) == kind == motion_kind(opposite_motion(path, name)[1])
    assert [motion_kind(CAM_TYPES[c]) for c in range(1, 11)] == ["pan", "pan", "tilt", "tilt", "dolly", "dolly",
                                                                  "translate", "translate", "arc", "arc"]
    with pytest.raises(ConfigError, match="names no kind"):
        motion_kind("spin left")
    names = ["pan left", "zoom in", "arc right", "tilt up", "translate down", "pan right", "zoom out"]
    prompts = [f"a room with a camera box, camera {n}" for n in names]
    assert [prompt_camera(p) for p in prompts] == names
    n = len(names)
    pool = (torch.arange(n).view(n, 1) * 10, torch.arange(n).view(n, 1) * 100, torch.arange(n).view(n, 1), prompts)
    src, tgt, cams, kept = keep_kinds(pool, ["pan", "tilt"])
    assert kept == [prompts[0], prompts[3], prompts[5]]
    assert src.flatten().tolist() == [0, 30, 50] and tgt.flatten().tolist() == [0, 300, 500]
    assert cams.flatten().tolist() == [0, 3, 5]
    assert keep_kinds(pool, ["dolly"])[3] == [prompts[1], prompts[6]]
    with pytest.raises(ConfigError, match="--kinds must name"):
        keep_kinds(pool, ["zoom"], what="--kinds")


def test_training_noise_levels_are_shifted_towards_noise_by_hand():
    """pretrain_recam_video.shifted_sigma: s = shift u / (1 + (shift - 1) u), the scheduler's flow_shift (3) unless
    --train-shift says otherwise; shift 1 is uniform, a larger shift trains more at the noisiest levels."""
    import torch

    from benchmarks.pretrain_recam_video import shifted_sigma

    u = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(shifted_sigma(u), torch.tensor([0.0, 0.5, 0.75, 1.0], dtype=torch.float64))
    torch.testing.assert_close(shifted_sigma(u, 1.0), u)
    torch.testing.assert_close(shifted_sigma(u, 8.0), torch.tensor([0.0, 2 / 2.75, 4 / 4.5, 1.0], dtype=torch.float64))
    draws = shifted_sigma(torch.rand(100_000, generator=torch.Generator().manual_seed(0)), 8.0)
    assert abs(float((draws > 0.8).double().mean()) - 2 / 3) < 0.01  # P(s > 0.8) = P(u > 1 / 3) at shift 8


def test_gpu_recam3d_dry_run_trains_a_fresh_8_block_dit_saves_on_the_cpu_and_measures(tmp_path):
    """scripts/gpu_recam3d.sh --dry-run with its defaults: the device command's two stages on the CPU. A fresh 8-block
    DiT 128 channels wide with its camera layers at 10 x the lr (the default variant) trains until --dit-seconds ends
    its schedule (the folder, not a snapshot, is saved, with the steps it ran, and packed in float16 into the one tar
    that comes back from the device), the folder loads with plain diffusers
    with 8 blocks of 8 heads, its ReCamMaster checkpoint holds CPU tensors: the bundled DiT's keys and shapes block
    for block (the bundled DiT is as wide, with 4 blocks), camera layers for all 8 blocks, and recam3d_start's
    measurement is written."""
    import json
    import subprocess

    import torch
    from diffusers import WanTransformer3DModel

    from ddpo_grpo.models import resolve_model_path

    env = dict(os.environ, OUT=str(tmp_path), DIT_SECONDS="2", DIT_BATCH="4", PYTHON=sys.executable)
    env.pop("DIT_ARGS", None)
    proc = subprocess.run(["bash", "scripts/gpu_recam3d.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = tmp_path / "tiny-recam3d-gpu"
    meta = json.loads((folder / "pretrain_meta.json").read_text())
    assert 1 <= meta["dit_steps"] == meta["args"]["dit_steps"] < 1_000_000  # ended by the seconds
    assert meta["args"]["dit_layers"] == 8 and meta["args"]["cam_lr_mult"] == 10
    assert (meta["args"]["dit_heads"], meta["args"]["dit_head_dim"], meta["args"]["dit_ffn"]) == (8, 16, 256)
    assert not meta["args"].get("dit_init")
    bundled = resolve_model_path("tiny-recam3d")
    new = torch.load(folder / "recammaster.ckpt", weights_only=True)
    old = torch.load(os.path.join(bundled, "recammaster.ckpt"), weights_only=True)
    assert all(v.device.type == "cpu" for v in new.values())
    block = lambda k, n: k.replace("blocks.0.", f"blocks.{n}.")  # noqa: E731
    per_block = [k for k in old if k.startswith("blocks.0.")]
    shared = [k for k in old if not k.startswith("blocks.")]
    assert set(new) == set(shared) | {block(k, n) for k in per_block for n in range(8)}
    # the bundled DiT is the same width (8 heads of 16, FFN 256) with 4 blocks: every shape is its, block for block
    assert len({k.split(".")[1] for k in old if k.startswith("blocks.")}) == 4
    assert all(tuple(new[block(k, n)].shape) == tuple(old[k].shape) for k in per_block for n in range(8))
    assert all(tuple(new[k].shape) == tuple(old[k].shape) for k in shared)
    assert tuple(new["blocks.0.cam_encoder.weight"].shape) == (128, 12)
    assert {f"blocks.{n}.cam_encoder.weight" for n in range(8)} <= set(new)
    plain = WanTransformer3DModel.from_pretrained(folder / "transformer")
    assert plain.config.num_layers == 8 and plain.config.num_attention_heads == 8
    start = json.loads((tmp_path / "start.json").read_text())
    assert start["n_samples"] == 2 and 0.0 <= start["cam_score_mean"] <= 1.0
    assert "held-out cam_score" in proc.stdout
    # what comes back from the device: one tar of the folder with its DiT in float16, the same tensors rounded
    import tarfile

    with tarfile.open(tmp_path / "tiny-recam3d-gpu-f16.tar") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    half = torch.load(tmp_path / "back" / "tiny-recam3d-gpu-f16" / "recammaster.ckpt", weights_only=True)
    assert set(half) == set(new) and all(v.dtype == torch.float16 for v in half.values())
    assert all(torch.equal(half[k], new[k].half()) for k in new)
    assert json.loads((tmp_path / "back" / "tiny-recam3d-gpu-f16" / "pretrain_meta.json").read_text())["dit_dtype"] \
        == "float16"


def test_gpu_recam3d_grpo_stage_dry_run_trains_each_seed_and_prints_its_curve(tmp_path):
    """scripts/gpu_recam3d.sh --dry-run --grpo FOLDER: the device's second command on the CPU, shrunk to one epoch of
    one group. recam3d_tiny_grpo runs from the folder once per seed, side by side; grpo.json holds each seed's held-out
    curve (the evals at epochs 0 and 1), each seed's export is written, and stdout prints one line per seed. A
    folder without a ReCamMaster checkpoint is refused in one line, exit 2."""
    import json
    import subprocess

    from ddpo_grpo.models import resolve_model_path

    folder = resolve_model_path("tiny-recam3d")
    env = dict(os.environ, OUT=str(tmp_path), GRPO_SEEDS="42 1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_recam3d.sh", "--dry-run", "--grpo", folder], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "grpo.json").read_text())
    assert res["model"] == folder and list(res["seeds"]) == ["42", "1"]
    for seed, curve in res["seeds"].items():
        assert [e for e, _ in curve] == [0, 1]
        assert all(0.0 <= v <= 1.0 for _, v in curve)
        assert (tmp_path / "grpo" / f"seed{seed}" / "export" / "recammaster.ckpt").is_file()
        assert f"seed {seed}: held-out cam_score" in proc.stdout
    import tarfile

    with tarfile.open(tmp_path / "grpo_summaries.tar") as tar:  # what comes back from the device: the summaries
        assert sorted(tar.getnames()) == sorted(f"grpo/seed{s}/summary.json" for s in ("42", "1"))
    bad = subprocess.run(["bash", "scripts/gpu_recam3d.sh", "--dry-run", "--grpo", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no recammaster.ckpt" in bad.stderr


@pytest.mark.parametrize("patch", [1, 2])
def test_pretraining_dit_patch_sets_the_tokens_and_trains_through_the_trainers_denoiser(patch):
    """pretrain_recam_video.py --dit-patch: the DiT build_parts makes has that spatial patch (8 x 12 latents: 8 x 12
    tokens a frame at 1, 4 x 6 at 2), and stage 2's loss (velocity_error through RecamDenoiser, the module the trainer
    samples with) runs on the 3-D world's latent shape with a finite gradient into the camera layers."""
    import torch

    from benchmarks.pretrain_recam_video import build_parts, velocity_error
    from ddpo_grpo.models.recam import RecamDenoiser, add_camera_layers

    torch.manual_seed(0)
    tr = add_camera_layers(build_parts(0, dit_patch=patch)["transformer"])
    assert tuple(tr.config.patch_size) == (1, patch, patch)
    tokens = []
    tr.patch_embedding.register_forward_hook(lambda m, i, o: tokens.append(o.shape[-2:]))
    x0, src = torch.randn(2, 8, 3, 8, 12), torch.randn(2, 8, 3, 8, 12)
    err = velocity_error(RecamDenoiser(tr), x0, src, torch.randn(2, 3, 12), torch.randn(2, 16, 32),
                         torch.tensor([0.3, 0.9]), torch.randn_like(x0))
    assert err.shape == x0.shape and torch.isfinite(err).all()
    assert tuple(tokens[0]) == (8 // patch, 12 // patch)
    err.pow(2).mean().backward()
    cam = [p.grad for n, p in tr.named_parameters() if "cam_encoder" in n and p.grad is not None]
    assert cam and all(torch.isfinite(g).all() for g in cam)


@pytest.mark.parametrize("fraction, flipped, offset", [(1.0, 8, 0.0), (0.0, 0, 0.0), (0.5, None, 0.5)])
def test_pretraining_mislabelled_by_noise_trains_on_the_coupled_labels(tmp_path, fraction, flipped, offset):
    """pretrain_recam_video.py --mislabel-by noise end to end (a 6-clip pool, 2 DiT steps of 4 from the bundled
    tiny-recam3d): it trains and saves, and its pretrain_meta.json counts the draws that carried the opposite camera:
    all of them at fraction 1, none at 0 (the threshold's ends). With --noise-offset the same draws carry the offset
    (counted once, so never more than the draws) and the probe's reading before the first step is saved, finite, at
    both levels."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "benchmarks/pretrain_recam_video.py", "--world", "room3d", "--supersample",
                           "1", "--mislabel", "opposite", "--mislabel-by", "noise", "--mislabel-fraction", str(fraction),
                           "--pool", "6", "--vae-from", "assets/tiny-recam3d", "--dit-init", "tiny-recam3d",
                           "--dit-heads", "8", "--dit-ffn", "256", "--dit-steps", "2", "--batch", "4", "--noise-offset", str(offset),
                           "--out", str(tmp_path / "m")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "m" / "pretrain_meta.json").read_text())
    assert meta["args"]["mislabel_by"] == "noise" and meta["draws"] == 8
    if flipped is None:
        assert 0 <= meta["opposite_draws"] <= 8
    else:
        assert meta["opposite_draws"] == flipped
    if offset:
        reads = meta["noise_reads"]["0"]
        assert set(reads) == {"0.95", "0.8"} and all(np.isfinite(v) for v in reads.values())
    else:
        assert meta["noise_reads"] == {}


@pytest.mark.parametrize("kinds, mislabel_kinds, camera", [("", "pan,tilt,dolly,translate,arc", 8), ("arc", "dolly", 0)])
def test_pretraining_mislabel_kinds_flips_the_camera_of_those_kinds_only(tmp_path, kinds, mislabel_kinds, camera):
    """--mislabel-kinds: at fraction 1 every draw's noise reads above the threshold, so every draw carries the offset
    (opposite_draws 8 of 8); the opposite camera only where the draw's clip is of the named kinds: all of them when all
    five are named, none when the pool (--kinds arc: the 6-clip pool's two arcs) has no clip of those kinds."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "benchmarks/pretrain_recam_video.py", "--world", "room3d", "--supersample",
                           "1", "--mislabel", "opposite", "--mislabel-by", "noise", "--mislabel-fraction", "1",
                           "--mislabel-kinds", mislabel_kinds, *(["--kinds", kinds] if kinds else []),
                           "--pool", "6", "--vae-from", "assets/tiny-recam3d", "--dit-init", "tiny-recam3d",
                           "--dit-heads", "8", "--dit-ffn", "256", "--dit-steps", "2", "--batch", "4", "--noise-offset",
                           "1", "--out", str(tmp_path / "m")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "m" / "pretrain_meta.json").read_text())
    assert (meta["draws"], meta["opposite_draws"], meta["opposite_camera_draws"]) == (8, 8, camera)
    assert meta["mislabel_kinds"] == mislabel_kinds.split(",")


def test_pretraining_s_cam_lr_mult_gives_exactly_the_camera_layers_their_multiple_of_the_lr():
    """pretrain_recam_video.dit_optimizer (--cam-lr-mult): every parameter of the DiT in one AdamW group; those of
    ReCamMaster's camera layers (cam_encoder and projector: four tensors a block) at lr * the multiple, the rest at
    lr; a multiple of 1 is one group."""
    from benchmarks.pretrain_recam_video import build_parts, dit_optimizer
    from ddpo_grpo.models.recam import add_camera_layers

    tr = add_camera_layers(build_parts(0)["transformer"])
    opt = dit_optimizer(tr, 5e-4, 10.0)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert len(lr_of) == len(list(tr.parameters()))
    cam = {id(p) for b in tr.blocks for m in (b.cam_encoder, b.projector) for p in m.parameters()}
    assert len(cam) == 4 * len(tr.blocks)
    assert all(lr_of[i] == pytest.approx(5e-3, rel=1e-12) for i in cam)
    assert all(v == pytest.approx(5e-4, rel=1e-12) for i, v in lr_of.items() if i not in cam)
    assert len(dit_optimizer(tr, 5e-4, 1.0).param_groups) == 1


def test_pretraining_s_dit_trainable_trains_exactly_the_named_parameters():
    """pretrain_recam_video.dit_optimizer's `trainable` (--dit-trainable): only the parameters whose names hold a
    fragment train (requires_grad, and in the optimizer), by the trainer's own rule (build.train_only, which
    train.trainable_modules uses): ReCamMaster's set is self-attention and the camera layers, four blocks' worth; a
    fragment that names nothing is one ConfigError line."""
    from benchmarks.pretrain_recam_video import build_parts, dit_optimizer
    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.models.recam import ADAPTER, add_camera_layers

    tr = add_camera_layers(build_parts(0)["transformer"])
    opt = dit_optimizer(tr, 5e-4, 10.0, ",".join(ADAPTER.full_trainable))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    named = {n: p for n, p in tr.named_parameters()}
    want = {n for n in named if ".attn1." in n or ".cam_encoder." in n or ".projector." in n}
    assert want and len(want) < len(named)
    assert {n for n, p in named.items() if p.requires_grad} == want
    assert in_opt == {id(named[n]) for n in want}
    cam = [p for b in tr.blocks for m in (b.cam_encoder, b.projector) for p in m.parameters()]
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert all(lr_of[id(p)] == pytest.approx(5e-3, rel=1e-12) for p in cam)
    with pytest.raises(ConfigError, match="names no parameter"):
        dit_optimizer(add_camera_layers(build_parts(0)["transformer"]), 5e-4, 1.0, "no_such_layer.")


"""MultiCamVideo in (worlds/recam/multicam.py): a folder in the dataset's layout written here by the test's own code
(PyAV + JSON in Unreal Engine's row layout, not the library's writers); its camera numbers against the test's own
reading of ReCamMaster's conversion, the split by scene, damaged and missing files, scripts/recam_cameras.py, a
user's folder with ReCamMaster's trajectories, and ReCamMaster's ten trajectories as shipped."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddpo_grpo.errors import ConfigError
from helpers import write_mp4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VID_H, VID_W, VID_FRAMES, CAMS, SCENES = 40, 56, 81, 3, 4


def ue_rows(yaw, pitch, loc_cm):
    """Unreal Engine camera-to-world rows [forward 0] [right 0] [up 0] [location 1] for a camera turned by yaw (about
    up, towards right) and pitch (up), UE axes X forward, Y right, Z up."""
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    fwd = np.array([cp * cy, cp * sy, sp])
    right = np.array([-sy, cy, 0.0])
    up = np.cross(fwd, right) * -1  # UE is left-handed: up = right x forward
    return [list(fwd) + [0], list(right) + [0], list(up) + [0], list(loc_cm) + [1]]


def as_text(rows):
    return " ".join("[" + " ".join(f"{v:.6f}" for v in r) + "]" for r in rows) + " "


def own_numbers(extr, src, tgt, frames):
    """ReCamMaster's conversion as the test reads it: camera axes from the UE rows (x = right, y = -up, z = forward),
    metres, then the target's pose in the source camera's frame-0 coordinates."""
    def c2w(text):
        rows = np.array([[float(v) for v in r.strip("[] ").split()] for r in text.strip().split("] [")])
        m = np.eye(4)
        m[:3, 0], m[:3, 1], m[:3, 2], m[:3, 3] = rows[1, :3], -rows[2, :3], rows[0, :3], rows[3, :3] / 100
        return m
    inv = np.linalg.inv(c2w(extr["frame0"][f"cam{src:02d}"]))  # as ReCamMaster: a full inverse (6-decimal text is
    return np.array([(inv @ c2w(extr[f"frame{f}"][f"cam{tgt:02d}"]))[:3].reshape(12) for f in frames])  # not orthonormal)


@pytest.fixture(scope="module", autouse=True)
def check_cache(tmp_path_factory):
    """The dataset check's verdicts (multicam.check_scenes) kept in a folder of this module's, also for the trainer
    subprocesses (they inherit the environment)."""
    before = os.environ.get("DDPO_GRPO_CACHE")
    os.environ["DDPO_GRPO_CACHE"] = str(tmp_path_factory.mktemp("ddpo_cache"))
    yield os.environ["DDPO_GRPO_CACHE"]
    if before is None:
        os.environ.pop("DDPO_GRPO_CACHE")
    else:
        os.environ["DDPO_GRPO_CACHE"] = before


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """ROOT/train/f18_aperture10/sceneK/{videos/camNN.mp4, cameras/camera_extrinsics.json} + metadata.csv."""
    root = tmp_path_factory.mktemp("MultiCamVideo")
    g = np.random.default_rng(0)
    lines = ["file_name,text"]
    for k in range(1, SCENES + 1):
        scene = root / "train" / "f18_aperture10" / f"scene{k}"
        (scene / "videos").mkdir(parents=True)
        (scene / "cameras").mkdir()
        extr = {}
        starts = [(g.uniform(-1, 1), g.uniform(-.3, .3), g.uniform(-500, 500, 3)) for _ in range(CAMS)]
        ends = [(g.uniform(-.4, .4), g.uniform(-.2, .2), g.uniform(-100, 100, 3)) for _ in range(CAMS)]
        for f in range(VID_FRAMES):
            a = f / (VID_FRAMES - 1)
            extr[f"frame{f}"] = {f"cam{c + 1:02d}": as_text(ue_rows(s[0] + a * e[0], s[1] + a * e[1], s[2] + a * e[2]))
                                 for c, (s, e) in enumerate(zip(starts, ends))}
        (scene / "cameras" / "camera_extrinsics.json").write_text(json.dumps(extr))
        for c in range(1, CAMS + 1):
            blocks = g.integers(0, 256, (5, 7, 3))
            frames = np.stack([np.roll(np.kron(blocks, np.ones((8, 8, 1))), f // 4, axis=1) for f in range(VID_FRAMES)])
            write_mp4(scene / "videos" / f"cam{c:02d}.mp4", frames.astype(np.uint8))
            lines.append(f"f18_aperture10/scene{k}/videos/cam{c:02d}.mp4,\"scene {k} seen by camera {c}\"")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root


def test_camera_numbers_are_recammasters_relative_to_the_source(dataset):
    from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

    ds = MultiCamConditions(str(dataset), "all", num_frames=81, height=32, width=48)
    assert len(ds) == SCENES * CAMS * (CAMS - 1)
    for i in (0, 5, len(ds) - 1):
        it = ds[i]
        extr = json.load(open(dataset / "train" / it["scene"].split("train/")[-1] / "cameras" / "camera_extrinsics.json"))
        want = own_numbers(extr, it["source_cam"], it["target_cam"], range(0, 81, 4))
        assert it["cameras"].shape == (21, 12)
        assert np.abs(it["cameras"].numpy() - want).max() < 1e-5
        assert it["index"] == (int(it["scene"].split("scene")[-1]) - 1) * 10000 + it["source_cam"] * 100 + it["target_cam"]
        assert it["prompt"] == f"scene {it['scene'].split('scene')[-1]} seen by camera {it['target_cam']}"
    # source != target: frame 0 is not the identity (the source camera's frame, not the target's)
    assert np.abs(ds[0]["cameras"][0].numpy() - np.eye(3, 4).reshape(12)).max() > 1e-2


def test_frames_are_cover_cropped_and_strided(dataset):
    import av
    from PIL import Image

    from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

    ds = MultiCamConditions(str(dataset), "all", num_frames=9, height=32, width=48)  # stride 10
    it = ds[1]
    path = dataset / "train" / "f18_aperture10" / "scene1" / "videos" / f"cam{it['source_cam']:02d}.mp4"
    with av.open(str(path)) as c:
        dec = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    # 40 x 56 -> scale max(48/56, 32/40) = 0.857: 34 x 48 (34.29 rounds down), crop 1 row top
    want = np.stack([np.asarray(Image.fromarray(dec[10 * f]).resize((48, 34), Image.BILINEAR))[1:33] for f in range(9)])
    got = it["source_video"].numpy()
    assert got.shape == (9, 3, 32, 48)
    assert np.abs(got - want.transpose(0, 3, 1, 2) / 255.0).max() < 1e-6
    want_cams = own_numbers(json.load(open(path.parent.parent / "cameras" / "camera_extrinsics.json")),
                            it["source_cam"], it["target_cam"], [0, 40, 80])  # latent j <-> clip 4j <-> video 40j
    assert np.abs(it["cameras"].numpy() - want_cams).max() < 1e-5


def test_split_by_scene(dataset):
    from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

    tr = MultiCamConditions(str(dataset), "train", num_frames=9, height=32, width=48, eval_fraction=0.25)
    ev = MultiCamConditions(str(dataset), "eval", num_frames=9, height=32, width=48, eval_fraction=0.25)
    scenes = lambda d: {d.scenes[p][1] for p, _, _ in d.pairs}  # noqa: E731
    assert len(scenes(ev)) == 1 and len(scenes(tr)) == SCENES - 1 and not scenes(tr) & scenes(ev)
    assert not set(tr.indices) & set(ev.indices) and len(set(tr.indices)) == len(tr)


def test_damaged_and_missing_files_are_one_line_each(dataset, tmp_path):
    import shutil

    from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

    root = tmp_path / "copy"
    shutil.copytree(dataset, root)
    bad = root / "train" / "f18_aperture10" / "scene2" / "videos" / "cam02.mp4"
    bad.write_bytes(b"\x00not an mp4" * 50)
    missing = root / "train" / "f18_aperture10" / "scene3" / "videos" / "cam01.mp4"
    missing.unlink()  # a partial download: camera_extrinsics.json lists cam01, its video is not there
    cams = root / "train" / "f18_aperture10" / "scene4" / "cameras" / "camera_extrinsics.json"
    extr = json.loads(cams.read_text())
    extr["frame40"]["cam03"] = "[1 0 0] [oops]"
    cams.write_text(json.dumps(extr))
    lines = []
    ds = MultiCamConditions(str(root), "all", num_frames=9, height=32, width=48, max_bad_fraction=0.5, log=lines.append)
    assert len(lines) == 3, lines
    assert str(bad) in lines[0] and "damaged" in lines[0] and "\n" not in lines[0]
    assert str(missing) in lines[1] and "missing (listed in" in lines[1] and "\n" not in lines[1]
    assert str(cams) in lines[2] and "frame40 cam03" in lines[2]
    assert all(not (d.scenes[p][1].endswith("scene2") and 2 in (s, t)) for d in [ds] for p, s, t in ds.pairs)
    assert len(ds) == 6 + 2 + 2 + 2  # scene1 all 3 cameras, scenes 2-4 two each
    with pytest.raises(ConfigError, match=r"3 of 12 videos / camera files .* e\.g\. .*cam02\.mp4"):
        MultiCamConditions(str(root), "all", num_frames=9, height=32, width=48, max_bad_fraction=0.1, log=lines.append)


def test_intrinsics_from_the_focal_folder_through_resize_and_crop(dataset, tmp_path):
    """f18 on ReCamMaster's 23.76 mm sensor, a 56 x 40 video cover-resized to 48 x 34 and cropped to 48 x 32 (by
    hand: fx = 18 / 23.76 * 56 * 48 / 56, fy = 18 / 23.76 * 56 * 34 / 40, the centre (27.5, 19.5) -> ((27.5 + .5) * 48
    / 56 - .5, (19.5 + .5) * 34 / 40 - .5 - 1)); a scene outside a focal folder has none unless data.fov_deg gives
    them, and a run with cam_score stops before training naming it."""
    import shutil

    from config import grpo
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.worlds.recam.multicam import MultiCamConditions

    ds = MultiCamConditions(str(dataset), "all", num_frames=9, height=32, width=48)
    k = ds[0]["intrinsics"]
    f0 = 18 / 23.76 * 56
    np.testing.assert_allclose(k, [f0 * 48 / 56, f0 * 34 / 40, 28 * 48 / 56 - .5, 20 * 34 / 40 - 1.5], rtol=1e-6)
    assert ds.missing_intrinsics() == []
    root = tmp_path / "plain"
    shutil.copytree(dataset / "train" / "f18_aperture10", root / "train" / "renders")
    cfg = grpo.get_config("recam_video_tiny")
    cfg.data.name, cfg.data.root, cfg.data.eval_fraction = "multicam", str(root), 0.25
    cfg.pretrained.height, cfg.pretrained.width = 32, 48
    with pytest.raises(ConfigError, match=r"cam_score needs the clips' intrinsics.*renders/scene\d.*fov_deg"):
        build_dataset(cfg, "train")
    cfg.data.fov_deg = 90.0  # fx = 24 / tan(45 deg)
    item = build_dataset(cfg, "train")[0]
    np.testing.assert_allclose(item["intrinsics"], [24.0, 24.0, 23.5, 15.5], rtol=1e-6)


def test_the_check_is_kept_per_process_and_between_runs_by_size_and_mtime(dataset, tmp_path, monkeypatch):
    """Every video is opened once: the second build in a process (train / eval / memory plan) reuses the verdict
    without printing its lines again; a new process (the in-process memo cleared) reads the kept verdicts, prints the
    bad lines again and opens nothing; a file whose size or mtime changed has its scene checked again, and only it."""
    import shutil

    from ddpo_grpo.worlds.recam import multicam

    root = tmp_path / "copy"
    shutil.copytree(dataset, root)
    bad = root / "train" / "f18_aperture10" / "scene2" / "videos" / "cam02.mp4"
    bad.write_bytes(b"\x00not an mp4" * 50)
    opened = []
    real_probe = multicam.probe_video
    monkeypatch.setattr(multicam, "probe_video", lambda path, needed: opened.append(path) or real_probe(path, needed))

    def build(split="train"):
        lines = []
        ds = multicam.MultiCamConditions(str(root), split, num_frames=9, height=32, width=48, eval_fraction=0.25,
                                         max_bad_fraction=0.5, log=lines.append)
        return ds, lines

    first, lines = build()
    assert len(opened) == SCENES * CAMS and len(lines) == 1 and str(bad) in lines[0]
    again, lines = build("eval")
    assert len(opened) == SCENES * CAMS and lines == []  # same process: nothing opened, nothing printed again
    assert not {first.scenes[p][1] for p, _, _ in first.pairs} & {again.scenes[p][1] for p, _, _ in again.pairs}
    monkeypatch.setattr(multicam, "_CHECKED", {})  # a new process
    kept, lines = build()
    assert len(opened) == SCENES * CAMS and len(lines) == 1 and str(bad) in lines[0]
    assert kept.pairs == first.pairs and kept.indices == first.indices
    assert np.array_equal(kept[3]["cameras"].numpy(), first[3]["cameras"].numpy())
    other = root / "train" / "f18_aperture10" / "scene3" / "videos" / "cam01.mp4"
    other.write_bytes(b"broken" * 10)  # damaged after the check: size and mtime change
    monkeypatch.setattr(multicam, "_CHECKED", {})
    again, lines = build("all")
    assert sorted(opened[SCENES * CAMS:]) == sorted(str(other.parent / f"cam{c:02d}.mp4") for c in range(1, CAMS + 1))
    assert len(lines) == 2 and str(other) in lines[1] and "damaged" in lines[1]
    assert all(not (again.scenes[p][1].endswith("scene3") and 1 in (s, t)) for p, s, t in again.pairs)


def test_recam_cameras_script(dataset):
    scene = dataset / "train" / "f18_aperture10" / "scene2"
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "recam_cameras.py"), *a],  # noqa
                                    capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    r = run(str(scene), "1", "3")
    assert r.returncode == 0, r.stderr
    got = np.array(json.loads(r.stdout))
    want = own_numbers(json.load(open(scene / "cameras" / "camera_extrinsics.json")), 1, 3, range(0, 81, 4))
    assert got.shape == (21, 12) and np.abs(got - want).max() < 1e-9
    for args in ([str(scene), "1", "9"], [str(dataset), "1", "2"], [str(scene), "1", "2", "--num-frames", "8"]):
        r = run(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_recammaster_trajectories_as_published():
    from ddpo_grpo.worlds.recam.recammaster_cameras import motion_summary, trajectory_numbers

    # cam_type 1 (pan right), frame 80 in the published file: rows [0.940432 0.339982 0 0] [-0.339982 0.940432 0 0]
    # [0 -0 1 0] at frame 0's location; by hand: a turn about the camera's y axis, z towards +x (right)
    c, s = 0.940432, 0.339982
    assert np.allclose(trajectory_numbers(1)[-1], [c, 0, s, 0, 0, 1, 0, 0, -s, 0, c, 0], atol=1e-6)
    assert np.allclose(trajectory_numbers("pan left")[-1], [c, 0, -s, 0, 0, 1, 0, 0, s, 0, c, 0], atol=1e-6)
    want = {1: (19.9, 0), 3: (9.9, 0), 5: (0, 1.99), 7: (14.0, 0.99), 9: (29.8, 2.06)}
    for k, (deg, metres) in want.items():
        m = motion_summary(trajectory_numbers(k))
        assert abs(m["rotation_deg"] - deg) < 0.1 and abs(np.linalg.norm(m["translation_m"]) - metres) < 0.01, (k, m)
    assert np.allclose(trajectory_numbers(5)[-1][[3, 7, 11]], [0, 0, 1.988], atol=1e-3)  # zoom in: forward along z
    assert trajectory_numbers(9, 3).shape == (3, 12)  # a short clip: poses 0, 10, 20 of 21
    assert np.array_equal(trajectory_numbers(9, 3), trajectory_numbers(9)[[0, 10, 20]])
    with pytest.raises(ConfigError, match="cam_type 1-10"):
        trajectory_numbers(11)


def test_user_folder_with_recammaster_trajectories(dataset, tmp_path):
    from ddpo_grpo.worlds.recam.folder import RecamFolder
    from ddpo_grpo.worlds.recam.recammaster_cameras import trajectory_numbers

    (tmp_path / "videos").mkdir()
    src = dataset / "train" / "f18_aperture10" / "scene1" / "videos"
    for n in (1, 2):
        (tmp_path / "videos" / f"{n}.mp4").write_bytes((src / f"cam0{n}.mp4").read_bytes())
    (tmp_path / "metadata.csv").write_text('file_name,text\n1.mp4,"a dancer"\n2.mp4,"a street"\n')
    ds = RecamFolder(str(tmp_path), "1,zoom out", num_frames=9, height=32, width=48)
    assert len(ds) == 4 and ds.indices == [1, 6, 101, 106]
    it = ds[3]
    assert it["prompt"] == "a street" and it["source_video"].shape == (9, 3, 32, 48)
    assert torch.equal(it["cameras"], torch.from_numpy(trajectory_numbers(6, 3)))
    with pytest.raises(ConfigError, match="recam_folder: .*3.mp4: missing"):
        (tmp_path / "metadata.csv").write_text('file_name,text\n3.mp4,"x"\n')
        RecamFolder(str(tmp_path), "1", num_frames=9, height=32, width=48)


@pytest.mark.timeout(600)
def test_trains_recam_video_tiny_non_square_on_multicam(dataset, tmp_path):
    """scripts/train.py on recam_video_tiny's model at 32 x 48 px with the MultiCamVideo folder (one damaged video: one
    line naming it, its pairs left out); export.json records the size; a folder with too many bad files exits 2
    before training with one line."""
    import shutil

    from helpers import cpu_env

    root = tmp_path / "data"
    shutil.copytree(dataset, root)
    bad = root / "train" / "f18_aperture10" / "scene1" / "videos" / "cam03.mp4"
    bad.write_bytes(b"broken" * 100)
    args = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:recam_video_tiny",
            "--config.data.name=multicam", f"--config.data.root={root}", "--config.data.eval_fraction=0.25",
            "--config.pretrained.height=32", "--config.pretrained.width=48", "--config.num_epochs=1",
            "--config.save_freq=0", "--config.eval_freq=0", "--config.logging.wandb=False",
            "--config.logging.tensorboard=False", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1",
            "--config.sample.k=4", "--config.train.batch_size=4", "--config.train.gradient_accumulation_steps=1",
            "--config.sample.num_steps=2",  # the recipe's own reward: cam_score, read in 3-D from the intrinsics
            "--config.sample.flow_grid=recammaster", "--config.sample.flow_shift=5.0",  # the trainer samples on it
            f"--config.logdir={tmp_path / 'logs'}", "--config.run_name=mc"]
    r = subprocess.run(args + ["--config.logging.debug_dump=True"], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "grid recammaster, shift 5" in r.stdout  # the run's scheduler note: the grid reached the sampler's scheduler
    named = [line for line in (r.stdout + r.stderr).splitlines() if str(bad) in line]
    assert len(named) == 1 and "damaged" in named[0]  # one line, though the dataset is built 4 times (splits, plan)
    # what it trained: training-split pairs only, of scenes the held-out split does not hold (index // 10000 = scene)
    from config import grpo
    from ddpo_grpo.trainer.run.data import build_dataset

    cfg = grpo.get_config("recam_video_tiny")
    cfg.data.name, cfg.data.root, cfg.data.eval_fraction = "multicam", str(root), 0.25
    cfg.pretrained.height, cfg.pretrained.width = 32, 48
    train, held = build_dataset(cfg, "train"), build_dataset(cfg, "eval")
    held_scenes = {i // 10000 for i in held.indices}
    assert len(held_scenes) == 1 and not held_scenes & {i // 10000 for i in train.indices}
    dump = json.load(open(sorted((tmp_path / "logs" / "mc" / "debug").glob("*.json"))[0]))
    keys = set(int(k) for k in dump["keys_all"])
    assert keys and keys <= set(train.indices) and not {k // 10000 for k in keys} & held_scenes
    history = json.load(open(tmp_path / "logs" / "mc" / "summary.json"))["history"][0]
    assert "cam_score/cam_score_accuracy" in history  # the recipe's own reward ran (read in 3-D: no 2-D motions here)
    exp = json.load(open(tmp_path / "logs" / "mc" / "export" / "export.json"))
    assert (exp["height"], exp["width"], exp["num_frames"]) == (32, 48, 9)
    r = subprocess.run(args + ["--config.data.max_bad_fraction=0.0"], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if "max_bad_fraction" in line]
    assert len(err) == 1 and "cam03.mp4" in err[0]

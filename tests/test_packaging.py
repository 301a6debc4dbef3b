"""A wheel (what `pip install .` installs, non-editable) carries the bundled models and the reward entry points,
and an installed copy finds its models relative to the package, not to a source checkout. In the checkout the
models are the top-level assets/ (beside ddpo_grpo/), which setup.py maps into the wheel as ddpo_grpo/assets/."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ddpo_grpo")
ASSETS = os.path.join(ROOT, "assets")
BUNDLED = ("tiny-t2i", "tiny-t2i-noisy", "tiny-flow", "tiny-recam", "tiny-recam-video", "tiny-recam3d")
WORLD_REWARDS = {
    "toyworld": "ddpo_grpo.worlds.toyworld.reward:make_toyworld_reward",
    "cam_score": "ddpo_grpo.worlds.recam.cam_score:make_cam_score",
    "unifiedscore": "ddpo_grpo.worlds.recam.unifiedscore:make_unifiedscore",
    "cam_margin": "ddpo_grpo.worlds.room3d.reward:make_cam_margin",
    "view_match": "ddpo_grpo.worlds.room3d.reward:make_view_match",
    "colour_share": "ddpo_grpo.worlds.toyworld.hackable:make_colour_share_reward",
}
# The in-package adapters, registered as a user's adapter plugin would be (models/registry.py).
MODEL_ADAPTERS = {cls: f"ddpo_grpo.models.{mod}:ADAPTER" for cls, mod in (
    ("StableDiffusionPipeline", "sd"), ("StableDiffusionXLPipeline", "sdxl"), ("StableDiffusion3Pipeline", "sd3"),
    ("FluxPipeline", "flux"), ("WanPipeline", "wan"))}


def asset_files():
    """Paths (relative to assets/, '/'-separated) of every file of the bundled models."""
    out = []
    for name in BUNDLED:
        for dirpath, _, files in os.walk(os.path.join(ASSETS, name)):
            out += [os.path.relpath(os.path.join(dirpath, f), ASSETS).replace(os.sep, "/") for f in files]
    return sorted(out)


def test_checkout_has_the_models_at_the_top_level():
    """The promised layout: assets/ beside ddpo_grpo/, and the checkout (editable install) reads it in place."""
    import ddpo_grpo.models as m
    assert os.path.dirname(os.path.dirname(m.__file__)) == PKG, m.__file__
    assert m.ASSETS_DIR == ASSETS
    for name in BUNDLED:
        folder = m.resolve_model_path(name)  # a pixel UNet folder, or a Wan folder (tiny-recam-video)
        assert any(os.path.isfile(os.path.join(folder, sub, "config.json")) for sub in ("unet", "transformer"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel offline from a copy of what the build reads (setup.py, the package and assets/), plus a
    pretraining snapshot folder beside the models, which must stay out of the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*_snapshots")
    shutil.copytree(PKG, src / "ddpo_grpo", ignore=ignore)
    shutil.copytree(ASSETS, src / "assets", ignore=ignore)
    shutil.copytree(os.path.join(ASSETS, "tiny-t2i", "unet"), src / "assets" / "tiny-t2i_snapshots" / "step1" / "unet")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist")], cwd=src, env=env, capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (whl,) = (tmp / "dist").glob("ddpo_grpo-*.whl")
    return whl


@pytest.mark.timeout(60)
def test_wheel_has_the_models_and_the_reward_and_adapter_entry_points(wheel):
    files = asset_files()
    assert len(files) >= 20 and any(f.endswith("unet/diffusion_pytorch_model.safetensors") for f in files)
    assert sum(os.path.getsize(os.path.join(ASSETS, f)) for f in files) <= 35 * 2**20
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [f for f in files if "ddpo_grpo/assets/" + f not in names]
        assert not missing, f"not in the wheel's ddpo_grpo/assets/: {missing}"
        assert "ddpo_grpo/core/ddim_with_logprob.py" in names and "ddpo_grpo/worlds/toyworld/reward.py" in names
        # every module of the checkout, sub-packages included (the trainer's rooms: a folder without __init__.py
        # would be left out by find_packages)
        library = sorted(os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
                         for d, _, fs in os.walk(PKG) for f in fs if f.endswith(".py"))
        assert "ddpo_grpo/trainer/epoch/sampling.py" in library
        assert not [m for m in library if m not in names], [m for m in library if m not in names]
        assert not any(n.startswith(("assets/", "benchmarks/", "tests/", "scripts/")) for n in names)
        assert not any("_snapshots/" in n for n in names)
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        groups, group = {}, None
        for ln in (ln.strip() for ln in z.read(ep_file).decode().splitlines()):
            if ln.startswith("["):
                group = groups.setdefault(ln.strip("[]"), {})
            elif ln:
                name, value = ln.split(" = ")
                group[name] = value
    assert groups == {"ddpo_grpo.rewards": WORLD_REWARDS, "ddpo_grpo.models": MODEL_ADAPTERS}


@pytest.mark.timeout(60)
def test_unpacked_wheel_finds_its_own_models_and_rewards(wheel, tmp_path):
    """An unpacked wheel is what a non-editable install puts in site-packages: first on the path here."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = ("import os, ddpo_grpo.models as m, ddpo_grpo.rewards as r\n"
            "assert m.__file__.startswith(os.environ['SITE']), m.__file__\n"
            "assert m.ASSETS_DIR == os.path.join(os.path.dirname(os.path.dirname(m.__file__)), 'assets')\n"
            "for name in m.BUNDLED:\n"
            "    assert m.resolve_model_path(name).startswith(os.environ['SITE'])\n"
            "f = r.get_reward_factory('toyworld')\n"
            "assert m.model_adapter('tiny-t2i').__module__ == 'ddpo_grpo.models.sd'\n"
            "assert f.__module__ == 'ddpo_grpo.worlds.toyworld.reward'\n"
            "import sys; assert sys.modules[f.__module__].__file__.startswith(os.environ['SITE'])\n"
            "print('ok')")
    env = dict(os.environ, PYTHONPATH=str(site), SITE=str(site), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=55)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]

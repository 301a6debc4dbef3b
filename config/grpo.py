"""Named GRPO configs: `--config config/grpo.py:NAME`. This file is their index, grouped by task; the recipes live in
config/recipes/ (blocks.py holds what several share). Each starts from config/base.py, where every knob is defined and
commented, or from the named config it varies, and states only what differs."""
import importlib
import importlib.util
import os
import sys


def _recipes(*modules):
    """config/recipes/ loaded as a package of its own name (this file is loaded by path, not imported), afresh each
    time so that an edited recipe is read again."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
    package = "ddpo_grpo_config_recipes"
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        del sys.modules[key]
    spec = importlib.util.spec_from_file_location(package, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    sys.modules[package] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[package])
    return [importlib.import_module(f"{package}.{m}") for m in modules]


toy, camera, family = _recipes("toy", "recam", "families")

# The index: each task's named configs (a config's name is its function's name).
TASKS = {
    "the toy world on the bundled text-to-image model: the CPU demo and its recipes (recipes/toy.py)": [
        toy.tiny, toy.tiny_per_step, toy.tiny_raft, toy.tiny_nft, toy.tiny_kl, toy.tiny_branch, toy.ddpo],
    "the colour task: a systematic error to correct, held out (recipes/toy.py; docs/efficacy.md)": [
        toy.tiny_colour, toy.tiny_colour_nft, toy.tiny_colour_grpo, toy.tiny_colour_branch],
    "reward hacking: a proxy reward against a gold one (recipes/toy.py; docs/hacking.md)": [toy.tiny_hack],
    "DDPO's reward functions on the toy world (recipes/toy.py)": [toy.compressibility, toy.incompressibility,
                                                                  toy.aesthetic],
    "the bundled flow-matching model (recipes/toy.py)": [toy.tiny_flow, toy.tiny_flow_window],
    "camera control: ReCamMaster at real shape, its CPU analogues (2-D, 3-D), the 2-D image world (recipes/recam.py)": [
        camera.recam, camera.recam_video_tiny, camera.recam_video_tiny_grpo, camera.recam3d_tiny_grpo,
        camera.recam3d_tiny_grpo_view, camera.recam3d_tiny_nft, camera.recam_image, camera.recam_image_tiny],
    "model families: each one's tiny build on this CPU, the config for a user's folder (recipes/families.py)": [
        family.sd15_random_bench, family.sd3_tiny, family.sd3, family.sdxl_tiny, family.sdxl, family.flux_tiny,
        family.flux, family.wan_tiny, family.wan],
}
CONFIGS = {f.__name__: f for recipes in TASKS.values() for f in recipes}
globals().update(CONFIGS)  # each also as this module's NAME()


def get_config(name: str = "tiny"):
    if name not in CONFIGS:
        raise ValueError(f"unknown config name {name!r}; choose one of: {', '.join(sorted(CONFIGS))}")
    return CONFIGS[name]()

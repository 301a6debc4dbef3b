"""ddpo_grpo's own entry points: the one list.

setup.py declares them from here, so an installed ddpo_grpo registers its model adapters and its worlds' rewards exactly
as a user's package registers its own (models/registry.py, rewards/registry.py find every one through
importlib.metadata). Where the ddpo_grpo being run has no installed distribution (a checkout on PYTHONPATH without
`pip install -e .`, as on a lent device whose image has no ddpo_grpo), the registries read them from here instead, so
the same folders and rewards load. Standard library only: setup.py executes this file alone (runpy), before ddpo_grpo or
its requirements are importable.
"""
from __future__ import annotations

import importlib.metadata
from typing import Dict, List, Tuple

DISTRIBUTION = "ddpo_grpo"

# group -> (name, "module:attribute"), as setup.py's entry_points spells them
ENTRY_POINTS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    # The worlds' rewards are plugins, as a user's would be (ddpo_grpo.rewards imports no world).
    "ddpo_grpo.rewards": (
        ("toyworld", "ddpo_grpo.worlds.toyworld.reward:make_toyworld_reward"),
        # a hackable proxy (docs/hacking.md)
        ("colour_share", "ddpo_grpo.worlds.toyworld.hackable:make_colour_share_reward"),
        ("cam_score", "ddpo_grpo.worlds.recam.cam_score:make_cam_score"),
        ("unifiedscore", "ddpo_grpo.worlds.recam.unifiedscore:make_unifiedscore"),
        ("cam_margin", "ddpo_grpo.worlds.room3d.reward:make_cam_margin"),  # requested - opposite (docs/recam.md)
        ("view_match", "ddpo_grpo.worlds.room3d.reward:make_view_match"),  # looks like the requested render (docs)
    ),
    # model_index.json `_class_name` -> its adapter (models/registry.py; docs/models.md). models.recam is chosen by
    # pretrained.recam_checkpoint, not by a class name.
    "ddpo_grpo.models": (
        ("StableDiffusionPipeline", "ddpo_grpo.models.sd:ADAPTER"),
        ("StableDiffusionXLPipeline", "ddpo_grpo.models.sdxl:ADAPTER"),
        ("StableDiffusion3Pipeline", "ddpo_grpo.models.sd3:ADAPTER"),
        ("FluxPipeline", "ddpo_grpo.models.flux:ADAPTER"),
        ("WanPipeline", "ddpo_grpo.models.wan:ADAPTER"),
    ),
}


def setup_entry_points() -> Dict[str, List[str]]:
    """setup(entry_points=...): {group: ["name = module:attribute", ...]}."""
    return {group: [f"{name} = {value}" for name, value in eps] for group, eps in ENTRY_POINTS.items()}


def uninstalled_entry_points(group: str) -> List[importlib.metadata.EntryPoint]:
    """ddpo_grpo's own entry points of `group` when no ddpo_grpo distribution is installed, else [] (an installed one
    is the truth, also when its metadata predates a group: the registries then say to reinstall)."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
        return []
    except importlib.metadata.PackageNotFoundError:
        return [importlib.metadata.EntryPoint(name, value, group) for name, value in ENTRY_POINTS.get(group, ())]

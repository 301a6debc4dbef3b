"""Which adapter loads a model folder: model_index.json's `_class_name` -> a ModelAdapter, through the entry-point
group ``ddpo_grpo.models`` (the name a pipeline class as model_index.json spells it, the value the adapter object).

The in-package adapters are registered there too (setup.py, from ddpo_grpo/plugins.py's list), exactly as a user's
package would register its own::

    entry_points={"ddpo_grpo.models": ["MyCamPipeline = my_pkg.adapter:ADAPTER"]}

so an architecture comes in with one entry point and no change here (docs/models.md says how to write one). Only the
entry point of the folder's class is imported: a plugin that fails to import stops a run of its own class, in one
ConfigError line naming it, and no other. Where two distributions declare one class, ddpo_grpo's own wins (as
built-in rewards win over reward plugins), then the first on sys.path (as imports do). `register` adds one in this
process (tests, notebooks) and wins over both. A checkout run without installing ddpo_grpo (no distribution: e.g. on
PYTHONPATH on a lent device) finds its own adapters in plugins.py's list instead. models.recam is not here:
pretrained.recam_checkpoint chooses it over a WanPipeline folder (models.model_adapter).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Dict, List, Optional

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.plugins import DISTRIBUTION as OWN_DISTRIBUTION, uninstalled_entry_points

from .adapter import ModelAdapter

ENTRY_POINT_GROUP = "ddpo_grpo.models"
DEFAULT_CLASS = "StableDiffusionPipeline"  # a folder without model_index.json (the bundled models, older SD folders)

_REGISTERED: Dict[str, object] = {}  # register(): pipeline class -> adapter, this process only


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


def _entry_points() -> Dict[str, importlib.metadata.EntryPoint]:
    """Pipeline class -> its entry point: ddpo_grpo's own first, then the first on sys.path."""
    own: Dict[str, importlib.metadata.EntryPoint] = {}
    others: Dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        mine = _dist_name(ep).replace("-", "_").lower() == OWN_DISTRIBUTION
        (own if mine else others).setdefault(ep.name, ep)
    for ep in uninstalled_entry_points(ENTRY_POINT_GROUP):  # a checkout run without installing it: plugins.py's list
        own.setdefault(ep.name, ep)
    return {**others, **own}


def register(pipeline_class: str, adapter) -> None:
    """An adapter (a ModelAdapter instance) for a pipeline class in this process only: for code that builds its
    own runs. A launched run (scripts/train.py) finds adapters through the entry-point group instead."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"register({pipeline_class!r}, ...) takes a ModelAdapter instance, not {type(adapter).__name__}")
    _REGISTERED[pipeline_class] = adapter


def unregister(pipeline_class: str) -> None:
    """Remove a register() entry (mainly for tests); unknown names are ignored."""
    _REGISTERED.pop(pipeline_class, None)


def supported_classes() -> List[str]:
    """Sorted pipeline classes some adapter loads (nothing imported)."""
    return sorted(set(_REGISTERED) | set(_entry_points()))


def model_index_class(path: str) -> Optional[str]:
    """The folder's model_index.json `_class_name`, or None without that file. A model_index.json that does not name
    its pipeline class (no `_class_name`, or not a JSON object) is one ConfigError line naming the supported classes:
    guessing Stable Diffusion for it would load an SD3 / FLUX / Wan folder with the wrong adapter and fail deep inside
    diffusers."""
    f = os.path.join(path, "model_index.json")
    if not os.path.isfile(f):
        return None
    try:
        with open(f) as fh:
            index = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {path!r}: model_index.json cannot be read ({_one_line(e)})") from None
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(cls, str) or not cls:
        raise ConfigError(f"model {path!r}: model_index.json names no pipeline class (`_class_name`); add the one "
                          f"its components form, one of the supported: {', '.join(supported_classes()) or '(none)'}")
    return cls


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"  # a SyntaxError's or a traceback's newlines, folded


def adapter_for(path: str):
    """The adapter of a model folder, by its model_index.json's `_class_name` (DEFAULT_CLASS for a folder without
    model_index.json: the bundled models, older SD folders; one ConfigError line for a model_index.json without it). One
    ConfigError line for a class no adapter loads (listing those that do), and for a plugin that cannot be imported
    or whose object is not a ModelAdapter (naming the entry point and its distribution)."""
    cls = model_index_class(path) or DEFAULT_CLASS
    if cls in _REGISTERED:
        return _REGISTERED[cls]
    eps = _entry_points()
    if cls not in eps:
        known = supported_classes()
        # No entry points at all: ddpo_grpo's own metadata predates the group (a checkout installed before it).
        hint = (f"(an adapter plugin adds one under the entry-point group '{ENTRY_POINT_GROUP}': docs/models.md)"
                if known else f"(no adapter is registered under the entry-point group '{ENTRY_POINT_GROUP}': "
                              "reinstall ddpo_grpo, e.g. pip install -e .)")
        raise ConfigError(f"model {path!r} is a {cls}; supported pipeline classes: {', '.join(known) or '(none)'} "
                          f"{hint}")
    ep = eps[cls]
    where = f"adapter plugin '{ep.name} = {ep.value}' (distribution {_dist_name(ep)})"
    try:
        adapter = ep.load()
    except Exception as e:  # anything a plugin's import raises: the run stops in one line naming it
        raise ConfigError(f"model {path!r} is a {cls}, whose {where} cannot be imported: {_one_line(e)}") from None
    if isinstance(adapter, type) and issubclass(adapter, ModelAdapter):
        raise ConfigError(f"model {path!r} is a {cls}, whose {where} is the class {adapter.__name__}; the entry point "
                          f"names an instance of it (e.g. ADAPTER = {adapter.__name__}())")
    if not isinstance(adapter, ModelAdapter):
        raise ConfigError(f"model {path!r} is a {cls}, whose {where} is a {type(adapter).__name__}, not a "
                          "ddpo_grpo.models.base.ModelAdapter instance")
    return adapter


"""ddpo_grpo's own entry points (ddpo_grpo/plugins.py, the one list): setup.py declares exactly them, and a checkout run
without installing ddpo_grpo (on PYTHONPATH, as on a lent device whose image has no ddpo_grpo) still finds its model
adapters and its worlds' rewards, where the registries found none before (scripts/gpu_recam3d.sh's measurement stopped
at "supported pipeline classes: (none)" on the H200). An installed ddpo_grpo whose metadata lacks them keeps the
"reinstall" line."""
import importlib
import importlib.metadata
import json

import pytest

from ddpo_grpo import plugins
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.models.registry import adapter_for, supported_classes
from ddpo_grpo.rewards.registry import available_rewards, get_reward_factory

GROUPS = ("ddpo_grpo.models", "ddpo_grpo.rewards")


def test_the_installed_entry_points_are_plugins_list():
    """The editable install (setup.py) declares, per group, exactly plugins.ENTRY_POINTS: nothing more, nothing less."""
    for group in GROUPS:
        installed = sorted(f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group=group)
                           if ep.dist is not None and ep.dist.metadata["Name"].replace("-", "_") == "ddpo_grpo")
        assert installed == sorted(plugins.setup_entry_points()[group])
    assert plugins.uninstalled_entry_points("ddpo_grpo.models") == []  # installed here: its metadata is the truth


def _folder(tmp_path, cls):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    return str(tmp_path)


@pytest.fixture
def no_metadata(monkeypatch):
    """The process as a checkout on PYTHONPATH sees it: no ddpo_grpo distribution, none of its entry points."""
    real_dist, real_eps = importlib.metadata.distribution, importlib.metadata.entry_points

    def distribution(name):
        if name.replace("-", "_").lower() == "ddpo_grpo":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_dist(name)

    def entry_points(**kw):
        if kw.get("group") not in GROUPS:  # other libraries' lookups as they are
            return real_eps(**kw)
        return [ep for ep in real_eps(**kw)
                if ep.dist is None or ep.dist.metadata["Name"].replace("-", "_") != "ddpo_grpo"]

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_a_checkout_without_metadata_loads_its_own_adapters_and_rewards(no_metadata, tmp_path):
    for group in GROUPS:
        assert not [ep for ep in importlib.metadata.entry_points(group=group) if ep.value.startswith("ddpo_grpo.")]
    assert set(dict(plugins.ENTRY_POINTS["ddpo_grpo.models"])) <= set(supported_classes())
    for cls, value in plugins.ENTRY_POINTS["ddpo_grpo.models"]:
        module, attr = value.split(":")
        assert adapter_for(_folder(tmp_path, cls)) is getattr(importlib.import_module(module), attr)
    for name, value in plugins.ENTRY_POINTS["ddpo_grpo.rewards"]:
        module, attr = value.split(":")
        assert name in available_rewards()
        assert get_reward_factory(name) is getattr(importlib.import_module(module), attr)


def test_an_install_whose_metadata_lacks_them_still_says_reinstall(monkeypatch, tmp_path):
    real_eps = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [] if kw.get("group") in GROUPS else real_eps(**kw))
    with pytest.raises(ConfigError, match="reinstall ddpo_grpo") as e:
        adapter_for(_folder(tmp_path, "WanPipeline"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown reward 'cam_score'"):
        get_reward_factory("cam_score")

"""Every named config of config/grpo.py loads the way scripts/train.py loads it (ml_collections config_flags,
`--config config/grpo.py:NAME`) and passes the trainer's validation for the model family it names; the configs for
a user's own folder refuse without one in one line and validate with their family's tiny build in its place."""
import importlib.util
import os

import pytest
from absl import flags
from ml_collections import config_flags

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.trainer.run.validate import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(ROOT, "config", "grpo.py")

# name -> the sampler family validate_config must find (DDIM for the UNet models, flow for the flow-matching ones).
FAMILY = {
    "tiny": "ddim", "tiny_colour": "ddim", "tiny_colour_nft": "ddim", "tiny_hack": "ddim", "tiny_colour_grpo": "ddim",
    "tiny_colour_branch": "ddim", "tiny_branch": "ddim", "ddpo": "ddim", "tiny_per_step": "ddim", "tiny_raft": "ddim",
    "tiny_nft": "ddim", "tiny_kl": "ddim", "compressibility": "ddim", "incompressibility": "ddim", "aesthetic": "ddim",
    "tiny_flow": "flow", "tiny_flow_window": "flow", "recam": "flow", "recam_video_tiny": "flow", "recam_video_tiny_grpo": "flow",
    "recam3d_tiny_grpo": "flow", "recam3d_tiny_grpo_view": "flow",
    "recam3d_tiny_nft": "flow",
    "recam_image": "ddim", "recam_image_tiny": "ddim", "sd15_random_bench": "ddim",
    "sd3_tiny": "flow", "sd3": "flow", "sdxl_tiny": "ddim", "sdxl": "ddim",
    "flux_tiny": "flow", "flux": "flow", "wan_tiny": "flow", "wan": "flow",
}
# The configs for a user's folder (pretrained.model = ""), each with its family's bundled tiny build.
USER_FOLDER = {"sd3": "sd3-tiny", "sdxl": "sdxl-tiny", "flux": "flux-tiny", "wan": "wan-tiny"}


def _module():
    spec = importlib.util.spec_from_file_location("grpo_configs_names", GRPO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_index_holds_every_recipe_and_an_unknown_name_lists_them():
    """config/grpo.py's index (TASKS, by task) names every public function of config/recipes/ exactly once, each a
    module attribute too; a recipe written but not indexed, or indexed twice, fails here."""
    mod = _module()
    indexed = [f.__name__ for recipes in mod.TASKS.values() for f in recipes]
    assert len(indexed) == len(set(indexed)) == len(mod.CONFIGS)
    public = {n for m in (mod.toy, mod.camera, mod.family) for n, f in vars(m).items()
              if callable(f) and not n.startswith("_") and getattr(f, "__module__", "") == m.__name__}
    assert set(indexed) == public, f"recipes not in config/grpo.py's TASKS, or gone: {public ^ set(indexed)}"
    assert all(getattr(mod, n) is mod.CONFIGS[n] for n in indexed)
    assert set(indexed) == set(FAMILY), f"new or removed named configs: add them to FAMILY here ({public ^ set(FAMILY)})"
    with pytest.raises(ValueError, match="unknown config name 'nope'; choose one of: aesthetic, compressibility"):
        mod.get_config("nope")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_named_config_loads_through_config_flags_and_validates(name):
    argv = ["train.py", "--config", f"{GRPO}:{name}", "--config.seed=7"]
    fv = flags.FlagValues()  # as scripts/train.py defines it; the override flags are read from argv at definition
    config_flags.DEFINE_config_file("config", f"{GRPO}:tiny", flag_values=fv, sys_argv=argv)
    fv(argv)
    config = fv.config
    assert config.seed == 7  # a command-line override reaches the loaded config
    if name in USER_FOLDER:
        with pytest.raises(ConfigError, match=r"^pretrained.model: model path '' is not a folder"):
            validate_config(config, 1)
        config.pretrained.model = USER_FOLDER[name]
        config.pretrained.resolution = 32 if config.pretrained.resolution else 0  # the tiny build's size
    assert validate_config(config, 1) == FAMILY[name]


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_named_config_matches_its_golden_values(name):
    """Every field of the named config against tests/golden/configs/NAME.json: a default changed in config/base.py or
    in a named config (say, by a refactor) fails here, one line per field. A change that is meant: regenerate with
    `python tests/golden/update.py` and name it in the commit."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
    from golden_configs import differences, golden_path

    assert os.path.isfile(golden_path(name)), f"no golden values for {name!r}: run python tests/golden/update.py"
    diff = differences(name)
    assert not diff, "\n".join(diff + ["(a change that is meant: python tests/golden/update.py)"])

"""eval.group_by: the deterministic eval's reward per value of an item field (room3d: per camera preset)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.trainer.epoch.evaluation import group_means, group_value

HERE = os.path.dirname(os.path.abspath(__file__))


def test_group_means_by_hand():
    scores = np.array([0.2, 0.4, np.nan, 1.0, 0.0, 0.6])
    groups = ["pan_left", "tilt_up", "pan_left", "pan_left", "tilt_up", "zoom_in"]
    got = group_means("preset", groups, scores)
    assert got == pytest.approx({
        "eval/by_preset/pan_left": 0.6, "eval/by_preset/pan_left/n": 3.0,  # the NaN (a failed reading) left out
        "eval/by_preset/tilt_up": 0.2, "eval/by_preset/tilt_up/n": 2.0,
        "eval/by_preset/zoom_in": 0.6, "eval/by_preset/zoom_in/n": 1.0})
    only_nan = group_means("preset", ["a", "b"], np.array([np.nan, 0.5]))
    assert math.isnan(only_nan["eval/by_preset/a"]) and only_nan["eval/by_preset/a/n"] == 1.0
    with pytest.raises(ValueError, match="3 group values for 2 scores"):
        group_means("preset", ["a", "b", "c"], np.array([0.1, 0.2]))


@pytest.mark.parametrize("seed", range(5))
def test_group_means_property(seed):
    """Random groups and scores: the counts add up to n, and the count-weighted means give the overall mean."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    groups = [f"g{int(i)}" for i in rng.integers(0, 7, n)]
    scores = rng.random(n)
    got = group_means("k", groups, scores)
    keys = sorted(set(groups))
    assert sum(got[f"eval/by_k/{g}/n"] for g in keys) == n
    assert sum(got[f"eval/by_k/{g}"] * got[f"eval/by_k/{g}/n"] for g in keys) / n == pytest.approx(scores.mean())
    assert len(got) == 2 * len(keys)


def test_group_value_names_and_missing_field():
    assert group_value({"preset": "pan left"}, "preset") == "pan_left"
    assert group_value({"preset": "arc left (30°)"}, "preset") == "arc_left_30"
    assert group_value({"k": 3}, "k") == "3"
    assert group_value({"k": "!!"}, "k") == "_"
    with pytest.raises(ConfigError, match=r"eval.group_by='camera': the eval items have no such field; they have "
                                          r"index, preset, prompt$"):
        group_value({"index": 1, "prompt": "p", "preset": "x", "source_video": None}, "camera")


def test_room3d_recipes_group_by_a_field_their_eval_items_have():
    from config.grpo import get_config

    from ddpo_grpo.worlds.room3d.data import Room3DConditions

    for name in ("recam3d_tiny_grpo", "recam3d_tiny_nft"):
        assert get_config(name).eval.group_by == "preset"
    items = Room3DConditions("eval", num_frames=5, height=16, width=24)
    names = {group_value(items[i], "preset") for i in range(10)}  # held out: ReCamMaster's ten presets, one each
    assert names == {"pan_left", "pan_right", "tilt_up", "tilt_down", "zoom_in", "zoom_out", "translate_up",
                     "translate_down", "arc_left", "arc_right"}, names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [1, 2])
def test_group_means_match_the_gathered_samples(tmp_path, nproc):
    """On the trainer's own context, in 1 and 2 processes: the logged per-group means and counts are the gathered
    per-sample rewards grouped by their eval positions' prompts (tests/eval_groups_check.py)."""
    from helpers import cpu_env, launch_cmd

    cmd = launch_cmd(nproc, 29400 + 17 * nproc) + [os.path.join(HERE, "eval_groups_check.py"), str(tmp_path)]
    env = cpu_env(PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560, cwd=os.path.dirname(HERE))
    assert out.returncode == 0 and "groups ok 10" in out.stdout, (out.stdout + out.stderr)[-4000:]


def test_missing_field_stops_the_trainer_in_one_line(tmp_path):
    """A field the eval items lack: exit 2 with one line, before the first eval."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "scripts", "train.py"), "--config",
                          "config/grpo.py:tiny", "--config.eval.group_by=camera", "--config.logging.wandb=False",
                          f"--config.logdir={tmp_path}"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(HERE))
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "eval.group_by" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: eval.group_by='camera': the eval items have no such field")
    assert "Traceback" not in out.stderr and "epoch 0: eval" not in out.stdout

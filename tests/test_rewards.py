"""Reward registry, plugins and the weighted/per-step combiner (the built-in rewards: test_reward_builtins.py)."""
from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ddpo_grpo.rewards import (
    ConfigError,
    RewardComputer,
    RewardError,
    RewardResult,
    available_rewards,
    collect_rewards,
    get_reward_fn,
    register_reward,
    unregister_reward,
)
from ddpo_grpo.worlds.toyworld.reward import make_toyworld_reward

BUILTINS = ("aesthetic", "jpeg_compressibility", "jpeg_incompressibility", "toyworld")


# ----------------------------------------------------------------------------- test rewards
@pytest.fixture
def test_rewards():
    """Tiny registered rewards with known outputs; unregistered afterwards."""
    names = []

    def reg(name, factory):
        register_reward(name)(factory)
        names.append(name)

    def make_a():
        return lambda images, prompts, metadata: (
            np.array([1.0, 2.0, 3.0], np.float32)[: len(images)],
            {"hits": np.array([1.0, 0.0, 1.0], np.float32)[: len(images)]},
        )

    def make_b():
        return lambda images, prompts, metadata: (np.array([10.0, 20.0, 30.0], np.float32)[: len(images)], {})

    def make_mean_pixel():  # deterministic: mean pixel value of each image
        return lambda images, prompts, metadata: (images.flatten(1).mean(1).numpy().astype(np.float32), {})

    def make_nan_second():
        return lambda images, prompts, metadata: (np.array([0.5, np.nan, 0.5], np.float32)[: len(images)], {})

    def make_wrong_length():
        return lambda images, prompts, metadata: (np.zeros(len(images) + 1, np.float32), {})

    def make_strings():
        return lambda images, prompts, metadata: (np.array(["good"] * len(images), dtype=object), {})

    def make_raises_in_factory(x=1):
        return 1 / 0

    def make_raises_in_call():
        def fn(images, prompts, metadata):
            raise KeyError("condition")
        return fn

    reg("t_a", make_a)
    reg("t_b", make_b)
    reg("t_mean_pixel", make_mean_pixel)
    reg("t_nan_second", make_nan_second)
    reg("t_wrong_length", make_wrong_length)
    reg("t_strings", make_strings)
    reg("t_factory_raises", make_raises_in_factory)
    reg("t_call_raises", make_raises_in_call)
    yield
    for n in names:
        unregister_reward(n)


def _imgs(b=3, value=0.5, c=3, hw=8):
    return torch.full((b, c, hw, hw), value)


# ----------------------------------------------------------------------------- registry
def test_available_lists_builtins():
    names = available_rewards()
    assert set(BUILTINS) <= set(names)
    assert names == sorted(names)


def test_unknown_name_lists_available():
    with pytest.raises(ConfigError) as ei:
        get_reward_fn("no_such_reward")
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "no_such_reward" in msg and "\n" not in msg
    for name in available_rewards():
        assert name in msg


def test_factory_and_call_errors_name_the_plugin(test_rewards):
    with pytest.raises(RewardError, match=r"^reward 't_factory_raises' failed: ZeroDivisionError: division by zero$") as ei:
        get_reward_fn("t_factory_raises")
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    fn = get_reward_fn("t_call_raises")
    with pytest.raises(RewardError, match=r"reward 't_call_raises' failed: KeyError: 'condition'"):
        fn(_imgs(), [""] * 3, [{}] * 3)


def test_bad_factory_option_is_config_error(test_rewards):
    with pytest.raises(ConfigError, match="t_a"):
        get_reward_fn("t_a", nonsense=3)


def test_duplicate_registration_refused(test_rewards):
    with pytest.raises(ValueError, match="already registered"):
        register_reward("t_a")(lambda: None)


def test_toyworld_entry_point_declared():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="ddpo_grpo.rewards")}
    assert eps["toyworld"].load() is make_toyworld_reward


PLUGIN_SRC = textwrap.dedent(
    """
    import numpy as np

    def make(value=0.5):
        def constant(images, prompts, metadata):
            return np.full(len(images), value, dtype=np.float32), {"ones": np.ones(len(images), np.float32)}
        return constant

    def make_broken():
        raise ZeroDivisionError("plugin exploded")
    """
)


def test_entry_point_plugin_discovered(tmp_path, monkeypatch):
    (tmp_path / "my_reward_plugin.py").write_text(PLUGIN_SRC)
    info = tmp_path / "my_reward_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my_reward_plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[ddpo_grpo.rewards]\nconstant_half = my_reward_plugin:make\nbroken_plugin = my_reward_plugin:make_broken\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "constant_half" in available_rewards()
        fn = get_reward_fn("constant_half")
        scores, details = fn(_imgs(4), [""] * 4, [{}] * 4)
        np.testing.assert_array_equal(scores, np.full(4, 0.5, np.float32))
        assert get_reward_fn("constant_half", value=0.25)(_imgs(2), ["", ""], [{}, {}])[0].tolist() == [0.25, 0.25]
        with pytest.raises(RewardError, match=r"reward 'broken_plugin' failed: ZeroDivisionError: plugin exploded"):
            get_reward_fn("broken_plugin")
        res = RewardComputer({"constant_half": 2.0})(_imgs(2), ["", ""], [{}, {}])
        np.testing.assert_array_equal(res.avg, [1.0, 1.0])
        assert list(res.details) == ["constant_half/ones"]
    finally:
        sys.modules.pop("my_reward_plugin", None)
    monkeypatch.undo()
    assert "constant_half" not in available_rewards()


# ----------------------------------------------------------------------------- combine
def test_weighted_avg_exact_and_details_separate(test_rewards):
    comp = RewardComputer({"t_a": 2.0, "t_b": -1.0})
    res = comp(_imgs(3), [""] * 3, [{}] * 3)
    assert isinstance(res, RewardResult)
    np.testing.assert_array_equal(res.avg, np.array([-8.0, -16.0, -24.0], np.float32))
    assert res.avg.dtype == np.float32
    np.testing.assert_array_equal(res.per_fn["t_a"], [1, 2, 3])
    np.testing.assert_array_equal(res.per_fn["t_b"], [10, 20, 30])
    assert list(res.details) == ["t_a/hits"]
    np.testing.assert_array_equal(res.details["t_a/hits"], [1, 0, 1])
    np.testing.assert_array_equal(res.valid, [True, True, True])
    assert res.invalid_count == 0
    np.testing.assert_array_equal(res.final, res.avg)
    s = res.summary()
    assert s["reward_mean"] == pytest.approx(-16.0) and s["t_a/hits"] == pytest.approx(2 / 3)


def test_per_step_modes_on_hand_made_trajectory(test_rewards):
    # B=2, T=3, constant images so the mean pixel value is the score.
    steps = np.array([[0.1, 0.4, 0.3], [0.5, 0.5, 0.9]], np.float32)
    x0 = torch.from_numpy(steps)[:, :, None, None, None].expand(2, 3, 3, 4, 4).contiguous()
    final = torch.from_numpy(np.array([0.3, 0.9], np.float32))[:, None, None, None].expand(2, 3, 4, 4)
    comp = RewardComputer({"t_mean_pixel": 1.0})
    args = (final, ["", ""], [{}, {}])

    res = comp(*args, per_step="none")
    assert res.avg.shape == (2,)
    np.testing.assert_allclose(res.avg, [0.3, 0.9], rtol=1e-6)

    res = comp(*args, per_step="broadcast", num_steps=3)
    assert res.avg.shape == (2, 3)
    np.testing.assert_allclose(res.avg, [[0.3] * 3, [0.9] * 3], rtol=1e-6)

    res = comp(*args, x0_images=x0, per_step="x0")
    assert res.avg.shape == (2, 3) and res.per_fn["t_mean_pixel"].shape == (2, 3)
    np.testing.assert_allclose(res.avg, steps, rtol=1e-6)
    np.testing.assert_allclose(res.final, [0.3, 0.9], rtol=1e-6)

    res = comp(*args, x0_images=x0, per_step="x0_gain")
    np.testing.assert_allclose(res.avg, [[0.1, 0.3, -0.1], [0.5, 0.0, 0.4]], atol=1e-6)
    np.testing.assert_allclose(res.avg.cumsum(1), steps, atol=1e-6)  # gains telescope to the x0 scores
    np.testing.assert_allclose(res.per_fn["t_mean_pixel"], steps, rtol=1e-6)  # raw scores, not gains

    # weights scale per-step rewards too
    res = RewardComputer({"t_mean_pixel": -2.0})(*args, x0_images=x0, per_step="x0_gain")
    np.testing.assert_allclose(res.avg, -2 * np.array([[0.1, 0.3, -0.1], [0.5, 0.0, 0.4]]), atol=1e-6)

    with pytest.raises(ValueError, match="x0_images"):
        comp(*args, per_step="x0")
    with pytest.raises(ValueError, match="num_steps"):
        comp(*args, per_step="broadcast")
    with pytest.raises(ConfigError, match="per_step"):
        comp(*args, per_step="dense")


def test_nan_marks_sample_invalid(test_rewards):
    res = RewardComputer({"t_a": 1.0, "t_nan_second": 1.0})(_imgs(3), [""] * 3, [{}] * 3)
    np.testing.assert_array_equal(res.valid, [True, False, True])
    assert res.invalid_count == 1
    assert np.isnan(res.avg[1]) and np.isnan(res.final[1])
    np.testing.assert_allclose(res.avg[[0, 2]], [1.5, 3.5])
    assert res.summary()["reward_mean"] == pytest.approx(2.5)  # over valid samples only

    res = RewardComputer({"t_nan_second": 1.0})(_imgs(3), [""] * 3, [{}] * 3, per_step="broadcast", num_steps=2)
    assert np.isnan(res.avg[1]).all() and np.isfinite(res.avg[[0, 2]]).all()


def test_wrong_length_and_dtype_are_errors(test_rewards):
    with pytest.raises(RewardError, match=r"reward 't_wrong_length' returned scores of shape \(4,\); expected \(3,\)"):
        RewardComputer({"t_wrong_length": 1.0})(_imgs(3), [""] * 3, [{}] * 3)
    with pytest.raises(RewardError, match=r"reward 't_strings' returned scores of dtype object"):
        RewardComputer({"t_strings": 1.0})(_imgs(3), [""] * 3, [{}] * 3)


def test_computer_config_errors(test_rewards):
    with pytest.raises(ConfigError, match="available rewards"):
        RewardComputer({"t_a": 1.0, "missing_reward": 1.0})
    with pytest.raises(ConfigError, match="finite"):
        RewardComputer({"t_a": float("nan")})
    with pytest.raises(ConfigError, match="t_b"):
        RewardComputer({"t_a": 1.0}, fn_kwargs={"t_b": {}})


def test_executor_submit_matches_call(test_rewards):
    comp_sync = RewardComputer({"t_a": 2.0, "t_mean_pixel": 1.0})
    images = torch.rand(3, 3, 4, 4)
    expected = comp_sync(images, [""] * 3, [{}] * 3)
    with ThreadPoolExecutor(max_workers=1) as ex:
        comp = RewardComputer({"t_a": 2.0, "t_mean_pixel": 1.0}, executor=ex)
        fut = comp.submit(images, [""] * 3, [{}] * 3)
        images.zero_()  # the caller reuses its buffer; the submitted batch was cloned
        got = fut.result(timeout=10)
    np.testing.assert_array_equal(got.avg, expected.avg)
    np.testing.assert_array_equal(got.valid, expected.valid)
    assert got.details.keys() == expected.details.keys()
    # without an executor submit returns a finished future; errors surface from .result()
    fut = RewardComputer({"t_wrong_length": 1.0}).submit(_imgs(3), [""] * 3, [{}] * 3)
    assert fut.done()
    with pytest.raises(RewardError):
        fut.result()


def test_collect_rewards_concatenates_batches_and_names_a_failure(test_rewards):
    comp = RewardComputer({"t_a": 1.0})
    res = collect_rewards([comp.submit(_imgs(3), [""] * 3, [{}] * 3), comp.submit(_imgs(2), [""] * 2, [{}] * 2)])
    np.testing.assert_array_equal(res.avg, [1.0, 2.0, 3.0, 1.0, 2.0])
    bad = RewardComputer({"t_call_raises": 1.0}).submit(_imgs(3), [""] * 3, [{}] * 3)
    with pytest.raises(RewardError, match="t_call_raises"):
        collect_rewards([comp.submit(_imgs(3), [""] * 3, [{}] * 3), bad])

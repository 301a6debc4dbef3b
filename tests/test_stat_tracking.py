import io
import math
import pickle

import numpy as np
import pytest
import torch

from ddpo_grpo.core.stat_tracking import PerPromptStatTracker
from ddpo_grpo.trainer.checks.verification import verify_groups


def test_group_mode_per_column_mean0_std1_random():
    rng = np.random.default_rng(0)
    k, n_keys, T = 4, 6, 5
    keys = [f"p{i}" for i in range(n_keys) for _ in range(k)]
    order = rng.permutation(len(keys))  # groups need not be contiguous
    keys = [keys[i] for i in order]
    rewards = rng.normal(size=(len(keys), T))
    tracker = PerPromptStatTracker()
    adv = tracker.update(keys, torch.from_numpy(rewards))
    assert adv.shape == (24, T) and adv.dtype == np.float32
    for key in set(keys):
        a = adv[[i for i, kk in enumerate(keys) if kk == key]].astype(np.float64)
        np.testing.assert_allclose(a.mean(0), 0.0, atol=1e-6)
        np.testing.assert_allclose(a.std(0), 1.0, atol=1e-6)
    verify_groups(np.array([int(kk[1:]) for kk in keys]), adv, np.ones(len(keys), bool), rewards, k, tracker)
    stats = tracker.get_stats()
    assert stats["group_size"] == 4.0 and stats["trained_prompt_num"] == 6 and stats["zero_std_ratio"] == 0.0


def test_zero_std_group_is_exactly_zero_in_every_mode():
    keys = ["a"] * 3 + ["b"] * 3
    rewards = np.array([0.1, 0.1, 0.1, 0.0, 1.0, 2.0])  # 0.1 is not exact in binary: mean has rounding noise
    for mode in ("group", "global", "none"):
        adv = PerPromptStatTracker(std_mode=mode).update(keys, rewards)
        assert np.all(adv[:3] == 0.0), mode
        assert np.all(np.isfinite(adv))
    # A batch that is constant everywhere also gives zeros (and no NaN) in running mode.
    adv = PerPromptStatTracker(std_mode="running").update(keys, np.full(6, 0.3))
    assert np.all(adv == 0.0)


def test_four_std_modes_by_hand():
    keys = ["a", "a", "b", "b"]
    r = np.array([1.0, 2.0, 3.0, 4.0])
    # Group means 1.5, 3.5; group (population) stds 0.5; batch mean 2.5, batch std sqrt(1.25).
    expected = {
        "group": [-1.0, 1.0, -1.0, 1.0],
        "global": [-0.5 / math.sqrt(1.25), 0.5 / math.sqrt(1.25), -0.5 / math.sqrt(1.25), 0.5 / math.sqrt(1.25)],
        "none": [-0.5, 0.5, -0.5, 0.5],
        # First call: the running stats are the batch's: (r - 2.5) / sqrt(1.25).
        "running": [(x - 2.5) / math.sqrt(1.25) for x in r],
    }
    for mode, exp in expected.items():
        adv = PerPromptStatTracker(std_mode=mode).update(keys, r)
        np.testing.assert_allclose(adv, exp, rtol=1e-6, err_msg=mode)


def test_running_mode_second_call_mixes_by_ema():
    tracker = PerPromptStatTracker(std_mode="running", ema_decay=0.9)
    tracker.update(["a", "a"], np.array([0.0, 2.0]))      # mean 1, var 1
    adv = tracker.update(["b", "b"], np.array([4.0, 6.0]))  # batch mean 5, var 1
    # mean = 0.9*1 + 0.1*5 = 1.4; var = 0.9*1 + 0.1*1 + 0.9*0.1*(5-1)^2 = 1 + 1.44 = 2.44
    np.testing.assert_allclose(adv, [(4 - 1.4) / math.sqrt(2.44), (6 - 1.4) / math.sqrt(2.44)], rtol=1e-6)
    stats = tracker.get_stats()
    assert stats["running_mean"] == pytest.approx(1.4) and stats["running_std"] == pytest.approx(math.sqrt(2.44))


def test_buffer_history_and_min_count_fallback():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    # Epoch 1: 'a' has 2 rewards < min_count -> batch stats: mean 2.5, std sqrt(1.25).
    adv1 = tracker.update(["a", "a", "b", "b"], np.array([1.0, 2.0, 3.0, 4.0]))
    s = math.sqrt(1.25)
    np.testing.assert_allclose(adv1, [(1 - 2.5) / s, (2 - 2.5) / s, (3 - 2.5) / s, (4 - 2.5) / s], rtol=1e-6)
    tracker.clear()  # new epoch: the history survives
    # Epoch 2: history a = [1, 2, 5, 7] (4 >= 3): mean 3.75, std sqrt(((-2.75)^2+(-1.75)^2+1.25^2+3.25^2)/4)
    # 'c' is new with 1 reward -> batch stats of [5, 7, 10]: mean 22/3.
    adv2 = tracker.update(["a", "a", "c"], np.array([5.0, 7.0, 10.0]))
    hist = np.array([1.0, 2.0, 5.0, 7.0])
    batch = np.array([5.0, 7.0, 10.0])
    np.testing.assert_allclose(adv2[:2], (np.array([5.0, 7.0]) - hist.mean()) / hist.std(), rtol=1e-6)
    np.testing.assert_allclose(adv2[2], (10 - batch.mean()) / batch.std(), rtol=1e-6)
    # Epoch 3: the deque keeps the last 4 rewards: [5, 7, 0, 1] after two more.
    adv3 = tracker.update(["a", "a"], np.array([0.0, 1.0]))
    hist = np.array([5.0, 7.0, 0.0, 1.0])
    np.testing.assert_allclose(adv3, (np.array([0.0, 1.0]) - hist.mean()) / hist.std(), rtol=1e-6)
    assert list(tracker.history["a"]) == [5.0, 7.0, 0.0, 1.0]


def test_stats_on_hand_made_batch_zero_std_per_column():
    # Group a: column 0 constant (2, 2), column 1 varies. Group b: both vary.
    rewards = np.array([[2.0, 0.0], [2.0, 1.0], [0.0, 0.0], [1.0, 3.0]])
    tracker = PerPromptStatTracker()
    adv = tracker.update(["a", "a", "b", "b"], rewards)
    np.testing.assert_array_equal(adv[:2, 0], [0.0, 0.0])
    np.testing.assert_allclose(adv[:2, 1], [-1.0, 1.0])
    np.testing.assert_allclose(adv[2:], [[-1.0, -1.0], [1.0, 1.0]])
    stats = tracker.get_stats()
    assert stats["group_size"] == 2.0
    assert stats["trained_prompt_num"] == 2 and stats["trained_prompt_num_total"] == 2
    assert stats["zero_std_ratio"] == 0.25  # 1 of 2 groups x 2 columns; flattened group a would hide it
    assert stats["zero_std_ratio_per_column"] == [0.5, 0.0]  # column 0 carries no signal in group a
    # Per-(group, column) stds: a: 0, 0.5; b: 0.5, 1.5.
    assert stats["reward_std_mean"] == pytest.approx((0 + 0.5 + 0.5 + 1.5) / 4)

    tracker.clear()
    tracker.update(["c", "c"], np.array([[0.0, 1.0], [1.0, 1.0]]))
    stats = tracker.get_stats()
    assert stats["trained_prompt_num"] == 1 and stats["trained_prompt_num_total"] == 3
    assert stats["zero_std_ratio"] == 0.5


def test_tuple_and_numpy_keys():
    keys = [(0, 1.5), (0, 1.5), (np.int64(0), 2.5), (0, np.float64(2.5))]
    tracker = PerPromptStatTracker()
    adv = tracker.update(keys, np.array([1.0, 3.0, 5.0, 4.0]))
    np.testing.assert_allclose(adv, [-1.0, 1.0, 1.0, -1.0])
    stats = tracker.get_stats()
    assert stats["num_groups"] == 2 and stats["trained_prompt_num"] == 2  # numpy scalars key the same groups
    adv = PerPromptStatTracker().update([3, 3, 7, 7], torch.tensor([0.0, 1.0, 1.0, 1.0]))
    np.testing.assert_allclose(adv, [-1.0, 1.0, 0.0, 0.0])


def test_nonfinite_and_length_errors():
    tracker = PerPromptStatTracker()
    with pytest.raises(ValueError, match=r"\('img7', 2\)"):
        tracker.update([("img3", 1)] * 2 + [("img7", 2)] * 2, np.array([1.0, 2.0, np.nan, 0.0]))
    with pytest.raises(ValueError, match="'b'"):
        tracker.update(["a", "b"], np.array([[0.0, 1.0], [np.inf, 0.0]]))
    with pytest.raises(ValueError, match="3 keys for 2 rewards"):
        tracker.update(["a", "a", "b"], np.array([1.0, 2.0]))
    assert tracker.get_stats()["num_samples"] == 0  # failed calls record nothing


def test_state_dict_round_trip():
    tracker = PerPromptStatTracker(buffer_size=3, min_count=2)
    tracker.update([("s", 1), ("s", 1), ("t", 2)], np.array([1.0, 2.0, 4.0]))
    buf = io.BytesIO()
    torch.save(tracker.state_dict(), buf)
    buf.seek(0)
    restored = PerPromptStatTracker()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    again = PerPromptStatTracker()
    again.load_state_dict(pickle.loads(pickle.dumps(tracker.state_dict())))
    batch_keys, batch = [("s", 1), ("t", 2), ("t", 2)], np.array([3.0, 0.0, 5.0])
    expected = tracker.update(batch_keys, batch)
    np.testing.assert_array_equal(restored.update(batch_keys, batch), expected)
    np.testing.assert_array_equal(again.update(batch_keys, batch), expected)
    assert restored.get_stats()["trained_prompt_num_total"] == 2

    running = PerPromptStatTracker(std_mode="running", ema_decay=0.5)
    running.update(["a", "b"], np.array([[0.0, 1.0], [2.0, 5.0]]))
    copy = PerPromptStatTracker()
    copy.load_state_dict(pickle.loads(pickle.dumps(running.state_dict())))
    r = np.array([[1.0, 1.0], [3.0, 2.0]])
    np.testing.assert_array_equal(copy.update(["a", "b"], r), running.update(["a", "b"], r))


@pytest.mark.parametrize("mode,buffer", [("group", 8), ("none", 8), ("running", None)])
def test_live_check_under_history_or_running_stats_checks_the_trackers_own_statistics(mode, buffer):
    """With a history buffer or running statistics the advantages have no per-epoch group mean 0 / std 1, but each
    must be its reward standardised by the tracker's own statistics for its condition: the check verifies that, says
    which mode it is in, and stops on advantages handed to the wrong sample, shifted, or not finite."""
    from ddpo_grpo.errors import VerificationError

    rng = np.random.default_rng(0)
    keys = np.repeat([3, 5], 4)
    tracker = PerPromptStatTracker(std_mode=mode, buffer_size=buffer, min_count=2)
    for epoch in range(3):  # later epochs: the history / running statistics are not this batch's
        tracker.clear()
        rewards = rng.normal(loc=epoch, size=8)
        adv = tracker.update(keys.tolist(), rewards)
        metrics, table = verify_groups(keys, adv, np.ones(8, bool), rewards, 4, tracker)
        head = table.splitlines()[0]
        assert ("running statistics" if mode == "running" else "history buffer") in head, head
        assert metrics["verify/adv_tracker_err_max"] < 1e-6
    assert abs(adv[:4].astype(np.float64).mean()) > 0.05  # group mean 0 does not hold: the per-epoch check cannot apply
    swapped = adv.copy()
    swapped[[0, 4]] = adv[[4, 0]]  # two samples' advantages exchanged across conditions
    shifted = adv.copy()
    shifted[4:] += 0.01
    nan = adv.copy()
    nan[6] = np.nan
    for bad, text in ((swapped, "condition 3 column 0: advantages differ from the tracker's own"),
                      (shifted, "condition 5 column 0: advantages differ from the tracker's own"),
                      (nan, "condition 5 column 0: advantage nan is not finite")):
        with pytest.raises(VerificationError, match=text):
            verify_groups(keys, bad, np.ones(8, bool), rewards, 4, tracker)


def test_live_check_before_any_valid_reward_reaches_running_stats():
    """Running statistics that have seen no valid reward yet (every sample invalid so far) have no mean to report:
    the check passes on an all-masked epoch and its line says so (found by the zero-spread property test)."""
    tracker = PerPromptStatTracker(std_mode="running")
    keys = np.array([3, 3])
    metrics, table = verify_groups(keys, np.zeros(2), np.zeros(2, bool), np.full(2, np.nan), 2, tracker)
    assert "running statistics (none yet" in table.splitlines()[0]


@pytest.mark.parametrize("mode", ["global", "none"])
def test_live_check_checks_the_scale_where_group_std_is_not_1(mode):
    """Global / none modes have group mean 0 but no group std 1: the check compares every advantage with
    (r - group mean) / the batch's std (or / 1), so a mis-scaled advantage (which keeps mean 0) stops the run, and
    its line does not claim a std-1 check it did not make."""
    from ddpo_grpo.errors import VerificationError

    rng = np.random.default_rng(1)
    keys = np.repeat([3, 5, 7], 4)
    rewards = rng.normal(size=(12, 3)) + np.repeat([0.0, 2.0, -1.0], 4)[:, None]  # between-group spread in the batch
    tracker = PerPromptStatTracker(std_mode=mode)
    adv = tracker.update(keys.tolist(), rewards)
    # hand-computed: group 5's column 1 centred on its own mean, over the batch column's std (ddof 0) or 1
    g = rewards[4:8, 1]
    want = (g - g.mean()) / (rewards[:, 1].std() if mode == "global" else 1.0)
    np.testing.assert_allclose(adv[4:8, 1], want, rtol=1e-5, atol=1e-6)
    metrics, table = verify_groups(keys, adv, np.ones(12, bool), rewards, 4, tracker)
    head = table.splitlines()[0]
    assert "|std-1|" not in head and ("the batch's std" if mode == "global" else "1 (no std)") in head, head
    assert metrics["verify/adv_tracker_err_max"] < 1e-6
    scaled = adv * np.float32(1.05)  # group means stay 0: only the scale is wrong
    with pytest.raises(VerificationError, match=r"advantages differ from the tracker's own .*this epoch's groups"):
        verify_groups(keys, scaled, np.ones(12, bool), rewards, 4, tracker)


def test_live_check_group_mode_line_reports_std_1():
    rng = np.random.default_rng(2)
    keys = np.repeat([1, 2], 4)
    rewards = rng.normal(size=8)
    tracker = PerPromptStatTracker()
    adv = tracker.update(keys.tolist(), rewards)
    metrics, table = verify_groups(keys, adv, np.ones(8, bool), rewards, 4, tracker)
    assert "|std-1| <=" in table.splitlines()[0] and metrics["verify/adv_group_std_err_max"] < 1e-5

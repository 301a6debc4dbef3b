"""paths.opposite_motion: the camera error of tiny-recam3d's pretraining data (issue 59 part 2)."""
import numpy as np
import pytest

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.worlds.room3d.paths import RANDOM_KINDS, opposite_motion, preset_path, random_motion


@pytest.mark.parametrize("name, other", [("pan right", "pan left"), ("tilt up", "tilt down"),
                                         ("zoom in", "zoom out"), ("arc left", "arc right"),
                                         ("translate up", "translate down")])
def test_opposite_of_a_preset_is_its_counterpart(name, other):
    for a, b in ((name, other), (other, name)):
        path, opp = opposite_motion(preset_path(a, 9), a)
        assert opp == b
        np.testing.assert_allclose(path, preset_path(b, 9), atol=1e-12)


def test_opposite_by_hand():
    a = np.radians(20.0)
    pan = np.tile(np.eye(4), (1, 1, 1))
    pan[0, :3, :3] = [[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]]  # R_y(20 deg): pan right
    out, name = opposite_motion(pan, "pan right")
    assert name == "pan left"
    np.testing.assert_allclose(out[0, :3, :3], [[np.cos(a), 0, -np.sin(a)], [0, 1, 0], [np.sin(a), 0, np.cos(a)]],
                               atol=1e-15)
    dolly = np.eye(4)[None].copy()
    dolly[0, 2, 3] = 1.5
    out, name = opposite_motion(dolly, "zoom in")
    assert name == "zoom out" and out[0, 2, 3] == pytest.approx(-1.5) and out[0, :3, :3] == pytest.approx(np.eye(3))
    trans = np.eye(4)[None].copy()
    trans[0, :3, 3] = [0.0, -0.8, 0.0]  # y down: moving up is -y
    out, name = opposite_motion(trans, "translate up")
    assert name == "translate down" and out[0, :3, 3] == pytest.approx([0.0, 0.8, 0.0])


def test_opposite_twice_is_the_identity_and_keeps_rotations_proper():
    rng = np.random.default_rng(5)
    for kind in RANDOM_KINDS:
        for _ in range(4):
            path, name = random_motion(rng, kind, 9)
            once, n1 = opposite_motion(path, name)
            twice, n2 = opposite_motion(once, n1)
            assert n1 != name and n2 == name
            np.testing.assert_allclose(twice, path, atol=1e-12)
            np.testing.assert_allclose(np.linalg.det(once[:, :3, :3]), 1.0, atol=1e-12)
            if kind != "dolly":  # the motion really changes (a dolly's rotation is I, its translation flips)
                assert np.abs(once - path).max() > 1e-3


def test_opposite_of_an_unknown_name_is_one_error():
    with pytest.raises(ConfigError, match="no opposite"):
        opposite_motion(np.tile(np.eye(4), (9, 1, 1)), "spin")

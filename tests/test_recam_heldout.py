"""benchmarks/recam_heldout.py's ceilings (issue 47): re-scoring per-frame motions follows cam_score's rule, and
removing a purely linear bias gives back the request exactly."""
import math

import numpy as np

from benchmarks import recam_heldout as h  # benchmarks/ is importable from the repository root (tests/conftest.py)
from ddpo_grpo.worlds.recam.video import camera_numbers


def _requests(rng, n=40, frames=9):
    """(n, F, 3) trajectories linear in clip time from the identity, as the world's: dx, dy in [-6, 6], log zoom in
    [-0.3, 0.3]."""
    a = np.linspace(0, 1, frames)[None, :, None]
    end = np.stack([rng.uniform(-6, 6, n), rng.uniform(-6, 6, n), rng.uniform(-0.3, 0.3, n)], axis=1)[:, None, :]
    req = a * end
    req[..., 2] = np.exp(req[..., 2])
    return req


def test_clip_scores_is_the_frame_mean_of_the_formula():
    req = np.array([[[0, 0, 1.0], [1, 0, 1.0]]])
    est = np.array([[[0, 0, 1.0], [2, 0, 1.1]]])  # frame 1: 1 px and log(1.1) off
    want = 0.5 * (1.0 + math.exp(-1 / 2) * math.exp(-math.log(1.1) / 0.1))
    assert abs(h.clip_scores(est, req)[0] - want) < 1e-12


def test_a_purely_linear_bias_is_removed_exactly_and_scatter_is_scaled():
    rng = np.random.default_rng(0)
    req = _requests(rng)
    est = req.copy()
    est[..., 0] = 0.85 * req[..., 0] + 0.1
    est[..., 1] = 0.92 * req[..., 1]
    est[..., 2] = np.exp(0.6 * np.log(req[..., 2]))
    est[:, 0] = req[:, 0]  # frame 0, the identity, is kept as estimated
    assert np.allclose(h.unbiased(est, req)[:, 1:], req[:, 1:], atol=1e-9)
    c = h.ceilings(est, req)
    assert c["as_sampled"] < 0.95 and abs(c["bias_free_scatter_x1"] - 1.0) < 1e-9
    # with scatter, halving it halves every frame's residual about the fitted line
    noisy = est + rng.normal(0, 0.5, est.shape) * np.array([1, 1, 0])
    e1, e5 = h.unbiased(noisy, req), h.unbiased(noisy, req, 0.5)
    assert np.allclose(e5[:, 1:, :2] - req[:, 1:, :2], 0.5 * (e1[:, 1:, :2] - req[:, 1:, :2]), atol=1e-9)
    c = h.ceilings(noisy, req)
    assert c["bias_free_scatter_x1"] < c["bias_free_scatter_x0.75"] < c["bias_free_scatter_x0.5"] < 1.0
    # one component at a time: only that component moves to the request, the others stay as estimated
    only_dx = h.unbiased(est, req, components=(0,))
    assert np.allclose(only_dx[:, 1:, 0], req[:, 1:, 0], atol=1e-9) and np.allclose(only_dx[..., 1:], est[..., 1:])
    c = h.ceilings(est, req)
    assert c["as_sampled"] < c["bias_free_only_dx"] < 1.0 and c["as_sampled"] < c["bias_free_only_log_zoom"] < 1.0


def test_amplified_cameras_scale_the_requested_motion():
    rng = np.random.default_rng(1)
    m = _requests(rng, n=1)[0].astype(np.float32)
    g = (1.2, 0.9, 1.5)
    want = m.astype(np.float64).copy()
    want[:, 0] *= 1.2
    want[:, 1] *= 0.9
    want[:, 2] **= 1.5
    assert np.allclose(h.amplified_cameras(m, g, 9), camera_numbers(want, 9), atol=1e-6)
    assert not np.allclose(h.amplified_cameras(m, g, 9), camera_numbers(m, 9), atol=1e-3)

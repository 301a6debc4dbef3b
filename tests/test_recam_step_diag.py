"""benchmarks/recam_step_diag.py (issue 47's per-timestep diagnosis): its advantages are per-group standardised, and a
model compared with itself has shifted nothing at any step."""
import numpy as np
import torch

from benchmarks import recam_step_diag as d  # benchmarks/ is importable from the repository root (tests/conftest.py)


def test_group_advantages_are_standardised_per_group():
    r = np.array([0.1, 0.3, 0.2, 0.9, 0.5, 0.7])
    a = d.group_adv(r, 3).reshape(2, 3)
    assert np.allclose(a.mean(1), 0, atol=1e-9) and np.allclose(a.std(1), 1, atol=5e-3)
    assert a[0].argmax() == 1 and a[1].argmax() == 0


def test_a_model_compared_with_itself_has_no_shift_and_no_velocity_change():
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import resolve_model_path
    from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions

    torch.manual_seed(0)
    pipe = d.load(resolve_model_path("tiny-recam-video"))
    settings = SamplerSettings(family="flow", noise_level=0.7, sde_type="sde")
    items = [RecamVideoConditions("train", num_frames=d.FRAMES, size=d.SIZE)[0]]
    traj, r, emb, cond = d.sample_epoch(pipe, settings, items, 2, 0)
    assert traj.log_probs.shape == (2, d.STEPS) and r.shape == (2,)
    for t in (0, d.STEPS - 1):
        kl, dv = d.step_shift(pipe, pipe, settings, traj, emb, cond, t)
        assert kl == 0.0 and dv == 0.0


def test_snr_sampling_mirrors_pairs_inside_the_window_only():
    """--snr's epochs: with window (0, 4) only the window's 4 steps are stored, and with mirrored noise copies (0, 1)
    and (2, 3) of an item sit symmetric about one step-0 mean (x_a + x_b equal for both pairs) while the pairs differ."""
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import resolve_model_path
    from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions

    pipe = d.load(resolve_model_path("tiny-recam-video"))
    settings = SamplerSettings(family="flow", noise_level=0.7, sde_type="sde")
    items = [RecamVideoConditions("train", num_frames=d.FRAMES, size=d.SIZE)[0]]
    traj, r, _, _ = d.sample_epoch(pipe, settings, items, 4, 0, window=(0, 4), antithetic=True)
    assert traj.log_probs.shape == (4, 4) and r.shape == (4,)
    x1 = traj.latents[:, 1]
    torch.testing.assert_close(x1[0] + x1[1], x1[2] + x1[3], atol=1e-5, rtol=0)
    assert (x1[0] - x1[2]).abs().max() > 0.1

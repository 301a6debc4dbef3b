"""benchmarks/noise_probe.py, the reading behind pretrain_recam_video.py --noise-offset (docs/recam_log.md, thirty-second
session): the offset's direction and application, the probe's inputs and its reading, each against a hand computation
or an oracle predictor. The option's end-to-end run and its bad values are in test_room3d_pretrain.py."""
import pytest


@pytest.mark.parametrize("seed", range(5))
def test_noise_probe_offset_is_along_a_direction_the_noise_mode_does_not_sum(seed):
    """noise_probe (pretrain_recam_video --noise-offset): u is a unit vector orthogonal to the all-ones direction over
    the channels, so moving a draw's latents along u leaves noise_mode's sum unchanged; apply_offset moves exactly the
    flagged rows' frames 1.. by amount * u (float64 by hand) and nothing else."""
    import torch

    from benchmarks.noise_probe import apply_offset, offset_direction
    from benchmarks.pretrain_pools import noise_mode

    g = torch.Generator().manual_seed(seed)
    c = 2 * int(torch.randint(1, 9, (1,), generator=g))
    u = offset_direction(c)
    assert abs(float(u.double().norm()) - 1) < 1e-6 and abs(float(u.double().sum())) < 1e-6
    x0 = torch.randn(6, c, 3, 4, 5, generator=g, dtype=torch.float64)
    moved = torch.rand(6, generator=g) < 0.5
    amount = float(torch.rand(1, generator=g)) * 3 - 1.5
    out = apply_offset(x0, moved, amount)
    want = x0.clone()
    for b in range(6):
        if moved[b]:
            for ch in range(c):
                want[b, ch, 1:] += amount * (1 if ch % 2 == 0 else -1) / c ** 0.5
    assert torch.allclose(out, want, atol=1e-6)  # u is float32
    assert torch.allclose(noise_mode(out), noise_mode(x0), atol=1e-9)
    with pytest.raises(ValueError, match="even number of channels"):
        offset_direction(3)


@pytest.mark.parametrize("amount", [0.5, 2.0])
def test_noise_probe_reads_one_for_a_dit_that_renders_the_noise_s_offset_and_zero_for_one_that_does_not(amount):
    """offset_read by construction: a predictor whose x0 estimate is the true target plus amount * u exactly where the
    noise's mode is above its threshold reads 1 at every level; one that returns the true target whatever the noise
    reads 0; half the offset reads 0.5. Both modes must be present."""
    import torch

    from benchmarks.noise_probe import apply_offset, offset_read
    from benchmarks.pretrain_pools import mode_threshold, noise_mode

    g = torch.Generator().manual_seed(0)
    x0, src = torch.randn(32, 8, 3, 4, 6, generator=g), torch.randn(32, 8, 3, 4, 6, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    mode = noise_mode(noise) > mode_threshold(0.5)
    assert 0 < int(mode.sum()) < 32

    def oracle(scale):
        def predict(xt, s, cams, emb, sig):  # v = (xt - x0_hat) / sigma
            target = apply_offset(x0, mode, scale * amount)
            return (xt - target) / sig.view(-1, 1, 1, 1, 1)
        return predict

    for scale, want in ((1.0, 1.0), (0.0, 0.0), (0.5, 0.5)):
        reads = offset_read(oracle(scale), x0, src, None, None, noise, mode, amount)
        assert set(reads) == {0.95, 0.8} and all(abs(r - want) < 1e-4 for r in reads.values()), (scale, reads)
    with pytest.raises(ValueError, match="both modes"):
        offset_read(oracle(1.0), x0, src, None, None, noise, torch.ones(32, dtype=torch.bool), amount)


def test_noise_probe_inputs_are_seeded_and_none_when_the_noises_have_one_mode():
    """probe_inputs: the first n items, the same noises for the same seed, modes as noise_mode reads them against the
    fraction's threshold; None at fractions 0 and 1 (every noise on one side: nothing to read)."""
    import torch

    from benchmarks.noise_probe import probe_inputs
    from benchmarks.pretrain_pools import mode_threshold, noise_mode

    x0, src = torch.randn(10, 8, 3, 4, 6), torch.randn(10, 8, 3, 4, 6)
    cams, emb = torch.randn(10, 3, 12), torch.randn(10, 5, 16)
    a, b = probe_inputs(x0, src, cams, emb, 7, False, 0.5, n=6), probe_inputs(x0, src, cams, emb, 7, False, 0.5, n=6)
    assert a is not None and torch.equal(a[4], b[4]) and a[0].shape[0] == 6 and torch.equal(a[0], x0[:6])
    assert torch.equal(a[5], noise_mode(a[4]) > mode_threshold(0.5))
    assert probe_inputs(x0, src, cams, emb, 7, False, 1.0) is None
    assert probe_inputs(x0, src, cams, emb, 7, True, 0.0) is None

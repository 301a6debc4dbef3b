"""The byte meters (trainer/checks/byte_meters.py) the memory plan's activation counts come from: the meta-device
count of what a training forward saves for backward against the memory a real CPU forward keeps, and the emulated
autocast's dtypes against a hand count."""
import pytest
import torch

from ddpo_grpo.trainer.checks.byte_meters import SavedBytes, activation_bytes
from helpers import fresh_process, heap_in_use, mid_unet_config


def _inputs(rows, latent, device):
    return (torch.randn(rows, 4, latent, latent).to(device), torch.full((rows,), 500.0).to(device),
            torch.randn(rows, 77, 64).to(device))


@pytest.mark.parametrize("channels,latent", [((32, 64, 64, 64), 8), ((64, 128, 128, 128), 16)])
def test_activation_estimate_matches_the_memory_a_cpu_forward_keeps(channels, latent, request):
    """Per row (the slope between 1 and 2 rows, which cancels fixed costs such as autograd's nodes): the bytes the
    meta-device count says against glibc's heap growth over a real float32 forward with grad, within 10 %. The
    checkpointed count's kept part (block inputs) likewise. Two sizes: 3.3 M and 12.8 M parameters."""
    from diffusers import UNet2DConditionModel

    if fresh_process(request):
        return
    used = heap_in_use()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**mid_unet_config(latent, channels)).requires_grad_(True)
    with torch.device("meta"):
        meta = UNet2DConditionModel(**mid_unet_config(latent, channels))
    est = [activation_bytes(meta, _inputs(r, latent, "meta"), False) for r in (1, 2)]
    for rows in (1, 2):  # warm-up at each shape: oneDNN's primitive caches and the allocator's one-offs
        x, t, c = _inputs(rows, latent, "cpu")
        unet(x, t, encoder_hidden_states=c)

    def kept(rows, checkpointing=False):
        if checkpointing:
            unet.enable_gradient_checkpointing()
        x, t, c = _inputs(rows, latent, "cpu")
        before = used()
        out = unet(x, t, encoder_hidden_states=c).sample
        nbytes = used() - before - out.numel() * out.element_size()
        del out
        unet.disable_gradient_checkpointing()
        return nbytes

    measured = kept(2) - kept(1)
    assert est[1] - est[0] == pytest.approx(measured, rel=0.10)
    assert est[1] == pytest.approx(2 * est[0], rel=0.02)  # per row: the plan multiplies it by rows
    if latent == 16:
        counted = []
        for r in (1, 2):
            sb = SavedBytes()
            meta.enable_gradient_checkpointing(gradient_checkpointing_func=sb.checkpoint)
            with sb.counting():
                x, t, c = _inputs(r, latent, "meta")
                meta(x, t, encoder_hidden_states=c)
            counted.append(sb.outside)
        assert counted[1] - counted[0] == pytest.approx(kept(2, True) - kept(1, True), rel=0.10)
        assert activation_bytes(meta, _inputs(1, latent, "meta"), True) < est[0] / 3


def test_autocast_emulation_saves_what_autocast_saves_by_hand():
    """conv -> group_norm -> silu -> conv on meta under emulated bf16 autocast: the first conv saves its input cast
    to bf16 (2 B/elt), group_norm an fp32 copy of the bf16 conv output (4) plus its fp32 mean/rstd, silu its fp32 input
    (4), the second conv its input cast back to bf16 (2). fp32: conv input, gn input, silu input, conv input (4 each)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(4, 8, 1)
            self.n = torch.nn.GroupNorm(2, 8)
            self.b = torch.nn.Conv2d(8, 8, 1)

        def forward(self, x, t, encoder_hidden_states=None):
            return self.b(torch.nn.functional.silu(self.n(self.a(x))))

    with torch.device("meta"):
        net = Net()
    x = torch.zeros(1, 4, 16, 16, device="meta")
    e = 16 * 16  # elements per channel
    stats = 2 * 4 * 2  # group_norm's mean and rstd: (N, groups) fp32, 2 tensors
    inputs = (x, torch.zeros(1, device="meta"), torch.zeros(1, 1, 1, device="meta"))
    assert activation_bytes(net, inputs, False, "no") == 4 * e * 4 + 8 * e * 4 * 3 + stats
    assert activation_bytes(net, inputs, False, "bf16") == 4 * e * 2 + 8 * e * (4 + 4 + 2) + stats

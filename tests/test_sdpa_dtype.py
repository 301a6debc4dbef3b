"""Video attention on a fused kernel (issue 61 item 5): every scaled_dot_product_attention call of one Wan and one
ReCamMaster forward under bf16 autocast gets bf16 q, k, v in the layout FlashAttention-2 takes (one dtype, head dim
a multiple of 8 and <= 256, last dim contiguous), with the models' float32 weights (a full fine-tune's master
weights) and with a LoRA run's bf16 base; the q / k RMSNorm stays on torch's fused path (models.wan.AutocastRMSNorm)
and a float32 forward is what diffusers' own modules give, bit for bit."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from ddpo_grpo.models import recam, wan

HEAD_DIM = 128  # Wan 2.1's attention_head_dim (1.3B and 14B); the tiny build's 12 is no flash shape
FLASH_HEAD_DIMS = range(8, 257, 8)


def transformer(head_dim: int = HEAD_DIM, seed: int = 0) -> WanTransformer3DModel:
    """wan-tiny's transformer (models.wan.tiny_parts: 2 blocks, 2 heads, 16 latent channels, 1x2x2 patches) with
    Wan 2.1's head dim, float32, seeded."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32)


def wan_denoiser(model):
    """A Wan transformer through the adapter's own wrap (what load and the real-shape builds return)."""
    parts = dict(wan.tiny_parts(), transformer=model)
    return wan.ADAPTER.wrap(parts, "flow", "wan-tiny", 32, 5).unet


def recam_denoiser(model):
    """ReCamMaster over a Wan transformer: its camera layers (seeded, not the zero / identity start, so the camera
    changes the output), through the Wan adapter's wrap as RecamAdapter.load does."""
    recam.add_camera_layers(model)
    torch.manual_seed(1)
    for block in model.blocks:
        torch.nn.init.normal_(block.cam_encoder.weight, std=0.5)
        torch.nn.init.normal_(block.cam_encoder.bias, std=0.1)
    return recam.RecamDenoiser(wan_denoiser(model))


def inputs(kind: str, rows: int = 2):
    """(x, t, cond): Wan's (rows, 16, 2, 4, 4) latents; ReCamMaster's (rows, 16 + 16 + 12, 2, 4, 4) with the source
    latents and constant camera planes (RecamAdapter.condition_channels' layout); UMT5-width text (rows, 8, 32)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 16, 2, 4, 4, generator=g)
    if kind == "recam":
        cams = torch.randn(rows, 2, recam.CAMERA_DIM, generator=g)
        x = torch.cat([x, torch.randn(rows, 16, 2, 4, 4, generator=g), recam.camera_planes(cams, 4, 4)], dim=1)
    return x, torch.tensor([500.0, 250.0][:rows]), torch.randn(rows, 8, 32, generator=g)


class SdpaRecorder:
    """Records (dtype, shape, stride) of q, k, v of every torch.nn.functional.scaled_dot_product_attention call
    inside it (diffusers' native attention backend calls it by that attribute), and (input dtype, weight dtype) of
    every torch.nn.functional.rms_norm call (torch.nn.RMSNorm's; one dtype is torch's fused kernel)."""

    def __init__(self):
        self.calls, self.norms = [], []

    def __enter__(self):
        self.saved = F.scaled_dot_product_attention, F.rms_norm
        sdpa, rms_norm = self.saved

        def record(*args, **kwargs):
            qkv = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
            self.calls.append([(t.dtype, tuple(t.shape), t.stride()) for t in qkv])
            return sdpa(*args, **kwargs)

        def record_norm(x, shape, weight=None, eps=None):
            self.norms.append((x.dtype, None if weight is None else weight.dtype))
            return rms_norm(x, shape, weight, eps)

        F.scaled_dot_product_attention, F.rms_norm = record, record_norm
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention, F.rms_norm = self.saved


def forward(model, kind, autocast: bool):
    x, t, cond = inputs(kind)
    with warnings.catch_warnings(record=True) as caught, SdpaRecorder() as rec:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, t, encoder_hidden_states=cond)
    out = out.sample if hasattr(out, "sample") else out[0]
    forward.norms = rec.norms
    return out, rec.calls, [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", ["wan", "recam"])
@pytest.mark.parametrize("base", ["float32", "bfloat16"])
def test_every_sdpa_call_gets_bf16_qkv_in_flash_layout(kind, base):
    """Under bf16 autocast, float32 master weights (full fine-tune) or a bf16 base (LoRA): per block one self- and
    one cross-attention call (2 blocks: 4 calls), q, k, v bf16, head dim 128, last dim contiguous; the self-attention
    over Wan's 8 tokens a row (2 latent frames x 2 x 2 patches), ReCamMaster's 16 (target and source frames), keys of
    the cross-attention the 8 text tokens. No RMSNorm leaves the fused path: each of the 8 q / k norms gets its
    input and weight in one dtype, bf16 (torch's dtype-mismatch warning, where it is not spent: it warns once)."""
    model = transformer().to(getattr(torch, base))
    den = wan_denoiser(model) if kind == "wan" else recam_denoiser(model)
    _, calls, warned = forward(den, kind, autocast=True)
    tokens = 8 if kind == "wan" else 16
    assert len(calls) == 4
    for i, qkv in enumerate(calls):
        kv_len = tokens if i % 2 == 0 else 8  # self-attention, then cross-attention over the text
        assert [shape for _, shape, _ in qkv] == [(2, 2, tokens, HEAD_DIM), (2, 2, kv_len, HEAD_DIM),
                                                  (2, 2, kv_len, HEAD_DIM)], (i, qkv)
        for dtype, shape, stride in qkv:
            assert dtype == torch.bfloat16, (i, qkv)
            assert shape[-1] in FLASH_HEAD_DIMS and stride[-1] == 1, (i, qkv)
    assert forward.norms == [(torch.bfloat16, torch.bfloat16)] * 8
    assert not [w for w in warned if "Mismatch dtype" in w], warned


def test_recam_camera_layers_keep_autocasts_dtype():
    """ReCamMaster's camera embedding is added to attn1's input and its projector applied to attn1's output in bf16
    under autocast, with float32 weights: neither turns the self-attention's input or output float32."""
    den = recam_denoiser(transformer())
    seen = []
    for block in den.model.blocks:
        block.attn1.register_forward_pre_hook(lambda m, a, k: seen.append(("in", (a[0] if a else k["hidden_states"]).dtype)),
                                              with_kwargs=True)  # after _AddCamera's (registered first)
        block.attn1.register_forward_hook(lambda m, a, out: seen.append(("out", out.dtype)))  # after _Project
    forward(den, "recam", autocast=True)
    assert seen == [("in", torch.bfloat16), ("out", torch.bfloat16)] * 2


@pytest.mark.parametrize("kind", ["wan", "recam"])
def test_float32_forward_is_diffusers_own_bit_for_bit(kind):
    """Without autocast the adapted modules compute exactly what diffusers' own do: the same weights with the stock
    torch.nn.RMSNorm (the class swap undone on a deep copy) give the same float32 output, bit for bit, and q / k / v
    reach SDPA in float32."""
    model = transformer()
    den = wan_denoiser(model) if kind == "wan" else recam_denoiser(model)
    assert sum(isinstance(m, wan.AutocastRMSNorm) for m in den.modules()) == 2 * 2 * 2  # norm_q, norm_k x 2 attn x 2
    stock = copy.deepcopy(den)
    for m in stock.modules():
        if isinstance(m, wan.AutocastRMSNorm):
            m.__class__ = torch.nn.RMSNorm
    got, calls, _ = forward(den, kind, autocast=False)
    want, _, _ = forward(stock, kind, autocast=False)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert {dtype for qkv in calls for dtype, _, _ in qkv} == {torch.float32}
    # and the bf16 forward stays near the float32 one (what the fused norm changes is within bf16's rounding)
    low, _, _ = forward(den, kind, autocast=True)
    err = (low.float() - got).abs().max() / got.abs().max()
    assert err < 0.05, err


def test_norm_matches_torchs_rms_norm_in_float64():
    """AutocastRMSNorm against a float64 hand computation, x / sqrt(mean(x^2) + eps) * w: float32 without autocast
    (to float32's rounding), and bf16 input with a float32 weight under autocast (to bf16's), the output bf16."""
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(256, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    fused = copy.deepcopy(norm)
    fused.__class__ = wan.AutocastRMSNorm
    x = torch.randn(3, 5, 256)
    ref = lambda a: (a.double() / torch.sqrt(a.double().pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
                     * norm.weight.double())
    assert torch.equal(fused(x), norm(x))
    assert torch.allclose(fused(x).double(), ref(x), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(xb)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref(xb), rtol=2 ** -7, atol=2 ** -7)

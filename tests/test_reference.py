import io

import pytest
import torch

from ddpo_grpo.core.reference import EMAReference


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _set_all(module, value):
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def test_closed_form_mix_every_f_steps():
    policy = _mlp()
    theta0 = _snapshot(policy)
    alpha, f = 0.6, 3
    ref = EMAReference(policy, alpha=alpha, update_freq=f)
    # The policy takes values v_s = s (all entries) after optimizer step s; mixes happen at s = 3, 6.
    updated = []
    for s in range(1, 8):
        _set_all(policy, float(s))
        updated.append(ref.step())
    assert updated == [False, False, True, False, False, True, False]
    assert ref.num_steps == 7 and ref.num_updates == 2
    # ref = a*(a*theta0 + (1-a)*3) + (1-a)*6 = a^2 theta0 + a(1-a)*3 + (1-a)*6
    for n, t in ref.tensors.items():
        expected = alpha ** 2 * theta0[n] + alpha * (1 - alpha) * 3.0 + (1 - alpha) * 6.0
        torch.testing.assert_close(t, expected)
        assert not t.requires_grad


@pytest.mark.parametrize("decay,freq", [(0.95, 1), (0.6, 1), (0.9, 3)])
def test_warmup_follows_diffusers_ema_model(decay, freq):
    """train.ema_decay's EMA (warmup=True) is diffusers' EMAModel without use_ema_warmup, mix for mix: the same
    tensors after random policy moves (float64; EMAModel stepped at every mix), and its first mix is a copy."""
    from diffusers.training_utils import EMAModel

    policy = _mlp(3)
    ema = EMAReference(policy, alpha=decay, update_freq=freq, warmup=True)
    theirs = EMAModel(policy.parameters(), decay=decay)
    g = torch.Generator().manual_seed(7)
    for s in range(1, 61):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        if ema.step():
            theirs.step(policy.parameters())
        if s == freq:  # the first mix copies the policy (EMAModel's decay 0 at its first step)
            for n, p in policy.named_parameters():
                assert torch.equal(ema.tensors[n], p.detach())
    assert ema.num_updates == 60 // freq == theirs.optimization_step
    for (n, t), shadow in zip(ema.tensors.items(), theirs.shadow_params):
        torch.testing.assert_close(t, shadow, rtol=1e-12, atol=1e-12)
    # the weights used: (1 + s) / (10 + s) capped at decay, so the average covers a growing tail of the run
    assert [ema.mix_weight(n) for n in (1, 2, 11)] == [0.0, min(decay, 2 / 11), min(decay, 11 / 20)]
    assert EMAReference(policy, alpha=decay).mix_weight(1) == decay  # without warmup: alpha from the first mix


def test_alpha_one_keeps_initial_weights():
    policy = _mlp()
    theta0 = _snapshot(policy)
    ref = EMAReference(policy, alpha=1.0, update_freq=1)
    for s in range(5):
        _set_all(policy, float(s))
        assert ref.step()
    for n, t in ref.tensors.items():
        assert torch.equal(t, theta0[n])


def test_swap_is_exact_grad_free_and_safe_on_exceptions():
    policy = _mlp()
    ref = EMAReference(policy, alpha=0.5, update_freq=1)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    x = torch.randn(5, 3, dtype=torch.float64)
    policy(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    ref.step()  # the reference is now halfway between theta0 and theta1
    before = _snapshot(policy)
    ref_before = {n: t.clone() for n, t in ref.tensors.items()}

    with ref.swapped():
        assert not torch.is_grad_enabled()
        for n, p in policy.named_parameters():
            assert torch.equal(p, ref_before[n])
        ref_out = policy(x)
    assert torch.is_grad_enabled()
    assert not ref_out.requires_grad
    after = _snapshot(policy)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert all(torch.equal(ref.tensors[n], ref_before[n]) for n in ref_before)

    # A loss that also uses the reference output: the policy's gradient is that of its own term.
    out = policy(x)
    (out.pow(2).sum() + (out * ref_out).sum()).backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    out = policy(x)
    (out.pow(2).sum() + (out * ref_out.clone()).sum()).backward()
    for n, p in policy.named_parameters():
        torch.testing.assert_close(got[n], p.grad)
    assert all(t.grad is None and not t.requires_grad for t in ref.tensors.values())

    with pytest.raises(RuntimeError, match="boom"):
        with ref.swapped(policy):
            raise RuntimeError("boom")
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(ref.tensors[n], ref_before[n]) for n in ref_before)
    assert torch.is_grad_enabled()


def test_fp32_copy_of_bf16_policy_restores_exactly():
    policy = torch.nn.Linear(4, 4).to(torch.bfloat16)
    before = _snapshot(policy)
    ref = EMAReference(policy, alpha=0.9, update_freq=1, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in ref.tensors.values())
    _set_all(policy, 1.0)
    ref.step()
    ref_values = {n: t.clone() for n, t in ref.tensors.items()}
    with ref.swapped():
        assert all(torch.equal(p, ref_values[n].bfloat16()) for n, p in policy.named_parameters())
    assert all(torch.equal(p, torch.ones_like(before[n])) for n, p in policy.named_parameters())
    assert all(torch.equal(ref.tensors[n], ref_values[n]) for n in ref_values)  # fp32 values kept


def test_state_dict_round_trip_and_wrapped_names():
    policy = _mlp()
    ref = EMAReference(policy, alpha=0.7, update_freq=2)
    for s in range(4):
        _set_all(policy, float(s))
        ref.step()
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    other = EMAReference(_mlp(seed=1), alpha=0.7, update_freq=2)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.num_steps == 4 and other.num_updates == 2
    assert all(torch.equal(other.tensors[n], ref.tensors[n]) for n in ref.tensors)
    # A DDP-like wrapper adds a "module." prefix; swapped/step accept it.
    wrapper = torch.nn.Module()
    wrapper.module = policy
    expected = ref.tensors["0.weight"].clone()  # inside the swap ref.tensors park the policy's values
    with ref.swapped(wrapper):
        assert torch.equal(policy[0].weight, expected)
    assert not ref.step(wrapper) and ref.step(wrapper) and ref.num_updates == 3


def _tiny_lora_unet():
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet


def test_lora_unet_reference_holds_only_adapters():
    unet = _tiny_lora_unet()
    lora_numel = sum(p.numel() for n, p in unet.named_parameters() if "lora_" in n)
    total = sum(p.numel() for p in unet.parameters())
    ref = EMAReference(unet, alpha=1.0, update_freq=1, lora=True)
    assert ref.is_lora and ref.numel == lora_numel and lora_numel > 0 and 10 * lora_numel < total
    assert all("lora_" in n for n in ref.tensors)

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([10, 500])
    cond = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out0 = unet(x, t, cond).sample
    # Move the adapter as an optimizer would; the alpha = 1 reference still gives the start output.
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    ref.step()
    with torch.no_grad():
        out1 = unet(x, t, cond).sample
    assert not torch.allclose(out0, out1)
    with ref.swapped(unet):
        out_ref = unet(x, t, cond).sample
    torch.testing.assert_close(out_ref, out0, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(unet(x, t, cond).sample, out1, rtol=0, atol=0)

    with pytest.raises(ValueError, match="non-adapter"):
        unet.conv_in.weight.requires_grad_(True)
        EMAReference(unet, alpha=0.5, update_freq=1, lora=True)

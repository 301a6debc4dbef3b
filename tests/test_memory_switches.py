"""The memory switches (issue 38, parts 1-2): the trainer sampling the same with cached embeddings and offload (the cache
itself: tests/test_embedding_cache.py), text encoders parked off the device once cached, a LoRA run's frozen base in the run's
dtype with float32 adapters (models.base.component_dtype), full fine-tuning in float32, pretrained.offload's VAE and
encoders visiting the device only for their calls (core.offload), the LoRA reference = the base with the adapter
disabled (no second copy), and the EMA reference sharded with the model under FSDP2."""
import os
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.core import offload
from ddpo_grpo.models import load_pipeline
from ddpo_grpo.models.base import component_dtype, inner_model
from ddpo_grpo.trainer.run.embeddings import FOLDER, PromptEmbeddings
from helpers import FAMILIES, ROOT, SIZE, cpu_env

sys.path.insert(0, os.path.join(ROOT, "config"))
import grpo  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# ------------------------------------------------------------------------------------------ dtypes under LoRA
@pytest.mark.parametrize("name", FAMILIES)
def test_lora_base_in_run_dtype_adapters_fp32_and_half_the_bytes(cache, name):
    """component_dtype's LoRA rule through each adapter's load: a bf16 LoRA run loads the frozen base in bf16 (the
    same weights to bf16 rounding: the fp32 run's cast), make_trainable's adapters are float32; the frozen base's
    bytes are exactly half the full fine-tune's float32 denoiser's. Full fine-tuning loads float32 whatever the run."""
    from ml_collections import ConfigDict

    from ddpo_grpo.trainer.run.build import make_trainable

    full = load_pipeline(name, torch_dtype=BF16, **SIZE.get(name, {}))
    lora = load_pipeline(name, torch_dtype=BF16, lora=True, **SIZE.get(name, {}))
    assert {p.dtype for p in inner_model(full.unet).parameters()} == {FP32}
    # diffusers keeps a model's _keep_in_fp32_modules in float32 in any load dtype (Wan: its time embedder, modulation
    # tables and norms, 0.3 % of 1.3 B), as its own bf16 pipelines run them
    keep = getattr(inner_model(lora.unet), "_keep_in_fp32_modules", None) or []
    kept = {n for n, _ in inner_model(lora.unet).named_parameters() if any(k in n.split(".") for k in keep)}
    assert bool(kept) == (name == "wan-tiny")
    assert all(p.dtype == (FP32 if n in kept else BF16) for n, p in inner_model(lora.unet).named_parameters())
    a, b = inner_model(full.unet).state_dict(), inner_model(lora.unet).state_dict()
    assert all(torch.equal(a[k].to(b[k].dtype), b[k]) for k in a)
    kept_numel = sum(p.numel() for n, p in inner_model(lora.unet).named_parameters() if n in kept)
    cfg = ConfigDict(dict(use_lora=True, lora_rank=4, train=dict(learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999,
                                                                 adam_weight_decay=0.0, adam_epsilon=1e-8)))
    opt = make_trainable(lora.unet, cfg, lora.adapter.lora_target_modules, lora.adapter.full_trainable)
    trained = [p for p in lora.unet.parameters() if p.requires_grad]
    frozen = [p for p in lora.unet.parameters() if not p.requires_grad]
    assert trained and {p.dtype for p in trained} == {FP32}  # diffusers' cast_training_params
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in trained}
    full_bytes = nbytes(inner_model(full.unet).parameters())
    assert nbytes(frozen) == full_bytes // 2 + 2 * kept_numel  # halved, but for the modules diffusers keeps in fp32


def build(config, tmp_path, mixed_precision="no"):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_grpo.trainer.run.build import build_context

    config.logging.wandb = config.logging.tensorboard = False
    config.mixed_precision = mixed_precision
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision)
    return build_context(config, acc, str(tmp_path))


def close(ctx):
    from accelerate.state import AcceleratorState

    ctx.rewards.shutdown()
    AcceleratorState._reset_state(reset_partial_state=True)


def small(config):
    config.sample.num_steps, config.sample.batch_size, config.sample.num_batches_per_epoch = 3, 4, 1
    config.sample.k, config.train.batch_size = 2, 4
    return config


def test_lora_bf16_run_is_on_policy_and_full_finetune_keeps_fp32(cache, tmp_path):
    """The trainer under bf16 (autocast on CPU): LoRA on a bf16 base samples and re-scores every stored step with the
    same weights, so the ratio is 1 within the trainer's bf16 bound (core.loss.onpolicy_tolerance) (the log-probs are float32); a full fine-tune
    holds its denoiser in float32 (master weights)."""
    from ddpo_grpo.core.loss import onpolicy_tolerance
    from ddpo_grpo.trainer.epoch.sampling import sample_epoch, sampler_settings
    from ddpo_grpo.trainer.epoch.rescoring import call_inputs as _call_inputs, score as _score

    config = small(grpo.get_config("tiny"))
    config.use_lora, config.lora_rank = True, 4
    ctx = build(config, tmp_path / "lora", "bf16")
    try:
        unet = ctx.accelerator.unwrap_model(ctx.unet)
        assert {p.dtype for p in unet.parameters() if not p.requires_grad} == {BF16}
        assert {p.dtype for p in unet.parameters() if p.requires_grad} == {FP32}
        samples = sample_epoch(ctx, 0)
        assert samples.log_probs.dtype == FP32
        settings = sampler_settings(config, ctx.pipe.family)
        idx = torch.arange(len(samples))
        for j in range(samples.log_probs.shape[1]):
            with torch.no_grad(), ctx.accelerator.autocast():
                res = _score(ctx, settings, _call_inputs(ctx, settings, samples, idx, torch.full((len(idx), 1), j))[2])
            assert res.log_prob.dtype == FP32
            ratio = torch.exp(res.log_prob - samples.log_probs[:, j].to(res.log_prob.device))
            assert (ratio - 1).abs().max() <= onpolicy_tolerance(BF16, config.train.clip_range), j
    finally:
        close(ctx)
    config = small(grpo.get_config("tiny"))
    ctx = build(config, tmp_path / "full", "bf16")
    try:
        assert {p.dtype for p in ctx.accelerator.unwrap_model(ctx.unet).parameters()} == {FP32}
    finally:
        close(ctx)


# -------------------------------------------------------------------------------------- cached embeddings
@pytest.mark.parametrize("config_name", ["tiny", "flux_tiny"])
def test_trainer_samples_the_same_with_cache_and_offload(cache, tmp_path, config_name):
    """build_context with data.cache_embeddings and pretrained.offload: the whole prompt set (train, eval, "") cached
    on the host and in the run folder, text encoders (and, with offload, the VAE) parked; an epoch's latents, log-probs
    and conditions are bit-identical to the default run's."""
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.trainer.run.embeddings import dataset_prompts
    from ddpo_grpo.trainer.epoch.sampling import sample_epoch

    runs = {}
    for mode, (cache_on, off) in {"plain": (False, False), "cached": (True, True)}.items():
        config = small(grpo.get_config(config_name))
        config.data.num_conditions = 8  # the precompute encodes one prompt per call: 8 + 64 eval, not 2216 + 64
        config.data.cache_embeddings, config.pretrained.offload = cache_on, off
        ctx = build(config, tmp_path / mode)
        try:
            runs[mode] = sample_epoch(ctx, 0)
            encoders = ctx.pipe.text_encoders()
            assert encoders and all(offload.is_parked(m) == cache_on for m in encoders)
            if ctx.pipe.vae is not None:
                assert offload.is_parked(ctx.pipe.vae) == off
            if cache_on:
                want = set(dataset_prompts(build_dataset(config, "train")))
                want |= set(dataset_prompts(build_dataset(config, "eval")))
                assert set(ctx.encode.table) == want | {""}
                assert all(t.device.type == "cpu" for t in ctx.encode.table.values())
                assert len(os.listdir(tmp_path / mode / FOLDER)) == 1
            else:
                assert not (tmp_path / mode / FOLDER).exists()
        finally:
            close(ctx)
    a, b = runs["plain"], runs["cached"]
    for field in ("latents", "log_probs", "embeds", "images"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


# ---------------------------------------------------------------------------------------------- offload
class Spy(torch.nn.Linear):
    """A module whose moves are recorded, not made (only a CPU here): `device` is where it would be."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves, self.fake = [], torch.device("cpu")

    def to(self, device, *a, **k):
        self.moves.append(str(torch.device(device)))
        self.fake = torch.device(device)
        return self


def test_visiting_moves_parked_modules_once_and_back(monkeypatch):
    monkeypatch.setattr(offload, "module_device", lambda m: m.fake if isinstance(m, Spy) else None)
    parked, free = Spy(), Spy()
    assert offload.park([parked, parked, None]) == [parked] and parked.moves == ["cpu"]
    parked.moves.clear()
    with offload.visiting([parked, free], "meta"):
        assert parked.fake.type == "meta"
        with offload.visiting(parked, "meta"):  # nested (the precompute around encode): no second move
            pass
        assert parked.fake.type == "meta"
    assert parked.moves == ["meta", "cpu"] and free.moves == []  # an unparked module stays where it is
    with pytest.raises(RuntimeError):
        with offload.visiting(parked, "meta"):
            raise RuntimeError("inside")
    assert parked.moves[-1] == "cpu" and parked.fake.type == "cpu"  # back home on an exception too
    assert offload.compute_device(parked, "meta").type == "meta" and offload.compute_device(free, "meta").type == "cpu"


def test_decode_encode_and_prompts_visit_the_device(cache, monkeypatch):
    """The calls that use a parked module go through visiting with the device of their inputs: decode and
    encode_frames (the VAE), LoadedPipeline.encode (the text encoders, to the denoiser's device)."""
    import ddpo_grpo.core.offload as off
    from ddpo_grpo.core.pipeline_with_logprob import decode

    calls = []
    real = off.visiting

    def spy(modules, device):
        calls.append(([type(m).__name__ for m in off._modules(modules)], str(torch.device(device))))
        return real(modules, device)

    monkeypatch.setattr(off, "visiting", spy)
    pipe = load_pipeline("sd3-tiny")
    off.park([pipe.vae] + pipe.text_encoders())
    with torch.no_grad():
        decode(pipe.vae, torch.randn(1, *pipe.sample_shape))
        pipe.encode(["a"])
    assert calls == [(["AutoencoderKL"], "cpu"),
                     (["CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel"], "cpu")]
    wan = load_pipeline("wan-tiny", resolution=32, num_frames=5)
    calls.clear()
    from ddpo_grpo.core.pipeline_with_logprob import encode_frames

    encode_frames(wan.vae, torch.rand(1, 5, 3, 32, 32))
    assert calls == [(["AutoencoderKLWan"], "cpu")]


# --------------------------------------------------------------------------------------------- references
def test_lora_reference_is_the_base_with_the_adapter_disabled_no_second_copy(cache):
    """EMAReference under LoRA (alpha = 1, the frozen start) holds the adapter's tensors only, none sharing storage
    with the base, and what it runs is bit for bit the base with peft's adapter disabled, after the adapter moved."""
    from ml_collections import ConfigDict

    from ddpo_grpo.core.reference import EMAReference
    from ddpo_grpo.trainer.run.build import make_trainable

    pipe = load_pipeline("sd3-tiny", torch_dtype=BF16, lora=True)
    cfg = ConfigDict(dict(use_lora=True, lora_rank=4, train=dict(learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999,
                                                                 adam_weight_decay=0.0, adam_epsilon=1e-8)))
    make_trainable(pipe.unet, cfg, pipe.adapter.lora_target_modules)
    unet, model = pipe.unet, inner_model(pipe.unet)
    base_ptrs = {p.data_ptr() for n, p in unet.named_parameters() if "lora_" not in n}
    ref = EMAReference(unet, alpha=1.0, lora=True)
    lora_numel = sum(p.numel() for n, p in unet.named_parameters() if "lora_" in n)
    assert ref.numel == lora_numel and 20 * lora_numel < sum(p.numel() for p in unet.parameters())
    assert not base_ptrs & {t.data_ptr() for t in ref.tensors.values()}
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))  # the policy moved off the base
    x = torch.randn(2, *pipe.sample_shape, generator=torch.Generator().manual_seed(1))
    cond = pipe.encode(["a", "b"])
    t = torch.tensor([500.0, 200.0])
    autocast = lambda: torch.autocast("cpu", dtype=BF16)  # noqa: E731  one per forward, as the trainer's
    with torch.no_grad():
        with autocast():
            policy = unet(x, t, encoder_hidden_states=cond).sample
        with ref.swapped(), autocast():
            got = unet(x, t, encoder_hidden_states=cond).sample
        model.disable_adapters()
        with autocast():
            base = unet(x, t, encoder_hidden_states=cond).sample
        model.enable_adapters()
        with autocast():  # one autocast context around a swap: its cached bf16 casts of the float32 adapters are
            unet(x, t, encoder_hidden_states=cond)  # the policy's, so the swapped-in values are never seen
            with ref.swapped():
                stale = unet(x, t, encoder_hidden_states=cond).sample
    assert torch.equal(got, base) and not torch.equal(policy, base)
    assert torch.equal(stale, policy)  # why core/reference.py asks for the swap outside the autocast


def test_fsdp2_lora_bf16_base_and_sharded_ema_reference(tmp_path):
    """fully_shard (gloo, one process) of a LoRA model with a bf16 base and float32 adapters trains under bf16
    autocast, and the full fine-tune's EMA reference made after the shard holds sharded DTensors like the model."""
    code = r'''
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
sys.path.insert(0, "tests")
from helpers import tiny_unet
from ddpo_grpo.core.reference import EMAReference
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d" % (29800 + os.getpid() % 97))
x, t, e = torch.randn(2, 3, 8, 8), torch.tensor([10, 500]), torch.randn(2, 4, 8)
lora = tiny_unet().to(torch.bfloat16)
lora.requires_grad_(False)
lora.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v"]))
cast_training_params(lora, torch.float32)
for m in lora.modules():
    if type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D"):
        fully_shard(m)
fully_shard(lora)
trained = [p for p in lora.parameters() if p.requires_grad]
assert {p.dtype for p in trained} == {torch.float32} and all(isinstance(p, DTensor) for p in trained)
opt = torch.optim.AdamW(trained, lr=1e-2)
with torch.autocast("cpu", dtype=torch.bfloat16):
    lora(x, t, e).sample.float().square().mean().backward()
opt.step()
assert all(p.grad is not None for p in trained)
full = tiny_unet()
for m in full.modules():
    if type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D"):
        fully_shard(m)
fully_shard(full)
ref = EMAReference(full.train(), alpha=0.5)
assert all(isinstance(v, DTensor) for v in ref.tensors.values())
placements = {n: p.placements for n, p in full.named_parameters()}
assert {n: v.placements for n, v in ref.tensors.items()} == placements
print("OK")
'''
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_component_dtype_lora_rule():
    for run in (FP32, BF16, torch.float16):
        assert component_dtype("denoiser", run, lora=True) == run and component_dtype("denoiser", run) == FP32


def test_new_prompts_of_a_batch_visit_the_encoders_once(monkeypatch):
    """Parked text encoders without the cache (pretrained.offload, data.cache_embeddings False): a batch's new prompts
    are encoded one per call (an embedding must not depend on its batch) inside one visit of the encoders, not one
    host -> device -> host round trip of them per prompt (T5-XXL: 9.5 GB each way); known prompts move nothing."""
    monkeypatch.setattr(offload, "module_device", lambda m: m.fake if isinstance(m, Spy) else None)

    class FakePipe:  # LoadedPipeline.encode's visit, with a Spy for the encoders
        def __init__(self):
            self.enc, self.unet, self.calls = Spy(), torch.nn.Linear(2, 2, device="meta"), []

        def text_encoders(self):
            return [self.enc]

        def encode(self, prompts):
            with offload.visiting(self.text_encoders(), next(self.unet.parameters()).device):
                self.calls.append(list(prompts))
                return torch.full((len(prompts), 3, 4), float(len(prompts[0])))

    pipe = FakePipe()
    offload.park([pipe.enc])
    pipe.enc.moves.clear()
    emb = PromptEmbeddings(pipe, "cpu", host=True)
    out = emb(["a", "bb", "ccc", "a"])
    assert pipe.calls == [["a"], ["bb"], ["ccc"]]  # one prompt per encode call
    assert pipe.enc.moves == ["meta", "cpu"]  # one visit for the three
    assert out.shape == (4, 3, 4) and out[:, 0, 0].tolist() == [1.0, 2.0, 3.0, 1.0]
    emb(["bb", "a"])
    assert pipe.enc.moves == ["meta", "cpu"] and len(pipe.calls) == 3  # all known: no visit, no encode



"""FLUX.1 (FluxPipeline) end to end on the tiny random build `flux-tiny`: it loads in plain diffusers and through our
adapter (same condition as the pipeline's own encode_prompt; the denoiser wrapper gives the transformer's output as
FluxPipeline calls it: packed latents, ids, timestep / 1000, embedded guidance); our static-shift schedule is
FluxPipeline's dynamic one at the run's resolution; the trainer runs it with LoRA and with full fine-tuning,
on-policy ratio exactly 1; the exports load in plain diffusers in a fresh process and FluxPipeline's own sampling
loop reproduces the trained policy's deterministic sample. Also the FLUX.1-dev real-shape build, on the meta device."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import cpu_env, finish_plain_export, policy_from_checkpoint, start_plain_export, train_modes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GUIDANCE, RES = 4, 3.5, 32
EMBEDDED = 5.0  # the runs' embedded guidance: not FluxPipeline's default 3.5, so an export that lost it would fail
RUN = [f"--config.sample.num_steps={STEPS}", f"--config.pretrained.embedded_guidance={EMBEDDED}",
       "--config.num_epochs=2", "--config.save_freq=1", "--config.num_checkpoint_limit=5", "--config.eval_freq=0",
       "--config.sample.batch_size=4", "--config.train.batch_size=4", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.train.timestep_fraction=1.0"]
MODES = {"lora": ["--config.use_lora=True"], "full": ["--config.use_lora=False"]}
PROMPTS = ["a red circle on the left", "a blue square in the middle", "a green triangle on the right"]

@pytest.fixture(scope="module")
def tiny(cache):
    from ddpo_grpo.models import load_pipeline

    return load_pipeline("flux-tiny", resolution=RES)


@pytest.fixture(scope="module")
def plain(tiny):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny.path)


def flux_call(transformer, x, t, seq, pooled, guidance, vae_scale=4):
    """The transformer called as FluxPipeline.__call__ calls it, on unpacked latents x (B, 16, h, w); the output
    unpacked with FluxPipeline._unpack_latents (pixel sizes)."""
    from diffusers import FluxPipeline

    B, C, h, w = x.shape
    g = torch.full([1], guidance, dtype=torch.float32).expand(B) if transformer.config.guidance_embeds else None
    out = transformer(hidden_states=FluxPipeline._pack_latents(x, B, C, h, w), timestep=t.to(x.dtype) / 1000,
                      guidance=g, pooled_projections=pooled, encoder_hidden_states=seq,
                      txt_ids=torch.zeros(seq.shape[1], 3),
                      img_ids=FluxPipeline._prepare_latent_image_ids(B, h // 2, w // 2, x.device, x.dtype),
                      return_dict=False)[0]
    return FluxPipeline._unpack_latents(out, h * vae_scale, w * vae_scale, vae_scale)


def test_tiny_build_loads_in_plain_diffusers_and_through_the_adapter(tiny, plain, cache):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel, T5TokenizerFast

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.models.base import pack_condition
    from ddpo_grpo.models.flux import FluxAdapter, FluxDenoiser

    path = os.path.join(cache, "flux-tiny")
    assert tiny.path == path and json.load(open(os.path.join(path, "model_index.json")))["_class_name"] == "FluxPipeline"
    assert isinstance(plain.transformer, FluxTransformer2DModel) and isinstance(plain.vae, AutoencoderKL)
    assert isinstance(plain.text_encoder, CLIPTextModel) and isinstance(plain.text_encoder_2, T5EncoderModel)
    assert isinstance(plain.tokenizer_2, T5TokenizerFast)
    assert isinstance(plain.scheduler, FlowMatchEulerDiscreteScheduler) and plain.scheduler.config.use_dynamic_shifting
    assert plain.transformer.config.guidance_embeds  # dev-like
    assert plain.vae.config.latent_channels == 16 and plain.vae.config.shift_factor == pytest.approx(0.1159)
    # every prompt word is one token for each tokenizer (the tiny tokenizers cover the toy-world words)
    n_words = len(PROMPTS[0].split())
    assert len(plain.tokenizer(PROMPTS[0]).input_ids) == n_words + 2  # <|startoftext|> ... <|endoftext|>
    ids = plain.tokenizer_2(PROMPTS[0]).input_ids
    assert len(ids) == n_words + 1 and plain.tokenizer_2.unk_token_id not in ids  # ... </s>

    assert isinstance(tiny.adapter, FluxAdapter) and isinstance(tiny.unet, FluxDenoiser) and tiny.family == "flow"
    assert tiny.resolution == RES and tiny.sample_shape == (16, 8, 8)  # 32 px / VAE 4
    assert decode(tiny.vae, torch.zeros(1, 16, 8, 8)).shape == (1, 3, 32, 32)
    with torch.no_grad():
        cond = tiny.encode(PROMPTS)
        seq, pooled, text_ids = plain.encode_prompt(PROMPTS, max_sequence_length=16)
    # 16 T5 tokens of width 32, and CLIP's 32 pooled dims in one extra row
    assert cond.shape == (3, 17, 32) and seq.shape == (3, 16, 32) and pooled.shape == (3, 32)
    assert torch.allclose(cond, pack_condition(seq, [pooled]), atol=1e-6)
    assert (cond[0] - cond[1]).abs().max() > 1e-3  # different prompts, different conditions


def test_denoiser_is_the_transformer_called_as_flux_pipeline_calls_it(tiny, plain):
    """Dev (guidance embedding) on the tiny build, and schnell (none) on a transformer built here."""
    from diffusers import FluxTransformer2DModel

    from ddpo_grpo.models.base import unpack_condition
    from ddpo_grpo.models.flux import FluxDenoiser, pack_latents, unpack_latents

    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 16, 8, 8, generator=g), torch.tensor([1000.0, 620.0, 90.0])
    with torch.no_grad():
        cond = tiny.encode(PROMPTS)
        seq, (pooled,) = unpack_condition(cond, [32])
        got = tiny.unet(x, t, encoder_hidden_states=cond).sample
        want = flux_call(plain.transformer, x, t, seq, pooled, GUIDANCE)
        assert got.shape == x.shape and torch.allclose(got, want, atol=1e-6)
        tiny.unet.guidance = 1.0  # the embedded guidance reaches the model
        try:
            other = tiny.unet(x, t, encoder_hidden_states=cond).sample
        finally:
            tiny.unet.guidance = GUIDANCE
        assert torch.allclose(other, flux_call(plain.transformer, x, t, seq, pooled, 1.0), atol=1e-6)
        assert (other - got).abs().max() > 1e-4
        # packing is a permutation: unpack inverts it exactly
        assert torch.equal(unpack_latents(pack_latents(x), 8, 8), x)
        torch.manual_seed(1)
        schnell = FluxTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                         num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                         guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()
        got = FluxDenoiser(schnell)(x, t, encoder_hidden_states=cond).sample
        assert torch.allclose(got, flux_call(schnell, x, t, seq, pooled, None), atol=1e-6)


def test_speed_switches_apply_to_the_wrapper(tiny):
    """apply_unet_options on the FLUX wrapper: "math" attention keeps FLUX's processors on plain-matmul attention
    (the generic AttnProcessor cannot run FLUX's rotary joint attention), gradient checkpointing reaches the model;
    same outputs, and a backward pass runs."""
    from diffusers.models.attention_dispatch import AttentionBackendName
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    from ml_collections import ConfigDict

    from ddpo_grpo.models import apply_unet_options, load_pipeline

    pipe = load_pipeline("flux-tiny", resolution=RES)
    apply_unet_options(pipe.unet, ConfigDict(dict(unet_attention="math", compile_unet="", channels_last=False,
                                                  gradient_checkpointing=True)))
    model = pipe.unet.model
    procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert procs and all(isinstance(p, FluxAttnProcessor) for p in procs)
    assert all(p._attention_backend == AttentionBackendName._NATIVE_MATH for p in procs)
    assert model.gradient_checkpointing
    x, t = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 300.0])
    cond = tiny.encode(PROMPTS[:2])
    with torch.no_grad():
        want = tiny.unet(x, t, encoder_hidden_states=cond).sample
    model.train()
    pipe.unet.requires_grad_(True)
    got = pipe.unet(x, t, encoder_hidden_states=cond).sample
    assert torch.allclose(got, want, atol=1e-5)
    got.square().mean().backward()
    assert model.proj_out.weight.grad.abs().sum() > 0 and model.transformer_blocks[0].attn.to_q.weight.grad is not None


@pytest.mark.parametrize("config_name,res,vae_scale", [("tiny", 32, 4), ("tiny", 48, 4), ("dev", 512, 8),
                                                        ("dev", 1024, 8), ("schnell", 1024, 8)])
def test_static_shift_schedule_is_flux_pipelines(plain, config_name, res, vae_scale):
    """FluxPipeline: sigmas linspace(1, 1/n, n) shifted by mu(image tokens) (dynamic); ours: set_timesteps(n) of the
    static-shift scheduler, as the flow family calls it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    from ddpo_grpo.models.flux import FLUX_DEV_SCHEDULER, static_scheduler

    cfg = {"tiny": dict(plain.scheduler.config), "dev": FLUX_DEV_SCHEDULER,
           "schnell": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)}[config_name]
    theirs = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    ours = static_scheduler(theirs, res, vae_scale)
    seq_len = (res // vae_scale // 2) ** 2
    mu = calculate_shift(seq_len, theirs.config.get("base_image_seq_len", 256),
                         theirs.config.get("max_image_seq_len", 4096), theirs.config.get("base_shift", 0.5),
                         theirs.config.get("max_shift", 1.15))
    if config_name == "dev" and res == 1024:  # 4096 tokens: FLUX's max_shift
        assert mu == pytest.approx(1.15) and ours.config.shift == pytest.approx(np.exp(1.15))
    for n in (1, 4, 16, 28):
        retrieve_timesteps(theirs, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu)  # FluxPipeline's call
        ours.set_timesteps(n, device="cpu")
        assert ours.sigmas.shape == theirs.sigmas.shape == (n + 1,)
        assert torch.allclose(ours.sigmas, theirs.sigmas, atol=1e-6, rtol=0)
        assert torch.allclose(ours.timesteps, theirs.timesteps, atol=1e-3, rtol=0)
    if config_name == "dev":  # shifted: not the unshifted linspace
        assert (ours.sigmas[1:-1] - torch.from_numpy(np.linspace(1.0, 1 / 28, 28)[1:]).float()).min() > 1e-3


@pytest.mark.parametrize("res", [32, 48])
def test_deterministic_sampler_is_flux_pipelines_call(tiny, plain, cache, res):
    """Our deterministic sampler (flow ODE) through the adapter = FluxPipeline.__call__ (its own schedule at this
    resolution, encode, packing, guidance, decode), untrained tiny model."""
    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import load_pipeline
    from diffusers import FluxPipeline

    pipe = tiny if res == RES else load_pipeline("flux-tiny", resolution=res)
    assert pipe.sample_shape == (16, res // 4, res // 4)
    x = torch.randn((2, *pipe.sample_shape), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(prompt=PROMPTS[:2], latents=FluxPipeline._pack_latents(x, *x.shape), height=res, width=res,
                     num_inference_steps=STEPS, guidance_scale=GUIDANCE, output_type="pt",
                     max_sequence_length=16).images
        got = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow"), pipe.encode(PROMPTS[:2]),
                                    num_inference_steps=STEPS, latents=x.clone(), vae=pipe.vae,
                                    deterministic=True).images
    assert got.shape == want.shape == (2, 3, res, res)
    assert (got - want).abs().max().item() <= 1e-5


def test_lora_targets_resolution_and_folder_checks(tiny, tmp_path):
    from ml_collections import ConfigDict

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable
    from ddpo_grpo.trainer.run.validate import check_resolution

    pipe = load_pipeline("flux-tiny", resolution=RES)
    make_trainable(pipe.unet, ConfigDict(dict(use_lora=True, lora_rank=2, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8))),
        pipe.adapter.lora_target_modules)
    wrapped = sorted(n[:-len(".lora_A")] for n, _ in inner_model(pipe.unet).named_modules() if n.endswith(".lora_A"))
    # the double block: every target; the single block: its attention's to_q/k/v (no separate out / text stream)
    want = sorted([f"transformer_blocks.0.{m}" for m in pipe.adapter.lora_target_modules]
                  + [f"single_transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v")])
    assert wrapped == want
    trainable = [n for n, p in pipe.unet.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # the adapter's configure: the run's embedded guidance onto the denoiser
    pipe.adapter.configure(pipe, ConfigDict(dict(pretrained=dict(embedded_guidance=2.0))))
    assert pipe.unet.guidance == 2.0
    # resolution: multiples of VAE (4) x packing (2); 0 is the VAE config's sample_size
    a, path = tiny.adapter, tiny.path
    assert a.check_resolution(path, 0) == a.check_resolution(path, 48) == a.check_resolution(path, 64) == ""
    assert "multiple of 8" in a.check_resolution(path, 20)
    assert load_pipeline("flux-tiny").resolution == 32
    check_resolution(ConfigDict(dict(pretrained=dict(model="flux-tiny", resolution=48))))
    with pytest.raises(ConfigError, match="multiple of 8"):
        check_resolution(ConfigDict(dict(pretrained=dict(model="flux-tiny", resolution=36))))
    # a folder without a component: one line naming it
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ConfigError, match="without text_encoder_2/"):
        load_pipeline(str(broken))


def test_flux_dev_random_build_has_flux_dev_shapes():
    """The real-shape build for GPU benchmarks, on the meta device (no memory): FLUX.1-dev's published sizes."""
    from ddpo_grpo.models.flux import FluxDenoiser, build_flux_dev_random

    pipe = build_flux_dev_random(resolution=512, torch_dtype=torch.bfloat16, device="meta")
    count = {k: sum(p.numel() for p in pipe.components[k].parameters())
             for k in ("transformer", "text_encoder", "text_encoder_2", "vae")}
    assert count == {"transformer": 11_901_408_320, "text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656,
                     "vae": 83_819_683}
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 and not p.requires_grad
               for k in count for p in pipe.components[k].parameters())
    assert isinstance(pipe.unet, FluxDenoiser) and pipe.unet.config.guidance_embeds and pipe.family == "flow"
    assert pipe.sample_shape == (16, 64, 64)  # 512 px / 8
    assert pipe.adapter.max_sequence_length(pipe) == 512
    # 512 px = 1024 image tokens: mu = 0.5 + (1024 - 256) * 0.65 / 3840
    assert pipe.scheduler.config.shift == pytest.approx(np.exp(0.5 + 768 * 0.65 / 3840))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """A 2-epoch flux_tiny run per mode (checkpoints after epochs 1 and 2), side by side."""
    tmp = tmp_path_factory.mktemp("flux_runs")
    return train_modes(tmp, "flux_tiny", cache, RUN, MODES)


def trained_policy_sample(ckpt: str, lora: bool) -> torch.Tensor:
    """The trained policy rebuilt from the checkpoint's training state, sampled deterministically (flow ODE, no CFG,
    the run's embedded guidance) by our sampler, from one seeded generator per sample as eval draws it."""
    from ml_collections import ConfigDict

    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings

    pipe = policy_from_checkpoint("flux-tiny", ckpt, lora, resolution=RES)
    pipe.adapter.configure(pipe, ConfigDict(dict(pretrained=dict(embedded_guidance=EMBEDDED))))
    with torch.no_grad():
        emb = torch.cat([pipe.encode([p]) for p in PROMPTS])
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow"), emb,
                                 num_inference_steps=STEPS, sample_shape=pipe.sample_shape, vae=pipe.vae,
                                 generator=[torch.Generator().manual_seed(s) for s in SEEDS], deterministic=True)
    return traj.images


SEEDS = [7, 8, 9]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_trains_on_policy_and_export_reproduces_the_policy_in_plain_diffusers(runs, mode, tmp_path, cache):
    """The export alone (PLAIN_EXPORT: its files and export.json, nothing but prompts and seeds passed by hand; FluxPipeline's
    own __call__ with the folder's dynamic-shift scheduler at the recorded size, the recorded embedded guidance)
    reproduces the trained policy's deterministic sample."""
    run = runs / mode
    history = json.load(open(run / "summary.json"))["history"]
    assert [h["epoch"] for h in history] == [0, 1]
    for h in history:  # the live check: before the first update the re-scored log-probs are the sampled ones
        assert 0.0 <= h["train"]["onpolicy_ratio_max_dev"] <= 1e-6
        assert h["train"]["grad_norm"] > 0
    ckpts = sorted((run / "checkpoints").glob("checkpoint_*"))
    assert [c.name for c in ckpts] == ["checkpoint_00001", "checkpoint_00002"]
    lora = mode == "lora"
    export_files = sorted(os.listdir(run / "export"))
    if lora:  # diffusers' FLUX LoRA file: transformer.<module>.lora_A/B.weight, and the scheduler to sample with
        assert export_files == ["export.json", "pytorch_lora_weights.safetensors", "scheduler"]
        keys = list(load_file(str(run / "export" / "pytorch_lora_weights.safetensors")))
        assert keys and all(k.startswith("transformer.") and ".lora_" in k and "base_layer" not in k for k in keys)
        assert any(".attn.add_q_proj.lora_A." in k for k in keys) and any("single_transformer_blocks.0.attn.to_q.lora_B."
                                                                          in k for k in keys)
    else:  # a complete FluxPipeline folder
        assert export_files == ["export.json", "model_index.json", "scheduler", "text_encoder", "text_encoder_2",
                                "tokenizer", "tokenizer_2", "transformer", "vae"]
    # the folder's own (dynamic-shift) scheduler: FluxPipeline computes the run's shift from the recorded size
    sched = json.load(open(run / "export" / "scheduler" / "scheduler_config.json"))
    assert sched["_class_name"] == "FlowMatchEulerDiscreteScheduler" and sched["use_dynamic_shifting"]
    # the end of the run (epoch 2) and the checkpoint in the middle (epoch 1), in one fresh process
    pairs = ((run / "export", ckpts[-1]), (ckpts[0] / "export", ckpts[0]))
    for export, ckpt in pairs:
        info = json.load(open(export / "export.json"))
        assert info["epoch"] == int(ckpt.name[-5:]) and info["guidance_scale"] == 1.0
        assert info["embedded_guidance"] == EMBEDDED and (info["height"], info["width"]) == (RES, RES)
    proc = start_plain_export([e for e, _ in pairs], PROMPTS, SEEDS, tmp_path, cpu_env(DDPO_GRPO_TINY_CACHE=cache))
    wants = [trained_policy_sample(str(ckpt), lora) for _, ckpt in pairs]
    got = finish_plain_export(proc, tmp_path)
    for (export, _), want in zip(pairs, wants):
        assert got[str(export)]["pipeline"] == "FluxPipeline"
        assert got[str(export)]["samples"].shape == want.shape == (3, 3, RES, RES)
        assert (got[str(export)]["samples"] - want).abs().max().item() <= 1e-5
    # training moved the policy: the two checkpoints sample different images, so the comparison above could fail
    assert (wants[0] - wants[1]).abs().max().item() > 1e-4

"""Stable Diffusion 3 (StableDiffusion3Pipeline) end to end on the tiny random build `sd3-tiny`: it loads in plain
diffusers and through our adapter (same condition as the pipeline's own encode_prompt, same denoiser output as the
transformer called directly); the trainer runs it with LoRA and with full fine-tuning, on-policy ratio exactly 1;
the exports load in plain diffusers in a fresh process and StableDiffusion3Pipeline's own sampling loop reproduces
the trained policy's deterministic sample; a SIGKILL mid-epoch and resume gives bit-identical weights."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import cpu_env, finish_plain_export, policy_from_checkpoint, start_plain_export, train_modes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GUIDANCE = 4, 4.5
RUN = [f"--config.sample.num_steps={STEPS}", f"--config.sample.guidance_scale={GUIDANCE}", "--config.num_epochs=2",
       "--config.save_freq=1", "--config.num_checkpoint_limit=5", "--config.eval_freq=0",
       "--config.logging.wandb=False", "--config.logging.tensorboard=False", "--config.logging.image_freq=0",
       "--config.train.timestep_fraction=1.0", "--config.train.min_step_std=0.0"]
MODES = {"lora": ["--config.use_lora=True"], "full": ["--config.use_lora=False"],
         # trees on the latent model (issue 29): one split at step 1 of 4 into K = 2, the flow ODE elsewhere
         "branch": ["--config.use_lora=True", "--config.sample.branch_steps=(1,)", "--config.sample.branches=2"]}
PROMPTS = ["a red circle on the left", "a blue square in the middle", "a green triangle on the right"]

@pytest.fixture(scope="module")
def tiny(cache):
    from ddpo_grpo.models import load_pipeline

    return load_pipeline("sd3-tiny")


def test_tiny_build_loads_in_plain_diffusers_and_through_the_adapter(tiny, cache):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, \
        StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.models.base import pack_condition
    from ddpo_grpo.models.sd3 import SD3Adapter, SD3Denoiser

    path = os.path.join(cache, "sd3-tiny")
    assert tiny.path == path and json.load(open(os.path.join(path, "model_index.json")))["_class_name"] == \
        "StableDiffusion3Pipeline"
    plain = StableDiffusion3Pipeline.from_pretrained(path)
    assert isinstance(plain.transformer, SD3Transformer2DModel) and isinstance(plain.vae, AutoencoderKL)
    assert isinstance(plain.text_encoder, CLIPTextModelWithProjection)
    assert isinstance(plain.text_encoder_2, CLIPTextModelWithProjection)
    assert isinstance(plain.text_encoder_3, T5EncoderModel)
    assert isinstance(plain.scheduler, FlowMatchEulerDiscreteScheduler)
    assert plain.vae.config.latent_channels == 16 and plain.vae.config.shift_factor == pytest.approx(0.0609)
    # every prompt word is one token for each tokenizer (the tiny tokenizers cover the toy-world words)
    n_words = len(PROMPTS[0].split())
    assert len(plain.tokenizer(PROMPTS[0]).input_ids) == n_words + 2  # <|startoftext|> ... <|endoftext|>
    assert len(plain.tokenizer_3(PROMPTS[0]).input_ids) == n_words + 1  # ... </s>
    assert plain.tokenizer_3.unk_token_id not in plain.tokenizer_3(PROMPTS[0]).input_ids

    assert isinstance(tiny.adapter, SD3Adapter) and isinstance(tiny.unet, SD3Denoiser) and tiny.family == "flow"
    assert tiny.sample_shape == (16, 8, 8)
    assert decode(tiny.vae, torch.zeros(1, 16, 8, 8)).shape == (1, 3, 32, 32)
    with torch.no_grad():
        cond = tiny.encode(PROMPTS)
        seq, _, pooled, _ = plain.encode_prompt(PROMPTS, PROMPTS, PROMPTS, do_classifier_free_guidance=False,
                                                max_sequence_length=16)
    # 16 CLIP tokens + 16 T5 tokens of width 64, and the 32 pooled dims in one extra row
    assert cond.shape == (3, 33, 64) and seq.shape == (3, 32, 64) and pooled.shape == (3, 32)
    assert torch.allclose(cond, pack_condition(seq, [pooled]), atol=1e-6)
    assert (cond[0] - cond[1]).abs().max() > 1e-3  # different prompts, different conditions
    # the wrapper's call is the transformer's call with the unpacked condition
    x, t = torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 500.0, 100.0])
    with torch.no_grad():
        got = tiny.unet(x, t, encoder_hidden_states=cond).sample
        want = plain.transformer(hidden_states=x, timestep=t, encoder_hidden_states=seq, pooled_projections=pooled,
                                 return_dict=False)[0]
    assert got.shape == x.shape and torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("D,sizes", [(64, [32]), (4096, [2048]), (8, [20, 3])])
def test_pack_unpack_round_trip(D, sizes):
    from ddpo_grpo.models.base import pack_condition, unpack_condition

    g = torch.Generator().manual_seed(0)
    seq = torch.randn(2, 5, D, generator=g)
    vecs = [torch.randn(2, d, generator=g) for d in sizes]
    packed = pack_condition(seq, vecs)
    rows = -(-sum(sizes) // D)
    assert packed.shape == (2, 5 + rows, D)
    assert (packed[:, 5:].reshape(2, -1)[:, sum(sizes):] == 0).all()  # zero padding after the vectors
    back, out = unpack_condition(packed, sizes)
    assert torch.equal(back, seq) and all(torch.equal(a, b) for a, b in zip(out, vecs))


def test_lora_targets_the_joint_attention_and_resolution_check(tiny):
    from ml_collections import ConfigDict

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable

    pipe = load_pipeline("sd3-tiny")
    make_trainable(pipe.unet, ConfigDict(dict(use_lora=True, lora_rank=2, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8))),
        pipe.adapter.lora_target_modules)
    wrapped = sorted(n[:-len(".lora_A")] for n, _ in inner_model(pipe.unet).named_modules() if n.endswith(".lora_A"))
    # 2 joint blocks x 8 projections, less the last block's text output (context_pre_only: no to_add_out)
    want = sorted(f"transformer_blocks.{b}.{m}" for b in (0, 1) for m in pipe.adapter.lora_target_modules
                  if not (b == 1 and m == "attn.to_add_out"))
    assert wrapped == want
    trainable = [n for n, p in pipe.unet.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # other sizes than the native 32 px: multiples of VAE (4) x patch (2) up to the position embedding's 8 patches
    path = tiny.path
    assert tiny.adapter.check_resolution(path, 0) == "" and tiny.adapter.check_resolution(path, 16) == ""
    assert "multiple of 8" in tiny.adapter.check_resolution(path, 20)
    assert "up to 64 px" in tiny.adapter.check_resolution(path, 72)
    assert load_pipeline("sd3-tiny", resolution=16).sample_shape == (16, 4, 4)  # 16 px / 4


def test_speed_switches_reach_the_transformer(tiny):
    """apply_unet_options on the wrapper: unet_attention="math" keeps SD3's joint attention (same output as SDPA's,
    the math backend), gradient_checkpointing turns on in the transformer."""
    from ml_collections import ConfigDict

    from ddpo_grpo.models import apply_unet_options, load_pipeline

    pipe = load_pipeline("sd3-tiny")
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([700.0, 300.0])
    with torch.no_grad():
        cond = pipe.encode(PROMPTS[:2])
        before = pipe.unet(x, t, encoder_hidden_states=cond).sample
    apply_unet_options(pipe.unet, ConfigDict(dict(unet_attention="math", channels_last=False, compile_unet="",
                                                  gradient_checkpointing=True)))
    model = pipe.unet.model
    assert model.gradient_checkpointing
    assert {type(p).__name__ for p in model.attn_processors.values()} == {"JointAttnProcessorMath"}
    with torch.no_grad():
        after = pipe.unet(x, t, encoder_hidden_states=cond).sample
    assert torch.allclose(before, after, atol=1e-5) and before.abs().max() > 0


def test_sd3_config_validates_with_a_folder_and_says_what_is_wrong_in_one_line(tiny, tmp_path):
    """config/grpo.py:sd3 (a user's folder) passes validation with an SD3 folder; without one, at a size the folder
    cannot sample, or with a folder that lacks a component, it stops with one ConfigError line."""
    import shutil

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.run.validate import validate_config

    from helpers import grpo_configs

    configs = grpo_configs()
    config = configs.get_config("sd3")
    assert config.pretrained.resolution == 512 and config.use_lora and config.gradient_checkpointing
    with pytest.raises(ConfigError, match=r"^pretrained.model: model path '' is not a folder"):
        validate_config(config, 1)
    config.pretrained.model = tiny.path
    with pytest.raises(ConfigError, match=r"^pretrained.resolution: resolution 512 must be a multiple of 8 px .* up "
                                          r"to 64 px"):
        validate_config(config, 1)
    config.pretrained.resolution = 32
    assert validate_config(config, 1) == "flow"
    # a folder without T5: refused when loaded (before any training), naming what is missing
    broken = tmp_path / "no_t5"
    shutil.copytree(tiny.path, broken)
    shutil.rmtree(broken / "text_encoder_3")
    with pytest.raises(ConfigError, match="without text_encoder_3/"):
        load_pipeline(str(broken))


def test_dynamic_shift_config_samples_the_stock_pipeline_schedule(tiny, tmp_path):
    """A folder whose scheduler shifts dynamically (use_dynamic_shifting): our sampler's schedule is the one
    StableDiffusion3Pipeline takes at the run's image size (its mu from the token count), not the static shift's."""
    import shutil

    from diffusers import StableDiffusion3Pipeline

    from ddpo_grpo.core.families import get_family
    from ddpo_grpo.models import load_pipeline

    folder = tmp_path / "dynamic"
    shutil.copytree(tiny.path, folder)
    cfg_file = folder / "scheduler" / "scheduler_config.json"
    cfg = json.load(open(cfg_file))
    cfg.update(use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64, base_shift=0.5, max_shift=1.5)
    json.dump(cfg, open(cfg_file, "w"))
    seen = []
    plain = StableDiffusion3Pipeline.from_pretrained(str(folder))
    plain("a red circle", num_inference_steps=STEPS, guidance_scale=1.0, output_type="latent", max_sequence_length=16,
          callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or {})
    for resolution in (0, 16):  # 16 image tokens (native 32 px) and 4 (16 px): different shifts
        pipe = load_pipeline(str(folder), resolution=resolution)
        get_family("flow").set_timesteps(pipe.scheduler, STEPS)
        if resolution == 0:
            assert pipe.scheduler.timesteps.tolist() == pytest.approx(seen, abs=1e-4)
        else:
            assert pipe.scheduler.timesteps[1].item() < seen[1] - 1.0  # fewer tokens, less shift
    get_family("flow").set_timesteps(tiny.scheduler, STEPS)  # the static shift 3.0 of the tiny build: another one
    assert abs(tiny.scheduler.timesteps[1].item() - seen[1]) > 1.0


def test_sd35_medium_random_build_has_the_real_shapes_on_the_meta_device():
    """The GPU benchmark's SD3.5-Medium build, made on the meta device (no memory): each component's parameter count
    is the released model's, in bf16, and the condition / latent / denoiser shapes are SD3.5's at 512 px."""
    from ddpo_grpo.models.sd3 import build_sd35_medium_random

    pipe = build_sd35_medium_random(resolution=512, device="meta")
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    # millions of parameters: MMDiT 2.24 B (+ the 226 M-entry position-embedding buffer = SD3.5-Medium's 2.5 B),
    # CLIP-L 124 M, CLIP-G 695 M, T5-XXL encoder 4.76 B, VAE 84 M
    assert {k: round(v / 1e6) for k, v in counts.items()} == {
        "transformer": 2243, "vae": 84, "text_encoder": 124, "text_encoder_2": 695, "text_encoder_3": 4762}
    assert pipe.components["transformer"].pos_embed.pos_embed.numel() == 384 * 384 * 1536
    assert all(p.dtype == torch.bfloat16 and p.is_meta for m in pipe.components.values()
               if isinstance(m, torch.nn.Module) for p in m.parameters())
    assert torch.get_default_dtype() == torch.float32  # restored
    assert pipe.sample_shape == (16, 64, 64) and pipe.family == "flow"
    with torch.no_grad():
        cond = pipe.encode(["a red circle on the left"])
        x = torch.zeros(2, *pipe.sample_shape, device="meta", dtype=torch.bfloat16)
        out = pipe.unet(x, torch.full((2,), 500.0, device="meta"), encoder_hidden_states=cond.expand(2, -1, -1))
    assert cond.shape == (1, 77 + 256 + 1, 4096) and out.sample.shape == x.shape


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """A 2-epoch sd3_tiny run per mode (checkpoints after epochs 1 and 2), side by side."""
    tmp = tmp_path_factory.mktemp("sd3_runs")
    return train_modes(tmp, "sd3_tiny", cache, RUN, MODES)


def trained_policy_sample(ckpt: str, lora: bool) -> torch.Tensor:
    """The trained policy rebuilt from the checkpoint's training state, sampled deterministically (flow ODE, CFG
    with the empty prompt's condition as the trainer does) by our sampler, one seeded generator per sample as eval."""
    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings

    pipe = policy_from_checkpoint("sd3-tiny", ckpt, lora)
    with torch.no_grad():
        emb = torch.cat([pipe.encode([p]) for p in PROMPTS])
        neg = pipe.encode([""]).expand(len(PROMPTS), -1, -1)
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow", guidance_scale=GUIDANCE),
                                 emb, neg, num_inference_steps=STEPS, sample_shape=pipe.sample_shape, vae=pipe.vae,
                                 generator=[torch.Generator().manual_seed(s) for s in SEEDS], deterministic=True)
    return traj.images


SEEDS = [7, 8, 9]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_trains_on_policy_and_export_reproduces_the_policy_in_plain_diffusers(runs, mode, tmp_path, cache):
    """The export alone (PLAIN_EXPORT: its files and export.json, nothing but prompts and seeds passed by hand;
    StableDiffusion3Pipeline's own __call__: flow ODE, CFG with the empty negative prompt, VAE decode with
    shift_factor) reproduces the trained policy's deterministic sample."""
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
    if lora:  # diffusers' SD3 LoRA file: transformer.<module>.lora_A/B.weight, and the scheduler to sample with
        assert export_files == ["export.json", "pytorch_lora_weights.safetensors", "scheduler"]
        keys = list(load_file(str(run / "export" / "pytorch_lora_weights.safetensors")))
        assert keys and all(k.startswith("transformer.") and ".lora_" in k and "base_layer" not in k for k in keys)
        assert any(".attn.add_q_proj.lora_A." in k for k in keys) and any(".attn.to_q.lora_B." in k for k in keys)
    else:  # a complete StableDiffusion3Pipeline folder
        assert export_files == ["export.json", "model_index.json", "scheduler", "text_encoder", "text_encoder_2",
                                "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3", "transformer", "vae"]
    # the end of the run (epoch 2) and the checkpoint in the middle (epoch 1), in one plain process that runs while
    # this one samples the policy
    pairs = ((run / "export", ckpts[-1]), (ckpts[0] / "export", ckpts[0]))
    for export, ckpt in pairs:
        info = json.load(open(export / "export.json"))
        assert info["epoch"] == int(ckpt.name[-5:]) and info["guidance_scale"] == GUIDANCE
        assert info["pipeline_call"]["guidance_scale"] == GUIDANCE and info["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    proc = start_plain_export([e for e, _ in pairs], PROMPTS, SEEDS, tmp_path, cpu_env())
    wants = [trained_policy_sample(str(ckpt), lora) for _, ckpt in pairs]
    got = finish_plain_export(proc, tmp_path)
    for (export, _), want in zip(pairs, wants):
        assert got[str(export)]["pipeline"] == "StableDiffusion3Pipeline"
        assert got[str(export)]["samples"].shape == want.shape == (3, 3, 32, 32)
        assert (got[str(export)]["samples"] - want).abs().max().item() <= 1e-5
    # training moved the policy: the two checkpoints sample different images, so the comparison above could fail
    assert (wants[0] - wants[1]).abs().max().item() > 1e-4
    # eval_model.py takes the export as --model, and the checkpoint as --weights over the base: decoded 32 px images
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from eval_model import evaluate_model, resolve_model

    kw = dict(num_samples=2, steps=STEPS, guidance=GUIDANCE, split="eval", objects="single")
    model, weights, _ = resolve_model(str(run / "export"), "")
    as_model = evaluate_model(model, weights=weights, **kw)[1]
    over_base = evaluate_model("sd3-tiny", weights=str(ckpts[-1]), **kw)[1]
    assert as_model.shape == (2, 3, 32, 32) and torch.allclose(as_model, over_base, atol=1e-6)


def test_branched_trees_train_the_latent_transformer_through_its_adapter(runs):
    # The same LoRA run on trees: the live GRPO check of the sibling groups passed every epoch (the run exits 0 only
    # then), the re-scored split step has ratio 1, and the trunk is shared. Denoiser rows per 2-leaf tree: 1 at
    # step 0, K = 2 at the split (step 1), 2 at each of steps 2-3 = 7 per 2 samples, against 4 per sample (CFG
    # doubles both); training re-scores only the split step, once per leaf, against all 4 steps.
    plain, tree = (json.load(open(runs / m / "summary.json"))["history"] for m in ("lora", "branch"))
    assert [h["epoch"] for h in tree] == [0, 1]
    for p, h in zip(plain, tree):
        assert 0.0 <= h["train"]["onpolicy_ratio_max_dev"] <= 1e-6 and h["train"]["grad_norm"] > 0
        assert h["nfe_per_sample"]["sampling"] == pytest.approx(p["nfe_per_sample"]["sampling"] * 7 / 8, rel=1e-12)
        assert h["nfe_per_sample"]["training"] < p["nfe_per_sample"]["training"] / 2
    assert sorted(os.listdir(runs / "branch" / "export")) == ["export.json", "pytorch_lora_weights.safetensors",
                                                               "scheduler"]


def _start(tmp, name, cache, extra=()):
    """An sd3_tiny trainer run in the background in a session of its own, unbuffered output to tmp/<name>.out."""
    args = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:sd3_tiny", f"--config.logdir={tmp}",
            f"--config.run_name={name}", *RESUME, *extra]
    with open(tmp / f"{name}.out", "w") as out:
        return subprocess.Popen(args, cwd=ROOT, env=cpu_env(DDPO_GRPO_TINY_CACHE=cache, PYTHONUNBUFFERED="1"),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc, tmp, name) -> str:
    proc.wait(timeout=300)
    out = (tmp / f"{name}.out").read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


# 3 epochs of 32 samples (8 conditions x k=4 from a fixed set of 8, shared x_T), the kill inside the lr warmup
RESUME = [f"--config.sample.num_steps={STEPS}", "--config.num_epochs=3", "--config.save_freq=1", "--config.eval_freq=0",
          "--config.sample.num_batches_per_epoch=4", "--config.train.lr_warmup_steps=6",
          "--config.sample.shared_init_noise=True", "--config.data.num_conditions=8",
          "--config.logging.debug_dump=True", "--config.logging.wandb=False", "--config.logging.tensorboard=False",
          "--config.logging.image_freq=0"]


@pytest.mark.timeout(600)  # a hang guard (three runs): a loaded suite stretches them toward the 300 s it was
def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path, cache):
    straight = _start(tmp_path, "straight", cache)
    proc = _start(tmp_path, "killed", cache)
    deadline = time.time() + 480
    # killed between epoch 1's sampling and its update (the GRPO check line comes after sampling, before training)
    while proc.poll() is None and time.time() < deadline and \
            "epoch 1: GRPO check" not in (tmp_path / "killed.out").read_text():
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = tmp_path / "killed" / "checkpoints"
    assert (ckpts / "checkpoint_00001").exists() and not (ckpts / "checkpoint_00002").exists()
    _finish(straight, tmp_path, "straight")
    out = _finish(_start(tmp_path, "killed", cache, [f"--config.resume_from={tmp_path / 'killed'}"]), tmp_path,
                  "killed")
    assert "resumed from" in out and "at epoch 1" in out
    finals = [load_file(str(tmp_path / run / "checkpoints" / "checkpoint_00003" / "model.safetensors"))
              for run in ("straight", "killed")]
    assert finals[0].keys() == finals[1].keys() and any(".lora_A." in k for k in finals[0])
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
    moved = []
    for epoch in range(3):
        s, k = [json.load(open(tmp_path / run / "debug" / f"epoch_{epoch:04d}_rank_0.json"))
                for run in ("straight", "killed")]
        assert s["rewards"] == k["rewards"] and s["weights_sum"] == k["weights_sum"], epoch
        assert any(s["advantages"]), epoch
        moved.append(s["weights_sum"])
    assert len(set(moved)) == 3  # the weights moved every epoch, so the comparisons above could fail

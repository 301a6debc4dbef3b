"""Wan 2.1 text-to-video (WanPipeline) end to end on the tiny random build `wan-tiny` (32x32 px, 5 frames): it loads in
plain diffusers and through our adapter (the pipeline's own encode_prompt, the transformer called on 5-D latents, the
released UniPC flow_shift config read as flow-matching Euler, decode as WanPipeline's); the trainer runs it with LoRA and with full fine-tuning, on-policy ratio exactly 1; the exports load in plain
diffusers in a fresh process and WanPipeline's own sampling loop reproduces the trained policy's deterministic clip;
a SIGKILL mid-epoch and resume gives bit-identical weights. Rewards, grids and wandb on clips: tests/test_video_rewards.py."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ddpo_grpo.core.loss import ONPOLICY_TOL_EXACT
import torch
from helpers import cpu_env, finish_plain_export, policy_from_checkpoint, start_plain_export, train_modes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GUIDANCE, SIZE, FRAMES = 4, 4.0, 32, 5  # none of them WanPipeline's default (5.0, 480 x 832 px, 81 frames)
LATENT = (16, 2, 4, 4)  # 16 channels, (5 - 1) / 4 + 1 latent frames, 32 / 8 px
RUN = [f"--config.sample.num_steps={STEPS}", f"--config.sample.guidance_scale={GUIDANCE}", "--config.num_epochs=2",
       "--config.save_freq=1", "--config.num_checkpoint_limit=5", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.train.timestep_fraction=1.0", "--config.train.min_step_std=0.0",
       "--config.train.learning_rate=3e-3"]
# LoRA: with the eval (epoch 0 and the final policy) and a grid per epoch; full: neither.
MODES = {"lora": ["--config.use_lora=True", "--config.eval_freq=2", "--config.logging.image_freq=1"],
         "full": ["--config.use_lora=False", "--config.eval_freq=0", "--config.logging.image_freq=0"]}
PROMPTS = ["a red circle on the left", "a blue square in the center", "a green triangle on the right"]

@pytest.fixture(scope="module")
def tiny(cache):
    from ddpo_grpo.models import load_pipeline

    return load_pipeline("wan-tiny", resolution=SIZE, num_frames=FRAMES)


# ------------------------------------------------------------------------------------ the build and the adapter
def test_tiny_build_loads_in_plain_diffusers_and_through_the_adapter(tiny, cache):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline, \
        WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.models.wan import WanAdapter

    path = os.path.join(cache, "wan-tiny")
    assert tiny.path == path and json.load(open(os.path.join(path, "model_index.json")))["_class_name"] == "WanPipeline"
    plain = WanPipeline.from_pretrained(path)
    assert isinstance(plain.transformer, WanTransformer3DModel) and isinstance(plain.vae, AutoencoderKLWan)
    assert isinstance(plain.text_encoder, UMT5EncoderModel)
    # the folder holds Wan's released scheduler kind; we sample it as flow-matching Euler with its flow_shift
    assert isinstance(plain.scheduler, UniPCMultistepScheduler) and plain.scheduler.config.flow_shift == 3.0
    assert isinstance(tiny.scheduler, FlowMatchEulerDiscreteScheduler) and tiny.scheduler.config.shift == 3.0
    assert tiny.family == "flow" and isinstance(tiny.adapter, WanAdapter)
    assert tiny.unet is tiny.components["transformer"]  # no wrapper: it takes the UNet call as it is
    # every prompt word is one token (the tiny tokenizer covers the toy-world words), then </s>
    ids = plain.tokenizer(PROMPTS[0]).input_ids
    assert len(ids) == len(PROMPTS[0].split()) + 1 and plain.tokenizer.unk_token_id not in ids
    spelled = plain.tokenizer.convert_ids_to_tokens(plain.tokenizer("a zebra").input_ids)  # others: letter by letter
    assert spelled == ["\u2581a", "\u2581", "z", "e", "b", "r", "a", "</s>"]

    assert tiny.sample_shape == LATENT
    with torch.no_grad():
        cond = tiny.encode(PROMPTS)
        want, _ = plain.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=512)
    assert cond.shape == (3, 512, 32) and torch.equal(cond, want)  # 512: what WanPipeline.__call__ pads to
    assert (cond[:, 7:] == 0).all() and (cond[0] - cond[1]).abs().max() > 1e-3  # zero after the 7 tokens
    # the UNet-style call on 5-D latents is the transformer's own call
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, *LATENT, generator=g), torch.tensor([900.0, 500.0, 100.0])
    with torch.no_grad():
        got = tiny.unet(x, t, encoder_hidden_states=cond).sample
        ref = plain.transformer(hidden_states=x, timestep=t, encoder_hidden_states=want, return_dict=False)[0]
    assert got.shape == x.shape and torch.equal(got, ref)
    # decode: frames (B, F, 3, H, W) in [0, 1], as WanPipeline: latents * std + mean, VAE, postprocess_video
    with torch.no_grad():
        frames = decode(tiny.vae, x)
        mean = torch.tensor(plain.vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(plain.vae.config.latents_std).view(1, 16, 1, 1, 1)
        video = plain.vae.decode(x / (1.0 / std) + mean, return_dict=False)[0]  # WanPipeline.__call__'s arithmetic
        stock = plain.video_processor.postprocess_video(video, output_type="pt")
    assert frames.shape == (3, FRAMES, 3, SIZE, SIZE) and stock.shape == frames.shape
    assert (frames - stock).abs().max().item() <= 1e-6 and frames.std() > 0.01


def test_sizes_lora_targets_and_refusals(tiny, cache):
    from ml_collections import ConfigDict

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable

    path = tiny.path
    # WanPipeline's defaults without a size (480x832 px, 81 frames), other sizes on request
    native = load_pipeline("wan-tiny")
    assert (native.height, native.width, native.num_frames) == (480, 832, 81)
    assert native.sample_shape == (16, 21, 60, 104)
    assert load_pipeline("wan-tiny", resolution=64, num_frames=9).sample_shape == (16, 3, 8, 8)
    native.adapter.configure(native, ConfigDict(dict(pretrained=dict(num_frames=13))))
    assert native.sample_shape == (16, 4, 60, 104)
    assert tiny.adapter.check_resolution(path, 48) == "" and "multiple of 16" in tiny.adapter.check_resolution(path, 40)
    with pytest.raises(ConfigError, match="1 \\+ 4k"):
        load_pipeline("wan-tiny", resolution=SIZE, num_frames=6)
    with pytest.raises(ConfigError, match="1 \\+ 4k"):
        native.adapter.configure(native, ConfigDict(dict(pretrained=dict(num_frames=8))))
    with pytest.raises(ConfigError, match="video models"):
        load_pipeline("tiny-t2i", num_frames=5)

    pipe = load_pipeline("wan-tiny", resolution=SIZE, num_frames=FRAMES)
    make_trainable(pipe.unet, ConfigDict(dict(use_lora=True, lora_rank=2, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8))),
        pipe.adapter.lora_target_modules)
    wrapped = sorted(n[:-len(".lora_A")] for n, _ in inner_model(pipe.unet).named_modules() if n.endswith(".lora_A"))
    want = sorted([f"blocks.{b}.{a}.{m}" for b in (0, 1) for a in ("attn1", "attn2")
                   for m in ("to_q", "to_k", "to_v", "to_out.0")]
                  + [f"blocks.{b}.ffn.net.{m}" for b in (0, 1) for m in ("0.proj", "2")])
    assert wrapped == want
    trainable = [n for n, p in pipe.unet.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_height_width_are_for_video_models_only(cache):
    """pretrained.height / width: a Wan folder checks them against its VAE x patch before loading; any image model
    (which samples pretrained.resolution's square) refuses them in one line instead of ignoring them, and
    scripts/train.py exits 2 with that line before anything loads."""
    from ml_collections import ConfigDict

    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.run.validate import check_height_width

    def cfg(model, h, w):
        return ConfigDict(dict(pretrained=dict(model=model, resolution=0, height=h, width=w)))

    check_height_width(cfg("wan-tiny", 32, 48))
    check_height_width(cfg("tiny-t2i", 0, 0))
    check_height_width(cfg("recam-1.3b-random", 480, 832))  # a built video model: its builder's set_size checks
    with pytest.raises(ConfigError, match="pretrained.width: width 40 must be a positive multiple of 16"):
        check_height_width(cfg("wan-tiny", 32, 40))
    for model in ("tiny-t2i", "sd15-random", "sdxl-random", "flux-dev-random", "sd35-medium-random", "tiny-recam"):
        with pytest.raises(ConfigError, match="apply to video models .* samples pretrained.resolution's square"):
            check_height_width(cfg(model, 0, 48))
    env = dict(cpu_env(), WORLD_SIZE="1")
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny",
                        "--config.pretrained.height=32", "--config.pretrained.width=48"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "error: pretrained.height=32 / pretrained.width=48 apply to video models (Wan, ReCamMaster); 'tiny-t2i' (sd) "
        "samples pretrained.resolution's square: set that and leave height and width at 0"]
    assert not any("startup:" in line for line in p.stdout.splitlines())


def test_real_shape_build_has_wan21_1_3b_sizes_on_the_meta_device():
    """The GPU benchmark's build, made on the meta device (no memory): Wan 2.1 T2V 1.3B's 1.42 B-parameter
    transformer, UMT5-XXL's 5.68 B encoder and the 127 M Wan VAE, in bf16; 480x832 px x 81 frames by default."""
    from ddpo_grpo.models.wan import build_wan21_1_3b_random

    pipe = build_wan21_1_3b_random(device="meta")
    sizes = {k: sum(p.numel() for p in pipe.components[k].parameters()) for k in ("transformer", "text_encoder", "vae")}
    assert round(sizes["transformer"] / 1e7) == 142 and round(sizes["text_encoder"] / 1e7) == 568
    assert round(sizes["vae"] / 1e6) == 127
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in pipe.unet.parameters())
    assert pipe.family == "flow" and pipe.scheduler.config.shift == 3.0
    assert pipe.sample_shape == (16, 21, 60, 104)
    assert build_wan21_1_3b_random(resolution=256, num_frames=33, device="meta").sample_shape == (16, 9, 32, 32)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        build_wan21_1_3b_random(num_frames=32, device="meta")


# ------------------------------------------------------------------------------------------------ trainer runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """A 2-epoch wan_tiny run per mode (checkpoints after epochs 1 and 2), side by side."""
    tmp = tmp_path_factory.mktemp("wan_runs")
    return train_modes(tmp, "wan_tiny", cache, RUN, MODES)


def trained_policy_sample(ckpt: str, lora: bool) -> torch.Tensor:
    """The trained policy rebuilt from the checkpoint's training state, sampled deterministically (flow ODE, CFG
    with the empty prompt's condition as the trainer does) by our sampler, one seeded generator per sample as eval:
    frames (B, F, 3, H, W)."""
    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings

    pipe = policy_from_checkpoint("wan-tiny", ckpt, lora, resolution=SIZE, num_frames=FRAMES)
    with torch.no_grad():
        emb = torch.cat([pipe.encode([p]) for p in PROMPTS])
        neg = pipe.encode([""]).expand(len(PROMPTS), -1, -1)
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="flow", guidance_scale=GUIDANCE),
                                 emb, neg, num_inference_steps=STEPS, sample_shape=pipe.sample_shape, vae=pipe.vae,
                                 generator=[torch.Generator().manual_seed(s) for s in SEEDS], deterministic=True)
    return traj.images


SEEDS = [7, 8, 9]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_trains_on_policy_and_export_reproduces_the_policy_in_plain_diffusers(runs, mode, tmp_path, cache):
    """The export alone (PLAIN_EXPORT: its files and export.json, nothing but prompts and seeds passed by hand;
    WanPipeline's own __call__ with the export's flow-matching Euler scheduler, a LoRA's included, at the recorded
    size, frames and CFG) reproduces the trained policy's deterministic clip."""
    run = runs / mode
    summary = json.load(open(run / "summary.json"))
    history = summary["history"]
    assert [h["epoch"] for h in history] == [0, 1]
    for h in history:  # the live check: before the first update the re-scored log-probs are exactly the sampled ones
        assert h["train"]["onpolicy_ratio_max_dev"] < ONPOLICY_TOL_EXACT  # float32 CPU, the sampler's log-probs
        assert h["train"]["grad_norm"] > 0 and np.isfinite(h["reward_mean"]) and h["reward_mean"] < 0  # -JPEG kB
    lora = mode == "lora"
    if lora:  # eval on frames (epoch 0 and the final policy), and a frame-strip grid per epoch
        assert np.isfinite(history[0]["eval_reward_mean"]) and summary["final_eval"]["eval/num_samples"] == 8.0
        images = sorted(os.listdir(run / "images"))
        assert images == ["eval_epoch_0000.png", "eval_epoch_0002.png", "train_epoch_0000.png",
                          "train_epoch_0001.png"]
        from PIL import Image

        from ddpo_grpo.trainer.run.reporting import CELL
        assert Image.open(run / "images" / "train_epoch_0001.png").size == (FRAMES * CELL, 4 * (CELL + 44))
    ckpts = sorted((run / "checkpoints").glob("checkpoint_*"))
    assert [c.name for c in ckpts] == ["checkpoint_00001", "checkpoint_00002"]
    export_files = sorted(os.listdir(run / "export"))
    if lora:  # diffusers' Wan LoRA file: transformer.<module>.lora_A/B.weight, and the scheduler to sample with
        assert export_files == ["export.json", "pytorch_lora_weights.safetensors", "scheduler"]
        keys = list(load_file(str(run / "export" / "pytorch_lora_weights.safetensors")))
        assert keys and all(k.startswith("transformer.") and ".lora_" in k and "base_layer" not in k for k in keys)
        assert any(".attn2.to_k.lora_A." in k for k in keys) and any(".ffn.net.2.lora_B." in k for k in keys)
    else:  # a complete WanPipeline folder
        assert export_files == ["export.json", "model_index.json", "scheduler", "text_encoder", "tokenizer",
                                "transformer", "vae"]
    # the run sampled the base's UniPC flow-sigma config as flow-matching Euler at its flow_shift: LoRA and full alike,
    # the export's scheduler/ is that one (the base folder's UniPC would sample other clips)
    sched = json.load(open(run / "export" / "scheduler" / "scheduler_config.json"))
    assert sched["_class_name"] == "FlowMatchEulerDiscreteScheduler" and sched["shift"] == 3.0
    # the end of the run (epoch 2) and the checkpoint in the middle (epoch 1), in one plain process that runs while
    # this one samples the policy
    pairs = ((run / "export", ckpts[-1]), (ckpts[0] / "export", ckpts[0]))
    for export, ckpt in pairs:
        info = json.load(open(export / "export.json"))
        assert info["epoch"] == int(ckpt.name[-5:]) and info["guidance_scale"] == GUIDANCE
        assert (info["num_frames"], info["height"], info["width"]) == (FRAMES, SIZE, SIZE)
    proc = start_plain_export([e for e, _ in pairs], PROMPTS, SEEDS, tmp_path, cpu_env())
    wants = [trained_policy_sample(str(ckpt), lora) for _, ckpt in pairs]
    got = finish_plain_export(proc, tmp_path)
    for (export, _), want in zip(pairs, wants):
        res = got[str(export)]
        assert res["pipeline"] == "WanPipeline" and res["scheduler"] == "FlowMatchEulerDiscreteScheduler"
        assert res["samples"].shape == want.shape == (3, FRAMES, 3, SIZE, SIZE)
        assert (res["samples"] - want).abs().max().item() <= 1e-5
    # training moved the policy: the two checkpoints sample different clips, so the comparison above could fail
    assert (wants[0] - wants[1]).abs().max().item() > 1e-4


# ----------------------------------------------------------------------------------------------- exact resume
@pytest.mark.timeout(400)
def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path, cache):
    """Video shapes through the checkpoint: a run killed in epoch 1 and resumed ends with the weights (and per-epoch
    rewards) of the uninterrupted run, bit for bit; the lr warmup and the shared initial noise must come back too."""
    def start(name, extra=()):
        cmd = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:wan_tiny", f"--config.logdir={tmp_path}",
               f"--config.run_name={name}", *RUN, "--config.num_epochs=3", "--config.eval_freq=0",
               "--config.logging.image_freq=0", "--config.logging.debug_dump=True", "--config.use_lora=False",
               "--config.train.lr_warmup_steps=3", "--config.sample.shared_init_noise=True", *extra]
        with open(tmp_path / f"{name}.out", "w") as out:
            return subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(DDPO_GRPO_TINY_CACHE=cache), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def finish(proc, name):
        proc.wait(timeout=300)
        out = (tmp_path / f"{name}.out").read_text()
        assert proc.returncode == 0, out[-4000:]
        return out

    straight, proc = start("straight"), start("killed")
    first = tmp_path / "killed" / "checkpoints" / "checkpoint_00001"
    deadline = time.time() + 300
    # an epoch takes about a second here: kill as soon as epoch 1 has begun sampling (its progress bar is out)
    while not (first.exists() and "epoch 1: sampling" in (tmp_path / "killed.out").read_text()) \
            and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists() and not (tmp_path / "killed" / "checkpoints" / "checkpoint_00003").exists()
    finish(straight, "straight")
    out = finish(start("killed", [f"--config.resume_from={tmp_path / 'killed'}"]), "killed")
    assert "resumed from" in out and "at epoch 1" in out
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "checkpoint_00003" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "checkpoints" / "checkpoint_00003" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start_weights = load_pipeline_state()
    assert any(not torch.equal(a[k], start_weights[k]) for k in a)  # training moved the weights
    for epoch in range(3):
        s = json.load(open(tmp_path / "straight" / "debug" / f"epoch_{epoch:04d}_rank_0.json"))
        k = json.load(open(tmp_path / "killed" / "debug" / f"epoch_{epoch:04d}_rank_0.json"))
        assert s["rewards"] == k["rewards"] and s["weights_sum"] == k["weights_sum"], epoch


def load_pipeline_state():
    from ddpo_grpo.models import load_pipeline

    return load_pipeline("wan-tiny", resolution=SIZE, num_frames=FRAMES).unet.state_dict()

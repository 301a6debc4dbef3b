"""What a user takes away: a run's exported model, loaded by plain diffusers in a fresh process that never imports
ddpo_grpo, with only what the export holds (its files and export.json: scheduler, steps, eta, size, guidance), reproduces
the deterministic sample of the policy eval measures; for LoRA, full fine-tuning, DiffusionNFT's soft-updated
sampling policy and the policy's EMA (train.ema_decay), at the end of a run and from a checkpoint in the middle of it; for every stock pipeline class at
non-default settings. Also eval_model.py's loading of every weights format."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import cpu_env, run_side_by_side
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
RUN = ["--config.sample.num_steps=4", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
       "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.train.timestep_fraction=1.0",
       "--config.num_epochs=2", "--config.save_freq=1", "--config.num_checkpoint_limit=5",
       "--config.train.learning_rate=3e-3", "--config.lora_rank=4"]
MODES = {"lora": ["--config.use_lora=True"], "full": ["--config.use_lora=False"],
         # DiffusionNFT's soft-updated sampling policy theta_old samples and is what eval measures: the export's weights
         "nft": ["--config.use_lora=False", "--config.train.objective=nft", "--config.train.nft_old_decay=0.5"],
         # train.ema_decay: the policy's EMA is what eval measures and the export holds; training is the full run's
         "ema": ["--config.use_lora=False", "--config.train.ema_decay=0.6"]}
OVER = {"nft": "sampling_policy.safetensors", "ema": "ema_policy.safetensors"}  # the weights eval measures, over theta
SEEDS = [7, 8, 9]
PROMPTS = ["a red circle on the left", "a blue square in the middle", "a green triangle on the right"]

# Plain diffusers + transformers, nothing of ours: the export folder's own files and export.json decide what is loaded
# and how it samples (the scheduler in scheduler/, LoRA or not; steps, eta and size from pipeline_call), and the noise
# is one seeded generator per sample, as eval draws it. No stock pipeline class samples the pixel-space tiny model, so
# the loop is StableDiffusionPipeline's own, written out.
PLAIN = r'''
import json, sys, torch, diffusers
from diffusers import UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer
export, data_path, out_path = sys.argv[1:4]
info = json.load(open(f"{export}/export.json"))
call = info["pipeline_call"]
model = info["base_model_path"] if info["lora"] else export
unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
if info["lora"]:
    unet.load_lora_adapter(export, weight_name="pytorch_lora_weights.safetensors", prefix="unet")
scheduler = getattr(diffusers, info["scheduler"]).from_pretrained(export, subfolder="scheduler")
tok = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
enc = CLIPTextModel.from_pretrained(model, subfolder="text_encoder")
data = torch.load(data_path)
ids = tok(data["prompts"], padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt").input_ids
with torch.no_grad():
    emb = enc(ids)[0]
    shape = (unet.config.in_channels, call["height"], call["width"])
    x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in data["seeds"]])
    scheduler.set_timesteps(call["num_inference_steps"])
    for t in scheduler.timesteps:
        x = scheduler.step(unet(x, t, emb).sample, t, x, eta=call["eta"]).prev_sample
torch.save({"images": (x / 2 + 0.5).clamp(0, 1), "loaded": sorted(m for m in sys.modules if m.startswith("ddpo"))}, out_path)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-epoch tiny run per mode (checkpoints after epochs 1 and 2), side by side."""
    tmp = tmp_path_factory.mktemp("export")
    jobs = [dict(args=[sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", f"--config.logdir={tmp}",
                       f"--config.run_name={mode}", *RUN, *extra], cwd=ROOT, env=cpu_env())
            for mode, extra in MODES.items()]
    for job, res in zip(jobs, run_side_by_side(jobs)):
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp


def trained_policy_sample(ckpt: str, lora: bool, over: str = "", theta: bool = False) -> torch.Tensor:
    """The policy eval measures, rebuilt from the checkpoint's training state as the trainer holds it (`over`: the
    file of the weights eval measures over the trained theta, nft's sampling policy theta_old or the EMA; theta=True:
    the trained theta instead), sampled deterministically (DDIM eta 0) by our sampler from one seeded generator per
    sample."""
    from ml_collections import ConfigDict

    from ddpo_grpo.core.pipeline_with_logprob import encode_prompts, pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.run.build import make_trainable

    pipe = load_pipeline("tiny-t2i")
    make_trainable(pipe.unet, ConfigDict(dict(use_lora=lora, lora_rank=4, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8))))
    pipe.unet.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")), strict=True)
    if over and not theta:
        pipe.unet.load_state_dict(load_file(os.path.join(ckpt, over)), strict=False)
    with torch.no_grad():
        emb = encode_prompts(pipe.text_encoder, pipe.tokenizer, PROMPTS)
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, SamplerSettings(family="ddim", eta=1.0), emb,
                                 num_inference_steps=STEPS, sample_shape=pipe.sample_shape,
                                 generator=[torch.Generator().manual_seed(s) for s in SEEDS], deterministic=True)
    return traj.images


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_export_loads_in_plain_diffusers_and_reproduces_the_policy(runs, mode, tmp_path):
    """The export alone (its files and export.json, nothing passed by hand but the prompts and seeds) samples what the
    policy eval measures samples: LoRA, full, DiffusionNFT's sampling policy and the policy's EMA."""
    run = runs / mode
    ckpts = sorted((run / "checkpoints").glob("checkpoint_*"))
    assert [c.name for c in ckpts] == ["checkpoint_00001", "checkpoint_00002"]
    lora, over = mode == "lora", OVER.get(mode, "")
    export_files = sorted(os.listdir(run / "export"))
    if lora:  # a standard LoRA file, not the whole peft-wrapped model, and the scheduler the run sampled with
        assert export_files == ["export.json", "pytorch_lora_weights.safetensors", "scheduler"]
        keys = list(load_file(str(run / "export" / "pytorch_lora_weights.safetensors")))
        assert keys and all(k.startswith("unet.") and ".lora_" in k and "base_layer" not in k for k in keys)
    else:  # a complete model folder: every component, written by save_pretrained
        assert export_files == ["export.json", "scheduler", "text_encoder", "tokenizer", "unet"]
    # the end of the run (epoch 2) and the checkpoint in the middle (epoch 1)
    for export, ckpt in ((run / "export", ckpts[-1]), (ckpts[0] / "export", ckpts[0])):
        info = json.load(open(export / "export.json"))
        assert info["epoch"] == int(ckpt.name[-5:]) and info["scheduler"] == "DDIMScheduler"
        assert info["weights"].startswith("sampling policy") == (mode == "nft")
        assert info["weights"].startswith("EMA of the policy") == (mode == "ema")
        want = trained_policy_sample(str(ckpt), lora, over)
        data, out = tmp_path / "data.pt", tmp_path / "out.pt"
        torch.save({"seeds": SEEDS, "prompts": PROMPTS}, data)
        p = subprocess.run([sys.executable, "-c", PLAIN, str(export), str(data), str(out)], cwd=str(tmp_path),
                           env=cpu_env(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        got = torch.load(out)
        assert got["loaded"] == []  # plain diffusers: nothing of ddpo_grpo was imported
        assert got["images"].shape == want.shape == (len(PROMPTS), 3, 32, 32)
        assert (got["images"] - want).abs().max().item() <= 1e-5
        if over:  # theta_old / the EMA is not the trained theta, so exporting theta would fail the comparison above
            assert (trained_policy_sample(str(ckpt), lora, over, theta=True) - want).abs().max().item() > 1e-3
    # the two checkpoints differ (training moved the model), so the comparison above could fail
    base = trained_policy_sample(str(ckpts[0]), lora, over)
    assert (trained_policy_sample(str(ckpts[-1]), lora, over) - base).abs().max().item() > 1e-3
    if mode == "ema":  # the EMA only watches: the trained theta is the full run's, step for step (same seed)
        for a, b in zip(sorted((runs / "full" / "checkpoints").glob("checkpoint_*")), ckpts):
            mine, full = load_file(str(b / "model.safetensors")), load_file(str(a / "model.safetensors"))
            assert mine.keys() == full.keys()
            for k in mine:
                torch.testing.assert_close(mine[k], full[k], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
def test_eval_model_takes_every_export_format(runs):
    """eval_model.py: a LoRA export as --model (its base from export.json), the same LoRA as --weights over the base,
    a checkpoint folder as --weights (its export/), and a full fine-tune's export folder as --model give the policy's
    images; a LoRA run's training state (the peft-wrapped model.safetensors) is refused with a pointer to export/."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from eval_model import evaluate_model, resolve_model

    from ddpo_grpo.models.export import ExportError

    kw = dict(num_samples=4, steps=STEPS, split="eval", objects="single")
    base = evaluate_model("tiny-t2i", **kw)[1]
    for mode in ("lora", "full"):
        run = runs / mode
        ckpt = str(sorted((run / "checkpoints").glob("checkpoint_*"))[-1])
        model, weights, info = resolve_model(str(run / "export"), "")
        assert info["lora"] == (mode == "lora") and info["epoch"] == 2
        as_model = evaluate_model(model, weights=weights, **kw)[1]
        over_base = evaluate_model("tiny-t2i", weights=ckpt, **kw)[1]
        assert torch.equal(as_model, over_base) and (as_model - base).abs().max() > 1e-3
    with pytest.raises(ExportError, match="training state"):
        evaluate_model("tiny-t2i", weights=str(sorted((runs / "lora" / "checkpoints").glob("checkpoint_*"))[-1]
                                               / "model.safetensors"), **kw)


# Non-default settings for each stock pipeline (its defaults: 7.0 / 5.0 CFG, FLUX's embedded 3.5, the tiny builds' 32 px,
# Wan's 480 x 832 px x 81 frames), so that a setting the export failed to record would change the sample.
CALL_CASES = {"sdxl": ("sdxl-tiny", dict(resolution=16, cfg=2.0)), "sd3": ("sd3-tiny", dict(resolution=16, cfg=2.0)),
              "flux": ("flux-tiny", dict(resolution=16, cfg=1.0, embedded=5.0)),
              "flux_true_cfg": ("flux-tiny", dict(resolution=16, cfg=2.0, embedded=5.0)),  # FluxPipeline's true_cfg_scale
              "wan": ("wan-tiny", dict(resolution=16, cfg=2.0))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CALL_CASES))
def test_a_full_export_alone_reproduces_our_deterministic_sample(case, cache, tmp_path):
    """A full export written from a loaded model at non-default settings (size, CFG, FLUX's embedded guidance), read
    back by plain diffusers from the folder and export.json only (the scheduler/ and `pipeline_call`; the noise from one
    seeded generator per sample, as eval draws it), samples what our deterministic sampler samples."""
    import diffusers
    from ml_collections import ConfigDict

    from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.export import sampling_settings, write_export

    (model, case), steps, seeds = CALL_CASES[case], 2, [3, 11]
    pipe = load_pipeline(model, resolution=case["resolution"])
    pipe.adapter.configure(pipe, ConfigDict(dict(pretrained=dict(embedded_guidance=case.get("embedded", 3.5),
                                                                 num_frames=0))))
    out = str(tmp_path / "export")
    write_export(pipe, pipe.unet, pipe.unet.state_dict(), out, False, sampling_settings(pipe, steps, case["cfg"]))
    info = json.load(open(os.path.join(out, "export.json")))
    assert info["height"] == info["width"] == case["resolution"] and info["guidance_scale"] == case["cfg"]
    if "embedded" in case:
        assert info["embedded_guidance"] == case["embedded"] == info["pipeline_call"]["guidance_scale"]
    settings = SamplerSettings(family=pipe.family, eta=1.0, guidance_scale=case["cfg"])
    with torch.no_grad():
        emb = torch.cat([pipe.encode([p]) for p in PROMPTS[:2]])
        neg = pipe.encode([""]).expand(2, -1, -1) if case["cfg"] != 1.0 else None
        want = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, neg, num_inference_steps=steps,
                                     sample_shape=pipe.sample_shape, generator=[torch.Generator().manual_seed(s)
                                                                                for s in seeds],
                                     vae=pipe.vae, deterministic=True).images
        scheduler = getattr(diffusers, info["scheduler"]).from_pretrained(out, subfolder="scheduler")
        plain = diffusers.DiffusionPipeline.from_pretrained(out, scheduler=scheduler)
        result = plain(prompt=PROMPTS[:2], generator=[torch.Generator().manual_seed(s) for s in seeds],
                       output_type="pt", **info["pipeline_call"])
    got = result.frames if model.startswith("wan") else result.images
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5

"""ReCamMaster (models/recam.py): a checkpoint written here by the test's own code, under the original Wan key
names, loads through diffusers' converter; every checkpoint (the input, the library's naming, the trained
exports) loads with strict=True into a module of ReCamMaster's own key list, written from its published
architecture; the camera block math against a direct re-implementation of the equations; CFG; bad checkpoints are
one line; exports give back the input's keys and render what the policy samples (the render script alone:
test_recam_render.py)."""
import os
import pickle
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.errors import ConfigError
from recam_helpers import (  # noqa: F401 (wan_folder, ckpt, pipe: the module's fixtures)
    FRAMES, ROOT, SIZE, _inputs, ckpt, independent_render, load_as_recammaster, pipe, reference_velocity,
    wan_folder, wan_tiny_recam_keys, write_recam_checkpoint,
)


def test_checkpoint_keys_round_trip(pipe, ckpt):
    from ddpo_grpo.models.recam import original_state, to_diffusers_key, to_original_key

    state = torch.load(ckpt, weights_only=True)
    for k in state:
        assert to_original_key(to_diffusers_key(k)) == k
    model = pipe.unet.model
    mine = original_state(model)
    assert set(mine) == set(state)
    for k, v in state.items():  # every tensor of the file is the loaded model's
        assert torch.equal(mine[k], v), k


def test_checkpoints_have_recammasters_own_keys(wan_folder, ckpt):
    """The test's input checkpoint (written with _OWN), and the library's original_state of a model with camera layers
    (how exports of a model loaded without a checkpoint and the bundled recam-tiny name their tensors), both load into
    a module of ReCamMaster's own key list with strict=True."""
    from diffusers import WanTransformer3DModel

    from ddpo_grpo.models.recam import add_camera_layers, original_state

    keys = wan_tiny_recam_keys(wan_folder)
    # counted by hand: 12 tensors before the blocks, 31 in each block, 3 in the head
    assert len(keys) == 12 + 2 * (1 + 2 * (4 * 2 + 2) + 2 + 4 + 4) + 3
    load_as_recammaster(wan_folder, torch.load(ckpt, weights_only=True))
    model = add_camera_layers(WanTransformer3DModel.from_pretrained(wan_folder, subfolder="transformer"))
    mine = original_state(model)  # names from the library's map alone (no input checkpoint's names to echo)
    loaded = load_as_recammaster(wan_folder, mine).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in mine.items())


def test_block_math_matches_equations(pipe):
    items, cond, x = _inputs(pipe)
    C = pipe.sample_shape[0]
    emb = pipe.encode(["a red circle", "a blue square"])
    t = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        got = pipe.unet(torch.cat([x, cond], 1), t, encoder_hidden_states=emb).sample
        cams = torch.stack([torch.as_tensor(it["cameras"]) for it in items])
        want = reference_velocity(pipe.unet.model, x, cond[:, :C], cams, t, emb)
    assert got.shape == x.shape
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()
    # the camera matters (random camera layers), and so does the source
    cond2 = cond.clone()
    cond2[:, C:] += 1.0
    with torch.no_grad():
        other = pipe.unet(torch.cat([x, cond2], 1), t, encoder_hidden_states=emb).sample
    assert (other - got).abs().max() > 1e-3


def test_source_latents_are_the_vae_posterior_mean_normalised(pipe):
    items, cond, _ = _inputs(pipe, B=1)
    vae = pipe.vae
    with torch.no_grad():
        z = vae.encode(items[0]["source_video"][None].permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    C = z.shape[1]
    assert torch.allclose(cond[:, :C], (z - mean) / std, atol=1e-6)
    planes = cond[:, C:]
    cams = torch.as_tensor(items[0]["cameras"])
    assert torch.equal(planes[0, :, :, 2, 3], cams.T)  # constant planes: any pixel holds frame f's 12 numbers


def test_cfg_passes_get_the_same_source_and_camera(pipe):
    from ddpo_grpo.core.policy_step import denoiser_output

    items, cond, x = _inputs(pipe)
    emb, neg = pipe.encode(["a red circle", "a red circle"]), pipe.encode(["", ""])
    t = torch.tensor([500.0, 500.0])
    with torch.no_grad():
        guided = denoiser_output(pipe.unet, x, t, emb, neg, 4.0, cond)
        pos = pipe.unet(torch.cat([x, cond], 1), t, encoder_hidden_states=emb).sample
        unc = pipe.unet(torch.cat([x, cond], 1), t, encoder_hidden_states=neg).sample
    assert torch.allclose(guided, unc + 4.0 * (pos - unc), atol=1e-5)


def test_fsdp2_blocks_hold_the_camera_layers(pipe):
    from ddpo_grpo.models.recam import ADAPTER

    assert ADAPTER.fsdp_block_classes == ("WanTransformerBlock",)
    for name, p in pipe.unet.model.named_parameters():
        if "cam_encoder" in name or "projector" in name:
            assert name.startswith("blocks."), name  # sharded with the block that uses them


@pytest.mark.parametrize("lazy", [False, True], ids=["load", "check"])
@pytest.mark.parametrize("case", ["plain_wan", "wrong_camera_dim", "damaged", "damaged_safetensors", "code_pickle",
                                  "wrong_width", "missing"])
def test_bad_checkpoint_is_one_line(wan_folder, tmp_path, case, lazy):
    """Each bad file is one line both when validate_config checks it (lazy: header / memory map only) and at load."""
    from ddpo_grpo.models.recam import RecamAdapter, read_checkpoint
    from diffusers import WanTransformer3DModel

    path = str(tmp_path / ("bad.safetensors" if case == "damaged_safetensors" else "bad.ckpt"))
    if case == "plain_wan":
        write_recam_checkpoint(wan_folder, path, drop_camera=True)
        want = "no camera layers"
    elif case == "wrong_camera_dim":
        write_recam_checkpoint(wan_folder, path, cam_dim=16)
        want = "camera numbers per frame"
    elif case in ("damaged", "damaged_safetensors"):
        write_recam_checkpoint(wan_folder, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        want = "cannot be read"
    elif case == "code_pickle":
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))

        with open(path, "wb") as f:
            pickle.dump({"x": Evil()}, f)
        want = "cannot be read as tensors only"
    elif case == "wrong_width":
        state = write_recam_checkpoint(wan_folder, path)
        state["blocks.0.cam_encoder.weight"] = torch.zeros(48, 12)
        torch.save(state, path)
        want = "wide"
    else:
        path = str(tmp_path / "nope.ckpt")
        want = "is not a file"
    cfg = WanTransformer3DModel.load_config(wan_folder, subfolder="transformer")
    with pytest.raises(ConfigError) as e:
        RecamAdapter.check_checkpoint(read_checkpoint(path, lazy=lazy), cfg, path)
    msg = str(e.value)
    assert want in msg and "\n" not in msg and path in msg


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_lazy_read_sees_every_key_shape_and_dtype(wan_folder, tmp_path, suffix):
    """validate_config's check reads the header (safetensors) or maps the file (pickle): the same keys, shapes and
    dtypes as reading it whole, and a safetensors file's data is not read at all (meta tensors)."""
    from ddpo_grpo.models.recam import read_checkpoint

    path = str(tmp_path / f"ok{suffix}")
    write_recam_checkpoint(wan_folder, path)
    full, lazy = read_checkpoint(path), read_checkpoint(path, lazy=True)
    assert set(lazy) == set(full)
    for k, v in full.items():
        assert lazy[k].shape == v.shape and lazy[k].dtype == v.dtype, k
    if suffix == ".safetensors":
        assert all(t.is_meta for t in lazy.values())
    else:
        assert all(torch.equal(lazy[k], full[k]) for k in full)


def test_train_refuses_a_bad_checkpoint_with_exit_2(wan_folder, tmp_path):
    path = str(tmp_path / "plain.ckpt")
    write_recam_checkpoint(wan_folder, path, drop_camera=True)
    r = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:recam_video_tiny",
                        f"--config.pretrained.model={wan_folder}", f"--config.pretrained.recam_checkpoint={path}",
                        "--config.dry_run=True"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "no camera layers" in lines[-1] and "Traceback" not in r.stderr


def test_lora_merge_matches_peft(pipe, ckpt):
    """merged_state (used for the LoRA export's recammaster.ckpt) equals peft's own merge."""
    import copy

    from peft import LoraConfig

    from ddpo_grpo.models.recam import ADAPTER, merged_state

    model = copy.deepcopy(pipe.unet.model)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                 target_modules=list(ADAPTER.lora_target_modules)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    merged = merged_state(model, model.state_dict())
    want = copy.deepcopy(model)
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in want.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    ref = {k.replace(".base_layer.", "."): v for k, v in want.state_dict().items() if ".lora_" not in k}
    assert set(ref) == set(merged)
    changed = 0
    for k in ref:
        assert torch.allclose(ref[k], merged[k], atol=1e-6), k
        changed += not torch.equal(merged[k], pipe.unet.model.state_dict()[k])
    assert changed >= 2 * 6  # every targeted linear of both blocks


# ------------------------------------------------------------------------------------------------ through the trainer
# save_freq=2: the end's training state (checkpoint_00002/model.safetensors), what the export is compared with
RUN = ["--config.num_epochs=2", "--config.save_freq=2", "--config.eval_freq=0", "--config.logging.wandb=False",
       "--config.logging.tensorboard=False", f"--config.pretrained.resolution={SIZE}",
       f"--config.pretrained.num_frames={FRAMES}", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
       "--config.sample.k=4", "--config.train.batch_size=4", "--config.train.gradient_accumulation_steps=1",
       "--config.sample.num_steps=3", "--config.sample.guidance_scale=2.0", "--config.train.learning_rate=3e-3",
       "--config.train.clip_range=1.0", "--config.data.num_conditions=4", "--config.train.lr_warmup_steps=0",
       # the clipped-ratio GRPO loss (recam's; recam_video_tiny trains by NFT), whose on-policy ratio is checked
       "--config.train.objective=grpo", "--config.train.nft_old_decay=0.0", "--config.reward.per_step=broadcast",
       # a reward with spread on a random model (cam_score is 0 on noise): JPEG size of every frame
       "--config.reward.fns={'jpeg_compressibility': 1.0, 'cam_score': 0.0}"]
RECAM_MODES = {"full": ["--config.use_lora=False"], "lora": ["--config.use_lora=True", "--config.lora_rank=4"]}


@pytest.fixture(scope="module")
def trained(wan_folder, ckpt, tmp_path_factory):
    from helpers import train_modes

    tmp = tmp_path_factory.mktemp("recam_runs")
    cache = os.environ.get("DDPO_GRPO_TINY_CACHE") or os.path.dirname(wan_folder)
    return train_modes(tmp, "recam_video_tiny", cache, [f"--config.pretrained.model={wan_folder}",
                                                         f"--config.pretrained.recam_checkpoint={ckpt}", *RUN],
                       RECAM_MODES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(RECAM_MODES))
def test_outside_checkpoint_trains_on_policy_and_exports_its_own_keys(trained, mode, ckpt, wan_folder):
    import json

    run = trained / mode
    history = json.load(open(run / "summary.json"))["history"]
    assert [h["epoch"] for h in history] == [0, 1]
    for h in history:  # the ratio of the epoch's first training calls, before any update: exactly 1
        assert h["train"]["onpolicy_ratio_max_dev"] <= 1e-6, h["train"]
    assert history[1]["train"]["grad_norm"] > 0
    info = json.load(open(run / "export" / "export.json"))
    assert info["recam_checkpoint"] == "recammaster.ckpt" and info["num_frames"] == FRAMES and info["height"] == SIZE
    before = torch.load(ckpt, weights_only=True)
    after = torch.load(run / "export" / "recammaster.ckpt", weights_only=True)
    assert list(after) == list(before)  # the input's keys, in its order
    load_as_recammaster(wan_folder, after)  # what ReCamMaster's inference does with it: strict, its own key list
    trained_keys = [k for k in before if "self_attn" in k or "cam_encoder" in k or "projector" in k]
    for k, v in before.items():
        assert after[k].shape == v.shape and after[k].dtype == v.dtype, k
        if k not in trained_keys:
            assert torch.equal(after[k], v), f"{k} is outside ReCamMaster's trainable set but changed"
    lora_targets = [k for k in trained_keys if k.endswith(".weight") and "norm" not in k]
    changed = [k for k in trained_keys if not torch.equal(after[k], before[k])]
    assert set(lora_targets) <= set(changed), sorted(set(lora_targets) - set(changed))[:3]
    if mode == "lora":
        assert os.path.isfile(run / "export" / "pytorch_lora_weights.safetensors")
        assert not any(k.endswith(".bias") and not torch.equal(after[k], before[k]) for k in before)


@pytest.mark.timeout(600)
def test_export_renders_what_the_trained_policy_samples(trained, wan_folder, ckpt, tmp_path):
    """The full run's export, loaded back from recammaster.ckpt over the base folder, is the trained policy: its weights
    are the training state's (the run's checkpoint_00002/model.safetensors loaded as the trainer holds it), its
    render (scripts/recam_render.py) is the trained policy's render and equals the independent Euler loop over the
    checkpoint's tensors."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import recam_render
    from helpers import policy_from_checkpoint

    from ddpo_grpo.models import load_pipeline

    ck = str(trained / "full" / "export" / "recammaster.ckpt")
    pipe = load_pipeline(wan_folder, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=ck)
    policy = policy_from_checkpoint(wan_folder, str(trained / "full" / "checkpoints" / "checkpoint_00002"), False,
                                    resolution=SIZE, num_frames=FRAMES, recam_checkpoint=ckpt)
    # Weights: both in diffusers' names (the export's through diffusers' own converter at load), full fine-tuning in
    # float32 end to end, so the export must be the trained tensors exactly; and training moved them.
    exported, trained_w = pipe.unet.model.state_dict(), policy.unet.model.state_dict()
    assert exported.keys() == trained_w.keys()
    assert [k for k in exported if not torch.equal(exported[k], trained_w[k])] == []
    start = load_pipeline(wan_folder, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=ckpt).unet.model.state_dict()
    assert any(not torch.equal(start[k], trained_w[k]) for k in start)
    items, cond, x = _inputs(pipe, B=1, seed=9)
    frames = recam_render.render(pipe, items[0]["source_video"], items[0]["cameras"], "a red circle", "", steps=2,
                                 guidance=2.0, noise=x, grid="scheduler", shift=0.0)
    # the same weights through the same render call: the same arithmetic, so equal
    assert torch.equal(recam_render.render(policy, items[0]["source_video"], items[0]["cameras"], "a red circle", "",
                                           steps=2, guidance=2.0, noise=x, grid="scheduler", shift=0.0), frames)
    want = independent_render(pipe, cond, items[0]["cameras"], x, 2, 2.0, "a red circle")
    assert frames.shape == (FRAMES, 3, SIZE, SIZE) and torch.allclose(frames, want, atol=1e-4)
    base = load_pipeline(wan_folder, resolution=SIZE, num_frames=FRAMES,
                         recam_checkpoint=ckpt)
    assert not torch.allclose(recam_render.render(base, items[0]["source_video"], items[0]["cameras"], "a red circle",
                                                  "", steps=2, guidance=2.0, noise=x, grid="scheduler", shift=0.0),
                              frames, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(pipe):
    """The camera hooks run again in a checkpointed block's recompute and read the same camera tokens."""
    items, cond, x = _inputs(pipe, seed=11)
    emb = pipe.encode(["a red circle", "a blue square"])
    model = pipe.unet.model
    grads = []
    for ckpt_on in (False, True):
        model.requires_grad_(True)
        model.zero_grad()
        if ckpt_on:
            model.enable_gradient_checkpointing()
        model.train()
        out = pipe.unet(torch.cat([x, cond], 1), torch.tensor([600.0, 300.0]), encoder_hidden_states=emb).sample
        out.pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "cam_encoder" in n or "attn1.to_q" in n})
        model.disable_gradient_checkpointing()
        model.eval()
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    assert grads[0] and all(g.abs().sum() > 0 for g in grads[0].values())
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_camera_hooks_take_attn1_input_however_it_is_called(pipe, call):
    """diffusers releases differ in how WanTransformerBlock calls attn1 (positionally in 0.42, by keyword in
    others): both give projector(self_attn(x + cam_encoder(cam))), written out with attn1's processor directly."""
    model = pipe.unet.model
    blk = model.blocks[0]
    g = torch.Generator().manual_seed(5)
    dim = blk.attn1.to_q.in_features
    x = torch.randn(1, 2 * 2 * 2 * 2, dim, generator=g)  # 2F' = 4 frames of 2 x 2 tokens
    cams = torch.randn(1, 2, 12, generator=g)
    rope = model.rope(torch.zeros(1, 16, 4, 4, 4))  # 4 latent frames of 4 x 4 (patch 2: 2 x 2 tokens each)
    from ddpo_grpo.models.recam import camera_tokens

    blk._recam_tokens = camera_tokens(cams, 4)
    with torch.no_grad():
        if call == "positional":
            got = blk.attn1(x, None, None, rope)
        else:
            got = blk.attn1(hidden_states=x, encoder_hidden_states=None, attention_mask=None, rotary_emb=rope)
        want = blk.projector(blk.attn1.processor(blk.attn1, x + blk.cam_encoder(blk._recam_tokens), None, None, rope))
        plain = blk.projector(blk.attn1.processor(blk.attn1, x, None, None, rope))
    blk._recam_tokens = None
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert (got - plain).abs().max() > 1e-3  # the camera was added

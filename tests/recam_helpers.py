"""What the ReCamMaster tests share: the test's own reading of ReCamMaster's checkpoint (original Wan key names,
its published key list), a wan-tiny folder with a ReCamMaster checkpoint written here, the camera block's equations
re-implemented, and an independent Euler render (tests/test_model_recam.py, tests/test_recam_render.py)."""
import os

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE, FRAMES = 32, 5  # wan-tiny: latents (16, 2, 4, 4)

# The test's own reading of the original Wan <-> diffusers names (not the library's table).
_OWN = [("self_attn.q.", "attn1.to_q."), ("self_attn.k.", "attn1.to_k."), ("self_attn.v.", "attn1.to_v."),
        ("self_attn.o.", "attn1.to_out.0."), ("self_attn.norm_q", "attn1.norm_q"), ("self_attn.norm_k", "attn1.norm_k"),
        ("cross_attn.q.", "attn2.to_q."), ("cross_attn.k.", "attn2.to_k."), ("cross_attn.v.", "attn2.to_v."),
        ("cross_attn.o.", "attn2.to_out.0."), ("cross_attn.norm_q", "attn2.norm_q"),
        ("cross_attn.norm_k", "attn2.norm_k"), ("ffn.0.", "ffn.net.0.proj."), ("ffn.2.", "ffn.net.2."),
        ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
        ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
        ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
        ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
        ("time_projection.1.", "condition_embedder.time_proj."), ("head.head.", "proj_out.")]


def own_original_name(key: str) -> str:
    """diffusers name -> the original Wan name, as ReCamMaster's state_dict() spells it."""
    if key == "scale_shift_table":
        return "head.modulation"
    if key.endswith(".scale_shift_table"):
        return key[:-len("scale_shift_table")] + "modulation"
    for orig, new in _OWN:
        if new in key:
            return key.replace(new, orig)
    if ".norm2." in key:
        return key.replace(".norm2.", ".norm3.")  # diffusers' norm2 is the cross-attention norm: Wan's norm3
    return key


# ReCamMaster's own key list, the oracle for every checkpoint here (written without the library's map or the test's
# _OWN above): a ReCamMaster checkpoint is `pipe.dit.state_dict()` (train_recammaster.py: torch.save of it; its
# inference: `pipe.dit.load_state_dict(state_dict, strict=True)`), where dit is DiffSynth-Studio's Wan 2.1 T2V
# `WanModel` (diffsynth/models/wan_video_dit.py, KwaiVGI/ReCamMaster at 39c0dc2) with two layers added to every
# block: `cam_encoder = nn.Linear(12, dim)` and `projector = nn.Linear(dim, dim)`. WanModel's parameters, by its code:
# patch_embedding (Conv3d in_dim -> dim, kernel = stride = patch), text_embedding / time_embedding (Sequential:
# Linear, activation, Linear: indices 0 and 2), time_projection (Sequential: SiLU, Linear(dim, 6 dim): index 1),
# blocks.N: modulation (1, 6, dim), self_attn and cross_attn (q, k, v, o Linear(dim, dim); norm_q, norm_k RMSNorm
# with a weight only), norm1 / norm2 (LayerNorm without affine: no tensors), norm3 (LayerNorm with weight and bias),
# ffn (Sequential: Linear(dim, ffn_dim), GELU, Linear(ffn_dim, dim)); head: modulation (1, 2, dim), norm (no affine),
# head (Linear(dim, out_dim x prod(patch))). `freqs` is a plain attribute (no tensor in the state); img_emb only
# with has_image_input (I2V, not ReCamMaster's T2V base).
def recam_keys(dim, in_dim, ffn_dim, out_dim, text_dim, freq_dim, num_layers, patch=(1, 2, 2), cam_dim=12):
    """{key: shape} of ReCamMaster's DiT state dict for a WanModel config."""
    lin = lambda name, o, i: {f"{name}.weight": (o, i), f"{name}.bias": (o,)}  # noqa: E731
    keys = {"patch_embedding.weight": (dim, in_dim, *patch), "patch_embedding.bias": (dim,),
            **lin("text_embedding.0", dim, text_dim), **lin("text_embedding.2", dim, dim),
            **lin("time_embedding.0", dim, freq_dim), **lin("time_embedding.2", dim, dim),
            **lin("time_projection.1", 6 * dim, dim)}
    for n in range(num_layers):
        b = f"blocks.{n}"
        keys[f"{b}.modulation"] = (1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                keys.update(lin(f"{b}.{attn}.{proj}", dim, dim))
            keys[f"{b}.{attn}.norm_q.weight"] = keys[f"{b}.{attn}.norm_k.weight"] = (dim,)
        keys[f"{b}.norm3.weight"] = keys[f"{b}.norm3.bias"] = (dim,)
        keys.update({**lin(f"{b}.ffn.0", ffn_dim, dim), **lin(f"{b}.ffn.2", dim, ffn_dim)})
        keys.update({**lin(f"{b}.cam_encoder", dim, cam_dim), **lin(f"{b}.projector", dim, dim)})
    keys.update({"head.modulation": (1, 2, dim), **lin("head.head", out_dim * int(np.prod(patch)), dim)})
    return keys


def recam_module(keys) -> torch.nn.Module:
    """A torch module whose state dict is exactly `keys` (nested submodules by the dotted names, a parameter of each
    shape at the leaves): what ReCamMaster's load_state_dict(strict=True) checks, names and shapes."""
    root = torch.nn.Module()
    for key, shape in keys.items():
        *path, leaf = key.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


def wan_tiny_recam_keys(folder):
    """recam_keys for the folder's transformer config (diffusers' config names -> WanModel's arguments)."""
    import json

    c = json.load(open(os.path.join(folder, "transformer", "config.json")))
    return recam_keys(dim=c["num_attention_heads"] * c["attention_head_dim"], in_dim=c["in_channels"],
                      ffn_dim=c["ffn_dim"], out_dim=c["out_channels"], text_dim=c["text_dim"], freq_dim=c["freq_dim"],
                      num_layers=c["num_layers"], patch=tuple(c["patch_size"]))


def load_as_recammaster(folder, state):
    """ReCamMaster's inference step on `state`: load_state_dict(strict=True) into a module of its key list (raises on
    a missing, unexpected or misshapen key); returns the module."""
    module = recam_module(wan_tiny_recam_keys(folder))
    module.load_state_dict(state, strict=True)
    return module


@pytest.fixture(scope="module")
def wan_folder():
    from ddpo_grpo.models import resolve_model_path

    return resolve_model_path("wan-tiny")


def write_recam_checkpoint(folder, path, seed=3, cam_dim=12, drop_camera=False):
    """A ReCamMaster-format checkpoint of the folder's transformer: original names + random camera layers."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    state = {own_original_name(k): v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    if not drop_camera:
        for i in range(model.config.num_layers):
            state[f"blocks.{i}.cam_encoder.weight"] = torch.randn(dim, cam_dim, generator=g) * 0.5
            state[f"blocks.{i}.cam_encoder.bias"] = torch.randn(dim, generator=g) * 0.1
            state[f"blocks.{i}.projector.weight"] = torch.eye(dim) + torch.randn(dim, dim, generator=g) * 0.1
            state[f"blocks.{i}.projector.bias"] = torch.randn(dim, generator=g) * 0.1
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, path)
    else:
        torch.save(state, path)
    return state


@pytest.fixture(scope="module")
def ckpt(wan_folder, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("recam") / "step20000.ckpt")
    write_recam_checkpoint(wan_folder, path)
    return path


@pytest.fixture(scope="module")
def pipe(wan_folder, ckpt):
    from ddpo_grpo.models import load_pipeline

    return load_pipeline(wan_folder, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=ckpt)


def reference_velocity(model, x, source, cams, t, emb):
    """The equations of the issue, written out: cat([x, source]) on frames, per block x_mod = modulate(norm1(x)) +
    cam_encoder(cam of the token's frame mod F), x += gate * projector(self_attn(x_mod)), Wan's cross-attention and
    FFN, the first F frames of the prediction. Wan's own attention processor is the primitive (called directly, so
    the library's hooks are not involved)."""
    inp = torch.cat([x, source], dim=2)
    B, C, F2, H, W = inp.shape
    F = x.shape[2]
    rope = model.rope(inp)
    h = model.patch_embedding(inp).flatten(2).transpose(1, 2)
    temb, proj, enc, _ = model.condition_embedder(t, emb, None)
    proj = proj.unflatten(1, (6, -1))
    hp, wp = H // 2, W // 2
    frame_of_token = torch.arange(F2).repeat_interleave(hp * wp) % F  # token order (frame, row, column)
    cam_tok = cams[:, frame_of_token]  # (B, S, 12)
    for blk in model.blocks:
        shift, scale, gate, c_shift, c_scale, c_gate = (blk.scale_shift_table + proj.float()).chunk(6, dim=1)
        x_mod = (blk.norm1(h.float()) * (1 + scale) + shift) + blk.cam_encoder(cam_tok)
        h = h + gate * blk.projector(blk.attn1.processor(blk.attn1, x_mod, None, None, rope))
        h = h + blk.attn2.processor(blk.attn2, blk.norm2(h), enc, None, None)
        h = h + c_gate * blk.ffn((blk.norm3(h) * (1 + c_scale) + c_shift))
    shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    h = model.proj_out(model.norm_out(h) * (1 + scale) + shift)
    out = h.reshape(B, F2, hp, wp, 1, 2, 2, C).permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, C, F2, H, W)
    return out[:, :, :F]


def _inputs(pipe, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    C, F, h, w = pipe.sample_shape
    items = [{"index": i, "source_video": torch.rand(FRAMES, 3, SIZE, SIZE, generator=g),
              "cameras": torch.randn(F, 12, generator=g)} for i in range(B)]
    cond = pipe.adapter.condition_channels(pipe, items, "cpu")
    x = torch.randn(B, C, F, h, w, generator=g)
    return items, cond, x


def independent_render(pipe, cond, cams, x, steps, guidance, prompt, sigmas=None, negative=""):
    """The flow-matching Euler update over `sigmas` (default: the folder's shifted sigmas), CFG
    v_neg + G (v_pos - v_neg) with the equations' velocity, then the VAE decode: frames (F, 3, H, W)."""
    from ddpo_grpo.core.pipeline_with_logprob import decode

    C = pipe.sample_shape[0]
    if sigmas is None:
        sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
        sched.set_timesteps(steps)
        sigmas = sched.sigmas.tolist()
    pos, neg = pipe.encode([prompt]), pipe.encode([negative])
    z = x.clone()
    with torch.no_grad():
        for i in range(steps):
            t = torch.tensor([1000.0 * sigmas[i]])  # the model's timestep: 1000 sigma
            vp = reference_velocity(pipe.unet.model, z, cond[:, :C], cams[None], t, pos)
            vn = reference_velocity(pipe.unet.model, z, cond[:, :C], cams[None], t, neg)
            z = z + (sigmas[i + 1] - sigmas[i]) * (vn + guidance * (vp - vn))
        return decode(pipe.vae, z)[0]


def recammaster_sigmas(steps, shift=5.0):
    """ReCamMaster's inference grid as read from its scheduler (the test's own numpy): linspace(1, 0, N + 1) without
    its last value, shift * s / (1 + (shift - 1) * s), then 0."""
    s = np.linspace(1.0, 0.0, steps + 1)[:-1]
    return [float(v) for v in shift * s / (1 + (shift - 1) * s)] + [0.0]

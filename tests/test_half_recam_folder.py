"""benchmarks/half_recam_folder.py: a ReCamMaster folder with its DiT stored in float16 (how the bundled tiny-recam3d
fits the asset budget). The copy's tensors are the float16 rounding of the source's, in both files; it loads through
the trainer's loader into float32 parameters, and its denoiser output stays within float16 rounding of the source's;
plain diffusers still loads its transformer/; the lineage of parent stages is kept; the bundled model is such a
folder."""
import json
import os
import shutil
import sys

import pytest
import torch

from recam_helpers import FRAMES, ROOT, SIZE, _inputs, ckpt, pipe, wan_folder  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.fixture(scope="module")
def halved(wan_folder, ckpt, tmp_path_factory):  # noqa: F811
    from half_recam_folder import half_folder

    base = tmp_path_factory.mktemp("half")
    src, parent = base / "src", base / "parent"
    shutil.copytree(wan_folder, src)
    shutil.copy(ckpt, src / "recammaster.ckpt")
    (src / "pretrain_meta.json").write_text(json.dumps({"dit_steps": 3, "args": {"dit_init": str(parent)}}))
    parent.mkdir()
    (parent / "pretrain_meta.json").write_text(json.dumps({"dit_steps": 7, "args": {"mislabel": "none"}}))
    return src, half_folder(str(src), str(base / "dst"), [str(parent)])


def test_the_copy_holds_the_float16_rounding_of_every_dit_tensor(halved):
    from safetensors.torch import load_file

    src, dst = halved
    for rel, load in [("recammaster.ckpt", lambda p: torch.load(p, weights_only=True)),
                      ("transformer/diffusion_pytorch_model.safetensors", load_file)]:
        old, new = load(os.path.join(src, rel)), load(os.path.join(dst, rel))
        assert set(old) == set(new) and len(new) > 0
        for k, v in old.items():
            assert v.dtype == torch.float32 and new[k].dtype == torch.float16, k
            assert torch.equal(new[k], v.half()), k
    # everything else is copied byte for byte
    vae = "vae/diffusion_pytorch_model.safetensors"
    assert open(os.path.join(src, vae), "rb").read() == open(os.path.join(dst, vae), "rb").read()
    meta = json.load(open(os.path.join(dst, "pretrain_meta.json")))
    assert meta["dit_dtype"] == "float16" and meta["dit_steps"] == 3
    assert meta["lineage"] == [{"dit_steps": 7, "args": {"mislabel": "none"}}]
    assert not os.path.exists(dst + ".tmp")


def test_a_parent_with_a_lineage_of_its_own_brings_it(halved, tmp_path):
    """A stage trained on from a halved folder (a bundled start) and halved again: its lineage is the parent's
    lineage, then the parent itself, oldest first, so every stage's command is kept once."""
    from half_recam_folder import half_folder

    src, dst = halved
    child = tmp_path / "child"
    shutil.copytree(src, child)
    (child / "pretrain_meta.json").write_text(json.dumps({"dit_steps": 5, "args": {"dit_init": str(dst)}}))
    meta = json.load(open(os.path.join(half_folder(str(child), str(tmp_path / "out"), [dst]), "pretrain_meta.json")))
    assert meta["dit_steps"] == 5
    parent = {"dit_steps": 3, "args": {"dit_init": str(src.parent / "parent")}, "dit_dtype": "float16"}
    assert meta["lineage"] == [{"dit_steps": 7, "args": {"mislabel": "none"}}, parent]


def test_the_halved_folder_loads_in_float32_and_denoises_within_rounding(halved, pipe):  # noqa: F811
    from diffusers import WanTransformer3DModel

    from ddpo_grpo.models import load_pipeline

    _, dst = halved
    half = load_pipeline(dst, resolution=SIZE, num_frames=FRAMES, recam_checkpoint=os.path.join(dst, "recammaster.ckpt"))
    assert {p.dtype for p in half.unet.model.parameters()} == {torch.float32}
    assert half.recam_checkpoint["dtypes"]["blocks.0.cam_encoder.weight"] == torch.float16  # exports write float16
    items, cond, x = _inputs(pipe)
    emb = pipe.encode(["a red circle", "a blue square"])
    t = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        want = pipe.unet(torch.cat([x, cond], 1), t, encoder_hidden_states=emb).sample
        got = half.unet(torch.cat([x, cond], 1), t, encoder_hidden_states=emb).sample
    err = (got - want).abs().max().item()
    assert 0.0 < err < 2e-2 * want.abs().max().item(), err  # rounded (not equal), by float16's rounding only
    plain = WanTransformer3DModel.from_pretrained(dst, subfolder="transformer", torch_dtype=torch.float32)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}


def test_a_folder_without_a_checkpoint_is_refused_in_one_line(wan_folder, tmp_path):  # noqa: F811
    import subprocess

    proc = subprocess.run([sys.executable, "benchmarks/half_recam_folder.py", str(wan_folder), str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "recammaster.ckpt is missing" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "o").exists()


def test_the_bundled_start_is_the_four_stage_tie_stored_in_float16():
    """assets/tiny-recam3d is benchmarks/make_tiny_recam3d.sh's output: its DiT in float16 in both files, its own stage
    the noise tie at three draws in four learnt in ReCamMaster's trainable set, its lineage the three stages before it
    (gain 2, true labels, then the half tie stored in float16), and the trainer's loader gives float32 parameters."""
    from safetensors.torch import load_file

    from ddpo_grpo.models import load_pipeline, resolve_model_path

    folder = resolve_model_path("tiny-recam3d")
    ckpt = torch.load(os.path.join(folder, "recammaster.ckpt"), weights_only=True)
    assert {v.dtype for v in ckpt.values()} == {torch.float16}
    assert tuple(ckpt["blocks.0.cam_encoder.weight"].shape) == (128, 12)
    assert {v.dtype for v in load_file(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"))
            .values()} == {torch.float16}
    meta = json.load(open(os.path.join(folder, "pretrain_meta.json")))
    a = meta["args"]
    assert meta["dit_dtype"] == "float16" and meta["dit_steps"] == 3000
    assert (a["mislabel"], a["mislabel_by"], a["mislabel_fraction"], a["noise_offset"]) == ("opposite", "noise", 0.75, 2.0)
    assert a["dit_trainable"] == "attn1.,cam_encoder.,projector."
    gain2, control, tie = meta["lineage"]
    assert gain2["args"]["label_gain"] == 2.0 and not gain2["args"]["dit_init"] and gain2["dit_steps"] == 6000
    assert control["args"]["mislabel"] == "none" and control["dit_steps"] == 3000
    t = tie["args"]
    assert (t["mislabel"], t["mislabel_by"], t["mislabel_fraction"], t["dit_trainable"]) == (
        "opposite", "noise", 0.5, a["dit_trainable"])
    assert tie["dit_dtype"] == "float16" and tie["dit_steps"] == 3000
    pipe = load_pipeline(folder, recam_checkpoint=os.path.join(folder, "recammaster.ckpt"))
    assert {p.dtype for p in pipe.unet.model.parameters()} == {torch.float32}

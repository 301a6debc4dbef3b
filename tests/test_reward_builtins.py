"""The built-in rewards, with values computed by hand: JPEG size, the toy world's verifiable scores, aesthetic."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_grpo.rewards import ConfigError, RewardComputer, RewardError, get_reward_fn
from ddpo_grpo.worlds.toyworld import all_conditions, render


# ----------------------------------------------------------------------------- jpeg
def test_jpeg_sign_convention_and_values():
    rng = np.random.default_rng(0)
    flat = torch.full((1, 3, 32, 32), 0.5)
    noise = torch.from_numpy(rng.random((1, 3, 32, 32), dtype=np.float32))
    images = torch.cat([flat, noise])
    comp, det = get_reward_fn("jpeg_compressibility")(images, ["", ""], [{}, {}])
    incomp, _ = get_reward_fn("jpeg_incompressibility")(images, ["", ""], [{}, {}])
    assert comp.dtype == np.float32 and comp.shape == (2,)
    assert comp[0] > comp[1]  # flat is more compressible
    assert incomp[1] > incomp[0]
    assert (comp < 0).all() and (incomp > 0).all()
    np.testing.assert_array_equal(comp, -incomp)
    np.testing.assert_array_equal(det["jpeg_kb"], incomp)
    # size of the noise image computed by hand: uint8 HWC, JPEG quality 95, bytes / 1000
    arr = (noise[0] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    assert incomp[1] == pytest.approx(len(buf.getvalue()) / 1000, abs=1e-6)


def test_jpeg_rejects_video_and_marks_nan():
    from ddpo_grpo.rewards import make_jpeg_compressibility

    with pytest.raises(ValueError, match="video"):  # the image reward itself takes still images only
        make_jpeg_compressibility()(torch.zeros(2, 4, 3, 8, 8), ["", ""], [{}, {}])
    # through the registry a video is scored frame by frame and averaged per sample (rewards package docstring)
    fn = get_reward_fn("jpeg_compressibility")
    video = torch.rand(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    video[1, :2] = 0.5  # two flat frames: sample 1 compresses better
    scores, det = fn(video, ["", ""], [{}, {}])
    frames = make_jpeg_compressibility()(video.reshape(8, 3, 8, 8), [""] * 8, [{}] * 8)[0]
    np.testing.assert_allclose(scores, frames.reshape(2, 4).mean(axis=1), rtol=1e-6)
    assert scores[1] > scores[0]
    with pytest.raises(RewardError, match="expects images"):  # other shapes are still refused
        fn(torch.zeros(2, 4, 1, 3, 8, 8), ["", ""], [{}, {}])
    x = torch.zeros(2, 3, 8, 8)
    x[1, 0, 0, 0] = float("nan")
    scores, _ = fn(x, ["", ""], [{}, {}])
    assert np.isfinite(scores[0]) and np.isnan(scores[1])


# ----------------------------------------------------------------------------- toyworld
def _toyworld_truth():
    # Every single-object condition, plus pairs without circles (canonical, un-jittered renders).
    conds = all_conditions()
    pairs = [c for c in conds[72:] if "circle" not in (c.obj.shape, c.other.shape)][::40]
    picked = conds[:72:5] + pairs
    images = torch.from_numpy(np.stack([render(c) for c in picked]))
    return picked, images


def test_toyworld_ground_truth_scores_one_and_noise_low():
    conds, images = _toyworld_truth()
    fn = get_reward_fn("toyworld")
    meta = [{"index": i, "condition": c} for i, c in enumerate(conds)]
    scores, details = fn(images, [c.prompt() for c in conds], meta)
    assert scores.dtype == np.float32 and scores.shape == (len(conds),)
    np.testing.assert_array_equal(scores, np.ones(len(conds), np.float32))
    assert set(details) == {"color_accuracy", "shape_accuracy", "position_accuracy", "strict_accuracy"}
    for v in details.values():
        np.testing.assert_array_equal(v, np.ones(len(conds)))

    noise = torch.from_numpy(np.random.default_rng(0).random(images.shape, dtype=np.float32))
    scores, details = fn(noise, [c.prompt() for c in conds], meta)
    assert scores.mean() < 0.2
    for v in details.values():
        assert v.shape == (len(conds),) and set(np.unique(v)) <= {0.0, 1.0}
    assert details["strict_accuracy"].sum() == 0


def test_toyworld_details_are_per_sample_0_1():
    cond = all_conditions()[0]  # a red square on the left
    wrong = [c for c in all_conditions()[:72] if c.obj.color != cond.obj.color and c.obj.shape == cond.obj.shape
             and c.place == cond.place][0]
    img = torch.from_numpy(render(cond))[None].repeat(2, 1, 1, 1)
    scores, det = get_reward_fn("toyworld")(img, ["", ""], [{"condition": cond}, {"condition": wrong}])
    np.testing.assert_allclose(scores, [1.0, 2 / 3], rtol=1e-6)
    np.testing.assert_array_equal(det["color_accuracy"], [1, 0])
    np.testing.assert_array_equal(det["shape_accuracy"], [1, 1])
    np.testing.assert_array_equal(det["strict_accuracy"], [1, 0])


def test_toyworld_needs_condition():
    with pytest.raises(RewardError, match=r"metadata\[0\]\['condition'\]"):
        get_reward_fn("toyworld")(torch.zeros(1, 3, 32, 32), [""], [{"index": 3}])


def test_toyworld_through_computer():
    conds, images = _toyworld_truth()
    res = RewardComputer({"toyworld": 1.0})(images, [c.prompt() for c in conds], [{"condition": c} for c in conds])
    np.testing.assert_array_equal(res.avg, np.ones(len(conds), np.float32))
    assert res.summary()["toyworld/strict_accuracy"] == 1.0


# ----------------------------------------------------------------------------- aesthetic
def test_aesthetic_missing_paths_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="clip_model_path"):
        get_reward_fn("aesthetic")
    with pytest.raises(ConfigError, match="mlp_path"):
        get_reward_fn("aesthetic", clip_model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="not an existing folder"):
        get_reward_fn("aesthetic", clip_model_path=str(tmp_path / "nope"), mlp_path="x.pth")


def test_aesthetic_tiny_clip_offline(tmp_path, monkeypatch):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from ddpo_grpo.rewards import AestheticMLP

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    embed_dim = 16
    cfg = CLIPConfig(
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=embed_dim,
    )
    clip_dir = tmp_path / "clip"
    CLIPModel(cfg).save_pretrained(clip_dir)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(clip_dir)
    mlp_path = tmp_path / "mlp.pth"
    torch.save(AestheticMLP(embed_dim).state_dict(), mlp_path)

    fn = get_reward_fn("aesthetic", clip_model_path=str(clip_dir), mlp_path=str(mlp_path), embed_dim=embed_dim,
                       batch_size=2)
    images = torch.randint(0, 256, (3, 3, 40, 40), generator=torch.Generator().manual_seed(1)) / 255.0
    scores, details = fn(images, [""] * 3, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == np.float32 and np.isfinite(scores).all()
    assert details == {}
    # the score is the LAION predictor's: the MLP on the L2-normalised projected CLIP image embedding of the
    # images as 8-bit RGB, through CLIP's own preprocessing (transformers' get_image_features), MLP in eval mode
    clip = CLIPModel.from_pretrained(clip_dir).eval()
    pix = CLIPImageProcessor.from_pretrained(clip_dir)(
        images=list((images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()), return_tensors="pt").pixel_values
    mlp = AestheticMLP(embed_dim)
    mlp.load_state_dict(torch.load(mlp_path))
    with torch.no_grad():
        feats = clip.get_image_features(pixel_values=pix)
        feats = getattr(feats, "pooler_output", feats)  # transformers 5 returns the output object
        want = mlp.eval()(feats / feats.norm(dim=-1, keepdim=True)).squeeze(-1).numpy()
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6)
    assert np.ptp(want) > 1e-4  # the images score differently, so a wrong embedding would show
    again, _ = fn(images, [""] * 3, [{}] * 3)
    np.testing.assert_allclose(scores, again, rtol=1e-5, atol=1e-6)  # eval mode: dropout off
    with pytest.raises(ConfigError, match="embed_dim"):
        get_reward_fn("aesthetic", clip_model_path=str(clip_dir), mlp_path=str(mlp_path), embed_dim=768)

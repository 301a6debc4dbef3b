"""Toy world: deterministic renders, a verifier that reads them back, the tokenizer and the bundled model."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddpo_grpo.worlds.toyworld import (COLORS, PLACES, RELATIONS, SHAPES, Condition, Obj, ToyWorldDataset, all_conditions,
                                render, summarize, verify_batch, vocabulary)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_world_size_and_prompts():
    conds = all_conditions()
    assert len(COLORS) >= 6 and len(SHAPES) >= 4 and len(PLACES) >= 3
    assert len(conds) == 6 * 4 * 3 + len(RELATIONS) * 24 * 23
    assert Condition(Obj("red", "triangle"), relation="left of", other=Obj("blue", "square")).prompt() == \
        "a red triangle left of a blue square"
    assert conds[0].prompt() == "a red square on the left"


def test_render_is_deterministic_and_seeded():
    c = all_conditions()[100]
    a = render(c, np.random.default_rng(3))
    b = render(c, np.random.default_rng(3))
    d = render(c, np.random.default_rng(4))
    assert a.shape == (3, 32, 32) and a.dtype == np.float32 and np.array_equal(a, b) and not np.array_equal(a, d)
    ds = ToyWorldDataset(split="train", seed=1)
    p1, img1, idx1 = ds[5]
    p2, img2, idx2 = ToyWorldDataset(split="train", seed=1)[5]
    assert p1 == p2 and idx1 == idx2 and torch.equal(img1, img2) and img1.min() >= -1 and img1.max() <= 1
    assert set(ToyWorldDataset("eval").indices).isdisjoint(ToyWorldDataset("train").indices)


def test_verifier_ground_truth_and_noise():
    rng = np.random.default_rng(0)
    conds = all_conditions()
    picked = [conds[i] for i in rng.choice(len(conds), 400, replace=False)]
    gt = np.stack([render(c, rng) for c in picked])
    s = summarize(verify_batch(gt, picked))
    assert s["strict_accuracy"] >= 0.99 and s["accuracy"] >= 0.99
    canonical = np.stack([render(c) for c in picked])
    assert summarize(verify_batch(canonical, picked))["strict_accuracy"] == 1.0
    noise = rng.random(gt.shape).astype(np.float32)
    s = summarize(verify_batch(noise, picked))
    assert s["strict_accuracy"] == 0.0 and s["accuracy"] < 0.2


def test_verifier_reads_each_attribute():
    c = Condition(Obj("green", "circle"), place="right")
    img = render(c)
    wrong_colour = render(Condition(Obj("blue", "circle"), place="right"))
    wrong_shape = render(Condition(Obj("green", "cross"), place="right"))
    wrong_place = render(Condition(Obj("green", "circle"), place="left"))
    s = verify_batch(np.stack([img, wrong_colour, wrong_shape, wrong_place]), [c] * 4)
    assert s["color"].tolist() == [1, 0, 1, 1]
    assert s["shape"].tolist() == [1, 1, 0, 1]
    assert s["position"].tolist() == [1, 1, 1, 0]
    pair = Condition(Obj("red", "square"), relation="above", other=Obj("cyan", "triangle"))
    swapped = Condition(Obj("red", "square"), relation="below", other=Obj("cyan", "triangle"))
    s = verify_batch(np.stack([render(pair), render(swapped)]), [pair, pair])
    assert s["reward"][0] == 1.0 and s["position"][1] == 0.0


def test_tokenizer_round_trip(tmp_path):
    from transformers import CLIPTokenizer

    from ddpo_grpo.models.tiny import build_tokenizer

    build_tokenizer(vocabulary(), str(tmp_path / "tok"))
    tok = CLIPTokenizer.from_pretrained(str(tmp_path / "tok"))
    for c in all_conditions()[::37]:
        ids = tok(c.prompt()).input_ids
        assert len(ids) == len(c.prompt().split()) + 2  # every word is one token, plus BOS/EOS
        assert tok.decode(ids, skip_special_tokens=True) == c.prompt()
        assert tok.unk_token_id not in ids[1:-1]  # CLIP's unk is its EOS token
    ids = tok(["a red square", "a blue circle"]).input_ids
    assert ids[0][2] != ids[1][2]  # distinct words, distinct ids (the transformers-5 pitfall maps all to one)


def test_bundled_model_loads_offline_and_generates():
    code = ("from ddpo_grpo.models import load_pipeline; p = load_pipeline('tiny-t2i'); "
            "print(p.family, p.sample_shape, type(p.scheduler).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    assert "ddim (3, 32, 32) DDIMScheduler" in out.stdout
    from ddpo_grpo.core.pipeline_with_logprob import encode_prompts, pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings
    from ddpo_grpo.models import load_pipeline

    p = load_pipeline("tiny-t2i")
    emb = encode_prompts(p.text_encoder, p.tokenizer, ["a red square on the left", "a blue circle above a red cross"])
    traj = pipeline_with_logprob(p.unet, p.scheduler, SamplerSettings(family="ddim"), emb, num_inference_steps=4,
                                 sample_shape=p.sample_shape, generator=torch.Generator().manual_seed(0))
    assert traj.images.shape == (2, 3, 32, 32) and traj.log_probs.shape == (2, 4)
    assert torch.isfinite(traj.log_probs).all()


def test_missing_model_path_is_a_clear_error():
    from ddpo_grpo.models import ModelPathError, load_pipeline

    with pytest.raises(ModelPathError, match="not a folder"):
        load_pipeline("/no/such/model")


def test_verifier_reads_a_two_pixel_blob_without_numeric_warnings():
    """A blob 2 pixels wide (as an undertrained sample draws) is still read as an object, and no template of
    radius 0 is built (the triangle's would divide by zero and warn in every user's log)."""
    import warnings

    c = Condition(Obj("red", "triangle"), place="left")
    img = np.zeros((3, 32, 32), np.float32)
    img[0, 15:17, 4:6] = 1.0  # a red 2x2 blob on the left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = verify_batch(img[None], [c])
    assert s["color"].tolist() == [1.0] and s["position"].tolist() == [1.0]


def test_cached_verifier_templates_change_no_score(monkeypatch):
    """verify._template caches shape_mask: the same arrays (read-only), and every score over noisy renders of random
    conditions equal to what the uncached templates give."""
    from ddpo_grpo.worlds.toyworld import verify

    rng = np.random.default_rng(3)
    for _ in range(50):
        key = (str(rng.choice(SHAPES)), rng.integers(0, 65) / 2, rng.integers(0, 65) / 2, rng.integers(1, 17) / 2)
        t = verify._template(*key)
        assert not t.flags.writeable and np.array_equal(t, verify.shape_mask(*key))
    conds = all_conditions()
    picked = [conds[i] for i in rng.integers(len(conds), size=48)]
    imgs = np.stack([np.clip(render(c, rng) + rng.normal(0, 0.15, (3, 32, 32)), 0, 1) for c in picked])
    cached = verify_batch(imgs, picked)
    monkeypatch.setattr(verify, "_template", lambda *k: verify.shape_mask(*k))
    plain = verify_batch(imgs, picked)
    assert set(cached) == set(plain)
    for k in plain:
        assert np.array_equal(np.asarray(cached[k]), np.asarray(plain[k])), k
    assert 0.0 < float(np.mean(plain["strict"])) < 1.0  # the noise makes some reads fail: the check compares both kinds

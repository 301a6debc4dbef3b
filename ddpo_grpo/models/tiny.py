"""Architectures of the bundled tiny models: a word-level CLIP tokenizer, a small CLIP text encoder
and a pixel-space UNet2DConditionModel. Used by benchmarks/pretrain_tiny.py; loading goes through
`ddpo_grpo.models.load_pipeline` like any diffusers checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Iterable, List, Tuple

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

MAX_TOKENS = 16


def _bpe_for_words(words: Iterable[str]) -> Tuple[dict, List[Tuple[str, str]]]:
    """A CLIP-style BPE vocab and merge list in which every given word is one token.

    Merges are learned the standard way (repeatedly merge the most frequent adjacent pair), so
    applying them in rank order reproduces the learned segmentation and ends in whole words.
    """
    words = sorted(set(words))
    chars = sorted({ch for w in words for ch in w})
    vocab: List[str] = chars + [c + "</w>" for c in chars]
    merges: List[Tuple[str, str]] = []
    segs = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    while any(len(s) > 1 for s in segs):
        counts: dict = {}
        for s in segs:
            for pair in zip(s, s[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        pair = max(sorted(counts), key=lambda p: counts[p])
        merges.append(pair)
        merged = pair[0] + pair[1]
        if merged not in vocab:
            vocab.append(merged)
        for k, s in enumerate(segs):
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == pair:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segs[k] = out
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def clip_tokenizer(words: Iterable[str], model_max_length: int) -> CLIPTokenizer:
    """A CLIPTokenizer (CLIP BPE) in which every word is one token, padded with <|endoftext|>: the bundled models' and
    every tiny / random build's CLIP tokenizer. CLIPTokenizer reads its vocabulary from files only: they are written
    to a fresh temporary folder (a stale tokenizer.json next to them would take precedence)."""
    vocab, merges = _bpe_for_words(list(words))
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        with open(os.path.join(tmp, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=model_max_length, pad_token="<|endoftext|>")


def t5_tokenizer(words: Iterable[str], model_max_length: int, extra_letters: str = ""):
    """A T5 (Unigram, sentencepiece-style) tokenizer built with the `tokenizers` library: every word one piece
    ("▁word"), single letters (a-z, the words' own, `extra_letters`) as fallback, <pad>=0, </s>=1, <unk>=2 as in T5.
    Saved as tokenizer.json, which transformers' T5 tokenizer class (T5Tokenizer in transformers 5) loads offline:
    the T5 / UMT5 tokenizer of the tiny and random builds."""
    from transformers import T5TokenizerFast

    words = list(words)
    letters = sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz" + extra_letters))
    vocab = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in words]
             + [("\u2581", -2.0)] + [(c, -5.0) for c in letters])
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def build_tokenizer(words: Iterable[str], save_dir: str) -> CLIPTokenizer:
    """Build the bundled models' CLIPTokenizer whose vocab is `words` (one token each) and save it to save_dir."""
    tok = clip_tokenizer(words, MAX_TOKENS)
    if os.path.isdir(save_dir):
        shutil.rmtree(save_dir)
    tok.save_pretrained(save_dir)
    return tok


def build_text_encoder(vocab_size: int) -> CLIPTextModel:
    cfg = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_TOKENS, projection_dim=64,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    )
    return CLIPTextModel(cfg)


def build_unet(prediction_type: str = "v_prediction", in_channels: int = 3) -> UNet2DConditionModel:
    """~1.4M-parameter pixel UNet for 3x32x32; cross-attention only at 8x8 (attention at 32x32 is ~8x slower)."""
    return UNet2DConditionModel(
        sample_size=32, in_channels=in_channels, out_channels=3,
        down_block_types=("DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 64), layers_per_block=1, cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=8, addition_embed_type="text",
        addition_embed_type_num_heads=4,
    )


def build_ddim_scheduler() -> DDIMScheduler:
    # set_alpha_to_one=False (as in Stable Diffusion) keeps the last DDIM step stochastic, so it has a logprob.
    return DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction",
        clip_sample=True, clip_sample_range=1.0, set_alpha_to_one=False, steps_offset=1,
        timestep_spacing="leading",
    )


def build_flow_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


def save_model(out: str, unet, scheduler, meta: dict, text_encoder=None, tokenizer=None) -> None:
    """Write a diffusers-format folder (unet/, scheduler/, optional text_encoder/ and tokenizer/) plus
    pretrain_meta.json, loadable offline by ddpo_grpo.models.load_pipeline."""
    os.makedirs(out, exist_ok=True)
    unet.save_pretrained(os.path.join(out, "unet"))
    scheduler.save_pretrained(os.path.join(out, "scheduler"))
    if text_encoder is not None:
        text_encoder.save_pretrained(os.path.join(out, "text_encoder"))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "pretrain_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)


def optimizer_step(loss, opt, lr_schedule, params, max_grad_norm: float = 1.0) -> None:
    """One pretraining update: backward, grad-norm clip, AdamW step, LR schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    lr_schedule.step()

"""Cached prompt embeddings (data.cache_embeddings, trainer/run/embeddings.py; issue 38): bit-identical to encoding on
the fly for every family, keyed by what changes an embedding, a damaged file encoded again, and one file shared by
the processes of a run."""
import os
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.core import offload
from ddpo_grpo.models import load_pipeline
from ddpo_grpo.trainer.run.embeddings import FOLDER, PromptEmbeddings
from helpers import FAMILIES, PROMPTS, ROOT, SIZE, cpu_env, launch_cmd

sys.path.insert(0, os.path.join(ROOT, "config"))
import grpo  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_embeddings_are_the_on_the_fly_ones_every_family(cache, tmp_path, name, monkeypatch):
    """PromptEmbeddings with the prompt set precomputed on the host (data.cache_embeddings) gives the bits of encoding
    each prompt on first use on the device (the default path), the empty prompt (CFG's negative) and duplicates
    included; the text encoders are parked on the host after the precompute; a second process (or a resumed run)
    reads the run folder's file without running an encoder, and gets the same bits."""
    pipe = load_pipeline(name, **SIZE.get(name, {}))
    fly = PromptEmbeddings(pipe, "cpu", host=False)(PROMPTS)
    cached = PromptEmbeddings(pipe, "cpu", host=True)
    path = cached.precompute(PROMPTS, folder=str(tmp_path), settings={"model": name})
    assert all(offload.is_parked(m) and offload.module_device(m).type == "cpu" for m in pipe.text_encoders())
    assert all(t.device.type == "cpu" for t in cached.table.values())  # held on the host
    got = cached(PROMPTS)
    assert got.dtype == fly.dtype and torch.equal(got, fly)
    assert os.path.dirname(path) == str(tmp_path / FOLDER) and os.listdir(tmp_path / FOLDER) == [os.path.basename(path)]

    def no_encoder(*a, **k):
        raise AssertionError("the cached file should have been read")

    monkeypatch.setattr(pipe.adapter, "encode", no_encoder)
    again = PromptEmbeddings(pipe, "cpu", host=True)
    assert again.precompute(PROMPTS, folder=str(tmp_path), settings={"model": name}) == path
    assert torch.equal(again(PROMPTS), fly)


def test_cache_file_is_keyed_and_a_damaged_one_is_reencoded(cache, tmp_path):
    """Another prompt set or model settings -> another file; a damaged file is encoded again, not trusted."""
    pipe = load_pipeline("tiny-t2i")
    a = PromptEmbeddings(pipe, "cpu", host=True).precompute(PROMPTS, folder=str(tmp_path), settings={"model": "x"})
    b = PromptEmbeddings(pipe, "cpu", host=True).precompute(PROMPTS[:2], folder=str(tmp_path), settings={"model": "x"})
    c = PromptEmbeddings(pipe, "cpu", host=True).precompute(PROMPTS, folder=str(tmp_path), settings={"model": "y"})
    assert len({a, b, c}) == 3
    ref = PromptEmbeddings(pipe, "cpu")(PROMPTS)
    with open(a, "wb") as f:
        f.write(b"not a torch file")
    again = PromptEmbeddings(pipe, "cpu", host=True)
    again.precompute(PROMPTS, folder=str(tmp_path), settings={"model": "x"})
    assert torch.equal(again(PROMPTS), ref) and torch.load(a, weights_only=True).keys() == set(PROMPTS)


def test_two_processes_share_one_cached_embedding_file(tmp_path):
    """data.cache_embeddings under 2 processes: each machine's main process encodes and writes while the others
    wait (local_main_process_first), then they read its file: the run trains on both, and leaves exactly one
    complete file in <run>/embeddings (no temporary one) holding every train and eval prompt and the negative ""."""
    import glob

    cmd = [*launch_cmd(2, 28900), "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=1",
           f"--config.logdir={tmp_path}", "--config.run_name=cached", "--config.data.cache_embeddings=True",
           "--config.sample.num_steps=3", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1",
           "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.save_freq=0",
           "--config.logging.wandb=False", "--config.logging.image_freq=0", "--config.logging.debug_dump=True"]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    files = os.listdir(tmp_path / "cached" / FOLDER)
    assert len(files) == 1 and files[0].endswith(".pt"), files
    table = torch.load(tmp_path / "cached" / FOLDER / files[0], weights_only=True)
    assert len(glob.glob(str(tmp_path / "cached" / "debug" / "epoch_0000_rank_*.json"))) == 2  # both trained
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.trainer.run.embeddings import dataset_prompts

    config = grpo.get_config("tiny")
    want = set(dataset_prompts(build_dataset(config, "train")) + dataset_prompts(build_dataset(config, "eval")) + [""])
    assert set(table) == want and len(want) > 100


def test_cache_key_covers_what_changes_an_embedding(cache):
    """The file name (embeddings.cache_key) changes with what changes the bits of an embedding beyond the prompts and
    settings: SDXL's resolution (packed in its time ids) and the encoders' / denoiser's dtype; the same model and
    prompts give the same name in another process (nothing per-object in it)."""
    from ddpo_grpo.trainer.run.embeddings import cache_key

    small, large = load_pipeline("sdxl-tiny", resolution=16), load_pipeline("sdxl-tiny", resolution=32)
    with torch.no_grad():
        assert not torch.equal(small.encode(["x"]), large.encode(["x"]))  # so a shared file would be wrong
    assert cache_key(small, {}, ["x"]) != cache_key(large, {}, ["x"])
    fp32, bf16 = load_pipeline("tiny-t2i"), load_pipeline("tiny-t2i", torch_dtype=BF16)
    assert cache_key(fp32, {}, ["x"]) != cache_key(bf16, {}, ["x"])
    assert cache_key(fp32, {}, ["x"]) == cache_key(load_pipeline("tiny-t2i"), {}, ["x"])
    assert cache_key(fp32, {}, ["x", "y"]) != cache_key(fp32, {}, ["y", "x"])  # the order the file lists them in

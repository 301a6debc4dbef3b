"""Prompt embeddings, computed once: the trainer's `ctx.encode` (build.py) and, with data.cache_embeddings, the
whole prompt set encoded before training, held on the host (and in the run folder), with the text encoders parked
off the accelerator (core.offload) for the rest of the run.

Every condition goes through the adapter's own encode path (LoadedPipeline.encode -> ModelAdapter.encode: the
diffusers pipeline's encode_prompt, pooled vectors packed in), one prompt per call, whether it is cached ahead or on
first use: an embedding never depends on which batch first asked for it, so a cached run, a resumed run and an
uncached run feed the denoiser the same bits (tests/test_memory_switches.py, every family)."""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from tqdm.auto import tqdm

from ddpo_grpo.core.offload import park, visiting

FOLDER = "embeddings"  # under the run folder: one file per (model, settings, prompt set)


def dataset_prompts(dataset) -> List[str]:
    """Every prompt of a condition dataset, in order, without building its items where it says them more cheaply
    (`prompt_at(i)`: a recam_video item renders two clips)."""
    at = getattr(dataset, "prompt_at", None)
    return [at(i) if at is not None else dataset[i]["prompt"] for i in range(len(dataset))]


def cache_key(pipe, settings: dict, prompts: Sequence[str]) -> str:
    """sha1 over what decides an embedding: the model (folder, adapter, the denoiser's dtype, resolution: SDXL packs
    its size in the time ids), the run's settings that reach the encoder (`settings`) and the prompt texts."""
    what = {"model": str(pipe.path), "adapter": pipe.adapter.name, "resolution": int(getattr(pipe, "resolution", 0)),
            "dtype": str(next(pipe.unet.parameters()).dtype),
            "encoders": [str(next(m.parameters()).dtype) for m in pipe.text_encoders()], **settings}
    h = hashlib.sha1(json.dumps(what, sort_keys=True).encode())
    for p in prompts:
        h.update(p.encode("utf-8") + b"\0")
    return h.hexdigest()


class PromptEmbeddings:
    """prompt -> condition (L, D), each encoded once (LoadedPipeline.encode of that prompt alone).

    `host`: keep them on the host and copy a batch's to `device` per call (data.cache_embeddings), else on `device`
    (the trainer's default: a small prompt set, encoders left where they loaded). Calling it with prompts gives their
    conditions stacked, (B, L, D) on `device`."""

    def __init__(self, pipe, device, host: bool = False):
        self.pipe, self.device, self.host = pipe, torch.device(device), bool(host)
        self.table: Dict[str, torch.Tensor] = {}
        self.seconds = 0.0  # time spent encoding (the startup line: trainer/run/startup.py)

    def _one(self, prompt: str) -> torch.Tensor:
        e = self.pipe.encode([prompt])[0]
        return e.cpu() if self.host else e.to(self.device)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> torch.Tensor:
        todo = [p for p in dict.fromkeys(prompts) if p not in self.table]
        if todo:  # parked encoders (pretrained.offload) visit once for the batch's new prompts, not once per prompt
            start = time.perf_counter()
            with visiting(self.pipe.text_encoders(), next(self.pipe.unet.parameters()).device):
                for p in todo:
                    self.table[p] = self._one(p)
            self.seconds += time.perf_counter() - start
        return torch.stack([self.table[p] for p in prompts]).to(self.device)

    @torch.no_grad()
    def precompute(self, prompts: Iterable[str], folder: Optional[str] = None, settings: Optional[dict] = None,
                   write: bool = True) -> str:
        """Encode every prompt not held yet (the text encoders visit the device once for all of them), then park the
        text encoders on the host. With `folder`: first read <folder>/embeddings/<cache_key>.pt if a process or an
        earlier run of this folder wrote it (a resume), else encode and, if `write`, write it there atomically (a
        file of its own renamed into place: concurrent writers leave one complete file). Returns the file ('' none)."""
        prompts = list(dict.fromkeys(prompts))
        path = ""
        if folder:
            path = os.path.join(folder, FOLDER, cache_key(self.pipe, settings or {}, prompts) + ".pt")
            saved = _read(path, prompts)
            if saved is not None:
                for p, t in saved.items():
                    self.table.setdefault(p, t if self.host else t.to(self.device))
        todo = [p for p in prompts if p not in self.table]
        if todo:
            start = time.perf_counter()
            with visiting(self.pipe.text_encoders(), next(self.pipe.unet.parameters()).device):
                # a bar: a large prompt set through a T5-XXL takes a while, and this is before any other output
                for p in tqdm(todo, desc="caching prompt embeddings", leave=False, mininterval=2.0, disable=not write):
                    self.table[p] = self._one(p)
            self.seconds += time.perf_counter() - start
            if path and write:
                _write(path, {p: self.table[p].cpu() for p in prompts})
        park(self.pipe.text_encoders())  # training never runs them again; a prompt outside the set visits
        return path


def _read(path: str, prompts: Sequence[str]) -> Optional[Dict[str, torch.Tensor]]:
    """The saved {prompt: embedding} at `path` if it holds exactly `prompts`, else None (absent, or unreadable)."""
    if not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged file is re-encoded, not trusted
        return None
    return saved if isinstance(saved, dict) and set(saved) == set(prompts) else None


def _write(path: str, table: Dict[str, torch.Tensor]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # unique across machines sharing the folder (pids are not)
    torch.save(table, tmp)
    os.replace(tmp, path)  # atomic on one filesystem: readers see the old file or the whole new one

"""Frozen modules parked on the host between their calls (config pretrained.offload, and text encoders once the prompt
embeddings are cached: trainer/run/embeddings.py).

A parked module lives on the CPU and visits the compute device only for a call: the VAE for decode / encode, the
text encoders for encode_prompt, so that during the training phase the accelerator holds the denoiser, its
gradients and optimizer state, and the activations, nothing else. What users of the peers' trainers do by hand
(DanceGRPO's precomputed embeddings, Flow-GRPO's issues on T5 and the VAE filling the GPU).

    park([vae])                       # moved to the CPU and marked
    with visiting([vae], device):     # on `device` inside (only the parked modules that are elsewhere), back after
        images = vae.decode(z)

visiting moves only parked modules and only those not already on `device`, and moves back exactly those it moved:
nested visits (the embedding precompute around many encode calls) move each module once. Unparked modules are left
where they are, so code that calls visiting costs nothing in a run without offload. Moving a module is a copy of the
same values: results do not depend on whether it was parked (tests/test_memory_switches.py)."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional

import torch

PARKED = "_ddpo_grpo_parked"  # the marker attribute on a parked module
HOME = torch.device("cpu")


def _modules(modules) -> List[torch.nn.Module]:
    if modules is None or isinstance(modules, torch.nn.Module):
        modules = [modules]
    seen, out = set(), []
    for m in modules:
        if isinstance(m, torch.nn.Module) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def module_device(module: torch.nn.Module) -> Optional[torch.device]:
    """The device of a module's first parameter (or buffer); None for a module without tensors."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def same_device(a: torch.device, b: torch.device) -> bool:
    """a and b name the same device ("cuda" and "cuda:0" do when 0 is the current device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def is_parked(module) -> bool:
    return isinstance(module, torch.nn.Module) and bool(getattr(module, PARKED, False))


def park(modules: Iterable[torch.nn.Module]) -> List[torch.nn.Module]:
    """Mark `modules` parked and move them to the host (in place: every holder of the module sees it move). Frees the
    accelerator's cached blocks they held. Returns the modules parked."""
    parked = _modules(modules)
    for m in parked:
        setattr(m, PARKED, True)
        m.to(HOME)
    if parked and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return parked


def compute_device(module, device) -> torch.device:
    """Where `module` runs a call asked for on `device`: `device` when it is parked (visiting brings it), else where
    its parameters are."""
    if is_parked(module) or module_device(module) is None:
        return torch.device(device)
    return module_device(module)


@contextlib.contextmanager
def visiting(modules, device) -> Iterator[None]:
    """The parked ones among `modules` on `device` inside the block, back on the host after it (also on exceptions)."""
    moved = []
    try:
        for m in _modules(modules):
            here = module_device(m)
            if is_parked(m) and here is not None and not same_device(here, device):
                m.to(device)
                moved.append(m)
        yield
    finally:
        for m in moved:
            m.to(HOME)

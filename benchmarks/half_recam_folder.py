"""A ReCamMaster model folder (benchmarks/pretrain_recam_video.py's output) with its DiT stored in float16: how a
128-channel start fits the repository's 35 MB of bundled assets (issue 59).

    python benchmarks/half_recam_folder.py SRC DST [--parents FOLDER ...]

Only the DiT is halved, in both places it lives: `transformer/` (the plain Wan weights, what diffusers loads) and
`recammaster.ckpt` (the DiT with camera layers under Wan's original key names, what the trainer loads). The VAE, text
encoder, tokenizer and scheduler are copied as they are. Loading is unchanged: `RecamAdapter.load` builds the DiT in the
run's dtype (float32 on a CPU) and copies the checkpoint's tensors in, so only the weights' rounding differs
(tests/test_half_recam_folder.py bounds what that does to a denoiser output). `pretrain_meta.json` gains
`dit_dtype` and, with --parents, `lineage`: each parent stage's own pretrain_meta.json, oldest first, so a bundled
start made in several stages keeps every command that made it (a parent that has a lineage of its own, such as an
earlier bundled start trained on, brings it in front of itself)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import refuse  # noqa: E402  (a SRC or --parents folder of the wrong kind: one line, exit 2)

from ddpo_grpo.models.recam import EXPORT_CHECKPOINT as CHECKPOINT  # noqa: E402  (the checkpoint file's one name)

WEIGHTS = "diffusion_pytorch_model.safetensors"


def halve(state: dict) -> dict:
    """Every floating tensor as float16 (contiguous, on the CPU); anything else as it is."""
    return {k: (v.detach().to("cpu", torch.float16).contiguous() if torch.is_floating_point(v) else v)
            for k, v in state.items()}


def half_folder(src: str, dst: str, parents=()) -> str:
    """Copy the model folder SRC to DST with its DiT in float16; written to DST.tmp and renamed, so DST is never half
    written. Returns DST."""
    from safetensors.torch import load_file, save_file

    for path in [os.path.join(src, CHECKPOINT), os.path.join(src, "transformer", WEIGHTS),
                 os.path.join(src, "pretrain_meta.json")]:
        if not os.path.isfile(path):
            refuse(f"{path} is missing: SRC must be a pretrain_recam_video.py folder")
    metas = []
    for p in parents:
        meta_path = os.path.join(p, "pretrain_meta.json")
        if not os.path.isfile(meta_path):
            refuse(f"--parents {p}: no pretrain_meta.json")
        metas.append(json.load(open(meta_path)))
    tmp = dst.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    weights = os.path.join(tmp, "transformer", WEIGHTS)
    save_file(halve(load_file(weights)), weights, metadata={"format": "pt"})
    ckpt = os.path.join(tmp, CHECKPOINT)
    torch.save(halve(torch.load(ckpt, map_location="cpu", weights_only=True)), ckpt)
    meta_path = os.path.join(tmp, "pretrain_meta.json")
    meta = json.load(open(meta_path))
    meta["dit_dtype"] = "float16"
    if metas:
        # a parent that is itself a halved folder (a bundled start trained on) brings its own lineage before it
        meta["lineage"] = [stage for m in metas for stage in [*(m.get("lineage") or []),
                                                               {k: v for k, v in m.items() if k != "lineage"}]]
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--parents", nargs="*", default=[], help="the stages SRC was trained from, oldest first")
    args = ap.parse_args(argv)
    print(half_folder(args.src, args.dst, args.parents))


if __name__ == "__main__":
    main()

"""The memory plan's table for docs/performance.md: SD 1.5, SDXL, SD3.5-M, FLUX.1-dev, Wan 2.1 1.3B and 14B, LoRA
and full fine-tuning, on 1 x 80 GB, 8 x 80 GB and 8 x 64 GB (Ascend 910B): what fits, with which switches.

    python -m benchmarks.memory_table                              # print the table (Markdown)
    python -m benchmarks.memory_table --write docs/performance.md  # and replace it between the markers there

Each model runs its named config (config/grpo.py, as scripts/bench_gpu.py does: resolution, frames, CFG, train batch,
LoRA rank, beta) with the real-shape build in place of the folder, bf16, and the memory switches off (gradient
checkpointing, data.cache_embeddings, pretrained.offload): the "plain" plan. Per hardware, DDP over its devices; where
that does not fit, the fewest switches that do (trainer/checks/memory_plan.fit: offload, cached embeddings, gradient
checkpointing, FSDP2 over the machine's devices, a smaller train.batch_size), planned, not guessed. Counts come from
the configs on the meta device (trainer/checks/meta_counts.count_model); nothing is allocated, no GPU is needed. Wan 2.1 14B
is models.wan.build_wan21_14b_random on "meta" (not a models.BUILT name). Measured GPU peaks: pending (no GPU
has run these shapes yet; scripts/bench_gpu.py measures them where one is available).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# label -> (named config, built model or "wan14b")
MODELS = {"SD 1.5": ("sd15_random_bench", "sd15-random"), "SDXL": ("sdxl", "sdxl-random"),
          "SD3.5-M": ("sd3", "sd35-medium-random"), "FLUX.1-dev": ("flux", "flux-dev-random"),
          "Wan 2.1 1.3B": ("wan", "wan21-1.3b-random"), "Wan 2.1 14B": ("wan", "wan14b")}
# (label, devices, GiB per device): an 80 GB H100 reports 79.2 GiB (torch.cuda.get_device_properties); 64 GB = 59.6 GiB
HARDWARE = (("1 x 80 GB", 1, 79.2), ("8 x 80 GB", 8, 79.2), ("8 x 64 GB (Ascend 910B)", 8, 59.6))
SHORT = {"offload": "offload", "cache_embeddings": "cache", "gradient_checkpointing": "ckpt", "fsdp2": "FSDP2"}
BEGIN, END = "<!-- memory_table:begin -->", "<!-- memory_table:end -->"


def model_config(name: str, built: str):
    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo

    c = grpo.get_config(name)
    c.pretrained.model = built if built != "wan14b" else "wan21-1.3b-random"
    c.mixed_precision = "bf16"
    c.gradient_checkpointing = False
    return c


def counts_of(name: str, built: str):
    import torch

    from ddpo_grpo.trainer.checks.meta_counts import count_model

    c = model_config(name, built)
    pipe = None
    if built == "wan14b":
        from ddpo_grpo.models.wan import build_wan21_14b_random

        pipe = build_wan21_14b_random(int(c.pretrained.resolution), 0, torch.float32, "meta")
    return c, count_model(c, pipe)


def shape_of(counts) -> str:
    """The denoised sample's shape: latent channels x [latent frames x] height x width."""
    return "x".join(str(d) for d in counts.sample_shape)


def cell(counts, s, devices: int, gib: float) -> str:
    from ddpo_grpo.trainer.checks import memory_plan as mp

    e = mp.Engine("ddp", devices)
    nbytes = mp.total(mp.plan(counts, s, e))
    if mp.fits(nbytes, gib):
        return f"fits ({nbytes / mp.GiB:.1f})"
    found = mp.fit(counts, s, e, gib, max_world=devices, switches=tuple(k for k in mp.SWITCHES if k != "use_lora"))
    if found is None:
        return f"no ({nbytes / mp.GiB:.0f})"
    names = [SHORT.get(n, n.replace("train.batch_size=", "bs ")) for n in found[0]]
    return f"{' + '.join(names)} ({found[3] / mp.GiB:.1f})"


def table() -> str:
    from ddpo_grpo.trainer.checks import memory_plan as mp

    head = ("| model | latent | mode | params / grads / optim, 1 device | activations per sample (ckpt) | train batch | "
            + " | ".join(h for h, _, _ in HARDWARE) + " | measured peak (GPU) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, (name, built) in MODELS.items():
        c, counts = counts_of(name, built)
        for lora in (True, False):
            s = replace(mp.settings_of(c, "bf16"), use_lora=lora, gradient_checkpointing=False,
                        cache_embeddings=False, offload=False)
            rows = dict(mp.plan(counts, s, mp.Engine()))
            params = sum(b for k, b in rows.items() if k.startswith("denoiser")) / mp.GiB
            grads = sum(b for k, b in rows.items() if k.startswith(("gradients", "DDP"))) / mp.GiB
            optim = sum(b for k, b in rows.items() if k.startswith("optimizer")) / mp.GiB
            act = counts.act_bytes * 2 / 4 * s.rows_per_sample / mp.GiB  # bf16: half the fp32 count
            act_ckpt = counts.act_bytes_ckpt * 2 / 4 * s.rows_per_sample / mp.GiB
            mode = f"LoRA r{c.lora_rank}" if lora else "full"
            lines.append(f"| {label} | {shape_of(counts)} | {mode} | {params:.1f} / {grads:.1f} / {optim:.1f} | "
                         f"{act:.1f} ({act_ckpt:.2f}) | {s.train_batch_size} | "
                         + " | ".join(cell(counts, s, n, g) for _, n, g in HARDWARE) + " | pending |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", default="", help="a Markdown file whose table between the markers is replaced")
    args = ap.parse_args(argv)
    text = table()
    print(text)
    if args.write:
        with open(args.write) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"error: {args.write} has no {BEGIN} ... {END} markers")
        a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        with open(args.write, "w") as f:
            f.write(doc[:a] + "\n" + text + "\n" + doc[b:])


if __name__ == "__main__":
    main()

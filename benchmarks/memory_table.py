"""The memory plan's table for docs/performance.md: SD 1.5, SDXL, SD3.5-M, FLUX.1-dev, Wan 2.1 1.3B and 14B, LoRA
and full fine-tuning, on 1 x 80 GB, 8 x 80 GB and 8 x 64 GB (Ascend 910B): what fits, with which switches.

    python -m benchmarks.memory_table                              # print the table (Markdown)
    python -m benchmarks.memory_table --write docs/performance.md  # and replace it between the markers there
    python -m benchmarks.memory_table --traced                     # the counts against traced CPU peaks (tiny builds)

Each model runs its named config (config/grpo.py, as scripts/bench_gpu.py does: resolution, frames, CFG, train batch,
LoRA rank, beta) with the real-shape build in place of the folder, bf16, and the memory switches off (gradient
checkpointing, data.cache_embeddings, pretrained.offload): the "plain" plan. Per hardware, DDP over its devices; where
that does not fit, the fewest switches that do (trainer/checks/memory_plan.fit: offload, cached embeddings, gradient
checkpointing, FSDP2 over the machine's devices, a smaller train.batch_size), planned, not guessed. Counts come from
the configs on the meta device (trainer/checks/meta_counts.count_model); nothing is allocated, no GPU is needed. Wan 2.1 14B
is models.wan.build_wan21_14b_random on "meta" (not a models.BUILT name). Counted under bf16 autocast's rules
(meta_counts' precision="bf16"); weights are counted once, in the static rows. Measured GPU peaks: scripts/gpu_check.sh.

`--traced`: each tiny build of TRACED at its config's shapes, float32 on this CPU, the plan's counts of the no-grad
phases (one sampling call, the decode of a sampling batch) against the allocated peak torch.profiler traces over the
same call of the real modules (`traced_peak`): the check that the counts are the computation's.
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
    return c, count_model(c, pipe, precision="bf16")


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
            "sampling call / decode (no grad) | " + " | ".join(h for h, _, _ in HARDWARE) + " | measured peak (GPU) |")
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
            per_sample = s.steps_per_call * s.train_cfg  # training rows per sample (counted in bf16 already)
            full_or_lora = ((counts.act_bytes_lora, counts.act_bytes_ckpt_lora) if lora
                            else (counts.act_bytes, counts.act_bytes_ckpt))  # what plan() reads for the mode
            act, act_ckpt = (b * per_sample / mp.GiB for b in full_or_lora)
            decode = counts.decode_bytes * mp.DECODE_TRANSIENTS[counts.decode_kind] / mp.GiB
            mode = f"LoRA r{c.lora_rank}" if lora else "full"
            lines.append(f"| {label} | {shape_of(counts)} | {mode} | {params:.1f} / {grads:.1f} / {optim:.1f} | "
                         f"{act:.1f} ({act_ckpt:.2f}) | {s.train_batch_size} | "
                         f"{counts.sampling_bytes / mp.GiB:.1f} / {decode:.1f} | "
                         + " | ".join(cell(counts, s, n, g) for _, n, g in HARDWARE) + " | pending |")
    return "\n".join(lines)


# tiny builds (config names) the --traced check runs: every family's, with a VAE of each kind
TRACED = ("tiny", "sdxl_tiny", "sd3_tiny", "flux_tiny", "wan_tiny", "recam_video_tiny")


def traced_peak(fn) -> int:
    """The peak of the bytes allocated on the CPU while fn() runs (torch.profiler's allocation and free events, in
    order; what was allocated before is not counted): the measured side of --traced, the counted side being
    meta_counts' nograd_peak_bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def traced_phases(name: str) -> dict:
    """One tiny build's no-grad phases, float32 on the CPU: the counts (count_model, precision "no") and the traced
    peaks of the same calls of the real modules, after one warm-up call each (oneDNN's caches)."""
    import torch

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.models import load_pipeline, recam_checkpoint_path
    from ddpo_grpo.trainer.checks.meta_counts import count_model, denoiser_inputs

    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo

    cfg = grpo.get_config(name)
    counts = count_model(cfg, only_configured=True, precision="no")
    pipe = load_pipeline(cfg.pretrained.model, torch.float32, "cpu", int(cfg.pretrained.resolution),
                         recam_checkpoint=recam_checkpoint_path(cfg))
    pipe.adapter.configure(pipe, cfg)
    B = int(cfg.sample.batch_size)
    rows = B * (2 if float(cfg.sample.guidance_scale) != 1.0 else 1)
    shapes = [a.shape for a in denoiser_inputs(pipe, rows)]
    gen = torch.Generator().manual_seed(0)
    x, cond = (torch.randn(sh, generator=gen) for sh in (shapes[0], shapes[2]))
    t = torch.full(shapes[1], 500.0)
    out = dict(name=name, rows=rows, sampling_count=counts.sampling_bytes, decode_kind=counts.decode_kind,
               decode_count=counts.decode_bytes, denoiser_params=counts.denoiser)
    with torch.no_grad():
        call = lambda: pipe.unet(x, t, encoder_hidden_states=cond)  # noqa: E731
        call()
        out["sampling_traced"] = traced_peak(call)
        if pipe.vae is not None:
            z = torch.randn(B, *pipe.sample_shape, generator=gen)
            decode(pipe.vae, z)
            out["decode_traced"] = traced_peak(lambda: decode(pipe.vae, z))
    return out


def traced_table(names=TRACED) -> str:
    from ddpo_grpo.trainer.checks import memory_plan as mp

    lines = ["| build | sampling call: rows, counted / traced MiB (ratio) | decode: VAE, counted x factor / traced MiB "
             "(ratio; count alone) |", "|---|---|---|"]
    for name in names:
        r = traced_phases(name)
        row = (f"| {name} | {r['rows']}, {r['sampling_count'] / 2**20:.2f} / {r['sampling_traced'] / 2**20:.2f} "
               f"({r['sampling_count'] / r['sampling_traced']:.2f}) | ")
        if r.get("decode_traced"):
            f = mp.DECODE_TRANSIENTS[r["decode_kind"]]
            row += (f"{r['decode_kind']}, {r['decode_count'] / 2**20:.2f} x {f} / {r['decode_traced'] / 2**20:.2f} "
                    f"({r['decode_count'] * f / r['decode_traced']:.2f}; {r['decode_count'] / r['decode_traced']:.2f}) |")
        else:
            row += "no VAE |"
        lines.append(row)
        print(row, file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", default="", help="a Markdown file whose table between the markers is replaced")
    ap.add_argument("--traced", action="store_true", help="the counts against traced CPU peaks of the tiny builds")
    args = ap.parse_args(argv)
    if args.traced:
        print(traced_table())
        return
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

"""Where a run's start-up time goes, printed once after the first sampling step:

    startup: load X s, move Y s, embeddings Z s (N prompts), first sampling step W s

On a real-shape model the minutes before the first progress line used to say nothing (issue 50: Wan and SD3.5 gave
no sampling line within 110 s / 56 s). The phases, measured by build_context and the prompt-embedding cache:
  load: building or reading the pipeline (a built model is initialised on the device there), the datasets and the
        reward functions (build_context's time less the two below);
  move: making the denoiser trainable (LoRA adapters), the speed switches, accelerate's prepare (device placement,
        DDP / FSDP2 wrapping) and the reference copy;
  embeddings: the text encoders' time so far (data.cache_embeddings: the whole prompt set before training; else the
        conditions met by then), and how many prompts that was;
  first sampling step: from build_context's end to the end of the denoiser's first call (synchronised once), less
        the embeddings encoded meanwhile (counted above): the noise draw, kernel selection / autotuning, the first
        call itself and, for ReCamMaster, the source clips' VAE encoding.
The four are disjoint: they add up to total_s, build_context's start to the first call's end (bench_gpu.py's "time to
first sample").
The hook is a one-shot forward hook on the denoiser (it removes itself), so the sampler carries no start-up code.
The line goes out through tqdm's writer (write_line): it fires inside the first sampling batch, while that bar is
drawn, and a plain print was glued into the bar's line in a log ("epoch 0: sampling: 0%| ...startup: load ...")."""
from __future__ import annotations

import os
import sys
import time
from typing import Dict

import torch


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work: the first call's time is its kernels', not their launch's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()


def line(phases: Dict[str, float]) -> str:
    return (f"startup: load {phases['load_s']:.1f} s, move {phases['move_s']:.1f} s, embeddings "
            f"{phases['embeddings_s']:.1f} s ({int(phases['embedding_prompts'])} prompts), first sampling step "
            f"{phases['first_step_s']:.1f} s")


def _same_file(a, b) -> bool:
    """Whether two streams write to one file (a log taking both stdout and stderr, `2>&1`)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a capture, a closed stream)
        return a == b
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def write_line(text: str) -> None:
    """Print `text` on stdout as a line of its own beside tqdm's progress bars: through tqdm's writer, which clears
    the bars (stdout's and stderr's: one terminal shows both) and redraws them after it. Clearing is a carriage
    return, which a file does not obey: where a drawn bar writes to a file that stdout also writes to (`> log 2>&1`,
    not a terminal), a newline first ends the bar's line there, so that `text` starts a line of the file too."""
    from tqdm import tqdm  # (tqdm.auto's classes share std tqdm's instances and lock)

    out = sys.stdout
    if out is None:
        return
    out.flush()  # what stdout holds goes before the bars are cleared, not after `text`
    with tqdm.external_write_mode(file=out):
        for bar in list(getattr(tqdm, "_instances", ())):
            fp = getattr(bar, "fp", None)
            if fp is not None and hasattr(bar, "start_t") and not _isatty(fp) and _same_file(fp, out):
                fp.write("\n")  # once: one newline ends the line of every bar in that file
                fp.flush()
                break
        out.write(text + "\n")
        out.flush()


def watch_first_step(ctx, printing: bool = True) -> None:
    """Complete ctx.startup at the end of the denoiser's first call (embeddings, first step, total) and print the
    line on the main process. ctx.startup holds load_s and move_s (build_context) and ready_at (perf_counter at
    build_context's end). Safe to call once per context."""
    module = ctx.unet

    def done(mod, args, output):
        handle.remove()  # one-shot: later calls pay nothing
        _sync(torch.device(ctx.accelerator.device))
        s = ctx.startup
        s["embeddings_s"] = float(getattr(ctx.encode, "seconds", 0.0))  # before and after build_context's end
        s["first_step_s"] = time.perf_counter() - s["ready_at"] - (s["embeddings_s"] - s.get("ready_embeddings_s", 0))
        s["embedding_prompts"] = int(len(getattr(ctx.encode, "table", ())))
        s["total_s"] = time.perf_counter() - s["started_at"]  # start of build_context to the first step's end
        if printing and ctx.accelerator.is_main_process:
            write_line(line(s))

    handle = module.register_forward_hook(done)

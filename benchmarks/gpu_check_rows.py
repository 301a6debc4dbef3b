"""The GPU check's rows (scripts/gpu_check.sh, scripts/bench_gpu.py): bench_gpu.jsonl read and written by Python
only (`append_row`, `read_rows`: a shell's printf of a log line with a progress bar's "\r" was invalid JSON, and the
table's json.loads then lost every build's row); the row of a build whose process ended without one, its cause named
from its exit status and its log (`build_result`, `classify`: time-out, OOM kill, CUDA error, CUDA out of memory,
Python error with the file:line it was raised at, a signal); and the stand-ins that act out each way a build ends,
for the CPU test of the whole script (`simulate`, gpu_check.sh --simulate)."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def append_row(path: str, row: dict) -> None:
    """One JSON line appended to `path` in one write; a last line left unfinished (a process killed mid-write)
    is ended first, so that the new row is a line of its own."""
    line = json.dumps(row, ensure_ascii=True) + "\n"  # escapes control characters and any non-ASCII text
    if os.path.isfile(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
    with open(path, "a") as f:
        f.write(line)


def read_rows(path: str, start: int = 0):
    """([row dict per readable line from line `start` on], how many lines were unreadable): a half-written or
    garbled line is counted, never raised."""
    rows, bad = [], 0
    if not os.path.isfile(path):
        return rows, bad
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    for line in lines[start:]:
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(r, dict) and isinstance(r.get("model"), str):
            rows.append(r)
        else:
            bad += 1
    return rows, bad


def latest_rows(rows) -> dict:
    """model -> its last full row, with the annotations written after it (gpu_check.sh's exit status of a build that
    wrote its row and then ended badly) merged in."""
    out = {}
    for r in rows:
        if r.get("annotate"):
            if r["model"] in out:
                out[r["model"]].update({k: v for k, v in r.items() if k not in ("model", "annotate")})
        else:
            out[r["model"]] = dict(r)
    return out


# ---- why a build ended without its row, from its exit status and its log (stdout and stderr, 2>&1)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIMEOUT_SENT = re.compile(r"timeout: sending signal (\w+)")  # GNU timeout --verbose, one line per signal sent
TIMEOUT_LINE = re.compile(r"timeout: sending signal \w+ to command [^\n]*\n?")  # (glued to a bar's line, maybe)
CUDA = re.compile(r"(\w+(Error|Exception): )?(CUDA error|CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS|"
                  r"CUDNN_STATUS|cuDNN error|NCCL error|device-side assert)")
CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
STARTUP = re.compile(r"startup: load ([\d.]+) s, move ([\d.]+) s, embeddings ([\d.]+) s \((\d+) prompts\), "
                     r"first sampling step ([\d.]+) s")


def screen_lines(text: str):
    """What a terminal shows of `text`: each line's last carriage-return segment (a progress bar redraws its line with
    "\r"), escape sequences dropped, blank lines and timeout's own messages left out."""
    out = []
    for line in ANSI.sub("", TIMEOUT_LINE.sub("\n", text)).split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        if parts:
            out.append(parts[-1].strip())
    return out


def _short(s: str, n: int = 240) -> str:
    """At most n characters (never a split UTF-8 character: this is text, not bytes)."""
    return s if len(s) <= n else s[:n - 3] + "..."


def _path(p: str) -> str:
    """A traceback's file, relative to the checkout or to site-packages."""
    if p.startswith(ROOT + os.sep):
        return os.path.relpath(p, ROOT)
    return p.split("site-packages" + os.sep, 1)[-1]


def traceback_summary(text: str):
    """(exception line, "file:line in function: source") of the last Python traceback in `text`, or None."""
    head = "Traceback (most recent call last):"
    lines = [line.split("\r")[-1].rstrip() for line in ANSI.sub("", TIMEOUT_LINE.sub("\n", text)).split("\n")]
    lines = [line[line.index(head):] if head in line else line for line in lines]  # (a bar's line it was glued to)
    starts = [i for i, line in enumerate(lines) if line.startswith(head)]
    if not starts:
        return None
    where, exc = "", ""
    frame = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
    block = lines[starts[-1] + 1:]
    for i, line in enumerate(block):
        m = frame.match(line)
        if m:
            source = block[i + 1].strip() if i + 1 < len(block) and not frame.match(block[i + 1]) else ""
            where = f"{_path(m.group(1))}:{m.group(2)} in {m.group(3)}" + (f": {source}" if source else "")
        elif line and not line[0].isspace():
            exc = line.strip()
            break
    return exc or "(no exception line)", where


def parse_startup(text: str):
    """The `startup:` line's phases (trainer/run/startup.py) from a log, or None (a build killed before its first
    sampling step)."""
    found = [STARTUP.search(line) for line in screen_lines(text)]
    found = [m for m in found if m]
    if not found:
        return None
    load, move, emb, prompts, first = found[-1].groups()
    st = {"load_s": float(load), "move_s": float(move), "embeddings_s": float(emb), "embedding_prompts": int(prompts),
          "first_step_s": float(first)}
    st["total_s"] = st["load_s"] + st["move_s"] + st["embeddings_s"] + st["first_step_s"]  # disjoint phases
    return st


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def classify(rc: int, text: str, limit: float, elapsed: float, kill_after: float = 5) -> tuple:
    """(cause, detail) of a build process that ended with exit status `rc` (timeout's: 124 when it stopped the build
    with SIGTERM, 128 + 9 when it had to kill it; the shell's 128 + n for a signal) after `elapsed` of its `limit`
    seconds, from its log `text` (with timeout --verbose's lines). Causes: "time-out", "OOM kill" (SIGKILL from
    outside before the time-out: the host's OOM killer), "CUDA error", "CUDA out of memory", "Python error" (the
    exception and the file:line it was raised at), "killed by SIGxxx", "exit N"."""
    shown = screen_lines(text)
    last = _short(shown[-1]) if shown else "(no output)"
    sent = TIMEOUT_SENT.findall(text)
    if sent or rc == 124 or (rc == 137 and elapsed >= limit):
        how = (f"killed {kill_after:g} s after SIGTERM, which it did not obey (stuck in a CUDA call or a C extension)"
               if "KILL" in sent or rc == 137 else "stopped by SIGTERM")
        return "time-out", f"no row within its {limit:g} s time-out, {how}; last output: {last}"
    if rc == 137:
        return "OOM kill", (f"SIGKILL (exit 137) at {elapsed:.0f} s, before its {limit:g} s time-out: the host's OOM "
                            f"killer (dmesg says) or another kill; last output: {last}")
    tb = traceback_summary(text)
    hits = [line[CUDA.search(line).start():] for line in shown if CUDA.search(line)]
    if tb and CUDA.search(tb[0]):
        hits.insert(0, tb[0])  # the exception's own line first
    if hits:
        cause = "CUDA out of memory" if any(CUDA_OOM.search(h) for h in hits) else "CUDA error"
        return cause, _short(hits[0] + (f" (at {tb[1]})" if tb and tb[1] else ""), 400)
    if tb:
        return "Python error", _short(f"{tb[0]} (at {tb[1]})" if tb[1] else tb[0], 400)
    if rc > 128:
        return f"killed by {_signal_name(rc - 128)}", f"exit {rc}; last output: {last}"
    return f"exit {rc}", f"last output: {last}"


def row_cause(row: dict) -> tuple:
    """(cause, detail) of a row with an "error": the cause gpu_check.sh named, else the one its error and traceback
    (measure caught them in the build's process) say: CUDA error / CUDA out of memory / Python error ("error" for
    a row with neither, as the first GPU check's shell wrote them)."""
    if row.get("cause"):
        return row["cause"], row.get("error", "")
    err = str(row.get("error", ""))
    tb = traceback_summary(row.get("traceback", "")) if row.get("traceback") else None
    where = f" (at {tb[1]})" if tb and tb[1] else ""
    if CUDA.search(err):
        return ("CUDA out of memory" if CUDA_OOM.search(err) else "CUDA error"), err + where
    return ("Python error" if tb else "error"), err + where


def build_result(jsonl: str, model: str, rc: int, log: str, limit: float, elapsed: float, since: int,
                 kill_after: float = 5, extra=None, forced=None) -> str:
    """After one build's process (gpu_check.sh): nothing to write when it appended its row (rows from line `since`
    on) and exited 0; an annotation of its exit when it wrote its row and then failed; else a row with the cause
    (classify, or `forced`'s (cause, detail): "interrupted", "not run") and, when its log has one, the `startup:`
    line's phases. Returns the one-line verdict it prints."""
    rows, _ = read_rows(jsonl, since)
    mine = [r for r in rows if r["model"] == model and not r.get("annotate")]
    text = ""
    if os.path.isfile(log):
        with open(log, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    if mine and not forced:
        row, note = mine[-1], {}
        if not row.get("startup") and parse_startup(text):  # (a point that failed after its first step)
            note["startup"] = parse_startup(text)
        verdict = f"{model}: row written" + (f", {row_cause(row)[0]}" if "error" in row else "")
        if rc not in (0, 1) or (rc == 1 and "error" not in row):  # (bench_gpu.py exits 1 after an error row)
            cause, detail = classify(rc, text, limit, elapsed, kill_after)
            note["exit_after_row"] = f"{cause}: {detail}"
            verdict += f", then {cause}"
        if note:
            append_row(jsonl, dict(note, model=model, annotate=True))
        return verdict
    cause, detail = forced or classify(rc, text, limit, elapsed, kill_after)
    if forced and text:
        shown = screen_lines(text)
        detail += f"; last output: {_short(shown[-1])}" if shown else ""
    row = dict(extra or {}, model=model, error=detail, cause=cause, exit=rc, elapsed_s=round(elapsed, 1),
               time_out_s=limit, log=os.path.basename(log), date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    st = parse_startup(text)
    if st:
        row["startup"] = st
    append_row(jsonl, row)
    return f"{model}: FAILED ({cause}): {_short(detail, 200)}"


# ---- stand-ins for the CPU test of gpu_check.sh: one process per build that ends as a real one can

SIMULATED = {"sd15-random": "ok", "sd35-medium-random": "hang", "sdxl-random": "stuck", "wan21-1.3b-random": "oom",
             "recam-1.3b-random": "python", "flux-dev-random": "cuda"}
SIMULATED_KINDS = ("ok", "hang", "stuck", "oom", "python", "cuda")


def simulated_kind(model: str, environ=None) -> str:
    """How `model`'s stand-in ends: GPU_CHECK_SIMULATE="model=kind,..." where it names the model, else SIMULATED's."""
    kinds = dict(SIMULATED)
    for item in filter(None, (environ if environ is not None else os.environ).get("GPU_CHECK_SIMULATE", "").split(",")):
        name, _, kind = item.partition("=")
        kinds[name.strip()] = kind.strip()
    return kinds.get(model, "ok")


def simulated_process(args, models) -> int:
    """bench_gpu.py --simulate: with --dry-run the counts file of `models`, else --model's stand-in (its exit status;
    a kind that is not one of SIMULATED_KINDS: one line, exit 2)."""
    if args.dry_run:
        with open(args.counts_out or os.devnull, "w") as f:
            json.dump(simulated_counts(models), f, indent=1)
        return 0
    kind = simulated_kind(args.model)
    if kind not in SIMULATED_KINDS:
        print(f"error: GPU_CHECK_SIMULATE: {args.model}={kind}; choose from {', '.join(SIMULATED_KINDS)}",
              file=sys.stderr)
        return 2
    return simulate(kind, args.model, args.out, args)


def simulated_counts(models) -> dict:
    """counts.json as gpu_check.sh's meta-device process writes it, with made-up plans and FLOPs."""
    return {m: {"plan_gib": 10.0 + i, "gradient_checkpointing": False, "denoiser_params": 1e9,
                "flops_fwd_row": 1e12, "flops_train_row": 2.5e12} for i, m in enumerate(models)}


def _progress(epoch: int, n: int, of: int) -> str:
    bar = "█" * (10 * n // of) + " " * (10 - 10 * n // of)  # multi-byte UTF-8, as tqdm draws it
    return f"\repoch {epoch}: sampling — prompts «café»: {100 * n // of:3d}%|{bar}| {n}/{of} [00:0{n}<00:0{of - n}]"


def _nested_failure():
    raise ValueError("sample.batch_size 3 does not divide the epoch — «é» in the message")


def simulate(kind: str, model: str, out: str, args=None) -> int:
    """Act out one way a build ends (gpu_check.sh --simulate), after a run's own output (notes, the `startup:` line,
    a progress bar redrawn with "\r" in multi-byte UTF-8): "ok" appends a complete measured row; "hang" sleeps past its
    time-out; "stuck" also ignores SIGTERM (timeout must kill it); "oom" is SIGKILLed from outside mid-bar (exit 137,
    as the host's OOM killer ends a process); "python" raises an uncaught exception (no row); "cuda" fails in
    measure's trainer with a sticky CUDA error, which empty_cache then raises again, writes its error row and
    aborts (a CUDA teardown can): measure's real path with `args` (bench_gpu.py's) on "cuda" and a config stand-in."""
    os.makedirs(out, exist_ok=True)
    err = sys.stderr
    print(f"note: simulated build {model} ({kind})", flush=True)
    print("startup: load 1.2 s, move 0.3 s, embeddings 0.4 s (9 prompts), first sampling step 0.5 s", flush=True)
    for n in range(3):
        err.write(_progress(0, n, 5))
        err.flush()
    if kind == "ok":
        err.write(_progress(0, 5, 5) + "\n")
        tr = {"sampling_s": 2.0, "training_s": 4.0, "epoch_s": 6.0, "rescore_s": 1.0, "samples": 8,
              "data_s": 0.5, "reward_wait_s": 0.2,
              "rows": {"sampling": 160, "train_grad": 80, "rescore": 80},
              "epochs_s": [{"sampling_s": 3.0, "training_s": 5.0, "epoch_s": 8.0, "rescore_s": 1.2},
                           {"sampling_s": 2.0, "training_s": 4.0, "epoch_s": 6.0, "rescore_s": 1.0}],
              "cuda_peak_sampling_mb": 9 * 1024, "cuda_peak_training_mb": 9.5 * 1024,
              "cuda_reserved_sampling_mb": 10 * 1024, "cuda_reserved_training_mb": 11 * 1024,
              "sampling_rows": 160, "train_rows": 80, "reference_rows": 0, "train_sample_steps": 80}
        row = {"model": model, "batch_size": 8, "cfg": True, "mode": "lora", "switch": "none", "resolution": 512,
               "num_steps": 10, "epoch_s": 6.0, "samples_per_s": 4.0, "train_steps_per_s": 20.0,
               "peak_mem_mb": 9.5 * 1024, "reserved_mem_mb": 11 * 1024, "onpolicy_ratio_max_dev": 0.0,
               "onpolicy_tol": 5e-5, "sampler_gap_max": 4.8e-3, "sampler_gap_mean": 2.9e-4,
               "startup": {"total_s": 2.4, "load_s": 1.2, "move_s": 0.3, "embeddings_s": 0.4, "first_step_s": 0.5},
               "trainer": tr, "gpu": "simulated GPU", "torch": "simulated", "date": "simulated"}
        append_row(os.path.join(out, "bench_gpu.jsonl"), row)
        return 0
    if kind in ("hang", "stuck"):
        if kind == "stuck":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
        return 0
    if kind == "oom":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "python":
        _nested_failure()
    if kind == "cuda":
        import torch

        from benchmarks import bench_gpu_point

        def sticky(*_a, **_k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                               "asynchronously reported at some other API call")

        bench_gpu_point.trainer_epoch = sticky  # the trainer's first backward, as FLUX's was
        torch.cuda.empty_cache = sticky  # and every CUDA call after it
        from types import SimpleNamespace as NS

        args.device, args.count = "cuda", False
        config = NS(pretrained=NS(resolution=512), sample=NS(num_steps=6), gradient_checkpointing=True,
                    mixed_precision="bf16", train=NS(clip_range=1e-4))
        row = bench_gpu_point.measure(args, config, model, 8, False, "lora", "none")
        append_row(os.path.join(out, "bench_gpu.jsonl"), dict(row, gpu="simulated GPU", torch="simulated",
                                                              date="simulated"))
        sys.stdout.flush()
        os.abort()
    raise ValueError(f"unknown simulated kind {kind!r}")



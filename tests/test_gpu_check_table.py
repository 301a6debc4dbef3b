"""scripts/gpu_check.sh always ends with its table (issue 61): each way a build can end, acted out on the CPU by
`--simulate`'s stand-in builds (benchmarks/gpu_check_rows.simulate), still gives the whole table with the cause named;
rows are written and read by Python (a progress bar's "\r", multi-byte UTF-8, a half-written line); a build's cause
from its exit status and log; a sticky CUDA error in the point's cleanup does not lose its error row; --only reruns
one build and keeps the others' rows."""
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import pytest
from helpers import python_for_shell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_gpu_point  # noqa: E402
from benchmarks.gpu_check_rows import (append_row, build_result, classify, parse_startup, read_rows,  # noqa: E402
                                       traceback_summary)

ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
BUILDS = ["sd15-random", "sd35-medium-random", "sdxl-random", "wan21-1.3b-random", "recam-1.3b-random",
          "flux-dev-random"]


def gpu_check(*args, out, **env):
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(ENV, OUT=str(out), **python_for_shell(dict(ENV, **env)), **env))


def status(line: str) -> str:
    """A table line's last cell (its status), "\\|" unescaped."""
    return re.split(r"(?<!\\) \| ", line.strip().strip("|").strip())[-1].replace("\\|", "|")


def test_every_simulated_failure_still_prints_the_whole_table(tmp_path):
    """gpu_check.sh --simulate, one stand-in per build (cheapest first): sd15 finishes; SD3.5 hangs past its
    3 s time-out (SIGTERM); SDXL ignores SIGTERM and is killed 1 s later (exit 137, still a time-out); Wan is
    SIGKILLed mid-bar from outside (exit 137 before its time-out: the host's OOM killer); ReCamMaster raises an
    uncaught Python error; FLUX fails in measure with a sticky CUDA error that empty_cache raises again, writes its
    row and aborts. Every log has a progress bar redrawn with "\\r" in multi-byte UTF-8. The table has all six rows in
    order with the right causes, the script exits 1 naming the five, and every line it wrote is JSON."""
    out = tmp_path / "out"
    p = gpu_check("--simulate", out=out)
    assert p.returncode == 1, (p.stdout[-4000:], p.stderr[-3000:])
    table = (out / "gpu_check.md").read_text().splitlines()
    assert table[0] == "simulated GPU, torch simulated, simulated"
    rows = table[3:9]
    assert [line.split(" | ")[0].lstrip("| ") for line in rows] == BUILDS
    ok, hang, stuck, oom, python, cuda = (status(line) for line in rows)
    assert ok == "ok"
    # the stand-in's row: 160 / 80 / 80 rows at 1 / 2.5 / 1 TFLOPs (counts.json) in 2 s and 4 s (1 s of rescore):
    # MFU 1e12 x 160 / 2 / 989e12 = 0.081; (2.5e12 x 80 + 1e12 x 80) / 4 / 989e12 = 0.071; update 2e14 / 3 s = 0.067
    assert rows[0] == ("| sd15-random | 8 x 10 | 2.4 (1.2 / 0.3 / 0.4 / 0.5) | 8.0 / 6.0 | "
                       "2.0 (9.0 / 10.0; data 0.5, reward wait 0.2) | 4.0 (9.5 / 11.0) | 1.0 (25 %) | 4.00 | "
                       "0.081 / 0.071 (0.067) | 9.5 / 11.0 / 10.0 | "
                       "0.0e+00 (5e-05) | 4.8e-03 / 2.9e-04 | ok |")
    bar = "epoch 0: sampling — prompts «café»:  40%|████      | 2/5 [00:02<00:03]"
    assert hang == f"FAILED (time-out): no row within its 3 s time-out, stopped by SIGTERM; last output: {bar}"
    assert stuck.startswith("FAILED (time-out): no row within its 3 s time-out, killed 1 s after SIGTERM, which it "
                            "did not obey")
    assert re.fullmatch(r"FAILED \(OOM kill\): SIGKILL \(exit 137\) at \d+ s, before its 60 s time-out: the host's "
                        r"OOM killer \(dmesg says\) or another kill; last output: " + re.escape(bar), oom), oom
    assert python.startswith("FAILED (Python error): ValueError: sample.batch_size 3 does not divide the epoch — «é» "
                             "in the message (at benchmarks/gpu_check_rows.py:")
    assert " in _nested_failure: raise ValueError(" in python
    assert cuda.startswith("FAILED (CUDA error): RuntimeError: CUDA error: an illegal memory access was encountered "
                           "(at benchmarks/gpu_check_rows.py:")
    assert cuda.endswith("; then killed by SIGABRT: exit 134; last output: " + bar)  # it wrote its row, then aborted
    # the start-up phases from the failed builds' logs (their `startup:` lines), the plans from counts.json
    assert all("| 2.4 (1.2 / 0.3 / 0.4 / 0.5) |" in line for line in rows)
    assert [f"/ {10.0 + i:.1f} |" in line for i, line in enumerate(rows)] == [True] * 6
    assert table[9] == ("gpu check: 5 of 6 builds failed or off-policy: sd35-medium-random, sdxl-random, "
                        "wan21-1.3b-random, recam-1.3b-random, flux-dev-random")
    assert p.stdout.rstrip().endswith(f"output in {out}")
    # every line JSON (Python wrote them: escaped, never split mid-character), one row per build and FLUX's
    # annotation of its exit after its row; the logs are the builds' own bytes, "\r" and UTF-8 intact
    lines = (out / "bench_gpu.jsonl").read_text().splitlines()
    written = [json.loads(line) for line in lines]
    assert [r["model"] for r in written if not r.get("annotate")] == BUILDS
    assert [r["model"] for r in written if r.get("annotate")] == ["flux-dev-random"]
    log = (out / "wan21-1.3b-random.log").read_bytes().decode("utf-8")
    assert "\r" in log and "«café»" in log
    assert re.search(r"^\[\d+ s\] sdxl-random: starting, time-out 3 s$", p.stdout, re.M), p.stdout[-3000:]


def test_only_reruns_one_build_and_keeps_the_other_rows(tmp_path):
    """--only NAME runs that build alone; the rows of the others already in bench_gpu.jsonl stay and are shown,
    marked as an earlier run's; the exit status is the rerun build's."""
    out = tmp_path / "out"
    out.mkdir()
    append_row(str(out / "bench_gpu.jsonl"), {"model": "flux-dev-random", "error": "x", "cause": "time-out",
                                              "date": "2026-11-27"})
    append_row(str(out / "bench_gpu.jsonl"), {"model": "sd15-random", "error": "y", "cause": "OOM kill"})
    p = gpu_check("--simulate", "--only", "sd15-random", out=out)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    table = (out / "gpu_check.md").read_text().splitlines()
    assert [line.split(" | ")[0].lstrip("| ") for line in table[3:]] == ["sd15-random", "flux-dev-random"]
    assert status(table[3]) == "ok"  # the rerun's row, not the earlier OOM kill
    assert status(table[4]) == "FAILED (time-out): x (earlier run: 2026-11-27)"
    assert "starting" not in p.stdout.split("sd15-random: exit")[1]  # no other build ran


def test_a_signal_to_the_script_stops_the_build_and_prints_the_table(tmp_path):
    """SIGTERM to gpu_check.sh (an outer time-out) while a build hangs: the build is stopped, its row says
    "interrupted", the table prints and the script exits 1."""
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--simulate", "--only", "sd15-random"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(ENV, OUT=str(out), **python_for_shell(ENV), GPU_CHECK_SIMULATE="sd15-random=stuck"))
    for line in iter(proc.stdout.readline, ""):  # the build has started: stop the script
        if "sd15-random: starting" in line:
            time.sleep(3)  # the script prints the line before it starts the build: let the build be running
            proc.terminate()
            break
    rest = proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode == 1, rest
    table = (out / "gpu_check.md").read_text().splitlines()
    assert status(table[3]).startswith("FAILED (interrupted): gpu_check.sh was stopped by a signal while this build "
                                       "ran")
    assert "gpu check: stopped by a signal" in rest


GLUED = ("epoch 0: sampling:  50%|█████     | 1/2 [00:40<00:40]\rtraining: 3/8\rTraceback (most recent call last):\n"
         '  File "/x/site-packages/torch/nn/modules/module.py", line 1786, in _call_impl\n'
         "    return forward_call(*args, **kwargs)\n"
         "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
         f'  File "{ROOT}/ddpo_grpo/models/wan.py", line 212, in forward\n'
         "    x = attn(q, k, v)\n"
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
         "79 GiB\n")


@pytest.mark.parametrize("rc, text, limit, elapsed, cause, detail", [
    (1, GLUED, 85, 40, "CUDA out of memory",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB "
     "(at ddpo_grpo/models/wan.py:212 in forward: x = attn(q, k, v))"),
    (124, "loading\rtimeout: sending signal TERM to command ‘python3’\n", 85, 85, "time-out",
     "no row within its 85 s time-out, stopped by SIGTERM; last output: loading"),
    (137, "x\ntimeout: sending signal TERM to command ‘python3’\n"
          "timeout: sending signal KILL to command ‘python3’\n",
     85, 90, "time-out", "no row within its 85 s time-out, killed 5 s after SIGTERM, which it did not obey (stuck in "
     "a CUDA call or a C extension); last output: x"),
    (137, "", 85, 12.4, "OOM kill", "SIGKILL (exit 137) at 12 s, before its 85 s time-out: the host's OOM killer "
     "(dmesg says) or another kill; last output: (no output)"),
    (139, "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
          "  <no Python frame>\n",
     85, 3, "killed by SIGSEGV", "exit 139; last output: <no Python frame>"),
    (2, "error: --model 'x': choose one of ...\n", 85, 1, "exit 2",
     "last output: error: --model 'x': choose one of ..."),
])
def test_a_builds_cause_from_its_exit_and_log(rc, text, limit, elapsed, cause, detail):
    assert classify(rc, text, limit, elapsed) == (cause, detail)


def test_the_last_traceback_and_the_startup_line_are_found_in_a_bar_garbled_log():
    text = ("startup: load 25.6 s, move 1.2 s, embeddings 1.0 s (9 prompts), first sampling step 1.5 s\n"
            "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    g()\nKeyError: 'first'\n\n"
            "During handling of the above exception, another exception occurred:\n\n" + GLUED)
    exc, where = traceback_summary(text)
    assert exc.startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert where.startswith("ddpo_grpo/models/wan.py:212")
    st = parse_startup(text)
    assert st == {"load_s": 25.6, "move_s": 1.2, "embeddings_s": 1.0, "embedding_prompts": 9, "first_step_s": 1.5,
                  "total_s": pytest.approx(29.3)}


def test_rows_survive_a_half_written_line_and_a_carriage_return(tmp_path):
    """append_row ends an unfinished last line before its own; read_rows skips what is not JSON; a row written by a
    failed build (build_result) carries the cause, the batch and the startup phases of its log."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"model": "sd15-random", "epoch_s": 1.0}\n{"model": "sdxl-ran')  # killed mid-write
    log = tmp_path / "wan.log"
    log.write_bytes(("startup: load 1.0 s, move 0.0 s, embeddings 0.5 s (3 prompts), first sampling step 2.0 s\n"
                     "epoch 0: training:  25%|██▌       | 1/4\r").encode())
    verdict = build_result(str(path), "wan21-1.3b-random", 137, str(log), 85, 30.2, 0, extra={"batch_size": 2})
    assert verdict.startswith("wan21-1.3b-random: FAILED (OOM kill): SIGKILL (exit 137) at 30 s")
    rows, bad = read_rows(str(path))
    assert bad == 1 and [r["model"] for r in rows] == ["sd15-random", "wan21-1.3b-random"]
    wan = rows[1]
    assert wan["cause"] == "OOM kill" and wan["batch_size"] == 2 and wan["exit"] == 137
    assert wan["error"].endswith("last output: epoch 0: training:  25%|██▌       | 1/4")
    assert wan["startup"]["total_s"] == pytest.approx(3.5)
    # the build that wrote its row and exited 0: nothing added
    assert build_result(str(path), "sd15-random", 0, str(tmp_path / "none.log"), 85, 3, 0) == "sd15-random: row written"
    assert len(path.read_text().splitlines()) == 3


def test_a_sticky_cuda_error_in_the_cleanup_keeps_the_points_error_row(monkeypatch):
    """measure's `finally` empties CUDA's cache; after a sticky CUDA error (an illegal memory access) that call raises
    the error again. The point's row (its error, its traceback) is still returned, the cleanup's error beside it."""
    import torch

    def sticky(*_a, **_k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench_gpu_point, "trainer_epoch", sticky)
    monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
    args = NS(device="cuda", count=False, gpu_check=True, all_models=False, peak_tflops=989.0)
    config = NS(pretrained=NS(resolution=512), sample=NS(num_steps=6), gradient_checkpointing=True,
                mixed_precision="bf16", train=NS(clip_range=1e-4))
    row = bench_gpu_point.measure(args, config, "flux-dev-random", 8, False, "lora", "none")
    assert row["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert row["release_error"] == row["error"] and "in sticky" in row["traceback"]
    assert row["onpolicy_tol"] > 0 and row["batch_size"] == 8


def test_mfu_counts_flops_and_seconds_on_the_same_footing():
    """By hand: 160 sampling rows of 1 TFLOP in 2 s; training 80 update rows of 2.5 TFLOPs, 80 rescore rows and 8
    reference rows of 1 TFLOP in 4 s, 1 s of it the rescore; peak 100 TFLOP/s."""
    row = {"flops_fwd_row": 1e12, "flops_train_row": 2.5e12,
           "trainer": {"sampling_s": 2.0, "training_s": 4.0, "rescore_s": 1.0,
                       "rows": {"sampling": 160, "train_grad": 80, "rescore": 80, "train_nograd": 8}}}
    m = bench_gpu_point.mfu(row, 100.0)
    assert m["mfu_sampling"] == pytest.approx(160e12 / 2 / 100e12)  # 0.8
    assert m["mfu_training"] == pytest.approx((200e12 + 80e12 + 8e12) / 4 / 100e12)  # 0.72
    assert m["mfu_update"] == pytest.approx((200e12 + 8e12) / 3 / 100e12)  # 0.6933


def test_a_missing_library_is_one_line_before_any_build(tmp_path):
    """The image lacks a library the check needs (diffusers, say): one line naming it and where the wheels are, exit 2,
    from the one interpreter that imports them (and prints their versions on success), before any build or count."""
    fake = tmp_path / "path" / "diffusers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'diffusers'\")\n")
    out = tmp_path / "out"
    out.mkdir()
    # the real interpreter (a served run has diffusers imported already), the fake package first on its path
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(ENV, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(fake.parent)))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == ("error: ModuleNotFoundError: No module named 'diffusers'; install the "
                                                 "wheels first (docs/performance.md, GPU check)")
    assert "torch " not in p.stdout and not (out / "counts.json").exists()


def test_the_sampling_cell_shows_its_data_reads_and_reward_wait_when_a_row_has_them():
    """A row that timed the sampling phase's condition reads and reward wait (bench_gpu_point.trainer_epoch) shows them
    in the sampling cell; a row written before they were timed keeps the cell it had."""
    from benchmarks.bench_gpu_tables import _cells

    tr = {"sampling_s": 7.0, "training_s": 6.3, "cuda_peak_sampling_mb": 20.7 * 1024,
          "cuda_reserved_sampling_mb": 23.1 * 1024}
    row = {"model": "recam-1.3b-random", "trainer": dict(tr, data_s=4.25, reward_wait_s=0.31)}
    assert _cells(row, {}, 989.0)[0][3] == "7.0 (20.7 / 23.1; data 4.2, reward wait 0.3)"
    assert _cells({"model": "recam-1.3b-random", "trainer": tr}, {}, 989.0)[0][3] == "7.0 (20.7 / 23.1)"

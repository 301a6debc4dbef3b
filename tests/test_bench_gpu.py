"""scripts/bench_gpu.py without a GPU: the plan of a dry run, and one-line refusals (exit 2). CUDA is hidden from
the child so that the refusal is tested on GPU machines too. (A CPU run of one point takes ~2 min: two SD-sized
model builds and four epochs; it was run by hand, see the README.)"""
import os
import sys

from helpers import run_side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def bench(*arg_lists):
    """scripts/bench_gpu.py once per argument list, side by side (independent single-threaded processes)."""
    return run_side_by_side([dict(args=[sys.executable, "scripts/bench_gpu.py", *args], cwd=ROOT, env=ENV)
                             for args in arg_lists], timeout=300)


def test_dry_run_plans_the_grid_and_validates_every_config():
    p, p2 = bench(["--dry-run"], ["--dry-run", "--batch-sizes", "8", "--cfg", "on", "--modes", "full", "--switches", "all"])
    assert p.returncode == 0, p.stderr[-2000:]
    # 2 modes x 3 batch sizes x CFG off/on, no switches
    assert "plan: 12 points on cpu at 512 px: lora/B4/cfg-off/none, lora/B4/cfg-on/none, lora/B8/cfg-off/none" in p.stdout
    assert "full/B16/cfg-on/none" in p.stdout
    p = p2
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().endswith("full/B8/cfg-on/none, full/B8/cfg-on/attention_math, full/B8/cfg-on/channels_last, "
                                     "full/B8/cfg-on/grad_ckpt, full/B8/cfg-on/stack4, full/B8/cfg-on/compile")


def test_refusals_are_one_line_exit_2():
    cases = [
        ((), "error: no CUDA device: this benchmark measures the GPU path"),
        (("--allow-cpu",), "error: --allow-cpu with --resolution 512: on CPU use <= 128"),
        (("--dry-run", "--switches", "fast"), "error: --switches: unknown fast"),
        (("--dry-run", "--modes", "qlora"), "error: --modes 'qlora': choose from lora, full"),
        (("--dry-run", "--resolution", "100"), "error: B=4 cfg=False lora none: pretrained.resolution: resolution 100"),
    ]
    for (args, start), p in zip(cases, bench(*(args for args, _ in cases))):
        assert p.returncode == 2, (args, p.stderr[-2000:])
        assert p.stderr.strip().splitlines()[-1].startswith(start), (args, p.stderr[-500:])
        assert "Traceback" not in p.stderr

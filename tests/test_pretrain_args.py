"""benchmarks/pretrain_recam_args.py: the pretraining script's options and its refusals. Every bad combination is
refused by check_args (in-process, one ConfigError each), and the script turns a refusal into one line on stderr and
exit 2 before the pool or a model is built (two runs of the script itself)."""
import os
import subprocess
import sys

import pytest

from ddpo_grpo.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BAD = [(["--world", "room3d", "--kinds", "pan,spin"], "--kinds must name some of"),
       (["--kinds", "pan"], "--kinds is a room3d option"),
       (["--mislabel", "opposite"], "--mislabel is a room3d option"),
       (["--world", "room3d", "--mislabel-fraction", "2"], "must be in [0, 1]"),
       (["--world", "room3d", "--mislabel-by", "noise"], "give --mislabel opposite"),
       (["--label-gain", "2"], "a room3d option"),
       (["--world", "room3d", "--label-gain", "-1"], "> 0"),
       (["--world", "room3d", "--mislabel", "opposite", "--label-gain", "2"], "with --mislabel none"),
       (["--world", "room3d", "--noise-offset", "1"], "--mislabel-by noise or"),
       (["--noise-offset", "1", "--mislabel-by", "noise"], "a room3d diagnostic"),
       (["--world", "room3d", "--mislabel", "opposite", "--mislabel-kinds", "pan"],
        "--mislabel-kinds: give --mislabel opposite --mislabel-by noise"),
       (["--world", "room3d", "--mislabel", "opposite", "--mislabel-by", "noise", "--mislabel-kinds", "pan,spin"],
        "--mislabel-kinds must name some of"),
       (["--world", "room3d", "--train-shift", "0"], "--train-shift must be > 0"),
       (["--vae-from", "a", "--vae-init", "b"], "give one of them"),
       (["--world", "room3d", "--frames", "8"], "1 + 4k")]


@pytest.mark.parametrize("argv, says", BAD)
def test_check_args_refuses_each_bad_combination_with_its_reason(argv, says):
    """A bad --kinds (unknown kind; on the 2-D world), mislabel (on the 2-D world; a fraction outside [0, 1]; by
    noise without the opposite camera; kinds without the noise tie), label gain (the 2-D world, not > 0, beside
    --mislabel opposite), noise offset (no noise reading to tie it to; the 2-D world), train shift, both VAE sources,
    or a frame count the world cannot take: one ConfigError naming the reason, on one line."""
    from benchmarks.pretrain_recam_args import check_args, parse_args

    with pytest.raises(ConfigError) as e:
        check_args(parse_args([*argv, "--out", "/nonexistent/x"]))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv, kinds, mislabel_kinds", [
    ([], (), ()),
    (["--world", "room3d", "--kinds", "arc,pan"], ("pan", "arc"), ()),
    (["--world", "room3d", "--mislabel", "opposite", "--mislabel-by", "noise", "--mislabel-kinds", "tilt,dolly"],
     (), ("tilt", "dolly"))])
def test_check_args_accepts_good_options_and_returns_the_kinds(argv, kinds, mislabel_kinds):
    """Good options pass, and --kinds / --mislabel-kinds come back parsed: tuples of exactly the kinds named."""
    from benchmarks.pretrain_recam_args import check_args, parse_args

    got = check_args(parse_args(argv))
    assert all(isinstance(k, tuple) for k in got)
    assert sorted(got[0]) == sorted(kinds) and sorted(got[1]) == sorted(mislabel_kinds)


def test_the_script_turns_a_refusal_into_one_line_and_exit_2():
    """The script's own handling: a refusal from check_args is one line on stderr and exit 2."""
    proc = subprocess.run([sys.executable, "benchmarks/pretrain_recam_video.py", "--world", "room3d",
                           "--mislabel-fraction", "2", "--out", "/nonexistent/x"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("pretrain_recam_video: error: --mislabel-fraction must be in [0, 1]"), proc.stderr


def test_pretraining_refuses_a_cuda_device_it_does_not_have():
    """--device cuda where torch has none: one line, exit 2, before the pool or a model is built."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "benchmarks/pretrain_recam_video.py", "--device", "cuda",
                           "--world", "room3d", "--out", "/nonexistent/x"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "this torch sees no CUDA device" in proc.stderr

"""Every config/accelerate/*.yaml on a CPU machine with 2 processes (issue 30): launched as its own comment says, it
trains with 2 processes in fp32, or it stops with one line saying what to use instead; launched with accelerate's
--cpu (which starts ONE process whatever --num_processes says) it stops with one line.

Real launches: every YAML with `--num_processes 2 --cpu` (the refusal comes before anything loads: ~4 s each, two
side by side), and ddp.yaml's documented CPU launch for one tiny epoch. The other YAMLs' documented CPU launches go
through accelerate's own launch code in process (argument parsing, the launcher it picks, the environment it hands
the trainer) and the trainer's check on that environment."""
import glob
import os
import re
import subprocess
import sys
import types

import pytest
from accelerate.commands.launch import _validate_launch_command, deepspeed_launcher, launch_command_parser
from accelerate.utils import is_deepspeed_available
from accelerate.utils.launch import (prepare_deepspeed_cmd_env, prepare_multi_gpu_env,
                                     prepare_simple_launcher_cmd_env)
from helpers import cpu_env, run_side_by_side, selected_params

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.trainer.run import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "config", "accelerate", "*.yaml")))
TRAINS_ON_CPU = {"ddp.yaml", "ddp_multinode.yaml", "npu8.yaml"}  # their comment gives a CPU launch
GPU_ONLY = {"fsdp2_hybrid.yaml": "parallelism_config (FSDP2 hybrid shard",
            "deepspeed_zero2.yaml": "a DeepSpeed launch", "deepspeed_zero3.yaml": "a DeepSpeed launch"}
# Refused once the Accelerator exists (scale.check_engine_applied): accelerate would run it as plain DDP on CPU.
GPU_ONLY_AFTER_START = {"fsdp2.yaml": "error: an FSDP launch (config/accelerate/fsdp2.yaml) but accelerate"}
LONE = "error: accelerate launch started 1 process of a multi-process launch"
# Launcher variables a developer's shell may hold: each launch here starts from none of them.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_SIZE",
               "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP",
               "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG")


def _env(**extra):
    env = cpu_env(PYTHONPATH=ROOT, **extra)
    for k in LAUNCH_VARS:
        env.pop(k, None)
    return env


def _documented_cpu_flags(name):
    """The launch flags of the YAML's own comment line `ACCELERATE_USE_CPU=1 accelerate launch ... scripts/train.py`
    (continuation lines joined)."""
    header = "".join(line for line in open(os.path.join(ROOT, "config", "accelerate", name)) if line.startswith("#"))
    header = re.sub(r"\\\n#\s*", " ", header)
    m = re.search(r"ACCELERATE_USE_CPU=1 accelerate launch (.*?) scripts/train\.py", header)
    assert m, f"{name}: no CPU launch line in its comment"
    flags = m.group(1).split()
    assert flags[:2] == ["--config_file", f"config/accelerate/{name}"] and "--cpu" not in flags
    return flags


def test_every_config_is_covered():
    assert set(CONFIGS) == TRAINS_ON_CPU | set(GPU_ONLY) | set(GPU_ONLY_AFTER_START)
    for name in [*GPU_ONLY, *GPU_ONLY_AFTER_START]:  # their comment points to what runs on CPU instead
        text = open(os.path.join(ROOT, "config", "accelerate", name)).read()
        assert "GPU/NPU only" in text and "use ddp.yaml" in text


# --- `accelerate launch --config_file X --num_processes 2 --cpu`: one process, refused in one line (real launches) ---

ISSUE_ARGS = ["--config", "config/grpo.py:tiny", "--config.num_epochs=1", "--config.eval_freq=0"]


@pytest.fixture(scope="module")
def cpu_flag_launches(request, tmp_path_factory):
    names = selected_params(request, CONFIGS)
    logdir = tmp_path_factory.mktemp("cpu_flag")
    jobs = [dict(args=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       f"config/accelerate/{n}", "--num_processes", "2", "--cpu", "scripts/train.py", *ISSUE_ARGS,
                       f"--config.logdir={logdir}"], cwd=ROOT, env=_env()) for n in names]
    return dict(zip(names, run_side_by_side(jobs, timeout=300)))


@pytest.mark.parametrize("name", CONFIGS)
def test_cpu_flag_launch_stops_in_one_line(cpu_flag_launches, name):
    p = cpu_flag_launches[name]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1 and errors[0].startswith(LONE), p.stdout[-1500:] + p.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=1 accelerate launch --config_file config/accelerate/ddp.yaml --num_processes N" \
        in errors[0]
    # The trainer exits 2; accelerate's single-process launcher then reports that status in a traceback of its own.
    assert "returned non-zero exit status 2" in p.stderr
    assert "epoch 0" not in p.stdout + p.stderr  # stopped before any model loaded


# --- the documented CPU launch (ACCELERATE_USE_CPU=1, no --cpu) ---

PROBE = '''import atexit, runpy, sys
def report():
    from accelerate.state import AcceleratorState
    if AcceleratorState._shared_state:
        s = AcceleratorState()
        print(f"PROBE rank={s.process_index} world={s.num_processes} mixed_precision={s.mixed_precision}", flush=True)
atexit.register(report)
sys.argv = ["scripts/train.py"] + sys.argv[1:]
runpy.run_path("scripts/train.py", run_name="__main__")
'''
TINY = ["--config.sample.num_steps=2", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1",
        "--config.sample.k=4", "--config.train.batch_size=4", "--config.logging.wandb=False",
        "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.save_freq=0"]


def test_ddp_yaml_documented_cpu_launch_trains_2_processes_in_fp32(tmp_path):
    """ddp.yaml says mixed_precision: bf16; on CPU the trainer takes fp32 and says so once. The probe reads
    accelerate's own state in each process at exit."""
    (tmp_path / "probe.py").write_text(PROBE)
    flags = _documented_cpu_flags("ddp.yaml")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", "0",
           str(tmp_path / "probe.py"), *ISSUE_ARGS, *TINY, f"--config.logdir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    probes = sorted(line for line in p.stdout.splitlines() if line.startswith("PROBE"))
    assert probes == ["PROBE rank=0 world=2 mixed_precision=no", "PROBE rank=1 world=2 mixed_precision=no"]
    notes = [line for line in p.stdout.splitlines() if line.startswith("note: the launch's mixed_precision bf16")]
    assert len(notes) == 1 and "this CPU run trains in fp32" in notes[0]


def _accelerate_launch(flags, monkeypatch):
    """What `ACCELERATE_USE_CPU=1 accelerate launch FLAGS scripts/train.py` starts, by accelerate's own code: the
    launcher launch_command() picks, its parsed arguments, and rank 0's environment (torchrun, which both the
    multi-GPU and the one-machine DeepSpeed launcher run, adds WORLD_SIZE / RANK to it)."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    parsed = launch_command_parser().parse_args([*flags, "scripts/train.py"])
    args, defaults, mp_from_config = _validate_launch_command(parsed)
    if args.use_deepspeed and not args.cpu:
        fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as launch_command() sets it
        kind, env = "deepspeed", prepare_deepspeed_cmd_env(args)[1]
    elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
        kind, env = "torchrun", prepare_multi_gpu_env(args)
    else:
        return "simple", args, prepare_simple_launcher_cmd_env(args)[1]
    local = int(args.num_processes) // int(args.num_machines)
    env.update(WORLD_SIZE=str(args.num_processes), LOCAL_WORLD_SIZE=str(local), RANK="0", LOCAL_RANK="0")
    return kind, args, env


def _config():
    return types.SimpleNamespace(mixed_precision="", dry_run=False)


@pytest.mark.parametrize("name", sorted(TRAINS_ON_CPU))
def test_documented_cpu_launch_gives_2_processes_in_fp32(monkeypatch, capsys, name):
    flags = [*_documented_cpu_flags(name), "--main_process_port", "0"]
    kind, _, env = _accelerate_launch(flags, monkeypatch)
    assert kind == "torchrun" and env["WORLD_SIZE"] == "2" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    monkeypatch.setattr(devices, "npu_available", lambda: True)  # even where an NPU is present (npu8.yaml's machine)
    monkeypatch.setattr(os, "environ", env)
    device = devices.setup()
    assert device == "cpu"
    config = _config()
    devices.check_launch(config, device)
    assert config.mixed_precision == "no"
    assert capsys.readouterr().out.startswith("note: the launch's mixed_precision bf16")


@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_only_config_on_cpu_stops_in_one_line(monkeypatch, name):
    """Launched the way the others run on CPU (ACCELERATE_USE_CPU=1, 2 processes on 1 machine)."""
    flags = ["--config_file", f"config/accelerate/{name}", "--num_processes", "2", "--num_machines", "1",
             "--main_process_port", "0"]
    kind, args, env = _accelerate_launch(flags, monkeypatch)
    assert kind == ("deepspeed" if name.startswith("deepspeed") else "torchrun") and env["WORLD_SIZE"] == "2"
    if kind == "deepspeed" and not is_deepspeed_available():
        # Here accelerate's launcher stops first, with its own ImportError; the trainer's line is for where it is.
        with pytest.raises(ImportError, match="DeepSpeed is not installed"):
            deepspeed_launcher(args)
    with pytest.raises(ConfigError) as e:
        devices.check_launch(_config(), "cpu", env)
    assert "\n" not in str(e.value) and str(e.value).startswith(GPU_ONLY[name])
    assert "ddp.yaml" in str(e.value) and "ACCELERATE_USE_CPU=1" in str(e.value)


def test_fsdp2_yaml_on_cpu_stops_in_one_line_instead_of_running_ddp(tmp_path):
    """fsdp2.yaml launched on CPU as the others are (ACCELERATE_USE_CPU=1, 2 processes): accelerate builds a
    MULTI_CPU (DDP) run whatever the YAML says; the trainer says so in one line and exits 2 on each process, before any
    model loads, instead of training unsharded. (tests/fsdp_cpu_train.py, which patches accelerate, passes.)"""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "config/accelerate/fsdp2.yaml",
           "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0", "scripts/train.py",
           *ISSUE_ARGS, *TINY, f"--config.logdir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 2, p.stdout[-1500:] + p.stderr[-3000:]  # one per process
    assert errors[0] == errors[1] and errors[0].startswith(GPU_ONLY_AFTER_START["fsdp2.yaml"])
    assert "MULTI_CPU" in errors[0] and "ddp.yaml" in errors[0] and "ACCELERATE_USE_CPU=1" in errors[0]
    assert "epoch 0" not in p.stdout + p.stderr  # stopped before any model loaded

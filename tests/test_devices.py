"""Device choice and the process-count check, without any GPU: counts are passed in."""
import os
import subprocess
import sys

import pytest

from ddpo_grpo.trainer.run import devices
from ddpo_grpo.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_more_gpu_processes_than_gpus_is_one_line_naming_both_counts():
    with pytest.raises(ConfigError) as e:
        devices.check_process_count("cuda", local_processes=2, visible=1)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("2 processes on this machine but 1 visible CUDA device(s)")
    assert "--num_processes 1" in msg and "ACCELERATE_USE_CPU=1" in msg
    with pytest.raises(ConfigError, match="8 processes on this machine but 4 visible NPU"):
        devices.check_process_count("npu", local_processes=8, visible=4)


def test_enough_devices_or_cpu_passes():
    devices.check_process_count("cuda", local_processes=1, visible=1)
    devices.check_process_count("cuda", local_processes=4, visible=8)
    devices.check_process_count("cpu", local_processes=8, visible=0)  # gloo: any number of CPU processes


def test_local_process_count_prefers_torchrun_local_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert devices.local_process_count() == 1
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert devices.local_process_count() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 machines x 8: each machine needs 8 devices, not 16
    assert devices.local_process_count() == 8


@pytest.mark.parametrize("value, forced", [("1", True), ("True", True), ("", False), ("0", False), ("false", False)])
def test_accelerate_use_cpu_pins_cpu(monkeypatch, value, forced):
    monkeypatch.setenv("ACCELERATE_USE_CPU", value)
    assert devices.cpu_forced() is forced
    if forced:
        assert devices.setup() == "cpu"


def test_trainer_stops_with_exit_2_when_processes_outnumber_gpus():
    """The real script path: a fake CUDA with one device and WORLD_SIZE=2 (no process group is formed: the check
    runs before accelerate is asked for anything)."""
    code = ("import sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
            "sys.argv = ['train.py', '--config', 'config/grpo.py:tiny']; import runpy; "
            "runpy.run_path('scripts/train.py', run_name='__main__')")
    env = dict(os.environ, WORLD_SIZE="2", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env.pop("ACCELERATE_USE_CPU", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: 2 processes on this machine but 1 visible CUDA")
    assert "Traceback" not in p.stderr


# --- Ascend NPUs: HCCL timeouts raised before the process group forms (NPU detection faked) ---

HCCL = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")


def test_npu_setup_raises_hccl_timeouts(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(devices, "npu_available", lambda: True)
    for k in HCCL:
        monkeypatch.delenv(k, raising=False)
    assert devices.setup() == "npu"
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "1800" and os.environ["HCCL_EXEC_TIMEOUT"] == "1836"
    assert 120 <= int(os.environ["HCCL_CONNECT_TIMEOUT"]) <= 7200  # HCCL's accepted range
    assert int(os.environ["HCCL_EXEC_TIMEOUT"]) % 68 == 0  # HCCL rounds down to a multiple of 68 s: taken as is


def test_users_hccl_timeouts_win(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(devices, "npu_available", lambda: True)
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "600")
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    assert devices.setup() == "npu"
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "600" and os.environ["HCCL_EXEC_TIMEOUT"] == "1836"
    env = {"HCCL_CONNECT_TIMEOUT": "300", "HCCL_EXEC_TIMEOUT": "68"}
    assert devices.apply_hccl_timeouts(env) == {} and env == {"HCCL_CONNECT_TIMEOUT": "300", "HCCL_EXEC_TIMEOUT": "68"}


@pytest.mark.parametrize("forced_cpu", [True, False])
def test_cpu_and_cuda_leave_hccl_alone(monkeypatch, forced_cpu):
    monkeypatch.setattr(devices, "npu_available", lambda: True)  # an NPU present, but ACCELERATE_USE_CPU wins
    if not forced_cpu:
        monkeypatch.setattr(devices, "npu_available", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1" if forced_cpu else "0")
    for k in HCCL:
        monkeypatch.delenv(k, raising=False)
    assert devices.setup() in ("cpu", "cuda")
    assert not any(k in os.environ for k in HCCL)


# A torch_npu that is installed but broken (fake packages on sys.path): each case's module source.
BROKEN_NPU = {
    "cann_missing": ("raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')",
                     "torch_npu is installed but cannot be imported (ImportError: libhccl.so: cannot open"),
    "dependency_missing": ("import cann_runtime_bindings",
                           "torch_npu is installed but cannot be imported (ModuleNotFoundError: No module named "
                           "'cann_runtime_bindings')"),
    "init_fails": ("import torch, types\n"
                   "def is_available():\n    raise RuntimeError('drvErr 87: the NPU driver is not loaded')\n"
                   "torch.npu = types.SimpleNamespace(is_available=is_available)",
                   "torch_npu is installed but cannot initialise its devices (RuntimeError: drvErr 87"),
}


def _fake_torch_npu(folder, source):
    pkg = folder / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(source + "\n")
    return str(folder)


@pytest.mark.parametrize("case", sorted(BROKEN_NPU))
def test_a_broken_torch_npu_is_one_line_not_a_silent_cpu_run(tmp_path, monkeypatch, case):
    import torch

    source, want = BROKEN_NPU[case]
    monkeypatch.syspath_prepend(_fake_torch_npu(tmp_path, source))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(torch, "npu", None, raising=False)  # whatever the fake sets is undone after the test
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    try:
        with pytest.raises(ConfigError) as e:
            devices.setup()
    finally:
        sys.modules.pop("torch_npu", None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(want), msg
    assert "uninstall torch_npu" in msg and "ACCELERATE_USE_CPU=1" in msg


def test_torch_npu_without_devices_or_forced_cpu_is_no_error(tmp_path, monkeypatch):
    """Installed and working on a machine without NPUs: CPU/CUDA as before; ACCELERATE_USE_CPU never imports it."""
    import torch

    monkeypatch.syspath_prepend(_fake_torch_npu(tmp_path, "import torch, types\n"
                                                          "torch.npu = types.SimpleNamespace(is_available=lambda: False)"))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(torch, "npu", None, raising=False)
    try:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
        assert devices.setup() in ("cpu", "cuda")
        sys.modules.pop("torch_npu", None)
        monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
        assert devices.setup() == "cpu" and "torch_npu" not in sys.modules
    finally:
        sys.modules.pop("torch_npu", None)


def test_trainer_stops_on_a_broken_torch_npu_in_one_line(tmp_path):
    source, want = BROKEN_NPU["cann_missing"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([_fake_torch_npu(tmp_path, source), ROOT]))
    env.pop("ACCELERATE_USE_CPU", None)
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny",
                        f"--config.logdir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: {want}")


def test_trainer_sets_hccl_timeouts_before_the_process_count_check():
    """The real script path with a faked NPU (1 device) and WORLD_SIZE=2: the trainer stops at the process-count
    guard, before any process group; by then both timeouts are in its environment, the user's one unchanged."""
    code = ("import atexit, os, sys, types, torch; from ddpo_grpo.trainer.run import devices; "
            "devices.npu_available = lambda: True; torch.npu = types.SimpleNamespace(device_count=lambda: 1); "
            "atexit.register(lambda: print('HCCL', os.environ.get('HCCL_CONNECT_TIMEOUT'), "
            "os.environ.get('HCCL_EXEC_TIMEOUT'), flush=True)); "
            "sys.argv = ['train.py', '--config', 'config/grpo.py:tiny']; import runpy; "
            "runpy.run_path('scripts/train.py', run_name='__main__')")
    env = dict(os.environ, WORLD_SIZE="2", HF_HUB_OFFLINE="1", WANDB_MODE="offline", HCCL_CONNECT_TIMEOUT="900",
               PYTHONPATH=ROOT)
    for k in ("ACCELERATE_USE_CPU", "HCCL_EXEC_TIMEOUT", "MASTER_ADDR"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: 2 processes on this machine but 1 visible NPU")
    assert "HCCL 900 1836" in p.stdout


# --- check_launch: what the launch asked for against what this process got (env passed in) ---

def _cfg(mixed_precision="", dry_run=False):
    import types
    return types.SimpleNamespace(mixed_precision=mixed_precision, dry_run=dry_run)


def test_lone_process_of_a_multi_process_launch_is_one_line():
    """accelerate launch --cpu --num_processes 2: one process, MASTER_ADDR set, no WORLD_SIZE."""
    env = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1"}
    for dry in (False, True):  # a dry run would report 1 process: refused too
        with pytest.raises(ConfigError) as e:
            devices.check_launch(_cfg(dry_run=dry), "cpu", env)
        assert "\n" not in str(e.value) and str(e.value).startswith("accelerate launch started 1 process")
        assert "ACCELERATE_USE_CPU=1 accelerate launch --config_file config/accelerate/ddp.yaml" in str(e.value)
    for ok in ({**env, "WORLD_SIZE": "2"}, {**env, "PMI_SIZE": "2"},  # torchrun; mpirun (--mpirun_hostfile)
               {"ACCELERATE_MIXED_PRECISION": "no"},  # accelerate launch of 1 process: no MASTER_ADDR
               {"MASTER_ADDR": "10.0.0.1"}):  # python scripts/train.py with a cluster's MASTER_ADDR exported
        devices.check_launch(_cfg(), "cpu", ok)


@pytest.mark.parametrize("config_mp, launch_mp, device, want, note", [
    ("", "bf16", "cpu", "no", "the launch's mixed_precision bf16"),  # the YAMLs' line on a CPU machine
    ("", "fp16", "cpu", "no", "the launch's mixed_precision fp16"),
    ("", "no", "cpu", "no", None),
    ("fp16", "no", "cpu", "no", "config.mixed_precision=fp16"),
    ("bf16", "no", "cpu", "bf16", None),  # asked for by name: bf16 autocast on CPU
    ("", "bf16", "cuda", "", None),  # GPU/NPU: untouched, Accelerator takes the launch's setting
    ("no", "bf16", "npu", "no", None),
    ("fp8", "bf16", "cpu", "fp8", None),  # not a valid value: validate_config's own line, not silently fp32
])
def test_mixed_precision_rule(capsys, config_mp, launch_mp, device, want, note):
    cfg = _cfg(config_mp)
    devices.check_launch(cfg, device, {"ACCELERATE_MIXED_PRECISION": launch_mp, "WORLD_SIZE": "2", "RANK": "0"})
    assert cfg.mixed_precision == want
    out = capsys.readouterr().out
    if note:
        assert out.count("\n") == 1 and out.startswith(f"note: {note}") and "this CPU run trains in fp32" in out
    else:
        assert out == ""
    devices.check_launch(_cfg(config_mp), device, {"ACCELERATE_MIXED_PRECISION": launch_mp, "RANK": "1"})
    assert capsys.readouterr().out == ""  # the note once per run (rank 0)


def test_parallelism_mesh_must_hold_every_process():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8", "PARALLELISM_CONFIG_TP_SIZE": "1"}
    devices.check_launch(_cfg(), "cuda", {**env, "WORLD_SIZE": "16"})
    with pytest.raises(ConfigError) as e:
        devices.check_launch(_cfg(), "cuda", {**env, "WORLD_SIZE": "8"})
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("parallelism_config's mesh (dp_replicate 2 x dp_shard 8) holds 16 processes but "
                                   "this launch has 8")
    with pytest.raises(ConfigError, match="needs GPU/NPU processes: accelerate refuses it for CPU"):
        devices.check_launch(_cfg(), "cpu", {**env, "WORLD_SIZE": "16"})
    devices.check_launch(_cfg(dry_run=True), "cpu", {**env, "WORLD_SIZE": "16"})  # a GPU launch checked from a CPU box


def test_deepspeed_on_cpu_processes_is_one_line():
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="^a DeepSpeed launch .* needs GPU/NPU processes.*ddp.yaml"):
        devices.check_launch(_cfg(), "cpu", env)
    devices.check_launch(_cfg(), "cuda", env)
    devices.check_launch(_cfg(dry_run=True), "cpu", env)  # the DeepSpeed start-up guards stay checkable on CPU


def test_fsdp2_wraps_the_architectures_own_blocks(monkeypatch):
    """An FSDP2 launch wraps the adapter's block classes (the YAML lists an SD UNet's): SD3's JointTransformerBlock,
    the SD UNet's own; other engines leave the environment alone."""
    import types

    from ddpo_grpo.trainer.run import scale

    cfg = lambda model: types.SimpleNamespace(pretrained=types.SimpleNamespace(model=model))  # noqa: E731
    env = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "BasicTransformerBlock,ResnetBlock2D"}
    monkeypatch.setattr(scale, "engine", lambda: "ddp")
    scale.use_architecture_blocks(cfg("sd3-tiny"), env)
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "BasicTransformerBlock,ResnetBlock2D"
    monkeypatch.setattr(scale, "engine", lambda: "fsdp2")
    scale.use_architecture_blocks(cfg("sd3-tiny"), env)
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "JointTransformerBlock"
    scale.use_architecture_blocks(cfg("tiny-t2i"), env)
    assert set(env["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")) == {"ResnetBlock2D", "BasicTransformerBlock"}

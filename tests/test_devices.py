"""Device choice and the process-count check, without any GPU: counts are passed in."""
import os
import subprocess
import sys

import pytest

from ddpo_grpo.trainer import devices
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

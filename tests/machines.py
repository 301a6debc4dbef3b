"""Two "machines" on loopback for tests/test_multinode.py: each machine's launch line (accelerate's
config/accelerate/ddp_multinode.yaml, gloo, one or more CPU processes), starting both, killing one at a kill point,
and telling a hang of the other from a kill that came too late (LateKill)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from forkserver import descendants
from helpers import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 3
# collective_timeout_s of these runs: a dead or hung peer ends the job within it. It is also how far apart the two
# machines may drift at any collective of a healthy run (start-up imports and loads, machine 0 writing a checkpoint's
# export while machine 1 waits at the barrier), which a loaded machine stretches: 60 s, not 20. A SIGKILLed peer is
# normally seen at once (its sockets close), so this bound costs the kill tests nothing.
TIMEOUT_S = 60
KILL_WAIT_S = 600  # hang guards only (no timing is asserted): how long a machine may take to reach the kill point
END_WAIT_S = 300  # ... and machine 0 to end after the kill; far below the 1800 s default collective time-out, so a
# run that ignored collective_timeout_s still fails here
SMALL = ["--config", "config/grpo.py:tiny", f"--config.num_epochs={EPOCHS}", "--config.sample.num_steps=3",
         "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1", "--config.sample.k=4",
         "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
         "--config.logging.tensorboard=False", "--config.logging.image_freq=0", "--config.logging.debug_dump=True",
         "--config.train.timestep_fraction=1.0", "--config.save_freq=1", "--config.num_checkpoint_limit=1",
         # the EMA reference and an LR warmup: state a resume must restore exactly
         "--config.train.beta=0.05", "--config.train.reference_model_mixup_alpha=0.5",
         "--config.train.lr_warmup_steps=5", f"--config.collective_timeout_s={TIMEOUT_S}"]


OTHER_ZONE = "XYZ-05"  # POSIX TZ: local time 5 h ahead of UTC (no tz database needed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_cmd(rank: int, port: int, per_machine: int = 1, fsdp: bool = False) -> list:
    """The launch line of machine `rank` of 2 (per_machine processes each), as docs/scaling.md gives it. fsdp: FSDP2
    through tests/fsdp_cpu_train.py (accelerate keeps FSDP on CPU processes there; see tests/test_scale_out.py)."""
    yaml, script = ("fsdp2.yaml", "tests/fsdp_cpu_train.py") if fsdp else ("ddp_multinode.yaml", "scripts/train.py")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"config/accelerate/{yaml}",
            "--num_machines", "2", "--num_processes", str(2 * per_machine), "--machine_rank", str(rank), "--main_process_ip",
            "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            "--rdzv_conf", "timeout=120", script, *SMALL]


def machine_processes(pid: int) -> list:
    """pid and all its descendants: a "machine" is accelerate's launcher (torchrun's agent) and the workers it starts
    (in sessions of their own, so a process-group kill would miss them)."""
    return descendants(pid)


def kill_machine(proc) -> None:
    for pid in machine_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LateKill(Exception):
    """Machine 1 was killed only after machine 0 had finished training (the kill point's file lasts one epoch, under
    a second here, and on a loaded CPU the poll or the kill can come later): a race of the test, not a hang of the
    trainer. torchrun's agent on machine 0 then waits out its exit barrier (300 s) for machine 1's."""


def two_machines(logdirs, extra=((), ()), kill_when=None, per_machine=1, fsdp=False):
    """Machine 0, then 1 s later machine 1, with --config.logdir=logdirs[rank] and extra[rank]. kill_when: a
    function giving a path (or None); once that path exists machine 1's launcher and workers are SIGKILLed, and
    machine 0 must end by itself (within END_WAIT_S: a hang guard, not a timing check); LateKill if machine 0 had
    finished training before the kill landed. Returns (outputs, return codes)."""
    port = free_port()
    procs = []
    # Each machine's output goes to a file, not a pipe: nothing reads a pipe while the machines run, and a full pipe
    # buffer (64 KiB; a loaded machine prints more, tqdm redraws by time) would block a machine in its own write.
    folder = tempfile.mkdtemp(prefix="machines-")
    logs = [os.path.join(folder, f"machine{rank}.log") for rank in (0, 1)]
    try:
        for rank in (0, 1):
            cmd = machine_cmd(rank, port, per_machine, fsdp) + [f"--config.logdir={logdirs[rank]}", *extra[rank]]
            # Machine 1's clock reads another time zone (as two machines' can): without rank 0's broadcast of the
            # run name, each would name its run folder by its own clock, and the two names would differ by hours.
            env = cpu_env(PYTHONPATH=ROOT, **({"TZ": OTHER_ZONE} if rank == 1 else {}))
            with open(logs[rank], "a") as out:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
            time.sleep(1)
        if kill_when:
            # Poll for the condition (the kill point's file), not a time: a loaded machine only gets there later.
            deadline = time.monotonic() + KILL_WAIT_S
            reached = False
            while procs[1].poll() is None and time.monotonic() < deadline:
                path = kill_when()
                if path and os.path.exists(path):
                    reached = True
                    break
                time.sleep(0.05)
            kill_machine(procs[1])
            if not reached:  # machine 1 ended (or hung) before the kill point: say so, not a later, stranger failure
                pytest.fail(f"machine 1 never reached the kill point {kill_when()} (exit {procs[1].poll()}, "
                            f"waited up to {KILL_WAIT_S} s): {_read(logs[1])[-2000:]}")
            end = time.monotonic() + END_WAIT_S
            while procs[0].poll() is None:  # a hang fails here
                if "done in " in _read(logs[0]):  # the trainer's last line (reporting.finish): nothing left to stop
                    raise LateKill(_read(logs[0])[-500:])
                if time.monotonic() > end:
                    pytest.fail(f"machine 0 still running {END_WAIT_S} s after machine 1 was killed (collective_"
                                f"timeout_s={TIMEOUT_S}): a hang; its output ends: {_read(logs[0])[-2000:]}")
                time.sleep(0.5)
        for p in procs:
            p.wait(timeout=600)
        return [_read(f) for f in logs], [p.returncode for p in procs]
    finally:  # nothing outlives a failed test
        for p in procs:
            if p.poll() is None:
                kill_machine(p)
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: str) -> str:
    """All a machine wrote so far."""
    with open(path) as f:
        return f.read()

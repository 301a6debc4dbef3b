"""A fork server for the suite's Python runs: `python scripts/X.py ...` (or `-c CODE`, `-m benchmarks.X`, an
`accelerate launch` and the ranks it starts) started by a test costs ~7 s of imports (torch,
diffusers, transformers, accelerate, peft) before the script's first line of work, and the suite starts a few hundred
of them. This server imports those libraries once, then forks a fresh process per run, which executes the script
as `python` would (`__main__`, its argv, cwd, environment and stdio: the test's own pipes or files, passed over the
socket). Only third-party libraries are imported ahead; ddpo_grpo's modules are imported by each run itself, so their
module-level code (e.g. models.TINY_CACHE read from the environment) runs with the run's environment.

A run goes through the server only where that changes nothing but the start-up: the environment variables that those
libraries read at import (ENV_AT_IMPORT) must equal the server's, and the server holds one native thread when it
forks; otherwise the client (tests/fork_client.py) executes the real interpreter instead. The client is the test's
subprocess: signals sent to it reach the run, its exit status is the run's (a signal's death included), and a run
whose client is killed (SIGKILL, a killed session) is killed with its whole session at once. A test that checks what
a fresh interpreter has imported (tests/test_layout.py) sets DDPO_GRPO_TEST_FORK=0 in its run's environment.

    python tests/forkserver.py SOCKET_PATH       (started by tests/conftest.py, one per pytest worker and environment)
"""
import json
import os
import select
import signal
import socket
import struct
import sys

from fork_exit import finish, track_opened  # (tests/ is first on the path: the server runs as tests/forkserver.py)

# environment variables the pre-imported libraries read at import: a run whose values differ runs the real interpreter
# (accelerate and torch.distributed read theirs when a state or process group is made; torchrun's per-rank variables,
# TORCHELASTIC_* and TORCH_NCCL_*, are not import-time)
ENV_AT_IMPORT = ("HF_", "HUGGINGFACE", "DIFFUSERS", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "OMP_", "MKL_",
                 "KMP_", "OPENBLAS", "PYTHON", "MALLOC_", "LD_", "MPL", "XDG_", "TOKENIZERS", "NUMEXPR", "WANDB_",
                 "USE_TORCH")
# PYTHONPATH is applied per run instead (run_sys_path): the preimported libraries come from site-packages either way,
# and the tests' PYTHONPATHs (the repository, a reward plugin's folder) hold only modules the server never imports.
# PYTHONUNBUFFERED likewise (worker: as `-u`): the shell scripts export it (scripts/gpu_check.sh), and as an
# import-time variable it sent each of their dozen Python runs to a fresh interpreter.
NOT_AT_IMPORT = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHONPATH", "PYTHONUNBUFFERED")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, "tests", "fork_client.py")
MODULES = ("accelerate.commands.launch",)  # `python -m` runs that go through the server


def import_sensitive(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(ENV_AT_IMPORT) and not k.startswith(NOT_AT_IMPORT)}


def _pythonpath(env: dict, cwd: str) -> list:
    return [os.path.abspath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


SERVER_PYTHONPATH = set(_pythonpath(dict(os.environ), os.getcwd()))  # (read when the server imports this module)


def run_sys_path(first: str, env: dict, cwd: str) -> list:
    """sys.path as the interpreter starts a run with `env` in `cwd`: `first` (the script's folder, "" for -c, the cwd
    for -m), then the run's PYTHONPATH entries made absolute (as site does), then the server's own interpreter paths
    (stdlib, site-packages) without the server's PYTHONPATH entries."""
    base = [p for p in sys.path[1:] if p not in SERVER_PYTHONPATH]
    entries = []
    for p in [first, *_pythonpath(env, cwd), *base]:
        if p not in entries:
            entries.append(p)
    return entries


def served_args(args, kwargs):
    """The interpreter arguments of a Popen(args, **kwargs) the server can run (`python [-u] SCRIPT.py ...`,
    `python [-u] -c CODE ...`, `python [-u] -m MODULE ...` for MODULES and benchmarks.*), else None: interpreter
    options (-S, -X, -I, ...) and other modules (pip, pytest) run the real interpreter."""
    if not isinstance(args, (list, tuple)) or len(args) < 2 or kwargs.get("shell") or kwargs.get("executable"):
        return None
    if str(args[0]) != sys.executable:
        return None
    rest = [str(a) for a in args[1:]]
    opts = []
    while rest and rest[0] == "-u":
        opts.append(rest.pop(0))
    if len(rest) >= 2 and rest[0] == "-m" and (rest[1] in MODULES or rest[1].startswith("benchmarks.")):
        return opts + rest
    if len(rest) >= 2 and rest[0] == "-c":
        return opts + rest
    return opts + rest if rest and rest[0].endswith(".py") and not rest[0].startswith("-") else None


def install_popen_hook(server_for_env) -> None:
    """Route subprocess.Popen's served runs (served_args) through fork_client.py with the socket server_for_env(env)
    returns (None: the real interpreter). In the pytest process (conftest.py) and in every served run (so that the runs
    a launcher or a benchmark starts are served too)."""
    import subprocess

    popen_init = getattr(subprocess.Popen.__init__, "_unhooked", subprocess.Popen.__init__)

    def init(self, args, *rest, **kwargs):
        served = None if rest else served_args(args, kwargs)
        if served is not None:
            env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
            path = server_for_env(env) if env.get("DDPO_GRPO_TEST_FORK", "1") != "0" else None
            if path is not None:
                args = [sys.executable, "-S", CLIENT, *served]
                kwargs["env"] = dict(env, DDPO_GRPO_FORKSERVER=path)
        popen_init(self, args, *rest, **kwargs)

    init._unhooked = popen_init
    subprocess.Popen.__init__ = init


def read_request(conn: socket.socket):
    """(header dict, [stdin, stdout, stderr] fds) sent by fork_client.main."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if len(head) < 8 or len(fds) != 3:
        raise ConnectionError("bad request")
    (n,) = struct.unpack("!Q", head)
    body = b""
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            raise ConnectionError("request cut short")
        body += chunk
    return json.loads(body), fds


def preimport() -> None:
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import diffusers
    from absl import app, flags  # noqa: F401
    from ml_collections import config_flags  # noqa: F401
    import PIL.Image  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (accelerate's tracker)
    import wandb.apis.public  # noqa: F401  (wandb.init imports these: ~4 s, pydantic reading docstrings)
    import wandb.sdk.launch  # noqa: F401
    # the classes the trainer and the tests' scripts build (diffusers imports its model modules on first access)
    for name in ("UNet2DConditionModel", "AutoencoderKL", "StableDiffusionPipeline", "StableDiffusionXLPipeline",
                 "StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline", "DDIMScheduler",
                 "FlowMatchEulerDiscreteScheduler", "SD3Transformer2DModel", "FluxTransformer2DModel",
                 "WanTransformer3DModel", "AutoencoderKLWan"):
        getattr(diffusers, name, None)


def worker(req: dict, fds) -> None:
    """In the forked run: become `python SCRIPT ARGS` with the client's stdio, cwd and environment. Never returns."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = list(req["argv"])
    module = None
    unbuffered = bool(req["env"].get("PYTHONUNBUFFERED"))  # a non-empty PYTHONUNBUFFERED is `-u`
    while argv and argv[0] == "-u":
        argv.pop(0)
        unbuffered = True
    if unbuffered:  # unbuffered stdout / stderr, as `python -u`
        import io

        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                      errors="backslashreplace")
    code_string = None
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = argv[1:]
        first = os.getcwd()
    elif argv[0] == "-c":  # as `python -c`: sys.argv[0] "-c", the current directory first on sys.path (as "")
        code_string = argv[1]
        sys.argv = ["-c", *argv[2:]]
        first = ""
    else:
        sys.argv = argv
        first = os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = run_sys_path(first, req["env"], req["cwd"])
    import importlib

    importlib.invalidate_caches()  # folders made since the server started (a test's plugin) are read afresh
    install_popen_hook(lambda env: req["server"])  # the runs this run starts: served by the same server
    track_opened()
    import random

    import numpy

    random.seed()  # a fresh interpreter seeds these from the OS; forks of one server would share one state
    numpy.random.seed()
    import runpy

    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        elif code_string is not None:
            import types

            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(code_string, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # as the interpreter reports an uncaught exception: traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    finish(code)


def descendants(pid: int) -> list:
    """pid and every process below it (from /proc's parent links), pid first."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL pid's session and all its descendants (a launcher's ranks run in sessions of their own: a test kills
    a "machine" as the launcher and every process below it; through the server, the processes below its client)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def client_gone(pid: int) -> None:
    kill_tree(pid)
    os.waitpid(pid, 0)
    os._exit(0)


def supervise(conn: socket.socket, own_env: dict) -> None:
    """One run: fork it, forward the client's signals, report its exit status; kill its session if the client dies.
    Never returns, except in the forked run (which exits through worker())."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        req, fds = read_request(conn)
    except (ConnectionError, OSError, ValueError) as e:
        sys.stderr.write(f"forkserver: request not read: {e!r}\n")
        os._exit(0)
    if import_sensitive(req["env"]) != own_env or len(os.listdir("/proc/self/task")) != 1:
        conn.sendall(b"fallback\n")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        worker(req, fds)
    for fd in fds:
        os.close(fd)
    try:
        relay(conn, pid)
    finally:  # relay() exits the process; here only on an error: the run must not outlive its supervisor
        kill_tree(pid)


def relay(conn: socket.socket, pid: int) -> None:
    """Tell the client the run's pid, pass its "sig N" lines on to the run, send the run's exit status. A client gone
    at any point (its socket at EOF, or erroring: EPIPE when it died before the pid line was sent, ECONNRESET when it
    died with the line unread) is a killed client: the run goes too, with its session and every process it started
    (an OSError here used to end the supervisor alone, and the orphaned run held the test's pipes open)."""
    try:
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:
        client_gone(pid)
    pidfd = os.pidfd_open(pid)
    buf = b""
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            os._exit(0)
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            client_gone(pid)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"sig "):
                try:
                    os.kill(pid, int(line[4:]))
                except ProcessLookupError:
                    pass


def serve(path: str) -> None:
    # The server ends with the pytest worker that started it: it polls its parent PROCESS (below). Not PR_SET_PDEATHSIG,
    # which fires when the parent THREAD ends: a server started from a test's thread pool (helpers.run_parallel) was
    # killed when the pool shut down, and every later run of its environment fell back to a fresh interpreter.
    parent = os.getppid()
    own_env = import_sensitive(dict(os.environ))
    preimport()
    if len(os.listdir("/proc/self/task")) != 1:  # a library started a thread: forking would copy a broken pool
        sys.stderr.write("forkserver: more than one thread after the imports; not serving\n")
        sys.exit(3)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(64)
    os.rename(path + ".tmp", path)  # the path appears when the server accepts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors are reaped by the kernel
    while True:
        if not select.select([srv], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the worker is gone (re-parented to init): so is its server
                os._exit(0)
            continue
        conn, _ = srv.accept()
        if os.fork() == 0:
            srv.close()
            me = os.getpid()
            try:
                supervise(conn, own_env)
            except BaseException:
                if os.getpid() != me:  # the run itself ending (SystemExit from worker()): not the supervisor's
                    raise
                import traceback

                traceback.print_exc()
                os._exit(1)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])

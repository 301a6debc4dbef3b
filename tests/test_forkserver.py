"""The suite's fork server (tests/forkserver.py, hooked in tests/conftest.py) must change nothing a test can see but the
start-up time: a script's output, exit status, signals and death as `python SCRIPT` gives them."""
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import conftest
import pytest
from helpers import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, "tests", "fork_client.py")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

SCRIPT = """
import os, sys, random, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "path0", sys.path[0] == os.path.dirname(
    os.path.abspath(__file__)), "main", __name__, "rand", random.random(), flush=True)
sys.stderr.write("to stderr\\n")
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("boom")
if mode == "message":
    sys.exit("stopped: a message")
if mode == "leave":  # what the interpreter's shutdown finishes: a file left open, atexit, a thread still running
    import atexit, threading
    left = open(sys.argv[2], "w")
    left.write("written, never closed")
    atexit.register(lambda: print("atexit ran, unflushed", end=""))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
if mode == "sleep":
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
if mode == "term":
    import signal
    got = []
    # the handler only records the signal; the loop exits. A SystemExit raised in the handler itself is lost when the
    # handler happens to run inside a finalizer or a gc callback (Python reports and drops exceptions there), which
    # under load left the run sleeping after "got SIGTERM" (seen in loaded repetitions of this test)
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), got.append(1)))
    open(sys.argv[2], "w").write("ready")
    # short sleeps: a signal landing between the interpreter's check for one and the sleep's system call has its
    # handler run when that sleep ends (as in any Python program), so the step bounds the wait, not 600 s
    for _ in range(6000):
        if got:
            sys.exit(7)
        time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A script, the environment the trainer's tests use, and the socket of the server for it."""
    folder = tmp_path_factory.mktemp("fork")
    script = folder / "probe.py"
    script.write_text(SCRIPT)
    env = cpu_env(PROBE="x")
    path = conftest._fork_server(env, now=True)
    if path is None:
        pytest.skip("no fork server for this environment (hook disabled by DDPO_GRPO_TEST_FORK=0)")
    return str(script), env, path, folder


def through_server(served, *args, **kw):
    """The CompletedProcess of `python SCRIPT args` run by the server."""
    script, env, path, folder = served
    return subprocess.run([sys.executable, "-S", CLIENT, script, *args], env=dict(env, DDPO_GRPO_FORKSERVER=path),
                          cwd=folder, capture_output=True, text=True, timeout=120, **kw)


def both(served, *args, **kw):
    """(through the server, real interpreter) CompletedProcess of `python SCRIPT args`."""
    script, env, path, folder = served
    fork = through_server(served, *args, **kw)
    plain = subprocess.run([sys.executable, script, *args], env=env, cwd=folder, capture_output=True, text=True,
                           timeout=120, **kw)
    return fork, plain


def without_rand(out: str) -> str:
    return out.split(" rand ")[0]


@pytest.mark.parametrize("args,code", [(("exit", "0"), 0), (("exit", "3"), 3), (("raise",), 1)])
def test_output_and_exit_status_are_the_interpreters(served, args, code):
    fork, plain = both(served, *args)
    assert fork.returncode == plain.returncode == code
    assert without_rand(fork.stdout) == without_rand(plain.stdout)
    assert f"argv {list(args)!r} cwd {served[3]} env x path0 True main __main__" in fork.stdout
    assert fork.stderr.startswith("to stderr\n")
    if code == 1:
        assert fork.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == "ValueError: boom"


def test_what_the_shutdown_finishes_is_finished(served, tmp_path):
    """A served run ends without the interpreter's teardown (fork_exit.finish: ~2 s of CPU saved per run), yet what
    that shutdown does that a test can see is done as the interpreter does it: a thread still running joined, then
    the atexit handlers, a file left open flushed, stdout's last unflushed text written; sys.exit("text") prints the
    text, status 1; and PYTHONUNBUFFERED is `-u`."""
    fork, plain = both(served, "leave", str(tmp_path / "left.txt"))
    assert fork.returncode == plain.returncode == 0
    assert without_rand(fork.stdout) == without_rand(plain.stdout)
    assert fork.stdout.split("\n", 1)[1] == "thread joined\natexit ran, unflushed"
    assert (tmp_path / "left.txt").read_text() == "written, never closed"
    fork, plain = both(served, "message")
    assert fork.returncode == plain.returncode == 1
    assert fork.stderr == plain.stderr == "to stderr\nstopped: a message\n"
    script, env, path, folder = served
    code = "import sys; print(sys.stdout.write_through)"
    fork = subprocess.run([sys.executable, "-S", CLIENT, "-c", code], cwd=folder, capture_output=True, text=True,
                          timeout=120, env=dict(env, DDPO_GRPO_FORKSERVER=path, PYTHONUNBUFFERED="1"))
    assert fork.returncode == 0 and fork.stdout == "True\n"


def test_python_c_is_the_interpreters(served):
    """`python -c CODE ARGS`: argv[0] "-c", "" first on sys.path, __main__ a module of its own, an uncaught exception's
    last traceback line and status as the interpreter's."""
    script, env, path, folder = served
    code = ("import sys, __main__; print(sys.argv, repr(sys.path[0]), __name__, hasattr(__main__, '__file__'));"
            "sys.exit(int(sys.argv[1])) if sys.argv[1] != 'raise' else int('x')")
    for arg, status in (("0", 0), ("4", 4), ("raise", 1)):
        fork, plain = (subprocess.run([sys.executable, *pre, "-c", code, arg], env=e, cwd=folder, capture_output=True,
                                      text=True, timeout=120)
                       for pre, e in ((("-S", CLIENT), dict(env, DDPO_GRPO_FORKSERVER=path)), ((), env)))
        assert fork.returncode == plain.returncode == status
        assert fork.stdout == plain.stdout == f"['-c', '{arg}'] '' __main__ False\n"
        assert fork.stderr.strip().splitlines()[-1:] == plain.stderr.strip().splitlines()[-1:]


def test_each_run_draws_its_own_random_state(served):
    # forks of one server would share the server's `random` state; a fresh interpreter seeds it from the OS
    runs = [through_server(served, "exit", "0").stdout.split(" rand ")[1] for _ in range(2)]
    assert runs[0] != runs[1]


def test_a_different_import_time_environment_runs_the_real_interpreter(served):
    script, env, path, folder = served
    res = subprocess.run([sys.executable, "-S", CLIENT, script, "exit", "0"], cwd=folder, capture_output=True,
                         text=True, timeout=120, env=dict(env, DDPO_GRPO_FORKSERVER=path, TOKENIZERS_PARALLELISM="0"))
    assert res.returncode == 0 and "env x" in res.stdout


def test_pythonpath_is_the_runs_own(served, tmp_path):
    """PYTHONPATH is not an import-time variable for the server: each run's sys.path has its entries (made absolute)
    right after the script's folder, as the interpreter's does, and a module there is found."""
    script, env, path, folder = served
    (tmp_path / "probe_mod.py").write_text("VALUE = 42\n")
    code = "import sys, probe_mod; print(sys.path[:3], probe_mod.VALUE)"
    run_env = dict(env, PYTHONPATH=os.pathsep.join([str(tmp_path), "rel"]))
    fork, plain = (subprocess.run([sys.executable, *pre, "-c", code], env=e, cwd=folder, capture_output=True,
                                  text=True, timeout=120)
                   for pre, e in ((("-S", CLIENT), dict(run_env, DDPO_GRPO_FORKSERVER=path)), ((), run_env)))
    assert fork.returncode == plain.returncode == 0, fork.stderr[-2000:]
    assert fork.stdout == plain.stdout == f"{['', str(tmp_path), str(folder / 'rel')]} 42\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_sleeping_run(script, env, path, folder):
    """(client process, run pid, its child's pid) of the probe's "sleep" mode through the server at `path`, once the
    run has written its pids (the client in a session of its own, so that a test can kill it whole)."""
    marker = folder / "pids"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-S", CLIENT, script, "sleep", str(marker)], cwd=folder,
                            env=dict(env, DDPO_GRPO_FORKSERVER=path), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    run_pid, child_pid = map(int, marker.read_text().split())
    return proc, run_pid, child_pid


def test_killing_the_client_kills_the_run_and_its_children(served):
    proc, run_pid, child_pid = start_sleeping_run(*served)
    assert run_pid != proc.pid and _alive(run_pid) and _alive(child_pid)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.time() + 10
    while (_alive(run_pid) or _alive(child_pid)) and time.time() < deadline:
        time.sleep(0.02)
    assert not _alive(run_pid) and not _alive(child_pid)


def test_a_signal_to_the_client_reaches_the_run(served):
    script, env, path, folder = served
    marker = folder / "ready"
    proc = subprocess.Popen([sys.executable, "-S", CLIENT, script, "term", str(marker)], cwd=folder,
                            env=dict(env, DDPO_GRPO_FORKSERVER=path), stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7 and "got SIGTERM" in out


def _pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits, blocked, on process pid (False once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except FileNotFoundError:
        return False
    return any(int(fields[k], 16) >> (sig - 1) & 1 for k in ("SigPnd", "ShdPnd"))


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def _read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1)  # a byte at a time: nothing past the line is taken from the stream
        assert chunk, "connection closed"
        line += chunk
    return line


def test_a_signal_before_the_client_has_read_the_runs_pid_reaches_the_run(served):
    """The run starts (and may set its handlers) before its client has read the pid line; a signal to the client in
    between must reach the run, not kill the client (it did, by SIGTERM's default action, and the run slept on). Forced
    here: a relay between the client and the server holds the pid line back until the run's handler is set and the
    client has been sent SIGTERM, then passes everything on."""
    script, env, path, folder = served
    marker, proxy = folder / "early", str(folder / "relay")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(proxy)
    listener.listen(1)
    listener.settimeout(120)
    proc = subprocess.Popen([sys.executable, "-S", CLIENT, script, "term", str(marker)], cwd=folder,
                            env=dict(env, DDPO_GRPO_FORKSERVER=proxy), stdout=subprocess.PIPE, text=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client, _ = listener.accept()
        client.settimeout(120)
        head, fds, _, _ = socket.recv_fds(client, 8, 3)
        body = _recv_exactly(client, struct.unpack("!Q", head)[0])
        server.connect(path)
        server.settimeout(120)
        socket.send_fds(server, [head], fds)
        server.sendall(body)
        for fd in fds:
            os.close(fd)
        pid_line = _read_line(server)
        assert pid_line.startswith(b"pid ")
        deadline = time.time() + 60
        while not (marker.exists() and marker.read_text()) and time.time() < deadline:
            time.sleep(0.02)
        assert marker.read_text() == "ready"  # the run's SIGTERM handler is set; its client has not heard of it yet
        proc.terminate()
        deadline = time.time() + 60
        while proc.poll() is None and not _pending(proc.pid, signal.SIGTERM) and time.time() < deadline:
            time.sleep(0.01)
        try:
            client.sendall(pid_line)
        except OSError:  # the client is gone: the assertions below say so
            pass
        while True:  # relay both ways ("sig 15" to the server, "rc 7" back) until the client hangs up
            ready, _, _ = select.select([client, server], [], [], 120)
            assert ready, "the relay heard nothing for 120 s"
            src = ready[0]
            data = src.recv(4096)
            if not data:
                break
            (server if src is client else client).sendall(data)
    finally:
        listener.close()
        server.close()  # (a run whose client is gone is killed by its supervisor: nothing is left running)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7 and "got SIGTERM" in out


def test_a_client_gone_with_the_pid_line_unread_takes_the_run_with_it(served):
    """A client killed after its request but before reading the pid line (its connection reset, not just closed) is
    a killed client like any other: the run and its children die (the supervisor used to die of the reset alone and
    the run, orphaned, held the test's pipes open)."""
    script, env, path, folder = served
    marker = folder / "unread"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps({"argv": [script, "sleep", str(marker)], "cwd": str(folder), "env": env,
                       "server": path}).encode()
    with open(os.devnull, "r+b") as null:
        socket.send_fds(conn, [struct.pack("!Q", len(body))], [null.fileno()] * 3)
    conn.sendall(body)
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        time.sleep(0.02)
    run_pid, child_pid = map(int, marker.read_text().split())
    assert select.select([conn], [], [], 120)[0]  # the pid line is there, unread
    conn.close()
    deadline = time.time() + 30
    while (_alive(run_pid) or _alive(child_pid)) and time.time() < deadline:
        time.sleep(0.02)
    assert not _alive(run_pid) and not _alive(child_pid)


def test_a_trainer_run_through_the_server_equals_one_in_a_fresh_interpreter(tmp_path, served):
    """The same tiny run (2 epochs, a checkpoint, a debug dump) through the hook and in a fresh interpreter: the same
    rewards, advantages and final weights, bit for bit (the runs are seeded and single-threaded)."""
    import json

    from safetensors.torch import load_file

    args = ["scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=2",
            "--config.sample.num_steps=3", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1",
            "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0",
            "--config.logging.wandb=False", "--config.logging.image_freq=0", "--config.logging.debug_dump=True",
            f"--config.logdir={tmp_path}"]
    env = cpu_env()
    served = conftest._fork_server(env, now=True)
    fork = subprocess.run([sys.executable, *args, "--config.run_name=fork"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert "fork_client.py" in " ".join(fork.args) or served is None
    plain = subprocess.run([sys.executable, *args, "--config.run_name=plain"], cwd=ROOT,
                           env=dict(env, DDPO_GRPO_TEST_FORK="0"), capture_output=True,
                           text=True, timeout=600)
    assert "fork_client.py" not in " ".join(plain.args)
    assert fork.returncode == plain.returncode == 0, fork.stderr[-2000:] + plain.stderr[-2000:]
    for epoch in (0, 1):
        a, b = (json.load(open(tmp_path / name / "debug" / f"epoch_{epoch:04d}_rank_0.json")) for name in
                ("fork", "plain"))
        assert a["rewards"] == b["rewards"] and a["advantages"] == b["advantages"]
        assert a["weights_sum"] == b["weights_sum"]
    last = [sorted((tmp_path / name / "checkpoints").glob("checkpoint_*"))[-1] for name in ("fork", "plain")]
    wa, wb = (load_file(str(d / "model.safetensors")) for d in last)
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_a_server_started_from_a_thread_outlives_the_thread_and_a_dead_one_is_restarted(served):
    """helpers.run_parallel starts runs from a thread pool, so the hook may start a server from a thread that then
    ends; the server must live on (it watches the worker process, not the thread: PR_SET_PDEATHSIG killed it, and every
    later run of its environment fell back to a fresh interpreter). A server killed from outside is started again on
    its environment's next run instead of its stale socket being handed out."""
    import threading

    script, _, _, folder = served
    env = cpu_env(PROBE="x", TOKENIZERS_PARALLELISM="false")  # an import-time variable: an environment of its own
    key = conftest.env_key(env)
    got = []
    try:
        t = threading.Thread(target=lambda: got.append(conftest._fork_server(env, now=True)))
        t.start()
        t.join()
        path = got[0]
        if path is None:
            pytest.skip("no fork server for this environment")
        time.sleep(1.5)  # PR_SET_PDEATHSIG's SIGTERM would have arrived by now
        assert conftest._running[key].poll() is None

        def run_pid(p):
            proc, pid, _ = start_sleeping_run(script, env, p, folder)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return pid, proc.pid

        pid, client = run_pid(path)
        assert pid != client  # served: the run is a fork of the server, not the client's own interpreter
        conftest._running[key].kill()
        conftest._running[key].wait(timeout=30)
        again = conftest._fork_server(env)
        assert again is not None and again != path and conftest._running[key].poll() is None
        pid, client = run_pid(again)
        assert pid != client
    finally:
        server = conftest._running.pop(key, None)
        if server is not None:
            server.kill()
        conftest._servers[key] = "first"

"""`python fork_client.py [-u] SCRIPT ARGS...` (or `-m MODULE ARGS...`): run SCRIPT through the suite's fork server (tests/forkserver.py, socket in
$DDPO_GRPO_FORKSERVER) as `python SCRIPT ARGS...` would run it, this process standing in for it: same stdio, signals
forwarded, the run's exit status (or signal) as its own. Where the server is absent or declines (an environment its
imports did not see), it executes the real interpreter. Imports only the standard library's small modules: it is the
process the test started, and its start-up is all it adds."""
import json
import os
import signal
import socket
import struct
import sys


def real_python(argv):
    env = dict(os.environ)
    env.pop("DDPO_GRPO_FORKSERVER", None)
    os.execve(sys.executable, [sys.executable, *argv], env)


def main(argv):
    path = os.environ.get("DDPO_GRPO_FORKSERVER")
    env = dict(os.environ)
    env.pop("DDPO_GRPO_FORKSERVER", None)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env, "server": path}).encode()
        socket.send_fds(conn, [struct.pack("!Q", len(body))], [0, 1, 2])
        conn.sendall(body)
    except (OSError, TypeError):
        real_python(argv)
    f = conn.makefile("rb")
    try:
        first = f.readline()
    except OSError:
        first = b""
    if not first.startswith(b"pid "):  # "fallback", or no answer: the run has not started, the interpreter runs it
        real_python(argv)

    def forward(signum, _frame):
        try:
            conn.sendall(f"sig {signum}\n".encode())
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    while True:
        try:
            line = f.readline()
        except OSError:
            line = b""
        if line.startswith(b"rc "):
            rc = int(line[3:])
            break
        if line == b"":
            sys.stderr.write("fork_client: the fork server ended before the run reported its exit status\n")
            os._exit(1)
    if rc < 0:  # the run died of a signal: so does its stand-in, as the test would see the real process die
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main(sys.argv[1:])

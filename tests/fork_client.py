"""`python fork_client.py [-u] SCRIPT ARGS...` (or `-m MODULE ARGS...`): run SCRIPT through the suite's fork server (tests/forkserver.py, socket in
$DDPO_GRPO_FORKSERVER) as `python SCRIPT ARGS...` would run it, this process standing in for it: same stdio, signals
forwarded, the run's exit status (or signal) as its own. Where the server is absent or declines (an environment its
imports did not see), it executes the real interpreter. Imports only the standard library's small modules: it is the
process the test started, and its start-up is all it adds."""
import json
import os
import select
import signal
import socket
import struct
import sys

# the signals a stand-in passes on to its run (the ones a test or a user sends to stop or poke a script)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def real_python(argv, mask):
    env = dict(os.environ)
    env.pop("DDPO_GRPO_FORKSERVER", None)
    # exec keeps the signal mask: the interpreter gets the one this process started with. A signal that arrived while
    # blocked (below) then acts on this process as on an interpreter that has not set a handler yet: the default.
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.execve(sys.executable, [sys.executable, *argv], env)


def main(argv):
    # Block the forwarded signals from before the request until the run's pid is read and forward() is installed. The
    # run may start (and set its own handlers) before this process reads the pid line; a signal in that window used to
    # kill this stand-in by its default action, leaving the run unsignalled (and, the pid line unread, the server saw a
    # reset connection and left the run orphaned: a test's communicate() timed out). Blocked, it stays pending and is
    # forwarded once unblocked below.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
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
        real_python(argv, mask)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    buf = b""

    def next_line() -> bytes:
        """The server's next line, b"" once it is gone. Waits in select() on the socket and a signal wakeup pipe, not
        in a blocking recv(): Python runs a handler between bytecodes, and a signal that lands after the interpreter's
        last check but before recv() blocks would have forward() wait for recv() to return, i.e. for the run's end."""
        nonlocal buf
        while b"\n" not in buf:
            ready, _, _ = select.select([conn, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)  # (its byte only woke select; the handler runs as select returns)
            if conn in ready:
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    return b""
                buf += data
        line, buf = buf.split(b"\n", 1)
        return line + b"\n"

    if not next_line().startswith(b"pid "):  # "fallback", or no answer: no run started, the interpreter runs it
        real_python(argv, mask)

    def forward(signum, _frame):
        try:
            conn.sendall(f"sig {signum}\n".encode())
        except OSError:
            pass

    signal.set_wakeup_fd(wake_w)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal pending since the request: forward() runs now
    while True:
        line = next_line()
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

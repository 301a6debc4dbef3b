"""How a run forked by the suite's fork server (tests/forkserver.py) ends: as the interpreter's shutdown does what a
test can see of it, without its teardown (finish), and the run's own open files, which that needs (track_opened).
Standard library only: imported by the server before it forks."""
import os
import sys

_OPENED = None  # in a run: a weakref.WeakSet of the files it opened (track_opened)


def track_opened() -> None:
    """In a run: every file it opens by open() / io.open (pathlib, tempfile and os.fdopen call these) is remembered
    weakly, for finish() to flush what the run left open, as a teardown would."""
    global _OPENED
    import builtins
    import io
    import weakref

    import _io

    _OPENED = weakref.WeakSet()
    plain = _io.open

    def opener(*args, **kwargs):
        f = plain(*args, **kwargs)
        _OPENED.add(f)
        return f

    builtins.open = io.open = _io.open = opener


def finish(code) -> None:
    """End a run as the interpreter's shutdown does what a test can see of it, without tearing its modules down: the
    status of a SystemExit's code, non-daemon threads joined, the atexit handlers (weakref.finalize's, logging's,
    multiprocessing's, the run's own), every open file's buffer flushed (a teardown flushes them as their objects
    die: track_opened's files), C stdio flushed; then _exit. The teardown itself (every module of torch, diffusers,
    transformers, wandb... and their objects freed, in a fork: each page their reference counts touch copied) cost
    ~1.5-2 s of CPU per run, measured on a forked child of this server: more than many runs' work."""
    import atexit
    import ctypes
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        status = 1
    threading._shutdown()  # Py_FinalizeEx's order: threads, then atexit, then the files
    atexit._run_exitfuncs()
    for f in list(_OPENED or ()):
        try:
            if not f.closed:
                f.flush()
        except Exception:  # a closed pipe's reader: as a teardown, nothing to report
            pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):  # (the run may have rebound them)
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            status = status or 120  # the interpreter's status when flushing stdout at exit fails
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass
    os._exit(status & 0xFF)

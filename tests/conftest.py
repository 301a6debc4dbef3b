"""The repository root on sys.path (the benchmark modules live in `benchmarks/` there, outside the installed library),
torch's threads per pytest-xdist worker, and `cache`: a fresh tiny-build cache per test module."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `make test` runs two workers: each takes its share of the cores
    import torch

    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    # and so do the Python runs a test starts with this environment (a test that wants threads sets its own): a run
    # with all the cores beside the other worker oversubscribes them, and on two cores a share of one lets the fork
    # server (below) serve it; without it, each was a fresh interpreter (~7 s of imports)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh tiny-build cache for a test module (the build itself is part of what is tested), for this process
    (models.TINY_CACHE) and, passed as DDPO_GRPO_TINY_CACHE, the trainer subprocesses."""
    import ddpo_grpo.models as models

    folder = tmp_path_factory.mktemp("tiny_builds")
    before = models.TINY_CACHE
    models.TINY_CACHE = str(folder)
    yield str(folder)
    models.TINY_CACHE = before


# --- script runs through the fork server (tests/forkserver.py): the suite starts a few hundred `python scripts/X.py`
# runs and `accelerate launch`es, each ~7-12 s of library imports before its first line of work (wandb.init's alone
# ~4 s); one server per pytest worker pays them once. DDPO_GRPO_TEST_FORK=0 (in the suite's environment or a run's)
# runs scripts in a fresh interpreter.
import atexit  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import forkserver  # noqa: E402

_servers = {}  # the import-time environment (JSON) -> the socket of its server, "first" (seen once), or None (none)
_running = {}  # the environment -> its server process, least recently used first
MAX_SERVERS = 4  # per pytest worker (each holds torch, diffusers, transformers, ... imported: ~0.5 GB)


def env_key(env: dict) -> str:
    """The import-time environment of `env` as a key: runs with equal keys can share a server."""
    return json.dumps(sorted(forkserver.import_sensitive(env).items()))


def _fork_server(env: dict, now: bool = False):
    """The socket of a server whose imports saw `env`'s import-time variables (started on the environment's second
    run, or at once with `now`), or None. Past MAX_SERVERS the least recently used server stops (its runs in flight
    go on: they are its children's children, not it)."""
    key = env_key(env)
    if key in _running and _running[key].poll() is not None:  # it died (killed from outside): start it again
        _running.pop(key)
        _servers[key] = "first"
    if key in _running:
        _running[key] = _running.pop(key)  # most recently used last
    if key not in _servers and not now:  # an environment's first run: the interpreter (a server costs a run's imports)
        _servers[key] = "first"
        return None
    if _servers.get(key, "first") == "first":  # its second: a server, which its later runs reuse
        _servers[key] = None
        if env.get("OMP_NUM_THREADS") != "1":  # more threads: a library would start a pool, and fork copies it
            return None
        while len(_running) >= MAX_SERVERS:
            old = next(iter(_running))
            _running.pop(old).kill()
            _servers[old] = "first"  # its next run starts it again
        folder = tempfile.mkdtemp(prefix="ddpo_fork_")
        path = os.path.join(folder, "s")
        with open(os.path.join(folder, "log"), "w") as log:
            server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "forkserver.py"), path], env=env,
                                      cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        atexit.register(server.kill)
        atexit.register(shutil.rmtree, folder, True)
        deadline = time.time() + 300
        while not os.path.exists(path) and server.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if os.path.exists(path):
            _servers[key], _running[key] = path, server
        else:
            server.kill()
    return _servers[key]


if os.environ.get("DDPO_GRPO_TEST_FORK", "1") != "0" and sys.platform.startswith("linux"):
    forkserver.install_popen_hook(_fork_server)

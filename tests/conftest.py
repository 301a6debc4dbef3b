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

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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

"""The unifiedscore client at scale, against scripts/bench_reward_server.py's local sleeping server: the in-flight
bound holds across overlapping calls, timeouts and retries end in NaN (or one clear error when asked), and the
benchmark runs. No timing assertions."""
import importlib.util
import os
import threading

import numpy as np
import pytest
import torch

import ddpo_grpo.worlds.recam  # noqa: F401  (registers unifiedscore)
from ddpo_grpo.worlds.recam.unifiedscore import make_unifiedscore
from ddpo_grpo.rewards import RewardComputer, RewardError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_reward_server", os.path.join(ROOT, "scripts", "bench_reward_server.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture
def server():
    srv = bench.SleepyScorer(delay=0.05, hang=1.0).start()
    try:
        yield srv
    finally:
        srv.stop()


def images(n):
    return torch.rand((n, 3, 8, 8), generator=torch.Generator().manual_seed(n))


def test_in_flight_requests_are_bounded_across_concurrent_calls(server):
    fn = make_unifiedscore(base_url=server.url, max_workers=3, timeout=10, retries=0)
    results = []

    def call(tag):
        results.append(fn(images(6), [f"{tag} {i}" for i in range(6)], [{}] * 6)[0])

    threads = [threading.Thread(target=call, args=(t,)) for t in ("a", "b", "c")]  # 3 batches scored at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.count == 18 and all(np.allclose(r, 0.8) for r in results)
    assert 1 <= server.max_in_flight <= 3 + 1  # +1: a response being written while the next request arrives


def test_concurrency_is_used(server):
    fn = make_unifiedscore(base_url=server.url, max_workers=4, timeout=10, retries=0)
    scores, _ = fn(images(12), ["p"] * 12, [{}] * 12)
    assert np.allclose(scores, 0.8) and server.max_in_flight >= 2


def test_timeout_then_retries_end_in_nan(server):
    fn = make_unifiedscore(base_url=server.url, max_workers=2, timeout=0.2, retries=1, backoff=0.01)
    scores, det = fn(images(3), ["hang x", "ok", "hang y"], [{}] * 3)
    assert np.isnan(scores[0]) and np.isnan(scores[2]) and scores[1] == pytest.approx(0.8)
    assert det["unifiedscore_failed"].tolist() == [1, 0, 1]
    assert server.count == 2 * 2 + 1  # each hanging request: 1 attempt + 1 retry


def test_server_down_is_one_clear_error_when_asked(server):
    fn = make_unifiedscore(base_url=server.url, max_workers=2, timeout=5, retries=2, backoff=0.01,
                           raise_if_all_fail=True)
    with pytest.raises(RuntimeError, match=r"all 2 requests to http://127\.0\.0\.1:\d+/v1/chat/completions failed "
                                           r"after 3 attempt\(s\) each; last error: HTTP 503"):
        fn(images(2), ["fail", "fail"], [{}] * 2)
    assert server.count == 6
    scores, _ = fn(images(2), ["fail", "ok"], [{}] * 2)  # one good answer: no error, the failure is NaN
    assert np.isnan(scores[0]) and scores[1] == pytest.approx(0.8)
    port = server.server_address[1]
    server.stop()
    rc = RewardComputer({"unifiedscore": 1.0}, {"unifiedscore": {"base_url": f"http://127.0.0.1:{port}/v1",
                                                                  "timeout": 1, "retries": 0,
                                                                  "raise_if_all_fail": True}})
    with pytest.raises(RewardError, match="reward 'unifiedscore' failed: .*all 2 requests .* last error: URLError"):
        rc(images(2), ["a", "b"], [{}] * 2)


def test_benchmark_runs_and_writes_json(tmp_path):
    out = bench.main(["--requests", "8", "--batches", "2", "--delay", "0.01", "--sample-seconds", "0.01",
                      "--workers", "4", "--out", str(tmp_path / "b.json")])
    assert (tmp_path / "b.json").exists() and len(out["runs"]) == 4
    assert all(r["requests"] == 8 for r in out["runs"])
    assert {(r["workers"], r["overlap"]) for r in out["runs"]} == {(1, False), (1, True), (4, False), (4, True)}

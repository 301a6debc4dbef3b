"""unifiedscore: the OpenAI-compatible scoring client against a local fake server (127.0.0.1, port 0)."""
from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_grpo.worlds.recam.unifiedscore import make_unifiedscore, parse_final_score
from ddpo_grpo.rewards import ConfigError, RewardComputer, get_reward_fn


class FakeScorer(ThreadingHTTPServer):
    """Behaviour per request is chosen by a keyword in the prompt text:
    good -> "Final Score: 4"; garbage -> no score; slow -> sleeps past the client timeout;
    flaky -> HTTP 500 on the first request of each prompt, then "Final Score: 3"; notfound -> 404."""

    daemon_threads = True
    block_on_close = False

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.requests = []  # (path, headers, body)
        self.seen = {}
        self.slow_seconds = 0.6


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def _answer(self, code, payload):
        data = json.dumps(payload).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout) and closed the socket
            pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        with srv.lock:
            srv.requests.append((self.path, dict(self.headers), body))
            n = srv.seen[text] = srv.seen.get(text, 0) + 1
        if self.path != "/v1/chat/completions" or "notfound" in text:
            return self._answer(404, {"error": "not found"})
        if "slow" in text:
            time.sleep(srv.slow_seconds)
            content = "Final Score: 5"
        elif "garbage" in text:
            content = "I think this picture is rather nice."
        elif "flaky" in text and n == 1:
            return self._answer(500, {"error": "overloaded"})
        elif "flaky" in text:
            content = "Looks fine.\nFinal Score: 3"
        else:
            content = "The camera moved as asked, colours kept.\nFinal Score: 4"
        self._answer(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def server():
    srv = FakeScorer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=2)


def url(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}/v1"


def images(n, seed=0):
    return torch.rand((n, 3, 32, 32), generator=torch.Generator().manual_seed(seed))


def test_parse_final_score():
    assert parse_final_score("blah\nFinal Score: 4") == 4.0
    assert parse_final_score("**Final Score:** 3.5") == 3.5
    assert parse_final_score("final score 2") == 2.0
    assert parse_final_score("Final Score: 2 ... Final Score: 5") == 5.0  # the last one counts
    assert parse_final_score("Final Score: 7") is None  # out of range
    assert parse_final_score("no score here") is None
    assert parse_final_score(None) is None


def test_good_answers_and_request_format(server):
    fn = get_reward_fn("unifiedscore", base_url=url(server), model="UnifiedReward-qwen-7b", timeout=5, retries=0,
                       max_workers=4, api_key="sk-test")
    imgs = images(3)
    prompts = [f"good pan (+{i},-2) zoom 1.10" for i in range(3)]
    scores, det = fn(imgs, prompts, [{} for _ in prompts])
    np.testing.assert_allclose(scores, [0.8, 0.8, 0.8])
    np.testing.assert_array_equal(det["unifiedscore_failed"], [0, 0, 0])
    np.testing.assert_array_equal(det["unifiedscore_raw"], [4, 4, 4])
    assert len(server.requests) == 3
    by_text = {}
    for path, headers, body in server.requests:
        assert path == "/v1/chat/completions"
        assert headers["Authorization"] == "Bearer sk-test" and headers["Content-Type"] == "application/json"
        assert body["model"] == "UnifiedReward-qwen-7b"
        parts = body["messages"][0]["content"]
        img_part = next(p for p in parts if p["type"] == "image_url")
        text = next(p["text"] for p in parts if p["type"] == "text")
        data_url = img_part["image_url"]["url"]
        assert data_url.startswith("data:image/png;base64,")
        by_text[text] = np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))))
    for i, p in enumerate(prompts):  # every prompt was asked about, with its own image
        text = next(t for t in by_text if p in t)
        assert "Final Score" in text
        expected = (imgs[i] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(by_text[text], expected)


def test_garbage_answer_is_nan_not_zero(server):
    fn = make_unifiedscore(base_url=url(server), timeout=5, retries=1, backoff=0.01)
    scores, det = fn(images(2), ["good", "garbage"], [{}, {}])
    assert scores[0] == pytest.approx(0.8) and np.isnan(scores[1])
    np.testing.assert_array_equal(det["unifiedscore_failed"], [0, 1])
    assert server.seen[next(t for t in server.seen if "garbage" in t)] == 2  # retried once
    fn = make_unifiedscore(base_url=url(server), timeout=5, retries=3, backoff=0.01, retry_unparseable=False)
    scores, _ = fn(images(1), ["garbage again"], [{}])
    assert np.isnan(scores[0]) and server.seen[next(t for t in server.seen if "garbage again" in t)] == 1


def test_slow_server_times_out_to_nan_quickly(server):
    fn = make_unifiedscore(base_url=url(server), timeout=0.2, retries=1, backoff=0.01, max_workers=4)
    t0 = time.monotonic()
    scores, det = fn(images(3), ["slow a", "good b", "slow c"], [{}] * 3)
    elapsed = time.monotonic() - t0
    assert np.isnan(scores[0]) and np.isnan(scores[2]) and scores[1] == pytest.approx(0.8)
    np.testing.assert_array_equal(det["unifiedscore_failed"], [1, 0, 1])
    assert server.seen[next(t for t in server.seen if "slow a" in t)] == 2  # 1 + 1 retry
    assert elapsed < 1.5, elapsed


def test_server_error_then_success_on_retry(server):
    fn = make_unifiedscore(base_url=url(server), timeout=5, retries=2, backoff=0.01)
    scores, det = fn(images(2), ["flaky x", "flaky y"], [{}, {}])
    np.testing.assert_allclose(scores, [0.6, 0.6])
    np.testing.assert_array_equal(det["unifiedscore_failed"], [0, 0])
    assert sorted(server.seen.values()) == [2, 2]
    fn0 = make_unifiedscore(base_url=url(server), timeout=5, retries=0)
    scores, det = fn0(images(1), ["flaky z"], [{}])  # no retries: the 500 stays a failure
    assert np.isnan(scores[0]) and det["unifiedscore_failed"][0] == 1


def test_client_errors_are_not_retried_and_refused_connections_fail(server):
    fn = make_unifiedscore(base_url=url(server), timeout=5, retries=3, backoff=0.01)
    scores, _ = fn(images(1), ["notfound"], [{}])
    assert np.isnan(scores[0]) and server.seen[next(iter(server.seen))] == 1
    # a port nobody listens on (a closed server's port)
    dead = FakeScorer()
    port = dead.server_address[1]
    dead.server_close()
    fn = make_unifiedscore(base_url=f"http://127.0.0.1:{port}/v1", timeout=0.5, retries=1, backoff=0.01)
    scores, det = fn(images(2), ["good", "good"], [{}, {}])
    assert np.isnan(scores).all() and det["unifiedscore_failed"].tolist() == [1, 1]


def test_reward_computer_marks_failures_invalid(server):
    rc = RewardComputer({"unifiedscore": 1.0}, {"unifiedscore": {"base_url": url(server), "timeout": 5,
                                                                  "retries": 0}})
    res = rc(images(3), ["good", "garbage", "good"], [{}] * 3)
    assert res.valid.tolist() == [True, False, True] and res.invalid_count == 1
    assert res.final[0] == pytest.approx(0.8) and math.isnan(res.final[1])
    assert res.details["unifiedscore/unifiedscore_failed"].tolist() == [0, 1, 0]


def test_non_finite_image_is_not_sent(server):
    x = images(2)
    x[0, 0, 0, 0] = float("nan")
    scores, det = make_unifiedscore(base_url=url(server), timeout=5, retries=0)(x, ["good", "good"], [{}, {}])
    assert np.isnan(scores[0]) and scores[1] == pytest.approx(0.8) and len(server.requests) == 1


def test_bad_options():
    for kw in ({"base_url": "127.0.0.1:30000"}, {"timeout": 0}, {"retries": -1}, {"max_workers": 0}):
        with pytest.raises(ConfigError):
            get_reward_fn("unifiedscore", **kw)
    with pytest.raises(ConfigError):
        get_reward_fn("unifiedscore", no_such_option=1)

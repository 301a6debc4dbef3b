"""An epoch's reward time against a remote scoring server: serial vs concurrent requests, and with vs without
overlap with sampling. The server is a local OpenAI-compatible stand-in that sleeps `--delay` s per request
(threaded: requests overlap as on a batching vLLM/SGLang server); the client is the trainer's own
`unifiedscore` reward through RewardComputer, exactly as scripts/train.py runs it.

    python scripts/bench_reward_server.py [--requests 64] [--batches 4] [--delay 0.2] [--sample-seconds 0.8]
                                          [--workers 16] [--out docs/bench_reward_server.json]

Sampling is simulated (a sleep of --sample-seconds per batch: about what the tiny model takes on a CPU for a
batch of 16) unless --real-sampling, which samples the bundled tiny-t2i model for real.
Modes:  no overlap: sample every batch, then score them all;  overlap: each batch's rewards are submitted in
the background as soon as it is sampled (what the trainer does), so scoring hides behind the next batch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SleepyScorer(ThreadingHTTPServer):
    """POST /v1/chat/completions -> "Final Score: 4" after `delay` s. Tracks requests and the most in flight.
    A prompt containing "fail" gets HTTP 503; one containing "hang" sleeps `hang` s (past a client timeout)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # listen backlog: a burst of concurrent connections must not be refused

    def __init__(self, delay: float = 0.2, hang: float = 2.0, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.delay, self.hang = delay, hang
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.count = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> "SleepyScorer":
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def reset(self) -> None:
        with self.lock:
            self.in_flight = self.max_in_flight = self.count = 0


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        with srv.lock:
            srv.count += 1
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            time.sleep(srv.hang if "hang" in text else srv.delay)
            code, payload = (503, {"error": "overloaded"}) if "fail" in text else (
                200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Final Score: 4"}}]})
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client timed out and closed the socket
            pass
        finally:
            with srv.lock:
                srv.in_flight -= 1


def _sampler(args):
    """Returns sample(batch_index) -> images (B, 3, 32, 32): a sleep, or the tiny model for real."""
    if not args.real_sampling:
        def fake(i):
            time.sleep(args.sample_seconds)
            return torch.rand((args.requests // args.batches, 3, 32, 32), generator=torch.Generator().manual_seed(i))
        return fake
    from ddpo_grpo.core.pipeline_with_logprob import encode_prompts
    from ddpo_grpo.models import load_pipeline

    pipe = load_pipeline("tiny-t2i")
    emb = encode_prompts(pipe.text_encoder, pipe.tokenizer, ["a red square"] * (args.requests // args.batches))
    pipe.scheduler.set_timesteps(10)

    @torch.no_grad()
    def real(i):
        x = torch.randn((emb.shape[0], *pipe.sample_shape), generator=torch.Generator().manual_seed(i))
        for t in pipe.scheduler.timesteps:
            x = pipe.scheduler.step(pipe.unet(x, t, emb).sample, t, x).prev_sample
        return (x.clamp(-1, 1) + 1) / 2
    real(0)  # warm-up: the first call pays for allocation and kernel selection
    return real


def run_epoch(args, server, workers: int, overlap: bool, sample) -> dict:
    from ddpo_grpo.rewards import RewardComputer
    import ddpo_grpo.worlds.recam  # noqa: F401  (registers unifiedscore)

    server.reset()
    kwargs = {"unifiedscore": {"base_url": server.url, "max_workers": workers, "timeout": 30, "retries": 0}}
    executor = ThreadPoolExecutor(args.reward_threads) if overlap else None
    rc = RewardComputer({"unifiedscore": 1.0}, kwargs, executor=executor)
    t0 = time.perf_counter()
    futures, batches, t_sampling = [], [], 0.0
    for b in range(args.batches):
        s0 = time.perf_counter()
        images = sample(b)
        t_sampling += time.perf_counter() - s0
        prompts = [f"pan left {b}-{i}" for i in range(len(images))]
        if overlap:
            futures.append(rc.submit(images, prompts, [{}] * len(images)))  # in the background, as the trainer
        else:
            batches.append((images, prompts))
    r0 = time.perf_counter()
    results = [f.result() for f in futures] if overlap else [rc(im, pr, [{}] * len(im)) for im, pr in batches]
    wait = time.perf_counter() - r0
    total = time.perf_counter() - t0
    if executor is not None:
        executor.shutdown()
    scores = np.concatenate([r.final for r in results])
    assert len(scores) == args.requests and np.isfinite(scores).all(), \
        f"{int((~np.isfinite(scores)).sum())} of {len(scores)} requests failed ({server.count} reached the server)"
    return {"workers": workers, "overlap": overlap, "epoch_seconds": round(total, 3),
            "sampling_seconds": round(t_sampling, 3), "reward_wait_after_sampling_seconds": round(wait, 3),
            "requests": server.count, "max_in_flight": server.max_in_flight}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.2, help="server seconds per request")
    ap.add_argument("--sample-seconds", type=float, default=0.8, help="simulated sampling seconds per batch")
    ap.add_argument("--real-sampling", action="store_true", help="sample the bundled tiny-t2i model instead")
    ap.add_argument("--workers", type=int, default=16, help="unifiedscore max_workers of the concurrent runs")
    ap.add_argument("--reward-threads", type=int, default=1, help="reward.num_threads (the overlap executor)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    server = SleepyScorer(args.delay).start()
    sample = _sampler(args)
    runs = []
    try:
        for workers in (1, args.workers):
            for overlap in (False, True):
                r = run_epoch(args, server, workers, overlap, sample)
                runs.append(r)
                print(f"{'serial' if workers == 1 else 'concurrent':10s} workers={workers:<3d} "
                      f"{'overlap   ' if overlap else 'no overlap'}  epoch {r['epoch_seconds']:6.2f} s  "
                      f"(sampling {r['sampling_seconds']:.2f} s, reward wait after sampling "
                      f"{r['reward_wait_after_sampling_seconds']:.2f} s, max in flight {r['max_in_flight']})", flush=True)
    finally:
        server.stop()
    out = {"setup": {"requests": args.requests, "batches": args.batches, "server_delay_s": args.delay,
                     "sampling": "tiny-t2i" if args.real_sampling else f"sleep {args.sample_seconds} s/batch",
                     "reward_threads": args.reward_threads, "cpus": os.cpu_count()}, "runs": runs}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

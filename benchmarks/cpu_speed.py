"""How fast this CPU is right now, on the kind of work the test suite does: one thread, a fixed seeded workload of
small-model training steps (float32 convolutions and matmuls, and many small ops, where Python and dispatch overhead
count as in the suite's tiny runs). benchmarks/suite_time.sh runs it before and after the suite, so that a suite time
can be read against the machine it was measured on: the same commit has read 8 min 20 s and 16 min 30 s on this
project's CPU machines (docs/performance.md), and on one machine the suite's slowest test took 60 s, then 89 s an
hour later.

    python benchmarks/cpu_speed.py            # prints {"seconds": S, "repeats": [...]}: S the median of 3 repeats
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def workload(seed: int = 0) -> float:
    """~2-3 s on the 2026-12 CPU machine: 40 Adam steps of a small conv net on (16, 3, 32, 32), 2,000 small
    elementwise ops and 20 matrix-vector products with a 64 MB matrix (memory-bound, as a large model's forward on a
    CPU is). Returns a number from the result so that nothing is skipped."""
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(32, 32, 3, padding=1),
                              torch.nn.SiLU(), torch.nn.Flatten(), torch.nn.Linear(32 * 32 * 32, 64))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(16, 3, 32, 32, generator=g)
    y = torch.randn(16, 64, generator=g)
    for _ in range(40):
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    small = torch.randn(64, generator=g)
    for _ in range(2000):
        small = (small * 0.999 + 0.001).tanh()
    w = torch.randn(4096, 4096, generator=g)  # 64 MB: read from memory, not cache, as a large model's weights are
    v = torch.randn(4096, 8, generator=g)
    for _ in range(20):
        v = torch.tanh(w @ v / 64.0)
    return float(loss.detach()) + float(small.sum()) + float(v.sum())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    workload()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        workload()
        times.append(round(time.perf_counter() - start, 3))
    print(json.dumps({"seconds": statistics.median(times), "repeats": times}))


if __name__ == "__main__":
    main()

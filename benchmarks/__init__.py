"""Benchmarks of the trainer (not part of the installed library): `bench_floor` (the bare-loop floor and eval),
`bench_runs` (timed training runs), `bench_efficacy` (learning curves), `bench_plots` (their figures),
`bench_report` (the markdown report). Run from the repository root, e.g.
`python -m benchmarks.bench_floor ...`; scripts/bench.py and scripts/bench_gpu.py import them from here (bench_gpu's
measured point: `bench_gpu_point`). Beside them, the measurements behind the docs (memory_table, onpolicy_dtype,
rescore_cost, recam_heldout, plot_*), research and probe scripts (step_credit, recam_follow, probe_fsdp2_gloo) and
the scripts that made the bundled models in assets/ (pretrain_tiny, pretrain_recam, pretrain_recam_video)."""

import sys as _sys
from typing import NoReturn as _NoReturn


class BadInput(SystemExit):
    """A benchmark's refusal of its input (an option, a file or a folder of the wrong kind): exit status 2, as
    scripts/train.py's for a bad config; str() is the one line `refuse` printed, so a test can match it."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(message: str) -> _NoReturn:
    """Print `error: <message>` on stderr as one line and exit 2 (raises BadInput). A bare SystemExit("...") prints
    its message but exits 1, the status of a run that failed rather than of input refused before any work."""
    line = " ".join(str(message).split())
    print(f"error: {line}", file=_sys.stderr, flush=True)
    raise BadInput(line)

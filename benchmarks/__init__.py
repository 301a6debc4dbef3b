"""Benchmarks of the trainer (not part of the installed library): `bench_floor` (the bare-loop floor and eval),
`bench_runs` (timed training runs), `bench_efficacy` (learning curves), `bench_plots` (their figures),
`bench_report` (the markdown report). Run from the repository root, e.g.
`python -m benchmarks.bench_floor ...`; scripts/bench.py and scripts/bench_gpu.py import them from here."""

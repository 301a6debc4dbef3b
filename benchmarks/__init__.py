"""Benchmarks of the trainer (not part of the installed library): `bench_floor` (the bare-loop floor and eval),
`bench_runs` (timed training runs), `bench_efficacy` (learning curves), `bench_plots` (their figures),
`bench_report` (the markdown report). Run from the repository root, e.g.
`python -m benchmarks.bench_floor ...`; scripts/bench.py and scripts/bench_gpu.py import them from here (bench_gpu's
measured point: `bench_gpu_point`). Beside them, the measurements behind the docs (memory_table, onpolicy_dtype,
rescore_cost, recam_heldout, plot_*), research and probe scripts (step_credit, recam_follow, probe_fsdp2_gloo) and
the scripts that made the bundled models in assets/ (pretrain_tiny, pretrain_recam, pretrain_recam_video)."""

"""The run around the epochs: its context, data, devices, engines, identity, checkpoints and reports.

`validate` checks a config first (one line per mistake, before anything loads), then `build` turns it into the
RunContext every step reads, from `data` (conditions by index and the k-repeat sampler), `embeddings` (each prompt
encoded once), `devices` (CPU / CUDA / NPU setup and the launch checks) and `scale` (the sharded engines, FSDP2 /
DeepSpeed); `run_identity` agrees one run name and folder across machines, `checkpointing` saves and resumes (step
8), `reporting` logs each epoch and eval and writes the run's summary (steps 6-7), and `startup` says where the time
before the first sample went."""

"""What the run checks about itself: the GRPO invariants, reward hacking and whether it fits in memory.

`verification` (step 4: the GRPO invariants on every epoch's data), `onpolicy` (the ratio and the sampler/trainer gap
before the epoch's first update),
`hacking` (reward-hacking guardrails: a held-out gold reward, drift monitors, an alarm) and `memory_plan` (what the
run holds per device and whether it fits, printed before anything loads), with the model counts it plans from, made on
the meta device, in `meta_counts`."""

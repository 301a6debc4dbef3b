"""The trainer, in three rooms; `scripts/train.py` runs them, one epoch after another.

- `epoch/`: the epoch's steps, in order: `sampling` (trajectories, rewards started), `advantages`, `rescoring` (the
  ratio's old log-probs), `training` (GRPO) / `training_forward` (RAFT, NFT; what both share: `update`), `evaluation`,
  with `supervised` (the supervised term) and `metrics` (how each number is reduced).
- `run/`: what carries the epochs: `validate` (a config's mistakes, one line each, before anything loads), `build`
  (config -> RunContext), `data`, `embeddings`, `devices`, `scale` (sharded engines), `run_identity`, `checkpointing`,
  `reporting`, `startup`.
- `checks/`: what the run checks about itself: `verification` (the GRPO invariants, every epoch), `onpolicy` (ratio 1
  before the first update), `hacking` (reward hacking guardrails) and `memory_plan` (does it fit, before anything loads; its counts: `meta_counts`)."""

"""The training loop's parts, in epoch order: `build` (config -> RunContext, validation), `data`, `sampling`,
`advantages`, `verification`, `training` / `training_forward` (what both share: `update`), `evaluation`, `reporting`
(metrics, image grids, reward curve), `checkpointing`; plus `supervised` (the supervised term) and `devices` (CPU /
GPU / NPU setup). `scripts/train.py` runs them."""

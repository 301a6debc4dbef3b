"""The epoch's steps, one module each, in the order scripts/train.py calls them.

`sampling` (step 1: trajectories with log-probs, rewards started in the background), `advantages` (step 3:
group-relative, over every process), `rescoring` (the old log-probs of the clipped ratio and a training call's rows),
`training` (step 5: the clipped-ratio GRPO update) or `training_forward` (RAFT / DiffusionNFT), both planned by
`update` (which steps are trained, the call plan, the optimizer step), and `evaluation` (step 7: deterministic
held-out eval); `supervised` adds the optional supervised term to the loss and `metrics` says how each training number
is reduced over calls and processes. Step 4 (the invariants) is checks/verification.py; reporting and checkpoints
(steps 6-8) are run/'s."""

"""The named configs' recipes, by task; config/grpo.py is their index (`--config config/grpo.py:NAME`).

blocks.py: what several recipes share (config/base.py as `base`, the batch geometry, Flow-GRPO's SDE, the tiny and
full-size family settings, the NFT demo's update); toy.py: the toy-world tasks on the bundled tiny models; recam.py:
camera control; families.py: one section per model family (its tiny build, the config for a user's folder)."""

"""Branched trajectories: the tree, its sibling groups and node values (TempFlow-GRPO, BranchGRPO).

Why: on the demo task the outcome is decided by x_T and the first denoising steps. With one independent
trajectory per sample, a group's reward spread is mostly x_T's luck and every step is credited with it. A tree
shares x_T and a deterministic trunk, and splits only at chosen steps: at split d, each node takes K stochastic
steps from the same state, and everything else runs deterministically (DDIM eta 0 / the flow ODE, which share the
marginals of the stochastic processes). The K children of one node are a group, and each child's value is the mean
reward of the leaves below it. So the advantage at column d measures what that step's noise did, and nothing else.

Layout: a tree of D = len(steps) splits with K branches has L = K**D leaves. A batch holds whole trees; the leaves
of tree n are rows n*L ... n*L + L - 1. Leaf l passes through node l // K**(D - d) at depth d; depth 0 is the root
(x_T and the trunk), and depth D is the leaves. Column d of a leaf is the stochastic step of split d, from its node at
depth d to its node at depth d + 1. That transition is shared by the K**(D - d - 1) leaves below the child. Its
**owner**, the child's first leaf, carries the advantage and is trained; the other leaves carry 0 at column d and
are not trained there, so no transition is counted twice.

This module owns the tree rule. The sampler (`pipeline_with_logprob`), the advantages and the live check
(trainer/checks/verification.py) all call it. Nothing here imports the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class BranchSpec:
    """steps: increasing schedule positions where every node splits; branches: K >= 2 children per split."""

    steps: Tuple[int, ...]
    branches: int

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))

    @property
    def depth(self) -> int:
        return len(self.steps)

    @property
    def leaves(self) -> int:
        """L = K**D leaves per tree."""
        return self.branches ** self.depth

    def check(self, stochastic_steps: int) -> None:
        """Raise ValueError (one line) unless the spec is a tree the sampler can draw: at least one split, K >= 2,
        and strictly increasing split steps among the first `stochastic_steps` (the steps with positive variance)."""
        if not self.steps:
            raise ValueError("branch steps are empty: give at least one step to split at")
        if self.branches < 2:
            raise ValueError(f"branches={self.branches}: a split needs at least 2 children to compare")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError(f"branch steps {list(self.steps)} must be strictly increasing")
        bad = [s for s in self.steps if not 0 <= s < stochastic_steps]
        if bad:
            raise ValueError(f"branch step {bad[0]} is outside the schedule's {stochastic_steps} stochastic steps "
                             f"(0 ... {stochastic_steps - 1})")

    def leaves_below(self, depth: int) -> int:
        """Leaves under one node at `depth` (K**(D - depth))."""
        return self.branches ** (self.depth - depth)

    def owners(self, n: int, column: int) -> np.ndarray:
        """(n,) bool for n leaf rows (whole trees): the leaves that own column `column`'s transition (the first leaf
        under each child at depth column + 1)."""
        return np.arange(n) % self.leaves_below(column + 1) == 0

    def owner_cells(self, n: int) -> np.ndarray:
        """(n, D) bool: owners(n, d) for every column, the cells a tree's structure trains (valid or not)."""
        return np.stack([self.owners(n, d) for d in range(self.depth)], axis=1)

    def node_values(self, rewards: np.ndarray, column: int) -> np.ndarray:
        """rewards (n,) per leaf, n = trees * L -> (trees * K**(column + 1),) the value of each child at column
        `column`: the mean reward of the leaves below it, in owner-row order."""
        r = np.asarray(rewards, dtype=np.float64)
        return r.reshape(-1, self.leaves_below(column + 1)).mean(axis=1)

    def sibling_keys(self, conditions: Sequence, column: int) -> List[tuple]:
        """The group key of each owner row of column `column`, in owner-row order: (condition, tree, column,
        parent node). conditions (n,): each leaf row's condition key. The K children of one parent share a key."""
        n = len(conditions)
        rows = np.flatnonzero(self.owners(n, column))
        L = self.leaves
        return [(conditions[r], int(r // L), column, int((r % L) // self.leaves_below(column))) for r in rows]


def tree_advantages(tracker, spec: BranchSpec, conditions: Sequence, rewards: np.ndarray,
                    valid_trees: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per-column advantages of whole trees.

    conditions (n,) condition keys; rewards (n,) per leaf; valid_trees (n // L,) bool: trees that take part (a
    tree with an invalid leaf has no node values). tracker: a PerPromptStatTracker; each column's sibling groups
    are normalised by its `update` (the zero-spread rule included).
    Returns (advantages (n, D) float32, cell_mask (n, D) bool): the owner cells of valid trees are True and carry
    the sibling-normalised node value; every other cell is 0 and False."""
    n, D = len(rewards), spec.depth
    adv = np.zeros((n, D), dtype=np.float32)
    cells = np.zeros((n, D), dtype=bool)
    leaf_valid = np.repeat(np.asarray(valid_trees, dtype=bool), spec.leaves)
    for d in range(D):
        owner_rows = np.flatnonzero(spec.owners(n, d))
        keep = leaf_valid[owner_rows]
        if not keep.any():
            continue
        rows = owner_rows[keep]
        values = spec.node_values(np.where(leaf_valid, rewards, 0.0), d)[keep]
        keys = [k for k, ok in zip(spec.sibling_keys(conditions, d), keep) if ok]
        adv[rows, d] = tracker.update(keys, values)
        cells[rows, d] = True
    return adv, cells

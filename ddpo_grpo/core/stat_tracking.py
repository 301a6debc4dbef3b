"""Group-relative advantages: rewards are normalised within the group of samples that share a key.

A key is the condition the k samples were generated from: a prompt string, a dataset index, a
tuple such as (sample_id, budget). The class name is kept from ddpo-pytorch's tracker.

Zero spread: a (group, column) whose reward std is <= eps gets advantage exactly 0 in every
std mode that uses a per-key baseline; otherwise the division is by the plain std (no "+ eps"),
so in "group" mode every other (group, column) has advantage mean 0 and std exactly 1.
Stds are population stds (ddof=0, in float64), like np.std. eps is therefore a threshold in reward
units: differences smaller than it are treated as noise rather than amplified to unit scale.
`zero_spread` is the one definition of this rule; the live check (verification.py) calls it too.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Dict, Hashable, List, Optional, Sequence, Union

import numpy as np
import torch

STD_MODES = ("group", "global", "none", "running")
ZERO_SPREAD_EPS = 1e-4  # default eps: reward differences at or below it are noise, not signal
ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[float]]


def column_std(rewards: np.ndarray) -> np.ndarray:
    """(n, T) rewards -> (T,) population std per column, computed in float64 whatever the input dtype."""
    return np.asarray(rewards, dtype=np.float64).std(axis=0)


def zero_spread(rewards: np.ndarray, eps: float = ZERO_SPREAD_EPS) -> np.ndarray:
    """(n, T) rewards of one group -> (T,) bool: the columns that carry no signal (std <= eps).

    The tracker gives these (group, column) cells advantage exactly 0 and the verification expects
    exactly that: both call this function, so near-ties (k rewards that differ by float noise) are
    treated the same way by the math and by its check."""
    return column_std(rewards) <= eps


def _normalize_key(key: Any) -> Hashable:
    """Numpy/torch scalars become Python scalars: np.int64(3) and 3 must be one group, a 0-d
    tensor hashes by identity, and Python scalars survive torch.load(weights_only=True)."""
    if isinstance(key, torch.Tensor):
        if key.numel() != 1:
            raise TypeError(f"a key must be a scalar, got a tensor of shape {tuple(key.shape)}")
        return key.item()
    if isinstance(key, np.generic):
        return key.item()
    if isinstance(key, np.ndarray):
        if key.size != 1:
            raise TypeError(f"a key must be a scalar, got an array of shape {key.shape}")
        return key.item()
    if isinstance(key, tuple):
        return tuple(_normalize_key(k) for k in key)
    hash(key)
    return key


def _to_float64(rewards: ArrayLike) -> np.ndarray:
    if isinstance(rewards, torch.Tensor):
        return rewards.detach().to("cpu", torch.float64).numpy()
    return np.asarray(rewards, dtype=np.float64)


class PerPromptStatTracker:
    """Turns rewards into advantages, normalising within groups of samples that share a key.

    std_mode:
      - "group":   A = (r - mean_key) / std_key                     (GRPO, Flow-GRPO default)
      - "global":  A = (r - mean_key) / std_batch                   (Flow-GRPO's global_std)
      - "none":    A = r - mean_key                                 (Dr. GRPO, nanochat)
      - "running": A = (r - running_mean) / running_std, with a running global mean/std mixed by
        EMA across update() calls (global running reward normalisation). There is no per-key
        baseline in this mode: keys only feed the statistics.
    For (B, T) rewards every statistic is per column t (per denoising step).

    buffer_size: if set, DDPO's original per-key history: a deque of the last buffer_size rewards
    of each key, kept across epochs (clear() does not reset it); the current batch is appended
    before the statistics are taken; while a key has fewer than min_count rewards in its history
    the batch's global mean and std are used instead. mean_key/std_key above then come from the
    history. Not available with "running".
    Without a buffer, each update() call normalises within its own batch.
    """

    def __init__(self, std_mode: str = "group", buffer_size: Optional[int] = None, min_count: int = 16,
                 eps: float = ZERO_SPREAD_EPS, ema_decay: float = 0.99) -> None:
        if std_mode not in STD_MODES:
            raise ValueError(f"std_mode must be one of {STD_MODES}, got {std_mode!r}")
        if buffer_size is not None:
            if buffer_size < 1:
                raise ValueError(f"buffer_size must be >= 1 or None, got {buffer_size}")
            if std_mode == "running":
                raise ValueError("buffer_size has no effect in 'running' mode (no per-key baseline)")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.std_mode = std_mode
        self.buffer_size = buffer_size
        self.min_count = int(min_count)
        self.eps = float(eps)
        self.ema_decay = float(ema_decay)
        self.history: Dict[Hashable, deque] = {}
        self.running_mean: Optional[np.ndarray] = None  # (T,); T = 1 for (B,) rewards
        self.running_var: Optional[np.ndarray] = None
        self.running_count = 0
        self.keys_seen: set = set()
        self.clear()

    def clear(self) -> None:
        """Start a new epoch: forget this epoch's groups (history, running stats and the set of
        keys seen so far are kept)."""
        self._records: List[Dict[str, Any]] = []
        self._epoch_rewards: List[np.ndarray] = []
        self._epoch_adv: List[np.ndarray] = []

    # ------------------------------------------------------------------ advantages
    def update(self, keys: Sequence[Hashable], rewards: ArrayLike) -> np.ndarray:
        """Advantages for one batch.

        keys: B hashables, one per sample (the condition it was generated from).
        rewards: (B,) or (B, T), numpy or torch. Returns float32 numpy with the rewards' shape.
        Raises ValueError on non-finite rewards (naming the keys) or len(keys) != B.
        """
        r = _to_float64(rewards)
        if r.ndim not in (1, 2):
            raise ValueError(f"rewards must be (B,) or (B, T), got shape {r.shape}")
        batch = r.shape[0]
        if len(keys) != batch:
            raise ValueError(f"got {len(keys)} keys for {batch} rewards")
        keys = [_normalize_key(k) for k in keys]
        r2 = r.reshape(batch, -1)
        bad_rows = ~np.isfinite(r2).all(axis=1)
        if bad_rows.any():
            bad_keys = list(dict.fromkeys(keys[i] for i in np.flatnonzero(bad_rows)))
            raise ValueError(
                f"non-finite rewards (NaN/inf) in {int(bad_rows.sum())} of {batch} samples, keys "
                f"{bad_keys[:5]}{' ...' if len(bad_keys) > 5 else ''}: a failed reward must not become "
                "a number; drop or recompute those samples")
        if self.std_mode == "running" and self.running_mean is not None and self.running_mean.shape != r2.shape[1:]:
            raise ValueError(f"running stats have {self.running_mean.shape} columns, rewards {r2.shape[1:]}")

        groups: Dict[Hashable, List[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(k, []).append(i)
        adv = np.zeros_like(r2)

        if self.std_mode == "running":
            self._update_running(r2)
            mean, std, zero = self.baseline(None, r2, r2)
            adv = np.divide(r2 - mean, std, out=np.zeros_like(r2), where=~zero)
        else:
            for key, idx in groups.items():
                adv[idx] = self._group_advantages(key, r2[idx], r2)

        for key, idx in groups.items():
            self._record(key, r2[idx])
        self.keys_seen.update(groups)
        self._epoch_rewards.append(r2)
        self._epoch_adv.append(adv)
        return adv.reshape(r.shape).astype(np.float32)

    def _group_advantages(self, key: Hashable, g: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """(n, T) advantages of one group from its (n, T) rewards; batch: the whole (B, T) batch."""
        if self.buffer_size is not None:
            hist = self.history.get(key)
            if hist is None:
                hist = self.history[key] = deque(maxlen=self.buffer_size)
            if hist and hist[0].shape != g.shape[1:]:
                raise ValueError(f"key {key!r}: history has {hist[0].shape} columns, rewards {g.shape[1:]}")
            hist.extend(g.copy())
        mean, scale, zero = self.baseline(key, g, batch)
        return np.divide(g - mean, scale, out=np.zeros_like(g), where=~zero)

    def baseline(self, key: Hashable, g: np.ndarray, batch: np.ndarray):
        """The statistics a group's advantages are (r - mean) / scale of, zero where `zero`, from the tracker's state
        after the update() that computed them: the one rule the advantages and the live check
        (trainer/checks/verification.py) both use. g: the key's (n, T) rewards in that call; batch: the call's (B, T).
        Returns (mean (T,), scale (T,), zero (T,) bool), float64."""
        if self.std_mode == "running":
            std = np.sqrt(self.running_var)
            return self.running_mean, std, ~(std > self.eps)
        base = g  # the rewards the baseline (and the zero-spread test) is taken over
        if self.buffer_size is not None:
            hist = self.history.get(key)
            base = np.stack(hist) if hist is not None and len(hist) >= self.min_count else batch
        # The zero test uses the baseline's spread in every mode: a constant group's centred
        # rewards are float noise (~1e-17), which "global"/"none" would otherwise pass on.
        zero = zero_spread(base, self.eps)
        if self.std_mode == "group":
            scale = column_std(base)
        elif self.std_mode == "global":
            scale = column_std(batch)
            zero = zero | zero_spread(batch, self.eps)
        else:
            scale = np.ones(g.shape[1])
        return base.mean(axis=0), scale, zero

    def _update_running(self, r2: np.ndarray):
        """Mix this batch into the running mean/var; returns the (T,) mean and std to use."""
        b_mean, b_var = r2.mean(axis=0), r2.var(axis=0)
        if self.running_mean is None:
            self.running_mean, self.running_var = b_mean, b_var
        else:
            d = self.ema_decay
            m0 = self.running_mean
            self.running_mean = d * m0 + (1 - d) * b_mean
            # Variance of the two-component mixture (weights d, 1-d): the between-means term keeps
            # a drifting reward from shrinking the std below the spread actually seen.
            self.running_var = d * self.running_var + (1 - d) * b_var + d * (1 - d) * (b_mean - m0) ** 2
        self.running_count += 1
        return self.running_mean, np.sqrt(self.running_var)

    # ------------------------------------------------------------------ statistics
    def _record(self, key: Hashable, g: np.ndarray) -> None:
        self._records.append({
            "key": key, "n": g.shape[0],
            "reward_std": g.std(axis=0), "zero": zero_spread(g, self.eps),
        })

    def get_stats(self) -> Dict[str, Any]:
        """Statistics of this epoch's groups (since the last clear()).

        Scalars: num_samples, num_groups, group_size (mean samples per key), trained_prompt_num
        (distinct keys this epoch), trained_prompt_num_total (distinct keys since creation),
        zero_std_ratio (share of (group, column) cells whose rewards have zero spread, see zero_spread),
        zero_std_ratio_per_column ((T,) list: the same share per column, i.e. per denoising step for
        (B, T) rewards: which steps carry no signal),
        reward_std_mean (mean over (group, column) pairs of the batch reward std), reward_mean,
        reward_std, adv_mean, adv_std, adv_abs_max (over all samples and columns), and in
        "running" mode running_mean/running_std (averaged over columns).
        """
        recs = self._records
        distinct = {rec["key"] for rec in recs}
        stats: Dict[str, Any] = {
            "num_samples": int(sum(rec["n"] for rec in recs)),
            "num_groups": len(recs),
            "group_size": float(np.mean([rec["n"] for rec in recs])) if recs else 0.0,
            "trained_prompt_num": len(distinct),
            "trained_prompt_num_total": len(self.keys_seen),
        }
        if recs:
            stds = np.concatenate([rec["reward_std"] for rec in recs])
            zero = [rec["zero"] for rec in recs]
            rewards = np.concatenate([x.ravel() for x in self._epoch_rewards])
            adv = np.concatenate([x.ravel() for x in self._epoch_adv])
            stats.update(
                zero_std_ratio=float(np.mean(np.concatenate(zero))),
                # per column only while every update() had the same number of columns
                zero_std_ratio_per_column=np.mean(zero, axis=0).tolist() if len({z.size for z in zero}) == 1 else [],
                reward_std_mean=float(stds.mean()),
                reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                adv_mean=float(adv.mean()), adv_std=float(adv.std()), adv_abs_max=float(np.abs(adv).max()))
        else:
            stats.update(zero_std_ratio=0.0, zero_std_ratio_per_column=[], reward_std_mean=0.0, reward_mean=0.0,
                         reward_std=0.0, adv_mean=0.0, adv_std=0.0, adv_abs_max=0.0)
        if self.std_mode == "running" and self.running_mean is not None:
            stats["running_mean"] = float(np.mean(self.running_mean))
            stats["running_std"] = float(np.mean(np.sqrt(self.running_var)))
        return stats

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Settings, histories, running stats and seen keys (not the current epoch's table).

        Only tensors, Python scalars, lists, tuples and dicts: it round-trips through pickle and
        torch.save/torch.load(weights_only=True) as long as the keys are built from str/int/float.
        """
        def tensor(x):
            return None if x is None else torch.from_numpy(np.array(x, dtype=np.float64))
        return {
            "std_mode": self.std_mode, "buffer_size": self.buffer_size, "min_count": self.min_count,
            "eps": self.eps, "ema_decay": self.ema_decay,
            "history": [(k, tensor(np.stack(h)) if h else None) for k, h in self.history.items()],
            "running_mean": tensor(self.running_mean), "running_var": tensor(self.running_var),
            "running_count": self.running_count,
            "keys_seen": list(self.keys_seen),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what state_dict() saved; the settings are taken from the state too."""
        self.__init__(state["std_mode"], state["buffer_size"], state["min_count"], state["eps"], state["ema_decay"])
        for k, h in state["history"]:
            hist = self.history[k] = deque(maxlen=self.buffer_size)
            if h is not None:
                hist.extend(h.numpy().copy())
        if state["running_mean"] is not None:
            self.running_mean = state["running_mean"].numpy().copy()
            self.running_var = state["running_var"].numpy().copy()
        self.running_count = int(state["running_count"])
        self.keys_seen = set(state["keys_seen"])

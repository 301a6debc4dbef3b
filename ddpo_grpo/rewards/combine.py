"""Weighted combination of reward functions, per-step reward shaping, validity checks, async scoring.

Per-step modes (`per_step=`), for a trajectory of T denoising steps:
  - "none":      avg (B,) = sum_k w_k * score_k(final images).
  - "broadcast": avg (B, T) = the final weighted score copied to every step.
  - "x0":        avg[:, t] = s_t := sum_k w_k * score_k(x0_images[:, t]), the weighted score of the
                 clean image x^0_t predicted from step t's output, i.e. after its action (x0_images
                 (B, T, C, H, W), clamped to [0, 1]; the last step's is the final image).
  - "x0_gain":   avg[:, 0] = s_0 and avg[:, t] = s_t - s_{t-1} for t >= 1, i.e. the gain over a zero
                 baseline before the first step. The cumulative sum over steps gives back s_t, so the
                 undiscounted return from step 0 is s_{T-1}, the score of the last prediction (~ the
                 final image). A constant baseline for step 0 does not change per-step group-normalised
                 advantages; only the relative ordering within a group at each step matters.
In every mode the final images are scored too (`final`, `final_per_fn`, `details`).

Validity: each function must return scores of shape (B,) and a real numeric dtype (ints/bools are
cast to float32), else `RewardError`. NaN/inf scores are let through but the sample is marked
invalid (`valid[i] = False`, any function, any step); its `avg` row and `final` entry become NaN so
that nothing trains on it silently. Raw scores in `per_fn`/`final_per_fn` are kept as returned.
"""
from __future__ import annotations

import math
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .registry import ConfigError, RewardError, get_reward_fn

PER_STEP_MODES = ("none", "broadcast", "x0", "x0_gain")


@dataclass
class RewardResult:
    avg: np.ndarray  # float32 (B,) for per_step="none", else (B, T); NaN rows where not valid
    per_fn: Dict[str, np.ndarray]  # name -> raw scores, same shape as avg (per-step: score of x^0_t, not gains)
    details: Dict[str, np.ndarray]  # "<fn name>/<detail>" -> (B,), from the final images; never summed
    valid: np.ndarray  # bool (B,): False where any function returned NaN/inf for the sample
    invalid_count: int
    final: np.ndarray = field(default=None)  # float32 (B,): weighted score of the final images (NaN if invalid)
    final_per_fn: Dict[str, np.ndarray] = field(default_factory=dict)  # name -> raw (B,) scores of final images

    @classmethod
    def concat(cls, results: Sequence["RewardResult"]) -> "RewardResult":
        """Results of consecutive batches as one, in order: (N,) or (N, T) with N = sum of batch sizes."""
        def cat(dicts):
            return {k: np.concatenate([d[k] for d in dicts]) for k in dicts[0]}

        return cls(
            avg=np.concatenate([r.avg for r in results]).astype(np.float32),
            per_fn=cat([r.per_fn for r in results]),
            details=cat([r.details for r in results]),
            valid=np.concatenate([r.valid for r in results]),
            invalid_count=sum(r.invalid_count for r in results),
            final=np.concatenate([r.final for r in results]).astype(np.float32),
            final_per_fn=cat([r.final_per_fn for r in results]),
        )

    def means(self, mean: Optional[Callable[[np.ndarray], float]] = None) -> Dict[str, float]:
        """Means for logging: `reward_mean` (weighted score of the final images) and `reward_<fn>` (each function's
        raw score) over valid samples, and each detail's mean over all samples.

        `mean` reduces an array (N,) with NaN for what is left out to a float; the default is this result's
        own NaN-mean, and the trainer passes one that averages over every process's samples."""
        mean = mean or _nanmean
        out = {"reward_mean": mean(np.where(self.valid, self.final, np.nan))}
        for name, s in self.final_per_fn.items():
            out[f"reward_{name}"] = mean(np.where(self.valid, s, np.nan))
        for name, d in self.details.items():
            out[name] = mean(d)
        return out

    def summary(self) -> Dict[str, float]:
        """Scalars of this result: `means()`, plus the std of the final reward over valid samples and the
        invalid count."""
        out = self.means()
        v = self.valid
        out["reward_std"] = float(self.final[v].std()) if v.any() else math.nan
        out["invalid_count"] = float(self.invalid_count)
        return out


def _nanmean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.nanmean(x)) if np.isfinite(x).any() else math.nan


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _checked(name: str, what: str, x: Any, batch: int) -> np.ndarray:
    try:
        arr = _to_numpy(x)
    except Exception as e:
        raise RewardError(f"reward {name!r} returned {what} that is not an array: {type(e).__name__}: {e}", name) from e
    if arr.shape != (batch,):
        raise RewardError(f"reward {name!r} returned {what} of shape {arr.shape}; expected ({batch},) for {batch} images", name)
    if arr.dtype.kind not in "fiub":
        raise RewardError(f"reward {name!r} returned {what} of dtype {arr.dtype}; expected float scores of shape ({batch},)", name)
    return arr.astype(np.float32)


def _snapshot(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else (np.array(x, copy=True) if x is not None else None)


class RewardComputer:
    """Weighted sum of named rewards: `RewardComputer({"toyworld": 1.0, "jpeg_compressibility": 0.1})`.

    `fn_kwargs` maps a reward name to its factory options. `executor` (e.g. a
    ThreadPoolExecutor(1)) makes `submit` run in the background; it is not shut down here.
    """

    def __init__(self, fns: Mapping[str, float], fn_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 executor: Optional[Executor] = None):
        if not isinstance(fns, Mapping) or not fns:
            raise ConfigError(f"rewards must be a non-empty mapping name -> weight, got {fns!r}")
        fn_kwargs = dict(fn_kwargs or {})
        extra = sorted(set(fn_kwargs) - set(fns))
        if extra:
            raise ConfigError(f"reward options given for {extra}, which are not among the rewards {sorted(fns)}")
        self.weights: Dict[str, float] = {}
        for name, w in fns.items():
            try:
                w = float(w)
            except (TypeError, ValueError):
                w = math.nan
            if not math.isfinite(w):
                raise ConfigError(f"reward {name!r}: weight must be a finite number, got {fns[name]!r}")
            self.weights[name] = w
        self.fns = {name: get_reward_fn(name, **dict(fn_kwargs.get(name) or {})) for name in self.weights}
        self.executor = executor

    @property
    def names(self) -> List[str]:
        return list(self.weights)

    def _score(self, images, prompts, metadata) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray], np.ndarray]:
        batch = len(images)
        per_fn, details = {}, {}
        bad = np.zeros(batch, dtype=bool)
        for name, fn in self.fns.items():
            out = fn(images, prompts, metadata)
            if isinstance(out, tuple) and len(out) == 2 and (out[1] is None or isinstance(out[1], Mapping)):
                scores, det = out
            else:
                scores, det = out, None
            scores = _checked(name, "scores", scores, batch)
            bad |= ~np.isfinite(scores)
            per_fn[name] = scores
            for key, val in (det or {}).items():
                details[f"{name}/{key}"] = _checked(name, f"detail {key!r}", val, batch)
        return per_fn, details, bad

    def _weighted(self, per_fn: Mapping[str, np.ndarray]) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            return sum(self.weights[n] * per_fn[n].astype(np.float64) for n in self.weights).astype(np.float32)

    def __call__(self, images, prompts: Optional[Sequence[str]] = None, metadata: Optional[Sequence[dict]] = None,
                 x0_images=None, per_step: str = "none", num_steps: Optional[int] = None) -> RewardResult:
        if per_step not in PER_STEP_MODES:
            raise ConfigError(f"per_step must be one of {PER_STEP_MODES}, got {per_step!r}")
        batch = len(images)
        prompts = [""] * batch if prompts is None else list(prompts)
        metadata = [{} for _ in range(batch)] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"{batch} images but {len(prompts)} prompts and {len(metadata)} metadata entries")

        final_per_fn, details, bad = self._score(images, prompts, metadata)
        final = self._weighted(final_per_fn)

        if per_step == "none":
            avg, per_fn = final.copy(), final_per_fn
        elif per_step == "broadcast":
            steps = num_steps if num_steps is not None else (None if x0_images is None else x0_images.shape[1])
            if steps is None or int(steps) < 1:
                raise ValueError(f"per_step='broadcast' needs num_steps >= 1 (or x0_images), got {steps!r}")
            steps = int(steps)
            avg = np.repeat(final[:, None], steps, axis=1)
            per_fn = {n: np.repeat(s[:, None], steps, axis=1) for n, s in final_per_fn.items()}
        else:
            if x0_images is None:
                raise ValueError(f"per_step={per_step!r} needs x0_images (B, T, C, H, W) in [0, 1]")
            x0 = torch.from_numpy(x0_images) if isinstance(x0_images, np.ndarray) else x0_images
            if x0.ndim < 3 or x0.shape[0] != batch:
                raise ValueError(f"x0_images must be (B={batch}, T, C, H, W), got {tuple(x0.shape)}")
            steps = x0.shape[1]
            if num_steps is not None and int(num_steps) != steps:
                raise ValueError(f"num_steps={num_steps} but x0_images has {steps} steps")
            cols: Dict[str, List[np.ndarray]] = {n: [] for n in self.weights}
            for t in range(steps):
                s_t, _, bad_t = self._score(x0[:, t].clamp(0, 1), prompts, metadata)
                bad |= bad_t
                for n in cols:
                    cols[n].append(s_t[n])
            per_fn = {n: np.stack(c, axis=1) for n, c in cols.items()}
            s = self._weighted(per_fn)
            avg = s if per_step == "x0" else np.diff(s, axis=1, prepend=np.float32(0)).astype(np.float32)

        avg = avg.astype(np.float32)
        avg[bad] = np.nan
        final[bad] = np.nan
        return RewardResult(avg=avg, per_fn=per_fn, details=details, valid=~bad, invalid_count=int(bad.sum()),
                            final=final, final_per_fn=final_per_fn)

    def submit(self, images, prompts=None, metadata=None, **kwargs) -> "Future[RewardResult]":
        """Like `__call__` but returns a Future; runs on `executor` if one was given, else right away.

        Tensors are cloned first, so the caller may reuse its buffers while the reward runs.
        """
        images = _snapshot(images)
        if kwargs.get("x0_images") is not None:
            kwargs["x0_images"] = _snapshot(kwargs["x0_images"])
        prompts = None if prompts is None else list(prompts)
        metadata = None if metadata is None else list(metadata)
        if self.executor is not None:
            return self.executor.submit(self.__call__, images, prompts, metadata, **kwargs)
        fut: Future = Future()
        try:
            fut.set_result(self(images, prompts, metadata, **kwargs))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def shutdown(self) -> None:
        """Stop the reward pool, if there is one (reward.num_threads = 0 runs inline: nothing to stop); rewards still
        running finish in their threads."""
        if self.executor is not None:
            self.executor.shutdown(wait=False)


def collect_rewards(futures: Sequence["Future[RewardResult]"], accelerator=None) -> RewardResult:
    """Wait for the batches' reward futures (`RewardComputer.submit`) and concatenate them into one RewardResult
    (N,) / (N, T).

    A reward that raises on any process stops every process with its message: the processes first agree on
    who failed, so none is left waiting in the next collective (a hang, on a cluster). `accelerator` (an
    accelerate.Accelerator, or None for one process) is only used for that agreement.
    """
    results, error = [], ""
    try:
        results = [f.result() for f in futures]
    except Exception as e:  # noqa: BLE001 - any plugin failure is reported, not swallowed
        error = str(e) if isinstance(e, RewardError) else f"reward computation failed: {type(e).__name__}: {e}"
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        errors = [m for m in gather_object([error]) if m]
        if errors:
            raise RewardError(errors[0] + (f" (on {len(errors)} processes)" if len(errors) > 1 else ""))
    elif error:
        raise RewardError(error)
    return RewardResult.concat(results)

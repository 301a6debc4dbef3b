"""Name -> reward factory lookup: built-ins registered with `@register_reward`, then plugins.

A *reward function* is `fn(images, prompts, metadata) -> (scores, details)` (ddpo-pytorch's
signature); a *reward plugin* is a factory `make(**kwargs) -> reward function`. Plugins are found
through the entry-point group ``ddpo_grpo.rewards``, e.g. in a plugin's setup.py::

    entry_points={"ddpo_grpo.rewards": ["my_reward = my_pkg.rewards:make_my_reward"]}

Built-ins win over entry points of the same name. The worlds' rewards are ddpo_grpo's own entry points
(ddpo_grpo/plugins.py's list, which setup.py declares; a checkout run without installing ddpo_grpo reads the list).

Video (samples of frames (B, F, C, H, W)): a reward function scores still images by default; `RewardFn` then
scores every frame (frames flattened to (B*F, C, H, W), each sample's prompt and metadata repeated F times) and
returns each sample's mean over its frames (scores and details alike; a non-finite frame makes the sample's
score non-finite, so it is marked invalid). A factory marked with `@clip_reward` (attribute `takes_clips = True`,
on the factory or on the function it returns) gets the clips (B, F, C, H, W) as they are.
"""
from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any, Callable, Dict, List, Optional

ENTRY_POINT_GROUP = "ddpo_grpo.rewards"

RewardFactory = Callable[..., Callable]


from ddpo_grpo.errors import ConfigError  # noqa: E402  (one ConfigError for the whole project)
from ddpo_grpo.plugins import uninstalled_entry_points  # noqa: E402  (ddpo_grpo's own, when it is not installed)


class RewardError(RuntimeError):
    """A reward factory or reward function failed, or returned something malformed."""

    def __init__(self, message: str, reward_name: Optional[str] = None):
        super().__init__(message)
        self.reward_name = reward_name


_BUILTINS: Dict[str, RewardFactory] = {}


def register_reward(name: str, *, override: bool = False):
    """Decorator registering `factory(**kwargs) -> reward fn` as the built-in reward `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def deco(factory: RewardFactory) -> RewardFactory:
        old = _BUILTINS.get(name)
        if old is not None and old is not factory and not override:
            raise ValueError(
                f"reward {name!r} is already registered (by {_describe(old)}); pass override=True to replace it"
            )
        _BUILTINS[name] = factory
        return factory

    return deco


def unregister_reward(name: str) -> None:
    """Remove a built-in registration (mainly for tests); unknown names are ignored."""
    _BUILTINS.pop(name, None)


def _entry_points() -> Dict[str, importlib.metadata.EntryPoint]:
    out: Dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, ep)  # first on sys.path wins, like imports
    for ep in uninstalled_entry_points(ENTRY_POINT_GROUP):  # a checkout run without installing it: plugins.py's list
        out.setdefault(ep.name, ep)
    return out


def available_rewards() -> List[str]:
    """Sorted names of every built-in and every installed plugin reward."""
    return sorted(set(_BUILTINS) | set(_entry_points()))


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _fail(name: str, exc: BaseException) -> RewardError:
    return RewardError(f"reward {name!r} failed: {type(exc).__name__}: {exc}", reward_name=name)


def get_reward_factory(name: str) -> RewardFactory:
    """The factory registered as `name` (built-in first, then entry point), not yet called."""
    if name in _BUILTINS:
        return _BUILTINS[name]
    eps = _entry_points()
    if name not in eps:
        names = sorted(set(_BUILTINS) | set(eps))
        raise ConfigError(
            f"unknown reward {name!r}; available rewards: {', '.join(names) or '(none)'} "
            f"(plugins register under the entry-point group '{ENTRY_POINT_GROUP}')"
        )
    ep = eps[name]
    try:
        return ep.load()
    except Exception as e:
        raise RewardError(
            f"reward {name!r} failed: could not load entry point '{ep.name} = {ep.value}': {type(e).__name__}: {e}",
            reward_name=name,
        ) from e


def clip_reward(factory: RewardFactory) -> RewardFactory:
    """Decorator marking a reward factory whose reward function scores whole clips: it gets video batches
    (B, F, C, H, W) as they are, instead of one call on every frame averaged per sample (the default)."""
    factory.takes_clips = True
    return factory


def _per_frame(values, batch: int, frames: int, what: str, name: str):
    """(B*F,) per-frame values -> (B,) float64 means over each sample's frames."""
    import numpy as np

    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    arr = np.asarray(values)
    if arr.shape != (batch * frames,):
        raise RewardError(f"reward {name!r} returned {what} of shape {arr.shape} for {batch} videos of {frames} frames; "
                          f"it scores still images, so it is called on the {batch * frames} frames and must return "
                          f"({batch * frames},) (or mark its factory @clip_reward to get (B, F, C, H, W))", name)
    if arr.dtype.kind not in "fiub":
        return arr  # left for the caller's dtype check
    with np.errstate(invalid="ignore", over="ignore"):
        return arr.astype(np.float64).reshape(batch, frames).mean(axis=1)


class RewardFn:
    """A reward function tagged with its registry name; exceptions are re-raised as `RewardError`. Video batches
    (B, F, C, H, W) are scored frame by frame and averaged per sample unless `takes_clips` (module docstring)."""

    def __init__(self, name: str, fn: Callable, kwargs: Optional[dict] = None, takes_clips: bool = False):
        self.name = name
        self.fn = fn
        self.kwargs = dict(kwargs or {})
        self.takes_clips = bool(takes_clips or getattr(fn, "takes_clips", False))

    def __call__(self, images, prompts, metadata):
        try:
            if getattr(images, "ndim", 0) == 5 and not self.takes_clips:
                return self._frames(images, prompts, metadata)
            return self.fn(images, prompts, metadata)
        except RewardError:
            raise
        except Exception as e:
            raise _fail(self.name, e) from e

    def _frames(self, videos, prompts, metadata):
        """An image reward on video: every frame scored, each sample's scores and details averaged over frames."""
        from collections.abc import Mapping

        B, F = videos.shape[:2]
        frames = videos.reshape(B * F, *videos.shape[2:])
        rep = lambda xs: None if xs is None else [x for x in xs for _ in range(F)]  # noqa: E731
        out = self.fn(frames, rep(prompts), rep(metadata))
        if isinstance(out, tuple) and len(out) == 2 and (out[1] is None or isinstance(out[1], Mapping)):
            scores, details = out
        else:
            scores, details = out, None
        means = _per_frame(scores, B, F, "scores", self.name)
        if details is None:
            return means
        return means, {k: _per_frame(v, B, F, f"detail {k!r}", self.name) for k, v in details.items()}

    def __repr__(self) -> str:
        return f"RewardFn({self.name!r}, {_describe(self.fn)})"


def get_reward_fn(name: str, **kwargs) -> RewardFn:
    """Build the reward `name` with the factory options `kwargs`.

    Raises `ConfigError` for an unknown name (listing the available ones) or options the factory
    does not accept, and `RewardError` when the factory itself raises.
    """
    factory = get_reward_factory(name)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise ConfigError(f"reward {name!r}: bad options {sorted(kwargs)}: {e}; signature: {name}{sig}") from e
    try:
        fn = factory(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"reward {name!r}: {e}") from e
    except RewardError:
        raise
    except Exception as e:
        raise _fail(name, e) from e
    if not callable(fn):
        raise RewardError(f"reward {name!r} failed: its factory returned {type(fn).__name__}, not a callable", name)
    return RewardFn(name, fn, kwargs, takes_clips=getattr(factory, "takes_clips", False))

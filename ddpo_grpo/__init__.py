"""GRPO fine-tuning for diffusion and flow-matching models (DDPO-style, group-relative advantages).

Layout: `core` (the math: per-step log-probs, group statistics, losses, reference; no accelerate),
`trainer` (the epoch loop's parts), `rewards` (registry and generic rewards), `worlds` (toyworld, recam:
data with their own rewards, registered as plugins), `models` (loading the bundled and local models).

The names ddpo-pytorch users import are available here too, loaded on first use so that
`import ddpo_grpo` stays light (no torch, no accelerate):
`ddim_step_with_logprob`, `pipeline_with_logprob`, `PerPromptStatTracker`.
"""
import importlib

_LAZY = {
    "ddim_step_with_logprob": "ddpo_grpo.core.ddim_with_logprob",
    "pipeline_with_logprob": "ddpo_grpo.core.pipeline_with_logprob",
    "PerPromptStatTracker": "ddpo_grpo.core.stat_tracking",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddpo_grpo' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

"""Errors that stop a run with one clear line (scripts/train.py prints them without a traceback)."""


class ConfigError(ValueError):
    """The config, a path or the batch geometry is wrong; the message says how to fix it."""


class VerificationError(RuntimeError):
    """A GRPO invariant failed during the run (group counts, advantage statistics, on-policy ratio)."""


class InvalidRewardError(RuntimeError):
    """Too many rewards of an epoch were invalid (NaN, inf) to train on."""

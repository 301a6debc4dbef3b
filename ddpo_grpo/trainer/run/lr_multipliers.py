"""The one reading of train.lr_multipliers ("fragment=multiplier,...": the optimizer's lr groups).

The config check (validate), the optimizer (build.lr_groups) and the checkpoint's record of the optimizer's layout
(checkpointing.run_meta) all call it, so the three cannot read the same spec differently."""
from __future__ import annotations

from ddpo_grpo.errors import ConfigError


def parse_lr_multipliers(spec: str) -> list:
    """train.lr_multipliers "fragment=multiplier,..." (e.g. "cam_encoder.=10,projector.=10") -> [(fragment, float)]
    in the order given; a malformed entry is a ConfigError naming it."""
    out = []
    for item in (x.strip() for x in (spec or "").split(",")):
        if not item:
            continue
        frag, eq, mult = item.partition("=")
        try:
            value = float(mult) if eq and frag.strip() else None
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise ConfigError(f"train.lr_multipliers: {item!r} is not fragment=multiplier with a multiplier > 0 "
                              "(e.g. 'cam_encoder.=10,projector.=10')")
        out.append((frag.strip(), value))
    return out

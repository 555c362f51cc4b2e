"""The AMP ledger: update attempts vs updates actually applied."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Ledger:
    """``attempted``: steps that produced gradients with an optimizer attached; ``applied``: steps in
    which ``optimizer.step`` really ran (its post-hook fired -- GradScaler skips never call it);
    ``skipped_steps``: attempted but not applied, in order; ``scale_history``: ``(step, loss scale)``
    read with the step's record copy (no extra sync)."""

    attempted: int = 0
    applied: int = 0
    skipped_steps: list = dataclasses.field(default_factory=list)
    scale_history: list = dataclasses.field(default_factory=list)

    @property
    def skipped(self) -> int:
        return len(self.skipped_steps)

    def to_dict(self) -> dict:
        from nanscan.record import json_float

        return {"attempted": self.attempted, "applied": self.applied, "skipped_steps": list(self.skipped_steps),
                "scale_history": [[s, json_float(v)] for s, v in self.scale_history]}

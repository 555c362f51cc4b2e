"""The AMP ledger: update attempts vs updates actually applied."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Ledger:
    """``attempted``: steps that called ``optimizer.step`` (or ``scaler.step``), checked or not --
    with gradient accumulation one step is one optimizer step, however many backwards it took;
    ``applied``: attempts whose update really ran (the optimizer's post-hook fired -- GradScaler
    skips never call it -- and, for fused optimizers under GradScaler, the device ``found_inf``
    flag read with the step's records was 0); ``skipped_steps``: attempted and not applied, in
    order; ``undecided_steps``: fused-optimizer steps whose ``found_inf`` was never read (steps not
    sampled by ``every``: nanscan reads nothing then, so it does not say applied or skipped);
    ``scale_history``: ``(step, loss scale)`` read with the step's record copy (no extra sync)."""

    attempted: int = 0
    applied: int = 0
    skipped_steps: list = dataclasses.field(default_factory=list)
    undecided_steps: list = dataclasses.field(default_factory=list)
    scale_history: list = dataclasses.field(default_factory=list)

    @property
    def skipped(self) -> int:
        return len(self.skipped_steps)

    def attempt(self, step: int, applied: Optional[bool]) -> None:
        """One optimizer step was attempted; ``applied`` None: decided later by :meth:`decide`."""
        self.attempted += 1
        if applied is None:
            self.undecided_steps.append(step)
        else:
            self._count(step, applied)

    def decide(self, step: int, applied: bool) -> bool:
        """The fused-AMP flag of an undecided ``step`` arrived; False when it was not undecided."""
        if step not in self.undecided_steps:
            return False
        self.undecided_steps.remove(step)
        self._count(step, applied)
        return True

    def _count(self, step: int, applied: bool) -> None:
        if applied:
            self.applied += 1
        else:
            self.skipped_steps = sorted(self.skipped_steps + [step])

    def to_dict(self) -> dict:
        from nanscan.record import json_float

        return {"attempted": self.attempted, "applied": self.applied, "skipped_steps": list(self.skipped_steps),
                "undecided_steps": list(self.undecided_steps),
                "scale_history": [[s, json_float(v)] for s, v in self.scale_history]}

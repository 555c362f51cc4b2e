"""The AMP ledger: update attempts vs updates actually applied."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


class ScaleHistory(list):
    """A list of ``(step, loss scale)`` tuples that keeps the changes only: :meth:`append` stores a
    tuple when its scale differs from the last one stored (always the first; NaN equals NaN), so a
    run at a steady scale keeps one entry however long it is."""

    def append(self, item) -> None:
        step, scale = item
        if self:
            last = self[-1][1]
            if scale == last or (isinstance(scale, float) and isinstance(last, float)
                                 and math.isnan(scale) and math.isnan(last)):
                return
        super().append((step, scale))


@dataclasses.dataclass
class Ledger:
    """``attempted``: steps that called ``optimizer.step`` (or ``scaler.step``), checked or not --
    with gradient accumulation one step is one optimizer step, however many backwards it took;
    ``applied``: attempts whose update really ran (the optimizer's post-hook fired -- GradScaler
    skips never call it -- and, for fused optimizers under GradScaler, the device ``found_inf``
    flag read with the step's records was 0); ``skipped_steps``: attempted and not applied, in
    order; ``undecided_steps``: fused-optimizer steps whose ``found_inf`` was never read (steps not
    sampled by ``every``: nanscan reads nothing then, so it does not say applied or skipped);
    ``scale_history``: the history of the loss scale's *changes*, a list of ``(step, loss scale)``
    tuples in step order, each the first checked step at which the scale had that value (the scale
    is read with a checked step's record copy: no extra sync); a step not listed had the scale of
    the entry before it, as far as the checked steps show (a change and its reversal between two
    checked steps are not seen). Changes only (a :class:`ScaleHistory`: its ``append`` drops a
    repeat of the last scale), so it stays small however long the run; the per-step
    scale is in the event log's step records (``loss_scale``)."""

    attempted: int = 0
    applied: int = 0
    skipped_steps: list = dataclasses.field(default_factory=list)
    undecided_steps: list = dataclasses.field(default_factory=list)
    scale_history: list = dataclasses.field(default_factory=ScaleHistory)

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

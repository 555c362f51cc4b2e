"""What the monitor reports: :class:`Incident` and :class:`NonFiniteError`."""
from __future__ import annotations

import dataclasses
from typing import Optional

from nanscan.record import TensorSummary
from nanscan.vocabulary import KIND_PHRASES


@dataclasses.dataclass(frozen=True)
class Incident:
    """The first non-finite tensor of one step and phase.

    ``produced`` is True when the offender's inputs were finite and its output was not (the NaN was
    made here), False when a non-finite input propagated into it, None when nanscan cannot tell.
    For activations the inputs are the module's tensor inputs; for a parameter's gradient, the
    gradient flowing into its module's output; for a parameter after the update, its gradient;
    for the loss, the model's outputs. ``inputs`` names the non-finite inputs when propagated.
    ``handled_by_scaler`` is True for a gradient (backward-phase) incident in a step whose update
    GradScaler skipped, i.e. AMP handled the overflow as designed (recorded, never raised). Forward
    and loss incidents are never "handled": loss scaling cannot fix them. ``order``: the value's
    position in its rank's production order of the read (the ranks of one SPMD program record the
    same sequence, so under torch.distributed the rank whose fault came first in the step is the
    one reported, even where a collective then spread it to the others). ``order_known`` is False
    when the step's forward ran some modules eagerly beside compiled graphs (Note [eager frames
    beside compiled ones], findings.py): the order of their values is unknown, so ``name`` is only
    the first non-finite value nanscan saw, and ``produced`` is None.
    """

    step: int
    phase: str
    name: str
    kind: str
    produced: Optional[bool]
    summary: TensorSummary
    rank: int = 0
    inputs: tuple = ()
    handled_by_scaler: bool = False
    order: int = 0
    order_known: bool = True

    def __str__(self) -> str:
        s = self.summary
        what = KIND_PHRASES.get(self.kind, self.kind)
        if self.produced is True:
            cause = "its inputs were finite, so the non-finite values were produced here"
        elif self.produced is False:
            cause = ("its inputs were already non-finite (propagated from "
                     f"{', '.join(self.inputs) if self.inputs else 'upstream'})")
        elif not self.order_known:
            cause = ("nanscan cannot tell where it began: this forward ran some modules eagerly (dynamo past its "
                     "recompile limit, or after a graph break) beside compiled graphs, so the order of their values "
                     "is unknown and this is only the first non-finite value it saw")
        else:
            cause = "nanscan cannot tell whether it was produced here or propagated"
        first = "" if s.first_nonfinite_index is None else f", first at flat index {s.first_nonfinite_index}"
        tail = "; GradScaler skipped this update (handled)" if self.handled_by_scaler else ""
        return (f"non-finite {what} '{self.name}' at step {self.step}, phase {self.phase}, rank {self.rank}: "
                f"{s.nan_count} NaN, {s.posinf_count} +Inf, {s.neginf_count} -Inf of {s.numel} "
                f"({str(s.dtype).replace('torch.', '')}{list(s.shape)}{first}); {cause}{tail}.")

    def to_dict(self) -> dict:
        """Strict-JSON-safe dict."""
        return {"step": self.step, "phase": self.phase, "name": self.name, "kind": self.kind,
                "produced": self.produced, "rank": self.rank, "inputs": list(self.inputs),
                "handled_by_scaler": self.handled_by_scaler, "order_known": self.order_known,
                "summary": self.summary.to_dict()}


class NonFiniteError(FloatingPointError):
    """Raised by a monitor with ``on_nonfinite="raise"``; ``.incident`` says where and when."""

    def __init__(self, incident: Incident):
        super().__init__(str(incident))
        self.incident = incident

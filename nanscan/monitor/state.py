"""Where the monitor is in the training step: :class:`StepState`, the only writer of it.

The triggers -- the root module's forward, the optimizer's step hooks, GradScaler's wrapped
``step``, ``with mon.step()``, ``close`` -- tell the state what happened through its methods; the
monitor asks it what to do (read now? end the step?). What was seen in a step is a handful of facts
that are independent of each other (a closure runs the forward *after* ``optimizer.step`` was
called; a read can come before or without an update), so they are fields, reset together by
:meth:`next_step`; how the step is delimited is one :class:`Delimiter`. Whoever must follow the
recording switch (the compiled path's rows: they record only in checked steps of an open monitor)
registers ``on_recording``; the state calls it whenever ``checking`` or ``closed`` changes, so no
caller has to remember to.
"""
from __future__ import annotations

import enum
from typing import Callable, Optional

__all__ = ["Delimiter", "RootCall", "StepState"]


class Delimiter(enum.Enum):
    """How the current step ends (Note [explicit steps] in :mod:`nanscan.monitor.monitor`)."""

    IMPLICIT = "implicit"  # at the optimizer's update, a GradScaler skip, or the next training forward
    BLOCK = "block"  # inside ``with mon.step():``
    AWAITING_UPDATE = "awaiting update"  # the block ended before its optimizer step: that step ends it


class RootCall(enum.Enum):
    """The step's outermost watched forward so far (whose inputs the failure bundle keeps)."""

    NONE = "none"
    EVAL = "eval"  # only in eval mode with grad enabled (a validation pass without no_grad) so far
    TRAIN = "train"


class StepState:
    """The step index, whether it is checked (``every``), and what was seen in it."""

    __slots__ = ("index", "every", "checking", "delimiter", "forward_seen", "root", "attempted", "applied",
                 "read", "closed", "_on_recording")

    def __init__(self, every: int, on_recording: Optional[Callable[[], None]] = None):
        self.index = 0
        self.every = every
        self.checking = True  # this step is sampled (step index % every == 0)
        self.closed = False
        self.delimiter = Delimiter.IMPLICIT
        self._on_recording = on_recording
        self._clear()

    def _clear(self) -> None:
        self.forward_seen = False  # a training forward ran (or an explicit block owns the step)
        self.root = RootCall.NONE
        self.attempted = False  # optimizer.step / scaler.step was called
        # The update ran: True / False; None while a fused-AMP flag decides (read later).
        self.applied: Optional[bool] = False
        self.read = False  # the step's records were read

    @property
    def in_block(self) -> bool:
        """Inside ``with mon.step():``."""
        return self.delimiter is Delimiter.BLOCK

    @property
    def awaiting_update(self) -> bool:
        return self.delimiter is Delimiter.AWAITING_UPDATE

    @property
    def recording(self) -> bool:
        """Records are taken now: a checked step of an open monitor."""
        return self.checking and not self.closed

    # ------------------------------------------------------------------ what happened
    def forward_began(self, train_mode: bool) -> bool:
        """A training forward of an outermost watched module began. True when its inputs are the
        step's batch: the step's first such call, or its first in train mode after calls in eval mode
        with grad enabled."""
        self.forward_seen = True
        root = self.root
        if root is RootCall.NONE or (root is RootCall.EVAL and train_mode):
            self.root = RootCall.TRAIN if train_mode else RootCall.EVAL
            return True
        return False

    def forward_aborted(self) -> None:
        """The model's last forward raised and the loop went on: the next forward's batch is the step's."""
        if self.root is not RootCall.NONE and not self.in_block:
            self.root = RootCall.NONE

    def update_attempted(self) -> None:
        """optimizer.step / scaler.step was called: an explicit block awaiting it has it now."""
        self.attempted = True
        if self.delimiter is Delimiter.AWAITING_UPDATE:
            self.delimiter = Delimiter.IMPLICIT

    def update_applied(self, applied: Optional[bool]) -> None:
        self.applied = applied

    def was_read(self) -> None:
        self.read = True

    def block_entered(self) -> None:
        """``with mon.step():`` began (the block owns the step's batch)."""
        self.delimiter = Delimiter.BLOCK
        self.forward_seen = True

    def block_awaits_update(self) -> None:
        """The block ended without its optimizer step, which comes after it (Note [explicit steps])."""
        self.delimiter = Delimiter.AWAITING_UPDATE

    def block_left(self) -> None:
        """The block is over; a step awaiting its update stays so."""
        if self.delimiter is Delimiter.BLOCK:
            self.delimiter = Delimiter.IMPLICIT

    def next_step(self) -> None:
        """The step ended: the next one begins, nothing seen in it yet."""
        self.index += 1
        self.checking = self.index % self.every == 0
        if self.delimiter is Delimiter.AWAITING_UPDATE:
            self.delimiter = Delimiter.IMPLICIT
        self._clear()
        if self._on_recording is not None:
            self._on_recording()

    def close(self) -> None:
        self.closed = True
        if self._on_recording is not None:
            self._on_recording()

    def __repr__(self) -> str:
        return (f"StepState(index={self.index}, checking={self.checking}, delimiter={self.delimiter.value}, "
                f"forward_seen={self.forward_seen}, root={self.root.value}, attempted={self.attempted}, "
                f"applied={self.applied}, read={self.read}, closed={self.closed})")

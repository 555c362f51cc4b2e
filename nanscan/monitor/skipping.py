"""``on_nonfinite="skip"``: a non-finite step is not applied, and training goes on.

The sync read runs in the optimizer's step pre-hook, before the update. When it finds a reported
incident and ``on_nonfinite="skip"``, the monitor restores the buffers the step's forward changed
and raises :class:`SkipStep` out of the pre-hook; the optimizer's ``step`` -- wrapped on the
optimizer instance (:meth:`StepSkipper.wrap`) -- catches it and returns None, so the update and
every change of optimizer state (Adam's moments, step counts) never happen. A ``GradScaler`` that
skips an update itself (inf gradients) never calls ``optimizer.step``: that skip stays its own.

Note [what a skipped step leaves]: the parameters and the optimizer state are those before the
step (the update never ran); the buffers (BatchNorm running statistics, ``num_batches_tracked``,
any registered buffer) are copied back from a snapshot taken at the step's first training forward --
the one extra memory skip costs, the size of the model's buffers, never of its weights. The
gradients stay as the step left them (the loop's ``zero_grad`` clears them, as after a GradScaler
skip). An LR scheduler the loop steps after ``optimizer.step`` advances anyway -- as after a
GradScaler skip -- and torch may warn once that ``lr_scheduler.step()`` ran without
``optimizer.step()``. Under torch.distributed every rank learns of an incident in the same step
(the monitor's agreement), so every rank skips the same steps and the replicas stay identical.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SkipStep", "StepSkipper"]


class SkipStep(Exception):
    """Raised out of the optimizer's step pre-hook to cancel the update; caught by the wrapped
    ``optimizer.step`` and never seen by the training loop."""

    def __init__(self, optimizer):
        super().__init__("nanscan skipped this optimizer step (on_nonfinite='skip')")
        self.optimizer = optimizer


class _Unwrap:
    def __init__(self, optimizer, wrapper):
        self.optimizer, self.wrapper = optimizer, wrapper

    def remove(self) -> None:
        if self.optimizer.__dict__.get("step") is self.wrapper:
            del self.optimizer.step


class StepSkipper:
    """Skips steps for one monitor: the buffer snapshot, the consecutive count, the wrapped step."""

    def __init__(self, model: torch.nn.Module, max_consecutive: int):
        self.model, self.max_consecutive = model, max_consecutive
        self.consecutive = 0  # steps skipped in a row
        self.steps: list = []  # every step skipped (also in the ledger's skipped_steps)
        self._buffers: list = []
        self._snapshot: list = []

    def wrap(self, optimizer) -> _Unwrap:
        """``optimizer.step`` on the instance, catching this monitor's :class:`SkipStep`."""
        original = optimizer.step

        def step(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except SkipStep as skip:
                if skip.optimizer is not optimizer:
                    raise
                return None

        optimizer.step = step
        return _Unwrap(optimizer, step)

    def snapshot(self) -> None:
        """The buffers as they are before the step's forward (Note [what a skipped step leaves]).
        Device copies into tensors kept between steps: no host sync, no allocation once warm."""
        buffers = [b for b in self.model.buffers()]  # (now: the model may have moved since the last step)
        if len(buffers) != len(self._buffers) or any(a is not b for a, b in zip(buffers, self._buffers)):
            self._buffers = buffers
            self._snapshot = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            for saved, b in zip(self._snapshot, buffers):
                saved.copy_(b)

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in zip(self._buffers, self._snapshot):
                b.copy_(saved)

    @property
    def allowed(self) -> bool:
        """One more step may be skipped (fewer than ``max_consecutive`` in a row so far)."""
        return self.consecutive < self.max_consecutive

    def skipped(self, step: int) -> None:
        self.consecutive += 1
        self.steps.append(step)

    def applied(self) -> None:
        self.consecutive = 0

    def memory_bytes(self) -> int:
        """What the snapshot holds (the model's buffers)."""
        return sum(t.numel() * t.element_size() for t in self._snapshot)


def limit_note(skipper: Optional[StepSkipper]) -> Optional[str]:
    """The note a NonFiniteError gets when the consecutive limit made it raise instead of skip."""
    if skipper is None or skipper.allowed:
        return None
    return (f"nanscan skipped the {skipper.consecutive} step(s) before this one (max_consecutive_skips="
            f"{skipper.max_consecutive}); this one raises: a non-finite step after that many in a row is not "
            f"a passing fault (check the data and the weights, see the bundle)")

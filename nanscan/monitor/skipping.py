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

Note [what skip cannot undo]: a step is skipped only when skipping it gives the weights of a run
without that step. Where it cannot, the incident is raised (a :class:`~nanscan.NonFiniteError` with
a note saying why), never "skipped":

* the incident is of an update already applied -- a parameter (or buffer, optimizer state) that an
  earlier step's update made non-finite, found by this read: that update cannot be taken back;
* the weights or the optimizer state are already non-finite before the step's update (an update of
  a step that was not checked, with ``every`` > 1, made them so): skipping this step would only skip
  steps on broken weights (checked on the incident's path only, one sync there: free on clean steps);
* the optimizer called the closure again after changing the weights within the step (LBFGS's inner
  iterations) and the weights from before the step were not kept: torch.optim.LBFGS's are (a copy
  of the parameters and optimizer state at each checked step's ``step(closure)``, the cost of
  skip with LBFGS); another optimizer that calls its closure more than once cannot be skipped after
  its first call.

What skip cannot protect is refused or said at ``watch`` (:func:`check_skip_can_protect`): trainable
parameters outside the watched optimizer (another optimizer would apply their non-finite gradients:
refused, naming them), and ``every`` > 1 (an unchecked step's update is applied unseen: warned).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from nanscan.allow import name_allowed
from nanscan.monitor import distributed
from nanscan.warn import warn

__all__ = ["SkipStep", "StepSkipper", "check_skip_can_protect"]

_UPDATE_UNDONE = ("forward", "loss", "backward")  # phases of incidents whose update has not run yet


def check_skip_can_protect(model: torch.nn.Module, optimizer, every: int) -> None:
    """At ``watch(..., on_nonfinite="skip")``: refuses trainable parameters the watched optimizer
    does not step, and warns that ``every`` > 1 leaves unchecked steps unprotected (Note [what skip
    cannot undo])."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if outside:
        shown = ", ".join(repr(n) for n in outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        raise ValueError(
            f"nanscan.watch: on_nonfinite='skip' cancels the watched optimizer's update, and {len(outside)} trainable "
            f"parameter(s) of the model are not in it: {shown}. Another optimizer that steps them would apply a "
            f"non-finite step's gradients. Put every trained parameter in the watched optimizer (param groups "
            f"can give them their own lr), freeze the others (requires_grad_(False)), or use "
            f"on_nonfinite='raise'")
    if every > 1:
        warn(f"nanscan.watch: on_nonfinite='skip' with every={every} protects the checked steps only: an "
             f"unchecked step's non-finite update is applied unseen; the next checked step then finds the weights "
             f"non-finite and raises (a skip cannot undo it). every=1 skips every non-finite step.",
             RuntimeWarning, stacklevel=3)


def _nonfinite_names(named) -> list:
    """Names of the floating tensors in ``named`` ((name, tensor) pairs) holding a NaN or Inf: one
    flag per tensor, one host copy per device (an incident's path only)."""
    flags: dict = {}
    for name, t in named:
        t = distributed.local_shards([t])[0]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
            flags.setdefault(t.device, []).append((name, ~torch.isfinite(t).all()))
    bad = []
    for pairs in flags.values():
        found = torch.stack([f for _, f in pairs]).cpu().tolist()
        bad += [name for (name, _), b in zip(pairs, found) if b]
    return bad


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

    def __init__(self, model: torch.nn.Module, max_consecutive: int, allow: tuple = ()):
        self.model, self.max_consecutive = model, max_consecutive
        self.allow = allow  # (names allowed to be non-finite: they do not stop a skip either)
        self.optimizer = None
        self.consecutive = 0  # steps skipped in a row
        self.steps: list = []  # every step skipped (also in the ledger's skipped_steps)
        self._buffers: list = []
        self._snapshot: list = []
        # optimizer.step(closure): the closure's returns so far in this step, and (LBFGS) the
        # parameters and optimizer state from before the step (Note [what skip cannot undo])
        self.closure_calls = 0
        self._weights: Optional[tuple] = None

    def wrap(self, optimizer) -> _Unwrap:
        """``optimizer.step`` on the instance, catching this monitor's :class:`SkipStep`."""
        self.optimizer = optimizer
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

    def closure_step_begins(self, optimizer) -> None:
        """A checked ``optimizer.step(closure)`` begins: an optimizer whose step calls the closure
        again after changing the weights (torch.optim.LBFGS) has its parameters and state kept."""
        self.closure_calls = 0
        self._weights = None
        if isinstance(optimizer, torch.optim.LBFGS):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                self._weights = ([(p, p.detach().clone()) for p in params],
                                 {p: copy.deepcopy(state) for p, state in optimizer.state.items()})

    def closure_returned(self) -> None:
        self.closure_calls += 1

    def step_ended(self) -> None:
        self.closure_calls = 0
        self._weights = None

    def cannot_undo(self, read_step: int, report) -> Optional[str]:
        """Why the reported step cannot be skipped (Note [what skip cannot undo]), or None. Under
        torch.distributed a collective (every rank asks it of the same agreed report)."""
        if report.step != read_step or report.phase not in _UPDATE_UNDONE:
            return (f"nanscan did not skip: the incident is of step {report.step}'s update, which was applied "
                    f"already; skipping step {read_step} cannot undo it")
        if self.closure_calls > 1 and self._weights is None:
            return (f"nanscan did not skip: {type(self.optimizer).__name__} called the closure {self.closure_calls} "
                    f"times in this step and changed the weights in between; they were not kept, so the step "
                    f"cannot be undone")
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self._weights is not None:  # (LBFGS: the weights from before the step are the ones to keep)
            params, state = self._weights
            named = [(names.get(id(p), "a parameter"), saved) for p, saved in params]
        else:
            named = list(self.model.named_parameters())
            state = self.optimizer.state if self.optimizer is not None else {}
        for p, entries in state.items():
            for key, value in (entries.items() if isinstance(entries, dict) else ()):
                if isinstance(value, torch.Tensor):
                    named.append((f"optimizer state {key!r} of {names.get(id(p), 'a parameter')}", value))
        bad = [n for n in _nonfinite_names(named) if not (self.allow and name_allowed(n, self.allow))]
        if distributed.active():
            broken = distributed.any_rank(bool(bad))
            if broken and not bad:
                bad = ["(on another rank)"]
        if bad:
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            return (f"nanscan did not skip: the weights were already non-finite before step {read_step}'s update "
                    f"({shown}); an earlier update made them so (with every > 1, an unchecked step's), and "
                    f"skipping cannot undo it")
        return None

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in zip(self._buffers, self._snapshot):
                b.copy_(saved)
            if self._weights is not None and self.closure_calls > 1:  # (LBFGS: its inner iterations ran)
                params, state = self._weights
                for p, saved in params:
                    p.copy_(saved)
                self.optimizer.state.clear()
                self.optimizer.state.update(state)

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

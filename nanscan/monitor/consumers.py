"""What the monitor's reads and completed steps are given to: two small protocols, and the one rule
for a failure inside either.

* A :class:`ReadConsumer` is given every landed :class:`~nanscan.monitor.read.Read`, in the order of
  :class:`~nanscan.monitor.outcomes.Outcomes`'s one list: the step log, headroom, telemetry, the
  spike baselines. Each walks the read's rows through :meth:`Read.runs` (one iterator, the same runs
  for all of them) and decodes only the rows it needs; each leaves eval reads alone unless it keeps
  them (the step log keeps their incidents).
* A :class:`StepListener` is given, by the step log, each checked step once all its records are in
  (:class:`CompletedStep`, in step order), the events another listener found in it (a spike: the
  telemetry sinks publish its ratio), the end of the run (``run_ends``: the step raised its incident,
  or the monitor closes) and ``close``. Telemetry and the spike baselines are listeners: they need a
  step's loss and gradient norm, which exist only once its last record was read.

A failure inside a consumer or a listener is nanscan's own, never the training loop's: it is warned
about once and that part is turned off (:func:`turn_off`); the others go on. Under torch.distributed
telemetry stays in its gathers after it is turned off (:meth:`nanscan.monitor.health.Health.turn_off`),
so no rank waits for it.
"""
from __future__ import annotations

from typing import Optional

from nanscan.warn import warn

__all__ = ["CompletedStep", "Part", "ReadConsumer", "StepListener", "tell", "turn_off"]


class Part:
    """What consumers and listeners share: ``what`` names the part in the warning of its failure;
    ``off``: turned off by one (it is then given nothing more)."""

    what = "a part of the monitor"
    off = False

    def turn_off(self) -> None:
        self.off = True


class ReadConsumer(Part):
    """Given every landed read (see the module docstring)."""

    def observe(self, read) -> None:
        raise NotImplementedError


class CompletedStep:
    """A checked step whose records are all in, as the step log writes it: ``loss``, ``grad_norm``
    (before clipping; NaN / inf when a gradient was non-finite; None unknown), ``loss_scale``,
    ``update`` (``"applied"`` / ``"skipped"`` / None), ``nonfinite`` (per training phase), ``clipped``
    (``grad_norm`` is the total norm ``clip_grad_norm_`` returned), ``ended`` (the step ended; a step
    only read, at close, did not)."""

    __slots__ = ("step", "loss", "grad_norm", "loss_scale", "update", "nonfinite", "clipped", "ended")

    def __init__(self, step: int, *, loss, grad_norm, loss_scale, update: Optional[str], nonfinite: dict,
                 clipped: bool, ended: bool):
        self.step, self.loss, self.grad_norm, self.loss_scale = step, loss, grad_norm, loss_scale
        self.update, self.nonfinite, self.clipped, self.ended = update, nonfinite, clipped, ended


class StepListener(Part):
    """Given each completed step by the step log (see the module docstring). ``completed`` returns the
    events it found in the step (each with ``step``, ``to_dict()`` and ``LOG_TYPE``, the event
    line's type): the step log writes them and gives them to every listener's ``event``."""

    def wants_numbers(self, read) -> bool:
        """It needs the step numbers this read holds (its loss, its gradient norm). False lets the step
        log fold only what adds up between points (non-finite counts, the loss)."""
        return True

    def completed(self, step: CompletedStep) -> list:
        return []

    def event(self, event) -> None:
        pass

    def run_ends(self, failure: bool) -> None:
        """The run stops here (``failure``: the step raised its incident) or the monitor closes."""

    def close(self) -> None:
        pass


def turn_off(part, error: BaseException, stacklevel: int = 4) -> None:
    """``part`` (a consumer or a listener) failed with ``error``: warned about once, turned off."""
    if part.off:
        return
    part.turn_off()
    warn(f"nanscan: {part.what} failed and is turned off: {error!r}", RuntimeWarning, stacklevel=stacklevel)


def tell(parts, call, stacklevel: int = 6) -> list:
    """``call(part)`` for each of ``parts`` still on, in order; their results. A part that fails is
    turned off (:func:`turn_off`) and the others go on."""
    results = []
    for part in parts:
        if not part.off:
            try:
                results.append(call(part))
            except Exception as error:  # nanscan's own failure never stops training
                turn_off(part, error, stacklevel)
    return results

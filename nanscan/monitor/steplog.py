"""The monitor's per-step event log: one JSONL record per checked step and one per incident,
built from the records the monitor reads anyway (no extra host sync).

Only checked steps (``every``) have a record. A step's record is written once the step ended and
its records were read -- one step later when parameters are checked after the update (those records
come with the next step's copy), two in async mode -- and at close; records are written in
increasing step order, and the log keeps an entry only for a checked step still to be written (a
few at most, whatever the run's length). A record that arrives for a step already written (a late
one) is not folded in: its incident, if any, is logged on its own.

Eval forwards (a decision; ``no_grad`` / ``inference_mode``: phase ``"eval"``, see
:mod:`nanscan.monitor.monitor`) are no step's: their reads never create, change or count in a step
record -- not its ``nonfinite`` counts, not its ``loss`` (a model that returns its own loss in
eval) -- and a non-finite value they hold is logged as an incident line of its own (``"phase":
"eval"``, with the step it ran in). So ``nonfinite`` has the training phases only. (Eval forwards
run in every step, checked or not, and at times no step runs -- after the last one, say --: folding
them into step records made an entry for every step, and records for steps never checked or never
run.)

Per step: ``loss`` (the loss record's value), ``grad_norm`` (sqrt of the summed FP32 sums of squares
of the parameter gradients, read when the step is checked: unscaled when GradScaler unscaled them;
``inf`` / NaN when a gradient was non-finite), ``loss_scale``, ``lr`` (first param group),
``update`` (``"applied"`` / ``"skipped"``; None without an optimizer) and ``nonfinite``: per training
phase (``forward``, ``loss``, ``backward``, ``update``), the number of non-finite elements over the
tensors checked in that phase (propagated values included, so it measures spread, not origin);
with ``watch(..., headroom_bits=N)``, ``headroom``: the few tensors closest to overflow that step,
``"<kind> <name>"`` -> bits of headroom (only those within a few bits of the threshold:
:mod:`nanscan.monitor.headroom`). A headroom warning is an event line of its own (``"type":
"headroom"``, the fields of :class:`~nanscan.monitor.headroom.HeadroomEvent`).

A failure to write the log never stops training: it is warned about once, logging stops, and the
error is kept in ``error`` (``nanscan.guard`` attaches it to a training exception, if any).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

from nanscan.monitor.slots import EagerRows
from nanscan.record import Field
from nanscan.vocabulary import TRAINING_PHASES


class StepLog:
    def __init__(self, log, rank: int):
        from nanscan.log import EventLog

        self.steps: dict = {}  # step -> its entry, only for checked steps still to be written
        self.error: Optional[BaseException] = None
        self.written = -1  # the last step flushed: a record of it or of an earlier step is late
        self.owned = not isinstance(log, EventLog)
        self.log = log if not self.owned else None
        if self.owned:  # opening it is a write too: a failure warns once and logging stops
            self._write(lambda: setattr(self, "log", EventLog(log, rank=rank)))

    def _entry(self, step: int) -> Optional[dict]:
        """The entry of ``step``, made if needed; None when ``step`` was flushed already (late)."""
        if step <= self.written:
            return None
        return self.steps.setdefault(step, {"loss": None, "grad_sumsq": None, "grad_bad": False, "loss_scale": None,
                                            "nonfinite": dict.fromkeys(TRAINING_PHASES, 0), "ended": False,
                                            "read": False, "headroom": {}})

    @staticmethod
    def _eval_read(slots, rows) -> bool:
        """Whether ``rows`` (the hook rows of a read) are an eval forward's: a read window is of one
        phase, and each hook row says which but a loss row (phase ``"loss"`` in either)."""
        for i, s in enumerate(slots):
            if s is rows:
                phase = rows.slot(i).phase
                if phase != "loss":
                    return phase == "eval"
        return False

    def observe(self, slots, values, nonfinite) -> None:
        """Fold one decoded read into its steps; an eval forward's read is not a step's (see the
        module docstring) and is left out. (The hooks' rows are looked at only where they matter
        here -- non-finite, or the model's own loss -- : making a Slot of each costs more than the
        rest of the read.)"""
        eager = list({id(s): s for s in slots if type(s) is EagerRows}.values())
        if any(self._eval_read(slots, rows) for rows in eager):
            return
        for rows in eager:
            for step in rows.steps:
                e = self._entry(step)
                if e is not None:
                    e["read"] = True
        for i, (s, v, bad) in enumerate(zip(slots, values, nonfinite)):
            if type(s) is EagerRows:
                if not bad and i not in s.loss_entries:
                    continue
                s = s.slot(i)
            if s.phase == "eval":  # (defensive: an eval read was left out above)
                continue
            e = self._entry(s.step)
            if e is None:  # already written (a late record; incidents are logged on their own)
                continue
            e["read"] = True
            count = int(v[Field.NAN_COUNT] + v[Field.POSINF_COUNT] + v[Field.NEGINF_COUNT])
            if s.candidate and s.phase in e["nonfinite"]:
                e["nonfinite"][s.phase] += count
            if s.kind == "loss":
                e["loss"] = v[Field.FINITE_MIN] if not bad else (math.nan if v[Field.NAN_COUNT] else
                                                                  math.copysign(math.inf, v[Field.POSINF_COUNT] - 0.5))
            elif s.kind == "grad" and s.param is not None:
                e["grad_sumsq"] = (e["grad_sumsq"] or 0.0) + v[Field.SUMSQ]
                e["grad_bad"] = e["grad_bad"] or (bool(v[Field.NAN_COUNT]) and "nan") or (count > 0 and "inf")

    def headroom(self, step: int, lowest: dict) -> None:
        """The tensors closest to overflow in ``step`` (``label -> bits``), kept with its record."""
        e = self._entry(step)
        if e is not None:
            kept = e["headroom"]
            for label, bits in lowest.items():
                kept[label] = min(bits, kept.get(label, bits))

    def headroom_event(self, event) -> None:
        fields = {("record_kind" if k == "kind" else k): v for k, v in event.to_dict().items()
                  if k not in ("step", "rank")}
        self._write(lambda: self.log.event("headroom", event.step, **fields))

    def clip_norm(self, step: int, value: Optional[float]) -> None:
        """The total norm ``clip_grad_norm_`` returned in ``step`` (before clipping): the step's
        ``grad_norm``, since the gradients read before the update are the clipped ones. None: it
        clipped by another norm than L2, so the L2 norm before clipping is unknown."""
        e = self._entry(step)
        if e is not None:
            e["clip_norm"] = "unknown" if value is None else value

    def scale(self, step: int, value: float) -> None:
        e = self._entry(step)
        if e is not None:
            e["loss_scale"] = value

    def ended(self, step: int, update: Optional[str], lr: Optional[float]) -> None:
        """A checked step ended (the monitor calls this for checked steps only)."""
        e = self._entry(step)
        if e is not None:
            e.update(ended=True, update=update, lr=lr)

    def decided(self, step: int, update: str) -> None:
        if step in self.steps:
            self.steps[step]["update"] = update

    def incident(self, incident, bundle: Optional[str]) -> None:
        self._write(lambda: self.log.incident(incident, bundle=bundle, step=incident.step))

    def flush(self, before: Optional[int] = None) -> None:
        """Write the checked steps before ``before``, in step order: the monitor passes the first
        step whose records may still be coming (it keeps a step back while its
        parameters-after-update records are still to be read: they come with the next step's
        copy), so every record of an earlier step is in. An earlier entry that did not end is not
        a checked step's (only checked steps end here): it is dropped. ``before`` None (close):
        everything left, but an entry neither ended nor read (no step ran for it)."""
        for step in sorted(self.steps):
            if before is not None and step >= before:
                break
            e = self.steps.pop(step)
            self.written = step  # (ascending, and every entry is after the last one written)
            if not e["ended"] and (before is not None or not e["read"]):
                continue
            grad_norm = None
            if e.get("clip_norm") is not None:  # (clipped in this step: the norm before clipping)
                grad_norm = None if e["clip_norm"] == "unknown" else e["clip_norm"]
            elif e["grad_bad"] == "nan":
                grad_norm = math.nan
            elif e["grad_bad"]:
                grad_norm = math.inf
            elif e["grad_sumsq"] is not None:
                grad_norm = math.sqrt(e["grad_sumsq"])
            extra = {"headroom": dict(sorted(e["headroom"].items(), key=lambda kv: kv[1]))} if e["headroom"] else {}
            # (_write calls it at once; a lambda, not a partial: self.log and e are read inside _write's try)
            self._write(lambda step=step, e=e, grad_norm=grad_norm, extra=extra: self.log.step(
                step, loss=e["loss"], grad_norm=grad_norm, loss_scale=e["loss_scale"], lr=e.get("lr"),
                update=e.get("update"), nonfinite=e["nonfinite"], **extra))

    def _write(self, write) -> None:
        if self.error is not None:
            return
        try:
            write()
        except Exception as e:  # the run matters more than its log: warn once, stop logging
            self.error = e
            warnings.warn(f"nanscan: the event log could not be written, logging stops: {e!r}", RuntimeWarning,
                          stacklevel=4)

    def close(self) -> None:
        self.flush()
        if self.owned and self.log is not None:
            self._write(self.log.close)

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

from nanscan.monitor.consumers import CompletedStep, ReadConsumer, tell
from nanscan.monitor.slots import EagerRows, Slot
from nanscan.record import Field
from nanscan.vocabulary import TRAINING_PHASES


class StepLog(ReadConsumer):
    """The step log of one monitor (see the module docstring): a :class:`ReadConsumer` of every
    read, and the one that hands each completed step to its ``listeners`` (telemetry, the spike
    baselines: :class:`~nanscan.monitor.consumers.StepListener`), in order. ``log`` None: no event
    log is written (the listeners still get their steps)."""

    def __init__(self, log, rank: int, listeners=()):
        from nanscan.log import EventLog

        self.steps: dict = {}  # step -> its entry, only for checked steps still to be written
        self.error: Optional[BaseException] = None
        self.written = -1  # the last step flushed: a record of it or of an earlier step is late
        self._losses: list = []  # (loss slot, entry in the training window) recorded since the last read
        self.listeners = list(listeners)
        self.logging = log is not None
        self.owned = log is not None and not isinstance(log, EventLog)
        self.log = log if not self.owned else None
        if self.owned:  # opening it is a write too: a failure warns once and logging stops
            self._write(lambda: setattr(self, "log", EventLog(log, rank=rank)))

    @property
    def what(self) -> str:
        fed = [listener.what for listener in self.listeners if not listener.off]
        return "the step log" + (f" (and with it {', '.join(fed)})" if fed else "")

    def turn_off(self) -> None:
        """Its own failure: no more lines, and the listeners it feeds are turned off too (the steps
        it would give them now miss what it failed to fold). Telemetry under torch.distributed
        stays in its gathers (:meth:`Health.turn_off`), so flushing goes on for it."""
        self.off = True
        self.logging = False
        for listener in self.listeners:
            listener.turn_off()

    def _entry(self, step: int) -> Optional[dict]:
        """The entry of ``step``, made if needed; None when ``step`` was flushed already (late)."""
        if step <= self.written:
            return None
        entry = self.steps.get(step)  # (asked once per decoded row: no new dict for a step that has one)
        if entry is not None:
            return entry
        return self.steps.setdefault(step, {"loss": None, "grad_sumsq": None, "grad_bad": False, "loss_scale": None,
                                            "nonfinite": dict.fromkeys(TRAINING_PHASES, 0), "ended": False,
                                            "read": False, "headroom": {}})

    def loss_recorded(self, slot, entry: int) -> None:
        """The monitor put a loss (``slot``) at ``entry`` of the training window: the fast path of
        :meth:`observe` folds it without scanning the read."""
        self._losses.append((slot, entry))

    @staticmethod
    def _eval_read(runs) -> bool:
        """Whether a read's hook rows are an eval forward's: a read window is of one phase, and each
        hook row says which but a loss row (phase ``"loss"`` in either)."""
        for start, end, s in runs:
            if type(s) is EagerRows:
                for i in range(start, end):
                    phase = s.rows.row(i)[4]
                    if phase != "loss":
                        return phase == "eval"
        return False

    def _wanted(self, read) -> bool:
        """A listener needs this read's numbers of its steps (loss, gradient norm) -- or the log does."""
        return self.logging or any(listener.wants_numbers(read) for listener in self.listeners if not listener.off)

    def observe(self, read) -> None:
        """Fold one decoded :class:`~nanscan.monitor.read.Read` into its steps; an eval forward's read
        is not a step's (see the module docstring) and is left out. Only the rows that matter here
        are decoded -- non-finite ones, losses, parameter gradients (their norm) --, the hooks' rows
        from one conversion of the host records, and no Slot is made for a block's row (making a
        Slot of each row costs more than the rest of the read)."""
        runs, bad = read.runs(), read.bad
        if self._eval_read(runs):
            return
        eager = list({id(s): s for _, _, s in runs if type(s) is EagerRows}.values())
        for rows in eager:
            for step in rows.steps:
                e = self._entry(step)
                if e is not None:
                    e["read"] = True
        slots = read.slots
        if not self._wanted(read):
            # Telemetry alone, and no telemetry step in this read: only what adds up between points
            # (non-finite counts, kept per step) is needed, and the loss (a point published off
            # schedule has it: Note [the failure reaches the tracker]).
            for i in sorted(bad):
                row = read.slot(i)
                self._fold(row.step, row.phase, row.kind, row.param, row.candidate, read.values(i), True)
            for rows in eager:
                for i in rows.loss_entries:
                    if i not in bad:
                        row = rows.slot(i)
                        self._fold(row.step, row.phase, row.kind, row.param, row.candidate, read.values(i), False)
            for slot, i in self._losses:  # (recorded at backward: found by where it was put, not by a scan)
                if i < len(slots) and slots[i] is slot and i not in bad:
                    self._fold(slot.step, slot.phase, slot.kind, slot.param, slot.candidate, read.values(i), False)
            self._losses.clear()
            return
        self._losses.clear()
        # (a few rows each -- the losses, non-finite rows -- and one column of the parameter
        # gradients: converted as read, not every row of the read)
        values = read.record
        for start, end, s in runs:
            t = type(s)
            if t is EagerRows:  # (only its non-finite rows and its losses)
                wanted = bad | s.loss_entries
                for i in sorted(i for i in wanted if start <= i < end):
                    row = s.slot(i)
                    self._fold(row.step, row.phase, row.kind, row.param, row.candidate, values(i), i in bad)
            elif t is Slot:
                self._fold(s.step, s.phase, s.kind, s.param, s.candidate, values(start), start in bad)
            else:  # (a block's rows share step, phase and kind: no Slot made for any)
                self._fold_block(s, start, end, bad, read)

    def _fold(self, step, phase, kind, param, candidate, v, is_bad: bool) -> None:
        """One decoded row into its step's entry."""
        if phase == "eval":  # (defensive: an eval read was left out above)
            return
        e = self._entry(step)
        if e is None:  # already written (a late record; incidents are logged on their own)
            return
        e["read"] = True
        self._count(e, phase, kind, param, candidate, v)
        if kind == "loss":
            e["loss"] = v[Field.FINITE_MIN] if not is_bad else (
                math.nan if v[Field.NAN_COUNT] else math.copysign(math.inf, v[Field.POSINF_COUNT] - 0.5))
        elif kind == "grad" and param is not None:
            e["grad_sumsq"] = (e["grad_sumsq"] or 0.0) + v[Field.SUMSQ]

    @staticmethod
    def _count(e: dict, phase, kind, param, candidate, v) -> None:
        """A row's non-finite values into its step's counts (and a parameter gradient's kind of break)."""
        count = int(v[Field.NAN_COUNT] + v[Field.POSINF_COUNT] + v[Field.NEGINF_COUNT])
        if candidate and phase in e["nonfinite"]:
            e["nonfinite"][phase] += count
        if kind == "grad" and param is not None:
            e["grad_bad"] = e["grad_bad"] or (bool(v[Field.NAN_COUNT]) and "nan") or (count > 0 and "inf")

    def _fold_block(self, block, start: int, end: int, bad: set, read) -> None:
        """The rows [start, end) of one block of ``read``: only its non-finite rows, and the sums of
        squares of the parameter gradients (their norm), are decoded."""
        if block.phase == "eval":
            return
        e = self._entry(block.step)
        if e is None:
            return
        e["read"] = True
        broken = sorted(j for j in bad if start <= j < end)
        for j in broken:  # (counts, and a non-finite gradient's kind; the norm is summed below)
            self._count(e, block.phase, block.kind, block.param, True, read.record(j))
        if block.kind == "grad" and block.param is not None:  # every row, in order (not sum(): 3.12 compensates)
            total = e["grad_sumsq"] or 0.0
            for v in read.column(start, end, Field.SUMSQ):
                total = total + v
            e["grad_sumsq"] = total

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
        """Write the checked steps before ``before``, in step order, and give each to the listeners
        (after its line: a sink's KeyboardInterrupt cannot lose the line): the monitor passes the
        first step whose records may still be coming (it keeps a step back while its
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
            if self.listeners:
                self._completed(CompletedStep(step, loss=e["loss"], grad_norm=grad_norm, loss_scale=e["loss_scale"],
                                              update=e.get("update"), nonfinite=e["nonfinite"],
                                              clipped=e.get("clip_norm") is not None, ended=e["ended"]))

    def _completed(self, done: CompletedStep) -> None:
        """``done`` to each listener in order; the events one finds are written (their own line) and
        given to every listener. A listener's failure turns it off (warned once)."""
        found = [event for events in tell(self.listeners, lambda listener: listener.completed(done), 7)
                 for event in events]
        for event in found:
            fields = {k: v for k, v in event.to_dict().items() if k != "step"}
            self._write(lambda event=event, fields=fields: self.log.event(event.LOG_TYPE, event.step, **fields))
            tell(self.listeners, lambda listener, event=event: listener.event(event), 7)

    def _write(self, write) -> None:
        if self.error is not None or not self.logging:
            return
        try:
            write()
        except Exception as e:  # the run matters more than its log: warn once, stop logging
            self.error = e
            warnings.warn(f"nanscan: the event log could not be written, logging stops: {e!r}", RuntimeWarning,
                          stacklevel=4)

    def failed(self) -> None:
        """A step raised its incident: every step read so far is written and given to the
        listeners now (telemetry publishes a point: Note [the failure reaches the tracker] in
        :mod:`nanscan.monitor.health`), before the error stops the loop. Records of those steps
        that come later are late ones."""
        self.flush()
        self._run_ends(failure=True)

    def _run_ends(self, failure: bool) -> None:
        tell(self.listeners, lambda listener: listener.run_ends(failure))

    def close(self) -> None:
        self.flush()
        self._run_ends(failure=False)
        if self.owned and self.log is not None:
            self._write(self.log.close)
        for listener in self.listeners:  # (one turned off too: it may hold sinks to close)
            try:
                listener.close()
            except Exception as error:
                warnings.warn(f"nanscan: {listener.what} could not be closed: {error!r}", RuntimeWarning, stacklevel=3)

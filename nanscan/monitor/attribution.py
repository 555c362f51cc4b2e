"""Attribution: from the decoded records of one read, the first non-finite value of each step and
phase, and whether it was produced there or propagated.

Production order is the order of the slots (eager hooks run in the order the values are made;
compiled rows are ordered by their device counter). The first non-finite *candidate* slot of a
(step, phase), outside the allow-list, is the incident. ``produced`` compares with the records of
the slot's inputs:

* a module output: the module's inputs; a value made in a module's own body: that module's inputs;
* the gradient flowing into a module output: the module that consumed the output made it in its
  backward, from the gradients of its own outputs. With exactly one consumer the incident is
  named after it; with several (a residual stream) nanscan cannot tell which one made it: it
  keeps the tensor's name and says ``produced=None`` unless an incoming gradient was already
  non-finite (then it was propagated);
* a parameter's gradient: the gradients of its module's outputs and the module's forward inputs;
* a parameter after the update: its gradient (read a step earlier); a buffer after the update:
  produced when nothing in the step's forward was non-finite, else nanscan cannot tell;
* the loss: the model's outputs.

A slot that went stale (its tensor was changed in place before it was summarized) is never an
incident, and a value computed from a stale one gets ``produced=None``: nanscan does not know
what the stale tensor held. Nor does it know what a module call that changed one of its inputs in
place computed from (its input's record, made before the call, is right; the call then read
something else): its outputs get ``produced=None`` too.
"""
from __future__ import annotations

from typing import Optional

from nanscan.allow import name_allowed
from nanscan.monitor.incident import Incident
from nanscan.monitor.slots import at
from nanscan.record import Field, TensorSummary
from nanscan.vocabulary import PHASE_ORDER


def allowed(slot, patterns) -> bool:
    return name_allowed(slot.name, patterns)


def _consumer(slots, slot):
    """For the gradient of a forward value: (name, incoming gradient slot indices, unique)."""
    forward = at(slots, slot.grad_of)
    frames = forward.consumers or ()
    incoming = tuple(at(slots, o).grad for f in frames for o in f.outputs if at(slots, o).grad is not None)
    if len(frames) == 1:
        return frames[0].info.name, incoming, frames[0].complete
    return slot.name, incoming, False


def first_incidents(slots, values, bad: set, *, allow, handled_step: Optional[int], rank: int,
                    position=None, reduced_grads: bool = False) -> list:
    """Incidents, one per (step, phase), sorted in training order. ``values(i)`` gives slot i's
    record as a list of floats; ``bad`` holds the indices of slots with a non-finite element;
    gradient incidents of ``handled_step`` are marked handled by GradScaler; ``position(i)``
    orders slots in production order where index order is not (default: index order).
    ``reduced_grads``: parameter gradients were reduced across ranks (data parallel, FSDP): one
    whose local inputs were finite may hold another rank's non-finite contribution, so nanscan
    cannot tell where it was produced (``produced=None``)."""
    first, seen = {}, set()
    last_bad = {}  # (step, phase) -> the latest non-finite slot that is not a compiled input row
    explained_by = {}  # compiled input row -> that slot: the value it most likely is (no identity in a graph)
    for i in sorted(bad, key=position):
        s = at(slots, i)
        if s.late:  # the root's output, recorded eagerly after a compiled forward (decoded before its rows)
            continue
        earlier = (s.step, s.phase) in seen
        seen.add((s.step, s.phase))
        if s.derived and earlier:  # a compiled input row that an earlier non-finite value explains
            if (s.step, s.phase) in last_bad:
                explained_by[i] = last_bad[(s.step, s.phase)]
            continue
        if not s.derived:
            last_bad[(s.step, s.phase)] = i
        if not s.candidate or (s.step, s.phase) in first:
            continue
        if s.stale or allowed(s, allow):
            continue
        name, inputs, sure = s.name, s.inputs, True
        if s.grad_of is not None:
            name, inputs, sure = _consumer(slots, s)
        bad_inputs = tuple(dict.fromkeys(at(slots, explained_by.get(j, j)).name for j in inputs if j in bad))
        if s.known_bad_inputs is not None:  # inputs read in an earlier window
            bad_inputs = tuple(s.known_bad_inputs)
            produced = not bad_inputs
        elif s.inputs_changed or any(at(slots, j).stale for j in inputs):
            # What a stale input held when it was used is unknown, and so is what a call that
            # changed its inputs in place computed from: only a non-finite input that is not stale
            # says "propagated".
            produced = False if any(j in bad and not at(slots, j).stale for j in inputs) else None
        elif s.kind == "optimizer_state" or (s.kind in ("grad", "param", "buffer") and not inputs
                                             and s.grad_of is None):
            produced = None
        elif not sure:
            produced = False if bad_inputs else None
        elif reduced_grads and s.param and not bad_inputs:
            produced = None
        else:
            produced = not bad_inputs
        # Only gradient overflow is AMP's to handle: loss scaling cannot fix a non-finite forward
        # activation or loss (the same batch would overflow again and the scale would only collapse).
        handled = handled_step is not None and s.step == handled_step and s.phase == "backward"
        summary = TensorSummary.from_values(values(i), s.dtype, s.shape)
        order = i if position is None else sum(1 for j in range(len(slots)) if position(j) < position(i))
        first[(s.step, s.phase)] = Incident(step=s.step, phase=s.phase, name=name, kind=s.kind, produced=produced,
                                            summary=summary, rank=rank, inputs=bad_inputs, handled_by_scaler=handled,
                                            order=order)
    return sorted(first.values(), key=lambda inc: (inc.step, PHASE_ORDER[inc.phase]))


def offenders(slots, bad: set, *, allow, position=None) -> dict:
    """Every non-finite value a read found, not only the first: ``{step: [names]}`` in production
    order, without repeats -- the list to build an allow-list from when non-finite values are
    intended (padding with -inf in several heads, say). Values recorded only for attribution (the
    batch, compiled input rows) and stale ones are left out."""
    found: dict = {}
    for i in sorted(bad, key=position):
        s = at(slots, i)
        if not s.candidate or s.derived or s.late:
            continue
        if s.stale or allowed(s, allow):
            continue
        names = found.setdefault(s.step, [])
        if s.name not in names:
            names.append(s.name)
    return found


def other_offenders(slots, values, bad: set, *, allow, report, position=None) -> tuple:
    """What the warning about ``report`` says of the step's other non-finite values: ``(made,
    spread, fills)`` -- the names of values made non-finite from finite inputs, how many values were
    computed from non-finite ones (propagated: they say nothing new and must not go into an
    allow-list, which would mute the monitor), and the names that look like intended fills (only
    -inf, made from finite inputs: masks, padding), the report's own included when it is one."""
    made, fills, spread, seen = [], [], 0, set()
    for i in sorted(bad, key=position):
        s = at(slots, i)
        if not s.candidate or s.derived or s.late or s.stale or allowed(s, allow) or s.step != report.step:
            continue
        if s.name in seen:
            continue
        seen.add(s.name)
        v = values(i)
        from_bad = bool(s.known_bad_inputs) or any(j in bad for j in (s.inputs or ()))
        only_neginf = v[Field.NAN_COUNT] == 0 and v[Field.POSINF_COUNT] == 0
        if only_neginf and not from_bad and s.grad_of is None:
            fills.append(s.name)
        if s.name == report.name:
            continue
        if from_bad:
            spread += 1
        else:
            made.append(s.name)
    return made, spread, fills

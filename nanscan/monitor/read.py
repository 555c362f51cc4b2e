"""One landed read: :class:`Read`, the contract between recording and everything that consumes it.

Recording puts records in three places -- the eager window (hooks, the loss, parameters, buffers,
optimizer state), the gradient sink (gradients of module outputs) and the parameter gradients taken
at the read -- and, under ``torch.compile``, in the compiled path's rows (one sub-window per
training forward). :meth:`Read.land` waits for the one copy of a read (:mod:`readback`) and glues
the compiled rows after the window's entries, so that every consumer sees one list of rows in
production order, whatever their source:

* ``slots[i]`` -- what row ``i`` is (a :class:`~nanscan.monitor.slots.Slot`, or a lazy run standing
  in for each of its rows; :meth:`slot` gives the Slot);
* :meth:`runs` -- the rows as runs ``(start, end, source)``: the one way a consumer walks a read;
* :meth:`values` ``(i)`` -- its record as Python floats (decoded only when asked: a consumer asks
  for the few rows it needs);
* ``bad`` -- the indices of the rows holding a NaN or an Inf;
* ``position`` -- None when index order is production order, else the key that orders the rows:
  eager records among the compiled rows by the host's count of stamped rows when each was made
  (``order_known``: Note [stamps counted on the host] in csrc/monitor/stamp_rows.cpp), else eager
  records first, then the compiled rows; the parameter gradients read after the backward last;
* ``step``, ``training`` (False: an eval forward's window), ``final`` (read at close), ``handled``
  (GradScaler skipped this step's update), ``extras`` (loss scale, fused-AMP ``found_inf``, clip
  norm), ``host`` (the hooks' records as one float64 tensor, for vectorized passes; :meth:`host_rows`:
  the same as Python floats, converted once for every consumer).

Attribution, offenders, the step log, headroom, the cross-rank agreement, capture and the raise /
warn policy each take a ``Read``; none of them reaches back into the monitor.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, Optional

from nanscan.monitor.readback import Copy
from nanscan.monitor.slots import BODY, OUTPUT, Block, EagerRows, at
from nanscan.record import RECORD_SIZE

__all__ = ["Read"]


class Read:
    """A landed read (see the module docstring)."""

    __slots__ = ("step", "training", "final", "handled", "slots", "bad", "values", "position", "eager_count",
                 "grad_start", "recorded_forward", "compiled", "compiled_ran", "extras", "host", "order_known",
                 "grads_in_graphs", "_runs", "_host_rows")

    def __init__(self, *, step: int, slots: list, values: Callable, bad: set, training: bool = True,
                 final: bool = False, handled: bool = False, position: Optional[Callable] = None,
                 eager_count: Optional[int] = None, grad_start: Optional[int] = None, recorded_forward: bool = True,
                 compiled: bool = False, compiled_ran: bool = False, extras: Optional[dict] = None, host=None,
                 order_known: bool = True):
        self.step, self.slots, self.values, self.bad = step, slots, values, bad
        self.training, self.final, self.handled = training, final, handled
        self.position = position
        self.eager_count = len(slots) if eager_count is None else eager_count  # rows before the compiled ones
        self.grad_start = grad_start  # where the parameter gradients' block starts, if they were read
        self.recorded_forward = recorded_forward  # a training forward was recorded by the eager hooks
        self.compiled = compiled  # the compiled path's rows were read with it (a compiled model)
        self.compiled_ran = compiled_ran  # ... and compiled graphs wrote some
        self.extras = extras if extras is not None else {}
        self.host = host
        # How the eager records and the compiled rows interleave is known (always, without compiled rows).
        self.order_known = order_known
        self.grads_in_graphs = False  # compiled graphs record the gradients of their modules (set by land)
        self._runs = self._host_rows = None

    def __len__(self) -> int:
        return len(self.slots)

    def slot(self, i: int):
        """Row ``i`` as a :class:`~nanscan.monitor.slots.Slot`."""
        return at(self.slots, i)

    def host_rows(self) -> list:
        """The records of the window's rows (the first ``eager_count``: hooks, gradients, parameters)
        as lists of Python floats, converted in one call when first asked and shared by every
        consumer; ``[]`` when the read holds no host copy of them (a clean read decided where its rows
        lie: Note [a clean read comes back as one number]). Other rows: :attr:`values`."""
        rows = self._host_rows
        if rows is None:
            n = self.eager_count
            rows = self._host_rows = self.host[:n, :RECORD_SIZE].tolist() if (n and self.host is not None) else []
        return rows

    def record(self, i: int) -> list:
        """Row ``i``'s record as Python floats: from :meth:`host_rows` where a consumer converted them
        already, else on its own (a consumer that reads a few rows need not convert them all)."""
        rows = self._host_rows
        return rows[i] if rows is not None and i < len(rows) else self.values(i)

    def column(self, start: int, end: int, field: int) -> list:
        """Field ``field`` of the records of rows ``[start, end)`` as Python floats, in one conversion
        where they are the window's host rows."""
        rows = self._host_rows
        if rows is not None and end <= len(rows):
            return [rows[j][field] for j in range(start, end)]
        if self.host is not None and end <= self.eager_count:
            return self.host[start:end, field].tolist()
        values = self.values
        return [values(j)[field] for j in range(start, end)]

    def runs(self) -> list:
        """The rows in index order as runs ``(start, end, source)``, the one way every consumer walks
        a read: ``source`` is an :class:`~nanscan.monitor.slots.EagerRows` (the hooks' rows
        ``start .. end - 1``, described by the C++ rows one at a time), a
        :class:`~nanscan.monitor.slots.GradBlock` or :class:`~nanscan.monitor.slots.Block` (rows
        that share step, phase and kind: ``source.start`` is its first row, ``k = i -
        source.start`` row ``i``'s place in it; no Slot is made) or a
        :class:`~nanscan.monitor.slots.Slot` (one row). Made once per read, when first asked
        (a read no consumer walks never makes them), in one C pass over the slot list: a lazy run
        stands in for each of its rows, so equal neighbours are one run."""
        runs = self._runs
        if runs is None:
            runs, start = [], 0
            for _, group in itertools.groupby(self.slots, id):
                members = list(group)
                source, end = members[0], start + len(members)
                if isinstance(source, Block):
                    runs.append((start, end, source))
                else:  # (a Slot is one row; one object twice in a row is still two rows)
                    runs.extend((i, i + 1, source) for i in range(start, end))
                start = end
            self._runs = runs
        return runs

    @classmethod
    def land(cls, copy: Copy, traced, *, link_compiled_weights: bool) -> "Read":
        """Wait for ``copy`` and assemble its rows; ``traced`` (the compiled path's
        :class:`~nanscan.monitor.traced.TracedRows`) turns its written rows into slots.
        ``link_compiled_weights``: parameter gradients take the compiled modules' forward inputs and
        output gradients as their inputs (gradients are recorded inside the graphs)."""
        copy.wait()
        slots, step = copy.slots, copy.step
        common = dict(step=step, training=not copy.eval, final=copy.final, handled=copy.handled, bad=copy.bad,
                      grad_start=copy.grad_start, recorded_forward=copy.recorded_forward, extras=copy.extras,
                      host=copy.host, compiled=copy.traced is not None,
                      compiled_ran=bool(copy.traced and any(copy.traced)))
        if copy.traced is None:
            return cls(slots=slots, values=copy.row, **common)
        offset = len(slots)
        traced_slots, traced_values, traced_seqs, weight_inputs = [], [], [], {}
        for written in copy.traced:  # (one sub-window per training forward, in order)
            more, values, seqs, inputs = traced.slots(written, step, offset + len(traced_slots))
            traced_slots += more
            traced_values += values
            traced_seqs += seqs
            for name, indices in inputs.items():
                weight_inputs.setdefault(name, []).extend(indices)
        if link_compiled_weights:
            # weights of compiled modules: their forward inputs and output gradients
            for block in {s for s in slots if type(s) is Block and s.param}:
                block.extra_inputs = {name: tuple(rows) for name, rows in weight_inputs.items()}
        all_slots = list(slots) + traced_slots
        common["bad"] = copy.bad | {offset + i for i, v in enumerate(traced_values) if v[0] + v[1] + v[2] > 0}
        eager_row = copy.row

        def values(i):
            return eager_row(i) if i < offset else traced_values[i - offset]

        grad_start = copy.grad_start if copy.grad_start is not None else offset
        # The host counted every stamp whose rows were read back: each eager record's count says
        # where it falls among the compiled rows (Note [stamps counted on the host]).
        order_known = copy.stamped == max(traced_seqs, default=0)
        if order_known:
            starts = [i for i, _ in copy.marks]
            counts = [count for _, count in copy.marks]

            def position(i):
                if i >= offset:  # the compiled row stamped seq-th
                    return traced_seqs[i - offset], 0, i
                if i >= grad_start:  # the parameter gradients, read after everything
                    return float("inf"), 2, i
                k = bisect.bisect_right(starts, i) - 1  # an eager record: after the rows stamped before it
                return (counts[k] if k >= 0 else 0), 1, i
        else:
            # Production order as far as it is known: eager records, the compiled rows, then the
            # parameter gradients (read after the backward; eager ones are last in index order already).
            def position(i):
                return (1, i) if i >= offset else ((2, i) if i >= grad_start else (0, i))

        read = cls(slots=all_slots, values=values, position=position, eager_count=offset, order_known=order_known,
                   **common)
        read.grads_in_graphs = link_compiled_weights
        return read

    def steps_mixing_eager_and_compiled(self, phase: str = "forward") -> set:
        """Steps whose training forward recorded, through the eager hooks, rows of modules other than
        the root while compiled rows are in this read too: how the two sequences interleaved is not
        recorded (Note [eager frames beside compiled ones]) -- none when the host's stamp count
        placed every eager record among the compiled rows (in the backward, only where the compiled
        graphs record gradients too: else a gradient they made is not among the rows at all)."""
        if not self.compiled or (self.order_known and (phase == "forward" or self.grads_in_graphs)):
            return set()
        steps = set()
        for start, end, s in self.runs():
            if start >= self.eager_count:
                break
            if type(s) is not EagerRows:
                continue
            for i in range(start, end):
                kind, info, _, step, phase = s.rows.row(i)[:5]
                if kind in (OUTPUT, BODY) and phase == "forward" and not s.infos[info].is_root:
                    steps.add(step)
        return steps

"""What the compiled path learns while dynamo traces a graph: :class:`TraceNotes`, one per
:class:`~nanscan.monitor.traced.TracedRows` (so one per monitor).

A compiled graph writes rows of a device buffer and nothing else; what a row *is* beyond its place
-- its label, dtype and static shape, whether an input row can be trusted, which module took an
output as its input (the consumers a gradient is named after) -- is noted at trace time, by the
stamp op's fake kernel (:func:`noted_at_trace`, set as ``nanscan._ops.STAMP_TRACED``): the traced
hooks themselves make no Python call for it, because every call dynamo traces costs compile time.
The graph names its monitor by an int constant (``owner``: a per-process count, the same in every
run of a script, see Note [compiled graphs cached]); :data:`LIVE` maps it to that monitor's rows,
the one registry there is. A monitor that closed is no longer in it: a graph of it that still runs
notes nothing.

Notes are kept per trace (one dynamo trace of one frame: one graph): the same rows can be written by
graphs of different structure (a recompile), and only the notes of the graph that ran apply. Which
one ran is read from the rows themselves: a trace's forward rows, in the order it stamped them, are
a contiguous run of the rows written in the window (``TracedRows._traces_that_ran``).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["LABEL_SEP", "LEAF_STAMPS", "LIVE", "MORE_INPUTS", "TraceNotes", "noted_at_trace", "note"]

LABEL_SEP = "\x1f"
# Ends a stamp's labels when the module had more floating inputs than its INPUTS rows: the modules
# that took a value as such an input are not known, so neither is a value's set of consumers.
MORE_INPUTS = "\x1e"

LIVE: dict = {}  # TracedRows.owner -> TracedRows of an open monitor (the graphs' `owner` constant)


class TraceNotes:
    """Everything noted at trace time about one monitor's rows (see the module docstring)."""

    __slots__ = ("labels", "shapes", "untrusted", "partial_traces", "consumers", "explained", "trace_rows",
                 "needs_grad", "traced", "versions", "made_at")

    def __init__(self):
        self.labels: dict = {}  # row -> (label or None, dtype)
        self.shapes: dict = {}  # row -> static shape
        self.untrusted: set = set()  # post-time input rows whose tensor was changed in place (stale)
        self.partial_traces: set = set()  # traces that stamped a module with inputs left out
        self.consumers: dict = {}  # output row -> {trace: names of the modules that took it as an input}
        self.explained: dict = {}  # input row -> {trace: the output rows whose value it took}
        self.trace_rows: dict = {}  # trace -> the forward rows it stamped, in order
        self.needs_grad: set = set()  # output rows whose tensor required grad when traced
        self.traced = False  # a hook of this monitor was traced into some graph
        # Version counters of the (fake) tensors the stamps have seen; and which fake tensor is
        # which output row (a child's output that its parent returns unchanged is in two rows):
        # dynamo's fake tensors have identity while a graph is traced, the compiled graph has none.
        self.versions = torch.utils.weak.WeakIdKeyDictionary()
        self.made_at = torch.utils.weak.WeakIdKeyDictionary()

    def label(self, row: int, label, dtype) -> None:
        self.labels[row] = (label, dtype)
        self.traced = True

    def stamped(self, rows, first_row: int, values: list, labels: str) -> None:
        """One traced ``nanscan::stamp`` writing ``values`` into rows from ``first_row`` (``rows``:
        the monitor's row descriptions; see :func:`noted_at_trace`)."""
        partial = labels.endswith(MORE_INPUTS)
        labels = labels[:-1] if partial else labels
        names = labels.split(LABEL_SEP) if labels else []
        in_dynamo = LEAF_STAMPS and _in_dynamo_fake_pass()
        trace = _trace_id() if in_dynamo else None
        if partial and trace is not None:
            self.partial_traces.add(trace)
        for k, t in enumerate(values):
            row = first_row + k
            label = names[k] if k < len(names) and names[k] else None
            if label is None:  # the row's own name (or, for a tap's gradient row, the label noted at the tap)
                label = self.labels.get(row, (None, None))[0]
            self.labels[row] = (label, t.dtype)
            shape = tuple(t.shape)
            if all(type(s) is int for s in shape):
                self.shapes[row] = shape
            if in_dynamo and row < len(rows):  # (dynamo's pass)
                info = rows[row]
                version = t._version
                if info.post_time and self.versions.get(t, 0) != version:
                    self.untrusted.add(row)
                self.versions[t] = version
                if info.phase == "forward" and trace is not None:
                    self.trace_rows.setdefault(trace, []).append(row)
                    if info.is_output:
                        self.made_at.setdefault(t, set()).add(row)
                        if t.requires_grad:
                            self.needs_grad.add(row)
                    else:
                        for made_at in self.made_at.get(t, ()):
                            self.consumers.setdefault(made_at, {}).setdefault(trace, set()).add(info.module.name)
                            self.explained.setdefault(row, {}).setdefault(trace, set()).add(made_at)
        self.traced = True


@torch._dynamo.assume_constant_result
def note(owner: int, row: int, label, dtype) -> int:
    """A tap's gradient row label, noted while dynamo traces the hook (the result is a constant of the
    graph): no Python work is left in the compiled hook."""
    rows = LIVE.get(owner)
    if rows is not None:
        rows.notes.label(row, label, dtype)
    return 0


def noted_at_trace(owner: int, first_row: int, values: list, labels: str) -> None:
    """What one traced ``nanscan::stamp`` writes -- its rows' labels, dtypes and static shapes --
    noted while the graph is traced (called by the op's fake kernel, nanscan/_ops.py).
    A symbolic (dynamic) shape is not noted: the hook writes it into the row at run time.

    A leaf module's inputs are stamped after its forward, with its outputs (one graph op per module
    instead of two). Their record is the value the module received only if nothing changed them in
    place during its forward; fake tensors carry version counters, so that is decided here: an
    input row is trusted when its tensor's version is the one an earlier stamp saw, or 0 if none
    saw it. Otherwise the row is kept ``stale`` (never an incident; a value computed from it gets
    ``produced=None``): nanscan cannot tell what the module received."""
    traced = LIVE.get(owner)
    if traced is not None:
        traced.notes.stamped(traced.rows, first_row, values, labels)


def _trace_id():
    """The dynamo trace being made (its compile id and attempt: a restarted analysis is a trace of
    its own), or None."""
    try:
        return torch._guards.CompileContext.current_trace_id()
    except AttributeError:  # pragma: no cover - a torch without it: no trace is known to have run
        return None


def _dynamo_fake_code():
    try:
        from torch._dynamo.utils import get_fake_value
        return get_fake_value.__code__
    except (ImportError, AttributeError):  # pragma: no cover - a torch without it
        return None


# The fake kernel runs in several passes over a graph: dynamo's trace (its fake values are the
# user's tensors, with their in-place history), then AOT autograd's and inductor's, whose
# functionalized fakes have version counters of their own. Only dynamo's pass says whether an input
# was changed in place, and it is the one that runs under dynamo's get_fake_value. No public flag
# tells the passes apart (the tracing and compile contexts are set in all of them), so the fake
# kernel looks for that frame a few frames up: bounded, and only while a graph is traced.
_DYNAMO_FAKE_CODE = _dynamo_fake_code()
LEAF_STAMPS = _DYNAMO_FAKE_CODE is not None  # (without it: every module stamps its inputs before its forward)


def _in_dynamo_fake_pass() -> bool:
    frame, depth = sys._getframe(3), 0
    while frame is not None and depth < 64:
        if frame.f_code is _DYNAMO_FAKE_CODE:
            return True
        frame, depth = frame.f_back, depth + 1
    return False

"""The compiled path: what the monitor records inside a ``torch.compile`` graph.

Inside a graph, hooks are traced and then replayed as graph ops: they may do nothing but tensor
ops (Python bookkeeping would be replayed as side effects on every call, or break the graph). So
every watched module owns static rows of a device buffer, fixed at ``watch``: ``INPUTS`` rows for
its first floating inputs and ``OUTPUTS`` rows for its floating outputs. A traced hook writes the
value's record into its row together with the value of a device counter (the host learns which
rows ran in this read window, and in which order: several graphs per step, graph breaks, several
forwards per optimizer step) and the value's real shape. The read decodes the written rows into
slots like eager ones, so attribution is the same code.

Tensor identity is not available inside a graph, so module inputs are recorded too. An input of a
child that is non-finite while no earlier value of the step was is a value made in the parent's
own body (the same rule as eager, decided from the records instead of from identity): such rows
are ``derived`` candidates named after the parent. Output labels (``[0].y``) are noted once, at
trace time.

Only training forwards are recorded (grad enabled, the root in training mode, the step sampled:
dynamo guards on all three, so an eval forward runs a graph of its own that writes nothing).
Gradients of module outputs inside compiled graphs are not recorded (parameter gradients are:
they are read outside the graph).
"""
from __future__ import annotations

from typing import Optional

import torch

from nanscan.monitor.eager import float_tensors
from nanscan.monitor.slots import Slot
from nanscan.record import RECORD_SIZE

INPUTS, OUTPUTS = 2, 8
MAX_DIMS = 6
# Columns: the record, the execution sequence number (0 = not written in this window), numel,
# ndim and the sizes.
SEQ, NUMEL, NDIM, DIMS = RECORD_SIZE, RECORD_SIZE + 1, RECORD_SIZE + 2, RECORD_SIZE + 3
COLUMNS = DIMS + MAX_DIMS

_NOTES: dict = {}  # (id(TracedRows), row) -> (label or None, dtype), noted at trace time


@torch._dynamo.assume_constant_result
def _note(owner: int, row: int, label, dtype) -> int:
    """Runs once, while dynamo traces the hook (its result is a constant of the graph): no Python
    work is left in the compiled hook."""
    _NOTES[(owner, row)] = (label, dtype)
    return 0


class _RowInfo:
    __slots__ = ("name", "info", "inputs", "candidate", "derived", "is_output", "index")

    def __init__(self, name, info, inputs, candidate, derived, is_output, index):
        self.name, self.info, self.inputs = name, info, inputs
        self.candidate, self.derived, self.is_output, self.index = candidate, derived, is_output, index


class TracedRows:
    def __init__(self, monitor, infos: list, kernels_for):
        self.monitor = monitor
        self.kernels_for = kernels_for  # device -> (summarize one, summarize many)
        self.record_one = None  # the op for the buffer's device, fixed at allocate: no lookup to guard on
        self.buffer: Optional[torch.Tensor] = None
        self.counter: Optional[torch.Tensor] = None
        self.base = {}
        self.rows: list = []
        by_name = {info.name: info for info in infos}
        for info in infos:
            self.base[info.name] = len(self.rows)
            parent = None if info.is_root else by_name.get(info.name.rpartition(".")[0] or "(model)")
            parent_inputs = () if parent is None else tuple(range(self.base.get(parent.name, 0),
                                                                  self.base.get(parent.name, 0) + INPUTS))
            for k in range(INPUTS):
                if parent is None:
                    self.rows.append(_RowInfo(f"{info.name}.input[{k}]", info, (), False, False, False, k))
                else:
                    self.rows.append(_RowInfo(parent.name, parent, parent_inputs, True, True, False, k))
            own_inputs = tuple(range(self.base[info.name], self.base[info.name] + INPUTS))
            for k in range(OUTPUTS):
                self.rows.append(_RowInfo(info.name if k == 0 else f"{info.name}[output {k}]", info, own_inputs,
                                          True, False, True, k))

    def allocate(self, device) -> None:
        if self.buffer is None or self.buffer.device != device:
            self.buffer = torch.zeros(len(self.rows), COLUMNS, dtype=torch.float64, device=device)
            self.counter = torch.zeros(1, dtype=torch.float64, device=device)
            self.record_one = self.kernels_for(device)[0]

    @property
    def used(self) -> bool:
        """A traced hook was compiled (the buffer is worth reading)."""
        return any(key[0] == id(self) for key in _NOTES)

    def forget(self) -> None:
        for key in [k for k in _NOTES if k[0] == id(self)]:
            del _NOTES[key]

    # ------------------------------------------------------------ traced hooks (tensor ops only)
    def _recording(self) -> bool:
        m = self.monitor
        return m.activations and m.checking and not m._closed and torch.is_grad_enabled() and m.model.training

    def _write(self, row: int, t: torch.Tensor) -> None:
        view = self.buffer[row]
        view[:RECORD_SIZE].copy_(self.record_one(t.detach()))
        self.counter.add_(1)
        view[SEQ:SEQ + 1].copy_(self.counter)
        view[NUMEL] = t.numel()
        view[NDIM] = t.dim()
        for d in range(min(t.dim(), MAX_DIMS)):
            view[DIMS + d] = t.shape[d]

    def write_inputs(self, info, args, kwargs) -> None:
        if not self._recording():
            return
        base = self.base[info.name]
        found = float_tensors(kwargs, "input", float_tensors(args, "input", []))  # labels as eager gives them
        for k, (label, t) in enumerate(found[:INPUTS]):
            _note(id(self), base + k, f"{info.name}.{label}" if info.is_root else None, t.dtype)
            self._write(base + k, t)

    def write_outputs(self, info, output) -> None:
        if not self._recording():
            return
        base = self.base[info.name] + INPUTS
        for k, (label, t) in enumerate(float_tensors(output, "", [])[:OUTPUTS]):
            _note(id(self), base + k, info.name + label, t.dtype)
            self._write(base + k, t)

    # ------------------------------------------------------------ read
    def reset(self) -> None:
        """Mark every row unwritten (device ops, no sync): a new read window."""
        if self.used:
            self.buffer[:, SEQ].zero_()
            self.counter.zero_()

    def slots(self, written: list, step: int, phase: str = "forward"):
        """Slots and record values of the rows written in this window (``[(row, values)]``), in
        execution order."""
        slots, records, index_of_row = [], [], {}
        for row, v in sorted(written, key=lambda rv: rv[1][SEQ]):
            if row >= len(self.rows):
                continue
            r = self.rows[row]
            label, dtype = _NOTES.get((id(self), row), (None, torch.float32))
            name = label or r.name
            ndim = int(v[NDIM])
            shape = tuple(int(s) for s in v[DIMS:DIMS + ndim]) if ndim <= MAX_DIMS else (int(v[NUMEL]),)
            slot = Slot(step, phase, "activation", name, dtype, shape,
                        tuple(index_of_row[i] for i in r.inputs if i in index_of_row), r.candidate, r.info)
            slot.derived = r.derived
            index_of_row[row] = len(slots)
            slots.append(slot)
            records.append(v[:RECORD_SIZE])
        return slots, records

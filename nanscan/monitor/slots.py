"""The monitor's records of one read window, in production order.

A :class:`Slot` says what one record describes (step, phase, kind, name, dtype, shape) and what it
depends on; :class:`Slots` keeps them in the order the tensors were produced together with the
device records, summarized in batches.

Why batches: one ``summarize`` launch costs a few microseconds of host time whatever the tensor's
size, and the monitor records two or three tensors per module per step; ``summarize_many`` over a
batch costs a fraction of that per tensor. A tensor is therefore kept (with its version counter)
until the batch is summarized: at the end of the forward, at a read, before a module that works in
place, or when the batch is full (``BATCH`` tensors or ``BATCH_BYTES``: bounded memory).

Why that is safe: a tensor changed in place between its hook and the batch would be summarized
with its later value. Its version counter says so; the slot is then marked ``stale`` (nanscan
cannot tell what it held when it was produced, and says so), and the module it came from is
recorded without batching from then on (``on_stale`` callback).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from nanscan.record import RECORD_SIZE

BATCH = 64
BATCH_BYTES = 64 << 20


class Slot:
    """One record: what was summarized, when, and what it depends on.

    ``inputs``: indices of the slots this value was computed from ("produced" means they were all
    finite); ``candidate``: False for values recorded only for attribution (the batch);
    ``owner``: the module (:class:`nanscan.monitor.eager.ModuleInfo`) whose forward produced it;
    ``consumers``: the module calls (frames) that took it as an input; ``grad``: the slot of its
    gradient; ``grad_of``: for a gradient, the slot of the forward value; ``param``: for a
    parameter gradient read at the check, the parameter."""

    __slots__ = ("step", "phase", "kind", "name", "dtype", "shape", "inputs", "candidate", "owner",
                 "consumers", "grad", "grad_of", "param", "stale", "derived", "known_bad_inputs", "late")

    def __init__(self, step, phase, kind, name, dtype, shape, inputs=(), candidate=True, owner=None):
        self.step, self.phase, self.kind, self.name = step, phase, kind, name
        self.dtype, self.shape, self.inputs, self.candidate, self.owner = dtype, shape, inputs, candidate, owner
        self.consumers = self.grad = self.grad_of = self.param = None
        self.stale = False
        # A compiled-path input row: a body value only if nothing earlier in its phase was non-finite.
        self.derived = False
        # Inputs read in an earlier window: the names of the non-finite ones (() = all finite), or None.
        self.known_bad_inputs = None
        # Recorded eagerly after a compiled forward whose rows are decoded after it: not a producer.
        self.late = False


class Slots:
    """Slots of the current read window and their records (device tensors, one row per slot)."""

    def __init__(self, summarize_many: Callable[[list], torch.Tensor],
                 on_stale: Optional[Callable[[Slot], None]] = None):
        self._summarize_many = summarize_many
        self._on_stale = on_stale
        self.slots: list = []
        self.blocks: list = []  # summarized records, [k, RECORD_SIZE] each, in slot order
        self._queued: list = []  # tensors not summarized yet (the last len(_queued) slots)
        self._versions: list = []
        self._bytes = 0
        self._device = None

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, tensor: torch.Tensor, slot: Slot) -> int:
        """Queue ``tensor``'s record for ``slot``; returns the slot's index."""
        device = tensor.device
        if device != self._device:
            self.flush()
            self._device = device
        self._queued.append(tensor)
        self.slots.append(slot)
        if tensor.is_inference():  # no version counter to check: summarize it now
            self._versions.append(None)
            self.flush()
            return len(self.slots) - 1
        self._versions.append(tensor._version)
        self._bytes += tensor.numel() * tensor.element_size()
        if len(self._queued) >= BATCH or self._bytes >= BATCH_BYTES:
            self.flush()
        return len(self.slots) - 1

    def add_block(self, rows: torch.Tensor, block: "Block", n: int) -> None:
        """A :class:`Block` of ``n`` rows whose records were computed already (``rows``)."""
        if not n:
            return
        self.flush()
        block.start = len(self.slots)
        self.blocks.append(rows)
        self.slots.extend([block] * n)

    def flush(self) -> None:
        """Summarize the queued tensors (one launch group)."""
        queued = self._queued
        if not queued:
            return
        first = len(self.slots) - len(queued)
        for k, (t, version) in enumerate(zip(queued, self._versions)):
            # Changed in place since its hook: the record would be of a later value.
            if version is not None and t._version != version:
                slot = self.slots[first + k]
                slot.stale = True
                if self._on_stale is not None:
                    self._on_stale(slot)
        self.blocks.append(self._summarize_many(queued))
        self._queued, self._versions, self._bytes = [], [], 0

    def take(self):
        """Everything recorded so far, ``(slots, records [n, RECORD_SIZE] or None)``, and start afresh."""
        self.flush()
        slots, blocks = self.slots, self.blocks
        self.slots, self.blocks, self._device = [], [], None
        if not blocks:
            return slots, None
        device = blocks[0].device
        blocks = [b if b.device == device else b.to(device, non_blocking=True) for b in blocks]
        return slots, (torch.cat(blocks) if len(blocks) > 1 else blocks[0])


class Block:
    """Rows of one launch group whose :class:`Slot` objects are made only when looked at:
    parameters, their gradients and buffers -- hundreds of rows a step, almost never non-finite,
    so building a Python object per row per step would be most of the monitor's host cost. In a
    slot list the block stands in for each of its rows; :func:`at` materializes one.

    ``tensors``: the live parameters / buffers (dtype and shape are read from them when a row is
    materialized); ``names`` and ``owners`` per row; ``inputs(k)`` -> slot indices of row k's inputs
    in the same window, or ``input_bad(k)`` -> the names of its non-finite inputs (() when all were
    finite, None when unknown) for inputs that were read in an earlier window."""

    candidate, stale, derived, late, grad_of, consumers, grad = True, False, False, False, None, None, None

    def __init__(self, step, phase, kind, names, tensors, owners, *, inputs=None, input_bad=None, param=False):
        self.step, self.phase, self.kind = step, phase, kind
        self.names, self.tensors, self.owners = names, tensors, owners
        self.inputs_of, self.input_bad = inputs, input_bad
        self.param = True if param else None  # parameter gradients: the step log sums their norms
        self.start = 0
        self.extra_inputs: dict = {}  # owner name -> more input slot indices (the compiled path's rows)

    def slot(self, index: int) -> Slot:
        k = index - self.start
        t, owner = self.tensors[k], self.owners[k]
        inputs = self.inputs_of(k) if self.inputs_of is not None else None
        if inputs is not None and owner is not None:
            inputs = tuple(inputs) + self.extra_inputs.get(owner.name, ())
        slot = Slot(self.step, self.phase, self.kind, self.names[k], t.dtype, tuple(t.shape), inputs or (), True, owner)
        if self.input_bad is not None:
            slot.known_bad_inputs = self.input_bad(k)
        return slot


class GradBlock(Block):
    """Gradients flowing into module outputs, received by the C++ backward tap
    (``csrc/monitor/grad_sink.cpp``) and summarized there in batches: ``indices[k]`` is the slot
    (in ``window``) of the output whose gradient row k is."""

    def __init__(self, step, window, indices, stale, dtypes, shapes):
        super().__init__(step, "backward", "grad", None, None, None)
        self.window, self.indices, self.stale_rows, self.dtypes, self.shapes = window, indices, stale, dtypes, shapes

    def slot(self, index: int) -> Slot:
        k = index - self.start
        forward = self.window[self.indices[k]]
        slot = Slot(self.step, "backward", "grad", f"{forward.name} (output grad)", self.dtypes[k], self.shapes[k],
                    (), True, forward.owner)
        slot.grad_of, slot.stale = self.indices[k], self.stale_rows[k]
        return slot


def at(slots: list, index: int) -> Slot:
    """The slot at ``index`` of a window's slot list (materializing block rows)."""
    s = slots[index]
    return s.slot(index) if isinstance(s, Block) else s

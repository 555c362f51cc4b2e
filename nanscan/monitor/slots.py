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
                 "consumers", "grad", "grad_of", "param", "stale", "derived")

    def __init__(self, step, phase, kind, name, dtype, shape, inputs=(), candidate=True, owner=None):
        self.step, self.phase, self.kind, self.name = step, phase, kind, name
        self.dtype, self.shape, self.inputs, self.candidate, self.owner = dtype, shape, inputs, candidate, owner
        self.consumers = self.grad = self.grad_of = self.param = None
        self.stale = False
        # A compiled-path input row: a body value only if nothing earlier in its phase was non-finite.
        self.derived = False


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
        if tensor.device != self._device:
            self.flush()
            self._device = tensor.device
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

    def add_records(self, rows: torch.Tensor, slots: list) -> None:
        """Slots whose records were computed already (``rows``: ``[len(slots), RECORD_SIZE]``)."""
        if not slots:
            return
        self.flush()
        self.blocks.append(rows)
        self.slots.extend(slots)

    def flush(self) -> None:
        """Summarize the queued tensors (one launch group)."""
        queued = self._queued
        if not queued:
            return
        first = len(self.slots) - len(queued)
        for k, (t, version) in enumerate(zip(queued, self._versions)):
            if version is not None and t._version != version:  # changed in place since its hook: the record would be of a later value
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


def empty_records(device) -> torch.Tensor:
    return torch.empty(0, RECORD_SIZE, dtype=torch.float64, device=device)

"""Gathering a read: :class:`Reading` holds the read windows and turns everything recorded since the
last read into one :class:`~nanscan.monitor.readback.Copy`.

A training read takes, in production order: the eager window (hook rows, the loss, parameters and
buffers after the last update, optimizer state), the gradients of module outputs from the gradient
sink, the parameter gradients as they are now, then the compiled path's rows, and a few scalars
(loss scale, a fused-AMP optimizer's ``found_inf``, the total norm ``clip_grad_norm_`` returned).
An eval forward's read takes the eval window alone. In async mode a copy stays in flight and is
decoded one read later: :meth:`Reading.swap_in_flight`. Nothing here decodes or judges a read
(:mod:`nanscan.monitor.read`, :mod:`nanscan.monitor.findings`).
"""
from __future__ import annotations

import functools
import itertools
from typing import Optional

import torch

from nanscan.monitor import readback
from nanscan.monitor.readback import Clean, Copy
from nanscan.monitor.slots import BATCH, BATCH_BYTES, EagerRows, GradBlock

__all__ = ["Reading"]

# A read that no consumer walks is taken and tested in one C++ call (Note [a clean step's read] in
# nanscan/monitor/monitor.py, Note [a clean read in one call] in csrc/monitor/lean_read.h): where its
# records lie on the host, or by one sum on their device; False takes it call by call through gather,
# decided in its blocks (sync) or as a Copy (the benchmark's A/B: benchmarks/read_cost.py).
TAKEN_IN_ONE_CALL = True


def _pairs(marks: bytes) -> list:
    """``[(index, host stamp count)]`` from a window's or the gradient sink's ``taken_marks()``."""
    flat = memoryview(marks).cast("q").tolist()
    return list(zip(flat[0::2], flat[1::2]))


class Reading:
    """The read windows of one monitor, and what a read gathers from them."""

    def __init__(self, extension, infos: list, summarize, *, activation_grads: bool):
        # Per read window: the records (production order); eval forwards have their own.
        def window():
            return extension.Window(functools.partial(EagerRows, infos=infos), summarize, None, len(infos), BATCH,
                                    BATCH_BYTES)

        self.window, self.eval_window = window(), window()
        self.generation = 0
        # The gradients of module outputs: a C++ tap on the autograd node of each recorded output
        # (no Python in the backward with the default kernels).
        self.grad_sink = extension.GradSink(BATCH, BATCH_BYTES, summarize) if activation_grads else None
        self.in_flight: Optional[Copy] = None  # async mode: the read to decode at the next one
        # total norms clip_grad_norm_ returned since the last read (Note [grad norm before clipping])
        self.clip_norms: list = []
        self.clip_unknown = False  # clipped by a norm other than L2 since the last read
        self._extension = extension
        # (nanscan._C.LeanRead, and the parameter set and C++ hooks it was made for: made at the first
        # read that takes it)
        self._lean_read = None

    def follow_stamps(self, owner: int) -> None:
        """Mark the training window's entries and the gradients with the compiled path's host count
        of ``owner``'s stamps: where they fall among its rows (Note [stamps counted on the host] in
        csrc/monitor/stamp_rows.cpp)."""
        self.window.follow_stamps(owner)
        if self.grad_sink is not None:
            self.grad_sink.follow_stamps(owner)

    def backward_seen(self) -> bool:
        """A gradient of a module output was received since the last read."""
        return self.grad_sink is not None and len(self.grad_sink) > 0

    def pending(self) -> bool:
        """Records wait in the training window (or a copy in flight)."""
        return len(self.window) > 0 or self.in_flight is not None

    def clipped(self, total_norm, norm_type) -> None:
        """``clip_grad_norm_`` of this model's parameters returned ``total_norm``."""
        if float(norm_type) != 2.0:
            self.clip_norms = []  # (not the L2 norm the log reports: the step's grad_norm is unknown)
            self.clip_unknown = True
            return
        local = getattr(total_norm, "full_tensor", None)  # (a DTensor norm under FSDP2 / TP)
        self.clip_norms.append((local() if callable(local) else total_norm).detach())

    def scalars(self, step: int, scale, found_inf, scalars: bool, final: bool, steplog) -> list:
        """The scalars read with a training read's records, in the same copy: ``[(what, tensor)]`` --
        GradScaler's ``scale`` (a tensor, or None) and the clip norm when ``scalars`` (not in what
        close reads of a step that ended already), a fused-AMP optimizer's ``found_inf``."""
        extras = []
        if isinstance(scale, torch.Tensor) and not final and scalars:
            extras.append(("scale", scale))
        if found_inf is not None:
            extras.append(("found_inf", found_inf))
        if self.clip_norms or self.clip_unknown:
            self._clip_norm(step, extras, scalars, steplog)
        return extras

    def take_in_one_call(self, hooks, tensors, read_grads: bool, may_sync: bool = True):
        """The read taken and tested in one C++ call (Note [a clean read in one call] in
        csrc/monitor/lean_read.h; ``generation`` already moved on for it): clean, the names of the
        parameter gradients read (None: not read, or none exists); else the parts as a tuple, for
        :meth:`gather` (``taken``) -- also, when not ``may_sync`` (async mode), records on a device,
        undecided."""
        lean_read = self._lean_read
        if lean_read is None or lean_read[1] is not tensors.param_set or lean_read[2] is not hooks.cpp:
            lean_read = self._lean_read = (self._extension.LeanRead(self.window, self.grad_sink,
                                                                    tensors.param_set, hooks.cpp),
                                           tensors.param_set, hooks.cpp)
        taken = lean_read[0].take(read_grads, self.generation, readback.DEVICE_DECISION == "always", may_sync)
        if type(taken) is tuple:
            return taken
        return None if taken is None else (
            tensors.param_names if taken is True else [tensors.param_names[k] for k in taken])

    def gather(self, step: int, *, hooks, tensors, traced, grads: bool, explained: bool, extras: list, handled: bool,
               final: bool, non_blocking: bool, recorded_forward: bool, rows_wanted: bool = True, lean: bool = False,
               taken: Optional[tuple] = None):
        """Start the copy of a training read of ``step`` (``generation`` already moved on for it;
        ``recorded_forward``: a forward was recorded since the last read): everything recorded since
        the last read (see the module docstring). ``grads``: the parameter gradients are read too
        (``explained``: with their inputs, see :meth:`ModelTensors.grad_block`); ``extras``: the
        read's :meth:`scalars`; ``handled``: GradScaler skipped the update; ``rows_wanted`` False: no
        consumer needs a clean read's rows (Note [a clean read comes back as one number] in
        :mod:`~nanscan.monitor.readback`). ``lean``: a sync read that nothing else needs if it is
        clean: it comes back as a :class:`~nanscan.monitor.readback.Clean` when it is (Note [a clean
        read is decided without a Read]). ``taken``: the parts :meth:`take_in_one_call` returned
        for this read (not clean, or undecided; Note [a clean step's read] in
        :mod:`~nanscan.monitor.monitor`)."""
        read_grads = grads and bool(tensors.named_params)
        # (A compiled path that never traced a hook has no rows, no stamps and nothing to reset.)
        used = traced.used
        if taken is not None:
            (slots, blocks, eager_rows), sink, taken_grads = taken
            param_grads = tensors.grad_records(taken_grads) if read_grads else None
        else:
            slots, blocks, eager_rows = self.window.take()  # (blocks: a list of [k, RECORD_SIZE] records)
            sink = self.grad_sink.take() if self.grad_sink is not None else None  # (records, meta): the C++ tap
            if self.grad_sink is not None:
                self.grad_sink.generation = self.generation
            # (records only: their Block is made below, when the read is decoded)
            param_grads = tensors.grad_records() if read_grads else None
            hooks.reset()  # (after the gradients: their inputs are the modules' last calls)
        if sink is not None and len(sink[1]):
            blocks.extend(sink[0])
        if param_grads is not None:
            blocks.append(param_grads[0])
        if lean and not used and taken is None:
            clean = Clean.of(step, blocks, extras, param_grads[1] if param_grads is not None else None)
            if clean is not None:
                return clean
        # The slots of the rows, in the order of the blocks: the window's, the gradients of module
        # outputs, the parameter gradients.
        marks = self.window.taken_marks()  # (entry, host stamp count) where the count moved
        marks = _pairs(marks) if marks else []
        if sink is not None and len(sink[1]):
            meta = sink[1]
            block = GradBlock(step, slots, meta)
            block.start = len(slots)
            grad_marks = self.grad_sink.taken_marks()
            if grad_marks:
                marks += [(block.start + k, count) for k, count in _pairs(grad_marks)]
            if eager_rows is not None:
                eager_rows.rows.set_grads(meta, block.start)
            slots.extend(itertools.repeat(block, len(meta)))  # (the list take() made: no copy of it)
        grad_start = None  # where the parameter gradients start: read last, produced after compiled rows
        if param_grads is not None:
            block = tensors.grad_block(step, param_grads, eager_rows, explained)
            block.start = grad_start = len(slots)
            slots.extend(itertools.repeat(block, len(block.names)))
        copy = Copy.start(blocks, slots, extras, traced.window() if used else None, handled=handled, step=step,
                          non_blocking=non_blocking, window_rows=len(traced.rows) if used else 0,
                          rows_wanted=rows_wanted)
        copy.recorded_forward = recorded_forward
        copy.final = final
        copy.grad_start = grad_start
        copy.marks = marks
        if used:
            copy.stamped = traced.stamped()
            traced.reset()
        return copy

    def _clip_norm(self, step: int, extras: list, scalars: bool, steplog) -> None:
        """The total norm ``clip_grad_norm_`` returned since the last read, read with the records
        (Note [grad norm before clipping]); unknown to the step log when a norm other than L2 clipped."""
        clip_norms, self.clip_norms = self.clip_norms, []
        if self.clip_unknown and steplog is not None:
            steplog.clip_norm(step, None)
        self.clip_unknown = False
        if clip_norms and scalars and steplog is not None:
            total = clip_norms[0] if len(clip_norms) == 1 else torch.stack(
                [n.to(clip_norms[0].device, torch.float64) for n in clip_norms]).pow(2).sum().sqrt()
            extras.append(("clip_norm", total))

    def gather_eval(self, step: int, hooks) -> Optional[Copy]:
        """The copy of an eval forward's window (read at its end), or None when it recorded nothing."""
        slots, blocks, _ = self.eval_window.take()
        hooks.reset("eval")
        if not blocks:
            return None
        copy = Copy.start(blocks, slots, [], None, handled=False, step=step, non_blocking=False, rows_wanted=False)
        copy.eval = True
        return copy

    def swap_in_flight(self, copy: Copy, keep: bool) -> tuple:
        """``(previous, now)``: the read left in flight by the last call, to decode first (its records
        were made first), and ``copy`` unless ``keep`` leaves it in flight for the next read."""
        previous, self.in_flight = self.in_flight, (copy if keep else None)
        return previous, (None if keep else copy)

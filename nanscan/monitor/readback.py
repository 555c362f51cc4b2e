"""The read: every record of a read window, the compiled path's rows and a few scalars (loss scale,
GradScaler's ``found_inf``) stacked into one tensor and copied to the host once.

In sync mode the copy is a plain ``.cpu()``; in async mode it goes into pinned memory with
``non_blocking=True`` behind a CUDA event, and :meth:`Copy.wait` is called a read later (normally
long done). Only the rows holding a non-finite element are turned into Python floats, so a read
costs the same few tensor ops whatever the number of records.

Note [a clean read comes back as one number]: on a GPU, when no consumer of the read needs its rows
(no step log, telemetry, spike or headroom check), the rows stay on the device: one reduction
there -- the sum of every row's NaN / +Inf / -Inf counts, the same test as
``nonfinite_rows`` -- and the read's scalars (loss scale, ``found_inf``, clip norm) are what the
host copies back, ``8 * (1 + scalars)`` bytes whatever the number of records. Only when that sum
is not 0 are the full rows copied (a failing step: a second copy, in a read that is about to
report), so the same rows decide the same incident. A consumer that asks a clean read for a row
(``Copy.row``) gets it copied then.

On the CPU the rows are on the host already: such a read is decided where they lie, block by block
(one C++ pass over each ``[k, RECORD_SIZE]`` block the windows and the gradient records made, with
its offset), without stacking them into one tensor first -- the stack is made only when a row is
asked for. So a clean read's host work is a fixed number of Python calls and torch ops whatever the
number of records (``benchmarks/read_cost.py``); what grows with them is C++ loops.
Note [a clean read is decided without a Read]: most reads are clean, and a clean read that no
consumer walks leads to nothing but a little bookkeeping -- which parameter gradients were read and
that the forward was finite (``ModelTensors.note_clean_read``, for the records made after the
update), the read's scalars into the ledger (``Outcomes.take_extras``): ``Monitor._decided_clean``.
So the slots of its rows, the :class:`Copy`, the :class:`~nanscan.monitor.read.Read`, the findings
are made only for a read that needs them. A read whose scalars lie on the CPU (or that has none)
is taken and tested in one C++ call before any of them is made (Note [a clean step's read] in
nanscan/monitor/monitor.py, Note [a clean read in one call] in csrc/monitor/lean_read.h): records on
the host where they lie, records on a device by the one sum above, its 8 bytes the read's sync (in
async mode, records on a device go on undecided) -- or call by call, as below, where that call does
not apply (a sharded model's parameters, a scalar on a device: a sync read then comes back from
``Reading.gather(lean=True)`` as a :class:`Clean` when its blocks are); a read that lands clean (a
device read's count, an async read a read later) is bookkept from its :class:`Copy`
(``Copy.clean``) without a ``Read`` (an eval forward's clean read leads to nothing at all). Not
decided so, and so decided whole as before: a read after a step whose forward ran neither the eager
hooks nor a compiled graph's stamps while activations are watched (the monitor's check of that
needs the rows), and any training
read while ``torch.distributed`` runs more than one rank (the ranks agree on the incident to report,
and another rank's may be this read's). The A/B, and what it costs: ``benchmarks/read_cost.py``.

Note [compiled rows decided where they lie]: a read with the compiled path's rows is decided the
same way, where the rows lie (on the CPU too: it is a few tensor ops, where decoding every written
row into a slot was Python per row), by one more term and one more number: the NaN / +Inf / -Inf
counts of the compiled rows written in the window (sequence number > 0: an unwritten row keeps an
earlier window's record) join the sum, and the largest sequence number comes back after the scalars
-- whether compiled graphs wrote rows in this read (``Copy.compiled_ran``: the forward ran, for the
hooks' check). The count covers every written row, so a read it calls clean has no row the whole
read would call non-finite; when it is not 0, the rows are fetched and decoded exactly as a whole
read decodes them (``Copy._decode``), and so are a clean read's where a ``Read`` is still made
(``Copy.decode_compiled``). Only the compiled rows' placing among the eager records -- an
incident's business -- is left undone for a clean read.

``DEVICE_DECISION`` picks the path: ``"cuda"`` (default) -- on the device for rows on a GPU, in
blocks for rows on the CPU --, ``"always"`` (the tests: the device path run on CPU rows), ``"never"``
(every read stacked and copied whole: the path before this note, kept as the A/B baseline).
"""
from __future__ import annotations

from typing import Optional

import torch

from nanscan import _ops
from nanscan.monitor.traced import COLUMNS, SEQ
from nanscan.record import RECORD_SIZE


# Where a read that no consumer needs the rows of is decided (Note [a clean read comes back as one
# number]): "cuda" -- on a GPU for rows there, in blocks for rows on the CPU --, "always" (the tests:
# the device path run on CPU rows), "never" (stacked and copied whole).
DEVICE_DECISION = "cuda"


def _decided_on_device(rows: torch.Tensor) -> bool:
    return DEVICE_DECISION == "always" or (DEVICE_DECISION == "cuda" and rows.is_cuda)


def _scalars_on_host(extras: list) -> bool:
    """Reads are decided where their rows lie (the default) and the read's scalars lie on the CPU.
    (Loops, not ``all`` over generators: this runs at every read.)"""
    if DEVICE_DECISION != "cuda":
        return False
    for _, tensor in extras:
        if not tensor.is_cpu:
            return False
    return True


def _decided_in_blocks(blocks: list, extras: list) -> bool:
    """A read whose records and scalars all lie on the CPU, decided where they lie (the default)."""
    if not _scalars_on_host(extras):
        return False
    for block in blocks:
        if not block.is_cpu:
            return False
    return True


# Rows ``< n`` of landed records ``[k, >= RECORD_SIZE]`` with a NaN / +Inf / -Inf count: ``(host, n)
# -> list`` (C++: one pass, no tensor op); and the same across a read's blocks, in one call, or None
# where a block is not on the host. Looked up once. None without the library (no monitor runs then).
_EXTENSION = _ops.monitor_extension()
_nonfinite_rows = _EXTENSION.nonfinite_rows if _EXTENSION is not None else None
_nonfinite_in_blocks = _EXTENSION.nonfinite_in_blocks if _EXTENSION is not None else None


class Clean:
    """A training read decided clean where its records lie, before any slot, :class:`Copy` or
    :class:`~nanscan.monitor.read.Read` was made of it (Note [a clean read is decided without a
    Read]): what the monitor keeps of it -- the ``step``, the names of the parameter gradients read
    (``grad_names``, None when they were not) and the read's scalars as floats (``extras``)."""

    __slots__ = ("step", "grad_names", "extras")

    def __init__(self, step: int, grad_names, extras: dict):
        self.step, self.grad_names, self.extras = step, grad_names, extras

    @classmethod
    def of(cls, step: int, blocks: list, extras: list, grad_names) -> Optional["Clean"]:
        """The read of ``blocks`` (``[k, RECORD_SIZE]`` records) and ``extras`` (``(name,
        one-element tensor)``) as a :class:`Clean`, or None: a record holds a NaN / Inf, or the
        records or scalars do not all lie on the CPU (a device read is decided on its device:
        :meth:`Copy.start`). (A read taken in one call, the default, is tested there: Note [a
        clean read in one call] in csrc/monitor/lean_read.h.)"""
        if not _scalars_on_host(extras) or _nonfinite_in_blocks(blocks) != []:  # (None: a block on a device)
            return None
        return cls(step, grad_names, {name: float(e) for name, e in extras} if extras else {})


class Copy:
    """One read in flight (``start``) or landed (``wait``)."""

    def __init__(self, rows, event, slots, extra_names, n_traced, handled, step):
        self.rows, self.event, self.slots = rows, event, slots
        self.extra_names, self.n_traced = extra_names, n_traced
        self.handled, self.step = handled, step
        self.host: Optional[torch.Tensor] = None
        self.bad: set = set()
        self.extras: dict = {}
        # Per sub-window of the compiled path (one per training forward: TracedRows.begin_forward),
        # [(row, values)] of the rows written; or None.
        self.traced: Optional[list] = None
        self.window_rows = 0  # rows per sub-window
        self.grad_start: Optional[int] = None  # where the parameter gradients' block starts, if read
        self.recorded_forward = True  # a training forward was recorded in the window
        self.eval = False  # the read of an eval window (eval forwards), not of a training step
        self.final = False  # read at close: what is left of a step that may have ended already
        # Where the eager records fall among the compiled rows: ``[(slot index, host stamp count)]``
        # from that slot on (where the count moved), and the host's count of stamped rows (Note
        # [stamps counted on the host] in csrc/monitor/stamp_rows.cpp).
        self.marks: list = []
        self.stamped = 0
        # Decided on the device (Note [a clean read comes back as one number]): the rows, left there;
        # ``rows`` is then the summary in flight ([non-finite count, scalars...]).
        self.device_rows: Optional[torch.Tensor] = None
        self.read_back_bytes = 0  # what the host copied back (the summary, and the rows if they came)
        # Compiled graphs wrote rows in this read (decided on the device: from the summary's largest
        # sequence number; else from the rows, once decoded).
        self.compiled_ran = False
        # Decided in blocks on the CPU: the records as the windows made them (stacked only if a row
        # is asked for), and the scalars as tensors.
        self.blocks: Optional[list] = None
        self.extra_tensors: tuple = ()
        self.landed = False

    @property
    def clean(self) -> bool:
        """Landed, with nothing non-finite and no compiled rows decoded (none, or a read decided on
        the device: Note [compiled rows decided where they lie]): nothing in it to attribute or to
        place (Note [a clean read is decided without a Read])."""
        return self.landed and not self.bad and self.traced is None

    @property
    def lands(self) -> bool:
        """The wait has records or scalars to land (on a device: the read's one host sync)."""
        return self.rows is not None or self.blocks is not None

    @classmethod
    def start(cls, blocks, slots, extras, traced, *, handled: bool, step: int, non_blocking: bool,
              window_rows: int = 0, rows_wanted: bool = True) -> "Copy":
        """Stack ``blocks`` (``[k, RECORD_SIZE]`` records of ``slots``, in order), the ``extras``
        (``(name, one-element tensor)``) and the compiled rows (sub-windows of ``window_rows``
        rows), and start the copy. ``rows_wanted`` False: no consumer needs the rows of a clean read
        (Note [a clean read comes back as one number])."""
        names = tuple([name for name, _ in extras]) if extras else ()
        if not rows_wanted and traced is None and blocks and _decided_in_blocks(blocks, extras):
            copy = cls(None, None, slots, names, 0, handled, step)
            copy.blocks = blocks
            if extras:
                copy.extra_tensors = tuple([e for _, e in extras])
            return copy
        parts = []
        # Rows are RECORD_SIZE wide, COLUMNS when the compiled path's rows join them (each op here
        # costs host time: one cat of the records, a pad only when the widths differ).
        width = COLUMNS if traced is not None else RECORD_SIZE
        if blocks:
            device = blocks[0].device
            blocks = [b if b.device == device else b.to(device, non_blocking=True) for b in blocks]
            records = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            parts.append(records if width == RECORD_SIZE
                         else torch.nn.functional.pad(records, (0, width - RECORD_SIZE)))
        parts += [e.detach().to(torch.float64).reshape(1, 1).expand(1, width) for _, e in extras]
        if traced is not None:
            parts.append(traced)
        n_traced = 0 if traced is None else traced.shape[0]
        if not parts:
            return cls(None, None, slots, names, 0, handled, step)
        device = parts[0].device
        parts = [p if p.device == device else p.to(device, non_blocking=True) for p in parts]  # a stray CPU row
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        if rows is traced:  # (the buffer itself: the read resets it before the rows are copied or fetched)
            rows = rows.clone()
        device_rows = None
        if not rows_wanted and (_decided_on_device(rows) if traced is None else DEVICE_DECISION != "never"):
            n, e = len(slots), len(names)  # (the records; the scalars' rows follow them, then the compiled rows)
            device_rows = rows
            count = rows[:n, :3].sum()
            if traced is None:
                rows = torch.cat([count.reshape(1), rows[n:, 0]])
            else:  # Note [compiled rows decided where they lie]
                compiled = rows[n + e:]
                written = compiled[:, SEQ] > 0
                count = count + torch.where(written, compiled[:, :3].sum(1), 0).sum()
                rows = torch.cat([count.reshape(1), rows[n:n + e, 0], compiled[:, SEQ].amax().reshape(1)])
        event = None
        if rows.is_cuda and non_blocking:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            rows = host
        copy = cls(rows, event, slots, names, n_traced, handled, step)
        copy.window_rows = window_rows or n_traced
        copy.device_rows = device_rows
        return copy

    def wait(self) -> None:
        """Land the copy (the one host sync of the read) and find the non-finite rows (once: a landed
        copy is left as it is)."""
        if self.landed:
            return
        self.landed = True
        if self.event is not None:
            self.event.synchronize()
        if self.blocks is not None:  # on the CPU, decided where the rows lie
            if self.extra_names:
                self.extras = {name: float(e) for name, e in zip(self.extra_names, self.extra_tensors)}
                self.extra_tensors = ()
            self.bad = set(_nonfinite_in_blocks(self.blocks))
            return
        if self.rows is None:
            return
        host = self.rows.cpu()
        self.read_back_bytes = host.numel() * host.element_size()
        e = len(self.extra_names)
        if self.device_rows is not None:  # decided on the device: [non-finite count, scalars..., (largest seq)]
            summary = host.tolist()
            if e:
                self.extras = dict(zip(self.extra_names, summary[1:1 + e]))
            if self.n_traced:
                self.compiled_ran = summary[1 + e] > 0
            if summary[0] > 0:  # something is non-finite: the rows, to find which
                self._decode(self._fetch_rows())
            return
        self.host = host
        self._decode(host)

    def decode_compiled(self) -> None:
        """The compiled rows of a landed read decided on the device, decoded now (Note [compiled
        rows decided where they lie]): for a clean read that still needs a :class:`~nanscan.monitor.
        read.Read` (several ranks agree on it; no hook's record says a forward ran)."""
        if self.n_traced and self.traced is None and self.device_rows is not None:
            self._decode(self._fetch_rows())

    def _decode(self, host: torch.Tensor) -> None:
        """The non-finite rows, the scalars and the written compiled rows of the landed ``host`` rows."""
        n, e = len(self.slots), len(self.extra_names)
        self.bad = set(_nonfinite_rows(host, n))
        if e:
            self.extras = dict(zip(self.extra_names, host[n:n + e, 0].tolist()))
        if self.n_traced:
            self.traced = []
            for first in range(n + e, n + e + self.n_traced, self.window_rows):
                block = host[first:first + self.window_rows]
                written = torch.nonzero(block[:, SEQ] > 0).flatten().tolist()
                self.traced.append(list(zip(written, block[written].tolist())) if written else [])

    def _fetch_rows(self) -> torch.Tensor:
        """The rows of a read decided on the device, copied now (once); of one decided in blocks,
        stacked now."""
        if self.host is None and self.blocks is not None:
            self.host = torch.cat(self.blocks) if len(self.blocks) > 1 else self.blocks[0]
            self.blocks = None
        elif self.host is None:
            self.host = self.device_rows.cpu()
            self.read_back_bytes += self.host.numel() * self.host.element_size()
        return self.host

    def row(self, i: int) -> list:
        """Slot ``i``'s record as Python floats."""
        host = self.host if self.host is not None else self._fetch_rows()
        return host[i, :RECORD_SIZE].tolist()

"""The monitor's early warning: a tensor whose headroom (:mod:`nanscan.headroom`) fell below
``watch(..., headroom_bits=N)`` bits is named once, with its trend, before it overflows.

No extra kernel work and no extra copy: a read already holds every record's finite min and max on
the host. Per read, one vectorized pass computes every row's headroom against its dtype (and, for
float32 rows in a float16 autocast step or rows of a declared cast, against the cast dtype); a
Python object is made only for the rows within ``N + ZONE`` bits of overflow. Those rows keep a
short history (``HISTORY`` checked steps) from which the trend is fitted when the warning is
given. Inside compiled graphs, module inputs are rows of their own (``derived``: a value made in
the parent's body or a child's output seen again) and are not tracked: a child's output would be
tracked twice. Only training reads are looked at (eval forwards are not), and only checked steps (under
``every=k``, the steps that are read).

A warning is a :class:`HeadroomEvent`: kept in ``Monitor.headroom_events``, written to the event log
(``"event": "headroom"``) and warned as a :class:`HeadroomWarning`. It never raises, whatever
``on_nonfinite`` says: nothing is non-finite yet. Each tensor (kind, name) is warned about once per
monitor.
"""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
import math
from typing import Optional

import torch

from nanscan.headroom import dtype_max, headroom_bits, trend
from nanscan.monitor.consumers import ReadConsumer
from nanscan.monitor.slots import EagerRows, GradBlock, Slot
from nanscan.record import RECORD_SIZE, Field
from nanscan.warn import warn

ZONE = 6  # bits above the threshold at which a tensor's history starts (a trend needs steps before the warning)
HISTORY = 32  # checked steps of history per tracked tensor
LOWEST = 8  # tensors with the least headroom written per step to the event log (for the report's plot)
_FP32_MAX = dtype_max(torch.float32)


class HeadroomWarning(RuntimeWarning):
    """A watched tensor is close to the largest value its dtype holds (see :class:`HeadroomEvent`)."""


@dataclasses.dataclass
class HeadroomEvent:
    """``name`` (of ``kind``, recorded in ``phase``) had ``bits`` of headroom at ``step``: its largest
    finite magnitude ``amax`` against ``dtype``'s largest value ``dtype_max`` -- the dtype it is
    stored in (``stored_dtype``) or the one it is cast to (``cast``: e.g. float16 under autocast).
    ``bits_per_100``: bits lost per 100 steps over the last checked steps (None with fewer than 3);
    ``overflow_step``: where that trend reaches 0 bits (None unless headroom is shrinking)."""

    step: int
    name: str
    kind: str
    phase: str
    dtype: str
    stored_dtype: str
    cast: bool
    amax: float
    dtype_max: float
    bits: float
    bits_per_100: Optional[float]
    overflow_step: Optional[int]
    threshold: float
    rank: int = 0

    def __str__(self) -> str:
        what = f"{self.name} ({self.kind}, {self.phase}, {self.stored_dtype}"
        what += f", {self.dtype} under autocast or a cast)" if self.cast else ")"
        text = (f"nanscan: {what} is {self.bits:.1f} bits from overflow at step {self.step} "
                f"(largest |value| {self.amax:.4g} of {self.dtype} max {self.dtype_max:.6g}; "
                f"warned below {self.threshold:g} bits)")
        if self.bits_per_100 is not None:
            text += f"; losing {self.bits_per_100:.2f} bits per 100 steps"
            if self.overflow_step is not None:
                text += f": overflows near step {self.overflow_step} at this rate"
        return text + "."

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class HeadroomWatch(ReadConsumer):
    """Per monitor: the threshold, the casts it knows of, the tracked tensors' history.

    ``casts``: ``{fnmatch pattern: dtype}`` for tensors the user knows are cast, unscaled, to a
    narrower dtype before use (e.g. a float8 recipe with a fixed scale). Dynamically scaled float8
    casts (torchao's default) rescale by amax and cannot overflow: nanscan does not assume any
    float8 cast by itself. ``grads=False`` leaves gradients out (with a GradScaler: loss scaling
    keeps them near float16's largest value on purpose, and the scaler handles their overflow)."""

    what = "the headroom check"

    def __init__(self, bits: float, casts: Optional[dict] = None, rank: int = 0, grads: bool = True, steplog=None):
        self.threshold = float(bits)
        self.steplog = steplog  # (each step's lowest headroom and the events go to its step log)
        self.grads = grads
        self.casts = [(p, d, dtype_max(d)) for p, d in (casts or {}).items()]
        self.rank = rank
        self.history: dict = {}  # (kind, name) -> deque of (step, bits)
        self.warned: set = set()
        self.events: list = []
        self.autocast: dict = {}  # step -> the autocast dtype its training forward ran under (None: off)
        self._cast_floor = min((m for _, _, m in self.casts), default=math.inf)

    def note_autocast(self, step: int, device_type: str) -> None:
        """Called as a training forward begins: the autocast dtype it runs under."""
        dtype = None
        try:
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
        except Exception:  # an unknown device type: no autocast to know of
            dtype = None
        self.autocast[step] = dtype
        for old in [k for k in self.autocast if k < step - 2]:
            del self.autocast[old]

    def _cast_of(self, slot) -> Optional[tuple]:
        """(dtype, its max) the value of ``slot`` is cast to before use, if nanscan can know it."""
        for pattern, dtype, limit in self.casts:
            if fnmatch.fnmatchcase(slot.name, pattern):
                return dtype, limit
        if slot.dtype == torch.float32 and slot.kind in ("activation", "param", "grad"):
            # Under float16 autocast the matmuls and convolutions take float16 operands: a float32
            # activation or parameter is cast before use, and a float32 parameter gradient was
            # computed in float16 and cast back. (Parameters are recorded after the update of the
            # step whose forward they then feed.)
            ac = self.autocast.get(slot.step)
            if ac is not None and ac != torch.float32:
                limit = dtype_max(ac)
                if limit < _FP32_MAX:
                    return ac, limit
        return None

    def _look(self, read, candidates) -> list:
        """Look at one decoded read: ``candidates`` are the row indices whose headroom (against
        their own dtype or a possible cast) is within ``threshold + ZONE`` bits (:func:`near_rows`).
        Returns the new events."""
        lowest: dict = {}
        new = []
        self.lowest = {}
        values = read.values
        for i in candidates:
            s = read.slot(i)
            if not s.candidate or s.stale or s.derived or s.phase == "eval" or s.dtype is None:
                continue  # (a compiled path's input row may be an output recorded already: it is not tracked twice)
            if s.kind == "grad" and not self.grads:
                continue
            if not (s.dtype.is_floating_point or s.dtype.is_complex):
                continue
            v = values(i)
            measured = s.dtype
            bits = headroom_bits(v, s.dtype)
            cast = self._cast_of(s)
            if cast is not None:
                cast_bits = headroom_bits(v, cast[0])
                if cast_bits is not None and (bits is None or cast_bits < bits):
                    bits, measured = cast_bits, cast[0]
            if bits is None or bits >= self.threshold + ZONE:
                continue
            key = (s.kind, s.name)
            history = self.history.get(key)
            if history is None:
                history = self.history[key] = collections.deque(maxlen=HISTORY)
            if history and history[-1][0] == s.step:  # several records of one tensor in a step: the lowest
                if bits < history[-1][1]:
                    history[-1] = (s.step, bits)
            else:
                history.append((s.step, bits))
            label = f"{s.kind} {s.name}"
            lowest[s.step] = lowest.get(s.step, {})
            lowest[s.step][label] = min(bits, lowest[s.step].get(label, math.inf))
            if bits < self.threshold and key not in self.warned:
                self.warned.add(key)
                fit = trend([h[0] for h in history], [h[1] for h in history])
                a = max(abs(v[Field.FINITE_MIN]), abs(v[Field.FINITE_MAX]))
                event = HeadroomEvent(step=s.step, name=s.name, kind=s.kind, phase=s.phase,
                                      dtype=_dtype_name(measured), stored_dtype=_dtype_name(s.dtype),
                                      cast=measured != s.dtype, amax=a, dtype_max=dtype_max(measured), bits=bits,
                                      bits_per_100=fit["bits_per_100"], overflow_step=fit["overflow_step"],
                                      threshold=self.threshold, rank=self.rank)
                new.append(event)
        self.events.extend(new)
        self.lowest = {step: dict(sorted(d.items(), key=lambda kv: kv[1])[:LOWEST]) for step, d in lowest.items()}
        for event in new:
            try:  # never raises (a user's "error" warnings filter included): the event is kept either way
                warn(str(event), HeadroomWarning, stacklevel=4)
            except Exception:
                pass
        return new

    def near_rows(self, records: torch.Tensor, maxima: torch.Tensor, autocast: bool) -> list:
        """Indices of the rows of ``records`` (``[n, >= RECORD_SIZE]`` float64 on the host) within
        ``threshold + ZONE`` bits of their dtype's largest value ``maxima`` (NaN: unknown), or of a
        cast's: float32 rows against float16's max when ``autocast`` (a float16 autocast step is in
        the read), every row against a declared cast's. Rows with no finite value are left out
        (they are incidents, not headroom). (One C++ pass: ``headroom_candidates``.)"""
        from nanscan import _ops

        n = records.shape[0]
        if n == 0:
            return []
        return _ops.monitor_extension().headroom_candidates(records, maxima, n, self.threshold + ZONE, bool(autocast),
                                                            self._cast_floor)

    @property
    def fp16_autocast(self) -> bool:
        """A recent training forward ran under float16 autocast."""
        return any(d == torch.float16 for d in self.autocast.values())

    def observe(self, read) -> list:
        """Look at a landed training :class:`~nanscan.monitor.read.Read`: a vectorized pass over the
        hooks' host records (one C++ call, :meth:`near_rows`), Python only for the rows near
        overflow; the events and each step's lowest headroom go to the step log, if any. Returns
        the new events."""
        if not read.training:
            return []
        n, total = read.eager_count, len(read.slots)
        near = []
        maxima = row_maxima(read, total) if (n and read.host is not None) or total > n else None
        if n and read.host is not None:
            near = self.near_rows(read.host[:n], maxima[:n], self.fp16_autocast)
        if total > n:  # the compiled path's rows (Slot objects already)
            values = torch.tensor([read.values(i)[:RECORD_SIZE] for i in range(n, total)], dtype=torch.float64)
            near += [n + j for j in self.near_rows(values, maxima[n:], self.fp16_autocast)]
        bad = read.bad
        near = [i for i in near if i not in bad]
        events = self._look(read, near)
        steplog = self.steplog
        if steplog is not None:
            for step, lowest in self.lowest.items():
                steplog.headroom(step, lowest)
            for event in events:
                steplog.headroom_event(event)
        return events


_MAX_OF: dict = {}  # dtype -> its largest finite value (NaN: not floating)


def max_of(dtype) -> float:
    """``dtype``'s largest finite value, cached (NaN for a dtype that is not floating)."""
    limit = _MAX_OF.get(dtype)
    if limit is None:
        limit = _MAX_OF[dtype] = dtype_max(dtype) if (dtype.is_floating_point or dtype.is_complex) else math.nan
    return limit


def row_maxima(read, n: int) -> torch.Tensor:
    """Per row of a read's first ``n``, its dtype's largest finite value (NaN where
    unknown): the hooks' rows and each block of tensors in one C++ call, Python slots from their
    dtypes."""
    from nanscan import _ops

    extension = _ops.monitor_extension()
    maxima = torch.full((n,), math.nan, dtype=torch.float64)
    eager_done = False
    for start, end, s in read.runs():
        if start >= n:
            break
        t = type(s)
        if t is EagerRows:
            if not eager_done:  # (one call for the window's every hook row: NaN at its Python entries)
                eager_done = True
                m = s.rows.dtype_maxima()
                k = min(n, m.shape[0])
                maxima[:k] = torch.where(torch.isnan(m[:k]), maxima[:k], m[:k])
        elif t is GradBlock:
            maxima[start:end] = s.meta.dtype_maxima()[start - s.start:end - s.start]
        elif t is Slot:
            if s.dtype is not None:
                maxima[start] = max_of(s.dtype)
        else:
            maxima[start:end] = extension.dtype_maxima(list(s.tensors[start - s.start:end - s.start]))
    return maxima

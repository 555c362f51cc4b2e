"""Headroom: how far a tensor's largest finite magnitude is from the largest value its dtype holds.

For a record with finite minimum ``lo`` and maximum ``hi`` (:class:`nanscan.record.Field`) and a
dtype whose largest finite value is ``M`` (``torch.finfo(dtype).max``)::

    amax     = max(|lo|, |hi|)
    headroom = log2(M / amax)        # in bits: how many doublings amax can take before it overflows

A tensor at 8 bits of headroom in float16 has ``amax = 65504 / 2**8 = 255.9``. Headroom is
defined when the tensor has at least one finite non-zero value (``amax > 0``); all-zero, empty or
all-non-finite tensors have none (None here).

The *cast* headroom is the same quantity against the dtype a value is converted to before use:
float32 activations and parameters of a step whose forward ran under ``torch.autocast`` with
float16 are multiplied in float16 by the matmuls and convolutions autocast covers, so their
headroom against 65504 is what matters. bfloat16 has float32's exponent range (its largest value
is 3.39e38), so a bfloat16 autocast region costs no overflow headroom. float8 formats: e4m3fn holds
448, e5m2 57344 (the ``fnuz`` variants 240 and 57344).

What the record cannot tell: the *underflow* side. The record holds the number of exact zeros and
the signed finite min / max, not the smallest non-zero magnitude, so the share of values that would
flush to zero in float16 (below 2**-24, or lose precision below 2**-14) is not known from it, and
nanscan does not estimate it. A rising zero count between steps is the only underflow signal the
record carries.

The trend (:func:`trend`) fits a straight line to headroom over steps: headroom falls linearly
when amax grows geometrically (a fixed factor per step -- weights or activations feeding on their
own growth, a loss scale doubling), the usual shape of a drift towards overflow. The predicted
overflow step is where that line reaches 0 bits.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from nanscan.record import Field

# The threshold ``watch(..., headroom_bits=True)`` uses. 4 bits = amax within 1/16 of the dtype's
# largest value (4096 in float16). The healthy test models keep >= 13.5 bits under float16 autocast
# (a GPT-style transformer and a CNN with BatchNorm, tests/test_headroom.py), so 4 bits leaves ~9.5
# bits (a factor of ~700) of margin against false warnings, and a tensor drifting up by 3% a step
# crosses it ~47 steps before it overflows (log2(16) / log2(1.03)).
SUGGESTED_BITS = 4.0


def dtype_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype`` (of its real part for complex dtypes)."""
    if dtype.is_complex:
        dtype = torch.empty(0, dtype=dtype).real.dtype
    if not dtype.is_floating_point:
        raise TypeError(f"nanscan.headroom: headroom is defined for floating dtypes, got {dtype}")
    return float(torch.finfo(dtype).max)


def amax(finite_min: float, finite_max: float) -> Optional[float]:
    """``max(|finite_min|, |finite_max|)``, or None when the tensor had no finite value
    (the record's min is +inf and its max -inf then)."""
    if not (math.isfinite(finite_min) and math.isfinite(finite_max)):
        return None
    return max(abs(finite_min), abs(finite_max))


def headroom_bits(record, dtype: torch.dtype) -> Optional[float]:
    """``log2(finfo(dtype).max / amax)`` for one record (a :class:`nanscan.Summary`, a decoded
    record, or a sequence of the record's fields); None when there is no finite non-zero value.

    ``dtype`` is the dtype to measure against: the tensor's own, or the one it will be cast to."""
    if hasattr(record, "finite_min"):
        lo, hi = record.finite_min, record.finite_max
    else:
        lo, hi = record[Field.FINITE_MIN], record[Field.FINITE_MAX]
    if lo is None or hi is None:
        return None
    a = amax(float(lo), float(hi))
    if a is None or a == 0.0:
        return None
    return math.log2(dtype_max(dtype) / a)


def trend(steps: Sequence[int], bits: Sequence[float]) -> dict:
    """Least-squares line through ``(step, bits)``: ``bits_per_100`` (bits *lost* per 100 steps:
    positive while headroom shrinks) and ``overflow_step`` (the step at which the line reaches 0
    bits, only while headroom shrinks, else None). Needs 3 points (both None otherwise)."""
    n = len(steps)
    if n < 3 or n != len(bits):
        return {"bits_per_100": None, "overflow_step": None}
    mean_s, mean_b = sum(steps) / n, sum(bits) / n
    var = sum((s - mean_s) ** 2 for s in steps)
    if var == 0:
        return {"bits_per_100": None, "overflow_step": None}
    slope = sum((s - mean_s) * (b - mean_b) for s, b in zip(steps, bits)) / var  # bits per step
    out = {"bits_per_100": -100.0 * slope, "overflow_step": None}
    if slope < 0:
        intercept = mean_b - slope * mean_s
        out["overflow_step"] = int(math.ceil(-intercept / slope))
    return out

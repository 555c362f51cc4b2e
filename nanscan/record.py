"""The record layout in Python and :class:`TensorSummary`, its decoded view.

A record is a float64 row of ``RECORD_SIZE`` values (mirror of ``csrc/record.h``; keep them in
step). Raw conventions: ``finite_min = +inf`` / ``finite_max = -inf`` when there is no finite
element, ``first_nonfinite_index = -1`` when every element is finite. Counts are exact integers
(float64 holds every integer up to 2**53). Decoding is the only place a record reaches the host.

Records of an earlier layout, the first ``LEGACY_RECORD_SIZE`` fields without ``sum`` / ``sum4``,
still decode (:meth:`TensorSummary.from_values`): their ``sum`` / ``sum4`` are ``None``.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional, Sequence

import torch

from nanscan.jsonl import encode_float


class Field(enum.IntEnum):
    NAN_COUNT = 0
    POSINF_COUNT = 1
    NEGINF_COUNT = 2
    ZERO_COUNT = 3
    FINITE_MIN = 4
    FINITE_MAX = 5
    SUMSQ = 6
    FIRST_NONFINITE = 7
    SUM = 8
    SUM4 = 9


RECORD_SIZE = len(Field)
LEGACY_RECORD_SIZE = 8  # records written before sum / sum4 were fields: the first 8 of Field


json_float = encode_float  # (the one home of the format: nanscan.jsonl)


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """Numeric health of one tensor, decoded from a record.

    ``finite_min`` / ``finite_max`` are ``None`` when no element is finite (never ±inf, NaN or a
    made-up 0). ``sumsq``, ``sum`` and ``sum4`` are the sums of squares, of values and of fourth
    powers of the finite elements, accumulated in FP32 for 8/16/32-bit floating dtypes (FP64 for
    float64, integer and bool); ``sumsq`` and ``sum4`` may be ``inf`` when the accumulation
    overflowed although every element is finite (``sumsq_overflowed``, ``sum4_overflowed``: an FP32
    fourth power overflows from ``|x|`` ~ 4.3e9, a square from ~1.8e19). ``mean`` and ``kurtosis``
    are made from them. ``sum`` / ``sum4`` are ``None`` only for a record of the earlier 8-field
    layout (see the module docstring).
    Complex tensors are summarized as ``torch.view_as_real(x)``: ``shape`` gains a trailing 2 and
    each real / imaginary part counts as one element.
    """

    dtype: torch.dtype
    shape: tuple
    numel: int
    nan_count: int
    posinf_count: int
    neginf_count: int
    zero_count: int
    finite_min: Optional[float]
    finite_max: Optional[float]
    sumsq: float
    first_nonfinite_index: Optional[int]
    sum: Optional[float] = None
    sum4: Optional[float] = None

    @classmethod
    def from_values(cls, values: Sequence[float], dtype: torch.dtype, shape: Sequence[int]) -> "TensorSummary":
        """Decode one record already on the host (a sequence of ``RECORD_SIZE`` floats, or of
        ``LEGACY_RECORD_SIZE`` for a record of the earlier layout: then ``sum`` / ``sum4`` are None)."""
        if len(values) not in (RECORD_SIZE, LEGACY_RECORD_SIZE):
            raise ValueError(f"a nanscan record has {RECORD_SIZE} values ({LEGACY_RECORD_SIZE} in the earlier "
                             f"layout), got {len(values)}")
        legacy = len(values) == LEGACY_RECORD_SIZE
        shape = tuple(shape) + ((2,) if dtype.is_complex else ())
        numel = math.prod(shape)
        nan, pos, neg = (int(values[f]) for f in (Field.NAN_COUNT, Field.POSINF_COUNT, Field.NEGINF_COUNT))
        has_finite = numel - nan - pos - neg > 0
        first = int(values[Field.FIRST_NONFINITE])
        return cls(
            dtype=dtype, shape=shape, numel=numel,
            nan_count=nan, posinf_count=pos, neginf_count=neg,
            zero_count=int(values[Field.ZERO_COUNT]),
            finite_min=float(values[Field.FINITE_MIN]) if has_finite else None,
            finite_max=float(values[Field.FINITE_MAX]) if has_finite else None,
            sumsq=float(values[Field.SUMSQ]),
            first_nonfinite_index=first if first >= 0 else None,
            sum=None if legacy else float(values[Field.SUM]),
            sum4=None if legacy else float(values[Field.SUM4]),
        )

    @classmethod
    def from_record(cls, record: torch.Tensor, x: torch.Tensor) -> "TensorSummary":
        """Decode a device record of ``x`` (one host copy)."""
        return cls.from_values(record.tolist(), x.dtype, x.shape)

    @property
    def nonfinite_count(self) -> int:
        return self.nan_count + self.posinf_count + self.neginf_count

    @property
    def finite_count(self) -> int:
        return self.numel - self.nonfinite_count

    @property
    def is_finite(self) -> bool:
        return self.nonfinite_count == 0

    @property
    def absmax(self) -> Optional[float]:
        """Largest finite magnitude, ``None`` when no element is finite."""
        if self.finite_min is None:
            return None
        return max(abs(self.finite_min), abs(self.finite_max))

    @property
    def l2_norm(self) -> float:
        """``sqrt(sumsq)``: the L2 norm of the finite elements (``inf`` if ``sumsq`` overflowed)."""
        return math.sqrt(self.sumsq)

    @property
    def sumsq_overflowed(self) -> bool:
        """True when the finite elements' sum of squares overflowed its accumulator: every term is
        finite by construction, so an infinite ``sumsq`` can only come from the accumulation."""
        return math.isinf(self.sumsq)

    @property
    def sum4_overflowed(self) -> bool:
        """True when the finite elements' sum of fourth powers overflowed (FP32 accumulation: from
        ``|x|`` ~ 4.3e9, long before the squares do); ``kurtosis`` is None then. False when unknown
        (a record of the earlier layout)."""
        return self.sum4 is not None and math.isinf(self.sum4)

    @property
    def mean(self) -> Optional[float]:
        """Mean of the finite elements, ``sum / finite_count``; None when no element is finite,
        when the sum is not finite (its accumulator overflowed, which only happens when ``sumsq``
        did too) or unknown (a record of the earlier layout). The sum is accumulated in FP32 for
        8/16/32-bit floating dtypes: a mean that is small against the elements' magnitudes (about
        ``1e-7 * rms`` and below) is mostly rounding."""
        if self.sum is None or self.finite_count == 0 or not math.isfinite(self.sum):
            return None
        return self.sum / self.finite_count

    @property
    def kurtosis(self) -> Optional[float]:
        """Kurtosis of the finite elements **about zero** (non-central), ``E[x**4] / E[x**2]**2 =
        finite_count * sum4 / sumsq**2``: 3 for zero-mean Gaussian values, 1 when every element has
        the same magnitude, large when a few outliers dominate; always >= 1 (up to rounding) and at
        most ``finite_count``. It is not the central kurtosis (about the mean), which would need the
        third moment: for values with a mean far from zero it tends to 1. None when no element is
        finite, when ``E[x**2]`` is 0 (all zeros), when ``sumsq`` or ``sum4`` overflowed
        (``sum4_overflowed``), when ``sum4`` is too small for its FP32 / FP64 accumulator to hold it
        accurately (the fourth powers underflowed: FP32 values below ~1e-10 in magnitude), or
        unknown (a record of the earlier layout)."""
        n = self.finite_count
        if self.sum4 is None or n == 0 or not (math.isfinite(self.sumsq) and math.isfinite(self.sum4)):
            return None
        if self.sumsq <= 0.0 or self.sum4 < n * _underflow_floor(self.dtype):
            return None
        return n * self.sum4 / (self.sumsq * self.sumsq)

    def to_dict(self) -> dict:
        """Strict-JSON-safe dict (``json.dumps(..., allow_nan=False)`` accepts it): non-finite floats
        become ``{"finite": false, "value": ...}``, "none" becomes ``null``."""
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "shape": list(self.shape),
            "numel": self.numel,
            "nan_count": self.nan_count,
            "posinf_count": self.posinf_count,
            "neginf_count": self.neginf_count,
            "zero_count": self.zero_count,
            "finite_min": json_float(self.finite_min),
            "finite_max": json_float(self.finite_max),
            "sumsq": json_float(self.sumsq),
            "sum": json_float(self.sum),
            "sum4": json_float(self.sum4),
            "first_nonfinite_index": self.first_nonfinite_index,
            "nonfinite_count": self.nonfinite_count,
            "finite_count": self.finite_count,
            "is_finite": self.is_finite,
            "absmax": json_float(self.absmax),
            "l2_norm": json_float(self.l2_norm),
            "sumsq_overflowed": self.sumsq_overflowed,
            "mean": json_float(self.mean),
            "kurtosis": json_float(self.kurtosis),
            "sum4_overflowed": self.sum4_overflowed,
        }

    def __str__(self) -> str:
        def num(v):
            return "none" if v is None else f"{v:.6g}"
        first = "none" if self.first_nonfinite_index is None else str(self.first_nonfinite_index)
        return (f"TensorSummary({str(self.dtype).replace('torch.', '')}{list(self.shape)}: "
                f"nan={self.nan_count} +inf={self.posinf_count} -inf={self.neginf_count} "
                f"zero={self.zero_count} min={num(self.finite_min)} max={num(self.finite_max)} "
                f"sumsq={num(self.sumsq)}{' (overflowed)' if self.sumsq_overflowed else ''} "
                f"mean={num(self.mean)} kurtosis={num(self.kurtosis)} "
                f"first_nonfinite={first})")


def _underflow_floor(dtype: torch.dtype) -> float:
    """The smallest mean fourth power ``sum4 / finite_count`` that ``kurtosis`` trusts, for records of
    ``dtype``: 2**20 times the spacing of the accumulator's subnormals (2**-149 in FP32, 2**-1074 in
    FP64). Each fourth power that underflows loses at most half that spacing, so below the floor the
    rounding of underflowed terms could move the kurtosis by more than ~1e-6 relative -- at a mean
    fourth power of 0 (every term flushed to zero) the kurtosis would read 0, not the 1 -- 3 it is."""
    real = torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype
    fp64 = real == torch.float64 or not real.is_floating_point
    return 2.0 ** (-1074 + 20) if fp64 else 2.0 ** (-149 + 20)

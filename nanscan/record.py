"""The record layout in Python and :class:`TensorSummary`, its decoded view.

A record is a float64 row of ``RECORD_SIZE`` values (mirror of ``csrc/record.h``; keep them in
step). Raw conventions: ``finite_min = +inf`` / ``finite_max = -inf`` when there is no finite
element, ``first_nonfinite_index = -1`` when every element is finite. Counts are exact integers
(float64 holds every integer up to 2**53). Decoding is the only place a record reaches the host.
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


RECORD_SIZE = len(Field)


json_float = encode_float  # (the one home of the format: nanscan.jsonl)


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """Numeric health of one tensor, decoded from a record.

    ``finite_min`` / ``finite_max`` are ``None`` when no element is finite (never ±inf, NaN or a
    made-up 0). ``sumsq`` is the sum of squares of the finite elements, accumulated in FP32 for
    8/16/32-bit floating dtypes (FP64 for float64, integer and bool) and may be ``inf`` when the
    accumulation overflowed although every element is finite: see ``sumsq_overflowed``.
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

    @classmethod
    def from_values(cls, values: Sequence[float], dtype: torch.dtype, shape: Sequence[int]) -> "TensorSummary":
        """Decode one record already on the host (a sequence of ``RECORD_SIZE`` floats)."""
        if len(values) != RECORD_SIZE:
            raise ValueError(f"a nanscan record has {RECORD_SIZE} values, got {len(values)}")
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
            "first_nonfinite_index": self.first_nonfinite_index,
            "nonfinite_count": self.nonfinite_count,
            "finite_count": self.finite_count,
            "is_finite": self.is_finite,
            "absmax": json_float(self.absmax),
            "l2_norm": json_float(self.l2_norm),
            "sumsq_overflowed": self.sumsq_overflowed,
        }

    def __str__(self) -> str:
        def num(v):
            return "none" if v is None else f"{v:.6g}"
        first = "none" if self.first_nonfinite_index is None else str(self.first_nonfinite_index)
        return (f"TensorSummary({str(self.dtype).replace('torch.', '')}{list(self.shape)}: "
                f"nan={self.nan_count} +inf={self.posinf_count} -inf={self.neginf_count} "
                f"zero={self.zero_count} min={num(self.finite_min)} max={num(self.finite_max)} "
                f"sumsq={num(self.sumsq)}{' (overflowed)' if self.sumsq_overflowed else ''} "
                f"first_nonfinite={first})")

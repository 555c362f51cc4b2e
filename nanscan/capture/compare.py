"""Compare a tensor with a reference: where their non-finite values differ, then how far apart the
values finite in both are.

Every element is classified as finite, NaN, +Inf or -Inf. A position is a **mismatch** when the two
classes differ: non-finite in exactly one tensor, NaN in one and ±Inf in the other, or +Inf vs -Inf.
NaN vs NaN and +Inf vs +Inf match. Positions are flat indices in logical row-major order (the
order of ``x.reshape(-1)``, whatever the strides). Over the positions finite in both (``F``)::

    abs_i = |a_i - e_i|                     (float64)
    max_abs_error  = max_F abs_i            mean_abs_error = sum_F abs_i / |F|
    max_rel_error  = max_F abs_i / max(|e_i|, rel_floor)

``rel_floor`` guards a reference near zero. Its default is the smallest positive normal magnitude of
the reference dtype: ``torch.finfo(expected.dtype).tiny`` (below it the reference itself has lost
relative precision), 1 for integer / bool references. ``tiny * 1e3`` was not used: it is 15.6 for
float8_e4m3fn and 0.06 for float16, above many real values. An explicit ``rel_floor`` overrides it.
The quotient is float64, so it is finite except for a float64 reference whose error exceeds
``float64 max * rel_floor`` (then ``inf``, reported, not hidden). Errors are ``None`` when ``F`` is empty.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from nanscan.record import json_float

_FINITE, _NAN, _POSINF, _NEGINF = 0, 1, 2, 3
_CLASS_NAMES = {_FINITE: "finite", _NAN: "nan", _POSINF: "+inf", _NEGINF: "-inf"}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`. Counts and flat indices refer to ``shape`` (the inputs' shape, with
    a trailing 2 when complex inputs were compared as ``torch.view_as_real``)."""

    shape: tuple
    expected_dtype: torch.dtype
    actual_dtype: torch.dtype
    complex_as_real: bool
    nonfinite_expected: int
    nonfinite_actual: int
    mismatch_count: int
    mismatch_positions: tuple          # first ``max_positions`` flat indices, ascending
    mismatch_kinds: tuple              # (expected class, actual class) for each listed position
    first_nonfinite_expected: Optional[int]
    first_nonfinite_actual: Optional[int]
    finite_in_both: int
    max_abs_error: Optional[float]
    mean_abs_error: Optional[float]
    max_rel_error: Optional[float]
    rel_floor: float

    def unravel(self, flat: int) -> tuple:
        """Multi-dim index of a flat (logical row-major) index into ``shape``."""
        index = []
        for size in reversed(self.shape):
            flat, rem = divmod(flat, size)
            index.append(rem)
        return tuple(reversed(index))

    @property
    def mismatch_indices(self) -> tuple:
        return tuple(self.unravel(p) for p in self.mismatch_positions)

    @property
    def nonfinite_match(self) -> bool:
        return self.mismatch_count == 0

    def to_dict(self) -> dict:
        """Strict-JSON-safe dict (``json.dumps(..., allow_nan=False)`` accepts it)."""
        return {
            "shape": list(self.shape),
            "expected_dtype": str(self.expected_dtype).replace("torch.", ""),
            "actual_dtype": str(self.actual_dtype).replace("torch.", ""),
            "complex_as_real": self.complex_as_real,
            "nonfinite_expected": self.nonfinite_expected,
            "nonfinite_actual": self.nonfinite_actual,
            "mismatch_count": self.mismatch_count,
            "mismatch_positions": list(self.mismatch_positions),
            "mismatch_indices": [list(i) for i in self.mismatch_indices],
            "mismatch_kinds": [list(k) for k in self.mismatch_kinds],
            "first_nonfinite_expected": self.first_nonfinite_expected,
            "first_nonfinite_actual": self.first_nonfinite_actual,
            "finite_in_both": self.finite_in_both,
            "max_abs_error": json_float(self.max_abs_error),
            "mean_abs_error": json_float(self.mean_abs_error),
            "max_rel_error": json_float(self.max_rel_error),
            "rel_floor": json_float(self.rel_floor),
        }

    def __str__(self) -> str:
        def num(v):
            return "none" if v is None else f"{v:.6g}"

        def first(v):
            return "none" if v is None else f"{v} {list(self.unravel(v))}"
        dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
        lines = [f"Comparison(expected {dt(self.expected_dtype)} vs actual {dt(self.actual_dtype)}, "
                 f"shape {list(self.shape)}{', complex as view_as_real' if self.complex_as_real else ''})",
                 f"  non-finite: expected {self.nonfinite_expected}, actual {self.nonfinite_actual}; "
                 f"first at expected {first(self.first_nonfinite_expected)}, "
                 f"actual {first(self.first_nonfinite_actual)}",
                 f"  non-finite mismatches: {self.mismatch_count}"]
        for pos, idx, (e, a) in list(zip(self.mismatch_positions, self.mismatch_indices, self.mismatch_kinds))[:5]:
            lines.append(f"    flat {pos} {list(idx)}: expected {e}, actual {a}")
        if self.mismatch_count > 5:
            lines.append(f"    ... {self.mismatch_count - 5} more")
        lines.append(f"  finite in both: {self.finite_in_both}; max_abs_error={num(self.max_abs_error)} "
                     f"mean_abs_error={num(self.mean_abs_error)} max_rel_error={num(self.max_rel_error)} "
                     f"(rel_floor={self.rel_floor:.3g})")
        return "\n".join(lines)


def _classes(x: torch.Tensor) -> torch.Tensor:
    """Per element: 0 finite, 1 NaN, 2 +Inf, 3 -Inf (int8, same shape)."""
    inf = torch.isinf(x)
    c = torch.where(inf, torch.where(x > 0, _POSINF, _NEGINF), _FINITE)
    return torch.where(torch.isnan(x), _NAN, c).to(torch.int8)


def _first(mask: torch.Tensor) -> Optional[int]:
    """First True flat index (argmax returns the first maximum), ``None`` if none."""
    return int(torch.argmax(mask.to(torch.uint8))) if bool(mask.any()) else None


def compare(expected: torch.Tensor, actual: torch.Tensor, *, max_positions: int = 20,
            rel_floor: Optional[float] = None) -> Comparison:
    """Compare ``actual`` against the reference ``expected`` (see the module docstring for the maths).

    Shapes must match (``ValueError`` naming both); dtypes may differ: both are converted to float64
    (complex128 then ``torch.view_as_real`` if either is complex, shape gaining a trailing 2).
    ``actual`` is moved to ``expected``'s device. Host syncs happen; no Python loop over elements.
    """
    for name, t in (("expected", expected), ("actual", actual)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"compare: {name} must be a torch.Tensor, got {type(t).__name__}")
    if expected.shape != actual.shape:
        raise ValueError(f"compare: shapes differ: expected {tuple(expected.shape)} vs actual {tuple(actual.shape)}")
    if not isinstance(max_positions, int) or max_positions < 0:
        raise ValueError(f"compare: max_positions must be an int >= 0, got {max_positions!r}")
    if rel_floor is None:
        floating = expected.is_floating_point() or expected.is_complex()
        rel_floor = torch.finfo(expected.dtype).tiny if floating else 1.0
    if not (rel_floor > 0 and rel_floor != float("inf")):
        raise ValueError(f"compare: rel_floor must be finite and > 0, got {rel_floor!r}")
    is_complex = expected.is_complex() or actual.is_complex()
    work = torch.complex128 if is_complex else torch.float64
    e = expected.detach().to(dtype=work)
    a = actual.detach().to(device=expected.device, dtype=work)
    if is_complex:
        e, a = torch.view_as_real(e), torch.view_as_real(a)
    e, a = e.reshape(-1), a.reshape(-1)  # logical row-major order, whatever the strides
    ce, ca = _classes(e), _classes(a)
    mismatch = ce != ca
    positions = mismatch.nonzero().flatten()[:max_positions]
    kinds = torch.stack([ce[positions], ca[positions]], dim=1).tolist() if positions.numel() else []
    both = (ce == 0) & (ca == 0)
    n_both = int(both.sum())
    max_abs = mean_abs = max_rel = None
    if n_both:
        ef = e[both]
        err = (a[both] - ef).abs()
        max_abs, mean_abs = float(err.max()), float(err.mean())
        max_rel = float((err / ef.abs().clamp_min(rel_floor)).max())
    return Comparison(
        shape=tuple(expected.shape) + ((2,) if is_complex else ()),
        expected_dtype=expected.dtype, actual_dtype=actual.dtype, complex_as_real=is_complex,
        nonfinite_expected=int((ce != 0).sum()), nonfinite_actual=int((ca != 0).sum()),
        mismatch_count=int(mismatch.sum()), mismatch_positions=tuple(positions.tolist()),
        mismatch_kinds=tuple((_CLASS_NAMES[x], _CLASS_NAMES[y]) for x, y in kinds),
        first_nonfinite_expected=_first(ce != 0), first_nonfinite_actual=_first(ca != 0),
        finite_in_both=n_both, max_abs_error=max_abs, mean_abs_error=mean_abs, max_rel_error=max_rel,
        rel_floor=float(rel_floor),
    )

"""Pure-PyTorch reference summary: the oracle for every kernel test and the fallback backend.

For a tensor ``x`` (complex ``x`` is read as ``torch.view_as_real(x)``) with elements ``x_i``,
``i`` the flat index in logical row-major order, the record (layout: ``nanscan.record``) holds::

    nan_count     = #{i : x_i is NaN}
    posinf_count  = #{i : x_i = +inf}           neginf_count = #{i : x_i = -inf}
    zero_count    = #{i : x_i = 0}              (+0 and -0)
    finite_min    = min {x_i : x_i finite}      (+inf when there is none)
    finite_max    = max {x_i : x_i finite}      (-inf when there is none)
    sumsq         = sum_{x_i finite} fl(x_i * x_i), accumulated in float32 for 8/16/32-bit
                    floating inputs (each square is a float32 product, so 1e20**2 is +inf) and in
                    float64 for float64, integer and bool inputs
    first_nonfinite_index = min {i : x_i not finite}   (-1 when there is none)
    sum           = sum_{x_i finite} x_i, accumulated like sumsq
    sum4          = sum_{x_i finite} fl(s_i * s_i) with s_i = fl(x_i * x_i), accumulated like sumsq
                    (a float32 fourth power is +inf from |x_i| ~ 4.3e9)

The three sums are accumulated by ``torch.sum`` in the accumulation dtype (its own, pairwise order),
the kernels in blocks of at most 256 terms per accumulator, with fused multiply-adds where they have
them: the two agree within the tolerance ``tests/helpers.py`` checks -- 1e-4 relative in float32,
1e-12 in float64; for ``sum`` relative to the sum of the ``|x_i|``, since a signed sum can cancel to
far below its terms. sumsq and sum4 are +inf on both sides or on neither; whether an FP32 ``sum``
overflows, which needs the squares to overflow first, depends on the order of its additions.

Integers wider than 2**53 lose precision in finite_min / finite_max (records are float64).
It uses only elementwise ops and full reductions, never boolean indexing, so it does not sync the
host and it traces under ``torch.compile``. It is not fast: it materializes several temporaries.
"""
from __future__ import annotations

import torch

from nanscan.record import RECORD_SIZE, Field

_SUPPORTED_REAL = frozenset(
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8,
     torch.int8, torch.int16, torch.int32, torch.int64]
    + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
       if hasattr(torch, n)]
)

def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernels summarize tensors of ``dtype`` (complex ones as their real views)."""
    return dtype in _SUPPORTED_REAL or dtype in (torch.complex32, torch.complex64, torch.complex128)


# Kept in step with csrc/inputs.h (kSupportedText) so every backend rejects bad input the same way.
SUPPORTED_TEXT = (
    "supported: float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, "
    "float8_e5m2fnuz, bool, uint8, int8, int16, int32, int64, complex64, complex128, complex32, "
    "as dense strided tensors"
)


def normalize_input(x: torch.Tensor, op: str = "nanscan.summarize") -> torch.Tensor:
    """Validate ``x`` and return the real tensor the kernels read (``view_as_real`` for complex).

    Raises ``TypeError`` naming the layout / dtype for sparse, nested, quantized and other
    unsupported inputs, mirroring ``csrc/inputs.h``. The public API calls it before dispatching to
    any backend: sparse tensors would otherwise never reach the C++ check (the dispatcher routes
    them to a Sparse key that has no kernel).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(f"{op}: nested tensors are not supported ({SUPPORTED_TEXT}); "
                        "summarize each component with .unbind()")
    if x.is_quantized:
        raise TypeError(f"{op}: quantized tensors (dtype {x.dtype}) are not supported "
                        f"({SUPPORTED_TEXT}); dequantize first")
    if x.layout != torch.strided:
        raise TypeError(f"{op}: layout {x.layout} is not supported ({SUPPORTED_TEXT}); "
                        "convert with .to_dense()")
    # A lazily conjugated / negated view (x.conj()) has no real view: materialize it (a copy, only then).
    real = torch.view_as_real(x.resolve_conj().resolve_neg()) if x.is_complex() else x.resolve_neg()
    if real.dtype not in _SUPPORTED_REAL:
        raise TypeError(f"{op}: dtype {x.dtype} is not supported ({SUPPORTED_TEXT})")
    return real


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype elements are compared and squared in: float64 for float64 / integer / bool inputs,
    float32 for every narrower floating dtype."""
    if dtype == torch.float64 or not dtype.is_floating_point:
        return torch.float64
    return torch.float32


def summarize(x: torch.Tensor) -> torch.Tensor:
    """Return the float64 ``[RECORD_SIZE]`` record of ``x`` on ``x.device`` (see the module docstring)."""
    real = normalize_input(x)
    vals = real.reshape(-1).to(compute_dtype(real.dtype))
    n = vals.numel()
    out = torch.empty(RECORD_SIZE, dtype=torch.float64, device=vals.device)
    inf = float("inf")
    if n == 0:
        out.copy_(torch.tensor([0, 0, 0, 0, inf, -inf, 0, -1, 0, 0], dtype=torch.float64))
        return out
    finite = torch.isfinite(vals)
    out[Field.NAN_COUNT] = torch.isnan(vals).sum()
    out[Field.POSINF_COUNT] = torch.isposinf(vals).sum()
    out[Field.NEGINF_COUNT] = torch.isneginf(vals).sum()
    out[Field.ZERO_COUNT] = (vals == 0).sum()
    out[Field.FINITE_MIN] = torch.where(finite, vals, inf).amin()
    out[Field.FINITE_MAX] = torch.where(finite, vals, -inf).amax()
    finite_vals = torch.where(finite, vals, 0)
    squares = finite_vals * finite_vals
    out[Field.SUMSQ] = squares.sum(dtype=vals.dtype)
    out[Field.SUM] = finite_vals.sum(dtype=vals.dtype)
    out[Field.SUM4] = (squares * squares).sum(dtype=vals.dtype)
    index = torch.arange(n, device=vals.device)
    first = torch.where(finite, n, index).amin()
    out[Field.FIRST_NONFINITE] = torch.where(first == n, -1, first)
    return out


def summarize_many(xs: list[torch.Tensor]) -> torch.Tensor:
    """Return the ``[len(xs), RECORD_SIZE]`` float64 records of ``xs`` (a Python loop: this is the oracle)."""
    if len(xs) == 0:
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    return torch.stack([summarize(x) for x in xs])

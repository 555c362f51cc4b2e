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

from nanscan.record import RECORD_SIZE

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
    vals = real.to(compute_dtype(real.dtype))
    n = vals.numel()
    if n == 0:
        inf = float("inf")
        return torch.tensor([0, 0, 0, 0, inf, -inf, 0, -1, 0, 0], dtype=torch.float64, device=vals.device)
    # One elementwise select over the record's 10 slots, not a stack: a stack of 0-d tensors is a
    # cat, which inductor lowers to one tiny kernel per field.
    slot = torch.arange(RECORD_SIZE, device=vals.device)
    record = torch.zeros(RECORD_SIZE, dtype=torch.float64, device=vals.device)
    for k, field in enumerate(_fields(vals, n)):
        record = torch.where(slot == k, field.to(torch.float64), record)
    return record


def _fields(vals: torch.Tensor, n: int) -> list:
    """The record's fields (in ``Field`` order) as 0-d tensors, each a full reduction of ``vals``.

    Written as one functional stack of reductions over the same elements -- no in-place writes, no
    reshape of a strided tensor (the flat index is an ``arange`` viewed in ``vals``' shape) -- so
    that inductor, given this as the decomposition of the ops (``nanscan._ops.register_fused_records``),
    computes all of them in one loop, fused with the kernel that writes ``vals`` where it can
    (Note [records fused into compiled kernels] in nanscan/_ops.py)."""
    inf = float("inf")
    finite = torch.isfinite(vals)
    finite_vals = torch.where(finite, vals, 0)
    squares = finite_vals * finite_vals
    index = torch.arange(n, device=vals.device).view(vals.shape)
    first = torch.where(finite, n, index).amin()
    return [
        torch.isnan(vals).sum(),
        torch.isposinf(vals).sum(),
        torch.isneginf(vals).sum(),
        (vals == 0).sum(),
        torch.where(finite, vals, inf).amin(),
        torch.where(finite, vals, -inf).amax(),
        squares.sum(dtype=vals.dtype),
        torch.where(first == n, -1, first),
        finite_vals.sum(dtype=vals.dtype),
        (squares * squares).sum(dtype=vals.dtype),
    ]


def summarize_many(xs: list[torch.Tensor]) -> torch.Tensor:
    """Return the ``[len(xs), RECORD_SIZE]`` float64 records of ``xs`` (a Python loop: this is the oracle)."""
    if len(xs) == 0:
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    if len(xs) == 1:
        return summarize(xs[0]).unsqueeze(0)
    return torch.stack([summarize(x) for x in xs])

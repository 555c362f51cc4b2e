"""The record as inductor computes it inside a compiled graph: the decomposition
``nanscan._ops.register_fused_records`` gives inductor for ``nanscan::summarize`` /
``summarize_many`` (Note [records fused into compiled kernels] in nanscan/_ops.py).

Note [a record in two stages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Written as ten full reductions (the reference's ``_fields``), a record is what inductor makes of a
large full reduction for a GPU: each field split in two stages, the ten first stages fused with the
producer and with each other, and the ten second stages one small kernel each -- they read ten
different partial buffers, and inductor fuses kernels that share no buffer only on request. About
nine kernels more per record than the opaque op's one call.

So the record is written in two stages here, the split chosen in the tensor's own shape:

1. **Rows.** The tensor's leading dimensions, as few as make at least ``MIN_ROWS`` rows, are kept;
   each field is reduced over the rest (a LayerNorm's or softmax's own loop: a pointwise producer,
   or a kernel reducing over the same last dimensions, fuses with it on every backend, where a full
   reduction fuses only with a producer whose loop is flat on the C++ backend). Ten reductions over
   the same elements: one loop, the tensor read once, ten partial values a row.
2. **The record.** Over the rows, two reductions of the ten partials as one ``[rows, 10]`` matrix
   (a select over the ten partial buffers, never written as such): a sum (the counts and the FP32
   sums) and a max (finite_max; finite_min and the first non-finite index negated). Both read the
   same buffers, so inductor fuses them, and the select of each field from the one or the other,
   over the record's ten slots, is their epilogue: one small kernel a record.

The record equals the reference's field by field: the counts, min, max and first index exactly (the
index is the flat index in logical order: ``arange`` viewed in the tensor's shape, as the
reference); the sums within the FP32 tolerance -- the partial sums are accumulated in the
accumulation dtype over a row, the rows' sums in float64 and rounded to the accumulation dtype once,
so a sum of squares overflows to +inf where the total does, as one FP32 accumulation of
non-negative terms does. A tensor with fewer elements than ``MIN_ELEMENTS``, with no leading
dimensions to keep (1-D, or too few leading rows), or with a symbolic (dynamic) shape is reduced in
one stage (the reference's own reductions): inductor splits a reduction only when it is large.
"""
from __future__ import annotations

import torch

from nanscan.kernels import reference
from nanscan.record import RECORD_SIZE

# Rows a tensor is split into, at least (a GPU's first stage runs one program per row or so: a few
# per SM of an H100's 132). A smaller tensor is reduced in one stage: inductor does not split it.
MIN_ROWS = 256
MIN_ELEMENTS = 1 << 16

# The ten slots (``nanscan.record.Field`` order): those combined by a sum (counts, FP32 sums), by a
# max of the negated value (finite_min, first_nonfinite_index), and the FP32 sums.
_SUMMED = (0, 1, 2, 3, 6, 8, 9)
_NEGATED = (4, 7)
_ACCUMULATED = (6, 8, 9)
_FIRST = 7


def kept_dims(shape) -> int:
    """How many leading dimensions of ``shape`` are kept as rows (0: one stage)."""
    rows = 1
    for k in range(len(shape) - 1):  # (at least the last dimension is reduced in the first stage)
        rows *= shape[k]
        if rows >= MIN_ROWS:
            return k + 1
    return 0


def summarize(x: torch.Tensor) -> torch.Tensor:
    """The float64 ``[RECORD_SIZE]`` record of ``x``, in two stages where it is large (Note [a record
    in two stages]); the reference's otherwise."""
    real = reference.normalize_input(x)
    shape = real.shape
    if not all(type(s) is int for s in shape) or real.numel() < MIN_ELEMENTS:
        return reference.summarize(x)
    keep = kept_dims(shape)
    if keep == 0:
        return reference.summarize(x)
    vals = real.to(reference.compute_dtype(real.dtype))
    n = vals.numel()
    rest = tuple(range(keep, vals.dim()))
    inf = float("inf")
    finite = torch.isfinite(vals)
    finite_vals = torch.where(finite, vals, 0)
    squares = finite_vals * finite_vals
    index = torch.arange(n, device=vals.device).view(shape)
    partials = [  # (Field order; each [rows])
        torch.isnan(vals).sum(rest),
        torch.isposinf(vals).sum(rest),
        torch.isneginf(vals).sum(rest),
        (vals == 0).sum(rest),
        torch.where(finite, vals, inf).amin(rest),
        torch.where(finite, vals, -inf).amax(rest),
        squares.sum(rest, dtype=vals.dtype),
        torch.where(finite, n, index).amin(rest),
        finite_vals.sum(rest, dtype=vals.dtype),
        (squares * squares).sum(rest, dtype=vals.dtype),
    ]
    rows = partials[0].numel()
    device = vals.device
    slot = torch.arange(RECORD_SIZE, device=device)
    matrix = torch.zeros(rows, RECORD_SIZE, dtype=torch.float64, device=device)
    for k, p in enumerate(partials):
        matrix = torch.where(slot == k, p.reshape(rows, 1).to(torch.float64), matrix)
    summed = _mask(slot, _SUMMED)
    negated = _mask(slot, _NEGATED)
    sign = torch.where(negated, -1.0, 1.0).to(torch.float64)
    total = torch.where(summed, matrix, 0).sum(0)
    largest = torch.where(summed, -inf, matrix * sign).amax(0) * sign
    # The FP32 sums rounded once to the accumulation dtype (+inf where the total overflows it).
    total = torch.where(_mask(slot, _ACCUMULATED), total.to(vals.dtype).to(torch.float64), total)
    record = torch.where(summed, total, largest)
    return torch.where((slot == _FIRST) & (record == n), -1.0, record)


def _mask(slot: torch.Tensor, slots: tuple) -> torch.Tensor:
    mask = slot == slots[0]
    for k in slots[1:]:
        mask = mask | (slot == k)
    return mask


def summarize_many(xs: list) -> torch.Tensor:
    """The ``[len(xs), RECORD_SIZE]`` float64 records of ``xs``, each as :func:`summarize`."""
    if len(xs) == 0:
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    if len(xs) == 1:
        return summarize(xs[0]).unsqueeze(0)
    return torch.stack([summarize(x) for x in xs])

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

1. **Rows.** The tensor's leading dimensions, as few as make at least ``MIN_ROWS`` rows (else all
   but the last), are kept; each field is reduced over the rest (a LayerNorm's or softmax's own
   loop: a pointwise producer, or a kernel reducing over the same last dimensions, fuses with it on
   every backend, where a full reduction fuses only with a producer whose loop is flat on the C++
   backend). Ten reductions over the same elements: one loop, the tensor read once, ten partial
   values a row.
2. **The record.** Over the rows, a sum (the counts and the FP32 sums) and a max (finite_max;
   finite_min and the first non-finite index negated) of the ten partials, each as a
   ``[10, rows]`` select over the ten partial buffers -- of every record of the call at once:
   ``[records x 10, rows]``, each partial padded to the most rows with the reduction's identity.
   Each select is read by its reduction only, so inductor can compute it inside the reduction
   instead of writing it first (a select of more than eight partial buffers is realized on a GPU,
   ``realize_acc_reads_threshold``, but in the kernel that reduces it: no memory traffic;
   stacking the partials into one buffer instead broke the first stages' fusion, twenty kernels
   for four records); both read every partial, so the two reductions are one kernel; the rows
   are contiguous in it, an inner reduction, which inductor does not split again up to 8,192 rows
   (an outer one, over ``[rows, 10]``, it splits from 128 rows: a written matrix and two more
   kernels a record); and the select of each slot from the one or the other is their epilogue.
   One small kernel a call (a record op call holds one to a few records).

The record equals the reference's field by field: the counts, min, max and first index exactly (the
index is the flat index in logical order: ``arange`` viewed in the tensor's shape, as the
reference); the sums within the FP32 tolerance -- the partial sums are accumulated in the
accumulation dtype over a row, the rows' sums in float64 and rounded to the accumulation dtype once,
so a sum of squares overflows to +inf where the total does, as one FP32 accumulation of
non-negative terms does. A tensor of at most ``ONE_STAGE_MAX`` elements, with no leading
dimensions to keep (1-D, or leading dimensions of size 1), or with a symbolic (dynamic) shape is
reduced in one stage (the reference's own reductions): inductor does not split a small one, and
its ten reductions read the same elements (one kernel). A 1-D tensor above that size, or one with
fewer than 264 rows and more than 8,192 elements a row, is split by inductor itself (about ten
more small kernels for it on a GPU); compiled graphs record few such tensors.
"""
from __future__ import annotations

import math

import torch

from nanscan.kernels import reference
from nanscan.record import RECORD_SIZE

# Inductor's split heuristics for a GPU (``Reduction.num_splits``, torch 2.11 -- 2.14): a reduction
# with at least two outputs per SM (264 on an H100 or H200) is never split, nor an inner reduction
# (over contiguous elements) of at most 8,192 elements. So the rows are at least MIN_ROWS (stage 1
# stays one kernel, fusible with the producer), stage 2 reduces the rows as an inner reduction (one
# kernel up to 8,192 rows), and a tensor of at most ONE_STAGE_MAX elements is reduced in one stage
# (its ten reductions read the same elements: one kernel, unsplit).
MIN_ROWS = 512
ONE_STAGE_MAX = 8192

# The ten slots (``nanscan.record.Field`` order): those combined by a sum (counts, FP32 sums), by a
# max of the negated value (finite_min, first_nonfinite_index), and the FP32 sums.
_SUMMED = (0, 1, 2, 3, 6, 8, 9)
_NEGATED = (4, 7)
_ACCUMULATED = (6, 8, 9)
_FIRST = 7


def kept_dims(shape) -> int:
    """How many leading dimensions of ``shape`` are kept as rows: the fewest that make ``MIN_ROWS``
    rows, else all but the last (at least the last dimension is reduced in the first stage)."""
    rows = 1
    for k in range(len(shape) - 1):
        rows *= shape[k]
        if rows >= MIN_ROWS:
            return k + 1
    return max(len(shape) - 1, 0)


def summarize(x: torch.Tensor) -> torch.Tensor:
    """The float64 ``[RECORD_SIZE]`` record of ``x``, in two stages where it is large (Note [a record
    in two stages]); the reference's otherwise."""
    return summarize_many([x])[0]


def summarize_many(xs: list) -> torch.Tensor:
    """The ``[len(xs), RECORD_SIZE]`` float64 records of ``xs``: each large one's rows reduced in its
    own first stage, the second stages of all of them one reduction (one kernel a call, not one a
    record); the others the reference's."""
    if len(xs) == 0:
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    records, staged = [None] * len(xs), []
    for k, x in enumerate(xs):
        first = _first_stage(x)
        if first is None:
            records[k] = reference.summarize(x)
        else:
            staged.append((k, *first))
    if staged:
        finished = _second_stage([s[1:] for s in staged])
        if len(staged) == len(xs):  # (the records as the second stage writes them: no copy)
            return finished
        for j, (k, *_) in enumerate(staged):
            records[k] = finished[j]
    return records[0].unsqueeze(0) if len(records) == 1 else torch.stack(records)


def _first_stage(x: torch.Tensor):
    """``(partials, n, accumulation dtype)``: the ten fields of ``x`` by rows (ten ``[rows]``
    tensors, ``Field`` order), or None where ``x`` is reduced in one stage."""
    real = reference.normalize_input(x)
    shape = real.shape
    if not all(type(s) is int for s in shape) or real.numel() <= ONE_STAGE_MAX:
        return None
    keep = kept_dims(shape)
    if math.prod(shape[:keep]) < 2:  # (1-D, or leading dimensions of 1: no rows to keep)
        return None
    vals = real.to(reference.compute_dtype(real.dtype))
    n = vals.numel()
    rest = tuple(range(keep, vals.dim()))
    inf = float("inf")
    finite = torch.isfinite(vals)
    finite_vals = torch.where(finite, vals, 0)
    squares = finite_vals * finite_vals
    # The partials are written by the first stage and read by the second: counts a row and indices
    # below 2**31 in 32 bits (exact) keep them at 40 bytes a row with FP32 accumulation, not 60.
    count = torch.int32 if n < 2**31 else torch.int64
    index = torch.arange(n, dtype=count, device=vals.device).view(shape)
    partials = [
        torch.isnan(vals).sum(rest, dtype=count),
        torch.isposinf(vals).sum(rest, dtype=count),
        torch.isneginf(vals).sum(rest, dtype=count),
        (vals == 0).sum(rest, dtype=count),
        torch.where(finite, vals, inf).amin(rest),
        torch.where(finite, vals, -inf).amax(rest),
        squares.sum(rest, dtype=vals.dtype),
        torch.where(finite, n, index).amin(rest),
        finite_vals.sum(rest, dtype=vals.dtype),
        (squares * squares).sum(rest, dtype=vals.dtype),
    ]
    return [p.reshape(-1) for p in partials], n, vals.dtype


def _second_stage(staged: list) -> torch.Tensor:
    """The ``[len(staged), RECORD_SIZE]`` records from ``(partials, n, dtype)`` first stages: a sum
    and a max over the rows of two ``[len(staged) * RECORD_SIZE, rows]`` selects of every partial,
    each padded to the most rows with its reduction's identity."""
    inf = float("inf")
    device = staged[0][0][0].device
    rows = max(partials[0].numel() for partials, _, _ in staged)
    width = len(staged) * RECORD_SIZE
    # Each select is read by one reduction only, so inductor can compute it inside the reduction
    # instead of writing it first (a select read twice is written to memory); the rows are
    # contiguous in it, an inner reduction, which inductor does not split again up to 8,192 rows
    # (one over [rows, RECORD_SIZE] it splits from 128); both read every partial, so the sum and
    # the max are one kernel.
    summed_cols, largest_cols = [], []
    for partials, _, _ in staged:
        for field, p in enumerate(partials):
            c = p.to(torch.float64)
            summed_cols.append(_padded(c, rows, 0.0))
            largest_cols.append(_padded(-c if field in _NEGATED else c, rows, -inf))
    line = torch.arange(width, device=device).view(width, 1)
    summed = _mask(line % RECORD_SIZE, _SUMMED)
    total = _select(line, summed_cols, torch.zeros(width, rows, dtype=torch.float64, device=device))
    total = torch.where(summed, total, 0).sum(1).view(len(staged), RECORD_SIZE)
    largest = _select(line, largest_cols, torch.full((width, rows), -inf, dtype=torch.float64, device=device))
    largest = torch.where(summed, -inf, largest).amax(1).view(len(staged), RECORD_SIZE)

    slot = torch.arange(RECORD_SIZE, device=device).view(1, RECORD_SIZE)
    record_of = torch.arange(len(staged), device=device).view(len(staged), 1)
    largest = torch.where(_mask(slot, _NEGATED), -largest, largest)
    # The FP32 sums rounded once to their accumulation dtype (+inf where the total overflows it).
    accumulated = _mask(slot, _ACCUMULATED)
    for dtype in {d for _, _, d in staged if d != torch.float64}:
        rounded = accumulated & _mask(record_of, tuple(j for j, s in enumerate(staged) if s[2] == dtype))
        total = torch.where(rounded, total.to(dtype).to(torch.float64), total)
    record = torch.where(_mask(slot, _SUMMED), total, largest)
    zeros = torch.zeros(len(staged), 1, dtype=torch.float64, device=device)
    n = _select(record_of, [float(s[1]) for s in staged], zeros)
    return torch.where((slot == _FIRST) & (record == n), -1.0, record)


def _padded(column: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``column`` (``[r]``) as ``[1, rows]``, the rows past ``r`` ``value``."""
    short = rows - column.numel()
    column = torch.constant_pad_nd(column, (0, short), value) if short else column
    return column.view(1, rows)


def _select(line: torch.Tensor, columns: list, base: torch.Tensor) -> torch.Tensor:
    """``columns[k]`` where ``line == k`` (``base`` elsewhere): a pointwise select, never written."""
    out = base
    for k, c in enumerate(columns):
        out = torch.where(line == k, c, out)
    return out


def _mask(slot: torch.Tensor, slots: tuple) -> torch.Tensor:
    mask = slot == slots[0]
    for k in slots[1:]:
        mask = mask | (slot == k)
    return mask

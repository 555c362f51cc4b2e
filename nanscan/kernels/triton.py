"""Triton backend, the launcher: the implementations behind ``nanscan::triton_summarize`` and
``nanscan::triton_summarize_many`` (registered for CUDA, and for CPU under ``TRITON_INTERPRET=1``, by
:mod:`nanscan._ops`).

It validates and flattens the inputs, picks each launch's configuration (tile, tiles per chunk,
register cap) and launches the two kernels of :mod:`nanscan.kernels.triton_kernels` (which
describes the algorithm, its numerics and the launch grid): stage 1 over chunks, then stage 2
for the records -- two launches for a tensor (none for an empty one), and for a list on CUDA one
stage-1 launch per group and one stage-2 launch (below).

Known limitations:

* Non-contiguous inputs are copied with ``.contiguous()`` first (a full copy; the CUDA backend has
  a strided kernel). ``first_nonfinite_index`` is the logical row-major index either way. Tensors
  carrying a conjugate / negative bit are resolved (copied) first as well.
* Under ``TRITON_INTERPRET=1`` (CPU tensors, tests) fp16 / bf16 inputs are upcast to float32 by
  the launcher (the interpreter has no bf16 arithmetic; the record is identical because both
  paths compute in float32), and ``summarize_many`` is a Python loop over ``summarize``.
* On CUDA, ``summarize_many`` is a multi-tensor launch: tensors are grouped by (element kind,
  16-byte alignment); each group is ONE stage-1 launch over a pointer table (int64 data pointers
  in a device tensor, one entry per chunk naming its tensor), followed by ONE stage-2 launch for
  all tensors: ``groups + 1`` launches plus one (pinned, asynchronous) host-to-device copy of
  the tables, and no host sync. ``_summarize_many_table`` is that path; tests also run it under
  the interpreter (where the "device" pointers are CPU addresses). During CUDA graph capture
  ``summarize_many`` falls back to two launches per tensor: a captured copy would re-read this
  call's host table -- a temporary pinned buffer -- at every replay, long after it was freed or
  reused.
  The table's host side costs ~0.7 us of Python per tensor: a contiguous plain tensor (not a
  subclass, no negative bit; not fp16 / bf16 under the interpreter) contributes its data pointer
  and numel only, and the per-tensor arithmetic runs on small CPU tensors; every other tensor is
  validated and converted one by one (``_prepare``, 8 - 15 us). ``benchmarks/triton_host.py``
  measures it, and counts the launches and the table's torch operations.

Host work on the GPU path (CUDA tensors, no interpreter), counted from this code -- it cannot be
timed without a GPU. "Device allocations" go through the caching allocator; no path syncs the host.

``summarize(x)``, a plain contiguous tensor, n > 0:

=========================  ======================================  ==================================
                           before (issue 44)                       now
=========================  ======================================  ==================================
input handling             ``_prepare``: ~12 checks, detach +      8 attribute reads; ``x`` is
                           reshape (2 new tensors)                 passed as it is (other inputs:
                                                                   ``_prepare``, as before)
device allocations         3 (record, int / float partials)        3
device guard               ``torch.cuda.device``: 2 exchanges      1 ``current_device`` query (a
                                                                   guard only on another device)
launches                   2                                       2
empty tensor               0 launches, a new 10-float host         0 launches, one cached host
                           tensor per call, 1 staged copy          tensor, 1 staged copy
=========================  ======================================  ==================================

``summarize_many(xs)``, N tensors in G (read kind, alignment) groups; per call:

=========================  ======================================  ==================================
                           before                                  now
=========================  ======================================  ==================================
capture check              ``current_device`` +                    same
                           ``is_current_stream_capturing``
table build (CPU tensors)  49 - 51 torch ops for one group, ~25    21 for one group of one-tile
                           more per further group                  chunks, 24 otherwise, 28 - 32 for
                                                                   several groups (~1 - 2 us each)
                                                                   -- ``benchmarks/triton_host.py``
host buffers               pageable table, then ``pin_memory``     the table is built in one
                           (a pinned block and a second copy)      pinned block
host-to-device copies      1 (asynchronous)                        1
device allocations         4 (table, records, 2 partial buffers)   4
device guard               2 exchanges                             as for ``summarize``
launches                   G + 1                                   G + 1
=========================  ======================================  ==================================

and per tensor: 9 attribute reads and 3 list stores (``_entries``; a tensor it cannot read in place:
``_prepare``), then 3 ints into torch -- before through ``torch.tensor(list)`` (~50 - 130 ns an
int), now through ``array`` (~12 - 45 ns). On this project's 2-core CPU (``benchmarks.triton_host``,
launches stubbed): per call 119 -> 55 us, per tensor 0.88 -> 0.73 us, of which 0.55 us is
``_entries``. Triton's own work per launch is not ours to cut: ``JITFunction.run`` reads the
current device and stream, binds and specializes every argument (~2.5 - 3 us on that CPU, triton
3.8), builds a cache key (~1 us) and calls the driver; launching a cached compiled kernel directly
would skip the binding and the key but depends on Triton internals (3.6 on the GPU machine, 3.8
here) that only a GPU run could check.
"""

import contextlib
from array import array

import torch
import triton

from nanscan.kernels.reference import SUPPORTED_TEXT, normalize_input
from nanscan.kernels.triton_kernels import (
    INTERPRETING,
    RECORD_SIZE,
    _BLOCK_BY_ITEMSIZE,
    _BLOCK_OTHER,
    _DTYPE_INFO,
    _KIND_FLOAT,
    _MAX_ITERS,
    _MAX_ITERS_PACKED,
    _MAXNREG,
    _NUM_WARPS,
    _PTR_CODE,
    _STAGE2_BLOCK,
    _TARGET_PROGRAMS,
    _UNROLL,
    _stage1_kernel,
    _stage2_kernel,
)

__all__ = ["INTERPRETING", "SUPPORTED_TEXT", "summarize", "summarize_many"]

_INF = float("inf")
# the record of an empty tensor, on the host (the source of a staged copy: never written)
_IDENTITY = torch.tensor([0.0, 0.0, 0.0, 0.0, _INF, -_INF, 0.0, -1.0, 0.0, 0.0], dtype=torch.float64)


def _prepare(x: torch.Tensor, op: str):
    """Validate x and return (flat contiguous tensor the kernel reads, kind, acc64).

    Raises TypeError (naming the dtype / layout and the supported set) like csrc/inputs.h, and
    ValueError for a CPU tensor outside the interpreter."""
    if isinstance(x, torch.Tensor) and not x.is_nested and x.layout == torch.strided and x.is_complex():
        x = x.detach().resolve_conj()  # view_as_real refuses a lazily conjugated tensor
    real = normalize_input(x, op)  # TypeError for nested / quantized / sparse / bad dtype
    info = _DTYPE_INFO.get(real.dtype)
    if info is None:  # normalize_input and _DTYPE_INFO disagree: still a clean TypeError
        raise TypeError(f"{op}: dtype {x.dtype} is not supported ({SUPPORTED_TEXT})")
    kind, acc64, view_as = info
    if real.device.type == "cpu" and not INTERPRETING:
        raise ValueError(f"{op}: the triton backend runs on CUDA tensors, or on CPU tensors only under "
                         "TRITON_INTERPRET=1 (set before triton is imported); got a CPU tensor")
    # resolve_neg: a negative-bit view (e.g. x.conj().imag) stores the negated values
    t = real.detach().resolve_neg().contiguous().reshape(-1)
    if view_as is not None:
        t = t.view(view_as)
    if INTERPRETING and t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()  # the interpreter has no bf16 arithmetic; fp32 is the compute type anyway
    return t, kind, acc64


_NO_GUARD = contextlib.nullcontext()  # (reusable: it holds no state)


def _device_guard(device: torch.device):
    """``torch.cuda.device(device)`` when ``device`` is a CUDA device other than the current one
    (Triton launches on the current device); otherwise a no-op context -- entering and leaving
    ``torch.cuda.device`` costs two device exchanges per call even when nothing changes."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (asked of that device, which
    need not be the current one)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _block_for(kind: int, itemsize: int) -> int:
    return _BLOCK_BY_ITEMSIZE[itemsize] if kind == _KIND_FLOAT else _BLOCK_OTHER


def _stage1_options(kind: int, itemsize: int) -> dict:
    """Launch options of the stage-1 kernel for (kind, element size): num_warps, and maxnreg where
    _MAXNREG caps the registers (part of Triton's specialization key, which holds the dtype
    already: still one compile per dtype). The interpreter ignores both."""
    return _STAGE1_OPTIONS.get((kind, itemsize), _STAGE1_DEFAULT)


_STAGE1_DEFAULT = {"num_warps": _NUM_WARPS}
_STAGE1_OPTIONS = {key: {"num_warps": _NUM_WARPS, "maxnreg": regs} for key, regs in _MAXNREG.items()}


def _iters_for(nblocks: int) -> int:
    return max(1, min(_MAX_ITERS, nblocks // _TARGET_PROGRAMS))


def _summarize_prepared(t, kind, acc64, out, block=None, iters=None):
    """Write the record of the flat contiguous tensor t into out ([RECORD_SIZE] float64, t.device)."""
    n = t.numel()
    if n == 0:  # the identity record: no kernel, one small host-to-device copy
        if not _capturing(out.device):
            return out.copy_(_IDENTITY, non_blocking=True)
        # under CUDA graph capture a pageable copy is not allowed: stage 2 over zero partials
        # writes the same identity record
        dummy_i = torch.empty(1, dtype=torch.int64, device=t.device)
        dummy_f = torch.empty(1, dtype=torch.float64, device=t.device)
        with _device_guard(t.device):
            _stage2_kernel[(1,)](dummy_i, dummy_f, 1, out, 0, int(acc64), dummy_i, 0,
                                 MULTI=False, BLOCK2=_STAGE2_BLOCK, num_warps=_NUM_WARPS)
        return out
    block = block or _block_for(kind, t.element_size())
    iters = iters or _iters_for(triton.cdiv(n, block))
    assert 1 <= iters <= _MAX_ITERS_PACKED, iters  # the rescan's packed per-lane counters
    assert block % _UNROLL == 0, block
    nchunks = triton.cdiv(n, block * iters)
    part_i = torch.empty(5 * nchunks, dtype=torch.int64, device=t.device)
    part_f = torch.empty(5 * nchunks, dtype=torch.float64, device=t.device)
    with _device_guard(t.device):
        _stage1_kernel[(nchunks,)](
            t, n, iters, part_i, 0, 0, part_i, part_f, nchunks,
            KIND=kind, ACC64=acc64, CODE=_PTR_CODE[t.dtype], MULTI=False, ALIGNED=False, BLOCK=block,
            **_stage1_options(kind, t.element_size()))
        _stage2_kernel[(1,)](
            part_i, part_f, nchunks, out, nchunks, int(acc64), part_i, 0,
            MULTI=False, BLOCK2=_STAGE2_BLOCK, num_warps=_NUM_WARPS)
    return out


def summarize(x: torch.Tensor, *, _block=None, _iters=None) -> torch.Tensor:
    """Float64 ``[RECORD_SIZE]`` record of ``x`` on ``x.device`` (two launches; none for an empty tensor).

    Non-contiguous ``x`` is copied with ``.contiguous()`` first (a known limitation of this backend).
    ``_block`` / ``_iters`` override the tile size / tiles per program (tests only)."""
    info = _SINGLE_FAST.get(x.dtype) if type(x) is torch.Tensor else None
    if (info is not None and x.layout is torch.strided and not x.is_nested and x.is_contiguous() and not x.is_neg()
            and (x.is_cuda or (INTERPRETING and x.is_cpu))):
        t, (kind, acc64) = x, info  # read in place: the kernel needs its address, numel and dtype only
    else:
        t, kind, acc64 = _prepare(x, "nanscan.triton_summarize")
    out = torch.empty(RECORD_SIZE, dtype=torch.float64, device=t.device)
    return _summarize_prepared(t, kind, acc64, out, _block, _iters)


def _check_list(xs, op):
    xs = list(xs)
    for x in xs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: expected a list of torch.Tensor, got an element of type {type(x).__name__}")
    devices = {x.device for x in xs}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    return xs


def summarize_many(xs: list) -> torch.Tensor:
    """Float64 ``[len(xs), RECORD_SIZE]`` records, one row per tensor, on the tensors' (common) device.

    On CUDA this is the pointer-table path (``_summarize_many_table``): one stage-1 launch per
    (element kind, alignment) group and one stage-2 launch for all tensors, no host sync. Under
    ``TRITON_INTERPRET=1``, and during CUDA graph capture (the table is built on the host per call,
    in a temporary pinned buffer that a captured copy would re-read at every replay after it was
    freed), it is a Python loop of two launches per tensor writing rows of the output. An empty list
    gives a ``[0, RECORD_SIZE]`` CPU tensor."""
    op = "nanscan.triton_summarize_many"
    xs = list(xs)
    if not xs:
        return torch.empty((0, RECORD_SIZE), dtype=torch.float64)
    first = xs[0]
    if (not isinstance(first, torch.Tensor) or INTERPRETING or first.device.type != "cuda"
            or _capturing(first.device)):
        xs = _check_list(xs, op)
        prepared = [_prepare(x, op) for x in xs]  # validate everything before launching anything
        out = torch.empty((len(xs), RECORD_SIZE), dtype=torch.float64, device=prepared[0][0].device)
        for row, (t, kind, acc64) in zip(out, prepared):
            _summarize_prepared(t, kind, acc64, row)
        return out
    return _summarize_many_table(xs)


# The pointer table's fast path (_table_host). A plain tensor (not a subclass: a DTensor's or a fake
# tensor's data pointer is not its values) that is strided, contiguous, not nested and carries no
# negative bit is read in place by the kernels, so its entry is its address and numel -- none of
# _prepare's validation, detach, reshape and views (8 - 15 us of Python per tensor, most of
# summarize_many's host time for a model's parameters). Every other tensor takes _prepare.
_FAST_TYPES = frozenset([torch.Tensor, torch.nn.Parameter])
# Every (kind, acc64, pointer code, element size) a tensor can be read as -- its launch group but for
# alignment --, numbered so that the table's per-tensor arithmetic runs on small ints. (_prepare's
# conversions -- complex to real, bool / float8 to bytes, fp16 / bf16 to fp32 under the interpreter
# -- all end in one of these.)
_READ_KINDS = tuple(dict.fromkeys(
    (kind, acc64, _PTR_CODE[view_as or dtype], (view_as or dtype).itemsize)
    for dtype, (kind, acc64, view_as) in _DTYPE_INFO.items()))
_READ_KIND_ID = {key: i for i, key in enumerate(_READ_KINDS)}
# A launch group's key: 2 * read kind, + 1 if its addresses are not 16-byte aligned. Per key, the tile
# size and the float64-accumulation flag, as tables _table_host indexes (never written).
_NGROUPS = 2 * len(_READ_KINDS)
_GROUP_BLOCK = torch.tensor([_block_for(k[0], k[3]) for k in _READ_KINDS for _ in (0, 1)], dtype=torch.int64)
_GROUP_ACC = torch.tensor([int(k[1]) for k in _READ_KINDS for _ in (0, 1)], dtype=torch.int64)
# dtype -> 2 * read kind of the tensors the fast path takes; under the interpreter fp16 / bf16 are
# left to _prepare, which converts them (see the module docstring).
_FAST_DTYPES = {
    dtype: 2 * _READ_KIND_ID[(kind, acc64, _PTR_CODE[view_as or dtype], (view_as or dtype).itemsize)]
    for dtype, (kind, acc64, view_as) in _DTYPE_INFO.items()
    if not (INTERPRETING and dtype in (torch.float16, torch.bfloat16))
}
# dtype -> (kind, acc64) of the tensors ``summarize`` hands to the kernel as they are (a plain
# contiguous tensor on CUDA, or on the CPU under the interpreter, without a negative bit): those
# read as their own dtype (not bool / float8, which the kernel reads as bytes through a view).
_SINGLE_FAST = {dtype: (kind, acc64) for dtype, (kind, acc64, view_as) in _DTYPE_INFO.items()
                if view_as is None and dtype in _FAST_DTYPES}


def _entries(xs: list, op: str):
    """Validate ``xs`` and return what the pointer table needs of each tensor: ``(ptrs, numels,
    kind_keys, device, keep)`` -- data pointers, element counts, 2 * indices into _READ_KINDS,
    the common device, and the contiguous copies made for inputs that are not read in place
    (they must live until the launches are queued). Contiguous plain tensors take the fast path
    (see _FAST_TYPES); the rest, and every error, go through _prepare, in list order."""
    n = len(xs)
    ptrs, numels, kinds = [0] * n, [0] * n, [0] * n
    slow = []
    device = xs[0].device if n and isinstance(xs[0], torch.Tensor) else None
    fast = _FAST_DTYPES.get
    strided = torch.strided
    for i, x in enumerate(xs):
        key = fast(x.dtype) if type(x) in _FAST_TYPES else None
        if (key is not None and x.layout is strided and not x.is_nested and x.is_contiguous()
                and not x.is_neg() and x.device == device):
            ptrs[i] = x.data_ptr()
            numels[i] = x.numel()
            kinds[i] = key
        else:
            slow.append(i)
    if slow:
        _check_list(xs, op)  # a non-tensor, or tensors on several devices: the errors it always gave
    if device.type == "cpu" and not INTERPRETING:
        _prepare(xs[0], op)  # raises what the first tensor's preparation raised: a TypeError, or the CPU ValueError
    keep = []
    for i in slow:
        t, kind, acc64 = _prepare(xs[i], op)
        keep.append(t)
        ptrs[i] = t.data_ptr()
        numels[i] = t.numel()
        kinds[i] = 2 * _READ_KIND_ID[(kind, acc64, _PTR_CODE[t.dtype], t.element_size())]
    return ptrs, numels, kinds, device, keep


def _table_host(xs: list, op: str, block=None, iters=None):
    """The host side of ``_summarize_many_table``: validate ``xs`` (_entries), group the tensors
    and number their chunks, with nothing launched and nothing copied to the device.

    Returns ``(meta_host, plan, device, keep)``: the int64 table (data pointers, numels, first
    chunk and chunk count per tensor, float64-accumulation flags, then the owning tensor of every
    chunk), one ``((kind, acc64, code, aligned), first chunk, chunks, iters, block, options)`` per launch
    group, the common device, and _entries' copies.

    Groups are (read kind, 16-byte alignment), launched in the order of their key; every group's
    chunks are numbered consecutively in one global chunk space, its tensors in list order. The
    per-tensor arithmetic runs on small CPU tensors in a fixed number of operations (21 - 24 for
    one group, 28 - 32 for several: each costs 1 - 2 us, whatever the list length), and the
    per-tensor lists reach torch through one ``array`` (~12 - 45 ns an int; ``torch.tensor(list)``
    takes ~50 - 130)."""
    n = len(xs)
    ptrs, numels, kinds, device, keep = _entries(xs, op)
    cols = array("q", ptrs)
    cols.extend(numels)
    cols.extend(kinds)
    ptr_t, numel_t, kind_t = torch.frombuffer(cols, dtype=torch.int64).view(3, n).unbind()
    # (an empty tensor's key is whatever its address makes it: it has no blocks and no chunks, so it
    # never makes a group of its own, and its address is never read)
    group_t = (ptr_t & 15).clamp_(max=1).add_(kind_t)
    nblocks = (numel_t - 1).div_(_GROUP_BLOCK[group_t] if block is None else block, rounding_mode="floor").add_(1)
    per_group = torch.zeros(_NGROUPS, dtype=torch.int64).index_add_(0, group_t, nblocks).tolist()
    chunk_of = array("q", [1]) * _NGROUPS  # elements per chunk by group key (1: no group, no chunks)
    live = []
    for g, g_blocks in enumerate(per_group):
        if g_blocks:
            kind, acc64, code, size = _READ_KINDS[g >> 1]
            g_block = block or _block_for(kind, size)
            g_iters = iters or _iters_for(g_blocks)
            assert 1 <= g_iters <= _MAX_ITERS_PACKED and g_block % _UNROLL == 0, (g_iters, g_block)
            chunk_of[g] = g_block * g_iters
            live.append((g, (kind, acc64, code, g & 1 == 0), g_iters, g_block, _stage1_options(kind, size)))
    # chunks per tensor (ceil; 0 for an empty one): its blocks when chunks are one tile (lists of
    # small tensors). With one group, every tensor of another key is empty: its chunk length does
    # not matter, and the tensors need no reordering.
    if all(g_iters == 1 for _, _, g_iters, _, _ in live):
        nch = nblocks
    else:
        chunk = chunk_of[live[0][0]] if len(live) == 1 else torch.frombuffer(chunk_of, dtype=torch.int64)[group_t]
        nch = (numel_t - 1).div_(chunk, rounding_mode="floor").add_(1)
    order = torch.argsort(group_t, stable=True) if len(live) > 1 else None  # group order; list order within
    counts = nch if order is None else nch[order]
    ends = counts.cumsum(0)
    starts = ends - counts
    cbase = starts if order is None else torch.empty_like(starts).index_copy_(0, order, starts)
    total = int(ends[-1])
    # The owner of every chunk: the position (in group order) of its tensor is the number of
    # tensors that end at or before it. (Not repeat_interleave: on CPU it is a parallel_for with
    # grain 1, which waits for the thread pool even for a few thousand elements.)
    position = torch.bincount(ends[:-1], minlength=total)[:total].cumsum(0)
    owner = position if order is None else order[position]
    if len(live) > 1:
        group_chunks = torch.zeros(_NGROUPS, dtype=torch.int64).index_add_(0, group_t, nch).tolist()
    else:
        group_chunks = {g: total for g, *_ in live}
    plan, first = [], 0
    for g, key, g_iters, g_block, options in live:
        plan.append((key, first, group_chunks[g], g_iters, g_block, options))
        first += group_chunks[g]
    parts = [ptr_t, numel_t, cbase, nch, _GROUP_ACC[group_t], owner]
    if device.type == "cuda":  # built in pinned memory: the host-to-device copy is asynchronous
        meta_host = torch.cat(parts, out=torch.empty(5 * n + total, dtype=torch.int64, pin_memory=True))
    else:
        meta_host = torch.cat(parts)
    return meta_host, plan, device, keep


def _summarize_many_table(xs: list, *, _block=None, _iters=None) -> torch.Tensor:
    """Multi-tensor summarize through a pointer table (the CUDA path; also runs under the
    interpreter on CPU tensors, where the table holds host addresses).

    Tensors are grouped by (kind, accumulator, pointer element type, 16-byte alignment); all of a
    group's chunks are numbered consecutively in one global chunk space, so one stage-1 launch per
    group writes its partials and one stage-2 launch writes every record. The tables (data
    pointers, numels, first chunk and chunk count per tensor, float64-accumulation flags, and the
    owning tensor of every chunk) travel in one int64 host-to-device copy; ``_table_host`` builds
    them."""
    op = "nanscan.triton_summarize_many"
    xs = list(xs)
    if not xs:
        return torch.empty((0, RECORD_SIZE), dtype=torch.float64)
    # (_keep: the contiguous copies of inputs not read in place, alive until the launches are queued)
    meta_host, plan, device, _keep = _table_host(xs, op, _block, _iters)
    n = len(xs)
    total = sum(entry[2] for entry in plan)
    out = torch.empty((n, RECORD_SIZE), dtype=torch.float64, device=device)
    # (on CUDA meta_host is pinned, so the copy is truly asynchronous -- no wait on the stream; the
    # caching host allocator keeps the pinned block until the copy has completed)
    meta = meta_host.to(device, non_blocking=True)
    # The kernels get the whole table and its row length n, never slices: a slice at k * n int64
    # would be 16-byte aligned or not depending on the parity of n, and pointer alignment is part
    # of Triton's specialization key (one more compile per kernel for odd lists).

    rows = max(total, 1)
    part_i = torch.empty(5 * rows, dtype=torch.int64, device=device)
    part_f = torch.empty(5 * rows, dtype=torch.float64, device=device)
    with _device_guard(device):
        for (kind, acc64, code, aligned), start, count, iters, block, options in plan:
            _stage1_kernel[(count,)](
                meta, 0, iters, meta, n, start, part_i, part_f, rows,
                KIND=kind, ACC64=acc64, CODE=code, MULTI=True, ALIGNED=aligned, BLOCK=block, **options)
        _stage2_kernel[(n,)](
            part_i, part_f, rows, out, 0, 0, meta, n,
            MULTI=True, BLOCK2=_STAGE2_BLOCK, num_warps=_NUM_WARPS)
    # The tables, partials and any contiguous copies are freed on return; the caching allocator
    # only reuses their blocks for work queued later on the same stream, so the kernels are safe.
    return out

"""Triton kernels of the triton backend: the two stages that compute a record, and the constants
that they and their launcher (:mod:`nanscan.kernels.triton`, which validates inputs and launches
them) share.

Each record (float64 ``[10]``, layout in ``csrc/record.h`` / :mod:`nanscan.record`) is computed in two
deterministic stages, with no atomics:

stage 1 (``_stage1_kernel``)
    One program per *chunk* of a flattened contiguous tensor. A chunk is ``iters`` tiles of ``BLOCK``
    elements, a tile four 16-byte loads per thread (full tiles are loaded without a mask, so they
    vectorize; the rest of a chunk, < BLOCK elements, is read one masked load at a time), and
    writes one partial: nan / +inf / -inf / zero counts and the first non-finite index (int64),
    finite min, finite max and the sums of squares, values and fourth powers (stored as float64;
    min/max are exact, and the sums of a float32-accumulated chunk are float32 values, so they are
    stored exactly too). Like the CPU and CUDA kernels it assumes the chunk is clean and proves it
    afterwards: the fast pass keeps only the zero count, min / max (one lane per thread) and the
    three sums (one lane per element of a load: at most 256 elements each) of the raw values; a NaN
    or +-inf element turns its lane's sum of squares NaN or +inf, so only a chunk whose sum of
    squares is not finite (a non-finite element, or squares that overflowed) is read a second
    time, classifying every element (``_rescan``). With every element non-finite a chunk is read
    twice; integer chunks never are.
stage 2 (``_stage2_kernel``)
    One program per tensor combines that tensor's partials in a fixed order (counts in int64, the
    sums in float32 for 8/16/32-bit floating inputs, float64 otherwise) and writes the
    record with the raw conventions (min = +inf / max = -inf without a finite element, first = -1
    without a non-finite one).

Numerics: elements are compared, squared and summed in float32 for fp32 / fp16 / bf16 / float8 (so
``1e20**2`` is +inf and sumsq may be +inf from overflow, sum4 from ``|x|`` ~ 4.3e9), in float64 for
fp64, integer and bool inputs; the per-lane float32 order differs from torch's pairwise sum by a few
ulps * chunk length.
Integer inputs are converted to float64 in the kernel: ``finite_min`` / ``finite_max`` of int64
values with ``|x| > 2**53`` are rounded to the nearest float64 (as in every backend: records are
float64). Complex inputs are summarized as ``torch.view_as_real(x)``. float8 inputs
(e4m3fn, e5m2, e4m3fnuz, e5m2fnuz) are read as raw bytes and decoded in the kernel (no copy).

Launch parameters (_BLOCK_BY_ITEMSIZE, _NUM_WARPS, _UNROLL, _TARGET_PROGRAMS, _MAX_ITERS, _MAXNREG)
were chosen from register counts and instruction mixes of the kernels compiled ahead of time for
sm_90 (``benchmarks/triton_isa.py``, which also prints programs per SM and waves), not tuned by
measurement on a GPU.

The launch grid -- one program per chunk, occupancy, waves, what else was considered and why
fp16 / bf16 are capped at 64 registers -- is explained in csrc/README.md ("The Triton launch grid").
"""

import os

import torch
import triton
import triton.language as tl

from nanscan.record import RECORD_SIZE, Field  # RECORD_SIZE: float64 values per record (re-exported)

# Whether the kernels below are interpreted: triton.jit reads TRITON_INTERPRET when it decorates
# them, i.e. when this module is first imported, and so does this flag (tests/conftest.py sets it
# before that). The launcher uses and re-exports it.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_index_of_one_element_blocks() -> None:
    """Triton's interpreter runs scalars as 1-element numpy arrays; before triton 3.7 its
    ``tensor.__index__`` was ``int(data)``, which numpy >= 2.4 refuses for a 1-D array ("only
    0-dimensional arrays can be converted to Python scalars"), so ``range(0, n)`` over a computed
    bound fails under the interpreter (the GPU compile path is not affected). Triton 3.8 squeezes
    the array first; this gives older interpreters the same ``__index__``. Interpreter only."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without an interpreter module
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_nanscan_squeeze", False):
        return
    import inspect

    try:
        if "squeeze()" in inspect.getsource(original):  # triton >= 3.7: nothing to do
            return
    except (OSError, TypeError):  # pragma: no cover - no source: patch anyway, it is harmless
        pass

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._nanscan_squeeze = True
    interpreter._patch_lang_tensor = patched


if INTERPRETING:
    _interpreter_index_of_one_element_blocks()

# Stage 2 writes record t at out[10 * t : 10 * t + 10], the fields at these offsets (literals in the
# kernel: a jit function reads no plain global).
assert RECORD_SIZE == 10 and [int(f) for f in Field] == list(range(10)) and Field.SUM == 8 and Field.SUM4 == 9

# Element kinds (constexpr KIND of the stage-1 kernel).
_KIND_FLOAT = 0  # fp64 / fp32 / fp16 / bf16, loaded natively
_KIND_INT = 1  # bool (read as uint8) and integers: finite by definition, computed in float64
_KIND_E4M3FN = 2  # float8 formats, read as uint8 and decoded in the kernel
_KIND_E5M2 = 3
_KIND_E4M3FNUZ = 4
_KIND_E5M2FNUZ = 5

# Element type of the data pointers in the pointer table (constexpr CODE of the stage-1 kernel).
_PTR_CODE = {
    torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4,
    torch.int8: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8,
}

# dtype -> (kind, accumulate in float64, dtype the kernel reads the bytes as (None: itself))
_DTYPE_INFO = {
    torch.float64: (_KIND_FLOAT, True, None),
    torch.float32: (_KIND_FLOAT, False, None),
    torch.float16: (_KIND_FLOAT, False, None),
    torch.bfloat16: (_KIND_FLOAT, False, None),
    torch.bool: (_KIND_INT, True, torch.uint8),
    torch.uint8: (_KIND_INT, True, None),
    torch.int8: (_KIND_INT, True, None),
    torch.int16: (_KIND_INT, True, None),
    torch.int32: (_KIND_INT, True, None),
    torch.int64: (_KIND_INT, True, None),
}
for _name, _kind in (("float8_e4m3fn", _KIND_E4M3FN), ("float8_e5m2", _KIND_E5M2),
                     ("float8_e4m3fnuz", _KIND_E4M3FNUZ), ("float8_e5m2fnuz", _KIND_E5M2FNUZ)):
    if hasattr(torch, _name):
        _DTYPE_INFO[getattr(torch, _name)] = (_kind, False, torch.uint8)

# Launch configuration. A tile is _UNROLL = 4 loads per thread. For floating inputs (fp64 / fp32 /
# fp16 / bf16) each load is 16 bytes (a tile of 1024 / 2048 / 4096 elements with 4 warps), so
# every thread has 64 bytes in flight -- what a memory-bound scan needs outstanding to cover
# DRAM latency on H100 / H200; 16-32 bytes leave bandwidth unused. Integer, bool and float8 inputs
# cost 12-26 instructions per element (conversion to float64, software float8 decoding): they are
# bound by instruction issue, not by bandwidth, so they use 4 elements per load (_BLOCK_OTHER) and
# stay at the register count of the float kernels (64 one-byte elements per thread would need
# 150-190 registers). Chunks grow to up to _MAX_ITERS tiles so that very large tensors produce a
# few thousand partials (stage 2 reads them with one program per tensor) while mid-sized tensors
# still spread over >= _TARGET_PROGRAMS programs. Untuned on hardware: benchmarks/triton_isa.py
# shows registers and instruction mixes.
_NUM_WARPS = 4
_UNROLL = 4  # loads per thread per tile; the kernels spell the four loads out (_tile_fast)
_BLOCK_BY_ITEMSIZE = {s: _NUM_WARPS * 32 * _UNROLL * 16 // s for s in (8, 4, 2)}  # KIND_FLOAT
_BLOCK_OTHER = _NUM_WARPS * 32 * _UNROLL * 4
_TARGET_PROGRAMS = 2048
# Register cap (ptxas .maxnreg) of the stage-1 kernel per (kind, element size); none where absent.
# fp16 / bf16 tiles hold 32 elements per thread, and their three float32 sums 8 lanes each: uncapped
# they take 80 (fp16) / 71 (bf16) registers on triton 3.8, i.e. 6 / 7 programs per SM on sm_90 (a
# 4-warp program at 73-80 / 65-72 registers), 8 at <= 64. Capped at 64 they keep their fast loops
# (bf16 333 instructions, two more than uncapped; no spill inside) and spill two or three 32-bit
# values outside them (bf16: in the epilogue, once per chunk; fp16: also in the rescan's loop). See
# the launch-grid paragraph of the module docstring for why occupancy, and not the grid shape, moves
# the tail.
_MAXNREG = {(_KIND_FLOAT, 2): 64}
_MAX_ITERS = 64
# The rescan packs three per-lane counters into one int32, 10 bits each; a lane sees
# iters * _UNROLL elements of a chunk, so iters <= 255 keeps every field <= 1020.
_MAX_ITERS_PACKED = 1023 // _UNROLL
_STAGE2_BLOCK = 256

# Integer arguments that must not become part of a kernel's specialization key: Triton would
# otherwise compile one variant per value class (== 1, divisible by 16) of each. Table offsets in
# particular are integers here, not pointers into the middle of the table: a pointer's 16-byte
# alignment is part of the key, and slices at multiples of the list length change alignment with
# its parity (the even / odd recompile of issue 12). tests/test_triton.py recomputes the keys.
_STAGE1_DO_NOT_SPECIALIZE = ("numel", "iters", "meta_rows", "chunk_offset", "total")
_STAGE2_DO_NOT_SPECIALIZE = ("total", "nchunks", "acc64", "meta_rows")


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _as_ptr(raw, CODE: tl.constexpr, ALIGNED: tl.constexpr):
    """int64 address -> typed pointer (element type chosen by CODE, see _PTR_CODE). ALIGNED: the
    launcher checked address % 16 == 0; the hint lets full tiles use 128-bit loads. (It must be set
    here, on the cast itself: a hint on the value returned by a jit function is lost at inlining.)"""
    if CODE == 0:
        p = raw.to(tl.pointer_type(tl.float64))
    elif CODE == 1:
        p = raw.to(tl.pointer_type(tl.float32))
    elif CODE == 2:
        p = raw.to(tl.pointer_type(tl.float16))
    elif CODE == 3:
        p = raw.to(tl.pointer_type(tl.bfloat16))
    elif CODE == 4:
        p = raw.to(tl.pointer_type(tl.uint8))
    elif CODE == 5:
        p = raw.to(tl.pointer_type(tl.int8))
    elif CODE == 6:
        p = raw.to(tl.pointer_type(tl.int16))
    elif CODE == 7:
        p = raw.to(tl.pointer_type(tl.int32))
    else:
        p = raw.to(tl.pointer_type(tl.int64))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _decode_fp8(raw, KIND: tl.constexpr):
    """float8 bytes -> float32 values (NaN / +-inf where the format encodes them). Exact: normal
    values are rebuilt bit by bit as normal float32, subnormals as mantissa * 2**(1 - bias - M)."""
    u = raw.to(tl.int32)
    neg = (u & 128) != 0
    if KIND == 2:  # e4m3fn: bias 7, 3 mantissa bits, no inf, NaN = S.1111.111
        e = (u >> 3) & 15
        m = u & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # 2**-9
        isnan = (u & 127) == 127
        isinf = u < 0  # never
    elif KIND == 3:  # e5m2: bias 15, 2 mantissa bits, IEEE-style inf / NaN
        e = (u >> 2) & 31
        m = u & 3
        normal = (((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # 2**-16
        isnan = (e == 31) & (m != 0)
        isinf = (e == 31) & (m == 0)
    elif KIND == 4:  # e4m3fnuz: bias 8, no inf, no -0, NaN = 0x80
        e = (u >> 3) & 15
        m = u & 7
        normal = (((e + 119) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0009765625  # 2**-10
        isnan = u == 128
        isinf = u < 0  # never
    else:  # e5m2fnuz: bias 16, no inf, no -0, NaN = 0x80
        e = (u >> 2) & 31
        m = u & 3
        normal = (((e + 111) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.00000762939453125  # 2**-17
        isnan = u == 128
        isinf = u < 0  # never
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where(isinf, float("inf"), mag)
    mag = tl.where(isnan, float("nan"), mag)
    # The sign as a bit, not `-mag`: negating 0.0 must give -0.0, which some Triton interpreters
    # (3.6: 0 - x) do not.
    sign = neg.to(tl.int32) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _load(p, loc, rem, MASKED: tl.constexpr):
    """Raw elements p[loc]; with MASKED, lanes with loc >= rem read 0 (which every kernel below
    then masks out of the zero count and min / max; 0 adds nothing to a sum of squares)."""
    if MASKED:
        raw = tl.load(p + loc, mask=loc < rem, other=0)
    else:
        raw = tl.load(p + loc)
    return raw


@triton.jit
def _value(raw, KIND: tl.constexpr, ACC64: tl.constexpr):
    """Raw elements -> the compute type: float64 for fp64 and integers, float32 otherwise (float8
    decoded exactly, see _decode_fp8)."""
    if KIND == 0:
        if ACC64:
            v = raw.to(tl.float64)
        else:
            v = raw.to(tl.float32)
    elif KIND == 1:
        v = raw.to(tl.float64)
    else:
        v = _decode_fp8(raw, KIND)
    return v


@triton.jit
def _min_select(a, b):
    return tl.where(b < a, b, a)


@triton.jit
def _max_select(a, b):
    return tl.where(b > a, b, a)


@triton.jit
def _fold_fast(v, loc, rem, zeros, vmin, vmax, vss, vsum, vs4, MASKED: tl.constexpr, PT: tl.constexpr,
               FOLD_SUMS: tl.constexpr):
    """Fast path for one load: zeros += [v = 0], vmin = min(vmin, v), vmax = max(vmax, v),
    vss += v * v, vsum += v, vs4 += (v * v) ** 2, with no classification.

    Lanes. The sums are kept per element lane (SUB lanes: a lane sees at most iters * 4 <= 256
    elements of a chunk, the FP32 blocks of the record contract). The zero count, min and max are
    exact whatever the order, so each thread first folds its PT consecutive elements of the load
    (in registers: a reshape that keeps the thread's elements together) into one lane of SUB / PT:
    the same instructions per element, PT times fewer accumulator registers. FOLD_SUMS folds the
    sums too (float64 sums of integers, where no FP32 blocks apply).

    A NaN or +-inf element makes its lane's sum of squares NaN or +inf (its square is, and sums of
    non-negative numbers never go back to finite), so a chunk whose sum of squares is finite had
    no non-finite element and these min / max / sums are its finite min / max / sums (a sum of
    fourth powers may be +inf from overflow in a clean chunk: the rescan would say the same).
    Otherwise the chunk is rescanned (_rescan) and only the zero count of this pass is kept (NaN
    and +-inf are never 0, so it is exact either way)."""
    SUB: tl.constexpr = v.shape[0]
    iz = v == 0
    if MASKED:
        m = loc < rem
        iz = iz & m
        lo = tl.where(m, v, float("inf"))
        hi = tl.where(m, v, float("-inf"))
    else:
        lo = v
        hi = v
    zeros += tl.sum(tl.reshape(iz.to(tl.int32), [SUB // PT, PT]), axis=1)
    if v.dtype == tl.float64:
        # no float64 min / max instruction: minnum would cost a compare, two selects and a NaN
        # fix-up per element; a compare and a select are enough (NaN lanes are rescanned anyway)
        mn = tl.reduce(tl.reshape(lo, [SUB // PT, PT]), 1, _min_select)
        mx = tl.reduce(tl.reshape(hi, [SUB // PT, PT]), 1, _max_select)
        vmin = tl.where(mn < vmin, mn, vmin)
        vmax = tl.where(mx > vmax, mx, vmax)
    else:
        vmin = tl.minimum(vmin, tl.min(tl.reshape(lo, [SUB // PT, PT]), axis=1))
        vmax = tl.maximum(vmax, tl.max(tl.reshape(hi, [SUB // PT, PT]), axis=1))
    x2 = v * v
    if FOLD_SUMS:
        vss += tl.sum(tl.reshape(x2, [SUB // PT, PT]), axis=1)
        vsum += tl.sum(tl.reshape(v, [SUB // PT, PT]), axis=1)
        vs4 += tl.sum(tl.reshape(x2 * x2, [SUB // PT, PT]), axis=1)
    else:
        vss += x2
        vsum += v
        vs4 += x2 * x2
    return zeros, vmin, vmax, vss, vsum, vs4


@triton.jit
def _tile_fast(p, base, rem, zeros, vmin, vmax, vss, vsum, vs4,
               KIND: tl.constexpr, ACC64: tl.constexpr, BLOCK: tl.constexpr, PT: tl.constexpr):
    """Fold the full tile p[base : base + BLOCK] into the per-lane fast-path accumulators (BLOCK / 4
    lanes). The four loads are issued before any of them is used: each thread then has four
    16-byte loads (64 bytes) in flight."""
    SUB: tl.constexpr = BLOCK // 4
    l0 = base + tl.arange(0, SUB)
    l1 = l0 + SUB
    l2 = l1 + SUB
    l3 = l2 + SUB
    r0 = _load(p, l0, rem, False)
    r1 = _load(p, l1, rem, False)
    r2 = _load(p, l2, rem, False)
    r3 = _load(p, l3, rem, False)
    zeros, vmin, vmax, vss, vsum, vs4 = _fold_fast(_value(r0, KIND, ACC64), l0, rem, zeros, vmin, vmax, vss, vsum,
                                                   vs4, False, PT, KIND == 1)
    zeros, vmin, vmax, vss, vsum, vs4 = _fold_fast(_value(r1, KIND, ACC64), l1, rem, zeros, vmin, vmax, vss, vsum,
                                                   vs4, False, PT, KIND == 1)
    zeros, vmin, vmax, vss, vsum, vs4 = _fold_fast(_value(r2, KIND, ACC64), l2, rem, zeros, vmin, vmax, vss, vsum,
                                                   vs4, False, PT, KIND == 1)
    zeros, vmin, vmax, vss, vsum, vs4 = _fold_fast(_value(r3, KIND, ACC64), l3, rem, zeros, vmin, vmax, vss, vsum,
                                                   vs4, False, PT, KIND == 1)
    return zeros, vmin, vmax, vss, vsum, vs4


@triton.jit
def _fold_classify(v, loc, rem, counts, vmin, vmax, vss, vsum, vs4, vfirst, MASKED: tl.constexpr,
                   PT: tl.constexpr):
    """Rescan of one load: classify every element. counts packs three per-lane counters into one
    int32 (bits 0-9 NaN, 10-19 +inf, 20-29 -inf; a lane sees iters * 4 <= 1020 elements per
    chunk); vmin / vmax / vss / vsum / vs4 skip non-finite elements; vfirst is the smallest chunk-local index
    of a non-finite element (2**31 - 1: none). Masked lanes hold 0: finite, and excluded from
    min / max. vmin / vmax / vfirst keep one lane per thread (PT elements, as in _fold_fast)."""
    SUB: tl.constexpr = v.shape[0]
    isnan = v != v
    ispinf = v == float("inf")
    isninf = v == float("-inf")
    nonfinite = isnan | ispinf | isninf
    if MASKED:
        skip = nonfinite | (loc >= rem)
    else:
        skip = nonfinite
    vmin = tl.minimum(vmin, tl.min(tl.reshape(tl.where(skip, float("inf"), v), [SUB // PT, PT]), axis=1))
    vmax = tl.maximum(vmax, tl.max(tl.reshape(tl.where(skip, float("-inf"), v), [SUB // PT, PT]), axis=1))
    fv = tl.where(nonfinite, 0.0, v)
    x2 = fv * fv
    vss += x2
    vsum += fv
    vs4 += x2 * x2
    counts += isnan.to(tl.int32) | (ispinf.to(tl.int32) << 10) | (isninf.to(tl.int32) << 20)
    vfirst = tl.minimum(vfirst, tl.min(tl.reshape(tl.where(nonfinite, loc, 2147483647), [SUB // PT, PT]), axis=1))
    return counts, vmin, vmax, vss, vsum, vs4, vfirst


@triton.jit
def _combine_fast(z0, mn0, mx0, ss0, s0, s40, z1, mn1, mx1, ss1, s1, s41):
    """Combine of the fast pass's per-lane (zero count, min, max, sums of squares, values, fourth
    powers)."""
    return z0 + z1, tl.minimum(mn0, mn1), tl.maximum(mx0, mx1), ss0 + ss1, s0 + s1, s40 + s41


@triton.jit
def _accumulators(ACC64: tl.constexpr, SUB: tl.constexpr, LANES: tl.constexpr = 0):
    """Identities of min / max (LANES lanes; SUB when 0) and of the sums of squares, values and fourth
    powers (SUB lanes) in the compute type."""
    N: tl.constexpr = SUB if LANES == 0 else LANES
    if ACC64:
        vmin = tl.full([N], float("inf"), tl.float64)
        vmax = tl.full([N], float("-inf"), tl.float64)
        vss = tl.zeros([SUB], tl.float64)
    else:
        vmin = tl.full([N], float("inf"), tl.float32)
        vmax = tl.full([N], float("-inf"), tl.float32)
        vss = tl.zeros([SUB], tl.float32)
    return vmin, vmax, vss, vss, vss


@triton.jit
def _rescan(p, start, rem, n_subs, KIND: tl.constexpr, ACC64: tl.constexpr, SUB: tl.constexpr, PT: tl.constexpr):
    """Second pass over a chunk the fast path saw a non-finite value (or an overflowing square)
    in: (nan, +inf, -inf) counts, finite min / max / sums of squares, values and fourth powers,
    and the first non-finite index (global, int64; INT64_MAX: none) of elements p[0 : rem],
    p = chunk start, in n_subs loads of SUB elements. One load per iteration: this path is rare,
    and its seven per-lane accumulators would otherwise raise the register count (and lower the
    occupancy) of the whole kernel, fast path included."""
    counts = tl.zeros([SUB], tl.int32)
    vfirst = tl.full([SUB // PT], 2147483647, tl.int32)
    vmin, vmax, vss, vsum, vs4 = _accumulators(ACC64, SUB, SUB // PT)
    n_full = rem // SUB
    for j in range(0, n_full):
        loc = j * SUB + tl.arange(0, SUB)
        counts, vmin, vmax, vss, vsum, vs4, vfirst = _fold_classify(
            _value(_load(p, loc, rem, False), KIND, ACC64), loc, rem, counts, vmin, vmax, vss, vsum, vs4, vfirst,
            False, PT)
    for j in range(n_full, n_subs):  # at most one partial load
        loc = j * SUB + tl.arange(0, SUB)
        counts, vmin, vmax, vss, vsum, vs4, vfirst = _fold_classify(
            _value(_load(p, loc, rem, True), KIND, ACC64), loc, rem, counts, vmin, vmax, vss, vsum, vs4, vfirst,
            True, PT)
    f = tl.min(vfirst, axis=0)
    first = tl.where(f == 2147483647, 9223372036854775807, start + f.to(tl.int64))
    return (tl.sum(counts & 1023, axis=0).to(tl.int64), tl.sum((counts >> 10) & 1023, axis=0).to(tl.int64),
            tl.sum(counts >> 20, axis=0).to(tl.int64), tl.min(vmin, axis=0), tl.max(vmax, axis=0),
            tl.sum(vss, axis=0), tl.sum(vsum, axis=0), tl.sum(vs4, axis=0), first)


# Expected instruction mix of the clean fast path, measured statically (no GPU): the kernel
# compiled ahead of time for sm_90, SASS of its full-tile loop, `.venv/bin/python -m
# benchmarks.triton_isa` (triton 3.8):
#   dtype  instructions / element  registers  bytes in flight / thread
#   fp32       10.1                 46         64
#   bf16       10.4                 64         64   (71 without the maxnreg=64 cap)
#   fp16       10.2                 64         64   (80 without the cap)
#   fp64       14.8                 46         64
# (A kernel that classifies every element takes 24 - 42 instructions per element: `--rev 8e80e4b`
# compiles one.) fp32 per 16 elements: 4 LDG.128, 32 FMNMX (min, max: 4 per thread's 4 elements and
# its lane), 32 FFMA + 16 FMUL (squares and fourth powers), 16 FADD (sum), 16 FSETP + 16 SEL + ~24
# integer instructions (the zero count, addresses) and ~5 of loop control. The masked rest of a
# chunk (< BLOCK elements) and the rescan are separate loops.
@triton.jit(do_not_specialize=_STAGE1_DO_NOT_SPECIALIZE)
def _stage1_kernel(x_ptr, numel, iters, meta, meta_rows, chunk_offset, part_i, part_f, total,
                   KIND: tl.constexpr, ACC64: tl.constexpr, CODE: tl.constexpr,
                   MULTI: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One partial per chunk of iters * BLOCK elements, in two passes like the CPU and CUDA
    kernels: a fast pass that only keeps the zero count and per-lane min / max / sums (of squares,
    values, fourth powers),
    then -- only in a chunk whose sum of squares came out NaN or +inf, i.e. that held a NaN /
    +-inf element or whose squares overflowed -- a rescan of that chunk that classifies every
    element (_rescan). Integers are finite: no rescan.

    Single tensor (MULTI=False): x_ptr / numel describe it, chunk = program id.
    Multi-tensor (MULTI=True): meta is the int64 table of the launcher's _summarize_many_table,
    meta_rows its row length (the number of tensors); global chunk gid = chunk_offset + program id,
    t = meta[5 * meta_rows + gid] its tensor, whose data pointer is meta[t], element count
    meta[meta_rows + t] and first global chunk meta[2 * meta_rows + t]. Partials are stored
    struct-of-arrays with row stride `total`: part_i[k * total + gid] (k: nan, +inf, -inf, zero,
    first) and part_f[k * total + gid] (k: min, max, sumsq, sum, sum4).

    Every element index and offset is int64 (tensors may have more than 2**31 elements); only
    chunk-local indices, < iters * BLOCK < 2**31, are int32.
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk = iters.to(tl.int64) * BLOCK
    total64 = total.to(tl.int64)
    if MULTI:
        rows = meta_rows.to(tl.int64)
        gid = chunk_offset.to(tl.int64) + pid
        t = tl.load(meta + 5 * rows + gid)
        p0 = _as_ptr(tl.load(meta + t), CODE, ALIGNED)
        n = tl.load(meta + rows + t)
        start = (gid - tl.load(meta + 2 * rows + t)) * chunk
    else:
        gid = pid
        p0 = x_ptr
        n = numel.to(tl.int64)
        start = pid * chunk
    p = p0 + start
    rem = tl.minimum(n - start, chunk)  # 1 <= rem <= chunk
    SUB: tl.constexpr = BLOCK // 4  # elements per load (16 bytes per thread)
    rem32 = rem.to(tl.int32)
    n_full = rem32 // BLOCK  # full tiles
    n_subs = (rem32 + SUB - 1) // SUB  # loads, the last one partial when SUB does not divide rem

    # PT: elements per thread in one load (SUB / (32 * _NUM_WARPS), 1 for the tests' small tiles);
    # the zero count, min and max keep one lane per thread (see _fold_fast), integer sums too
    PT: tl.constexpr = (SUB + 127) // 128
    LANES: tl.constexpr = SUB // PT
    SUM_LANES: tl.constexpr = LANES if KIND == 1 else SUB
    zeros = tl.zeros([LANES], tl.int32)
    vmin, vmax, vss, vsum, vs4 = _accumulators(ACC64, SUM_LANES, LANES)
    for i in range(0, n_full):
        zeros, vmin, vmax, vss, vsum, vs4 = _tile_fast(p, i * BLOCK, rem32, zeros, vmin, vmax, vss, vsum, vs4,
                                                       KIND, ACC64, BLOCK, PT)
    # the rest, < BLOCK elements, one masked load at a time (at most four; one load's registers)
    for j in range(n_full * 4, n_subs):
        loc = j * SUB + tl.arange(0, SUB)
        zeros, vmin, vmax, vss, vsum, vs4 = _fold_fast(_value(_load(p, loc, rem32, True), KIND, ACC64), loc, rem32,
                                                       zeros, vmin, vmax, vss, vsum, vs4, True, PT, KIND == 1)
    if KIND != 1:  # each thread's sums of its PT lanes, in lane order (registers only)
        vss = tl.sum(tl.reshape(vss, [LANES, PT]), axis=1)
        vsum = tl.sum(tl.reshape(vsum, [LANES, PT]), axis=1)
        vs4 = tl.sum(tl.reshape(vs4, [LANES, PT]), axis=1)

    # one reduction of the six accumulators together: one round trip through shared memory (two
    # barriers) instead of six; the sums' order (in-thread, then the same butterfly and cross-warp
    # tree as tl.sum) is a function of BLOCK and _NUM_WARPS only
    nz32, mn, mx, ss, s1, s4 = tl.reduce((zeros, vmin, vmax, vss, vsum, vs4), 0, _combine_fast)
    n_zero = nz32.to(tl.int64)
    n_nan = n_zero * 0
    n_pinf = n_nan
    n_ninf = n_nan
    first = n_nan + 9223372036854775807
    if KIND != 1:
        # ss >= 0 is a sum of squares: it is NaN or +inf iff some lane saw a non-finite element
        # or an overflow (then the rescan's sum is +inf too). Once per chunk; rarely taken.
        if (ss != ss) | (ss == float("inf")):
            n_nan, n_pinf, n_ninf, mn, mx, ss, s1, s4, first = _rescan(p, start, rem32, n_subs, KIND, ACC64, SUB,
                                                                       PT)
    tl.store(part_i + gid, n_nan)
    tl.store(part_i + total64 + gid, n_pinf)
    tl.store(part_i + 2 * total64 + gid, n_ninf)
    tl.store(part_i + 3 * total64 + gid, n_zero)
    tl.store(part_i + 4 * total64 + gid, first)
    tl.store(part_f + gid, mn.to(tl.float64))
    tl.store(part_f + total64 + gid, mx.to(tl.float64))
    tl.store(part_f + 2 * total64 + gid, ss.to(tl.float64))
    tl.store(part_f + 3 * total64 + gid, s1.to(tl.float64))
    tl.store(part_f + 4 * total64 + gid, s4.to(tl.float64))


@triton.jit(do_not_specialize=_STAGE2_DO_NOT_SPECIALIZE)
def _stage2_kernel(part_i, part_f, total, out, nchunks, acc64, meta, meta_rows,
                   MULTI: tl.constexpr, BLOCK2: tl.constexpr):
    """Record of tensor t = program id from its partials [base, base + n), combined in a fixed order.
    Single tensor (MULTI=False): base 0, n = nchunks, float64 sums iff acc64 != 0.
    Multi-tensor: base = meta[2 * meta_rows + t], n = meta[3 * meta_rows + t], float64 sums iff
    meta[4 * meta_rows + t] != 0 (see _stage1_kernel)."""
    t = tl.program_id(0).to(tl.int64)
    total64 = total.to(tl.int64)
    if MULTI:
        rows = meta_rows.to(tl.int64)
        base = tl.load(meta + 2 * rows + t)
        n = tl.load(meta + 3 * rows + t)
        a64 = tl.load(meta + 4 * rows + t)
    else:
        base = t * 0
        n = nchunks.to(tl.int64)
        a64 = acc64.to(tl.int64)

    s_nan = tl.zeros([BLOCK2], tl.int64)
    s_pinf = tl.zeros([BLOCK2], tl.int64)
    s_ninf = tl.zeros([BLOCK2], tl.int64)
    s_zero = tl.zeros([BLOCK2], tl.int64)
    vfirst = tl.full([BLOCK2], 9223372036854775807, tl.int64)
    vmin = tl.full([BLOCK2], float("inf"), tl.float64)
    vmax = tl.full([BLOCK2], float("-inf"), tl.float64)
    ss32 = tl.zeros([BLOCK2], tl.float32)
    ss64 = tl.zeros([BLOCK2], tl.float64)
    s1_32 = tl.zeros([BLOCK2], tl.float32)
    s1_64 = tl.zeros([BLOCK2], tl.float64)
    s4_32 = tl.zeros([BLOCK2], tl.float32)
    s4_64 = tl.zeros([BLOCK2], tl.float64)
    for c in range(0, n, BLOCK2):
        idx = c + tl.arange(0, BLOCK2)
        m = idx < n
        g = base + idx
        s_nan += tl.load(part_i + g, mask=m, other=0)
        s_pinf += tl.load(part_i + total64 + g, mask=m, other=0)
        s_ninf += tl.load(part_i + 2 * total64 + g, mask=m, other=0)
        s_zero += tl.load(part_i + 3 * total64 + g, mask=m, other=0)
        vfirst = tl.minimum(vfirst, tl.load(part_i + 4 * total64 + g, mask=m, other=9223372036854775807))
        vmin = tl.minimum(vmin, tl.load(part_f + g, mask=m, other=float("inf")))
        vmax = tl.maximum(vmax, tl.load(part_f + total64 + g, mask=m, other=float("-inf")))
        ss = tl.load(part_f + 2 * total64 + g, mask=m, other=0.0)
        ss32 += ss.to(tl.float32)  # exact: float32-accumulated partials are float32 values
        ss64 += ss
        s1 = tl.load(part_f + 3 * total64 + g, mask=m, other=0.0)
        s1_32 += s1.to(tl.float32)
        s1_64 += s1
        s4 = tl.load(part_f + 4 * total64 + g, mask=m, other=0.0)
        s4_32 += s4.to(tl.float32)
        s4_64 += s4

    first = tl.min(vfirst, axis=0)
    o = out + t * 10  # RECORD_SIZE; the offsets below are the fields of nanscan.record.Field
    tl.store(o, tl.sum(s_nan, axis=0).to(tl.float64))
    tl.store(o + 1, tl.sum(s_pinf, axis=0).to(tl.float64))
    tl.store(o + 2, tl.sum(s_ninf, axis=0).to(tl.float64))
    tl.store(o + 3, tl.sum(s_zero, axis=0).to(tl.float64))
    tl.store(o + 4, tl.min(vmin, axis=0))
    tl.store(o + 5, tl.max(vmax, axis=0))
    tl.store(o + 6, tl.where(a64 != 0, tl.sum(ss64, axis=0), tl.sum(ss32, axis=0).to(tl.float64)))
    tl.store(o + 7, tl.where(first == 9223372036854775807, -1.0, first.to(tl.float64)))
    tl.store(o + 8, tl.where(a64 != 0, tl.sum(s1_64, axis=0), tl.sum(s1_32, axis=0).to(tl.float64)))
    tl.store(o + 9, tl.where(a64 != 0, tl.sum(s4_64, axis=0), tl.sum(s4_32, axis=0).to(tl.float64)))

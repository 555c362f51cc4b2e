"""The Triton kernels against the pure-PyTorch reference, on small shapes.

Without a GPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported), so shapes stay small. Besides the public ``summarize`` /
``summarize_many`` these tests drive the pointer-table multi-tensor path (``_summarize_many_table``,
the CUDA implementation of ``summarize_many``: under the interpreter its "device" pointers are CPU
addresses) and small tile / chunk overrides so that multi-tile chunks, masked tails and the
chunk-combining stage are exercised at these sizes. The last section checks the two-pass stage 1
(a fast pass per chunk, a rescan only of chunks with a NaN / +-inf or an overflowing square: under
the interpreter the tests count the rescans), 64-bit offsets, and that the multi-tensor launches'
specialization keys do not depend on the list length. The host-work section counts launches per
call (by wrapping the kernels the launcher launches through, as benchmarks/triton_host.py does),
checks the pointer table's invariants and the in-place reads of ``summarize`` (bit for bit those
of the prepared path).
"""
import math
import operator

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nanscan.kernels import reference  # noqa: E402
from nanscan.kernels import triton as tk  # noqa: E402  (the launcher)
from nanscan.kernels import triton_kernels as kern  # noqa: E402  (the kernels and their constants)
from tests.helpers import VALUE_KINDS, assert_record_matches, cast, layouts, special_values, stable_seed  # noqa: E402

DEVICE = "cpu" if tk.INTERPRETING else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton without TRITON_INTERPRET=1 needs a CUDA device", allow_module_level=True)

FLOAT8_ALL = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
              if hasattr(torch, n)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool, torch.complex64,
          *FLOAT8_ALL[:2]]
SIZES = [1, 7, 5000]  # 5000 crosses the default 1024-element tile several times
INF, NAN = float("inf"), float("nan")

# The interpreter evaluates the kernels with numpy, which warns where float32 squares overflow, where
# the fast path's sum adds +inf and -inf, and (triton 3.6) where its min / max reduce lanes that are
# all NaN (such a chunk is rescanned; the fast path's min / max / sums are discarded).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def check(x, got=None, what=""):
    got = tk.summarize(x) if got is None else got
    assert got.dtype == torch.float64 and got.shape == (kern.RECORD_SIZE,) and got.device == x.device
    assert_record_matches(got, reference.summarize(x), x, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", VALUE_KINDS)
def test_matches_reference(dtype, kind):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), kind))
    for n in SIZES:
        x = cast(special_values(kind, n, gen), dtype).to(DEVICE)
        check(x, what=f"n={n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64], ids=str)
def test_multi_tile_chunks(dtype):
    """Tiles of 64 elements, 3 tiles per chunk: full and masked tiles, several chunks, the first
    non-finite index in a later chunk / tile, and combining partials in stage 2."""
    gen = torch.Generator().manual_seed(1)
    v = special_values("random", 1000, gen)
    if dtype.is_floating_point:
        v[[700, 191, 192, 999]] = torch.tensor([NAN, INF, -INF, NAN], dtype=torch.float64)
        v[[5, 6]] = torch.tensor([0.0, -0.0], dtype=torch.float64)
    x = cast(v, dtype).to(DEVICE)
    for n in (1000, 192, 193, 191, 64, 63, 1):
        xs = x[:n]
        assert_record_matches(tk.summarize(xs, _block=64, _iters=3), reference.summarize(xs), xs, f"n={n}")


@pytest.mark.parametrize(("fill", "iters", "chunks"), [(NAN, 127, 2), (0.0, 127, 2), (-INF, 127, 2),
                                                      (NAN, 255, 1), (INF, 255, 1), (-INF, 255, 1)])
def test_packed_counters_do_not_overflow(fill, iters, chunks):
    """Up to 255 tiles per chunk (kern._MAX_ITERS_PACKED, the most the rescan's packed per-lane
    counters allow: 4 * 255 elements per lane), every element counted."""
    assert kern._MAX_ITERS_PACKED == 255
    x = torch.full((16 * iters * chunks + 5,), fill, device=DEVICE)
    assert_record_matches(tk.summarize(x, _block=16, _iters=iters), reference.summarize(x), x)


@pytest.mark.parametrize("dtype", FLOAT8_ALL, ids=str)
def test_float8_decoding_is_exact(dtype):
    """Every byte pattern decodes bit-exactly as torch's float8 -> float32 conversion."""

    @triton.jit
    def decode(src, dst, KIND: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, kern._decode_fp8(tl.load(src + offs), KIND))

    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    decode[(1,)](raw, out, KIND=kern._DTYPE_INFO[dtype][0])
    want = raw.view(dtype).float()
    same = (out.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(out) & torch.isnan(want))
    assert bool(same.all()), [(i, out[i].item(), want[i].item()) for i in torch.nonzero(~same).flatten().tolist()]
    check(raw.view(dtype), what="all bytes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.complex64], ids=str)
def test_layouts(dtype):
    """Non-contiguous inputs (copied by this backend) keep the logical row-major first index."""
    gen = torch.Generator().manual_seed(2)
    v = special_values("random", 1200, gen)
    v[[77, 301, 1100]] = torch.tensor([INF, NAN, -INF], dtype=torch.float64)
    base = cast(v, dtype).to(DEVICE)
    for name, view in layouts(base):
        check(view, what=name)


def test_transposed_first_index_is_logical():
    x = torch.zeros(4, 6, device=DEVICE)
    x[3, 0] = NAN  # storage index 18
    x[0, 2] = INF  # storage index 2
    # x.t()[0, 3] is storage 18, x.t()[2, 0] is storage 2: logical order puts the NaN (index 3) first
    rec = tk.summarize(x.t())
    assert rec[7].item() == 3.0
    check(x.t())


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.complex64], ids=str)
def test_empty(shape, dtype):
    x = torch.empty(shape, dtype=dtype, device=DEVICE)
    rec = tk.summarize(x)
    assert rec.tolist() == [0.0, 0.0, 0.0, 0.0, INF, -INF, 0.0, -1.0, 0.0, 0.0]
    check(x)


def test_zero_dim_and_special_cases():
    for value in (NAN, INF, -INF, 0.0, -0.0, 2.5, 1e20):
        check(torch.tensor(value, device=DEVICE), what=str(value))
    x = torch.full((100,), 1e20, device=DEVICE)
    rec = tk.summarize(x)
    f32 = torch.tensor(1e20, dtype=torch.float32).item()
    assert rec[6].item() == INF and rec[4].item() == rec[5].item() == f32  # fp32 square overflows
    assert rec[8].item() == pytest.approx(100 * f32, rel=1e-6) and rec[9].item() == INF  # the sum does not
    x64 = x.double()
    assert tk.summarize(x64)[6].item() == pytest.approx(100 * 1e40)  # fp64 does not
    big = torch.tensor([2**62 + 1, -(2**60), 3], dtype=torch.int64, device=DEVICE)
    check(big, what="int64 beyond 2**53")


def test_conjugate_and_negative_views():
    z = torch.randn(40, dtype=torch.complex64, device=DEVICE)
    z[7] = complex(1.0, INF)
    want = reference.summarize(z.conj().resolve_conj())
    assert_record_matches(tk.summarize(z.conj()), want, z)
    imag = z.conj().imag  # a negative-bit view
    assert imag.is_neg()
    assert_record_matches(tk.summarize(imag), reference.summarize(imag.resolve_neg()), imag)


def test_deterministic():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5000, generator=gen) * 1e3).to(DEVICE)
    a, b = tk.summarize(x), tk.summarize(x)
    assert torch.equal(a, b)


def mixed_list():
    gen = torch.Generator().manual_seed(4)
    xs = [
        cast(special_values("mixed", 5000, gen), torch.float32),
        torch.empty(0),
        cast(special_values("random", 21, gen), torch.float32).reshape(3, 7).t(),
        cast(special_values("nan_last", 1000, gen), torch.float64),
        cast(special_values("random", 300, gen), torch.int32),
        cast(special_values("random", 33, gen), torch.float32)[1:],  # data pointer not 16-byte aligned
        torch.tensor([1.0, NAN]),
        cast(special_values("mixed", 130, gen), FLOAT8_ALL[1] if len(FLOAT8_ALL) > 1 else torch.float16),
        cast(special_values("overflow_sumsq", 100, gen), torch.bfloat16),
        torch.tensor(3.0),
        cast(special_values("random", 64, gen), torch.bool),
        cast(special_values("mixed", 50, gen), torch.complex64),
        torch.empty(2, 0, dtype=torch.float64),
    ]
    return [x.to(DEVICE) for x in xs]


@pytest.mark.parametrize("impl", ["summarize_many", "table", "table_small_tiles"])
def test_summarize_many(impl):
    xs = mixed_list()
    if impl == "summarize_many":
        got = tk.summarize_many(xs)
    elif impl == "table":
        got = tk._summarize_many_table(xs)
    else:
        got = tk._summarize_many_table(xs, _block=32, _iters=2)
    assert got.dtype == torch.float64 and got.shape == (len(xs), kern.RECORD_SIZE) and got.device == xs[0].device
    for i, x in enumerate(xs):
        assert_record_matches(got[i], reference.summarize(x), x, f"row {i}")


class _Subclass(torch.Tensor):
    """A tensor subclass: its data pointer is not trusted to be its values (DTensor, fake tensors)."""


def fast_and_slow_list():
    """Tensors the pointer table reads in place (contiguous plain tensors of every read kind, at
    aligned and unaligned addresses) beside every kind it must not (views that are not contiguous,
    a negative bit, complex, fp16 under the interpreter, a subclass)."""
    gen = torch.Generator().manual_seed(5)
    base = cast(special_values("mixed", 400, gen), torch.float32).to(DEVICE)
    z = cast(special_values("mixed", 40, gen), torch.complex64).to(DEVICE)
    fast = [base[:100], base[1:97].reshape(8, 12), torch.nn.Parameter(base[100:200].clone()), base[:0],
            base[5].clone(), cast(special_values("nan_last", 70, gen), torch.float64).to(DEVICE),
            cast(special_values("random", 30, gen), torch.int32).to(DEVICE),
            cast(special_values("random", 30, gen), torch.bool).to(DEVICE),
            *[cast(special_values("mixed", 40, gen), d).to(DEVICE) for d in FLOAT8_ALL]]
    slow = [base[:96].reshape(8, 12).t(), base[::3], z, z.conj().imag, base[200:240].as_subclass(_Subclass)]
    if tk.INTERPRETING:
        slow.append(cast(special_values("mixed", 40, gen), torch.float16).to(DEVICE))
    else:
        fast.append(cast(special_values("mixed", 40, gen), torch.float16).to(DEVICE))
    xs = [x for pair in zip(fast, slow + [None] * len(fast)) for x in pair if x is not None]
    return xs, slow


def test_table_reads_contiguous_tensors_without_preparing_them(monkeypatch):
    """The pointer table takes a contiguous plain tensor's address and numel directly: _prepare
    (8 - 15 us of Python per tensor) runs only for the tensors it must convert; the records are
    the reference's and bit for bit those of the path that prepares every tensor."""
    xs, slow = fast_and_slow_list()
    prepared = []
    real_prepare = tk._prepare

    def counting(x, op):
        prepared.append(x)
        return real_prepare(x, op)

    monkeypatch.setattr(tk, "_prepare", counting)
    got = tk._summarize_many_table(xs)
    assert [id(x) for x in prepared] == [id(x) for x in slow]
    for i, x in enumerate(xs):
        assert_record_matches(got[i], reference.summarize(x), x, f"row {i}")
    monkeypatch.setattr(tk, "_FAST_DTYPES", {})  # every tensor through _prepare
    assert torch.equal(tk._summarize_many_table(xs), got)
    assert len(prepared) == len(slow) + len(xs)


def test_table_of_thousands_of_tensors_is_the_prepared_one(monkeypatch):
    """2000 tensors (no launch: the host table only), contiguous ones at every 4-byte alignment
    among the others: the same table, plan and device with and without the fast path (but for
    the addresses of the copies that both make of the tensors that are not read in place)."""
    xs, slow = fast_and_slow_list()
    gen = torch.Generator().manual_seed(6)
    buffer = torch.randn(70000, generator=gen).to(DEVICE)
    xs = [buffer[k * 33:k * 33 + 1 + k % 70] if k % 7 else xs[k // 7 % len(xs)] for k in range(2000)]
    op = "nanscan.triton_summarize_many"
    meta, plan, device, copies = tk._table_host(xs, op)
    monkeypatch.setattr(tk, "_FAST_DTYPES", {})
    slow_meta, slow_plan, slow_device, _ = tk._table_host(xs, op)
    n = len(xs)
    in_place = torch.tensor([not any(x is y for y in slow) for x in xs])
    assert len(copies) == n - int(in_place.sum())
    assert torch.equal(meta[:n][in_place], slow_meta[:n][in_place])
    assert torch.equal(meta[n:], slow_meta[n:]) and plan == slow_plan and device == slow_device
    assert len({aligned for (_, _, _, aligned), *_ in plan}) == 2


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized / nested tensor creation warnings
def test_table_refuses_what_it_refused(monkeypatch):
    ok = torch.zeros(2, device=DEVICE)
    table = tk._summarize_many_table
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo .*supported: float64"):
        table([ok, ok.to_sparse()])
    with pytest.raises(TypeError, match="nested"):
        table([ok, torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]).to(DEVICE)])
    with pytest.raises(TypeError, match="quantized"):  # (quantized tensors live on the CPU)
        table([torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)])
    with pytest.raises(TypeError, match="expected a list of torch.Tensor, got an element of type str"):
        table([ok, "not a tensor"])
    with pytest.raises(ValueError, match="one device"):
        table([ok, torch.zeros(2, device="meta")])
    monkeypatch.setattr(tk, "INTERPRETING", False)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            table([ok, ok])


def test_summarize_many_edge_cases():
    assert tk.summarize_many([]).shape == (0, kern.RECORD_SIZE)
    assert tk._summarize_many_table([]).shape == (0, kern.RECORD_SIZE)
    empties = [torch.empty(0, device=DEVICE), torch.empty(0, 3, dtype=torch.int32, device=DEVICE)]
    assert tk._summarize_many_table(empties).tolist() == [[0.0, 0.0, 0.0, 0.0, INF, -INF, 0.0, -1.0, 0.0, 0.0]] * 2
    one = [torch.tensor([NAN, 1.0, -2.0], device=DEVICE)]
    assert torch.equal(tk.summarize_many(one)[0], tk.summarize(one[0]))
    with pytest.raises(ValueError, match="one device"):
        tk.summarize_many([torch.zeros(2, device=DEVICE), torch.zeros(2, device="meta")])


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized / nested tensor creation warnings
def test_rejects_unsupported_inputs():
    sparse = torch.zeros(3, 3, device=DEVICE).to_sparse()
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo .*supported: float64"):
        tk.summarize(sparse)
    with pytest.raises(TypeError, match=r"quantized"):
        tk.summarize(torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8))
    with pytest.raises(TypeError, match=r"nested"):
        tk.summarize(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]))
    for name in ("uint16", "float8_e8m0fnu"):
        if hasattr(torch, name):
            with pytest.raises(TypeError, match=rf"dtype torch\.{name} is not supported \(supported: "):
                tk.summarize(torch.zeros(4, dtype=torch.uint8).view(getattr(torch, name))[:1])
    with pytest.raises(TypeError, match=r"layout"):
        tk.summarize_many([torch.zeros(2, device=DEVICE), sparse])
    with pytest.raises(TypeError):
        tk.summarize_many([torch.zeros(2, device=DEVICE), "not a tensor"])


def test_cpu_tensor_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRETING", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tk.summarize(torch.zeros(3))


def test_record_roundtrip_sanity():
    x = torch.tensor([0.0, -0.0, 3.0, -4.0, NAN, INF, -INF, INF], device=DEVICE)
    rec = tk.summarize(x).tolist()
    assert rec[:4] == [1.0, 2.0, 1.0, 2.0]
    assert rec[4:6] == [-4.0, 3.0] and rec[6] == 25.0 and rec[7] == 4.0
    assert not any(math.isnan(v) for v in rec)


# --------------------------------------------------------------------------------------------------
# Fast path + rescan (issue 12): a chunk is rescanned only when its fast pass saw a non-finite value
# --------------------------------------------------------------------------------------------------

BLOCK, ITERS = 64, 2  # chunks of 128 elements: small tensors still cover many chunks
CHUNK = BLOCK * ITERS


@pytest.fixture
def rescans(monkeypatch):
    """For every rescan the kernels ran, the offset of its chunk in its tensor; None on a GPU. Under the
    interpreter a kernel looks its callees up in its module (triton_kernels) at every call, so a counting
    wrapper around ``kern._rescan`` sees each one."""
    if not tk.INTERPRETING:
        return None
    starts = []
    original = kern._rescan

    def counting(p, start, *args):
        starts.append(operator.index(start))
        return original(p, start, *args)

    monkeypatch.setattr(kern, "_rescan", counting)
    return starts


def chunks_needing_rescan(x, chunk=CHUNK):
    """Starts of the chunks of x (flat) that hold a NaN / +-inf or whose squares overflow."""
    flat = reference.normalize_input(x).reshape(-1)
    out = []
    for s in range(0, flat.numel(), chunk):
        rec = reference.summarize(flat[s:s + chunk])
        if rec[0] + rec[1] + rec[2] > 0 or math.isinf(rec[6].item()):
            out.append(s)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, FLOAT8_ALL[1]], ids=str)
@pytest.mark.parametrize("n", [1024, 1000])  # the last chunk full / partial (masked loads)
def test_nonfinite_in_last_chunk_only(dtype, n, rescans):
    gen = torch.Generator().manual_seed(stable_seed("last", str(dtype), n))
    v = special_values("random", n, gen)
    v[[n - 1, n - 30]] = torch.tensor([NAN, -INF], dtype=torch.float64)
    x = cast(v, dtype).to(DEVICE)
    assert_record_matches(tk.summarize(x, _block=BLOCK, _iters=ITERS), reference.summarize(x), x)
    if rescans is not None:
        assert rescans == [(n - 1) // CHUNK * CHUNK]  # the last chunk, and only it
    assert_record_matches(tk._summarize_many_table([x], _block=BLOCK, _iters=ITERS)[0], reference.summarize(x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_nonfinite_in_several_chunks_first_index_is_global(dtype, rescans):
    """Non-finite values in chunks 2, 5 and 7: the first index is the global minimum, although a
    later chunk holds one at a smaller chunk-local index (643 is local 3; 356 is local 100)."""
    gen = torch.Generator().manual_seed(5)
    v = special_values("random", 1000, gen)
    v[[356, 380, 643, 999]] = torch.tensor([INF, NAN, NAN, -INF], dtype=torch.float64)
    x = cast(v, dtype).to(DEVICE)
    rec = tk.summarize(x, _block=BLOCK, _iters=ITERS)
    assert rec[7].item() == 356.0
    assert_record_matches(rec, reference.summarize(x), x)
    if rescans is not None:
        assert rescans == [2 * CHUNK, 5 * CHUNK, 7 * CHUNK]
    rows = tk._summarize_many_table([x.flip(0), x], _block=BLOCK, _iters=ITERS)
    assert rows[1, 7].item() == 356.0 and rows[0, 7].item() == 0.0
    assert_record_matches(rows[0], reference.summarize(x.flip(0)), x)


NONFINITE_PATTERNS = [(dt, pat) for dt in (torch.float32, torch.float64, torch.bfloat16, *FLOAT8_ALL[:2])
                      for pat in ("nan", "inf", "cycle") if pat == "nan" or torch.tensor(INF).to(dt).float().isinf()]


@pytest.mark.parametrize(("dtype", "pattern"), NONFINITE_PATTERNS, ids=str)
def test_all_values_nonfinite(dtype, pattern, rescans):
    """Every chunk is rescanned; no finite element: min +inf, max -inf, sumsq 0, first index 0."""
    n = 1000
    if pattern == "cycle":
        v = torch.tensor([NAN, INF, -INF], dtype=torch.float64).repeat(n // 3 + 1)[:n]
    else:
        v = torch.full((n,), NAN if pattern == "nan" else INF, dtype=torch.float64)
    x = cast(v, dtype).to(DEVICE)
    want = reference.summarize(x)
    assert want[4].item() == INF and want[5].item() == -INF and want[7].item() == 0.0
    for got in (tk.summarize(x, _block=BLOCK, _iters=ITERS), tk.summarize(x)):
        assert_record_matches(got, want, x)
    if rescans is not None:
        assert rescans[: math.ceil(n / CHUNK)] == list(range(0, n, CHUNK))


def test_mixed_list_some_tensors_rescanned(rescans):
    """One multi-tensor launch group holds clean tensors (never rescanned) next to tensors with
    non-finite values or overflowing squares (only their affected chunks are rescanned); integers
    are finite and never rescanned."""
    gen = torch.Generator().manual_seed(6)

    def planted(n, dtype, where, values):
        v = special_values("random", n, gen)
        v[where] = torch.tensor(values, dtype=torch.float64)
        return cast(v, dtype)

    xs = [
        cast(special_values("random", 700, gen), torch.float32),  # clean, several chunks
        planted(700, torch.float32, [300, 310], [NAN, INF]),  # chunk 2 only
        cast(special_values("random", 300, gen), torch.float64),  # clean
        planted(300, torch.float64, [0], [-INF]),  # chunk 0
        cast(special_values("overflow_sumsq", 200, gen), torch.bfloat16),  # finite, squares overflow FP32
        cast(special_values("mixed", 500, gen), torch.int32),  # integers: never rescanned
        planted(257, torch.float32, [256], [NAN])[1:],  # not 16-byte aligned; NaN in the masked tail
        cast(special_values("random", 130, gen), torch.float32),  # clean, tail in the second chunk
        planted(130, FLOAT8_ALL[1], [129], [NAN]),  # float8: NaN decoded in the kernel
        cast(special_values("mixed", 1, gen), torch.float32),
    ]
    xs = [x.to(DEVICE) for x in xs]
    expected = sorted(s for x in xs if x.dtype.is_floating_point for s in chunks_needing_rescan(x))
    assert 4 <= len(expected) < sum(math.ceil(x.numel() / CHUNK) for x in xs) - 5  # some, not all
    for impl in ("table", "summarize_many"):
        if rescans is not None:
            rescans.clear()
        if impl == "table":
            got = tk._summarize_many_table(xs, _block=BLOCK, _iters=ITERS)
        else:  # default tiles: each tensor is one chunk
            got = tk.summarize_many(xs)
        for i, x in enumerate(xs):
            assert_record_matches(got[i], reference.summarize(x), x, f"{impl} row {i}")
        if rescans is not None and impl == "table":
            assert sorted(rescans) == expected


def test_offsets_beyond_2_31_elements():
    """64-bit offsets without 8 GiB: a tensor of 2**31 + 300 float32 elements whose data pointer
    lies 2**31 elements before a real 300-element buffer, of which stage 1 scans the last three
    chunks (through the table: its first-chunk entry is shifted so that those chunks are the
    launch's first). Any 32-bit offset or index would wrap and read or report the wrong place."""
    gen = torch.Generator().manual_seed(7)
    tail = special_values("random", 300, gen)
    tail[[7, 200]] = torch.tensor([NAN, -INF], dtype=torch.float64)
    buf = tail.float().to(DEVICE)
    big = 2**31 + 300
    skipped = 2**31 // CHUNK  # chunks before the buffer
    nch = 3
    rows = [buf.data_ptr() - 2**31 * buf.element_size(), big, -skipped, nch, 0] + [0] * nch
    meta = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    part_i = torch.empty(5 * nch, dtype=torch.int64, device=DEVICE)
    part_f = torch.empty(5 * nch, dtype=torch.float64, device=DEVICE)  # min, max, sumsq, sum, sum4
    kind, acc64, _ = kern._DTYPE_INFO[torch.float32]
    kern._stage1_kernel[(nch,)](meta, 0, ITERS, meta, 1, 0, part_i, part_f, nch, KIND=kind, ACC64=acc64,
                                CODE=kern._PTR_CODE[torch.float32], MULTI=True, ALIGNED=False, BLOCK=BLOCK,
                                num_warps=kern._NUM_WARPS)
    out = torch.empty(kern.RECORD_SIZE, dtype=torch.float64, device=DEVICE)
    kern._stage2_kernel[(1,)](part_i, part_f, nch, out, nch, 0, part_i, 0, MULTI=False,
                              BLOCK2=kern._STAGE2_BLOCK, num_warps=kern._NUM_WARPS)
    want = reference.summarize(buf)
    want[7] = 2**31 + 7
    assert part_i[4 * nch:].tolist() == [2**31 + 7, 2**31 + 200, 2**63 - 1]
    assert_record_matches(out, want, buf)


class _SpecializationRecorder:
    """Stands in for a kernel: records the specialization key Triton's own binder computes for each
    launch (argument types, 16-byte alignment of pointers, value classes of integers not in
    do_not_specialize, constexprs, options), then launches the real kernel. Two launches with the
    same key share one compiled kernel."""

    def __init__(self, kernel, do_not_specialize, keys):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime import jit as triton_jit

        self.kernel, self.keys = kernel, keys
        jf = triton_jit.JITFunction(kernel.fn, do_not_specialize=list(do_not_specialize))
        backend = make_backend(GPUTarget("cuda", 90, 32))  # no GPU needed to build a backend
        self.binder = triton_jit.create_function_from_signature(jf.signature, jf.params, backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.add((self.kernel.fn.__name__, repr(specialization), repr(sorted(options.items()))))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_list_length_parity_does_not_change_specialization(monkeypatch):
    """The multi-tensor launches of lists of even and odd length, over the same dtype / alignment
    groups, have identical specialization keys: one compile per group, whatever the list length
    (the tables are passed as one pointer and an integer row length, never as slices)."""
    keys: set = set()
    for name, dns in (("_stage1_kernel", kern._STAGE1_DO_NOT_SPECIALIZE),
                      ("_stage2_kernel", kern._STAGE2_DO_NOT_SPECIALIZE)):
        try:
            recorder = _SpecializationRecorder(getattr(kern, name), dns, keys)
        except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - triton internals moved
            pytest.skip(f"this triton has no binder to compute specialization keys with: {e!r}")
        monkeypatch.setattr(tk, name, recorder)  # the launcher's own reference, the one it launches
    gen = torch.Generator().manual_seed(8)

    def tensor(i):  # cycles through the four groups: fp32, fp64, int32, fp32 not 16-byte aligned
        x = cast(special_values("mixed", 40 + 97 * i, gen), (torch.float32, torch.float64, torch.int32,
                                                             torch.float32)[i % 4]).to(DEVICE)
        return x[1 + i % 3:] if i % 4 == 3 else x

    pool = [tensor(i) for i in range(17)]
    per_length = {}
    for length in (5, 6, 7, 8, 16, 17):  # 16: an integer argument divisible by 16 is specialized too
        xs = pool[:length]  # every group in every list
        keys.clear()
        got = tk._summarize_many_table(xs)
        for i, x in enumerate(xs):
            assert_record_matches(got[i], reference.summarize(x), x, f"length {len(xs)} row {i}")
        per_length[len(xs)] = frozenset(keys)
    assert len(per_length) == 6 and len(set(per_length.values())) == 1, per_length
    assert len(next(iter(per_length.values()))) == 5  # fp32, fp64, int32, unaligned fp32, stage 2


def test_stage1_register_cap():
    """fp16 / bf16 stage-1 launches carry maxnreg=64 (sm_90: 8 resident programs per SM instead of
    7, see the launch-grid paragraph of triton_kernels' docstring), through both launchers; other
    read kinds none. The record does not depend on it: a launch with the cap (ignored by the
    interpreter) gives the record of the uncapped one."""
    capped = {"num_warps": kern._NUM_WARPS, "maxnreg": 64}
    assert tk._stage1_options(kern._KIND_FLOAT, 2) == capped
    for kind, size in ((kern._KIND_FLOAT, 4), (kern._KIND_FLOAT, 8), (kern._KIND_INT, 1), (kern._KIND_INT, 8),
                       (kern._KIND_E4M3FN, 1), (kern._KIND_E5M2, 1)):
        assert tk._stage1_options(kind, size) == {"num_warps": kern._NUM_WARPS}, (kind, size)
    gen = torch.Generator().manual_seed(9)
    xs = [cast(special_values("mixed", 3000, gen), d).to(DEVICE) for d in (torch.bfloat16, torch.float32)]
    _, plan, _, _ = tk._table_host(xs, "test")
    for (kind, _, code, _), _, _, _, _, options in plan:
        size = next(d.itemsize for d, c in kern._PTR_CODE.items() if c == code)
        assert options == tk._stage1_options(kind, size)
    assert any(options == capped for *_, options in plan) != tk.INTERPRETING  # the interpreter reads fp32
    t, kind, acc64 = tk._prepare(xs[0], "test")
    n, chunks = t.numel(), triton.cdiv(t.numel(), BLOCK * ITERS)
    records = []
    for options in (capped, {"num_warps": kern._NUM_WARPS}):
        part_i = torch.empty(5 * chunks, dtype=torch.int64, device=DEVICE)
        part_f = torch.empty(5 * chunks, dtype=torch.float64, device=DEVICE)  # min, max, sumsq, sum, sum4
        kern._stage1_kernel[(chunks,)](t, n, ITERS, part_i, 0, 0, part_i, part_f, chunks, KIND=kind, ACC64=acc64,
                                       CODE=kern._PTR_CODE[t.dtype], MULTI=False, ALIGNED=False, BLOCK=BLOCK,
                                       **options)
        out = torch.empty(kern.RECORD_SIZE, dtype=torch.float64, device=DEVICE)
        kern._stage2_kernel[(1,)](part_i, part_f, chunks, out, chunks, int(acc64), part_i, 0, MULTI=False,
                                  BLOCK2=kern._STAGE2_BLOCK, num_warps=kern._NUM_WARPS)
        records.append(out)
    assert torch.equal(records[0], records[1])
    assert_record_matches(records[0], reference.summarize(xs[0]), xs[0])


# --------------------------------------------------------------------------------------------------
# Host work per call (issue 44): launches counted, the table's invariants, summarize's in-place read
# --------------------------------------------------------------------------------------------------


def bits(t):
    """A record's bits (records may hold NaN, which torch.equal never calls equal)."""
    return t.detach().cpu().view(torch.int64)


def one_dtype_list(k, dtype=torch.float32, seed=10):
    """k contiguous 16-byte aligned tensors of one dtype, of mixed sizes and shapes, some empty."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1 + 37 * i % 300,) if i % 3 else (2, 1 + i % 9, 3) for i in range(k)]
    xs = [cast(special_values("mixed", math.prod(s), gen), dtype).reshape(s).to(DEVICE) for s in shapes]
    return [torch.empty(0, 4, dtype=dtype, device=DEVICE) if i % 7 == 6 else x for i, x in enumerate(xs)]


@pytest.mark.parametrize("k", [1, 6, 40])
def test_one_stage1_launch_per_group_whatever_the_list_length(k):
    """N tensors of one dtype (mixed sizes, some empty): the CUDA path (_summarize_many_table) makes
    one stage-1 and one stage-2 launch, O(1) in N, as its docstring and benchmarks/triton_host.py
    claim -- counted by wrapping the kernels it launches through (real launches here: the records
    are the reference's)."""
    from benchmarks.triton_host import counting_launches

    xs = one_dtype_list(k)
    with counting_launches(tk) as launches:
        got = tk._summarize_many_table(xs)
    assert [name for name, _ in launches] == ["_stage1_kernel", "_stage2_kernel"]
    assert launches[0][1] == (sum(x.numel() > 0 for x in xs),)  # (at most 300 elements: one chunk each)
    assert launches[1][1] == (k,)
    for i, x in enumerate(xs):
        assert_record_matches(got[i], reference.summarize(x), x, f"row {i}")


def test_launch_counts_of_every_path():
    """Counted without launching: 2000 tensors of one dtype are 2 launches; a list spanning G (read
    kind, alignment) groups G + 1; summarize 2, or none for an empty tensor; under the interpreter
    summarize_many is a loop of summarize (2 per non-empty tensor)."""
    from benchmarks.triton_host import count_launches

    gen = torch.Generator().manual_seed(11)
    buffer = torch.randn(70000, generator=gen).to(DEVICE)
    many = [buffer[k * 32:k * 32 + 1 + k % 70] for k in range(2000)]  # all 16-byte aligned (k * 128 bytes)
    assert count_launches(tk, lambda: tk._summarize_many_table(many)) == 2
    xs = mixed_list()
    _, plan, _, _ = tk._table_host(xs, "test")
    assert len({key for key, *_ in plan}) == len(plan) >= 5  # one launch group per (read kind, alignment)
    assert count_launches(tk, lambda: tk._summarize_many_table(xs)) == len(plan) + 1
    assert count_launches(tk, lambda: tk.summarize(buffer)) == 2
    assert count_launches(tk, lambda: tk.summarize(buffer[:0])) == 0
    if tk.INTERPRETING:
        assert count_launches(tk, lambda: tk.summarize_many(xs)) == 2 * sum(x.numel() > 0 for x in xs)


def check_table(xs, block=None, iters=None):
    """The pointer table's invariants, from its definition: every tensor's chunks are consecutive
    and its own, in the range of its group's launch; groups tile the chunk space; the chunk length
    of a group is its tile times its tiles per chunk."""
    meta, plan, device, _ = tk._table_host(xs, "test", block, iters)
    n = len(xs)
    ptr, numel, cbase, nch, acc = (meta[k * n:(k + 1) * n].tolist() for k in range(5))
    owner = meta[5 * n:].tolist()
    total = len(owner)
    assert sum(count for _, _, count, *_ in plan) == total and sum(nch) == total
    first = 0
    for (kind, acc64, code, aligned), start, count, g_iters, g_block, options in plan:
        assert start == first and count > 0
        first += count
        size = next(d.itemsize for d, c in kern._PTR_CODE.items() if c == code)
        assert g_block == (block or tk._block_for(kind, size)) and options == tk._stage1_options(kind, size)
        members = [i for i in range(n) if numel[i] and start <= cbase[i] < start + count]
        assert g_iters == (iters or tk._iters_for(sum(math.ceil(numel[i] / g_block) for i in members)))
        for i in members:
            assert (ptr[i] % 16 == 0) == aligned and acc[i] == int(acc64)
            assert nch[i] == math.ceil(numel[i] / (g_block * g_iters))
            assert cbase[i] + nch[i] <= start + count
        assert sorted(members) == members == sorted(members, key=lambda i: cbase[i])  # list order within
    for i in range(n):
        assert nch[i] == 0 if numel[i] == 0 else owner[cbase[i]:cbase[i] + nch[i]] == [i] * nch[i]
    assert len(plan) == len({key for key, *_ in plan})
    assert sorted(owner) == sorted(i for i in range(n) for _ in range(nch[i]))  # every tensor in one group
    return meta, plan


def test_table_invariants():
    gen = torch.Generator().manual_seed(12)
    dtypes = [torch.float32, torch.float64, torch.int32, torch.bool, torch.bfloat16, *FLOAT8_ALL[:1]]
    xs = []
    for i in range(300):
        x = cast(special_values("mixed", 1 + (i * 7919) % 2000, gen), dtypes[i % len(dtypes)]).to(DEVICE)
        xs.append(x[: i % 4] if i % 11 == 0 else x[1:] if i % 5 == 0 else x.reshape(-1, 1).t() if i % 13 == 0 else x)
    for block, iters in ((None, None), (32, 2), (64, 1)):
        check_table(xs, block, iters)
    check_table(one_dtype_list(50))
    check_table([torch.empty(0, device=DEVICE)] * 3)
    # groups of more than 4096 tiles: several tiles per chunk (table only, nothing launched)
    big32, big64 = torch.empty(2**23 + 5, device=DEVICE), torch.empty(2**22 + 3, dtype=torch.float64, device=DEVICE)
    for xs in ([big32, *one_dtype_list(5)], [big32[1:], big64, *one_dtype_list(5), big64[3:]]):
        _, plan = check_table(xs)
        assert any(g_iters > 1 for _, _, _, g_iters, *_ in plan)
    meta, plan = check_table(mixed_list())
    assert len(plan) >= 5


def test_table_rows_are_the_single_tensor_records_bit_for_bit():
    """A multi-group batch (mixed sizes, dtypes, empty tensors, non-contiguous views, unaligned
    addresses) with the tile and chunk length pinned: every row of the table path is bit for bit
    the record summarize gives the tensor alone (same chunks, same combining order), and the
    reference's."""
    gen = torch.Generator().manual_seed(13)
    dtypes = [torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.bool, torch.complex64, *FLOAT8_ALL[:1]]
    xs = []
    for i in range(24):
        n = (0, 1, 31, 64, 65, 200, 333)[i % 7]
        x = cast(special_values(VALUE_KINDS[i % len(VALUE_KINDS)], n + 2, gen), dtypes[i % len(dtypes)]).to(DEVICE)
        xs.append((x[1:n + 1], x[:n][::2], x[:n])[i % 3])  # unaligned, strided, contiguous
    rows = tk._summarize_many_table(xs, _block=32, _iters=2)
    for i, x in enumerate(xs):
        assert torch.equal(bits(rows[i]), bits(tk.summarize(x, _block=32, _iters=2))), f"row {i}"
        assert_record_matches(rows[i], reference.summarize(x), x, f"row {i}")


def test_summarize_reads_plain_contiguous_tensors_in_place(monkeypatch):
    """summarize hands a plain contiguous tensor of a dtype the kernel reads natively to the kernel as
    it is (no _prepare: no detach, reshape or views); everything else is prepared. The records are
    bit for bit those of the prepared path, and the reference's."""
    gen = torch.Generator().manual_seed(14)
    base = cast(special_values("mixed", 500, gen), torch.float32).to(DEVICE)
    z = cast(special_values("mixed", 40, gen), torch.complex64).to(DEVICE)
    in_place = [base, base[3:403].reshape(20, 20), base[7], base[:0], base.double(),
                cast(special_values("random", 90, gen), torch.int64).to(DEVICE),
                cast(special_values("random", 90, gen), torch.uint8).to(DEVICE)]
    prepared = [base.reshape(20, 25).t(), base[::2], torch.nn.Parameter(base.clone()), z, z.conj().imag,
                cast(special_values("random", 30, gen), torch.bool).to(DEVICE), base.as_subclass(_Subclass),
                *[cast(special_values("mixed", 40, gen), d).to(DEVICE) for d in FLOAT8_ALL[:1]]]
    if tk.INTERPRETING:
        prepared.append(base.half())
    else:
        in_place.append(base.half())
    calls = []
    real_prepare = tk._prepare
    monkeypatch.setattr(tk, "_prepare", lambda x, op: calls.append(x) or real_prepare(x, op))
    got = [tk.summarize(x, _block=64, _iters=2) for x in in_place + prepared]
    assert [id(x) for x in calls] == [id(x) for x in prepared]
    monkeypatch.setattr(tk, "_SINGLE_FAST", {})  # every tensor through _prepare
    for x, rec in zip(in_place + prepared, got):
        assert torch.equal(bits(rec), bits(tk.summarize(x, _block=64, _iters=2)))
        assert_record_matches(rec, reference.summarize(x), x)


def test_device_guard_only_when_the_device_changes(monkeypatch):
    """Launches need the tensors' device to be current: torch.cuda.device is entered only when it is
    not (its enter and exit cost two device exchanges per call); otherwise one shared no-op."""
    assert tk._device_guard(torch.device("cpu")) is tk._NO_GUARD
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert tk._device_guard(torch.device("cuda", 1)) is tk._NO_GUARD
    guard = tk._device_guard(torch.device("cuda", 0))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 0


def test_triton_host_benchmark_counts(tmp_path):
    """benchmarks/triton_host.py runs here (nothing launched) and reports O(1) launches per call of
    the CUDA path and a fixed number of host torch operations per table build, whatever N."""
    import json

    from benchmarks import triton_host

    out = tmp_path / "host.json"
    assert triton_host.main(["--tensors", "120", "--repeats", "2", "--device", DEVICE, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    table = got["launches"]["_summarize_many_table (the CUDA path)"]
    assert table == {"1": 2, "10": 2, "100": 2, "120": 2}
    assert got["launches"]["summarize (one tensor)"] == {"1": 2}
    ops = got["table_host_torch_ops"]
    assert ops["1"] == ops["120"] <= 30

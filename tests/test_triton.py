"""The Triton kernels against the pure-PyTorch reference, on small shapes.

Without a GPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported), so shapes stay small. Besides the public ``summarize`` /
``summarize_many`` these tests drive the pointer-table multi-tensor path (``_summarize_many_table``,
the CUDA implementation of ``summarize_many``: under the interpreter its "device" pointers are CPU
addresses) and small tile / chunk overrides so that multi-tile chunks, masked tails and the
chunk-combining stage are exercised at these sizes.
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nanscan.kernels import reference  # noqa: E402
from nanscan.kernels import triton as tk  # noqa: E402
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

# The interpreter evaluates the kernels with numpy, which warns where float32 squares overflow.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def check(x, got=None, what=""):
    got = tk.summarize(x) if got is None else got
    assert got.dtype == torch.float64 and got.shape == (8,) and got.device == x.device
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


@pytest.mark.parametrize("fill", [NAN, 0.0, -INF])
def test_packed_counters_do_not_overflow(fill):
    """127 tiles per chunk (the most the packed per-lane counters allow), every element counted."""
    x = torch.full((16 * 127 * 2 + 5,), fill, device=DEVICE)
    assert_record_matches(tk.summarize(x, _block=16, _iters=127), reference.summarize(x), x)


@pytest.mark.parametrize("dtype", FLOAT8_ALL, ids=str)
def test_float8_decoding_is_exact(dtype):
    """Every byte pattern decodes bit-exactly as torch's float8 -> float32 conversion."""

    @triton.jit
    def decode(src, dst, KIND: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, tk._decode_fp8(tl.load(src + offs), KIND))

    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    decode[(1,)](raw, out, KIND=tk._DTYPE_INFO[dtype][0])
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
    assert rec.tolist() == [0.0, 0.0, 0.0, 0.0, INF, -INF, 0.0, -1.0]
    check(x)


def test_zero_dim_and_special_cases():
    for value in (NAN, INF, -INF, 0.0, -0.0, 2.5, 1e20):
        check(torch.tensor(value, device=DEVICE), what=str(value))
    x = torch.full((100,), 1e20, device=DEVICE)
    rec = tk.summarize(x)
    f32 = torch.tensor(1e20, dtype=torch.float32).item()
    assert rec[6].item() == INF and rec[4].item() == rec[5].item() == f32  # fp32 square overflows
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
    assert got.dtype == torch.float64 and got.shape == (len(xs), 8) and got.device == xs[0].device
    for i, x in enumerate(xs):
        assert_record_matches(got[i], reference.summarize(x), x, f"row {i}")


def test_summarize_many_edge_cases():
    assert tk.summarize_many([]).shape == (0, 8)
    assert tk._summarize_many_table([]).shape == (0, 8)
    empties = [torch.empty(0, device=DEVICE), torch.empty(0, 3, dtype=torch.int32, device=DEVICE)]
    assert tk._summarize_many_table(empties).tolist() == [[0.0, 0.0, 0.0, 0.0, INF, -INF, 0.0, -1.0]] * 2
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

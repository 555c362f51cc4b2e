"""Every compiled backend against the pure-PyTorch reference, over dtypes x shapes x layouts x values."""
import json

import pytest
import torch

import nanscan
from nanscan.kernels import reference
from nanscan.record import Field
from tests.helpers import FLOAT8, VALUE_KINDS, assert_record_matches, cast, layouts, special_values, stable_seed

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, *FLOAT8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.complex64]
# Sizes are multiples of 12 (for the layouts) chosen to straddle vector widths and the GPU kernels'
# 64K runs. MULTI_CHUNK is past several of the CPU kernel's 1M-element chunks (and several GPU chunks).
SIZES = [12, 1020, 65544]
MULTI_CHUNK = 3 * 2**20 + 24


def compiled_backends():
    """(backend, device) pairs to test against the reference on this machine; triton on CPU (the
    interpreter) has its own small-shape tests in test_triton.py."""
    out = [("cpu", "cpu")] if "cpu" in nanscan.available_backends() else []
    if torch.cuda.is_available():
        out += [(b, "cuda") for b in ("cuda", "triton") if b in nanscan.available_backends()]
    return out


BACKENDS = compiled_backends()


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", VALUE_KINDS)
def test_matches_reference_all_values(backend, device, dtype, kind):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), kind))
    for n in SIZES:
        x = cast(special_values(kind, n, gen), dtype).to(device)
        assert_record_matches(nanscan.record(x, backend=backend), reference.summarize(x), x, f"{backend} n={n}")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.complex64], ids=str)
@pytest.mark.parametrize("kind", ["random", "mixed", "nan_last"])
def test_matches_reference_all_layouts(backend, device, dtype, kind):
    gen = torch.Generator().manual_seed(7)
    base = cast(special_values(kind, MULTI_CHUNK, gen), dtype).to(device)
    for name, view in layouts(base):
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() or name == "channels_last"
        assert_record_matches(nanscan.record(view, backend=backend), reference.summarize(view), view,
                              f"{backend} {name}")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_first_nonfinite_is_logical_row_major_index(backend, device):
    x = torch.zeros(6, 8, device=device)
    x[5, 1] = float("nan")  # memory offset 41; in x.t() it is logical (1, 5) -> 1 * 6 + 5 = 11
    x[2, 7] = float("inf")  # memory offset 23; in x.t() logical (7, 2) -> 44
    assert nanscan.summarize(x, backend=backend).first_nonfinite_index == 23
    assert nanscan.summarize(x.t(), backend=backend).first_nonfinite_index == 11


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_empty_and_zero_dim(backend, device):
    for x in [torch.empty(0, device=device), torch.empty(3, 0, 5, device=device)]:
        s = nanscan.summarize(x, backend=backend)
        assert (s.numel, s.nonfinite_count, s.zero_count, s.sumsq) == (0, 0, 0, 0.0)
        assert s.finite_min is None and s.finite_max is None and s.first_nonfinite_index is None
    s = nanscan.summarize(torch.tensor(float("-inf"), device=device), backend=backend)
    assert (s.shape, s.numel, s.neginf_count, s.first_nonfinite_index, s.finite_min) == ((), 1, 1, 0, None)
    s = nanscan.summarize(torch.tensor(-2.5, device=device), backend=backend)
    assert (s.finite_min, s.finite_max, s.sumsq, s.is_finite) == (-2.5, -2.5, 6.25, True)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sumsq_overflow_is_a_finding_not_an_error(backend, device):
    x = torch.full((1000,), 1e20, device=device)  # every element finite; the FP32 squares are not
    s = nanscan.summarize(x, backend=backend)
    assert s.is_finite and s.sumsq_overflowed and s.l2_norm == float("inf")
    assert (s.finite_min, s.finite_max) == (pytest.approx(1e20), pytest.approx(1e20))
    s64 = nanscan.summarize(x.double(), backend=backend)  # FP64 accumulation does not overflow
    assert not s64.sumsq_overflowed and s64.sumsq == pytest.approx(1000 * 1e40)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_float8_special_values(backend, device):
    if not FLOAT8:
        pytest.skip("this torch has no float8 dtypes")
    # Built from bit patterns: torch's float -> float8 casts saturate ±inf instead of producing them.
    e4m3_bits = torch.tensor([0x38, 0x7F, 0xFF, 0x00, 0x80, 0xFE], dtype=torch.uint8)  # 1, NaN, -NaN, 0, -0, -448
    e4m3 = nanscan.summarize(e4m3_bits.view(torch.float8_e4m3fn).to(device), backend=backend)
    assert (e4m3.nan_count, e4m3.posinf_count, e4m3.neginf_count, e4m3.zero_count) == (2, 0, 0, 2)
    assert (e4m3.finite_min, e4m3.finite_max, e4m3.first_nonfinite_index) == (-448.0, 1.0, 1)
    e5m2_bits = torch.tensor([0x3C, 0x7E, 0x7C, 0xFC, 0x00, 0x7B], dtype=torch.uint8)  # 1, NaN, inf, -inf, 0, 57344
    e5m2 = nanscan.summarize(e5m2_bits.view(torch.float8_e5m2).to(device), backend=backend)
    assert (e5m2.nan_count, e5m2.posinf_count, e5m2.neginf_count, e5m2.zero_count) == (1, 1, 1, 1)
    assert (e5m2.finite_max, e5m2.first_nonfinite_index) == (57344.0, 1)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_summarize_many_matches_single(backend, device):
    gen = torch.Generator().manual_seed(3)
    xs = [cast(special_values(kind, n, gen), dtype).to(device)
          for kind, n, dtype in [("mixed", 70001, torch.float32), ("random", 5, torch.bfloat16),
                                 ("nan_last", 3 * 2**20 + 1, torch.float16), ("random", 0, torch.float32),
                                 ("all_inf", 12, torch.float64), ("random", 100, torch.int64)]]
    xs.append(xs[0].reshape(-1)[:70000].reshape(700, 100).t())
    rows = nanscan.records(xs, backend=backend)
    assert rows.shape == (len(xs), nanscan.RECORD_SIZE) and rows.device.type == device
    for row, x in zip(rows, xs):
        assert_record_matches(row, reference.summarize(x), x, f"{backend} many")
    summaries = nanscan.summarize_many(xs, backend=backend)
    assert [s.shape for s in summaries] == [tuple(x.shape) for x in xs]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_summarize_many_thousands_of_tensors(backend, device):
    xs = [torch.full((i % 7 + 1,), float(i), device=device) for i in range(3000)]
    xs[2500][0] = float("nan")
    rows = nanscan.records(xs, backend=backend).cpu()
    assert rows[:, 0].sum().item() == 1 and rows[2500, 0].item() == 1
    assert rows[:, 5].tolist() == [float(i) for i in range(3000)]


def test_cpu_results_do_not_depend_on_thread_count():
    if "cpu" not in nanscan.available_backends():
        pytest.skip("compiled library not available")
    gen = torch.Generator().manual_seed(0)
    xs = [cast(special_values("mixed", 5 * 2**20 + 7, gen), dtype) for dtype in (torch.float32, torch.bfloat16)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(nanscan.records(xs + [xs[0][::3]], backend="cpu"))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert torch.equal(r, results[0])  # bitwise, the FP32 sum of squares included


def test_summary_properties_and_strict_json():
    x = torch.tensor([3.0, -4.0, float("nan"), 0.0, float("inf")])
    s = nanscan.summarize(x, backend="reference")
    assert (s.nonfinite_count, s.finite_count, s.is_finite, s.absmax, s.l2_norm) == (2, 3, False, 4.0, 5.0)
    d = json.loads(json.dumps(nanscan.summarize(torch.full((4,), float("nan"))).to_dict(), allow_nan=False))
    assert d["finite_min"] is None and d["first_nonfinite_index"] == 0 and d["nan_count"] == 4
    d = json.loads(json.dumps(nanscan.summarize(torch.full((4,), 1e20)).to_dict(), allow_nan=False))
    assert d["sumsq"] == {"finite": False, "value": "inf"} and d["sumsq_overflowed"] is True


def test_complex_is_summarized_as_view_as_real():
    x = torch.tensor([1 + 2j, complex(float("nan"), 0), complex(0, float("inf"))], dtype=torch.complex64)
    s = nanscan.summarize(x)
    assert s.shape == (3, 2) and s.numel == 6
    assert (s.nan_count, s.posinf_count, s.first_nonfinite_index, s.zero_count) == (1, 1, 2, 2)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_unsupported_inputs_raise_clear_errors(backend):
    if backend not in nanscan.available_backends():
        pytest.skip("compiled library not available")
    dense = torch.eye(3)
    with pytest.raises(TypeError, match="layout torch.sparse_coo is not supported.*supported: float64"):
        nanscan.summarize(dense.to_sparse(), backend=backend)
    with pytest.raises(TypeError, match="layout torch.sparse_csr"):
        nanscan.summarize(dense.to_sparse_csr(), backend=backend)
    with pytest.raises(TypeError, match="quantized"):
        nanscan.summarize(torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), backend=backend)
    with pytest.raises(TypeError, match="nested"):
        nanscan.summarize(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), backend=backend)
    with pytest.raises(TypeError, match="dtype torch.uint16 is not supported"):
        nanscan.summarize(torch.zeros(3, dtype=torch.uint16), backend=backend)
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        nanscan.summarize([1.0, 2.0], backend=backend)
    with pytest.raises(ValueError, match="meta tensor has no values"):
        nanscan.summarize(torch.empty(3, device="meta"), backend=backend)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_record_refusals_name_the_input_and_keep_the_kernels_error(backend):
    """record hands a plain tensor straight to the kernel; what the kernel (or the dispatcher)
    refuses is then explained as summarize explains it, naming nanscan.record."""
    if backend not in nanscan.available_backends():
        pytest.skip("compiled library not available")
    dense = torch.eye(3)
    refused = [(dense.to_sparse(), "layout torch.sparse_coo is not supported.*supported: float64"),
               (torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), "quantized"),
               (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
               (torch.zeros(3, dtype=torch.uint16), "dtype torch.uint16 is not supported")]
    for x, message in refused:
        with pytest.raises(TypeError, match="nanscan.record: " + message) as info:
            nanscan.record(x, backend=backend)
        if backend == "cpu" and x.layout != torch.strided:  # (the dispatcher's own refusal, kept)
            assert info.value.__cause__ is not None
    with pytest.raises(TypeError, match="nanscan.record: expected a torch.Tensor, got list"):
        nanscan.record([1.0, 2.0], backend=backend)
    param = torch.nn.Parameter(torch.tensor([1.0, float("inf")]))  # a subclass: checked, then summarized
    assert nanscan.record(param, backend=backend)[Field.POSINF_COUNT].item() == 1


def test_a_tensor_is_not_a_list_of_tensors():
    for fn in (nanscan.summarize_many, nanscan.records):
        with pytest.raises(TypeError, match="got a tensor of shape \\(3, 4\\)"):
            fn(torch.ones(3, 4))
    assert len(nanscan.summarize_many(list(torch.ones(3, 4)))) == 3  # the rows, when asked for


def test_cpu_kernel_and_reference_accept_the_same_dtypes():
    """The C++ list (NANSCAN_FORALL_REAL_DTYPES in csrc/inputs.h) and the reference's agree, over
    every dtype this torch has."""
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    checked = 0
    for dtype in dtypes:
        try:
            x = torch.zeros(3, dtype=dtype)
        except Exception:  # (dtypes without CPU tensors: nothing to summarize)
            continue
        accepted = {}
        for backend in ("cpu", "reference"):
            try:
                nanscan.record(x, backend=backend)
                accepted[backend] = True
            except TypeError as e:
                assert "is not supported" in str(e), (dtype, backend, e)
                accepted[backend] = False
        assert accepted["cpu"] == accepted["reference"], (dtype, accepted)
        checked += 1
    assert checked >= 20


def test_backend_choice_errors_and_env(monkeypatch):
    with pytest.raises(ValueError, match="unknown nanscan backend backend='fast'; choose one of cpu, cuda"):
        nanscan.summarize(torch.ones(2), backend="fast")
    nanscan.record(torch.ones(2))  # resolved (and remembered) without NANSCAN_BACKEND...
    monkeypatch.setenv("NANSCAN_BACKEND", "nope")  # ...which is still read on every call
    with pytest.raises(ValueError, match="NANSCAN_BACKEND='nope'"):
        nanscan.record(torch.ones(2))
    with pytest.raises(ValueError, match="NANSCAN_BACKEND='nope'"):
        nanscan.summarize(torch.ones(2))
    monkeypatch.setenv("NANSCAN_BACKEND", "reference")
    assert nanscan.summarize(torch.tensor([float("nan")])).nan_count == 1
    if not torch.cuda.is_available() and "cpu" in nanscan.available_backends():
        with pytest.raises((ValueError, nanscan.ExtensionError), match="cuda"):
            nanscan.summarize(torch.ones(2), backend="cuda")


def test_records_are_device_tensors_without_host_sync():
    # What a host sync is made of, seen from the dispatcher: an op that reads a value back to Python
    # (.item(), bool(t), nonzero's size). record / records must call none of them -- checked here on
    # CPU with a dispatch mode; tests/test_cuda.py checks the same with CUDA's sync debug mode.
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}

    class NoHostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.called.append(func)
            if func in reads:
                raise AssertionError(f"{func} reads a value back to the host")
            return func(*args, **(kwargs or {}))

    x = torch.randn(100)
    xs = [x, torch.tensor([1.0, float("nan")]), torch.zeros(3, dtype=torch.bfloat16)]
    with NoHostReads() as mode:
        rec = nanscan.record(x)
        many = nanscan.records(xs)
    assert torch.ops.nanscan.summarize.default in mode.called  # (the mode saw the op itself)
    assert many.shape == (3, nanscan.RECORD_SIZE) and many.dtype == torch.float64
    assert rec.dtype == torch.float64 and rec.shape == (nanscan.RECORD_SIZE,) and rec.device == x.device
    meta = nanscan.record(torch.empty(10, device="meta"))  # the fake kernel: shape propagation only
    assert meta.device.type == "meta" and meta.shape == (nanscan.RECORD_SIZE,)


def test_readme_example():
    s = nanscan.summarize(torch.tensor([1.0, float("nan"), 1e20]))
    assert (s.nan_count, s.first_nonfinite_index, s.sumsq_overflowed) == (1, 1, True)
    assert s.mean == pytest.approx(5e19) and s.kurtosis is None and s.sum4_overflowed
    json.dumps(s.to_dict(), allow_nan=False)
    model = torch.nn.Linear(3, 2)
    summaries = nanscan.summarize_many(list(model.parameters()))
    assert [x.shape for x in summaries] == [(2, 3), (2,)] and all(x.is_finite for x in summaries)
    assert nanscan.records([torch.ones(2), torch.ones(3)]).shape == (2, nanscan.RECORD_SIZE)
    assert nanscan.available_backends()[-1] == "reference"


@pytest.mark.parametrize("layout", ["short_rows", "expanded", "step_sliced"])
def test_fp32_sumsq_of_strided_views_is_as_accurate_as_contiguous(layout):
    """Views walked row by row (rows of 3 elements, stride-0 expansion, steps) sum their squares in
    blocks like the contiguous path: relative error ~1e-6 over 196K elements, not the 1e-4 of one
    sequential FP32 sum."""
    gen = torch.Generator().manual_seed(0)
    x = {"short_rows": lambda: torch.rand(65536, 8, generator=gen)[:, :3],
         "expanded": lambda: torch.rand(65536, 1, generator=gen).expand(65536, 3),
         "step_sliced": lambda: torch.rand(65536 * 3 * 3, generator=gen)[::3]}[layout]()
    want = x.double().pow(2).sum().item()
    assert abs(nanscan.summarize(x).sumsq - want) / want < 2e-5


def _blocked_fp32_sum(squares: torch.Tensor) -> float:
    """The FP32 sum the kernels' blocking implies, done here one rounding at a time: sequential sums
    of 256 squares, then of 256 such block sums, then of those sums (the kernels' own tree differs
    in its shape -- lanes, chunks -- not in the size of any sequential sum)."""
    acc = torch.zeros(squares.numel() // 256)
    for column in squares.view(-1, 256).unbind(1):
        acc += column  # one FP32 rounding per element, like one lane of a kernel
    chunk = torch.zeros(acc.numel() // 256)
    for column in acc.view(-1, 256).unbind(1):
        chunk += column
    total = torch.zeros(())
    for part in chunk:
        total += part
    return total.item()


SUMSQ_LAYOUTS = {  # (shape of the tensor made, view of it): 2**20 elements, every way the kernels walk one
    "contiguous": ((1024, 1024), lambda t: t),
    "transposed": ((1024, 1024), lambda t: t.t()),
    "channels_last": ((16, 32, 32, 64), lambda t: t.permute(0, 3, 1, 2)),
    "row_sliced": ((1024, 1536), lambda t: t[:, :1024]),
    "step_sliced": ((1024, 2048), lambda t: t[:, ::2]),
    "expanded": ((1024, 1), lambda t: t.expand(1024, 1024)),
}


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sumsq_is_as_accurate_on_every_layout(backend, device, dtype):
    """Contiguous, permuted, sliced and expanded tensors, alone and in one summarize_many, all sum
    their squares in FP32 blocks of 256: each relative error is within 2x of that of the blocked
    sum (or of 4 FP32 ulps, where rounding noise dominates). The squares of bf16 / fp16 values have
    biased low bits, so a longer sequential sum is measurably low, not just noisier."""
    gen = torch.Generator().manual_seed(0)
    # (the view is taken on the device and after the cast: .to() of a strided view is contiguous)
    xs = {name: view(torch.randn(shape, generator=gen).to(device, dtype))
          for name, (shape, view) in SUMSQ_LAYOUTS.items()}
    assert xs["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert not any(x.is_contiguous() for name, x in xs.items() if name != "contiguous")
    rows = nanscan.records(list(xs.values()), backend=backend).cpu()
    for (name, x), row in zip(xs.items(), rows):
        squares = x.cpu().float().reshape(-1) ** 2
        want = squares.double().sum().item()
        bound = 2 * max(abs(_blocked_fp32_sum(squares) - want) / want, 2.0 ** -22)
        for how, got in (("record", nanscan.record(x, backend=backend)[6].item()), ("records", row[6].item())):
            assert abs(got - want) / want <= bound, (name, how, abs(got - want) / want, bound)


def test_cpu_sums_of_many_small_sums_are_blocked_too():
    """One big square, then one 1.0 every 64K elements (512 of them): a sequential FP32 sum drops
    every 1.0 (2**24 + 1 rounds back to 2**24); blocked -- per lane, per run of a chunk's parts, per
    256 chunks -- the ones after the first block survive."""
    chunk, n_chunks = 65536, 512
    x = torch.zeros(n_chunks * chunk, dtype=torch.bfloat16)
    x[::chunk] = 1.0
    x[0] = 4096.0  # square 2**24
    chunk_sums = x.view(n_chunks, chunk).float().pow(2).sum(1)  # exact: one nonzero per chunk
    want = chunk_sums.double().sum().item()
    blocked = _blocked_fp32_sum(torch.cat([chunk_sums, torch.zeros(256 * 256 - n_chunks)]))
    got = nanscan.summarize(x, backend="cpu").sumsq
    assert blocked > 2.0 ** 24 and abs(got - want) <= abs(blocked - want)


@pytest.mark.parametrize("layout", ["row_sliced", "step_sliced"])
def test_cpu_parts_of_a_strided_tensor_are_summed_in_blocks(layout):
    """A strided tensor is walked row by row, each row a part of its chunk; a chunk's parts are added
    256 at a time too, so 4096 rows of squares summing to 1.0 after a row of 2**24 are not all lost
    (a sequential sum would round every 2**24 + 1 back to 2**24)."""
    rows, cols = 4096, 256
    base = torch.zeros(rows, 2 * cols, dtype=torch.bfloat16)
    x = base[:, :cols] if layout == "row_sliced" else base[:, ::2]
    x[1:, 0] = 1.0
    x[0, 0] = 4096.0  # square 2**24
    assert not x.is_contiguous() and x.numel() == 2 ** 20
    want = 2.0 ** 24 + (rows - 1)
    got = nanscan.summarize(x, backend="cpu").sumsq
    assert got >= 2.0 ** 24 + 15 * 256 and abs(got - want) < 256, got


# ------------------------------------------------------------------------- sum, sum4: mean, kurtosis


def finite_moments(x: torch.Tensor):
    """(mean, kurtosis about zero, mean of |x|) of the finite elements of x (complex: its real view),
    in float64 with torch: the numbers TensorSummary.mean / .kurtosis estimate, and the scale of the
    mean's rounding error."""
    real = torch.view_as_real(x) if x.is_complex() else x
    v = real.reshape(-1).cpu().double()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return None, None, None
    m2 = (v ** 2).mean().item()
    return v.mean().item(), ((v ** 4).mean().item() / m2 ** 2 if m2 > 0 else None), v.abs().mean().item()


MOMENT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, *FLOAT8, torch.int32, torch.int64,
                 torch.int16, torch.uint8, torch.bool, torch.complex64]


@pytest.mark.parametrize("backend,device", BACKENDS + [("reference", "cpu")])
@pytest.mark.parametrize("dtype", MOMENT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "mixed", "nan_last"])
def test_mean_and_kurtosis_match_torch(backend, device, dtype, kind):
    """mean = sum / finite_count and kurtosis = E[x**4] / E[x**2]**2 over the finite elements (NaN / Inf
    present or not), against torch in float64. FP32 accumulation for 8/16/32-bit floats (fp16 / bf16
    included: their values, squares and fourth powers are summed in FP32), FP64 otherwise."""
    gen = torch.Generator().manual_seed(stable_seed("moments", str(dtype), kind))
    for n in (1, 1000, MULTI_CHUNK):
        v = special_values(kind, n, gen) * 3 + 0.5  # (a mean away from zero)
        x = cast(v, dtype).to(device)
        s = nanscan.summarize(x, backend=backend)
        mean, kurt, scale = finite_moments(x)
        fp64 = dtype in (torch.float64, torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool)
        rtol = 1e-12 if fp64 else 2e-5
        if mean is None:
            assert s.mean is None and s.kurtosis is None, (n, s)
            continue
        assert s.mean == pytest.approx(mean, rel=0, abs=rtol * scale + 1e-300), (n, s.mean, mean)
        if kurt is None:
            assert s.kurtosis is None, (n, s)
        else:
            assert s.kurtosis == pytest.approx(kurt, rel=10 * rtol), (n, s.kurtosis, kurt)
            assert 1 - 1e-6 <= s.kurtosis <= s.finite_count * (1 + 1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS + [("reference", "cpu")])
def test_mean_and_kurtosis_edge_cases(backend, device):
    def summary(values, dtype=torch.float32):
        return nanscan.summarize(torch.tensor(values, dtype=dtype, device=device), backend=backend)

    nan, inf = float("nan"), float("inf")
    for values in ([], [nan, inf, -inf]):  # no finite element: no mean, no kurtosis
        s = summary(values)
        assert (s.mean, s.kurtosis, s.sum, s.sum4) == (None, None, 0.0, 0.0), values
    s = nanscan.summarize(torch.empty(3, 0, device=device), backend=backend)
    assert (s.mean, s.kurtosis) == (None, None)
    s = summary([0.0, -0.0, nan, 0.0])  # all finite elements zero: a mean, no kurtosis (E[x**2] = 0)
    assert (s.mean, s.kurtosis) == (0.0, None)
    s = summary([2.0, -2.0, 2.0, inf, -2.0])  # one magnitude: kurtosis 1, whatever the sign
    assert (s.mean, s.kurtosis, s.sum, s.sumsq, s.sum4) == (0.0, 1.0, 0.0, 16.0, 64.0)
    s = summary([0.0] * 99 + [5.0])  # one outlier among n: kurtosis n
    assert s.kurtosis == pytest.approx(100.0) and s.mean == pytest.approx(0.05)
    s = summary(-2.5)  # 0-dim
    assert (s.mean, s.kurtosis) == (-2.5, 1.0)
    s = summary([1, 2, 3, 250], torch.uint8)  # integers: FP64 sums, exact here
    assert (s.sum, s.sumsq, s.sum4, s.mean) == (256.0, 62514.0, 1 + 16 + 81 + 250.0 ** 4, 64.0)
    s = summary([True, False, True], torch.bool)
    assert (s.mean, s.kurtosis) == (pytest.approx(2 / 3), 1.5)
    s = nanscan.summarize(torch.tensor([1 + 2j, complex(nan, -3)], dtype=torch.complex64, device=device),
                          backend=backend)  # the real view: 1, 2, nan, -3
    assert (s.finite_count, s.sum, s.sumsq, s.sum4) == (3, 0.0, 14.0, 98.0) and s.mean == 0.0


@pytest.mark.parametrize("backend,device", BACKENDS + [("reference", "cpu")])
def test_sum4_overflow_and_underflow_give_no_kurtosis(backend, device):
    """FP32 fourth powers overflow from |x| ~ 4.3e9 (squares only from ~1.8e19): sum4 is +inf, a
    finding like an overflowing sumsq, and the kurtosis is None, while mean and sumsq are fine. Below
    ~1e-10 they underflow (every term flushed to 0 at 1e-12): None too, not a kurtosis of 0. FP64
    accumulation (fp64, integers) has neither problem at these magnitudes."""
    big = torch.full((1000,), 1e10, device=device)
    big[::2] = -1e10
    s = nanscan.summarize(big, backend=backend)
    assert s.is_finite and not s.sumsq_overflowed and s.sum4_overflowed and s.sum4 == float("inf")
    assert s.kurtosis is None and abs(s.mean) <= 1e4 and s.sumsq == pytest.approx(1000 * 1e20, rel=1e-6)
    s64 = nanscan.summarize(big.double(), backend=backend)
    assert not s64.sum4_overflowed and s64.kurtosis == pytest.approx(1.0)
    half = nanscan.summarize(torch.full((100,), 60000.0, dtype=torch.float16, device=device), backend=backend)
    assert half.sum == 6e6 and half.mean == 60000.0  # FP32 sums: in fp16 they would be inf
    assert half.sum4 == pytest.approx(100 * 60000.0 ** 4, rel=1e-6) and half.kurtosis == pytest.approx(1.0)
    tiny = torch.full((1000,), 1e-12, device=device)
    s = nanscan.summarize(tiny, backend=backend)
    assert s.sum4 == 0.0 and s.sumsq > 0 and s.kurtosis is None and s.mean == pytest.approx(1e-12, rel=1e-5)
    assert nanscan.summarize(tiny.double(), backend=backend).kurtosis == pytest.approx(1.0)
    d = json.loads(json.dumps(nanscan.summarize(big, backend=backend).to_dict(), allow_nan=False))
    assert d["sum4"] == {"finite": False, "value": "inf"} and d["sum4_overflowed"] is True and d["kurtosis"] is None


def test_summary_of_a_record_of_the_earlier_layout():
    """A record of the 8-field layout (without sum / sum4), e.g. saved by an earlier version, still
    decodes: sum / sum4 / mean / kurtosis unknown (None), the rest as before."""
    old = [1.0, 0.0, 0.0, 2.0, -4.0, 3.0, 25.0, 1.0]
    s = nanscan.TensorSummary.from_values(old, torch.float32, (4,))
    assert (s.nan_count, s.zero_count, s.finite_min, s.finite_max, s.sumsq, s.first_nonfinite_index) == (
        1, 2, -4.0, 3.0, 25.0, 1)
    assert (s.sum, s.sum4, s.mean, s.kurtosis, s.sum4_overflowed) == (None, None, None, None, False)
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["sum"] is None and d["mean"] is None and d["kurtosis"] is None and "none" not in str(s).split("sumsq")[0]
    with pytest.raises(ValueError, match="has 10 values"):
        nanscan.TensorSummary.from_values(old[:7], torch.float32, (4,))


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_and_sum4_are_as_accurate_on_every_layout(backend, device, dtype):
    """sum and sum4 are summed in the blocks of sumsq (test_sumsq_is_as_accurate_on_every_layout): on
    every layout, alone and in one summarize_many, the relative error of sum4 is within 2x of the
    blocked FP32 sum's (or 4 ulps), and sum's error, relative to the sum of |x|, too (values with a
    mean of 2, so that a long sequential FP32 sum would drift)."""
    gen = torch.Generator().manual_seed(1)
    xs = {name: view((torch.randn(shape, generator=gen) + 2).to(device, dtype))
          for name, (shape, view) in SUMSQ_LAYOUTS.items()}
    rows = nanscan.records(list(xs.values()), backend=backend).cpu()
    for (name, x), row in zip(xs.items(), rows):
        values = x.cpu().float().reshape(-1)
        fourth = (values * values) ** 2
        want4, want1, scale = fourth.double().sum().item(), values.double().sum().item(), values.abs().sum().item()
        bound4 = 2 * max(abs(_blocked_fp32_sum(fourth) - want4) / want4, 2.0 ** -22)
        bound1 = 2 * max(abs(_blocked_fp32_sum(values) - want1) / scale, 2.0 ** -22)
        one = nanscan.record(x, backend=backend)
        for how, rec in (("record", one), ("records", row)):
            assert abs(rec[9].item() - want4) / want4 <= bound4, (name, how, "sum4")
            assert abs(rec[8].item() - want1) / scale <= bound1, (name, how, "sum")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_min_max_and_zeros_of_16_bit_values_of_every_sign(backend, device, dtype):
    """The CPU kernel takes the min / max / zero count of fp16 / bf16 vectors from their raw bits
    (sign-magnitude as signed and unsigned integers): all negative, all positive, all -0.0, mixed
    signed zeros, tiny subnormals and the format's extremes, over the vector path and its tail."""
    gen = torch.Generator().manual_seed(5)
    big = torch.finfo(dtype).max
    cases = {
        "negative": -(torch.rand(1000, generator=gen) + 0.5),
        "positive": torch.rand(1000, generator=gen) + 0.5,
        "minus_zero": torch.full((1000,), -0.0),
        "signed_zeros": torch.where(torch.rand(1000, generator=gen) < 0.5, 0.0, -0.0),
        "zeros_and_negative": torch.cat([torch.zeros(500), -torch.rand(500, generator=gen) - 1]),
        "subnormal": torch.full((1000,), float(torch.finfo(dtype).smallest_normal) / 4) * torch.sign(
            torch.randn(1000, generator=gen)),
        "extremes": torch.tensor([big, -big] * 500),
    }
    for name, v in cases.items():
        for n in (1000, 997, 40):
            x = v[:n].to(dtype).to(device)
            got = nanscan.record(x, backend=backend)
            assert_record_matches(got, reference.summarize(x), x, f"{backend} {name} n={n}")
            want = x.cpu().float()
            assert got[4].item() == want.min().item() and got[5].item() == want.max().item(), name
            assert got[3].item() == (want == 0).sum().item(), name

"""The ops as torch ops: opcheck on every op in the namespace, and torch.compile without graph breaks."""
import pytest
import torch

import nanscan
from nanscan import _ops
from nanscan.kernels import reference
from tests.helpers import assert_record_matches

R = nanscan.RECORD_SIZE  # record columns


def devices_for(op_name):
    if op_name.startswith("triton_"):
        return ["cuda"] if torch.cuda.is_available() else (["cpu"] if _ops.triton_usable() else [])
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and _ops.has_cuda_kernels() else [])


def sample_inputs(op_name, device):
    """Small inputs: under TRITON_INTERPRET=1 the triton ops run in the (slow) interpreter."""
    if op_name == "stamp_rows_":  # (buffer, counter, values, records, first_row, owner, labels)
        def fresh():
            return (torch.zeros(5, R + 4, dtype=torch.float64, device=device),
                    torch.full((1,), 3.0, dtype=torch.float64, device=device))
        values = [torch.randn(3, 4, device=device), torch.ones(2, device=device)]
        records = torch.arange(2 * R, dtype=torch.float64, device=device).reshape(2, R)
        return [(*fresh(), values, None, 2, 0, ""), (*fresh(), values, records, 1, 0, "a\x1fb")]
    if op_name == "stamp":  # (values, records, owner, first_row, labels): owner 0 names no buffer, a no-op
        records = torch.arange(2 * R, dtype=torch.float64, device=device).reshape(2, R)
        values = [torch.randn(3, 4, device=device), torch.ones(2, device=device)]
        return [(values, None, 0, 1, ""), (values, records, 0, 0, "a\x1fb")]
    x = torch.tensor([[1.0, float("nan"), -3.0], [0.0, float("inf"), 2.0]], device=device)
    y = torch.arange(10, dtype=torch.int32, device=device)
    many = op_name.endswith("_many")
    if many:
        # (an empty list has no device, so the dispatcher cannot route it: nanscan.records handles it)
        return [([x, y, x.t(), torch.empty(0, device=device)],)] if device == "cpu" else [([x, y],)]
    return [(x,), (x.t(),), (y,), (torch.tensor(5.0, device=device),)]


def nanscan_op_names():
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("nanscan::"))
    assert names, "no nanscan op is registered"
    return names


def test_every_op_is_known_to_this_test():
    assert set(nanscan_op_names()) == set(_ops.OPS), "add sample inputs for the new op to tests/test_ops.py"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("op_name", _ops.OPS)
def test_opcheck(op_name, device):
    # (one test per op and device: a failure names both)
    if device not in devices_for(op_name):
        pytest.skip(f"{op_name} has no usable {device} kernel here")
    op = getattr(torch.ops.nanscan, op_name)
    for args in sample_inputs(op_name, device):
        torch.library.opcheck(op, args)


def test_compile_fullgraph_keeps_ops_in_graph_and_matches_eager():
    def health(x, w):
        y = torch.relu(x @ w)
        return y.sum(), nanscan.record(y), nanscan.records([x, w, y])

    x, w = torch.randn(64, 32), torch.randn(32, 16)
    x[3, 4] = float("nan")
    eager = health(x, w)
    # fullgraph=True turns any graph break into an error
    compiled = torch.compile(health, fullgraph=True, backend="aot_eager")(x, w)
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2])
    assert_record_matches(compiled[1], reference.summarize(torch.relu(x @ w)), x)


def test_compile_inductor_calls_the_op():
    def f(x):
        return nanscan.record(x * 2)

    x = torch.randn(1000)
    x[10] = float("-inf")
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0
    out = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(out, f(x))


def test_cuda_kernels_registered_iff_info_says_compiled():
    info = nanscan.build_info()
    assert info is not None
    assert _ops.has_cuda_kernels() == bool(info["cuda_compiled"])
    assert torch._C._dispatch_has_kernel_for_dispatch_key("nanscan::summarize", "CPU")


def test_stale_or_missing_library_is_refused_loudly(monkeypatch):
    monkeypatch.setattr(_ops, "build_info", lambda: {"torch": "1.0.0", "source_hash": "x"})
    err = _ops._load()
    assert isinstance(err, nanscan.ExtensionError) and "built against torch 1.0.0" in str(err)
    assert str(err).endswith(_ops.rebuild_hint())
    monkeypatch.setattr(_ops, "build_info", lambda: {"torch": torch.__version__, "source_hash": "x"})
    if (_ops.os.path.isdir(_ops.os.path.join(_ops.REPO_DIR, "csrc"))):
        assert "is stale" in str(_ops._load())
    monkeypatch.setattr(_ops, "library_path", lambda: None)
    assert "was not found" in str(_ops._load())
    # ...and a compiled backend then raises it, while the reference backend still works
    monkeypatch.setattr(_ops, "LOAD_ERROR", _ops._load())
    with pytest.raises(nanscan.ExtensionError, match="not found"):
        nanscan.summarize(torch.ones(3))
    assert nanscan.available_backends() == ["reference"]
    assert nanscan.summarize(torch.ones(3), backend="reference").sumsq == 3.0


def test_rebuild_hint_fits_the_install(tmp_path):
    """A checkout (setup.py and csrc/ beside the package) is rebuilt in place; a wheel's user has no
    checkout, so the fix is a reinstall from source against the torch that is installed."""
    checkout, site = tmp_path / "checkout", tmp_path / "site-packages"
    (checkout / "csrc").mkdir(parents=True)
    (checkout / "setup.py").write_text("")
    site.mkdir()
    assert _ops.is_checkout(str(checkout)) and not _ops.is_checkout(str(site))
    assert _ops.rebuild_hint(repo_dir=str(checkout)) == (
        f"rebuild it in the checkout: `cd {checkout} && pip install --no-build-isolation --no-deps -e .`")
    wheel = _ops.rebuild_hint(env="NANSCAN_CUDA=1 ", repo_dir=str(site))
    assert wheel == ("reinstall it from source against the installed torch: `NANSCAN_CUDA=1 pip install "
                     "--no-build-isolation --no-deps --force-reinstall --no-binary nanscan "
                     f"nanscan=={nanscan.__version__}` "
                     "(installed from a source tree: `NANSCAN_CUDA=1 pip install --no-build-isolation --no-deps "
                     "--force-reinstall .` in it)")


def test_a_wheel_built_for_another_torch_says_to_reinstall(tmp_path):
    """The package as a wheel installs it (no setup.py, no csrc/ beside it), its library built
    against another torch: the error a wheel user sees names the reinstall, not a checkout."""
    import json
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site-packages"
    library = _ops.os.path.basename(_ops.library_path())
    shutil.copytree(_ops.PACKAGE_DIR, site / "nanscan", ignore=shutil.ignore_patterns("__pycache__", "_C*"))
    (site / "nanscan" / library).write_bytes(b"")  # (never loaded: the torch version is checked first)
    info_path = site / "nanscan" / "_build_info.json"
    info = json.loads(info_path.read_text())
    info["torch"] = "2.0.0"
    info_path.write_text(json.dumps(info))
    code = ("import torch, nanscan\n"
            "try:\n    nanscan.summarize(torch.ones(3))\n"
            "except nanscan.ExtensionError as e:\n    print(nanscan.__file__, e, sep='\\n')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**_ops.os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(site / "nanscan" / "__init__.py")
    assert "built against torch 2.0.0" in out[1]
    assert out[1].endswith(_ops.rebuild_hint(repo_dir=str(site)))
    assert f"--force-reinstall --no-binary nanscan nanscan=={nanscan.__version__}`" in out[1] and "-e ." not in out[1]


def test_stamp_rows_writes_records_and_sequence_numbers():
    buffer = torch.zeros(6, R + 4, dtype=torch.float64)
    counter = torch.full((1,), 4.0, dtype=torch.float64)
    values = [torch.randn(3, 5), torch.tensor([1.0, float("nan")]), torch.zeros(4, dtype=torch.bfloat16)]
    values[0][1, 2] = float("inf")
    torch.ops.nanscan.stamp_rows_(buffer, counter, values, None, 2, 0, "")  # records: the default kernels'
    torch.testing.assert_close(buffer[2:5, :R], torch.ops.nanscan.summarize_many(values), rtol=0, atol=0,
                               equal_nan=True)
    assert buffer[2:5, R].tolist() == [5.0, 6.0, 7.0]
    assert buffer[2:5, R + 1].tolist() == [1.0, 1.0, 1.0]  # each row's writes
    assert buffer[[0, 1, 5]].abs().sum() == 0 and buffer[:, R + 2:].abs().sum() == 0 and counter.item() == 7.0
    given = torch.arange(R, dtype=torch.float64).reshape(1, R)  # records of another backend
    torch.ops.nanscan.stamp_rows_(buffer, counter, values[:1], given, 0, 0, "")
    assert torch.equal(buffer[0, :R], given[0]) and buffer[0, R].item() == 8.0 and counter.item() == 8.0
    torch.ops.nanscan.stamp_rows_(buffer, counter, values[:2], None, 2, 0, "")  # rows 2, 3 again
    assert buffer[2:5, R].tolist() == [9.0, 10.0, 7.0] and buffer[:5, R + 1].tolist() == [1.0, 0.0, 2.0, 2.0, 1.0]
    narrow = torch.zeros(2, R + 1, dtype=torch.float64)  # no column for the writes: none are counted
    torch.ops.nanscan.stamp_rows_(narrow, counter, values[:1], None, 0, 0, "")
    assert narrow[0, R].item() == 11.0 and narrow[1].abs().sum() == 0
    with pytest.raises(RuntimeError, match="outside the buffer"):
        torch.ops.nanscan.stamp_rows_(buffer, counter, values, None, 4, 0, "")
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.nanscan.stamp_rows_(buffer, counter, values[:1], given.float(), 0, 0, "")


def test_stamp_writes_the_buffer_named_for_its_owner_and_nothing_once_it_is_dropped():
    from nanscan import _C

    buffer, counter = torch.zeros(4, R + 4, dtype=torch.float64), torch.full((1,), 5.0, dtype=torch.float64)
    grad = torch.tensor([1.0, float("nan"), -2.0])
    _C.set_stamp_target(4242, buffer, counter)
    try:
        torch.ops.nanscan.stamp([grad], None, 4242, 2, "")
        given = torch.arange(R, dtype=torch.float64)  # one record of another backend, for one value
        torch.ops.nanscan.stamp([grad], given, 4242, 0, "")
    finally:
        _C.set_stamp_target(4242, None, None)
    assert_record_matches(buffer[2, :R], reference.summarize(grad), grad)
    assert torch.equal(buffer[0, :R], given)
    assert buffer[2, R].item() == 6.0 and buffer[0, R].item() == 7.0 and counter.item() == 7.0  # sequence numbers
    assert buffer[[1, 3]].abs().sum().item() == 0.0
    torch.ops.nanscan.stamp([grad], None, 4242, 1, "")  # dropped: nothing is written
    assert buffer[1].abs().sum().item() == 0.0 and counter.item() == 7.0


def test_stamp_given_records_without_their_values_writes_a_row_per_record():
    # (a compiled graph's stamp: Note [a stamp given its records takes no values], nanscan/kernels/graph_passes.py)
    from nanscan import _C

    buffer, counter = torch.zeros(4, R + 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    records = torch.arange(2 * R, dtype=torch.float64).reshape(2, R)
    _C.set_stamp_target(4243, buffer, counter)
    try:
        before = _C.stamp_count(4243)
        torch.ops.nanscan.stamp([], records, 4243, 1, "")
        assert _C.stamp_count(4243) - before == 2  # (the host's count: one per row written)
        with pytest.raises(RuntimeError, match=r"records given without values must be \[rows, columns\]"):
            torch.ops.nanscan.stamp([], records[0], 4243, 0, "")
        torch.ops.nanscan.stamp([], None, 4243, 0, "")  # neither values nor records: nothing to write
    finally:
        _C.set_stamp_target(4243, None, None)
    assert torch.equal(buffer[1:3, :R], records) and buffer[1:3, R].tolist() == [1.0, 2.0] and counter.item() == 2.0
    assert buffer[[0, 3]].abs().sum().item() == 0.0
    assert counter.item() == 2.0 and _C.stamp_count(4243) - before == 2
    _C.drop_stamp_count(4243)


def test_tensor_set_records_the_held_tensors_and_the_gradients_that_exist():
    # The monitor's per-step parameter checks: one C++ call for the records of the held parameters,
    # one for those of their gradients (which exist, and where).
    from nanscan import _C

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.tensor([1.0, float("inf")])),
              torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    held = _C.TensorSet(params)
    assert len(held) == 3
    expected = torch.ops.nanscan.summarize_many([p.detach() for p in params])
    torch.testing.assert_close(held.records(), expected, rtol=0, atol=0, equal_nan=True)
    assert held.grad_records()[0] is None  # no gradient yet
    params[1].grad = torch.tensor([float("nan"), 2.0])
    records, present, sparse = held.grad_records()
    assert sparse is None
    assert present == [1]
    torch.testing.assert_close(records, torch.ops.nanscan.summarize_many([params[1].grad]), rtol=0, atol=0,
                               equal_nan=True)
    for p in params:
        p.grad = torch.ones_like(p)
    records, present, sparse = held.grad_records()
    assert sparse is None
    assert present is None and records.shape == (3, R)
    with torch.no_grad():
        params[0].data = torch.full((5,), float("nan"))  # (module.to: the same tensor, new data)
    assert held.records()[0, 0].item() == 5.0  # five NaNs
    calls = []  # another backend's summarize_many, a Python callable

    def other(xs):
        calls.append(len(xs))
        return torch.ops.nanscan.summarize_many(xs)

    torch.testing.assert_close(_C.TensorSet(params, other).records(), held.records(), rtol=0, atol=0, equal_nan=True)
    assert calls == [3]


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3),  # small: its values copied on arrival, summarized when the rows are sealed
    lambda: torch.tensor([1.0, float("nan"), -float("inf"), 0.0, -0.0, 3e38, 3e38]),  # special values, FP32 overflow
    lambda: torch.randn(5).to(torch.bfloat16),
    lambda: torch.arange(6, dtype=torch.int32),
    lambda: torch.empty(0),
    lambda: torch.randn(64, 64),  # 16 KiB: summarized on arrival
    lambda: torch.randn(4, 4, dtype=torch.float64).t(),  # not contiguous: summarized on arrival
    lambda: -torch.randn(4),  # (a plain tensor; a lazily negated view is summarized on arrival)
], ids=["small", "special", "bf16", "int32", "empty", "large", "transposed", "negated"])
def test_a_cpu_record_made_on_arrival_is_the_value_then_bit_for_bit(make):
    # Small CPU tensors are copied when recorded and summarized with the other copies when the
    # window is taken (csrc/monitor/grad_sink.h: HostRows); others are summarized at once. Either
    # way the record is summarize()'s of the value as it was when recorded, to the bit.
    import types

    from nanscan import _C

    x = make()
    want = torch.ops.nanscan.summarize(x.clone())
    w = _C.Window(lambda rows: None, None, None, 1, 64, 1 << 20)
    w.add(x, types.SimpleNamespace(stale=False))
    if x.numel():
        x.fill_(7)  # changed after it was recorded
    got = torch.cat(w.take()[1])
    assert got.shape == (1, R) and torch.equal(got[0], want), (got[0], want)


def test_a_cpu_read_window_summarizes_on_arrival_and_a_batched_one_marks_a_later_change_stale():
    # The monitor's read window (csrc/monitor/window.h): with the default kernels a CPU tensor
    # is summarized when it is recorded, so changing it afterwards changes nothing; with another
    # backend (a Python summarize_many) it waits for its batch, and a change before the batch marks
    # it stale rather than recording the later value as the earlier one.
    import types

    from nanscan import _C

    def window(summarize):
        return _C.Window(lambda rows: None, summarize, None, 1, 64, 1 << 20)

    on_arrival, batched = window(None), window(lambda xs: torch.ops.nanscan.summarize_many(xs))
    for w, stale in ((on_arrival, False), (batched, True)):
        first, second = torch.ones(3), torch.tensor([2.0, -1.0])
        slots = [types.SimpleNamespace(stale=False), types.SimpleNamespace(stale=False)]
        w.add(first, slots[0])
        w.add(second, slots[1])
        first.mul_(float("nan"))  # changed after it was recorded
        entries, records, rows = w.take()
        assert entries == slots and rows is None and [s.stale for s in slots] == [stale, False]
        got = torch.cat(records)
        assert got.shape == (2, R)
        torch.testing.assert_close(got[1], torch.ops.nanscan.summarize(torch.tensor([2.0, -1.0])), rtol=0, atol=0)
        if not stale:  # the record of what it held when it was recorded
            torch.testing.assert_close(got[0], torch.ops.nanscan.summarize(torch.ones(3)), rtol=0, atol=0)
        else:  # (the later value's record, which the read never takes as the earlier one's)
            assert got[0, 0].item() == 3.0
    # A block of records made elsewhere (the parameters) keeps its place between them.
    w = window(None)
    a, b = torch.ones(2), torch.zeros(2)
    first, block, last = types.SimpleNamespace(stale=False), types.SimpleNamespace(start=None), \
        types.SimpleNamespace(stale=False)
    w.add(a, first)
    w.add_block(torch.full((2, R), 7.0, dtype=torch.float64), block, 2)
    w.add(b, last)
    assert len(w) == 4
    entries, records, _ = w.take()
    assert torch.cat(records)[:, 3].tolist() == [0.0, 7.0, 7.0, 2.0]  # zero counts, in production order
    assert entries == [first, block, block, last] and block.start == 1 and len(w) == 0


def test_env_backend_reads_what_os_environ_holds(monkeypatch):
    """The backend lookup reads os.environ's own storage (a few DRAM misses fewer per call after a
    large record): it must see every set and delete made through os.environ."""
    monkeypatch.delenv("NANSCAN_BACKEND", raising=False)
    assert _ops.env_backend() is None
    for value in ("reference", "cpu", "", "é"):
        monkeypatch.setenv("NANSCAN_BACKEND", value)
        assert _ops.env_backend() == _ops.os.environ.get("NANSCAN_BACKEND") == value
    monkeypatch.delenv("NANSCAN_BACKEND")
    assert _ops.env_backend() is None


def test_record_kernel_is_the_resolved_kernel_for_every_device_type(monkeypatch):
    monkeypatch.delenv("NANSCAN_BACKEND", raising=False)
    for x in (torch.ones(3), torch.empty(3, device="meta")):
        for backend in (None, "cpu", "reference"):
            assert _ops.record_kernel(backend, x) is _ops.kernels(backend, x.device)[0]
    monkeypatch.setenv("NANSCAN_BACKEND", "reference")
    assert _ops.record_kernel(None, torch.ones(3)) is _ops.kernels("reference", torch.device("cpu"))[0]


def _stamp_rows_args(values):
    return (torch.zeros(4, R + 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), values, None, 0, 0, "")


# Each op entry with a list of values: how to call it (the ops take one tensor, a list, or a list
# to stamp). owner 0 names no buffer: stamp then writes nothing, but refuses what it cannot read.
CALLS = {
    "summarize": lambda xs: torch.ops.nanscan.summarize(xs[-1]),
    "summarize_many": lambda xs: torch.ops.nanscan.summarize_many(xs),
    "triton_summarize": lambda xs: torch.ops.nanscan.triton_summarize(xs[-1]),
    "triton_summarize_many": lambda xs: torch.ops.nanscan.triton_summarize_many(xs),
    "stamp_rows_": lambda xs: torch.ops.nanscan.stamp_rows_(*_stamp_rows_args(xs)),
    "stamp": lambda xs: torch.ops.nanscan.stamp(xs, None, 0, 0, ""),
}


def test_every_op_entry_is_called_by_the_refusal_tests():
    assert set(CALLS) == set(_ops.OPS)


@pytest.mark.parametrize("op_name", ["summarize_many", "triton_summarize_many", "stamp_rows_", "stamp"])
def test_a_list_on_several_devices_is_refused_by_the_op_itself(op_name):
    """cpu + meta reaches the fake (meta) kernel, which has no values to read: it must refuse, as the
    CPU and CUDA kernels refuse cpu + cuda (a GPU test checks that one), never return an
    uninitialised record or write nothing silently."""
    call = CALLS[op_name]
    for xs in ([torch.ones(3), torch.ones(3, device="meta")], [torch.ones(3, device="meta"), torch.ones(3)]):
        with pytest.raises(ValueError, match="one device|meta tensor \\(no values\\) beside"):
            call(xs)
    if op_name != "stamp":  # (stamp summarizes each value where it lives: model parallelism)
        with pytest.raises(ValueError, match=r"all tensors must be on one device, but (xs|values)\[1\] is on meta"):
            call([torch.ones(3), torch.ones(3, device="meta")])
    with pytest.raises(ValueError, match="one device"):
        nanscan.records([torch.ones(3), torch.ones(3, device="meta")])


@pytest.mark.parametrize("op_name", _ops.OPS)
def test_what_no_kernel_reads_is_refused_by_every_op_with_the_reason(op_name):
    """Sparse, quantized and nested tensors reach keys no backend implements: each op refuses them
    itself, naming what was wrong and what is accepted (not the dispatcher's 'could not run')."""
    dense = torch.eye(3)
    # (the C++ kernels name a layout as c10 prints it: Sparse, SparseCsr)
    refused = [(dense.to_sparse(), "layout (torch.sparse_coo|Sparse) is not supported.*supported: float64"),
               (dense.to_sparse_csr(), "layout (torch.sparse_csr|SparseCsr) is not supported"),
               (torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), "quantized tensors .* dequantize first"),
               (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensors are not supported")]
    for x, message in refused:
        with pytest.raises(TypeError, match=f"nanscan.{op_name}: {message}"):
            CALLS[op_name]([torch.ones(2), x])


def written_with_ops(buffer, counter, records, first_row):
    """What ``stamp_rows_`` writes, as the ATen ops that wrote it before its CPU and CUDA kernels."""
    n, width = records.shape
    block = buffer[first_row:first_row + n]
    block[:, :width] = records
    block[:, width] = torch.arange(1, n + 1, dtype=counter.dtype, device=counter.device) + counter
    if buffer.shape[1] > width + 1:
        block[:, width + 1] += 1
    counter += n


def stamp_rows_layouts(device):
    """(buffer, counter, records, first_row): a plain buffer, one with no column for the writes, a
    strided buffer (a column slice of a wider one), transposed records, a negated view, float32."""
    def base(rows, cols, dtype=torch.float64):
        return torch.rand(rows, cols, dtype=dtype, device=device) * 4
    records = torch.randn(3, R, dtype=torch.float64, device=device)
    records[1, 2] = float("nan")
    return [(base(6, R + 4), torch.full((1,), 4.0, dtype=torch.float64, device=device), records, 2),
            (base(3, R + 1), torch.full((1,), 0.0, dtype=torch.float64, device=device), records, 0),
            (base(5, R + 9)[:, 3:3 + R + 2], torch.full((1,), 7.0, dtype=torch.float64, device=device), records, 1),
            (base(4, R + 4), torch.full((1,), 2.0, dtype=torch.float64, device=device),
             records.t().contiguous().t(), 1),
            (base(4, R + 4), torch.full((1,), 2.0, dtype=torch.float64, device=device), torch._neg_view(records), 0),
            (base(4, R + 4, torch.float32), torch.full((1,), 2.0, device=device), records.float(), 1)]


def assert_stamp_rows_write_what_the_ops_write(device):
    """``stamp_rows_`` on ``device`` writes the cells ``written_with_ops`` writes, bit for bit, on
    every layout of ``stamp_rows_layouts``."""
    for buffer, counter, records, first in stamp_rows_layouts(device):
        want_buffer, want_counter = buffer.clone(), counter.clone()
        written_with_ops(want_buffer, want_counter, records.clone(), first)
        torch.ops.nanscan.stamp_rows_(buffer, counter, [], records, first, 0, "")
        assert torch.equal(counter, want_counter)
        torch.testing.assert_close(buffer, want_buffer, rtol=0, atol=0, equal_nan=True)


def test_stamp_rows_kernel_writes_what_the_aten_ops_write():
    """The CPU kernel writes a stamp's rows in one pass (the ATen ops were 29 dispatcher calls a
    stamp): the same cells, bit for bit, on every layout; a float32 buffer takes the ops."""
    assert_stamp_rows_write_what_the_ops_write("cpu")


def test_a_stamp_given_its_records_calls_no_aten_op():
    """What a compiled graph's stamp costs the host beyond its own call: nothing through the dispatcher
    but ``stamp_rows_`` (the write is one kernel: csrc/monitor/stamp_rows.cpp, csrc/cuda/stamp_rows.cu)."""
    from torch.profiler import ProfilerActivity, profile

    from nanscan import _C

    buffer, counter = torch.zeros(4, R + 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    records = torch.arange(2 * R, dtype=torch.float64).reshape(2, R)
    _C.set_stamp_target(4244, buffer, counter)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.ops.nanscan.stamp([], records, 4244, 1, "")
    finally:
        _C.set_stamp_target(4244, None, None)
        _C.drop_stamp_count(4244)
    assert sorted(e.name for e in prof.events()) == ["nanscan::stamp", "nanscan::stamp_rows_"]
    assert torch.equal(buffer[1:3, :R], records) and buffer[1:3, R].tolist() == [1.0, 2.0] and counter.item() == 2.0

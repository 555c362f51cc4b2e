"""Records fused into inductor's kernels (Note [records fused into compiled kernels], nanscan/_ops.py):
inside a graph inductor compiles, ``nanscan::summarize`` / ``summarize_many`` are the reference's
reductions, which inductor fuses with the kernel that writes the tensor. Checked here: the fused
record equals the reference's and the C++ kernel's field by field (per dtype, per value kind, for
several, empty, 0-d and strided tensors), a pointwise producer and its record are one generated
kernel with no call of the op, the op stays opaque where the decomposition is not given, a
registration after the process's first compile still takes effect, and a watched compiled model's
records are fused into its kernels with the same incident as eager."""
import contextlib
import re

import pytest
import torch
from torch import nn
from torch._inductor import decomposition as inductor_decompositions
from torch._inductor.utils import run_and_get_code

import nanscan
from nanscan import _ops
from nanscan.kernels import reference
from tests.helpers import VALUE_KINDS, assert_record_matches, cast, layouts, special_values

pytestmark = pytest.mark.skipif(_ops.LOAD_ERROR is not None, reason="needs the compiled library")

OPS = (torch.ops.nanscan.summarize.default, torch.ops.nanscan.summarize_many.default)


@contextlib.contextmanager
def no_caches():
    """Inductor's on-disk caches off: they key on the graph, not on the decomposition table, so a
    test that compiles the same function with and without the decomposition must not be served
    the other one's code."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False, force_disable_caches=True), \
            functorch_config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


@contextlib.contextmanager
def unregistered():
    """The process as if ``register_fused_records`` had never run (restored after)."""
    tables = [inductor_decompositions.decompositions]
    cached = inductor_decompositions.fast_random_decomps
    if cached.cache_info().currsize:
        tables.append(cached())
    saved = [{op: t[op] for op in OPS if op in t} for t in tables]
    registered = _ops._FUSED_REGISTERED
    import torch._inductor.config as inductor_config

    marked = inductor_config.unsafe_marked_cacheable_functions
    marker = marked.pop(_ops.FUSED_CACHE_KEY, None)
    for t in tables:
        for op in OPS:
            t.pop(op, None)
    _ops._FUSED_REGISTERED = False
    try:
        yield
    finally:
        if len(tables) == 1 and cached.cache_info().currsize:  # (made meanwhile, from the table with them)
            tables.append(cached())
            saved.append(saved[0])
        for t, s in zip(tables, saved):
            for op in OPS:
                t.pop(op, None)
            t.update(s)
        _ops._FUSED_REGISTERED = registered
        marked.pop(_ops.FUSED_CACHE_KEY, None)
        if marker is not None:
            marked[_ops.FUSED_CACHE_KEY] = marker


def compiled_code(fn, *args):
    """(result, the generated source) of ``fn`` compiled by inductor, with no cache."""
    with no_caches():
        result, codes = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), *args)
    return result, "\n".join(codes)


def kernels_defined(code: str) -> list:
    return re.findall(r"^(\w+) = async_compile\.\w+\(", code, flags=re.MULTILINE)


@pytest.fixture(autouse=True, scope="module")
def registered():
    """Fused records on for this module (off by default: ``NANSCAN_FUSED_RECORDS``)."""
    was = _ops.FUSED_RECORDS
    _ops.FUSED_RECORDS = True
    with unregistered():  # (and the tables as they were after: other tests compare inductor with eager exactly)
        assert _ops.register_fused_records()
        yield
    _ops.FUSED_RECORDS = was


def summarize_compiled(x):
    return torch.ops.nanscan.summarize(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_record_is_the_references_and_the_kernels_field_by_field(dtype):
    gen = torch.Generator().manual_seed(7)
    xs = [cast(special_values(kind, 1000, gen), dtype) for kind in VALUE_KINDS]
    fn = torch.compile(lambda *ts: [torch.ops.nanscan.summarize(t) for t in ts], backend="inductor",
                       fullgraph=True)
    with no_caches():
        got = fn(*xs)
    for kind, x, g in zip(VALUE_KINDS, xs, got):
        assert_record_matches(g, reference.summarize(x), x, f"inductor vs reference, {kind}")
        assert_record_matches(g, torch.ops.nanscan.summarize(x), x, f"inductor vs the C++ kernel, {kind}")


def test_several_empty_zero_dim_and_strided_tensors_in_one_fused_call():
    gen = torch.Generator().manual_seed(3)
    base = cast(special_values("mixed", 240, gen), torch.float32)
    views = [v for _, v in layouts(base)]
    xs = views + [torch.empty(0), torch.tensor(float("-inf")), torch.tensor(2.5, dtype=torch.bfloat16),
                  cast(special_values("nan_last", 96, gen), torch.float16).reshape(8, 12)]
    got, code = compiled_code(lambda *ts: torch.ops.nanscan.summarize_many(list(ts)), *xs)
    assert not re.search(r"nanscan\.summarize\w*\.default\(", code), "the op was called, not fused"
    assert got.shape == (len(xs), 10) and got.dtype == torch.float64
    for k, x in enumerate(xs):
        assert_record_matches(got[k], reference.summarize(x), x, f"tensor {k} {tuple(x.shape)} {x.dtype}")
        assert_record_matches(got[k], torch.ops.nanscan.summarize(x), x, f"tensor {k} vs the C++ kernel")


def test_a_pointwise_producer_and_its_record_are_one_generated_kernel():
    def f(a, b):
        y = torch.nn.functional.gelu(a * b + 1)
        return y, torch.ops.nanscan.summarize_many([y])

    a, b = torch.randn(64, 256), torch.randn(64, 256)
    a[3, 7] = float("nan")
    (y, records), code = compiled_code(f, a, b)
    assert not re.search(r"nanscan\.summarize\w*\.default\(", code)
    defined = kernels_defined(code)
    assert len(defined) == 1, f"expected the producer and its record in one kernel, got {defined}"
    assert_record_matches(records[0], reference.summarize(y), y, "fused with its producer")
    assert records[0][7].item() == 3 * 256 + 7  # first non-finite index


def test_without_the_decomposition_the_op_stays_opaque():
    def f(a):
        y = a.sin()
        return torch.ops.nanscan.summarize_many([y])

    with unregistered():
        got, code = compiled_code(f, torch.randn(32))
    assert "torch.ops.nanscan.summarize_many.default(" in code
    # and aot_eager (no inductor table) keeps the op, registered or not
    with no_caches():
        graphs = []

        def keep(gm, inputs):
            graphs.append(gm)
            return gm.forward

        from torch._dynamo.backends.common import aot_autograd

        torch.compile(f, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(torch.randn(32))
    assert any(n.target is torch.ops.nanscan.summarize_many.default for n in graphs[0].graph.nodes)


def test_inductors_cache_keys_tell_fused_graphs_apart():
    """A graph compiled with the records fused is never served from inductor's caches to a process
    without them (nor the reverse): the registration is part of inductor's config, which its cache
    keys hash."""
    import torch._inductor.config as inductor_config

    assert inductor_config.unsafe_marked_cacheable_functions.get(_ops.FUSED_CACHE_KEY)
    with unregistered():
        assert _ops.FUSED_CACHE_KEY not in inductor_config.unsafe_marked_cacheable_functions
        off = inductor_config.save_config_portable()
    assert off != inductor_config.save_config_portable()


def test_a_registration_after_the_first_compile_of_the_process_takes_effect():
    def f(a):
        y = a.cos()
        return y, torch.ops.nanscan.summarize_many([y])

    with unregistered():
        # The first compile makes inductor's cached table (fast_random_decomps) ...
        compiled_code(lambda a: a + 1, torch.randn(4))
        assert inductor_decompositions.fast_random_decomps.cache_info().currsize
        assert _ops.register_fused_records()  # ... which the registration must update too
        x = torch.randn(50)
        (y, got), code = compiled_code(f, x)
    assert not re.search(r"nanscan\.summarize\w*\.default\(", code)
    assert_record_matches(got[0], reference.summarize(y), y, "registered late")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def test_a_watched_compiled_model_fuses_its_records_and_names_the_same_incident_as_eager():
    x = torch.randn(4, 16)
    found, codes = {}, []
    for mode in ("eager", "inductor"):
        torch.manual_seed(0)
        model = nn.Sequential(Block(16), Block(16))
        poisoned = {"on": False}

        def plant(module, args, output, poisoned=poisoned):  # a NaN made by the second block's GELU, at step 2
            return output.index_fill(1, torch.tensor([3]), float("nan")) if poisoned["on"] else output

        model[1].act.register_forward_hook(plant)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = nanscan.watch(model, opt)
        run = model if mode == "eager" else torch.compile(model, backend="inductor")
        found[mode] = None
        try:
            with no_caches(), mon:
                for step in range(3):
                    poisoned["on"] = step == 2
                    if mode == "inductor" and step == 0:
                        _, codes = run_and_get_code(lambda run=run: run(x).sum().backward())
                    else:
                        run(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
        except nanscan.NonFiniteError as e:
            found[mode] = (e.incident.step, e.incident.phase, e.incident.kind, e.incident.name, e.incident.produced)
    code = "\n".join(codes)
    # the stamps get records that generated kernels computed: no record op reads a tensor again
    assert "torch.ops.nanscan.stamp.default(" in code
    assert not re.search(r"nanscan\.summarize\w*\.default\(", code), "a record op was called"
    # ... and take none of the recorded tensors (Note [a stamp given its records takes no values]):
    # inductor does not write a value for them
    stamps = re.findall(r"torch\.ops\.nanscan\.stamp\.default\((.*)\)", code)
    assert stamps and all(args.startswith("[], ") for args in stamps), stamps
    assert found["inductor"] == found["eager"]
    assert found["eager"] is not None and found["eager"][3] == "1.act", found


def test_a_large_record_is_made_in_two_stages_fused_with_its_producer():
    """Note [a record in two stages] (nanscan/kernels/fused.py): a tensor large enough for inductor to
    split is reduced by rows of its leading dimensions, in the producer's own loop, then finished in
    one small kernel (which the C++ backend runs in the producer's kernel too) -- and the record is
    the reference's."""
    from nanscan.kernels import fused

    def f(a, b):
        y = torch.tanh(a * b)
        return y, torch.ops.nanscan.summarize_many([y])

    a, b = torch.randn(8, 64, 256), torch.randn(8, 64, 256)
    assert a.numel() > fused.ONE_STAGE_MAX and fused.kept_dims(a.shape) == 2
    a[5, 17, 3] = float("nan")
    a[6, 0, 0] = float("inf")
    (y, records), code = compiled_code(f, a, b)
    assert not re.search(r"nanscan\.summarize\w*\.default\(", code)
    defined = kernels_defined(code)
    # (The C++ backend merges the record's small kernel into the producer's loop too: one kernel.)
    assert len(defined) == 1, f"expected the producer, its rows and its record in one kernel; got {defined}"
    assert_record_matches(records[0], reference.summarize(y), y, "in two stages")
    assert records[0][7].item() == (5 * 64 + 17) * 256 + 3  # first non-finite index, in logical order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_record_in_two_stages_is_the_references_field_by_field(dtype):
    from nanscan.kernels import fused

    gen = torch.Generator().manual_seed(11)
    xs = [cast(special_values(kind, 300 * 256, gen), dtype).reshape(300, 256) for kind in VALUE_KINDS]
    xs.append(xs[0].t())  # (strided: rows of the transposed shape)
    fn = torch.compile(lambda *ts: torch.ops.nanscan.summarize_many(list(ts)), backend="inductor", fullgraph=True)
    with no_caches():
        got = fn(*xs)
    for k, x in enumerate(xs):
        assert fused.kept_dims(x.shape) == 1
        assert_record_matches(got[k], reference.summarize(x), x, f"two stages, {dtype}, tensor {k}")
        assert_record_matches(fused.summarize(x), reference.summarize(x), x, f"two stages eager, {dtype}, tensor {k}")


def test_as_lowered_for_a_gpu_a_call_of_two_large_records_adds_one_kernel():
    """Note [a record in two stages] on a GPU's lowering, scheduled by Triton's rules (Note
    [Triton's fusion, scheduled on the CPU] in benchmarks/compiled_traffic.py): each tensor's rows
    are reduced in its producer's kernel, and the second stages of both records are one kernel --
    the call adds one kernel and reads nothing again (reduced as ten full reductions, a record is
    split by inductor into ten second stages; over [rows, 10], its second stage into two kernels)."""
    from benchmarks import compiled_traffic as ct
    from nanscan.kernels import fused

    def f(a, b):
        y, z = torch.tanh(a * b), torch.sigmoid(a + b)
        return y, z, torch.ops.nanscan.summarize_many([y, z])

    a, b = torch.randn(8, 128, 256), torch.randn(8, 128, 256)
    assert fused.kept_dims(a.shape) == 2
    a[3, 100, 7] = float("nan")
    with no_caches(), ct.as_if_lowered_for_a_gpu(), ct.Observer(triton_schedule=True) as obs:
        y, z, records = torch.compile(f, backend="inductor", fullgraph=True)(a, b)
    (g,) = obs.graphs
    tri = g["triton"]
    assert tri["record_kernels"]["standalone"] == 1, tri
    assert tri["record_kernels"]["fused"] >= 1 and tri["record_kernels"]["extra_bytes"] == {"fused": 0, "standalone": 0}
    assert tri["kernel_groups"] == tri["record_kernels"]["fused"] + 1, tri  # (the producers' kernels, and one)
    for k, t in enumerate((y, z)):
        assert_record_matches(records[k], reference.summarize(t), t, f"GPU lowering, tensor {k}")

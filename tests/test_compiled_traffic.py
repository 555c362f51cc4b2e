"""benchmarks/compiled_traffic.py: what a watched model's inductor graphs hold, pinned against a hand
count on Linear(4, 8) -> Tanh -> Linear(8, 2), batch 5, compiled with inductor on the CPU: the
record ops in the forward and backward graphs, the tensors they read and their bytes, which of
those tensors an extern kernel (the Linears' addmm, the backward's mm) or a generated kernel (tanh,
its backward) made, the kernels beside them; and no record op at all in the unwatched graphs."""
import json

import pytest
import torch
from torch import nn

from benchmarks import compiled_traffic as ct
from nanscan.monitor.trace_notes import LEAF_STAMPS
from nanscan.monitor.traced import GRAD_HOOKS

BATCH, F32 = 5, 4  # (fp32: 4 bytes an element)


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(BATCH, 4)


def step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def result():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield ct.measure_pair(make, step, warmup=2, rounds=1, steps=1)
    finally:
        torch.set_num_threads(before)


# The hand count. Module outputs recorded inside the forward graph, in order: the root's input x
# (5x4), then each leaf records its input with its outputs in one op (with LEAF_STAMPS; else an op
# for its input before its forward, one for its outputs after): Linear 0 [x, addmm (5x8)], Tanh
# [addmm, tanh (5x8)], Linear 2 [tanh, addmm_1 (5x2)]; then the root's output, addmm_1 again.
X, H, Y = BATCH * 4 * F32, BATCH * 8 * F32, BATCH * 2 * F32
FORWARD = {
    "ops": 5 if LEAF_STAMPS else 8,
    "values": [X, X, H, H, H, H, Y, Y],
    "producers": ["graph input", "graph input", "extern", "extern", "generated", "generated", "extern", "extern"],
}
# Backward (gradient hooks in the graph: torch 2.14, not 2.11): the gradient flowing into the root's
# output and into Linear 2's output (the same graph input, tangents_1, 5x2), into Tanh's output
# (Linear 2's input gradient: an mm) and into Linear 0's output (tanh's backward: generated).
BACKWARD = {"ops": 4, "values": [Y, Y, H, H], "producers": ["graph input", "graph input", "extern", "generated"]} \
    if GRAD_HOOKS else {"ops": 0, "values": [], "producers": []}


def graph(res, variant, kind):
    graphs = [g for g in res[variant]["graphs"] if g["kind"] == kind]
    assert len(graphs) == 1, f"{variant}: {len(graphs)} {kind} graphs"
    return graphs[0]


def values_of(g):
    return [v for r in g["record_ops"] for v in r["values"]]


@pytest.mark.parametrize("kind, expected", [("forward", FORWARD), ("backward", BACKWARD)])
def test_record_ops_their_bytes_and_producers_are_the_hand_count(result, kind, expected):
    g = graph(result, "watched", kind)
    assert len(g["record_ops"]) == expected["ops"]
    assert {r["op"] for r in g["record_ops"]} <= {"nanscan.stamp"}
    values = values_of(g)
    assert sorted(v["bytes"] for v in values) == sorted(expected["values"])
    assert sorted(v["producer"] for v in values) == sorted(expected["producers"])
    # Each tensor, by size: the Linears' outputs from addmm (forward) / mm (backward), tanh generated.
    by_producer = {}
    for v in values:
        by_producer.setdefault(v["producer"], set()).add((v["bytes"], v["kernel"] if v["producer"] == "extern"
                                                          else None))
    if kind == "forward":
        assert by_producer == {"graph input": {(X, None)}, "extern": {(H, "addmm"), (Y, "addmm")},
                               "generated": {(H, None)}}
        assert all(v["dtype"] == "float32" for v in values)
        assert {tuple(v["shape"]) for v in values} == {(BATCH, 4), (BATCH, 8), (BATCH, 2)}
    elif GRAD_HOOKS:
        assert by_producer == {"graph input": {(Y, None)}, "extern": {(H, "mm")}, "generated": {(H, None)}}
    # (the scheduler runs each record op as an extern call of its own, apart from the others)
    assert g["nanscan_calls"] == expected["ops"]


def test_read_by_a_generated_kernel(result):
    """Linear 0's addmm output is read by the tanh kernel (a record could ride along there); the
    last addmm's output and the batch x are read by no generated kernel of the forward."""
    read = {(v["bytes"], v["producer"]): v["read_by_generated"] for v in values_of(graph(result, "watched", "forward"))}
    assert read == {(X, "graph input"): False, (H, "extern"): True, (H, "generated"): False, (Y, "extern"): False}


def test_step_totals(result):
    t = result["watched"]["totals"]
    fw, bw = sum(FORWARD["values"]), sum(BACKWARD["values"])
    assert t["bytes"] == {"forward": fw, "backward": bw}
    assert t["records"] == {"forward": len(FORWARD["values"]), "backward": len(BACKWARD["values"])}
    assert t["record_ops"] == {"forward": FORWARD["ops"], "backward": BACKWARD["ops"]}
    producers = FORWARD["producers"] + BACKWARD["producers"]
    sizes = FORWARD["values"] + BACKWARD["values"]
    for p in ("graph input", "extern", "generated"):
        assert t["by_producer"][p] == {"records": producers.count(p),
                                       "bytes": sum(b for b, q in zip(sizes, producers) if q == p)}, p
    assert sum(x["bytes"] for x in t["by_producer"].values()) == fw + bw
    assert t["by_extern_kernel"]["addmm"] == {"records": 4, "bytes": 2 * H + 2 * Y}
    # distinct tensors: x, addmm, tanh, addmm_1 (and tangents_1, mm, tanh's backward)
    assert t["distinct"] == ({"records": 7, "bytes": X + 2 * H + Y + Y + 2 * H} if GRAD_HOOKS
                             else {"records": 4, "bytes": X + 2 * H + Y})
    # the steady step ran each compiled record op once (torch.profiler)
    assert result["watched"]["runtime_record_ops"] == {"nanscan.stamp": FORWARD["ops"] + BACKWARD["ops"]}


def test_unwatched_graphs_hold_no_record_op(result):
    u = result["unwatched"]
    assert [len(g["record_ops"]) for g in u["graphs"]] == [0, 0]
    assert [g["nanscan_calls"] for g in u["graphs"]] == [0, 0]
    assert u["totals"]["bytes"] == {"forward": 0, "backward": 0}
    assert u["runtime_nanscan_calls"] == {}


def test_kernels_and_extern_calls(result):
    for variant in ("unwatched", "watched"):
        fw, bw = graph(result, variant, "forward"), graph(result, variant, "backward")
        # forward: the two Linears are addmm calls, tanh the one generated kernel
        assert fw["extern_calls"] == {"addmm": 2}, variant
        assert bw["extern_calls"] == {"mm": 3}, variant
        assert result[variant]["compiled_after_first_step"] == 0, variant
        if variant == "watched":  # (its records are generated kernels too: test_record_reads)
            continue
        assert fw["generated_kernels"] == fw["kernel_calls_in_code"] == 1, variant
        # backward: three mm (the input gradient of Linear 2, the two weight gradients); tanh's
        # backward and the two bias gradients are generated (the C++ backend may merge two of them)
        assert bw["generated_kernels"] == 3, variant
        assert 2 <= bw["kernel_calls_in_code"] <= 3, variant


def test_inductors_byte_count(result):
    """``bytes_accessed``: inductor's count for ``metrics.num_bytes_accessed`` (every scheduler node's
    buffers), nanscan's calls apart. Unwatched, the forward holds at least the two addmm calls'
    inputs and outputs and tanh's read and write; the totals are the graphs' sums."""
    fw = graph(result, "unwatched", "forward")
    assert fw["bytes_accessed"] >= X + H + H + H + H + Y
    for variant in ("unwatched", "watched"):
        graphs = result[variant]["graphs"]
        assert result[variant]["totals"]["bytes_accessed"] == sum(g["bytes_accessed"] for g in graphs) > 0
        for g in graphs:  # split by kernel kind, buffer by buffer: the parts make the whole
            assert sum(g["bytes_by_kind"].values()) == g["bytes_accessed"], (variant, g["kind"])
    u = result["unwatched"]["totals"]["bytes_by_kind"]
    # unwatched: no record anywhere; the forward's addmm calls are extern, tanh a kernel of the step
    assert u["extern"] > 0 and u["step"] > 0
    assert u["fused_step"] == u["fused_records"] == u["records_step"] == u["records_records"] == 0
    assert "inductor's count" in ct.table(result) and "the step's own kernels" in ct.table(result)


@pytest.fixture(scope="module")
def fused_result():
    from nanscan import _ops
    from tests.test_fused_records import unregistered

    before, was = torch.get_num_threads(), _ops.FUSED_RECORDS
    torch.set_num_threads(1)
    _ops.FUSED_RECORDS = True
    torch._dynamo.reset()  # (the other fixture's graphs of the same code would be reused)
    try:
        with unregistered():  # (inductor's tables as they were, after: other tests compare with eager exactly)
            yield ct.measure_pair(make, step, warmup=2, rounds=0, steps=1, triton_schedule=True)
    finally:
        _ops.FUSED_RECORDS = was
        torch.set_num_threads(before)


def test_record_reads_of_the_opaque_ops(result):
    """Fused records off (the default): each stamp reads the tensors it records, no generated kernel
    computes a record."""
    w = result["watched"]["totals"]
    assert w["op_bytes"] == w["bytes"] and w["record_bytes_read"] == sum(w["bytes"].values())
    assert w["record_kernels"] == {"fused": 0, "standalone": 0}


def test_record_reads_fused(fused_result):
    """Records computed by generated kernels (Note [records fused into compiled kernels]): the
    stamps are given them and read no tensor; tanh's record rides in tanh's kernel (no extra
    read); the batch x and the addmm outputs, which no generated kernel writes, are read once
    each by a record kernel of their own (x, recorded twice, once: inductor computes one record)."""
    result = fused_result
    w, u = result["watched"]["totals"], result["unwatched"]["totals"]
    assert w["op_bytes"] == {"forward": 0, "backward": 0}
    fw, bw = graph(result, "watched", "forward"), graph(result, "watched", "backward")
    assert fw["record_kernels"]["fused"] == 1
    assert fw["record_kernels"]["extra_bytes"] == {"fused": 0, "standalone": X + H + Y}
    if GRAD_HOOKS:
        # tangents_1 and the mm once each; tanh's backward is recomputed inside its record kernel
        # (inlined: it reads the mm output and tanh's output again) rather than fused with its own
        assert bw["record_kernels"]["extra_bytes"] == {"fused": 0, "standalone": Y + H + 2 * H}
    assert w["record_bytes_read"] == sum(g["record_kernels"]["extra_bytes"]["standalone"]
                                         for g in result["watched"]["graphs"])
    assert u["record_bytes_read"] == 0 and u["record_kernels"] == {"fused": 0, "standalone": 0}


def test_triton_schedule_of_the_same_lowering(fused_result):
    """Note [Triton's fusion, scheduled on the CPU]: the same graphs scheduled by Triton's rules
    beside the C++ scheduler's (whose counts test_record_reads_fused pins with this on: the Triton
    schedule built first changes nothing of them). Triton fuses a pointwise producer into a
    reduction over its elements whatever its loop's shape, so its records read at most what the
    C++ backend's read, and tanh's record rides in tanh's kernel there too."""
    result = fused_result
    for g in result["watched"]["graphs"] + result["unwatched"]["graphs"]:
        tri = g["triton"]
        assert tri["kernel_groups"] >= 1
        assert sum(tri["record_kernels"]["extra_bytes"].values()) <= sum(g["record_kernels"]["extra_bytes"].values())
    fw = graph(result, "watched", "forward")
    assert fw["triton"]["record_kernels"]["fused"] >= 1
    assert fw["triton"]["record_kernels"]["extra_bytes"]["fused"] == 0
    w = result["watched"]["totals"]
    assert w["triton"]["record_bytes_read"] <= w["record_bytes_read"]
    assert result["unwatched"]["totals"]["triton"]["record_kernels"] == {"fused": 0, "standalone": 0}
    assert "Triton's scheduler" in ct.table(result)
    # the records' kernels are kernels too: inductor counts more bytes watched than unwatched
    for sched in (lambda t: t, lambda t: t["triton"]):
        assert sched(w)["bytes_accessed"] > sched(result["unwatched"]["totals"])["bytes_accessed"] > 0
        # ... split by kind: the records' partials are the records' own buffers, in record kernels
        # or fused ones; what the watched graph moves beyond the unwatched one is in those parts
        by_kind = sched(w)["bytes_by_kind"]
        assert sum(by_kind.values()) == sched(w)["bytes_accessed"]
        assert by_kind["fused_records"] + by_kind["records_records"] > 0
        assert sched(result["unwatched"]["totals"])["bytes_by_kind"]["records_records"] == 0
    for g in result["watched"]["graphs"]:
        assert sum(g["triton"]["bytes_by_kind"].values()) == g["triton"]["bytes_accessed"]


def test_kernel_calls_skip_the_kernels_sources():
    q = "'" * 3
    code = (f"triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', {q}\n"
            f"def triton_poi_fused_0(in_ptr0, xnumel):\n    pass\n{q})\n"
            f"cpp_fused_sum_1 = async_compile.cpp_pybinding(['float*'], r{q}\nvoid kernel(float* a) {{}}\n{q})\n"
            "def call(args):\n    triton_poi_fused_0.run(buf0, 8, stream=stream0)\n"
            "    triton_poi_fused_0.run(buf1, 8, stream=stream0)\n    cpp_fused_sum_1(buf2)\n"
            "    extern_kernels.mm(a, b, out=buf3)\n")
    assert ct.kernel_calls(code) == (2, 3)


def test_table_and_json(result):
    text = ct.table(result)
    assert "| nanscan record ops (forward + backward) | 0 + 0 = 0 | " in text
    assert f"| {FORWARD['ops']} + {BACKWARD['ops']} = {FORWARD['ops'] + BACKWARD['ops']} |" in text
    assert "| addmm | 4 |" in text
    listing = ct.record_listing(result)
    assert listing.count("nanscan.stamp [") == FORWARD["ops"] + BACKWARD["ops"]
    json.loads(json.dumps(result))

"""The FX passes nanscan gives inductor (nanscan/kernels/graph_passes.py): records kept out of the
partitioner's weighing and put back next to their tensors after it (Note [records the partitioner
does not weigh]), and stamps given their records taking no values (Note [a stamp given its records
takes no values])."""
from __future__ import annotations

import collections
import contextlib
import operator
import re

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
import torch._inductor.lowering

import nanscan
from nanscan import _ops
from nanscan.kernels import graph_passes
from tests.test_fused_records import no_caches, unregistered

WITH_EFFECTS = torch.ops.higher_order.with_effects
STAMP = torch.ops.nanscan.stamp.default


def joint_graph_with_records():
    """A joint graph as AOT autograd traces a watched model: a forward op, its record and stamp, a
    backward op on a tangent with its own record, a stamp."""
    graph = torch.fx.Graph()
    x = graph.placeholder("primals_1")
    tangent = graph.placeholder("tangents_1")
    token = graph.call_function(torch.ops.prims._make_token.default, ())
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    records = graph.call_function(torch.ops.nanscan.summarize_many.default, ([y],))
    stamped = graph.call_function(WITH_EFFECTS, (token, STAMP, [y], records, 7, 0, ""))
    token = graph.call_function(operator.getitem, (stamped, 0))
    z = graph.call_function(torch.ops.aten.sin.default, (y,))
    dy = graph.call_function(torch.ops.aten.mul.default, (tangent, y))
    grad_records = graph.call_function(torch.ops.nanscan.summarize_many.default, ([dy],))
    graph.output((z, dy, token, grad_records))
    return graph, dict(y=y, records=records, stamped=stamped, token=token, z=z, dy=dy, grad_records=grad_records)


def test_the_forwards_records_move_to_the_end_and_the_backwards_stay():
    graph, n = joint_graph_with_records()
    assert graph_passes.forward_records_last(graph) == 3  # (the summary, the stamp, its token)
    order = [node.name for node in graph.nodes]
    assert order.index(n["records"].name) > order.index(n["dy"].name) > order.index(n["z"].name)
    assert order[-4:-1] == [n["records"].name, n["stamped"].name, n["token"].name]
    assert order.index(n["grad_records"].name) == order.index(n["dy"].name) + 1  # (the backward's: kept)
    graph.lint()
    assert graph_passes.forward_records_last(graph) == 3  # (again: the same nodes, in the same place)
    assert [node.name for node in graph.nodes] == order


def test_a_record_that_a_node_of_the_model_uses_stays_where_it_is():
    """An effectful op of the user's chained on a stamp's token: the stamp before it cannot move."""
    graph = torch.fx.Graph()
    x = graph.placeholder("primals_1")
    token = graph.call_function(torch.ops.prims._make_token.default, ())
    records = graph.call_function(torch.ops.nanscan.summarize_many.default, ([x],))
    stamped = graph.call_function(WITH_EFFECTS, (token, STAMP, [x], records, 7, 0, ""))
    token = graph.call_function(operator.getitem, (stamped, 0))
    users = graph.call_function(WITH_EFFECTS, (token, torch.ops.aten._print.default, "step"))
    token = graph.call_function(operator.getitem, (users, 0))
    y = graph.call_function(torch.ops.aten.cos.default, (x,))
    graph.output((y, token))
    before = [node.name for node in graph.nodes]
    assert graph_passes.forward_records_last(graph) == 0
    assert [node.name for node in graph.nodes] == before


def test_after_the_partition_each_record_is_back_after_its_last_input():
    graph, n = joint_graph_with_records()
    original = [node.name for node in graph.nodes]
    graph_passes.forward_records_last(graph)
    assert graph_passes.records_after_inputs(graph) > 0
    graph.lint()
    assert [node.name for node in graph.nodes] == original
    assert graph_passes.records_after_inputs(graph) == 0


def test_a_record_of_two_tensors_goes_after_the_later_one_and_a_record_of_one_after_it():
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    b = graph.call_function(torch.ops.aten.exp.default, (a,))
    c = graph.call_function(torch.ops.aten.sin.default, (a,))
    first = graph.call_function(torch.ops.nanscan.summarize_many.default, ([b, c],))
    second = graph.call_function(torch.ops.nanscan.summarize.default, (b,))
    d = graph.call_function(torch.ops.aten.cos.default, (c,))
    graph.output((d, first, second))
    # a layout the partitioner could leave: the records at the end
    graph.output_node().prepend(first)
    graph.output_node().prepend(second)
    assert graph_passes.records_after_inputs(graph) > 0
    graph.lint()
    assert [node.name for node in graph.nodes] == [a.name, b.name, second.name, c.name, first.name, d.name, "output"]


def test_a_records_constant_goes_before_its_first_user_not_where_the_partition_left_it():
    """A decomposition's constants (a fill, an iota, a node made of those alone) read no value: left
    at the end of the forward, where the joint pass moved every record, they would hold there each
    record node that uses them, far from the value it records."""
    def record(node):
        node.meta["original_aten"] = torch.ops.nanscan.summarize_many.default
        return node

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.exp.default, (x,))
    fill = record(graph.call_function(torch.ops.aten.full.default, ([1], 0.0)))
    iota = record(graph.call_function(torch.ops.prims.iota.default, (4,), dict(start=0, step=1, dtype=torch.int64,
                                                                              device=torch.device("cpu"),
                                                                              requires_grad=False)))
    both = record(graph.call_function(torch.ops.aten.add.Tensor, (fill, iota)))
    part = record(graph.call_function(torch.ops.aten.mul.Tensor, (y, both)))
    z = graph.call_function(torch.ops.aten.sin.default, (y,))
    w = graph.call_function(torch.ops.aten.cos.default, (z,))
    graph.output((w, part))
    for node in (fill, iota, both, part):  # (as the joint pass leaves them: at the end of the forward)
        graph.output_node().prepend(node)
    assert graph_passes.records_after_inputs(graph) > 0
    graph.lint()
    assert [node.name for node in graph.nodes] == [x.name, y.name, fill.name, iota.name, both.name, part.name,
                                                   z.name, w.name, "output"]


def test_a_decompositions_nodes_are_records_and_the_models_are_not():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    amax = graph.call_function(torch.ops.aten.amax.default, (x,))
    assert not graph_passes.is_record(amax)
    amax.meta["original_aten"] = torch.ops.nanscan.summarize_many.default
    assert graph_passes.is_record(amax)
    item = graph.call_function(operator.getitem, (amax, 0))
    assert graph_passes.is_record(item) and not graph_passes.is_record(x)


def test_the_post_grad_pass_empties_the_values_of_stamps_given_records_only():
    """Note [a stamp given its records takes no values]: on a graph with a stamp given its records
    and one without, the pass takes the first's values away (kept in its meta) and leaves the
    second."""

    def graph_of_two_stamps():
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        token = graph.call_function(torch.ops.prims._make_token.default, ())
        records = graph.call_function(torch.ops.nanscan.summarize_many.default, ([x],))
        given = graph.call_function(WITH_EFFECTS, (token, STAMP, [x], records, 7, 0, ""))
        token = graph.call_function(operator.getitem, (given, 0))
        summarized = graph.call_function(WITH_EFFECTS, (token, STAMP, [x], None, 7, 1, ""))
        graph.output((graph.call_function(operator.getitem, (summarized, 0)),))
        return graph, x, given, summarized

    graph, x, given, summarized = graph_of_two_stamps()
    assert graph_passes.stamps_take_no_values(graph) == 1
    assert given.args[2] == [] and given.meta[graph_passes.RECORDED] == [x]
    assert summarized.args[2] == [x] and graph_passes.RECORDED not in summarized.meta
    graph, x, given, _ = graph_of_two_stamps()
    graph_passes.RecordsInPlace()(graph)
    assert given.args[2] == []


@pytest.mark.parametrize("kind, slot", [(graph_passes.RecordsLastForThePartition, "joint_custom_post_pass"),
                                        (graph_passes.RecordsInPlace, "post_grad_custom_post_pass")])
def test_each_pass_runs_after_the_one_configured_before_it_and_is_installed_once(kind, slot):
    seen = []

    class Before(CustomGraphPass):
        def __call__(self, graph):
            seen.append([node.name for node in graph.nodes])

        def uuid(self):
            return "before"

    graph, n = joint_graph_with_records()
    original = [node.name for node in graph.nodes]
    kind(Before())(graph)
    assert seen == [original]  # (the configured pass saw the graph first)
    assert kind(Before()).uuid()[-1] == "before" and kind(Before()).uuid()[:-1] == kind().uuid()
    assert kind(lambda graph: None).uuid() is None  # (no key: inductor does not cache)
    assert graph_passes.RecordsInPlace().uuid() != graph_passes.RecordsLastForThePartition().uuid()
    with inductor_config.patch(**{slot: Before()}):
        graph_passes.install()
        installed = getattr(inductor_config, slot)
        assert isinstance(installed, kind) and isinstance(installed.before, Before)
        graph_passes.install()  # (once: not chained after itself)
        assert getattr(inductor_config, slot) is installed


class Mlp(nn.Module):
    """A transformer's MLP: the GELU whose backward terms the partitioner weighs against the
    matmul's output."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _is_view(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and not alias.is_write


def saved_by_the_forward(graph: torch.fx.Graph) -> collections.Counter:
    """The ops that wrote what a forward graph returns (through views), but its tokens: what the
    step keeps for the backward, by who wrote it."""
    (output,) = [node for node in graph.nodes if node.op == "output"]
    made = collections.Counter()
    for node in output.args[0]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        while _is_view(node.target):
            node = node.args[0]
        made["an input" if node.op == "placeholder" else str(node.target)] += 1
    return made


def compiled_forward_saves(watched: bool, fused: bool, passes: bool = True) -> collections.Counter:
    graphs = []

    class Spy(CustomGraphPass):
        def __call__(self, graph):
            graphs.append(saved_by_the_forward(graph))

        def uuid(self):
            return None

    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    was = _ops.FUSED_RECORDS
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_caches())
        stack.enter_context(inductor_config.patch(post_grad_custom_post_pass=Spy(), joint_custom_post_pass=None))
        stack.callback(setattr, _ops, "FUSED_RECORDS", was)
        stack.enter_context(unregistered())  # (the decomposition registered by the watch below, if fused)
        _ops.FUSED_RECORDS = fused
        if not passes:
            stack.enter_context(_passes_uninstalled())
        if watched:
            stack.enter_context(nanscan.watch(model, opt))
        run = torch.compile(model, backend="inductor")
        run(torch.randn(8, 32, 64)).square().mean().backward()
    return graphs[0]  # (the forward's: inductor compiles it first)


@contextlib.contextmanager
def _passes_uninstalled():
    install = graph_passes.install
    graph_passes.install = lambda: None
    try:
        yield
    finally:
        graph_passes.install = install


@pytest.mark.parametrize("fused", [False, True], ids=["opaque records", "fused records"])
def test_a_watched_compiled_forward_saves_what_the_unwatched_one_saves(fused):
    unwatched = compiled_forward_saves(watched=False, fused=False)
    assert unwatched["aten.addmm.default"] >= 1, unwatched  # (the up projection's output, written anyway)
    assert compiled_forward_saves(watched=True, fused=fused) == unwatched


def test_a_joint_graphs_fused_records_move_last_and_come_back_with_their_constants():
    """The decomposition's nodes move with the records (Note [records the partitioner does not
    weigh]), its constants too, and all come back where dynamo traced them."""
    graph, n = joint_graph_with_records()
    fill = graph.call_function(torch.ops.aten.full.default, ([1], 0.0))
    part = graph.call_function(torch.ops.aten.amax.default, (n["y"],))
    both = graph.call_function(torch.ops.aten.maximum.default, (part, fill))
    for node in (part, fill, both):  # (as traced: the constant just before its user)
        node.meta["original_aten"] = torch.ops.nanscan.summarize_many.default
        n["records"].prepend(node)
    n["records"].args = ([both],)  # (the decomposition's result feeds the op it stands for, here)
    traced = [node.name for node in graph.nodes]
    assert graph_passes.forward_records_last(graph) == 6
    moved = [node.name for node in graph.nodes]
    assert moved[-7:-1] == [part.name, fill.name, both.name, n["records"].name, n["stamped"].name, n["token"].name]
    graph.lint()
    graph_passes.records_after_inputs(graph)
    graph.lint()
    assert [node.name for node in graph.nodes] == traced


STAMP_CALL = re.compile(r"torch\.ops\.nanscan\.stamp\.default\(.*, (\d+), (\d+), '[^']*'\)\s*$", re.MULTILINE)


def stamps_as_compiled_and_as_traced(fused: bool, lowering: bool = True):
    """The stamps' rows in the order the compiled forward calls them, and in the order of its FX
    graph (the order dynamo traced them), for one step of a watched model whose compiled forward
    inductor reorders for peak memory (the test_monitor_compiled recompile model, armed)."""
    from tests.test_monitor_compiled import ArmedNet

    traced = []

    class Spy(CustomGraphPass):
        def __call__(self, graph):
            traced.append([n.args[5] for n in graph.nodes if n.target is WITH_EFFECTS and n.args[1] is STAMP])

        def uuid(self):
            return None

    torch.manual_seed(0)
    model = ArmedNet()
    model.blocks[1].sq.armed = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    was, lowerings = _ops.FUSED_RECORDS, torch._inductor.lowering.lowerings
    codes = []
    with contextlib.suppress(nanscan.NonFiniteError), contextlib.ExitStack() as stack:  # (the armed gradient)
        stack.enter_context(no_caches())
        stack.enter_context(inductor_config.patch(post_grad_custom_post_pass=Spy(), joint_custom_post_pass=None))
        stack.callback(setattr, _ops, "FUSED_RECORDS", was)
        stack.enter_context(unregistered())
        _ops.FUSED_RECORDS = fused
        own = lowerings.pop(STAMP, None)
        stack.callback(lambda: lowerings.__setitem__(STAMP, own) if own is not None else lowerings.pop(STAMP, None))
        if not lowering:
            stack.enter_context(_lowering_not_installed())
        stack.enter_context(nanscan.watch(model, opt))
        run = torch.compile(model, backend="inductor")
        _, codes = run_and_get_code(lambda: run(torch.randn(4, 8)).square().mean().backward())
    compiled = [int(row) for _, row in STAMP_CALL.findall(codes[0])]
    return compiled, traced[0]


@contextlib.contextmanager
def _lowering_not_installed():
    install = graph_passes._install_stamp_lowering
    graph_passes._install_stamp_lowering = lambda: True  # (the joint pass installed, not the lowering)
    try:
        yield
    finally:
        graph_passes._install_stamp_lowering = install


@pytest.mark.parametrize("fused", [False, True], ids=["opaque records", "fused records"])
def test_the_compiled_forward_calls_its_stamps_in_the_order_they_were_traced(fused):
    """Note [stamps run in the order they were traced]: inductor's peak-memory reordering does not
    move a stamp before the one traced before it."""
    compiled, traced = stamps_as_compiled_and_as_traced(fused)
    assert len(traced) > 10 and compiled == traced

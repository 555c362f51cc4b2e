"""The FX passes nanscan gives inductor for a watched graph: where the records sit when AOT autograd
partitions the joint graph (Note [records the partitioner does not weigh]), and, with records fused,
a stamp given its records no longer names the tensors they are of (Note [a stamp given its records
takes no values]); and the stamp's lowering, which keeps the stamps in the order they were traced
(Note [stamps run in the order they were traced]).

Note [stamps run in the order they were traced]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A stamp writes its rows with the next value of the monitor's counter, and that sequence is the
compiled rows' production order: which row is first, which trace's graph ran (traced.py). The
stamp is an ordered effect, and AOT autograd threads a token through the stamps in the order dynamo
traced them; inductor lowers each one after a dependency on the previous effectful kernel -- but
registers that dependency under the kernel's buffer name, while its scheduler looks it up by the
operation's name (torch 2.11 -- 2.14), so it is never applied. The stamps then keep their order only
while nothing reorders the schedule, and inductor's peak-memory reordering (on by default) does: a
watched MLP's forward ran its stamps as rows 141, 161, 60, 100, 21, ... where it traced 21, 60, 100,
121, 141, and its incident lost the module that made it. So nanscan gives inductor the stamp's
lowering (the same fallback kernel) with the dependency on the stamp lowered before it registered
under the name the scheduler reads. Where the scheduler does not read those names, the lowering is
not installed, and neither is the joint-graph pass below, which moves stamps: they stay where dynamo
traced them, each after the tensors it reads, in inductor's order as without nanscan's passes.

Note [records the partitioner does not weigh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
AOT autograd's min-cut partitioner chooses what the forward saves for the backward, and what the
backward recomputes, from the joint graph's nodes and their order. Its heuristics read the records
as part of the model: a stamp is an op no kernel fuses with, so ``ban_recompute_used_far_apart``
bans recomputing what a tensor's stamp uses before the next pointwise op does (a GELU's inner
terms, right after the matmul that feeds them); the fused records' decomposition adds hundreds of
nodes to the forward's order, so ``ban_if_long_fusible_chains`` finds chains "too long" that were
not; and a tensor a stamp reads counts as materialized. On the benchmark GPT the watched forward then
saved a GELU's backward term (a tensor a pointwise kernel must now write, 4 MiB a layer) instead of
the matmul's output (written anyway): +16 MiB of writes a step, for records that change nothing the
model computes.

So before the partitioner sees the joint graph (``joint_custom_post_pass``), the forward's records --
the summary ops, their decompositions' nodes and the stamps, with the getitems of their outputs --
move to just before the graph's output, where no heuristic weighs them against the model's nodes:
the partition is the unwatched graph's. A record whose result a node of the model uses (an
effectful op of the user's, chained on a stamp's token) stays where it is. Then, after the
partition (``post_grad_custom_post_pass``), every record moves back to just after the last of its
inputs, in the forward and in the backward graph alike: an opaque stamp at the end of the forward
would keep each tensor it reads alive until then. The records are the same records of the same
tensors: the passes move nodes, and change none.

With records fused (``NANSCAN_FUSED_RECORDS=1``) the decomposition's nodes move too. Among them are
constants -- fills and iotas that read no value, and nodes made of those alone --, which go back
just before their first user, not after their (no) inputs: left at the end of the forward they held
there every record node that used them, far from the value it records, and inductor fused those
records worse than left in place (687.83 MiB against 605.13). Moved and back, constants included,
the step's bytes are 570.08 MiB (unwatched 539.69: the records' cost +30.39, was +65.44 in place);
with the opaque ops they went from 558.23 to 529.31 MiB (python -m benchmarks.compiled_traffic
--rounds 0 --gpu-lowering, Triton's schedule: inductor's count, nanscan's calls apart).

Note [a stamp given its records takes no values]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With records fused (Note [records fused into compiled kernels] in nanscan/_ops.py) the traced hooks
call ``nanscan::stamp(values, records, ...)`` with the records computed by the graph's own kernels:
the stamp copies ``records`` into the monitor's buffer and never reads ``values``. They are there for
the trace: the stamp's fake kernel notes, while dynamo traces, each value's dtype, static shape,
identity and version (nanscan/monitor/trace_notes.py) -- the one moment Python runs for a hook. But
inductor lowers the stamp as an extern (fallback) kernel, and every tensor argument of an extern
kernel is realized: written to memory. A value that inductor would otherwise keep in registers --
an embedding sum, a GELU's output that only the next matmul reads, a gradient summed into its
consumer -- is then written (and counted as read by the stamp), the traffic fused records exist to
avoid.

So after AOT autograd and inductor's own FX passes, this pass (``post_grad_custom_post_pass``)
empties the ``values`` of every ``with_effects(nanscan.stamp, values, records, ...)`` node whose
``records`` is given; the kernel then writes one row per row of ``records`` (csrc/monitor/
stamp_rows.cpp). Nothing is lost: the records are the values' (summarize_many's decomposition, in
the graph), the rows they go to are the same, and what the trace noted was noted by dynamo's pass,
before this one. The values are kept in the node's ``meta[RECORDED]`` for tools that account for
the graph (benchmarks/compiled_traffic.py). A stamp without records (its kernel summarizes the
values) is left as it is.

Both passes are installed when a monitor first traces its hooks, once per process, each chained
after the pass the user set before in its slot (a callable or, on torch >= 2.12, a list of them);
one the user sets later replaces it, which costs bytes (the partition above, the values realized
again), never a wrong record. Each pass's ``uuid`` is this file's hash with the chained pass's:
inductor's FX graph cache keys a graph by it.
"""
from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

RECORDED = "nanscan_recorded"  # node.meta key: the values a stamp's given records are of


def bound_arguments(op, positional, kwargs) -> dict:
    """``op``'s arguments by their schema names (``positional`` in schema order, then ``kwargs``)."""
    bound = dict(zip((a.name for a in op._schema.arguments), positional))
    bound.update(kwargs)
    return bound


def stamps_take_no_values(graph: torch.fx.Graph) -> int:
    """Empty the ``values`` of ``graph``'s stamps given their records (their FX nodes kept in
    ``meta[RECORDED]``); returns how many stamps were changed."""
    with_effects = getattr(torch.ops.higher_order, "with_effects", None)
    stamp = torch.ops.nanscan.stamp.default
    names = [a.name for a in stamp._schema.arguments]
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not with_effects or len(node.args) < 2 \
                or node.args[1] is not stamp:
            continue
        positional, kwargs = list(node.args[2:]), dict(node.kwargs)
        bound = bound_arguments(stamp, positional, kwargs)
        values, records = bound.get("values"), bound.get("records")
        if not isinstance(records, torch.fx.Node) or not values:
            continue
        node.meta[RECORDED] = list(values)
        if "values" in kwargs:
            kwargs["values"] = []
        else:
            positional[names.index("values")] = []
        node.args, node.kwargs = (*node.args[:2], *positional), kwargs
        changed += 1
    return changed


def is_record(node: torch.fx.Node) -> bool:
    """Whether ``node`` is part of a record: a nanscan op (a summary, or a stamp under
    ``with_effects``), a node of a summary op's decomposition, or a getitem of one of these."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return is_record(node.args[0])
    if target is getattr(torch.ops.higher_order, "with_effects", None) and len(node.args) > 1:
        target = node.args[1]
    if getattr(target, "namespace", None) == "nanscan":
        return True
    # (A decomposition's nodes carry the op they were traced from.)
    return getattr(node.meta.get("original_aten"), "namespace", None) == "nanscan"


def _is_tangent(node: torch.fx.Node) -> bool:
    # (How AOT autograd names the joint graph's backward inputs; its partitioner tells them so too.)
    return node.op == "placeholder" and "tangents" in str(node.target)


def forward_records_last(graph: torch.fx.Graph) -> int:
    """Move the forward's records of a joint graph to just before its output (Note [records the
    partitioner does not weigh]); returns how many nodes moved. A node is the backward's if it
    depends on a tangent; a record stays where it is if a node other than a moved record or the
    output uses it."""
    output = None
    backward: set = set()
    for node in graph.nodes:
        if node.op == "output":
            output = node
        elif _is_tangent(node) or any(i in backward for i in node.all_input_nodes):
            backward.add(node)
    if output is None:
        return 0
    movable: set = set()
    for node in reversed(graph.nodes):
        if node in backward or not is_record(node):
            continue
        if all(user is output or user in movable for user in node.users):
            movable.add(node)
    if not movable:
        return 0
    for node in [n for n in graph.nodes if n in movable]:  # (in their order: each after its inputs)
        output.prepend(node)
    return len(movable)


def records_after_inputs(graph: torch.fx.Graph) -> int:
    """Move each record of ``graph`` to just after the last of its inputs (records in their order
    where they share one; Note [records the partitioner does not weigh]); returns how many nodes
    changed place. One pass: each node gets a key, (its place, -1) for the model's nodes, (the key
    of its latest input's place, its own place) for a record, and the nodes are laid out by key --
    a record after all its inputs, its users after it."""
    nodes = list(graph.nodes)
    if not any(is_record(n) for n in nodes):
        return 0
    key: dict = {}
    # A record's node that reads no value (a decomposition's constant: a fill, an iota, or made of
    # those alone) goes just before its first user: left where it was -- at the end of the forward,
    # after the joint pass -- it would anchor there every record node that uses it, far from the
    # value that node records (inductor then fused the records worse: 687.83 MiB against 605.13).
    constants: set = set()
    for place, node in enumerate(nodes):
        inputs = [i for i in node.all_input_nodes if i not in constants]
        if is_record(node) and not inputs:
            constants.add(node)
        elif is_record(node):
            anchor = max(key[i] for i in inputs)
            key[node] = (anchor[0], place)
        else:
            key[node] = (place, -1)
    for node in reversed(nodes):  # (its users first: each constant just before the first of them)
        if node in constants:
            first = min((key[user] for user in node.users), default=(len(nodes), 0))
            key[node] = (first[0], first[1] - 0.5)
    order = sorted(nodes, key=key.__getitem__)
    if order == nodes:
        return 0
    moved = sum(1 for a, b in zip(order, nodes) if a is not b)
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node
    return moved


class _Chained(CustomGraphPass):
    """A pass of this file's, after ``before`` (the pass that was configured in its slot, if any)."""

    def __init__(self, before=None):
        self.before = before

    def _before(self) -> tuple:
        if self.before is None:
            return ()
        return tuple(self.before) if isinstance(self.before, (list, tuple)) else (self.before,)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for chained in self._before():
            chained(graph)
        self.run(graph)

    def run(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def uuid(self):
        chained = []
        for p in self._before():
            key = p.uuid() if isinstance(p, CustomGraphPass) else None
            if key is None:  # (a pass without a key: inductor cannot cache the graph, as before)
                return None
            chained.append(key)
        return (get_hash_for_files((__file__,)), type(self).__name__, *chained)


class RecordsLastForThePartition(_Chained):
    """The joint graph's pass: :func:`forward_records_last`."""

    def run(self, graph: torch.fx.Graph) -> None:
        forward_records_last(graph)


class RecordsInPlace(_Chained):
    """The post-grad pass: :func:`records_after_inputs`, then :func:`stamps_take_no_values`."""

    def run(self, graph: torch.fx.Graph) -> None:
        records_after_inputs(graph)
        stamps_take_no_values(graph)


_LAST_STAMP = "_nanscan_last_stamp"  # (on inductor's GraphLowering: the stamp lowered last)


def lower_stamp_in_order(*args, **kwargs):
    """Inductor's lowering of ``nanscan::stamp`` (Note [stamps run in the order they were traced]):
    the fallback kernel inductor would make, after the stamp lowered before it in the graph. Only
    the stamp's kernel waits for it: the kernels that compute its records (made here, when the
    stamp realizes them) stay free to fuse with their producers."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    graph = V.graph
    first = len(graph.operations)
    ir.FallbackKernel.create(torch.ops.nanscan.stamp.default, *args, **kwargs)
    stamp_op = torch.ops.nanscan.stamp.default
    stamps = [op for op in graph.operations[first:] if getattr(op, "op_overload", None) is stamp_op]
    previous = getattr(graph, _LAST_STAMP, None)
    for stamp in stamps:
        if previous is not None:
            graph.additional_star_deps[stamp.get_operation_name()].add(previous.get_name())
        previous = stamp
    setattr(graph, _LAST_STAMP, previous)
    return None


def _install_stamp_lowering() -> bool:
    """Register :func:`lower_stamp_in_order`; whether inductor's scheduler reads the dependencies
    it adds (``GraphLowering.additional_star_deps``: else the stamps' order is inductor's own)."""
    try:
        from torch._inductor import lowering
        from torch._inductor.scheduler import Scheduler

        if "additional_star_deps" not in Scheduler.compute_dependencies.__code__.co_names:
            return False
        lowering.lowerings[torch.ops.nanscan.stamp.default] = lower_stamp_in_order
        return True
    except Exception:  # pragma: no cover - an inductor laid out otherwise
        return False


def install() -> None:
    """Make the passes inductor's ``joint_custom_post_pass`` and ``post_grad_custom_post_pass``
    (once: an installed one is kept), and the stamp's lowering :func:`lower_stamp_in_order`. A
    torch without either slot keeps its own partition: bytes, never a record."""
    import torch._inductor.config as inductor_config

    passes = [("post_grad_custom_post_pass", RecordsInPlace)]
    # (Records moved in the joint graph rely on the stamps keeping their order: Note [stamps run in
    # the order they were traced].)
    if _install_stamp_lowering():
        passes.append(("joint_custom_post_pass", RecordsLastForThePartition))
    for slot, kind in passes:
        if not hasattr(inductor_config, slot):  # pragma: no cover - an older torch
            continue
        current = getattr(inductor_config, slot)
        if not isinstance(current, kind):
            setattr(inductor_config, slot, kind(current))

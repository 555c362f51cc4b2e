"""The post-grad pass inductor runs on a watched graph when records are fused: a stamp given its
records no longer names the tensors they are of (Note [a stamp given its records takes no values]).

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

Installed with the fused records' decomposition, once per process, chained after a pass the user
set before (a callable or, on torch >= 2.12, a list of them); one the user sets later replaces it,
which costs bytes (the values realized again), never a wrong record. Its ``uuid`` is this file's
hash with the chained pass's: inductor's FX graph cache keys a graph by it.
"""
from __future__ import annotations

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


class StampsTakeNoValues(CustomGraphPass):
    """:func:`stamps_take_no_values`, after ``before`` (the pass that was configured, if any)."""

    def __init__(self, before=None):
        self.before = before

    def _before(self) -> tuple:
        if self.before is None:
            return ()
        return tuple(self.before) if isinstance(self.before, (list, tuple)) else (self.before,)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for chained in self._before():
            chained(graph)
        stamps_take_no_values(graph)

    def uuid(self):
        chained = []
        for p in self._before():
            key = p.uuid() if isinstance(p, CustomGraphPass) else None
            if key is None:  # (a pass without a key: inductor cannot cache the graph, as before)
                return None
            chained.append(key)
        return (get_hash_for_files((__file__,)), *chained)


def install() -> None:
    """Make the pass inductor's ``post_grad_custom_post_pass`` (once: an installed one is kept)."""
    import torch._inductor.config as inductor_config

    current = inductor_config.post_grad_custom_post_pass
    if not isinstance(current, StampsTakeNoValues):
        inductor_config.post_grad_custom_post_pass = StampsTakeNoValues(current)

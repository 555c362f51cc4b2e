"""Compiled-graph traffic: what a watched model's ``torch.compile`` (inductor) graphs hold, read from
the graphs inductor compiles -- groundwork for fusing the records into inductor's kernels (#45).

Per training step of a model compiled with inductor, watched (``nanscan.watch`` then
``torch.compile``) beside the same model unwatched:

1. **Generated kernels** (forward + backward graphs): the kernels inductor writes for the step,
   launched once each, beside the extern kernels it calls (mm, addmm, SDPA ...).
2. **Record ops**: the standalone ``torch.ops.nanscan.*`` calls in the compiled graphs (the traced
   hooks' ``nanscan::stamp``; inductor runs each as an extern / fallback kernel, counted apart
   from the generated ones), the tensors they read and the bytes (numel x itemsize of each).
3. **Producers**: for each tensor a record op reads, what made it -- a kernel inductor generated
   (the record could be fused into it: #45 item 1), an extern kernel (mm / addmm / bmm /
   convolution / SDPA ...: a record of it keeps a separate read, unless a generated kernel that
   reads the tensor anyway takes it), or a graph input (made outside this graph: the batch, a
   gradient flowing in) -- with the bytes of each class.
4. **Step time**, watched / unwatched, from interleaved rounds (a side column).

How each number is obtained
---------------------------
Everything but the time comes from inductor's own lowering of each graph, observed while the
models compile (their first steps), with inductor's caches off for that (``force_disable_caches``:
a cache hit would skip the lowering, and the counts with it):

- ``GraphLowering.run_node`` is wrapped. ``GraphLowering`` is inductor's lowering of one post-grad
  FX graph -- the graph after AOT autograd split it into forward and backward and after inductor's
  FX passes (the same graph a ``post_grad_custom_post_pass`` sees), and ``is_backward`` says which
  it is. When the node being lowered calls a ``nanscan`` op -- directly, or, the traced hooks'
  effectful ``stamp``, inside ``higher_order.with_effects`` -- its tensor arguments are the values
  recorded (or, a stamp given its records, the values the fused records' post-grad pass took from
  it and kept in the node's meta: Note [a stamp given its records takes no values]): their bytes
  come from the FX nodes' ``meta['val']`` (numel x itemsize), and their
  producers from the IR inductor made for the op: the fallback kernel created for the node lists
  the buffers it reads (``inputs``); each is followed through views to its buffer, whose class
  says who writes it -- ``ComputedBuffer``: a generated kernel (``TemplateBuffer``: a generated
  template, e.g. a Triton matmul, whose epilogue is generated too), ``ExternKernel`` (and the
  ``MultiOutput`` of one, e.g. SDPA): an extern kernel, named, ``InputBuffer``: a graph input,
  ``ConcatKernel`` (a cat, e.g. of q, k, v's gradients): generated when the kernels writing its
  parts are (an extern part is copied in by a generated kernel). A buffer created while the record
  op itself was lowered that is not the value's own storage (realized for the op: a pointwise value
  becomes a generated kernel then) is a copy made for the record (a view inductor had to make
  contiguous). This uses the IR, not a table of op names: whether inductor
  generates an op or calls an extern kernel for it depends on the op, the device and the config
  (mm is an extern call by default, a Triton template under max-autotune).
- ``GraphLowering.save_output_code`` (the hook ``torch._inductor.utils.run_and_get_code`` uses)
  keeps each graph's output code: **generated kernels launched** are the calls, in its wrapper, of
  the kernels it defines (``name = async_compile.triton(...)`` / ``.cpp_pybinding(...)``; a call is
  ``name(`` or ``name.run(`` outside the kernels' sources). ``GraphLowering.codegen`` is wrapped:
  the increase of ``torch._inductor.metrics.generated_kernel_count`` while that graph's code is
  generated is inductor's own count (one per kernel object its codegen makes; its tests pin fusion
  with it), shown beside. For Triton the source makes one kernel object per kernel (not run here);
  the C++ backend makes several per kernel (its vectorized and scalar variants) and merges a
  pointwise kernel with the reduction after it at codegen (the outer-loop fusion), so on the CPU
  the metric is several times the calls, and the calls are the number. After
  codegen, the graph's scheduler nodes (after fusion) are walked: ``ExternKernelSchedulerNode`` s
  are the **extern calls** (the nanscan ones apart; a ``MultiOutput`` is part of its call), and
  the ``read_writes.reads`` of the other non-nop nodes (the generated kernels) tell whether a
  generated kernel of the same graph reads a recorded tensor too ("read by a generated kernel":
  where a record of a tensor that no generated kernel writes could ride along in a consumer).

  Why these hooks: ``GraphLowering.run_node`` / ``codegen`` / ``save_output_code``, ``is_backward``,
  the IR classes and ``metrics.generated_kernel_count`` are the same in torch 2.11 (the GPU
  machine's; read in its wheel's source, not run) and 2.14 (here); the lowered IR is the only
  place where the producer's class is a fact rather than a guess from an op's name.
  ``post_grad_custom_post_pass`` would see the same FX graph but not the IR (nor the kernels);
  TORCH_LOGS=output_code is the same text as ``save_output_code``, through logging;
  ``run_and_get_code`` itself resets dynamo, and ``config.debug`` writes files.
- Per step: each compiled graph is taken to run once per step (one forward and one backward graph
  per graph break; recompiles are counted: "graphs compiled after the first step"). The record ops
  that actually run in a steady step are counted too, under ``torch.profiler`` (CPU activity: the
  compiled wrapper calls the nanscan op through the dispatcher, which the profiler sees; a
  dispatch mode would make dynamo skip the frame): they must equal the compiled count.
- Step time: two models, one watched then compiled, one compiled bare (same seed, same inductor
  options), warmed up; dynamo guards on module hooks for the whole run
  (``skip_nnmodule_hook_guards=False``; Note [two instances of one class]: by default the bare
  model's graph, compiled later, would run for the watched model too, without its hooks). Rounds
  alternate the two (the order flipped every round), each round
  ``--steps`` steps (synchronized on CUDA); the ratio is the median watched / median unwatched
  step. On the CPU it runs on 1 thread by default (``--threads``), as benchmarks/traffic.py does.

The model is the benchmark GPT (benchmarks/models.py, AdamW, benchmarks/bench_monitor.py's plain
loop); the defaults are the CPU benchmark's (4 layers, d=256, 4 heads, vocab 1024, seq 128, batch
8; fp32 on the CPU, bf16 autocast on CUDA, as bench_monitor.py). GPT-2-small's shapes for a GPU run::

    python -m benchmarks.compiled_traffic --device cuda --layers 12 --d 768 --heads 12 --vocab 50257 \\
        --seq 512 --batch 8 --json compiled-traffic-gpt2-small.json

    python -m benchmarks.compiled_traffic [--layers N --d D --heads H --vocab V --seq S --batch B]
        [--device cpu|cuda] [--autocast none|bf16] [--rounds R --steps K] [--threads T] [-v]
        [--triton-schedule | --gpu-lowering] [--json out.json]

On the CPU, ``--triton-schedule`` adds Triton's fusion of the same lowering and ``--gpu-lowering``
lowers as inductor does for an H100 first (Note [Triton's fusion, scheduled on the CPU]).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from unittest import mock

import torch

import nanscan
from nanscan.kernels.graph_passes import RECORDED, bound_arguments

# The classes of a recorded tensor's producer.
GENERATED, TEMPLATE, EXTERN, INPUT, COPY, OTHER = ("generated", "template", "extern", "graph input",
                                                   "copy for the record", "other")
PRODUCERS = (GENERATED, TEMPLATE, EXTERN, INPUT, COPY, OTHER)
FUSIBLE = (GENERATED, TEMPLATE)  # made by a kernel inductor generates: a record could ride along


def _nanscan_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "nanscan"


def _record_call(node: torch.fx.Node):
    """(op, its arguments) when ``node`` calls a nanscan op, directly or in ``with_effects``; else None."""
    if node.op != "call_function":
        return None
    if _nanscan_op(node.target):
        return node.target, (node.args, node.kwargs)
    if node.target is getattr(torch.ops.higher_order, "with_effects", None) and len(node.args) > 1 \
            and _nanscan_op(node.args[1]):
        return node.args[1], (node.args[2:], node.kwargs)
    return None


def _tensor_nodes(args) -> list:
    """The FX nodes holding tensors in ``args``, in pytree order (the order inductor flattens them in)."""
    leaves = torch.utils._pytree.tree_leaves(args)
    return [a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _nbytes(t: torch.Tensor):
    numel = t.numel()
    try:
        numel = int(numel)
    except Exception:  # (a symbolic size without a hint)
        return None
    return numel * t.element_size()


def _short(name: str) -> str:
    for prefix in ("extern_kernels.", "torch.ops.", "aten."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.removesuffix(".default").removesuffix(".out")


def _kernel_name(kernel) -> str:
    op = getattr(kernel, "op_overload", None)
    if op is not None:
        return _short(str(op))
    return _short(getattr(kernel, "python_kernel_name", None) or type(kernel).__name__)


def _buffer(node):
    """Follow boxes and views down to the buffer that holds ``node``'s storage."""
    from torch._inductor import ir

    for _ in range(64):
        if not isinstance(node, (ir.MutableBox, ir.BaseView)):
            return node
        node = node.data
    return node


def _buffer_name(buffer):
    """The name of an IR buffer; None for values not realized (inductor's loops have none)."""
    from torch._inductor import ir

    return None if isinstance(buffer, ir.Loops) or not hasattr(buffer, "get_name") else buffer.get_name()


def classify(buffer, created: set, graph_inputs: set) -> tuple:
    """(producer class, kernel name) of the IR buffer a record op reads."""
    from torch._inductor import ir

    if isinstance(buffer, ir.Loops):  # (not realized when the stamp is lowered: a generated kernel's values)
        return GENERATED, f"{type(buffer).__name__} (unrealized)"
    name = _buffer_name(buffer)
    if name is not None and name in created:
        return COPY, type(buffer).__name__
    if isinstance(buffer, ir.ConcatKernel):
        # A cat allocates its output and its parts' kernels write into it (a part made by an
        # extern kernel is copied in by a generated one): a record of it could ride along in them.
        parts = [classify(_buffer(p), (), graph_inputs)[0] for p in buffer.inputs]
        if parts and all(p in FUSIBLE for p in parts):
            return GENERATED, f"cat of {len(parts)} generated parts"
        if parts and all(p == EXTERN for p in parts):
            return EXTERN, f"cat of {len(parts)} extern parts"
        return OTHER, f"cat of {', '.join(parts)}"
    if isinstance(buffer, ir.MultiOutput):
        return EXTERN, _kernel_name(buffer.inputs[0]) if buffer.inputs else "MultiOutput"
    if isinstance(buffer, ir.ExternKernel):
        return EXTERN, _kernel_name(buffer)
    if isinstance(buffer, ir.TemplateBuffer):
        return TEMPLATE, type(buffer).__name__
    if isinstance(buffer, ir.ComputedBuffer):
        return GENERATED, type(buffer).__name__
    if isinstance(buffer, (ir.InputBuffer, ir.ConstantBuffer)) or (name is not None and name in graph_inputs):
        return INPUT, type(buffer).__name__
    return OTHER, type(buffer).__name__


KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)


def kernel_calls(code: str) -> tuple:
    """(kernel definitions, calls of them) in a graph's output code: ``name = async_compile.X(...)``
    defines one (identical sources are defined once and called several times); a call is
    ``name(`` or ``name.run(`` (a Triton kernel) in the rest of the code."""
    return tuple(len(x) for x in kernel_names(code))


def kernel_names(code: str) -> tuple:
    """(the kernels a graph's output code defines, the kernels its wrapper calls, once a call)."""
    names = KERNEL_DEF.findall(code)
    wrapper = re.sub(r"r?'''.*?'''", "''", code, flags=re.DOTALL)  # (without the kernels' sources)
    calls = [n for n in names for _ in re.findall(rf"(?<![\w.]){re.escape(n)}(?:\.run)?\(", wrapper)]
    return names, calls


class Observer:
    """While active (``with Observer() as obs``), every graph inductor compiles is accounted in
    ``obs.graphs`` (dicts; see ``_finish``), in compile order. Inductor's caches are off.
    ``triton_schedule``: each graph's lowering is also scheduled as Triton's scheduler would fuse
    it (Note [Triton's fusion, scheduled on the CPU])."""

    def __init__(self, triton_schedule: bool = False):
        self.triton_schedule = triton_schedule
        self.graphs: list = []
        self._open: dict = {}  # id(GraphLowering) -> its account so far
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import torch._inductor.config as inductor_config
        from torch._inductor.graph import GraphLowering

        run_node, codegen = GraphLowering.run_node, GraphLowering.codegen
        update_scheduler = GraphLowering._update_scheduler
        observer = self

        def observed_update_scheduler(lowering):
            # Note [Triton's fusion, scheduled on the CPU]
            if observer.triton_schedule and not hasattr(lowering, "_nanscan_triton"):
                with inductor_config.patch(cpu_backend="triton"):
                    update_scheduler(lowering)
                    lowering._nanscan_triton = {"record_kernels": record_kernels(lowering),
                                                "kernel_groups": _kernel_groups(lowering),
                                                "bytes_accessed": bytes_accessed(lowering),
                                                "bytes_by_kind": bytes_by_kind(lowering)}
            return update_scheduler(lowering)

        def observed_run_node(lowering, n):
            call = _record_call(n)
            if call is None:
                result = run_node(lowering, n)
                # (the interpreter drops a value after its last user; a stamp whose values were
                # taken away is not one: Note [a stamp given its records takes no values])
                lowering.__dict__.setdefault("_nanscan_lowered", {})[n] = result
                return result
            before = len(lowering.operations)
            result = run_node(lowering, n)
            observer._note_record(lowering, n, call, lowering.operations[before:])
            return result

        def observed_codegen(lowering, *args, **kwargs):
            from torch._inductor import metrics

            count = metrics.generated_kernel_count
            result = codegen(lowering, *args, **kwargs)
            observer._finish(lowering, metrics.generated_kernel_count - count)
            return result

        def save_output_code(code):
            if observer.graphs:
                g = observer.graphs[-1]
                defs, calls = kernel_names(code)
                g["kernel_defs"] = g.get("kernel_defs", 0) + len(defs)
                g["kernel_calls_in_code"] = g.get("kernel_calls_in_code", 0) + len(calls)
                g.setdefault("kernels_called", []).extend(calls)

        s = self._stack
        s.enter_context(inductor_config.patch(force_disable_caches=True))
        s.enter_context(mock.patch.object(GraphLowering, "run_node", observed_run_node))
        s.enter_context(mock.patch.object(GraphLowering, "codegen", observed_codegen))
        s.enter_context(mock.patch.object(GraphLowering, "_update_scheduler", observed_update_scheduler))
        s.enter_context(mock.patch.object(GraphLowering, "save_output_code", save_output_code))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def _account(self, lowering) -> dict:
        key = id(lowering)
        if key not in self._open:
            kind = "backward" if lowering.is_backward else ("inference" if lowering.is_inference else "forward")
            self._open[key] = {"kind": kind, "record_ops": []}
        return self._open[key]

    def _note_record(self, lowering, n, call, new_ops) -> None:
        op, args = call
        values, records_given = _recorded(op, args, n)
        values_are_args = RECORDED not in n.meta
        kernels = [o for o in new_ops if _nanscan_op(getattr(o, "op_overload", None))]
        kernel = kernels[-1] if kernels else None
        inputs = list(getattr(kernel, "inputs", ()) or ()) if kernel is not None else []
        created = set()
        for o in new_ops:
            if o is not kernel:
                for buf in (o.get_outputs() if hasattr(o, "get_outputs") else [o]):
                    if hasattr(buf, "get_name"):
                        created.add(buf.get_name())
        graph_inputs = set(getattr(lowering, "graph_inputs", {}) or {})
        recorded = []
        for i, v in enumerate(values):
            t = v.meta["val"]
            # With records given, the op copies them and never reads the value (its record was
            # computed by the graph's own kernels: see record_reads).
            entry = {"node": v.name, "shape": [int(s) if isinstance(s, int) else str(s) for s in t.shape],
                     "dtype": str(t.dtype).removeprefix("torch."), "bytes": _nbytes(t),
                     "read_by_op": not records_given}
            env = getattr(lowering, "_nanscan_lowered", {})
            own = _buffer(env[v]) if v in env else None  # (the value's own storage, realized by now)
            # (the kernel's inputs are the values, in order, unless the values were taken away)
            buf = _buffer(inputs[i]) if values_are_args and len(inputs) == len(values) else own
            if buf is None:
                entry.update(producer=OTHER, kernel="unknown", buffer=None)
            else:
                # A buffer made while the record op was lowered is the value's own storage realized
                # for the op (an unrealized pointwise value: a generated kernel), or a copy of it.
                entry["producer"], entry["kernel"] = classify(buf, () if buf is own else created, graph_inputs)
                entry["buffer"] = _buffer_name(buf)
            recorded.append(entry)
        self._account(lowering)["record_ops"].append({"op": _short(str(op)), "fx_node": n.name, "values": recorded})

    def _finish(self, lowering, generated: int) -> None:
        from torch._inductor import ir, scheduler as sched

        self._account(lowering)  # (a graph with no record op)
        g = self._open.pop(id(lowering))
        g["generated_kernels"] = generated
        extern, nanscan_calls, generated_reads = {}, 0, set()
        g["record_kernels"] = record_kernels(lowering)
        if hasattr(lowering, "_nanscan_triton"):
            g["triton"] = lowering._nanscan_triton
        for node in getattr(getattr(lowering, "scheduler", None), "nodes", []) or []:
            if isinstance(node, sched.NopKernelSchedulerNode):
                continue
            if isinstance(node, sched.ExternKernelSchedulerNode):
                if _nanscan_call(node):
                    nanscan_calls += 1
                elif not isinstance(node.node, ir.MultiOutput):  # (an output of a call counted once)
                    name = _kernel_name(node.node)
                    extern[name] = extern.get(name, 0) + 1
                continue
            for sub in node.get_nodes():  # (the step's own kernels: record kernels read every recorded tensor)
                if not _computes_a_record(sub):
                    generated_reads.update(dep.name for dep in sub.read_writes.reads)
        g["extern_calls"] = dict(sorted(extern.items()))
        g["nanscan_calls"] = nanscan_calls
        g["scheduler_kernel_groups"] = _kernel_groups(lowering)
        g["bytes_accessed"] = bytes_accessed(lowering)
        g["bytes_by_kind"] = bytes_by_kind(lowering)
        for record in g["record_ops"]:
            for v in record["values"]:
                v["read_by_generated"] = v["buffer"] in generated_reads
        self.graphs.append(g)


# Note [Triton's fusion, scheduled on the CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# No GPU here, yet the question for the GPU is which records Triton's scheduler fuses into their
# producers. Inductor can schedule a CPU graph for Triton (``config.cpu_backend = "triton"``): the
# same lowered IR, fused by Triton's rules (SIMDScheduling: a pointwise node fuses into a reduction
# over the same number of elements, whatever its loop's shape) rather than the C++ backend's (its
# loop variables must match: `_why_fuse_nodes`). ``GraphLowering._update_scheduler`` is made to
# build a Triton-scheduled ``Scheduler`` first -- only to count its record kernels and their extra
# reads (``record_kernels``), never to generate code (there is no Triton driver here) -- then the
# C++ one that compiles and runs (``_update_scheduler`` is inductor's re-initialization of the
# scheduler: a second call rebuilds it from the same operations). What this is not: the GPU's
# lowering. On a GPU inductor splits a large full reduction into two stages (``Reduction.num_splits``;
# the C++ backend reduces to one element in one loop), and the first stage, not the whole
# reduction, fuses with the producer; device-dependent heuristics (persistent reductions, kernel
# size limits) may refuse some fusions. So it is an estimate of the GPU's fusion from the CPU's
# lowering -- labelled so in the table --, to be checked by the same account run on the GPU.


# An H100's properties, for ``as_if_lowered_for_a_gpu`` (what inductor's split heuristics ask).
H100 = dict(type="cuda", index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
            max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)


@contextlib.contextmanager
def as_if_lowered_for_a_gpu():
    """Compile CPU graphs lowered as inductor lowers them for Triton on an H100 -- a large full
    reduction split in two stages (``Reduction.num_splits`` with an H100's SM count) -- and
    generate (and run) C++ code for that lowering. With ``Observer(triton_schedule=True)`` the
    Triton rows are then an estimate of the GPU's own graph (Note [Triton's fusion, scheduled on
    the CPU]); the C++ rows are of this lowering, not of the CPU's default one.

    Which values inductor writes to memory rather than recomputes in each consumer is decided
    while lowering, by thresholds that differ for a CPU (``ir.is_cpu``: more reads and ops before
    a value is realized, and ``tanh``, ``exp``, ``sigmoid`` ... realized whenever reused); they are
    the GPU's here, so that a value a GPU keeps in registers is not counted as written."""
    import torch._inductor.config as inductor_config
    from torch._inductor import ir
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime import hints

    create, codegen = hints.DeviceProperties.create, GraphLowering.codegen
    gpu = hints.DeviceProperties(**H100)

    def properties(device):
        return gpu if torch.device(device).type == "cpu" else create(device)

    def cpp_codegen(lowering, *args, **kwargs):
        with inductor_config.patch(cpu_backend="cpp"):
            return codegen(lowering, *args, **kwargs)

    with contextlib.ExitStack() as s:
        s.enter_context(inductor_config.patch(cpu_backend="triton"))  # (the lowering's heuristics)
        s.enter_context(mock.patch.object(hints.DeviceProperties, "create", staticmethod(properties)))
        s.enter_context(mock.patch.object(GraphLowering, "codegen", cpp_codegen))
        s.enter_context(mock.patch.object(ir, "is_cpu", lambda x: False))  # (the realize heuristics)
        yield


def _kernel_groups(lowering) -> int:
    """The generated kernels of ``lowering``'s scheduler (its fused nodes that are neither extern
    calls nor no-ops)."""
    from torch._inductor import scheduler as sched

    nodes = getattr(getattr(lowering, "scheduler", None), "nodes", []) or []
    return sum(1 for n in nodes if not isinstance(n, (sched.NopKernelSchedulerNode, sched.ExternKernelSchedulerNode)))


def bytes_accessed(lowering) -> int:
    """The bytes the graph's kernels read and write, as inductor counts them for its
    ``metrics.num_bytes_accessed`` (``GraphLowering.count_bytes``: each scheduler node's buffers
    after fusion, extern calls included; without the runtime estimate that count also makes, which
    needs the device) -- less nanscan's own calls: a stamp given its records reads none of the
    tensors it names, which inductor counts as its reads."""
    nodes = getattr(getattr(lowering, "scheduler", None), "nodes", []) or []
    return sum(int(node.get_read_write_buffers_sizes()) for node in nodes if not _nanscan_call(node))


# The parts of inductor's byte count (bytes_by_kind): extern calls (nanscan's apart), the step's own
# generated kernels, kernels where records are fused with the step's own nodes and kernels that
# compute records only -- the last two split by buffer: the step's, or the records' own (partials
# and records: buffers a record node writes).
BYTE_KINDS = ("extern", "step", "fused_step", "fused_records", "records_step", "records_records")


def bytes_by_kind(lowering) -> dict:
    """:func:`bytes_accessed` split by :data:`BYTE_KINDS`, buffer by buffer as inductor counts
    them (each scheduler node's ``get_read_write_buffer_accesses``): where the bytes a watched graph
    moves beyond the unwatched one's go -- values the step's kernels now write (a recorded tensor
    that fusion kept in registers), standalone record kernels reading the step's tensors (extern
    outputs), the records' partials."""
    from torch._inductor import scheduler as sched

    out = dict.fromkeys(BYTE_KINDS, 0)
    nodes = getattr(getattr(lowering, "scheduler", None), "nodes", []) or []
    partials = _record_buffers(nodes)
    for node in nodes:
        if _nanscan_call(node) or isinstance(node, sched.NopKernelSchedulerNode):
            continue
        if isinstance(node, sched.ExternKernelSchedulerNode):
            out["extern"] += int(node.get_read_write_buffers_sizes())
            continue
        record = [_computes_a_record(sub) for sub in node.get_nodes()]
        if not any(record):
            out["step"] += int(node.get_read_write_buffers_sizes())
            continue
        kind = "fused" if not all(record) else "records"
        for name, b in node.get_read_write_buffer_accesses(include_reads=True, include_writes=True).items():
            out[f"{kind}_records" if name in partials else f"{kind}_step"] += int(b)
    return out


def _nanscan_call(snode) -> bool:
    """Whether a scheduler node is a call of a nanscan op (an extern kernel node)."""
    from torch._inductor import scheduler as sched

    return isinstance(snode, sched.ExternKernelSchedulerNode) and _nanscan_op(getattr(snode.node, "op_overload", None))


def _recorded(op, args, node=None) -> tuple:
    """(the FX nodes of the values a record op records, whether it is given their records). The
    stamp ops take ``values`` and ``records`` (``Tensor?``) by name in their schema; the summary
    ops read every tensor argument. A stamp given its records whose values the fused records' pass
    took away (Note [a stamp given its records takes no values] in nanscan/kernels/graph_passes.py)
    has them in ``node.meta``."""
    positional, kwargs = args
    if "values" not in (a.name for a in op._schema.arguments):
        return _tensor_nodes(args), False
    bound = bound_arguments(op, positional, kwargs)
    given = isinstance(bound.get("records"), torch.fx.Node)
    values = bound.get("values")
    if given and not values and node is not None:
        values = node.meta.get(RECORDED, values)
    return _tensor_nodes(values), given


def _from_record_op(origin) -> bool:
    """Whether the post-grad FX node ``origin`` comes from a nanscan op that AOT autograd decomposed
    (inductor's table: Note [records fused into compiled kernels]); make_fx notes it as
    ``meta['original_aten']``."""
    return _nanscan_op(getattr(origin, "meta", {}).get("original_aten"))


def _computes_a_record(snode) -> bool:
    """Whether a scheduler node computes (part of) a record: one of its FX origins comes from a
    nanscan op (a node of the step's own computation inlined into it may be among them too)."""
    origins = getattr(getattr(snode, "node", None), "origins", ()) or ()
    return any(_from_record_op(o) for o in origins)


def _record_buffers(nodes) -> set:
    """The buffers the record nodes among scheduler ``nodes`` write: the records' partials and the
    records themselves (a record's own intermediates, not the step's tensors)."""
    return {dep.name for node in nodes for sub in node.get_nodes() if _computes_a_record(sub)
            for dep in sub.read_writes.writes}


def _dep_bytes(dep) -> int:
    try:
        return int(dep.numbytes_hint())
    except Exception:  # (a dependency without a size: nothing counted)
        return 0


def record_kernels(lowering) -> dict:
    """The records the graph's generated kernels compute (the decomposed record ops), read from
    inductor's scheduler after fusion: each kernel holding record nodes -- nodes whose FX origins
    come from a nanscan op -- is ``fused`` when it holds nodes of the step's own computation too,
    ``standalone`` when it holds record nodes only. ``extra_bytes``: what the record nodes read
    that the kernel's other nodes neither read nor write (a tensor its producer writes in the same
    kernel is reduced while in registers; one read by the kernel anyway costs nothing more):
    the memory traffic the records add, by kernel kind."""
    from torch._inductor import scheduler as sched
    from torch._inductor.virtualized import V

    out = {"fused": 0, "standalone": 0, "extra_bytes": {"fused": 0, "standalone": 0}, "extra_reads": {}}
    nodes = getattr(getattr(lowering, "scheduler", None), "nodes", []) or []
    # (the records' own intermediates -- a reduction's scalar read by the record's assembly -- are
    # not reads of the step's tensors)
    partials = _record_buffers(nodes)
    with V.set_graph_handler(lowering):
        for node in nodes:
            if isinstance(node, (sched.NopKernelSchedulerNode, sched.ExternKernelSchedulerNode)):
                continue
            record, own = [], []
            for sub in node.get_nodes():
                (record if _computes_a_record(sub) else own).append(sub)
            if not record:
                continue
            kind = "fused" if own else "standalone"
            out[kind] += 1
            covered = set(partials)
            for sub in own:
                covered.update(dep.name for dep in sub.read_writes.reads)
            for sub in node.get_nodes():
                covered.update(dep.name for dep in sub.read_writes.writes)
            reads = {}
            for sub in record:
                for dep in sub.read_writes.reads:
                    if dep.name not in covered:
                        reads[dep.name] = max(reads.get(dep.name, 0), _dep_bytes(dep))
            out["extra_bytes"][kind] += sum(reads.values())
            for name, b in reads.items():  # (buffer -> bytes, to name what is still read)
                out["extra_reads"][name] = out["extra_reads"].get(name, 0) + b
    return out


# ------------------------------------------------------------------------------------------ a step's totals
def _summed_record_kernels(accounts: list) -> dict:
    """``record_kernels`` and ``generated_record_bytes`` summed over ``record_kernels`` accounts."""
    kinds = ("fused", "standalone")
    return {"record_kernels": {k: sum(a.get(k, 0) for a in accounts) for k in kinds},
            "generated_record_bytes": {k: sum(a.get("extra_bytes", {}).get(k, 0) for a in accounts) for k in kinds}}


def totals(graphs: list) -> dict:
    """Per-step sums over ``graphs`` (each taken to run once per step)."""
    by_kind = {}
    for g in graphs:
        by_kind[g["kind"]] = by_kind.get(g["kind"], 0) + 1
    out = {
        "graphs": by_kind,
        "generated_kernels": {k: sum(g["generated_kernels"] for g in graphs if g["kind"] == k) for k in by_kind},
        "kernel_defs": sum(g.get("kernel_defs", 0) for g in graphs),
        "kernel_calls_in_code": {k: sum(g.get("kernel_calls_in_code", 0) for g in graphs if g["kind"] == k)
                                 for k in by_kind},
        "extern_calls": {},
        "record_ops": {k: sum(len(g["record_ops"]) for g in graphs if g["kind"] == k) for k in by_kind},
        "records": {k: sum(len(r["values"]) for g in graphs if g["kind"] == k for r in g["record_ops"])
                    for k in by_kind},
        "bytes": {k: sum(v["bytes"] or 0 for g in graphs if g["kind"] == k for r in g["record_ops"]
                         for v in r["values"]) for k in by_kind},
        # What reading for the records costs: the record ops' own reads (a value whose record is
        # given is not read by the op), and the generated record kernels' extra reads (record_kernels).
        "op_bytes": {k: sum(v["bytes"] or 0 for g in graphs if g["kind"] == k for r in g["record_ops"]
                            for v in r["values"] if v.get("read_by_op", True)) for k in by_kind},
        **_summed_record_kernels([g.get("record_kernels", {}) for g in graphs]),
        "by_producer": {p: {"records": 0, "bytes": 0} for p in PRODUCERS},
        "by_extern_kernel": {},
        "read_by_generated": {"records": 0, "bytes": 0},  # of tensors no generated kernel writes
        "distinct": {"records": 0, "bytes": 0},
    }
    for g in graphs:
        for name, n in g["extern_calls"].items():
            out["extern_calls"][name] = out["extern_calls"].get(name, 0) + n
        seen = set()
        for r in g["record_ops"]:
            for v in r["values"]:
                b = v["bytes"] or 0
                p = out["by_producer"][v["producer"]]
                p["records"] += 1
                p["bytes"] += b
                if v["producer"] == EXTERN:
                    e = out["by_extern_kernel"].setdefault(v["kernel"], {"records": 0, "bytes": 0})
                    e["records"] += 1
                    e["bytes"] += b
                if v["producer"] not in FUSIBLE and v.get("read_by_generated"):
                    out["read_by_generated"]["records"] += 1
                    out["read_by_generated"]["bytes"] += b
                if v["buffer"] is None or v["buffer"] not in seen:
                    seen.add(v["buffer"])
                    out["distinct"]["records"] += 1
                    out["distinct"]["bytes"] += b
    out["extern_calls"] = dict(sorted(out["extern_calls"].items()))
    out["record_bytes_read"] = sum(out["op_bytes"].values()) + sum(out["generated_record_bytes"].values())
    out["kernel_groups"] = sum(g.get("scheduler_kernel_groups", 0) for g in graphs)
    out["bytes_accessed"] = sum(g.get("bytes_accessed", 0) for g in graphs)
    out["bytes_by_kind"] = {k: sum(g.get("bytes_by_kind", {}).get(k, 0) for g in graphs) for k in BYTE_KINDS}
    if graphs and all("triton" in g for g in graphs):  # (Note [Triton's fusion, scheduled on the CPU])
        tri = {"kernel_groups": sum(g["triton"]["kernel_groups"] for g in graphs),
               "bytes_accessed": sum(g["triton"].get("bytes_accessed", 0) for g in graphs),
               "bytes_by_kind": {k: sum(g["triton"].get("bytes_by_kind", {}).get(k, 0) for g in graphs)
                                 for k in BYTE_KINDS},
               **_summed_record_kernels([g["triton"]["record_kernels"] for g in graphs])}
        tri["record_bytes_read"] = sum(out["op_bytes"].values()) + sum(tri["generated_record_bytes"].values())
        out["triton"] = tri
    return out


def runtime_record_ops(step) -> dict:
    """The nanscan ops one call of ``step`` runs, counted by torch.profiler (CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = {}
    for e in prof.events():
        if e.name.startswith("nanscan::"):
            name = e.name.replace("::", ".")
            counts[name] = counts.get(name, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------ measuring
def observe_compile(step, steps: int = 3, triton_schedule: bool = False) -> dict:
    """Run ``step`` ``steps`` times (the first compiles) under an :class:`Observer`: the graphs
    compiled at each step, and the per-step totals of all of them."""
    per_step = []
    with Observer(triton_schedule) as obs:
        for _ in range(steps):
            before = len(obs.graphs)
            step()
            per_step.append(obs.graphs[before:])
    graphs = [g for gs in per_step for g in gs]
    return {"graphs": graphs, "compiled_per_step": [len(gs) for gs in per_step],
            "compiled_after_first_step": sum(len(gs) for gs in per_step[1:]), "totals": totals(graphs)}


def interleaved_time(steps: dict, *, device, rounds: int, steps_per_round: int) -> dict:
    """Rounds alternating the variants of ``steps`` (name -> step), the order flipped every round;
    per variant the seconds per step of each round and their median; ratio of the medians."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / steps_per_round)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"median_s": medians, "per_round_s": times, "rounds": rounds, "steps": steps_per_round}


def measure_pair(make, step, *, device="cpu", warmup: int = 3, rounds: int = 5, steps: int = 3,
                 watch_options=None, compile_options=None, triton_schedule: bool = False) -> dict:
    """``make()`` -> (model, opt, batch), twice (seeded: the same model); one is watched, both are
    compiled (``torch.compile(model, **compile_options)``); ``step(model, opt, batch)``. The
    watched model compiles (and runs its first ``warmup`` steps) first, then the bare one, each
    under an :class:`Observer`; then the record ops of one steady step of each (profiler), then
    ``rounds`` interleaved timing rounds (none when 0). ``triton_schedule``: each graph is also
    scheduled by Triton's rules (Note [Triton's fusion, scheduled on the CPU])."""
    # Note [two instances of one class]: dynamo keeps graphs per code object and, by default, does
    # not guard on module hooks; the bare model's graph (compiled later, tried first) passes the
    # watched model's guards, and the watched model would run it -- without its hooks, silently
    # where a loss is recorded. Guarding on hooks keeps each model on its own graphs.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        return _measure_pair(make, step, device=device, warmup=warmup, rounds=rounds, steps=steps,
                             watch_options=watch_options, compile_options=compile_options or {},
                             triton_schedule=triton_schedule)


def _measure_pair(make, step, *, device, warmup, rounds, steps, watch_options, compile_options,
                  triton_schedule) -> dict:
    watched_model, watched_opt, watched_batch = make()
    bare_model, bare_opt, bare_batch = make()
    mon = nanscan.watch(watched_model, watched_opt, **(watch_options or {}))
    try:
        watched_c = torch.compile(watched_model, **compile_options)
        bare_c = torch.compile(bare_model, **compile_options)
        variants = {"unwatched": lambda: step(bare_c, bare_opt, bare_batch),
                    "watched": lambda: step(watched_c, watched_opt, watched_batch)}
        result = {"watched": observe_compile(variants["watched"], warmup, triton_schedule),
                  "unwatched": observe_compile(variants["unwatched"], warmup, triton_schedule)}
        for name, fn in variants.items():
            if not result[name]["graphs"]:
                raise RuntimeError(f"the {name} model compiled no graph: it ran the other model's (dynamo's "
                                   "cache), and its counts would be the other's")
            ran = runtime_record_ops(fn)
            compiled = {}
            for g in result[name]["graphs"]:
                for r in g["record_ops"]:
                    compiled[r["op"]] = compiled.get(r["op"], 0) + 1
            result[name]["runtime_record_ops"] = {op: ran.get(op, 0) for op in compiled}
            result[name]["runtime_nanscan_calls"] = ran  # (every nanscan op, nested calls included)
            if result[name]["runtime_record_ops"] != compiled:
                raise RuntimeError(f"the {name} model's steady step ran the record ops {ran}, its compiled graphs "
                                   f"hold {compiled}: a graph ran more or less than once per step, or not its own")
        if rounds > 0:
            result["time"] = interleaved_time(variants, device=device, rounds=rounds, steps_per_round=steps)
            med = result["time"]["median_s"]
            result["time"]["ratio"] = med["watched"] / med["unwatched"]
    finally:
        mon.close()
    result["config"] = {"parameters": sum(p.numel() for p in bare_model.parameters()), "device": str(device),
                        "threads": torch.get_num_threads(), "torch": torch.__version__,
                        "compile": compile_options or "default (inductor)", "grad_hooks_in_graph": _grad_hooks()}
    return result


def _grad_hooks() -> bool:
    from nanscan.monitor.traced import GRAD_HOOKS

    return bool(GRAD_HOOKS)


def measure_gpt(*, layers=4, d=256, heads=4, vocab=1024, seq=128, batch=8, device="cpu", autocast=None,
                warmup=3, rounds=5, steps=3, triton_schedule=False) -> dict:
    """The benchmark GPT (benchmarks/traffic.py's ``make_gpt`` / ``gpt_step``: AdamW, the plain loop)."""
    from benchmarks.traffic import gpt_step, make_gpt

    if autocast is None:
        autocast = torch.device(device).type == "cuda"  # (as bench_monitor.py)

    def make():
        return make_gpt(layers=layers, d=d, heads=heads, vocab=vocab, seq=seq, batch=batch, device=device)

    def step(model, opt, idx):
        return gpt_step(model, opt, idx, autocast)

    result = measure_pair(make, step, device=device, warmup=warmup, rounds=rounds, steps=steps,
                          triton_schedule=triton_schedule)
    result["config"].update(model="GPT", layers=layers, d=d, heads=heads, vocab=vocab, seq=seq, batch=batch,
                            autocast="bf16" if autocast else "none")
    return result


# ------------------------------------------------------------------------------------------ the table
def _mib(b) -> str:
    return f"{b / 2**20:,.2f}"


def _split(d: dict, fmt=str) -> str:
    """``fw + bw = total`` of a per-kind dict."""
    if not d:
        return "0"
    parts = [fmt(d[k]) for k in ("forward", "backward", "inference") if k in d]
    total = fmt(sum(d.values()))
    return parts[0] if len(parts) == 1 else " + ".join(parts) + f" = {total}"


def title(result: dict) -> str:
    c = result["config"]
    model = (f"GPT {c['layers']}x{c['d']} ({c['heads']} heads, vocab {c['vocab']}, seq {c['seq']}, batch "
             f"{c['batch']}; {c['parameters']:,} parameters), {c['autocast'] if c['autocast'] != 'none' else 'fp32'}"
             if c.get("model") == "GPT" else c.get("model", "model"))
    return (f"compiled-graph traffic, per training step (forward + backward graphs): {model}, AdamW, "
            f"torch.compile (inductor), {c['device']}, torch {c['torch']}"
            + (f"; lowered {c['lowering']}" if c.get("lowering") else ""))


BY_KIND_LABEL = ("... of which extern calls / the step's own kernels / kernels with records fused in: the step's "
                 "buffers + the records' / record kernels: the step's buffers + the records'")


def _by_kind(b: dict) -> str:
    return (f"{_mib(b['extern'])} / {_mib(b['step'])} / {_mib(b['fused_step'])} + {_mib(b['fused_records'])} / "
            f"{_mib(b['records_step'])} + {_mib(b['records_records'])}")


def table(result: dict) -> str:
    """Markdown: one row per number, unwatched and watched side by side; then the extern producers."""
    u, w = result["unwatched"], result["watched"]
    tu, tw = u["totals"], w["totals"]
    rows = []

    def row(label, fn):
        rows.append(f"| {label} | {fn(u, tu)} | {fn(w, tw)} |")

    def producer(p, r, t):
        x = t["by_producer"][p]
        return f"{x['records']} / {_mib(x['bytes'])}"

    row("graphs compiled (forward + backward)", lambda r, t: _split(t["graphs"]))
    row("graphs compiled after the first step (recompiles)", lambda r, t: str(r["compiled_after_first_step"]))
    row("generated kernels launched (calls in the output code; forward + backward)",
        lambda r, t: _split(t["kernel_calls_in_code"]))
    row("generated kernels counted by inductor (metrics.generated_kernel_count)",
        lambda r, t: _split(t["generated_kernels"]))
    row("extern kernel calls, nanscan's apart", lambda r, t: str(sum(t["extern_calls"].values())))
    row("nanscan record ops (forward + backward)", lambda r, t: _split(t["record_ops"]))
    row("nanscan ops run in a steady step (profiler)", lambda r, t: str(sum(r["runtime_record_ops"].values())))
    row("tensors the record ops read (forward + backward)", lambda r, t: _split(t["records"]))
    row("MiB of the tensors they record (forward + backward)", lambda r, t: _split(t["bytes"], _mib))
    row("... MiB the record ops read themselves (not given the records)", lambda r, t: _split(t["op_bytes"], _mib))
    row("generated kernels computing records: fused with the step's own / standalone",
        lambda r, t: f"{t['record_kernels']['fused']} / {t['record_kernels']['standalone']}")
    row("... MiB they read beyond what their kernel reads anyway: fused / standalone",
        lambda r, t: " / ".join(_mib(t["generated_record_bytes"][k]) for k in ("fused", "standalone")))
    row("**MiB read for the records** (the ops' reads + the generated record kernels' extra reads)",
        lambda r, t: _mib(t["record_bytes_read"]))
    row("MiB the graphs' kernels read and write, inductor's count (`num_bytes_accessed`, nanscan's calls apart)",
        lambda r, t: _mib(t["bytes_accessed"]))
    row(BY_KIND_LABEL, lambda r, t: _by_kind(t["bytes_by_kind"]))
    if "triton" in tw and "triton" in tu:  # Note [Triton's fusion, scheduled on the CPU]
        row("*Triton's scheduler, estimated from this lowering:* generated kernels (fused scheduler nodes)",
            lambda r, t: str(t["triton"]["kernel_groups"]))
        row("... generated kernels computing records: fused with the step's own / standalone",
            lambda r, t: f"{t['triton']['record_kernels']['fused']} / {t['triton']['record_kernels']['standalone']}")
        row("... MiB they read beyond what their kernel reads anyway: fused / standalone",
            lambda r, t: " / ".join(_mib(t["triton"]["generated_record_bytes"][k]) for k in ("fused", "standalone")))
        row("... **MiB read for the records**", lambda r, t: _mib(t["triton"]["record_bytes_read"]))
        row("... MiB the graphs' kernels read and write, inductor's count",
            lambda r, t: _mib(t["triton"]["bytes_accessed"]))
        row("... " + BY_KIND_LABEL, lambda r, t: _by_kind(t["triton"]["bytes_by_kind"]))
        row("(the C++ scheduler's generated kernels, for comparison)", lambda r, t: str(t["kernel_groups"]))
    row("... distinct tensors / MiB (a tensor read by several ops once)",
        lambda r, t: f"{t['distinct']['records']} / {_mib(t['distinct']['bytes'])}")
    labels = {GENERATED: "made by a generated kernel (fusible into its producer)",
              TEMPLATE: "made by a generated template (fusible into its epilogue)",
              EXTERN: "made by an extern kernel (mm, addmm, SDPA ...)",
              INPUT: "graph inputs (made outside the graph)",
              COPY: "copies inductor made for the record",
              OTHER: "other"}
    for p in PRODUCERS:
        if p in (GENERATED, EXTERN, INPUT) or tw["by_producer"][p]["records"]:
            row(f"... {labels[p]}: tensors / MiB", lambda r, t, p=p: producer(p, r, t))
    row("... of those not made by a generated kernel, read by one anyway: tensors / MiB",
        lambda r, t: f"{t['read_by_generated']['records']} / {_mib(t['read_by_generated']['bytes'])}")
    if "time" in result:
        tm = result["time"]
        rows.append(f"| step time (ms, median of {tm['rounds']} interleaved rounds of {tm['steps']}) | "
                    f"{tm['median_s']['unwatched'] * 1e3:.2f} | {tm['median_s']['watched'] * 1e3:.2f} |")
        rows.append(f"| watched / unwatched | 1 | {tm['ratio']:.3f} |")
    out = [f"`{title(result)}`", "", "| per step | unwatched | watched |", "|---|---|---|", *rows]
    ext = tw["by_extern_kernel"]
    if ext:
        out += ["", "| extern producer of recorded tensors (watched) | tensors | MiB |", "|---|---|---|"]
        out += [f"| {name} | {x['records']} | {_mib(x['bytes'])} |"
                for name, x in sorted(ext.items(), key=lambda kv: -kv[1]["bytes"])]
    calls = sorted(set(tu["extern_calls"]) | set(tw["extern_calls"]))
    if calls:
        out += ["", "| extern kernel calls per step | unwatched | watched |", "|---|---|---|"]
        out += [f"| {name} | {tu['extern_calls'].get(name, 0)} | {tw['extern_calls'].get(name, 0)} |"
                for name in calls]
    return "\n".join(out)


def record_listing(result: dict) -> str:
    """Every record op of the watched graphs, with each tensor's shape, bytes and producer."""
    lines = []
    for i, g in enumerate(result["watched"]["graphs"]):
        lines.append(f"graph {i} ({g['kind']}): {g['generated_kernels']} generated kernels, "
                     f"{len(g['record_ops'])} record ops, extern calls {g['extern_calls']}")
        for r in g["record_ops"]:
            vals = ", ".join(f"{v['node']}{tuple(v['shape'])} {v['dtype']} {v['bytes']} B <- {v['producer']}"
                             f"{'' if v['producer'] in FUSIBLE else ' ' + v['kernel']}"
                             f"{' (read by a generated kernel)' if v.get('read_by_generated') else ''}"
                             for v in r["values"])
            lines.append(f"  {r['op']} [{r['fx_node']}]: {vals}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.traffic import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--autocast", choices=("none", "bf16"), default=None,
                        help="default: bf16 on cuda, none on cpu (as bench_monitor.py)")
    parser.add_argument("--warmup", type=int, default=3, help="steps observed while compiling (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (0: no timing)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 on the CPU)")
    parser.add_argument("--triton-schedule", action="store_true",
                        help="on the CPU, also schedule each graph by Triton's fusion rules (an estimate of the GPU's)")
    parser.add_argument("--gpu-lowering", action="store_true",
                        help="on the CPU, lower as for an H100 (split reductions) and schedule by Triton's rules too")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every record op of the watched graphs")
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args(argv)
    threads = args.threads if args.threads is not None else (1 if torch.device(args.device).type == "cpu" else None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    on_cpu = torch.device(args.device).type == "cpu"
    lowering = as_if_lowered_for_a_gpu() if args.gpu_lowering and on_cpu else contextlib.nullcontext()
    try:
        with lowering:
            result = measure_gpt(layers=args.layers, d=args.d, heads=args.heads, vocab=args.vocab, seq=args.seq,
                                 batch=args.batch, device=args.device,
                                 autocast=None if args.autocast is None else args.autocast == "bf16",
                                 warmup=args.warmup, rounds=args.rounds, steps=args.steps,
                                 triton_schedule=(args.triton_schedule or args.gpu_lowering) and on_cpu)
        if args.gpu_lowering and on_cpu:
            result["config"]["lowering"] = "as for an H100 (emulated on the CPU)"
    finally:
        torch.set_num_threads(before)
    print(table(result))
    if args.verbose:
        print()
        print(record_listing(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

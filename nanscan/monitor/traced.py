"""The compiled path: what the monitor records inside a ``torch.compile`` graph.

Inside a graph, hooks are traced and then replayed as graph ops: they may do nothing but tensor
ops (Python bookkeeping would be replayed as side effects on every call, or break the graph). So
every watched module owns static rows of a device buffer, fixed at ``watch``: ``INPUTS`` rows for
its first floating inputs and ``OUTPUTS`` rows for its floating outputs. A traced hook writes its
values' records into its rows together with values of a device counter (the host learns which
rows ran in this read window, and in which order: several graphs per step, graph breaks, several
forwards per optimizer step) in one graph op, ``nanscan::stamp`` (csrc/monitor/stamp_rows.cpp:
it summarizes and writes; the buffer is named once per monitor, not passed, and the op is
effectful -- the compiler keeps it, in order, and has no mutation to functionalize) -- and the
values' real shapes are noted at trace time. The read decodes the written rows into slots like
eager ones, so attribution is the same code.

Rows are static, so a row written twice in one read window keeps only its last value; each row
counts its writes, and such a row is kept ``stale`` (never an incident, "cannot tell" downstream).
Two cases: a module called twice in one forward (an input row that took the first call's output
then names that module, ``produced=None``: :meth:`TracedRows._name_inputs_of_overwritten_outputs`),
and several forwards per read (gradient accumulation): each training forward of the root first
keeps the rows so far in a device copy, a sub-window decoded in its turn
(:meth:`TracedRows.begin_forward`), so no micro-step's records are lost.

Tensor identity is not available inside a graph, so module inputs are recorded too. An input of a
child that is non-finite while no earlier value of the step was is a value made in the parent's
own body (the same rule as eager, decided from the records instead of from identity): such rows
are ``derived`` candidates named after the parent. Output labels (``[0].y``) are noted once, at
trace time.

Compile time is dynamo tracing the hooks (every line, at every module call) and AOT autograd
handling each stamp. So the common call (``module(x) -> tensor``) takes a fast
path of a few traced lines (``EagerHooks._pre_hook`` / ``_post_hook``), and a *leaf* module (no
hooked descendant, not in place, not the root) makes one stamp per call: its inputs are stamped
with its outputs, after its forward -- no other hook runs in between, so production order is
kept. What the leaf received is its input's value then only if its forward did not change it in
place: dynamo's fake tensors carry version counters, and an input row whose tensor changed since
an earlier stamp saw it (or that no stamp saw, with a version above 0) is kept ``stale`` --
"cannot tell", never a guess (``trace_notes.noted_at_trace``). Watched / unwatched compile time: README.

Gradients (the default, where this torch traces tensor hooks into graphs: ``GRAD_HOOKS``): the
traced hook registers a tensor hook on each recorded module output that requires grad; dynamo
traces it into the graph and it runs in the compiled backward, writing the gradient flowing into
that output into the output's gradient row. The module whose backward made that gradient
is the output's consumer: while dynamo traces, its fake tensors have identity, so the stamps note
which modules took each recorded output as an input -- per trace, because graphs of different
structure (a recompile) write the same rows; at the read, only the notes of the traces whose rows
ran apply (:meth:`TracedRows._traces_that_ran`). Attribution is then the eager rule: one consumer,
named, produced when the gradients of its own outputs were finite; several, "cannot tell".

Gradients with taps (``watch(..., compiled_grads="taps")``, or ``True``): an identity autograd
Function, :class:`_Tap`, whose output is a view (autograd then forbids in-place ops on it, so a
model that modifies module inputs or outputs in place cannot use it) on a module's top-level
floating inputs and outputs (a tensor, or tensors in a tuple / list) that require grad; its
backward writes the incoming gradient's record into a row of the same buffer, stamped by the same
counter. A non-finite gradient of a module's *input* is what that module's backward made: it is
named after the module, produced when the gradients of its outputs were finite. Outputs in other
containers (dicts, ``ModelOutput``) are recorded but not tapped: the gradient flowing into them is
unknown, and an input gradient of such a module says "cannot tell".

Only training forwards are recorded (grad enabled -- Note [training forwards] in monitor.py --,
the step sampled: dynamo guards on both, so an eval forward runs a graph of its own that writes nothing).
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from nanscan import _ops
from nanscan.monitor.eager import ROOT as ROOT_NAME, float_tensors, hooked
from nanscan.monitor.slots import Call, Slot
from nanscan.monitor.trace_notes import LABEL_SEP, LEAF_STAMPS, LIVE, MORE_INPUTS, TraceNotes, note, noted_at_trace
from nanscan.record import RECORD_SIZE

INPUTS, OUTPUTS = 2, 8
MAX_DIMS = 6
# Columns: the record, the execution sequence number (0 = not written in this window), the number
# of writes in this window (more than 1: only the last value is there), numel,
# ndim and the sizes.
SEQ, WRITES, NUMEL, NDIM, DIMS = RECORD_SIZE, RECORD_SIZE + 1, RECORD_SIZE + 2, RECORD_SIZE + 3, RECORD_SIZE + 4
COLUMNS = DIMS + MAX_DIMS

def _hooks_trace_into_graphs() -> bool:
    """Whether dynamo traces ``tensor.register_hook`` on a value made inside the graph into the graph
    itself (the ``register_hook`` higher-order op: the hook fires on the tensor's gradient in
    AOT autograd's backward graph, and the tensor may then be changed in place, as in eager).
    Older torch (2.11 included) rewrites such a hook into an autograd Function whose output is a
    view, which in-place ops on module outputs (every resnet) cannot compile with."""
    try:
        import torch._higher_order_ops.register_hook  # noqa: F401
        return True
    except ImportError:  # pragma: no cover - older torch: the gradients of compiled modules are not recorded
        return False


# Gradients inside compiled graphs by default: a tensor hook on every recorded module output.
GRAD_HOOKS = _hooks_trace_into_graphs()


_OWNERS = itertools.count(1)  # TracedRows.owner
_ops.STAMP_TRACED = noted_at_trace  # (the stamp op's fake kernel tells the monitor's TraceNotes)


def drop_graphs_compiled_without_hooks(model: torch.nn.Module) -> int:
    """Drop dynamo's cached graphs of the ``forward`` of ``model``'s class and of every submodule
    class; returns how many were dropped.

    Why: dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``
    is True by default) and caches graphs per code object. A graph compiled *before* ``watch`` --
    for this instance, or for another instance of the same class (a notebook re-run, a train / eval
    copy) -- would be reused for the watched model without calling its hooks: faults would be
    reported at ``(model)`` or not at all. Dropped, they are recompiled at the next call (with the
    hooks for the watched model; as before for the others)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except ImportError:  # pragma: no cover - a torch without these: nothing to drop
        return 0
    dropped, seen = 0, set()
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        code = getattr(forward, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        n = len(_debug_get_cache_entry_list(code))
        if n:
            reset_code(code)
            dropped += n
    return dropped


# Note [two instances of one class]: dynamo keeps its graphs per code object, tries the newest
# first, and by default does not guard on module hooks (``skip_nnmodule_hook_guards``). So a model
# of the watched model's class compiled *after* ``watch`` without a monitor -- an eval copy, a
# reference or teacher model, a second run in a notebook -- makes a graph that the watched model's
# guards accept too: the watched model would run it, without its hooks, and nothing of its forward
# would be recorded (silently, where its loss is). While a monitor that records activations is
# open, dynamo guards on module hooks (``hold_hook_guards``): every graph then says whether it
# was compiled with hooks, and each model runs its own. The guards are a length check per hook
# dict of each module, in dynamo's C++ guard tree, per compiled call. The user's setting is put
# back when the last such monitor closes; graphs compiled meanwhile keep their guards.
_hook_guard_holders = 0
_hook_guards_before: Optional[bool] = None


def hold_hook_guards() -> None:
    """Have dynamo guard on module hooks until :func:`release_hook_guards` (Note [two instances
    of one class])."""
    global _hook_guard_holders, _hook_guards_before
    config = torch._dynamo.config
    if _hook_guard_holders == 0:
        _hook_guards_before = config.skip_nnmodule_hook_guards
        config.skip_nnmodule_hook_guards = False
    _hook_guard_holders += 1


def release_hook_guards() -> None:
    global _hook_guard_holders
    if _hook_guard_holders <= 0:
        return
    _hook_guard_holders -= 1
    if _hook_guard_holders == 0 and _hook_guards_before is not None:
        torch._dynamo.config.skip_nnmodule_hook_guards = _hook_guards_before


class _RowInfo:
    __slots__ = ("name", "info", "inputs", "candidate", "derived", "is_output", "index", "phase", "kind", "module",
                 "weight_input", "post_time")

    def __init__(self, name, info, inputs, candidate, derived, is_output, index, phase="forward", kind="activation",
                 module=None):
        self.name, self.info, self.inputs = name, info, inputs
        self.candidate, self.derived, self.is_output, self.index = candidate, derived, is_output, index
        self.phase, self.kind = phase, kind
        # The module whose row this is, and whether its weights' gradients depend on it (its
        # forward inputs and the gradients of its outputs).
        self.module = module
        self.weight_input = (phase == "forward" and not is_output) or (phase == "backward" and is_output)
        self.post_time = False  # an input row of a leaf, stamped after its forward (see trace_notes.noted_at_trace)


def _mark_leaves(infos: list, compiled_grads: bool) -> None:
    """Set ``info.leaf``: the module's inputs are stamped with its outputs, after its forward.
    True for a module with no hooked descendant (no other hook runs between its pre-hook and its
    hook, so the rows keep production order), that is not the root (its input rows are the batch)
    and does not work in place; never with gradient taps (they wrap inputs before the forward)."""
    has_child = set()
    for info in infos:
        if info.is_root or not hooked(info):
            continue
        name = info.name
        while "." in name:
            name = name.rpartition(".")[0]
            if name in has_child:
                break
            has_child.add(name)
        else:
            has_child.add(ROOT_NAME)
    for info in infos:
        info.leaf = LEAF_STAMPS and not (compiled_grads or info.is_root or info.inplace or info.name in has_child)


class _Tap(torch.autograd.Function):
    """Identity in the forward; in the backward, writes the record of the incoming gradient into
    a row of the compiled path's buffer (stamped by the same device counter). Placed on module
    inputs and outputs inside compiled graphs, where tensor hooks cannot be registered."""

    @staticmethod
    def forward(ctx, x, owner: int, row: int):
        ctx.owner, ctx.row = owner, row
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        LIVE[ctx.owner]._write_rows(ctx.row, [grad])
        return grad, None, None


# Note [compiled graphs cached]: the stamp op is effectful (Note in _ops.py), so inductor sees it
# inside a ``with_effects`` higher-order op, which it does not cache by default: a watched model's
# graphs were compiled anew in every process (a warm re-run took several times the unwatched one's
# time to its first step). Replaying a cached graph is sound here: the stamp's arguments are the
# values, the rows and ``owner`` -- a per-process count, the same in every run of a script, never
# id() --, and where it writes is looked up at run time (``set_stamp_target``). So nanscan marks
# ``with_effects`` cacheable through inductor's own knob for it, keyed by torch's version and
# nanscan's build -- its version, the record's size and the hash of the compiled sources: a graph
# cached by an older build (whose ops wrote another record) is never replayed by a newer one.
# (Other effectful ops in the process are then cached too: torch's own effectful ops are the print
# / profiler kind, whose effect tokens AOT autograd threads the same way.)
def mark_effects_cacheable() -> None:
    try:
        import torch._inductor.config as inductor_config
        from nanscan import _ops
        from nanscan._version import __version__

        marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
        if isinstance(marked, dict):
            build = (_ops.build_info() or {}).get("source_hash", "unknown")
            marked.setdefault("torch.ops.higher_order.with_effects",
                              f"{torch.__version__} nanscan {__version__} record {RECORD_SIZE} build {build}")
    except Exception:  # pragma: no cover - a torch without the knob: graphs are compiled anew
        pass


def install_graph_passes() -> None:
    try:
        from nanscan.kernels import graph_passes
    except ImportError:  # pragma: no cover - a torch without inductor: nothing partitions there
        return
    graph_passes.install()


class TracedRows:
    INPUTS, OUTPUTS = INPUTS, OUTPUTS

    def __init__(self, monitor, infos: list, kernels_for, extension):
        self.monitor = monitor
        self.extension = extension  # (nanscan._C: the host's stamp count, the stamp target)
        # Names this object in the graphs (the stamp op's `owner` constant) and the trace-time notes.
        # A count, not id(): the same in every run of the same script, so a compiled graph is the same
        # graph in a fresh process and inductor's caches serve it (Note [compiled graphs cached]).
        self.owner = next(_OWNERS)
        self.notes = TraceNotes()  # what dynamo's traces of this monitor's hooks noted
        mark_effects_cacheable()
        # The records kept out of the partitioner's weighing, and next to their tensors after it
        # (Note [records the partitioner does not weigh] in nanscan/kernels/graph_passes.py).
        install_graph_passes()
        # The traced hooks hand the stamp its records from summarize_many, which inductor fuses
        # into its own kernels (Note [records fused into compiled kernels] in nanscan/_ops.py).
        self.fused_records = _ops.register_fused_records()
        self.kernels_for = kernels_for  # device -> (summarize one, summarize many)
        # The ops for the buffer's device, fixed at allocate: no lookup to guard on.
        self.record_one = self.record_many = None
        self.default_kernels = False
        self.buffer: Optional[torch.Tensor] = None
        self.counter: Optional[torch.Tensor] = None
        self.model = monitor.model
        # This step records activations (``recording``); and with the default kernels and no
        # gradient taps, through the hooks' fast path (``stamping``). Set by set_recording: dynamo
        # guards on each as on one constant, where the monitor's state would be several.
        self.recording = self.stamping = False
        self._retired: list = []  # buffers of earlier devices (model.to(...)): kept alive
        self.snapshots: list = []  # device copies of the rows of earlier forwards in this read window
        self.forwards = 0  # training forwards of the root in this read window (see begin_forward)
        base = {}  # module name -> its first row (also kept on its ModuleInfo: row_base)
        self.rows: list = []
        by_name = self.infos = {info.name: info for info in infos}
        _mark_leaves(infos, compiled_grads=monitor.compiled_grads)
        # Gradients inside graphs: a tensor hook per recorded output (GRAD_HOOKS), unless taps.
        self.grad_hooks = GRAD_HOOKS and monitor.compiled_grad_hooks
        for info in infos:
            base[info.name] = info.row_base = len(self.rows)
            parent = None if info.is_root else by_name.get(info.name.rpartition(".")[0] or "(model)")
            parent_inputs = () if parent is None else tuple(range(base.get(parent.name, 0),
                                                                  base.get(parent.name, 0) + INPUTS))
            for k in range(INPUTS):
                if parent is None:
                    self.rows.append(_RowInfo(f"{info.name}.input[{k}]", info, (), False, False, False, k, module=info))
                else:
                    self.rows.append(_RowInfo(parent.name, parent, parent_inputs, True, True, False, k, module=info))
            if info.leaf:
                for row in self.rows[-INPUTS:]:
                    row.post_time = True
            own_inputs = tuple(range(base[info.name], base[info.name] + INPUTS))
            for k in range(OUTPUTS):
                self.rows.append(_RowInfo(info.name if k == 0 else f"{info.name}[output {k}]", info, own_inputs,
                                          True, False, True, k, module=info))
            # Gradients: of the inputs (what this module's backward made: the candidates, named after
            # the module, produced when the gradients of its outputs were finite) and of the outputs.
            output_grads = tuple(range(len(self.rows) + INPUTS, len(self.rows) + INPUTS + OUTPUTS))
            for k in range(INPUTS):
                self.rows.append(_RowInfo(info.name, info, output_grads, True, False, False, k, "backward", "grad",
                                          module=info))
            for k in range(OUTPUTS):  # (with hooks, candidates: named after the output's consumer, see slots)
                self.rows.append(_RowInfo(f"{info.name} (output grad)", info, (), self.grad_hooks, False, True, k,
                                          "backward", "grad", module=info))
        LIVE[self.owner] = self

    def allocate(self, device) -> None:
        if self.buffer is None or self.buffer.device != device:
            if self.buffer is not None:  # (a CUDA graph captured with it may write it at a replay)
                self._retired.append((self.buffer, self.counter))
            self.buffer = torch.zeros(len(self.rows), COLUMNS, dtype=torch.float64, device=device)
            self.counter = torch.zeros(1, dtype=torch.float64, device=device)
            self.record_one, self.record_many = self.kernels_for(device)
            self.default_kernels = self.record_many is torch.ops.nanscan.summarize_many.default
            self.extension.set_stamp_target(self.owner, self.buffer, self.counter)
            self.set_recording()

    def set_recording(self) -> None:
        """Open or close the traced hooks' fast path for this step (the monitor's StepState calls it
        whenever ``checking`` or ``closed`` changes)."""
        m = self.monitor
        self.recording = bool(m.activations and m.state.recording)
        self.stamping = self.recording and self.default_kernels and not m.compiled_grads

    def grad_hook(self, info, k: int, label: str = ""):
        """The tensor hook that records the gradient flowing into output ``k`` of ``info``'s module
        (row label ``label``; "" for the row's own name) -- registered by the traced hooks on the
        output, traced by dynamo into the graph (``GRAD_HOOKS``), run in its backward."""
        row = info.row_base + INPUTS + OUTPUTS + INPUTS + k
        stamp, owner, many, fused = torch.ops.nanscan.stamp, self.owner, torch.ops.nanscan.summarize_many, \
            self.fused_records

        def record_grad(grad):
            # (The common case in as few lines as the hooks' fast path: dynamo traces this body
            # for every hooked output.)
            if self.default_kernels and type(grad.numel()) is int:
                stamp([grad], many([grad]) if fused else None, owner, row, label)
            else:
                self._write_rows(row, [grad], label)

        return record_grad

    @property
    def used(self) -> bool:
        """A traced hook was compiled (the buffer is worth reading)."""
        return self.notes.traced

    def forget(self) -> None:
        self.recording = self.stamping = False
        if self.buffer is not None:
            self.extension.set_stamp_target(self.owner, None, None)
        LIVE.pop(self.owner, None)  # (its graphs, if they run again, note nothing)
        self.extension.drop_stamp_count(self.owner)
        self.notes = TraceNotes()

    # ------------------------------------------------------------ traced hooks (tensor ops only)
    def _recording(self) -> bool:
        return self.recording and torch.is_grad_enabled()  # Note [training forwards] (monitor.py)

    def _write_rows(self, first_row: int, values: list, labels: str = "") -> None:
        """One hook's values into consecutive rows from ``first_row``: their records and sequence
        numbers into the buffer in one ``nanscan::stamp`` (csrc/monitor/stamp_rows.cpp; another
        backend's records come from one more op).
        ``labels``: the rows' labels joined by ``LABEL_SEP`` ("" for a row's own name). Labels,
        dtypes and static shapes are noted at trace time (``trace_notes.noted_at_trace``); only symbolic
        (dynamic) shapes are written at run time."""
        if not values:
            return
        # (Unfused, the default kernels summarize inside the op, values on another device than the
        # buffer included: dynamo traces every line here at every module call.)
        records = self._records_of(values) if self.fused_records or not self.default_kernels else None
        torch.ops.nanscan.stamp(values, records, self.owner, first_row, labels)
        for k, t in enumerate(values):
            if type(t.numel()) is not int:  # a symbolic shape: written at run time (static ones are noted)
                self.write_shape(first_row + k, t)

    def _records_of(self, values: list) -> torch.Tensor:
        """Records of ``values`` -- by another backend than the default kernels, or by the default
        ones for inductor to fuse -- on the buffer's device (a value on another device -- model
        parallelism -- is summarized where it lives)."""
        device, one_device = self.buffer.device, True
        for t in values:  # (loops, not generator expressions: fewer traced lines)
            if t.device != device:
                one_device = False
        if one_device:
            records = self.record_many(values)
        else:
            records = torch.stack([self.record_one(t).to(device) for t in values])
        return records.detach() if records.requires_grad else records  # (a backend without the autograd fall-through)

    def write_shape(self, row: int, t) -> None:
        """A symbolic (dynamic) shape into ``row``, as graph ops (a static one is noted at trace time).
        The hooks ask ``type(t.numel()) is not int``: dynamo folds it to a constant."""
        view = self.buffer[row]
        view[NUMEL] = t.numel()
        view[NDIM] = t.dim()
        for d in range(min(t.dim(), MAX_DIMS)):
            view[DIMS + d] = t.shape[d]

    def write_leaf(self, info, args, kwargs, output):
        """A leaf's inputs and outputs after its forward, in one stamp: the inputs into the last of
        its input rows, the outputs right after (see trace_notes.noted_at_trace for when an input row is
        trusted). Only without gradient taps (which must wrap the inputs before the forward)."""
        if not self._recording():
            return None
        values, labels, more = [], [], ""
        for container, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
            for i in keys:
                found = float_tensors(container[i], f"input[{i}]" if container is args else f"input.{i}", [])
                for _, t in found:
                    if len(values) < INPUTS:
                        values.append(t)
                        labels.append("")
                    else:
                        more = MORE_INPUTS
        n_in = len(values)
        found = float_tensors(output, "", [])[:OUTPUTS]
        values += [t for _, t in found]
        labels += [info.name + label for label, _ in found]
        self._write_rows(info.row_base + INPUTS - n_in, values, LABEL_SEP.join(labels) + more)
        self._hook_grads(info, found)
        return None

    def _hook_grads(self, info, found: list) -> None:
        """A gradient hook on each recorded output (``found``: ``(label, tensor)`` in row order)."""
        if self.grad_hooks:
            for k, (label, t) in enumerate(found):
                if t.requires_grad:
                    t.register_hook(self.grad_hook(info, k, f"{info.name}{label} (output grad)"))

    def write_inputs(self, info, args, kwargs):
        """Record the module's first floating inputs; tap the top-level ones that require grad.
        Returns the hook's result: ``(args, kwargs)`` with tapped inputs, or None."""
        if not self._recording():
            return None
        base = info.row_base
        compiled_grads = self.monitor.compiled_grads
        if len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor and not compiled_grads:
            # The common call, module(x): the walk below without its bytecode (dynamo traces every
            # line of a hook, at every module call: that is the watched model's compile time).
            t = args[0]
            if t.is_floating_point() or t.is_complex():
                self._write_rows(base, [t])  # (row names: "<root>.input[0]", else the parent's)
            return None
        grad_base = base + INPUTS + OUTPUTS
        new_args, new_kwargs, k, values, labels = list(args), dict(kwargs), 0, [], []
        for container, keys in ((new_args, range(len(args))), (new_kwargs, list(kwargs))):
            for i in keys:
                value = container[i]
                label = f"input[{i}]" if container is new_args else f"input.{i}"
                found = float_tensors(value, label, [])
                for lab, t in found:
                    if k < INPUTS:
                        labels.append(f"{info.name}.{lab}" if info.is_root else "")
                        values.append(t)
                        if t is value and t.requires_grad and compiled_grads:
                            note(self.owner, grad_base + k, None, t.dtype)
                            container[i] = _Tap.apply(t, self.owner, grad_base + k)
                    k += 1
        more = MORE_INPUTS if k > INPUTS and not info.is_root else ""  # (the root's inputs are the batch)
        self._write_rows(base, values, LABEL_SEP.join(labels) + more)  # (the inputs as they came in, before any tap)
        return tuple(new_args), new_kwargs

    def write_outputs(self, info, output):
        """Record the module's floating outputs; tap the top-level ones (a tensor, or tensors in a
        tuple / list) that require grad. Returns the hook's result: the tapped output, or None."""
        if not self._recording():
            return None
        base = info.row_base + INPUTS
        if type(output) is torch.Tensor and not self.monitor.compiled_grads:  # the common case, as for inputs
            if output.is_floating_point() or output.is_complex():
                self._write_rows(base, [output])  # (row name: the module's)
                if self.grad_hooks and output.requires_grad:
                    output.register_hook(self.grad_hook(info, 0))
            return None
        grad_base = base + OUTPUTS + INPUTS
        found = float_tensors(output, "", [])[:OUTPUTS]
        self._write_rows(base, [t for _, t in found], LABEL_SEP.join(info.name + label for label, _ in found))
        if not self.monitor.compiled_grads:
            self._hook_grads(info, found)
            return None
        if isinstance(output, torch.Tensor):
            if output.requires_grad and (output.is_floating_point() or output.is_complex()):
                note(self.owner, grad_base, f"{info.name} (output grad)", output.dtype)
                return _Tap.apply(output, self.owner, grad_base)
            return None
        if type(output) in (tuple, list):
            tapped, k = list(output), 0
            for i, value in enumerate(output):
                if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                    if k < OUTPUTS and value.requires_grad:
                        note(self.owner, grad_base + k, f"{info.name}[{i}] (output grad)", value.dtype)
                        tapped[i] = _Tap.apply(value, self.owner, grad_base + k)
                    k += 1
                else:
                    k += len(float_tensors(value, "", []))
            return type(output)(tapped)
        return None

    # ------------------------------------------------------------ read
    def begin_forward(self) -> None:
        """A training forward of the root starts (called by the monitor, eagerly). Its graph will
        write the same rows as the forward before it in this read window (gradient accumulation):
        the rows so far are kept in a device copy first -- a sub-window, decoded in its turn -- and
        marked unwritten. No sync."""
        if not self.used:
            return
        if self.forwards:
            self.snapshots.append(self.buffer.clone())
            self.buffer[:, SEQ:WRITES + 1].zero_()
        self.forwards += 1

    def window(self) -> Optional[torch.Tensor]:
        """What a read copies: the sub-windows kept by :meth:`begin_forward`, then the buffer, as
        one tensor of ``len(rows)``-row blocks (None when no traced hook was compiled)."""
        if not self.used:
            return None
        return torch.cat(self.snapshots + [self.buffer]) if self.snapshots else self.buffer

    def reset(self) -> None:
        """Mark every row unwritten (device ops, no sync): a new read window."""
        self.snapshots, self.forwards = [], 0
        if self.used:
            self.buffer[:, SEQ:WRITES + 1].zero_()
            self.counter.zero_()
        self.extension.reset_stamp_count(self.owner)  # (the host's count of the same stamps)

    def stamped(self) -> int:
        """Rows stamped since the last :meth:`reset`, counted on the host (Note [stamps counted on
        the host] in csrc/monitor/stamp_rows.cpp)."""
        return self.extension.stamp_count(self.owner)

    def slots(self, written: list, step: int, offset: int = 0, phase: str = "forward"):
        """Slots, record values and sequence numbers of the rows written in this window
        (``[(row, values)]``), in execution order, and per module name the indices of the slots its
        weights' gradients depend on (its forward inputs and the gradients of its outputs). The slots will sit at
        ``offset`` onwards in the window's slot list: the indices they hold count from there.

        With gradient hooks, the gradient flowing into an output is linked to that output
        (``grad_of`` / ``grad``) and the output to the modules that took it as an input
        (``consumers``, noted while the graph was traced): attribution then names the gradient
        after its consumer, as in eager."""
        slots, records, seqs, index_of_row, weight_inputs = [], [], [], {}, {}
        notes = self.notes
        for row, v in sorted(written, key=lambda rv: rv[1][SEQ]):
            if row >= len(self.rows):
                continue
            r = self.rows[row]
            label, dtype = notes.labels.get(row, (None, torch.float32))
            name = label or r.name
            shape = notes.shapes.get(row)
            if shape is None:  # written at run time (dynamic shapes)
                ndim = int(v[NDIM])
                shape = tuple(int(s) for s in v[DIMS:DIMS + ndim]) if ndim <= MAX_DIMS else (int(v[NUMEL]),)
            slot = Slot(step, r.phase if phase == "forward" else phase, r.kind, name, dtype, shape,
                        tuple(index_of_row[i] for i in r.inputs if i in index_of_row), r.candidate, r.info)
            slot.derived = r.derived
            # (written twice: a module called twice in one forward; only its last value is here)
            slot.stale = row in notes.untrusted or v[WRITES] > 1
            index_of_row[row] = offset + len(slots)
            if r.weight_input and r.module is not None:
                weight_inputs.setdefault(r.module.name, []).append(offset + len(slots))
            slots.append(slot)
            records.append(v[:RECORD_SIZE])
            seqs.append(int(v[SEQ]))
        ran = self._traces_that_ran(index_of_row)
        self._name_inputs_of_overwritten_outputs(slots, records, offset, index_of_row, ran)
        if self.grad_hooks:
            self._link_grads(slots, offset, index_of_row, ran)
        return slots, records, seqs, weight_inputs

    def _name_inputs_of_overwritten_outputs(self, slots: list, records: list, offset: int, index_of_row: dict,
                                            ran: set) -> None:
        """A non-finite input row that took a module's output (noted at trace time) whose own row
        was written again (the module called twice): the input row may be the one record left of
        an earlier output. It is not a value of the parent's body -- it is named after the module
        that made it, with ``produced=None`` (what that call received was overwritten too).

        In a window with an overwritten output, a non-finite input row that no trace that ran
        explains (it came from another graph, across a graph break, or its graph's notes are
        unknown) may hold that lost output: it is kept stale, never called a value of the parent's
        body. (Only non-finite rows: a finite one is still the value its consumer took.)"""
        overwritten_outputs = any(self.rows[r].is_output and self.rows[r].phase == "forward"
                                  and slots[i - offset].stale for r, i in index_of_row.items())
        if not overwritten_outputs:
            return
        for row, index in index_of_row.items():
            v = records[index - offset]
            if not v[0] + v[1] + v[2] > 0:
                continue
            notes = self.notes.explained.get(row)
            made = set().union(*(rows for trace, rows in notes.items() if trace in ran)) if notes else set()
            if not made:
                if slots[index - offset].derived:
                    slots[index - offset].stale = True
                continue
            overwritten = [r for r in made if r in index_of_row and slots[index_of_row[r] - offset].stale]
            if not overwritten:
                continue
            producer = slots[index_of_row[overwritten[0]] - offset]
            slot = slots[index - offset]
            slot.name, slot.owner, slot.derived, slot.candidate = producer.name, producer.owner, False, True
            slot.inputs = (index_of_row[overwritten[0]],)  # (stale: produced is None)

    def _link_grads(self, slots: list, offset: int, index_of_row: dict, ran: set) -> None:
        """Gradient rows to their outputs, outputs to their consumers (see :meth:`slots`). A consumer
        with an output that required grad but whose gradient was not recorded here is marked
        incomplete: what flowed into it is unknown, so nanscan cannot say it made the gradient."""
        grad_shift = OUTPUTS + INPUTS  # an output row's gradient row is this many rows after it
        for row, index in index_of_row.items():
            r = self.rows[row]
            if r.phase == "backward" and r.is_output and row - grad_shift in index_of_row:
                forward = index_of_row[row - grad_shift]
                slots[index - offset].grad_of = forward
                slots[forward - offset].grad = index
        calls = {}  # consumer module name -> Call
        if any(trace in self.notes.partial_traces for trace in ran):
            return  # (a module took inputs that were not stamped: no value's consumers are known)
        for row, index in index_of_row.items():
            notes = self.notes.consumers.get(row)
            if not notes:
                continue
            names = set().union(*(names for trace, names in notes.items() if trace in ran))
            frames = []
            for name in sorted(names):
                if name not in calls:
                    calls[name] = self._call(self.infos[name], slots, offset, index_of_row)
                frames.append(calls[name])
            slots[index - offset].consumers = frames

    def _traces_that_ran(self, index_of_row: dict) -> set:
        """The traces whose graphs wrote this window's rows: those whose forward rows, in the order
        they were stamped (a row stamped twice at its last stamp: the one its sequence number
        keeps), are a contiguous run of the forward rows written, in execution order. A graph that
        ran and was partly overwritten by another does not count: its notes are then unknown,
        never guessed."""
        if not self.notes.trace_rows:
            return set()
        written = [row for row in index_of_row if self.rows[row].phase == "forward"]
        position = {row: i for i, row in enumerate(written)}
        ran = set()
        for trace, stamped in self.notes.trace_rows.items():
            if not stamped:
                continue
            rows = list(dict.fromkeys(reversed(stamped)))[::-1]  # (each row at its last stamp)
            start = position.get(rows[0])
            if start is not None and written[start:start + len(rows)] == rows:
                ran.add(trace)
        return ran

    def _call(self, info, slots: list, offset: int, index_of_row: dict) -> Call:
        first = info.row_base + INPUTS
        rows = [r for r in range(first, first + OUTPUTS) if r in index_of_row]
        outputs = [index_of_row[r] for r in rows]
        complete = all(slots[index_of_row[r] - offset].grad is not None for r in rows if r in self.notes.needs_grad)
        return Call(info, outputs, complete)

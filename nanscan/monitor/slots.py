"""The monitor's records of one read window, in production order.

A :class:`Slot` says what one record describes (step, phase, kind, name, dtype, shape) and what it
depends on. The window itself -- the entries in production order and the device records,
summarized in batches -- is the C++ :class:`nanscan._C.Window` (``csrc/monitor/window.h``):
the eager hooks add rows to it without making Python objects, Python code adds :class:`Slot`
objects (the loss, optimizer state) and :class:`Block` runs (parameters, buffers). A taken window
is a list in which every entry is a :class:`Slot` or a lazy run (:class:`Block`,
:class:`GradBlock`, :class:`EagerRows`) standing in for each of its rows; :func:`at` gives the
:class:`Slot` of any entry.

Why batches: one ``summarize`` launch costs a few microseconds of host time whatever the tensor's
size, and the monitor records two or three tensors per module per step; ``summarize_many`` over a
batch costs a fraction of that per tensor. A tensor is therefore kept (with its version counter)
until the batch is summarized: at the end of the forward, at a read, before a module that works in
place, or when the batch is full (``BATCH`` tensors, or ``BATCH_BYTES`` that only the batch keeps
alive: bounded memory).

Why that is safe: a tensor changed in place between its hook and the batch would be summarized
with its later value. Its version counter says so; the slot is then marked ``stale`` (nanscan
cannot tell what it held when it was produced, and says so), and the module it came from is
recorded without batching from then on.

On the CPU with the default kernels there is no batch: a tensor is recorded as it is the moment it
arrives (``summarized_on_arrival`` in ``csrc/monitor/grad_sink.h``: a small one copied and
summarized with the other copies when the window is read, a larger one summarized at once), so its
record is never stale and no tensor is kept alive for a batch.
"""
from __future__ import annotations

import math

from nanscan import _ops

# A batch is summarized at BATCH tensors, or when what it alone keeps alive reaches BATCH_BYTES (Note
# [a batch bounded by what only it keeps alive] in csrc/monitor/grad_sink.h): a training forward's
# outputs, held by autograd anyway, make one batch up to BATCH.
BATCH = 1024
BATCH_BYTES = 64 << 20


class Slot:
    """One record: what was summarized, when, and what it depends on.

    ``inputs``: indices of the slots this value was computed from ("produced" means they were all
    finite); ``candidate``: False for values recorded only for attribution (the batch);
    ``owner``: the module (:class:`nanscan.monitor.eager.ModuleInfo`) whose forward produced it;
    ``consumers``: the module calls (frames) that took it as an input; ``grad``: the slot of its
    gradient; ``grad_of``: for a gradient, the slot of the forward value; ``param``: for a
    parameter gradient read at the check, the parameter."""

    __slots__ = ("step", "phase", "kind", "name", "dtype", "shape", "inputs", "candidate", "owner",
                 "consumers", "grad", "grad_of", "param", "stale", "derived", "known_bad_inputs", "late",
                 "inputs_changed")

    def __init__(self, step, phase, kind, name, dtype, shape, inputs=(), candidate=True, owner=None):
        self.step, self.phase, self.kind, self.name = step, phase, kind, name
        self.dtype, self.shape, self.inputs, self.candidate, self.owner = dtype, shape, inputs, candidate, owner
        self.consumers = self.grad = self.grad_of = self.param = None
        self.stale = False
        # A compiled-path input row: a body value only if nothing earlier in its phase was non-finite.
        self.derived = False
        # Inputs read in an earlier window: the names of the non-finite ones (() = all finite), or None.
        self.known_bad_inputs = None
        # Recorded eagerly after a compiled forward whose rows are decoded after it: not a producer.
        self.late = False
        # Made by a call that changed one of its inputs in place: what it was computed from is unknown.
        self.inputs_changed = False


class Block:
    """Rows of one launch group whose :class:`Slot` objects are made only when looked at:
    parameters, their gradients and buffers -- hundreds of rows a step, almost never non-finite,
    so building a Python object per row per step would be most of the monitor's host cost. In a
    slot list the block stands in for each of its rows; :func:`at` materializes one.

    ``tensors``: the live parameters / buffers (dtype and shape are read from them when a row is
    materialized); ``names`` and ``owners`` per row; ``inputs(k)`` -> slot indices of row k's inputs
    in the same window, or ``input_bad(k)`` -> the names of its non-finite inputs (() when all were
    finite, None when unknown) for inputs that were read in an earlier window."""

    candidate, stale, derived, late, grad_of, consumers, grad = True, False, False, False, None, None, None

    def __init__(self, step, phase, kind, names, tensors, owners, *, inputs=None, input_bad=None, param=False):
        self.step, self.phase, self.kind = step, phase, kind
        self.names, self.tensors, self.owners = names, tensors, owners
        self.inputs_of, self.input_bad = inputs, input_bad
        self.param = True if param else None  # parameter gradients: the step log sums their norms
        self.start = 0
        self.extra_inputs: dict = {}  # owner name -> more input slot indices (the compiled path's rows)

    def slot(self, index: int) -> Slot:
        k = index - self.start
        t, owner = self.tensors[k], self.owners[k]
        inputs = self.inputs_of(k) if self.inputs_of is not None else None
        if inputs is not None and owner is not None:
            inputs = tuple(inputs) + self.extra_inputs.get(owner.name, ())
        slot = Slot(self.step, self.phase, self.kind, self.names[k], t.dtype, tuple(t.shape), inputs or (), True, owner)
        slot.param = self.param
        if self.input_bad is not None:
            slot.known_bad_inputs = self.input_bad(k)
        return slot


class GradBlock(Block):
    """Gradients flowing into module outputs, received by the C++ backward tap
    (``csrc/monitor/grad_sink.h``) and summarized there (in batches; on arrival on the CPU):
    ``meta`` (a ``nanscan._C.GradMeta``) holds in C++, per row k, the slot (in ``window``) of the
    output whose gradient it is (``meta.index(k)``), its dtype, shape and staleness -- asked only
    for a row that is looked at."""

    def __init__(self, step, window, meta):
        # (Block's fields set here, not through its __init__: one Python call less per read)
        self.step, self.phase, self.kind = step, "backward", "grad"
        self.names = self.tensors = self.owners = self.inputs_of = self.input_bad = self.param = None
        self.start, self.extra_inputs = 0, {}
        self.window, self.meta = window, meta

    def slot(self, index: int) -> Slot:
        k = index - self.start
        meta = self.meta
        forward_index = meta.index(k)
        forward = at(self.window, forward_index)
        slot = Slot(self.step, "backward", "grad", f"{forward.name} (output grad)", meta.dtype(k), meta.shape(k),
                    (), True, forward.owner)
        slot.grad_of, slot.stale = forward_index, meta.stale(k)
        return slot


class Call:
    """One recorded module call, as attribution sees it: the module and the entries of its outputs.
    ``complete``: False when the gradient of one of its outputs that needed one was not recorded
    (what flowed into its backward is then unknown)."""

    __slots__ = ("info", "outputs", "complete")

    def __init__(self, info, outputs, complete=True):
        self.info, self.outputs, self.complete = info, outputs, complete


# Row kinds, defined once in csrc/monitor/rows.h and exposed by the extension (None without a usable
# library: no rows exist then).
_EXTENSION = _ops.monitor_extension()
_ROW_KINDS = _EXTENSION.ROW_KINDS if _EXTENSION is not None else {}
OUTPUT, BODY, BATCH_INPUT, MODEL_LOSS = (_ROW_KINDS.get(k) for k in ("OUTPUT", "BODY", "BATCH_INPUT", "MODEL_LOSS"))


class EagerRows(Block):
    """The rows the C++ hooks recorded in one window (``rows``: a :class:`nanscan._C.Rows`):

    * a module's output: named ``module`` + where it sits in the output (``"[1]"``, ``".logits"``);
      its inputs are the module's inputs;
    * a value made in a module's own body (an input of a child that no record explains): named
      after that module, from its inputs;
    * the batch (inputs of the outermost call): ``"<module>.input[0]"``, for attribution only;
    * a loss the model returned itself (``output["loss"]``): phase and kind ``"loss"``, from the
      model's inputs and other outputs.

    ``consumers`` are the calls that took the value as an input (:class:`Call`)."""

    def __init__(self, rows, infos):
        # (Block's fields set here, not through its __init__: made at every read, by the C++ window)
        self.step = self.phase = None
        self.kind = "activation"
        self.names = self.tensors = self.owners = self.inputs_of = self.input_bad = self.param = None
        self.start, self.extra_inputs = 0, {}
        self.rows, self.infos = rows, infos
        self._loss_entries = self._steps = None

    @property
    def loss_entries(self) -> frozenset:
        """Entries of the losses the model returned itself (asked by the step log)."""
        if self._loss_entries is None:
            self._loss_entries = frozenset(self.rows.loss_entries())
        return self._loss_entries

    def module_output(self, index: int):
        """``(step, phase, candidate, name, dtype, numel)`` of row ``index`` when it is a module's
        output or a value made in a module's body, None otherwise or when the row is stale (its
        record is of a later value). Read straight from the C++ row: no Slot is made (telemetry
        and the spike baselines ask this of every row of a step)."""
        kind, info, label, step, phase, dtype, shape, _, candidate, _, _, stale = self.rows.row(index)[:12]
        if (kind != OUTPUT and kind != BODY) or stale:
            return None
        module = self.infos[info]
        return step, phase, candidate, module.name + label if kind == OUTPUT else module.name, dtype, math.prod(shape)

    @property
    def steps(self) -> tuple:
        """The steps the rows were recorded in, ascending."""
        if self._steps is None:
            self._steps = tuple(self.rows.steps())
        return self._steps

    def slot(self, index: int) -> Slot:
        kind, info, label, step, phase, dtype, shape, inputs, candidate, consumers, grad, stale, changed = \
            self.rows.row(index)
        module = self.infos[info]
        owner = module
        if kind == OUTPUT:
            name = module.name + label
        elif kind == BODY:
            name = module.name
        elif kind == BATCH_INPUT:
            name, owner = f"{module.name}.{label}", None
        else:
            name = "loss"
        slot = Slot(step, phase, "loss" if kind == MODEL_LOSS else "activation", name, dtype, shape, inputs, candidate,
                    owner)
        slot.late = not candidate and kind in (OUTPUT, MODEL_LOSS)
        slot.consumers = [self._call(f) for f in consumers] or None
        slot.grad, slot.stale, slot.inputs_changed = grad, stale, changed
        return slot

    def _call(self, frame: int) -> Call:
        info, outputs = self.rows.frame(frame)
        return Call(self.infos[info], outputs)


def at(slots: list, index: int) -> Slot:
    """The slot at ``index`` of a window's slot list (materializing block rows)."""
    s = slots[index]
    return s.slot(index) if isinstance(s, Block) else s

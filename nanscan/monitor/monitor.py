"""The always-on monitor: ``nanscan.watch(model, optimizer)`` -> :class:`Monitor`.

One call turns it on; the training loop needs no change. This module holds the step lifecycle
and the read; the pieces live beside it, one concept each:

* :mod:`~nanscan.monitor.eager` -- the hooks that record module inputs / outputs and their
  gradients outside compiled graphs;
* :mod:`~nanscan.monitor.traced` -- the same inside ``torch.compile`` graphs (static rows of a
  device buffer, stamped with a device counter);
* :mod:`~nanscan.monitor.slots` -- the records of one read window, in production order;
* :mod:`~nanscan.monitor.readback` -- the step's one device-to-host copy;
* :mod:`~nanscan.monitor.attribution` -- the first non-finite value and produced / propagated;
* :mod:`~nanscan.monitor.ledger`, :mod:`~nanscan.monitor.steplog`,
  :mod:`~nanscan.monitor.stepcapture`, :mod:`~nanscan.monitor.distributed`.

Steps. A step is one optimizer step: it ends in the optimizer's step post-hook, or when
GradScaler skipped the update (its ``step`` is wrapped), however many forward / backward passes
it took (gradient accumulation). Without an optimizer, a step ends at the first training forward
after a backward, and at :meth:`Monitor.close`. ``with mon.step(batch):`` still works as an
explicit delimiter.

Note [training forwards]: a *training* forward is one with grad enabled (outside ``no_grad`` and
``inference_mode``), whatever the modules' ``training`` flag: fine-tuning in ``model.eval()``
(frozen BatchNorm statistics, no dropout) is training, and its backward and update follow. Other
forwards are phase ``"eval"``: they never change the step, are checked by default, read at their
end, and never raise unless ``eval_forwards="raise"``. A validation pass in ``model.eval()`` that
leaves grad enabled cannot be told from fine-tuning in eval mode: it is checked as a training
forward of the step it runs in (HF Trainer and Lightning validate under ``no_grad`` /
``inference_mode``); the failure bundle keeps the step's first train-mode batch where there is one.

Reads. Records stay on the device. A checked step is read once, with one copy: in sync mode in
the optimizer's step pre-hook (a non-finite step is stopped before the update), or when the step
ends without an update; parameters and buffers recorded after the update (step post-hook) are
read with the next step's copy. In async mode the copy is non-blocking and decoded one read
later: no host sync at all on CUDA. ``optimizer.step(closure)`` (Lightning's automatic
optimization, LBFGS) runs the forward and backward inside the step: the read then happens when the
closure returns, still before the update.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import glob
import os
import weakref
from typing import Iterable, Optional

import torch

from nanscan import _ops
from nanscan.allow import check_allow
from nanscan.guard import attach_note
from nanscan.monitor import distributed
from nanscan.monitor.autocast_probe import AutocastProbe, autocast_enabled
from nanscan.monitor.attribution import first_incidents, offenders, other_offenders
from nanscan.monitor.eager import ROOT, EagerHooks, ModuleInfo
from nanscan.monitor.headroom import HeadroomWatch, row_maxima
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.readback import Copy
from nanscan.monitor.slots import BATCH, BATCH_BYTES, BODY, OUTPUT, Block, EagerRows, GradBlock, Slot, at
from nanscan.monitor.stepcapture import StepCapture
from nanscan.monitor.steplog import StepLog
from nanscan.monitor.torch_hooks import WATCHED as _WATCHED
from nanscan.monitor.torch_hooks import graph_has_compiled_function, install, unwrap
from nanscan.monitor.traced import TracedRows, drop_graphs_compiled_without_hooks
from nanscan.record import RECORD_SIZE
from nanscan.vocabulary import PHASE_ORDER
from nanscan.warn import warn

MODES = ("sync", "async")
COMPILED_GRADS = ("hooks", "taps", "off")
ON_NONFINITE = ("raise", "warn", "record")
EVAL_FORWARDS = ("check", "raise", "skip")




# Note [one incident per step and phase]: an incident is the *first* non-finite value of its step
# and phase. A step can be read more than once -- optimizer.step(closure) reads after every closure
# call, and LBFGS evaluates the closure many times in one step, at parameters it moved in between --
# and a later read of the same step finds the same fault (or what followed from it) again: it adds
# nothing to self.incidents, the log or the warnings. Eval forwards are read one by one and keep
# their incidents each (phase "eval").


# Note [eager frames beside compiled ones]: under torch.compile(model) the modules' hooks run inside
# the graphs (traced rows, in production order among themselves) and only the root's run eagerly.
# A frame that dynamo runs eagerly -- past its recompile limit (a module whose attribute changes at
# every call), or a frame it skips -- calls the eager hooks of the modules in it, in the same forward:
# their rows are in the eager window, the compiled ones in the traced rows, and how the two sequences
# interleave is not recorded. A forward or backward incident of such a step is then named after the
# first non-finite value in the order the read assumes (eager rows first), which may not be the first
# that was made: it says so (order_known=False, produced=None) instead of naming a place as certain.
def _steps_with_eager_module_rows(eager_slots) -> set:
    """Steps whose training forward recorded rows of modules other than the root through the eager
    hooks (a read that also holds compiled rows: those steps mixed the two)."""
    steps = set()
    for i, s in enumerate(eager_slots):
        if type(s) is not EagerRows:
            continue
        kind, info, _, step, phase = s.rows.row(i)[:5]
        if kind in (OUTPUT, BODY) and phase == "forward" and not s.infos[info].is_root:
            steps.add(step)
    return steps


def _training_order(incident) -> tuple:
    return incident.step, PHASE_ORDER[incident.phase]


class Monitor:
    """Watches one model; see :func:`watch` for the options. Use as a context manager (or call
    :meth:`close`): hooks are removed and pending records are checked on exit."""

    def __init__(self, model, optimizer=None, scaler=None, *, activations=True, activation_grads=True,
                 compiled_grads="hooks", grads=True, params=True, buffers=True, optimizer_state=False, every=1,
                 mode="sync", on_nonfinite="raise", allow=(),
                 backend=None, capture_dir=None, keep_pre_update_state=False, log=None, eval_forwards="check",
                 headroom_bits=None, headroom_cast=None):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.activations, self.grads, self.params, self.buffers = activations, grads, params, buffers
        self.activation_grads = activations and activation_grads
        # Gradients inside compiled graphs: taps (``compiled_grads``) or tensor hooks (``compiled_grad_hooks``).
        self.compiled_grads = self.activation_grads and compiled_grads == "taps"
        self.compiled_grad_hooks = self.activation_grads and compiled_grads == "hooks"
        self.optimizer_state = optimizer_state
        self.every, self.mode, self.on_nonfinite, self.eval_forwards = every, mode, on_nonfinite, eval_forwards
        self.allow = tuple(allow)
        self.backend = backend
        self.capture_dir = capture_dir
        self.keep_pre_update_state = keep_pre_update_state
        self.incidents: list = []
        self._incident_keys: set = set()  # (step, phase) of the training incidents in self.incidents
        self.offenders: dict = {}  # step -> names of every non-finite value found in it (not only the first)
        self.ledger = Ledger()
        self.rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                     and torch.distributed.is_initialized()) else 0
        self.steplog: Optional[StepLog] = StepLog(log, self.rank) if log is not None else None
        self.headroom = (HeadroomWatch(headroom_bits, headroom_cast, self.rank, grads=scaler is None)
                         if headroom_bits is not None else None)
        self._autocast_probe = AutocastProbe()
        self._capturer = StepCapture(model, optimizer, scaler, capture_dir, keep_pre_update_state, self.rank, mode)
        self._kernels: dict = {}  # device -> (one, many)
        infos = [ModuleInfo(name or ROOT, m, m is model, k) for k, (name, m) in enumerate(model.named_modules())]
        self._info_of = {info.name: info for info in infos}
        # (Note [modules changed after watch])
        self._index_of_module = {id(m): k for k, (_, m) in enumerate(model.named_modules())}
        self._recollect = False
        extension = self._extension = _ops.monitor_extension()
        if extension is None:
            raise RuntimeError(f"nanscan.watch needs nanscan's compiled library (its hooks and read windows are "
                               f"C++): {_ops.LOAD_ERROR}")
        self._collect_tensors()
        # (The hooks' records are summarized by C++: in batches on a device, on arrival on the CPU.)
        summarize = self._summarize_in_cpp()
        # Per read window: the records (production order); eval forwards have their own.
        marker = object()  # (stands for a C++ row in a window's entry list until the window is taken)

        def window():
            return extension.Window(marker, lambda rows: EagerRows(rows, infos), summarize, None,
                                    len(infos), BATCH, BATCH_BYTES)

        self.slots, self.eval_slots = window(), window()
        self.slots_generation = 0
        # The gradients of module outputs: a C++ tap on the autograd node of each recorded output
        # (no Python in the backward with the default kernels).
        self.grad_sink = extension.GradSink(BATCH, BATCH_BYTES, summarize) if self.activation_grads else None
        self.hooks = EagerHooks(self, infos, self.activation_grads, extension)
        self.traced = TracedRows(self, infos, self._kernels_for)
        # Step state.
        self.step_index = 0
        self.checking = True  # this step is sampled (every)
        self._explicit = False  # inside `with mon.step()`
        # An explicit step whose block ended before its optimizer step (Note [explicit steps]).
        self._awaiting_update = False
        self._forward_seen = False  # a training forward ran in this step
        self._root_seen = False  # ... of the whole model
        self._attempted = False  # optimizer.step / scaler.step was called in this step
        self._applied: Optional[bool] = False  # the update ran (None: a fused-AMP flag decides, read later)
        self._read_this_step = False
        self._in_flight: Optional[Copy] = None
        self._grads_read: dict = {}  # step -> (names with a gradient read, names non-finite)
        self._forward_bad: dict = {}  # step -> whether its forward had a non-finite value
        self._fused_applied: dict = {}  # step -> did a fused-AMP update apply (read before the update)
        self._closed = False
        self._loss_ref = None  # the loss recorded last (check_loss / scaler.scale / backward record it once)
        self._scaled_ref = None  # the last scaler.scale(loss) result
        self._clip_unknown = False  # clipped by a norm other than L2 in this step
        self._higher_order_step = None  # the step a gradient was taken with create_graph=True in
        # total norms clip_grad_norm_ returned in this step (Note [grad norm before clipping])
        self._clip_norms: list = []
        self._raised = False  # a NonFiniteError was raised (close() then records, never raises)
        self.opened_by_callback = False  # (an integration's callback opened it: see integrations.transformers)
        self._unhooked_graph = False  # a backward ran through a graph compiled without this monitor's hooks
        self._failed_step: Optional[int] = None  # the explicit step that ended by raising, if the last did
        self._handles: list = []
        try:
            self._install()
        except BaseException:  # a half-installed monitor leaves nothing behind on the model
            for handle in self._handles:
                handle.remove()
            self.hooks.close()
            raise

    # ------------------------------------------------------------------ setup
    def _install(self) -> None:
        if self.activations:
            self.hooks.install(self._handles)
            self.traced.allocate(self._model_device())
        if self.optimizer is not None:
            # Host work (the read): run eagerly even when the optimizer step is compiled (one graph
            # break there instead of dynamo tracing the read and breaking on every host op).
            eager = torch.compiler.disable
            self._handles.append(self.optimizer.register_step_pre_hook(eager(self._optimizer_pre_hook)))
            self._handles.append(self.optimizer.register_step_post_hook(eager(self._optimizer_post_hook)))
        if self.scaler is not None:
            self._wrap_scaler_step()

    def _collect_tensors(self) -> None:
        """The model's parameters and floating buffers, as the checks read them."""
        model = self.model
        first_name, self._first_param = next(iter(model.named_parameters()))
        self._where = (self._first_param.device, self._first_param.dtype)
        # How the first parameter is reached from the root: (the holder's _modules or _parameters,
        # key, value) per part of its name, so that _follow_moves asks a few dicts instead of
        # walking every module.
        *path, leaf = first_name.split(".")
        self._first_chain, holder = [], model
        for key in path:
            child = holder._modules[key]
            self._first_chain.append((holder._modules, key, child))
            holder = child
        self._first_chain.append((holder._parameters, leaf, self._first_param))
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in self._params]
        self._all_param_names = frozenset(self._param_names)
        self._param_tensors = [p for _, p in self._params]
        # FSDP2 / tensor parallelism: DTensor parameters (and gradients, optimizer state) are
        # summarized shard-locally (distributed.local_shards). Decided once: plain models pay nothing.
        self._sharded = distributed.has_dtensors(self._param_tensors)
        self._param_owners = [self._info_of.get(n.rpartition(".")[0] or ROOT) for n in self._param_names]
        # Plain (unsharded) parameters are held in C++ for the per-step checks: one call each for
        # their records and their gradients' records (no Python list to convert, no Python object
        # per gradient). The kernels are those of the parameters' device now; a move collects again.
        self._param_ids = None  # (made when first asked: clip_grad_norm_ tells its parameters by identity)
        self._param_set = None
        if self._param_tensors and not self._sharded:
            self._param_set = self._extension.TensorSet(self._param_tensors, self._summarize_in_cpp())
        self._buffers = [(n, b, self._info_of.get(n.rpartition(".")[0] or ROOT)) for n, b in model.named_buffers()
                         if b.is_floating_point() or b.is_complex()] if self.buffers else []

    def _module_registered(self, parent, name: str, child) -> None:
        """A module of the model is given a child (Note [modules changed after watch])."""
        index = self._index_of_module.get(id(parent))
        if self._closed or index is None or parent._modules.get(name) is child:
            return
        self.hooks.cpp.set_unwatched_child(index)
        self._recollect = True
        where = f"{self.hooks.infos[index].name}.{name}" if index else name
        warn(f"nanscan: module {where!r} was set after watch and is not watched: values it makes are "
             f"'cannot tell' at its parent; its parameters are checked from the next step. Watch the model "
             f"again (mon.close(); nanscan.watch(...)) to watch it.", RuntimeWarning, stacklevel=4)

    def _follow_moves(self) -> None:
        """After ``model.to(...)`` (device or dtype) the buffers are new tensors, and with
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` (or ``to_empty``) so are
        the parameters: the checks would read the old ones and miss what the new ones hold. Asked
        at every step end for the price of a few dict lookups (the first parameter, by its path from
        the root: a replaced module or parameter on that path, or a new device or dtype, is a
        move); a move collects them again. Not
        for sharded models: FSDP2 registers unsharded parameters in place of the sharded ones for
        a while; they are not a move."""
        if self._recollect:
            self._recollect = False
            self._collect_tensors()
            return
        if self._sharded:
            return
        for attributes, key, value in self._first_chain:  # (a few dict lookups, not a walk of the model)
            if attributes.get(key) is not value:
                break
        else:
            first = self._first_param
            if (first.device, first.dtype) == self._where:
                return
        if next(iter(self.model.parameters()), None) is not None:  # (a model left with no parameter: kept)
            self._collect_tensors()

    def _model_device(self) -> torch.device:
        # (The first parameter, kept: model.to() moves a Parameter's data in place, so its device
        # stays current without walking model.parameters() at every step.)
        return self._first_param.device

    def _kernels_for(self, device):
        kernels = self._kernels.get(device)
        if kernels is None:
            kernels = self._kernels[device] = _ops.kernels(self.backend, device)
        return kernels

    def _summarize_in_cpp(self):
        """What the C++ side (read windows, gradient sink, parameter set) summarizes with: None for the
        default kernels on a plain model -- the op, called from C++ with no Python per batch --, else
        this monitor's _summarize_many (another backend; a sharded model's DTensors, as local shards)."""
        many = self._kernels_for(self._model_device())[1]
        return None if many is torch.ops.nanscan.summarize_many.default and not self._sharded else self._summarize_many

    def _summarize_many(self, xs: list) -> torch.Tensor:
        if self._sharded:  # (a DTensor module input or optimizer state: its local shard)
            xs = distributed.local_shards(xs)
        return self._kernels_for(xs[0].device)[1](xs)

    def _wrap_scaler_step(self) -> None:
        """GradScaler has no hooks; two methods of this scaler instance are wrapped.

        ``scale(loss)``: the loss is recorded (phase ``"loss"``) -- in an AMP loop the step log and
        the loss incident need no ``mon.check_loss``. ``step(optimizer)``: when GradScaler skips
        the update, optimizer.step never runs, so the step would end unseen -- after the loop's
        ``zero_grad`` dropped the gradients and ``scaler.update()`` changed the scale. The wrapper
        ends the step right there, with the unscaled gradients still in place."""
        scaler, original_step, original_scale = self.scaler, self.scaler.step, self.scaler.scale

        def scale(outputs):
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and not self._closed:
                self.check_loss(outputs)
                scaled = original_scale(outputs)
                self._scaled_ref = weakref.ref(scaled)  # (its backward is the loss's, recorded unscaled)
                return scaled
            return original_scale(outputs)

        def step(optimizer, *args, **kwargs):
            self._attempted = True
            self._awaiting_update = False
            step_before = self.step_index
            result = original_step(optimizer, *args, **kwargs)
            if not self._closed and self.step_index == step_before and not self._applied:  # skipped
                try:
                    if self.checking and not self._read_this_step:
                        self._read(before_update=False)
                finally:
                    if not self._explicit:
                        self._end_step(raise_incident=False)
            return result

        scaler.step, scaler.scale = step, scale

        class _Restore:
            def remove(self_inner):
                for name, wrapper in (("step", step), ("scale", scale)):
                    if scaler.__dict__.get(name) is wrapper:
                        delattr(scaler, name)

        self._handles.append(_Restore())

    # ------------------------------------------------------------------ step lifecycle
    def _forward_begins(self, info: ModuleInfo, args, kwargs) -> Optional[str]:
        """An outermost watched module starts a forward: the phase its records get, or None."""
        module = info.module()
        if self._closed or module is None:
            return None
        if not (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):  # Note [training forwards]
            return "eval" if (self.eval_forwards != "skip" and self.activations) else None
        if not self._explicit and self.optimizer is None and self._backward_seen():
            self._end_step()  # no optimizer: a training forward after a backward starts the next step
        elif self._awaiting_update:
            self._end_step()  # an explicit step whose optimizer step never came: the next step begins
        if self.headroom is not None:
            self.headroom.note_autocast(self.step_index, self._model_device().type)
        # The step's first outermost watched call -- the model, or the watched module a step calls
        # when the model is a wrapper (Lightning's `self.net(x)` in training_step) -- or its first in
        # train mode, after forwards in eval mode with grad enabled (a validation pass without
        # no_grad): the inputs it trained on. (Every outermost call comes here: a nested one does not.)
        if not self._root_seen or (self._root_seen == "eval" and module.training):
            self._root_seen = True if module.training else "eval"
            if self.capture_dir is not None and self.checking and not self._explicit:
                self._capturer.remember(self.step_index, forward_inputs=(args, kwargs),
                                        inputs_of=None if info.is_root else info.name)
            else:
                self._capturer.note_autocast(self.step_index)
        if (self.headroom is not None or self.capture_dir is not None) and not autocast_enabled():
            self._autocast_probe.arm(module, functools.partial(self._autocast_inside, self.step_index))
        self._forward_seen = True
        if not (self.checking and self.activations):
            return None
        if info.is_root:
            self.traced.begin_forward()
        return "forward"

    def _autocast_inside(self, step: int) -> None:
        """Autocast was entered inside the model's forward (Note [autocast inside the forward])."""
        if self.headroom is not None:
            self.headroom.note_autocast(step, self._model_device().type)
        self._capturer.note_autocast(step, inside=True)

    def _forward_aborted(self) -> None:
        """The model's last forward raised and the loop went on (it skipped the batch): that batch is
        not the step's, the next forward's is."""
        if self._root_seen and not self._explicit:
            self._root_seen = False

    def _backward_seen(self) -> bool:
        """A gradient of a module output was received since the last read."""
        return self.grad_sink is not None and len(self.grad_sink) > 0

    def _forward_ends(self, info: ModuleInfo) -> None:
        if self.hooks.phase == "eval":
            self._read_eval()

    def _fused_amp_found_inf(self, optimizer) -> Optional[torch.Tensor]:
        """With a GradScaler and an optimizer that handles AMP itself (fused Adam/AdamW/SGD),
        GradScaler does not skip ``optimizer.step``: it sets ``optimizer.found_inf`` and the kernel
        skips the update. That device flag is read with the step's records."""
        if self.scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return None
        found_inf = getattr(optimizer, "found_inf", None)
        return found_inf if isinstance(found_inf, torch.Tensor) else None

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        if self._closed:
            return None
        self._attempted = True
        self._awaiting_update = False
        if not self.checking:
            return None
        at = 1 if args and args[0] is optimizer else 0  # (torch passes the optimizer itself as args[0])
        closure = kwargs.get("closure") if "closure" in kwargs else (args[at] if len(args) > at else None)
        if callable(closure):
            # optimizer.step(closure): the step's forward and backward run inside the step, in the
            # closure (Lightning's automatic optimization, LBFGS). Read when the closure returns --
            # after the backward, before the update -- not here, before the forward.
            def closure_then_read(*c_args, **c_kwargs):
                result = closure(*c_args, **c_kwargs)
                if not self._closed:
                    self._read_before_update(optimizer)
                return result

            if "closure" in kwargs:
                return args, dict(kwargs, closure=closure_then_read)
            return tuple(args[:at]) + (closure_then_read,) + tuple(args[at + 1:]), kwargs
        self._read_before_update(optimizer)
        return None

    def _read_before_update(self, optimizer) -> None:
        try:
            self._read(before_update=True, found_inf=self._fused_amp_found_inf(optimizer))
        except NonFiniteError:
            if not self._explicit:  # the update will not run: the step ends here, skipped
                self._end_step(raise_incident=False)
            raise

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        if self._closed:
            return
        self._applied = True
        if self._fused_amp_found_inf(optimizer) is not None:
            self._applied = self._fused_applied.pop(self.step_index, None)
        if self.checking:
            self._record_after_update(optimizer)
        if not self._explicit:
            self._end_step()

    def _record_after_update(self, optimizer) -> None:
        """Parameters and floating buffers after the update (one launch group each), and on
        request the optimizer state; read with the next step's copy. A parameter's input is the
        gradient the update used, read (and decoded) a moment ago."""
        step = self.step_index
        if self.optimizer_state:
            # Before the parameters: the update computed them from this state (Adam's moments), so a
            # non-finite state is the first place in production order, not the parameter it spoiled.
            names = {id(p): n for n, p in self._params}
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1 and value.is_floating_point():
                        if self._sharded:
                            value = distributed.local_shards([value])[0]
                        name = f"{names.get(id(p), '?')}.{key}"
                        self.slots.add(value, Slot(step, "update", "optimizer_state", name, value.dtype, value.shape))
        if self.params and self._params:
            def input_bad(k, names=self._param_names):
                grads_read = self._grads_read.get(step)  # looked up when asked: async mode decodes late
                if grads_read is None or names[k] not in grads_read[0]:
                    return None  # no gradient was read for it in this step
                return (f"{names[k]} (grad)",) if names[k] in grads_read[1] else ()

            params = self._param_tensors
            if self._param_set is not None:
                rows = self._param_set.records()
            else:  # (sharded: each rank's local shards)
                params = distributed.local_shards(params)
                rows = self._summarize_many(params)
            self.slots.add_block(rows, Block(step, "update", "param", self._param_names, params,
                                             self._param_owners, input_bad=input_bad), len(params))
        self._record_buffers(step)

    def _record_buffers(self, step: int) -> None:
        """Floating buffers after the update. They are produced by their module's forward (running
        statistics) or by the loop (EMA): produced when the step's forward was finite."""
        if not self._buffers:
            return
        forward_bad = self._forward_bad

        def input_bad(k):
            state = forward_bad.get(step)
            return None if state is None else (("the step's forward",) if state else ())

        tensors = [b for _, b, _ in self._buffers]
        self.slots.add_block(self._summarize_many(tensors),
                             Block(step, "update", "buffer", [n for n, _, _ in self._buffers], tensors,
                                   [o for _, _, o in self._buffers], input_bad=input_bad), len(tensors))

    def _end_step(self, raise_incident: bool = True) -> None:
        """The step ends: ledger, the read if it was not read yet, the step log; next step."""
        step = self.step_index
        try:
            if self._attempted:  # (applied None: a fused-AMP flag decides when read, if ever)
                self.ledger.attempt(step, self._applied)
            recorded = self._forward_seen or self._backward_seen() or len(self.slots) > 0 or self.traced.used
            if self.checking and recorded and not self._read_this_step:
                if self.optimizer is None:
                    self._record_buffers(step)
                self._read(before_update=False, raise_incident=raise_incident)
        finally:
            if self.steplog is not None and self.checking:
                update = None
                if self._attempted:
                    update = {True: "applied", False: "skipped", None: None}[self._applied]
                lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
                self.steplog.ended(step, update, lr if isinstance(lr, (int, float)) else None)
                # (Records that come with a later read -- parameters after the update, async mode's
                # one-read delay -- arrive with the next *checked* step's read, `every` steps later.)
                lag = (1 if (self.params and self.optimizer is not None) else 0) + (1 if self.mode == "async" else 0)
                self.steplog.flush(before=step + 1 - lag * self.every)
            self.step_index += 1
            self.checking = self.step_index % self.every == 0
            self.traced.set_recording()
            self._follow_moves()  # the model may have moved (model.to(device) after watch)
            if self.activations:
                self.traced.allocate(self._model_device())
            self._forward_seen = self._root_seen = self._attempted = self._read_this_step = False
            self._applied = self._awaiting_update = False

    # ------------------------------------------------------------------ user API
    # Note [explicit steps]: ``with mon.step(batch):`` is one step. When the block ends without an
    # optimizer step and an optimizer is watched, the loop calls ``optimizer.step()`` (and often the
    # backward) after the block: the step stays open -- read before its update, ended by the
    # optimizer's post-hook (or GradScaler's skip) like a step without ``mon.step`` -- so that the
    # update is the block's and not a step of its own. When the next step begins first (``mon.step``,
    # a training forward) or the monitor closes, the step ends there and is read as it stands.
    @contextlib.contextmanager
    def step(self, batch=None):
        """Optional explicit step: ``with mon.step(batch):`` around one training step (``batch``
        goes into the failure bundle, cloned before the forward). Without it, steps are
        delimited by the optimizer (see the module docstring). The optimizer step may come after
        the block (``opt.step()`` outside it): it is the block's step's update."""
        if self._closed:
            raise RuntimeError("this nanscan Monitor is closed; call nanscan.watch(model) again")
        if self._explicit:
            raise RuntimeError("mon.step() contexts cannot be nested")
        if self._forward_seen or self._attempted:  # an implicit step (or a block awaiting its update) ends here
            self._end_step()
        if self.capture_dir is not None and self.checking:  # (a batch that cannot be kept raises here,
            self._capturer.remember(self.step_index, batch=batch)  # before the monitor changed state)
        self._explicit = True
        self._forward_seen = True  # the explicit step owns the batch
        self._failed_step = None
        try:
            yield self
        except BaseException as primary:
            self._failed_step = self.step_index  # (the step ends below: guard asks which one failed)
            # The training exception stays the primary error; a failure of our own bookkeeping is
            # attached to it, never the other way round.
            try:
                self._end_step(raise_incident=False)
            except Exception as secondary:  # pragma: no cover - defensive
                attach_note(primary, f"nanscan could not finish the step: {secondary!r}")
            raise
        else:
            if self.optimizer is not None and not self._attempted:
                self._awaiting_update = True  # read and ended with its optimizer step (Note [explicit steps])
            else:
                self._end_step(raise_incident=True)
        finally:
            self._explicit = False

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Records the loss (phase ``"loss"``; its inputs are the model's outputs); returns it.
        Optional: ``loss.backward()`` records it already (Note [the loss is what backward is called
        on]), and so does ``scaler.scale(loss)``; for a loop that calls ``torch.autograd.backward``."""
        if self.checking and not self._closed and isinstance(loss, torch.Tensor):
            if self._loss_ref is not None and self._loss_ref() is loss:  # recorded already
                return loss
            self._loss_ref = weakref.ref(loss)
            # Its inputs: the model's outputs in this window; with no forward recorded (a loss of the
            # parameters alone) what it was computed from is unknown.
            forward = self.hooks.recorded_forward
            slot = Slot(self.step_index, "loss", "loss", "loss", loss.dtype, loss.shape,
                        self.hooks.root_outputs if forward else (), True)
            slot.inputs_changed = not forward
            self.slots.add(loss, slot)
        return loss

    def _clipped(self, parameters: list, total_norm, norm_type) -> None:
        """``clip_grad_norm_`` ran (Note [grad norm before clipping])."""
        if self._closed or not self.checking or self.steplog is None or not isinstance(total_norm, torch.Tensor):
            return
        if self._param_ids is None:
            self._param_ids = frozenset(id(p) for p in self._param_tensors)
        if not any(id(p) in self._param_ids for p in parameters):
            return  # another model's
        if float(norm_type) != 2.0:
            self._clip_norms = []  # (not the L2 norm the log reports: the step's grad_norm is unknown)
            self._clip_unknown = True
            return
        local = getattr(total_norm, "full_tensor", None)  # (a DTensor norm under FSDP2 / TP)
        self._clip_norms.append((local() if callable(local) else total_norm).detach())

    def _higher_order(self) -> None:
        """A gradient was taken with ``create_graph=True`` in this step (a gradient penalty, MAML):
        the backward of that graph runs through nodes no module owns, so a parameter gradient's
        value is no longer explained by its module's output gradients and inputs: "cannot tell"
        where it was produced (never its module's)."""
        self._higher_order_step = self.step_index

    def _backward_called(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` was called (Note [the loss is what backward is called on])."""
        if self._closed or not self.checking or tensor.numel() != 1 or not tensor.is_floating_point():
            return
        if self._scaled_ref is not None and self._scaled_ref() is tensor:
            return  # scaler.scale(loss).backward(): the loss was recorded, unscaled, by scale()
        if not self.hooks.recorded_forward and graph_has_compiled_function(tensor.grad_fn):
            self._unhooked_graph = True  # (a graph compiled before watch, whose hooks never run: _check_hooks_ran)
        self.check_loss(tensor)  # (with no forward recorded: a loss of the parameters alone, origin unknown)

    def capture(self, incident: Optional[Incident] = None, capture_dir: Optional[str] = None,
                step: Optional[int] = None) -> str:
        """Write the bundle of ``step`` (default: the incident's step, else the current one) into
        ``capture_dir`` (default: the monitor's); returns its path. Used at the first incident, and
        by :func:`nanscan.guard` when a step fails otherwise."""
        capture_dir = capture_dir or self.capture_dir
        if capture_dir is None:
            raise ValueError("nanscan: no capture_dir was given "
                             "(watch(..., capture_dir=...) or guard(capture_dir=...))")
        if self.capture_dir is None:
            raise RuntimeError("nanscan: the monitor kept no batch / RNG (it was created without capture_dir), "
                               "so no bundle can be written for this step")
        step = step if step is not None else (incident.step if incident is not None else self.step_index)
        return self._capturer.write(incident, capture_dir, step, current_step=self.step_index,
                                    applied_this_step=self._applied)

    @property
    def failing_step(self) -> int:
        """The step a training error happened in: the one a ``with mon.step():`` block just ended by
        raising, else the current step (:func:`nanscan.guard` logs and captures this one)."""
        return self._failed_step if self._failed_step is not None else self.step_index

    @property
    def bundle_path(self) -> Optional[str]:
        """The bundle written at the first reported incident (or by :func:`nanscan.guard`), or None."""
        return self._capturer.bundle_path

    def allow_patterns(self) -> tuple:
        """fnmatch patterns matching exactly every non-finite value found so far (see
        :attr:`offenders`), for ``watch(..., allow=...)`` when those values are intended."""
        return tuple(dict.fromkeys(glob.escape(n) for names in self.offenders.values() for n in names))

    def allow_line(self) -> str:
        """``allow=(...)`` ready to paste, from :meth:`allow_patterns`."""
        return f"allow={self.allow_patterns()!r}"

    @property
    def incident(self) -> Optional[Incident]:
        """The first incident, or None."""
        return self.incidents[0] if self.incidents else None

    def close(self) -> None:
        """Checks what is still pending (the last step if it did not end), removes every hook and
        releases the model."""
        if self._closed:
            return
        # After an incident was raised, what close still finds (async mode's late read of that step,
        # values that followed from it) is recorded, never raised: a second NonFiniteError from a
        # `finally: mon.close()` would replace the first.
        raise_incident = None if self._raised else True
        try:
            if self._awaiting_update:  # an explicit step whose optimizer step never came
                self._end_step(raise_incident=raise_incident)
            if self.checking and (self._forward_seen or self._backward_seen()) and not self._read_this_step:
                self._read(before_update=False, final=True, raise_incident=raise_incident)
            elif len(self.slots) or self._in_flight is not None or self.traced.used:
                self._read(before_update=False, final=True, include_grads=False, raise_incident=raise_incident)
        finally:
            self._closed = True
            self.traced.set_recording()
            if self.grad_sink is not None:
                self.grad_sink.generation = -1
            if self.steplog is not None:
                self.steplog.close()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._autocast_probe.disarm()
            self.hooks.close()
            self.traced.forget()
            _WATCHED.pop(id(self.model), None)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as secondary:
            attach_note(exc, f"nanscan.Monitor.close failed: {secondary!r}")

    # ------------------------------------------------------------------ reading
    def _param_grad_block(self, rows):
        """Records and a :class:`Block` of the parameter gradients as they are now (final:
        accumulated, and unscaled if ``scaler.unscale_`` ran), or None. A gradient's inputs: the
        gradients of its module's outputs and the module's forward inputs in this window (``rows``:
        the window's hook records, or None)."""
        names, owners = self._param_names, self._param_owners
        sparse = None
        if self._param_set is not None:  # (C++: no Python per parameter)
            records, present, sparse = self._param_set.grad_records()
            grads = self._param_tensors  # (a gradient's dtype and shape are its parameter's)
        else:  # sharded: each rank's local shards
            records = None
            grads, present = self._extension.param_grads(self._param_tensors)
        if present is not None:
            if not present:
                return None
            names = [names[k] for k in present]
            owners = [owners[k] for k in present]
            if self._param_set is not None:
                grads = [grads[k] for k in present]
        if sparse:  # a sparse gradient's record is of its (coalesced) values: their dtype and shape
            grads = list(grads)
            for position, values in sparse.items():
                grads[position] = values
        if records is None:
            grads = distributed.local_shards(grads)
            records = self._summarize_many(grads)

        def inputs(k):  # (asked only when a gradient is decoded as non-finite)
            owner = owners[k]
            return () if owner is None or rows is None else rows.rows.weight_inputs(owner.index)

        # Without the gradients of module outputs, the gradient a weight received is unknown:
        # no inputs, so "produced" is None rather than judged from the forward inputs alone.
        explained = self.activation_grads and self._higher_order_step != self.step_index
        return records, Block(self.step_index, "backward", "grad", names, grads, owners,
                              inputs=inputs if explained else None, param=True)

    def _read(self, before_update: bool, raise_incident: bool = True, final: bool = False,
              found_inf: Optional[torch.Tensor] = None, include_grads: bool = True) -> None:
        self._read_this_step = True
        slots, blocks, eager_rows = self.slots.take()  # (blocks: a list of [k, RECORD_SIZE] records)
        if self.grad_sink is not None:  # the gradients of module outputs, from the C++ tap
            records, meta = self.grad_sink.take()
            n = len(meta)
            if n:
                block = GradBlock(self.step_index, slots, meta)
                block.start = len(slots)
                if eager_rows is not None:
                    eager_rows.rows.set_grads(meta, block.start)
                slots = slots + [block] * n
                blocks.extend(records)
        self.slots_generation += 1
        if self.grad_sink is not None:
            self.grad_sink.generation = self.slots_generation
        recorded_forward, self.hooks.recorded_forward = self.hooks.recorded_forward, False
        grad_start = None  # where the parameter gradients start: read last, produced after compiled rows
        if include_grads and self.grads and self._params:
            found = self._param_grad_block(eager_rows)
            if found is not None:
                rows, block = found
                block.start = grad_start = len(slots)
                blocks.append(rows)
                slots = slots + [block] * len(block.names)
        self.hooks.reset()  # (after the gradients: their inputs are the modules' last calls)
        handled = (not before_update and self.scaler is not None and self._attempted
                   and self._applied is False and not final)
        extras = []  # (what, tensor): read with the records, in the same copy
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        if isinstance(scale, torch.Tensor) and not final and include_grads:
            extras.append(("scale", scale))
        if found_inf is not None:
            extras.append(("found_inf", found_inf))
        clip_norms, self._clip_norms = self._clip_norms, []
        if self._clip_unknown and self.steplog is not None:
            self.steplog.clip_norm(self.step_index, None)
        self._clip_unknown = False
        if clip_norms and include_grads and self.steplog is not None:
            total = clip_norms[0] if len(clip_norms) == 1 else torch.stack(
                [n.to(clip_norms[0].device, torch.float64) for n in clip_norms]).pow(2).sum().sqrt()
            extras.append(("clip_norm", total))
        copy = Copy.start(blocks, slots, extras, self.traced.window(), handled=handled, step=self.step_index,
                          non_blocking=self.mode == "async" and not final, window_rows=len(self.traced.rows))
        copy.recorded_forward = recorded_forward
        copy.final = final
        copy.grad_start = grad_start
        self.traced.reset()
        # The earlier read first: its records were made first (async mode decodes a read late).
        previous, self._in_flight = self._in_flight, None
        if self.mode == "async" and not final:
            self._in_flight = copy
            copy = None
        error = None
        if previous is not None:
            try:
                self._decode(previous, raise_incident=raise_incident)
            except NonFiniteError as e:  # the later read is still decoded (recorded), then this is raised
                error = e
        if copy is not None:
            self._decode(copy, raise_incident=raise_incident if error is None else None)
        if error is not None:
            raise error

    def _read_eval(self) -> None:
        slots, blocks, _ = self.eval_slots.take()
        self.hooks.reset("eval")
        if not blocks:
            return
        copy = Copy.start(blocks, slots, [], None, handled=False, step=self.step_index, non_blocking=False)
        copy.eval = True
        self._decode(copy, raise_incident=self.eval_forwards == "raise")

    def _decode(self, copy: Copy, raise_incident: Optional[bool] = True) -> None:
        """Decode a landed read: ledger scalars, incidents (raised, warned or only recorded:
        ``raise_incident`` False warns, None records silently), the step log, the agreement across
        ranks, the bundle."""
        copy.wait()
        slots, step, handled = copy.slots, copy.step, copy.handled
        for what, value in copy.extras.items():
            if what == "clip_norm":
                if self.steplog is not None:
                    self.steplog.clip_norm(step, value)
            elif what == "scale":
                self.ledger.scale_history.append((step, value))
                if self.steplog is not None:
                    self.steplog.scale(step, value)
            elif what == "found_inf":
                applied = value == 0
                handled = handled or not applied  # the fused kernel skipped the update: AMP handled it
                if self.ledger.decide(step, applied):  # async: the step already ended
                    if self.steplog is not None:
                        self.steplog.decided(step, "applied" if applied else "skipped")
                else:
                    self._fused_applied[step] = applied
        row = copy.row
        bad = copy.bad
        position = None
        if copy.traced is not None:
            offset = len(slots)
            traced_slots, traced_values, weight_inputs = [], [], {}
            for written in copy.traced:  # (one sub-window per training forward, in order)
                more, values, inputs = self.traced.slots(written, step, offset + len(traced_slots))
                traced_slots += more
                traced_values += values
                for name, indices in inputs.items():
                    weight_inputs.setdefault(name, []).extend(indices)
            if self.compiled_grads or self.traced.grad_hooks:
                # weights of compiled modules: their forward inputs and output gradients
                for block in {s for s in slots if type(s) is Block and s.param}:
                    block.extra_inputs = {name: tuple(rows) for name, rows in weight_inputs.items()}
            slots = list(slots) + traced_slots
            bad = bad | {offset + i for i, v in enumerate(traced_values) if v[0] + v[1] + v[2] > 0}

            def row(i):
                return copy.row(i) if i < offset else traced_values[i - offset]

            # Production order: eager records, the compiled rows, then the parameter gradients
            # (read after the backward; eager ones are last in index order already).
            grad_start = copy.grad_start if copy.grad_start is not None else offset

            def position(i):
                return (1, i) if i >= offset else ((2, i) if i >= grad_start else (0, i))

        training = not copy.eval  # (a read is of one window: the training one or the eval one)
        if training:
            self._check_hooks_ran(copy, slots)
            self._note_read(slots, bad, step, copy.grad_start)
        found = first_incidents(slots, row, bad, allow=self.allow, rank=self.rank, reduced_grads=distributed.active(),
                                handled_step=step if handled else None, position=position)
        if copy.traced is not None and found:
            mixed = _steps_with_eager_module_rows(slots[:offset])
            if mixed:  # Note [eager frames beside compiled ones]
                found = [dataclasses.replace(inc, produced=None, inputs=(), order_known=False)
                         if inc.step in mixed and inc.phase in ("forward", "backward") else inc for inc in found]
        if training:  # one incident per step and phase (Note [one incident per step and phase])
            found = [inc for inc in found if (inc.step, inc.phase) not in self._incident_keys]
        if bad:
            for s, names in offenders(slots, bad, allow=self.allow, position=position).items():
                known = self.offenders.setdefault(s, [])
                known.extend(n for n in names if n not in known)
        if self.steplog is not None:
            self.steplog.observe(slots, [row(i) for i in range(len(slots))], [i in bad for i in range(len(slots))])
        if self.headroom is not None and training:
            self._check_headroom(copy, slots, row, bad)
        report = found[0] if found and not found[0].handled_by_scaler else None
        if training and distributed.active():  # every rank reports the same incident in the same step
            report = distributed.agree(report)
            if report is not None and report.rank != self.rank:
                # The first failing rank's incident stands for its step and phase here too, in
                # training order: before this rank's own later ones (a gradient reduced from it).
                found = [inc for inc in found if (inc.step, inc.phase) != (report.step, report.phase)]
                if (report.step, report.phase) not in self._incident_keys:
                    found.append(report)
        self._add_incidents(found)
        if report is None:
            self._log_incidents(found)
            return
        capture_error = None
        try:
            if self.capture_dir is not None and self.bundle_path is None and report.phase != "eval":
                self.capture(report)
        except Exception as e:  # the incident stays the primary finding; the capture failure is attached
            capture_error = e
            warn(f"nanscan could not write the bundle: {e!r}", RuntimeWarning, stacklevel=3)
        self._log_incidents(found)
        if self.on_nonfinite == "record" or raise_incident is None:  # None: an earlier incident is being raised
            return
        if self.on_nonfinite == "warn" or not raise_incident:
            warn(str(report) + self._also(slots, row, bad, report, position), RuntimeWarning, stacklevel=3)
            return
        error = NonFiniteError(report)
        self._raised = True
        error.bundle_path = self.bundle_path
        if self.bundle_path:
            attach_note(error, f"nanscan wrote the failure bundle: {self.bundle_path}")
        if capture_error is not None:
            attach_note(error, f"nanscan could not write the bundle: {capture_error!r}")
        raise error

    def _add_incidents(self, found: list) -> None:
        """Into ``self.incidents`` in training order, (step, phase): a read may hold an earlier step's
        update next to this step's forward, and the first failing rank's incident may be earlier in
        the step than this rank's own."""
        incidents = self.incidents
        for inc in sorted(found, key=_training_order):
            if inc.phase != "eval":
                self._incident_keys.add((inc.step, inc.phase))
            where = len(incidents)
            while where and _training_order(incidents[where - 1]) > _training_order(inc):
                where -= 1
            incidents.insert(where, inc)

    def _also(self, slots, row, bad, report, position) -> str:
        """The rest of a warned incident's message: the step's other values made non-finite (by
        name), how many were computed from non-finite values (counted: ``mon.offenders`` lists
        them), and ``allow=`` only for values that look intended (-inf fills)."""
        if report.step not in self.offenders:
            return ""
        made, spread, fills = other_offenders(slots, row, bad, allow=self.allow, report=report, position=position)
        parts = []
        if made:
            shown = ", ".join(made[:8]) + (f" and {len(made) - 8} more" if len(made) > 8 else "")
            parts.append(f" Also non-finite in this step: {shown}.")
        if spread:
            parts.append(f" {spread} value(s) in this step were computed from non-finite ones (mon.offenders "
                         f"lists every name).")
        if fills:
            patterns = tuple(dict.fromkeys(glob.escape(n) for n in fills))
            parts.append(f" If these -inf fills are intended (masks, padding): watch(..., allow={patterns!r}).")
        return "".join(parts)

    @property
    def headroom_events(self) -> list:
        """The headroom warnings given so far (:class:`~nanscan.monitor.headroom.HeadroomEvent`)."""
        return self.headroom.events if self.headroom is not None else []

    def _check_headroom(self, copy: Copy, slots: list, row, bad) -> None:
        """Headroom of the rows of a landed read (:mod:`nanscan.monitor.headroom`): a vectorized
        pass over the host records, Python only for the rows near overflow. A failure here is
        nanscan's own: warned once, the check turned off, training goes on."""
        try:
            watch = self.headroom
            n = len(copy.slots)
            near = []
            if n and copy.host is not None:
                near = watch.near_rows(copy.host[:n], row_maxima(copy.slots, n), watch.fp16_autocast)
            if len(slots) > n:  # the compiled path's rows (Slot objects already)
                values = torch.tensor([row(i)[:RECORD_SIZE] for i in range(n, len(slots))], dtype=torch.float64)
                maxima = row_maxima(slots[n:], len(slots) - n)
                near += [n + j for j in watch.near_rows(values, maxima, watch.fp16_autocast)]
            near = [i for i in near if i not in bad]
            events = watch.observe(slots, lambda i: at(slots, i), row, near)
            if self.steplog is not None:
                for step, lowest in watch.lowest.items():
                    self.steplog.headroom(step, lowest)
                for event in events:
                    self.steplog.headroom_event(event)
        except Exception as error:  # pragma: no cover - nanscan's own failure never stops training
            self.headroom = None
            warn(f"nanscan: the headroom check failed and is turned off: {error!r}", RuntimeWarning,
                          stacklevel=3)

    def _log_incidents(self, incidents) -> None:
        if self.steplog is not None:
            for inc in incidents:
                self.steplog.incident(inc, self.bundle_path if inc.step == self._capturer.bundle_step else None)

    def _note_read(self, slots, bad, step, grad_start) -> None:
        """What later windows need of this one: which parameters had a gradient read (and which of
        those were non-finite) for the update records, and whether the forward was finite for the
        buffer records (``grad_start``: where the parameter gradients' block starts, or None).
        Kept for the last few steps."""
        if grad_start is not None:
            s = slots[grad_start]
            names = self._all_param_names if s.names is self._param_names else frozenset(s.names)
            bad_names = {s.names[i - s.start] for i in bad if s.start <= i < s.start + len(s.names)}
            self._grads_read[s.step] = (names, bad_names)
        self._forward_bad[step] = any(s.phase == "forward" and s.candidate for s in (at(slots, i) for i in bad))
        for old in [k for k in self._grads_read if k < step - 2]:
            del self._grads_read[old]
        for old in [k for k in self._forward_bad if k < step - 2]:
            del self._forward_bad[old]

    def _check_hooks_ran(self, copy: Copy, slots) -> None:
        """Gradients in a step with no recorded forward mean the forward hooks did not run:
        typically the model was torch.compile-d *before* nanscan.watch, and the compiled graph never
        calls hooks added later. Attribution would then be wrong, so refuse loudly."""
        unhooked, self._unhooked_graph = self._unhooked_graph, False
        if not self.activations or copy.recorded_forward or (copy.traced and any(copy.traced)):
            return
        if getattr(copy, "final", False):  # (close, at exit: what is left of a step that already ended)
            return
        if self._loss_ref is not None and not unhooked and self._loss_ref() is not None:
            return  # a loss recorded at its backward with no forward: of the parameters alone, origin unknown
        if any(type(s) is Block and s.param for s in slots[-1:]) or any(
                s.phase in ("loss", "backward") and s.step == copy.step for s in slots if type(s) is Slot):
            raise RuntimeError(
                "nanscan.watch: the model's forward hooks did not run in this step although a loss / gradients "
                "were seen. If the model was compiled before it was watched, the compiled graph never calls "
                "hooks added later: call nanscan.watch(model) first, then torch.compile(model). (A loss computed "
                "without calling the watched model gives this error too.)")




@atexit.register
def _close_at_exit() -> None:
    """A monitor left open at exit still reads what it holds (async mode's last step, the last
    update): an incident there is printed, never lost silently."""
    for monitor in list(_WATCHED.values()):
        try:
            monitor.close()
        except NonFiniteError as error:
            import sys

            print(f"nanscan (at exit, monitor never closed): {error}", file=sys.stderr)
        except Exception as error:  # pragma: no cover - nothing may fail at exit
            import sys

            print(f"nanscan: closing a monitor at exit failed: {error!r}", file=sys.stderr)


def watch(model, optimizer=None, scaler=None, *, activations: bool = True, activation_grads: bool = True,
          compiled_grads="hooks", grads: bool = True,
          params: bool = True, buffers: bool = True, optimizer_state: bool = False, every: int = 1,
          mode: str = "sync", on_nonfinite: str = "raise", allow: Iterable[str] = (), backend: Optional[str] = None,
          capture_dir: Optional[str] = None, keep_pre_update_state: bool = False, log=None,
          eval_forwards: str = "check", headroom_bits: Optional[float] = None,
          headroom_cast: Optional[dict] = None) -> Monitor:
    """Watch ``model`` for non-finite values, every ``every`` steps, cheaply enough to leave on.
    One call: the training loop needs no change (steps end at ``optimizer.step``; see
    :mod:`nanscan.monitor.monitor`).

    ``activations``: module outputs (and values made in a module's own body) in the forward, and
    (``activation_grads``) the gradients flowing into module outputs (taken by a C++ hook on each
    output's autograd node). Without them a backward-only fault is reported at the first non-finite
    parameter gradient with ``produced=None``. ``compiled_grads``: how those gradients are taken
    inside ``torch.compile`` graphs -- ``"hooks"`` (default): a tensor hook on each recorded output
    that dynamo traces into the graph, on a torch that can (``nanscan.monitor.traced.GRAD_HOOKS``;
    torch 2.11 cannot: there, none); ``"taps"`` (or ``True``): identity autograd Functions on module
    inputs and outputs, whose outputs are views -- only for models that never modify a module's
    input or output in place (``ReLU(inplace=True)``, ``out += identity``: autograd forbids in-place
    ops on such views and the compile fails), on any torch; ``"off"`` (or ``False``): none, for the
    shortest compile (the hooks add graph ops: README, compile time). ``grads``: parameter gradients; ``params``:
    parameters after each optimizer update (needs ``optimizer``); ``buffers``: floating-point
    buffers (BatchNorm running statistics, EMA copies kept as buffers) after the update, kind
    ``"buffer"``; ``optimizer_state``: optimizer state tensors after the update.
    ``mode="sync"`` reads the step's records once, before ``optimizer.step`` (so a bad update can
    be stopped); ``"async"`` copies them without blocking and checks them a step later.
    ``on_nonfinite``: ``"raise"`` (:class:`NonFiniteError`), ``"warn"`` or ``"record"`` (only
    ``mon.incidents``). Non-finite gradients in a step whose update GradScaler skipped are never
    raised (AMP handled them): they are recorded and counted in ``mon.ledger``. Non-finite forward
    activations or losses are incidents even then: loss scaling cannot fix them. ``allow``: fnmatch
    patterns of names allowed to be non-finite (e.g. ``"*.attn_mask"``). ``eval_forwards``: forwards
    outside training (``no_grad``, ``inference_mode``; a forward with grad enabled is training
    whatever ``model.training`` says: Note [training forwards]) are ``"check"``-ed as phase
    ``"eval"`` and warned about (default), ``"raise"`` like training incidents, or ``"skip"``-ped.
    Watch before ``torch.compile``. The loss is the tensor the step calls ``.backward()`` on
    (Note [the loss is what backward is called on]); the logged grad norm is the one before
    clipping (Note [grad norm before clipping]). Every option is validated here: a wrong type or
    value is a ``TypeError`` / ``ValueError`` naming what is accepted. ``optimizer`` may be
    accelerate's ``AcceleratedOptimizer`` (its torch optimizer, and its GradScaler when ``scaler``
    is None, are used).

    ``capture_dir``: at the first reported incident, write a failure bundle there
    (``step000123-rank0``; see :mod:`nanscan.capture.bundle`) with the batch (the root module's
    forward inputs of the step's first forward, or the ``batch`` given to ``mon.step(batch)``;
    cloned before the forward), the pre-step RNG, and model / optimizer / scaler state marked
    "before-update" or "after-update". Cost per checked step: a clone of the batch and the RNG
    states. ``keep_pre_update_state=True`` also keeps a copy of model, optimizer and scaler state
    from the start of each step, so update-phase (and async) incidents get pre-update state.

    ``log``: a path or a :class:`nanscan.EventLog`: one JSONL record per checked step and one per
    incident (fsynced); see :mod:`nanscan.monitor.steplog`.

    ``headroom_bits``: warn (once per tensor, never raising) when a watched tensor's largest finite
    magnitude comes within that many bits of its dtype's largest value -- ``log2(finfo.max /
    amax)``, against the dtype it is stored in and, for float32 activations and parameters of a
    step whose forward ran under float16 autocast, against float16 -- with the trend over the last
    checked steps and the step at which it would overflow (:mod:`nanscan.monitor.headroom`,
    ``mon.headroom_events``, ``"headroom"`` lines in the log). Off (None) by default; ``True`` takes
    the suggested 4 bits (:data:`nanscan.headroom.SUGGESTED_BITS`). With a GradScaler, gradients are
    left out: loss scaling keeps them near float16's top on purpose, and the scaler handles their
    overflow.
    ``headroom_cast``: ``{fnmatch pattern: dtype}`` of tensors you know are cast, unscaled, to a
    narrower dtype (e.g. a float8 recipe with a fixed scale); their headroom is measured against it.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanscan.watch expects a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise ValueError("nanscan.watch: this model is already torch.compile-d; hooks added now would never "
                         "run inside the compiled graph. Call nanscan.watch(model) first, then torch.compile(model)")
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError("nanscan.watch: this model was compiled in place (model.compile()); hooks added now would "
                         "never run inside the compiled graph. Call nanscan.watch(model) first, then model.compile()")
    if not any(True for _ in model.parameters()):
        raise ValueError("nanscan.watch: the model has no parameters; there is nothing to train or watch")
    optimizer, scaler = unwrap(optimizer, scaler)
    if optimizer is not None and not (callable(getattr(optimizer, "register_step_pre_hook", None))
                                      and hasattr(optimizer, "param_groups")):
        raise TypeError(f"nanscan.watch: optimizer must be a torch.optim.Optimizer (or None), got "
                        f"{type(optimizer).__name__}: {optimizer!r}"[:300])
    if scaler is not None and not (callable(getattr(scaler, "step", None))
                                   and callable(getattr(scaler, "scale", None))):
        raise TypeError(f"nanscan.watch: scaler must be a torch.amp.GradScaler (or None), got "
                        f"{type(scaler).__name__}: {scaler!r}"[:300])
    if scaler is not None and optimizer is None:
        raise ValueError("nanscan.watch: a GradScaler needs the optimizer it steps: watch(model, optimizer, scaler). "
                         "(Without it nanscan cannot see whether scaler.step(optimizer) applied an update.)")
    for name, value in (("activations", activations), ("activation_grads", activation_grads), ("grads", grads),
                        ("params", params), ("buffers", buffers), ("optimizer_state", optimizer_state),
                        ("keep_pre_update_state", keep_pre_update_state)):
        if not isinstance(value, bool):
            raise TypeError(f"nanscan.watch: {name} must be True or False, got {value!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"nanscan.watch: every must be an int >= 1, got {every!r}")
    if mode not in MODES:
        raise ValueError(f"nanscan.watch: mode must be one of {MODES}, got {mode!r}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"nanscan.watch: on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    if compiled_grads is True or compiled_grads is False:
        compiled_grads = "taps" if compiled_grads else "off"
    if compiled_grads not in COMPILED_GRADS:
        raise ValueError(f"nanscan.watch: compiled_grads must be one of {COMPILED_GRADS} (or True for 'taps', False "
                         f"for 'off'), got {compiled_grads!r}")
    if eval_forwards not in EVAL_FORWARDS:
        raise ValueError(f"nanscan.watch: eval_forwards must be one of {EVAL_FORWARDS}, got {eval_forwards!r}")
    allow = check_allow(allow, "nanscan.watch")
    if capture_dir is not None and not isinstance(capture_dir, (str, os.PathLike)):
        raise TypeError(f"nanscan.watch: capture_dir must be a directory path (str or os.PathLike) or None, got "
                        f"{type(capture_dir).__name__}: {capture_dir!r}"[:300])
    if keep_pre_update_state and capture_dir is None:
        raise ValueError("nanscan.watch: keep_pre_update_state=True keeps state for the failure bundle, which needs "
                         "capture_dir=...")
    if log is not None and not isinstance(log, (str, os.PathLike)) and type(log).__name__ != "EventLog":
        raise TypeError(f"nanscan.watch: log must be a path (str or os.PathLike), a nanscan.EventLog or None, got "
                        f"{type(log).__name__}: {log!r}"[:300])
    if backend is not None:
        _ops.resolve_backend(backend, next(model.parameters()).device)  # (an unknown one is a ValueError here)
    if headroom_bits is True:
        from nanscan.headroom import SUGGESTED_BITS

        headroom_bits = SUGGESTED_BITS
    if headroom_bits is not None and (isinstance(headroom_bits, bool) or not isinstance(headroom_bits, (int, float))
                                      or not 0 < headroom_bits < 1024):
        raise ValueError(f"nanscan.watch: headroom_bits must be a number of bits in (0, 1024), True (the suggested "
                         f"4 bits) or None (off), "
                         f"got {headroom_bits!r}")
    if headroom_cast is not None:
        if not isinstance(headroom_cast, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.dtype) and v.is_floating_point
                for k, v in headroom_cast.items()):
            raise TypeError(f"nanscan.watch: headroom_cast must be a dict of fnmatch pattern (str) -> floating "
                            f"torch.dtype, got {headroom_cast!r}")
        if headroom_bits is None:
            raise ValueError("nanscan.watch: headroom_cast needs headroom_bits (the warning threshold)")
    if id(model) in _WATCHED:
        raise ValueError("nanscan.watch: this model is already watched; close the first Monitor "
                         "(mon.close() or leave its `with` block) before watching it again")
    if activations:
        dropped = drop_graphs_compiled_without_hooks(model)
        if dropped:
            warn(f"nanscan.watch: dropped {dropped} torch.compile graph(s) of this model's classes compiled "
                          f"before this watch (dynamo does not guard on module hooks and would reuse them without "
                          f"this monitor's hooks); they recompile at the next call", RuntimeWarning, stacklevel=2)
    monitor = Monitor(model, optimizer, scaler, activations=activations, activation_grads=activation_grads,
                      compiled_grads=compiled_grads, grads=grads, params=params,
                      buffers=buffers, optimizer_state=optimizer_state, every=every, mode=mode,
                      on_nonfinite=on_nonfinite, allow=tuple(allow), backend=backend, capture_dir=capture_dir,
                      keep_pre_update_state=keep_pre_update_state, log=log, eval_forwards=eval_forwards,
                      headroom_bits=headroom_bits, headroom_cast=headroom_cast)
    install()
    _WATCHED[id(model)] = monitor
    return monitor

"""The always-on monitor: ``nanscan.watch(model, ...)`` -> :class:`Monitor`.

How it stays cheap. Hooks never look at values: each one launches nanscan's fused summary op and
keeps the small device record (float64 [8]) in a list of *slots*, in the order the tensors were
produced. The host reads all pending records of a step with ONE stack + ONE device-to-host copy:

* sync mode: in the optimizer's step pre-hook (so a non-finite step can be stopped before the
  update), or at the end of ``mon.step()`` when the update did not run (GradScaler skip, no
  optimizer). Parameter records taken after the update (optimizer step post-hook) are read with
  the next step's copy and reported with their own step index, phase ``"update"``.
* async mode: the same copy, non-blocking into host memory, decoded at the next read point (one
  step later); no host sync at all on CUDA.

Attribution. Slots are kept in production order: module inputs and outputs during the forward
(forward hooks fire when a module *finishes*, so a leaf comes before its parent), the loss
(``mon.check_loss``), gradients flowing into module outputs and parameter gradients in the order
autograd produced them, then parameters after the update. The first non-finite slot (outside the
allow-list) is the incident. ``produced`` compares with the records of the slot's inputs: a
module's tensor inputs; for a parameter's gradient, the gradient of its module's output; for a
parameter after the update, its gradient. A NaN made by a functional op inside a module (not in
a submodule) shows up first in that module's output, so it is attributed to that module.

Parameter gradients are summarized when the step is checked, in one ``summarize_many`` launch
group, so they are the final (accumulated, and unscaled if ``scaler.unscale_`` ran) gradients.
Hooks only record between ``mon.step()`` enter and exit, and only on sampled steps (``every``).
"""
from __future__ import annotations

import contextlib
import fnmatch
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch

from nanscan.monitor import distributed
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.stepcapture import StepCapture
from nanscan.monitor.steplog import StepLog
from nanscan.record import RECORD_SIZE, Field, TensorSummary
from nanscan.summary import record, records

MODES = ("sync", "async")
ON_NONFINITE = ("raise", "warn", "record")
ROOT = "(model)"


def _tensors(value: Any, prefix: str):
    """(name, tensor) pairs of the floating / complex tensors inside a module input or output."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield prefix, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{prefix}.{k}")


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    for _, t in _tensors(value, ""):
        return t
    return None


# On the torch.compile path each module owns one input row and this many output rows.
_TRACED_OUTPUTS = 4


# Columns of the traced buffer (used inside torch.compile graphs): the record, the execution
# sequence number (0 = not written this step), numel, and a dtype code.
_SEQ, _NUMEL, _DTYPE = RECORD_SIZE, RECORD_SIZE + 1, RECORD_SIZE + 2
_TRACED_COLS = RECORD_SIZE + 3
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


class _Slot:
    """One pending record: what was summarized, when, and what it depends on."""

    __slots__ = ("step", "phase", "kind", "name", "record", "dtype", "shape", "inputs", "param", "candidate")

    def __init__(self, step, phase, kind, name, rec, tensor, inputs=(), param=None, candidate=True):
        self.step, self.phase, self.kind, self.name = step, phase, kind, name
        self.record = rec
        self.dtype = tensor.dtype if tensor is not None else None
        self.shape = tuple(tensor.shape) if tensor is not None else None
        self.inputs = tuple(inputs)  # indices of earlier slots (same pending list)
        self.param = param  # for deferred parameter-gradient slots: (param, name)
        self.candidate = candidate  # inputs recorded only for attribution are never the incident


class Monitor:
    """Watches one model; see :func:`watch` for the options. Use as a context manager (or call
    :meth:`close`): hooks are removed and pending records are checked on exit."""

    def __init__(self, model, optimizer=None, scaler=None, *, activations=True, grads=True, params=True,
                 optimizer_state=False, every=1, mode="sync", on_nonfinite="raise", allow=(), backend=None,
                 capture_dir=None, keep_pre_update_state=False, log=None):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.activations, self.grads, self.params, self.optimizer_state = activations, grads, params, optimizer_state
        self.every, self.mode, self.on_nonfinite = every, mode, on_nonfinite
        self.allow = tuple(allow)
        self.backend = backend
        self.capture_dir = capture_dir
        self.keep_pre_update_state = keep_pre_update_state
        self.steplog: Optional[StepLog] = None
        self.step_index = 0
        self.incidents: list = []
        self.ledger = Ledger()
        self.rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                     and torch.distributed.is_initialized()) else 0
        self._capturer = StepCapture(model, optimizer, scaler, capture_dir, keep_pre_update_state, self.rank, mode)
        self._module_names = {m: (n or ROOT) for n, m in model.named_modules()}
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_module = {id(p): (n.rpartition(".")[0] or ROOT) for n, p in self._params}
        # torch.compile path: each module owns two static rows (input, output) of a device buffer
        # that traced hooks write into; a device counter stamps the execution order.
        stride = 1 + _TRACED_OUTPUTS
        self._row_of = {name: stride * i for i, name in enumerate(self._module_names.values())}
        self._row_info = {}
        for name, r_in in self._row_of.items():
            self._row_info[r_in] = (f"{name}.input", False, None)
            for k in range(_TRACED_OUTPUTS):
                self._row_info[r_in + 1 + k] = (name if k == 0 else f"{name}[output {k}]", True, r_in)
        self._traced: Optional[torch.Tensor] = None
        self._seq: Optional[torch.Tensor] = None
        self._handles: list = []
        self._pending: list = []  # slots not yet read
        self._in_flight = None  # async: (host rows, event, slots, extras) awaiting decode
        self._known: dict = {}  # id(tensor) -> (weakref, version, slot index) for this step
        self._inputs_of: dict = {}  # module -> slot indices of its inputs, between pre and post hook
        self._forward_inputs_of: dict = {}  # module name -> slot indices of its inputs this step
        self._outputs_of: dict = {}  # module name -> slot indices of its latest outputs
        self._out_grads_of: dict = {}  # module name -> slot indices of gradients of its outputs
        self._grad_seen: set = set()
        self._grad_slots: dict = {}  # param name -> slot of its gradient at the last check
        self._scale_used = None  # GradScaler's scale during this step's backward (device tensor)
        self._active = False
        self._in_step = False
        self._read_this_step = False
        self._applied_this_step = False  # True / False, or None: decided when found_inf is read
        self._fused_applied: dict = {}  # step -> did a fused-AMP update apply (read before the step)
        self._undecided: set = set()  # steps whose fused-AMP decision arrives with a later read
        self._grads_this_step = False
        self._closed = False
        if log is not None:
            self.steplog = StepLog(log, self.rank)
        self._install()

    # ------------------------------------------------------------------ hooks
    def _install(self) -> None:
        for module, name in self._module_names.items():
            if self.activations:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._make_post_hook(name), with_kwargs=True))
        if self.grads:
            for name, p in self._params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(name)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre_hook))
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post_hook))
        if self.scaler is not None:
            self._wrap_scaler_step()

    def _wrap_scaler_step(self) -> None:
        """GradScaler has no hooks. When it skips an update, optimizer.step never runs, so the
        step would be checked only at ``mon.step()`` exit -- after the loop's ``zero_grad`` dropped
        the gradients and ``scaler.update()`` changed the scale. Wrapping this instance's ``step``
        checks a skipped step right there, with the unscaled gradients still in place."""
        scaler, original = self.scaler, self.scaler.step

        def step(optimizer, *args, **kwargs):
            result = original(optimizer, *args, **kwargs)
            if self._active and not self._read_this_step:  # the update was skipped
                self._read(before_update=False)
            return result

        scaler.step = step

        class _Restore:
            def remove(self_inner):
                if scaler.__dict__.get("step") is step:
                    del scaler.step

        self._handles.append(_Restore())

    def _slot(self, phase, kind, name, tensor, rec=None, inputs=(), param=None, candidate=True) -> int:
        if rec is None and tensor is not None:
            rec = record(tensor.detach(), backend=self.backend)
        self._pending.append(_Slot(self.step_index, phase, kind, name, rec, tensor, inputs, param, candidate))
        return len(self._pending) - 1

    def _lookup(self, t: torch.Tensor) -> Optional[int]:
        known = self._known.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            return known[2]
        return None

    def _remember(self, t: torch.Tensor, index: int) -> None:
        self._known[id(t)] = (weakref.ref(t), t._version, index)

    def _make_pre_hook(self, name):
        def pre_hook(module, args, kwargs):
            if not self._active:
                return None
            if torch.compiler.is_compiling():
                self._traced_write(self._row_of[name], _first_tensor((args, kwargs)))
                return None
            if name == ROOT:
                self._capturer.note_autocast(self.step_index)
            inputs = []
            for label, t in list(_tensors(args, "input")) + list(_tensors(kwargs, "input")):
                index = self._lookup(t)
                if index is None:
                    index = self._slot("forward", "activation", f"{name}.{label}", t, candidate=False)
                    self._remember(t, index)
                inputs.append(index)
            self._inputs_of[module] = inputs
            return None

        return pre_hook

    def _make_post_hook(self, name):
        def post_hook(module, args, kwargs, output):
            if not self._active:
                return None
            if torch.compiler.is_compiling():
                for k, (_, t) in enumerate(_tensors(output, "")):
                    if k == _TRACED_OUTPUTS:
                        break
                    self._traced_write(self._row_of[name] + 1 + k, t)
                return None
            inputs = self._inputs_of.pop(module, [])
            self._forward_inputs_of[name] = inputs
            outs = []
            for label, t in _tensors(output, ""):
                index = self._lookup(t)
                if index is None or not self._pending[index].candidate:
                    index = self._slot("forward", "activation", f"{name}{label}", t, inputs=inputs)
                    self._remember(t, index)
                    if self.grads and t.requires_grad:
                        t.register_hook(self._make_out_grad_hook(name, f"{name}{label}"))
                outs.append(index)
            self._outputs_of[name] = outs
            return None

        return post_hook

    def _traced_write(self, row: int, t: Optional[torch.Tensor]) -> None:
        """Inside a torch.compile graph: only tensor ops (no Python bookkeeping), so the hook is
        traced into the graph with no break. The record lands in a static row with its execution
        sequence number; the host decodes the rows with the step's single copy. On this path a
        module's first floating input and its first four floating outputs are checked, and shapes
        are reported flattened."""
        if t is None or self._traced is None:
            return
        row_view = self._traced[row]
        row_view[:RECORD_SIZE].copy_(record(t.detach(), backend=self.backend))
        self._seq.add_(1)
        row_view[_SEQ:_SEQ + 1].copy_(self._seq)
        row_view[_NUMEL] = t.numel()
        row_view[_DTYPE] = _DTYPE_CODE.get(t.dtype, 0)

    def _make_out_grad_hook(self, module_name, tensor_name):
        def out_grad_hook(grad):
            if self._active and grad is not None:
                index = self._slot("backward", "grad", f"{tensor_name} (output grad)", grad, candidate=True)
                self._out_grads_of.setdefault(module_name, []).append(index)
            return None

        return out_grad_hook

    def _make_grad_hook(self, name):
        def grad_hook(param):
            if not self._active:
                return
            if not self._grads_this_step and self.scaler is not None:
                # The scale this backward used, before scaler.update() changes it (a device copy).
                scale = getattr(self.scaler, "_scale", None)
                self._scale_used = scale.detach().clone() if isinstance(scale, torch.Tensor) else None
            self._grads_this_step = True
            if name in self._grad_seen:  # gradient accumulation: one slot per step, read at the end
                return
            self._grad_seen.add(name)
            # A weight's gradient combines the gradient of its module's output with the module's
            # forward inputs (saved for backward): both must be finite for "produced here".
            owner = self._param_module[id(param)]
            depends = tuple(self._out_grads_of.get(owner, ())) + tuple(self._forward_inputs_of.get(owner, ()))
            self._pending.append(_Slot(self.step_index, "backward", "grad", name, None, param, depends, param=param))

        return grad_hook

    def _fused_amp_found_inf(self, optimizer) -> Optional[torch.Tensor]:
        """With a GradScaler and an optimizer that handles AMP itself (fused Adam/AdamW/SGD),
        GradScaler does not skip ``optimizer.step``: it sets ``optimizer.found_inf`` and the
        kernel skips the update. That device flag is read with the step's records."""
        if self.scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return None
        found_inf = getattr(optimizer, "found_inf", None)
        return found_inf if isinstance(found_inf, torch.Tensor) else None

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        if self._active:
            self._read(before_update=True, found_inf=self._fused_amp_found_inf(optimizer))
        return None

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        self._applied_this_step = True
        if self._active and self._fused_amp_found_inf(optimizer) is not None:
            self._applied_this_step = self._fused_applied.pop(self.step_index, None)
        if not self._active:
            return
        if self.params and self._params:
            rows = records([p.detach() for _, p in self._params], backend=self.backend)
            grads = self._grad_slots
            for i, (name, p) in enumerate(self._params):
                inputs = ()
                if name in grads:  # the gradient this update used: "produced" compares with it
                    g = grads[name]
                    self._pending.append(_Slot(g.step, "update", "grad", f"{name} (grad)", g.record, None, candidate=False))
                    self._pending[-1].dtype, self._pending[-1].shape = g.dtype, g.shape
                    inputs = (len(self._pending) - 1,)
                self._pending.append(_Slot(self.step_index, "update", "param", name, rows[i], p, inputs))
        if self.optimizer_state:
            names = {id(p): n for n, p in self._params}
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1 and value.is_floating_point():
                        self._slot("update", "optimizer_state", f"{names.get(id(p), '?')}.{key}", value)

    # ------------------------------------------------------------------ user API
    @contextlib.contextmanager
    def step(self, batch=None):
        """Marks one training step (``mon.step_index`` counts from 0). ``batch`` is accepted for the
        capture feature (issue 4) and is not read here."""
        if self._closed:
            raise RuntimeError("this nanscan Monitor is closed; call nanscan.watch(model) again")
        if self._in_step:
            raise RuntimeError("mon.step() contexts cannot be nested")
        self._in_step = True
        self._active = self.step_index % self.every == 0
        self._read_this_step = self._applied_this_step = self._grads_this_step = False
        self._known.clear()
        self._reset_traced()
        if self.capture_dir is not None and self._active:
            self._capturer.remember(self.step_index, batch)
        self._inputs_of = {}
        self._forward_inputs_of.clear()
        self._outputs_of.clear()
        self._out_grads_of.clear()
        self._grad_seen.clear()
        try:
            yield self
        except BaseException as primary:
            # The training exception stays the primary error; a failure of our own bookkeeping is
            # attached to it, never the other way round.
            try:
                self._end_step(raise_incident=False)
            except Exception as secondary:  # pragma: no cover - defensive
                _attach_note(primary, f"nanscan could not finish the step: {secondary!r}")
            raise
        else:
            self._end_step(raise_incident=True)

    def capture(self, incident: Optional[Incident] = None, capture_dir: Optional[str] = None,
                step: Optional[int] = None) -> str:
        """Write the bundle of ``step`` (default: the incident's step, else the current one) into
        ``capture_dir`` (default: the monitor's) from what ``mon.step(batch)`` kept; returns its path.
        Used at the first incident, and by :func:`nanscan.guard` when a step fails otherwise."""
        capture_dir = capture_dir or self.capture_dir
        if capture_dir is None:
            raise ValueError("nanscan: no capture_dir was given (watch(..., capture_dir=...) or guard(capture_dir=...))")
        if self.capture_dir is None:
            raise RuntimeError("nanscan: the monitor kept no batch / RNG (it was created without capture_dir), "
                               "so no bundle can be written for this step")
        step = step if step is not None else (incident.step if incident is not None else self.step_index)
        return self._capturer.write(incident, capture_dir, step, current_step=self.step_index,
                                    applied_this_step=self._applied_this_step)

    @property
    def bundle_path(self) -> Optional[str]:
        """The bundle written at the first reported incident (or by :func:`nanscan.guard`), or None."""
        return self._capturer.bundle_path

    def _reset_traced(self) -> None:
        """(Re)allocate the traced buffer on the model's device and mark every row unwritten."""
        device = next(iter(self.model.parameters())).device
        if self._traced is None or self._traced.device != device:
            self._traced = torch.zeros(len(self._row_info), _TRACED_COLS, dtype=torch.float64, device=device)
            self._seq = torch.zeros(1, dtype=torch.float64, device=device)
        elif self._active:
            self._traced[:, _SEQ].zero_()
            self._seq.zero_()

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Records the loss (phase ``"loss"``); returns it unchanged."""
        if self._active:
            outputs = self._outputs_of.get(ROOT, [])
            self._slot("loss", "loss", "loss", loss, inputs=outputs)
        return loss

    @property
    def incident(self) -> Optional[Incident]:
        """The first incident, or None."""
        return self.incidents[0] if self.incidents else None

    def close(self) -> None:
        """Checks what is still pending, removes every hook and releases the model."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending or self._in_flight is not None:
                self._read(before_update=False, final=True)
        finally:
            if self.steplog is not None:
                self.steplog.close()
            for h in self._handles:
                h.remove()
            self._handles.clear()
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
            _attach_note(exc, f"nanscan.Monitor.close failed: {secondary!r}")

    # ------------------------------------------------------------------ reading
    def _end_step(self, raise_incident: bool) -> None:
        try:
            if self._active:
                if self.optimizer is not None and self._grads_this_step:
                    self.ledger.attempted += 1
                    if self._applied_this_step is False:
                        self.ledger.skipped_steps.append(self.step_index)
                    elif self._applied_this_step is None:
                        self._undecided.add(self.step_index)
                if self._applied_this_step is True:
                    self.ledger.applied += 1
                if not self._read_this_step:
                    self._read(before_update=False, raise_incident=raise_incident)
            elif self._applied_this_step is True:
                self.ledger.applied += 1
        finally:
            if self.steplog is not None and self._active:
                update = None
                if self.optimizer is not None and self._grads_this_step:
                    update = {True: "applied", False: "skipped", None: None}[self._applied_this_step]
                lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
                self.steplog.ended(self.step_index, update, lr if isinstance(lr, (int, float)) else None)
                lag = (1 if (self.params and self.optimizer is not None) else 0) + (1 if self.mode == "async" else 0)
                self.steplog.flush(before=self.step_index + 1 - lag)
            self._active = False
            self._in_step = False
            self.step_index += 1

    def _read(self, before_update: bool, raise_incident: bool = True, final: bool = False,
              found_inf: Optional[torch.Tensor] = None) -> None:
        self._read_this_step = True
        slots = self._pending
        self._pending = []
        deferred = [s for s in slots if s.record is None and s.param is not None]
        if deferred:  # parameter gradients: one launch group, final (accumulated, unscaled) values
            live = [s for s in deferred if s.param.grad is not None]
            if live:
                rows = records([s.param.grad.detach() for s in live], backend=self.backend)
                for s, row in zip(live, rows):
                    s.record, s.dtype, s.shape = row, s.param.grad.dtype, tuple(s.param.grad.shape)
            self._grad_slots = {s.name: s for s in live}
            slots = [s for s in slots if s.record is not None]
        handled = (not before_update and self.scaler is not None and self._grads_this_step
                   and not self._applied_this_step and not final)
        scale, self._scale_used = self._scale_used, None
        extras = []  # (what, tensor): read with the records, in the same copy
        if scale is not None and not final:
            extras.append(("scale", scale))
        if found_inf is not None:
            extras.append(("found_inf", found_inf))
        previous, self._in_flight = self._in_flight, None
        if self.mode == "async" and not final:
            self._in_flight = self._start_copy(slots, extras, handled)
        else:
            self._decode(*self._start_copy(slots, extras, handled), raise_incident=raise_incident)
        if previous is not None:
            self._decode(*previous, raise_incident=raise_incident)

    def _start_copy(self, slots, extras, handled):
        """Stack every pending record, the traced buffer and the loss scale into one tensor and
        start its copy to the host (the step's one copy)."""
        parts = [s.record for s in slots] + [e.detach().double().reshape(1).expand(RECORD_SIZE) for _, e in extras]
        traced = self._traced if (self._traced is not None and self._active) else None
        if not parts and traced is None:
            return None, None, slots, (), 0, handled, self.step_index
        device = traced.device if traced is not None else parts[0].device
        parts = [t if t.device == device else t.to(device, non_blocking=True) for t in parts]  # a stray CPU input
        blocks = []
        if parts:
            blocks.append(torch.nn.functional.pad(torch.stack(parts), (0, _TRACED_COLS - RECORD_SIZE)))
        if traced is not None:
            blocks.append(traced)
        rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        event = None
        if rows.is_cuda and self.mode == "async":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            rows = host
        n_traced = 0 if traced is None else traced.shape[0]
        return rows, event, slots, tuple(what for what, _ in extras), n_traced, handled, self.step_index

    def _traced_slots(self, traced_values, step):
        """Slots for the traced rows written this step, in execution order."""
        written = sorted((v[_SEQ], r) for r, v in enumerate(traced_values) if v[_SEQ] > 0)
        slots, values, index_of_row = [], [], {}
        for _, r in written:
            name, is_output, input_row = self._row_info[r]
            v = traced_values[r]
            inputs = (index_of_row[input_row],) if is_output and input_row in index_of_row else ()
            slot = _Slot(step, "forward", "activation", name, None, None, inputs, candidate=is_output)
            slot.dtype, slot.shape = _DTYPES[int(v[_DTYPE])], (int(v[_NUMEL]),)
            index_of_row[r] = len(slots)
            slots.append(slot)
            values.append(v[:RECORD_SIZE])
        return slots, values

    def _decode(self, rows, event, slots, extra_names, n_traced, handled, step, raise_incident=True) -> None:
        if event is not None:
            event.synchronize()  # recorded a step ago: normally long done
        # rows is None when nothing was recorded; under torch.distributed the agreement below is
        # a collective, so every rank must still reach it.
        values = rows.tolist() if rows is not None else []  # the one host copy per step (sync mode)
        main = [v[:RECORD_SIZE] for v in values[:len(slots)]]
        n_extras = len(extra_names)
        extra, traced = values[len(slots):len(slots) + n_extras], values[len(slots) + n_extras:]
        for what, row in zip(extra_names, extra):
            if what == "scale":
                self.ledger.scale_history.append((step, row[0]))
                if self.steplog is not None:
                    self.steplog.scale(step, row[0])
            elif what == "found_inf":
                applied = row[0] == 0
                handled = handled or not applied  # the fused kernel skipped the update: AMP handled it
                if step in self._undecided:  # async: the step already ended
                    self._undecided.discard(step)
                    if applied:
                        self.ledger.applied += 1
                    else:
                        self.ledger.skipped_steps = sorted(self.ledger.skipped_steps + [step])
                    if self.steplog is not None:
                        self.steplog.decided(step, "applied" if applied else "skipped")
                else:
                    self._fused_applied[step] = applied
        if n_traced:
            traced_slots, traced_values = self._traced_slots(traced, step)
            offset = len(slots)
            for t in traced_slots:
                t.inputs = tuple(offset + j for j in t.inputs)
            slots, values = list(slots) + traced_slots, main + traced_values
        else:
            values = main
        self._check_hooks_ran(slots, step)
        nonfinite = [v[Field.NAN_COUNT] + v[Field.POSINF_COUNT] + v[Field.NEGINF_COUNT] > 0 for v in values]
        first_by_phase = {}
        for i, s in enumerate(slots):
            if not nonfinite[i] or not s.candidate or (s.step, s.phase) in first_by_phase or self._allowed(s.name):
                continue
            # Only gradient overflow is AMP's to handle: loss scaling cannot fix a non-finite forward
            # activation or loss (the same batch would overflow again, and the scale would only
            # collapse), so those stay incidents even when GradScaler skipped the step.
            handled_here = handled and s.step == step and s.phase == "backward"
            first_by_phase[(s.step, s.phase)] = self._incident(s, values[i], slots, nonfinite, handled_here)
        found = sorted(first_by_phase.values(), key=lambda inc: (inc.step, _PHASE_ORDER[inc.phase]))
        self.incidents.extend(found)
        if self.steplog is not None:
            self.steplog.observe(slots, values, nonfinite)
        report = found[0] if found and not found[0].handled_by_scaler else None
        if distributed.active():  # every rank reports the same incident in the same step
            report = distributed.agree(report)
            if report is not None and report.rank != self.rank:
                self.incidents.append(report)
        if report is None:
            self._log_incidents(found)
            return
        capture_error = None
        try:
            if self.capture_dir is not None and self.bundle_path is None:  # the first reported incident
                self.capture(report)
        except Exception as e:  # the incident stays the primary finding; the capture failure is attached
            capture_error = e
            warnings.warn(f"nanscan could not write the bundle: {e!r}", RuntimeWarning, stacklevel=3)
        self._log_incidents(found if report in found else found + [report])
        if self.on_nonfinite == "record":
            return
        if self.on_nonfinite == "warn" or not raise_incident:
            warnings.warn(str(report), RuntimeWarning, stacklevel=3)
            return
        error = NonFiniteError(report)
        error.bundle_path = self.bundle_path
        if self.bundle_path:
            _attach_note(error, f"nanscan wrote the failure bundle: {self.bundle_path}")
        if capture_error is not None:
            _attach_note(error, f"nanscan could not write the bundle: {capture_error!r}")
        raise error

    def _log_incidents(self, incidents) -> None:
        if self.steplog is not None:
            for inc in incidents:
                self.steplog.incident(inc, self.bundle_path if inc.step == self._capturer.bundle_step else None)

    def _check_hooks_ran(self, slots, step) -> None:
        """A step with a loss or gradients but no module output means the forward hooks did not
        run: typically the model was torch.compile-d *before* nanscan.watch, and the compiled graph
        never calls hooks added later. Attribution would then be wrong, so refuse loudly."""
        if not self.activations:
            return
        this_step = [s for s in slots if s.step == step]
        if any(s.phase == "forward" for s in this_step):
            return
        if any(s.phase in ("loss", "backward") for s in this_step):
            raise RuntimeError(
                "nanscan.watch: the model's forward hooks did not run in this step although a loss / gradients "
                "were seen. If the model was compiled before it was watched, the compiled graph never calls "
                "hooks added later: call nanscan.watch(model) first, then torch.compile(model). (A loss computed "
                "without calling the watched model gives this error too.)")

    def _allowed(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.allow)

    def _incident(self, s: _Slot, values, slots, nonfinite, handled) -> Incident:
        produced: Optional[bool]
        bad_inputs = tuple(slots[j].name for j in s.inputs if j < len(nonfinite) and nonfinite[j])
        if s.kind == "optimizer_state" or (s.kind in ("grad", "param") and not s.inputs):
            produced = None
        else:
            produced = not bad_inputs
        summary = TensorSummary.from_values(values, s.dtype, s.shape)
        return Incident(step=s.step, phase=s.phase, name=s.name, kind=s.kind, produced=produced,
                        summary=summary, rank=self.rank, inputs=bad_inputs,
                        handled_by_scaler=handled)


_PHASE_ORDER = {"forward": 0, "loss": 1, "backward": 2, "update": 3}
_WATCHED: dict = {}


def _attach_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def watch(model, optimizer=None, scaler=None, *, activations: bool = True, grads: bool = True,
          params: bool = True, optimizer_state: bool = False, every: int = 1, mode: str = "sync",
          on_nonfinite: str = "raise", allow: Iterable[str] = (), backend: Optional[str] = None,
          capture_dir: Optional[str] = None, keep_pre_update_state: bool = False, log=None) -> Monitor:
    """Watch ``model`` for non-finite values, every ``every`` steps, cheaply enough to leave on.

    ``activations``: module inputs/outputs in the forward and the gradients flowing into module
    outputs; ``grads``: parameter gradients; ``params``: parameters after each optimizer update
    (needs ``optimizer``); ``optimizer_state``: optimizer state tensors after the update.
    ``mode="sync"`` reads the step's records once, before ``optimizer.step`` (so a bad update can
    be stopped); ``"async"`` copies them without blocking and checks them a step later.
    ``on_nonfinite``: ``"raise"`` (:class:`NonFiniteError`), ``"warn"`` or ``"record"`` (only
    ``mon.incidents``). Non-finite gradients in a step whose update GradScaler skipped are never
    raised (AMP handled them): they are recorded and counted in ``mon.ledger``. Non-finite forward
    activations or losses are incidents even then: loss scaling cannot fix them. ``allow``: fnmatch patterns of names allowed to be
    non-finite (e.g. ``"*.attn_mask"``). Watch before ``torch.compile``.

    ``capture_dir``: at the first reported incident, write a failure bundle there
    (``step000123-rank0``; see :mod:`nanscan.capture.bundle`) with the batch given to
    ``mon.step(batch)`` (cloned before the forward), the pre-step RNG, and model / optimizer /
    scaler state marked "before-update" or "after-update". Cost per checked step: a clone of the
    batch and the RNG states. ``keep_pre_update_state=True`` also keeps a copy of model, optimizer
    and scaler state from the start of each step, so update-phase (and async) incidents get
    pre-update state: one extra copy of all state in memory and a device copy of it every step.

    ``log``: a path or a :class:`nanscan.EventLog`: one JSONL record per checked step (loss, unscaled
    grad norm, loss scale, lr, update applied / skipped, non-finite counts per phase) and one per
    incident (fsynced); see :mod:`nanscan.monitor.steplog`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanscan.watch expects a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise ValueError("nanscan.watch: this model is already torch.compile-d; hooks added now would never "
                         "run inside the compiled graph. Call nanscan.watch(model) first, then torch.compile(model)")
    if not any(True for _ in model.parameters()):
        raise ValueError("nanscan.watch: the model has no parameters; there is nothing to train or watch")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"nanscan.watch: every must be an int >= 1, got {every!r}")
    if mode not in MODES:
        raise ValueError(f"nanscan.watch: mode must be one of {MODES}, got {mode!r}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"nanscan.watch: on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    if isinstance(allow, str):
        allow = (allow,)
    if id(model) in _WATCHED:
        raise ValueError("nanscan.watch: this model is already watched; close the first Monitor "
                         "(mon.close() or leave its `with` block) before watching it again")
    monitor = Monitor(model, optimizer, scaler, activations=activations, grads=grads, params=params,
                      optimizer_state=optimizer_state, every=every, mode=mode, on_nonfinite=on_nonfinite,
                      allow=tuple(allow), backend=backend, capture_dir=capture_dir,
                      keep_pre_update_state=keep_pre_update_state, log=log)
    _WATCHED[id(model)] = monitor
    return monitor

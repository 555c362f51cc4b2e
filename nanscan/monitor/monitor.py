"""The always-on monitor: ``nanscan.watch(model, optimizer)`` -> :class:`Monitor`, which composes
the parts (diagram: ``docs/layout.md#the-monitor``; semantics: ``docs/monitor.md``):

* triggers -- module hooks (:mod:`~nanscan.monitor.eager`, :mod:`~nanscan.monitor.traced` inside
  ``torch.compile`` graphs), optimizer hooks, the GradScaler / closure wrappers
  (:mod:`~nanscan.monitor.triggers`) -- tell :class:`~nanscan.monitor.state.StepState` what happened;
* :class:`~nanscan.monitor.reading.Reading` gathers the step's records into one device-to-host copy,
  which lands as a :class:`~nanscan.monitor.read.Read`;
* :class:`~nanscan.monitor.outcomes.Outcomes` gives that read to every consumer and applies the
  policy (raise, warn, record; the bundle).

A step is one optimizer step (its post-hook, or GradScaler's skip), however many forward / backward
passes it took; without an optimizer a step ends at the first training forward after a backward;
``with mon.step(batch):`` is an explicit delimiter (Note [explicit steps]). A checked step is read
once, before the update in sync mode, one read later in async mode.

Note [training forwards]: a *training* forward is one with grad enabled (outside ``no_grad`` and
``inference_mode``), whatever the modules' ``training`` flag: fine-tuning in ``model.eval()``
(frozen BatchNorm statistics, no dropout) is training, and its backward and update follow. Other
forwards are phase ``"eval"``: they never change the step, are checked by default, read at their
end, and never raise unless ``eval_forwards="raise"``. A validation pass in ``model.eval()`` that
leaves grad enabled cannot be told from fine-tuning in eval mode: it is checked as a training
forward of the step it runs in (HF Trainer and Lightning validate under ``no_grad`` /
``inference_mode``); the failure bundle keeps the step's first train-mode batch where there is one.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Optional

import torch

from nanscan import _ops
from nanscan.guard import attach_note
from nanscan.monitor.autocast_probe import AutocastProbe, autocast_enabled
from nanscan.monitor.config import WatchConfig
from nanscan.monitor.eager import ROOT, EagerHooks, ModuleInfo
from nanscan.monitor.findings import Findings
from nanscan.monitor.headroom import HeadroomWatch
from nanscan.monitor.health import make_health
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.outcomes import Outcomes
from nanscan.monitor.read import Read
from nanscan.monitor import distributed, readback
from nanscan.monitor import reading as reading_module
from nanscan.monitor.readback import Clean, Copy, _scalars_on_host
from nanscan.monitor.reading import Reading
from nanscan.monitor.results import Results
from nanscan.monitor.skipping import SkipStep, StepSkipper
from nanscan.monitor.slots import Block, Slot
from nanscan.monitor.spikes import SpikeWatch
from nanscan.monitor.state import StepState
from nanscan.monitor.stepcapture import StepCapture
from nanscan.monitor.steplog import StepLog
from nanscan.monitor.tensors import ModelTensors
from nanscan.monitor.torch_hooks import WATCHED as _WATCHED
from nanscan.monitor.torch_hooks import graph_has_compiled_function, graph_reaches
from nanscan.monitor.traced import TracedRows, release_hook_guards
from nanscan.monitor.triggers import Triggers, wrap_closure, wrap_scaler
from nanscan.warn import warn


class Monitor(Results):
    """Watches one model; see :func:`watch` for the options. Use as a context manager (or call
    :meth:`close`): hooks are removed and pending records are checked on exit. Its interface is the
    table in docs/monitor.md ("What the monitor gives you": the properties of
    :class:`~nanscan.monitor.results.Results`, ``ledger``, ``skipper``, ``config``, :meth:`step`,
    :meth:`check_loss`, :meth:`capture`, :meth:`close`); every other attribute is one of its parts.
    The hooks in other files reach it only through ``triggers``
    (:class:`~nanscan.monitor.triggers.Triggers`)."""

    def __init__(self, model, optimizer=None, scaler=None, config: Optional[WatchConfig] = None):
        config = self.config = config if config is not None else WatchConfig()
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.activations, self.grads, self.params, self.buffers = (config.activations, config.grads, config.params,
                                                                   config.buffers)
        self.activation_grads = config.records_activation_grads
        # Gradients inside compiled graphs: taps (``compiled_grads``) or tensor hooks (``compiled_grad_hooks``).
        self.compiled_grads = config.compiled_grad_taps
        self.compiled_grad_hooks = config.compiled_grad_hooks
        self.allow = config.allow
        self.capture_dir = config.capture_dir
        self.ledger = Ledger()
        self.rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                     and torch.distributed.is_initialized()) else 0
        self.findings = Findings(config.allow, self.rank)
        # The read consumers, in order: the step log (and through it, the listeners of completed
        # steps: spikes, then telemetry), headroom (into the step log's steps), telemetry, spikes.
        health = make_health(config, model)  # (under torch.distributed: a collective)
        spikes = SpikeWatch(config.spikes) if config.spikes is not None else None
        listeners = [part for part in (spikes, health) if part is not None]
        self.steplog: Optional[StepLog] = (StepLog(config.log, self.rank, listeners)
                                           if config.log is not None or listeners else None)
        headroom = (HeadroomWatch(config.headroom_bits, config.headroom_cast, self.rank, grads=scaler is None,
                                  steplog=self.steplog)
                    if config.headroom_bits is not None else None)
        consumers = [part for part in (self.steplog, headroom, health, spikes) if part is not None]
        self._headroom, self._spikes = headroom, spikes  # (Results' views)
        self._autocast_probe = AutocastProbe()
        self._capturer = StepCapture(model, optimizer, scaler, config.capture_dir, config.keep_pre_update_state,
                                     self.rank, config.mode)
        # on_nonfinite="skip": the buffer snapshot, the consecutive count, the wrapped optimizer.step.
        self.skipper = (StepSkipper(model, config.max_consecutive_skips, config.allow)
                        if config.on_nonfinite == "skip" else None)
        # What a landed read leads to (ledger, findings, step log, headroom, telemetry, the policy).
        self.outcomes = Outcomes(config, self.ledger, self.findings, self.steplog, consumers, self._capturer,
                                 write_bundle=self.capture, skipper=self.skipper)
        infos = [ModuleInfo(name or ROOT, m, m is model, k) for k, (name, m) in enumerate(model.named_modules())]
        # (Note [modules changed after watch])
        self._index_of_module = {id(m): k for k, (_, m) in enumerate(model.named_modules())}
        extension = _ops.monitor_extension()
        if extension is None:
            raise RuntimeError(f"nanscan.watch needs nanscan's compiled library (its hooks and read windows are "
                               f"C++): {_ops.LOAD_ERROR}")
        self.tensors = ModelTensors(model, {info.name: info for info in infos}, extension, config.backend,
                                    buffers=config.buffers)
        # (The hooks' records are summarized by C++: in batches on a device, on arrival on the CPU.)
        summarize = self.tensors.summarize_in_cpp()
        # The read windows (eager hooks, eval forwards), the gradient sink, async mode's copy in flight.
        reading = self.reading = Reading(extension, infos, summarize, activation_grads=self.activation_grads)
        self.slots, self.eval_slots, self.grad_sink = reading.window, reading.eval_window, reading.grad_sink
        # What the hooks outside this file tell the monitor (the one way in).
        self.triggers = Triggers(
            forward_begins=self._forward_begins, forward_aborted=self._forward_aborted,
            forward_ends=self._forward_ends, model_returned_loss=self._model_returned_loss,
            backward_called=self._backward_called, higher_order=self._higher_order, clipped=self._clipped,
            module_registered=self._module_registered)
        self.hooks = EagerHooks(self, infos, self.activation_grads, extension)
        self.traced = TracedRows(self, infos, self.tensors.kernels_for, extension)
        reading.follow_stamps(self.traced.owner)  # (eager records placed among the compiled rows)
        # Where the step is: its only writer (the triggers below tell it what happened).
        self.state = StepState(config.every, on_recording=self.traced.set_recording)
        self._loss_ref = None  # the loss recorded last (check_loss / scaler.scale / backward record it once)
        self._scaled_ref = None  # the last scaler.scale(loss) result
        self._higher_order_step = None  # the step a gradient was taken with create_graph=True in
        self.opened_by_callback = False  # (an integration's callback opened it: see integrations.transformers)
        self._unhooked_graph = False  # a backward ran through a graph compiled without this monitor's hooks
        self._failed_step: Optional[int] = None  # the explicit step that ended by raising, if the last did
        self._raising = False  # a read raised a NonFiniteError that has not left the step yet
        self.holds_hook_guards = False  # dynamo guards on module hooks for it (Note [two instances of one class])
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
            self.traced.allocate(self.tensors.device())
        if self.optimizer is not None:
            # Host work (the read): run eagerly even when the optimizer step is compiled (one graph
            # break there instead of dynamo tracing the read and breaking on every host op).
            eager = torch.compiler.disable
            self._handles.append(self.optimizer.register_step_pre_hook(eager(self._optimizer_pre_hook)))
            self._handles.append(self.optimizer.register_step_post_hook(eager(self._optimizer_post_hook)))
        if self.scaler is not None:
            self._handles.append(wrap_scaler(self.scaler, self._scaler_scale, self._scaler_step))
        if self.skipper is not None:
            self._handles.append(self.skipper.wrap(self.optimizer))

    def _module_registered(self, parent, name: str, child) -> None:
        """A module of the model is given a child (Note [modules changed after watch])."""
        index = self._index_of_module.get(id(parent))
        if self.state.closed or index is None or parent._modules.get(name) is child:
            return
        self.hooks.cpp.set_unwatched_child(index)
        self.tensors.recollect = True
        where = f"{self.hooks.infos[index].name}.{name}" if index else name
        warn(f"nanscan: module {where!r} was set after watch and is not watched: values it makes are "
             f"'cannot tell' at its parent; its parameters are checked from the next step. Watch the model "
             f"again (mon.close(); nanscan.watch(...)) to watch it.", RuntimeWarning, stacklevel=4)

    def _scaler_scale(self, loss, original_scale):
        """``scaler.scale(loss)``: the loss is recorded (phase ``"loss"``) -- in an AMP loop the step
        log and the loss incident need no ``mon.check_loss``."""
        if self.state.closed:
            return original_scale(loss)
        self.check_loss(loss)
        scaled = original_scale(loss)
        self._scaled_ref = weakref.ref(scaled)  # (its backward is the loss's, recorded unscaled)
        return scaled

    def _scaler_step(self, original_step, optimizer, args, kwargs):
        """``scaler.step(optimizer)``: a skipped update ends the step here (see triggers.wrap_scaler)."""
        state = self.state
        state.update_attempted()
        step_before = state.index
        result = original_step(optimizer, *args, **kwargs)
        if not state.closed and state.index == step_before and not state.applied:  # skipped
            try:
                if state.checking and not state.read:
                    # (the update is not applied either way: under on_nonfinite="skip" a reported
                    # incident -- a non-finite forward or loss -- has the step's buffers restored)
                    self.outcomes.before_update = True
                    try:
                        self._read(before_update=False)
                    finally:
                        self.outcomes.before_update = False
                    if self.outcomes.skip_report is not None:
                        self._skip_step(optimizer, cancel=False)
            finally:
                if not state.in_block:
                    self._end_step(raise_incident=False)
        return result

    # ------------------------------------------------------------------ step lifecycle
    def _forward_begins(self, info: ModuleInfo, args, kwargs) -> Optional[str]:
        """An outermost watched module starts a forward: the phase its records get, or None."""
        module, state = info.module(), self.state
        if state.closed or module is None:
            return None
        if not (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):  # Note [training forwards]
            return "eval" if (self.config.eval_forwards != "skip" and self.activations) else None
        if not state.in_block and self.optimizer is None and self.reading.backward_seen():
            self._end_step()  # no optimizer: a training forward after a backward starts the next step
        elif state.awaiting_update:
            self._end_step()  # an explicit step whose optimizer step never came: the next step begins
        if self.headroom is not None:
            self.headroom.note_autocast(state.index, self.tensors.device().type)
        # The step's first outermost watched call -- the model, or the watched module a step calls
        # when the model is a wrapper (Lightning's `self.net(x)` in training_step) -- or its first in
        # train mode, after forwards in eval mode with grad enabled (a validation pass without
        # no_grad): the inputs it trained on. (Every outermost call comes here: a nested one does not.)
        if state.forward_began(module.training):
            if self.skipper is not None and state.checking:
                self.skipper.snapshot()  # (Note [what a skipped step leaves])
            if self.capture_dir is not None and state.checking and not state.in_block:
                self._capturer.remember(state.index, forward_inputs=(args, kwargs),
                                        inputs_of=None if info.is_root else info.name)
            else:
                self._capturer.note_autocast(state.index)
        if (self.headroom is not None or self.capture_dir is not None) and not autocast_enabled():
            self._autocast_probe.arm(module, functools.partial(self._autocast_inside, state.index))
        if not (state.checking and self.activations):
            return None
        if info.is_root:
            self.traced.begin_forward()
        return "forward"

    def _autocast_inside(self, step: int) -> None:
        """Autocast was entered inside the model's forward (Note [autocast inside the forward])."""
        if self.headroom is not None:
            self.headroom.note_autocast(step, self.tensors.device().type)
        self._capturer.note_autocast(step, inside=True)

    def _forward_aborted(self) -> None:
        """The model's last forward raised and the loop went on (it skipped the batch): that batch is
        not the step's, the next forward's is."""
        self.state.forward_aborted()

    def _forward_ends(self, info: ModuleInfo) -> None:
        if self.hooks.phase == "eval":
            self._read_eval()

    def _model_returned_loss(self, output) -> None:
        """The root returned ``output["loss"]`` (recorded as the loss): ``check_loss`` of the same
        tensor must not record it twice."""
        self._loss_ref = weakref.ref(output["loss"]) if isinstance(output, dict) else None

    def _fused_amp_found_inf(self, optimizer) -> Optional[torch.Tensor]:
        """With a GradScaler and an optimizer that handles AMP itself (fused Adam/AdamW/SGD),
        GradScaler does not skip ``optimizer.step``: it sets ``optimizer.found_inf`` and the kernel
        skips the update. That device flag is read with the step's records."""
        if self.scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return None
        found_inf = getattr(optimizer, "found_inf", None)
        return found_inf if isinstance(found_inf, torch.Tensor) else None

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        state = self.state
        if state.closed:
            return None
        state.update_attempted()
        if not state.checking:
            return None
        # optimizer.step(closure): the step's forward and backward run inside the step, in the closure
        # (Lightning's automatic optimization, LBFGS). Read when the closure returns -- after the
        # backward, before the update -- not here, before the forward.
        wrapped = wrap_closure(optimizer, args, kwargs,
                               lambda: None if state.closed else self._closure_returned(optimizer))
        if wrapped is None:
            self._read_before_update(optimizer)
        elif self.skipper is not None:
            self.skipper.closure_step_begins(optimizer)
        return wrapped

    def _closure_returned(self, optimizer) -> None:
        if self.skipper is not None:
            self.skipper.closure_returned()
        self._read_before_update(optimizer)

    def _read_before_update(self, optimizer) -> None:
        outcomes = self.outcomes
        outcomes.before_update = True
        try:
            self._read(before_update=True, found_inf=self._fused_amp_found_inf(optimizer))
        except NonFiniteError:
            if not self.state.in_block:  # the update will not run: the step ends here, skipped
                self._end_step(raise_incident=False)
            raise
        finally:
            outcomes.before_update = False
        if outcomes.skip_report is not None:
            self._skip_step(optimizer)

    def _skip_step(self, optimizer, cancel: bool = True) -> None:
        """on_nonfinite="skip": the reported step is not applied (:mod:`nanscan.monitor.skipping`);
        ``cancel``: the optimizer's step is running and is cancelled (False: GradScaler skipped it)."""
        report, self.outcomes.skip_report = self.outcomes.skip_report, None
        state = self.state
        self.skipper.restore()
        self.skipper.skipped(state.index)
        state.update_applied(False)
        warn(f"nanscan skipped the update of step {state.index} ({self.skipper.consecutive} in a row, at most "
             f"{self.skipper.max_consecutive}): {report}", RuntimeWarning, stacklevel=5)
        if not cancel:
            return
        if not state.in_block:
            self._end_step(raise_incident=False)
        raise SkipStep(optimizer)

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        state = self.state
        if state.closed:
            return
        fused = self._fused_amp_found_inf(optimizer) is not None
        state.update_applied(self.outcomes.fused_applied.pop(state.index, None) if fused else True)
        if self.skipper is not None and state.applied:
            self.skipper.applied()
        if state.checking:
            self.tensors.record_update(self.slots, state.index, optimizer, optimizer_state=self.config.optimizer_state,
                                       params=self.params)
        if not state.in_block:
            self._end_step()

    def _end_step(self, raise_incident: bool = True) -> None:
        """The step ends: ledger, the read if it was not read yet, the step log; next step."""
        state = self.state
        step = state.index
        try:
            if state.attempted:  # (applied None: a fused-AMP flag decides when read, if ever)
                self.ledger.attempt(step, state.applied)
            recorded = state.forward_seen or self.reading.backward_seen() or len(self.slots) > 0 or self.traced.used
            if state.checking and recorded and not state.read:
                if self.optimizer is None:
                    self.tensors.record_buffers(self.slots, step)
                self._read(before_update=False, raise_incident=raise_incident)
        finally:
            try:
                if self.steplog is not None and state.checking:
                    self._log_step_end(step)
                if self.steplog is not None and self._raising:
                    # A NonFiniteError is on its way to the loop: the log and the tracker get the
                    # failing step now, ended (its update "skipped"), before it stops the run.
                    self.steplog.failed()
            finally:
                self._raising = False
                # The next step begins whatever the log and the sinks did: a sink's KeyboardInterrupt
                # the loop catches must not leave the step count behind for the rest of the run.
                if self.skipper is not None:
                    self.skipper.step_ended()
                state.next_step()  # (the compiled rows follow its recording switch)
                self.tensors.follow_moves()  # the model may have moved (model.to(device) after watch)
                if self.activations:
                    self.traced.allocate(self.tensors.device())

    def _log_step_end(self, step: int) -> None:
        """The step log (and through it telemetry and spikes) hears that a checked step ended."""
        state = self.state
        update = None
        if state.attempted:
            update = {True: "applied", False: "skipped", None: None}[state.applied]
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
        self.steplog.ended(step, update, lr if isinstance(lr, (int, float)) else None)
        # (Records that come with a later read -- parameters after the update, async mode's
        # one-read delay -- arrive with the next *checked* step's read, `every` steps later.)
        lag = ((1 if (self.params and self.optimizer is not None) else 0)
               + (1 if self.config.mode == "async" else 0))
        self.steplog.flush(before=step + 1 - lag * self.config.every)

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
        state = self.state
        if state.closed:
            raise RuntimeError("this nanscan Monitor is closed; call nanscan.watch(model) again")
        if state.in_block:
            raise RuntimeError("mon.step() contexts cannot be nested")
        if state.forward_seen or state.attempted:  # an implicit step (or a block awaiting its update) ends here
            self._end_step()
        if self.capture_dir is not None and state.checking:  # (a batch that cannot be kept raises here,
            self._capturer.remember(state.index, batch=batch)  # before the monitor changed state)
        state.block_entered()  # (the explicit step owns the batch)
        self._failed_step = None
        try:
            yield self
        except BaseException as primary:
            self._failed_step = state.index  # (the step ends below: guard asks which one failed)
            # The training exception stays the primary error; a failure of our own bookkeeping is
            # attached to it, never the other way round.
            try:
                self._end_step(raise_incident=False)
            except Exception as secondary:  # pragma: no cover - defensive
                attach_note(primary, f"nanscan could not finish the step: {secondary!r}")
            raise
        else:
            if self.optimizer is not None and not state.attempted:
                state.block_awaits_update()  # read and ended with its optimizer step (Note [explicit steps])
            else:
                self._end_step(raise_incident=True)
        finally:
            state.block_left()

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Records the loss (phase ``"loss"``; its inputs are the model's outputs); returns it.
        Optional: ``loss.backward()`` records it already (Note [the loss is what backward is called
        on]), and so does ``scaler.scale(loss)``; for a loop that calls ``torch.autograd.backward``."""
        if self.state.recording and isinstance(loss, torch.Tensor):
            if self._loss_ref is not None and self._loss_ref() is loss:  # recorded already
                return loss
            self._loss_ref = weakref.ref(loss)
            # Its inputs: the model's outputs in this window; with no forward recorded (a loss of the
            # parameters alone) what it was computed from is unknown.
            forward = self.hooks.recorded_forward
            slot = Slot(self.state.index, "loss", "loss", "loss", loss.dtype, loss.shape,
                        self.hooks.root_outputs if forward else (), True)
            slot.inputs_changed = not forward
            if self.steplog is not None:
                self.steplog.loss_recorded(slot, len(self.slots))
            self.slots.add(loss, slot)
        return loss

    def _clipped(self, parameters: list, total_norm, norm_type) -> None:
        """``clip_grad_norm_`` ran (Note [grad norm before clipping])."""
        if not self.state.recording or self.steplog is None or not isinstance(total_norm, torch.Tensor):
            return
        tensors = self.tensors
        if tensors.param_ids is None:
            tensors.param_ids = frozenset(id(p) for p in tensors.param_tensors)
        if not any(id(p) in tensors.param_ids for p in parameters):
            return  # another model's
        self.reading.clipped(total_norm, norm_type)

    def _higher_order(self) -> None:
        """A gradient was taken with ``create_graph=True`` in this step (a gradient penalty, MAML):
        the backward of that graph runs through nodes no module owns, so a parameter gradient's
        value is no longer explained by its module's output gradients and inputs: "cannot tell"
        where it was produced (never its module's)."""
        self._higher_order_step = self.state.index

    def _backward_called(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` was called (Note [the loss is what backward is called on])."""
        if not self.state.recording or tensor.numel() != 1 or not tensor.is_floating_point():
            return
        if self._scaled_ref is not None and self._scaled_ref() is tensor:
            return  # scaler.scale(loss).backward(): the loss was recorded, unscaled, by scale()
        if len(_WATCHED) > 1 and not self._owns_loss(tensor):
            return  # another watched model's loss (Note [whose loss])
        if not self.hooks.recorded_forward and graph_has_compiled_function(tensor.grad_fn):
            self._unhooked_graph = True  # (a graph compiled before watch, whose hooks never run: _check_hooks_ran)
        self.check_loss(tensor)  # (with no forward recorded: a loss of the parameters alone, origin unknown)

    # Note [whose loss]: ``tensor.backward()`` is heard by every open monitor. With one model
    # watched, it is that model's loss. With several (a GAN's generator and discriminator, a teacher
    # and a student, each watched), a monitor takes as its loss only a backward whose graph
    # accumulates into one of its model's trainable parameters (``graph_reaches``: found at once for
    # its own loss; another model's graph is walked whole, once per backward, only while several
    # models are watched). A generator's loss through the discriminator reaches both: both record it.
    # A watched model with no trainable parameter (a frozen teacher) takes no loss from a backward.
    def _owns_loss(self, tensor: torch.Tensor) -> bool:
        tensors = self.tensors
        if tensors.param_ids is None:
            tensors.param_ids = frozenset(id(p) for p in tensors.param_tensors)
        # (only a parameter that requires grad has an AccumulateGrad node: a frozen one is never found)
        return tensor.grad_fn is not None and graph_reaches(tensor.grad_fn, tensors.param_ids)

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
        step = step if step is not None else (incident.step if incident is not None else self.state.index)
        return self._capturer.write(incident, capture_dir, step, current_step=self.state.index,
                                    applied_this_step=self.state.applied)

    def close(self) -> None:
        """Checks what is still pending (the last step if it did not end), removes every hook and
        releases the model."""
        state = self.state
        if state.closed:
            return
        # After an incident was raised, what close still finds (async mode's late read of that step,
        # values that followed from it) is recorded, never raised: a second NonFiniteError from a
        # `finally: mon.close()` would replace the first.
        raise_incident = None if self.outcomes.raised else True
        try:
            if state.awaiting_update:  # an explicit step whose optimizer step never came
                self._end_step(raise_incident=raise_incident)
            if state.checking and (state.forward_seen or self.reading.backward_seen()) and not state.read:
                self._read(before_update=False, final=True, raise_incident=raise_incident)
            elif self.reading.pending() or self.traced.used:
                self._read(before_update=False, final=True, include_grads=False, raise_incident=raise_incident)
        finally:
            state.close()  # (the compiled rows follow its recording switch)
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
            if self.holds_hook_guards:
                self.holds_hook_guards = False
                release_hook_guards()
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
    def _read(self, before_update: bool, raise_incident: bool = True, final: bool = False,
              found_inf: Optional[torch.Tensor] = None, include_grads: bool = True) -> None:
        try:
            self._read_and_decide(before_update, raise_incident, final, found_inf, include_grads)
        except NonFiniteError:
            self._raising = True  # (the step's end publishes it: _end_step)
            raise

    def _read_and_decide(self, before_update: bool, raise_incident: bool, final: bool,
                         found_inf: Optional[torch.Tensor], include_grads: bool) -> None:
        state = self.state
        state.was_read()
        step = state.index
        scaler = self.scaler
        outcomes = self.outcomes
        reading, hooks = self.reading, self.hooks
        sync = self.config.mode == "sync" or final
        extras = [] if (scaler is None and found_inf is None and not reading.clip_norms and not reading.clip_unknown) \
            else reading.scalars(step, getattr(scaler, "_scale", None) if scaler is not None else None, found_inf,
                                 include_grads, final, self.steplog)
        # Note [a clean step's read]: a read that nothing needs but its answer if it is clean -- no
        # consumer of its rows, nothing in flight, no compiled path, on one process (else another
        # rank's incident may be the one to report), after a recorded forward where activations are
        # watched (else the hooks' check needs the rows) -- is taken and tested in one C++ call
        # before any other line of the read runs: each line and call of a read is fetched cold after
        # the step (Note [a clean read in one call] in csrc/monitor/lean_read.h), so the common
        # clean step makes a few Python calls besides the C++ take (benchmarks/read_cost.py). Its
        # scalars (loss scale, found_inf, clip norm) ride along where they lie on the host. Not
        # clean, its parts go to gather as its own take would have made them. In async mode too,
        # where the host need not wait to decide it: records on the host are decided at once, as in
        # sync mode (async mode spares the host a wait for the device, and there is none); records
        # on a device come back undecided and go on as a copy decided a read later.
        lean = (not outcomes.rows_wanted and reading.in_flight is None
                and (hooks.recorded_forward or not self.activations) and not self.traced.used
                and not distributed.active())
        tensors = self.tensors
        read_grads = include_grads and self.grads and bool(tensors.named_params)
        reading.generation += 1  # (the read begins: gradients recorded from now on belong to the next one)
        recorded_forward, hooks.recorded_forward = hooks.recorded_forward, False
        taken = None
        if (lean and reading_module.TAKEN_IN_ONE_CALL and (tensors.param_set is not None or not read_grads)
                and (_scalars_on_host(extras) if extras else readback.DEVICE_DECISION != "never")):
            taken = reading.take_in_one_call(hooks, tensors, read_grads, may_sync=sync)
            if type(taken) is not tuple:  # clean: the parameter gradients' names
                self._decided_clean(step, taken, {name: float(e) for name, e in extras} if extras else None)
                return
        copy = reading.gather(
            step, hooks=hooks, tensors=tensors, traced=self.traced, grads=include_grads and self.grads,
            explained=self.activation_grads and self._higher_order_step != step, extras=extras,
            handled=not before_update and scaler is not None and state.attempted and state.applied is False
            and not final, final=final, non_blocking=not sync, recorded_forward=recorded_forward,
            rows_wanted=outcomes.rows_wanted, lean=lean and sync, taken=taken)
        if type(copy) is Clean:
            self._decided_clean(step, copy.grad_names, copy.extras)
            return
        # The earlier read first: its records were made first (async mode decodes a read late).
        previous, copy = self.reading.swap_in_flight(copy, keep=not sync)
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
        copy = self.reading.gather_eval(self.state.index, self.hooks)
        if copy is None:
            return
        self._decode(copy, raise_incident=self.config.eval_forwards == "raise")

    def _decode(self, copy: Copy, raise_incident: Optional[bool] = True) -> None:
        """A landed read, checked for hooks that never ran, then given to :class:`Outcomes`
        (``raise_incident`` False warns, None records silently). A clean read that nothing walks
        is decided without a :class:`Read` (Note [a clean read is decided without a Read])."""
        copy.wait()
        if copy.clean and not self.outcomes.rows_wanted:
            if copy.eval:  # (an eval forward's clean read: nothing to note, judge or agree on)
                return
            if (copy.recorded_forward or copy.compiled_ran or not self.activations) and not distributed.active():
                grads = copy.slots[copy.grad_start].names if copy.grad_start is not None else None
                self._decided_clean(copy.step, grads, copy.extras)
                return
            copy.decode_compiled()  # (Note [compiled rows decided where they lie])
        read = Read.land(copy, self.traced, link_compiled_weights=self.compiled_grads or self.traced.grad_hooks)
        if read.training:
            self._check_hooks_ran(read)
            self.tensors.note_read(read.step, read.slots, read.grad_start, read.bad)
        self.outcomes.decide(read, raise_incident)

    def _decided_clean(self, step: int, grad_names, extras: dict) -> None:
        """A clean training read of ``step`` that nothing walks, after a recorded forward, on one
        process (Note [a clean read is decided without a Read]): what later reads need of it (the
        parameter gradients ``grad_names`` read, None if not) and its scalars ``extras``."""
        self._unhooked_graph = False  # (what _check_hooks_ran does after a recorded forward)
        self.tensors.note_clean_read(step, grad_names)
        if extras:
            self.outcomes.take_extras(step, extras)

    def _check_hooks_ran(self, read: Read) -> None:
        """Gradients in a step with no recorded forward mean the forward hooks did not run:
        typically the model was torch.compile-d *before* nanscan.watch, and the compiled graph never
        calls hooks added later. Attribution would then be wrong, so refuse loudly."""
        unhooked, self._unhooked_graph = self._unhooked_graph, False
        if not self.activations or read.recorded_forward or read.compiled_ran:
            return
        if read.final:  # (close, at exit: what is left of a step that already ended)
            return
        slots = read.slots
        if self._loss_ref is not None and not unhooked and self._loss_ref() is not None:
            return  # a loss recorded at its backward with no forward: of the parameters alone, origin unknown
        if any(type(s) is Block and s.param for s in slots[-1:]) or any(
                s.phase in ("loss", "backward") and s.step == read.step for s in slots if type(s) is Slot):
            raise RuntimeError(
                "nanscan.watch: the model's forward hooks did not run in this step although a loss / gradients "
                "were seen. If the model was compiled before it was watched, the compiled graph never calls "
                "hooks added later: call nanscan.watch(model) first, then torch.compile(model). (A loss computed "
                "without calling the watched model gives this error too.)")

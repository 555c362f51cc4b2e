"""``nanscan`` in the HF ``Trainer``: one callback.

    from nanscan.integrations.transformers import NanscanCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NanscanCallback()])

The callback calls :func:`nanscan.watch` on the Trainer's model and optimizer when training begins
(the optimizer exists by then; an ``accelerate`` wrapper is unwrapped to the torch optimizer its
hooks need) and closes the monitor when training ends (a run that ended by raising has its monitor closed
when the next run on the model begins: HF calls no callback on an exception). Keyword arguments go to ``watch``
(``capture_dir=``, ``log=``, ``allow=``, ``every=``, ...). The incident is ``callback.monitor.incident``;
with ``on_nonfinite="raise"`` (the default) the ``NonFiniteError`` stops ``trainer.train()``.
The loss HF models return (``output.loss``) is recorded as the loss. Not with
``TrainingArguments(torch_compile=True)``: the Trainer compiles the model before any callback runs,
and hooks added to a compiled model never run (``watch`` refuses it); use ``model = torch.compile``
after ``watch`` in your own loop instead.

``NanscanCallback(telemetry="trainer")`` sends the monitor's telemetry (docs/telemetry.md) through
the Trainer's own reporting: every ``report_to`` integration (TensorBoard, W&B, MLflow, ...) gets the
points through its ``on_log``, at the Trainer's ``global_step`` of the step they describe (the
global step after that step's update, as the Trainer's own ``loss``). ``telemetry`` may also list
nanscan sinks beside ``"trainer"``. Choices: the points go to the reporting integrations only -- not
to ``state.log_history`` (it is saved with every checkpoint and would grow by a point per module per
telemetry step) nor to the console printer; with ``report_to="none"`` training refuses to start
(nowhere to send them). The monitor then closes at the end of the last step (``max_steps``), so
the last points reach the integrations before their ``on_train_end`` ends their runs (an
evaluation the Trainer runs after that step is not watched); a run stopped
earlier (early stopping) sends its last points at ``on_train_end``, which integrations that end
their run there (MLflow's auto end) may log into a new run.
"""
from __future__ import annotations

import copy
import sys
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

import nanscan
from nanscan.telemetry.sinks import Sink


class NanscanCallback(TrainerCallback):
    def __init__(self, **watch_options):
        self.watch_options = watch_options
        self.monitor: Optional[nanscan.Monitor] = None
        self._reporters: Optional[TrainerReporters] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.monitor is None and model is not None:
            _close_stale_monitor(model)
            options = dict(self.watch_options)
            self._reporters = None
            if _names_trainer(options.get("telemetry")):
                self._reporters = TrainerReporters(_calling_handler(), args, state, control)
                options["telemetry"] = _with_trainer(options["telemetry"], self._reporters)
            self.monitor = nanscan.watch(model, optimizer, **options)  # (watch unwraps accelerate's)
            self.monitor.opened_by_callback = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None and self._reporters and 0 < state.max_steps <= state.global_step:
            self._close()  # the last step: its telemetry reaches the integrations before they end their runs

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            self.last_monitor = monitor
            monitor.close()


def _names_trainer(telemetry) -> bool:
    return telemetry == "trainer" or (isinstance(telemetry, (list, tuple)) and "trainer" in telemetry)


def _with_trainer(telemetry, sink: Sink):
    """``telemetry`` with ``"trainer"`` replaced by ``sink``."""
    if not isinstance(telemetry, (list, tuple)):
        return sink
    return [sink if s == "trainer" else s for s in telemetry]


def _calling_handler() -> CallbackHandler:
    """The Trainer's :class:`CallbackHandler`, which is calling this callback's ``on_train_begin``.

    Note [the callback handler from the caller's frame]: HF passes a callback the model, optimizer
    and dataloaders, never the Trainer or its handler, and only the handler knows the reporting
    integrations. ``CallbackHandler.call_event`` is the one caller of every event, so the handler is
    ``self`` a frame or two up; it is looked for once, when training begins, and checked by type.
    """
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, CallbackHandler):
            return candidate
        frame = frame.f_back
    raise RuntimeError("nanscan: NanscanCallback(telemetry='trainer') could not find the Trainer's callback handler "
                       "(this transformers version calls callbacks differently); pass nanscan sinks instead, e.g. "
                       "telemetry=nanscan.telemetry.TensorBoard(log_dir)")


class TrainerReporters(Sink):
    """Telemetry through the Trainer's ``report_to`` integrations: each gets the points in its
    ``on_log``, with the Trainer's ``global_step`` after the update of the step they describe."""

    def __init__(self, handler: CallbackHandler, args, state, control):
        from transformers.integrations import get_reporting_integration_callbacks

        kinds = tuple(get_reporting_integration_callbacks(args.report_to))
        self.reporters = [cb for cb in handler.callbacks if kinds and isinstance(cb, kinds)]
        if not self.reporters:
            raise ValueError(f"nanscan: NanscanCallback(telemetry='trainer') needs a reporting integration, and "
                             f"TrainingArguments(report_to={args.report_to!r}) has none; set report_to (e.g. "
                             f"'tensorboard', 'wandb', 'mlflow') or pass nanscan sinks (nanscan.telemetry)")
        self.handler, self.args, self.state, self.control = handler, args, state, control
        self.first_step = state.global_step  # the Trainer's step when the monitor's step 0 begins

    def write(self, step: int, points: dict) -> None:
        state = copy.copy(self.state)
        state.global_step = self.first_step + step + 1
        h = self.handler
        for reporter in self.reporters:
            reporter.on_log(self.args, state, self.control, model=h.model, processing_class=h.processing_class,
                            optimizer=h.optimizer, lr_scheduler=h.lr_scheduler, train_dataloader=h.train_dataloader,
                            eval_dataloader=h.eval_dataloader, logs=dict(points))

    def __repr__(self) -> str:
        return f"TrainerReporters({[type(r).__name__ for r in self.reporters]})"


def _close_stale_monitor(model) -> None:
    """The Trainer calls no callback when ``train()`` ends by raising (a ``NonFiniteError`` among
    others), so a monitor a callback opened can outlive its run. A new run on the same model closes
    it -- after an incident it records and never raises again -- instead of failing "already
    watched". A monitor the user opened is left alone (``watch`` then says it is watched)."""
    from nanscan.monitor.torch_hooks import WATCHED as _WATCHED

    stale = _WATCHED.get(id(model))
    if stale is not None and getattr(stale, "opened_by_callback", False):
        try:
            stale.close()
        except nanscan.NonFiniteError:  # (its incident is in stale.incidents)
            pass

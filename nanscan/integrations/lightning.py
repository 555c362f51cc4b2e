"""``nanscan`` in a Lightning ``Trainer``: one callback.

    from nanscan.integrations.lightning import NanscanCallback
    trainer = lightning.Trainer(..., callbacks=[NanscanCallback()])

When fitting starts (the optimizers and the precision plugin exist by then) the callback calls
:func:`nanscan.watch` on the ``LightningModule`` with the Trainer's optimizer and, under
``precision="16-mixed"``, its ``GradScaler``; it records the loss Lightning is about to
backpropagate (``on_before_backward``) and closes the monitor when fitting ends or fails. Keyword
arguments go to ``watch`` (``capture_dir=``, ``log=``, ``allow=``, ``every=``, ...). The incident is
``callback.monitor.incident`` (``callback.last_monitor`` once fitting ended); with
``on_nonfinite="raise"`` (the default) the ``NonFiniteError`` stops ``trainer.fit()`` before the
faulty update is applied.

Choices (where Lightning leaves room):

* Lightning's automatic optimization runs ``training_step`` and the backward inside
  ``optimizer.step(closure)``: the monitor reads when the closure returns (see
  :mod:`nanscan.monitor.monitor`), so a step is still stopped before its update.
* One optimizer is watched: steps end at its ``step``. With several (GANs), the first
  (``trainer.optimizers[0]``) delimits steps, and the callback warns; pass ``optimizer_index=`` to
  choose another.
* Validation and sanity-check forwards run in eval mode under ``no_grad``: they are checked as
  phase ``"eval"`` and warned about, never raised (``eval_forwards=`` changes that).
* ``NanscanCallback(telemetry="trainer")`` sends the monitor's telemetry (docs/telemetry.md) to every
  logger of the Trainer (``trainer.loggers``: TensorBoard, W&B, MLflow, CSV, ...) with
  ``logger.log_metrics(points, step)``, ``step`` the one Lightning logs that batch's ``self.log``
  values at; ``telemetry`` may also list nanscan sinks beside ``"trainer"``. Not through
  ``pl_module.log_dict``: the points are published when a step ends (in the optimizer's hooks), where
  Lightning does not allow ``log``. A Trainer without a logger refuses to start (nowhere to send them).
* Not with a model compiled before fitting starts (``torch.compile(model)`` handed to the Trainer):
  hooks added to a compiled model never run, and ``watch`` refuses it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import lightning.pytorch as pl

import nanscan
from nanscan.telemetry.sinks import Sink


class NanscanCallback(pl.Callback):
    def __init__(self, optimizer_index: int = 0, **watch_options):
        self.optimizer_index = optimizer_index
        self.watch_options = watch_options
        self.monitor: Optional[nanscan.Monitor] = None
        self.last_monitor: Optional[nanscan.Monitor] = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            return
        optimizers = list(trainer.optimizers)
        optimizer = None
        if optimizers:
            if len(optimizers) > 1:
                warnings.warn(f"nanscan: {len(optimizers)} optimizers; steps end at optimizer "
                              f"{self.optimizer_index}'s step (NanscanCallback(optimizer_index=...))",
                              RuntimeWarning, stacklevel=2)
            optimizer = optimizers[self.optimizer_index]
            optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wrapper
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        options = dict(self.watch_options)
        telemetry = options.get("telemetry")
        if telemetry == "trainer" or (isinstance(telemetry, (list, tuple)) and "trainer" in telemetry):
            loggers = TrainerLoggers(trainer)
            options["telemetry"] = (loggers if telemetry == "trainer"
                                    else [loggers if s == "trainer" else s for s in telemetry])
        self.monitor = nanscan.watch(pl_module, optimizer, scaler, **options)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.monitor is not None:
            self.monitor.check_loss(loss)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # The training exception stays the one raised; a failure of closing is attached to it.
        try:
            self._close()
        except Exception as secondary:
            from nanscan.guard import attach_note

            attach_note(exception, f"nanscan: closing the monitor after this error failed: {secondary!r}")

    def _close(self) -> None:
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            self.last_monitor = monitor
            monitor.close()


class TrainerLoggers(Sink):
    """Telemetry through a Lightning Trainer's loggers, at the step Lightning logs the batch's
    ``self.log`` values at (its global step when the monitor's step 0 begins, plus the step)."""

    def __init__(self, trainer):
        if not trainer.loggers:
            raise ValueError("nanscan: NanscanCallback(telemetry='trainer') needs a logger, and this Trainer has none "
                             "(logger=False); give it one (e.g. TensorBoardLogger, CSVLogger) or pass nanscan sinks "
                             "(nanscan.telemetry)")
        self.trainer = trainer
        self.first_step = trainer.global_step

    def write(self, step: int, points: dict) -> None:
        for logger in self.trainer.loggers:
            logger.log_metrics(dict(points), step=self.first_step + step)

    def __repr__(self) -> str:
        return f"TrainerLoggers({[type(lg).__name__ for lg in self.trainer.loggers]})"

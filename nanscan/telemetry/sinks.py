"""The tracker sinks: TensorBoard, W&B, MLflow and nanscan's own JSONL event log (docs/telemetry.md).

Every sink is a callable ``sink(step, scalars)`` that applies the NaN rule itself
(:func:`nanscan.telemetry.scalars.finite_scalars`) before writing, so a sink used on its own is as
safe as one behind a :class:`~nanscan.telemetry.Publisher`. An optional package (``tensorboard``,
``wandb``, ``mlflow``) is imported when its sink is made, never before: ``import nanscan`` stays cheap
and works without any of them; a missing one is an ``ImportError`` naming the package and its pip
command.

Sinks write through every publish (TensorBoard flushes, the event log flushes, MLflow logs
synchronously): the steps just before a failure are the ones a user needs, and a run that dies on a
NaN gives no later chance to flush. ``close()`` releases only what the sink opened itself (a
``SummaryWriter`` made from a path, an ``EventLog`` made from a path); a writer, run or log the caller
passed in stays the caller's to close.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import re
import struct
import time
from typing import Any, Optional

from nanscan.telemetry.scalars import check_step, finite_scalars
from nanscan.warn import warn


def require(module: str, package: str, sink: str):
    """Import ``module`` for the sink named ``sink``; a failure names the pip package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"nanscan.telemetry.{sink} needs the {package!r} package, which could not be imported "
                          f"({e}). Install it with: pip install {package}") from e


def _is_path(target: Any) -> bool:
    return isinstance(target, (str, os.PathLike)) and isinstance(os.fspath(target), str) and bool(os.fspath(target))


class Sink:
    """Base of the sinks: ``sink(step, scalars)`` checks the step, applies the NaN rule and hands
    the finite points to :meth:`write` (nothing is written when no point is left)."""

    def __call__(self, step: int, scalars) -> None:
        step = check_step(step)
        points = finite_scalars(scalars)
        if points:
            self.write(step, points)

    def write(self, step: int, points: dict) -> None:  # pragma: no cover - every sink defines it
        """Write ``points`` (name -> finite float, never empty) for ``step``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Push what was written to its store (sinks that write through need nothing)."""

    def close(self) -> None:
        """Flush, and release what the sink itself opened. Idempotent."""
        self.flush()


_FLOAT32 = struct.Struct("<f")


def _fits_float32(value: float) -> bool:
    # TensorBoard's scalar summaries store float32: a finite float64 beyond its range would be read
    # back as Inf. struct packs with float32 rounding and refuses exactly the values that overflow.
    try:
        _FLOAT32.pack(value)
    except OverflowError:
        return False
    return True


class TensorBoard(Sink):
    """``TensorBoard(log_dir)`` makes (and on ``close`` closes) a ``torch.utils.tensorboard.SummaryWriter``;
    ``TensorBoard(writer)`` writes to a writer you own (any object with ``add_scalar(tag, value, step)``,
    tensorboardX's included; ``flush`` is called when it has one, ``close`` never).

    Every scalar is its own tag (``add_scalar``, not ``add_scalars``, which would make one event
    directory per name). The writer is flushed after each publish. TensorBoard's scalars are float32:
    a finite value beyond float32's range (|x| > 3.4e38) would read back as Inf, so it is not written
    (one warning per sink names the first such tag); ``double_precision=True`` writes float64 tensor
    summaries instead (``add_scalar(..., new_style=True, double_precision=True)``, torch's writer only).
    """

    def __init__(self, log_dir_or_writer, *, double_precision: bool = False):
        target = log_dir_or_writer
        if _is_path(target):
            tensorboard = require("torch.utils.tensorboard", "tensorboard", "TensorBoard")
            self.writer = tensorboard.SummaryWriter(log_dir=os.fspath(target))
            self._owned = True
        elif callable(getattr(target, "add_scalar", None)):
            self.writer = target
            self._owned = False
        else:
            raise TypeError(f"nanscan.telemetry.TensorBoard takes a log directory (str or path) or a SummaryWriter, "
                            f"got {type(target).__name__} {target!r}")
        self.double_precision = bool(double_precision)
        self._warned_range = False
        self._closed = False

    def write(self, step: int, points: dict) -> None:
        if self._closed:  # (torch's SummaryWriter would silently open a new event file)
            raise ValueError(f"nanscan.telemetry: {self!r} is closed")
        add = self.writer.add_scalar
        for tag, value in points.items():
            if self.double_precision:
                add(tag, value, step, new_style=True, double_precision=True)
            elif _fits_float32(value):
                add(tag, value, step)
            elif not self._warned_range:
                self._warned_range = True
                warn(f"nanscan.telemetry.TensorBoard: {tag} = {value!r} at step {step} is beyond float32's range, "
                     f"which TensorBoard scalars store (it would read back as Inf); not written. Values like it "
                     f"are skipped without further warning; TensorBoard(..., double_precision=True) stores float64.",
                     RuntimeWarning, stacklevel=4)
        self.flush()

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if callable(flush) and not self._closed:
            flush()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._owned:
            self.writer.close()

    def __repr__(self) -> str:
        where = getattr(self.writer, "log_dir", None) or getattr(self.writer, "logdir", None)
        return f"TensorBoard({where!r})" if where else f"TensorBoard({type(self.writer).__name__})"


class WandB(Sink):
    """``WandB(run=None)``: ``run.log(points, step=step)`` on ``run``, or on ``wandb.run`` (the run
    ``wandb.init`` started) when ``run`` is None -- made without either, it is a ``RuntimeError``
    naming ``wandb.init``. The run stays yours: ``close`` does not finish it.

    W&B's own step must only grow: a point logged at a step below one the run already logged is
    dropped by W&B (with its warning). When your code also calls ``wandb.log`` without ``step=``
    (the HF Trainer's and Lightning's W&B loggers count their own steps), pass
    ``step_metric="nanscan/step"``: points are then logged as ``{step_metric: step, **points}``
    without ``step=``, and each name is charted against ``step_metric`` (``run.define_metric``).
    """

    def __init__(self, run=None, *, step_metric: Optional[str] = None):
        wandb = require("wandb", "wandb", "WandB")
        if run is None:
            run = wandb.run
            if run is None:
                raise RuntimeError("nanscan.telemetry.WandB: no W&B run is active; call wandb.init(...) before making "
                                   "the sink, or pass run=wandb.init(...)")
        elif not callable(getattr(run, "log", None)):
            raise TypeError(f"nanscan.telemetry.WandB: run must be a W&B run (what wandb.init returns), got "
                            f"{type(run).__name__}")
        if step_metric is not None and (not isinstance(step_metric, str) or not step_metric):
            raise TypeError(f"nanscan.telemetry.WandB: step_metric must be a non-empty str or None, "
                            f"got {step_metric!r}")
        self.run = run
        self.step_metric = step_metric
        self._defined: set = set()

    def write(self, step: int, points: dict) -> None:
        if self.step_metric is None:
            self.run.log(points, step=step)
            return
        for name in points:
            if name not in self._defined:
                self.run.define_metric(name, step_metric=self.step_metric)
                self._defined.add(name)
        self.run.log({self.step_metric: step, **points})

    def __repr__(self) -> str:
        return f"WandB(run={getattr(self.run, 'id', None)!r})"


# MLflow refuses a whole batch over one bad key: names may hold letters, digits, _ - . space / (and
# ':' outside Windows; left out so that a store can move), no empty, "." or ".." path segment, at
# most 250 characters. Module names fit already; anything else is mapped, not refused.
_MLFLOW_BAD = re.compile(r"[^\w./\- ]")
_MLFLOW_MAX_KEY = 250
_MLFLOW_MAX_BATCH = 1000


def mlflow_key(name: str) -> str:
    """``name`` as a key MLflow accepts (unchanged when it already is one)."""
    key = "/".join(seg if seg not in ("", ".", "..") else "_" for seg in _MLFLOW_BAD.sub("_", name).split("/"))
    if len(key) > _MLFLOW_MAX_KEY:
        key = key[:_MLFLOW_MAX_KEY - 9].rstrip("/") + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return key


class MLflow(Sink):
    """``MLflow(run_id=None, tracking_uri=None)``: the points of a publish as one ``log_batch`` of
    metrics (``step=step``, timestamp now; batches of 1000) through an ``MlflowClient``. Without
    ``run_id`` the active run (``mlflow.start_run``) and its tracking URI are taken when the sink is
    made -- with none active it is a ``RuntimeError`` naming ``mlflow.start_run``. A ``run_id`` is
    looked up at once (an unknown one fails here, not at the first publish). MLflow keys allow ``/``;
    a name with characters MLflow refuses is written with ``_`` in their place (:func:`mlflow_key`);
    two names that map to one key: the first is kept, one warning. The run stays yours.
    """

    def __init__(self, run_id: Optional[str] = None, tracking_uri: Optional[str] = None):
        mlflow = require("mlflow", "mlflow", "MLflow")
        entities = require("mlflow.entities", "mlflow", "MLflow")
        tracking = require("mlflow.tracking", "mlflow", "MLflow")
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise RuntimeError("nanscan.telemetry.MLflow: no MLflow run is active; call mlflow.start_run() before "
                                   "making the sink, or pass run_id=")
            run_id = active.info.run_id
            if tracking_uri is None:
                tracking_uri = mlflow.get_tracking_uri()
        elif not isinstance(run_id, str) or not run_id:
            raise TypeError(f"nanscan.telemetry.MLflow: run_id must be a non-empty str, got {run_id!r}")
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._metric = entities.Metric
        self.client = tracking.MlflowClient(tracking_uri)
        self.client.get_run(run_id)
        self._keys: dict = {}
        self._owner: dict = {}
        self._warned_clash = False

    def _key(self, name: str) -> Optional[str]:
        key = self._keys.get(name)
        if key is None:
            key = mlflow_key(name)
            owner = self._owner.setdefault(key, name)
            if owner != name:
                if not self._warned_clash:
                    self._warned_clash = True
                    warn(f"nanscan.telemetry.MLflow: {name!r} and {owner!r} are both {key!r} as MLflow keys; only "
                         f"{owner!r} is written (further clashes are not warned)", RuntimeWarning, stacklevel=5)
                key = ""
            self._keys[name] = key
        return key or None

    def write(self, step: int, points: dict) -> None:
        timestamp = int(time.time() * 1000)
        metrics = []
        for name, value in points.items():  # (a loop, not a comprehension: the clash warning's stacklevel)
            key = self._key(name)
            if key is not None:
                metrics.append(self._metric(key=key, value=value, timestamp=timestamp, step=step))
        for i in range(0, len(metrics), _MLFLOW_MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_MAX_BATCH])

    def __repr__(self) -> str:
        return f"MLflow(run_id={self.run_id!r})"


class JSONL(Sink):
    """``JSONL(path)`` opens (and on ``close`` closes) a :class:`nanscan.EventLog` at ``path`` --
    appended to, never truncated (a path under a file, or a directory, fails here: the log is opened
    when the sink is made); ``JSONL(event_log)`` writes to a log you own (the monitor's, say).
    Each publish is one line through the log's strict-JSON writer::

        {"type": "telemetry", "step": 7, "rank": 0, "time": "...", "scalars": {"nanscan/loss": 2.5, ...}}
    """

    def __init__(self, path_or_log):
        from nanscan.log import EventLog

        if isinstance(path_or_log, EventLog):
            self.log = path_or_log
            self._owned = False
        elif _is_path(path_or_log):
            self.log = EventLog(path_or_log)
            self._owned = True
        else:
            raise TypeError(f"nanscan.telemetry.JSONL takes a file path (str or path) or a nanscan.EventLog, got "
                            f"{type(path_or_log).__name__} {path_or_log!r}")

    def write(self, step: int, points: dict) -> None:
        self.log.event("telemetry", step, scalars=points)

    def close(self) -> None:
        if self._owned:
            self.log.close()

    def __repr__(self) -> str:
        return f"JSONL({str(self.log.path)!r})"

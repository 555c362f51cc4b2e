"""The publisher: one call per telemetry step fans the finite points out to every sink
(docs/telemetry.md).

Training must never stop for telemetry: a sink that raises is warned about once and dropped (the
others keep receiving), and ``close`` warns about a sink that fails to close instead of raising.
Only the caller's own mistakes raise -- a tensor or a string where a number belongs, a step that is
not an int -- because those are bugs at the call site that would otherwise fail silently forever.
"""
from __future__ import annotations

import inspect
import os
import threading
from typing import Any

from nanscan.telemetry.scalars import check_step, finite_scalars
from nanscan.telemetry.sinks import Sink
from nanscan.warn import warn


def describe(sink: Any) -> str:
    """A short name for ``sink`` in messages."""
    if isinstance(sink, Sink):
        return repr(sink)
    name = getattr(sink, "__qualname__", None) or type(sink).__qualname__
    module = getattr(sink, "__module__", None) or type(sink).__module__
    return f"{module}.{name}" if module and module != "builtins" else name


def _hint(obj: Any) -> str:
    if obj == "trainer":
        return (" telemetry='trainer' is an option of the HF Trainer and Lightning callbacks "
                "(nanscan.integrations), which route points through the trainer's loggers.")
    if isinstance(obj, (str, os.PathLike)):
        return (" A path is not a sink: JSONL(path) appends to an event log, "
                "TensorBoard(path) writes an event directory.")
    if callable(getattr(obj, "add_scalar", None)):
        return " Wrap a SummaryWriter: TensorBoard(writer)."
    if callable(getattr(obj, "define_metric", None)):
        return " Wrap a W&B run: WandB(run)."
    if type(obj).__name__ == "EventLog":
        return " Wrap an event log: JSONL(log)."
    if getattr(obj, "__name__", None) in ("wandb", "mlflow"):
        return " Use the sink: WandB() / MLflow() (with a run started)."
    return ""


def check_sink(sink: Any) -> Any:
    """``sink`` if it is one (a nanscan sink, or a callable ``fn(step, scalars)``), else a ``TypeError``
    that says what was passed and what would have worked."""
    if isinstance(sink, Sink):
        return sink
    if isinstance(sink, type):
        raise TypeError(f"nanscan.telemetry: {sink.__qualname__} is a class; pass an instance (e.g. "
                        f"{sink.__qualname__}(...)), or a function fn(step, scalars)")
    if not callable(sink):
        raise TypeError(f"nanscan.telemetry: a sink is a callable fn(step: int, scalars: dict[str, float]) or one of "
                        f"nanscan.telemetry.TensorBoard / WandB / MLflow / JSONL; got {type(sink).__name__} "
                        f"{sink!r}.{_hint(sink)}")
    try:
        signature = inspect.signature(sink)
    except (TypeError, ValueError):  # (some builtins have none: trust them)
        return sink
    try:
        signature.bind(0, {})
    except TypeError:
        raise TypeError(f"nanscan.telemetry: sink {describe(sink)}{signature} "
                        "cannot be called as fn(step, scalars)") from None
    return sink


def _as_list(sinks: Any) -> list:
    if isinstance(sinks, (list, tuple)):
        return list(sinks)
    if sinks is None:
        raise TypeError("nanscan.telemetry.Publisher: no sink given (pass a sink or a list of sinks)")
    return [sinks]


class Publisher:
    """``Publisher(sink_or_sinks)``; ``publish(step, scalars)`` sends the finite points (the NaN rule:
    :func:`nanscan.telemetry.finite_scalars`) to every live sink, each given its own dict, and returns
    the points sent; ``close()`` closes every sink. Usable as a context manager. Thread-safe.

    A sink that raises (an ``Exception``; ``KeyboardInterrupt`` and the like propagate) is warned about
    once, with its error, and dropped: it receives nothing more; :attr:`dropped` lists
    ``(sink, error)``. ``publish`` after ``close`` sends nothing (one warning)."""

    def __init__(self, sinks):
        items = [check_sink(s) for s in _as_list(sinks)]
        if len({id(s) for s in items}) != len(items):
            raise ValueError("nanscan.telemetry.Publisher: the same sink is given twice (it would receive every point "
                             "twice)")
        self._sinks = items
        self.dropped: list = []
        self._closed = False
        self._warned_closed = False
        self._lock = threading.RLock()  # (re-entrant: a sink that publishes must not deadlock)

    @property
    def sinks(self) -> tuple:
        """The sinks that still receive points."""
        return tuple(self._sinks)

    def publish(self, step: int, scalars) -> dict:
        step = check_step(step)
        points = finite_scalars(scalars)
        with self._lock:
            if self._closed:
                if not self._warned_closed:
                    self._warned_closed = True
                    warn("nanscan.telemetry: publish after close; nothing is sent", RuntimeWarning, stacklevel=2)
                return {}
            if not points:
                return points
            for sink in list(self._sinks):
                try:
                    sink(step, dict(points))
                except Exception as error:  # noqa: BLE001 - any failure of a tracker is the tracker's
                    self._drop(sink, error)
        return points

    def _drop(self, sink, error: Exception) -> None:
        self._sinks.remove(sink)
        self.dropped.append((sink, error))
        warn(f"nanscan.telemetry: sink {describe(sink)} raised {type(error).__name__}: {error}; it is dropped (it "
             f"receives no more points) and training continues", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Close every sink, dropped ones included (they may hold files); a failure is warned, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sink in self._sinks + [s for s, _ in self.dropped]:
                close = getattr(sink, "close", None)
                if not callable(close):
                    continue
                try:
                    close()
                except Exception as error:  # noqa: BLE001
                    warn(f"nanscan.telemetry: closing sink {describe(sink)} failed: {type(error).__name__}: {error}",
                         RuntimeWarning, stacklevel=2)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Publisher([{', '.join(describe(s) for s in self._sinks)}])"

"""``nanscan.guard``: when a training step fails, keep the original exception, then try to log and
capture -- and never let a failure of that (disk full, unwritable path, a bug) replace it."""
from __future__ import annotations

import contextlib
import traceback
from typing import Optional


def attach_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` (Python 3.11+) and never raise doing it: an exception whose
    ``__notes__`` is not a list, or that refuses attributes, keeps its identity and message."""
    try:
        exc.add_note(note)
    except Exception:
        pass


def _attach(primary: BaseException, what: str, secondary: BaseException) -> None:
    """Attach a secondary failure to the primary exception without replacing it: a note (Python
    3.11+) with the secondary's type, message and location, and ``primary.nanscan_errors``."""
    where = "".join(traceback.format_exception_only(type(secondary), secondary)).strip()
    attach_note(primary, f"nanscan: {what} failed while handling this error: {where}")
    errors = getattr(primary, "nanscan_errors", None)
    if errors is None:
        errors = []
        try:
            primary.nanscan_errors = errors
        except AttributeError:  # an exception type with __slots__: the note is all we can do
            return
    errors.append(secondary)


@contextlib.contextmanager
def guard(log=None, capture_dir: Optional[str] = None, monitor=None):
    """Context manager around a training step or loop.

    If the body raises, that exception propagates unchanged (same object, type, message and
    traceback). Before it does, nanscan tries (1) to append an ``"exception"`` event to ``log`` (a
    path or an :class:`nanscan.EventLog`, fsynced) with the exception, the step and the incident if
    it is a :class:`nanscan.NonFiniteError`, and (2) when ``capture_dir`` and ``monitor`` are given
    and the monitor has not written a bundle yet, to write one for the failing step
    (``monitor.failing_step``; its batch and pre-step RNG are what the monitor kept: the model's
    forward inputs, or the ``batch`` of ``mon.step(batch)``). Any failure of (1) or (2) is attached to the
    original exception (``add_note`` and ``exc.nanscan_errors``), never raised in its place.
    ``KeyboardInterrupt`` / ``SystemExit`` pass through untouched.
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as primary:
        from nanscan.monitor.incident import NonFiniteError

        # Only nanscan's own error carries an Incident: any other exception's `incident` attribute
        # (a ticket id, a property that raises) is none of our business.
        incident = primary.incident if isinstance(primary, NonFiniteError) else None
        step = incident.step if incident is not None else (monitor.failing_step if monitor is not None else None)
        if log is not None:
            try:
                from nanscan.log import EventLog

                event_log = log if isinstance(log, EventLog) else EventLog(log)
                try:
                    event_log.event("exception", step=step, error_type=type(primary).__name__, message=str(primary),
                                    incident=incident.to_dict() if incident is not None else None,
                                    bundle=getattr(primary, "bundle_path", None), fsync=True)
                finally:
                    if event_log is not log:
                        event_log.close()
            except Exception as secondary:
                _attach(primary, "logging", secondary)
        if capture_dir is not None and monitor is not None and monitor.bundle_path is None:
            try:
                path = monitor.capture(incident=incident, capture_dir=capture_dir, step=step)
                attach_note(primary, f"nanscan wrote the failure bundle: {path}")
            except Exception as secondary:
                _attach(primary, "capture", secondary)
        raise

"""nanscan's warnings, which never become exceptions.

A warning is how nanscan says something without stopping the run: an eval-forward incident, an
incident with ``on_nonfinite="warn"``, a log it could not write. Under ``python -W error`` (or a
``warnings.filterwarnings("error")`` the training script set for its own reasons) ``warnings.warn``
raises instead, and the one thing nanscan promises -- it never stops a run that would have run --
breaks. :func:`warn` goes through ``warnings.warn`` (filters, ``catch_warnings``, pytest's capture
all see it as usual) and, where a filter turned it into an exception, writes it to stderr instead.
"""
from __future__ import annotations

import sys
import warnings


def warn(message: str, category: type = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message, category, stacklevel)``, or the same line on stderr when a filter
    makes warnings errors."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        try:
            sys.stderr.write(f"{category.__name__} (nanscan; shown, not raised): {message}\n")
        except Exception:  # pragma: no cover - a closed stderr must not stop training either
            pass

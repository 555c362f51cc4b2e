"""Scalar names and the NaN rule: what a tracker may be sent (docs/telemetry.md).

**Names.** ``nanscan/<stat>/<name>`` for a statistic of a named tensor (``nanscan/rms/blocks.0.mlp.fc1``),
``nanscan/<stat>`` for a run-wide one (``nanscan/loss``): :func:`scalar_name`.

**The NaN rule** (:func:`finite_scalars`). Trackers mishandle non-finite points in different ways --
W&B drops them, HF's ``logging_nan_inf_filter`` hides the whole step, some backends refuse them -- so
none is ever sent. A finite value ``X`` is sent as is (as a Python float). A non-finite value of
``X`` (NaN, +Inf, -Inf) is never sent: ``X_nonfinite = 1.0`` is sent in its place, so the chart shows
*that* the value broke at that step instead of a gap that looks like a logging hiccup. ``X_nonfinite``
appears only at steps where ``X`` was non-finite (no ``0`` points: they would double every series).
A ``None`` value (a number that was not measured this step) sends nothing.

**Accepted values:** ``int``, ``float``, ``bool`` (as 0 / 1), and any other ``numbers.Real`` (numpy
scalars included). A tensor is a ``TypeError``: reading its value would wait for the device, and
telemetry must never be what synchronizes a training step (the monitor hands plain floats it already
copied to the host; call ``.item()`` yourself where that wait is acceptable). Arrays, strings, complex
numbers: ``TypeError``. Keys must be non-empty strings.
"""
from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Mapping
from typing import Any, Optional

PREFIX = "nanscan"
NONFINITE_SUFFIX = "_nonfinite"


def scalar_name(stat: str, name: Optional[str] = None) -> str:
    """``nanscan/<stat>/<name>``, or ``nanscan/<stat>`` without ``name``. ``stat`` is one path segment
    (no ``/``) so that every tracker groups the series by statistic."""
    if not isinstance(stat, str) or not stat or "/" in stat:
        raise ValueError(f"nanscan.telemetry.scalar_name: stat must be a non-empty str without '/', got {stat!r}")
    if name is None:
        return f"{PREFIX}/{stat}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"nanscan.telemetry.scalar_name: name must be a non-empty str, got {name!r}")
    return f"{PREFIX}/{stat}/{name}"


def nonfinite_name(name: str) -> str:
    """The name that stands for ``name`` at a step where its value was non-finite."""
    return name + NONFINITE_SUFFIX


def _is_tensor(value: Any) -> bool:
    # (torch is only consulted if already imported: a tensor cannot exist otherwise)
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor_error(what: str, value) -> TypeError:
    return TypeError(f"nanscan.telemetry: {what} is a tensor ({value.dtype}, {value.device}); telemetry takes "
                     f"plain numbers so that it never waits for the device. Pass float(x.item()) where that "
                     f"wait is acceptable.")


def check_step(step: Any) -> int:
    """``step`` as an ``int`` >= 0 (ints and numpy integers; bools, floats and tensors are refused)."""
    if _is_tensor(step):
        raise _tensor_error("the step", step)
    if isinstance(step, bool):
        raise TypeError("nanscan.telemetry: the step must be an int, got a bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"nanscan.telemetry: the step must be an int, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"nanscan.telemetry: the step must be >= 0, got {value}")
    return value


def to_float(name: str, value: Any) -> Optional[float]:
    """One value as a Python float (possibly non-finite); ``None`` stays ``None``."""
    if value is None:
        return None
    if _is_tensor(value):
        raise _tensor_error(f"scalar {name!r}", value)
    np = sys.modules.get("numpy")
    if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
        return float(bool(value))
    if not isinstance(value, numbers.Real):
        raise TypeError(f"nanscan.telemetry: scalar {name!r} must be a real number (int, float, bool, numpy "
                        f"scalar) or None, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float: it has no finite float value
        return math.inf if value > 0 else -math.inf


def finite_scalars(scalars: Mapping) -> dict:
    """The points a tracker may receive for ``scalars`` (the module docstring's rule): every value a
    finite Python float, every non-finite ``X`` replaced by ``X_nonfinite = 1.0``. Key order is kept.
    A ``X_nonfinite`` the caller also passed is overridden by the rule's ``1.0`` (the value did break)."""
    if not isinstance(scalars, Mapping):
        raise TypeError(f"nanscan.telemetry: scalars must be a mapping name -> number, got {type(scalars).__name__}")
    out: dict = {}
    broken = []
    isfinite = math.isfinite
    for name, value in scalars.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"nanscan.telemetry: scalar names must be non-empty str, got {name!r}")
        if type(value) is float:  # (the common case, the monitor's points: no conversion to make)
            if isfinite(value):
                out[name] = value
            else:
                broken.append(name)
            continue
        number = to_float(name, value)
        if number is None:
            continue
        if math.isfinite(number):
            out[name] = number
        else:
            broken.append(name)
    for name in broken:
        out[nonfinite_name(name)] = 1.0
    return out

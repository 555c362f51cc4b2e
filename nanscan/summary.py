"""The summary API: records on the device (no host sync) and decoded :class:`TensorSummary`.

``record`` / ``records`` return the raw float64 records as device tensors and never sync the host:
use them inside training steps and ``torch.compile``-d functions. ``summarize`` /
``summarize_many`` decode to Python numbers, which costs exactly one device-to-host copy.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from nanscan import _ops
from nanscan.record import RECORD_SIZE, TensorSummary


def _check_tensor(x, op: str) -> torch.Tensor:
    from nanscan.kernels.reference import normalize_input

    normalize_input(x, op)  # TypeError naming the layout / dtype, before any dispatch
    return x


def record(x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """The float64 ``[8]`` record of ``x`` on ``x.device`` (layout: :class:`nanscan.record.Field`)."""
    _check_tensor(x, "nanscan.record")
    return _ops.kernels(backend, x.device)[0](x)


def records(xs: Sequence[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
    """The ``[len(xs), 8]`` float64 records of ``xs`` (all on one device), in as few launches as the
    backend allows. An empty list gives a ``[0, 8]`` CPU tensor."""
    xs = list(xs)
    for x in xs:
        _check_tensor(x, "nanscan.records")
    devices = {x.device for x in xs}
    if len(devices) > 1:
        raise ValueError(f"nanscan.records: all tensors must be on one device, got {sorted(map(str, devices))}")
    if not xs:  # no tensor, no device: the dispatcher could not route the op
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    return _ops.kernels(backend, xs[0].device)[1](xs)


def _no_meta(x: torch.Tensor, op: str) -> None:
    if x.device.type == "meta":
        raise ValueError(f"{op}: a meta tensor has no values to summarize; use nanscan.record() to get "
                         "a meta record for shape propagation")


def summarize(x: torch.Tensor, backend: Optional[str] = None) -> TensorSummary:
    """Summarize ``x`` in one fused pass and return a :class:`TensorSummary` (one host copy)."""
    _no_meta(_check_tensor(x, "nanscan.summarize"), "nanscan.summarize")
    return TensorSummary.from_record(record(x, backend), x)


def summarize_many(xs: Sequence[torch.Tensor], backend: Optional[str] = None) -> list:
    """Summarize every tensor of ``xs`` (one launch group, one host copy for all of them)."""
    xs = list(xs)
    for x in xs:
        _no_meta(_check_tensor(x, "nanscan.summarize_many"), "nanscan.summarize_many")
    rows = records(xs, backend).tolist()
    return [TensorSummary.from_values(row, x.dtype, x.shape) for row, x in zip(rows, xs)]

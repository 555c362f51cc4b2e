"""The summary API: records on the device (no host sync) and decoded :class:`TensorSummary`.

``record`` / ``records`` return the raw float64 records as device tensors and never sync the host:
use them inside training steps and ``torch.compile``-d functions. ``summarize`` /
``summarize_many`` decode to Python numbers, which costs exactly one device-to-host copy.

DTensors (:mod:`nanscan.sharded`): ``summarize`` / ``summarize_many`` give the summary of the
*global* tensor -- each rank's shard record, combined over the mesh in one small collective per
mesh dimension (records, never the data); ``record`` / ``records`` stay local and sync-free: a
DTensor's record is this rank's contribution (its shard's record, ``first_nonfinite_index`` as a
global index, the neutral record for a replica that is not the first), which
``nanscan.sharded.combine`` turns into the global record.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from nanscan import _ops, sharded
from nanscan.record import RECORD_SIZE, TensorSummary


def _check_tensor(x, op: str) -> torch.Tensor:
    from nanscan.kernels.reference import normalize_input

    normalize_input(x, op)  # TypeError naming the layout / dtype, before any dispatch
    return x


def _explain_refusal(x, op: str, refused: Exception) -> None:
    """After a kernel refused its input: the clear error for ``x`` (what was wrong, what is accepted),
    raised from the kernel's own; nothing if ``x`` passes the check (the caller re-raises)."""
    try:
        _check_tensor(x, op)
    except Exception as clear:
        raise clear from refused


def record(x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """The float64 ``[RECORD_SIZE]`` (10) record of ``x`` on ``x.device`` (layout: :class:`nanscan.record.Field`);
    for a DTensor, this rank's contribution to the global record (module docstring).

    A plain tensor goes straight to the kernel, which checks it (as ``records`` does): only when the
    kernel refuses it is it checked here, to say what was wrong and what is accepted (the kernel's
    own error kept as the cause). The fewer Python steps matter after a large tensor: the record
    streams it through the caches, and every step of the next call's way to the kernel misses (Note
    [the way to the kernel] in nanscan/_ops.py)."""
    if type(x) is not torch.Tensor:  # a subclass (a DTensor, a Parameter) or not a tensor at all
        if sharded.is_dtensor(x):
            return sharded.local_record(x, lambda t: record(t, backend))
        _check_tensor(x, "nanscan.record")
    summarize_one = _ops.record_kernel(backend, x)
    try:
        return summarize_one(x)
    except Exception as refused:
        _explain_refusal(x, "nanscan.record", refused)
        raise


def _as_list(xs, op: str) -> list:
    """``xs`` as a list of tensors. A tensor is refused: iterating it would summarize its rows."""
    if isinstance(xs, torch.Tensor):
        raise TypeError(f"{op} takes a list (or other sequence) of tensors, got a tensor of shape {tuple(xs.shape)}: "
                        f"for one tensor use nanscan.summarize(x) / nanscan.record(x); for its rows, pass list(x)")
    return list(xs)


def records(xs: Sequence[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
    """The ``[len(xs), RECORD_SIZE]`` float64 records of ``xs`` (all on one device), in as few launches as the
    backend allows. An empty list gives a ``[0, RECORD_SIZE]`` CPU tensor.

    No Python work per tensor on the way: the kernels check their inputs (in C++ for the cpu and
    cuda backends). Only when the op refuses the list are the tensors checked here, one by one, to
    say which one is wrong and why (the op's own error is kept as the cause)."""
    xs = _as_list(xs, "nanscan.records")
    if not xs:  # no tensor, no device: the dispatcher could not route the op
        return torch.empty(0, RECORD_SIZE, dtype=torch.float64)
    try:
        return _ops.kernels(backend, xs[0].device)[1](xs)
    except Exception as refused:
        if any(sharded.is_dtensor(x) for x in xs):  # (each DTensor maps its own first index)
            return torch.stack([record(x, backend) for x in xs])
        for x in xs:
            _explain_refusal(x, "nanscan.records", refused)
        devices = {x.device for x in xs}
        if len(devices) > 1:
            raise ValueError(f"nanscan.records: all tensors must be on one device, got "
                             f"{sorted(map(str, devices))}") from refused
        raise


def _no_meta(x: torch.Tensor, op: str) -> None:
    if x.device.type == "meta":
        raise ValueError(f"{op}: a meta tensor has no values to summarize; use nanscan.record() to get "
                         "a meta record for shape propagation")


def summarize(x: torch.Tensor, backend: Optional[str] = None) -> TensorSummary:
    """Summarize ``x`` in one fused pass and return a :class:`TensorSummary` (one host copy). For a
    DTensor: the global tensor's summary, combined over its mesh (a collective: every rank of the
    mesh calls it)."""
    if sharded.is_dtensor(x):
        rec = sharded.combine(record(x, backend).unsqueeze(0), x.device_mesh)[0]
        return TensorSummary.from_values(rec.tolist(), x.dtype, x.shape)
    _no_meta(_check_tensor(x, "nanscan.summarize"), "nanscan.summarize")
    return TensorSummary.from_record(record(x, backend), x)


def summarize_many(xs: Sequence[torch.Tensor], backend: Optional[str] = None) -> list:
    """Summarize every tensor of ``xs`` (one launch group, one host copy for all of them). DTensors
    get their global summaries, combined in one collective per mesh dimension for all of them
    (they must share one mesh; every rank of it calls this with the same list)."""
    xs = _as_list(xs, "nanscan.summarize_many")
    shards = [k for k, x in enumerate(xs) if sharded.is_dtensor(x)]
    for k, x in enumerate(xs):
        if k not in shards:
            _no_meta(_check_tensor(x, "nanscan.summarize_many"), "nanscan.summarize_many")
    rows = records(xs, backend)
    if shards:
        meshes = {xs[k].device_mesh for k in shards}
        if len(meshes) > 1:
            raise ValueError(f"nanscan.summarize_many: the DTensors are on {len(meshes)} different device meshes; "
                             "summarize each mesh's tensors in a call of their own")
        index = torch.tensor(shards, device=rows.device)
        rows = rows.index_copy(0, index, sharded.combine(rows[index], meshes.pop()))
    rows = rows.tolist()
    return [TensorSummary.from_values(row, x.dtype, x.shape) for row, x in zip(rows, xs)]

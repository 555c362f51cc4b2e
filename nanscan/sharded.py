"""Summaries of DTensors: the summary of the *global* tensor, from records of its shards.

A DTensor is spread over the ranks of a device mesh: along each mesh dimension its placement is
``Shard(d)`` (each rank holds a block of tensor dimension ``d``), ``Replicate()`` (each rank holds
the same values) or ``Partial`` (each rank holds an addend). The summary of the global tensor
combines the records of the pieces without moving any data:

* NaN / +Inf / -Inf / zero counts and the sums (of squares, values, fourth powers) add over the
  shards -- each value is counted once: along a ``Replicate`` mesh dimension only the rank at
  coordinate 0 contributes, the others give the neutral record (no element: counts and sums 0,
  finite min +inf, max -inf, no index);
* the finite min / max are the min / max over the shards;
* ``first_nonfinite_index`` is the index into the global tensor in logical row-major order: each
  rank maps its shard's first index to global coordinates (its block offset, from DTensor's own
  ``compute_local_shape_and_global_offset``) -- a block of a row-major array keeps the global
  order, so the global first is the smallest of the mapped ones;
* ``Partial`` placements are refused: addends are not values, and the summary of a sum cannot be
  made from the summaries of its addends.

:func:`local_record` (no collective, no host sync) is what ``nanscan.record(dt)`` /
``nanscan.records`` return for a DTensor; :func:`combine` is one ``all_gather`` of the
``[n, RECORD_SIZE]`` records per mesh dimension (a 1-D mesh: one collective for a whole list), which
``nanscan.summarize(dt)`` / ``summarize_many`` do before decoding. Each sum (of squares, values,
fourth powers) is each shard's FP32-accumulated sum, added in float64.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from nanscan.record import RECORD_SIZE, Field


def dtensor_type():
    """The DTensor class, or None while ``torch.distributed.tensor`` is not imported -- then no
    tensor can be one, and nanscan does not import it (0.4 s) to find that out."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(x) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def neutral_record(device) -> torch.Tensor:
    """The record of no element: what a duplicate replica (or a rank outside the mesh) contributes."""
    rec = torch.zeros(RECORD_SIZE, dtype=torch.float64, device=device)
    rec[Field.FINITE_MIN] = math.inf
    rec[Field.FINITE_MAX] = -math.inf
    rec[Field.FIRST_NONFINITE] = -1.0
    return rec


def local_record(dt, record_one: Callable[[torch.Tensor], torch.Tensor], op: str = "nanscan.record") -> torch.Tensor:
    """This rank's contribution to the record of the global tensor ``dt`` (see the module
    docstring): its shard's record with ``first_nonfinite_index`` as a global index, or the neutral
    record for a replica that is not the first. Device ops only: no collective, no host sync."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = dt.device_mesh, dt.placements
    bad = [p for p in placements if not isinstance(p, (Shard, Replicate))]
    if bad:
        raise ValueError(f"{op}: a DTensor with a Partial placement ({bad[0]}) holds addends of the global tensor, "
                         "not its values, so its summary cannot be combined from the ranks' records. Redistribute it "
                         "to Shard / Replicate first (dt.redistribute(mesh, [Replicate()]) sums the addends), or "
                         "summarize dt.to_local() for what this rank holds")
    local = dt._local_tensor
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(isinstance(p, Replicate) and coordinate[d] != 0 for d, p in enumerate(placements)):
        return neutral_record(local.device)
    rec = record_one(local)
    if not any(isinstance(p, Shard) for p in placements):
        return rec
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    global_shape = tuple(dt.shape)
    if dt.dtype.is_complex:  # summarized as view_as_real: a trailing dimension of 2
        local_shape, offset, global_shape = tuple(local_shape) + (2,), tuple(offset) + (0,), global_shape + (2,)
    first = rec[Field.FIRST_NONFINITE]
    rest = first.clamp(min=0)
    index = torch.zeros_like(first)
    for k in range(len(global_shape)):
        local_stride = math.prod(local_shape[k + 1:])
        coord = torch.floor(rest / local_stride)
        rest = rest - coord * local_stride
        index = index + (coord + offset[k]) * math.prod(global_shape[k + 1:])
    rec = rec.clone()
    rec[Field.FIRST_NONFINITE] = torch.where(first >= 0, index, first)
    return rec


def combine(rows: torch.Tensor, mesh) -> torch.Tensor:
    """Every rank's ``[n, RECORD_SIZE]`` contributions (:func:`local_record`) combined into the records of
    the global tensors, on every rank of ``mesh``: one ``all_gather`` per mesh dimension."""
    import torch.distributed as dist

    rows = rows.contiguous()
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, rows, group=group)
        rows = combine_stacked(torch.stack(gathered))
    return rows


def combine_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """``[pieces, n, RECORD_SIZE]`` contributions -> ``[n, RECORD_SIZE]``: counts and sums (of squares,
    values, fourth powers) add, min / max, and the smallest global first index (-1 where no piece
    has one)."""
    out = stacked.sum(dim=0)
    out[:, Field.FINITE_MIN] = stacked[:, :, Field.FINITE_MIN].amin(dim=0)
    out[:, Field.FINITE_MAX] = stacked[:, :, Field.FINITE_MAX].amax(dim=0)
    first = stacked[:, :, Field.FIRST_NONFINITE]
    found = torch.where(first >= 0, first, math.inf).amin(dim=0)
    out[:, Field.FIRST_NONFINITE] = torch.where(torch.isfinite(found), found, -1.0)
    return out

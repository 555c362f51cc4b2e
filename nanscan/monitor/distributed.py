"""torch.distributed support: every rank learns of an incident in the same step, and records can
be combined across ranks.

"First rank" means the rank whose incident has the smallest (step, phase) -- ranks run the same
steps, so that is the one that went non-finite first in training order. Within one (step, phase) a
rank whose incident says produced / propagated goes before one that cannot tell (a parameter
gradient reduced across ranks -- data parallel, FSDP -- may hold another rank's non-finite
contribution: ``produced=None`` there); then the lowest rank (ranks are not clocks: nanscan does
not compare wall times across machines).

Sharded models (FSDP2 ``fully_shard``, tensor parallelism): parameters, their gradients and
optimizer state are DTensors; the monitor summarizes each rank's local shard (:func:`local_shards`),
never an all-gather of the data, so a parameter incident's summary and shape are that rank's
shard's. Call ``watch`` after ``fully_shard`` (it replaces the parameters).
"""
from __future__ import annotations

from typing import Optional

import torch

from nanscan.record import Field
from nanscan.sharded import dtensor_type, is_dtensor
from nanscan.vocabulary import PHASE_ORDER


def has_dtensors(tensors) -> bool:
    """Whether any of ``tensors`` is a DTensor (FSDP2's sharded parameters, tensor parallelism)."""
    return any(is_dtensor(t) for t in tensors)


def local_shards(tensors: list) -> list:
    """The shard this rank holds of each DTensor in ``tensors`` (other tensors as they are).

    The monitor summarizes parameters, gradients and optimizer state of a sharded model
    shard-locally: never an all-gather of the data, and every rank's incident describes its own
    shard (its summary counts and shape are the shard's). ``_local_tensor`` rather than
    ``to_local()``: the same tensor without a differentiable view and DTensor's per-call
    dispatch, hundreds of times per step."""
    dtensor = dtensor_type()
    return [t._local_tensor if isinstance(t, dtensor) else t for t in tensors]


_AVAILABLE = torch.distributed.is_available()  # (fixed by the build: asked once, not at every read)
# What torch.distributed.is_initialized() reads (GroupMember.WORLD, a metaclass property, returns
# _world.default_pg, a property returning _world._default_pg), read directly where this torch has it
# (the module's global at every call, as torch reads it). Every read asks active() first, fetched
# cold after the step: its three Python calls took 8.5 -- 10.1 us as a read began beside 160 layers,
# the direct read 2.2 -- 3.0 (benchmarks/read_cost.py, "a cold call").
_C10D = None
if _AVAILABLE:
    _C10D = torch.distributed.distributed_c10d
    if not hasattr(getattr(_C10D, "_world", None), "_default_pg"):
        _C10D = None  # (another layout: the public calls)


def active() -> bool:
    """More than one process in the default process group."""
    if _C10D is not None:
        return _C10D._world._default_pg is not None and torch.distributed.get_world_size() > 1
    return _AVAILABLE and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def rank() -> int:
    return torch.distributed.get_rank()


def _device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo / mpi take CPU tensors.
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


RANK_BITS = 20  # ranks below 2**20 (about a million)
NO_INCIDENT = (1 << 63) - 1


def _when(local) -> int:
    """(step, phase) of an incident as one int64, smaller = earlier; ``NO_INCIDENT`` for none."""
    return NO_INCIDENT if local is None else int(local.step) * len(PHASE_ORDER) + PHASE_ORDER[local.phase]


def _which(local, rank: int) -> int:
    """(production order, cannot tell, rank) of an incident as one int64, smaller = first."""
    order = min(int(local.order), (1 << 41) - 1)
    return (((order << 1) | int(local.produced is None)) << RANK_BITS) | rank


def _min_all(value: int) -> int:
    dist = torch.distributed
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())  # host copy: once per checked step, like the records


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank (one all_reduce of one int64)."""
    return _min_all(0 if flag else 1) == 0


def agree(local):
    """Collective: every rank passes its own first incident to raise (or None) and gets back the
    one every rank will report, or None: the earliest (step, phase); among the ranks with that one,
    the earliest in production order (a collective -- a tensor-parallel all-reduce, a gradient
    reduce-scatter -- spreads a fault to every rank, but the rank that made it records it first),
    then one that can tell produced / propagated, then the lowest rank.

    Cost: one ``all_reduce(MIN)`` of one int64 per checked step -- 8 bytes per rank whatever the
    world size (a tree or ring reduction: O(log world) latency). Only when some rank has an
    incident: one more such all_reduce (which rank) and one broadcast of that incident."""
    dist = torch.distributed
    rank = dist.get_rank()
    when = _when(local)
    first = _min_all(when)
    if first == NO_INCIDENT:
        return None
    src = _min_all(_which(local, rank) if when == first else NO_INCIDENT) & ((1 << RANK_BITS) - 1)
    box = [local if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_records(rows: torch.Tensor, group=None, mesh_dim: Optional[int] = None):
    """Combine ``[n, RECORD_SIZE]`` records of the same n tensors' shards across ranks, in one
    collective (an all_gather; the combination is local): counts and sums (of squares, values,
    fourth powers) add, finite min / max take the min / max. first_nonfinite_index comes from the
    lowest rank that has a non-finite element -- the first one in the concatenation of shards in
    rank order -- and is an index into that rank's shard. Returns ``(combined [n, RECORD_SIZE],
    rank_of_first [n] int64, -1 where none)``; ranks are numbered within the group. ``group``: a
    process group (default: the whole world) or a ``DeviceMesh`` with ``mesh_dim`` (its process
    group along that dimension; a 1-D mesh needs none). For the summary of a DTensor's global
    tensor use ``nanscan.summarize(dt)``, which maps first indices to the global tensor
    (:mod:`nanscan.sharded`)."""
    dist = torch.distributed
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"nanscan.all_reduce_records: a {group.ndim}-D DeviceMesh needs mesh_dim= (which "
                             "dimension's ranks to combine over)")
        group = group.get_group(mesh_dim or 0)
    elif mesh_dim is not None:
        raise ValueError("nanscan.all_reduce_records: mesh_dim= goes with a DeviceMesh as group=")
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, rows.contiguous(), group=group)
    stacked = torch.stack(gathered)  # [world, n, RECORD_SIZE]
    out = stacked.sum(dim=0)
    out[:, Field.FINITE_MIN] = stacked[:, :, Field.FINITE_MIN].amin(dim=0)
    out[:, Field.FINITE_MAX] = stacked[:, :, Field.FINITE_MAX].amax(dim=0)
    first = stacked[:, :, Field.FIRST_NONFINITE]  # [world, n]
    has = first >= 0
    world = torch.arange(first.shape[0], device=first.device).unsqueeze(1).expand_as(first)
    rank_of_first = torch.where(has, world, first.shape[0]).amin(dim=0)
    found = rank_of_first < first.shape[0]
    index = first.gather(0, rank_of_first.clamp(max=first.shape[0] - 1).unsqueeze(0)).squeeze(0)
    out[:, Field.FIRST_NONFINITE] = torch.where(found, index, -1.0)
    return out, torch.where(found, rank_of_first, -1)


def telemetry_plan(interval: int) -> tuple:
    """Collective, at ``watch``: every rank passes its telemetry interval (0: no sinks) and gets
    ``(publishing rank, interval)`` -- the lowest rank with sinks publishes, every rank contributes
    its records (one that has no sinks too: the gather needs every rank), ``(-1, 0)`` when no rank
    has sinks. Ranks with sinks must agree on the interval: a ``ValueError`` on every rank otherwise."""
    dist = torch.distributed
    intervals = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=_device())
    mine = torch.tensor([interval], dtype=torch.int64, device=_device())
    dist.all_gather_into_tensor(intervals, mine)
    intervals = intervals.tolist()  # (once, at watch)
    on = [(rank, n) for rank, n in enumerate(intervals) if n]
    if not on:
        return -1, 0
    if len({n for _, n in on}) > 1:
        raise ValueError(f"nanscan.watch: ranks disagree on telemetry_every ({dict(on)}, by rank): every rank must "
                         "use the same (telemetry points are combined across ranks)")
    return on[0][0], on[0][1]


def param_sharing(named_params) -> dict:
    """How this rank's copy of each parameter (and its gradient) adds to the global tensor, for
    telemetry's global numbers: ``"plain"`` -- a plain tensor, taken to be replicated on every rank
    (data parallel; checked when combined: ranks that differ make its numbers unknown); ``"counted"``
    -- a DTensor shard this rank counts (its coordinate is 0 on every ``Replicate`` mesh dimension);
    ``"replica"`` -- a DTensor shard another rank counts for it; ``"unknown"`` -- a ``Partial``
    placement (a pending sum: the norm of a sum is not the sum of norms) or a mesh that does not
    cover every rank (replicas outside it cannot be told from other models)."""
    dtensor = dtensor_type()
    world = torch.distributed.get_world_size()
    out = {}
    for name, p in named_params:
        if dtensor is None or not isinstance(p, dtensor):
            out[name] = "plain"
            continue
        mesh, placements = p.device_mesh, p.placements
        coordinate = mesh.get_coordinate()
        if mesh.size() != world or coordinate is None or any(pl.is_partial() for pl in placements):
            out[name] = "unknown"
        elif all(coordinate[d] == 0 for d, pl in enumerate(placements) if pl.is_replicate()):
            out[name] = "counted"
        else:
            out[name] = "replica"
    return out


def gather_to(payload, dst: int):
    """Collective: every rank's ``payload`` (picklable) to rank ``dst`` as a list by rank; None on
    the other ranks."""
    dist = torch.distributed
    box = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(payload, box, dst=dst)
    return box

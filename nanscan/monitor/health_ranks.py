"""Telemetry's global numbers under torch.distributed: what every rank sends, and how the publishing
rank combines it. Pure functions over host numbers (no tensor data crosses ranks, no collective
here: :mod:`nanscan.monitor.health` gathers).

Note [global telemetry]: what a number means when the ranks' numbers are combined.

* A module's output: each rank's output is of its own batch (data parallel, FSDP) -- the global
  tensor is their concatenation: finite and zero counts and sums of squares add, maxima take the
  max. ``rms``, ``amax``, ``zero_frac`` and ``headroom_bits`` are then exact whether the ranks'
  outputs are distinct or replicated (tensor parallelism: a replicated output scales every sum
  alike); the ``nonfinite`` count is summed over the ranks' copies (a replicated output counts once
  per rank).
* A parameter and its gradient: by its sharing on this rank (:func:`~nanscan.monitor.distributed.param_sharing`).
  DTensor shards (FSDP2, tensor parallelism) add up over the ranks that count them (one per set of
  replicas); a plain tensor is taken to be replicated on every rank (DDP) and the ranks' numbers are
  compared: when they differ it was not, and its numbers cannot be known. A ``Partial`` placement,
  a mesh that does not cover every rank, or plain tensors beside DTensors of one name: unknown.
  Unknown numbers are left out of the point (one warning names them), never guessed.
* Per step: ``loss`` is the mean of the ranks' losses (the global batch's, for equal per-rank
  batches and a mean loss; non-finite on any rank: ``loss_nonfinite``); ``loss_scale`` and
  ``updates_skipped`` are the publishing rank's (GradScaler's state is the same on every rank);
  ``nonfinite`` is summed over the ranks' records; ``grad_norm`` is, for a model with replicated
  gradients or when ``clip_grad_norm_`` returned the total norm, the value every rank has (checked:
  ranks that differ leave it out), and for a sharded model that was not clipped the square root of
  the ranks' counted shares.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from nanscan.warn import warn

__all__ = ["RankPlan", "combine"]


@dataclasses.dataclass
class RankPlan:
    """One rank's part in global telemetry: its rank, the publishing rank, each parameter's sharing
    (``distributed.param_sharing``) and whether the model is sharded (DTensor parameters)."""

    rank: int
    publisher: int
    sharing: dict
    sharded: bool
    unknown_warned: set = dataclasses.field(default_factory=set)  # names already warned about


def combine(payloads: list, *, publisher: int, sharded: bool, names: Optional[set] = None) -> tuple:
    """``(raw, counts, values)`` of the global point from every rank's payload (by rank):
    ``{"raw": {scalar names: raw numbers}, "counts": {name: (count, kind)}, "step": {...},
    "clipped": bool, "grad_contrib": float or None}``. ``names``: tensor scalar names already warned
    about as unknown (the set is updated; None: no warnings)."""
    unknown: list = []
    raw: dict = {}
    keys: dict = {}
    for payload in payloads:
        for key in payload["raw"]:
            keys.setdefault(key, None)
    for key in keys:
        entries = [p["raw"].get(key) for p in payloads]
        present = [e for e in entries if e is not None]
        if len(present[0]) == 6:  # a module output
            raw[key] = (sum(e[0] for e in present), sum(e[1] for e in present), sum(e[2] for e in present),
                        sum(e[3] for e in present), _max(e[4] for e in present), present[0][5])
            continue
        combined = _param(entries)
        if combined is None:
            unknown.append(key[0])
        else:
            raw[key] = combined
    counts: dict = {}
    count_names: dict = {}
    for payload in payloads:
        for name in payload["counts"]:
            count_names.setdefault(name, None)
    for name in count_names:
        entries = [p["counts"].get(name) for p in payloads]
        count = _count(entries)
        if count is None:
            unknown.append(name)
        else:
            counts[name] = count
    values = _step_values(payloads, payloads[publisher]["step"], sharded)
    if values["grad_norm"] is _UNKNOWN:
        values["grad_norm"] = None
        unknown.append("nanscan/grad_norm")
    if names is not None:
        new = [n for n in unknown if n not in names]
        if new:
            names.update(new)
            warn(f"nanscan: telemetry across ranks left out {len(new)} number(s) that cannot be known from the ranks' "
                 f"records (a plain tensor that differs across ranks, a Partial placement, a mesh that does not "
                 f"cover every rank): {', '.join(new[:5])}{' ...' if len(new) > 5 else ''}", RuntimeWarning,
                 stacklevel=2)
    return raw, counts, values


_UNKNOWN = object()


def _max(values):
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _param(entries: list) -> Optional[tuple]:
    """A parameter's (or gradient's) global ``(finite, sumsq, amax, sharing)``, or None: unknown."""
    present = [e for e in entries if e is not None]
    kinds = {e[3] for e in present}
    if kinds == {"plain"}:
        if len(present) != len(entries) or len({e[:3] for e in present}) != 1:
            return None  # not on every rank, or different: not replicated
        return present[0]
    if not kinds <= {"counted", "replica"}:
        return None
    counted = [e for e in present if e[3] == "counted"]
    if not counted:
        return None
    return (sum(e[0] for e in counted), sum(e[1] for e in counted), _max(e[2] for e in counted), "counted")


def _count(entries: list) -> Optional[int]:
    """A tensor's non-finite count over the ranks (entries ``(count, kind)`` or None for 0), or None."""
    kinds = {e[1] for e in entries if e is not None}
    counts = [e[0] if e is not None else 0 for e in entries]
    if kinds == {"activation"}:
        return sum(counts)
    if kinds == {"plain"}:
        return counts[0] if len(set(counts)) == 1 else None
    if kinds <= {"counted", "replica"}:
        return sum(e[0] for e in entries if e is not None and e[1] == "counted")
    return None


def _step_values(payloads: list, publisher: dict, sharded: bool) -> dict:
    losses = [p["step"]["loss"] for p in payloads if p["step"]["loss"] is not None]
    loss = None
    if losses:
        loss = math.nan if any(not math.isfinite(v) for v in losses) else sum(losses) / len(losses)
    norms = [p["step"]["grad_norm"] for p in payloads]
    clipped = all(p["clipped"] for p in payloads)
    if all(v is None for v in norms):
        grad_norm = None  # (no gradient in the step, or clipped by another norm than L2)
    elif any(v is not None and not math.isfinite(v) for v in norms):
        grad_norm = math.nan if any(v != v for v in norms if v is not None) else math.inf
    elif sharded and not clipped:
        contribs = [p["grad_contrib"] for p in payloads]
        grad_norm = math.sqrt(sum(contribs)) if None not in contribs else _UNKNOWN
    else:
        grad_norm = norms[0] if len(set(norms)) == 1 else _UNKNOWN
    return {"loss": loss, "grad_norm": grad_norm, "loss_scale": publisher["loss_scale"],
            "updates_skipped": publisher["updates_skipped"],
            "nonfinite": sum(p["step"]["nonfinite"] for p in payloads)}

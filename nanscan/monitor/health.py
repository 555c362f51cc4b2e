"""Health telemetry: every module's numbers, every ``telemetry_every`` steps, from the records the
monitor reads anyway -- no extra kernel, no extra host sync, nothing inside compiled graphs.

:class:`Health` is given every decoded training read (:meth:`observe`), and, by the step log
(:mod:`nanscan.monitor.steplog`), every checked step once all its records are in (:meth:`step_done`,
in step order, parameters after the update included). At a telemetry step it publishes, through a
:class:`nanscan.telemetry.Publisher` (so the NaN rule applies: no NaN or Inf is ever sent):

per module output (``<name>`` = the module path; a module called twice in the step: its last call;
an output changed in place before it was summarized -- its record is of a later value -- is left out)
    ``rms``, ``amax``, ``zero_frac`` -- over the finite elements --, ``headroom_bits`` (log2 of its
    dtype's largest value over ``amax``) and ``nonfinite`` (a count, see below);
per parameter (``<name>`` = the parameter path), after the step's update, and its gradient
    ``param_norm``, ``param_amax``, ``grad_norm``, ``grad_amax`` (over the finite elements) and
    ``param_nonfinite``, ``grad_nonfinite``;
per step (no ``<name>``)
    ``loss``, ``grad_norm`` (before clipping, as the step log), ``loss_scale``, ``updates_skipped``
    (running count), ``nonfinite`` (non-finite values in the step's records), ``headroom_bits`` (the
    least of the tensors above).

Counts (``nonfinite``, per tensor and per step) add up every checked step since the last telemetry
point, so a NaN between two points is never lost; norms and maxima are of the telemetry step. A
tensor's count is sent only when it is not 0 (the per-step ``nonfinite`` is always sent): a model
sends its per-tensor statistics and no series of zeros.
Which tensors: ``telemetry_names`` (fnmatch patterns of names; default every one): 4 scalars per
module output and 4 per parameter (two for it, two for its gradient), so a 200-layer model sends about
2,400 per point; ``telemetry_names=["*.layers.0.*", "lm_head*"]`` or a larger ``telemetry_every``
keep a large model's trackers small.

Under torch.distributed (more than one rank) the points are global: at a telemetry step every rank
sends its host numbers of the step (sums of squares, finite and zero counts, maxima, counts; no
tensor data) to the publishing rank in one gather, which combines them (:mod:`~nanscan.monitor.health_ranks`
says how, and when a number cannot be known and is left out) and alone publishes.
"""
from __future__ import annotations

import math
from typing import Optional

from nanscan.allow import name_allowed
from nanscan.monitor import distributed
from nanscan.monitor.headroom import max_of
from nanscan.monitor.health_ranks import RankPlan, combine
from nanscan.monitor.consumers import ReadConsumer, StepListener
from nanscan.monitor.slots import EagerRows, GradBlock, Slot
from nanscan.record import Field
from nanscan.telemetry.scalars import PREFIX, scalar_name
from nanscan.warn import warn

__all__ = ["Health"]

_NAN, _POSINF, _NEGINF, _ZERO = Field.NAN_COUNT, Field.POSINF_COUNT, Field.NEGINF_COUNT, Field.ZERO_COUNT
_MIN, _MAX_FIELD, _SUMSQ = Field.FINITE_MIN, Field.FINITE_MAX, Field.SUMSQ


def make_health(config, model) -> Optional["Health"]:
    """The monitor's :class:`Health`, or None when telemetry is off. Under torch.distributed this
    is a collective (:func:`~nanscan.monitor.distributed.telemetry_plan`, at ``watch``): every rank
    contributes when any rank has sinks, and the lowest rank with sinks publishes."""
    from nanscan.telemetry import Publisher

    interval = config.telemetry_interval if config.telemetry is not None else 0
    if not distributed.active():
        return Health(Publisher(config.telemetry), interval, config.every, config.telemetry_names) if interval else None
    publisher, interval = distributed.telemetry_plan(interval)
    if not interval:
        return None
    rank = distributed.rank()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = RankPlan(rank, publisher, distributed.param_sharing(named), distributed.has_dtensors(p for _, p in named))
    sinks = Publisher(config.telemetry) if config.telemetry is not None else None
    return Health(sinks if rank == publisher else None, interval, config.every, config.telemetry_names, ranks=plan,
                  idle_sinks=sinks if rank != publisher else None)


class Health(ReadConsumer, StepListener):
    """Collects and publishes the telemetry points of one monitor (see the module docstring): a
    consumer of every training read and a listener of the step log's completed steps."""

    what = "telemetry"

    def __init__(self, publisher, every: int, lag: int, names: tuple = ("*",), ranks: Optional[RankPlan] = None,
                 idle_sinks=None):
        # lag: steps between two checked steps (a read holds the last one's parameters after the update)
        # publisher None: this rank only contributes its numbers to the publishing rank (ranks)
        self.publisher, self.every, self.lag = publisher, every, lag
        self.names = None if tuple(names) == ("*",) else tuple(names)  # (None: every name)
        self.ranks = ranks  # (None: one process)
        self._idle_sinks = idle_sinks  # (a rank that does not publish: its own sinks, closed with the monitor)
        # Under torch.distributed a failure does not drop telemetry on one rank alone (the others would
        # wait in the gather): the rank keeps gathering, and nothing more is published anywhere.
        self.failed = False
        # telemetry step -> {scalar names of a tensor: its raw numbers}: (numel, finite, sumsq, zeros,
        # amax, dtype max) for a module output, (finite, sumsq, amax, sharing) for a parameter or gradient
        self._raw: dict = {}
        self._counts: dict = {}  # step -> {scalar name: its non-finite values} since the last point
        self._count_kind: dict = {}  # count's scalar name -> "activation" or the parameter's sharing
        self._grad_contrib: dict = {}  # telemetry step -> this rank's share of the squared gradient norm
        self._step_nonfinite = 0  # ... in every record of the checked steps since the last point
        self._skipped = 0  # updates skipped so far (running)
        self._unpublished = None  # (step, values, clipped) of the last complete step not published
        # (prefix, tensor name) -> its scalar names: the statistics', then its non-finite count's; ()
        # when telemetry_names leaves it out. Made once per tensor (every point has the same names).
        self._names: dict = {}

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def wants_read(self, read) -> bool:
        """``read`` holds records of a telemetry step: its own, or the last checked step's parameters
        after the update. (That step is the last multiple of ``lag`` before the read's: one ``lag``
        back for the read of a checked step, less for the read at ``close`` after an unchecked one.)"""
        return self.wants(read.step) or self.wants((read.step - 1) // self.lag * self.lag)

    def wants_numbers(self, read) -> bool:
        return self.wants_read(read)

    def observe(self, read) -> None:
        """One decoded training :class:`~nanscan.monitor.read.Read`: the non-finite counts of its
        rows (only the non-finite rows are looked at), and, when it holds records of a telemetry
        step -- its own step's, or the previous checked step's parameters after the update --, the
        statistics of those (from the host records in one conversion, rows described without
        making a Slot of each)."""
        if self.failed or not read.training:
            return
        bad = read.bad
        if not self.wants_read(read):
            for i in sorted(bad):
                slot = read.slot(i)
                if slot.step is not None:
                    self._row(slot.kind, slot.phase, slot.candidate, slot.param, slot.name, slot.dtype,
                              math.prod(slot.shape), slot.step, read.values(i), True)
            return
        host = read.host_rows()
        n = len(host)
        for start, end, s in read.runs():
            t = type(s)
            if t is EagerRows:
                for i in range(start, end):
                    self._eager_row(s, i, host[i], i in bad)
            elif t is Slot:
                if s.step is not None and not s.stale:
                    self._row(s.kind, s.phase, s.candidate, s.param, s.name, s.dtype, math.prod(s.shape), s.step,
                              host[start] if start < n else read.values(start), start in bad)
            elif t is not GradBlock:  # (gradients of module outputs: not sent)
                if (s.kind == "grad" and s.param is not None) or (s.kind == "param" and s.phase == "update"):
                    names, tensors, kind, phase, param = s.names, s.tensors, s.kind, s.phase, s.param
                    block_step, first = s.step, s.start
                    for j in range(start, end):
                        t_ = tensors[j - first]
                        self._row(kind, phase, True, param, names[j - first], t_.dtype, t_.numel(), block_step,
                                  host[j] if j < n else read.values(j), j in bad)

    def _eager_row(self, rows: EagerRows, i: int, v, bad: bool) -> None:
        row = rows.module_output(i)
        if row is not None:
            step, phase, candidate, name, dtype, numel = row
            self._row("activation", phase, candidate, None, name, dtype, numel, step, v, bad)

    def _row(self, kind, phase, candidate, param, name, dtype, numel, step, v, bad: bool) -> None:
        # (Runs for every row of a telemetry step: ~1,000 rows for a 200-layer model, so it is kept
        # tight -- one cached tuple of scalar names per tensor, no per-statistic dispatch.)
        if kind == "activation":
            if phase != "forward" or not candidate:
                return
            prefix = ""
        elif kind == "grad":
            if param is None:
                return
            prefix = "grad_"
        elif kind == "param":
            if phase != "update":
                return
            prefix = "param_"
        else:
            return
        point = step % self.every == 0
        if not bad and not point:
            return
        if dtype is not None and dtype.is_complex:  # (its record is of the real view: two numbers each)
            numel *= 2
        sharing = None
        if prefix and self.ranks is not None:
            sharing = self.ranks.sharing.get(name, "plain")
            if point and prefix == "grad_":
                self._add_grad_contrib(step, sharing, v[_SUMSQ])
        key = (prefix, name)
        names = self._names.get(key)
        if names is None:
            if self.names is not None and not name_allowed(name, self.names):
                names = self._names[key] = ()
            else:
                stats = ("rms", "amax", "zero_frac", "headroom_bits") if not prefix else ("norm", "amax")
                names = self._names[key] = tuple(f"{PREFIX}/{prefix}{stat}/{name}" for stat in stats + ("nonfinite",))
                self._count_kind[names[-1]] = sharing if (prefix and sharing) else "activation"
        if not names:
            return
        count = int(v[_NAN] + v[_POSINF] + v[_NEGINF]) if bad else 0
        if count:
            counts = self._counts.setdefault(step, {})
            counts[names[-1]] = counts.get(names[-1], 0) + count
        if not point:
            return
        raw = self._raw.get(step)
        if raw is None:
            raw = self._raw[step] = {}
        finite = numel - count
        if finite > 0:
            lo, hi = v[_MIN], v[_MAX_FIELD]
            amax = hi if hi >= -lo else -lo
        else:
            amax = None
        if prefix:  # a parameter or a gradient
            raw[names] = (finite, v[_SUMSQ], amax, sharing)
        else:
            raw[names] = (numel, finite, v[_SUMSQ], v[_ZERO], amax, max_of(dtype))

    def _add_grad_contrib(self, step: int, sharing: str, sumsq: float) -> None:
        """This rank's share of the step's squared gradient norm (see health_ranks); None once a
        gradient's share cannot be known."""
        contrib = self._grad_contrib.get(step, 0.0)
        if contrib is None:
            return
        if sharing == "unknown":
            contrib = None
        elif sharing == "counted" or (sharing == "plain" and self.ranks.rank == self.ranks.publisher):
            contrib += sumsq
        self._grad_contrib[step] = contrib

    def step_done(self, step: int, *, loss, grad_norm, loss_scale, skipped: bool, nonfinite: int,
                  clipped: bool = False) -> None:
        """A checked step is complete (the step log flushes it); publishes it when it is a telemetry
        step. ``nonfinite``: the non-finite values of its records; ``skipped``: its update was;
        ``clipped``: ``grad_norm`` is the total norm ``clip_grad_norm_`` returned."""
        self._skipped += bool(skipped)
        self._step_nonfinite += nonfinite
        raw = self._raw.pop(step, None)
        for old in [k for k in self._raw if k < step]:  # (steps that never completed)
            del self._raw[old]
        contrib = self._grad_contrib.pop(step, 0.0)
        for old in [k for k in self._grad_contrib if k < step]:
            del self._grad_contrib[old]
        values = {"loss": loss, "grad_norm": grad_norm, "loss_scale": loss_scale}
        if not self.wants(step):
            # Kept until the next point: a point published off schedule (Note [the failure reaches
            # the tracker]) is of this step.
            self._unpublished = (step, values, clipped)
            return
        self._unpublished = None
        self._publish_point(step, raw or {}, values, clipped, contrib)

    def completed(self, done) -> list:
        self.step_done(done.step, loss=done.loss, grad_norm=done.grad_norm, loss_scale=done.loss_scale,
                       skipped=done.update == "skipped", nonfinite=sum(done.nonfinite.values()),
                       clipped=done.clipped)
        return []

    def event(self, event) -> None:
        """An event another listener found (a spike): its numbers to the sinks, at its step."""
        if self.publisher is not None and not self.failed:
            self.publisher.publish(event.step, event.telemetry())

    def run_ends(self, failure: bool) -> None:
        self.publish_pending(failure=failure)

    def publish_pending(self, failure: bool = False) -> None:
        """Note [the failure reaches the tracker]: a point at the last complete step that was not a
        telemetry step, published off schedule, when the run would otherwise lose what it counted --
        when the step raises its incident (``failure``: the error is about to stop the loop) and at
        ``close`` when non-finite values were counted since the last point. It has the step's
        ``loss``, ``grad_norm`` and ``loss_scale``, the running ``updates_skipped`` and the
        non-finite counts (per step and per tensor) since the last point; no per-tensor statistics
        (those are taken at telemetry steps only). A clean run's points stay on schedule. Under
        torch.distributed (several ranks) a point is a collective, so none is published off
        schedule: the counts wait for the next scheduled point (the incident is in every rank's
        event log and ``mon.incidents``)."""
        if self._unpublished is None or self.failed or self.ranks is not None:
            return
        step, values, clipped = self._unpublished
        if not failure and not self._step_nonfinite and not any(self._counts.values()):
            return
        self._unpublished = None
        self._publish_point(step, {}, values, clipped, 0.0)

    def _publish_point(self, step: int, raw: dict, values: dict, clipped: bool, contrib) -> None:
        counts: dict = {}
        for counted in [k for k in self._counts if k <= step]:  # every checked step since the last point
            for name, count in self._counts.pop(counted).items():
                counts[name] = counts.get(name, 0) + count
        values = dict(values, updates_skipped=self._skipped, nonfinite=self._step_nonfinite)
        self._step_nonfinite = 0
        if self.ranks is not None:
            if self.failed:
                distributed.gather_to({"failed": True}, self.ranks.publisher)
                return
            mine = {"raw": raw, "counts": {name: (count, self._count_kind.get(name, "activation"))
                                           for name, count in counts.items()},
                    "step": values, "clipped": clipped, "grad_contrib": contrib}
            gathered = distributed.gather_to(mine, self.ranks.publisher)
            if gathered is None:  # (another rank publishes)
                return
            if any(p.get("failed") for p in gathered):
                if self.publisher is not None:
                    failed = [r for r, p in enumerate(gathered) if p.get("failed")]
                    warn(f"nanscan: telemetry failed on rank(s) {failed} and is turned off", RuntimeWarning,
                         stacklevel=2)
                    self.publisher.close()
                    self.publisher = None
                return
            raw, counts, values = combine(gathered, publisher=self.ranks.publisher, sharded=self.ranks.sharded,
                                          names=self.ranks.unknown_warned)
        if self.publisher is not None:
            self.publisher.publish(step, _points(raw, counts, values))

    def turn_off(self) -> None:
        """A failure of telemetry on this rank (warned about once): nothing more is published; under
        torch.distributed the rank still takes part in the gathers (it stays on the step log's list,
        sending that it failed), so no rank waits for it."""
        self.failed = True
        self.off = self.ranks is None
        if self.ranks is None and self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def close(self) -> None:
        for publisher in (self.publisher, self._idle_sinks):
            if publisher is not None:
                publisher.close()


def _points(raw: dict, counts: dict, values: dict) -> dict:
    """The scalars of one telemetry point from the raw numbers of its tensors (module docstring)."""
    points: dict = {}
    least = None
    for names, r in raw.items():
        if len(r) == 4:  # a parameter or a gradient: (finite, sumsq, amax, sharing)
            finite, sumsq, amax = r[0], r[1], r[2]
            points[names[0]] = math.sqrt(sumsq) if finite > 0 else None
            points[names[1]] = amax
            continue
        numel, finite, sumsq, zeros, amax, limit = r
        points[names[0]] = math.sqrt(sumsq / finite) if finite > 0 else None
        points[names[1]] = amax
        points[names[2]] = zeros / numel if numel else None
        headroom = math.log2(limit / amax) if (amax and limit == limit) else None  # (limit NaN: not floating)
        points[names[3]] = headroom
        if headroom is not None and (least is None or headroom < least):
            least = headroom
    for name, count in counts.items():
        points[name] = (points.get(name) or 0) + count
    for what, value in values.items():
        points[scalar_name(what)] = value
    points[scalar_name("headroom_bits")] = least
    return points

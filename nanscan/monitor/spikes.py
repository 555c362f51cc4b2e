"""Loss-spike warnings: ``watch(..., spikes=True)`` (or a :class:`SpikePolicy`) says *when* a step's
loss or gradient norm jumped, and *where*: the first module, in production order, whose own output
numbers jumped in that step.

From the records the monitor reads anyway, every checked training step:

* per step, the loss and the gradient norm (before clipping), as the step log has them;
* per module output (a module called twice in a step: each call), its ``rms`` and ``amax`` over
  the finite elements.

Each metric keeps a running baseline of its logarithm: a forecast ``f`` of ``log(value)`` (Holt's
linear exponential smoothing, a level and a trend with memory ``memory`` steps, so that a loss
falling steadily is forecast where it is going) and ``d``, the mean absolute error of that forecast
-- the metric's usual step-to-step noise. Departures are ratios to ``exp(f)``. A step metric
spikes when ``log(value) - f`` is at least ``log(ratio)`` *and* at least ``deviations * d``: twice
the baseline (by default) and far outside its usual noise, after ``warmup`` checked steps. A
module departed when its ``|log(value) - f|`` passes ``log(module_ratio)`` and
``module_deviations * d`` (up or down: a jump either way in a module upstream of the loss is where
a spike starts). A spiking value moves its baseline by at most ``deviations * d``, so one spike
does not hide the next. Values that are not positive and finite are left out (non-finite values
are incidents, not spikes; a loss can be negative: it is then not tracked).

Near 0 a ratio measures nothing: a batch's loss is the mean of its examples' losses, so it moves
by whole examples, each ``1/B`` of its own loss. A classifier trained to a loss ~0.01 on batches
of 4 is at ~0.001 on most batches and at 0.1 -- 0.3 on one that holds a single hard example: a
hundredfold, far outside the log noise of the easy batches, and no spike (issue #43). So each step
metric has a floor, ``floor_deviations`` times its noise *in its own units* over the warmup steps
(the mean absolute error ``|value - exp(f)|`` there): one batch's sampling noise when training
started, about what one example moves a batch by (it shrinks as ``1/sqrt(B)``: the floor of a
batch of 4 is high, that of a GPT's 128 tokens a small part of its loss). After the warmup the
metric's values and its forecast are counted at the floor when they are under it: a metric at
the floor is at 0, and a spike from there has to reach ``ratio`` times the floor (its reported
baseline is the floor). Labels flipped in one batch of 4 of that classifier reach 13 -- 37 times
the floor; of 140 clean runs like it, 2 still warned with a floor of 4 units, none with 5 (Note
[spike thresholds] in docs/monitor.md).
(A watch started on a model already trained to near 0 measures that noise there and gets a low
floor: ``SpikePolicy(floor_deviations=...)`` raises it.)

A spike is a :class:`SpikeEvent`: kept in ``Monitor.spikes``, written to the event log (``"type":
"spike"``), sent to the telemetry sinks (``nanscan/spike/<metric>``: the ratio to the baseline) and
warned as a :class:`SpikeWarning`; it never raises. Under torch.distributed each rank watches its
own numbers. Note [spike thresholds] in docs/monitor.md gives the numbers behind the defaults.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from nanscan.monitor.consumers import ReadConsumer, StepListener
from nanscan.monitor.slots import EagerRows, Slot
from nanscan.record import Field
from nanscan.warn import warn

__all__ = ["SpikeEvent", "SpikePolicy", "SpikeWarning", "SpikeWatch"]

_NAN, _POSINF, _NEGINF = Field.NAN_COUNT, Field.POSINF_COUNT, Field.NEGINF_COUNT
_MIN, _MAX, _SUMSQ = Field.FINITE_MIN, Field.FINITE_MAX, Field.SUMSQ


class SpikeWarning(RuntimeWarning):
    """A step's loss or gradient norm jumped far above its running baseline (:class:`SpikeEvent`)."""


@dataclasses.dataclass(frozen=True)
class SpikePolicy:
    """Thresholds of the spike warnings (``watch(..., spikes=SpikePolicy(...))``; ``spikes=True``
    takes these defaults; the module docstring says what each means). ``floor_deviations``: a step
    metric's floor, in units of its warmup noise in its own units (0: no floor); values under the
    floor count as 0, so a spike from near 0 must reach ``ratio`` times the floor."""

    ratio: float = 2.0
    deviations: float = 6.0
    module_ratio: float = 2.0
    module_deviations: float = 6.0
    warmup: int = 20
    memory: int = 10
    floor_deviations: float = 5.0

    def __post_init__(self):
        for name in ("ratio", "module_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
                raise ValueError(f"nanscan.SpikePolicy: {name} must be a number > 1, got {value!r}")
        for name in ("deviations", "module_deviations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"nanscan.SpikePolicy: {name} must be a number > 0, got {value!r}")
        if isinstance(self.floor_deviations, bool) or not isinstance(self.floor_deviations, (int, float)) \
                or not 0 <= self.floor_deviations < math.inf:
            raise ValueError(f"nanscan.SpikePolicy: floor_deviations must be a finite number >= 0, got "
                             f"{self.floor_deviations!r}")
        for name in ("warmup", "memory"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"nanscan.SpikePolicy: {name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass
class SpikeEvent:
    """``metric`` (``"loss"`` or ``"grad_norm"``) of ``step`` was ``value``, ``value / baseline``
    times its running baseline. ``name``: the first module output, in the step's production order,
    whose own ``module_metric`` (``"rms"`` or ``"amax"``) departed from its baseline, by
    ``module_ratio`` (its value over its baseline); None when no module's numbers departed (the
    jump came from the data or the loss alone, or the modules' numbers were not read)."""

    LOG_TYPE = "spike"  # (the type of its event log line; a class attribute, not a field)

    step: int
    metric: str
    value: float
    baseline: float
    name: Optional[str] = None
    module_metric: Optional[str] = None
    module_ratio: Optional[float] = None

    @property
    def ratio(self) -> float:
        return self.value / self.baseline

    def __str__(self) -> str:
        where = (f"; it started at module {self.name!r}, whose output {self.module_metric} was "
                 f"{self.module_ratio:.3g}x its baseline" if self.name is not None
                 else "; no module's output departed from its baseline")
        return (f"nanscan: {self.metric} spike at step {self.step}: {self.value:.4g}, {self.ratio:.3g}x its running "
                f"baseline {self.baseline:.4g}{where}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def telemetry(self) -> dict:
        """Its scalar for the telemetry sinks: the ratio to the baseline."""
        return {f"nanscan/spike/{self.metric}": self.ratio}


class _Baseline:
    """A forecast of ``log(value)`` with its typical error: Holt's linear exponential smoothing (a
    level and a trend, so a loss that falls steadily is forecast where it is going, not where it
    was), and the mean absolute one-step forecast error. Plain averages while ``n < 2 / alpha``."""

    __slots__ = ("n", "level", "trend", "dev")

    def __init__(self):
        self.n, self.level, self.trend, self.dev = 0, 0.0, 0.0, 0.0

    @property
    def forecast(self) -> float:
        return self.level + self.trend

    def departure(self, log_value: float) -> float:
        return log_value - self.forecast if self.n else 0.0

    def add(self, log_value: float, policy: SpikePolicy, clip: float) -> None:
        self.n += 1
        if self.n == 1:
            self.level = log_value
            return
        alpha = max(2.0 / (policy.memory + 1), 1.0 / self.n)
        forecast = self.forecast
        err = log_value - forecast
        if clip > 0 and abs(err) > clip:  # (a spike moves its baseline by at most this much)
            err = math.copysign(clip, err)
        level = forecast + alpha * err
        self.trend += (alpha / 2) * (level - self.level - self.trend)
        self.level = level
        self.dev += alpha * (abs(err) - self.dev) if self.n > 2 else abs(err) - self.dev


class SpikeWatch(ReadConsumer, StepListener):
    """The baselines and events of one monitor (see the module docstring): a consumer of every
    training read (the module outputs' numbers) and a listener of the step log's completed steps
    (the loss and the gradient norm)."""

    what = "the spike warnings"

    def __init__(self, policy: SpikePolicy):
        self.policy = policy
        self.events: list = []
        self._steps: dict = {}  # (step metric) -> _Baseline
        self._warmup_noise: dict = {}  # step metric -> [sum, count] of |value - exp(f)| over the warmup steps
        self._floor: dict = {}  # step metric -> log of its floor (floor_deviations x its warmup noise)
        self._modules: dict = {}  # (module name, "rms" / "amax") -> _Baseline
        self._departed: dict = {}  # step -> (name, metric, ratio) of its first departed module output

    def observe(self, read) -> None:
        """A decoded training read: its module outputs' numbers, in production order."""
        if not read.training:
            return
        policy = self.policy
        first = {}
        for step, name, numel, v in _module_outputs(read):
            finite = numel - (v[_NAN] + v[_POSINF] + v[_NEGINF])
            if finite <= 0:
                continue
            rms = math.sqrt(v[_SUMSQ] / finite)
            amax = max(v[_MAX], -v[_MIN])
            for metric, value in (("rms", rms), ("amax", amax)):
                if not (value > 0 and math.isfinite(value)):
                    continue
                key = (name, metric)
                base = self._modules.get(key)
                if base is None:
                    base = self._modules[key] = _Baseline()
                x = math.log(value)
                d = base.departure(x)
                limit = policy.module_deviations * base.dev
                if (step not in first and base.n >= policy.warmup and abs(d) >= math.log(policy.module_ratio)
                        and abs(d) >= limit):
                    first[step] = (name, metric, math.exp(d))
                base.add(x, policy, limit if base.n >= policy.warmup else 0.0)
        for step, departed in first.items():
            self._departed.setdefault(step, departed)

    def completed(self, done) -> list:
        """A completed step that ended (a step only read at close is not one the loop ran)."""
        return self.step_done(done.step, loss=done.loss, grad_norm=done.grad_norm) if done.ended else []

    def step_done(self, step: int, *, loss, grad_norm) -> list:
        """A checked step's loss and gradient norm; returns its new :class:`SpikeEvent` s (also kept)."""
        policy = self.policy
        departed = self._departed.pop(step, None)
        for old in [k for k in self._departed if k < step]:
            del self._departed[old]
        found = []
        for metric, value in (("loss", loss), ("grad_norm", grad_norm)):
            if value is None or not (value > 0 and math.isfinite(value)):
                continue
            base = self._steps.get(metric)
            if base is None:
                base = self._steps[metric] = _Baseline()
            x = math.log(value)
            if base.n < policy.warmup:
                if base.n:  # (the noise in the metric's own units, for its floor)
                    noise = self._warmup_noise.setdefault(metric, [0.0, 0])
                    noise[0] += abs(value - math.exp(base.forecast))
                    noise[1] += 1
                base.add(x, policy, 0.0)
                continue
            floor = self._floor.get(metric)
            if floor is None:
                total, count = self._warmup_noise.pop(metric, (0.0, 0))
                level = policy.floor_deviations * total / count if count else 0.0
                floor = self._floor[metric] = math.log(level) if level > 0 else -math.inf
            x = max(x, floor)  # (under the floor a metric is at 0: see the module docstring)
            forecast = max(base.forecast, floor)
            d = x - forecast
            limit = policy.deviations * base.dev
            if d >= math.log(policy.ratio) and d >= limit:
                name, module_metric, module_ratio = departed if departed is not None else (None, None, None)
                found.append(SpikeEvent(step, metric, value, math.exp(forecast), name, module_metric,
                                         module_ratio))
            base.add(x, policy, limit)
        for event in found:
            self.events.append(event)
            warn(str(event), SpikeWarning, stacklevel=9)
        return found


def _module_outputs(read):
    """``(step, name, numel, record)`` of each module output of a training read, in production order
    (the eager hooks' rows, then other rows; blocks of parameters and gradients are passed over)."""
    host = read.host_rows()
    n = len(host)
    for start, end, s in read.runs():
        t = type(s)
        if t is EagerRows:
            for i in range(start, end):
                row = s.module_output(i)
                if row is not None and row[1] == "forward" and row[2]:
                    yield row[0], row[3], row[5], host[i]
        elif t is Slot:
            if s.kind == "activation" and s.phase == "forward" and s.candidate and not s.stale and s.step is not None:
                yield s.step, s.name, math.prod(s.shape), (host[start] if start < n else read.values(start))

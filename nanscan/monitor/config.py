"""The options of :func:`nanscan.watch`, written once: :class:`WatchConfig`.

``nanscan.watch(model, opt, every=10, mode="async")`` builds a ``WatchConfig`` from its keyword
options (``watch.__signature__`` lists them, with their defaults, from this class), validates it
once, and the monitor reads it and nothing else. A config can also be made ahead and passed whole
-- ``cfg = WatchConfig(every=10); nanscan.watch(model, opt, config=cfg)`` -- and keyword options
given beside it replace its fields (``dataclasses.replace``). It is frozen: a monitor's options do
not change while it watches.

Only what can be checked without the model is checked here (types, values, options that need each
other); :func:`nanscan.watch` checks the model, optimizer and scaler, and the backend against the
model's device.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from nanscan.allow import check_allow

__all__ = ["COMPILED_GRADS", "EVAL_FORWARDS", "MODES", "ON_NONFINITE", "WatchConfig"]

MODES = ("sync", "async")
COMPILED_GRADS = ("hooks", "taps", "off")
ON_NONFINITE = ("raise", "warn", "record", "skip")
EVAL_FORWARDS = ("check", "raise", "skip")

_FLAGS = ("activations", "activation_grads", "grads", "params", "buffers", "optimizer_state",
          "keep_pre_update_state")


def _refuse(error: type, text: str) -> None:
    raise error(f"nanscan.watch: {text}"[:400])


@dataclasses.dataclass(frozen=True)
class WatchConfig:
    """Options of :func:`nanscan.watch`. Every field is validated when the config is made: a wrong
    type or value is a ``TypeError`` / ``ValueError`` naming what is accepted.

    What is recorded:

    ``activations``: module outputs (and values made in a module's own body) in the forward, and
    (``activation_grads``) the gradients flowing into module outputs (taken by a C++ hook on each
    output's autograd node). Without them a backward-only fault is reported at the first non-finite
    parameter gradient with ``produced=None``. ``compiled_grads``: how those gradients are taken
    inside ``torch.compile`` graphs -- ``"hooks"`` (default): a tensor hook on each recorded output
    that dynamo traces into the graph, on a torch that can (``nanscan.monitor.traced.GRAD_HOOKS``;
    torch 2.11 cannot: there, none); ``"taps"`` (or ``True``): identity autograd Functions on module
    inputs and outputs, whose outputs are views -- only for models that never modify a module's
    input or output in place (``ReLU(inplace=True)``, ``out += identity``: autograd forbids in-place
    ops on such views and the compile fails), on any torch; ``"off"`` (or ``False``): none, for the
    shortest compile (docs/compile.md). ``grads``: parameter gradients; ``params``: parameters after
    each optimizer update (needs an optimizer); ``buffers``: floating-point buffers (BatchNorm
    running statistics, EMA copies kept as buffers) after the update, kind ``"buffer"``;
    ``optimizer_state``: optimizer state tensors after the update.

    When and how it is read:

    ``every``: check one step in ``every``. ``mode="sync"`` reads the step's records once, before
    ``optimizer.step`` (so a bad update can be stopped); ``"async"`` copies them without blocking
    and checks them a step later. ``backend``: the kernels (``nanscan.BACKENDS``; None: the default
    for the model's device).

    What a finding does:

    ``on_nonfinite``: ``"raise"`` (:class:`~nanscan.NonFiniteError`), ``"warn"``, ``"record"``
    (only ``mon.incidents``) or ``"skip"``: a non-finite step's update is not applied -- the
    optimizer's step does not run, the buffers its forward changed are restored -- and training
    goes on, up to ``max_consecutive_skips`` skipped steps in a row; the next one raises
    (:mod:`nanscan.monitor.skipping`; needs ``mode="sync"`` and an optimizer). Non-finite gradients
    in a step whose update GradScaler skipped are never raised (AMP handled them): they are recorded
    and counted in ``mon.ledger``. Non-finite forward activations or losses are incidents even then:
    loss scaling cannot fix them. ``allow``: fnmatch
    patterns of names allowed to be non-finite (e.g. ``"*.attn_mask"``). ``eval_forwards``: forwards
    outside training (``no_grad``, ``inference_mode``; a forward with grad enabled is training
    whatever ``model.training`` says: Note [training forwards]) are ``"check"``-ed as phase
    ``"eval"`` and warned about (default), ``"raise"`` like training incidents, or ``"skip"``-ped.

    What is kept:

    ``capture_dir``: at the first reported incident, write a failure bundle there
    (``step000123-rank0``; see :mod:`nanscan.capture.bundle`) with the batch (the root module's
    forward inputs of the step's first forward, or the ``batch`` given to ``mon.step(batch)``;
    cloned before the forward), the pre-step RNG, and model / optimizer / scaler state marked
    "before-update" or "after-update". Cost per checked step: a clone of the batch and the RNG
    states. ``keep_pre_update_state=True`` also keeps a copy of model, optimizer and scaler state
    from the start of each step, so update-phase (and async) incidents get pre-update state.
    ``log``: a path or a :class:`nanscan.EventLog`: one JSONL record per checked step and one per
    incident (fsynced); see :mod:`nanscan.monitor.steplog`.

    Early warning:

    ``headroom_bits``: warn (once per tensor, never raising) when a watched tensor's largest finite
    magnitude comes within that many bits of its dtype's largest value -- ``log2(finfo.max /
    amax)``, against the dtype it is stored in and, for float32 activations and parameters of a
    step whose forward ran under float16 autocast, against float16 -- with the trend over the last
    checked steps and the step at which it would overflow (:mod:`nanscan.monitor.headroom`,
    ``mon.headroom_events``, ``"headroom"`` lines in the log). Off (None) by default; ``True`` takes
    the suggested 4 bits (:data:`nanscan.headroom.SUGGESTED_BITS`). With a GradScaler, gradients are
    left out: loss scaling keeps them near float16's top on purpose, and the scaler handles their
    overflow. ``headroom_cast``: ``{fnmatch pattern: dtype}`` of tensors you know are cast, unscaled,
    to a narrower dtype (e.g. a float8 recipe with a fixed scale); their headroom is measured
    against it.

    Numbers for your tracker:

    ``telemetry``: a sink or a list of sinks (:mod:`nanscan.telemetry`: ``TensorBoard(log_dir)``,
    ``WandB()``, ``MLflow()``, ``JSONL(path)``, or any ``fn(step, scalars)``) that get every module's
    numbers every ``telemetry_every`` steps (:mod:`nanscan.monitor.health`: names, statistics, the
    NaN rule); the monitor closes them when it closes. ``telemetry_every``: a multiple of ``every``
    (telemetry points are checked steps); default (None) ``every`` times the smallest number that
    makes it at least 10 (:attr:`telemetry_interval`). ``telemetry_names``: fnmatch patterns of the
    tensors (module paths, parameter paths) that get per-tensor scalars (default ``("*",)``: every
    one); the per-step scalars are always sent.

    ``spikes``: ``True`` (default thresholds) or a :class:`~nanscan.monitor.spikes.SpikePolicy` warns
    of loss and gradient-norm spikes, naming the first module whose output numbers jumped
    (``mon.spikes``; :mod:`nanscan.monitor.spikes`). Off (None) by default.

    Normalized when made: ``compiled_grads`` True / False become ``"taps"`` / ``"off"``,
    ``headroom_bits=True`` the suggested number, ``allow`` a tuple.
    """

    activations: bool = True
    activation_grads: bool = True
    compiled_grads: Any = "hooks"
    grads: bool = True
    params: bool = True
    buffers: bool = True
    optimizer_state: bool = False
    every: int = 1
    mode: str = "sync"
    on_nonfinite: str = "raise"
    max_consecutive_skips: int = 3
    allow: tuple = ()
    backend: Optional[str] = None
    capture_dir: Optional[str] = None
    keep_pre_update_state: bool = False
    log: Any = None
    eval_forwards: str = "check"
    headroom_bits: Optional[float] = None
    headroom_cast: Optional[dict] = None
    telemetry: Any = None
    telemetry_every: Optional[int] = None
    telemetry_names: Any = ("*",)
    spikes: Any = None

    def __post_init__(self) -> None:
        normalize = _normalizer(self)
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                _refuse(TypeError, f"{name} must be True or False, got {value!r}")
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            _refuse(ValueError, f"every must be an int >= 1, got {every!r}")
        if self.mode not in MODES:
            _refuse(ValueError, f"mode must be one of {MODES}, got {self.mode!r}")
        if self.on_nonfinite not in ON_NONFINITE:
            _refuse(ValueError, f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}")
        skips = self.max_consecutive_skips
        if isinstance(skips, bool) or not isinstance(skips, int) or skips < 1:
            _refuse(ValueError, f"max_consecutive_skips must be an int >= 1, got {skips!r}")
        if self.on_nonfinite == "skip" and self.mode != "sync":
            _refuse(ValueError, "on_nonfinite='skip' needs mode='sync': in async mode a step's records are checked "
                                "one read later, after its update was applied, so it can no longer be skipped")
        if self.compiled_grads is True or self.compiled_grads is False:
            normalize("compiled_grads", "taps" if self.compiled_grads else "off")
        if self.compiled_grads not in COMPILED_GRADS:
            _refuse(ValueError, f"compiled_grads must be one of {COMPILED_GRADS} (or True for 'taps', False for "
                                f"'off'), got {self.compiled_grads!r}")
        if self.eval_forwards not in EVAL_FORWARDS:
            _refuse(ValueError, f"eval_forwards must be one of {EVAL_FORWARDS}, got {self.eval_forwards!r}")
        normalize("allow", tuple(check_allow(self.allow, "nanscan.watch")))
        capture_dir = self.capture_dir
        if capture_dir is not None and not isinstance(capture_dir, (str, os.PathLike)):
            _refuse(TypeError, f"capture_dir must be a directory path (str or os.PathLike) or None, got "
                               f"{type(capture_dir).__name__}: {capture_dir!r}")
        if self.keep_pre_update_state and capture_dir is None:
            _refuse(ValueError, "keep_pre_update_state=True keeps state for the failure bundle, which needs "
                                "capture_dir=...")
        log = self.log
        if log is not None and not isinstance(log, (str, os.PathLike)) and type(log).__name__ != "EventLog":
            _refuse(TypeError, f"log must be a path (str or os.PathLike), a nanscan.EventLog or None, got "
                               f"{type(log).__name__}: {log!r}")
        bits = self.headroom_bits
        if bits is True:
            from nanscan.headroom import SUGGESTED_BITS

            normalize("headroom_bits", SUGGESTED_BITS)
            bits = SUGGESTED_BITS
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits < 1024):
            _refuse(ValueError, f"headroom_bits must be a number of bits in (0, 1024), True (the suggested 4 bits) "
                                f"or None (off), got {bits!r}")
        cast = self.headroom_cast
        if cast is not None:
            if not isinstance(cast, dict) or not all(isinstance(k, str) and isinstance(v, torch.dtype)
                                                     and v.is_floating_point for k, v in cast.items()):
                _refuse(TypeError, f"headroom_cast must be a dict of fnmatch pattern (str) -> floating torch.dtype, "
                                   f"got {cast!r}")
            if bits is None:
                _refuse(ValueError, "headroom_cast needs headroom_bits (the warning threshold)")
        if self.telemetry is not None:
            from nanscan.telemetry import check_sink

            sinks = list(self.telemetry) if isinstance(self.telemetry, (list, tuple)) else [self.telemetry]
            if not sinks:
                _refuse(ValueError, "telemetry must be a sink or a non-empty list of sinks (None: off)")
            sinks = [check_sink(s) for s in sinks]
            if len({id(s) for s in sinks}) != len(sinks):
                _refuse(ValueError, "telemetry: the same sink is given twice (it would receive every point twice)")
            normalize("telemetry", tuple(sinks))
        te = self.telemetry_every
        if te is not None and (isinstance(te, bool) or not isinstance(te, int) or te < 1 or te % every):
            _refuse(ValueError, f"telemetry_every must be an int >= 1 and a multiple of every={every} (telemetry "
                                f"points are checked steps), got {te!r}")
        spikes = self.spikes
        if spikes is True:
            from nanscan.monitor.spikes import SpikePolicy

            normalize("spikes", SpikePolicy())
        elif spikes is False:
            normalize("spikes", None)
        elif spikes is not None and type(spikes).__name__ != "SpikePolicy":
            _refuse(TypeError, f"spikes must be True (the default thresholds), a nanscan.SpikePolicy or None (off), "
                               f"got {type(spikes).__name__}: {spikes!r}")
        names = (self.telemetry_names,) if isinstance(self.telemetry_names, str) else self.telemetry_names
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
            _refuse(TypeError, f"telemetry_names must be an fnmatch pattern (str) or a non-empty list of them, got "
                               f"{self.telemetry_names!r}")
        normalize("telemetry_names", tuple(names))

    # Derived once (the hooks read these on every step).
    @property
    def records_activation_grads(self) -> bool:
        """Gradients of module outputs are recorded (they need ``activations`` too)."""
        return self.activations and self.activation_grads

    @property
    def compiled_grad_taps(self) -> bool:
        """Inside compiled graphs, gradients are taken by identity autograd Functions."""
        return self.records_activation_grads and self.compiled_grads == "taps"

    @property
    def compiled_grad_hooks(self) -> bool:
        """Inside compiled graphs, gradients are taken by tensor hooks dynamo traces."""
        return self.records_activation_grads and self.compiled_grads == "hooks"

    @property
    def telemetry_interval(self) -> int:
        """Steps between telemetry points: ``telemetry_every``, or by default ``every`` times the
        smallest number that makes it at least 10 (telemetry points are checked steps)."""
        te = self.telemetry_every
        return te if te is not None else self.every * -(-10 // self.every)

    @classmethod
    def of(cls, config: Optional["WatchConfig"], options: dict) -> "WatchConfig":
        """``config`` (or the defaults) with ``options`` replacing its fields; an unknown option is a
        TypeError listing the accepted ones."""
        if config is not None and not isinstance(config, cls):
            _refuse(TypeError, f"config must be a nanscan.WatchConfig or None, got {type(config).__name__}")
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"nanscan.watch got unknown option(s) {', '.join(map(repr, unknown))}; the options are "
                            f"{', '.join(FIELDS)}")
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options) if options else config


def _normalizer(config: WatchConfig):
    """The one way __post_init__ normalizes a field of the frozen config."""
    return lambda name, value: object.__setattr__(config, name, value)


FIELDS = tuple(f.name for f in dataclasses.fields(WatchConfig))

"""Replay a bundle's step and name the first op on the path to the failure.

``docs/replay.md`` says how to read the answer; this is how it is found.

1. **Provenance** (:mod:`nanscan.capture.provenance`). Every aten op of the step, forward and
   backward, is seen; an op whose output holds a NaN or Inf made from finite inputs is an
   *origin*, and an op with non-finite inputs passes on the origins those inputs carry (and is an
   origin too when it also makes non-finite values of its own).
2. **The target** is the step's result: the loss / output when it went non-finite, else the
   parameters' gradients that did. ``reproduced`` means exactly that. Only origins the target
   carries can be the answer: an ``-inf`` fill that softmax turns into zeros is carried by
   nothing after the softmax, whichever op came first.
3. **Trials.** Provenance is kept per storage, not per element, so it can over-approximate: a NaN
   and an ``-inf`` mask that meet in one tensor (``scores + mask``, sdpa with a float mask) both
   reach what follows. When more than one origin reaches the target, they are tried in order of
   production: the step is run again with the *other* origins' non-finite values made finite, and
   the first origin that alone still makes the result non-finite is the answer; failing that, the
   first without which the result stays finite (needed together with another). When the trials
   cannot tell them apart, or the step takes another path, or a value came from somewhere the
   replay cannot see (a tensor made before the step, an inductor kernel), the answer is "cannot
   tell", with the reason.

``allow=`` takes the fnmatch patterns of :func:`nanscan.watch`, matched against the qualified name of
the module an op ran in (``"(model)"`` for the root; in the backward also ``"<module> (output
grad)"``): an allowed module's non-finite values are never the answer. Where they leave the
allowed module and make something non-finite, the op that took them is.

Replay is offline: it syncs the host for every op and re-runs ops and the step, which never
happens on the training hot path.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from nanscan.allow import check_allow
from nanscan.capture.bundle import Bundle, load_bundle, restore_rng
from nanscan.capture.provenance import (ModuleStack, Origin, StepMode, TagNodes, Trial, float_tensors,
                                        has_nonfinite, host_records, is_float, made_finite, summary_of)
from nanscan.record import TensorSummary

# The most step re-runs one replay spends telling apart the origins that reach the result.
MAX_TRIALS = 12


@dataclasses.dataclass
class ReplayResult:
    """What a replay found.

    ``reproduced``: the step's result went non-finite -- the loss / output, or a parameter's
    gradient (``failure`` says which). Non-finite values that never reached it (an ``-inf`` mask
    that softmax turned into zeros) do not count: they are listed in ``off_path``.

    ``first_op`` / ``module`` / ``phase`` / ``stack`` / ``inputs`` / ``outputs``: the first op on the
    path to the failure -- the op that made the non-finite values the result carries, earliest in
    the step. ``inputs_finite``: its inputs were finite (False when it made new non-finite values
    next to non-finite inputs that were not the cause, or took values from an allowed module).
    All None when nanscan cannot name an op: then ``cannot_tell`` says why, or the values were in
    the bundle before the step ran (``nonfinite_before``).

    ``candidates``: the origins the result carried, before the trials told them apart.
    ``result``: summary of what ``forward`` returned (its first non-finite tensor, else its first).
    ``anomaly_error``: the message of ``detect_anomaly`` when ``anomaly=True`` and it fired."""

    reproduced: bool
    first_op: Optional[str]
    module: Optional[str]
    phase: Optional[str]
    stack: Optional[str]
    inputs: list
    outputs: list
    result: Optional[TensorSummary]
    precision: Optional[str]
    compile_backend: Optional[str]
    anomaly_error: Optional[str] = None
    # Batch tensors, parameters and buffers that were non-finite before the step ran.
    nonfinite_before: list = dataclasses.field(default_factory=list)
    failure: Optional[str] = None
    inputs_finite: Optional[bool] = None
    cannot_tell: Optional[str] = None
    candidates: list = dataclasses.field(default_factory=list)
    off_path: list = dataclasses.field(default_factory=list)
    allow: tuple = ()
    # How the named op made its non-finite values: "finite" from finite inputs; "beside" new ones
    # next to non-finite inputs that were not their cause; "allowed" from an allowed module's values.
    how: Optional[str] = None

    @property
    def from_bundle(self) -> bool:
        """The result's non-finite values were in the bundle before the step ran: no op made them."""
        return self.reproduced and self.first_op is None and self.cannot_tell is None and bool(self.nonfinite_before)

    def __str__(self) -> str:
        how = f"precision={self.precision or 'as recorded'}, backend={self.compile_backend or 'eager'}"
        off = ""
        if self.off_path:
            shown = ", ".join(self.off_path[:6]) + (" ..." if len(self.off_path) > 6 else "")
            off = f" (non-finite values that never reached the result: {shown})"
        if not self.reproduced:
            return f"replay ({how}): did not reproduce: the step's result and gradients stayed finite{off}"
        head = f"replay ({how}): reproduced: {self.failure} went non-finite"
        if self.result is not None and not self.result.is_finite:
            head += f" ({self.result})"
        if self.cannot_tell is not None:
            return f"{head}; cannot tell which op made it: {self.cannot_tell}{off}"
        if self.first_op is None:
            names = ", ".join(self.nonfinite_before[:8]) + (" ..." if len(self.nonfinite_before) > 8 else "")
            return (f"{head}; no op made it: it was already in the bundle before the step ran "
                    f"({names}){off}")
        ins = "; ".join(str(s) for s in self.inputs if s is not None) or "no floating inputs"
        if self.inputs_finite:
            cause = f"inputs finite ({ins})"
        elif self.how == "allowed":
            cause = f"its non-finite inputs came from modules allowed by {self.allow!r} ({ins})"
        else:
            cause = f"it made new non-finite values; its inputs' own non-finite values were not the cause ({ins})"
        where = self.module or ("(module unknown: inside the compiled graph)" if self.compile_backend
                                else "(outside any module)")
        return (f"{head}; first non-finite op {self.first_op} in {self.phase}, module {where}, "
                f"at {self.stack or '?'}; {cause}; "
                f"output {self.outputs[0] if self.outputs else '?'}{off}")


def _to(value, device, fp32: bool):
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.float() if fp32 and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, fp32) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, fp32) for k, v in value.items()}
    return value


def _autocast(manifest: dict, device: torch.device, precision: Optional[str]):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    rec = (manifest.get("autocast") or {}).get(device.type) or {}
    if not rec.get("enabled"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, rec["dtype"]))


# A mismatch names at most this many keys of each kind, then "and N more".
MAX_KEYS_NAMED = 4


class ModelMismatchError(ValueError):
    """The model's state dict does not fit the bundle's: ``detail`` names the missing and unexpected
    keys and the shape mismatches, a few of each."""

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"nanscan.replay: the model does not fit the bundle's saved state (is it built the way "
                         f"the captured model was?): {detail}")


def _some(names: list) -> str:
    shown = ", ".join(names[:MAX_KEYS_NAMED])
    return shown + (f" and {len(names) - MAX_KEYS_NAMED} more" if len(names) > MAX_KEYS_NAMED else "")


def _state_mismatch(model: torch.nn.Module, state: dict) -> Optional[str]:
    """The keys and shapes where ``state`` does not fit ``model``, in words; None when they all do."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} (bundle {list(state[k].shape)}, model {list(own[k].shape)})" for k in own
              if isinstance(own.get(k), torch.Tensor) and isinstance(state.get(k), torch.Tensor)
              and not isinstance(own[k], torch.nn.parameter.UninitializedTensorMixin)  # a lazy module takes any
              and own[k].shape != state[k].shape]
    parts = [f"{what}: {_some(names)}" for what, names in (
        ("missing keys (in the model, not in the bundle)", missing),
        ("unexpected keys (in the bundle, not in the model)", unexpected),
        ("shape mismatches", shapes)) if names]
    return "; ".join(parts) or None


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """``model.load_state_dict(state)``; a state that does not fit (a layer added, removed or resized
    since the bundle was captured) is a :class:`ModelMismatchError` naming the keys, instead of the
    several lines of ``load_state_dict``'s ``RuntimeError``."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = _state_mismatch(model, state)
        if detail is None:  # (a failure of the model's own loading code: its error says more)
            raise
        raise ModelMismatchError(detail) from e


def prepare(bundle, model: torch.nn.Module, precision: Optional[str] = None):
    """Load the bundle's state into ``model`` (and restore the pre-step RNG); returns the bundle
    and its batch on the model's device. Shared by replay and bisect."""
    if precision not in (None, "fp32"):
        raise ValueError(f"precision must be None (as recorded) or 'fp32', got {precision!r}")
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    model.load_state_dict(b.model_state)
    if precision == "fp32":
        model.float()
    model.train(bool(b.manifest.get("training", True)))
    batch = dict(b.batch)
    batch["args"] = _to(b.batch["args"], device, precision == "fp32")
    batch["kwargs"] = _to(b.batch["kwargs"], device, precision == "fp32")
    inputs_of = (b.manifest.get("extra") or {}).get("inputs_of")
    if isinstance(inputs_of, str):
        batch["inputs_of"] = inputs_of
    restore_rng(b.rng)
    return b, batch, device


def default_forward(model, batch):
    """``model(*args, **kwargs)`` of the recorded batch -- or of the submodule whose inputs they are
    (``inputs_of`` in the manifest's ``extra``: the step's outermost watched call was a submodule's,
    as in a Lightning ``training_step`` calling ``self.net(x)``)."""
    target = model.get_submodule(batch["inputs_of"]) if batch.get("inputs_of") else model
    return target(*batch["args"], **batch["kwargs"])


def run_step(model, batch, forward: Optional[Callable], compile_backend: Optional[str]):
    def user_batch(b):  # the batch as the loop had it: a dict, one tensor, or a tuple
        if b.get("mapping"):
            return dict(b["kwargs"])
        return b["args"][0] if b.get("single") else tuple(b["args"])

    fn = (lambda m, b: forward(m, user_batch(b))) if forward else default_forward
    if compile_backend is not None:
        fn = torch.compile(fn, backend=compile_backend)
    return fn(model, batch)


@dataclasses.dataclass
class _Outcome:
    result: Any
    leaves: list  # [(name, tensor)] of the result's floating tensors
    grads: list  # [(name, gradient)] of the parameters
    anomaly_error: Optional[str]
    before: list  # names of the tensors non-finite before the step


class _Runner:
    """Runs the bundle's step on the model: the replay itself, and each trial."""

    def __init__(self, bundle: Bundle, model, forward, precision, compile_backend, backward, allow):
        self.bundle, self.model, self.forward = bundle, model, forward
        self.precision, self.compile_backend, self.backward, self.allow = precision, compile_backend, backward, allow
        self.mode: Optional[StepMode] = None
        self.backend = None
        if compile_backend is not None:
            # dynamo does not compile a frame entered under a user's dispatch mode: it runs it
            # eagerly. So the step is compiled with no mode active, and the mode is entered
            # inside the compiled callable, where it sees the ops the backend runs (all of them
            # for aot_eager; inductor's fused kernels stay out of sight). One backend object for
            # every run, so that trials reuse the compiled graph.
            inner = torch._dynamo.lookup_backend(compile_backend)

            def backend(gm, example_inputs):
                compiled = inner(gm, example_inputs)

                def run(*args):
                    with self.mode:
                        return compiled(*args)
                return run
            self.backend = backend

    def __call__(self, mode: StepMode, anomaly: bool = False, finite_before=(), backward=None) -> _Outcome:
        model = self.model
        b, batch, device = prepare(self.bundle, model, self.precision)
        for p in model.parameters():
            p.grad = None  # this step's gradients only
        named = _named_state(model, batch)
        before = _nonfinite(named)
        with torch.no_grad():
            for name, t in named:
                if name in before and name in finite_before:
                    t.copy_(made_finite(t, 0.0))
        modules = ModuleStack(model)
        mode.modules = modules
        if mode.track:  # values already non-finite in the bundle are origins of their own
            for name, t in named:
                if name in before:
                    origin = Origin(seq=0, kind="bundle", name=name)
                    mode.origins.append(origin)
                    mode.prov.add(t, {origin})
        anomaly_error, result = None, None
        anomaly_ctx = torch.autograd.detect_anomaly(check_nan=True) if anomaly else contextlib.nullcontext()
        tag = mode.track and self.compile_backend is None
        self.mode = mode
        mode.compiled = self.compile_backend is not None
        with modules:
            try:
                with anomaly_ctx:
                    with (TagNodes(modules) if tag else contextlib.nullcontext()), \
                            (mode if self.backend is None else contextlib.nullcontext()), \
                            _autocast(b.manifest, device, self.precision):
                        result = run_step(model, batch, self.forward, self.backend)
                    leaves = _result_leaves(result)
                    run_backward = self.backward if backward is None else backward
                    if run_backward and isinstance(result, torch.Tensor) and result.requires_grad \
                            and result.numel() == 1:
                        # Once the result itself is non-finite, the backward cannot change the answer.
                        mode.track = mode.track and not any(
                            has_nonfinite(r) for r in host_records([t for _, t in leaves]))
                        mode.phase = "backward"
                        with mode:
                            result.backward()
            except RuntimeError as e:
                if not anomaly:
                    raise
                anomaly_error = str(e)  # detect_anomaly raises on the first NaN gradient: that is a finding
        leaves = _result_leaves(result)
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        return _Outcome(result, leaves, grads, anomaly_error, [n for n, _ in named if n in before])


def _result_leaves(result) -> list:
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [("result", result.detach())] if is_float(result) else []
    try:
        flat = tree_flatten_with_path(result)[0]
    except Exception:  # an object pytree cannot walk: its tensors, unnamed
        return [(f"result[{i}]", t.detach()) for i, t in enumerate(float_tensors(result))]
    return [(f"result{keystr(path)}", t.detach()) for path, t in flat if is_float(t)]


def _failed(outcome: _Outcome, kind: str) -> tuple:
    """(what went non-finite, in words; its tensors) for the target ``kind``: ``"result"`` (what
    forward returned: ``result``, ``result[1]``, ``result['loss']``) or ``"gradient"``."""
    if kind == "result":
        recs = host_records([t for _, t in outcome.leaves])
        bad = [(n, t) for (n, t), r in zip(outcome.leaves, recs) if has_nonfinite(r)]
    else:
        grads = [(n, g) for n, g in outcome.grads if is_float(g)]
        recs = host_records([g for _, g in grads])
        bad = [(f"the gradient of {n}", g) for (n, g), r in zip(grads, recs) if has_nonfinite(r)]
    if not bad:
        return None, []
    names = ["the result" if n == "result" else n for n, _ in bad]
    if len(names) == 1:
        what = names[0]
    elif len(names) <= 3:
        what = ", ".join(names[:-1]) + " and " + names[-1]
    else:
        what = f"{', '.join(names[:2])} and {len(names) - 2} more"
    return what, [t for _, t in bad]


def replay(bundle, model: torch.nn.Module, forward: Optional[Callable[[Any, Any], Any]] = None,
           precision: Optional[str] = None, compile_backend: Optional[str] = None,
           anomaly: bool = False, backward: bool = True, allow=()) -> ReplayResult:
    """Re-run the bundle's step on ``model`` under the recorded conditions (state, mode, autocast,
    pre-step RNG) or changed ones (``precision="fp32"``, ``compile_backend="inductor"`` ...) and
    name the first op on the path to the failure. ``forward(model, batch)`` returns the loss or
    the output (``batch`` is what was captured: the tensor, or the tuple of inputs); by default the
    model is called on the recorded args / kwargs. A scalar result that requires grad is
    back-propagated too (``backward=False`` to skip), so gradient faults are found. ``allow``:
    the fnmatch patterns of :func:`nanscan.watch` (module names whose non-finite values are
    intended). ``model``'s parameters are overwritten by the bundle's state and its gradients
    reset; a model whose state dict does not fit the bundle's is a :class:`ModelMismatchError` (a
    ``ValueError``) naming the missing and unexpected keys and the shape mismatches. See
    ``docs/replay.md`` for how to read the answer."""
    allow = check_allow(allow, "nanscan.replay")
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    # Loaded once here to report a model that does not fit in words (prepare loads it again before
    # each run; bisect keeps load_state_dict's own error for each backend it reports).
    load_model_state(model, b.model_state)
    runner = _Runner(b, model, forward, precision, compile_backend, backward, allow)
    mode = StepMode(None, allow)
    outcome = runner(mode, anomaly=anomaly)

    kind = "result"
    failure, targets = _failed(outcome, "result")
    if failure is None:
        kind = "gradient"
        failure, targets = _failed(outcome, "gradient")
    if failure is None and outcome.anomaly_error is not None:
        failure, targets = "a gradient (detect_anomaly stopped the backward at a NaN)", list(mode.last_bad)
    summary = _result_summary(outcome.leaves)
    reached: set = set()
    untracked = False
    for t in targets:
        got = mode.prov.get(t)
        if got is None:
            untracked = True
        else:
            reached |= got
    off_path = _off_path([o for o in mode.origins if o.kind == "op" and o not in reached])
    common = dict(result=summary, precision=precision, compile_backend=compile_backend,
                  anomaly_error=outcome.anomaly_error, nonfinite_before=outcome.before, allow=allow,
                  off_path=off_path)
    if failure is None:
        return ReplayResult(reproduced=False, first_op=None, module=None, phase=None, stack=None, inputs=[],
                            outputs=[], **common)

    candidates = sorted((o for o in reached if not o.allowed), key=lambda o: o.seq)
    reasons = []
    if untracked or not targets:
        if compile_backend not in (None, "eager", "aot_eager"):
            reasons.append("the result was made where the op search cannot see (inside a compiled graph)")
        else:
            blind = f" (it could not summarize the outputs of {sorted(set(mode.blind))[:3]})" if mode.blind else ""
            reasons.append(f"the op search did not see the op that made the result{blind}")
    unsure = [o for o in candidates if o.kind == "unsure"]
    if unsure:
        reasons.append(f"{unsure[0].op} in {unsure[0].where()} could not be re-run to tell whether it made the "
                       "non-finite values itself")
    if not reasons and not candidates:
        reasons.append(f"only values from modules allowed by {allow!r} reached it")
    answer = None
    if not reasons:
        if len(candidates) == 1:
            answer = candidates[0]
        else:
            answer, why = _trials(runner, candidates, kind)
            if answer is None:
                reasons.append(why)
    if answer is not None and answer.kind == "outside":
        reasons.append(f"its non-finite values came from {answer}: nanscan did not see them made"
                       + ("; replay without compile_backend to find the op" if answer.compiled else ""))
        answer = None
    described = [str(o) for o in candidates]
    if reasons:
        return ReplayResult(reproduced=True, first_op=None, module=None, phase=None, stack=None, inputs=[],
                            outputs=[], failure=failure, cannot_tell="; ".join(reasons), candidates=described,
                            **common)
    described = [str(answer)] + [d for o, d in zip(candidates, described) if o is not answer]
    if answer.kind == "bundle":
        common["nonfinite_before"] = [answer.name] + [n for n in outcome.before if n != answer.name]
        return ReplayResult(reproduced=True, first_op=None, module=None, phase=None, stack=None, inputs=[],
                            outputs=[], failure=failure, candidates=described, **common)
    how = {"finite": "inputs finite", "made": "made next to non-finite inputs",
           "allowed": "took non-finite values from allowed modules"}[answer.how]
    described[0] = f"{described[0]} ({how})"
    return ReplayResult(reproduced=True, first_op=answer.op, module=answer.module, phase=answer.phase,
                        stack=answer.stack, inputs=answer.inputs, outputs=answer.outputs, failure=failure,
                        inputs_finite=answer.how == "finite", candidates=described,
                        how={"made": "beside"}.get(answer.how, answer.how), **common)


def _trials(runner: _Runner, candidates: list, kind: str):
    """The first candidate, in order of production, that alone still makes the result non-finite
    when the others are made finite; else the first without which it stays finite (it is on the
    path, needed together with another); (None, why) when the trials cannot tell them apart."""
    tried = candidates[:MAX_TRIALS]

    def run(finite: list):
        trial = Trial(ops={o.seq: o for o in finite if o.kind in ("op", "unsure")},
                       outside=[o.storage for o in finite if o.kind == "outside" and o.storage is not None],
                       bundle={o.name for o in finite if o.kind == "bundle"})
        mode = StepMode(None, runner.allow, trial)
        outcome = runner(mode, finite_before=trial.bundle, backward=kind == "gradient")
        if mode.diverged:
            raise _Diverged(mode.diverged)
        return _failed(outcome, "result")[0] is not None or (
            kind == "gradient" and _failed(outcome, "gradient")[0] is not None)

    try:
        for c in tried:  # sufficient: the others made finite, the result still fails
            if run([o for o in candidates if o is not c]):
                return c, None
        for c in tried:  # necessary: made finite alone, the result no longer fails
            if not run([c]):
                return c, None
    except _Diverged as e:
        return None, (f"the step took another path when origins were made finite ({e}); "
                      f"origins: {'; '.join(map(str, candidates))}")
    more = f" (tried the first {MAX_TRIALS})" if len(candidates) > MAX_TRIALS else ""
    return None, (f"the result carried {len(candidates)} origins and none of them alone makes it non-finite or "
                  f"keeps it finite when made finite{more}: {'; '.join(map(str, tried))}")


class _Diverged(Exception):
    pass


def _result_summary(leaves: list) -> Optional[TensorSummary]:
    if not leaves:
        return None
    recs = host_records([t for _, t in leaves])
    for (_, t), r in zip(leaves, recs):
        if has_nonfinite(r):
            return summary_of(r, t)
    return summary_of(recs[0], leaves[0][1])


def _off_path(origins: list) -> list:
    """``"aten.masked_fill.Scalar in blocks.0.attn (x3)"``: ops that made non-finite values the
    result never carried, in order of first appearance."""
    counts = collections.Counter((o.op, o.module) for o in origins)
    return [f"{op} in {module or '(outside any module)'}" + (f" (x{n})" if n > 1 else "")
            for (op, module), n in counts.items()]


def _named_state(model: torch.nn.Module, batch: dict) -> list:
    """``(name, tensor)`` of the batch's floating tensors (``batch.args[0]``, ``batch.input_ids``)
    and of the model's parameters and floating buffers, as the step will read them."""
    named = []

    def walk(value, name):
        if isinstance(value, torch.Tensor):
            if is_float(value):
                named.append((name, value.detach()))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}")

    if batch.get("mapping"):
        walk(dict(batch["kwargs"]), "batch")
    else:
        walk(tuple(batch["args"]), "batch.args")
        walk(dict(batch["kwargs"]), "batch")
    named += [(n, t.detach()) for n, t in model.named_parameters()] + [
        (n, t.detach()) for n, t in model.named_buffers() if is_float(t)]
    return named


def _nonfinite(named: list) -> set:
    """Names of the tensors in ``named`` holding a NaN/Inf (offline: the host sync is fine)."""
    recs = host_records([t for _, t in named])
    return {n for (n, _), r in zip(named, recs) if has_nonfinite(r)}


def _nonfinite_before(model: torch.nn.Module, batch: dict) -> list:
    named = _named_state(model, batch)
    bad = _nonfinite(named)
    return [n for n, _ in named if n in bad]

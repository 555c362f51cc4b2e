"""Replay a bundle's step and name the first op on the path to the failure.

``docs/replay.md`` says how to read the answer; this is how it is found.

1. **Provenance.** The step runs under a ``TorchDispatchMode`` that sees every aten op, forward and
   backward, functional ops inside modules included. An op whose output holds a NaN or Inf is an
   *origin* when its inputs were finite. An op with non-finite inputs passes on the origins those
   inputs carry -- looked up by the inputs' storage, so views, in-place writes (``masked_fill_``,
   ``add_``) and the tensors autograd saved for the backward keep their provenance -- and is an
   origin too when it also makes non-finite values of its own: re-running the op with its
   inputs' non-finite values replaced by finite ones (0, then 1) still gives NaN/Inf there.
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
import os
import traceback
import weakref
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map

from nanscan.allow import check_allow, name_allowed
from nanscan.capture.bundle import Bundle, load_bundle, restore_rng
from nanscan.record import TensorSummary
from nanscan.summary import records

_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib))
_NANSCAN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_META_KEY = "nanscan_forward"
# Ops whose written argument's earlier value is not read: it is output only.
_OVERWRITES = frozenset({"aten::copy_", "aten::fill_", "aten::zero_", "aten::set_", "aten::resize_",
                         "aten::resize_as_", "aten::detach_"})
# Re-running a collective would talk to the other ranks: those are never re-run.
_NO_RERUN = ("c10d", "_c10d_functional", "c10d_functional")
# The most step re-runs one replay spends telling apart the origins that reach the result.
MAX_TRIALS = 12


def _user_frame() -> Optional[str]:
    """``file:line in function`` of the innermost frame that is the user's code."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if f.startswith(_SKIP_DIRS) or frame.filename.startswith("<frozen") or (
                f.startswith(_NANSCAN_DIR) and os.path.basename(f) != "demo_model.py"):  # the demo's model is user code
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta"


def _float_tensors(value) -> list:
    return [t for t in tree_leaves(value) if _is_float(t)]


def _storage(t: torch.Tensor):
    """``t``'s storage object (one Python object per storage while it lives), or None for tensors
    without one (sparse, nested, some subclasses)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def _bad(rec) -> bool:
    return rec is not None and (rec[0] + rec[1] + rec[2]) > 0


def _records(tensors: list) -> list:
    """Host copies of the records of ``tensors``, one ``records`` call per device (an op may read
    a CPU scalar next to CUDA tensors). A tensor nanscan cannot summarize gets None."""
    out: list = [None] * len(tensors)
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    for idx in groups.values():
        try:
            recs = records([tensors[i].detach() for i in idx]).tolist()
        except (TypeError, ValueError, RuntimeError):
            recs = []
            for i in idx:
                t = tensors[i].detach()
                try:
                    recs.append(records([t._values() if t.is_sparse else t]).tolist()[0])
                except (TypeError, ValueError, RuntimeError):
                    recs.append(None)
        for i, r in zip(idx, recs):
            out[i] = r
    return out


def _summary(rec, t: torch.Tensor) -> Optional[TensorSummary]:
    return None if rec is None else TensorSummary.from_values(rec, t.dtype, t.shape)


def _finite(t: torch.Tensor, value: float) -> torch.Tensor:
    """A new tensor: ``t`` with its NaN/Inf replaced by ``value``."""
    t = t.detach()
    return torch.where(torch.isfinite(t), t, torch.full((), value, dtype=t.dtype, device=t.device))


class _ModuleStack:
    """Which module is running: global forward pre/post hooks push and pop qualified names."""

    def __init__(self, model: torch.nn.Module):
        self.names = {m: (n or "(model)") for n, m in model.named_modules()}
        self.stack: list = []
        self.handles: list = []

    def __enter__(self):
        reg = torch.nn.modules.module
        self.handles = [reg.register_module_forward_pre_hook(self._push),
                        reg.register_module_forward_hook(self._pop)]
        return self

    def _push(self, module, args):
        if module in self.names:
            self.stack.append(self.names[module])

    def _pop(self, module, args, output):
        if module in self.names and self.stack:
            self.stack.pop()

    def current(self) -> Optional[str]:
        return self.stack[-1] if self.stack else None

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _TagNodes(TorchFunctionMode):
    """Above autograd (unlike the dispatch mode, whose outputs have no grad_fn yet): tags each new
    autograd node with the module and user frame that created it, so that an op of the backward
    pass can be traced back to its forward module."""

    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        where = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and _META_KEY not in t.grad_fn.metadata:
                where = where or (self.modules.current(), _user_frame())
                t.grad_fn.metadata[_META_KEY] = where
        return out


@dataclasses.dataclass(eq=False)  # compared and hashed by identity: origins live in sets
class _Origin:
    """Where non-finite values came from. ``kind``: ``"op"`` an op of the step; ``"bundle"`` a
    parameter, buffer or batch tensor already non-finite before the step (``name``);
    ``"outside"`` a tensor made before the step that is none of those (``op`` / ``module``: its
    first reader); ``"unsure"`` an op that could not be re-run to tell whether it made non-finite
    values. ``how`` (ops): ``"finite"`` made from finite inputs, ``"made"`` made new non-finite
    values next to non-finite inputs, ``"allowed"`` took non-finite values out of an allowed module."""

    seq: int
    kind: str
    op: Optional[str] = None
    phase: Optional[str] = None
    module: Optional[str] = None
    stack: Optional[str] = None
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    how: str = "finite"
    allowed: bool = False
    name: Optional[str] = None
    storage: Any = None  # "outside": weak reference to the storage, to make it finite in a trial
    finite_inputs: tuple = ()  # "allowed": indices of the inputs a trial makes finite
    compiled: bool = False  # seen inside a compiled graph: no module, no line of the user's code

    def where(self) -> str:
        if self.module is not None:
            return self.module
        return "(module unknown: inside the compiled graph)" if self.compiled else "(outside any module)"

    def __str__(self) -> str:
        if self.kind == "bundle":
            return f"{self.name} (non-finite in the bundle, before the step)"
        if self.kind == "outside" and self.compiled:
            return (f"a value made inside the compiled graph, where the op search cannot see, first read by "
                    f"{self.op}")
        if self.kind == "outside":
            return (f"a tensor made before the step (not a parameter, buffer or batch tensor), first read by "
                    f"{self.op} in {self.where()}")
        return f"{self.op} in {self.phase}, module {self.where()}"


class _Provenance:
    """Storage -> the origins whose non-finite values were written into it. Keyed by the storage
    object, checked through a weak reference: a freed storage's entry goes with it, so an address
    reused by a later tensor never inherits it; nothing is kept alive for the replay's sake."""

    def __init__(self):
        self.entries: dict = {}

    def get(self, t: torch.Tensor) -> Optional[set]:
        s = _storage(t)
        entry = self.entries.get(id(s)) if s is not None else None
        return entry[1] if entry is not None and entry[0]() is s else None

    def add(self, t: torch.Tensor, origins) -> None:
        s = _storage(t)
        if s is None:
            return
        key = id(s)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is s:
            entry[1].update(origins)
            return
        ref = weakref.ref(s, lambda r, key=key: self._drop(key, r))
        self.entries[key] = (ref, set(origins))

    def _drop(self, key, ref) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry[0] is ref:
            del self.entries[key]


class _Rng:
    """The random state a seeded op (dropout, bernoulli_ ...) draws from, so that its re-runs
    draw the same numbers and the step after it draws what it would have."""

    def __init__(self, args, kwargs):
        gens = [g for g in tree_leaves((args, kwargs)) if isinstance(g, torch.Generator)]
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.gens = gens
        self.cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                            for d in devices if d.type == "cuda"})
        self.before = self._get()
        self.after = None

    def _get(self):
        return ([g.get_state() for g in self.gens], torch.get_rng_state(),
                [torch.cuda.get_rng_state(i) for i in self.cuda])

    def _set(self, state) -> None:
        gens, cpu, cuda = state
        for g, s in zip(self.gens, gens):
            g.set_state(s)
        torch.set_rng_state(cpu)
        for i, s in zip(self.cuda, cuda):
            torch.cuda.set_rng_state(s, i)

    @contextlib.contextmanager
    def rerun(self):
        if self.after is None:
            self.after = self._get()
        self._set(self.before)
        try:
            yield
        finally:
            self._set(self.after)


class _OpRun:
    """One op, run for real, with what it read and wrote; ``made()`` re-runs it with its inputs'
    non-finite values made finite to find the non-finite values it makes itself."""

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs
        written = _written(func, args, kwargs)
        self.written = [t for t, _ in written if _is_float(t)]
        overwritten = {id(t) for t, reads in written if not reads}
        seen: set = set()
        self.ins = []
        for t in tree_leaves((args, kwargs)):
            if _is_float(t) and id(t) not in overwritten and id(t) not in seen:
                seen.add(id(t))
                self.ins.append(t)
        self.in_recs = None
        self.prior: dict = {}
        if self.written:  # it overwrites what it reads: read it first
            self.in_recs = _records(self.ins)
            if any(_bad(r) for r in self.in_recs):  # the earlier values, for re-runs
                self.prior = {id(t): t.detach().clone() for t, _ in written if isinstance(t, torch.Tensor)}
        self.rng = _Rng(args, kwargs) if torch.Tag.nondeterministic_seeded in func.tags else None

    def run(self):
        out = self.func(*self.args, **self.kwargs)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        written = {id(t) for t in self.written}
        read = {id(s) for s in map(_storage, (t for t in tree_leaves((self.args, self.kwargs))
                                              if isinstance(t, torch.Tensor))) if s is not None}
        # A fresh output is written here; one sharing an input's storage (a view, detach) is not:
        # its provenance is the storage's already.
        self.kept = [i for i, t in enumerate(leaves) if _is_float(t) and id(t) not in written
                     and id(_storage(t)) not in read]
        self.outs = self.written + [leaves[i] for i in self.kept]
        return out

    def read_records(self) -> list:
        if self.in_recs is None:
            self.in_recs = _records(self.ins)
        return self.in_recs

    def rerunnable(self) -> bool:
        return self.func.namespace not in _NO_RERUN

    def made(self) -> Optional[list]:
        """Per output, a bool mask of the non-finite values the op makes with every non-finite
        input replaced by 0 and by 1 (both: a value that only one replacement makes, like x / 0,
        is the replacement's doing); None when it makes none."""
        bad = {id(t) for t, r in zip(self.ins, self.read_records()) if _bad(r)}
        masks = None
        for value in (0.0, 1.0):
            swap = {}
            for t in self.ins:
                if id(t) in bad:
                    swap[id(t)] = _finite(self.prior.get(id(t), t), value)
            for t in self.written:
                if id(t) not in swap:
                    swap[id(t)] = self.prior[id(t)].clone() if id(t) in self.prior else t.detach().clone()
            args, kwargs = tree_map(lambda x, swap=swap: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                                    (self.args, self.kwargs))
            with torch.no_grad(), (self.rng.rerun() if self.rng else contextlib.nullcontext()):
                res = self.func(*args, **kwargs)
            leaves = [t for t in tree_leaves(res) if isinstance(t, torch.Tensor)]
            outs = [swap[id(t)] for t in self.written] + [leaves[i] for i in self.kept]
            now = [~torch.isfinite(o) for o in outs]
            masks = now if masks is None else [a & b for a, b in zip(masks, now)]
            if not any(bool(m.any()) for m in masks):
                return None
        return masks


def _written(func, args, kwargs) -> list:
    """``(tensor, reads_it)`` for each tensor the op writes (``Tensor(a!)`` in its schema):
    ``reads_it`` False for outputs only (``out=``, ``copy_``'s destination, a random fill)."""
    schema = func._schema
    found = []
    overwrites = schema.name in _OVERWRITES or torch.Tag.nondeterministic_seeded in func.tags
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if (not a.kwarg_only and i < len(args)) else kwargs.get(a.name)
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor):
                found.append((t, not (a.kwarg_only or overwrites)))
    return found


@dataclasses.dataclass
class _Trial:
    """What one trial run makes finite: ops by their position in the step (``seq -> origin``),
    tensors from outside the step by storage, bundle tensors by name."""

    ops: dict
    outside: list
    bundle: set


class _StepMode(TorchDispatchMode):
    """Tracks provenance (``track``) or, in a trial, makes chosen origins finite."""

    def __init__(self, modules: Optional[_ModuleStack], allow: tuple, trial: Optional[_Trial] = None):
        super().__init__()
        self.modules, self.allow, self.trial = modules, allow, trial
        self.track = trial is None
        self.seq = 0
        self.phase = "forward"
        self.origins: list = []
        self.prov = _Provenance()
        self.diverged: Optional[str] = None
        self.last_bad: list = []  # backward: the outputs of the latest op that made or passed NaN/Inf
        self.blind: list = []  # ops whose outputs could not be summarized
        self.compiled = False  # ops run by a compiled graph: its frames are generated code

    # -- where an op runs
    def _where(self):
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            module, stack = node.metadata.get(_META_KEY, (None, None)) if node is not None else (None, None)
            return module, stack
        return (self.modules.current() if self.modules else None), None

    def _allowed(self, module: Optional[str]) -> bool:
        if module is None or not self.allow:
            return False
        names = (module, f"{module} (output grad)") if self.phase == "backward" else (module,)
        return any(name_allowed(n, self.allow) for n in names)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seq += 1
        if self.trial is not None:
            return self._trial_op(func, args, kwargs)
        # Allocators (empty, empty_like, new_empty ...) return uninitialized memory that may hold
        # NaN bit patterns: they make nothing, so they are never an origin.
        if not self.track or "empty" in func.__name__:
            return func(*args, **kwargs)
        return self._tracked_op(func, args, kwargs)

    def _tracked_op(self, func, args, kwargs):
        op = _OpRun(func, args, kwargs)
        out = op.run()
        if not op.outs:
            return out
        out_recs = _records(op.outs)
        self.blind += [str(func) for r in out_recs if r is None]
        if not any(_bad(r) for r in out_recs):
            return out
        in_recs = op.read_records()
        module, stack = self._where()
        bad_ins = [(i, t) for i, (t, r) in enumerate(zip(op.ins, in_recs)) if _bad(r)]
        if not bad_ins:
            carried = {self._origin(func, op, in_recs, out_recs, module, stack, "finite")}
        else:
            carried, per_input = set(), []
            for i, t in bad_ins:
                got = self.prov.get(t)
                if got is None:  # non-finite, and no op of the step wrote it
                    got = {self._outside(t, func, module)}
                per_input.append((i, got))
                carried |= got
            if not self._allowed(module):
                passed = {o for o in carried if o.allowed}
                if passed:  # allowed values leave their module here and make something non-finite
                    carried -= passed
                    origin = self._origin(func, op, in_recs, out_recs, module, stack, "allowed")
                    origin.finite_inputs = tuple(i for i, got in per_input if got <= passed)
                    carried.add(origin)
            try:
                made = op.made() if op.rerunnable() else False
            except Exception:  # the op cannot run on other values: unsure whether it made any
                made = False
            if made is False:
                carried.add(self._origin(func, op, in_recs, out_recs, module, stack, "made", kind="unsure"))
            elif made is not None:
                carried.add(self._origin(func, op, in_recs, out_recs, module, stack, "made"))
        for t, r in zip(op.outs, out_recs):
            if _bad(r):
                self.prov.add(t, carried)
        if self.phase == "backward":
            self.last_bad = [t for t, r in zip(op.outs, out_recs) if _bad(r)]
        return out

    def _origin(self, func, op, in_recs, out_recs, module, stack, how, kind="op") -> _Origin:
        if stack is None and self.phase == "forward" and not self.compiled:
            stack = _user_frame()
        origin = _Origin(seq=self.seq, kind=kind, op=str(func), phase=self.phase, module=module, stack=stack,
                         inputs=[_summary(r, t) for r, t in zip(in_recs, op.ins)],
                         outputs=[_summary(r, t) for r, t in zip(out_recs, op.outs)], how=how,
                         allowed=self._allowed(module), compiled=self.compiled)
        self.origins.append(origin)
        return origin

    def _outside(self, t, func, module) -> _Origin:
        s = _storage(t)
        origin = _Origin(seq=0, kind="outside", op=str(func), phase=self.phase, module=module,
                         storage=weakref.ref(s) if s is not None else None, compiled=self.compiled)
        self.origins.append(origin)
        self.prov.add(t, {origin})
        return origin

    # -- trials
    def _trial_op(self, func, args, kwargs):
        trial = self.trial
        if trial.outside:  # a tensor from outside the step is read as finite (never written: it is the user's)
            stores = [s for s in (r() for r in trial.outside) if s is not None]
            written = {id(t) for t, _ in _written(func, args, kwargs)}
            args, kwargs = tree_map(
                lambda x: _finite(x, 0.0) if _is_float(x) and id(x) not in written
                and any(_storage(x) is s for s in stores) else x, (args, kwargs))
        origin = trial.ops.get(self.seq)
        if origin is None:
            return func(*args, **kwargs)
        if str(func) != origin.op:
            self.diverged = self.diverged or f"op {self.seq} of the step was {func}, not {origin.op}"
            return func(*args, **kwargs)
        op = _OpRun(func, args, kwargs)
        if origin.how == "allowed":  # the allowed values it took are read as finite
            chosen = [op.ins[i] for i in origin.finite_inputs if i < len(op.ins)]
            written = {id(t) for t in op.written}
            with torch.no_grad():
                for t in chosen:
                    if id(t) in written:  # an in-place op returns what it wrote: make it finite where it is
                        t.copy_(_finite(t, 0.0))
            swap = {id(t): _finite(t, 0.0) for t in chosen if id(t) not in written}
            args, kwargs = tree_map(lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            return func(*args, **kwargs)
        out = op.run()
        made = [~torch.isfinite(o) for o in op.outs]
        if origin.how == "made" and any(_bad(r) for r in op.read_records()):
            try:
                made = op.made()
            except Exception as e:  # (it ran in the replay itself; here it does not)
                self.diverged = self.diverged or f"{func} could not be re-run ({type(e).__name__}: {e})"
                return out
        with torch.no_grad():
            for o, m in zip(op.outs, made or ()):
                o.copy_(torch.where(m, torch.zeros((), dtype=o.dtype, device=o.device), o))
        return out


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
        self.mode: Optional[_StepMode] = None
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

    def __call__(self, mode: _StepMode, anomaly: bool = False, finite_before=(), backward=None) -> _Outcome:
        model = self.model
        b, batch, device = prepare(self.bundle, model, self.precision)
        for p in model.parameters():
            p.grad = None  # this step's gradients only
        named = _named_state(model, batch)
        before = _nonfinite(named)
        with torch.no_grad():
            for name, t in named:
                if name in before and name in finite_before:
                    t.copy_(_finite(t, 0.0))
        modules = _ModuleStack(model)
        mode.modules = modules
        if mode.track:  # values already non-finite in the bundle are origins of their own
            for name, t in named:
                if name in before:
                    origin = _Origin(seq=0, kind="bundle", name=name)
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
                    with (_TagNodes(modules) if tag else contextlib.nullcontext()), \
                            (mode if self.backend is None else contextlib.nullcontext()), \
                            _autocast(b.manifest, device, self.precision):
                        result = run_step(model, batch, self.forward, self.backend)
                    leaves = _result_leaves(result)
                    run_backward = self.backward if backward is None else backward
                    if run_backward and isinstance(result, torch.Tensor) and result.requires_grad \
                            and result.numel() == 1:
                        # Once the result itself is non-finite, the backward cannot change the answer.
                        mode.track = mode.track and not any(_bad(r) for r in _records([t for _, t in leaves]))
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
        return [("result", result.detach())] if _is_float(result) else []
    try:
        flat = tree_flatten_with_path(result)[0]
    except Exception:  # an object pytree cannot walk: its tensors, unnamed
        return [(f"result[{i}]", t.detach()) for i, t in enumerate(_float_tensors(result))]
    return [(f"result{keystr(path)}", t.detach()) for path, t in flat if _is_float(t)]


def _failed(outcome: _Outcome, kind: str) -> tuple:
    """(what went non-finite, in words; its tensors) for the target ``kind``: ``"result"`` (what
    forward returned: ``result``, ``result[1]``, ``result['loss']``) or ``"gradient"``."""
    if kind == "result":
        recs = _records([t for _, t in outcome.leaves])
        bad = [(n, t) for (n, t), r in zip(outcome.leaves, recs) if _bad(r)]
    else:
        grads = [(n, g) for n, g in outcome.grads if _is_float(g)]
        recs = _records([g for _, g in grads])
        bad = [(f"the gradient of {n}", g) for (n, g), r in zip(grads, recs) if _bad(r)]
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
    reset. See ``docs/replay.md`` for how to read the answer."""
    allow = check_allow(allow, "nanscan.replay")
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    runner = _Runner(b, model, forward, precision, compile_backend, backward, allow)
    mode = _StepMode(None, allow)
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
        trial = _Trial(ops={o.seq: o for o in finite if o.kind in ("op", "unsure")},
                       outside=[o.storage for o in finite if o.kind == "outside" and o.storage is not None],
                       bundle={o.name for o in finite if o.kind == "bundle"})
        mode = _StepMode(None, runner.allow, trial)
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
    recs = _records([t for _, t in leaves])
    for (_, t), r in zip(leaves, recs):
        if _bad(r):
            return _summary(r, t)
    return _summary(recs[0], leaves[0][1])


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
            if _is_float(value):
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
        (n, t.detach()) for n, t in model.named_buffers() if _is_float(t)]
    return named


def _nonfinite(named: list) -> set:
    """Names of the tensors in ``named`` holding a NaN/Inf (offline: the host sync is fine)."""
    recs = _records([t for _, t in named])
    return {n for (n, _), r in zip(named, recs) if _bad(r)}


def _nonfinite_before(model: torch.nn.Module, batch: dict) -> list:
    named = _named_state(model, batch)
    bad = _nonfinite(named)
    return [n for n, _ in named if n in bad]

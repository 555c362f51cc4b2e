"""Provenance of non-finite values in one replayed step: which op made them, and which ops only
passed them on.

The step runs under :class:`StepMode`, a ``TorchDispatchMode`` that sees every aten op, forward and
backward, functional ops inside modules included. An op whose output holds a NaN or Inf is an
*origin* when its inputs were finite. An op with non-finite inputs passes on the origins those
inputs carry -- looked up by the inputs' storage, so views, in-place writes (``masked_fill_``,
``add_``) and the tensors autograd saved for the backward keep their provenance -- and is an
origin too when it also makes non-finite values of its own: re-running the op with its inputs'
non-finite values replaced by finite ones (0, then 1) still gives NaN/Inf there.

In a *trial* (``StepMode(..., trial=Trial)``) the same mode makes chosen origins' values finite
instead, so that :mod:`nanscan.capture.replay` can tell apart origins that reach one result.
:class:`ModuleStack` and :class:`TagNodes` name the module each op ran in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
import weakref
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from nanscan.allow import name_allowed
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


def _user_frame() -> Optional[str]:
    """``file:line in function`` of the innermost frame that is the user's code."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if f.startswith(_SKIP_DIRS) or frame.filename.startswith("<frozen") or (
                f.startswith(_NANSCAN_DIR) and os.path.basename(f) != "demo_model.py"):  # the demo's model is user code
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta"


def float_tensors(value) -> list:
    return [t for t in tree_leaves(value) if is_float(t)]


def _storage(t: torch.Tensor):
    """``t``'s storage object (one Python object per storage while it lives), or None for tensors
    without one (sparse, nested, some subclasses)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def has_nonfinite(rec) -> bool:
    return rec is not None and (rec[0] + rec[1] + rec[2]) > 0


def host_records(tensors: list) -> list:
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


def summary_of(rec, t: torch.Tensor) -> Optional[TensorSummary]:
    return None if rec is None else TensorSummary.from_values(rec, t.dtype, t.shape)


def made_finite(t: torch.Tensor, value: float) -> torch.Tensor:
    """A new tensor: ``t`` with its NaN/Inf replaced by ``value``."""
    t = t.detach()
    return torch.where(torch.isfinite(t), t, torch.full((), value, dtype=t.dtype, device=t.device))


class ModuleStack:
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


class TagNodes(TorchFunctionMode):
    """Above autograd (unlike the dispatch mode, whose outputs have no grad_fn yet): tags each new
    autograd node with the module and user frame that created it, so that an op of the backward
    pass can be traced back to its forward module."""

    def __init__(self, modules: ModuleStack):
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
class Origin:
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
        self.written = [t for t, _ in written if is_float(t)]
        overwritten = {id(t) for t, reads in written if not reads}
        seen: set = set()
        self.ins = []
        for t in tree_leaves((args, kwargs)):
            if is_float(t) and id(t) not in overwritten and id(t) not in seen:
                seen.add(id(t))
                self.ins.append(t)
        self.in_recs = None
        self.prior: dict = {}
        if self.written:  # it overwrites what it reads: read it first
            self.in_recs = host_records(self.ins)
            if any(has_nonfinite(r) for r in self.in_recs):  # the earlier values, for re-runs
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
        self.kept = [i for i, t in enumerate(leaves) if is_float(t) and id(t) not in written
                     and id(_storage(t)) not in read]
        self.outs = self.written + [leaves[i] for i in self.kept]
        return out

    def read_records(self) -> list:
        if self.in_recs is None:
            self.in_recs = host_records(self.ins)
        return self.in_recs

    def rerunnable(self) -> bool:
        return self.func.namespace not in _NO_RERUN

    def made(self) -> Optional[list]:
        """Per output, a bool mask of the non-finite values the op makes with every non-finite
        input replaced by 0 and by 1 (both: a value that only one replacement makes, like x / 0,
        is the replacement's doing); None when it makes none."""
        bad = {id(t) for t, r in zip(self.ins, self.read_records()) if has_nonfinite(r)}
        masks = None
        for value in (0.0, 1.0):
            swap = {}
            for t in self.ins:
                if id(t) in bad:
                    swap[id(t)] = made_finite(self.prior.get(id(t), t), value)
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
class Trial:
    """What one trial run makes finite: ops by their position in the step (``seq -> origin``),
    tensors from outside the step by storage, bundle tensors by name."""

    ops: dict
    outside: list
    bundle: set


class StepMode(TorchDispatchMode):
    """Tracks provenance (``track``) or, in a trial, makes chosen origins finite."""

    def __init__(self, modules: Optional[ModuleStack], allow: tuple, trial: Optional[Trial] = None):
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
        out_recs = host_records(op.outs)
        self.blind += [str(func) for r in out_recs if r is None]
        if not any(has_nonfinite(r) for r in out_recs):
            return out
        in_recs = op.read_records()
        module, stack = self._where()
        bad_ins = [(i, t) for i, (t, r) in enumerate(zip(op.ins, in_recs)) if has_nonfinite(r)]
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
            if has_nonfinite(r):
                self.prov.add(t, carried)
        if self.phase == "backward":
            self.last_bad = [t for t, r in zip(op.outs, out_recs) if has_nonfinite(r)]
        return out

    def _origin(self, func, op, in_recs, out_recs, module, stack, how, kind="op") -> Origin:
        if stack is None and self.phase == "forward" and not self.compiled:
            stack = _user_frame()
        origin = Origin(seq=self.seq, kind=kind, op=str(func), phase=self.phase, module=module, stack=stack,
                         inputs=[summary_of(r, t) for r, t in zip(in_recs, op.ins)],
                         outputs=[summary_of(r, t) for r, t in zip(out_recs, op.outs)], how=how,
                         allowed=self._allowed(module), compiled=self.compiled)
        self.origins.append(origin)
        return origin

    def _outside(self, t, func, module) -> Origin:
        s = _storage(t)
        origin = Origin(seq=0, kind="outside", op=str(func), phase=self.phase, module=module,
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
                lambda x: made_finite(x, 0.0) if is_float(x) and id(x) not in written
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
                        t.copy_(made_finite(t, 0.0))
            swap = {id(t): made_finite(t, 0.0) for t in chosen if id(t) not in written}
            args, kwargs = tree_map(lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            return func(*args, **kwargs)
        out = op.run()
        made = [~torch.isfinite(o) for o in op.outs]
        if origin.how == "made" and any(has_nonfinite(r) for r in op.read_records()):
            try:
                made = op.made()
            except Exception as e:  # (it ran in the replay itself; here it does not)
                self.diverged = self.diverged or f"{func} could not be re-run ({type(e).__name__}: {e})"
                return out
        with torch.no_grad():
            for o, m in zip(op.outs, made or ()):
                o.copy_(torch.where(m, torch.zeros((), dtype=o.dtype, device=o.device), o))
        return out

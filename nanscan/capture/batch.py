"""The batch a bundle keeps: independent clones of what entered the step, and what could not be kept
(the rules: "Batches" in :mod:`nanscan.capture.bundle`)."""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import Optional

import torch

from nanscan.capture.bundle_format import _MAX_DEPTH

# Kept in memory with a cloned batch, never in batch.pt: write_bundle moves "dropped", "dropped_total"
# and "types" into the manifest (batch_dropped ...); "dataclasses" only says what to warn about.
_NOTE_KEYS = ("dropped", "dropped_total", "types", "dataclasses")
_MAX_NOTED = 256  # batch_dropped / batch_types entries a manifest lists (a batch may hold millions)
_SCALARS = (bool, int, float, str)


def _qualname(cls) -> str:
    module = getattr(cls, "__module__", None)
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "?")
    return name if module in (None, "builtins") else f"{module}.{name}"


class _Cloner:
    """Clones a batch into what ``weights_only`` loading accepts (see the module docstring).
    ``strict``: an element that cannot be stored raises ``TypeError``; otherwise it becomes None
    and is noted in ``dropped``."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.dropped: list = []  # [(path, qualified type name)], the first _MAX_NOTED
        self.dropped_total = 0
        self.types: dict = {}  # path -> qualified type name of a converted element
        self.dataclasses: list = []  # [(path, qualified type name)]
        self._active: set = set()  # ids of the containers being cloned: a cycle is refused

    def _convert(self, path: str, value) -> None:
        if len(self.types) < _MAX_NOTED:
            self.types[path] = _qualname(type(value))

    def drop(self, value, path: str, why: str = ""):
        if self.strict:
            raise TypeError(f"nanscan: cannot store a batch element of type {type(value).__name__}{why}; a bundle "
                            "holds tensors, numbers, strings and lists / tuples / dicts / dataclasses of them")
        self.dropped_total += 1
        if len(self.dropped) < _MAX_NOTED:
            self.dropped.append((path, _qualname(type(value))))
        return None

    def clone(self, value, path: str, depth: int = 0):
        if isinstance(value, torch.Tensor):
            if self.strict:
                return value.detach().clone()
            try:
                return value.detach().clone()
            except Exception:  # an exotic tensor (a subclass that refuses clone): not kept, never raised
                return self.drop(value, path)
        if value is None or type(value) in _SCALARS:
            return value
        if isinstance(value, _SCALARS):  # an IntEnum, a numpy float64: stored as the plain number / string
            base = next(t for t in _SCALARS if isinstance(value, t))
            self._convert(path, value)
            return {bool: bool, int: int.__index__, float: float.__float__, str: str.__str__}[base](value)
        if depth >= _MAX_DEPTH:  # its elements would nest deeper than load_bundle accepts
            return self.drop(value, path, f" nested deeper than {_MAX_DEPTH} levels")
        if id(value) in self._active:
            return self.drop(value, path, " that contains itself")
        self._active.add(id(value))
        try:
            return self._container(value, path, depth)
        except Exception:  # a mapping whose items() raises, a field whose getattr raises: dropped
            if self.strict:
                raise
            return self.drop(value, path)
        finally:
            self._active.discard(id(value))

    def _container(self, value, path: str, depth: int):
        if isinstance(value, collections.abc.Mapping):  # dict, OrderedDict, ModelOutput, BatchEncoding
            if type(value) is not dict:
                self._convert(path, value)
            return {str(k): self.clone(v, f"{path}.{k}", depth + 1) for k, v in list(value.items())}
        if isinstance(value, (list, tuple)):
            if type(value) not in (list, tuple):  # a namedtuple, torch.Size
                self._convert(path, value)
            return [self.clone(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._convert(path, value)
            if len(self.dataclasses) < _MAX_NOTED:
                self.dataclasses.append((path, _qualname(type(value))))
            # (getattr's default: a field(init=False) never set)
            return {f.name: self.clone(getattr(value, f.name, None), f"{path}.{f.name}", depth + 1)
                    for f in dataclasses.fields(value)}
        return self.drop(value, path)

    def finish(self, batch: dict) -> dict:
        if self.dropped:
            batch["dropped"] = [{"path": p, "type": t} for p, t in self.dropped]
            batch["dropped_total"] = self.dropped_total
        if self.types:
            batch["types"] = dict(self.types)
        if self.dataclasses:
            batch["dataclasses"] = [{"path": p, "type": t} for p, t in self.dataclasses]
        return batch


def clone_batch(args=(), kwargs=None, *, strict: bool = True) -> dict:
    """Independent copies of the tensors of a batch given as a whole (``mon.step(batch)``,
    ``capture_bundle``), taken before the forward: nested lists / tuples / mappings / dataclasses
    kept as lists and dicts, other leaves ints, floats, bools, strings or None (module docstring,
    "Batches"). A mapping given alone is stored as keyword arguments (HF-style ``model(**batch)``).
    Anything else raises ``TypeError``, or with ``strict=False`` becomes None and is listed under
    the result's ``"dropped"`` key (``write_bundle`` moves it and ``"types"`` into the manifest)."""
    c = _Cloner(strict)
    if isinstance(args, collections.abc.Mapping) and not kwargs:  # model(**batch), kept as keyword arguments
        return c.finish({"args": [], "kwargs": c.clone(args, "kwargs"), "single": False, "mapping": True})
    single = not isinstance(args, (tuple, list))
    if not single and type(args) not in (tuple, list):
        c._convert("args", args)
    args = [args] if single else list(args)
    return c.finish({"args": [c.clone(v, f"args[{i}]", 1) for i, v in enumerate(args)],
                     "kwargs": c.clone(dict(kwargs or {}), "kwargs"), "single": single})


def clone_forward_inputs(args=(), kwargs=None, *, strict: bool = False) -> dict:
    """Like :func:`clone_batch`, for the inputs of a forward call ``model(*args, **kwargs)``,
    stored in the form of the call so that replay makes the same call: ``model(x)`` (``x`` a
    tensor, a dict, a ``BatchEncoding``, a dataclass ...) as ``"single"``, ``model(**batch)`` as
    ``"mapping"``, anything else as args and kwargs. Not strict by default: this runs inside the
    watched forward, which a batch the bundle cannot store must never stop."""
    c = _Cloner(strict)
    args, kwargs = tuple(args), dict(kwargs or {})
    if not args and kwargs:  # model(**batch)
        return c.finish({"args": [], "kwargs": c.clone(kwargs, "kwargs"), "single": False, "mapping": True})
    if len(args) == 1 and not kwargs:  # model(x)
        return c.finish({"args": [c.clone(args[0], "args[0]", 1)], "kwargs": {}, "single": True})
    return c.finish({"args": [c.clone(v, f"args[{i}]", 1) for i, v in enumerate(args)],
                     "kwargs": c.clone(kwargs, "kwargs"), "single": False})


def batch_notices(batch: Optional[dict]) -> list:
    """``[(kind, message)]`` about what of a cloned batch was not stored as it was given: kind
    ``"dropped"`` (elements stored as None) and ``"dataclass"`` (stored as dicts of their fields).
    The monitor warns each kind once."""
    if not batch:
        return []
    out = []
    dropped = batch.get("dropped") or []
    if dropped:
        total = max(batch.get("dropped_total") or 0, len(dropped))
        shown = ", ".join(f"{d['path']} ({d['type']})" for d in dropped[:6]) + (
            f" and {total - 6} more" if total > 6 else "")
        out.append(("dropped", f"nanscan: the failure bundle cannot store {shown} of the batch -- a bundle holds "
                               "tensors, numbers, strings, None and lists / dicts / dataclasses of them -- so it "
                               "keeps None in place of each (listed under batch_dropped in the manifest) and every "
                               "tensor around them; training is not affected. A replay needs forward= to rebuild "
                               "them. (Warned once per monitor.)"))
    classes = batch.get("dataclasses") or []
    if classes:
        shown = ", ".join(f"{d['path']} ({d['type']})" for d in classes[:6]) + (
            f" and {len(classes) - 6} more" if len(classes) > 6 else "")
        name = classes[0]["type"].rsplit(".", 1)[-1]
        out.append(("dataclass", f"nanscan: the batch holds dataclass instances, {shown}: the failure bundle keeps "
                                 "the fields of each as a dict (the class is named under batch_types in the "
                                 "manifest), and replay passes that dict -- a bundle loads without unpickling, so "
                                 "it cannot rebuild the class. A model that needs the class itself replays with "
                                 f"forward=, e.g. forward=lambda model, b: model({name}(**b)). "
                                 "(Warned once per monitor.)"))
    return out

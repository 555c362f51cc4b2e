"""NaN-safe strict JSON and the JSONL event log (docs/logs-and-reports.md says what a user sees).

**Encoding** (:func:`encode`, :func:`dumps`, :func:`dump`): the output always passes
``json.dumps(..., allow_nan=False)`` (forced). A non-finite float becomes
``{"finite": false, "value": "nan" | "inf" | "-inf"}`` (:func:`nanscan.jsonl.encode_float`); nothing is
replaced by 0 or dropped. Dict keys go through ``str()`` (two keys with the same ``str`` are a
``ValueError``); tuples, lists, ``torch.Size`` -> lists; sets -> sorted lists (unsorted if not
sortable); numpy scalars -> bool / int / float; a numpy array or torch tensor with at most
``max_elements`` (64) elements -> its values as nested lists (bool / int / float as its dtype);
a larger one -> its ``TensorSummary.to_dict()`` plus ``"__summary__": true`` (reference backend, any
device; the tensor is not kept). Complex values (scalar, array, tensor) ->
``{"real": ..., "imag": ...}``. ``torch.dtype`` -> ``"float32"`` (no ``torch.`` prefix, as in
``TensorSummary.to_dict``), ``torch.device`` -> ``"cuda:0"``, datetime / date / time -> isoformat,
paths -> str, objects with ``to_dict()`` -> that (first), dataclasses -> dict of their fields. Anything
else is a ``TypeError`` naming its type. numpy is never imported here: its branches apply only
when the caller already imported it.

**Decoding** (:func:`loads`, :func:`load`): every object with exactly the keys ``finite`` (false) and
``value`` ("nan" / "inf" / "-inf") becomes that float, at any depth.

**Event log** (:class:`EventLog`): one JSON object per line (UTF-8, ASCII-only, ``\\n``-terminated),
appended, never truncated. Every line has ``type``, ``rank`` and ``time`` (UTC ISO-8601); all but the
header also have ``step`` (an int, or null for events outside a step)::

    {"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "...", "pid": 1234}
    {"type": "step", "step": 7, "rank": 0, "time": "...", <caller fields: loss, grad_norm,
     loss_scale, lr, update ("applied" | "skipped" | null), nonfinite ({phase: count})>}
    {"type": "incident", "step": 7, "rank": 0, "time": "...", "incident": {Incident.to_dict()},
     "bundle": "runs/nan/step000007-rank0" | null}
    {"type": <kind>, "step": null, "rank": 0, "time": "...", <fields>}      # EventLog.event
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch

from nanscan import _version, jsonl
from nanscan.record import TensorSummary, json_float

MAX_ELEMENTS = 64


def _type_name(obj) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _summarize(x: torch.Tensor):
    """The tensor's summary with the default kernels (one pass, no copy), the reference only when
    the compiled library is missing (it makes temporaries several times the tensor's size)."""
    from nanscan.summary import summarize  # lazy: nanscan/__init__ may import this module
    from nanscan._ops import ExtensionError

    try:
        return summarize(x)
    except ExtensionError:
        return summarize(x, backend="reference")


def _summary(x: torch.Tensor) -> dict:
    if x.dtype in _WIDE_UNSIGNED:  # finite by definition; not a kernel dtype
        d = _summarize(x.to(torch.float64 if x.dtype == torch.uint64 else torch.int64)).to_dict()
        return {"__summary__": True, **d, "dtype": str(x.dtype).replace("torch.", "")}
    return {"__summary__": True, **_summarize(x).to_dict()}


def _encodable_dtype(dtype: torch.dtype) -> bool:
    from nanscan.kernels.reference import supports_dtype

    return dtype in _WIDE_UNSIGNED or supports_dtype(dtype)


def _tensor(x: torch.Tensor, max_elements: int, seen) -> Any:
    x = x.detach()
    if x.is_nested:
        raise TypeError(f"nanscan.log cannot encode a nested tensor ({x.dtype}); encode its components "
                        f"(list(x.unbind()))")
    if x.layout != torch.strided or x.is_quantized or x.device.type == "meta":
        what = "meta" if x.device.type == "meta" else ("quantized" if x.is_quantized else str(x.layout))
        raise TypeError(f"nanscan.log cannot encode a {what} tensor ({x.dtype}{list(x.shape)})")
    if not _encodable_dtype(x.dtype):
        raise TypeError(f"nanscan.log cannot encode a tensor of dtype {x.dtype} (sub-byte, bits and other "
                        f"storage-only dtypes have no values to write); convert it first")
    if x.numel() > max_elements:
        return _summary(x)
    if x.is_complex():
        return {"real": encode(x.real, max_elements, seen), "imag": encode(x.imag, max_elements, seen)}
    x = x.cpu()
    return encode((x.double() if x.is_floating_point() else x).tolist(), max_elements, seen)


def _numpy(obj, np, max_elements: int, seen) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "c":
            return {"real": encode(obj.real, max_elements, seen), "imag": encode(obj.imag, max_elements, seen)}
        if obj.size <= max_elements or obj.dtype.kind not in "biuf":
            return encode(obj.tolist(), max_elements, seen)  # elementwise; object arrays recurse
        try:
            t = torch.from_numpy(np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("=")))
        except TypeError as e:
            raise TypeError(f"nanscan.log cannot summarize a numpy array of dtype {obj.dtype}: {e}") from None
        return _summary(t)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return json_float(float(obj))
    if isinstance(obj, np.complexfloating):
        return encode(complex(obj), max_elements, seen)
    raise TypeError(f"nanscan.log cannot encode an object of type {_type_name(obj)}")


def encode(obj: Any, max_elements: int = MAX_ELEMENTS, _seen: Optional[set] = None) -> Any:
    """``obj`` as plain JSON data (dict / list / str / int / float / bool / None) with every float
    finite; see the module docstring for the rules. Keeps no reference to ``obj`` or its tensors."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return json_float(float(obj))
    if isinstance(obj, complex):
        return {"real": json_float(obj.real), "imag": json_float(obj.imag)}
    if isinstance(obj, TensorSummary):
        return obj.to_dict()
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, torch.device):
        return str(obj)
    if isinstance(obj, (datetime.date, datetime.time)):
        return obj.isoformat()
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        raise ValueError(f"nanscan.log: circular reference through a {_type_name(obj)}")
    seen.add(id(obj))
    try:
        return _container(obj, max_elements, seen)
    finally:
        seen.discard(id(obj))


def _container(obj, max_elements: int, seen) -> Any:
    if isinstance(obj, torch.Tensor):
        return _tensor(obj, max_elements, seen)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            key = str(k)
            if key in out:
                raise ValueError(f"nanscan.log: two keys of a dict are both {key!r} as strings")
            out[key] = encode(v, max_elements, seen)
        return out
    if isinstance(obj, (list, tuple)):  # torch.Size and namedtuples included
        return [encode(v, max_elements, seen) for v in obj]
    if isinstance(obj, (set, frozenset)):
        try:
            items = sorted(obj)
        except TypeError:
            items = list(obj)
        return [encode(v, max_elements, seen) for v in items]
    np = sys.modules.get("numpy")  # numpy objects exist only if numpy was imported
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _numpy(obj, np, max_elements, seen)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict) and not isinstance(obj, type):
        return encode(to_dict(), max_elements, seen)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: encode(getattr(obj, f.name), max_elements, seen) for f in dataclasses.fields(obj)}
    raise TypeError(f"nanscan.log cannot encode an object of type {_type_name(obj)}")


def dumps(obj: Any, *, max_elements: int = MAX_ELEMENTS, **kw) -> str:
    """Strict JSON text of ``obj`` (``allow_nan=False`` is forced; other ``json.dumps`` options pass).
    Nesting too deep to encode is a ``ValueError``."""
    kw["allow_nan"] = False
    try:
        return json.dumps(encode(obj, max_elements), **kw)
    except RecursionError:
        raise ValueError(f"nanscan.log: {jsonl.MAX_DEPTH_MESSAGE}") from None


def dump(obj: Any, fp, *, max_elements: int = MAX_ELEMENTS, **kw) -> None:
    fp.write(dumps(obj, max_elements=max_elements, **kw))


def loads(s) -> Any:
    """Parse JSON; ``{"finite": false, "value": "nan"|"inf"|"-inf"}`` objects become floats
    (:func:`nanscan.jsonl.loads`: anything that is not JSON, too deep nesting included, is a
    ``ValueError``)."""
    return jsonl.loads(s)


def load(fp) -> Any:
    return loads(fp.read())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _make_parent_directories(path: pathlib.Path) -> None:
    """Create the missing directories above ``path``. One of them that exists as a file is a
    ``NotADirectoryError`` naming it: mkdir's own error names only the directory it tried to make
    ("File exists: 'runs'" for ``runs/events.jsonl`` where ``runs`` is a file), and a warning that
    shows the error's repr loses even that."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        in_the_way = next((p for p in path.parents if os.path.lexists(p) and not p.is_dir()), None)
        if in_the_way is None:  # (not a file in the way after all: mkdir's error is the better one)
            raise
        what = "is a file, not a directory" if in_the_way.is_file() else "exists and is not a directory"
        raise NotADirectoryError(f"nanscan EventLog: cannot create {path}: {in_the_way} {what}; give a path "
                                 "under a directory (missing directories are created)") from None


class EventLog:
    """Append-only JSONL event log of one rank (format: module docstring).

    ``rank=None`` takes ``torch.distributed.get_rank()`` when initialized, else 0. The file is
    ``path`` itself in a single-process run (world size 1 and rank 0); otherwise each rank writes its
    own ``<stem>.rank<R><suffix>`` (``.jsonl`` if ``path`` has no suffix) next to ``path``, rank 0
    included -- ``self.path`` is the file actually written. Missing parent directories are created; a
    parent that is a file (``NotADirectoryError``, naming it) or a ``path`` that is a directory
    (``IsADirectoryError``) is refused here, before any step. Each line is encoded before anything is
    written (an unencodable field is a ``TypeError`` and leaves the file untouched) and written with
    one ``write``; ``step``/``event`` flush, ``incident`` and ``close`` flush and ``os.fsync``. A
    failed write raises its ``OSError``: the log never swallows it
    (``nanscan.guard`` attaches it to the training error it was recording).
    """

    _RESERVED = ("type", "step", "rank", "time")

    def __init__(self, path, rank: Optional[int] = None):
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = int(rank) if rank is not None else (dist.get_rank() if initialized else 0)
        world = dist.get_world_size() if initialized else 1
        path = pathlib.Path(path)
        if world > 1 or self.rank != 0:
            path = path.with_name(f"{path.stem}.rank{self.rank}{path.suffix or '.jsonl'}")
        self.path = path
        self._lock = threading.Lock()
        _make_parent_directories(path)
        if path.is_dir():
            raise IsADirectoryError(f"nanscan EventLog: {path} is a directory; give a file path "
                                    f"(such as {path / 'events.jsonl'})")
        torn = False  # a torn last line (crash mid-write) must not swallow our header
        if path.is_file() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._file = open(path, "a", encoding="utf-8", newline="\n")
        try:
            if torn:
                self._file.write("\n")
            self._write({"type": "header", "nanscan": _version.__version__, "rank": self.rank,
                         "time": _now(), "pid": os.getpid()}, fsync=False)
        except BaseException:  # (a full disk: do not leak the file descriptor)
            self._file.close()
            raise

    def _write(self, record: dict, fsync: bool) -> None:
        line = dumps(record) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"nanscan EventLog {self.path} is closed")
            self._file.write(line)
            self._file.flush()
            if fsync:
                os.fsync(self._file.fileno())

    def _record(self, kind: str, step, fields: dict) -> dict:
        clash = [k for k in fields if k in self._RESERVED]
        if clash:
            raise ValueError(f"nanscan EventLog: fields {clash} are reserved ({', '.join(self._RESERVED)})")
        return {"type": kind, "step": None if step is None else int(step), "rank": self.rank, "time": _now(),
                **fields}

    def step(self, step: int, **fields) -> None:
        """One line per step: ``loss``, ``grad_norm``, ``loss_scale``, ``lr``, ``update``, ``nonfinite``..."""
        self._write(self._record("step", step, fields), fsync=False)

    def incident(self, incident, bundle=None, step: Optional[int] = None) -> None:
        """An incident (an ``Incident``, a dict or anything with ``to_dict``); ``step`` defaults to its
        own. Flushed and fsynced: this is the line that must survive the crash that follows."""
        data = encode(incident)
        if step is None and isinstance(data, dict):
            step = data.get("step")
        record = self._record("incident", step, {})
        record.update(incident=data, bundle=None if bundle is None else str(bundle))
        self._write(record, fsync=True)

    def event(self, kind: str, step: Optional[int] = None, *, fsync: bool = False, **fields) -> None:
        """Any other event (e.g. ``"exception"`` from ``nanscan.guard``), fsynced when ``fsync``;
        ``kind`` may not be "header", "step" or "incident" (use their methods)."""
        if not isinstance(kind, str) or kind in ("header", "step", "incident"):
            raise ValueError(f"nanscan EventLog.event: kind {kind!r} is reserved or not a str")
        self._write(self._record(kind, step, fields), fsync=fsync)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_events(path) -> list:
    """Every event of a JSONL log, decoded with :func:`loads` (lines: :func:`nanscan.jsonl.parse_lines`).
    Blank lines are skipped; a line that does not parse is skipped with a warning when it was torn
    by a crash (the last line, or a line followed by a new writer's header); any other bad line is a
    ``ValueError`` naming its number."""
    events = []
    for event in jsonl.read_lines(path):
        if event.get("type") == "unparsed":
            if event["torn"]:
                warnings.warn(f"{path}:{event['line']}: skipping a truncated event line (crash mid-write?)",
                              stacklevel=2)
                continue
            raise ValueError(f"{path}:{event['line']}: {event['error']}")
        events.append(event)
    return events

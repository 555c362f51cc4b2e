"""Failure bundles: everything needed to rebuild one training step, in a directory.

Layout (every file but the manifest is written with ``torch.save`` and read back with
``torch.load(weights_only=True)``, so loading never runs arbitrary pickled code)::

    BUNDLE/
      manifest.json   strict JSON a person can read: step, incident, state markers, autocast,
                      input dtypes, model precision, environment, the SHA-256 of every file, and
                      ``digest``: the SHA-256 of the manifest itself (see :func:`manifest_digest`)
      batch.pt        {"args": [...], "kwargs": {...}, "single": bool[, "mapping": True]}: the
                      tensors that entered the step, cloned *before* the forward (later in-place
                      edits do not reach the bundle); what is kept of other batches: below
      rng.pt          RNG states captured before the step: python, numpy, torch CPU, every CUDA device
      model.pt        model.state_dict()
      optimizer.pt    optimizer.state_dict()        (when an optimizer was given)
      scaler.pt       GradScaler.state_dict()       (when a scaler was given)

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place,
and an existing path is never overwritten (the monitor writes a rerun's bundle under the first
free ``-1``, ``-2``, ... suffix instead). A write that fails (a full disk) removes the partial
bundle, closes every file it opened and says how many bytes were free. A writer that was killed
(SIGKILL, the out-of-memory killer, a preempted node) cannot remove its temporary directory: see
Note [stale temporary directories] for who removes it.

``load_bundle`` verifies before it trusts anything:

- the manifest: UTF-8, strict JSON (no NaN / Infinity), at most 16 MiB and 32 levels deep, every
  field of the type ``write_bundle`` writes, and its ``digest`` must match its content -- a
  flipped byte (the step, the incident's name) is refused as "edited or corrupted". The digest
  is a checksum, not a signature: it catches corruption and hand edits, not someone who
  recomputes it (nothing in a bundle is secret or signed).
- every file: a regular file inside the bundle directory (a symbolic link is refused, even one
  pointing inside), matching the manifest's hash, so a truncated or edited file is refused with
  its name; a file whose hash was forged too still cannot execute code (``weights_only=True``)
  and must hold what ``write_bundle`` writes (e.g. ``model.pt`` a dict of str -> Tensor).

Batches. ``batch.pt`` holds only what ``weights_only`` loading accepts -- tensors, numbers,
strings, None and lists / dicts of them -- so other batch objects are stored as follows
(:func:`clone_batch`, :func:`clone_forward_inputs`); ``path`` names an element the way
``manifest["inputs"]`` does (``args[0]``, ``args[0].mask``, ``kwargs.input_ids``):

- a mapping that is not a plain dict (an HF ``BatchEncoding``, which is a ``UserDict``; a
  ``ModelOutput``, an ``OrderedDict``): a dict of its items. ``model(**batch)`` is stored as keyword
  arguments (``"mapping": True``) and replays as ``model(**dict)``; ``model(batch)`` is stored as
  one positional input (``"single": True``) and replays as ``model(dict)`` -- a model that reads
  ``batch["input_ids"]`` gets what it read, one that uses ``batch.input_ids`` (attribute access of
  a ``BatchEncoding``) needs ``replay(..., forward=...)``. Tuples (named ones too) become lists.
- a dataclass instance: a dict of its fields. Rebuilding the user's class would take unpickling
  (importing and running its code), which ``load_bundle`` never does, so replay passes the fields
  as a dict; to replay a model that needs the class itself, rebuild it in ``forward=``, e.g.
  ``replay(bundle, model, forward=lambda m, b: m(Batch(**b)))``. Capturing one warns once per
  monitor, saying so.
- ``manifest["batch_types"]``: ``path -> qualified type name`` of every element converted so
  (a mapping, a dataclass, a tuple or number subclass; the first 256).
- anything else (a custom object, a generator, a numpy array, an object that refers to itself):
  the monitor stores None in its place, warns once per monitor naming its type, and lists it in
  ``manifest["batch_dropped"]`` (``[{"path": ..., "type": ...}]``, the first 256, with
  ``batch_dropped_total`` when there were more); every tensor around it is kept. A monitor
  feature never stops the run, so the watched forward never raises for a batch it cannot store;
  ``capture_bundle`` and ``mon.step(batch)``, called by the user with the batch, raise
  ``TypeError`` instead. These manifest fields are optional: a bundle written before them loads.

Versions: format 2 added the manifest digest. A format-1 bundle (written before it) still loads
-- its files are verified as before -- but its manifest cannot be, so ``load_bundle`` warns and
sets ``Bundle.manifest_verified = False``; a format-1 manifest that carries a digest is refused
(its version was edited).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import platform
import random
import re
import shutil
import socket
import stat
import tempfile
import warnings
from typing import Any, Optional

import torch

from nanscan import jsonl
from nanscan.warn import warn as _warn

FORMAT = "nanscan-bundle"
VERSION = 2  # 2: the manifest carries its own digest
READABLE_VERSIONS = (1, 2)
_TENSOR_FILES = ("batch.pt", "rng.pt", "model.pt", "optimizer.pt", "scaler.pt")
_REQUIRED_FILES = ("batch.pt", "rng.pt", "model.pt")
_MANIFEST_MAX_BYTES = 16 << 20  # ours are a few KiB (the incident's records); far larger is not ours
_MAX_DEPTH = 32  # ours nest ~5 deep; a bound keeps every reader (json, repr, the report) off RecursionError
_SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")


class BundleError(ValueError):
    """A bundle that is missing, truncated, tampered with or not a nanscan bundle."""


# ---------------------------------------------------------------------------- capture helpers
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


def capture_rng() -> dict:
    """RNG states of python ``random``, numpy (if installed), torch CPU and every CUDA device, in
    a form ``weights_only`` loading accepts (tensors, numbers, strings, lists)."""
    version, internal, gauss = random.getstate()
    state: dict = {"python": [version, list(internal), gauss], "torch_cpu": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        state["numpy"] = None
    state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"])
    if state.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def environment() -> dict:
    """Versions, device and the numerics-relevant backend flags."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def autocast_state() -> dict:
    """Autocast as it is now (call inside the step's autocast region to record it)."""
    out = {}
    for device_type in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device_type)
        out[device_type] = {"enabled": enabled,
                            "dtype": str(torch.get_autocast_dtype(device_type)).replace("torch.", "")}
    return out


def model_precision(model: torch.nn.Module) -> dict:
    """Parameter dtypes: tells a ``.half()`` / ``.to(bfloat16)`` model from an fp32 one under autocast."""
    counts: dict = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + p.numel()
    out = {"param_dtypes": counts,
           "converted": sorted(k for k in counts if k in ("float16", "bfloat16"))}
    policies = _fsdp_mixed_precision(model)
    if policies:
        out["fsdp_mixed_precision"] = policies
    return out


def _fsdp_mixed_precision(model: torch.nn.Module) -> dict:
    """FSDP2's ``MixedPrecisionPolicy`` of every ``fully_shard``-ed module that sets one: the
    parameters are stored in their own dtype and all-gathered in ``param_dtype`` for compute, so
    ``param_dtypes`` alone would say fp32 for a step that ran in bf16. ``{module path: {field: value}}``."""
    out: dict = {}
    for name, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        try:
            policy = state()._mp_policy
        except Exception:  # a torch whose FSDP keeps it elsewhere: nothing to record, nothing guessed
            continue
        fields = {}
        for field in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"):
            value = getattr(policy, field, None)
            fields[field] = str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
        if any(fields[f] is not None for f in ("param_dtype", "reduce_dtype", "output_dtype")):
            out[name or "(model)"] = fields
            if len(out) >= _MAX_NOTED:
                break
    return out


def _dtypes_of(batch: dict) -> list:
    out = []

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            out.append({"path": path, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)})
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")

    walk(batch["args"], "args")
    walk(batch["kwargs"], "kwargs")
    return out


def _sha256_file(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return _sha256_file(f)


def manifest_digest(manifest: dict) -> str:
    """The ``digest`` of a manifest: SHA-256 (hex) of its canonical JSON without the ``digest``
    field -- ``json.dumps(sort_keys=True, separators=(",", ":"), allow_nan=False)``, ASCII. Every
    key and value is covered; layout (indentation, key order) is not."""
    return jsonl.digest(manifest)  # (one home: the report checks it too, without torch)


def free_bundle_path(path: str) -> str:
    """``path`` when nothing is there, else the first free ``path-1``, ``path-2``, ..."""
    if not os.path.lexists(path):
        return path
    n = 1
    while os.path.lexists(f"{path}-{n}"):
        n += 1
    return f"{path}-{n}"


# Note [stale temporary directories]
# A bundle is written into ``.<name>.tmp-p<pid>-h<host>-<random>`` beside its final path and renamed
# into place. A writer killed mid-write leaves that directory behind (tens of MB: the model and
# optimizer state). Every later write into the same directory removes the temporary directories
# of dead writers: those whose name carries this host's tag and the id of a process that no longer
# exists, and that hold nothing but bundle files. Any other leftover -- a writer on another host of
# a shared filesystem, whose liveness this host cannot see, or a directory named before writers put
# their pid in the name -- is never removed; a warning (once per directory and process) names it so
# a person can. A live writer's directory is never touched: its pid exists (a reused pid keeps a
# dead writer's directory, the safe side).
_TMP_NAME = re.compile(r"\A\.(?P<name>.+)\.tmp-(?:p(?P<pid>\d+)-h(?P<host>[0-9a-f]{8})-)?[A-Za-z0-9_]+\Z")
_BUNDLE_FILES = frozenset(_TENSOR_FILES + ("manifest.json",))
_warned_leftovers: set = set()


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _temp_prefix(name: str) -> str:
    return f".{name}.tmp-p{os.getpid()}-h{_host_tag()}-"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # another user's process, or cannot tell: alive
        return True
    return True


def _only_bundle_files(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return all(e.name in _BUNDLE_FILES and e.is_file(follow_symlinks=False) for e in entries)
    except OSError:
        return False


def clean_stale_temp_dirs(directory: str) -> tuple:
    """Remove the temporary directories that killed bundle writers left in ``directory``; return
    ``(removed, left)``: the paths removed and the leftovers this host cannot judge (Note [stale
    temporary directories]). Never raises: a directory that cannot be listed has nothing to clean."""
    removed, left = [], []
    host = _host_tag()
    try:
        with os.scandir(directory) as entries:
            candidates = [(e.name, e.path) for e in entries if e.name.startswith(".")
                          and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed, left
    for name, path in candidates:
        m = _TMP_NAME.match(name)
        if m is None:
            continue
        if m.group("pid") is None or m.group("host") != host:
            left.append(path)  # another host's writer, or a name without a pid: this host cannot judge
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _process_exists(pid):
            continue  # a live writer's directory (this process's other threads included)
        if _only_bundle_files(path):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
                continue
        left.append(path)  # a dead writer's, but holding something not ours, or not removable
    return removed, left


def _clean_before_write(directory: str) -> None:
    try:
        _, left = clean_stale_temp_dirs(directory)
        key = (os.path.abspath(directory), tuple(sorted(left)))
        if left and key not in _warned_leftovers:
            _warned_leftovers.add(key)
            shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            _warn(f"nanscan: {len(left)} temporary bundle director{'y' if len(left) == 1 else 'ies'} of an earlier "
                  f"writer {'is' if len(left) == 1 else 'are'} left in {directory}: {shown}. nanscan removes those "
                  "of dead writers on this host only; remove these by hand once no writer uses them.",
                  RuntimeWarning, stacklevel=4)
    except Exception:  # cleaning up after others must never stop this write
        pass


def _save(obj, target: str) -> None:
    """``torch.save`` into a file this function opens and always closes: a write that fails (a
    full disk) releases the descriptor at once, not when the traceback is collected."""
    with open(target, "wb") as f:
        torch.save(obj, f)


class BundleWriteError(OSError):
    """A bundle could not be written (``errno.ENOSPC`` when the disk is full); the partial bundle
    was removed and the original error is the ``__cause__``."""


# ---------------------------------------------------------------------------- write
def write_bundle(path: str, *, batch: dict, rng: dict, model_state: dict, optimizer_state=None,
                 scaler_state=None, state_when: str = "before-update", training: bool = True,
                 autocast: Optional[dict] = None, precision: Optional[dict] = None,
                 incident: Optional[dict] = None, step: Optional[int] = None, extra: Optional[dict] = None,
                 new_name: bool = False) -> str:
    """Write a bundle directory atomically at ``path``; return the path written.

    An existing ``path`` is never overwritten: it is a ``FileExistsError``, or with ``new_name``
    the bundle goes to the first free ``path-1``, ``path-2``, ... (a rerun into the same
    directory keeps both). A failed write (a full disk) removes the partial bundle and raises
    :class:`BundleWriteError` saying how many bytes were free.

    ``state_when`` is the honest marker of the model / optimizer / scaler state: ``"before-update"``
    (taken before the step's optimizer update ran) or ``"after-update"``."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not new_name:
        raise FileExistsError(f"nanscan: {path} already exists; a bundle never overwrites anything")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    notes = {k: batch[k] for k in _NOTE_KEYS if k in batch}  # (clone_batch's notes: to the manifest)
    batch = {k: v for k, v in batch.items() if k not in _NOTE_KEYS}
    _clean_before_write(parent)
    tmp = tempfile.mkdtemp(prefix=_temp_prefix(os.path.basename(path)), dir=parent)
    files = {"batch.pt": batch, "rng.pt": rng, "model.pt": model_state}
    if optimizer_state is not None:
        files["optimizer.pt"] = optimizer_state
    if scaler_state is not None:
        files["scaler.pt"] = scaler_state
    writing = None  # the file being written, for the error of a failed write
    try:
        hashes = {}
        for writing, obj in files.items():
            target = os.path.join(tmp, writing)
            _save(obj, target)
            hashes[writing] = _sha256(target)
        writing = "manifest.json"
        manifest = {
            "format": FORMAT, "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "step": step, "state": state_when, "training": training,
            "autocast": autocast or {}, "model_precision": precision or {},
            "inputs": _dtypes_of(batch), "incident": incident, "environment": environment(),
            "extra": extra or {}, "files": hashes,
        }
        dropped = list(notes.get("dropped") or [])
        total = max(notes.get("dropped_total") or 0, len(dropped))
        manifest["batch_dropped"] = dropped[:_MAX_NOTED]
        if total > _MAX_NOTED:
            manifest["batch_dropped_total"] = total
        manifest["batch_types"] = dict(list((notes.get("types") or {}).items())[:_MAX_NOTED])
        manifest["digest"] = manifest_digest(manifest)
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        writing = None
        return _rename_into_place(tmp, path, new_name)
    except BaseException as e:
        # measured before the partial bundle is removed: the space free when the write failed
        error = _write_error(e, path, writing, files.get(writing)) if writing and _is_write_failure(e) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error from e
        raise


def _rename_into_place(tmp: str, path: str, new_name: bool) -> str:
    while True:
        target = free_bundle_path(path) if new_name else path
        if os.path.lexists(target):  # something appeared at path while the bundle was written
            raise FileExistsError(f"nanscan: {path} already exists; a bundle never overwrites anything")
        try:
            os.rename(tmp, target)  # atomic on one filesystem: a reader sees no bundle or a whole one
            return target
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not new_name:
                raise FileExistsError(f"nanscan: {path} already exists; a bundle never overwrites anything") from e
            # another writer took the name between the check and the rename: the next free one


_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_WRITE_ERRNOS = _DISK_FULL_ERRNOS | {errno.EFBIG, errno.EIO}
_LOW_FREE_BYTES = 1 << 20  # free space this low when a write failed: the disk is what filled up


def _is_write_failure(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _WRITE_ERRNOS
    # torch's zip writer reports a failed write (a full disk) as e.g. "[enforce fail at
    # inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write failed"
    return isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("inline_container", "PytorchStreamWriter", "file write failed"))


def _payload_bytes(obj) -> Optional[int]:
    """About how many bytes ``torch.save(obj)`` writes: its tensors' storages, each once."""
    total, seen, stack = 0, set(), [(obj, 0)]
    try:
        while stack:
            value, depth = stack.pop()
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = (storage.data_ptr(), str(storage.device))
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
            elif depth < _MAX_DEPTH and isinstance(value, dict):
                stack.extend((v, depth + 1) for v in value.values())
            elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
                stack.extend((v, depth + 1) for v in value)
    except Exception:  # an exotic tensor subclass: the size is only a hint
        return None
    return total


def _write_error(e: BaseException, path: str, name: str, obj) -> BundleWriteError:
    parent = os.path.dirname(path)
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        free = None
    need = _payload_bytes(obj) if name != "manifest.json" else None
    full = (getattr(e, "errno", None) in _DISK_FULL_ERRNOS
            or (free is not None and (free < _LOW_FREE_BYTES or (need is not None and need > free))))
    space = ("free space unknown" if free is None else f"{free} bytes free in {parent}") + (
        f"; {name} needs about {need} bytes" if need is not None else "")
    if full:
        return BundleWriteError(errno.ENOSPC, f"nanscan: the disk is full: writing {name} of the bundle {path} "
                                f"failed ({space}); the partial bundle was removed")
    return BundleWriteError(f"nanscan: writing {name} of the bundle {path} failed ({space}, so the disk is "
                            f"probably not full: a quota, a file size limit or an I/O error?): {e}; "
                            "the partial bundle was removed")


# ---------------------------------------------------------------------------- load
@dataclasses.dataclass
class Bundle:
    """A loaded bundle: ``manifest`` (dict) and the tensor payloads. ``manifest_verified`` is
    False only for a format-1 bundle, whose manifest has no digest."""

    path: str
    manifest: dict
    batch: dict
    rng: dict
    model_state: dict
    optimizer_state: Optional[dict]
    scaler_state: Optional[dict]
    manifest_verified: bool = True

    @property
    def args(self) -> list:
        return self.batch["args"]

    @property
    def inputs(self):
        """The batch as it was given: the tensor itself, or a tuple of the positional inputs."""
        if self.batch.get("mapping"):
            return dict(self.batch["kwargs"])
        return self.batch["args"][0] if self.batch.get("single") else tuple(self.batch["args"])

    @property
    def kwargs(self) -> dict:
        return self.batch["kwargs"]

    @property
    def batch_dropped(self) -> list:
        """``[{"path", "type"}]`` of the batch elements stored as None (module docstring,
        "Batches"); empty for a bundle written before the field existed."""
        return list(self.manifest.get("batch_dropped") or [])

    @property
    def batch_types(self) -> dict:
        """``path -> qualified type name`` of the batch elements stored converted (a
        ``BatchEncoding`` or a dataclass as a dict ...)."""
        return dict(self.manifest.get("batch_types") or {})


def load_bundle(path: str, map_location: Any = "cpu") -> Bundle:
    """Load and verify a bundle (what is checked: the module docstring); raises
    :class:`BundleError` naming the file that is wrong and why. A format-1 bundle (no manifest
    digest) loads with a ``UserWarning`` and ``manifest_verified=False``."""
    path = os.path.abspath(path)
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isdir(path) or not os.path.lexists(manifest_path):
        raise BundleError(f"{path} is not a nanscan bundle: {manifest_path} is missing")
    with _open_in_bundle(path, "manifest.json") as f:
        raw = f.read(_MANIFEST_MAX_BYTES + 1)
    manifest = _parse_manifest(raw, manifest_path)
    verified = _verify_manifest(manifest, manifest_path)
    loaded = {}
    for name in _TENSOR_FILES:
        if name not in manifest["files"]:
            continue
        file_path = os.path.join(path, name)
        with _open_in_bundle(path, name) as f:  # hashed and loaded from the same open file
            if _sha256_file(f) != manifest["files"][name]:
                raise BundleError(f"{file_path} does not match the hash in manifest.json: truncated or tampered with")
            f.seek(0)
            try:
                obj = torch.load(f, map_location=map_location, weights_only=True)
            except Exception as e:  # weights_only refuses any global it does not know: never executed
                raise BundleError(f"{file_path} could not be loaded safely (weights_only=True refused it: {e})") from e
        problem = _PAYLOAD_CHECKS[name](obj)
        if problem is not None:
            raise BundleError(f"{file_path} is not what nanscan writes there: it holds {problem}; "
                              f"expected {_PAYLOAD_EXPECTED[name]}")
        loaded[name] = obj
    return Bundle(path=path, manifest=manifest, batch=loaded["batch.pt"], rng=loaded["rng.pt"],
                  model_state=loaded["model.pt"], optimizer_state=loaded.get("optimizer.pt"),
                  scaler_state=loaded.get("scaler.pt"), manifest_verified=verified)


def _open_in_bundle(directory: str, name: str):
    """``directory/name`` opened for reading, when it is a regular file inside ``directory``: a
    symbolic link (even one pointing inside), a device, a FIFO or a file swapped while being
    opened is refused."""
    file_path = os.path.join(directory, name)
    try:
        st = os.lstat(file_path)
    except FileNotFoundError:
        raise BundleError(f"{file_path} is missing from the bundle") from None
    except OSError as e:
        raise BundleError(f"{file_path} cannot be read ({e})") from e
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(file_path)
        except OSError:
            target = "?"
        raise BundleError(f"{file_path} is a symbolic link (to {target!r}): a bundle's files must be regular files "
                          "inside it; refused")
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{file_path} is not a regular file; refused")
    if os.path.dirname(os.path.realpath(file_path)) != os.path.realpath(directory):
        raise BundleError(f"{file_path} resolves to {os.path.realpath(file_path)}, outside the bundle; refused")
    # O_NOFOLLOW and the inode comparison close the window between the lstat and the open;
    # O_NONBLOCK keeps a FIFO swapped in meanwhile from blocking the open.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(file_path, flags)
    except OSError as e:
        raise BundleError(f"{file_path} cannot be opened ({e}); refused") from e
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise BundleError(f"{file_path} was replaced while it was opened; refused")
    return os.fdopen(fd, "rb")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is not a finite number")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _parse_manifest(raw: bytes, manifest_path: str):
    if len(raw) > _MANIFEST_MAX_BYTES:
        raise BundleError(f"{manifest_path} is larger than {_MANIFEST_MAX_BYTES >> 20} MiB: not a manifest nanscan wrote")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{manifest_path} is not UTF-8 ({e}): the manifest was edited or corrupted") from e
    try:
        manifest = json.loads(text, parse_float=_finite_float, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
        raise BundleError(f"{manifest_path} is not valid JSON ({type(e).__name__}: {e}); "
                          "the bundle is truncated or was edited") from e
    _check_json_tree(manifest, manifest_path)
    return manifest


def _check_json_tree(root, where: str) -> None:
    """Bounded depth and strings that are Unicode (no lone surrogate from a ``\\ud800`` escape),
    so that hashing, printing and reporting the manifest cannot fail."""
    stack = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)) and depth > _MAX_DEPTH:
            raise BundleError(f"{where} nests deeper than {_MAX_DEPTH} levels: not a manifest nanscan wrote")
        strings = []
        if isinstance(value, dict):
            strings = list(value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            strings = [value]
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BundleError(f"{where} holds a string that is not valid Unicode ({e}): the manifest was "
                                  "edited or corrupted") from e


def _kind(value) -> str:
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _verify_manifest(m, manifest_path: str) -> bool:
    """Format, version, digest, then the type of every field; returns whether the manifest was
    covered by a digest (False for format 1)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BundleError(f"{manifest_path} is not a nanscan bundle manifest")
    version = m.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:  # type(): True is not version 1
        raise BundleError(f"{manifest_path}: bundle format version {repr(version)[:40]} is not supported "
                          f"(this nanscan reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    if version >= 2:
        if "digest" not in m:
            raise BundleError(f"{manifest_path} has no digest, which format {version} always writes: the manifest "
                              "was edited or corrupted")
        if m["digest"] != manifest_digest(m):
            raise BundleError(f"{manifest_path} was edited or corrupted: its content does not match its digest")
        verified = True
    else:
        if "digest" in m:
            raise BundleError(f"{manifest_path} says format 1, which has no digest, yet carries one: the manifest "
                              "was edited or corrupted")
        warnings.warn(f"nanscan: {manifest_path} is a format-1 bundle, written before manifests carried a digest: "
                      "its files are verified, the manifest itself cannot be", UserWarning, stacklevel=3)
        verified = False
    _check_fields(m, manifest_path)
    return verified


def _is_torch_dtype(name) -> bool:
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


# field -> (what it must be, check); a field write_bundle always writes may still be absent in an
# older bundle (readers use .get), but when present it has this type.
_FIELDS = {
    "created": ("a string", lambda v: isinstance(v, str)),
    "step": ("an integer or null", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool))),
    "state": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "training": ("true or false", lambda v: isinstance(v, bool)),
    "incident": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "autocast": ('an object of device -> {"enabled": bool, "dtype": a torch dtype name}',
                 lambda v: isinstance(v, dict) and all(
                     isinstance(a, dict) and isinstance(a.get("enabled"), bool) and _is_torch_dtype(a.get("dtype"))
                     for a in v.values())),
    "model_precision": ("an object", lambda v: isinstance(v, dict)),
    "inputs": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(i, dict) for i in v)),
    "environment": ("an object", lambda v: isinstance(v, dict)),
    "extra": ("an object", lambda v: isinstance(v, dict)),
    # (optional: absent in a bundle written before them)
    "batch_dropped": ('a list of {"path": string, "type": string}',
                      lambda v: isinstance(v, list) and all(
                          isinstance(d, dict) and isinstance(d.get("path"), str) and isinstance(d.get("type"), str)
                          for d in v)),
    "batch_dropped_total": ("a count", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "batch_types": ("an object of path -> type name",
                    lambda v: isinstance(v, dict) and all(isinstance(t, str) for t in v.values())),
}


def _check_fields(m: dict, manifest_path: str) -> None:
    files = m.get("files")
    if not isinstance(files, dict):
        raise BundleError(f"{manifest_path}: files is {_kind(files)}, expected an object of file name -> SHA-256")
    for name, digest in files.items():
        if name not in _TENSOR_FILES:
            raise BundleError(f"{manifest_path} lists an unexpected file {name!r}")
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            raise BundleError(f"{manifest_path}: the hash of {name} is {repr(digest)[:80]}, expected a SHA-256 "
                              "(64 lowercase hex digits)")
    if not set(_REQUIRED_FILES) <= set(files):
        raise BundleError(f"{manifest_path} does not list batch.pt, rng.pt and model.pt")
    for field, (expected, ok) in _FIELDS.items():
        if field in m and not ok(m[field]):
            raise BundleError(f"{manifest_path}: {field} is {repr(m[field])[:80]}, expected {expected}: "
                              "not a manifest nanscan wrote")


# ---------------------------------------------------------------------------- payload checks
# Each returns None when the loaded object has the structure write_bundle gives that file, else
# what is wrong; run after torch.load(weights_only=True), so a forged file with a matching hash
# is refused here instead of failing later inside replay.
def _leaves_problem(root, where: str) -> Optional[str]:
    stack = [(root, where, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"{at}: nested deeper than {_MAX_DEPTH} levels"
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    return f"{at}: a key {k!r} that is not a string"
                stack.append((v, f"{at}.{k}", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{at}[{i}]", depth + 1) for i, v in enumerate(value))
        elif not (value is None or isinstance(value, (torch.Tensor, bool, int, float, str))):
            return f"{at}: {_kind(value)}"
    return None


def _batch_problem(obj) -> Optional[str]:
    if not isinstance(obj, dict):
        return _kind(obj)
    unknown = sorted(map(repr, set(obj) - {"args", "kwargs", "single", "mapping"}))
    if unknown:
        return f"the unexpected key(s) {', '.join(unknown)}"
    args, kwargs = obj.get("args"), obj.get("kwargs")
    if not isinstance(args, (list, tuple)):
        return f"args: {_kind(args)}"
    if not isinstance(kwargs, dict):
        return f"kwargs: {_kind(kwargs)}"
    for key in ("single", "mapping"):
        if key in obj and not isinstance(obj[key], bool):
            return f"{key}: {_kind(obj[key])}"
    if obj.get("single") and len(args) != 1:
        return f"single=True with {len(args)} positional inputs"
    if obj.get("mapping") and args:
        return "mapping=True with positional inputs"
    return _leaves_problem(args, "args") or _leaves_problem(kwargs, "kwargs")


def _byte_state(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1


def _rng_problem(obj) -> Optional[str]:
    if not isinstance(obj, dict):
        return _kind(obj)
    py = obj.get("python")
    if not isinstance(py, (list, tuple)) or len(py) != 3:
        return f"python: {_kind(py)}" + (f" of length {len(py)}" if isinstance(py, (list, tuple)) else "")
    try:  # a private Random: checked the way restore_rng uses it, without touching the global state
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
    except (TypeError, ValueError, OverflowError) as e:
        return f"python: not a random.getstate() ({e})"
    cpu = obj.get("torch_cpu")
    if not _byte_state(cpu):
        return f"torch_cpu: {_kind(cpu)}" + (f" of {cpu.dtype}" if isinstance(cpu, torch.Tensor) else "")
    if cpu.device.type == "cpu":
        try:
            torch.Generator().set_state(cpu)
        except RuntimeError as e:
            return f"torch_cpu: not a torch RNG state ({e})"
    np_state = obj.get("numpy")
    if np_state is not None:
        if not (isinstance(np_state, (list, tuple)) and len(np_state) == 5 and isinstance(np_state[0], str)
                and isinstance(np_state[1], torch.Tensor)
                and all(isinstance(x, (int, float)) for x in np_state[2:])):
            return f"numpy: {_kind(np_state)}, not [kind, keys, pos, has_gauss, cached]"
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            kind, keys, pos, has_gauss, cached = np_state
            try:
                np.random.RandomState().set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))
            except (TypeError, ValueError) as e:
                return f"numpy: not a numpy RNG state ({e})"
    cuda = obj.get("cuda", [])
    if not isinstance(cuda, (list, tuple)) or not all(_byte_state(c) for c in cuda):
        return f"cuda: {_kind(cuda)}, not a list of uint8 RNG states"
    return None


def _model_problem(obj) -> Optional[str]:
    if not isinstance(obj, dict):
        return _kind(obj)
    for k, v in obj.items():
        if not isinstance(k, str):
            return f"a key {k!r} that is not a string"
        if not isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):  # get_extra_state: any value
            return f"{k!r}: {_kind(v)}"
    return None


def _optimizer_problem(obj) -> Optional[str]:
    if not isinstance(obj, dict):
        return _kind(obj)
    state, groups = obj.get("state"), obj.get("param_groups")
    if not isinstance(state, dict):
        return f"state: {_kind(state)}"
    for k, v in state.items():
        if not isinstance(v, dict):
            return f"state[{k!r}]: {_kind(v)}"
    if not isinstance(groups, (list, tuple)):
        return f"param_groups: {_kind(groups)}"
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            return f"param_groups[{i}]: {_kind(g)} without a params list"
    return None


def _scaler_problem(obj) -> Optional[str]:
    if not isinstance(obj, dict):
        return _kind(obj)
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, (int, float)):
            return f"{k!r}: {_kind(v)}"
    return None


_PAYLOAD_CHECKS = {"batch.pt": _batch_problem, "rng.pt": _rng_problem, "model.pt": _model_problem,
                   "optimizer.pt": _optimizer_problem, "scaler.pt": _scaler_problem}
_PAYLOAD_EXPECTED = {
    "batch.pt": 'a dict {"args": list, "kwargs": dict, "single": bool} of tensors, numbers, strings, None and '
                "lists / dicts of them",
    "rng.pt": 'a dict {"python": random.getstate() as a list, "torch_cpu": uint8 tensor, "numpy": None or '
              '[kind, keys, pos, has_gauss, cached], "cuda": list of uint8 tensors}',
    "model.pt": "a dict of str -> Tensor (model.state_dict())",
    "optimizer.pt": 'a dict {"state": dict of dicts, "param_groups": list of dicts with "params"} '
                    "(optimizer.state_dict())",
    "scaler.pt": "a dict of str -> number (GradScaler.state_dict())",
}


def capture_bundle(path: str, *, model: torch.nn.Module, batch: Any = (), kwargs: Optional[dict] = None,
                   optimizer=None, scaler=None, rng: Optional[dict] = None, state_when: str = "before-update",
                   incident=None, step: Optional[int] = None) -> str:
    """Write a bundle on demand. ``batch`` is the positional input(s) of ``model`` (a tensor or a
    tuple, a mapping, a dataclass: module docstring, "Batches"; an element it cannot store raises
    ``TypeError``), ``kwargs`` its keyword inputs. Call it *before* the step to get pre-step RNG and state
    (``rng`` lets a caller pass states it captured earlier). State dicts are saved as they are (no
    extra copy of the model is made)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanscan.capture_bundle: model must be a torch.nn.Module, got {type(model).__name__}")
    kept = clone_batch(batch, kwargs)
    for _, message in batch_notices(kept):
        warnings.warn(message.replace(" (Warned once per monitor.)", ""), RuntimeWarning, stacklevel=2)
    return write_bundle(
        path, batch=kept, rng=rng if rng is not None else capture_rng(),
        model_state=model.state_dict(), optimizer_state=optimizer.state_dict() if optimizer is not None else None,
        scaler_state=scaler.state_dict() if scaler is not None else None, state_when=state_when,
        training=model.training, autocast=autocast_state(), precision=model_precision(model),
        incident=incident.to_dict() if hasattr(incident, "to_dict") else incident, step=step)

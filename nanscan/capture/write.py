"""Writing a bundle: atomically, never over anything, cleaning up after writers that were killed."""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from typing import Any, Optional

import torch

from nanscan.capture.batch import _MAX_NOTED, _NOTE_KEYS, batch_notices, clone_batch
from nanscan.capture.bundle_format import (
    _MAX_DEPTH,
    _TENSOR_FILES,
    FORMAT,
    VERSION,
    _sha256,
    manifest_digest,
)
from nanscan.capture.conditions import (
    autocast_state,
    capture_rng,
    environment,
    model_precision,
)
from nanscan.warn import warn as _warn


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

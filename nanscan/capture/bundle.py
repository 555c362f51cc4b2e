"""Failure bundles: everything needed to rebuild one training step, in a directory.

Layout (every file but the manifest is written with ``torch.save`` and read back with
``torch.load(weights_only=True)``, so loading never runs arbitrary pickled code)::

    BUNDLE/
      manifest.json   strict JSON a person can read: step, incident, state markers, autocast,
                      input dtypes, model precision, environment, and the SHA-256 of every file
      batch.pt        {"args": [...], "kwargs": {...}}: the tensors that entered the step, cloned
                      *before* the forward (later in-place edits do not reach the bundle)
      rng.pt          RNG states captured before the step: python, numpy, torch CPU, every CUDA device
      model.pt        model.state_dict()
      optimizer.pt    optimizer.state_dict()        (when an optimizer was given)
      scaler.pt       GradScaler.state_dict()       (when a scaler was given)

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place,
and an existing path is never overwritten. ``load_bundle`` checks every file against the
manifest's hashes first, so a truncated or edited file is refused with its name; a file whose
hash was forged too still cannot execute code, because it is loaded with ``weights_only=True``.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import random
import shutil
import tempfile
from typing import Any, Optional

import torch

FORMAT = "nanscan-bundle"
VERSION = 1
_TENSOR_FILES = ("batch.pt", "rng.pt", "model.pt", "optimizer.pt", "scaler.pt")


class BundleError(ValueError):
    """A bundle that is missing, truncated, tampered with or not a nanscan bundle."""


# ---------------------------------------------------------------------------- capture helpers
def clone_batch(args=(), kwargs=None) -> dict:
    """Independent copies of the tensors of a batch (nested lists / tuples / dicts kept; other
    leaves must be ints, floats, bools, strings or None). Taken before the forward."""

    def clone(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, (list, tuple)):
            return [clone(v) for v in value]
        if isinstance(value, dict):
            return {str(k): clone(v) for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"nanscan: cannot store a batch element of type {type(value).__name__}; a bundle "
                        "holds tensors, numbers, strings and lists / tuples / dicts of them")

    if isinstance(args, dict) and not kwargs:  # an HF-style batch: model(**batch), kept as keyword arguments
        return {"args": [], "kwargs": clone(dict(args)), "single": False, "mapping": True}
    single = not isinstance(args, (tuple, list))
    if single:
        args = (args,)
    return {"args": clone(list(args)), "kwargs": clone(dict(kwargs or {})), "single": single}


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
    return {"param_dtypes": counts,
            "converted": sorted(k for k in counts if k in ("float16", "bfloat16"))}


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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------- write / load
def write_bundle(path: str, *, batch: dict, rng: dict, model_state: dict, optimizer_state=None,
                 scaler_state=None, state_when: str = "before-update", training: bool = True,
                 autocast: Optional[dict] = None, precision: Optional[dict] = None,
                 incident: Optional[dict] = None, step: Optional[int] = None, extra: Optional[dict] = None) -> str:
    """Write a bundle directory atomically at ``path`` (which must not exist); return ``path``.

    ``state_when`` is the honest marker of the model / optimizer / scaler state: ``"before-update"``
    (taken before the step's optimizer update ran) or ``"after-update"``."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"nanscan: {path} already exists; a bundle never overwrites anything")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        files = {"batch.pt": batch, "rng.pt": rng, "model.pt": model_state}
        if optimizer_state is not None:
            files["optimizer.pt"] = optimizer_state
        if scaler_state is not None:
            files["scaler.pt"] = scaler_state
        hashes = {}
        for name, obj in files.items():
            target = os.path.join(tmp, name)
            torch.save(obj, target)
            hashes[name] = _sha256(target)
        manifest = {
            "format": FORMAT, "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "step": step, "state": state_when, "training": training,
            "autocast": autocast or {}, "model_precision": precision or {},
            "inputs": _dtypes_of(batch), "incident": incident, "environment": environment(),
            "extra": extra or {}, "files": hashes,
        }
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)  # atomic on one filesystem: a reader sees no bundle or a whole one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@dataclasses.dataclass
class Bundle:
    """A loaded bundle: ``manifest`` (dict) and the tensor payloads."""

    path: str
    manifest: dict
    batch: dict
    rng: dict
    model_state: dict
    optimizer_state: Optional[dict]
    scaler_state: Optional[dict]

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


def load_bundle(path: str, map_location: Any = "cpu") -> Bundle:
    """Load and verify a bundle; raises :class:`BundleError` naming the file that is wrong."""
    path = os.path.abspath(path)
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise BundleError(f"{path} is not a nanscan bundle: {manifest_path} is missing")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise BundleError(f"{manifest_path} is not valid JSON ({e}); the bundle is truncated or was edited") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path} is not a nanscan bundle manifest")
    if manifest.get("version") != VERSION:
        raise BundleError(f"{manifest_path}: bundle format version {manifest.get('version')} is not supported "
                          f"(this nanscan reads version {VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not {"batch.pt", "rng.pt", "model.pt"} <= set(files):
        raise BundleError(f"{manifest_path} does not list batch.pt, rng.pt and model.pt")
    loaded = {}
    for name, digest in files.items():
        if name not in _TENSOR_FILES:
            raise BundleError(f"{manifest_path} lists an unexpected file {name!r}")
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise BundleError(f"{file_path} is missing from the bundle")
        if _sha256(file_path) != digest:
            raise BundleError(f"{file_path} does not match the hash in manifest.json: truncated or tampered with")
        try:
            loaded[name] = torch.load(file_path, map_location=map_location, weights_only=True)
        except Exception as e:  # weights_only refuses any global it does not know: never executed
            raise BundleError(f"{file_path} could not be loaded safely (weights_only=True refused it: {e})") from e
    return Bundle(path=path, manifest=manifest, batch=loaded["batch.pt"], rng=loaded["rng.pt"],
                  model_state=loaded["model.pt"], optimizer_state=loaded.get("optimizer.pt"),
                  scaler_state=loaded.get("scaler.pt"))


def capture_bundle(path: str, *, model: torch.nn.Module, batch: Any = (), kwargs: Optional[dict] = None,
                   optimizer=None, scaler=None, rng: Optional[dict] = None, state_when: str = "before-update",
                   incident=None, step: Optional[int] = None) -> str:
    """Write a bundle on demand. ``batch`` is the positional input(s) of ``model`` (a tensor or a
    tuple), ``kwargs`` its keyword inputs. Call it *before* the step to get pre-step RNG and state
    (``rng`` lets a caller pass states it captured earlier). State dicts are saved as they are (no
    extra copy of the model is made)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanscan.capture_bundle: model must be a torch.nn.Module, got {type(model).__name__}")
    return write_bundle(
        path, batch=clone_batch(batch, kwargs), rng=rng if rng is not None else capture_rng(),
        model_state=model.state_dict(), optimizer_state=optimizer.state_dict() if optimizer is not None else None,
        scaler_state=scaler.state_dict() if scaler is not None else None, state_when=state_when,
        training=model.training, autocast=autocast_state(), precision=model_precision(model),
        incident=incident.to_dict() if hasattr(incident, "to_dict") else incident, step=step)

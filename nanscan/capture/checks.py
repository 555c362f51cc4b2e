"""The checks a bundle passes before it is loaded: its manifest (strict JSON, bounded, typed, its digest)
and the structure of each payload file."""
from __future__ import annotations

import json
import random
import warnings
from typing import Optional

import torch

from nanscan.capture.bundle_format import (
    _MANIFEST_MAX_BYTES,
    _MAX_DEPTH,
    _REQUIRED_FILES,
    _SHA256_HEX,
    _TENSOR_FILES,
    FORMAT,
    READABLE_VERSIONS,
    BundleError,
    manifest_digest,
)


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is not a finite number")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _parse_manifest(raw: bytes, manifest_path: str):
    if len(raw) > _MANIFEST_MAX_BYTES:
        raise BundleError(f"{manifest_path} is larger than {_MANIFEST_MAX_BYTES >> 20} MiB: "
                          "not a manifest nanscan wrote")
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

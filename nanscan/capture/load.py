"""Loading a bundle: verified before anything is trusted (what is checked: :mod:`nanscan.capture.bundle`)."""
from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any, Optional

import torch

from nanscan.capture.bundle_format import (
    _MANIFEST_MAX_BYTES,
    _TENSOR_FILES,
    BundleError,
    _sha256_file,
)
from nanscan.capture.checks import (
    _PAYLOAD_CHECKS,
    _PAYLOAD_EXPECTED,
    _parse_manifest,
    _verify_manifest,
)


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

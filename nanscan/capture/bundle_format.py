"""The bundle format's constants, its error, and the digests (the layout: :mod:`nanscan.capture.bundle`)."""
from __future__ import annotations

import hashlib
import re

from nanscan import jsonl

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

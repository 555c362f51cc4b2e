"""What a report reads: a JSONL event log or a failure bundle's ``manifest.json``; and the strict
JSON a summary is written as.

Non-finite floats travel as ``{"finite": false, "value": "nan" | "inf" | "-inf"}`` and lines are
read by :mod:`nanscan.jsonl` (the format's one home, torch-free, shared with :mod:`nanscan.log`).
Neither torch nor ``nanscan.log`` is imported: a report can be made anywhere the log is."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from nanscan import jsonl

BUNDLE_FORMAT = "nanscan-bundle"  # nanscan.capture.bundle.FORMAT, repeated to keep torch out of here


def loads(text: str) -> Any:
    """Parse one JSON document, non-finite markers decoded (:func:`nanscan.jsonl.loads`)."""
    return jsonl.loads(text)


def to_json(summary: dict, indent: Optional[int] = 1) -> str:
    """Strict JSON of a summary: non-finite floats written as ``{"finite": false, "value": ...}``."""
    return jsonl.dumps(summary, indent=indent)


# ---------------------------------------------------------------------------- event logs
def load_events(path: str) -> list:
    """The events of a JSONL log, in file order, non-finite floats decoded.

    A line that is not a JSON object (a crash mid-write truncates the last line) is kept as
    ``{"type": "unparsed", "line": N, "last": bool, "torn": bool, "error": str, "text": first 80
    chars}`` (:func:`nanscan.jsonl.parse_lines`) so that :func:`~nanscan.report.summarize_log` can
    say so; nothing is raised for it."""
    return jsonl.read_lines(path)


def parse_events(lines) -> list:
    """:func:`load_events` over lines already read (strings, without or with their newline)."""
    return jsonl.parse_lines([(n, line.rstrip("\n")) for n, line in enumerate(lines, 1) if line.strip()])


# ---------------------------------------------------------------------------- bundles
def _bundle_manifest_path(path: str) -> Optional[str]:
    if os.path.isdir(path):
        return os.path.join(path, "manifest.json")
    if os.path.basename(path) == "manifest.json":
        return path
    return None


def is_bundle(path: str) -> bool:
    """Whether ``path`` names a bundle: a directory (its manifest is checked on loading) or an
    existing ``manifest.json``."""
    manifest_path = _bundle_manifest_path(path)
    return manifest_path is not None and (os.path.isdir(path) or os.path.isfile(manifest_path))


def load_bundle_manifest(path: str) -> dict:
    """The manifest of a bundle directory (or of its ``manifest.json``), checked for the format.
    Only the manifest is read: no tensor file is loaded, so this needs no torch."""
    manifest_path = _bundle_manifest_path(path)
    if manifest_path is None or not os.path.isfile(manifest_path):
        raise ValueError(f"nanscan report: {path} is a directory without manifest.json: give a JSONL event "
                         "log or a failure bundle directory")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            text = f.read()
        manifest = loads(text)
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"nanscan report: {manifest_path} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"nanscan report: {manifest_path} is not a nanscan bundle manifest "
                         f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    _check_digest(manifest_path, text, manifest)
    return manifest


def _check_digest(manifest_path: str, text: str, manifest: dict) -> None:
    """A format-2 manifest's ``digest`` must match its content (:func:`nanscan.jsonl.digest`), as
    ``load_bundle`` checks it: a report never describes an edited or corrupted manifest as the
    incident. Format 1 (written before the digest existed) has none to check."""
    if manifest.get("version") == 1 and "digest" not in manifest:
        return
    try:
        raw = json.loads(text)  # (the digest covers the JSON as written: markers not decoded)
        ok = isinstance(raw.get("digest"), str) and raw["digest"] == jsonl.digest(raw)
    except (ValueError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise ValueError(f"nanscan report: {manifest_path} was edited or corrupted (its digest does not match its "
                         f"content, or it has none): not reporting it as the bundle's incident")

"""What a report reads: a JSONL event log or a failure bundle's ``manifest.json``; and the strict
JSON a summary is written as.

Non-finite floats travel as ``{"finite": false, "value": "nan" | "inf" | "-inf"}`` (the form
:mod:`nanscan.log` writes) and are decoded back to floats here. Neither torch nor
``nanscan.log`` is imported: a report can be made anywhere the log is."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

BUNDLE_FORMAT = "nanscan-bundle"  # nanscan.capture.bundle.FORMAT, repeated to keep torch out of here
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


def _decode_nonfinite(obj: dict) -> Any:
    """json object_hook: ``{"finite": false, "value": "nan"|"inf"|"-inf"}`` -> the float."""
    if obj.get("finite") is False and set(obj) <= {"finite", "value"}:
        value = obj.get("value")
        if isinstance(value, str) and value.lower() in _NONFINITE_TEXT:
            return _NONFINITE_TEXT[value.lower()]
    return obj


def loads(text: str) -> Any:
    """Parse one JSON document, turning nanscan's non-finite objects back into floats (bare
    ``NaN`` / ``Infinity`` tokens, which Python's json writes by default, are accepted too)."""
    return json.loads(text, object_hook=_decode_nonfinite)


def to_json(summary: dict, indent: Optional[int] = 1) -> str:
    """Strict JSON of a summary: non-finite floats written as ``{"finite": false, "value": ...}``."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return {"finite": False, "value": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(summary), indent=indent, allow_nan=False)


# ---------------------------------------------------------------------------- event logs
def load_events(path: str) -> list:
    """The events of a JSONL log, in file order, non-finite floats decoded.

    A line that is not a JSON object (a crash mid-write truncates the last line) is skipped and
    replaced by ``{"type": "unparsed", "line": N, "last": bool, "error": str, "text": first 80
    chars}`` so that :func:`~nanscan.report.summarize_log` can say so; nothing is raised for it."""
    with open(path, "rb") as f:
        raw = f.read()
    return parse_events(raw.decode("utf-8", errors="replace").splitlines())


def parse_events(lines) -> list:
    """:func:`load_events` over lines already read (strings, without or with their newline)."""
    lines = list(lines)
    while lines and not lines[-1].strip():
        lines.pop()
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = loads(line)
            if not isinstance(event, dict):
                raise ValueError(f"a {type(event).__name__}, not an object")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            events.append({"type": "unparsed", "line": number, "last": number == len(lines),
                           "error": str(e), "text": line[:80]})
            continue
        events.append(event)
    return events


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
        with open(manifest_path) as f:
            manifest = loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"nanscan report: {manifest_path} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"nanscan report: {manifest_path} is not a nanscan bundle manifest "
                         f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    return manifest

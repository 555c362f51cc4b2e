"""nanscan's on-disk number format and event lines, in one torch-free module: the event log
(:mod:`nanscan.log`), records (:mod:`nanscan.record`) and reports (:mod:`nanscan.report`, which
must work where torch is not installed) all read and write through it.

Strict JSON has no NaN or Infinity, so a non-finite float is written as the object
``{"finite": false, "value": "nan" | "inf" | "-inf"}`` (:func:`encode_float`) and decoded back by
:func:`loads` -- only an object with exactly those two keys and one of those three strings is a
marker; anything else stays what it is. Bare ``NaN`` / ``Infinity`` tokens (Python's json default)
are read too. Nothing is ever replaced by 0 or dropped.

An event log is JSON Lines: one object per ``\\n``-terminated line (only ``\\n`` ends a line: a raw
U+2028 inside a string is part of it). :func:`parse_lines` reads every line; a line that does not
parse is kept as ``{"type": "unparsed", ...}`` with ``torn`` set when a crash mid-write explains it
(the last line, or a line followed by a new writer's header). Readers choose what to do with
those: :func:`nanscan.log.read_events` skips torn lines with a warning and refuses others, a report
shows them.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Optional

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_DEPTH_MESSAGE = "nested too deeply (past Python's recursion limit)"


def encode_float(value: Optional[float]) -> Any:
    """A float as strict JSON: a number when finite, ``{"finite": false, "value": "nan"|"inf"|"-inf"}``
    otherwise; None stays ``null``."""
    if value is None or math.isfinite(value):
        return value
    return {"finite": False, "value": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def decode_object(obj: dict) -> Any:
    """``json`` object hook: a non-finite marker becomes its float; any other object is returned as is."""
    if len(obj) == 2 and obj.get("finite", True) is False:
        value = obj.get("value")
        if isinstance(value, str) and value in _NONFINITE:
            return _NONFINITE[value]
    return obj


def loads(text) -> Any:
    """Parse one JSON document, non-finite markers decoded. Anything that is not JSON -- including
    nesting too deep for the decoder -- is a ``ValueError``."""
    try:
        return json.loads(text, object_hook=decode_object)
    except RecursionError:
        raise ValueError(MAX_DEPTH_MESSAGE) from None


def strict(value: Any) -> Any:
    """``value`` (dicts, lists, tuples, floats, ...) with every non-finite float as its marker: what
    ``json.dumps(..., allow_nan=False)`` accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return encode_float(value)
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **kw) -> str:
    """Strict JSON of plain data (non-finite floats as markers)."""
    return json.dumps(strict(value), allow_nan=False, **kw)


def digest(document: dict, without: str = "digest") -> str:
    """SHA-256 (hex) of ``document``'s canonical JSON, its ``without`` field left out:
    ``json.dumps(sort_keys=True, separators=(",", ":"), allow_nan=False)``, ASCII. Every key and
    value is covered; layout (indentation, key order) is not. A bundle's manifest carries its own
    (:mod:`nanscan.capture.bundle` writes and checks it, the report checks it too). ``document`` is
    the JSON as parsed, markers not decoded."""
    body = {k: v for k, v in document.items() if k != without}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _is_header(line: str) -> bool:
    try:
        event = loads(line)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("type") == "header"


def split_lines(text: str) -> list:
    """The non-blank lines of a JSONL text as ``(line number, line)`` (split on ``\\n`` only)."""
    return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def parse_lines(lines: list) -> list:
    """Decode ``(number, line)`` pairs (:func:`split_lines`). A line that is not a JSON object becomes
    ``{"type": "unparsed", "line": number, "last": bool, "torn": bool, "error": str, "text": first 80
    characters}``: ``torn`` when a crash mid-write explains it (a line that is not JSON, last or
    followed by a header line)."""
    events = []
    for i, (number, line) in enumerate(lines):
        try:
            event = loads(line)
        except ValueError as e:  # (json.JSONDecodeError is a ValueError)
            last = i + 1 == len(lines)
            events.append({"type": "unparsed", "line": number, "last": last,
                           "torn": last or _is_header(lines[i + 1][1]), "error": f"not a JSON event line: {e}",
                           "text": line[:80]})
            continue
        if not isinstance(event, dict):  # (whole JSON: not a torn line)
            events.append({"type": "unparsed", "line": number, "last": i + 1 == len(lines), "torn": False,
                           "error": f"an event line must be a JSON object, got {type(event).__name__}",
                           "text": line[:80]})
            continue
        events.append(event)
    return events


def read_lines(path) -> list:
    """:func:`parse_lines` of a file (UTF-8; undecodable bytes replaced, so a torn multi-byte
    character only spoils its own line)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return parse_lines(split_lines(text))

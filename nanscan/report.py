"""Reports over a run's event log: the first anomalous step and what preceded it.

Input is either the JSONL event log of a run (one JSON object a line: ``header``, ``step``,
``incident``; other types are ignored) or a failure bundle directory (``manifest.json``, see
:mod:`nanscan.capture.bundle`). A log gives a timeline; a bundle holds one step and gives none.

The checklist followed is the one for mixed-precision trouble: log loss, unscaled grad norm, loss
scale and lr per step, find the first anomalous step, and look at what the loss scale, the grad
norm and the lr did in the few steps before it (a grad norm that grew by more than 10x points at an
explosion; a loss scale that keeps halving points at FP16 overflow -- FP16's largest value is 65504;
an lr still rising points at the warmup).

API (plain functions; ``python -m nanscan report`` builds on them)::

    load_events(path) -> list[dict]        # own tolerant parser: a truncated line is skipped, noted
    parse_events(lines) -> list[dict]      # the same over lines already read
    summarize_log(events, window=5) -> dict
    summarize_run(path) -> dict            # log or bundle
    text_report(path) -> str               # no matplotlib needed
    plot_report(path, out_png) -> str      # 4-panel timeline, needs matplotlib (Agg, no pyplot)
    html_report(path, out_html, png=None) -> str
    to_json(summary) -> str                # strict JSON, non-finite floats as {"finite": false, ...}

A step is *anomalous* when its loss or grad norm is non-finite, any per-phase non-finite count is
positive, its update was skipped, or an incident was logged for it. The criteria are checked in
that order and the first that fires names the step (``criterion``; ``criteria`` lists all). An
anomaly is *handled by the scaler* when the update was skipped while the loss and forward stayed
finite -- GradScaler's dynamic loss scaling doing its job on a gradient overflow. A non-finite loss
or activation is never that, so the report also names the first anomaly that is *not* handled
(``first_unhandled_anomaly``): usually the one that matters. Its predecessors are the ``focus``.

This module imports neither torch nor ``nanscan.log``: a report can be made anywhere the log is.
"""
from __future__ import annotations

import base64
import html
import json
import math
import os
from typing import Any, Optional

PHASES = ("forward", "loss", "backward", "update")
BUNDLE_FORMAT = "nanscan-bundle"  # nanscan.capture.bundle.FORMAT, repeated to keep torch out of here
MATPLOTLIB_HINT = "pip install 'nanscan[report]' (matplotlib) for the plot; the text report works without it"

CRITERIA = {  # in the order they are checked; the first that fires names the step
    "loss_nonfinite": "loss non-finite",
    "grad_norm_nonfinite": "grad norm non-finite",
    **{f"nonfinite_{p}": f"non-finite tensors in {p}" for p in PHASES},
    "update_skipped": "update skipped",
    "incident": "incident logged",
}
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


# ---------------------------------------------------------------------------- parsing
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


def load_events(path: str) -> list:
    """The events of a JSONL log, in file order, non-finite floats decoded.

    A line that is not a JSON object (a crash mid-write truncates the last line) is skipped and
    replaced by ``{"type": "unparsed", "line": N, "last": bool, "error": str, "text": first 80
    chars}`` so that :func:`summarize_log` can say so; nothing is raised for it."""
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


# ---------------------------------------------------------------------------- small helpers
def _num(value) -> Optional[float]:
    """A logged number as float (None stays None; bools and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _nonfinite(value) -> bool:
    return value is not None and not math.isfinite(value)


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value.is_integer() and abs(value) < 1e9:
            return str(int(value))  # loss scales, counts: 65536, not 6.554e+04
        return f"{value:.{digits}g}"
    return str(value)


def _int(value) -> int:
    v = _num(value)
    return int(v) if v is not None and math.isfinite(v) else 0


def _ranges(steps) -> str:
    """[3, 4, 5, 9] -> '3-5, 9' (at most 12 pieces)."""
    steps = sorted(set(steps))
    pieces, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        pieces.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    if len(pieces) > 12:
        pieces = pieces[:12] + [f"... ({len(steps)} steps)"]
    return ", ".join(pieces)


# ---------------------------------------------------------------------------- the log summary
def _anomaly(i: int, s: dict, incidents_at: dict) -> Optional[dict]:
    fired = []
    if _nonfinite(s["loss"][i]):
        fired.append("loss_nonfinite")
    if _nonfinite(s["grad_norm"][i]):
        fired.append("grad_norm_nonfinite")
    for p in PHASES:
        if s["nonfinite"][p][i] > 0:
            fired.append(f"nonfinite_{p}")
    if s["update"][i] == "skipped":
        fired.append("update_skipped")
    incs = incidents_at.get(s["steps"][i], [])
    if incs:
        fired.append("incident")
    if not fired:
        return None
    # handled = a gradient overflow GradScaler absorbed (as the monitor decides): the update was
    # skipped, and nothing but the backward went non-finite, and no incident says otherwise
    beyond_backward = {"loss_nonfinite", "nonfinite_forward", "nonfinite_loss", "nonfinite_update"} & set(fired)
    handled = (s["update"][i] == "skipped" and not beyond_backward
               and all(inc["incident"].get("handled_by_scaler") is not False for inc in incs))
    return {"step": s["steps"][i], "index": i, "criterion": fired[0], "criteria": fired,
            "description": ", ".join(CRITERIA[c] for c in fired),
            "handled_by_scaler": handled}


def _trend(values: list) -> dict:
    """First / last finite value of a window, their ratio and the direction."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    out = {"values": values, "first": finite[0] if finite else None, "last": finite[-1] if finite else None,
           "min": min(finite) if finite else None, "max": max(finite) if finite else None,
           "nonfinite": sum(1 for v in values if _nonfinite(v)), "ratio": None, "direction": None}
    if len(finite) >= 2:
        a, b = finite[0], finite[-1]
        out["ratio"] = (b / a) if a != 0 else None
        out["direction"] = "rising" if b > a else ("falling" if b < a else "flat")
    return out


def _preceding(s: dict, index: int, window: int) -> dict:
    """What the last ``window`` step records before record ``index`` show (seed 004's checklist)."""
    lo = max(0, index - window)
    steps = s["steps"][lo:index]
    out = {"steps": steps, "window": window}
    for key in ("loss", "grad_norm", "loss_scale", "lr"):
        out[key] = _trend(s[key][lo:index])
    g = out["grad_norm"]
    # growth over the window: last finite value against the smallest finite one before it
    finite = [v for v in g["values"] if v is not None and math.isfinite(v)]
    growth = None
    if len(finite) >= 2 and min(finite[:-1]) > 0:
        growth = finite[-1] / min(finite[:-1])
    out["grad_norm_growth"] = growth
    out["grad_norm_grew_10x"] = bool(growth is not None and growth > 10)
    out["grad_norm_nonfinite_before"] = g["nonfinite"] > 0
    scale = s["loss_scale"]
    drops = [s["steps"][j] for j in range(1, index)
             if scale[j] is not None and scale[j - 1] is not None and scale[j] < scale[j - 1]]
    drops_in_window = [d for d in drops if d in steps]
    out["loss_scale_drops_before"] = drops
    out["loss_scale_dropping"] = bool(drops_in_window)
    out["loss_scale_drops_in_window"] = drops_in_window
    out["loss_scale_below_1"] = bool(out["loss_scale"]["last"] is not None and out["loss_scale"]["last"] < 1)
    out["lr_rising"] = out["lr"]["direction"] == "rising"
    out["loss_rising"] = out["loss"]["direction"] == "rising"
    out["skipped_in_window"] = [st for st, u in zip(steps, s["update"][lo:index]) if u == "skipped"]
    return out


def summarize_log(events: list, window: int = 5, rank: Optional[int] = None) -> dict:
    """Per-step series, skipped steps, incidents, the first anomalous step and what preceded it.

    ``rank`` picks one rank's records when a log holds several (default: the header's rank, else
    the first seen). A step logged twice (a restart that repeated steps) keeps its last record.

    Keys: ``source`` ("log"), ``timeline`` (True), ``header``, ``rank``, ``other_ranks``,
    ``steps`` and aligned lists ``loss``, ``grad_norm``, ``loss_scale``, ``lr``, ``update``,
    ``nonfinite`` ({phase: [count]}); ``skipped_steps``, ``loss_scale_drops`` (steps where the scale
    fell); ``incidents`` (each ``{"step", "rank", "incident", "bundle"}``); ``first_anomaly`` and
    ``first_unhandled_anomaly`` (each None or ``{"step", "criterion", "criteria", "description",
    "handled_by_scaler", "incidents", "preceding"}``), ``focus`` (the unhandled one if any, else the
    first), ``anomalous_steps``; ``notes`` (truncated lines, duplicates, other ranks)."""
    notes: list = []
    header = next((e for e in events if e.get("type") == "header"), None)
    ranks_seen = []
    for e in events:
        if e.get("type") in ("step", "incident") and e.get("rank") not in ranks_seen:
            ranks_seen.append(e.get("rank"))
    if rank is None:
        rank = header.get("rank") if header and header.get("rank") in ranks_seen else (ranks_seen[0] if ranks_seen else None)
    other_ranks = [r for r in ranks_seen if r != rank]
    if other_ranks:
        notes.append(f"the log holds records of ranks {ranks_seen}; this report is for rank {rank}")

    for e in events:
        if e.get("type") == "unparsed":
            where = "last line" if e.get("last") else "line"
            why = "truncated (the run stopped mid-write?)" if e.get("last") else "not valid JSON"
            notes.append(f"{where} {e['line']} is {why}; skipped")

    by_step: dict = {}
    duplicates = 0
    incidents = []
    for e in events:
        kind = e.get("type")
        if e.get("rank") != rank or not isinstance(e.get("step"), int) or isinstance(e.get("step"), bool):
            continue
        if kind == "step":
            if e["step"] in by_step:
                duplicates += 1
            by_step[e["step"]] = e
        elif kind == "incident":
            inc = e.get("incident") if isinstance(e.get("incident"), dict) else {}
            incidents.append({"step": e["step"], "rank": e.get("rank"), "incident": inc, "bundle": e.get("bundle")})
    if duplicates:
        notes.append(f"{duplicates} step(s) logged more than once (a restart?); the last record of each is used")

    steps = sorted(by_step)
    s: dict = {"steps": steps, "loss": [], "grad_norm": [], "loss_scale": [], "lr": [], "update": [],
               "nonfinite": {p: [] for p in PHASES}}
    for st in steps:
        e = by_step[st]
        for key in ("loss", "grad_norm", "loss_scale", "lr"):
            s[key].append(_num(e.get(key)))
        s["update"].append(e.get("update") if e.get("update") in ("applied", "skipped") else None)
        counts = e.get("nonfinite") if isinstance(e.get("nonfinite"), dict) else {}
        for p in PHASES:
            s["nonfinite"][p].append(_int(counts.get(p)))

    # an incident for a step that has no step record still counts: give it an empty record
    incident_steps = {inc["step"] for inc in incidents}
    missing = sorted(incident_steps - set(steps))
    if missing:
        notes.append(f"incident(s) at step {_ranges(missing)} without a step record")
        for st in missing:
            i = len([x for x in s["steps"] if x < st])
            s["steps"].insert(i, st)
            for key in ("loss", "grad_norm", "loss_scale", "lr", "update"):
                s[key].insert(i, None)
            for p in PHASES:
                s["nonfinite"][p].insert(i, 0)
        steps = s["steps"]

    incidents_at: dict = {}
    for inc in incidents:
        incidents_at.setdefault(inc["step"], []).append(inc)
    anomalies = [a for a in (_anomaly(i, s, incidents_at) for i in range(len(steps))) if a is not None]
    first = anomalies[0] if anomalies else None
    unhandled = next((a for a in anomalies if not a["handled_by_scaler"]), None)
    phase_rank = {p: i for i, p in enumerate(PHASES)}
    for a in (first, unhandled):
        if a is not None and "preceding" not in a:
            a["incidents"] = sorted((inc for inc in incidents if inc["step"] == a["step"]),
                                    key=lambda inc: phase_rank.get(inc["incident"].get("phase"), len(PHASES)))
            a["preceding"] = _preceding(s, a.pop("index"), window)
    for a in anomalies:
        a.pop("index", None)

    scale = s["loss_scale"]
    drops = [steps[j] for j in range(1, len(steps))
             if scale[j] is not None and scale[j - 1] is not None and scale[j] < scale[j - 1]]
    return {
        "source": "log", "timeline": True, "header": header, "rank": rank, "other_ranks": other_ranks,
        **s,
        "skipped_steps": [st for st, u in zip(steps, s["update"]) if u == "skipped"],
        "loss_scale_drops": drops,
        "incidents": incidents,
        "anomalous_steps": [a["step"] for a in anomalies],
        "first_anomaly": first,
        "first_unhandled_anomaly": unhandled,
        "focus": unhandled or first,
        "notes": notes,
    }


# ---------------------------------------------------------------------------- bundles
def _bundle_manifest_path(path: str) -> Optional[str]:
    if os.path.isdir(path):
        return os.path.join(path, "manifest.json")
    if os.path.basename(path) == "manifest.json":
        return path
    return None


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


def summarize_bundle(manifest: dict, path: str = "") -> dict:
    """A bundle's one step, shaped like :func:`summarize_log`'s output where it can be (no series)."""
    inc = manifest.get("incident") if isinstance(manifest.get("incident"), dict) else None
    step = manifest.get("step", inc.get("step") if inc else None)
    incidents = [{"step": step, "rank": inc.get("rank"), "incident": inc, "bundle": path}] if inc else []
    focus = None
    if inc or step is not None:
        focus = {"step": step, "criterion": "incident" if inc else None, "criteria": ["incident"] if inc else [],
                 "description": "incident captured in the bundle" if inc else "bundle captured on request",
                 "handled_by_scaler": bool(inc and inc.get("handled_by_scaler")), "incidents": incidents,
                 "preceding": None}
    return {"source": "bundle", "timeline": False, "path": path, "manifest": manifest, "step": step,
            "state": manifest.get("state"), "training": manifest.get("training"),
            "autocast": manifest.get("autocast") or {}, "model_precision": manifest.get("model_precision") or {},
            "inputs": manifest.get("inputs") or [], "environment": manifest.get("environment") or {},
            "files": sorted((manifest.get("files") or {}).keys()), "incidents": incidents,
            "first_anomaly": focus, "first_unhandled_anomaly": focus if focus and not focus["handled_by_scaler"] else None,
            "focus": focus,
            "notes": ["a bundle holds one step: no timeline (give the run's JSONL event log for loss, grad norm, "
                      "loss scale and lr per step)"]}


def _is_bundle(path: str) -> bool:
    manifest_path = _bundle_manifest_path(path)
    return manifest_path is not None and (os.path.isdir(path) or os.path.isfile(manifest_path))


def summarize_run(path: str, window: int = 5) -> dict:
    """:func:`summarize_log` of a JSONL log, or :func:`summarize_bundle` of a bundle directory."""
    path = os.fspath(path)
    if _is_bundle(path):
        return summarize_bundle(load_bundle_manifest(path), os.path.abspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"nanscan report: {path} does not exist")
    summary = summarize_log(load_events(path), window=window)
    summary["path"] = os.path.abspath(path)
    return summary


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


# ---------------------------------------------------------------------------- text
def incident_text(inc: dict) -> str:
    """One sentence for an incident dict (``Incident.to_dict()``), like ``str(Incident)``."""
    s = inc.get("summary") if isinstance(inc.get("summary"), dict) else {}
    kind = inc.get("kind")
    what = {"activation": "output of module", "grad": "gradient", "param": "parameter after the update",
            "loss": "loss", "optimizer_state": "optimizer state"}.get(kind, kind or "tensor")
    produced = inc.get("produced")
    if produced is True:
        cause = "inputs finite: produced here"
    elif produced is False:
        cause = f"propagated from {', '.join(inc.get('inputs') or []) or 'upstream'}"
    else:
        cause = "produced or propagated: unknown"
    counts = ""
    if s:
        counts = (f": {_int(s.get('nan_count'))} NaN, {_int(s.get('posinf_count'))} +Inf, "
                  f"{_int(s.get('neginf_count'))} -Inf of {_int(s.get('numel'))} ({s.get('dtype', '?')}{s.get('shape', [])}"
                  + ("" if s.get("first_nonfinite_index") is None else f", first at flat index {s['first_nonfinite_index']}")
                  + ("; no finite element)" if s.get("finite_min") is None else
                     f"; finite range [{_fmt(_num(s.get('finite_min')))}, {_fmt(_num(s.get('finite_max')))}])"))
    tail = "; GradScaler skipped the update (handled)" if inc.get("handled_by_scaler") else ""
    return (f"non-finite {what} '{inc.get('name', '?')}' at step {inc.get('step')}, phase {inc.get('phase', '?')}, "
            f"rank {inc.get('rank', '?')}{counts}; {cause}{tail}")


def _series_line(label: str, trend: dict) -> str:
    return f"    {label:<11}" + " ".join(f"{_fmt(v, 3):>9}" for v in trend["values"])


def _preceding_lines(p: dict, step) -> list:
    if not p["steps"]:
        return [f"  nothing precedes step {step} in the log"]
    lines = [f"  what preceded step {step} (steps {p['steps'][0]}-{p['steps'][-1]}):",
             f"    {'step':<11}" + " ".join(f"{x:>9}" for x in p["steps"])]
    for key, label in (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"), ("lr", "lr")):
        lines.append(_series_line(label, p[key]))
    findings = []
    if p["grad_norm_growth"] is not None:
        grew = f"grad norm grew {p['grad_norm_growth']:.3g}x (last finite value vs the window's smallest)"
        findings.append(grew + (" (>10x: an explosion before the failure)" if p["grad_norm_grew_10x"] else ""))
    if p["grad_norm_nonfinite_before"]:
        findings.append(f"grad norm already non-finite {p['grad_norm']['nonfinite']} time(s) in the window")
    if p["loss_scale_dropping"]:
        findings.append(f"loss scale dropping (fell at step {', '.join(map(str, p['loss_scale_drops_in_window']))}): "
                        "scaled gradients overflowed (FP16 max 65504)")
    elif p["loss_scale_drops_before"]:
        findings.append(f"loss scale fell {len(p['loss_scale_drops_before'])} time(s) earlier "
                        f"(steps {_ranges(p['loss_scale_drops_before'])}), steady in the window")
    if p["loss_scale_below_1"]:
        findings.append("loss scale below 1: gradients overflow FP16 even unscaled")
    if p["lr"]["direction"] is not None:
        ratio = p["lr"]["ratio"]
        if p["lr"]["direction"] == "flat":
            findings.append(f"lr constant at {_fmt(p['lr']['last'])}")
        else:
            findings.append(f"lr {p['lr']['direction']}" + (f" (x{ratio:.3g})" if ratio is not None else "")
                            + (": still warming up?" if p["lr_rising"] else ""))
    if p["loss_rising"]:
        findings.append(f"loss rising ({_fmt(p['loss']['first'])} -> {_fmt(p['loss']['last'])})")
    if p["skipped_in_window"]:
        findings.append(f"updates skipped at step {', '.join(map(str, p['skipped_in_window']))}")
    lines += [f"    - {f}" for f in findings]
    return lines


def _anomaly_lines(label: str, a: dict) -> list:
    tail = " -- handled by GradScaler (update skipped, only gradients overflowed)" if a["handled_by_scaler"] else ""
    lines = [f"{label}: step {a['step']}: {CRITERIA.get(a['criterion'], a['criterion'])}"
             + (f" (also: {', '.join(CRITERIA[c] for c in a['criteria'][1:])})" if len(a["criteria"]) > 1 else "")
             + tail]
    incs = a.get("incidents") or []
    if incs:  # the first in phase order is where it started; the rest usually followed from it
        lines.append(f"  incident: {incident_text(incs[0]['incident'])}")
        if len(incs) > 1:
            lines.append("  then, same step: " + "; ".join(
                f"{i['incident'].get('kind', '?')} '{i['incident'].get('name', '?')}' ({i['incident'].get('phase', '?')})"
                for i in incs[1:6]) + (f"; ... ({len(incs) - 6} more)" if len(incs) > 6 else ""))
        bundles = list(dict.fromkeys(i["bundle"] for i in incs if i.get("bundle")))
        for b in bundles:
            lines.append(f"  bundle: {b}  (nanscan show / replay / bisect it)")
    return lines


def _bundle_text(summary: dict) -> str:
    env, lines = summary["environment"], [f"nanscan report: {summary['path']}",
                                          "source: failure bundle (one step) -- no timeline; give the run's "
                                          "JSONL event log for loss / grad norm / loss scale / lr per step"]
    lines.append(f"step {_fmt(summary['step'])}, state {summary['state'] or '-'}, "
                 f"{'training' if summary['training'] else 'eval'} mode")
    focus = summary["focus"]
    if focus and focus["incidents"]:
        lines.append(f"incident: {incident_text(focus['incidents'][0]['incident'])}")
    else:
        lines.append("incident: none recorded (bundle captured on request)")
    ac = [f"{dev} {v.get('dtype')}" for dev, v in summary["autocast"].items() if isinstance(v, dict) and v.get("enabled")]
    lines.append(f"autocast: {', '.join(ac) if ac else 'off'}")
    prec = summary["model_precision"]
    if prec:
        dtypes = ", ".join(f"{k} {v}" for k, v in (prec.get("param_dtypes") or {}).items())
        lines.append(f"parameters: {dtypes or '-'}"
                     + (f" (converted to {', '.join(prec['converted'])})" if prec.get("converted") else ""))
    if summary["inputs"]:
        lines.append("inputs: " + ", ".join(f"{i.get('path')} {i.get('dtype')}{i.get('shape')}" for i in summary["inputs"]))
    if env:
        keys = ("torch", "triton", "cuda", "cudnn", "device", "cudnn_benchmark", "cudnn_deterministic",
                "deterministic_algorithms", "tf32_matmul", "tf32_cudnn", "float32_matmul_precision")
        lines.append("environment: " + ", ".join(f"{k} {env[k]}" for k in keys if k in env))
    if summary["files"]:
        lines.append(f"files: {', '.join(summary['files'])}")
    lines.append(f"next: nanscan replay {summary['path']} --model pkg.module:factory [--fp32] [--backend inductor]")
    return "\n".join(lines) + "\n"


def format_summary(summary: dict) -> str:
    """The text of :func:`text_report` for a summary already made."""
    if summary["source"] == "bundle":
        return _bundle_text(summary)
    steps = summary["steps"]
    lines = [f"nanscan report: {summary.get('path', '(events)')}"]
    h = summary["header"] or {}
    desc = f"log: {len(steps)} step record(s)" + (f" (steps {steps[0]}-{steps[-1]})" if steps else "")
    desc += f", {len(summary['incidents'])} incident(s)"
    if h:
        desc += f"; nanscan {h.get('nanscan', '?')}, rank {h.get('rank', '?')}, started {h.get('time', '?')}"
    lines.append(desc)
    lines += [f"note: {n}" for n in summary["notes"]]
    if not steps:
        lines.append("no step records: nothing to report")
        return "\n".join(lines) + "\n"
    skipped = summary["skipped_steps"]
    lines.append(f"updates skipped: {len(skipped)}" + (f" (steps {_ranges(skipped)})" if skipped else ""))
    scales = [v for v in summary["loss_scale"] if v is not None]
    if scales:
        lines.append(f"loss scale: {_fmt(scales[0])} -> {_fmt(scales[-1])}, fell {len(summary['loss_scale_drops'])} time(s)"
                     + (f" (steps {_ranges(summary['loss_scale_drops'])})" if summary["loss_scale_drops"] else ""))
    else:
        lines.append("loss scale: not logged (no GradScaler)")
    first, unhandled = summary["first_anomaly"], summary["first_unhandled_anomaly"]
    if first is None:
        lines.append("no anomalous step: every logged loss and grad norm is finite, no non-finite tensor, "
                     "no skipped update")
        return "\n".join(lines) + "\n"
    lines += _anomaly_lines("first anomalous step", first)
    if first is not unhandled:
        if unhandled is None:
            lines.append("every anomaly was handled by GradScaler (skipped updates with a finite loss)")
        else:
            lines += _anomaly_lines("first anomaly not handled by the scaler", unhandled)
    focus = summary["focus"]
    lines += _preceding_lines(focus["preceding"], focus["step"])
    later = [st for st in summary["anomalous_steps"] if st > focus["step"]]
    if later:
        lines.append(f"anomalous after it: {len(later)} step(s) ({_ranges(later)})")
    return "\n".join(lines) + "\n"


def text_report(path: str) -> str:
    """A short readable summary of a JSONL event log or a bundle (no matplotlib needed)."""
    return format_summary(summarize_run(path))


# ---------------------------------------------------------------------------- plot
def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(MATPLOTLIB_HINT) from e
    return Figure, FigureCanvasAgg


def _plot_series(ax, steps, values, *, color, label, log, markers=True):
    """Finite values as a line (gaps at None and at non-finite values); non-finite ones as markers
    along the top edge of the panel, so they are seen, never dropped."""
    from matplotlib.transforms import blended_transform_factory

    ys = [v if v is not None and math.isfinite(v) and (not log or v > 0) else math.nan for v in values]
    ax.plot(steps, ys, color=color, lw=1.4 if markers else 0.8, marker="o" if markers else None, ms=2.5, label=label)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    marks = {"NaN": ([], "X", "#d62728"), "+Inf": ([], "^", "#ff7f0e"), "-Inf": ([], "v", "#9467bd")}
    for st, v in zip(steps, values):
        if v is not None and math.isnan(v):
            marks["NaN"][0].append(st)
        elif v is not None and math.isinf(v):
            marks["+Inf" if v > 0 else "-Inf"][0].append(st)
    for name, (xs, marker, c) in marks.items():
        if xs:
            ax.scatter(xs, [0.93] * len(xs), transform=top, marker=marker, s=46, color=c, zorder=5,
                       clip_on=False, label=f"{name} (marker at the panel's top)")
    if not any(v is not None for v in values):
        ax.text(0.5, 0.5, f"{label}: not logged", transform=ax.transAxes, ha="center", va="center", color="0.4")
    if log and any(v is not None and math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")
    if any(marks[k][0] for k in marks):  # headroom so the top-edge markers do not sit on the data
        lo, hi = ax.get_ylim()
        if ax.get_yscale() == "log":
            ax.set_ylim(lo, hi * (hi / lo) ** 0.2)
        else:
            ax.set_ylim(lo, hi + 0.2 * (hi - lo))


def plot_summary(summary: dict, out_png: str, title: Optional[str] = None) -> str:
    """Draw the 4-panel timeline of a log summary into ``out_png`` (matplotlib Agg, no pyplot)."""
    if not summary.get("timeline"):
        raise ValueError("nanscan report: a bundle holds one step, there is no timeline to plot; "
                         "give the run's JSONL event log")
    Figure, FigureCanvasAgg = _require_matplotlib()
    steps = summary["steps"]
    fig = Figure(figsize=(11, 10), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [1.2, 1.1, 1, 0.9]})
    ax_loss, ax_grad, ax_scale, ax_nf = axes
    span = (steps[-1] - steps[0]) if steps else 0
    width = max(0.8, span / 500)  # bars and shaded spans stay visible on runs of 100k steps
    markers = len(steps) <= 300

    loss = [v for v in summary["loss"] if v is not None and math.isfinite(v)]
    loss_log = bool(loss) and min(loss) > 0 and max(loss) / min(loss) > 1e3
    _plot_series(ax_loss, steps, summary["loss"], color="#1f77b4", label="loss", log=loss_log, markers=markers)
    ax_loss.set_ylabel("loss" + (" (log)" if loss_log else ""))
    _plot_series(ax_grad, steps, summary["grad_norm"], color="#2ca02c", label="grad norm", log=True, markers=markers)
    ax_grad.set_ylabel("unscaled grad norm (log)")
    if any(v is not None for v in summary["loss_scale"]):
        _plot_series(ax_scale, steps, summary["loss_scale"], color="#8c564b", label="loss scale", log=True, markers=markers)
        ax_scale.lines[-1].set_drawstyle("steps-post")
    else:
        ax_scale.text(0.5, 0.5, "loss scale not logged (no GradScaler)", transform=ax_scale.transAxes,
                      ha="center", va="center", color="0.4")
    ax_scale.set_ylabel("loss scale (log)")
    lr = summary["lr"]
    if any(v is not None for v in lr):
        ax_lr = ax_scale.twinx()
        ax_lr.plot(steps, [v if v is not None and math.isfinite(v) else math.nan for v in lr],
                   color="#7f7f7f", lw=1, ls="--", label="lr (right axis)")
        ax_lr.set_ylabel("lr", color="#7f7f7f")
        ax_lr.tick_params(axis="y", colors="#7f7f7f")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax_lr.set_ylim(bottom=0)
        ax_lr_lines = ax_lr.get_lines()
    else:
        ax_lr_lines = []

    # the counts are non-finite *elements* per phase (propagated ones included): they span orders of
    # magnitude (3 in an activation, millions in the gradients), so grouped bars on a log axis
    colors = {"forward": "#1f77b4", "loss": "#d62728", "backward": "#ff7f0e", "update": "#9467bd"}
    any_nf = False
    for k, p in enumerate(PHASES):
        counts = summary["nonfinite"][p]
        idx = [i for i, c in enumerate(counts) if c > 0]
        if idx:  # sparse: only bars that exist, so a long clean run costs nothing here
            any_nf = True
            ax_nf.bar([steps[i] + (k - 1.5) * width / 4 for i in idx], [counts[i] for i in idx],
                      width=width / 4, color=colors[p], label=p, log=True, zorder=3)  # above the step lines
    if any_nf:
        ax_nf.set_ylim(bottom=0.5)
    else:
        ax_nf.text(0.5, 0.5, "no non-finite values recorded", transform=ax_nf.transAxes,
                   ha="center", va="center", color="0.4")
    ax_nf.set_ylabel("non-finite elements\nper phase (log)")
    ax_nf.set_xlabel("step")

    # skipped updates: shaded spans on every panel, merged into one collection per panel
    spans: list = []
    for st in summary["skipped_steps"]:
        lo, hi = st - width / 2 - 0.1, st + width / 2 + 0.1
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = hi
        else:
            spans.append([lo, hi])
    if spans:
        for ax in axes:
            ax.broken_barh([(lo, hi - lo) for lo, hi in spans], (0, 1), transform=ax.get_xaxis_transform(),
                           color="#ffbb78", alpha=0.45, lw=0, zorder=0,
                           label="update skipped" if ax is ax_loss else None)

    # the incident(s) of the focus step: red line + annotation; the first anomaly if it differs
    focus, first = summary["focus"], summary["first_anomaly"]
    if first is not None and focus is not None and first["step"] != focus["step"]:
        for ax in axes:
            ax.axvline(first["step"], color="#9467bd", ls=":", lw=1.5,
                       label=(f"first anomaly (step {first['step']}"
                              + (", handled by GradScaler)" if first["handled_by_scaler"] else ")"))
                       if ax is ax_loss else None)
    if focus is not None:
        incs = focus.get("incidents") or []
        if incs:
            inc = incs[0]["incident"]
            text = f"step {focus['step']}: {inc.get('name', '?')} ({inc.get('phase', '?')})"
        else:
            text = f"step {focus['step']}: {CRITERIA.get(focus['criterion'], focus['criterion'])}"
        for ax in axes:
            ax.axvline(focus["step"], color="#d62728", lw=1.8, alpha=0.85, zorder=2,
                       label="incident" if ax is ax_loss and incs else ("first anomaly" if ax is ax_loss else None))
        left = bool(span) and focus["step"] - steps[0] > 0.35 * span  # text on the side with room
        ax_loss.annotate(text, xy=(focus["step"], 1.0), xycoords=ax_loss.get_xaxis_transform(),
                         xytext=(-8 if left else 8, -10), textcoords="offset points",
                         ha="right" if left else "left", va="top", fontsize=9,
                         color="#d62728", fontweight="bold",
                         bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#d62728", "alpha": 0.9})

    # one legend below the panels: it never hides data, the annotation or the top-edge markers
    legend: dict = {}
    for ax in axes:
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if ax is ax_scale:  # the lr line lives on the twin axis
            handles, labels = handles + ax_lr_lines, labels + [ln.get_label() for ln in ax_lr_lines]
        for h, lab in zip(handles, labels):
            legend.setdefault(lab if ax is not ax_nf else f"non-finite in {lab}", h)
    if legend:
        fig.legend(list(legend.values()), list(legend.keys()), loc="outside lower center",
                   ncols=min(4, len(legend)), fontsize=8, frameon=False)
    if steps:
        ax_nf.set_xlim(steps[0] - width, steps[-1] + width)
    if title is None:
        name = os.path.basename(summary.get("path", "")) or "event log"
        title = f"nanscan: {name} -- {len(steps)} steps"
        if focus is not None:
            title += f", first {'unhandled ' if first is not focus else ''}anomaly at step {focus['step']} " \
                     f"({CRITERIA.get(focus['criterion'], focus['criterion'])})"
    fig.suptitle(title, fontsize=11)
    out_png = os.fspath(out_png)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def plot_report(path: str, out_png: str) -> str:
    """Write a PNG timeline of the log at ``path`` to ``out_png`` and return ``out_png``: loss;
    unscaled grad norm (log); loss scale (log) with lr on a right axis; non-finite tensors per
    phase (stacked bars). Skipped updates are shaded, the incident step is a red line annotated
    with the module and phase, non-finite values are markers along a panel's top edge. Needs
    matplotlib (``ImportError`` with the install hint otherwise)."""
    _require_matplotlib()  # before reading anything: the hint is the answer when it is missing
    return plot_summary(summarize_run(path), out_png)


# ---------------------------------------------------------------------------- html
def html_report(path: str, out_html: str, png: Optional[str] = None) -> str:
    """A self-contained HTML page: the text summary, and the PNG at ``png`` embedded as base64."""
    summary = summarize_run(path)
    text = format_summary(summary)
    image = ""
    if png is not None:
        with open(png, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        image = f'<img alt="nanscan timeline" src="data:image/png;base64,{data}">\n'
    title = html.escape(f"nanscan report: {os.path.basename(summary.get('path', '')) or path}")
    page = (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{title}</title>\n"
            "<style>body{font-family:sans-serif;margin:1.5em;max-width:1300px}"
            "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:13px}img{max-width:100%}</style>\n"
            f"</head>\n<body>\n<h1>{title}</h1>\n<pre>{html.escape(text)}</pre>\n{image}</body>\n</html>\n")
    out_html = os.fspath(out_html)
    os.makedirs(os.path.dirname(os.path.abspath(out_html)), exist_ok=True)
    with open(out_html, "w", encoding="utf-8") as f:
        f.write(page)
    return out_html

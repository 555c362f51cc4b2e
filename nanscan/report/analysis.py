"""From events to a summary: per-step series, the first anomalous step and what preceded it.

A step is *anomalous* when its loss or grad norm is non-finite, any per-phase non-finite count is
positive, its update was skipped, or an incident was logged for it. The criteria are checked in
that order and the first that fires names the step (``criterion``; ``criteria`` lists all). An
anomaly is *handled by the scaler* when the update was skipped while the loss and forward stayed
finite -- GradScaler's dynamic loss scaling doing its job on a gradient overflow. A non-finite loss
or activation is never that, so the summary also names the first anomaly that is *not* handled
(``first_unhandled_anomaly``): usually the one that matters. Its predecessors are the ``focus``.

What preceded it follows the checklist for mixed-precision trouble: the loss scale, the grad norm
and the lr in the few steps before (a grad norm that grew by more than 10x points at an explosion; a
loss scale that keeps halving points at FP16 overflow -- FP16's largest value is 65504; an lr still
rising points at the warmup; a loss that at least doubled points at a divergence). A window that shows
none of these gets no finding: a grad norm up 1.02x or a loss up 0.3% is noise, not a sign.

A summary never gives an all-clear it cannot back. It counts, per number, the steps that logged it
(``logged``: a null or absent field is not logged, never taken as finite), and its ``verdict`` is
``"finding"`` (an anomaly GradScaler did not handle), ``"clear"`` (none, in what was logged) or
``"cannot tell"`` (no step record logs a loss, a grad norm, non-finite counts or an update decision;
a bundle captured on request)."""
from __future__ import annotations

import math
import os
import stat
from typing import Optional

from nanscan.report.heatmap import check_heatmap_stat, module_heatmap
from nanscan.report.load import is_bundle, load_bundle_manifest, load_events
from nanscan.vocabulary import TRAINING_PHASES

PHASES = TRAINING_PHASES  # (the step log counts these; eval forwards are not a step's)
SERIES = ("loss", "grad_norm", "loss_scale", "lr")  # the numbers a step record carries

CRITERIA = {  # in the order they are checked; the first that fires names the step
    "loss_nonfinite": "loss non-finite",
    "grad_norm_nonfinite": "grad norm non-finite",
    **{f"nonfinite_{p}": f"non-finite tensors in {p}" for p in PHASES},
    "update_skipped": "update skipped",
    "incident": "incident logged",
}


# ---------------------------------------------------------------------------- logged values
def _num(value) -> Optional[float]:
    """A logged number as float (None stays None; bools and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _nonfinite(value) -> bool:
    return value is not None and not math.isfinite(value)


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


def _scale_drops(steps: list, scale: list, end: int) -> list:
    """The steps among ``steps[1:end]`` where the loss scale fell below the step before's."""
    return [steps[j] for j in range(1, end)
            if scale[j] is not None and scale[j - 1] is not None and scale[j] < scale[j - 1]]


# ---------------------------------------------------------------------------- reading the log
def _pick_rank(events: list, header: Optional[dict], rank: Optional[int]) -> tuple:
    """(the rank reported on, every rank seen in step / incident records, in order of appearance)."""
    ranks_seen = []
    for e in events:
        if e.get("type") in ("step", "incident") and e.get("rank") not in ranks_seen:
            ranks_seen.append(e.get("rank"))
    if rank is None:
        rank = (header.get("rank") if header and header.get("rank") in ranks_seen
                else (ranks_seen[0] if ranks_seen else None))
    return rank, ranks_seen


_JSON_TYPES = {"list": "an array", "dict": "an object", "int": "a number", "float": "a number", "str": "a string",
               "bool": "true or false", "NoneType": "null"}
NOT_AN_OBJECT = "an event line must be a JSON object, got "  # nanscan.jsonl.parse_lines' error for valid JSON


def _unparsed_reason(e: dict, in_a_log: bool = True) -> str:
    """Why a line was not read, as the rest of a sentence that starts "line N ...": valid JSON that
    is not an object, a line a crash cut off (only ``in_a_log``: in a file with no event line at
    all, no run was writing), or text that is not JSON."""
    error = str(e.get("error", ""))
    if error.startswith(NOT_AN_OBJECT):
        what = error[len(NOT_AN_OBJECT):]
        return f"is valid JSON but not an event ({_JSON_TYPES.get(what, what)}, not an object)"
    if e.get("torn") and in_a_log:
        return ("is truncated (the run stopped mid-write?)" if e.get("last")
                else "was cut off mid-write (a new run's header follows it)")
    return "is not valid JSON"


def _unparsed_notes(events: list) -> list:
    return [f"{'last line' if e.get('last') else 'line'} {e['line']} {_unparsed_reason(e)}; skipped"
            for e in events if e.get("type") == "unparsed"]


def _records_of(events: list, rank) -> tuple:
    """(step records by step -- the last one wins --, incidents, how many step records repeated a step)."""
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
            # (a hand-edited or foreign line: the words a report sorts and prints by are text)
            inc = {k: (str(v) if k in ("phase", "kind", "name") and v is not None and not isinstance(v, str) else v)
                   for k, v in inc.items()}
            incidents.append({"step": e["step"], "rank": e.get("rank"), "incident": inc, "bundle": e.get("bundle")})
    return by_step, incidents, duplicates


def _series(by_step: dict) -> dict:
    """``steps`` and the lists aligned with it: the numbers, ``update``, ``nonfinite`` per phase;
    ``nonfinite_logged`` (whether the step's record has a ``nonfinite`` object: without one its
    counts read 0 but say nothing)."""
    steps = sorted(by_step)
    s: dict = {"steps": steps, **{key: [] for key in SERIES}, "update": [], "nonfinite": {p: [] for p in PHASES},
               "nonfinite_logged": []}
    for st in steps:
        e = by_step[st]
        for key in SERIES:
            s[key].append(_num(e.get(key)))
        s["update"].append(e.get("update") if e.get("update") in ("applied", "skipped") else None)
        counts = e.get("nonfinite") if isinstance(e.get("nonfinite"), dict) else None
        s["nonfinite_logged"].append(counts is not None)
        for p in PHASES:
            s["nonfinite"][p].append(_int((counts or {}).get(p)))
    return s


def _logged(s: dict) -> dict:
    """How many step records logged each number, ``update`` and ``nonfinite`` (a null or absent field
    did not)."""
    out = {key: sum(v is not None for v in s[key]) for key in (*SERIES, "update")}
    out["nonfinite"] = sum(s["nonfinite_logged"])
    return out


def _add_empty_steps(s: dict, missing: list) -> None:
    """An incident for a step that has no step record still counts: give that step an empty record."""
    for st in missing:
        i = len([x for x in s["steps"] if x < st])
        s["steps"].insert(i, st)
        for key in (*SERIES, "update"):
            s[key].insert(i, None)
        for p in PHASES:
            s["nonfinite"][p].insert(i, 0)
        s["nonfinite_logged"].insert(i, False)


# ---------------------------------------------------------------------------- anomalies
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


def _growth(values: list) -> Optional[float]:
    """The last finite value of a window against the smallest finite one before it (None unless
    there are two and all are positive)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2 or min(finite) <= 0:
        return None
    return finite[-1] / min(finite[:-1])


def _preceding(s: dict, index: int, window: int) -> dict:
    """What the last ``window`` step records before record ``index`` show (seed 004's checklist)."""
    lo = max(0, index - window)
    steps = s["steps"][lo:index]
    out = {"steps": steps, "window": window}
    for key in SERIES:
        out[key] = _trend(s[key][lo:index])
    g = out["grad_norm"]
    out["grad_norm_growth"] = growth = _growth(g["values"])
    out["grad_norm_grew_10x"] = bool(growth is not None and growth > 10)
    out["grad_norm_nonfinite_before"] = g["nonfinite"] > 0
    # (a loss can be negative -- a log-likelihood --: growth is measured only when every value is positive)
    out["loss_growth"] = growth = _growth(out["loss"]["values"])
    out["loss_grew_2x"] = bool(growth is not None and growth >= 2)
    out["not_logged"] = [key for key in SERIES if all(v is None for v in out[key]["values"])]
    drops = _scale_drops(s["steps"], s["loss_scale"], index)
    drops_in_window = [d for d in drops if d in steps]
    out["loss_scale_drops_before"] = drops
    out["loss_scale_dropping"] = bool(drops_in_window)
    out["loss_scale_drops_in_window"] = drops_in_window
    out["loss_scale_below_1"] = bool(out["loss_scale"]["last"] is not None and out["loss_scale"]["last"] < 1)
    out["lr_rising"] = out["lr"]["direction"] == "rising"
    out["loss_rising"] = out["loss"]["direction"] == "rising"
    out["skipped_in_window"] = [st for st, u in zip(steps, s["update"][lo:index]) if u == "skipped"]
    return out


def _anomalies(s: dict, incidents: list, window: int) -> tuple:
    """(every anomaly in step order, the first, the first not handled by the scaler); the last two
    carry their ``incidents`` (in phase order: the first is where it started) and ``preceding``."""
    incidents_at: dict = {}
    for inc in incidents:
        incidents_at.setdefault(inc["step"], []).append(inc)
    anomalies = [a for a in (_anomaly(i, s, incidents_at) for i in range(len(s["steps"]))) if a is not None]
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
    return anomalies, first, unhandled


HEADROOM_PLOTTED = 4  # tensors drawn in the headroom panel: the warned ones first, then the closest to overflow


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _headroom(events: list, rank, incidents: list) -> dict:
    """The monitor's headroom warnings (``"headroom"`` lines) and, for the few tensors closest to
    overflow, their bits of headroom per step (the steps' ``headroom`` fields; only tensors within a
    few bits of the threshold are logged there). ``overflow``: the step of the first incident that
    names the tensor, if any."""
    warned = [e for e in events if e.get("type") == "headroom" and e.get("rank") == rank
              and isinstance(e.get("step"), int) and isinstance(e.get("name"), str) and _number(e.get("bits"))]
    series: dict = {}
    for e in events:
        if e.get("type") == "step" and e.get("rank") == rank and isinstance(e.get("step"), int) \
                and isinstance(e.get("headroom"), dict):
            for label, bits in e["headroom"].items():
                if _number(bits):
                    series.setdefault(str(label), {})[e["step"]] = float(bits)
    for w in warned:  # (the warning's own value, should its step line be missing)
        series.setdefault(f"{w.get('record_kind')} {w['name']}", {}).setdefault(w["step"], float(w["bits"]))
    warned_labels = list(dict.fromkeys(f"{w.get('record_kind')} {w['name']}" for w in warned))
    rest = sorted((lab for lab in series if lab not in warned_labels), key=lambda lab: min(series[lab].values()))
    plotted = {}
    for label in (warned_labels + rest)[:HEADROOM_PLOTTED]:
        points = sorted(series[label].items())
        name = label.split(" ", 1)[-1]
        overflow = next((inc["step"] for inc in incidents if inc["incident"].get("name") == name), None)
        plotted[label] = {"steps": [p[0] for p in points], "bits": [p[1] for p in points],
                          "warned_at": next((w["step"] for w in warned
                                             if f"{w.get('record_kind')} {w['name']}" == label), None),
                          "overflow": overflow}
    threshold = next((w.get("threshold") for w in warned if _number(w.get("threshold"))), None)
    return {"warnings": warned, "series": plotted, "threshold": threshold}


SPIKE_METRICS = ("loss", "grad_norm")  # what the monitor's spike warnings watch (nanscan.monitor.spikes)


def _positive(v) -> Optional[float]:
    return float(v) if _number(v) and math.isfinite(v) and v > 0 else None


def _spikes(events: list, rank) -> list:
    """The monitor's spike warnings (``"spike"`` lines) of ``rank``, in step order: each ``{"step",
    "metric", "value", "baseline", "ratio", "name", "module_metric", "module_ratio"}`` (``ratio``:
    ``value / baseline``; ``name``, ``module_metric``, ``module_ratio`` None when no module's
    output departed). A step and metric logged twice (a restart that repeated steps) keeps its last
    line; a line without a step, a metric or a positive value and baseline is not a spike."""
    kept: dict = {}
    for e in events:
        step, metric = e.get("step"), e.get("metric")
        if e.get("type") != "spike" or e.get("rank") != rank or not isinstance(step, int) or isinstance(step, bool) \
                or not isinstance(metric, str):
            continue
        value, baseline = _positive(e.get("value")), _positive(e.get("baseline"))
        if value is None or baseline is None:
            continue
        name = e.get("name")
        name = None if name is None else str(name)  # (a hand-edited or foreign line: the words are text)
        module_ratio = _positive(e.get("module_ratio")) if name is not None else None
        module_metric = e.get("module_metric") if name is not None else None
        kept[step, metric] = {"step": step, "metric": metric, "value": value, "baseline": baseline,
                              "ratio": value / baseline, "name": name,
                              "module_metric": None if module_metric is None else str(module_metric),
                              "module_ratio": module_ratio}
    order = {m: i for i, m in enumerate(SPIKE_METRICS)}
    return sorted(kept.values(), key=lambda sp: (sp["step"], order.get(sp["metric"], len(order)), sp["metric"]))


# ---------------------------------------------------------------------------- verdicts
CHECKED = ("loss", "grad_norm", "nonfinite", "update")  # what can show a step going non-finite (lr, scale cannot)


def _log_verdict(steps: list, logged: dict, unhandled: Optional[dict]) -> dict:
    """``{"status": "finding" | "clear" | "cannot tell", "reason": str}``: an all-clear only where the
    log holds something that would have shown a failure."""
    if unhandled is not None:
        return {"status": "finding", "reason": f"step {unhandled['step']}: {unhandled['description']}"}
    if not steps:
        return {"status": "cannot tell", "reason": "no step records"}
    if not any(logged[key] for key in CHECKED):
        return {"status": "cannot tell", "reason": "no step record logs a loss, a grad norm, non-finite counts or "
                                                   "an update decision"}
    return {"status": "clear", "reason": "no anomaly GradScaler did not handle, in what was logged"}


# ---------------------------------------------------------------------------- summaries
def summarize_log(events: list, window: int = 5, rank: Optional[int] = None, heatmap_stat: str = "rms") -> dict:
    """Per-step series, skipped steps, incidents, the first anomalous step and what preceded it.

    ``rank`` picks one rank's records when a log holds several (default: the header's rank, else
    the first seen). A step logged twice (a restart that repeated steps) keeps its last record.

    Keys: ``source`` ("log"), ``timeline`` (True), ``header``, ``rank``, ``other_ranks``,
    ``steps`` and aligned lists ``loss``, ``grad_norm``, ``loss_scale``, ``lr``, ``update``,
    ``nonfinite`` ({phase: [count]}), ``nonfinite_logged`` ([bool]); ``logged`` ({"loss", "grad_norm",
    "loss_scale", "lr", "update", "nonfinite": how many step records logged it}); ``verdict``
    ({"status": "finding" | "clear" | "cannot tell", "reason"}); ``skipped_steps``, ``loss_scale_drops``
    (steps where the scale fell); ``incidents`` (each ``{"step", "rank", "incident", "bundle"}``);
    ``first_anomaly`` and ``first_unhandled_anomaly`` (each None or ``{"step", "criterion", "criteria",
    "description", "handled_by_scaler", "incidents", "preceding"}``), ``focus`` (the unhandled one if
    any, else the first), ``anomalous_steps``; ``headroom`` (``{"warnings": [headroom events], "series": {"<kind>
    <name>": {"steps", "bits", "warned_at", "overflow"}}, "threshold"}``: the monitor's early
    warnings and the few tensors closest to overflow); ``spikes`` (the monitor's spike warnings, in
    step order: ``[{"step", "metric", "value", "baseline", "ratio", "name", "module_metric",
    "module_ratio"}]``, ``name`` None when no module's output departed; empty without them);
    ``heatmap`` (None without telemetry lines, else the module x step matrix of ``heatmap_stat``,
    ``"rms"`` or ``"headroom_bits"``: :func:`nanscan.report.heatmap.module_heatmap`); ``notes``
    (truncated lines, duplicates, other ranks)."""
    notes: list = []
    header = next((e for e in events if e.get("type") == "header"), None)
    rank, ranks_seen = _pick_rank(events, header, rank)
    other_ranks = [r for r in ranks_seen if r != rank]
    if other_ranks:
        notes.append(f"the log holds records of ranks {ranks_seen}; this report is for rank {rank}")
    notes += _unparsed_notes(events)

    by_step, incidents, duplicates = _records_of(events, rank)
    if duplicates:
        notes.append(f"{duplicates} step(s) logged more than once (a restart?); the last record of each is used")
    s = _series(by_step)
    missing = sorted({inc["step"] for inc in incidents} - set(s["steps"]))
    if missing:
        notes.append(f"incident(s) at step {_ranges(missing)} without a step record")
        _add_empty_steps(s, missing)
    steps = s["steps"]

    anomalies, first, unhandled = _anomalies(s, incidents, window)
    logged = _logged(s)
    spikes = _spikes(events, rank)
    return {
        "source": "log", "timeline": True, "header": header, "rank": rank, "other_ranks": other_ranks,
        **s,
        "logged": logged,
        "verdict": _log_verdict(steps, logged, unhandled),
        "skipped_steps": [st for st, u in zip(steps, s["update"]) if u == "skipped"],
        "loss_scale_drops": _scale_drops(steps, s["loss_scale"], len(steps)),
        "incidents": incidents,
        "anomalous_steps": [a["step"] for a in anomalies],
        "first_anomaly": first,
        "first_unhandled_anomaly": unhandled,
        "focus": unhandled or first,
        "headroom": _headroom(events, rank, incidents),
        "spikes": spikes,
        "heatmap": module_heatmap(events, rank, heatmap_stat, unhandled or first, spikes=spikes),
        "notes": notes,
    }


def _bundle_verdict(focus: Optional[dict]) -> dict:
    if focus is None or not focus["incidents"]:
        return {"status": "cannot tell", "reason": "a bundle captured on request records no check of its step"}
    if focus["handled_by_scaler"]:
        return {"status": "clear", "reason": "the bundle's incident was a gradient overflow GradScaler handled"}
    return {"status": "finding", "reason": f"step {focus['step']}: incident captured in the bundle"}


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
            "files": sorted(manifest["files"]) if isinstance(manifest.get("files"), dict) else [],
            "incidents": incidents, "first_anomaly": focus,
            "first_unhandled_anomaly": focus if focus and not focus["handled_by_scaler"] else None,
            "focus": focus, "verdict": _bundle_verdict(focus),
            "notes": ["a bundle holds one step: no timeline (give the run's JSONL event log for loss, grad norm, "
                      "loss scale and lr per step)"]}


LOG_TYPES = ("header", "step", "incident")  # a file with none of these lines is not an event log


def _special_file(mode: int) -> Optional[str]:
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None


def _check_log_file(path: str) -> None:
    """A log must be a regular file that exists: anything else is named for what it is (a pipe is
    never opened: without a writer, opening it would wait forever)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileNotFoundError(f"nanscan report: {path} is a broken symbolic link "
                                    f"(to {os.readlink(path)})") from None
        raise FileNotFoundError(f"nanscan report: {path} does not exist") from None
    except OSError as e:  # (a parent that is a file, a directory we may not search)
        raise ValueError(f"nanscan report: cannot read {path}: {e.strerror or e}") from None
    special = _special_file(mode)
    if special is not None:
        raise ValueError(f"nanscan report: {path} is {special}, not a file: give a JSONL event log or a bundle "
                         "directory (save a stream to a file first)")


def _check_is_log(path: str, events: list) -> None:
    """Refuse a file none of whose lines is a header, step or incident record (a README, a JSON
    config, an image): its report would be empty, as if the run had nothing to show."""
    if any(e.get("type") in LOG_TYPES for e in events):
        return
    if not events:
        why = "it is empty"
    else:
        bad = next((e for e in events if e.get("type") == "unparsed"), None)
        if bad is not None:
            why = f"line {bad['line']} {_unparsed_reason(bad, in_a_log=False)}"
        else:
            why = 'no line is a "header", "step" or "incident" record'
        why += f" ({len(events)} line(s))"
    raise ValueError(f"nanscan report: {path} is not a nanscan event log: {why}; give a JSONL event log "
                     "(EventLog, watch(..., log=...)) or a bundle directory")


def summarize_run(path: str, window: int = 5, heatmap_stat: str = "rms") -> dict:
    """:func:`summarize_log` of a JSONL log, or :func:`summarize_bundle` of a bundle directory.
    A path that is missing is a ``FileNotFoundError``; one that is not a regular file, cannot be
    read, or is not an event log (no header, step or incident line) is a ``ValueError`` saying which.
    ``heatmap_stat``: the telemetry statistic of the log's module heatmap (``"rms"`` or
    ``"headroom_bits"``; a bundle has none)."""
    path = os.fspath(path)
    check_heatmap_stat(heatmap_stat)
    if is_bundle(path):
        return summarize_bundle(load_bundle_manifest(path), os.path.abspath(path))
    _check_log_file(path)
    try:
        events = load_events(path)
    except OSError as e:
        raise ValueError(f"nanscan report: cannot read {path}: {e.strerror or e}") from None
    _check_is_log(path, events)
    summary = summarize_log(events, window=window, heatmap_stat=heatmap_stat)
    summary["path"] = os.path.abspath(path)
    return summary

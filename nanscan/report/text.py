"""A summary as text: the log's first anomaly and what preceded it, or a bundle's one step.

:func:`bundle_text` is the one renderer of a capture bundle: ``nanscan show BUNDLE`` and
``nanscan report BUNDLE`` both print it (and the demo). :func:`summary_blocks` is the text before it
is laid out -- lines, the table of what preceded the focus step as a :class:`Table`, the spikes as
a :class:`Listing` -- so that the HTML page (:mod:`nanscan.report.html`) says the same words with
real tables."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

from nanscan.report.analysis import CRITERIA, _int, _num, _ranges, summarize_run
from nanscan.vocabulary import KIND_PHRASES


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


def _dict(value) -> dict:
    """A manifest field that should be an object; anything else reads as empty (never a crash)."""
    return value if isinstance(value, dict) else {}


def incident_text(inc: dict) -> str:
    """One sentence for an incident dict (``Incident.to_dict()``), like ``str(Incident)``."""
    s = inc.get("summary") if isinstance(inc.get("summary"), dict) else {}
    kind = inc.get("kind")
    what = KIND_PHRASES.get(kind, kind or "tensor") if isinstance(kind, str) or kind is None else str(kind)
    produced = inc.get("produced")
    if produced is True:
        cause = "inputs finite: produced here"
    elif produced is False:
        cause = f"propagated from {', '.join(inc.get('inputs') or []) or 'upstream'}"
    elif inc.get("order_known") is False:
        cause = "where it began: unknown (modules run eagerly beside compiled graphs; the first value seen)"
    else:
        cause = "produced or propagated: unknown"
    counts = ""
    if s:
        counts = (f": {_int(s.get('nan_count'))} NaN, {_int(s.get('posinf_count'))} +Inf, "
                  f"{_int(s.get('neginf_count'))} -Inf of {_int(s.get('numel'))} "
                  f"({s.get('dtype', '?')}{s.get('shape', [])}"
                  + ("" if s.get("first_nonfinite_index") is None
                     else f", first at flat index {s['first_nonfinite_index']}")
                  + ("; no finite element)" if s.get("finite_min") is None else
                     f"; finite range [{_fmt(_num(s.get('finite_min')))}, {_fmt(_num(s.get('finite_max')))}])"))
    tail = "; GradScaler skipped the update (handled)" if inc.get("handled_by_scaler") else ""
    return (f"non-finite {what} '{inc.get('name', '?')}' at step {inc.get('step')}, phase {inc.get('phase', '?')}, "
            f"rank {inc.get('rank', '?')}{counts}; {cause}{tail}")


# ---------------------------------------------------------------------------- a bundle
def bundle_text(summary: dict) -> str:
    """A bundle's manifest as a readable page, from :func:`~nanscan.report.summarize_bundle`:
    when and at which step it was captured, the state it holds, the incident (headline and the full
    sentence), autocast per device, parameter dtypes, the inputs, every environment entry, the
    files, the summary's notes and the replay command to run next."""
    m = summary["manifest"]
    state = summary["state"]
    lines = [f"nanscan bundle {summary['path']}",
             f"  created      {m.get('created', '-')}",
             f"  step         {_fmt(summary['step'])}",
             "  state        " + (f"model / optimizer / scaler state from {state}" if state else "-"),
             f"  mode         {'train' if summary['training'] else 'eval'}"]
    focus = summary["focus"]
    if focus and focus["incidents"]:
        inc = focus["incidents"][0]["incident"]
        lines.append(f"  incident     {inc.get('kind')} '{inc.get('name')}' in {inc.get('phase')} "
                     f"(produced={inc.get('produced')}, rank {inc.get('rank')})")
        lines.append(f"               {incident_text(inc)}")
    else:
        lines.append("  incident     none recorded (bundle captured on request)")
    for device, ac in _dict(summary["autocast"]).items():
        ac = _dict(ac)
        lines.append(f"  autocast     {device}: " + (f"on, {ac.get('dtype')}" if ac.get("enabled") else "off"))
    prec = _dict(summary["model_precision"])
    dtypes = ", ".join(f"{k} {v}" for k, v in _dict(prec.get("param_dtypes")).items())
    converted = prec.get("converted") if isinstance(prec.get("converted"), list) else []
    lines.append(f"  parameters   {dtypes or '-'}"
                 + (f" (converted to {', '.join(map(str, converted))})" if converted else ""))
    for item in summary["inputs"] if isinstance(summary["inputs"], list) else []:
        item = _dict(item)
        lines.append(f"  input        {item.get('path')}: {item.get('dtype')}{item.get('shape')}")
    for key, value in _dict(summary["environment"]).items():
        lines.append(f"  env          {key} = {value}")
    lines.append(f"  files        {', '.join(summary['files']) or '-'}")
    lines += [f"  note         {n}" for n in summary["notes"]]
    lines.append(f"  next         nanscan replay {summary['path']} --model pkg.module:factory "
                 "[--fp32] [--backend inductor]")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- a log
class Table(NamedTuple):
    """Numbers per step: ``steps`` (the columns of the text) and ``rows`` ((label, [cell text]))."""
    steps: list
    rows: list


class Listing(NamedTuple):
    """Rows of cells under a header, one row per item (the spikes): ``columns`` ((label, align),
    align ``"<"`` or ``">"``) and ``rows`` ([cell text] each). The text lays it out in aligned
    columns; the HTML page as a table whose last column wraps."""
    columns: list
    rows: list


PRECEDING_ROWS = (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"), ("lr", "lr"))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _findings(p: dict) -> list:
    """What the window before a step shows, one phrase each (the checklist of the analysis). A
    window that shows nothing gets no phrase: a change below the thresholds is noise."""
    findings = []
    if p["grad_norm_grew_10x"]:
        findings.append(f"grad norm grew {p['grad_norm_growth']:.3g}x (last finite value vs the window's smallest): "
                        "an explosion before the failure")
    if p["grad_norm_nonfinite_before"]:
        findings.append(f"grad norm already non-finite {p['grad_norm']['nonfinite']} time(s) in the window")
    if p["loss_grew_2x"]:
        findings.append(f"loss grew {p['loss_growth']:.3g}x (last finite value vs the window's smallest)")
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
    if p["skipped_in_window"]:
        findings.append(f"updates skipped at step {', '.join(map(str, p['skipped_in_window']))}")
    return findings


def _preceding_blocks(p: dict, step) -> list:
    """The window before the focus step: a table of the numbers it logged (rows of what it did not
    log are left out and named), then the findings."""
    if not p["steps"]:
        return [f"  nothing precedes step {step} in the log"]
    rows = [(label, [_fmt(v, 3) for v in p[key]["values"]]) for key, label in PRECEDING_ROWS
            if key not in p["not_logged"]]
    blocks = [f"  what preceded step {step} (steps {p['steps'][0]}-{p['steps'][-1]}):", Table(list(p["steps"]), rows)]
    if p["not_logged"]:
        labels = dict(PRECEDING_ROWS)
        blocks.append(f"    not logged in these steps: {', '.join(labels[k] for k in p['not_logged'])}")
    return blocks + [f"    - {f}" for f in _findings(p)]


def _table_lines(table: Table) -> list:
    return ([f"    {'step':<11}" + " ".join(f"{x:>9}" for x in table.steps)]
            + [f"    {label:<11}" + " ".join(f"{c:>9}" for c in cells) for label, cells in table.rows])


def _listing_lines(listing: Listing) -> list:
    """The header and the rows in columns as wide as their widest cell (the last one unpadded)."""
    labels = [label for label, _ in listing.columns]
    widths = [max(len(cell) for cell in column) for column in zip(labels, *listing.rows)]
    last = len(labels) - 1

    def line(cells) -> str:
        return "    " + "  ".join(cell if i == last and align == "<" else f"{cell:{align}{width}}"
                                  for i, (cell, (_, align), width) in enumerate(zip(cells, listing.columns, widths)))
    return [line(labels)] + [line(cells) for cells in listing.rows]


def _block_lines(block) -> list:
    if isinstance(block, Table):
        return _table_lines(block)
    if isinstance(block, Listing):
        return _listing_lines(block)
    return [block]


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
                f"{i['incident'].get('kind', '?')} '{i['incident'].get('name', '?')}' "
                f"({i['incident'].get('phase', '?')})"
                for i in incs[1:6]) + (f"; ... ({len(incs) - 6} more)" if len(incs) > 6 else ""))
        bundles = list(dict.fromkeys(i["bundle"] for i in incs if i.get("bundle")))
        for b in bundles:
            lines.append(f"  bundle: {b}  (nanscan show / replay / bisect it)")
    return lines


def _log_overview_lines(summary: dict) -> list:
    """What the log holds: step records, incidents, the header, the notes."""
    steps = summary["steps"]
    h = summary["header"] or {}
    desc = f"log: {len(steps)} step record(s)" + (f" (steps {steps[0]}-{steps[-1]})" if steps else "")
    desc += f", {len(summary['incidents'])} incident(s)"
    if h:
        desc += f"; nanscan {h.get('nanscan', '?')}, rank {h.get('rank', '?')}, started {h.get('time', '?')}"
    return [f"nanscan report: {summary.get('path', '(events)')}", desc] + [f"note: {n}" for n in summary["notes"]]


def _updates_lines(summary: dict) -> list:
    """Skipped updates (counted over the steps that logged an update decision) and the loss scale's path."""
    skipped, n, k = summary["skipped_steps"], len(summary["steps"]), summary["logged"]["update"]
    if k == 0:
        lines = ["updates skipped: not logged (no step record has an update decision)"]
    else:
        lines = [f"updates skipped: {len(skipped)}" + (f" (steps {_ranges(skipped)})" if skipped else "")
                 + ("" if k == n else f" of the {k} steps that logged an update decision")]
    scales = [v for v in summary["loss_scale"] if v is not None]
    if scales:
        drops = summary["loss_scale_drops"]
        lines.append(f"loss scale: {_fmt(scales[0])} -> {_fmt(scales[-1])}, fell {len(drops)} time(s)"
                     + (f" (steps {_ranges(drops)})" if drops else ""))
    else:
        lines.append("loss scale: not logged (no GradScaler watched)")
    return lines


COVERAGE = (("loss", "loss"), ("grad_norm", "grad norm"), ("nonfinite", "non-finite counts"),
            ("update", "update decisions"))  # analysis.CHECKED, as they are named


def _not_logged_lines(summary: dict) -> list:
    """What no step record logged: nothing about it was checked."""
    n, logged = len(summary["steps"]), summary["logged"]
    missing = [f"{label} ({'absent' if key == 'nonfinite' else 'null'} at all {_plural(n, 'step')})"
               for key, label in COVERAGE if logged[key] == 0]
    return [f"not logged, so not checked: {', '.join(missing)}"] if missing else []


def _all_clear_lines(summary: dict) -> list:
    """No anomaly: say so for each thing that was logged, with how many steps logged it."""
    n, logged = len(summary["steps"]), summary["logged"]
    lines = ["no anomalous step in what was logged:"]
    for key, label in (("loss", "loss"), ("grad_norm", "grad norm")):
        k = logged[key]
        if k:
            lines.append(f"  - {label} finite at all {_plural(k, 'logged step')}"
                         + ("" if k == n else f" (null at {n - k} of {n})"))
    for key, phrase in (("nonfinite", "no non-finite tensor counted"), ("update", "no update skipped")):
        k = logged[key]
        if k:
            counted = _plural(k, "step") if k == n else f"{k} of {n} steps; not logged at {n - k}"
            lines.append(f"  - {phrase} ({counted})")
    return lines


def _headroom_lines(headroom: Optional[dict]) -> list:
    """The monitor's headroom warnings, one line each, with the trend and whether it came true."""
    if not headroom or not headroom["warnings"]:
        return []
    threshold = headroom["threshold"]
    lines = [f"headroom warnings ({len(headroom['warnings'])}"
             + (f", below {threshold:g} bits" if threshold is not None else "") + "):"]
    for w in headroom["warnings"]:
        label = f"{w.get('record_kind')} {w['name']}"
        dtype = w.get("dtype")
        if w.get("cast") and w.get("stored_dtype"):
            dtype = f"{w['stored_dtype']}, as {dtype}"
        line = f"  step {w['step']}: {label} ({dtype}) {_fmt(w['bits'], 3)} bits left"
        if w.get("bits_per_100") is not None:
            line += f", losing {_fmt(w['bits_per_100'], 3)} bits per 100 steps"
            if w.get("overflow_step") is not None:
                line += f", overflow predicted near step {w['overflow_step']}"
        overflow = (headroom["series"].get(label) or {}).get("overflow")
        if overflow is not None:
            line += f"; non-finite at step {overflow}"
        lines.append(line)
    return lines


SPIKES_LISTED = 20  # spikes listed at most; the summary's "spikes" holds them all
SPIKE_COLUMNS = (("step", ">"), ("metric", "<"), ("value", ">"), ("baseline", ">"), ("x baseline", ">"),
                 ("where it started", "<"))


def _spike_started(sp: dict) -> str:
    """Where a spike started: the module whose output departed first, by how much; or that none did."""
    if sp.get("name") is None:
        return "no module departed"
    what = f"output {sp['module_metric']}" if sp.get("module_metric") else "output"
    ratio = sp.get("module_ratio")
    return f"{sp['name']} ({what} {_fmt(ratio, 3)}x its baseline)" if ratio is not None else f"{sp['name']} ({what})"


def _spikes_blocks(spikes: Optional[list]) -> list:
    """The monitor's spike warnings: a line, then one row per spike (the first SPIKES_LISTED)."""
    if not spikes:
        return []
    rows = [[str(sp["step"]), sp["metric"].replace("_", " "), _fmt(sp["value"]), _fmt(sp["baseline"]),
             f"{_fmt(sp['ratio'], 3)}x", _spike_started(sp)] for sp in spikes[:SPIKES_LISTED]]
    blocks = [f"spikes ({len(spikes)}): loss or grad norm far above its running baseline, and where it started:",
              Listing(list(SPIKE_COLUMNS), rows)]
    rest = spikes[SPIKES_LISTED:]
    if rest:
        blocks.append(f"    ... {len(rest)} more (steps {_ranges(sp['step'] for sp in rest)})")
    return blocks


def _heatmap_lines(hm: Optional[dict]) -> list:
    """Where the plot's module heatmap comes from, in one line (none without telemetry lines)."""
    if hm is None:
        return []
    steps = hm["steps"]
    if not hm["modules"]:
        return [f"heatmap: none; the {len(steps)} telemetry line(s) hold no nanscan/{hm['stat']}/<module> scalars"]
    scale = "log colour scale" if hm["scale"] == "log10" else "linear colour scale"
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    which = (f"{steps[0]}-{steps[-1]} every {gaps.pop()}" if len(gaps) == 1 and 1 not in gaps else _ranges(steps))
    line = (f"heatmap: {hm['what']} ({scale}), {_plural(hm['total_modules'], 'module')} x "
            f"{_plural(len(steps), 'telemetry step')} ({which})")
    if hm["hidden"]:
        line += f"; drawn: {hm['rule']}"
    return [line]


def _log_blocks(summary: dict) -> list:
    lines = _log_overview_lines(summary)
    if not summary["steps"]:
        return lines + _heatmap_lines(summary.get("heatmap")) + [
            "no step records: cannot tell whether the run stayed finite"]
    lines += _updates_lines(summary)
    lines += _headroom_lines(summary.get("headroom"))
    lines += _spikes_blocks(summary.get("spikes"))
    lines += _heatmap_lines(summary.get("heatmap"))
    first, unhandled = summary["first_anomaly"], summary["first_unhandled_anomaly"]
    verdict = summary["verdict"]
    if verdict["status"] == "cannot tell":
        return lines + [f"cannot tell whether the run stayed finite: {verdict['reason']}"]
    lines += _not_logged_lines(summary)
    if first is None:
        return lines + _all_clear_lines(summary)
    lines += _anomaly_lines("first anomalous step", first)
    if first is not unhandled:
        if unhandled is None:
            lines.append("every anomaly was handled by GradScaler (skipped updates with a finite loss)")
        else:
            lines += _anomaly_lines("first anomaly not handled by the scaler", unhandled)
    focus = summary["focus"]
    lines += _preceding_blocks(focus["preceding"], focus["step"])
    later = [st for st in summary["anomalous_steps"] if st > focus["step"]]
    if later:
        lines.append(f"anomalous after it: {len(later)} step(s) ({_ranges(later)})")
    return lines


def summary_blocks(summary: dict) -> list:
    """The report's text before layout: lines (str, indented by leading spaces), :class:`Table` s and
    :class:`Listing` s."""
    if summary["source"] == "bundle":
        return bundle_text(summary).splitlines()
    return _log_blocks(summary)


def format_summary(summary: dict) -> str:
    """The text of :func:`text_report` for a summary already made (a log's or a bundle's)."""
    if summary["source"] == "bundle":
        return bundle_text(summary)
    lines: list = []
    for block in _log_blocks(summary):
        lines += _block_lines(block)
    return "\n".join(lines) + "\n"


def text_report(path: str) -> str:
    """A short readable summary of a JSONL event log or a bundle (no matplotlib needed)."""
    return format_summary(summarize_run(path))

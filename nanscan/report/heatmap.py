"""A module x step matrix of one telemetry statistic, from a log's ``"telemetry"`` lines.

``watch(..., telemetry=JSONL(log))`` writes, every ``telemetry_every`` steps, a line
``{"type": "telemetry", "step": 7, "rank": 0, "scalars": {"nanscan/rms/<module>": ..., ...}}``
(:mod:`nanscan.monitor.health`). :func:`module_heatmap` turns them into one row per module output
and one column per telemetry step:

- ``stat``: ``"rms"`` (root mean square of the module's output over its finite elements; drawn as
  log10, since activations span decades) or ``"headroom_bits"`` (log2(dtype max / amax): already a
  logarithm, drawn linearly).
- ``values``: the logged number, as it was logged. A point that was not logged (the module did not
  run that step, or ``telemetry_names`` left it out) is ``None`` -- blank in the picture, never 0.
- ``not_finite``: where the statistic itself was not finite, so the NaN rule sent
  ``<stat>_nonfinite = 1`` in its place (an rms whose sum of squares overflowed: the output's values
  can still be finite); its value is ``None``.
- ``nonfinite``: ``nanscan/nonfinite/<module>``, the module's non-finite values summed over the
  checked steps since the previous point (so a NaN between two points shows at the next one); 0 where
  none was sent (the monitor sends no zeros).
- Rows are the modules that have the statistic, in model order: the order of the module's scalar
  names in the first line that has them (names the NaN rule renamed go last in a line, so they
  count after the others), then modules first seen in later lines, in the order seen.
- ``incident``: the report's incident (the first of its focus step, in phase order), on the row of
  its module -- a parameter's or gradient's incident on the row of the module that owns it --,
  at its own step (which need not be a telemetry step).
- ``warnings``: the monitor's headroom warnings (``"headroom"`` lines) of module outputs, at their
  step, on their module's row. Warnings of parameters and gradients are in the report's headroom
  panel, not here: a row is a module's output.
- ``spikes``: the monitor's spike warnings (``"spike"`` lines, the summary's ``spikes``) that name
  the module where the spike started, at their step (which need not be a telemetry step), on that
  module's row. A spike that names no module (no module's output departed) is in the timeline
  only.
- Columns are the steps whose telemetry lines hold module statistics. Lines of one step are merged
  (a later line's value wins): the monitor sends a spike's ratio (``nanscan/spike/<metric>``) in a
  line of its own at the spike's step, a telemetry step or not; it adds to that step's numbers and
  is never a column of blanks.

At most :data:`MAX_ROWS` rows, so that a big model stays readable (:func:`_pick_rows`): a model with
more modules shows, in model order, the incident's module and its two neighbours on each side, then
the modules that counted non-finite values or whose statistic was not finite (earliest in model
order first), then those with a headroom warning, then those where a spike started, then those
whose plotted value changed most over the run (the span of the colour scale they cover: decades of
rms, bits of headroom). The incident's module is never left out; the summary says how many were."""
from __future__ import annotations

import math
from typing import Optional

HEATMAP_STATS = {  # stat -> (what it is, colour scale)
    "rms": ("rms of module outputs", "log10"),
    "headroom_bits": ("headroom bits of module outputs", "linear"),
}
MAX_ROWS = 64  # rows drawn at most; beyond this the picture is a smear of names
NEIGHBOURS = 2  # rows kept on each side of the incident's module: where it came from, where it went
PREFIX = "nanscan"  # nanscan.telemetry.scalars.PREFIX (repeated: the report imports no torch)
MODULE_STATS = ("rms", "amax", "zero_frac", "headroom_bits", "nonfinite")  # per module output (monitor.health)
NONFINITE_SUFFIX = "_nonfinite"  # the NaN rule's name for a value that was not finite


def check_heatmap_stat(stat) -> str:
    """``stat`` if a heatmap can be made of it, else a ``ValueError`` naming the ones that can."""
    if stat not in HEATMAP_STATS:
        raise ValueError(f"nanscan report: heatmap stat {stat!r} is not one of {', '.join(HEATMAP_STATS)}")
    return stat


def _value(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _telemetry_points(events: list, rank) -> dict:
    """step -> scalars of the rank's telemetry lines, the lines of one step merged (a later line's
    value wins: a restart that repeated a step keeps its last numbers)."""
    points: dict = {}
    for e in events:
        if e.get("type") == "telemetry" and e.get("rank") == rank and isinstance(e.get("step"), int) \
                and not isinstance(e.get("step"), bool) and isinstance(e.get("scalars"), dict):
            points.setdefault(e["step"], {}).update(e["scalars"])
    return points


def _module_scalar(key) -> bool:
    """Whether a scalar's name is a module statistic (``nanscan/<stat>/<module>``)."""
    if not isinstance(key, str) or not key.startswith(PREFIX + "/"):
        return False
    kind, _, name = key[len(PREFIX) + 1:].partition("/")
    return kind in MODULE_STATS and bool(name)


def _module_of(name, modules: dict) -> Optional[str]:
    """The row of a tensor's name: itself, an output gradient's module (``"fc (output grad)"``), or
    the nearest enclosing module of a parameter (``"blocks.0.fc.weight"`` -> ``"blocks.0.fc"``);
    None when no row is any of these."""
    if not isinstance(name, str):
        return None
    name = name.removesuffix(" (output grad)")
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _span(values: list, scale: str) -> float:
    """How much of the colour scale a row covers: decades of a log10 scale, units of a linear one
    (-1 when it has fewer than two values to compare)."""
    finite = [v for v in values if v is not None and (v > 0 or scale != "log10")]
    if len(finite) < 2:
        return -1.0
    if scale == "log10":
        return math.log10(max(finite)) - math.log10(min(finite))
    return max(finite) - min(finite)


def _pick_rows(modules: list, values: list, nonfinite: list, warned: set, spiked: set, incident_row: Optional[int],
               scale: str, max_rows: int) -> tuple:
    """(the row indices kept, in model order; the rule in words). See the module docstring."""
    n = len(modules)
    if n <= max_rows:
        return list(range(n)), "all modules"
    keep: list = []

    def add(rows) -> None:
        for r in rows:
            if len(keep) >= max_rows:
                return
            if r not in keep:
                keep.append(r)

    if incident_row is not None:
        add([incident_row])
        add(r for r in range(incident_row - NEIGHBOURS, incident_row + NEIGHBOURS + 1) if 0 <= r < n)
    add(r for r in range(n) if any(nonfinite[r]))
    add(r for r in range(n) if r in warned)
    add(r for r in range(n) if r in spiked)
    add(sorted(range(n), key=lambda r: (-_span(values[r], scale), r)))
    return sorted(keep), (f"{len(keep)} of {n} modules: the incident's and its neighbours, the non-finite, the "
                          "headroom-warned, where spikes started, then the most changed")


def module_heatmap(events: list, rank, stat: str = "rms", focus: Optional[dict] = None,
                   max_rows: int = MAX_ROWS, spikes: Optional[list] = None) -> Optional[dict]:
    """The matrix of ``stat`` per module output and telemetry step (see the module docstring), or
    None when the log has no telemetry line of ``rank``.

    Keys: ``stat``, ``what``, ``scale`` ("log10" | "linear"), ``steps`` (the telemetry steps),
    ``modules`` (the rows drawn, in model order), ``index`` (their places in model order: a gap
    where modules were left out), ``values`` ([[float | None] per step] per row: the logged
    values), ``not_finite`` ([[bool] per step] per row), ``nonfinite`` ([[int] per step] per row),
    ``total_modules``, ``hidden`` (modules not drawn), ``rule`` (which rows were kept, in words),
    ``incident`` (None or ``{"step", "name", "kind", "phase", "module"}``; ``module`` None when no
    row is its module), ``warnings`` (``[{"step", "module", "bits"}]`` of the rows drawn), ``spikes``
    (``[{"step", "module", "metrics", "module_metric", "module_ratio"}]`` of the rows drawn: one per
    step and module, ``metrics`` the spiking metrics in order).
    ``focus``: the summary's focus anomaly (its first incident is the one marked). ``spikes``: the
    summary's spikes (:func:`~nanscan.report.summarize_log`'s ``spikes``), marked where they name a row."""
    check_heatmap_stat(stat)
    if rank is None:  # (a log of telemetry lines only: no step or incident line named the rank)
        rank = next((e.get("rank") for e in events if e.get("type") == "telemetry"), None)
    points = _telemetry_points(events, rank)
    if not points:
        return None
    # (columns: the steps with module statistics; when none has any, every line's step, so that the
    # text can say the lines hold none)
    steps = sorted(st for st, scalars in points.items() if any(map(_module_scalar, scalars))) or sorted(points)
    col = {st: j for j, st in enumerate(steps)}
    order: dict = {}  # module -> place in model order (first seen: lines in file order, names in line order)
    logged: dict = {}  # (module, column) -> value
    broken: set = set()  # (module, column): the statistic was not finite (sent as <stat>_nonfinite)
    counts: dict = {}  # (module, column) -> non-finite values counted since the previous point
    for st, scalars in points.items():
        if st not in col:
            continue
        j = col[st]
        late = []
        for key, v in scalars.items():
            if not isinstance(key, str) or not key.startswith(PREFIX + "/"):
                continue
            kind, _, name = key[len(PREFIX) + 1:].partition("/")
            if kind not in MODULE_STATS or not name:
                continue
            flagged = name.endswith(NONFINITE_SUFFIX)  # (the NaN rule: the value was not finite, 1 sent instead)
            if flagged and kind != "nonfinite":
                name = name[:-len(NONFINITE_SUFFIX)]
                late.append(name)  # (the NaN rule puts these names last: not where the module is)
            elif kind != "nonfinite":
                order.setdefault(name, len(order))
            if kind == stat:
                if flagged:
                    broken.add((name, j))
                else:
                    logged[name, j] = _value(v)
            elif kind == "nonfinite":
                count = _value(v)
                if count is not None and count > 0:
                    counts[name, j] = int(count)
        for name in late:
            order.setdefault(name, len(order))
    with_stat = {name for name, _ in logged} | {name for name, _ in broken}
    names = [name for name in order if name in with_stat]
    modules = {name: i for i, name in enumerate(names)}
    columns = range(len(steps))
    values = [[logged.get((name, j)) for j in columns] for name in names]
    not_finite = [[(name, j) in broken for j in columns] for name in names]
    nonfinite = [[counts.get((name, j), 0) for j in columns] for name in names]

    incident = None
    incs = (focus or {}).get("incidents") or []
    if incs:
        inc = incs[0]["incident"]
        incident = {"step": incs[0]["step"], "name": inc.get("name"), "kind": inc.get("kind"),
                    "phase": inc.get("phase"), "module": _module_of(inc.get("name"), modules)}
    warned_at: list = []
    for e in events:
        if e.get("type") == "headroom" and e.get("rank") == rank and e.get("record_kind") == "activation" \
                and isinstance(e.get("step"), int) and e.get("name") in modules and _value(e.get("bits")) is not None:
            warned_at.append((modules[e["name"]], e["step"], float(e["bits"])))

    spiked_at: dict = {}  # (row, step) -> the spikes that started there, in the summary's order
    for sp in spikes or ():
        if sp.get("name") in modules:
            spiked_at.setdefault((modules[sp["name"]], sp["step"]), []).append(sp)

    flagged_rows = [[c > 0 or bad for c, bad in zip(cs, bads)] for cs, bads in zip(nonfinite, not_finite)]
    incident_row = modules.get(incident["module"]) if incident is not None else None
    rows, rule = _pick_rows(names, values, flagged_rows, {r for r, _, _ in warned_at}, {r for r, _ in spiked_at},
                            incident_row, HEATMAP_STATS[stat][1], max_rows)
    kept = set(rows)
    return {"stat": stat, "what": HEATMAP_STATS[stat][0], "scale": HEATMAP_STATS[stat][1], "steps": steps,
            "modules": [names[r] for r in rows], "index": rows, "values": [values[r] for r in rows],
            "nonfinite": [nonfinite[r] for r in rows], "not_finite": [not_finite[r] for r in rows],
            "total_modules": len(names), "hidden": len(names) - len(rows), "rule": rule, "incident": incident,
            "warnings": [{"step": st, "module": names[r], "bits": bits} for r, st, bits in warned_at if r in kept],
            "spikes": [{"step": st, "module": names[r], "metrics": [sp["metric"] for sp in sps],
                        "module_metric": sps[0].get("module_metric"), "module_ratio": sps[0].get("module_ratio")}
                       for (r, st), sps in sorted(spiked_at.items(), key=lambda kv: (kv[0][1], kv[0][0]))
                       if r in kept]}

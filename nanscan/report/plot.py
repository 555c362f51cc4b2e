"""A log summary as a PNG timeline (matplotlib's Agg canvas, never pyplot: no display, no global
figure state).

Panels, top to bottom, each only when the log holds its numbers (the title names what it does not):
loss; unscaled grad norm (log); loss scale (log) with lr on a right axis -- or lr alone, smaller,
on a run without a GradScaler --; non-finite elements per phase (grouped bars, log axis); and,
when the monitor logged headroom (``watch(..., headroom_bits=N)``), bits of headroom of the few
tensors closest to overflow, with the threshold, the warnings and the overflow marked. An empty
panel would say only "not logged", at the cost of a quarter of the picture. Skipped updates are
shaded on every panel, the focus step is a red line annotated with the module and phase,
non-finite values are markers along a panel's top edge, and the monitor's spike warnings
(``watch(..., spikes=True)``) are gold stars on the loss or grad-norm panel, at the spiking value,
with a dotted line down to the running baseline it was measured against. When the log holds
telemetry lines (``watch(..., telemetry=JSONL(log))``), a last panel is the module heatmap on the
same step axis (:func:`_draw_heatmap`: one row per module output, rms on a log colour scale or
headroom bits on a linear one, blank where nothing was logged; a gold star on the module where a
spike started). matplotlib is optional: without it, :func:`plot_report` raises an ``ImportError``
with the install hint and the text report still works."""
from __future__ import annotations

import math
import os
import textwrap
from typing import Optional

from nanscan.report.analysis import CRITERIA, PHASES, summarize_run

MATPLOTLIB_HINT = "pip install 'nanscan[report]' (matplotlib) for the plot; the text report works without it"
PHASE_COLORS = {"forward": "#1f77b4", "loss": "#d62728", "backward": "#ff7f0e", "update": "#9467bd"}


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


def _note(ax, text: str) -> None:
    """A grey message in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _draw_loss(ax, summary: dict, markers: bool) -> None:
    loss = [v for v in summary["loss"] if v is not None and math.isfinite(v)]
    loss_log = bool(loss) and min(loss) > 0 and max(loss) / min(loss) > 1e3
    _plot_series(ax, summary["steps"], summary["loss"], color="#1f77b4", label="loss", log=loss_log, markers=markers)
    ax.set_ylabel("loss" + (" (log)" if loss_log else ""))


def _draw_grad_norm(ax, summary: dict, markers: bool) -> None:
    _plot_series(ax, summary["steps"], summary["grad_norm"], color="#2ca02c", label="grad norm", log=True,
                 markers=markers)
    ax.set_ylabel("unscaled grad norm (log)")


def _draw_lr(ax, summary: dict, label: str) -> list:
    ax.plot(summary["steps"], [v if v is not None and math.isfinite(v) else math.nan for v in summary["lr"]],
            color="#7f7f7f", lw=1, ls="--", label=label)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylim(bottom=0)
    return ax.get_lines()


def _draw_loss_scale_and_lr(ax_scale, summary: dict, markers: bool) -> list:
    """The loss scale as steps, the lr (if logged) on a twin right axis labelled "twin"; returns
    the lr lines (for the legend)."""
    _plot_series(ax_scale, summary["steps"], summary["loss_scale"], color="#8c564b", label="loss scale", log=True,
                 markers=markers)
    ax_scale.lines[-1].set_drawstyle("steps-post")
    ax_scale.set_ylabel("loss scale (log)")
    if not any(v is not None for v in summary["lr"]):
        return []
    ax_lr = ax_scale.twinx()
    ax_lr.set_label("twin")
    lines = _draw_lr(ax_lr, summary, "lr (right axis)")
    ax_lr.set_ylabel("lr", color="#7f7f7f")
    ax_lr.tick_params(axis="y", colors="#7f7f7f")
    return lines


def _draw_nonfinite_counts(ax_nf, summary: dict, width: float) -> None:
    # the counts are non-finite *elements* per phase (propagated ones included): they span orders of
    # magnitude (3 in an activation, millions in the gradients), so grouped bars on a log axis
    steps = summary["steps"]
    any_nf = False
    for k, p in enumerate(PHASES):
        counts = summary["nonfinite"][p]
        idx = [i for i, c in enumerate(counts) if c > 0]
        if idx:  # sparse: only bars that exist, so a long clean run costs nothing here
            any_nf = True
            ax_nf.bar([steps[i] + (k - 1.5) * width / 4 for i in idx], [counts[i] for i in idx],
                      width=width / 4, color=PHASE_COLORS[p], label=p, log=True, zorder=3)  # above the step lines
    if any_nf:
        ax_nf.set_ylim(bottom=0.5)
    else:
        _note(ax_nf, "no non-finite values counted")
    ax_nf.set_ylabel("non-finite elements\nper phase (log)")


HEADROOM_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#8c564b")


def _draw_headroom(ax, headroom: dict) -> None:
    """Bits of headroom over the steps for the few tensors closest to overflow (the warned ones
    first): the threshold as a dashed line, each warning as a triangle, an overflow (the first
    incident naming the tensor) as a cross at 0 bits."""
    for color, (label, s) in zip(HEADROOM_COLORS, headroom["series"].items()):
        ax.plot(s["steps"], s["bits"], color=color, lw=1.2, marker="o" if len(s["steps"]) <= 300 else None, ms=2,
                label=f"headroom: {_short(label, NAME_CHARS)}")
        if s["warned_at"] is not None:
            bits = dict(zip(s["steps"], s["bits"])).get(s["warned_at"])
            if bits is not None:
                ax.scatter([s["warned_at"]], [bits], marker="v", s=60, color=color, zorder=5, edgecolor="black",
                           label="headroom warning" if color == HEADROOM_COLORS[0] else None)
        if s["overflow"] is not None:
            ax.scatter([s["overflow"]], [0.0], marker="X", s=70, color="#d62728", zorder=5,
                       label="overflow (non-finite)")
    if headroom["threshold"] is not None:
        ax.axhline(headroom["threshold"], color="0.3", ls="--", lw=1,
                   label=f"warning threshold ({headroom['threshold']:g} bits)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("headroom (bits)\nlog2(dtype max / amax)")


SPIKE_COLOR = "#ffd700"  # gold, edged in black: seen on white and on every viridis cell, used by no other mark
SPIKE_PANELS = {"loss": "loss", "grad_norm": "grad_norm"}  # a spike's metric -> the panel it is drawn on
SPIKE_TOP = 0.88  # a star sits at most this high in its panel (fraction of the height): never cut by the top edge
SPIKE_X_ROOM = 0.012  # room kept left and right of a star at the first or last step (fraction of the steps' span)


def _room_above(ax, top: float) -> None:
    """Raise the panel's upper limit so that a mark at ``top`` sits at most SPIKE_TOP of its height."""
    lo, hi = ax.get_ylim()
    log = ax.get_yscale() == "log"
    f = math.log10 if log else float
    span = f(hi) - f(lo)
    if span > 0 and (f(top) - f(lo)) / span > SPIKE_TOP:
        new = f(lo) + (f(top) - f(lo)) / SPIKE_TOP
        ax.set_ylim(lo, 10 ** new if log else new)


def _mark_spikes(panels: dict, spikes: list) -> None:
    """Each spike as a star at its value on its metric's panel, a dotted line from its running
    baseline up to it (how far above the baseline it was). A spike whose panel is not drawn (its
    metric was not logged by the steps) stays in the text."""
    for metric, panel in SPIKE_PANELS.items():
        ax = panels.get(panel)
        mine = [sp for sp in spikes if sp["metric"] == metric]
        if ax is None or not mine:
            continue
        xs = [sp["step"] for sp in mine]
        ax.vlines(xs, [sp["baseline"] for sp in mine], [sp["value"] for sp in mine], colors="0.25", linestyles=":",
                  lw=1.2, zorder=4)
        ax.scatter(xs, [sp["value"] for sp in mine], marker="*", s=150, color=SPIKE_COLOR, edgecolors="black",
                   linewidths=0.8, zorder=6, label="spike (dotted: down to its running baseline)")
        _room_above(ax, max(sp["value"] for sp in mine))


HEATMAP_CMAP = "viridis"
NONFINITE_COLOR = "#d62728"  # red: not in viridis, as the incident line and the NaN markers elsewhere
WARNING_COLOR = "#ff7f0e"
NOT_FINITE_COLOR = "#e377c2"  # pink: a statistic that was not finite (sent as <stat>_nonfinite)
ZERO_COLOR = "black"  # an rms of exactly 0 (all zeros): below a log scale, never blank (blank: not logged)
HEATMAP_LABEL_CHARS = 32  # a longer module name keeps its end (the most specific part)
NAME_CHARS = 48  # the same for the incident's name in the annotation and the legend


def _edges(steps: list) -> list:
    """Cell edges on the step axis: halfway between telemetry steps (a lone step: one step wide)."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [steps[0] - (mids[0] - steps[0])] + mids + [steps[-1] + (steps[-1] - mids[-1])]


def _short(name, limit: int) -> str:
    """A module or tensor name of at most ``limit`` characters: a longer one keeps its end."""
    name = str(name)
    return name if len(name) <= limit else "\u2026" + name[-(limit - 1):]


def _heatmap_norm(hm: dict, values: list):
    """The colour scale: log for rms (a zero sits below it, drawn in ZERO_COLOR), linear for bits."""
    from matplotlib.colors import LogNorm, Normalize

    log = hm["scale"] == "log10"
    shown = [v for row in values for v in row if v is not None and (v > 0 or not log)]
    lo, hi = (min(shown), max(shown)) if shown else (1.0, 10.0)
    if lo == hi:  # (one value: a scale around it)
        lo, hi = (lo / 2, hi * 2) if log else (lo - 1, hi + 1)
    return (LogNorm(lo, hi) if log else Normalize(lo, hi)), lo


def _draw_heatmap(ax, fig, hm: dict, height_in: float) -> None:
    """One row per module output (model order, top to bottom; a white line where rows were left
    out), one cell per telemetry step centred on it: the logged value's colour, blank where nothing
    was logged, pink where the statistic was not finite, black for an rms of 0. Marks: a red x on a
    cell whose module counted non-finite values since the previous point, a hollow red square on the
    incident's module at its step, an orange triangle where the monitor warned about its headroom, a
    gold star on the module where a spike started, at the spike's step.
    The colour bar sits below, so the panel keeps the timeline's width and step axis."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    rows, steps, values = hm["modules"], hm["steps"], hm["values"]
    log = hm["scale"] == "log10"
    norm, lowest = _heatmap_norm(hm, values)
    zeros = log and any(v == 0 for row in values for v in row)
    data = np.ma.masked_invalid(np.array([[math.nan if v is None else (v if v > 0 or not log else lowest / 10)
                                           for v in row] for row in values], dtype=float))
    cmap = colormaps[HEATMAP_CMAP].with_extremes(bad=(0, 0, 0, 0), under=ZERO_COLOR)
    xs, ys = _edges(steps), np.arange(len(rows) + 1) - 0.5
    mesh = ax.pcolormesh(xs, ys, data, cmap=cmap, norm=norm, zorder=1)
    if any(any(row) for row in hm["not_finite"]):
        flags = np.ma.masked_equal(np.array(hm["not_finite"], dtype=float), 0)
        ax.pcolormesh(xs, ys, flags, cmap=ListedColormap([NOT_FINITE_COLOR]), zorder=1.5)
        # (a patch of no size: the legend's swatch for the cells above)
        ax.add_patch(Rectangle((steps[0], 0), 0, 0, color=NOT_FINITE_COLOR,
                               label=f"{hm['stat']} not finite (sent as {hm['stat']}_nonfinite)"))
    ax.set_ylim(len(rows) - 0.5, -0.5)  # (model order, top to bottom)
    ax.set_yticks(range(len(rows)), [_short(r, HEATMAP_LABEL_CHARS) for r in rows],
                  fontsize=8 if len(rows) <= 24 else (7 if len(rows) <= 48 else 6))
    ax.tick_params(axis="y", length=0)
    ax.set_label("heatmap")
    ax.set_ylabel("module output")
    title = f"{hm['what']} per telemetry step" + (" (log colour scale)" if log else " (linear: bits are a log)")
    if hm["hidden"]:
        title += "\n" + textwrap.fill(f"{hm['rule']}; a white line: modules left out", 130)
    ax.set_title(title, fontsize=9, loc="left")
    for i in range(1, len(rows)):  # (rows not next to each other in the model)
        if hm["index"][i] != hm["index"][i - 1] + 1:
            ax.axhline(i - 0.5, color="white", lw=2, zorder=3)
    bar = fig.colorbar(mesh, ax=ax, location="bottom", aspect=60, shrink=0.6, extend="min" if zeros else "neither")
    bar.set_label(("rms (log)" if log else "headroom bits, log2(dtype max / amax)")
                  + (f"; {ZERO_COLOR}: rms 0" if zeros else "") + "; blank: not logged", fontsize=8)
    bar.ax.tick_params(labelsize=7)

    # marker sizes from the size of a cell (points^2), so that they fit it on a big model or a long run
    cell = min(height_in * 72 / max(1, len(rows)), 8.5 * 72 / max(1, len(steps)))
    small, big = min(64.0, max(9.0, (0.8 * cell) ** 2)), min(160.0, max(30.0, (1.2 * cell) ** 2))
    row_of = {name: i for i, name in enumerate(rows)}
    bad = [(steps[j], i) for i, counts in enumerate(hm["nonfinite"]) for j, c in enumerate(counts) if c > 0]
    if bad:
        ax.scatter([x for x, _ in bad], [y for _, y in bad], marker="x", s=small, color=NONFINITE_COLOR,
                   linewidths=1.3, zorder=4, label="non-finite values counted (since the previous point)")
    warned = [(w["step"], row_of[w["module"]]) for w in hm["warnings"]]
    if warned:
        ax.scatter([x for x, _ in warned], [y for _, y in warned], marker="v", s=small, color=WARNING_COLOR,
                   edgecolors="black", linewidths=0.6, zorder=5, label="headroom warning (module output)")
    spiked = [(sp["step"], row_of[sp["module"]]) for sp in hm.get("spikes") or () if sp["module"] in row_of]
    if spiked:
        # (a star as wide as the cell at most: whole inside the first and last rows)
        ax.scatter([x for x, _ in spiked], [y for _, y in spiked], marker="*", s=min(100.0, max(16.0, cell ** 2)),
                   color=SPIKE_COLOR, edgecolors="black", linewidths=0.7, zorder=5.5,
                   label="spike: where it started (module output)")
    inc = hm["incident"]
    if inc is not None and inc["module"] in row_of:
        ax.scatter([inc["step"]], [row_of[inc["module"]]], marker="s", s=big, facecolors="none",
                   edgecolors=NONFINITE_COLOR, linewidths=2.2, zorder=6,
                   label=f"incident: {_short(inc['name'], HEATMAP_LABEL_CHARS)} ({inc['phase']}), step {inc['step']}")


def _shade_skipped(axes, skipped_steps: list, width: float) -> None:
    """Skipped updates: shaded spans on every panel, merged into one collection per panel."""
    spans: list = []
    for st in skipped_steps:
        lo, hi = st - width / 2 - 0.1, st + width / 2 + 0.1
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = hi
        else:
            spans.append([lo, hi])
    if spans:
        for ax in axes:
            ax.broken_barh([(lo, hi - lo) for lo, hi in spans], (0, 1), transform=ax.get_xaxis_transform(),
                           color="#ffbb78", alpha=0.45, lw=0, zorder=0,
                           label="update skipped" if ax is axes[0] else None)


def _mark_focus(axes, summary: dict, span: float) -> None:
    """The incident(s) of the focus step: red line + annotation; the first anomaly if it differs."""
    ax_loss, steps = axes[0], summary["steps"]
    focus, first = summary["focus"], summary["first_anomaly"]
    if first is not None and focus is not None and first["step"] != focus["step"]:
        for ax in axes:
            ax.axvline(first["step"], color="#9467bd", ls=":", lw=1.5,
                       label=(f"first anomaly (step {first['step']}"
                              + (", handled by GradScaler)" if first["handled_by_scaler"] else ")"))
                       if ax is ax_loss else None)
    if focus is None:
        return
    incs = focus.get("incidents") or []
    if incs:
        inc = incs[0]["incident"]
        text = f"step {focus['step']}: {_short(inc.get('name', '?'), NAME_CHARS)} ({inc.get('phase', '?')})"
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


def _legend(fig, panels: dict, lr_lines: list) -> None:
    """One legend below the panels: it never hides data, the annotation or the top-edge markers."""
    legend: dict = {}
    for name, ax in panels.items():
        if name != "heatmap":  # (grid lines would cross its cells)
            ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if name == "loss_scale":  # the lr line lives on the twin axis
            handles, labels = handles + lr_lines, labels + [ln.get_label() for ln in lr_lines]
        for h, lab in zip(handles, labels):
            legend.setdefault(lab if name != "nonfinite" else f"non-finite in {lab}", h)
    if legend:
        fig.legend(list(legend.values()), list(legend.keys()), loc="outside lower center",
                   ncols=_legend_columns(list(legend)), fontsize=8, frameon=False)


LEGEND_CHARS = 170  # characters of the legend's 8-point text across the 11-inch figure, handles included


def _legend_columns(labels: list) -> int:
    """As many columns as fit the figure's width (at most 4): matplotlib fills them top to bottom,
    so a column is as wide as its longest label; long module names get fewer columns, never a
    legend wider than the PNG."""
    for ncols in range(min(4, len(labels)), 1, -1):
        rows = -(-len(labels) // ncols)
        if sum(max(map(len, labels[c:c + rows])) + 6 for c in range(0, len(labels), rows)) <= LEGEND_CHARS:
            return ncols
    return 1


NOT_LOGGED_NAMES = (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"), ("lr", "lr"),
                    ("nonfinite", "non-finite counts"))


def _logged(summary: dict) -> dict:
    logged = summary.get("logged")
    if logged is None:  # (a summary made by hand: what its lists hold)
        logged = {key: sum(v is not None for v in summary[key]) for key, _ in NOT_LOGGED_NAMES[:4]}
        logged["nonfinite"] = sum(any(summary["nonfinite"][p][i] for p in PHASES) for i in range(len(summary["steps"])))
    return logged


def _title(summary: dict) -> str:
    focus, first = summary["focus"], summary["first_anomaly"]
    name = os.path.basename(summary.get("path", "")) or "event log"
    title = f"nanscan: {name} -- {len(summary['steps'])} steps"
    if focus is not None:
        title += f", first {'unhandled ' if first is not focus else ''}anomaly at step {focus['step']} " \
                 f"({CRITERIA.get(focus['criterion'], focus['criterion'])})"
    logged = _logged(summary)
    missing = [label for key, label in NOT_LOGGED_NAMES if not logged.get(key)]
    if missing and summary["steps"]:
        title += f"\nnot logged: {', '.join(missing)}"
    return title


PANEL_HEIGHTS = {"loss": 1.2, "grad_norm": 1.1, "loss_scale": 1.0, "lr": 0.7, "nonfinite": 0.9, "headroom": 1.0,
                 "empty": 0.8}  # (the heatmap's grows with its rows: _heatmap_height)


def _heatmap_height(hm: dict) -> float:
    """The heatmap panel's height in PANEL_HEIGHTS units (2 inches): a row about 0.13 inch, room for
    the colour bar below."""
    return max(1.1, 0.065 * len(hm["modules"]) + 0.45)


def _heatmap(summary: dict) -> Optional[dict]:
    hm = summary.get("heatmap")
    return hm if hm and hm["modules"] and hm["steps"] else None


def _panels(summary: dict) -> list:
    """The panels this summary has numbers for, top to bottom."""
    logged = _logged(summary)
    names = [key for key in ("loss", "grad_norm") if logged.get(key)]
    if logged.get("loss_scale"):
        names.append("loss_scale")  # (with the lr on its right axis)
    elif logged.get("lr"):
        names.append("lr")
    if logged.get("nonfinite"):
        names.append("nonfinite")
    if (summary.get("headroom") or {}).get("series"):
        names.append("headroom")
    if not names:
        names.append("empty")
    if _heatmap(summary) is not None:
        names.append("heatmap")
    return names


def timeline_figure(summary: dict, title: Optional[str] = None):
    """The timeline of a log summary as a matplotlib ``Figure`` (Agg canvas, no pyplot): one panel
    per logged series (see the module docstring), each labelled by its y label; the lr axis on the
    right of the loss-scale panel is labelled "twin", the module heatmap "heatmap" and its colour
    bar "<colorbar>" (``Axes.get_label``)."""
    if not summary.get("timeline"):
        raise ValueError("nanscan report: a bundle holds one step, there is no timeline to plot; "
                         "give the run's JSONL event log")
    Figure, FigureCanvasAgg = _require_matplotlib()
    steps = summary["steps"]
    names = _panels(summary)
    any_counted = any(c > 0 for counts in summary["nonfinite"].values() for c in counts)
    # (a non-finite panel with nothing counted says one thing -- none counted --: it gets half the room)
    heights = [_heatmap_height(summary["heatmap"]) if n == "heatmap"
               else PANEL_HEIGHTS[n] * (0.5 if n == "nonfinite" and not any_counted else 1) for n in names]
    fig = Figure(figsize=(11, 1.6 + 2.0 * sum(heights)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    panels = dict(zip(names, axes))
    span = (steps[-1] - steps[0]) if steps else 0
    width = max(0.8, span / 500)  # bars and shaded spans stay visible on runs of 100k steps
    markers = len(steps) <= 300

    lr_lines: list = []
    for name, ax in panels.items():
        if name == "loss":
            _draw_loss(ax, summary, markers)
        elif name == "grad_norm":
            _draw_grad_norm(ax, summary, markers)
        elif name == "loss_scale":
            lr_lines = _draw_loss_scale_and_lr(ax, summary, markers)
        elif name == "lr":
            _draw_lr(ax, summary, "lr")
            ax.set_ylabel("lr")
        elif name == "nonfinite":
            _draw_nonfinite_counts(ax, summary, width)
        elif name == "headroom":
            _draw_headroom(ax, summary["headroom"])
        elif name == "heatmap":
            _draw_heatmap(ax, fig, summary["heatmap"], 2.0 * heights[names.index("heatmap")] - 0.6)
        else:
            _note(ax, "no loss, grad norm, loss scale, lr or non-finite counts logged: nothing to plot"
                  + ("\n(the heatmap below is of the telemetry lines)" if "heatmap" in panels else ""))
    axes[-1].set_xlabel("step")
    _shade_skipped(list(axes), summary["skipped_steps"], width)
    _mark_focus(list(axes), summary, span)
    _mark_spikes(panels, summary.get("spikes") or [])
    _legend(fig, panels, lr_lines)
    hm = _heatmap(summary)
    if steps or hm is not None:
        lo, hi = [], []
        if steps:
            lo.append(steps[0] - width)
            hi.append(steps[-1] + width)
        marked = [sp["step"] for sp in summary.get("spikes") or [] if SPIKE_PANELS.get(sp["metric"]) in panels]
        if marked:  # (a star at the first or last step of a long run: whole, not cut by the panel's edge)
            lo.append(min(marked) - SPIKE_X_ROOM * max(span, 1))
            hi.append(max(marked) + SPIKE_X_ROOM * max(span, 1))
        if hm is not None:
            edges = _edges(hm["steps"])
            lo.append(edges[0])
            hi.append(edges[-1])
        axes[-1].set_xlim(min(lo), max(hi))
    fig.suptitle(_title(summary) if title is None else title, fontsize=11)
    return fig


def plot_summary(summary: dict, out_png: str, title: Optional[str] = None) -> str:
    """Draw the timeline of a log summary (:func:`timeline_figure`) into ``out_png``."""
    fig = timeline_figure(summary, title)
    out_png = os.fspath(out_png)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def plot_report(path: str, out_png: str, heatmap_stat: str = "rms") -> str:
    """Write a PNG timeline of the log at ``path`` to ``out_png`` and return ``out_png``: loss;
    unscaled grad norm (log); loss scale (log) with lr on a right axis; non-finite elements per
    phase (grouped bars, log axis) -- each where the log holds it --; with telemetry lines, the module
    heatmap of ``heatmap_stat`` (``"rms"``, ``"headroom_bits"``). Skipped updates are shaded, the
    incident step is a red line annotated with the module and phase, non-finite values are markers
    along a panel's top edge. Needs matplotlib (``ImportError`` with the install hint otherwise)."""
    _require_matplotlib()  # before reading anything: the hint is the answer when it is missing
    return plot_summary(summarize_run(path, heatmap_stat=heatmap_stat), out_png)

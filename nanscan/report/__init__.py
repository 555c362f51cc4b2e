"""Reports over a run's event log: the first anomalous step and what preceded it.

Input is either the JSONL event log of a run (one JSON object a line: ``header``, ``step``,
``incident``, ``headroom``, ``spike``, ``telemetry``; other types are ignored) or a failure bundle directory
(``manifest.json``, see :mod:`nanscan.capture.bundle`). A log gives a timeline; a bundle holds one step and gives none.

API (plain functions; ``python -m nanscan report`` builds on them)::

    load_events(path) -> list[dict]        # own tolerant parser: a truncated line is skipped, noted
    parse_events(lines) -> list[dict]      # the same over lines already read
    summarize_log(events, window=5) -> dict
    summarize_run(path, heatmap_stat="rms") -> dict  # log or bundle
    module_heatmap(events, rank, stat) -> dict  # module x step matrix of telemetry lines (summary["heatmap"])
    text_report(path) -> str               # no matplotlib needed
    summary_blocks(summary) -> list        # its lines and tables (Table, Listing) before layout (the HTML page's)
    bundle_text(summary) -> str            # a bundle's page (``nanscan show`` prints it too)
    timeline_figure(summary) -> Figure     # a panel per logged series (+ the heatmap), needs matplotlib
    plot_report(path, out_png, heatmap_stat="rms") -> str  # that figure as a PNG
    html_report(path, out_html, png=None, heatmap_stat="rms") -> str
    to_json(summary) -> str                # strict JSON, non-finite floats as {"finite": false, ...}

One concept per module: :mod:`~nanscan.report.load` (reading logs and manifests, the JSON codec),
:mod:`~nanscan.report.analysis` (summaries: what counts as an anomaly, what preceded it),
:mod:`~nanscan.report.heatmap` (the module x step matrix of the telemetry lines),
:mod:`~nanscan.report.text`, :mod:`~nanscan.report.plot`, :mod:`~nanscan.report.html`.

This package imports neither torch nor ``nanscan.log``: a report can be made anywhere the log is.
"""
from nanscan.report.analysis import CRITERIA, PHASES, summarize_bundle, summarize_log, summarize_run
from nanscan.report.heatmap import HEATMAP_STATS, MAX_ROWS, module_heatmap
from nanscan.report.html import html_page, html_report
from nanscan.report.load import (BUNDLE_FORMAT, is_bundle, load_bundle_manifest, load_events, loads, parse_events,
                                 to_json)
from nanscan.report.plot import MATPLOTLIB_HINT, plot_report, plot_summary, timeline_figure
from nanscan.report.text import (Listing, Table, bundle_text, format_summary, incident_text, summary_blocks,
                                 text_report)

__all__ = [
    "BUNDLE_FORMAT", "CRITERIA", "HEATMAP_STATS", "Listing", "MATPLOTLIB_HINT", "MAX_ROWS", "PHASES", "Table",
    "bundle_text", "format_summary", "html_page", "html_report", "incident_text", "is_bundle", "load_bundle_manifest",
    "load_events", "loads", "module_heatmap", "parse_events", "plot_report", "plot_summary", "summarize_bundle",
    "summarize_log", "summarize_run", "summary_blocks", "text_report", "timeline_figure", "to_json",
]

"""A report as one self-contained HTML page: the text report's words (:func:`summary_blocks`), and
the timeline PNG (with the module heatmap, when the log has telemetry) inlined as base64.

Laid out for any window, never cut off at the right edge: each line of the text wraps (its
continuation hangs under it, its indentation kept) and a long word -- a path, a module name --
breaks where it must; the numbers before the failure are a real table with one row per step, so
its width does not grow with the window of steps; the spikes are a table with one row per spike,
whose last column (the module where it started) wraps; the image scales down to the page. A headless
browser checks this at a laptop's width and a narrow one (``tests/test_report_html.py``)."""
from __future__ import annotations

import base64
import html
import os
from typing import Optional

from nanscan.report.analysis import summarize_run
from nanscan.report.text import Listing, Table, summary_blocks

STYLE = """
body{font-family:sans-serif;margin:1.5em auto;padding:0 1.5em;max-width:1300px;overflow-wrap:anywhere}
h1{font-size:1.35em}
.report{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;line-height:1.45;
        background:#f6f6f6;padding:1em}
.line{white-space:pre-wrap;padding-left:calc(var(--indent,0ch) + 2ch);text-indent:-2ch}
table{border-collapse:collapse;margin:.2em 0 .4em calc(var(--indent,0ch) + 2ch)}
th,td{padding:0 .7em;text-align:right;white-space:nowrap;vertical-align:baseline}
th{font-weight:600;border-bottom:1px solid #bbb}
th:first-child,td:first-child{text-align:left;padding-left:0}
th.left,td.left{text-align:left}
td.wrap{white-space:normal;overflow-wrap:anywhere}
img{display:block;max-width:100%;height:auto;margin-top:1em}
@media (max-width:640px){body{margin:.5em;padding:0}.report{padding:.5em;font-size:12px}th,td{padding:0 .35em}}
"""


def _line(text: str) -> str:
    indent = len(text) - len(text.lstrip(" "))
    return f'<div class="line" style="--indent:{indent}ch">{html.escape(text[indent:]) or "&nbsp;"}</div>'


def _table(table: Table, indent: int = 4) -> str:
    """One row per step: the window of steps grows down, never across."""
    head = "".join(f"<th>{html.escape(label)}</th>" for label in ["step", *(label for label, _ in table.rows)])
    body = "".join("<tr>" + f"<td>{html.escape(str(step))}</td>"
                   + "".join(f"<td>{html.escape(cells[i])}</td>" for _, cells in table.rows) + "</tr>"
                   for i, step in enumerate(table.steps))
    return f'<table style="--indent:{indent}ch"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _listing(listing: Listing, indent: int = 4) -> str:
    """One row per item; the last column (a module name, a sentence) wraps, the others never do."""
    last = len(listing.columns) - 1

    def cls(i: int, align: str, cell: bool) -> str:
        names = (["left"] if align == "<" else []) + (["wrap"] if cell and i == last else [])
        return f' class="{" ".join(names)}"' if names else ""
    head = "".join(f"<th{cls(i, align, False)}>{html.escape(label)}</th>"
                   for i, (label, align) in enumerate(listing.columns))
    body = "".join("<tr>" + "".join(f"<td{cls(i, align, True)}>{html.escape(cell)}</td>"
                                    for i, (cell, (_, align)) in enumerate(zip(cells, listing.columns))) + "</tr>"
                   for cells in listing.rows)
    return f'<table style="--indent:{indent}ch"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _block(block) -> str:
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Listing):
        return _listing(block)
    return _line(block)


def html_page(summary: dict, png: Optional[bytes] = None) -> str:
    """The page of a summary (a log's or a bundle's), with ``png`` (the PNG's bytes) inlined."""
    blocks = "\n".join(_block(b) for b in summary_blocks(summary))
    image = ""
    if png is not None:
        hm = summary.get("heatmap")
        alt = "nanscan timeline" + (" and module heatmap" if hm and hm["modules"] and hm["steps"] else "")
        image = (f'<img alt="{alt}" src="data:image/png;base64,'
                 f'{base64.b64encode(png).decode("ascii")}">\n')
    title = html.escape(f"nanscan report: {os.path.basename(summary.get('path', '')) or '(events)'}")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{title}</title>\n"
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n<div class=\"report\">\n{blocks}\n</div>\n"
            f"{image}</body>\n</html>\n")


def html_report(path: str, out_html: str, png: Optional[str] = None, heatmap_stat: str = "rms") -> str:
    """Write the page of the log or bundle at ``path`` (:func:`html_page`) to ``out_html``, the PNG
    at ``png`` embedded (its module heatmap, if any, of ``heatmap_stat``, which the text names);
    returns ``out_html``."""
    summary = summarize_run(path, heatmap_stat=heatmap_stat)
    data = None
    if png is not None:
        with open(png, "rb") as f:
            data = f.read()
    out_html = os.fspath(out_html)
    os.makedirs(os.path.dirname(os.path.abspath(out_html)), exist_ok=True)
    with open(out_html, "w", encoding="utf-8") as f:
        f.write(html_page(summary, data))
    return out_html

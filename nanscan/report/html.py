"""A report as one self-contained HTML page (the text, and the timeline PNG inlined as base64)."""
from __future__ import annotations

import base64
import html
import os
from typing import Optional

from nanscan.report.analysis import summarize_run
from nanscan.report.text import format_summary


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

"""The HTML report laid out by a real browser: headless Chromium opens a copy of the page with a
small script that measures every element, at a laptop's width and at a narrow one, and writes what
it found into the page; the test reads it back from the DOM Chromium dumps. Nothing may be cut off
or hidden behind a sideways scroll bar: not the incident's sentence, not a path, not the PNG.

Skipped only when no Chromium binary is found (Debian: ``apt-get install -y chromium``;
``NANSCAN_CHROMIUM`` names another binary)."""
import html
import json
import os
import re
import shutil
import subprocess

import pytest

from nanscan import report
from tests.test_report import incident, write_log


def find_chromium():
    named = os.environ.get("NANSCAN_CHROMIUM")
    if named:
        return shutil.which(named)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary found (Debian: apt-get install -y "
                                                         "chromium; or set NANSCAN_CHROMIUM): the HTML layout "
                                                         "is checked in a real headless browser")

WIDTHS = (1366, 500)  # a laptop, and a narrow window (headless Chromium's smallest is about 500 px)

# Every element whose content is wider than its box (cut off, or behind a scroll bar) or that reaches
# past the viewport's edge, and whether the page itself scrolls sideways. Inline elements have no
# box of their own (their scrollWidth and clientWidth are 0): their block's is measured.
MEASURE = """<script>
(function () {
  var width = document.documentElement.clientWidth, problems = [];
  function describe(el) {
    return el.tagName.toLowerCase() + (el.className ? "." + el.className : "") + ": " +
           (el.textContent || el.getAttribute("alt") || "").replace(/\\s+/g, " ").slice(0, 90);
  }
  var all = document.body.querySelectorAll("*");
  for (var i = 0; i < all.length; i++) {
    var el = all[i];
    if (el.tagName === "SCRIPT") continue;
    var box = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1)
      problems.push({what: "content wider than its box", scroll: el.scrollWidth, client: el.clientWidth,
                     element: describe(el)});
    if (box.width > 0 && (box.right > width + 1 || box.left < -1))
      problems.push({what: "past the viewport's edge", left: box.left, right: box.right, element: describe(el)});
  }
  if (document.documentElement.scrollWidth > width + 1)
    problems.push({what: "the page scrolls sideways", scroll: document.documentElement.scrollWidth});
  var out = document.createElement("pre");
  out.id = "layout-check";
  out.textContent = JSON.stringify({width: width, images: document.images.length,
                                    loaded: Array.prototype.every.call(document.images, function (im) {
                                      return im.complete && im.naturalWidth > 0; }),
                                    problems: problems});
  document.body.appendChild(out);
})();
</script>
"""


# The page's image drawn into a canvas at the size it has on the page, once it has loaded; the
# colours at the given fractions of it.
SAMPLE = """<script>
window.addEventListener("load", function () {
  var im = document.images[0], box = im.getBoundingClientRect(), points = POINTS, pixels = [];
  var canvas = document.createElement("canvas");
  canvas.width = Math.round(box.width);
  canvas.height = Math.round(box.height);
  var g = canvas.getContext("2d");
  g.drawImage(im, 0, 0, canvas.width, canvas.height);
  for (var i = 0; i < points.length; i++) {
    var x = Math.floor(points[i][0] * canvas.width), y = Math.floor(points[i][1] * canvas.height);
    var d = g.getImageData(x, y, 1, 1).data;
    pixels.push([d[0], d[1], d[2], d[3]]);
  }
  var out = document.createElement("pre");
  out.id = "pixels";
  out.textContent = JSON.stringify({pixels: pixels, image: {left: box.left, right: box.right, width: box.width,
                                                            height: box.height, alt: im.alt,
                                                            page_height: document.documentElement.scrollHeight}});
  document.body.appendChild(out);
});
</script>
"""


# Every table as laid out: its header cells, its body rows' cells, its box and the widest of its rows.
TABLES = """<script>
(function () {
  var tables = [];
  var all = document.querySelectorAll(".report table");
  for (var i = 0; i < all.length; i++) {
    var t = all[i], box = t.getBoundingClientRect(), rows = [], heads = [], widest = 0;
    t.querySelectorAll("th").forEach(function (th) { heads.push(th.textContent); });
    t.querySelectorAll("tbody tr").forEach(function (tr) {
      var cells = [];
      tr.querySelectorAll("td").forEach(function (td) {
        cells.push({text: td.textContent, height: td.getBoundingClientRect().height}); });
      rows.push(cells);
      widest = Math.max(widest, tr.getBoundingClientRect().right);
    });
    tables.push({heads: heads, rows: rows, left: box.left, right: box.right, width: box.width, widest: widest});
  }
  var out = document.createElement("pre");
  out.id = "tables";
  out.textContent = JSON.stringify(tables);
  document.body.appendChild(out);
})();
</script>
"""


def layout(page_path, width, tmp_path, points=None, tables=False):
    """Open a copy of the page with MEASURE in Chromium at ``width`` px; the measurement. With
    ``points`` ([x, y] as fractions of the image), also the colours of the page's image there, as
    Chromium decoded and scaled it to its size on the page (``"pixels"``: [[r, g, b, a]]), and where
    the image lies (``"image"``). With ``tables``, the report's tables as laid out (``"tables"``)."""
    page = open(page_path, encoding="utf-8").read()
    assert page.count("</body>") == 1
    probe = tmp_path / f"probe-{width}.html"
    script = (MEASURE + (SAMPLE.replace("POINTS", json.dumps(points)) if points is not None else "")
              + (TABLES if tables else ""))
    probe.write_text(page.replace("</body>", script + "</body>"), encoding="utf-8")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / f'profile-{width}'}", f"--window-size={width},900",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', out.stdout, re.S)
    assert found, f"chromium gave no measurement (exit {out.returncode}): {out.stderr[-2000:]}"
    measured = json.loads(html.unescape(found.group(1)))
    if points is not None:
        sampled = re.search(r'<pre id="pixels">(.*?)</pre>', out.stdout, re.S)
        assert sampled, f"chromium sampled no pixels (exit {out.returncode}): {out.stderr[-2000:]}"
        measured.update(json.loads(html.unescape(sampled.group(1))))
    if tables:
        laid_out = re.search(r'<pre id="tables">(.*?)</pre>', out.stdout, re.S)
        assert laid_out, f"chromium measured no tables (exit {out.returncode}): {out.stderr[-2000:]}"
        measured["tables"] = json.loads(html.unescape(laid_out.group(1)))
    return measured


def bundle_dir(tmp_path):
    bundle = tmp_path / ("step000020-rank0-" + "a-long-run-name-without-spaces" * 3)
    bundle.mkdir()
    manifest = {"format": "nanscan-bundle", "version": 1, "step": 20, "state": "before-update", "training": True,
                "autocast": {"cuda": {"enabled": True, "dtype": "float16"}},
                "model_precision": {"param_dtypes": {"float32": 1000}, "converted": []},
                "inputs": [{"path": "args[0]", "dtype": "float32", "shape": [8, 64]}],
                "incident": incident(20, "forward", "block.act", "activation", False, 3)["incident"],
                "environment": {"torch": "2.14.1", "device": "NVIDIA H200", "cudnn_flags": "x" * 300},
                "files": {"batch.pt": "0" * 64, "model.pt": "0" * 64}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return str(bundle)


@pytest.mark.parametrize("source", ["log", "bundle"])
def test_nothing_on_the_html_page_is_cut_off(tmp_path, source):
    """The incident's sentence (300 characters), long paths, the table of what preceded the
    failure and the timeline PNG all fit the window: wrapped, never cut off at the right edge."""
    if source == "log":
        pytest.importorskip("matplotlib")
        path = write_log(tmp_path / "events.jsonl")
        png = report.plot_report(path, tmp_path / "t.png")
    else:
        path, png = bundle_dir(tmp_path), None
    page = report.html_report(path, tmp_path / "report.html", png=png)
    text = open(page, encoding="utf-8").read()
    assert "block.act" in text and ("data:image/png;base64," in text) == (png is not None)
    for width in WIDTHS:
        found = layout(page, width, tmp_path)
        assert abs(found["width"] - width) <= 20, found["width"]  # (the window was the size asked for)
        assert found["images"] == (png is not None) and found["loaded"]
        assert found["problems"] == [], f"at {found['width']} px: {json.dumps(found['problems'], indent=1)}"


def test_the_check_finds_a_line_that_is_cut_off(tmp_path):
    """The measurement itself: a page with an unwrapped long line in a scrolling <pre> (how the
    report used to be laid out) is caught."""
    page = tmp_path / "cut.html"
    page.write_text("<!DOCTYPE html><html><body><pre style=\"overflow-x:auto\">" + "incident " * 60
                    + "</pre></body></html>")
    found = layout(page, WIDTHS[0], tmp_path)
    assert [p["what"] for p in found["problems"]] == ["content wider than its box"]
    assert found["problems"][0]["element"].startswith("pre: incident incident")


def test_the_module_heatmap_is_seen_on_the_page(tmp_path):
    """A real watched run's telemetry (tests/test_report_heatmap.py): the page's PNG holds the
    module heatmap, and at both widths the page shows it whole -- nothing cut off or scrolled
    sideways -- with its cells in the colours of the logged values: a cell of the first module, one
    of the last, a blank where the module did not run, the pink of an rms that was not finite."""
    pytest.importorskip("matplotlib")
    from tests.test_report_heatmap import MODULES, SKIP_STEP, heatmap_axes, watched_log

    path, points = watched_log(tmp_path / "events.jsonl")
    summary = report.summarize_run(path)
    fig = report.timeline_figure(summary)
    png = tmp_path / "t.png"
    fig.savefig(png, format="png")  # (as plot_summary does; the figure's layout is now the PNG's)
    ax = heatmap_axes(fig)
    mesh = ax.collections[0]
    width, height = fig.bbox.width, fig.bbox.height
    cells = {"first module": ("fc", 2), "last module": ("head", 8), "did not run": ("side", SKIP_STEP),
             "rms not finite": ("loud", 2)}
    fractions, expected = [], {}
    for what, (module, step) in cells.items():
        x, y = ax.transData.transform((step, MODULES.index(module)))
        fractions.append([x / width, 1 - y / height])
        value = points[step].get(f"nanscan/rms/{module}")
        expected[what] = ([round(255 * c) for c in mesh.cmap(mesh.norm(value))[:3]] if value is not None
                          else {"did not run": [255, 255, 255], "rms not finite": [0xe3, 0x77, 0xc2]}[what])
    assert expected["first module"] != expected["last module"]  # (the check tells cells apart)

    page = report.html_report(path, tmp_path / "report.html", png=str(png))
    assert "heatmap: rms of module outputs (log colour scale), 8 modules" in open(page, encoding="utf-8").read()
    for window in WIDTHS:
        found = layout(page, window, tmp_path, points=fractions)
        assert found["images"] == 1 and found["loaded"]
        assert found["problems"] == [], f"at {found['width']} px: {json.dumps(found['problems'], indent=1)}"
        image = found["image"]
        assert image["alt"] == "nanscan timeline and module heatmap"
        assert 0 <= image["left"] and image["right"] <= found["width"] and image["width"] > 0.8 * min(window, 1300)
        assert image["height"] == pytest.approx(image["width"] * height / width, abs=2)  # scaled, not cropped
        for (what, want), got in zip(expected.items(), found["pixels"]):
            assert got[3] == 255 and max(abs(a - b) for a, b in zip(got[:3], want)) <= 24, (window, what, got, want)


def test_the_spikes_table_renders_on_the_page(tmp_path):
    """A log with spikes (tests/test_report_spikes.py), one of them named at a module with a long
    name: the page has the spikes as a table, one row per spike with the text report's cells, and at
    both widths nothing is cut off -- at the narrow one the module's cell wraps inside the page."""
    pytest.importorskip("matplotlib")
    from tests.test_report_spikes import spike_line, two_rank_log

    path = two_rank_log(tmp_path / "events.jsonl")
    module = "model.transformer.encoder.layers.11.attention.output.dense.projection"
    with open(path, "a") as f:
        f.write(json.dumps(spike_line(27, "loss", 3.5, 1.75, name=module, module_ratio=0.125)) + "\n")
    summary = report.summarize_run(path)
    listing = next(b for b in report.summary_blocks(summary) if isinstance(b, report.Listing))
    png = report.plot_report(path, tmp_path / "t.png")
    page = report.html_report(path, tmp_path / "report.html", png=png)
    for width in WIDTHS:
        found = layout(page, width, tmp_path, tables=True)
        assert found["problems"] == [], f"at {found['width']} px: {json.dumps(found['problems'], indent=1)}"
        (spikes,) = [t for t in found["tables"] if t["heads"] == [label for label, _ in listing.columns]]
        assert [[c["text"] for c in row] for row in spikes["rows"]] == listing.rows
        assert [row[0]["text"] for row in spikes["rows"]] == ["12", "25", "27"]
        assert spikes["rows"][2][-1]["text"] == f"{module} (output rms 0.125x its baseline)"
        assert 0 <= spikes["left"] and spikes["right"] <= found["width"] and spikes["widest"] <= found["width"]
        line = min(c["height"] for row in spikes["rows"] for c in row)  # (one line of text)
        wrapped = spikes["rows"][2][-1]["height"] > 1.5 * line
        assert wrapped == (width < 1000), (width, spikes["rows"][2][-1], line)

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


def layout(page_path, width, tmp_path):
    """Open a copy of the page with MEASURE in Chromium at ``width`` px; the measurement."""
    page = open(page_path, encoding="utf-8").read()
    assert page.count("</body>") == 1
    probe = tmp_path / f"probe-{width}.html"
    probe.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / f'profile-{width}'}", f"--window-size={width},900",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', out.stdout, re.S)
    assert found, f"chromium gave no measurement (exit {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


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

"""The report's module heatmap, from a real watched run whose telemetry went into its own event log
(``watch(..., log=event_log, telemetry=JSONL(event_log))``): one NaN made in a known module at a
known step, one module skipped at one step, one module whose rms overflows, one headroom warning.
The matrix is checked against the telemetry lines as the log holds them (read back with
``nanscan.log.read_events``, not the report's reader), and the figure against the matrix."""
import json
import math

import pytest
import torch
from torch import nn

import nanscan
from nanscan import cli, report
from nanscan.log import read_events
from nanscan.monitor.headroom import HeadroomWarning
from nanscan.telemetry import JSONL
from tests.test_report import plain_log, write_log
from tests.test_telemetry_monitor import Mask, Spike

STEPS, EVERY = 12, 2
NAN_STEP = 5  # spike's output gets one NaN (mask hides it from the loss): not a telemetry step
SKIP_STEP = 4  # side does not run
MODULES = ["fc", "act", "spike", "mask", "side", "(model)", "loud", "head"]  # (model): the root's own add
TELEMETRY_STEPS = list(range(0, STEPS, EVERY))


class Loud(nn.Module):
    """An output near 1e30: 27 bits of float32 headroom left (warned below 40), and a sum of squares
    that overflows float32, so its rms is sent as ``rms_nonfinite``."""

    def forward(self, x):
        return x * 1e30


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.spike, self.mask = nn.Linear(4, 8), nn.ReLU(), Spike(), Mask()
        self.side, self.loud, self.head = nn.Linear(8, 8), Loud(), nn.Linear(8, 1)
        self.use_side = True

    def forward(self, x):
        h = self.mask(self.spike(self.act(self.fc(x))))
        if self.use_side:
            h = h + self.side(h)
        self.loud(h)  # (watched, unused: the loss stays finite)
        return self.head(h)


def watched_log(path):
    """A real watched run into ``path``; returns (the path, {step: scalars} of its telemetry lines)."""
    torch.manual_seed(0)
    model = Net()
    model.spike.at = {NAN_STEP}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    event_log = nanscan.EventLog(path)
    with pytest.warns(HeadroomWarning), \
            nanscan.watch(model, opt, on_nonfinite="record", log=event_log, telemetry=JSONL(event_log),
                          telemetry_every=EVERY, headroom_bits=40) as mon:
        for step in range(STEPS):
            model.use_side = step != SKIP_STEP
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    event_log.close()
    assert [(i.step, i.name) for i in mon.incidents] == [(NAN_STEP, "spike")]
    points = {e["step"]: e["scalars"] for e in read_events(path) if e["type"] == "telemetry"}
    return str(path), points


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return watched_log(tmp_path_factory.mktemp("run") / "events.jsonl")


def test_the_matrix_is_the_logged_scalars(run):
    path, points = run
    hm = report.summarize_run(path)["heatmap"]
    assert hm["stat"] == "rms" and hm["scale"] == "log10" and hm["steps"] == TELEMETRY_STEPS == sorted(points)
    assert hm["modules"] == MODULES and hm["total_modules"] == len(MODULES) and hm["hidden"] == 0
    for i, module in enumerate(MODULES):
        for j, step in enumerate(TELEMETRY_STEPS):
            logged = points[step].get(f"nanscan/rms/{module}")
            assert hm["values"][i][j] == logged, (module, step)  # exactly the number in the log
    side, root = MODULES.index("side"), MODULES.index("(model)")
    skipped = TELEMETRY_STEPS.index(SKIP_STEP)
    assert hm["values"][side][skipped] is None and hm["values"][root][skipped] is None  # blank, not 0
    assert sum(v is None for row in hm["values"] for v in row) == 2 + len(TELEMETRY_STEPS)  # those, and loud
    loud = MODULES.index("loud")
    assert hm["values"][loud] == [None] * len(TELEMETRY_STEPS) and all(hm["not_finite"][loud])
    assert all(points[st]["nanscan/rms/loud_nonfinite"] == 1 for st in TELEMETRY_STEPS)
    assert not any(hm["not_finite"][i][j] for i in range(len(MODULES)) if i != loud for j in range(len(points)))
    # the NaN of step 5 is counted at the next telemetry point, on spike's row only
    counted = [(MODULES[i], TELEMETRY_STEPS[j])
               for i, row in enumerate(hm["nonfinite"]) for j, c in enumerate(row) if c]
    assert counted == [("spike", 6)] and points[6]["nanscan/nonfinite/spike"] == 1
    assert hm["incident"] == {"step": NAN_STEP, "name": "spike", "kind": "activation", "phase": "forward",
                              "module": "spike"}
    warned = [e for e in read_events(path) if e["type"] == "headroom"]
    assert [(e["record_kind"], e["name"]) for e in warned] == [("activation", "loud")]
    assert hm["warnings"] == [{"step": warned[0]["step"], "module": "loud", "bits": warned[0]["bits"]}]
    json.loads(report.to_json(hm))  # (strict JSON, like the rest of a summary)


def test_headroom_bits_are_the_other_stat(run):
    path, points = run
    hm = report.summarize_run(path, heatmap_stat="headroom_bits")["heatmap"]
    assert hm["stat"] == "headroom_bits" and hm["scale"] == "linear" and hm["modules"] == MODULES
    loud = MODULES.index("loud")
    assert hm["values"][loud] == [points[st]["nanscan/headroom_bits/loud"] for st in TELEMETRY_STEPS]
    assert all(20 < v < 40 for v in hm["values"][loud]) and not any(hm["not_finite"][loud])
    with pytest.raises(ValueError, match="heatmap stat 'amax' is not one of rms, headroom_bits"):
        report.summarize_run(path, heatmap_stat="amax")


def heatmap_axes(fig):
    found = [ax for ax in fig.axes if ax.get_label() == "heatmap"]
    return found[0] if found else None


def test_the_figure_has_the_heatmap_panel(run, tmp_path):
    pytest.importorskip("matplotlib")
    import numpy as np

    path, points = run
    summary = report.summarize_run(path)
    fig = report.timeline_figure(summary)
    ax = heatmap_axes(fig)
    assert ax is fig.axes[len(fig.axes) - 2]  # the last panel (its colour bar is made after it)
    assert fig.axes[-1].get_label() == "<colorbar>" and "rms (log)" in fig.axes[-1].get_xlabel()
    assert ax.get_title(loc="left").startswith("rms of module outputs per telemetry step (log colour scale)")
    assert [t.get_text() for t in ax.get_yticklabels()] == MODULES
    hm = summary["heatmap"]
    mesh = ax.collections[0]
    drawn = mesh.get_array()
    assert drawn.shape == (len(MODULES), len(TELEMETRY_STEPS))
    expected = np.array([[math.nan if v is None else v for v in row] for row in hm["values"]])
    assert (np.ma.getmaskarray(drawn) == np.isnan(expected)).all()  # blank exactly where nothing was logged
    assert np.allclose(drawn.filled(0), np.nan_to_num(expected), rtol=0)
    marks = {c.get_label(): c.get_offsets().tolist() for c in ax.collections if c.get_label()[:1] != "_"}
    spike, loud = MODULES.index("spike"), MODULES.index("loud")
    assert marks["non-finite values counted (since the previous point)"] == [[6, spike]]
    assert marks["incident: spike (forward), step 5"] == [[NAN_STEP, spike]]
    assert marks["headroom warning (module output)"] == [[hm["warnings"][0]["step"], loud]]
    assert any(p.get_label() == "rms not finite (sent as rms_nonfinite)" for p in ax.patches)
    assert ax.get_xlim()[0] < TELEMETRY_STEPS[0] and ax.get_xlim()[1] >= TELEMETRY_STEPS[-1] + 1
    out = report.plot_report(path, tmp_path / "r.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_log_without_telemetry_has_no_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    for path in (write_log(tmp_path / "amp.jsonl"), plain_log(tmp_path / "plain.jsonl")):
        summary = report.summarize_run(path)
        assert summary["heatmap"] is None
        assert heatmap_axes(report.timeline_figure(summary)) is None
        assert "heatmap" not in report.format_summary(summary)


def test_the_text_names_the_heatmaps_source(run):
    path, _ = run
    text = report.text_report(path)
    assert ("heatmap: rms of module outputs (log colour scale), 8 modules x 6 telemetry steps (0-10 every 2)\n"
            in text)
    only_fc = [e for e in report.load_events(path) if e.get("type") != "telemetry"]
    only_fc.append({"type": "telemetry", "step": 0, "rank": 0, "scalars": {"nanscan/loss": 1.0}})
    s = report.summarize_log(only_fc)
    assert s["heatmap"]["modules"] == []
    assert "heatmap: none; the 1 telemetry line(s) hold no nanscan/rms/<module> scalars" in report.format_summary(s)


def test_the_cli_takes_the_heatmap_stat(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = run
    assert cli.main(["report", path, "--heatmap-stat", "headroom_bits", "-o", str(tmp_path / "h.png")]) == 1
    out = capsys.readouterr().out
    assert "heatmap: headroom bits of module outputs (linear colour scale), 8 modules x 6 telemetry steps" in out
    with pytest.raises(SystemExit) as exited:  # (argparse: a bad option is one line, exit 2)
        cli.main(["report", path, "--heatmap-stat", "amax"])
    assert exited.value.code == 2 and "invalid choice: 'amax'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a big model: the row cap
def synthetic(n_modules, n_steps=8, incident_module=None, nonfinite=(), warned=(), zero=None, prefix="m"):
    """Telemetry lines for ``m0 .. m<n-1>``: m<i>'s rms grows by 1.1**i over the run (so the later
    modules change most), ``nonfinite`` modules count a NaN at step 3, an incident at step 3."""
    events = [{"type": "header", "rank": 0}]
    for st in range(n_steps):
        scalars = {}
        for i in range(n_modules):
            scalars[f"nanscan/rms/{prefix}{i}"] = 0.0 if (i, st) == zero else 0.5 * 1.1 ** (i * st / n_steps)
            if st == 3 and i in nonfinite:
                scalars[f"nanscan/nonfinite/{prefix}{i}"] = 1
        events.append({"type": "step", "step": st, "rank": 0, "loss": 1.0})
        events.append({"type": "telemetry", "step": st, "rank": 0, "scalars": scalars})
    for i in warned:
        events.append({"type": "headroom", "step": 2, "rank": 0, "name": f"{prefix}{i}", "record_kind": "activation",
                       "bits": 3.0})
    if incident_module is not None:
        events.append({"type": "incident", "step": 3, "rank": 0,
                       "incident": {"step": 3, "phase": "forward", "name": f"{prefix}{incident_module}.weight",
                                    "kind": "param", "rank": 0}})
    return events


def test_a_big_model_keeps_64_rows_and_never_hides_the_incident():
    """300 modules: the incident's (a parameter's: its module's row) and its neighbours, the ones
    that counted a NaN, the warned ones, then the most changed (here: the last ones) -- 64 rows, in
    model order, the rule said."""
    hm = report.summarize_log(synthetic(300, incident_module=7, nonfinite=(40, 41), warned=(100,)))["heatmap"]
    assert hm["total_modules"] == 300 and len(hm["modules"]) == report.MAX_ROWS == 64 and hm["hidden"] == 236
    assert hm["incident"]["module"] == "m7" and hm["incident"]["name"] == "m7.weight"
    expected = [5, 6, 7, 8, 9, 40, 41, 100] + list(range(300 - 56, 300))
    assert hm["index"] == expected and hm["modules"] == [f"m{i}" for i in expected]
    assert hm["rule"].startswith("64 of 300 modules: the incident's and its neighbours")
    assert hm["warnings"] == [{"step": 2, "module": "m100", "bits": 3.0}]
    # many non-finite modules before it in model order: the incident's module still comes first
    hm = report.summarize_log(synthetic(300, incident_module=250, nonfinite=range(100)))["heatmap"]
    assert "m250" in hm["modules"] and hm["modules"][:59] == [f"m{i}" for i in range(59)]
    assert hm["modules"][59:] == [f"m{i}" for i in (248, 249, 250, 251, 252)]
    # 64 or fewer: all of them
    assert report.summarize_log(synthetic(64))["heatmap"]["modules"] == [f"m{i}" for i in range(64)]


def test_a_big_models_figure_has_every_text_inside_it(tmp_path):
    """64 rows of long module names, a two-line panel title: every text of the figure (tick labels
    shortened to their end, titles, the legend, the colour bar) lies inside the PNG."""
    pytest.importorskip("matplotlib")
    prefix = "model.transformer.encoder.layers.attention.output.dense.projection."
    summary = report.summarize_log(synthetic(300, incident_module=7, nonfinite=(40,), warned=(100,), prefix=prefix))
    fig = report.timeline_figure(summary)
    ax = heatmap_axes(fig)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 64 and labels[0] == "\u2026" + f"{prefix}5"[-31:]
    assert "\n" in ax.get_title(loc="left") and "236 not shown" not in ax.get_title(loc="left")
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    # every artist drawn (ticks outside the view are not), in inches: inside the figure, to the pixel
    ink, page = fig.get_tightbbox(renderer), fig.bbox_inches
    px = 1 / fig.dpi
    assert page.x0 - px <= ink.x0 and ink.x1 <= page.x1 + px and page.y0 - px <= ink.y0 and ink.y1 <= page.y1 + px, \
        (ink, page)
    assert ink.width > 0.95 * page.width  # (the check sees the figure's contents: the legend spans it)


def test_a_zero_rms_is_drawn_below_the_scale_not_blank():
    pytest.importorskip("matplotlib")
    summary = report.summarize_log(synthetic(5, zero=(2, 4)))
    hm = summary["heatmap"]
    assert hm["values"][2][4] == 0.0  # a value, not missing
    ax = heatmap_axes(report.timeline_figure(summary))
    mesh = ax.collections[0]
    drawn = mesh.get_array()
    assert not drawn.mask[2, 4] and drawn[2, 4] < mesh.norm.vmin  # the colour map's "under": black
    assert tuple(mesh.cmap.get_under()) == (0.0, 0.0, 0.0, 1.0)

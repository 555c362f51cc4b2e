"""The report's spikes, from a real watched run with ``spikes=True`` (tests/test_spikes.py's planted
fault: a weight of ``blocks.0.fc`` scaled x30 at step 40 of the tiny GPT) whose telemetry went into
its own event log: the summary lists the log's ``"spike"`` lines, the text a row per spike, the
timeline a star at each spike's value on its metric's panel, the module heatmap a star on the module
where it started. A log without spike lines gives the report it gave before."""
import json
import re

import pytest
import torch
from torch import nn

import nanscan
from nanscan import cli, report
from nanscan.log import read_events
from nanscan.telemetry import JSONL
from tests.test_report import plain_log
from tests.test_report_heatmap import heatmap_axes, synthetic
from tests.test_spikes import _gpt, _tokens

STEPS, EVERY, PLANTED = 60, 5, 40
SPIKE_LABEL = "spike (dotted: down to its running baseline)"
HEATMAP_LABEL = "spike: where it started (module output)"


def spike_run(path):
    """The planted x30 weight, watched with spikes on, telemetry into the event log; returns (the
    path, the monitor's spikes as dicts)."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    event_log = nanscan.EventLog(path)
    with pytest.warns(nanscan.SpikeWarning), \
            nanscan.watch(model, opt, spikes=True, log=event_log, telemetry=JSONL(event_log),
                          telemetry_every=EVERY) as mon:
        for step in range(STEPS):
            if step == PLANTED:
                with torch.no_grad():
                    model.blocks[0].fc.weight.mul_(30.0)
            idx = _tokens(step)
            logits = model(idx[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    event_log.close()
    return str(path), [e.to_dict() for e in mon.spikes]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return spike_run(tmp_path_factory.mktemp("spikes") / "events.jsonl")


def logged_spikes(path):
    """The log's spike lines as ``nanscan.log`` reads them (not the report's reader)."""
    return [e for e in read_events(path) if e["type"] == "spike"]


def test_the_summary_holds_the_logs_spikes(run):
    path, spikes = run
    lines = logged_spikes(path)
    assert [(e["step"], e["metric"], e["name"]) for e in lines] == [(s["step"], s["metric"], s["name"]) for s in spikes]
    assert any(e["step"] == PLANTED and e["metric"] == "loss" and e["name"] == "blocks.0.fc" for e in lines)
    summary = report.summarize_run(path)
    assert summary["spikes"] == [{"step": e["step"], "metric": e["metric"], "value": e["value"],
                                  "baseline": e["baseline"], "ratio": e["value"] / e["baseline"], "name": e["name"],
                                  "module_metric": e["module_metric"], "module_ratio": e["module_ratio"]}
                                 for e in sorted(lines, key=lambda e: e["step"])]
    assert all(s["step"] >= PLANTED and s["ratio"] > 2 for s in summary["spikes"])
    # a spike is a warning, not an anomaly: the verdict is what it was
    assert summary["verdict"]["status"] == "clear" and summary["anomalous_steps"] == []
    json.loads(report.to_json(summary))


def test_the_text_lists_each_spike(run):
    path, _ = run
    summary = report.summarize_run(path)
    text = report.format_summary(summary).splitlines()
    head = text.index(f"spikes ({len(summary['spikes'])}): loss or grad norm far above its running baseline, "
                      "and where it started:")
    assert re.split(r"\s{2,}", text[head + 1].strip()) == ["step", "metric", "value", "baseline", "x baseline",
                                                           "where it started"]
    for line, s in zip(text[head + 2:], summary["spikes"]):
        assert re.split(r"\s{2,}", line.strip()) == [
            str(s["step"]), s["metric"].replace("_", " "), f"{s['value']:.4g}", f"{s['baseline']:.4g}",
            f"{s['ratio']:.3g}x", f"blocks.0.fc (output {s['module_metric']} {s['module_ratio']:.3g}x its baseline)"]
    first = text[head + 2]
    assert first.startswith("      40  loss    2.7") and "blocks.0.fc (output rms" in first
    assert text[head + 2 + len(summary["spikes"])].startswith("heatmap: ")  # (the table ends there)
    # the columns line up: each row's ratio ends where the header's "x baseline" does
    header = text[head + 1]
    for line, s in zip(text[head + 2:], summary["spikes"]):
        ratio = f" {s['ratio']:.3g}x  "
        assert line.index(ratio) + len(ratio) == header.index("x baseline") + len("x baseline  ")


def panel(fig, ylabel):
    return next(ax for ax in fig.axes if ax.get_ylabel() == ylabel)


def marks(ax, label):
    return [c.get_offsets().tolist() for c in ax.collections if c.get_label() == label]


def test_the_timeline_marks_each_spike_on_its_metrics_panel(run):
    pytest.importorskip("matplotlib")
    path, _ = run
    summary = report.summarize_run(path)
    fig = report.timeline_figure(summary)
    loss, grad = panel(fig, "loss"), panel(fig, "unscaled grad norm (log)")
    on_loss = [s for s in summary["spikes"] if s["metric"] == "loss"]
    on_grad = [s for s in summary["spikes"] if s["metric"] == "grad_norm"]
    assert marks(loss, SPIKE_LABEL) == [[[s["step"], s["value"]] for s in on_loss]]
    assert marks(grad, SPIKE_LABEL) == ([[[s["step"], s["value"]] for s in on_grad]] if on_grad else [])
    # the value is the step's own loss, and the dotted line goes down to the baseline
    steps = summary["steps"]
    assert all(s["value"] == pytest.approx(summary["loss"][steps.index(s["step"])], rel=1e-6) for s in on_loss)
    (dotted,) = [c for c in loss.collections if c.get_linestyle() != [(0, None)] and c.get_label().startswith("_")]
    assert [seg.tolist() for seg in dotted.get_segments()] == [[[s["step"], s["baseline"]], [s["step"], s["value"]]]
                                                               for s in on_loss]
    star = next(c for c in loss.collections if c.get_label() == SPIKE_LABEL)
    assert star.get_paths()[0].vertices.shape[0] >= 10  # (a star, not the line's dots)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend.count(SPIKE_LABEL) == 1 and HEATMAP_LABEL in legend


def test_the_heatmap_marks_the_module_where_it_started(run):
    pytest.importorskip("matplotlib")
    path, _ = run
    summary = report.summarize_run(path)
    hm = summary["heatmap"]
    # the monitor sends each spike's ratio in a telemetry line of its own at its step: merged into
    # step 40's numbers, and no column of blanks at step 41
    assert hm["steps"] == list(range(0, STEPS, EVERY))
    assert all(any(v is not None for v in column) for column in zip(*hm["values"]))
    named = [s for s in summary["spikes"] if s["name"] is not None]
    assert hm["spikes"] == [{"step": s["step"], "module": s["name"], "metrics": [s["metric"]],
                             "module_metric": s["module_metric"], "module_ratio": s["module_ratio"]} for s in named]
    fig = report.timeline_figure(summary)
    ax = heatmap_axes(fig)
    row = [t.get_text() for t in ax.get_yticklabels()].index("blocks.0.fc")
    assert marks(ax, HEATMAP_LABEL) == [[[s["step"], row] for s in named]]
    assert [PLANTED, row] in marks(ax, HEATMAP_LABEL)[0]


def test_a_log_without_spikes_gives_the_report_it_gave_before(run, tmp_path):
    path, _ = run
    events = report.load_events(path)
    without = [e for e in events if e.get("type") != "spike"]
    before, after = report.summarize_log(without), report.summarize_log(events)
    assert before["spikes"] == [] and before["heatmap"]["spikes"] == []
    text_before, text_after = report.format_summary(before), report.format_summary(after)
    assert "spike" not in text_before
    spike_lines = [line for line in text_after.splitlines() if line not in text_before.splitlines()]
    assert len(spike_lines) == 2 + len(after["spikes"]) and spike_lines[0].startswith("spikes (")
    assert [line for line in text_after.splitlines() if line not in spike_lines] == text_before.splitlines()
    for s in (before, after):
        s.pop("spikes"), s["heatmap"].pop("spikes")
    assert before == after  # (the rest of the summary does not change)
    pytest.importorskip("matplotlib")
    fig = report.timeline_figure(report.summarize_run(plain_log(tmp_path / "plain.jsonl")))
    assert not any(c.get_label() == SPIKE_LABEL for ax in fig.axes for c in ax.collections)


# ---------------------------------------------------------------------------- hand-made logs
def spike_line(step, metric, value, baseline, name=None, rank=0, module_metric="rms", module_ratio=None):
    return {"type": "spike", "step": step, "rank": rank, "time": f"t{step}", "metric": metric, "value": value,
            "baseline": baseline, "name": name, "module_metric": module_metric if name else None,
            "module_ratio": module_ratio if name else None}


def two_rank_log(path):
    """Ranks 0 and 1 in one file: a grad-norm spike no module explains and a loss spike named on
    rank 0; rank 1's own spike at another step."""
    lines = [{"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "t"}]
    for step in range(30):
        for rank in (0, 1):
            lines.append({"type": "step", "step": step, "rank": rank, "loss": 2.0 - 0.01 * step + 3.0 * (step == 25),
                          "grad_norm": 1.0 + 9.0 * (step == 12), "lr": 0.1, "update": "applied",
                          "nonfinite": {"forward": 0, "loss": 0, "backward": 0, "update": 0}})
    lines += [spike_line(25, "loss", 4.75, 1.76, name="enc.fc", module_ratio=12.5),
              spike_line(12, "grad_norm", 10.0, 1.01),
              spike_line(20, "loss", 5.0, 1.8, name="other", rank=1, module_ratio=3.0),
              {"type": "spike", "step": "late", "rank": 0, "metric": "loss", "value": 2.0, "baseline": 1.0},  # no step
              {"type": "spike", "step": 13, "rank": 0, "metric": "loss", "value": None, "baseline": 1.0}]  # no value
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_spikes_are_the_reported_ranks_in_step_order(tmp_path):
    path = two_rank_log(tmp_path / "ranks.jsonl")
    s = report.summarize_run(path)
    assert s["rank"] == 0
    assert [(sp["step"], sp["metric"], sp["name"]) for sp in s["spikes"]] == [(12, "grad_norm", None),
                                                                              (25, "loss", "enc.fc")]
    assert s["spikes"][0]["ratio"] == pytest.approx(10.0 / 1.01) and s["spikes"][0]["module_ratio"] is None
    one = report.summarize_log(report.load_events(path), rank=1)
    assert [(sp["step"], sp["name"]) for sp in one["spikes"]] == [(20, "other")]
    text = report.format_summary(s).splitlines()
    head = text.index("spikes (2): loss or grad norm far above its running baseline, and where it started:")
    assert text[head + 1:head + 4] == [
        "    step  metric     value  baseline  x baseline  where it started",
        "      12  grad norm     10      1.01        9.9x  no module departed",
        "      25  loss        4.75      1.76        2.7x  enc.fc (output rms 12.5x its baseline)"]


def test_a_grad_norm_spike_is_on_the_grad_norm_panel(tmp_path):
    pytest.importorskip("matplotlib")
    fig = report.timeline_figure(report.summarize_run(two_rank_log(tmp_path / "ranks.jsonl")))
    assert marks(panel(fig, "loss"), SPIKE_LABEL) == [[[25, 4.75]]]
    assert marks(panel(fig, "unscaled grad norm (log)"), SPIKE_LABEL) == [[[12, 10.0]]]
    assert [t.get_text() for t in fig.legends[0].get_texts()].count(SPIKE_LABEL) == 1


def test_many_spikes_list_twenty_and_count_the_rest(tmp_path):
    path = tmp_path / "many.jsonl"
    lines = [{"type": "step", "step": st, "rank": 0, "loss": 1.0 + (st % 2), "update": "applied"} for st in range(60)]
    lines += [spike_line(st, "loss", 2.0, 1.0) for st in range(1, 60, 2)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = report.text_report(str(path)).splitlines()
    head = next(i for i, line in enumerate(text) if line.startswith("spikes (30)"))
    assert text[head + 2].startswith("       1  loss") and text[head + 21].startswith("      39  loss")
    assert text[head + 22] == "    ... 10 more (steps 41, 43, 45, 47, 49, 51, 53, 55, 57, 59)"


def test_a_big_model_keeps_the_row_where_a_spike_started():
    events = synthetic(300, incident_module=7, nonfinite=(40,), warned=(100,))
    events.append(spike_line(5, "loss", 3.0, 1.0, name="m150", module_ratio=4.0))
    events.append(spike_line(6, "loss", 3.0, 1.0, name="not-a-module", module_ratio=4.0))
    hm = report.summarize_log(events)["heatmap"]
    assert len(hm["modules"]) == report.MAX_ROWS and "m150" in hm["modules"]
    assert hm["index"][:9] == [5, 6, 7, 8, 9, 40, 100, 150, 244]
    assert hm["spikes"] == [{"step": 5, "module": "m150", "metrics": ["loss"], "module_metric": "rms",
                             "module_ratio": 4.0}]
    assert "where spikes started" in hm["rule"]


def test_a_figure_with_spikes_has_every_text_inside_it(tmp_path):
    """Spikes on both panels, the last one at the last step and the run's largest loss (the top right
    corner), one on a long-named module of a 64-row heatmap: every text and mark of the figure, the
    legend's new entries included, lies inside the PNG."""
    pytest.importorskip("matplotlib")
    prefix = "model.transformer.encoder.layers.attention.output.dense.projection."
    events = synthetic(300, incident_module=7, nonfinite=(40,), warned=(100,), prefix=prefix)
    for e in events:
        if e.get("type") == "step":
            e["grad_norm"] = 1.0 + 5.0 * (e["step"] == 2)
    last = max(e["step"] for e in events if e.get("type") == "step")
    next(e for e in events if e.get("type") == "step" and e["step"] == last)["loss"] = 9.0
    events += [spike_line(2, "grad_norm", 6.0, 1.0, name=f"{prefix}150", module_ratio=8.0),
               spike_line(last, "loss", 9.0, 1.0, name=f"{prefix}299", module_ratio=0.25)]
    summary = report.summarize_log(events)
    fig = report.timeline_figure(summary)
    assert len(heatmap_axes(fig).get_yticklabels()) == 64
    assert marks(heatmap_axes(fig), HEATMAP_LABEL)[0] == [[2, summary["heatmap"]["modules"].index(f"{prefix}150")],
                                                           [last, summary["heatmap"]["modules"].index(f"{prefix}299")]]
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    ink, page = fig.get_tightbbox(renderer), fig.bbox_inches
    px = 1 / fig.dpi
    assert page.x0 - px <= ink.x0 and ink.x1 <= page.x1 + px and page.y0 - px <= ink.y0 and ink.y1 <= page.y1 + px, \
        (ink, page)
    assert_stars_inside(fig, renderer)


def assert_stars_inside(fig, renderer):
    """Every spike star lies whole inside its panel (not cut by the axes' edges): centre +- radius,
    in pixels."""
    for ax in (panel(fig, "loss"), panel(fig, "unscaled grad norm (log)")):
        star = next(c for c in ax.collections if c.get_label() == SPIKE_LABEL)
        radius = star.get_sizes()[0] ** 0.5 / 2 * fig.dpi / 72
        box = ax.get_window_extent(renderer)
        for x, y in ax.transData.transform(star.get_offsets()):
            assert box.x0 + radius <= x <= box.x1 - radius and box.y0 + radius <= y <= box.y1 - radius, (x, y, box)


def test_a_spike_at_the_edge_of_a_long_run_is_drawn_whole(tmp_path):
    """20000 steps: the timeline's own margin is a few pixels; a star at the first or last step, at
    the largest value of its panel, still lies whole inside it."""
    pytest.importorskip("matplotlib")
    n = 20_000
    path = plain_log(tmp_path / "long.jsonl", n=n, loss=lambda st: 9.0 if st == n - 1 else 2.0 - st / n,
                     grad_norm=lambda st: 50.0 if st == 0 else 1.0 + st / n)
    with open(path, "a") as f:
        f.write(json.dumps(spike_line(n - 1, "loss", 9.0, 1.1)) + "\n")
        f.write(json.dumps(spike_line(0, "grad_norm", 50.0, 1.0, name="fc", module_ratio=3.0)) + "\n")
    fig = report.timeline_figure(report.summarize_run(path))
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    assert_stars_inside(fig, renderer)


def test_the_cli_prints_the_spikes(run, tmp_path, capsys):
    path, _ = run
    assert cli.main(["report", path]) == 0  # (spikes are warnings: the run is clear)
    out = capsys.readouterr().out
    assert "spikes (" in out and "blocks.0.fc (output rms" in out


def test_a_spikes_own_telemetry_line_adds_to_its_step_never_a_column():
    """The monitor's ``nanscan/spike/<metric>`` line, before or after the step's own telemetry line
    or at a step without one: the matrix is the one of the telemetry lines alone."""
    events = synthetic(4)
    plain = report.summarize_log(events)["heatmap"]
    ratio = {"type": "telemetry", "rank": 0, "scalars": {"nanscan/spike/loss": 3.0}}
    after = events + [dict(ratio, step=2), dict(ratio, step=9)]
    first = next(i for i, e in enumerate(events) if e.get("type") == "telemetry" and e["step"] == 2)
    before = events[:first] + [dict(ratio, step=2)] + events[first:] + [dict(ratio, step=9)]
    for spiked in (after, before):
        assert report.summarize_log(spiked)["heatmap"] == plain

"""nanscan.report on a synthetic run: AMP overflows the scaler handled, then a gradient explosion
and a NaN loss; a crash truncated the last log line."""
import base64
import json
import math
import os

import pytest

from nanscan import report

NAN = {"finite": False, "value": "nan"}
INF = {"finite": False, "value": "inf"}
SKIPPED = (6, 17)      # GradScaler overflows: grad norm inf, update skipped, scale halved next step
FAIL = 20              # the NaN loss (forward produced it in 'block.act')
GRAD = {15: 1.5, 16: 6.0, 18: 40.0, 19: 400.0}  # the explosion before the failure


def step_record(step, scale):
    if step == FAIL:
        return {"type": "step", "step": step, "rank": 0, "time": f"t{step}", "loss": NAN, "grad_norm": NAN,
                "loss_scale": scale, "lr": 1e-3, "update": "skipped",
                "nonfinite": {"forward": 3, "loss": 1, "backward": 250_000, "update": 0}}
    skipped = step in SKIPPED
    return {"type": "step", "step": step, "rank": 0, "time": f"t{step}", "loss": 2.5 - 0.02 * step,
            "grad_norm": INF if skipped else GRAD.get(step, 1.0 + 0.01 * step), "loss_scale": scale,
            "lr": 1e-3 * min(1.0, (step + 1) / (FAIL + 1)), "update": "skipped" if skipped else "applied",
            "nonfinite": {"forward": 0, "loss": 0, "backward": 4096 if skipped else 0, "update": 0}}


def incident(step, phase, name, kind, handled, nan):
    summary = {"dtype": "float16", "shape": [8, 64], "numel": 512, "nan_count": nan, "posinf_count": 0 if nan else 4,
               "neginf_count": 0, "zero_count": 3, "finite_min": -7.5, "finite_max": 60000.0,
               "sumsq": INF, "first_nonfinite_index": 17, "nonfinite_count": nan or 4, "finite_count": 512 - (nan or 4),
               "is_finite": False, "absmax": 60000.0, "l2_norm": INF, "sumsq_overflowed": False}
    return {"type": "incident", "step": step, "rank": 0, "time": f"t{step}",
            "incident": {"step": step, "phase": phase, "name": name, "kind": kind, "produced": True, "rank": 0,
                         "inputs": [], "handled_by_scaler": handled, "summary": summary},
            "bundle": f"/runs/nan/step{step:06d}-rank0" if not handled else None}


def write_log(path, n=30):
    lines = [{"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "2026-01-01T00:00:00Z", "world_size": 1}]
    scale = 65536.0
    for step in range(n - 1):
        lines.append(step_record(step, scale))
        if step == SKIPPED[0]:
            lines.append(incident(step, "backward", "block.fc2.weight", "grad", True, 0))
        if step == FAIL:
            lines.append(incident(step, "forward", "block.act", "activation", False, 3))
            lines.append({"type": "checkpoint", "step": step, "path": "/ckpt"})  # an unknown type: ignored
        if step in SKIPPED or step == FAIL:
            scale /= 2
    text = "\n".join(json.dumps(x, allow_nan=False) for x in lines) + "\n"
    text += json.dumps(step_record(n - 1, scale))[:37]  # the crash cut the last line mid-write
    path.write_text(text)
    return str(path)


@pytest.fixture
def log(tmp_path):
    return write_log(tmp_path / "events.jsonl")


def test_load_events_decodes_nonfinite_and_skips_the_truncated_line(log):
    events = report.load_events(log)
    assert events[0]["type"] == "header"
    fail = next(e for e in events if e.get("type") == "step" and e["step"] == FAIL)
    assert math.isnan(fail["loss"]) and math.isnan(fail["grad_norm"])
    assert next(e for e in events if e.get("step") == 6)["grad_norm"] == math.inf
    inc = next(e for e in events if e.get("type") == "incident" and e["step"] == FAIL)
    assert inc["incident"]["summary"]["sumsq"] == math.inf and inc["incident"]["summary"]["finite_min"] == -7.5
    assert events[-1]["type"] == "unparsed" and events[-1]["last"]
    assert sum(e.get("type") == "step" for e in events) == 29


def test_summarize_log_finds_first_anomaly_skips_and_what_preceded(log):
    s = report.summarize_log(report.load_events(log))
    assert s["steps"] == list(range(29)) and len(s["loss"]) == len(s["lr"]) == len(s["nonfinite"]["forward"]) == 29
    assert s["skipped_steps"] == [6, 17, 20]
    assert s["loss_scale_drops"] == [7, 18, 21]
    n_lines = len(open(log).read().splitlines())
    assert f"last line {n_lines} is truncated (the run stopped mid-write?); skipped" in s["notes"]

    first = s["first_anomaly"]
    assert first["step"] == 6 and first["criterion"] == "grad_norm_nonfinite"
    assert first["criteria"] == ["grad_norm_nonfinite", "nonfinite_backward", "update_skipped", "incident"]
    assert first["handled_by_scaler"]

    bad = s["first_unhandled_anomaly"]
    assert s["focus"] is bad and bad["step"] == FAIL and bad["criterion"] == "loss_nonfinite"
    assert not bad["handled_by_scaler"]  # a NaN loss is never an overflow the scaler absorbs
    assert [i["incident"]["name"] for i in bad["incidents"]] == ["block.act"]
    assert bad["incidents"][0]["bundle"] == "/runs/nan/step000020-rank0"

    p = bad["preceding"]
    assert p["steps"] == [15, 16, 17, 18, 19]
    assert p["grad_norm"]["values"][:2] == [1.5, 6.0] and p["grad_norm"]["values"][2] == math.inf
    assert p["grad_norm_grew_10x"] and p["grad_norm_growth"] == pytest.approx(400 / 1.5)
    assert p["grad_norm_nonfinite_before"]
    assert p["loss_scale_dropping"] and p["loss_scale_drops_in_window"] == [18]
    assert p["loss_scale"]["values"] == [32768.0, 32768.0, 32768.0, 16384.0, 16384.0]
    assert p["lr_rising"] and not p["loss_rising"]
    assert p["skipped_in_window"] == [17]
    # the handled overflow at step 6 had nothing alarming before it
    q = first["preceding"]
    assert q["steps"] == [1, 2, 3, 4, 5] and not q["grad_norm_grew_10x"] and not q["loss_scale_dropping"]

    assert [st for st in s["anomalous_steps"]] == [6, 17, 20]
    json.loads(report.to_json(s))  # strict JSON round trip of a summary holding NaN / Inf


def test_summarize_log_clean_run_and_other_ranks():
    events = [{"type": "step", "step": i, "rank": r, "loss": 1.0, "grad_norm": 1.0, "loss_scale": None, "lr": 0.1,
               "update": "applied", "nonfinite": {}} for i in range(4) for r in (0, 1)]
    events.append({"type": "step", "step": 2, "rank": 1, "loss": NAN})  # raw object: not decoded, ignored
    s = report.summarize_log(events)
    assert s["rank"] == 0 and s["other_ranks"] == [1] and s["first_anomaly"] is None and s["focus"] is None
    s1 = report.summarize_log(events, rank=1)
    assert s1["steps"] == [0, 1, 2, 3] and any("more than once" in n for n in s1["notes"])


def test_incident_without_step_record_is_an_anomaly():
    events = [{"type": "step", "step": 0, "rank": 0, "loss": 1.0},
              incident(3, "update", "fc.weight", "param", False, 1)]
    s = report.summarize_log(events)
    assert s["steps"] == [0, 3] and s["first_anomaly"]["step"] == 3 and s["first_anomaly"]["criterion"] == "incident"


def test_skipped_update_is_handled_only_for_a_gradient_overflow():
    base = {"type": "step", "rank": 0, "loss": 1.0, "grad_norm": INF, "update": "skipped",
            "nonfinite": {"backward": 10}}
    events = report.parse_events([json.dumps({**base, "step": 0}),
                                  json.dumps({**base, "step": 1, "nonfinite": {"backward": 10, "update": 1}}),
                                  json.dumps({**base, "step": 2}),
                                  json.dumps(incident(2, "backward", "fc.weight", "grad", False, 1))])
    s = report.summarize_log(events)
    assert s["anomalous_steps"] == [0, 1, 2] and s["first_anomaly"]["handled_by_scaler"]
    assert s["first_unhandled_anomaly"]["step"] == 1  # a non-finite parameter after a skipped update
    s = report.summarize_log([e for e in events if e["step"] != 1])
    assert s["first_unhandled_anomaly"]["step"] == 2  # the monitor said the scaler did not handle it


def test_text_report_names_step_module_and_phase(log):
    text = report.text_report(log)
    assert "first anomalous step: step 6: grad norm non-finite" in text and "handled by GradScaler" in text
    assert "first anomaly not handled by the scaler: step 20: loss non-finite" in text
    assert "'block.act' at step 20, phase forward" in text and "produced here" in text
    assert "what preceded step 20 (steps 15-19)" in text
    assert "grad norm grew 267x (last finite value vs the window's smallest): an explosion before the failure" in text
    assert "loss scale dropping" in text and "lr rising" in text
    assert "truncated" in text and "updates skipped: 3 (steps 6, 17, 20)" in text


def test_plot_report_writes_a_png(log, tmp_path):
    pytest.importorskip("matplotlib")
    out = report.plot_report(log, tmp_path / "plots" / "timeline.png")
    with open(out, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    if os.environ.get("NANSCAN_REPORT_SAMPLE"):  # leave a copy to look at
        with open(os.environ["NANSCAN_REPORT_SAMPLE"], "wb") as f:
            f.write(data)


def test_plot_report_without_matplotlib_says_how_to_install(log, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'nanscan\[report\]' \(matplotlib\)"):
        report.plot_report(log, tmp_path / "x.png")
    assert "block.act" in report.text_report(log)  # the text report still works


def test_html_report_embeds_the_png(log, tmp_path):
    pytest.importorskip("matplotlib")
    png = report.plot_report(log, tmp_path / "t.png")
    out = report.html_report(log, tmp_path / "r.html", png=png)
    page = open(out, encoding="utf-8").read()
    with open(png, "rb") as f:
        assert f'src="data:image/png;base64,{base64.b64encode(f.read()).decode()}"' in page
    assert "&#x27;block.act&#x27; at step 20, phase forward" in page and page.startswith("<!DOCTYPE html>")
    assert "<img" not in open(report.html_report(log, tmp_path / "plain.html"), encoding="utf-8").read()


def test_bundle_gives_a_text_report_without_timeline(tmp_path):
    bundle = tmp_path / "step000020-rank0"
    bundle.mkdir()
    manifest = {"format": "nanscan-bundle", "version": 1, "step": 20, "state": "before-update", "training": True,
                "autocast": {"cuda": {"enabled": True, "dtype": "float16"},
                             "cpu": {"enabled": False, "dtype": "bfloat16"}},
                "model_precision": {"param_dtypes": {"float32": 1000}, "converted": []},
                "inputs": [{"path": "args[0]", "dtype": "float32", "shape": [8, 64]}],
                "incident": incident(20, "forward", "block.act", "activation", False, 3)["incident"],
                "environment": {"torch": "2.14.1", "cuda": "13.0", "device": "NVIDIA H200", "tf32_matmul": False},
                "extra": {}, "files": {"batch.pt": "0" * 64, "rng.pt": "0" * 64, "model.pt": "0" * 64}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    text = report.text_report(str(bundle))
    assert "no timeline" in text and "'block.act' at step 20, phase forward" in text
    assert "  incident     activation 'block.act' in forward (produced=True, rank 0)\n" in text
    assert "  autocast     cuda: on, float16\n" in text and "  autocast     cpu: off\n" in text
    assert "  state        model / optimizer / scaler state from before-update\n" in text
    assert "  parameters   float32 1000\n" in text and "  input        args[0]: float32[8, 64]\n" in text
    assert "  env          torch = 2.14.1\n" in text and "  env          tf32_matmul = False\n" in text
    assert "  files        batch.pt, model.pt, rng.pt\n" in text
    assert f"  next         nanscan replay {bundle} --model pkg.module:factory" in text
    s = report.summarize_run(str(bundle))
    assert s["source"] == "bundle" and not s["timeline"] and s["focus"]["step"] == 20
    assert "block.act" in report.text_report(str(bundle / "manifest.json"))
    try:
        import matplotlib  # noqa: F401  (the plot needs it; the checks around it do not)
    except ImportError:
        pass
    else:
        with pytest.raises(ValueError, match="no timeline"):
            report.plot_report(str(bundle), tmp_path / "x.png")
    page = open(report.html_report(str(bundle), tmp_path / "b.html"), encoding="utf-8").read()
    assert "no timeline" in page

    (tmp_path / "notabundle").mkdir()
    with pytest.raises(ValueError, match="without manifest.json"):
        report.text_report(str(tmp_path / "notabundle"))
    (bundle / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a nanscan bundle"):
        report.text_report(str(bundle))


def test_show_and_report_print_the_same_bundle_page(tmp_path):
    """One renderer: `nanscan show` (a verified bundle) and `nanscan report BUNDLE` (its manifest
    only) print the same page."""
    import torch

    import nanscan
    from nanscan import cli

    path = nanscan.capture_bundle(str(tmp_path / "b"), model=torch.nn.Linear(4, 2), batch=torch.randn(3, 4))
    page = report.text_report(path)
    assert cli.show(nanscan.load_bundle(path)) == page
    assert page.startswith(f"nanscan bundle {path}\n  created      ")
    assert "  incident     none recorded (bundle captured on request)\n" in page
    assert "  input        args[0]: float32[3, 4]\n" in page and f"  env          torch = {torch.__version__}\n" in page


def test_bundle_page_of_an_odd_manifest_does_not_crash():
    """Valid JSON of unexpected shapes reads as missing, never as a KeyError / TypeError."""
    manifest = {"format": "nanscan-bundle", "step": 3, "autocast": {"cpu": {"enabled": True}, "cuda": [1]},
                "model_precision": {"param_dtypes": [], "converted": "x"}, "inputs": [{"dtype": "float32"}, 5],
                "environment": [], "files": ["model.pt"], "incident": {"kind": "grad"}}
    text = report.bundle_text(report.summarize_bundle(manifest, "/b"))
    assert "  autocast     cpu: on, None\n  autocast     cuda: off\n" in text
    assert "  parameters   -\n" in text and "  input        None: float32None\n" in text
    assert "  files        -\n" in text and "incident     grad 'None' in None" in text


def test_incident_sentences_use_the_monitors_kind_phrases():
    """One vocabulary (nanscan.vocabulary): a buffer incident reads "buffer after the update" in the
    report as in str(Incident) (the report had its own table, without buffers)."""
    from nanscan.vocabulary import KIND_PHRASES, KINDS

    for kind in KINDS:
        text = report.incident_text({"step": 3, "phase": "update", "kind": kind, "name": "bn.running_var"})
        assert text.startswith(f"non-finite {KIND_PHRASES[kind]} 'bn.running_var' at step 3"), text


# ---------------------------------------------------------------------------- what was logged
def plain_log(path, n=10, **fields):
    """A run without AMP: header + ``n`` step records; ``fields`` override a record's values (a
    callable gets the step)."""
    lines = [{"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "2026-01-01T00:00:00Z", "pid": 1}]
    for step in range(n):
        record = {"type": "step", "step": step, "rank": 0, "time": f"t{step}", "loss": 2.0 - 0.01 * step,
                  "grad_norm": 1.0 + 0.001 * step, "loss_scale": None, "lr": 0.1, "update": "applied",
                  "nonfinite": {"forward": 0, "loss": 0, "backward": 0, "update": 0}}
        for key, value in fields.items():
            if callable(value):
                value = value(step)
            if value is DROP:
                record.pop(key)
            else:
                record[key] = value
        lines.append(record)
    path.write_text("".join(json.dumps(x, allow_nan=False) + "\n" for x in lines))
    return str(path)


DROP = object()  # plain_log: leave the field out of the record


def test_all_clear_names_what_was_not_logged(tmp_path):
    """A run whose every loss is null was reported as "every logged loss and grad norm is
    finite": the all-clear lists only what the log holds, and says what it does not."""
    s = report.summarize_run(plain_log(tmp_path / "noloss.jsonl", loss=None))
    assert s["logged"] == {"loss": 0, "grad_norm": 10, "loss_scale": 0, "lr": 10, "update": 10, "nonfinite": 10}
    assert s["verdict"]["status"] == "clear"
    text = report.format_summary(s)
    assert "every logged loss" not in text
    assert "no anomalous step in what was logged:" in text
    assert "  - grad norm finite at all 10 logged steps\n" in text
    assert "  - no non-finite tensor counted (10 steps)\n" in text and "  - no update skipped (10 steps)\n" in text
    assert "not logged, so not checked: loss (null at all 10 steps)\n" in text

    # partly logged: the steps without it are counted, never assumed finite
    text = report.text_report(plain_log(tmp_path / "some.jsonl", loss=lambda st: None if st % 2 else 1.0,
                                        nonfinite=lambda st: DROP if st >= 4 else {"forward": 0}))
    assert "  - loss finite at all 5 logged steps (null at 5 of 10)\n" in text
    assert "  - no non-finite tensor counted (4 of 10 steps; not logged at 6)\n" in text


def test_nothing_logged_is_cannot_tell(tmp_path):
    """Step records with no loss, grad norm, non-finite counts or update decision back no
    all-clear: "cannot tell", not "no anomalous step"."""
    path = plain_log(tmp_path / "bare.jsonl", loss=None, grad_norm=None, update=None, nonfinite=DROP)
    s = report.summarize_run(path)
    assert s["verdict"]["status"] == "cannot tell" and s["first_anomaly"] is None
    text = report.format_summary(s)
    assert "no anomalous step" not in text
    assert ("cannot tell whether the run stayed finite: no step record logs a loss, a grad norm, non-finite "
            "counts or an update decision") in text
    header_only = tmp_path / "header.jsonl"
    header_only.write_text('{"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "x"}\n')
    assert report.summarize_run(str(header_only))["verdict"]["status"] == "cannot tell"
    assert report.summarize_run(write_log(tmp_path / "events.jsonl"))["verdict"]["status"] == "finding"


def test_findings_that_say_nothing_are_left_out(tmp_path):
    """ "grad norm grew 1x" and "loss rising (5.638 -> 5.656)" said nothing: only a real change
    is a finding (a grad norm that grew more than 10x, a loss that at least doubled)."""
    def loss(st):
        return NAN if st == 8 else 5.638 + 0.003 * st

    text = report.text_report(plain_log(tmp_path / "flat.jsonl", loss=loss))
    assert "what preceded step 8 (steps 3-7):" in text
    assert "grad norm grew" not in text and "loss rising" not in text and "loss grew" not in text
    # rows of what was not logged in the window are left out, and named
    assert "    loss scale" not in text and "    not logged in these steps: loss scale\n" in text

    def diverging(st):
        return NAN if st == 8 else 1.0 * 2 ** max(0, st - 4)

    text = report.text_report(plain_log(tmp_path / "div.jsonl", loss=diverging,
                                        grad_norm=lambda st: 1.0 if st < 6 else 50.0))
    assert "    - loss grew 8x (last finite value vs the window's smallest)\n" in text
    assert ("    - grad norm grew 50x (last finite value vs the window's smallest): an explosion before the "
            "failure\n") in text


def test_unparsed_lines_are_named_for_what_they_are(tmp_path):
    """Valid JSON that is not an event object ([1,2], a final 5) was called "not valid JSON" /
    "truncated"."""
    path = tmp_path / "events.jsonl"
    good = plain_log(tmp_path / "good.jsonl", n=3)
    lines = open(good).read().splitlines()
    # 1 header, 2 step, 3 [1,2], 4 not JSON, 5 step, 6 a line cut off by a restart, 7 header, 8 step, 9 `5`
    path.write_text("\n".join([lines[0], lines[1], "[1,2]", "{oops", lines[2], lines[3][:20], lines[0], lines[3],
                               "5"]) + "\n")
    notes = report.summarize_run(str(path))["notes"]
    assert "line 3 is valid JSON but not an event (an array, not an object); skipped" in notes
    assert "line 4 is not valid JSON; skipped" in notes
    assert "line 6 was cut off mid-write (a new run's header follows it); skipped" in notes
    assert "last line 9 is valid JSON but not an event (a number, not an object); skipped" in notes
    assert not any("truncated" in n for n in notes), notes


@pytest.mark.parametrize("case", ["array", "number", "text", "config", "empty", "binary", "word"])
def test_a_file_that_is_not_an_event_log_is_refused(tmp_path, case):
    content, expected = {
        "array": (b"[1,2]\n", "line 1 is valid JSON but not an event (an array, not an object)"),
        "number": (b"5\n", "line 1 is valid JSON but not an event (a number, not an object)"),
        "text": (b"# README\n\nnot a log\n", "line 1 is not valid JSON"),
        "config": (b'{"lr": 0.1}\n', 'no line is a "header", "step" or "incident" record'),
        "empty": (b"", "is empty"),
        "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "line 1 is not valid JSON"),
        "word": (b"hello", "line 1 is not valid JSON"),  # (one line, no newline: still not "truncated")
    }[case]
    path = tmp_path / "file.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a nanscan event log") as err:
        report.summarize_run(str(path))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_special_files_are_named_not_missing(tmp_path):
    """/dev/null and a FIFO were reported as "does not exist"."""
    with pytest.raises(ValueError, match=r"/dev/null is a character device, not a file: give a JSONL event log"):
        report.summarize_run("/dev/null")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"pipe is a named pipe \(FIFO\), not a file"):
        report.summarize_run(str(fifo))  # (never opened: a FIFO without a writer would block)
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "link.jsonl")
    with pytest.raises(FileNotFoundError, match="link.jsonl is a broken symbolic link"):
        report.summarize_run(str(tmp_path / "link.jsonl"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        report.summarize_run(str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------------------- the timeline's panels
def panel_labels(summary):
    """The y labels of the figure's panels (twin axes as "twin:<label>"), top to bottom."""
    fig = report.timeline_figure(summary)
    main = [ax for ax in fig.axes if ax.get_label() != "twin"]
    twins = [f"twin:{ax.get_ylabel()}" for ax in fig.axes if ax.get_label() == "twin"]
    return [ax.get_ylabel() for ax in main] + twins, fig


def test_timeline_has_a_panel_only_for_what_was_logged(tmp_path):
    """Without AMP the loss-scale panel was a quarter of the PNG saying "not logged"."""
    pytest.importorskip("matplotlib")
    amp = report.summarize_run(write_log(tmp_path / "amp.jsonl"))
    labels, _ = panel_labels(amp)
    assert labels == ["loss", "unscaled grad norm (log)", "loss scale (log)", "non-finite elements\nper phase (log)",
                      "twin:lr"]

    plain = report.summarize_run(plain_log(tmp_path / "plain.jsonl"))
    labels, fig = panel_labels(plain)
    assert labels == ["loss", "unscaled grad norm (log)", "lr", "non-finite elements\nper phase (log)"]
    assert "not logged: loss scale" in fig._suptitle.get_text()

    bare = report.summarize_run(plain_log(tmp_path / "bare.jsonl", loss=None, lr=None, nonfinite=DROP))
    labels, fig = panel_labels(bare)
    assert labels == ["unscaled grad norm (log)"]
    assert "not logged: loss, loss scale, lr, non-finite counts" in fig._suptitle.get_text()
    out = report.plot_summary(bare, tmp_path / "bare.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

"""nanscan.log: NaN-safe strict JSON and the JSONL event log."""
import dataclasses
import datetime
import json
import math
import os
import pathlib

import numpy as np
import pytest
import torch

import nanscan
from nanscan import log

NAN, INF = float("nan"), float("inf")
NONFINITE = {"nan": NAN, "inf": INF, "-inf": -INF}


def _no_constants(token):
    raise AssertionError(f"non-strict JSON token {token!r}")


def strict(text: str):
    """Parse as strict JSON: NaN / Infinity / -Infinity tokens fail the test."""
    return json.loads(text, parse_constant=_no_constants)


def same(a, b) -> bool:
    """Structural equality where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_every_nonfinite_kind_round_trips_nested(text):
    v = NONFINITE[text]
    obj = {"a": v, "b": [1.0, v, {"c": (v, 2, None)}], 3: (v,), "ok": True, "s": "nan"}
    s = log.dumps(obj)
    assert "NaN" not in s and "Infinity" not in s
    assert strict(s)["a"] == {"finite": False, "value": text}
    back = log.loads(s)
    assert same(back, {"a": v, "b": [1.0, v, {"c": [v, 2, None]}], "3": [v], "ok": True, "s": "nan"})
    assert isinstance(back["a"], float)


def test_allow_nan_is_forced_and_kwargs_pass():
    s = log.dumps({"x": NAN, "y": 1}, allow_nan=True, sort_keys=True, indent=1)
    strict(s)
    assert s.index('"x"') < s.index('"y"') and "\n" in s


def test_dump_load_files(tmp_path):
    p = tmp_path / "x.json"
    with open(p, "w") as f:
        log.dump([NAN, -INF], f)
    with open(p) as f:
        assert same(log.load(f), [NAN, -INF])


def test_only_the_exact_marker_decodes():
    assert same(log.loads('{"finite": false, "value": "inf"}'), INF)
    for keep in ['{"finite": false, "value": "inf", "extra": 1}', '{"finite": true, "value": "inf"}',
                 '{"finite": 0, "value": "nan"}', '{"finite": false, "value": "huge"}']:
        assert log.loads(keep) == json.loads(keep)


def test_numpy_scalars_and_small_arrays():
    obj = {"f32": np.float32(NAN), "f64": np.float64(-INF), "f16": np.float16(INF), "i": np.int64(7),
           "b": np.bool_(True), "u": np.uint8(255), "c": np.complex64(complex(1, INF)),
           "arr": np.array([[1.0, NAN], [INF, -INF]]), "iarr": np.arange(3, dtype=np.int16),
           "barr": np.array([True, False])}
    s = log.dumps(obj)
    d = strict(s)
    assert d["i"] == 7 and d["b"] is True and d["u"] == 255 and d["iarr"] == [0, 1, 2] and d["barr"] == [True, False]
    back = log.loads(s)
    assert same(back["arr"], [[1.0, NAN], [INF, -INF]])
    assert same(back["f32"], NAN) and same(back["f64"], -INF) and same(back["f16"], INF)
    assert same(back["c"], {"real": 1.0, "imag": INF})


def test_large_numpy_array_is_a_summary():
    a = np.zeros(1000, dtype=np.float32)
    a[5], a[7], a[9] = NAN, INF, -INF
    d = strict(log.dumps({"a": a[::-1]}))["a"]   # negative strides: copied to summarize
    assert d["__summary__"] is True and d["numel"] == 1000
    assert (d["nan_count"], d["posinf_count"], d["neginf_count"]) == (1, 1, 1)
    assert d["first_nonfinite_index"] == 990
    assert strict(log.dumps(np.arange(100, dtype=np.uint32)))["finite_max"] == 99.0
    assert strict(log.dumps(np.arange(10), max_elements=4))["__summary__"] is True


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_zero_dim_and_small_tensors(text):
    v = NONFINITE[text]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2):
        assert same(log.loads(log.dumps(torch.tensor(v, dtype=dtype))), v)
        back = log.loads(log.dumps(torch.tensor([[1.0, v], [v, 0.5]], dtype=dtype)))
        assert same(back, [[1.0, v], [v, 0.5]])
    z = torch.tensor([complex(1.0, v)])
    assert same(log.loads(log.dumps(z)), {"real": [1.0], "imag": [v]})


def test_tensor_dtypes_are_preserved_semantically():
    d = strict(log.dumps({"i": torch.tensor([1, 2]), "b": torch.tensor(True), "f": torch.tensor([1, 2.5]),
                          "t": torch.arange(6.0).reshape(2, 3).t(), "g": torch.ones(2, requires_grad=True)}))
    assert d["i"] == [1, 2] and all(type(v) is int for v in d["i"])
    assert d["b"] is True and d["f"] == [1.0, 2.5] and d["g"] == [1.0, 1.0]
    assert d["t"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_large_tensor_is_a_summary():
    x = torch.ones(100, 3)
    x[2, 1] = NAN
    x[50, 0] = -INF
    d = strict(log.dumps({"x": x}))["x"]
    assert d["__summary__"] is True
    ref = nanscan.summarize(x, backend="reference").to_dict()
    assert {k: v for k, v in d.items() if k != "__summary__"} == ref
    assert d["nan_count"] == 1 and d["neginf_count"] == 1 and d["first_nonfinite_index"] == 7
    c = strict(log.dumps(torch.full((100,), complex(NAN, 1.0))))
    assert c["__summary__"] is True and c["nan_count"] == 100 and c["shape"] == [100, 2]


def test_tensor_summary_and_dataclasses():
    s = nanscan.summarize(torch.tensor([NAN, 1.0, INF]), backend="reference")
    d = strict(log.dumps(s))
    assert d == s.to_dict() and d["nan_count"] == 1
    assert same(log.loads(log.dumps(s))["finite_max"], 1.0)
    assert same(log.loads(log.dumps(s))["sumsq"], 1.0)
    inc = nanscan.Incident(step=3, phase="forward", name="fc", kind="activation", produced=True, summary=s)
    assert strict(log.dumps(inc)) == inc.to_dict()

    @dataclasses.dataclass
    class Point:
        x: float
        t: torch.Tensor
        p: pathlib.Path

    back = log.loads(log.dumps(Point(NAN, torch.tensor([INF]), pathlib.Path("/a/b"))))
    assert same(back, {"x": NAN, "t": [INF], "p": "/a/b"})


def test_misc_types():
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    d = strict(log.dumps({"dt": torch.bfloat16, "dev": torch.device("cpu"), "size": torch.Size([2, 3]),
                          "when": when, "set": {3, 1, 2}, "mixed": {1, "a"}, "frozen": frozenset([NAN])}))
    assert d["dt"] == "bfloat16" and d["dev"] == "cpu" and d["size"] == [2, 3]
    assert d["when"] == "2024-01-02T03:04:05+00:00" and d["set"] == [1, 2, 3]
    assert sorted(map(str, d["mixed"])) == ["1", "a"]
    assert d["frozen"] == [{"finite": False, "value": "nan"}]


def test_unknown_and_bad_objects_raise():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="Opaque"):
        log.dumps({"a": [1, Opaque()]})
    with pytest.raises(TypeError, match="bytes"):
        log.dumps(b"x")
    with pytest.raises(TypeError, match="meta"):
        log.dumps(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="both '1'"):
        log.dumps({1: 0, "1": 1})
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match="circular"):
        log.dumps(loop)


def test_numpy_is_optional(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "numpy")  # only the lazily found module goes away
    assert same(log.loads(log.dumps({"x": [NAN], "t": torch.tensor([INF])})), {"x": [NAN], "t": [INF]})


def read_strict_lines(path):
    with open(path) as f:
        text = f.read()
    assert text.endswith("\n")
    return [strict(line) for line in text.splitlines()]


def test_event_log_format(tmp_path, monkeypatch):
    syncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    path = tmp_path / "sub" / "events.jsonl"
    s = nanscan.summarize(torch.tensor([NAN, 1.0]), backend="reference")
    inc = nanscan.Incident(step=1, phase="backward", name="fc.weight", kind="grad", produced=True, summary=s)
    with log.EventLog(path) as ev:
        assert ev.path == path and ev.rank == 0
        ev.step(0, loss=2.5, grad_norm=1.0, loss_scale=65536.0, lr=1e-3, update="applied",
                nonfinite={"forward": 0})
        ev.step(1, loss=NAN, grad_norm=INF, loss_scale=32768.0, lr=1e-3, update="skipped",
                nonfinite={"backward": 3}, extra=torch.tensor([NAN, 1.0]))
        assert syncs == []
        ev.incident(inc, bundle=tmp_path / "b")
        assert len(syncs) == 1
        ev.event("note", text="multi\nline")
        assert len(syncs) == 1
        ev.event("exception", step=1, fsync=True, error_type="NonFiniteError")
        assert len(syncs) == 2
    lines = read_strict_lines(path)
    assert [e["type"] for e in lines] == ["header", "step", "step", "incident", "note", "exception"]
    header = lines[0]
    assert set(header) == {"type", "nanscan", "rank", "time", "pid"}
    assert header["nanscan"] == nanscan.__version__ and header["pid"] == os.getpid() and header["rank"] == 0
    datetime.datetime.fromisoformat(header["time"])
    for e in lines[1:]:
        assert {"type", "step", "rank", "time"} <= set(e) and e["rank"] == 0
    assert lines[1]["update"] == "applied" and lines[1]["nonfinite"] == {"forward": 0}
    assert lines[2]["loss"] == {"finite": False, "value": "nan"}
    assert lines[2]["grad_norm"] == {"finite": False, "value": "inf"}
    assert lines[3]["step"] == 1 and lines[3]["bundle"] == str(tmp_path / "b")
    assert lines[3]["incident"] == inc.to_dict()
    assert lines[4]["step"] is None and lines[4]["text"] == "multi\nline"
    assert lines[5]["step"] == 1 and "fsync" not in lines[5]
    events = log.read_events(path)
    assert math.isnan(events[2]["loss"]) and events[2]["grad_norm"] == INF
    assert same(events[2]["extra"], [NAN, 1.0]) and events[2]["update"] == "skipped"
    assert events[3]["incident"]["summary"]["nan_count"] == 1 and events[3]["incident"]["summary"]["finite_max"] == 1.0


def test_event_log_appends_and_validates(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"user": "line"}\n')
    with log.EventLog(path) as ev:
        ev.step(0, loss=1.0)
        with pytest.raises(ValueError, match="reserved"):
            ev.step(1, rank=3)
        with pytest.raises(ValueError, match="reserved"):
            ev.event("incident")
        with pytest.raises(TypeError, match="Opaque"):
            ev.step(2, loss=type("Opaque", (), {})())
    with log.EventLog(path) as ev:
        ev.step(1, loss=2.0)
    with pytest.raises(ValueError, match="closed"):
        ev.step(2)
    lines = read_strict_lines(path)
    assert lines[0] == {"user": "line"}
    assert [e["type"] for e in lines[1:]] == ["header", "step", "header", "step"]
    assert [e["step"] for e in lines if e.get("type") == "step"] == [0, 1]


def test_event_log_rank_files(tmp_path):
    ev = log.EventLog(tmp_path / "events.jsonl", rank=2)
    ev.step(0, loss=1.0)
    ev.close()
    ev.close()  # idempotent
    assert ev.path == tmp_path / "events.rank2.jsonl" and ev.rank == 2
    assert [e["rank"] for e in log.read_events(ev.path)] == [2, 2]
    with log.EventLog(tmp_path / "plain", rank=1) as other:
        assert other.path == tmp_path / "plain.rank1.jsonl"


def test_a_log_under_a_file_names_that_file(tmp_path):
    # mkdir's own error named only the directory it tried to make: "File exists: '.../notes.txt'"
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    for path in (notes / "events.jsonl", notes / "deeper" / "events.jsonl"):
        with pytest.raises(NotADirectoryError) as error:
            log.EventLog(path)
        assert str(error.value) == (f"nanscan EventLog: cannot create {path}: {notes} is a file, not a directory; "
                                    "give a path under a directory (missing directories are created)")
    assert notes.read_text() == "x"


def test_a_log_at_a_directory_asks_for_a_file_name(tmp_path):
    with pytest.raises(IsADirectoryError) as error:
        log.EventLog(tmp_path)
    assert str(error.value) == (f"nanscan EventLog: {tmp_path} is a directory; give a file path "
                                f"(such as {tmp_path / 'events.jsonl'})")


def test_watch_with_a_log_under_a_file_warns_naming_it_and_trains_on(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    model = torch.nn.Linear(3, 1)
    with pytest.warns(RuntimeWarning, match=rf"could not be written.*{notes} is a file, not a directory"):
        mon = nanscan.watch(model, log=str(notes / "events.jsonl"))
    with mon:
        model(torch.ones(2, 3)).sum().backward()
    assert notes.read_text() == "x"


def test_write_errors_are_raised(tmp_path, monkeypatch):
    ev = log.EventLog(tmp_path / "e.jsonl")

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        ev.incident({"step": 4, "phase": "loss"})
    monkeypatch.undo()
    ev.close()


def test_read_events_truncated_and_bad_lines(tmp_path):
    path = tmp_path / "e.jsonl"
    with log.EventLog(path) as ev:
        ev.step(0, loss=NAN)
    with open(path, "a") as f:
        f.write('{"type": "step", "step": 1, "lo')          # crash mid-write
    with pytest.warns(UserWarning, match=r"e.jsonl:3: skipping a truncated"):
        events = log.read_events(path)
    assert [e["type"] for e in events] == ["header", "step"] and math.isnan(events[1]["loss"])

    with log.EventLog(path) as ev:   # a restarted run appends after the torn line
        ev.step(1, loss=1.0)
    with pytest.warns(UserWarning, match="truncated"):
        events = log.read_events(path)
    assert [(e["type"], e.get("step")) for e in events] == [("header", None), ("step", 0),
                                                            ("header", None), ("step", 1)]
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and lines[2].endswith('"lo')   # the torn line was terminated, not merged
    assert [strict(line)["type"] for i, line in enumerate(lines) if i != 2] == ["header", "step", "header", "step"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header"}\n\nnot json\n{"type": "step", "step": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        log.read_events(bad)
    bad.write_text('{"type": "header"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: an event line must be a JSON object"):
        log.read_events(bad)


def test_one_json_format_for_log_record_and_report(tmp_path):
    """nanscan.jsonl is the one home of the format: the log, records and the report agree on
    markers, torn lines and odd input (each case failed somewhere before)."""
    from nanscan import jsonl, report
    from nanscan.record import json_float

    assert json_float is jsonl.encode_float
    # a marker needs exactly its two keys and one of the three strings; anything else is data
    assert log.loads('{"finite": false, "value": []}') == {"finite": False, "value": []}
    assert report.loads('{"finite": false, "value": "nan", "x": 1}') == {"finite": False, "value": "nan", "x": 1}
    assert math.isnan(report.loads('{"finite": false, "value": "nan"}'))
    with pytest.raises(ValueError, match="nested too deeply"):
        log.loads("[" * 100000)
    # a raw U+2028 inside a string is part of its line, for both readers
    path = tmp_path / "events.jsonl"
    line = json.dumps({"type": "step", "step": 0, "rank": 0, "note": "a\u2028b"}, ensure_ascii=False)
    path.write_text('{"type": "header", "rank": 0}\n' + line + "\n" + '{"type": "step", "st', encoding="utf-8")
    with pytest.warns(UserWarning, match="truncated"):
        events = log.read_events(path)
    assert [e.get("note") for e in events] == [None, "a\u2028b"]
    parsed = report.load_events(str(path))
    assert parsed[1]["note"] == "a\u2028b" and parsed[2]["type"] == "unparsed" and parsed[2]["torn"]
    assert "last line 3 is truncated" in report.text_report(str(path))


def test_tensors_without_values_and_deep_nesting_are_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="nested tensor"):
        log.dumps(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged))
    for dtype in [d for d in (getattr(torch, n, None) for n in ("bits8", "uint1", "int4")) if d is not None]:
        with pytest.raises(TypeError, match=f"dtype {dtype}"):
            log.dumps(torch.zeros(4, dtype=dtype))
    deep: list = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(ValueError, match="nested too deeply"):
        log.dumps(deep)
    # large tensors are summarized by the kernels (one pass, no copy), not the reference's temporaries
    from nanscan.kernels import reference

    def refuse(*args, **kwargs):
        raise AssertionError("the reference was used")

    monkeypatch.setattr(reference, "summarize", refuse)
    assert log.loads(log.dumps(torch.ones(1000)))["numel"] == 1000


# What TensorSummary.to_dict() wrote before the record had sum / sum4 (no sum, sum4, mean, kurtosis,
# sum4_overflowed): logs and bundles written then must keep reading.
EARLIER_SUMMARY = {"dtype": "float32", "shape": [4, 8], "numel": 32, "nan_count": 3, "posinf_count": 0,
                   "neginf_count": 1, "zero_count": 2, "finite_min": -1.5, "finite_max": 2.0, "sumsq": 11.25,
                   "first_nonfinite_index": 5, "nonfinite_count": 4, "finite_count": 28, "is_finite": False,
                   "absmax": 2.0, "l2_norm": 3.3541019662496847, "sumsq_overflowed": False}


def test_a_log_written_with_the_earlier_summary_format_still_reads(tmp_path):
    from nanscan import report

    incident = {"step": 1, "phase": "forward", "name": "fc", "kind": "activation", "produced": True, "rank": 0,
                "summary": EARLIER_SUMMARY}
    path = tmp_path / "events.jsonl"
    lines = [{"type": "header", "nanscan": "0.1.0", "rank": 0, "time": "2024-01-02T03:04:05", "pid": 1},
             {"type": "step", "step": 0, "rank": 0, "time": "2024-01-02T03:04:06", "loss": 2.5},
             {"type": "step", "step": 1, "rank": 0, "time": "2024-01-02T03:04:07",
              "loss": {"finite": False, "value": "nan"}, "nonfinite": {"forward": 4}},
             {"type": "incident", "step": 1, "rank": 0, "time": "2024-01-02T03:04:07", "incident": incident,
              "bundle": None}]
    path.write_text("".join(json.dumps(e, allow_nan=False) + "\n" for e in lines))
    events = log.read_events(path)
    assert events[3]["incident"]["summary"] == EARLIER_SUMMARY
    text = report.text_report(str(path))
    assert "non-finite output of module 'fc' at step 1" in text and "3 NaN, 0 +Inf, 1 -Inf of 32" in text
    json.loads(report.to_json(report.summarize_run(str(path))))

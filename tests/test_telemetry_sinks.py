"""nanscan.telemetry: the NaN rule, the publisher, and each sink with the real package behind it.

What each tracker received is read back from what it stored -- TensorBoard's event files with
tensorboard's EventAccumulator, an offline W&B run from its run directory (the ``.wandb`` record
file, decoded with wandb's own protobuf classes), MLflow's local store with its client, the JSONL
log with nanscan's reader -- never from a mock. W&B and MLflow tests skip only where the package is
not installed (the Makefile installs both); tensorboard is a test dependency and does not skip."""
import glob
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

from nanscan import log as nlog
from nanscan.telemetry import (JSONL, MLflow, Publisher, Sink, TensorBoard, WandB, finite_scalars, mlflow_key,
                               nonfinite_name, scalar_name)

NAN, INF = float("nan"), float("inf")

# Three steps of a run whose loss breaks at step 2 and one module's stats go non-finite.
STEPS = {
    0: {"nanscan/loss": 2.5, "nanscan/rms/fc1": 0.75, "nanscan/maxabs/fc1": 3.0, "nanscan/grad_norm": None},
    1: {"nanscan/loss": 2.25, "nanscan/rms/fc1": INF, "nanscan/maxabs/fc1": 4.0, "nanscan/grad_norm": 1.5},
    2: {"nanscan/loss": NAN, "nanscan/rms/fc1": NAN, "nanscan/maxabs/fc1": -INF, "nanscan/grad_norm": 2.0},
}
# What every tracker must hold afterwards: name -> {step: value}.
EXPECTED = {
    "nanscan/loss": {0: 2.5, 1: 2.25},
    "nanscan/loss_nonfinite": {2: 1.0},
    "nanscan/rms/fc1": {0: 0.75},
    "nanscan/rms/fc1_nonfinite": {1: 1.0, 2: 1.0},
    "nanscan/maxabs/fc1": {0: 3.0, 1: 4.0},
    "nanscan/maxabs/fc1_nonfinite": {2: 1.0},
    "nanscan/grad_norm": {1: 1.5, 2: 2.0},
}


def publish_all(sink) -> None:
    with Publisher(sink) as pub:
        for step, scalars in STEPS.items():
            pub.publish(step, scalars)
        assert pub.dropped == [], pub.dropped


def assert_received(got: dict, expected: dict = EXPECTED) -> None:
    """``got``: name -> {step: value} as read back. Every value finite, exactly the expected points."""
    for name, points in got.items():
        for step, value in points.items():
            assert math.isfinite(value), f"{name} at step {step}: {value} reached the tracker"
    assert got == expected


# --- the NaN rule -----------------------------------------------------------------------------

def test_every_nonfinite_value_becomes_a_nonfinite_point_and_is_never_sent():
    got = finite_scalars({"nanscan/loss": NAN, "a": INF, "b": -INF, "c": 1, "d": None, "e": True, "f": 0.5})
    assert got == {"c": 1.0, "e": 1.0, "f": 0.5, "nanscan/loss_nonfinite": 1.0, "a_nonfinite": 1.0,
                   "b_nonfinite": 1.0}
    assert all(type(v) is float for v in got.values())
    assert nonfinite_name("nanscan/loss") == "nanscan/loss_nonfinite"


def test_numpy_scalars_and_huge_ints_follow_the_rule():
    got = finite_scalars({"a": np.float32(1.5), "b": np.float16("nan"), "c": np.int64(3), "d": np.bool_(True),
                          "e": 10 ** 400, "f": np.float64("-inf")})
    assert got == {"a": 1.5, "c": 3.0, "d": 1.0, "b_nonfinite": 1.0, "e_nonfinite": 1.0, "f_nonfinite": 1.0}


def test_the_rule_wins_over_a_stale_nonfinite_value_the_caller_passed():
    assert finite_scalars({"x_nonfinite": 0.0, "x": NAN}) == {"x_nonfinite": 1.0}
    assert finite_scalars({"x_nonfinite": NAN}) == {"x_nonfinite_nonfinite": 1.0}


def test_tensors_are_refused_so_telemetry_never_waits_for_the_device():
    with pytest.raises(TypeError, match=r"tensor.*item\(\)"):
        finite_scalars({"nanscan/loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="tensor"):
        Publisher(lambda step, scalars: None).publish(torch.tensor(3), {"a": 1.0})


@pytest.mark.parametrize("scalars, match", [
    ({"a": "1.0"}, "real number"), ({"a": 1 + 2j}, "real number"), ({"a": np.ones(1)}, "real number"),
    ({"a": [1.0]}, "real number"), ({1: 1.0}, "non-empty str"), ({"": 1.0}, "non-empty str"),
    ([("a", 1.0)], "mapping"),
])
def test_bad_scalars_are_a_type_error(scalars, match):
    with pytest.raises(TypeError, match=match):
        Publisher(lambda step, s: None).publish(0, scalars)


@pytest.mark.parametrize("step, error", [(True, TypeError), (1.0, TypeError), ("3", TypeError), (-1, ValueError)])
def test_bad_steps_are_refused(step, error):
    with pytest.raises(error, match="step"):
        Publisher(lambda s, x: None).publish(step, {"a": 1.0})
    assert Publisher(lambda s, x: None).publish(np.int64(4), {"a": 1.0}) == {"a": 1.0}


def test_scalar_names():
    assert scalar_name("rms", "blocks.0.mlp.fc1") == "nanscan/rms/blocks.0.mlp.fc1"
    assert scalar_name("loss") == "nanscan/loss"
    for bad in ("", "a/b", None):
        with pytest.raises(ValueError, match="stat"):
            scalar_name(bad, "x")
    with pytest.raises(ValueError, match="name"):
        scalar_name("rms", "")


# --- the publisher ----------------------------------------------------------------------------

def test_callables_receive_only_finite_points_each_in_its_own_dict():
    got_a, got_b = {}, {}

    def a(step, scalars):
        for k, v in scalars.items():
            got_a.setdefault(k, {})[step] = v
        scalars.clear()  # (a sink that mutates its dict must not starve the next one)

    def b(step, scalars):
        for k, v in scalars.items():
            got_b.setdefault(k, {})[step] = v

    publish_all([a, b])
    assert_received(got_a)
    assert_received(got_b)


def test_a_raising_sink_is_warned_once_and_dropped_while_the_others_keep_receiving():
    calls, got = [], {}

    def broken(step, scalars):
        calls.append(step)
        raise ConnectionError("tracker unreachable")

    def good(step, scalars):
        for k, v in scalars.items():
            got.setdefault(k, {})[step] = v

    pub = Publisher([broken, good])
    with pytest.warns(RuntimeWarning) as record:
        for step, scalars in STEPS.items():
            pub.publish(step, scalars)
    ours = [w for w in record if "nanscan.telemetry" in str(w.message)]
    assert ours[0].filename == __file__  # (the warning points at the publish call)
    messages = [str(w.message) for w in ours]
    assert len(messages) == 1 and "ConnectionError: tracker unreachable" in messages[0] and "dropped" in messages[0]
    assert "broken" in messages[0]
    assert calls == [0]
    assert pub.sinks == (good,) and [type(e) for _, e in pub.dropped] == [ConnectionError]
    assert_received(got)


def test_warnings_as_errors_cannot_turn_a_dropped_sink_into_a_crash(capsys):
    def broken(step, scalars):
        raise RuntimeError("boom")

    pub = Publisher(broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under python -W error
        assert pub.publish(0, {"a": 1.0}) == {"a": 1.0}
    assert "dropped" in capsys.readouterr().err


def test_keyboard_interrupt_is_not_swallowed():
    def interrupted(step, scalars):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Publisher(interrupted).publish(0, {"a": 1.0})


def test_close_closes_every_sink_warns_on_failure_and_publish_after_close_sends_nothing():
    closed = []

    class Recorder(Sink):
        def __init__(self, name, fail_close=False, fail_write=False):
            self.name, self.fail_close, self.fail_write = name, fail_close, fail_write

        def write(self, step, points):
            if self.fail_write:
                raise OSError("disk full")

        def close(self):
            closed.append(self.name)
            if self.fail_close:
                raise OSError("cannot close")

    pub = Publisher([Recorder("ok"), Recorder("bad close", fail_close=True), Recorder("bad write", fail_write=True)])
    with pytest.warns(RuntimeWarning, match="disk full"):
        pub.publish(0, {"a": 1.0})
    with pytest.warns(RuntimeWarning, match="closing sink .* failed: OSError: cannot close"):
        pub.close()
    assert closed == ["ok", "bad close", "bad write"]  # the dropped sink is closed too
    pub.close()  # idempotent
    assert closed == ["ok", "bad close", "bad write"]
    with pytest.warns(RuntimeWarning, match="publish after close"):
        assert pub.publish(1, {"a": 1.0}) == {}


def test_nothing_is_sent_when_no_point_is_left():
    calls = []
    pub = Publisher(lambda step, scalars: calls.append(step))
    assert pub.publish(0, {"a": None}) == {}
    assert pub.publish(1, {}) == {}
    assert calls == []


class _Writer:  # has add_scalar: a SummaryWriter-like object that is not a sink by itself
    def add_scalar(self, *a, **k):
        pass


@pytest.mark.parametrize("sinks, match", [
    (None, "no sink"),
    ("runs/x", "A path is not a sink: JSONL"),
    (["runs/x"], "A path is not a sink"),
    (3, "a sink is a callable"),
    (TensorBoard, "is a class; pass an instance"),
    (lambda scalars: None, r"cannot be called as fn\(step, scalars\)"),
    (lambda step, scalars, extra: None, r"cannot be called as fn\(step, scalars\)"),
    (_Writer(), r"TensorBoard\(writer\)"),
])
def test_bad_sink_arguments_say_what_would_work(sinks, match):
    with pytest.raises(TypeError, match=match):
        Publisher(sinks)


def test_the_same_sink_twice_is_refused():
    def fn(step, scalars):
        pass

    with pytest.raises(ValueError, match="twice"):
        Publisher([fn, fn])


def test_an_event_log_is_not_a_sink_by_itself(tmp_path):
    with nlog.EventLog(tmp_path / "e.jsonl") as event_log, pytest.raises(TypeError, match=r"JSONL\(log\)"):
        Publisher(event_log)


@pytest.mark.parametrize("make, match", [
    (lambda: TensorBoard(123), "log directory"), (lambda: TensorBoard(""), "log directory"),
    (lambda: JSONL(123), "file path"), (lambda: JSONL(""), "file path"),
])
def test_bad_sink_constructor_arguments(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_jsonl_under_a_file_names_that_file_when_made(tmp_path):
    # The sink's EventLog is opened when the sink is made: the error comes before training starts,
    # and it names the file in the way (mkdir's own error read "File exists: '.../notes.txt'").
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"^nanscan EventLog: cannot create .*: "
                                                 rf"{re.escape(str(notes))} is a file, not a directory; "
                                                 r"give a path under a directory"):
        JSONL(notes / "sub.jsonl")
    assert notes.read_text() == "x"


# --- TensorBoard ------------------------------------------------------------------------------

def read_tensorboard(log_dir) -> dict:
    """name -> {step: value} of every scalar in the event files, with tensorboard's own reader
    (float64 tensor summaries included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:
        got[tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
    return got


def test_tensorboard_from_a_log_dir_reads_back_every_finite_point_and_no_nan(tmp_path):
    sink = TensorBoard(tmp_path / "tb")
    publish_all(sink)
    with pytest.raises(ValueError, match="closed"):  # (no new event file behind a closed sink)
        sink(3, {"nanscan/loss": 1.0})
    assert len(os.listdir(tmp_path / "tb")) == 1
    assert_received(read_tensorboard(tmp_path / "tb"))


def test_tensorboard_flushes_each_publish_so_a_crash_keeps_the_last_steps(tmp_path):
    sink = TensorBoard(tmp_path / "tb")
    pub = Publisher(sink)
    pub.publish(7, {"nanscan/loss": 1.25, "nanscan/rms/fc1": NAN})
    # read back before close, as after a crash
    assert read_tensorboard(tmp_path / "tb") == {"nanscan/loss": {7: 1.25}, "nanscan/rms/fc1_nonfinite": {7: 1.0}}
    pub.close()


def test_tensorboard_with_a_caller_writer_leaves_it_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    publish_all(TensorBoard(writer))
    writer.add_scalar("mine", 1.0, 3)  # still open: the sink did not close it
    writer.close()
    got = read_tensorboard(tmp_path / "tb")
    assert got.pop("mine") == {3: 1.0}
    assert_received(got)


def test_tensorboard_never_writes_a_value_that_float32_would_make_inf(tmp_path):
    sink = TensorBoard(tmp_path / "tb")
    pub = Publisher(sink)
    with pytest.warns(RuntimeWarning, match="beyond float32's range.*double_precision=True") as record:
        pub.publish(0, {"big": 1e39, "ok": 1.0})
        pub.publish(1, {"big": -1e300, "ok": 2.0})
    assert [w.filename for w in record if "float32" in str(w.message)] == [__file__]  # once, at the publish call
    pub.close()
    assert read_tensorboard(tmp_path / "tb") == {"ok": {0: 1.0, 1: 2.0}}

    with Publisher(TensorBoard(tmp_path / "tb64", double_precision=True)) as pub:
        pub.publish(0, {"big": 1e39, "small": 0.1, "bad": NAN})
    # float64 tensor summaries: exact, and still no NaN
    assert read_tensorboard(tmp_path / "tb64") == {"big": {0: 1e39}, "small": {0: 0.1}, "bad_nonfinite": {0: 1.0}}


# --- JSONL ------------------------------------------------------------------------------------

def _strict(text):
    def refuse(token):
        raise AssertionError(f"non-strict JSON token {token!r}")

    return json.loads(text, parse_constant=refuse)


def test_jsonl_appends_one_strict_line_per_publish_and_keeps_the_existing_file(tmp_path):
    path = tmp_path / "events.jsonl"
    before = '{"type": "header", "nanscan": "0.0.9", "rank": 0, "time": "t", "pid": 1}\n'
    path.write_text(before)
    publish_all(JSONL(path))
    text = path.read_text()
    assert text.startswith(before)
    lines = [_strict(line) for line in text.splitlines()]
    telemetry = [e for e in lines if e["type"] == "telemetry"]
    assert [e["step"] for e in telemetry] == [0, 1, 2]
    assert all(set(e) == {"type", "step", "rank", "time", "scalars"} for e in telemetry)
    got = {}
    for e in nlog.read_events(path):
        if e["type"] == "telemetry":
            for k, v in e["scalars"].items():
                got.setdefault(k, {})[e["step"]] = v
    assert_received(got)


def test_jsonl_on_a_callers_event_log_shares_it_and_leaves_it_open(tmp_path):
    event_log = nlog.EventLog(tmp_path / "events.jsonl")
    publish_all(JSONL(event_log))
    event_log.step(3, loss=1.0)  # still open
    event_log.close()
    kinds = [e["type"] for e in nlog.read_events(tmp_path / "events.jsonl")]
    assert kinds == ["header", "telemetry", "telemetry", "telemetry", "step"]


# --- W&B --------------------------------------------------------------------------------------

def _wandb_records(path) -> list:
    """The ``wandb_internal_pb2.Record`` messages of a ``.wandb`` file: W&B's record log (7-byte header
    ``:W&B`` + magic + version, then 32 KiB blocks of records, each with a 7-byte header: crc32,
    length, type FULL/FIRST/MIDDLE/LAST) -- the file ``wandb sync`` uploads."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # (a block's tail too short for a header is padding)
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # (end, or a record still being written)
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_wandb_history(wandb_dir, timeout: float = 60.0) -> list:
    """The history rows of the one offline run under ``wandb_dir``, decoded from its ``.wandb`` file
    with W&B's own protobuf classes. Rows: ``{key: value}``, values JSON-decoded (a NaN would decode
    as nan and fail the test). ``run.finish()`` can return before W&B's service process has written
    the file (seen with wandb 0.31 offline: a header-only file for a moment), so this waits for the
    run's ``exit`` record."""
    files = glob.glob(os.path.join(str(wandb_dir), "**", "offline-run-*", "run-*.wandb"), recursive=True)
    assert len(files) == 1, files
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(files[0])
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), f"{files[0]}: no exit record in {timeout}s"
    return [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_holds_every_finite_point_and_no_nan(wandb_offline, tmp_path):
    wandb = wandb_offline
    run = wandb.init(project="nanscan-test", dir=str(tmp_path / "wandb"), mode="offline")
    sink = WandB()  # wandb.run
    assert sink.run is run
    publish_all(sink)
    run.finish()
    got = {}
    for row in read_wandb_history(tmp_path / "wandb"):
        for key, value in row.items():
            if not key.startswith("_"):  # (W&B's own _step, _runtime, _timestamp)
                got.setdefault(key, {})[row["_step"]] = value
    assert_received(got)


def test_wandb_step_metric_charts_against_nanscans_step(wandb_offline, tmp_path):
    wandb = wandb_offline
    run = wandb.init(project="nanscan-test", dir=str(tmp_path / "wandb"), mode="offline")
    run.log({"user/loss": 1.0})  # the user's own logging advances W&B's step on its own
    run.log({"user/loss": 0.5})
    with Publisher(WandB(run, step_metric="nanscan/step")) as pub:
        pub.publish(0, {"nanscan/loss": 2.5, "nanscan/rms/fc1": NAN})
    run.finish()
    rows = [r for r in read_wandb_history(tmp_path / "wandb") if "nanscan/step" in r]
    assert len(rows) == 1
    assert {k: v for k, v in rows[0].items() if not k.startswith("_")} == {
        "nanscan/step": 0, "nanscan/loss": 2.5, "nanscan/rms/fc1_nonfinite": 1.0}


def test_wandb_without_a_run_names_wandb_init(wandb_offline):
    assert wandb_offline.run is None
    with pytest.raises(RuntimeError, match=r"wandb\.init"):
        WandB()
    with pytest.raises(TypeError, match="W&B run"):
        WandB(run=object())


# --- MLflow -----------------------------------------------------------------------------------

def read_mlflow(client, run_id) -> dict:
    got = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            got.setdefault(key, {})[m.step] = m.value
    return got


def test_mlflow_active_run_holds_every_finite_point_and_no_nan(mlflow_store):
    mlflow, uri = mlflow_store
    with mlflow.start_run() as run:
        sink = MLflow()
        assert sink.run_id == run.info.run_id
        publish_all(sink)
    assert_received(read_mlflow(mlflow.MlflowClient(uri), run.info.run_id))


def test_mlflow_by_run_id_maps_names_it_would_refuse_and_batches_over_1000(mlflow_store):
    mlflow, uri = mlflow_store
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("nanscan")).info.run_id
    scalars = {f"nanscan/rms/m{i}": float(i) for i in range(1200)}
    scalars.update({"nanscan/rms/a[0]": 1.0, "nanscan/rms/": 2.0, "nanscan/rms/b": NAN})
    with Publisher(MLflow(run_id=run_id, tracking_uri=uri)) as pub:
        pub.publish(5, scalars)
    metrics = client.get_run(run_id).data.metrics
    assert len(metrics) == 1203
    assert metrics["nanscan/rms/a_0_"] == 1.0 and metrics["nanscan/rms/_"] == 2.0
    assert metrics["nanscan/rms/b_nonfinite"] == 1.0 and "nanscan/rms/b" not in metrics
    assert all(math.isfinite(v) for v in metrics.values())
    assert mlflow_key("nanscan/rms/blocks.0.mlp.fc1") == "nanscan/rms/blocks.0.mlp.fc1"
    assert len(mlflow_key("x" * 400)) <= 250


def test_mlflow_keys_that_clash_keep_the_first_with_one_warning(mlflow_store):
    mlflow, uri = mlflow_store
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("nanscan")).info.run_id
    with Publisher(MLflow(run_id=run_id)) as pub, pytest.warns(RuntimeWarning, match="both 'a_b' as MLflow keys") as w:
        pub.publish(0, {"a[b": 1.0, "a]b": 2.0})
    assert [r.filename for r in w if "MLflow keys" in str(r.message)] == [__file__]
    assert client.get_run(run_id).data.metrics == {"a_b": 1.0}


def test_mlflow_without_a_run_names_start_run_and_an_unknown_run_fails_at_once(mlflow_store):
    with pytest.raises(RuntimeError, match=r"mlflow\.start_run"):
        MLflow()
    with pytest.raises(Exception, match="nope"):
        MLflow(run_id="nope")
    with pytest.raises(TypeError, match="run_id"):
        MLflow(run_id=5)


# --- optional packages ------------------------------------------------------------------------

@pytest.mark.parametrize("module, make, package", [
    ("torch.utils.tensorboard", lambda tmp: TensorBoard(tmp / "tb"), "tensorboard"),
    ("wandb", lambda tmp: WandB(), "wandb"),
    ("mlflow", lambda tmp: MLflow(), "mlflow"),
])
def test_a_missing_package_is_an_import_error_naming_it(module, make, package, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` now raises ImportError
    with pytest.raises(ImportError, match=rf"needs the '{package}' package.*pip install {package}"):
        make(tmp_path)


def test_a_writer_needs_no_tensorboard_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    got = []

    class Writer:
        def add_scalar(self, tag, value, step):
            got.append((tag, value, step))

    Publisher(TensorBoard(Writer())).publish(3, {"a": 1.0, "b": INF})
    assert got == [("a", 1.0, 3), ("b_nonfinite", 1.0, 3)]


def test_importing_telemetry_imports_no_tracker():
    code = ("import sys, nanscan.telemetry; "
            "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'wandb', 'mlflow') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

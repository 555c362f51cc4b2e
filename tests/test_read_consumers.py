"""The read as one pipeline: every consumer walks a read through ``Read.runs`` (one row iterator), the
consumers sit in one list in ``Outcomes`` and the step log hands completed steps to its listeners
(telemetry, spikes). A failure of any of them is nanscan's own: warned once, that part turned off,
the others and the incidents go on."""
import json
import math
import warnings

import pytest
import torch
from torch import nn

import nanscan
from nanscan.monitor.consumers import ReadConsumer, StepListener
from nanscan.monitor.headroom import HeadroomWatch
from nanscan.monitor.health import Health
from nanscan.monitor.slots import Block, EagerRows, Slot
from nanscan.monitor.spikes import SpikePolicy, SpikeWatch
from nanscan.monitor.steplog import StepLog

NAN_STEP = 7


class Plant(nn.Module):
    """A NaN in its output at step ``NAN_STEP`` (the loss goes NaN with it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * math.nan if self.calls - 1 == NAN_STEP else x * 1.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Plant(), nn.Linear(8, 1))


class Keep(ReadConsumer):
    what = "the test's reads"

    def __init__(self):
        self.reads = []

    def observe(self, read):
        self.reads.append(read)


def _train(tmp_path, steps=10, extra=None, **options):
    """A plain loop (the loss outside the model) with every consumer on; returns the monitor, the
    telemetry points (step -> scalars), the log's step lines and the warnings."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    points, log = {}, tmp_path / "events.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanscan.watch(model, opt, on_nonfinite="record", log=str(log), headroom_bits=4.0,
                           spikes=SpikePolicy(warmup=3), telemetry=lambda step, s: points.__setitem__(step, s),
                           telemetry_every=1, **options) as mon:
            if extra is not None:
                mon.outcomes.consumers.append(extra)
            for _ in range(steps):
                opt.zero_grad()
                loss = model(torch.randn(16, 4)).pow(2).mean()
                loss.backward()
                opt.step()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps_logged = [e["step"] for e in lines if e.get("type") == "step"]
    return mon, points, steps_logged, [w for w in caught if "turned off" in str(w.message)]


def test_runs_cover_every_row_once_in_order_and_name_its_source(tmp_path):
    keep = Keep()
    _train(tmp_path, steps=4, extra=keep)
    assert keep.reads
    kinds = set()
    for read in keep.reads:
        runs = read.runs()
        assert runs is read.runs()  # (made once per read)
        assert [start for start, _, _ in runs] == [0] + [end for _, end, _ in runs[:-1]]
        assert runs[-1][1] == len(read.slots)
        for start, end, source in runs:
            assert all(read.slots[i] is source for i in range(start, end))
            if type(source) is Slot:
                assert end == start + 1
            else:
                assert isinstance(source, Block)
                if type(source) is not EagerRows:  # (a block's rows are one run, at its own offsets)
                    assert start == source.start
            kinds.add(type(source).__name__)
    # the hooks' rows, the gradients of module outputs, parameters / gradients, the loss read at backward
    assert {"EagerRows", "GradBlock", "Block", "Slot"} <= kinds


def test_a_rows_record_and_column_are_the_host_rows_values_whether_or_not_they_were_converted(tmp_path):
    keep = Keep()
    _train(tmp_path, steps=3, extra=keep)
    checked = 0
    for read in keep.reads:
        if read.host is None or not read.eager_count:
            continue
        n = read.eager_count
        fresh = [read.record(i) for i in range(n)], read.column(0, n, 7)  # (before any conversion)
        read._host_rows = None
        rows = read.host_rows()
        assert fresh == (rows, [r[7] for r in rows])
        assert [read.record(i) for i in range(n)] == rows and read.column(1, n, 7) == [r[7] for r in rows[1:]]
        checked += 1
    assert checked


def test_the_step_log_alone_converts_no_read_whole(tmp_path, monkeypatch):
    # the losses, the non-finite rows and the gradients' sums of squares only: not every row of a read
    from nanscan.monitor.read import Read
    converted = []
    host_rows = Read.host_rows
    monkeypatch.setattr(Read, "host_rows", lambda self: converted.append(self.step) or host_rows(self))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "events.jsonl"
    with nanscan.watch(model, opt, on_nonfinite="record", log=str(log)):
        for _ in range(NAN_STEP + 2):
            opt.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
    steps = [e for e in map(json.loads, log.read_text().splitlines()) if e.get("type") == "step"]
    assert converted == [] and len(steps) == NAN_STEP + 2
    assert all(math.isfinite(e["grad_norm"]) and e["grad_norm"] > 0 for e in steps[:NAN_STEP])
    assert steps[NAN_STEP]["loss"] == {"finite": False, "value": "nan"} and steps[NAN_STEP]["nonfinite"]["loss"] == 1


def test_the_consumers_are_in_one_list_in_order(tmp_path):
    mon, points, logged, failures = _train(tmp_path, steps=2)
    assert [type(c) for c in mon.outcomes.consumers] == [StepLog, HeadroomWatch, Health, SpikeWatch]
    assert [type(listener) for listener in mon.steplog.listeners] == [SpikeWatch, Health]
    assert not failures


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.parametrize("part, method, what", [
    (HeadroomWatch, "observe", "the headroom check"),
    (Health, "observe", "telemetry"),
    (SpikeWatch, "observe", "the spike warnings"),
    (StepLog, "observe", "the step log"),
    (Health, "completed", "telemetry"),
    (SpikeWatch, "completed", "the spike warnings"),
])
def test_a_failing_part_is_warned_once_turned_off_and_the_rest_goes_on(tmp_path, monkeypatch, part, method, what):
    monkeypatch.setattr(part, method, _boom)
    mon, points, logged, failures = _train(tmp_path)
    assert len(failures) == 1, [str(w.message) for w in failures]
    assert f"nanscan: {what}" in str(failures[0].message) and "boom" in str(failures[0].message)
    # the incidents do not depend on any consumer
    assert mon.incident is not None and mon.incident.step == NAN_STEP and mon.incident.name == "2"
    on = [c for c in mon.outcomes.consumers if not c.off]
    assert not any(isinstance(c, part) for c in on)
    if part is StepLog:  # the parts it feeds are off with it: their steps would miss what it failed to fold
        assert logged == [] and points == {}
        assert all(listener.off for listener in mon.steplog.listeners)
        return
    assert logged == list(range(10))  # the step log wrote every step
    if part is Health:
        assert points == {}  # (it failed at its first read / step)
    else:
        assert sorted(points) == list(range(10))  # telemetry published every step
    if part is HeadroomWatch:
        assert mon.headroom is None and mon.headroom_events == []


def test_a_spike_found_by_one_listener_reaches_the_log_and_the_other(tmp_path):
    class Spiky(StepListener):
        """A listener that finds an event at step 2."""

        what = "the test's events"

        def completed(self, done):
            return [_Event(done.step)] if done.step == 2 else []

    class _Event:
        LOG_TYPE = "test"

        def __init__(self, step):
            self.step = step

        def to_dict(self):
            return {"step": self.step, "value": 1.5}

        def telemetry(self):
            return {"nanscan/test/value": 1.5}

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    points, log = {}, tmp_path / "events.jsonl"
    with nanscan.watch(model, opt, log=str(log), telemetry=lambda step, s: points.setdefault(step, {}).update(s),
                       telemetry_every=1) as mon:
        mon.steplog.listeners.insert(0, Spiky())
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (line,) = [e for e in events if e.get("type") == "test"]
    assert line["step"] == 2 and line["value"] == 1.5
    assert points[2]["nanscan/test/value"] == 1.5 and "nanscan/test/value" not in points[1]

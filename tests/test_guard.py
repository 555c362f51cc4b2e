"""nanscan.guard keeps the original exception; the monitor's event log is strict JSON."""
import json
import os
import stat
import traceback

import pytest
import torch
from torch import nn

import nanscan
from nanscan.log import read_events


def no_constants(name):
    raise AssertionError(f"non-strict JSON constant {name} in the log")


def test_guard_keeps_the_original_exception_when_logging_fails(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, stat.S_IRUSR | stat.S_IXUSR)  # no writing in here
    if os.access(locked, os.W_OK):  # running as root: permissions do not bind; use a file as "directory"
        locked = tmp_path / "a-file"
        locked.write_text("not a directory")

    def failing_step():
        raise KeyError("the real training bug")

    with pytest.raises(KeyError, match="the real training bug") as err:
        with nanscan.guard(log=str(locked / "sub" / "events.jsonl")):
            failing_step()
    assert type(err.value) is KeyError
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "failing_step" in frames  # the original traceback survives
    assert err.value.nanscan_errors and isinstance(err.value.nanscan_errors[0], OSError)
    assert any("nanscan: logging failed" in n for n in getattr(err.value, "__notes__", []))


def test_guard_logs_and_captures_a_nonfinite_error(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "events.jsonl"
    mon = nanscan.watch(model, opt, log=str(log), capture_dir=str(tmp_path / "bundles"))
    with pytest.raises(nanscan.NonFiniteError) as err, mon, \
            nanscan.guard(log=str(tmp_path / "guard.jsonl"), monitor=mon):
        for i in range(4):
            x = torch.randn(2, 4)
            if i == 2:
                x[0, 0] = float("inf")
            with mon.step(x):
                mon.check_loss(model(x).sum()).backward()
                opt.step()
                opt.zero_grad()
    assert err.value.bundle_path and os.path.isdir(err.value.bundle_path)
    for path in (log, tmp_path / "guard.jsonl"):
        for line in path.read_text().splitlines():
            json.loads(line, parse_constant=no_constants)
    events = read_events(str(log))
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert (steps[0]["update"], steps[2]["update"]) == ("applied", "skipped")  # step 2 was stopped before its update
    assert steps[2]["nonfinite"]["forward"] > 0 and steps[0]["grad_norm"] > 0 and steps[0]["lr"] == 0.01
    incidents = [e for e in events if e["type"] == "incident"]
    assert incidents[0]["incident"]["name"] == "0" and incidents[0]["bundle"] == err.value.bundle_path
    guard_events = read_events(str(tmp_path / "guard.jsonl"))
    assert guard_events[-1]["type"] == "exception" and guard_events[-1]["error_type"] == "NonFiniteError"


def test_guard_capture_failure_is_attached_not_raised(tmp_path):
    model = nn.Linear(2, 1)
    mon = nanscan.watch(model)  # no capture_dir: nothing was kept to build a bundle from
    with pytest.raises(ZeroDivisionError) as err, mon:
        with nanscan.guard(capture_dir=str(tmp_path), monitor=mon):
            with mon.step(torch.ones(1, 2)):
                _ = 1 / 0
    assert any("capture failed" in n for n in err.value.__notes__)


def test_guard_around_mon_step_logs_and_captures_the_step_that_failed(tmp_path):
    # An ordinary error in step 2 of a `with mon.step()` loop: the step has ended (step_index moved
    # on) when guard sees the error, but the log and the bundle are about step 2.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path / "kept"))
    with pytest.raises(RuntimeError, match="data loader broke") as err, mon:
        with nanscan.guard(log=str(tmp_path / "guard.jsonl"), capture_dir=str(tmp_path / "b"), monitor=mon):
            for i in range(4):
                x = torch.randn(2, 4)
                with mon.step(x):
                    model(x).sum().backward()
                    if i == 2:
                        raise RuntimeError("data loader broke")
                    opt.step()
                    opt.zero_grad()
    assert mon.failing_step == 2 and mon.step_index == 3
    assert read_events(str(tmp_path / "guard.jsonl"))[-1]["step"] == 2
    assert any("wrote the failure bundle" in n and "step000002" in n for n in err.value.__notes__)


class PagerError(Exception):
    def __init__(self, msg, incident):
        super().__init__(msg)
        self.incident = incident  # a ticket id, nothing of nanscan's


class BadProperty(Exception):
    @property
    def incident(self):
        raise RuntimeError("property broke")


@pytest.mark.parametrize("error", [PagerError("paged", incident="INC-4711"), BadProperty("odd")])
def test_guard_ignores_an_incident_attribute_that_is_not_nanscans(tmp_path, error):
    with pytest.raises(type(error)) as err:
        with nanscan.guard(log=str(tmp_path / "g.jsonl")):
            raise error
    assert err.value is error
    assert read_events(str(tmp_path / "g.jsonl"))[-1]["error_type"] == type(error).__name__


def test_guard_keeps_the_error_when_its_notes_are_not_a_list(tmp_path):
    error = ValueError("the real one")
    error.__notes__ = ("frozen",)  # add_note raises TypeError on a tuple
    with pytest.raises(ValueError, match="the real one") as err:
        with nanscan.guard(log=str(tmp_path / "missing-dir-is-a-file")):
            (tmp_path / "missing-dir-is-a-file").mkdir()  # the log path is a directory: logging fails
            raise error
    assert err.value is error and isinstance(err.value.nanscan_errors[0], OSError)


@pytest.mark.parametrize("where", ["dev-full", "unwritable"])
def test_watch_with_an_unwritable_log_warns_and_trains(tmp_path, where):
    if where == "dev-full":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full here")
        path = "/dev/full"
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        path = str(blocker / "sub" / "events.jsonl")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.warns(RuntimeWarning, match="event log could not be written"):
        mon = nanscan.watch(model, opt, log=path)
    with mon:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert mon.step_index == 2 and mon.steplog.error is not None
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds  # no leaked file descriptor

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
    with pytest.raises(nanscan.NonFiniteError) as err, mon, nanscan.guard(log=str(tmp_path / "guard.jsonl"), monitor=mon):
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
                1 / 0
    assert any("capture failed" in n for n in err.value.__notes__)

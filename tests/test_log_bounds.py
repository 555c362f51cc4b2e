"""What the monitor keeps per step stays bounded however long the run:
the step log holds entries only for checked steps still to be written -- eval forwards in unchecked
steps make none -- and writes them in step order; the AMP ledger keeps the loss scale's changes,
not one entry per step."""
import math
import warnings

import pytest
import torch
from torch import nn

import nanscan
from nanscan import log
from nanscan.monitor.ledger import Ledger
from nanscan.vocabulary import TRAINING_PHASES

from tests.helpers import backward_and_step

NAN, INF = float("nan"), float("inf")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _step_records(path):
    return [e for e in log.read_events(path) if e.get("type") == "step"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eval_forwards_in_unchecked_steps_make_no_step_entries(tmp_path, mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "events.jsonl"
    mon = nanscan.watch(model, opt, every=10, log=str(path), mode=mode)
    steps, most = 300, 0
    with mon:
        for _ in range(steps):
            with torch.no_grad():  # an eval forward in every step, checked or not
                model(torch.randn(4, 8))
            loss = mon.check_loss(model(torch.randn(4, 8)).pow(2).mean())
            loss.backward()
            opt.step()
            opt.zero_grad()
            most = max(most, len(mon.steplog.steps))
        with torch.no_grad():  # after the last step: step 300 never runs
            model(torch.randn(4, 8))
        most = max(most, len(mon.steplog.steps))
    assert mon.step_index == steps
    records = _step_records(path)
    assert [e["step"] for e in records] == list(range(0, steps, 10))  # checked steps only, in order
    for e in records:
        assert e["update"] == "applied", e
        assert isinstance(e["lr"], float) and e["lr"] == 0.01, e
        assert isinstance(e["loss"], float) and math.isfinite(e["loss"]), e
        assert isinstance(e["grad_norm"], float) and math.isfinite(e["grad_norm"]), e
        assert set(e["nonfinite"]) == set(TRAINING_PHASES) and not any(e["nonfinite"].values()), e
    assert most <= 3, most  # entries only for the checked steps still to be written
    assert mon.steplog.steps == {}


def test_a_nonfinite_eval_forward_is_an_incident_line_not_a_step_record(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "events.jsonl"
    mon = nanscan.watch(model, opt, every=10, log=str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (eval incidents are warned about)
        with mon:
            for i in range(25):
                with torch.no_grad():
                    x = torch.randn(4, 8)
                    if i in (10, 15):  # an eval NaN in a checked step and in an unchecked one
                        x[0, 0] = NAN
                    model(x)
                backward_and_step(model(torch.randn(4, 8)).pow(2).mean(), opt)
                assert len(mon.steplog.steps) <= 3
    events = log.read_events(path)
    records = [e for e in events if e.get("type") == "step"]
    assert [e["step"] for e in records] == [0, 10, 20]
    assert all(not any(e["nonfinite"].values()) for e in records)  # eval is no step's
    evals = [e for e in events if e.get("type") == "incident"]
    assert [(e["step"], e["incident"]["phase"]) for e in evals] == [(10, "eval"), (15, "eval")]


def test_scale_history_keeps_changes_only():
    ledger = Ledger()
    for step, scale in [(0, 1024.0), (1, 1024.0), (2, 512.0), (3, 512.0), (4, 1024.0), (5, NAN), (6, NAN),
                        (7, INF), (8, INF)]:
        ledger.scale_history.append((step, scale))
    history = ledger.scale_history
    assert isinstance(history, list) and all(type(entry) is tuple for entry in history)
    assert [s for s, _ in history] == [0, 2, 4, 5, 7]
    assert [v for _, v in history][:3] == [1024.0, 512.0, 1024.0] and math.isnan(history[3][1])
    assert ledger.to_dict()["scale_history"] == [[0, 1024.0], [2, 512.0], [4, 1024.0],
                                                [5, {"finite": False, "value": "nan"}],
                                                [7, {"finite": False, "value": "inf"}]]


def test_a_steady_loss_scale_is_one_entry_and_a_skip_adds_the_halved_one():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # (growth_interval 2000: no growth here)
    poison = {"on": False}
    model[2].weight.register_hook(lambda g: g * INF if poison["on"] else g)
    mon = nanscan.watch(model, opt, scaler)
    with mon:
        for _ in range(200):
            backward_and_step(model(torch.randn(4, 8)).pow(2).mean(), opt, scaler)
        assert mon.ledger.scale_history == [(0, 1024.0)]
        poison["on"] = True  # step 200: an inf gradient, GradScaler skips it and halves the scale
        backward_and_step(model(torch.randn(4, 8)).pow(2).mean(), opt, scaler)
        poison["on"] = False
        for _ in range(10):
            backward_and_step(model(torch.randn(4, 8)).pow(2).mean(), opt, scaler)
    ledger = mon.ledger
    assert (ledger.attempted, ledger.applied, ledger.skipped_steps) == (211, 210, [200])
    assert ledger.scale_history == [(0, 1024.0), (201, 512.0)]  # the first step at the halved scale
    assert ledger.to_dict()["scale_history"] == [[0, 1024.0], [201, 512.0]]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_with_every_the_update_counts_reach_their_steps_record(tmp_path, mode):
    # The parameters after a checked step's update are read with the next *checked* step's copy,
    # `every` steps later: the step's record waits for them, in sync and async mode alike.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = {"i": 0}

    def plant(optimizer, args, kwargs):  # (registered before watch: runs before nanscan's post-hook)
        if step["i"] == 10:
            with torch.no_grad():
                model[0].weight[0, 0] = NAN

    opt.register_step_post_hook(plant)
    path = tmp_path / "events.jsonl"
    with nanscan.watch(model, opt, every=10, log=str(path), mode=mode, on_nonfinite="record"):
        for i in range(25):
            step["i"] = i
            if i == 11:
                with torch.no_grad():
                    model[0].weight[0, 0] = 0.0
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    records = {e["step"]: e for e in _step_records(path)}
    assert sorted(records) == [0, 10, 20]
    assert records[10]["nonfinite"]["update"] >= 1
    assert records[0]["nonfinite"]["update"] == 0

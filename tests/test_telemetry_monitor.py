"""watch(..., telemetry=...): every module's numbers every telemetry_every steps, from the records the
monitor reads anyway, checked against torch and read back from a real TensorBoard event file."""
import json
import math
import warnings

import pytest
import torch
from torch import nn

import nanscan
from nanscan.telemetry import TensorBoard


class Spike(nn.Module):
    """Makes one NaN at the steps in ``at`` (the next module masks it: the loss stays finite)."""

    def __init__(self):
        super().__init__()
        self.at, self.calls = set(), 0

    def forward(self, x):
        y = x * 1.0
        if self.calls in self.at:
            y = y.clone()
            y[0, 0] = float("nan")
        self.calls += 1
        return y


class Mask(nn.Module):
    def forward(self, x):
        return torch.nan_to_num(x, nan=0.0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Spike(), Mask(), nn.Linear(8, 1))


def _train(model, steps, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    points, seen = {}, {}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__(m.calls_seen, o.detach().clone()))
    options.setdefault("telemetry", lambda step, scalars: points.__setitem__(step, scalars))
    with nanscan.watch(model, opt, on_nonfinite="record", **options) as mon:
        for step in range(steps):
            model[0].calls_seen = step
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            seen[("after update", step)] = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
    return points, seen, mon


def test_the_points_are_the_modules_numbers_at_every_telemetry_step():
    model = _model()
    points, outputs, mon = _train(model, 6, telemetry_every=2)
    assert sorted(points) == [0, 2, 4]
    p = points[4]
    out = outputs[4]  # layer 0's output at step 4
    assert p["nanscan/rms/0"] == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-6)
    assert p["nanscan/amax/0"] == pytest.approx(out.abs().max().item(), rel=1e-7)
    relu = out.clamp(min=0)
    assert p["nanscan/zero_frac/1"] == pytest.approx((relu == 0).float().mean().item())
    fp32_max = torch.finfo(torch.float32).max
    assert p["nanscan/headroom_bits/0"] == pytest.approx(math.log2(fp32_max / out.abs().max().item()))
    # parameters after the step's update (0.weight, 0.bias, 4.weight, 4.bias), and their gradients
    w0, b0, w4, _ = outputs[("after update", 4)]
    assert p["nanscan/param_norm/4.weight"] == pytest.approx(w4.norm().item(), rel=1e-6)
    assert p["nanscan/param_amax/0.bias"] == pytest.approx(b0.abs().max().item())
    assert p["nanscan/grad_norm/0.weight"] > 0 and "nanscan/grad_nonfinite/0.weight" not in p  # (0: not sent)
    assert p["nanscan/loss"] > 0 and p["nanscan/grad_norm"] > 0 and p["nanscan/updates_skipped"] == 0
    assert p["nanscan/nonfinite"] == 0 and "nanscan/loss_scale" not in p  # (no GradScaler)
    assert p["nanscan/headroom_bits"] == min(v for k, v in p.items() if k.startswith("nanscan/headroom_bits/"))
    assert all(isinstance(v, float) and math.isfinite(v) for v in p.values())
    assert not mon.incidents


def test_a_nan_between_two_points_is_counted_at_the_next_one():
    model = _model()
    model[2].at = {1, 3}  # steps 1 and 3: one NaN each, masked before the loss
    points, _, mon = _train(model, 5, telemetry_every=2)
    assert [i.step for i in mon.incidents] == [1, 3] and mon.incidents[0].name == "2"
    assert "nanscan/nonfinite/2" not in points[0] and points[0]["nanscan/nonfinite"] == 0
    assert points[2]["nanscan/nonfinite/2"] == 1 and points[2]["nanscan/nonfinite"] == 1
    assert points[4]["nanscan/nonfinite/2"] == 1 and points[4]["nanscan/nonfinite"] == 1
    # statistics are of the telemetry step itself, over finite elements
    assert math.isfinite(points[2]["nanscan/rms/2"])


def test_a_nonfinite_loss_is_sent_as_loss_nonfinite_and_never_as_a_point():
    model = nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    points = {}
    with nanscan.watch(model, opt, telemetry=lambda s, p: points.__setitem__(s, p), telemetry_every=1,
                       on_nonfinite="record"):
        x = torch.randn(2, 4)
        x[0, 0] = float("inf")
        out = model(x)
        out.sum().backward()
        opt.step()
    p = points[0]
    assert "nanscan/loss" not in p and p["nanscan/loss_nonfinite"] == 1
    # the output's statistics are over its finite element; its Inf is counted
    assert p["nanscan/nonfinite/0"] == 1 and p["nanscan/rms/0"] == pytest.approx(out[1, 0].abs().item())
    assert all(math.isfinite(v) for v in p.values())


def test_tensorboard_reads_back_every_layer_over_the_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    _, outputs, _ = _train(model, 4, telemetry=TensorBoard(tmp_path / "tb"), telemetry_every=2)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"nanscan/rms/0", "nanscan/rms/4", "nanscan/param_norm/0.weight", "nanscan/loss"} <= set(tags)
    rms = acc.Scalars("nanscan/rms/0")
    assert [e.step for e in rms] == [0, 2]
    assert rms[1].value == pytest.approx(outputs[2].pow(2).mean().sqrt().item(), rel=1e-6)


def test_names_are_chosen_by_pattern_and_the_step_scalars_are_always_sent():
    points, _, _ = _train(_model(), 1, telemetry_every=1, telemetry_names=["4*"])
    names = set(points[0])
    assert {"nanscan/rms/4", "nanscan/param_norm/4.weight", "nanscan/loss"} <= names
    assert not any(n.endswith("/0") or "/0." in n for n in names)


def test_a_failing_sink_is_dropped_once_and_training_goes_on():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    calls, good = [], {}

    def broken(step, scalars):
        calls.append(step)
        raise OSError("tracker down")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanscan.watch(model, opt, telemetry=[broken, lambda s, p: good.__setitem__(s, p)], telemetry_every=1):
            for _ in range(3):
                model(torch.randn(4, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert calls == [0] and sorted(good) == [0, 1, 2]
    assert sum("tracker down" in str(w.message) for w in caught) == 1


def test_telemetry_options_are_checked_at_watch():
    model = _model()
    with pytest.raises(ValueError, match="telemetry_every must be an int >= 1 and a multiple of every=3"):
        nanscan.watch(model, telemetry=lambda s, p: None, every=3, telemetry_every=4)
    with pytest.raises(TypeError, match="a sink is a callable"):
        nanscan.watch(model, telemetry="runs/tb")
    with pytest.raises(TypeError, match="telemetry_names must be an fnmatch pattern"):
        nanscan.watch(model, telemetry=lambda s, p: None, telemetry_names=[1])
    assert nanscan.WatchConfig(every=3).telemetry_interval == 12 and nanscan.WatchConfig().telemetry_interval == 10


def test_wandb_offline_run_holds_the_monitors_points(wandb_offline, tmp_path):
    from nanscan.telemetry import WandB
    from tests.test_telemetry_sinks import read_wandb_history

    model = _model()
    model[2].at = {1}  # a NaN in step 1, between points: counted at the next point
    run = wandb_offline.init(project="nanscan-test", dir=str(tmp_path / "wandb"), mode="offline")
    points, outputs, _ = _train(model, 4, telemetry=WandB(run), telemetry_every=2)
    run.finish()
    rows = [r for r in read_wandb_history(tmp_path / "wandb") if "nanscan/loss" in r]
    assert len(rows) == 2
    assert rows[1]["nanscan/nonfinite/2"] == 1 and "nanscan/nonfinite/2" not in rows[0]
    assert rows[1]["nanscan/rms/0"] == pytest.approx(outputs[2].pow(2).mean().sqrt().item(), rel=1e-6)
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


def test_mlflow_store_holds_the_monitors_points(mlflow_store):
    from nanscan.telemetry import MLflow
    from tests.test_telemetry_sinks import read_mlflow

    mlflow, uri = mlflow_store
    model = _model()
    with mlflow.start_run() as run:
        _, outputs, _ = _train(model, 4, telemetry=MLflow(), telemetry_every=2)
    got = read_mlflow(mlflow.MlflowClient(uri), run.info.run_id)
    assert sorted(got["nanscan/rms/0"]) == [0, 2]
    assert got["nanscan/rms/0"][2] == pytest.approx(outputs[2].pow(2).mean().sqrt().item(), rel=1e-6)
    assert {"nanscan/param_norm/0.weight", "nanscan/grad_norm/4.weight", "nanscan/loss"} <= set(got)


def _steps(mon, model, opt, steps, nan_at=(), catch=()):
    """Trains ``steps`` steps; a NaN in the batch at the steps in ``nan_at``; exceptions of the types
    in ``catch`` are caught as a loop would (the step's gradients dropped)."""
    for step in range(steps):
        x = torch.randn(16, 4)
        if step in nan_at:
            x[0, 0] = float("nan")
        try:
            model(x).pow(2).mean().backward()
            opt.step()
        except catch:
            pass
        opt.zero_grad()


def test_the_step_that_raises_publishes_its_point_before_the_error_propagates():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    points = {}
    mon = nanscan.watch(model, opt, telemetry_every=10, telemetry=lambda step, s: points.__setitem__(step, dict(s)))
    with pytest.raises(nanscan.NonFiniteError) as raised:
        _steps(mon, model, opt, 20, nan_at={13})
    assert raised.value.incident.step == 13
    # (before close: the loop's error is what the user sees next, and the process may end with it)
    assert sorted(points) == [0, 10, 13]
    failing = points[13]
    # (one NaN input of 16 x 4: row 0 of layer 0's 16 x 8 output; the Mask cleans it before the loss)
    assert failing["nanscan/nonfinite/0"] == failing["nanscan/nonfinite/2"] == 8
    assert failing["nanscan/nonfinite"] > 0 and failing["nanscan/grad_nonfinite/0.weight"] == 8
    assert failing["nanscan/loss"] > 0
    mon.close()
    assert sorted(points) == [0, 10, 13]


def test_close_publishes_the_counts_since_the_last_point_and_a_clean_run_stays_on_schedule():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    points = {}
    with nanscan.watch(model, opt, telemetry_every=10, on_nonfinite="record",
                       telemetry=lambda step, s: points.__setitem__(step, dict(s))) as mon:
        model[2].at = {12}  # (one NaN in step 12, masked before the loss)
        _steps(mon, model, opt, 15)
        assert sorted(points) == [0, 10]
    assert sorted(points) == [0, 10, 14]  # (the last complete step: the NaN of step 12 is counted)
    assert points[14]["nanscan/nonfinite"] == 1 and points[14]["nanscan/nonfinite/2"] == 1
    assert points[14]["nanscan/loss"] > 0 and "nanscan/rms/0" not in points[14]  # (statistics: on schedule only)
    clean = {}
    with nanscan.watch(_model(), None, telemetry_every=10, telemetry=lambda step, s: clean.__setitem__(step, s)):
        pass
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanscan.watch(model, opt, telemetry_every=10, telemetry=lambda step, s: clean.__setitem__(step, s)) as mon:
        _steps(mon, model, opt, 15)
    assert sorted(clean) == [0, 10]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("steps", [5, 6])
def test_the_last_point_has_the_parameters_after_its_update_with_every_above_one(mode, steps):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    points = {}
    with nanscan.watch(model, opt, every=2, telemetry_every=2, mode=mode,
                       telemetry=lambda step, s: points.__setitem__(step, dict(s))) as mon:
        for step in range(steps):
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 4:
                after = [p.detach().clone() for p in model.parameters()]
    assert sorted(points) == [0, 2, 4] and not mon.incidents
    last = points[4]
    assert last["nanscan/param_norm/4.weight"] == pytest.approx(after[2].norm().item(), rel=1e-6)
    assert last["nanscan/param_amax/0.bias"] == pytest.approx(after[1].abs().max().item())


def test_a_sink_interrupt_caught_by_the_loop_leaves_the_step_count_right(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    published = []

    def sink(step, scalars):
        published.append(step)
        if len(published) == 2:
            raise KeyboardInterrupt

    log = tmp_path / "log.jsonl"
    with nanscan.watch(model, opt, telemetry_every=2, telemetry=sink, on_nonfinite="record", log=str(log)) as mon:
        _steps(mon, model, opt, 12, nan_at={11}, catch=KeyboardInterrupt)
        assert mon.state.index == 12
    assert [inc.step for inc in mon.incidents][:1] == [11]
    assert published == [0, 2, 4, 6, 8, 10, 11]  # (11: at close, the NaN counted since the last point)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [line["step"] for line in lines if line["type"] == "step"]
    assert steps == list(range(12))  # (the step whose point was interrupted is logged too)
    assert [line["step"] for line in lines if line["type"] == "incident"][:1] == [11]

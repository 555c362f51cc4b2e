"""Headroom (nanscan.headroom) and the monitor's early warning (watch(..., headroom_bits=N))."""
import json
import math
import warnings

import pytest
import torch
from torch import nn

import nanscan
from nanscan.headroom import SUGGESTED_BITS, dtype_max, headroom_bits, trend
from nanscan.monitor.headroom import HeadroomWarning
from tests.helpers import backward_and_step

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


# ---------------------------------------------------------------- the maths
@pytest.mark.parametrize("dtype,expected", [(torch.float16, 65504.0), (torch.bfloat16, 3.3895313892515355e38),
                                            (torch.float32, 3.4028234663852886e38)]
                         + [(d, {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[str(d)[6:]]) for d in FLOAT8])
def test_headroom_is_log2_of_the_dtype_max_over_amax(dtype, expected):
    assert dtype_max(dtype) == expected
    x = torch.tensor([-3.0, 0.5, 2.0])  # amax 3 (the negative side)
    s = nanscan.summarize(x)
    assert headroom_bits(s, dtype) == pytest.approx(math.log2(expected / 3.0))
    # a record given as its fields, as the event log and the monitor hold it
    assert headroom_bits(nanscan.summary.record(x).tolist(), dtype) == pytest.approx(math.log2(expected / 3.0))


def test_headroom_is_undefined_without_a_finite_nonzero_value():
    assert headroom_bits(nanscan.summarize(torch.zeros(4)), torch.float16) is None
    assert headroom_bits(nanscan.summarize(torch.full((3,), math.nan)), torch.float16) is None
    # a non-finite element does not hide the finite ones
    assert headroom_bits(nanscan.summarize(torch.tensor([math.inf, 1024.0])), torch.float16) == pytest.approx(
        math.log2(65504 / 1024))
    with pytest.raises(TypeError, match="floating dtypes"):
        dtype_max(torch.int32)


def test_trend_fits_bits_lost_per_100_steps_and_the_step_it_reaches_zero():
    steps = [10, 11, 12, 13]
    bits = [8.0 - 0.05 * (s - 10) for s in steps]
    fit = trend(steps, bits)
    assert fit["bits_per_100"] == pytest.approx(5.0)
    assert fit["overflow_step"] == 170  # 8 bits at 0.05 bits / step from step 10
    assert trend(steps, [5.0] * 4) == {"bits_per_100": pytest.approx(0.0), "overflow_step": None}
    assert trend([1, 2], [3.0, 2.0]) == {"bits_per_100": None, "overflow_step": None}  # too few points


# ---------------------------------------------------------------- the monitor
class Drifting(nn.Module):
    """proj's weight grows 3% a step (an instability feeding on itself); tanh keeps its gradient
    small, so the forward activation is what overflows (float16 under autocast)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.squash = nn.Tanh()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.squash(self.proj(x)))


def drift_run(steps=400, compile_backend=None, **watch):
    torch.manual_seed(0)
    model = Drifting()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the drift is planted, not learned
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    mon = nanscan.watch(model, opt, on_nonfinite="record", **watch)
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with torch.no_grad():
                model.proj.weight.mul_(1.03)
            with torch.autocast("cpu", dtype=torch.float16):
                y = run(x)
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if mon.incidents:
                break
    mon.close()
    return mon, [w for w in caught if issubclass(w.category, HeadroomWarning)]


def test_a_drifting_fp16_activation_is_warned_about_before_it_overflows():
    mon, caught = drift_run(headroom_bits=SUGGESTED_BITS)
    first = mon.incidents[0]
    assert (first.phase, first.name, first.produced) == ("forward", "proj", True)
    events = [e for e in mon.headroom_events if (e.kind, e.name) == ("activation", "proj")]
    assert len(events) == 1  # once per tensor
    e = events[0]
    assert (e.phase, e.stored_dtype, e.dtype, e.cast, e.dtype_max) == ("forward", "float16", "float16", False, 65504.0)
    assert e.bits < SUGGESTED_BITS and e.amax == pytest.approx(65504 / 2 ** e.bits)
    horizon = first.step - e.step
    assert horizon >= 20  # warned at least 20 steps before the first Inf
    assert abs(e.overflow_step - first.step) <= 0.25 * horizon  # the trend predicts it within 25%
    assert e.bits_per_100 == pytest.approx(100 * math.log2(1.03), rel=0.05)
    assert any(str(e) == str(w.message) for w in caught)
    # the first warning of the run is the activation that overflows
    assert mon.headroom_events[0].name == "proj"


def test_fp32_values_are_measured_against_fp16_under_autocast():
    """proj's float32 parameter is cast to float16 by autocast's matmul: its headroom is against 65504."""
    torch.manual_seed(0)
    model = Drifting()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model.proj.weight.fill_(10000.0)  # 2.7 bits below float16's max, 115 bits below float32's
        model.proj.bias.zero_()
    x = torch.full((2, 16), 1e-4)
    with nanscan.watch(model, opt, headroom_bits=4, on_nonfinite="record") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                y = model(x)
            y.float().mean().backward()
            opt.step()
            opt.zero_grad()
    params = [e for e in mon.headroom_events if e.kind == "param" and e.name == "proj.weight"]
    assert len(params) == 1
    assert (params[0].stored_dtype, params[0].dtype, params[0].cast) == ("float32", "float16", True)
    assert params[0].bits == pytest.approx(math.log2(65504 / 10000.0))
    # the same model without autocast: float32 has room to spare
    with nanscan.watch(model, opt, headroom_bits=4, on_nonfinite="record") as mon:
        model(x).mean().backward()
        opt.step()
    assert mon.headroom_events == []


class Narrow(nn.Module):
    """Returns its input as float8 / bfloat16 values: the C++ rows' dtype maxima are checked."""

    def __init__(self, dtype, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.dtype, self.scale = dtype, scale

    def forward(self, x):
        return (self.lin(x).abs() * 0 + self.scale).to(self.dtype)


@pytest.mark.parametrize("dtype,scale,bits", [(torch.bfloat16, 1e30, 40.0)]
                         + [(d, {"float8_e4m3fn": 300.0, "float8_e5m2": 30000.0}[str(d)[6:]], 4.0) for d in FLOAT8])
def test_headroom_of_bf16_and_float8_values_is_against_their_own_maxima(dtype, scale, bits):
    model = Narrow(dtype, scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanscan.watch(model, opt, headroom_bits=bits, on_nonfinite="record") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.ones(2, 4)).float().sum().backward()
        opt.step()
    (e,) = [e for e in mon.headroom_events if e.name == "(model)"]
    value = float(torch.tensor(scale).to(dtype).float())
    assert (e.dtype, e.dtype_max, e.cast) == (str(dtype)[6:], dtype_max(dtype), False)
    assert e.bits == pytest.approx(math.log2(dtype_max(dtype) / value))


def test_declared_casts_are_measured_against_their_dtype():
    if not FLOAT8:
        pytest.skip("no float8 dtypes in this torch")
    model = Drifting()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model.proj.weight.fill_(1.0)
        model.proj.bias.fill_(100.0)  # proj's outputs ~ 100 + sum(x): float32, 2 bits below e4m3fn's 448
    with nanscan.watch(model, opt, headroom_bits=3, headroom_cast={"proj": FLOAT8[0]},
                       on_nonfinite="record") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.ones(2, 16) * 0.01).sum().backward()
        opt.step()
    (e,) = mon.headroom_events
    assert (e.name, e.kind, e.stored_dtype, e.dtype, e.cast) == ("proj", "activation", "float32", "float8_e4m3fn", True)
    assert e.bits == pytest.approx(math.log2(448 / 100.16), rel=1e-4)


def test_warnings_never_raise_and_are_logged(tmp_path):
    log = tmp_path / "run.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # even a user's "error" filter does not turn them into exceptions
        mon, _ = drift_run(steps=400, headroom_bits=SUGGESTED_BITS, log=str(log))
    assert mon.headroom_events and mon.incidents
    events = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [e for e in events if e["type"] == "headroom"]
    assert [(e["step"], e["name"], e["record_kind"]) for e in logged] == [
        (e.step, e.name, e.kind) for e in mon.headroom_events]
    assert logged[0]["bits"] < SUGGESTED_BITS and logged[0]["overflow_step"] is not None
    steps = {e["step"]: e for e in events if e["type"] == "step"}
    warned = mon.headroom_events[0]
    assert steps[warned.step]["headroom"][f"activation {warned.name}"] == pytest.approx(warned.bits)
    # a step far from overflow logs no headroom (only tensors near the threshold are kept)
    assert "headroom" not in steps[0]


def test_only_checked_steps_are_looked_at():
    mon, _ = drift_run(headroom_bits=SUGGESTED_BITS, every=5)
    e = [e for e in mon.headroom_events if e.name == "proj"][0]
    assert e.step % 5 == 0
    assert all(s % 5 == 0 for s, _ in mon.headroom.history[("activation", "proj")])


def test_a_compiled_model_is_warned_about_like_the_eager_one():
    eager, _ = drift_run(headroom_bits=SUGGESTED_BITS)
    compiled, _ = drift_run(headroom_bits=SUGGESTED_BITS, compile_backend="aot_eager")
    key = lambda e: (e.step, e.kind, e.name, e.dtype, round(e.bits, 6), e.overflow_step)  # noqa: E731
    assert [key(e) for e in compiled.headroom_events] == [key(e) for e in eager.headroom_events]
    assert compiled.incidents[0].step == eager.incidents[0].step


def test_watch_refuses_bad_headroom_options():
    model = Drifting()
    for bad in (0, -1, "4", 2000):
        with pytest.raises(ValueError, match="headroom_bits"):
            nanscan.watch(model, headroom_bits=bad)
    with pytest.raises(TypeError, match="headroom_cast"):
        nanscan.watch(model, headroom_bits=4, headroom_cast={"proj": "float8"})
    with pytest.raises(ValueError, match="needs headroom_bits"):
        nanscan.watch(model, headroom_cast={"proj": torch.float16})
    with nanscan.watch(model, headroom_bits=True) as mon:
        assert mon.headroom.threshold == SUGGESTED_BITS


# ---------------------------------------------------------------- healthy runs: no false warning
class GPTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


@pytest.mark.parametrize("name", ["gpt", "cnn"])
@pytest.mark.parametrize("autocast", [True, False])
def test_no_warning_on_healthy_runs_at_the_suggested_threshold(name, autocast):
    torch.manual_seed(0)
    model = TinyGPT() if name == "gpt" else cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if autocast else None
    with nanscan.watch(model, opt, scaler, headroom_bits=True) as mon, warnings.catch_warnings():
        warnings.simplefilter("error", HeadroomWarning)
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                if name == "gpt":
                    tokens = torch.randint(0, 64, (4, 16))
                    logits = model(tokens)
                    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
                else:
                    loss = nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)).float(),
                                                       torch.randint(0, 10, (8,)))
            backward_and_step(loss, opt, scaler)
    assert mon.incidents == [] and mon.headroom_events == []
    # the margin the suggested threshold leaves on these models (SUGGESTED_BITS's comment)
    tracked = [b for h in mon.headroom.history.values() for _, b in h]
    assert min(tracked, default=math.inf) > SUGGESTED_BITS + 4


def test_the_report_shows_warnings_trend_and_overflow(tmp_path):
    from nanscan import report

    log = tmp_path / "run.jsonl"
    mon, _ = drift_run(headroom_bits=SUGGESTED_BITS, log=str(log))
    warned, first = mon.headroom_events[0], mon.incidents[0]
    summary = report.summarize_run(str(log))
    series = summary["headroom"]["series"][f"activation {warned.name}"]
    assert series["warned_at"] == warned.step and series["overflow"] == first.step
    assert series["bits"] == sorted(series["bits"], reverse=True)  # the drift, step by step
    assert summary["headroom"]["threshold"] == SUGGESTED_BITS
    text = report.format_summary(summary)
    assert (f"step {warned.step}: activation proj (float16) {warned.bits:.3g} bits left, losing "
            f"{warned.bits_per_100:.3g} bits per 100 steps, overflow predicted near step {warned.overflow_step}; "
            f"non-finite at step {first.step}") in text
    pytest.importorskip("matplotlib")
    png = report.plot_report(str(log), str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 10000 and png.endswith("run.png")

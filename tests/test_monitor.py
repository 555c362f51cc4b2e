"""nanscan.watch: planted faults, each asserting step, phase, name, kind and produced."""

import pytest
import torch
from torch import nn

import nanscan
from nanscan.monitor import monitor as monitor_module
from tests.helpers import backward_and_step

INF = float("inf")


class Block(nn.Module):
    """Linear then an optional planted functional fault (log of a negative) inside the module."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.fault = False

    def forward(self, x):
        h = self.lin(x)
        return torch.log(h - 100.0) if self.fault else torch.tanh(h)


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.block = Block(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def train(model, mon, steps, batch_fn, opt, loss_scale=None, scaler=None):
    torch.manual_seed(0)
    for i in range(steps):
        with mon.step():
            x = batch_fn(i)
            backward_and_step(mon.check_loss(model(x).pow(2).mean()), opt, scaler)


def setup(**kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=kw.pop("lr", 0.01))
    return model, opt, nanscan.watch(model, opt, **kw)


def test_functional_fault_inside_named_submodule_is_produced_there():
    model, opt, mon = setup()

    def batch(i):
        model.block.fault = i == 2
        return torch.randn(4, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 5, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (2, "forward", "block", "activation", True)
    assert inc.summary.nan_count > 0 and "block" in str(inc) and "produced here" in str(inc)
    assert mon.incident is inc and isinstance(err.value, FloatingPointError)
    # the update of the failing step was stopped (sync mode reads before optimizer.step)
    assert mon.ledger.applied == 2 and mon.ledger.skipped_steps == [2]


def test_nan_in_the_batch_is_propagated_not_blamed_on_the_first_layer():
    model, opt, mon = setup()

    def batch(i):
        x = torch.randn(4, 8)
        if i == 1:
            x[2, 3] = float("nan")
        return x

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 3, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "forward", "embed", "activation", False)
    assert inc.inputs == ("(model).input[0]",) and "propagated" in str(inc)


class Attention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.mask_all = False

    def forward(self, x):
        scores = self.q(x) @ x.transpose(-1, -2)
        mask = torch.zeros_like(scores)
        if self.mask_all:
            mask[:, 0, :] = -INF  # a fully masked row: softmax of all -inf is NaN
        return torch.softmax(scores + mask, dim=-1) @ x


def test_softmax_over_an_all_minus_inf_row_inside_a_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Attention(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)

    def batch(i):
        model[1].mask_all = i == 1
        return torch.randn(2, 5, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 3, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "forward", "1", "activation", True)


class SqrtGate(nn.Module):
    """y = x * sqrt(w): finite forward at w = 0, infinite gradient d/dw = x / (2 sqrt(w))."""

    def __init__(self, d=8):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.sqrt(self.w)


def test_backward_only_fault_names_the_parameter_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SqrtGate(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nanscan.watch(model, opt)

    def batch(i):
        if i == 1:
            with torch.no_grad():
                model[1].w[3] = 0.0
        return torch.randn(4, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 3, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "backward", "1.w", "grad", True)
    assert inc.summary.posinf_count + inc.summary.neginf_count >= 1


class GatedNet(Net):
    """A parameter whose gradient is exactly 0 (it is multiplied by 0 in the forward)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return super().forward(x + 0.0 * self.gate)


def test_update_that_blows_up_is_reported_in_phase_update():
    # Adam with eps=0 divides 0 by 0 for a parameter whose gradient is 0: the gradient is finite,
    # the update is NaN -- produced by the update itself.
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 3, lambda i: torch.randn(4, 8), opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (0, "update", "gate", "param", True)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("blown", [15, 21])
def test_an_update_checked_every_few_steps_still_knows_its_gradient_was_finite(mode, blown):
    # every=3: the update of step 15 is decoded with the read of step 18, the seventh read -- where
    # the reads kept for the updates are thinned; its gradient was read finite, so the update made it
    torch.manual_seed(0)
    model = GatedNet()
    rest = [p for name, p in model.named_parameters() if name != "gate"]
    opt = torch.optim.Adam([{"params": rest}, {"params": [model.gate], "eps": 1e-8}], lr=1e-3)
    mon = nanscan.watch(model, opt, every=3, mode=mode)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(blown + 6):
            opt.param_groups[1]["eps"] = 0.0 if i == blown else 1e-8  # (0 / 0 for the gate, at that step)
            with mon.step():
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (blown, "update", "gate", "param", True)


def test_gradscaler_skips_are_in_the_ledger_and_not_raised():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    poison = {"on": False}
    model.head.weight.register_hook(lambda g: g * INF if poison["on"] else g)
    mon = nanscan.watch(model, opt, scaler)

    def batch(i):
        poison["on"] = i in (1, 3)
        return torch.randn(4, 8)

    with mon:
        train(model, mon, 5, batch, opt, scaler=scaler)
    ledger = mon.ledger
    assert (ledger.attempted, ledger.applied, ledger.skipped_steps) == (5, 3, [1, 3])
    # changes only: GradScaler halved the scale after each skip
    assert ledger.scale_history == [(0, 1024.0), (2, 512.0), (4, 256.0)]
    assert [(i.step, i.phase, i.kind, i.handled_by_scaler) for i in mon.incidents] == \
        [(1, "backward", "grad", True), (3, "backward", "grad", True)]
    assert mon.incidents[0].name == "head.weight"


def test_allowed_minus_inf_mask_never_raises():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_mask = MaskMaker()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.lin(x) + self.attn_mask(x), dim=-1)

    class MaskMaker(nn.Module):
        def forward(self, x):
            return torch.triu(torch.full((x.shape[-1],) * 2, -INF), diagonal=1)[: x.shape[-2]]

    torch.manual_seed(0)
    model = nn.Sequential(Masked(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, allow=("*.attn_mask",)) as mon:
        train(model, mon, 2, lambda i: torch.randn(8, 8), opt)
    assert mon.incidents == []
    with nanscan.watch(model, opt) as mon2, pytest.raises(nanscan.NonFiniteError) as err:
        train(model, mon2, 1, lambda i: torch.randn(8, 8), opt)
    assert err.value.incident.name == "0.attn_mask"


def test_warn_and_record_modes_and_every():
    model, opt, mon = setup(on_nonfinite="record", every=2)

    def batch(i):
        model.block.fault = i in (1, 2)
        return torch.randn(4, 8)

    with mon:
        train(model, mon, 4, batch, opt)
    assert [(i.step, i.phase) for i in mon.incidents if i.phase == "forward"] == [(2, "forward")]  # step 1 not sampled
    model2, opt2, mon2 = setup(on_nonfinite="warn")
    model2.block.fault = True
    with mon2, pytest.warns(RuntimeWarning, match="non-finite output of module 'block'"):
        train(model2, mon2, 1, lambda i: torch.randn(4, 8), opt2)


def test_one_host_read_per_step(monkeypatch):
    model, opt, mon = setup()
    reads = []
    original = monitor_module.Monitor._read_and_decide
    monkeypatch.setattr(monitor_module.Monitor, "_read_and_decide",
                        lambda self, *a, **k: (reads.append(True), original(self, *a, **k)))
    with mon:
        train(model, mon, 4, lambda i: torch.randn(4, 8), opt)
        assert sum(reads) == 4
    assert sum(reads) == 5  # close() reads the last update's parameter records


def test_async_mode_reports_one_step_later_without_losing_the_step():
    # (records on the host too: found at step 1's read, whose clean reads are decided at once, and
    # raised at the next read, as a GPU's copy would land)
    model, opt, mon = setup(mode="async")
    batches = []

    def batch(i):
        batches.append(i)
        model.block.fault = i == 1
        return torch.randn(4, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(model, mon, 4, batch, opt)
    assert (err.value.incident.step, err.value.incident.name) == (1, "block")
    assert batches == [0, 1, 2]  # raised in step 2


def test_training_exception_stays_primary_and_hooks_are_removed():
    model, opt, mon = setup()
    with pytest.raises(KeyError, match="user bug"), mon:
        with mon.step():
            model(torch.randn(2, 8))
            raise KeyError("user bug")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    nanscan.watch(model, opt).close()  # watchable again after close


def test_bad_use_gets_clear_errors():
    model = Net()
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        nanscan.watch(lambda x: x)
    with pytest.raises(ValueError, match="no parameters"):
        nanscan.watch(nn.ReLU())
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        nanscan.watch(model, every=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        nanscan.watch(model, mode="eventually")
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        nanscan.watch(model, on_nonfinite="explode")
    with nanscan.watch(model):
        with pytest.raises(ValueError, match="already watched"):
            nanscan.watch(model)
    with pytest.raises(ValueError, match="already torch.compile-d"):
        nanscan.watch(torch.compile(model))
    with pytest.raises(ValueError, match="eval_forwards must be one of"):
        nanscan.watch(model, eval_forwards="sometimes")
    with pytest.raises(ValueError, match=r"compiled_grads must be one of \('hooks', 'taps', 'off'\)"):
        nanscan.watch(model, compiled_grads="yes")
    in_place = Net()
    in_place.compile(backend="eager")
    with pytest.raises(ValueError, match="compiled in place"):
        nanscan.watch(in_place)


def test_incident_to_dict_is_strict_json():
    import json

    model, opt, mon = setup(on_nonfinite="record")
    model.block.fault = True
    with mon:
        train(model, mon, 1, lambda i: torch.randn(4, 8), opt)
    text = json.dumps([i.to_dict() for i in mon.incidents] + [mon.ledger.to_dict()], allow_nan=False)
    assert '"phase": "forward"' in text


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_localizes_with_zero_graph_breaks(backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, opt, mon = setup()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a break would raise

    def batch(i):
        model.block.fault = i == 2
        return torch.randn(4, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(compiled, mon, 4, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (2, "forward", "block", "activation", True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    model2, opt2, mon2 = setup()
    compiled2 = torch.compile(model2, fullgraph=True, backend=backend)
    with pytest.raises(nanscan.NonFiniteError) as err2, mon2:
        train(compiled2, mon2, 2, lambda i: torch.full((4, 8), float("nan")) if i else torch.randn(4, 8), opt2)
    assert (err2.value.incident.step, err2.value.incident.name, err2.value.incident.produced) == (1, "embed", False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fused_optimizer_skips_are_read_from_found_inf(mode):
    # A fused optimizer takes found_inf from GradScaler and skips inside its kernel: step() and
    # its hooks still run, so "applied" must come from the device flag, not from the hook.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    poison = {"on": False}
    model.head.weight.register_hook(lambda g: g * INF if poison["on"] else g)
    mon = nanscan.watch(model, opt, scaler, mode=mode)

    def batch(i):
        poison["on"] = i in (1, 2)
        return torch.randn(4, 8)

    with mon:
        train(model, mon, 5, batch, opt, scaler=scaler)
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped_steps) == (5, 3, [1, 2])
    assert all(i.handled_by_scaler for i in mon.incidents) and {i.step for i in mon.incidents} == {1, 2}


def test_optimizer_state_is_watched_on_request():
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanscan.watch(model, opt, params=False, optimizer_state=True, on_nonfinite="record") as mon:
        train(model, mon, 2, lambda i: torch.randn(4, 8), opt)
        with torch.no_grad():
            opt.state[model.gate]["exp_avg_sq"].fill_(float("nan"))
        train(model, mon, 1, lambda i: torch.randn(4, 8), opt)
    kinds = {(i.kind, i.name) for i in mon.incidents}
    assert ("optimizer_state", "gate.exp_avg_sq") in kinds


def test_hooks_added_after_compile_are_refused_not_silently_ignored():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(torch.randn(4, 8))  # compiled before any hook exists: this graph never calls them
    mon = nanscan.watch(model, opt)
    with pytest.raises(RuntimeError, match="watch\\(model\\) first, then torch.compile"), mon:
        train(compiled, mon, 1, lambda i: torch.randn(4, 8), opt)


class Odd(nn.Module):
    """Shapes of real models: a shared submodule called twice, tuple / dict outputs, keyword
    tensors, an integer output, and a buffer updated in place."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.pair = Pair()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x, *, scale=None):
        h = self.shared(self.shared(x))
        a, b = self.pair(h, bias=scale)
        self.count += 1
        return {"out": a["y"] + b, "argmax": a["y"].argmax(-1)}


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fault = False

    def forward(self, h, bias=None):
        y = self.lin(h) + (bias if bias is not None else 0)
        if self.fault:
            y = y / 0.0 * 0.0  # NaN made here
        return {"y": y}, torch.relu(y)


def test_odd_module_shapes_and_inference_steps():
    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        for i in range(3):
            model.pair.fault = i == 2
            with mon.step():
                if i == 1:  # an evaluation step inside the loop: no grads, no update
                    model.eval()
                    with torch.no_grad():
                        model(torch.randn(2, 8), scale=torch.ones(8))
                    model.train()
                    continue
                try:
                    out = model(torch.randn(2, 8), scale=torch.ones(8))
                    mon.check_loss(out["out"].sum()).backward()
                    opt.step()
                    opt.zero_grad()
                except nanscan.NonFiniteError as e:
                    inc = e.incident
    assert (inc.step, inc.phase, inc.name, inc.produced) == (2, "forward", "pair[0].y", True)
    assert mon.ledger.applied == 1 and mon.step_index == 3


def test_compiled_path_checks_several_outputs_of_a_module():
    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.fault = False

        def forward(self, x):
            y = self.lin(x)
            return y, (torch.log(y - 100.0) if self.fault else y * 2)

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.two = TwoOut()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            a, b = self.two(x)
            return self.head(a) + b.sum(-1, keepdim=True) * 0.0

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net2()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nanscan.watch(model, opt)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def batch(i):
        model.two.fault = i == 1
        return torch.randn(4, 8)

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        train(compiled, mon, 3, batch, opt)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.produced) == (1, "forward", "two[1]", True)  # the eager name

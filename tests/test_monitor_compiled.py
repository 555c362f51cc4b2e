"""Compiled = eager: every forward fault planted in the monitor tests gives the same incident (step,
phase, kind, name, produced, shape) under torch.compile (default and fullgraph, aot_eager and
inductor) as in eager mode; watching adds no graph; eval forwards between compiled steps change
nothing; backward faults inside compiled graphs are named like eager ones; where the compiled path
cannot know (a gradient it could not tap), it says so."""
import pytest
import torch
from torch import nn

import nanscan
from nanscan.monitor.traced import GRAD_HOOKS
from tests.test_monitor import GatedNet, Odd, SqrtGate
from tests.test_monitor_loops import AttnNet, Net, SqNet, SqrtZero, key

BACKENDS = ["aot_eager", "inductor"]


def run(model, steps, plant, compile_kw=None, eval_between=False, make_opt=None, loss_fn=None, **watch_options):
    """Plain loop (no mon.step); returns the incident (or None) and the monitor. ``plant(model, i)``
    returns the batch: a tensor, or ``(args, kwargs)``."""
    opt = make_opt(model) if make_opt else torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, **watch_options)
    fwd = torch.compile(model, **compile_kw) if compile_kw is not None else model
    loss_fn = loss_fn or (lambda out: out.pow(2).mean())
    torch.manual_seed(1)
    try:
        with mon:
            for i in range(steps):
                x = plant(model, i)
                args, kwargs = x if isinstance(x, tuple) else ((x,), {})
                loss_fn(fwd(*args, **kwargs)).backward()
                opt.step()
                opt.zero_grad()
                if eval_between:
                    with torch.no_grad():
                        fwd(*args, **kwargs)
    except nanscan.NonFiniteError as e:
        return e.incident, mon
    return None, mon


def eager_and_compiled(make, steps, plant, compile_kw, compiled_only=None, **options):
    """The incidents of the same seeded run, eager then compiled (``compile_kw``); ``options`` go to
    both runs, ``compiled_only`` (e.g. ``compiled_grads``, ``eval_between``) to the compiled one."""
    torch.manual_seed(0)
    eager, _ = run(make(), steps, plant, **options)
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled, _ = run(make(), steps, plant, compile_kw, **options, **(compiled_only or {}))
    return eager, compiled


def block_fault(model, i):
    model.block.fault = i == 2
    return torch.randn(4, 8)


def nan_batch(model, i):
    x = torch.randn(4, 8)
    if i == 1:
        x[1, 2] = float("nan")
    return x


def masked_attention(model, i):
    model.attn.mask_all = i == 1
    return torch.randn(2, 5, 8)


def sqrt_gate_net():
    return nn.Sequential(nn.Linear(8, 8), SqrtGate(), nn.Linear(8, 1))


def zero_sqrt_gate(model, i):
    if i == 1:
        with torch.no_grad():
            model[1].w[3] = 0.0  # finite forward, infinite d/dw sqrt(w)
    return torch.randn(4, 8)


def odd_batch(model, i):
    model.pair.fault = i == 2
    return (torch.randn(2, 8),), {"scale": torch.ones(8)}


# name -> (model factory, plant, optimizer factory or None, loss or None)
CASES = {
    "block_fault": (Net, block_fault, None, None),
    "nan_batch": (Net, nan_batch, None, None),
    "masked_attention": (AttnNet, masked_attention, None, None),
    "param_grad_only": (sqrt_gate_net, zero_sqrt_gate, None, None),
    "update_blows_up": (GatedNet, lambda m, i: torch.randn(4, 8),
                        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0), None),
    "odd_shapes": (Odd, odd_batch, None, lambda out: out["out"].sum()),
}


def like_eager(compiled, eager) -> bool:
    """Compiled = eager; except for a backward fault where this torch traces no gradient hook into
    a graph (torch 2.11): there nanscan must say it cannot tell (``produced=None``) at the same
    step, phase and kind, never guess. ``compiled`` / ``eager``: incident keys."""
    if GRAD_HOOKS or eager[1] != "backward":
        return compiled == eager
    return compiled[:2] == eager[:2] and compiled[3] == eager[3] and compiled[4] is None


def incident_tuple(inc):
    return key(inc) + (inc.summary.shape, inc.summary.nan_count + inc.summary.posinf_count + inc.summary.neginf_count)


# Every case under aot_eager (default and fullgraph); inductor (slow to compile on 2 cores) on a
# spread of them, in both modes.
MATRIX = ([("aot_eager", fullgraph, case) for fullgraph in (False, True) for case in sorted(CASES)]
          + [("inductor", True, "block_fault"), ("inductor", True, "masked_attention"),
             ("inductor", True, "param_grad_only"), ("inductor", False, "nan_batch"),
             ("inductor", False, "update_blows_up")])


@pytest.mark.parametrize("backend,fullgraph,case", MATRIX)
def test_compiled_incident_equals_eager(backend, fullgraph, case):
    make, plant, make_opt, loss_fn = CASES[case]
    eager, compiled = eager_and_compiled(make, 4, plant, dict(backend=backend, fullgraph=fullgraph),
                                         dict(compiled_grads=True), make_opt=make_opt, loss_fn=loss_fn)
    assert eager is not None and compiled is not None
    assert incident_tuple(compiled) == incident_tuple(eager)
    assert compiled.inputs == eager.inputs


# Every case with the default options (no gradient taps): the traced hooks' fast path, leaf
# modules' one stamp per call (inputs with outputs, after the forward) and the gradient hooks.
DEFAULT_MATRIX = ([("aot_eager", fullgraph, case) for fullgraph in (False, True)
                   for case in ("block_fault", "masked_attention", "nan_batch", "odd_shapes", "update_blows_up",
                                "param_grad_only")]
                  + [("inductor", True, "masked_attention"), ("inductor", False, "block_fault")])


@pytest.mark.parametrize("backend,fullgraph,case", DEFAULT_MATRIX)
def test_compiled_incident_equals_eager_with_default_options(backend, fullgraph, case):
    make, plant, make_opt, loss_fn = CASES[case]
    eager, compiled = eager_and_compiled(make, 4, plant, dict(backend=backend, fullgraph=fullgraph),
                                         make_opt=make_opt, loss_fn=loss_fn)
    assert eager is not None and compiled is not None
    assert like_eager(incident_tuple(compiled), incident_tuple(eager))
    assert compiled.inputs == eager.inputs


class PoisonsItsInput(nn.Module):
    """A leaf that writes NaN into its input in place (no ``inplace`` attribute says so) and returns
    a new tensor. A leaf's inputs are stamped after its forward inside a graph: what it received
    is then unknown, and nanscan must say so rather than blame whoever made the input."""

    def __init__(self):
        super().__init__()
        self.fault = False

    def forward(self, x):
        if self.fault:
            x[0, 0] = float("nan")
        return x * 2.0


class PoisonNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.poison, self.head = nn.Linear(8, 8), PoisonsItsInput(), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.poison(self.embed(x)))


class BodyMutatesNet(PoisonNet):
    """The parent's own body changes a child's output in place (NaN) before the next child reads it:
    the next child's input was changed after the stamp that saw it."""

    def forward(self, x):
        h = self.embed(x)
        if self.poison.fault:
            h[0, 0] = float("nan")
        return self.head(h * 1.0 + self.poison(torch.ones_like(h)))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_leaf_that_changes_its_input_in_place_is_not_guessed(fullgraph):
    def plant(m, i):
        m.poison.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(PoisonNet, 3, plant, dict(backend="aot_eager", fullgraph=fullgraph))
    # Eager: the embed output was changed before it was summarized (stale); compiled: the poison's
    # input row changed during its forward. Both name the poison, and neither says who produced it.
    assert key(eager) == key(compiled) == (1, "forward", "poison", "activation", None)


def test_a_parent_body_that_changes_a_value_in_place_is_still_named():
    def plant(m, i):
        m.poison.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(BodyMutatesNet, 3, plant, dict(backend="aot_eager", fullgraph=True))
    assert eager is not None and compiled is not None
    # The parent's NaN reaches the poison's input after the stamp of the embed's output saw it finite:
    # both name the poison, and neither can say who produced the value.
    assert key(eager) == key(compiled) == (1, "forward", "poison", "activation", None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_forwards_between_compiled_steps_change_nothing(backend):
    eager, compiled = eager_and_compiled(Net, 4, block_fault, dict(backend=backend), dict(eval_between=True))
    assert incident_tuple(compiled) == incident_tuple(eager) and compiled.produced is True


def _graphs(model, watch):
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt) if watch else None
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for _ in range(3):
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            compiled(torch.randn(4, 8))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if mon is not None:
        mon.close()
    return graphs, breaks


def test_watching_adds_no_graph_and_no_break():
    torch.manual_seed(0)
    assert _graphs(Net(), watch=True) == _graphs(Net(), watch=False)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_backward_fault_equals_eager(backend, fullgraph):
    # Inside the graph, taps on module inputs and outputs record the gradients (an autograd
    # Function whose backward writes the gradient's record into the buffer).
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(SqNet, 3, plant, dict(backend=backend, fullgraph=fullgraph),
                                         dict(compiled_grads=True))
    assert incident_tuple(compiled) == incident_tuple(eager)
    assert key(eager) == (1, "backward", "sq", "grad", True)


class DictSq(nn.Module):
    """The backward-only fault of SqrtZero, in a module that returns a dict: its output is not
    tapped inside a compiled graph (only tensors, tuples and lists are), so the gradient flowing
    into it is unknown there."""

    def forward(self, x):
        return {"y": x + torch.sqrt(x * 0.0)}


class DictSqNet(SqNet):
    def __init__(self):
        super().__init__()
        self.sq = DictSq()

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.sq(h)["y"] if self.fault else h)


def test_compiled_backward_fault_without_output_gradient_is_not_guessed():
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    torch._dynamo.reset()
    torch.manual_seed(0)
    inc, _ = run(DictSqNet(), 3, plant, dict(backend="aot_eager", fullgraph=True), compiled_grads=True)
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "backward", "sq", "grad", None)
    assert "cannot tell" in str(inc)


@pytest.mark.parametrize("what", ["optimizer_step", "train_step"])
def test_compiled_optimizer_step_or_whole_train_step(what):
    # torch.compile(opt.step) (the PyTorch recipe for fast optimizers) or a whole compiled train
    # step: the monitor's host work runs eagerly (one graph break, never traced), steps still end
    # at the optimizer step, and the incident is the eager one.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt)
    opt_step = torch.compile(opt.step, backend="aot_eager")

    def train_step(x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step = torch.compile(train_step, backend="aot_eager") if what == "train_step" else None
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(4):
            model.block.fault = i == 2
            if step is not None:
                step(torch.randn(4, 8))
            else:
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt_step()
                opt.zero_grad()
    assert key(err.value.incident) == (2, "forward", "block", "activation", True)
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped_steps) == (3, 2, [2])


def test_compiled_buffer_overflow_equals_eager():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        model.fault = False
        return model

    def plant(model, i):
        if i == 1:
            with torch.no_grad():
                model[0].weight.mul_(1e30)  # finite outputs, infinite variance
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(make, 3, plant, dict(backend="aot_eager"))
    assert key(compiled) == key(eager) == (1, "update", "1.running_var", "buffer", True)


class InPlace(nn.Module):
    """What resnets do: ReLU(inplace=True) on a module's output, `out += identity` in the body."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 1)
        self.fault = False

    def forward(self, x):
        out = self.lin(x)
        out += x
        out = self.act(out)
        return self.head(torch.log(out - 100.0) if self.fault else out)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("backend,make", [("aot_eager", SqNet), ("inductor", SqNet), ("aot_eager", "DictSqNet")])
def test_compiled_backward_fault_with_the_default_options(backend, make, fullgraph):
    # Default: a tensor hook on every module output, traced into the graph where this torch can
    # (GRAD_HOOKS), so a backward-only fault is named like eager; elsewhere nanscan says it
    # cannot tell (the first non-finite parameter gradient, produced=None), never a guess.
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    make = globals()[make] if isinstance(make, str) else make  # (DictSqNet is defined below)
    eager, compiled = eager_and_compiled(make, 3, plant, dict(backend=backend, fullgraph=fullgraph))
    assert key(eager) == (1, "backward", "sq", "grad", True)
    if GRAD_HOOKS:
        assert incident_tuple(compiled) == incident_tuple(eager)
    else:
        assert (compiled.step, compiled.phase, compiled.kind, compiled.produced) == (1, "backward", "grad", None)


class SqAfterInPlace(InPlace):
    """InPlace with a backward-only fault consuming the in-place ReLU's output."""

    def __init__(self):
        super().__init__()
        self.sq = SqrtZero()

    def forward(self, x):
        out = self.lin(x)
        out += x
        out = self.act(out)
        return self.head(self.sq(out) if self.fault else out)


@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_in_place_ops_on_module_outputs_compile_and_are_named_like_eager(fault, fullgraph):
    # Default options: the gradient hooks leave module outputs as they are (no view, unlike taps),
    # so in-place ops on them compile, and the hook on `lin`'s output receives the gradient of the
    # value it made.
    if fault == "backward" and not GRAD_HOOKS:
        pytest.skip("this torch traces no tensor hook into a graph")
    make, at, expected = {"forward": (InPlace, 2, (2, "forward", "(model)", "activation", True)),
                          "backward": (SqAfterInPlace, 1, (1, "backward", "sq", "grad", True))}[fault]

    def plant(model, i):
        model.fault = i == at
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(make, at + 2, plant, dict(backend="aot_eager", fullgraph=fullgraph))
    assert incident_tuple(compiled) == incident_tuple(eager)
    assert key(eager) == expected


@pytest.mark.parametrize("off", ["off", False])
def test_compiled_grads_off_says_it_cannot_tell(off):
    # No gradient records inside the graph (the shortest compile): a backward-only fault is the first
    # non-finite parameter gradient, produced=None -- never a guess.
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    torch._dynamo.reset()
    torch.manual_seed(0)
    inc, mon = run(SqNet(), 3, plant, dict(backend="aot_eager", fullgraph=True), compiled_grads=off)
    assert not mon.traced.grad_hooks and not mon.compiled_grads
    assert (inc.step, inc.phase, inc.kind, inc.produced) == (1, "backward", "grad", None)


class _NoUpdate(torch.optim.SGD):
    """An optimizer whose step leaves the weights alone (non-finite gradients then poison nothing)."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.1)

    def step(self, closure=None):
        return None


@pytest.mark.skipif(not GRAD_HOOKS, reason="this torch traces no tensor hook into a graph")
def test_a_gradient_whose_consumer_differs_between_graphs_is_named_after_the_graph_that_ran():
    # The same rows are written by two graphs of different structure (SqNet's fault flag switches
    # between them every step: `inp`'s output goes to `head` in one, to `sq` in the other). Only the
    # notes of the graph that ran apply: each faulty step is named `sq`, produced, like eager.
    def plant(m, i):
        m.fault = i % 2 == 1
        return torch.randn(4, 8)

    incidents = []
    for compile_kw in (None, dict(backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        _, mon = run(SqNet(), 5, plant, compile_kw, make_opt=_NoUpdate, on_nonfinite="record")
        incidents.append([key(inc) for inc in mon.incidents])
    assert incidents[1] == incidents[0] == [(s, "backward", "sq", "grad", True) for s in (1, 3)]


@pytest.mark.parametrize("same_instance", [False, True])
def test_a_graph_compiled_before_watch_is_never_reused_without_the_hooks(same_instance):
    # dynamo does not guard on module hooks and caches graphs per code object: a graph compiled for an
    # unwatched model of the same class (a notebook re-run, a train / eval copy) -- or for this model
    # before watch -- would run the watched model without its hooks, and the fault would be reported
    # at (model). watch drops those graphs (and says so); the fault is named where it is made.
    torch._dynamo.reset()
    torch.manual_seed(0)
    first = Net()
    torch.compile(first, backend="aot_eager")(torch.randn(4, 8)).pow(2).mean().backward()
    model = first if same_instance else Net()
    with pytest.warns(RuntimeWarning, match="dropped 1 torch.compile graph"):
        incident, _ = run(model, 4, block_fault, dict(backend="aot_eager"))
    eager, _ = run(Net(), 4, block_fault)
    assert key(incident) == key(eager) and incident.name == "block"


def _accumulating_run(compiled, plant, make=SqNet, micro_steps=2, **watch_options):
    """Gradient accumulation (``micro_steps`` forward / backward per optimizer step), record mode:
    the keys of every incident. ``plant(model, step, micro)`` returns the batch."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, on_nonfinite="record", **watch_options)
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    with mon:
        for i in range(3):
            for micro in range(micro_steps):
                fwd(plant(model, i, micro)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [key(inc) for inc in mon.incidents]


@pytest.mark.parametrize("fault", ["backward", "forward"])
def test_gradient_accumulation_keeps_every_micro_step_of_a_compiled_model(fault):
    # Every micro-step's graph writes the same rows; each training forward keeps the rows before it
    # (a device copy, decoded in its turn), so a fault in the first micro-step is not overwritten
    # by the clean second one -- before, a backward-only fault there was reported as the
    # accumulated `inp.weight` gradient, "produced" (wrong: it came from `sq`).
    def plant(m, i, micro):
        m.fault = fault == "backward" and (i, micro) == (1, 0)
        x = torch.randn(4, 8)
        if fault == "forward" and (i, micro) == (1, 0):
            x[0, 0] = float("nan")
        return x

    eager = _accumulating_run(False, plant)
    compiled = _accumulating_run(True, plant)
    assert like_eager(compiled[0], eager[0])
    expected = ((1, "backward", "sq", "grad", True) if fault == "backward"
                else (1, "forward", "inp", "activation", False))
    assert eager[0] == expected


class LogGate(nn.Module):
    def forward(self, x):
        return torch.log(x)


class CalledTwice(nn.Module):
    """`gate` is called twice per forward: in a graph both calls write its rows, only the last
    value stays there (the write count says so)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = LogGate()
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.fault = False

    def forward(self, x):
        h = self.inp(x)
        h = self.gate(h if self.fault else h.abs() + 1.0)  # the fault: log of negatives in the first call
        h = self.mid(h)
        return self.head(self.gate(h.abs() + 1.0))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_module_called_twice_is_named_and_never_said_to_produce_what_it_cannot_know(fullgraph):
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(CalledTwice, 3, plant, dict(backend="aot_eager", fullgraph=fullgraph))
    assert key(eager) == (1, "forward", "gate", "activation", True)
    # The first call's row was overwritten by the second: its value survives as `mid`'s input,
    # named after the module that made it; what that call received is gone, so produced is None.
    assert key(compiled)[:4] == key(eager)[:4] and compiled.produced is None


class ThreeInputs(nn.Module):
    """Takes three floating inputs: in a graph only the first two are stamped (INPUTS rows)."""

    def __init__(self):
        super().__init__()
        self.fault = False

    def forward(self, a, b, c):
        return a + b + (c + torch.sqrt(c * 0.0) if self.fault else c)


class ThirdInputNet(nn.Module):
    """`inp`'s output goes to `q` and, as an unstamped third input, to `three`, whose backward makes
    the NaN: a graph sees only `q` take it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)
        self.three = ThreeInputs()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.three(x, x * 2.0, h) + self.q(h))


@pytest.mark.skipif(not GRAD_HOOKS, reason="this torch traces no tensor hook into a graph")
def test_a_consumer_through_an_unstamped_input_is_never_left_out():
    # Without the rule, `q` looked like the one consumer of `inp`'s output and was named, produced.
    def plant(m, i):
        m.three.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(ThirdInputNet, 3, plant, dict(backend="aot_eager", fullgraph=True))
    assert key(eager) == (1, "backward", "inp (output grad)", "grad", None)  # two consumers: cannot tell
    assert incident_tuple(compiled) == incident_tuple(eager)


def test_async_mode_decodes_compiled_sub_windows_a_step_later_like_eager():
    def plant(m, i, micro):
        m.fault = (i, micro) == (1, 0)
        return torch.randn(4, 8)

    eager = _accumulating_run(False, plant, mode="async")
    compiled = _accumulating_run(True, plant, mode="async")
    assert eager[0] == (1, "backward", "sq", "grad", True)
    assert like_eager(compiled[0], eager[0])


class CalledTwiceAcrossABreak(CalledTwice):
    """CalledTwice with a graph break between the two calls of `gate`: the first call's value
    reaches `mid` as an input of the second graph, where no note says who made it."""

    def forward(self, x):
        h = self.inp(x)
        h = self.gate(h if self.fault else h.abs() + 1.0)
        torch._dynamo.graph_break()
        h = self.mid(h)
        return self.head(self.gate(h.abs() + 1.0))


def test_a_module_called_twice_across_a_graph_break_is_never_called_the_parents_body():
    def plant(m, i):
        m.fault = i == 1
        return torch.randn(4, 8)

    eager, compiled = eager_and_compiled(CalledTwiceAcrossABreak, 3, plant, dict(backend="aot_eager"))
    assert key(eager) == (1, "forward", "gate", "activation", True)
    # Before: "(model)", produced (the root's body). The value `mid` took is the lost first call's
    # output: either `gate` is named, or nanscan says it cannot tell.
    assert (compiled.step, compiled.phase) == (1, "forward")
    assert compiled.name == "gate" or compiled.produced is None


class ArmedSq(nn.Module):
    """Identity until ``armed`` (set by the module itself at a step: dynamo recompiles its frame):
    then x + sqrt(0 * x), a finite forward with a NaN gradient."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x + torch.sqrt(x * 0.0) if self.armed else x


class ArmedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.sq = ArmedSq()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.mlp.fc2 = self.mlp[2]

    def forward(self, x):
        return x + self.sq(self.mlp(x))  # (fc2's output has one consumer, sq)


class ArmedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(ArmedBlock() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class SelfArmedSq(ArmedSq):
    """Arms itself at its third call (an attribute set inside the compiled forward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            self.armed = True
        return super().forward(x)


class SelfArmedNet(ArmedNet):
    def __init__(self):
        super().__init__()
        self.blocks[1].sq = SelfArmedSq()


@pytest.mark.skipif(not GRAD_HOOKS, reason="this torch cannot trace tensor hooks into the graph")
@pytest.mark.parametrize("who", ["loop", "module"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backward_fault_armed_by_a_recompile_is_named_like_eager(backend, who):
    def plant(m, i):
        if who == "loop":
            m.blocks[1].sq.armed = i == 2  # (a guard on the attribute: that frame recompiles at step 2)
        return torch.randn(4, 8)

    make = ArmedNet if who == "loop" else SelfArmedNet
    eager, compiled = eager_and_compiled(make, 4, plant, dict(backend=backend))
    assert key(eager) == (2, "backward", "blocks.1.sq", "grad", True)
    assert incident_tuple(compiled) == incident_tuple(eager)


WARM_RUN = r"""
import json
import torch, nanscan
from tests.test_monitor_compiled import SqNet, key
from torch._dynamo.utils import counters
out = {}
for fault in ("forward", "backward"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SqNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, on_nonfinite="record")
    fwd = torch.compile(model, backend="inductor")
    with mon:
        for i in range(3):
            model.fault = i == 1 and fault == "backward"
            x = torch.randn(4, 8)
            if i == 1 and fault == "forward":
                x[0, 0] = float("inf")
            fwd(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    out[fault] = list(key(mon.incident))
out["hits"] = counters["inductor"].get("fxgraph_cache_hit", 0)
print(json.dumps(out))
"""


def test_a_watched_compiled_rerun_is_served_by_inductors_cache_and_answers_the_same(tmp_path):
    # Note [compiled graphs cached]: a fresh process with a warm cache replays the cached graphs
    # (no new compile) and names the same incidents as the cold run.
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(pathlib.Path(__file__).parent.parent))
    runs = [json.loads(subprocess.run([sys.executable, "-c", WARM_RUN], env=env, capture_output=True, text=True,
                                      check=True, timeout=900).stdout.strip().splitlines()[-1]) for _ in range(2)]
    cold, warm = runs
    assert cold["forward"] == warm["forward"] == [1, "forward", "inp", "activation", False]
    assert cold["backward"] == warm["backward"]
    if GRAD_HOOKS:  # (a torch that cannot trace the gradient hooks says "cannot tell" there, cold and warm)
        assert warm["backward"] == [1, "backward", "sq", "grad", True]
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
        assert warm["hits"] > 0


class CountingSq(ArmedSq):
    """Arms itself after its third call from a call counter: the counter changes at every call, so
    dynamo recompiles this frame at every call until the recompile limit, then runs it eagerly --
    while the rest of the model stays compiled."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 3:
            self.armed = True
        return super().forward(x)


class BrokenBlock(ArmedBlock):
    def __init__(self):
        super().__init__()
        self.sq = CountingSq()

    def forward(self, x):
        h = self.mlp(x)
        torch._dynamo.graph_break()  # (sq in a frame of its own)
        return x + self.sq(h)


class BrokenNet(ArmedNet):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(BrokenBlock() for _ in range(2))


def test_frames_run_eagerly_past_the_recompile_limit_are_never_misnamed():
    # Note [eager frames beside compiled ones] (monitor.py): the order of eager and compiled rows in one
    # forward is unknown, so such a step's incidents say "cannot tell" rather than name a wrong place.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dynamo's recompile-limit warnings)
        eager, compiled = [], []
        for out, compile_kw in ((eager, None), (compiled, dict(backend="aot_eager"))):
            torch._dynamo.reset()
            torch.manual_seed(0)
            _, mon = run(BrokenNet(), 5, lambda m, i: torch.randn(4, 8), compile_kw, on_nonfinite="record")
            out += [key(inc) for inc in mon.incidents if inc.phase in ("forward", "backward")][:2]
    assert eager == [(3, "backward", "blocks.1.sq", "grad", True), (4, "forward", "inp", "activation", True)]
    assert len(compiled) == len(eager)
    for c, e in zip(compiled, eager):  # the same answer, or "cannot tell" -- never another place
        assert c == e or (c[:2] == e[:2] and c[4] is None), (compiled, eager)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("bare_first", [True, False])
def test_a_model_of_the_same_class_compiled_unwatched_never_takes_the_watched_ones_graph(bare_first):
    # Note [two instances of one class]: an eval copy, a teacher, a reference model of the watched
    # class, compiled without a monitor after watch: its graph (no hooks) passed the watched model's
    # guards, the watched model ran it, and its fault was named at '(model)' with certainty.
    torch._dynamo.reset()
    torch.manual_seed(0)
    watched, bare = TwoLayer(), TwoLayer()
    opt, bare_opt = torch.optim.SGD(watched.parameters(), lr=0.01), torch.optim.SGD(bare.parameters(), lr=0.01)
    before = torch._dynamo.config.skip_nnmodule_hook_guards
    x = torch.randn(4, 8)
    with nanscan.watch(watched, opt, on_nonfinite="record") as mon:
        compiled, compiled_bare = torch.compile(watched), torch.compile(bare)

        def bare_step():
            compiled_bare(x).pow(2).mean().backward()
            bare_opt.step()
            bare_opt.zero_grad()

        for i in range(3):
            if bare_first:
                bare_step()
            if i == 2:
                with torch.no_grad():
                    watched.a.weight[0, 0] = float("nan")
            compiled(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if not bare_first:
                bare_step()
    assert key(mon.incident) == (2, "forward", "a", "activation", True)
    assert torch.isfinite(bare.a.weight).all()  # (the bare model never saw the watched one's weights)
    assert torch._dynamo.config.skip_nnmodule_hook_guards == before  # the user's setting, back at close


def test_hook_guards_are_held_while_any_watching_monitor_is_open():
    from nanscan.monitor import traced

    before = torch._dynamo.config.skip_nnmodule_hook_guards
    first, second = TwoLayer(), TwoLayer()
    m1 = nanscan.watch(first)
    m2 = nanscan.watch(second)
    assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    m1.close()
    assert torch._dynamo.config.skip_nnmodule_hook_guards is False  # (the second still records activations)
    m2.close()
    m2.close()  # (a second close releases nothing more)
    assert torch._dynamo.config.skip_nnmodule_hook_guards == before and traced._hook_guard_holders == 0
    with nanscan.watch(TwoLayer(), activations=False):
        assert torch._dynamo.config.skip_nnmodule_hook_guards == before  # no module hooks: nothing to guard

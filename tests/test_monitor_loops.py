"""nanscan.watch on the loops people run: one call and no other change to the loop (no mon.step),
gradient accumulation, no optimizer, eval / no_grad / inference_mode forwards between steps,
compiled re-runs, model copies, buffers, checkpointing. Each planted fault asserts step, phase,
name, kind and produced; where nanscan cannot know, it must say so."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import nanscan
from nanscan.monitor.slots import at
from tests.test_monitor import Net  # embed -> block (log of a negative when block.fault) -> head

INF = float("inf")


def key(inc):
    return (inc.step, inc.phase, inc.name, inc.kind, inc.produced)


def raised_incident(model, plant, steps=3, batch=lambda: torch.randn(4, 8), **watch_options):
    """A plain loop (SGD, sum loss) that plants with ``plant(model, i)`` before step i; the incident
    the monitor raised (the test fails if none was)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, **watch_options)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(steps):
            plant(model, i)
            model(batch()).sum().backward()
            opt.step()
            opt.zero_grad()
    return err.value.incident


def plain_loop(model, opt, steps, fault_at=None, accumulate=1, x_fn=None):
    """The loop a user writes: no mon.step(), no check_loss."""
    torch.manual_seed(0)
    losses = []
    for i in range(steps):
        for micro in range(accumulate):
            model.block.fault = fault_at == (i, micro) or fault_at == i
            x = x_fn(i, micro) if x_fn else torch.randn(4, 8)
            loss = model(x).pow(2).mean() / accumulate
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def test_plain_loop_without_mon_step_stops_at_the_fault():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        plain_loop(model, opt, 6, fault_at=3)
    assert key(err.value.incident) == (3, "forward", "block", "activation", True)
    assert mon.ledger.attempted == 4 and mon.ledger.applied == 3 and mon.ledger.skipped_steps == [3]


def test_every_step_is_checked_and_counted_without_mon_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, on_nonfinite="record") as mon:
        plain_loop(model, opt, 5)
        assert mon.step_index == 5
    assert mon.incidents == [] and (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped) == (5, 5, 0)


def test_gradient_accumulation_is_one_step_per_optimizer_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        plain_loop(model, opt, 3, accumulate=4)
        assert mon.step_index == 3
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped_steps) == (3, 3, [])
    # a fault in the third micro-batch of step 1 is named in step 1, produced in block
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        plain_loop(model, opt, 3, accumulate=4, fault_at=(1, 2))
    assert key(err.value.incident) == (1, "forward", "block", "activation", True)


def test_nan_gradient_of_an_earlier_micro_batch_is_not_blamed_on_a_later_one():
    # micro-batch 0 of step 1 makes a NaN only in the gradient of `head.weight` (hook), micro-batch 1
    # is clean: the accumulated gradient is NaN and must be reported once, in step 1, as the
    # gradient -- not as something micro-batch 1 produced in its forward.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    poison = {"on": False}
    model.head.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    mon = nanscan.watch(model, opt, on_nonfinite="record")
    with mon:
        for i in range(3):
            for micro in range(2):
                poison["on"] = (i, micro) == (1, 0)
                model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    found = [(i.step, i.phase, i.name, i.kind) for i in mon.incidents]
    assert found[0] == (1, "backward", "head.weight", "grad")
    assert not any(i.step == 1 and i.phase == "forward" for i in mon.incidents)
    # (record mode lets the NaN update through: step 2's forward then meets a NaN weight in `head`)


def test_every_n_ledger_counts_every_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, every=3) as mon:
        plain_loop(model, opt, 7)
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped) == (7, 7, 0)


def test_no_optimizer_steps_end_at_the_next_training_forward():
    torch.manual_seed(0)
    model = Net()
    mon = nanscan.watch(model)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(5):
            model.block.fault = i == 2
            model(torch.randn(4, 8)).sum().backward()
            model.zero_grad()
    assert key(err.value.incident) == (2, "forward", "block", "activation", True)
    # the last step of a loop without optimizer is read at close
    torch.manual_seed(0)
    model = Net()
    mon = nanscan.watch(model, on_nonfinite="record")
    with mon:
        for i in range(3):
            model.block.fault = i == 2
            model(torch.randn(4, 8)).sum().backward()
    assert [key(i) for i in mon.incidents][0] == (2, "forward", "block", "activation", True)


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "eval"])
def test_eval_forwards_between_steps_never_disturb_training_steps(how):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)

    def evaluate():
        if how == "no_grad":
            with torch.no_grad():
                model(torch.randn(2, 8))
        elif how == "inference_mode":
            with torch.inference_mode():
                model(torch.randn(2, 8))
        else:
            model.eval()
            model(torch.randn(2, 8))
            model.train()

    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(5):
            model.block.fault = i == 3
            model(torch.randn(4, 8)).pow(2).mean().backward()
            evaluate()  # after the backward, before the update: a validation pass mid-step
            opt.step()
            opt.zero_grad()
            evaluate()
    assert key(err.value.incident) == (3, "forward", "block", "activation", True)
    # step 3 was stopped before its update
    assert mon.step_index == 4 and mon.ledger.applied == 3 and mon.ledger.skipped_steps == [3]


def test_eval_incident_is_phase_eval_and_warned_not_raised_by_default():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        plain_loop(model, opt, 2)
        model.block.fault = True
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="phase eval"):
            model(torch.randn(2, 8))
        model.block.fault = False
        plain_loop(model, opt, 2)
    assert [key(i) for i in mon.incidents] == [(2, "eval", "block", "activation", True)]
    assert mon.ledger.applied == 4
    with nanscan.watch(model, opt, eval_forwards="raise"):
        model.block.fault = True
        with torch.no_grad(), pytest.raises(nanscan.NonFiniteError):
            model(torch.randn(2, 8))
        model.block.fault = False
    with nanscan.watch(model, opt, eval_forwards="skip") as mon3:
        model.block.fault = True
        with torch.no_grad():
            model(torch.randn(2, 8))
        model.block.fault = False
    assert mon3.incidents == []


class Attention(nn.Module):
    """softmax over a fully masked row (NaN) made in the module's own body, then fed to a child."""

    def __init__(self, d=8):
        super().__init__()
        self.qk = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.mask_all = False

    def forward(self, x):
        scores = self.qk(x) @ x.transpose(-1, -2)
        if self.mask_all:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), -INF)
        return self.proj(F.softmax(scores, dim=-1) @ x)


class AttnNet(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.attn = Attention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.attn(self.inp(x)))


def test_functional_op_in_a_module_body_is_blamed_on_that_module_not_its_child():
    torch.manual_seed(0)
    inc = raised_incident(AttnNet(), lambda m, i: setattr(m.attn, "mask_all", i == 1),
                          batch=lambda: torch.randn(2, 5, 8))
    assert key(inc) == (1, "forward", "attn", "activation", True)
    assert inc.summary.shape == (2, 5, 8)  # the real shape of the body value


class SqrtZero(nn.Module):
    """Finite forward (x + sqrt(0 * x) = x), NaN gradient: d sqrt(u)/du at u = 0 is inf, times 0."""

    def forward(self, x):
        return x + torch.sqrt(x * 0.0)


class SqNet(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.sq = SqrtZero()
        self.head = nn.Linear(d, 1)
        self.fault = False

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.sq(h) if self.fault else h)


def test_backward_only_fault_is_named_after_the_module_whose_backward_made_it():
    torch.manual_seed(0)
    inc = raised_incident(SqNet(), lambda m, i: setattr(m, "fault", i == 1))
    assert key(inc) == (1, "backward", "sq", "grad", True)


def test_batchnorm_running_var_overflow_is_a_buffer_incident():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))
    model(torch.randn(2, 3, 6, 6))  # materialize the lazy layer
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            if i == 1:
                with torch.no_grad():
                    model[0].weight.mul_(1e30)  # conv outputs ~1e30: finite; their variance is not
            model(torch.randn(2, 3, 6, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind) == (1, "update", "1.running_var", "buffer")
    assert inc.summary.shape == (4,)
    with nanscan.watch(model, opt, buffers=False, on_nonfinite="record") as mon2:
        model(torch.randn(2, 3, 6, 6)).sum().backward()
        opt.step()
    assert all(i.kind != "buffer" for i in mon2.incidents)


def test_a_deep_copy_of_the_watched_model_is_not_watched_and_never_blamed():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        ema = copy.deepcopy(model)  # an EMA / teacher copy made while watched
        ema.block.fault = True  # NaN only in the copy
        for _ in range(3):
            with torch.no_grad():
                ema(torch.randn(4, 8))
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mon.incidents == []


def test_non_reentrant_checkpointing_is_not_double_counted():
    class Ckpt(Net):
        def forward(self, x):
            h = self.embed(x)
            h = checkpoint(self.block, h, use_reentrant=False)
            return self.head(h)

    torch.manual_seed(0)
    model = Ckpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    mon = nanscan.watch(model, opt)
    original = mon._decode

    def spy(copy_, **kw):
        slots = [at(copy_.slots, i) for i in range(len(copy_.slots))]
        seen.append([s.name for s in slots if s.phase == "forward"])
        return original(copy_, **kw)

    mon._decode = spy
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            model.block.fault = i == 2
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert seen[0].count("block") == 1  # the recomputation in the backward is not recorded again
    assert key(err.value.incident) == (2, "forward", "block", "activation", True)


class DictOut(nn.Module):
    """HF-style: keyword batch in, a mapping out."""

    def __init__(self):
        super().__init__()
        self.body = Net()

    def forward(self, input_ids=None, labels=None):
        logits = self.body(input_ids)
        return {"logits": logits, "loss": (logits - labels).pow(2).mean()}


def test_dict_batch_and_mapping_output_plain_loop():
    torch.manual_seed(0)
    model = DictOut()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            batch = {"input_ids": torch.randn(4, 8), "labels": torch.randn(4, 1)}
            if i == 1:
                batch["labels"][0, 0] = INF
            out = model(**batch)
            out["loss"].backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    # the loss the model returns (HF style), made from a non-finite label: it is the loss, and it
    # was propagated from the batch
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "loss", "loss", "loss", False)
    assert inc.inputs == ("(model).input.labels",)


def test_capture_without_mon_step_keeps_the_forward_inputs(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path))
    xs = []

    def x_fn(i, micro):
        xs.append(torch.randn(4, 8))
        return xs[-1]

    with pytest.raises(nanscan.NonFiniteError), mon:
        plain_loop(model, opt, 4, fault_at=2, x_fn=x_fn)
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert torch.equal(bundle.inputs, xs[2])


def test_module_returning_its_own_parameter_gets_no_hook_per_step():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self):
            return self.w

    class UsesTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = Table()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x * self.table())

    torch.manual_seed(0)
    model = UsesTable()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert model.table.w._backward_hooks in (None, {}) or len(model.table.w._backward_hooks) == 0
    assert mon.incidents == []


def test_without_activation_gradients_a_backward_fault_is_not_guessed():
    torch.manual_seed(0)
    inc = raised_incident(SqNet(), lambda m, i: setattr(m, "fault", i == 1), activation_grads=False)
    assert (inc.step, inc.phase, inc.kind, inc.produced) == (1, "backward", "grad", None)
    assert inc.name == "inp.weight" and "cannot tell" in str(inc)


def test_a_batch_that_cannot_be_kept_does_not_wedge_the_monitor(tmp_path):
    import numpy as np

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, capture_dir=str(tmp_path)) as mon:
        with pytest.raises(TypeError, match="cannot store a batch element"):
            with mon.step(np.zeros(3)):
                pass
        with mon.step(torch.randn(4, 8)):  # the next step works
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert mon.step_index == 1


@pytest.mark.parametrize("backend", [None, "reference"])
def test_backward_attribution_same_with_every_kernel_backend(backend, monkeypatch):
    # The C++ tap (csrc/monitor/grad_sink.h) takes the gradients of module outputs whatever the
    # backend: with the default kernels it summarizes them without Python, with another backend
    # (here the reference) it calls that backend's summarize_many. Same incident either way.
    from nanscan.kernels import reference

    torch.manual_seed(0)
    calls = []
    original = reference.summarize_many

    def counting(xs):
        calls.append(len(xs))
        return original(xs)

    monkeypatch.setattr(reference, "summarize_many", counting)
    inc = raised_incident(SqNet(), lambda m, i: setattr(m, "fault", i == 1), backend=backend)
    assert bool(calls) == (backend == "reference")
    assert key(inc) == (1, "backward", "sq", "grad", True) and inc.summary.shape == (4, 8)


def test_a_loss_the_model_returns_is_the_loss_and_is_logged(tmp_path):
    class LogLoss(DictOut):
        def forward(self, input_ids=None, labels=None):
            logits = self.body(input_ids)
            return {"logits": logits, "loss": torch.log(logits - labels.abs() - 1e3).mean()}  # log of a negative

    import json

    torch.manual_seed(0)
    model = LogLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "events.jsonl"
    mon = nanscan.watch(model, opt, log=str(log))
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        out = model(input_ids=torch.randn(4, 8), labels=torch.randn(4, 1))
        out["loss"].backward()
        opt.step()
    assert key(err.value.incident) == (0, "loss", "loss", "loss", True)
    steps = [json.loads(line) for line in log.read_text().splitlines() if '"step"' in line]
    assert any(e.get("type") == "step" and e.get("loss") == {"finite": False, "value": "nan"} for e in steps)


def test_every_offender_of_a_step_is_listed_with_a_ready_allow_line():
    class Head(nn.Module):
        """Pads its logits with -inf (intended: a detection head's unused slots)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return torch.cat([self.lin(x), torch.full_like(x[..., :2], -INF)], dim=-1)

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(Head() for _ in range(3))

        def forward(self, x):
            return [h(x) for h in self.heads]

    def train(mon, model, opt):
        with mon:
            for _ in range(2):
                outs = model(torch.randn(2, 8))
                sum(o[..., :4].sum() for o in outs).backward()
                opt.step()
                opt.zero_grad()

    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, on_nonfinite="record")
    train(mon, model, opt)
    assert mon.offenders[0] == ["heads.0", "heads.1", "heads.2"]  # all of them, not only the first
    assert mon.allow_patterns() == ("heads.0", "heads.1", "heads.2")
    assert mon.allow_line() == "allow=('heads.0', 'heads.1', 'heads.2')"
    with pytest.warns(RuntimeWarning, match=r"Also non-finite in this step: heads.1, heads.2.*allow=\("):
        train(nanscan.watch(model, opt, on_nonfinite="warn"), model, opt)
    quiet = nanscan.watch(model, opt, allow=mon.allow_patterns())
    train(quiet, model, opt)
    assert quiet.incidents == [] and quiet.offenders == {}


def test_async_fault_in_the_last_step_is_reported_at_exit_without_close(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, nanscan\n"
        "from tests.test_monitor import Net\n"
        "torch.manual_seed(0)\n"
        "model = Net()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "mon = nanscan.watch(model, opt, mode='async')\n"
        "for i in range(3):\n"
        "    model.block.fault = i == 2  # the last step: async mode would read it one step later\n"
        "    model(torch.randn(4, 8)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "print('training done')\n")
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=root, env={**__import__("os").environ, "PYTHONPATH": root})
    assert "training done" in out.stdout
    assert "nanscan (at exit, monitor never closed)" in out.stderr and "'block' at step 2" in out.stderr


def test_bad_optimizer_or_a_failed_install_leaves_no_hook_on_the_model(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        nanscan.watch(model, optimizer="sgd")
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        nanscan.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=1.0)
    assert hooks() == 0

    def broken(*args):
        raise RuntimeError("planted failure while wrapping the scaler")

    monkeypatch.setattr(nanscan.monitor.monitor, "wrap_scaler", broken)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="planted failure"):
        nanscan.watch(model, opt, torch.amp.GradScaler("cpu"))
    assert hooks() == 0 and not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    with nanscan.watch(model, opt):  # and the model can be watched afterwards
        pass


def test_parameters_without_a_gradient_are_skipped_and_the_rest_named():
    """A branch unused in a step leaves its parameters' .grad None: the read takes the others (the
    C++ TensorSet path with some missing) and still names the faulty gradient."""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(self.body(x))

    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanscan.watch(model, opt, on_nonfinite="record") as mon:
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            if step == 1:
                model.body.weight.grad[0, 0] = float("nan")  # a gradient hook's bug, say
            opt.step()
            opt.zero_grad()
    assert model.unused.weight.grad is None
    inc = mon.incidents[0]  # (the NaN then reaches the weight and the next steps: recorded, not raised)
    assert (inc.step, inc.phase, inc.kind, inc.name) == (1, "backward", "grad", "body.weight")


@pytest.mark.parametrize("overwrite_params", [False, True])
def test_a_model_moved_after_watch_is_checked_in_its_new_tensors(overwrite_params):
    # model.to(dtype) after watch: the buffers are new tensors (and, with the overwrite flag, the
    # parameters too); the checks must read the new ones, not the old ones.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 1))
    mon = nanscan.watch(model)  # (no optimizer: steps end at the next training forward)
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite_params)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(4):
            if i == 2:
                with torch.no_grad():
                    model[0].weight.mul_(1e200)  # float64 outputs ~1e200: finite; their variance is not
            model(torch.randn(2, 3, 6, 6, dtype=torch.float64)).sum().backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.name, inc.kind) == (2, "1.running_var", "buffer")
    assert inc.summary.dtype == torch.float64


@pytest.mark.parametrize("backend, produced", [("reference", None), (None, True)])
def test_a_gradient_changed_in_place_after_it_was_received_is_never_read_as_its_producers(backend, produced):
    """A backward that changes the gradient it received in place (here: the next node's custom
    backward poisons it) must not make the monitor read the later value as what the earlier
    node's backward made.

    * Batched (another backend; device tensors): the C++ tap queues the gradient flowing into a
      module output and summarizes it later. Its record is then of the later value: the row is
      stale, never read as what ``out``'s backward made. Without the staleness check the incident
      named ``out``, produced -- a wrong place; it is ``poison``, where the NaN came from, with
      "cannot tell" for produced (what flowed into it is unknown).
    * Summarized on arrival (CPU tensors, default kernels): the record is of the value received,
      finite; the NaN is first in the gradient ``poison``'s backward made -- produced there."""

    class PoisonGradInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.mul_(float("nan"))  # changes the gradient it received, in place

    class Poison(nn.Module):
        def forward(self, x):
            return PoisonGradInPlace.apply(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.poison, self.out = nn.Linear(4, 4), Poison(), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.poison(self.inp(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanscan.watch(model, opt, on_nonfinite="record", backend=backend) as mon:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    inc = mon.incidents[0]
    assert (inc.step, inc.phase, inc.kind, inc.name, inc.produced) == (0, "backward", "grad", "poison", produced)


def test_a_module_that_declares_it_works_in_place_keeps_produced():
    """A call that changes its input in place gives its outputs "cannot tell" -- unless the module
    says it works in place (``inplace=True``): it computes from what its input held when the call
    began, which is what the input's record holds. ``nn.Threshold(0, inf, inplace=True)`` turns the
    non-positive values of a finite input into +inf: made there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Threshold(0.0, float("inf"), inplace=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanscan.watch(model, opt, on_nonfinite="record") as mon:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    inc = mon.incidents[0]
    assert (inc.step, inc.phase, inc.kind, inc.name, inc.produced) == (0, "forward", "activation", "1", True)


class TwoInputs(nn.Module):
    """Takes its inputs in a list, a dict and a tensor subclass: the hooks' walk must find each."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, pair, extra):
        return self.a(pair[0]) + self.b(pair[1]) + extra["bias"]


@pytest.mark.parametrize("where", ["list", "dict", "subclass"])
def test_batch_inputs_in_lists_dicts_and_tensor_subclasses_are_recorded_with_their_labels(where):
    # The C++ walk (gather in csrc/monitor/walk.h) tests plain tensors first, then containers,
    # and only then tensor subclasses (nn.Parameter here): a NaN in any of them is the batch's,
    # named where it sat, and the first layer that took it only propagated it.
    torch.manual_seed(0)
    model = TwoInputs()
    mon = nanscan.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pair = [torch.randn(2, 4), torch.randn(2, 4)]
    extra = {"bias": torch.zeros(4)}
    if where == "list":
        pair[1][0, 0] = float("nan")
    elif where == "dict":
        extra["bias"][1] = float("nan")
    else:
        pair[0] = nn.Parameter(torch.full((2, 4), float("nan")), requires_grad=False)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        model(pair, extra).sum().backward()
        mon.optimizer.step()
    inc = err.value.incident
    label = {"list": "(model).input[0][1]", "dict": "(model).input[1].bias", "subclass": "(model).input[0][0]"}[where]
    assert inc.phase == "forward" and inc.produced is False
    assert label in inc.inputs, (inc.name, inc.inputs)


def test_a_nested_tensor_output_is_not_recorded_and_never_stops_the_forward():
    # nn.TransformerEncoder's fast path returns nested tensors in eval; the kernels do not take
    # them (no sizes), so the hooks leave them out -- before, the eval forward raised inside the hook.
    class ToNested(nn.Module):
        def forward(self, x):
            return torch.nested.nested_tensor([x[0], x[1, :2]])

    model = nn.Sequential(nn.Linear(4, 4), ToNested())
    mon = nanscan.watch(model, on_nonfinite="record")
    model.eval()
    with torch.no_grad(), mon:
        model[0].bias.fill_(float("nan"))
        out = model(torch.randn(2, 4))
    assert out.is_nested
    assert [(i.phase, i.name) for i in mon.incidents] == [("eval", "0")]  # the Linear before it is still checked


def test_a_module_fed_a_nested_tensor_that_nanscan_could_not_record_gets_cannot_tell():
    # The nested tensor is left out of the records, so a NaN it carried is unknown to attribution:
    # the module that took it must not be named as the one that produced the NaN.
    class ToNested(nn.Module):
        def forward(self, x):
            return torch.nested.nested_tensor([x[0] * float("nan"), x[1, :2]])

    class ToPadded(nn.Module):
        def forward(self, x):
            return torch.nested.to_padded_tensor(x, 0.0)

    model = nn.Sequential(nn.Linear(4, 4), ToNested(), ToPadded())
    mon = nanscan.watch(model, on_nonfinite="record")
    model.eval()
    with torch.no_grad(), mon:
        model(torch.randn(2, 4))
    inc = mon.incidents[0]
    assert (inc.phase, inc.name, inc.produced) == ("eval", "2", None)



@pytest.mark.parametrize("on_nonfinite", ["record", "warn"])
def test_lbfgs_keeps_one_incident_per_step_and_phase_however_often_it_calls_the_closure(on_nonfinite):
    # LBFGS evaluates the closure (forward + backward) several times in one optimizer step, and the
    # step is read after each call: the later evaluations, at the parameters LBFGS moved in between,
    # meet the same fault or what followed from it. The step's incident is its first.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    x = torch.randn(16, 8)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanscan.watch(model, opt, on_nonfinite=on_nonfinite) as mon:
            for step in range(3):
                model.block.fault = step == 1

                def closure(step=step):
                    calls.append(step)
                    opt.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    return loss

                opt.step(closure)
    assert calls.count(1) > 1  # (the closure ran more than once in the faulty step)
    keys = [(i.step, i.phase) for i in mon.incidents]
    assert len(keys) == len(set(keys)), keys
    assert key(mon.incidents[0]) == (1, "forward", "block", "activation", True)
    assert keys[:4] == [(1, "forward"), (1, "loss"), (1, "backward"), (1, "update")]
    if on_nonfinite == "warn":
        import re

        warned = [re.search(r"at step (\d+), phase (\w+)", str(w.message)) for w in caught
                  if issubclass(w.category, RuntimeWarning) and "non-finite" in str(w.message)]
        warned = [(int(m.group(1)), m.group(2)) for m in warned]
        assert warned and len(warned) == len(set(warned)) and set(warned) <= set(keys), warned  # none warned twice


def update_after_the_block(mon, model, opt, steps, plant=None, backward_inside=True, scaler=None, factor=None):
    """``with mon.step(batch):`` around the forward (and the backward), the optimizer step after it;
    ``factor(i)`` multiplies step i's loss."""
    for i in range(steps):
        if plant is not None:
            plant(model, i)
        x = torch.randn(4, 8)
        with mon.step((x,)):
            loss = model(x).pow(2).mean() * (factor(i) if factor is not None else 1.0)
            if backward_inside:
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if not backward_inside:
            loss.backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("backward_inside", [True, False])
@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_an_optimizer_step_after_the_mon_step_block_is_that_steps_update(fault, backward_inside):
    # `with mon.step(batch): loss = ...; loss.backward()` then `opt.step()` after the block: the
    # update is the block's step's, not a step of its own (step numbers would double, and a read
    # before it would see gradients without their forward).
    torch.manual_seed(0)
    model = SqNet() if fault == "backward" else Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def plant(m, i):
        if fault == "backward":
            m.fault = i == 2
        else:
            m.block.fault = i == 2

    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        update_after_the_block(mon, model, opt, 4, plant, backward_inside)
    want = (2, "forward", "block", "activation", True) if fault == "forward" else (2, "backward", "sq", "grad", True)
    assert key(err.value.incident) == want
    assert mon.step_index == 3  # (one step per block)
    assert (mon.ledger.attempted, mon.ledger.applied) == (3, 2)  # step 2 was stopped before its update
    assert torch.isfinite(model.head.weight).all()


def test_mon_step_blocks_with_the_update_after_them_count_one_step_each_in_the_log(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    log = tmp_path / "log.jsonl"
    with nanscan.watch(model, opt, scaler, log=str(log)) as mon:
        # step 1's finite loss overflows once scaled: GradScaler skips that update
        update_after_the_block(mon, model, opt, 4, scaler=scaler, factor=lambda i: 1e36 if i == 1 else 1.0)
        # blocks whose optimizer step never comes end when the next one begins, and at close
        for _ in range(2):
            with mon.step():
                model(torch.randn(4, 8)).sum().backward()
            opt.zero_grad()
    assert [(i.step, i.phase, i.handled_by_scaler) for i in mon.incidents] == [(1, "backward", True)]
    assert mon.step_index == 6
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped_steps) == (4, 3, [1])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r.get("type") == "step"]
    assert [r["step"] for r in steps] == list(range(6))
    assert [r["update"] for r in steps] == ["applied", "skipped", "applied", "applied", None, None]


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_two_watched_models_each_take_only_their_own_loss():
    a, b = _mlp(0), _mlp(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
    log = []
    mon_a = nanscan.watch(a, opt_a, on_nonfinite="record")
    mon_b = nanscan.watch(b, opt_b, on_nonfinite="record")
    with mon_a, mon_b:
        for step in range(4):
            x = torch.randn(8, 4)
            loss_a = a(x).pow(2).mean()
            loss_b = b(x).pow(2).mean() * (float("nan") if step == 2 else 1.0)
            loss_a.backward()
            loss_b.backward()
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
            log.append(mon_a.state.index)
    assert mon_a.incidents == []  # (model b's NaN loss is not model a's)
    assert (mon_b.incident.step, mon_b.incident.phase, mon_b.incident.name) == (2, "loss", "loss")
    assert log == [1, 2, 3, 4]


def test_a_watched_frozen_teacher_takes_no_loss_from_the_students_backward():
    teacher, student = _mlp(0).requires_grad_(False), _mlp(1)
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    with nanscan.watch(teacher, on_nonfinite="record") as mon_t, \
            nanscan.watch(student, opt, on_nonfinite="record") as mon_s:
        for step in range(3):
            x = torch.randn(8, 4)
            with torch.no_grad():
                target = teacher(x)
            loss = (student(x) - target).pow(2).mean() * (float("nan") if step == 1 else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert [(i.step, i.phase) for i in mon_s.incidents][:1] == [(1, "loss")]
    assert all(i.phase == "eval" for i in mon_t.incidents)  # (its forwards: under no_grad, after the NaN weights)

"""The loops a hostile battery and a new user found the monitor breaking or misleading on: each
test fails on the monitor before its fix. Wrong answers become right ones or "cannot tell";
crashes become runs that go on; options are refused at ``watch`` with what is accepted."""
import copy
import dataclasses
import io
import pickle
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import nanscan
from tests.test_monitor import Net  # embed -> block (log of a negative when block.fault) -> head

NAN = float("nan")


def key(inc):
    return (inc.step, inc.phase, inc.name, inc.kind, inc.produced)


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def sgd_loop(model, opt, steps, loss=lambda out: out.pow(2).mean(), x=lambda i: torch.randn(4, 8)):
    for i in range(steps):
        loss(model(x(i))).backward()
        opt.step()
        opt.zero_grad()


# ---------------------------------------------------------------- options refused at watch
@pytest.mark.parametrize("options, match", [
    (dict(allow=[1]), "allow"),
    (dict(allow=("*.mask", None)), "allow"),
    (dict(every=True), "every"),
    (dict(activations="no"), "activations"),
    (dict(grads=1), "grads"),
    (dict(capture_dir=123), "capture_dir"),
    (dict(keep_pre_update_state="yes"), "keep_pre_update_state"),
    (dict(backend="nope"), "backend"),
    (dict(log=3.5), "log"),
])
def test_every_option_is_validated_at_watch(options, match):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = hook_count(model)
    with pytest.raises((TypeError, ValueError), match=match):
        nanscan.watch(model, opt, **options)
    assert hook_count(model) == before
    nanscan.watch(model, opt).close()  # nothing was left "already watched"


def test_a_scaler_without_its_optimizer_is_refused():
    model = Net()
    with pytest.raises(ValueError, match="optimizer"):
        nanscan.watch(model, None, torch.amp.GradScaler("cpu"))
    assert hook_count(model) == 0


def test_keep_pre_update_state_without_capture_dir_is_refused():
    model = Net()
    with pytest.raises(ValueError, match="capture_dir"):
        nanscan.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), keep_pre_update_state=True)


# ---------------------------------------------------------------- training in model.eval()
def test_training_in_eval_mode_is_training_and_names_the_fault():
    torch.manual_seed(0)
    model = Net()
    model.eval()  # fine-tuning with frozen BatchNorm / no dropout
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        sgd_loop(model, opt, 3)
    assert mon.incidents == [] and mon.ledger.applied == 3
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            model.block.fault = i == 1
            sgd_loop(model, opt, 1)
    assert key(err.value.incident) == (1, "forward", "block", "activation", True)


# ---------------------------------------------------------------- pickling and copies
def test_a_watched_model_pickles_and_its_copy_carries_no_hooks():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt):
        sgd_loop(model, opt, 1)
        buffer = io.BytesIO()
        torch.save(model, buffer)  # a whole-model checkpoint
        clone = pickle.loads(pickle.dumps(model))
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    for m in (clone, loaded):  # unwatched: nanscan's hooks remove themselves at the first call
        assert torch.equal(m(torch.ones(2, 8)), model(torch.ones(2, 8)))
        assert hook_count(m) == 0
    nanscan.watch(clone).close()  # an unwatched copy can be watched


def test_close_leaves_no_hook_on_deep_copies_of_the_model():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    ema = copy.deepcopy(model)  # an EMA copy made while watched
    sgd_loop(model, opt, 2)
    with torch.no_grad():
        ema(torch.randn(2, 8))
    mon.close()
    assert hook_count(model) == 0
    assert hook_count(ema) == 0  # close removes nanscan's hooks from the copy (tests/test_hooks_on_copies.py)
    with torch.no_grad():
        ema(torch.randn(2, 8))


# ---------------------------------------------------------------- TorchScript submodules
class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.core = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = nn.Linear(8, 1)
        self.fault = False

    def forward(self, x):
        h = self.core(self.embed(x))
        if self.fault:
            h = torch.log(h - 100.0)
        return self.head(h)


def test_a_scripted_submodule_is_watched_around():
    torch.manual_seed(0)
    model = Scripted()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            model.fault = i == 2
            sgd_loop(model, opt, 1)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.kind) == (2, "forward", "activation")
    assert inc.name == "(model)" and inc.produced is True  # the log in the root's body, fed by core's output
    assert hook_count(model) == 0


# ---------------------------------------------------------------- -W error
def test_nanscans_own_warnings_never_stop_a_run_under_warnings_as_errors(tmp_path):
    script = f"""
import torch, nanscan
from tests.test_monitor import Net
torch.manual_seed(0)
model = Net(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
with nanscan.watch(model, opt, log={str(tmp_path / 'no' / 'such' / 'dir' / 'x.jsonl')!r}) as mon:
    for i in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    model.block.fault = True
    with torch.no_grad():
        model(torch.randn(2, 8))  # an eval NaN: warned, never raised
    model.block.fault = False
with nanscan.watch(model, opt, on_nonfinite="warn") as mon2:
    model.block.fault = True
    model(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
print("incidents", len(mon.incidents), mon2.incident.phase)
"""
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True,
                          cwd=str(__import__("pathlib").Path(__file__).parent.parent), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "incidents 1 forward" in done.stdout
    assert "phase eval" in done.stderr  # the warning still reaches the user, as text


# ---------------------------------------------------------------- a forward that raised midway
class Fragile(Net):
    def forward(self, x):
        h = self.block(self.embed(x))
        if not torch.isfinite(h).all():  # the user's own check: skip the batch
            raise FloatingPointError("bad batch")
        return self.head(h)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_forward_that_raised_on_a_bad_batch_leaves_nothing_for_the_next_step(mode):
    torch.manual_seed(0)
    model = Fragile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, mode=mode) as mon:
        for i in range(4):
            model.block.fault = i == 1
            try:
                out = model(torch.randn(4, 8))
            except FloatingPointError:
                continue  # the batch is skipped: no backward, no step
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mon.ledger.applied == 3 and mon.ledger.skipped_steps == []
    assert [i.phase for i in mon.incidents] in ([], ["forward"])  # recorded at most, never raised


# ---------------------------------------------------------------- Accelerate's wrappers
def test_accelerate_wrapped_optimizer_and_scaler_are_accepted():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            model.block.fault = i == 2
            accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
            opt.step()
            opt.zero_grad()
    assert key(err.value.incident) == (2, "forward", "block", "activation", True)
    assert mon.ledger.applied == 2


# ---------------------------------------------------------------- outputs nanscan must see into
@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    aux: float = 0.0


class DataclassChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fault = False

    def forward(self, x):
        h = self.lin(x)
        return Out(torch.log(h - 100.0) if self.fault else torch.tanh(h))


class GeneratorChild(DataclassChild):
    def forward(self, x):
        h = self.lin(x)
        return (t for t in [torch.log(h - 100.0) if self.fault else torch.tanh(h)])


class Parent(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        out = self.child(x)
        h = out.hidden if isinstance(out, Out) else next(iter(out))
        return self.head(h * 2)  # (a value made in the parent's body, fed to head)


def child_fault_incident(child):
    """The incident raised when ``child`` (in a Parent) makes a NaN at step 1."""
    torch.manual_seed(0)
    model = Parent(child)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            model.child.fault = i == 1
            sgd_loop(model, opt, 1)
    return err.value.incident


def test_a_dataclass_output_is_walked_and_its_nan_named_at_the_child():
    # (output field, as for dicts)
    assert key(child_fault_incident(DataclassChild())) == (1, "forward", "child.hidden", "activation", True)


def test_a_generator_output_nanscan_cannot_see_into_gives_cannot_tell():
    inc = child_fault_incident(GeneratorChild())
    assert (inc.step, inc.phase) == (1, "forward")
    assert inc.produced is None  # never "(model) produced": the NaN came out of the generator


class Wrapper(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass that holds its data in an inner tensor (torchao /
    float8 style): the wrapper itself has no storage."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):
        return f"Wrapper({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


class WrapsActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return Wrapper(self.lin(x).detach())


class WrapNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.wrap = WrapsActivations()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.wrap(x).inner) + self.wrap.lin(x).sum()


def test_a_wrapper_subclass_activation_is_left_out_and_training_goes_on():
    torch.manual_seed(0)
    model = WrapNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt) as mon:
        sgd_loop(model, opt, 3)
    assert mon.incidents == [] and mon.ledger.applied == 3


# ---------------------------------------------------------------- optimizer state
def test_a_nan_in_adam_state_before_the_update_is_named_at_the_state_not_the_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt, optimizer_state=True)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(5):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if i == 2:
                opt.state[model[2].weight]["exp_avg_sq"][0, 0] = NAN  # (before this step's update)
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (
        2, "update", "2.weight.exp_avg_sq", "optimizer_state", None)


# ---------------------------------------------------------------- the warning of on_nonfinite="warn"
def test_the_warning_names_what_was_produced_counts_what_propagated_and_never_suggests_muting():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model[3].weight[0, 0] = NAN  # a NaN made in layer 3; layers 4 .. 11 only carry it on
    with nanscan.watch(model, opt, on_nonfinite="warn") as mon:
        with pytest.warns(RuntimeWarning) as caught:
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    text = str(caught[0].message)
    assert "module '3'" in text
    assert "computed from non-finite ones" in text
    assert "allow=" not in text  # propagated values are not an allow-list
    assert len(mon.offenders[0]) > 8


# ---------------------------------------------------------------- the loss is what backward is called on
def test_a_nan_loss_computed_outside_the_model_is_recorded_with_no_extra_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            logits = model(torch.randn(4, 8))
            y = torch.randint(0, 4, (4,))
            shift = 5.0 if i == 1 else -5.0  # log of a negative mean at step 1: a NaN loss, finite gradients
            loss = nn.functional.cross_entropy(logits, y) + 0.01 * torch.log(logits.mean(-1) - shift).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert key(err.value.incident) == (1, "loss", "loss", "loss", True)
    assert mon.ledger.applied == 1  # the NaN step was stopped before its update


def test_a_loss_of_the_parameters_alone_trains_and_says_cannot_tell():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, on_nonfinite="record") as mon:
        for i in range(3):
            loss = sum(p.pow(2).sum() for p in model.parameters())
            if i == 1:
                loss = loss * NAN
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert mon.ledger.attempted == 3
    first = mon.incident
    assert (first.step, first.phase, first.kind, first.produced) == (1, "loss", "loss", None)


def test_gradscaler_loss_is_recorded_once_unscaled():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126)  # the scaled loss overflows float32
    with nanscan.watch(model, opt, scaler, on_nonfinite="record") as mon:
        for _ in range(2):
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean() * 1e10).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert all(i.phase != "loss" for i in mon.incidents)


# ---------------------------------------------------------------- close after a raised incident
def test_async_close_after_a_raised_incident_never_raises_a_second_one():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, mode="async")
    with pytest.raises(nanscan.NonFiniteError) as err:
        try:
            for i in range(5):
                model.block.fault = i >= 2
                sgd_loop(model, opt, 1)
        finally:
            mon.close()  # (a try/finally: a second error here would replace the first)
    assert err.value.incident.step == 2
    assert mon.incidents[0].step == 2


# ---------------------------------------------------------------- the logged grad norm is before clipping
def test_the_logged_grad_norm_is_the_norm_before_clipping(tmp_path):
    from nanscan import log

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "steps.jsonl"
    returned = []
    with nanscan.watch(model, opt, log=str(path)):
        for _ in range(3):
            (model(torch.randn(4, 8)).pow(2).mean() * 100).backward()
            returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
            opt.step()
            opt.zero_grad()
    steps = [e for e in log.read_events(str(path)) if e.get("type") == "step"]
    logged = [e["grad_norm"] for e in steps]
    assert len(logged) == 3 and all(r > 1.5 for r in returned)  # clipping did clip
    assert logged == pytest.approx(returned, rel=1e-6)


# ---------------------------------------------------------------- sparse gradients
class SparseEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_sparse_embedding_gradient_is_summarized_over_its_values():
    torch.manual_seed(0)
    model = SparseEmbed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    poison = {"on": False}
    model.emb.weight.register_hook(lambda g: g * NAN if poison["on"] else g)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(4):
            poison["on"] = i == 2
            ids = torch.tensor([[1, 2, 2, 7]])  # (a repeated index: duplicates are summed, coalesced)
            model(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind) == (2, "backward", "emb.weight", "grad")
    assert inc.summary.shape == (3, 8) and inc.summary.nan_count == 24  # 3 distinct rows stored
    assert mon.ledger.applied == 2


# ---------------------------------------------------------------- a module replaced after watch
def test_a_head_replaced_after_watch_is_never_blamed_on_its_parent_and_its_parameters_are_checked():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, on_nonfinite="record")
    sgd_loop(model, opt, 1)
    with pytest.warns(RuntimeWarning, match="'head' was set after watch"):
        model.head = nn.Linear(8, 1)  # fine-tuning: a new head
    opt.add_param_group({"params": model.head.parameters()})
    with torch.no_grad():
        model.head.weight[0, 0] = NAN
    sgd_loop(model, opt, 2)
    mon.close()
    first = mon.incident
    assert (first.step, first.phase) == (1, "forward")
    assert first.produced is None  # the NaN came out of the unwatched head: never "(model) produced"
    assert any(n == "head.weight" for names in mon.offenders.values() for n in names)  # its parameters are read


# ---------------------------------------------------------------- a gradient penalty (create_graph=True)
def test_a_nan_made_by_a_gradient_penalty_backward_is_not_blamed_on_a_weight():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for i in range(3):
            x = torch.randn(4, 8, requires_grad=True)
            loss = model(x).pow(2).mean()
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            # sqrt of an exact 0 at step 1: a finite penalty whose backward is inf * 0 = NaN
            penalty = (g.pow(2).sum() * (0.0 if i == 1 else 1.0)).sqrt()
            (loss + penalty).backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.kind) == (1, "backward", "grad")
    assert inc.produced is None  # made in the penalty's double backward, outside every module


# ---------------------------------------------------------------- a background evaluator thread
def test_eval_forwards_on_another_thread_never_join_the_training_threads_records():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bad = torch.full((2, 8), NAN)
    stop = threading.Event()

    def evaluator():  # no_grad forwards of a NaN batch, as fast as it can, beside the training loop
        while not stop.is_set():
            with torch.no_grad():
                model(bad)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the evaluator's eval incidents are warned)
        mon = nanscan.watch(model, opt)
        worker = threading.Thread(target=evaluator, daemon=True)
        worker.start()
        try:
            sgd_loop(model, opt, 300)
        finally:
            stop.set()
            worker.join()
            mon.close()
    assert mon.ledger.applied == 300  # no clean update was refused
    assert all(i.phase == "eval" for i in mon.incidents)  # the evaluator's NaNs are its own, phase eval

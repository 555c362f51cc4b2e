"""A clean read comes back as one number (Note [a clean read comes back as one number] in
nanscan/monitor/readback.py): where no consumer needs the rows, the read is decided on the device
and the host copies back the non-finite count and the read's scalars -- a few bytes whatever the
number of records --; a non-finite record anywhere still brings the rows back and yields the same
incident as the host's decision. The device path runs here on CPU rows (``DEVICE_DECISION =
"always"``): it is the same torch code a GPU runs."""
import collections

import pytest
import torch
from torch import nn

import nanscan
from nanscan.monitor import reading, readback
from nanscan.monitor.monitor import Monitor
from nanscan.record import RECORD_SIZE

NAN = float("nan")


def key(inc):
    return (inc.step, inc.phase, inc.name, inc.kind, inc.produced)


@pytest.fixture
def copies(monkeypatch):
    """Every landed Copy of the test, in order."""
    landed = []
    wait = readback.Copy.wait

    def recording(self):
        if not self.landed:
            landed.append(self)
        wait(self)

    monkeypatch.setattr(readback.Copy, "wait", recording)
    return landed


Decided = collections.namedtuple("Decided", "step grad_names extras")


@pytest.fixture
def cleans(monkeypatch):
    """Every read of the test decided clean before a Copy was made of it, in order: (step, names of
    the parameter gradients read, scalars) -- a Clean from gather, or the clean step's read taken
    first (Note [a clean step's read]); not a Copy found clean when it landed."""
    found = []
    decided, decode = Monitor._decided_clean, Monitor._decode
    landing = []

    def recording(self, step, grad_names, extras):
        if not landing:
            found.append(Decided(step, grad_names, extras or {}))
        decided(self, step, grad_names, extras)

    def decoding(self, *args, **kwargs):
        landing.append(True)
        try:
            return decode(self, *args, **kwargs)
        finally:
            landing.pop()

    monkeypatch.setattr(Monitor, "_decided_clean", recording)
    monkeypatch.setattr(Monitor, "_decode", decoding)
    return found


def deep(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)])


def train(model, steps=3, plant=None, compiled=False, **options):
    """A plain loop; ``plant(model, step, loss)`` may break something: called before the forward
    (``loss`` None) and after it (it returns the loss to use). ``compiled``: the model compiled after
    it is watched (aot_eager: the compiled path's rows without inductor's compile time)."""
    if compiled:
        torch._dynamo.reset()  # (a model per run: else dynamo's recompile limit leaves later runs eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, on_nonfinite="record", **options)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    with mon:
        for i in range(steps):
            if plant is not None:
                plant(model, i, None)
            loss = forward(torch.randn(4, 8)).pow(2).mean()
            if plant is not None:
                loss = plant(model, i, loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return mon


@pytest.mark.parametrize("layers", [4, 60])
def test_a_clean_step_reads_back_the_count_and_nothing_else(monkeypatch, copies, layers):
    # (as a Copy: async mode's path on a device; a sync read is taken in one call, next test)
    monkeypatch.setattr(readback, "DEVICE_DECISION", "always")
    monkeypatch.setattr(reading, "TAKEN_IN_ONE_CALL", False)
    mon = train(deep(layers))
    assert mon.incidents == [] and mon.ledger.applied == 3
    training = [c for c in copies if c.slots and not c.final]  # (close reads the last update's parameters)
    assert len(training) == 3
    for c in training:
        records = len(c.slots)
        assert records >= 6 * layers  # (outputs, their gradients, parameters, gradients)
        assert c.device_rows is not None and c.host is None
        assert c.read_back_bytes == 8 * (1 + len(c.extra_names))  # not 8 * RECORD_SIZE * records


def test_a_clean_sync_read_decided_on_its_device_is_taken_in_one_call(monkeypatch, copies, cleans):
    # the device path run on CPU rows: the read taken in one call and its records summed where
    # they lie (on a GPU the sum's 8 bytes are the read's sync); no Copy or Read is made of it
    monkeypatch.setattr(readback, "DEVICE_DECISION", "always")
    mon = train(deep(4))
    assert mon.incidents == [] and mon.ledger.applied == 3
    assert [c.step for c in cleans] == [0, 1, 2]
    assert not [c for c in copies if not c.final]  # (close reads the last update's parameters: a Copy)
    assert mon.tensors.grads_read[2] == (mon.tensors.all_param_names, set())


def test_on_the_cpu_a_clean_sync_read_is_decided_before_its_slots_are_made(copies, cleans):
    # the rows lie on the host already: a clean step's read is decided in the blocks the windows
    # made -- no slot list, Copy or Read is made of it --, and what later reads need is kept
    mon = train(deep(4))
    assert mon.incidents == [] and mon.ledger.applied == 3
    assert [c.step for c in cleans] == [0, 1, 2]
    assert all(mon.tensors.grad_names(c.grad_names) == mon.tensors.all_param_names and c.extras == {} for c in cleans)
    assert not [c for c in copies if not c.final]  # (close reads the last update's parameters: a Copy)
    assert mon.tensors.grads_read[2] == (mon.tensors.all_param_names, set())
    assert mon.tensors.forward_bad[2] is False


def test_on_the_cpu_an_async_clean_read_is_decided_at_once_as_in_sync_mode(copies, cleans):
    # async mode spares the host a wait for the device; rows on the host need none: a clean step's
    # read is decided in one call as in sync mode (Note [a clean step's read])
    mon = train(deep(4), mode="async")
    assert mon.incidents == [] and mon.ledger.applied == 3
    assert [c.step for c in cleans] == [0, 1, 2]
    assert not [c for c in copies if not c.final]
    assert mon.tensors.grads_read[2] == (mon.tensors.all_param_names, set())


def test_an_async_read_on_a_device_goes_on_as_a_copy_decided_a_read_later(monkeypatch, copies, cleans):
    # the device path run on CPU rows: in async mode the one call does not wait for the device's
    # sum; the read goes on, undecided, as a copy that lands at the next read
    monkeypatch.setattr(readback, "DEVICE_DECISION", "always")
    mon = train(deep(4), mode="async")
    assert mon.incidents == [] and mon.ledger.applied == 3
    assert cleans == []
    training = [c for c in copies if c.slots and not c.final]
    assert [c.step for c in training] == [0, 1, 2]
    assert all(c.device_rows is not None and c.host is None for c in training)


def test_on_the_cpu_an_async_clean_read_taken_call_by_call_is_decided_in_its_blocks(monkeypatch, copies, cleans):
    # (the path before the clean step's read: a Copy, decided in its blocks a read later, nothing stacked)
    monkeypatch.setattr(reading, "TAKEN_IN_ONE_CALL", False)
    mon = train(deep(4), mode="async")
    assert mon.incidents == [] and mon.ledger.applied == 3
    assert cleans == []
    training = [c for c in copies if c.slots]
    assert training
    for c in training:
        assert c.device_rows is None and c.host is None and c.read_back_bytes == 0
        assert c.blocks and sum(b.shape[0] for b in c.blocks) == len(c.slots)


def test_never_stacks_and_copies_every_read_whole(monkeypatch, copies):
    monkeypatch.setattr(readback, "DEVICE_DECISION", "never")
    mon = train(deep(4))
    assert mon.incidents == []
    for c in copies:
        assert c.device_rows is None and c.blocks is None
        if c.slots:
            assert c.host is not None and c.read_back_bytes == c.host.numel() * 8 >= len(c.slots) * RECORD_SIZE * 8


def test_a_row_asked_of_a_read_in_blocks_is_stacked_then(copies):
    train(deep(2), steps=1, mode="async")
    clean = next(c for c in copies if c.slots)
    blocks = list(clean.blocks)
    row = clean.row(len(clean.slots) - 1)
    assert clean.host is not None and clean.host.shape[0] == sum(b.shape[0] for b in blocks)
    assert row == blocks[-1][-1].tolist()


def _activation(model, step, loss):
    if step == 1 and loss is None:
        with torch.no_grad():
            model[2][0].weight[0, 0] = NAN
    return loss


def _loss(model, step, loss):
    return loss * NAN if step == 1 and loss is not None else loss


def _gradient(model, step, loss):
    if step != 1 or loss is None:
        return loss

    class NanGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * NAN

    return NanGrad.apply(loss)


def _param_grad(model, step, loss):
    # a parameter's gradient alone: the gradients of module outputs stay finite
    if step == 1 and loss is None:
        handle = model[3][0].weight.register_hook(lambda g: g * NAN)
        model._nan_hook = handle
    elif step == 2 and loss is None:
        model._nan_hook.remove()
    return loss


@pytest.mark.parametrize("plant", [_activation, _loss, _gradient, _param_grad])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nonfinite_record_anywhere_gives_the_same_incident_as_the_host_decision(monkeypatch, copies, plant,
                                                                                     mode):
    results = {}
    # (on CPU rows "cuda" decides a sync read in one call, "blocks" call by call in its blocks)
    for where in ("never", "always", "cuda", "blocks"):
        monkeypatch.setattr(readback, "DEVICE_DECISION", "cuda" if where == "blocks" else where)
        monkeypatch.setattr(reading, "TAKEN_IN_ONE_CALL", where != "blocks")
        copies.clear()
        mon = train(deep(6), steps=4, plant=plant, mode=mode)
        results[where] = ([key(i) for i in mon.incidents], dict(mon.offenders), mon.ledger.applied,
                          mon.ledger.attempted)
        if where == "always":
            failing = [c for c in copies if c.bad]
            assert failing and all(c.host is not None for c in failing)  # the rows came back to say which
            assert all(c.host is None for c in copies if c.slots and not c.bad)  # ... only for them
        if where == "cuda":
            assert all(c.host is None for c in copies if c.slots and not c.bad)
    assert results["always"][0], "the planted fault was not found"
    assert results["always"] == results["never"] == results["cuda"] == results["blocks"]


class _Partly(nn.Module):
    """A model one of whose layers is not used: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def test_a_read_taken_in_one_call_keeps_which_gradients_it_read(cleans):
    # the clean read taken in one C++ call says which parameters had a gradient: the update's
    # records are judged against those alone
    mon = train(_Partly())
    assert mon.incidents == [] and [c.step for c in cleans] == [0, 1, 2]
    assert all(c.grad_names == ["used.weight", "used.bias"] for c in cleans)
    assert mon.tensors.grads_read[2] == (frozenset({"used.weight", "used.bias"}), set())
    assert mon.reading._lean_read is not None  # (the read was taken in one call)


def _gathers(monkeypatch) -> list:
    """The steps of the reads that went through Reading.gather, in order."""
    gathered = []
    gather = reading.Reading.gather

    def counting(self, step, **kwargs):
        gathered.append(step)
        return gather(self, step, **kwargs)

    monkeypatch.setattr(reading.Reading, "gather", counting)
    return gathered


def test_a_plain_clean_step_is_decided_before_the_reads_general_path(monkeypatch, cleans):
    # Note [a clean step's read]: a plain loop's clean sync read is taken in one call first; gather
    # runs only for what that read does not cover (here the final read at close)
    gathered = _gathers(monkeypatch)
    mon = train(deep(3), steps=3)
    assert mon.incidents == [] and [c.step for c in cleans] == [0, 1, 2]
    assert all(c.grad_names is mon.tensors.param_names and c.extras == {} for c in cleans)
    assert not {0, 1, 2} & set(gathered)
    assert mon.tensors.grads_read[2] == (mon.tensors.all_param_names, set())


def test_a_clean_steps_scalars_on_the_host_ride_with_its_one_call(monkeypatch, cleans):
    # GradScaler's scale rides with the read: on the host it is decided clean in the one call, with
    # its scale, before gather
    gathered = _gathers(monkeypatch)
    torch.manual_seed(0)
    model = deep(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nanscan.watch(model, opt, scaler) as mon:
        for _ in range(3):
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert mon.incidents == [] and not {0, 1, 2} & set(gathered)
    assert [c.step for c in cleans] == [0, 1, 2] and [c.extras for c in cleans] == [{"scale": 4.0}] * 3


def test_a_read_a_consumer_walks_goes_the_general_way(monkeypatch, cleans, tmp_path):
    # a step log walks every read's rows: no read is decided before gather makes them
    gathered = _gathers(monkeypatch)
    mon = train(deep(3), steps=3, log=str(tmp_path / "steps.jsonl"))
    assert mon.incidents == [] and cleans == [] and {0, 1, 2} <= set(gathered)


def test_a_watch_without_activations_is_decided_in_one_call_and_still_finds_a_gradient(monkeypatch, cleans):
    # no forward is recorded then, and none is needed to decide the read (the hooks' check is of
    # activations): the clean steps are taken in the one call, and a NaN gradient is still found
    gathered = _gathers(monkeypatch)

    def nan_grad(model, step, loss):
        if step == 2 and loss is not None:
            return loss * float("nan")
        return loss

    mon = train(deep(3), steps=4, plant=nan_grad, activations=False)
    assert [c.step for c in cleans] == [0, 1] and not {0, 1} & set(gathered)
    assert mon.incidents and mon.incidents[0].step == 2


def test_a_fault_found_by_the_clean_steps_read_is_read_on_from_its_parts(monkeypatch, cleans):
    # not clean, the parts taken in one call go on to gather: the fault is found where it was made
    gathered = _gathers(monkeypatch)
    mon = train(deep(6), steps=4, plant=_activation)
    assert [c.step for c in cleans] == [0] and {1, 2, 3} <= set(gathered)  # (the NaN weight stays)
    assert (mon.incidents[0].step, mon.incidents[0].phase, mon.incidents[0].name) == (1, "forward", "2.0")


def test_the_one_call_take_returns_what_the_separate_calls_do_when_a_record_is_not_finite():
    from nanscan import _ops

    extension = _ops.monitor_extension()
    mon = train(deep(2), steps=1)
    window = extension.Window(lambda rows: rows, None, None, 1, 8, 1 << 20)
    params = [torch.randn(3), torch.randn(2, 2)]
    held = extension.TensorSet(params, None)
    lean = extension.LeanRead(window, None, held, mon.hooks.cpp)
    assert lean.take(True, 1) is None  # no gradient yet: nothing read, clean
    params[0].grad = torch.ones(3)
    assert lean.take(True, 1) == [0]  # the first parameter's gradient alone
    params[1].grad = torch.ones(2, 2)
    assert lean.take(True, 1) is True and lean.take(False, 1) is None
    assert lean.take(True, 1, True) is True  # (summed where the records lie: the device path)
    params[1].grad[0, 1] = float("inf")
    assert lean.finishing_ns >= 0
    assert type(lean.take(True, 1, True)) is tuple
    taken = lean.take(True, 1)
    (entries, blocks, rows), sink, (records, present, sparse) = taken
    assert entries == [] and blocks == [] and rows is None and sink is None
    assert present is None and sparse is None and records.shape == (2, RECORD_SIZE)
    assert records[1, 1].item() == 1  # the +Inf, counted


def test_the_reads_scalars_ride_with_the_count(monkeypatch, copies, cleans):
    # GradScaler's scale is read with the count: the same scale history, the same skipped updates
    # and incidents as the host's decision.
    histories = {}
    for where in ("never", "always", "cuda"):
        monkeypatch.setattr(readback, "DEVICE_DECISION", where)
        torch.manual_seed(0)
        model = deep(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126)
        with nanscan.watch(model, opt, scaler, on_nonfinite="record") as mon:
            for _ in range(4):
                scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        histories[where] = (list(mon.ledger.scale_history), mon.ledger.applied, [key(i) for i in mon.incidents])
        read = [c for c in copies if "scale" in c.extra_names]
        if where == "cuda":  # (clean on the host: decided before a Copy is made, the scale taken with it)
            assert not read and [c.extras for c in cleans] == [{"scale": 2.0 ** 126}] * 4
        else:
            assert read and all((c.device_rows is not None) == (where == "always") for c in read)
            assert cleans == []
        copies.clear()
        cleans.clear()
    assert histories["always"] == histories["never"] == histories["cuda"]
    assert histories["always"][0][0] == (0, 2.0 ** 126)


def test_a_consumer_of_the_rows_gets_them(monkeypatch, copies, tmp_path):
    # a step log reads every step's loss and gradient norm from the rows: they come back whole
    monkeypatch.setattr(readback, "DEVICE_DECISION", "always")
    log = tmp_path / "steps.jsonl"
    mon = train(deep(4), log=str(log))
    assert mon.incidents == []
    training = [c for c in copies if c.slots]
    assert training and all(c.device_rows is None and c.host is not None for c in training)
    assert log.read_text().count("\n") >= 3


def test_a_row_asked_of_a_clean_read_is_copied_then(monkeypatch, copies):
    monkeypatch.setattr(readback, "DEVICE_DECISION", "always")
    train(deep(2), steps=1)
    clean = next(c for c in copies if c.slots)
    assert clean.host is None
    before = clean.read_back_bytes
    row = clean.row(0)
    assert len(row) == RECORD_SIZE and row[0] + row[1] + row[2] == 0
    assert clean.read_back_bytes == before + clean.host.numel() * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the default decides on the device there")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_on_a_gpu_the_default_decides_on_the_device(copies, mode):
    model = deep(6).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, on_nonfinite="record", mode=mode) as mon:
        for i in range(4):
            if i == 2:
                with torch.no_grad():
                    model[3][0].weight[0, 0] = NAN
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert key(mon.incident) == (2, "forward", "3.0", "activation", True)
    clean = [c for c in copies if c.slots and not c.bad]
    assert clean and all(c.device_rows is not None and c.host is None and c.read_back_bytes == 8 * (
        1 + len(c.extra_names)) for c in clean)


@pytest.mark.parametrize("where", ["cuda", "never"])
def test_a_clean_read_makes_as_many_python_calls_for_ten_times_the_records(where):
    # what grows with the records is C++ loops (benchmarks/read_cost.py measures the time)
    from benchmarks import read_cost

    small = read_cost.run_reads(4, where, 3, count_calls=True)
    large = read_cost.run_reads(40, where, 3, count_calls=True)
    assert min(large["records"]) >= 9 * max(small["records"])
    assert len(set(small["calls"])) == 1 and small["calls"] == large["calls"]


def test_an_eval_forwards_clean_read_makes_no_read_and_a_failing_one_still_reports(monkeypatch):
    from nanscan.monitor.read import Read

    landed = []
    land = Read.land.__func__
    monkeypatch.setattr(Read, "land", classmethod(lambda cls, copy, *a, **k: (landed.append(copy.eval),
                                                                              land(cls, copy, *a, **k))[1]))
    model = deep(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanscan.watch(model, opt, on_nonfinite="record") as mon:
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, 8))
            assert landed == [] and mon.incidents == []
            model[1][0].weight[0, 0] = NAN
            model(torch.randn(4, 8))
    assert landed and all(landed)  # (the failing eval forward's read, decoded whole)
    assert (mon.incident.phase, mon.incident.name) == ("eval", "1.0")


def test_nonfinite_in_blocks_counts_rows_across_blocks():
    """The one C++ call a CPU read is decided with: the non-finite rows of its blocks numbered
    across them in order; None when a block is not on the host; a malformed block is refused."""
    find = readback._nonfinite_in_blocks
    first, second = torch.zeros(3, RECORD_SIZE, dtype=torch.float64), torch.zeros(4, RECORD_SIZE, dtype=torch.float64)
    assert find([first, second]) == [] and find([]) == []
    first[1, 0] = 1   # a NaN count
    second[0, 1] = 2  # +Inf
    second[3, 2] = 1  # -Inf
    second[2, 3] = 5  # zeros: not non-finite
    assert find([first, second]) == [1, 3, 6]
    assert find([first, second.to("meta")]) is None
    with pytest.raises(RuntimeError, match="float64 host records"):
        find([torch.zeros(2, RECORD_SIZE)])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_clean_compiled_read_comes_back_as_its_count_and_whether_graphs_ran(monkeypatch, copies, mode):
    """Note [compiled rows decided where they lie]: no compiled row is decoded into a slot (Python
    per row) for a clean read no consumer walks; the host copies back the count, the scalars and the
    largest sequence number."""
    from nanscan.monitor.traced import TracedRows

    decoded = []
    slots = TracedRows.slots
    monkeypatch.setattr(TracedRows, "slots", lambda self, *a, **k: decoded.append(a) or slots(self, *a, **k))
    mon = train(deep(4), steps=4, compiled=True, mode=mode)
    assert mon.incidents == [] and mon.ledger.applied == 4
    training = [c for c in copies if c.n_traced and not c.final]
    assert len(training) == 4
    assert [written for written, *_ in decoded] == [[]]  # (only close's read: no graph ran after the last one)
    for c in training:
        assert c.device_rows is not None and c.host is None and c.traced is None and c.compiled_ran
        assert c.read_back_bytes == 8 * (2 + len(c.extra_names))
    assert mon.tensors.grads_read[3] == (mon.tensors.all_param_names, set())
    assert mon.tensors.forward_bad[3] is False


@pytest.mark.parametrize("plant", [_activation, _loss, _gradient, _param_grad])
def test_a_nonfinite_compiled_row_gives_the_same_incident_as_the_whole_read(monkeypatch, copies, plant):
    results = {}
    for where in ("never", "cuda"):
        monkeypatch.setattr(readback, "DEVICE_DECISION", where)
        copies.clear()
        mon = train(deep(6), steps=4, plant=plant, compiled=True)
        results[where] = ([key(i) for i in mon.incidents], dict(mon.offenders), mon.ledger.applied)
        if where == "cuda":
            assert [c for c in copies if c.bad and c.n_traced and c.device_rows is not None]
            assert all(c.traced is None for c in copies if c.n_traced and not c.bad and not c.final)
    assert results["never"][0], "the planted fault was not found"
    assert results["never"] == results["cuda"]


def test_compiled_rows_not_written_in_the_window_do_not_count():
    """An unwritten row (sequence number 0) keeps the record of an earlier window: its counts are
    not this read's. A written one's are, and the rows then come back decoded as a whole read's."""
    from nanscan.monitor.traced import COLUMNS, SEQ

    records = torch.zeros(2, RECORD_SIZE, dtype=torch.float64)
    window = torch.zeros(4, COLUMNS, dtype=torch.float64)
    window[1, 0] = 3.0  # (a NaN count left by an earlier window: not written in this one)
    window[2, SEQ] = 1.0  # (written, finite)
    copy = readback.Copy.start([records], ["a", "b"], [], window, handled=False, step=0, non_blocking=False,
                               window_rows=4, rows_wanted=False)
    copy.wait()
    assert copy.clean and copy.compiled_ran and copy.traced is None and copy.read_back_bytes == 16
    window[2, 1] = 1.0  # (the written row holds a +Inf)
    copy = readback.Copy.start([records], ["a", "b"], [], window, handled=False, step=0, non_blocking=False,
                               window_rows=4, rows_wanted=False)
    window[:, SEQ] = 0  # (the read resets the window before it lands: the rows it fetches are a copy)
    copy.wait()
    # (the eager rows' verdict, and the compiled rows written, for Read.land to judge as a whole read's)
    assert not copy.clean and copy.bad == set() and [row for row, _ in copy.traced[0]] == [2]
    assert copy.traced[0][0][1][1] == 1.0

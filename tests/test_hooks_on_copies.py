"""Deep copies of a watched model (EMA, teacher): ``close()`` removes nanscan's hooks from every
copy still alive, copies of copies included, and a copy never records into the monitor
(Note [hooks on copies] in nanscan/monitor/eager.py)."""
import copy
import gc
import io
import weakref

import pytest
import torch

import nanscan
from tests.test_monitor import Net  # embed -> block (log of a negative when block.fault) -> head


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def step(model, opt, x):
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_close_removes_the_hooks_from_an_ema_copy_of_resnet18_that_ran_while_watched():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    x = torch.randn(2, 3, 32, 32)
    step(model, opt, x)
    ema = copy.deepcopy(model)  # an EMA copy made while watched: it carries the hooks
    assert hook_count(ema) == hook_count(model) > 50
    with torch.no_grad():
        ema.fc.weight.fill_(float("nan"))  # non-finite only in the copy
    for _ in range(2):
        with torch.no_grad():
            assert ema(x).isnan().all()  # the copy runs while watched, records nothing, raises nothing
        step(model, opt, x)
    assert mon.incidents == [] and mon.ledger.applied == 3
    mon.close()
    assert hook_count(model) == 0
    assert hook_count(ema) == 0  # without a call of the copy after close
    with torch.no_grad():
        assert ema(x).shape == (2, 10)


def test_close_removes_the_hooks_from_copies_of_copies():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    ema = copy.deepcopy(model)
    teacher = copy.deepcopy(ema)  # a copy of the copy
    pair = copy.deepcopy([model, ema])  # both in one deep copy
    block = copy.deepcopy(teacher.block)  # a submodule's copy
    gone = weakref.ref(copy.deepcopy(ema))  # a copy that dies: the monitor does not keep it alive
    gc.collect()
    assert gone() is None
    step(model, opt, torch.randn(4, 8))
    buffer = io.BytesIO()
    torch.save(ema, buffer)  # a copy still pickles while watched
    mon.close()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copies = [model, ema, teacher, *pair, block]
    assert [hook_count(m) for m in copies] == [0] * len(copies)
    assert torch.equal(loaded(torch.ones(2, 8)), ema(torch.ones(2, 8)))
    assert hook_count(loaded) == 0  # (a pickled hook removes itself at its first call)


def test_a_copy_made_under_one_watch_carries_nothing_into_the_next():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = nanscan.watch(model, opt)
    ema = copy.deepcopy(model)
    first.close()
    assert hook_count(ema) == 0
    second = nanscan.watch(model, opt)
    teacher = copy.deepcopy(model)
    step(model, opt, torch.randn(4, 8))
    second.close()
    assert (hook_count(model), hook_count(ema), hook_count(teacher)) == (0, 0, 0)


def test_closing_one_monitor_leaves_the_hooks_of_a_monitor_watching_the_copy():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    teacher = copy.deepcopy(model)  # carries mon's hooks
    own = nanscan.watch(teacher)  # and is watched itself
    own_hooks = hook_count(teacher) - hook_count(model)
    mon.close()
    assert hook_count(model) == 0 and hook_count(teacher) == own_hooks > 0
    with torch.no_grad():
        teacher(torch.randn(4, 8))
    assert hook_count(teacher) == own_hooks
    own.close()
    assert hook_count(teacher) == 0


def test_a_copy_close_could_not_see_unhooks_itself_and_so_do_its_copies():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt)
    # The root's __dict__ copied by hand: its copy is not in the memo under the root's id (the
    # children's copies are).
    clone = Net.__new__(Net)
    clone.__dict__ = copy.deepcopy(model.__dict__)
    mon.close()
    assert all(hook_count(m) == 0 for m in clone.children())
    later = copy.deepcopy(clone)  # made after close
    for m in (clone, later):
        with torch.no_grad():
            m(torch.randn(2, 8))  # its first call removes the hooks left on it
        assert hook_count(m) == 0

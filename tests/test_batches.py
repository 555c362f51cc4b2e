"""Batches of queued tensors (nanscan/monitor/slots.py): bounded by what only the batch keeps alive
(Note [a batch bounded by what only it keeps alive] in csrc/monitor/grad_sink.h). A training
forward's outputs, held by autograd anyway, are summarized in one call at the forward's end; outputs
nothing else holds are summarized as their bytes reach the bound. The default CPU kernels summarize
on arrival (no batch), so these run with the reference backend, whose batches are Python calls."""
import pytest
import torch
from torch import nn

import nanscan
from nanscan.monitor import reading
from nanscan.monitor.tensors import ModelTensors

NAN = float("nan")


@pytest.fixture
def batches(monkeypatch):
    """The size of every batch summarized through the monitor's Python backend, in order."""
    sizes = []
    many = ModelTensors.summarize_many

    def counting(self, xs):
        sizes.append(len(xs))
        return many(self, xs)

    monkeypatch.setattr(ModelTensors, "summarize_many", counting)
    return sizes


def deep(n: int, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def test_a_training_forward_is_one_batch(batches):
    # 100 outputs, every one saved by autograd for the backward: nothing is kept alive for the batch
    model = deep(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanscan.watch(model, opt, backend="reference", on_nonfinite="record") as mon:
        for _ in range(2):
            del batches[:]
            out = model(torch.randn(4, 16))
            forward = list(batches)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            assert forward == [101]  # (the outputs and the batch, at the forward's end)
    assert mon.incidents == []


def test_outputs_only_the_batch_holds_are_summarized_at_the_bound(monkeypatch, batches):
    # under no_grad each output is let go once the next layer has read it: only the batch holds it,
    # so the batch is summarized as those bytes reach the bound (here 3 outputs of 16 KiB)
    monkeypatch.setattr(reading, "BATCH_BYTES", 3 * 16 * 256 * 4)
    model = deep(30, width=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanscan.watch(model, opt, backend="reference", on_nonfinite="record"):
        x = torch.randn(16, 256)
        with torch.no_grad():
            del batches[:]
            model(x)
            held = list(batches)
        del batches[:]
        model(x).sum().backward()  # (held by autograd: one batch, whatever the bound)
        trained = list(batches)
        opt.step()
    # (a flush when 3 outputs are held by the batch alone; the two newest are still the running
    # layer's input and output; the first batch holds the model's input too)
    assert sum(held) == 31 and len(held) >= 5 and max(held) <= 6
    assert trained[0] == 31  # (the training forward)
    # the gradients of module outputs are let go once the backward has used them: bounded too
    assert len(trained) >= 6 and max(trained[1:]) <= 6


def test_a_record_in_a_large_batch_still_finds_the_first_nonfinite_output(batches):
    model = deep(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model[60].weight[0, 0] = NAN
    with nanscan.watch(model, opt, backend="reference", on_nonfinite="record") as mon:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    assert batches[0] == 101
    assert (mon.incident.phase, mon.incident.name, mon.incident.produced) == ("forward", "60", True)

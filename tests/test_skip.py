"""on_nonfinite="skip": a non-finite step's update is not applied -- weights, buffers and optimizer
state stay bit-identical to before the step -- its incident, ledger entry and bundle are kept, and
training goes on; the (N+1)-th non-finite step in a row raises. Plain / foreach / fused optimizers,
GradScaler, gradient accumulation, optimizer.step(closure), explicit steps, and 2 gloo ranks (DDP,
FSDP2) that must skip together."""
import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanscan
from tests import ranks


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step, bad=False):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    if bad:
        x[3, 2] = float("nan")
    return x


def _state(model, opt) -> dict:
    """Everything a skipped step must leave as it was: weights, buffers, optimizer state."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer/{n}": b.detach().clone() for n, b in model.named_buffers()})
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"opt/{i}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list):  # (LBFGS keeps lists of tensors: old_dirs, old_stps, ro, al)
            assert len(x) == len(y) and all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
                                            for u, v in zip(x, y)), k
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


def _run(make_opt, bad_steps, steps=5, **options):
    """Train ``steps`` steps, non-finite batches at ``bad_steps``; returns the monitor, the states
    before and after each step, and the warnings."""
    model = _net()
    opt = make_opt(model.parameters())
    before, after = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanscan.watch(model, opt, on_nonfinite="skip", **options) as mon:
            for step in range(steps):
                before[step] = _state(model, opt)
                model(_batch(step, step in bad_steps)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                after[step] = _state(model, opt)
    return mon, before, after, [str(w.message) for w in caught]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_step_leaves_weights_buffers_and_optimizer_state_as_they_were(name):
    mon, before, after, warned = _run(OPTIMIZERS[name], bad_steps={2})
    _assert_same(before[2], after[2])  # BatchNorm's running stats and num_batches_tracked restored too
    assert not torch.equal(before[3]["param/0.weight"], after[3]["param/0.weight"])  # later steps train
    assert not torch.equal(before[3]["buffer/1.running_mean"], after[3]["buffer/1.running_mean"])
    assert after[4]["buffer/1.num_batches_tracked"].item() == 4  # 5 forwards, the skipped one undone
    assert (mon.ledger.attempted, mon.ledger.applied, mon.ledger.skipped_steps) == (5, 4, [2])
    assert (mon.incident.step, mon.incident.phase, mon.incident.name) == (2, "forward", "0")
    assert {i.step for i in mon.incidents} == {2} and mon.skipper.steps == [2]
    assert any("skipped the update of step 2" in w for w in warned)


def test_the_next_nonfinite_step_after_the_limit_raises_at_its_step():
    with pytest.raises(nanscan.NonFiniteError) as err:
        _run(OPTIMIZERS["sgd"], bad_steps={1, 2, 3, 4}, steps=6, max_consecutive_skips=3)
    assert err.value.incident.step == 4
    assert any("max_consecutive_skips=3" in n for n in getattr(err.value, "__notes__", []))


def test_the_consecutive_count_restarts_after_an_applied_step():
    mon, *_ = _run(OPTIMIZERS["sgd"], bad_steps={1, 3, 5}, steps=7, max_consecutive_skips=1)
    assert mon.ledger.skipped_steps == [1, 3, 5] and mon.ledger.applied == 4


def test_skip_keeps_the_bundle(tmp_path):
    mon, *_ = _run(OPTIMIZERS["sgd"], bad_steps={2}, capture_dir=str(tmp_path))
    assert mon.bundle_path is not None and os.path.basename(mon.bundle_path).startswith("step000002")


def test_gradient_accumulation_skips_the_whole_step():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanscan.watch(model, opt, on_nonfinite="skip") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            start = _state(model, opt)
            for micro in range(3):
                model(_batch(10 * step + micro, step == 1 and micro == 2)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                _assert_same(start, _state(model, opt))  # three forwards' BatchNorm updates undone
    assert mon.ledger.skipped_steps == [1] and mon.ledger.applied == 3


def test_gradscaler_skips_stay_its_own_and_nanscan_skips_the_rest():
    # CPU GradScaler with a bf16 autocast forward: an overflowing gradient is GradScaler's own skip
    # (counted once); a NaN in the forward is nanscan's.
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with nanscan.watch(model, opt, scaler, on_nonfinite="skip") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(_batch(step, step == 3)).float().pow(2).mean()
            if step == 1:
                loss = loss * 1e38  # scaled by 2**16: inf gradients, GradScaler skips
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert mon.ledger.skipped_steps == [1, 3] and mon.ledger.applied == 3
    assert mon.skipper.steps == [3]  # GradScaler's own skip is not nanscan's
    # step 3 was GradScaler's skip too (NaN gradients), but its forward was non-finite: nanscan
    # restored the BatchNorm statistics that forward poisoned
    assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()


def test_closure_step_and_explicit_step_blocks_are_skipped():
    model = _net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    with nanscan.watch(model, opt, on_nonfinite="skip") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            x = _batch(step, step == 1)

            def closure(x=x):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            start = _state(model, opt)
            with mon.step():
                opt.step(closure)
            if step == 1:
                _assert_same(start, _state(model, opt))
    assert mon.ledger.skipped_steps == [1] and mon.ledger.applied == 2


def test_skip_is_refused_where_it_cannot_work():
    model = _net()
    with pytest.raises(ValueError, match="needs mode='sync'"):
        nanscan.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), on_nonfinite="skip", mode="async")
    with pytest.raises(ValueError, match="no optimizer was given"):
        nanscan.watch(model, on_nonfinite="skip")
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        nanscan.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), on_nonfinite="skip",
                      max_consecutive_skips=0)


def test_close_unwraps_the_optimizer_step():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nanscan.watch(model, opt, on_nonfinite="skip")
    assert "step" in opt.__dict__
    mon.close()
    assert "step" not in opt.__dict__


# --- 2 gloo ranks -----------------------------------------------------------------------------

def rank_worker(rank, world, style):
    model = _net() if style == "ddp" else nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if style == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sums = []
    with nanscan.watch(model, opt, on_nonfinite="skip") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x = _batch(100 * step + rank, bad=rank == 1 and step == 2)  # a NaN on rank 1 only
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
            sums.append(float(sum(p.detach().double().sum() for p in full)))
    return {"skipped": mon.ledger.skipped_steps, "applied": mon.ledger.applied, "sums": sums,
            "incident": [mon.incidents[0].step, mon.incidents[0].rank] if mon.incidents else None}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("style", ["ddp", "fsdp"])
def test_every_rank_skips_the_same_step(tmp_path, style):
    got = ranks.spawn(rank_worker, 2, tmp_path, style)
    assert got[0]["skipped"] == got[1]["skipped"] == [2]
    assert got[0]["applied"] == got[1]["applied"] == 3
    assert got[0]["incident"] == got[1]["incident"] == [2, 1]
    assert got[0]["sums"] == got[1]["sums"]  # the replicas stayed identical
    assert got[0]["sums"][1] == got[0]["sums"][2] != got[0]["sums"][3]  # step 2 changed nothing; step 3 trained



def test_a_bf16_loop_survives_a_nonfinite_step_with_its_bundle(tmp_path):
    # bf16 training has no GradScaler to skip a bad update: skip is its guard.
    model = _net().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(), nanscan.watch(model, opt, on_nonfinite="skip", capture_dir=str(tmp_path)) as mon:
        warnings.simplefilter("ignore")
        for step in range(6):
            start = _state(model, opt)
            model(_batch(step, step == 3).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                _assert_same(start, _state(model, opt))
    assert mon.ledger.skipped_steps == [3] and mon.ledger.applied == 5
    assert mon.bundle_path is not None and "step000003" in mon.bundle_path
    assert all(torch.isfinite(p).all() for p in model.parameters())
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert bundle.manifest["incident"]["step"] == 3


def test_an_incident_with_no_update_pending_is_warned_not_skipped():
    # With no optimizer step to cancel (the loop never called it), "skip" cannot skip: the incident
    # is warned about and recorded; nothing is claimed skipped.
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nanscan.watch(model, opt, on_nonfinite="skip")
    model(_batch(0, bad=True)).pow(2).mean().backward()
    with pytest.warns(RuntimeWarning, match="non-finite output of module '0'"):
        mon.close()
    assert mon.ledger.skipped_steps == [] and mon.skipper.steps == [] and mon.incident.step == 0


class TwiceSGD(torch.optim.Optimizer):
    """An optimizer that calls its closure twice per step and updates the weights in between (as
    LBFGS's inner iterations do), and that nanscan knows no way to restore. (Its own update, not
    ``super().step()``: torch runs the optimizer hooks at every patched ``step`` it goes through.)"""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def _update(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def step(self, closure=None):
        with torch.enable_grad():
            closure()
        self._update()
        with torch.enable_grad():
            loss = closure()
        self._update()
        return loss


def _closure_run(opt_class, bad_call, steps=3, **opt_kwargs):
    """``steps`` closure steps; the closure's call number ``bad_call`` (counted over the run) sees a
    NaN batch. Returns the monitor, the states before and after each step."""
    model = _net()
    opt = opt_class(model.parameters(), **opt_kwargs)
    calls, before, after = [0], {}, {}

    def closure():
        opt.zero_grad()
        x = _batch(calls[0], calls[0] == bad_call)
        calls[0] += 1
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with nanscan.watch(model, opt, on_nonfinite="skip") as mon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            before[step] = _state(model, opt)
            opt.step(closure)
            after[step] = _state(model, opt)
    return mon, before, after


def test_lbfgs_nonfinite_at_a_later_closure_call_restores_the_weights_from_before_the_step():
    # LBFGS(max_iter=4) calls the closure up to 5 times a step; call 7 is the second step's third
    mon, before, after = _closure_run(torch.optim.LBFGS, bad_call=7, lr=0.1, max_iter=4)
    assert mon.ledger.skipped_steps == [1] and mon.incident.step == 1
    _assert_same(before[1], after[1])  # weights, BatchNorm statistics and LBFGS's state (d, t, old_dirs...)
    assert not torch.equal(before[2]["param/0.weight"], after[2]["param/0.weight"])  # the next step trains


def test_a_closure_optimizer_that_changed_the_weights_before_the_nonfinite_call_raises_not_skips():
    with pytest.raises(nanscan.NonFiniteError) as raised:
        _closure_run(TwiceSGD, bad_call=3, lr=0.05)  # step 1's second call, after step 1's first update
    assert raised.value.incident.step == 1
    assert any("called the closure 2 times" in n for n in raised.value.__notes__)
    # its first call is before any update: skipped as usual
    mon, before, after = _closure_run(TwiceSGD, bad_call=2, lr=0.05)
    assert mon.ledger.skipped_steps == [1]
    _assert_same(before[1], after[1])


def test_trainable_parameters_outside_the_watched_optimizer_are_refused_at_watch():
    model = _net()
    body = torch.optim.SGD(model[:3].parameters(), lr=0.05)
    torch.optim.SGD(model[3].parameters(), lr=0.05)  # the head's own optimizer, which skip cannot cancel
    with pytest.raises(ValueError, match=r"2 trainable parameter\(s\).*'3.weight', '3.bias'.*watched optimizer"):
        nanscan.watch(model, body, on_nonfinite="skip")
    model[3].requires_grad_(False)  # a frozen head needs no protection
    nanscan.watch(model, body, on_nonfinite="skip").close()


def test_skip_with_every_warns_at_watch_and_raises_on_weights_an_unchecked_step_broke():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning, match="every=4 protects the checked steps only"):
        mon = nanscan.watch(model, opt, on_nonfinite="skip", every=4)
    with pytest.raises(nanscan.NonFiniteError) as raised:
        for step in range(8):
            model(_batch(step, step == 1)).pow(2).mean().backward()  # step 1: not checked, applied
            opt.step()
            opt.zero_grad()
    assert raised.value.incident.step == 4 and mon.skipper.steps == []  # (raised: not skipped)
    assert any("already non-finite before step 4's update" in n and "'0.weight'" not in n and "0.weight" in n
               for n in raised.value.__notes__)
    mon.close()


def test_an_update_that_overflows_the_weights_is_raised_as_that_steps_update_incident():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(nanscan.NonFiniteError) as raised, warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "skipped" warning either)
        with nanscan.watch(model, opt, on_nonfinite="skip") as mon:
            for step in range(6):
                opt.param_groups[0]["lr"] = 1e37 if step == 2 else 0.05
                (model(_batch(step)).pow(2).mean() * 100).backward()
                opt.step()
                opt.zero_grad()
    incident = raised.value.incident
    assert (incident.step, incident.phase, incident.kind) == (2, "update", "param")
    assert mon.skipper.steps == [] and any("applied already" in n for n in raised.value.__notes__)

"""Telemetry under torch.distributed (2 gloo ranks): the publishing rank's points are the global
numbers -- checked against the same model trained unsharded, in one process, on both ranks' batches
together -- for DDP (replicated parameters, a rank without sinks) and FSDP2 (sharded parameters);
numbers that cannot be known (plain parameters that differ across ranks) are left out, with a
warning, never guessed. The combination rules themselves: tests/test_monitor_parts.py."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanscan
from tests import ranks

STEPS, EVERY = 4, 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step, rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model, batch, telemetry, clip=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanscan.watch(model, opt, on_nonfinite="record", telemetry=telemetry, telemetry_every=EVERY):
            for step in range(STEPS):
                model(batch(step)).pow(2).mean().backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # (returns the total norm)
                opt.step()
                opt.zero_grad()
    return [str(w.message) for w in caught if "telemetry" in str(w.message)]


def worker(rank, world, style):
    points = {}

    def collect(step, scalars):
        points[str(step)] = scalars

    if style in ("ddp", "ddp_failing"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if style == "ddp_failing" and rank == 1:  # telemetry fails on rank 1 at its first read
            from nanscan.monitor.health import Health

            def boom(self, read):
                raise RuntimeError("boom")

            Health.observe = boom
        model = DDP(_net())
        telemetry = collect if rank == 0 else None  # rank 1 has no sinks: it still contributes
        warned = _train(model, lambda step: _batch(step, rank), telemetry, clip=True)
    elif style == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = _net()
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(model)
        warned = _train(model, lambda step: _batch(step, rank), collect)  # rank 1's sink gets nothing
    else:  # "independent": no DDP, each rank its own updates -- plain parameters that differ
        warned = _train(_net(), lambda step: _batch(step, rank), collect)
    return {"points": points, "warned": warned}


def unsharded(clip=False) -> dict:
    """The points of the same model trained in one process on both ranks' batches together."""
    points = {}
    _train(_net(), lambda step: torch.cat([_batch(step, 0), _batch(step, 1)]),
           lambda step, scalars: points.__setitem__(str(step), scalars), clip=clip)
    return points


def _plain_names(scalars: dict) -> dict:
    """DDP's names (``module.0``) as the unwrapped model's (``0``)."""
    return {name.replace("/module.", "/"): value for name, value in scalars.items()}


EXPECTED = {"nanscan/rms/0", "nanscan/amax/2", "nanscan/zero_frac/3", "nanscan/headroom_bits/4",
            "nanscan/param_norm/0.weight", "nanscan/param_amax/2.bias", "nanscan/grad_norm/4.weight",
            "nanscan/grad_amax/0.weight", "nanscan/loss", "nanscan/grad_norm", "nanscan/nonfinite"}


def _assert_global(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) == ["0", "2"]
    for step in want:
        g, w = _plain_names(got[step]), want[step]
        assert EXPECTED <= set(g), sorted(EXPECTED - set(g))
        for name in EXPECTED:
            assert g[name] == pytest.approx(w[name], rel=1e-5, abs=1e-7), (step, name)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_rank_0_publishes_the_global_numbers_and_rank_1_contributes_without_sinks(tmp_path):
    got = ranks.spawn(worker, 2, tmp_path, "ddp")
    _assert_global(got[0]["points"], unsharded(clip=True))
    assert got[1]["points"] == {} and got[0]["warned"] == []


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_sharded_parameters_add_up_to_the_unsharded_numbers(tmp_path):
    got = ranks.spawn(worker, 2, tmp_path, "fsdp")
    _assert_global(got[0]["points"], unsharded())
    assert got[1]["points"] == {} and got[0]["warned"] == []


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_plain_parameters_that_differ_across_ranks_are_left_out_not_guessed(tmp_path):
    got = ranks.spawn(worker, 2, tmp_path, "independent")
    points = got[0]["points"]
    assert sorted(points) == ["0", "2"]
    for step, scalars in points.items():
        assert not any(n.startswith(("nanscan/grad_norm/", "nanscan/grad_amax/")) for n in scalars), step
        assert "nanscan/rms/0" in scalars and "nanscan/loss" in scalars
    assert "nanscan/grad_norm" not in points["0"]  # each rank's own gradients: no global norm
    assert "nanscan/param_norm/0.weight" not in points["2"]  # updated apart: they differ by step 2
    assert any("cannot be known" in w for w in got[0]["warned"])


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_telemetry_failing_on_one_rank_turns_it_off_everywhere_without_a_hang(tmp_path):
    got = ranks.spawn(worker, 2, tmp_path, "ddp_failing")  # (returns: no rank waited for another)
    assert any("telemetry failed and is turned off" in w and "boom" in w for w in got[1]["warned"])
    assert got[0]["warned"] == ["nanscan: telemetry failed on rank(s) [1] and is turned off"]
    assert got[0]["points"] == {}  # (the first point found rank 1 failed: none is published)

"""2 ranks on gloo (CPU): a fault on rank 1 only; every rank stops in the same step and names rank 1."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import nanscan
from nanscan.monitor import distributed


def worker(rank, world, out_dir):
    # (what every read asks first: more than one process? read where torch keeps the default group)
    result = {"rank": rank, "active_before_init": distributed.active()}
    # A file rendezvous: no TCP port to race for with other processes on the machine.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    result["active"] = [distributed.active(), dist.is_initialized() and dist.get_world_size() > 1]
    result["reads_the_group"] = distributed._C10D is not None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with nanscan.watch(model, opt) as mon:
            for i in range(4):
                result["last_step"] = i
                with mon.step():
                    x = torch.randn(3, 4)
                    if rank == 1 and i == 2:
                        x[0, 0] = float("nan")
                    loss = mon.check_loss(model(x).pow(2).mean())
                    loss.backward()
                    opt.step()  # the check before the update is where every rank agrees
                    opt.zero_grad()
    except nanscan.NonFiniteError as e:
        inc = e.incident
        result.update(raised=True, step=inc.step, phase=inc.phase, name=inc.name, incident_rank=inc.rank,
                      produced=inc.produced)
    # records of shards combine in one collective
    shard = torch.tensor([1.0, -2.0, float("inf")]) if rank == 0 else torch.tensor([0.0, float("nan"), 5.0])
    combined, first_rank = nanscan.all_reduce_records(nanscan.records([shard]))
    result["combined"] = combined[0].tolist()
    result["first_rank"] = first_rank.tolist()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # both results are on disk
    # Skip interpreter teardown: gloo's worker threads occasionally abort the process in C++
    # static destructors at exit ("terminate called without an active exception"), after all
    # the work above is done -- a shutdown flake of the test harness, not of nanscan.
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_gloo_fault_on_rank_1_only(tmp_path):
    mp.spawn(worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["active_before_init"] is False and r["active"] == [True, True]
        assert r["reads_the_group"]  # (this torch keeps its default group where active() reads it)
        assert r.get("raised"), f"rank {r['rank']} did not stop"
        assert (r["step"], r["last_step"], r["phase"], r["incident_rank"]) == (2, 2, "forward", 1)
        assert (r["name"], r["produced"]) == ("0", False)  # the batch of rank 1 carried the NaN
        nan, pos, neg, zero, mn, mx, sumsq, first, total, sum4 = r["combined"]
        assert (nan, pos, neg, zero, mn, mx, sumsq, total, sum4) == (1, 1, 0, 1, -2.0, 5.0, 30.0, 4.0, 642.0)
        assert r["first_rank"] == [0] and first == 2  # rank 0's shard comes first: its +inf at index 2

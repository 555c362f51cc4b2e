"""Tensor parallelism (parallelize_module: ColwiseParallel then RowwiseParallel) on 2 gloo ranks:
faults planted on rank 1 only are named on every rank, at rank 1 -- also where the row-parallel
all-reduce spreads them to rank 0 (rank 1 recorded them earlier in the step's production order)."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import nanscan
from tests.test_fsdp import Faulty


def make_model(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Faulty(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def scenario(rank, mesh, fault):
    model = make_model(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    try:
        with nanscan.watch(model, opt) as mon:
            seen["sharded"] = mon._sharded
            for step in range(4):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # TP: the same batch
                planted = rank == 1 and step == 2
                model[1].mode = fault if planted and fault in ("forward", "backward") else None
                if planted and fault == "batch":
                    x[1, 3] = float("nan")
                model(x).pow(2).mean().backward()
                if planted and fault == "update":  # a huge (finite) gradient on rank 1's shard: the update overflows
                    model[2].weight.grad._local_tensor.fill_(1e38)
                    for group in opt.param_groups:
                        group["lr"] = 1e3
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        inc = e.incident
        seen.update(step=inc.step, phase=inc.phase, name=inc.name, produced=inc.produced, rank=inc.rank)
    return seen


def worker(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for fault in ("forward", "backward", "batch", "update"):
        results[fault] = scenario(rank, mesh, fault)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tensor_parallel_faults_on_rank_1_are_named_at_rank_1(tmp_path):
    mp.spawn(worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    expected = {
        "forward": (2, "forward", "1", True),  # rank 0 sees it only after the row-parallel all-reduce, in "2"
        "backward": (2, "backward", "1", True),
        "batch": (2, "forward", "0", False),
        "update": (2, "update", "2.weight", True),
    }
    for r in range(2):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        for fault, (step, phase, name, produced) in expected.items():
            seen = results[fault]
            assert seen["sharded"], "tensor-parallel parameters are DTensors"
            assert (seen.get("step"), seen.get("phase"), seen.get("name"), seen.get("produced"), seen.get("rank")) == (
                step, phase, name, produced, 1), (r, fault, seen)

"""Tensor parallelism (parallelize_module: ColwiseParallel then RowwiseParallel) on 2 gloo ranks:
faults planted on rank 1 only are named on every rank, at rank 1 -- also where the row-parallel
all-reduce spreads them to rank 0 (rank 1 recorded them earlier in the step's production order)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import ranks
from tests.test_fsdp import FAULTS, Faulty


def make_model(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Faulty(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def worker(rank, world):
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for fault in FAULTS:
        model = make_model(mesh)
        results[fault] = ranks.planted_run(  # tensor parallel: the same batch on every rank
            model, model[1], rank, fault, lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(step)),
            update_param=model[2].weight)
        dist.barrier()
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tensor_parallel_faults_on_rank_1_are_named_at_rank_1(tmp_path):
    expected = {
        "forward": (2, "forward", "1", True),  # rank 0 sees it only after the row-parallel all-reduce, in "2"
        "backward": (2, "backward", "1", True),
        "batch": (2, "forward", "0", False),
        "update": (2, "update", "2.weight", True),
    }
    for r, results in enumerate(ranks.spawn(worker, 2, tmp_path)):
        for fault, want in expected.items():
            seen = results[fault]
            assert seen["sharded"], "tensor-parallel parameters are DTensors"
            assert ranks.key(seen) == want + (1,), (r, fault, seen)

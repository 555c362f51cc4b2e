"""More distributed loops on gloo ranks (CPU), each with faults planted on rank 1 only:
DDP with no_sync() gradient accumulation (2 ranks), FSDP2 with activation checkpointing
(2 ranks), and a 2-D mesh FSDP x tensor parallel (4 ranks). Every rank names rank 1, in the
fault's real step and phase, once."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanscan
from tests.test_fsdp import Faulty


def _incident(seen, e):
    inc = e.incident
    seen.update(step=inc.step, phase=inc.phase, name=inc.name, produced=inc.produced, rank=inc.rank)


def ddp_no_sync(rank, fault):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Faulty(), nn.Linear(16, 1))
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    try:
        with nanscan.watch(model, opt) as mon:
            for step in range(4):
                for micro in range(2):  # gradient accumulation: the first micro-step without the all-reduce
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro + 100 * rank))
                    planted = rank == 1 and step == 2 and micro == 1
                    inner[2].mode = fault if planted else None
                    ctx = model.no_sync() if micro == 0 else torch.enable_grad()
                    with ctx:
                        model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            seen["ledger"] = [mon.ledger.attempted, mon.ledger.applied]
    except nanscan.NonFiniteError as e:
        _incident(seen, e)
        seen["ledger"] = [mon.ledger.attempted, mon.ledger.applied]
    return seen


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.faulty = nn.Linear(16, 16), nn.Tanh(), Faulty()

    def forward(self, x):
        return self.faulty(self.act(self.lin(x)))


class CheckpointedNet(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)  # recomputed in the backward
        return self.out(h)


def fsdp_checkpoint(rank, fault, use_reentrant):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = CheckpointedNet(use_reentrant)
    for m in (model.inp, model.block, model.out):
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    try:
        with nanscan.watch(model, opt):
            for step in range(4):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 100 * rank))
                model.block.faulty.mode = fault if (rank == 1 and step == 2) else None
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        _incident(seen, e)
    return seen


def worker2(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    results = {}
    for fault in ("forward", "backward"):
        results[f"ddp-{fault}"] = ddp_no_sync(rank, fault)
        dist.barrier()
        for reentrant in (False, True):
            results[f"ckpt-{fault}-{reentrant}"] = fsdp_checkpoint(rank, fault, reentrant)
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_no_sync_and_fsdp2_checkpointing_name_rank_1(tmp_path):
    mp.spawn(worker2, args=(2, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        for fault in ("forward", "backward"):
            ddp = results[f"ddp-{fault}"]
            assert (ddp.get("step"), ddp.get("phase"), ddp.get("name"), ddp.get("produced"), ddp.get("rank")) == (
                2, fault, "module.2", True, 1), (r, fault, ddp)  # (watch(ddp_model): names under "module.")
            assert ddp["ledger"] == [3, 2], ddp  # one step per optimizer.step, not per micro-step
            for reentrant in (False, True):
                seen = results[f"ckpt-{fault}-{reentrant}"]
                if fault == "backward" and reentrant:
                    # A reentrant checkpoint runs the block's first forward without grad, so no
                    # output gradient inside it is tapped, and the recomputation inside the
                    # backward is not recorded: the first record is a (reduced) parameter
                    # gradient, and nanscan says it cannot tell (produced=None), never "produced".
                    assert (seen.get("step"), seen.get("phase"), seen.get("produced")) == (2, "backward", None), seen
                    continue
                assert (seen.get("step"), seen.get("phase"), seen.get("name"), seen.get("produced"),
                        seen.get("rank")) == (2, fault, "block.faulty", True, 1), (r, fault, reentrant, seen)


def fsdp_x_tp(rank, mesh, fault):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Faulty(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp_rank = mesh["dp"].get_local_rank()
    seen = {}
    try:
        with nanscan.watch(model, opt):
            for step in range(4):
                # the same batch within a tensor-parallel group, different ones across data-parallel ranks
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 100 * dp_rank))
                model[1].mode = fault if (rank == 1 and step == 2) else None
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        _incident(seen, e)
    return seen


def worker4(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for fault in ("forward", "backward"):
        results[fault] = fsdp_x_tp(rank, mesh, fault)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_x_tensor_parallel_on_a_2d_mesh_names_rank_1(tmp_path):
    mp.spawn(worker4, args=(4, str(tmp_path)), nprocs=4, join=True)
    for r in range(4):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        for fault, seen in results.items():
            assert (seen.get("step"), seen.get("phase"), seen.get("name"), seen.get("produced"), seen.get("rank")) == (
                2, fault, "1", True, 1), (r, fault, seen)

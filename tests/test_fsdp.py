"""FSDP2 (fully_shard) on 2 gloo ranks: watch a sharded model; faults planted on rank 1 only are
named on every rank (same step, phase, module, produced, first failing rank 1); parameters and
gradients are summarized shard-locally (their DTensors' local shards, never all-gathered)."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import nanscan

CONFIGS = {"reshard": dict(reshard_after_forward=True), "no-reshard": dict(reshard_after_forward=False),
           "bf16-params": dict(reshard_after_forward=True, bf16=True)}


class Faulty(nn.Module):
    """Identity unless ``mode`` says: "forward" multiplies by inf, "backward" adds sqrt(0 * x)
    (finite forward, NaN gradient)."""

    def __init__(self):
        super().__init__()
        self.mode = None

    def forward(self, x):
        if self.mode == "forward":
            return x * float("inf")
        if self.mode == "backward":
            return x + torch.sqrt(x * 0.0)
        return x


def make_model(config):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), Faulty(), nn.Linear(16, 1))
    kwargs = {"reshard_after_forward": config["reshard_after_forward"]}
    if config.get("bf16"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def scenario(rank, config, fault):
    """4 steps; at step 2, rank 1 only gets the fault. Returns what this rank saw."""
    model = make_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    try:
        with nanscan.watch(model, opt) as mon:
            seen["sharded"] = mon._sharded
            for step in range(4):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(4, 8, generator=g)
                planted = rank == 1 and step == 2
                model[3].mode = fault if planted and fault in ("forward", "backward") else None
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
        seen.update(step=inc.step, phase=inc.phase, name=inc.name, produced=inc.produced, rank=inc.rank,
                    shape=list(inc.summary.shape))
    return seen


def worker(rank, world, out_dir, config_name):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    results = {}
    for fault in ("forward", "backward", "batch", "update"):
        results[fault] = scenario(rank, CONFIGS[config_name], fault)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)  # (see test_distributed.py: gloo's threads can abort at interpreter teardown)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_fsdp2_faults_on_rank_1_are_named_on_every_rank(tmp_path, config_name):
    mp.spawn(worker, args=(2, str(tmp_path), config_name), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {
        "forward": (2, "forward", "3", True),
        "backward": (2, "backward", "3", True),
        "batch": (2, "forward", "0", False),  # propagated from rank 1's batch
        "update": (2, "update", "2.weight", True),
    }
    for r in results:
        for fault, (step, phase, name, produced) in expected.items():
            seen = r[fault]
            assert seen["sharded"], "FSDP2's parameters are DTensors"
            assert (seen.get("step"), seen.get("phase"), seen.get("name"), seen.get("produced"), seen.get("rank")) == (
                step, phase, name, produced, 1), (fault, seen)
        # parameters are summarized shard-locally: rank 1's half of the 16x16 weight
        assert r["update"]["shape"] == [8, 16]

"""Shared pieces of the multi-rank tests (gloo on CPU): spawning ranks with a file rendezvous, and
the planted-fault loop the FSDP2 / tensor-parallel tests run on every rank."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nanscan


def spawn(worker, world: int, tmp_path, *args) -> list:
    """Run ``worker(rank, world, *args) -> dict`` on ``world`` gloo ranks; returns every rank's dict."""
    mp.spawn(_run, args=(world, str(tmp_path), worker, args), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _run(rank, world, out_dir, worker, args):
    # A file rendezvous: no TCP port to race for with other processes on the machine.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    result = worker(rank, world, *args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # every result is on disk
    # Skip interpreter teardown: gloo's worker threads occasionally abort the process in C++ static
    # destructors at exit, after all the work is done -- a shutdown flake of the harness, not nanscan's.
    os._exit(0)


def incident_of(error) -> dict:
    inc = error.incident
    return dict(step=inc.step, phase=inc.phase, name=inc.name, produced=inc.produced, rank=inc.rank,
                shape=list(inc.summary.shape))


def key(seen: dict) -> tuple:
    return seen.get("step"), seen.get("phase"), seen.get("name"), seen.get("produced"), seen.get("rank")


def planted_run(model, faulty, rank: int, fault: str, batch, steps: int = 4, fault_step: int = 2,
                update_param=None) -> dict:
    """Train ``steps`` SGD steps on ``batch(step)``; at ``fault_step`` rank 1 only gets ``fault``:
    "forward" / "backward" (``faulty.mode``), "batch" (a NaN in its batch), "update" (a huge finite
    gradient on its shard of ``update_param``, so the update overflows). Returns what this rank saw."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    try:
        with nanscan.watch(model, opt) as mon:
            seen["sharded"] = mon.tensors.sharded
            for step in range(steps):
                x = batch(step)
                planted = rank == 1 and step == fault_step
                faulty.mode = fault if planted and fault in ("forward", "backward") else None
                if planted and fault == "batch":
                    x[1, 3] = float("nan")
                model(x).pow(2).mean().backward()
                if planted and fault == "update":
                    update_param.grad._local_tensor.fill_(1e38)
                    for group in opt.param_groups:
                        group["lr"] = 1e3
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        seen.update(incident_of(e))
    return seen

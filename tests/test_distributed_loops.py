"""More distributed loops on gloo ranks (CPU), each with faults planted on rank 1 only:
DDP with no_sync() gradient accumulation (2 ranks), FSDP2 with activation checkpointing
(torch.utils.checkpoint reentrant and not, checkpoint_wrapper, composable checkpoint; 2 ranks), and a
2-D mesh FSDP x tensor parallel (4 ranks). Every rank names rank 1, in the fault's real step and
phase, once."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanscan
from tests import ranks
from tests.test_fsdp import Faulty


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
                    inner[2].mode = fault if planted and fault in ("forward", "backward") else None
                    if planted and fault == "batch":
                        x[1, 3] = float("nan")
                    ctx = model.no_sync() if micro == 0 else torch.enable_grad()
                    with ctx:
                        model(x).pow(2).mean().backward()
                if rank == 1 and step == 2 and fault == "update":  # after the all-reduce: rank 1's update only
                    inner[0].weight.grad.fill_(1e38)
                    for group in opt.param_groups:
                        group["lr"] = 1e3
                opt.step()
                opt.zero_grad()
            seen["ledger"] = [mon.ledger.attempted, mon.ledger.applied]
    except nanscan.NonFiniteError as e:
        seen.update(ranks.incident_of(e))
        seen["ledger"] = [mon.ledger.attempted, mon.ledger.applied]
    return seen


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.faulty = nn.Linear(16, 16), nn.Tanh(), Faulty()

    def forward(self, x):
        return self.faulty(self.act(self.lin(x)))


class CheckpointedNet(nn.Module):
    """``how``: ``"reentrant"`` / ``"non-reentrant"`` (torch.utils.checkpoint in forward),
    ``"wrapper"`` (``checkpoint_wrapper``, torchtitan's default with FSDP2: the block becomes
    ``block._checkpoint_wrapped_module``) or ``"composable"`` (``torch.distributed._composable
    .checkpoint``: hooks on the block, non-reentrant)."""

    def __init__(self, how):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 1)
        self.how = how
        if how == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.block = checkpoint_wrapper(self.block)
        elif how == "composable":
            from torch.distributed._composable import checkpoint as composable_checkpoint

            composable_checkpoint(self.block)

    def forward(self, x):
        h = self.inp(x)
        if self.how in ("reentrant", "non-reentrant"):  # recomputed in the backward
            h = checkpoint(self.block, h, use_reentrant=self.how == "reentrant")
        else:
            h = self.block(h)
        return self.out(h)


def fsdp_checkpoint(rank, fault, how):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = CheckpointedNet(how)
    for m in (model.inp, model.block, model.out):
        fully_shard(m)
    fully_shard(model)
    faulty = model.block._checkpoint_wrapped_module.faulty if how == "wrapper" else model.block.faulty
    return ranks.planted_run(model, faulty, rank, fault,
                             lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 100 * rank)),
                             update_param=model.inp.weight)


FAULTS = ("forward", "backward", "batch", "update")
CHECKPOINTING = ("non-reentrant", "reentrant", "wrapper", "composable")


def worker2(rank, world):
    results = {}
    for fault in FAULTS:
        results[f"ddp-{fault}"] = ddp_no_sync(rank, fault)
        dist.barrier()
        for how in CHECKPOINTING:
            results[f"ckpt-{fault}-{how}"] = fsdp_checkpoint(rank, fault, how)
            dist.barrier()
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_no_sync_and_fsdp2_checkpointing_name_rank_1(tmp_path):
    ddp_expected = {"forward": (2, "forward", "module.2", True), "backward": (2, "backward", "module.2", True),
                    "batch": (2, "forward", "module.0", False),  # propagated from rank 1's batch
                    "update": (2, "update", "module.0.weight", True)}
    ckpt_expected = {"forward": (2, "forward", "block.faulty", True), "backward": (2, "backward", "block.faulty", True),
                     "batch": (2, "forward", "inp", False), "update": (2, "update", "inp.weight", True)}
    for r, results in enumerate(ranks.spawn(worker2, 2, tmp_path)):
        for fault in FAULTS:
            ddp = results[f"ddp-{fault}"]
            assert ranks.key(ddp) == ddp_expected[fault] + (1,), (r, fault, ddp)  # (names under "module.")
            # one step per optimizer.step, not per micro-step (an update fault of step 2 is read with step
            # 3's records, before step 3's update: 4 attempts, 3 applied)
            assert ddp["ledger"] == ([4, 3] if fault == "update" else [3, 2]), (fault, ddp)
            for how in CHECKPOINTING:
                seen = results[f"ckpt-{fault}-{how}"]
                if fault == "backward" and how == "reentrant":
                    # A reentrant checkpoint runs the block's first forward without grad, so no
                    # output gradient inside it is tapped, and the recomputation inside the
                    # backward is not recorded: the first record is a (reduced) parameter
                    # gradient, and nanscan says it cannot tell (produced=None), never "produced".
                    assert (seen.get("step"), seen.get("phase"), seen.get("produced")) == (2, "backward", None), seen
                    continue
                want = ckpt_expected[fault]
                if how == "wrapper":
                    want = (want[0], want[1], want[2].replace("block.", "block._checkpoint_wrapped_module."), want[3])
                assert ranks.key(seen) == want + (1,), (r, fault, how, seen)


def fsdp_x_tp(rank, mesh, fault):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Faulty(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    # the same batch within a tensor-parallel group, different ones across data-parallel ranks
    return ranks.planted_run(model, model[1], rank, fault,
                             lambda step: torch.randn(4, 8,
                                                      generator=torch.Generator().manual_seed(step + 100 * dp_rank)),
                             update_param=model[4].weight)


def worker4(rank, world):
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for fault in FAULTS:
        results[fault] = fsdp_x_tp(rank, mesh, fault)
        dist.barrier()
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_x_tensor_parallel_on_a_2d_mesh_names_rank_1(tmp_path):
    expected = {"forward": (2, "forward", "1", True), "backward": (2, "backward", "1", True),
                "batch": (2, "forward", "0", False), "update": (2, "update", "4.weight", True)}
    for r, results in enumerate(ranks.spawn(worker4, 4, tmp_path)):
        for fault, seen in results.items():
            assert ranks.key(seen) == expected[fault] + (1,), (r, fault, seen)


class ActNet(nn.Module):
    """fc1 -> act (no parameters) -> fc2 -> head; ``act.mode`` plants the fault."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.head = nn.Linear(8, 16), Faulty(), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(self.act(self.fc1(x)))))


def fsdp2_act_run(rank, style, on_nonfinite, mode):
    """4 AdamW steps of a fully_shard-ed ActNet, rank 1's ``act`` making infinities in step 2's
    forward; ``style``: where the loop puts ``with mon.step``, the backward and the optimizer step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ActNet()
    for m in (model.fc1, model.fc2, model.head):
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    try:
        with nanscan.watch(model, opt, on_nonfinite=on_nonfinite, mode=mode) as mon:
            for step in range(4):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 100 * rank))
                model.act.mode = "forward" if rank == 1 and step == 2 else None
                if style == "plain":
                    model(x).pow(2).mean().backward()
                else:
                    with mon.step((x,)):
                        loss = mon.check_loss(model(x).pow(2).mean())
                        if style != "backward-after-block":
                            loss.backward()
                        if style == "explicit":
                            opt.step()
                            opt.zero_grad()
                    if style == "backward-after-block":
                        loss.backward()
                if style != "explicit":
                    opt.step()
                    opt.zero_grad()
    except nanscan.NonFiniteError as e:
        seen.update(ranks.incident_of(e))
    if on_nonfinite == "record" and mon.incident is not None:
        inc = mon.incident
        seen.update(step=inc.step, phase=inc.phase, name=inc.name, produced=inc.produced, rank=inc.rank)
    seen["incidents"] = [(i.step, i.phase) for i in mon.incidents]
    return seen


FSDP2_ACT_STYLES = ("explicit", "update-after-block", "backward-after-block", "plain")
FSDP2_ACT_RUNS = (("raise", "sync"), ("record", "sync"), ("record", "async"))


def fsdp2_parameter_free_fault(rank, world):
    results = {}
    for style in FSDP2_ACT_STYLES:
        for on_nonfinite, mode in FSDP2_ACT_RUNS:
            results[f"{style}/{on_nonfinite}/{mode}"] = fsdp2_act_run(rank, style, on_nonfinite, mode)
            dist.barrier()
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_a_fault_in_a_parameter_free_module_on_rank_1_is_named_on_every_rank(tmp_path):
    # Rank 0 sees the fault only as the gradients reduced from rank 1 (its own fc1.weight gradient,
    # "cannot tell"): its first incident -- raised, or mon.incident in record mode -- is still rank
    # 1's, in the step the loop ran it in, whether the optimizer step is inside `with mon.step` or
    # after it; and a step and phase has one incident on each rank.
    for r, results in enumerate(ranks.spawn(fsdp2_parameter_free_fault, 2, tmp_path)):
        for run, seen in results.items():
            assert ranks.key(seen) == (2, "forward", "act", True, 1), (r, run, seen)
            incidents = [tuple(k) for k in seen["incidents"]]
            assert len(incidents) == len(set(incidents)) and incidents == sorted(incidents, key=lambda k: (
                k[0], ("forward", "loss", "backward", "update").index(k[1]))), (r, run, incidents)
            # (4 steps: no step of its own for the update)
            assert max(step for step, _ in incidents) <= 3, (r, run, incidents)

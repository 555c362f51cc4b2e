"""FSDP2 (fully_shard) on 2 gloo ranks: watch a sharded model; faults planted on rank 1 only are
named on every rank (same step, phase, module, produced, first failing rank 1); parameters and
gradients are summarized shard-locally (their DTensors' local shards, never all-gathered)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import ranks

CONFIGS = {"reshard": dict(reshard_after_forward=True), "no-reshard": dict(reshard_after_forward=False),
           "bf16-params": dict(reshard_after_forward=True, bf16=True)}
FAULTS = ("forward", "backward", "batch", "update")


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


def worker(rank, world, config_name):
    results = {}
    for fault in FAULTS:
        model = make_model(CONFIGS[config_name])
        results[fault] = ranks.planted_run(  # data parallel: every rank its own batch
            model, model[3], rank, fault, lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(
                100 * step + rank)), update_param=model[2].weight)
        dist.barrier()
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_fsdp2_faults_on_rank_1_are_named_on_every_rank(tmp_path, config_name):
    expected = {
        "forward": (2, "forward", "3", True),
        "backward": (2, "backward", "3", True),
        "batch": (2, "forward", "0", False),  # propagated from rank 1's batch
        "update": (2, "update", "2.weight", True),
    }
    for r in ranks.spawn(worker, 2, tmp_path, config_name):
        for fault, want in expected.items():
            seen = r[fault]
            assert seen["sharded"], "FSDP2's parameters are DTensors"
            assert ranks.key(seen) == want + (1,), (fault, seen)
        # parameters are summarized shard-locally: rank 1's half of the 16x16 weight
        assert r["update"]["shape"] == [8, 16]

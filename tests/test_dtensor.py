"""DTensor summaries on gloo ranks (CPU): nanscan.summarize(dt) is the summary of the global
tensor -- counts, min / max, sum of squares and the first non-finite index in global row-major
order -- for Shard(d) (even and uneven), Replicate and 2-D meshes; Partial is refused clearly;
nanscan.record(dt) compiles to the same local record (fullgraph on torch 2.14)."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nanscan


def global_tensor(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    flat = x.view(-1)
    flat[7] = float("nan")
    flat[-3] = float("inf")
    flat[11] = float("-inf")
    flat[2] = 0.0
    return x


def as_list(summary):
    d = summary.to_dict()
    return [d[k] for k in ("shape", "nan_count", "posinf_count", "neginf_count", "zero_count", "finite_min",
                           "finite_max", "first_nonfinite_index")], [summary.sumsq, summary.sum, summary.sum4]


def worker(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    results = {}
    if world == 2:
        mesh = init_device_mesh("cpu", (2,))
        cases = {"shard0": ((6, 5), [Shard(0)]), "shard1": ((6, 5), [Shard(1)]),
                 "uneven": ((5, 7), [Shard(0)]), "replicate": ((4, 6), [Replicate()]),
                 "shard1-3d": ((3, 4, 6), [Shard(2)])}
    else:
        mesh = init_device_mesh("cpu", (2, 2))
        cases = {"2d-shard0-shard1": ((6, 8), [Shard(0), Shard(1)]),
                 "2d-replicate-shard0": ((6, 8), [Replicate(), Shard(0)]),
                 "2d-shard1-shard1": ((4, 8), [Shard(1), Shard(1)])}
    dts = []
    for k, (name, (shape, placements)) in enumerate(cases.items()):
        x = global_tensor(shape, seed=k)
        dt = distribute_tensor(x, mesh, placements)
        dts.append(dt)
        results[name] = {"dtensor": as_list(nanscan.summarize(dt)), "full": as_list(nanscan.summarize(x))}
    many = nanscan.summarize_many(dts)  # one list, one collective per mesh dimension
    results["many"] = [as_list(s) for s in many]
    if world == 2:  # record(dt) inside a compiled function: the same local record as eager
        # (fullgraph where dynamo traces DTensor's shard offsets -- torch 2.14 does, 2.11 breaks the
        # graph there and runs that part eagerly)
        fullgraph = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)
        compiled = torch.compile(lambda t: nanscan.record(t), fullgraph=fullgraph, backend="aot_eager")
        results["compiled"] = [torch.equal(compiled(dt), nanscan.record(dt)) for dt in dts]
    try:
        from torch.distributed.tensor import DTensor
        p = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()] * mesh.ndim)
        nanscan.summarize(p)
        results["partial"] = "accepted"
    except ValueError as e:
        results["partial"] = str(e)
    # all_reduce_records over a DeviceMesh dimension: pairs of ranks along the last dimension
    shard = torch.tensor([float(rank), float("nan") if rank % 2 else 0.0])
    combined, first_rank = nanscan.all_reduce_records(nanscan.records([shard]), mesh, mesh_dim=mesh.ndim - 1)
    results["mesh_dim"] = [combined[0].tolist(), first_rank.tolist()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_summary_is_the_global_tensors(tmp_path, world):
    mp.spawn(worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        (nan, pos, neg, zero, mn, mx, sumsq, first, total, sum4), first_rank = results.pop("mesh_dim")
        pair = [2 * (r // 2), 2 * (r // 2) + 1] if world == 4 else [0, 1]  # the ranks along the last mesh dim
        # shards [p0, 0] and [p1, nan]: one NaN, at index 1 of the group's second rank
        zeros = 2 if pair[0] == 0 else 1
        assert (nan, zero, mn, mx, first, first_rank) == (1, zeros, 0, pair[1], 1, [1])
        # the sums add over the finite elements p0, 0 and p1 (the NaN is out)
        assert (sumsq, total, sum4) == (pair[0] ** 2 + pair[1] ** 2, sum(pair), pair[0] ** 4 + pair[1] ** 4)
        many = results.pop("many")
        assert results.pop("compiled", [True] * len(many)) == [True] * len(many)
        assert "Partial" in results.pop("partial")
        assert many == [got["dtensor"] for got in results.values()]  # the list: the same summaries
        for name, got in results.items():
            (fields, sums), (want, want_sums) = got["dtensor"], got["full"]
            assert fields == want, (r, name)
            sumsq, total, sum4 = sums
            want_sumsq, want_total, want_sum4 = want_sums
            assert math.isclose(sumsq, want_sumsq, rel_tol=1e-5), (r, name)
            assert math.isclose(sum4, want_sum4, rel_tol=1e-5), (r, name)
            assert abs(total - want_total) <= 1e-5 * want_sumsq ** 0.5 * 8, (r, name)  # (|sum| <= sqrt(n sumsq))

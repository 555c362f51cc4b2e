"""Cost of the monitor's per-step agreement across ranks (issue 11): every checked step, every rank
learns which incident (if any) all ranks report -- ``nanscan.monitor.distributed.agree``: one
``all_reduce(MIN)`` of one int64, plus one broadcast of the incident only when there is one.
Baseline: the all_gather of a 3-float row per rank it replaced (bytes per rank grow with the world
size). Also the telemetry step's gather under torch.distributed (``nanscan.monitor.health``): every
rank's numbers of a 200-module model (200 outputs, 200 parameters and 200 gradients) gathered to
rank 0 and combined there -- paid once per telemetry step, not per checked step. gloo on this
machine's CPU cores, file rendezvous; median microseconds per call.

    python -m benchmarks.agreement [--worlds 2 4 8] [--calls 200]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _all_gather_baseline():
    row = torch.zeros(3, dtype=torch.float64)
    gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    return torch.stack(gathered).tolist()


def _worker(rank, world, out_dir, calls):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    from nanscan.monitor import distributed
    from nanscan.monitor.incident import Incident

    incident = Incident(step=3, phase="backward", name="blocks.1.mlp", kind="grad", produced=True, summary=None,
                        rank=rank, inputs=(), handled_by_scaler=False)

    def timed(fn, n):
        for _ in range(5):
            fn()
        dist.barrier()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e6

    from nanscan.monitor.health import _points
    from nanscan.monitor.health_ranks import combine

    raw = {(f"nanscan/rms/blocks.{i}",) * 5: (4096, 4096, 1.0 + i, 3, 2.0, 65504.0) for i in range(200)}
    raw.update({(f"nanscan/{kind}_norm/blocks.{i}.weight",) * 3: (4096, 1.0, 0.5, "plain")
                for i in range(200) for kind in ("param", "grad")})
    payload = {"raw": raw, "counts": {}, "clipped": False, "grad_contrib": 1.0,
               "step": {"loss": 1.0, "grad_norm": 2.0, "loss_scale": None, "updates_skipped": 0, "nonfinite": 0}}

    def telemetry_gather():
        gathered = distributed.gather_to(payload, 0)
        if gathered is not None:
            _points(*combine(gathered, publisher=0, sharded=False))

    result = {
        "agree, no incident": timed(lambda: distributed.agree(None), calls),
        "agree, incident on the last rank": timed(
            lambda: distributed.agree(incident if rank == world - 1 else None), max(calls // 10, 5)),
        "all_gather baseline (old agree)": timed(_all_gather_baseline, calls),
        "telemetry gather, 200 modules": timed(telemetry_gather, max(calls // 10, 5)),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)


def measure(world: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, out_dir, calls), nprocs=world, join=True)
        per_rank = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}  # the slowest rank sets the pace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"agreement per checked step, gloo, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"median us per call (slowest rank)")
    rows = {w: measure(w, args.calls) for w in args.worlds}
    names = list(next(iter(rows.values())))
    print(f"{'ranks':>5}  " + "  ".join(f"{n:>34}" for n in names))
    for w, r in rows.items():
        print(f"{w:>5}  " + "  ".join(f"{r[n]:>34.1f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())

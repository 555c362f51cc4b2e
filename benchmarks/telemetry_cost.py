"""What telemetry adds to a watched step: ``nanscan.watch(model, opt, telemetry=sink,
telemetry_every=10)`` against ``nanscan.watch(model, opt)``, side by side in interleaved rounds, on
the CPU GPT step of ``bench_monitor`` (4 layers, d=256) and on the 200-module host-bound step of
``host_cost``. The sink is a function that keeps the last point (what a tracker costs is the
tracker's). Each round times ``steps`` steps of each variant (the order rotates), so the ratio of
the medians compares steps taken seconds apart; every ``telemetry_every``-th step publishes.

    python -m benchmarks.telemetry_cost [--rounds R] [--steps N] [--every N]

Targets: <= 1.02x on the GPT step, <= 1.05x on the host-bound step.
"""
import argparse
import statistics
import time

import torch

import nanscan
from benchmarks import bench_monitor
from benchmarks.host_cost import make_host_bound, train_step


def _gpt():
    model, opt, idx = bench_monitor.make()
    return model, opt, lambda: bench_monitor.step(model, opt, idx)


def _host():
    model, opt, x = make_host_bound()
    return model, opt, lambda: train_step(model, opt, x)


def measure(make, rounds: int, steps: int, every: int) -> dict:
    model, opt, step = make()
    kept = {}
    variants = {"watched": {}, f"watched + telemetry every {every}": dict(
        telemetry=lambda s, points: kept.__setitem__("last", points), telemetry_every=every)}
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            with nanscan.watch(model, opt, **variants[name]):
                for _ in range(3):
                    step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                times[name].append((time.perf_counter() - t0) / steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"median_s": medians, "ratio": medians[names[1]] / medians[names[0]], "scalars": len(kept.get("last", {}))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    for label, make, n_threads in (("gpt 4x256 (CPU)", _gpt, threads), ("200x Linear(8,8), 1 thread", _host, 1)):
        torch.set_num_threads(n_threads)
        result = measure(make, args.rounds, args.steps, args.every)
        m = result["median_s"]
        print(f"{label:<28} " + "  ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in m.items())
              + f"  ratio {result['ratio']:.3f}x  ({result['scalars']} scalars per point)")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()

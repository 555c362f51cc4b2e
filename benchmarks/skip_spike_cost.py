"""What ``on_nonfinite="skip"`` and ``spikes=True`` add to a watched step, side by side in interleaved
rounds against ``nanscan.watch(model, opt)``, on the CPU GPT step of ``bench_monitor`` (4 layers,
d=256) and the 200-module host-bound step of ``host_cost`` (clean steps: nothing is skipped); and
the memory skip keeps, the snapshot of the model's buffers, against the model's parameters, for the
GPT model and torchvision's resnet18 (BatchNorm: the buffers skip restores).

    python -m benchmarks.skip_spike_cost [--rounds R] [--steps N]
"""
import argparse
import statistics
import time
import warnings

import torch

import nanscan
from benchmarks import bench_monitor
from benchmarks.telemetry_cost import _gpt, _host

VARIANTS = {"watched": {}, "+ on_nonfinite='skip'": {"on_nonfinite": "skip"}, "+ spikes=True": {"spikes": True}}


def measure(make, rounds: int, steps: int) -> dict:
    model, opt, step = make()
    times = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with warnings.catch_warnings(), nanscan.watch(model, opt, **VARIANTS[name]):
                warnings.simplefilter("ignore")
                for _ in range(3):
                    step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                times[name].append((time.perf_counter() - t0) / steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {name: medians[name] / medians["watched"] for name in names[1:]}


def snapshot_bytes(model) -> tuple:
    """(bytes of the buffer snapshot skip keeps, bytes of the parameters)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanscan.watch(model, opt, on_nonfinite="skip") as mon:
        mon.skipper.snapshot()
        kept = mon.skipper.memory_bytes()
    return kept, sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.rounds} interleaved rounds of {args.steps} steps; ratio of medians "
          "against the watched step")
    for label, make in (("GPT step (CPU)", _gpt), ("host-bound step, 200 modules", _host)):
        ratios = measure(make, args.rounds, args.steps)
        print(f"{label:32s} " + "  ".join(f"{name} {ratio:.3f}x" for name, ratio in ratios.items()))
    import torchvision

    for label, model in (("GPT", bench_monitor.make()[0]), ("resnet18", torchvision.models.resnet18())):
        kept, params = snapshot_bytes(model)
        print(f"skip's buffer snapshot, {label}: {kept / 2**10:.1f} KiB ({kept / params:.2%} of the parameters' "
              f"{params / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

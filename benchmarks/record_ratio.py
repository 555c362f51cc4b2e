"""The single-tensor CPU record against `torch.sum`, as ratios measured side by side.

    python -m benchmarks.record_ratio [--numel 16777216] [--pairs 41] [--runs 3]

`torch.sum` is the floor: one read of every byte with the least work per element. On a shared
machine two separate timing runs of the same code differ by more than the gap being measured, so
this script alternates the two in one process -- record, sum, sum, record, ... (the order flips
every pair, so neither always runs on the caches the other warmed) -- takes the ratio of each pair and
reports the median over the pairs, for fp32 and bf16 on 1 and 2 threads. `--runs` repeats the whole
measurement and prints every run's median, so the spread between runs is visible too.
"""
import argparse
import statistics
import time

import torch

import nanscan


def pair_ratios(x: torch.Tensor, pairs: int) -> list[float]:
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    record = lambda: nanscan.record(x, backend="cpu")  # noqa: E731
    floor = lambda: x.sum()  # noqa: E731
    for _ in range(3):  # warm-up: page faults, the thread pool, the op's first dispatch
        record()
        floor()
    ratios = []
    for k in range(pairs):
        if k % 2:
            t_floor, t_record = timed(floor), timed(record)
        else:
            t_record, t_floor = timed(record), timed(floor)
        ratios.append(t_record / t_floor)
    return ratios


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--pairs", type=int, default=41)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args(argv)
    if "cpu" not in nanscan.available_backends():
        raise SystemExit("the C++ CPU backend is not built (pip install -e . builds it)")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.numel, generator=gen)
    print(f"record / torch.sum, {args.numel:,} elements, median of {args.pairs} alternated pairs per run, "
          f"{torch.backends.cpu.get_cpu_capability()} torch")
    print("| dtype | threads | " + " | ".join(f"run {r + 1}" for r in range(args.runs)) + " |")
    print("|---|---|" + "---|" * args.runs)
    saved_threads = torch.get_num_threads()
    try:
        for dtype in args.dtypes.split(","):
            x = base.to(getattr(torch, dtype)).contiguous()
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                medians = [statistics.median(pair_ratios(x, args.pairs)) for _ in range(args.runs)]
                print(f"| {dtype} | {threads} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    finally:
        torch.set_num_threads(saved_threads)


if __name__ == "__main__":
    main()

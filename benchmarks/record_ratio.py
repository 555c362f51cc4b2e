"""The single-tensor CPU record against `torch.sum`, as ratios measured side by side.

    python -m benchmarks.record_ratio [--numel 16777216] [--pairs 41] [--runs 3]

`torch.sum` is the floor: one read of every byte with the least work per element. On a shared
machine two separate timing runs of the same code differ by more than the gap being measured, so
this script alternates the two in one process -- record, sum, sum, record, ... (the order flips
every pair, so neither always runs on the caches the other warmed) -- takes the ratio of each pair and
reports the median over the pairs, for fp32 and bf16 on 1 and 2 threads. `--runs` repeats the whole
measurement and prints every run's median, so the spread between runs is visible too.

For scale, `torch.linalg.vector_norm` (one statistic where the record has ten) is measured against
`torch.sum` the same way: torch's own one-statistic reductions are not all at the read floor either.
`--subjects op` times the bare custom op (`torch.ops.nanscan.summarize`), without `nanscan.record`'s
Python.

`--neighbour` runs the measurement beside a memory-streaming process (a NumPy copy of 256 MB, over
and over, on its own core): what a busy machine does to both.

`--cold P` adds what a call costs on its way to the kernel once a large tensor has streamed every
cache out: a call on a 16-element tensor right after a `torch.sum` of the large one, for `torch.sum`,
the op and `nanscan.record` (median of P, in microseconds, beside the same call made warm). A record
of a large tensor pays this on top of its read; the pairs above include it.
"""
import argparse
import contextlib
import statistics
import subprocess
import sys
import time

import torch

import nanscan


SUBJECTS = {
    "record": lambda x: nanscan.record(x, backend="cpu"),
    "op": lambda x: torch.ops.nanscan.summarize.default(x),
    "vector_norm": torch.linalg.vector_norm,
}
COLD_CALLS = {
    "torch.sum": torch.sum,
    "op": lambda x: torch.ops.nanscan.summarize.default(x),
    "record": lambda x: nanscan.record(x, backend="cpu"),
}


NEIGHBOUR = """
import numpy as np
a = np.ones(1 << 26, dtype=np.float32)
b = np.empty_like(a)
print("streaming", flush=True)
while True:
    np.copyto(b, a)
"""


@contextlib.contextmanager
def memory_neighbour(on: bool):
    """A process that streams 256 MB through memory over and over while the block runs (if on); yields it."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "streaming":
            raise SystemExit("the memory-streaming neighbour did not start")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def cold_and_warm(call, big: torch.Tensor, repeats: int) -> tuple:
    """Median microseconds of call(16 elements) right after big.sum() (cold), and right after itself (warm)."""
    small = torch.randn(16)
    cold, warm = [], []
    for _ in range(repeats):
        big.sum()
        t0 = time.perf_counter()
        call(small)
        t1 = time.perf_counter()
        call(small)
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def pair_ratios(subject, x: torch.Tensor, pairs: int) -> list[float]:
    """subject(x) / x.sum() time ratios of `pairs` alternated pairs."""
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    measured = lambda: subject(x)  # noqa: E731
    floor = lambda: x.sum()  # noqa: E731
    for _ in range(3):  # warm-up: page faults, the thread pool, the op's first dispatch
        measured()
        floor()
    ratios = []
    for k in range(pairs):
        if k % 2:
            t_floor, t_measured = timed(floor), timed(measured)
        else:
            t_measured, t_floor = timed(measured), timed(floor)
        ratios.append(t_measured / t_floor)
    return ratios


def _isa() -> str:
    flags = (nanscan.build_info() or {}).get("cpu_flags", [])
    return next((f.split("=", 1)[1] for f in flags if f.startswith("-DCPU_CAPABILITY=")), "portable (no AVX)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--pairs", type=int, default=41)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--subjects", default="record,vector_norm", help=f"of {sorted(SUBJECTS)}")
    parser.add_argument("--neighbour", action="store_true", help="measure beside a memory-streaming process")
    parser.add_argument("--cold", type=int, default=0, metavar="P",
                        help="also time 16-element calls right after a sum of the large tensor (P repeats)")
    args = parser.parse_args(argv)
    if "cpu" not in nanscan.available_backends():
        raise SystemExit("the C++ CPU backend is not built (pip install -e . builds it)")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.numel, generator=gen)
    subjects = args.subjects.split(",")
    unknown = sorted(set(subjects) - set(SUBJECTS))
    if unknown:
        parser.error(f"unknown --subjects {unknown}; known: {sorted(SUBJECTS)}")
    print(f"time / torch.sum's, {args.numel:,} elements, median of {args.pairs} alternated pairs per run, "
          f"torch's CPU kernels {torch.backends.cpu.get_cpu_capability()}, nanscan's {_isa()}"
          + (", beside a memory-streaming process" if args.neighbour else ""))
    print("| subject | dtype | threads | " + " | ".join(f"run {r + 1}" for r in range(args.runs)) + " |")
    print("|---|---|---|" + "---|" * args.runs)
    saved_threads = torch.get_num_threads()
    with memory_neighbour(args.neighbour):
        try:
            _measure(args, base, subjects)
        finally:
            torch.set_num_threads(saved_threads)


def _measure(args, base: torch.Tensor, subjects: list) -> None:
    """The table of run medians, then (--cold) the 16-element calls."""
    for dtype in args.dtypes.split(","):
        x = base.to(getattr(torch, dtype)).contiguous()
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for subject in subjects:
                medians = [statistics.median(pair_ratios(SUBJECTS[subject], x, args.pairs))
                           for _ in range(args.runs)]
                print(f"| {subject} | {dtype} | {threads} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    if args.cold:
        torch.set_num_threads(1)
        print(f"\n16-element calls on 1 thread, microseconds (median of {args.cold}): cold = right after a "
              f"torch.sum of the {args.numel:,} fp32 elements, warm = right after the same call")
        print("| call | cold | warm |\n|---|---|---|")
        for name, call in COLD_CALLS.items():
            cold, warm = cold_and_warm(call, base, args.cold)
            print(f"| {name} | {cold:.0f} | {warm:.1f} |")


if __name__ == "__main__":
    main()

"""Kernel launches per call (torch.profiler, CUDA only): summarize_many over GPT-2-small parameter
shapes and over 2000 tensors of 64 floats vs torch._foreach_norm and GradScaler's fused non-finite
check (records in at most 2 launches); a single summarize; a compiled graph's stamp given its
records.

On any device, what one stamp (``nanscan::stamp`` given two records, as a compiled graph calls it)
asks of the host: its calls through the dispatcher (torch.profiler's CPU events) and its time
(median of 5 rounds of 2,000 calls), with its kernel (a float64 buffer, the monitor's) and as the
ATen ops every other device takes (a float32 buffer: the same ops the write was before its kernel).

    python -m benchmarks.launch_counts [--device cpu|cuda] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import time

import torch

import nanscan
from benchmarks.bench_summarize import gpt2_small_shapes


def count_kernels(fn) -> int:
    fn()  # warm up (Triton compiles, caching allocator)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _stamp_call():
    """A compiled graph's stamp given two records, into a buffer named for an owner of its own."""
    from nanscan import _C

    buffer = torch.zeros(64, nanscan.RECORD_SIZE + 4, dtype=torch.float64, device="cuda")
    counter = torch.zeros(1, dtype=torch.float64, device="cuda")
    records = torch.ones(2, nanscan.RECORD_SIZE, dtype=torch.float64, device="cuda")
    _C.set_stamp_target(9192, buffer, counter)  # (kept to the process's end: its tensors stay alive)
    return lambda: torch.ops.nanscan.stamp([], records, 9192, 1, "")


def stamp_host_cost(device: str, rounds: int = 5, calls: int = 2000) -> dict:
    """{"kernel" / "ATen ops": {"dispatcher calls", "us per stamp"}}: one stamp given two records
    (see the module docstring)."""
    from nanscan import _C

    owner, out = 9191, {}
    for name, dtype in (("kernel", torch.float64), ("ATen ops", torch.float32)):
        buffer = torch.zeros(64, nanscan.RECORD_SIZE + 4, dtype=dtype, device=device)
        counter = torch.zeros(1, dtype=dtype, device=device)
        records = torch.ones(2, nanscan.RECORD_SIZE, dtype=dtype, device=device)
        stamp = torch.ops.nanscan.stamp
        _C.set_stamp_target(owner, buffer, counter)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                stamp([], records, owner, 1, "")
            ops = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
            times = []
            for _ in range(rounds):
                for _ in range(calls // 10):
                    stamp([], records, owner, 1, "")
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter_ns()
                for _ in range(calls):
                    stamp([], records, owner, 1, "")
                times.append((time.perf_counter_ns() - start) / calls / 1e3)
                if device == "cuda":
                    torch.cuda.synchronize()
        finally:
            _C.set_stamp_target(owner, None, None)
            _C.drop_stamp_count(owner)
        out[name] = {"dispatcher calls": ops, "us per stamp": statistics.median(times)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    stamps = stamp_host_cost(args.device)
    for name, cost in stamps.items():
        print(f"nanscan.stamp, 2 records, {args.device}, {name:<9} {cost['dispatcher calls']:>3} dispatcher calls "
              f"{cost['us per stamp']:8.2f} us per stamp (host)")
    if args.device != "cuda":
        print("launch_counts: no CUDA device here; no launches to count")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"stamp": stamps}, f, indent=1)
        return 0
    params = [torch.randn(s, device="cuda") for s in gpt2_small_shapes()]
    found_inf, inv = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    big = torch.randn(1 << 26, device="cuda")
    small = [torch.randn(64, device="cuda") for _ in range(2000)]
    cases = {
        "torch._foreach_norm (148 tensors)": lambda: torch._foreach_norm(params),
        "torch._amp_foreach_non_finite_check_and_unscale_": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            params, found_inf, inv),
        "torch._foreach_norm (2000 x 64 floats)": lambda: torch._foreach_norm(small),
    }
    for backend in [b for b in ("cuda", "triton") if b in nanscan.available_backends()]:
        cases[f"nanscan.records[{backend}] (148 tensors)"] = lambda b=backend: nanscan.records(params, backend=b)
        cases[f"nanscan.records[{backend}] (2000 x 64 floats)"] = lambda b=backend: nanscan.records(small, backend=b)
        cases[f"nanscan.record[{backend}] (64M fp32)"] = lambda b=backend: nanscan.record(big, backend=b)
    cases["nanscan.stamp, 2 records given (float64 buffer)"] = _stamp_call()
    counts = {name: count_kernels(fn) for name, fn in cases.items()}
    for name, n in counts.items():
        print(f"{name:<55} {n:>5} kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**counts, "stamp": stamps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel launches per call (torch.profiler, CUDA only): summarize_many over GPT-2-small parameter
shapes and over 2000 tensors of 64 floats vs torch._foreach_norm and GradScaler's fused non-finite
check (issue 13's target: records in at most 2 launches); and a single summarize.

    python benchmarks/launch_counts.py [--json out.json]
"""
import argparse
import json
import sys

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_counts: no CUDA device here; nothing to count")
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
    counts = {name: count_kernels(fn) for name, fn in cases.items()}
    for name, n in counts.items():
        print(f"{name:<55} {n:>5} kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

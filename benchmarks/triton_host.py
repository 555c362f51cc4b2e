"""Host (Python) cost of the Triton backend's ``summarize_many`` per tensor, without launching
anything: the pointer-table path's preparation over many small tensors (a model's parameters and
gradients), timed on its own.

    python -m benchmarks.triton_host [--tensors 2000] [--numel 64] [--dtype float32] [--device cpu|cuda]
                                     [--json out.json]

Rows (microseconds per tensor, min and median over repeats of the whole list):

* ``_prepare per tensor``: the full validation / normalization every tensor went through before
  contiguous tensors had a fast path (detach, resolve_neg, contiguous, reshape, views);
* ``_entries``: the preparation now (address, numel and read kind of a contiguous plain tensor);
* ``_table_host``: the whole host side of ``_summarize_many_table`` -- ``_entries``, grouping,
  chunk numbering and the int64 table -- and the same with the fast path switched off.

What it leaves out: the pinned host-to-device copy of the table and the launches. On CPU the
tensors are host tensors under ``TRITON_INTERPRET=1`` (set here before triton is imported); the
host code is the same as for CUDA tensors. For scale: ``torch._foreach_norm`` over 2000 x 64
floats takes ~0.1 - 0.3 ms on a GPU, i.e. 0.05 - 0.15 us per tensor.
"""
import argparse
import json
import os
import statistics
import sys
import time


def _time(fn, repeats: int, per: int):
    """(min, median) of fn's wall time over `repeats` calls, in microseconds per item."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) / per * 1e6, statistics.median(times) / per * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None,
                        help="cpu (under TRITON_INTERPRET=1) or cuda; default: cuda if present")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before nanscan.kernels.triton imports triton
    from nanscan.kernels import triton as tk

    dtype = getattr(torch, args.dtype)
    xs = [torch.randn(args.numel, device=device).to(dtype) for _ in range(args.tensors)]
    op = "nanscan.triton_summarize_many"
    n, reps = len(xs), args.repeats
    rows = {
        "_prepare per tensor (no fast path)": _time(lambda: [tk._prepare(x, op) for x in xs], max(5, reps // 5), n),
        "_entries (preparation)": _time(lambda: tk._entries(xs, op), reps, n),
        "_table_host (preparation + table)": _time(lambda: tk._table_host(xs, op), reps, n),
    }
    fast = tk._FAST_DTYPES
    tk._FAST_DTYPES = {}  # every tensor through _prepare, as before the fast path
    try:
        rows["_table_host, fast path off"] = _time(lambda: tk._table_host(xs, op), max(5, reps // 5), n)
        slow_table = tk._table_host(xs, op)[0]
    finally:
        tk._FAST_DTYPES = fast
    assert torch.equal(tk._table_host(xs, op)[0], slow_table), "the fast path built another table"

    print(f"triton host path: {n} x {args.numel} {args.dtype} on {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'step':<40} {'min us/tensor':>14} {'median':>10}")
    for name, (best, median) in rows.items():
        print(f"{name:<40} {best:>14.3f} {median:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": n, "numel": args.numel, "dtype": args.dtype, "device": device,
                       "torch": torch.__version__,
                       "us_per_tensor": {k: {"min": b, "median": m} for k, (b, m) in rows.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

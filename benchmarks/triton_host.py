"""Host (Python) cost of the Triton backend's ``summarize_many`` per tensor and per call, without
launching anything: the pointer-table path's preparation over many small tensors (a model's
parameters and gradients), timed on its own, and the kernel launches and host torch operations a
call makes, counted.

    python -m benchmarks.triton_host [--tensors 2000] [--numel 64] [--dtype float32] [--device cpu|cuda]
                                     [--json out.json]

Timed rows (microseconds per tensor, min and median over repeats of the whole list):

* ``_prepare per tensor``: the full validation / normalization every tensor went through before
  contiguous tensors had a fast path (detach, resolve_neg, contiguous, reshape, views);
* ``_entries``: the preparation now (address, numel and read kind of a contiguous plain tensor);
* ``_table_host``: the whole host side of ``_summarize_many_table`` -- ``_entries``, grouping,
  chunk numbering and the int64 table -- and the same with the fast path switched off;
* ``_summarize_many_table, launches stubbed``: the whole call (table, its copy to the device, the
  output and partial buffers) with the launches replaced by nothing, split into a per-call part (a
  one-tensor list) and a per-tensor part ((t(N) - t(1)) / (N - 1)).

Counted (the same on every device: the launcher's own code decides them):

* kernel launches per call of the CUDA path (``_summarize_many_table``) for 1, 10, ... N tensors of
  one dtype -- one stage-1 launch per (read kind, alignment) group plus one stage-2 launch, whatever
  N -- of ``summarize_many`` on this device (under the interpreter a loop: 2 per tensor), and of a
  single ``summarize``. Counted by wrapping the kernels the launcher launches through
  (``nanscan.kernels.triton._stage1_kernel`` / ``_stage2_kernel``: ``kernel[grid](...)``), so they
  need no GPU and nothing runs;
* host torch operations per call of the table build (``_table_host``, a dispatch mode's count of
  the aten operations), for 1 and N tensors: a fixed number, each ~1 - 2 us of host time.

What it leaves out: Triton's own work per launch (binding and specializing the arguments, the cache
lookup, the driver call: several us each, see the module docstring of ``nanscan.kernels.triton``)
and the dispatcher's way to the Python kernel. On CPU the tensors are host tensors under
``TRITON_INTERPRET=1`` (set here before triton is imported); the host code is the same as for CUDA
tensors but for the pinned table (CUDA only). For scale: ``torch._foreach_norm`` over 2000 x 64
floats takes ~0.1 - 0.3 ms on a GPU, i.e. 0.05 - 0.15 us per tensor.
"""
import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time

KERNELS = ("_stage1_kernel", "_stage2_kernel")


def _time(fn, repeats: int, per: int):
    """(min, median) of fn's wall time over `repeats` calls, in microseconds per item."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) / per * 1e6, statistics.median(times) / per * 1e6


class _CountingKernel:
    """Stands in for one of the launcher's kernels: records ``(name, grid)`` of every launch
    ``kernel[grid](...)`` and launches the real kernel only when ``launch``."""

    def __init__(self, name, kernel, launches, launch):
        self.name, self.kernel, self.launches, self.launch = name, kernel, launches, launch

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((self.name, tuple(grid)))
            return self.kernel[grid](*args, **kwargs) if self.launch else None

        return run


@contextlib.contextmanager
def counting_launches(tk, launch: bool = True):
    """Within the block, every kernel launch of the launcher module ``tk`` is appended to the
    yielded list as ``(kernel name, grid)``; with ``launch=False`` nothing is launched (the outputs
    are then left unwritten: for counting only)."""
    launches = []
    originals = {name: getattr(tk, name) for name in KERNELS}
    try:
        for name, kernel in originals.items():
            setattr(tk, name, _CountingKernel(name, kernel, launches, launch))
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(tk, name, kernel)


def count_launches(tk, fn, launch: bool = False) -> int:
    """Kernel launches ``fn()`` makes through the launcher ``tk``."""
    with counting_launches(tk, launch) as launches:
        fn()
    return len(launches)


def count_torch_ops(fn) -> collections.Counter:
    """The aten operations ``fn()`` runs (a TorchDispatchMode's count, by operator name)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as mode:
        fn()
    return mode.ops


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

    # The whole CUDA-path call with the launches stubbed: per call (one tensor) and per tensor.
    with counting_launches(tk, launch=False):
        one = _time(lambda: tk._summarize_many_table(xs[:1]), reps * 4, 1)
        many = _time(lambda: tk._summarize_many_table(xs), reps, 1)
    per_call = {"min": one[0], "median": one[1]}
    per_tensor = {"min": (many[0] - one[0]) / max(n - 1, 1), "median": (many[1] - one[1]) / max(n - 1, 1)}

    sizes = sorted({1, *(k for k in (10, 100, 1000) if k < n), n})
    launches = {
        "_summarize_many_table (the CUDA path)": {
            k: count_launches(tk, lambda k=k: tk._summarize_many_table(xs[:k])) for k in sizes},
        f"summarize_many on {device}{' (interpreter: a loop)' if tk.INTERPRETING else ''}": {
            k: count_launches(tk, lambda k=k: tk.summarize_many(xs[:k])) for k in sizes},
        "summarize (one tensor)": {1: count_launches(tk, lambda: tk.summarize(xs[0]))},
    }
    torch_ops = {k: sum(count_torch_ops(lambda k=k: tk._table_host(xs[:k], op)).values()) for k in (1, n)}

    print(f"triton host path: {n} x {args.numel} {args.dtype} on {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'step':<40} {'min us/tensor':>14} {'median':>10}")
    for name, (best, median) in rows.items():
        print(f"{name:<40} {best:>14.3f} {median:>10.3f}")
    print(f"_summarize_many_table, launches stubbed: per call {per_call['min']:.1f} us (median "
          f"{per_call['median']:.1f}), per tensor {per_tensor['min']:.3f} us (median {per_tensor['median']:.3f})")
    print("kernel launches per call, by number of tensors:")
    for name, counts in launches.items():
        print(f"  {name:<55} " + ", ".join(f"{k}: {c}" for k, c in counts.items()))
    print("host torch operations per _table_host call: " + ", ".join(f"{k} tensors: {c}" for k, c in torch_ops.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": n, "numel": args.numel, "dtype": args.dtype, "device": device,
                       "torch": torch.__version__,
                       "us_per_tensor": {k: {"min": b, "median": m} for k, (b, m) in rows.items()},
                       "table_call_launches_stubbed_us": {"per_call": per_call, "per_tensor": per_tensor},
                       "launches": launches, "table_host_torch_ops": torch_ops}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

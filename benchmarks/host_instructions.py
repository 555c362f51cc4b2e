"""Host cost of nanscan.watch in instructions: the host_cost benchmark's model and variants, counted
by valgrind (callgrind) instead of timed -- a number that does not move with the machine's load.

Why: on a shared machine the wall-time ratios of ``benchmarks.host_cost`` drift run to run (on
2026-12-01 the same build measured 1.3x -- 2.7x the floor within an hour, while the unwatched step
itself varied 5.7 -- 7.9 ms). An instruction count is exact and repeatable, so it tells whether a
change cut the monitor's host work, side by side with a base build. It is not time: cache misses,
allocator behaviour and atomics cost cycles that it does not count (on this machine the
wall-time ratio to the floor runs about 1.3x the instruction ratio), so it complements the timed
benchmark and never replaces it.

Each variant runs in its own process under ``valgrind --tool=callgrind``, collecting only inside
``functools.reduce`` over the timed steps (after warm-up steps that are not counted), so the
import of torch and the setup are left out. Per module = (variant - unwatched) / 201 modules.

    python -m benchmarks.host_instructions [--steps N] [--jobs J] [--only TEXT] [--cache]

``--cache`` also simulates the caches (``--cache-sim=yes``, about 1.5x slower) and adds L1
instruction-cache misses per module. Why: this step is bound by instruction fetch -- the floor
misses L1i on ~4% of its instructions (Python, the module call path, the dispatcher and autograd
do not fit in 32 KiB) -- so code the monitor runs per module call costs more in time than its
instruction count says: on 2026-12-01 the watched step was 1.27x the floor in instructions and
1.93x in L1i misses (910 against 472 per module), about its ratio in time; 1.65x (780) once small
CPU records were summarized per read instead of per module call; 1.41x (686 against 488) once rows
became plain structs and the autograd fields were read inline (1.21x in instructions).

Needs ``valgrind`` on the PATH (about 2.5 minutes per variant, most of it importing torch under
valgrind); not part of ``make test``.
"""
import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

VARIANTS = ("unwatched", "no-op hooks (floor)", "watched (every step)", "watched, activation_grads=False",
            "watched, activations=False")


def child(variant: str, steps: int) -> None:
    """Run ``steps`` counted training steps of ``variant`` (inside functools.reduce: what is counted)."""
    import torch

    from benchmarks.host_cost import _variants, make_host_bound, train_step

    torch.set_num_threads(1)
    model, opt, x = make_host_bound()
    _, teardown = _variants()[variant](model, opt)
    for _ in range(5):  # (warm-up: not counted)
        train_step(model, opt, x)
    functools.reduce(lambda _, __: train_step(model, opt, x), range(steps), None)
    teardown()


def count(variant: str, steps: int, cache: bool = False) -> tuple:
    """(instructions, L1 instruction-cache misses or None) in ``steps`` steps of ``variant``
    (callgrind's Ir and, with ``cache``, I1mr; collected in reduce only)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", *(["--cache-sim=yes"] if cache else []), "--collect-atstart=no",
             "--toggle-collect=functools_reduce",
             f"--callgrind-out-file={os.path.join(tmp, 'callgrind.out')}", sys.executable, "-m",
             "benchmarks.host_instructions", "--child", variant, "--steps", str(steps)],
            capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = re.search(r"Collected\s*:\s*([\d ]+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run of {variant!r} failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    events = [int(v) for v in found.group(1).split()]  # Ir [Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw]
    return events[0], (events[3] if cache and len(events) > 3 else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="counted steps per variant (default 5)")
    parser.add_argument("--jobs", type=int, default=2, help="variants counted at once (default 2)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="count only the variants whose name contains TEXT (with the unwatched step "
                             "and the floor)")
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches and report L1 instruction-cache misses (slower)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps)
        return 0
    if shutil.which("valgrind") is None:
        print("host_instructions: valgrind is not installed; nothing measured")
        return 0
    names = [v for v in VARIANTS if v in VARIANTS[:2] or not args.only or any(o in v for o in args.only)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = dict(zip(names, pool.map(lambda v: count(v, args.steps, args.cache), names)))
    counts = {name: ir for name, (ir, _) in results.items()}
    misses = {name: i1 for name, (_, i1) in results.items()}
    import torch

    from benchmarks.host_cost import make_host_bound

    n_modules = len(list(make_host_bound()[0].modules()))
    base = counts["unwatched"] / args.steps
    floor = (counts["no-op hooks (floor)"] / args.steps - base) / n_modules
    print(f"host instructions: 200x Linear(8,8), batch 1, 1 thread, cpu, torch {torch.__version__}, "
          f"{args.steps} counted steps per variant (callgrind)")
    cache_head = f" {'L1i miss/module':>16} {'x floor':>8}" if args.cache else ""
    print(f"{'variant':<34} {'instr/step':>12} {'ratio':>6} {'instr/module':>13} {'x floor':>8}{cache_head}")
    print("-" * (78 + (26 if args.cache else 0)))
    miss_base = misses["unwatched"] / args.steps if args.cache else 0
    miss_floor = (misses["no-op hooks (floor)"] / args.steps - miss_base) / n_modules if args.cache else 0
    for name, total in counts.items():
        per_step = total / args.steps
        per_module = (per_step - base) / n_modules
        x_floor = f"{per_module / floor:8.2f}" if name != "unwatched" and floor > 0 else f"{'-':>8}"
        cache_cols = ""
        if args.cache:
            miss_module = (misses[name] / args.steps - miss_base) / n_modules
            x_miss = f"{miss_module / miss_floor:8.2f}" if name != "unwatched" and miss_floor > 0 else f"{'-':>8}"
            cache_cols = f" {miss_module:>16,.0f} {x_miss}"
        print(f"{name:<34} {per_step:>12,.0f} {per_step / base:>6.3f} {per_module:>13,.0f} {x_floor}{cache_cols}")
    print(f"per module: (variant - unwatched) / {n_modules} modules; instructions, not time (see the docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

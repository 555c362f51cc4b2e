"""Time to the first step of a ``torch.compile``-d model in a fresh process whose inductor cache is
warm (a re-run of the same script), watched against unwatched -- what a user restarting a run pays.

    python -m benchmarks.warm_compile [--pairs N] [--backend inductor]

Each variant runs in its own process (fresh interpreter, shared ``TORCHINDUCTOR_CACHE_DIR``): one
cold run each to fill the cache, then ``--pairs`` warm runs, alternating, so the machine's load
falls on both alike. Prints the warm times and their ratio, with the cache counters of the last
warm run (``fxgraph_cache_hit`` must be > 0 for the watched one: Note [compiled graphs cached])."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import torch, nanscan
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = nanscan.watch(model, opt) if sys.argv[1] == "watched" else None
fwd = torch.compile(model, backend=sys.argv[2])
start = time.perf_counter()
fwd(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
print(json.dumps({"seconds": time.perf_counter() - start, "inductor": dict(counters["inductor"]),
                  "aot": dict(counters["aot_autograd"])}))
"""


def run(variant: str, backend: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, variant, backend], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for variant in ("unwatched", "watched"):
            run(variant, args.backend, env)  # cold: fills the cache
        times = {"unwatched": [], "watched": []}
        last = {}
        for _ in range(args.pairs):
            for variant in times:
                last[variant] = run(variant, args.backend, env)
                times[variant].append(last[variant]["seconds"])
    for variant, seconds in times.items():
        print(f"{variant:10s} warm first step: " + ", ".join(f"{s:.2f}" for s in seconds) + " s;  cache "
              f"{ {k: v for k, v in last[variant]['inductor'].items() if 'cache' in k} }")
    ratio = statistics.median(times["watched"]) / statistics.median(times["unwatched"])
    print(f"watched / unwatched (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""torch.compile time of a watched model vs the same model unwatched (issue 10: watched compile time;
DESIGN §7): the first forward + backward of a compiled timm model, which is where dynamo traces and
the backend compiles. Side by side in one run, each from a fresh dynamo cache.

    python -m benchmarks.compile_time [--model resnet18] [--backend aot_eager] [--rounds 3]

Four variants, alternated round by round: unwatched; the no-op-hook floor (a no-op forward pre- and
post-hook on every module, as in benchmarks/host_cost.py: what dynamo pays to trace ``Module._call_impl``'s
hook path at every module call, whatever the hooks do); watched (the default options: gradient hooks
inside the graph); and watched with ``compiled_grads="off"`` (no gradient records in the graph).
"""
import argparse
import time

import torch

import nanscan


def _noop(*args, **kwargs):
    return None


def first_step_seconds(model_name: str, backend: str, watch: bool, noop_hooks: bool = False,
                       **watch_options) -> float:
    import timm

    # Inductor keeps compiled graphs on disk across processes: a second run (or the unwatched graph,
    # compiled by an earlier run) would time a cache hit instead of a compile.
    torch._inductor.config.force_disable_caches = True
    torch._dynamo.reset()
    torch.manual_seed(0)
    kwargs = {"img_size": 64} if model_name.startswith("vit") else {}
    model = timm.create_model(model_name, pretrained=False, num_classes=10, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, **watch_options) if watch else None
    if noop_hooks:
        for m in model.modules():
            m.register_forward_pre_hook(_noop, with_kwargs=True)
            m.register_forward_hook(_noop, with_kwargs=True)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 64, 64)
    start = time.perf_counter()
    torch.nn.functional.cross_entropy(compiled(x), torch.tensor([1, 2])).backward()
    seconds = time.perf_counter() - start
    if mon is not None:
        mon.close()
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=1, help="alternate unwatched / watched; report the minima")
    args = parser.parse_args(argv)
    # Warm up: the first compile in a process also pays for imports and dynamo's own set-up.
    warm = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    torch.compile(warm, backend=args.backend)(torch.randn(1, 3, 8, 8)).sum().backward()
    bare, floor, watched, no_grads = [], [], [], []
    for _ in range(args.rounds):
        bare.append(first_step_seconds(args.model, args.backend, watch=False))
        floor.append(first_step_seconds(args.model, args.backend, watch=False, noop_hooks=True))
        watched.append(first_step_seconds(args.model, args.backend, watch=True))
        no_grads.append(first_step_seconds(args.model, args.backend, watch=True, compiled_grads="off"))
    base = min(bare)
    print(f"{args.model} ({args.backend}): unwatched {base:.1f} s; no-op hooks (floor) {min(floor):.1f} s "
          f"(ratio {min(floor) / base:.2f}); watched {min(watched):.1f} s (ratio {min(watched) / base:.2f}); "
          f"watched with compiled_grads='off' {min(no_grads):.1f} s (ratio {min(no_grads) / base:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

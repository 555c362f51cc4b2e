"""``python -m nanscan`` / ``nanscan``: ``info``, ``demo``, and for failure bundles ``show``,
``replay`` and ``bisect``.

``--model pkg.module:factory`` names a function returning the model (built the same way as in
training); the factory may also return ``(model, forward)`` where ``forward(model, batch)``
returns the loss or output of one step.

Exit status: 0 nothing non-finite (``replay`` did not reproduce; ``bisect``: every backend ran
finite, or some ran finite and the others failed); 1 ``replay`` reproduced / ``bisect``: some
backend produced NaN or Inf; 2 an expected error (not a bundle, a tampered bundle, a bad
``--model``), one line on stderr; 3 ``bisect``: every backend failed, so nothing was checked (each
one's error is printed: a ``--model`` that does not fit the bundle?)."""
from __future__ import annotations

import argparse
import json
import platform
import sys


def info() -> dict:
    import torch

    import nanscan
    from nanscan import _ops

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    build = nanscan.build_info() or {}
    return {
        "nanscan": nanscan.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "library": _ops.library_path(),
        "library_error": None if _ops.LOAD_ERROR is None else str(_ops.LOAD_ERROR),
        "cuda_kernels_compiled": bool(build.get("cuda_compiled")),
        "cuda_kernels_registered": _ops.has_cuda_kernels(),
        "cuda_archs": build.get("cuda_archs"),
        "cpu_flags": build.get("cpu_flags"),
        "backends": nanscan.available_backends(),
    }


def main(argv=None) -> int:
    """Expected failures (a path that is not a bundle or log, a tampered bundle, a bad --model) are
    reported as one line on stderr with exit status 2; anything else keeps its traceback."""
    from nanscan import ExtensionError
    from nanscan.capture.bundle import BundleError

    try:
        return _main(argv)
    except (BundleError, ExtensionError, FileNotFoundError, ValueError) as e:
        print(f"nanscan: error: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nanscan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, usable backends, what was compiled")
    p_info.add_argument("--json", action="store_true", help="print strict JSON")
    p_demo = sub.add_parser("demo", help="the end-to-end walk-through (tensors, monitor, bundle, replay, report)")
    p_demo.add_argument("workdir", nargs="?", default=None, help="where the log, bundle and report go (default: a temp dir)")
    p_show = sub.add_parser("show", help="a failure bundle's manifest as a readable page")
    p_show.add_argument("bundle")
    p_replay = sub.add_parser("replay", help="re-run a bundle's step and name the first non-finite op")
    p_replay.add_argument("bundle")
    p_replay.add_argument("--model", required=True, help="pkg.module:factory returning the model (or (model, forward))")
    p_replay.add_argument("--fp32", action="store_true", help="re-run in float32 without autocast")
    p_replay.add_argument("--backend", default=None, help="re-run compiled with this torch.compile backend")
    p_replay.add_argument("--anomaly", action="store_true", help="add detect_anomaly(check_nan=True)")
    p_bisect = sub.add_parser("bisect", help="eager / aot_eager / aot_eager_decomp_partition / inductor on the bundle",
                              epilog="exit status: 0 no backend produced NaN / Inf, 1 some backend did, "
                                     "3 every backend failed (nothing was checked), 2 not a bundle / bad --model")
    p_bisect.add_argument("bundle")
    p_bisect.add_argument("--model", required=True, help="pkg.module:factory returning the model (or (model, forward))")
    p_report = sub.add_parser("report", help="timeline + summary of an event log (or a bundle's manifest)")
    p_report.add_argument("source", help="an event log (.jsonl) or a bundle directory")
    p_report.add_argument("-o", "--output", default=None, help="write the timeline PNG here (needs matplotlib)")
    p_report.add_argument("--html", default=None, help="write a self-contained HTML page here")
    args = parser.parse_args(argv)
    if args.command == "info":
        data = info()
        if args.json:
            print(json.dumps(data, indent=1, allow_nan=False))
        else:
            width = max(map(len, data))
            for key, value in data.items():
                print(f"{key:<{width}}  {value}")
        return 0 if data["library_error"] is None else 1
    if args.command == "demo":
        from nanscan.demo import main as demo_main

        return demo_main([args.workdir] if args.workdir else None)
    if args.command == "report":
        return report_command(args)
    from nanscan.capture import bisect_backends, load_bundle, replay

    bundle = load_bundle(args.bundle)
    if args.command == "show":
        print(show(bundle), end="")
        return 0
    model, forward = load_factory(args.model)
    if args.command == "replay":
        result = replay(bundle, model, forward=forward, precision="fp32" if args.fp32 else None,
                        compile_backend=args.backend, anomaly=args.anomaly)
        print(result)
        return 1 if result.reproduced else 0
    results = bisect_backends(bundle, model, forward=forward)
    for name, result in results.items():
        print(f"{name:<28} {result}")
    if any(r.finite is False for r in results.values()):
        return 1
    if all(r.error is not None for r in results.values()):  # an errored backend has finite=None
        print(f"nanscan: error: every backend failed ({len(results)}), nothing was checked: "
              "does --model build the model this bundle was captured from?", file=sys.stderr)
        return 3
    return 0


def report_command(args) -> int:
    from nanscan import report

    print(report.text_report(args.source))
    png = None
    if args.output or args.html:
        try:
            png = report.plot_report(args.source, args.output or (args.html + ".png"))
            print(f"timeline: {png}")
        except ImportError as e:  # matplotlib is optional: the text report above still stands
            print(f"no plot: {e}")
    if args.html:
        print(f"html: {report.html_report(args.source, args.html, png=png)}")
    return 0


def load_factory(spec: str):
    """``pkg.module:factory`` -> (model, forward or None). A malformed spec, a module that is not
    there or a missing factory is a ``ValueError`` (one line, exit 2); what the user's module or
    factory raises propagates as it is."""
    import importlib
    import importlib.util

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model must look like pkg.module:factory, got {spec!r}")
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:  # a parent package that is missing
        raise ValueError(f"--model {spec}: cannot find module {module_name!r} ({e})") from e
    if found is None:
        raise ValueError(f"--model {spec}: no module named {module_name!r} (is it on PYTHONPATH?)")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: module {module_name!r} has no callable {attr!r}")
    made = factory()
    return made if isinstance(made, tuple) else (made, None)


def show(bundle) -> str:
    """The bundle's manifest as a readable page (:func:`nanscan.report.bundle_text`, which
    ``nanscan report BUNDLE`` prints too)."""
    from nanscan import report

    return report.bundle_text(report.summarize_bundle(bundle.manifest, str(bundle.path)))


if __name__ == "__main__":
    sys.exit(main())

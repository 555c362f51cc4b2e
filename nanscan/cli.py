"""``python -m nanscan`` / ``nanscan``: ``info``, ``demo``, ``report`` for event logs and bundles,
and for failure bundles ``show``, ``replay`` and ``bisect``.

``--model pkg.module:factory`` names a function returning the model (built the same way as in
training); the factory may also return ``(model, forward)`` where ``forward(model, batch)``
returns the loss or output of one step.

Exit status, one meaning per code for every command (:data:`EXIT_CODES`; ``--help`` prints it,
``docs/cli.md`` explains it): 0 checked, nothing non-finite; 1 a finding; 2 bad usage or unreadable
input, one line on stderr; 3 nothing could be checked. Per command:

- ``report``: 1 the log (or bundle) shows an anomaly GradScaler did not handle, 0 it shows none in
  what was logged, 3 it logs nothing that would show one (no loss, grad norm, non-finite counts or
  update decision; a bundle captured on request).
- ``replay``: 1 reproduced: the step's loss / output or a gradient went non-finite (an fp16-only
  overflow replayed with ``--fp32`` exits 0; an -inf mask that never reaches the result does not
  count), 0 did not reproduce.
- ``bisect``: 1 some backend produced NaN or Inf, 0 every backend ran finite (or some ran finite and
  the others failed), 3 ``bisect``: every backend failed, so nothing was checked (each one's error
  is printed: a ``--model`` that does not fit the bundle?).
- ``info``: 1 the compiled library did not load.
- every command: 2 a path that is missing or is not what the command reads, a tampered bundle, a bad
  ``--model`` or ``--backend`` (for ``replay``, a ``--model`` whose state dict does not fit the
  bundle's: the line names the keys), an output that cannot be written, a bad option."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import textwrap


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


EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_UNCHECKED = 0, 1, 2, 3
EXIT_CODES = {  # the one table: --help's epilog prints it, docs/cli.md repeats it (a test keeps them equal)
    EXIT_OK: "checked, nothing non-finite: report found no anomaly GradScaler did not handle in what was logged, "
             "replay did not reproduce, bisect saw every backend that ran stay finite",
    EXIT_FINDING: "a finding: report found a non-finite value, skipped update or incident GradScaler did not handle, "
                  "replay reproduced the failure, bisect saw a backend produce NaN or Inf (info: the compiled "
                  "library did not load)",
    EXIT_USAGE: "bad usage or unreadable input, one line on stderr: a bad option, a path that is missing or is not "
                "what the command reads, a tampered bundle, a bad --model or --backend, an output that cannot be "
                "written",
    EXIT_UNCHECKED: "nothing could be checked: report of a log that logs no loss, grad norm, non-finite counts or "
                    "update decision (or of a bundle captured on request), bisect where every backend failed",
}
EPILOG = "exit status:\n" + "\n".join(textwrap.fill(f"{code} {meaning}", 96, initial_indent="  ",
                                                     subsequent_indent="    ") for code, meaning in EXIT_CODES.items())
VERDICT_EXIT = {"finding": EXIT_FINDING, "clear": EXIT_OK, "cannot tell": EXIT_UNCHECKED}


class UsageError(Exception):
    """A command's input is wrong: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (the option that was wrong, and where help is)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(error: BaseException) -> str:
    """An error's message as one line, without the prefix the report's API errors carry."""
    text = " ".join(str(error).split())
    for prefix in ("nanscan report: ", "nanscan: "):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text or type(error).__name__


def main(argv=None) -> int:
    """Expected failures (a path that is not a bundle or log, a tampered bundle, a bad --model, an
    output that cannot be written) are one line on stderr with exit status 2; anything else keeps
    its traceback."""
    from nanscan import ExtensionError
    from nanscan.capture.bundle import BundleError

    try:
        return _main(argv)
    except (UsageError, BundleError, ExtensionError, FileNotFoundError, ValueError) as e:
        print(f"nanscan: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    model_help = "pkg.module:factory returning the model (or (model, forward))"
    parser = _Parser(prog="nanscan", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p_info = command("info", "versions, usable backends, what was compiled")
    p_info.add_argument("--json", action="store_true", help="print strict JSON")
    p_demo = command("demo", "the end-to-end walk-through (tensors, monitor, bundle, replay, report)")
    p_demo.add_argument("workdir", nargs="?", default=None,
                        help="a directory (made if missing) for the log, bundles and plots (default: a temp dir)")
    p_show = command("show", "a failure bundle's manifest as a readable page")
    p_show.add_argument("bundle", help="a bundle directory")
    p_replay = command("replay", "re-run a bundle's step and name the first op on the path to the failure")
    p_replay.add_argument("bundle", help="a bundle directory")
    p_replay.add_argument("--model", required=True, help=model_help)
    p_replay.add_argument("--fp32", action="store_true", help="re-run in float32 without autocast")
    p_replay.add_argument("--backend", default=None, help="re-run compiled with this torch.compile backend")
    p_replay.add_argument("--anomaly", action="store_true", help="add detect_anomaly(check_nan=True)")
    p_replay.add_argument("--allow", action="append", default=[], metavar="PATTERN",
                          help="fnmatch pattern of modules whose non-finite values are intended, as in "
                               "watch(allow=...); repeatable")
    p_bisect = command("bisect", "eager / aot_eager / aot_eager_decomp_partition / inductor on the bundle")
    p_bisect.add_argument("bundle", help="a bundle directory")
    p_bisect.add_argument("--model", required=True, help=model_help)
    p_report = command("report", "timeline + summary of an event log (or a bundle's manifest)")
    p_report.add_argument("source", help="an event log (.jsonl) or a bundle directory")
    p_report.add_argument("-o", "--output", default=None, help="write the timeline PNG here (needs matplotlib)")
    p_report.add_argument("--html", default=None, help="write a self-contained HTML page here (and its PNG "
                                                       "next to it, HTML.png, unless -o names one)")
    p_report.add_argument("--heatmap-stat", default="rms", choices=("rms", "headroom_bits"),
                          help="the module heatmap's statistic, from the log's telemetry lines "
                               "(watch(..., telemetry=JSONL(log))): rms of module outputs (log colour scale, the "
                               "default) or headroom_bits (linear)")
    return parser


def _main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        data = info()
        if args.json:
            print(json.dumps(data, indent=1, allow_nan=False))
        else:
            width = max(map(len, data))
            for key, value in data.items():
                print(f"{key:<{width}}  {value}")
        return EXIT_OK if data["library_error"] is None else EXIT_FINDING
    if args.command == "demo":
        from nanscan.demo import main as demo_main

        return demo_main([_demo_workdir(args.workdir)] if args.workdir else None)
    if args.command == "report":
        return report_command(args)
    _check_bundle_path(args.command, args.bundle)
    if args.command == "replay" and args.backend is not None:
        _check_backend(args.backend)  # (before the bundle and the model are loaded: minutes, at times)
    from nanscan.capture import bisect_backends, load_bundle, replay

    bundle = load_bundle(args.bundle)
    if args.command == "show":
        print(show(bundle), end="")
        return EXIT_OK
    model, forward = load_factory(args.model)
    if args.command == "replay":
        from nanscan.capture.replay import ModelMismatchError

        try:
            result = replay(bundle, model, forward=forward, precision="fp32" if args.fp32 else None,
                            compile_backend=args.backend, anomaly=args.anomaly, allow=tuple(args.allow))
        except ModelMismatchError as e:  # bad input, not a finding: a traceback's exit 1 reads as "reproduced"
            raise UsageError(f"--model {args.model} does not build the model this bundle was captured from: "
                             f"{e.detail}") from None
        print(result)
        return EXIT_FINDING if result.reproduced else EXIT_OK
    results = bisect_backends(bundle, model, forward=forward)
    print(results)  # (one line per backend, then the conclusion in words)
    if any(r.finite is False for r in results.values()):
        return EXIT_FINDING
    if all(r.error is not None for r in results.values()):  # an errored backend has finite=None
        print(f"nanscan: error: every backend failed ({len(results)}), nothing was checked: "
              "does --model build the model this bundle was captured from?", file=sys.stderr)
        return EXIT_UNCHECKED
    return EXIT_OK


# ---------------------------------------------------------------------------- checking arguments
def _first_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_output(option: str, path: str, example: str, source: str) -> None:
    """An output file must be creatable: not a directory, under directories (or ones still to be
    made), and not the file being reported (a PNG written over the log would destroy it)."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path} is a directory: give a file name (such as {os.path.join(path, example)})")
    ancestor = _first_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(ancestor):
        raise UsageError(f"{option} {path}: {ancestor} is a file, not a directory")
    if os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
        raise UsageError(f"{option} {path} is the log being reported: it would be overwritten")


def _demo_workdir(path: str) -> str:
    """The demo's directory, made now: a file there would end the demo a minute in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"demo: {path} is a file, not a directory: give a directory (made if missing) for the "
                         "demo's log, bundles and plots")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"demo: cannot make the directory {path}: {e.strerror or e}") from None
    return path


def _check_bundle_path(command: str, path: str) -> None:
    if not os.path.lexists(path):
        raise UsageError(f"{command}: {path} does not exist: give a bundle directory")
    if os.path.isfile(path) and os.path.basename(path) != "manifest.json":
        raise UsageError(f"{command}: {path} is a file, not a bundle directory (nanscan report reads an event log)")


def _check_backend(name: str) -> None:
    """A ``--backend`` torch.compile knows here (its debug backends included: eager, aot_eager)."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        raise UsageError(f"--backend {name!r} is not a torch.compile backend here; known: {', '.join(known)}")


# ---------------------------------------------------------------------------- report
def report_command(args) -> int:
    """The text report, then the PNG and the HTML page, all from one reading of the source; the
    exit status is the summary's verdict (0 clear, 1 a finding, 3 cannot tell)."""
    from nanscan import report

    png_path = args.output or (args.html + ".png" if args.html else None)
    outputs = [("--html", args.html, "report.html")] if args.html else []
    if png_path is not None:  # (the PNG an --html page makes next to itself is checked as --html's)
        outputs.append(("-o" if args.output else "--html", png_path, "timeline.png"))
    for option, path, example in outputs:
        _check_output(option, path, example, args.source)
    if args.output and args.html and os.path.abspath(args.output) == os.path.abspath(args.html):
        raise UsageError(f"-o and --html both name {args.html}: give two files")
    summary = report.summarize_run(args.source, heatmap_stat=args.heatmap_stat)
    if args.output and not summary.get("timeline"):
        raise UsageError(f"-o: {args.source} is a bundle, which holds one step: there is no timeline to plot "
                         "(give the run's JSONL event log)")
    print(report.format_summary(summary))
    png = None
    if png_path is not None and summary.get("timeline"):
        try:
            png = _write(png_path, "the timeline PNG", lambda: report.plot_summary(summary, png_path))
            print(f"timeline: {png}")
        except ImportError as e:  # matplotlib is optional: the text report above still stands
            print(f"no plot: {e}")
    if args.html:
        def write_page():
            with open(png, "rb") if png else contextlib.nullcontext() as f:
                page = report.html_page(summary, f.read() if f else None)
            os.makedirs(os.path.dirname(os.path.abspath(args.html)), exist_ok=True)
            with open(args.html, "w", encoding="utf-8") as out:
                out.write(page)
            return args.html

        print(f"html: {_write(args.html, 'the HTML page', write_page)}")
    return VERDICT_EXIT[summary["verdict"]["status"]]


def _write(path: str, what: str, write):
    """Run ``write``; an ``OSError`` (a full disk, no permission) is one line naming the file."""
    try:
        return write()
    except OSError as e:
        raise UsageError(f"cannot write {what} to {path}: {e.strerror or e}") from None


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

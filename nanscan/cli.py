"""``python -m nanscan`` / ``nanscan``: ``info`` (versions, backends, build) and ``demo``."""
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
    parser = argparse.ArgumentParser(prog="nanscan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, usable backends, what was compiled")
    p_info.add_argument("--json", action="store_true", help="print strict JSON")
    sub.add_parser("demo", help="summarize example tensors on every available backend")
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

        return demo_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())

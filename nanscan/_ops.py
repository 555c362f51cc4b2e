"""The op registry on the Python side: loading the compiled library, fake kernels, the Python
(Triton) kernel registrations, and the choice of backend.

Schemas live in ``csrc/nanscan.cpp`` only. Backends meet here and in the dispatcher:

==========  =========================================  ==========================================
backend     op                                         implementation
==========  =========================================  ==========================================
cpu         ``nanscan::summarize`` / ``summarize_many``  C++ (csrc/cpu), dispatch key CPU
cuda        ``nanscan::summarize`` / ``summarize_many``  C++/CUDA (csrc/cuda), dispatch key CUDA
triton      ``nanscan::triton_summarize`` / ``_many``    nanscan/kernels/triton.py, keys CUDA and
                                                       CPU (CPU only under ``TRITON_INTERPRET=1``)
reference   (no op: plain PyTorch)                     nanscan/kernels/reference.py
==========  =========================================  ==========================================

``nanscan::stamp_rows_`` is not a summary: the monitor's compiled path writes the records of one
hook into rows of its buffer with it (one graph node per hook; csrc/monitor/stamp_rows.cpp: one
pass on the CPU, one launch on CUDA -- csrc/cuda/stamp_rows.cu --, ATen ops on other devices).
``nanscan::stamp`` does the same into a buffer named by ``nanscan._C.set_stamp_target`` -- the op
the traced hooks call (effectful: kept by the compiler, in order; see csrc/monitor/stamp_rows.cpp
for why the buffer is not an argument).

The library is loaded at ``import nanscan`` (a dlopen and a few registrations). When it is missing
or stale the import still succeeds, the error is kept, and it is raised -- loudly, with the fix --
the first time a compiled backend is asked for. Only ``backend="reference"`` (or
``NANSCAN_BACKEND=reference``) works without it: nanscan never falls back silently.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Callable, Optional

import torch

from nanscan._build import source_hash
from nanscan.record import RECORD_SIZE

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(PACKAGE_DIR)
BACKENDS = ("cpu", "cuda", "triton", "reference")
OPS = ("summarize", "summarize_many", "triton_summarize", "triton_summarize_many", "stamp_rows_", "stamp")


def is_checkout(repo_dir: Optional[str] = None) -> bool:
    """Whether nanscan runs from a source checkout (an editable install, or the tree on sys.path):
    ``setup.py`` and ``csrc/`` sit beside the package. A wheel's package sits in site-packages with
    neither, so its user has no checkout to rebuild in."""
    repo_dir = REPO_DIR if repo_dir is None else repo_dir
    return os.path.isfile(os.path.join(repo_dir, "setup.py")) and os.path.isdir(os.path.join(repo_dir, "csrc"))


def rebuild_hint(env: str = "", repo_dir: Optional[str] = None) -> str:
    """The fix for a missing, stale or mismatched library, for the way nanscan was installed: a
    rebuild in the checkout, or a reinstall from source against the running torch (from the
    package index, or from the source tree a ``pip install .`` came from: nanscan cannot tell
    which, so the hint names both). (``--no-deps``:
    a forced reinstall would otherwise reinstall torch too, maybe another version; ``--no-binary``:
    pip would otherwise fetch the same prebuilt wheel again; ``--no-build-isolation``: the build
    must see the torch that is installed, not a fresh one.) ``env``: variables to set for the build,
    e.g. ``"NANSCAN_CUDA=1 "``."""
    repo_dir = REPO_DIR if repo_dir is None else repo_dir
    if is_checkout(repo_dir):
        return f"rebuild it in the checkout: `cd {repo_dir} && {env}pip install --no-build-isolation --no-deps -e .`"
    from nanscan._version import __version__

    return (f"reinstall it from source against the installed torch: `{env}pip install --no-build-isolation "
            f"--no-deps --force-reinstall --no-binary nanscan nanscan=={__version__}` (installed from a "
            f"source tree: `{env}pip install --no-build-isolation --no-deps --force-reinstall .` in it)")


class ExtensionError(ImportError):
    """The compiled library (nanscan/_C) is missing, stale or failed to load."""


def library_path() -> Optional[str]:
    found = sorted(glob.glob(os.path.join(PACKAGE_DIR, "_C*.so")) + glob.glob(os.path.join(PACKAGE_DIR, "_C*.pyd")))
    return found[0] if found else None


def build_info() -> Optional[dict]:
    """What ``setup.py`` recorded about the build (``nanscan/_build_info.json``), or None."""
    path = os.path.join(PACKAGE_DIR, "_build_info.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _load() -> Optional[ExtensionError]:
    """Load and check the compiled library; return the error instead of raising it."""
    path = library_path()
    if path is None:
        return ExtensionError(f"nanscan's compiled library was not found in {PACKAGE_DIR}; {rebuild_hint()}")
    info = build_info()
    if info is None:
        return ExtensionError(f"{path} has no _build_info.json beside it, so it cannot be checked; {rebuild_hint()}")
    if info.get("torch") != torch.__version__:
        return ExtensionError(f"{path} was built against torch {info.get('torch')} but torch "
                              f"{torch.__version__} is running (the C++ ABI differs); {rebuild_hint()}")
    if os.path.isdir(os.path.join(REPO_DIR, "csrc")) and source_hash(REPO_DIR) != info.get("source_hash"):
        return ExtensionError(f"{path} is stale: the C++/CUDA sources in {REPO_DIR}/csrc changed since it "
                              f"was built; {rebuild_hint()}")
    try:
        torch.ops.load_library(path)
    except OSError as e:  # keep the loader's message: it names the missing symbol or library
        return ExtensionError(f"loading {path} failed: {e}; {rebuild_hint()}")
    _register_python_kernels()
    return None


def _fake_summarize(x: torch.Tensor) -> torch.Tensor:
    from nanscan.kernels.reference import normalize_input

    normalize_input(x)  # same TypeError as the real kernels
    return x.new_empty(RECORD_SIZE, dtype=torch.float64)


def one_device(xs, op: str, what: str = "xs"):
    """The one device of the tensors ``xs`` (None for an empty list); ValueError naming the first
    tensor on another device. A list is read by one device's kernels, and the dispatcher picks
    one device's kernel for the whole list (cpu + meta goes to the meta kernel, which has no
    values to read; cpu + cuda to the CUDA kernel): so every op refuses a mixed list itself."""
    device = None
    for i, x in enumerate(xs):
        if device is None:
            device = x.device
        elif x.device != device:
            raise ValueError(f"{op}: all tensors must be on one device, but {what}[{i}] is on {x.device} and "
                             f"{what}[0] on {device}; summarize each device's tensors in a call of their own")
    return device


def _fake_summarize_many(xs: list, op: str = "nanscan.summarize_many") -> torch.Tensor:
    from nanscan.kernels.reference import normalize_input

    for x in xs:
        normalize_input(x, op)
    device = one_device(xs, op) or torch.device("cpu")
    return torch.empty(len(xs), RECORD_SIZE, dtype=torch.float64, device=device)


def _fake_triton_summarize_many(xs: list) -> torch.Tensor:
    return _fake_summarize_many(xs, "nanscan.triton_summarize_many")


def _triton_module(device: torch.device):
    from nanscan.kernels import triton as triton_launcher

    if device.type == "cpu" and not triton_launcher.INTERPRETING:
        raise ValueError("the triton backend runs on CUDA tensors, or on CPU tensors only under "
                         "TRITON_INTERPRET=1 (set before nanscan is imported)")
    return triton_launcher


def _triton_summarize(x: torch.Tensor) -> torch.Tensor:
    return _triton_module(x.device).summarize(x)


def _triton_summarize_many(xs: list) -> torch.Tensor:
    return _triton_module(xs[0].device if xs else torch.device("cpu")).summarize_many(xs)


# Set by nanscan.monitor.traced: told, while a graph is traced, what each stamp (or stamp_rows_) in it writes.
STAMP_TRACED: Optional[Callable] = None


def _fake_stamp_rows(buffer, counter, values, records, first_row, owner, labels) -> None:
    """A write into ``buffer`` and ``counter``: nothing to compute for fake tensors. This is the one
    piece of Python that runs when a graph holding the op is traced: the monitor notes there the
    rows' labels, dtypes and static shapes (``STAMP_TRACED``), so its traced hooks need no Python
    call of their own. Refused as the real kernel refuses: tensors on several devices (here, a meta
    tensor beside real ones: the dispatcher sent the whole call to this kernel, which writes nothing)."""
    op = "nanscan.stamp_rows_"
    one_device([buffer, counter] + ([records] if records is not None else []), op, "[buffer, counter, records]")
    one_device(values, op, "values")
    _refuse_meta_beside_real(list(values) + [buffer], op)
    if STAMP_TRACED is not None:
        STAMP_TRACED(owner, first_row, values, labels)


def _fake_stamp(values, records, owner, first_row, labels) -> None:
    """As ``_fake_stamp_rows``. ``values`` may be on several devices (model parallelism: the real
    kernel summarizes each where it lives), but not meta beside real ones."""
    _refuse_meta_beside_real(list(values) + ([records] if records is not None else []), "nanscan.stamp")
    if STAMP_TRACED is not None:
        STAMP_TRACED(owner, first_row, values, labels)


def _refuse_meta_beside_real(tensors: list, op: str) -> None:
    """ValueError for a meta tensor beside tensors on a real device: the dispatcher routes such a
    call to the fake kernel, which has no values to read and would write nothing, silently."""
    kinds = {t.device.type == "meta" for t in tensors}
    if len(kinds) > 1:
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"{op}: a meta tensor (no values) beside tensors on a real device ({', '.join(devices)}); "
                         "stamp real tensors, or only meta tensors while tracing")


def _register_python_kernels() -> None:
    torch.library.register_fake("nanscan::stamp_rows_")(_fake_stamp_rows)
    torch.library.register_fake("nanscan::stamp")(_fake_stamp)
    # stamp writes a buffer the compiler cannot see (not an argument: see stamp_rows.cpp): an
    # ordered effect keeps it in the graph, in order.
    from torch._library.effects import EffectType
    torch.library._register_effectful_op("nanscan::stamp", EffectType.ORDERED)
    torch.library.register_fake("nanscan::summarize")(_fake_summarize)
    torch.library.register_fake("nanscan::triton_summarize")(_fake_summarize)
    torch.library.register_fake("nanscan::summarize_many")(_fake_summarize_many)
    torch.library.register_fake("nanscan::triton_summarize_many")(_fake_triton_summarize_many)
    torch.library.register_kernel("nanscan::triton_summarize", ("cuda", "cpu"), _triton_summarize)
    torch.library.register_kernel("nanscan::triton_summarize_many", ("cuda", "cpu"), _triton_summarize_many)


LOAD_ERROR: Optional[ExtensionError] = _load()

# Note [records fused into compiled kernels]: inside a graph inductor compiles, a record written by
# an opaque op is a second read of a tensor that a generated kernel has just written. Given the
# record as a functional stack of reductions (``kernels/fused.py``: the reference's fields, in two
# stages for a large tensor, Note [a record in two stages]) as the decomposition of
# ``nanscan::summarize_many`` / ``summarize``, inductor computes the record as reductions its
# scheduler fuses into the kernel that writes the tensor (or into another kernel that reads it),
# while the values are in registers: one loop, no re-read. Only inductor's tables get it: eager
# calls, aot_eager and the other backends keep the C++ / CUDA kernels. Tensors written by extern
# kernels (mm, addmm, convolution, SDPA) keep a separate read unless a generated kernel reads them
# anyway (benchmarks/compiled_traffic.py counts both). The traced hooks therefore pass the stamp
# op its records from ``summarize_many`` (traced.py) instead of letting the stamp summarize inside.
# Off by default until its compile time and GPU step are measured: ``NANSCAN_FUSED_RECORDS=1``
# (or ``FUSED_RECORDS = True`` before ``watch``) turns it on; off, the ops stay opaque (the A/B switch).
FUSED_RECORDS = os.environ.get("NANSCAN_FUSED_RECORDS", "0") == "1"
_FUSED_REGISTERED = False
FUSED_CACHE_KEY = "nanscan.fused_records"


def register_fused_records() -> bool:
    """Give inductor the reference as the decomposition of the summary ops (once per process;
    Note [records fused into compiled kernels]). Returns whether the decomposition is in place."""
    global _FUSED_REGISTERED
    if not FUSED_RECORDS or LOAD_ERROR is not None:
        return False  # (a decomposition registered before stays: it gives the same records)
    if _FUSED_REGISTERED:
        return True
    try:
        from torch._inductor import decomposition as inductor_decompositions
    except ImportError:  # pragma: no cover - a torch without inductor
        return False
    from nanscan.kernels import fused

    table = {torch.ops.nanscan.summarize_many.default: fused.summarize_many,
             torch.ops.nanscan.summarize.default: fused.summarize}
    inductor_decompositions.decompositions.update(table)
    # Inductor's caches key a graph by its FX code and its config, not by the decomposition table:
    # a config entry tells a graph compiled with the records fused from one compiled without
    # (their FP32 sums round differently), across processes too.
    import torch._inductor.config as inductor_config

    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        marked[FUSED_CACHE_KEY] = "summarize decomposed"
    # Inductor compiles with a cached copy of that table (``fast_random_decomps``, made at the
    # first compile of the process): a registration after it would otherwise go unseen.
    cached = getattr(inductor_decompositions, "fast_random_decomps", None)
    if cached is not None and getattr(cached, "cache_info", None) is not None and cached.cache_info().currsize:
        cached().update(table)
    # (A stamp given its records then takes no values: the post-grad pass nanscan/kernels/
    # graph_passes.py installs, with the watched graph's, when a monitor traces its hooks.)
    _FUSED_REGISTERED = True
    return True


def require_library() -> None:
    """Raise the load error, if any (compiled backends call this before touching torch.ops)."""
    if LOAD_ERROR is not None:
        raise LOAD_ERROR


_CUDA_REGISTERED: Optional[bool] = None


def has_cuda_kernels() -> bool:
    """Whether the loaded library registered its CUDA kernels (i.e. CUDA was compiled in). Asked of
    the dispatcher once: backend resolution runs on every summarize call."""
    global _CUDA_REGISTERED
    if LOAD_ERROR is not None:
        return False
    if _CUDA_REGISTERED is None:
        _CUDA_REGISTERED = torch._C._dispatch_has_kernel_for_dispatch_key("nanscan::summarize", "CUDA")
    return _CUDA_REGISTERED


def triton_usable() -> bool:
    if importlib.util.find_spec("triton") is None or LOAD_ERROR is not None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def available_backends() -> list:
    """Backends that can run here, fastest first for their device type."""
    out = []
    if LOAD_ERROR is None:
        out.append("cpu")
        if has_cuda_kernels() and torch.cuda.is_available():
            out.append("cuda")
    if triton_usable():
        out.append("triton")
    out.append("reference")
    return out


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """The backend to use for tensors on ``device``: ``backend``, else ``$NANSCAN_BACKEND``, else the
    fastest for the device (cpu -> C++ CPU kernels; cuda -> C++/CUDA kernels, or Triton when the
    library was built without CUDA). Raises ValueError for an unknown or mismatched backend and
    ExtensionError when a compiled backend is asked for but the library is unusable."""
    chosen = backend if backend is not None else (env_backend() or None)
    source = "backend=" if backend is not None else "NANSCAN_BACKEND="
    if chosen is None:
        if device.type in ("cpu", "meta"):  # meta: the op's fake kernel propagates shapes
            chosen = "cpu"
        elif device.type == "cuda":
            chosen = "cuda" if has_cuda_kernels() or LOAD_ERROR is not None else "triton"
        else:
            raise ValueError(f"nanscan has no kernel for device type {device.type!r} (it has cpu and cuda); "
                             "pass backend='reference' to use the pure-PyTorch implementation")
    if chosen not in BACKENDS:
        raise ValueError(f"unknown nanscan backend {source}{chosen!r}; choose one of {', '.join(BACKENDS)}")
    if chosen == "reference":
        return chosen
    require_library()
    if chosen in ("cpu", "cuda") and device.type != chosen and device.type != "meta":
        raise ValueError(f"{source}{chosen!r} summarizes {chosen} tensors, got a tensor on {device}")
    if chosen == "cuda" and not has_cuda_kernels():
        raise ExtensionError(f"the cuda backend was asked for but nanscan was built without CUDA kernels "
                             f"(see `python -m nanscan info`); use backend='triton', or "
                             f"{rebuild_hint(env='NANSCAN_CUDA=1 ')}")
    return chosen


# Resolved compiled kernels (ops) by (backend, $NANSCAN_BACKEND, device type), filled only while the
# library is loaded: what resolve_backend chooses depends on nothing else. nanscan.record resolves on every
# call, and after a large tensor has streamed every cache out each Python step on the way misses to
# DRAM: see Note [the way to the kernel].
_RESOLVED: dict = {}

# Note [the way to the kernel]: a record of a 64 MB tensor leaves nothing of the interpreter in the
# caches, so the next call's steps are paid in DRAM misses: measured right after a 16M torch.sum, a
# 16-element call took about 90 us through the bare op, and each of `os.environ.get(...)` and
# `x.device` added about 30 (warm: under a microsecond each) -- a few percent of a 16M record. The
# lookup below reads the environment's own dict (CPython keeps os.environ's encoded keys and values
# there, updated on every set and delete) and the device type from x.is_cpu / x.is_cuda; anything
# else takes the plain route.
try:
    _ENV_KEY = os.environ.encodekey("NANSCAN_BACKEND")
except AttributeError:  # pragma: no cover - an os.environ without CPython's _Environ internals
    _ENV_KEY = None


def env_backend() -> Optional[str]:
    """``$NANSCAN_BACKEND`` as ``os.environ.get`` gives it (Note [the way to the kernel])."""
    data = getattr(os.environ, "_data", None) if _ENV_KEY is not None else None
    if not isinstance(data, dict):
        return os.environ.get("NANSCAN_BACKEND")
    raw = data.get(_ENV_KEY)
    return None if raw is None else os.environ.decodevalue(raw)


def record_kernel(backend: Optional[str], x: torch.Tensor) -> Callable:
    """``kernels(backend, x.device)[0]``, found without building ``x.device`` for a CPU or CUDA
    tensor once resolved (Note [the way to the kernel])."""
    device_type = "cpu" if x.is_cpu else "cuda" if x.is_cuda else None
    found = _remembered(backend, device_type) if device_type is not None else None
    return found[0] if found is not None else kernels(backend, x.device)[0]


def _remembered(backend: Optional[str], device_type: str):
    """The kernels resolved before for this backend, $NANSCAN_BACKEND and device type, or None."""
    return _RESOLVED.get((backend, env_backend(), device_type)) if LOAD_ERROR is None else None


def kernels(backend: Optional[str], device: torch.device):
    """``(summarize one, summarize many)`` callables of the backend chosen for ``device`` (see
    :func:`resolve_backend`): the one table from backend name to implementation. Every one of them
    checks its inputs (the C++ kernels in C++, the others with ``reference.normalize_input``);
    callers on a hot path resolve them once per device and call them directly."""
    found = _remembered(backend, device.type)
    if found is not None:
        return found
    chosen = resolve_backend(backend, device)  # (raises for an unknown or mismatched backend: never cached)
    if chosen == "reference":
        from nanscan.kernels import reference

        found = reference.summarize, reference.summarize_many
    elif chosen == "triton":
        found = torch.ops.nanscan.triton_summarize.default, torch.ops.nanscan.triton_summarize_many.default
    else:
        found = torch.ops.nanscan.summarize.default, torch.ops.nanscan.summarize_many.default
    if LOAD_ERROR is None and chosen != "reference":  # (the reference's functions are looked up each time: patchable)
        _RESOLVED[(backend, env_backend(), device.type)] = found
    return found


def monitor_extension():
    """The Python module of the compiled library (``nanscan._C``: the monitor's C++ hooks, read
    windows and backward tap, ``csrc/monitor/``), or None when the library is unusable here."""
    if LOAD_ERROR is not None:
        return None
    try:
        from nanscan import _C as module
    except ImportError:  # pragma: no cover - a library without its Python module
        return None
    return module if hasattr(module, "Hooks") else None

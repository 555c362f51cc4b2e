"""The traffic account: what one watched training step costs, by what it reads, in measured counts.

Per watched step (a steady-state step: the monitor watched a few steps first, so the read holds
the parameters recorded after the last update, as every later read does):

(a) **Bytes the records read, by kind** -- activations (module outputs and values made in a
    module's own body), activation grads (gradients of module outputs), parameters (after the
    update), parameter grads, buffers, optimizer state (only with ``--optimizer-state``), and the
    small kinds beside them (the loss, the batch the model was called with: recorded for
    attribution) -- and the time those bytes take at ``--bandwidth`` (default 4.3e12 B/s, the
    H200's measured copy bandwidth).
(b) **Record-op calls**: each ``nanscan::summarize_many`` / ``nanscan::summarize`` call (one
    flush of a read window, of the gradient sink's batch, of the parameters, ...), the tensors per
    call, the dtype groups per call, and the CUDA launches those calls imply.
(c) **Host syncs**: the read's copies waited on.
(d) **Step time added**: the watched step's median time minus the unwatched one's, in interleaved
    rounds on one model, and their ratio.

How each number is obtained
---------------------------
(a) From the read that lands in the step. ``Read.land`` (nanscan/monitor/read.py) is wrapped for
    the step, so the ``Read`` the monitor decodes is kept (a clean read, which the monitor decides
    without a ``Read``, is decoded whole while observed -- Note [a clean read is decided without a
    Read] in nanscan/monitor/readback.py: the account needs its rows, and the device read, which
    that note's CPU path never takes, is the one measured). Every row of a read is one record -- one
    tensor summarized once -- and its entry says what the tensor was (nanscan/monitor/slots.py):
    the C++ hook rows (``EagerRows``: ``rows.row(i)`` gives the row's kind -- output, body, batch
    input, model loss --, dtype and shape), the gradient sink's rows (``GradBlock``: the
    ``GradMeta`` dtype and shape of each gradient), the parameter, parameter-gradient and buffer
    runs (``Block``: the tensors themselves; a sparse gradient's row is of its coalesced values),
    and Python slots (the loss, optimizer state). A row's bytes are ``numel * itemsize`` of that
    dtype and shape: what a kernel reading the tensor once reads. The scalar rows a read appends
    (loss scale, ``found_inf``) are not records and are not counted. This is exact for what the
    records are of, on every device and with every backend, because the read is the list of what
    was recorded; it is not a hardware counter (a strided view's cache lines, a small CPU tensor's
    1 KiB copy before its record, a sparse gradient's coalesce are not in it).
(b) From the op calls that run. The step runs under a ``TorchDispatchMode`` that notes every call
    of the ``nanscan`` summary ops with its tensors -- also the calls made from C++ through the
    dispatcher (the read window's and the gradient sink's flushes, ``TensorSet``'s parameter and
    gradient records: csrc/monitor/grad_sink.h ``summarize_many_with``), which a Python monkeypatch
    of ``torch.ops.nanscan`` would not see, and which ``torch.profiler`` sees without the shapes of
    a tensor list. Dtype groups per call are the distinct dtypes of its contiguous tensors; the
    **CUDA launches implied** are 2 per dtype group (one scan, one combine) plus 1 per
    non-contiguous tensor (the single-tensor path), and 1 per ``summarize`` call: read from
    csrc/cuda/summarize.cu (``summarize_many_cuda``, ``summarize_group``, ``launch_one``), not
    measured (the pinned table copy of a table-cache miss is not counted either). On CUDA the step
    also runs under ``torch.profiler`` with CUDA activity, and the kernels whose names hold
    ``nanscan::`` are counted and timed: the measured launches and their device time, beside the
    implied ones. On the CPU with the default kernels, a tensor the hooks or the gradient sink
    receive is summarized on arrival by C++ code that makes no op call (``summarized_on_arrival``,
    csrc/monitor/grad_sink.h): those rows are reported as "rows without an op call". On a device
    every row goes through an op call, so that count must be 0 there and the op calls' bytes the
    account's total (in a steady-state step the parameters recorded after this step's update stand
    for those recorded after the last one): anything else is a finding.
(c) ``Copy.wait`` (nanscan/monitor/readback.py) is wrapped: each call with rows to land is one
    host sync of the read (sync mode on a device: the blocking ``.cpu()``; async mode: the event
    waited on a read later), and so is each later fetch of rows the wait did not bring back
    (``Copy._fetch_rows``, where the read has it). The bytes copied back are the copy's own count
    (``Copy.read_back_bytes``) where it keeps one, else the rows landed. On the CPU nothing is
    copied from a device: the count is of the waits, each of which is a host sync on a device. On
    CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` also counts every synchronizing call of the
    watched step and of an unwatched one.
(d) One model; rounds alternate unwatched and watched (``nanscan.watch`` at the round's start,
    ``close`` at its end, warm-up steps untimed), the order flipped every round; a round's time is
    ``--steps`` steps, synchronized (on CUDA) before and after; the added time is the median over
    rounds of (watched - unwatched) per step, the ratio is 1 + that / the median unwatched step. On
    the CPU that is host time; on a GPU it is the step's wall time, where host time the device
    hides costs nothing.

The model is the benchmark GPT (benchmarks/models.py: pre-LN blocks, causal SDPA), trained with
AdamW in the plain loop of benchmarks/bench_monitor.py (no ``mon.step``), default kernels, fp32 and
bf16 autocast. Defaults are the CPU benchmark's GPT (4 layers, d=256, 4 heads, vocab 1024, seq 128,
batch 8). GPT-2-small's shapes, as the GPU benchmark runs them (bf16 autocast)::

    python -m benchmarks.traffic --device cuda --layers 12 --d 768 --heads 12 --vocab 50257 \\
        --seq 512 --batch 8 --autocast bf16 --json traffic-gpt2-small.json

    python -m benchmarks.traffic [--layers N --d D --heads H --vocab V --batch B --seq S]
        [--device cpu|cuda] [--autocast none|bf16|both] [--mode sync|async] [--optimizer-state]
        [--bandwidth BPS] [--rounds R --steps K] [--threads T] [--json out.json]

On the CPU the default is 1 thread (``--threads``): on the shared 2-core machine two threads timed
the step 2 -- 7x slower and too noisy to use. The defaults run in about 30 s there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanscan
from nanscan.monitor import reading
from nanscan.monitor.read import Read
from nanscan.monitor.readback import Copy
from nanscan.monitor.reading import Reading
from nanscan.monitor.slots import BATCH_INPUT, BODY, MODEL_LOSS, OUTPUT, Block, EagerRows, GradBlock
from nanscan.monitor.tensors import ModelTensors

H200_BANDWIDTH = 4.3e12  # B/s: the H200's measured device copy bandwidth
KINDS = ("activations", "activation grads", "parameters", "parameter grads", "buffers", "optimizer state", "loss",
         "batch input")
SUMMARY_OPS = frozenset({"summarize", "summarize_many", "triton_summarize", "triton_summarize_many"})
# The kinds a CPU step with the default kernels records through an op call: the parameter set's two
# calls and the buffers' one (every other row is summarized on arrival, with no op call).
OP_KINDS_ON_CPU = ("parameters", "parameter grads", "buffers")


# ---------------------------------------------------------------------------------------------- (a)
def row_record(read: Read, i: int) -> tuple:
    """``(kind, dtype, shape)`` of row ``i`` of a landed read: one of KINDS, and the dtype and shape
    of the tensor its record was made of (see the module docstring)."""
    s = read.slots[i]
    if type(s) is EagerRows:
        row = s.rows.row(i)
        kind, dtype, shape = row[0], row[5], tuple(row[6])
        if kind in (OUTPUT, BODY):
            return "activations", dtype, shape
        if kind == BATCH_INPUT:
            return "batch input", dtype, shape
        if kind == MODEL_LOSS:
            return "loss", dtype, shape
        raise ValueError(f"row {i}: a C++ row of unknown kind {kind}")
    if type(s) is GradBlock:
        k = i - s.start
        return "activation grads", s.meta.dtype(k), tuple(s.meta.shape(k))
    if isinstance(s, Block):
        t = s.tensors[i - s.start]
        kind = {"param": "parameters", "buffer": "buffers"}.get(s.kind)
        if s.kind == "grad" and s.param:
            kind = "parameter grads"
        if kind is None:
            raise ValueError(f"row {i}: a block of unknown kind {s.kind!r}")
        return kind, t.dtype, tuple(t.shape)
    kind = {"loss": "loss", "optimizer_state": "optimizer state", "activation": "activations",
            "grad": "activation grads", "param": "parameters", "buffer": "buffers"}.get(s.kind)
    if kind is None:
        raise ValueError(f"row {i}: a slot of unknown kind {s.kind!r}")
    return kind, s.dtype, tuple(s.shape)


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def account_read(read: Read) -> dict:
    """kind -> {"records": rows, "bytes": bytes their tensors hold, "dtypes": {dtype: rows}}, every
    kind of KINDS present (zeros for those the read has none of)."""
    out = {kind: {"records": 0, "bytes": 0, "dtypes": {}} for kind in KINDS}
    for i in range(len(read.slots)):
        kind, dtype, shape = row_record(read, i)
        entry = out[kind]
        entry["records"] += 1
        entry["bytes"] += nbytes(dtype, shape)
        name = str(dtype).replace("torch.", "")
        entry["dtypes"][name] = entry["dtypes"].get(name, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------- (b)
def launches_implied(op: str, tensors: list) -> tuple:
    """``(dtype groups, non-contiguous tensors, CUDA launches)`` of one summary-op call with the
    default CUDA kernels, as csrc/cuda/summarize.cu launches them: summarize_many runs each dtype's
    contiguous tensors as one scan and one combine launch and every other tensor on the single-tensor
    path (one launch); summarize is one launch. (Read from the source, not measured; outside CUDA
    graph capture, where every tensor takes the single-tensor path.)"""
    if op in ("summarize", "triton_summarize"):
        return 1, 0 if tensors[0].is_contiguous() else 1, 1
    groups = {t.dtype for t in tensors if t.is_contiguous()}
    strided = sum(1 for t in tensors if not t.is_contiguous())
    return len(groups), strided, 2 * len(groups) + strided


class OpCalls(TorchDispatchMode):
    """Notes every call of nanscan's summary ops while active -- also those made from C++ through
    the dispatcher -- as ``{"op", "tensors", "bytes", "dtypes", "groups", "non_contiguous",
    "launches_implied"}``; everything else passes through untouched."""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self._kernels_for = None

    def __enter__(self):
        # A Python backend (``backend="reference"``) is no op: its batches are noted where the
        # monitor looks its kernels up (ModelTensors.kernels_for, asked at every call).
        self._kernels_for = kernels_for = ModelTensors.kernels_for
        note = self._note

        def noting_kernels_for(tensors, device):
            one, many = kernels_for(tensors, device)
            if isinstance(many, torch._ops.OpOverload):
                return one, many

            def noted(xs):
                note("summarize_many", list(xs))
                return many(xs)

            return one, noted

        ModelTensors.kernels_for = noting_kernels_for
        return super().__enter__()

    def __exit__(self, *exc):
        ModelTensors.kernels_for = self._kernels_for
        return super().__exit__(*exc)

    def _note(self, op: str, xs: list) -> None:
        groups, strided, launches = launches_implied(op, xs)
        dtypes: dict = {}
        for t in xs:
            name = str(t.dtype).replace("torch.", "")
            dtypes[name] = dtypes.get(name, 0) + 1
        self.calls.append({"op": op, "tensors": len(xs), "bytes": sum(nbytes(t.dtype, t.shape) for t in xs),
                           "dtypes": dtypes, "groups": groups, "non_contiguous": strided, "launches_implied": launches})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "nanscan" and func._opname in SUMMARY_OPS:
            self._note(func._opname, list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]])
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- (c)
class Observed:
    """What one observed stretch of training landed: the reads (``Read.land``), the copies waited on
    (``Copy.wait`` with rows to land) and the rows fetched later for a read that came back as a
    summary (``Copy._fetch_rows``, where the read has that path)."""

    def __init__(self):
        self.reads: list = []
        self.copies: list = []  # the Copy of each wait with rows (each: one host sync)
        self.fetches = 0  # rows copied after the wait (each: one more host sync)
        self.empty_waits = 0  # (a wait with nothing to land: no copy, no sync)

    @property
    def syncs(self) -> int:
        return len(self.copies) + self.fetches

    def d2h_bytes(self) -> int:
        """Bytes the host copied back: ``Copy.read_back_bytes`` where the read counts them, else the
        rows landed."""
        total = 0
        for copy, rows_bytes in self.copies:
            counted = getattr(copy, "read_back_bytes", None)
            total += counted if isinstance(counted, int) else rows_bytes
        return total


def _not_lean(gather):
    """``Reading.gather`` with ``lean`` off: a clean read is not decided before its Copy is made."""
    def gather_whole(self, *args, **kwargs):
        kwargs["lean"] = False
        return gather(self, *args, **kwargs)
    return gather_whole


@contextlib.contextmanager
def every_read_gathered():
    """Every read through ``Reading.gather`` for the block (``reading.TAKEN_IN_ONE_CALL`` off: Note
    [a clean step's read]): the steady state the account is of -- on the CPU an async read's rows
    need no wait and are decided at once otherwise; on a device the copy is in flight a step, as here."""
    one_call = reading.TAKEN_IN_ONE_CALL
    reading.TAKEN_IN_ONE_CALL = False
    try:
        yield
    finally:
        reading.TAKEN_IN_ONE_CALL = one_call


@contextlib.contextmanager
def observe():
    """Wrap ``Read.land`` and ``Copy.wait`` (and ``Copy._fetch_rows`` where it exists) -- class
    attributes: every monitor's reads go through them -- for the block; yields an :class:`Observed`."""
    seen = Observed()
    land, wait = Read.__dict__["land"], Copy.__dict__["wait"]
    fetch = Copy.__dict__.get("_fetch_rows")
    # (every read decoded whole: a clean one has no Read otherwise)
    gather, clean = Reading.__dict__["gather"], Copy.__dict__["clean"]

    def observed_land(cls, copy, traced, **kwargs):
        read = land.__func__(cls, copy, traced, **kwargs)
        seen.reads.append(read)
        return read

    def observed_wait(self):
        rows = self.rows
        if getattr(self, "landed", False):  # (waited on already: a landed copy is left as it is)
            pass
        elif not self.lands:
            seen.empty_waits += 1
        else:  # (a CPU read decided in its blocks copies nothing: on a device it is the one sync)
            seen.copies.append((self, 0 if rows is None else rows.numel() * rows.element_size()))
        return wait(self)

    def observed_fetch(self):
        if getattr(self, "host", None) is None:
            seen.fetches += 1
        return fetch(self)

    Read.land = classmethod(observed_land)
    Copy.wait = observed_wait
    Reading.gather = _not_lean(gather)
    Copy.clean = property(lambda self: False)
    if fetch is not None:
        Copy._fetch_rows = observed_fetch
    try:
        with every_read_gathered():
            yield seen
    finally:
        Read.land = land
        Copy.wait = wait
        Reading.gather, Copy.clean = gather, clean
        if fetch is not None:
            Copy._fetch_rows = fetch


def _count_cuda_syncs(fn) -> int:
    """Synchronizing CUDA calls made by ``fn()`` (``torch.cuda.set_sync_debug_mode("warn")``)."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum(1 for w in caught if "synchroniz" in str(w.message))


def cuda_activity(fn) -> dict:
    """What the device ran in ``fn()`` (torch.profiler, CUDA activity): every kernel, the kernels
    whose names hold ``nanscan::`` and their device time, and the memory copies each way."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    ours = [e for e in kernels if "nanscan::" in e.name]
    return {"kernels": len(kernels), "nanscan_kernels": len(ours),
            "nanscan_device_us": sum(e.time_range.elapsed_us() for e in ours),
            "memcpy_dtoh": sum(1 for e in events if e.name.startswith("Memcpy DtoH")),
            "memcpy_htod": sum(1 for e in events if e.name.startswith("Memcpy HtoD"))}


# ---------------------------------------------------------------------------------------------- one step
def account_step(step, device="cpu") -> dict:
    """The account of one call of ``step()`` (a training step of a watched model, past its first
    steps): the kinds of the read(s) that landed in it (a), its op calls (b), its syncs (c). On CUDA
    also what the profiler saw the device run (:func:`cuda_activity`)."""
    device = torch.device(device)
    calls = OpCalls()
    cuda = device.type == "cuda"
    extra = {}

    def run():
        with calls:
            step()
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.synchronize()
    with observe() as seen:
        if cuda:
            try:
                extra["measured"] = cuda_activity(run)
            except Exception as e:  # (the account stands without it)
                extra["measured"] = {"error": repr(e)}
        else:
            run()
    kinds = {kind: {"records": 0, "bytes": 0, "dtypes": {}} for kind in KINDS}
    for read in seen.reads:
        if not read.training:
            continue
        for kind, entry in account_read(read).items():
            kinds[kind]["records"] += entry["records"]
            kinds[kind]["bytes"] += entry["bytes"]
            for name, n in entry["dtypes"].items():
                kinds[kind]["dtypes"][name] = kinds[kind]["dtypes"].get(name, 0) + n
    rows = sum(e["records"] for e in kinds.values())
    op_tensors = sum(c["tensors"] for c in calls.calls)
    return {
        "kinds": kinds,
        "records": rows,
        "bytes": sum(e["bytes"] for e in kinds.values()),
        "reads": len(seen.reads),
        "calls": calls.calls,
        "op_calls": len(calls.calls),
        "op_tensors": op_tensors,
        "op_bytes": sum(c["bytes"] for c in calls.calls),
        "rows_without_op_call": rows - op_tensors,
        "launches_implied": sum(c["launches_implied"] for c in calls.calls),
        "syncs": seen.syncs,
        "waits": [{"rows": c.rows.shape[0], "device": str(c.rows.device), "event": c.event is not None}
                  if c.rows is not None else  # (decided in its blocks on the CPU)
                  {"rows": len(c.slots) + len(c.extra_names), "device": "cpu", "event": False}
                  for c, _ in seen.copies],
        "fetches": seen.fetches,
        "d2h_bytes": seen.d2h_bytes(),
        **extra,
    }


# ---------------------------------------------------------------------------------------------- the benchmark
def make_gpt(*, layers, d, heads, vocab, seq, batch, device):
    """The benchmark GPT (seeded), its AdamW and a batch of token ids."""
    from benchmarks.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    return model, opt, idx


def gpt_step(model, opt, idx, autocast: bool):
    """benchmarks/bench_monitor.py's plain loop step, with bf16 autocast on any device when asked."""
    from benchmarks.bench_monitor import step

    return step(model, opt, idx, autocast)


def add_model_arguments(parser) -> None:
    """The benchmark GPT's shape and device options (this module's and benchmarks/compiled_traffic.py's)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def time_added(model, opt, step, *, device, watch_options, rounds, steps, warmup=1) -> dict:
    """(d): unwatched and watched rounds alternated on one model; see the module docstring."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = {"unwatched": [], "watched": []}
    for r in range(rounds):
        for name in (("unwatched", "watched") if r % 2 == 0 else ("watched", "unwatched")):
            mon = nanscan.watch(model, opt, **watch_options) if name == "watched" else None
            try:
                for _ in range(warmup):
                    step()
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                sync()
                times[name].append((time.perf_counter() - t0) / steps)
            finally:
                if mon is not None:
                    mon.close()
    base = statistics.median(times["unwatched"])
    added = statistics.median(w - u for w, u in zip(times["watched"], times["unwatched"]))
    return {"unwatched_s": base, "watched_s": statistics.median(times["watched"]), "added_s": added,
            "ratio": (base + added) / base, "rounds": rounds, "steps": steps, "per_round_s": times}


def measure(*, layers=4, d=256, heads=4, vocab=1024, seq=128, batch=8, device="cpu", autocast=False,
            mode="sync", optimizer_state=False, rounds=7, steps=3, warmup=3, backend=None) -> dict:
    """The whole account of one configuration: (a) -- (c) from one steady-state watched step
    (after ``warmup`` watched steps), (d) from ``rounds`` interleaved rounds (none when 0).
    ``backend``: the kernels ``watch`` is given (None: the default; ``"reference"`` on the CPU runs
    the batches a device runs -- every record through an op call -- so their calls are counted)."""
    model, opt, idx = make_gpt(layers=layers, d=d, heads=heads, vocab=vocab, seq=seq, batch=batch, device=device)

    def step():
        return gpt_step(model, opt, idx, autocast)

    watch_options = {"mode": mode, "optimizer_state": optimizer_state, "backend": backend}
    cuda = torch.device(device).type == "cuda"
    step()  # (the optimizer's state exists from here on, as in a running loop)
    unwatched = {}
    if cuda:
        unwatched["syncs"] = _count_cuda_syncs(step)
        try:
            unwatched["measured"] = cuda_activity(step)
        except Exception as e:  # (the account stands without it)
            unwatched["measured"] = {"error": repr(e)}
    with nanscan.watch(model, opt, **watch_options), every_read_gathered():
        for _ in range(warmup):
            step()
        watched_syncs = _count_cuda_syncs(step) if cuda else None
        account = account_step(step, device)
    result = {
        "config": {"model": "GPT", "layers": layers, "d": d, "heads": heads, "vocab": vocab, "seq": seq,
                   "batch": batch, "device": str(device), "autocast": "bf16" if autocast else "none", "mode": mode,
                   "optimizer_state": optimizer_state, "backend": backend or "default",
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "threads": torch.get_num_threads(), "torch": torch.__version__},
        "account": account,
    }
    if cuda:
        account["cuda_syncs"] = {"watched": watched_syncs, "unwatched": unwatched["syncs"]}
        account["unwatched_measured"] = unwatched["measured"]
    if rounds > 0:
        result["time"] = time_added(model, opt, step, device=device, watch_options=watch_options, rounds=rounds,
                                    steps=steps)
    return result


# ---------------------------------------------------------------------------------------------- the table
def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f}"


def _spread(values: list) -> str:
    """``a`` when all equal, else ``min -- max (median m)``."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo} -- {hi} (median {statistics.median(values):g})"


def variant_name(result: dict) -> str:
    c = result["config"]
    return ("bf16 autocast" if c["autocast"] == "bf16" else "fp32") + ("" if c["mode"] == "sync" else f", {c['mode']}")


def table(results: list, bandwidth: float = H200_BANDWIDTH) -> str:
    """Markdown: the bytes by kind (records, MiB, µs at ``bandwidth``) per variant, then the op
    calls, syncs and time."""
    names = [variant_name(r) for r in results]
    c = results[0]["config"]
    lines = [f"traffic account, one steady-state watched step: GPT {c['layers']}x{c['d']} ({c['heads']} heads, "
             f"vocab {c['vocab']}, seq {c['seq']}, batch {c['batch']}; {c['parameters']:,} parameters), AdamW, "
             f"{c['device']}, torch {c['torch']}; µs at {bandwidth / 1e12:g} TB/s", ""]
    head = "| kind | " + " | ".join(f"{n}: records | {n}: MiB | {n}: µs" for n in names) + " |"
    lines += [head, "|---|" + "---|" * (3 * len(names))]
    for kind in KINDS + ("total",):
        cells = []
        for r in results:
            a = r["account"]
            e = {"records": a["records"], "bytes": a["bytes"]} if kind == "total" else a["kinds"][kind]
            cells += [f"{e['records']:,}", _mib(e["bytes"]), f"{e['bytes'] / bandwidth * 1e6:,.1f}"]
        label = f"**{kind}**" if kind == "total" else kind
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| per step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def metric(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in results) + " |")

    metric("record-op calls (summarize_many + summarize)", lambda r: str(r["account"]["op_calls"]))
    metric("tensors per call", lambda r: _spread([c["tensors"] for c in r["account"]["calls"]]))
    metric("dtype groups per call", lambda r: _spread([c["groups"] for c in r["account"]["calls"]]))
    metric("CUDA launches implied (2 per dtype group + 1 per strided tensor)",
           lambda r: str(r["account"]["launches_implied"]))
    metric("bytes through op calls (MiB)", lambda r: _mib(r["account"]["op_bytes"]))
    metric("rows without an op call (CPU: summarized on arrival)",
           lambda r: f"{r['account']['rows_without_op_call']:,}")
    if any("measured" in r["account"] for r in results):
        def measured(r, key, unwatched=False):
            m = r["account"].get("unwatched_measured" if unwatched else "measured", {})
            return m.get(key, m.get("error", "-"))

        metric("nanscan kernels measured (CUDA profiler)", lambda r: str(measured(r, "nanscan_kernels")))
        metric("their device time (µs, CUDA profiler)",
               lambda r: (lambda v: f"{v:,.1f}" if isinstance(v, (int, float)) else str(v))(
                   measured(r, "nanscan_device_us")))
        metric("all kernels, watched / unwatched step (CUDA profiler)",
               lambda r: f"{measured(r, 'kernels')} / {measured(r, 'kernels', unwatched=True)}")
        metric("device-to-host memcpys, watched / unwatched step (CUDA profiler)",
               lambda r: f"{measured(r, 'memcpy_dtoh')} / {measured(r, 'memcpy_dtoh', unwatched=True)}")
    metric("host syncs (read copies waited on)", lambda r: str(r["account"]["syncs"]))
    metric("bytes the read lands on the host", lambda r: f"{r['account']['d2h_bytes']:,}")
    if any("cuda_syncs" in r["account"] for r in results):
        metric("synchronizing CUDA calls, watched / unwatched (sync debug mode)",
               lambda r: "{watched} / {unwatched}".format(**r["account"].get("cuda_syncs", {"watched": "-",
                                                                                          "unwatched": "-"})))
    if all("time" in r for r in results):
        metric("unwatched step (ms, median)", lambda r: f"{r['time']['unwatched_s'] * 1e3:,.2f}")
        metric("watched step (ms, median)", lambda r: f"{r['time']['watched_s'] * 1e3:,.2f}")
        metric("time added per step (µs, median of round differences)", lambda r: f"{r['time']['added_s'] * 1e6:,.0f}")
        metric("watched / unwatched", lambda r: f"{r['time']['ratio']:.3f}")
        t = results[0]["time"]
        lines.append("")
        lines.append(f"(time: {t['rounds']} interleaved rounds of {t['steps']} steps per variant)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--autocast", choices=("none", "bf16", "both"), default="both",
                        help="fp32, bf16 autocast, or both side by side (default)")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--optimizer-state", action="store_true", help="watch(..., optimizer_state=True)")
    parser.add_argument("--backend", choices=nanscan.BACKENDS, default=None,
                        help="watch(..., backend=...); reference on the CPU batches every record as a device does")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH,
                        help=f"bytes per second for the time column (default {H200_BANDWIDTH:g}: the H200's copy)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (0: no timing)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: 1 on the CPU -- on a shared 2-core machine two "
                             "threads time the step 2-7x slower and unusably noisy --, torch's own on CUDA)")
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.bandwidth <= 0:
        parser.error("--bandwidth must be positive")
    threads = args.threads if args.threads is not None else (1 if torch.device(args.device).type == "cpu" else None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        results = [measure(layers=args.layers, d=args.d, heads=args.heads, vocab=args.vocab, seq=args.seq,
                           batch=args.batch, device=args.device, autocast=autocast, mode=args.mode,
                           optimizer_state=args.optimizer_state, rounds=args.rounds, steps=args.steps,
                           backend=args.backend)
                   for autocast in {"none": (False,), "bf16": (True,), "both": (False, True)}[args.autocast]]
    finally:
        torch.set_num_threads(before)
    print(table(results, args.bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

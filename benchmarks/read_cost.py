"""What a clean read costs the host, as the number of records grows: the read and its decision
apart from the records it finishes.

The model is ``n`` ``nn.Linear(8, 8)`` layers at batch 2 on one thread, trained with SGD (lr 0:
the values stay the same, every step is clean) in a plain loop, watched with the defaults: every
step is read once, before the update, and no consumer needs the rows (no step log, telemetry,
spikes or headroom: Note [a clean read comes back as one number] in nanscan/monitor/readback.py).
A read then holds about ``6 n`` records: each layer's output and its gradient, its weight and bias
after the last update, and their gradients.

Per read (``Monitor._read_and_decide``, timed with ``perf_counter_ns`` around each call):

- **whole read**: everything the read does on the host, from taking the windows to the last
  consumer's decision;
- **records finished at the read**: the parts of it that make records -- the read window's and the
  gradient sink's ``take`` (on the CPU they summarize, in one pass, the small tensors copied on
  arrival: HostRows in csrc/monitor/grad_sink.h; on a device, the last batch's launch) and the
  parameter gradients' records (``ModelTensors.grad_records``: one C++ call) -- timed around
  those calls, or, where the read takes them in one C++ call with its test (``LeanRead``: Note [a
  clean read in one call] in csrc/monitor/lean_read.h), by that call (``finishing_ns``). That is
  kernel work on the CPU, a launch or two on a device;
- **read + decision**: the difference -- the non-finite test, the slots, the copy, the findings and
  every consumer: what the clean-step target is about (<= 30 us at 1,000 records, flat in the number
  of records);
- **Python calls**: functions and builtins called from Python during one read (``sys.setprofile``
  "call" and "c_call" events, in a separate pass: the profile hook slows the read);
- **a cold call**: ``distributed.active()`` timed twice in a row as each read begins (in a separate
  pass of the default variant): what the read's first lines pay because the step between two reads
  evicted them from the caches, against the same call warm.

Each ``n`` is measured in nine variants: the read decided as by default (``DEVICE_DECISION =
"cuda"``, sync mode: a clean read is taken and tested in one C++ call before any other line of the
read runs, and before any slot, Copy or Read is made of it -- Note [a clean step's read] in
nanscan/monitor/monitor.py, Note [a clean read in one call] in csrc/monitor/lean_read.h); the same
read taken call by call through ``Reading.gather`` and tested in its blocks (``"blocks"``: the
path before those notes, ``reading.TAKEN_IN_ONE_CALL = False``); the path a read on a GPU takes,
run on these CPU rows (``DEVICE_DECISION = "always"``: one sum of the records where they lie and
its 8 bytes copied back), taken in one call (``"device"``) and as a Copy (``"device_copy"``); the
default in async mode (``"async"``: rows on the host are decided in the one call as in sync mode
-- Note [a clean step's read]), and async mode taken call by call (``"async_copy"``: a Copy decided
in its blocks a read later, then bookkept without a Read: async mode's clean path before that note,
and still the path of a device's rows); stacked and copied whole (``"never"``: the read before the
clean-read path); with a step log on (``"log"``: it walks every read, reading the losses, the
non-finite rows and the parameter gradients' sums of squares); and with every part that walks a
read's rows on (``"parts"``: a step log, spike warnings, ``headroom_bits=4`` and telemetry every 10
steps to a no-op sink -- the rows are then stacked, and each part walks them through
``Read.runs``). They run
in interleaved rounds (one round: ``--steps`` watched steps of each variant, order reversed every
round); a number is the median over every read of the rounds. The slope per record is (the largest
``n``'s value - the smallest's) / (their record difference).

With ``--compiled`` the model is compiled after it is watched (``torch.compile``, aot_eager: the
compiled path's rows, stamped in the graphs, without inductor's compile time), and two variants run
instead: the read decided where its rows lie (the default: Note [compiled rows decided where they
lie] in nanscan/monitor/readback.py) and decoded whole, each written compiled row made a slot (the
path before that note; ``DEVICE_DECISION = "never"``). Compiling takes seconds a run: use few rounds.

    python -m benchmarks.read_cost [--layers 16 160] [--rounds R] [--steps K] [--compiled] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import nanscan
from nanscan import _ops
from nanscan.monitor import distributed, reading, readback
from nanscan.monitor.monitor import Monitor
from nanscan.monitor.tensors import ModelTensors

# variant -> (the decision, the mode, every part that walks the rows on, how the read is taken: "first"
# -- in one call before the rest of the read, "blocks" -- call by call, through Reading.gather)
VARIANTS = {"cuda": ("cuda", "sync", "", "first"), "blocks": ("cuda", "sync", "", "blocks"),
            "device": ("always", "sync", "", "first"), "device_copy": ("always", "sync", "", "blocks"),
            "async": ("cuda", "async", "", "first"), "async_copy": ("cuda", "async", "", "blocks"),
            "never": ("never", "sync", "", "first"), "log": ("cuda", "sync", "log", "first"),
            "parts": ("cuda", "sync", "all", "first")}
# The same model compiled after it is watched (--compiled; aot_eager: the compiled path's rows without
# inductor's compile time): its read decided where the rows lie (Note [compiled rows decided where
# they lie] in nanscan/monitor/readback.py), and decoded whole -- every written row made a slot (the
# path before that note; "never" takes it).
COMPILED_VARIANTS = {"compiled": ("cuda", "sync", "", "first"),
                     "compiled_whole": ("never", "sync", "", "first")}
NAMES = {"cuda": "default (one call)", "blocks": "call by call, in blocks",
         "device": "device path, one call",
         "device_copy": "device path, as a Copy", "async": "async (one call)",
         "async_copy": "async, Copy in blocks", "never": "stacked, copied whole",
         "log": "a step log", "parts": "every part on", "compiled": "compiled, rows in place",
         "compiled_whole": "compiled, decoded whole"}


def _model(layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    return model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(2, 8)


def _train(model, opt, x, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def run_reads(layers: int, decision: str, steps: int, *, count_calls: bool = False, parts: str = "",
              mode: str = "sync", taken: str = "first", cold_probe: bool = False, compiled: bool = False) -> dict:
    """Watch a fresh ``layers``-layer model in ``mode``, train ``steps`` steps (after 2 untimed ones)
    with the read decided by ``decision`` (``parts``: ``"log"`` a step log on, ``"all"`` a step log,
    spikes, headroom and telemetry);
    per read: whole and records-finished nanoseconds, records, and (``count_calls``) Python calls;
    ``cold_probe``: also the time of ``distributed.active()`` (four small Python functions) called
    twice in a row as the read begins -- the first as cold as the read's own first call; ``compiled``:
    the model is compiled after it is watched (aot_eager)."""
    model, opt, x = _model(layers)
    options = {"mode": mode}
    log_dir = None
    if parts:
        log_dir = tempfile.mkdtemp(prefix="nanscan-read-cost-")
        options["log"] = os.path.join(log_dir, "events.jsonl")
        if parts == "all":
            options.update(spikes=True, headroom_bits=4.0, telemetry=lambda step, scalars: None, telemetry_every=10)
    whole, finishing, records, calls, probes = [], [], [], [], []
    read_and_decide, grad_records = Monitor._read_and_decide, ModelTensors.grad_records
    extension = _ops.monitor_extension()
    takes = {cls: cls.__dict__["take"] for cls in (extension.Window, extension.GradSink)}
    decision_before = readback.DEVICE_DECISION

    def timed_read(self, *args, **kwargs):
        finishing.append(0)
        # (the records this read takes: the window's entries, the gradients of module outputs, the
        # parameter gradients -- every parameter has one here; compiled, the rows its graphs stamped)
        window, sink = self.reading.window, self.reading.grad_sink
        records.append(len(window) + (len(sink) if sink is not None else 0) + len(self.tensors.param_names)
                       + (self.traced.stamped() if self.traced.used else 0))
        if cold_probe:
            t0 = time.perf_counter_ns()
            distributed.active()
            t1 = time.perf_counter_ns()
            distributed.active()
            probes.append((t1 - t0, time.perf_counter_ns() - t1))
        counted = [0]
        if count_calls:
            def profile(frame, event, arg):
                if event in ("call", "c_call"):
                    counted[0] += 1
            sys.setprofile(profile)
        t = time.perf_counter_ns()
        try:
            return read_and_decide(self, *args, **kwargs)
        finally:
            whole.append(time.perf_counter_ns() - t)
            if count_calls:
                sys.setprofile(None)
                calls.append(counted[0])
            lean = self.reading._lean_read  # (a read taken in one C++ call times its own finishing)
            if lean is not None:
                finishing[-1] += lean[0].finishing_ns
                lean[0].finishing_ns = 0

    def timed(function):
        def timed_call(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                finishing[-1] += time.perf_counter_ns() - t
        return timed_call

    def restore():
        Monitor._read_and_decide, ModelTensors.grad_records = read_and_decide, grad_records
        for cls, take in takes.items():
            cls.take = take

    readback.DEVICE_DECISION, reading.TAKEN_IN_ONE_CALL = decision, taken != "blocks"
    try:
        with nanscan.watch(model, opt, **options) as mon:
            if compiled:
                torch._dynamo.reset()  # (a model per run: dynamo's recompile limit would leave later runs eager)
                model = torch.compile(model, backend="aot_eager")
            _train(model, opt, x, 2)
            Monitor._read_and_decide, ModelTensors.grad_records = timed_read, timed(grad_records)
            for cls, take in takes.items():  # (the hooks call C++ directly: only the read's takes come here)
                cls.take = timed(take)
            try:
                _train(model, opt, x, steps)
            finally:
                restore()
            assert mon.incidents == [], "the benchmark's steps must be clean"
    finally:
        readback.DEVICE_DECISION, reading.TAKEN_IN_ONE_CALL = decision_before, True
        restore()
        if log_dir is not None:
            for name in os.listdir(log_dir):
                os.remove(os.path.join(log_dir, name))
            os.rmdir(log_dir)
    return {"whole_ns": whole, "finishing_ns": finishing, "records": records, "calls": calls, "probes": probes}


def measure(layers=(16, 160), rounds: int = 15, steps: int = 20, compiled: bool = False) -> dict:
    variants = COMPILED_VARIANTS if compiled else VARIANTS
    results = {}
    cold = None
    for n in layers:
        samples = {v: {"whole_ns": [], "finishing_ns": [], "records": [], "calls": []} for v in variants}
        order = list(variants)
        for r in range(rounds):
            for variant in (order if r % 2 == 0 else order[::-1]):
                decision, mode, parts, taken = variants[variant]
                got = run_reads(n, decision, steps, parts=parts, mode=mode, taken=taken, compiled=compiled)
                for k in ("whole_ns", "finishing_ns", "records"):
                    samples[variant][k] += got[k]
        for variant, (decision, mode, parts, taken) in variants.items():
            samples[variant]["calls"] = run_reads(n, decision, 3, count_calls=True, parts=parts, mode=mode,
                                                  taken=taken, compiled=compiled)["calls"]
            if variant == "cuda":  # (a pass of its own: the probe warms what the read calls first)
                probes = run_reads(n, decision, steps, cold_probe=True)["probes"]
                cold = {"first_call_us": statistics.median(p[0] for p in probes) / 1e3,
                        "second_call_us": statistics.median(p[1] for p in probes) / 1e3}
            s = samples[variant]
            whole = statistics.median(s["whole_ns"]) / 1e3
            finishing = statistics.median(s["finishing_ns"]) / 1e3
            rest = statistics.median([w - f for w, f in zip(s["whole_ns"], s["finishing_ns"])]) / 1e3
            results.setdefault(str(n), {})[variant] = {
                "records": statistics.median(s["records"]), "whole_us": whole, "finishing_us": finishing,
                "read_and_decision_us": rest, "python_calls": statistics.median(s["calls"]),
                "reads": len(s["whole_ns"])}
        if cold is not None:
            results[str(n)]["cold_call"] = cold
    return {"layers": list(layers), "rounds": rounds, "steps": steps, "torch": torch.__version__,
            "variants": list(variants), "results": results}


def slopes(result: dict) -> dict:
    """Per variant: (largest n - smallest n) per record, of each measure."""
    res = result["results"]
    small, large = res[str(min(result["layers"]))], res[str(max(result["layers"]))]
    out = {}
    for v in result.get("variants", VARIANTS):
        records = large[v]["records"] - small[v]["records"]
        out[v] = {k: (large[v][k] - small[v][k]) / records if records else float("nan")
                  for k in ("whole_us", "finishing_us", "read_and_decision_us", "python_calls")}
    return out


def table(result: dict) -> str:
    lines = [f"{'layers':>6} {'records':>8} {'variant':<22} {'whole us':>9} {'records finished us':>20} "
             f"{'read+decision us':>17} {'Python calls':>13}", "-" * 100]
    for n in result["layers"]:
        for v in result.get("variants", VARIANTS):
            r = result["results"][str(n)][v]
            lines.append(f"{n:>6} {r['records']:>8.0f} {NAMES[v]:<22} {r['whole_us']:>9.1f} "
                         f"{r['finishing_us']:>20.1f} {r['read_and_decision_us']:>17.1f} {r['python_calls']:>13.0f}")
    for n in result["layers"]:
        cold = result["results"][str(n)].get("cold_call")
        if cold is None:
            continue
        lines.append(f"{n:>6} layers: distributed.active() as a read begins {cold['first_call_us']:.1f} us, "
                     f"called again at once {cold['second_call_us']:.1f} us")
    for v, s in slopes(result).items():
        lines.append(f"per record, {NAMES[v]}: whole {s['whole_us']:.3f} us, records finished "
                     f"{s['finishing_us']:.3f} us, read+decision {s['read_and_decision_us']:.3f} us, Python calls "
                     f"{s['python_calls']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 160])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--compiled", action="store_true",
                        help="the model compiled (aot_eager): its read where the rows lie vs decoded whole")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(tuple(args.layers), args.rounds, args.steps, compiled=args.compiled)
    print(f"read cost: n x Linear(8,8){' compiled (aot_eager)' if args.compiled else ''}, batch 2, 1 thread, cpu, "
          f"torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps per variant")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  parameter gradients' records (``ModelTensors.grad_records``: one C++ call). That is kernel work
  on the CPU, a launch or two on a device;
- **read + decision**: the difference -- the non-finite test, the slots, the copy, the findings and
  every consumer: what the clean-step target is about (<= 30 us at 1,000 records, flat in the number
  of records);
- **Python calls**: functions and builtins called from Python during one read (``sys.setprofile``
  "call" and "c_call" events, in a separate pass: the profile hook slows the read).

Each ``n`` is measured in four variants: the read decided as by default (``DEVICE_DECISION =
"cuda"``, sync mode: a clean read is decided in the blocks the windows made before any slot, Copy
or Read is made of it -- Note [a clean read is decided without a Read] in
nanscan/monitor/readback.py), the same in async mode (``"async"``: a Copy decided in its blocks, a
read later, then bookkept without a Read: the clean path before that note, and the GPU's),
stacked and copied whole (``"never"``: the read before the clean-read path), and with every part
that walks a read's rows on (``"parts"``: a step log, spike warnings, ``headroom_bits=4`` and
telemetry every 10 steps to a no-op sink -- the rows are then stacked, and each part walks them
through ``Read.runs``), in
interleaved rounds (one round: ``--steps`` watched steps of each variant, order reversed every
round); a number is the median over every read of the rounds. The slope per record is (the largest
``n``'s value - the smallest's) / (their record difference).

    python -m benchmarks.read_cost [--layers 16 160] [--rounds R] [--steps K] [--json out.json]
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
from nanscan.monitor import readback
from nanscan.monitor.monitor import Monitor
from nanscan.monitor.tensors import ModelTensors

# variant -> (the decision, the mode, every part that walks the rows on)
VARIANTS = {"cuda": ("cuda", "sync", False), "async": ("cuda", "async", False), "never": ("never", "sync", False),
            "parts": ("cuda", "sync", True)}
NAMES = {"cuda": "default (no Copy)", "async": "async (Copy in blocks)", "never": "stacked, copied whole",
         "parts": "every part on"}


class _Timed:
    """Stands for a C++ read window (or gradient sink) in ``Reading``: times its ``take``. (The
    hooks hold the C++ object itself: only the read's calls come through here.)"""

    def __init__(self, inner, spent: list):
        self._inner, self._spent = inner, spent

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name in ("_inner", "_spent"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __len__(self):
        return len(self._inner)

    def take(self):
        t = time.perf_counter_ns()
        try:
            return self._inner.take()
        finally:
            self._spent[-1] += time.perf_counter_ns() - t


def _model(layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    return model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(2, 8)


def _train(model, opt, x, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def run_reads(layers: int, decision: str, steps: int, *, count_calls: bool = False, parts: bool = False,
              mode: str = "sync") -> dict:
    """Watch a fresh ``layers``-layer model in ``mode``, train ``steps`` steps (after 2 untimed ones)
    with the read decided by ``decision`` (``parts``: a step log, spikes, headroom and telemetry on);
    per read: whole and records-finished nanoseconds, records, and (``count_calls``) Python calls."""
    model, opt, x = _model(layers)
    options = {"mode": mode}
    log_dir = None
    if parts:
        log_dir = tempfile.mkdtemp(prefix="nanscan-read-cost-")
        options.update(log=os.path.join(log_dir, "events.jsonl"), spikes=True, headroom_bits=4.0,
                       telemetry=lambda step, scalars: None, telemetry_every=10)
    whole, finishing, records, calls = [], [], [], []
    read_and_decide, grad_records = Monitor._read_and_decide, ModelTensors.grad_records
    decision_before = readback.DEVICE_DECISION

    def timed_read(self, *args, **kwargs):
        finishing.append(0)
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

    def timed_grad_records(self, *args, **kwargs):
        t = time.perf_counter_ns()
        try:
            found = grad_records(self, *args, **kwargs)
        finally:
            finishing[-1] += time.perf_counter_ns() - t
        return found

    readback.DEVICE_DECISION = decision
    Monitor._read_and_decide, ModelTensors.grad_records = timed_read, timed_grad_records
    try:
        with nanscan.watch(model, opt, **options) as mon:
            reading = mon.reading
            reading.window = _Timed(reading.window, finishing)
            if reading.grad_sink is not None:
                reading.grad_sink = _Timed(reading.grad_sink, finishing)
            _train(model, opt, x, 2)
            del whole[:], finishing[:], calls[:]
            # (records counted from the blocks: a read decided clean has no slots)
            start, clean_of = readback.Copy.start.__func__, readback.Clean.of.__func__

            def counting_start(cls, blocks, slots, *args, **kwargs):
                records.append(sum(b.shape[0] for b in blocks))
                return start(cls, blocks, slots, *args, **kwargs)

            def counting_clean(cls, step, blocks, *args, **kwargs):
                records.append(sum(b.shape[0] for b in blocks))
                return clean_of(cls, step, blocks, *args, **kwargs)

            readback.Copy.start, readback.Clean.of = classmethod(counting_start), classmethod(counting_clean)
            try:
                _train(model, opt, x, steps)
            finally:
                readback.Copy.start, readback.Clean.of = classmethod(start), classmethod(clean_of)
                Monitor._read_and_decide, ModelTensors.grad_records = read_and_decide, grad_records
            assert mon.incidents == [], "the benchmark's steps must be clean"
    finally:
        readback.DEVICE_DECISION = decision_before
        Monitor._read_and_decide, ModelTensors.grad_records = read_and_decide, grad_records
        if log_dir is not None:
            for name in os.listdir(log_dir):
                os.remove(os.path.join(log_dir, name))
            os.rmdir(log_dir)
    return {"whole_ns": whole, "finishing_ns": finishing, "records": records, "calls": calls}


def measure(layers=(16, 160), rounds: int = 15, steps: int = 20) -> dict:
    results = {}
    for n in layers:
        samples = {v: {"whole_ns": [], "finishing_ns": [], "records": [], "calls": []} for v in VARIANTS}
        order = list(VARIANTS)
        for r in range(rounds):
            for variant in (order if r % 2 == 0 else order[::-1]):
                decision, mode, parts = VARIANTS[variant]
                got = run_reads(n, decision, steps, parts=parts, mode=mode)
                for k in ("whole_ns", "finishing_ns", "records"):
                    samples[variant][k] += got[k]
        for variant, (decision, mode, parts) in VARIANTS.items():
            samples[variant]["calls"] = run_reads(n, decision, 3, count_calls=True, parts=parts, mode=mode)["calls"]
            s = samples[variant]
            whole = statistics.median(s["whole_ns"]) / 1e3
            finishing = statistics.median(s["finishing_ns"]) / 1e3
            rest = statistics.median([w - f for w, f in zip(s["whole_ns"], s["finishing_ns"])]) / 1e3
            results.setdefault(str(n), {})[variant] = {
                "records": statistics.median(s["records"]), "whole_us": whole, "finishing_us": finishing,
                "read_and_decision_us": rest, "python_calls": statistics.median(s["calls"]),
                "reads": len(s["whole_ns"])}
    return {"layers": list(layers), "rounds": rounds, "steps": steps, "torch": torch.__version__,
            "results": results}


def slopes(result: dict) -> dict:
    """Per variant: (largest n - smallest n) per record, of each measure."""
    res = result["results"]
    small, large = res[str(min(result["layers"]))], res[str(max(result["layers"]))]
    out = {}
    for v in VARIANTS:
        records = large[v]["records"] - small[v]["records"]
        out[v] = {k: (large[v][k] - small[v][k]) / records if records else float("nan")
                  for k in ("whole_us", "finishing_us", "read_and_decision_us", "python_calls")}
    return out


def table(result: dict) -> str:
    lines = [f"{'layers':>6} {'records':>8} {'variant':<22} {'whole us':>9} {'records finished us':>20} "
             f"{'read+decision us':>17} {'Python calls':>13}", "-" * 100]
    for n in result["layers"]:
        for v in VARIANTS:
            r = result["results"][str(n)][v]
            lines.append(f"{n:>6} {r['records']:>8.0f} {NAMES[v]:<22} {r['whole_us']:>9.1f} "
                         f"{r['finishing_us']:>20.1f} {r['read_and_decision_us']:>17.1f} {r['python_calls']:>13.0f}")
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(tuple(args.layers), args.rounds, args.steps)
    print(f"read cost: n x Linear(8,8), batch 2, 1 thread, cpu, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.steps} steps per variant")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

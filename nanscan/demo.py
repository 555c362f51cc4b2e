"""``make demo``: nanscan end to end, in under two minutes on a CPU.

Part 1 summarizes a few example tensors (NaN/Inf, an FP32 sum of squares that overflows, float8,
an empty tensor) on every backend usable here. Part 2 is the incident walk-through: a small
transformer trained on synthetic data with fp16 autocast and a GradScaler (on a GPU and on the
CPU alike: fp16 autocast runs on both). The first steps overflow in the *backward* while the
GradScaler calibrates its scale: those updates are skipped and nanscan only counts them. At one step
a planted batch of unnormalized features (a data bug: values around 6e4, finite in fp16) drives the
input projection past fp16's 65504: the activation overflows in the *forward*, which loss scaling
cannot fix. nanscan stops the step before the update, names the step, phase and module, says the
values were produced there, writes the bundle, and the replay names the op -- and shows it is
finite in FP32. The event log becomes a report (PNG when matplotlib is installed).

Part 3 is the early warning (``watch(..., headroom_bits=True)``): the same model, fp16 autocast, but
one MLP's weights start 32x too large and grow 5% a step (what a learning rate too high for an
unnormalized layer does).
Its fp16 activations creep towards 65504; nanscan names the module dozens of steps before the
first Inf, with the step at which the trend reaches it, and the report plots the drift.

The model is :mod:`nanscan.demo_model`'s; this module is the story around it (the planted batch,
the loop, what is printed).
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Optional

import torch

import nanscan
from nanscan import report
from nanscan.demo_model import make_model, step_loss
from nanscan.monitor.headroom import HeadroomWarning

PLANTED_STEP = 14
STEPS = 18
DRIFT = 1.05  # part 3: blocks.1.fc's weights start 32x too large and grow 5% a step
DRIFT_START = 32.0
DRIFT_MODULE = "blocks.1.fc"


def examples() -> list:
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(0)
    healthy = torch.randn(256, 256, generator=gen)
    poisoned = healthy.clone()
    poisoned[17, 3], poisoned[40, 0], poisoned[200, 9] = nan, inf, -inf
    return [
        ("healthy fp32 weights", healthy),
        ("NaN + Inf planted (fp32)", poisoned),
        ("same, transposed view", poisoned.t()),
        ("fp32 1e20s: sumsq overflows", torch.full((1000,), 1e20)),
        ("fp16 past 65504 -> inf", torch.linspace(0, 70000, 9).half()),
        ("float8_e4m3fn", torch.tensor([0.5, -448.0, 3.0]).to(torch.float8_e4m3fn)),
        ("empty", torch.empty(0, 4)),
    ]


def fmt(v, missing: str = "none") -> str:
    """A number for the tables: integers whole (an index of 123456 stays 123456), floats to 4
    significant digits; nan / inf spelled out; ``missing`` for None."""
    if v is None:
        return missing
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else f"{v:.4g}"


def tensor_table() -> None:
    # triton on CPU tensors would be the (slow) interpreter: shown on GPUs only
    backends = [b for b in nanscan.available_backends() if b in ("cpu", "reference") or torch.cuda.is_available()]
    header = (f"{'tensor':<30} {'backend':<9} {'dtype':<14} {'nan':>5} {'+inf':>5} {'-inf':>5} {'zero':>6} "
              f"{'min':>10} {'max':>10} {'sumsq':>10} {'first':>6}  note")
    print(header)
    print("-" * len(header))
    for name, x in examples():
        for backend in backends:
            s = nanscan.summarize(x, backend=backend)
            note = "sumsq overflowed (inputs finite)" if s.sumsq_overflowed and s.is_finite else (
                "" if s.is_finite else f"{s.nonfinite_count} non-finite")
            print(f"{name:<30} {backend:<9} {str(s.dtype).replace('torch.', ''):<14} {s.nan_count:>5} "
                  f"{s.posinf_count:>5} {s.neginf_count:>5} {s.zero_count:>6} {fmt(s.finite_min):>10} "
                  f"{fmt(s.finite_max):>10} {fmt(s.sumsq):>10} {fmt(s.first_nonfinite_index):>6}  {note}")


def batch_for(step: int, device) -> tuple:
    x = torch.randn(16, 24, 32, device=device)
    y = x.mean(dim=-1)
    if step == PLANTED_STEP:  # a data bug: unnormalized readings, finite in fp16 (max 65504)
        x = x.sign() * 6e4
    return x, y


def fresh(workdir: str, name: str) -> str:
    """``workdir/name``, or ``name-2``, ``name-3``... when taken: a rerun into the same directory
    gets logs and plots of its own (an event log appends, and its report would mix the runs) and
    never touches the earlier run's files."""
    stem, suffix = os.path.splitext(name)
    path, k = os.path.join(workdir, name), 1
    while os.path.exists(path):
        k += 1
        path = os.path.join(workdir, f"{stem}-{k}{suffix}")
    return path


def show_report(log_path: str, png: str) -> None:
    """What ``nanscan report LOG -o PNG`` prints and draws (the plot only with matplotlib)."""
    print("\n" + report.text_report(log_path))
    try:
        report.plot_report(log_path, png)
        print(f"report plot: {png}")
    except ImportError as e:
        print(f"(no plot: {e})")


def walkthrough(workdir: str) -> int:
    from nanscan.log import read_events

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, forward = make_model(), step_loss
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**20)  # high on purpose: a few early skips
    log_path = fresh(workdir, "events.jsonl")
    bundles = os.path.join(workdir, "bundles")
    print(f"\n== 2. incident walk-through: tiny transformer, fp16 autocast + GradScaler on {device} ==")
    print(f"event log {log_path}; bundles in {bundles}")
    print(f"{'step':>4} {'loss':>10} {'grad norm':>10} {'loss scale':>11} {'lr':>8}  update    non-finite")
    mon = nanscan.watch(model, opt, scaler, capture_dir=bundles, log=log_path)
    error: Optional[nanscan.NonFiniteError] = None
    shown = 0
    try:
        with mon, nanscan.guard(log=mon.steplog.log, monitor=mon):
            for step in range(STEPS):
                x, y = batch_for(step, device)
                try:  # the plain AMP loop: watch() needs no change to it
                    with torch.autocast(device, dtype=torch.float16):
                        loss = forward(model, (x, y))
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
                finally:
                    for e in [e for e in read_events(log_path) if e.get("type") == "step"][shown:]:
                        shown += 1
                        bad = {k: v for k, v in (e.get("nonfinite") or {}).items() if v}
                        print(f"{e['step']:>4} {fmt(e.get('loss'), '-'):>10} {fmt(e.get('grad_norm'), '-'):>10} "
                              f"{fmt(e.get('loss_scale'), '-'):>11} {fmt(e.get('lr'), '-'):>8}  "
                              f"{e.get('update') or '-':<9} {bad or ''}")
    except nanscan.NonFiniteError as e:
        error = e
    if error is None:
        print("no incident: the planted batch did not overflow (unexpected)")
        return 1
    led = mon.ledger
    print(f"\nAMP ledger: {led.attempted} update attempts, {led.applied} applied, skipped steps {led.skipped_steps} "
          "(gradient overflow while GradScaler calibrated: handled, counted, not raised)")
    inc = error.incident
    print(f"\nINCIDENT  step {inc.step}, phase {inc.phase}, module '{inc.name}' ({inc.kind}), "
          f"{'produced there' if inc.produced else 'propagated'}")
    print(f"          {inc}")
    print(f"bundle    {error.bundle_path}")
    print("\n" + report.text_report(error.bundle_path), end="")  # what `nanscan show` prints

    print("\nreplay (as recorded: fp16 autocast, pre-step RNG and state):")
    result = nanscan.replay(error.bundle_path, make_model().to(device))
    print(f"  {result}")
    print("replay in FP32:")
    fp32 = nanscan.replay(error.bundle_path, make_model().to(device), precision="fp32")
    print(f"  {fp32}")
    print(f"  -> {'an fp16 range problem: FP32 stays finite' if not fp32.reproduced else 'not a precision problem'}")
    print(f"  (same from a shell: nanscan replay {error.bundle_path} --model nanscan.demo_model:make_model [--fp32])")

    show_report(log_path, fresh(workdir, "report.png"))
    ok = (inc.step == PLANTED_STEP and inc.phase == "forward" and inc.name == "embed" and inc.produced
          and result.reproduced and not fp32.reproduced)
    return 0 if ok else 1


def headroom_walkthrough(workdir: str) -> int:
    """Part 3: warned before the overflow. Returns 0 when the warning named the module that then
    overflowed, at least 20 steps ahead, with an overflow step predicted within 25%."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device)
    drifting = model.get_submodule(DRIFT_MODULE)
    with torch.no_grad():
        drifting.weight.mul_(DRIFT_START)
    log_path = fresh(workdir, "headroom.jsonl")
    print(f"\n== 3. early warning: {DRIFT_MODULE}'s weights start {DRIFT_START:g}x too large and grow "
          f"{100 * (DRIFT - 1):.0f}% a step, fp16 autocast on {device} ==")
    print(f"nanscan.watch(model, opt, scaler, headroom_bits=True, log={log_path!r})")
    gen = torch.Generator().manual_seed(1)
    error: Optional[nanscan.NonFiniteError] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadroomWarning)  # (printed below, from mon.headroom_events)
        try:
            with nanscan.watch(model, opt, scaler, headroom_bits=True, log=log_path) as mon:
                for _step in range(1000):
                    with torch.no_grad():
                        drifting.weight.mul_(DRIFT)
                    x = torch.randn(16, 24, 32, generator=gen).to(device)
                    with torch.autocast(device, dtype=torch.float16):
                        loss = step_loss(model, (x, x.mean(dim=-1)))
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
        except nanscan.NonFiniteError as e:
            error = e
    if error is None or not mon.headroom_events:
        print("no overflow or no warning (unexpected)")
        return 1
    warned = mon.headroom_events[0]
    inc = error.incident
    print(f"WARNING   {warned}")
    print(f"INCIDENT  {inc}")
    ahead = inc.step - warned.step
    print(f"-> warned {ahead} steps before the first Inf, in the module that overflowed "
          f"('{warned.name}' / '{inc.name}'); predicted step {warned.overflow_step}, actual {inc.step}")
    show_report(log_path, fresh(workdir, "headroom.png"))
    close = warned.overflow_step is not None and abs(warned.overflow_step - inc.step) <= 0.25 * ahead
    return 0 if (warned.name == inc.name and inc.phase == "forward" and ahead >= 20 and close) else 1


def main(argv=None) -> int:
    print(f"nanscan {nanscan.__version__}: torch {torch.__version__}; backends here: "
          f"{', '.join(nanscan.available_backends())}")
    print("\n== 1. one fused pass per tensor ==")
    tensor_table()
    workdir = (argv or [None])[0] if argv else None
    workdir = workdir or tempfile.mkdtemp(prefix="nanscan-demo-")
    status = walkthrough(workdir)
    return headroom_walkthrough(workdir) or status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

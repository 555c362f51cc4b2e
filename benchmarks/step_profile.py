"""What one training step asks of the device and the host, watched and unwatched: a profile per
variant (torch.profiler, CUDA activity where there is a GPU), counted per step, and the A/B of the
read's two decisions in one process.

Variants, on the monitor benchmark's model (``benchmarks/bench_monitor.py``: GPT-2-small in bf16
autocast on a GPU, the 4-layer GPT here):

- ``unwatched``: the plain step;
- ``sync`` / ``async``: ``nanscan.watch(model, opt, mode=...)``, every step checked;
- ``sync, host decides``: the sync read with ``readback.DEVICE_DECISION = "never"`` -- the read as
  it was before a clean read came back as one number (Note [a clean read comes back as one
  number]), so the two read paths are compared in one process.

Per step, from the profile (``--steps`` steps after ``--warmup``): kernel launches
(``cudaLaunchKernel`` / ``cuLaunchKernel`` / ``cudaLaunchKernelExC`` runtime calls), memcpys (device
memcpy activity by direction), synchronizations (``cudaStreamSynchronize`` / ``cudaEventSynchronize``
/ ``cudaDeviceSynchronize``), pinned host allocations (``cudaHostAlloc``, and the growth of
``torch.cuda.host_memory_stats()``'s allocations), nanscan op calls (``nanscan::`` ops seen by the
dispatcher) and ``aten::cat`` / ``aten::copy_`` calls. Then every variant is timed round by round,
interleaved (``--rounds``), CUDA events beside wall time on a GPU; ratios are to the unwatched step
of the same round. The top host ops by self CPU time of each variant are printed, and everything
goes to ``--json``.

    python -m benchmarks.step_profile [--model gpt,llama-1b,host-bound] [--steps 5] [--warmup 3] [--rounds 10]
                                      [--json FILE]

``--model llama-1b``: TinyLlama-1.1B's shape through transformers' ``LlamaForCausalLM`` (bf16
autocast, seq 2048, batch 4 on a GPU; a 2-layer narrow one here), the loss computed by the model:
the compute-bound common case beside GPT-2-small's host-bound one. ``--model host-bound``:
``benchmarks/host_cost.py``'s 200x ``Linear(8, 8)`` at batch 1, a step that is all host time: its top
host ops say what the hooks cost per module on the device. Several models, comma-separated, go
into one JSON (``models``: one entry each).

On this CPU the counts of CUDA runtime calls are 0 (no CUDA path runs): what is here is the op
counts and the timing; the GPU check (``benchmarks/gpu_check.sh`` part 1) runs it on the H200.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

import nanscan
from benchmarks import bench_monitor
from benchmarks.bench_monitor import DEVICE
from nanscan.monitor import readback


class Workload:
    """A model, its optimizer, its batch and its training step (the plain loop: no ``mon.step``)."""

    def __init__(self, name: str):
        self.name = name
        if name == "gpt":  # the monitor benchmark's (GPT-2-small bf16 on a GPU, the 4-layer GPT here)
            self.label = bench_monitor.NAME
            self.model, self.opt, self.batch = bench_monitor.make()
            self._step = bench_monitor.step
        elif name == "llama-1b":
            self._make_llama()
        elif name == "host-bound":  # benchmarks/host_cost.py's: 200x Linear(8, 8), batch 1 -- all host time
            from benchmarks.host_cost import make_host_bound, train_step

            self.label = "200x Linear(8, 8), batch 1"
            self.model, self.opt, self.batch = make_host_bound(device=DEVICE)
            self._step = train_step
        else:
            raise ValueError(f"step_profile: unknown model {name!r} (accepted: {', '.join(MODELS)})")

    def _make_llama(self) -> None:
        # TinyLlama-1.1B's shape (RMSNorm, SwiGLU, RoPE, grouped-query attention), bf16 autocast,
        # seq 2048 on a GPU: the compute-bound case. Here (CPU) a few-layer, narrow one of the same code.
        from transformers import LlamaConfig, LlamaForCausalLM

        gpu = DEVICE == "cuda"
        config = LlamaConfig(
            hidden_size=2048 if gpu else 128, intermediate_size=5632 if gpu else 352,
            num_hidden_layers=22 if gpu else 2, num_attention_heads=32 if gpu else 4,
            num_key_value_heads=4 if gpu else 2, vocab_size=32000 if gpu else 1000,
            max_position_embeddings=2048, attn_implementation="sdpa")
        seq, batch = (2048, 4) if gpu else (64, 2)
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config).to(DEVICE)
        params = sum(p.numel() for p in self.model.parameters())
        self.label = f"llama {params / 1e9:.2f}B bf16, seq {seq}, batch {batch}"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batch = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)

        def step(model, opt, ids):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=gpu):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        self._step = step

    def step(self):
        return self._step(self.model, self.opt, self.batch)

VARIANTS = ("unwatched", "sync", "async", "sync, host decides")
MODELS = ("gpt", "llama-1b", "host-bound")

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
HOST_ALLOC = ("cudaHostAlloc", "cudaMallocHost")


@contextlib.contextmanager
def variant(name: str, model, opt):
    """The monitor (or none) of a variant, open for the body."""
    if name == "unwatched":
        yield
        return
    decision = readback.DEVICE_DECISION
    readback.DEVICE_DECISION = "never" if name == "sync, host decides" else decision
    mode = "async" if name == "async" else "sync"
    try:
        with nanscan.watch(model, opt, mode=mode):
            yield
    finally:
        readback.DEVICE_DECISION = decision


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _host_allocations() -> int:
    if DEVICE != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return 0
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("num_host_alloc", stats.get("allocation.all.allocated", 0)))


def count(events, steps: int) -> dict:
    """Per-step counts from a profile's events."""
    per = {"launches": 0, "syncs": 0, "pinned_allocs": 0, "memcpy_DtoH": 0, "memcpy_HtoD": 0, "memcpy_DtoD": 0,
           "nanscan_ops": 0, "aten_cat": 0, "aten_copy_": 0, "device_kernels": 0}
    for e in events:
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if "Memcpy" in name or "memcpy" in name:
                for direction in ("DtoH", "HtoD", "DtoD"):
                    if direction in name:
                        per[f"memcpy_{direction}"] += 1
            else:
                per["device_kernels"] += 1
            continue
        if name in LAUNCH:
            per["launches"] += 1
        elif name in SYNC:
            per["syncs"] += 1
        elif name in HOST_ALLOC:
            per["pinned_allocs"] += 1
        elif name.startswith("nanscan::"):
            per["nanscan_ops"] += 1
        elif name == "aten::cat":
            per["aten_cat"] += 1
        elif name == "aten::copy_":
            per["aten_copy_"] += 1
    return {k: v / steps for k, v in per.items()}


def profile(work: Workload, name: str, steps: int, warmup: int) -> dict:
    model, opt = work.model, work.opt
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with variant(name, model, opt):
        for _ in range(warmup):
            work.step()
        _sync()
        allocs = _host_allocations()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                work.step()
            _sync()
        result = count(prof.events(), steps)
        result["host_allocs_growth"] = (_host_allocations() - allocs) / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    result["top_host_ops"] = f"== {name}: {steps} steps of {work.label} on {DEVICE}\n{table}\n"
    return result


def timed(work: Workload, rounds: int, steps: int, warmup: int) -> dict:
    """Every variant round by round, interleaved: per variant, the medians of its wall (and GPU)
    time per step, and the median of its ratio to the unwatched step of the same round."""
    model, opt = work.model, work.opt
    wall = {v: [] for v in VARIANTS}
    gpu = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            with variant(name, model, opt):
                for _ in range(warmup):
                    work.step()
                _sync()
                start_event = end_event = None
                if DEVICE == "cuda":
                    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start_event.record()
                t0 = time.perf_counter()
                for _ in range(steps):
                    work.step()
                if end_event is not None:
                    end_event.record()
                _sync()
                wall[name].append((time.perf_counter() - t0) / steps * 1e3)
                if end_event is not None:
                    gpu[name].append(start_event.elapsed_time(end_event) / steps)
    result = {}
    for name in VARIANTS:
        ratios = [w / u for w, u in zip(wall[name], wall["unwatched"])]
        result[name] = {"wall_ms": statistics.median(wall[name]), "ratio": statistics.median(ratios),
                        "ratio_range": [min(ratios), max(ratios)]}
        if gpu[name]:
            gpu_ratios = [g / u for g, u in zip(gpu[name], gpu["unwatched"])]
            result[name].update(gpu_ms=statistics.median(gpu[name]), gpu_ratio=statistics.median(gpu_ratios))
    return result


def markdown(label: str, counts: dict, timing: dict) -> str:
    keys = list(next(iter(counts.values())))
    lines = [f"Per step, {label} on {DEVICE} (benchmarks/step_profile.py)", "",
             "| | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{counts[v][k]:g}" for v in VARIANTS) + " |")
    for k in ("wall_ms", "ratio", "gpu_ms", "gpu_ratio"):
        if all(k in timing[v] for v in VARIANTS):
            lines.append(f"| {k} (median) | " + " | ".join(f"{timing[v][k]:.3f}" for v in VARIANTS) + " |")
    lines.append("| ratio range | " + " | ".join(
        f"{timing[v]['ratio_range'][0]:.2f} -- {timing[v]['ratio_range'][1]:.2f}" for v in VARIANTS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt",
                        help=f"one or more, comma-separated, of: {', '.join(MODELS)} (gpt: the monitor benchmark's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None, help="a file for everything: counts, timing, top host ops")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.model.split(",") if m.strip()]
    for name in names:
        if name not in MODELS:
            parser.error(f"unknown model {name!r} (accepted: {', '.join(MODELS)})")
    result = {"device": DEVICE, "torch": torch.__version__, "models": {}}
    for name in names:
        work = Workload(name)
        counts = {v: profile(work, v, args.steps, args.warmup) for v in VARIANTS}
        ops = {v: counts[v].pop("top_host_ops") for v in VARIANTS}
        timing = timed(work, args.rounds, args.steps, args.warmup) if args.rounds > 0 else {
            v: {"wall_ms": float("nan"), "ratio": float("nan"), "ratio_range": [float("nan")] * 2} for v in VARIANTS}
        text = markdown(work.label, counts, timing)
        print("".join(ops.values()))
        print(text)
        result["models"][name] = {"label": work.label, "counts": counts, "timing": timing, "table": text,
                                  "top_host_ops": ops}
        del work
        if args.json:  # (after each model: a run cut short keeps what it measured)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

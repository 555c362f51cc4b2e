"""A training step with and without nanscan.watch (activations + grads + params, every step),
eager and compiled; ratio = overhead. And the host-bound model of issue 9 (200x Linear(8,8), batch 1,
1 thread): watched vs unwatched vs the no-op-hook floor, with host cost in us per module."""
import pytest
import torch
from torch.nn import functional as F

import nanscan
from benchmarks.host_cost import add_noop_hooks, make_host_bound, train_step
from benchmarks.models import GPT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU: the small GPT (4 layers, d=256, seq 128, batch 8). GPU: GPT-2 small (12 layers,
# d=768, vocab 50257, seq 512, batch 8) in bf16 autocast, the size the always-on targets are about.
CONFIG = (dict(vocab=50257, d=768, layers=12, heads=12, seq=512) if DEVICE == "cuda"
          else dict(vocab=1024, d=256, layers=4, heads=4, seq=128))
NAME = "gpt2-small bf16" if DEVICE == "cuda" else "gpt 4x256"
GROUP = f"train step {NAME} (eager)"


def make():
    torch.manual_seed(0)
    model = GPT(**CONFIG).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, CONFIG["vocab"], (8, CONFIG["seq"]), device=DEVICE)
    return model, opt, idx


def step(model, opt, idx, autocast: bool = DEVICE == "cuda"):
    """The plain loop: watch() needs no change to it (no mon.step, no check_loss). bf16 autocast on
    a GPU by default (``autocast``: on any device when asked, as benchmarks/traffic.py does)."""
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_step_without_watch(run_bench):
    model, opt, idx = make()
    run_bench(lambda: step(model, opt, idx), GROUP, "train step", baseline=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_with_watch(run_bench, mode):
    model, opt, idx = make()
    with nanscan.watch(model, opt, mode=mode):
        run_bench(lambda: step(model, opt, idx), GROUP, f"train step + watch({mode})")


# Compile modes: inductor's default everywhere; on a GPU also mode="reduce-overhead" (CUDA graphs:
# the step's kernels replayed with no per-kernel launch, so what is left of the host cost is what a
# graph cannot hold -- the monitor's read and the optimizer, outside the graph here).
COMPILE_MODES = ["default"] + (["reduce-overhead"] if DEVICE == "cuda" else [])


def group_compiled(mode):
    return f"train step {NAME} (compiled)" if mode == "default" else f"train step {NAME} (compiled, {mode})"


@pytest.fixture(scope="module", params=COMPILE_MODES)
def compiled_pair(request):
    """Two identical models: one compiled bare, one watched and then compiled (same inductor, same
    mode): ((model, opt, idx), (model, opt, monitor), mode)."""
    mode = request.param
    torch._dynamo.reset()
    bare, bare_opt, idx = make()
    watched, watched_opt, _ = make()
    mon = nanscan.watch(watched, watched_opt)
    yield (torch.compile(bare, mode=mode), bare_opt, idx), (torch.compile(watched, mode=mode), watched_opt, mon), mode
    mon.close()


def warm_up(model, opt, idx, mode) -> str:
    """Compile (and, with CUDA graphs, warm up and record) outside the timing; returns what the
    label must add when inductor did not use the CUDA graphs that mode asked for (it then logs why
    and runs the graph without them: a number that would be mislabelled otherwise)."""
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    for _ in range(3):
        step(model, opt, idx)
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    return f" [CUDA graphs skipped in {skipped} graph(s)]" if mode == "reduce-overhead" and skipped else ""


def test_compiled_step_without_watch(run_bench, compiled_pair):
    (model, opt, idx), _, mode = compiled_pair
    note = warm_up(model, opt, idx, mode)
    run_bench(lambda: step(model, opt, idx), group_compiled(mode), "compiled train step" + note, baseline=True)


def test_compiled_step_with_watch(run_bench, compiled_pair):
    (_, _, idx), (model, opt, _), mode = compiled_pair
    note = warm_up(model, opt, idx, mode)
    run_bench(lambda: step(model, opt, idx), group_compiled(mode), "compiled train step + watch(sync)" + note)


# Host-bound model (issue 9): 200x Linear(8, 8) at batch 1 on one thread, so the step is almost all
# host time, which is what sits on a GPU's critical path. Floor: no-op forward pre/post hooks on
# every module. See benchmarks/host_cost.py (interleaved rounds, table in us per module).
GROUP_HOST = "train step 200x Linear(8,8), 1 thread (host-bound)"
N_HOST_MODULES = 201  # len(list(model.modules())): 200 Linear + the Sequential root
_HOST_MEDIANS = {}  # label -> median s per step, for the per-module summary at session end


class _HostCostSummary:
    """Prints host cost per module over the unwatched step, also in quick mode (a runtime plugin:
    pytest collects hooks from conftest.py only)."""

    def pytest_terminal_summary(self, terminalreporter):
        base, floor = _HOST_MEDIANS.get("unwatched"), _HOST_MEDIANS.get("no-op hooks (floor)")
        if base is None:
            return
        terminalreporter.section(f"host cost per module ({GROUP_HOST}, {N_HOST_MODULES} modules)")
        floor_us = (floor - base) / N_HOST_MODULES * 1e6 if floor is not None else None
        for label, median in _HOST_MEDIANS.items():
            us = (median - base) / N_HOST_MODULES * 1e6
            x_floor = f"{us / floor_us:.2f}x floor" if floor_us and label != "unwatched" else ""
            terminalreporter.write_line(f"{label:<34} {median * 1e6:>9.1f} us/step {us:>8.2f} us/module  {x_floor}")
        # (Each variant is its own benchmark here, one after the other, and the floor is a small
        # difference of two of them: on a shared machine its multiples move by 2x between runs.)
        terminalreporter.write_line("(variants timed one after another; the interleaved measure, 200 rounds: "
                                    "python -m benchmarks.host_cost)")


@pytest.fixture
def host_bound(request):
    """(model, opt, x) of the host-bound model on DEVICE, with torch.set_num_threads(1) meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not request.config.pluginmanager.has_plugin("nanscan-host-cost"):
        request.config.pluginmanager.register(_HostCostSummary(), "nanscan-host-cost")
    model, opt, x = make_host_bound(device=DEVICE)
    assert len(list(model.modules())) == N_HOST_MODULES
    yield model, opt, x
    torch.set_num_threads(threads)


def _host_bench(run_bench, benchmark, step, label, baseline=False):
    run_bench(step, GROUP_HOST, label, baseline=baseline)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        _HOST_MEDIANS[label] = stats.stats.median
        if "unwatched" in _HOST_MEDIANS:
            benchmark.extra_info["us_per_module"] = (
                (stats.stats.median - _HOST_MEDIANS["unwatched"]) / N_HOST_MODULES * 1e6)


def test_host_step_unwatched(run_bench, benchmark, host_bound):
    _host_bench(run_bench, benchmark, lambda: train_step(*host_bound), "unwatched", baseline=True)


def test_host_step_noop_hooks(run_bench, benchmark, host_bound):
    handles = add_noop_hooks(host_bound[0])
    try:
        _host_bench(run_bench, benchmark, lambda: train_step(*host_bound), "no-op hooks (floor)")
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("every,activation_grads", [(1, True), (1, False), (1000, True)])
def test_host_step_watched(run_bench, benchmark, host_bound, every, activation_grads):
    model, opt, x = host_bound
    mon = nanscan.watch(model, opt, every=every, activation_grads=activation_grads)
    try:
        train_step(model, opt, x)  # the first step is the checked one; with every=1000 the rest are not
        label = ("watched every=1000 (unchecked)" if every != 1 else
                 "watched (every step)" if activation_grads else "watched, activation_grads=False")
        _host_bench(run_bench, benchmark, lambda: train_step(model, opt, x), label)
    finally:
        mon.close()

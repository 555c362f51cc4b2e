"""GPU-only checks the CPU suite cannot make: CUDA-graph capture, no host sync, mixed devices,
determinism, and more than 2**31 elements. (Every backend vs reference on CUDA tensors runs in
test_summarize.py, parametrized over the backends available here.)"""
import pytest
import torch

import nanscan
from nanscan.kernels import reference
from tests.helpers import assert_record_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BACKENDS = [b for b in ("cuda", "triton") if b in nanscan.available_backends()]


def planted(n, dtype=torch.float32):
    x = torch.randn(n, device="cuda").to(dtype)
    x[n // 3] = float("nan")
    x[n - 1] = float("-inf")
    return x


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_capture_single_and_many(backend):
    x, ys = planted(1 << 20), [planted(1000), planted(70001, torch.bfloat16), torch.zeros(5, device="cuda")]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture -- every path
        nanscan.record(x, backend=backend), nanscan.records(ys, backend=backend)  # the capture takes:
        for y in ys:  # under capture the multi-tensor call runs per tensor (no host-built table)
            nanscan.record(y, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        single = nanscan.record(x, backend=backend)
        many = nanscan.records(ys, backend=backend)
    x.copy_(planted(1 << 20))  # new values, same buffer: the replay must read them
    graph.replay()
    torch.cuda.synchronize()
    assert_record_matches(single, reference.summarize(x), x, f"{backend} graph single")
    for row, y in zip(many, ys):
        assert_record_matches(row, reference.summarize(y), y, f"{backend} graph many")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_host_sync(backend):
    xs = [planted(n) for n in (10, 5000, 1 << 20)]
    nanscan.record(xs[0], backend=backend), nanscan.records(xs, backend=backend)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nanscan.record(xs[2], backend=backend)
        nanscan.records(xs, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_deterministic_bitwise(backend):
    x = torch.randn(1 << 24, device="cuda")
    first = nanscan.record(x, backend=backend)
    for _ in range(3):
        assert torch.equal(nanscan.record(x, backend=backend), first)


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="one device"):
        nanscan.records([torch.ones(2), torch.ones(2, device="cuda")])


@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_more_than_2_pow_31_elements(backend):
    n = 2**31 + 1000
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    x[2**31 + 7] = float("nan")
    x[2**31 + 9] = float("inf")
    x[11] = -3.0
    s = nanscan.summarize(x, backend=backend)
    assert (s.nan_count, s.posinf_count, s.zero_count, s.first_nonfinite_index) == (1, 1, n - 3, 2**31 + 7)
    assert (s.finite_min, s.finite_max, s.sumsq) == (-3.0, 0.0, 9.0)
    del x
    torch.cuda.empty_cache()


def test_watched_training_step_async_has_no_host_sync():
    from benchmarks.models import GPT
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = GPT(layers=2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 1024, (2, 128), device="cuda")
    with nanscan.watch(model, opt, mode="async") as mon:
        try:
            for i in range(5):  # the plain loop: the monitor delimits steps itself
                if i == 2:  # warm-up steps (allocations, first copies) are done; from here on, every
                    torch.cuda.set_sync_debug_mode("error")  # step and the late decode of the one before
                loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")  # (close() reads the last step: one sync, allowed)
    assert mon.incidents == [] and mon.ledger.applied == 5

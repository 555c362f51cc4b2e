"""summarize vs torch.sum (the one-read-pass floor) vs the naive composite; summarize_many over
GPT-2-small parameter shapes vs torch._foreach_norm, GradScaler's fused non-finite check and a
Python loop of summarize (DESIGN §7). Each benchmark records bytes read in extra_info so that
benchmarks/results_table.py can turn medians into GB/s.

CPU: 16M-element tensors (64 MiB in fp32: past the caches). GPU: 1 GiB tensors (L2 is 60 MB).
"""
import pytest
import torch

import nanscan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUMEL = (1 << 28) if DEVICE == "cuda" else (1 << 24)  # 1 GiB fp32 on GPU, 64 MiB on CPU
BACKENDS = [b for b in nanscan.available_backends() if b != "reference" and (b != "triton" or DEVICE == "cuda")]


def naive_composite(x: torch.Tensor):
    """What a user writes without nanscan: one kernel (or more) per statistic."""
    finite = torch.isfinite(x)
    return (torch.isnan(x).sum(), torch.isposinf(x).sum(), torch.isneginf(x).sum(), (x == 0).sum(),
            torch.where(finite, x, float("inf")).amin(), torch.where(finite, x, -float("inf")).amax(),
            torch.where(finite, x, 0).float().pow(2).sum())


def gpt2_small_shapes():
    """Parameter shapes of GPT-2 small (124M): 148 tensors."""
    d, layers = 768, 12
    shapes = [(50257, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


DTYPES = ["float32", "bfloat16"] + (["float16"] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module", params=DTYPES)
def big(request):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(NUMEL, generator=gen).to(getattr(torch, request.param)).to(DEVICE)


def test_sum_baseline(big, run_bench):
    run_bench(lambda: big.sum(), f"single {str(big.dtype)[6:]} {NUMEL >> 20}M", "torch.sum", baseline=True,
              bytes_read=big.numel() * big.element_size())


def test_naive_composite(big, run_bench):
    run_bench(lambda: naive_composite(big), f"single {str(big.dtype)[6:]} {NUMEL >> 20}M", "naive composite (7 ops)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_summarize(big, run_bench, backend):
    run_bench(lambda: nanscan.record(big, backend=backend), f"single {str(big.dtype)[6:]} {NUMEL >> 20}M",
              f"nanscan.record[{backend}]", bytes_read=big.numel() * big.element_size())


@pytest.fixture(scope="module")
def params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(DEVICE) for s in gpt2_small_shapes()]


GROUP_MANY = "many: gpt2-small params"


def test_foreach_norm_baseline(params, run_bench):
    run_bench(lambda: torch._foreach_norm(params), GROUP_MANY, "torch._foreach_norm", baseline=True)


def test_amp_unscale_baseline(params, run_bench):
    """What GradScaler runs every step: a non-finite check fused with the unscale (no norms)."""
    grads = [p.clone() for p in params]
    found_inf = torch.zeros(1, device=DEVICE)
    inv_scale = torch.ones(1, device=DEVICE)
    run_bench(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale), GROUP_MANY,
              "torch._amp_foreach_non_finite_check_and_unscale_")


def test_sum_loop_read_floor(params, run_bench):
    """One torch.sum per parameter: a read of every byte with the least work per element, the floor
    a one-pass records can approach. (On CPU, _foreach_norm has no fused kernel: it runs one norm
    after another.)"""
    run_bench(lambda: [p.sum() for p in params], GROUP_MANY, "loop of torch.sum (the read floor)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_summarize_many(params, run_bench, backend):
    run_bench(lambda: nanscan.records(params, backend=backend), GROUP_MANY, f"nanscan.records[{backend}]")


@pytest.mark.parametrize("backend", BACKENDS[:1])
def test_python_loop_of_summarize(params, run_bench, backend):
    run_bench(lambda: [nanscan.record(p, backend=backend) for p in params], GROUP_MANY,
              f"loop of nanscan.record[{backend}]")


GROUP_SMALL = "many small: 2000 x 64 floats"


@pytest.fixture(scope="module")
def small_tensors():
    """The host path: per-call cost per tensor dominates (issue 12: records / _foreach_norm <= 1.0)."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(64, generator=gen).to(DEVICE) for _ in range(2000)]


def test_small_foreach_norm_baseline(small_tensors, run_bench):
    run_bench(lambda: torch._foreach_norm(small_tensors), GROUP_SMALL, "torch._foreach_norm", baseline=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_records(small_tensors, run_bench, backend):
    run_bench(lambda: nanscan.records(small_tensors, backend=backend), GROUP_SMALL, f"nanscan.records[{backend}]")


GROUP_LAYOUT = "layouts fp32 16M"


@pytest.fixture(scope="module")
def square():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4096, 4096, generator=gen).to(DEVICE)


def test_layout_contiguous_baseline(square, run_bench):
    run_bench(lambda: nanscan.record(square), GROUP_LAYOUT, "nanscan.record, contiguous", baseline=True)


def test_layout_transposed(square, run_bench):
    t = square.t()
    run_bench(lambda: nanscan.record(t), GROUP_LAYOUT, "nanscan.record, transposed view")


def test_layout_channels_last(square, run_bench):
    cl = square.reshape(16, 64, 128, 128).contiguous(memory_format=torch.channels_last)
    run_bench(lambda: nanscan.record(cl), GROUP_LAYOUT, "nanscan.record, channels_last")


def test_layout_step_sliced(square, run_bench):
    sliced = square[:, ::2]  # not dense: the strided path (half the elements)
    run_bench(lambda: nanscan.record(sliced), GROUP_LAYOUT, "nanscan.record, [:, ::2] (8M, strided)")


GROUP_QVIEW = "q view of a fused qkv, fp32 16M"


@pytest.fixture(scope="module")
def q_view():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(4096, 3 * 4096, generator=gen).to(DEVICE)[:, :4096]  # rows contiguous, gaps between


def test_q_view_sum_baseline(q_view, run_bench):
    run_bench(lambda: q_view.sum(), GROUP_QVIEW, "torch.sum of the view", baseline=True)


def test_q_view_record(q_view, run_bench):
    run_bench(lambda: nanscan.record(q_view), GROUP_QVIEW, "nanscan.record of the view")

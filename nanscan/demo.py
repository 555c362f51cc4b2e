"""``make demo``: summarize example tensors -- healthy, NaN/Inf, an FP32 sum of squares that
overflows, float8, complex, transposed, empty -- on every available backend, as a table."""
from __future__ import annotations

import torch

import nanscan


def examples() -> list:
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(0)
    healthy = torch.randn(256, 256, generator=gen)
    poisoned = healthy.clone()
    poisoned[17, 3], poisoned[40, 0], poisoned[200, 9] = nan, inf, -inf
    activations = torch.relu(torch.randn(4, 8, 16, 16, generator=gen)).contiguous(memory_format=torch.channels_last)
    return [
        ("healthy fp32 weights", healthy),
        ("NaN + Inf planted (fp32)", poisoned),
        ("same, transposed view", poisoned.t()),
        ("bf16 activations after ReLU", activations.bfloat16()),
        ("fp32 1e20s: sumsq overflows", torch.full((1000,), 1e20)),
        ("same in fp64: no overflow", torch.full((1000,), 1e20, dtype=torch.float64)),
        ("fp16 past 65504 -> inf", (torch.linspace(0, 70000, 9)).half()),
        ("float8_e4m3fn", torch.tensor([0.5, -448.0, 3.0]).to(torch.float8_e4m3fn)),
        ("all NaN", torch.full((5,), nan)),
        ("complex64 with inf imag", torch.tensor([1 + 1j, complex(0, inf)], dtype=torch.complex64)),
        ("int64 labels", torch.arange(-3, 10)),
        ("empty", torch.empty(0, 4)),
    ]


def fmt(v) -> str:
    return "none" if v is None else f"{v:.4g}"


def main() -> int:
    # triton on CPU tensors would be the (slow) interpreter: the demo shows it on GPUs only
    backends = [b for b in nanscan.available_backends() if b in ("cpu", "reference") or torch.cuda.is_available()]
    print(f"nanscan {nanscan.__version__}: torch {torch.__version__}; backends here: {', '.join(nanscan.available_backends())}")
    header = f"{'tensor':<30} {'backend':<9} {'dtype':<14} {'nan':>5} {'+inf':>5} {'-inf':>5} {'zero':>6} " \
             f"{'min':>10} {'max':>10} {'sumsq':>10} {'first':>6}  note"
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
    return 0

"""More than 2**31 elements: 64-bit indexing end to end (counts, first index) on the CPU kernel."""
import pytest
import torch

import nanscan


@pytest.mark.slow
def test_more_than_2_pow_31_elements_cpu():
    n = 2**31 + 64
    try:
        x = torch.zeros(n, dtype=torch.float16)  # 4 GiB
    except RuntimeError as e:  # not enough memory on this machine
        pytest.skip(f"cannot allocate {n} fp16 elements: {e}")
    x[2**31 + 3] = float("inf")
    x[2**31 + 40] = float("nan")
    x[7] = 2.0
    s = nanscan.summarize(x, backend="cpu")
    assert (s.numel, s.posinf_count, s.nan_count, s.zero_count) == (n, 1, 1, n - 3)
    assert (s.first_nonfinite_index, s.finite_max, s.finite_min, s.sumsq) == (2**31 + 3, 2.0, 0.0, 4.0)

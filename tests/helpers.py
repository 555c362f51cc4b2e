"""Shared test helpers: the comparison against the reference oracle, and the input catalogue."""
import math
import zlib

import torch

from nanscan.record import Field

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def sumsq_rtol(x: torch.Tensor) -> float:
    """Tolerance on the sums (of squares, values, fourth powers): float64 accumulation is near exact;
    float32 accumulation differs between a pairwise (torch) and a lane-wise / sequential (kernel)
    order by a few n * eps in the worst case -- 1e-4 covers the kernels' sums, none of more than 256 terms."""
    real = torch.view_as_real(x) if x.is_complex() else x
    return 1e-12 if (real.dtype == torch.float64 or not real.dtype.is_floating_point) else 1e-4


def abs_sum(x: torch.Tensor) -> float:
    """Sum of |x_i| over the finite elements of x in float64: the scale of ``sum``'s rounding error
    (a signed sum can cancel to far below its terms, so its tolerance is relative to this)."""
    real = torch.view_as_real(x) if x.is_complex() else x
    vals = real.detach().reshape(-1).cpu().to(torch.float64)
    return float(torch.where(torch.isfinite(vals), vals.abs(), 0).sum())


def assert_record_matches(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str = "") -> None:
    """Every field exact (counts, min, max, first index) but the sums: sumsq and sum4 match within
    ``sumsq_rtol`` and are +inf exactly when the reference overflowed; sum matches within
    ``sumsq_rtol`` of the sum of the finite |x_i| (see :func:`abs_sum`), and is non-finite exactly
    when the reference's is -- unless the squares overflowed, where the sum's overflow depends on
    the order of the additions."""
    got, want = got.detach().cpu().tolist(), want.detach().cpu().tolist()
    for field in Field:
        g, w = got[field], want[field]
        label = f"{what} {field.name}: got {g}, reference {w} (dtype {x.dtype}, shape {tuple(x.shape)})"
        if field in (Field.SUMSQ, Field.SUM4):
            if math.isinf(w) or math.isinf(g):
                assert g == w, label
            else:
                assert math.isclose(g, w, rel_tol=sumsq_rtol(x), abs_tol=1e-30), label
        elif field is Field.SUM:
            if not (math.isfinite(w) and math.isfinite(g)):
                # An FP32 sum overflows only where the squares did too (|sum| <= sqrt(n * sumsq)), and
                # then whether it does, and to what, depends on the order: +big - big + big ... is 0
                # summed in sequence, inf - inf = nan summed in pairs.
                assert g == w or (math.isnan(g) and math.isnan(w)) or math.isinf(want[Field.SUMSQ]), label
            else:
                assert abs(g - w) <= sumsq_rtol(x) * abs_sum(x) + 1e-30, label
        else:
            assert g == w, label


def special_values(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """A float64 tensor of n values of the given kind (cast to the dtype under test by the caller)."""
    nan, inf = float("nan"), float("inf")
    v = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "random":
        return v
    if kind == "mixed":
        idx = torch.randperm(n, generator=gen)[: max(3, n // 50)]
        v[idx[0::3]] = nan
        v[idx[1::3]] = inf
        v[idx[2::3]] = -inf
        return v
    if kind == "all_nan":
        return torch.full((n,), nan, dtype=torch.float64)
    if kind == "all_inf":
        return torch.full((n,), -inf if n % 2 else inf, dtype=torch.float64)
    if kind == "nan_last":
        v[-1] = nan
        return v
    if kind == "zeros_subnormals":
        v[0::3] = 0.0
        v[1::3] = -0.0
        v[2::5] = 1e-310  # float64 subnormal; rounds to 0 or a subnormal in narrower types
        v[4::7] = -5e-41
        return v
    if kind == "dtype_max":
        v[0::4] = 3.0e38  # saturates to inf in fp16 / float8: the reference says what that means
        v[1::4] = -1e300
        return v
    if kind == "overflow_sumsq":
        return torch.full((n,), 1e20, dtype=torch.float64) * torch.sign(v)
    raise ValueError(kind)


VALUE_KINDS = ["random", "mixed", "all_nan", "all_inf", "nan_last", "zeros_subnormals", "dtype_max",
               "overflow_sumsq"]


def cast(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return v.to(dtype)
    if dtype == torch.bool:
        return torch.nan_to_num(v) > 0
    info = torch.iinfo(dtype)
    return torch.nan_to_num(v * 50, posinf=info.max, neginf=info.min).clamp(info.min, info.max).to(dtype)


def layouts(base: torch.Tensor):
    """(name, view) pairs over a contiguous base of numel divisible by 12: every view reads base's
    storage without copying."""
    n = base.numel()
    yield "contiguous", base
    yield "transposed", base.reshape(12, n // 12).t()
    yield "step_sliced", base.reshape(n // 12, 12)[::2, 1::3]
    yield "column_slice", base.reshape(n // 12, 12)[:, 2:11]  # contiguous runs with gaps (q/k/v views)
    yield "expanded", base[: n // 12].reshape(n // 12, 1).expand(n // 12, 5)
    if n % 24 == 0:
        yield "channels_last", base.reshape(n // 24, 2, 3, 4).contiguous(memory_format=torch.channels_last)


def stable_seed(*parts) -> int:
    """A seed from ``parts`` that is the same in every process (``hash`` of a string is salted per
    process, so a seed made with it changes from run to run)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def backward_and_step(loss: torch.Tensor, opt, scaler=None) -> None:
    """The training loop's end, with or without a GradScaler (the AMP recipe), then zero_grad."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()

"""nanscan.capture.compare on crafted tensors: non-finite mismatches first, then error numbers."""
import dataclasses
import json

import pytest
import torch

from nanscan.capture.compare import Comparison, compare

NAN, INF = float("nan"), float("inf")


def strict_json(c: Comparison) -> dict:
    return json.loads(json.dumps(c.to_dict(), allow_nan=False))


def test_identical():
    x = torch.tensor([1.0, NAN, INF, -INF, 0.0])
    c = compare(x, x.clone())
    assert isinstance(c, Comparison)
    assert (c.nonfinite_expected, c.nonfinite_actual, c.mismatch_count) == (3, 3, 0)
    assert c.mismatch_positions == () and c.nonfinite_match
    assert c.first_nonfinite_expected == c.first_nonfinite_actual == 1
    assert c.finite_in_both == 2
    assert (c.max_abs_error, c.mean_abs_error, c.max_rel_error) == (0.0, 0.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mismatch_count = 1


def test_nan_in_actual_only():
    e = torch.tensor([1.0, 2.0, 4.0])
    a = torch.tensor([1.5, NAN, 4.0])
    c = compare(e, a)
    assert (c.nonfinite_expected, c.nonfinite_actual) == (0, 1)
    assert c.first_nonfinite_expected is None and c.first_nonfinite_actual == 1
    assert c.mismatch_positions == (1,) and c.mismatch_kinds == (("finite", "nan"),)
    assert c.finite_in_both == 2
    assert c.max_abs_error == 0.5 and c.mean_abs_error == 0.25 and c.max_rel_error == 0.5


def test_shifted_nan_positions():
    e = torch.zeros(10)
    a = torch.zeros(10)
    e[[3, 7]] = NAN
    a[[5, 7]] = NAN
    c = compare(e, a)
    assert c.first_nonfinite_expected == 3 and c.first_nonfinite_actual == 5
    assert c.mismatch_positions == (3, 5) and c.mismatch_count == 2
    assert c.mismatch_kinds == (("nan", "finite"), ("finite", "nan"))
    assert c.finite_in_both == 7


def test_inf_sign_and_nan_vs_inf_are_mismatches():
    e = torch.tensor([INF, NAN, INF, -INF, NAN])
    a = torch.tensor([-INF, INF, INF, -INF, NAN])
    c = compare(e, a)
    assert c.mismatch_positions == (0, 1) and c.mismatch_count == 2
    assert c.mismatch_kinds == (("+inf", "-inf"), ("nan", "+inf"))
    assert c.finite_in_both == 0
    assert c.max_abs_error is None and c.mean_abs_error is None and c.max_rel_error is None


def test_near_zero_reference_rel_guarded():
    e = torch.tensor([0.0, 1e-40, 1.0], dtype=torch.float64)
    a = torch.tensor([1e-3, 2e-40, 1.0], dtype=torch.float64)
    c = compare(e, a)
    floor = torch.finfo(torch.float64).tiny
    assert c.rel_floor == floor
    assert c.max_abs_error == pytest.approx(1e-3)
    assert c.max_rel_error == pytest.approx(1e-3 / floor)
    assert c.max_rel_error != INF
    assert compare(e.half(), a.half()).rel_floor == torch.finfo(torch.float16).tiny
    assert compare(torch.tensor([0, 5]), torch.tensor([0.5, 5.0])).max_rel_error == 0.5  # int floor 1
    c2 = compare(e, a, rel_floor=1e-2)
    assert c2.max_rel_error == pytest.approx(0.1)
    with pytest.raises(ValueError, match="rel_floor"):
        compare(e, a, rel_floor=0.0)


def test_shape_mismatch_names_both():
    with pytest.raises(ValueError) as err:
        compare(torch.zeros(2, 3), torch.zeros(3, 2))
    assert "(2, 3)" in str(err.value) and "(3, 2)" in str(err.value)


def test_non_tensor_type_error():
    with pytest.raises(TypeError, match="list"):
        compare(torch.zeros(2), [0.0, 0.0])
    with pytest.raises(TypeError, match="float"):
        compare(1.0, torch.zeros(2))


def test_bf16_vs_fp32():
    e = torch.tensor([1.0, 3.0, 1000.0, NAN])
    a = e.to(torch.bfloat16)
    a[1] = INF
    c = compare(e, a)
    assert c.expected_dtype == torch.float32 and c.actual_dtype == torch.bfloat16
    assert c.mismatch_positions == (1,) and c.mismatch_kinds == (("finite", "+inf"),)
    assert c.finite_in_both == 2
    assert c.max_abs_error == 0.0  # 1 and 1000 are exact in bf16
    x = torch.tensor([1.01])
    c2 = compare(x, x.to(torch.bfloat16))
    assert c2.max_abs_error == pytest.approx(abs(x.double().item() - x.to(torch.bfloat16).double().item()), rel=1e-12)
    assert 0 < c2.max_rel_error < 2 ** -8


def test_2d_multidim_positions_in_str():
    e = torch.zeros(3, 4)
    a = torch.zeros(3, 4)
    a[1, 2] = NAN
    a[2, 0] = -INF
    c = compare(e, a)
    assert c.mismatch_positions == (6, 8)
    assert c.mismatch_indices == ((1, 2), (2, 0))
    s = str(c)
    assert "[1, 2]" in s and "[2, 0]" in s
    assert s.index("non-finite") < s.index("max_abs_error")
    assert "first at expected none, actual 6 [1, 2]" in s


def test_transposed_view_uses_logical_order():
    base = torch.zeros(4, 3)
    base[0, 1] = NAN            # t[1, 0] -> logical flat 4 in t (shape 3x4)
    t = base.t()
    c = compare(torch.zeros(3, 4), t)
    assert c.first_nonfinite_actual == 4 and c.mismatch_indices == ((1, 0),)


def test_cap_on_mismatch_positions():
    e = torch.zeros(100)
    a = torch.full((100,), NAN)
    c = compare(e, a)
    assert c.mismatch_count == 100 and len(c.mismatch_positions) == 20
    assert c.mismatch_positions == tuple(range(20))
    c3 = compare(e, a, max_positions=3)
    assert c3.mismatch_positions == (0, 1, 2) and c3.mismatch_count == 100
    assert "... 95 more" in str(c3)


def test_to_dict_strict_json():
    e = torch.tensor([1e308, -1e308, NAN, 0.0], dtype=torch.float64)
    a = torch.tensor([-1e308, 1e308, 0.0, INF], dtype=torch.float64)
    c = compare(e, a)
    assert c.max_abs_error == INF  # |a - e| overflows float64: reported, not hidden
    d = strict_json(c)
    assert d["max_abs_error"] == {"finite": False, "value": "inf"}
    assert d["mismatch_positions"] == [2, 3] and d["mismatch_kinds"] == [["nan", "finite"], ["finite", "+inf"]]
    d2 = strict_json(compare(torch.tensor([NAN]), torch.tensor([INF])))
    assert d2["max_abs_error"] is None and d2["max_rel_error"] is None


def test_empty():
    c = compare(torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float16))
    assert (c.nonfinite_expected, c.nonfinite_actual, c.mismatch_count, c.finite_in_both) == (0, 0, 0, 0)
    assert c.first_nonfinite_expected is None and c.first_nonfinite_actual is None
    assert c.max_abs_error is None and c.mean_abs_error is None and c.max_rel_error is None
    strict_json(c)
    str(c)


def test_nothing_finite_in_both():
    e = torch.tensor([NAN, 1.0])
    a = torch.tensor([2.0, INF])
    c = compare(e, a)
    assert c.finite_in_both == 0 and c.mismatch_count == 2
    assert c.max_abs_error is None and c.mean_abs_error is None and c.max_rel_error is None
    assert "max_abs_error=none" in str(c)


def test_complex_and_integer_and_scalar():
    e = torch.tensor([1 + 1j, complex(NAN, 0)], dtype=torch.complex64)
    a = e.clone()
    a[0] = complex(1, INF)
    c = compare(e, a)
    assert c.complex_as_real and c.shape == (2, 2)
    assert c.mismatch_positions == (1,) and c.mismatch_indices == ((0, 1),)
    assert "view_as_real" in str(c)
    ci = compare(torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.5, NAN]))
    assert ci.max_abs_error == 0.5 and ci.mismatch_positions == (2,)
    c0 = compare(torch.tensor(NAN), torch.tensor(1.0))
    assert c0.mismatch_indices == ((),) and c0.first_nonfinite_expected == 0
    str(c0)

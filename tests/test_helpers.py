"""Tests of the FlashAttention-2 pass-rule checker: a checker that cannot fail proves nothing."""

import pytest
import torch

from helpers import fa2_check

NEG_INF = float("-inf")


def test_passes_within_twice_baseline_error():
    oracle = torch.tensor([1.0, 2.0, 3.0])
    baseline = oracle + torch.tensor([0.0, 0.01, -0.005])
    fa2_check(oracle + torch.tensor([0.0, -0.02, 0.0]), oracle, baseline, "out", eps=0.0)


def test_fails_beyond_twice_baseline_error_and_names_everything():
    oracle = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    baseline = oracle + 0.01
    actual = oracle.clone()
    actual[1, 0] += 0.05
    with pytest.raises(AssertionError) as excinfo:
        fa2_check(actual, oracle, baseline, "dq", eps=1e-5)
    message = str(excinfo.value)
    assert message.startswith("dq: ")
    assert "5.000e-02" in message and "1.000e-02" in message
    assert "(1, 0)" in message


def test_eps_is_added_to_the_bound():
    oracle = torch.tensor([1.0, 2.0])
    fa2_check(oracle + 1e-3, oracle, oracle, "out", eps=2e-3)
    with pytest.raises(AssertionError, match="^out: max"):
        fa2_check(oracle + 1e-3, oracle, oracle, "out", eps=5e-4)


def test_nan_in_actual_fails():
    oracle = torch.tensor([1.0, 2.0])
    baseline = oracle + 1.0
    with pytest.raises(AssertionError, match="^out: actual contains 1 NaN"):
        fa2_check(torch.tensor([1.0, float("nan")]), oracle, baseline, "out")


def test_neg_inf_lse_must_match_and_is_excluded_from_errors():
    oracle = torch.tensor([NEG_INF, 0.5, 1.5])
    baseline = torch.tensor([NEG_INF, 0.51, 1.5])
    fa2_check(torch.tensor([NEG_INF, 0.52, 1.5]), oracle, baseline, "lse", eps=0.0)
    with pytest.raises(AssertionError, match="^lse: 1 position"):
        fa2_check(torch.tensor([0.0, 0.5, 1.5]), oracle, baseline, "lse")
    with pytest.raises(AssertionError, match="^lse: actual is not finite"):
        fa2_check(torch.tensor([NEG_INF, NEG_INF, 1.5]), oracle, baseline, "lse")


def test_all_neg_inf_and_empty_pass():
    oracle = torch.full((2, 3), NEG_INF)
    fa2_check(oracle.clone(), oracle, oracle.clone(), "lse")
    empty = torch.empty(0, 4)
    fa2_check(empty, empty, empty, "out")


def test_non_finite_baseline_fails_instead_of_passing_everything():
    oracle = torch.tensor([1.0, 2.0])
    baseline = torch.tensor([1.0, float("inf")])
    with pytest.raises(AssertionError, match="^out: torch_same_dtype is not finite"):
        fa2_check(oracle + 100.0, oracle, baseline, "out")


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match="^out: shapes differ"):
        fa2_check(torch.ones(2, 3), torch.ones(3, 2), torch.ones(3, 2), "out")


def test_compares_low_precision_in_fp32():
    oracle = torch.tensor([1 / 3, 2 / 3, 0.1], dtype=torch.float64)
    baseline = oracle.to(torch.bfloat16)
    fa2_check(oracle.to(torch.float16), oracle, baseline, "out", eps=0.0)

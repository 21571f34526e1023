"""Sequence isolation in a packed (variable-length) batch: a NaN or Inf in one sequence's q, k, v or
dout changes no other sequence's outputs or gradients. The tiles of a sequence's last blocks reach
into the next sequence's rows (TMA reads the packed tensor); the kernels must not let those values
through (0 * NaN = NaN). Skipped without a GPU."""

import pytest
import torch

import flash_cutlass
from helpers import (COMPILED_SM90_BACKWARD_HEAD_DIMS, COMPILED_SM90_HEAD_DIMS, kernel_unavailable, requires_backward,
                     requires_cuda)

pytestmark = requires_cuda

LENGTHS = (100, 77, 150)  # tails in every sequence's last query and key blocks
TOTAL, LONGEST = sum(LENGTHS), max(LENGTHS)
MIDDLE = slice(100, 177)  # all of the middle sequence
NEIGHBOURS = (slice(0, 100), slice(177, 327))


def packed_inputs(gen, head_dim):
    """cu_seqlens of LENGTHS and random packed q, k, v, dout (4 query heads, 2 kv heads) in bf16."""
    def rand(heads):
        return torch.randn(TOTAL, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)

    cu_seqlens = torch.tensor([0, 100, 177, 327], dtype=torch.int32, device="cuda")
    return cu_seqlens, {"q": rand(4), "k": rand(2), "v": rand(2), "dout": rand(4)}


def poisoned_copy(clean, name, value):
    """clean with a copy of tensor `name` whose middle sequence is all `value`."""
    poisoned = dict(clean)
    poisoned[name] = clean[name].clone()
    poisoned[name][MIDDLE] = value
    return poisoned


@requires_backward
@pytest.mark.parametrize("poisoned", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("kernel", ["sm80", "sm90", "sm90_gqa_walk"])
def test_a_non_finite_sequence_leaves_its_neighbours_gradients_alone(cuda_gen, monkeypatch, kernel, head_dim, causal,
                                                                     value, poisoned):
    """sm90_gqa_walk: the Hopper backward with CTAs walking both query heads of a K/V head
    ($FLASH_CUTLASS_GQA_WALK_HEADS), whose loader zeroes the tails of each head's last query block."""
    # One head a tile on "sm90", whatever the default walks.
    monkeypatch.setenv("FLASH_CUTLASS_GQA_WALK_HEADS", "2" if kernel == "sm90_gqa_walk" else "1")
    if kernel == "sm90_gqa_walk":
        kernel = "sm90"
    reason = kernel_unavailable(kernel, head_dim, "backward")
    if reason:
        pytest.skip(reason)
    cu_seqlens, clean = packed_inputs(cuda_gen, head_dim)
    out, lse = flash_cutlass.flash_forward_varlen(clean["q"], clean["k"], clean["v"], cu_seqlens, cu_seqlens, LONGEST,
                                                  LONGEST, causal=causal)

    def gradients(tensors):
        return flash_cutlass.flash_backward_varlen(tensors["dout"], tensors["q"], tensors["k"], tensors["v"], out, lse,
                                                   cu_seqlens, cu_seqlens, LONGEST, LONGEST, causal=causal,
                                                   kernel=kernel)

    expected = gradients(clean)
    got = gradients(poisoned_copy(clean, poisoned, value))
    for name, grad, ref in zip(("dq", "dk", "dv"), got, expected):
        for rows in NEIGHBOURS:
            assert grad[rows].isfinite().all(), f"{name} rows {rows} not finite ({poisoned} of the middle sequence)"
            torch.testing.assert_close(grad[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2,
                                       msg=f"{name} rows {rows}")


@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_HEAD_DIMS)
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_a_non_finite_sequence_leaves_its_neighbours_outputs_alone(cuda_gen, kernel, head_dim, causal, value,
                                                                   poisoned):
    reason = kernel_unavailable(kernel, head_dim, "forward")
    if reason:
        pytest.skip(reason)
    cu_seqlens, clean = packed_inputs(cuda_gen, head_dim)

    def forward(tensors):
        return flash_cutlass.flash_forward_varlen(tensors["q"], tensors["k"], tensors["v"], cu_seqlens, cu_seqlens,
                                                  LONGEST, LONGEST, causal=causal, kernel=kernel)

    expected_out, expected_lse = forward(clean)
    out, lse = forward(poisoned_copy(clean, poisoned, value))
    for rows in NEIGHBOURS:
        assert out[rows].isfinite().all() and lse[:, rows].isfinite().all(), (
            f"rows {rows} not finite ({poisoned} of the middle sequence)")
        assert torch.equal(out[rows], expected_out[rows]) and torch.equal(lse[:, rows], expected_lse[:, rows])

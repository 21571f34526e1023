"""Sliding-window (local) attention: window_size=(left, right), alone and with causal.

CPU: the reference against an fp64 implementation whose mask is built element by element, and
the argument checks. GPU (skipped without one): both forward kernels and both backward kernels
against the fp32 oracle with FlashAttention-2's pass rule.
"""


import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import attention_forward, naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, check_kernels_against_oracle, check_reference_backward,
                     check_rejected_by_every_entry_point, cuda_inputs, explicit_attention_fp64, has_kernels,
                     make_qkv_fp64, over_compiled_kernels, requires_backward, requires_cuda)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}
# (left, right); -1 is unbounded. (0, 0) keeps only the diagonal.
WINDOWS = [(0, 0), (3, -1), (-1, 2), (5, 7), (20, 0), (40, 1000)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 60), (60, 17), (1, 33), (33, 1)])
@pytest.mark.parametrize("heads,heads_k", [(4, 4), (4, 1)])
def test_reference_forward_matches_explicit_mask(gen, causal, window, sq, sk, heads, heads_k):
    q, k, v = make_qkv_fp64(gen, sq, sk, heads, heads_k, 16)
    expected_out, expected_lse = explicit_attention_fp64(q, k, v, 0.3, causal, window)
    for block_size in (7, 128):
        out, lse = attention_forward(q, k, v, 0.3, causal, block_size=block_size, window_size=window)
        torch.testing.assert_close(out, expected_out, **FP64_TOL)
        torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    out, lse = naive_attention(q, k, v, 0.3, causal, compute_dtype=torch.float64, window_size=window)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 60)])  # every row keeps its diagonal key
def test_reference_backward_matches_autograd_of_explicit_mask(gen, causal, window, sq, sk):
    q, k, v = make_qkv_fp64(gen, sq, sk, 4, 2, 16)
    check_reference_backward(gen, q, k, v, 0.3, causal, {"window": window}, {"window_size": window})


def test_cpu_entry_points_take_window_size(gen):
    q, k, v = make_qkv_fp64(gen, 30, 50, 4, 2, 16, torch.bfloat16)
    out, lse = flash_cutlass.flash_forward(q, k, v, window_size=(4, 2))
    expected_out, expected_lse = explicit_attention_fp64(q.double(), k.double(), v.double(), 16**-0.5, False,
                                                         (4, 2))
    torch.testing.assert_close(out.double(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention(*leaves, window_size=(4, 2))
    dout = torch.randn(attended.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(attended, leaves, dout)
    expected = flash_cutlass.flash_backward(dout, q, k, v, out, lse, window_size=(4, 2))
    for grad, ref in zip(grads, expected):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("window,error,match", [
    ((-2, 0), ValueError, r"window_size entries must be >= -1"),
    ((0, -5), ValueError, r"window_size entries must be >= -1"),
    ((2**63, 2**63), ValueError, r"window_size entries must be below 2\^31"),
    ((0, 2**31), ValueError, r"window_size entries must be below 2\^31"),
    ((1, 2, 3), TypeError, r"window_size must be a \(left, right\) tuple of two ints"),
    ((1.0, 2), TypeError, r"window_size must be a \(left, right\) tuple of two ints"),
    ((True, 2), TypeError, r"window_size must be a \(left, right\) tuple of two ints"),
    (4, TypeError, r"window_size must be a \(left, right\) tuple of two ints"),
])
def test_bad_window_size_is_rejected_by_every_entry_point(window, error, match):
    check_rejected_by_every_entry_point(error, match, window_size=window)


# GPU: every compiled kernel and head dim, both dtypes, windows alone and with causal.
GPU_WINDOWS = [(0, 0), (17, -1), (-1, 33), (100, 5), (300, 0)]
GPU_SEQLENS = [(113, 255), (255, 113), (256, 256), (1023, 1023), (2049, 17), (1, 2049)]
HEADS = 8
WINDOW_COMPILED = has_kernels(flash_cutlass.compiled_window)
requires_window_kernels = pytest.mark.skipif(
    not WINDOW_COMPILED, reason="the sliding-window kernels were left out (FLASH_CUTLASS_WINDOW=0)")


@requires_cuda
@requires_window_kernels
@pytest.mark.parametrize("seqlen_q,seqlen_k", GPU_SEQLENS)
@pytest.mark.parametrize("window", GPU_WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@over_compiled_kernels
def test_forward_and_backward_match_oracle(cuda_gen, kernel, dtype, head_dim, causal, window, seqlen_q, seqlen_k):
    heads_k = 2 if (seqlen_q + seqlen_k) % 2 else HEADS  # GQA on some shapes
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, HEADS, heads_k, head_dim)
    check_kernels_against_oracle(kernel, q, k, v, dout, causal, window_size=window)


@requires_cuda
@requires_backward
@requires_window_kernels
def test_deterministic_backward_with_window_is_bitwise_reproducible(cuda_gen):
    dtype = COMPILED_DTYPES[-1]
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, 700, 900, HEADS, 2, COMPILED_HEAD_DIMS[0])
    out, lse = flash_cutlass.flash_forward(q, k, v, window_size=(64, 16))
    first = flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=True, window_size=(64, 16))
    second = flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=True, window_size=(64, 16))
    for name, a, b in zip("qkv", first, second):
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"


@requires_cuda
@pytest.mark.skipif(WINDOW_COMPILED, reason="this build has the sliding-window kernels")
def test_window_without_its_kernels_names_the_build_flag(cuda_gen):
    q, k, v, _ = cuda_inputs(cuda_gen, COMPILED_DTYPES[-1], 64, 64, HEADS, HEADS, COMPILED_HEAD_DIMS[0])
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_WINDOW=0"):
        flash_cutlass.flash_forward(q, k, v, window_size=(8, 0))
    # Windows that reach every key need no window kernel.
    flash_cutlass.flash_forward(q, k, v, causal=True, window_size=(100, 0))


@requires_cuda
def test_window_wider_than_the_sequence_equals_full_attention(cuda_gen):
    dtype = COMPILED_DTYPES[-1]
    q, k, v, _ = cuda_inputs(cuda_gen, dtype, 300, 300, HEADS, HEADS, COMPILED_HEAD_DIMS[-1])
    full = flash_cutlass.flash_forward(q, k, v)
    wide = flash_cutlass.flash_forward(q, k, v, window_size=(299, 299))
    causal = flash_cutlass.flash_forward(q, k, v, causal=True)
    causal_wide = flash_cutlass.flash_forward(q, k, v, causal=True, window_size=(5000, 7))
    # Windows that reach every key run the kernels without a window: bitwise the same results.
    for a, b in ((full, wide), (causal, causal_wide)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if WINDOW_COMPILED:
        # (unbounded, 0) without causal is the causal mask, computed by the window kernel.
        local = flash_cutlass.flash_forward(q, k, v, window_size=(5000, 0))
        torch.testing.assert_close(local[0], causal[0], atol=0, rtol=0)
        torch.testing.assert_close(local[1], causal[1], atol=0, rtol=0)

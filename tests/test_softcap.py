"""Soft-capped scores: softcap > 0 turns each scaled score s into softcap * tanh(s / softcap).

CPU: the reference against an fp64 implementation written out here, forward and gradients (by
autograd), alone and with causal and a window; the argument checks. GPU (skipped without one):
both forward kernels and both backward kernels against the fp32 oracle with FlashAttention-2's
pass rule.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import attention_forward, naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, check_kernels_against_oracle, check_reference_backward,
                     check_rejected_by_every_entry_point, cuda_inputs, explicit_attention_fp64, has_kernels,
                     make_qkv_fp64, over_compiled_kernels, requires_cuda)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2)), (True, (9, -1))])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 60), (60, 17)])
def test_reference_forward_matches_explicit_softcap(gen, softcap, causal, window, sq, sk):
    q, k, v = make_qkv_fp64(gen, sq, sk, 4, 2, 16, spread=3.0)
    expected_out, expected_lse = explicit_attention_fp64(q, k, v, 0.3, causal, window, softcap=softcap)
    for block_size in (7, 128):
        out, lse = attention_forward(q, k, v, 0.3, causal, block_size=block_size, window_size=window,
                                     softcap=softcap)
        torch.testing.assert_close(out, expected_out, **FP64_TOL)
        torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    out, lse = naive_attention(q, k, v, 0.3, causal, torch.float64, window_size=window, softcap=softcap)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)


@pytest.mark.parametrize("softcap", [0.5, 5.0])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (9, -1))])
def test_reference_backward_matches_autograd(gen, softcap, causal, window):
    q, k, v = make_qkv_fp64(gen, 17, 60, 4, 2, 16, spread=3.0)  # every row keeps its diagonal key
    check_reference_backward(gen, q, k, v, 0.3, causal, {"window": window, "softcap": softcap},
                             {"window_size": window, "softcap": softcap})


def test_cpu_entry_points_take_softcap(gen):
    q, k, v = make_qkv_fp64(gen, 30, 50, 4, 2, 16, torch.bfloat16, spread=3.0)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, softcap=2.0)
    expected_out, expected_lse = explicit_attention_fp64(q.double(), k.double(), v.double(), 16**-0.5, True,
                                                         softcap=2.0)
    torch.testing.assert_close(out.double(), expected_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention(*leaves, causal=True, softcap=2.0)
    dout = torch.randn(attended.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(attended, leaves, dout)
    expected = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, softcap=2.0)
    for grad, ref in zip(grads, expected):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("softcap,error,match", [
    (-1.0, ValueError, r"softcap must be finite and >= 0"),
    (math.inf, ValueError, r"softcap must be finite and >= 0"),
    (math.nan, ValueError, r"softcap must be finite and >= 0"),
    (3e38, ValueError, r"softcap must be at most 2\.359e\+38 \(times log2\(e\) it must stay a finite float32\)"),
    ("5", TypeError, r"softcap must be a float"),
    (True, TypeError, r"softcap must be a float"),
])
def test_bad_softcap_is_rejected_by_every_entry_point(softcap, error, match):
    check_rejected_by_every_entry_point(error, match, softcap=softcap)


# GPU: every compiled kernel and head dim, both dtypes, with causal and a window.
GPU_CASES = [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 5))]
GPU_SEQLENS = [(113, 255), (256, 256), (1023, 1023), (2049, 17)]
HEADS = 8
SOFTCAP_COMPILED = has_kernels(flash_cutlass.compiled_softcap)


@requires_cuda
@pytest.mark.skipif(not SOFTCAP_COMPILED, reason="the soft-capping kernels were left out")
@pytest.mark.parametrize("seqlen_q,seqlen_k", GPU_SEQLENS)
@pytest.mark.parametrize("causal,window", GPU_CASES)
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@over_compiled_kernels
def test_forward_and_backward_match_oracle(cuda_gen, kernel, dtype, head_dim, softcap, causal, window, seqlen_q,
                                           seqlen_k):
    heads_k = 2 if seqlen_q != seqlen_k else HEADS
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, HEADS, heads_k, head_dim, spread=3.0)
    check_kernels_against_oracle(kernel, q, k, v, dout, causal, window_size=window, softcap=softcap)


@requires_cuda
@pytest.mark.skipif(SOFTCAP_COMPILED, reason="this build has the soft-capping kernels")
def test_softcap_without_its_kernels_names_the_build_flag(cuda_gen):
    q = torch.randn(1, 64, 4, COMPILED_HEAD_DIMS[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_SOFTCAP=0"):
        flash_cutlass.flash_forward(q, q, q, softcap=5.0)

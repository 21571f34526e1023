"""ALiBi: alibi_slopes (fp32, (heads,) or (batch, heads)) adds -slope * |i + seqlen_k - seqlen_q - j|
to the score of query i and key j, after the soft cap and before any mask.

CPU: the reference against an fp64 implementation written out here, forward and gradients (by
autograd), with both slope shapes, causal, a window, a soft cap and GQA; the argument checks.
GPU (skipped without one): both forward kernels and both backward kernels against the fp32
oracle with FlashAttention-2's pass rule, alone and combined with causal, a window, a soft cap
and GQA.
"""


import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import attention_forward, naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, check_kernels_against_oracle, check_reference_backward,
                     check_rejected_by_every_entry_point, cuda_inputs, explicit_attention_fp64, has_kernels,
                     make_qkv_fp64, over_compiled_kernels, requires_cuda)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}


def make_slopes(gen, shape):
    """Positive slopes of the given shape, spread over two orders of magnitude."""
    return torch.exp2(-8 * torch.rand(shape, generator=gen)).float()


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (6, 2), 0.0), (True, (9, -1), 5.0), (False, (-1, -1), 2.0)])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 40), (40, 17)])
def test_reference_forward_matches_explicit_alibi(gen, slopes_shape, causal, window, softcap, sq, sk):
    q, k, v = make_qkv_fp64(gen, sq, sk, 4, 2, 16)
    slopes = make_slopes(gen, slopes_shape)
    expected_out, expected_lse = explicit_attention_fp64(q, k, v, 0.3, causal, window, softcap, slopes)
    options = {"window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    for block_size in (7, 128):
        out, lse = attention_forward(q, k, v, 0.3, causal, block_size=block_size, **options)
        torch.testing.assert_close(out, expected_out, **FP64_TOL)
        torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    out, lse = naive_attention(q, k, v, 0.3, causal, torch.float64, **options)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (9, -1), 5.0)])
def test_reference_backward_matches_autograd(gen, slopes_shape, causal, window, softcap):
    q, k, v = make_qkv_fp64(gen, 17, 40, 4, 2, 16)  # every row keeps its diagonal key
    slopes = make_slopes(gen, slopes_shape)
    check_reference_backward(gen, q, k, v, 0.3, causal,
                             {"window": window, "softcap": softcap, "alibi_slopes": slopes},
                             {"window_size": window, "softcap": softcap, "alibi_slopes": slopes})


def test_cpu_entry_points_take_alibi_slopes(gen):
    q, k, v = make_qkv_fp64(gen, 30, 50, 4, 2, 16, torch.bfloat16)
    slopes = make_slopes(gen, (2, 4))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, alibi_slopes=slopes)
    expected_out, expected_lse = explicit_attention_fp64(q.double(), k.double(), v.double(), 16**-0.5, True,
                                                         alibi_slopes=slopes)
    torch.testing.assert_close(out.double(), expected_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention(*leaves, causal=True, alibi_slopes=slopes)
    dout = torch.randn(attended.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(attended, leaves, dout)
    expected = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, alibi_slopes=slopes)
    for grad, ref in zip(grads, expected):
        torch.testing.assert_close(grad, ref)


def test_alibi_changes_the_result(gen):
    """Guards the tests above against a bias that is silently dropped."""
    q, k, v = make_qkv_fp64(gen, 20, 20, 4, 4, 16)
    plain, _ = attention_forward(q, k, v, 0.3, False)
    biased, _ = attention_forward(q, k, v, 0.3, False, alibi_slopes=torch.full((4,), 0.5))
    assert (plain - biased).abs().max() > 1e-2


@pytest.mark.parametrize("slopes,error,match", [
    ([0.5] * 2, TypeError, r"alibi_slopes must be a torch.Tensor or None, got list"),
    (torch.ones(2, dtype=torch.float64), TypeError, r"alibi_slopes must be float32, got torch.float64"),
    (torch.ones(2, dtype=torch.bfloat16), TypeError, r"alibi_slopes must be float32"),
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(heads,\) = \(2,\) or \(batch, heads\) = \(1, 2\)"),
    (torch.ones(2, 2), ValueError, r"alibi_slopes must have shape"),
    (torch.ones(1, 2, 1), ValueError, r"alibi_slopes must have shape"),
])
def test_bad_alibi_slopes_are_rejected_by_every_entry_point(slopes, error, match):
    check_rejected_by_every_entry_point(error, match, alibi_slopes=slopes)


# GPU: every compiled kernel and head dim, both dtypes, alone and with causal, a window, a soft
# cap; GQA where seqlen_q != seqlen_k; slopes per head or per (batch, head).
GPU_CASES = [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True), (False, (100, 5), 0.0, True),
             (True, (-1, -1), 30.0, False)]
GPU_SEQLENS = [(113, 255), (256, 256), (1023, 1023), (2049, 17)]
HEADS = 8
ALIBI_COMPILED = has_kernels(flash_cutlass.compiled_alibi)


@requires_cuda
@pytest.mark.skipif(not ALIBI_COMPILED, reason="ALiBi was left out of this build (FLASH_CUTLASS_ALIBI=0)")
@pytest.mark.parametrize("seqlen_q,seqlen_k", GPU_SEQLENS)
@pytest.mark.parametrize("causal,window,softcap,per_batch", GPU_CASES)
@over_compiled_kernels
def test_forward_and_backward_match_oracle(cuda_gen, kernel, dtype, head_dim, causal, window, softcap, per_batch,
                                           seqlen_q, seqlen_k):
    heads_k = 2 if seqlen_q != seqlen_k else HEADS
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, HEADS, heads_k, head_dim)
    batch = q.shape[0]
    # ALiBi's usual slopes 2^(-8 h / heads), per (batch, head) scaled differently per batch.
    slopes = torch.exp2(-8 * torch.arange(1, HEADS + 1, device="cuda") / HEADS)
    if per_batch:
        slopes = slopes * torch.arange(1, batch + 1, device="cuda").unsqueeze(1)
    check_kernels_against_oracle(kernel, q, k, v, dout, causal, window_size=window, softcap=softcap,
                                 alibi_slopes=slopes.float())


@requires_cuda
def test_alibi_slopes_on_another_device_are_rejected(cuda_gen):
    q = torch.randn(1, 64, 4, COMPILED_HEAD_DIMS[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    with pytest.raises(ValueError, match=r"alibi_slopes is on cpu but q is on cuda:0"):
        flash_cutlass.flash_forward(q, q, q, alibi_slopes=torch.ones(4))


@requires_cuda
@pytest.mark.skipif(ALIBI_COMPILED, reason="this build has ALiBi")
def test_alibi_without_its_kernels_names_the_build_flag(cuda_gen):
    q = torch.randn(1, 64, 4, COMPILED_HEAD_DIMS[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_ALIBI=0"):
        flash_cutlass.flash_forward(q, q, q, alibi_slopes=torch.ones(4, device="cuda"))

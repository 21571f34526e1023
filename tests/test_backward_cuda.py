"""The CUDA backward kernel against the fp32 oracle, with FlashAttention-2's pass rule.

Skipped (with the reason) where no CUDA GPU is visible.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import naive_attention
from helpers import fa2_check, requires_cuda

pytestmark = requires_cuda

try:
    COMPILED_HEAD_DIMS = flash_cutlass.compiled_head_dims()
    COMPILED_DTYPES = flash_cutlass.compiled_dtypes()
except RuntimeError:
    COMPILED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
    COMPILED_DTYPES = (torch.float16, torch.bfloat16)

HEADS = 8
SEQLENS = [(1, 1), (17, 17), (113, 255), (255, 113), (256, 256), (1023, 1023), (1, 2049), (2049, 17)]
GQA_HEADS_K = {"mha": HEADS, "gqa4": HEADS // 4, "mqa": 1}


def gradients(q, k, v, dout, scale, causal, compute_dtype):
    """Gradients of naive attention by autograd, computed in compute_dtype (None: the inputs')."""
    leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*leaves, scale, causal)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


@pytest.mark.parametrize("gqa", list(GQA_HEADS_K))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=["fp16", "bf16"])
def test_backward_matches_oracle(cuda_gen, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    if dtype not in COMPILED_DTYPES:
        pytest.skip(f"{dtype} was not compiled into this build (FLASH_CUTLASS_DTYPES)")
    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    q = rand(batch, seqlen_q, HEADS, head_dim)
    k, v = rand(batch, seqlen_k, GQA_HEADS_K[gqa], head_dim), rand(batch, seqlen_k, GQA_HEADS_K[gqa], head_dim)
    dout = rand(batch, seqlen_q, HEADS, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel="sm80")
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal)
    oracle = gradients(q, k, v, dout, scale, causal, torch.float32)
    same_dtype = gradients(q, k, v, dout, scale, causal, None)
    for name, grad, ref, base, t in zip("qkv", grads, oracle, same_dtype, (q, k, v)):
        assert grad.shape == t.shape and grad.dtype == t.dtype, f"d{name}"
        fa2_check(grad, ref, base, f"d{name}")


def test_autograd_matches_flash_backward(cuda_gen):
    head_dim = COMPILED_HEAD_DIMS[-1]
    dtype = COMPILED_DTYPES[-1]
    q, k, v = (torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype).requires_grad_()
               for _ in range(3))
    out = flash_cutlass.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    out2, lse = flash_cutlass.flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
    expected = flash_cutlass.flash_backward(dout, q.detach(), k.detach(), v.detach(), out2, lse, causal=True)
    for leaf, grad in zip((q, k, v), expected):
        torch.testing.assert_close(leaf.grad, grad, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
def test_deterministic_mode_is_bitwise_reproducible_and_correct(cuda_gen, head_dim, causal):
    dtype = COMPILED_DTYPES[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    q, k, v = rand(2, 777, 8, head_dim), rand(2, 1023, 2, head_dim), rand(2, 1023, 2, head_dim)
    dout = rand(2, 777, 8, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
    first = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    second = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two deterministic runs differ"
    scale = head_dim ** -0.5
    oracle = gradients(q, k, v, dout, scale, causal, torch.float32)
    same_dtype = gradients(q, k, v, dout, scale, causal, None)
    for name, grad, ref, base in zip("qkv", first, oracle, same_dtype):
        fa2_check(grad, ref, base, f"deterministic d{name}")

"""Dropout: dropout_p > 0 drops each attention probability with probability p (a Philox mask drawn
from a (seed, offset) rng_state) and scales the kept ones by 1 / (1 - p).

CPU: Philox4x32-10 against its published known answers; the reference's mask (keep rate, and
that it depends on seed, offset, batch, head, row and column); the reference forward and backward
against an fp64 implementation written out here with the same mask; the entry points (rng_state
returned and reused, generators reproduce); bad input. GPU (skipped without one): the mask each
kernel applies, read back through one-hot values, equals the reference's, in the forward and in
the backward; forward and gradients against the fp32 oracle with the same mask, with causal, a
window, ALiBi, a soft cap and GQA; bitwise reproduction from the same generator state.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import attention_forward, dropout_keep_mask, naive_attention, philox4x32_10
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, check_kernels_against_oracle, check_reference_backward,
                     check_rejected_by_every_entry_point, cuda_inputs, explicit_attention_fp64, has_kernels,
                     kernel_unavailable, make_qkv_fp64, over_compiled_kernels, requires_backward, requires_cuda)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}


def state(seed, offset=0):
    return torch.tensor([seed, offset], dtype=torch.int64)


# Philox4x32-10 known-answer vectors (counter, key, output) of the Random123 distribution.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_matches_known_answers(counter, key, expected):
    words = philox4x32_10(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(dropout_p):
    keep = dropout_keep_mask(state(1234, 8), dropout_p, 2, 4, 128, 0, 256)
    n = keep.numel()
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / n)
    assert abs(keep.float().mean().item() - (1 - dropout_p)) < 5 * sigma


def test_mask_depends_on_seed_offset_and_position():
    base = dropout_keep_mask(state(7, 0), 0.5, 2, 2, 64, 0, 64)
    assert torch.equal(base, dropout_keep_mask(state(7, 0), 0.5, 2, 2, 64, 0, 64))
    assert not torch.equal(base, dropout_keep_mask(state(8, 0), 0.5, 2, 2, 64, 0, 64))
    assert not torch.equal(base, dropout_keep_mask(state(7, 4), 0.5, 2, 2, 64, 0, 64))
    assert not torch.equal(base[0, 0], base[0, 1]) and not torch.equal(base[0, 0], base[1, 0])
    # A block of keys is the same slice of the whole mask (the kernels tile the keys).
    assert torch.equal(base[..., 16:48], dropout_keep_mask(state(7, 0), 0.5, 2, 2, 64, 16, 48))


@pytest.mark.parametrize("dropout_p", [0.17, 0.6])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 40), (40, 17)])
def test_reference_forward_matches_explicit_dropout(gen, dropout_p, causal, window, sq, sk):
    q, k, v = make_qkv_fp64(gen, sq, sk, 4, 2, 16)
    rng_state = state(99, 12)
    keep = dropout_keep_mask(rng_state, dropout_p, 2, 4, sq, 0, sk)
    expected_out, expected_lse = explicit_attention_fp64(q, k, v, 0.3, causal, window, dropout_keep=keep,
                                                                 dropout_p=dropout_p)
    options = {"window_size": window, "dropout_p": dropout_p, "rng_state": rng_state}
    for block_size in (7, 128):
        out, lse = attention_forward(q, k, v, 0.3, causal, block_size=block_size, **options)
        torch.testing.assert_close(out, expected_out, **FP64_TOL)
        torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    out, lse = naive_attention(q, k, v, 0.3, causal, torch.float64, **options)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (9, -1))])
def test_reference_backward_matches_autograd(gen, causal, window):
    q, k, v = make_qkv_fp64(gen, 17, 40, 4, 2, 16)
    rng_state, dropout_p = state(5, 4), 0.3
    keep = dropout_keep_mask(rng_state, dropout_p, 2, 4, 17, 0, 40)
    check_reference_backward(gen, q, k, v, 0.3, causal,
                             {"window": window, "dropout_keep": keep, "dropout_p": dropout_p},
                             {"window_size": window, "dropout_p": dropout_p, "rng_state": rng_state})


def test_cpu_entry_points_return_and_reuse_rng_state(gen):
    q, k, v = make_qkv_fp64(gen, 30, 50, 4, 2, 16, torch.bfloat16)
    out, lse, rng_state = flash_cutlass.flash_forward(q, k, v, causal=True, dropout_p=0.2,
                                                      generator=torch.Generator().manual_seed(3))
    again, _, same_state = flash_cutlass.flash_forward(q, k, v, causal=True, dropout_p=0.2,
                                                       generator=torch.Generator().manual_seed(3))
    assert torch.equal(rng_state, same_state) and torch.equal(out, again)
    replayed, _, _ = flash_cutlass.flash_forward(q, k, v, causal=True, dropout_p=0.2, rng_state=rng_state)
    assert torch.equal(out, replayed)
    other, _, _ = flash_cutlass.flash_forward(q, k, v, causal=True, dropout_p=0.2,
                                              generator=torch.Generator().manual_seed(4))
    assert not torch.equal(out, other)
    plain_out, plain_lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    torch.testing.assert_close(lse, plain_lse)  # dropout leaves the log-sum-exp alone

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention(*leaves, causal=True, dropout_p=0.2,
                                             generator=torch.Generator().manual_seed(3))
    assert torch.equal(attended, out)
    dout = torch.randn(attended.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(attended, leaves, dout)
    expected = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, dropout_p=0.2, rng_state=rng_state)
    for grad, ref in zip(grads, expected):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("dropout_p,error,match", [
    (-0.1, ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    (1.0, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (math.nan, ValueError, r"dropout_p must be in \[0, 1\)"),
    ("0.1", TypeError, r"dropout_p must be a float, got str"),
    (True, TypeError, r"dropout_p must be a float, got bool"),
])
def test_bad_dropout_p_is_rejected_by_every_entry_point(dropout_p, error, match):
    check_rejected_by_every_entry_point(error, match, backward_options={"rng_state": state(1)}, dropout_p=dropout_p)


@pytest.mark.parametrize("rng_state,error,match", [
    ([1, 2], TypeError, r"rng_state must be a torch.Tensor or None, got list"),
    (torch.tensor([1, 2], dtype=torch.int32), ValueError, r"rng_state must be an int64 CPU tensor of 2 elements"),
    (torch.tensor([1, 2, 3]), ValueError, r"rng_state must be an int64 CPU tensor of 2 elements"),
])
def test_bad_rng_state_is_rejected(rng_state, error, match):
    check_rejected_by_every_entry_point(error, match, dropout_p=0.1, rng_state=rng_state)


def test_backward_with_dropout_needs_rng_state_and_forward_one_source():
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward(q, q, q)
    with pytest.raises(ValueError, match=r"dropout_p > 0 needs rng_state"):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"pass generator or rng_state, not both"):
        flash_cutlass.flash_forward(q, q, q, dropout_p=0.1, generator=torch.Generator(), rng_state=state(1))
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None, got int"):
        flash_cutlass.flash_forward(q, q, q, dropout_p=0.1, generator=3)


# GPU ----------------------------------------------------------------------------------------


DROPOUT_COMPILED = has_kernels(flash_cutlass.compiled_dropout)
requires_dropout = pytest.mark.skipif(not DROPOUT_COMPILED,
                                      reason="dropout was left out of this build (FLASH_CUTLASS_DROPOUT=0)")


@requires_cuda
@requires_backward
@requires_dropout
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_kernel_masks_equal_the_reference_mask(kernel, dtype):
    """With q = k = 0 every probability is 1 / seqlen_k; with one-hot values the forward's out[i, j]
    is keep[i, j] / ((1 - p) seqlen_k), and with one-hot output gradients the backward's dv[j, i]
    is the same: both masks read back whole."""
    if dtype not in COMPILED_DTYPES:
        pytest.skip(f"{dtype} was not compiled into this build")
    head_dim = max(COMPILED_HEAD_DIMS)
    if head_dim < 128:
        pytest.skip("needs a compiled head dim of at least 128")
    batch, heads, sq, sk, dropout_p = 2, 3, 96, 112, 0.4
    q = torch.zeros(batch, sq, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.zeros(batch, sk, heads, head_dim, device="cuda", dtype=dtype)
    v = torch.eye(sk, head_dim, device="cuda", dtype=dtype).expand(batch, heads, sk, head_dim).transpose(1, 2)
    rng_state = state(2024, 36)
    expected = dropout_keep_mask(rng_state, dropout_p, batch, heads, sq, 0, sk, "cuda")
    forward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "forward") else kernel
    out, lse, _ = flash_cutlass.flash_forward(q, k, v.contiguous(), kernel=forward_kernel, dropout_p=dropout_p,
                                              rng_state=rng_state)
    forward_mask = out[..., :sk].transpose(1, 2) > 0  # (batch, heads, sq, sk)
    assert torch.equal(forward_mask, expected), f"{forward_kernel} forward: {(forward_mask != expected).sum()} bits differ"
    kept_value = out.float().max().item()
    assert kept_value == pytest.approx(1 / ((1 - dropout_p) * sk), rel=1e-2)

    backward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "backward") else kernel
    dout = torch.eye(sq, head_dim, device="cuda", dtype=dtype).expand(batch, heads, sq, head_dim).transpose(1, 2)
    _, _, dv = flash_cutlass.flash_backward(dout.contiguous(), q, k, v.contiguous(), out, lse, kernel=backward_kernel,
                                            dropout_p=dropout_p, rng_state=rng_state)
    backward_mask = dv[..., :sq].permute(0, 2, 3, 1) > 0  # dv[b, j, h, i] -> (batch, heads, sq, sk)
    assert torch.equal(backward_mask, expected), f"{backward_kernel} backward: {(backward_mask != expected).sum()} differ"
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / expected.numel())
    assert abs(forward_mask.float().mean().item() - (1 - dropout_p)) < 5 * sigma


GPU_CASES = [
    # causal, window, options
    (False, (-1, -1), {}),
    (True, (-1, -1), {}),
    (False, (100, 5), {"alibi": True}),
    (True, (-1, -1), {"softcap": 30.0}),
]
GPU_SEQLENS = [(113, 255), (256, 256), (1023, 1023), (2049, 17)]
HEADS = 8


@requires_cuda
@requires_dropout
@pytest.mark.parametrize("seqlen_q,seqlen_k", GPU_SEQLENS)
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@over_compiled_kernels
def test_forward_and_backward_match_oracle(cuda_gen, kernel, dtype, head_dim, case, seqlen_q, seqlen_k):
    causal, window, extra = GPU_CASES[case]
    heads_k = 2 if seqlen_q != seqlen_k else HEADS
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, HEADS, heads_k, head_dim)
    options = {"window_size": window, "dropout_p": 0.17, "rng_state": state(31337 + case, 4 * seqlen_q)}
    if extra.get("alibi"):
        options["alibi_slopes"] = torch.exp2(-8 * torch.arange(1, HEADS + 1, device="cuda") / HEADS).float()
    if "softcap" in extra:
        options["softcap"] = extra["softcap"]
    check_kernels_against_oracle(kernel, q, k, v, dout, causal, **options)


@requires_cuda
@requires_backward
@requires_dropout
def test_same_generator_state_reproduces_bitwise(cuda_gen):
    dtype = COMPILED_DTYPES[-1]
    head_dim = COMPILED_HEAD_DIMS[0]
    q, k, v = (torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype)

    def run(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        out = flash_cutlass.flash_attention(q, k, v, causal=True, dropout_p=0.3, generator=generator,
                                            deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    first, second, other = run(11), run(11), run(12)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


@requires_cuda
@requires_dropout
def test_default_generator_advances_between_calls(cuda_gen):
    q = torch.randn(1, 128, 2, COMPILED_HEAD_DIMS[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    torch.cuda.manual_seed(5)
    first = flash_cutlass.flash_forward(q, q, q, dropout_p=0.5)
    second = flash_cutlass.flash_forward(q, q, q, dropout_p=0.5)
    assert not torch.equal(first[2], second[2]) and not torch.equal(first[0], second[0])
    torch.cuda.manual_seed(5)
    replay = flash_cutlass.flash_forward(q, q, q, dropout_p=0.5)
    assert torch.equal(replay[2], first[2]) and torch.equal(replay[0], first[0])


@requires_cuda
@pytest.mark.skipif(DROPOUT_COMPILED, reason="this build has dropout")
def test_dropout_without_its_kernels_names_the_build_flag(cuda_gen):
    q = torch.randn(1, 64, 4, COMPILED_HEAD_DIMS[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_DROPOUT=0"):
        flash_cutlass.flash_forward(q, q, q, dropout_p=0.1)

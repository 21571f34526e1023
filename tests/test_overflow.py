"""Extreme but finite inputs (issue 28): softmax_scale=1e30, ALiBi slopes of 1e30, q and k of magnitude
3e17 in bf16, and query rows of such magnitudes mixed with ordinary ones. Attention in fp32 is finite
for all of them; the kernels' outputs, log-sum-exp and gradients must be too, and match attention in
fp64. NaN and Inf inputs still spread as in PyTorch's scaled_dot_product_attention: a NaN or an Inf in
query row i makes output row i NaN and no other.

These softmaxes are one-hot (one ulp of the scores is worth more than e^100), so each output row is
the value row of the largest score. Rows whose two largest scores lie within 1e-3 of each other
(relative) are left out of the comparisons: fp32 cannot resolve them (the kernels accumulate q.k in
fp32, in another order than the oracle), and the backward's P, recomputed from the rounded
log-sum-exp, spreads over scores that close (common/softmax.h, probability_exponent). Their outputs
must still be finite; their dout is zeroed so that they add nothing to the gradients compared.

CPU: the public API on CPU tensors (the reference path). GPU (skipped without one): both kernels,
forward and backward, every compiled head dim.
"""


import pytest
import torch
import torch.nn.functional as F

import flash_cutlass
from flash_cutlass.reference import alibi_bias, keep_mask, naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, has_kernels, kernel_unavailable, requires_backward,
                     requires_cuda)

HEADS = 2
# Query row magnitudes of the mixed case, one each in turn: ordinary rows next to extreme ones, in
# every tile.
MIXED_ROW_SCALES = (1.0, 1e12, 3e17)
CASES = ("scale_1e30", "alibi_1e30", "magnitude_3e17", "mixed")
ALIBI_COMPILED = has_kernels(flash_cutlass.compiled_alibi)


def make_case(case, gen, batch, seqlen_q, seqlen_k, head_dim, dtype):
    """q, k, v, dout (batch, seqlen, HEADS, head_dim) on gen's device and the call's options
    (softmax_scale and alibi_slopes)."""
    device = gen.device

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q, k = rand(batch, seqlen_q, HEADS, head_dim), rand(batch, seqlen_k, HEADS, head_dim)
    v, dout = rand(batch, seqlen_k, HEADS, head_dim), rand(batch, seqlen_q, HEADS, head_dim)
    options = {"softmax_scale": head_dim**-0.5, "alibi_slopes": None}
    if case == "scale_1e30":
        options["softmax_scale"] = 1e30
    elif case == "alibi_1e30":
        options["alibi_slopes"] = torch.full((HEADS,), 1e30, device=device)
    elif case == "magnitude_3e17":
        q, k = q * 3e17, k * 3e17
    elif case == "mixed":
        scales = torch.tensor(MIXED_ROW_SCALES, device=device)
        q = q * scales[torch.arange(seqlen_q, device=device) % len(MIXED_ROW_SCALES)].view(1, -1, 1, 1)
    else:
        raise ValueError(case)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype), options


def ordinary_rows(case, seqlen_q, device):
    """(seqlen_q,) bool: the query rows whose dq means something to compare. Elsewhere a one-hot P
    leaves dS = P (dP - D) at fp32's rounding noise of dP - D, which softmax_scale = 1e30 or keys of
    3e17 blow up (the oracle's is exactly 0); those rows are only checked to be finite."""
    rows = torch.arange(seqlen_q, device=device)
    if case == "alibi_1e30":
        return torch.ones(seqlen_q, dtype=torch.bool, device=device)
    if case == "mixed":
        return rows % len(MIXED_ROW_SCALES) == 0
    return torch.zeros(seqlen_q, dtype=torch.bool, device=device)


def decided_rows(q, k, causal, softmax_scale, alibi_slopes):
    """(batch, seqlen_q, heads) bool: the rows whose two largest scores (fp64) differ by 1e-3 of the
    largest or more, or that see fewer than two keys."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * softmax_scale
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, 0, seqlen_k, torch.float64)
    keep = keep_mask(seqlen_q, seqlen_k, causal, device=q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.topk(2, dim=-1).values
    close = (top[..., 0] - top[..., 1]) < 1e-3 * top[..., 0].abs()  # False for NaN (-inf - -inf)
    return (~close).transpose(1, 2)


# The LSE's error allowed: 1e-5 of it, or, where q.k cancels, the scores' own error: sums of q.k
# in fp32 (on the tensor cores, which align each step's products to the largest) are off by up to
# about head_dim 2^-23 of the sum of |q_d k_d| (score_magnitude), far above the score itself in a
# row whose q.k nearly cancels (a causal row that sees one key: 5e-5 of its LSE on the H200).
def allowed_lse_error(expected_lse, magnitude, head_dim):
    return 1e-3 + torch.maximum(1e-5 * expected_lse.abs(), 4 * head_dim * 2.0**-24 * magnitude)


def score_magnitude(q, k, causal, softmax_scale, alibi_slopes):
    """(batch, heads, seqlen_q), lse's layout: per query row, the largest over the keys it sees of
    softmax_scale * sum_d |q_d k_d| + |ALiBi bias|, in fp64."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    magnitude = torch.einsum("bqhd,bkhd->bhqk", q.double().abs(), k.double().abs()) * softmax_scale
    if alibi_slopes is not None:
        magnitude = magnitude + alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, 0, seqlen_k, torch.float64).abs()
    keep = keep_mask(seqlen_q, seqlen_k, causal, device=q.device)
    if keep is not None:
        magnitude = magnitude.masked_fill(~keep, 0.0)
    return magnitude.amax(dim=-1)


def oracle(q, k, v, dout, causal, softmax_scale, alibi_slopes):
    """out, lse and (dq, dk, dv) of attention in fp64 (reference.naive_attention), from the same
    inputs; first checks the premise that attention in fp32 is finite."""
    out32, lse32 = naive_attention(q, k, v, softmax_scale, causal, torch.float32, alibi_slopes=alibi_slopes)
    assert out32.isfinite().all() and not lse32.isnan().any() and (lse32 != float("inf")).all()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = naive_attention(*leaves, softmax_scale, causal, torch.float64, alibi_slopes=alibi_slopes)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), lse.detach(), grads


def check_forward(name, out, lse, expected_out, expected_lse, lse_magnitude, decided):
    assert out.isfinite().all(), f"{name}: out is not finite at {int((~out.isfinite()).sum())} position(s)"
    finite = expected_lse.isfinite()
    assert lse[finite].isfinite().all(), f"{name}: lse is not finite where the oracle's is"
    assert (lse[~finite] == expected_lse[~finite]).all(), f"{name}: lse differs where the oracle's is -inf"
    error = (lse[finite].double() - expected_lse[finite]).abs()
    allowed = allowed_lse_error(expected_lse[finite], lse_magnitude[finite], out.shape[-1])
    worst = int((error / allowed).argmax()) if error.numel() else 0
    assert (error <= allowed).all(), (
        f"{name} lse: {int((error > allowed).sum())} of {error.numel()} off by more than allowed; worst "
        f"{float(error[worst]):.6g} (allowed {float(allowed[worst]):.6g}) at {float(expected_lse[finite][worst]):.6g}")
    torch.testing.assert_close(out.double()[decided], expected_out[decided], atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"{name} out: {m}")


def check_gradients(name, grads, expected, ordinary):
    """Every gradient finite; dv against the oracle, and dq on the ordinary rows (and dk where every
    row is ordinary), to 2% of the largest value."""
    for letter, grad in zip("qkv", grads):
        assert grad.isfinite().all(), f"{name}: d{letter} is not finite at {int((~grad.isfinite()).sum())} position(s)"
    dq, dk, dv = grads
    expected_dq, expected_dk, expected_dv = expected
    pairs = [("dv", dv, expected_dv), ("dq", dq[:, ordinary], expected_dq[:, ordinary])]
    if ordinary.all():
        pairs.append(("dk", dk, expected_dk))
    for letter, grad, ref in pairs:
        if ref.numel():
            atol = 2e-2 * (float(ref.abs().max()) + 1.0)
            torch.testing.assert_close(grad.double(), ref, atol=atol, rtol=2e-2, msg=lambda m: f"{name} {letter}: {m}")


def run_case(name, case, gen, batch, seqlen_q, seqlen_k, head_dim, dtype, causal, forward, backward=None):
    """forward(q, k, v, options) -> (out, lse); backward(dout, q, k, v, out, lse, options) -> grads."""
    q, k, v, dout, options = make_case(case, gen, batch, seqlen_q, seqlen_k, head_dim, dtype)
    decided = decided_rows(q, k, causal, **options)
    dout = dout * decided.unsqueeze(-1).to(dout.dtype)
    expected_out, expected_lse, expected_grads = oracle(q, k, v, dout, causal, **options)
    out, lse = forward(q, k, v, options)
    check_forward(name, out, lse, expected_out, expected_lse, score_magnitude(q, k, causal, **options), decided)
    if backward is not None:
        grads = backward(dout, q, k, v, out, lse, options)
        check_gradients(name, grads, expected_grads, ordinary_rows(case, seqlen_q, q.device))


def skip_unless_compiled(case, dtype):
    if case == "alibi_1e30" and not ALIBI_COMPILED:
        pytest.skip("ALiBi was left out of this build (FLASH_CUTLASS_ALIBI=0)")
    if dtype not in COMPILED_DTYPES:
        pytest.skip(f"{dtype} was not compiled into this build (FLASH_CUTLASS_DTYPES)")


# (seqlen_q, seqlen_k): several key blocks, tails; with ALiBi, 300 queries on 200 keys leave the first
# 100 rows without a key at distance 0, whose scores are all of order -1e31 (-inf for them when causal).
SEQLENS = {"scale_1e30": (257, 640), "alibi_1e30": (300, 200), "magnitude_3e17": (640, 333), "mixed": (384, 384)}


# CPU: the public API (the reference's tiled forward and backward).

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_cpu_api_is_finite_and_matches_fp64(gen, case, causal):
    seqlen_q, seqlen_k = (150, 100) if case == "alibi_1e30" else (130, 200)

    def forward(q, k, v, options):
        return flash_cutlass.flash_forward(q, k, v, causal=causal, **options)

    def backward(dout, q, k, v, out, lse, options):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attended = flash_cutlass.flash_attention(*leaves, causal=causal, **options)
        return torch.autograd.grad(attended, leaves, dout)

    run_case(f"cpu {case}", case, gen, 1, seqlen_q, seqlen_k, 32, torch.bfloat16, causal, forward, backward)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cpu_api_keeps_a_non_finite_query_row_to_itself(gen, value):
    q, k, v = (torch.randn(1, 40, HEADS, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    q[0, 7, 1, 3] = value
    out, lse = flash_cutlass.flash_forward(q, k, v)
    expected = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out[0, 7, 1].isnan().all() and out.isnan().sum() == out.shape[-1]


# GPU: both kernels, every compiled head dim.

def flash_forward_of(kernel, causal):
    def forward(q, k, v, options):
        return flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=kernel, **options)

    return forward


@requires_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_forward_is_finite_and_matches_fp64(cuda_gen, kernel, head_dim, dtype, case, causal):
    if dtype == torch.float16 and case in ("magnitude_3e17", "mixed"):
        pytest.skip("3e17 is past fp16's range")
    skip_unless_compiled(case, dtype)
    reason = kernel_unavailable(kernel, head_dim, "forward")
    if reason:
        pytest.skip(reason)
    seqlen_q, seqlen_k = SEQLENS[case]
    run_case(f"{kernel} forward {case}", case, cuda_gen, 2, seqlen_q, seqlen_k, head_dim, dtype, causal,
             flash_forward_of(kernel, causal))


@requires_cuda
@requires_backward
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_backward_is_finite_and_matches_fp64(cuda_gen, kernel, head_dim, case, causal, deterministic):
    # bf16 only: the gradients of softmax_scale = 1e30 are past fp16's range (so is 3e17).
    skip_unless_compiled(case, torch.bfloat16)
    reason = kernel_unavailable(kernel, head_dim, "backward")
    if reason:
        pytest.skip(reason)
    # The forward of the kernel's path where it has one at this head dim (its out and lse feed the
    # backward).
    forward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "forward") else kernel

    def backward(dout, q, k, v, out, lse, options):
        return flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel,
                                            deterministic=deterministic, **options)

    seqlen_q, seqlen_k = SEQLENS[case]
    run_case(f"{kernel} backward {case}", case, cuda_gen, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, causal,
             flash_forward_of(forward_kernel, causal), backward)


@requires_cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_a_non_finite_query_row_stays_in_its_row(cuda_gen, kernel, head_dim, causal, value):
    """One element of query row 70 (batch 1, head 1) NaN or +-Inf: that output row is NaN, as in
    SDPA; every other row is finite and as without it. In the backward, dq of every other row too."""
    reason = kernel_unavailable(kernel, head_dim, "forward")
    if reason:
        pytest.skip(reason)
    dtype = COMPILED_DTYPES[-1]
    q, k, v = (torch.randn(2, 300, HEADS, head_dim, generator=cuda_gen, device="cuda").to(dtype) for _ in range(3))
    dout = torch.randn(q.shape, generator=cuda_gen, device="cuda").to(dtype)
    poisoned = q.clone()
    poisoned[1, 70, 1, head_dim // 2] = value

    clean_out, clean_lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=kernel)
    out, lse = flash_cutlass.flash_forward(poisoned, k, v, causal=causal, kernel=kernel)
    expected = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (poisoned, k, v)),
                                              is_causal=causal).transpose(1, 2)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out[1, 70, 1].isnan().all() and int(out.isnan().sum()) == head_dim
    others = torch.ones(out.shape[:3], dtype=torch.bool, device="cuda")
    others[1, 70, 1] = False
    torch.testing.assert_close(out[others].float(), clean_out[others].float(), atol=1e-2, rtol=1e-2)
    assert lse.transpose(1, 2)[1, 70, 1].isnan()
    torch.testing.assert_close(lse.transpose(1, 2)[others], clean_lse.transpose(1, 2)[others], atol=1e-4, rtol=1e-4)

    if kernel_unavailable(kernel, head_dim, "backward"):
        return
    clean_dq = flash_cutlass.flash_backward(dout, q, k, v, clean_out, clean_lse, causal=causal, kernel=kernel)[0]
    dq = flash_cutlass.flash_backward(dout, poisoned, k, v, out, lse, causal=causal, kernel=kernel)[0]
    assert dq[others].isfinite().all()
    torch.testing.assert_close(dq[others].float(), clean_dq[others].float(), atol=2e-2, rtol=2e-2)

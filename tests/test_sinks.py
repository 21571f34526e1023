"""Attention sinks: sinks (heads,) join every row's softmax as one more logit that attends to no
value (gpt-oss), so lse = log(exp(sink) + sum_j exp(score_j)) and out = sum_j exp(score_j - lse) v_j.

CPU: the reference (tiled and naive) against an fp64 implementation written out here (the sink as
one more column of the scores), forward and gradients (by autograd, the sinks' own included), with
causal masks, windows, a soft cap, ALiBi, GQA and rows that see no key; reference.fold_sinks_into (what
ring attention applies to its merged out and lse) against the reference's own sinks in both
layouts; the entry points (flash_forward / flash_backward / flash_attention, their variable-length
forms, torch.compile, the KV cache) with sinks; a sink of -inf is no sink; dropout; bad sinks
rejected before any work. GPU (skipped without one): every compiled kernel and head dim against the
fp32 oracle with FlashAttention-2's rule, dsinks included; variable-length calls; sinks in fp32 and
in bf16.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass import reference
from flash_cutlass.reference import (attention_backward, attention_forward, fold_sinks_into, naive_attention,
                                     sinks_gradient)
from helpers import (check_gradients_against_oracle, check_kernels_against_oracle, check_rejected_by_every_entry_point,
                     check_sinks_gradient, cuda_inputs, options_left_out,
                     explicit_attention_fp64, fa2_check, kernel_unavailable, make_qkv_fp64, over_compiled_kernels,
                     requires_backward, requires_cuda)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}
HEADS = 4


def make_sinks(gen, heads=HEADS, dtype=torch.float64):
    """Sinks spread around the scores' log-sum-exps (a few units), so that they matter."""
    return (2 * torch.randn(heads, generator=gen, dtype=torch.float64) + 1).to(dtype)


def oracle_with_grads(gen, q, k, v, sinks, scale, causal, **oracle_options):
    """explicit_attention_fp64's out and lse, a dout, and the gradients of q, k, v and sinks."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = explicit_attention_fp64(*leaves[:3], scale, causal, sinks=leaves[3], **oracle_options)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return out.detach(), lse.detach(), dout, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal,window,softcap,alibi", [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False),
                                                         (False, (6, 2), 0.0, False), (True, (9, -1), 5.0, True),
                                                         (False, (-1, -1), 2.0, True)])
@pytest.mark.parametrize("sq,sk", [(17, 17), (17, 40), (40, 17)])
def test_reference_matches_explicit_fp64(gen, causal, window, softcap, alibi, sq, sk):
    """Forward (tiled at two block sizes, and naive) and backward: dq, dk, dv from the lse that holds
    the sinks, dsinks from sinks_gradient. (40, 17) causal has rows that see no key: out 0, lse the
    sink's."""
    q, k, v = make_qkv_fp64(gen, sq, sk, HEADS, 2, 16)
    sinks = make_sinks(gen)
    slopes = torch.exp2(-4 * torch.rand(HEADS, generator=gen)).float() if alibi else None
    expected_out, expected_lse, dout, expected_grads = oracle_with_grads(
        gen, q, k, v, sinks, 0.3, causal, window=window, softcap=softcap, alibi_slopes=slopes)
    options = {"window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    for block_size in (7, 128):
        out, lse = attention_forward(q, k, v, 0.3, causal, block_size=block_size, sinks=sinks, **options)
        torch.testing.assert_close(out, expected_out, **FP64_TOL)
        torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    out, lse = naive_attention(q, k, v, 0.3, causal, torch.float64, sinks=sinks, **options)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)
    grads = attention_backward(dout, q, k, v, out, lse, 0.3, causal, block_size=16, **options)
    grads = (*grads, sinks_gradient(dout, out, lse, sinks))
    for name, grad, expected in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        torch.testing.assert_close(grad, expected, **FP64_TOL, msg=lambda m: f"{name}: {m}")
    if causal and sq > sk:
        seen_nothing = slice(0, sq - sk)
        assert torch.equal(out[:, seen_nothing], torch.zeros_like(out[:, seen_nothing]))
        assert torch.equal(lse[:, :, seen_nothing], sinks.view(1, -1, 1).expand_as(lse[:, :, seen_nothing]))


def test_sinks_change_the_result_and_minus_infinity_is_no_sink(gen):
    """Guards the tests above against sinks silently dropped."""
    q, k, v = make_qkv_fp64(gen, 20, 20, HEADS, HEADS, 16)
    plain_out, plain_lse = attention_forward(q, k, v, 0.3, True)
    sunk_out, sunk_lse = attention_forward(q, k, v, 0.3, True, sinks=torch.full((HEADS,), 2.0, dtype=torch.float64))
    assert (plain_out - sunk_out).abs().max() > 1e-2 and (sunk_lse > plain_lse).all()
    none_out, none_lse = attention_forward(q, k, v, 0.3, True, sinks=torch.full((HEADS,), -math.inf))
    assert torch.equal(none_out, plain_out) and torch.equal(none_lse, plain_lse)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(sinks_gradient(dout, none_out, none_lse, torch.full((HEADS,), -math.inf)),
                       torch.zeros(HEADS, dtype=torch.float32))
    # Folded into a result with rows that see no key (out 0, lse -inf): they stay so, no NaN.
    out, lse = attention_forward(q[:, :20], k[:, :5], v[:, :5], 0.3, True)
    folded_out = out.clone()
    folded_lse = fold_sinks_into(folded_out, lse, torch.full((HEADS,), -math.inf))
    assert torch.equal(folded_out, out) and torch.equal(folded_lse, lse) and torch.isneginf(lse).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fold_sinks_into_equals_the_reference_with_sinks(gen, dtype):
    """What ring attention does (a merged out and lse, then fold_sinks_into) against the reference's own
    sinks, in both layouts; in bfloat16 out is rounded twice there, once here: one unit of its last
    place apart at most."""
    q, k, v = make_qkv_fp64(gen, 40, 17, HEADS, 2, 16, dtype)  # causal: rows without keys too
    sinks = make_sinks(gen, dtype=torch.float32)
    plain = attention_forward(q, k, v, 0.3, True)
    expected_out, expected_lse = attention_forward(q, k, v, 0.3, True, sinks=sinks)
    # (batch, seqlen, heads, d) with (batch, heads, seqlen); packed (seqlen, heads, d) with (heads, seqlen).
    layouts = [(plain, (expected_out, expected_lse)), ((plain[0][0], plain[1][0]), (expected_out[0], expected_lse[0]))]
    for (out, lse), (want_out, want_lse) in layouts:
        folded_out = out.clone()
        folded_lse = fold_sinks_into(folded_out, lse, sinks)
        assert folded_out.dtype == out.dtype and folded_lse.dtype == want_lse.dtype
        torch.testing.assert_close(folded_lse, want_lse, atol=1e-6, rtol=1e-6)
        if dtype == torch.float64:
            torch.testing.assert_close(folded_out, want_out, **FP64_TOL)
        else:
            ulp = want_out.float().abs().clamp_min(2**-126) * 2**-7
            assert ((folded_out.float() - want_out.float()).abs() <= ulp).all()


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_the_sinks_gradient_check_catches_wrong_gradients(gen, layout):
    """check_sinks_gradient (tests/helpers.py, the GPU tests' check of dsinks) passes the gradient
    of a bf16 call with the sinks folded in after the forward (out rounded twice: a harder case than
    the kernels', which fold before rounding), and fails it negated, halved, or with two heads
    swapped."""
    q, k, v = make_qkv_fp64(gen, 60, 90, HEADS, 2, 32, torch.bfloat16)
    sinks = make_sinks(gen, dtype=torch.float32)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    out, lse = attention_forward(q, k, v, 0.2, True)
    lse = fold_sinks_into(out, lse, sinks)
    leaves = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    oracle_out, oracle_lse = naive_attention(*leaves[:3], 0.2, True, torch.float32, sinks=leaves[3])
    oracle_dsinks = torch.autograd.grad(oracle_out, leaves[3], dout.float())[0]
    if layout == "packed":  # batch entry 0 as a packed sequence
        out, lse, dout, oracle_out, oracle_lse = out[0], lse[0], dout[0], oracle_out[0], oracle_lse[0]
        oracle_dsinks = torch.autograd.grad(naive_attention(*(t[:1] for t in leaves[:3]), 0.2, True, torch.float32,
                                                            sinks=leaves[3])[0], leaves[3], dout[None].float())[0]
    dsinks = sinks_gradient(dout, out, lse, sinks)
    check_sinks_gradient("dsinks", dsinks, dout, out, lse, sinks, oracle_out.detach(), oracle_lse, oracle_dsinks)
    for wrong in (-dsinks, dsinks / 2, dsinks[[1, 0, 2, 3]]):
        with pytest.raises(AssertionError, match="exceeds the bound"):
            check_sinks_gradient("dsinks", wrong, dout, out, lse, sinks, oracle_out.detach(), oracle_lse,
                                 oracle_dsinks)


def test_gradient_check_carries_outs_rounding_into_dq_and_dk(monkeypatch):
    """With a sink, a row of one key has a large out and little else, and D = rowsum(dout * out)
    carries out's bf16 rounding into dq and dk: FlashAttention-2's rule against PyTorch alone fails
    some correct gradients of such rows (here the CPU reference's, at head dim 128, the GPU test
    case that failed), check_gradients_against_oracle's bound with that term passes them all, and
    still fails gradients scaled by 1.1, negated or with their heads swapped."""
    import helpers

    gen = torch.Generator().manual_seed(7)
    rule_alone_failures = 0
    for draw in range(24):
        seqlen_q, seqlen_k = (1, 1) if draw % 4 else (40, 70)
        q, k, v, dout = (torch.randn(1, s, h, 128, generator=gen).to(torch.bfloat16)
                         for s, h in ((seqlen_q, HEADS), (seqlen_k, 2), (seqlen_k, 2), (seqlen_q, HEADS)))
        sinks = 2 * torch.randn(HEADS, generator=gen) + 1
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, sinks=sinks)
        grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
        check_gradients_against_oracle("cpu", grads, q, k, v, dout, True, out=out, lse=lse, sinks=sinks)
        dq, dk, dv, dsinks = grads
        for wrong in ((dq * 1.1, dk, dv, dsinks), (dq, dk * 1.1, dv, dsinks), (-dq, dk, dv, dsinks),
                      (dq, dk.flip(2), dv, dsinks)):
            with pytest.raises(AssertionError):
                check_gradients_against_oracle("cpu", wrong, q, k, v, dout, True, out=out, lse=lse, sinks=sinks)
        with monkeypatch.context() as patch:
            patch.setattr(helpers, "rounded_out_slack", lambda *args: (0.0, 0.0, 0.0))
            try:
                check_gradients_against_oracle("cpu", grads, q, k, v, dout, True, out=out, lse=lse, sinks=sinks)
            except AssertionError:
                rule_alone_failures += 1
    assert rule_alone_failures > 0


def test_sinks_gradient_leaves_out_rows_past_the_last_sequence(gen):
    """A variable-length CUDA forward leaves rows outside every sequence unspecified (NaN here)."""
    out = torch.randn(10, HEADS, 8, generator=gen)
    dout = torch.randn(10, HEADS, 8, generator=gen)
    lse = torch.randn(HEADS, 10, generator=gen) + 3
    sinks = make_sinks(gen, dtype=torch.float32)
    expected = sinks_gradient(dout[:7], out[:7], lse[:, :7].contiguous(), sinks)
    out[7:], lse[:, 7:] = math.nan, math.nan
    actual = sinks_gradient(dout, out, lse, sinks, rows=torch.tensor(7, dtype=torch.int32))
    torch.testing.assert_close(actual, expected)
    assert torch.equal(sinks_gradient(dout, out, lse, sinks, rows=7), actual)


@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
def test_cpu_entry_points_take_sinks(gen, sinks_dtype):
    """flash_forward / flash_backward (which adds dsinks) / flash_attention (sinks get their .grad, in
    their dtype) on bfloat16 CPU tensors, against the fp64 oracle by FlashAttention-2's rule."""
    q, k, v = make_qkv_fp64(gen, 30, 50, HEADS, 2, 16, torch.bfloat16)
    sinks = make_sinks(gen, dtype=sinks_dtype)
    expected_out, expected_lse, dout, _ = oracle_with_grads(
        gen, q.double(), k.double(), v.double(), sinks.double(), 16**-0.5, True)
    dout = dout.to(torch.bfloat16)
    baseline_out, baseline_lse = naive_attention(q, k, v, 16**-0.5, True, sinks=sinks)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, sinks=sinks)
    fa2_check(out, expected_out, baseline_out, "out")
    fa2_check(lse, expected_lse, baseline_lse, "lse")
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    assert len(grads) == 4 and grads[3].dtype == sinks_dtype and grads[3].shape == (HEADS,)
    check_gradients_against_oracle("cpu", grads, q, k, v, dout, True, out=out, lse=lse, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    attended = flash_cutlass.flash_attention(*leaves[:3], causal=True, sinks=leaves[3])
    attended.backward(dout)
    assert torch.equal(attended, out)
    for leaf, grad in zip(leaves, grads):
        assert leaf.grad.dtype == leaf.dtype
        assert torch.equal(leaf.grad, grad)
    assert len(flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True)) == 3


def test_torch_compile_gives_the_eager_gradients(gen):
    q, k, v = make_qkv_fp64(gen, 24, 24, HEADS, 2, 16, torch.bfloat16)
    sinks = make_sinks(gen, dtype=torch.float32)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)

    def attention(q, k, v, sinks):
        return flash_cutlass.flash_attention(q, k, v, causal=True, window_size=(5, 0), sinks=sinks)

    results = []
    for function in (attention, torch.compile(attention, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = function(*leaves)
        out.backward(dout)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def test_forward_and_backward_ops_pass_opcheck(gen):
    """The forward op with sinks (and their gradient through its autograd), and the backward op,
    whose fourth output is dsinks (empty without sinks)."""
    from flash_cutlass.options import backward_options, forward_options

    q, k, v = make_qkv_fp64(gen, 12, 12, HEADS, 2, 16, torch.bfloat16)
    sinks = make_sinks(gen, dtype=torch.float32).requires_grad_()
    options = forward_options(q, causal=True, sinks=sinks)
    torch.library.opcheck(torch.ops.flash_cutlass.forward.default, (q, k, v, *options.op_args()))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, sinks=sinks.detach())
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    for given in (sinks.detach(), None):
        options = backward_options(q, causal=True, sinks=given)
        torch.library.opcheck(torch.ops.flash_cutlass.backward.default, (dout, q, k, v, out, lse, *options.op_args()))
        dsinks = torch.ops.flash_cutlass.backward.default(dout, q, k, v, out, lse, *options.op_args())[3]
        assert dsinks.shape == ((HEADS,) if given is not None else (0,))


def test_varlen_entry_points_equal_per_sequence_calls(gen):
    lengths = [(9, 20), (0, 5), (13, 4)]
    sinks = make_sinks(gen, dtype=torch.float32)
    pieces = [make_qkv_fp64(gen, sq, sk, HEADS, 2, 16, torch.bfloat16) for sq, sk in lengths]
    pieces = [tuple(t[:1] for t in piece) for piece in pieces]
    q, k, v = (torch.cat([piece[i][0] for piece in pieces]) for i in range(3))
    cu_q = torch.tensor([0, 9, 9, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 25, 29], dtype=torch.int32)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, 13, 20, causal=True, sinks=sinks)
    grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 13, 20, causal=True, sinks=sinks)
    dsinks = torch.zeros(HEADS)
    for b, (sq, sk) in enumerate(lengths):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        seq_q, seq_k, seq_v = pieces[b]
        seq_out, seq_lse = flash_cutlass.flash_forward(seq_q, seq_k, seq_v, causal=True, sinks=sinks)
        assert torch.equal(out[rows], seq_out[0]) and torch.equal(lse[:, rows], seq_lse[0])
        seq_grads = flash_cutlass.flash_backward(dout[rows].unsqueeze(0), seq_q, seq_k, seq_v, seq_out, seq_lse,
                                                 causal=True, sinks=sinks)
        assert torch.equal(grads[0][rows], seq_grads[0][0])
        dsinks += seq_grads[3]
    torch.testing.assert_close(grads[3], dsinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    flash_cutlass.flash_attention_varlen(*leaves[:3], cu_q, cu_k, 13, 20, causal=True, sinks=leaves[3]).backward(dout)
    for leaf, grad in zip(leaves, grads):
        assert torch.equal(leaf.grad, grad)


def test_dropout_with_sinks_matches_explicit_fp64(gen):
    q, k, v = make_qkv_fp64(gen, 20, 33, HEADS, 2, 16)
    sinks = make_sinks(gen)
    rng_state = torch.tensor([1234, 8], dtype=torch.int64)
    keep = reference.dropout_keep_mask(rng_state, 0.3, 2, HEADS, 20, 0, 33)
    expected_out, _, dout, expected_grads = oracle_with_grads(gen, q, k, v, sinks, 0.3, True, dropout_keep=keep,
                                                              dropout_p=0.3)
    options = {"dropout_p": 0.3, "rng_state": rng_state}
    out, lse = attention_forward(q, k, v, 0.3, True, sinks=sinks, **options)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    grads = (*attention_backward(dout, q, k, v, out, lse, 0.3, True, **options), sinks_gradient(dout, out, lse, sinks))
    for name, grad, expected in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        torch.testing.assert_close(grad, expected, **FP64_TOL, msg=lambda m: f"{name}: {m}")


def test_kvcache_takes_sinks(gen):
    """The KV-cache call with sinks gives flash_forward's result over the same keys (cache plus the
    appended tokens)."""
    q, k, v = make_qkv_fp64(gen, 3, 30, HEADS, 2, 16, torch.bfloat16)
    sinks = make_sinks(gen, dtype=torch.float32)
    k_cache, v_cache = torch.zeros(2, 40, 2, 16, dtype=torch.bfloat16), torch.zeros(2, 40, 2, 16, dtype=torch.bfloat16)
    k_cache[:, :27], v_cache[:, :27] = k[:, :27], v[:, :27]
    out, lse = flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, k[:, 27:], v[:, 27:], 27, causal=True,
                                                          sinks=sinks, return_lse=True)
    expected_out, expected_lse = flash_cutlass.flash_forward(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse)


def test_empty_calls(gen):
    sinks = make_sinks(gen, dtype=torch.float32)
    q = torch.zeros(2, 0, HEADS, 16, dtype=torch.bfloat16)
    k = torch.zeros(2, 5, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward(q, k, k, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (2, HEADS, 0)
    q = torch.randn(2, 3, HEADS, 16, generator=gen).to(torch.bfloat16)
    no_keys = torch.zeros(2, 0, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward(q, no_keys, no_keys, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.view(1, -1, 1).expand(2, HEADS, 3))


@pytest.mark.parametrize("sinks,error,match", [
    ([0.5] * 2, TypeError, r"sinks must be a torch.Tensor or None, got list"),
    (torch.ones(2, dtype=torch.int32), TypeError, r"sinks must be float32, float16, bfloat16 or float64, got torch.int32"),
    (torch.ones(3), ValueError, r"sinks must have shape \(heads,\) = \(2,\), one logit a query head, got \(3,\)"),
    (torch.ones(1, 2), ValueError, r"sinks must have shape \(heads,\)"),
    (torch.ones(2, device="meta"), ValueError, r"sinks is on meta but q is on cpu"),
])
def test_bad_sinks_are_rejected_by_every_entry_point(sinks, error, match):
    check_rejected_by_every_entry_point(error, match, sinks=sinks)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    new = torch.ones(1, 1, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        flash_cutlass.flash_attention_with_kvcache(q, cache, cache, new, new, 3, sinks=sinks)
    assert not cache.any()  # rejected before the append


# GPU: every compiled kernel and head dim, both dtypes; sinks with causal masks (rows that see no key
# where seqlen_q > seqlen_k), a window and a soft cap, GQA where seqlen_q != seqlen_k.
GPU_CASES = [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (100, 5), 0.0), (True, (-1, -1), 30.0)]
GPU_SEQLENS = [(113, 255), (256, 256), (2049, 17)]
GPU_HEADS = 8


@requires_cuda
@pytest.mark.parametrize("seqlen_q,seqlen_k", GPU_SEQLENS)
@pytest.mark.parametrize("causal,window,softcap", GPU_CASES)
@over_compiled_kernels
def test_forward_and_backward_match_oracle(cuda_gen, kernel, dtype, head_dim, causal, window, softcap, seqlen_q,
                                           seqlen_k):
    reason = options_left_out(window_size=window, softcap=softcap)
    if reason:
        pytest.skip(reason)
    heads_k = 2 if seqlen_q != seqlen_k else GPU_HEADS
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, GPU_HEADS, heads_k, head_dim)
    sinks = 2 * torch.randn(GPU_HEADS, generator=cuda_gen, device="cuda") + 1
    check_kernels_against_oracle(kernel, q, k, v, dout, causal, window_size=window, softcap=softcap, sinks=sinks)


@requires_cuda
@pytest.mark.parametrize("option", ["alibi", "dropout"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 255), (2049, 17)])
@over_compiled_kernels
def test_sinks_with_alibi_and_dropout_match_oracle(cuda_gen, kernel, dtype, head_dim, option, seqlen_q, seqlen_k):
    """The sinks with the option kernels: ALiBi's bias and dropout's mask (the sink is never dropped:
    it has no value) against the oracle, causal, GQA."""
    options = {"alibi_slopes": torch.exp2(-8 * torch.arange(1, GPU_HEADS + 1, device="cuda") / GPU_HEADS).float()}
    if option == "dropout":
        options = {"dropout_p": 0.17, "rng_state": torch.tensor([4242, 8 * seqlen_q], dtype=torch.int64)}
    reason = options_left_out(alibi=option == "alibi", dropout_p=options.get("dropout_p", 0.0))
    if reason:
        pytest.skip(reason)
    q, k, v, dout = cuda_inputs(cuda_gen, dtype, seqlen_q, seqlen_k, GPU_HEADS, 2, head_dim)
    sinks = 2 * torch.randn(GPU_HEADS, generator=cuda_gen, device="cuda") + 1
    check_kernels_against_oracle(kernel, q, k, v, dout, True, sinks=sinks, **options)


@requires_cuda
@requires_backward
@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_autograd_and_varlen_on_cuda(cuda_gen, kernel, sinks_dtype):
    """flash_attention's gradients (sinks' in their dtype) equal flash_backward's; a variable-length
    call equals its sequences' own calls, dsinks their sum."""
    head_dim = 128
    if kernel_unavailable(kernel, head_dim, "backward"):
        pytest.skip(kernel_unavailable(kernel, head_dim, "backward"))
    dtype = torch.bfloat16
    lengths = [(100, 300), (257, 64), (1, 1)]
    pieces = [tuple(t[:1] for t in cuda_inputs(cuda_gen, dtype, sq, sk, GPU_HEADS, 2, head_dim)) for sq, sk in lengths]
    sinks = (2 * torch.randn(GPU_HEADS, generator=cuda_gen, device="cuda") + 1).to(sinks_dtype)
    q, k, v, dout = (torch.cat([piece[i][0] for piece in pieces]) for i in range(4))
    cu_q = torch.tensor([0, 100, 357, 358], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 364, 365], dtype=torch.int32, device="cuda")
    options = dict(causal=True, kernel=kernel, sinks=sinks)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, 257, 300, **options)
    grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 257, 300, **options)
    assert grads[3].dtype == sinks_dtype
    dsinks = torch.zeros(GPU_HEADS, device="cuda")
    for b, piece in enumerate(pieces):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        seq_out, seq_lse = flash_cutlass.flash_forward(*piece[:3], **options)
        torch.testing.assert_close(out[rows], seq_out[0])
        torch.testing.assert_close(lse[:, rows], seq_lse[0])
        seq_grads = flash_cutlass.flash_backward(piece[3], *piece[:3], seq_out, seq_lse, **options)
        dsinks += seq_grads[3].float()
        check_kernels_against_oracle(kernel, *piece, True, sinks=sinks)
    torch.testing.assert_close(grads[3].float(), dsinks, atol=1e-2, rtol=1e-2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    flash_cutlass.flash_attention_varlen(*leaves[:3], cu_q, cu_k, 257, 300, **dict(options, sinks=leaves[3])
                                         ).backward(dout)
    for leaf, grad in zip(leaves, grads):
        assert leaf.grad.dtype == leaf.dtype
        torch.testing.assert_close(leaf.grad, grad)

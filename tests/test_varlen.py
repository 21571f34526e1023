"""Variable-length batches: flash_forward_varlen / flash_backward_varlen / flash_attention_varlen
on packed (total_tokens, heads, head_dim) tensors with int32 cumulative lengths.

CPU: the reference against an fp64 implementation written out here on the packed tensors (a
block-diagonal mask, each sequence's causal diagonal and window aligned to its own lengths), with
ALiBi and dropout; the entry points equal flash_forward / flash_backward run sequence by sequence;
sequences of length 0 and 1; bad input. GPU (skipped without one): every kernel's varlen results
equal its per-sequence results bitwise in the forward and closely in the backward, and pass the
fp32 oracle by FlashAttention-2's rule, sequence by sequence, with causal, a window, ALiBi, a soft
cap, dropout and GQA. CUDA calls read their lengths on the device only: they never synchronize,
replay in a CUDA graph on new data and new lengths, run lengths that break the rules without
leaving the tensors (and without changing the sequences those leave alone), ignore rows past the
last sequence, and check the lengths with FLASH_CUTLASS_CHECK_VARLEN=1.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import (attention_backward, attention_backward_varlen, attention_forward_varlen,
                                     dropout_keep_mask, naive_attention)
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, fa2_check, kernel_unavailable, options_left_out,
                     over_compiled_kernels, requires_backward, requires_cuda, worse_baseline)

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}


def cumulative(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed_inputs(gen, lengths_q, lengths_k, heads, heads_k, head_dim, dtype=torch.float64, device="cpu"):
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32).to(device, dtype)

    return (rand(sum(lengths_q), heads, head_dim), rand(sum(lengths_k), heads_k, head_dim),
            rand(sum(lengths_k), heads_k, head_dim))


def packed_attention_fp64(q, k, v, lengths_q, lengths_k, scale, causal=False, window=(-1, -1), slopes=None,
                          dropout=None):
    """out, lse on the packed tensors with the whole (total_q, total_k) score matrix: query i of
    sequence b sees key j iff j is in sequence b and inside b's causal mask / window; dropout =
    (p, rng_state) drops with sequence b's mask as batch entry b."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * scale
    heads, total_q, total_k = scores.shape
    visible = torch.zeros(total_q, total_k, dtype=torch.bool)
    bias = torch.zeros(heads, total_q, total_k, dtype=torch.float64)
    keep = torch.ones(heads, total_q, total_k, dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    q0 = k0 = 0
    for b, (sq, sk) in enumerate(zip(lengths_q, lengths_k)):
        rows = torch.arange(sq).unsqueeze(1) + sk - sq
        cols = torch.arange(sk).unsqueeze(0)
        block = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            block &= cols >= rows - left
        if right >= 0:
            block &= cols <= rows + right
        visible[q0:q0 + sq, k0:k0 + sk] = block
        if slopes is not None:
            slope = (slopes[b] if slopes.dim() == 2 else slopes).double()
            bias[:, q0:q0 + sq, k0:k0 + sk] = -slope.view(-1, 1, 1) * (rows - cols).abs()
        if dropout is not None:
            keep[:, q0:q0 + sq, k0:k0 + sk] = dropout_keep_mask(dropout[1], dropout[0], 1, heads, sq, 0, sk,
                                                                batch_start=b)[0]
        q0, k0 = q0 + sq, k0 + sk
    scores = (scores + bias).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    if dropout is not None:
        probs = torch.where(keep, probs / (1 - dropout[0]), 0.0)
    return torch.einsum("hqk,khd->qhd", probs, vr), lse


CPU_LENGTHS = [([5, 0, 1, 17, 9], [7, 3, 4, 17, 0]), ([1], [1]), ([12, 30], [30, 12])]


@pytest.mark.parametrize("lengths", CPU_LENGTHS, ids=["mixed", "single", "swapped"])
@pytest.mark.parametrize("causal,window,alibi,dropout", [(False, (-1, -1), False, False), (True, (-1, -1), False, False),
                                                         (False, (4, 2), True, False), (True, (-1, -1), True, True)])
def test_reference_matches_packed_fp64(gen, lengths, causal, window, alibi, dropout):
    lengths_q, lengths_k = lengths
    q, k, v = packed_inputs(gen, lengths_q, lengths_k, 4, 2, 16)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    options = {"window_size": window}
    slopes = torch.rand(len(lengths_q), 4, generator=gen) if alibi else None
    rng_state = torch.tensor([77, 8]) if dropout else None
    if alibi:
        options["alibi_slopes"] = slopes
    if dropout:
        options.update(dropout_p=0.3, rng_state=rng_state)
    expected_out, expected_lse = packed_attention_fp64(q, k, v, lengths_q, lengths_k, 0.3, causal, window, slopes,
                                                       (0.3, rng_state) if dropout else None)
    out, lse = attention_forward_varlen(q, k, v, cu_q, cu_k, 0.3, causal, **options)
    torch.testing.assert_close(out, expected_out, **FP64_TOL)
    torch.testing.assert_close(lse, expected_lse, **FP64_TOL)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    explicit_out, _ = packed_attention_fp64(*leaves, lengths_q, lengths_k, 0.3, causal, window, slopes,
                                            (0.3, rng_state) if dropout else None)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(explicit_out, leaves, dout)
    grads = attention_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 0.3, causal, **options)
    for name, grad, ref in zip("qkv", grads, expected):
        torch.testing.assert_close(grad, ref, **FP64_TOL, msg=lambda m: f"d{name}: {m}")


def per_sequence(flash_call, tensors_q, tensors_k, lengths_q, lengths_k):
    """flash_call(sequence b's (1, len, heads, dim) views) for each sequence b."""
    q0 = k0 = 0
    results = []
    for b, (sq, sk) in enumerate(zip(lengths_q, lengths_k)):
        results.append(flash_call(b, [t[q0:q0 + sq].unsqueeze(0) for t in tensors_q],
                                  [t[k0:k0 + sk].unsqueeze(0) for t in tensors_k]))
        q0, k0 = q0 + sq, k0 + sk
    return results


def test_cpu_entry_points_equal_per_sequence_calls(gen):
    lengths_q, lengths_k = CPU_LENGTHS[0]
    q, k, v = packed_inputs(gen, lengths_q, lengths_k, 4, 2, 16, torch.bfloat16)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    wider = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, max_q + 100, max_k + 1, causal=True)
    assert torch.equal(wider[0], out) and torch.equal(wider[1], lse)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    dq, dk, dv = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=True)

    def forward(b, qs, ks):
        return flash_cutlass.flash_forward(qs[0], ks[0], ks[1], causal=True)

    starts = cu_q.tolist()
    for b, (seq_out, seq_lse) in enumerate(per_sequence(forward, [q], [k, v], lengths_q, lengths_k)):
        assert torch.equal(out[starts[b]:starts[b + 1]], seq_out[0])
        assert torch.equal(lse[:, starts[b]:starts[b + 1]], seq_lse[0])

    def backward(b, qs, ks):
        seq_out, seq_lse = flash_cutlass.flash_forward(qs[0], ks[0], ks[1], causal=True)
        return flash_cutlass.flash_backward(qs[1], qs[0], ks[0], ks[1], seq_out, seq_lse, causal=True)

    starts_k = cu_k.tolist()
    for b, (seq_dq, seq_dk, seq_dv) in enumerate(per_sequence(backward, [q, dout], [k, v], lengths_q, lengths_k)):
        assert torch.equal(dq[starts[b]:starts[b + 1]], seq_dq[0])
        assert torch.equal(dk[starts_k[b]:starts_k[b + 1]], seq_dk[0])
        assert torch.equal(dv[starts_k[b]:starts_k[b + 1]], seq_dv[0])

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, causal=True)
    assert torch.equal(attended, out)
    for grad, ref in zip(torch.autograd.grad(attended, leaves, dout), (dq, dk, dv)):
        assert torch.equal(grad, ref)


def test_empty_batches_and_sequences():
    q = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    k = torch.zeros(6, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, k, cumulative([0, 0]), cumulative([2, 4]), 0, 4)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    q = torch.ones(3, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward_varlen(q, k[:0], k[:0], cumulative([3]), cumulative([0]), 3, 0)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("change,error,match", [
    ({"cu_seqlens_q": torch.tensor([0, 4, 9])}, TypeError, r"cu_seqlens_q must be int32, got torch.int64"),
    ({"cu_seqlens_k": [0, 5, 9]}, TypeError, r"cu_seqlens_k must be a torch.Tensor, got list"),
    ({"cu_seqlens_q": torch.tensor([[0, 4, 9]], dtype=torch.int32)}, ValueError, r"cu_seqlens_q must be 1-D"),
    ({"cu_seqlens_q": torch.tensor([1, 4, 9], dtype=torch.int32)}, ValueError, r"cu_seqlens_q must start at 0, got 1"),
    ({"cu_seqlens_q": torch.tensor([0, 6, 4, 9], dtype=torch.int32), "cu_seqlens_k": torch.tensor([0, 1, 2, 9],
                                                                                                  dtype=torch.int32)},
     ValueError, r"cu_seqlens_q must be non-decreasing"),
    ({"cu_seqlens_k": torch.tensor([0, 4, 8], dtype=torch.int32)}, ValueError,
     r"cu_seqlens_k must end at the 9 tokens of k, got 8"),
    ({"cu_seqlens_q": torch.tensor([0, 4, 12], dtype=torch.int32)}, ValueError,
     r"cu_seqlens_q must end at the 9 tokens of q, got 12"),
    ({"cu_seqlens_k": torch.tensor([-2, 5, 9], dtype=torch.int32)}, ValueError,
     r"cu_seqlens_k must start at 0, got -2"),
    ({"cu_seqlens_k": torch.tensor([0, 9], dtype=torch.int32)}, ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have the same number of entries \(batch \+ 1\), got 3 and 2"),
    ({"max_seqlen_q": 4}, ValueError, r"max_seqlen_q = 4 is below the longest sequence, 5 tokens"),
    ({"max_seqlen_k": -1}, ValueError, r"max_seqlen_k must be in \[0, 2\^31\)"),
    ({"max_seqlen_k": 5.0}, TypeError, r"max_seqlen_k must be an int, got float"),
    ({"q": torch.zeros(1, 9, 2, 16, dtype=torch.bfloat16)}, ValueError, r"q must have 3 dimensions"),
    ({"alibi_slopes": torch.ones(3, 2)}, ValueError, r"alibi_slopes must have shape \(heads,\) = \(2,\) or "
                                                     r"\(batch, heads\) = \(2, 2\)"),
])
def test_bad_varlen_input_is_rejected_by_every_entry_point(change, error, match):
    args = {"q": torch.zeros(9, 2, 16, dtype=torch.bfloat16), "k": torch.zeros(9, 2, 16, dtype=torch.bfloat16),
            "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
            "cu_seqlens_k": torch.tensor([0, 5, 9], dtype=torch.int32), "max_seqlen_q": 5, "max_seqlen_k": 5,
            "alibi_slopes": None}
    good = dict(args)
    out, lse = flash_cutlass.flash_forward_varlen(good["q"], good["k"], good["k"], good["cu_seqlens_q"],
                                                  good["cu_seqlens_k"], 5, 5)
    args.update(change)
    positional = (args["q"], args["k"], args["k"], args["cu_seqlens_q"], args["cu_seqlens_k"], args["max_seqlen_q"],
                  args["max_seqlen_k"])
    with pytest.raises(error, match=match):
        flash_cutlass.flash_forward_varlen(*positional, alibi_slopes=args["alibi_slopes"])
    with pytest.raises(error, match=match):
        flash_cutlass.flash_attention_varlen(*positional, alibi_slopes=args["alibi_slopes"])
    if "q" not in change:
        with pytest.raises(error, match=match):
            flash_cutlass.flash_backward_varlen(out, args["q"], args["k"], args["k"], out, lse, *positional[3:],
                                                alibi_slopes=args["alibi_slopes"])


def test_the_check_variable_takes_0_or_1_and_cpu_calls_check_either_way(monkeypatch):
    q = torch.zeros(9, 2, 16, dtype=torch.bfloat16)
    lengths = torch.tensor([0, 4, 9], dtype=torch.int32)
    monkeypatch.setenv("FLASH_CUTLASS_CHECK_VARLEN", "yes")
    with pytest.raises(ValueError, match=r"FLASH_CUTLASS_CHECK_VARLEN must be 0 or 1, got 'yes'"):
        flash_cutlass.flash_forward_varlen(q, q, q, lengths, lengths, 5, 5)
    monkeypatch.setenv("FLASH_CUTLASS_CHECK_VARLEN", "0")
    with pytest.raises(ValueError, match=r"max_seqlen_q = 4 is below the longest sequence, 5 tokens"):
        flash_cutlass.flash_forward_varlen(q, q, q, lengths, lengths, 4, 5)


# GPU ----------------------------------------------------------------------------------------

GPU_LENGTHS = [
    ([300, 0, 1, 129, 64, 40], [300, 17, 1, 129, 250, 0]),  # no queries, one of each, no keys
    ([1000, 24], [24, 1000]),
    ([700, 650, 5, 1300, 0, 300], [700, 1, 900, 1300, 64, 300]),  # more query tiles than SMs
]
GPU_CASES = [
    # causal, window, alibi, softcap, dropout_p
    (False, (-1, -1), False, 0.0, 0.0),
    (True, (-1, -1), False, 0.0, 0.0),
    (False, (50, 7), True, 0.0, 0.0),
    (True, (-1, -1), True, 20.0, 0.15),
]
HEADS = 4


@requires_cuda
@requires_backward
@pytest.mark.parametrize("lengths", range(len(GPU_LENGTHS)))
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@over_compiled_kernels
def test_varlen_matches_per_sequence_calls_and_oracle(cuda_gen, kernel, dtype, head_dim, case, lengths):
    causal, window, alibi, softcap, dropout_p = GPU_CASES[case]
    left_out = options_left_out(window, softcap, alibi, dropout_p)
    if left_out:
        pytest.skip(left_out)
    lengths_q, lengths_k = GPU_LENGTHS[lengths]
    heads_k = 2 if lengths % 2 else HEADS
    q, k, v = packed_inputs(cuda_gen, lengths_q, lengths_k, HEADS, heads_k, head_dim, dtype, "cuda")
    dout = torch.randn(q.shape, generator=cuda_gen, device="cuda").to(dtype)
    cu_q, cu_k = cumulative(lengths_q, "cuda"), cumulative(lengths_k, "cuda")
    max_q, max_k = max(lengths_q), max(lengths_k)
    slopes = torch.exp2(-8 * torch.rand(len(lengths_q), HEADS, generator=cuda_gen, device="cuda")) if alibi else None
    rng_state = torch.tensor([1234, 16]) if dropout_p > 0 else None
    options = {"window_size": window, "softcap": softcap, "dropout_p": dropout_p, "rng_state": rng_state}
    forward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "forward") else kernel
    backward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "backward") else kernel
    # The sm80 backward's deterministic dQ kernel on one case; a max_seqlen above the longest on another.
    deterministic = backward_kernel == "sm80" and case == 1
    max_q += 64 * (case == 2)

    out, lse, *_ = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                      kernel=forward_kernel, alibi_slopes=slopes, **options)
    dq, dk, dv = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                                     deterministic=deterministic, kernel=backward_kernel,
                                                     alibi_slopes=slopes, **options)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    scale = 1.0 / math.sqrt(head_dim)
    # The oracle and the same-dtype baseline, sequence by sequence, assembled over the packed rows and
    # checked once per result, as for a padded batch: a maximum over a few rows (a 5-query sequence)
    # is too small a sample to bound the kernel's error. Rows of sequences without queries or keys
    # hold the kernel's own values (checked exactly below).
    results = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    oracles = {name: t.detach().float().clone() for name, t in results.items()}
    baselines = {name: t.detach().float().clone() for name, t in results.items()}
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        seq = [t[rows_q].unsqueeze(0) for t in (q, dout)] + [t[rows_k].unsqueeze(0) for t in (k, v)]
        seq_q, seq_dout, seq_k, seq_v = seq
        seq_slopes = slopes[b] if alibi else None
        if dropout_p == 0:
            # The same kernel on the sequence alone: the same tiles, the same bits.
            seq_out, seq_lse = flash_cutlass.flash_forward(seq_q, seq_k, seq_v, causal=causal, kernel=forward_kernel,
                                                           alibi_slopes=seq_slopes, **options)
            assert torch.equal(out[rows_q], seq_out[0]), f"sequence {b}: out differs from the per-sequence call"
            assert torch.equal(lse[:, rows_q], seq_lse[0]), f"sequence {b}: lse differs from the per-sequence call"
        if lengths_k[b] == 0:
            assert not out[rows_q].any() and bool(torch.isneginf(lse[:, rows_q]).all()) and not dq[rows_q].any()
        if lengths_q[b] == 0:
            assert not dk[rows_k].any() and not dv[rows_k].any()
        if lengths_q[b] == 0 or lengths_k[b] == 0:
            continue
        oracle_options = dict(options, alibi_slopes=seq_slopes, batch_start=b)
        oracle_out, oracle_lse = naive_attention(seq_q, seq_k, seq_v, scale, causal, torch.float32, **oracle_options)
        same_out, same_lse = naive_attention(seq_q, seq_k, seq_v, scale, causal, **oracle_options)
        oracles["out"][rows_q], baselines["out"][rows_q] = oracle_out[0], same_out[0].float()
        oracles["lse"][:, rows_q], baselines["lse"][:, rows_q] = oracle_lse[0], same_lse[0].float()

        def grads_of(compute_dtype):
            leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (seq_q, seq_k, seq_v)]
            attended, _ = naive_attention(*leaves, scale, causal, **oracle_options)
            return torch.autograd.grad(attended, leaves, seq_dout.to(attended.dtype))

        # The kernels' dS = P * (dP - D) takes D = rowsum(dout * out) from the stored out, rounded to
        # the input dtype; where a row sees one key (a 1-token sequence) autograd's softmax gradient
        # is exactly 0 while dP - D is out's rounding error. The baseline is the worse of autograd in
        # the input dtype and the reference's backward from the rounded out.
        from_rounded_out = attention_backward(seq_dout, seq_q, seq_k, seq_v, same_out, oracle_lse, scale, causal,
                                              **oracle_options)
        for name, rows, ref, base, rounded in zip(("dq", "dk", "dv"), (rows_q, rows_k, rows_k),
                                                  grads_of(torch.float32), grads_of(None), from_rounded_out):
            oracles[name][rows] = ref[0]
            baselines[name][rows] = worse_baseline(ref[0], base[0], rounded[0]).float()
    for name, result in results.items():
        fa2_check(result, oracles[name], baselines[name], name)


@requires_cuda
def test_cu_seqlens_on_another_device_are_rejected(cuda_gen):
    q = torch.zeros(9, 2, COMPILED_HEAD_DIMS[0], device="cuda", dtype=COMPILED_DTYPES[-1])
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on cpu but q is on cuda:0"):
        flash_cutlass.flash_forward_varlen(q, q, q, cumulative([4, 5]), cumulative([4, 5], "cuda"), 5, 5)


# GPU: the lengths are read on the device only ------------------------------------------------
# CUDA calls read cu_seqlens and max_seqlen nowhere but in the kernels: nothing synchronizes, CUDA
# graphs capture the calls, and lengths that break the rules stay inside the tensors.

DEVICE_LENGTHS = ([300, 40, 1, 200], [280, 50, 17, 230])  # 541 queries, 577 keys
# cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k that break the rules, and the sequences
# (of DEVICE_LENGTHS) they leave alone, whose results must stay those of the well-formed call.
MALFORMED_LENGTHS = {
    "max_seqlen_below_the_longest": ([0, 300, 340, 341, 541], [0, 280, 330, 347, 577], 250, 250, (1, 2, 3)),
    "last_entry_past_the_totals": ([0, 300, 340, 341, 10**6], [0, 280, 330, 347, 2**31 - 1], 300, 280, (0, 1, 2)),
    "negative_first_entry": ([-7, 300, 340, 341, 541], [-2**31, 280, 330, 347, 577], 300, 280, (1, 2, 3)),
    "decreasing": ([0, 300, 120, 341, 541], [0, 280, 330, 100, 577], 300, 280, ()),
    "garbage": ([2**31 - 1, -2**31, 5, 2**31 - 1, -1], [-1, 7, 2**31 - 1, 0, 3], 2**31 - 1, 2**31 - 1, ()),
}


def device_lengths_case(kernel: str):
    """(head_dim, dtype) of the tests below on `kernel` ('sm80' or 'sm90', forward and backward);
    skips where the build or the GPU cannot run them."""
    head_dim = 64 if 64 in COMPILED_HEAD_DIMS else COMPILED_HEAD_DIMS[0]
    reason = kernel_unavailable(kernel, head_dim, "backward") or kernel_unavailable(kernel, head_dim, "forward")
    if reason:
        pytest.skip(reason)
    return head_dim, COMPILED_DTYPES[-1]


def device_inputs(gen, lengths_q, lengths_k, head_dim, dtype):
    """q, k, v (GQA: HEADS query heads on 2 key heads) and dout of packed sequences on the GPU."""
    q, k, v = packed_inputs(gen, lengths_q, lengths_k, HEADS, 2, head_dim, dtype, "cuda")
    return q, k, v, torch.randn(q.shape, generator=gen, device="cuda").to(dtype)


def check_same_gradients(grads, expected, rows_q, rows_k, label):
    """(dq, dk, dv) of two calls agree on the rows given: dK and dV bitwise, dQ (added in an order
    that may change between runs) up to rounding."""
    dq, dk, dv = grads
    ref_dq, ref_dk, ref_dv = expected
    assert torch.equal(dk[rows_k], ref_dk[rows_k]), f"{label}: dk"
    assert torch.equal(dv[rows_k], ref_dv[rows_k]), f"{label}: dv"
    torch.testing.assert_close(dq[rows_q].float(), ref_dq[rows_q].float(), atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"{label}: dq: {m}")


def check_same_rows(actual, expected, rows_q, rows_k, label):
    """(out, lse, (dq, dk, dv)) of two calls agree on the rows given: out and lse bitwise, the
    gradients as check_same_gradients."""
    out, lse, grads = actual
    ref_out, ref_lse, ref_grads = expected
    assert torch.equal(out[rows_q], ref_out[rows_q]), f"{label}: out"
    assert torch.equal(lse[:, rows_q], ref_lse[:, rows_q]), f"{label}: lse"
    check_same_gradients(grads, ref_grads, rows_q, rows_k, label)


@requires_cuda
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_cuda_varlen_calls_never_synchronize(cuda_gen, kernel, monkeypatch):
    head_dim, dtype = device_lengths_case(kernel)
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", kernel)  # flash_attention_varlen's backward
    lengths_q, lengths_k = DEVICE_LENGTHS
    q, k, v, dout = device_inputs(cuda_gen, lengths_q, lengths_k, head_dim, dtype)
    cu_q, cu_k = cumulative(lengths_q, "cuda"), cumulative(lengths_k, "cuda")
    lengths = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def calls():
        out, lse = flash_cutlass.flash_forward_varlen(q, k, v, *lengths, causal=True, kernel=kernel)
        flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, *lengths, causal=True, kernel=kernel)
        flash_cutlass.flash_attention_varlen(*leaves, *lengths, causal=True, kernel=kernel).backward(dout)

    calls()  # first launches (kernel attributes, device queries) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # from here, a synchronizing call raises
    try:
        calls()
        with pytest.raises(RuntimeError, match="synchroniz"):
            cu_q.tolist()  # what the calls used to do: the mode catches it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_cuda_graph_of_varlen_calls_replays_new_data_and_lengths(cuda_gen, kernel, monkeypatch):
    head_dim, dtype = device_lengths_case(kernel)
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", kernel)
    lengths_q, lengths_k = DEVICE_LENGTHS
    max_q, max_k = max(lengths_q), max(lengths_k)
    # The replay's lengths: the same totals and longest lengths (the graph's shapes and grid), but
    # other sequences.
    new_lengths_q, new_lengths_k = lengths_q[::-1], lengths_k[::-1]

    def calls(q, k, v, dout, cu_q, cu_k, leaves):
        out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, kernel=kernel)
        grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=True,
                                                    kernel=kernel)
        attended = flash_cutlass.flash_attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, causal=True, kernel=kernel)
        attended.backward(dout)
        return out, lse, grads, attended

    static = list(device_inputs(cuda_gen, lengths_q, lengths_k, head_dim, dtype))
    static += [cumulative(lengths_q, "cuda"), cumulative(lengths_k, "cuda")]
    leaves = [t.clone().requires_grad_() for t in static[:3]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graphs asks
        calls(*static, leaves)
    torch.cuda.current_stream().wait_stream(stream)
    for leaf in leaves:
        leaf.grad = None  # the captured backward allocates the gradients in the graph's memory
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, grads, attended = calls(*static, leaves)
    leaf_grads = [leaf.grad for leaf in leaves]

    new = list(device_inputs(cuda_gen, lengths_q, lengths_k, head_dim, dtype))
    new += [cumulative(new_lengths_q, "cuda"), cumulative(new_lengths_k, "cuda")]
    with torch.no_grad():
        for target, source in zip(static + leaves, new + new[:3]):
            target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()

    new_leaves = [t.clone().requires_grad_() for t in new[:3]]
    eager_out, eager_lse, eager_grads, eager_attended = calls(*new, new_leaves)
    everything = slice(None)
    check_same_rows((out, lse, grads), (eager_out, eager_lse, eager_grads), everything, everything, "replay")
    assert torch.equal(attended, eager_attended), "replay of flash_attention_varlen: out"
    check_same_gradients(leaf_grads, [t.grad for t in new_leaves], everything, everything,
                         "replay of flash_attention_varlen")


@requires_cuda
@pytest.mark.parametrize("case", list(MALFORMED_LENGTHS))
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_malformed_lengths_stay_inside_the_tensors(cuda_gen, kernel, case):
    """Lengths that break the rules run to completion (the kernels clamp them to the tensors and
    the grid: common/block_info.h, sequence_rows) and leave the results of the sequences they do
    not involve as those of the well-formed call. Run under compute-sanitizer for the bounds."""
    head_dim, dtype = device_lengths_case(kernel)
    lengths_q, lengths_k = DEVICE_LENGTHS
    cu_q, cu_k, max_q, max_k, intact = MALFORMED_LENGTHS[case]
    q, k, v, dout = device_inputs(cuda_gen, lengths_q, lengths_k, head_dim, dtype)
    good = (cumulative(lengths_q, "cuda"), cumulative(lengths_k, "cuda"), max(lengths_q), max(lengths_k))
    bad = (torch.tensor(cu_q, dtype=torch.int32, device="cuda"), torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
           max_q, max_k)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, *good, causal=True, kernel=kernel)
    grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, *good, causal=True, kernel=kernel)
    bad_out, bad_lse = flash_cutlass.flash_forward_varlen(q, k, v, *bad, causal=True, kernel=kernel)
    # The backward from the well-formed forward's out and lse: only the lengths differ.
    bad_grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, *bad, causal=True, kernel=kernel)
    torch.cuda.synchronize()  # no fault, no hang
    starts_q, starts_k = good[0].tolist(), good[1].tolist()
    for b in intact:
        check_same_rows((bad_out, bad_lse, bad_grads), (out, lse, grads), slice(starts_q[b], starts_q[b + 1]),
                        slice(starts_k[b], starts_k[b + 1]), f"{case}, sequence {b}")


@requires_cuda
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_rows_past_the_last_sequence_change_no_result(cuda_gen, kernel):
    """cu_seqlens ending before the token counts (buffers of a fixed size, as CUDA graphs need):
    the rows past the last sequence, finite, belong to none, and every sequence's results are those
    of the call on the tensors without them."""
    head_dim, dtype = device_lengths_case(kernel)
    lengths_q, lengths_k = DEVICE_LENGTHS
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, k, v, dout = device_inputs(cuda_gen, lengths_q + [37], lengths_k + [45], head_dim, dtype)
    lengths = (cumulative(lengths_q, "cuda"), cumulative(lengths_k, "cuda"), max(lengths_q), max(lengths_k))
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, *lengths, causal=True, kernel=kernel)
    grads = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, *lengths, causal=True, kernel=kernel)
    unpadded = (q[:total_q], k[:total_k], v[:total_k])
    ref_out, ref_lse = flash_cutlass.flash_forward_varlen(*unpadded, *lengths, causal=True, kernel=kernel)
    ref_grads = flash_cutlass.flash_backward_varlen(dout[:total_q], *unpadded, ref_out, ref_lse, *lengths, causal=True,
                                                    kernel=kernel)
    dq, dk, dv = grads
    everything = slice(None)
    check_same_rows((out[:total_q], lse[:, :total_q], (dq[:total_q], dk[:total_k], dv[:total_k])),
                    (ref_out, ref_lse, ref_grads), everything, everything, "buffers past the sequences")


@requires_cuda
def test_check_variable_reads_and_checks_cuda_lengths(cuda_gen, monkeypatch):
    head_dim, dtype = COMPILED_HEAD_DIMS[0], COMPILED_DTYPES[-1]
    q = torch.randn(9, 2, head_dim, generator=cuda_gen, device="cuda").to(dtype)
    out, lse = flash_cutlass.flash_forward_varlen(q, q, q, cumulative([4, 5], "cuda"), cumulative([5, 4], "cuda"), 5, 5)

    def lengths(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    bad_calls = [
        ((lengths([1, 4, 9]), lengths([0, 5, 9]), 5, 5), r"cu_seqlens_q must start at 0, got 1"),
        ((lengths([0, 6, 4]), lengths([0, 5, 9]), 6, 5), r"cu_seqlens_q must be non-decreasing"),
        ((lengths([0, 4, 9]), lengths([0, 5, 12]), 5, 5), r"cu_seqlens_k must end at the 9 tokens of k, got 12"),
        ((lengths([0, 4, 9]), lengths([0, 5, 9]), 4, 5), r"max_seqlen_q = 4 is below the longest sequence, 5 tokens"),
    ]
    monkeypatch.setenv("FLASH_CUTLASS_CHECK_VARLEN", "1")
    for varlen, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            flash_cutlass.flash_forward_varlen(q, q, q, *varlen)
        with pytest.raises(ValueError, match=match):
            flash_cutlass.flash_attention_varlen(q, q, q, *varlen)
        with pytest.raises(ValueError, match=match):
            flash_cutlass.flash_backward_varlen(out, q, q, q, out, lse, *varlen)
    monkeypatch.delenv("FLASH_CUTLASS_CHECK_VARLEN")
    for varlen, _ in bad_calls:  # unchecked by default: they run (with wrong results)
        flash_cutlass.flash_forward_varlen(q, q, q, *varlen)
    torch.cuda.synchronize()

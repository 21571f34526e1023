"""Dropout: dropout_p > 0 drops each attention probability with probability p (a Philox mask drawn
from a (seed, offset) rng_state) and scales the kept ones by 1 / (1 - p).

CPU: Philox4x32-10 against its published known answers; the reference's mask (keep rate, and
that it depends on seed, offset, batch, head, row and column); the reference forward and backward
against an fp64 implementation written out here with the same mask; the entry points (rng_state
returned and reused, generators reproduce); bad input. GPU (skipped without one): the mask each
kernel applies, read back through one-hot values, equals the reference's, in the forward and in
the backward; forward and gradients against the fp32 oracle with the same mask, with causal, a
window, ALiBi, a soft cap and GQA; bitwise reproduction from the same generator state; the state a
CUDA call draws (a CUDA tensor of the generator's seed and offset, which advances by 4); CUDA
graphs: a captured call draws a fresh mask on every replay (that of an eager call given the
replay's rng_state, read back against the reference's mask and checked against the oracle), a
given rng_state replays its one mask, a registered generator= is honoured.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import attention_forward, dropout_keep_mask, naive_attention, philox4x32_10
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, capture_graph, check_gradients_against_oracle,
                     check_kernels_against_oracle, check_reference_backward, check_rejected_by_every_entry_point, cuda_inputs,
                     explicit_attention_fp64, fa2_check, has_kernels, kernel_unavailable, make_qkv_fp64,
                     over_compiled_kernels, requires_backward, requires_cuda)

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


RNG_STATE_FORM = r"rng_state must be an int64 tensor of 2 elements \(seed, offset\) on the CPU or on q's device \(cpu\)"


@pytest.mark.parametrize("rng_state,error,match", [
    ([1, 2], TypeError, r"rng_state must be a torch.Tensor or None, got list"),
    (torch.tensor([1, 2], dtype=torch.int32), ValueError, RNG_STATE_FORM + r", .* got torch.int32"),
    (torch.tensor([1, 2, 3]), ValueError, RNG_STATE_FORM + r", .* of shape \(3,\)"),
    (torch.tensor([1, 2], device="meta"), ValueError, RNG_STATE_FORM + r", .* on meta"),
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


# CUDA graphs and the drawn state -------------------------------------------------------------
# A CUDA call without rng_state draws its (seed, offset) in the extension as PyTorch's own dropout
# does: in a captured CUDA graph every replay draws a fresh mask, and the returned rng_state (a
# CUDA tensor the forward kernel fills) says which.

GRAPH_DROPOUT_P = 0.2


def skip_unless_kernel_runs(kernel, head_dim, directions=("forward", "backward")):
    for direction in directions:
        reason = kernel_unavailable(kernel, head_dim, direction)
        if reason:
            pytest.skip(reason)


def replayed(graph, outputs, count=2):
    """Copies of the graph's outputs after each of `count` replays (rng_state tensors to the CPU)."""
    results = []
    for _ in range(count):
        graph.replay()
        results.append(tuple(t.cpu() if t.dtype == torch.int64 else t.clone() for t in outputs))
    return results


def check_out_against_oracle(name, out, q, k, v, causal, rng_state):
    scale = 1.0 / math.sqrt(q.shape[-1])
    options = {"dropout_p": GRAPH_DROPOUT_P, "rng_state": rng_state}
    oracle_out, _ = naive_attention(q, k, v, scale, causal, torch.float32, **options)
    same_out, _ = naive_attention(q, k, v, scale, causal, **options)
    fa2_check(out, oracle_out, same_out, f"{name} out")


def graph_inputs(cuda_gen, requires_grad=False):
    """q, k, v (GQA, odd lengths) and dout of the graph tests, in the smallest compiled head dim."""
    q, k, v, dout = cuda_inputs(cuda_gen, COMPILED_DTYPES[-1], 255, 320, 4, 2, COMPILED_HEAD_DIMS[0])
    return (*(t.requires_grad_(requires_grad) for t in (q, k, v)), dout)


@requires_cuda
@requires_backward
@requires_dropout
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_captured_flash_forward_and_backward_draw_a_fresh_mask_per_replay(cuda_gen, kernel, causal):
    q, k, v, dout = graph_inputs(cuda_gen)
    skip_unless_kernel_runs(kernel, q.shape[-1])
    options = {"causal": causal, "kernel": kernel, "dropout_p": GRAPH_DROPOUT_P}

    def step():
        out, lse, rng_state = flash_cutlass.flash_forward(q, k, v, **options)
        assert rng_state.device == q.device and rng_state.dtype == torch.int64 and tuple(rng_state.shape) == (2,)
        return (out, rng_state, *flash_cutlass.flash_backward(dout, q, k, v, out, lse, rng_state=rng_state, **options))

    graph, outputs = capture_graph(step)
    replays = replayed(graph, outputs)
    (first_out, first_state, *_), (second_out, second_state, *_) = replays
    assert first_state[0] == second_state[0] and first_state[1] != second_state[1]
    assert not torch.equal(first_out, second_out)
    for out, rng_state, *grads in replays:
        # The eager call given the replay's (seed, offset), on the CPU, computes what the replay did.
        eager_out, eager_lse, eager_state = flash_cutlass.flash_forward(q, k, v, rng_state=rng_state, **options)
        assert eager_state is rng_state and torch.equal(out, eager_out)
        eager_grads = flash_cutlass.flash_backward(dout, q, k, v, eager_out, eager_lse, rng_state=rng_state, **options)
        for name, grad, expected in zip(("dq", "dk", "dv"), grads, eager_grads):
            torch.testing.assert_close(grad, expected, msg=lambda m, name=name: f"{name}: {m}")
    check_out_against_oracle(f"{kernel} replay", first_out, q, k, v, causal, first_state)
    check_gradients_against_oracle(f"{kernel} replay", replays[0][2:], q, k, v, dout, causal,
                                   dropout_p=GRAPH_DROPOUT_P, rng_state=first_state)


def replay_mismatch(replay, replayed_out, eager_out, step, rng_state, q, k, v, causal):
    """What a replay's out that differs from the eager call's at its state is: the share of (batch,
    row, head) rows that differ, whether a second eager call agrees with the first, the offsets
    near the state (if any) at which an eager call gives the replay's out, and which of the two
    passes the oracle at the state (the wrong one is the one that does not)."""
    rows_differing = (replayed_out != eager_out).any(dim=-1).float().mean().item()
    again = step(rng_state=rng_state)[0]
    seed, offset = rng_state.tolist()
    matching = [delta for delta in range(-16, 17, 4)
                if offset + delta >= 0 and torch.equal(step(rng_state=state(seed, offset + delta))[0], replayed_out)]

    def verdict(out):
        try:
            check_out_against_oracle("", out, q.detach(), k.detach(), v.detach(), causal, rng_state)
            return "passes"
        except AssertionError:
            return "fails"

    return (f"replay {replay}: out differs from the eager call's at (seed, offset) ({seed}, {offset}) in "
            f"{rows_differing:.1%} of its rows; a second eager call {'agrees' if torch.equal(again, eager_out) else 'differs'}; "
            f"eager calls equal the replay at offset deltas {matching}; against the oracle at the state the "
            f"replay {verdict(replayed_out)}, the eager call {verdict(eager_out)}")


@requires_cuda
@requires_backward
@requires_dropout
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_captured_flash_attention_draws_what_eager_draws(cuda_gen, monkeypatch, kernel, causal):
    """flash_attention forward and backward in one graph: each replay draws from the default
    generator what an eager call would at that state (seed, the offset before the replay), and the
    backward drops what the forward dropped."""
    q, k, v, dout = graph_inputs(cuda_gen, requires_grad=True)
    skip_unless_kernel_runs(kernel, q.shape[-1])
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", kernel)
    options = {"causal": causal, "kernel": kernel, "dropout_p": GRAPH_DROPOUT_P}

    def step(**extra):
        out = flash_cutlass.flash_attention(q, k, v, **options, **extra)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.cuda.manual_seed(20261201)
    generator = torch.cuda.default_generators[q.device.index]
    graph, outputs = capture_graph(step)
    results, states = [], []
    for _ in range(2):
        states.append(state(generator.initial_seed(), generator.get_offset()))
        (result,) = replayed(graph, outputs, count=1)
        results.append(result)
        expected = step(rng_state=states[-1])
        assert torch.equal(result[0], expected[0]), replay_mismatch(len(results), result[0], expected[0], step,
                                                                    states[-1], q, k, v, causal)
        for name, grad, expected_grad in zip(("dq", "dk", "dv"), result[1:], expected[1:]):
            torch.testing.assert_close(grad, expected_grad, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(results[0][0], results[1][0])
    check_out_against_oracle(f"{kernel} replay", results[0][0], q.detach(), k.detach(), v.detach(), causal,
                             states[0])


@requires_cuda
@requires_backward
@requires_dropout
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_captured_masks_equal_the_reference_mask(kernel):
    """test_kernel_masks_equal_the_reference_mask's read-back (zero q and k, one-hot values and
    output gradients) in a captured graph: each replay's forward and backward masks are the
    reference's mask of the rng_state the replay returned."""
    dtype, head_dim = COMPILED_DTYPES[-1], max(COMPILED_HEAD_DIMS)
    forward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "forward") else kernel
    backward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "backward") else kernel
    # One-hot values and output gradients need sk and sq <= head_dim.
    batch, heads, sq, sk, dropout_p = 2, 3, min(96, head_dim), head_dim - 8, 0.4
    q = torch.zeros(batch, sq, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.zeros(batch, sk, heads, head_dim, device="cuda", dtype=dtype)
    v = torch.eye(sk, head_dim, device="cuda", dtype=dtype).expand(batch, heads, sk, head_dim).transpose(1, 2)
    v = v.contiguous()
    dout = torch.eye(sq, head_dim, device="cuda", dtype=dtype).expand(batch, heads, sq, head_dim).transpose(1, 2)
    dout = dout.contiguous()

    def step():
        out, lse, rng_state = flash_cutlass.flash_forward(q, k, v, kernel=forward_kernel, dropout_p=dropout_p)
        _, _, dv = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel=backward_kernel, dropout_p=dropout_p,
                                                rng_state=rng_state)
        return out, rng_state, dv

    graph, outputs = capture_graph(step)
    replays = replayed(graph, outputs)
    assert not torch.equal(replays[0][1], replays[1][1])
    for out, rng_state, dv in replays:
        expected = dropout_keep_mask(rng_state, dropout_p, batch, heads, sq, 0, sk, "cuda")
        forward_mask = out[..., :sk].transpose(1, 2) > 0  # (batch, heads, sq, sk)
        backward_mask = dv[..., :sq].permute(0, 2, 3, 1) > 0  # dv[b, j, h, i] -> (batch, heads, sq, sk)
        for name, mask in ((f"{forward_kernel} forward", forward_mask), (f"{backward_kernel} backward", backward_mask)):
            assert torch.equal(mask, expected), f"{name}: {(mask != expected).sum()} bits differ"


@requires_cuda
@requires_backward
@requires_dropout
@pytest.mark.parametrize("kernel", ("sm80", "sm90"))
def test_flash_forward_returns_its_drawn_state_on_the_device(cuda_gen, kernel):
    """Eager: the rng_state of a drawn mask is a CUDA tensor holding the default generator's seed
    and offset, which advances by 4; flash_backward and flash_forward take it as it is or copied to
    the CPU; the results match the oracle with that mask."""
    q, k, v, dout = graph_inputs(cuda_gen)
    skip_unless_kernel_runs(kernel, q.shape[-1])
    options = {"causal": True, "kernel": kernel, "dropout_p": GRAPH_DROPOUT_P}
    torch.cuda.manual_seed(77)
    generator = torch.cuda.default_generators[q.device.index]
    offset = generator.get_offset()
    out, lse, rng_state = flash_cutlass.flash_forward(q, k, v, **options)
    assert rng_state.device == q.device and rng_state.dtype == torch.int64
    assert rng_state.tolist() == [77, offset] and generator.get_offset() == offset + 4
    for given in (rng_state, rng_state.cpu()):
        again, _, returned = flash_cutlass.flash_forward(q, k, v, rng_state=given, **options)
        assert returned is given and torch.equal(again, out)
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, rng_state=rng_state, **options)
    cpu_state_grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, rng_state=rng_state.cpu(), **options)
    for grad, expected in zip(grads, cpu_state_grads):
        torch.testing.assert_close(grad, expected)
    check_out_against_oracle(f"{kernel} forward", out, q, k, v, True, rng_state)
    check_gradients_against_oracle(f"{kernel} backward", grads, q, k, v, dout, True, dropout_p=GRAPH_DROPOUT_P,
                                   rng_state=rng_state)


@requires_cuda
@requires_backward
@requires_dropout
def test_captured_call_with_a_given_rng_state_replays_its_mask(cuda_gen):
    """A CPU rng_state given by the user is one mask: every replay applies it, as eager calls do."""
    q, k, v, dout = graph_inputs(cuda_gen, requires_grad=True)
    rng_state = state(4242, 64)

    def step():
        out = flash_cutlass.flash_attention(q, k, v, causal=True, dropout_p=GRAPH_DROPOUT_P, rng_state=rng_state)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    graph, outputs = capture_graph(step)
    first, second = replayed(graph, outputs)
    expected = step()
    assert torch.equal(first[0], second[0]) and torch.equal(first[0], expected[0])
    for grads in (first[1:], second[1:]):
        for grad, expected_grad in zip(grads, expected[1:]):
            torch.testing.assert_close(grad, expected_grad)


@requires_cuda
@requires_dropout
def test_captured_draws_come_from_a_registered_generator(cuda_gen):
    """generator= in a graph (registered with it, as PyTorch requires of generators other than the
    default one): the replays draw from it and leave the default generator alone."""
    q, k, v, _ = graph_inputs(cuda_gen)
    generator = torch.Generator(device="cuda").manual_seed(5)
    default = torch.cuda.default_generators[q.device.index]

    def step():
        return flash_cutlass.flash_forward(q, k, v, dropout_p=GRAPH_DROPOUT_P, generator=generator)

    graph, outputs = capture_graph(step, generators=(generator,))
    default_offset = default.get_offset()
    (first_out, _, first_state), (second_out, _, second_state) = replayed(graph, outputs)
    assert first_state[0] == second_state[0] == 5 and first_state[1] != second_state[1]
    assert not torch.equal(first_out, second_out) and default.get_offset() == default_offset
    eager_out, _, _ = flash_cutlass.flash_forward(q, k, v, dropout_p=GRAPH_DROPOUT_P, rng_state=first_state)
    assert torch.equal(first_out, eager_out)

"""The Hopper backward kernel (kernel="sm90") at the edges of its tiles and pipeline.

Its CTA owns 128 keys (64 past head dim 128) and walks query blocks of 64 rows (128 at head dim
64) through a load pipeline of 2 or 3 stages (dO in one past head dim 128): the lengths below put
sequence ends one row before, at and after those multiples, give a CTA 1 to 5 query blocks (fewer,
as many and more than the stages),
and cover GQA ratios 1 to 8. Head dims between the compiled ones run padded in the next one. Gradients
are checked against the fp32 oracle with FlashAttention-2's rule. Also: a CUDA graph of the
backward replays to the same gradients, and deterministic=True gives bitwise equal gradients run
after run. Skipped (with the reason) without an H100/H200 build.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import naive_attention
from helpers import (COMPILED_SM90_BACKWARD_HEAD_DIMS, capture_graph, fa2_check, kernel_unavailable,
                     options_left_out, requires_backward, requires_cuda)

pytestmark = [requires_cuda, requires_backward]

HEADS = 8
# (seqlen_q, seqlen_k): query blocks of 64 and key blocks of 128 cut one before, at and after. (With
# a single key every gradient of dK is 0 up to rounding, and the rule's bound is then its eps.)
TAIL_SEQLENS = [(63, 129), (64, 128), (65, 127), (128, 64), (129, 200), (191, 191), (192, 65), (320, 257),
                (1, 300), (300, 2)]


def skip_unless_hopper_backward(head_dim: int) -> None:
    reason = kernel_unavailable("sm90", head_dim, "backward")
    if reason:
        pytest.skip(reason)


def assert_gradients_close(got, want, label):
    """dq, dk and dv of two calls equal up to the rounding that atomics' orders leave."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{label}, {name}: {m}")


def assert_gradients_equal(got, want, label):
    """dq, dk and dv of two calls bitwise equal."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{label}: {name} differs"


def oracle_gradients(q, k, v, dout, causal, dtype, **options):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*leaves, 1.0 / math.sqrt(q.shape[-1]), causal, **options)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def random_inputs(gen, batch, seqlen_q, seqlen_k, heads_k, head_dim):
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    return (rand(batch, seqlen_q, HEADS, head_dim), rand(batch, seqlen_k, heads_k, head_dim),
            rand(batch, seqlen_k, heads_k, head_dim), rand(batch, seqlen_q, HEADS, head_dim))


def check_hopper_backward(gen, head_dim, causal, seqlen_q, seqlen_k, heads_k, batch=2, **options):
    """kernel="sm90"'s gradients of random inputs against the fp32 oracle, FlashAttention-2's rule."""
    q, k, v, dout = random_inputs(gen, batch, seqlen_q, seqlen_k, heads_k, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, **options)
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel="sm90", **options)
    oracle = oracle_gradients(q, k, v, dout, causal, torch.float32, **options)
    same_dtype = oracle_gradients(q, k, v, dout, causal, torch.bfloat16, **options)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, oracle, same_dtype):
        fa2_check(grad, ref, base,
                  f"sm90 backward {name} (head dim {head_dim}, {seqlen_q}, {seqlen_k}, heads_k {heads_k})")


@pytest.mark.parametrize("heads_k", [8, 4, 2, 1], ids=["gqa1", "gqa2", "gqa4", "gqa8"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", TAIL_SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_hopper_backward_tails_and_gqa_ratios(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, heads_k):
    skip_unless_hopper_backward(head_dim)
    check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, heads_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [d for d in (96, 160, 192) if d not in COMPILED_SM90_BACKWARD_HEAD_DIMS
                                      and d < max(COMPILED_SM90_BACKWARD_HEAD_DIMS, default=0)])
def test_hopper_backward_pads_head_dims_it_lacks(cuda_gen, head_dim, causal):
    """kernel="sm90" runs a head dim between its compiled ones in the next one up (columns past
    head_dim load as zeros and are not stored)."""
    skip_unless_hopper_backward(head_dim)
    check_hopper_backward(cuda_gen, head_dim, causal, 129, 200, 2)


@pytest.mark.parametrize("head_dim", [96, 192])
def test_automatic_backward_runs_head_dims_96_and_192_on_the_hopper_kernel(cuda_gen, head_dim):
    """Head dims 96 and 192 take their own Hopper backwards: the automatic choice's dK and dV
    (written once, no atomics) are kernel="sm90"'s, bitwise."""
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 2, 200, 300, HEADS, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    _, dk_auto, dv_auto = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel="auto")
    _, dk_sm90, dv_sm90 = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel="sm90")
    assert torch.equal(dk_auto, dk_sm90) and torch.equal(dv_auto, dv_sm90)


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_hopper_backward_is_the_same_in_a_cuda_graph(cuda_gen, head_dim):
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 2, 1000, 1000, 2, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    eager = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, kernel="sm90")
    graph, captured = capture_graph(
        lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, kernel="sm90"))
    dout.mul_(-1.0)  # the replay reads the new dout
    graph.replay()
    torch.cuda.synchronize()
    for name, replayed, reference in zip(("dq", "dk", "dv"), captured, eager):
        # dQ (and with GQA dK, dV) adds in an order that may change between runs: equal up to
        # rounding, with the sign flipped.
        torch.testing.assert_close(replayed.float(), -reference.float(), atol=2e-2, rtol=2e-2, msg=name)


DETERMINISTIC_HEAD_DIMS = list(COMPILED_SM90_BACKWARD_HEAD_DIMS)


def check_deterministic_runs(gen, head_dim, seqlens, heads_k, causal, options, label, batch=2):
    """Three deterministic kernel="sm90" backwards of random inputs: bitwise equal, and the first
    against the fp32 oracle with FlashAttention-2's rule."""
    q, k, v, dout = random_inputs(gen, batch, *seqlens, heads_k, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, **options)
    runs = [flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, kernel="sm90",
                                         **options) for _ in range(3)]
    for run in runs[1:]:
        assert_gradients_equal(run, runs[0], f"two deterministic runs ({label})")
    oracle = oracle_gradients(q, k, v, dout, causal, torch.float32, **options)
    same_dtype = oracle_gradients(q, k, v, dout, causal, torch.bfloat16, **options)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), runs[0], oracle, same_dtype):
        fa2_check(grad, ref, base, f"deterministic sm90 backward {name} ({label})")


@pytest.mark.parametrize("heads_k", [8, 2], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_deterministic_hopper_backward_is_bitwise_reproducible_and_correct(cuda_gen, head_dim, mask, heads_k):
    """Six key blocks of 128 (five with the window's left edge) add to each query block in turn:
    three runs give bitwise equal gradients, which pass the rule against the fp32 oracle."""
    skip_unless_hopper_backward(head_dim)
    causal = mask == "causal"
    options = {"window_size": (300, 40)} if mask == "window" else {}
    reason = options_left_out(**options)
    if reason:
        pytest.skip(reason)
    check_deterministic_runs(cuda_gen, head_dim, (333, 700), heads_k, causal, options, f"head dim {head_dim}, {mask}")


@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_deterministic_rotated_walks_over_several_heads_a_cta(cuda_gen, head_dim):
    """Without a mask, a deterministic call whose key blocks fit on the SMs walks rotated: a
    persistent grid of whole heads, each key block starting at its own query block and taking its
    turn as it arrives. 1050 queries and 1000 keys (17 query blocks; 8 key blocks of 128, 16 of 64
    past head dim 128) over 3 x 8 heads: two or three heads a CTA, bitwise equal runs."""
    skip_unless_hopper_backward(head_dim)
    check_deterministic_runs(cuda_gen, head_dim, (1050, 1000), 2, False, {}, f"head dim {head_dim}, rotated",
                             batch=3)


@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_deterministic_rotated_walks_in_a_cuda_graph(cuda_gen, head_dim):
    """The rotated walks launch cooperatively (all CTAs resident at once); a captured graph replays
    them to the eager gradients, bitwise."""
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 3, 700, 650, 2, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v)

    def backward():
        return flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=True, kernel="sm90")

    eager = backward()
    graph, captured = capture_graph(backward)
    graph.replay()
    torch.cuda.synchronize()
    for name, replayed, reference in zip(("dq", "dk", "dv"), captured, eager):
        assert torch.equal(replayed, reference), name


@pytest.mark.parametrize("case", ["window_of_long_keys", "softcap_alibi"])
@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_deterministic_hopper_backward_edges(cuda_gen, head_dim, case):
    """A one-sided window over 900 keys for 200 queries (key blocks whose query range is empty, and
    query blocks only some key blocks reach), and the extended kernels (soft cap and ALiBi, whose
    instantiation takes the window mask at run time): bitwise equal runs, close to the oracle."""
    skip_unless_hopper_backward(head_dim)
    if case == "window_of_long_keys":
        options, seqlens = {"window_size": (64, 0)}, (200, 900)
        reason = options_left_out(window_size=(64, 0))
        if reason:
            pytest.skip(reason)
    else:
        reason = options_left_out(softcap=30.0, alibi=True)
        if reason:
            pytest.skip(reason)
        slopes = torch.rand(HEADS, generator=cuda_gen, device="cuda") * 0.1
        options, seqlens = {"softcap": 30.0, "alibi_slopes": slopes}, (333, 700)
    check_deterministic_runs(cuda_gen, head_dim, seqlens, 2, False, options, f"head dim {head_dim}, {case}")


def test_deterministic_varlen_hopper_backward_is_bitwise_reproducible(cuda_gen):
    """Packed sequences of different lengths (each its own turns) and a max_seqlen above the longest."""
    if not DETERMINISTIC_HEAD_DIMS:
        pytest.skip("no Hopper backward in this build")
    head_dim = DETERMINISTIC_HEAD_DIMS[-1]
    skip_unless_hopper_backward(head_dim)
    lengths = [517, 1, 300, 129]
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(torch.bfloat16)

    q, k, v, dout = rand(total, HEADS, head_dim), rand(total, 2, head_dim), rand(total, 2, head_dim), rand(total, HEADS, head_dim)
    max_seqlen = max(lengths) + 64
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    runs = [flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                causal=True, deterministic=True, kernel="sm90") for _ in range(3)]
    for run in runs[1:]:
        assert_gradients_equal(run, runs[0], "two deterministic varlen runs")
    atomics = flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen,
                                                  max_seqlen, causal=True, kernel="sm90")
    assert_gradients_close(runs[0], atomics, "deterministic varlen against atomics")


@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_automatic_deterministic_backward_runs_on_the_hopper_kernel(cuda_gen, head_dim):
    """kernel="auto" with deterministic=True takes the Hopper backward: its gradients are bitwise
    kernel="sm90"'s (the sm80 path's dQ kernel sums in another order)."""
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 1, 400, 400, 4, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    auto = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, kernel="auto")
    hopper = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, kernel="sm90")
    assert_gradients_equal(auto, hopper, "kernel='auto' against kernel='sm90'")


def backward_peak_bytes(dout, q, k, v, out, lse, **options):
    """flash_backward's gradients and the bytes its peak of requested allocations grew by (requested:
    the caching allocator hands out a cached block whole where less than 1 MiB of it would be left,
    which the allocated bytes count)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_stats()["requested_bytes.all.current"]
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel="sm90", **options)
    torch.cuda.synchronize()
    return grads, torch.cuda.memory_stats()["requested_bytes.all.peak"] - baseline


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_gqa_hopper_backward_accumulates_per_kv_head(cuda_gen, monkeypatch, head_dim):
    # 16 query heads on 2 K/V heads, one head a tile: the group's dK and dV are added per K/V head
    # (fp32, 2 heads' worth), not kept per query head (16 heads' worth) and summed afterwards.
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(WALK_ENV, "1")
    batch, seqlen, heads, heads_k = 1, 2048, 16, 2
    dtype = torch.bfloat16
    q, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=cuda_gen, device="cuda").to(dtype)
               for _ in range(2))
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, generator=cuda_gen, device="cuda").to(dtype)
            for _ in range(2))
    out, lse = flash_cutlass.flash_forward(q, k, v)
    grads, peak = backward_peak_bytes(dout, q, k, v, out, lse)
    gradients = sum(g.numel() * g.element_size() for g in grads)
    dq_accumulator = batch * seqlen * heads * head_dim * 4  # fp32; a compiled head dim: no padding
    per_kv_head = 2 * batch * seqlen * heads_k * head_dim * 4
    per_query_head = 2 * batch * seqlen * heads * head_dim * 4
    # Halfway between the per-K/V-head and the per-query-head accumulators (D adds 128 KiB).
    bound = gradients + dq_accumulator + (per_kv_head + per_query_head) // 2
    assert per_kv_head + (4 << 20) < (per_kv_head + per_query_head) // 2
    assert peak <= bound, f"backward allocated {peak} bytes at its peak, expected at most {bound}"
    expected = oracle_gradients(q, k, v, dout, False, torch.float32)
    for got, want in zip(grads, expected):
        assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


# GQA walks ($FLASH_CUTLASS_GQA_WALK_HEADS, csrc/flash_api.cpp): a CTA's key tile walks several query
# heads of its K/V head's group, K and V loaded once, dK and dV summed in registers; over the whole
# group it writes dk and dv itself, over a part it adds to the K/V head's fp32 accumulators.
WALK_ENV = "FLASH_CUTLASS_GQA_WALK_HEADS"
# 8 query heads on 2 K/V heads: a group of 4, walked whole or in halves.
WALKS = {"whole": 4, "half": 2}
WALK_SEQLENS = [(63, 129), (65, 127), (129, 200), (1, 300), (300, 2), (300, 4500)]


@pytest.mark.parametrize("walk", list(WALKS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", WALK_SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_gqa_walks_over_query_and_key_tails(cuda_gen, monkeypatch, head_dim, causal, seqlen_q, seqlen_k, walk):
    """Walks over tails, seqlen 1 and (300, 4500) (36 or 71 key blocks a head: more tiles than SMs at
    batch 3): gradients against the oracle."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(WALK_ENV, str(WALKS[walk]))
    check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, 2, batch=3)


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_automatic_gqa_walks_and_mqa(cuda_gen, monkeypatch, head_dim):
    """'auto' (select.h's rule) on MQA, batch 2, 8448 keys: 66 key blocks of 128 (132 of 64 past
    head dim 128), so that on 132 SMs whole groups fill every SM and the rule walks all 8 query
    heads: dK and dV are then bitwise those of the forced whole-group walk (no atomics in them).
    Against the oracle too, and the forced walk on a causal call."""
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 2, 64, 8448, 1, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    monkeypatch.setenv(WALK_ENV, "auto")
    automatic = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel="sm90")
    oracle = oracle_gradients(q, k, v, dout, False, torch.float32)
    same_dtype = oracle_gradients(q, k, v, dout, False, torch.bfloat16)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), automatic, oracle, same_dtype):
        fa2_check(grad, ref, base, f"automatic GQA walk {name} (head dim {head_dim})")
    monkeypatch.setenv(WALK_ENV, "8")
    whole = flash_cutlass.flash_backward(dout, q, k, v, out, lse, kernel="sm90")
    if torch.cuda.get_device_properties(q.device).multi_processor_count == 132:
        assert torch.equal(automatic[1], whole[1]) and torch.equal(automatic[2], whole[2])
    check_hopper_backward(cuda_gen, head_dim, True, 333, 500, 1, batch=2)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_deterministic_whole_group_walks(cuda_gen, monkeypatch, head_dim, mask):
    """Deterministic walks over whole groups: turns per query head, bitwise equal runs; without a
    mask at 1050 / 1000 the rotated walks too."""
    skip_unless_hopper_backward(head_dim)
    options = {"window_size": (300, 40)} if mask == "window" else {}
    reason = options_left_out(**options)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv(WALK_ENV, "4")
    check_deterministic_runs(cuda_gen, head_dim, (333, 700), 2, mask == "causal", options,
                             f"head dim {head_dim}, {mask}, whole-group walks")
    if mask == "none":
        # 9 x 2 walks of 8 key blocks of 128 (16 of 64): 144 (288) tiles on a rotated grid of at
        # most 128 CTAs, so that CTAs take several multi-head tiles.
        check_deterministic_runs(cuda_gen, head_dim, (1050, 1000), 2, False, {},
                                 f"head dim {head_dim}, rotated whole-group walks", batch=9)


def packed_causal_backward(gen, head_dim):
    """kernel="sm90"'s causal backward of a packed batch of random inputs (lengths 517, 1, 300 and 129,
    8 query heads on 2 K/V heads, max_seqlen 64 above the longest), as a function of its options."""
    lengths = [517, 1, 300, 129]
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total, max_seqlen = sum(lengths), max(lengths) + 64

    def rand(heads):
        return torch.randn(total, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)

    q, k, v, dout = rand(HEADS), rand(2), rand(2), rand(HEADS)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    return lambda **options: flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens,
                                                                 max_seqlen, max_seqlen, causal=True, kernel="sm90",
                                                                 **options)


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_gqa_walks_in_variable_length_calls(cuda_gen, monkeypatch, head_dim):
    """Packed sequences with tails in every head's last query block (the loader's tail barrier
    changes phase once a head): half and whole walks, and deterministic whole walks (bitwise equal
    runs), against one head a tile."""
    skip_unless_hopper_backward(head_dim)
    backward = packed_causal_backward(cuda_gen, head_dim)

    def gradients(walk, deterministic=False):
        monkeypatch.setenv(WALK_ENV, walk)
        return backward(deterministic=deterministic)

    one_head = gradients("1")
    walks = {walk: gradients(walk) for walk in ("2", "4")}
    walks["4, deterministic"] = gradients("4", deterministic=True)
    again = gradients("4", deterministic=True)
    assert_gradients_equal(again, walks["4, deterministic"], "two deterministic varlen walks")
    for walk, grads in walks.items():
        assert_gradients_close(grads, one_head, f"walk {walk}")


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_gqa_walks_leave_the_extended_kernels_alone(cuda_gen, monkeypatch, head_dim):
    """A soft cap and ALiBi run one query head a tile whatever the variable says; MHA calls ignore it."""
    skip_unless_hopper_backward(head_dim)
    reason = options_left_out(softcap=30.0, alibi=True)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv(WALK_ENV, "4")
    slopes = torch.rand(HEADS, generator=cuda_gen, device="cuda") * 0.1
    check_hopper_backward(cuda_gen, head_dim, False, 200, 300, 2, softcap=30.0, alibi_slopes=slopes)
    monkeypatch.setenv(WALK_ENV, "3")
    check_hopper_backward(cuda_gen, head_dim, True, 200, 300, HEADS)


@pytest.mark.parametrize("value,deterministic,message", [
    ("0", False, "positive number"), ("two", False, "positive number"), ("3", False, "must divide the 4"),
    ("2", True, "a deterministic call walks 1 or all 4")])
def test_gqa_walk_values_are_checked(cuda_gen, monkeypatch, value, deterministic, message):
    head_dim = max(COMPILED_SM90_BACKWARD_HEAD_DIMS, default=0)
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 1, 64, 64, 2, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    monkeypatch.setenv(WALK_ENV, value)
    with pytest.raises(ValueError, match=f"{WALK_ENV}.*{message}"):
        flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic, kernel="sm90")


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_default_walks_whole_groups_without_a_mask_only(cuda_gen, monkeypatch, head_dim):
    """$FLASH_CUTLASS_GQA_WALK_HEADS unset: cuDNN's 64 / 8 heads at 4k walk whole groups without a
    mask (no fp32 dK/dV accumulators) at head dims 96, 128 and 256, deterministic at every head dim
    (csrc/flash_api.cpp, walks_by_default), and one head a tile causal (the K/V heads'
    accumulators) and elsewhere; the same gradients as one head a tile."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.delenv(WALK_ENV, raising=False)
    batch, seqlen, heads, heads_k = 1, 4096, 64, 8
    q, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    per_kv_head = 2 * batch * seqlen * heads_k * head_dim * 4
    row_buffers = batch * heads * seqlen * 4 + (1 << 20)  # D (1 MiB here) and under 1 MiB of turn counters
    assert per_kv_head > 4 * row_buffers
    cases = ((False, False, head_dim in (96, 128, 256)), (True, False, False), (False, True, True))
    for causal, deterministic, walks in cases:
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
        monkeypatch.delenv(WALK_ENV, raising=False)
        grads, peak = backward_peak_bytes(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        gradients = sum(g.numel() * g.element_size() for g in grads)
        dq_accumulator = batch * seqlen * heads * head_dim * 4
        label = f"causal {causal}, deterministic {deterministic}"
        if walks:
            assert peak <= gradients + dq_accumulator + row_buffers, f"{label}: fp32 dK/dV allocated ({peak} bytes)"
        else:
            assert peak >= gradients + dq_accumulator + per_kv_head, f"{label}: no fp32 dK/dV ({peak} bytes)"
        monkeypatch.setenv(WALK_ENV, "1")
        one_head = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                                kernel="sm90")
        assert_gradients_close(grads, one_head, label)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_whole_group_walks_allocate_no_fp32_dk_dv(cuda_gen, monkeypatch, head_dim, deterministic):
    """Walking whole groups, the kernel writes dk and dv itself: no fp32 dK/dV accumulators, neither per
    K/V head nor (deterministic calls otherwise) per query head."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(WALK_ENV, "8")
    batch, seqlen, heads, heads_k = 1, 2048, 16, 2
    q, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    out, lse = flash_cutlass.flash_forward(q, k, v)
    grads, peak = backward_peak_bytes(dout, q, k, v, out, lse, deterministic=deterministic)
    gradients = sum(g.numel() * g.element_size() for g in grads)
    dq_accumulator = batch * seqlen * heads * head_dim * 4
    per_kv_head = 2 * batch * seqlen * heads_k * head_dim * 4
    # D and the turn counters take under 1 MiB; the smallest fp32 dK/dV accumulators 2 MiB or more.
    assert per_kv_head >= 2 << 20
    bound = gradients + dq_accumulator + (1 << 20)
    assert peak <= bound, f"backward allocated {peak} bytes at its peak, expected at most {bound}"
    expected = oracle_gradients(q, k, v, dout, False, torch.float32)
    for got, want in zip(grads, expected):
        assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


# $FLASH_CUTLASS_BWD_V_AFTER_Q=1 (csrc/flash_api.cpp): in walks of one tile a CTA the loader issues V
# after the first Q and dO, on a barrier of its own.
V_AFTER_Q_ENV = "FLASH_CUTLASS_BWD_V_AFTER_Q"


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(63, 129), (1, 300), (300, 2), (333, 700)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_v_after_the_first_query_block(cuda_gen, monkeypatch, head_dim, causal, seqlen_q, seqlen_k):
    """MHA, GQA walked over whole groups, a window (key blocks no query sees: tiles without steps),
    and the soft cap's kernels (past head dim 128 both consumer warpgroups read V there): gradients
    against the oracle."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(V_AFTER_Q_ENV, "1")
    check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, HEADS)
    monkeypatch.setenv(WALK_ENV, "4")
    check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, 2)
    if not options_left_out(window_size=(40, 8)):
        check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, 2, window_size=(40, 8))
    if not options_left_out(softcap=30.0):
        check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, 2, softcap=30.0)


@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_v_after_the_first_query_block_deterministic_and_varlen(cuda_gen, monkeypatch, head_dim):
    """Deterministic runs stay bitwise equal (one head a tile and whole-group walks); a causal packed
    batch of other key lengths than query lengths (key tails land with K on the zeroed path, full
    key blocks with V later; first query blocks that are tails) matches the calls that load V first."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(V_AFTER_Q_ENV, "1")
    check_deterministic_runs(cuda_gen, head_dim, (333, 700), 2, True, {}, f"head dim {head_dim}, V after Q")
    monkeypatch.setenv(WALK_ENV, "4")
    check_deterministic_runs(cuda_gen, head_dim, (333, 700), 2, True, {}, f"head dim {head_dim}, V after Q, walks")
    monkeypatch.delenv(WALK_ENV)
    lengths_q, lengths_k = [517, 1, 30, 129], [600, 257, 300, 64]
    cu_seqlens_q, cu_seqlens_k = (
        torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
        for lengths in (lengths_q, lengths_k))

    def rand(total, heads):
        return torch.randn(total, heads, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)

    q, dout = rand(sum(lengths_q), HEADS), rand(sum(lengths_q), HEADS)
    k, v = rand(sum(lengths_k), 2), rand(sum(lengths_k), 2)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=True)

    def gradients(order):
        monkeypatch.setenv(V_AFTER_Q_ENV, order)
        return flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                                   causal=True, kernel="sm90")

    assert_gradients_close(gradients("1"), gradients("0"), "V after Q against V with K")


# dQ's first store (csrc/flash_api.cpp; $FLASH_CUTLASS_BWD_DQ_FIRST_STORE=1, unset: on at head dims up
# to 128 and in deterministic calls): the first key block to reach a query block stores its dQ, the
# others add to it; dq_accum is never zeroed.
DQ_FIRST_STORE_ENV = "FLASH_CUTLASS_BWD_DQ_FIRST_STORE"
# Tails, seqlen 1, more queries than keys (causal: the first 260 rows see no key, their blocks
# unreached), fewer, and more key blocks than query blocks (rotated starts that coincide). Not 300
# queries against 2 keys: there causal dK is a sum over 2 rows a head, and FlashAttention-2's rule
# (twice torch's bf16 error) fails on one bf16 rounding of a single element, with the store or without.
DQ_FIRST_STORE_SEQLENS = [(1, 1), (63, 129), (300, 40), (2, 300), (1000, 1000), (700, 4500)]


def poison_cached_memory(megabytes=256):
    """Leaves NaNs in memory the caching allocator hands out next, so that a buffer a kernel reads
    before writing shows up as NaN rather than as the zeros of fresh memory."""
    torch.full((megabytes << 18,), float("nan"), device="cuda")
    torch.cuda.synchronize()


@pytest.mark.parametrize("heads_k", [8, 2], ids=["mha", "gqa4"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", DQ_FIRST_STORE_SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_dq_first_store(cuda_gen, monkeypatch, head_dim, causal, seqlen_q, seqlen_k, heads_k):
    """dQ's first store against the oracle, over memory left full of NaNs (an unwritten block of
    dq_accum would show), MHA and GQA (walks by default without a mask at some head dims)."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(DQ_FIRST_STORE_ENV, "1")
    poison_cached_memory()
    check_hopper_backward(cuda_gen, head_dim, causal, seqlen_q, seqlen_k, heads_k)


@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_dq_first_store_with_a_window_and_in_a_cuda_graph(cuda_gen, monkeypatch, head_dim):
    """A window (query blocks no key block reaches: zeros), and graph replays equal to the eager
    call (the counters zeroed by each replay's preprocess)."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(DQ_FIRST_STORE_ENV, "1")
    options = {"window_size": (100, 0)}
    if not options_left_out(**options):
        poison_cached_memory()
        check_hopper_backward(cuda_gen, head_dim, False, 500, 300, 2, **options)
    q, k, v, dout = random_inputs(cuda_gen, 2, 333, 700, 2, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    eager = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, kernel="sm90")
    graph, replayed = capture_graph(
        lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, kernel="sm90"))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert_gradients_close(replayed, eager, "graph replay")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", DETERMINISTIC_HEAD_DIMS)
def test_dq_first_store_in_deterministic_calls(cuda_gen, monkeypatch, head_dim, causal):
    """Deterministic calls store at their first turn and add after it in the same order: bitwise
    equal to the call without the switch (0 + x is x), over memory left full of NaNs; causal with
    more queries than keys (blocks no key block reaches), and rotated walks without a mask (1050 /
    1000), MHA and GQA walks of whole groups."""
    skip_unless_hopper_backward(head_dim)
    for seqlen_q, seqlen_k, heads_k in ((700, 333, 2), (1050, 1000, 8), (1050, 1000, 2)):
        q, k, v, dout = random_inputs(cuda_gen, 2, seqlen_q, seqlen_k, heads_k, head_dim)
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)

        def gradients(switch):
            monkeypatch.setenv(DQ_FIRST_STORE_ENV, switch)
            poison_cached_memory()
            return flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                                kernel="sm90")

        assert_gradients_equal(gradients("1"), gradients("0"), f"deterministic ({seqlen_q}, {seqlen_k}, heads_k "
                                                                 f"{heads_k}) with {DQ_FIRST_STORE_ENV}=1")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_BACKWARD_HEAD_DIMS)
def test_dq_first_store_switched_off(cuda_gen, monkeypatch, head_dim, causal):
    """FLASH_CUTLASS_BWD_DQ_FIRST_STORE=0: the preprocess zeroes dq_accum and every key block adds."""
    skip_unless_hopper_backward(head_dim)
    monkeypatch.setenv(DQ_FIRST_STORE_ENV, "0")
    check_hopper_backward(cuda_gen, head_dim, causal, 700, 333, 2)


def test_dq_first_store_leaves_varlen_calls_alone(cuda_gen, monkeypatch):
    """Variable-length calls keep their zeroed accumulator (a tail block's store would overwrite
    the next sequence's first rows)."""
    head_dim = max(COMPILED_SM90_BACKWARD_HEAD_DIMS, default=0)
    skip_unless_hopper_backward(head_dim)
    backward = packed_causal_backward(cuda_gen, head_dim)
    monkeypatch.setenv(DQ_FIRST_STORE_ENV, "0")
    off = backward()
    monkeypatch.setenv(DQ_FIRST_STORE_ENV, "1")
    poison_cached_memory()
    assert_gradients_close(backward(), off, f"varlen with {DQ_FIRST_STORE_ENV}=1")


@pytest.mark.parametrize("variable", [V_AFTER_Q_ENV, DQ_FIRST_STORE_ENV])
def test_opt_in_switches_take_0_or_1(cuda_gen, monkeypatch, variable):
    head_dim = max(COMPILED_SM90_BACKWARD_HEAD_DIMS, default=0)
    skip_unless_hopper_backward(head_dim)
    q, k, v, dout = random_inputs(cuda_gen, 1, 64, 64, HEADS, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=f"{variable} must be 0 or 1, got 'yes'"):
        flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=True, kernel="sm90")

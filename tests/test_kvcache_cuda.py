"""The KV-cache kernels (flash_attention_with_kvcache on CUDA tensors) against the reference: every
option, compiled head dim and dtype, padded head dims, GQA 1-8, contiguous and paged caches (page
sizes 1, 16, 64, 256, pages shuffled; chunks looked up by page and by row), decoding and chunked prefill, split-KV; the append (rotated
too) bitwise the reference's; paged == contiguous bitwise; lengths 0 and 1, fully masked rows, int
and None cache_seqlens, NaN past the lengths; attention sinks; CUDA graph replay and torch.compile == eager; out-of-range lengths and
block ids stay inside the cache. Skipped without a GPU."""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass import reference
from helpers import (COMPILED_DTYPES, SMEM_99_KIB, SMEM_PER_BLOCK_ENV, fa2_check, has_kernels, kernel_unavailable,
                     options_left_out, requires_cuda)
from kvcache_cases import check_lse, cloned, make_call, reference_of, rotary_tables

pytestmark = [requires_cuda, pytest.mark.skipif(not has_kernels(flash_cutlass.compiled_kvcache),
                                                reason="the build left the KV-cache kernels out")]

# A build without the KV-cache kernels has none (every test here skips); the parameters still need
# head dims to be collected.
try:
    KVCACHE_HEAD_DIMS = flash_cutlass.compiled_kvcache_head_dims() or (64, 128)
except RuntimeError:
    KVCACHE_HEAD_DIMS = (64, 128)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch."), marks=pytest.mark.skipif(
    d not in COMPILED_DTYPES, reason=f"{d} was not compiled")) for d in (torch.float16, torch.bfloat16)]
# The output's: the kernel rounds P to the input dtype before P V; the baseline (the reference in
# the input dtype) computes in fp32 and rounds only its output: eps covers the difference. The
# log-sum-exp has its own, much tighter tolerance (kvcache_cases.check_lse).
EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Head dims that are no compiled head dim and run padded into the next one (zero columns).
PADDED_HEAD_DIMS = [pytest.param(d, marks=pytest.mark.skipif(
    not any(c >= d for c in KVCACHE_HEAD_DIMS), reason=f"no compiled KV-cache head dim holds {d}"))
    for d in (40, 72, 136)]


def run(call, **options):
    return flash_cutlass.flash_attention_with_kvcache(**call, **options, return_lse=True)


def check_against_reference(call, dtype, num_splits=0, **options):
    """The kernels' out and lse against the reference's, and the caches they leave bitwise the
    reference's (the append, rotated with rotary)."""
    oracle, baseline, expected_caches = reference_of(call, **options)
    actual = cloned(call)
    out, lse = run(actual, num_splits=num_splits, **options)
    fa2_check(out, oracle[0].float(), baseline[0], "out", eps=EPS[dtype])
    check_lse(lse, baseline[1], options.get("softcap", 0.0))
    assert torch.equal(actual["k_cache"].cpu(), expected_caches[0])
    assert torch.equal(actual["v_cache"].cpu(), expected_caches[1])
    return out, lse, baseline


def options_of(name, gen, batch):
    """OPTIONS[name] as keyword arguments: ALiBi's slopes (batch, 8 heads) and the sinks (8 heads)
    drawn from gen, on the GPU."""
    options = OPTIONS[name]
    if options == "alibi":
        return {"alibi_slopes": torch.rand(batch, 8, generator=gen).cuda(), "causal": True}
    if options == "sinks":  # causal, so that some calls have rows that see no key
        return {"sinks": (2 * torch.randn(8, generator=gen) + 1).cuda(), "causal": True}
    return options


OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 0)},
    "window_both": {"window_size": (20, 3)},
    "softcap": {"softcap": 4.0, "causal": True},
    "alibi": "alibi",
    "sinks": "sinks",
    "scale": {"softmax_scale": 0.3},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", KVCACHE_HEAD_DIMS)
@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 256], ids=["contiguous", "p1", "p16", "p64", "p256"])
@pytest.mark.parametrize("heads,heads_k", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_decode_matches_reference(cuda_gen, dtype, head_dim, page_size, heads, heads_k):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=3, heads=heads, heads_k=heads_k, head_dim=head_dim, seqlens=(0, 200, 511),
                     page_size=page_size, capacity=512, dtype=dtype, device="cuda")
    check_against_reference(call, dtype, causal=True)


@pytest.mark.parametrize("head_dim", KVCACHE_HEAD_DIMS)
@pytest.mark.parametrize("page_size", [None, 1, 16, 256], ids=["contiguous", "p1", "p16", "p256"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (5, 5), (3, 0), (17, 17)])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_compact_kernel_for_99_kib_matches_reference(cuda_gen, monkeypatch, head_dim, page_size, seqlen_q,
                                                     seqlen_new, num_splits):
    """The kernel a GPU of 99 KiB a block runs (fewer stages at 64 and 96, two warps at 192 and
    256; forced here by the extension's cap on a block's shared memory): GQA 4, the append (17 new
    rows go through the append kernel from head dim 128, more than the attention kernel holds),
    lengths that end inside a chunk, splits."""
    dtype = COMPILED_DTYPES[-1]
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=3, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=head_dim, seqlens=(0, 77, 230),
                     seqlen_new=seqlen_new, page_size=page_size, capacity=256, dtype=dtype, device="cuda")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(SMEM_99_KIB))
    check_against_reference(call, dtype, num_splits=num_splits, causal=True)


@pytest.mark.parametrize("page_size,capacity", [(None, 100), (None, 96), (8, 96), (24, 96), (48, 96)],
                         ids=["contiguous100", "contiguous96", "p8", "p24", "p48"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunk_rows_looked_up_by_page_or_by_row(cuda_gen, page_size, capacity, num_splits):
    """The kernel looks a warp's 16-key chunk up once where its rows share a page (pages of a
    multiple of 16 rows, a contiguous cache of a multiple of 16 positions) and row by row elsewhere:
    both against the reference, with lengths that end inside a chunk and at the capacity."""
    dtype = COMPILED_DTYPES[-1]
    head_dim = 128 if 128 in KVCACHE_HEAD_DIMS else KVCACHE_HEAD_DIMS[-1]
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=3, seqlen_q=2, heads=8, heads_k=2, head_dim=head_dim, seqlens=(17, 61, capacity - 2),
                     seqlen_new=2, page_size=page_size, capacity=capacity, dtype=dtype, device="cuda")
    check_against_reference(call, dtype, num_splits=num_splits, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (5, 5), (70, 70), (3, 0)])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_every_option_matches_reference(cuda_gen, dtype, option, seqlen_q, seqlen_new, num_splits):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    head_dim = 128 if 128 in KVCACHE_HEAD_DIMS else KVCACHE_HEAD_DIMS[-1]
    call = make_call(gen, batch=2, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=head_dim, seqlens=(33, 150),
                     seqlen_new=seqlen_new, page_size=16, capacity=256, dtype=dtype, device="cuda")
    check_against_reference(call, dtype, num_splits=num_splits, **options_of(option, gen, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_matches_reference(cuda_gen, dtype, interleaved, causal):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    head_dim = KVCACHE_HEAD_DIMS[-1]
    call = make_call(gen, seqlen_q=4, seqlen_new=4, head_dim=head_dim, seqlens=(3, 40), page_size=16, capacity=64,
                     dtype=dtype, device="cuda")
    cos, sin = rotary_tables(gen, 64, head_dim // 2, dtype, "cuda")
    check_against_reference(call, dtype, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                            causal=causal)


@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_padded_head_dims_match_reference(cuda_gen, head_dim, num_splits):
    """A head dim between compiled ones runs in the next one with zero columns; rotary turns all but
    the last 8 features."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = make_call(gen, batch=2, seqlen_q=2, heads=8, heads_k=2, head_dim=head_dim, seqlens=(30, 97), seqlen_new=2,
                     page_size=16, capacity=128, dtype=dtype, device="cuda")
    cos, sin = rotary_tables(gen, 128, head_dim - 8, dtype, "cuda")
    check_against_reference(call, dtype, num_splits=num_splits, causal=True, rotary_cos=cos, rotary_sin=sin)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (0, 0)}], ids=["causal", "window_0_0"])
def test_fully_masked_rows_inside_a_sequence(cuda_gen, options, num_splits, sinks):
    """More queries than keys: the first rows see no key (causal: query i sees keys up to
    i + length - seqlen_q; window (0, 0): that key alone), while the sequence is not empty.
    Those rows give out 0 and lse -inf (with sinks, the head's sink), no NaN, the others the
    reference's."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = make_call(gen, batch=2, seqlen_q=6, heads=8, heads_k=2, seqlens=(2, 4), seqlen_new=0, page_size=16,
                     capacity=32, dtype=dtype, device="cuda")
    sink_values = 2 * torch.randn(8, generator=gen) + 1
    extra = {"sinks": sink_values.cuda()} if sinks else {}
    out, lse, _ = check_against_reference(call, dtype, num_splits=num_splits, **options, **extra)
    masked = reference_of(call, **options)[1][1] == float("-inf")  # (batch, heads, seqlen_q), without sinks
    assert int(masked.sum()) == 8 * (4 + 2)
    assert not out.isnan().any() and not lse.isnan().any()
    no_key_lse = sink_values.view(1, 8, 1).expand(masked.shape) if sinks else torch.full(masked.shape, -math.inf)
    assert torch.equal(lse.cpu()[masked], no_key_lse[masked])
    assert bool((out.transpose(1, 2).cpu()[masked] == 0).all())


@pytest.mark.parametrize("cache_seqlens", [21, None], ids=["int", "none"])
def test_int_and_none_cache_seqlens(cuda_gen, cache_seqlens):
    """An int length for every sequence (with an append), or None: every sequence is its whole cache."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = make_call(gen, batch=3, seqlen_q=2, heads=8, heads_k=2, seqlens=(0, 0, 0),
                     seqlen_new=2 if cache_seqlens is not None else 0, page_size=16, capacity=48, dtype=dtype,
                     device="cuda")
    if cache_seqlens is None:
        del call["cache_seqlens"]
    else:
        call["cache_seqlens"] = cache_seqlens
    check_against_reference(call, dtype, causal=True)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_nan_past_each_length_does_not_reach_the_output(cuda_gen, causal, num_splits):
    """A contiguous cache holding NaN past each sequence's length (after the append) gives the bits
    of one holding finite values there: those keys and values are never read into a score or O."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    seqlens = (5, 40, 77)
    call = make_call(gen, batch=3, seqlen_q=2, heads=8, heads_k=2, seqlens=seqlens, seqlen_new=2, page_size=None,
                     capacity=96, device="cuda")
    poisoned = cloned(call)
    for b, length in enumerate(seqlens):
        poisoned["k_cache"][b, length + 2:] = float("nan")
        poisoned["v_cache"][b, length + 2:] = float("nan")
    out, lse = run(call, causal=causal, num_splits=num_splits)
    out_poisoned, lse_poisoned = run(poisoned, causal=causal, num_splits=num_splits)
    assert not out_poisoned.isnan().any() and not lse_poisoned.isnan().any()
    assert torch.equal(out_poisoned, out) and torch.equal(lse_poisoned, lse)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["heads", "batch_heads"])
def test_alibi_slopes_per_head_or_per_sequence(cuda_gen, per_sequence):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = make_call(gen, batch=2, seqlen_q=3, heads=8, heads_k=2, seqlens=(33, 150), seqlen_new=3, page_size=16,
                     capacity=256, dtype=dtype, device="cuda")
    slopes = torch.rand((2, 8) if per_sequence else (8,), generator=gen).cuda()
    check_against_reference(call, dtype, causal=True, alibi_slopes=slopes)


def test_softcap_and_alibi_run_whatever_the_forward_build_flags(cuda_gen):
    """The KV-cache kernel carries the soft cap and ALiBi in its one instantiation: a build with
    FLASH_CUTLASS_SOFTCAP=0 or FLASH_CUTLASS_ALIBI=0 (which leave them out of the forward's
    kernels) runs them here all the same."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = make_call(gen, batch=2, seqlen_q=1, heads=8, heads_k=2, seqlens=(33, 150), seqlen_new=1, page_size=16,
                     capacity=256, dtype=dtype, device="cuda")
    check_against_reference(call, dtype, softcap=4.0, alibi_slopes=torch.rand(8, generator=gen).cuda())


@pytest.mark.parametrize("smem_limit", [None, SMEM_99_KIB], ids=["usual", "compact"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_is_bitwise_contiguous(cuda_gen, monkeypatch, page_size, num_splits, smem_limit):
    """The same values in a shuffled paged cache and a contiguous one give the same bits (on the
    usual kernel and on the one for 99 KiB a block)."""
    if smem_limit is not None:
        monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(smem_limit))
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    paged = make_call(gen, batch=2, seqlen_q=2, seqlens=(30, 97), seqlen_new=2, page_size=page_size, capacity=128,
                      device="cuda")
    contiguous = cloned(paged)
    del contiguous["block_table"]
    rows = paged["block_table"].long()
    contiguous["k_cache"] = paged["k_cache"][rows].flatten(1, 2)
    contiguous["v_cache"] = paged["v_cache"][rows].flatten(1, 2)
    out_paged, lse_paged = run(paged, causal=True, num_splits=num_splits)
    out_contiguous, lse_contiguous = run(contiguous, causal=True, num_splits=num_splits)
    assert torch.equal(out_paged, out_contiguous) and torch.equal(lse_paged, lse_contiguous)
    assert torch.equal(paged["k_cache"][rows].flatten(1, 2), contiguous["k_cache"])


@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_append_writes_exactly_the_new_slots(cuda_gen, page_size):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, seqlen_q=3, seqlen_new=3, seqlens=(0, 29), page_size=page_size, capacity=48,
                     device="cuda", cache_batch_idx=page_size is None)
    expected = cloned(call)
    reference.attention_with_kvcache(**expected)
    run(call)
    assert torch.equal(call["k_cache"], expected["k_cache"]) and torch.equal(call["v_cache"], expected["v_cache"])


# The attention kernel appends a call's new tokens itself where each sequence's new rows fit its
# threads (seqlen_new * head_dim at most 2048), without rotary and inside the last query's window;
# FLASH_CUTLASS_KVCACHE_TILE_APPEND=0 keeps the append kernel (csrc/flash_api.cpp).
TILE_APPEND_ENV = "FLASH_CUTLASS_KVCACHE_TILE_APPEND"


@pytest.mark.parametrize("page_size", [None, 1, 16], ids=["contiguous", "p1", "p16"])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("seqlen_new,options", [(1, {}), (4, {"causal": True}), (16, {}), (17, {"causal": True}),
                                                (4, {"window_size": (2, 0)}), (4, {"window_size": (3, 0)})],
                         ids=["1", "4_causal", "16", "17_causal", "4_window_2", "4_window_3"])
def test_append_in_the_attention_kernel(cuda_gen, monkeypatch, page_size, num_splits, seqlen_new, options):
    """New rows that end inside a chunk, cross a 16-key chunk and a split, against the reference
    and bitwise equal to the same call through the append kernel: 16 new rows of head dim 128 are
    the most the attention kernel appends, 17 and a window that leaves new rows out of the last
    query's sight take the append kernel. GQA 4 with 2 queries a sequence: two 16-row blocks of
    packed queries write the same new rows."""
    head_dim = 128 if 128 in KVCACHE_HEAD_DIMS else KVCACHE_HEAD_DIMS[-1]
    dtype = COMPILED_DTYPES[-1]
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    heads = 16
    call = make_call(gen, batch=3, seqlen_q=2, heads=heads, heads_k=heads // 4, head_dim=head_dim,
                     seqlens=(14, 0, 230), seqlen_new=seqlen_new, page_size=page_size, capacity=256, dtype=dtype,
                     device="cuda", cache_batch_idx=page_size is None)
    monkeypatch.delenv(TILE_APPEND_ENV, raising=False)
    in_tile, _, _ = check_against_reference(call, dtype, num_splits=num_splits, **options)
    monkeypatch.setenv(TILE_APPEND_ENV, "0")
    through_append_kernel = cloned(call)
    out, lse = run(through_append_kernel, num_splits=num_splits, **options)
    monkeypatch.delenv(TILE_APPEND_ENV)
    in_tile_call = cloned(call)
    out_in_tile, lse_in_tile = run(in_tile_call, num_splits=num_splits, **options)
    assert torch.equal(out_in_tile, out) and torch.equal(lse_in_tile, lse)
    assert torch.equal(in_tile_call["k_cache"], through_append_kernel["k_cache"])
    assert torch.equal(in_tile_call["v_cache"], through_append_kernel["v_cache"])


def test_tile_append_switch_takes_0_or_1(cuda_gen, monkeypatch):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, page_size=16, capacity=32, device="cuda")
    monkeypatch.setenv(TILE_APPEND_ENV, "yes")
    with pytest.raises(ValueError, match=f"{TILE_APPEND_ENV} must be 0 or 1, got 'yes'"):
        run(call)


@pytest.mark.parametrize("seqlens", [(0, 0), (0, 1), (1, 1)])
def test_lengths_zero_and_one(cuda_gen, seqlens):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, seqlens=seqlens, seqlen_new=0, page_size=16, capacity=32, device="cuda")
    out, lse = run(cloned(call))
    expected_out, expected_lse = reference.attention_with_kvcache(**cloned(call, None, "cpu"))
    for b, length in enumerate(seqlens):
        if length == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and bool((lse[b] == float("-inf")).all())
    torch.testing.assert_close(out.cpu().float(), expected_out.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [33, 70, 128])
def test_many_splits_match_reference(cuda_gen, dtype, num_splits):
    """The merge's warps load 64 splits' partial rows at a time: more splits take further groups
    (33: some warps one split more than others; 70: a short second group and several splits
    without keys; 128: the most, two full groups), as batch-1 decoding over a long cache does with
    num_splits=0."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    head_dim = 128 if 128 in KVCACHE_HEAD_DIMS else KVCACHE_HEAD_DIMS[-1]
    call = make_call(gen, batch=2, heads=8, heads_k=2, head_dim=head_dim, seqlens=(1500, 2046), page_size=16,
                     capacity=2048, dtype=dtype, device="cuda")
    check_against_reference(call, dtype, num_splits=num_splits, causal=True)


@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_cuda_graph_replay_matches_eager(cuda_gen, num_splits):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=4, heads=8, heads_k=2, seqlens=(10, 300, 1, 700), seqlen_new=1, page_size=16,
                     capacity=1024, device="cuda")
    eager = cloned(call)
    out_eager, lse_eager = run(eager, causal=True, num_splits=num_splits)
    captured = cloned(call)
    run(cloned(captured), causal=True, num_splits=num_splits)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph, lse_graph = run(captured, causal=True, num_splits=num_splits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_graph, out_eager) and torch.equal(lse_graph, lse_eager)
    assert torch.equal(captured["k_cache"], eager["k_cache"])
    # A replay with new lengths and queries computes the new call.
    captured["cache_seqlens"].copy_(torch.tensor([3, 5, 8, 13], dtype=torch.int32))
    captured["q"].copy_(torch.randn(captured["q"].shape, generator=gen).to(captured["q"]))
    fresh = cloned(captured)
    graph.replay()
    out_fresh, lse_fresh = run(fresh, causal=True, num_splits=num_splits)
    assert torch.equal(out_graph, out_fresh) and torch.equal(lse_graph, lse_fresh)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda_graphs"])
def test_torch_compile_matches_eager(cuda_gen, mode):
    """Decoding steps compiled with fullgraph=True (through the custom op; "reduce-overhead" also
    captures them in CUDA graphs) give the eager steps' results bitwise and the same caches."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=3, heads=8, heads_k=2, seqlens=(10, 300, 1), page_size=16, capacity=512,
                     device="cuda")
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")

    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        return flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                          block_table=block_table, causal=True, return_lse=True)

    compiled_step = torch.compile(step, fullgraph=True, mode=mode)
    eager, compiled = cloned(call), cloned(call)
    for _ in range(4):
        out, lse = step(*(eager[name] for name in names))
        compiled_out, compiled_lse = compiled_step(*(compiled[name] for name in names))
        torch.cuda.synchronize()
        assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)
        assert torch.equal(compiled["k_cache"], eager["k_cache"]) and torch.equal(compiled["v_cache"], eager["v_cache"])
        for state in (eager, compiled):
            state["cache_seqlens"] += 1


def test_out_of_range_lengths_and_block_ids_stay_inside_the_cache(cuda_gen):
    """Unchecked device values are clamped: block ids into [0, num_blocks), lengths into
    [0, capacity - seqlen_new]; the memory around the cache is untouched, and the result is the
    reference's on the clamped values."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=3, seqlen_q=2, seqlen_new=2, seqlens=(0, 0, 0), page_size=16, capacity=64,
                     device="cuda")
    pool = call["k_cache"].shape[0]
    guard = 4096
    for name in ("k_cache", "v_cache"):
        buffer = torch.full((call[name].numel() + 2 * guard,), 7.0, dtype=call[name].dtype, device="cuda")
        inside = buffer[guard:guard + call[name].numel()].view(call[name].shape)
        inside.copy_(call[name])
        call[name], call[name + "_buffer"] = inside, buffer
    # Sequence 2 is valid and owns pages 1-4; 0 and 1 point out of range (clamped to pages 14 and 0).
    call["block_table"] = torch.tensor([[10**6, 5, 6, 7], [-5] * 4, [1, 2, 3, 4]], dtype=torch.int32, device="cuda")
    call["cache_seqlens"] = torch.tensor([10**9, -7, 61], dtype=torch.int32, device="cuda")
    expected = {name: value for name, value in cloned(call, None, "cpu").items() if not name.endswith("_buffer")}
    expected["block_table"] = expected["block_table"].clamp(0, pool - 1)
    expected["cache_seqlens"] = expected["cache_seqlens"].clamp(0, 64 - 2)
    # Sequence 2 alone: the reference refuses the others' ids.
    expected_out, _ = reference.attention_with_kvcache(**{**expected, "block_table": expected["block_table"][2:],
                                                          **{n: expected[n][2:] for n in ("q", "k", "v",
                                                                                          "cache_seqlens")}})
    out, lse = run({name: value for name, value in call.items() if not name.endswith("_buffer")})
    torch.cuda.synchronize()
    for name in ("k_cache_buffer", "v_cache_buffer"):
        assert bool((call[name][:guard] == 7).all()) and bool((call[name][-guard:] == 7).all())
    assert bool(out.isfinite().all())
    torch.testing.assert_close(out[2:].cpu().float(), expected_out.float(), atol=2e-2, rtol=2e-2)


def test_split_count_does_not_change_the_result_beyond_rounding(cuda_gen):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=1, heads=32, heads_k=8, head_dim=KVCACHE_HEAD_DIMS[-1], seqlens=(4000,),
                     seqlen_new=1, page_size=64, capacity=4096, device="cuda")
    results = [run(cloned(call), causal=True, num_splits=splits) for splits in (1, 2, 7, 64, 128)]
    for out, lse in results[1:]:
        # The outputs, averages of ~4000 values, are ~0.03 (at most ~0.1, where a bf16 ulp is 5e-4):
        # the splits change only fp32 sums and which running maximum P is rounded under, a few ulps.
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=2e-3, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=1e-4)


# Chunked prefill: a call of at least PREFILL_SEQLEN_Q queries that leaves the split to us runs, on
# the Hopper path's GPUs and options, the forward over its caches gathered into packed sequences
# (include/flash_cutlass/select.h, kKVCachePrefillMinSeqlenQ); elsewhere the KV-cache kernel.
PREFILL_SEQLEN_Q = 128
PREFILL_HEAD_DIM = 128 if 128 in KVCACHE_HEAD_DIMS else KVCACHE_HEAD_DIMS[-1]


def prefill_call(gen, page_size, seqlen_new, seqlens=(0, 5, 300, 700), heads=8, heads_k=2, **extra):
    return make_call(gen, batch=len(seqlens), seqlen_q=PREFILL_SEQLEN_Q, heads=heads, heads_k=heads_k,
                     head_dim=PREFILL_HEAD_DIM, seqlens=seqlens, seqlen_new=seqlen_new, page_size=page_size,
                     capacity=1024, device="cuda", **extra)


def requires_prefill_forward(**options):
    """Skips where this GPU and build run a chunked prefill in the KV-cache kernel."""
    reason = kernel_unavailable("sm90", PREFILL_HEAD_DIM, "forward") or options_left_out(**options)
    if reason:
        pytest.skip(f"chunked prefill runs the KV-cache kernel here: {reason}")


@pytest.mark.parametrize("page_size", [None, 1, 16, 256], ids=["contiguous", "p1", "p16", "p256"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("seqlen_new", [0, PREFILL_SEQLEN_Q])
def test_chunked_prefill_matches_reference(cuda_gen, page_size, option, seqlen_new):
    """Lengths 0 and 5 (below seqlen_q: rows without keys under causal masks), 300, 700; with and
    without the append of seqlen_q new tokens."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    dtype = COMPILED_DTYPES[-1]
    call = prefill_call(gen, page_size, seqlen_new, dtype=dtype)
    check_against_reference(call, dtype, **options_of(option, gen, 4))


@pytest.mark.parametrize("heads,heads_k", [(8, 8), (8, 1), (12, 3)])
def test_chunked_prefill_gqa_ratios(cuda_gen, heads, heads_k):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = prefill_call(gen, 16, PREFILL_SEQLEN_Q, heads=heads, heads_k=heads_k)
    check_against_reference(call, COMPILED_DTYPES[-1], causal=True)


def packed_for_forward(call, seqlen_new):
    """The call's caches after its append (run before), gathered on the host into the packed keys
    and values of flash_forward_varlen, with the cumulative lengths."""
    lengths = [int(length) + seqlen_new for length in call["cache_seqlens"].tolist()]
    keys, values = [], []
    for b, length in enumerate(lengths):
        if "block_table" in call:
            pages = call["block_table"][b].long()
            k_rows = call["k_cache"][pages].flatten(0, 1)
            v_rows = call["v_cache"][pages].flatten(0, 1)
        else:
            row = int(call["cache_batch_idx"][b]) if "cache_batch_idx" in call else b
            k_rows, v_rows = call["k_cache"][row], call["v_cache"][row]
        keys.append(k_rows[:length])
        values.append(v_rows[:length])
    cu_seqlens_k = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return torch.cat(keys), torch.cat(values), cu_seqlens_k


def call_and_forward_over_its_caches(call, causal):
    """The call's (out, lse) and flash_forward_varlen's over the caches the call left (after its
    append of seqlen_q new tokens)."""
    seqlen_new = call["q"].shape[1]
    out, lse = run(call, causal=causal)
    k, v, cu_seqlens_k = packed_for_forward(call, seqlen_new)
    batch, seqlen_q, heads, head_dim = call["q"].shape
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device="cuda")
    expected_out, expected_lse = flash_cutlass.flash_forward_varlen(
        call["q"].reshape(batch * seqlen_q, heads, head_dim), k, v, cu_seqlens_q, cu_seqlens_k, seqlen_q, 1024,
        causal=causal, kernel="sm90")
    return out, lse, expected_out.view(out.shape), expected_lse.view(heads, batch, seqlen_q).transpose(0, 1)


@pytest.mark.parametrize("page_size,cache_batch_idx",
                         [(None, False), (None, True), (1, False), (16, False), (48, False), (128, False),
                          (256, False)],
                         ids=["contiguous_in_place", "contiguous_batch_idx", "p1", "p16", "p48", "p128", "p256"])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_is_the_hopper_forward_bitwise(cuda_gen, page_size, cache_batch_idx, causal):
    """On the Hopper path the call is flash_forward_varlen over the gathered caches, to the bit
    (the KV-cache kernel's other tiles round differently): the route is the one taken, whether it
    reads a contiguous cache in place, pages of a multiple of 128 rows through the block table
    (causal calls), or gathers the cache first (cache_batch_idx, other pages). With the append."""
    requires_prefill_forward()
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = prefill_call(gen, page_size, PREFILL_SEQLEN_Q, cache_batch_idx=cache_batch_idx)
    out, lse, expected_out, expected_lse = call_and_forward_over_its_caches(call, causal)
    assert torch.equal(out, expected_out)
    assert torch.equal(lse, expected_lse)


# Below PREFILL_SEQLEN_Q the route depends on the batch (select.h, kvcache_prefill_may_gather): a
# contiguous cache read in place from 32 queries and 128 over the batch, a gathered one (or pages
# of 128 read through the table) from 64 queries and 256 over the batch; other calls run the
# KV-cache kernel.
BATCHED_SEQLENS = (0, 5, 300, 700, 1, 64, 511, 980)


@pytest.mark.parametrize("batch,seqlen_q,page_size,routed",
                         [(4, 32, None, True), (2, 32, None, False), (4, 32, 16, False), (8, 32, 16, False),
                          (4, 64, 16, True), (4, 64, 1, True), (2, 64, 16, False), (4, 32, 128, False),
                          (4, 64, 128, True)],
                         ids=["b4_q32_in_place", "b2_q32_in_place_kernel", "b4_q32_p16_kernel", "b8_q32_p16_kernel",
                              "b4_q64_p16", "b4_q64_p1", "b2_q64_p16_kernel", "b4_q32_p128_kernel", "b4_q64_p128"])
def test_chunked_prefill_route_below_its_seqlen_depends_on_the_batch(cuda_gen, batch, seqlen_q, page_size, routed):
    """The forward's result to the bit where the call reaches the route's thresholds, the KV-cache
    kernel's (which rounds differently, and is checked against the reference) below them."""
    requires_prefill_forward()
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    seqlens = BATCHED_SEQLENS[:batch]
    assert max(seqlens) + seqlen_q <= 1024
    call = make_call(gen, batch=batch, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=PREFILL_HEAD_DIM,
                     seqlens=seqlens, seqlen_new=seqlen_q, page_size=page_size, capacity=1024, device="cuda")
    reference_call = cloned(call)
    out, lse, expected_out, expected_lse = call_and_forward_over_its_caches(call, True)
    assert torch.equal(out, expected_out) == routed
    if not routed:
        check_against_reference(reference_call, call["q"].dtype, causal=True)


@pytest.mark.parametrize("interleaved", [True, False])
def test_chunked_prefill_rotary_matches_reference(cuda_gen, interleaved):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = prefill_call(gen, 16, PREFILL_SEQLEN_Q)
    cos, sin = rotary_tables(gen, 1024, PREFILL_HEAD_DIM // 2, call["q"].dtype, "cuda")
    check_against_reference(call, call["q"].dtype, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                            causal=True)


def test_chunked_prefill_nan_past_each_length_does_not_reach_the_output(cuda_gen):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    seqlens = (5, 400, 770)
    call = prefill_call(gen, None, PREFILL_SEQLEN_Q, seqlens=seqlens)
    poisoned = cloned(call)
    for b, length in enumerate(seqlens):
        poisoned["k_cache"][b, length + PREFILL_SEQLEN_Q:] = float("nan")
        poisoned["v_cache"][b, length + PREFILL_SEQLEN_Q:] = float("nan")
    out, lse = run(call, causal=True)
    out_poisoned, lse_poisoned = run(poisoned, causal=True)
    assert not out_poisoned.isnan().any() and not lse_poisoned.isnan().any()
    assert torch.equal(out_poisoned, out) and torch.equal(lse_poisoned, lse)


def poison_past_lengths(call, lengths):
    """NaN in every cache row a paged call's sequences do not hold (past each length in its pages,
    and the pool's spare pages); their block-table entries past the pages they need out of range."""
    table = call["block_table"]
    page_size = call["k_cache"].shape[1]
    used = torch.zeros(call["k_cache"].shape[:2], dtype=torch.bool, device=table.device)
    for b, length in enumerate(lengths):
        pages = -(-length // page_size)
        for j in range(pages):
            used[table[b, j], :min(page_size, length - j * page_size)] = True
        table[b, pages::2] = 10**6
        table[b, pages + 1::2] = -3
    for name in ("k_cache", "v_cache"):
        call[name][~used] = float("nan")


@pytest.mark.parametrize("page_size", [1, 16, 128, 256], ids=["p1", "p16", "p128", "p256"])
def test_chunked_prefill_paged_nan_and_bad_ids_past_each_length(cuda_gen, page_size):
    """Rows past each sequence's length (inside its last page, its other pages, the spare pages) hold
    NaN and its block-table entries past its pages point out of the cache: neither the gather (pages
    of 1 and 16) nor the forward reading the pages (128, 256) takes them in, and the output is the
    clean cache's, to the bit."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    seqlens = (5, 400, 0, 770)
    call = prefill_call(gen, page_size, 0, seqlens=seqlens)
    poisoned = cloned(call)
    poison_past_lengths(poisoned, seqlens)
    out, lse = run(call, causal=True)
    out_poisoned, lse_poisoned = run(poisoned, causal=True)
    assert not out_poisoned.isnan().any() and not lse_poisoned.isnan().any()
    assert torch.equal(out_poisoned, out) and torch.equal(lse_poisoned, lse)


@pytest.mark.parametrize("page_size", [16, 256], ids=["p16", "p256"])
def test_chunked_prefill_out_of_range_block_ids_are_clamped(cuda_gen, page_size):
    """Block ids inside a sequence's length that point out of the cache read the page they clamp
    to, as the KV-cache kernel's do."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = prefill_call(gen, page_size, 0, seqlens=(300, 700))
    pool = call["k_cache"].shape[0]
    wild = cloned(call)
    wild["block_table"][0, 0] = 10**6
    wild["block_table"][1, 1] = -9
    clamped = cloned(call)
    clamped["block_table"][0, 0] = pool - 1
    clamped["block_table"][1, 1] = 0
    out_wild, lse_wild = run(wild, causal=True)
    out_clamped, lse_clamped = run(clamped, causal=True)
    assert torch.equal(out_wild, out_clamped) and torch.equal(lse_wild, lse_clamped)


@pytest.mark.parametrize("page_size,seqlens,capacity", [(16, (0, 5, 300, 700), 1024), (128, (5, 1100, 7000), 8192),
                                                       (256, (0, 1500, 7000), 8192)],
                         ids=["p16", "p128_long", "p256_long"])
def test_chunked_prefill_paged_is_bitwise_contiguous(cuda_gen, page_size, seqlens, capacity):
    """Pages in shuffled order against the same rows in a contiguous cache, with the append: pages
    of 16 gathered, of 128 and 256 rows read through the block table, whose producer warp reads the
    table 32 key blocks at a time (include/flash_cutlass/sm90/fwd_producer.h, load_paged_tile):
    sequences of fewer and of more than 32 key blocks of 128."""
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    paged = make_call(gen, batch=len(seqlens), seqlen_q=PREFILL_SEQLEN_Q, heads=8, heads_k=2,
                      head_dim=PREFILL_HEAD_DIM, seqlens=seqlens, seqlen_new=PREFILL_SEQLEN_Q, page_size=page_size,
                      capacity=capacity, device="cuda")
    contiguous = cloned(paged)
    del contiguous["block_table"]
    rows = paged["block_table"].long()
    contiguous["k_cache"] = paged["k_cache"][rows].flatten(1, 2)
    contiguous["v_cache"] = paged["v_cache"][rows].flatten(1, 2)
    out_paged, lse_paged = run(paged, causal=True)
    out_contiguous, lse_contiguous = run(contiguous, causal=True)
    assert torch.equal(out_paged, out_contiguous) and torch.equal(lse_paged, lse_contiguous)


def test_chunked_prefill_cuda_graph_replay_matches_eager(cuda_gen):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = prefill_call(gen, 16, PREFILL_SEQLEN_Q, seqlens=(10, 300, 1, 700))
    eager = cloned(call)
    out_eager, lse_eager = run(eager, causal=True)
    captured = cloned(call)
    run(cloned(captured), causal=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph, lse_graph = run(captured, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_graph, out_eager) and torch.equal(lse_graph, lse_eager)
    captured["cache_seqlens"].copy_(torch.tensor([3, 500, 8, 13], dtype=torch.int32))
    captured["q"].copy_(torch.randn(captured["q"].shape, generator=gen).to(captured["q"]))
    fresh = cloned(captured)
    graph.replay()
    out_fresh, lse_fresh = run(fresh, causal=True)
    assert torch.equal(out_graph, out_fresh) and torch.equal(lse_graph, lse_fresh)


def test_chunked_prefill_without_memory_for_the_gather_runs_the_kvcache_kernel(cuda_gen):
    """Where the gathered copy does not fit in the memory left (a server whose caches fill the GPU),
    the call runs the KV-cache kernel instead of raising."""
    requires_prefill_forward()
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=1, seqlen_q=PREFILL_SEQLEN_Q, heads=8, heads_k=8, head_dim=PREFILL_HEAD_DIM,
                     seqlens=(30000,), seqlen_new=0, page_size=None, capacity=32768, device="cuda")
    expected = run(cloned(call), causal=True)
    limited = cloned(call)
    cache_bytes = call["k_cache"].numel() * call["k_cache"].element_size()  # 64 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(call["q"].device).total_memory
    # Room for the KV-cache kernel's small buffers, not for the two gathered copies of the cache.
    allowed = torch.cuda.memory_reserved() + 3 * cache_bytes // 4
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * cache_bytes, dtype=torch.uint8, device="cuda")
        out, lse = run(limited, causal=True)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.testing.assert_close(out.float(), expected[0].float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, expected[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size,causal,copies", [(128, True, False), (256, True, False), (16, True, True),
                                                     (256, False, True)],
                         ids=["p128", "p256", "p16", "p256_not_causal"])
def test_chunked_prefill_reads_pages_of_128_rows_without_a_copy(cuda_gen, page_size, causal, copies):
    """In a causal call, pages of a multiple of 128 rows reach the forward through the block table:
    the call allocates nothing the size of the cache (smaller pages, and calls without the causal
    mask, are gathered into a copy first)."""
    requires_prefill_forward()
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, batch=2, seqlen_q=PREFILL_SEQLEN_Q, heads=8, heads_k=8, head_dim=PREFILL_HEAD_DIM,
                     seqlens=(3000, 3900), seqlen_new=0, page_size=page_size, capacity=4096, device="cuda")
    gathered_bytes = 2 * 2 * 4096 * 8 * PREFILL_HEAD_DIM * call["k_cache"].element_size()
    run(cloned(call), causal=causal)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(call, causal=causal)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert (grown >= gathered_bytes) == copies, f"peak grew by {grown} bytes; a gathered copy is {gathered_bytes}"


def test_kernel_errors_name_the_argument(cuda_gen):
    gen = torch.Generator().manual_seed(cuda_gen.initial_seed())
    call = make_call(gen, device="cuda", head_dim=64)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16 on CUDA"):
        run(cloned(call, torch.float32))
    odd = make_call(gen, device="cuda", head_dim=20)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        run(odd)
    strided = cloned(call)
    strided["k_cache"] = torch.randn(2, 64, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="k_cache must be 16-byte aligned"):
        run(strided)

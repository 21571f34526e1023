"""Tests of the KV-cache reference (flash_cutlass.reference.attention_with_kvcache), the oracle of the
coming serving kernel (FlashAttention-2's flash_attn_with_kvcache).

Appending then attending is checked against naive_attention over each sequence's concatenated keys
(fp64, so the comparison is tight), the paged cache against the contiguous one (bitwise), rotary
against a rotation written independently here, the cache contents after the append, and every
argument check, which must raise before the cache is written. CPU only.
"""

import math

import pytest
import torch

from flash_cutlass.reference import attention_with_kvcache, naive_attention

FP64_TOL = {"atol": 1e-12, "rtol": 1e-12}
# (heads, kv_heads): GQA ratios 1, 2, 4, 8.
HEAD_LAYOUTS = [(4, 4), (4, 2), (8, 2), (8, 1)]
OPTIONS = {
    "plain": {},
    "window": {"window_size": (5, 2)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": "per-sequence"},
}


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def resolved(options, gen, batch, heads):
    options = dict(options)
    if options.get("alibi_slopes") == "per-sequence":
        options["alibi_slopes"] = torch.rand(batch, heads, generator=gen, dtype=torch.float64).float()
    return options


def slopes_of(options, b):
    slopes = options.get("alibi_slopes")
    return slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes


def expected(q, old_k, old_v, k, v, seqlens, causal, options, rows=None):
    """naive_attention per sequence over its cached keys then its new ones."""
    batch, sq, heads, head_dim = q.shape
    scale = options.pop("softmax_scale", 1 / math.sqrt(head_dim))
    outs, lses = [], []
    for b in range(batch):
        row, s = b if rows is None else rows[b], seqlens[b]
        keys = torch.cat([old_k[row, :s], k[b]]) if k is not None else old_k[row, :s]
        values = torch.cat([old_v[row, :s], v[b]]) if v is not None else old_v[row, :s]
        if keys.shape[0] == 0:
            outs.append(torch.zeros_like(q[b]))
            lses.append(torch.full((heads, sq), float("-inf"), dtype=torch.float64))
            continue
        out, lse = naive_attention(q[b:b + 1], keys[None], values[None], scale, causal, compute_dtype=torch.float64,
                                   **{**options, "alibi_slopes": slopes_of(options, b)})
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("sq,seqlen_new", [(1, 1), (1, 0), (4, 4), (3, 1), (2, 5)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_append_then_attend_matches_naive(gen, causal, sq, seqlen_new, heads, kv_heads, option):
    batch, capacity, head_dim = 4, 40, 16
    seqlens = [0, 1, 7, 29]  # lengths 0 and 1 when nothing is appended
    q = randn(gen, batch, sq, heads, head_dim)
    k_cache, v_cache = randn(gen, batch, capacity, kv_heads, head_dim), randn(gen, batch, capacity, kv_heads, head_dim)
    k, v = randn(gen, batch, seqlen_new, kv_heads, head_dim), randn(gen, batch, seqlen_new, kv_heads, head_dim)
    old_k, old_v = k_cache.clone(), v_cache.clone()
    options = resolved(OPTIONS[option], gen, batch, heads)

    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, torch.tensor(seqlens, dtype=torch.int32),
                                      causal=causal, **options)

    ref_out, ref_lse = expected(q, old_k, old_v, k, v, seqlens, causal, options)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)
    # The new tokens are in the cache at cache_seqlens[b]..; nothing else changed.
    want_k, want_v = old_k.clone(), old_v.clone()
    for b, s in enumerate(seqlens):
        want_k[b, s:s + seqlen_new], want_v[b, s:s + seqlen_new] = k[b], v[b]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_row_without_keys_is_zero_with_minus_inf_lse(gen):
    """Length 0, and causal rows above the diagonal (seqlen_q > length), see no key."""
    q = randn(gen, 2, 3, 2, 8, dtype=torch.float32)
    k_cache, v_cache = randn(gen, 2, 4, 2, 8, dtype=torch.float32), randn(gen, 2, 4, 2, 8, dtype=torch.float32)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                                      causal=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2])) and torch.isneginf(lse[1, :, :2]).all()
    torch.testing.assert_close(out[1, 2], v_cache[1, 0].expand(2, 8))
    assert torch.isfinite(lse[1, :, 2]).all()


def paged_copy(gen, k_cache, v_cache, page_size, spare_blocks=3):
    """The contiguous cache's contents in pages of page_size, in a shuffled page order, with a block
    table whose unused entries are -1 (they must not be read)."""
    batch, capacity = k_cache.shape[:2]
    per_seq = capacity // page_size
    num_blocks = batch * per_seq + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    paged_k = randn(gen, num_blocks, page_size, *k_cache.shape[2:], dtype=k_cache.dtype)
    paged_v = randn(gen, num_blocks, page_size, *k_cache.shape[2:], dtype=k_cache.dtype)
    for b in range(batch):
        for i in range(per_seq):
            paged_k[order[b, i]] = k_cache[b, i * page_size:(i + 1) * page_size]
            paged_v[order[b, i]] = v_cache[b, i * page_size:(i + 1) * page_size]
    return paged_k, paged_v, order.to(torch.int32)


def unpaged(paged, block_table, page_size):
    return torch.stack([torch.cat([paged[block] for block in row.tolist()]) for row in block_table])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("option", ["plain", "everything"])
def test_paged_equals_contiguous_bitwise(gen, page_size, dtype, option):
    batch, heads, kv_heads, head_dim, sq = 3, 8, 2, 32, 2
    capacity = 192
    seqlens = torch.tensor([0, 61, 150], dtype=torch.int32)
    q = randn(gen, batch, sq, heads, head_dim, dtype=dtype)
    k_cache, v_cache = (randn(gen, batch, capacity, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    k, v = (randn(gen, batch, sq, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    options = {"causal": False}
    if option == "everything":
        angles = torch.rand(capacity, 8, generator=gen, dtype=torch.float64) * 6
        options = {"causal": True, "window_size": (70, 0), "softcap": 4.0, "softmax_scale": 0.3,
                   "alibi_slopes": torch.rand(batch, heads, generator=gen).float(),
                   "rotary_cos": angles.cos().to(dtype), "rotary_sin": angles.sin().to(dtype)}
    paged_k, paged_v, table = paged_copy(gen, k_cache, v_cache, page_size)
    # Entries past what a sequence needs are never read.
    needed = (seqlens + sq + page_size - 1) // page_size
    table = torch.where(torch.arange(table.shape[1]) < needed[:, None], table, torch.full_like(table, -1))
    used = torch.where(table >= 0, table, torch.zeros_like(table))

    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, **options)
    paged_out, paged_lse = attention_with_kvcache(q, paged_k, paged_v, k, v, seqlens, block_table=table, **options)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)
    for b in range(batch):
        n = int(seqlens[b]) + sq
        assert torch.equal(unpaged(paged_k, used[b:b + 1], page_size)[0, :n], k_cache[b, :n])
        assert torch.equal(unpaged(paged_v, used[b:b + 1], page_size)[0, :n], v_cache[b, :n])


def rotate(x, cos, sin, positions, interleaved):
    """x (n, heads, head_dim) rotated at positions (n,), the first 2 * cos.shape[1] features, as the
    usual rotate-half formulations write it."""
    rotary_dim = 2 * cos.shape[1]
    if interleaved:
        cos_full = cos[positions].repeat_interleave(2, dim=-1)[:, None]
        sin_full = sin[positions].repeat_interleave(2, dim=-1)[:, None]
        part = x[..., :rotary_dim]
        turned = torch.stack([-part[..., 1::2], part[..., 0::2]], dim=-1).flatten(-2)
    else:
        cos_full = torch.cat([cos[positions]] * 2, dim=-1)[:, None]
        sin_full = torch.cat([sin[positions]] * 2, dim=-1)[:, None]
        part = x[..., :rotary_dim]
        half = rotary_dim // 2
        turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    return torch.cat([part * cos_full + turned * sin_full, x[..., rotary_dim:]], dim=-1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [8, 32])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_rotary_matches_direct_rotation(gen, interleaved, rotary_dim, mask):
    batch, heads, kv_heads, head_dim, sq, capacity = 3, 4, 2, 32, 3, 24
    seqlens = [0, 5, 20]
    q = randn(gen, batch, sq, heads, head_dim)
    k_cache, v_cache = randn(gen, batch, capacity, kv_heads, head_dim), randn(gen, batch, capacity, kv_heads, head_dim)
    k, v = randn(gen, batch, sq, kv_heads, head_dim), randn(gen, batch, sq, kv_heads, head_dim)
    angles = torch.rand(capacity, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    old_q, old_k, old_new_k = q.clone(), k_cache.clone(), k.clone()
    old_v = v_cache.clone()
    causal, options = mask == "causal", ({"window_size": (4, 1)} if mask == "window" else {})

    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, torch.tensor(seqlens, dtype=torch.int32),
                                      causal=causal, rotary_cos=cos, rotary_sin=sin,
                                      rotary_interleaved=interleaved, **options)

    # FlashAttention-2: q rows at their own positions under a mask, all at cache_seqlens without.
    per_row = mask != "full"
    rot_q = torch.stack([rotate(q[b], cos, sin, seqlens[b] + (torch.arange(sq) if per_row else torch.zeros(sq,
                         dtype=torch.int64)), interleaved) for b in range(batch)])
    rot_k = torch.stack([rotate(k[b], cos, sin, seqlens[b] + torch.arange(sq), interleaved) for b in range(batch)])
    ref_out, ref_lse = expected(rot_q, old_k, old_v, rot_k, v, seqlens, causal, options)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)
    for b, s in enumerate(seqlens):
        torch.testing.assert_close(k_cache[b, s:s + sq], rot_k[b], **FP64_TOL)
        assert torch.equal(v_cache[b, s:s + sq], v[b])
    # q and the new k are rotated on the way, never in place.
    assert torch.equal(q, old_q) and torch.equal(k, old_new_k) and not torch.equal(rot_q, q)


def test_cache_batch_idx_selects_rows(gen):
    batch_cache, heads, head_dim, capacity = 4, 2, 16, 12
    rows = [3, 0]
    q = randn(gen, 2, 1, heads, head_dim)
    k_cache, v_cache = randn(gen, batch_cache, capacity, heads, head_dim), randn(gen, batch_cache, capacity, heads,
                                                                               head_dim)
    k, v = randn(gen, 2, 1, heads, head_dim), randn(gen, 2, 1, heads, head_dim)
    old_k, old_v = k_cache.clone(), v_cache.clone()
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, 6, causal=True,
                                      cache_batch_idx=torch.tensor(rows, dtype=torch.int32))
    ref_out, ref_lse = expected(q, old_k, old_v, k, v, [6, 6], True, {}, rows=rows)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)
    for b, row in enumerate(rows):
        assert torch.equal(k_cache[row, 6], k[b, 0]) and torch.equal(v_cache[row, 6], v[b, 0])
    for row in (1, 2):
        assert torch.equal(k_cache[row], old_k[row]) and torch.equal(v_cache[row], old_v[row])


def test_without_cache_seqlens_attends_the_whole_cache(gen):
    q = randn(gen, 2, 2, 4, 16)
    k_cache, v_cache = randn(gen, 2, 9, 2, 16), randn(gen, 2, 9, 2, 16)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, causal=True, softmax_scale=0.5)
    ref_out, ref_lse = naive_attention(q, k_cache, v_cache, 0.5, True)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)


def test_half_precision_computes_in_fp32(gen):
    q = randn(gen, 2, 1, 8, 64, dtype=torch.float16)
    k_cache, v_cache = randn(gen, 2, 50, 2, 64, dtype=torch.float16), randn(gen, 2, 50, 2, 64, dtype=torch.float16)
    k, v = randn(gen, 2, 1, 2, 64, dtype=torch.float16), randn(gen, 2, 1, 2, 64, dtype=torch.float16)
    seqlens = torch.tensor([17, 49], dtype=torch.int32)
    old = [t.float() for t in (q, k_cache, v_cache, k, v)]
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    ref_out, ref_lse = attention_with_kvcache(old[0], old[1], old[2], old[3], old[4], seqlens)
    torch.testing.assert_close(out, ref_out.half())
    torch.testing.assert_close(lse, ref_lse)


def _call(**changes):
    """Arguments of a valid call on a paged or contiguous cache, with ``changes`` applied."""
    gen = torch.Generator().manual_seed(0)
    paged = changes.pop("paged", False)
    args = {
        "q": randn(gen, 2, 1, 4, 16, dtype=torch.float16),
        "k": randn(gen, 2, 1, 2, 16, dtype=torch.float16),
        "v": randn(gen, 2, 1, 2, 16, dtype=torch.float16),
        "cache_seqlens": torch.tensor([3, 7], dtype=torch.int32),
    }
    if paged:
        args["k_cache"] = randn(gen, 6, 4, 2, 16, dtype=torch.float16)
        args["block_table"] = torch.tensor([[5, 1], [0, 3]], dtype=torch.int32)
    else:
        args["k_cache"] = randn(gen, 2, 8, 2, 16, dtype=torch.float16)
    args["v_cache"] = args["k_cache"].clone() + 1
    args.update(changes)
    return args


META_INT32 = torch.zeros(2, dtype=torch.int32, device="meta")
ANGLES = torch.zeros(8, 4, dtype=torch.float16)
BAD_CALLS = [
    ("cache_seqlens_dtype", {"cache_seqlens": torch.tensor([3, 7])}, TypeError, "cache_seqlens must be int32"),
    ("cache_seqlens_device", {"cache_seqlens": META_INT32}, ValueError, "cache_seqlens is on meta"),
    ("cache_seqlens_shape", {"cache_seqlens": torch.tensor([3], dtype=torch.int32)}, ValueError,
     r"cache_seqlens must have shape \(batch,\)"),
    ("cache_seqlens_negative", {"cache_seqlens": -1}, ValueError, "cache_seqlens must be >= 0"),
    ("cache_seqlens_missing", {"cache_seqlens": None}, ValueError, "cache_seqlens is required with k and v"),
    ("past_contiguous_cache", {"cache_seqlens": torch.tensor([3, 8], dtype=torch.int32)}, ValueError,
     r"cache_seqlens\[1\] = 8 plus 1 new tokens is past the cache: k_cache holds seqlen_cache = 8"),
    ("block_table_dtype", {"paged": True, "block_table": torch.tensor([[5, 1], [0, 3]])}, TypeError,
     "block_table must be int32"),
    ("block_table_device", {"paged": True, "block_table": torch.zeros(2, 2, dtype=torch.int32, device="meta")},
     ValueError, "block_table is on meta"),
    ("block_table_shape", {"paged": True, "block_table": torch.tensor([5, 1], dtype=torch.int32)}, ValueError,
     r"block_table must be \(batch, max_blocks_per_seq\)"),
    ("block_table_batch", {"paged": True, "block_table": torch.tensor([[5, 1]], dtype=torch.int32)}, ValueError,
     "block_table must have batch = 2 rows"),
    ("block_table_too_short", {"paged": True, "cache_seqlens": torch.tensor([3, 8], dtype=torch.int32)}, ValueError,
     r"cache_seqlens\[1\] = 8 plus 1 new tokens is past the cache: block_table holds max_blocks_per_seq \* "
     r"page_size = 8"),
    ("block_id_too_large", {"paged": True, "block_table": torch.tensor([[5, 1], [0, 6]], dtype=torch.int32)},
     ValueError, r"block_table\[1\] holds block id 6 among the blocks of its first 8 tokens; block ids must be in "
     r"\[0, 6\)"),
    ("block_id_negative", {"paged": True, "block_table": torch.tensor([[-1, 1], [0, 3]], dtype=torch.int32)},
     ValueError, r"block_table\[0\] holds block id -1"),
    ("page_size_zero", {"paged": True, "k_cache": torch.zeros(6, 0, 2, 16, dtype=torch.float16),
                        "v_cache": torch.zeros(6, 0, 2, 16, dtype=torch.float16)}, ValueError,
     r"page size \(k_cache.shape\[1\]\) must be >= 1"),
    ("cache_batch_idx_with_pages", {"paged": True, "cache_batch_idx": torch.tensor([0, 1], dtype=torch.int32)},
     ValueError, "cache_batch_idx is for a contiguous cache"),
    ("cache_batch_idx_dtype", {"cache_batch_idx": torch.tensor([0, 1])}, TypeError, "cache_batch_idx must be int32"),
    ("cache_batch_idx_range", {"cache_batch_idx": torch.tensor([0, 2], dtype=torch.int32)}, ValueError,
     r"cache_batch_idx entries must be in \[0, 2\)"),
    ("cache_batch_mismatch", {"k_cache": torch.zeros(3, 8, 2, 16, dtype=torch.float16),
                              "v_cache": torch.zeros(3, 8, 2, 16, dtype=torch.float16)}, ValueError,
     r"k_cache batch \(3\) must equal q's batch \(2\) without cache_batch_idx"),
    ("heads_not_multiple", {"q": torch.zeros(2, 1, 3, 16, dtype=torch.float16)}, ValueError,
     r"q heads \(3\) must be a multiple of k_cache heads \(2\)"),
    ("new_k_heads", {"k": torch.zeros(2, 1, 4, 16, dtype=torch.float16),
                     "v": torch.zeros(2, 1, 4, 16, dtype=torch.float16)}, ValueError,
     r"k must be \(batch, seqlen_new, kv_heads, head_dim\)"),
    ("head_dim", {"q": torch.zeros(2, 1, 4, 32, dtype=torch.float16)}, ValueError,
     r"k_cache head_dim \(16\) must equal q's \(32\)"),
    ("v_cache_shape", {"v_cache": torch.zeros(2, 9, 2, 16, dtype=torch.float16)}, ValueError,
     "v_cache must have k_cache's shape"),
    ("v_shape", {"v": torch.zeros(2, 2, 2, 16, dtype=torch.float16)}, ValueError, "v must have k's shape"),
    ("k_without_v", {"v": None}, ValueError, "k and v must be given together"),
    ("cache_dtype", {"k_cache": torch.zeros(2, 8, 2, 16), "v_cache": torch.zeros(2, 8, 2, 16)}, TypeError,
     "k_cache must have q's dtype"),
    ("write_conflict", {"cache_batch_idx": torch.tensor([1, 1], dtype=torch.int32),
                        "cache_seqlens": 3}, ValueError, "batch entries 0 and 1 write the same cache slot"),
    ("read_conflict", {"cache_batch_idx": torch.tensor([1, 1], dtype=torch.int32)}, ValueError,
     "batch entry 1 reads a cache slot that batch entry 0 writes"),
    ("shared_page_conflict", {"paged": True, "block_table": torch.tensor([[5, 1], [5, 3]], dtype=torch.int32)},
     ValueError, "batch entry 1 reads a cache slot that batch entry 0 writes"),
    ("rotary_without_sin", {"rotary_cos": ANGLES}, ValueError, "rotary_cos and rotary_sin must be given together"),
    ("rotary_without_k", {"k": None, "v": None, "rotary_cos": ANGLES, "rotary_sin": ANGLES}, ValueError,
     "rotary_cos and rotary_sin need k and v"),
    ("rotary_dtype", {"rotary_cos": ANGLES.float(), "rotary_sin": ANGLES.float()}, TypeError,
     "rotary_cos must have q's dtype"),
    ("rotary_dim", {"rotary_cos": torch.zeros(8, 9, dtype=torch.float16),
                    "rotary_sin": torch.zeros(8, 9, dtype=torch.float16)}, ValueError,
     r"rotary_cos must be \(seqlen_ro, rotary_dim / 2\) with 2 <= rotary_dim <= head_dim = 16"),
    ("rotary_too_short", {"rotary_cos": ANGLES[:7], "rotary_sin": ANGLES[:7]}, ValueError,
     r"rotary_cos/rotary_sin have 7 positions \(seqlen_ro\) but the call rotates positions up to 7"),
    ("window_size", {"window_size": (-2, 0)}, ValueError, "window_size entries must be >= -1"),
    ("softcap", {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    ("softmax_scale", {"softmax_scale": "x"}, TypeError, "softmax_scale must be a float or None"),
    ("alibi_slopes", {"alibi_slopes": torch.zeros(3)}, ValueError, "alibi_slopes must have shape"),
]


@pytest.mark.parametrize("changes,error,message", [case[1:] for case in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_before_writing(changes, error, message):
    args = _call(**changes)
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(error, match=message):
        attention_with_kvcache(**args)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_valid_call_of_the_error_cases_runs():
    """The base of BAD_CALLS is valid, so each case fails for its own change."""
    for paged in (False, True):
        out, lse = attention_with_kvcache(**_call(paged=paged))
        assert out.shape == (2, 1, 4, 16) and lse.shape == (2, 4, 1)

"""Inputs of KV-cache tests (flash_attention_with_kvcache): caches filled with random values (never
zeros), contiguous or paged with the pages shuffled, and what the reference expects of them."""

import torch

from flash_cutlass import reference


def make_call(gen, *, batch=2, seqlen_q=1, heads=8, heads_k=2, head_dim=64, seqlens=(5, 17), seqlen_new=1,
              page_size=None, capacity=64, dtype=torch.bfloat16, device="cpu", cache_batch_idx=False):
    """The arguments of one call. page_size None: a contiguous cache (rows reversed through
    cache_batch_idx when asked); else a paged cache of capacity // page_size pages per sequence,
    every page id of the pool used once, in a shuffled order, plus spare pages."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    call = {"q": randn(batch, seqlen_q, heads, head_dim),
            "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32, device=device)}
    if seqlen_new:
        call["k"] = randn(batch, seqlen_new, heads_k, head_dim)
        call["v"] = randn(batch, seqlen_new, heads_k, head_dim)
    if page_size is None:
        call["k_cache"] = randn(batch, capacity, heads_k, head_dim)
        call["v_cache"] = randn(batch, capacity, heads_k, head_dim)
        if cache_batch_idx:
            call["cache_batch_idx"] = torch.arange(batch - 1, -1, -1, dtype=torch.int32, device=device)
    else:
        blocks = -(-capacity // page_size)
        pool = batch * blocks + 3
        order = torch.randperm(pool, generator=gen)[:batch * blocks]
        call["block_table"] = order.view(batch, blocks).to(device=device, dtype=torch.int32)
        call["k_cache"] = randn(pool, page_size, heads_k, head_dim)
        call["v_cache"] = randn(pool, page_size, heads_k, head_dim)
    return call


def rotary_tables(gen, positions, rotary_dim, dtype, device):
    angles = torch.rand(positions, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def cloned(call, dtype=None, device=None):
    """A copy of a call's tensors (the caches too, which the call writes), optionally cast/moved;
    the index tensors keep their dtype."""
    out = {}
    for name, value in call.items():
        if isinstance(value, torch.Tensor):
            value = value.clone()
            if device is not None:
                value = value.to(device)
            if dtype is not None and value.is_floating_point() and name != "alibi_slopes":
                value = value.to(dtype)
        out[name] = value
    return out


def reference_of(call, **options):
    """The reference's (out, lse) of a call on the CPU in fp64 (the oracle) and in the call's dtype
    (computed in fp32, rounded to the dtype: the baseline of the pass rule), each on fresh copies of
    the caches; and the caches (k_cache, v_cache) after the baseline's append, on the CPU in the
    call's dtype: a kernel's append must write them bitwise."""
    oracle = reference.attention_with_kvcache(**cloned(call, torch.float64, "cpu"), **_on_cpu(options, torch.float64))
    in_dtype = cloned(call, None, "cpu")
    baseline = reference.attention_with_kvcache(**in_dtype, **_on_cpu(options, None))
    return oracle, baseline, (in_dtype["k_cache"], in_dtype["v_cache"])


# The log-sum-exp against the reference in the input dtype, which computes it in fp32 from the same
# rounded inputs (rotated q and k included): the kernels' other summation order and their exp2 and
# log approximations (relative error ~2^-22) move it by ~1e-6 of its size, so 1e-4 absolute plus
# relative has room, while a mask one key off moves it by that key's weight, ~1/length (2e-3 at
# 511 keys, 7e-3 at 150). The soft cap's hardware tanh (relative error ~2^-11 of |tanh| <= 1)
# moves each score by up to softcap * 2^-11 (2e-3 at softcap 4) and the log-sum-exp by a weighted
# mean of those: 3e-3 absolute, no relative term, which a one-key error at 150 keys still exceeds.
LSE_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
LSE_SOFTCAP_TOLERANCE = {"atol": 3e-3, "rtol": 0.0}


def check_lse(lse, expected, softcap=0.0):
    """lse (any device) against expected with the tolerance above; -inf rows must match exactly."""
    tolerance = LSE_SOFTCAP_TOLERANCE if softcap > 0 else LSE_TOLERANCE
    torch.testing.assert_close(lse.detach().float().cpu(), expected.float().cpu(), **tolerance)


def _on_cpu(options, dtype):
    moved = {}
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            value = value.cpu()
            if dtype is not None and name in ("rotary_cos", "rotary_sin"):
                value = value.to(dtype)
        moved[name] = value
    return moved

"""Serving: attention over a KV cache, appending the new tokens first (FlashAttention-2's
flash_attn_with_kvcache), for decoding (one query per sequence) and chunked prefill.

Every argument is checked once by flash_cutlass.reference.check_kvcache_arguments, the checks that
read no tensor data, for both paths. CPU tensors then run flash_cutlass.reference.
attention_with_kvcache, which also reads and checks the lengths, block ids and cache rows. CUDA
tensors run the extension's KV-cache kernels (include/flash_cutlass/sm80/kvcache_kernel.h), which
read nothing on the host: no synchronization, so CUDA graphs capture the call; lengths and block
ids out of range are clamped into the cache on the device instead of raising, and so are rotary
positions past seqlen_ro (to its last row) where cache_seqlens is a tensor (an int is checked on the
host, on both paths).

The call is also the custom op torch.ops.flash_cutlass.kvcache (mutating k_cache and v_cache), with
a fake implementation, so that torch.compile traces a decoding step without a graph break; eager
calls skip the op's dispatch.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from flash_cutlass import backend, reference
from flash_cutlass.options import AttentionOptions, check_bool

# At most this many splits of the keys (include/flash_cutlass/params.h, kKVCacheMaxSplits).
MAX_NUM_SPLITS = 128


def _check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [0, {MAX_NUM_SPLITS}] (0: chosen from the shapes), got {num_splits}")
    return int(num_splits)


def _check_cuda_tensors(q, k_cache, v_cache, k, v) -> None:
    """What the kernels need beyond check_kvcache_arguments: fp16/bf16, a head dim that is a
    multiple of 8, and caches whose rows start on 16-byte boundaries (the kernels write them in
    place, so they cannot be copied)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16 on CUDA, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim % 8 != 0 or head_dim > 256:
        raise ValueError(f"head_dim must be a multiple of 8 up to 256 for CUDA tensors, got {head_dim}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")
        if any(s % 8 != 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1) or t.data_ptr() % 16 != 0:
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 8 elements, got "
                             f"strides {t.stride()}")


def _aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An input the kernels read (q, k, v) with a contiguous last dimension and 16-byte rows: itself,
    or a copy (q, k and v are never written)."""
    if t is None:
        return None
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
            s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, *,
                                 block_table: Optional[torch.Tensor] = None,
                                 cache_batch_idx: Optional[torch.Tensor] = None,
                                 softmax_scale: Optional[float] = None, causal: bool = False,
                                 window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                 alibi_slopes: Optional[torch.Tensor] = None,
                                 rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
                                 rotary_interleaved: bool = True, num_splits: int = 0, return_lse: bool = False,
                                 sinks: Optional[torch.Tensor] = None):
    """Attention of q over a KV cache after appending k and v to it in place.

    q: (batch, seqlen_q, heads, head_dim), seqlen_q from 1 (decoding) to thousands (chunked
    prefill). k_cache, v_cache: (batch_cache, seqlen_cache, heads_k, head_dim), or paged
    (num_blocks, page_size, heads_k, head_dim) with block_table, int32 (batch, max_blocks): position
    p of sequence b at page block_table[b, p // page_size], row p % page_size (any page size >= 1,
    pages in any order). k, v: (batch, seqlen_new, heads_k, head_dim) new tokens, written into the
    cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (rotated first with
    rotary_cos/rotary_sin), then sequence b attends to its first cache_seqlens[b] + seqlen_new
    positions, with causal masks, windows and ALiBi aligned to that length. cache_seqlens: int32
    (batch,) on q's device, or an int for every sequence; None (without k, v): every sequence is
    the whole cache. cache_batch_idx (int32 (batch,), contiguous caches): the cache row of each
    batch entry. heads a multiple of heads_k (GQA/MQA). The full semantics, including rotary's
    positions: flash_cutlass.reference.attention_with_kvcache.

    sinks ((heads,), on q's device): an attention sink a query head, as in flash_forward (lse then
    includes it).
    num_splits: how many CTAs share one sequence's keys on CUDA (split-KV, merged by log-sum-exp);
    0 picks from the shapes and the GPU's SM count. CPU tensors ignore it.
    Returns out like q, or (out, lse) with return_lse, lse fp32 (batch, heads, seqlen_q).

    Errors (TypeError / ValueError naming the argument) are raised before the cache is touched.
    CPU calls also check the lengths, block ids and conflicting writes; CUDA calls read nothing on
    the host (CUDA graphs capture them) and clamp lengths into [0, capacity - seqlen_new] and page
    ids / cache rows into the cache, so that wrong values give wrong results for their sequences
    but no access outside the cache. CUDA needs fp16/bf16, head_dim a multiple of 8 up to 256 and
    16-byte aligned caches.
    """
    arguments = reference.check_kvcache_arguments(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, sinks=sinks)
    num_splits = _check_num_splits(num_splits)
    return_lse = check_bool(return_lse, "return_lse")
    op_args = _op_args(q, k_cache, v_cache, k, v, arguments, num_splits)
    if torch.compiler.is_compiling():
        out, lse = kvcache_op(*op_args)
    else:
        out, lse = _run(arguments, *op_args)
    return (out, lse) if return_lse else out


def _op_args(q, k_cache, v_cache, k, v, arguments: reference.KVCacheArguments, num_splits: int) -> tuple:
    """The op's arguments, in its schema's order, from checked ones."""
    seqlens = arguments.cache_seqlens
    return (q, k_cache, v_cache, k, v, seqlens if isinstance(seqlens, torch.Tensor) else None,
            seqlens if isinstance(seqlens, int) else None, arguments.block_table, arguments.cache_batch_idx,
            arguments.softmax_scale, arguments.causal, arguments.window_size[0], arguments.window_size[1],
            arguments.softcap, arguments.alibi_slopes, arguments.rotary_cos, arguments.rotary_sin,
            arguments.rotary_interleaved, num_splits, arguments.sinks)


def _run(arguments: Optional[reference.KVCacheArguments], q, k_cache, v_cache, k, v, seqlens_tensor, seqlens_int,
         block_table, cache_batch_idx, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
         rotary_cos, rotary_sin, rotary_interleaved, num_splits, sinks):
    """(out, lse) of a call given the op's arguments; `arguments` are their checked form, or None to
    check them again (the op's own entry, whose values came from checked ones)."""
    cache_seqlens = seqlens_tensor if seqlens_tensor is not None else seqlens_int
    options = dict(block_table=block_table, cache_batch_idx=cache_batch_idx, softmax_scale=softmax_scale,
                   causal=causal, window_size=(window_left, window_right), softcap=softcap,
                   alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   rotary_interleaved=rotary_interleaved, sinks=sinks)
    if q.device.type != "cuda":
        return reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, **options)
    if arguments is None:
        arguments = reference.check_kvcache_arguments(q, k_cache, v_cache, k, v, cache_seqlens, **options)
    return _forward_cuda(q, k_cache, v_cache, k, v, arguments, num_splits)


_LIBRARY = torch.library.Library("flash_cutlass", "FRAGMENT")
_LIBRARY.define("kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
                "Tensor? cache_seqlens, int? cache_seqlen, Tensor? block_table, Tensor? cache_batch_idx, "
                "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
                "Tensor? alibi_slopes, Tensor? rotary_cos, Tensor? rotary_sin, bool rotary_interleaved, "
                "int num_splits, Tensor? sinks) -> (Tensor, Tensor)")


@torch.library.impl(_LIBRARY, "kvcache", "CompositeExplicitAutograd")
def _kvcache_impl(*op_args):
    return _run(None, *op_args)


@torch.library.register_fake("flash_cutlass::kvcache")
def _kvcache_fake(q, *_):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


kvcache_op = torch.ops.flash_cutlass.kvcache.default


def _forward_cuda(q, k_cache, v_cache, k, v, arguments: reference.KVCacheArguments, num_splits: int):
    _check_cuda_tensors(q, k_cache, v_cache, k, v)
    backend.check_kvcache_device(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    seqlens = arguments.cache_seqlens
    options = backend.with_float_sinks(AttentionOptions(
        softmax_scale=arguments.softmax_scale, causal=arguments.causal, window_left=arguments.window_size[0],
        window_right=arguments.window_size[1], softcap=arguments.softcap, alibi_slopes=arguments.alibi_slopes,
        sinks=arguments.sinks))
    rotary = [None if t is None else t.contiguous() for t in (arguments.rotary_cos, arguments.rotary_sin)]
    contiguous = [None if t is None else t.contiguous()
                  for t in (seqlens if isinstance(seqlens, torch.Tensor) else None, arguments.block_table,
                            arguments.cache_batch_idx)]
    backend.kvcache_extension().kvcache_forward(
        _aligned(q), k_cache, v_cache, _aligned(k), _aligned(v), contiguous[0],
        seqlens if isinstance(seqlens, int) else arguments.capacity, contiguous[1], contiguous[2], *rotary,
        arguments.rotary_interleaved, arguments.rotary_q_per_row, out, lse, num_splits, options)
    return out, lse

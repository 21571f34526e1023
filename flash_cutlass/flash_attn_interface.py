"""FlashAttention-2's Python functions, with its signatures, on flash_cutlass.

    # was: from flash_attn import flash_attn_func
    from flash_cutlass.flash_attn_interface import flash_attn_func

    out = flash_attn_func(q, k, v, dropout_p=0.1 if training else 0.0, causal=True)

flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func and flash_attn_with_kvcache
(serving: flash_cutlass.flash_attention_with_kvcache) take the arguments of
flash_attn.flash_attn_interface's functions (same names, order and defaults) and mean the same:
- q is (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim), with
  nheads a multiple of nheads_k (query head i reads kv head i // (nheads // nheads_k)); fp16 or
  bf16. The varlen functions take tokens packed as (total, nheads, headdim), sequence b owning
  rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, batch + 1 entries from 0).
- qkv is (batch, seqlen, 3, nheads, headdim) or (total, 3, nheads, headdim), kv (batch, seqlen_k,
  2, nheads_k, headdim) or (total_k, 2, nheads_k, headdim); the gradient comes back as one tensor
  of the packed shape.
- dropout_p applies whenever it is > 0 (pass 0.0 in evaluation); softmax_scale None is
  1/sqrt(headdim); causal aligns the diagonal to the bottom-right corner; window_size = (left,
  right) is a sliding window around it, -1 unbounded; softcap > 0 caps the scaled scores at
  softcap * tanh(s / softcap); alibi_slopes (fp32, (nheads,) or (batch, nheads)) adds
  -slope * |i + seqlen_k - seqlen_q - j|; deterministic makes the backward bitwise reproducible.
- The result is out, shaped like q; with return_attn_probs, (out, softmax_lse, S_dmask).

Each runs flash_cutlass.flash_attention or flash_attention_varlen: differentiable, traceable by
torch.compile(fullgraph=True), and on CPU tensors the pure-PyTorch reference (FA2 needs CUDA).

What differs from FlashAttention-2 (where flash_cutlass cannot do what FA2 does, the call raises
rather than return something else):
- return_attn_probs=True returns S_dmask empty, as FA2 does with dropout_p == 0; with
  dropout_p > 0, where FA2 returns the probabilities and the dropout pattern (for its tests), it
  raises NotImplementedError. softmax_lse ((batch, nheads, seqlen_q), or (nheads, total_q) in the
  varlen functions) carries no gradient, where FA2's takes one and drops it.
- block_table of flash_attn_varlen_func raises NotImplementedError (flash_attn_with_kvcache takes one).
- softcap < 0 and window sides below -1 raise ValueError (FA2 reads them as off and unbounded),
  as does softmax_scale <= 0. max_seqlen is trusted as in FA2 on CUDA (checked on CPU, and on
  CUDA with FLASH_CUTLASS_CHECK_VARLEN=1).
- The dropout mask is flash_cutlass's own (Philox over seed, offset, batch, head, row and key):
  the same seed drops other entries than FA2's. As with FA2, dropout_p > 0 draws from the CUDA
  generator without synchronizing: torch.compile keeps it in one graph, and a captured CUDA graph
  draws a fresh mask on each replay.
- A packed input's gradient is put together from dq, dk and dv (one copy of it), where FA2's
  backward writes into it directly.
- flash_attn_with_kvcache: cache_leftpad raises NotImplementedError; page sizes need not be
  multiples of 256 and rotary dims of 16; CUDA calls clamp out-of-range lengths and block ids
  into the cache (FA2 reads past it); the semantics otherwise are
  flash_cutlass.reference.attention_with_kvcache's.
- FA2's other functions are not provided.
"""

from __future__ import annotations

import torch

from flash_cutlass.kvcache import flash_attention_with_kvcache
from flash_cutlass.interface import flash_attention, flash_attention_varlen, with_contiguous_last_dim
from flash_cutlass.options import check_dropout_p

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _unpacked(packed, name: str, dim: int, count: int, layout: str):
    """The `count` tensors packed along `dim` of `packed`, as views (gradients flow back into it)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != dim + 3 or packed.shape[dim] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim)


def _check_attn_probs(dropout_p) -> None:
    """return_attn_probs=True can be honoured without dropout only: FA2's S_dmask is then empty."""
    if check_dropout_p(dropout_p) > 0:
        raise NotImplementedError(
            "return_attn_probs=True with dropout_p > 0 asks for S_dmask, the attention probabilities with "
            "the dropout pattern (FlashAttention-2 returns them for its tests), which flash_cutlass does not "
            "compute; pass return_attn_probs=False (flash_cutlass.flash_attention(q, k, v, dropout_p=..., "
            "return_lse=True) returns out and the log-sum-exp)")


def _with_empty_s_dmask(result):
    """(out, softmax_lse, S_dmask) from flash_attention's (out, lse): S_dmask is empty, as FA2's
    is without dropout."""
    out, softmax_lse = result
    return out, softmax_lse, out.new_empty((0,))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention-2's flash_attn_func: q (batch, seqlen_q, nheads, headdim) attends to k and v
    (batch, seqlen_k, nheads_k, headdim). Returns out like q, or with return_attn_probs (out,
    softmax_lse (batch, nheads, seqlen_q) fp32, an empty S_dmask; dropout_p must be 0 then). The
    arguments are described in the module docstring."""
    if return_attn_probs:
        _check_attn_probs(dropout_p)
    q, k, v = (with_contiguous_last_dim(t) for t in (q, k, v))
    result = flash_attention(q, k, v, softmax_scale, causal, deterministic, bool(return_attn_probs),
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    return _with_empty_s_dmask(result) if return_attn_probs else result


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim)."""
    q, k, v = _unpacked(qkv, "qkv", 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of q and of k, v packed as kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpacked(kv, "kv", 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention-2's flash_attn_varlen_func: a batch of sequences packed without padding, q
    (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim), sequence b owning rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32); max_seqlen_q and max_seqlen_k (ints) at least the longest lengths. Returns out like
    q, or with return_attn_probs (out, softmax_lse (nheads, total_q) fp32, an empty S_dmask).
    block_table (a paged KV cache) is not supported: it must be None."""
    if block_table is not None:
        raise NotImplementedError(
            "block_table (a paged KV cache) is not supported by flash_cutlass yet; pass block_table=None "
            "with k and v packed as (total_k, nheads_k, headdim)")
    if return_attn_probs:
        _check_attn_probs(dropout_p)
    q, k, v = (with_contiguous_last_dim(t) for t in (q, k, v))
    result = flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, deterministic, bool(return_attn_probs), window_size=window_size,
                                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    return _with_empty_s_dmask(result) if return_attn_probs else result


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func of q, k, v packed as qkv (total, 3, nheads, headdim), with one
    cu_seqlens and max_seqlen for queries and keys."""
    q, k, v = _unpacked(qkv, "qkv", 1, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func of q and of k, v packed as kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpacked(kv, "kv", 1, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """FlashAttention-2's flash_attn_with_kvcache: appends k and v to the cache in place at
    cache_seqlens, then attends q over each sequence's cache (flash_cutlass.flash_attention_with_kvcache).
    Returns out, or (out, softmax_lse) with return_softmax_lse."""
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not supported: pass each sequence's cache from position 0")
    return flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits, return_lse=return_softmax_lse)

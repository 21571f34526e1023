"""torch.nn.functional.scaled_dot_product_attention's signature and layout on flash_cutlass.

    out = flash_cutlass.scaled_dot_product_attention(query, key, value, is_causal=True)

query is (batch, heads, seqlen_q, head_dim), key and value (batch, heads_k, seqlen_k, head_dim),
as torch SDPA takes them; the result is (batch, heads, seqlen_q, head_dim), a transposed view of
flash_cutlass's (batch, seqlen_q, heads, head_dim) output (torch's flash backend returns the same
kind of view). Differentiable in query, key and value.

Semantics are torch SDPA's:
- is_causal aligns the diagonal to the top-left corner (query i sees keys 0..i), where
  flash_cutlass's causal=True aligns it to the bottom-right (query i sees keys up to
  i + seqlen_k - seqlen_q). Both agree when seqlen_q == seqlen_k; for seqlen_q > seqlen_k the
  top-left mask runs as a window on flash_cutlass's kernels.
- scale defaults to 1/sqrt(head_dim); enable_gqa=True lets heads be a multiple of heads_k.
- dropout_p drops probabilities as torch does, with flash_cutlass's own random stream (the masks
  differ from torch's).

What flash_cutlass cannot serve (an attn_mask, a causal mask with seqlen_q < seqlen_k, float32 or
float64 inputs, other ranks than 4, a build without the window kernels where one is needed) goes
to torch's own scaled_dot_product_attention with a warning the first time each reason occurs, or
raises ValueError with fallback=False.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from flash_cutlass import backend
from flash_cutlass.interface import SUPPORTED_DTYPES, flash_attention, with_contiguous_last_dim

_warned_reasons: set = set()


def _unsupported_reason(query, key, value, attn_mask, is_causal: bool) -> Optional[str]:
    """Why flash_cutlass cannot run this call, or None when it can."""
    if attn_mask is not None:
        return "an attn_mask (only attn_mask=None runs on flash_cutlass)"
    tensors = (query, key, value)
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return None  # flash_attention names the argument
    if any(t.dim() != 4 for t in tensors):
        return "inputs that are not 4-dimensional (batch, heads, seqlen, head_dim)"
    if any(t.dtype not in SUPPORTED_DTYPES for t in tensors):
        return f"dtype {query.dtype} (flash_cutlass runs float16 and bfloat16)"
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if is_causal and seqlen_q < seqlen_k:
        return ("is_causal with seqlen_q < seqlen_k (torch's top-left diagonal leaves keys past "
                "seqlen_q unseen; flash_cutlass's causal=True aligns the diagonal bottom-right)")
    if is_causal and seqlen_q > seqlen_k and query.is_cuda and not backend.compiled_window():
        return "is_causal with seqlen_q > seqlen_k in a build without the window kernels (FLASH_CUTLASS_WINDOW=0)"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, fallback: bool = True):
    """torch.nn.functional.scaled_dot_product_attention on flash_cutlass's kernels (see the module
    docstring). fallback: what a call flash_cutlass cannot serve does; True runs torch's SDPA (with
    a warning the first time for each reason), False raises ValueError."""
    reason = _unsupported_reason(query, key, value, attn_mask, bool(is_causal))
    if reason is not None:
        if not fallback:
            raise ValueError(f"flash_cutlass.scaled_dot_product_attention cannot run {reason}; "
                             "pass fallback=True to run torch's scaled_dot_product_attention instead")
        if reason not in _warned_reasons:
            _warned_reasons.add(reason)
            warnings.warn(f"flash_cutlass.scaled_dot_product_attention: {reason}: running torch's "
                          "scaled_dot_product_attention instead", stacklevel=2)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True to let "
                         "groups of query heads share a key/value head (as torch SDPA requires)")
    q, k, v = (with_contiguous_last_dim(t.transpose(1, 2)) for t in (query, key, value))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    causal = bool(is_causal) and seqlen_q == seqlen_k
    # Top-left causal with more queries than keys: query i sees key j iff j <= i, which is the
    # bottom-right convention's window with seqlen_q - seqlen_k keys to the right of its diagonal.
    window_size = (-1, seqlen_q - seqlen_k) if is_causal and seqlen_q > seqlen_k else (-1, -1)
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    out = flash_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          dropout_p=dropout_p)
    return out.transpose(1, 2)

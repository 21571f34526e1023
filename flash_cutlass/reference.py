"""Pure-PyTorch attention: the slow path.

This module is the CPU fallback and the oracle the CUDA kernels are tested
against. It favours clarity and numerical care over speed; do not use it where
performance matters.

Layout and conventions shared by every function here:

* ``q`` is ``(batch, seqlen_q, heads, head_dim)``; ``k`` and ``v`` are
  ``(batch, seqlen_k, kv_heads, head_dim)`` with ``heads % kv_heads == 0``.
  Query head ``i`` reads kv head ``i // (heads // kv_heads)`` (GQA/MQA).
* ``softmax_scale`` multiplies ``q @ k^T``; callers resolve a default of
  ``1 / sqrt(head_dim)`` themselves.
* ``causal`` masking is aligned to the bottom-right corner of the score matrix
  (the FlashAttention-2 convention): query row ``i`` may attend key ``j`` iff
  ``j <= i + seqlen_k - seqlen_q``.
* ``window_size = (left, right)`` is sliding-window (local) attention on the same
  diagonal: row ``i`` may attend key ``j`` iff ``i + d - left <= j <= i + d + right``
  with ``d = seqlen_k - seqlen_q``; ``-1`` leaves a side unbounded, and ``causal``
  sets ``right = 0`` (FlashAttention-2's semantics).
* ``softcap > 0`` soft-caps the scaled scores before any mask:
  ``score = softcap * tanh(softmax_scale * q k^T / softcap)``; ``0`` leaves them as they are.
* ``alibi_slopes`` (fp32 ``(heads,)`` or ``(batch, heads)``) adds ALiBi to the (soft-capped)
  scores before any mask: ``score -= slope * |i + seqlen_k - seqlen_q - j|`` with the slope of
  the row's batch and query head (FlashAttention-2's ALiBi); ``None`` adds nothing.
* ``dropout_p > 0`` with ``rng_state`` (an int64 ``(seed, offset)`` tensor) drops each
  probability ``P[i, j]`` of (batch ``b``, head ``h``) whose Philox word is below
  ``floor(dropout_p * 2^32)`` and scales the kept ones by ``1 / (1 - dropout_p)`` on their way
  into the output; the log-sum-exp stays that of the undropped softmax. The words are the
  kernels' (``include/flash_cutlass/common/dropout.h``): :func:`dropout_keep_mask`.
* ``sinks`` (``(heads,)``, a floating dtype) gives each query head an attention sink: a logit
  that joins every row's softmax after the scale, soft cap, ALiBi and mask, and attends to no value
  (gpt-oss's learned sinks). The row's probabilities then sum to ``1 - exp(sink - lse)``, and the
  log-sum-exp includes it: ``lse = log(exp(sink) + sum_j exp(score_j))``, so that a row that sees no
  key gets output 0 and log-sum-exp ``sink``. ``-inf`` is no sink. The backward needs nothing more
  than that ``lse``; the sinks' own gradient is :func:`sinks_gradient`.
* ``window_size``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``rng_state`` and ``sinks`` (the
  forwards only) are keywords of every function here, as is ``batch_start``: the call's index of the first batch entry, for
  dropout's words (the variable-length functions run their sequences one at a time).
* A query row that may attend no key gets output 0 and log-sum-exp ``-inf``.
* The log-sum-exp is the natural logarithm of ``sum_j exp(scaled score_j)``,
  shaped ``(batch, heads, seqlen_q)``.

The main functions: :func:`attention_forward`, a tiled
online-softmax forward that follows the kernels' algorithm without ever holding
the full score matrix; :func:`attention_backward`, its tiled gradient, which
recomputes the probabilities from the log-sum-exp one key block at a time; and
:func:`naive_attention`, which materializes the scores and is used to measure
what PyTorch achieves in a given dtype. :func:`attention_with_kvcache` is the
serving form (FlashAttention-2's ``flash_attn_with_kvcache``): new keys appended
to a contiguous or paged KV cache in place, then attention over each sequence's
cache.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterator, NamedTuple

import torch

__all__ = ["KVCacheArguments", "alibi_bias", "attention_backward", "attention_backward_varlen", "attention_forward",
           "attention_forward_varlen", "attention_with_kvcache", "causal_mask", "check_alibi_slopes",
           "check_kvcache_arguments",
           "check_sinks", "check_window_size", "dropout_keep_mask", "fold_sinks_into", "keep_mask", "naive_attention",
           "philox4x32_10", "sinks_gradient", "sinks_gradient_of_delta"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``(sq, sk)`` keep-mask: True where query row ``i`` may attend key ``j``.

    Bottom-right aligned: ``keep[i, j] = j <= i + sk - sq``. When ``sq > sk`` the
    first ``sq - sk`` rows keep nothing.
    """
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    return cols <= rows + (sk - sq)


def keep_mask(
    sq: int,
    sk: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    key_start: int = 0,
    key_end: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Bool ``(sq, key_end - key_start)`` keep-mask of keys ``[key_start, key_end)``
    (default: all ``sk``) under ``causal`` and ``window_size`` (module docstring), or
    ``None`` when nothing is masked."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    cols = torch.arange(key_start, sk if key_end is None else key_end, device=device).unsqueeze(0)
    keep = torch.ones(sq, cols.shape[1], dtype=torch.bool, device=device)
    if left >= 0:
        keep &= cols >= rows - left
    if right >= 0:
        keep &= cols <= rows + right
    return keep


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_size: int = 128,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled online-softmax attention forward.

    Walks the keys in blocks of ``block_size``, keeping a running row maximum
    and row sum in fp32 (fp64 for fp64 inputs) and rescaling the output
    accumulator whenever the maximum grows, as the CUDA kernels do. Extra memory
    is linear in the sequence lengths: one block of scores at a time, never the
    full score matrix, and K/V are never repeated across query heads.
    ``options``: the keywords of the module docstring's options.

    Returns ``(out, lse)``: ``out`` is ``(batch, seqlen_q, heads, head_dim)`` in
    ``q.dtype``; ``lse`` is ``(batch, heads, seqlen_q)`` in fp32 (fp64 for fp64
    inputs).
    """
    blocks = _KeyBlocks(q, k, v, softmax_scale, causal, block_size, options)
    rows = blocks.queries.shape[:3]  # (b, kv_heads, group * sq)
    row_max = blocks.queries.new_full(rows, float("-inf"))
    row_sum = blocks.queries.new_zeros(rows)
    acc = blocks.queries.new_zeros((*rows, v.shape[-1]))
    for block in blocks:
        scores = block.scores
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        # Rows that have seen no key yet keep a -inf maximum; subtracting 0
        # instead makes their exponentials exp(-inf) = 0 rather than NaN.
        shift = torch.where(torch.isneginf(new_max), 0.0, new_max)
        probs = torch.exp(scores - shift.unsqueeze(-1))
        correction = torch.exp(row_max - shift)
        row_sum = row_sum * correction + probs.sum(dim=-1)
        kept = blocks.dropout.applied(probs, block.start, block.end)
        acc = acc * correction.unsqueeze(-1) + torch.matmul(kept, block.values)
        row_max = new_max

    # Testing the maximum rather than the sum keeps NaN inputs visible as NaN.
    has_key = ~torch.isneginf(row_max)
    out = acc / torch.where(has_key, row_sum, 1.0).unsqueeze(-1)
    lse = torch.where(has_key, row_max + torch.log(row_sum), float("-inf"))
    out, lse = _ungroup_out(out, blocks.group, blocks.sq), lse.reshape(blocks.batch, blocks.heads, blocks.sq)
    if blocks.options.sinks is not None:
        lse = fold_sinks_into(out, lse, blocks.options.sinks)
    return out.to(q.dtype), lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_size: int = 128,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled gradient of :func:`attention_forward` with respect to ``q``, ``k`` and ``v``.

    ``dout`` and ``out`` are shaped like ``q``; ``lse`` is the forward's
    ``(batch, heads, seqlen_q)`` log-sum-exp. With ``D = rowsum(dout * out)``, each
    key block recomputes ``P = exp(scale * q k^T - lse)`` and accumulates
    ``dV += P^T dout``, ``dS = P * (dout v^T - D)``, ``dQ += scale * dS k`` and
    ``dK += scale * dS^T q``, summing over the query heads that share a kv head.
    Computes in fp32 (fp64 for fp64 inputs); extra memory is linear in the
    sequence lengths. Rows with ``lse = -inf`` (no visible key) get zero gradients.
    ``options``: the keywords of the module docstring's options.

    Returns ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k`` and ``v``.
    """
    if options.get("sinks") is not None:
        raise TypeError("attention_backward takes no sinks: the forward's lse holds them, and their gradient "
                        "is sinks_gradient's")
    blocks = _KeyBlocks(q, k, v, softmax_scale, causal, block_size, options)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            raise ValueError(f"{name} must be a tensor shaped like q {tuple(q.shape)}")
    batch, heads, sq, kv_heads, dtype = blocks.batch, blocks.heads, blocks.sq, blocks.kv_heads, blocks.dtype
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (batch, heads, sq):
        raise ValueError(f"lse must be a tensor shaped (batch, heads, seqlen_q) = {(batch, heads, sq)}")

    dog = _group_queries(dout.to(dtype), kv_heads)
    delta = (dog * _group_queries(out.to(dtype), kv_heads)).sum(dim=-1, keepdim=True)
    lse_g = lse.to(dtype).reshape(batch, kv_heads, blocks.group * sq, 1)
    # Rows without a visible key have lse = -inf; their P must be 0, not exp(-inf + inf).
    lse_g = torch.where(torch.isneginf(lse_g), float("inf"), lse_g)
    dq = torch.zeros_like(blocks.queries)
    dk = torch.zeros(batch, blocks.sk, kv_heads, k.shape[-1], dtype=dtype, device=q.device)
    dv = torch.zeros(batch, blocks.sk, kv_heads, v.shape[-1], dtype=dtype, device=q.device)
    for block in blocks:
        start, end = block.start, block.end
        probs = torch.exp(block.scores - lse_g)
        dv[:, start:end] = torch.matmul(blocks.dropout.applied(probs, start, end).transpose(-1, -2),
                                        dog).transpose(1, 2)
        dprobs = blocks.dropout.applied(torch.matmul(dog, block.values.transpose(-1, -2)), start, end)
        dscores = probs * (dprobs - delta)
        if block.softcap_slope is not None:
            dscores = dscores * block.softcap_slope
        dq += torch.matmul(dscores, block.keys) * blocks.scale
        dk[:, start:end] = (torch.matmul(dscores.transpose(-1, -2), blocks.queries) * blocks.scale).transpose(1, 2)

    return _ungroup_out(dq, blocks.group, sq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    compute_dtype: torch.dtype | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the full score matrix materialized.

    Inputs are cast to ``compute_dtype`` and every step (matmul, scaling,
    softmax, log-sum-exp, matmul) runs in that dtype, but for ALiBi's bias and the
    softmax after it, which run in fp32 at least. With ``compute_dtype=None``
    the inputs' own dtype is used, which gives the error PyTorch itself makes
    in that precision (the baseline of the FlashAttention-2 pass rule).
    ``options``: the keywords of the module docstring's options.

    Returns ``(out, lse)``: ``out`` is ``(batch, seqlen_q, heads, head_dim)`` in
    the compute dtype; ``lse`` is ``(batch, heads, seqlen_q)`` in fp32 (fp64 when
    computing in fp64).
    """
    scale = _check_inputs(q, k, v, softmax_scale)
    dtype = q.dtype if compute_dtype is None else compute_dtype
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"compute_dtype must be one of {_FLOAT_DTYPES}, got {compute_dtype}")

    batch, sq, heads, _ = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    options = _ScoreOptions.checked(batch, heads, options)
    qg = _group_queries(q.to(dtype), kv_heads)
    kt = k.to(dtype).permute(0, 2, 3, 1)
    vt = v.to(dtype).transpose(1, 2)

    scores = _softcapped(torch.matmul(qg, kt) * scale, options.softcap)
    if options.alibi_slopes is not None:
        # The bias in fp32 at least, as FlashAttention-2's reference adds it: distances of
        # thousands times a slope would lose their units in fp16/bf16.
        bias_dtype = torch.promote_types(dtype, torch.float32)
        bias = alibi_bias(options.alibi_slopes, batch, sq, sk, 0, sk, bias_dtype)
        scores = scores.to(bias_dtype) + _grouped(bias, kv_heads)
    keep = keep_mask(sq, sk, causal, options.window_size, device=q.device)
    if keep is not None:
        scores = _apply_keep(scores, keep, group)
    if options.sinks is not None:
        # The sink as one more column of each row's softmax, dropped after it.
        sink_column = _grouped_sinks(options.sinks, kv_heads, sq, scores.dtype).unsqueeze(-1)
        scores = torch.cat([scores, sink_column.expand(batch, -1, -1, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if options.sinks is not None:
        probs = probs[..., :-1]
    # softmax of an all -inf row is NaN; such a row attends nothing.
    probs = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, probs)
    dropout = _Dropout(options, batch, heads, sq, kv_heads, probs.dtype)
    out = torch.matmul(dropout.applied(probs, 0, sk).to(dtype), vt)

    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return _ungroup_out(out, group, sq), lse.to(lse_dtype).reshape(batch, heads, sq)


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(batch index, query rows, key rows) of each sequence of a variable-length call."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        yield b, slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


def _sequence_slopes(alibi_slopes: torch.Tensor | None, b: int) -> torch.Tensor | None:
    return alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def attention_forward_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_forward` of a variable-length batch: packed ``q`` ``(total_q, heads,
    head_dim)``, ``k`` and ``v`` ``(total_k, kv_heads, head_dim)``, sequence ``b`` owning rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32 cumulative lengths, ``batch + 1`` entries), each
    attended on its own with the masks aligned to its own lengths. ``options`` as
    :func:`attention_forward`'s (``alibi_slopes`` of shape ``(batch, heads)`` give sequence ``b``
    its row; dropout draws sequence ``b`` as batch entry ``b``). Returns ``out`` like ``q`` and
    ``lse`` ``(heads, total_q)``."""
    alibi_slopes = options.pop("alibi_slopes", None)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        seq_out, seq_lse = attention_forward(q[rows_q].unsqueeze(0), k[rows_k].unsqueeze(0), v[rows_k].unsqueeze(0),
                                             softmax_scale, causal, alibi_slopes=_sequence_slopes(alibi_slopes, b),
                                             batch_start=b, **options)
        out[rows_q] = seq_out[0]
        lse[:, rows_q] = seq_lse[0]
    return out, lse


def attention_backward_varlen(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_backward` of a variable-length batch (see :func:`attention_forward_varlen`;
    ``lse`` is ``(heads, total_q)``). Returns ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``."""
    alibi_slopes = options.pop("alibi_slopes", None)
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        seq_grads = attention_backward(dout[rows_q].unsqueeze(0), q[rows_q].unsqueeze(0), k[rows_k].unsqueeze(0),
                                       v[rows_k].unsqueeze(0), out[rows_q].unsqueeze(0),
                                       lse[:, rows_q].unsqueeze(0), softmax_scale, causal,
                                       alibi_slopes=_sequence_slopes(alibi_slopes, b), batch_start=b, **options)
        for grad, seq_grad, rows in zip(grads, seq_grads, (rows_q, rows_k, rows_k)):
            grad[rows] = seq_grad[0]
    return tuple(grads)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    *,
    block_table: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    sinks: torch.Tensor | None = None,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a KV cache, appending new keys first: FlashAttention-2's
    ``flash_attn_with_kvcache`` (forward only), the oracle of the coming serving kernel.

    Shapes (``heads % kv_heads == 0``; query head ``i`` reads kv head ``i // (heads // kv_heads)``):

    * ``q``: ``(batch, seqlen_q, heads, head_dim)``.
    * ``k_cache``, ``v_cache`` (one shape): contiguous ``(batch_cache, seqlen_cache, kv_heads,
      head_dim)``; or, with ``block_table``, paged ``(num_blocks, page_size, kv_heads, head_dim)``.
    * ``k``, ``v`` (both or neither): ``(batch, seqlen_new, kv_heads, head_dim)``, the new tokens.
    * ``cache_seqlens``: int32 ``(batch,)`` on q's device, or an int for every batch entry: the
      tokens already in each sequence's cache. ``None`` (only without ``k``/``v``): every sequence
      is its whole cache (``seqlen_cache``, or ``max_blocks_per_seq * page_size`` when paged).
    * ``block_table``: int32 ``(batch, max_blocks_per_seq)`` on q's device: position ``p`` of
      sequence ``b`` lives at ``k_cache[block_table[b, p // page_size], p % page_size]``. Only
      the entries covering the sequence's length are read (the rest may hold anything, e.g. -1).
    * ``cache_batch_idx``: int32 ``(batch,)``: batch entry ``b`` uses cache row
      ``cache_batch_idx[b]`` (contiguous cache only); ``None``: row ``b`` (then
      ``batch_cache == batch``).

    What it does, in order:

    1. Checks every argument; any error (``TypeError``/``ValueError`` naming the argument) is
       raised before the cache is touched.
    2. With ``rotary_cos``/``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)`` (q's dtype; they need
       ``k``/``v``), rotates the first ``rotary_dim`` (even, ``<= head_dim``) features of the new
       keys at positions ``cache_seqlens[b] + j`` and of the queries at ``cache_seqlens[b] + i``
       when ``causal`` or ``window_size != (-1, -1)``, else at ``cache_seqlens[b]`` for every
       query row (FlashAttention-2: without a mask all queries are the newest token). Rotation by
       angle ``t`` of pair ``(x1, x2)``: ``(x1 cos t - x2 sin t, x1 sin t + x2 cos t)``; the pairs
       are features ``(2m, 2m + 1)`` with ``rotary_interleaved`` (GPT-J) or ``(m, m + rotary_dim
       / 2)`` without (GPT-NeoX). Computed in fp32 (fp64 for fp64 inputs) and rounded to the
       inputs' dtype, as the kernels hold the rotated q and k. ``q``, ``k`` and ``v`` are never
       modified.
    3. Writes the (rotated) ``k`` and ``v`` in place into the cache at positions
       ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of sequence ``b`` (through the
       block table when paged). Every write slot must be distinct and no sequence may read a
       slot another batch entry writes (shared rows or pages): a kernel could not order them.
    4. Attends each sequence ``b`` over its first ``len_b = cache_seqlens[b] + seqlen_new``
       keys, as :func:`attention_forward` on that sequence alone: ``causal``, ``window_size``
       and ALiBi are aligned to ``len_b`` (query ``i`` may attend key ``j`` iff ``j <= i + len_b
       - seqlen_q`` when causal), ``softcap`` as in the module docstring, ``alibi_slopes`` of
       shape ``(batch, heads)`` give sequence ``b`` its row. ``softmax_scale`` defaults to
       ``1 / sqrt(head_dim)``. The keys are gathered into one contiguous tensor per sequence
       first, so a paged cache gives bitwise the result of a contiguous one holding the same
       values. ``sinks`` as in the module docstring.

    ``block_size`` is the key block of :func:`attention_forward`'s walk: the order of its sums,
    not what it computes.

    Returns ``(out, lse)``: ``out`` like ``q`` in q's dtype, ``lse`` ``(batch, heads, seqlen_q)``
    in fp32 (fp64 for fp64 inputs). A query row that sees no key (``len_b == 0``, or masked away)
    gets output 0 and log-sum-exp ``-inf``.

    Differences from FlashAttention-2, where its kernel's limits are not semantics: any
    ``page_size >= 1`` (FA2: a multiple of 256) and any even ``rotary_dim`` (FA2: a multiple of
    16); an int ``cache_seqlens`` is broadcast to ``batch`` (FA2: to ``batch_cache``);
    conflicting writes raise instead of racing; the queries' rotary positions follow ``causal`` and
    ``window_size`` as given (FA2 first drops a window side at least the cache's length, and then
    rotates every query row at ``cache_seqlens`` when no mask is left); FA2's ``cache_leftpad``,
    ``num_splits`` and ``return_softmax_lse`` are not taken (the log-sum-exp is always returned).
    """
    plan = _KVCachePlan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved,
                        sinks, block_size)
    # Everything is checked: from here on the cache is written.
    plan.append()
    batch, sq, heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, sq, dtype=plan.dtype, device=q.device)
    for b in range(batch):
        keys, values = plan.gathered(b)
        seq_out, seq_lse = attention_forward(
            plan.queries(b), keys.unsqueeze(0), values.unsqueeze(0), plan.scale, plan.causal, block_size,
            window_size=plan.window_size, softcap=plan.softcap, alibi_slopes=_sequence_slopes(plan.alibi_slopes, b),
            sinks=plan.sinks)
        out[b], lse[b] = seq_out[0], seq_lse[0]
    return out, lse


def check_device_of_q(t: torch.Tensor, name: str, device: torch.device) -> None:
    """Raises ValueError naming ``name`` unless tensor t is on q's device."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; they must be on one device")


def check_dtype_of_q(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """Raises TypeError naming ``name`` unless tensor t has q's dtype."""
    if t.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {t.dtype}")


def _int32_tensor(value: object, name: str, device: torch.device, dims: int, what: str) -> torch.Tensor:
    """``value`` checked to be an int32 ``dims``-D tensor on ``device``; raises naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {value.dtype}")
    check_device_of_q(value, name, device)
    if value.dim() != dims:
        raise ValueError(f"{name} must be {what}, got shape {tuple(value.shape)}")
    return value


@dataclasses.dataclass(frozen=True)
class KVCacheArguments:
    """The arguments of a KV-cache call, checked by :func:`check_kvcache_arguments` without reading
    any tensor's data, and what their shapes say."""

    paged: bool
    page_size: int  # rows of a page (paged); the contiguous cache's seqlen_cache otherwise
    capacity: int  # positions one sequence can hold
    seqlen_new: int
    cache_seqlens: torch.Tensor | int | None
    block_table: torch.Tensor | None
    cache_batch_idx: torch.Tensor | None
    softmax_scale: float
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    alibi_slopes: torch.Tensor | None
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    sinks: torch.Tensor | None = None

    @property
    def rotary(self) -> bool:
        return self.rotary_cos is not None

    @property
    def rotary_q_per_row(self) -> bool:
        """Whether query row i turns at cache_seqlens[b] + i (a mask is set), else at cache_seqlens[b]."""
        return self.causal or self.window_size != (-1, -1)


def check_kvcache_arguments(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, *, block_table=None,
                            cache_batch_idx=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=True, sinks=None) -> KVCacheArguments:
    """The checks of :func:`attention_with_kvcache`'s arguments that read no tensor data: types,
    dtypes, devices, shapes, and the values of Python numbers. Raises TypeError or ValueError naming
    the argument. The CPU path (this module) and the CUDA path (flash_cutlass.kvcache) both make
    them; only the CPU path then reads the lengths, block ids and cache rows and checks those (a
    CUDA call reads nothing on the host, and its kernels clamp them into the cache instead)."""
    from flash_cutlass import options as _options  # options imports this module

    _check_kvcache_tensors(q, k_cache, v_cache, k, v)
    batch, sq, heads, head_dim = q.shape
    device = q.device
    seqlen_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    if paged:
        block_table = _int32_tensor(block_table, "block_table", device, 2, "(batch, max_blocks_per_seq)")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have batch = {batch} rows (q's batch), got {block_table.shape[0]}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for a contiguous cache; a paged cache (block_table given) "
                             "maps batch entries to pages through block_table")
        page_size = k_cache.shape[1]
        if page_size < 1:
            raise ValueError(f"page size (k_cache.shape[1]) must be >= 1 for a paged cache, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        page_size = capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise ValueError(f"k_cache batch ({k_cache.shape[0]}) must equal q's batch ({batch}) "
                                 "without cache_batch_idx")
        else:
            cache_batch_idx = _int32_tensor(cache_batch_idx, "cache_batch_idx", device, 1, "(batch,)")
            if cache_batch_idx.shape[0] != batch:
                raise ValueError(f"cache_batch_idx must have shape (batch,) = ({batch},), "
                                 f"got {tuple(cache_batch_idx.shape)}")
    cache_seqlens = _check_kvcache_seqlens(cache_seqlens, batch, device, k is not None, seqlen_new, capacity, paged)
    window = check_window_size(window_size)
    causal = _options.check_bool(causal, "causal")
    arguments = KVCacheArguments(
        paged=paged, page_size=page_size, capacity=capacity, seqlen_new=seqlen_new, cache_seqlens=cache_seqlens,
        block_table=block_table, cache_batch_idx=cache_batch_idx,
        softmax_scale=_options.check_softmax_scale(softmax_scale, head_dim), causal=causal, window_size=window,
        softcap=_options.check_softcap(softcap), alibi_slopes=_options.check_alibi_slopes(alibi_slopes, q, batch),
        rotary_cos=None, rotary_sin=None, rotary_interleaved=True, sinks=_options.check_sinks(sinks, q))
    if rotary_cos is None and rotary_sin is None:
        return arguments
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin need k and v: the new keys are rotated before they are "
                         "appended (FlashAttention-2)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_dtype_of_q(t, name, q.dtype)
        check_device_of_q(t, name, device)
        if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] < 1 or 2 * t.shape[1] > head_dim:
            raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= head_dim = "
                             f"{head_dim} and seqlen_ro >= 1, got shape {tuple(t.shape)}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, "
                         f"got {tuple(rotary_sin.shape)}")
    arguments = dataclasses.replace(arguments, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                    rotary_interleaved=_options_bool(rotary_interleaved, "rotary_interleaved"))
    if _is_int(arguments.cache_seqlens) and batch:
        # An int length is known without reading data: CUDA calls, whose kernels would clamp a
        # position past seqlen_ro to its last row, raise here as CPU calls do.
        _check_rotary_positions(rotary_cos.shape[0], [arguments.cache_seqlens], seqlen_new, sq,
                                arguments.rotary_q_per_row)
    return arguments


def _check_rotary_positions(seqlen_ro: int, starts: list[int], seqlen_new: int, seqlen_q: int, q_per_row: bool):
    """Raises unless rotary_cos/rotary_sin have a row for every position the call rotates: the new
    keys at starts[b] + j, the queries at starts[b] + i (q_per_row) or starts[b]."""
    rows = max(seqlen_new, seqlen_q if q_per_row else 1)
    needed = max(starts) + rows if starts else 0
    if needed > seqlen_ro:
        raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} positions (seqlen_ro) but the call "
                         f"rotates positions up to {needed - 1}")


def _check_kvcache_tensors(q, k_cache, v_cache, k, v):
    given = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens) or both be None")
    if k is not None:
        given += [("k", k), ("v", v)]
    for name, t in given:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
    for name, t in given[1:]:
        check_dtype_of_q(t, name, q.dtype)
        check_device_of_q(t, name, q.device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    batch, _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim ({k_cache.shape[3]}) must equal q's ({head_dim})")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"q heads ({heads}) must be a multiple of k_cache heads ({kv_heads}), "
                         "and k_cache heads must be >= 1")
    if k is not None:
        if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"k must be (batch, seqlen_new, kv_heads, head_dim) = ({batch}, seqlen_new, "
                             f"{kv_heads}, {head_dim}), got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")


def _past_the_cache(b: int, start: int, seqlen_new: int, capacity: int, paged: bool) -> str:
    where = "block_table holds max_blocks_per_seq * page_size" if paged else "k_cache holds seqlen_cache"
    return (f"cache_seqlens[{b}] = {start} plus {seqlen_new} new tokens is past the cache: {where} = "
            f"{capacity} positions")


def _check_kvcache_seqlens(cache_seqlens, batch, device, appending, seqlen_new, capacity, paged):
    """cache_seqlens checked as far as it goes without its data: an int (every sequence) in range,
    or an int32 (batch,) tensor on q's device; None only without new tokens."""
    if cache_seqlens is None:
        if appending:
            raise ValueError("cache_seqlens is required with k and v: it says where the new tokens go")
        return None
    if _is_int(cache_seqlens):
        start = int(cache_seqlens)
        if start < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {start} for batch entry 0")
        if batch and start + seqlen_new > capacity:
            raise ValueError(_past_the_cache(0, start, seqlen_new, capacity, paged))
        return start
    seqlens = _int32_tensor(cache_seqlens, "cache_seqlens", device, 1, "an int or (batch,)")
    if seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(seqlens.shape)}")
    if seqlen_new > capacity:
        raise ValueError(f"k has {seqlen_new} new tokens but the cache holds {capacity} positions a sequence")
    return seqlens


class _KVCachePlan:
    """The checked arguments of :func:`attention_with_kvcache` and where each token lives: the
    checks of check_kvcache_arguments, then those of the lengths, block ids and cache rows, which
    read the tensors' data.

    A token lives at ``cache[row, position]`` (contiguous) or ``cache[block, offset]`` (paged);
    the cache is indexed in place, whatever its strides."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved, sinks, block_size):
        arguments = check_kvcache_arguments(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, sinks=sinks)
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        batch, sq, heads, head_dim = q.shape
        self.q, self.k_cache, self.v_cache, self.k, self.v = q, k_cache, v_cache, k, v
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.seqlen_new = arguments.seqlen_new
        self.paged, self.capacity = arguments.paged, arguments.capacity
        if self.paged:
            self.page_size = arguments.page_size
            self.block_table = arguments.block_table.tolist()
        elif arguments.cache_batch_idx is None:
            self.rows = list(range(batch))
        else:
            self.rows = arguments.cache_batch_idx.tolist()
            bad = [r for r in self.rows if not 0 <= r < k_cache.shape[0]]
            if bad:
                raise ValueError(f"cache_batch_idx entries must be in [0, {k_cache.shape[0]}) (k_cache's batch), "
                                 f"got {bad[0]}")

        self.start = self._check_seqlens(arguments.cache_seqlens, batch)
        self.lengths = [s + self.seqlen_new for s in self.start]
        if self.paged:
            for b, length in enumerate(self.lengths):
                used = self.block_table[b][:-(-length // self.page_size)]
                bad = [block for block in used if not 0 <= block < k_cache.shape[0]]
                if bad:
                    raise ValueError(f"block_table[{b}] holds block id {bad[0]} among the blocks of its first "
                                     f"{length} tokens; block ids must be in [0, {k_cache.shape[0]}) "
                                     "(k_cache's num_blocks)")

        self.scale, self.causal, self.window_size = arguments.softmax_scale, arguments.causal, arguments.window_size
        self.softcap, self.alibi_slopes, self.sinks = arguments.softcap, arguments.alibi_slopes, arguments.sinks
        self.rotary = arguments.rotary
        if self.rotary:
            self.cos, self.sin = arguments.rotary_cos, arguments.rotary_sin
            self.interleaved, self.q_per_row = arguments.rotary_interleaved, arguments.rotary_q_per_row
            _check_rotary_positions(self.cos.shape[0], self.start, self.seqlen_new, sq, self.q_per_row)
        self._check_conflicts()

    def _check_seqlens(self, cache_seqlens, batch) -> list[int]:
        """Each sequence's tokens already in the cache, checked against its capacity."""
        if cache_seqlens is None:
            return [self.capacity] * batch
        start = [cache_seqlens] * batch if _is_int(cache_seqlens) else cache_seqlens.tolist()
        for b, s in enumerate(start):
            if s < 0:
                raise ValueError(f"cache_seqlens must be >= 0, got {s} for batch entry {b}")
            if s + self.seqlen_new > self.capacity:
                raise ValueError(_past_the_cache(b, s, self.seqlen_new, self.capacity, self.paged))
        return start

    def _slots(self, b: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``positions`` of sequence ``b`` live: the (row or block, position or offset)
        indices (int64) into the cache's first two dimensions."""
        pos = torch.arange(positions.start, positions.stop, dtype=torch.int64)
        if self.paged:
            table = torch.tensor(self.block_table[b], dtype=torch.int64)
            return table[pos // self.page_size], pos % self.page_size
        return torch.full_like(pos, self.rows[b]), pos

    def _check_conflicts(self):
        if self.seqlen_new == 0:
            return
        writer = torch.full(tuple(self.k_cache.shape[:2]), -1, dtype=torch.int64)
        for b, s in enumerate(self.start):
            written = self._slots(b, range(s, s + self.seqlen_new))
            taken = writer[written]
            if (taken >= 0).any():
                raise ValueError(f"batch entries {int(taken[taken >= 0][0])} and {b} write the same cache slot "
                                 "(cache_batch_idx or block_table shared between them)")
            writer[written] = b
        for b, length in enumerate(self.lengths):
            readers = writer[self._slots(b, range(length))]
            foreign = (readers >= 0) & (readers != b)
            if foreign.any():
                raise ValueError(f"batch entry {b} reads a cache slot that batch entry {int(readers[foreign][0])} "
                                 "writes (cache_batch_idx or block_table shared between them)")

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``(n, heads, head_dim)`` with each row ``r`` rotated at ``positions[r]``."""
        half = self.cos.shape[1]
        cos = self.cos[positions].to(self.dtype).unsqueeze(1)
        sin = self.sin[positions].to(self.dtype).unsqueeze(1)
        x = x.to(self.dtype)
        rot = x[..., :2 * half]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., :half], rot[..., half:]
            rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return torch.cat((rot, x[..., 2 * half:]), dim=-1).to(self.q.dtype)

    def append(self):
        """Write the new (rotated) keys and values into the cache."""
        if self.seqlen_new == 0:
            return
        for b, s in enumerate(self.start):
            slots = tuple(index.to(self.k_cache.device) for index in self._slots(b, range(s, s + self.seqlen_new)))
            keys = self.k[b]
            if self.rotary:
                keys = self._rotated(keys, torch.arange(s, s + self.seqlen_new, device=self.cos.device))
            self.k_cache[slots] = keys
            self.v_cache[slots] = self.v[b]

    def gathered(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s keys and values ``(len_b, kv_heads, head_dim)``, contiguous."""
        slots = tuple(index.to(self.k_cache.device) for index in self._slots(b, range(self.lengths[b])))
        return self.k_cache[slots], self.v_cache[slots]

    def queries(self, b: int) -> torch.Tensor:
        """Sequence ``b``'s queries ``(1, seqlen_q, heads, head_dim)``, rotated when asked."""
        q = self.q[b]
        if self.rotary:
            offsets = torch.arange(q.shape[0], device=self.cos.device) if self.q_per_row else torch.zeros(
                q.shape[0], dtype=torch.int64, device=self.cos.device)
            q = self._rotated(q, self.start[b] + offsets)
        return q.unsqueeze(0)


def _options_bool(value: object, name: str) -> bool:
    from flash_cutlass import options as _options  # options imports this module

    return _options.check_bool(value, name)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> float:
    """Validate shapes, dtypes and devices; return the scale as a Python float."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "k and v must agree in (batch, seqlen_k, kv_heads), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head_dim differ: {q.shape[3]} vs {k.shape[3]}")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads}), "
            "and k/v heads must be >= 1"
        )
    if (
        softmax_scale is None
        or isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
    ):
        raise TypeError(f"softmax_scale must be a real number, got {softmax_scale!r}")
    return float(softmax_scale)


def _softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap) for softcap > 0, else the scores themselves."""
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def check_window_size(window_size: object) -> tuple[int, int]:
    """window_size as a (left, right) tuple of ints >= -1 (-1: unbounded); raises TypeError or
    ValueError naming the argument otherwise. flash_cutlass's entry points check with it too."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
        _is_int(side) for side in window_size
    ):
        raise TypeError(f"window_size must be a (left, right) tuple of two ints, got {window_size!r}")
    left, right = (int(side) for side in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {(left, right)}")
    if left >= 2**31 or right >= 2**31:
        raise ValueError(f"window_size entries must be below 2^31 (-1: unbounded), got {(left, right)}")
    return left, right


def check_alibi_slopes(alibi_slopes: object, batch: int, heads: int) -> torch.Tensor | None:
    """alibi_slopes as given (None, or a float32 tensor of shape (heads,) or (batch, heads));
    raises TypeError or ValueError naming the argument otherwise. flash_cutlass's entry points
    check with it too (and for the device)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = ({batch}, {heads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes


_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_sinks(sinks: object, heads: int) -> torch.Tensor | None:
    """sinks as given (None, or a floating tensor of shape (heads,)); raises TypeError or ValueError
    naming the argument otherwise. flash_cutlass's entry points check with it too (and for the
    device)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in _SINK_DTYPES:
        raise TypeError(f"sinks must be float32, float16, bfloat16 or float64, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one logit a query head, "
                         f"got {tuple(sinks.shape)}")
    return sinks


def _grouped_sinks(sinks: torch.Tensor, kv_heads: int, sq: int, dtype: torch.dtype) -> torch.Tensor:
    """The sink of each grouped row (1, kv_heads, group * sq) (the rows of ``_group_queries``)."""
    group = sinks.shape[0] // kv_heads
    return sinks.to(dtype).reshape(1, kv_heads, group, 1).expand(1, kv_heads, group, sq).reshape(1, kv_heads, -1)


def _sinks_of_rows(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sinks (heads,) shaped to broadcast against lse: (batch, heads, seqlen_q), or (heads, total_q)
    in a variable-length call."""
    return sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(-1, 1)


def _rows_to_out(values: torch.Tensor) -> torch.Tensor:
    """A value per row in lse's layout, shaped to broadcast against out: (batch, heads, seqlen_q) ->
    (batch, seqlen_q, heads, 1), (heads, total_q) -> (total_q, heads, 1)."""
    return values.transpose(-1, -2).unsqueeze(-1)


def fold_sinks_into(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Makes (out, lse) of attention without sinks those of attention with them (module docstring):
    scales out in place by exp(lse - lse') = sigmoid(lse - sink), in lse's dtype (at least fp32)
    before out's rounding, and returns lse' = log(exp(lse) + exp(sink)). out (batch, seqlen_q, heads,
    head_dim) with lse (batch, heads, seqlen_q), or packed out (total_q, heads, head_dim) with lse
    (heads, total_q); sinks (heads,). Reads no tensor data on the host; one pass over out."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(dtype)
    # A sink of -inf (none) as the lowest finite logit: a row without keys then keeps out 0 where
    # -inf - -inf would make its weight NaN.
    row_sinks = _sinks_of_rows(sinks.to(dtype).clamp_min(torch.finfo(dtype).min), lse)
    out.mul_(_rows_to_out(torch.sigmoid(lse - row_sinks)))
    return torch.logaddexp(lse, _sinks_of_rows(sinks.to(dtype), lse))


def sinks_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                   rows: torch.Tensor | int | None = None) -> torch.Tensor:
    """The gradient of the sinks (heads,): d sink_h = -sum over the rows of head h of
    exp(sink_h - lse) * rowsum(dout * out), with out and lse those of the forward with the sinks (the
    sink's probability times D, the rowsum every backward computes): sinks_gradient_of_delta of that
    D, computed here in fp32 (fp64 for fp64 inputs). Layouts as fold_sinks_into's."""
    dtype = torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)
    delta = (dout.to(dtype) * out.to(dtype)).sum(dim=-1).transpose(-1, -2)  # lse's layout
    return sinks_gradient_of_delta(delta, lse, sinks, rows)


def sinks_gradient_of_delta(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                            rows: torch.Tensor | int | None = None) -> torch.Tensor:
    """sinks_gradient from D = rowsum(dout * out) laid out as lse ((batch, heads, seqlen_q), or
    (heads, total_q)): the backward kernels' own. rows (a variable-length call): how many leading
    packed rows belong to a sequence (cu_seqlens_q[-1]), the others left out. Rows with lse -inf
    contribute nothing. Computed in D's dtype (at least fp32), returned in sinks' dtype; reads no
    tensor data on the host."""
    dtype = torch.promote_types(torch.promote_types(delta.dtype, lse.dtype), torch.float32)
    delta, lse = delta.to(dtype), lse.to(dtype)
    terms = torch.exp(_sinks_of_rows(sinks.to(dtype), lse) - lse) * delta
    outside = torch.isneginf(lse)
    if rows is not None:
        outside |= torch.arange(lse.shape[-1], device=lse.device) >= rows
    terms = torch.where(outside, 0.0, terms)
    return -(terms.sum(dim=(0, 2)) if lse.dim() == 3 else terms.sum(dim=1)).to(sinks.dtype)


def alibi_bias(
    alibi_slopes: torch.Tensor, batch: int, sq: int, sk: int, key_start: int, key_end: int, dtype: torch.dtype
) -> torch.Tensor:
    """ALiBi's ``(batch, heads, sq, key_end - key_start)`` bias of keys ``[key_start, key_end)``:
    ``-slope * |i + sk - sq - j|`` (module docstring), in ``dtype``."""
    slopes = alibi_slopes.to(dtype).expand(batch, alibi_slopes.shape[-1])
    rows = torch.arange(sq, device=alibi_slopes.device).unsqueeze(1) + (sk - sq)
    cols = torch.arange(key_start, key_end, device=alibi_slopes.device).unsqueeze(0)
    distance = (rows - cols).abs().to(dtype)
    return -slopes[:, :, None, None] * distance


_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def _mulhilo32(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of multiplier * x, x int64 in [0, 2^32), without int64 overflow."""
    low_half, high_half = x & 0xFFFF, x >> 16
    product_low = multiplier * low_half  # < 2^48
    product_high = multiplier * high_half  # < 2^48
    middle = ((product_high & 0xFFFF) << 16) + product_low
    return (product_high >> 16) + (middle >> 32), middle & _MASK32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., SC 2011) on int64 tensors holding uint32 words, elementwise:
    the four output words of each counter under the 64-bit key (low word, high word)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo32(_PHILOX_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_KEY_STEPS[0]) & _MASK32, (k1 + _PHILOX_KEY_STEPS[1]) & _MASK32
    return c0, c1, c2, c3


def dropout_keep_mask(
    rng_state: torch.Tensor, dropout_p: float, batch: int, heads: int, sq: int, key_start: int, key_end: int,
    device: torch.device | str | None = None, batch_start: int = 0,
) -> torch.Tensor:
    """Bool ``(batch, heads, sq, key_end - key_start)``: which probabilities of keys
    ``[key_start, key_end)`` dropout keeps (module docstring). The words are Philox4x32-10's with
    counter ``(j // 2, i // 2, b * heads + h, offset // 4)`` and key ``seed``; ``(i, j)`` reads
    word ``2 * (i % 2) + j % 2`` of its counter, as the CUDA kernels do. The batch entries are
    ``batch_start, ..., batch_start + batch - 1`` of the call (a variable-length call's sequences
    run one at a time here)."""
    seed, offset = (int(x) for x in rng_state.tolist())
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    rows = torch.arange(sq, device=device).view(1, 1, sq, 1)
    cols = torch.arange(key_start, key_end, device=device).view(1, 1, 1, -1)
    batch_head = torch.arange(batch_start * heads, (batch_start + batch) * heads, device=device)
    batch_head = batch_head.view(batch, heads, 1, 1)
    counter = (cols >> 1, rows >> 1, batch_head, torch.full((), (offset >> 2) & _MASK32, device=device))
    shape = (batch, heads, sq, key_end - key_start)
    words = [w.expand(shape) for w in philox4x32_10(tuple(c.expand(shape) for c in counter), key)]
    odd_row, odd_col = (rows & 1).bool(), (cols & 1).bool()
    word = torch.where(odd_row, torch.where(odd_col, words[3], words[2]), torch.where(odd_col, words[1], words[0]))
    return word >= _dropout_threshold(dropout_p)


def _dropout_threshold(dropout_p: float) -> int:
    return math.floor(dropout_p * 2**32)


@dataclasses.dataclass(frozen=True)
class _ScoreOptions:
    """The keyword options of every function here (module docstring), checked once per call."""

    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng_state: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    batch_start: int = 0

    @classmethod
    def checked(cls, batch: int, heads: int, options: dict) -> "_ScoreOptions":
        """The options of a call on ``batch`` x ``heads`` queries; raises naming the argument."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(names)}")
        given = cls(**options)
        window_size = check_window_size(given.window_size)
        alibi_slopes = check_alibi_slopes(given.alibi_slopes, batch, heads)
        if not 0 <= given.dropout_p < 1:
            raise ValueError(f"dropout_p must be in [0, 1), got {given.dropout_p}")
        if _dropout_threshold(given.dropout_p) > 0 and not isinstance(given.rng_state, torch.Tensor):
            raise ValueError("dropout_p > 0 needs rng_state, an int64 (seed, offset) tensor")
        return dataclasses.replace(given, window_size=window_size, alibi_slopes=alibi_slopes,
                                   sinks=check_sinks(given.sinks, heads))


class _Dropout:
    """The dropout of one call on grouped probabilities (b, kv_heads, group * sq, n)."""

    def __init__(self, options: _ScoreOptions, batch, heads, sq, kv_heads, dtype):
        self.active = _dropout_threshold(options.dropout_p) > 0
        self.dropout_p, self.rng_state = options.dropout_p, options.rng_state
        self.batch, self.heads, self.sq, self.kv_heads = batch, heads, sq, kv_heads
        self.scale = 1.0 / (1.0 - options.dropout_p)
        self.batch_start = options.batch_start

    def applied(self, probs: torch.Tensor, key_start: int, key_end: int) -> torch.Tensor:
        """probs with the dropped entries of keys [key_start, key_end) zeroed and the rest scaled."""
        if not self.active:
            return probs
        keep = dropout_keep_mask(self.rng_state, self.dropout_p, self.batch, self.heads, self.sq, key_start, key_end,
                                 probs.device, self.batch_start)
        return torch.where(_grouped(keep, self.kv_heads), probs * self.scale, 0.0)


class _KeyBlock(NamedTuple):
    start: int
    end: int
    keys: torch.Tensor  # (b, kv_heads, n, d) in the compute dtype
    values: torch.Tensor
    scores: torch.Tensor  # (b, kv_heads, group * sq, n): scaled, soft-capped, biased and masked
    softcap_slope: torch.Tensor | None  # d score / d scaled score under the soft cap; None without one


class _KeyBlocks:
    """What the tiled forward and backward share: the checked call, the queries grouped by kv head
    in the compute dtype (fp32, fp64 for fp64 inputs), the dropout, and, iterated, each block of
    ``block_size`` keys with its scores."""

    def __init__(self, q, k, v, softmax_scale, causal, block_size, options: dict):
        self.scale = _check_inputs(q, k, v, softmax_scale)
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.batch, self.sq, self.heads, _ = q.shape
        self.sk, self.kv_heads = k.shape[1], k.shape[2]
        self.group = self.heads // self.kv_heads
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.options = _ScoreOptions.checked(self.batch, self.heads, options)
        self.queries = _group_queries(q.to(self.dtype), self.kv_heads)
        self.dropout = _Dropout(self.options, self.batch, self.heads, self.sq, self.kv_heads, self.dtype)
        self.k, self.v, self.causal, self.block_size = k, v, causal, block_size

    def __iter__(self) -> Iterator[_KeyBlock]:
        options = self.options
        for start in range(0, self.sk, self.block_size):
            end = min(start + self.block_size, self.sk)
            keys = self.k[:, start:end].to(self.dtype).transpose(1, 2)
            values = self.v[:, start:end].to(self.dtype).transpose(1, 2)
            scores = torch.matmul(self.queries, keys.transpose(-1, -2)) * self.scale
            softcap_slope = None
            if options.softcap > 0:
                capped = torch.tanh(scores / options.softcap)
                scores = options.softcap * capped
                softcap_slope = 1 - capped * capped
            if options.alibi_slopes is not None:
                bias = alibi_bias(options.alibi_slopes, self.batch, self.sq, self.sk, start, end, self.dtype)
                scores = scores + _grouped(bias, self.kv_heads)
            # This block's columns of the mask, built per block: no (sq, sk) matrix.
            keep = keep_mask(self.sq, self.sk, self.causal, options.window_size, start, end, self.queries.device)
            if keep is not None:
                scores = _apply_keep(scores, keep, self.group)
            yield _KeyBlock(start, end, keys, values, scores, softcap_slope)


def _grouped(bias: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, sq, n) -> (b, kv_heads, group * sq, n), the rows of ``_group_queries``."""
    batch, heads, sq, n = bias.shape
    return bias.reshape(batch, kv_heads, (heads // kv_heads) * sq, n)


def _is_int(value: object) -> bool:
    # type() first: the ABC check costs about a microsecond, and most calls pass a plain int.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, sq, h, d) -> (b, kv_heads, group * sq, d), query heads sharing a kv head stacked.

    Folding the group into the row dimension lets one plain matmul against the
    (b, kv_heads, ...) K and V serve all query heads of a group, without
    repeating K or V.
    """
    batch, sq, heads, dim = q.shape
    group = heads // kv_heads
    return q.reshape(batch, sq, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(
        batch, kv_heads, group * sq, dim
    )


def _ungroup_out(out: torch.Tensor, group: int, sq: int) -> torch.Tensor:
    """(b, kv_heads, group * sq, dv) -> (b, sq, heads, dv); inverse of ``_group_queries``."""
    batch, kv_heads, _, dim = out.shape
    return out.reshape(batch, kv_heads, group, sq, dim).permute(0, 3, 1, 2, 4).reshape(
        batch, sq, kv_heads * group, dim
    )


def _apply_keep(scores: torch.Tensor, keep: torch.Tensor, group: int) -> torch.Tensor:
    """Set grouped scores (b, kv_heads, group * sq, n) to -inf where ``keep`` (sq, n) is False."""
    batch, kv_heads, rows, n = scores.shape
    grouped = scores.reshape(batch, kv_heads, group, keep.shape[0], n)
    return grouped.masked_fill(~keep, float("-inf")).reshape(batch, kv_heads, rows, n)

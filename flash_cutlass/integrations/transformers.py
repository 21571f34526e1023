"""Hugging Face transformers on flash_cutlass.

    import flash_cutlass.integrations.transformers as fc_transformers
    name = fc_transformers.register()            # "cutlass"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)

register() adds flash_cutlass to transformers' AttentionInterface (and the padding-mask function
that goes with it to AttentionMaskInterface) under a name. Models that accept custom attention
(`_supports_attention_backend`) then run their attention through attention_forward, for training
and for generate():
- padded batches: the 2D padding mask becomes a variable-length call (flash_attention_varlen),
  and padded query rows return zeros;
- sequences packed without padding: the cu_seq_lens_* / max_length_* keyword arguments of
  transformers' packing collators, or position ids that restart, become a variable-length call;
- GQA, sliding windows (a window of `sliding_window` keys, the query's own included), soft capping
  (Gemma 2), attention sinks (gpt-oss's `s_aux`, learned: they get their gradient), dropout in
  training, a KV cache (its keys after the queries': flash_cutlass's causal diagonal is aligned
  bottom-right).
The name must not contain "flash": transformers treats such names as flash-attn kernel packages
to import. Inputs must be float16 or bfloat16 (float32 activations are cast to the model's half
dtype, as transformers' flash path does). Not supported: output_attentions (a warning; no
weights are returned).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from flash_cutlass.interface import SUPPORTED_DTYPES, flash_attention, flash_attention_varlen

DEFAULT_NAME = "cutlass"
# What transformers' packing collators pass for sequences packed into one row.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register(name: str = DEFAULT_NAME) -> str:
    """Registers flash_cutlass with transformers under `name` (for attn_implementation=name) and
    returns the name."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash', which transformers reserves for flash-attn kernel "
                         f"packages it imports itself; choose another name (the default is {DEFAULT_NAME!r})")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _half_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """The dtype to run a float32 query in: autocast's, else the module's first half-precision
    Linear weight's."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        if dtype in SUPPORTED_DTYPES:
            return dtype
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in SUPPORTED_DTYPES:
            return layer.weight.dtype
    raise TypeError(f"flash_cutlass attention runs float16 and bfloat16, and this model computes in {query.dtype}; "
                    "load it with dtype=torch.bfloat16 (or float16), or run it under torch.autocast")


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _packed_starts(position_ids: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
    """Where the sequences of one packed row start (a position that does not follow its
    predecessor by 1), or None when position_ids describe one sequence per row."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] <= 1:
        return None
    positions = position_ids.reshape(-1)
    restarts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    if restarts.numel() == 0:
        return None
    return torch.cat([restarts.new_zeros(1), restarts, restarts.new_full((1,), positions.numel())])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention-function interface: query (batch, heads, seqlen_q, head_dim), key
    and value (batch, heads_k, seqlen_k, head_dim); attention_mask the 2D padding mask
    (batch, seqlen_k) or None; s_aux an attention sink a query head (heads,). Returns (output
    (batch, seqlen_q, heads, head_dim), None)."""
    if kwargs.get("output_attentions", False):
        warnings.warn("flash_cutlass attention does not return attention weights (output_attentions=True)",
                      stacklevel=2)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if q.dtype not in SUPPORTED_DTYPES:
        dtype = _half_dtype(q, module)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # value heads narrower than query heads (MLA): padded, then cropped
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, seqlen_q = q.shape[0], q.shape[1]
    # A window of sliding_window keys, the query's own included (transformers' convention).
    window = (sliding_window - 1, sliding_window - 1) if sliding_window and k.shape[1] > sliding_window else (-1, -1)
    options = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0, sinks=s_aux,
                   dropout_p=dropout, deterministic=bool(kwargs.get("deterministic") or False))

    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, options)
    elif all(kwargs.get(name) is not None for name in _PACKING_KWARGS):
        out = flash_attention_varlen(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
            int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), **options).view(batch, seqlen_q, *q.shape[2:])
    else:
        starts = _packed_starts(kwargs.get("position_ids"), batch) if seqlen_q == k.shape[1] else None
        if starts is not None:
            cu_seqlens = starts.to(torch.int32)
            longest = int((starts[1:] - starts[:-1]).max())
            out = flash_attention_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, longest, longest,
                                         **options).unsqueeze(0)
        else:
            out = flash_attention(q, k, v, **options)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


class _Unpadding(NamedTuple):
    """Where a padded batch's valid tokens sit: their flat indices and cumulative lengths."""
    rows_q: torch.Tensor
    rows_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


# A model's layers get the same padding mask tensor (two, with sliding-window layers): its unpadding
# is computed once per forward, not once per layer (each costs a device synchronization). Entries
# hold the mask itself and its version counter, so a new or modified mask is never mistaken.
_UNPADDING_CACHE_SIZE = 4
_unpadding_cache: list = []


def _unpadding_of(attention_mask: torch.Tensor, seqlen_q: int) -> _Unpadding:
    key = (attention_mask._version, seqlen_q)
    for mask, cached_key, unpadding in _unpadding_cache:
        if mask is attention_mask and cached_key == key:
            return unpadding
    valid_k = attention_mask.bool()
    if seqlen_q == 1:  # decoding: one query a row, after all of its keys
        valid_q = torch.ones(valid_k.shape[0], 1, dtype=torch.bool, device=valid_k.device)
    else:
        valid_q = valid_k[:, -seqlen_q:]
    lengths_q, lengths_k = valid_q.sum(dim=-1, dtype=torch.int32), valid_k.sum(dim=-1, dtype=torch.int32)
    longest = torch.stack([lengths_q.max(), lengths_k.max()]).tolist()  # one host read for both
    unpadding = _Unpadding(torch.nonzero(valid_q.flatten()).flatten(), torch.nonzero(valid_k.flatten()).flatten(),
                           _cumulative(lengths_q), _cumulative(lengths_k), int(longest[0]), int(longest[1]))
    if not torch.compiler.is_compiling():
        _unpadding_cache.insert(0, (attention_mask, key, unpadding))
        del _unpadding_cache[_UNPADDING_CACHE_SIZE:]
    return unpadding


def _padded_attention(q, k, v, attention_mask: torch.Tensor, options: dict) -> torch.Tensor:
    """A padded batch as one variable-length call: the valid keys of each row of the 2D mask
    (batch, seqlen_k), and the queries at its last seqlen_q positions; padded queries get zeros."""
    batch, seqlen_q, heads, head_dim = q.shape
    if k.shape[1] > attention_mask.shape[1]:  # a static cache longer than the mask: its tail is unused
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
    unpadding = _unpadding_of(attention_mask, seqlen_q)
    out = flash_attention_varlen(
        q.reshape(-1, heads, head_dim)[unpadding.rows_q], k.reshape(-1, *k.shape[2:])[unpadding.rows_k],
        v.reshape(-1, *v.shape[2:])[unpadding.rows_k], unpadding.cu_seqlens_q, unpadding.cu_seqlens_k,
        unpadding.max_seqlen_q, unpadding.max_seqlen_k, **options)
    padded = out.new_zeros(batch * seqlen_q, heads, head_dim)
    padded[unpadding.rows_q] = out
    return padded.view(batch, seqlen_q, heads, head_dim)

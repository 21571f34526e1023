"""flash_forward and flash_backward (and their variable-length forms) as torch.library custom ops,
and the autograd-enabled flash_attention and flash_attention_varlen built on them.

The ops have fake (meta) implementations, so torch.compile traces through them without graph
breaks, and the forward op's autograd formula is the backward op. The forward op takes the
backward's `deterministic` flag too (the forward ignores it), so that autograd can pass it on. A
variable-length call passes cu_seqlens_q / cu_seqlens_k (None otherwise) and the longest lengths.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_cutlass import interface


def _is_varlen(cu_seqlens_q: Optional[torch.Tensor]) -> bool:
    return cu_seqlens_q is not None


@torch.library.custom_op("flash_cutlass::forward", mutates_args=())
def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float], causal: bool,
               window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
               dropout_p: float, rng_state: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
               cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, kernel: Optional[str],
               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    options = {"window_size": (window_left, window_right), "softcap": softcap, "alibi_slopes": alibi_slopes,
               "dropout_p": dropout_p, "rng_state": rng_state}
    if _is_varlen(cu_seqlens_q):
        out, lse, *_ = interface.flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      softmax_scale, causal, kernel, **options)
    else:
        out, lse, *_ = interface.flash_forward(q, k, v, softmax_scale, causal, kernel, **options)
    return out, lse


def _check_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The shape-only checks of the fake implementations (a varlen call's lengths are data)."""
    views = (q, k, v) if not _is_varlen(cu_seqlens_q) else (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    batch = None
    if _is_varlen(cu_seqlens_q):
        batch = interface.check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    interface.check_forward_inputs(*views, softmax_scale, causal, (window_left, window_right))
    interface.check_softcap(softcap)
    interface.check_alibi_slopes(alibi_slopes, views[0], batch)
    interface.check_dropout_p(dropout_p)
    interface.check_rng_state(rng_state)


@forward_op.register_fake
def _forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                  rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel, deterministic):
    _check_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    interface.kernel_choice(kernel)
    if _is_varlen(cu_seqlens_q):
        total_q, heads, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=torch.float32)
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flash_cutlass::backward", mutates_args=())
def backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                rng_state: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = {"window_size": (window_left, window_right), "softcap": softcap, "alibi_slopes": alibi_slopes,
               "dropout_p": dropout_p, "rng_state": rng_state}
    if _is_varlen(cu_seqlens_q):
        return interface.flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, softmax_scale, causal, deterministic, **options)
    return interface.flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, **options)


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):
    _check_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    tensors = (dout, q, k, v, out, lse)
    if _is_varlen(cu_seqlens_q):
        # As (1, total, ...) views: lse (heads, total_q) becomes (1, heads, total_q).
        tensors = tuple(t.unsqueeze(0) for t in tensors)
    interface.check_backward_inputs(*tensors, softmax_scale, causal, deterministic, (window_left, window_right))
    # The gradients come back contiguous, whatever the inputs' strides.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, _, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k)
    ctx.dropout_p, ctx.max_seqlen_q, ctx.max_seqlen_k = dropout_p, max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = backward_op(grad_out.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                             ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, rng_state,
                             cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 14


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _checked_options(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, generator,
                     rng_state, kernel, deterministic, batch=None):
    """The checks of flash_attention(_varlen) before the op's schema would convert the arguments (1
    into True, say), and the dropout state (rng_state, or drawn from generator here, outside the op,
    so that the op is a function of its inputs): (window_left, window_right, softcap, dropout_p,
    rng_state)."""
    window_left, window_right = interface.check_forward_inputs(q, k, v, softmax_scale, causal, window_size)
    softcap = interface.check_softcap(softcap)
    interface.check_alibi_slopes(alibi_slopes, q, batch)
    dropout_p = interface.check_dropout_p(dropout_p)
    rng_state = interface.check_rng_state(rng_state)
    interface.kernel_choice(kernel)
    interface.check_deterministic(deterministic)
    rng_state = interface.dropout_rng_state(dropout_p, generator, rng_state, q.device)
    return window_left, window_right, softcap, dropout_p, rng_state


def flash_attention(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                    deterministic: bool = False, return_lse: bool = False, kernel: Optional[str] = None, *,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                    generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None):
    """Autograd-enabled attention: out = softmax(softmax_scale * q k^T) v, differentiable in q, k
    and v (flash_backward is its gradient), and traceable by torch.compile.

    Arguments as flash_forward's (window_size, softcap, alibi_slopes, dropout_p, generator and
    rng_state included; the slopes get no gradient; the backward reuses the forward's dropout
    mask; an rng_state drawn outside a torch.compile region keeps the region one graph);
    deterministic is flash_backward's (bitwise reproducible gradients). Returns out, or (out, lse)
    with return_lse; lse carries no gradient (it is marked non-differentiable).
    """
    window_left, window_right, softcap, dropout_p, rng_state = _checked_options(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, generator, rng_state, kernel,
        deterministic)
    out, lse = forward_op(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                          rng_state, None, None, 0, 0, kernel, deterministic)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
                           return_lse: bool = False, kernel: Optional[str] = None, *,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                           generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None):
    """flash_attention of a variable-length batch: packed q (total_q, heads, head_dim), k and v
    (total_k, heads_k, head_dim) and cumulative lengths as flash_forward_varlen takes them.
    Returns out like q, or (out, lse) with return_lse, lse (heads, total_q)."""
    # Shapes only here, so that torch.compile traces this; the op checks the lengths themselves.
    batch = interface.check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window_left, window_right, softcap, dropout_p, rng_state = _checked_options(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal, window_size, softcap, alibi_slopes,
        dropout_p, generator, rng_state, kernel, deterministic, batch)
    out, lse = forward_op(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                          rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel, deterministic)
    return (out, lse) if return_lse else out

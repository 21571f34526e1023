"""flash_forward and flash_backward as torch.library custom ops, and the autograd-enabled
flash_attention built on them.

The ops have fake (meta) implementations, so torch.compile traces through them without graph
breaks, and the forward op's autograd formula is the backward op. The forward op takes the
backward's `deterministic` flag too (the forward ignores it), so that autograd can pass it on.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_cutlass import interface


@torch.library.custom_op("flash_cutlass::forward", mutates_args=())
def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float], causal: bool,
               window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
               dropout_p: float, rng_state: Optional[torch.Tensor], kernel: Optional[str],
               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = interface.flash_forward(q, k, v, softmax_scale, causal, kernel,
                                           window_size=(window_left, window_right), softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state)
    return out, lse


@forward_op.register_fake
def _forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                  rng_state, kernel, deterministic):
    interface.check_forward_inputs(q, k, v, softmax_scale, causal, (window_left, window_right))
    interface.check_softcap(softcap)
    interface.check_alibi_slopes(alibi_slopes, q)
    interface.check_dropout_p(dropout_p)
    interface.check_rng_state(rng_state)
    interface.kernel_choice(kernel)
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flash_cutlass::backward", mutates_args=())
def backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                rng_state: Optional[torch.Tensor], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return interface.flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                    window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                                    dropout_p=dropout_p, rng_state=rng_state)


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   dropout_p, rng_state, deterministic):
    interface.check_backward_inputs(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                    (window_left, window_right))
    interface.check_softcap(softcap)
    interface.check_alibi_slopes(alibi_slopes, q)
    interface.check_dropout_p(dropout_p)
    interface.check_rng_state(rng_state)
    # The gradients come back contiguous, whatever the inputs' strides.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, _,
     deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state)
    ctx.dropout_p = dropout_p
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, alibi_slopes, rng_state = ctx.saved_tensors
    dq, dk, dv = backward_op(grad_out.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                             ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, rng_state,
                             ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


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
    # Checked here, before the op's schema would convert them (1 into True, say).
    window_left, window_right = interface.check_forward_inputs(q, k, v, softmax_scale, causal, window_size)
    softcap = interface.check_softcap(softcap)
    interface.check_alibi_slopes(alibi_slopes, q)
    dropout_p = interface.check_dropout_p(dropout_p)
    rng_state = interface.check_rng_state(rng_state)
    interface.kernel_choice(kernel)
    interface.check_deterministic(deterministic)
    # Drawn here, outside the op, so that the op is a function of its inputs.
    rng_state = interface.dropout_rng_state(dropout_p, generator, rng_state, q.device)
    out, lse = forward_op(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                          rng_state, kernel, deterministic)
    return (out, lse) if return_lse else out

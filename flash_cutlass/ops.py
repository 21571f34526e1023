"""flash_forward and flash_backward as torch.library custom ops, and the autograd-enabled
flash_attention built on them.

The ops have fake (meta) implementations, so torch.compile traces through them without graph
breaks, and the forward op's autograd formula is the backward op.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_cutlass import interface


@torch.library.custom_op("flash_cutlass::forward", mutates_args=())
def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float], causal: bool,
               kernel: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return interface.flash_forward(q, k, v, softmax_scale, causal, kernel)


@forward_op.register_fake
def _forward_fake(q, k, v, softmax_scale, causal, kernel):
    interface.check_forward_inputs(q, k, v, softmax_scale, causal)
    interface.kernel_choice(kernel)
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flash_cutlass::backward", mutates_args=())
def backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, softmax_scale: Optional[float], causal: bool,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return interface.flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    interface.check_backward_inputs(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)
    # The gradients come back contiguous, whatever the inputs' strides.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal = softmax_scale, causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = backward_op(grad_out.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal, False)
    return dq, dk, dv, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False, return_lse: bool = False,
                    kernel: Optional[str] = None):
    """Autograd-enabled attention: out = softmax(softmax_scale * q k^T) v, differentiable in q, k
    and v (flash_backward is its gradient), and traceable by torch.compile.

    Arguments as flash_forward's. Returns out, or (out, lse) with return_lse; lse carries no
    gradient (it is marked non-differentiable).
    """
    out, lse = forward_op(q, k, v, softmax_scale, causal, kernel)
    return (out, lse) if return_lse else out

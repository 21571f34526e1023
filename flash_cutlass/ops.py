"""The forward and the backward as torch.library custom ops, their fake (meta) implementations and
the forward's autograd formula (the backward op), so that torch.compile traces
flash_cutlass.flash_attention and flash_attention_varlen without graph breaks; attention() is what
those call (eager calls through an autograd.Function with the same context and formula).

Both ops take their tensors, then the fields of an AttentionOptions (flash_cutlass.options) as
their schema's trailing arguments; the options come already checked by the public entry points.
A variable-length call passes packed tensors and its cumulative lengths in the options.

The forward also returns the int64 (seed, offset) of its dropout mask (empty without dropout),
which the autograd formula hands to the backward. Without a given rng_state the forward draws it
from its generator when it runs: the op is tagged nondeterministic_seeded, so that torch.compile
neither merges two calls nor recomputes one (the partitioner reads dropout_p: calls without
dropout count as deterministic).
"""

from __future__ import annotations

import torch

from flash_cutlass import backend
from flash_cutlass.options import AttentionOptions, check_kernel, draws_in_kernel

_LIBRARY = torch.library.Library("flash_cutlass", "DEF")
_LIBRARY.define(f"forward(Tensor q, Tensor k, Tensor v, {AttentionOptions.schema()}) -> (Tensor, Tensor, Tensor)",
                tags=(torch.Tag.nondeterministic_seeded,))
# torch releases whose graph CSE does not yet read the nondeterministic_seeded tag (2.11 merged two
# dropout calls of one compiled graph into one mask) skip the random ops they list by name.
try:
    from torch._functorch import compile_utils as _compile_utils

    if torch.ops.flash_cutlass.forward not in _compile_utils.rand_ops:
        _compile_utils.rand_ops.append(torch.ops.flash_cutlass.forward)
except (ImportError, AttributeError):
    pass
# The backward returns (dq, dk, dv, dsinks), dsinks empty without sinks.
_LIBRARY.define(f"backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                f"{AttentionOptions.schema()}) -> (Tensor, Tensor, Tensor, Tensor)")


def _forward_outputs(q, k, v, options: AttentionOptions):
    """The forward op's outputs (out, lse, rng_state) of checked options."""
    out, lse, rng_state = backend.forward(q, k, v, options)
    if rng_state is None:
        rng_state = q.new_empty(0, dtype=torch.int64)
    elif rng_state is options.rng_state:
        rng_state = rng_state.clone()  # an op's outputs may not alias its inputs
    return out, lse, rng_state


@torch.library.impl(_LIBRARY, "forward", "CompositeExplicitAutograd")
def _forward(q, k, v, *option_args):
    return _forward_outputs(q, k, v, AttentionOptions.from_op_args(option_args))


@torch.library.impl(_LIBRARY, "backward", "CompositeExplicitAutograd")
def _backward(dout, q, k, v, out, lse, *option_args):
    dq, dk, dv, dsinks = backend.backward(dout, q, k, v, out, lse, AttentionOptions.from_op_args(option_args))
    return dq, dk, dv, q.new_empty(0, dtype=torch.float32) if dsinks is None else dsinks


_NO_OPTION_GRADIENTS = (None,) * len(AttentionOptions().op_args())
# Where the sinks are among the option arguments: the one option with a gradient.
_SINKS_INDEX = AttentionOptions.schema().split(", ").index("Tensor? sinks")
forward_op = torch.ops.flash_cutlass.forward.default
backward_op = torch.ops.flash_cutlass.backward.default


def _rng_state_fake(q, options: AttentionOptions) -> torch.Tensor:
    """The forward's rng_state as _forward returns it: empty without dropout, else 2 elements where
    the state lives (a given one's device, q's device for a draw in the extension, else the CPU)."""
    if options.dropout_p == 0:
        return q.new_empty(0, dtype=torch.int64)
    if options.rng_state is not None:
        return options.rng_state.new_empty(2)
    device = q.device if draws_in_kernel(q.device, options.generator) else torch.device("cpu")
    return torch.empty(2, dtype=torch.int64, device=device)


@torch.library.register_fake("flash_cutlass::forward")
def _forward_fake(q, k, v, *option_args):
    options = AttentionOptions.from_op_args(option_args)
    if options.is_varlen:
        total_q, heads, _ = q.shape
        lse = q.new_empty((heads, total_q), dtype=torch.float32)
    else:
        batch, seqlen_q, heads, _ = q.shape
        lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    return q.new_empty(q.shape), lse, _rng_state_fake(q, options)


@torch.library.register_fake("flash_cutlass::backward")
def _backward_fake(dout, q, k, v, out, lse, *option_args):
    # The gradients come back contiguous, whatever the inputs' strides.
    sinks = AttentionOptions.from_op_args(option_args).sinks
    dsinks = q.new_empty(0, dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _save_for_backward(ctx, q, k, v, options: AttentionOptions, out, lse, rng_state) -> None:
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    # The options' tensors (slopes, lengths, rng_state) are inputs that get no gradient.
    ctx.options = options
    ctx.mark_non_differentiable(lse, rng_state)
    # lse gets no gradient: without this autograd would allocate and zero-fill one for every backward.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    q, k, v, *option_args = inputs
    _save_for_backward(ctx, q, k, v, AttentionOptions.from_op_args(option_args), *output)


def _backward_options(forward_options: AttentionOptions, rng_state: torch.Tensor) -> AttentionOptions:
    """The backward's options of a forward call's: its own kernel choice (flash_attention's kernel=
    is the forward's) and, with dropout, the mask the forward drew or was given."""
    kernel = check_kernel(None, "backward")
    changes = {"kernel": kernel} if kernel != forward_options.kernel else {}
    if forward_options.dropout_p > 0:
        changes.update(rng_state=rng_state, generator=None)
    return forward_options.replace(**changes) if changes else forward_options


def _backward_inputs(ctx):
    """The saved (q, k, v, out, lse) and the backward's options."""
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    return (q, k, v, out, lse), _backward_options(ctx.options, rng_state)


def _gradients(ctx, grad_out, _grad_lse, _grad_rng_state):
    tensors, options = _backward_inputs(ctx)
    dq, dk, dv, dsinks = backward_op(grad_out.contiguous(), *tensors, *options.op_args())
    option_gradients = list(_NO_OPTION_GRADIENTS)
    if options.sinks is not None:
        option_gradients[_SINKS_INDEX] = dsinks
    return (dq, dk, dv, *option_gradients)


torch.library.register_autograd("flash_cutlass::forward", _gradients, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The forward op and its gradient as an autograd.Function, for eager calls: the same
    context and formula as the op's registered autograd, calling the ops' implementations
    directly (the dispatcher's walk over the schemas, torch.library's autograd redispatch and the
    options' round trip through op arguments cost about as much host time as the rest of a call).
    The sinks, the one option with a gradient, come again as an input of their own."""

    @staticmethod
    def forward(ctx, q, k, v, _sinks, options: AttentionOptions):
        # _sinks is options.sinks, passed on its own so that autograd sees it as an input.
        out, lse, rng_state = _forward_outputs(q, k, v, options)
        _save_for_backward(ctx, q, k, v, options, out, lse, rng_state)
        return out, lse, rng_state

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_rng_state):
        tensors, options = _backward_inputs(ctx)
        dq, dk, dv, dsinks = backend.backward(grad_out.contiguous(), *tensors, options)
        return dq, dk, dv, dsinks, None


def attention(q, k, v, options: AttentionOptions):
    """(out, lse) of flash_attention: differentiable in q, k and v. torch.compile traces the op
    with its registered autograd; eager calls take the autograd.Function."""
    if torch.compiler.is_compiling():
        out, lse, _ = forward_op(q, k, v, *options.op_args())
    else:
        out, lse, _ = _Attention.apply(q, k, v, options.sinks, options)
    return out, lse

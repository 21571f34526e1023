"""flash_cutlass.options: one options type from the public functions through the custom ops to the
extension, validated once. CPU tensors throughout (the reference path)."""

import dataclasses

import numpy as np
import pytest
import torch

import flash_cutlass
from flash_cutlass import backend, ops
from flash_cutlass import options as options_module
from flash_cutlass.options import AttentionOptions, backward_options, draws_in_kernel, forward_options


def qkv(gen, requires_grad=False):
    q = torch.randn(2, 24, 4, 16, generator=gen).bfloat16()
    k = torch.randn(2, 40, 2, 16, generator=gen).bfloat16()
    v = torch.randn(2, 40, 2, 16, generator=gen).bfloat16()
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_the_ops_schema_is_the_options_fields():
    fields = [field.name for field in dataclasses.fields(AttentionOptions)]
    for op, tensors in ((ops.forward_op, ["q", "k", "v"]), (ops.backward_op, ["dout", "q", "k", "v", "out", "lse"])):
        assert [argument.name for argument in op._schema.arguments] == tensors + fields
    assert AttentionOptions.schema().startswith("float softmax_scale, bool causal, int window_left")


def test_options_round_trip_through_the_op_arguments():
    slopes = torch.tensor([0.5, 0.25])
    options = AttentionOptions(softmax_scale=0.3, causal=True, window_left=5, softcap=2.0, alibi_slopes=slopes,
                               kernel="sm80", deterministic=True)
    again = AttentionOptions.from_op_args(options.op_args())
    assert again == options and again.alibi_slopes is slopes  # the tensors are passed, not copied


def test_forward_options_resolve_defaults(gen, monkeypatch):
    q, _, _ = qkv(gen)
    monkeypatch.setenv("FLASH_CUTLASS_FORWARD_KERNEL", "sm80")
    options = forward_options(q, causal=True, window_size=[3, -1])
    assert options.softmax_scale == pytest.approx(16 ** -0.5)
    assert (options.causal, options.window_size, options.kernel) == (True, (3, -1), "sm80")
    assert options.rng_state is None and not options.is_varlen


def test_forward_options_leave_the_dropout_draw_to_the_call(gen):
    """forward_options keep the generator and draw nothing (the forward op draws when it runs, so
    that torch.compile and CUDA graphs keep the draw); the call draws once, reproducibly."""
    q, k, v = qkv(gen)
    generator = torch.Generator().manual_seed(7)
    options = forward_options(q, dropout_p=0.1, generator=generator)
    assert options.rng_state is None and options.generator is generator
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(7).get_state())
    assert forward_options(q, generator=generator).generator is None  # no dropout: nothing to draw
    _, _, rng_state = backend.forward(q, k, v, options)
    assert rng_state.dtype == torch.int64 and rng_state.device.type == "cpu" and tuple(rng_state.shape) == (2,)
    assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(7).get_state())
    again = forward_options(q, dropout_p=0.1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(backend.forward(q, k, v, again)[2], rng_state)


def test_given_rng_state_comes_back_as_it_is(gen):
    q, k, v = qkv(gen)
    rng_state = torch.tensor([3, 8])
    options = forward_options(q, dropout_p=0.1, rng_state=rng_state)
    assert options.rng_state is rng_state and options.generator is None
    assert backend.forward(q, k, v, options)[2] is rng_state


def test_where_the_dropout_state_is_drawn():
    """CUDA tensors draw in the extension (graph-safe) unless the generator is a CPU one; CPU
    tensors draw on the host."""
    assert draws_in_kernel(torch.device("cuda", 0), None)
    assert not draws_in_kernel(torch.device("cuda", 0), torch.Generator())
    assert not draws_in_kernel(torch.device("cpu"), None)
    assert not draws_in_kernel(torch.device("cpu"), torch.Generator())


def test_backward_options_take_the_backward_kernel_variable(gen, monkeypatch):
    q, _, _ = qkv(gen)
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", "sm80")
    assert backward_options(q).kernel == "sm80"
    with pytest.raises(ValueError, match=r"^dropout_p > 0 needs rng_state"):
        backward_options(q, dropout_p=0.2)


@pytest.mark.parametrize("value", [np.bool_(True), np.bool_(False)])
def test_numpy_bools_are_accepted(gen, value):
    q, k, v = qkv(gen)
    out, _ = flash_cutlass.flash_forward(q, k, v, causal=value)
    expected, _ = flash_cutlass.flash_forward(q, k, v, causal=bool(value))
    assert torch.equal(out, expected)
    assert forward_options(q, causal=value).causal is bool(value)


def test_numpy_numbers_are_accepted(gen):
    q, k, v = qkv(gen)
    out, _ = flash_cutlass.flash_forward(q, k, v, softmax_scale=np.float32(0.25), window_size=(np.int64(4), -1))
    expected, _ = flash_cutlass.flash_forward(q, k, v, softmax_scale=0.25, window_size=(4, -1))
    assert torch.equal(out, expected)


def test_rejected_types_are_named_with_their_module(gen):
    q, k, v = qkv(gen)
    with pytest.raises(TypeError, match=r"^causal must be a bool, got numpy.int64$"):
        flash_cutlass.flash_forward(q, k, v, causal=np.int64(1))
    with pytest.raises(TypeError, match=r"^deterministic must be a bool, got str$"):
        flash_cutlass.flash_attention(q, k, v, deterministic="yes")


def test_flash_attention_validates_its_options_once(gen, monkeypatch):
    """The autograd path checks each option once, in flash_attention: neither the ops nor the
    backward check them again."""
    calls = []
    for name in ("check_softcap", "check_dropout_p", "check_softmax_scale"):
        original = getattr(options_module, name)

        def counted(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(options_module, name, counted)
    q, k, v = qkv(gen, requires_grad=True)
    flash_cutlass.flash_attention(q, k, v, causal=True, softcap=3.0).sum().backward()
    assert sorted(calls) == ["check_dropout_p", "check_softcap", "check_softmax_scale"]
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_flash_attention_backward_runs_with_the_forward_options(gen):
    q, k, v = qkv(gen, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).bfloat16()
    flash_cutlass.flash_attention(q, k, v, softmax_scale=0.2, causal=True, window_size=(6, -1)).backward(dout)
    out, lse = flash_cutlass.flash_forward(q.detach(), k.detach(), v.detach(), 0.2, True, window_size=(6, -1))
    grads = flash_cutlass.flash_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, 0.2, True,
                                         window_size=(6, -1))
    for actual, expected in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(actual, expected)


def test_eager_flash_attention_takes_the_autograd_function_and_gets_no_lse_gradient(gen, monkeypatch):
    """Eager calls go through ops._Attention (not torch.library's per-call autograd wrapper), and
    the backward receives no zero-filled gradient for the non-differentiable lse and rng_state."""
    received = []
    original = ops._Attention.backward

    def recording(ctx, grad_out, grad_lse, grad_rng_state):
        received.append((grad_lse, grad_rng_state))
        return original(ctx, grad_out, grad_lse, grad_rng_state)

    monkeypatch.setattr(ops._Attention, "backward", staticmethod(recording))
    q, k, v = qkv(gen, requires_grad=True)
    out = flash_cutlass.flash_attention(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
    out.sum().backward()
    assert received == [(None, None)]


def test_eager_flash_attention_skips_the_op_dispatch(gen, monkeypatch):
    """Eager calls run the implementations directly (the dispatcher's schema walk costs host time):
    with the ops replaced by stubs that raise, forward and backward still run, and agree with the
    ops' path."""
    q, k, v = qkv(gen, requires_grad=True)
    expected = flash_cutlass.flash_attention(q, k, v, causal=True)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))

    def not_in_eager_mode(*args):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(ops, "forward_op", not_in_eager_mode)
    monkeypatch.setattr(ops, "backward_op", not_in_eager_mode)
    out = flash_cutlass.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)


def test_a_copy_without_the_compiled_module_says_so(monkeypatch, tmp_path):
    from flash_cutlass import backend

    monkeypatch.setattr(backend, "_C", None)
    monkeypatch.setattr(backend, "_EXTENSION_ERROR", ImportError("cannot import name '_C'"))
    monkeypatch.setattr(backend, "__file__", str(tmp_path / "backend.py"))
    with pytest.raises(RuntimeError, match=r"has no compiled _C module: build it in place with pip install "
                                           r"--no-build-isolation -e \."):
        backend._extension()
    (tmp_path / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"its _C module failed to load \(cannot import name '_C'\)"):
        backend._extension()

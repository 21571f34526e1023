"""The torch.library custom ops: opcheck (schema, fake implementation, autograd registration)
and torch.compile(fullgraph=True), on CPU tensors everywhere and on the GPU where one is visible."""

import pytest
import torch

import flash_cutlass
from flash_cutlass import ops
from flash_cutlass.options import AttentionOptions
from helpers import options_left_out, requires_backward, requires_cuda

# The GPU cases differentiate through the ops: they need the backward kernels.
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, requires_backward])]


def inputs(device, gen_seed=0, causal=True, batch=2, seqlen_q=40, seqlen_k=56, heads=4, heads_k=2, head_dim=32):
    gen = torch.Generator().manual_seed(gen_seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

    return rand(batch, seqlen_q, heads, head_dim), rand(batch, seqlen_k, heads_k, head_dim), rand(
        batch, seqlen_k, heads_k, head_dim)


def slopes(device, alibi):
    """ALiBi slopes of inputs()' 4 heads, or None."""
    return torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device) if alibi else None


def dropout(enabled):
    """dropout_p and rng_state of a call with or without dropout."""
    return (0.25, torch.tensor([17, 8])) if enabled else (0.0, None)


def skip_if_left_out(device, window=(-1, -1), softcap=0.0, alibi=False, drop=False):
    """On the GPU, skip a call whose options' kernels this build left out (the CPU reference runs
    every option)."""
    left_out = options_left_out(window, softcap, alibi, dropout(drop)[0]) if device == "cuda" else ""
    if left_out:
        pytest.skip(left_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window,softcap,alibi,drop,deterministic",
                         [(False, (-1, -1), 0.0, False, False, False), (True, (-1, -1), 0.0, False, False, False),
                          (True, (-1, -1), 0.0, False, False, True), (False, (9, 3), 0.0, False, False, False),
                          (True, (-1, -1), 5.0, False, False, False), (False, (-1, -1), 0.0, True, False, False),
                          (True, (-1, -1), 0.0, False, True, False)])
def test_forward_op_passes_opcheck(device, causal, window, softcap, alibi, drop, deterministic):
    skip_if_left_out(device, window, softcap, alibi, drop)
    q, k, v = (t.requires_grad_() for t in inputs(device))
    p, state = dropout(drop)
    options = AttentionOptions(softmax_scale=32 ** -0.5, causal=causal, window_left=window[0], window_right=window[1],
                               softcap=softcap, alibi_slopes=slopes(device, alibi), dropout_p=p, rng_state=state,
                               deterministic=deterministic)
    torch.library.opcheck(ops.forward_op, (q, k, v, *options.op_args()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window,softcap,alibi,drop",
                         [(True, (-1, -1), 0.0, False, False), (True, (7, -1), 0.0, False, False),
                          (False, (-1, -1), 5.0, False, False), (True, (-1, -1), 0.0, True, False),
                          (False, (-1, -1), 0.0, False, True)])
def test_backward_op_passes_opcheck(device, causal, window, softcap, alibi, drop):
    skip_if_left_out(device, window, softcap, alibi, drop)
    q, k, v = inputs(device)
    dropout_p, rng_state = dropout(drop)
    out, lse, *_ = flash_cutlass.flash_forward(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                               alibi_slopes=slopes(device, alibi), dropout_p=dropout_p,
                                               rng_state=rng_state)
    dout = torch.randn_like(out)
    options = AttentionOptions(softmax_scale=32 ** -0.5, causal=causal, window_left=window[0], window_right=window[1],
                               softcap=softcap, alibi_slopes=slopes(device, alibi), dropout_p=dropout_p,
                               rng_state=rng_state)
    torch.library.opcheck(ops.backward_op, (dout, q, k, v, out, lse, *options.op_args()))


def varlen_inputs(device):
    """Packed q, k, v of three sequences (one empty in q, one of a single query) and their lengths."""
    gen = torch.Generator().manual_seed(1)
    lengths_q, lengths_k = [5, 0, 1, 9], [7, 3, 4, 9]
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

    q, k, v = rand(sum(lengths_q), 4, 32), rand(sum(lengths_k), 2, 32), rand(sum(lengths_k), 2, 32)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ops_pass_opcheck(device, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(device)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    options = AttentionOptions(softmax_scale=32 ** -0.5, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max_q, max_seqlen_k=max_k)
    torch.library.opcheck(ops.forward_op, (*leaves, *options.op_args()))
    out, lse = flash_cutlass.flash_forward_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k,
                                                  causal=causal)
    torch.library.opcheck(ops.backward_op, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                            *options.op_args()))


class AttentionBlock(torch.nn.Module):
    """q/k/v projections, attention, output projection: enough of a model for torch.compile."""

    def __init__(self, hidden, heads, heads_k):
        super().__init__()
        self.heads, self.heads_k, self.head_dim = heads, heads_k, hidden // heads
        self.q = torch.nn.Linear(hidden, hidden)
        self.kv = torch.nn.Linear(hidden, 2 * heads_k * self.head_dim)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, seqlen, hidden = x.shape
        q = self.q(x).view(batch, seqlen, self.heads, self.head_dim)
        k, v = self.kv(x).view(batch, seqlen, 2, self.heads_k, self.head_dim).unbind(dim=2)
        attended = flash_cutlass.flash_attention(q, k, v, causal=True)
        return self.out(attended.reshape(batch, seqlen, hidden))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_matches_eager_without_graph_breaks(device):
    torch.manual_seed(0)
    model = AttentionBlock(128, 4, 2).to(device, torch.bfloat16)
    x = torch.randn(2, 64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    eager = model(x)
    eager.float().square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    for p in model.parameters():
        p.grad = None
    x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    result = compiled(x)
    result.float().square().mean().backward()
    torch.testing.assert_close(result, eager, atol=2e-2, rtol=2e-2)
    for grad, expected in zip([p.grad for p in model.parameters()] + [x.grad], eager_grads):
        torch.testing.assert_close(grad, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_varlen_attention_matches_eager_without_graph_breaks(device):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(device)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def attend(q, k, v):
        return flash_cutlass.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)

    eager = attend(*leaves)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), leaves)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)(*leaves)
    compiled_grads = torch.autograd.grad(compiled.float().square().sum(), leaves)
    torch.testing.assert_close(compiled, eager)
    for grad, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_dropout_with_an_outside_rng_state_is_one_graph(device):
    skip_if_left_out(device, drop=True)
    q, k, v = (t.requires_grad_() for t in inputs(device))
    rng_state = torch.tensor([123, 4])

    def attend(q, k, v):
        return flash_cutlass.flash_attention(q, k, v, causal=True, dropout_p=0.25, rng_state=rng_state)

    eager = attend(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager)
    expected = flash_cutlass.flash_forward(q.detach(), k.detach(), v.detach(), causal=True, dropout_p=0.25,
                                           rng_state=rng_state)[0]
    torch.testing.assert_close(eager, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_dropout_drawing_its_mask_is_one_graph(device):
    """Without rng_state the forward op draws its mask when it runs: torch.compile keeps the call
    in one graph, draws what eager draws from the same generator state (the backward with the
    forward's mask), and draws afresh on every call."""
    skip_if_left_out(device, drop=True)
    q, k, v = (t.requires_grad_() for t in inputs(device))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device, q.dtype)

    def attend(q, k, v):
        return flash_cutlass.flash_attention(q, k, v, causal=True, dropout_p=0.25)

    def run(function):
        torch.manual_seed(11)
        out = function(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    eager = run(attend)
    torch._dynamo.reset()
    compiled_attend = torch.compile(attend, fullgraph=True)
    compiled_attend(q, k, v)  # compiled before the seeded run
    compiled = run(compiled_attend)
    for result, expected in zip(compiled, eager):
        torch.testing.assert_close(result, expected)
    assert not torch.equal(compiled_attend(q, k, v), compiled[0])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_calls_drawing_masks_are_not_merged(device):
    """Two identical calls in one compiled training graph draw two masks (the forward op is tagged
    nondeterministic_seeded: AOTAutograd's common-subexpression elimination merges them otherwise)."""
    skip_if_left_out(device, drop=True)
    q, k, v = (t.requires_grad_() for t in inputs(device))

    def difference(q, k, v):
        return flash_cutlass.flash_attention(q, k, v, dropout_p=0.5) - flash_cutlass.flash_attention(q, k, v,
                                                                                                  dropout_p=0.5)

    torch._dynamo.reset()
    assert torch.compile(difference, fullgraph=True)(q, k, v).abs().max() > 0


def test_fake_rng_state_is_where_the_forward_puts_it():
    """The forward op's fake implementation gives rng_state the device the real one does: empty
    without dropout, a given state's device, q's (CUDA) device for a draw in the extension, the CPU
    for a draw on the host (a CPU generator)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 4, 16, device="cuda", dtype=torch.bfloat16)
        cases = [({}, (0,), "cuda"), ({"dropout_p": 0.1}, (2,), "cuda"),
                 ({"dropout_p": 0.1, "generator": torch.Generator()}, (2,), "cpu"),
                 ({"dropout_p": 0.1, "rng_state": torch.empty(2, dtype=torch.int64)}, (2,), "cpu")]
        for fields, shape, device in cases:
            options = AttentionOptions(softmax_scale=0.25, **fields)
            _, _, rng_state = ops.forward_op(q, q, q, *options.op_args())
            assert (tuple(rng_state.shape), rng_state.device.type, rng_state.dtype) == (shape, device, torch.int64)


def test_lse_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in inputs("cpu"))
    out, lse = flash_cutlass.flash_attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad

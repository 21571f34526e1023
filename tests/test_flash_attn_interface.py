"""flash_cutlass.flash_attn_interface: FlashAttention-2's six attention functions on flash_cutlass.

CPU: FA2's signatures; each function's arguments reach flash_cutlass's options as FA2 means them
(softmax_scale None, window_size, softcap, alibi_slopes, dropout_p, deterministic); results and
gradients equal flash_attention / flash_attention_varlen, and the packed layouts equal the
unpacked call, gradients taken in the packed tensor; the masks and the ALiBi bias of FA2's
docstrings; the fp32 oracle by FA2's pass rule; return_attn_probs, block_table and malformed
packed inputs; torch.compile(fullgraph=True). GPU (skipped without one): every function against
flash_attention on bf16 CUDA tensors, gradients included, and against the fp32 oracle.
"""

import inspect
import math
import re
import subprocess
import sys

import pytest
import torch

import flash_cutlass
from flash_cutlass import backend
from flash_cutlass import flash_attn_interface as fai
from flash_cutlass.reference import naive_attention
from helpers import ROOT, fa2_check, options_left_out, requires_backward, requires_cuda

FUNCTIONS = ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
             "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func")
VARLEN = tuple(name for name in FUNCTIONS if "varlen" in name)

# FlashAttention-2's parameters (flash_attn/flash_attn_interface.py), name and default in order;
# REQUIRED marks one without a default.
REQUIRED = object()
_OPTIONS = (("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False))
_VARLEN_LENGTHS = (("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED),
                   ("max_seqlen_k", REQUIRED))
FA2_SIGNATURES = {
    "flash_attn_func": (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED)) + _OPTIONS,
    "flash_attn_qkvpacked_func": (("qkv", REQUIRED),) + _OPTIONS,
    "flash_attn_kvpacked_func": (("q", REQUIRED), ("kv", REQUIRED)) + _OPTIONS,
    "flash_attn_varlen_func": ((("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED)) + _VARLEN_LENGTHS + _OPTIONS
                               + (("block_table", None),)),
    "flash_attn_varlen_qkvpacked_func": (("qkv", REQUIRED), ("cu_seqlens", REQUIRED), ("max_seqlen", REQUIRED))
    + _OPTIONS,
    "flash_attn_varlen_kvpacked_func": (("q", REQUIRED), ("kv", REQUIRED)) + _VARLEN_LENGTHS + _OPTIONS,
}

HEADS, HEADS_K, HEAD_DIM = 4, 2, 16
SEQLEN_Q, SEQLEN_K = 9, 12
# Three sequences, one empty in q; the qkv-packed functions use LENGTHS_Q for both.
LENGTHS_Q, LENGTHS_K = [5, 0, 4], [7, 3, 2]


def rand(gen, *shape, device="cpu", dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device=gen.device).to(device, dtype)


def cumulative(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


class Call:
    """One FA2 function on fresh leaf inputs: `run(**options)` returns its result; `leaves` are the
    tensors it differentiates (the packed ones where it packs), `unpacked()` gives the same q, k, v
    as leaves of their own and `reference(q, k, v, **options)` runs flash_attention or
    flash_attention_varlen on them."""

    def __init__(self, name, gen, device="cpu", head_dim=HEAD_DIM, seqlens=(SEQLEN_Q, SEQLEN_K),
                 lengths=(LENGTHS_Q, LENGTHS_K), heads=(HEADS, HEADS_K)):
        self.name, self.function = name, getattr(fai, name)
        heads, heads_k = (heads[0], heads[0]) if "qkvpacked" in name else heads
        lengths_q, lengths_k = (lengths[0], lengths[0]) if "qkvpacked" in name else lengths
        self.varlen = name in VARLEN
        self.batch = len(lengths_q) if self.varlen else 2
        self.heads = heads
        if self.varlen:
            self.lengths = (cumulative(lengths_q, device), cumulative(lengths_k, device), max(lengths_q),
                            max(lengths_k))
            rows_q, rows_k = (sum(lengths_q),), (sum(lengths_k),)
        else:
            self.lengths = ()
            rows_q, rows_k = (2, seqlens[0]), (2, seqlens[0] if "qkvpacked" in name else seqlens[1])
        if "qkvpacked" in name:
            self.leaves = [rand(gen, *rows_q, 3, heads, head_dim, device=device)]
        elif "kvpacked" in name:
            self.leaves = [rand(gen, *rows_q, heads, head_dim, device=device),
                           rand(gen, *rows_k, 2, heads_k, head_dim, device=device)]
        else:
            self.leaves = [rand(gen, *rows_q, heads, head_dim, device=device),
                           rand(gen, *rows_k, heads_k, head_dim, device=device),
                           rand(gen, *rows_k, heads_k, head_dim, device=device)]
        for leaf in self.leaves:
            leaf.requires_grad_()

    def run(self, *leaves, **options):
        """The function on `leaves` (default: self.leaves)."""
        leaves = leaves or self.leaves
        if self.name == "flash_attn_varlen_qkvpacked_func":
            cu_seqlens, _, max_seqlen, _ = self.lengths
            return self.function(*leaves, cu_seqlens, max_seqlen, **options)
        return self.function(*leaves, *self.lengths, **options)

    def unpacked(self):
        """q, k, v as contiguous leaves of their own, equal to what the packed inputs hold."""
        dim = 1 if self.varlen else 2
        tensors = [t.detach() for t in self.leaves]
        if "qkvpacked" in self.name:
            tensors = tensors[0].unbind(dim)
        elif "kvpacked" in self.name:
            tensors = [tensors[0], *tensors[1].unbind(dim)]
        return [t.contiguous().requires_grad_() for t in tensors]

    def reference(self, q, k, v, **options):
        options = dict(options)
        options["return_lse"] = options.pop("return_attn_probs", False)
        if self.varlen:
            return flash_cutlass.flash_attention_varlen(q, k, v, *self.lengths, **options)
        return flash_cutlass.flash_attention(q, k, v, **options)

    def packed_gradients(self, grads):
        """The gradients of unpacked() leaves put together in the layout of self.leaves."""
        dim = 1 if self.varlen else 2
        if "qkvpacked" in self.name:
            return [torch.stack(grads, dim)]
        if "kvpacked" in self.name:
            return [grads[0], torch.stack(grads[1:], dim)]
        return list(grads)


def alibi_slopes(gen, call, per_batch, device="cpu"):
    shape = (call.batch, call.heads) if per_batch else (call.heads,)
    return torch.exp2(-4 * torch.rand(shape, generator=gen, device=gen.device)).float().to(device)


# ----------------------------------------------------------------------------- the module


def test_module_loads_on_demand_and_keeps_the_package_namespace():
    script = (
        "import sys, flash_cutlass\n"
        "assert 'flash_cutlass.flash_attn_interface' not in sys.modules\n"
        "from flash_cutlass.flash_attn_interface import flash_attn_func\n"
        "import flash_cutlass.flash_attn_interface as module\n"
        f"assert sorted(module.__all__) == {sorted(FUNCTIONS + ('flash_attn_with_kvcache',))!r}\n"
        "assert not [name for name in module.__all__\n"
        "            if hasattr(flash_cutlass, name) or name in flash_cutlass.__all__]\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_is_fa2s(name):
    parameters = list(inspect.signature(getattr(fai, name)).parameters.values())
    assert [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in parameters] == list(
        FA2_SIGNATURES[name])
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)


# ----------------------------------------------------------------------------- arguments


@pytest.fixture
def seen_options(monkeypatch):
    """The AttentionOptions of every forward and backward run, in order, as {'forward': [...],
    'backward': [...]}, and the rng_state each forward returned ('rng_state': [...])."""
    seen = {"forward": [], "backward": [], "rng_state": []}
    forward, backward = backend.forward, backend.backward

    def spy_forward(q, k, v, options):
        seen["forward"].append(options)
        out, lse, rng_state = forward(q, k, v, options)
        seen["rng_state"].append(rng_state)
        return out, lse, rng_state

    def spy_backward(dout, q, k, v, out, lse, options):
        seen["backward"].append(options)
        return backward(dout, q, k, v, out, lse, options)

    monkeypatch.setattr(backend, "forward", spy_forward)
    monkeypatch.setattr(backend, "backward", spy_backward)
    return seen


@pytest.mark.parametrize("name", FUNCTIONS)
def test_defaults_mean_what_fa2s_do(gen, name, seen_options):
    call = Call(name, gen)
    out = call.run()
    out.float().sum().backward()
    for options in seen_options["forward"] + seen_options["backward"]:
        assert options.softmax_scale == 1 / math.sqrt(HEAD_DIM)
        assert (options.causal, options.window_size, options.softcap, options.dropout_p) == (False, (-1, -1), 0.0, 0.0)
        assert options.alibi_slopes is None and options.rng_state is None and not options.deterministic
    assert len(seen_options["forward"]) == len(seen_options["backward"]) == 1


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_option_reaches_the_forward_and_the_backward(gen, name, seen_options):
    call = Call(name, gen)
    slopes = alibi_slopes(gen, call, per_batch=True)
    out = call.run(dropout_p=0.25, softmax_scale=0.3, causal=True, window_size=(5, 2), softcap=4.0,
                   alibi_slopes=slopes, deterministic=True)
    out.float().sum().backward()
    (forward,), (backward,) = seen_options["forward"], seen_options["backward"]
    for options in (forward, backward):
        assert (options.dropout_p, options.softmax_scale, options.causal, options.window_size, options.softcap,
                options.deterministic) == (0.25, 0.3, True, (5, 2), 4.0, True)
        assert torch.equal(options.alibi_slopes, slopes)
        assert options.is_varlen == (name in VARLEN)
    # The backward drops what the forward dropped.
    assert forward.rng_state is None and torch.equal(backward.rng_state, seen_options["rng_state"][0])
    if name in VARLEN:
        cu_q, cu_k, max_q, max_k = call.lengths
        assert torch.equal(forward.cu_seqlens_q, cu_q) and torch.equal(forward.cu_seqlens_k, cu_k)
        if "qkvpacked" in name:
            assert torch.equal(forward.cu_seqlens_k, cu_q)


# ----------------------------------------------------------------------------- results

OPTION_SETS = {
    "plain": {},
    "causal": {"causal": True},
    "window-softcap": {"window_size": (3, 1), "softcap": 3.0, "softmax_scale": 0.4},
    "alibi-heads": {"alibi": "heads", "causal": True},
    "alibi-batch-deterministic": {"alibi": "batch", "deterministic": True},
    "dropout": {"dropout_p": 0.3, "causal": True},
}


def resolved(gen, call, option_set, device="cpu"):
    """The keyword arguments of OPTION_SETS[option_set], with slopes drawn for `call`."""
    options = dict(OPTION_SETS[option_set])
    if "alibi" in options:
        options["alibi_slopes"] = alibi_slopes(gen, call, options.pop("alibi") == "batch", device)
    return options


def run_seeded(function, options):
    """function(), with the default generator seeded the same way each time (the dropout mask)."""
    torch.manual_seed(1234)
    return function(**options)


@pytest.mark.parametrize("option_set", OPTION_SETS)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_results_and_gradients_equal_flash_attention_on_unpacked_inputs(gen, name, option_set):
    call = Call(name, gen)
    options = resolved(gen, call, option_set)
    out = run_seeded(call.run, options)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    grads = torch.autograd.grad(out, call.leaves, dout)

    unpacked = call.unpacked()
    expected = run_seeded(lambda **o: call.reference(*unpacked, **o), options)
    expected_grads = call.packed_gradients(torch.autograd.grad(expected, unpacked, dout))
    assert torch.equal(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.shape == expected_grad.shape and torch.equal(grad, expected_grad)
    if option_set == "dropout":
        assert not torch.equal(out, call.reference(*unpacked, **{**options, "dropout_p": 0.0}))


def visible_keys(out, sk):
    """keep[i, j] of batch 0, head 0 from attention over zero queries and one-hot values."""
    return out[0, :, 0, :sk].float() != 0


@pytest.mark.parametrize("sq,sk,causal,window,expected", [
    # FA2's docstring: causal with seqlen_q = 2, seqlen_k = 5, and with seqlen_q = 5, seqlen_k = 2.
    (2, 5, True, (-1, -1), ["11110", "11111"]),
    (5, 2, True, (-1, -1), ["00", "00", "00", "10", "11"]),
    # Query i sees keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
    (3, 6, False, (1, 0), ["001100", "000110", "000011"]),
    (4, 4, False, (1, 2), ["1110", "1111", "0111", "0011"]),
    (4, 4, True, (2, -1), ["1000", "1100", "1110", "0111"]),
])
def test_masks_are_those_of_fa2s_docstring(sq, sk, causal, window, expected):
    q = torch.zeros(2, sq, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.eye(sk, HEAD_DIM, dtype=torch.bfloat16)[None, :, None, :].expand(2, sk, HEADS_K, HEAD_DIM)
    k = torch.randn(2, sk, HEADS_K, HEAD_DIM).bfloat16()
    out = fai.flash_attn_func(q, k, v.contiguous(), causal=causal, window_size=window)
    keep = torch.tensor([[c == "1" for c in row] for row in expected])
    assert torch.equal(visible_keys(out, sk), keep)
    assert torch.equal(out[0, ~keep.any(dim=1)], torch.zeros_like(out[0, ~keep.any(dim=1)]))  # rows with no key


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_is_fa2s_bias(gen, per_batch):
    sq, sk = 5, 8
    slopes = torch.rand((2, HEADS) if per_batch else (HEADS,), generator=gen)
    q = torch.zeros(2, sq, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = rand(gen, 2, sk, HEADS_K, HEAD_DIM)
    v = torch.eye(sk, HEAD_DIM, dtype=torch.bfloat16)[None, :, None, :].expand(2, sk, HEADS_K, HEAD_DIM).contiguous()
    out = fai.flash_attn_func(q, k, v, alibi_slopes=slopes)
    distance = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]).abs()
    bias = -slopes.expand(2, HEADS)[:, None, :, None] * distance[None, :, None, :]  # (batch, sq, heads, sk)
    torch.testing.assert_close(out[..., :sk].float(), bias.softmax(dim=-1), atol=1e-2, rtol=0)


@pytest.mark.parametrize("causal,window,softcap,alibi", [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True),
                                                         (False, (6, 3), 5.0, False)])
def test_flash_attn_func_passes_the_fp32_oracle(gen, causal, window, softcap, alibi):
    q, k, v = rand(gen, 2, 33, 4, 32), rand(gen, 2, 47, 2, 32), rand(gen, 2, 47, 2, 32)
    options = {"window_size": window, "softcap": softcap,
               "alibi_slopes": torch.rand(4, generator=gen) if alibi else None}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fai.flash_attn_func(*leaves, causal=causal, **options)
    dout = rand(gen, *out.shape)
    grads = torch.autograd.grad(out, leaves, dout)

    def oracle(compute_dtype):
        inputs = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        attended, _ = naive_attention(*inputs, 1 / math.sqrt(32), causal, **options)
        return attended, torch.autograd.grad(attended, inputs, dout.to(attended.dtype))

    (oracle_out, oracle_grads), (same_out, same_grads) = oracle(torch.float32), oracle(None)
    fa2_check(out, oracle_out, same_out, "out")
    for name, grad, ref, base in zip("qkv", grads, oracle_grads, same_grads):
        fa2_check(grad, ref, base, f"d{name}")


def test_varlen_sequences_attend_only_to_themselves(gen):
    call = Call("flash_attn_varlen_func", gen)
    out = call.run(causal=True)
    q, k, v = (t.detach() for t in call.leaves)
    cu_q, cu_k = call.lengths[0].tolist(), call.lengths[1].tolist()
    for b in range(call.batch):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = fai.flash_attn_func(q[None, rows], k[None, keys], v[None, keys], causal=True)
        assert torch.equal(out[rows], expected[0])


@pytest.mark.parametrize("name", FUNCTIONS)
def test_return_attn_probs_without_dropout_returns_lse_and_an_empty_s_dmask(gen, name):
    call = Call(name, gen)
    out, softmax_lse, s_dmask = call.run(causal=True, return_attn_probs=True)
    expected_out, expected_lse = call.reference(*call.unpacked(), causal=True, return_attn_probs=True)
    assert torch.equal(out, expected_out) and torch.equal(softmax_lse, expected_lse)
    total_q = call.leaves[0].shape[0]
    assert softmax_lse.dtype == torch.float32
    assert softmax_lse.shape == ((call.heads, total_q) if name in VARLEN else (2, call.heads, SEQLEN_Q))
    assert s_dmask.shape == (0,) and s_dmask.dtype == out.dtype and s_dmask.device == out.device
    assert out.requires_grad and not softmax_lse.requires_grad


def test_inputs_with_a_strided_last_dimension_are_copied_as_fa2_does(gen):
    q, k, v = (rand(gen, 2, 16, 4, SEQLEN_Q).transpose(1, 3).requires_grad_() for _ in range(3))
    assert q.stride(-1) != 1
    out = fai.flash_attn_func(q, k, v, causal=True)
    dout = rand(gen, *out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    expected = flash_cutlass.flash_attention(*contiguous, causal=True)
    assert torch.equal(out, expected)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, contiguous, dout)):
        assert torch.equal(grad, expected_grad)


# ----------------------------------------------------------------------------- rejected input


@pytest.mark.parametrize("name", FUNCTIONS)
def test_return_attn_probs_with_dropout_raises(gen, name):
    with pytest.raises(NotImplementedError, match=r"return_attn_probs=True with dropout_p > 0.*return_lse=True"):
        Call(name, gen).run(dropout_p=0.1, return_attn_probs=True)


def test_return_attn_probs_checks_dropout_p_first(gen):
    with pytest.raises(ValueError, match="dropout_p must be in"):
        Call("flash_attn_func", gen).run(dropout_p=1.5, return_attn_probs=True)


def test_block_table_raises(gen):
    call = Call("flash_attn_varlen_func", gen)
    with pytest.raises(NotImplementedError, match="block_table"):
        call.run(block_table=torch.zeros(3, 1, dtype=torch.int32))


@pytest.mark.parametrize("name,argument,shape", [
    ("flash_attn_qkvpacked_func", "qkv", (2, 9, 2, 4, 16)),
    ("flash_attn_qkvpacked_func", "qkv", (2, 9, 12, 16)),
    ("flash_attn_qkvpacked_func", "qkv", (9, 3, 4, 16)),
    ("flash_attn_kvpacked_func", "kv", (2, 12, 3, 2, 16)),
    ("flash_attn_kvpacked_func", "kv", (2, 12, 4, 16)),
    ("flash_attn_varlen_qkvpacked_func", "qkv", (9, 2, 4, 16)),
    ("flash_attn_varlen_qkvpacked_func", "qkv", (1, 9, 3, 4, 16)),
    ("flash_attn_varlen_kvpacked_func", "kv", (12, 3, 2, 16)),
    ("flash_attn_varlen_kvpacked_func", "kv", (2, 12, 2, 2, 16)),
])
def test_malformed_packed_inputs_raise_naming_the_argument(gen, name, argument, shape):
    call = Call(name, gen)
    index = 0 if argument == "qkv" else 1
    call.leaves[index] = rand(gen, *shape)
    with pytest.raises(ValueError, match=rf"^{argument} must have shape \(.*, got {re.escape(str(shape))}"):
        call.run()


@pytest.mark.parametrize("name,argument", [("flash_attn_qkvpacked_func", "qkv"), ("flash_attn_kvpacked_func", "kv"),
                                           ("flash_attn_varlen_qkvpacked_func", "qkv"),
                                           ("flash_attn_varlen_kvpacked_func", "kv")])
def test_packed_non_tensors_raise_naming_the_argument(gen, name, argument):
    call = Call(name, gen)
    call.leaves[0 if argument == "qkv" else 1] = [[0.0]]
    with pytest.raises(TypeError, match=f"^{argument} must be a torch.Tensor, got list"):
        call.run()


@pytest.mark.parametrize("name,change,error,message", [
    ("flash_attn_func", {"softmax_scale": -1.0}, ValueError, "softmax_scale must be finite and > 0"),
    ("flash_attn_func", {"window_size": (3,)}, TypeError, "window_size must be a"),
    ("flash_attn_kvpacked_func", {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    ("flash_attn_qkvpacked_func", {"dropout_p": 1.0}, ValueError, "dropout_p must be in"),
    ("flash_attn_func", {"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
    ("flash_attn_varlen_func", {"alibi_slopes": torch.ones(5)}, ValueError, "alibi_slopes must have shape"),
    ("flash_attn_varlen_kvpacked_func", {"alibi_slopes": torch.ones(4, dtype=torch.float16)}, TypeError,
     "alibi_slopes must be float32"),
])
def test_flash_cutlass_checks_name_fa2s_arguments(gen, name, change, error, message):
    with pytest.raises(error, match=message):
        Call(name, gen).run(**change)


@pytest.mark.parametrize("name", VARLEN)
def test_varlen_lengths_are_checked(gen, name):
    call = Call(name, gen)
    call.lengths = (call.lengths[0].long(), call.lengths[1].long(), *call.lengths[2:])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        call.run()
    call = Call(name, gen)
    call.lengths = (*call.lengths[:2], 3, 3)
    with pytest.raises(ValueError, match=r"max_seqlen_(q|k) = 3 is below the longest sequence"):
        call.run()


def test_fp32_inputs_raise_naming_q(gen):
    q, k, v = (rand(gen, 2, 8, 4, 16, dtype=torch.float32) for _ in range(3))
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        fai.flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------- torch.compile


def compiled_matches_eager(call, **options):
    def attend(*leaves):
        return call.run(*leaves, **options)

    leaves = call.leaves
    eager = attend(*leaves)
    eager_out = eager[0] if isinstance(eager, tuple) else eager
    eager_grads = torch.autograd.grad(eager_out.float().square().sum(), leaves)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)(*leaves)
    compiled_out = compiled[0] if isinstance(compiled, tuple) else compiled
    compiled_grads = torch.autograd.grad(compiled_out.float().square().sum(), leaves)
    torch.testing.assert_close(compiled, eager)
    for grad, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(grad, expected)


def test_compiled_qkvpacked_matches_eager_without_graph_breaks(gen):
    compiled_matches_eager(Call("flash_attn_qkvpacked_func", gen), causal=True, window_size=(4, -1))


def test_compiled_varlen_kvpacked_with_attn_probs_matches_eager_without_graph_breaks(gen):
    compiled_matches_eager(Call("flash_attn_varlen_kvpacked_func", gen), causal=True, return_attn_probs=True)


# ----------------------------------------------------------------------------- GPU


@requires_cuda
@requires_backward
@pytest.mark.parametrize("option_set", ["causal", "window-softcap", "alibi-batch-deterministic", "dropout"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_gpu_functions_match_flash_attention(cuda_gen, name, option_set):
    call = Call(name, cuda_gen, device="cuda", head_dim=128, seqlens=(300, 521),
                lengths=([300, 0, 77], [129, 256, 400]), heads=(8, 2))
    options = resolved(cuda_gen, call, option_set, "cuda")
    left_out = options_left_out(options.get("window_size", (-1, -1)), options.get("softcap", 0.0),
                                "alibi_slopes" in options, options.get("dropout_p", 0.0))
    if left_out:
        pytest.skip(left_out)

    def seeded(function, **o):
        torch.cuda.manual_seed(1234)
        return function(**o)

    out = seeded(call.run, **options)
    dout = torch.randn(out.shape, generator=cuda_gen, device="cuda").to(out.dtype)
    grads = torch.autograd.grad(out, call.leaves, dout)
    unpacked = call.unpacked()
    expected = seeded(lambda **o: call.reference(*unpacked, **o), **options)
    expected_grads = call.packed_gradients(torch.autograd.grad(expected, unpacked, dout))
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.shape == expected_grad.shape
        torch.testing.assert_close(grad, expected_grad)


@requires_cuda
@requires_backward
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_qkvpacked_passes_the_fp32_oracle(cuda_gen, causal):
    qkv = rand(cuda_gen, 2, 1023, 3, 8, 128, device="cuda").requires_grad_()
    out = fai.flash_attn_qkvpacked_func(qkv, causal=causal)
    dout = rand(cuda_gen, *out.shape, device="cuda")
    (grad,) = torch.autograd.grad(out, qkv, dout)

    def oracle(compute_dtype):
        packed = qkv.detach().to(compute_dtype or qkv.dtype).requires_grad_()
        attended, _ = naive_attention(*packed.unbind(2), 1 / math.sqrt(128), causal)
        return attended, torch.autograd.grad(attended, packed, dout.to(attended.dtype))[0]

    (oracle_out, oracle_grad), (same_out, same_grad) = oracle(torch.float32), oracle(None)
    fa2_check(out, oracle_out, same_out, "out")
    for i, name in enumerate("qkv"):
        fa2_check(grad[:, :, i], oracle_grad[:, :, i], same_grad[:, :, i], f"d{name}")

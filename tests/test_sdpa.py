"""flash_cutlass.scaled_dot_product_attention: torch SDPA's layout and semantics (the top-left
causal diagonal included), its fallbacks, and its gradients. CPU (the reference) in CI; CUDA (the
kernels) where a GPU is visible."""

import warnings

import pytest
import torch

import flash_cutlass
from flash_cutlass import sdpa as sdpa_module
from helpers import fa2_check, requires_cuda

torch_sdpa = torch.nn.functional.scaled_dot_product_attention


def inputs(gen, device, batch=2, heads=4, heads_k=4, seqlen_q=37, seqlen_k=37, head_dim=32, dtype=torch.bfloat16):
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return (rand(batch, heads, seqlen_q, head_dim), rand(batch, heads_k, seqlen_k, head_dim),
            rand(batch, heads_k, seqlen_k, head_dim))


def check_against_torch(q, k, v, dout, **kwargs):
    """Output and gradients against torch SDPA in fp32 (the oracle) with FlashAttention-2's rule
    (the baseline: torch SDPA in the inputs' dtype)."""
    results = []
    for fn, dtype in ((flash_cutlass.scaled_dot_product_attention, None), (torch_sdpa, torch.float32),
                      (torch_sdpa, None)):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kwargs)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.append((out, *grads))
    ours, oracle, baseline = results
    for name, a, o, b in zip(("out", "dq", "dk", "dv"), ours, oracle, baseline):
        assert a.shape == o.shape and a.dtype == q.dtype, name
        fa2_check(a, o, b, f"sdpa {name} {kwargs}")


def cpu_and_cuda():
    return ["cpu", pytest.param("cuda", marks=requires_cuda)]


def generator_for(request, device):
    """The test's seeded generator on `device` (the CUDA one only where a GPU is visible)."""
    return request.getfixturevalue("cuda_gen" if device == "cuda" else "gen")


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("seqlen_q,seqlen_k,is_causal", [(37, 37, False), (37, 37, True), (64, 19, True),
                                                         (19, 64, False), (1, 50, False)])
def test_matches_torch_sdpa(request, device, seqlen_q, seqlen_k, is_causal):
    generator = generator_for(request, device)
    q, k, v = inputs(generator, device, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    dout = torch.randn(q.shape, generator=generator, device=device).to(q.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # runs on flash_cutlass, no fallback
        check_against_torch(q, k, v, dout, is_causal=is_causal)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_scale_and_gqa(request, device):
    generator = generator_for(request, device)
    q, k, v = inputs(generator, device, heads=8, heads_k=2, seqlen_q=40, seqlen_k=40)
    dout = torch.randn(q.shape, generator=generator, device=device).to(q.dtype)
    check_against_torch(q, k, v, dout, is_causal=True, scale=0.3, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flash_cutlass.scaled_dot_product_attention(q, k, v)


def test_output_is_a_view_like_torchs_flash_backend(gen):
    q, k, v = inputs(gen, "cpu")
    out = flash_cutlass.scaled_dot_product_attention(q, k, v)
    assert out.shape == q.shape
    # (batch, seqlen, heads, head_dim) underneath: back to that layout without a copy.
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("case", ["attn_mask", "float32", "causal_fewer_queries", "rank3"])
def test_what_it_cannot_serve_falls_back_or_raises(gen, case):
    q, k, v = inputs(gen, "cpu", seqlen_q=21, seqlen_k=21)
    kwargs = {}
    if case == "attn_mask":
        kwargs["attn_mask"] = torch.rand(21, 21, generator=gen) > 0.3
        kwargs["attn_mask"][:, 0] = True
    elif case == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "causal_fewer_queries":
        q = q[:, :, :7]
        kwargs["is_causal"] = True
    else:
        q, k, v = q[0], k[0], v[0]
    expected = torch_sdpa(q, k, v, **kwargs)
    sdpa_module._warned_reasons.clear()
    with pytest.warns(UserWarning, match="running torch's scaled_dot_product_attention"):
        out = flash_cutlass.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning comes once per reason
        flash_cutlass.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="fallback=True"):
        flash_cutlass.scaled_dot_product_attention(q, k, v, fallback=False, **kwargs)


def test_dropout_drops_and_keeps_gradients(gen):
    q, k, v = (t.requires_grad_() for t in inputs(gen, "cpu", seqlen_q=64, seqlen_k=64))
    dense = flash_cutlass.scaled_dot_product_attention(q, k, v)
    dropped = flash_cutlass.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert dropped.shape == dense.shape and not torch.equal(dropped, dense)
    dropped.float().sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))

"""End to end: a small decoder (random weights made here, rotary positions, GQA; and a gpt-oss-like
one: learned attention sinks in every layer, a sliding window of 8 keys in the first) generates 64
tokens greedily with a paged KV cache through flash_attention_with_kvcache (prefill of the prompt
in one call, then one token a call), and every step matches recomputing full causal attention over
the whole sequence. On the CPU (fp64) the tokens and logits match exactly enough to compare tokens;
on the GPU (bf16) logits match within the dtype's tolerance and each greedy token agrees wherever
its margin over the runner-up exceeds that tolerance."""

import pytest
import torch

import flash_cutlass
from flash_cutlass import reference
from helpers import requires_cuda


class TinyDecoder:
    def __init__(self, gen, *, vocab=48, dim=64, heads=4, heads_k=2, layers=2, dtype=torch.float64, device="cpu",
                 gpt_oss_like=False):
        self.heads, self.heads_k, self.head_dim = heads, heads_k, dim // heads

        def weight(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

        self.embed = weight(vocab, dim, scale=1.0)
        self.layers = [{"wq": weight(dim, dim, scale=dim ** -0.5), "wk": weight(dim, heads_k * self.head_dim,
                                                                                scale=dim ** -0.5),
                        "wv": weight(dim, heads_k * self.head_dim, scale=dim ** -0.5),
                        "wo": weight(dim, dim, scale=dim ** -0.5)} for _ in range(layers)]
        self.unembed = weight(dim, vocab, scale=4 * dim ** -0.5)
        # gpt-oss-like: each layer's attention options, sinks (fp32 on the GPU) and a first layer that
        # attends to its last 8 keys only.
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.options = [{} for _ in range(layers)]
        if gpt_oss_like:
            for index, options in enumerate(self.options):
                options["sinks"] = (2 * torch.randn(heads, generator=gen, dtype=torch.float64) + 1).to(device, sink_dtype)
                if index == 0:
                    options["window_size"] = (7, 0)
        angles = torch.arange(256, dtype=torch.float64)[:, None] / 10000 ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        self.cos, self.sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)

    def _project(self, x, layer):
        batch, n, _ = x.shape
        q = (x @ layer["wq"]).view(batch, n, self.heads, self.head_dim)
        k = (x @ layer["wk"]).view(batch, n, self.heads_k, self.head_dim)
        v = (x @ layer["wv"]).view(batch, n, self.heads_k, self.head_dim)
        return q, k, v

    def _rotated(self, x, start):
        """GPT-NeoX rotary of x (batch, n, heads, head_dim) at positions start .. start + n - 1."""
        n, half = x.shape[1], self.head_dim // 2
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # the kernels': fp32
        cos = self.cos[start:start + n, None, :].to(compute)
        sin = self.sin[start:start + n, None, :].to(compute)
        x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    def logits_full(self, tokens):
        """Logits of the last position, recomputing causal attention over every token."""
        x = self.embed[tokens]
        for layer, options in zip(self.layers, self.options):
            q, k, v = self._project(x, layer)
            q, k = self._rotated(q, 0), self._rotated(k, 0)
            if x.is_cuda:
                out, _ = flash_cutlass.flash_forward(q, k, v, causal=True, **options)
            else:  # the CPU path in fp64, which flash_forward does not take
                out, _ = reference.attention_forward(q, k, v, self.head_dim ** -0.5, True, **options)
            x = x + out.reshape(x.shape) @ layer["wo"]
        return x[:, -1] @ self.unembed

    def logits_cached(self, tokens, caches, seqlens, block_table):
        """Logits of the last of `tokens` (the new ones), appending them to the paged caches."""
        x = self.embed[tokens]
        for layer, options, (k_cache, v_cache) in zip(self.layers, self.options, caches):
            q, k, v = self._project(x, layer)
            out = flash_cutlass.flash_attention_with_kvcache(
                q, k_cache, v_cache, k, v, seqlens, block_table=block_table, causal=True, rotary_cos=self.cos,
                rotary_sin=self.sin, rotary_interleaved=False, **options)
            x = x + out.reshape(x.shape) @ layer["wo"]
        return x[:, -1] @ self.unembed


def generate_and_compare(gen, device, dtype, page_size, tolerance, gpt_oss_like=False):
    batch, prompt, steps = 2, 7, 64
    model = TinyDecoder(gen, dtype=dtype, device=device, gpt_oss_like=gpt_oss_like)
    blocks = -(-(prompt + steps) // page_size)
    pool = batch * blocks + 5
    block_table = torch.randperm(pool, generator=gen)[:batch * blocks].view(batch, blocks).to(device, torch.int32)
    caches = [tuple(torch.full((pool, page_size, model.heads_k, model.head_dim), float("nan"), dtype=dtype,
                               device=device) for _ in range(2)) for _ in model.layers]
    tokens = torch.randint(0, model.embed.shape[0], (batch, prompt), generator=gen).to(device)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    new = tokens
    for step in range(steps):
        cached = model.logits_cached(new, caches, seqlens, block_table)
        full = model.logits_full(tokens)
        assert (cached.float() - full.float()).abs().max().item() <= tolerance, f"step {step}"
        top2 = full.float().topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
        next_token = cached.argmax(-1)
        assert torch.equal(next_token[decisive], full.argmax(-1)[decisive]), f"step {step}"
        seqlens += new.shape[1]
        new = next_token[:, None]
        tokens = torch.cat((tokens, new), dim=1)
    assert tokens.shape == (batch, prompt + steps)


@pytest.mark.parametrize("gpt_oss_like", [False, True], ids=["", "gpt_oss_like"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_generation_with_a_paged_cache_matches_full_recomputation_cpu(gen, page_size, gpt_oss_like):
    generate_and_compare(gen, "cpu", torch.float64, page_size, tolerance=1e-9, gpt_oss_like=gpt_oss_like)


@requires_cuda
@pytest.mark.parametrize("gpt_oss_like", [False, True], ids=["", "gpt_oss_like"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_greedy_generation_with_a_paged_cache_matches_full_recomputation_cuda(gen, page_size, gpt_oss_like):
    generate_and_compare(gen, "cuda", torch.bfloat16, page_size, tolerance=0.25, gpt_oss_like=gpt_oss_like)

"""Tests of the pure-PyTorch reference (flash_cutlass.reference), the oracle of every kernel test.

The tiled online-softmax forward is checked against the materialized-scores version in fp64 and
against torch's own scaled_dot_product_attention (math backend); edge cases (rows that attend no
key, empty tensors) and the dtype contract are checked directly.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cutlass.reference import attention_backward, attention_forward, causal_mask, naive_attention
from helpers import fa2_check, requires_cuda

FP64_TOL = {"atol": 1e-10, "rtol": 1e-10}

SEQLEN_PAIRS = [
    (1, 1),
    (17, 17),
    (113, 113),
    (255, 255),
    (17, 113),
    (113, 17),
    (1, 255),
    (255, 1),
]
# (heads, kv_heads): MHA, GQA with 4 query heads per kv head, MQA.
HEAD_LAYOUTS = [(4, 4), (8, 2), (4, 1)]
LOW_PRECISION = [torch.float16, torch.bfloat16, torch.float32]


def make_qkv(gen, batch, sq, sk, heads, kv_heads, head_dim, dtype=torch.float64):
    q = torch.randn(batch, sq, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, sk, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, sk, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def keep_mask(sq, sk, causal):
    """The bottom-right-aligned causal keep-mask, built independently of the module under test."""
    ones = torch.ones(sq, sk, dtype=torch.bool)
    return ones.tril(diagonal=sk - sq) if causal else ones


def assert_matches_fp64_oracle(q, k, v, scale, causal, block_size):
    out, lse = attention_forward(q, k, v, scale, causal, block_size=block_size)
    ref_out, ref_lse = naive_attention(q, k, v, scale, causal, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiled_matches_naive_fp64(gen, causal, sq, sk, heads, kv_heads, block_size):
    q, k, v = make_qkv(gen, 2, sq, sk, heads, kv_heads, 32)
    assert_matches_fp64_oracle(q, k, v, 32**-0.5, causal, block_size)


@pytest.mark.parametrize("block_size", [1, 7, 64, 254, 255, 256, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sizes(gen, causal, block_size):
    q, k, v = make_qkv(gen, 1, 113, 255, 4, 2, 24)
    assert_matches_fp64_oracle(q, k, v, 24**-0.5, causal, block_size)


@pytest.mark.parametrize("sq,sk", [(1023, 1023), (255, 1023), (1023, 255)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequences(gen, causal, sq, sk):
    q, k, v = make_qkv(gen, 1, sq, sk, 2, 1, 16)
    assert_matches_fp64_oracle(q, k, v, 16**-0.5, causal, 128)


@pytest.mark.parametrize("scale", [0.0, 0.05, 2.5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scales(gen, causal, scale):
    q, k, v = make_qkv(gen, 2, 113, 17, 4, 2, 32)
    assert_matches_fp64_oracle(q, k, v, scale, causal, 8)


def test_zero_scale_averages_values(gen):
    q, k, v = make_qkv(gen, 2, 17, 113, 4, 2, 32)
    out, lse = attention_forward(q, k, v, 0.0, causal=False, block_size=16)
    expected = v.mean(dim=1, keepdim=True).repeat_interleave(2, dim=2).expand_as(out)
    torch.testing.assert_close(out, expected, **FP64_TOL)
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(113)), **FP64_TOL)


@pytest.mark.parametrize("ramp", ["increasing", "decreasing"])
def test_rescaling_when_row_max_moves(gen, ramp):
    """Key norms that grow (or shrink) along the sequence move the running max at every block."""
    q, k, v = make_qkv(gen, 2, 113, 255, 4, 2, 32)
    norms = torch.linspace(0.1, 6.0, 255, dtype=torch.float64)
    if ramp == "decreasing":
        norms = norms.flip(0)
    k = k * norms.view(1, -1, 1, 1)
    assert_matches_fp64_oracle(q, k, v, 32**-0.5, False, 8)


@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("sq,sk", [(17, 17), (113, 113), (17, 113), (113, 17), (1, 255), (255, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_torch_sdpa(gen, causal, sq, sk, heads, kv_heads):
    q, k, v = make_qkv(gen, 2, sq, sk, heads, kv_heads, 32)
    scale = 0.7 * 32**-0.5
    mask = keep_mask(sq, sk, causal)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
    out, _ = attention_forward(q, k, v, scale, causal, block_size=16)
    rows = mask.any(dim=1)
    assert rows.any()
    torch.testing.assert_close(out[:, rows], expected[:, rows], **FP64_TOL)


def test_lse_matches_direct_logsumexp(gen):
    q, k, v = make_qkv(gen, 2, 113, 255, 8, 2, 32)
    scale = 32**-0.5
    _, lse = attention_forward(q, k, v, scale, causal=True, block_size=16)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4, dim=2)) * scale
    scores = scores.masked_fill(~keep_mask(113, 255, True), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **FP64_TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("sq,sk", [(255, 17), (17, 1), (2, 1)])
def test_rows_without_keys_give_zero_and_neg_inf(gen, sq, sk, dtype):
    q, k, v = make_qkv(gen, 2, sq, sk, 4, 2, 32, dtype)
    empty_rows = sq - sk
    results = {
        "attention_forward": attention_forward(q, k, v, 0.2, causal=True, block_size=16),
        "naive_attention": naive_attention(q, k, v, 0.2, causal=True),
    }
    for name, (out, lse) in results.items():
        assert not out.isnan().any(), name
        assert (out[:, :empty_rows] == 0).all(), name
        assert torch.isneginf(lse[:, :, :empty_rows]).all(), name
        assert lse[:, :, empty_rows:].isfinite().all(), name
        assert (out[:, empty_rows:] != 0).any(), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_keys(gen, causal):
    q = torch.randn(2, 17, 4, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 0, 2, 32, dtype=torch.float64)
    v = torch.randn(2, 0, 2, 32, dtype=torch.float64)
    for out, lse in (
        attention_forward(q, k, v, 0.2, causal),
        naive_attention(q, k, v, 0.2, causal),
    ):
        assert out.shape == (2, 17, 4, 32) and lse.shape == (2, 4, 17)
        assert (out == 0).all()
        assert torch.isneginf(lse).all()


@pytest.mark.parametrize("batch,sq,sk", [(0, 17, 113), (2, 0, 113), (2, 0, 0)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_batch_or_queries(gen, causal, batch, sq, sk):
    q, k, v = make_qkv(gen, batch, sq, sk, 4, 2, 32, torch.bfloat16)
    out, lse = attention_forward(q, k, v, 0.2, causal)
    assert out.shape == (batch, sq, 4, 32) and out.dtype == torch.bfloat16
    assert lse.shape == (batch, 4, sq) and lse.dtype == torch.float32
    out, lse = naive_attention(q, k, v, 0.2, causal)
    assert out.shape == (batch, sq, 4, 32) and lse.shape == (batch, 4, sq)


@pytest.mark.parametrize(
    "dtype,lse_dtype",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
    ids=["fp16", "bf16", "fp32", "fp64"],
)
def test_output_dtypes(gen, dtype, lse_dtype):
    q, k, v = make_qkv(gen, 1, 17, 17, 2, 1, 16, dtype)
    out, lse = attention_forward(q, k, v, 0.25, causal=True)
    assert (out.dtype, lse.dtype) == (dtype, lse_dtype)
    out, lse = naive_attention(q, k, v, 0.25, causal=True)
    assert (out.dtype, lse.dtype) == (dtype, lse_dtype)
    out, lse = naive_attention(q, k, v, 0.25, causal=True, compute_dtype=torch.float64)
    assert (out.dtype, lse.dtype) == (torch.float64, torch.float64)
    out, lse = naive_attention(q, k, v, 0.25, causal=True, compute_dtype=torch.float32)
    assert (out.dtype, lse.dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_inputs_computed_in_fp32(gen, causal, dtype):
    """Only the final store rounds to the input dtype: the output is within half an ulp of fp64."""
    q, k, v = make_qkv(gen, 2, 113, 255, 8, 2, 64, dtype)
    out, lse = attention_forward(q, k, v, 64**-0.5, causal, block_size=32)
    ref_out, ref_lse = naive_attention(q, k, v, 64**-0.5, causal, compute_dtype=torch.float64)
    torch.testing.assert_close(
        out.double(), ref_out, atol=1e-5, rtol=torch.finfo(dtype).eps / 2 + 1e-6, check_dtype=False
    )
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


def test_fp16_scores_beyond_fp16_range(gen):
    """Raw q.k^T products above fp16's max must not overflow: scores are formed in fp32."""
    q, k, v = make_qkv(gen, 1, 113, 255, 4, 2, 64)
    q, k, v = (60 * q).half(), (60 * k).half(), v.half()
    raw = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2))
    assert raw.abs().max() > torch.finfo(torch.float16).max
    # The scale brings the softmax input back to O(1), so the softmax is far from one-hot.
    scale = 2e-4
    out, lse = attention_forward(q, k, v, scale, causal=False, block_size=32)
    ref_out, ref_lse = naive_attention(q, k, v, scale, causal=False, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=2**-11 + 1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa2_rule_holds_for_reference(gen, causal, dtype):
    """The fp32-accumulating reference passes the kernels' pass rule, rows without keys included."""
    q, k, v = make_qkv(gen, 2, 255, 113, 8, 2, 64, dtype)
    scale = 64**-0.5
    out, lse = attention_forward(q, k, v, scale, causal, block_size=64)
    oracle_out, oracle_lse = naive_attention(q, k, v, scale, causal, compute_dtype=torch.float32)
    same_out, same_lse = naive_attention(q, k, v, scale, causal)
    fa2_check(out, oracle_out, same_out, "out")
    fa2_check(lse, oracle_lse, same_lse, "lse")


def test_noncontiguous_inputs(gen):
    q_bhsd = torch.randn(2, 8, 113, 32, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 255, 2, 2, 32, generator=gen, dtype=torch.float64)
    q, k, v = q_bhsd.transpose(1, 2), kv[:, :, 0], kv[:, :, 1]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, lse = attention_forward(q, k, v, 0.2, causal=True, block_size=16)
    ref_out, ref_lse = attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.2, causal=True, block_size=16
    )
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_nan_input_is_not_hidden(gen):
    q, k, v = make_qkv(gen, 1, 17, 17, 2, 1, 16)
    q[0, 5, 1, 3] = float("nan")
    out, lse = attention_forward(q, k, v, 0.25, causal=False, block_size=4)
    assert out[0, 5, 1].isnan().all() and lse[0, 1, 5].isnan()
    assert not out[0, :, 0].isnan().any()


@pytest.mark.parametrize(
    "sq,sk", [(1, 1), (4, 4), (2, 5), (5, 2), (17, 113), (113, 17), (3, 0), (0, 3)]
)
def test_causal_mask(sq, sk):
    mask = causal_mask(sq, sk, "cpu")
    assert mask.dtype == torch.bool and mask.shape == (sq, sk)
    assert torch.equal(mask, keep_mask(sq, sk, True))


def test_causal_mask_examples():
    assert causal_mask(2, 4, "cpu").int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(4, 2, "cpu").int().tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]


# Each rejected input: how to derive the bad arguments from valid (q, k, v), the error, and the
# start of a message that names the offending argument.
BAD_INPUTS = {
    "q_3d": (lambda q, k, v: (q[0], k, v, 0.25), ValueError, r"^q must be 4-D"),
    "v_5d": (lambda q, k, v: (q, k, v.unsqueeze(0), 0.25), ValueError, r"^v must be 4-D"),
    "k_int": (lambda q, k, v: (q, k.long(), v, 0.25), ValueError, r"^k dtype"),
    "q_list": (lambda q, k, v: (q.tolist(), k, v, 0.25), TypeError, r"^q must be a torch.Tensor"),
    "dtype_mix": (lambda q, k, v: (q, k, v.float(), 0.25), ValueError, r"^q, k, v must share"),
    "kv_seqlen": (lambda q, k, v: (q, k, v[:, :-1], 0.25), ValueError, r"^k and v must agree"),
    "batch": (lambda q, k, v: (q[:1], k, v, 0.25), ValueError, r"^q and k batch"),
    "head_dim": (lambda q, k, v: (q[..., :8], k, v, 0.25), ValueError, r"^q and k head_dim"),
    "heads": (lambda q, k, v: (q[:, :, :3], k, v, 0.25), ValueError, r"^q heads \(3\)"),
    "no_kv_heads": (
        lambda q, k, v: (q, k[:, :, :0], v[:, :, :0], 0.25),
        ValueError,
        r"k/v heads \(0\)",
    ),
    "scale_none": (lambda q, k, v: (q, k, v, None), TypeError, r"^softmax_scale"),
    "scale_bool": (lambda q, k, v: (q, k, v, True), TypeError, r"^softmax_scale"),
}


@pytest.mark.parametrize("fn", [attention_forward, naive_attention], ids=["tiled", "naive"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_bad_input(gen, fn, case):
    make_args, error, message = BAD_INPUTS[case]
    args = make_args(*make_qkv(gen, 2, 17, 33, 4, 2, 16))
    with pytest.raises(error, match=message):
        fn(*args, causal=False)


@pytest.mark.parametrize("block_size", [0, -16, 2.0, True, None])
def test_rejects_bad_block_size(gen, block_size):
    q, k, v = make_qkv(gen, 1, 17, 17, 2, 1, 16)
    with pytest.raises(ValueError, match="block_size"):
        attention_forward(q, k, v, 0.25, False, block_size=block_size)


@pytest.mark.parametrize("compute_dtype", [torch.int32, torch.complex64])
def test_rejects_bad_compute_dtype(gen, compute_dtype):
    q, k, v = make_qkv(gen, 1, 17, 17, 2, 1, 16)
    with pytest.raises(ValueError, match="compute_dtype"):
        naive_attention(q, k, v, 0.25, False, compute_dtype=compute_dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp16", "bf16", "fp32"])
def test_runs_on_cuda(gen, dtype):
    q, k, v = make_qkv(gen, 2, 113, 255, 8, 2, 64, dtype)
    cpu_out, cpu_lse = attention_forward(q, k, v, 0.125, causal=True)
    out, lse = attention_forward(q.cuda(), k.cuda(), v.cuda(), 0.125, causal=True)
    assert out.device.type == "cuda" and lse.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), cpu_out, atol=1e-4, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-4, rtol=1e-5)


def autograd_gradients(q, k, v, dout, scale, causal):
    """Gradients of naive fp64 attention by autograd: the oracle of attention_backward."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*leaves, scale, causal, compute_dtype=torch.float64)
    return torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize("block_size", [7, 128])
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_autograd_fp64(gen, causal, sq, sk, heads, kv_heads, block_size):
    q, k, v = make_qkv(gen, 2, sq, sk, heads, kv_heads, 16)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, 0.3, causal)
    grads = attention_backward(dout, q, k, v, out, lse, 0.3, causal, block_size=block_size)
    for name, grad, expected in zip("qkv", grads, autograd_gradients(q, k, v, dout, 0.3, causal)):
        assert grad.shape == expected.shape, name
        torch.testing.assert_close(grad, expected, **FP64_TOL, msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_gradcheck(gen, causal):
    # The forward and the tiled backward as one autograd function, checked by finite differences.
    class TiledAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = attention_forward(q, k, v, 0.4, causal, block_size=5)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            return attention_backward(dout, *ctx.saved_tensors, 0.4, causal, block_size=5)

    q, k, v = (t.requires_grad_() for t in make_qkv(gen, 1, 9, 13, 4, 2, 8))
    assert torch.autograd.gradcheck(TiledAttention.apply, (q, k, v))


def test_backward_rows_without_keys_get_zero_gradients(gen):
    q, k, v = make_qkv(gen, 1, 20, 5, 2, 2, 8)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, 0.5, True)
    assert torch.isneginf(lse[:, :, :15]).all()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, 0.5, True)
    assert torch.equal(dq[:, :15], torch.zeros_like(dq[:, :15]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp16", "bf16", "fp32"])
def test_backward_returns_input_dtypes(gen, dtype):
    q, k, v = make_qkv(gen, 2, 33, 47, 4, 2, 16, dtype)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    out, lse = attention_forward(q, k, v, 0.25, True)
    grads = attention_backward(dout, q, k, v, out, lse, 0.25, True)
    expected = autograd_gradients(q, k, v, dout, 0.25, True)
    for grad, ref, t in zip(grads, expected, (q, k, v)):
        assert grad.dtype == dtype and grad.shape == t.shape
        # Computed in fp32 from inputs (and out, lse) rounded to dtype: close to fp64 autograd.
        torch.testing.assert_close(grad.double(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("which", ["dout", "out", "lse"])
def test_backward_rejects_mismatched_shapes(gen, which):
    q, k, v = make_qkv(gen, 1, 17, 17, 2, 1, 16)
    out, lse = attention_forward(q, k, v, 0.25, False)
    args = {"dout": torch.ones_like(q), "out": out, "lse": lse}
    args[which] = args[which][:, :-1]
    with pytest.raises(ValueError, match=f"^{which} must be"):
        attention_backward(args["dout"], q, k, v, args["out"], args["lse"], 0.25, False)

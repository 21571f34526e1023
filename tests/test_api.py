"""The public API without a GPU: imports, build report, CPU path, and every rejected input."""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.backend import _aligned, check_compute_capability
from flash_cutlass.reference import naive_attention
from helpers import catalogue, check_rejected_by_every_entry_point, off_16_bytes


def qkv(batch=2, seqlen_q=33, seqlen_k=47, heads=4, heads_k=2, head_dim=32, dtype=torch.bfloat16, gen=None):
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return rand(batch, seqlen_q, heads, head_dim), rand(batch, seqlen_k, heads_k, head_dim), rand(
        batch, seqlen_k, heads_k, head_dim)


def test_extension_reports_what_was_compiled():
    head_dims = flash_cutlass.compiled_head_dims()
    assert head_dims and set(head_dims) <= set(catalogue.ALL_HEAD_DIMS)
    assert list(head_dims) == sorted(head_dims)
    assert set(flash_cutlass.compiled_dtypes()) <= {torch.float16, torch.bfloat16}
    assert flash_cutlass.compiled_dtypes()
    archs = flash_cutlass.compiled_archs()
    assert archs and all(
        a.startswith(("sm_", "compute_")) and int(a.split("_")[1].removesuffix("a")) >= 80 for a in archs
    )
    sm90_head_dims = flash_cutlass.compiled_sm90_head_dims()
    assert list(sm90_head_dims) == sorted(sm90_head_dims)
    # The Hopper path is built exactly when the sm_90a target is, at every compiled head dim it has a
    # forward kernel for.
    sm90_backward_head_dims = flash_cutlass.compiled_sm90_backward_head_dims()
    if "sm_90a" in archs:
        assert set(sm90_head_dims) == set(head_dims) & set(catalogue.HEAD_DIMS[("forward", "sm90")])
        backward = set(head_dims) & set(catalogue.HEAD_DIMS[("backward", "sm90")])
        assert set(sm90_backward_head_dims) == (backward if flash_cutlass.compiled_backward() else set())
    else:
        assert not sm90_head_dims and not sm90_backward_head_dims
    assert isinstance(flash_cutlass.compiled_window(), bool)
    assert isinstance(flash_cutlass.compiled_backward(), bool)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_tensors_run_the_reference(gen, causal):
    q, k, v = qkv(gen=gen)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
    ref_out, ref_lse = naive_attention(q, k, v, 32 ** -0.5, causal, compute_dtype=torch.float64)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 33)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_cpu_head_dim_not_multiple_of_8(gen):
    q, k, v = qkv(head_dim=20, gen=gen)
    out, lse = flash_cutlass.flash_forward(q, k, v, softmax_scale=0.5)
    ref_out, _ = naive_attention(q, k, v, 0.5, False, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)


def test_inputs_off_a_16_byte_boundary_are_copied_to_aligned_memory(gen):
    # The kernels load 16 bytes at a time: a contiguous view whose data starts 2 bytes into an
    # allocation goes to them as an aligned copy (t.contiguous() would hand back t itself).
    shifted = off_16_bytes(torch.randn(2, 8, 4, 16, generator=gen).to(torch.bfloat16))
    copy = _aligned(shifted)
    assert copy.data_ptr() % 16 == 0 and copy.is_contiguous() and torch.equal(copy, shifted)
    aligned = torch.randn(2, 8, 4, 16, generator=gen).to(torch.bfloat16)
    assert _aligned(aligned) is aligned


def test_cpu_empty_inputs():
    q, k, v = qkv(batch=0)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    assert out.shape == q.shape and lse.shape == (0, 4, 33)


def expect(error, match, q, k, v, **kwargs):
    with pytest.raises(error, match=match):
        flash_cutlass.flash_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rejects_unsupported_dtypes(dtype, which):
    tensors = dict(zip("qkv", qkv()))
    tensors[which] = tensors[which].to(dtype) if dtype.is_floating_point else tensors[which].to(dtype)
    if which == "q":
        expect(TypeError, r"^q must be float16 or bfloat16, got torch\.", **tensors)
    else:
        expect(TypeError, rf"^{which} must be float16 or bfloat16", **tensors)


def test_rejects_mixed_dtypes():
    q, k, v = qkv()
    expect(TypeError, r"^k has dtype torch.float16 but q has torch.bfloat16", q, k.half(), v)
    expect(TypeError, r"^v has dtype torch.float16 but q has torch.bfloat16", q, k, v.half())


def test_rejects_mixed_devices():
    q, k, v = qkv()
    expect(ValueError, r"^k is on meta but q is on cpu", q, k.to("meta"), v)
    expect(ValueError, r"^v is on meta but q is on cpu", q, k, v.to("meta"))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rejects_wrong_rank(which):
    tensors = dict(zip("qkv", qkv()))
    tensors[which] = tensors[which][0]
    expect(ValueError, rf"^{which} must have 4 dimensions \(batch, seqlen, heads, head_dim\)", **tensors)


def test_rejects_non_tensors():
    q, k, v = qkv()
    expect(TypeError, r"^v must be a torch.Tensor, got list", q, k, [1.0])


def test_rejects_head_dim_over_256():
    q, k, v = qkv(head_dim=264)
    expect(ValueError, r"^head_dim must be between 1 and 256, got 264", q, k, v)


def test_rejects_heads_not_multiple_of_heads_k():
    q, k, v = qkv(heads=6, heads_k=4)
    expect(ValueError, r"heads of q \(6\) must be a multiple of the heads of k and v \(heads_k = 4\)", q, k, v)


def test_rejects_mismatched_batch():
    q, k, v = qkv()
    expect(ValueError, r"^k and v must have q's batch size 2, got k 1", q, k[:1], v[:1])


def test_rejects_mismatched_head_dim():
    q, k, v = qkv()
    expect(ValueError, r"^k and v must have q's head_dim 32, got k 24 and v 32", q, k[..., :24], v)
    expect(ValueError, r"^k and v must have q's head_dim 32, got k 32 and v 24", q, k, v[..., :24])


def test_rejects_v_shape_unlike_k():
    q, k, v = qkv()
    expect(ValueError, r"^v must have k's \(batch, seqlen_k, heads_k\)", q, k, v[:, :5])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rejects_non_contiguous_last_dimension(which):
    tensors = dict(zip("qkv", qkv()))
    t = tensors[which]
    tensors[which] = torch.cat([t, t], dim=-1)[..., ::2]
    expect(ValueError, rf"^{which} must have a contiguous last dimension \(stride 1\), got stride 2", **tensors)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_rejects_bad_softmax_scale(scale):
    expect(ValueError, r"^softmax_scale must be finite and > 0", *qkv(), softmax_scale=scale)


def test_rejects_a_softmax_scale_past_float32_once_times_log2e():
    """The kernels take softmax_scale * log2(e) in fp32: 3e38 is a finite float32, its product is not."""
    expect(ValueError, r"^softmax_scale must be at most 2\.359e\+38 \(times log2\(e\) it must stay a finite float32\), "
           r"got 3e\+38", *qkv(), softmax_scale=3e38)


@pytest.mark.parametrize("name", ["softmax_scale", "softcap", "dropout_p"])
def test_rejects_ints_past_the_float_range_naming_the_argument(name):
    # float(10**400) raises OverflowError, which is neither TypeError nor ValueError.
    check_rejected_by_every_entry_point(ValueError, rf"^{name} must be finite, got a value too large for a float",
                                        **{name: 10**400})


def test_rejects_non_float_softmax_scale():
    expect(TypeError, r"^softmax_scale must be a float or None, got str", *qkv(), softmax_scale="0.1")


def test_rejects_non_bool_causal():
    expect(TypeError, r"^causal must be a bool, got int", *qkv(), causal=1)


@pytest.mark.parametrize("kernel", ["sm70", "SM90", "", 90])
def test_rejects_unknown_kernel(kernel):
    expect(ValueError, r"^kernel must be None or one of 'auto', 'sm80', 'sm90', got", *qkv(), kernel=kernel)


def test_rejects_unknown_kernel_in_the_environment(monkeypatch):
    monkeypatch.setenv("FLASH_CUTLASS_FORWARD_KERNEL", "fastest")
    expect(ValueError, r"^FLASH_CUTLASS_FORWARD_KERNEL must be one of auto, sm80, sm90, got 'fastest'", *qkv())


@pytest.mark.parametrize("kernel", [None, "auto", "sm80", "sm90"])
def test_cpu_tensors_accept_every_kernel_choice(gen, kernel):
    q, k, v = qkv(gen=gen)
    out, _ = flash_cutlass.flash_forward(q, k, v, kernel=kernel)
    ref_out, _ = naive_attention(q, k, v, 32 ** -0.5, False, compute_dtype=torch.float64)
    assert (out.double() - ref_out).abs().max() < 2e-2


def test_rejects_gpus_older_than_sm80():
    with pytest.raises(RuntimeError, match=r"compute capability 8.0 or newer .* cuda:0 has 7.5"):
        check_compute_capability((7, 5), ("sm_80", "sm_90"), "cuda:0")


def test_rejects_gpus_the_build_has_no_code_for():
    with pytest.raises(RuntimeError, match=r"built for sm_80, which cannot run on cuda:0 .*FLASH_CUTLASS_CUDA_ARCHS=90"):
        check_compute_capability((9, 0), ("sm_80",), "cuda:0")


@pytest.mark.parametrize(
    "capability,archs",
    [((8, 0), ("sm_80",)), ((8, 6), ("sm_80",)), ((9, 0), ("sm_80", "sm_90")), ((10, 0), ("sm_90", "compute_90")),
     ((9, 0), ("sm_80", "sm_90a", "compute_90")), ((10, 0), ("sm_90a", "compute_90"))],
)
def test_accepts_gpus_the_build_can_run_on(capability, archs):
    check_compute_capability(capability, archs, "cuda:0")


def test_architecture_specific_code_runs_only_on_its_own_capability():
    # sm_90a machine code (the Hopper path's target) is not forward compatible, unlike sm_90.
    with pytest.raises(RuntimeError, match=r"built for sm_90a, which cannot run on cuda:0 \(compute capability 9.1\)"):
        check_compute_capability((9, 1), ("sm_90a",), "cuda:0")


def backward_args(gen=None):
    q, k, v = qkv(gen=gen)
    out, lse = flash_cutlass.flash_forward(q, k, v)
    return {"dout": torch.randn(q.shape, generator=gen).to(q.dtype), "q": q, "k": k, "v": v, "out": out, "lse": lse}


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda a: a.update(dout=a["dout"][:, :-1]), ValueError, r"^dout must have q's shape"),
        (lambda a: a.update(out=a["out"].float()), TypeError, r"^out must be float16 or bfloat16"),
        (lambda a: a.update(lse=a["lse"].double()), TypeError, r"^lse must be float32"),
        (lambda a: a.update(lse=a["lse"][:, :, :-1]), ValueError, r"^lse must have shape \(batch, heads, seqlen_q\)"),
        (lambda a: a.update(lse=a["lse"].tolist()), TypeError, r"^lse must be a torch.Tensor"),
        (lambda a: a.update(dout=a["dout"].half()), TypeError, r"^dout has dtype torch.float16 but q has"),
    ],
)
def test_backward_rejects_bad_input(gen, change, error, message):
    args = backward_args(gen)
    change(args)
    with pytest.raises(error, match=message):
        flash_cutlass.flash_backward(**args)


def test_backward_rejects_non_bool_deterministic(gen):
    with pytest.raises(TypeError, match=r"^deterministic must be a bool"):
        flash_cutlass.flash_backward(**backward_args(gen), deterministic=1)


@pytest.mark.parametrize("kernel", ["sm70", "", 90])
def test_backward_rejects_unknown_kernel(gen, kernel):
    with pytest.raises(ValueError, match=r"^kernel must be None or one of 'auto', 'sm80', 'sm90', got"):
        flash_cutlass.flash_backward(**backward_args(gen), kernel=kernel)


def test_backward_rejects_unknown_kernel_in_the_environment(gen, monkeypatch):
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", "fastest")
    with pytest.raises(ValueError, match=r"^FLASH_CUTLASS_BACKWARD_KERNEL must be one of auto, sm80, sm90"):
        flash_cutlass.flash_backward(**backward_args(gen))


def test_flash_attention_rejects_non_bool_causal(gen):
    with pytest.raises(TypeError, match=r"^causal must be a bool, got int"):
        flash_cutlass.flash_attention(*qkv(gen=gen), causal=1)


def test_flash_attention_rejects_non_bool_deterministic(gen):
    with pytest.raises(TypeError, match=r"^deterministic must be a bool, got int"):
        flash_cutlass.flash_attention(*qkv(gen=gen), deterministic=1)


def test_cpu_attention_gradients_match_fp64_autograd(gen):
    q, k, v = (t.requires_grad_() for t in qkv(gen=gen))
    out = flash_cutlass.flash_attention(q, k, v, causal=True)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = naive_attention(*leaves, 32 ** -0.5, True, compute_dtype=torch.float64)
    expected = torch.autograd.grad(ref_out, leaves, dout.double())
    for grad, ref, t in zip(grads, expected, (q, k, v)):
        assert grad.dtype == t.dtype and grad.shape == t.shape
        assert (grad.double() - ref).abs().max() < 5e-2

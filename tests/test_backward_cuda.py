"""The CUDA backward kernel against the fp32 oracle, with FlashAttention-2's pass rule.

Skipped (with the reason) where no CUDA GPU is visible.
"""

import math
import re

import pytest
import torch

import flash_cutlass
from flash_cutlass.reference import naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, COMPILED_SM90_HEAD_DIMS, SMEM_163_KIB, SMEM_99_KIB,
                     SMEM_PER_BLOCK_ENV, fa2_check, kernel_unavailable, off_16_bytes, requires_backward,
                     requires_cuda, sm80_left_out_on_hopper, small_tiles_unavailable)

pytestmark = [requires_cuda, requires_backward]

BACKWARD_KERNELS = ("sm80", "sm90")


def skip_unless_backward_runs(kernel: str, head_dim: int) -> None:
    reason = kernel_unavailable(kernel, head_dim, "backward")
    if reason:
        pytest.skip(reason)


HEADS = 8
SEQLENS = [(1, 1), (17, 17), (113, 255), (255, 113), (256, 256), (1023, 1023), (1, 2049), (2049, 17)]
GQA_HEADS_K = {"mha": HEADS, "gqa4": HEADS // 4, "mqa": 1}


def gradients(q, k, v, dout, scale, causal, compute_dtype):
    """Gradients of naive attention by autograd, computed in compute_dtype (None: the inputs')."""
    leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*leaves, scale, causal)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def check_gradients(grads, q, k, v, dout, scale, causal, label):
    """fa2_check of (dq, dk, dv) against the fp32 oracle, and their shapes and dtypes."""
    oracle = gradients(q, k, v, dout, scale, causal, torch.float32)
    same_dtype = gradients(q, k, v, dout, scale, causal, None)
    for name, grad, ref, base, t in zip("qkv", grads, oracle, same_dtype, (q, k, v)):
        assert grad.shape == t.shape and grad.dtype == t.dtype, f"{label} d{name}"
        fa2_check(grad, ref, base, f"{label} d{name}")


@pytest.mark.parametrize("gqa", list(GQA_HEADS_K))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
def test_backward_matches_oracle(cuda_gen, kernel, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    if dtype not in COMPILED_DTYPES:
        pytest.skip(f"{dtype} was not compiled into this build (FLASH_CUTLASS_DTYPES)")
    skip_unless_backward_runs(kernel, head_dim)
    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    q = rand(batch, seqlen_q, HEADS, head_dim)
    k, v = rand(batch, seqlen_k, GQA_HEADS_K[gqa], head_dim), rand(batch, seqlen_k, GQA_HEADS_K[gqa], head_dim)
    dout = rand(batch, seqlen_q, HEADS, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel="sm80")
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel)
    check_gradients(grads, q, k, v, dout, scale, causal, f"{kernel} backward")


def test_autograd_matches_flash_backward(cuda_gen):
    head_dim = COMPILED_HEAD_DIMS[-1]
    dtype = COMPILED_DTYPES[-1]
    q, k, v = (torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype).requires_grad_()
               for _ in range(3))
    out = flash_cutlass.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    out2, lse = flash_cutlass.flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
    expected = flash_cutlass.flash_backward(dout, q.detach(), k.detach(), v.detach(), out2, lse, causal=True)
    for leaf, grad in zip((q, k, v), expected):
        torch.testing.assert_close(leaf.grad, grad, atol=1e-2, rtol=1e-2)


def test_autograd_passes_deterministic_to_the_backward(cuda_gen):
    head_dim = COMPILED_HEAD_DIMS[0]
    dtype = COMPILED_DTYPES[-1]
    q, k, v = (torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype) for _ in range(3))
    dout = torch.randn(2, 300, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(flash_cutlass.flash_attention(*leaves, causal=True, deterministic=True), leaves, dout)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    expected = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for name, grad, ref in zip("qkv", grads, expected):
        assert torch.equal(grad, ref), f"d{name} of flash_attention(deterministic=True) differs"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)
def test_deterministic_mode_is_bitwise_reproducible_and_correct(cuda_gen, head_dim, causal):
    dtype = COMPILED_DTYPES[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    q, k, v = rand(2, 777, 8, head_dim), rand(2, 1023, 2, head_dim), rand(2, 1023, 2, head_dim)
    dout = rand(2, 777, 8, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
    first = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    second = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two deterministic runs differ"
    check_gradients(first, q, k, v, dout, head_dim ** -0.5, causal, "deterministic")


def hopper_forward_unavailable() -> str:
    if not COMPILED_SM90_HEAD_DIMS:
        return "the Hopper forward path was not built"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Hopper forward path needs compute capability 9.0"
    return ""


@pytest.mark.parametrize("forward_kernel", ["sm80", "sm90"])
def test_backward_of_either_forward_path(cuda_gen, forward_kernel):
    if forward_kernel == "sm90":
        if hopper_forward_unavailable():
            pytest.skip(hopper_forward_unavailable())
        head_dim = COMPILED_SM90_HEAD_DIMS[0]
    else:
        head_dim = COMPILED_HEAD_DIMS[0]
    dtype = COMPILED_DTYPES[-1]
    q, k, v, dout = (torch.randn(2, 333, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype) for _ in range(4))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, kernel=forward_kernel)
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True)
    check_gradients(grads, q, k, v, dout, head_dim ** -0.5, True, f"after the {forward_kernel} forward")


@pytest.mark.parametrize("head_dim", [20, 40, 80, 200])
@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
def test_backward_head_dims_between_compiled_sizes(cuda_gen, kernel, head_dim):
    if head_dim > max(COMPILED_HEAD_DIMS):
        pytest.skip(f"head_dim {head_dim} exceeds the compiled head dims {COMPILED_HEAD_DIMS}")
    skip_unless_backward_runs(kernel, head_dim)
    dtype = COMPILED_DTYPES[0]
    q, dout = (torch.randn(2, 129, 4, head_dim, generator=cuda_gen, device="cuda").to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 77, 2, head_dim, generator=cuda_gen, device="cuda").to(dtype) for _ in range(2))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, kernel=kernel)
    assert all(g.is_contiguous() for g in grads)
    check_gradients(grads, q, k, v, dout, head_dim ** -0.5, True, f"head_dim {head_dim}")


def test_backward_of_strided_slices_equals_contiguous(cuda_gen):
    head_dim = COMPILED_HEAD_DIMS[0]
    dtype = COMPILED_DTYPES[-1]
    qkv = torch.randn(2, 301, 3, 6, head_dim, generator=cuda_gen, device="cuda").to(dtype)
    q, k, v = qkv.unbind(dim=2)
    dout = torch.randn(2, 301, 6, 2 * head_dim, generator=cuda_gen, device="cuda").to(dtype)[..., :head_dim]
    assert not q.is_contiguous() and not dout.is_contiguous()
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    strided = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    contiguous = flash_cutlass.flash_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                              out, lse, causal=True, deterministic=True)
    for name, a, b in zip("qkv", strided, contiguous):
        assert torch.equal(a, b), f"d{name} of strided inputs differs from that of their contiguous copies"
    check_gradients(strided, q, k, v, dout, head_dim ** -0.5, True, "packed qkv")


@pytest.mark.parametrize("which", ["dout", "q", "k", "v", "out", "lse"])
@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
def test_backward_inputs_off_a_16_byte_boundary_give_the_aligned_gradients(cuda_gen, kernel, which):
    # Contiguous, but with data one element past a 16-byte boundary: copied by the call, the
    # gradients are those of the aligned tensors (bitwise in the sm80 path's deterministic mode;
    # the Hopper path's dQ adds in an order that may change between runs, and its dK/dV of the two
    # query heads of each K/V head add onto zero: either order gives the same sum).
    head_dim = 64 if 64 in COMPILED_HEAD_DIMS else COMPILED_HEAD_DIMS[0]
    skip_unless_backward_runs(kernel, head_dim)
    dtype = COMPILED_DTYPES[-1]
    q, k, v, dout = (torch.randn(2, seqlen, heads, head_dim, generator=cuda_gen, device="cuda").to(dtype)
                     for seqlen, heads in ((300, 4), (257, 2), (257, 2), (300, 4)))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    deterministic = kernel == "sm80"
    expected = flash_cutlass.flash_backward(**tensors, causal=True, deterministic=deterministic, kernel=kernel)
    tensors[which] = off_16_bytes(tensors[which])
    grads = flash_cutlass.flash_backward(**tensors, causal=True, deterministic=deterministic, kernel=kernel)
    for name, grad, reference in zip(("dq", "dk", "dv"), grads, expected):
        if name == "dq" and not deterministic:
            torch.testing.assert_close(grad.float(), reference.float(), atol=2e-2, rtol=2e-2, msg=name)
        else:
            assert torch.equal(grad, reference), name


def test_backward_of_empty_inputs():
    head_dim = COMPILED_HEAD_DIMS[0]
    dtype = COMPILED_DTYPES[-1]
    for batch, seqlen_q, seqlen_k in ((0, 16, 16), (2, 0, 16), (2, 16, 0)):
        q = torch.randn(batch, seqlen_q, 4, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(batch, seqlen_k, 2, head_dim, device="cuda", dtype=dtype)
        out, lse = flash_cutlass.flash_forward(q, k, k)
        dq, dk, dv = flash_cutlass.flash_backward(torch.ones_like(out), q, k, k, out, lse)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        for grad in (dq, dk, dv):
            assert not grad.any(), "gradients of an empty attention must be zero"


def test_backward_memory_is_linear_in_seqlen(cuda_gen):
    # seqlen 8192, 8 heads: a score matrix would take 8 * 8192^2 * 4 bytes = 2 GiB; the backward's
    # own buffers (the gradients, fp32 dQ accumulator, D) take under 100 MiB.
    head_dim = 128 if 128 in COMPILED_HEAD_DIMS else COMPILED_HEAD_DIMS[-1]
    dtype = COMPILED_DTYPES[-1]
    q, k, v, dout = (torch.randn(1, 8192, 8, head_dim, generator=cuda_gen, device="cuda").to(dtype)
                     for _ in range(4))
    out, lse = flash_cutlass.flash_forward(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    input_bytes = q.numel() * q.element_size()
    assert peak <= 8 * input_bytes, f"backward allocated {peak} bytes at its peak, inputs are {input_bytes} each"
    del grads


def test_forced_hopper_backward_where_it_cannot_run_raises(cuda_gen):
    # Where the Hopper backward is not built for the head dim or the GPU is not compute capability 9.0.
    head_dim = COMPILED_HEAD_DIMS[-1]
    if not kernel_unavailable("sm90", head_dim, "backward"):
        pytest.skip("the Hopper backward runs every compiled head dim here")
    q = torch.randn(1, 64, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q)
    with pytest.raises(RuntimeError, match="kernel='sm90' cannot run this backward: "):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm90")


def test_backward_kernel_environment_variable(cuda_gen, monkeypatch):
    head_dim = COMPILED_HEAD_DIMS[0]
    q = torch.randn(1, 100, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q)
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", "sm80")
    by_env = flash_cutlass.flash_backward(out, q, q, q, out, lse, deterministic=True)
    monkeypatch.delenv("FLASH_CUTLASS_BACKWARD_KERNEL")
    forced = flash_cutlass.flash_backward(out, q, q, q, out, lse, deterministic=True, kernel="sm80")
    for a, b in zip(by_env, forced):
        assert torch.equal(a, b)
    monkeypatch.setenv("FLASH_CUTLASS_BACKWARD_KERNEL", "fast")
    with pytest.raises(ValueError, match="FLASH_CUTLASS_BACKWARD_KERNEL must be one of"):
        flash_cutlass.flash_backward(out, q, q, q, out, lse)


# The sm80 backward's tiers (sm80/bwd_kernel.h, BwdTilesOf) under a block limit of 99 KiB: every
# head dim runs smaller tiles than its usual ones but 192 (32 x 64) and 256 (32 x 32) run smaller
# still; under 163 KiB (the A100) only 256 does (64 x 64, one Q buffer).
SMALLER_TILE_CASES = ([pytest.param(SMEM_99_KIB, d, id=f"99KiB-{d}") for d in COMPILED_HEAD_DIMS] +
                      [pytest.param(SMEM_163_KIB, 256, id="163KiB-256")] * (256 in COMPILED_HEAD_DIMS))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("gqa", ["mha", "gqa4"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (113, 255), (255, 113), (1023, 1023)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("smem_limit,head_dim", SMALLER_TILE_CASES)
def test_sm80_tiles_for_smaller_shared_memory_match_oracle(cuda_gen, monkeypatch, smem_limit, head_dim, causal,
                                                           seqlen_q, seqlen_k, gqa, deterministic):
    """The sm80 backward on the tiles a GPU of 99 KiB (or 163 KiB) a block picks, forced here by
    the extension's cap on a block's shared memory, with the tails of their 32- or 64-row and 32-,
    64- or 128-key blocks, against the fp32 oracle."""
    reason = small_tiles_unavailable()
    if reason:
        pytest.skip(reason)
    dtype = COMPILED_DTYPES[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    q = rand(2, seqlen_q, HEADS, head_dim)
    k, v = rand(2, seqlen_k, GQA_HEADS_K[gqa], head_dim), rand(2, seqlen_k, GQA_HEADS_K[gqa], head_dim)
    dout = rand(2, seqlen_q, HEADS, head_dim)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel="sm80")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(smem_limit))
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel="sm80",
                                         deterministic=deterministic)
    if deterministic:
        again = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel="sm80",
                                             deterministic=True)
        for a, b in zip(grads, again):
            assert torch.equal(a, b), "two deterministic runs on the smaller tiles differ"
    check_gradients(grads, q, k, v, dout, head_dim ** -0.5, causal, f"sm80 backward under {smem_limit} bytes")


@pytest.mark.parametrize("value", ["yes", "0", "-4096", "99K", "1e5"])
def test_smem_limit_variable_is_checked(cuda_gen, monkeypatch, value):
    head_dim = COMPILED_HEAD_DIMS[0]
    q = torch.randn(1, 100, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, value)
    with pytest.raises(ValueError, match=f"{SMEM_PER_BLOCK_ENV} must be a positive number of bytes, got '{value}'"):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm80")


def test_smem_limit_below_every_tier_is_refused_before_any_launch(cuda_gen, monkeypatch):
    head_dim = COMPILED_HEAD_DIMS[-1]
    q = torch.randn(1, 100, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(32 * 1024))
    with pytest.raises(RuntimeError, match="KiB of shared memory per block, but .* allows 32 KiB"):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm80")


def test_smaller_tiles_left_out_of_the_sm90a_code_are_refused_before_any_launch(cuda_gen, monkeypatch):
    """A Hopper GPU made to pick the sm80 backward's smaller tiles by FLASH_CUTLASS_SMEM_PER_BLOCK,
    in a build whose sm_90a code leaves them out: an error naming the build flag, no launch (an
    empty kernel would leave the gradients unwritten)."""
    if not small_tiles_unavailable():
        pytest.skip("this GPU runs the smaller tiles of this build")
    head_dim = COMPILED_HEAD_DIMS[-1]
    q = torch.randn(1, 100, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(SMEM_99_KIB))
    with pytest.raises(RuntimeError, match="allows 99 KiB of shared memory a block \\(FLASH_CUTLASS_SMEM_PER_BLOCK\\); "
                                           "this build leaves them out of its sm_90a code: rebuild with "
                                           "FLASH_CUTLASS_SM90_SMALL_TILES=1"):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm80")


def test_sm80_path_left_out_of_the_sm90a_code_is_refused_before_any_launch(cuda_gen):
    """kernel="sm80" on a Hopper GPU at a head dim the Hopper path has, in a build whose sm_90a code
    leaves the sm80 path out there (FLASH_CUTLASS_SM80_ON_HOPPER=0): an error naming the build flag
    for the forward and the backward, no launch; the automatic choice runs the call."""
    head_dim = max(COMPILED_SM90_HEAD_DIMS, default=0)
    if not head_dim or not sm80_left_out_on_hopper(head_dim, "forward"):
        pytest.skip("this GPU runs the sm80 path at every head dim of this build")
    q = torch.randn(1, 100, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    refusal = (f"kernel='sm80' at head dim {head_dim} on cuda:\\d+ \\(the argument, or FLASH_CUTLASS_{{}}_KERNEL\\): "
               "this build leaves the sm80 path's {} at the Hopper path's head dims out of its sm_90a code, .*"
               "rebuild with FLASH_CUTLASS_SM80_ON_HOPPER=1")
    with pytest.raises(RuntimeError, match=refusal.format("FORWARD", "forward")):
        flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    out, lse = flash_cutlass.flash_forward(q, q, q)
    assert sm80_left_out_on_hopper(head_dim, "backward")
    with pytest.raises(RuntimeError, match=refusal.format("BACKWARD", "backward")):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm80")
    dq, dk, dv = flash_cutlass.flash_backward(out, q, q, q, out, lse)
    assert all(bool(t.isfinite().all()) for t in (dq, dk, dv))


def sm80_backward_kernel_names(run) -> set:
    """The names (demangled, with their tile template arguments) of the sm80 backward kernels that
    run() launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        run()
        torch.cuda.synchronize()
    return {event.name for event in profiler.events() if "flash_bwd_sm80" in event.name}


# (head dim, block limit, the launched kernel's BwdKernelTraits arguments as a pattern).
TIER_KERNELS = [
    (128, None, r"<128,\s*64,\s*128\b"),
    (128, SMEM_99_KIB, r"<128,\s*64,\s*64,\s*2,\s*4,\s*4,\s*[\w:]+,\s*1>"),
    (192, SMEM_99_KIB, r"<192,\s*32,\s*64\b"),
    (256, None, r"<256,\s*64,\s*64,\s*4,\s*2,\s*2,\s*[\w:]+,\s*2>"),
    (256, SMEM_163_KIB, r"<256,\s*64,\s*64,\s*4,\s*2,\s*2,\s*[\w:]+,\s*1>"),
    (256, SMEM_99_KIB, r"<256,\s*32,\s*32\b"),
]


@pytest.mark.parametrize("head_dim,smem_limit,pattern", TIER_KERNELS)
def test_smem_limit_launches_the_tier_that_fits(cuda_gen, monkeypatch, head_dim, smem_limit, pattern):
    """The kernel launched under each limit has the tiles of the first tier that fits it (the
    oracle tests alone would pass on any tier)."""
    if head_dim not in COMPILED_HEAD_DIMS:
        pytest.skip(f"head dim {head_dim} was not compiled into this build")
    if smem_limit is None and torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 200 * 1024:
        pytest.skip("the usual tiles at these head dims need more shared memory than this GPU allows a block")
    reason = small_tiles_unavailable() if smem_limit is not None else ""
    if reason:
        pytest.skip(reason)
    q = torch.randn(1, 300, 2, head_dim, generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    if smem_limit is None:
        monkeypatch.delenv(SMEM_PER_BLOCK_ENV, raising=False)
    else:
        monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(smem_limit))
    names = sm80_backward_kernel_names(lambda: flash_cutlass.flash_backward(out, q, q, q, out, lse, kernel="sm80"))
    assert names and all(re.search("BwdKernelTraits" + pattern, name) for name in names), names

"""Shared test utilities: the CUDA skip marker, what the build compiled, and the FlashAttention-2
pass rule."""

import importlib.util
import math
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_cutlass

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (sm_80 or newer); none is visible",
)

ROOT = Path(__file__).resolve().parents[1]


# The extension's cap on a block's shared memory (csrc/flash_api.cpp, emulated_smem_per_block): set,
# one GPU picks the kernels of a GPU that allows a block less. 99 KiB: sm_86, sm_89, sm_120; 163 KiB:
# the A100.
SMEM_PER_BLOCK_ENV = "FLASH_CUTLASS_SMEM_PER_BLOCK"
SMEM_99_KIB = 99 * 1024
SMEM_163_KIB = 163 * 1024


def small_tiles_unavailable() -> str:
    """Why this GPU cannot run the sm80 backward's smaller tiles that FLASH_CUTLASS_SMEM_PER_BLOCK makes
    it pick, or '': a Hopper GPU runs this build's sm_90a code, which holds them only when built with
    FLASH_CUTLASS_SM90_SMALL_TILES=1."""
    from flash_cutlass.backend import compiled_sm80_small_tiles_on_hopper

    if torch.cuda.get_device_capability() != (9, 0) or compiled_sm80_small_tiles_on_hopper():
        return ""
    return ("this build leaves the sm80 backward's smaller tiles out of its sm_90a code (build with "
            "FLASH_CUTLASS_SM90_SMALL_TILES=1 to run them on a Hopper GPU)")


def load_catalogue():
    """csrc/catalogue.py, the one list of what can be compiled (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("flash_cutlass_catalogue", ROOT / "csrc" / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


catalogue = load_catalogue()
try:
    COMPILED_HEAD_DIMS = flash_cutlass.compiled_head_dims()
    COMPILED_SM90_HEAD_DIMS = flash_cutlass.compiled_sm90_head_dims()
    COMPILED_SM90_BACKWARD_HEAD_DIMS = flash_cutlass.compiled_sm90_backward_head_dims()
    COMPILED_DTYPES = flash_cutlass.compiled_dtypes()
except RuntimeError:
    # The extension is not built: the GPU tests that parametrize over these skip anyway.
    COMPILED_HEAD_DIMS = catalogue.HEAD_DIMS[("forward", "sm80")]
    COMPILED_SM90_HEAD_DIMS = catalogue.HEAD_DIMS[("forward", "sm90")]
    COMPILED_SM90_BACKWARD_HEAD_DIMS = catalogue.HEAD_DIMS[("backward", "sm90")]
    COMPILED_DTYPES = tuple(getattr(torch, name) for _, name in catalogue.DTYPES.values())


def has_kernels(compiled) -> bool:
    """compiled() of the extension (flash_cutlass.compiled_alibi, compiled_window, ...): whether this
    build has those kernels; True without an extension, whose GPU tests skip anyway."""
    try:
        return compiled()
    except RuntimeError:
        return True


def over_compiled_kernels(test):
    """Parametrizes a GPU test over (kernel, dtype, head_dim): both paths, fp16 and bf16 (a dtype the
    build left out skips) and every compiled head dim."""
    dtypes = [pytest.param(dtype, id=name, marks=pytest.mark.skipif(
        dtype not in COMPILED_DTYPES, reason=f"{dtype} was not compiled into this build (FLASH_CUTLASS_DTYPES)"))
        for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"))]
    test = pytest.mark.parametrize("kernel", ("sm80", "sm90"))(test)
    test = pytest.mark.parametrize("dtype", dtypes)(test)
    return pytest.mark.parametrize("head_dim", COMPILED_HEAD_DIMS)(test)


def host_tool(name: str, tmp_path: Path) -> Path:
    """tools/<name>.cu compiled for the host with nvcc against the CUTLASS headers the build would
    use (setup.py's cutlass_include_dirs); skips the test where nvcc or the headers are missing."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    setup_globals = runpy.run_path(str(ROOT / "setup.py"), run_name="flash_cutlass_setup")
    try:
        includes = setup_globals["cutlass_include_dirs"]()
    except RuntimeError as error:
        pytest.skip(str(error))
    binary = tmp_path / name
    build = subprocess.run([nvcc, "-std=c++17", *(f"-I{d}" for d in includes), f"-I{ROOT / 'include'}",
                            str(ROOT / "tools" / f"{name}.cu"), "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return binary


def load_script(folder: str, name: str):
    """<folder>/<name>.py (benchmarks/ or tools/) imported as the module `name` (the scripts are not
    a package)."""
    path = ROOT / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def backward_left_out() -> str:
    """Why this build has no backward kernels (FLASH_CUTLASS_BACKWARD=0), or '' when it has them."""
    try:
        compiled = flash_cutlass.compiled_backward()
    except RuntimeError:  # no extension: the GPU tests skip anyway
        return ""
    return "" if compiled else "this build left the backward kernels out (FLASH_CUTLASS_BACKWARD=0)"


# GPU tests that run a backward kernel.
requires_backward = pytest.mark.skipif(bool(backward_left_out()), reason=backward_left_out() or "the backward is built")


# What the extension's refusals of a call this build left a piece out for end with (csrc/flash_api.cpp:
# an option's kernels, the sm80 path at the Hopper path's head dims, the smaller sm80 tiles, ...);
# tests/conftest.py reports a test that meets one as skipped, with its message.
BUILD_LEAVE_OUT_MARK = "rebuild with FLASH_CUTLASS_"


def sm80_left_out_on_hopper(head_dim: int, direction: str) -> str:
    """Why this Hopper GPU cannot run the sm80 path's `direction` at `head_dim`, or '': the sm_90a code
    holds it at the Hopper path's head dims only when built with FLASH_CUTLASS_SM80_ON_HOPPER=1."""
    from flash_cutlass.backend import compiled_sm80_every_head_dim_on_hopper

    if torch.cuda.get_device_capability() != (9, 0) or compiled_sm80_every_head_dim_on_hopper():
        return ""
    sm80_dim = min((d for d in COMPILED_HEAD_DIMS if d >= head_dim), default=0)
    hopper_dims = COMPILED_SM90_HEAD_DIMS if direction == "forward" else COMPILED_SM90_BACKWARD_HEAD_DIMS
    if sm80_dim not in hopper_dims:
        return ""
    return (f"this build leaves the sm80 {direction} at head dim {sm80_dim} out of its sm_90a code ("
            "FLASH_CUTLASS_SM80_ON_HOPPER=1 keeps it)")


def kernel_unavailable(kernel: str, head_dim: int, direction: str) -> str:
    """Why `kernel` ('sm80' or 'sm90') cannot run the `direction` ('forward' or 'backward') of a
    head dim on this GPU and build, or '' when it can."""
    if direction == "backward":
        left_out = backward_left_out()
        if left_out:
            return left_out
    if kernel == "sm80":
        return sm80_left_out_on_hopper(head_dim, direction)
    if not COMPILED_SM90_HEAD_DIMS:
        return "the Hopper path was not built"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Hopper path needs compute capability 9.0"
    limit = max(COMPILED_SM90_HEAD_DIMS if direction == "forward" else COMPILED_SM90_BACKWARD_HEAD_DIMS, default=0)
    if head_dim > limit:
        return f"head_dim {head_dim} is above the Hopper {direction}'s largest head dim {limit}"
    return ""


def options_left_out(window_size=(-1, -1), softcap=0.0, alibi=False, dropout_p=0.0) -> str:
    """Why this build cannot run a GPU call with these options (the build flags that left their
    kernels out), or '' when it can."""
    needed = (("FLASH_CUTLASS_WINDOW", tuple(window_size) != (-1, -1), flash_cutlass.compiled_window),
              ("FLASH_CUTLASS_SOFTCAP", softcap > 0, flash_cutlass.compiled_softcap),
              ("FLASH_CUTLASS_ALIBI", alibi, flash_cutlass.compiled_alibi),
              ("FLASH_CUTLASS_DROPOUT", dropout_p > 0, flash_cutlass.compiled_dropout))
    missing = [flag for flag, wanted, compiled in needed if wanted and not compiled()]
    return f"this build left their kernels out ({', '.join(f + '=0' for f in missing)})" if missing else ""


def off_16_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element (2 bytes of fp16/bf16, 4 of fp32) past a
    16-byte boundary: only its data pointer is unaligned, not its strides."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    shifted = storage[1:].view(t.shape).copy_(t)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    return shifted


def worse_baseline(oracle: torch.Tensor, *candidates: torch.Tensor) -> torch.Tensor:
    """The candidate baseline for :func:`fa2_check` farthest from ``oracle`` (max abs difference)."""
    return max(candidates, key=lambda c: (c.detach().float().to(oracle.device) - oracle.float()).abs().max().item())


def fa2_check(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    torch_same_dtype: torch.Tensor,
    name: str,
    eps: float = 1e-5,
) -> None:
    """Assert FlashAttention-2's pass rule for one result tensor.

    ``max|actual - oracle| <= 2 * max|torch_same_dtype - oracle| + eps``, where
    ``oracle`` is computed in fp32 or fp64 and ``torch_same_dtype`` is PyTorch
    computing the same thing in the kernel's input dtype. All three are compared
    in fp32. Positions where the oracle is not finite (the ``-inf`` log-sum-exp
    of a row that attends no key) must hold exactly the same value in ``actual``
    and are left out of both maxima. Any NaN in ``actual`` fails.
    """
    assert actual.shape == oracle.shape == torch_same_dtype.shape, (
        f"{name}: shapes differ: actual {tuple(actual.shape)}, oracle {tuple(oracle.shape)}, "
        f"torch_same_dtype {tuple(torch_same_dtype.shape)}"
    )
    # Compared where the oracle lives (on the GPU for kernel tests): no host copies of big tensors.
    actual = actual.detach().float().to(oracle.device)
    oracle = oracle.detach().float()
    baseline = torch_same_dtype.detach().float().to(oracle.device)

    assert not oracle.isnan().any(), f"{name}: the oracle contains NaN"
    nan_count = int(actual.isnan().sum())
    assert nan_count == 0, f"{name}: actual contains {nan_count} NaN value(s)"

    finite = oracle.isfinite()
    special = ~finite
    mismatched = int((actual[special] != oracle[special]).sum())
    assert mismatched == 0, (
        f"{name}: {mismatched} position(s) where the oracle is +-inf "
        "hold a different value in actual"
    )
    bad_actual = int((~actual[finite].isfinite()).sum())
    assert bad_actual == 0, (
        f"{name}: actual is not finite at {bad_actual} position(s) where the oracle is"
    )
    bad_baseline = int((~baseline[finite].isfinite()).sum())
    assert bad_baseline == 0, (
        f"{name}: torch_same_dtype is not finite at {bad_baseline} position(s) "
        "where the oracle is; the pass rule has no meaningful bound"
    )

    if not finite.any():
        return
    err = (actual - oracle).abs().where(finite, 0.0)
    base_err = float((baseline - oracle).abs().where(finite, 0.0).max())
    max_err = float(err.max())
    bound = 2.0 * base_err + eps
    if max_err > bound:
        worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{name}: max|actual - oracle| = {max_err:.3e} exceeds "
            f"2 * max|torch_same_dtype - oracle| + eps = 2 * {base_err:.3e} + {eps:.1e} "
            f"= {bound:.3e}; worst at index {worst}: "
            f"actual {float(actual[worst]):.6g}, oracle {float(oracle[worst]):.6g}"
        )


def check_kernels_against_oracle(kernel: str, q, k, v, dout, causal: bool, **options) -> None:
    """Runs flash_forward and flash_backward of `kernel` ('sm80' or 'sm90'; a forward the Hopper
    path cannot run takes the sm80 path) on CUDA inputs with the keyword `options` (window_size,
    softcap, alibi_slopes, dropout_p with rng_state) and checks out, lse and the three gradients
    against the fp32 oracle
    (reference.naive_attention and its autograd) by FlashAttention-2's pass rule. Skips the
    backward, after checking the forward, where `kernel` has no backward for this head dim."""
    from flash_cutlass.reference import naive_attention

    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    oracle_out, oracle_lse = naive_attention(q, k, v, scale, causal, torch.float32, **options)
    same_out, same_lse = naive_attention(q, k, v, scale, causal, **options)

    forward_kernel = "sm80" if kernel_unavailable(kernel, head_dim, "forward") else kernel
    out, lse, *_ = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=forward_kernel, **options)
    fa2_check(out, oracle_out, same_out, f"{forward_kernel} forward out")
    fa2_check(lse, oracle_lse, same_lse, f"{forward_kernel} forward lse")

    reason = kernel_unavailable(kernel, head_dim, "backward")
    if reason:
        pytest.skip(reason)

    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel, **options)
    check_gradients_against_oracle(f"{kernel} backward", grads, q, k, v, dout, causal, out=out, lse=lse, **options)


def check_gradients_against_oracle(name: str, grads, q, k, v, dout, causal: bool, out=None, lse=None,
                                   **options) -> None:
    """(dq, dk, dv) of a call on CUDA inputs with the keyword `options` against the gradients of
    the fp32 oracle (reference.naive_attention's autograd) by FlashAttention-2's pass rule; with
    sinks, grads end with dsinks, checked by check_sinks_gradient against the call's out and lse
    (which must then be given). The messages start with `name`."""
    from flash_cutlass.reference import naive_attention

    scale = 1.0 / math.sqrt(q.shape[-1])
    sinks = options.pop("sinks", None)
    assert len(grads) == (3 if sinks is None else 4), f"{name}: {len(grads)} gradients"

    def oracle_of(compute_dtype):
        leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        # The sinks as the oracle's own parameter: in fp32, or in their own dtype for the baseline.
        sink_leaves = [] if sinks is None else [sinks.detach().to(compute_dtype or sinks.dtype).requires_grad_()]
        attended, attended_lse = naive_attention(*leaves, scale, causal, **options,
                                                 **({"sinks": sink_leaves[0]} if sink_leaves else {}))
        grads = torch.autograd.grad(attended, leaves + sink_leaves, dout.to(attended.dtype))
        return attended.detach(), attended_lse, grads

    oracle_out, oracle_lse, oracle_grads = oracle_of(torch.float32)
    slack = (0.0, 0.0, 0.0) if sinks is None else rounded_out_slack(q, k, dout, out, oracle_out, scale, causal,
                                                                    sinks, options)
    for letter, grad, ref, base, extra in zip("qkv", grads, oracle_grads, oracle_of(None)[2], slack):
        fa2_check(grad, ref, base, f"{name} d{letter}", eps=1e-5 + extra)
    if sinks is not None:
        check_sinks_gradient(f"{name} dsinks", grads[3], dout, out, lse, sinks, oracle_out, oracle_lse,
                             oracle_grads[3])


def rounded_out_slack(q, k, dout, out, oracle_out, scale, causal, sinks, options):
    """What out's rounding adds to dq and dk of a call with sinks (0 for dv), each as its largest
    element: the backward takes out as given, and D = rowsum(dout * out) then differs from the
    oracle's by delta_i, which moves dq_i by scale * delta_i * (P K)_i and dk_j by
    scale * sum_i P_ij delta_i q_i (P the oracle's probabilities). Without sinks these terms are
    what PyTorch's own rounding makes too; with a sink, a row of one or a few keys has a large out
    and little else, and FlashAttention-2's rule against PyTorch alone fails a correct gradient
    (1.4x seen at seqlen 1). Rows with the dropout mask use the probabilities before it, as dS
    does. The terms are computed with the oracle in fp32, at 1.01x."""
    from flash_cutlass.reference import naive_attention

    device = oracle_out.device
    q32, k32 = (t.detach().float().to(device) for t in (q, k))
    dout32 = dout.detach().float().to(device)
    delta = (dout32 * (out.detach().float().to(device) - oracle_out.float())).sum(-1, keepdim=True)
    score_options = {key: value for key, value in options.items() if key not in ("dropout_p", "rng_state")}
    sink_leaf = {"sinks": sinks.detach().float().to(device)}
    # K as the values: the attention's output is P K, its gradient in the values P^T (delta * q).
    values = k32.clone().requires_grad_()
    probs_times_keys, _ = naive_attention(q32, k32, values, scale, causal, torch.float32, **score_options,
                                          **sink_leaf)
    (probs_t_delta_q,) = torch.autograd.grad(probs_times_keys, values, delta * q32)
    return (1.01 * scale * (delta * probs_times_keys.detach()).abs().max().item(),
            1.01 * scale * probs_t_delta_q.abs().max().item(), 0.0)


def check_sinks_gradient(name, dsinks, dout, out, lse, sinks, oracle_out, oracle_lse, oracle_dsinks) -> None:
    """dsinks against the oracle's, within what the out and lse it is computed from allow.

    dsinks_h = -sum over the rows of head h of exp(sink_h - lse) * D, D = rowsum(dout * out): a
    sum over every row of values computed from out rounded to bf16/fp16, whose relative error
    (2^-9 and more) does not average out in D as attention's rounding does in autograd's
    softmax gradient; FlashAttention-2's rule against PyTorch in the same dtype can then fail by
    far (10x seen) with a correct formula. So the bound is that error carried through the formula:
    sum_i P_sink,i (sum_d |dout_id| |out_id - oracle_out_id| + |D_i| |lse_i - oracle_lse_i|), plus
    fp32 summation, at 1.01x; a wrong sign, factor, head or row would exceed it. Layouts: (batch,
    seqlen, heads, d) with lse (batch, heads, seqlen), or packed (total, heads, d) with (heads, total).
    out and lse (flash_cutlass's, already checked against the oracle by the FA2 rule) and the
    oracle's in fp32."""
    assert dsinks.shape == sinks.shape and dsinks.dtype == sinks.dtype, f"{name}: shape or dtype"
    device = oracle_dsinks.device
    dout, out, oracle_out = (t.detach().float().to(device) for t in (dout, out, oracle_out))
    lse, oracle_lse = lse.detach().float().to(device), oracle_lse.detach().float().to(device)
    rows_last = (lambda t: t.transpose(-1, -2))  # (..., seqlen, heads) -> lse's layout
    row_sinks = sinks.detach().float().to(device).view(1, -1, 1) if lse.dim() == 3 else \
        sinks.detach().float().to(device).view(-1, 1)
    seen = torch.isfinite(oracle_lse)
    p_sink = torch.where(seen, torch.exp(row_sinks - torch.where(seen, oracle_lse, 0.0)), 0.0)
    delta = rows_last((dout * out).sum(-1))
    delta_error = rows_last((dout.abs() * (out - oracle_out).abs()).sum(-1))
    lse_error = torch.where(seen, (lse - oracle_lse).abs(), 0.0)
    terms = p_sink * (delta_error + delta.abs() * lse_error)
    summation = 1e-5 * (p_sink * delta.abs())
    reduce = (lambda t: t.sum(dim=(0, 2))) if lse.dim() == 3 else (lambda t: t.sum(dim=1))
    bound = 1.01 * reduce(terms + summation) + 1e-6
    error = (dsinks.float().to(device) - oracle_dsinks.float()).abs()
    assert (error <= bound).all(), (f"{name}: |dsinks - oracle| = {error.tolist()} exceeds the bound carried from "
                                    f"out's and lse's errors, {bound.tolist()} (dsinks {dsinks.tolist()}, oracle "
                                    f"{oracle_dsinks.tolist()})")


def window_keep(sq: int, sk: int, causal: bool, window) -> torch.Tensor:
    """keep[i, j] of a causal mask and window, built one element at a time from the documented
    rule (d = sk - sq: i sees j iff i + d - left <= j <= i + d + right, -1 unbounded, causal sets
    right to 0)."""
    left, right = window
    if causal:
        right = 0
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diagonal = i + sk - sq
            keep[i, j] = (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)
    return keep


def explicit_attention_fp64(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                            dropout_keep=None, dropout_p=0.0, sinks=None):
    """out and lse of (batch, seqlen, heads, head_dim) attention with every option written out
    from its documented rule, independently of flash_cutlass.reference: the soft cap, ALiBi's
    distances and the mask element by element, dropout from an explicit keep mask (batch, heads,
    sq, sk), sinks (heads,) as one more column of each row's softmax that is dropped after it.
    Computes in the inputs' dtype (fp64 in the tests); rows without keys (nor a sink) give 0, -inf."""
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    group = heads // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        distance = torch.zeros(sq, sk, dtype=scores.dtype)
        for i in range(sq):
            for j in range(sk):
                distance[i, j] = abs(i + sk - sq - j)
        slopes = alibi_slopes.to(scores.dtype).expand(batch, heads)
        scores = scores - slopes[:, :, None, None] * distance
    scores = scores.masked_fill(~window_keep(sq, sk, causal, window), -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, sq, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_keep is not None:
        probs = torch.where(dropout_keep, probs / (1 - dropout_p), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vr), lse


def make_qkv_fp64(gen, sq, sk, heads, heads_k, head_dim, dtype=torch.float64, spread=1.0):
    """q (2, sq, heads, head_dim), k and v (2, sk, heads_k, head_dim): normal * spread, as dtype."""
    def rand(*shape):
        return (spread * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    return rand(2, sq, heads, head_dim), rand(2, sk, heads_k, head_dim), rand(2, sk, heads_k, head_dim)


def check_reference_backward(gen, q, k, v, scale, causal, oracle_options, reference_options):
    """The reference's tiled backward (flash_cutlass.reference.attention_backward, key blocks of
    16) against fp64 autograd of explicit_attention_fp64, for q, k, v in fp64. oracle_options go to
    explicit_attention_fp64, reference_options to the reference's forward and backward."""
    from flash_cutlass.reference import attention_backward, attention_forward

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = explicit_attention_fp64(*leaves, scale, causal, **oracle_options)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(out, leaves, dout)
    ref_out, lse = attention_forward(q, k, v, scale, causal, **reference_options)
    grads = attention_backward(dout, q, k, v, ref_out, lse, scale, causal, block_size=16, **reference_options)
    for name, grad, ref in zip("qkv", grads, expected):
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=1e-10, msg=lambda m: f"d{name}: {m}")


def cuda_inputs(gen, dtype, seqlen_q, seqlen_k, heads, heads_k, head_dim, spread=1.0):
    """q, k, v and dout of the GPU oracle grids, normal times spread, drawn on gen's device: batch
    2, or 1 once the score matrix passes 2^20 entries."""
    def rand(*shape):
        return (spread * torch.randn(*shape, generator=gen, device=gen.device)).to(dtype)

    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1
    return (rand(batch, seqlen_q, heads, head_dim), rand(batch, seqlen_k, heads_k, head_dim),
            rand(batch, seqlen_k, heads_k, head_dim), rand(batch, seqlen_q, heads, head_dim))


def check_rejected_by_every_entry_point(error, match, backward_options=None, **options):
    """flash_forward, flash_backward and flash_attention each raise `error` with a message matching
    `match` on a small CPU call with the keyword `options` (flash_backward gets backward_options
    too, e.g. the rng_state it needs with dropout)."""
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_cutlass.flash_forward(q, q, q)
    with pytest.raises(error, match=match):
        flash_cutlass.flash_forward(q, q, q, **options)
    with pytest.raises(error, match=match):
        flash_cutlass.flash_backward(out, q, q, q, out, lse, **options, **(backward_options or {}))
    with pytest.raises(error, match=match):
        flash_cutlass.flash_attention(q, q, q, **options)


def capture_graph(function, generators=(), synchronize=True):
    """function() run once on a side stream (the warm-up that capturing autograd needs), then
    captured: (the graph, function's outputs, which each replay rewrites). `generators` other than
    the default one are registered with the graph. `synchronize`: wait for the device after the
    capture (below)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        outputs = function()
    # torch before 2.13 resets each registered generator's graph offset with a fill on the capture
    # stream before capturing, which nothing orders before the first replay's fill of the real
    # offset on the replaying stream. Under load, first replays have differed from the eager call
    # in part of their dropout mask: the suspected cause (tools/graph_dropout_replays.py, which
    # captures without this wait, tells). Waiting here orders the two, as the README asks users.
    if synchronize:
        torch.cuda.synchronize()
    return graph, outputs

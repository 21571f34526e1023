"""Runs a validated call: the compiled CUDA extension for CUDA tensors, the pure-PyTorch reference
for CPU tensors. Its callers (flash_cutlass.interface and the custom ops in flash_cutlass.ops)
have checked the tensors and built the AttentionOptions; nothing here checks them again, except
the data of a variable-length call's lengths, which only this layer reads (on CPU, or with
$FLASH_CUTLASS_CHECK_VARLEN=1).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from flash_cutlass import reference
from flash_cutlass.options import AttentionOptions, draw_rng_state, draws_in_kernel

try:
    from flash_cutlass import _C
except ImportError as error:  # the package stays importable (CPU path) without the build
    _C = None
    _EXTENSION_ERROR: Optional[ImportError] = error
else:
    _EXTENSION_ERROR = None

_ALIGN_ELEMS = 8  # 16 bytes of fp16/bf16: the width of every global memory access


def _extension():
    if _C is None:
        package = Path(__file__).resolve().parent
        if not any(package.glob("_C*.so")) and not any(package.glob("_C*.pyd")):
            reason = (f"this copy of flash_cutlass ({package}) has no compiled _C module: build it in place with "
                      "pip install --no-build-isolation -e . (a copy installed without -e is shadowed when Python "
                      "imports flash_cutlass from the source tree, e.g. pytest run from the checkout)")
        else:
            reason = f"its _C module failed to load ({_EXTENSION_ERROR}); rebuild with pip install --no-build-isolation -e ."
        raise RuntimeError(f"flash_cutlass's CUDA extension is not available: {reason}")
    return _C


@functools.lru_cache(maxsize=None)
def compiled_head_dims() -> Tuple[int, ...]:
    """Head dims compiled into the extension; a call runs in the smallest one >= its head_dim."""
    return tuple(_extension().compiled_head_dims())


@functools.lru_cache(maxsize=None)
def compiled_sm90_head_dims() -> Tuple[int, ...]:
    """Head dims of the Hopper path's forward (TMA + wgmma, sm_90 only) in this build; empty without it."""
    return tuple(_extension().compiled_sm90_head_dims())


@functools.lru_cache(maxsize=None)
def compiled_sm90_backward_head_dims() -> Tuple[int, ...]:
    """Head dims of the Hopper path's backward in this build; empty without it."""
    return tuple(_extension().compiled_sm90_backward_head_dims())


@functools.lru_cache(maxsize=None)
def compiled_backward() -> bool:
    """Whether this build has the backward kernels (FLASH_CUTLASS_BACKWARD)."""
    return bool(_extension().compiled_backward)


@functools.lru_cache(maxsize=None)
def compiled_sm80_small_tiles_on_hopper() -> bool:
    """Whether a Hopper GPU can run the sm80 backward's smaller tiles, those of GPUs that allow a
    block less shared memory, which only FLASH_CUTLASS_SMEM_PER_BLOCK makes it pick: this build's
    sm_90a code holds them only with FLASH_CUTLASS_SM90_SMALL_TILES=1 (code for sm_90 or PTX always)."""
    return bool(_extension().compiled_sm80_small_tiles_on_hopper)


@functools.lru_cache(maxsize=None)
def compiled_sm80_every_head_dim_on_hopper() -> bool:
    """Whether a Hopper GPU can run the sm80 path at every compiled head dim, which only
    kernel="sm80" asks of it where the Hopper path has the head dim: this build's sm_90a code holds
    those only with FLASH_CUTLASS_SM80_ON_HOPPER=1 (code for sm_90 or PTX always)."""
    return bool(_extension().compiled_sm80_every_head_dim_on_hopper)


@functools.lru_cache(maxsize=None)
def compiled_window() -> bool:
    """Whether this build has the sliding-window kernels (window_size=; FLASH_CUTLASS_WINDOW)."""
    return bool(_extension().compiled_window)


@functools.lru_cache(maxsize=None)
def compiled_softcap() -> bool:
    """Whether this build runs softcap= (the extended kernels; FLASH_CUTLASS_SOFTCAP)."""
    return bool(_extension().compiled_softcap)


@functools.lru_cache(maxsize=None)
def compiled_alibi() -> bool:
    """Whether this build runs alibi_slopes= (the extended kernels; FLASH_CUTLASS_ALIBI)."""
    return bool(_extension().compiled_alibi)


@functools.lru_cache(maxsize=None)
def compiled_dropout() -> bool:
    """Whether this build runs dropout_p= (the extended kernels; FLASH_CUTLASS_DROPOUT)."""
    return bool(_extension().compiled_dropout)


@functools.lru_cache(maxsize=None)
def compiled_kvcache() -> bool:
    """Whether this build has the KV-cache kernels (flash_attention_with_kvcache; FLASH_CUTLASS_KVCACHE)."""
    return bool(_extension().compiled_kvcache)


@functools.lru_cache(maxsize=None)
def compiled_kvcache_head_dims() -> Tuple[int, ...]:
    """Head dims of the KV-cache kernels in this build; a call runs in the smallest one >= its head_dim."""
    return tuple(_extension().compiled_kvcache_head_dims())


def kvcache_extension():
    """The extension, for flash_cutlass.kvcache's CUDA calls."""
    return _extension()


def check_kvcache_device(q: torch.Tensor) -> None:
    """Raises unless the build has KV-cache kernels for q's dtype and head dim that q's GPU can run."""
    if not compiled_kvcache():
        raise RuntimeError("flash_attention_with_kvcache needs the KV-cache kernels, which this build left out "
                           "(FLASH_CUTLASS_KVCACHE=0); rebuild with FLASH_CUTLASS_KVCACHE=1")
    _check_device(q)
    if not any(d >= q.shape[-1] for d in compiled_kvcache_head_dims()):
        raise RuntimeError(f"head_dim {q.shape[-1]} exceeds the KV-cache kernels' compiled head dims "
                           f"{compiled_kvcache_head_dims()}; rebuild with FLASH_CUTLASS_HEAD_DIMS including a larger one")


@functools.lru_cache(maxsize=None)
def compiled_dtypes() -> Tuple[torch.dtype, ...]:
    """Input dtypes compiled into the extension."""
    return tuple(getattr(torch, name) for name in _extension().compiled_dtypes())


@functools.lru_cache(maxsize=None)
def compiled_archs() -> Tuple[str, ...]:
    """Targets the kernels were compiled for, e.g. ('sm_80', 'sm_90a', 'compute_80')."""
    return tuple(a for a in _extension().compiled_archs.split(",") if a)


def forward_timeline(head_dim: int) -> torch.Tensor:
    """For developers: the clock64 timeline the Hopper-path forward kernels of head_dim (the
    compiled head dim that runs it) recorded since the last read, int64 (CTAs, steps, warpgroups,
    events), and clears it; needs a build with FLASH_CUTLASS_TIMELINE=1 (tools/timeline.py reads it)."""
    return _extension().forward_timeline(head_dim)


def check_compute_capability(capability: Tuple[int, int], archs: Tuple[str, ...], device: str = "cuda") -> None:
    """Raises unless a GPU of this compute capability can run kernels compiled for `archs`.

    Machine code for sm_XY runs on X.Y' with Y' >= Y, for sm_XYa only on X.Y; PTX for
    compute_XY JIT-compiles on any capability >= X.Y.
    """
    major, minor = capability
    if (major, minor) < (8, 0):
        raise RuntimeError(
            f"flash_cutlass needs a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper); "
            f"{device} has {major}.{minor}"
        )
    for arch in archs:
        kind, _, number = arch.partition("_")
        specific = number.endswith("a")
        number = number.removesuffix("a")
        arch_major, arch_minor = int(number[:-1]), int(number[-1])
        if kind == "sm" and arch_major == major and (arch_minor == minor or (arch_minor < minor and not specific)):
            return
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return
    raise RuntimeError(
        f"flash_cutlass was built for {', '.join(archs)}, which cannot run on {device} "
        f"(compute capability {major}.{minor}); rebuild with FLASH_CUTLASS_CUDA_ARCHS={major}{minor}"
    )


def _check_device(q: torch.Tensor) -> None:
    if q.dtype not in compiled_dtypes():
        raise RuntimeError(
            f"dtype {q.dtype} was not compiled into this build (compiled: {compiled_dtypes()}); "
            "rebuild with FLASH_CUTLASS_DTYPES including it"
        )
    _check_device_capability(q.device)


@functools.lru_cache(maxsize=None)
def _check_device_capability(device: torch.device) -> None:
    """check_compute_capability for one device, once per process (it cannot change)."""
    check_compute_capability(torch.cuda.get_device_capability(device), compiled_archs(), str(device))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself if every global access can be 16 bytes wide, else a contiguous copy in a new
    allocation (16-byte aligned; t.contiguous() would return a contiguous t whose data starts off
    a 16-byte boundary as it is)."""
    strides_ok = all(s % _ALIGN_ELEMS == 0 or n <= 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    if strides_ok and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a multiple of 8 (zero columns are added in that case); the C++
    side runs it in the smallest compiled head dim that holds it."""
    padded = -(-head_dim // _ALIGN_ELEMS) * _ALIGN_ELEMS
    if any(compiled >= padded for compiled in compiled_head_dims()):
        return padded
    raise RuntimeError(
        f"head_dim {head_dim} needs a kernel of head dim >= {padded}, but this build compiled only "
        f"{compiled_head_dims()}; rebuild with FLASH_CUTLASS_HEAD_DIMS including a larger one"
    )


def _padded(tensors, head_dim: int):
    """The tensors with their head dim padded to what the kernels take, 16-byte aligned."""
    padded_head_dim = _padded_head_dim(head_dim)
    if padded_head_dim != head_dim:
        tensors = [torch.nn.functional.pad(t, (0, padded_head_dim - head_dim)) for t in tensors]
    return [_aligned(t) for t in tensors]


# Set to 1, every variable-length call on CUDA tensors reads its lengths on the host and checks
# them (a device synchronization a call): for debugging; CPU calls always check.
CHECK_VARLEN_ENV = "FLASH_CUTLASS_CHECK_VARLEN"


def _check_varlen_requested() -> bool:
    value = os.environ.get(CHECK_VARLEN_ENV, "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{CHECK_VARLEN_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _check_lengths(q: torch.Tensor, k: torch.Tensor, options: AttentionOptions) -> None:
    """Reads a variable-length call's lengths on the host and checks them: they must start at 0,
    never decrease and end at the token counts, and max_seqlen_q / max_seqlen_k must be at least
    the longest lengths. Raises ValueError naming the argument."""
    values = torch.cat([options.cu_seqlens_q, options.cu_seqlens_k]).tolist()
    count = options.cu_seqlens_q.shape[0]
    for name, total, tensor, max_name, max_len, starts in (
            ("cu_seqlens_q", q.shape[0], "q", "max_seqlen_q", options.max_seqlen_q, values[:count]),
            ("cu_seqlens_k", k.shape[0], "k", "max_seqlen_k", options.max_seqlen_k, values[count:])):
        if starts[0] != 0:
            raise ValueError(f"{name} must start at 0, got {starts[0]}")
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        if any(length < 0 for length in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {starts}")
        if starts[-1] != total:
            raise ValueError(f"{name} must end at the {total} tokens of {tensor}, got {starts[-1]}")
        longest = max(lengths, default=0)
        if max_len < longest:
            raise ValueError(f"{max_name} = {max_len} is below the longest sequence, {longest} tokens")


def _with_varlen_lengths(q: torch.Tensor, k: torch.Tensor, options: AttentionOptions) -> AttentionOptions:
    """The options of a variable-length call with contiguous cumulative lengths. CUDA calls read
    nothing on the host (no synchronization; CUDA graphs can capture them): the kernels' grid is
    max_seqlen_q / max_seqlen_k as given, and the kernels bound every sequence by the packed
    tensors and the grid (include/flash_cutlass/common/block_info.h, sequence_rows), so that wrong
    lengths give wrong results but no access outside the tensors. CPU calls, and CUDA calls with
    $FLASH_CUTLASS_CHECK_VARLEN=1, check the lengths (_check_lengths)."""
    if _check_varlen_requested() or q.device.type != "cuda":
        _check_lengths(q, k, options)
    return options.replace(cu_seqlens_q=options.cu_seqlens_q.contiguous(),
                           cu_seqlens_k=options.cu_seqlens_k.contiguous())


def _varlen_without_work(options: AttentionOptions) -> bool:
    """Whether the kernels of a variable-length call have nothing to do: no sequences, or
    max_seqlen_q or max_seqlen_k 0 (every sequence cut to no queries or no keys)."""
    return options.cu_seqlens_q.shape[0] == 1 or options.max_seqlen_q == 0 or options.max_seqlen_k == 0


def _reference_options(options: AttentionOptions) -> dict:
    return {"window_size": options.window_size, "softcap": options.softcap, "alibi_slopes": options.alibi_slopes,
            "dropout_p": options.dropout_p, "rng_state": options.rng_state}


def forward(q, k, v, options: AttentionOptions) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(out, lse, rng_state) of a checked call: q (batch, seqlen_q, heads, head_dim) and lse (batch,
    heads, seqlen_q), or in a variable-length call packed q (total_q, heads, head_dim) and lse
    (heads, total_q). rng_state is None without dropout, else the int64 (seed, offset) of the mask:
    options.rng_state itself when given; else drawn from options.generator, by the extension for
    CUDA tensors (draws_in_kernel: a tensor on q's device that the kernel writes, graph-safe) or
    on the host (a CPU tensor). With options.sinks, out and lse are those of attention with the sinks,
    which the reference and every forward kernel fold into each row's softmax."""
    if options.dropout_p > 0 and options.rng_state is None and not draws_in_kernel(q.device, options.generator):
        options = options.replace(rng_state=draw_rng_state(options.generator, q.device), generator=None)
    if options.is_varlen:
        options = _with_varlen_lengths(q, k, options)
        if q.device.type != "cuda":
            out, lse = reference.attention_forward_varlen(q, k, v, options.cu_seqlens_q, options.cu_seqlens_k,
                                                          options.softmax_scale, options.causal,
                                                          sinks=options.sinks, **_reference_options(options))
            return out.contiguous(), lse.contiguous(), options.rng_state
        out, lse, rng_state = _forward_cuda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), options,
                                            without_work=_varlen_without_work(options))
        return out[0], lse[0], rng_state
    if q.device.type != "cuda":
        out, lse = reference.attention_forward(q, k, v, options.softmax_scale, options.causal, sinks=options.sinks,
                                               **_reference_options(options))
        return out.contiguous(), lse.contiguous(), options.rng_state
    return _forward_cuda(q, k, v, options)


def _forward_cuda(q, k, v, options: AttentionOptions, without_work: bool = False):
    """The extension's forward on (batch, seqlen, heads, head_dim) tensors ((1, total, ...) views
    in a variable-length call, whose lse is then (1, heads, total_q)), and its rng_state.
    without_work: the kernels would compute nothing (_varlen_without_work); out is then 0 and lse
    -inf, as without keys."""
    _check_device(q)
    batch, seqlen_q, heads, head_dim = q.shape
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    rng_state = options.rng_state
    drawn_rng_state = None
    if options.dropout_p > 0 and rng_state is None:
        drawn_rng_state = rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
    if q.numel() == 0 or k.shape[1] == 0 or without_work:
        if drawn_rng_state is not None:
            drawn_rng_state.zero_()  # no probabilities: no mask to draw
        if q.numel() == 0:
            return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse, rng_state
        lse.fill_(-math.inf)
        if options.sinks is not None:  # a row that sees no key: its lse is the sink's
            lse.copy_(options.sinks.view(1, -1, 1).expand(lse.shape))
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), lse, rng_state
    q, k, v = _padded((q, k, v), head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _extension().forward(q, k, v, out, lse, drawn_rng_state, with_float_sinks(options))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim].contiguous()
    return out, lse, rng_state


def with_float_sinks(options: AttentionOptions) -> AttentionOptions:
    """options with its sinks as the kernels read them: fp32, contiguous."""
    sinks = options.sinks
    if sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()):
        return options
    return options.replace(sinks=sinks.float().contiguous())


def backward(dout, q, k, v, out, lse, options: AttentionOptions):
    """(dq, dk, dv, dsinks) of a checked call: the gradients shaped like q, k and v (packed in a
    variable-length call), and that of options.sinks (None without them), from the backward
    kernels' own D = rowsum(dout * out) on CUDA (reference.sinks_gradient_of_delta)."""
    rows = None
    if options.is_varlen:
        options = _with_varlen_lengths(q, k, options)
        # Rows past the last sequence, which the CUDA forward leaves unspecified, are left out.
        rows = options.cu_seqlens_q[-1]
        if q.device.type != "cuda":
            grads = reference.attention_backward_varlen(dout, q, k, v, out, lse, options.cu_seqlens_q,
                                                        options.cu_seqlens_k, options.softmax_scale, options.causal,
                                                        **_reference_options(options))
            grads, delta = tuple(g.contiguous() for g in grads), None
        else:
            *grads, delta = _backward_cuda(*(t.unsqueeze(0) for t in (dout, q, k, v, out, lse)), options)
            grads, delta = tuple(g[0] for g in grads), None if delta is None else delta[0]
    elif q.device.type != "cuda":
        grads = reference.attention_backward(dout, q, k, v, out, lse, options.softmax_scale, options.causal,
                                             **_reference_options(options))
        grads, delta = tuple(g.contiguous() for g in grads), None
    else:
        *grads, delta = _backward_cuda(dout, q, k, v, out, lse, options)
        grads = tuple(grads)
    if options.sinks is None:
        return (*grads, None)
    if delta is None:  # the reference's: D from dout and out here
        return (*grads, reference.sinks_gradient(dout, out, lse, options.sinks, rows))
    return (*grads, reference.sinks_gradient_of_delta(delta, lse, options.sinks, rows))


def _backward_cuda(dout, q, k, v, out, lse, options: AttentionOptions):
    """The extension's (dq, dk, dv) and, with sinks, the D = rowsum(dout * out) its kernels computed
    (laid out as lse; else None)."""
    _check_device(q)
    head_dim = q.shape[-1]
    dout, q, k, v, out = _padded((dout, q, k, v, out), head_dim)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = None
    if options.sinks is not None:
        delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        # The backward's kernels need no sinks: the forward's lse holds them.
        options = options.replace(sinks=None)
    _extension().backward(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, options, delta)
    if dq.shape[-1] != head_dim:
        dq, dk, dv = (g[..., :head_dim].contiguous() for g in (dq, dk, dv))
    return dq, dk, dv, delta

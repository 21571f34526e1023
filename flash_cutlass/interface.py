"""Argument checking and normalization for the public entry points.

Every rejected input raises before any kernel launch, with a message that names the argument
and says what is accepted. CUDA tensors run the compiled kernels; CPU tensors run the slow
pure-PyTorch path in flash_cutlass.reference with the same semantics.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional, Tuple

import torch

from flash_cutlass import reference

try:
    from flash_cutlass import _C
except ImportError as error:  # the package stays importable (CPU path) without the build
    _C = None
    _EXTENSION_ERROR: Optional[ImportError] = error
else:
    _EXTENSION_ERROR = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_ALIGN_ELEMS = 8  # 16 bytes of fp16/bf16: the width of every global memory access
# Kernels a call may ask for, and their codes in the extension's forward() and backward().
KERNELS = {"auto": 0, "sm80": 1, "sm90": 2}
KERNEL_ENV = "FLASH_CUTLASS_FORWARD_KERNEL"
BACKWARD_KERNEL_ENV = "FLASH_CUTLASS_BACKWARD_KERNEL"
# Philox offset one dropout call takes from a CUDA generator (its offsets advance in steps of 4).
_PHILOX_OFFSET_STEP = 4


def _extension():
    if _C is None:
        raise RuntimeError(
            "flash_cutlass's CUDA extension is not built or failed to load "
            f"({_EXTENSION_ERROR}); build it with: pip install --no-build-isolation -e ."
        )
    return _C


@functools.lru_cache(maxsize=None)
def compiled_head_dims() -> Tuple[int, ...]:
    """Head dims compiled into the extension; a call runs in the smallest one >= its head_dim."""
    return tuple(_extension().compiled_head_dims())


@functools.lru_cache(maxsize=None)
def compiled_sm90_head_dims() -> Tuple[int, ...]:
    """Head dims of the Hopper path (TMA + wgmma, sm_90 only) in this build; empty without it."""
    return tuple(_extension().compiled_sm90_head_dims())


def forward_timeline(head_dim: int) -> torch.Tensor:
    """For developers: the clock64 timeline the Hopper-path forward kernels of head_dim (the
    compiled head dim that runs it) recorded since the last read, int64 (CTAs, steps, warpgroups,
    events), and clears it; needs a build with FLASH_CUTLASS_TIMELINE=1 (tools/timeline.py
    reads it)."""
    return _extension().forward_timeline(head_dim)


@functools.lru_cache(maxsize=None)
def compiled_backward() -> bool:
    """Whether this build has the backward kernels (flash_backward on CUDA tensors and the gradient
    of flash_attention; FLASH_CUTLASS_BACKWARD)."""
    return bool(_extension().compiled_backward)


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
def compiled_dtypes() -> Tuple[torch.dtype, ...]:
    """Input dtypes compiled into the extension."""
    return tuple(getattr(torch, name) for name in _extension().compiled_dtypes())


@functools.lru_cache(maxsize=None)
def compiled_archs() -> Tuple[str, ...]:
    """Targets the kernels were compiled for, e.g. ('sm_80', 'sm_90a', 'compute_90')."""
    return tuple(a for a in _extension().compiled_archs.split(",") if a)


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


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}; "
            f"pass {name}.contiguous()"
        )


def kernel_choice(kernel: Optional[str], env: str = KERNEL_ENV) -> str:
    """The kernel a call asks for: `kernel` if given, else the environment variable `env`
    ($FLASH_CUTLASS_FORWARD_KERNEL or $FLASH_CUTLASS_BACKWARD_KERNEL), else 'auto'. Raises
    ValueError naming the argument (or the variable) for anything else."""
    if kernel is None:
        value = os.environ.get(env, "").strip() or "auto"
        if value not in KERNELS:
            raise ValueError(f"{env} must be one of {', '.join(KERNELS)}, got {value!r}")
        return value
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be None or one of {', '.join(repr(k) for k in KERNELS)}, got {kernel!r}")
    return kernel


def check_forward_inputs(q, k, v, softmax_scale, causal, window_size=(-1, -1)) -> Tuple[int, int]:
    """Validates the arguments of flash_forward; raises TypeError/ValueError naming the argument.
    Returns window_size as a (left, right) tuple of ints."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k and v must be on one device")
    batch, _, heads, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got k {k.shape[0]} and v {v.shape[0]}")
    if tuple(v.shape[:3]) != (batch, seqlen_k, heads_k):
        raise ValueError(f"v must have k's (batch, seqlen_k, heads_k) = {tuple(k.shape[:3])}, got {tuple(v.shape[:3])}")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's head_dim {head_dim}, got k {k.shape[3]} and v {v.shape[3]}")
    if head_dim == 0 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(
            f"the heads of q ({heads}) must be a multiple of the heads of k and v (heads_k = {heads_k}) "
            "for grouped-query attention"
        )
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return reference.check_window_size(window_size)


def check_softcap(softcap) -> float:
    """softcap as a float >= 0 (0: no soft-capping); raises TypeError or ValueError naming it."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: no soft-capping), got {softcap}")
    return float(softcap)


def check_alibi_slopes(alibi_slopes, q, batch: Optional[int] = None) -> Optional[torch.Tensor]:
    """alibi_slopes as given: None, or float32 of shape (heads,) or (batch, heads) on q's device
    (batch: q's, or the number of sequences of a variable-length call); raises TypeError or
    ValueError naming it otherwise."""
    batch = q.shape[0] if batch is None else batch
    alibi_slopes = reference.check_alibi_slopes(alibi_slopes, batch, q.shape[-2])
    if alibi_slopes is not None and alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}; they must be on one device")
    return alibi_slopes


class Varlen(NamedTuple):
    """A variable-length call's cumulative sequence lengths (int32, batch + 1 entries, on q's
    device) and longest lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> int:
    """The checks of a variable-length call that read no tensor data (so torch.compile traces
    them): packed q (total_q, heads, head_dim), k and v (total_k, heads_k, head_dim), int32 1-D
    cumulative lengths of batch + 1 entries on q's device, int max_seqlen_q / max_seqlen_k in
    [0, 2^31). Returns the batch size; raises TypeError or ValueError naming the argument."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim) in a variable-length "
                             f"call, got shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    for name, cu, max_name, max_len in (("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q),
                                        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; they must be on one device")
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(f"{max_name} must be an int, got {type(max_len).__name__}")
        if not 0 <= max_len < 2**31:
            raise ValueError(f"{max_name} must be in [0, 2^31), got {max_len}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same number of entries (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return cu_seqlens_q.shape[0] - 1


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Varlen:
    """check_varlen_shapes, then the lengths themselves, read on the host (one device
    synchronization for CUDA tensors): they must start at 0, never decrease and end at the token
    counts, and max_seqlen_q / max_seqlen_k must be at least the longest lengths. The returned
    Varlen carries the longest lengths themselves (the kernels' grid)."""
    check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    values = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()
    count = cu_seqlens_q.shape[0]
    longest = []
    for name, total, tensor, max_name, max_len, starts in (
            ("cu_seqlens_q", q.shape[0], "q", "max_seqlen_q", max_seqlen_q, values[:count]),
            ("cu_seqlens_k", k.shape[0], "k", "max_seqlen_k", max_seqlen_k, values[count:])):
        if starts[0] != 0:
            raise ValueError(f"{name} must start at 0, got {starts[0]}")
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        if any(length < 0 for length in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {starts}")
        if starts[-1] != total:
            raise ValueError(f"{name} must end at the {total} tokens of {tensor}, got {starts[-1]}")
        longest.append(max(lengths, default=0))
        if max_len < longest[-1]:
            raise ValueError(f"{max_name} = {max_len} is below the longest sequence, {longest[-1]} tokens")
    return Varlen(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), longest[0], longest[1])


def check_dropout_p(dropout_p) -> float:
    """dropout_p as a float in [0, 1); raises TypeError or ValueError naming it otherwise."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_rng_state(rng_state) -> Optional[torch.Tensor]:
    """rng_state as given: None, or an int64 CPU tensor (seed, offset) as flash_forward returns it
    with dropout; raises TypeError or ValueError naming it otherwise."""
    if rng_state is None:
        return None
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor or None, got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or rng_state.device.type != "cpu" or tuple(rng_state.shape) != (2,):
        raise ValueError(
            "rng_state must be an int64 CPU tensor of 2 elements (seed, offset), as flash_forward returns it, got "
            f"{rng_state.dtype} on {rng_state.device} of shape {tuple(rng_state.shape)}"
        )
    return rng_state


def draw_rng_state(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """The (seed, offset) of one dropout call, an int64 CPU tensor, from `generator` (default: the
    default generator of `device`). A CUDA generator gives its seed and current Philox offset and
    advances the offset, without synchronizing; a CPU generator gives a seed drawn from it and
    offset 0. Re-seeding the generator reproduces the same states, hence the same masks."""
    if generator is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        else:
            generator = torch.default_generator
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type == "cuda":
        seed = generator.initial_seed()
        offset = generator.get_offset()
        generator.set_offset(offset + _PHILOX_OFFSET_STEP)
    else:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        offset = 0
    seed = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits as an int64
    return torch.tensor([seed, offset], dtype=torch.int64)


def dropout_rng_state(dropout_p: float, generator, rng_state: Optional[torch.Tensor],
                      device: torch.device) -> Optional[torch.Tensor]:
    """The (seed, offset) state of a forward call: None without dropout, else rng_state as given
    or drawn from generator (draw_rng_state). Raises ValueError when both are given."""
    if generator is not None and rng_state is not None:
        raise ValueError("pass generator or rng_state, not both")
    if dropout_p == 0:
        return None
    return rng_state if rng_state is not None else draw_rng_state(generator, device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself if every global access can be 16 bytes wide, else a contiguous copy."""
    strides_ok = all(s % _ALIGN_ELEMS == 0 or n <= 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    if strides_ok and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a multiple of 8 (zero columns are added in that case); the C++
    side runs it in the smallest compiled head dim that holds it."""
    padded = -(-head_dim // _ALIGN_ELEMS) * _ALIGN_ELEMS
    for compiled in compiled_head_dims():
        if compiled >= padded:
            return padded
    raise RuntimeError(
        f"head_dim {head_dim} needs a kernel of head dim >= {padded}, but this build compiled only "
        f"{compiled_head_dims()}; rebuild with FLASH_CUTLASS_HEAD_DIMS including a larger one"
    )


def forward_into(q, k, v, out, lse, softmax_scale: float, causal: bool, kernel: str = "auto",
                 window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                 rng_state: Optional[torch.Tensor] = None, varlen: Optional[Varlen] = None) -> None:
    """Runs the CUDA forward kernel into preallocated out (like q) and lse (fp32, batch x heads x
    seqlen_q). q, k, v must already be valid kernel inputs: CUDA, head_dim a multiple of 8 and at
    most a compiled head dim, 16-byte aligned strides; a variable-length call (varlen) passes its
    packed tensors as (1, total, heads, head_dim) views and lse as (1, heads, total_q).
    flash_forward and flash_forward_varlen are the checked entry points."""
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    _extension().forward(q, k, v, out, lse, float(softmax_scale), bool(causal), int(window_size[0]),
                         int(window_size[1]), float(softcap), alibi_slopes, float(dropout_p), rng_state, cu_q, cu_k,
                         max_q, max_k, KERNELS[kernel])


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


def flash_forward(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                  kernel: Optional[str] = None, *, window_size: Tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None):
    """Exact attention forward: out = softmax(softmax_scale * q k^T) v, and its log-sum-exp.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim), with
    heads a multiple of heads_k (GQA/MQA); float16 or bfloat16, all on one device; the last
    dimension contiguous. softmax_scale defaults to 1/sqrt(head_dim). causal masks with the
    diagonal aligned to the bottom-right corner (query i sees key j iff j <= i + seqlen_k -
    seqlen_q). Returns out like q and lse, float32 (batch, heads, seqlen_q), the natural-log
    log-sum-exp of the scaled scores. A query row that sees no key gets out 0 and lse -inf.
    window_size = (left, right) is sliding-window (local) attention around the same diagonal:
    query i sees key j iff i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q; -1 leaves
    a side unbounded, and causal=True sets right to 0 (FlashAttention-2's semantics). softcap > 0
    soft-caps the scaled scores before any mask: softcap * tanh(softmax_scale * q.k / softcap)
    (0, the default, leaves them as they are). alibi_slopes (float32, (heads,) or (batch, heads),
    on q's device) adds ALiBi after the soft cap and before any mask: the score of query i and
    key j gets -slope * |i + seqlen_k - seqlen_q - j| (FlashAttention-2's ALiBi).

    dropout_p in [0, 1) drops each probability with that probability and scales the kept ones by
    1 / (1 - p) (lse stays that of the undropped softmax). The mask comes from Philox with a
    (seed, offset) drawn from `generator` (default: the device's default generator; see
    draw_rng_state), or from `rng_state` when given (not both). With dropout_p > 0 the call returns
    (out, lse, rng_state): pass rng_state to flash_backward, or back here to draw the same mask.

    kernel picks the CUDA kernel: 'auto' (the default, or $FLASH_CUTLASS_FORWARD_KERNEL when
    kernel is None) runs the Hopper path (TMA + wgmma) on compute capability 9.0 for the head dims
    it was built for (64, 96, 128, 192, 256, and the multiples of 8 below them that need no
    larger kernel), and the sm80 path otherwise; 'sm80' and 'sm90' force one (RuntimeError where the
    forced one cannot run the call). CPU tensors ignore it.
    """
    return _forward_entry(q, k, v, softmax_scale, causal, kernel, window_size, softcap, alibi_slopes, dropout_p,
                          generator, rng_state)


def flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                         softmax_scale: Optional[float] = None, causal: bool = False, kernel: Optional[str] = None, *,
                         window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                         generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None):
    """flash_forward of a batch of sequences of different lengths, packed without padding.

    q: (total_q, heads, head_dim), k and v: (total_k, heads_k, head_dim); sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32 cumulative lengths, batch + 1 entries starting at 0, on q's device; a sequence may be
    empty). max_seqlen_q and max_seqlen_k must be at least the longest lengths (the kernels' grid
    is sized by the longest lengths themselves).
    Each sequence attends only to itself, with causal masks and windows aligned to its own
    lengths. The other arguments are flash_forward's; alibi_slopes (batch, heads) give sequence b
    row b, and dropout draws sequence b's mask as batch entry b of flash_forward. Returns out like
    q and lse, float32 (heads, total_q) (and rng_state with dropout). The lengths are read on the
    host and checked: one device synchronization per call.
    """
    varlen = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    result = _forward_entry(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal, kernel,
                            window_size, softcap, alibi_slopes, dropout_p, generator, rng_state, varlen)
    return (result[0][0], result[1][0]) + tuple(result[2:])


def _forward_entry(q, k, v, softmax_scale, causal, kernel, window_size, softcap, alibi_slopes, dropout_p, generator,
                   rng_state, varlen: Optional[Varlen] = None):
    """The checks and RNG draw of flash_forward (and of flash_forward_varlen, on (1, total, ...)
    views), then the call: (out, lse) or (out, lse, rng_state)."""
    window_size = check_forward_inputs(q, k, v, softmax_scale, causal, window_size)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi_slopes(alibi_slopes, q, varlen.batch if varlen is not None else None)
    dropout_p = check_dropout_p(dropout_p)
    rng_state = check_rng_state(rng_state)
    kernel = kernel_choice(kernel)
    rng_state = dropout_rng_state(dropout_p, generator, rng_state, q.device)
    out, lse = forward_checked(q, k, v, softmax_scale, causal, kernel, window_size, softcap, alibi_slopes, dropout_p,
                               rng_state, varlen)
    return (out, lse, rng_state) if dropout_p > 0 else (out, lse)


def forward_checked(q, k, v, softmax_scale, causal, kernel, window_size, softcap, alibi_slopes, dropout_p,
                    rng_state, varlen: Optional[Varlen] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_forward after its checks, rng_state resolved (dropout_rng_state): (out, lse). A
    variable-length call passes (1, total, heads, head_dim) views and gets lse (1, heads, total_q)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    if q.device.type != "cuda":
        options = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes,
                   "dropout_p": dropout_p, "rng_state": rng_state}
        if varlen is not None:
            out, lse = reference.attention_forward_varlen(q[0], k[0], v[0], varlen.cu_seqlens_q, varlen.cu_seqlens_k,
                                                          scale, causal, **options)
            return out.unsqueeze(0).contiguous(), lse.unsqueeze(0).contiguous()
        out, lse = reference.attention_forward(q, k, v, scale, causal, **options)
        return out.contiguous(), lse.contiguous()

    _check_device(q)
    padded_head_dim = _padded_head_dim(head_dim)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse
    if seqlen_k == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), lse.fill_(-math.inf)
    if padded_head_dim != head_dim:
        pad = (0, padded_head_dim - head_dim)
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    forward_into(q, k, v, out, lse, scale, causal, kernel, window_size, softcap, alibi_slopes, dropout_p, rng_state,
                 varlen)
    if padded_head_dim != head_dim:
        out = out[..., :head_dim].contiguous()
    return out, lse


def check_backward_inputs(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                          window_size=(-1, -1)) -> Tuple[int, int]:
    """Validates the arguments of flash_backward; raises TypeError/ValueError naming the argument.
    Returns window_size as a (left, right) tuple of ints."""
    window_size = check_forward_inputs(q, k, v, softmax_scale, causal, window_size)
    for t, name in ((dout, "dout"), (out, "out")):
        _check_tensor(t, name)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32 (as flash_forward returns it), got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}; they must be on one device")
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {expected}, got {tuple(lse.shape)}")
    check_deterministic(deterministic)
    return window_size


def check_deterministic(deterministic) -> None:
    """Raises TypeError unless deterministic is a bool."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")


def flash_backward(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None, causal: bool = False,
                   deterministic: bool = False, kernel: Optional[str] = None, *,
                   window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   rng_state: Optional[torch.Tensor] = None):
    """Gradients of flash_forward: returns (dq, dk, dv) in the dtypes and shapes of q, k and v.

    dout and out are shaped like q; out and lse are what flash_forward returned for these inputs.
    softmax_scale, causal, window_size, softcap, alibi_slopes and dropout_p must be those of the
    forward call, and with dropout_p > 0, rng_state the one it returned (the same mask). deterministic=True
    sums dQ in a fixed order (a second kernel pass) instead of with atomics, so two runs give
    bitwise identical gradients. kernel picks the CUDA kernel as in flash_forward ($FLASH_CUTLASS_BACKWARD_KERNEL
    when None): 'auto' runs the Hopper backward on compute capability 9.0 for head dims up to 128
    without deterministic=True, and the sm80 path otherwise. CPU tensors run
    flash_cutlass.reference.attention_backward (always deterministic).
    """
    return _backward_entry(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, kernel, window_size, softcap,
                           alibi_slopes, dropout_p, rng_state)


def flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: Optional[float] = None, causal: bool = False,
                          deterministic: bool = False, kernel: Optional[str] = None, *,
                          window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                          alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                          rng_state: Optional[torch.Tensor] = None):
    """Gradients of flash_forward_varlen: (dq, dk, dv) shaped like the packed q, k and v. dout and
    out are shaped like q, lse is (heads, total_q) as flash_forward_varlen returned it; the other
    arguments are those of the forward call and of flash_backward."""
    varlen = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for t, name in ((dout, "dout"), (out, "out"), (lse, "lse")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for t, name in ((dout, "dout"), (out, "out")):
        if t.dim() != 3:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if lse.dim() != 2:
        raise ValueError(f"lse must be (heads, total_q) as flash_forward_varlen returns it, got {tuple(lse.shape)}")
    grads = _backward_entry(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                            lse.unsqueeze(0), softmax_scale, causal, deterministic, kernel, window_size, softcap,
                            alibi_slopes, dropout_p, rng_state, varlen)
    return tuple(g[0] for g in grads)


def _backward_entry(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, kernel, window_size, softcap,
                    alibi_slopes, dropout_p, rng_state, varlen: Optional[Varlen] = None):
    """flash_backward (and flash_backward_varlen, on (1, total, ...) views): checks, then the call."""
    window_size = check_backward_inputs(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_size)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi_slopes(alibi_slopes, q, varlen.batch if varlen is not None else None)
    dropout_p = check_dropout_p(dropout_p)
    rng_state = check_rng_state(rng_state)
    if dropout_p > 0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the one flash_forward returned with out and lse")
    if dropout_p == 0:
        rng_state = None
    kernel = kernel_choice(kernel, BACKWARD_KERNEL_ENV)
    head_dim = q.shape[3]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if q.device.type != "cuda":
        options = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes,
                   "dropout_p": dropout_p, "rng_state": rng_state}
        if varlen is not None:
            grads = reference.attention_backward_varlen(dout[0], q[0], k[0], v[0], out[0], lse[0], varlen.cu_seqlens_q,
                                                        varlen.cu_seqlens_k, scale, causal, **options)
            return tuple(g.unsqueeze(0).contiguous() for g in grads)
        grads = reference.attention_backward(dout, q, k, v, out, lse, scale, causal, **options)
        return tuple(g.contiguous() for g in grads)

    _check_device(q)
    padded_head_dim = _padded_head_dim(head_dim)
    if padded_head_dim != head_dim:
        pad = (0, padded_head_dim - head_dim)
        dout, q, k, v, out = (torch.nn.functional.pad(t, pad) for t in (dout, q, k, v, out))
    dout, q, k, v, out = (_aligned(t) for t in (dout, q, k, v, out))
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    _extension().backward(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, scale, causal, window_size[0],
                          window_size[1], softcap, alibi_slopes, dropout_p, rng_state, cu_q, cu_k, max_q, max_k,
                          deterministic, KERNELS[kernel])
    if padded_head_dim != head_dim:
        dq, dk, dv = (g[..., :head_dim].contiguous() for g in (dq, dk, dv))
    return dq, dk, dv

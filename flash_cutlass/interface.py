"""The public entry points: flash_forward, flash_backward, the autograd-enabled flash_attention and
their variable-length forms.

Each checks its tensors here and its other arguments into one AttentionOptions
(flash_cutlass.options), once, before any kernel launch, with messages that name the argument
and say what is accepted. flash_forward / flash_backward then run the call
(flash_cutlass.backend: the CUDA kernels, or the pure-PyTorch reference for CPU tensors);
flash_attention goes through the custom ops of flash_cutlass.ops, whose autograd formula is the
backward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from flash_cutlass import backend, ops, reference
from flash_cutlass.options import backward_options, forward_options

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


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


def with_contiguous_last_dim(t):
    """t, or a copy of it whose last dimension is contiguous: for the doors whose originals accept
    any strides (FlashAttention-2's functions copy such inputs; torch SDPA takes them)."""
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def check_forward_tensors(q, k, v) -> None:
    """Validates q, k and v of a forward call; raises TypeError/ValueError naming the argument."""
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


def check_cu_seqlens(cu_seqlens, name: str) -> None:
    """Validates the type, dtype and shape of cumulative sequence lengths (int32, batch + 1
    entries); raises TypeError/ValueError naming the argument."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}")


def check_backward_tensors(dout, q, k, v, out, lse) -> None:
    """Validates the tensors of a backward call; raises TypeError/ValueError naming the argument."""
    check_forward_tensors(q, k, v)
    for t, name in ((dout, "dout"), (out, "out")):
        _check_tensor(t, name)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        reference.check_device_of_q(t, name, q.device)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32 (as flash_forward returns it), got {lse.dtype}")
    reference.check_device_of_q(lse, "lse", q.device)
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {expected}, got {tuple(lse.shape)}")


def check_packed_tensors(q, k, v) -> None:
    """q, k and v of a variable-length call are tensors of 3 dimensions (total_tokens, heads,
    head_dim); raises TypeError/ValueError naming the argument."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim) in a variable-length "
                             f"call, got shape {tuple(t.shape)}")


def check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> int:
    """The checks of a variable-length call that read no tensor data (so torch.compile traces
    them): packed q (total_q, heads, head_dim), k and v (total_k, heads_k, head_dim), int32 1-D
    cumulative lengths of batch + 1 entries on q's device, int max_seqlen_q / max_seqlen_k in
    [0, 2^31). Returns the batch size; raises TypeError or ValueError naming the argument."""
    check_packed_tensors(q, k, v)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    for name, cu, max_name, max_len in (("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q),
                                        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k)):
        check_cu_seqlens(cu, name)
        reference.check_device_of_q(cu, name, q.device)
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(f"{max_name} must be an int, got {type(max_len).__name__}")
        if not 0 <= max_len < 2**31:
            raise ValueError(f"{max_name} must be in [0, 2^31), got {max_len}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same number of entries (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return cu_seqlens_q.shape[0] - 1


def _check_varlen_outputs(dout, out, lse, q) -> None:
    """The shapes of a variable-length backward's dout, out (like q) and lse (heads, total_q)."""
    for t, name in ((dout, "dout"), (out, "out"), (lse, "lse")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for t, name in ((dout, "dout"), (out, "out")):
        if t.dim() != 3:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if lse.dim() != 2:
        raise ValueError(f"lse must be (heads, total_q) as flash_forward_varlen returns it, got {tuple(lse.shape)}")


def _with_rng_state(out, lse, rng_state, options):
    return (out, lse, rng_state) if options.dropout_p > 0 else (out, lse)


def flash_forward(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                  kernel: Optional[str] = None, *, window_size: Tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None):
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

    sinks ((heads,), float32, float16 or bfloat16, on q's device) gives each query head an attention
    sink (gpt-oss): a logit that joins every row's softmax after the scale, soft cap, ALiBi and mask
    and attends to no value, so out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)); lse then
    includes it (a row that sees no key gets out 0 and lse = sink; -inf is no sink). Every forward
    kernel folds it into each row as it finishes the row (fp32, before out is rounded).

    dropout_p in [0, 1) drops each probability with that probability and scales the kept ones by
    1 / (1 - p) (lse stays that of the undropped softmax). The mask comes from Philox with a
    (seed, offset) drawn from `generator` (default: the default generator of q's device), or from
    `rng_state` when given (not both). With dropout_p > 0 the call returns (out, lse, rng_state),
    rng_state the int64 (seed, offset) of the mask: pass it to flash_backward, or back here to
    draw the same mask. A CUDA call draws as PyTorch's own dropout does, without synchronizing and
    inside CUDA graph capture (each replay draws a fresh mask): its rng_state is a tensor on q's
    device that the kernel fills (a CPU generator draws on the host and gives a CPU tensor). A
    given rng_state is an int64 tensor of 2 elements on the CPU or on q's device, and comes back
    as it is.

    kernel picks the CUDA kernel: 'auto' (the default, or $FLASH_CUTLASS_FORWARD_KERNEL when
    kernel is None) runs the Hopper path (TMA + wgmma) on compute capability 9.0 for the head dims
    it was built for (64, 96, 128, 192, 256, and the multiples of 8 below them that need no
    larger kernel), and the sm80 path otherwise; 'sm80' and 'sm90' force one (RuntimeError where the
    forced one cannot run the call: 'sm80' on Hopper at those head dims needs a build with
    FLASH_CUTLASS_SM80_ON_HOPPER=1). CPU tensors ignore it.
    """
    check_forward_tensors(q, k, v)
    options = forward_options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                              generator=generator, rng_state=rng_state, kernel=kernel)
    return _with_rng_state(*backend.forward(q, k, v, options), options)


def flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                         softmax_scale: Optional[float] = None, causal: bool = False, kernel: Optional[str] = None, *,
                         window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                         generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None,
                         sinks: Optional[torch.Tensor] = None):
    """flash_forward of a batch of sequences of different lengths, packed without padding.

    q: (total_q, heads, head_dim), k and v: (total_k, heads_k, head_dim); sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32 cumulative lengths, batch + 1 entries starting at 0 and ending at total_q / total_k,
    on q's device; a sequence may be empty). max_seqlen_q and max_seqlen_k must be at least the
    longest lengths: they size the kernels' grid.
    Each sequence attends only to itself, with causal masks and windows aligned to its own
    lengths. The other arguments are flash_forward's; alibi_slopes (batch, heads) give sequence b
    row b, and dropout draws sequence b's mask as batch entry b of flash_forward. Returns out like
    q and lse, float32 (heads, total_q) (and rng_state with dropout).

    CUDA calls read nothing on the host (no device synchronization; CUDA graphs can capture them)
    and so check neither the lengths nor max_seqlen: lengths that break these rules give wrong
    results for the sequences concerned (rows outside every sequence are left unspecified), but
    the kernels never read or write outside the tensors. With $FLASH_CUTLASS_CHECK_VARLEN=1 they
    are read and checked (ValueError; one synchronization a call), as CPU calls always do.
    """
    options = _varlen_forward_options(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                      generator=generator, rng_state=rng_state, kernel=kernel)
    return _with_rng_state(*backend.forward(q, k, v, options), options)


def _varlen_forward_options(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **arguments):
    """The shape checks of a variable-length forward (the lengths' data are the backend's, so that
    torch.compile traces this) and its options."""
    batch = check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_forward_tensors(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    return forward_options(q.unsqueeze(0), batch=batch,
                           varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), **arguments)


def flash_backward(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None, causal: bool = False,
                   deterministic: bool = False, kernel: Optional[str] = None, *,
                   window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   rng_state: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None):
    """Gradients of flash_forward: returns (dq, dk, dv) in the dtypes and shapes of q, k and v, and
    with sinks (dq, dk, dv, dsinks), dsinks in sinks' dtype.

    dout and out are shaped like q; out and lse are what flash_forward returned for these inputs.
    softmax_scale, causal, window_size, softcap, alibi_slopes, sinks and dropout_p must be those of
    the forward call, and with dropout_p > 0, rng_state the one it returned (the same mask). deterministic=True
    sums dQ in a fixed order (key blocks in turn on the Hopper backward, a second kernel pass on the
    sm80 path) instead of with atomics, and with GQA dK and dV per query head then over each group
    (the Hopper backward otherwise adds a group's with atomics; where one of its CTAs walks a whole
    group's query heads, as in calls without a mask at head dim 128, it sums them in registers), so
    two runs give bitwise identical gradients. kernel picks
    the CUDA kernel as in flash_forward ($FLASH_CUTLASS_BACKWARD_KERNEL when None): 'auto' runs the
    Hopper backward on compute capability 9.0 where it is built for the head dim, and the sm80 path
    otherwise. CPU tensors run
    flash_cutlass.reference.attention_backward (always deterministic).
    """
    check_backward_tensors(dout, q, k, v, out, lse)
    options = backward_options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                               rng_state=rng_state, kernel=kernel, deterministic=deterministic)
    return _gradients(dout, q, k, v, out, lse, options)


def _gradients(dout, q, k, v, out, lse, options):
    """(dq, dk, dv) of a checked backward call, and dsinks after them with sinks."""
    dq, dk, dv, dsinks = backend.backward(dout, q, k, v, out, lse, options)
    return (dq, dk, dv) if options.sinks is None else (dq, dk, dv, dsinks)


def flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: Optional[float] = None, causal: bool = False,
                          deterministic: bool = False, kernel: Optional[str] = None, *,
                          window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                          alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                          rng_state: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None):
    """Gradients of flash_forward_varlen: (dq, dk, dv) shaped like the packed q, k and v (and dsinks
    after them with sinks, as flash_backward). dout and
    out are shaped like q, lse is (heads, total_q) as flash_forward_varlen returned it; the other
    arguments are those of the forward call and of flash_backward. The lengths are read and
    checked as in flash_forward_varlen (on CUDA only with $FLASH_CUTLASS_CHECK_VARLEN=1)."""
    batch = check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_outputs(dout, out, lse, q)
    check_backward_tensors(*(t.unsqueeze(0) for t in (dout, q, k, v, out, lse)))
    options = backward_options(q.unsqueeze(0), softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                               rng_state=rng_state, kernel=kernel, deterministic=deterministic, batch=batch,
                               varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _gradients(dout, q, k, v, out, lse, options)


def flash_attention(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                    deterministic: bool = False, return_lse: bool = False, kernel: Optional[str] = None, *,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                    generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None,
                    sinks: Optional[torch.Tensor] = None):
    """Autograd-enabled attention: out = softmax(softmax_scale * q k^T) v, differentiable in q, k
    and v (flash_backward is its gradient), and in sinks when given, and traceable by torch.compile.

    Arguments as flash_forward's (window_size, softcap, alibi_slopes, sinks, dropout_p, generator and
    rng_state included; the slopes get no gradient; the backward reuses the forward's dropout
    mask; with a drawn mask, torch.compile keeps one graph and a captured CUDA graph draws a fresh
    mask on each replay);
    deterministic is flash_backward's (bitwise reproducible gradients). Returns out, or (out, lse)
    with return_lse; lse carries no gradient (it is marked non-differentiable).
    """
    check_forward_tensors(q, k, v)
    options = forward_options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                              generator=generator, rng_state=rng_state, kernel=kernel, deterministic=deterministic)
    out, lse = ops.attention(q, k, v, options)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
                           return_lse: bool = False, kernel: Optional[str] = None, *,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                           generator: Optional[torch.Generator] = None, rng_state: Optional[torch.Tensor] = None,
                           sinks: Optional[torch.Tensor] = None):
    """flash_attention of a variable-length batch: packed q (total_q, heads, head_dim), k and v
    (total_k, heads_k, head_dim) and cumulative lengths as flash_forward_varlen takes them.
    Returns out like q, or (out, lse) with return_lse, lse (heads, total_q)."""
    options = _varlen_forward_options(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                      generator=generator, rng_state=rng_state, kernel=kernel,
                                      deterministic=deterministic)
    out, lse = ops.attention(q, k, v, options)
    return (out, lse) if return_lse else out

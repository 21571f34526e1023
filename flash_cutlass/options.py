"""The options of one attention call as one frozen type.

The public entry points (flash_cutlass.interface) validate their keyword arguments once into an
AttentionOptions; the custom ops (flash_cutlass.ops) take its fields as their schema's trailing
arguments (AttentionOptions.schema(), op_args(), from_op_args()); the extension reads the same
fields by name into its params (csrc/flash_api.cpp, options_from_python). Adding an option is a
field here, its check in `_checked`, and its reader in csrc/flash_api.cpp.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional, Tuple

import torch

from flash_cutlass import reference

# The kernels a call may ask for ('auto' lets include/flash_cutlass/select.h pick), and the
# environment variables that give each direction's default when the call passes kernel=None.
KERNELS = ("auto", "sm80", "sm90")
KERNEL_ENV = {"forward": "FLASH_CUTLASS_FORWARD_KERNEL", "backward": "FLASH_CUTLASS_BACKWARD_KERNEL"}
# Philox offset one dropout call takes from a CUDA generator (its offsets advance in steps of 4);
# csrc/flash_api.cpp's kPhiloxOffsetStep, for the draws of the CUDA calls, is the same.
_PHILOX_OFFSET_STEP = 4


def _option(schema: str, default):
    """A field and its type in the custom ops' schema."""
    return dataclasses.field(default=default, metadata={"schema": schema})


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Everything about an attention call but its tensors q, k, v (and out, lse, dout), in the
    form the kernels take: validated and resolved (the default scale computed, the kernel's
    environment default read). Build one with forward_options() or backward_options(); the
    constructor itself checks nothing."""

    softmax_scale: float = _option("float", 1.0)
    causal: bool = _option("bool", False)
    # Sliding window around the diagonal (-1: unbounded); causal bounds the right side at 0.
    window_left: int = _option("int", -1)
    window_right: int = _option("int", -1)
    softcap: float = _option("float", 0.0)
    # float32 (heads,) or (batch, heads), on q's device.
    alibi_slopes: Optional[torch.Tensor] = _option("Tensor?", None)
    # An attention sink a query head: (heads,), a floating dtype, on q's device (reference.py's
    # docstring); the forward kernels read it as fp32 (backend.with_float_sinks).
    sinks: Optional[torch.Tensor] = _option("Tensor?", None)
    dropout_p: float = _option("float", 0.0)
    # With dropout: the int64 (seed, offset) of the mask, on the CPU or on q's device (one a
    # forward returned); None in a forward that draws its mask from `generator` when it runs
    # (flash_cutlass.backend.forward), and always without dropout.
    rng_state: Optional[torch.Tensor] = _option("Tensor?", None)
    # The generator a forward with dropout and without rng_state draws from; None: the default
    # generator of q's device.
    generator: Optional[torch.Generator] = _option("Generator?", None)
    # A variable-length call: int32 cumulative lengths (batch + 1) on q's device and an upper bound
    # of the longest lengths; None / 0 otherwise.
    cu_seqlens_q: Optional[torch.Tensor] = _option("Tensor?", None)
    cu_seqlens_k: Optional[torch.Tensor] = _option("Tensor?", None)
    max_seqlen_q: int = _option("int", 0)
    max_seqlen_k: int = _option("int", 0)
    # One of KERNELS, the environment default already applied.
    kernel: str = _option("str", "auto")
    # The backward sums dQ in a fixed order (bitwise reproducible); the forward carries it for autograd.
    deterministic: bool = _option("bool", False)

    @classmethod
    def schema(cls) -> str:
        """The fields as arguments of a torch.library schema, e.g. 'float softmax_scale, bool causal, ...'."""
        return ", ".join(f"{field.metadata['schema']} {field.name}" for field in dataclasses.fields(cls))

    def op_args(self) -> tuple:
        """The fields in schema order (dataclasses.astuple would deep-copy the tensors)."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    @classmethod
    def from_op_args(cls, args) -> "AttentionOptions":
        return cls(*args)

    def replace(self, **changes) -> "AttentionOptions":
        return dataclasses.replace(self, **changes)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def window_size(self) -> Tuple[int, int]:
        return self.window_left, self.window_right


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(AttentionOptions))


def _type_name(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_bool(value, name: str) -> bool:
    """A bool, or a NumPy bool scalar, as a bool; TypeError naming the argument otherwise."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype.kind == "b":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {_type_name(value)}")


def _check_real(value, name: str, what: str) -> float:
    if type(value) is float:  # the usual case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {_type_name(value)}")
    try:
        return float(value)
    except OverflowError:  # e.g. an int past the float range
        raise ValueError(
            f"{name} must be finite, got a value too large for a float ({_type_name(value)})") from None


# The kernels scale scores by softmax_scale (or the soft cap) times log2(e) in fp32: the largest
# scale whose product stays finite.
MAX_SCORE_SCALE = 3.4028234663852886e38 / math.log2(math.e)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """softmax_scale as a finite float in (0, MAX_SCORE_SCALE], 1/sqrt(head_dim) for None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _check_real(softmax_scale, "softmax_scale", "a float or None")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if scale > MAX_SCORE_SCALE:
        raise ValueError(f"softmax_scale must be at most {MAX_SCORE_SCALE:.4g} (times log2(e) it must stay a finite "
                         f"float32), got {softmax_scale}")
    return scale


def check_softcap(softcap) -> float:
    """softcap as a float in [0, MAX_SCORE_SCALE] (0: no soft-capping)."""
    value = _check_real(softcap, "softcap", "a float")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: no soft-capping), got {softcap}")
    if value > MAX_SCORE_SCALE:
        raise ValueError(f"softcap must be at most {MAX_SCORE_SCALE:.4g} (times log2(e) it must stay a finite "
                         f"float32), got {softcap}")
    return value


def check_alibi_slopes(alibi_slopes, q: torch.Tensor, batch: int) -> Optional[torch.Tensor]:
    """None, or float32 slopes of shape (heads,) or (batch, heads) on q's device (made contiguous)."""
    alibi_slopes = reference.check_alibi_slopes(alibi_slopes, batch, q.shape[-2])
    if alibi_slopes is None:
        return None
    reference.check_device_of_q(alibi_slopes, "alibi_slopes", q.device)
    return alibi_slopes.contiguous()


def check_sinks(sinks, q: torch.Tensor) -> Optional[torch.Tensor]:
    """None, or a floating tensor of shape (heads,) on q's device."""
    sinks = reference.check_sinks(sinks, q.shape[-2])
    if sinks is not None:
        reference.check_device_of_q(sinks, "sinks", q.device)
    return sinks


def check_dropout_p(dropout_p) -> float:
    """dropout_p as a float in [0, 1)."""
    value = _check_real(dropout_p, "dropout_p", "a float")
    if not 0 <= value < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return value


def check_rng_state(rng_state, q: torch.Tensor) -> Optional[torch.Tensor]:
    """None, or an int64 tensor (seed, offset) of 2 elements on the CPU or on q's device, as
    flash_forward returns it with dropout."""
    if rng_state is None:
        return None
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor or None, got {_type_name(rng_state)}")
    if (rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,)
            or rng_state.device.type != "cpu" and rng_state.device != q.device):
        raise ValueError(
            f"rng_state must be an int64 tensor of 2 elements (seed, offset) on the CPU or on q's device ({q.device}), "
            f"as flash_forward returns it, got {rng_state.dtype} on {rng_state.device} of shape "
            f"{tuple(rng_state.shape)}")
    return rng_state


def check_generator(generator, q: torch.Tensor) -> Optional[torch.Generator]:
    """None, or a torch.Generator; a CUDA generator for CUDA tensors must be on q's device."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {_type_name(generator)}")
    if generator.device.type == q.device.type == "cuda" and generator.device.index not in (None, q.device.index):
        raise ValueError(f"generator is on {generator.device} but q is on {q.device}; a CUDA generator must be on "
                         "q's device")
    return generator


def check_kernel(kernel, direction: str = "forward") -> str:
    """The kernel a call asks for: `kernel` if given, else the direction's environment variable
    ($FLASH_CUTLASS_FORWARD_KERNEL or $FLASH_CUTLASS_BACKWARD_KERNEL), else 'auto'."""
    if kernel is None:
        variable = KERNEL_ENV[direction]
        value = os.environ.get(variable, "").strip() or "auto"
        if value not in KERNELS:
            raise ValueError(f"{variable} must be one of {', '.join(KERNELS)}, got {value!r}")
        return value
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be None or one of {', '.join(repr(k) for k in KERNELS)}, got {kernel!r}")
    return kernel


def draws_in_kernel(device: torch.device, generator: Optional[torch.Generator]) -> bool:
    """Whether a forward on `device` with dropout and without rng_state draws its (seed, offset)
    from `generator` in the extension (CUDA tensors with a CUDA generator or the default one:
    graph-safe, returned as a CUDA tensor the kernel writes), rather than on the host
    (draw_rng_state: CPU tensors, or a CPU generator)."""
    return device.type == "cuda" and (generator is None or generator.device.type == "cuda")


def draw_rng_state(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """The (seed, offset) of one dropout call drawn on the host, an int64 CPU tensor, from
    `generator` (default: the default generator of `device`): the CPU path's draw, and that of a
    CPU generator with CUDA tensors (CUDA calls otherwise draw in the extension: draws_in_kernel).
    A CUDA generator gives its seed and current Philox offset and advances the offset; a CPU
    generator gives a seed drawn from it and offset 0. Re-seeding the generator reproduces the
    same states, hence the same masks."""
    if generator is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        else:
            generator = torch.default_generator
    if generator.device.type == "cuda":
        seed = generator.initial_seed()
        offset = generator.get_offset()
        generator.set_offset(offset + _PHILOX_OFFSET_STEP)
    else:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        offset = 0
    seed = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits as an int64
    return torch.tensor([seed, offset], dtype=torch.int64)


def _checked(q, batch, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, dropout_p, rng_state,
             kernel, deterministic, direction, varlen) -> dict:
    window_left, window_right = reference.check_window_size(window_size)
    fields = dict(softmax_scale=check_softmax_scale(softmax_scale, q.shape[-1]), causal=check_bool(causal, "causal"),
                  window_left=window_left, window_right=window_right, softcap=check_softcap(softcap),
                  alibi_slopes=check_alibi_slopes(alibi_slopes, q, batch), sinks=check_sinks(sinks, q),
                  dropout_p=check_dropout_p(dropout_p),
                  rng_state=check_rng_state(rng_state, q), kernel=check_kernel(kernel, direction),
                  deterministic=check_bool(deterministic, "deterministic"))
    if varlen is not None:
        fields.update(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), varlen))
    return fields


def forward_options(q: torch.Tensor, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, sinks=None, dropout_p=0.0, generator=None, rng_state=None, kernel=None,
                    deterministic=False, batch: Optional[int] = None, varlen: Optional[tuple] = None
                    ) -> AttentionOptions:
    """The options of a forward call on q (batch, seqlen_q, heads, head_dim), validated; raises
    TypeError or ValueError naming the argument. With dropout and without rng_state, the call
    draws its (seed, offset) from generator when it runs (inside the forward op, so that
    torch.compile keeps it in its graph and a CUDA graph replays a fresh draw).
    A variable-length call passes its batch (the number of sequences) and varlen = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k), shapes already checked."""
    fields = _checked(q, q.shape[0] if batch is None else batch, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, sinks, dropout_p, rng_state, kernel, deterministic, "forward", varlen)
    generator = check_generator(generator, q)
    if generator is not None and fields["rng_state"] is not None:
        raise ValueError("pass generator or rng_state, not both")
    if fields["dropout_p"] == 0:
        fields["rng_state"] = None
    elif fields["rng_state"] is None:
        fields["generator"] = generator
    return AttentionOptions(**fields)


def backward_options(q: torch.Tensor, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=None, kernel=None, deterministic=False,
                     batch: Optional[int] = None, varlen: Optional[tuple] = None) -> AttentionOptions:
    """The options of a backward call (those of its forward call and deterministic), validated."""
    fields = _checked(q, q.shape[0] if batch is None else batch, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, sinks, dropout_p, rng_state, kernel, deterministic, "backward", varlen)
    if fields["dropout_p"] > 0 and fields["rng_state"] is None:
        raise ValueError("dropout_p > 0 needs rng_state, the one flash_forward returned with out and lse")
    if fields["dropout_p"] == 0:
        fields["rng_state"] = None
    return AttentionOptions(**fields)

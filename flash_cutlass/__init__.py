"""flash_cutlass: exact FlashAttention for PyTorch, hand-written CUDA kernels on CUTLASS/CuTe.

    out, lse = flash_cutlass.flash_forward(q, k, v, softmax_scale=None, causal=False, kernel=None,
                                           window_size=(-1, -1))

CUDA tensors (fp16/bf16, compute capability >= 8.0) run the compiled kernels; CPU tensors run
the slow pure-PyTorch reference in flash_cutlass.reference with the same semantics.
flash_attention_with_kvcache serves decoding and chunked prefill over a contiguous or paged KV cache.

FlashAttention-2's functions, with its signatures, are in the submodule
flash_cutlass.flash_attn_interface (`from flash_cutlass.flash_attn_interface import
flash_attn_func`), which `import flash_cutlass` leaves unloaded; so is flash_cutlass.distributed,
context parallelism (ring attention over torch.distributed).
"""

from flash_cutlass._version import __version__
from flash_cutlass.backend import (
    compiled_alibi,
    compiled_archs,
    compiled_backward,
    compiled_dropout,
    compiled_dtypes,
    compiled_head_dims,
    compiled_kvcache,
    compiled_kvcache_head_dims,
    compiled_sm90_backward_head_dims,
    compiled_sm90_head_dims,
    compiled_softcap,
    compiled_window,
)
from flash_cutlass.interface import (
    flash_attention,
    flash_attention_varlen,
    flash_backward,
    flash_backward_varlen,
    flash_forward,
    flash_forward_varlen,
)
from flash_cutlass.kvcache import flash_attention_with_kvcache
from flash_cutlass.options import AttentionOptions
from flash_cutlass.sdpa import scaled_dot_product_attention

__all__ = [
    "__version__",
    "AttentionOptions",
    "compiled_alibi",
    "compiled_archs",
    "compiled_backward",
    "compiled_dropout",
    "compiled_dtypes",
    "compiled_head_dims",
    "compiled_kvcache",
    "compiled_kvcache_head_dims",
    "compiled_sm90_backward_head_dims",
    "compiled_sm90_head_dims",
    "compiled_softcap",
    "compiled_window",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "flash_backward",
    "flash_backward_varlen",
    "flash_forward",
    "flash_forward_varlen",
    "scaled_dot_product_attention",
]

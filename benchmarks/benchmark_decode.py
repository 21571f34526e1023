#!/usr/bin/env python3
"""Decoding over a KV cache: flash_cutlass.flash_attention_with_kvcache (paged and contiguous)
against torch SDPA's backends and FlexAttention, in achieved HBM bandwidth (bytes of K, V, Q and
out moved per second) next to this GPU's measured device-to-device copy bandwidth.

    python3 benchmarks/benchmark_decode.py --batch 32 --context 8192
    python3 benchmarks/benchmark_decode.py --batch 1 --context 131072 --impls flash_cutlass,flash_cutlass_contiguous

Each sequence holds --context tokens; one new query token per sequence (seqlen_q 1), or with
--seqlen-q N the last N tokens of the context (chunked prefill: causal, aligned to the context's
end), then reported in TFLOPS too, next to flash_cutlass_prefill, the prefill forward
(flash_forward) over the same tokens as contiguous tensors. SDPA and FlexAttention read a
contiguous (batch, heads_k, context, head_dim) cache with GQA (and for N > 1 a bottom-right causal
mask); flash_cutlass_full is flash_cutlass over those same tensors without cache_seqlens (the whole
cache, no length read on the GPU: the computation SDPA runs), where flash_cutlass (paged) and
flash_cutlass_contiguous pass per-sequence lengths as a server does.

    python3 benchmarks/benchmark_decode.py --batch 1 --context 16384 --seqlen-q 512 \
        --impls flash_cutlass,flash_cutlass_prefill

From 128 queries flash_cutlass gathers the caches and runs the prefill forward over them
(include/flash_cutlass/select.h); --num-splits 1 keeps such calls on the KV-cache kernel, to
compare the two.

With --append, flash_cutlass's calls (paged, contiguous, and flash_cutlass_append_kernel: paged with
the append kernel instead of the attention kernel's own append) bring the keys and values of their
query tokens (k=, v=) and append them at cache_seqlens = context - seqlen_q before attending, as a
server's decode step does that appends in the same call (the same slots are written again by every
call); the bytes moved then count those writes too. The other implementations read the context as
it is.

Timings: after warm-up, --calls back-to-back calls between one pair of CUDA events (--timing loop,
the default: the host enqueues the next call while the GPU runs the last, so only host overhead
longer than a call shows), or one replay of a CUDA graph capturing them (--timing graph: no host
overhead at all), or both (--timing both: two columns, the bandwidth from the graph's time, so that
the host's share of a call shows as their difference); the time of a call is the median over
--repeats such measurements, divided by --calls. Every call reads the same cache: one that fits in L2 (50 MB on an H100/H200) is partly read
from there, so small shapes can show more than HBM bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_forward import with_environment  # noqa: E402

IMPLS = ("flash_cutlass", "flash_cutlass_contiguous", "flash_cutlass_full", "flash_cutlass_prefill",
         "flash_cutlass_append_kernel", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex")
APPENDING_IMPLS = ("flash_cutlass", "flash_cutlass_contiguous", "flash_cutlass_append_kernel")
# flash_cutlass (paged) with a switch of docs/DEVELOPING.md set around each call, for an A/B against
# the default in one process: flash_cutlass_append_kernel launches the append kernel before the
# attention kernel (with --append; against the append inside the attention kernel).
SWITCHED_PAGED_IMPLS = {"flash_cutlass_append_kernel": ("FLASH_CUTLASS_KVCACHE_TILE_APPEND", "0")}


def attention_flops(batch: int, heads: int, seqlen_q: int, context: int, head_dim: int) -> float:
    """Matmul FLOPs of the last seqlen_q queries of a context attending causally (aligned to the
    context's end): query i of seqlen_q sees context - seqlen_q + i + 1 keys; 4 * d per key."""
    keys_seen = seqlen_q * (context - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
    return 4.0 * batch * heads * head_dim * keys_seen


def time_ms(fn, calls: int, repeats: int, graph: bool = False, warmup: int = 5) -> float:
    """Milliseconds per call of fn: the median over `repeats` of `calls` back-to-back calls timed
    between one pair of CUDA events (one event pair per call would time the host's launch of each
    call too, and a sync per call would leave the GPU idle between them), or of one replay of a
    CUDA graph capturing the `calls` calls."""
    # The warm-up runs on a side stream, as a graph capture needs (PyTorch's CUDA graph notes).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(calls):
                fn()
        captured.replay()

        def timed():
            captured.replay()
    else:
        def timed():
            for _ in range(calls):
                fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        timed()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) / calls


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), calls=5, repeats=5)
    return 2 * src.numel() / (ms * 1e-3)


def new_tokens(batch, context, seqlen_q, heads_k, head_dim, dtype, append, device="cuda"):
    """The arguments of flash_attention_with_kvcache that give each sequence its length: with
    append, the keys and values of the seqlen_q new tokens (k, v) and the lengths before them
    (context - seqlen_q); without, the lengths alone (context)."""
    if not append:
        return {"cache_seqlens": torch.full((batch,), context, dtype=torch.int32, device=device)}
    k = torch.randn(batch, seqlen_q, heads_k, head_dim, device=device, dtype=dtype)
    return {"k": k, "v": torch.randn_like(k),
            "cache_seqlens": torch.full((batch,), context - seqlen_q, dtype=torch.int32, device=device)}


def make_callables(impl, batch, context, heads, heads_k, head_dim, page_size, dtype, seqlen_q=1, num_splits=0,
                   append=False):
    import flash_cutlass

    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
    lengths = new_tokens(batch, context, seqlen_q, heads_k, head_dim, dtype, append)
    if impl == "flash_cutlass" or impl in SWITCHED_PAGED_IMPLS:
        blocks = -(-context // page_size)
        k_cache = torch.randn(batch * blocks, page_size, heads_k, head_dim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)

        def paged():
            return flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, **lengths, block_table=table,
                                                              causal=True, num_splits=num_splits)
        return paged if impl == "flash_cutlass" else with_environment(paged, *SWITCHED_PAGED_IMPLS[impl])
    if impl == "flash_cutlass_contiguous":
        k_cache = torch.randn(batch, context, heads_k, head_dim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        return lambda: flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, **lengths, causal=True,
                                                                  num_splits=num_splits)
    if impl == "flash_cutlass_prefill":
        k = torch.randn(batch, context, heads_k, head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        return lambda: flash_cutlass.flash_forward(q, k, v, causal=True)
    qt = q.transpose(1, 2)
    k = torch.randn(batch, heads_k, context, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    if impl == "flash_cutlass_full":
        return lambda: flash_cutlass.flash_attention_with_kvcache(q, k.transpose(1, 2), v.transpose(1, 2),
                                                                  causal=True, num_splits=num_splits)
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        if seqlen_q == 1:
            return lambda: compiled(qt, k, v, enable_gqa=True)
        offset = context - seqlen_q
        mask = create_block_mask(lambda b, h, i, j: j <= i + offset, None, None, seqlen_q, context)
        return lambda: compiled(qt, k, v, block_mask=mask, enable_gqa=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    mask = None if seqlen_q == 1 else causal_lower_right(seqlen_q, context)

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=True)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64], help="batch sizes (default: %(default)s)")
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 131072],
                        help="tokens in each sequence's cache (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: %(default)s)")
    parser.add_argument("--heads-k", type=int, default=8, help="kv heads (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--seqlen-q", type=int, default=1,
                        help="query tokens per sequence, the context's last (default: %(default)s: decoding)")
    parser.add_argument("--append", action="store_true",
                        help="flash_cutlass's calls append their query tokens' keys and values (k=, v=) before "
                             "attending")
    parser.add_argument("--num-splits", type=int, default=0,
                        help="flash_cutlass's num_splits (default: %(default)s: chosen from the shapes; 1 keeps "
                             "chunked prefill on the KV-cache kernel)")
    parser.add_argument("--page-size", type=int, default=16, help="page size of the paged cache (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="(default: %(default)s)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS))
    parser.add_argument("--calls", type=int, default=20,
                        help="back-to-back calls per timed measurement (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed measurements per implementation and shape; the median is reported "
                             "(default: %(default)s)")
    parser.add_argument("--timing", choices=("loop", "graph", "both"), default="loop",
                        help="loop: calls launched back to back; graph: one replay of a CUDA graph capturing "
                             "them; both: the two, bandwidth from the graph's (default: %(default)s)")
    parser.add_argument("--max-cache-gib", type=float, default=40.0,
                        help="skip shapes whose K/V cache exceeds this (default: %(default)s)")
    args = parser.parse_args(argv)
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in impls if name not in IMPLS]
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be >= 1")
    if args.num_splits < 0:
        parser.error("--num-splits must be >= 0")
    if args.seqlen_q < 1 or args.seqlen_q > min(args.context):
        parser.error("--seqlen-q must be in [1, the smallest --context]")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device copy bandwidth {copy / 1e9:.0f} GB/s; timing: {args.timing}, "
          f"median of {args.repeats} x {args.calls} calls")
    both = args.timing == "both"
    graph_column = f" {'graph us':>9}" if both else ""
    prefill = args.seqlen_q > 1
    tflops_column = f" {'TFLOPS':>8}" if prefill else ""
    print(f"{'batch':>6} {'context':>8} {'impl':>26} {'time us':>9}{graph_column} {'GB/s':>8} {'of copy':>8}"
          f"{tflops_column}")
    for batch in args.batch:
        for context in args.context:
            cache_bytes = 2 * batch * context * args.heads_k * args.head_dim * dtype.itemsize
            if cache_bytes > args.max_cache_gib * 2**30:
                print(f"{batch:>6} {context:>8}  skipped: the cache is {cache_bytes / 2**30:.1f} GiB")
                continue
            moved = cache_bytes + 2 * batch * args.seqlen_q * args.heads * args.head_dim * dtype.itemsize
            flops = attention_flops(batch, args.heads, args.seqlen_q, context, args.head_dim)
            for impl in impls:
                appends = args.append and impl in APPENDING_IMPLS
                # The new keys and values: read from k and v, written into the cache.
                impl_moved = moved + (4 * batch * args.seqlen_q * args.heads_k * args.head_dim * dtype.itemsize
                                      if appends else 0)
                try:
                    fn = make_callables(impl, batch, context, args.heads, args.heads_k, args.head_dim,
                                        args.page_size, dtype, args.seqlen_q, args.num_splits, appends)
                    ms = time_ms(fn, args.calls, args.repeats, graph=args.timing == "graph")
                except (RuntimeError, torch.OutOfMemoryError) as error:
                    print(f"{batch:>6} {context:>8} {impl:>26}  unavailable: {str(error).splitlines()[0][:80]}")
                    continue
                graph_ms, graph_value = ms, ""
                if both:
                    try:
                        graph_ms = time_ms(fn, args.calls, args.repeats, graph=True)
                        graph_value = f" {graph_ms * 1e3:>9.1f}"
                    except RuntimeError:  # a peer that cannot be captured: bandwidth from the loop
                        graph_value = f" {'n/a':>9}"
                achieved = impl_moved / (graph_ms * 1e-3)
                tflops_value = f" {flops / (graph_ms * 1e-3) / 1e12:>8.1f}" if prefill else ""
                print(f"{batch:>6} {context:>8} {impl:>26} {ms * 1e3:>9.1f}{graph_value} {achieved / 1e9:>8.0f} "
                      f"{achieved / copy:>8.2f}{tflops_value}")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

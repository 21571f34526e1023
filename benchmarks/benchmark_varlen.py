#!/usr/bin/env python3
"""Variable-length benchmark: flash_forward_varlen / flash_backward_varlen on a batch of mixed
sequence lengths against the same sequences zero-padded to the longest one and run as one
flash_forward / flash_backward batch, and against SDPA on a jagged nested tensor (torch's
variable-length attention) where this torch runs it.

The batch holds about 16k tokens (benchmark_forward.py's budget) at hidden 2048, bf16; lengths are
drawn uniformly from [--min-len, --max-len] with a fixed seed. TFLOPS count the scores each
sequence's mask keeps (padding excluded), so the padded batch's TFLOPS are per useful token:
"padded / varlen" above 1 means varlen is faster per token.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_forward import (  # noqa: E402
    HIDDEN_SIZE, TOKENS_PER_BATCH, median_ms, peer_columns, peer_ms, tflops, write_rows)

DIRECTION_FACTOR = {"forward": 1.0, "backward": 2.5}


def draw_lengths(tokens: int, min_len: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(min_len, max_len + 1, (), generator=gen)))
    return lengths


def useful_pairs(lengths: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def varlen_runner(flash_cutlass, lengths, heads, head_dim, causal, direction):
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    longest = max(lengths)
    if direction == "forward":
        return lambda: flash_cutlass.flash_forward_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
    dout = torch.randn_like(out)
    return lambda: flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu, cu, longest, longest,
                                                       causal=causal)


def padded_runner(flash_cutlass, lengths, heads, head_dim, causal, direction):
    shape = (len(lengths), max(lengths), heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if direction == "forward":
        return lambda: flash_cutlass.flash_forward(q, k, v, causal=causal)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    return lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal)


def nested_sdpa_runner(lengths, heads, head_dim, causal, direction):
    """SDPA on jagged nested tensors (batch, heads, jagged seqlen, head_dim); None if unsupported."""
    if causal:
        return None  # SDPA takes is_causal with nested tensors only for equal lengths
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")

    def jagged():
        # One offsets tensor for every operand: they share one ragged dim (SDPA requires it).
        values = torch.randn(int(offsets[-1]), heads, head_dim, device="cuda", dtype=torch.bfloat16)
        return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    q, k, v = (jagged().requires_grad_() for _ in range(3))
    attend = torch.nn.functional.scaled_dot_product_attention
    if direction == "forward":
        return lambda: attend(q, k, v)
    out = attend(q, k, v)
    dout = jagged()
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dims (default 64,128)")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--directions", default="forward,backward", help="forward and/or backward")
    parser.add_argument("--min-time-ms", type=float, default=100.0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    import flash_cutlass

    lengths = draw_lengths(TOKENS_PER_BATCH, args.min_len, args.max_len, args.seed)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}: {lengths}")
    rows = []
    print("| direction | hdim | causal | varlen ms | TFLOPS | padded ms | padded / varlen | nested SDPA ms | "
          "nested SDPA / varlen |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for direction in args.directions.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            heads = HIDDEN_SIZE // head_dim
            for causal in (False, True):
                flops = DIRECTION_FACTOR[direction] * 4.0 * heads * head_dim * useful_pairs(lengths, causal)
                ms = median_ms(varlen_runner(flash_cutlass, lengths, heads, head_dim, causal, direction), 5, 10,
                               args.min_time_ms)
                padded_ms = median_ms(padded_runner(flash_cutlass, lengths, heads, head_dim, causal, direction), 5,
                                      10, args.min_time_ms)
                nested_ms = peer_ms(lambda: nested_sdpa_runner(lengths, heads, head_dim, causal, direction),
                                    "nested SDPA", args.min_time_ms)
                row = {"direction": direction, "head_dim": head_dim, "causal": causal, "lengths": lengths, "ms": ms,
                       "tflops": tflops(flops, ms), "padded_ms": padded_ms, "nested_sdpa_ms": nested_ms}
                rows.append(row)
                print(f"| {direction} | {head_dim} | {'yes' if causal else 'no'} | {ms:.3f} | {row['tflops']:.1f} | "
                      f"{padded_ms:.3f} | {padded_ms / ms:.2f} | {peer_columns(nested_ms, ms)} |", flush=True)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

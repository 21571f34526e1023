#!/usr/bin/env python3
"""Sliding-window attention benchmark: flash_cutlass with window_size=(w, 0) or (w, w) against
itself without a window (the time should shrink in proportion to the window) and against torch's
FlexAttention with the same sliding-window block mask (a compiled Triton kernel; the only fused
sliding-window attention torch offers).

Shapes follow benchmark_forward.py: 16k tokens per batch, hidden 2048. TFLOPS count only the
scores inside the window (causal halves and windows clipped at the sequence edges included), so
a kernel that skips the blocks outside the window keeps its TFLOPS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_forward import (  # noqa: E402
    DIRECTIONS, HIDDEN_SIZE, TOKENS_PER_BATCH, median_ms, peer_columns, peer_ms, tflops, write_rows)


def visible_pairs(seqlen: int, left: int, right: int) -> int:
    """Number of (query, key) pairs a window (left, right) keeps in a seqlen x seqlen matrix
    (-1: unbounded)."""
    rows = torch.arange(seqlen, dtype=torch.int64)
    begin = torch.zeros_like(rows) if left < 0 else (rows - left).clamp(min=0)
    end = torch.full_like(rows, seqlen) if right < 0 else (rows + right + 1).clamp(max=seqlen)
    return int((end - begin).clamp(min=0).sum())


def flex_runner(q, k, v, left, right, direction):
    """FlexAttention with the sliding-window block mask, compiled once; None if unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def keep(b, h, q_idx, kv_idx):
        inside = kv_idx <= q_idx + right if right >= 0 else q_idx >= 0
        return inside & (kv_idx >= q_idx - left) if left >= 0 else inside

    # The timed backward reuses one forward graph (retain_graph=True), which donated buffers forbid.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    seqlen = q.shape[1]
    block_mask = create_block_mask(keep, None, None, seqlen, seqlen, device=q.device)
    # A fresh, static compile per case: reusing dynamo's state across score_mods and masks failed
    # on torch 2.11 ("all unwrapped values must be FakeTensor ...").
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(qt)
    if direction == "forward":
        return lambda: compiled(qt, kt, vt, block_mask=block_mask)
    out = compiled(qt, kt, vt, block_mask=block_mask)
    if direction == "backward":
        return lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)
    return lambda: torch.autograd.grad(compiled(qt, kt, vt, block_mask=block_mask), (qt, kt, vt), dout)


def subject_runner(flash_cutlass, q, k, v, left, right, direction):
    window = (left, right)
    if direction == "forward":
        return lambda: flash_cutlass.flash_forward(q, k, v, window_size=window)
    dout = torch.randn_like(q)
    if direction == "backward":
        out, lse = flash_cutlass.flash_forward(q, k, v, window_size=window)
        return lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, window_size=window)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: torch.autograd.grad(flash_cutlass.flash_attention(*leaves, window_size=window), leaves, dout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dims (default 64,128)")
    parser.add_argument("--windows", default="256,1024,4096",
                        help="comma-separated left window sizes w (default 256,1024,4096)")
    parser.add_argument("--directions", default="forward,backward",
                        help=f"comma-separated, from {', '.join(DIRECTIONS)} (default forward,backward)")
    parser.add_argument("--no-flex", action="store_true", help="leave out FlexAttention")
    parser.add_argument("--min-time-ms", type=float, default=100.0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    import flash_cutlass

    dtype = torch.bfloat16
    rows = []
    print("| direction | hdim | window (left, right) | flash_cutlass ms | TFLOPS | full-attention ms | "
          "full / window | flex ms | flash_cutlass / flex |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for direction in args.directions.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            batch, heads = max(1, TOKENS_PER_BATCH // args.seqlen), HIDDEN_SIZE // head_dim
            q, k, v = (torch.randn(batch, args.seqlen, heads, head_dim, device="cuda", dtype=dtype)
                       for _ in range(3))
            full_ms = median_ms(subject_runner(flash_cutlass, q, k, v, -1, -1, direction), 5, 10, args.min_time_ms)
            for w in (int(x) for x in args.windows.split(",")):
                for left, right in ((w, 0), (w, w)):
                    ms = median_ms(subject_runner(flash_cutlass, q, k, v, left, right, direction), 5, 10,
                                   args.min_time_ms)
                    flops = DIRECTIONS[direction] * 4.0 * batch * heads * head_dim * visible_pairs(args.seqlen,
                                                                                                   left, right)
                    flex_ms = None
                    if not args.no_flex:
                        flex_ms = peer_ms(lambda: flex_runner(q, k, v, left, right, direction), "flex",
                                          args.min_time_ms)
                    row = {"direction": direction, "head_dim": head_dim, "seqlen": args.seqlen, "batch": batch,
                           "heads": heads, "window": [left, right], "ms": ms, "tflops": tflops(flops, ms),
                           "full_ms": full_ms, "flex_ms": flex_ms}
                    rows.append(row)
                    print(f"| {direction} | {head_dim} | ({left}, {right}) | {ms:.3f} | {row['tflops']:.1f} | "
                          f"{full_ms:.3f} | {full_ms / ms:.1f} | {peer_columns(flex_ms, ms)} |", flush=True)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

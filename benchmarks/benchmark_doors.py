#!/usr/bin/env python3
"""Doors benchmark: what each drop-in entry point costs over calling flash_attention directly.

The same attention (bf16, causal, GQA 4:1, 16k tokens per batch, hidden 2048) through
flash_cutlass.flash_attention, the FlashAttention-2 import (flash_attn_interface.flash_attn_func,
and flash_attn_qkvpacked_func on a packed qkv without GQA), scaled_dot_product_attention in SDPA's
(batch, heads, seqlen, head_dim) layout, and the transformers attention function
(flash_cutlass.integrations.transformers.attention_forward, when transformers is installed),
forward or forward + backward. Each door's time is the median of CUDA-event timings over many
calls, in one process, the doors alternating over --rounds rounds (the median of the rounds);
"overhead" is its time over the direct call's on the same inputs (1.00: none).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_forward import HIDDEN_SIZE, TOKENS_PER_BATCH, median_ms, write_rows  # noqa: E402

GQA_RATIO = 4


class _Module(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""
    is_causal = True


def door_calls(seqlen: int, head_dim: int, direction: str, device: str = "cuda", tokens: int = TOKENS_PER_BATCH,
               hidden: int = HIDDEN_SIZE) -> dict:
    """One zero-argument callable per door, on the same inputs (each returns the door's output, or
    with a backward the gradients)."""
    import flash_cutlass
    from flash_cutlass import flash_attn_interface

    batch, heads = max(1, tokens // seqlen), hidden // head_dim
    shape = (batch, seqlen, heads, head_dim)
    q = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, heads // GQA_RATIO, head_dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    q_bhsd, k_bhsd, v_bhsd = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dout = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def timed(forward, leaves, grad_out):
        if direction == "forward":
            return forward
        return lambda: torch.autograd.grad(forward(), leaves, grad_out)

    calls = {
        "flash_attention": timed(lambda: flash_cutlass.flash_attention(q, k, v, causal=True), (q, k, v), dout),
        "flash_attn_func": timed(lambda: flash_attn_interface.flash_attn_func(q, k, v, causal=True), (q, k, v),
                                 dout),
        "scaled_dot_product_attention": timed(
            lambda: flash_cutlass.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=True,
                                                               enable_gqa=True),
            (q_bhsd, k_bhsd, v_bhsd), dout.transpose(1, 2)),
        # Packed qkv has no GQA: measured against flash_attention on its own views.
        "flash_attention (qkv views)": timed(
            lambda: flash_cutlass.flash_attention(*qkv.unbind(dim=2), causal=True), (qkv,), dout),
        "flash_attn_qkvpacked_func": timed(lambda: flash_attn_interface.flash_attn_qkvpacked_func(qkv, causal=True),
                                           (qkv,), dout),
    }
    if importlib.util.find_spec("transformers") is not None:
        from flash_cutlass.integrations import transformers as fc_transformers

        module = _Module()
        calls["transformers attention_forward"] = timed(
            lambda: fc_transformers.attention_forward(module, q_bhsd, k_bhsd, v_bhsd, None)[0],
            (q_bhsd, k_bhsd, v_bhsd), dout)
    return calls


def door_times(calls: dict, rounds: int, time_ms) -> dict:
    """Each door's median over `rounds` rounds of time_ms(call), the doors alternating within a
    round (A B C A B C ...), so that a drift of the clocks falls on every door alike."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(time_ms(call))
    return {name: statistics.median(values) for name, values in samples.items()}


# What each door is compared with: the direct call on the same inputs.
BASELINES = {"flash_attn_qkvpacked_func": "flash_attention (qkv views)",
             "flash_attention (qkv views)": "flash_attention (qkv views)"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="512,4096", help="comma-separated (default 512,4096)")
    parser.add_argument("--head-dims", default="128", help="comma-separated head dims (default 128)")
    parser.add_argument("--directions", default="forward,forward+backward", help="forward and/or forward+backward")
    parser.add_argument("--min-time-ms", type=float, default=200.0, help="GPU time timed per measurement")
    parser.add_argument("--warmup-ms", type=float, default=100.0,
                        help="GPU time run untimed before each measurement, so the clocks settle under its load")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure the doors in this many alternating rounds (A B C A B C ...) and report the "
                             "median of each door's rounds: clock drift then falls on every door alike")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"{Path(sys.argv[0]).name}: no CUDA GPU is visible to torch {torch.__version__}; this benchmark "
                 "times CUDA kernels and needs one.")

    rows = []
    print("| direction | hdim | seqlen | door | ms | overhead |")
    print("|---|---:|---:|---|---:|---:|")
    for direction in args.directions.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            for seqlen in (int(s) for s in args.seqlens.split(",")):
                times = door_times(door_calls(seqlen, head_dim, direction), args.rounds,
                                   lambda call: median_ms(call, 10, 20, args.min_time_ms, args.warmup_ms))
                for name, ms in times.items():
                    base = times[BASELINES.get(name, "flash_attention")]
                    rows.append({"direction": direction, "head_dim": head_dim, "seqlen": seqlen, "door": name,
                                 "ms": ms, "overhead": ms / base})
                    print(f"| {direction} | {head_dim} | {seqlen} | {name} | {ms:.3f} | {ms / base:.3f} |", flush=True)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

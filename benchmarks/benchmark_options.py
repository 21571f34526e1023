#!/usr/bin/env python3
"""Options benchmark: flash_cutlass with softcap=, alibi_slopes= and dropout_p= (the extended
kernels) against itself without them (what the options cost) and, for the score options, against
torch's FlexAttention with the same score_mod (a compiled Triton kernel; SDPA's fused backends
offer neither; FlexAttention has no dropout).

Shapes follow benchmark_forward.py: 16k tokens per batch, hidden 2048, bf16. TFLOPS count the
scores the mask keeps (half of them with causal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_forward import (  # noqa: E402
    DIRECTIONS, HIDDEN_SIZE, TOKENS_PER_BATCH, median_ms, peer_columns, peer_ms, tflops, write_rows)

SOFTCAP = 30.0
DROPOUT_P = 0.1
OPTIONS = {
    "softcap": {"softcap": SOFTCAP},
    "alibi": {"alibi": True},
    "softcap+alibi": {"softcap": SOFTCAP, "alibi": True},
    "dropout": {"dropout_p": DROPOUT_P},
}


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's usual slopes 2^(-8 h / heads), h = 1..heads."""
    return torch.exp2(-8 * torch.arange(1, heads + 1, device="cuda") / heads).float()


def flex_runner(q, k, v, causal, softcap, slopes, direction):
    """FlexAttention with the options as a score_mod (and the causal block mask), compiled once;
    None if unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    seqlen = q.shape[1]

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    # The timed backward reuses one forward graph (retain_graph=True), which donated buffers forbid.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, seqlen, seqlen,
                                       device=q.device)
    # A fresh, static compile per case: reusing dynamo's state across score_mods and masks failed
    # on torch 2.11 ("all unwrapped values must be FakeTensor ...").
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(qt)
    if direction == "forward":
        return lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)
    out = compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)


def subject_runner(flash_cutlass, q, k, v, causal, softcap, slopes, dropout_p, direction):
    options = {"softcap": softcap, "alibi_slopes": slopes, "dropout_p": dropout_p}
    if direction == "forward":
        return lambda: flash_cutlass.flash_forward(q, k, v, causal=causal, **options)
    dout = torch.randn_like(q)
    out, lse, *rng_state = flash_cutlass.flash_forward(q, k, v, causal=causal, **options)
    if rng_state:
        options["rng_state"] = rng_state[0]
    return lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal, **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="4096,16384", help="comma-separated (default 4096,16384)")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dims (default 64,128)")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, from {', '.join(OPTIONS)}")
    parser.add_argument("--directions", default="forward,backward", help="forward and/or backward")
    parser.add_argument("--no-flex", action="store_true", help="leave out FlexAttention")
    parser.add_argument("--min-time-ms", type=float, default=100.0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    import flash_cutlass

    rows = []
    print("| direction | hdim | causal | seqlen | option | flash_cutlass ms | TFLOPS | without option ms | "
          "cost | flex ms | flash_cutlass / flex |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for direction in args.directions.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            for causal in (False, True):
                for seqlen in (int(s) for s in args.seqlens.split(",")):
                    batch, heads = max(1, TOKENS_PER_BATCH // seqlen), HIDDEN_SIZE // head_dim
                    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                               for _ in range(3))
                    flops = DIRECTIONS[direction] * 4.0 * batch * heads * head_dim * seqlen * seqlen
                    flops *= 0.5 if causal else 1.0
                    plain_ms = median_ms(subject_runner(flash_cutlass, q, k, v, causal, 0.0, None, 0.0, direction), 5,
                                         10, args.min_time_ms)
                    for name in args.options.split(","):
                        softcap = OPTIONS[name].get("softcap", 0.0)
                        slopes = alibi_slopes(heads) if OPTIONS[name].get("alibi") else None
                        dropout_p = OPTIONS[name].get("dropout_p", 0.0)
                        ms = median_ms(subject_runner(flash_cutlass, q, k, v, causal, softcap, slopes, dropout_p,
                                                      direction), 5, 10, args.min_time_ms)
                        flex_ms = None
                        if not args.no_flex and dropout_p == 0:
                            flex_ms = peer_ms(lambda: flex_runner(q, k, v, causal, softcap, slopes, direction),
                                              "flex", args.min_time_ms)
                        row = {"direction": direction, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
                               "batch": batch, "heads": heads, "option": name, "ms": ms,
                               "tflops": tflops(flops, ms), "plain_ms": plain_ms, "flex_ms": flex_ms}
                        rows.append(row)
                        print(f"| {direction} | {head_dim} | {'yes' if causal else 'no'} | {seqlen} | {name} | "
                              f"{ms:.3f} | {row['tflops']:.1f} | {plain_ms:.3f} | {ms / plain_ms:.2f} | "
                              f"{peer_columns(flex_ms, ms)} |", flush=True)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Demo: python -m flash_cutlass [--batch B --seqlen S --heads H --head-dim D --causal --dtype bf16]

Runs flash_forward on one shape, checks it against the fp32 reference, and prints its time and
TFLOPS next to torch's scaled_dot_product_attention. Without a GPU it says so and runs the CPU
reference path on a small shape instead.
"""

import argparse
import math

import torch

import flash_cutlass
from flash_cutlass.reference import naive_attention


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m flash_cutlass", description=__doc__.split("\n\n")[1])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (median reported)")
    return parser.parse_args()


def median_ms(fn, reps):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def max_error(out, q, k, v, causal, rows=256):
    """Max |out - fp32 reference| over the last `rows` query rows (bounded memory). With the
    bottom-right-aligned causal mask, those rows against all keys are exactly a causal problem of
    their own."""
    tail = slice(q.shape[1] - min(rows, q.shape[1]), q.shape[1])
    ref, _ = naive_attention(q[:, tail], k, v, q.shape[-1] ** -0.5, causal, compute_dtype=torch.float32)
    return (out[:, tail].float() - ref).abs().max().item()


def main():
    args = parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if not torch.cuda.is_available():
        print("No CUDA GPU is visible: running the CPU reference path on a small shape instead.")
        q, k, v = (torch.randn(1, 256, 4, 64, dtype=dtype) for _ in range(3))
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=args.causal)
        ref, _ = naive_attention(q, k, v, 64 ** -0.5, args.causal, compute_dtype=torch.float64)
        print(f"CPU reference: out {tuple(out.shape)}, max |error| vs fp64 = {(out.double() - ref).abs().max():.2e}")
        return
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    out, _ = flash_cutlass.flash_forward(q, k, v, causal=args.causal)
    error = max_error(out, q, k, v, args.causal)
    flops = 4 * math.prod(shape) * args.seqlen / (2 if args.causal else 1)
    ours = median_ms(lambda: flash_cutlass.flash_forward(q, k, v, causal=args.causal), args.reps)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal),
                     args.reps)
    print(f"{torch.cuda.get_device_name()}  shape (batch, seqlen, heads, head_dim) = {shape}  "
          f"{args.dtype}  causal={args.causal}")
    print(f"max |out - fp32 reference| over the last 256 rows: {error:.2e}")
    print(f"flash_cutlass: {ours:8.3f} ms  {flops / ours / 1e9:7.1f} TFLOPS")
    print(f"torch SDPA   : {sdpa:8.3f} ms  {flops / sdpa / 1e9:7.1f} TFLOPS  (its default backend choice)")


if __name__ == "__main__":
    main()

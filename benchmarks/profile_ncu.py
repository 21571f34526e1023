#!/usr/bin/env python3
"""Run one flash_cutlass.flash_forward (or, with --direction backward, flash_backward) call for
Nsight Compute to profile.

The script makes random q, k, v of shape (batch, seqlen, heads, head_dim), calls flash_forward
--warmup times, then makes the one profiled call. That call sits between
torch.cuda.profiler.start() and stop() (cudaProfilerStart/cudaProfilerStop) and inside an NVTX
range named "flash_forward" ("flash_backward"), so ncu can single it out in either of these ways
(for the backward, filter with regex:flash_bwd_sm, its main kernel):

1. Profiler start/stop, which benchmarks/profile_ncu.sh uses; warm-up launches are never
   profiled, whatever their number:

       ncu --clock-control none --profile-from-start off -k regex:flash_fwd --launch-count 1 \\
           --section SpeedOfLight python3 benchmarks/profile_ncu.py --seqlen 8192

2. Counting launches: skip the warm-up launches of kernels whose names match the filter. When
   each flash_forward call launches one such kernel, N equals --warmup (default 3):

       ncu --clock-control none -k regex:flash_fwd --launch-skip 3 --launch-count 1 \\
           --section SpeedOfLight python3 benchmarks/profile_ncu.py --warmup 3

   Or select by the NVTX range instead of counting: add --nvtx --nvtx-include "flash_forward/"
   and drop --launch-skip.

Keep --clock-control none so the kernel runs at the clocks it is benchmarked at.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NVTX_RANGES = {"forward": "flash_forward", "backward": "flash_backward"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Launch flash_cutlass.flash_forward --warmup times, then once more between "
                    "cudaProfilerStart/Stop and inside the NVTX range 'flash_forward', so "
                    "Nsight Compute can profile exactly that launch (see the module docstring "
                    "and benchmarks/profile_ncu.sh). q, k, v are random, of shape (batch, "
                    "seqlen, heads, head_dim); seqlen_k = seqlen_q and heads_k = heads.",
    )
    parser.add_argument("--batch", type=int, default=2, help="batch size (default: %(default)s)")
    parser.add_argument("--seqlen", type=int, default=8192,
                        help="sequence length of q and k (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=16,
                        help="number of heads (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="head dim; must be one of flash_cutlass.compiled_head_dims() "
                             "(default: %(default)s)")
    parser.add_argument("--causal", action="store_true", help="use the causal mask")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="dtype of q, k and v (default: %(default)s)")
    parser.add_argument("--kernel", choices=("auto", "sm80", "sm90"), default="auto",
                        help="the kernel choice of the profiled call (default: %(default)s: the Hopper "
                             "path on an H100/H200, the sm80 path otherwise)")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward",
                        help="profile flash_forward, or flash_backward (its forward runs once, before "
                             "the warm-up; ncu's kernel filter then wants flash_bwd_sm) (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="calls before the profiled one (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs (default: %(default)s)")
    args = parser.parse_args(argv)
    if min(args.batch, args.seqlen, args.heads, args.head_dim) < 1 or args.warmup < 0:
        parser.error("--batch, --seqlen, --heads and --head-dim must be positive, "
                     "--warmup non-negative")
    return args


def profiled_call(args: argparse.Namespace, flash_cutlass, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor):
    """The call to profile, with --causal and --kernel: flash_forward, or flash_backward after one
    flash_forward (whose outputs it takes, with a random dout)."""
    if args.direction == "forward":
        return lambda: flash_cutlass.flash_forward(q, k, v, causal=args.causal, kernel=args.kernel)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=args.causal, kernel=args.kernel)
    dout = torch.randn_like(out)
    return lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=args.causal, kernel=args.kernel)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"profile_ncu.py: no CUDA GPU is visible to torch {torch.__version__} "
                 f"(CUDA build {torch.version.cuda}); there is no kernel to profile.")
    try:
        import flash_cutlass
    except ImportError as err:
        sys.exit(f"cannot import flash_cutlass ({err}). Install it from the repository root "
                 f"with `pip install --no-build-isolation -e .`.")
    compiled = tuple(flash_cutlass.compiled_head_dims())
    if args.head_dim not in compiled:
        sys.exit(f"--head-dim {args.head_dim} is not compiled into flash_cutlass (compiled: "
                 f"{', '.join(map(str, compiled))}).")

    torch.manual_seed(args.seed)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPES[args.dtype]) for _ in range(3))
    call = profiled_call(args, flash_cutlass, q, k, v)
    name = NVTX_RANGES[args.direction]
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()

    torch.cuda.profiler.start()
    torch.cuda.nvtx.range_push(name)
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()

    print(f"profiled one {name} call after {args.warmup} warm-up calls: batch {args.batch}, "
          f"seqlen {args.seqlen}, heads {args.heads}, head_dim {args.head_dim}, "
          f"causal {args.causal}, {args.dtype}, kernel {args.kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What one call costs besides its main kernel: the CUDA kernels (and their GPU time), the
allocations and the host time of flash_cutlass's forward, backward and the user's path
(flash_attention(...) then .backward()) on one shape, next to torch SDPA's cuDNN backend.

    python3 tools/profile_calls.py --head-dim 64 --seqlen 1024
    python3 tools/profile_calls.py --head-dim 128 --seqlen 4096 --causal

Each path runs --warmup times, then once under torch.profiler; the table lists every kernel the
profiled call launched with its GPU time, then the host time of --reps calls (median, CUDA events
and perf_counter). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def paths(q, k, v, dout, causal):
    """name -> callable of one call of that path."""
    import flash_cutlass

    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    dout_bhsd = dout.transpose(1, 2).contiguous()

    def user_path():
        flash_cutlass.flash_attention(*leaves, causal=causal).backward(dout)

    def cudnn_user_path():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(*bhsd, is_causal=causal).backward(dout_bhsd)

    return {
        "flash_forward": lambda: flash_cutlass.flash_forward(q, k, v, causal=causal),
        "flash_backward": lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse, causal=causal),
        "flash_attention fwd+bwd": user_path,
        "sdpa cudnn fwd+bwd": cudnn_user_path,
    }


def kernel_table(fn) -> list[tuple[str, int, float]]:
    """(kernel name, launches, GPU microseconds) of one call of fn."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, total = rows.get(event.name, (0, 0.0))
            rows[event.name] = (count + 1, total + event.device_time)
    return sorted(((name, n, t) for name, (n, t) in rows.items()), key=lambda row: -row[2])


def timings(fn, reps: int) -> tuple[float, float]:
    """Median GPU milliseconds (CUDA events) and host milliseconds (perf_counter, to the return of
    the call) of fn."""
    gpu, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - begin) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim (default: %(default)s)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_calls.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 1
    batch, heads = max(1, args.tokens // args.seqlen), max(1, args.hidden // args.head_dim)
    shape = (batch, args.seqlen, heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"shape (batch, seqlen, heads, head_dim) = {shape}, causal={args.causal}, bf16")
    for name, fn in paths(q, k, v, dout, args.causal).items():
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
        fn()
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - allocated
        gpu_ms, host_ms = timings(fn, args.reps)
        table = kernel_table(fn)
        print(f"\n{name}: {gpu_ms:.3f} ms GPU, {host_ms:.3f} ms host to return, {allocations} allocations, "
              f"{sum(n for _, n, _ in table)} kernels")
        for kernel, launches, micros in table:
            print(f"  {micros:9.1f} us  x{launches}  {kernel[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Context-parallel (ring) attention benchmark: ring_flash_attention over a torchrun job's GPUs, or emulated on one.

flash_cutlass.distributed.ring_flash_attention runs on every GPU of a torchrun job, or the ring
of --emulate ranks runs in one process on one GPU.

Multi-GPU (NCCL, one process per GPU):
    torchrun --nproc-per-node 8 benchmarks/benchmark_ring.py --seqlens 65536,131072
One GPU, the ring emulated (every rank's calls on this GPU, K/V copies on a side stream):
    python3 benchmarks/benchmark_ring.py --emulate 4 --seqlens 16384 --trace ring_trace.json

Reported per shape (full sequence of `seqlen` tokens, batch, heads, heads_k, head_dim):
- ring: the time of one call (the slowest rank's, ranks started together) and its TFLOPS per
  GPU = FLOPs of attention over the full sequence / world_size / time. FLOPs: forward
  4 * batch * heads * seqlen^2 * head_dim, half for causal; forward+backward 3.5x that.
- single: TFLOPS of flash_attention on one GPU at the same per-GPU work: the full sequence
  shortened to seqlen / sqrt(world_size) (rounded to a multiple of 128), whose FLOPs equal one
  rank's share of the ring's, same mask. With --emulate the one GPU does every rank's work, so
  the comparison is flash_attention over the full sequence.
- efficiency: ring TFLOPS per GPU / single TFLOPS (1.00: the ring costs nothing over one kernel
  doing the same work: chunking, merging and communication all hidden).
Times: medians over --rounds of --reps calls each, after --warmup calls. --device cpu runs the
script on the CPU reference path (gloo; for checking the script without a GPU, the times mean
nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DIRECTIONS = {"forward": 1.0, "forward+backward": 3.5}


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, direction: str) -> float:
    """FLOPs of attention over a sequence of seqlen (seqlen_q = seqlen_k) in `direction`."""
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / (2 if causal else 1) * DIRECTIONS[direction]


def same_work_seqlen(seqlen: int, world_size: int, multiple: int = 128) -> int:
    """The sequence length whose attention has the FLOPs of one rank's share of a ring over
    seqlen tokens (seqlen / sqrt(world_size)), rounded to a multiple of `multiple`."""
    return max(multiple, round(seqlen / math.sqrt(world_size) / multiple) * multiple)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=_int_list, default=[16384, 65536],
                        help="full-sequence lengths, comma-separated (default 16384,65536); each a multiple of "
                             "2 * world_size (load_balanced) or world_size (contiguous)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--heads", type=int, default=64, help="query heads (default 64)")
    parser.add_argument("--heads-k", type=int, default=8, help="key/value heads (default 8: GQA, as NVIDIA's "
                                                               "published H200 shape)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--causal", choices=("true", "false", "both"), default="both",
                        help="causal mask (default both)")
    parser.add_argument("--direction", choices=tuple(DIRECTIONS), default="forward",
                        help="forward, or forward+backward (autograd; default forward)")
    parser.add_argument("--layout", choices=("load_balanced", "contiguous"), default="load_balanced",
                        help="how the sequence is sharded (default load_balanced)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="default bf16")
    parser.add_argument("--emulate", type=int, default=0, metavar="W",
                        help="run the ring of W ranks in this one process on one GPU (no torchrun)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per shape (default 5)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median round counts (default 3)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write a chrome trace (torch.profiler) of one ring call of the first shape; under "
                             "torchrun each rank writes its own, with .rank<r> before the suffix")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON (rank 0)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the CPU reference path over gloo, to check the script without a GPU")
    args = parser.parse_args(argv)
    if args.emulate < 0:
        parser.error("--emulate must be >= 0")
    return args


class Clock:
    """Timing of a block of calls on this device, the slowest rank's when a group is given."""

    def __init__(self, device: torch.device, group):
        self.device, self.group = device, group

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def per_call_ms(self, fn, reps: int) -> float:
        import torch.distributed as dist

        if self.group is not None:
            dist.barrier(self.group)
        self._sync()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            self._sync()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            for _ in range(reps):
                fn()
            elapsed = (time.perf_counter() - began) * 1e3
        if self.group is not None:
            slowest = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            elapsed = float(slowest)
        return elapsed / reps

    def median_ms(self, fn, args) -> float:
        for _ in range(args.warmup):
            fn()
        return statistics.median(self.per_call_ms(fn, args.reps) for _ in range(args.rounds))


def runner(attend, leaves, douts, direction: str):
    """One call of `attend(*leaves)` (a list of outputs), with its backward (the gradients douts
    of the outputs) for forward+backward."""
    if direction == "forward":
        def forward():
            with torch.no_grad():
                attend(*leaves)
        return forward
    return lambda: torch.autograd.grad(attend(*leaves), leaves, douts)


def random_leaves(shapes, dtype, device, generator):
    return [torch.randn(*shape, generator=generator, device=device).to(dtype).requires_grad_() for shape in shapes]


def measure_shape(args, seqlen: int, causal: bool, world_size: int, rank: int, group, device, generator) -> dict:
    import flash_cutlass
    import flash_cutlass.distributed as cp

    dtype = DTYPES[args.dtype]
    clock = Clock(device, group)
    local = seqlen // world_size
    q_shape = (args.batch, local, args.heads, args.head_dim)
    kv_shape = (args.batch, local, args.heads_k, args.head_dim)
    options = {"causal": causal, "layout": args.layout}
    if args.emulate:
        shards = [random_leaves((q_shape, kv_shape, kv_shape), dtype, device, generator) for _ in range(world_size)]
        leaves = [shard[i] for i in range(3) for shard in shards]
        douts = [torch.randn(q_shape, generator=generator, device=device).to(dtype) for _ in range(world_size)]

        def attend(*tensors):
            return cp.emulated_ring_flash_attention(tensors[:world_size], tensors[world_size:2 * world_size],
                                                    tensors[2 * world_size:], **options)

        single_seqlen = seqlen  # one GPU does every rank's work
    else:
        leaves = random_leaves((q_shape, kv_shape, kv_shape), dtype, device, generator)
        douts = [torch.randn(q_shape, generator=generator, device=device).to(dtype)]

        def attend(q, k, v):
            return [cp.ring_flash_attention(q, k, v, group, **options)]

        single_seqlen = same_work_seqlen(seqlen, world_size)
    ring_call = runner(attend, leaves, douts, args.direction)
    ring_ms = clock.median_ms(ring_call, args)

    single = random_leaves(((args.batch, single_seqlen, args.heads, args.head_dim),
                            (args.batch, single_seqlen, args.heads_k, args.head_dim),
                            (args.batch, single_seqlen, args.heads_k, args.head_dim)), dtype, device, generator)
    single_douts = [torch.randn(single[0].shape, generator=generator, device=device).to(dtype)]
    single_call = runner(lambda q, k, v: [flash_cutlass.flash_attention(q, k, v, causal=causal)], single,
                         single_douts, args.direction)
    # Each GPU runs its own single-GPU kernel; the slowest one counts, as for the ring.
    single_ms = clock.median_ms(single_call, args)

    ring_tflops = attention_flops(args.batch, args.heads, seqlen, args.head_dim, causal, args.direction) / (
        1 if args.emulate else world_size) / ring_ms / 1e9
    single_tflops = attention_flops(args.batch, args.heads, single_seqlen, args.head_dim, causal,
                                    args.direction) / single_ms / 1e9
    return {"seqlen": seqlen, "causal": causal, "world_size": world_size, "emulated": bool(args.emulate),
            "ring_ms": ring_ms, "ring_tflops_per_gpu": ring_tflops, "single_seqlen": single_seqlen,
            "single_ms": single_ms, "single_tflops": single_tflops, "efficiency": ring_tflops / single_tflops,
            "trace": None, "ring_call": ring_call}


def write_trace(path: Path, call, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    profiler.export_chrome_trace(str(path))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmark_ring.py needs a CUDA GPU (or --device cpu to check the script); none is visible")
        return 1
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.emulate and world_size > 1:
        print("--emulate runs in one process: start it with python3, not torchrun")
        return 1
    group, rank = None, 0
    device = torch.device(args.device)
    if not args.emulate:
        rank = int(os.environ.get("RANK", "0"))
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ:  # a single process started without torchrun
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world_size)
        group = dist.group.WORLD
    ring_size = args.emulate or world_size
    generator = torch.Generator(device=device).manual_seed(rank)
    causals = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    rows = []
    for seqlen in args.seqlens:
        for causal in causals:
            row = measure_shape(args, seqlen, causal, ring_size, rank, group, device, generator)
            if args.trace is not None and not rows:
                path = args.trace if args.emulate or world_size == 1 else args.trace.with_suffix(
                    f".rank{rank}{args.trace.suffix}")
                write_trace(path, row["ring_call"], device)
                row["trace"] = str(path)
            del row["ring_call"]
            rows.append(row)
            if rank == 0:
                mode = f"{ring_size} ranks emulated on 1 GPU" if args.emulate else f"{ring_size} ranks"
                print(f"seqlen {seqlen:>7} causal {str(causal):5} {mode}: ring {row['ring_ms']:9.3f} ms "
                      f"{row['ring_tflops_per_gpu']:7.1f} TFLOPS/GPU | single seqlen {row['single_seqlen']:>7} "
                      f"{row['single_tflops']:7.1f} TFLOPS | efficiency {row['efficiency']:.2f}", flush=True)
    if rank == 0 and args.json is not None:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "dtype": args.dtype, "direction": args.direction, "layout": args.layout,
                "batch": args.batch, "heads": args.heads, "heads_k": args.heads_k, "head_dim": args.head_dim}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if dist.is_initialized():
        # Every rank leaves the group together: gloo aborted a process whose peer had already left.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

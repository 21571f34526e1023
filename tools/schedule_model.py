#!/usr/bin/env python3
"""A model of how the Hopper forward's grid spreads its query tiles over the SMs: the share of
the SMs' time that is busy under each schedule, for the benchmark's shapes (16k tokens per batch,
hidden 2048). No GPU; it explains the grid orders of include/flash_cutlass/common/block_info.h
(docs/PERFORMANCE.md, what was tried).

A tile (one query block of one (batch, head)) costs the key blocks it visits plus a fixed cost
(--tile-overhead, in key blocks: its first scores, its epilogue). One CTA runs on an SM at a time
(the Hopper kernels fill its shared memory), and the kernel ends when the busiest SM is done; the
model counts time at a fixed rate, so it overstates an idle tail's cost on a GPU whose clocks rise
when SMs go idle. Schedules:

  pairs          persistent grid, one CTA per SM taking pairs (m, last - m) of one (batch, head):
                 pair blockIdx.x + k * gridDim.x at step k (shipped for causal tiles at head dims
                 64 and 128 until 2026-11-30)
  pairs, tail    the same up to the last full wave of pairs; that wave's pairs and the partial
                 one's as single tiles, longest first, dealt to the CTAs in a snake (block_info.h's
                 causal tail; shipped for causal tiles at head dims 64 and 128)
  singly         persistent grid taking tiles blockIdx.x + k * gridDim.x (shipped for tiles of one
                 cost at head dims 64 and 128)
  in order       one CTA per tile, started in blockIdx order as SMs free up; each (batch, head)'s
                 query blocks from the last to the first (shipped without a mask at head dim 256)
  longest first  the same with tiles numbered longest first across bands of (batch, head) pairs
                 whose K and V fit 16 MiB (shipped for causal tiles at head dim 256)
  snake          persistent grid taking tiles longest first over the whole grid (query blocks from
                 the last, every (batch, head) inner), a row of gridDim.x tiles a step, every other
                 row reversed (not shipped: a step's tiles span every (batch, head), whose K and V
                 then come from HBM)
  banded snake   the same over the longest-first order with bands (not shipped: a band restarts at
                 its longest tiles, so the cost along the numbering is a sawtooth and reversed rows
                 pair long tiles with long ones; measured 24-28% slower at head dim 128 causal,
                 docs/PERFORMANCE.md)
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys

TOKENS_PER_BATCH = 16384
HIDDEN_SIZE = 2048
SCHEDULES = ("pairs", "pairs, tail", "singly", "in order", "longest first", "snake", "banded snake")
BAND_BYTES = 16 << 20  # longest_first_query_tile_of_this_cta's band: K and V within 16 MiB
CAUSAL_NARROW_TILES_MAX_SEQLEN_Q = 2048  # fwd_launch.h: kCausalNarrowTilesMaxSeqlenQ


def tile_shape(head_dim: int, causal: bool, seqlen_q: int) -> tuple[int, int, bool]:
    """(block_m, block_n, persistent) of the kernel the call runs (sm90/tile_config.h,
    sm90/fwd_launch.h: kernels without runtime options)."""
    if head_dim == 64:
        if causal and seqlen_q <= CAUSAL_NARROW_TILES_MAX_SEQLEN_Q:
            return 128, 128, True
        return 192, 128, True
    if head_dim == 128:
        return 128, 128, True
    if head_dim == 256:
        return 128, 64, False
    raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")


def shipped_schedule(persistent: bool, causal: bool) -> str:
    if persistent:
        return "pairs, tail" if causal else "singly"
    return "longest first" if causal else "in order"


def key_blocks(m_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Key blocks a query block visits (a causal mask aligned to the bottom right, as the kernels'):
    block_info.h's key_block_range without a window."""
    if not causal:
        return math.ceil(seqlen_k / block_n)
    last_row = m_block * block_m + block_m - 1
    visible_end = max(0, min(seqlen_k, last_row + 1 + seqlen_k - seqlen_q))
    return math.ceil(visible_end / block_n)


def longest_first_order(num_m_blocks: int, batch_heads: int, seqlen_k: int, head_dim: int) -> list[tuple[int, int]]:
    """(m_block, batch_head) of tile 0, 1, ... as longest_first_query_tile_of_this_cta numbers them."""
    band = min(batch_heads, max(1, BAND_BYTES // (max(seqlen_k, 1) * head_dim * 4)))
    order = []
    for index in range(num_m_blocks * batch_heads):
        band_first = index // (band * num_m_blocks) * band
        band_size = min(band, batch_heads - band_first)
        in_band = index - band_first * num_m_blocks
        order.append((num_m_blocks - 1 - in_band // band_size, band_first + in_band % band_size))
    return order


def causal_tail(num_m_blocks: int, batch_heads: int, grid: int) -> tuple[int, list[tuple[int, int]]]:
    """The pairs before the causal tail and the tail's tiles (m_block, batch_head) in the order
    the CTAs deal them (block_info.h: persistent_work_of, causal_tail_tile_at_step): the tail
    starts at the last full wave of pairs, unless the pairs fill their waves exactly."""
    pairs_per_head = (num_m_blocks + 1) // 2
    items = pairs_per_head * batch_heads
    grid = min(grid, items)
    if grid < 1 or items % grid == 0:
        return items, []
    first_item = (items // grid - 1) * grid
    first_batch_head, first_pair = divmod(first_item, pairs_per_head)
    tiles = []
    for m_block in range(num_m_blocks - 1, -1, -1):
        in_first = first_pair <= m_block <= num_m_blocks - 1 - first_pair
        first = first_batch_head if in_first else first_batch_head + 1
        tiles.extend((m_block, batch_head) for batch_head in range(first, batch_heads))
    return first_item, tiles


def busy_share(schedule: str, head_dim: int, causal: bool, seqlen: int, batch: int, heads: int, sms: int,
               tile_overhead: float) -> float:
    """Share of the SMs' time busy (work / (sms * the busiest SM's time)) under a schedule."""
    block_m, block_n, _ = tile_shape(head_dim, causal, seqlen)
    num_m_blocks = math.ceil(seqlen / block_m)
    batch_heads = batch * heads

    def cost(m_block: int) -> float:
        return key_blocks(m_block, block_m, block_n, seqlen, seqlen, causal) + tile_overhead

    if schedule in ("pairs", "pairs, tail", "singly"):
        loads = [0.0] * sms
        if schedule in ("pairs", "pairs, tail"):
            pairs_per_head = (num_m_blocks + 1) // 2
            paired, tail = pairs_per_head * batch_heads, []
            if schedule == "pairs, tail":
                paired, tail = causal_tail(num_m_blocks, batch_heads, sms)
            for pair in range(paired):
                low = pair % pairs_per_head
                high = num_m_blocks - 1 - low
                loads[pair % sms] += cost(high) + (cost(low) if low != high else 0.0)
            grid = min(sms, pairs_per_head * batch_heads)
            for index, (m_block, _) in enumerate(tail):
                step, position = divmod(index, grid)
                loads[position if step % 2 == 0 else grid - 1 - position] += cost(m_block)
        else:
            for index in range(num_m_blocks * batch_heads):
                loads[index % sms] += cost(num_m_blocks - 1 - index % num_m_blocks)
        return sum(loads) / (sms * max(loads))
    if schedule in ("snake", "banded snake"):
        if schedule == "snake":
            order = [num_m_blocks - 1 - index // batch_heads for index in range(num_m_blocks * batch_heads)]
        else:
            order = [m_block for m_block, _ in longest_first_order(num_m_blocks, batch_heads, seqlen, head_dim)]
        loads = [0.0] * sms
        for index, m_block in enumerate(order):
            step, position = divmod(index, sms)
            loads[position if step % 2 == 0 else sms - 1 - position] += cost(m_block)
        return sum(loads) / (sms * max(loads))
    if schedule == "in order":
        order = [(num_m_blocks - 1 - index % num_m_blocks) for index in range(num_m_blocks * batch_heads)]
    elif schedule == "longest first":
        order = [m_block for m_block, _ in longest_first_order(num_m_blocks, batch_heads, seqlen, head_dim)]
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    free_at = [0.0] * sms  # each CTA starts on the SM that frees first
    for m_block in order:
        heapq.heapreplace(free_at, free_at[0] + cost(m_block))
    total = sum(cost(m_block) for m_block in order)
    return total / (sms * max(free_at))


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=parse_int_list, default=[64, 128, 256], metavar="D[,D...]",
                        help="head dims: 64, 128, 256 (default: all three)")
    parser.add_argument("--seqlens", type=parse_int_list, default=[1024, 2048, 4096, 8192, 16384], metavar="S[,S...]",
                        help="sequence lengths, seqlen_q = seqlen_k (default: 1k-16k)")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default: 132, the H200's)")
    parser.add_argument("--tile-overhead", type=float, default=2.0,
                        help="a tile's fixed cost in key blocks (default: 2)")
    args = parser.parse_args(argv)
    for head_dim in args.head_dims:
        if head_dim not in (64, 128, 256):
            parser.error(f"--head-dims: 64, 128 or 256, got {head_dim}")
    if args.sms <= 0:
        parser.error(f"--sms must be positive, got {args.sms}")
    if args.tile_overhead < 0:
        parser.error(f"--tile-overhead must be >= 0, got {args.tile_overhead}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("Busy share of the SMs' time per schedule; * marks the one the kernels use.\n")
    print("| hdim | causal | seqlen | batch | heads | " + " | ".join(SCHEDULES) + " |")
    print("|---:|---|---:|---:|---:|" + "---:|" * len(SCHEDULES))
    for head_dim in args.head_dims:
        heads = HIDDEN_SIZE // head_dim
        for causal in (False, True):
            for seqlen in args.seqlens:
                batch = max(1, TOKENS_PER_BATCH // seqlen)
                _, _, persistent = tile_shape(head_dim, causal, seqlen)
                shipped = shipped_schedule(persistent, causal)
                cells = []
                for schedule in SCHEDULES:
                    share = busy_share(schedule, head_dim, causal, seqlen, batch, heads, args.sms, args.tile_overhead)
                    cells.append(f"{share:.3f}{'*' if schedule == shipped else ''}")
                print(f"| {head_dim} | {'yes' if causal else 'no'} | {seqlen} | {batch} | {heads} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

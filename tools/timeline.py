#!/usr/bin/env python3
"""Where the Hopper forward's tiles spend their cycles: a developer's timeline.

Needs a build with FLASH_CUTLASS_TIMELINE=1 (compiled out otherwise): the first thread of the
producer and of each consumer warpgroup writes clock64() at fixed points of every tile
(include/flash_cutlass/sm90/timeline.h). This script runs --warmup calls of one shape, clears the
timeline, runs one more call and prints, per consumer warpgroup, the median SM cycles of each
phase of a tile, the cycles per key block after the first, the phases of one steady step of the
key loop (the one scoring a tile's fourth key block from the end: the waits for K/V and for the
ping-pong's turn, the GEMMs' issue, the waits for S and for the P·V before, the softmax), and the
spread of the CTAs' spans:

    FLASH_CUTLASS_TIMELINE=1 FLASH_CUTLASS_CUDA_ARCHS=90 pip install --no-build-isolation -e .
    python3 tools/timeline.py --head-dim 128 --seqlen 2048

The shape defaults to the benchmark's (16k tokens per batch, hidden 2048). Stamps cost a few
instructions a tile and a test, a clock read and a store each in every step of the key loop
(ptxas: the steady loop of head dim 128 without a mask 522 -> 547), so compare timelines with
timelines, not with benchmark times. Only the first 256 CTAs and 64 tiles of each
are recorded (FwdTimeline in include/flash_cutlass/fwd_api.h).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchmark_forward import DTYPES, HIDDEN_SIZE, TOKENS_PER_BATCH, benchmark_cases  # noqa: E402

# Consumer events (TimelineEvent in include/flash_cutlass/sm90/timeline.h) and the phases between them.
TILE_START, Q_ARRIVED, FIRST_SCORES, FIRST_BLOCK_DONE, LAST_PV, FINALIZED, O_STAGED, O_STORE_ISSUED = range(8)
# The probed steady-state step of a tile's key loop (events 8-15): the step that scores the fourth
# key block from the end of the tile's range.
STEP_START, STEP_STAGES_READY, STEP_TURN_TAKEN, STEP_GEMMS_ISSUED, STEP_SCORES, STEP_SOFTMAX_DONE, STEP_PV, STEP_DONE = range(8, 16)
KEY_BLOCKS = 4  # the producer's (warpgroup 0) value: key blocks the tile visits
STEP_PHASES = (
    ("waits for K and V", STEP_START, STEP_STAGES_READY),
    ("wait for the turn", STEP_STAGES_READY, STEP_TURN_TAKEN),
    ("S and the P·V before issued", STEP_TURN_TAKEN, STEP_GEMMS_ISSUED),
    ("wait for S", STEP_GEMMS_ISSUED, STEP_SCORES),
    ("softmax", STEP_SCORES, STEP_SOFTMAX_DONE),
    ("wait for the P·V before", STEP_SOFTMAX_DONE, STEP_PV),
    ("O rescaled, P stored", STEP_PV, STEP_DONE),
)
PHASES = (
    ("wait for Q", TILE_START, Q_ARRIVED),
    ("first S = Q K^T", Q_ARRIVED, FIRST_SCORES),
    ("first block's softmax", FIRST_SCORES, FIRST_BLOCK_DONE),
    ("other key blocks", FIRST_BLOCK_DONE, LAST_PV),
    ("finalize", LAST_PV, FINALIZED),
    ("O into shared memory", FINALIZED, O_STAGED),
    ("O's store issued", O_STAGED, O_STORE_ISSUED),
)


def _median(values: list[int]) -> float | None:
    return float(torch.tensor(values, dtype=torch.float64).median()) if values else None


def phase_table(timeline: torch.Tensor) -> dict:
    """Medians over the recorded tiles of a (ctas, steps, warpgroups, events) timeline: per consumer
    warpgroup, each phase's cycles, the cycles per key block after the first, and the cycles from a
    tile's last stamp to the next tile's start; the phases of the probed key-loop step, over the
    tiles that recorded all of its stamps; and the CTAs' spans (first tile start to last stamp)."""
    stamps = timeline.to(torch.int64).tolist()
    table: dict = {"warpgroups": {}, "steps": {}}
    for warpgroup in range(1, len(stamps[0][0]) if stamps and stamps[0] else 0):
        phases: dict[str, list[int]] = {name: [] for name, _, _ in PHASES}
        step_phases: dict[str, list[int]] = {name: [] for name, _, _ in STEP_PHASES}
        step_totals = []
        per_block, to_next = [], []
        for cta in stamps:
            tiles = [(step[0][KEY_BLOCKS], step[warpgroup]) for step in cta if step[warpgroup][TILE_START] != 0]
            for i, (blocks, tile) in enumerate(tiles):
                for name, begin, end in PHASES:
                    if tile[begin] and tile[end]:
                        phases[name].append(tile[end] - tile[begin])
                if len(tile) > STEP_DONE and all(tile[STEP_START:STEP_DONE + 1]):
                    for name, begin, end in STEP_PHASES:
                        step_phases[name].append(tile[end] - tile[begin])
                    step_totals.append(tile[STEP_DONE] - tile[STEP_START])
                if blocks > 1 and tile[FIRST_BLOCK_DONE] and tile[LAST_PV]:
                    per_block.append((tile[LAST_PV] - tile[FIRST_BLOCK_DONE]) / (blocks - 1))
                if i + 1 < len(tiles):
                    to_next.append(tiles[i + 1][1][TILE_START] - max(tile))
        if not any(phases.values()):
            continue
        row = {name: _median(values) for name, values in phases.items()}
        row["per key block after the first"] = _median(per_block)
        row["to the next tile's start"] = _median(to_next)
        table["warpgroups"][warpgroup] = row
        if step_totals:
            step_row = {name: _median(values) for name, values in step_phases.items()}
            step_row["the step"] = _median(step_totals)
            table["steps"][warpgroup] = step_row
    spans = []
    for cta in stamps:
        starts = [tile[TILE_START] for step in cta for tile in step[1:] if tile[TILE_START] != 0]
        if starts:
            spans.append(max(max(tile) for step in cta for tile in step[1:]) - min(starts))
    if spans:
        spans_t = torch.tensor(spans, dtype=torch.float64)
        table["cta_span"] = {"min": float(spans_t.min()), "median": float(spans_t.median()),
                             "max": float(spans_t.max()), "max_over_mean": float(spans_t.max() / spans_t.mean())}
    return table


def format_table(table: dict) -> str:
    warpgroups = sorted(table["warpgroups"])
    names = [name for name, _, _ in PHASES] + ["per key block after the first", "to the next tile's start"]
    lines = ["| phase | " + " | ".join(f"warpgroup {w}" for w in warpgroups) + " |",
             "|---|" + "---:|" * len(warpgroups)]
    for name in names:
        cells = [table["warpgroups"][w][name] for w in warpgroups]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells) + " |")
    steps = sorted(table.get("steps", {}))
    if steps:
        lines += ["", f"A steady step of the key loop (the one scoring the tile's fourth key block from the end; "
                      f"{len(steps)} warpgroups):",
                  "| phase | " + " | ".join(f"warpgroup {w}" for w in steps) + " |",
                  "|---|" + "---:|" * len(steps)]
        for name in [name for name, _, _ in STEP_PHASES] + ["the step"]:
            cells = [table["steps"][w][name] for w in steps]
            lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    if "cta_span" in table:
        span = table["cta_span"]
        lines.append(f"\nCTA spans (cycles): min {span['min']:.0f}, median {span['median']:.0f}, max {span['max']:.0f} "
                     f"(max / mean {span['max_over_mean']:.3f})")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=TOKENS_PER_BATCH,
                        help=f"batch = tokens / seqlen (default {TOKENS_PER_BATCH})")
    parser.add_argument("--hidden", type=int, default=HIDDEN_SIZE,
                        help=f"heads = hidden / head dim (default {HIDDEN_SIZE})")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=20, help="calls before the recorded one (default 20)")
    parser.add_argument("--json", help="also write the table to this file")
    args = parser.parse_args(argv)
    for name in ("head_dim", "seqlen", "tokens", "hidden"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.tokens < args.seqlen or args.hidden < args.head_dim:
        parser.error("--tokens must be >= --seqlen and --hidden >= --head-dim")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("timeline.py needs a CUDA GPU (the Hopper path: compute capability 9.0)", file=sys.stderr)
        return 1
    import flash_cutlass
    from flash_cutlass.backend import _extension, forward_timeline

    if not _extension().compiled_timeline:
        print("this build records no timeline: rebuild with FLASH_CUTLASS_TIMELINE=1", file=sys.stderr)
        return 1
    (case,) = benchmark_cases([args.head_dim], [args.seqlen], [args.causal], args.tokens, args.hidden)
    batch, heads = case.batch, case.heads
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=DTYPES[args.dtype])
               for _ in range(3))
    for _ in range(args.warmup):
        flash_cutlass.flash_forward(q, k, v, causal=args.causal, kernel="sm90")
    torch.cuda.synchronize()
    forward_timeline(args.head_dim)  # clears what the warm-up left
    flash_cutlass.flash_forward(q, k, v, causal=args.causal, kernel="sm90")
    torch.cuda.synchronize()
    table = phase_table(forward_timeline(args.head_dim))
    print(f"head dim {args.head_dim}, seqlen {args.seqlen}, batch {batch}, heads {heads}, "
          f"{'causal' if args.causal else 'no mask'}, {args.dtype}: median SM cycles a tile")
    print(format_table(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

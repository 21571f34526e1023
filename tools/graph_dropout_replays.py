#!/usr/bin/env python3
"""Replays of freshly captured dropout forwards against the eager call at each replay's recorded
(seed, offset). Each capture draws from a generator registered with its graph, as test_dropout's
graph tests do; a replay must compute bitwise what `flash_forward(..., rng_state=recorded)` computes.

Why: under 8 pytest processes on one H100, test_dropout's graph tests have failed now and then
(2026-12-06/07), and a first form of this probe caught one: the first replay of a fresh capture
differed from the eager call in one whole query block (8,105 of 130,560 elements), where later
replays and 3,200 eager repeats were bitwise equal. One suspect lies outside the kernel: before 2.13, torch's
capture_begin resets a registered generator's graph offset with a fill on the capture stream,
uncaptured, and nothing orders that fill before the first replay's own fill of the offset on the
replaying stream; a kernel reading the offset meanwhile draws at offset 0. --sync-after-capture
waits for the device after each capture, as the tests' capture_graph and the README's advice do:
if that removes the mismatches, the suspect is confirmed.

For a differing replay the probe prints the rows that differ, whether they were left unwritten
(each replay's output is filled with NaN first), and which (seed, offset) from 0 to the recorded
offset reproduces them in an eager call. Needs a CUDA GPU and a build with the dropout kernels.

  python3 tools/graph_dropout_replays.py --captures 64          # run 8 at once to load the GPU
  python3 tools/graph_dropout_replays.py --captures 64 --sync-after-capture

Exits 1 if any replay differed."""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import flash_cutlass  # noqa: E402

DROPOUT_P = 0.2


def explain(q, k, v, causal, replay_out, eager_out, state):
    """The differing rows of a replay, and the eager states that reproduce them."""
    differing = (replay_out != eager_out).any(dim=-1)  # (batch, seqlen_q, heads)
    where = differing.nonzero()
    batches = sorted(set(where[:, 0].tolist()))
    heads = sorted(set(where[:, 2].tolist()))
    unwritten = replay_out[differing].isnan().any(dim=-1).float().mean().item()
    seed, offset = int(state[0]), int(state[1])
    matches = []
    for candidate in range(0, offset + 8, 4):
        out, _, _ = flash_cutlass.flash_forward(q, k, v, dropout_p=DROPOUT_P, causal=causal,
                                                rng_state=torch.tensor([seed, candidate]))
        if torch.equal(out[differing], replay_out[differing]):
            matches.append(candidate)
    return (f"{len(where)} rows differ (batches {batches}, heads {heads}, queries {where[:, 1].min().item()}-"
            f"{where[:, 1].max().item()}); unwritten: {unwritten:.2f}; offsets reproducing them at seed {seed}: "
            f"{matches if matches else 'none in 0..' + str(offset + 4)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captures", type=int, default=64, help="fresh captures, causal and not in turn")
    parser.add_argument("--replays", type=int, default=2, help="replays of each capture")
    parser.add_argument("--sync-after-capture", action="store_true",
                        help="torch.cuda.synchronize() between each capture and its first replay")
    parser.add_argument("--head-dim", type=int, default=None, help="default: the smallest this build holds")
    parser.add_argument("--seed", type=int, default=0, help="of the inputs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (CUDA graphs)")
    if not flash_cutlass.compiled_dropout():
        parser.error("this build has no dropout kernels (FLASH_CUTLASS_DROPOUT=0)")
    head_dim = args.head_dim or min(flash_cutlass.compiled_head_dims())
    if head_dim not in flash_cutlass.compiled_head_dims():
        parser.error(f"--head-dim {head_dim} is not in this build ({flash_cutlass.compiled_head_dims()})")
    from helpers import capture_graph, cuda_inputs  # as the graph tests capture, with their inputs

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v, _ = cuda_inputs(gen, torch.bfloat16, 255, 320, 4, 2, head_dim)
    differing_by_replay = [0] * args.replays
    for index in range(args.captures):
        causal = index % 2 == 1
        generator = torch.Generator(device="cuda").manual_seed(5)

        def step():
            return flash_cutlass.flash_forward(q, k, v, dropout_p=DROPOUT_P, causal=causal, generator=generator)

        graph, (out, _, rng_state) = capture_graph(step, generators=(generator,),
                                                   synchronize=args.sync_after_capture)
        for replay in range(args.replays):
            out.fill_(float("nan"))
            graph.replay()
            replay_out, state = out.clone(), rng_state.cpu()
            eager_out, _, _ = flash_cutlass.flash_forward(q, k, v, dropout_p=DROPOUT_P, causal=causal, rng_state=state)
            if not torch.equal(replay_out, eager_out):
                differing_by_replay[replay] += 1
                print(f"capture {index} causal={causal} replay {replay} state {state.tolist()}: "
                      f"{explain(q, k, v, causal, replay_out, eager_out, state)}", flush=True)
    print(f"{args.captures} captures of head dim {head_dim}"
          f"{' (synchronized after capture)' if args.sync_after_capture else ''}: differing replays by replay "
          f"index {differing_by_replay}")
    return 1 if any(differing_by_replay) else 0


if __name__ == "__main__":
    sys.exit(main())

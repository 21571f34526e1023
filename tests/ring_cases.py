"""The cases of the ring-attention tests (tests/test_ring_attention.py) and the code that runs them:
full-sequence inputs, the ring on every rank's shards (in processes of a torch.distributed group,
spawned, or emulated in one process), and the check of the reassembled results against
single-process attention over the full sequence. Not a test module: spawned workers import it by
name, so it imports nothing from pytest."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Tuple

import torch

import flash_cutlass.distributed as cp
from flash_cutlass.reference import naive_attention


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    causal: bool = False
    window_size: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    layout: str = "load_balanced"
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    batch: int = 2
    # Tokens of a chunk (the full sequence has world_size * chunks-per-rank of them); odd on purpose.
    chunk: int = 5
    # A variable-length batch: each sequence's length in chunks (0: an empty sequence).
    chunks_per_sequence: Optional[Tuple[int, ...]] = None
    # Attention sinks (the same on every rank): the results then end with dsinks.
    with_sinks: bool = False

    @property
    def varlen(self) -> bool:
        return self.chunks_per_sequence is not None

    def sinks(self) -> Optional[torch.Tensor]:
        """Sinks spread around the scores' log-sum-exps, or None."""
        return torch.linspace(-1.0, 3.0, self.heads) if self.with_sinks else None

    def options(self) -> dict:
        return {"causal": self.causal, "window_size": self.window_size, "softcap": self.softcap,
                "layout": self.layout}

    def reference_options(self) -> dict:
        return {"window_size": self.window_size, "softcap": self.softcap}


# Run over 2 and 4 processes (gloo) and emulated: no mask, causal, windows, GQA/MHA, soft cap,
# both layouts, packed batches.
CASES = [
    Case("full_gqa"),
    Case("causal_mha", causal=True, heads_k=4),
    Case("causal_window_gqa", causal=True, window_size=(7, -1)),
    Case("window_both_sides_contiguous", window_size=(6, 3), layout="contiguous", heads_k=1),
    Case("causal_softcap", causal=True, softcap=3.0),
    Case("varlen_causal", causal=True, chunks_per_sequence=(3, 0, 1, 2)),
    Case("varlen_window", causal=True, window_size=(5, -1), chunks_per_sequence=(2, 4, 1), heads_k=1),
    Case("varlen_full_contiguous", layout="contiguous", chunks_per_sequence=(1, 3)),
    Case("causal_softcap_sinks", causal=True, softcap=3.0, heads_k=4, with_sinks=True),
    Case("varlen_causal_sinks", causal=True, chunks_per_sequence=(3, 0, 1, 2), with_sinks=True),
]

# The ring of two ranks inside a subgroup of the four-process run (its own inputs: seed + SUBGROUP_SEED).
SUBGROUP_CASE = CASES[1]
SUBGROUP_SEED = 1000


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "load_balanced" else 1


def full_inputs(case: Case, world_size: int, seed: int):
    """q, k, v, dout of the full sequence (bf16; packed with cu_seqlens for a varlen case, else
    None), normal draws from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    tokens_per_chunk_row = world_size * chunks_per_rank(case.layout) * case.chunk
    if case.varlen:
        lengths = [c * tokens_per_chunk_row for c in case.chunks_per_sequence]
        cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
        rows = (sum(lengths),)
    else:
        cu_seqlens = None
        rows = (case.batch, tokens_per_chunk_row)

    def rand(heads):
        return torch.randn(*rows, heads, case.head_dim, generator=gen).to(torch.bfloat16)

    return rand(case.heads), rand(case.heads_k), rand(case.heads_k), rand(case.heads), cu_seqlens


def shard(case: Case, x: torch.Tensor, cu_seqlens, rank: int, world_size: int) -> torch.Tensor:
    if case.varlen:
        return cp.shard_sequence_varlen(x, cu_seqlens, rank, world_size, layout=case.layout)
    return cp.shard_sequence(x, rank, world_size, layout=case.layout)


def unshard(case: Case, shards, cu_seqlens, lse: bool = False) -> torch.Tensor:
    """The full tensor from every rank's shard; lse shards have their tokens in the last dimension."""
    if lse:
        shards = [s.movedim(-1, 0) for s in shards]
        dim = 0
    else:
        dim = 0 if case.varlen else 1
    if case.varlen:
        full = cp.unshard_sequence_varlen(shards, cu_seqlens, layout=case.layout)
    else:
        full = cp.unshard_sequence(shards, layout=case.layout, dim=dim)
    return full.movedim(0, -1) if lse else full


def _sinks_leaves(case: Case, device) -> list:
    sinks = case.sinks()
    return [] if sinks is None else [sinks.to(device).requires_grad_()]


def _sinks_option(sinks_leaves: list) -> dict:
    return {"sinks": sinks_leaves[0]} if sinks_leaves else {}


def rank_results(case: Case, inputs, rank: int, world_size: int, group=None, device="cpu"):
    """This rank's (out, lse, dq, dk, dv[, dsinks: its part]) of ring_flash_attention(_varlen) and
    its backward."""
    q, k, v, dout, cu_seqlens = inputs
    local = [shard(case, t, cu_seqlens, rank, world_size).to(device) for t in (q, k, v, dout)]
    leaves = [t.requires_grad_() for t in local[:3]]
    sinks = _sinks_leaves(case, device)
    if case.varlen:
        out, lse = cp.ring_flash_attention_varlen(*leaves, cu_seqlens, group, return_lse=True, **case.options(),
                                                  **_sinks_option(sinks))
    else:
        out, lse = cp.ring_flash_attention(*leaves, group, return_lse=True, **case.options(), **_sinks_option(sinks))
    out.backward(local[3])
    return [t.detach().cpu() for t in (out, lse, *(leaf.grad for leaf in leaves + sinks))]


def emulated_results(case: Case, inputs, world_size: int, device="cpu"):
    """Every rank's (out, lse, dq, dk, dv) of emulated_ring_flash_attention and its backward; with
    sinks, rank 0's ends with the whole dsinks (the emulation's sum over its ranks), the others' with
    zeros."""
    q, k, v, dout, cu_seqlens = inputs
    shards = [[shard(case, t, cu_seqlens, rank, world_size).to(device) for rank in range(world_size)]
              for t in (q, k, v, dout)]
    leaves = [[t.requires_grad_() for t in per_rank] for per_rank in shards[:3]]
    sinks = _sinks_leaves(case, device)
    outs, lses = cp.emulated_ring_flash_attention(*leaves, return_lse=True, cu_seqlens=cu_seqlens,
                                                  **case.options(), **_sinks_option(sinks))
    torch.autograd.backward(outs, shards[3])
    per_output = [outs, lses, *([t.grad for t in ts] for ts in leaves)]
    if sinks:
        per_output.append([sinks[0].grad] + [torch.zeros_like(sinks[0].grad)] * (world_size - 1))
    return [[ts[rank].detach().cpu() for ts in per_output] for rank in range(world_size)]


def oracle(case: Case, inputs, compute_dtype):
    """out, lse, dq, dk, dv (and dsinks) of single-process attention over the full sequence (each
    sequence on its own in a varlen case), naive_attention computing in compute_dtype (None: bf16)."""
    q, k, v, dout, cu_seqlens = inputs
    scale = 1.0 / math.sqrt(case.head_dim)

    def dense(q, k, v, dout):
        leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        sinks = case.sinks()
        sinks_leaves = [] if sinks is None else [sinks.to(compute_dtype or q.dtype).requires_grad_()]
        out, lse = naive_attention(*leaves, scale, case.causal, compute_dtype, **case.reference_options(),
                                   **_sinks_option(sinks_leaves))
        return [out.detach(), lse, *torch.autograd.grad(out, leaves + sinks_leaves, dout.to(out.dtype))]

    if not case.varlen:
        return dense(q, k, v, dout)
    starts = cu_seqlens.tolist()
    pieces = [dense(*(t[a:b].unsqueeze(0) for t in (q, k, v, dout))) for a, b in zip(starts, starts[1:]) if b > a]
    joined = [torch.cat([p[i][0] for p in pieces], dim=-1 if i == 1 else 0) for i in range(5)]
    return joined + ([sum(p[5] for p in pieces)] if case.with_sinks else [])


def check(case: Case, inputs, ranks_results, fa2_check) -> None:
    """The results of every rank (ranks_results[r] = rank r's (out, lse, dq, dk, dv)), reassembled
    into the full sequence, against the fp32 oracle by FlashAttention-2's rule (fa2_check, from
    tests/helpers.py) with bf16 PyTorch as the baseline."""
    cu_seqlens = inputs[4]
    world = len(ranks_results)
    full = [unshard(case, [ranks_results[r][i] for r in range(world)], cu_seqlens, lse=(i == 1)) for i in range(5)]
    reference, baseline = oracle(case, inputs, torch.float32), oracle(case, inputs, None)
    for name, actual, expected, same_dtype in zip(("out", "lse", "dq", "dk", "dv"), full, reference, baseline):
        fa2_check(actual, expected, same_dtype, f"{case.name}, {world} ranks: {name}")
    if case.with_sinks:
        # Every rank's part of the replicated sinks' gradient, summed, within what the reassembled
        # out and lse allow (tests/helpers.py; imported here, in the test's process only).
        from helpers import check_sinks_gradient

        dsinks = sum(ranks_results[r][5] for r in range(world))
        check_sinks_gradient(f"{case.name}, {world} ranks: dsinks", dsinks, inputs[3], full[0], full[1],
                             case.sinks(), reference[0], reference[1], reference[5])


def worker(rank: int, world_size: int, backend: str, init_file: str, cases, seed: int, results_dir: str) -> None:
    """A spawned rank of a torch.distributed group (gloo on the CPU, NCCL on GPU `rank`): runs every
    case, the argument checks that must raise before any communication, a ring in a subgroup
    (with 4 ranks) and the check across ranks; saves what it got for the test to check."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    results = {"cases": [rank_results(case, full_inputs(case, world_size, seed + i), rank, world_size, None, device)
                         for i, case in enumerate(cases)]}
    results["errors"] = rejected_arguments(rank, world_size, device)
    if world_size == 4:
        # Ranks 1 and 3 of the world as group ranks 0 and 1: the peers of a group's ranks are
        # translated to global ranks.
        groups = [dist.new_group([1, 3]), dist.new_group([0, 2])]
        group = groups[0] if rank in (1, 3) else groups[1]
        results["subgroup_rank"] = dist.get_rank(group)
        results["subgroup"] = rank_results(SUBGROUP_CASE, full_inputs(SUBGROUP_CASE, 2, seed + SUBGROUP_SEED),
                                           results["subgroup_rank"], 2, group, device)
    # Rank 0 passes a shorter shard than the others: every rank must raise.
    q = torch.randn(1, 4 if rank == 0 else 8, 2, 16, device=device).to(torch.bfloat16)
    try:
        cp.ring_flash_attention(q, q, q, causal=True, check_across_ranks=True)
        results["mismatch"] = None
    except ValueError as error:
        results["mismatch"] = str(error)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(results_dir, f"rank{rank}.pt"))


def rejected_arguments(rank: int, world_size: int, device):
    """(name, message) of each bad call, which must raise on this rank without communicating
    (had one rank gone on to the ring, the test would hang)."""
    q = torch.randn(1, 2 * world_size + 1, 2, 16, device=device).to(torch.bfloat16)
    even = torch.randn(1, 4, 2, 16, device=device).to(torch.bfloat16)
    packed = torch.randn(6, 2, 16, device=device).to(torch.bfloat16)
    calls = {
        "odd_load_balanced_shard": lambda: cp.ring_flash_attention(q, q, q, causal=True),
        "dropout": lambda: cp.ring_flash_attention(even, even, even, dropout_p=0.1),
        "alibi": lambda: cp.ring_flash_attention(even, even, even, alibi_slopes=torch.ones(2, device=device)),
        "layout": lambda: cp.ring_flash_attention(even, even, even, layout="zigzag"),
        "sinks": lambda: cp.ring_flash_attention(even, even, even, sinks=torch.ones(3, device=device)),
        "kv_length": lambda: cp.ring_flash_attention(even, even[:, :2], even[:, :2]),
        "varlen_cu_seqlens": lambda: cp.ring_flash_attention_varlen(
            packed, packed, packed, torch.tensor([0, 3, 6 * world_size], dtype=torch.int32)),
        "varlen_total": lambda: cp.ring_flash_attention_varlen(
            packed, packed, packed, torch.tensor([0, 8 * world_size], dtype=torch.int32)),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except (TypeError, ValueError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages

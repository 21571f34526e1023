"""Context parallelism: exact attention over a sequence sharded across the ranks of a
torch.distributed group (ring attention).

Each rank holds a shard of the sequence's queries, keys and values. The key/value shards travel
around the ring (rank r sends to r + 1 and receives from r - 1) while each rank attends its
queries to the shard it holds, with flash_cutlass's own forward; the partial outputs are merged
by their log-sum-exp in fp32. The backward recomputes each (query shard, key shard) pair with
flash_backward from the final out and lse, keeps dQ on its rank in fp32, and sends fp32 dK/dV
accumulators around the ring behind the keys until they reach the rank that owns them.

    import flash_cutlass.distributed as cp
    q_local = cp.shard_sequence(q, rank, world_size)          # (batch, seqlen / world_size, ...)
    out_local = cp.ring_flash_attention(q_local, k_local, v_local, causal=True)
    out = cp.unshard_sequence(gathered_out_shards)

Layouts (how a sequence of length n is split; both entry points and every helper take `layout`):

* "load_balanced" (the default): the sequence is cut into 2 * world_size equal chunks and rank r
  holds chunks r and 2 * world_size - 1 - r, one from each end, in that order. Under a causal mask
  every rank then does the same work at every step of the ring. n must be a multiple of
  2 * world_size.
* "contiguous": rank r holds chunk r of world_size equal chunks (n a multiple of world_size).
  Natural without a mask; causal work is unbalanced (the last rank does the most).

Variable-length batches (ring_flash_attention_varlen) shard every sequence of the packed batch
in the same layout: rank r's packed shard is, sequence after sequence, that sequence's local
chunks, so every rank holds 1 / world_size of every sequence and every sequence's length must
be a multiple of 2 * world_size (load_balanced) or world_size (contiguous).
shard_sequence_varlen / unshard_sequence_varlen convert.

Masks are those of the full sequence: causal, and window_size=(left, right) around its diagonal
(query i sees key j iff i - left <= j <= i + right), as flash_attention on the whole sequence.
Each step splits the (query shard, key shard) pair into as few flash_cutlass calls as give
exactly that mask (one per step for causal or no mask in either layout), and pairs that see no
key are skipped; a ring whose last steps are empty for every rank (a small window with the
contiguous layout) stops early.

Attention sinks (sinks=, as flash_attention's) fold into each rank's merged out and lse; their
gradient on a rank is its query rows' part, as a replicated parameter's is before the data-parallel
all-reduce that sums it over the ranks (the emulated ring returns the sum over its ranks).

Not supported: dropout_p > 0 and alibi_slopes (ValueError naming them): both depend on positions
that a shard's calls do not see. Eager mode only (torch.compile graph-breaks on the
communication). Tensors on the CPU run flash_cutlass's reference per call, with any backend that
has point-to-point operations (gloo); CUDA tensors need a backend for them (NCCL).

emulated_ring_flash_attention runs the same algorithm for all ranks of a ring in one process
(the shards passed as lists), the key/value shards copied on a CUDA side stream as a transfer
would run: for checking and tracing the overlap of transfers and compute on one GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch

from flash_cutlass.interface import (check_cu_seqlens, check_forward_tensors, check_packed_tensors, flash_backward,
                                     flash_backward_varlen, flash_forward)
from flash_cutlass.interface import flash_forward_varlen
from flash_cutlass.options import check_bool, check_dropout_p, check_sinks, forward_options
from flash_cutlass.reference import fold_sinks_into, sinks_gradient

__all__ = ["LAYOUTS", "emulated_ring_flash_attention", "ring_flash_attention", "ring_flash_attention_varlen",
           "sequence_positions", "shard_sequence", "shard_sequence_varlen", "unshard_sequence",
           "unshard_sequence_varlen"]

LAYOUTS = ("load_balanced", "contiguous")


# --------------------------------------------------------------------------------------------
# Layouts


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(name) for name in LAYOUTS)}, got {layout!r}")
    return layout


def _check_world(rank, world_size) -> None:
    for value, name in ((world_size, "world_size"), (rank, "rank")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "load_balanced" else 1


def _rank_chunks(layout: str, rank: int, world_size: int) -> Tuple[int, ...]:
    """The chunks (of world_size * _chunks_per_rank) that rank holds, in its local order."""
    if layout == "load_balanced":
        return rank, 2 * world_size - 1 - rank
    return (rank,)


def _check_divisible(seqlen: int, world_size: int, layout: str, name: str) -> int:
    """The chunk length of a sequence of seqlen; ValueError naming `name` when it does not divide."""
    chunks = world_size * _chunks_per_rank(layout)
    if seqlen % chunks:
        raise ValueError(f"{name} is {seqlen}, not a multiple of {chunks}: layout={layout!r} cuts a sequence into "
                         f"{'2 * ' if layout == 'load_balanced' else ''}world_size = {chunks} equal chunks")
    return seqlen // chunks


def sequence_positions(seqlen: int, rank: int, world_size: int, *, layout: str = "load_balanced",
                       device=None) -> torch.Tensor:
    """The positions (int64, in the full sequence of length seqlen) of the tokens rank holds, in
    its local order: for position ids (e.g. rotary embeddings) of a shard."""
    _check_world(rank, world_size)
    layout = _check_layout(layout)
    chunk = _check_divisible(seqlen, world_size, layout, "seqlen")
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in _rank_chunks(layout, rank, world_size)])


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "load_balanced",
                   dim: int = 1) -> torch.Tensor:
    """Rank's shard of x, a full sequence along dimension `dim` (1: (batch, seqlen, heads,
    head_dim)), in `layout`; a new contiguous tensor."""
    _check_world(rank, world_size)
    layout = _check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    chunk = _check_divisible(x.shape[dim], world_size, layout, f"x.shape[{dim}]")
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in _rank_chunks(layout, rank, world_size)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], *, layout: str = "load_balanced", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (shards[r] of rank r, as shard_sequence gives
    them, e.g. from torch.distributed.all_gather): the inverse of shard_sequence."""
    layout = _check_layout(layout)
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    per_rank = _chunks_per_rank(layout)
    local = shards[0].shape[dim]
    if local % per_rank or any(s.shape[dim] != local for s in shards):
        raise ValueError(f"shards must all have one length along dim {dim}, a multiple of {per_rank} with "
                         f"layout={layout!r}, got {[s.shape[dim] for s in shards]}")
    chunk = local // per_rank
    chunks = [None] * (world_size * per_rank)
    for rank, shard in enumerate(shards):
        for i, c in enumerate(_rank_chunks(layout, rank, world_size)):
            chunks[c] = shard.narrow(dim, i * chunk, chunk)
    return torch.cat(chunks, dim=dim)


def _host_lengths(cu_seqlens, name: str = "cu_seqlens") -> List[int]:
    """The sequence lengths of int32 cumulative lengths (read on the host), checked."""
    check_cu_seqlens(cu_seqlens, name)
    starts = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(starts, starts[1:])]
    if starts[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must start at 0 and never decrease, got {starts}")
    return lengths


def _check_varlen_layout(lengths: List[int], world_size: int, layout: str, name: str = "cu_seqlens") -> None:
    for b, n in enumerate(lengths):
        _check_divisible(n, world_size, layout, f"the length of sequence {b} in {name}")


def shard_sequence_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int, *,
                          layout: str = "load_balanced") -> torch.Tensor:
    """Rank's packed shard of a packed batch x (total, ...) whose sequence b owns rows
    cu_seqlens[b]:cu_seqlens[b + 1] (int32, read on the host): each sequence's local chunks in
    `layout`, sequence after sequence. Every length must be a multiple of 2 * world_size
    (load_balanced) or world_size (contiguous); the shard's own cumulative lengths are
    cu_seqlens // world_size."""
    _check_world(rank, world_size)
    layout = _check_layout(layout)
    lengths = _host_lengths(cu_seqlens)
    _check_varlen_layout(lengths, world_size, layout)
    if x.shape[0] != sum(lengths):
        raise ValueError(f"x must have cu_seqlens[-1] = {sum(lengths)} rows, got {x.shape[0]}")
    pieces, start = [], 0
    for n in lengths:
        pieces.append(shard_sequence(x.narrow(0, start, n), rank, world_size, layout=layout, dim=0))
        start += n
    return torch.cat(pieces) if pieces else x.new_empty((0, *x.shape[1:]))


def unshard_sequence_varlen(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, *,
                            layout: str = "load_balanced") -> torch.Tensor:
    """The packed batch from every rank's packed shard: the inverse of shard_sequence_varlen
    (cu_seqlens: the full batch's cumulative lengths)."""
    layout = _check_layout(layout)
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    lengths = _host_lengths(cu_seqlens)
    _check_varlen_layout(lengths, world_size, layout)
    local_total = sum(lengths) // world_size
    if any(s.shape[0] != local_total for s in shards):
        raise ValueError(f"every shard must have cu_seqlens[-1] / world_size = {local_total} rows, got "
                         f"{[s.shape[0] for s in shards]}")
    pieces, start = [], 0
    for n in lengths:
        local = n // world_size
        pieces.append(unshard_sequence([s.narrow(0, start, local) for s in shards], layout=layout, dim=0))
        start += local
    return torch.cat(pieces) if pieces else shards[0].new_empty((0, *shards[0].shape[1:]))


# --------------------------------------------------------------------------------------------
# Plans: which flash_cutlass calls each rank makes at each step of the ring


@dataclasses.dataclass(frozen=True)
class _Band:
    """The pairs of the full sequence's mask: query i sees key j iff lo <= j - i <= hi (+-inf:
    unbounded)."""

    lo: float
    hi: float

    @classmethod
    def of(cls, causal: bool, window_size: Tuple[int, int]) -> "_Band":
        left, right = window_size
        hi = 0 if causal else (right if right >= 0 else math.inf)
        return cls(-left if left >= 0 else -math.inf, hi)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A chunk of a shard: `length` tokens at position `start` of the full sequence and `local`
    of the shard."""

    start: int
    local: int
    length: int


@dataclasses.dataclass(frozen=True)
class _Box:
    """One flash_cutlass call of a step: queries [q_start, q_end) of the local shard against keys
    [k_start, k_end) of the key shard held, with the call's causal and window_size (flash_cutlass's
    bottom-right aligned semantics on the box) giving exactly the full sequence's mask there."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    window_size: Tuple[int, int]

    def shifted(self, q_offset: int, k_offset: int) -> "_Box":
        return dataclasses.replace(self, q_start=self.q_start + q_offset, q_end=self.q_end + q_offset,
                                   k_start=self.k_start + k_offset, k_end=self.k_end + k_offset)


def _segments(seqlen: int, layout: str, world_size: int, rank: int) -> List[_Segment]:
    chunk = seqlen // (world_size * _chunks_per_rank(layout))
    return [_Segment(c * chunk, i * chunk, chunk) for i, c in enumerate(_rank_chunks(layout, rank, world_size))]


def _shift(q: _Segment, k: _Segment) -> int:
    """(full-sequence j - i) - (local j - i) on the pair (q, k)."""
    return (k.start - k.local) - (q.start - q.local)


def _local_band(q: _Segment, k: _Segment, band: _Band, rows=None, cols=None):
    """The (lo, hi) of local j - i that the full sequence's band keeps on the rectangle of the pair
    (q, k), cut to `rows` x `cols` when given; None when it keeps nothing there."""
    row_start, row_end = q.local, q.local + q.length
    col_start, col_end = k.local, k.local + k.length
    if rows is not None:
        row_start, row_end = max(row_start, rows[0]), min(row_end, rows[1])
        col_start, col_end = max(col_start, cols[0]), min(col_end, cols[1])
    if row_start >= row_end or col_start >= col_end:
        return None
    shift = _shift(q, k)
    lo = max(band.lo - shift, col_start - (row_end - 1))
    hi = min(band.hi - shift, (col_end - 1) - row_start)
    return (int(lo), int(hi)) if lo <= hi else None


def _box(rows, cols, lo: int, hi: int) -> _Box:
    """The call on rows x cols that keeps lo <= j - i <= hi (local indices): flash_cutlass's
    diagonal of the box runs through its bottom-right corner, j - i = cols[1] - rows[1]."""
    diagonal = cols[1] - rows[1]
    left = -1 if lo <= cols[0] - (rows[1] - 1) else diagonal - lo
    right = -1 if hi >= (cols[1] - 1) - rows[0] else hi - diagonal
    causal = right == 0 and left == -1
    return _Box(rows[0], rows[1], cols[0], cols[1], causal, (-1, -1) if causal else (left, right))


def _cover(q_segments: List[_Segment], k_segments: List[_Segment], band: _Band) -> List[_Box]:
    """The fewest calls this greedy split finds whose masks are exactly `band` on the shard pair:
    all of it in one call when one band of local j - i gives the mask on the bounding box of the
    visible pairs, else the query chunks apart, then the key chunks apart (one chunk pair is
    always one band)."""
    seen = []
    for q in q_segments:
        for k in k_segments:
            kept = _local_band(q, k, band)
            if kept is not None:
                seen.append((q, k, kept))
    if not seen:
        return []
    row_start = min(max(q.local, k.local - hi) for q, k, (lo, hi) in seen)
    row_end = max(min(q.local + q.length, k.local + k.length - lo) for q, k, (lo, hi) in seen)
    col_start = min(max(k.local, q.local + lo) for q, k, (lo, hi) in seen)
    col_end = max(min(k.local + k.length, q.local + q.length + hi) for q, k, (lo, hi) in seen)
    rows, cols = (row_start, row_end), (col_start, col_end)
    lo = min(kept[0] for _, _, kept in seen)
    hi = max(kept[1] for _, _, kept in seen)
    # The candidate band is in local indices; on a pair it is the full-sequence band shifted back.
    if all(_local_band(q, k, band, rows, cols) == _local_band(q, k, _Band(lo + _shift(q, k), hi + _shift(q, k)),
                                                               rows, cols)
           for q in q_segments for k in k_segments):
        return [_box(rows, cols, lo, hi)]
    if len(q_segments) > 1:
        return [box for q in q_segments for box in _cover([q], k_segments, band)]
    return [box for k in k_segments for box in _cover(q_segments, [k], band)]


@functools.lru_cache(maxsize=256)
def _sequence_plan(seqlen: int, layout: str, world_size: int, band: _Band) -> Tuple[Tuple[Tuple[_Box, ...], ...], ...]:
    """plan[rank][step]: the calls of rank at each step of the ring for one sequence of seqlen,
    rank holding the key shard of rank - step; steps that are empty for every rank at the end
    are left out (at least one step remains)."""
    plan = [[tuple(_cover(_segments(seqlen, layout, world_size, rank),
                          _segments(seqlen, layout, world_size, (rank - step) % world_size), band))
             for step in range(world_size)] for rank in range(world_size)]
    steps = 1 + max((step for rank_plan in plan for step, boxes in enumerate(rank_plan) if boxes), default=0)
    return tuple(tuple(rank_plan[:steps]) for rank_plan in plan)


@dataclasses.dataclass(frozen=True)
class _PackedCall:
    """One variable-length flash_cutlass call of a step: packed queries [q_start, q_end) against
    packed keys [k_start, k_end), cut into (virtual) sequences by cu_seqlens_q / cu_seqlens_k
    relative to those starts. Each box of the sequences is one of them; the rows and keys between
    boxes are sequences of their own with no keys or no queries (out 0, lse -inf: nothing to merge)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_seqlens_q: Tuple[int, ...]
    cu_seqlens_k: Tuple[int, ...]
    causal: bool
    window_size: Tuple[int, int]

    @classmethod
    def of(cls, chain: List[_Box]) -> "_PackedCall":
        q_start, k_start = chain[0].q_start, chain[0].k_start
        cu_q, cu_k = [0], [0]
        for box in chain:
            if box.q_start - q_start > cu_q[-1]:  # rows before the box: a sequence without keys
                cu_q.append(box.q_start - q_start)
                cu_k.append(cu_k[-1])
            if box.k_start - k_start > cu_k[-1]:  # keys before the box: a sequence without queries
                cu_q.append(cu_q[-1])
                cu_k.append(box.k_start - k_start)
            cu_q.append(box.q_end - q_start)
            cu_k.append(box.k_end - k_start)
        return cls(q_start, chain[-1].q_end, k_start, chain[-1].k_end, tuple(cu_q), tuple(cu_k), chain[0].causal,
                   chain[0].window_size)


def _packed_calls(boxes: List[_Box]) -> Tuple[_PackedCall, ...]:
    """The boxes of every sequence at one step as few variable-length calls: boxes with one mask
    whose query and key ranges both follow each other go into one call."""
    by_mask = {}
    for box in boxes:
        by_mask.setdefault((box.causal, box.window_size), []).append(box)
    calls = []
    for members in by_mask.values():
        chains: List[List[_Box]] = []
        for box in sorted(members, key=lambda b: (b.q_start, b.k_start)):
            for chain in chains:
                if chain[-1].q_end <= box.q_start and chain[-1].k_end <= box.k_start:
                    chain.append(box)
                    break
            else:
                chains.append([box])
        calls.extend(_PackedCall.of(chain) for chain in chains)
    return tuple(calls)


@functools.lru_cache(maxsize=16)
def _packed_plan(lengths: Tuple[int, ...], layout: str, world_size: int, rank: int,
                 band: _Band) -> Tuple[Tuple[_PackedCall, ...], ...]:
    """plan[step]: rank's variable-length calls at each step for a packed batch of sequences of
    `lengths` (each sharded in `layout`), over the steps the longest-lasting sequence needs."""
    plans = [_sequence_plan(n, layout, world_size, band) for n in lengths]
    steps = max((len(plan[0]) for plan in plans), default=1)
    per_step = []
    for step in range(steps):
        boxes, offset = [], 0
        for n, plan in zip(lengths, plans):
            if step < len(plan[rank]):
                boxes.extend(box.shifted(offset, offset) for box in plan[rank][step])
            offset += n // world_size
        per_step.append(_packed_calls(boxes))
    return tuple(per_step)


# --------------------------------------------------------------------------------------------
# The calls of a step on tensors


@dataclasses.dataclass(frozen=True)
class _Attention:
    """What every call of one ring attention shares: the scalar options, already checked."""

    softmax_scale: float
    softcap: float
    deterministic: bool


class _DenseCall:
    """A box on (batch, seqlen, heads, head_dim) shards."""

    row_dim = 1

    def __init__(self, box: _Box):
        self.box = box
        self.rows = slice(box.q_start, box.q_end)
        self.cols = slice(box.k_start, box.k_end)

    def forward(self, q, k, v, attention: _Attention):
        box = self.box
        return flash_forward(q[:, self.rows], k[:, self.cols], v[:, self.cols], attention.softmax_scale,
                             box.causal, window_size=box.window_size, softcap=attention.softcap)

    def backward(self, dout, q, k, v, out, lse, attention: _Attention):
        box, rows, cols = self.box, self.rows, self.cols
        return flash_backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[..., rows],
                              attention.softmax_scale, box.causal, attention.deterministic,
                              window_size=box.window_size, softcap=attention.softcap)


class _VarlenCall:
    """A _PackedCall on packed (total, heads, head_dim) shards, its lengths on the shards' device."""

    row_dim = 0

    def __init__(self, call: _PackedCall, device: torch.device):
        self.call = call
        self.rows = slice(call.q_start, call.q_end)
        self.cols = slice(call.k_start, call.k_end)
        self.cu_seqlens_q = torch.tensor(call.cu_seqlens_q, dtype=torch.int32).to(device, non_blocking=True)
        self.cu_seqlens_k = torch.tensor(call.cu_seqlens_k, dtype=torch.int32).to(device, non_blocking=True)
        self.max_seqlen_q = max(b - a for a, b in zip(call.cu_seqlens_q, call.cu_seqlens_q[1:]))
        self.max_seqlen_k = max(b - a for a, b in zip(call.cu_seqlens_k, call.cu_seqlens_k[1:]))

    def _lengths(self):
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    def forward(self, q, k, v, attention: _Attention):
        call = self.call
        return flash_forward_varlen(q[self.rows], k[self.cols], v[self.cols], *self._lengths(),
                                    attention.softmax_scale, call.causal, window_size=call.window_size,
                                    softcap=attention.softcap)

    def backward(self, dout, q, k, v, out, lse, attention: _Attention):
        call, rows, cols = self.call, self.rows, self.cols
        return flash_backward_varlen(dout[rows], q[rows], k[cols], v[cols], out[rows], lse[..., rows],
                                     *self._lengths(), attention.softmax_scale, call.causal,
                                     attention.deterministic, window_size=call.window_size,
                                     softcap=attention.softcap)


def _merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merges a partial attention (out, lse) over some keys into the fp32 accumulators (out_acc,
    lse_acc) over others, in place: the result is attention over both. lse are (..., heads, rows)
    and outs (..., rows, heads, head_dim) (a dense or a packed layout). Rows without keys on
    either side (lse -inf) stay at 0 and -inf, without NaN."""
    merged = torch.logaddexp(lse_acc, lse)
    # Rows without a key on either side keep lse -inf; shifting them by 0 instead gives exp(-inf) = 0.
    shift = torch.where(torch.isneginf(merged), 0.0, merged)
    old_weight = torch.exp(lse_acc - shift).transpose(-1, -2).unsqueeze(-1)
    new_weight = torch.exp(lse - shift).transpose(-1, -2).unsqueeze(-1)
    out_acc.mul_(old_weight).add_(out.float() * new_weight)
    lse_acc.copy_(merged)


# --------------------------------------------------------------------------------------------
# Transfers: a torch.distributed group, or every rank in this process


class _Transfer:
    """Tensors on their way: wait() gives them once they may be read on the current stream."""

    def __init__(self, received, works=(), event=None, sent=None):
        self._received, self._works, self._event, self._sent = received, works, event, sent

    def wait(self):
        for work in self._works:
            work.wait()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        # Done: let go of the operations and the sent tensors (gloo aborted processes that exited
        # while finished operations still held tensors).
        self._works, self._sent = (), None
        return self._received


class _GroupRing:
    """The ring of a torch.distributed group: this process is one rank of it."""

    def __init__(self, group):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = (self.rank,)

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else self._dist.get_global_rank(self.group, group_rank)

    def exchange(self, payloads, offset: int) -> _Transfer:
        """Sends this rank's payload (a tuple of tensors) to rank + offset and receives the
        payload of rank - offset, asynchronously (one batch of point-to-point operations)."""
        dist = self._dist
        (payload,) = payloads
        payload = tuple(t.contiguous() for t in payload)
        received = tuple(torch.empty_like(t) for t in payload)
        destination = self._global_rank((self.rank + offset) % self.world_size)
        source = self._global_rank((self.rank - offset) % self.world_size)
        operations = ([dist.P2POp(dist.isend, t, destination, self.group) for t in payload]
                      + [dist.P2POp(dist.irecv, t, source, self.group) for t in received])
        return _Transfer([received], dist.batch_isend_irecv(operations), sent=payload)


class _EmulatedRing:
    """Every rank of a ring of world_size in this process: a transfer is a copy, on a side CUDA
    stream for CUDA tensors (so that it overlaps the compute stream's work as a network transfer
    would), a plain clone on the CPU."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def exchange(self, payloads, offset: int) -> _Transfer:
        sources = [payloads[(rank - offset) % self.world_size] for rank in self.ranks]
        if self.copy_stream is None:
            return _Transfer([tuple(t.clone() for t in payload) for payload in sources])
        received = [tuple(torch.empty_like(t) for t in payload) for payload in sources]
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for source, target in zip(sources, received):
                for s, t in zip(source, target):
                    t.copy_(s, non_blocking=True)
                    # Both were allocated on the compute stream: keep them until the copy is done.
                    s.record_stream(self.copy_stream)
                    t.record_stream(self.copy_stream)
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return _Transfer(received, event=event)


# --------------------------------------------------------------------------------------------
# The ring: forward and backward for the ranks this process runs


@dataclasses.dataclass
class _Ring:
    """A ring attention call: the transfers, the calls of each of this process's ranks at each
    step (calls[i][step] for ranks[i]) and the options."""

    transfers: object
    calls: List[List[list]]
    attention: _Attention

    @property
    def steps(self) -> int:
        return len(self.calls[0])


def _ring_forward(ring: _Ring, qs, ks, vs, sinks=None):
    """(outs, lses) of the ranks this process runs: each rank attends its queries to every key
    shard in turn, receiving the next one meanwhile, and merges the partial results in fp32, into
    which the sinks (or None) then fold."""
    held = [(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)]
    out_accs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
    lse_accs = [None] * len(qs)
    for step in range(ring.steps):
        incoming = ring.transfers.exchange(held, 1) if step + 1 < ring.steps else None
        for i, q in enumerate(qs):
            for call in ring.calls[i][step]:
                out, lse = call.forward(q, *held[i], ring.attention)
                if lse_accs[i] is None:
                    shape = (*lse.shape[:-1], q.shape[call.row_dim])
                    lse_accs[i] = torch.full(shape, -math.inf, dtype=torch.float32, device=q.device)
                rows = call.rows
                _merge_into(out_accs[i].narrow(call.row_dim, rows.start, rows.stop - rows.start),
                            lse_accs[i][..., rows], out, lse)
        if incoming is not None:
            held = incoming.wait()
    lses = []
    for q, lse in zip(qs, lse_accs):
        if lse is None:  # no call at all: the shard is empty
            heads = q.shape[-2]
            shape = (q.shape[0], heads, q.shape[1]) if q.dim() == 4 else (heads, q.shape[0])
            lse = torch.full(shape, -math.inf, dtype=torch.float32, device=q.device)
        lses.append(lse)
    if sinks is not None:
        lses = [fold_sinks_into(acc, lse, sinks) for acc, lse in zip(out_accs, lses)]
    return [acc.to(q.dtype) for acc, q in zip(out_accs, qs)], lses


def _ring_backward(ring: _Ring, douts, qs, ks, vs, outs, lses):
    """(dqs, dks, dvs) of the ranks this process runs. Each step recomputes its calls with the
    final out and lse; dQ stays on its rank, and the fp32 dK/dV accumulator of the key shard held
    follows it around the ring, back to its owner at the end."""
    held = [(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)]
    dq_accs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
    accumulated = None
    passing = None
    for step in range(ring.steps):
        incoming = ring.transfers.exchange(held, 1) if step + 1 < ring.steps else None
        partial = []
        for i, (dout, q, out, lse) in enumerate(zip(douts, qs, outs, lses)):
            k, v = held[i]
            dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for call in ring.calls[i][step]:
                dq, dk, dv = call.backward(dout, q, k, v, out, lse, ring.attention)
                rows, cols = call.rows, call.cols
                dq_accs[i].narrow(call.row_dim, rows.start, rows.stop - rows.start).add_(dq)
                dk_acc.narrow(call.row_dim, cols.start, cols.stop - cols.start).add_(dk)
                dv_acc.narrow(call.row_dim, cols.start, cols.stop - cols.start).add_(dv)
            partial.append((dk_acc, dv_acc))
        if passing is None:
            accumulated = partial
        else:
            # The accumulator of the shard held, from the rank before: it ran the step before.
            accumulated = passing.wait()
            for (dk_acc, dv_acc), (dk, dv) in zip(accumulated, partial):
                dk_acc.add_(dk)
                dv_acc.add_(dv)
        if step + 1 < ring.steps:
            passing = ring.transfers.exchange(accumulated, 1)
        if incoming is not None:
            held = incoming.wait()
    # Rank r now holds the accumulator of rank r - (steps - 1): it goes straight back to its owner.
    back = -(ring.steps - 1)
    if back % ring.transfers.world_size:
        accumulated = ring.transfers.exchange(accumulated, back).wait()
    dqs = [acc.to(q.dtype) for acc, q in zip(dq_accs, qs)]
    dks = [dk.to(k.dtype) for (dk, _), k in zip(accumulated, ks)]
    dvs = [dv.to(v.dtype) for (_, dv), v in zip(accumulated, vs)]
    return dqs, dks, dvs


class _RingAttentionFunction(torch.autograd.Function):
    """Autograd of the ring: sinks (or None), then tensors = (q of each rank this process runs,
    then k, then v)."""

    @staticmethod
    def forward(ctx, ring: _Ring, sinks, *tensors):
        count = len(tensors) // 3
        qs, ks, vs = tensors[:count], tensors[count:2 * count], tensors[2 * count:]
        outs, lses = _ring_forward(ring, qs, ks, vs, sinks)
        ctx.ring, ctx.sinks = ring, sinks
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        ctx.mark_non_differentiable(*lses)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        count = len(saved) // 5
        qs, ks, vs, outs, lses = (saved[i * count:(i + 1) * count] for i in range(5))
        # An output that took no part in the loss gets a zero gradient.
        douts = [torch.zeros_like(out) if grad is None else grad.contiguous()
                 for grad, out in zip(grads[:count], outs)]
        dqs, dks, dvs = _ring_backward(ctx.ring, douts, qs, ks, vs, outs, lses)
        dsinks = None
        if ctx.sinks is not None:  # the sum over this process's ranks, in fp32
            parts = [sinks_gradient(dout, out, lse, ctx.sinks.float()) for dout, out, lse in zip(douts, outs, lses)]
            dsinks = torch.stack(parts).sum(dim=0).to(ctx.sinks.dtype)
        return (None, dsinks, *dqs, *dks, *dvs)


# --------------------------------------------------------------------------------------------
# Entry points


def _check_options(q, softmax_scale, causal, deterministic, return_lse, window_size, softcap, alibi_slopes,
                   dropout_p, layout):
    """The scalar arguments, checked as flash_attention checks them, and those ring attention
    does not take; returns (_Attention, _Band, layout, return_lse)."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention (its bias depends on positions in the "
                         "full sequence, which a shard's calls do not see); pass None")
    if check_dropout_p(dropout_p) > 0:
        raise ValueError(f"dropout_p must be 0 in ring attention, got {dropout_p}: dropout is not supported "
                         "(the shards' calls would each draw their own masks)")
    options = forward_options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap, deterministic=deterministic)
    attention = _Attention(options.softmax_scale, options.softcap, options.deterministic)
    band = _Band.of(options.causal, options.window_size)
    return attention, band, _check_layout(layout), check_bool(return_lse, "return_lse")


def _check_self_attention(q, k, rows_dim: int, what: str) -> None:
    if k.shape[rows_dim] != q.shape[rows_dim]:
        raise ValueError(f"k must have as many {what} as q ({q.shape[rows_dim]}), got {k.shape[rows_dim]}: ring "
                         "attention is self-attention over one sharded sequence")


def _group_ring(group, q) -> _GroupRing:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call torch.distributed.init_process_group "
                         "first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        raise ValueError(f"q is on {q.device} but group's backend is NCCL, which moves CUDA tensors only; use a "
                         "gloo group for CPU tensors")
    return _GroupRing(group)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _check_across_ranks(ring: _GroupRing, signature: List[int], what: str, device) -> None:
    """ValueError on every rank unless every rank of the group passed the same signature (one
    all-reduce of its maximum and minimum, read on the host)."""
    dist = ring._dist
    values = torch.tensor(signature + [-value for value in signature], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=ring.group)
    highest, lowest = values[:len(signature)], -values[len(signature):]
    if not torch.equal(highest, lowest):
        raise ValueError(f"the ranks of group passed different {what}: every rank must pass shards of one shape "
                         "and the same options (check_across_ranks=True)")


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}


def _signature(q, k, attention: _Attention, band: _Band, layout: str, extra=()) -> List[int]:
    bounds = [int(b) if math.isfinite(b) else (1 << 40) * (1 if b > 0 else -1) for b in (band.lo, band.hi)]
    return [*q.shape, *k.shape, _DTYPE_CODES[q.dtype], *bounds, LAYOUTS.index(layout),
            _float_bits(attention.softmax_scale), _float_bits(attention.softcap), int(attention.deterministic),
            *extra]



def _apply(ring: _Ring, qs, ks, vs, return_lse: bool, sinks=None):
    results = _RingAttentionFunction.apply(ring, sinks, *qs, *ks, *vs)
    count = len(qs)
    outs, lses = list(results[:count]), list(results[count:])
    return (outs, lses) if return_lse else outs


def ring_flash_attention(q, k, v, group=None, softmax_scale: Optional[float] = None, causal: bool = False,
                         deterministic: bool = False, return_lse: bool = False, *,
                         window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                         dropout_p: float = 0.0, layout: str = "load_balanced", check_across_ranks: bool = False,
                         sinks: Optional[torch.Tensor] = None):
    """Attention over a sequence sharded across the ranks of `group` (default: the world), each
    rank passing its shards: q (batch, seqlen_local, heads, head_dim), k and v (batch,
    seqlen_local, heads_k, head_dim) of the same positions (self-attention; GQA as in
    flash_attention: only the heads_k of k and v travel), sharded in `layout` (module docstring;
    shard_sequence gives a rank its shard). The full sequence has world_size * seqlen_local tokens.

    Returns this rank's out (like q), or (out, lse) with return_lse, lse float32 (batch, heads,
    seqlen_local): the rows of flash_attention(full q, full k, full v, ...) that this rank's
    queries own. Differentiable in q, k and v; every rank of the group must call it, and its
    backward, with shards of one shape and the same options.

    softmax_scale, causal, deterministic, window_size, softcap and sinks are flash_attention's,
    applied to the full sequence (causal and windows around its diagonal; the sinks' gradient is this
    rank's part: module docstring). alibi_slopes and dropout_p > 0 are
    not supported (ValueError). check_across_ranks=True all-reduces the shapes and options first
    and raises ValueError on every rank when they differ (one small collective and a host
    synchronization a call: for debugging). Every other argument error is raised before any
    communication.
    """
    check_forward_tensors(q, k, v)
    _check_self_attention(q, k, 1, "tokens (dimension 1)")
    attention, band, layout, return_lse = _check_options(q, softmax_scale, causal, deterministic, return_lse,
                                                         window_size, softcap, alibi_slopes, dropout_p, layout)
    check_across_ranks = check_bool(check_across_ranks, "check_across_ranks")
    sinks = check_sinks(sinks, q)
    if q.shape[1] % _chunks_per_rank(layout):
        raise ValueError(f"q has {q.shape[1]} tokens, not a multiple of 2: layout='load_balanced' gives each rank "
                         "two equal chunks (the full sequence a multiple of 2 * world_size)")
    transfers = _group_ring(group, q)
    if check_across_ranks:
        _check_across_ranks(transfers, _signature(q, k, attention, band, layout), "shapes or options", q.device)
    plan = _sequence_plan(q.shape[1] * transfers.world_size, layout, transfers.world_size, band)[transfers.rank]
    ring = _Ring(transfers, [[[_DenseCall(box) for box in boxes] for boxes in plan]], attention)
    results = _apply(ring, [q], [k], [v], return_lse, sinks)
    return (results[0][0], results[1][0]) if return_lse else results[0]


def _check_varlen_tensors(q, k, v) -> None:
    check_packed_tensors(q, k, v)
    check_forward_tensors(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    _check_self_attention(q, k, 0, "tokens (dimension 0)")


def _varlen_plan(cu_seqlens, q, world_size: int, rank: int, layout: str, band: _Band):
    lengths = _host_lengths(cu_seqlens)
    _check_varlen_layout(lengths, world_size, layout)
    if sum(lengths) != q.shape[0] * world_size:
        raise ValueError(f"q has {q.shape[0]} tokens, but cu_seqlens (the full batch's) gives "
                         f"{sum(lengths)} / world_size = {sum(lengths) / world_size:g} tokens per rank")
    return lengths, _packed_plan(tuple(lengths), layout, world_size, rank, band)


def ring_flash_attention_varlen(q, k, v, cu_seqlens, group=None, softmax_scale: Optional[float] = None,
                                causal: bool = False, deterministic: bool = False, return_lse: bool = False, *,
                                window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                dropout_p: float = 0.0, layout: str = "load_balanced",
                                check_across_ranks: bool = False, sinks: Optional[torch.Tensor] = None):
    """ring_flash_attention of a packed batch of sequences: q (total_local, heads, head_dim), k and
    v (total_local, heads_k, head_dim), each rank's packed shard as shard_sequence_varlen gives it
    (every sequence sharded in `layout`, sequence after sequence), and cu_seqlens the int32
    cumulative lengths of the FULL batch (the same on every rank; every length a multiple of
    2 * world_size with layout='load_balanced', of world_size with 'contiguous'). cu_seqlens is
    read on the host: a CPU tensor avoids a device synchronization.

    Returns out like q, or (out, lse) with return_lse, lse float32 (heads, total_local). Each
    sequence attends only to itself, as flash_attention_varlen on the full batch; the other
    arguments are ring_flash_attention's. A step runs one variable-length call per distinct mask
    (one for causal or no mask; with a window, sequences of different lengths may need their own).
    """
    _check_varlen_tensors(q, k, v)
    attention, band, layout, return_lse = _check_options(q.unsqueeze(0), softmax_scale, causal, deterministic,
                                                         return_lse, window_size, softcap, alibi_slopes,
                                                         dropout_p, layout)
    check_across_ranks = check_bool(check_across_ranks, "check_across_ranks")
    sinks = check_sinks(sinks, q.unsqueeze(0))
    transfers = _group_ring(group, q)
    lengths, plan = _varlen_plan(cu_seqlens, q, transfers.world_size, transfers.rank, layout, band)
    if check_across_ranks:
        extra = [len(lengths), functools.reduce(lambda h, n: (h * 1000003 + n) % (1 << 61), lengths, 0)]
        _check_across_ranks(transfers, _signature(q, k, attention, band, layout, extra),
                            "shapes, cu_seqlens or options", q.device)
    ring = _Ring(transfers, [[[_VarlenCall(call, q.device) for call in calls] for calls in plan]], attention)
    results = _apply(ring, [q], [k], [v], return_lse, sinks)
    return (results[0][0], results[1][0]) if return_lse else results[0]


def emulated_ring_flash_attention(q_shards: Sequence[torch.Tensor], k_shards: Sequence[torch.Tensor],
                                  v_shards: Sequence[torch.Tensor], softmax_scale: Optional[float] = None,
                                  causal: bool = False, deterministic: bool = False, return_lse: bool = False, *,
                                  window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                  layout: str = "load_balanced", cu_seqlens: Optional[torch.Tensor] = None,
                                  sinks: Optional[torch.Tensor] = None):
    """The ring of ring_flash_attention (or, with cu_seqlens, of ring_flash_attention_varlen) for
    all world_size = len(q_shards) ranks in this process, without torch.distributed: q_shards[r]
    is rank r's shard, and so on. Each transfer is a copy of the key/value shards (and, in the
    backward, of the dK/dV accumulators) made on a side CUDA stream while the compute stream runs
    the step before, as a network transfer would overlap it (a clone on the CPU).

    Returns the list of outs, or (outs, lses) with return_lse, each exactly as rank r of
    ring_flash_attention would return it; differentiable in every shard (and in sinks, whose
    gradient sums every rank's part). For testing and for
    tracing the overlap on one GPU; its calls run one rank after another.
    """
    world_size = len(q_shards)
    if world_size == 0 or len(k_shards) != world_size or len(v_shards) != world_size:
        raise ValueError(f"q_shards, k_shards and v_shards must each hold one tensor per rank (at least one), got "
                         f"{len(q_shards)}, {len(k_shards)} and {len(v_shards)}")
    for name, shards in (("q", q_shards), ("k", k_shards), ("v", v_shards)):
        for r, shard in enumerate(shards):
            if not isinstance(shard, torch.Tensor):
                raise TypeError(f"{name}_shards[{r}] must be a torch.Tensor, got {type(shard).__name__}")
            first = shards[0]
            if shard.shape != first.shape or shard.dtype != first.dtype or shard.device != first.device:
                raise ValueError(f"{name}_shards[{r}] must have the shape, dtype and device of {name}_shards[0] "
                                 f"({tuple(first.shape)}, {first.dtype}, {first.device}), got "
                                 f"({tuple(shard.shape)}, {shard.dtype}, {shard.device})")
    # Every rank's shards are alike: rank 0's stand for all of them.
    varlen = cu_seqlens is not None
    if varlen:
        _check_varlen_tensors(q_shards[0], k_shards[0], v_shards[0])
    else:
        check_forward_tensors(q_shards[0], k_shards[0], v_shards[0])
        _check_self_attention(q_shards[0], k_shards[0], 1, "tokens (dimension 1)")
    q = q_shards[0]
    attention, band, layout, return_lse = _check_options(q.unsqueeze(0) if varlen else q, softmax_scale, causal,
                                                         deterministic, return_lse, window_size, softcap, None, 0.0,
                                                         layout)
    sinks = check_sinks(sinks, q.unsqueeze(0) if varlen else q)
    transfers = _EmulatedRing(world_size, q.device)
    if varlen:
        calls = [[[_VarlenCall(call, q.device) for call in step_calls]
                  for step_calls in _varlen_plan(cu_seqlens, q, world_size, rank, layout, band)[1]]
                 for rank in range(world_size)]
    else:
        if q.shape[1] % _chunks_per_rank(layout):
            raise ValueError(f"q_shards hold {q.shape[1]} tokens each, not a multiple of 2: layout='load_balanced' "
                             "gives each rank two equal chunks")
        plan = _sequence_plan(q.shape[1] * world_size, layout, world_size, band)
        calls = [[[_DenseCall(box) for box in boxes] for boxes in plan[rank]] for rank in range(world_size)]
    return _apply(_Ring(transfers, calls, attention), list(q_shards), list(k_shards), list(v_shards), return_lse,
                  sinks)

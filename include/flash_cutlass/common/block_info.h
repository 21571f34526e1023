// The forward grid (which query tile a CTA computes), and which key blocks one query block
// visits and which of them need a mask.
#pragma once

#include <cstdint>

#include <cutlass/fast_math.h>

#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The forward works in tiles of one (query block, head, batch), numbered with the query block
// fastest so that the CTAs that share K/V run together.
template <int kBlockM>
__host__ __device__ inline int num_query_blocks(FwdParams const& params) {
  return (params.seqlen_q + kBlockM - 1) / kBlockM;
}

// Tiles of the forward, one per (query block, head, batch); the launchers refuse more than 2^31 - 1.
template <int kBlockM>
__host__ __device__ inline int64_t num_query_tiles(FwdParams const& params) {
  return int64_t(num_query_blocks<kBlockM>(params)) * params.batch * params.heads;
}

struct QueryTile {
  int m_block;
  int head;
  int batch;
};

// Tile `index` of the forward, the query blocks of one (head, batch) from the last to the first.
template <int kBlockM>
__device__ __forceinline__ QueryTile query_tile_at(FwdParams const& params, int index) {
  const int num_m_blocks = num_query_blocks<kBlockM>(params);
  const int batch_head = index / num_m_blocks;
  return {num_m_blocks - 1 - index % num_m_blocks, batch_head % params.heads, batch_head / params.heads};
}

// A persistent grid takes causal tiles in pairs: query blocks m and num_m_blocks - 1 - m of one
// (head, batch), the later (longer) first. A causal tile's cost grows linearly with its query
// block, so every pair costs about the same and a CTA that takes pairs blockIdx.x,
// blockIdx.x + gridDim.x, ... gets an even share. A pair's two blocks are one when num_m_blocks is
// odd and m is the middle one, so tiles of one cost (no mask, a window) go singly instead: with
// pairs, the CTAs whose pairs were all middles took half the tiles of the others (at 11 query
// blocks, 89% of the SMs' time busy instead of 97%).
template <MaskKind kKind>
constexpr bool persistent_tiles_in_pairs() {
  return kKind == MaskKind::kCausal;
}

// Pairs end in a partial wave: with 2048 pairs on 132 SMs, 68 CTAs take 16 and 64 take 15, and the
// call lasts 3% longer than an even share. So the pairs of the last full wave and of the partial
// one, the causal tail, go as single tiles instead, longest first across the tail's (head, batch)
// pairs, dealt to the CTAs in a snake (0 to gridDim.x - 1, then back): every CTA enters the tail
// with the same load, and the longest and shortest tiles even out (tools/schedule_model.py:
// 96-99% of the SMs' time busy at the benchmark's causal shapes, 94-97% with pairs alone; measured
// +0.4 to +2.8% at head dims 64 and 128 from 1k to 16k keys on the H200, but -1.3% at 128 and 1k).
// The tail starts at (head, batch) first_batch_head's pair first_pair: that (head, batch) brings
// its query blocks first_pair .. num_m_blocks - 1 - first_pair, the full_heads after it all of
// theirs.
struct CausalTail {
  int first_step;  // the CTAs' first step in the tail (two a pair before it)
  int tiles;
  int first_batch_head;
  int first_pair;
  int full_heads;
  cutlass::FastDivmod by_full_heads;            // 1 where full_heads is 0 (then unused)
  cutlass::FastDivmod by_full_heads_and_first;  // full_heads + 1
};

// The persistent grid's work items (tiles, or pairs of them) and the two divisors that turn an
// item's number into its (head, batch), precomputed on the host (cutlass::FastDivmod: a multiply-high
// and a shift): a division by a runtime value compiles to a MUFU reciprocal and a chain of
// conversions through the uniform datapath, and a 64-bit one to a subroutine. Between one tile's
// epilogue and the next tile's start a consumer warpgroup spent 635-810 cycles with those, 515-585
// with these (clock64 timelines at 2k keys on the H200).
struct PersistentWork {
  int64_t items;                       // tiles, or pairs of tiles with persistent_tiles_in_pairs
  cutlass::FastDivmod items_per_head;  // per (head, batch)
  cutlass::FastDivmod heads;
  CausalTail tail;                     // with pairs; first_step past every pair's steps where none
};

// The persistent grid's work items: tiles, or pairs of them.
template <int kBlockM, bool kInPairs>
__host__ inline int64_t persistent_items(FwdParams const& params) {
  const int blocks = num_query_blocks<kBlockM>(params);
  return int64_t(kInPairs ? (blocks + 1) / 2 : blocks) * params.batch * params.heads;
}

// The work of a persistent grid of `grid` CTAs: at most persistent_items, or, with pairs, more when
// there are fewer pairs than SMs (then every tile is in the causal tail: one a CTA, longest first).
template <int kBlockM, bool kInPairs>
__host__ inline PersistentWork persistent_work_of(FwdParams const& params, int64_t grid) {
  const int blocks = num_query_blocks<kBlockM>(params);
  const int per_head = kInPairs ? (blocks + 1) / 2 : blocks;
  const int batch_heads = params.batch * params.heads;
  PersistentWork work{persistent_items<kBlockM, kInPairs>(params), cutlass::FastDivmod(per_head > 0 ? per_head : 1),
                      cutlass::FastDivmod(params.heads),
                      {0x7fffffff, 0, 0, 0, 0, cutlass::FastDivmod(1), cutlass::FastDivmod(1)}};
  if (!kInPairs || grid < 1 || work.items % grid == 0) return work;
  // Before the tail: the tail holds grid .. 2 grid - 1 pairs, or all of them when there are fewer than grid.
  const int64_t full_waves = work.items < grid ? 0 : work.items / grid - 1;
  const int64_t first_item = full_waves * grid;
  CausalTail& tail = work.tail;
  tail.first_step = int(2 * full_waves);
  tail.first_batch_head = int(first_item / per_head);
  tail.first_pair = int(first_item % per_head);
  tail.full_heads = batch_heads - tail.first_batch_head - 1;
  tail.tiles = blocks * (tail.full_heads + 1) - 2 * tail.first_pair;
  tail.by_full_heads = cutlass::FastDivmod(tail.full_heads > 0 ? tail.full_heads : 1);
  tail.by_full_heads_and_first = cutlass::FastDivmod(tail.full_heads + 1);
  return work;
}

// Step `step` of a CTA that takes every gridDim-th pair (or tile) from blockIdx.x on: with pairs,
// the first or second tile of pair blockIdx.x + (step / 2) * gridDim.x, else tile
// blockIdx.x + step * gridDim.x (query_tile_at's order); then, with pairs, the causal tail's tiles.
// `valid` is false past the end and for the missing second tile of a middle block.
struct TileAtStep {
  QueryTile tile;
  bool valid;
  bool past_end;
};

// Tile `step - tail.first_step` of this CTA in the causal tail: the tail's tiles in order of their
// query block, the last first, and within one block the first (head, batch) first; the CTAs take
// them gridDim.x at a time, in a snake.
template <int kBlockM>
__device__ __forceinline__ TileAtStep causal_tail_tile_at_step(FwdParams const& params, PersistentWork const& work,
                                                               int step) {
  const CausalTail& tail = work.tail;
  const int round = step - tail.first_step;
  const int grid = int(gridDim.x);
  const int64_t index = int64_t(round) * grid + ((round & 1) ? grid - 1 - int(blockIdx.x) : int(blockIdx.x));
  if (index >= tail.tiles) return {{0, 0, 0}, false, true};
  int k = int(index);
  const int num_m_blocks = num_query_blocks<kBlockM>(params);
  // Query blocks past the first head's pairs (num_m_blocks - first_pair on, and below first_pair)
  // come from the full heads only; the ones between from the first head and the full heads.
  const int outer_tiles = tail.first_pair * tail.full_heads;
  const int inner_tiles = (num_m_blocks - 2 * tail.first_pair) * (tail.full_heads + 1);
  int m_block, nth, batch_head;
  if (k < outer_tiles) {
    tail.by_full_heads(nth, batch_head, k);
    m_block = num_m_blocks - 1 - nth;
    batch_head += tail.first_batch_head + 1;
  } else if (k - outer_tiles < inner_tiles) {
    tail.by_full_heads_and_first(nth, batch_head, k - outer_tiles);
    m_block = num_m_blocks - 1 - tail.first_pair - nth;
    batch_head += tail.first_batch_head;
  } else {
    tail.by_full_heads(nth, batch_head, k - outer_tiles - inner_tiles);
    m_block = tail.first_pair - 1 - nth;
    batch_head += tail.first_batch_head + 1;
  }
  int batch, head;
  work.heads(batch, head, batch_head);
  return {{m_block, head, batch}, true, false};
}

template <int kBlockM, bool kInPairs>
__device__ __forceinline__ TileAtStep persistent_tile_at_step(FwdParams const& params, PersistentWork const& work,
                                                              int step) {
  if constexpr (kInPairs) {
    if (step >= work.tail.first_step) return causal_tail_tile_at_step<kBlockM>(params, work, step);
  }
  const int64_t item = int64_t(blockIdx.x) + int64_t(kInPairs ? step / 2 : step) * gridDim.x;
  if (item >= work.items) return {{0, 0, 0}, false, true};
  int batch_head, in_head, batch, head;
  work.items_per_head(batch_head, in_head, int(item));  // the launcher refuses 2^31 items
  work.heads(batch, head, batch_head);
  const int num_m_blocks = num_query_blocks<kBlockM>(params);
  const int high = num_m_blocks - 1 - in_head;
  if constexpr (!kInPairs) return {{high, head, batch}, true, false};
  const bool second = (step & 1) != 0;
  return {{second ? in_head : high, head, batch}, !(second && in_head == high), false};
}

// The tile of a CTA in a grid of one CTA per tile without a causal mask: query_tile_at's order.
template <int kBlockM>
__device__ __forceinline__ QueryTile query_tile_of_this_cta(FwdParams const& params) {
  return query_tile_at<kBlockM>(params, int(blockIdx.x));
}

// The tile of a CTA in a causal grid of one CTA per tile (the sm80 path's, and the Hopper path's at
// head dim 256), longest first across bands of (head, batch) pairs. The hardware starts CTAs in
// blockIdx order as SMs free up; in the order of query_tile_of_this_cta each (head, batch)'s
// longest tile comes after the previous one's shortest, so CTAs started late can be long and leave
// SMs idle at the end (at 8 tiles an SM, about 12% of the SMs' time in
// tools/schedule_model.py; +3-9% measured at head dim 256, 1k-8k). Here a band's query blocks
// run from the last to the first with the band's (head, batch) pairs inner: the last tiles to start
// are the shortest. A band holds as many pairs as keep their K and V (two 16-bit operands) within
// 16 MiB, so that the CTAs running together read them from L2.
template <int kBlockM>
__device__ __forceinline__ QueryTile longest_first_query_tile_of_this_cta(FwdParams const& params) {
  const int num_m_blocks = num_query_blocks<kBlockM>(params);
  const int batch_heads = params.batch * params.heads;
  const int64_t kv_bytes = int64_t(max(params.seqlen_k, 1)) * params.head_dim * 4;
  const int64_t pairs_in_16_mib = (int64_t(16) << 20) / kv_bytes;
  const int band = pairs_in_16_mib < 1 ? 1 : pairs_in_16_mib > batch_heads ? batch_heads : int(pairs_in_16_mib);
  const int index = int(blockIdx.x);
  const int band_index = index / (band * num_m_blocks);
  const int band_first = band_index * band;
  const int band_size = min(band, batch_heads - band_first);  // the last band may be partial
  const int in_band = index - band_first * num_m_blocks;
  const int batch_head = band_first + in_band % band_size;
  return {num_m_blocks - 1 - in_band / band_size, batch_head % params.heads, batch_head / params.heads};
}

// The backward kernels' key tiles, (key block, head, batch) flattened with the key block fastest:
// in increasing order (the longest first under a causal mask), or with last_key_block_first in
// decreasing order (the deterministic Hopper backward: ordered_reduce.h). The sm80 path runs one
// CTA per tile, the Hopper path walks them (sm90/tile_scheduler.h). A tile of a walk over
// query_heads_per_tile query heads (BwdParams::query_heads_per_key_tile) names the first of them:
// the tiles are then (key block, group of query heads, batch), heads / query_heads_per_tile groups.
struct KeyTile {
  int n_block;
  int head;
  int batch;
};

template <int kBlockN>
__device__ __forceinline__ KeyTile key_tile_at(FwdParams const& params, int index, bool last_key_block_first,
                                               int query_heads_per_tile = 1) {
  const int num_n_blocks = (params.seqlen_k + kBlockN - 1) / kBlockN;
  const int head_groups = params.heads / query_heads_per_tile;
  const int batch_group = index / num_n_blocks;
  const int n_index = index % num_n_blocks;
  return {last_key_block_first ? num_n_blocks - 1 - n_index : n_index,
          batch_group % head_groups * query_heads_per_tile, batch_group / head_groups};
}

// One batch entry: its sequence lengths and where its rows start. A variable-length call
// (params.cu_seqlens_q set) packs the rows of every sequence into one (total, heads, head_dim)
// tensor per operand, batch strides 0, sequence b owning rows [cu_seqlens[b], cu_seqlens[b + 1]);
// params.seqlen_q and seqlen_k are then the grid's lengths (the caller's max_seqlen, at most the
// totals), which bound every sequence's (sequence_rows).
struct Sequence {
  int batch;
  int seqlen_q;
  int seqlen_k;
  int q_start;  // its first query row in the packed tensors (0 without varlen)
  int k_start;

  // Element offset of this sequence's first row in a query-side (q, out, dout, dq) or key-side
  // (k, v, dk, dv) operand.
  __device__ __forceinline__ int64_t q_offset(int64_t batch_stride, int64_t row_stride) const {
    return int64_t(batch) * batch_stride + int64_t(q_start) * row_stride;
  }
  __device__ __forceinline__ int64_t k_offset(int64_t batch_stride, int64_t row_stride) const {
    return int64_t(batch) * batch_stride + int64_t(k_start) * row_stride;
  }
};

struct SequenceRows {
  int start;
  int length;
};

// Rows [start, start + length) of sequence `batch` in a packed operand of `total` rows, from
// cumulative lengths nobody checked on the host: start and end within [0, total], end at least
// start, length at most grid_length. Lengths that do not start at 0, decrease, pass the total or
// exceed max_seqlen give that call wrong results, but every row a kernel reads or writes stays
// inside the packed tensors and the per-query buffers (heads, total_q), and every sequence inside
// the grid (one longer than max_seqlen is cut to its first max_seqlen rows). In unsigned
// arithmetic a negative entry lies past every row, so that min alone clamps it (as a signed
// max/min chain, ptxas moved these values from uniform into vector registers and the Hopper
// backward at head dim 64 spilled 84 instead of 44 bytes).
__device__ __forceinline__ SequenceRows sequence_rows(const int* cu_seqlens, int batch, int64_t total,
                                                     int grid_length) {
  const unsigned rows = unsigned(total);  // < 2^31 (the host checks)
  const unsigned start = min(unsigned(cu_seqlens[batch]), rows);
  const unsigned end = max(min(unsigned(cu_seqlens[batch + 1]), rows), start);
  return {int(start), int(min(end - start, unsigned(grid_length)))};
}

__device__ __forceinline__ Sequence sequence_of(FwdParams const& params, int batch) {
  if (params.cu_seqlens_q == nullptr) return {batch, params.seqlen_q, params.seqlen_k, 0, 0};
  const SequenceRows q = sequence_rows(params.cu_seqlens_q, batch, params.total_q, params.seqlen_q);
  const SequenceRows k = sequence_rows(params.cu_seqlens_k, batch, params.total_k, params.seqlen_k);
  return {batch, q.length, k.length, q.start, k.start};
}

// Index of (sequence, head, query 0) in the fp32 per-query buffers (lse, D; times the head dim in
// the dQ accumulator): (batch, heads, seqlen_q), or (heads, total_q) in a variable-length call.
__device__ __forceinline__ int64_t query_stats_index(FwdParams const& params, Sequence const& sequence, int head) {
  if (params.cu_seqlens_q == nullptr) return (int64_t(sequence.batch) * params.heads + head) * params.seqlen_q;
  return int64_t(head) * params.total_q + sequence.q_start;
}

// Row of (sequence, key 0) in the GQA dK/dV accumulators: (batch, seqlen_k, heads, head dim), or
// (total_k, heads, head dim) in a variable-length call.
__device__ __forceinline__ int64_t key_accum_row(FwdParams const& params, Sequence const& sequence) {
  return params.cu_seqlens_k == nullptr ? int64_t(sequence.batch) * params.seqlen_k : int64_t(sequence.k_start);
}

// The rows of those accumulators: every sequence's keys, one after the other.
__host__ __device__ inline int64_t key_accum_rows(FwdParams const& params) {
  return params.cu_seqlens_k == nullptr ? int64_t(params.batch) * params.seqlen_k : int64_t(params.total_k);
}

struct KeyBlockRange {
  int begin;           // key blocks [begin, end) are visited; end <= begin: the block sees no key
  int end;
  int unmasked_begin;  // key blocks [unmasked_begin, unmasked_end) need no mask for any row of the
  int unmasked_end;    // query block (an empty range when unmasked_end <= unmasked_begin)
};

template <int kBlockM, int kBlockN, MaskKind kKind>
__device__ __forceinline__ KeyBlockRange key_block_range(KeyMask<kKind> const& mask, int m_block) {
  const int first_row = m_block * kBlockM;
  // Rows past seqlen_q only widen the range; with a window, leave them out so that its left edge
  // is that of the last real row.
  const int last_row = KeyMask<kKind>::kLocal ? min(first_row + kBlockM, mask.seqlen_q) - 1 : first_row + kBlockM - 1;
  const int visible_begin = mask.key_begin(first_row);
  const int visible_end = max(0, mask.key_limit(last_row));
  const int unmasked_begin = mask.key_begin(last_row);
  const int unmasked_end = max(0, mask.key_limit(first_row));
  return {visible_begin / kBlockN, (visible_end + kBlockN - 1) / kBlockN, (unmasked_begin + kBlockN - 1) / kBlockN,
          unmasked_end / kBlockN};
}

// The query blocks whose rows see any key of [key_start, key_start + block_n): [begin, end).
template <int kBlockM, MaskKind kKind>
__host__ __device__ __forceinline__ int2 query_block_range(KeyMask<kKind> const& mask, int key_start, int block_n) {
  const int num_m_blocks = (mask.seqlen_q + kBlockM - 1) / kBlockM;
  const int diagonal = mask.seqlen_k - mask.seqlen_q;
  if constexpr (kKind == MaskKind::kNone) return {0, num_m_blocks};
  // Row i sees key j iff key_begin(i) <= j < key_limit(i), both non-decreasing in i.
  if constexpr (kKind == MaskKind::kCausal) return {max(0, key_start - diagonal) / kBlockM, num_m_blocks};
  const int key_end = min(key_start + block_n, mask.seqlen_k);
  const int first_row = max(0, key_start - diagonal - mask.window_right);
  const int row_end = min(mask.seqlen_q, key_end - diagonal + mask.window_left);
  if (row_end <= first_row) return {0, 0};
  return {first_row / kBlockM, (row_end + kBlockM - 1) / kBlockM};
}

// The place of key block n_block among the key blocks of its sequence that add to query block
// m_block (those whose query_block_range holds it), in decreasing order of their index: how many
// come before it, out of the sequence's first n_blocks key blocks. Without a mask every key block
// sees every query block, under a causal mask those up to the last that reaches the diagonal
// (closed forms, on the host too: tools/check_turn_places.cu); with a window, a warp counts them,
// 32 a step.
template <int kBlockM, int kBlockN, MaskKind kKind>
__host__ __device__ __forceinline__ int later_key_blocks_in_closed_form(KeyMask<kKind> const& mask, int n_block,
                                                                        int n_blocks, int m_block) {
  static_assert(kKind != MaskKind::kLocal, "a window's key blocks are counted (later_key_blocks)");
  if constexpr (kKind == MaskKind::kNone) {
    return n_blocks - 1 - n_block;
  } else {
    // Key block n reaches m_block iff n * kBlockN - diagonal < (m_block + 1) * kBlockM
    // (query_block_range): the blocks up to `last`, n_block among them.
    const int diagonal = mask.seqlen_k - mask.seqlen_q;
    const int last = min(n_blocks - 1, ((m_block + 1) * kBlockM + diagonal - 1) / kBlockN);
    return last - n_block;
  }
}

template <int kBlockM, int kBlockN, MaskKind kKind>
__device__ __forceinline__ int later_key_blocks(KeyMask<kKind> const& mask, int n_block, int n_blocks, int m_block,
                                                int lane) {
  if constexpr (kKind != MaskKind::kLocal) {
    return later_key_blocks_in_closed_form<kBlockM, kBlockN>(mask, n_block, n_blocks, m_block);
  } else {
    int count = 0;
    for (int first = n_block + 1; first < n_blocks; first += 32) {
      const int n = first + lane;
      bool adds = false;
      if (n < n_blocks) {
        const int2 m_blocks = query_block_range<kBlockM>(mask, n * kBlockN, kBlockN);
        adds = m_blocks.x <= m_block && m_block < m_blocks.y;
      }
      count += __popc(__ballot_sync(0xffffffffu, adds));
    }
    return count;
  }
}

// What a backward CTA derives from its key tile: its sequence and mask, and the query blocks
// [m_block_begin, m_block_end) whose rows see any of its keys. A variable-length call's key
// blocks past their sequence's end (shorter sequences have fewer than the grid) have nothing to do.
// Where a rotated walk without a mask starts (KeyBlockWork::m_rotation): key block n_block of
// n_blocks at query block n_block * m_blocks / n_blocks, so that its key blocks reach each query
// block one after the other (the deterministic rotated walks; dQ's first store in other calls).
__host__ __device__ __forceinline__ int rotated_start(int n_block, int m_blocks, int n_blocks) {
  return n_block * m_blocks / n_blocks;
}

// In rotated walks over m_blocks >= n_blocks query blocks (so that no two starts are equal), the
// key blocks that reach query block m (counted from the walk's first) before key block `own`: key
// block n reaches m at step (m - rotated_start(n)) mod m_blocks, and the starts increase with n, so
// those before `own` are the ones whose starts lie after its own, up to m, cyclically; `reached`
// counts the starts at most m.
__host__ __device__ __forceinline__ int rotated_walk_place(int own, int m, int m_blocks, int n_blocks) {
  const int reached = min(n_blocks, ((m + 1) * n_blocks + m_blocks - 1) / m_blocks);
  return rotated_start(own, m_blocks, n_blocks) <= m ? reached - own - 1 : n_blocks - 1 - own + reached;
}

template <int kBlockM, int kBlockN, MaskKind kKind>
struct KeyBlockWork {
  KeyTile tile;
  Sequence sequence;
  KeyMask<kKind> mask;
  int key_start;
  int m_block_begin;
  int m_block_end;
  // The walk visits [m_block_begin, m_block_end) starting m_rotation blocks in, wrapping around
  // (the deterministic Hopper backward's rotated walks: sm90/tile_scheduler.h); 0: in order.
  int m_rotation = 0;
  // The query heads walked, tile.head first (the Hopper backward's GQA walks: BwdParams::
  // query_heads_per_key_tile): each head's query blocks in the order above, head after head.
  int query_heads = 1;

  __device__ bool in_sequence() const { return key_start < sequence.seqlen_k; }
  __device__ int num_m_blocks() const { return max(0, m_block_end - m_block_begin); }
  // The steps of the walk: its query blocks for each of its query heads.
  __device__ int num_steps() const { return num_m_blocks() * query_heads; }
  // The query block of the walk's step i (0 <= i < num_m_blocks()) within a head.
  __device__ __forceinline__ int m_block_at(int i) const {
    int offset = i + m_rotation;
    if (offset >= m_block_end - m_block_begin) offset -= m_block_end - m_block_begin;
    return m_block_begin + offset;
  }
  // The query block of the walk's step s over all its heads (0 <= s < num_steps()).
  __device__ __forceinline__ int m_block_of_step(int s) const {
    return m_block_at(query_heads > 1 ? s % num_m_blocks() : s);
  }
};

template <int kBlockM, int kBlockN, MaskKind kKind>
__device__ __forceinline__ KeyBlockWork<kBlockM, kBlockN, kKind> key_block_work_of(FwdParams const& params,
                                                                                   KeyTile tile) {
  const Sequence sequence = sequence_of(params, tile.batch);
  const KeyMask<kKind> mask = key_mask_of<kKind>(params, sequence.seqlen_q, sequence.seqlen_k);
  const int key_start = tile.n_block * kBlockN;
  const int2 m_blocks = query_block_range<kBlockM>(mask, key_start, kBlockN);
  return {tile, sequence, mask, key_start, m_blocks.x, m_blocks.y};
}

template <int kBlockM, int kBlockN, MaskKind kKind>
__device__ __forceinline__ KeyBlockWork<kBlockM, kBlockN, kKind> key_block_work_of_this_cta(FwdParams const& params) {
  return key_block_work_of<kBlockM, kBlockN, kKind>(params, key_tile_at<kBlockN>(params, int(blockIdx.x), false));
}

}  // namespace flash_cutlass

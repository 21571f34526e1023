// The Hopper-path tile walks: which query tiles a forward CTA takes and which key tiles a backward
// CTA takes, in which order, and what the producer and the consumers both derive from a tile. The tile numbering and the persistent and
// longest-first orders themselves live in common/block_info.h (the sm80 path and the launchers use
// them too).
#pragma once

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// What the producer and the consumers both derive from a tile number. A tile is skipped when its
// query block lies past its sequence's end (a variable-length call's shorter sequences have fewer
// query blocks than the grid); it has no work but its epilogue when no row sees a key.
template <int kBlockM, int kBlockN, MaskKind kMaskKind>
struct TileWork {
  QueryTile tile;
  Sequence sequence;
  KeyMask<kMaskKind> mask;
  KeyBlockRange key_blocks;

  __device__ bool in_sequence() const { return tile.m_block * kBlockM < sequence.seqlen_q; }
  __device__ bool has_keys() const { return key_blocks.end > key_blocks.begin; }
};

template <int kBlockM, int kBlockN, MaskKind kMaskKind>
__device__ __forceinline__ TileWork<kBlockM, kBlockN, kMaskKind> tile_work(FwdParams const& params, QueryTile tile) {
  const Sequence sequence = sequence_of(params, tile.batch);
  const KeyMask<kMaskKind> mask = key_mask_of<kMaskKind>(params, sequence.seqlen_q, sequence.seqlen_k);
  return {tile, sequence, mask, key_block_range<kBlockM, kBlockN>(mask, tile.m_block)};
}

// Calls work(tile) for every query tile of this CTA: in a persistent grid (the launcher sizes it),
// the tiles of persistent_tile_at_step (causal ones in pairs: persistent_tiles_in_pairs), else the
// CTA's one tile (causal ones longest first). The producer and the consumers walk the same tiles.
template <int kBlockM, bool kPersistentGrid, MaskKind kMaskKind, class Work>
__device__ __forceinline__ void for_each_tile_of_this_cta(FwdParams const& params, PersistentWork const& persistent_work,
                                                          Work&& work) {
  if constexpr (kPersistentGrid) {
    for (int step = 0;; ++step) {
      const TileAtStep next =
          persistent_tile_at_step<kBlockM, persistent_tiles_in_pairs<kMaskKind>()>(params, persistent_work, step);
      if (next.past_end) break;
      if (next.valid) work(next.tile);
    }
  } else if constexpr (kMaskKind == MaskKind::kCausal) {
    work(longest_first_query_tile_of_this_cta<kBlockM>(params));
  } else {
    work(query_tile_of_this_cta<kBlockM>(params));
  }
}

// The backward's walk over key tiles (key_tile_at). Usually one CTA per key tile, in the launch
// order (deterministic calls: last key block first, ordered_reduce.h). Fixed-length calls without a
// mask or score modifications walk persistently instead (a kernel of its own, kRotatedWalk: CTAs
// take key tiles blockIdx.x, blockIdx.x + gridDim.x, ...; bwd_launch.h): non-deterministic ones at
// head dim 64 (kPersistentEpilogue), and deterministic ones of few key blocks (no more than the query blocks),
// rotated: a grid of whole heads (a multiple of the key blocks, all resident at once), key block n
// starting at query block n * m_blocks / n_blocks, so that the adders of a query block arrive one
// after the other in the order of their turns rather than all starting at block 0 and queueing
// behind the last one (with dQ's first store, walks without a mask start rotated in every
// non-deterministic kernel too, so that a block's first arrival comes a step before the others).
// (Variable-length calls, whose tails the loader zeroes once per CTA, always walk one tile a CTA.) In a GQA call a tile may take several query heads of one K/V head's group
// (BwdParams::query_heads_per_key_tile, KeyBlockWork::query_heads): every role walks each head's
// query blocks, head after head, while K and V stay loaded.

// Where a backward CTA's walk stands in its pipelines: the query blocks (stages, phases) and the
// key tiles that saw any (K/V's barriers) of the tiles walked before. Each role counts them alike.
struct KeyWalkPosition {
  int steps = 0;
  int key_tiles = 0;

  template <class Work>
  __device__ __forceinline__ void advance(Work const& work) {
    if (work.num_m_blocks() > 0) {
      steps += work.num_steps();
      ++key_tiles;
    }
  }
};

// Calls work(key_block_work, position) for every key tile of this CTA that lies in its sequence,
// from one call site (the roles' bodies are inlined once).
template <int kBlockM, int kBlockN, MaskKind kMaskKind, bool kRotatedWalk, class Work>
__device__ __forceinline__ void for_each_key_tile_of_this_cta(BwdParams const& params, Work&& work) {
  const int query_heads = params.query_heads_per_key_tile;
  if constexpr (!kRotatedWalk) {
    auto key_block = key_block_work_of<kBlockM, kBlockN, kMaskKind>(
        params, key_tile_at<kBlockN>(params, int(blockIdx.x), params.deterministic, query_heads));
    key_block.query_heads = query_heads;
    if (kMaskKind == MaskKind::kNone && params.dq_arrivals != nullptr) {
      key_block.m_rotation = rotated_start(key_block.tile.n_block, key_block.num_m_blocks(),
                                           (params.seqlen_k + kBlockN - 1) / kBlockN);
    }
    if (key_block.in_sequence()) work(key_block, KeyWalkPosition{});
  } else {
    KeyWalkPosition position;
    const int num_n_blocks = (params.seqlen_k + kBlockN - 1) / kBlockN;
    // Below 2^31: bwd_launch.h.
    const int items = params.batch * (params.heads / query_heads) * num_n_blocks;
    for (int item = int(blockIdx.x); item < items; item += int(gridDim.x)) {
      const KeyTile tile = key_tile_at<kBlockN>(params, item, false, query_heads);
      auto key_block = key_block_work_of<kBlockM, kBlockN, kMaskKind>(params, tile);
      key_block.query_heads = query_heads;
      if (!key_block.in_sequence()) continue;
      if (params.deterministic || params.dq_arrivals != nullptr) {
        key_block.m_rotation = rotated_start(key_block.tile.n_block, key_block.num_m_blocks(), num_n_blocks);
      }
      work(key_block, position);
      position.advance(key_block);
    }
  }
}

}  // namespace flash_cutlass::sm90

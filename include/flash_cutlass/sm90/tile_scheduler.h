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

// The backward's walk over key tiles (key_tile_at). A persistent grid (the launcher sizes it to the
// SMs) takes items blockIdx.x, blockIdx.x + gridDim.x, ...: a CTA's next K and V load while its
// consumers write the last tile's dK and dV. Under a causal mask an item is a pair of key blocks
// of one head, i and n - 1 - i, whose query blocks add up to about the same, so that a static
// walk stays balanced; otherwise one tile. A grid of one CTA per item (variable-length calls,
// whose tiles differ in cost, and deterministic ones, whose turns follow the launch order) walks
// one item each.
//
// Deterministic calls without a mask whose key blocks fit on the SMs (and are no more than the
// query blocks) walk rotated instead: a persistent grid of whole heads (a multiple of the key
// blocks, all resident at once), key block n starting at query block n * m_blocks / n_blocks, so
// that the adders of a query block arrive one after the other in the order of their turns
// (ordered_reduce.h) rather than all starting at block 0 and queueing behind the last one.
struct KeyTileWalk {
  int items;
  int pairs;    // 1: an item is a pair of key blocks
  int rotated;  // 1: rotated walks (deterministic, no mask)
};

// Where a backward CTA's walk stands in its pipelines: the query blocks (stages, phases) and the
// key tiles that saw any (K/V's barriers) of the tiles walked before. Each role counts them alike.
struct KeyWalkPosition {
  int steps = 0;
  int key_tiles = 0;

  template <class Work>
  __device__ __forceinline__ void advance(Work const& work) {
    const int blocks = work.num_m_blocks();
    if (blocks > 0) {
      steps += blocks;
      ++key_tiles;
    }
  }
};

// Calls work(key_block_work, position) for every key tile of this CTA that lies in its sequence,
// from one call site (the roles' bodies are inlined once).
template <int kBlockM, int kBlockN, MaskKind kMaskKind, class Work>
__device__ __forceinline__ void for_each_key_tile_of_this_cta(BwdParams const& params, KeyTileWalk walk, Work&& work) {
  KeyWalkPosition position;
  // cursor = item * 2 + (second tile of a pair); one register across the walk.
  for (int cursor = 2 * int(blockIdx.x); cursor < 2 * walk.items;) {
    const int item = cursor >> 1;
    const int num_n_blocks = (params.seqlen_k + kBlockN - 1) / kBlockN;
    KeyTile tile;
    bool last_of_item = true;
    if (walk.pairs) {
      const int pair_items = (num_n_blocks + 1) / 2;
      const int batch_head = item / pair_items;
      const int first = item % pair_items;
      const bool second = cursor & 1;
      last_of_item = second || num_n_blocks - 1 - first == first;
      tile = {second ? num_n_blocks - 1 - first : first, batch_head % params.heads, batch_head / params.heads};
    } else {
      tile = key_tile_at<kBlockN>(params, item, params.deterministic && !walk.rotated);
    }
    cursor = last_of_item ? 2 * (item + int(gridDim.x)) : cursor + 1;
    auto key_block = key_block_work_of<kBlockM, kBlockN, kMaskKind>(params, tile);
    if (!key_block.in_sequence()) continue;
    if (walk.rotated) key_block.m_rotation = tile.n_block * key_block.num_m_blocks() / num_n_blocks;
    work(key_block, position);
    position.advance(key_block);
  }
}

}  // namespace flash_cutlass::sm90

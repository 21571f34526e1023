// The Hopper-path forward's tile walk: which query tiles a CTA takes, in which order, and what the
// producer and the consumers both derive from a tile. The tile numbering and the persistent and
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

}  // namespace flash_cutlass::sm90

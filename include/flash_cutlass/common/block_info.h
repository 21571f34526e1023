// The forward grid (which query tile a CTA computes), and which key blocks one query block
// visits and which of them need a mask.
#pragma once

#include <cstdint>

#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The forward kernels run one CTA per (query block, head, batch), flattened into blockIdx.x with
// the query block fastest, so the CTAs that share K/V run together.
template <int kBlockM>
__host__ __device__ inline int num_query_blocks(FwdParams const& params) {
  return (params.seqlen_q + kBlockM - 1) / kBlockM;
}

// CTAs of the forward grid; the launchers refuse more than 2^31 - 1.
template <int kBlockM>
inline int64_t num_query_tiles(FwdParams const& params) {
  return int64_t(num_query_blocks<kBlockM>(params)) * params.batch * params.heads;
}

struct QueryTile {
  int m_block;
  int head;
  int batch;
};

// This CTA's tile. Query blocks run from the last to the first so that, with causal masking,
// the longest blocks start first.
template <int kBlockM>
__device__ __forceinline__ QueryTile query_tile_of_this_cta(FwdParams const& params) {
  const int num_m_blocks = num_query_blocks<kBlockM>(params);
  const int batch_head = int(blockIdx.x / num_m_blocks);
  return {num_m_blocks - 1 - int(blockIdx.x % num_m_blocks), batch_head % params.heads, batch_head / params.heads};
}

struct KeyBlockRange {
  int end;            // key blocks [0, end) are visited; end == 0: the whole query block sees no key
  int unmasked_end;   // key blocks [0, unmasked_end) need no mask for any row of the query block
};

template <int kBlockM, int kBlockN, bool kCausal>
__device__ __forceinline__ KeyBlockRange key_block_range(KeyMask<kCausal> const& mask, int m_block) {
  const int first_row = m_block * kBlockM;
  const int last_row = first_row + kBlockM - 1;
  const int visible_keys = max(0, mask.key_limit(last_row));
  const int unmasked_keys = max(0, mask.key_limit(first_row));
  return {(visible_keys + kBlockN - 1) / kBlockN, unmasked_keys / kBlockN};
}

}  // namespace flash_cutlass

// Which key blocks one query block visits, and which of them need a mask.
#pragma once

#include "flash_cutlass/common/mask.h"

namespace flash_cutlass {

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

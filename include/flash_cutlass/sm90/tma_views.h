// The global tensors the Hopper path's TMA copies address: (rows, head_dim, heads, batch) views of
// an operand, head_dim contiguous, and their extents for a call: (seqlen, batch) per sequence, or
// (total rows, 1) in a variable-length call, each sequence's rows reached from its first one (or,
// paged, K and V as the pages' rows, reached through the block table).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// The rows and batch extent of the TMA views of the query-side operands and of K, V.
struct TmaExtents {
  int rows_q;
  int rows_k;
  int batch;
};

__host__ __device__ inline TmaExtents tma_extents(FwdParams const& params) {
  if (params.cu_seqlens_q == nullptr) return {params.seqlen_q, params.seqlen_k, params.batch};
  // Paged keys and values: the pages' rows (params.h, block_table).
  const int64_t rows_k = params.block_table != nullptr ? int64_t(params.num_pages) * params.page_size : params.total_k;
  return {int(params.total_q), int(rows_k), 1};
}

// (seqlen, head_dim, heads, batch) over base, head_dim contiguous: Element const* for the loads,
// Element* for a store.
template <class Traits, class Pointer>
auto gmem_tensor(Pointer base, int seqlen, int head_dim, int heads, int batch, int64_t row_stride,
                 int64_t head_stride, int64_t batch_stride) {
  using namespace cute;
  return make_tensor(make_gmem_ptr(base), typename Traits::GmemLayout{make_shape(seqlen, head_dim, heads, batch),
                                                                      make_stride(row_stride, _1{}, head_stride,
                                                                                  batch_stride)});
}

}  // namespace flash_cutlass::sm90

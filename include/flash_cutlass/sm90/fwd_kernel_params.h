// What the Hopper-path forward kernel receives (built by fwd_launch.h), and the extents of the TMA
// views over Q, K and V that the launcher and the producer both derive from a call.
#pragma once

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// The call and the TMA descriptors built from it on the host.
template <class Traits>
struct FwdKernelParams {
  FwdParams call;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  typename Traits::TmaO tma_o;  // over out when store_o_with_tma, else a valid descriptor left unused
  bool store_o_with_tma;
  PersistentWork persistent_work;  // with Traits::kPersistent
};

// The rows and batch extent of the TMA views of Q and of K, V: (seqlen, batch) per sequence, or
// (total rows, 1) in a variable-length call.
struct TmaExtents {
  int rows_q;
  int rows_k;
  int batch;
};

__host__ __device__ inline TmaExtents tma_extents(FwdParams const& params) {
  if (params.cu_seqlens_q == nullptr) return {params.seqlen_q, params.seqlen_k, params.batch};
  return {int(params.total_q), int(params.total_k), 1};
}

}  // namespace flash_cutlass::sm90

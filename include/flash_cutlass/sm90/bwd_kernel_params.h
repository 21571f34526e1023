// What the Hopper-path backward kernel receives (built by bwd_launch.h): the call and the TMA
// descriptors of Q, dO, K, V, the dQ accumulator and dK, dV (or their accumulators) built from it
// on the host.
#pragma once

#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

template <class Traits>
struct BwdKernelParams {
  BwdParams call;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_dout;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  typename Traits::TmadQ tma_dq;  // reduce-add into dq_accum from the staged dQ tile
  typename Traits::TmaStoredQ tma_dq_store;  // the same tile stored (BwdParams::dq_first_store)
  typename Traits::TmaStoreKV tma_dk;
  typename Traits::TmaStoreKV tma_dv;
  // The same over boxes of a query block's rows (persistent walks: bwd_epilogue.h).
  typename Traits::TmaStoreQRows tma_dk_rows;
  typename Traits::TmaStoreQRows tma_dv_rows;
  // dK and dV by TMA (bwd_epilogue.h): calls that write them in the inputs' dtype. Otherwise
  // tma_dk and tma_dv are built over K and V and never used.
  bool store_dkv_with_tma;
  // A GQA call's dK and dV added to their K/V head's fp32 accumulators by TMA (bwd_epilogue.h);
  // otherwise built over dq_accum and never used.
  typename Traits::TmaAddKV tma_dk_accum;
  typename Traits::TmaAddKV tma_dv_accum;
  bool add_dkv_with_tma;
};

}  // namespace flash_cutlass::sm90

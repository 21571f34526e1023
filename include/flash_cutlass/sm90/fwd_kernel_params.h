// What the Hopper-path forward kernel receives (built by fwd_launch.h).
#pragma once

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/tma_views.h"

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
  // The paged kernel's own gather (FwdParams::page_gather): boxes of the cache's K and V, and of
  // the staging pages they go to. Built only for a call with the gather.
  typename Traits::TmaGatherLoad tma_gather_k;
  typename Traits::TmaGatherLoad tma_gather_v;
  typename Traits::TmaGatherStore tma_stage_k;
  typename Traits::TmaGatherStore tma_stage_v;
};

}  // namespace flash_cutlass::sm90

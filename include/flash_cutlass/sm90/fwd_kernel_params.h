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
};

}  // namespace flash_cutlass::sm90

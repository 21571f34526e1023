// The Hopper-path backward kernel (sm_90a): one CTA per key tile (key block, head, batch), or with
// kRotatedWalk a persistent grid walking them (tile_scheduler.h), keeps a tile's K and V in shared
// memory and walks the query blocks that see them, accumulating dK and dV in registers and adding
// each query block's dQ to an fp32 accumulator in global memory.
// Warpgroup 0 produces (bwd_producer.h): warp 0 loads K, V, Q and dO by TMA and warp 2 the LSE and
// D through a multi-stage pipeline, warp 1 adds dQ with TMA's reduce-add; the consumer warpgroups,
// 64 keys each, run the five GEMMs and the softmax gradient (bwd_mainloop.h), then store dK and dV
// (by TMA where the call allows: bwd_epilogue.h). Past head dim 128
// the consumers split the head dim instead (bwd_head_split_mainloop.h). Tile sizes, layouts and
// shared memory: bwd_tile_config.h; named barriers: barriers.h. The preprocess (D, dq_accum zeroed) and the
// postprocess (dQ scaled, converted) are both paths' (common/bwd_stages.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/bwd_head_split_mainloop.h"
#include "flash_cutlass/sm90/bwd_mainloop.h"
#include "flash_cutlass/sm90/bwd_producer.h"
#include "flash_cutlass/sm90/bwd_tile_config.h"
#include "flash_cutlass/sm90/tile_scheduler.h"

namespace flash_cutlass::sm90 {

template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kRotatedWalk>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90(__grid_constant__ const BwdKernelParams<Traits> kernel_params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  BwdParams const& params = kernel_params.call;
  extern __shared__ char smem[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(kernel_params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kernel_params.tma_dout.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kernel_params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kernel_params.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kernel_params.tma_dq.get_tma_descriptor());
    storage.pipeline.kv_full.init(1);
    storage.pipeline.kv_empty.init(Traits::kConsumerThreads);
    storage.pipeline.kv_landed.init(1);
    storage.pipeline.v_full.init(1);
    storage.pipeline.query_landed.init(1);
    CUTE_UNROLL
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      // The TMA transaction's arrival and one a statistics-warp lane (its LSE and D stores).
      storage.pipeline.query_full[stage].init(1 + 32);
      storage.pipeline.query_empty[stage].init(Traits::kConsumerThreads);
    }
    if constexpr (Traits::kSeparatedO) {
      CUTE_UNROLL
      for (int stage = 0; stage < Traits::kStagesdO; ++stage) {
        storage.pipeline.dout_full[stage].init(1);
        storage.pipeline.dout_empty[stage].init(Traits::kConsumerThreads);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // barriers initialized for every thread

  const int warpgroup = cutlass::canonical_warp_group_idx();
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = int(threadIdx.x) % 32;
    if (warp == 0) {
      for_each_key_tile_of_this_cta<Traits::kBlockM, Traits::kBlockN, kMaskKind, kRotatedWalk>(
          params, [&](auto const& work, KeyWalkPosition const& position) {
            load_key_block<Traits, kMaskKind, kRotatedWalk>(kernel_params, work, position, storage, lane);
          });
    } else if (warp == 1) {
      for_each_key_tile_of_this_cta<Traits::kBlockM, Traits::kBlockN, kMaskKind, kRotatedWalk>(
          params, [&](auto const& work, KeyWalkPosition const& position) {
            write_dq<Traits, kMaskKind, kExtension, kRotatedWalk>(kernel_params, work, position, storage, lane);
          });
    } else if (warp == 2) {
      const float score_unit = lse_score_unit<carries_score_mods(kExtension)>(params);
      for_each_key_tile_of_this_cta<Traits::kBlockM, Traits::kBlockN, kMaskKind, kRotatedWalk>(
          params, [&](auto const& work, KeyWalkPosition const& position) {
            stage_query_statistics<Traits, kMaskKind>(params, work, position, storage, lane, score_unit);
          });
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  for_each_key_tile_of_this_cta<Traits::kBlockM, Traits::kBlockN, kMaskKind, kRotatedWalk>(
      params, [&](auto const& work, KeyWalkPosition const& position) {
        // Opaque to the compiler once a tile, so that what the consumers derive from their index
        // (fragment offsets, coordinates) is not hoisted out of the walk and kept live across it
        // (536 B of spills at head dim 128).
        int consumer_idx = int(threadIdx.x) - 128;
        asm volatile("" : "+r"(consumer_idx));
        if constexpr (Traits::kHeadSplit) {
          consume_query_blocks_head_split<Traits, kMaskKind, kExtension, kRotatedWalk>(kernel_params, work, position,
                                                                                      storage, consumer_idx);
        } else {
          consume_query_blocks<Traits, kMaskKind, kExtension, kRotatedWalk>(kernel_params, work, position, storage,
                                                                            consumer_idx);
        }
      });
#endif  // Other targets get an empty body: the host launches this kernel only on sm_90.
}

}  // namespace flash_cutlass::sm90

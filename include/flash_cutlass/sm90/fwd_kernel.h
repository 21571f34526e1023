// The Hopper-path forward kernel: CTAs take the (query block, head, batch) tiles of
// out = softmax(scale * Q K^T) V and its log-sum-exp, one each or (a persistent grid, one CTA per
// SM) in turn (tile_scheduler.h).
// A producer thread brings each tile's Q and its K/V blocks through a multi-stage pipeline with
// TMA (fwd_producer.h), running ahead into the next tile while the consumers finish this one; each
// consumer warpgroup owns 64 query rows and runs S = Q K^T and O += P V as wgmma, with the online
// softmax in registers between them (fwd_mainloop.h), then stores O and the log-sum-exp
// (fwd_epilogue.h).
// Tile sizes, layouts and shared memory: tile_config.h; named barriers: barriers.h; the developer
// timeline: timeline.h. This file sets up the pipeline and each role's state and walks the tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/fwd_epilogue.h"
#include "flash_cutlass/sm90/fwd_kernel_params.h"
#include "flash_cutlass/sm90/fwd_mainloop.h"
#include "flash_cutlass/sm90/fwd_producer.h"
#include "flash_cutlass/sm90/tile_config.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/timeline.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// Warpgroup 0 is the producer (one thread issues the loads), the others the consumers. kPagedKV:
// K and V through a block table (params.h; chunked prefill over a paged cache), a kernel of its own
// so that the others' producer keeps its registers, with a register split of its own (tile_config.h).
template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kPagedKV = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90(__grid_constant__ const FwdKernelParams<Traits> kernel_params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using PipelineKV = typename Traits::PipelineKV;
  constexpr int kBlockM = Traits::kBlockM;
  using TileShape = typename Traits::TileShape;

  FwdParams const& params = kernel_params.call;
  extern __shared__ char smem[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

  // CTAs taking tiles in turn, causal ones in pairs (tile_config.h: per head dim), or one CTA per tile.
  constexpr bool kPersistentGrid = Traits::kPersistent;
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool producer_thread = threadIdx.x == 0;

  record_philox_state<carries_dropout(kExtension)>(params);
  if (producer_thread) {
    prefetch_tma_descriptor(kernel_params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(kernel_params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(kernel_params.tma_v.get_tma_descriptor());
    storage.q_full.init(1);
    storage.q_empty.init(Traits::kConsumerThreads);
  }
  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kBytesKV;
  pipeline_params.role = warpgroup == 0 ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = producer_thread;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  PipelineKV pipeline_k(storage.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  PipelineKV pipeline_v(storage.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barriers initialized for every thread

  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutVt{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kPagedKV ? Traits::kPagedProducerRegisters : Traits::kProducerRegisters>();
    // The paged kernel's producer is warp 0 (its lanes read the block table together; lane 0
    // issues: fwd_producer.h, load_paged_tile), the others' thread 0.
    if (kPagedKV ? cutlass::canonical_warp_idx_sync() == 0 : producer_thread) {
      // TMA views of Q, K, V: (seqlen, head_dim, heads, batch), or (total, head_dim, heads, 1) in a
      // variable-length call, each sequence's rows from its first one on; rows and columns past the
      // tensor arrive as zeros (V through per-sequence descriptors in a packed batch: fwd_producer.h).
      const TmaExtents extents = tma_extents(params);
      Tensor mQ = kernel_params.tma_q.get_tma_tensor(
          make_shape(extents.rows_q, params.head_dim, params.heads, extents.batch));
      Tensor mK = kernel_params.tma_k.get_tma_tensor(
          make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch));
      Tensor mV = kernel_params.tma_v.get_tma_tensor(
          make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch));
      auto state = cutlass::make_producer_start_state<PipelineKV>();
      int q_loads = 0;
      Timeline timeline(producer_thread);
      FwdProducer<Traits, kMaskKind, kPagedKV, decltype(mQ), decltype(mK), decltype(sQ), decltype(sK)> producer{
          params, mQ, mK, mV, kernel_params, sQ, sK, sV, pipeline_k, state, timeline, storage, q_loads, pipeline_v};
      for_each_tile_of_this_cta<kBlockM, kPersistentGrid, kMaskKind>(
          params, kernel_params.persistent_work, [&](QueryTile tile) __attribute__((always_inline)) {
            producer.load_tile(tile);
            timeline.next_tile();
          });
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kPagedKV ? Traits::kPagedConsumerRegisters : Traits::kConsumerRegisters>();
  const int consumer_idx = int(threadIdx.x) - 128;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(consumer_idx);
  auto thr_pv = mma_pv.get_thread_slice(consumer_idx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K): descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrVt = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor acc_o = partition_fragment_C(mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
  Tensor acc_o_rc = as_rows_cols(acc_o);
  // (row, col) of every accumulator element inside its tile.
  Tensor tScS = as_rows_cols(thr_qk.partition_C(make_identity_tensor(select<0, 1>(TileShape{}))));
  Tensor tOcO = as_rows_cols(thr_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}))));
  typename PipelineKV::PipelineState state;  // the K/V stage the consumers read next
  int q_loads = 0;
  Timeline timeline(consumer_idx % 128 == 0);

  FwdConsumer<Traits, kMaskKind, kExtension, decltype(sQ), decltype(tSrQ), decltype(tSrK), decltype(tOrVt),
              decltype(acc_o), decltype(acc_o_rc), decltype(tScS)>
      consumer{params, timeline, warpgroup, acc_o, storage, q_loads, mma_qk, tScS, consumer_idx, sQ,
               tSrK, state, tSrQ, pipeline_k, pipeline_v, mma_pv, tOrVt, acc_o_rc};
  FwdEpilogue<Traits, decltype(tOcO)> epilogue{params, kernel_params, storage, mma_pv, tOcO, consumer_idx, timeline,
                                               warpgroup};
  for_each_tile_of_this_cta<kBlockM, kPersistentGrid, kMaskKind>(
      params, kernel_params.persistent_work, [&](QueryTile tile) __attribute__((always_inline)) {
        consumer.compute_tile(tile, epilogue);
        timeline.next_tile();
      });
  epilogue.wait_for_last_store();
#endif  // Other targets (sm_80, PTX) get an empty body: the host launches this kernel only on sm_90.
}

}  // namespace flash_cutlass::sm90

// The Hopper-path forward's epilogue, per consumer warpgroup and tile: O (normalized and converted
// to the inputs' dtype by the mainloop, fwd_mainloop.h) through shared memory and a TMA store, which
// leaves out rows and columns past the tensor, or from registers; the log-sum-exp from registers,
// one thread per row.
#pragma once

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/fwd_kernel_params.h"
#include "flash_cutlass/sm90/timeline.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// The state that lives across tiles (the P V MMA, the coordinates of O's accumulator, the shared
// memory O is staged in, the timeline) is the kernel's; FwdEpilogue refers to it. `work` is the
// tile's (tile_scheduler.h).
template <class Traits, class CoordsO>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  using TileShape = typename Traits::TileShape;
  static constexpr int kBlockM = Traits::kBlockM;

  FwdParams const& params_;
  FwdKernelParams<Traits> const& kernel_params_;
  typename Traits::SharedStorage& storage_;
  typename Traits::TiledMmaPV& mma_pv_;
  CoordsO& tOcO_;
  int const& consumer_idx_;
  Timeline& timeline_;
  int const& warpgroup_;

  // o: this warpgroup's rows of O in the P V accumulator's layout; lse: their log-sum-exp.
  template <class Work, class O, int kRowsPerThread>
  __device__ __forceinline__ void store_tile(Work const& work, O const& o, float const (&lse)[kRowsPerThread]) {
    using namespace cute;
    if (Traits::kTmaStoreO && kernel_params_.store_o_with_tma) {
      store_o_with_tma(work, o);
      store_lse(work, lse);  // after O's store: the fence before it would wait for these global stores
      return;
    }
    // Every epilogue syncs the consumers: the ping-pong's turns across tiles rely on it
    // (fwd_mainloop.h).
    sync_consumers<Traits::kConsumerThreads>();
    store_lse(work, lse);
    store_o_from_registers(work, o);
  }

  // After the CTA's last tile: its shared memory must outlive the reads of its last TMA store.
  __device__ __forceinline__ void wait_for_last_store() const {
    if (Traits::kTmaStoreO && kernel_params_.store_o_with_tma && consumer_idx_ == 0) cute::tma_store_wait<0>();
  }

  // Into the swizzled tile in shared memory (its own buffer, or Q's), then one thread issues the
  // TMA store.
  template <class Work, class O>
  __device__ __forceinline__ void store_o_with_tma(Work const& work, O const& o) {
    using namespace cute;
    Tensor sO = make_tensor(make_smem_ptr(Traits::kOwnBufferO ? storage_.o.data() : storage_.q.data()),
                            typename Traits::SmemLayoutQ{});
    if (consumer_idx_ == 0) tma_store_wait<0>();  // the previous tile's store has read sO
    sync_consumers<Traits::kConsumerThreads>();
    // stmatrix: 8x8 blocks of 16-bit values, a row of each per lane, into the swizzled tile.
    auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv_);
    auto thr_copy_o = copy_o.get_thread_slice(consumer_idx_);
    copy(copy_o, thr_copy_o.retile_S(o), thr_copy_o.partition_D(sO));
    tma_store_fence();  // the writes above, visible to the TMA unit
    sync_consumers<Traits::kConsumerThreads>();
    timeline_.stamp(warpgroup_, kOStaged);
    if (consumer_idx_ == 0) {
      Tensor mO = kernel_params_.tma_o.get_tma_tensor(
          make_shape(work.sequence.seqlen_q, params_.head_dim, params_.heads, params_.batch));
      Tensor gO = local_tile(mO(_, _, work.tile.head, work.tile.batch), select<0, 2>(TileShape{}),
                             make_coord(work.tile.m_block, _0{}));
      auto [tOgO, tOsO] = tma_partition(kernel_params_.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                        group_modes<0, 2>(gO));
      copy(kernel_params_.tma_o, tOsO, tOgO);
      tma_store_arrive();
    }
    timeline_.stamp(warpgroup_, kOStoreIssued);
  }

  // Pairs of columns from registers, rows past the sequence and columns past head_dim left out.
  template <class Work, class O>
  __device__ __forceinline__ void store_o_from_registers(Work const& work, O const& o) {
    using namespace cute;
    const int row_start = work.tile.m_block * kBlockM;
    Element* out = static_cast<Element*>(params_.out) +
                   work.sequence.q_offset(params_.out_batch_stride, params_.out_row_stride) +
                   int64_t(work.tile.head) * params_.out_head_stride;
    Tensor o_rc = as_rows_cols(o);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(o_rc); ++r) {
      const int row = row_start + get<0>(tOcO_(r, 0));
      if (row >= work.sequence.seqlen_q) continue;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        const int col = get<1>(tOcO_(r, c));
        if (col < params_.head_dim) {
          cutlass::Array<Element, 2> pair;
          pair[0] = o_rc(r, c);
          pair[1] = o_rc(r, c + 1);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(out + int64_t(row) * params_.out_row_stride + col) = pair;
        }
      }
    }
  }

  // The thread that holds a row's first column writes its log-sum-exp.
  template <class Work, int kRowsPerThread>
  __device__ __forceinline__ void store_lse(Work const& work, float const (&lse)[kRowsPerThread]) {
    using namespace cute;
    const int row_start = work.tile.m_block * kBlockM;
    float* lse_row = params_.lse + query_stats_index(params_, work.sequence, work.tile.head);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = row_start + get<0>(tOcO_(r, 0));
      if (row < work.sequence.seqlen_q && get<1>(tOcO_(r, 0)) == 0) lse_row[row] = lse[r];
    }
  }
};

}  // namespace flash_cutlass::sm90

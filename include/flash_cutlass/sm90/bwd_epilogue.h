// The Hopper-path backward's epilogues by TMA, both staged in K's and V's tiles in shared memory
// (free once both consumer warpgroups' last GEMMs are done): where the call writes dK and dV in the
// inputs' dtype, a TMA store, which leaves out rows and columns past the tensor (in a
// variable-length call only full key blocks: the rows past a sequence are the next one's); in a
// GQA call, a TMA reduce-add into the K/V head's fp32 accumulators (full key blocks: there too the
// rows past a sequence are the next one's) instead of an atomic a pair of elements. From
// registers (store_dk_dv, common/bwd_key_block.h) the tiles took about 10,000 cycles at head dim
// 128 (two-element stores, 8 rows a warp instruction), while the SM, holding one CTA, did nothing
// else.
#pragma once

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/fp32_tile_offsets.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/tma_views.h"

namespace flash_cutlass::sm90 {

// Whether this tile's dK and dV go out by TMA (store_dk_dv_with_tma); otherwise from registers.
template <class Traits, class Work>
__device__ __forceinline__ bool stores_dk_dv_with_tma(BwdKernelParams<Traits> const& kernel_params,
                                                      Work const& work) {
  return kernel_params.store_dkv_with_tma &&
         (kernel_params.call.cu_seqlens_q == nullptr || work.sequence.seqlen_k - work.key_start >= Traits::kBlockN);
}

// Persistent walks (kRotatedWalk): whether this tile's dK and dV go out by TMA staged in the
// query stages of its walk's last kBlockN / kBlockM blocks (store_dk_dv_through_query_stages), so
// that the next tile's K and V load while they go out.
template <class Traits, class Work>
__device__ __forceinline__ bool stages_dk_dv_in_query_stages(BwdKernelParams<Traits> const& kernel_params,
                                                             Work const& work) {
  if constexpr (!Traits::kPersistentEpilogue) {
    return false;
  } else {
    return work.num_steps() >= Traits::kHeldStages && stores_dk_dv_with_tma(kernel_params, work);
  }
}

// Whether this tile's dK and dV are added by TMA (add_dk_dv_with_tma); otherwise with atomics.
template <class Traits, class Work>
__device__ __forceinline__ bool adds_dk_dv_with_tma(BwdKernelParams<Traits> const& kernel_params, Work const& work) {
  return kernel_params.add_dkv_with_tma && work.sequence.seqlen_k - work.key_start >= Traits::kBlockN;
}

// acc_dk, acc_dv: the consumers' unscaled fp32 accumulators in the dK/dV MMA's layout; coords: each
// element's (key, column) in the tile. dK, then dV: each staged in halves of the head dim, the
// first in K's tile and the second in V's (as many bytes), in the 128-byte-swizzled fp32 layout,
// then added by one thread with TMA's reduce-add, which waits until the adds have read them.
template <class Traits, class Work, class Acc, class Coords>
__device__ __forceinline__ void add_dk_dv_with_tma(BwdKernelParams<Traits> const& kernel_params, Work const& work,
                                                   Acc const& acc_dk, Acc const& acc_dv, Coords const& coords,
                                                   typename Traits::SharedStorage& storage, int consumer_idx) {
  using namespace cute;
  constexpr int kHalfColumns = Traits::kHeadDim / 2;
  constexpr int kHalfElements = Traits::kBlockN * kHalfColumns;
  static_assert(kHalfColumns % 32 == 0, "whole 128-byte atoms a half");
  BwdParams const& params = kernel_params.call;
  float* const halves[2] = {reinterpret_cast<float*>(storage.k.data()), reinterpret_cast<float*>(storage.v.data())};
  const int row0 = get<0>(coords(0)), col0 = get<1>(coords(0));
  const Fp32TileOffsets<Traits::kBlockN> offset_of(row0, col0);
  // Both warpgroups' GEMMs are done with K and V.
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  auto add = [&](Acc const& acc, typename Traits::TmaAddKV const& tma, bool last) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int col = get<1>(coords(i));
      const int offset = offset_of(get<0>(coords(i)) - row0, col - col0);
      float* dst = col < kHalfColumns ? halves[0] + offset : halves[1] + (offset - kHalfElements);
      *reinterpret_cast<float2*>(dst) = make_float2(acc(i), acc(i + 1));
    }
    tma_store_fence();  // the writes above, visible to the TMA unit
    named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
    if (consumer_idx == 0) {
      Tensor accum = tma.get_tma_tensor(
          make_shape(int(key_accum_rows(params)), Int<Traits::kHeadDim>{}, params.heads_k, 1));
      const auto rows = make_coord(int(key_accum_row(params, work.sequence)) + work.key_start, _0{});
      // (keys, columns, half)
      Tensor g = local_tile(domain_offset(rows, accum(_, _, kv_head_of(work.tile.head, params), 0)),
                            typename Traits::TileAccumHalf{}, make_coord(_0{}, _));
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        Tensor s = make_tensor(make_smem_ptr(halves[half]), typename Traits::SmemLayoutAccumHalf{});
        auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
        copy(tma, ts, tg(_, half));
      }
      tma_store_arrive();
      tma_store_wait<0>();  // the adds have read the tiles
    }
    if (!last) named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  };
  add(acc_dk, kernel_params.tma_dk_accum, false);
  add(acc_dv, kernel_params.tma_dv_accum, true);
}

// dK (scaled by softmax_scale, in place in acc_dk) and dV in the inputs' dtype, for the TMA stores.
template <class Element, class Acc>
__device__ __forceinline__ auto dk_dv_in_inputs_dtype(Acc& acc_dk, Acc const& acc_dv, float softmax_scale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc_dk); ++i) acc_dk(i) *= softmax_scale;
  return cute::make_tuple(convert_fragment<Element>(acc_dk), convert_fragment<Element>(acc_dv));
}

// dK and dV from registers (in tiled_mma's layout, thread's part) into shared-memory tiles by
// stmatrix (8x8 blocks of 16-bit values, a row of each per lane, into the swizzled tiles), then
// visible to the TMA unit, every consumer thread past the barrier.
template <class Traits, class TiledMma, class Fragment, class TileK, class TileV>
__device__ __forceinline__ void stage_dk_dv(TiledMma const& tiled_mma, int thread, Fragment const& dk,
                                            Fragment const& dv, TileK&& dk_tile, TileV&& dv_tile) {
  using namespace cute;
  auto copy_kv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, typename Traits::Element>{}, tiled_mma);
  auto thr_copy_kv = copy_kv.get_thread_slice(thread);
  copy(copy_kv, thr_copy_kv.retile_S(dk), thr_copy_kv.partition_D(dk_tile));
  copy(copy_kv, thr_copy_kv.retile_S(dv), thr_copy_kv.partition_D(dv_tile));
  tma_store_fence();  // the writes above, visible to the TMA unit
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
}

// acc_dk, acc_dv: the consumers' accumulators in mma_dkv's layout (dK not yet scaled). Every
// consumer thread calls it; one issues the stores and waits until they have read shared memory.
template <class Traits, class Work, class Acc, class TiledMma>
__device__ __forceinline__ void store_dk_dv_with_tma(BwdKernelParams<Traits> const& kernel_params, Work const& work,
                                                     Acc& acc_dk, Acc const& acc_dv, TiledMma const& mma_dkv,
                                                     typename Traits::SharedStorage& storage, int consumer_idx) {
  using namespace cute;
  using Element = typename Traits::Element;
  using TileKV = typename Traits::TileKV;
  BwdParams const& params = kernel_params.call;
  auto [dk, dv] = dk_dv_in_inputs_dtype<Element>(acc_dk, acc_dv, params.softmax_scale);
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  // Both warpgroups' GEMMs are done with K and V.
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  stage_dk_dv<Traits>(mma_dkv, consumer_idx, dk, dv, sK, sV);
  if (consumer_idx == 0) {
    const TmaExtents extents = tma_extents(params);
    const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
    const int head_k = kv_head_of(work.tile.head, params);
    const auto shape = make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch);
    const auto k_rows = make_coord(work.sequence.k_start, _0{});
    Tensor gdK = local_tile(domain_offset(k_rows, kernel_params.tma_dk.get_tma_tensor(shape)(_, _, head_k, tma_batch)),
                            TileKV{}, make_coord(work.tile.n_block, _0{}));
    Tensor gdV = local_tile(domain_offset(k_rows, kernel_params.tma_dv.get_tma_tensor(shape)(_, _, head_k, tma_batch)),
                            TileKV{}, make_coord(work.tile.n_block, _0{}));
    auto [tdKgdK, tdKsK] = tma_partition(kernel_params.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                         group_modes<0, 2>(gdK));
    auto [tdVgdV, tdVsV] = tma_partition(kernel_params.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                         group_modes<0, 2>(gdV));
    copy(kernel_params.tma_dk, tdKsK, tdKgdK);
    copy(kernel_params.tma_dv, tdVsV, tdVgdV);
    tma_store_arrive();
    tma_store_wait<0>();  // the CTA's shared memory must outlive the stores' reads
  }
}

// The persistent walks' epilogue (stages_dk_dv_in_query_stages): the consumers have held the query
// stages of the walk's last kHeldStages blocks (the loader fills them for the next tile only once
// they are released here). Each warpgroup writes its 64 keys of dK into a held stage's Q buffer and
// of dV into its dO buffer (kBlockM rows a stage: one stage at head dim 64, the one head dim with
// kPersistentEpilogue; two at 96/128), one thread stores them by TMA in boxes of kBlockM rows, and
// the stages go back to the loader once the stores have read them. K and V are free meanwhile:
// the next tile's load under this epilogue.
template <class Traits, class Work, class Acc>
__device__ __forceinline__ void store_dk_dv_through_query_stages(BwdKernelParams<Traits> const& kernel_params,
                                                                 Work const& work, KeyWalkPosition const& position,
                                                                 Acc& acc_dk, Acc const& acc_dv,
                                                                 typename Traits::SharedStorage& storage,
                                                                 int consumer_idx) {
  using namespace cute;
  using Element = typename Traits::Element;
  using TileQ = typename Traits::TileQ;
  constexpr int kHeld = Traits::kHeldStages;
  BwdParams const& params = kernel_params.call;
  const int first_step = position.steps + work.num_steps() - kHeld;
  auto [dk, dv] = dk_dv_in_inputs_dtype<Element>(acc_dk, acc_dv, params.softmax_scale);
  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutdO{});
  // This warpgroup's 64 keys: rows (64 w) % kBlockM of held stage (64 w) / kBlockM.
  const int key_row = 64 * (consumer_idx / 128);
  const int stage = (first_step + key_row / Traits::kBlockM) % Traits::kStages;
  using WarpgroupRows = Shape<_64, Int<Traits::kHeadDim>>;
  const auto rows = make_coord((key_row % Traits::kBlockM) / 64, _0{});
  Tensor dk_rows = local_tile(sQ(_, _, stage), WarpgroupRows{}, rows);
  Tensor dv_rows = local_tile(sdO(_, _, stage), WarpgroupRows{}, rows);
  // Both warpgroups' GEMMs are done with the held stages.
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  stage_dk_dv<Traits>(typename Traits::TiledMmadKVWarpgroup{}, consumer_idx % 128, dk, dv, dk_rows, dv_rows);
  if (consumer_idx == 0) {
    const TmaExtents extents = tma_extents(params);
    const auto shape = make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch);
    const auto k_rows = make_coord(work.sequence.k_start, _0{});
    const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
    const int head_k = kv_head_of(work.tile.head, params);
    // (rows, columns, block of kBlockM keys)
    Tensor gdK = local_tile(
        domain_offset(k_rows, kernel_params.tma_dk_rows.get_tma_tensor(shape)(_, _, head_k, tma_batch)),
        TileQ{}, make_coord(_, _0{}));
    Tensor gdV = local_tile(
        domain_offset(k_rows, kernel_params.tma_dv_rows.get_tma_tensor(shape)(_, _, head_k, tma_batch)),
        TileQ{}, make_coord(_, _0{}));
    CUTE_UNROLL
    for (int held = 0; held < kHeld; ++held) {
      const int held_stage = (first_step + held) % Traits::kStages;
      const int key_block = work.tile.n_block * kHeld + held;
      if (key_block * Traits::kBlockM >= work.sequence.seqlen_k) break;  // rows past the keys: nothing to store
      auto [tdKgdK, tdKsK] = tma_partition(kernel_params.tma_dk_rows, _0{}, Layout<_1>{},
                                           group_modes<0, 2>(sQ(_, _, held_stage)), group_modes<0, 2>(gdK));
      auto [tdVgdV, tdVsV] = tma_partition(kernel_params.tma_dv_rows, _0{}, Layout<_1>{},
                                           group_modes<0, 2>(sdO(_, _, held_stage)), group_modes<0, 2>(gdV));
      copy(kernel_params.tma_dk_rows, tdKsK, tdKgdK(_, key_block));
      copy(kernel_params.tma_dv_rows, tdVsV, tdVgdV(_, key_block));
    }
    tma_store_arrive();
    tma_store_wait<0>();  // the stores have read the held stages
  }
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  CUTE_UNROLL
  for (int held = 0; held < kHeld; ++held) storage.pipeline.query_empty[(first_step + held) % Traits::kStages].arrive();
}

// A walked tile's dK and dV out: by TMA where the call allows it (in persistent walks, whose next
// tile's K and V load meanwhile, through the held query stages), else from registers (store_dk_dv,
// common/bwd_key_block.h).
template <class Traits, bool kRotatedWalk, MaskKind kMaskKind, class Acc, class TiledMma>
__device__ __forceinline__ void write_dk_dv(BwdKernelParams<Traits> const& kernel_params,
                                            KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
                                            KeyWalkPosition const& position, Acc& acc_dk, Acc& acc_dv,
                                            TiledMma const& mma_dkv, typename Traits::SharedStorage& storage,
                                            int consumer_idx) {
  using namespace cute;
  Tensor coords = mma_dkv.get_thread_slice(consumer_idx).partition_C(make_identity_tensor(typename Traits::TileKV{}));
  if constexpr (kRotatedWalk) {
    if constexpr (Traits::kPersistentEpilogue) {
      if (stages_dk_dv_in_query_stages(kernel_params, work)) {
        store_dk_dv_through_query_stages(kernel_params, work, position, acc_dk, acc_dv, storage, consumer_idx);
        return;
      }
    }
  } else {
    if (stores_dk_dv_with_tma(kernel_params, work)) {
      store_dk_dv_with_tma(kernel_params, work, acc_dk, acc_dv, mma_dkv, storage, consumer_idx);
      return;
    }
    if constexpr (Traits::kAddsDkvWithTma) {
      if (adds_dk_dv_with_tma(kernel_params, work)) {
        add_dk_dv_with_tma(kernel_params, work, acc_dk, acc_dv, coords, storage, consumer_idx);
        return;
      }
    }
  }
  store_dk_dv<typename Traits::Element, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN, kMaskKind, true>(
      kernel_params.call, work, work.sequence.seqlen_k - work.key_start, acc_dk, acc_dv, coords);
}

}  // namespace flash_cutlass::sm90

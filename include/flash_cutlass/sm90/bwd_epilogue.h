// The Hopper-path backward's epilogue where the call writes dK and dV in the inputs' dtype: both
// staged, converted, in K's and V's tiles in shared memory (free once both consumer warpgroups'
// last GEMMs are done) and stored by TMA, which leaves out rows and columns past the tensor (in a
// variable-length call only full key blocks: the rows past a sequence are the next one's). From registers (store_dk_dv, common/bwd_key_block.h) the same tiles took about
// 10,000 cycles at head dim 128 (two-element stores, 8 rows a warp instruction), while the SM,
// holding one CTA, did nothing else.
#pragma once

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/tma_views.h"

namespace flash_cutlass::sm90 {

// Whether this tile's dK and dV go out by TMA (store_dk_dv_with_tma); otherwise from registers.
template <class Traits, class Work>
__device__ __forceinline__ bool stores_dk_dv_with_tma(BwdKernelParams<Traits> const& kernel_params,
                                                      Work const& work) {
  return kernel_params.store_dkv_with_tma &&
         (kernel_params.call.cu_seqlens_q == nullptr || work.sequence.seqlen_k - work.key_start >= Traits::kBlockN);
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
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;
  Tensor dk = convert_fragment<Element>(acc_dk);
  Tensor dv = convert_fragment<Element>(acc_dv);
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  // Both warpgroups' GEMMs are done with K and V.
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  // stmatrix: 8x8 blocks of 16-bit values, a row of each per lane, into the swizzled tiles.
  auto copy_kv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
  auto thr_copy_kv = copy_kv.get_thread_slice(consumer_idx);
  copy(copy_kv, thr_copy_kv.retile_S(dk), thr_copy_kv.partition_D(sK));
  copy(copy_kv, thr_copy_kv.retile_S(dv), thr_copy_kv.partition_D(sV));
  tma_store_fence();  // the writes above, visible to the TMA unit
  named_barrier_sync<BwdBarrier::kConsumers, 0, Traits::kConsumerThreads>();
  if (consumer_idx == 0) {
    const TmaExtents extents = tma_extents(params);
    const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
    const auto shape = make_shape(extents.rows_k, params.head_dim, params.heads, extents.batch);
    const auto k_rows = make_coord(work.sequence.k_start, _0{});
    Tensor gdK = local_tile(domain_offset(k_rows, kernel_params.tma_dk.get_tma_tensor(shape)(_, _, work.tile.head, tma_batch)),
                            TileKV{}, make_coord(work.tile.n_block, _0{}));
    Tensor gdV = local_tile(domain_offset(k_rows, kernel_params.tma_dv.get_tma_tensor(shape)(_, _, work.tile.head, tma_batch)),
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

}  // namespace flash_cutlass::sm90

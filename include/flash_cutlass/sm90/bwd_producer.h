// The producer warpgroup of the Hopper-path backward: warp 0 loads by TMA, warp 1 writes dQ, warp 2
// stages the query rows' statistics.
// - The loader brings the CTA's K and V into shared memory once, then each query block's Q and dO
//   with TMA, and the statistics warp its LSE and D with its lanes' own loads, through kStages
//   stages (dO past head dim 128: see below): a stage is full when the TMA bytes have landed and
//   every lane of the statistics warp has stored its rows, empty when every consumer thread is done
//   with it. Rows past the sequence
//   read LSE +inf and D 0, so that the consumers need no bounds there. (In one warp, the TMA issue
//   waited for the statistics' global loads, which 24 registers serialize.)
// - The dQ warp adds each query block's dQ, which the consumers leave in shared memory, to dq_accum
//   with TMA's reduce-add (fp32 add in L2), off the consumers' path.
// - Past head dim 128 (kSeparatedO) dO has one stage and barriers of its own, so that its next
//   block loads once the consumers' dV GEMMs are done, not after dK's.
// Sequence isolation in a variable-length call: TMA reads a tile's rows past its sequence from the
// next sequence (elsewhere rows past the tensor arrive as zeros). Those rows would meet a zero
// (P = 0, dS = 0) in a GEMM, and 0 * NaN = NaN, so the warps of this warpgroup zero them in shared
// memory (K and V once, Q and dO in the sequence's last query block, dQ before its reduce-add)
// and the consumers' code stays the same for every call.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/ordered_reduce.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/tma_views.h"
#include "flash_cutlass/sm90/zero_rows.h"

namespace flash_cutlass::sm90 {

// Whether the loader zeroes rows of this tile's K and V (a variable-length call's key block past its
// sequence's end: TMA brings the next sequence's rows), which then land on kv_landed.
template <class Traits, class Work>
__device__ __forceinline__ bool zeroes_key_tail(BwdParams const& params, Work const& work) {
  return params.cu_seqlens_q != nullptr && work.sequence.seqlen_k - work.key_start < Traits::kBlockN;
}

// Whether the loader issues this tile's V after its walk's first Q and dO, on v_full
// (BwdParams::v_after_first_query): in walks of one tile a CTA (a persistent walk's next K and V
// load under the tile before's epilogue anyway) whose K/V tile needs no zeroed rows (those land
// together on kv_landed). The loader and the consumers both ask.
template <bool kRotatedWalk, class Traits, class Work>
__device__ __forceinline__ bool loads_v_after_first_query(BwdParams const& params, Work const& work) {
  if constexpr (kRotatedWalk) {
    return false;
  } else {
    return params.v_after_first_query && !zeroes_key_tail<Traits>(params, work);
  }
}

// Run by the 32 lanes of the loader warp, once a key tile.
template <class Traits, MaskKind kMaskKind, bool kRotatedWalk>
__device__ __forceinline__ void load_key_block(BwdKernelParams<Traits> const& kernel_params,
                                               KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
                                               KeyWalkPosition const& position,
                                               typename Traits::SharedStorage& storage, int lane) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kStages = Traits::kStages;
  using TileQ = typename Traits::TileQ;
  using TileKV = typename Traits::TileKV;
  if (work.m_block_begin >= work.m_block_end) return;
  BwdParams const& params = kernel_params.call;
  const int head_k = kv_head_of(work.tile.head, params);  // of every query head the walk takes

  // TMA views (rows, head_dim, heads, batch): rows and columns past the tensor arrive as zeros; in a
  // variable-length call rows past a sequence are the next one's, zeroed below once landed.
  const TmaExtents extents = tma_extents(params);
  const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
  Tensor mQ = kernel_params.tma_q.get_tma_tensor(make_shape(extents.rows_q, params.head_dim, params.heads, extents.batch));
  Tensor mdO =
      kernel_params.tma_dout.get_tma_tensor(make_shape(extents.rows_q, params.head_dim, params.heads, extents.batch));
  Tensor mK = kernel_params.tma_k.get_tma_tensor(make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch));
  Tensor mV = kernel_params.tma_v.get_tma_tensor(make_shape(extents.rows_k, params.head_dim, params.heads_k, extents.batch));
  const auto q_rows = make_coord(work.sequence.q_start, _0{});
  const auto k_rows = make_coord(work.sequence.k_start, _0{});
  Tensor gK = local_tile(domain_offset(k_rows, mK(_, _, head_k, tma_batch)), TileKV{}, make_coord(work.tile.n_block, _0{}));
  Tensor gV = local_tile(domain_offset(k_rows, mV(_, _, head_k, tma_batch)), TileKV{}, make_coord(work.tile.n_block, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  auto [tKgK, tKsK] = tma_partition(kernel_params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(kernel_params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  const bool varlen = params.cu_seqlens_q != nullptr;
  const int keys_in_block = work.sequence.seqlen_k - work.key_start;
  const bool zero_key_tail = zeroes_key_tail<Traits>(params, work);
  auto& kv_arrival = zero_key_tail ? storage.pipeline.kv_landed : storage.pipeline.kv_full;
  const bool v_later = loads_v_after_first_query<kRotatedWalk, Traits>(params, work);
  // The consumers are done with the tile before (the first tile finds K and V free).
  storage.pipeline.kv_empty.wait((position.key_tiles & 1) ^ 1);
  if (lane == 0) {
    kv_arrival.arrive_and_expect_tx((v_later ? 1 : 2) * Traits::kBytesKV);
    copy(kernel_params.tma_k.with(reinterpret_cast<uint64_t&>(kv_arrival)), tKgK, tKsK);
    if (!v_later) copy(kernel_params.tma_v.with(reinterpret_cast<uint64_t&>(kv_arrival)), tVgV, tVsV);
  }
  if (zero_key_tail) {
    storage.pipeline.kv_landed.wait(0);  // once per CTA: variable-length calls walk one tile a CTA
    zero_tile_rows<Traits::kHeadDim, 32>(storage.k.data(), typename Traits::SmemLayoutKV{}, keys_in_block,
                                         Traits::kBlockN, lane);
    zero_tile_rows<Traits::kHeadDim, 32>(storage.v.data(), typename Traits::SmemLayoutKV{}, keys_in_block,
                                         Traits::kBlockN, lane);
    cutlass::arch::fence_view_async_shared();  // the zeros, before wgmma (the async proxy) reads them
    __syncwarp();
    if (lane == 0) storage.pipeline.kv_full.arrive();
  }
  const int num_m_blocks = work.num_m_blocks();
  int step = position.steps;
  for (int h = 0; h < work.query_heads; ++h) {
    const int head = work.tile.head + h;
    Tensor gQ = local_tile(domain_offset(q_rows, mQ(_, _, head, tma_batch)), TileQ{}, make_coord(_, _0{}));
    Tensor gdO = local_tile(domain_offset(q_rows, mdO(_, _, head, tma_batch)), TileQ{}, make_coord(_, _0{}));
    auto [tQgQ, tQsQ] =
        tma_partition(kernel_params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] =
        tma_partition(kernel_params.tma_dout, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    for (int i = 0; i < num_m_blocks; ++i, ++step) {
      const int m_block = work.m_block_at(i);
      const int stage = step % kStages;
      const int dout_stage = step % Traits::kStagesdO;
      // The stage's previous block is done (the first kStages steps find it free).
      storage.pipeline.query_empty[stage].wait(((step / kStages) & 1) ^ 1);
      // Only a sequence's last query block can hold rows past it: its loads land on query_landed.
      const int queries_in_block = work.sequence.seqlen_q - m_block * kBlockM;
      const bool zero_query_tail = varlen && queries_in_block < kBlockM;
      if constexpr (Traits::kSeparatedO) {
        if (zero_query_tail) storage.pipeline.dout_empty[dout_stage].wait(((step / Traits::kStagesdO) & 1) ^ 1);
      }
      auto& query_arrival = zero_query_tail ? storage.pipeline.query_landed : storage.pipeline.query_full[stage];
      if (lane == 0) {
        if constexpr (Traits::kSeparatedO) {
          // Q as soon as its stage is free; dO once the consumers' dV GEMMs are done with the last one.
          if (zero_query_tail) {
            query_arrival.arrive_and_expect_tx(2 * Traits::kBytesQ);
          } else {
            query_arrival.arrive_and_expect_tx(Traits::kBytesQ);
          }
          copy(kernel_params.tma_q.with(reinterpret_cast<uint64_t&>(query_arrival)), tQgQ(_, m_block), tQsQ(_, stage));
          auto& dout_arrival =
              zero_query_tail ? storage.pipeline.query_landed : storage.pipeline.dout_full[dout_stage];
          if (!zero_query_tail) {
            storage.pipeline.dout_empty[dout_stage].wait(((step / Traits::kStagesdO) & 1) ^ 1);
            dout_arrival.arrive_and_expect_tx(Traits::kBytesQ);
          }
          copy(kernel_params.tma_dout.with(reinterpret_cast<uint64_t&>(dout_arrival)), tdOgdO(_, m_block),
               tdOsdO(_, dout_stage));
        } else {
          query_arrival.arrive_and_expect_tx(2 * Traits::kBytesQ);
          copy(kernel_params.tma_q.with(reinterpret_cast<uint64_t&>(query_arrival)), tQgQ(_, m_block), tQsQ(_, stage));
          copy(kernel_params.tma_dout.with(reinterpret_cast<uint64_t&>(query_arrival)), tdOgdO(_, m_block),
               tdOsdO(_, stage));
        }
        if (v_later && h == 0 && i == 0) {
          storage.pipeline.v_full.arrive_and_expect_tx(Traits::kBytesKV);
          copy(kernel_params.tma_v.with(reinterpret_cast<uint64_t&>(storage.pipeline.v_full)), tVgV, tVsV);
        }
      }
      if (zero_query_tail) {
        // Once a query head: variable-length calls walk one tile a CTA, whose walk has one last block
        // a head.
        storage.pipeline.query_landed.wait(h & 1);
        zero_tile_rows<Traits::kHeadDim, 32>(storage.q.data(), typename Traits::SmemLayoutQ{}, queries_in_block,
                                             kBlockM, lane, stage);
        zero_tile_rows<Traits::kHeadDim, 32>(storage.dout.data(), typename Traits::SmemLayoutdO{}, queries_in_block,
                                             kBlockM, lane, dout_stage);
        cutlass::arch::fence_view_async_shared();
        __syncwarp();
        if (lane == 0) {
          storage.pipeline.query_full[stage].arrive();  // in place of the TMA transaction's arrival
          if constexpr (Traits::kSeparatedO) storage.pipeline.dout_full[dout_stage].arrive();
        }
      }
    }
  }
}

// Run by the 32 lanes of the statistics warp: each query block's exponents of P (from the LSE, in
// the score unit of lse_score_unit) and D into its stage, one arrival a lane on the stage's full
// barrier (which counts 1 + 32).
template <class Traits, MaskKind kMaskKind>
__device__ __forceinline__ void stage_query_statistics(
    BwdParams const& params, KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
    KeyWalkPosition const& position, typename Traits::SharedStorage& storage, int lane, float score_unit) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kStages = Traits::kStages;
  const int num_m_blocks = work.num_m_blocks();
  int step = position.steps;
  for (int h = 0; h < work.query_heads; ++h) {
    const QueryRowBuffers query_rows = query_row_buffers<Traits::kHeadDim>(params, work.sequence, work.tile.head + h);
    for (int i = 0; i < num_m_blocks; ++i, ++step) {
      const int m_block = work.m_block_at(i);
      const int stage = step % kStages;
      storage.pipeline.query_empty[stage].wait(((step / kStages) & 1) ^ 1);
      bool exact_rows = false;
      CUTE_UNROLL
      for (int local_row = lane; local_row < kBlockM; local_row += 32) {
        const int row = m_block * kBlockM + local_row;
        float lse = INFINITY, dsum = 0.f;
        if (row < work.sequence.seqlen_q) {
          lse = query_rows.lse[row];
          dsum = query_rows.dsum[row];
          if (lse == -INFINITY) lse = INFINITY;  // a row that sees no key: P = 0, not exp(-inf + inf)
        }
        const ScoreExponent exponent = probability_exponent(lse, params.exp2_scale, score_unit);
        exact_rows |= exponent.scale != params.exp2_scale;
        storage.pipeline.exponent[stage][local_row] = exponent;
        storage.pipeline.dsum[stage][local_row] = dsum;
      }
      exact_rows = __any_sync(0xffffffffu, exact_rows);
      if (lane == 0) storage.pipeline.exact_rows[stage] = exact_rows;
      storage.pipeline.query_full[stage].arrive();  // each lane releases its own stores
    }
  }
}

// Run by the dQ warp: the query blocks in the consumers' order, one TMA reduce-add each (in the
// head-split layout two, one a warpgroup's half of the columns, staged in turn). Rows past the
// tensor are not written; in a variable-length call the rows past a sequence are the next one's:
// the last block's are zeroed first (0 in exact arithmetic, but not when this sequence holds a NaN
// or an Inf).
template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kRotatedWalk>
__device__ __forceinline__ void write_dq(BwdKernelParams<Traits> const& kernel_params,
                                         KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
                                         KeyWalkPosition const& position, typename Traits::SharedStorage& storage,
                                         int lane) {
  using namespace cute;
  // The consumers that stage one tile, and this warp.
  constexpr int kParts = Traits::kHeadSplit ? Traits::kConsumerWarpgroups : 1;
  constexpr int kDqThreads = Traits::dq_staging_threads(kExtension != Extension::kNone) + 32;
  using TileDq = typename Traits::TileDq;
  constexpr int kDqColumns = size<1>(TileDq{});
  BwdParams const& params = kernel_params.call;
  const TmaExtents extents = tma_extents(params);
  const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
  Tensor mdQ = kernel_params.tma_dq.get_tma_tensor(
      make_shape(extents.rows_q, Int<Traits::kHeadDim>{}, params.heads, extents.batch));
  Tensor sdQ = make_tensor(make_smem_ptr(storage.dq.data()), typename Traits::SmemLayoutdQ{});
  const bool varlen = params.cu_seqlens_q != nullptr;
  const DqTurns<Traits::kBlockM, Traits::kBlockN, kMaskKind> turns(params, work, kRotatedWalk);
  const DqArrivals<Traits::kBlockM> arrivals(params, work.tile.batch);
  const int num_m_blocks = work.num_m_blocks();
  const int num_steps = work.num_steps();
  int walk_step = 0;
  for (int h = 0; h < work.query_heads; ++h) {
    const int head = work.tile.head + h;
    // (rows, columns, m_block, part)
    Tensor gdQ = local_tile(domain_offset(make_coord(work.sequence.q_start, _0{}), mdQ(_, _, head, tma_batch)),
                            TileDq{}, make_coord(_, _));
    auto [tdQgdQ, tdQsdQ] = tma_partition(kernel_params.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sdQ),
                                          group_modes<0, 2>(gdQ));
    for (int i = 0; i < num_m_blocks; ++i, ++walk_step) {
      const int m_block = work.m_block_at(i);
      // The block before's dQ has been read: the consumers (the first part's) refill storage.dq. In a
      // rotated walk, once its turn has been passed too (the walk's next tile begins here as well;
      // measured 6-15% faster at head dim 128 than freeing it before the turn); in one CTA a tile,
      // as soon as it has been read (below).
      if (kRotatedWalk && position.steps + walk_step > 0) named_barrier_arrive<BwdBarrier::kDqEmpty, 0, kDqThreads>();
      // Counted while the consumers still compute this block's dQ.
      const int place = turns ? turns.place(work, m_block, lane) : 0;
      // dQ's first store: a deterministic call's first turn, or else the first arrival.
      bool first_store = false;
      if (lane == 0 && params.dq_first_store) {
        first_store = turns ? place == 0 : arrivals.arrive_first_or_wait_for_store(head, m_block);
      }
      const int queries_in_block = work.sequence.seqlen_q - m_block * Traits::kBlockM;
      CUTE_UNROLL
      for (int part = 0; part < kParts; ++part) {
        if (part == 0) {
          named_barrier_sync<BwdBarrier::kDqFull, 0, kDqThreads>();
        } else {
          named_barrier_sync<BwdBarrier::kDqFull, 2, kDqThreads>();
        }
        if (varlen && queries_in_block < Traits::kBlockM) {
          zero_tile_rows<kDqColumns, 32>(storage.dq.data(), typename Traits::SmemLayoutdQ{}, queries_in_block,
                                         Traits::kBlockM, lane);
          cutlass::arch::fence_view_async_shared();  // before the TMA unit reads the tile
          __syncwarp();
        }
        if (lane == 0) {
          if (part == 0 && turns) wait_for_turn(turns.counter(head, m_block), place);
          if (first_store) {
            copy(kernel_params.tma_dq_store, tdQsdQ, tdQgdQ(_, m_block, part));
          } else {
            copy(kernel_params.tma_dq, tdQsdQ, tdQgdQ(_, m_block, part));
          }
          tma_store_arrive();
          tma_store_wait<0>();  // the TMA unit has read storage.dq
        }
        __syncwarp();
        // The next part's consumers refill storage.dq, or the next block's first (in a rotated walk:
        // above).
        if (part + 1 < kParts) {
          named_barrier_arrive<BwdBarrier::kDqEmpty, 2, kDqThreads>();
        } else if (!kRotatedWalk && walk_step + 1 < num_steps) {
          named_barrier_arrive<BwdBarrier::kDqEmpty, 0, kDqThreads>();
        }
      }
      if (lane == 0 && turns) pass_turn_after_reductions(turns.counter(head, m_block));
      if (first_store && !turns) arrivals.mark_stored(head, m_block);
    }
  }
}

}  // namespace flash_cutlass::sm90

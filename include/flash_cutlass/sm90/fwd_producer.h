// The producer of the Hopper-path forward: one thread of the producer warpgroup brings each tile's
// Q and its K/V blocks into shared memory with TMA, through the K/V pipeline's stages and Q's
// full/empty barrier pair, running ahead into the next tile while the consumers finish this one.
// In a variable-length call V comes through its sequence's own descriptor (sequence_descriptors.h),
// so that the rows a tile reads past the sequence arrive as zeros; paged K and V (chunked prefill
// over a paged KV cache) a key block at a time from the page the block table names.
#pragma once

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/kvcache.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/fwd_kernel_params.h"
#include "flash_cutlass/sm90/sequence_descriptors.h"
#include "flash_cutlass/sm90/tile_config.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/timeline.h"

namespace flash_cutlass::sm90 {

// The loads of one tile at a time. The state that lives across tiles (the TMA views, the K/V
// pipeline's write stage, the count of Q loads whose parity Q's barriers track, the timeline) is
// the kernel's; FwdProducer refers to it, so that the kernel's loop over tiles owns it.
template <class Traits, MaskKind kMaskKind, bool kPagedKV, class ViewQ, class ViewKV, class SmemQ, class SmemKV>
struct FwdProducer {
  using PipelineKV = typename Traits::PipelineKV;
  using TileShape = typename Traits::TileShape;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;

  FwdParams const& params;
  ViewQ& mQ;
  ViewKV& mK;
  ViewKV& mV;
  FwdKernelParams<Traits> const& kernel_params;
  SmemQ& sQ;
  SmemKV& sK;
  SmemKV& sV;
  PipelineKV& pipeline_k;
  typename PipelineKV::PipelineState& state;
  Timeline& timeline;
  typename Traits::SharedStorage& storage;
  int& q_loads;
  PipelineKV& pipeline_v;

  // A TMA copy's views of a global tensor's blocks and of their shared-memory stages, (global,
  // shared) as a tuple: the loaders' lambdas capture it whole (C++17 lambdas capture no
  // structured bindings).
  template <class Tma, class SmemTensor, class GmemTensor>
  __device__ __forceinline__ static auto tma_views(Tma const& tma, SmemTensor const& smem, GmemTensor const& gmem) {
    using namespace cute;
    return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(smem), group_modes<0, 2>(gmem));
  }

  // The tile's key blocks from the last to the first, the order the consumers visit them in; none
  // for a tile past its sequence's end or without keys (its consumers only store its epilogue).
  __device__ __forceinline__ void load_tile(QueryTile tile) {
    using namespace cute;
    const auto work = tile_work<kBlockM, kBlockN, kMaskKind>(params, tile);
    if (!work.in_sequence() || !work.has_keys()) return;
    timeline.stamp(0, kLoadStart);
    timeline.value(0, kKeyBlocks, work.key_blocks.end - work.key_blocks.begin);
    timeline.value(0, kQueryBlock, work.tile.m_block);
    const int head_k = kv_head_of(work.tile.head, params);
    const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
    const bool per_sequence_v = params.cu_seqlens_k != nullptr;
    const TmaDescriptor* v_descriptor =
        per_sequence_v ? static_cast<TmaDescriptor const*>(params.sequence_descriptors) + work.tile.batch
                       : kernel_params.tma_v.get_tma_descriptor();
    if (per_sequence_v) {  // written by shift_value_descriptors, before this kernel
      tma_descriptor_fence_acquire(v_descriptor);
      prefetch_tma_descriptor(v_descriptor);
    }
    if constexpr (kPagedKV) {
      load_paged_tile(work, head_k, v_descriptor);
      return;
    }
    Tensor gK = local_tile(domain_offset(make_coord(work.sequence.k_start, _0{}), mK(_, _, head_k, tma_batch)),
                           select<1, 2>(TileShape{}), make_coord(_, _0{}));
    const int v_row_origin = per_sequence_v ? value_row_origin(params, work.sequence) : work.sequence.k_start;
    Tensor gV = local_tile(domain_offset(make_coord(v_row_origin, _0{}), mV(_, _, head_k, tma_batch)),
                           select<1, 2>(TileShape{}), make_coord(_, _0{}));
    auto k_views = tma_views(kernel_params.tma_k, sK, gK);
    auto v_views = tma_views(kernel_params.tma_v, sV, gV);
    load_blocks(
        work, [](int n_block) { return n_block; },
        [&](int block, int, int stage, uint64_t& barrier) {
          copy(kernel_params.tma_k.with(barrier), get<0>(k_views)(_, block), get<1>(k_views)(_, stage));
        },
        [&](int block, int, int stage, uint64_t& barrier) {
          copy(kernel_params.tma_v.with(v_descriptor, barrier), get<0>(v_views)(_, block), get<1>(v_views)(_, stage));
        });
  }

  // A paged call (kPagedKV; params.h, block_table): each key block from the page that holds it
  // (pages of a multiple of kBlockN rows). The block holding the sequence's last key takes V
  // through the sequence's descriptor, whose extent ends at that key's row
  // (sequence_descriptors.h), so that its rows past the sequence, which the block table may leave
  // unwritten, arrive as zeros (P is 0 there, but 0 * NaN is not); K's rows there may hold
  // anything: the consumers mask their scores.
  template <class Work>
  __device__ __forceinline__ void load_paged_tile(Work const& work, int head_k,
                                                  cute::TmaDescriptor const* last_descriptor) {
    using namespace cute;
    const PagedKeys pages = paged_keys(params, work.tile.batch);
    const int seqlen_k = work.sequence.seqlen_k;
    // The sequence descriptor's row of a page row: its extent's last row is the last key's.
    const int last_shift = tma_extents(params).rows_k - 1 - pages.row_of(seqlen_k - 1);
    Tensor gK = local_tile(mK(_, _, head_k, _0{}), select<1, 2>(TileShape{}), make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, head_k, _0{}), select<1, 2>(TileShape{}), make_coord(_, _0{}));
    Tensor gVLast = local_tile(domain_offset(make_coord(last_shift, _0{}), mV(_, _, head_k, _0{})),
                               select<1, 2>(TileShape{}), make_coord(_, _0{}));
    auto k_views = tma_views(kernel_params.tma_k, sK, gK);
    auto v_views = tma_views(kernel_params.tma_v, sV, gV);
    Tensor tVgVLast = get<0>(tma_views(kernel_params.tma_v, sV, gVLast));
    // The page rows of the tile's key blocks, visited from the last (step 0) to the first, 32 at a
    // time: lane l of the producer warp holds the row of step 32 c + l of chunk c, the chunk read
    // together by the warp's lanes one chunk ahead, and lane 0, which issues the loads, takes each
    // block's row from its lane by a shuffle: no read of the table and no division between a
    // stage's wait and its loads. (The entry read one block ahead by the issuing thread alone left
    // the kernel 6% behind the contiguous cache's; a ring of cp.async copies of the entries, 16%.)
    const int lane = int(threadIdx.x) % 32;
    const int first = work.key_blocks.begin;
    const int last = work.key_blocks.end - 1;
    auto chunk_row = [&](int chunk) {
      const int n_block = last - (chunk * 32 + lane);
      return n_block >= first ? pages.row_of(n_block * kBlockN) : 0;
    };
    int chunk_rows = chunk_row(0);
    int next_chunk_rows = last - first >= 32 ? chunk_row(1) : 0;
    load_blocks(
        work,
        [&](int n_block) {
          const int step = last - n_block;
          if (step % 32 == 0 && step > 0) {
            chunk_rows = next_chunk_rows;
            if (step + 32 <= last - first) next_chunk_rows = chunk_row(step / 32 + 1);
          }
          return __shfl_sync(0xffffffffu, chunk_rows, step % 32) / kBlockN;
        },
        [&](int block, int, int stage, uint64_t& barrier) {
          if (lane == 0) copy(kernel_params.tma_k.with(barrier), get<0>(k_views)(_, block), get<1>(k_views)(_, stage));
        },
        [&](int block, int n_block, int stage, uint64_t& barrier) {
          if (lane != 0) return;
          if ((n_block + 1) * kBlockN > seqlen_k) {
            copy(kernel_params.tma_v.with(last_descriptor, barrier), tVgVLast(_, block), get<1>(v_views)(_, stage));
          } else {
            copy(kernel_params.tma_v.with(barrier), get<0>(v_views)(_, block), get<1>(v_views)(_, stage));
          }
        });
  }

  // The tile's Q and its K/V blocks: locate(key block) is where the block's rows lie (the index
  // copy_k and copy_v take: (that, key block, stage, barrier)), asked once a block in the order of
  // the loads, before the wait for its stages. The paged kernel runs this on the producer warp's
  // 32 lanes (load_paged_tile), its lane 0 issuing; the others on thread 0 alone.
  template <class Work, class Locate, class CopyK, class CopyV>
  __device__ __forceinline__ void load_blocks(Work const& work, Locate const& locate, CopyK const& copy_k,
                                              CopyV const& copy_v) {
    using namespace cute;
    const int tma_batch = params.cu_seqlens_q == nullptr ? work.tile.batch : 0;
    Tensor gQ = local_tile(domain_offset(make_coord(work.sequence.q_start, _0{}), mQ(_, _, work.tile.head, tma_batch)),
                           select<0, 2>(TileShape{}), make_coord(work.tile.m_block, _0{}));
    auto [tQgQ, tQsQ] = tma_partition(kernel_params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(gQ));
    const bool issues = !kPagedKV || threadIdx.x == 0;

    // The tile's first K block goes before its Q: it may load while the consumers still read
    // the previous tile's Q, which Q's load has to wait for.
    const int first = work.key_blocks.begin;
    const int last = work.key_blocks.end - 1;
    auto block = locate(last);
    pipeline_k.producer_acquire(state);
    timeline.stamp(0, kFirstKStageAcquired);
    copy_k(block, last, state.index(), *pipeline_k.producer_get_barrier(state));
    if (q_loads > 0) storage.q_empty.wait((q_loads - 1) & 1);
    timeline.stamp(0, kQBufferFree);
    if (issues) {
      storage.q_full.arrive_and_expect_tx(Traits::kBytesQ);
      copy(kernel_params.tma_q.with(reinterpret_cast<uint64_t&>(storage.q_full)), tQgQ, tQsQ);
    }
    ++q_loads;
    pipeline_v.producer_acquire(state);
    copy_v(block, last, state.index(), *pipeline_v.producer_get_barrier(state));
    ++state;
    for (int n_block = last - 1; n_block >= first; --n_block) {
      block = locate(n_block);
      pipeline_k.producer_acquire(state);
      copy_k(block, n_block, state.index(), *pipeline_k.producer_get_barrier(state));
      pipeline_v.producer_acquire(state);
      copy_v(block, n_block, state.index(), *pipeline_v.producer_get_barrier(state));
      ++state;
    }
    timeline.stamp(0, kLoadsIssued);
  }
};

}  // namespace flash_cutlass::sm90

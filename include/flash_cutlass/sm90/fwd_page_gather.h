// The paged forward kernel's own gather (FwdParams::page_gather): chunked prefill over a KV cache
// whose pages are smaller than a key block. Before, a gather kernel copied the whole cache into
// packed sequences and the forward waited for all of it; here one thread of the producer warpgroup
// copies it while the tiles run, into staging pages of kPagedKeyRows rows that the loader reads
// through the staging block table as it reads a cache of such pages (fwd_producer.h,
// load_paged_tile).
// - A staged page is one sequence's kPagedKeyRows positions of one K/V head, its K and V. The
//   threads of every CTA claim them from one counter in the order the tiles read them: the
//   sequences in turn (the tiles are numbered batch-major), within one its last page first (a
//   causal tile walks its key blocks from the last), the K/V heads innermost.
// - A page goes in boxes of kStagedPageBoxRows rows, each within one page of the cache: TMA loads
//   into a ring of shared-memory slots, and from each slot a TMA store into the staging page, a
//   few loads in flight. Once the page's stores have completed, its flag is released; the loader
//   acquires it before its first load from the page.
// - No wait of this thread depends on another CTA, so every claimed page gets staged whichever
//   CTAs the GPU runs, and the loaders' waits end.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/kvcache.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/fwd_kernel_params.h"
#include "flash_cutlass/sm90/ordered_reduce.h"

namespace flash_cutlass::sm90 {

// The flag of staged page `page` of sequence `batch` and K/V head `head_k`.
__device__ __forceinline__ int* staged_page_flag(FwdParams const& params, int batch, int head_k, int page) {
  const FwdParams::PageGather& gather = params.page_gather;
  return gather.flags + (int64_t(batch) * params.heads_k + head_k) * gather.staged_pages + page;
}

// Returns once the staged page of `flag` is filled, its stores ordered before this thread's next
// TMA loads; as poll_until (ordered_reduce.h), traps past 2^26 polls (at least 8 s: the route stages
// at most kKVCachePrefillMaxGatherBytes, milliseconds of copying).
__device__ __forceinline__ void wait_for_staged_page(const int* flag) {
  for (unsigned polls = 0;; ++polls) {
    int staged;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(staged) : "l"(flag) : "memory");
    if (staged != 0) break;
    if (polls == (1u << 26)) __trap();
    __nanosleep(128);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Run by one thread (of the producer warpgroup's second warp) until every staged page is claimed.
template <class Traits>
__device__ __forceinline__ void gather_pages(FwdKernelParams<Traits> const& kernel_params,
                                             typename Traits::GatherStorage& staging) {
  using namespace cute;
  constexpr int kSlots = Traits::kGatherSlots;
  constexpr int kBoxRows = Traits::kGatherBoxRows;
  constexpr int kBoxesPerPage = kPagedKeyRows / kBoxRows;
  FwdParams const& params = kernel_params.call;
  const FwdParams::PageGather& gather = params.page_gather;
  const int64_t cache_rows = int64_t(gather.num_pages) * gather.page_size;
  const int64_t staged_rows = int64_t(params.num_pages) * params.page_size;
  const auto cache_shape = make_shape(int(cache_rows), params.head_dim, params.heads_k, 1);
  const auto staged_shape = make_shape(int(staged_rows), params.head_dim, params.heads_k, 1);
  Tensor mCacheK = kernel_params.tma_gather_k.get_tma_tensor(cache_shape);
  Tensor mCacheV = kernel_params.tma_gather_v.get_tma_tensor(cache_shape);
  Tensor mStagedK = kernel_params.tma_stage_k.get_tma_tensor(staged_shape);
  Tensor mStagedV = kernel_params.tma_stage_v.get_tma_tensor(staged_shape);
  Tensor sSlots = make_tensor(make_smem_ptr(staging.boxes.data()), typename Traits::SmemLayoutGatherSlots{});
  using BoxShape = typename Traits::GatherBoxShape;
  // The slots' barriers, this thread's alone: initialized here, visible to the TMA unit before use.
  CUTE_UNROLL
  for (int slot = 0; slot < kSlots; ++slot) staging.landed[slot].init(1);
  cutlass::arch::fence_barrier_init();
  cutlass::arch::fence_view_async_shared();

  const int pages_per_batch = params.heads_k * gather.staged_pages;
  const int64_t pages = int64_t(params.batch) * pages_per_batch;
  int boxes_moved = 0;  // over the thread's pages: a slot's use count gives its barrier's phase
  for (;;) {
    const int claimed = atomicAdd(gather.next_page, 1);
    if (claimed >= pages) break;
    const int batch = claimed / pages_per_batch;
    const int in_batch = claimed - batch * pages_per_batch;
    const int head_k = in_batch % params.heads_k;
    const int length = sequence_rows(params.cu_seqlens_k, batch, params.total_k, params.seqlen_k).length;
    const int page = (length + kPagedKeyRows - 1) / kPagedKeyRows - 1 - in_batch / params.heads_k;
    if (page < 0) continue;  // past the sequence's pages: nothing a tile reads
    const int first_position = page * kPagedKeyRows;
    const int boxes = min(kBoxesPerPage, (length - first_position + kBoxRows - 1) / kBoxRows);
    const int copies = 2 * boxes;  // K's box, then V's, of each box of rows
    const int* table_row = gather.block_table + int64_t(batch) * gather.block_table_batch_stride;
    const int staged_row = (batch * gather.staged_pages + page) * kPagedKeyRows;  // < 2^31: the host's bound

    Tensor gCacheK = local_tile(mCacheK(_, _, head_k, 0), BoxShape{}, make_coord(_, _0{}));
    Tensor gCacheV = local_tile(mCacheV(_, _, head_k, 0), BoxShape{}, make_coord(_, _0{}));
    Tensor gStagedK = local_tile(mStagedK(_, _, head_k, 0), BoxShape{}, make_coord(_, _0{}));
    Tensor gStagedV = local_tile(mStagedV(_, _, head_k, 0), BoxShape{}, make_coord(_, _0{}));
    auto [tCgK, tCsK] = tma_partition(kernel_params.tma_gather_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sSlots),
                                      group_modes<0, 2>(gCacheK));
    auto [tCgV, tCsV] = tma_partition(kernel_params.tma_gather_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sSlots),
                                      group_modes<0, 2>(gCacheV));
    auto [tSgK, tSsK] = tma_partition(kernel_params.tma_stage_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sSlots),
                                      group_modes<0, 2>(gStagedK));
    auto [tSgV, tSsV] = tma_partition(kernel_params.tma_stage_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sSlots),
                                      group_modes<0, 2>(gStagedV));

    // Copy c (box c / 2, K if even) into slot (boxes_moved + c) % kSlots.
    auto load = [&](int c) {
      const int slot = (boxes_moved + c) % kSlots;
      const int position = first_position + (c / 2) * kBoxRows;
      const int page_index = position / gather.page_size;
      const int cache_row = clamped_page(table_row, page_index, gather.num_pages) * gather.page_size + position -
                            page_index * gather.page_size;
      auto& landed = staging.landed[slot];
      landed.arrive_and_expect_tx(Traits::kGatherBoxBytes);
      if (c % 2 == 0) {
        copy(kernel_params.tma_gather_k.with(reinterpret_cast<uint64_t&>(landed)), tCgK(_, cache_row / kBoxRows),
             tCsK(_, slot));
      } else {
        copy(kernel_params.tma_gather_v.with(reinterpret_cast<uint64_t&>(landed)), tCgV(_, cache_row / kBoxRows),
             tCsV(_, slot));
      }
    };
    for (int c = 0; c < kSlots - 1 && c < copies; ++c) load(c);
    for (int c = 0; c < copies; ++c) {
      const int moved = boxes_moved + c;
      const int slot = moved % kSlots;
      staging.landed[slot].wait((moved / kSlots) & 1);
      const int box_row = staged_row / kBoxRows + c / 2;
      if (c % 2 == 0) {
        copy(kernel_params.tma_stage_k, tSsK(_, slot), tSgK(_, box_row));
      } else {
        copy(kernel_params.tma_stage_v, tSsV(_, slot), tSgV(_, box_row));
      }
      tma_store_arrive();
      // The slot of copy c - 1 is read once its store is; copy c + kSlots - 1 loads into it.
      if (c + kSlots - 1 < copies) {
        tma_store_wait<1>();
        load(c + kSlots - 1);
      }
    }
    boxes_moved += copies;
    // The page's stores complete in global memory before its flag: the loaders' TMA reads follow.
    release_add_after_bulk_copies(staged_page_flag(params, batch, head_k, page), 1);
  }
  tma_store_wait<0>();  // the slots' last stores have read them before the CTA's shared memory goes
}

}  // namespace flash_cutlass::sm90

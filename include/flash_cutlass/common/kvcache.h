// Where a KV-cache call's tokens live (params.h, KVCacheParams): each sequence's length after the
// append, and the cache row of each of its positions. Shared by the append kernel and the
// attention kernels, so that both clamp the unchecked device values the same way.
#pragma once

#include <cstdint>

#include <cutlass/fast_math.h>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

// Sequence b of a KV-cache call: its new tokens go to positions [start, start + seqlen_new), and it
// attends to its first `length` = start + seqlen_new positions. cache_seqlens[b] is clamped into
// [0, capacity - seqlen_new] (the host checks capacity >= seqlen_new), so every position lies in
// the sequence's pages whatever the device holds.
struct CachedSequence {
  int start;
  int length;
};

__device__ __forceinline__ CachedSequence cached_sequence(KVCacheParams const& params, int batch) {
  const int held = params.cache_seqlens == nullptr ? params.cache_seqlen : params.cache_seqlens[batch];
  const int start = min(max(held, 0), params.capacity - params.seqlen_new);
  return {start, start + params.seqlen_new};
}

// Entry page_index of a block table row, clamped into [0, num_pages): an out-of-range id reads and
// writes some page of the cache, never memory outside it.
__device__ __forceinline__ int clamped_page(const int* table_row, int page_index, int num_pages) {
  return min(max(table_row[page_index], 0), num_pages - 1);
}

// The keys of one sequence of a paged call (FwdParams::block_table): row_of(position) is the row,
// among the pages' num_pages * page_size, holding a position below the positions the sequence's
// block table row reaches (the page clamped as clamped_page does; below 2^31: the host's bound on
// the pages' rows).
struct PagedKeys {
  const int* table;  // this sequence's block_table row
  int num_pages;
  int page_size;

  __device__ __forceinline__ int row_of(int position) const {
    const int page_index = position / page_size;
    return clamped_page(table, page_index, num_pages) * page_size + position - page_index * page_size;
  }
};

__device__ __forceinline__ PagedKeys paged_keys(FwdParams const& params, int batch) {
  return {params.block_table + int64_t(batch) * params.block_table_batch_stride, params.num_pages, params.page_size};
}

// The pages of one sequence. page_of(position) is the cache row (contiguous) or page (paged) that
// holds a position below capacity, clamped to [0, num_pages): an out-of-range id in a block table
// or cache_batch_idx reads and writes some page of the cache, never memory outside it.
struct SequencePages {
  const int* table;  // this sequence's block_table row; nullptr for a contiguous cache
  int row;           // the contiguous cache's row of this sequence
  int num_pages;
  cutlass::FastDivmod page_size;

  __device__ __forceinline__ int page_of(int position, int& row_in_page) const {
    if (table == nullptr) {
      row_in_page = position;
      return row;
    }
    int page_index;
    page_size(page_index, row_in_page, position);
    return clamped_page(table, page_index, num_pages);
  }

  // Element offset of (position, head) in a cache of these strides; page and row_in_page are never
  // negative (page_of's), so they widen unsigned.
  __device__ __forceinline__ int64_t offset_of(int page, int row_in_page, int64_t page_stride, int64_t row_stride,
                                               int64_t head_offset) const {
    return int64_t(uint32_t(page)) * page_stride + int64_t(uint32_t(row_in_page)) * row_stride + head_offset;
  }
};

__device__ __forceinline__ SequencePages sequence_pages(KVCacheParams const& params, int batch) {
  const int* table =
      params.block_table == nullptr ? nullptr : params.block_table + int64_t(batch) * params.block_table_batch_stride;
  int row = batch;
  if (params.block_table == nullptr && params.cache_batch_idx != nullptr) {
    row = min(max(params.cache_batch_idx[batch], 0), params.num_pages - 1);
  }
  return {table, row, params.num_pages, cutlass::FastDivmod(params.page_size)};
}

// Row `token` of sequence `batch`'s new keys (or, is_v, values) at kv head `head` (params.k_new,
// params.v_new).
template <class Element>
__device__ __forceinline__ const Element* new_token_row(KVCacheParams const& params, bool is_v, int batch, int token,
                                                        int head) {
  return is_v ? static_cast<const Element*>(params.v_new) + int64_t(batch) * params.v_new_batch_stride +
                    int64_t(token) * params.v_new_row_stride + int64_t(head) * params.v_new_head_stride
              : static_cast<const Element*>(params.k_new) + int64_t(batch) * params.k_new_batch_stride +
                    int64_t(token) * params.k_new_row_stride + int64_t(head) * params.k_new_head_stride;
}

// The writable K (or, is_v, V) cache row at (page, row_in_page) of `pages` (SequencePages::page_of),
// kv head `head` (params.k_cache, params.v_cache).
template <class Element>
__device__ __forceinline__ Element* cache_row(KVCacheParams const& params, SequencePages const& pages, bool is_v,
                                              int page, int row_in_page, int head) {
  return is_v ? static_cast<Element*>(params.v_cache) +
                    pages.offset_of(page, row_in_page, params.v_batch_stride, params.v_row_stride,
                                    int64_t(head) * params.v_head_stride)
              : static_cast<Element*>(params.k_cache) +
                    pages.offset_of(page, row_in_page, params.k_batch_stride, params.k_row_stride,
                                    int64_t(head) * params.k_head_stride);
}

// The query that packed row `row` of a (kv head, batch) tile holds, and its query head: the
// `group` = heads / heads_k query heads of one kv head are packed with the query index outer
// (row = query * group + head in group), so that a tile's rows span few queries and a causal
// mask or window bounds its keys tightly.
struct PackedRow {
  int query;
  int head;
};

__device__ __forceinline__ PackedRow packed_row(int row, int group, int kv_head) {
  const int query = row / group;
  return {query, kv_head * group + (row - query * group)};
}

}  // namespace flash_cutlass

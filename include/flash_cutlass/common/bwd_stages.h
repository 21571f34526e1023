// The frame of every backward path: a preprocess kernel (D = rowsum(dO * O), dq_accum zeroed)
// before the path's main kernel or kernels and a postprocess kernel (dQ = scale * dq_accum in the
// inputs' dtype) after them, and the host function that launches the three. The sm80 path
// (sm80/bwd_launch.h) and the Hopper path (sm90/bwd_launch.h) both run their main kernels in it.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The threads that share one row of kHeadDim elements, 8 per thread: a power of two (so that a
// row never straddles a warp or a CTA and the shuffle reduction is a butterfly); the threads
// past kHeadDim / 8 idle.
constexpr int threads_per_row(int head_dim) {
  int threads = 1;
  while (threads * 8 < head_dim) threads *= 2;
  return threads;
}
template <int kHeadDim>
constexpr int kThreadsPerRow = threads_per_row(kHeadDim);
constexpr int kPrePostThreads = 128;
static_assert(kThreadsPerRow<256> <= 32 && kPrePostThreads % 32 == 0);

// With dQ's first store (BwdParams::dq_first_store), the counters of the key blocks that reach each
// query block, and where a query row's block is counted; else nullptr.
__host__ __device__ __forceinline__ int* dq_block_counts(BwdParams const& params) {
  if (!params.dq_first_store) return nullptr;
  return params.deterministic ? params.dq_turns : params.dq_arrivals;
}
__device__ __forceinline__ int64_t dq_block_index(BwdParams const& params, int batch, int head, int query) {
  const int64_t blocks = (params.seqlen_q + params.dq_block_rows - 1) / params.dq_block_rows;
  return (int64_t(batch) * params.heads + head) * blocks + query / params.dq_block_rows;
}

// One row (batch, query, head) per kThreadsPerRow threads, rows in memory order of dout:
// dsoftmax_sum[batch, head, query] = sum(dout * out) over the head dim, in fp32, and the row of
// dq_accum zeroed (with dQ's first store, each block's arrival count instead).
template <int kHeadDim, class Element>
__global__ void __launch_bounds__(kPrePostThreads)
    flash_bwd_preprocess(__grid_constant__ const BwdParams params) {
  constexpr int kGroup = kThreadsPerRow<kHeadDim>;
  const int64_t row = (int64_t(blockIdx.x) * kPrePostThreads + threadIdx.x) / kGroup;
  const int lane = threadIdx.x % kGroup;
  const int64_t rows = int64_t(params.batch) * params.seqlen_q * params.heads;
  const int head = int(row % params.heads);
  const int query = int((row / params.heads) % params.seqlen_q);
  const int batch = int(row / (int64_t(params.heads) * params.seqlen_q));
  const int col = lane * 8;
  float sum = 0.f;
  if (row < rows && col < params.head_dim) {
    const Element* dout = static_cast<const Element*>(params.dout) + batch * params.dout_batch_stride +
                          query * params.dout_row_stride + head * params.dout_head_stride + col;
    const Element* out = static_cast<const Element*>(params.out) + batch * params.out_batch_stride +
                         query * params.out_row_stride + head * params.out_head_stride + col;
    const cutlass::Array<Element, 8> dout8 = *reinterpret_cast<const cutlass::Array<Element, 8>*>(dout);
    const cutlass::Array<Element, 8> out8 = *reinterpret_cast<const cutlass::Array<Element, 8>*>(out);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) sum += float(dout8[i]) * float(out8[i]);
  }
  CUTE_UNROLL
  for (int offset = kGroup / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && col < kHeadDim) {
    const int64_t out_row = (int64_t(batch) * params.heads + head) * params.seqlen_q + query;
    if (lane == 0) params.dsoftmax_sum[out_row] = sum;
    if (int* counts = dq_block_counts(params)) {
      if (lane == 0 && query % params.dq_block_rows == 0) counts[dq_block_index(params, batch, head, query)] = 0;
    } else {
      float4* dq_accum = reinterpret_cast<float4*>(params.dq_accum + out_row * kHeadDim + col);
      dq_accum[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dq_accum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// dq[batch, query, head, :head_dim] = softmax_scale * dq_accum[batch, head, query, :head_dim] in
// Element, one row per kThreadsPerRow threads as above (zeros where dQ's first store left the
// row's block unwritten: no key block reached it).
template <int kHeadDim, class Element>
__global__ void __launch_bounds__(kPrePostThreads)
    flash_bwd_postprocess(__grid_constant__ const BwdParams params) {
  constexpr int kGroup = kThreadsPerRow<kHeadDim>;
  const int64_t row = (int64_t(blockIdx.x) * kPrePostThreads + threadIdx.x) / kGroup;
  const int col = (threadIdx.x % kGroup) * 8;
  const int64_t rows = int64_t(params.batch) * params.seqlen_q * params.heads;
  if (row >= rows || col >= params.head_dim) return;
  const int head = int(row % params.heads);
  const int query = int((row / params.heads) % params.seqlen_q);
  const int batch = int(row / (int64_t(params.heads) * params.seqlen_q));
  const int64_t accum_row = (int64_t(batch) * params.heads + head) * params.seqlen_q + query;
  const float4* src = reinterpret_cast<const float4*>(params.dq_accum + accum_row * kHeadDim + col);
  const int* counts = dq_block_counts(params);
  const bool written = counts == nullptr || counts[dq_block_index(params, batch, head, query)] != 0;
  const float4 zeros = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 lo = written ? src[0] : zeros, hi = written ? src[1] : zeros;
  cutlass::Array<float, 8> values;
  values[0] = lo.x, values[1] = lo.y, values[2] = lo.z, values[3] = lo.w;
  values[4] = hi.x, values[5] = hi.y, values[6] = hi.z, values[7] = hi.w;
  CUTE_UNROLL
  for (int i = 0; i < 8; ++i) values[i] *= params.softmax_scale;
  Element* dq = static_cast<Element*>(params.dq) + batch * params.dq_batch_stride + query * params.dq_row_stride +
                head * params.dq_head_stride + col;
  *reinterpret_cast<cutlass::Array<Element, 8>*>(dq) = cutlass::NumericArrayConverter<Element, float, 8>{}(values);
}

// The preprocess (D, dq_accum zeroed), `launch_main` (the main kernel or kernels of a path), then
// the postprocess (dQ scaled and converted): the frame of every backward path. The pre- and
// postprocess walk every query row independently; a variable-length call's packed rows (batch
// strides 0, per-query buffers (heads, total_q)) are to them one sequence of total_q rows.
template <int kHeadDim, class Element, class LaunchMain>
cudaError_t run_bwd_stages(BwdParams const& params, cudaStream_t stream, LaunchMain&& launch_main) {
  BwdParams rows = params;
  if (params.cu_seqlens_q != nullptr) {
    rows.batch = 1;
    rows.seqlen_q = static_cast<int>(params.total_q);
  }
  const int64_t row_threads = int64_t(rows.batch) * rows.heads * rows.seqlen_q * kThreadsPerRow<kHeadDim>;
  const int64_t prepost_ctas = (row_threads + kPrePostThreads - 1) / kPrePostThreads;
  cudaError_t status = launch_kernel(&flash_bwd_preprocess<kHeadDim, Element>, prepost_ctas, kPrePostThreads,
                                     0, rows, stream);
  if (status != cudaSuccess) return status;
  status = launch_main();
  if (status != cudaSuccess) return status;
  return launch_kernel(&flash_bwd_postprocess<kHeadDim, Element>, prepost_ctas, kPrePostThreads, 0, rows,
                       stream);
}

}  // namespace flash_cutlass

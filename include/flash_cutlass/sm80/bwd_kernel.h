// The sm80-path backward kernel: one CTA per (key block, head, batch) keeps its K and V tiles in
// shared memory and walks the query blocks that see them, recomputing P from Q, K and the
// forward's log-sum-exp:
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dK += dS^T Q,  dQ += dS K (fp32 atomics).
// dK and dV stay in registers for the whole walk; no score matrix ever reaches global memory.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm80/gemm.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsN_, class Element_>
struct BwdKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step of the walk
  static constexpr int kBlockN = kBlockN_;  // keys of this CTA
  // Every GEMM splits its M (query rows or keys) across 4 warps of 16 rows, and its N across
  // kWarpsN warps: 2 at head dims above 128 keep the dK and dV accumulators in registers.
  static constexpr int kWarpsM = 4;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static_assert(kBlockM == 16 * kWarpsM && kBlockN == 16 * kWarpsM);
  static_assert(kBlockN % (16 * kWarpsN) == 0 && kHeadDim % (16 * kWarpsN) == 0);

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kWarpsN>, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * kWarpsN>, cute::_16>>;

  using SmemLayoutQ = PaddedRowMajor<kBlockM, kHeadDim>;    // Q and dO
  using SmemLayoutKV = PaddedRowMajor<kBlockN, kHeadDim>;   // K and V
  using SmemLayoutP = PaddedRowMajor<kBlockM, kBlockN>;     // P and dS
  using SmemLayoutQt = decltype(cute::select<1, 0>(SmemLayoutQ{}));
  using SmemLayoutKt = decltype(cute::select<1, 0>(SmemLayoutKV{}));
  using SmemLayoutPt = decltype(cute::select<1, 0>(SmemLayoutP{}));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomP = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  static constexpr int kGmemElemsPerCopy = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = 32 / kGmemElemsPerCopy;
  static constexpr int kGmemRowsPerPass = kThreads / kGmemThreadsPerRow;
  using GmemTiledCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      cute::Layout<cute::Shape<cute::Int<kGmemRowsPerPass>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerCopy>>>{}));

  static constexpr int kSmemElemsQ = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kSmemElemsKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSmemElemsP = cute::cosize_v<SmemLayoutP>;
  static constexpr int kSmemBytes = (2 * kSmemElemsQ + 2 * kSmemElemsKV + 2 * kSmemElemsP) * int(sizeof(Element));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

template <int kHeadDim, class Element>
using BwdTraitsFor = BwdKernelTraits<kHeadDim, 64, 64, (kHeadDim > 128 ? 2 : 1), Element>;

// acc (M x N, fp32, TiledMma's C layout) -> shared memory tile of Element, for a transposed reread.
template <class Traits, class Acc, class Smem>
__device__ __forceinline__ void store_acc_to_smem(typename Traits::TiledMma const& tiled_mma, Acc const& acc,
                                                  Smem& smem, int tidx) {
  using namespace cute;
  auto smem_tiled_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomP{}, tiled_mma);
  auto smem_thr_copy = smem_tiled_copy.get_thread_slice(tidx);
  Tensor converted = convert_fragment<typename Traits::Element>(acc);
  copy(smem_tiled_copy, smem_thr_copy.retile_S(converted), smem_thr_copy.partition_D(smem));
}

// In place: S -> P = exp(scale * S - lse) and dP -> dS = P * (dP - D) (without the softmax scale),
// for one (query block, key block) tile as (rows, cols), rows starting at row_start. Rows past
// seqlen_q and rows that see no key (lse = -inf) get P = 0 through lse = +inf.
template <class TensorS, class TensorDP, class Coords>
__device__ __forceinline__ void probabilities_and_ds(TensorS& s, TensorDP& dp, Coords const& coords, int row_start,
                                                     int seqlen_q, float scale_log2, const float* lse_row,
                                                     const float* dsum_row) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = row_start + get<0>(coords(r, 0));
    float lse = row < seqlen_q ? lse_row[row] : INFINITY;
    lse = lse == -INFINITY ? INFINITY : lse;
    const float lse_log2 = lse * float(M_LOG2E);
    const float dsum = row < seqlen_q ? dsum_row[row] : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      s(r, c) = exp2f(s(r, c) * scale_log2 - lse_log2);
      dp(r, c) = s(r, c) * (dp(r, c) - dsum);
    }
  }
}

// kAccumulateDq: add dS K into dq_accum with atomics; without it (deterministic mode) dQ comes
// from flash_bwd_dq_sm80.
template <class Traits, bool kCausal, bool kAccumulateDq>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_sm80(__grid_constant__ const BwdParams params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  const int num_n_blocks = (params.seqlen_k + kBlockN - 1) / kBlockN;
  const int n_block = int(blockIdx.x % num_n_blocks);
  const int batch_head = int(blockIdx.x / num_n_blocks);
  const int head = batch_head % params.heads;
  const int batch = batch_head / params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const int tidx = threadIdx.x;
  const KeyMask<kCausal> mask{params.seqlen_q, params.seqlen_k};
  const int key_start = n_block * kBlockN;
  const int rows_left_k = params.seqlen_k - key_start;
  // Query rows that see any key of this block: with the bottom-right causal diagonal, row i sees
  // key j iff j <= i + seqlen_k - seqlen_q, so the first row is key_start - (seqlen_k - seqlen_q).
  const int first_row = kCausal ? max(0, key_start - (params.seqlen_k - params.seqlen_q)) : 0;
  const int m_block_begin = first_row / kBlockM;
  const int m_block_end = (params.seqlen_q + kBlockM - 1) / kBlockM;

  auto gmem_matrix = [](auto const* base, int64_t batch_offset, int64_t head_offset, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(base) + batch_offset + head_offset),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  Tensor mQ = gmem_matrix(params.q, batch * params.q_batch_stride, head * params.q_head_stride, params.seqlen_q,
                          params.q_row_stride);
  Tensor mdO = gmem_matrix(params.dout, batch * params.dout_batch_stride, head * params.dout_head_stride,
                           params.seqlen_q, params.dout_row_stride);
  Tensor mK = gmem_matrix(params.k, batch * params.k_batch_stride, head_k * params.k_head_stride, params.seqlen_k,
                          params.k_row_stride);
  Tensor mV = gmem_matrix(params.v, batch * params.v_batch_stride, head_k * params.v_head_stride, params.seqlen_k,
                          params.v_row_stride);
  Tensor gQ = local_tile(mQ, TileQ{}, make_coord(_, 0));  // (kBlockM, kHeadDim, m_blocks)
  Tensor gdO = local_tile(mdO, TileQ{}, make_coord(_, 0));
  Tensor gK = local_tile(mK, TileKV{}, make_coord(n_block, 0));
  Tensor gV = local_tile(mV, TileKV{}, make_coord(n_block, 0));
  const int64_t row_offset = (int64_t(batch) * params.heads + head) * params.seqlen_q;
  const float* lse_row = params.lse + row_offset;
  const float* dsum_row = params.dsoftmax_sum + row_offset;
  float* dq_accum = params.dq_accum + row_offset * kHeadDim;

  extern __shared__ __align__(128) char smem[];
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + Traits::kSmemElemsQ;
  Element* smem_k = smem_do + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Element* smem_p = smem_v + Traits::kSmemElemsKV;
  Element* smem_ds = smem_p + Traits::kSmemElemsP;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPt{});

  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(TileKV{}));
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tQcQ(0, 0, k)) < params.head_dim;

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  // S = Q K^T and dP = dO V^T: M = query rows.
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  // dV = P^T dO and dK = dS^T Q: M = keys.
  Tensor tdVrPt = thr_mma.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_mma.partition_fragment_B(sdOt);
  Tensor tdKrdSt = thr_mma.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_mma.partition_fragment_B(sQt);
  // dQ = dS K: M = query rows, N = head dim.
  Tensor tdQrdS = thr_mma.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma.partition_fragment_B(sKt);

  auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_a_t = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_b_t = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_copy_a = copy_a.get_thread_slice(tidx);
  auto thr_copy_a_t = copy_a_t.get_thread_slice(tidx);
  auto thr_copy_b = copy_b.get_thread_slice(tidx);
  auto thr_copy_b_t = copy_b_t.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_a.partition_S(sQ);
  Tensor tSsK = thr_copy_b.partition_S(sK);
  Tensor tdPsdO = thr_copy_a.partition_S(sdO);
  Tensor tdPsV = thr_copy_b.partition_S(sV);
  Tensor tdVsPt = thr_copy_a_t.partition_S(sPt);
  Tensor tdVsdOt = thr_copy_b_t.partition_S(sdOt);
  Tensor tdKsdSt = thr_copy_a_t.partition_S(sdSt);
  Tensor tdKsQt = thr_copy_b_t.partition_S(sQt);
  Tensor tdQsdS = thr_copy_a.partition_S(sdS);
  Tensor tdQsKt = thr_copy_b_t.partition_S(sKt);

  Tensor acc_dk = partition_fragment_C(tiled_mma, TileKV{});
  Tensor acc_dv = partition_fragment_C(tiled_mma, TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor tScS = as_rows_cols(thr_mma.partition_C(make_identity_tensor(TileS{})));
  Tensor tdQcdQ = thr_mma.partition_C(make_identity_tensor(TileQ{}));
  const float scale_log2 = params.softmax_scale_log2;

  // K and V once, rows past seqlen_k zero-filled (0 * NaN must not reach dQ).
  copy_tile_async<true>(gmem_tiled_copy, tKgK, tKsK, tKVcKV, col_ok, rows_left_k);
  copy_tile_async<true>(gmem_tiled_copy, tVgV, tVsV, tKVcKV, col_ok, rows_left_k);
  cp_async_fence();

  for (int m_block = m_block_begin; m_block < m_block_end; ++m_block) {
    const int row_start = m_block * kBlockM;
    const int rows_left_q = params.seqlen_q - row_start;
    // Q and dO of this block; the previous step's reads of them and of P/dS are done.
    __syncthreads();
    copy_tile_async<true>(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ, tQcQ, col_ok, rows_left_q);
    copy_tile_async<true>(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO, tQcQ, col_ok, rows_left_q);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();

    // P = exp(scale * S - lse), from the forward's log-sum-exp. Rows past seqlen_q and rows that
    // see no key (lse = -inf) get P = 0 through lse = +inf.
    Tensor acc_s = partition_fragment_C(tiled_mma, TileS{});
    clear(acc_s);
    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_a, thr_copy_a, copy_b, thr_copy_b);
    Tensor s = as_rows_cols(acc_s);
    mask.apply(s, tScS, row_start, key_start);
    Tensor acc_dp = partition_fragment_C(tiled_mma, TileS{});
    clear(acc_dp);
    gemm_smem_smem(tiled_mma, acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, copy_a, thr_copy_a, copy_b, thr_copy_b);
    Tensor dp = as_rows_cols(acc_dp);
    probabilities_and_ds(s, dp, tScS, row_start, params.seqlen_q, scale_log2, lse_row, dsum_row);
    store_acc_to_smem<Traits>(tiled_mma, acc_s, sP, tidx);
    store_acc_to_smem<Traits>(tiled_mma, acc_dp, sdS, tidx);
    __syncthreads();

    gemm_smem_smem(tiled_mma, acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, copy_a_t, thr_copy_a_t, copy_b_t,
                   thr_copy_b_t);
    gemm_smem_smem(tiled_mma, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, copy_a_t, thr_copy_a_t, copy_b_t,
                   thr_copy_b_t);
    if constexpr (kAccumulateDq) {
      Tensor acc_dq = partition_fragment_C(tiled_mma, TileQ{});
      clear(acc_dq);
      gemm_smem_smem(tiled_mma, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_a, thr_copy_a, copy_b_t, thr_copy_b_t);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) {
        const int row = get<0>(tdQcdQ(i));
        if (row < rows_left_q) {
          atomicAdd(dq_accum + int64_t(row_start + row) * kHeadDim + get<1>(tdQcdQ(i)), acc_dq(i));
        }
      }
    }
  }

  // dK and dV of this key block for this query head, fp32, unscaled (the caller multiplies dK and
  // dQ by the softmax scale and sums over the heads of a GQA group).
  Tensor tKVc = thr_mma.partition_C(make_identity_tensor(TileKV{}));
  const int64_t kv_row_stride = int64_t(params.heads) * kHeadDim;
  float* dk = params.dk_accum + (int64_t(batch) * params.seqlen_k + key_start) * kv_row_stride + int64_t(head) * kHeadDim;
  float* dv = params.dv_accum + (int64_t(batch) * params.seqlen_k + key_start) * kv_row_stride + int64_t(head) * kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) {
    const int row = get<0>(tKVc(i));
    if (row < rows_left_k) {
      dk[int64_t(row) * kv_row_stride + get<1>(tKVc(i))] = acc_dk(i);
      dv[int64_t(row) * kv_row_stride + get<1>(tKVc(i))] = acc_dv(i);
    }
  }
}

// Deterministic dQ: one CTA per (query block, head, batch) keeps Q and dO in shared memory, walks
// the key blocks it sees in a fixed order and accumulates dQ = dS K in registers, then stores it
// (fp32, unscaled) into dq_accum without atomics.
template <class Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_dq_sm80(__grid_constant__ const BwdParams params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
  const int m_block = int(blockIdx.x % num_m_blocks);
  const int batch_head = int(blockIdx.x / num_m_blocks);
  const int head = batch_head % params.heads;
  const int batch = batch_head / params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const int tidx = threadIdx.x;
  const KeyMask<kCausal> mask{params.seqlen_q, params.seqlen_k};
  const int row_start = m_block * kBlockM;
  const int rows_left_q = params.seqlen_q - row_start;
  const KeyBlockRange key_blocks = key_block_range<kBlockM, kBlockN>(mask, m_block);

  auto gmem_matrix = [](auto const* base, int64_t batch_offset, int64_t head_offset, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(base) + batch_offset + head_offset),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  Tensor gQ = local_tile(gmem_matrix(params.q, batch * params.q_batch_stride, head * params.q_head_stride,
                                     params.seqlen_q, params.q_row_stride),
                         TileQ{}, make_coord(m_block, 0));
  Tensor gdO = local_tile(gmem_matrix(params.dout, batch * params.dout_batch_stride, head * params.dout_head_stride,
                                      params.seqlen_q, params.dout_row_stride),
                          TileQ{}, make_coord(m_block, 0));
  Tensor gK = local_tile(gmem_matrix(params.k, batch * params.k_batch_stride, head_k * params.k_head_stride,
                                     params.seqlen_k, params.k_row_stride),
                         TileKV{}, make_coord(_, 0));
  Tensor gV = local_tile(gmem_matrix(params.v, batch * params.v_batch_stride, head_k * params.v_head_stride,
                                     params.seqlen_k, params.v_row_stride),
                         TileKV{}, make_coord(_, 0));
  const int64_t row_offset = (int64_t(batch) * params.heads + head) * params.seqlen_q;

  extern __shared__ __align__(128) char smem[];
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + Traits::kSmemElemsQ;
  Element* smem_k = smem_do + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Element* smem_ds = smem_v + Traits::kSmemElemsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});

  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(TileKV{}));
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tQcQ(0, 0, k)) < params.head_dim;

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdQrdS = thr_mma.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma.partition_fragment_B(sKt);
  auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_b_t = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_copy_a = copy_a.get_thread_slice(tidx);
  auto thr_copy_b = copy_b.get_thread_slice(tidx);
  auto thr_copy_b_t = copy_b_t.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_a.partition_S(sQ);
  Tensor tSsK = thr_copy_b.partition_S(sK);
  Tensor tdPsdO = thr_copy_a.partition_S(sdO);
  Tensor tdPsV = thr_copy_b.partition_S(sV);
  Tensor tdQsdS = thr_copy_a.partition_S(sdS);
  Tensor tdQsKt = thr_copy_b_t.partition_S(sKt);
  Tensor tScS = as_rows_cols(thr_mma.partition_C(make_identity_tensor(TileS{})));
  Tensor acc_dq = partition_fragment_C(tiled_mma, TileQ{});
  clear(acc_dq);

  copy_tile_async<true>(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left_q);
  copy_tile_async<true>(gmem_tiled_copy, tdOgdO, tdOsdO, tQcQ, col_ok, rows_left_q);
  cp_async_fence();
  for (int n_block = 0; n_block < key_blocks.end; ++n_block) {
    // K and V of this block; the previous step's reads of them and of dS are done.
    __syncthreads();
    const int rows_left_k = params.seqlen_k - n_block * kBlockN;
    copy_tile_async<true>(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV, col_ok, rows_left_k);
    copy_tile_async<true>(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV, col_ok, rows_left_k);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(tiled_mma, TileS{});
    clear(acc_s);
    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_a, thr_copy_a, copy_b, thr_copy_b);
    Tensor s = as_rows_cols(acc_s);
    mask.apply(s, tScS, row_start, n_block * kBlockN);
    Tensor acc_dp = partition_fragment_C(tiled_mma, TileS{});
    clear(acc_dp);
    gemm_smem_smem(tiled_mma, acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, copy_a, thr_copy_a, copy_b, thr_copy_b);
    Tensor dp = as_rows_cols(acc_dp);
    probabilities_and_ds(s, dp, tScS, row_start, params.seqlen_q, params.softmax_scale_log2,
                         params.lse + row_offset, params.dsoftmax_sum + row_offset);
    store_acc_to_smem<Traits>(tiled_mma, acc_dp, sdS, tidx);
    __syncthreads();
    gemm_smem_smem(tiled_mma, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_a, thr_copy_a, copy_b_t, thr_copy_b_t);
  }

  Tensor tdQcdQ = thr_mma.partition_C(make_identity_tensor(TileQ{}));
  float* dq_accum = params.dq_accum + (row_offset + row_start) * kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) {
    const int row = get<0>(tdQcdQ(i));
    if (row < rows_left_q) dq_accum[int64_t(row) * kHeadDim + get<1>(tdQcdQ(i))] = acc_dq(i);
  }
}

}  // namespace flash_cutlass::sm80

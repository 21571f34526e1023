// The sm80-path KV-cache kernels (flash_cutlass.flash_attention_with_kvcache), for Ampere and
// Hopper alike: decoding and chunked prefill over a contiguous or paged cache.
//
// Decoding is memory-bound: each key and value byte is read once and meets only the few query rows
// of its kv head. So a CTA takes kRows = 16 packed query rows, the query heads of one kv head
// (GQA) times the queries (packed_row in common/kvcache.h), one MMA tile high, and its warps (4; 2
// in the compact kernel at head dims 192/256) split the keys: each warp streams its own 16-key
// chunks (chunk c goes to warp c % warps) through its own kStages-deep cp.async pipeline, gathering each key row from its page (any page size, pages in any
// order), and keeps its own online softmax and O. On Hopper (flash_kvcache_tma_sm90) a chunk's K
// and V land instead by one TMA tensor copy each into 128-byte-swizzled stages, where the call
// allows it (kvcache_launch.h): cp.async into padded rows asks L2 for 1.5x the bytes (and the L2's
// throughput bounds decoding). The warps' results merge once, at the end,
// through shared memory; the warps never wait for each other in the main loop. The score options
// (soft cap, ALiBi) and the mask (none, causal, window: KeyMask<kLocal>) are runtime values and
// every tile is masked: their few instructions a tile hide under the loads, and one instantiation
// per (head dim, dtype) serves every call.
//
// Split-KV: num_splits CTAs share the key chunks of one (row block, batch, kv head) and write fp32
// partial outputs with their log-sum-exps; flash_kvcache_combine_sm80 merges them.
#pragma once

#include <cmath>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_cutlass/common/copy.h"
#include "flash_cutlass/common/grid_dependency.h"
#include "flash_cutlass/common/kvcache.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm80/gemm.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// A warp's stage of K (or V), (keys, head_dim), and the same storage as V^T: rows padded by 16
// bytes (cp.async), or 128-byte-swizzled rows (TMA).
template <bool kTma, int kKeys, int kHeadDim, class Element>
struct KVStageLayouts {
  using KV = PaddedRowMajor<kKeys, kHeadDim>;
  using Vt = decltype(cute::select<1, 0>(KV{}));
};
template <int kKeys, int kHeadDim, class Element>
struct KVStageLayouts<true, kKeys, kHeadDim, Element> {
  using KV = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                          cute::Shape<cute::Int<kKeys>, cute::Int<kHeadDim>>{}));
  using Vt = decltype(cute::composition(
      KV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kKeys>>{}, cute::GenRowMajor{})));
};

// kTma_ (Hopper, head dims in 64s, a chunk's rows in one page): K and V land by TMA tensor copies
// into 128-byte-swizzled stages, one mbarrier a stage and warp; otherwise by cp.async into padded
// rows. kWarps_ warps, each walking its own chunks with its own stages.
template <int kHeadDim_, int kStages_, class Element_, bool kTma_ = false, int kWarps_ = 4>
struct KVCacheTraits {
  using Element = Element_;
  static constexpr bool kTma = kTma_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;
  static constexpr int kRows = kKVCacheTileRows;  // packed query rows of a CTA
  static constexpr int kKeys = 16;  // keys of one warp's chunk
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // The in-tile append's pieces (16 bytes of a new K or V row) a thread holds: the threads together
  // hold kKVCacheTileAppendElems of K and as many of V.
  static constexpr int kAppendPieces = kKVCacheTileAppendElems * 2 / 8 / kThreads;
  static_assert(kAppendPieces * kThreads * 8 == 2 * kKVCacheTileAppendElems);
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256);
  static_assert(kStages >= 2);
  static_assert(kRows == 16, "one MMA tile high");

  using TileQ = cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>;
  using TileS = cute::Shape<cute::Int<kRows>, cute::Int<kKeys>>;
  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // One warp computes a whole 16 x 16 score tile (two n8 atoms: B operands load with ldmatrix.x4).
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                  cute::Tile<cute::_16, cute::_16, cute::_16>>;

  using SmemLayoutQ = PaddedRowMajor<kRows, kHeadDim>;
  static_assert(!kTma || kHeadDim % 64 == 0, "TMA stages are rows of 128-byte swizzle atoms");
  // One stage of one warp's K (or V), and the same storage seen as V^T (head_dim, keys): the B
  // operand of P V; register fragments are shaped from the layouts without their swizzle.
  using SmemLayoutKV = typename KVStageLayouts<kTma, kKeys, kHeadDim, Element>::KV;
  using SmemLayoutVt = typename KVStageLayouts<kTma, kKeys, kHeadDim, Element>::Vt;
  using FragmentLayoutK = decltype(cute::get_nonswizzle_portion(SmemLayoutKV{}));
  using FragmentLayoutVt = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  // A warp's global -> shared copies of one chunk: 8 lanes cover 64 columns (one 128-byte line)
  // of a row and repeat across the head dim, so 4 rows go per pass and a lane copies 4 rows.
  static constexpr int kElemsPerCopy = 8;
  static constexpr int kLanesPerRow = kHeadDim % 64 == 0 ? 8 : 4;
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = kKeys / kRowsPerPass;
  static constexpr int kColPasses = kHeadDim / (kLanesPerRow * kElemsPerCopy);
  static_assert(kHeadDim % (kLanesPerRow * kElemsPerCopy) == 0);

  static constexpr int kSmemElemsQ = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kSmemElemsKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSmemElemsWarp = 2 * kStages * kSmemElemsKV;  // kStages of K, then kStages of V
  // TMA: the warps' K/V storage first (1024-byte-aligned swizzle atoms), then Q, then each warp's
  // stage barriers. cp.async: Q, then the warps' K/V storage.
  static constexpr int kBarrierBytes = kTma ? kWarps * kStages * 8 : 0;
  static constexpr int kSmemBytes = (kSmemElemsQ + kWarps * kSmemElemsWarp) * int(sizeof(Element)) + kBarrierBytes;
  static_assert(!kTma || kSmemElemsWarp * sizeof(Element) % 1024 == 0);
  static_assert(!kTma || kSmemElemsQ * sizeof(Element) % 8 == 0);
  // Each TMA copy: kKeys rows of the head dim (of K or of V).
  using TileKV = cute::Shape<cute::Int<kKeys>, cute::Int<kHeadDim>>;
  static constexpr uint32_t kTmaBytes = 2 * kKeys * kHeadDim * sizeof(Element);  // K and V of a chunk
  // The caches as TMA sees them: (page_size, head_dim, heads_k, num_pages), head_dim contiguous (a
  // contiguous cache's page is one of its rows; KVCacheParams).
  using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                  cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                GmemLayout{}));
  // The merge reuses each warp's own K/V storage for its fp32 output and row statistics (16-byte
  // aligned). The outputs' rows are padded by 16 bytes: a warp's float2 stores of an accumulator (8
  // rows, 4 lanes a row) then hit each bank twice, the fewest for 256 bytes, where rows of kHeadDim
  // floats (a multiple of 32) put all 8 rows on the same 8 banks.
  static constexpr int kMergeRowFloats = kHeadDim + 4;
  static_assert((kRows * kMergeRowFloats + 2 * kRows) * 4 <= kSmemElemsWarp * int(sizeof(Element)));
  static_assert(kMergeRowFloats * 4 % 16 == 0 && kSmemElemsWarp * sizeof(Element) % 16 == 0 &&
                kSmemElemsQ * sizeof(Element) % 16 == 0);
  static_assert(kSmemBytes <= 227 * 1024);
};

// The TMA copy of K (or V) a KVCacheTraits with kTma loads its stages with.
template <class Traits>
using KVCacheTmaCopy = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, typename Traits::GmemTensor{},
                                                    typename Traits::SmemLayoutKV{}, typename Traits::TileKV{},
                                                    cute::_1{}));

// Pipeline depth per head dim: a warp keeps kStages - 1 chunks of K and V in flight, so that an SM
// has enough bytes in flight to cover the memory latency (Little's law: ~40 KB per SM at 4.8 TB/s;
// two CTAs share a Hopper SM up to head dim 192). At head dim 128 one chunk a warp (32 KiB a CTA)
// is enough: a third stage measured up to 2% slower on the H200 (7% at batch 1 / 8k).
// kCompactStages and kCompactWarps: the compact kernel, for the devices whose per-block shared
// memory the usual one (kStages, 4 warps) exceeds (sm86, sm89 and sm120 allow 99 KiB a block; sm80
// 163 KiB, sm90 227 KiB): the deepest pipeline within kKVCacheCompactSmemBytes, with 2 warps at head
// dims 192 and 256, which exceed 99 KiB with 4 even at 2 stages. The host picks it from the device's
// limit; where it equals the usual one, one kernel serves every device.
constexpr int kKVCacheCompactSmemBytes = 99 * 1024;
template <int kHeadDim>
struct KVCacheStages;
template <> struct KVCacheStages<32>  { static constexpr int kStages = 8, kCompactStages = 8, kCompactWarps = 4; };
template <> struct KVCacheStages<64>  { static constexpr int kStages = 6, kCompactStages = 5, kCompactWarps = 4; };
template <> struct KVCacheStages<96>  { static constexpr int kStages = 4, kCompactStages = 3, kCompactWarps = 4; };
template <> struct KVCacheStages<128> { static constexpr int kStages = 2, kCompactStages = 2, kCompactWarps = 4; };
template <> struct KVCacheStages<192> { static constexpr int kStages = 2, kCompactStages = 3, kCompactWarps = 2; };
template <> struct KVCacheStages<256> { static constexpr int kStages = 2, kCompactStages = 2, kCompactWarps = 2; };

template <int kHeadDim, class Element>
using KVCacheTraitsFor = KVCacheTraits<kHeadDim, KVCacheStages<kHeadDim>::kStages, Element>;
template <int kHeadDim, class Element>
using KVCacheCompactTraitsFor = KVCacheTraits<kHeadDim, KVCacheStages<kHeadDim>::kCompactStages, Element, false,
                                              KVCacheStages<kHeadDim>::kCompactWarps>;
static_assert(KVCacheCompactTraitsFor<64, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes &&
              KVCacheCompactTraitsFor<96, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes &&
              KVCacheCompactTraitsFor<128, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes &&
              KVCacheCompactTraitsFor<192, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes &&
              KVCacheCompactTraitsFor<256, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes &&
              KVCacheTraitsFor<32, cutlass::half_t>::kSmemBytes <= kKVCacheCompactSmemBytes);
static_assert(KVCacheTraits<64, KVCacheStages<64>::kCompactStages + 1, cutlass::half_t>::kSmemBytes >
                  kKVCacheCompactSmemBytes &&
              KVCacheTraits<96, KVCacheStages<96>::kCompactStages + 1, cutlass::half_t>::kSmemBytes >
                  kKVCacheCompactSmemBytes &&
              KVCacheTraits<128, KVCacheStages<128>::kCompactStages + 1, cutlass::half_t>::kSmemBytes >
                  kKVCacheCompactSmemBytes &&
              KVCacheTraits<192, KVCacheStages<192>::kCompactStages + 1, cutlass::half_t, false,
                            KVCacheStages<192>::kCompactWarps>::kSmemBytes > kKVCacheCompactSmemBytes &&
              KVCacheTraits<256, KVCacheStages<256>::kCompactStages + 1, cutlass::half_t, false,
                            KVCacheStages<256>::kCompactWarps>::kSmemBytes >
                  kKVCacheCompactSmemBytes,
              "kCompactStages is the deepest pipeline that fits");

// One CTA: packed rows [m_block * kRows, + kRows) of (batch, kv_head), over split `split` of their keys.
// With Traits::kTma, tma_k and tma_v are the caches' TMA copies (KVCacheTmaCopy; kChunkInOnePage).
template <class Traits, bool kChunkInOnePage, class TmaCopy = int>
__device__ __forceinline__ void kvcache_tile(KVCacheParams const& params, char* smem, int m_block, int batch,
                                             int kv_head, int split, TmaCopy const* tma_k = nullptr,
                                             TmaCopy const* tma_v = nullptr) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kRows;
  constexpr int kKeys = Traits::kKeys;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kWarps = Traits::kWarps;
  constexpr int kStages = Traits::kStages;

  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  const int warp = tidx / 32;
  const int group = params.heads / params.heads_k;
  const int packed_rows = params.seqlen_q * group;
  const int first_row = m_block * kRows;
  // With params.append_in_tile, this thread's pieces of the new rows (16 bytes of K or V each, K's
  // row before V's), loaded before the lengths arrive: their addresses do not depend on them.
  const int row_pieces = params.head_dim / 8;
  const int append_pieces = params.append_in_tile ? params.seqlen_new * 2 * row_pieces : 0;
  struct AppendPiece {
    int token;
    bool is_v;
    int col;
  };
  auto append_piece = [&](int i) {
    const int piece = tidx + i * Traits::kThreads;
    const int token = piece / (2 * row_pieces);
    const int in_token = piece - token * 2 * row_pieces;
    const bool is_v = in_token >= row_pieces;
    return AppendPiece{token, is_v, (in_token - (is_v ? row_pieces : 0)) * 8};
  };
  cutlass::uint128_t appended[Traits::kAppendPieces];
  CUTE_UNROLL
  for (int i = 0; i < Traits::kAppendPieces; ++i) {
    if (tidx + i * Traits::kThreads < append_pieces) {
      const AppendPiece piece = append_piece(i);
      const Element* src = new_token_row<Element>(params, piece.is_v, batch, piece.token, kv_head);
      appended[i] = *reinterpret_cast<const cutlass::uint128_t*>(src + piece.col);
    }
  }
  const CachedSequence sequence = cached_sequence(params, batch);
  const SequencePages pages = sequence_pages(params, batch);
  const KeyMask<MaskKind::kLocal> mask = key_mask_of<MaskKind::kLocal>(params, params.seqlen_q, sequence.length);

  // The key chunks any row of this tile sees, and this split's consecutive share of them.
  const int first_query = first_row / group;
  const int last_query = (min(first_row + kRows, packed_rows) - 1) / group;
  const int keys_begin = mask.key_begin(first_query);
  const int keys_end = max(keys_begin, mask.key_limit(last_query));
  const int chunks_begin = keys_begin / kKeys;
  const int chunks = keys_end > keys_begin ? (keys_end + kKeys - 1) / kKeys - chunks_begin : 0;
  const int chunks_per_split = (chunks + params.num_splits - 1) / params.num_splits;
  const int split_begin = chunks_begin + split * chunks_per_split;
  const int split_end = min(chunks_begin + chunks, split_begin + chunks_per_split);
  // This warp's chunks: split_begin + warp, + kWarps, ...
  const int warp_chunks = split_end - split_begin > warp ? (split_end - split_begin - warp + kWarps - 1) / kWarps : 0;

  constexpr bool kTma = Traits::kTma;
  static_assert(!kTma || kChunkInOnePage, "a TMA copy takes a chunk's rows from one page");
  // The new rows in this split's chunks go into the cache before any copy reads them (the same
  // bytes from every CTA of this (batch, kv head) whose range holds them); TMA reads through the
  // async proxy, hence the proxy fence before the barrier.
  if (params.append_in_tile) {
    const int range_begin = split_begin * kKeys;
    const int range_end = split_end * kKeys;
    CUTE_UNROLL
    for (int i = 0; i < Traits::kAppendPieces; ++i) {
      const AppendPiece piece = append_piece(i);
      const int position = sequence.start + piece.token;
      if (tidx + i * Traits::kThreads < append_pieces && position >= range_begin && position < range_end) {
        int row_in_page;
        const int page = pages.page_of(position, row_in_page);
        Element* dst = cache_row<Element>(params, pages, piece.is_v, page, row_in_page, kv_head);
        *reinterpret_cast<cutlass::uint128_t*>(dst + piece.col) = appended[i];
      }
    }
    if constexpr (kTma) asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncthreads();
  }
  Element* smem_kv = reinterpret_cast<Element*>(smem) + (kTma ? 0 : Traits::kSmemElemsQ);
  Element* smem_q = reinterpret_cast<Element*>(smem) + (kTma ? kWarps * Traits::kSmemElemsWarp : 0);
  Element* smem_k = smem_kv + warp * Traits::kSmemElemsWarp;
  Element* smem_v = smem_k + kStages * Traits::kSmemElemsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  auto k_stage = [&](int stage) { return make_tensor(make_smem_ptr(smem_k + stage * Traits::kSmemElemsKV),
                                                     typename Traits::SmemLayoutKV{}); };
  auto v_stage = [&](int stage) { return make_tensor(make_smem_ptr(smem_v + stage * Traits::kSmemElemsKV),
                                                     typename Traits::SmemLayoutKV{}); };
  auto vt_stage = [&](int stage) { return make_tensor(make_smem_ptr(smem_v + stage * Traits::kSmemElemsKV),
                                                      typename Traits::SmemLayoutVt{}); };

  // This lane's rows of a chunk (kPasses of them, kRowsPerPass apart) and first column. A lane whose
  // column of a pass lies past head_dim (a padded head dim) reads its first column instead, with
  // zero bytes copied: every source address lies in the cache.
  const int copy_row = lane / Traits::kLanesPerRow;
  const int copy_col = (lane % Traits::kLanesPerRow) * Traits::kElemsPerCopy;
  bool col_ok[Traits::kColPasses];
  int col_src[Traits::kColPasses];  // from the lane's first column
  CUTE_UNROLL
  for (int c = 0; c < Traits::kColPasses; ++c) {
    col_ok[c] = copy_col + c * Traits::kLanesPerRow * 8 < params.head_dim;
    col_src[c] = col_ok[c] ? c * Traits::kLanesPerRow * 8 : 0;
  }
  const Element* k_cache = static_cast<const Element*>(params.k);
  const Element* v_cache = static_cast<const Element*>(params.v);
  const int64_t k_head_offset = int64_t(kv_head) * params.k_head_stride + copy_col;
  const int64_t v_head_offset = int64_t(kv_head) * params.v_head_stride + copy_col;

  // Where this lane's rows of the warp's chunk `t` live: looked up one chunk ahead of its copy, so
  // that the block table's latency hides behind the copies in flight. With kChunkInOnePage (pages
  // of a multiple of kKeys rows, or a contiguous cache of a multiple of kKeys positions) a chunk's
  // rows lie in one page, rows past the sequence included: one lookup a chunk, and the lane's rows
  // kRowsPerPass rows apart from its first. Otherwise each row is looked up, and rows past the
  // sequence read the page's first row (zero bytes copied): every source address lies in the cache.
  struct ChunkRows {
    int page[kChunkInOnePage ? 1 : Traits::kPasses];
    int row_in_page[kChunkInOnePage ? 1 : Traits::kPasses];
    bool valid[Traits::kPasses];
  };
  auto locate = [&](int t) __attribute__((always_inline)) {
    ChunkRows rows;
    const int key0 = (split_begin + warp + t * kWarps) * kKeys;
    if constexpr (kChunkInOnePage) {
      rows.row_in_page[0] = 0;
      rows.page[0] = t < warp_chunks ? pages.page_of(key0, rows.row_in_page[0]) : 0;
      rows.row_in_page[0] += copy_row;
      CUTE_UNROLL
      for (int p = 0; p < Traits::kPasses; ++p) {
        rows.valid[p] = t < warp_chunks && key0 + copy_row + p * Traits::kRowsPerPass < sequence.length;
      }
    } else {
      CUTE_UNROLL
      for (int p = 0; p < Traits::kPasses; ++p) {
        const int position = key0 + copy_row + p * Traits::kRowsPerPass;
        rows.valid[p] = t < warp_chunks && position < sequence.length;
        rows.page[p] = rows.valid[p] ? pages.page_of(position, rows.row_in_page[p]) : 0;
        if (!rows.valid[p]) rows.row_in_page[p] = 0;
      }
    }
    return rows;
  };
  // kRowsPerPass rows of K and of V, in bytes: the step between a lane's rows of one page.
  const int64_t k_pass_bytes = params.k_row_stride * int64_t(Traits::kRowsPerPass * sizeof(Element));
  const int64_t v_pass_bytes = params.v_row_stride * int64_t(Traits::kRowsPerPass * sizeof(Element));
  // Copies chunk `t` (rows located by `rows`) into stage t % kStages; rows past the sequence are
  // zero-filled (a V row of NaN garbage would leak into O through 0 * NaN).
  // TMA: one mbarrier a stage of this warp, completed by the stage's K and V bytes.
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem_q + Traits::kSmemElemsQ) + warp * kStages;
  if constexpr (kTma) {
    if (lane == 0) {
      CUTE_UNROLL
      for (int stage = 0; stage < kStages; ++stage) cutlass::arch::ClusterTransactionBarrier::init(&stage_full[stage], 1);
    }
    cutlass::arch::fence_barrier_init();
    __syncwarp();
  }
  auto copy_chunk = [&](int t, ChunkRows const& rows) __attribute__((always_inline)) {
    const int stage = t % kStages;
    Tensor sK = k_stage(stage);
    Tensor sV = v_stage(stage);
    if constexpr (kTma) {
      // Lane 0's first row is the chunk's first (copy_row 0): its page and row in the page.
      if (lane == 0) {
        Tensor mK = tma_k->get_tma_tensor(make_shape(params.page_size, params.head_dim, params.heads_k, params.num_pages));
        Tensor mV = tma_v->get_tma_tensor(make_shape(params.page_size, params.head_dim, params.heads_k, params.num_pages));
        const auto tile = make_coord(rows.row_in_page[0] / kKeys, _0{});
        Tensor gK = local_tile(mK(_, _, kv_head, rows.page[0]), typename Traits::TileKV{}, tile);
        Tensor gV = local_tile(mV(_, _, kv_head, rows.page[0]), typename Traits::TileKV{}, tile);
        auto [tKgK, tKsK] = tma_partition(*tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVgV, tVsV] = tma_partition(*tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&stage_full[stage], Traits::kTmaBytes);
        copy(tma_k->with(stage_full[stage]), tKgK, tKsK);
        copy(tma_v->with(stage_full[stage]), tVgV, tVsV);
      }
      return;
    }
    const Element* k_row = nullptr;
    const Element* v_row = nullptr;
    CUTE_UNROLL
    for (int p = 0; p < Traits::kPasses; ++p) {
      const int row = copy_row + p * Traits::kRowsPerPass;
      if (!kChunkInOnePage || p == 0) {
        const int i = kChunkInOnePage ? 0 : p;
        k_row = k_cache + pages.offset_of(rows.page[i], rows.row_in_page[i], params.k_batch_stride,
                                          params.k_row_stride, k_head_offset);
        v_row = v_cache + pages.offset_of(rows.page[i], rows.row_in_page[i], params.v_batch_stride,
                                          params.v_row_stride, v_head_offset);
      } else {
        k_row = reinterpret_cast<const Element*>(reinterpret_cast<const char*>(k_row) + k_pass_bytes);
        v_row = reinterpret_cast<const Element*>(reinterpret_cast<const char*>(v_row) + v_pass_bytes);
      }
      CUTE_UNROLL
      for (int c = 0; c < Traits::kColPasses; ++c) {
        const int col = c * Traits::kLanesPerRow * Traits::kElemsPerCopy;
        const bool valid = rows.valid[p] && col_ok[c];
        cp_async_16(&sK(row, copy_col + col), k_row + col_src[c], valid);
        cp_async_16(&sV(row, copy_col + col), v_row + col_src[c], valid);
      }
    }
  };

  // Prologue: chunks 0 .. kStages - 2, one cp.async group each (empty past the warp's chunks, so
  // that the group count stays uniform), with the next chunk's rows located.
  ChunkRows next_rows = locate(0);
  // Under the call's own append (params.after_own_append) the kernel has not yet waited for it:
  // the lengths, the split's range and the first lookups above read nothing it writes; the rotated
  // queries and the cache's new rows below are its writes.
  if (params.after_own_append) wait_for_previous_grid();
  // Q: each packed row from its own query and head; rows past the last and columns past head_dim
  // are zero-filled.
  {
    constexpr int kChunksPerRow = kHeadDim / Traits::kElemsPerCopy;
    const Element* q = static_cast<const Element*>(params.q);
    CUTE_UNROLL
    for (int index = tidx; index < kRows * kChunksPerRow; index += Traits::kThreads) {
      const int row = index / kChunksPerRow;
      const int col = (index % kChunksPerRow) * Traits::kElemsPerCopy;
      const bool valid = first_row + row < packed_rows && col < params.head_dim;
      const PackedRow packed = packed_row(valid ? first_row + row : 0, group, kv_head);
      const Element* src = q + int64_t(batch) * params.q_batch_stride + int64_t(packed.query) * params.q_row_stride +
                           int64_t(packed.head) * params.q_head_stride + (valid ? col : 0);
      cp_async_16(&sQ(row, col), src, valid);
    }
    cp_async_fence();
  }
  CUTE_UNROLL
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < warp_chunks) copy_chunk(t, next_rows);
    if constexpr (!kTma) cp_async_fence();
    next_rows = locate(t + 1);
  }
  cp_async_wait<kTma ? 0 : kStages - 1>();  // Q has landed (this thread's copies) ...
  __syncthreads();               // ... and every thread's

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(smem_k), typename Traits::FragmentLayoutK{}));
  Tensor tOrVt = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(smem_v), typename Traits::FragmentLayoutVt{}));
  Tensor acc_o = partition_fragment_C(tiled_mma, typename Traits::TileQ{});
  clear(acc_o);
  Tensor acc_o_rc = as_rows_cols(acc_o);
  auto smem_tiled_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_tiled_copy_q.get_thread_slice(lane);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_tiled_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_tiled_copy_k.get_thread_slice(lane);
  auto smem_tiled_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(lane);

  // Each fragment row is one packed row; its query, key range and ALiBi slope stay the same for
  // every chunk.
  Tensor tScS = as_rows_cols(thr_mma.partition_C(make_identity_tensor(typename Traits::TileS{})));
  constexpr int kRowsPerThread = decltype(size<0>(tScS))::value;
  const bool score_mods_on = params.softcap > 0.f || params.alibi_slopes != nullptr;
  int row_query[kRowsPerThread], row_key_begin[kRowsPerThread], row_key_limit[kRowsPerThread];
  ScoreMods<true> row_mods[kRowsPerThread];
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int row = first_row + get<0>(tScS(r, 0));
    const PackedRow packed = packed_row(min(row, packed_rows - 1), group, kv_head);
    row_query[r] = packed.query;
    row_key_begin[r] = mask.key_begin(packed.query);
    row_key_limit[r] = mask.key_limit(packed.query);
    row_mods[r] = score_mods_of<true>(params, batch, packed.head, params.seqlen_q, sequence.length);
  }

  OnlineSoftmax<kRowsPerThread> softmax(params.exp2_scale);
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    softmax.row_max[r] = -INFINITY;
    softmax.row_sum[r] = 0.f;
  }

  // Up to head dim 128 Q's fragments stay in registers for the whole walk (32 registers at 128;
  // at 256 they would spill): no ldmatrix of Q a chunk.
  constexpr bool kQInRegisters = kHeadDim <= 128;
  if constexpr (kQInRegisters) copy(smem_tiled_copy_q, tSsQ, smem_thr_copy_q.retile_D(tSrQ));

  // The chunks whose every key every row of the tile sees need no mask: those from the rows' last
  // key_begin to their first key_limit (a window's first chunks and each row's last are masked).
  int rows_key_begin = 0, rows_key_limit = sequence.length;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    rows_key_begin = max(rows_key_begin, row_key_begin[r]);
    rows_key_limit = min(rows_key_limit, row_key_limit[r]);
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) {
    rows_key_begin = max(rows_key_begin, __shfl_xor_sync(0xffffffffu, rows_key_begin, offset));
    rows_key_limit = min(rows_key_limit, __shfl_xor_sync(0xffffffffu, rows_key_limit, offset));
  }
  auto chunk_needs_mask = [&](int t) {
    const int key0 = (split_begin + warp + t * kWarps) * kKeys;
    return key0 < rows_key_begin || key0 + kKeys > rows_key_limit;
  };

  // One chunk of the walk; kMasked applies each row's key range to the scores.
  auto step = [&](int t, auto masked) __attribute__((always_inline)) {
    constexpr bool kMasked = decltype(masked)::value;
    // Chunk t + kStages - 1 goes into the stage chunk t - 1 used (every lane of this warp is done
    // with it: the __syncwarp at the end of the last step).
    if (t + kStages - 1 < warp_chunks) copy_chunk(t + kStages - 1, next_rows);
    if constexpr (!kTma) cp_async_fence();
    next_rows = locate(t + kStages);
    const int stage = t % kStages;
    const int key0 = (split_begin + warp + t * kWarps) * kKeys;
    if constexpr (kTma) {
      cutlass::arch::ClusterTransactionBarrier::wait(&stage_full[stage], (t / kStages) & 1);
      // V rows past the sequence hold whatever the cache holds there: zeroed (K's are masked).
      if (key0 + kKeys > sequence.length) {
        Tensor sV = v_stage(stage);
        const int first_zero = max(sequence.length - key0, 0);
        for (int index = lane; index < (kKeys - first_zero) * kHeadDim; index += 32) {
          sV(first_zero + index / kHeadDim, index % kHeadDim) = Element(0);
        }
      }
    } else {
      cp_async_wait<kStages - 1>();  // chunk t has landed (this lane's copies) ...
    }
    __syncwarp();                    // ... and the warp's

    Tensor acc_s = partition_fragment_C(tiled_mma, typename Traits::TileS{});
    clear(acc_s);
    if constexpr (kQInRegisters) {
      gemm_regs_smem(tiled_mma, acc_s, tSrQ, tSrK, smem_thr_copy_k.partition_S(k_stage(stage)), smem_tiled_copy_k,
                     smem_thr_copy_k);
    } else {
      gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, smem_thr_copy_k.partition_S(k_stage(stage)),
                     smem_tiled_copy_q, smem_thr_copy_q, smem_tiled_copy_k, smem_thr_copy_k);
    }
    Tensor s = as_rows_cols(acc_s);
    if (score_mods_on) {
      row_mods[0].cap(s);  // the soft cap is the same for every row
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        if (row_mods[r].alibi_slope != 0.f) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) s(r, c) += row_mods[r].bias(row_query[r], key0 + get<1>(tScS(r, c)));
        }
      }
    }
    if constexpr (kMasked) {
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) {
          const int key = key0 + get<1>(tScS(r, c));
          if (key >= row_key_limit[r] || key < row_key_begin[r]) s(r, c) = -INFINITY;
        }
      }
    }
    softmax.template update<false>(s, acc_o_rc);
    Tensor p = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(p.data(), acc_layout_as_operand_a(p.layout()));
    gemm_regs_smem(tiled_mma, acc_o, tOrP, tOrVt, smem_thr_copy_v.partition_S(vt_stage(stage)), smem_tiled_copy_v,
                   smem_thr_copy_v);
    // Every lane is done reading this stage before it is refilled (by TMA: after this lane's
    // generic accesses, in the async proxy's order).
    if constexpr (kTma) cutlass::arch::fence_view_async_shared();
    __syncwarp();
  };
  // Masked chunks one at a time, the unmasked between them in a loop of their own (a branch inside
  // one loop body ptxas turns into predicated instructions, issued for every chunk).
  int t = 0;
  while (t < warp_chunks) {
    if (chunk_needs_mask(t)) {
      step(t, cute::true_type{});
      ++t;
    } else {
      for (; t < warp_chunks && !chunk_needs_mask(t); ++t) step(t, cute::false_type{});
    }
  }
  cp_async_wait<0>();
  __syncwarp();  // every lane of this warp is done with its K/V storage

  // Merge the warps with one barrier: each warp leaves its unnormalized O (relative to its own row
  // maxima) and its rows' maxima and sums in its own K/V storage, which no other warp touches; after
  // the barrier each row's total rescales every warp's part (merged_row, below).
  const float scale_log2 = params.exp2_scale;
  constexpr int kMergeRowFloats = Traits::kMergeRowFloats;
  // Warp w's (kRows, kMergeRowFloats) outputs, then its kRows maxima and kRows sums.
  auto warp_merge_area = [&](int w) {
    return reinterpret_cast<float*>(smem_kv + w * Traits::kSmemElemsWarp);
  };
  auto warp_max = [&](int w, int row) -> float& { return warp_merge_area(w)[kRows * kMergeRowFloats + row]; };
  auto warp_sum = [&](int w, int row) -> float& {
    return warp_merge_area(w)[kRows * kMergeRowFloats + kRows + row];
  };
  {
    float* own_out = warp_merge_area(warp);
    Tensor tOcO = as_rows_cols(thr_mma.partition_C(make_identity_tensor(typename Traits::TileQ{})));
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(tOcO(r, 0));
      const float sum = quad_sum(softmax.row_sum[r]);
      if (get<1>(tScS(r, 0)) == 0) {
        warp_max(warp, get<0>(tScS(r, 0))) = softmax.row_max[r];
        warp_sum(warp, get<0>(tScS(r, 0))) = sum;
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o_rc); c += 2) {
        const int col = get<1>(tOcO(r, c));  // columns c and c + 1 are neighbours
        *reinterpret_cast<float2*>(&own_out[row * kMergeRowFloats + col]) = make_float2(acc_o_rc(r, c), acc_o_rc(r, c + 1));
      }
    }
  }
  __syncthreads();
  // Row `row`'s maximum M over the warps and the sum L of their sums rescaled to M; with `weights`,
  // each warp's factor exp2((m_w - M) * scale) / L (0 for a warp that saw no key of the row).
  auto merged_row = [&](int row, float& max, float& sum, float* weights) __attribute__((always_inline)) {
    float warp_maxima[kWarps];
    max = -INFINITY;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      warp_maxima[w] = warp_max(w, row);
      max = fmaxf(max, warp_maxima[w]);
    }
    sum = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      const float m = warp_maxima[w];
      warp_maxima[w] = m == -INFINITY ? 0.f : exp2f((m - max) * scale_log2);
      sum += warp_sum(w, row) * warp_maxima[w];
    }
    if (weights != nullptr) {
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) weights[w] = sum == 0.f ? 0.f : warp_maxima[w] / sum;
    }
  };

  // Sum the warps' outputs and store: 8 columns a thread at a time, into out in q's layout, or
  // into this split's fp32 partial output.
  const bool partial = params.num_splits > 1;
  const int64_t stats_stride = int64_t(params.batch) * params.heads * params.seqlen_q;  // one split's rows
  auto stats_index = [&](PackedRow packed) {
    return (int64_t(batch) * params.heads + packed.head) * params.seqlen_q + packed.query;
  };
  constexpr int kChunksPerRow = kHeadDim / 8;
  CUTE_UNROLL
  for (int index = tidx; index < kRows * kChunksPerRow; index += Traits::kThreads) {
    const int row = index / kChunksPerRow;
    const int col = (index % kChunksPerRow) * 8;
    if (first_row + row >= packed_rows) continue;
    const PackedRow packed = packed_row(first_row + row, group, kv_head);
    float row_max, row_sum, weights[kWarps];
    merged_row(row, row_max, row_sum, weights);
    if (!partial && params.sinks != nullptr) {  // unsplit: the sink folds in here (split: in the merge)
      float row_lse = row_sum == 0.f ? -INFINITY : row_max * lse_score_unit<true>(params) + __logf(row_sum);
      const float factor = fold_sink(row_lse, params.sinks[packed.head]);
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) weights[w] *= factor;
    }
    float sum[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) sum[e] = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(&warp_merge_area(w)[row * kMergeRowFloats + col]);
      const float4 a = src[0], b = src[1];
      const float f = weights[w];
      sum[0] += f * a.x; sum[1] += f * a.y; sum[2] += f * a.z; sum[3] += f * a.w;
      sum[4] += f * b.x; sum[5] += f * b.y; sum[6] += f * b.z; sum[7] += f * b.w;
    }
    if (partial) {
      float4* dst = reinterpret_cast<float4*>(
          params.out_accum + ((split * stats_stride + stats_index(packed)) * kHeadDim + col));
      dst[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
      dst[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
    } else if (col < params.head_dim) {
      cutlass::Array<float, 8> values;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) values[e] = sum[e];
      Element* dst = static_cast<Element*>(params.out) + int64_t(batch) * params.out_batch_stride +
                     int64_t(packed.query) * params.out_row_stride + int64_t(packed.head) * params.out_head_stride + col;
      *reinterpret_cast<cutlass::Array<Element, 8>*>(dst) = cutlass::NumericArrayConverter<Element, float, 8>{}(values);
    }
  }
  if (tidx < kRows && first_row + tidx < packed_rows) {
    float max, sum;
    merged_row(tidx, max, sum, nullptr);
    float lse = sum == 0.f ? -INFINITY : max * lse_score_unit<true>(params) + __logf(sum);
    const PackedRow packed = packed_row(first_row + tidx, group, kv_head);
    const int64_t index = stats_index(packed);
    if (partial) {
      params.lse_accum[split * stats_stride + index] = lse;
    } else {
      fold_sink(lse, sink_of(params, packed.head));
      params.lse[index] = lse;
    }
  }
}

// Grid: x = (kv head, batch) with the kv head fastest, y = block of packed query rows, z = split.
// The compact kernel (KVCacheCompactTraitsFor) is for GPUs of 99 KiB a block, and runs on Hopper
// only where FLASH_CUTLASS_SMEM_PER_BLOCK stands for one (its tests).
template <int kHeadDim, int kStages, class Element, int kWarps>
__global__ void __launch_bounds__(KVCacheTraits<kHeadDim, kStages, Element, false, kWarps>::kThreads)
    flash_kvcache_sm80(__grid_constant__ const KVCacheParams params) {
  using Traits = KVCacheTraits<kHeadDim, kStages, Element, false, kWarps>;
  // Launched under the kernel before it (the append, or the caller's): wait for its writes (under
  // the call's own append, later: kvcache_tile); the split merge may launch meanwhile.
  if (!params.after_own_append) wait_for_previous_grid();
  allow_next_grid();
  extern __shared__ __align__(128) char smem[];
  const int kv_head = int(blockIdx.x % unsigned(params.heads_k));
  const int batch = int(blockIdx.x / unsigned(params.heads_k));
  // A chunk's kKeys rows in one page: one page lookup a chunk (kvcache_tile).
  if ((params.block_table == nullptr ? params.capacity : params.page_size) % Traits::kKeys == 0) {
    kvcache_tile<Traits, true>(params, smem, int(blockIdx.y), batch, kv_head, int(blockIdx.z));
  } else {
    kvcache_tile<Traits, false>(params, smem, int(blockIdx.y), batch, kv_head, int(blockIdx.z));
  }
}

// The same attention with K and V by TMA (KVCacheTraits' kTma): Hopper, head dims in 64s, a chunk's
// rows in one page (KVCacheTmaKernel::takes, kvcache_launch.h). Built into the sm_90a code only.
template <int kHeadDim, int kStages, class Element>
__global__ void __launch_bounds__(KVCacheTraits<kHeadDim, kStages, Element, true>::kThreads)
    flash_kvcache_tma_sm90(__grid_constant__ const KVCacheParams params,
                           __grid_constant__ const KVCacheTmaCopy<KVCacheTraits<kHeadDim, kStages, Element, true>> tma_k,
                           __grid_constant__ const KVCacheTmaCopy<KVCacheTraits<kHeadDim, kStages, Element, true>> tma_v) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = KVCacheTraits<kHeadDim, kStages, Element, true>;
  // The descriptors are parameters, not the previous kernel's writes: fetched while it finishes.
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_v.get_tma_descriptor());
  }
  if (!params.after_own_append) wait_for_previous_grid();  // as flash_kvcache_sm80
  allow_next_grid();
  extern __shared__ __align__(1024) char tma_smem[];
  const int kv_head = int(blockIdx.x % unsigned(params.heads_k));
  const int batch = int(blockIdx.x / unsigned(params.heads_k));
  kvcache_tile<Traits, true>(params, tma_smem, int(blockIdx.y), batch, kv_head, int(blockIdx.z), &tma_k, &tma_v);
#endif
}

// Merges the splits' partial outputs: one CTA per (batch, head, query) row. With the splits'
// log-sum-exps lse_s, lse = log(sum_s exp(lse_s)) and out = sum_s exp(lse_s - lse) * out_s; a row
// no split saw keys for gets out 0 and lse -inf. An attention sink joins lse as one more split
// without an output (fold_sink), which scales out by the same exp(lse_s - lse). The CTA has combine_warps(splits) warps; warp w
// sums splits w, w + warps, ... and the warps' sums meet in shared memory. Every load of a row, up
// to kCombineWarps x kCombineSplitsInFlight splits, is issued before any is used, so that the merge
// waits one memory latency: each partial row with its split's lse, and every split's lse for the
// row's total (one warp a row that loaded the lses before the partial rows waited two, and a loop
// of 8 splits at a time one more each 8 splits).
constexpr int kCombineWarps = 8;
constexpr int kCombineSplitsInFlight = 8;  // a warp's partial rows in flight at once
constexpr int combine_warps(int splits) {
  const int warps = (splits + kCombineSplitsInFlight - 1) / kCombineSplitsInFlight;
  return warps < 1 ? 1 : warps > kCombineWarps ? kCombineWarps : warps;
}
template <int kHeadDim, class Element>
__global__ void __launch_bounds__(kCombineWarps * 32)
    flash_kvcache_combine_sm80(__grid_constant__ const KVCacheParams params) {
  constexpr int kColsPerLane = kHeadDim / 32;
  constexpr int kLsePerLane = (kKVCacheMaxSplits + 31) / 32;
  // A lane's columns of one partial row, loaded at once where their bytes are a power of two.
  constexpr bool kVector = (kColsPerLane & (kColsPerLane - 1)) == 0;
  using LaneColumns = cutlass::AlignedArray<float, kColsPerLane, kVector ? 4 * kColsPerLane : 4>;
  __shared__ float warp_out[kCombineWarps][kHeadDim];
  wait_for_previous_grid();  // the attention kernel's partial outputs
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int64_t rows = int64_t(params.batch) * params.heads * params.seqlen_q;
  const int64_t index = blockIdx.x;  // (batch, head, query)
  const int query = int(index % params.seqlen_q);
  const int head = int((index / params.seqlen_q) % params.heads);
  const int batch = int(index / (int64_t(params.seqlen_q) * params.heads));
  const int splits = min(params.num_splits, kKVCacheMaxSplits);
  const float* split_lse = params.lse_accum + index;  // split s at s * rows
  const float* split_out = params.out_accum + index * kHeadDim + lane * kColsPerLane;  // at s * rows * kHeadDim

  // This warp's splits of group g: (g x kCombineSplitsInFlight + j) x warps + warp, each partial
  // row with its lse (-inf past the last split: weight 0, nothing read).
  LaneColumns partial[kCombineSplitsInFlight];
  float partial_lse[kCombineSplitsInFlight];
  auto load_group = [&](int group) __attribute__((always_inline)) {
    CUTE_UNROLL
    for (int j = 0; j < kCombineSplitsInFlight; ++j) {
      const int s = (group * kCombineSplitsInFlight + j) * warps + warp;
      partial_lse[j] = -INFINITY;
      if (s < splits) {
        partial[j] = *reinterpret_cast<const LaneColumns*>(split_out + int64_t(s) * rows * kHeadDim);
        partial_lse[j] = split_lse[int64_t(s) * rows];
      }
    }
  };
  load_group(0);
  float lanes_lse[kLsePerLane];
  CUTE_UNROLL
  for (int i = 0; i < kLsePerLane; ++i) {
    const int s = i * 32 + lane;
    lanes_lse[i] = s < splits ? split_lse[int64_t(s) * rows] : -INFINITY;
  }

  float max = -INFINITY;
  CUTE_UNROLL
  for (int i = 0; i < kLsePerLane; ++i) max = fmaxf(max, lanes_lse[i]);
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
  float sum = 0.f;
  if (max != -INFINITY) {
    CUTE_UNROLL
    for (int i = 0; i < kLsePerLane; ++i) sum += __expf(lanes_lse[i] - max);  // exp(-inf) = 0
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  float lse = sum == 0.f ? -INFINITY : max + __logf(sum);
  fold_sink(lse, sink_of(params, head));

  float out[kColsPerLane];
  CUTE_UNROLL
  for (int c = 0; c < kColsPerLane; ++c) out[c] = 0.f;
  const int groups = (splits + warps * kCombineSplitsInFlight - 1) / (warps * kCombineSplitsInFlight);
  for (int group = 0; group < groups; ++group) {
    if (group > 0) load_group(group);
    CUTE_UNROLL
    for (int j = 0; j < kCombineSplitsInFlight; ++j) {
      const float weight = partial_lse[j] == -INFINITY || sum == 0.f ? 0.f : __expf(partial_lse[j] - lse);
      if (weight != 0.f) {
        CUTE_UNROLL
        for (int c = 0; c < kColsPerLane; ++c) out[c] += weight * partial[j][c];
      }
    }
  }
  Element* dst = static_cast<Element*>(params.out) + int64_t(batch) * params.out_batch_stride +
                 int64_t(query) * params.out_row_stride + int64_t(head) * params.out_head_stride;
  if (warps == 1) {
    CUTE_UNROLL
    for (int c = 0; c < kColsPerLane; ++c) {
      const int col = lane * kColsPerLane + c;
      if (col < params.head_dim) dst[col] = Element(out[c]);
    }
  } else {
    CUTE_UNROLL
    for (int c = 0; c < kColsPerLane; ++c) warp_out[warp][lane * kColsPerLane + c] = out[c];
    __syncthreads();
    for (int col = threadIdx.x; col < params.head_dim; col += warps * 32) {
      float total = 0.f;
      for (int w = 0; w < warps; ++w) total += warp_out[w][col];
      dst[col] = Element(total);
    }
  }
  if (threadIdx.x == 0) params.lse[index] = lse;
}

// fp32 a * b, a - b and a + b rounded to nearest, each on its own: PTX without .ftz, which neither
// nvcc's FMA contraction nor --use_fast_math's flush of subnormals (-ftz=true, which turns even
// __fmul_rn into FMUL.FTZ) touches. The append's rotation is thereby bitwise the CPU's.
__device__ __forceinline__ float mul_rn(float a, float b) {
  float result;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float result;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float result;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}

// Eight columns from `col` of the row at src into the row at dst, turned by the rotary embedding
// of `position` where they lie below rotary_dim: bitwise the reference's rotation
// (flash_cutlass.reference, _KVCachePlan._rotated), which rounds each fp32 product, then their
// difference or sum, then the result to the dtype.
template <class Element>
__device__ __forceinline__ void rotate_and_store(KVCacheParams const& params, const Element* src, Element* dst,
                                                 int col, int position) {
  cutlass::Array<Element, 8> values = *reinterpret_cast<const cutlass::Array<Element, 8>*>(src + col);
  if (params.rotary_cos != nullptr && col < params.rotary_dim) {
    const int half = params.rotary_dim / 2;
    const int64_t table_row = int64_t(min(max(position, 0), params.rotary_positions - 1)) * half;
    const Element* cos = static_cast<const Element*>(params.rotary_cos) + table_row;
    const Element* sin = static_cast<const Element*>(params.rotary_sin) + table_row;
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      const int feature = col + e;
      if (feature >= params.rotary_dim) break;
      // The pair (x1, x2) turned by angle m: (2m, 2m + 1) interleaved (GPT-J), (m, m + half) not (GPT-NeoX).
      const bool first = params.rotary_interleaved ? feature % 2 == 0 : feature < half;
      const int m = params.rotary_interleaved ? feature / 2 : (first ? feature : feature - half);
      const int x1_col = params.rotary_interleaved ? 2 * m : m;
      const int x2_col = params.rotary_interleaved ? 2 * m + 1 : m + half;
      const float x1 = float(src[x1_col]), x2 = float(src[x2_col]);
      const float c = float(cos[m]), s = float(sin[m]);
      // An FMA would round once where the reference rounds the product and the sum each.
      values[e] = Element(first ? sub_rn(mul_rn(x1, c), mul_rn(x2, s)) : add_rn(mul_rn(x1, s), mul_rn(x2, c)));
    }
  }
  *reinterpret_cast<cutlass::Array<Element, 8>*>(dst + col) = values;
}

// The append: new keys (rotated with rotary) and values into the cache at each sequence's length,
// and with rotary the rotated queries into params.q_rotated; one thread per 8 columns of a row.
// Reads the same clamped lengths and pages as the attention kernel (common/kvcache.h).
template <class Element>
__global__ void __launch_bounds__(128) flash_kvcache_append_sm80(__grid_constant__ const KVCacheParams params) {
  allow_next_grid();  // the attention kernel waits for this grid's end before it reads
  const int chunks_per_row = params.head_dim / 8;
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t row = index / chunks_per_row;
  const int col = int(index % chunks_per_row) * 8;
  const int64_t kv_rows = int64_t(params.batch) * params.seqlen_new * params.heads_k;
  if (row < kv_rows) {
    const int head = int(row % params.heads_k);
    const int token = int((row / params.heads_k) % params.seqlen_new);
    const int batch = int(row / (int64_t(params.heads_k) * params.seqlen_new));
    const int position = cached_sequence(params, batch).start + token;
    const SequencePages pages = sequence_pages(params, batch);
    int row_in_page;
    const int page = pages.page_of(position, row_in_page);
    const Element* k_new = new_token_row<Element>(params, false, batch, token, head);
    const Element* v_new = new_token_row<Element>(params, true, batch, token, head);
    Element* k_dst = cache_row<Element>(params, pages, false, page, row_in_page, head);
    Element* v_dst = cache_row<Element>(params, pages, true, page, row_in_page, head);
    rotate_and_store(params, k_new, k_dst, col, position);
    *reinterpret_cast<cutlass::uint128_t*>(v_dst + col) = *reinterpret_cast<const cutlass::uint128_t*>(v_new + col);
    return;
  }
  row -= kv_rows;
  if (params.rotary_cos == nullptr || row >= int64_t(params.batch) * params.seqlen_q * params.heads) return;
  const int head = int(row % params.heads);
  const int query = int((row / params.heads) % params.seqlen_q);
  const int batch = int(row / (int64_t(params.heads) * params.seqlen_q));
  const int position = cached_sequence(params, batch).start + (params.rotary_q_per_row ? query : 0);
  const Element* src = static_cast<const Element*>(params.q_source) + int64_t(batch) * params.q_source_batch_stride +
                       int64_t(query) * params.q_source_row_stride + int64_t(head) * params.q_source_head_stride;
  Element* dst = static_cast<Element*>(params.q_rotated) + int64_t(batch) * params.q_batch_stride +
                 int64_t(query) * params.q_row_stride + int64_t(head) * params.q_head_stride;
  rotate_and_store(params, src, dst, col, position);
}

// The gather for the Hopper forward (chunked prefill, flash_api.cpp): each sequence's positions
// [0, length) of the cache, after the append, copied into packed (params.h, KVCachePacked) from its
// pages, the sequences one after the other, with the cumulative lengths. One CTA per
// (kKVCacheGatherRows positions, sequence, kv head), one thread per 8 columns of a row; reads the
// same clamped lengths and pages as the attention kernel (common/kvcache.h), so both see the same
// keys whatever the device holds. The paged form (the forward reads the pages through the block
// table) writes the cumulative lengths only, one CTA per sequence.
template <class Element>
__global__ void __launch_bounds__(128) flash_kvcache_gather_sm80(__grid_constant__ const KVCacheParams params,
                                                                 const KVCachePacked packed) {
  const int batch = blockIdx.y;
  const int head = blockIdx.z;
  const int first = blockIdx.x * kKVCacheGatherRows;
  const int length = cached_sequence(params, batch).length;
  const bool writes_lengths = blockIdx.x == 0 && head == 0;
  if (first >= length && !writes_lengths) return;
  // Where this sequence starts in packed: the lengths of the sequences before it.
  __shared__ int warp_sums[4];
  int start = 0;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) start += cached_sequence(params, b).length;
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) start += __shfl_xor_sync(0xffffffff, start, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = start;
  __syncthreads();
  start = warp_sums[0] + warp_sums[1] + warp_sums[2] + warp_sums[3];
  if (writes_lengths && threadIdx.x == 0) {
    packed.cu_seqlens_k[batch + 1] = start + length;
    packed.cu_seqlens_q[batch + 1] = (batch + 1) * params.seqlen_q;
    if (batch == 0) packed.cu_seqlens_k[0] = packed.cu_seqlens_q[0] = 0;
  }
  if (packed.form != KVCachePacked::Form::kGathered) return;  // the paged form: the lengths alone
  const SequencePages pages = sequence_pages(params, batch);
  const int chunks_per_row = params.head_dim / 8;
  const int rows = min(kKVCacheGatherRows, length - first);
  for (int index = threadIdx.x; index < rows * chunks_per_row; index += blockDim.x) {
    const int position = first + index / chunks_per_row;
    const int col = (index % chunks_per_row) * 8;
    int row_in_page;
    const int page = pages.page_of(position, row_in_page);
    const Element* k_src = static_cast<const Element*>(params.k) +
                           pages.offset_of(page, row_in_page, params.k_batch_stride, params.k_row_stride,
                                           int64_t(head) * params.k_head_stride);
    const Element* v_src = static_cast<const Element*>(params.v) +
                           pages.offset_of(page, row_in_page, params.v_batch_stride, params.v_row_stride,
                                           int64_t(head) * params.v_head_stride);
    const int64_t dst = (int64_t(start + position) * params.heads_k + head) * params.head_dim + col;
    *reinterpret_cast<cutlass::uint128_t*>(static_cast<Element*>(packed.k) + dst) =
        *reinterpret_cast<const cutlass::uint128_t*>(k_src + col);
    *reinterpret_cast<cutlass::uint128_t*>(static_cast<Element*>(packed.v) + dst) =
        *reinterpret_cast<const cutlass::uint128_t*>(v_src + col);
  }
}

// The gather's in-place form (Form::kInPlace: a contiguous cache whose sequence b is cache row b,
// rows capacity positions apart): no copy, only the variable-length forward's cumulative lengths
// over the cache viewed as batch x capacity rows, each sequence followed by a sequence of no queries
// holding the rest of its row, so that every sequence starts where its row does: sequence 2 b has
// queries [b seqlen_q, (b + 1) seqlen_q) and keys [b capacity, b capacity + length), sequence 2 b + 1
// no query and keys up to (b + 1) capacity. One thread per sequence.
template <class Element>
__global__ void __launch_bounds__(128) flash_kvcache_sequences_sm80(__grid_constant__ const KVCacheParams params,
                                                                    const KVCachePacked packed) {
  const int batch = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (batch >= params.batch) return;
  const int row_start = batch * params.capacity;  // below 2^31: the host's bound on the cache's rows
  const int queries_end = (batch + 1) * params.seqlen_q;
  packed.cu_seqlens_q[2 * batch + 1] = queries_end;
  packed.cu_seqlens_q[2 * batch + 2] = queries_end;
  packed.cu_seqlens_k[2 * batch + 1] = row_start + cached_sequence(params, batch).length;
  packed.cu_seqlens_k[2 * batch + 2] = row_start + params.capacity;
  if (batch == 0) packed.cu_seqlens_q[0] = packed.cu_seqlens_k[0] = 0;
}

}  // namespace flash_cutlass::sm80

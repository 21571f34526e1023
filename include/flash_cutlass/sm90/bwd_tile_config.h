// Everything the Hopper-path backward kernel derives from (head dim, tile sizes, stages, dtype):
// the CTA's roles and register budgets, the warpgroup MMAs of its five GEMMs, the swizzled
// shared-memory layouts, the barriers and the TMA copy types.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "flash_cutlass/common/softmax.h"

namespace flash_cutlass::sm90 {

// What both consumer layouts share: the roles and register budgets of a CTA of a producer
// warpgroup and two consumer warpgroups, the tiles, the K-major 128-byte-swizzled layouts that TMA
// writes Q, dO, K and V in (and their transposed views), and the TMA copy types.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_, int kStagesdO_ = kStages_>
struct BwdCommonTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step of a CTA's walk
  static constexpr int kBlockN = kBlockN_;  // keys of a CTA
  static constexpr int kStages = kStages_;  // query blocks (Q, LSE, D and, unless kSeparatedO, dO) in flight
  static constexpr int kStagesdO = kStagesdO_;  // dO's stages: kStages, or one
  // With one dO stage under more Q stages, dO has barriers of its own (dout_full, dout_empty): it is
  // released after dV, its last GEMM, while Q waits for dK.
  static constexpr bool kSeparatedO = kStagesdO != kStages;
  static_assert(kStagesdO == kStages || kStagesdO == 1);
  static_assert(kBlockM % 64 == 0 && kBlockN % 64 == 0 && kHeadDim % 32 == 0,
                "query rows and keys in 64s (64-row wgmmas), the head dim in 32s (swizzle atoms)");

  // Warpgroup 0: warp 0 loads (TMA), warp 1 adds each query block's dQ to global memory where the
  // consumers leave it in shared memory (TMA reduce-add), warp 2 stages LSE and D; the others exit
  // at once. Warpgroups 1 and 2 are the consumers.
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kLaunchRegisters - kProducerRegisters ==
                kConsumerWarpgroups * (kConsumerRegisters - kLaunchRegisters));

  // A query block's tile (Q, dO, dQ), the key block's (K, V, dK, dV), and S^T's (keys, queries).
  using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileSt = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>;
  // S^T and dP^T of the whole tile: (keys, queries, head dim).
  using TileShapeSdPWhole = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  // dQ = dS K: (queries, head dim, keys), the warpgroups split the head dim.
  using TileShapedQPerWarpgroup =
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kConsumerWarpgroups>, cute::Int<kBlockN>>;
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  using WarpgroupsAlongN = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpgroups>, cute::_1>>;
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapedQPerWarpgroup, cute::GMMA::Major::MN,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongN{}));

  // 128-byte-swizzled rows of 64 elements, the head dim (or, for P^T and dS^T, the queries)
  // contiguous: the layout TMA writes and wgmma reads. At head dims 96 and 192, 64-byte-swizzled
  // rows of 32: the head dim (96), or the head-split consumers' halves of it (96), are then whole
  // atoms, as a wgmma operand whose head dim is its M or N needs.
  static constexpr bool kWideAtoms = kHeadDim % 64 == 0 && (kHeadDim <= 128 || (kHeadDim / 2) % 64 == 0);
  using SmemAtom = std::conditional_t<kWideAtoms, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  // Q and dO: one buffer a stage (of kStages and kStagesdO).
  template <int kBuffers>
  using SmemLayoutQueryRows = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBuffers>>{}));
  template <int kBuffers>
  using SmemLayoutQueryRowsT = decltype(cute::composition(
      SmemLayoutQueryRows<kBuffers>{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kBuffers>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutQ = SmemLayoutQueryRows<kStages>;
  using SmemLayoutQt = SmemLayoutQueryRowsT<kStages>;
  using SmemLayoutdO = SmemLayoutQueryRows<kStagesdO>;
  using SmemLayoutdOt = SmemLayoutQueryRowsT<kStagesdO>;
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));
  // (keys, queries), queries contiguous, two buffers (a step's GEMM of one warpgroup may still read
  // one while the other writes the next step's); seen as (queries, keys) it is the MN-major A of dQ.
  using SmemLayoutdSt = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::_2>{}));
  using SmemLayoutdS = decltype(cute::composition(
      SmemLayoutdSt{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::_2>{},
                                                 cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // From the accumulators to shared memory with stmatrix: four 8x8 tiles an instruction (the
  // 32-bit generic stores before took 16 instructions a thread, each with its own swizzled address).
  using SmemCopyAtomdS = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);    // one stage of Q (or dO)
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);  // K (or V)

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                  cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutQ{}), TileQ{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{}, TileKV{},
                                             cute::_1{}));
  // dK and dV stored from K's and V's tiles in shared memory (bwd_epilogue.h).
  using GmemTensorOut = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)),
                                                   GmemLayout{}));
  using TmaStoreKV = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutKV{},
                                                  TileKV{}, cute::_1{}));
  // The same in boxes of kBlockM rows from query stages (the persistent walks' epilogue).
  using TmaStoreQRows = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOut{},
                                                     cute::take<0, 2>(SmemLayoutQ{}), TileQ{}, cute::_1{}));
  // dq_accum as (rows, kHeadDim, heads, batch) fp32, added to with TMA's reduce-add from a staged
  // tile of dQ.
  using GmemTensordQ =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<float*>(nullptr)), GmemLayout{}));
  template <class SmemLayoutdQ, class TileDq>
  using TmadQFor = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensordQ{}, SmemLayoutdQ{},
                                                TileDq{}, cute::_1{}));
  // The same tile stored instead (the first of a query block's adders: BwdParams::dq_first_store).
  template <class SmemLayoutdQ, class TileDq>
  using TmaStoredQFor = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensordQ{}, SmemLayoutdQ{},
                                                     TileDq{}, cute::_1{}));
  // A GQA call's dK or dV added to its K/V head's fp32 accumulator by TMA's reduce-add
  // (bwd_epilogue.h): half the head dim at a time, 128-byte swizzled, staged in K's tile and V's
  // (each as many bytes as one half). Where a half is no whole number of 32-float atoms (head dim
  // 96), with atomics instead (the type below is then only a placeholder of the kernel's parameters).
  static constexpr bool kAddsDkvWithTma = (kHeadDim / 2) % 32 == 0;
  using TileAccumHalf = cute::Shape<cute::Int<kBlockN>, cute::Int<kAddsDkvWithTma ? kHeadDim / 2 : 32>>;
  using SmemLayoutAccumHalf =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{}, TileAccumHalf{}));
  static_assert(!kAddsDkvWithTma ||
                cute::cosize_v<SmemLayoutAccumHalf> * sizeof(float) == cute::cosize_v<SmemLayoutKV> * sizeof(Element));
  using TmaAddKV = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensordQ{}, SmemLayoutAccumHalf{},
                                                TileAccumHalf{}, cute::_1{}));
};

// The pipeline's shared state: per stage and query row the exponent of P from the log-sum-exp
// (probability_exponent, common/softmax.h; lse = +inf past the sequence, so that P = 0 there; the
// blocks whose every scale is exp2_scale, exact_rows false, read only its offset), D (0 past the
// sequence), and the barriers.
template <int kStages, int kBlockM, int kStagesdO = kStages>
struct BwdPipelineStorage {
  alignas(16) ScoreExponent exponent[kStages][kBlockM];
  int exact_rows[kStages];  // whether a row of the stage takes probability_exponent's exact form
  alignas(16) float dsum[kStages][kBlockM];
  // K and V: full when the tile's TMA bytes have landed, empty when every consumer thread is done
  // with the tile (the next tile's K and V then load while the consumers store dK and dV). Where V
  // comes after the walk's first Q and dO (loads_v_after_first_query, bwd_producer.h), kv_full
  // counts K's bytes and V lands on v_full.
  cutlass::arch::ClusterTransactionBarrier kv_full;
  cutlass::arch::ClusterBarrier kv_empty;
  cutlass::arch::ClusterTransactionBarrier v_full;
  // A stage is full when its Q and dO (only Q if kSeparatedO) have landed (TMA transaction bytes)
  // and every lane of the statistics warp has stored its LSE and D (an arrival each); empty when
  // every consumer thread is done with it.
  cutlass::arch::ClusterTransactionBarrier query_full[kStages];
  cutlass::arch::ClusterBarrier query_empty[kStages];
  // dO's own, where it has fewer stages than Q (kSeparatedO): full when its TMA bytes have landed,
  // empty when every consumer thread's dV GEMM is done with it.
  cutlass::arch::ClusterTransactionBarrier dout_full[kStagesdO];
  cutlass::arch::ClusterBarrier dout_empty[kStagesdO];
  // Variable-length calls only: the K/V tile, and a sequence's last query block, land here when
  // they hold rows past the sequence; the loader zeroes those rows before it marks them full.
  cutlass::arch::ClusterTransactionBarrier kv_landed;
  cutlass::arch::ClusterTransactionBarrier query_landed;
};

// Up to head dim 128: each consumer warpgroup owns 64 keys, dK and dV (keys, head dim) in its
// registers; dQ goes through shared memory to the dQ warp's TMA reduce-add.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_>
struct BwdKernelTraits : BwdCommonTraits<kHeadDim_, kBlockM_, kBlockN_, kStages_, Element_> {
  using Base = BwdCommonTraits<kHeadDim_, kBlockM_, kBlockN_, kStages_, Element_>;
  using typename Base::Element;
  using typename Base::TileQ;
  using typename Base::WarpgroupsAlongM;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages;
  static constexpr bool kHeadSplit = false;
  static_assert(kBlockN == 64 * Base::kConsumerWarpgroups && kHeadDim <= 128, "64 keys a warpgroup; registers");
  // The query stages a persistent walk's epilogue stages dK and dV in (store_dk_dv_through_query_stages):
  // kBlockN keys in stages of kBlockM rows, one left for the next tile's first block.
  static constexpr int kHeldStages = kBlockN / kBlockM;
  static_assert(kBlockN % kBlockM == 0 && kHeldStages < kStages && !Base::kSeparatedO);
  // Whether persistent walks take that epilogue, and non-deterministic calls walk persistently at
  // all (bwd_launch.h): head dim 64, one held stage (+2% at 1k on the H200, +1% at 4k); with two held
  // stages (96, 128) 0 to -1.3% against one CTA a tile.
  static constexpr bool kPersistentEpilogue = kHeldStages == 1;

  // S^T = K Q^T and dP^T = V dO^T: (keys, queries, head dim), the warpgroups split the keys.
  using TileShapeSdP = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  // dV = P^T dO and dK = dS^T Q: (keys, head dim, queries), A from registers.
  using TileShapedKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kBlockM>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapeSdP>(), WarpgroupsAlongM{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileShapedKV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));
  // One warpgroup's 64 keys of it (the same per-thread accumulator layout).
  using TiledMmadKVWarpgroup = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockM>>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>()));
  // dQ = dS K: (queries, head dim, keys). Up to head dim 64 the whole block by one warpgroup, the
  // warpgroups taking turns by step (wgmmas of N = 64 where halves of the head dim would be N = 32:
  // 1-2.5% faster at 64 on the H200; at 128, halves of N = 64 against a whole of N = 128 that
  // needs dV waited first for registers, 1.5-3.4% slower), past it half the head dim each. The
  // extended kernels (score mods, dropout) keep the halves: turns cost them 150 B more spills.
  // At head dim 96 always: its halves (48) are no whole swizzle atoms of an MN-major operand.
  static constexpr bool dq_in_turns(bool extended) { return (kHeadDim <= 64 && !extended) || kHeadDim % 64 != 0; }
  using TiledMmadQWhole = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  template <bool kExtended>
  using TiledMmadQFor = std::conditional_t<dq_in_turns(kExtended), TiledMmadQWhole, typename Base::TiledMmadQ>;
  // The consumer threads that stage one dQ tile for the dQ warp.
  static constexpr int dq_staging_threads(bool extended) {
    return dq_in_turns(extended) ? 128 : Base::kConsumerThreads;
  }
  // A query block's dQ in fp32, 128-byte swizzled (columns in chunks of 32): the layout the TMA
  // reduce-add reads, on which a warp's 64-bit stores of an accumulator (8 rows of 32 bytes) hit
  // every bank once per 128 bytes; unswizzled rows of kHeadDim floats put all 8 rows on the same
  // 8 banks. The whole tile at once (both warpgroups' columns).
  using TileDq = TileQ;
  using SmemLayoutdQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{}, TileDq{}));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>> v;
    // dS^T, two buffers.
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdSt>> ds;
    // A query block's dQ, staged for the dQ warp.
    alignas(1024) cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>> dq;
    BwdPipelineStorage<kStages, kBlockM> pipeline;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");

  using TmadQ = typename Base::template TmadQFor<SmemLayoutdQ, TileDq>;
  using TmaStoredQ = typename Base::template TmaStoredQFor<SmemLayoutdQ, TileDq>;
};

// The wide head dims (256): dK and dV of 64 keys x 256 do not fit one warpgroup's registers next
// to S and dP, so the consumers split the head dim instead of the keys. Per query block:
//   S^T = K Q^T, dP^T = V dO^T: (64 keys, kBlockM queries), warpgroup 0 S^T and warpgroup 1 dP^T
//   (TiledMmaSdPByRole; the soft-cap, ALiBi and dropout kernels split the queries instead);
//   P^T and dS^T go to shared memory (keys, queries), where both warpgroups read all of them;
//   dV += P^T dO and dK += dS^T Q: (64 keys, head dim), each warpgroup half of the head dim, both
//   operands from shared memory;
//   dQ = dS K: (queries, head dim), each warpgroup half of the head dim, staged in shared memory
//   one warpgroup's half after the other for the dQ warp's TMA reduce-add (the consumers' own
//   atomics had them wait on the memory pipeline: a third of their time).
// The staging tile (64 x 128 fp32) takes the room of a second dO stage: dO has one, released after
// dV, Q two.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_>
struct BwdHeadSplitKernelTraits : BwdCommonTraits<kHeadDim_, kBlockM_, kBlockN_, kStages_, Element_, 1> {
  using Base = BwdCommonTraits<kHeadDim_, kBlockM_, kBlockN_, kStages_, Element_, 1>;
  using typename Base::Element;
  using typename Base::WarpgroupsAlongN;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages, Base::kConsumerWarpgroups;
  static constexpr bool kHeadSplit = true;
  static constexpr bool kPersistentEpilogue = false;  // (the kernel traits': dK/dV through held query stages)
  static constexpr int dq_staging_threads(bool) { return 128; }  // a warpgroup stages its half
  static_assert(kBlockN == 64, "the keys are the M of S^T and dP^T: one 64-row wgmma");
  static_assert(kBlockM % (8 * kConsumerWarpgroups) == 0, "query halves of whole swizzle atoms");
  static_assert((kHeadDim / kConsumerWarpgroups) % 32 == 0,
                "head-dim halves: wgmma N (a multiple of 8), and whole 32-column atoms of dQ's staging tile");

  // S^T and dP^T: (keys, queries, head dim), the warpgroups split the queries.
  using TileShapeSdPPerWarpgroup =
      cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM / kConsumerWarpgroups>, cute::Int<kHeadDim>>;
  // dV and dK: (keys, head dim, queries), A (P^T, dS^T) query-major, B (dO, Q) head-dim-major, the
  // warpgroups split the head dim (the N of the wgmmas: halves of 96 at head dim 192, which 64-row
  // M tiles of the transposed form, dV^T, could not split; and a third less shared-memory traffic
  // than dV^T's two 64-row tiles a warpgroup).
  using TileShapedKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim / kConsumerWarpgroups>, cute::Int<kBlockM>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapeSdPPerWarpgroup>(), WarpgroupsAlongN{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapedKV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongN{}));
  // Without score modifications or dropout the warpgroups split S^T and dP^T by role instead:
  // warpgroup 0 computes S^T, warpgroup 1 dP^T, each the whole (64 keys, kBlockM queries) tile, so
  // that their wgmmas are of N = kBlockM (64) rather than kBlockM / 2: an m64n32k16 with both
  // operands in shared memory reads 3 KB in its 16 cycles (192 B a cycle, where shared memory gives
  // 128), an m64n64k16 4 KB in 32.
  using TiledMmaSdPByRole = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, typename Base::TileShapeSdPWhole>()));
  // P^T back from shared memory into the accumulator layout (the inverse of SmemCopyAtomdS).
  using SmemLoadAtomPt = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;

  // One warpgroup's half of a query block's dQ, fp32, 128-byte swizzled (as BwdKernelTraits's).
  using TileDq = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kConsumerWarpgroups>>;
  using SmemLayoutdQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{}, TileDq{}));
  using TmadQ = typename Base::template TmadQFor<SmemLayoutdQ, TileDq>;
  using TmaStoredQ = typename Base::template TmaStoredQFor<SmemLayoutdQ, TileDq>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>> v;
    // P^T and dS^T, two buffers each: the K-major A of dV and dK.
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdSt>> pt;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdSt>> ds;
    // Half a query block's dQ, staged for the dQ warp (the warpgroups take turns).
    alignas(1024) cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>> dq;
    BwdPipelineStorage<kStages, kBlockM, Base::kStagesdO> pipeline;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// Tile sizes per head dim: 128 keys a CTA; query blocks of 128 rows at head dim 64 (twice the N of
// the S^T and dP^T GEMMs, half the steps) in two stages, of 64 at 128 (the registers of dK and dV)
// in three (a third stage fills shared memory to 227 KiB; +1-2% over two).
template <int kHeadDim>
struct BwdTileSizes {
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64, kBlockN = 128, kStages = kHeadDim <= 64 ? 2 : 3;
};

// Past 128: 64 keys a CTA, query blocks of 64 rows, two Q stages and one of dO (BwdHeadSplitKernelTraits).
template <int kHeadDim, class Element, class Sizes = BwdTileSizes<kHeadDim>>
using BwdTraitsFor = std::conditional_t<(kHeadDim > 128), BwdHeadSplitKernelTraits<kHeadDim, 64, 64, 2, Element>,
                                        BwdKernelTraits<kHeadDim, Sizes::kBlockM, Sizes::kBlockN, Sizes::kStages, Element>>;

}  // namespace flash_cutlass::sm90

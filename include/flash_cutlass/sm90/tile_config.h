// Everything the Hopper-path forward kernel derives from (head dim, tile sizes, stages, dtype):
// warpgroup MMAs, swizzled shared-memory layouts, the K/V pipeline and the shared-memory size.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace flash_cutlass::sm90 {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kPersistent_, class Element_>
struct FwdKernelTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // A persistent grid taking tiles in turn (causal ones in pairs), or one CTA per tile (fwd_launch.h,
  // block_info.h).
  static constexpr bool kPersistent = kPersistent_;
  // One producer warpgroup (a single thread issues the TMA loads) and one consumer warpgroup per
  // 64 query rows.
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups >= 2 && kConsumerWarpgroups <= 3);
  // Registers per thread: what the CTA gets at launch (one CTA of kThreads per SM fills the 64K
  // file), and the budgets setmaxnreg sets after: the producer only issues copies, the consumers
  // hold the S and O accumulators. setmaxnreg moves registers only within the CTA, so the consumer
  // warpgroups can take at most what the producer warpgroup frees. Two consumer warpgroups: 32 and
  // 232 rather than 24 and 240, whose producer spilled 40-60 B at head dims 64 (causal), 96 and 128
  // (H200: +0.5-2% at 128 without a mask, level at 64/96/192/256).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 232 : 160;
  static_assert(kLaunchRegisters - kProducerRegisters >=
                kConsumerWarpgroups * (kConsumerRegisters - kLaunchRegisters));
  // The paged kernel's (fwd_kernel.h) up to head dim 128: 40 for its producer, whose block-table
  // walk, a block's entry read ahead by one thread, spilled 248 B at 24 (at 128 on the H200: 212
  // against 202 us at 40). The walk since, the warp's lanes reading the table together, compiles
  // without spills at either and runs as fast at both (188-193 us). Its consumers fit in 224
  // (past 128 they spill there). The producer frees more than the consumers take.
  static constexpr bool kWidePagedProducer = kConsumerWarpgroups == 2 && kHeadDim <= 128;
  static constexpr int kPagedProducerRegisters = kWidePagedProducer ? 40 : kProducerRegisters;
  static constexpr int kPagedConsumerRegisters = kWidePagedProducer ? 224 : kConsumerRegisters;
  static_assert(kPagedProducerRegisters * 128 + kPagedConsumerRegisters * 128 * kConsumerWarpgroups <=
                kLaunchRegisters * kThreads);
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "rows of 64- or 128-byte swizzle atoms");
  // The softmax of one key tile runs while P V of the tile before is in flight, its wait kept after
  // the exponentials (fwd_mainloop.h). At head dim 256 the O accumulator's 128 registers a thread
  // leave no room for S and P to live that long: ptxas spilled 650-1800 B a kernel, and 140-190 B at
  // 192 (96 registers of O). At head dim 64 (issue-bound, three consumer warpgroups) it measured 1-5%
  // slower on the H200, so it is off there.
  static constexpr bool kSoftmaxOverlapsPV = kHeadDim == 96 || kHeadDim == 128;
  // Every head dim: a row keeps a stale maximum while no key tile raises it by more than 2^8
  // (OnlineSoftmax::update_scores_lazily), so most tiles skip O's rescale: +11-16% at head dim 256
  // from 4k keys on the H200 (128 O registers a thread to rescale), 0-5% at 128 beside the late
  // wait, 1-5% at 96. At 64 it measured 1-3% slower alone, and 4-7% faster without a mask (-0.6 to
  // +5% causal) with the exponentials ahead of the maxima below.
  // With 128-key tiles, an unmasked key tile is exponentiated against the row maxima kept from
  // the tiles before, ahead of its own maxima, and scored again where a P exceeds the lazy bound
  // (OnlineSoftmax::exponentiate_against_kept_max, fwd_mainloop.h): the 64 FMNMX, 4 shuffles and the
  // vote before the first exponential leave a softmax's path. On the H200 +4-8% at head dim 128
  // without a mask and +2-6% causal, +4-5% and +1-6% at 96, +4-7% and -0.6 to +5% at 64; with 64-key
  // tiles (192, 256: half the maxima to take, K's stage held longer) -3 to +3%, so it is off there.
  static constexpr bool kExponentiatesAheadOfMax = kBlockN == 128;
  // A row's max and sum as four interleaved chains (OnlineSoftmax's kMaxChains) at head dims 96 and
  // 128 (128-key tiles on two consumer warpgroups).
  static constexpr int kSoftmaxChains = kHeadDim == 96 || kHeadDim == 128 ? 4 : 1;
  // A consumer tests whether the next step's K and V stages have landed at the end of a softmax
  // instead of waiting for them at the step's start (fwd_mainloop.h, test_next_stages): the test's
  // latency left the critical path, +2-3% at head dim 128 without a mask (2k-16k) and 64 causal
  // (1k-2k) on the H200. At 256, whose consumers wait for the loads themselves, 0 to -2%: off.
  static constexpr bool kTestsNextStagesEarly = kHeadDim <= 128;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);
  // Causal tiles: a consumer warpgroup skips the first key blocks visited that lie past the diagonal
  // for all of its rows (fwd_mainloop.h). With 192-row tiles on 128-key blocks, 1.5 of a tile's key
  // blocks on average, the masked ones: +2-4% at head dim 64 from 4k on the H200. With 128 rows on
  // 64 keys (head dim 256) one block a tile: 3-7% slower (the steady loop gained 8 instructions).
  // With 128 rows on 128 keys a warpgroup has such blocks only where seqlen_q != seqlen_k.
  static constexpr bool kSkipsKeyBlocksPastDiagonal = kBlockM % kBlockN != 0;
  // Causal tiles: a consumer warpgroup whose rows see none of the second half of the first key
  // block it visits (the diagonal block, for the first 64 rows of a 128-row tile) scores that
  // block's first half only: S = Q K^T on kBlockN / 2 keys and half the masked softmax; its P's
  // second half is 0 (fwd_mainloop.h). +1-3% at head dims 64 and 128, 1k-2k, on the H200.
  static constexpr bool kHalvesFirstKeyBlock = kBlockN == 128;
  static constexpr int kHalfBlockN = kBlockN / 2;

  using TileShape = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;    // S = Q K^T
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;  // O += P V
  using WarpgroupLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  // S = Q K^T: both operands in shared memory, K-major (head dim contiguous).
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShape>(), WarpgroupLayout{}));
  // The same on the first kHalfBlockN keys of a K stage (kHalvesFirstKeyBlock).
  using TileShapeHalf = cute::Shape<cute::Int<kBlockM>, cute::Int<kHalfBlockN>, cute::Int<kHeadDim>>;
  using TiledMmaQKHalf = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapeHalf>(), WarpgroupLayout{}));
  // S = Q K^T with Q from registers, copied once per tile from shared memory: a fifth less
  // shared-memory traffic per key block and 8 fewer instructions in the steady loop of head dim 64's
  // 128-row kernel (+1-2% causal at 1k-2k on the H200). At head dim 128 it measured +0.1 to +2.2%
  // causal (1k-16k) and -1% without a mask at 2k and 8k, so it is on in the causal kernel there
  // (kQInRegistersWhenCausal; head dim 96 takes 128's choices); the 192-row kernel (160 registers a
  // thread) spills with it; head dim 256's O leaves no room for it (192 keeps Q in shared memory
  // too, not measured). The half block's GEMM keeps Q in shared memory.
  static constexpr bool kQInRegisters = kConsumerWarpgroups == 2 && kHeadDim == 64;
  static constexpr bool kQInRegistersWhenCausal = kConsumerWarpgroups == 2 && kHeadDim <= 128;
  using TiledMmaQKRegisterQ = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileShape>(), WarpgroupLayout{}));
  // O += P V: P from registers; V is read as V^T, whose contiguous dim (head dim) is its N.
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileShapePV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupLayout{}));

  // Rows of 64 elements (128 bytes) swizzled across 8-row atoms: the canonical layout wgmma and
  // TMA agree on, free of bank conflicts. Head dims that are not a multiple of 64 (96) take atoms of
  // 32 elements (64 bytes), swizzled the same way over half the width.
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // The same V storage seen as V^T (head_dim, kBlockN, stage): the B operand of P V.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(
                          cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                          cute::Step<cute::_2, cute::_1, cute::_3>{})));

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;

  // O leaves through shared memory and a TMA store: in its own buffer where a tile of it fits beside
  // Q and the K/V stages (head dims 64 and 128), else, with one tile per CTA, in Q's buffer (head
  // dim 256): each consumer warpgroup writes its O rows over its own Q rows once its last S = Q K^T
  // has completed, and no later Q comes.
  static constexpr bool kOwnBufferO =
      (2 * kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element)) + 1024 <= 227 * 1024;
  static constexpr bool kTmaStoreO = kOwnBufferO || !kPersistent;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, kOwnBufferO ? cute::cosize_v<SmemLayoutQ> : 8> o;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> v;
    cutlass::arch::ClusterTransactionBarrier q_full;
    cutlass::arch::ClusterBarrier q_empty;  // the consumers are done with Q: the next tile's may load
    typename PipelineKV::SharedStorage pipeline_k;
    typename PipelineKV::SharedStorage pipeline_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one stage of K (or V)

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                  cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                            cute::select<0, 2>(TileShape{}), cute::_1{}));
  using GmemTensorOut = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}));
  using TmaO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutQ{},
                                            cute::select<0, 2>(TileShape{}), cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                             cute::take<0, 2>(SmemLayoutKV{}), cute::select<1, 2>(TileShape{}),
                                             cute::_1{}));
};

// Tile sizes per head dim: consumer warpgroups of 64 query rows each, which ping-pong
// (barriers.h, fwd_mainloop.h). Each choice was measured against its alternatives in one build on the H200
// (docs/PERFORMANCE.md). FwdTileSizes: two consumer warpgroups (128 query rows). At head dim 64, 4
// K/V stages with the ping-pong beat 2 stages without it (+0-10%) and key tiles of 192 (3-5% faster
// at 16k only, 10-12% slower at 1k); at 128, key tiles of 160 or 176 gained up to 3% at 16k and
// lost 6-20% at 1k; at 256, the persistent grid lost 5-10% without a mask. At 96, a third K/V stage
// measured 0 to -2%; at 192 (64-key tiles: two stages of 128 keys and O's buffer do not fit beside Q),
// the persistent grid 0-10% faster than one CTA per tile.
template <int kHeadDim>
struct FwdTileSizes;
template <> struct FwdTileSizes<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kStages = 4; static constexpr bool kPersistent = true; };
template <> struct FwdTileSizes<96>  { static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2; static constexpr bool kPersistent = true; };
template <> struct FwdTileSizes<128> { static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2; static constexpr bool kPersistent = true; };
template <> struct FwdTileSizes<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kStages = 2; static constexpr bool kPersistent = true; };
template <> struct FwdTileSizes<256> { static constexpr int kBlockM = 128, kBlockN = 64,  kStages = 2; static constexpr bool kPersistent = false; };

// Wide tiles: three consumer warpgroups (192 query rows) on 160 registers a thread, where S, P and
// O fit in them (head dim 64): 10-18% faster than FwdTileSizes from 1.5k keys without a mask and
// from 3k causal, but a causal tile of 192 rows straddles two or three key tiles of the diagonal,
// so short causal calls keep FwdTileSizes (fwd_launch.h). kAvailable: this head dim has them.
template <int kHeadDim>
struct FwdWideTileSizes { static constexpr bool kAvailable = false; };
template <> struct FwdWideTileSizes<64> { static constexpr bool kAvailable = true; static constexpr int kBlockM = 192, kBlockN = 128, kStages = 4; static constexpr bool kPersistent = true; };

template <int kHeadDim, class Element, class Sizes = FwdTileSizes<kHeadDim>>
using FwdTraitsFor = FwdKernelTraits<kHeadDim, Sizes::kBlockM, Sizes::kBlockN, Sizes::kStages, Sizes::kPersistent, Element>;

}  // namespace flash_cutlass::sm90

// The one place that picks the kernel of a call: its path (sm80 or Hopper), the compiled head
// dim it runs in, and the Hopper forward's tiles. csrc/flash_api.cpp asks it with the call's
// facts; the kernel a user asked for (kernel= or, for None, $FLASH_CUTLASS_FORWARD_KERNEL /
// $FLASH_CUTLASS_BACKWARD_KERNEL) arrives resolved in the options (flash_cutlass/options.py).
#pragma once

#include <string>

#include "flash_cutlass/dispatch.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The kernel a call asks for; the values are the positions in flash_cutlass.options.KERNELS.
enum class KernelChoice { kAuto = 0, kSm80 = 1, kSm90 = 2 };

struct KernelSelection {
  KernelPath path = KernelPath::kSm80;
  int kernel_hdim = 0;  // the compiled head dim that runs the call
  std::string error;    // why the call cannot run; empty when it can
  // The sm80 path's tile tier (FwdParams::sm80_tile_tier): set by the host from the device's limit
  // (csrc/flash_api.cpp, selected_kernel).
  int sm80_tile_tier = 0;
};

// The Hopper forward's tiles (sm90/tile_config.h): a head dim with wide tiles (FwdWideTileSizes)
// runs them in its kernels without runtime options (no window, no extension), except causal calls
// of up to kSm90CausalNarrowTilesMaxSeqlenQ query rows (max_seqlen_q in a variable-length call):
// at 2k the wide tiles compute 11% more of the masked diagonal and measured 12% slower, at
// 3k 7-10% faster (docs/PERFORMANCE.md).
inline constexpr int kSm90CausalNarrowTilesMaxSeqlenQ = 2048;

constexpr bool sm90_forward_has_wide_tiles(bool head_dim_has_wide_tiles, MaskKind mask, Extension extension) {
  return head_dim_has_wide_tiles && extension == Extension::kNone && mask != MaskKind::kLocal;
}

// A causal call of an instantiation that has them decides at run time (the others always run them).
constexpr bool sm90_causal_forward_uses_wide_tiles(int seqlen_q) {
  return seqlen_q > kSm90CausalNarrowTilesMaxSeqlenQ;
}

// Why the Hopper path cannot run a call of this direction and head dim on a GPU of compute
// capability major.minor, or an empty string when it can.
template <Direction kDirection>
std::string sm90_unavailable_reason(int head_dim, int major, int minor) {
  constexpr const char* kName = kDirection == Direction::kForward ? "forward" : "backward";
  if constexpr (!has_compiled_head_dims<kDirection, KernelPath::kSm90>()) {
    return std::string("the Hopper ") + kName +
           " was not built (it needs 90 in FLASH_CUTLASS_CUDA_ARCHS and FLASH_CUTLASS_SM90 not 0)";
  }
  if (major != 9 || minor != 0) {
    return "the Hopper path runs only on compute capability 9.0, and this GPU has " + std::to_string(major) + "." +
           std::to_string(minor);
  }
  if (kernel_head_dim<kDirection, KernelPath::kSm90>(head_dim) == 0) {
    return "head_dim " + std::to_string(head_dim) + " exceeds the Hopper " + kName + "'s compiled head dims";
  }

  return "";
}

// The kernel of a call: `head_dim` is the call's, rounded up to a multiple of 8. kAuto runs the
// Hopper path where it can and its head dim is the one the sm80 path would run (no extra
// padding); the sm80 path otherwise. kSm80 and kSm90 force a path (an error where the forced one
// cannot run).
template <Direction kDirection>
KernelSelection select_kernel(int head_dim, KernelChoice choice, int major, int minor) {
  KernelSelection selection;
  const int sm80_hdim = kernel_head_dim<kDirection, KernelPath::kSm80>(head_dim);
  if (choice != KernelChoice::kSm80) {
    const std::string reason = sm90_unavailable_reason<kDirection>(head_dim, major, minor);
    const int sm90_hdim = kernel_head_dim<kDirection, KernelPath::kSm90>(head_dim);
    if (choice == KernelChoice::kSm90 && !reason.empty()) {
      selection.error = std::string("kernel='sm90' cannot run this ") +
                        (kDirection == Direction::kForward ? "call" : "backward") + ": " + reason;
      return selection;
    }
    if (reason.empty() && (choice == KernelChoice::kSm90 || sm90_hdim == sm80_hdim)) {
      selection.path = KernelPath::kSm90;
      selection.kernel_hdim = sm90_hdim;
      return selection;
    }
  }
  selection.kernel_hdim = sm80_hdim;
  if (sm80_hdim == 0) {
    selection.error = "head_dim " + std::to_string(head_dim) +
                      " exceeds every compiled head dim (build flag FLASH_CUTLASS_HEAD_DIMS)";
  }
  return selection;
}

// The keys of one Hopper backward CTA's key block at a compiled head dim (sm90/bwd_tile_config.h,
// BwdTraitsFor; its launcher checks the two agree).
constexpr int sm90_backward_key_block(int kernel_hdim) { return kernel_hdim > 128 ? 64 : 128; }

// The share of `slots` SMs that `tiles` equal tiles, one a CTA, keep busy over their waves.
constexpr double sm90_backward_busy_share(int64_t tiles, int64_t slots) {
  const int64_t waves = (tiles + slots - 1) / slots;
  return waves == 0 ? 1.0 : double(tiles) / double(waves * slots);
}

// A GQA call on the Hopper backward: how many query heads of a K/V head's group one CTA's key tile
// walks (BwdParams::query_heads_per_key_tile), from the shapes and the SM count alone. A walk over
// the whole group keeps K and V loaded for all its heads and stores dK and dV once, in the inputs'
// dtype (no fp32 accumulators to zero, add to and convert); it divides the grid by the group, each
// tile taking that many times as long. The whole group when its tiles keep at least
// kSm90GqaWalkBusyShare of the SMs busy over their waves; else the divisor of the group whose tiles
// keep the most busy (the larger on a tie: fewer adds), a part of the group adding to the K/V head's
// accumulators. Deterministic calls take the whole group or one head a tile (parts add with
// atomics). key_blocks: of the longest sequence (sm90_backward_key_block).
inline constexpr double kSm90GqaWalkBusyShare = 0.9;

constexpr int sm90_backward_query_heads_per_key_tile(int64_t batch, int64_t heads, int64_t heads_k, int64_t key_blocks,
                                                     int64_t sms, bool deterministic) {
  if (heads_k <= 0 || heads % heads_k != 0 || heads == heads_k || sms <= 0) return 1;
  const int64_t group = heads / heads_k;
  const int64_t tiles_a_head = batch * key_blocks;
  if (sm90_backward_busy_share(tiles_a_head * heads_k, sms) >= kSm90GqaWalkBusyShare) return int(group);
  if (deterministic) return 1;
  int64_t best = 1;
  double best_share = 0.0;
  for (int64_t walk = group; walk >= 1; --walk) {
    if (group % walk != 0) continue;
    const double share = sm90_backward_busy_share(tiles_a_head * (heads / walk), sms);
    if (share > best_share) {
      best = walk;
      best_share = share;
    }
  }
  return int(best);
}
// 132 SMs, head dim 128 (128 keys a block): cuDNN's 64 / 8 heads at 4k walk whole groups (256
// tiles: 0.97 busy), batch 1 with 32 / 8 heads at 1k 2 heads a tile (128 tiles: 0.97; whole groups
// 64: 0.48), batch 4 with 16 / 2 heads at 2k whole groups (128 tiles); MHA one head.
static_assert(sm90_backward_query_heads_per_key_tile(1, 64, 8, 32, 132, false) == 8 &&
              sm90_backward_query_heads_per_key_tile(1, 32, 8, 8, 132, false) == 2 &&
              sm90_backward_query_heads_per_key_tile(1, 32, 8, 8, 132, true) == 1 &&
              sm90_backward_query_heads_per_key_tile(4, 16, 2, 16, 132, false) == 8 &&
              sm90_backward_query_heads_per_key_tile(16, 16, 16, 8, 132, false) == 1);

// Split-KV of a KV-cache call (sm80/kvcache_kernel.h) when the caller leaves it to us
// (num_splits=0): a pure function of the shapes and the GPU, so that a captured CUDA graph replays
// the same launch and the scratch is sized without reading any length. `tiles` CTAs without
// splitting ((batch, kv head, packed-row block) triples) fill `slots` = SMs x CTAs per SM; a call
// that fills at least kKVCacheFullWave of them runs unsplit. Otherwise the keys are split into as
// many parts as keep the CTAs within one wave of the slots, with at least kKVCacheMinKeysPerSplit
// keys each (two 16-key chunks for each of a CTA's 4 warps, four for each of the compact kernel's
// 2; H200, head dim 128, batch 1-4 at 1k-8k keys, page 16: 128 was the fastest or within 4% of it
// at every shape, 512 up to 1.6x slower), and at most kKVCacheMaxSplits. (Splitting until the CTAs
// filled the slots left a partial second wave: at 64 tiles on 264 slots, 5 splits ran 320 CTAs, 56
// of them in a second wave, where 4 run 256 in one.) Two refinements, measured at head dim 128, 32
// / 8 heads, page 16 (graph timing, forced split counts, us): caches of at most kKVCacheShortKeys
// run unsplit from kKVCacheShortWave of the slots, the split merge costing more than the second CTA
// an SM gains (batch 16 / 1k, 128 tiles: 22.2 unsplit, 24.2 in 2; batch 12, 96 tiles: 19.8 / 19.6);
// from kKVCacheLongKeys keys a call below kKVCacheFullWave splits in at least 2, as more CTAs than
// the slots stream faster than fewer than an SM each (batch 24, 192 tiles: 8k 227.5 -> 206.6 us,
// 32k 882.9 -> 806.1).
inline constexpr double kKVCacheFullWave = 0.8;
inline constexpr int kKVCacheMinKeysPerSplit = 128;
inline constexpr double kKVCacheShortWave = 0.45;
inline constexpr int64_t kKVCacheShortKeys = 1024;
inline constexpr int64_t kKVCacheLongKeys = 8192;

constexpr int kvcache_num_splits(int64_t tiles, int64_t max_keys, int64_t slots) {
  if (tiles <= 0 || slots <= 0 || double(tiles) >= kKVCacheFullWave * double(slots)) return 1;
  if (max_keys <= kKVCacheShortKeys && double(tiles) >= kKVCacheShortWave * double(slots)) return 1;
  int64_t splits = slots / tiles;
  if (max_keys >= kKVCacheLongKeys && splits < 2) splits = 2;
  const int64_t by_keys = max_keys / kKVCacheMinKeysPerSplit;
  if (splits > by_keys) splits = by_keys;
  if (splits > kKVCacheMaxSplits) splits = kKVCacheMaxSplits;
  return splits < 1 ? 1 : int(splits);
}
// 132 SMs x 2 CTAs: batch 8 x 8 kv heads at 32k keys splits in 4 (256 CTAs, one wave; 5 left a
// second wave of 56), batch 1 at 8k in 33, at 1k in 8 (by the keys), batch 32 not at all; batch 16
// at 1k not at all, at 8k in 2; batch 24 at 1k not at all, at 8k in 2.
static_assert(kvcache_num_splits(64, 32768, 264) == 4 && kvcache_num_splits(8, 8192, 264) == 33 &&
              kvcache_num_splits(8, 1024, 264) == 8 && kvcache_num_splits(256, 32768, 264) == 1);
static_assert(kvcache_num_splits(64, 1024, 264) == 4 && kvcache_num_splits(96, 1024, 264) == 2 &&
              kvcache_num_splits(128, 1024, 264) == 1 && kvcache_num_splits(128, 8192, 264) == 2 &&
              kvcache_num_splits(192, 1024, 264) == 1 && kvcache_num_splits(192, 8192, 264) == 2 &&
              kvcache_num_splits(192, 32768, 264) == 2 && kvcache_num_splits(212, 32768, 264) == 1);

// Chunked prefill: a KV-cache call that leaves the split to us runs the Hopper forward over its
// caches (csrc/flash_api.cpp, kvcache_forward) where the GPU, the head dim and the build's options
// allow, and the gathered keys and values take at most kKVCachePrefillMaxGatherBytes (batch x
// capacity positions: the lengths are not read on the host). The KV-cache kernel's CTAs take 16
// packed query rows and each reads its kv head's whole cache, so its time grows with batch x
// queries; the forward's few CTAs at batch 1 each walk the whole context. From
// kKVCachePrefillMinSeqlenQ queries the forward runs at any batch (512 queries on a 16k cache:
// 70-79 TFLOPS in the KV-cache kernel, 395-598 in the forward). Below it (H200, head dim 128,
// 32/8 heads, 4k and 16k keys, batch 1-16, graph timing): over a contiguous cache read in place
// the route ran 1.1-3.9x faster than the KV-cache kernel from 32 queries and batch x queries >=
// 128 (below, the forward alone took 1.2-2.5x the KV-cache kernel's time); a cache gathered first
// (pages, cache_batch_idx) adds a copy that grows with batch x capacity, not with the queries: at
// 32 queries the route ran 0.82-1.23x the KV-cache kernel's speed, at 64 queries and batch x
// queries >= 256 1.5-2.6x.
inline constexpr int kKVCachePrefillMinSeqlenQ = 128;
inline constexpr int kKVCachePrefillMinSeqlenQInPlace = 32;
inline constexpr int kKVCachePrefillMinSeqlenQGathered = 64;
inline constexpr int64_t kKVCachePrefillMinBatchQueriesInPlace = 128;
inline constexpr int64_t kKVCachePrefillMinBatchQueriesGathered = 256;
inline constexpr int64_t kKVCachePrefillMaxGatherBytes = int64_t(2) << 30;

constexpr bool kvcache_prefill_may_gather(int64_t batch, int64_t seqlen_q, int64_t capacity, int64_t gather_bytes,
                                          bool in_place, int64_t num_splits) {
  const bool batched = in_place ? seqlen_q >= kKVCachePrefillMinSeqlenQInPlace &&
                                      batch * seqlen_q >= kKVCachePrefillMinBatchQueriesInPlace
                                : seqlen_q >= kKVCachePrefillMinSeqlenQGathered &&
                                      batch * seqlen_q >= kKVCachePrefillMinBatchQueriesGathered;
  return num_splits == 0 && (seqlen_q >= kKVCachePrefillMinSeqlenQ || batched) && capacity > 0 &&
         gather_bytes <= kKVCachePrefillMaxGatherBytes;
}
static_assert(kvcache_prefill_may_gather(1, 128, 4096, 1, false, 0) && !kvcache_prefill_may_gather(1, 64, 4096, 1, true, 0) &&
              kvcache_prefill_may_gather(4, 32, 4096, 1, true, 0) && !kvcache_prefill_may_gather(16, 32, 4096, 1, false, 0) &&
              kvcache_prefill_may_gather(4, 64, 4096, 1, false, 0) && !kvcache_prefill_may_gather(2, 64, 4096, 1, false, 0) &&
              !kvcache_prefill_may_gather(16, 16, 4096, 1, true, 0) && !kvcache_prefill_may_gather(4, 64, 4096, 1, false, 1));

}  // namespace flash_cutlass

// Plain, torch-free description of one attention call. Filled by csrc/flash_api.cpp,
// read by the kernels. Strides are in elements and 64-bit so large tensors do not overflow.
#pragma once

#include <cstdint>

namespace flash_cutlass {

enum class DType { kFloat16, kBFloat16 };

// Which keys each query row sees (common/mask.h): every key, a causal mask, or a sliding window
// (with or without causal). Each kind is its own kernel instantiation, so the causal kernels carry
// no window logic; the extended instantiation (soft cap, ALiBi, dropout) uses kLocal, which expresses all three.
enum class MaskKind { kNone, kCausal, kLocal };

// The runtime options an instantiation carries: none (the kernels above), the score options (soft
// cap, ALiBi: common/score_mods.h), or those and dropout (common/dropout.h). The extended
// instantiations use MaskKind::kLocal; dropout has its own, so that calls without it do not pay
// for its registers.
enum class Extension { kNone, kScoreMods, kDropout };

// What an instantiation of `extension` carries: the score options in both extensions, dropout in
// kDropout's.
constexpr bool carries_score_mods(Extension extension) { return extension != Extension::kNone; }
constexpr bool carries_dropout(Extension extension) { return extension == Extension::kDropout; }

struct FwdParams {
  // Q: (batch, seqlen_q, heads, head_dim); K, V: (batch, seqlen_k, heads_k, head_dim);
  // out like Q. The last dimension is contiguous; every other stride is a multiple of 8
  // elements and every pointer 16-byte aligned (the host checks both).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  // fp32 (batch, heads, seqlen_q), contiguous; (heads, total_q) in a variable-length call.
  float* lse = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;

  int batch = 0;
  // The sequence lengths; in a variable-length call, the grid's (max_seqlen_q / max_seqlen_k, at
  // most the totals), which bound every sequence's lengths (common/block_info.h, sequence_rows).
  int seqlen_q = 0;
  int seqlen_k = 0;
  // A variable-length call: int32 (batch + 1) cumulative sequence lengths on the device; q, out
  // (and dout, dq) hold total_q packed rows, k and v (dk, dv) total_k, batch strides 0; the fp32
  // per-query buffers are (heads, total_q). nullptr: every sequence has seqlen_q / seqlen_k rows.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int64_t total_q = 0;
  int64_t total_k = 0;
  int heads = 0;
  int heads_k = 0;
  // The real head dim (a multiple of 8), at most the compiled kHeadDim the call dispatches to.
  int head_dim = 0;

  float softmax_scale = 0.f;
  // The factor the kernels multiply a score by before exp2: softmax_scale * log2(e), or with a soft
  // cap softcap * log2(e) (the capped score is softcap * tanh(q.k * softcap_input_scale)). The host
  // derives it once from the options (csrc/flash_api.cpp, set_scale_params).
  float exp2_scale = 0.f;
  MaskKind mask = MaskKind::kNone;
  // With MaskKind::kLocal, query row i sees keys [i + d - window_left, i + d + window_right],
  // d = seqlen_k - seqlen_q (see common/mask.h). Both sides are >= 0; an unbounded side is
  // max(seqlen_q, seqlen_k).
  int window_left = 0;
  int window_right = 0;
  // The options of the extended kernel instantiations (common/score_mods.h, common/dropout.h); a
  // call that sets any of them runs there (uses_extension below).
  // Soft cap: softcap > 0 and softcap_input_scale = softmax_scale / softcap. 0: none.
  float softcap = 0.f;
  float softcap_input_scale = 0.f;
  // ALiBi: fp32 slopes of (batch, head) at alibi_slopes[batch * alibi_slopes_batch_stride + head]
  // (batch stride 0 for one slope per head), times alibi_slope_scale = 1 / (softcap or
  // softmax_scale) into the kernels' score units. nullptr: none.
  const float* alibi_slopes = nullptr;
  int64_t alibi_slopes_batch_stride = 0;
  float alibi_slope_scale = 0.f;
  // Attention sinks: one fp32 logit a query head (natural units), folded into each row's softmax
  // when the row is finished (fold_sink, common/softmax.h); null: none.
  const float* sinks = nullptr;
  // Dropout (common/dropout.h): a probability is dropped when its Philox word is below
  // dropout_threshold = floor(p * 2^32) (0: no dropout), kept ones are scaled by
  // dropout_keep_scale = 1 / (1 - p); the words come from the call's Philox (seed, offset).
  uint32_t dropout_threshold = 0;
  float dropout_keep_scale = 1.f;
  // The Philox (seed, offset), resolved on the device (common/dropout.h, philox_seed_offset) with
  // the meaning of PyTorch's at::cuda::philox::unpack: without philox_seed_ptr, the values
  // philox_seed and philox_offset; with it, *philox_seed_ptr and *philox_offset_ptr +
  // philox_offset_intragraph, read from device memory: a forward drawing from a CUDA generator
  // under CUDA graph capture (the generator's seed and offset tensors, which each replay
  // refreshes), or a state kept on the device (the one a forward returned: offset_intragraph 0).
  uint64_t philox_seed = 0;
  uint64_t philox_offset = 0;
  const int64_t* philox_seed_ptr = nullptr;
  const int64_t* philox_offset_ptr = nullptr;
  uint64_t philox_offset_intragraph = 0;
  // A forward that drew its state from a generator: one thread writes the (seed, offset) it used
  // here (two int64 on the device), the state the backward reads back. nullptr: none.
  int64_t* philox_state_out = nullptr;
  // The Hopper forward of a variable-length call: device memory for one 128-byte TMA descriptor per
  // sequence (128-byte aligned), which its launcher fills (sm90/sequence_descriptors.h).
  void* sequence_descriptors = nullptr;
  // Keys and values in pages (a KV cache, KVCacheParams; and chunked prefill's variable-length
  // Hopper forward over a paged cache, sm90/fwd_producer.h): int32 (batch, max_blocks) page ids,
  // rows block_table_batch_stride apart; position p of sequence b at page
  // block_table[b][p / page_size], row p % page_size, ids clamped into [0, num_pages)
  // (common/kvcache.h). The forward then sees k and v as the pages' num_pages * page_size rows (batch
  // stride 0) and total_k as batch x the positions a sequence can hold, which bounds the cumulative
  // lengths. nullptr: no pages.
  const int* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int page_size = 1;
  int num_pages = 0;
  // The sm80 path's tiles: 0 the usual ones, 1 and 2 those for smaller shared memories
  // (sm80/kernel_traits.h FwdTraitsOfTier, sm80/bwd_kernel.h BwdTilesOf): the host takes the first
  // tier of the call's direction that the device's per-block limit holds (csrc/flash_api.cpp).
  int sm80_tile_tier = 0;
};
inline constexpr int kSm80TileTiers = 3;

// The Hopper forward reads paged keys and values a key block at a time, each block from one page
// (sm90/fwd_producer.h): it takes pages of a multiple of this many rows, its largest key block.
inline constexpr int kPagedKeyRows = 128;

// Whether a call sets any option of the extended instantiations: a soft cap, ALiBi or dropout.
inline bool uses_extension(FwdParams const& params) {
  return params.softcap > 0.f || params.alibi_slopes != nullptr || params.dropout_threshold != 0;
}

// One backward call: the forward's tensors (q, k, v, out, lse, scale, mask, shapes), dout, the
// gradients and the fp32 work buffers below.
struct BwdParams : FwdParams {
  const void* dout = nullptr;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  // D = rowsum(dout * out), fp32 (batch, heads, seqlen_q), contiguous; written by the preprocess.
  float* dsoftmax_sum = nullptr;
  // dQ before scaling, fp32 (batch, heads, seqlen_q, kernel head dim), contiguous; zeroed by the
  // preprocess, converted into dq by the postprocess.
  float* dq_accum = nullptr;
  // The gradients, in the inputs' dtype, shaped like q, k and v (head dims as the call's).
  void* dq = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  void* dk = nullptr;  // dk and dv: written directly when heads == heads_k
  void* dv = nullptr;
  int64_t dkv_batch_stride = 0, dkv_row_stride = 0, dkv_head_stride = 0;
  // With GQA (heads > heads_k): dK (unscaled) and dV in fp32, (batch, seqlen_k, dkv_accum_heads,
  // kernel head dim), contiguous. dkv_accum_heads = heads: one slice per query head, stored, which
  // the caller sums over each group in a fixed order (deterministic calls, the sm80 kernel);
  // = heads_k: one per K/V head, zeroed by the caller, which the query heads of its group add to
  // with atomics (the Hopper kernels).
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  int dkv_accum_heads = 0;
  // dQ summed in a fixed order instead of with atomics: bitwise reproducible. The sm80 path runs a
  // second kernel; the Hopper path adds each query block's dQ in key-block order, the turn kept in
  // dq_turns: int32 (batch, heads, ceil(seqlen_q / 64)), zeroed, counting the key blocks that
  // have added to that query block (64: the smallest block of rows a Hopper backward walks).
  bool deterministic = false;
  int* dq_turns = nullptr;
  // dQ's first store (Hopper path, fixed-length calls; csrc/flash_api.cpp decides where): the
  // preprocess leaves dq_accum unwritten and zeroes the counters of the query blocks instead
  // (dq_turns in a deterministic call, else dq_arrivals: int32 (batch, heads, ceil(seqlen_q /
  // dq_block_rows)), dq_block_rows the main kernel's kBlockM), which count the key blocks that
  // reach each block. The first to reach one (a
  // deterministic call's first turn) stores its dQ tile and the others add theirs once that store
  // has completed (sm90/ordered_reduce.h); the postprocess writes zeros for blocks none reached.
  bool dq_first_store = false;
  int* dq_arrivals = nullptr;
  int dq_block_rows = 0;
  // GQA on the Hopper path: the query heads one CTA's key tile walks (sm90/tile_scheduler.h), a
  // divisor of the group heads / heads_k. Its key block's K and V stay in shared memory while it
  // walks the query blocks of query heads [head, head + query_heads_per_key_tile), one head after
  // the other, dK and dV summed in registers. With the whole group the CTA writes its K/V head's dK
  // and dV into dk and dv; with a part of it, it adds them to the K/V head's fp32 accumulators. 1:
  // one query head a tile.
  int query_heads_per_key_tile = 1;
  // The Hopper kernels' one-tile-a-CTA walks load V after the walk's first Q and dO, so that the
  // first S^T (which needs K and Q) starts before V has landed; past head dim 128 warpgroup 0's
  // exponentials, P^T and dV too (sm90/bwd_producer.h, loads_v_after_first_query). false: K and V
  // together, first.
  bool v_after_first_query = false;
};

// One call of attention over a KV cache (flash_cutlass.flash_attention_with_kvcache): new keys
// appended in place at each sequence's cache length, then attention over the cache. The FwdParams
// part describes the attention: q (or its rotated copy), out and lse as in a forward; k and v are
// the caches, whose batch stride is the stride of one cache row (contiguous) or one page (paged);
// seqlen_q is q's; seqlen_k is the positions a sequence can hold (capacity below), the bound the
// window fields use for an unbounded side; the mask is always MaskKind::kLocal's form (the kernels
// mask every tile: they are memory-bound). Lengths and block ids come from device memory unchecked
// (no host synchronization): the kernels clamp them (common/kvcache.h), so that wrong ones give
// wrong results for the sequences concerned but no access outside the cache.
struct KVCacheParams : FwdParams {
  // The cache's pages: block_table, page_size and num_pages above (FwdParams). nullptr
  // block_table: a contiguous cache, sequence b in cache row cache_batch_idx[b] (or b without it) as
  // one page of page_size = seqlen_cache rows, num_pages the cache's rows.
  const int* cache_batch_idx = nullptr;
  // Positions one sequence can hold: max_blocks * page_size, or seqlen_cache.
  int capacity = 0;
  // The tokens already in each sequence's cache: int32 (batch,) on the device, or, for nullptr,
  // cache_seqlen for every sequence.
  const int* cache_seqlens = nullptr;
  int cache_seqlen = 0;
  // The new tokens (batch, seqlen_new, heads_k, head_dim), appended at cache_seqlens[b]; nullptr
  // (and seqlen_new 0) without them.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t k_new_batch_stride = 0, k_new_row_stride = 0, k_new_head_stride = 0;
  int64_t v_new_batch_stride = 0, v_new_row_stride = 0, v_new_head_stride = 0;
  int seqlen_new = 0;
  // Rotary embedding of the new keys and the queries: contiguous (rotary_positions, rotary_dim / 2)
  // cos and sin in the inputs' dtype; nullptr without. Query row i of sequence b turns at
  // cache_seqlens[b] + i with rotary_q_per_row, else at cache_seqlens[b]; q_source is the q to
  // rotate (strides as q's fields), params.q the contiguous buffer the rotated copy goes to.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int rotary_dim = 0;
  int rotary_positions = 0;
  bool rotary_interleaved = true;
  bool rotary_q_per_row = false;
  const void* q_source = nullptr;
  int64_t q_source_batch_stride = 0, q_source_row_stride = 0, q_source_head_stride = 0;
  // Split-KV: each (query-row block, batch, kv head) runs as num_splits CTAs over consecutive key
  // ranges. With more than one, they write fp32 partial outputs (num_splits, batch, heads, seqlen_q,
  // kernel head dim) to out_accum and their log-sum-exps (num_splits, batch, heads, seqlen_q) to
  // lse_accum, contiguous, and a second kernel merges them into out and lse.
  int num_splits = 1;
  float* out_accum = nullptr;
  float* lse_accum = nullptr;
  // What the append kernel writes: the caches (params.k and params.v as writable pointers) and,
  // with rotary, the rotated queries (params.q).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  void* q_rotated = nullptr;
  // The attention kernel runs right after this call's append in the stream (set by the host when
  // the append launched). Launched under it (programmatic dependent launch), it then reads the
  // lengths and the block table, which the append does not write, before it waits for the append's
  // grid. (A kernel of the caller's gives no such order: the attention kernel then waits first.)
  bool after_own_append = false;
  // The attention kernel appends the new tokens itself instead (set by the host where
  // kvcache_appends_in_tile allows it; the append kernel does not launch): each CTA writes the new
  // rows that fall in its split's key range, in every CTA of the rows' (batch, kv head) alike,
  // before its copies read them.
  bool append_in_tile = false;
};

// Where the KV-cache gather (sm80/kvcache_kernel.h, flash_kvcache_gather_sm80) packs each
// sequence's cache for the Hopper forward's variable-length call: keys and values as contiguous
// (rows, heads_k, head_dim) tensors of at least batch * capacity rows, the sequences one after the
// other, and int32 cumulative lengths (batch + 1 entries each) of the queries (b * seqlen_q) and
// the keys (the running sum of the sequences' lengths after the append); the paged form writes the
// lengths alone (k and v null); the in-place form 2 batch + 1 entries each
// (flash_kvcache_sequences_sm80).
struct KVCachePacked {
  // How the forward reads the cache: gathered into k and v; in place (a contiguous cache); or
  // through the block table (a paged cache, FwdParams::block_table), the lengths alone written.
  enum class Form { kGathered, kInPlace, kPaged };
  Form form = Form::kGathered;
  void* k = nullptr;
  void* v = nullptr;
  int* cu_seqlens_q = nullptr;
  int* cu_seqlens_k = nullptr;
};

// Cache positions one CTA of the KV-cache gather copies (per sequence and kv head).
inline constexpr int kKVCacheGatherRows = 64;

// Packed query rows one CTA of the KV-cache attention takes: one MMA tile high.
inline constexpr int kKVCacheTileRows = 16;

// At most this many splits of a KV-cache call's keys (num_splits; the split merge holds every
// split's log-sum-exp in registers).
inline constexpr int kKVCacheMaxSplits = 128;

// The KV-cache attention kernel appends a call's new tokens itself (KVCacheParams::append_in_tile)
// where its threads can hold them, 16 bytes of K or V each (four pieces a thread of 128, eight of
// 64): at most this many new elements of K per (sequence, kv head), seqlen_new * head_dim.
inline constexpr int kKVCacheTileAppendElems = 2048;

// Whether a call may append in the attention kernel: new tokens without rotary (whose queries the
// append kernel rotates), few enough (kKVCacheTileAppendElems), queries to attend (no kernel runs
// without), and every new position inside the last query's window (window_left as the kernels see
// it: unbounded sides already widened), so that some CTA's key range holds it and writes it.
inline bool kvcache_appends_in_tile(KVCacheParams const& params) {
  return params.seqlen_new > 0 && params.rotary_cos == nullptr && params.seqlen_q > 0 &&
         int64_t(params.seqlen_new) * params.head_dim <= kKVCacheTileAppendElems &&
         params.window_left >= params.seqlen_new - 1;
}

// Blocks of packed query rows of one (batch, kv head): seqlen_q times the query heads per kv head.
inline int64_t kvcache_row_blocks(KVCacheParams const& params) {
  const int64_t packed_rows = int64_t(params.seqlen_q) * (params.heads / params.heads_k);
  return (packed_rows + kKVCacheTileRows - 1) / kKVCacheTileRows;
}

}  // namespace flash_cutlass

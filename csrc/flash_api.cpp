// The one file that sees torch: reads the tensors and the options (flash_cutlass.options.
// AttentionOptions) handed over by flash_cutlass/backend.py, fills FwdParams / BwdParams, asks
// select.h for the kernel and launches it. User-facing argument errors are raised in Python first;
// the checks here keep a direct call from launching on bad memory.
#include <torch/extension.h>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flash_cutlass/common/per_device.h"
#include "flash_cutlass/dispatch.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/select.h"

namespace flash_cutlass {
namespace {

// Error messages put together as strings before TORCH_CHECK sees them: on the H200 test machine
// (torch 2.11.0+cu130, g++ 13.3) a TORCH_CHECK whose message streamed a number (c10::str's
// std::ostream formatting in this extension) crashed the interpreter with a segmentation fault
// instead of raising, while one message string went through untouched.
std::string message_part(const char* text) { return text; }
std::string message_part(const std::string& text) { return text; }
std::string message_part(int value) { return std::to_string(value); }
std::string message_part(long value) { return std::to_string(value); }
std::string message_part(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}
std::string message_part(at::ScalarType type) { return c10::toString(type); }
std::string message_part(const c10::Device& device) { return device.str(); }
std::string message_part(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

template <class... Parts>
std::string message(const Parts&... parts) {
  return (std::string() + ... + message_part(parts));
}

// TORCH_CHECK with a message of any of message_part's types, built only when the check fails.
#define FLASH_CHECK(condition, ...) TORCH_CHECK(condition, ::flash_cutlass::message(__VA_ARGS__))

constexpr int64_t kAlignElems = 8;  // 16 bytes of fp16/bf16: the width of every global copy

void check_operand(const at::Tensor& t, const char* name, int64_t rank) {
  FLASH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  FLASH_CHECK(t.dim() == rank, name, " must have ", rank, " dimensions, got ", t.dim());
  FLASH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
  for (int64_t d = 0; d + 1 < rank; ++d) {
    FLASH_CHECK(t.stride(d) % kAlignElems == 0 || t.size(d) <= 1, name, " stride ", d, " (", t.stride(d),
                 ") must be a multiple of 8 elements");
  }
  FLASH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  FLASH_CHECK(t.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16, got ", t.scalar_type());
  return DType::kBFloat16;
}

// t's device made current for the launches of one call (restored after, as c10's CUDAGuard does),
// with its primary context bound to this thread. PyTorch's autograd engine runs backward on
// threads of its own, and c10 skips cudaSetDevice where the thread's device number already
// matches, so such a thread may have no context yet; CUTLASS's TMA descriptor encoding (a driver
// call, made before any launch) then fails. cudaSetDevice binds it (CUDA 12+).
struct CallDevice {
  explicit CallDevice(const at::Tensor& t) : guard(t.device()) { C10_CUDA_CHECK(cudaSetDevice(t.get_device())); }
  c10::cuda::CUDAGuard guard;
};

// $FLASH_CUTLASS_SMEM_PER_BLOCK: bytes of shared memory a block may use, below the GPU's own limit,
// so that one GPU runs the kernels a GPU with less picks (101376: sm_86, sm_89 and sm_120; 166912:
// the A100); 0 where unset or empty. Read on every call, so that tests may set it between calls.
int emulated_smem_per_block() {
  constexpr const char* kVariable = "FLASH_CUTLASS_SMEM_PER_BLOCK";
  const char* value = std::getenv(kVariable);
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long bytes = std::strtol(value, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && bytes > 0 && bytes <= std::numeric_limits<int>::max(),
                    message(kVariable, " must be a positive number of bytes, got '", value, "'"));
  return static_cast<int>(bytes);
}

// Device `index`'s SM count, per-block shared memory limit and compute capability, queried once per
// device and process, so that a call's kernel selection, a decode step or a backward's walk rule asks
// the driver nothing (the kernels keep their own attributes per device: sm80/kvcache_launch.h).
KVCacheDevice kvcache_device(int index) {
  auto attribute = [index](cudaDeviceAttr which) {
    int value = 0;
    const cudaError_t status = cudaDeviceGetAttribute(&value, which, index);
    return status == cudaSuccess ? value : -int(status);
  };
  static PerDeviceValue sm_counts, smem_limits, majors, minors;
  const int sm_count = sm_counts.get(index, [&] { return attribute(cudaDevAttrMultiProcessorCount); });
  if (sm_count < 0) C10_CUDA_CHECK(cudaError_t(-sm_count));
  const int smem = smem_limits.get(index, [&] { return attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin); });
  if (smem < 0) C10_CUDA_CHECK(cudaError_t(-smem));
  const int emulated = emulated_smem_per_block();
  const int major = majors.get(index, [&] { return attribute(cudaDevAttrComputeCapabilityMajor); });
  if (major < 0) C10_CUDA_CHECK(cudaError_t(-major));
  const int minor = minors.get(index, [&] { return attribute(cudaDevAttrComputeCapabilityMinor); });
  if (minor < 0) C10_CUDA_CHECK(cudaError_t(-minor));
  const bool capped = emulated > 0 && emulated < smem;
  return {index, sm_count, capped ? emulated : smem, major, minor, capped};
}

// Refuses, before any launch, a kernel whose shared memory exceeds what q's GPU allows a block
// (smem_limit).
void check_smem(int smem_needed, int smem_limit, const char* direction, int64_t head_dim, int kernel_hdim,
                const at::Tensor& q) {
  FLASH_CHECK(smem_needed <= smem_limit, "head_dim ", head_dim, " runs in the head-dim-", kernel_hdim, " ", direction,
               " kernel, which needs ", smem_needed / 1024, " KiB of shared memory per block, but ", q.device(),
               " allows ", smem_limit / 1024, " KiB; this head dim is not supported on this GPU yet");
}

// A switch of the environment: "0" off, "1" on, unset or empty `otherwise`.
bool switched_on(const char* variable, bool otherwise = false) {
  const char* value = std::getenv(variable);
  const std::string text = value == nullptr ? "" : value;
  TORCH_CHECK_VALUE(text.empty() || text == "0" || text == "1",
                    message(variable, " must be 0 or 1, got '", text, "'"));
  return text.empty() ? otherwise : text == "1";
}

// The fields of flash_cutlass.options.AttentionOptions, read by name from the Python object.
struct AttentionOptions {
  double softmax_scale = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;
  double dropout_p = 0;
  std::optional<at::Tensor> rng_state;
  std::optional<at::Generator> generator;
  std::optional<at::Tensor> cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  KernelChoice kernel = KernelChoice::kAuto;
  bool deterministic = false;
  // Chunked prefill over a paged KV cache (kvcache_prefill_forward), not a Python option: a
  // variable-length call whose k and v are the cache's pages, (1, num_pages * page_size, heads_k,
  // head_dim), read through this block table (params.h, FwdParams::block_table); each sequence
  // holds up to paged_capacity positions.
  const int* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int page_size = 1;
  int num_pages = 0;
  int64_t paged_capacity = 0;

  bool is_varlen() const { return cu_seqlens_q.has_value() && cu_seqlens_q->defined(); }
};

template <class T>
T option(const pybind11::handle& options, const char* name) {
  return options.attr(name).cast<T>();
}

AttentionOptions options_from_python(const pybind11::handle& object) {
  AttentionOptions options;
  options.softmax_scale = option<double>(object, "softmax_scale");
  options.causal = option<bool>(object, "causal");
  options.window_left = option<int64_t>(object, "window_left");
  options.window_right = option<int64_t>(object, "window_right");
  options.softcap = option<double>(object, "softcap");
  options.alibi_slopes = option<std::optional<at::Tensor>>(object, "alibi_slopes");
  options.sinks = option<std::optional<at::Tensor>>(object, "sinks");
  options.dropout_p = option<double>(object, "dropout_p");
  options.rng_state = option<std::optional<at::Tensor>>(object, "rng_state");
  options.generator = option<std::optional<at::Generator>>(object, "generator");
  options.cu_seqlens_q = option<std::optional<at::Tensor>>(object, "cu_seqlens_q");
  options.cu_seqlens_k = option<std::optional<at::Tensor>>(object, "cu_seqlens_k");
  options.max_seqlen_q = option<int64_t>(object, "max_seqlen_q");
  options.max_seqlen_k = option<int64_t>(object, "max_seqlen_k");
  const std::string kernel = option<std::string>(object, "kernel");
  FLASH_CHECK(kernel == "auto" || kernel == "sm80" || kernel == "sm90",
              "options.kernel must be 'auto', 'sm80' or 'sm90', got '", kernel, "'");
  options.kernel = kernel == "sm80" ? KernelChoice::kSm80 : kernel == "sm90" ? KernelChoice::kSm90 : KernelChoice::kAuto;
  options.deterministic = option<bool>(object, "deterministic");
  return options;
}

// The checks both directions make of q, k, v, out and lse (as the forward returns them), and the
// sizes they describe.
struct AttentionShape {
  int64_t batch, seqlen_q, heads, head_dim, seqlen_k, heads_k;
  DType dtype;
};

AttentionShape check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, AttentionOptions const& options) {
  check_operand(q, "q", 4);
  check_operand(k, "k", 4);
  check_operand(v, "v", 4);
  check_operand(out, "out", 4);
  AttentionShape shape;
  shape.dtype = dtype_of(q);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &out}) {
    FLASH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v and out must share one dtype");
    FLASH_CHECK(t->device() == q.device(), "q, k, v and out must be on one device");
  }
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), head_dim = q.size(3);
  const int64_t seqlen_k = k.size(1), heads_k = k.size(2);
  FLASH_CHECK(k.size(0) == batch && v.size(0) == batch, "k and v must have q's batch size");
  FLASH_CHECK(v.size(1) == seqlen_k && v.size(2) == heads_k, "v must have k's seqlen and heads");
  FLASH_CHECK(k.size(3) == head_dim && v.size(3) == head_dim, "k and v must have q's head_dim");
  FLASH_CHECK(heads_k > 0 && heads % heads_k == 0, "heads (", heads, ") must be a multiple of heads_k (", heads_k, ")");
  FLASH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  FLASH_CHECK(head_dim % kAlignElems == 0 && head_dim > 0 && head_dim <= 256,
              "head_dim must be a multiple of 8 in [8, 256], got ", head_dim);
  FLASH_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat &&
                   lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == heads &&
                   lse.size(2) == seqlen_q,
               "lse must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device");
  FLASH_CHECK(std::isfinite(options.softmax_scale) && options.softmax_scale > 0,
              "softmax_scale must be finite and > 0");
  FLASH_CHECK(dtype_compiled(shape.dtype), "dtype ", q.scalar_type(),
               " was not compiled in (build flag FLASH_CUTLASS_DTYPES)");
  FLASH_CHECK(seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31), "sequence lengths must be < 2^31");
  shape.batch = batch;
  shape.seqlen_q = seqlen_q;
  shape.heads = heads;
  shape.head_dim = head_dim;
  shape.seqlen_k = seqlen_k;
  shape.heads_k = heads_k;
  return shape;
}

// A call's window as the kernels see it: causal and window_size = (window_left, window_right) as
// the Python API takes them (-1: unbounded; causal bounds the right side at 0). Row i sees keys
// from i + d - left to i + d + right (d = seqlen_k - seqlen_q): a side that reaches every key of
// every row (the left one key 0 when left >= seqlen_k - 1, the right one the last key when right
// >= seqlen_q - 1) counts as unbounded. Causal calls without a real left bound run the causal
// kernels, calls without any bound the unmasked ones, the rest the sliding-window kernels.
struct WindowReach {
  int64_t left, right;
  bool left_unbounded, right_unbounded;

  WindowReach(AttentionOptions const& options, int64_t seqlen_q, int64_t seqlen_k)
      : left(options.window_left),
        right(options.causal ? 0 : options.window_right),
        left_unbounded(left < 0 || left >= seqlen_k - 1),
        right_unbounded(right < 0 || right >= seqlen_q - 1) {}

  MaskKind mask_kind(bool causal) const {
    if (causal && left_unbounded) return MaskKind::kCausal;
    if (left_unbounded && right_unbounded) return MaskKind::kNone;
    return MaskKind::kLocal;
  }
};

// The mask of a call into params (WindowReach); an unbounded side is stored as max(seqlen_q,
// seqlen_k). The extended kernels (uses_extension: the options are set before) take every mask in
// the window's form.
void set_mask_params(FwdParams& params, AttentionOptions const& options) {
  FLASH_CHECK(options.window_left >= -1 && options.window_right >= -1, "window_size entries must be >= -1, got (",
               options.window_left, ", ", options.window_right, ")");
  const WindowReach reach(options, params.seqlen_q, params.seqlen_k);
  const int unbounded = std::max(params.seqlen_q, params.seqlen_k);
  params.window_left = reach.left_unbounded ? unbounded : static_cast<int>(reach.left);
  params.window_right = reach.right_unbounded ? unbounded : static_cast<int>(reach.right);
  params.mask = uses_extension(params) ? MaskKind::kLocal : reach.mask_kind(options.causal);
  FLASH_CHECK(uses_extension(params) || params.mask != MaskKind::kLocal || compiled::kWindow, "window_size ", "(",
               options.window_left, ", ", reach.right, ") needs the sliding-window kernels, which this build left "
               "out (FLASH_CUTLASS_WINDOW=0); rebuild with FLASH_CUTLASS_WINDOW=1");
}

// The extended kernels' options (include/flash_cutlass/common/score_mods.h, dropout.h) into
// params: the soft cap (softcap > 0: the kernels take tanh(q.k * softmax_scale /
// softcap) and exponentiate it times softcap; 0: none), ALiBi slopes (fp32, (heads,) or
// (batch, heads), on q's device; none: no ALiBi) and dropout's probability (dropout_p in [0, 1);
// its Philox state: set_philox_state), and the factor the kernels take before exp2 (exp2_scale).
// score_mods_built_in: the caller's kernels carry the soft cap and ALiBi whatever the build flags
// FLASH_CUTLASS_SOFTCAP and FLASH_CUTLASS_ALIBI say (the KV-cache kernel), so they are not checked.
void set_extended_params(FwdParams& params, AttentionOptions const& options, const at::Tensor& q,
                         bool score_mods_built_in = false) {
  const double softcap = options.softcap, dropout_p = options.dropout_p;
  const std::optional<at::Tensor>& alibi_slopes = options.alibi_slopes;
  FLASH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0, got ", softcap);
  params.exp2_scale = static_cast<float>((softcap > 0 ? softcap : options.softmax_scale) * M_LOG2E);
  if (softcap > 0) {
    FLASH_CHECK(score_mods_built_in || compiled::kSoftcap, "softcap=", softcap,
                 " needs the soft cap of the extended kernels, which this build left out (FLASH_CUTLASS_SOFTCAP=0); "
                 "rebuild with FLASH_CUTLASS_SOFTCAP=1");
    params.softcap = static_cast<float>(softcap);
    params.softcap_input_scale = static_cast<float>(params.softmax_scale / softcap);
  }
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const at::Tensor& slopes = *alibi_slopes;
    FLASH_CHECK(score_mods_built_in || compiled::kAlibi,
                 "alibi_slopes needs ALiBi in the extended kernels, which this build left out (FLASH_CUTLASS_ALIBI=0); "
                 "rebuild with FLASH_CUTLASS_ALIBI=1");
    FLASH_CHECK(slopes.scalar_type() == at::kFloat, "alibi_slopes must be float32, got ", slopes.scalar_type());
    FLASH_CHECK(slopes.device() == q.device(), "alibi_slopes must be on q's device ", q.device());
    const bool per_head = slopes.dim() == 1 && slopes.size(0) == params.heads;
    const bool per_batch_head = slopes.dim() == 2 && slopes.size(0) == params.batch && slopes.size(1) == params.heads;
    FLASH_CHECK(per_head || per_batch_head, "alibi_slopes must have shape (heads,) = (", params.heads,
                 ",) or (batch, heads) = (", params.batch, ", ", params.heads, "), got ", slopes.sizes());
    FLASH_CHECK(slopes.stride(-1) == 1 || params.heads == 1, "alibi_slopes must have a contiguous last dimension");
    params.alibi_slopes = slopes.data_ptr<float>();
    params.alibi_slopes_batch_stride = per_batch_head ? slopes.stride(0) : 0;
    params.alibi_slope_scale = static_cast<float>(1.0 / (softcap > 0 ? softcap : params.softmax_scale));
  }
  // Attention sinks: every forward kernel folds them in when it finishes a row (the backward's
  // kernels read the forward's lse, which holds them).
  if (options.sinks.has_value() && options.sinks->defined()) {
    const at::Tensor& sinks = *options.sinks;
    FLASH_CHECK(sinks.scalar_type() == at::kFloat, "sinks must reach the extension as float32, got ",
                 sinks.scalar_type());
    FLASH_CHECK(sinks.device() == q.device(), "sinks must be on q's device ", q.device());
    FLASH_CHECK(sinks.dim() == 1 && sinks.size(0) == params.heads && sinks.is_contiguous(),
                 "sinks must be contiguous of shape (heads,) = (", params.heads, ",), got ", sinks.sizes());
    params.sinks = sinks.data_ptr<float>();
  }
  FLASH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p > 0) {
    FLASH_CHECK(compiled::kDropout,
                 "dropout_p needs dropout in the extended kernels, which this build left out (FLASH_CUTLASS_DROPOUT=0); "
                 "rebuild with FLASH_CUTLASS_DROPOUT=1");
    // floor(p * 2^32) <= 2^32 - 1 for p < 1; a p below 2^-32 drops nothing (as in the reference).
    params.dropout_threshold = static_cast<uint32_t>(std::floor(dropout_p * 4294967296.0));
    params.dropout_keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  }
}

// The Philox offset a call drawing its mask takes from a CUDA generator: the mask uses the one
// stream offset / 4 (common/dropout.h), and PyTorch's CUDA generators advance in multiples of 4
// (flash_cutlass/options.py's _PHILOX_OFFSET_STEP, for its draws on the host, is the same).
constexpr uint64_t kPhiloxOffsetStep = 4;

// The Philox (seed, offset) of a call with dropout into params (params.h). With options.rng_state,
// an int64 (seed, offset) of 2 elements: on the CPU, its values; on q's device (a state a forward
// returned), pointers the kernels read it through. Without one (a forward that draws its mask:
// drawn_rng_state given), the CUDA generator (options.generator, or the default generator of q's
// device), as PyTorch's own dropout takes it: under the generator's lock, philox_cuda_state, which
// advances the generator's offset and, under CUDA graph capture, gives pointers to the seed and
// offset that each replay refreshes plus this call's offset within the graph; the forward kernel
// then writes the (seed, offset) it used into drawn_rng_state (int64, 2 elements on q's device),
// the state the backward takes. So the call needs no host synchronization and can be captured.
void set_philox_state(FwdParams& params, AttentionOptions const& options, const at::Tensor& q,
                      const std::optional<at::Tensor>& drawn_rng_state) {
  if (params.dropout_threshold == 0) return;
  if (options.rng_state.has_value() && options.rng_state->defined()) {
    const at::Tensor& state = *options.rng_state;
    FLASH_CHECK(state.scalar_type() == at::kLong && state.dim() == 1 && state.size(0) == 2 &&
                     (state.device().is_cpu() || state.device() == q.device()),
                 "rng_state must be an int64 tensor of 2 elements (seed, offset) on the CPU or on q's device ",
                 q.device());
    if (state.device().is_cpu()) {
      const auto values = state.accessor<int64_t, 1>();
      params.philox_seed = static_cast<uint64_t>(values[0]);
      params.philox_offset = static_cast<uint64_t>(values[1]);
    } else {
      params.philox_seed_ptr = state.data_ptr<int64_t>();
      params.philox_offset_ptr = state.data_ptr<int64_t>() + state.stride(0);
    }
    return;
  }
  FLASH_CHECK(drawn_rng_state.has_value() && drawn_rng_state->defined(),
               "dropout_p > 0 needs rng_state, the one the forward returned");
  const at::Tensor& drawn = *drawn_rng_state;
  FLASH_CHECK(drawn.device() == q.device() && drawn.scalar_type() == at::kLong && drawn.is_contiguous() &&
                   drawn.numel() == 2,
               "the forward's rng_state output must be a contiguous int64 tensor of 2 elements on q's device");
  const bool given = options.generator.has_value() && options.generator->defined();
  const at::Generator generator =
      given ? *options.generator : at::cuda::detail::getDefaultCUDAGenerator(q.get_device());
  const c10::Device generator_device = generator.device();
  FLASH_CHECK(generator_device.is_cuda() && (!generator_device.has_index() || generator_device == q.device()),
               "generator must be a CUDA generator on q's device ", q.device(), ", got one on ", generator_device);
  at::CUDAGeneratorImpl* impl = at::check_generator<at::CUDAGeneratorImpl>(generator);
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(impl->mutex_);
    state = impl->philox_cuda_state(kPhiloxOffsetStep);
  }
  if (state.captured_) {
    params.philox_seed_ptr = state.seed_.ptr;
    params.philox_offset_ptr = state.offset_.ptr;
    params.philox_offset_intragraph = static_cast<uint64_t>(state.offset_intragraph_);
  } else {
    params.philox_seed = state.seed_.val;
    params.philox_offset = state.offset_.val;
  }
  params.philox_state_out = drawn.data_ptr<int64_t>();
}

// A variable-length call: int32 cumulative sequence lengths (batch + 1 entries each, on q's device)
// and max_seqlen_q / max_seqlen_k, which size the grid (capped at the token counts: no sequence is
// longer). The packed (total, heads, head_dim) tensors come as (1, total, heads, head_dim) views,
// lse as (1, heads, total_q). Nothing here reads the lengths (no synchronization): the kernels clamp
// each sequence's rows to the packed tensors and its lengths to the grid's
// (include/flash_cutlass/common/block_info.h, sequence_rows), so that lengths that do not start at
// 0, decrease, pass the totals or exceed max_seqlen give wrong results but never an access outside
// the tensors; flash_cutlass/backend.py checks them where asked to. Turns params set for the
// (1, total, ...) views into a variable-length call's.
void set_varlen_params(FwdParams& params, AttentionOptions const& options, const at::Tensor& q) {
  FLASH_CHECK(options.cu_seqlens_k.has_value() && options.cu_seqlens_k->defined(),
               "cu_seqlens_q and cu_seqlens_k go together");
  const at::Tensor& cu_q = *options.cu_seqlens_q;
  const at::Tensor& cu_k = *options.cu_seqlens_k;
  for (const at::Tensor* cu : {&cu_q, &cu_k}) {
    FLASH_CHECK(cu->scalar_type() == at::kInt && cu->device() == q.device() && cu->dim() == 1 && cu->is_contiguous(),
                 "cu_seqlens_q and cu_seqlens_k must be contiguous 1-D int32 tensors on q's device");
  }
  FLASH_CHECK(cu_q.numel() == cu_k.numel() && cu_q.numel() >= 1,
               "cu_seqlens_q and cu_seqlens_k must have the same number (batch + 1 >= 1) of entries");
  FLASH_CHECK(params.batch == 1, "a variable-length call takes (1, total, heads, head_dim) views");
  FLASH_CHECK(options.max_seqlen_q >= 0 && options.max_seqlen_k >= 0 && options.max_seqlen_q < (int64_t(1) << 31) &&
                   options.max_seqlen_k < (int64_t(1) << 31),
               "max_seqlen_q and max_seqlen_k must be in [0, 2^31)");
  params.cu_seqlens_q = cu_q.data_ptr<int>();
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.total_q = params.seqlen_q;
  params.total_k = params.seqlen_k;
  params.batch = static_cast<int>(cu_q.numel() - 1);
  params.seqlen_q = static_cast<int>(std::min(options.max_seqlen_q, params.total_q));
  params.seqlen_k = static_cast<int>(std::min(options.max_seqlen_k, params.total_k));
  params.q_batch_stride = params.k_batch_stride = params.v_batch_stride = params.out_batch_stride = 0;
}

// Writes the pointers and (batch, row, head) strides of k and v (or of a KV cache) into params.
void set_key_value_params(FwdParams& params, const at::Tensor& k, const at::Tensor& v) {
  params.k = k.data_ptr();
  params.v = v.data_ptr();
  params.k_batch_stride = k.stride(0);
  params.k_row_stride = k.stride(1);
  params.k_head_stride = k.stride(2);
  params.v_batch_stride = v.stride(0);
  params.v_row_stride = v.stride(1);
  params.v_head_stride = v.stride(2);
}

// Writes the pointers, strides, sizes, scale, mask and extended options of q, k, v, out and lse into
// params.
void set_attention_params(FwdParams& params, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, AttentionShape const& shape,
                          AttentionOptions const& options) {
  params.q = q.data_ptr();
  set_key_value_params(params, k, v);
  params.out = out.data_ptr();
  params.lse = lse.data_ptr<float>();
  params.q_batch_stride = q.stride(0);
  params.q_row_stride = q.stride(1);
  params.q_head_stride = q.stride(2);
  params.out_batch_stride = out.stride(0);
  params.out_row_stride = out.stride(1);
  params.out_head_stride = out.stride(2);
  params.batch = static_cast<int>(shape.batch);
  params.seqlen_q = static_cast<int>(shape.seqlen_q);
  params.seqlen_k = static_cast<int>(shape.seqlen_k);
  params.heads = static_cast<int>(shape.heads);
  params.heads_k = static_cast<int>(shape.heads_k);
  params.head_dim = static_cast<int>(shape.head_dim);
  params.softmax_scale = static_cast<float>(options.softmax_scale);
  if (options.is_varlen()) set_varlen_params(params, options, q);
  if (options.block_table != nullptr) {
    // The cumulative lengths count positions of up to paged_capacity per sequence, not k's rows.
    FLASH_CHECK(options.is_varlen() && int64_t(params.batch) * options.paged_capacity < (int64_t(1) << 31),
                "a paged forward is a variable-length call of fewer than 2^31 positions");
    params.block_table = options.block_table;
    params.block_table_batch_stride = options.block_table_batch_stride;
    params.page_size = options.page_size;
    params.num_pages = options.num_pages;
    params.total_k = int64_t(params.batch) * options.paged_capacity;
    params.seqlen_k = static_cast<int>(std::min(options.max_seqlen_k, options.paged_capacity));
  }
  set_extended_params(params, options, q);
  set_mask_params(params, options);
}

// select.h's kernel for this call on q's GPU; raises its error.
template <Direction kDirection>
KernelSelection selected_kernel(AttentionShape const& shape, AttentionOptions const& options, const at::Tensor& q) {
  const KVCacheDevice device = kvcache_device(q.get_device());
  KernelSelection selection =
      select_kernel<kDirection>(static_cast<int>(shape.head_dim), options.kernel, device.major, device.minor);
  FLASH_CHECK(selection.error.empty(), selection.error);
  if (selection.path == KernelPath::kSm80) {
    const int hdim = selection.kernel_hdim;
    const bool runs_sm90a = device.major == 9 && device.minor == 0;  // this build's sm_90a code, if any
    // Only a forced kernel="sm80" reaches these (compiled_head_dims.h, sm80_kernel_on_hopper).
    FLASH_CHECK(!runs_sm90a || sm80_kernel_on_hopper<kDirection>(hdim), "kernel='sm80' at head dim ", hdim, " on ",
                q.device(), " (the argument, or FLASH_CUTLASS_",
                kDirection == Direction::kForward ? "FORWARD" : "BACKWARD", "_KERNEL): this build leaves the sm80 path's ",
                kDirection == Direction::kForward ? "forward" : "backward",
                " at the Hopper path's head dims out of its sm_90a code, which Hopper GPUs run (the automatic choice "
                "takes the Hopper path there); rebuild with FLASH_CUTLASS_SM80_ON_HOPPER=1");
    // The first tier of tiles, the usual ones first, whose shared memory the GPU allows a block.
    int needed = 0;  // of the smallest tier, where none fits
    for (int tier = 0; tier < kSm80TileTiers; ++tier) {
      const int bytes = sm80::smem_bytes(kDirection, hdim, tier);
      if (bytes == 0) continue;
      needed = bytes;
      selection.sm80_tile_tier = tier;
      if (bytes <= device.smem_per_block) break;
    }
    check_smem(needed, device.smem_per_block, kDirection == Direction::kForward ? "forward" : "backward",
               shape.head_dim, hdim, q);
    // The sm_90a code holds the backward's usual tiles only, unless built with
    // FLASH_CUTLASS_SM90_SMALL_TILES=1 (sm80/bwd_kernel.h, compiles_tiles_here).
    FLASH_CHECK(kDirection == Direction::kForward || selection.sm80_tile_tier == 0 || !runs_sm90a ||
                    compiled::kSm80SmallTilesOnHopper,
                "the sm80 backward at head dim ", hdim, " needs its smaller tiles on ", q.device(), ", which allows ",
                device.smem_per_block / 1024, " KiB of shared memory a block",
                device.smem_capped ? " (FLASH_CUTLASS_SMEM_PER_BLOCK)" : "",
                "; this build leaves them out of its sm_90a code: rebuild with FLASH_CUTLASS_SM90_SMALL_TILES=1");
  }
  return selection;
}

// The forward into preallocated out (like q) and lse (fp32 (batch, heads, seqlen_q)). A call with
// dropout and without options.rng_state draws its mask and writes the (seed, offset) it used into
// drawn_rng_state (set_philox_state).
void run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                 const std::optional<at::Tensor>& drawn_rng_state, AttentionOptions const& options) {
  const AttentionShape shape = check_attention(q, k, v, out, lse, options);
  if (shape.batch == 0 || shape.seqlen_q == 0 || shape.heads == 0) {
    if (drawn_rng_state.has_value() && drawn_rng_state->defined()) drawn_rng_state->zero_();  // no mask to draw
    return;
  }
  FLASH_CHECK(shape.seqlen_k > 0, "seqlen_k == 0 is handled by the caller");
  FwdParams params;
  set_attention_params(params, q, k, v, out, lse, shape, options);
  FLASH_CHECK(params.seqlen_q > 0 && params.seqlen_k > 0 && params.batch > 0,
               "a variable-length call without queries or keys is handled by the caller");
  const KernelSelection kernel = selected_kernel<Direction::kForward>(shape, options, q);
  params.sm80_tile_tier = kernel.sm80_tile_tier;
  const CallDevice call_device(q);
  // Last before the launch (a call that fails a check draws nothing), on q's device (a capture is
  // per device and stream).
  set_philox_state(params, options, q, drawn_rng_state);
  // The Hopper forward of a packed batch takes V through a TMA descriptor per sequence, which its
  // launcher writes here (sm90/sequence_descriptors.h); the stream orders the buffer's reuse.
  at::Tensor sequence_descriptors;
  if (options.is_varlen() && kernel.path == KernelPath::kSm90) {
    sequence_descriptors = at::empty({int64_t(params.batch) * 128}, q.options().dtype(at::kByte));
    params.sequence_descriptors = sequence_descriptors.data_ptr();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const cudaError_t status =
      kernel.path == KernelPath::kSm90
          ? run_kernel<Direction::kForward, KernelPath::kSm90>(params, shape.dtype, kernel.kernel_hdim, stream)
          : run_kernel<Direction::kForward, KernelPath::kSm80>(params, shape.dtype, kernel.kernel_hdim, stream);
  FLASH_CHECK(status == cudaSuccess, "flash_cutlass forward kernel launch failed: ", cudaGetErrorString(status));
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             const std::optional<at::Tensor>& drawn_rng_state, const pybind11::handle& options_object) {
  run_forward(q, k, v, out, lse, drawn_rng_state, options_from_python(options_object));
}

// $FLASH_CUTLASS_GQA_WALK_HEADS: how many query heads of a K/V head's group one Hopper backward CTA
// walks in a GQA call (BwdParams::query_heads_per_key_tile). Unset or empty: select.h's rule in
// calls without a mask where walks_by_default says so, one head a tile in the others; "auto":
// select.h's rule in every call; a number: that many, a divisor of the group, and in a
// deterministic call 1 or the whole group. Calls without GQA, with a soft cap, ALiBi or dropout, or
// on the sm80 kernel take one head a tile whatever it says (its form is checked in every call that
// launches).
constexpr const char* kGqaWalkHeadsEnv = "FLASH_CUTLASS_GQA_WALK_HEADS";
// Whole-group walks against one head a tile, 64 / 8 heads without a mask, backward TFLOPS at 4k /
// 16k (2026-12-05): head dim 128 1.12 / 1.01x (H200), deterministic 1.10 / 1.01x (H100); 96 1.05 /
// 1.00x, 64 1.05 / 0.98x and 192 0.99 / 0.99x (H100); 256 walks by default since its tests passed
// (1.03 / 0.99x, H100, 2026-12-06). Deterministic, against one head a tile with fp32 dK/dV per query
// head summed after the kernel (H100, 2026-12-06): 64 1.09 / 1.01x, 96 1.08 / 1.01x, 192 1.06 /
// 0.99x, 256 1.07 / 0.98x. Causal walks were slower wherever timed: whole groups at 128 0.77 /
// 0.89x (H200), deterministic 0.69-0.80x at 64-256 (H100), launched key block major 0.80 / 0.81x at
// 128 and 0.51 / 0.51x at 256 (H100), parts of a group 0.93-0.98x (docs/PERFORMANCE.md, What was
// tried).
bool walks_by_default(int kernel_hdim, bool deterministic) {
  if (deterministic) return true;
  return kernel_hdim == 96 || kernel_hdim == 128 || kernel_hdim == 256;
}

int gqa_walk_heads(BwdParams const& params, KernelSelection const& kernel, bool deterministic, const at::Tensor& q) {
  const char* value = std::getenv(kGqaWalkHeadsEnv);
  const std::string text = value == nullptr ? "" : value;
  int walk = 1;
  if (!text.empty() && text != "auto") {
    size_t parsed = 0;
    try {
      walk = std::stoi(text, &parsed);
    } catch (const std::exception&) {
      parsed = 0;
    }
    TORCH_CHECK_VALUE(parsed == text.size() && walk >= 1, message(kGqaWalkHeadsEnv, " must be 'auto' or a positive "
                                                                  "number of query heads, got '", text, "'"));
  }
  const int group = params.heads / params.heads_k;
  if (group == 1 || uses_extension(params) || kernel.path != KernelPath::kSm90) return 1;
  if (text.empty() && (params.mask != MaskKind::kNone || !walks_by_default(kernel.kernel_hdim, deterministic))) {
    return 1;
  }
  if (text.empty() || text == "auto") {
    const int sms = kvcache_device(q.get_device()).sm_count;
    const int key_block = sm90_backward_key_block(kernel.kernel_hdim);
    return sm90_backward_query_heads_per_key_tile(params.batch, params.heads, params.heads_k,
                                                  (params.seqlen_k + key_block - 1) / key_block, sms, deterministic);
  }
  TORCH_CHECK_VALUE(group % walk == 0, message(kGqaWalkHeadsEnv, " = ", walk, " must divide the ", group,
                                               " query heads of a K/V head (heads / heads_k) in this call"));
  TORCH_CHECK_VALUE(!deterministic || walk == 1 || walk == group,
                    message(kGqaWalkHeadsEnv, " = ", walk, ": a deterministic call walks 1 or all ", group,
                            " query heads of a K/V head (a part of the group adds dK and dV with atomics)"));
  return walk;
}

// $FLASH_CUTLASS_BWD_DQ_FIRST_STORE: dQ's first store, "1" on, "0" off, unset where
// dq_first_store_by_default says so. In the Hopper backward of fixed-length calls without a soft cap,
// ALiBi or dropout, the first key block to reach a query block (in a deterministic call the first
// turn) stores its dQ and the others add to it once that store has completed, so that the preprocess
// need not zero dq_accum (BwdParams::dq_first_store).
constexpr const char* kDqFirstStoreEnv = "FLASH_CUTLASS_BWD_DQ_FIRST_STORE";
// Against dq_accum zeroed, backward TFLOPS at 1k / 4k / 16k tokens, hidden 2048 (H100, 2026-12-05):
// head dim 64 1.03 / 1.01 / 0.99x without a mask, 1.06 / 1.03 / 1.02x causal; 128 1.04 / 1.03 / 1.02x
// and 1.06 / 1.03 / 1.04x; 192 0.96 / 1.04 / 0.99x and 1.01 / 0.99 / 0.88x, 256 1.00 / 1.02 / 0.93x
// and 1.04 / 0.96 / 0.94x (docs/PERFORMANCE.md names the suspects: the dQ warp's arrival atomic a
// block, and causal neighbours reaching a block before its store completed); deterministic at 256
// 1.06 / 1.01x without a mask (its turns wait anyway).
bool dq_first_store_by_default(int kernel_hdim, bool deterministic) {
  return deterministic || kernel_hdim <= 128;
}

// $FLASH_CUTLASS_BWD_V_AFTER_Q=1: the Hopper backward loads V after its walk's first Q and dO
// (BwdParams::v_after_first_query). Unset or 0: with K, first, as before (not yet measured on a GPU).
constexpr const char* kVAfterQueryEnv = "FLASH_CUTLASS_BWD_V_AFTER_Q";

// $FLASH_CUTLASS_KVCACHE_TILE_APPEND: "0" keeps the append kernel in every KV-cache call with new
// tokens; unset or "1": the attention kernel appends them itself where kvcache_appends_in_tile
// allows (KVCacheParams::append_in_tile).
constexpr const char* kKVCacheTileAppendEnv = "FLASH_CUTLASS_KVCACHE_TILE_APPEND";

// The backward into preallocated dq, dk and dv (the inputs' dtype, shaped like q, k and v, last
// dimension contiguous). D = rowsum(dout * out) and the fp32 dQ accumulator are computed on the
// device; D goes into dsoftmax_sum where the caller passes one (fp32, contiguous, laid out as lse:
// the sinks' gradient reads it), zeroed where no kernel runs. With GQA, dK and dV come in fp32: per K/V head, the group's query heads adding with
// atomics (the Hopper kernels), or per query head, summed over each group here in a fixed order
// (deterministic calls, the sm80 kernel). A Hopper call whose CTAs walk a whole group's query heads
// (gqa_walk_heads) writes dk and dv directly.
void backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv, const pybind11::handle& options_object,
              const std::optional<at::Tensor>& dsoftmax_sum_out) {
  FLASH_CHECK(compiled::kBackward,
               "the backward needs its kernels, which this build left out (FLASH_CUTLASS_BACKWARD=0); rebuild with "
               "FLASH_CUTLASS_BACKWARD=1");
  const AttentionOptions options = options_from_python(options_object);
  const AttentionShape shape = check_attention(q, k, v, out, lse, options);
  check_operand(dout, "dout", 4);
  check_operand(dq, "dq", 4);
  check_operand(dk, "dk", 4);
  check_operand(dv, "dv", 4);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&dout, &dq, &dk, &dv}) {
    FLASH_CHECK(t->scalar_type() == q.scalar_type(), "dout, dq, dk and dv must have q's dtype");
    FLASH_CHECK(t->device() == q.device(), "dout, dq, dk and dv must be on q's device");
  }
  FLASH_CHECK(dout.sizes() == q.sizes() && dq.sizes() == q.sizes(), "dout and dq must have q's shape");
  FLASH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == k.sizes(), "dk and dv must have k's shape");
  const int64_t batch = shape.batch, seqlen_q = shape.seqlen_q, heads = shape.heads, head_dim = shape.head_dim;
  const int64_t seqlen_k = shape.seqlen_k, heads_k = shape.heads_k;
  const auto fp32 = q.options().dtype(at::kFloat);
  at::Tensor dsoftmax_sum;
  if (dsoftmax_sum_out.has_value() && dsoftmax_sum_out->defined()) {
    dsoftmax_sum = *dsoftmax_sum_out;
    FLASH_CHECK(dsoftmax_sum.scalar_type() == at::kFloat && dsoftmax_sum.device() == q.device() &&
                    dsoftmax_sum.is_contiguous() && dsoftmax_sum.sizes() == lse.sizes(),
                "dsoftmax_sum must be a contiguous float32 tensor on q's device shaped like lse ", lse.sizes(),
                ", got ", dsoftmax_sum.scalar_type(), " ", dsoftmax_sum.sizes());
  }
  if (batch == 0 || seqlen_q == 0 || seqlen_k == 0 || heads == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (dsoftmax_sum.defined()) dsoftmax_sum.zero_();
    return;
  }
  const KernelSelection kernel = selected_kernel<Direction::kBackward>(shape, options, q);
  const int accum_hdim = kernel.kernel_hdim;

  if (!dsoftmax_sum.defined()) dsoftmax_sum = at::empty({batch, heads, seqlen_q}, fp32);

  BwdParams params;
  set_attention_params(params, q, k, v, out, lse, shape, options);
  set_philox_state(params, options, q, std::nullopt);
  if (params.batch == 0 || params.seqlen_q == 0 || params.seqlen_k == 0) {  // a variable-length call without work
    dq.zero_();
    dk.zero_();
    dv.zero_();
    dsoftmax_sum.zero_();
    return;
  }
  at::Tensor dq_accum = at::empty({batch, heads, seqlen_q, accum_hdim}, fp32);
  const int query_heads_per_key_tile = gqa_walk_heads(params, kernel, options.deterministic, q);
  params.query_heads_per_key_tile = query_heads_per_key_tile;
  params.sm80_tile_tier = kernel.sm80_tile_tier;
  params.v_after_first_query = switched_on(kVAfterQueryEnv) && kernel.path == KernelPath::kSm90;
  // dK and dV go straight into dk and dv without GQA and where a Hopper CTA walks a whole group.
  // Otherwise the Hopper kernels add a group's (or a part's) to per-K/V-head fp32 accumulators
  // with atomics; deterministic calls and the sm80 kernel store them per query head, summed below.
  const bool grouped = heads != heads_k && query_heads_per_key_tile != heads / heads_k;
  const bool per_query_head = options.deterministic || kernel.path != KernelPath::kSm90;
  const int64_t dkv_accum_heads = per_query_head ? heads : heads_k;
  at::Tensor dk_accum, dv_accum;
  if (grouped) {
    if (per_query_head) {
      dk_accum = at::empty({batch, seqlen_k, heads, accum_hdim}, fp32);
      dv_accum = at::empty({batch, seqlen_k, heads, accum_hdim}, fp32);
    } else {
      dk_accum = at::zeros({batch, seqlen_k, heads_k, accum_hdim}, fp32);
      dv_accum = at::zeros({batch, seqlen_k, heads_k, accum_hdim}, fp32);
    }
  }
  params.dout = dout.data_ptr();
  params.dout_batch_stride = dout.stride(0);
  params.dout_row_stride = dout.stride(1);
  params.dout_head_stride = dout.stride(2);
  params.dsoftmax_sum = dsoftmax_sum.data_ptr<float>();
  params.dq_accum = dq_accum.data_ptr<float>();
  params.dq = dq.data_ptr();
  params.dq_batch_stride = dq.stride(0);
  params.dq_row_stride = dq.stride(1);
  params.dq_head_stride = dq.stride(2);
  if (grouped) {
    params.dk_accum = dk_accum.data_ptr<float>();
    params.dv_accum = dv_accum.data_ptr<float>();
    params.dkv_accum_heads = int(dkv_accum_heads);
  } else {
    FLASH_CHECK(dk.strides() == dv.strides(), "dk and dv must have the same strides");
    params.dk = dk.data_ptr();
    params.dv = dv.data_ptr();
    params.dkv_batch_stride = dk.stride(0);
    params.dkv_row_stride = dk.stride(1);
    params.dkv_head_stride = dk.stride(2);
  }
  params.deterministic = options.deterministic;
  // Not in the soft-cap, ALiBi and dropout kernels, whose walks all start at block 0.
  const bool first_store = switched_on(kDqFirstStoreEnv,
                                       dq_first_store_by_default(kernel.kernel_hdim, options.deterministic));
  params.dq_first_store = first_store && kernel.path == KernelPath::kSm90 && !options.is_varlen() &&
                          !uses_extension(params);
  // Counters per query block of at least 64 rows (the Hopper kernels' smallest): zeroed here, or
  // with dQ's first store by the preprocess.
  const int64_t block_counters = int64_t(params.batch) * params.heads * ((params.seqlen_q + 63) / 64);
  const auto counters = [&] {
    const auto int32 = q.options().dtype(at::kInt);
    return params.dq_first_store ? at::empty({block_counters}, int32) : at::zeros({block_counters}, int32);
  };
  at::Tensor dq_turns, dq_arrivals;
  if (options.deterministic && kernel.path == KernelPath::kSm90) {
    dq_turns = counters();
    params.dq_turns = dq_turns.data_ptr<int>();
  } else if (params.dq_first_store) {
    dq_arrivals = counters();
    params.dq_arrivals = dq_arrivals.data_ptr<int>();
  }
  if (options.is_varlen()) params.dout_batch_stride = params.dq_batch_stride = params.dkv_batch_stride = 0;

  const CallDevice call_device(q);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const cudaError_t status =
      kernel.path == KernelPath::kSm90
          ? run_kernel<Direction::kBackward, KernelPath::kSm90>(params, shape.dtype, kernel.kernel_hdim, stream)
          : run_kernel<Direction::kBackward, KernelPath::kSm80>(params, shape.dtype, kernel.kernel_hdim, stream);
  FLASH_CHECK(status == cudaSuccess, "flash_cutlass backward kernel launch failed: ", cudaGetErrorString(status));
  if (grouped) {
    // Per K/V head already, or each group's query heads summed in a fixed order.
    const int64_t group = heads / heads_k;
    auto per_kv_head = [&](const at::Tensor& accum) {
      const at::Tensor summed = per_query_head
                                    ? accum.view({batch, seqlen_k, heads_k, group, accum_hdim}).sum(3)
                                    : accum;
      return summed.narrow(3, 0, head_dim);
    };
    dk.copy_(per_kv_head(dk_accum).mul_(options.softmax_scale));
    dv.copy_(per_kv_head(dv_accum));
  }
}

// Checks an optional int32 tensor of a KV-cache call (`rank` dimensions, contiguous, on q's
// device) and returns its data, or nullptr when absent.
const int* kvcache_indices(const std::optional<at::Tensor>& t, const char* name, int64_t rank, const at::Tensor& q) {
  if (!t.has_value() || !t->defined()) return nullptr;
  FLASH_CHECK(t->scalar_type() == at::kInt && t->device() == q.device() && t->dim() == rank && t->is_contiguous(),
              name, " must be a contiguous int32 tensor of ", rank, " dimensions on q's device");
  return t->data_ptr<int>();
}

// How chunked prefill's forward reads the cache (KVCachePacked::Form): a contiguous cache in place
// where its rows are the sequences (no cache_batch_idx, rows capacity positions apart) and ALiBi's
// slopes are not per sequence (kvcache_prefill_forward's in-place numbering interleaves sequences
// of no queries); a paged cache through its block table in a causal call without a window or
// score options (the paged forward kernel's) where its pages are of a multiple of kPagedKeyRows
// rows, each page's rows one after the other; otherwise gathered.
using PrefillForm = KVCachePacked::Form;

PrefillForm kvcache_prefill_form(KVCacheParams const& params, AttentionOptions const& options,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const bool alibi = options.alibi_slopes.has_value() && options.alibi_slopes->defined();
  if (params.block_table != nullptr) {
    const bool causal_only = options.causal && options.softcap == 0 && !alibi &&
                             WindowReach(options, params.seqlen_q, params.capacity).mask_kind(true) == MaskKind::kCausal;
    const bool rows_in_pages = k_cache.stride(0) == params.page_size * k_cache.stride(1) &&
                               v_cache.stride(0) == params.page_size * v_cache.stride(1);
    const bool positions_fit = int64_t(params.num_pages) * params.page_size < (int64_t(1) << 31) &&
                               int64_t(params.batch) * params.capacity < (int64_t(1) << 31);
    return causal_only && params.page_size % kPagedKeyRows == 0 && rows_in_pages && positions_fit
               ? PrefillForm::kPaged
               : PrefillForm::kGathered;
  }
  const bool alibi_per_sequence = alibi && options.alibi_slopes->dim() == 2;
  const bool in_place = params.cache_batch_idx == nullptr && !alibi_per_sequence &&
                        k_cache.stride(0) == params.capacity * k_cache.stride(1) &&
                        v_cache.stride(0) == params.capacity * v_cache.stride(1);
  return in_place ? PrefillForm::kInPlace : PrefillForm::kGathered;
}

// Whether a KV-cache call runs as chunked prefill through the Hopper forward (select.h,
// kvcache_prefill_may_gather): the shapes allow it, the Hopper forward runs the head dim on this
// GPU without padding, and the build holds the forward kernels of the call's mask and score options
// (set_mask_params and set_extended_params decide them as below).
bool kvcache_prefill_runs_forward(KVCacheParams const& params, AttentionOptions const& options, const at::Tensor& q,
                                  PrefillForm form, int64_t num_splits) {
  // A paged cache read through its table takes the gathered form's thresholds (measured with the
  // copy, which it saves).
  const int64_t gather_bytes =
      form == PrefillForm::kGathered
          ? 2 * int64_t(params.batch) * params.capacity * params.heads_k * params.head_dim * q.element_size()
          : 0;
  if (!kvcache_prefill_may_gather(params.batch, params.seqlen_q, params.capacity, gather_bytes,
                                  form == PrefillForm::kInPlace, num_splits)) {
    return false;
  }
  if (params.batch > 65535 || params.heads_k > 65535) return false;  // the gather's grid
  const KVCacheDevice device = kvcache_device(q.get_device());
  const KernelSelection kernel =
      select_kernel<Direction::kForward>(params.head_dim, KernelChoice::kAuto, device.major, device.minor);
  if (!kernel.error.empty() || kernel.path != KernelPath::kSm90) return false;
  const bool alibi = options.alibi_slopes.has_value() && options.alibi_slopes->defined();
  if (options.softcap > 0 || alibi) return (options.softcap == 0 || compiled::kSoftcap) && (!alibi || compiled::kAlibi);
  return compiled::kWindow ||
         WindowReach(options, params.seqlen_q, params.capacity).mask_kind(options.causal) != MaskKind::kLocal;
}

// What chunked prefill's forward reads: keys and values as (1, rows, heads_k, head_dim) and the
// cumulative lengths, (2, sequences + 1). In place, the contiguous cache's batch x capacity rows,
// each sequence followed by a sequence of no queries holding the rest of its row
// (flash_kvcache_sequences_sm80); paged, the cache's num_pages x page_size rows and the sequences'
// lengths (flash_kvcache_gather_sm80 without the copy); gathered, packed keys and values of
// batch x capacity rows (flash_kvcache_gather_sm80; no length is read on the host).
struct PrefillGather {
  at::Tensor k, v, cu_seqlens;
  PrefillForm form = PrefillForm::kGathered;
};

// The forward's operands, or none where the GPU's memory cannot hold the gather's copy: the
// KV-cache kernel then runs the call, as it did before the route (a server that filled the memory
// with its caches keeps working).
std::optional<PrefillGather> prefill_gather_buffers(KVCacheParams const& params, PrefillForm form,
                                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                    const at::Tensor& q) {
  const int64_t rows = form == PrefillForm::kPaged ? int64_t(params.num_pages) * params.page_size
                                                   : int64_t(params.batch) * params.capacity;
  PrefillGather gather;
  gather.form = form;
  try {
    if (form == PrefillForm::kGathered) {
      gather.k = at::empty({1, rows, params.heads_k, params.head_dim}, q.options());
      gather.v = at::empty_like(gather.k);
    } else {
      gather.k = k_cache.view({1, rows, params.heads_k, params.head_dim});
      gather.v = v_cache.view({1, rows, params.heads_k, params.head_dim});
    }
    const int64_t sequences = form == PrefillForm::kInPlace ? 2 * int64_t(params.batch) : params.batch;
    gather.cu_seqlens = at::empty({2, sequences + 1}, q.options().dtype(at::kInt));
    return gather;
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
}

// Chunked prefill through the Hopper forward, after the append: every sequence's cache gathered
// into gather's packed keys and values (or its lengths alone, in place and paged), then the
// variable-length forward of q (queries_used: q, or its rotated copy) over them; out and lse
// (batch, heads, seqlen_q) as the KV-cache kernel writes them.
void kvcache_prefill_forward(KVCacheParams const& params, PrefillGather const& gather, const at::Tensor& queries_used,
                             at::Tensor& out, at::Tensor& lse, AttentionOptions options, DType dtype,
                             cudaStream_t stream) {
  const int64_t batch = params.batch, seqlen_q = params.seqlen_q, heads = params.heads;
  const int64_t head_dim = params.head_dim;
  const at::Tensor& cu_seqlens = gather.cu_seqlens;
  const bool copies = gather.form == PrefillForm::kGathered;
  const KVCachePacked packed{gather.form, copies ? gather.k.data_ptr() : nullptr,
                             copies ? gather.v.data_ptr() : nullptr, cu_seqlens.data_ptr<int>(),
                             cu_seqlens.data_ptr<int>() + cu_seqlens.size(1)};
  const cudaError_t status = run_kvcache_gather_kernel(params, packed, dtype, stream);
  FLASH_CHECK(status == cudaSuccess, "flash_cutlass KV-cache gather launch failed: ", cudaGetErrorString(status));
  if (gather.form == PrefillForm::kPaged) {
    options.block_table = params.block_table;
    options.block_table_batch_stride = params.block_table_batch_stride;
    options.page_size = params.page_size;
    options.num_pages = params.num_pages;
    options.paged_capacity = params.capacity;
  }
  options.cu_seqlens_q = cu_seqlens[0];
  options.cu_seqlens_k = cu_seqlens[1];
  options.max_seqlen_q = seqlen_q;
  options.max_seqlen_k = params.capacity;
  options.kernel = KernelChoice::kSm90;
  const at::Tensor packed_q = queries_used.reshape({1, batch * seqlen_q, heads, head_dim});
  at::Tensor packed_out = out.is_contiguous() ? out.view({1, batch * seqlen_q, heads, head_dim})
                                              : at::empty({1, batch * seqlen_q, heads, head_dim}, out.options());
  at::Tensor packed_lse = at::empty({1, heads, batch * seqlen_q}, lse.options());
  run_forward(packed_q, gather.k, gather.v, packed_out, packed_lse, std::nullopt, options);
  if (!out.is_contiguous()) out.copy_(packed_out.view(out.sizes()));
  lse.copy_(packed_lse.view({heads, batch, seqlen_q}).permute({1, 0, 2}));
}

// Attention over a KV cache (flash_cutlass/kvcache.py, which checked every argument with
// flash_cutlass.reference.check_kvcache_arguments): the append of k and v (rotated with rotary)
// at cache_seqlens, then the attention of q (rotated with rotary) over each sequence's cache into
// preallocated out (like q) and lse (fp32 (batch, heads, seqlen_q)). Reads no device value on the
// host: the kernels clamp lengths and page ids (include/flash_cutlass/common/kvcache.h), and the
// split scratch is sized from the shapes, so CUDA graphs can capture the call.
void kvcache_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& cache_seqlens, int64_t cache_seqlen,
                     const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cache_batch_idx,
                     const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
                     bool rotary_interleaved, bool rotary_q_per_row, at::Tensor& out, at::Tensor& lse,
                     int64_t num_splits, const pybind11::handle& options_object) {
  FLASH_CHECK(compiled::kKVCache,
              "flash_attention_with_kvcache needs the KV-cache kernels, which this build left out "
              "(FLASH_CUTLASS_KVCACHE=0); rebuild with FLASH_CUTLASS_KVCACHE=1");
  const AttentionOptions options = options_from_python(options_object);
  check_operand(q, "q", 4);
  check_operand(k_cache, "k_cache", 4);
  check_operand(v_cache, "v_cache", 4);
  check_operand(out, "out", 4);
  const DType dtype = dtype_of(q);
  FLASH_CHECK(dtype_compiled(dtype), "dtype ", q.scalar_type(), " was not compiled in (build flag FLASH_CUTLASS_DTYPES)");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &out}) {
    FLASH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                "k_cache, v_cache and out must have q's dtype and device");
  }
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), head_dim = q.size(3);
  const int64_t heads_k = k_cache.size(2);
  FLASH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape");
  FLASH_CHECK(k_cache.size(3) == head_dim, "k_cache must have q's head_dim");
  FLASH_CHECK(heads_k > 0 && heads % heads_k == 0, "heads (", heads, ") must be a multiple of heads_k (", heads_k, ")");
  FLASH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  FLASH_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == heads && lse.size(2) == seqlen_q,
              "lse must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device");
  const int kernel_hdim = head_dim % kAlignElems == 0 ? kvcache_kernel_head_dim(static_cast<int>(head_dim)) : 0;
  FLASH_CHECK(kernel_hdim != 0, "head_dim ", head_dim, " needs a multiple of 8 up to the largest compiled KV-cache head dim");
  FLASH_CHECK(std::isfinite(options.softmax_scale) && options.softmax_scale > 0, "softmax_scale must be finite and > 0");
  FLASH_CHECK(options.dropout_p == 0, "flash_attention_with_kvcache has no dropout");
  if (batch == 0 || (seqlen_q == 0 && !k.has_value())) return;

  KVCacheParams params;
  params.batch = static_cast<int>(batch);
  params.seqlen_q = static_cast<int>(seqlen_q);
  params.heads = static_cast<int>(heads);
  params.heads_k = static_cast<int>(heads_k);
  params.head_dim = static_cast<int>(head_dim);
  params.softmax_scale = static_cast<float>(options.softmax_scale);
  // The KV-cache kernel takes the soft cap and ALiBi at run time in its one instantiation.
  set_extended_params(params, options, q, /*score_mods_built_in=*/true);

  // The cache: pages of a block table, or one page per cache row.
  params.block_table = kvcache_indices(block_table, "block_table", 2, q);
  params.cache_batch_idx = kvcache_indices(cache_batch_idx, "cache_batch_idx", 1, q);
  params.num_pages = static_cast<int>(k_cache.size(0));
  params.page_size = static_cast<int>(k_cache.size(1));
  int64_t capacity = k_cache.size(1);
  if (params.block_table != nullptr) {
    FLASH_CHECK(block_table->size(0) == batch, "block_table must have batch rows");
    FLASH_CHECK(params.page_size >= 1, "a paged cache needs page_size (k_cache.shape[1]) >= 1");
    capacity = block_table->size(1) * k_cache.size(1);
    params.block_table_batch_stride = block_table->stride(0);
    FLASH_CHECK(params.cache_batch_idx == nullptr, "cache_batch_idx is for a contiguous cache");
  } else {
    FLASH_CHECK(params.cache_batch_idx != nullptr || k_cache.size(0) == batch,
                "k_cache must have q's batch without cache_batch_idx");
    FLASH_CHECK(params.cache_batch_idx == nullptr || cache_batch_idx->size(0) == batch,
                "cache_batch_idx must have batch entries");
    params.page_size = std::max<int>(params.page_size, 1);
  }
  FLASH_CHECK(params.num_pages >= 1 || capacity == 0, "k_cache must hold at least one page or row");
  FLASH_CHECK(capacity < (int64_t(1) << 30) && seqlen_q < (int64_t(1) << 30),
              "the cache's positions and seqlen_q must be below 2^30");
  params.capacity = static_cast<int>(capacity);
  params.seqlen_k = params.capacity;
  set_key_value_params(params, k_cache, v_cache);
  params.k_cache = k_cache.data_ptr();
  params.v_cache = v_cache.data_ptr();
  params.cache_seqlens = kvcache_indices(cache_seqlens, "cache_seqlens", 1, q);
  FLASH_CHECK(params.cache_seqlens == nullptr || cache_seqlens->size(0) == batch, "cache_seqlens must have batch entries");
  params.cache_seqlen = static_cast<int>(std::min<int64_t>(std::max<int64_t>(cache_seqlen, 0), capacity));

  // The new tokens.
  FLASH_CHECK(k.has_value() == v.has_value(), "k and v go together");
  if (k.has_value()) {
    check_operand(*k, "k", 4);
    check_operand(*v, "v", 4);
    FLASH_CHECK(k->scalar_type() == q.scalar_type() && v->scalar_type() == q.scalar_type() &&
                    k->device() == q.device() && v->device() == q.device(),
                "k and v must have q's dtype and device");
    FLASH_CHECK(k->size(0) == batch && k->size(2) == heads_k && k->size(3) == head_dim && v->sizes() == k->sizes(),
                "k and v must be (batch, seqlen_new, heads_k, head_dim)");
    FLASH_CHECK(k->size(1) <= capacity, "seqlen_new must fit in the cache");
    params.seqlen_new = static_cast<int>(k->size(1));
    params.k_new = k->data_ptr();
    params.v_new = v->data_ptr();
    params.k_new_batch_stride = k->stride(0);
    params.k_new_row_stride = k->stride(1);
    params.k_new_head_stride = k->stride(2);
    params.v_new_batch_stride = v->stride(0);
    params.v_new_row_stride = v->stride(1);
    params.v_new_head_stride = v->stride(2);
  }

  // Queries, rotated into a buffer with rotary.
  params.q = q.data_ptr();
  params.q_batch_stride = q.stride(0);
  params.q_row_stride = q.stride(1);
  params.q_head_stride = q.stride(2);
  at::Tensor q_rotated;
  FLASH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(), "rotary_cos and rotary_sin go together");
  if (rotary_cos.has_value()) {
    FLASH_CHECK(k.has_value(), "rotary needs k and v");
    for (const at::Tensor* t : {&*rotary_cos, &*rotary_sin}) {
      FLASH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device() && t->dim() == 2 &&
                      t->is_contiguous() && t->size(0) >= 1 && t->size(1) >= 1 && 2 * t->size(1) <= head_dim &&
                      t->sizes() == rotary_cos->sizes(),
                  "rotary_cos and rotary_sin must be contiguous (seqlen_ro, rotary_dim / 2) tensors of q's dtype on "
                  "q's device, rotary_dim <= head_dim");
    }
    q_rotated = at::empty(q.sizes(), q.options());
    params.rotary_cos = rotary_cos->data_ptr();
    params.rotary_sin = rotary_sin->data_ptr();
    params.rotary_dim = static_cast<int>(2 * rotary_cos->size(1));
    params.rotary_positions = static_cast<int>(std::min<int64_t>(rotary_cos->size(0), int64_t(1) << 30));
    params.rotary_interleaved = rotary_interleaved;
    params.rotary_q_per_row = rotary_q_per_row;
    params.q_source = q.data_ptr();
    params.q_source_batch_stride = q.stride(0);
    params.q_source_row_stride = q.stride(1);
    params.q_source_head_stride = q.stride(2);
    params.q = params.q_rotated = q_rotated.data_ptr();
    params.q_batch_stride = q_rotated.stride(0);
    params.q_row_stride = q_rotated.stride(1);
    params.q_head_stride = q_rotated.stride(2);
  }
  params.out = out.data_ptr();
  params.out_batch_stride = out.stride(0);
  params.out_row_stride = out.stride(1);
  params.out_head_stride = out.stride(2);
  params.lse = lse.data_ptr<float>();

  // The mask in the window's form for every call (the kernels take it at run time): -1 and a side
  // that causal bounds become their bounds; unbounded sides reach past every key.
  const int unbounded = std::max(params.seqlen_q, params.capacity);
  FLASH_CHECK(options.window_left >= -1 && options.window_right >= -1, "window_size entries must be >= -1");
  params.mask = MaskKind::kLocal;
  params.window_left = options.window_left < 0 ? unbounded : static_cast<int>(std::min<int64_t>(options.window_left, unbounded));
  params.window_right = options.causal ? 0
                        : options.window_right < 0 ? unbounded
                                                   : static_cast<int>(std::min<int64_t>(options.window_right, unbounded));

  const CallDevice call_device(q);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  // Whether the append launched (with queries to attend, a call with new tokens or rotary launches it).
  auto append = [&] {
    if (params.seqlen_new == 0 && params.rotary_cos == nullptr) return false;
    const cudaError_t status = run_kvcache_append_kernel(params, dtype, stream);
    FLASH_CHECK(status == cudaSuccess, "flash_cutlass KV-cache append launch failed: ", cudaGetErrorString(status));
    return true;
  };
  const PrefillForm prefill_form = kvcache_prefill_form(params, options, k_cache, v_cache);
  const std::optional<PrefillGather> gather =
      kvcache_prefill_runs_forward(params, options, q, prefill_form, num_splits)
          ? prefill_gather_buffers(params, prefill_form, k_cache, v_cache, q)
          : std::nullopt;
  if (gather.has_value()) {
    append();
    kvcache_prefill_forward(params, *gather, q_rotated.defined() ? q_rotated : q, out, lse, options, dtype, stream);
    return;
  }
  const KVCacheDevice device = kvcache_device(q.get_device());
  const int smem_needed = kvcache_smem_bytes(kernel_hdim, device);
  FLASH_CHECK(smem_needed <= device.smem_per_block, "head_dim ", head_dim, " runs in the head-dim-", kernel_hdim,
              " KV-cache kernel, which needs ", smem_needed / 1024, " KiB of shared memory per block even at its "
              "shallowest pipeline, but ", q.device(), " allows ", device.smem_per_block / 1024,
              " KiB per block (cudaDevAttrMaxSharedMemoryPerBlockOptin; the KV-cache kernels fit 99 KiB, what "
              "sm86, sm89 and sm120 GPUs allow)");
  const int64_t row_blocks = kvcache_row_blocks(params);
  FLASH_CHECK(row_blocks <= 65535, "seqlen_q times heads / heads_k must be at most ", 65535 * kKVCacheTileRows,
              " in a KV-cache call");
  FLASH_CHECK(num_splits >= 0 && num_splits <= kKVCacheMaxSplits, "num_splits must be in [0, ", kKVCacheMaxSplits, "]");
  params.num_splits = num_splits > 0 ? static_cast<int>(num_splits)
                                     : kvcache_num_splits(batch * heads_k * row_blocks, capacity,
                                                          int64_t(device.sm_count) *
                                                              std::max(kvcache_ctas_per_sm(dtype, kernel_hdim, device), 1));
  at::Tensor out_accum, lse_accum;
  if (params.num_splits > 1) {
    const auto fp32 = q.options().dtype(at::kFloat);
    out_accum = at::empty({params.num_splits, batch, heads, seqlen_q, kernel_hdim}, fp32);
    lse_accum = at::empty({params.num_splits, batch, heads, seqlen_q}, fp32);
    params.out_accum = out_accum.data_ptr<float>();
    params.lse_accum = lse_accum.data_ptr<float>();
  }

  params.append_in_tile = kvcache_appends_in_tile(params) && switched_on(kKVCacheTileAppendEnv, true);
  params.after_own_append = !params.append_in_tile && append();
  if (seqlen_q == 0) return;
  const cudaError_t status = run_kvcache_kernel(params, dtype, kernel_hdim, device, stream);
  FLASH_CHECK(status == cudaSuccess, "flash_cutlass KV-cache kernel launch failed: ", cudaGetErrorString(status));
}

// The Hopper forward's developer timeline of head dim `head_dim`'s kernels on the current device
// (FLASH_CUTLASS_TIMELINE=1, sm90/timeline.h): int64 (FwdTimeline::kCtas, kSteps, kWarpgroups,
// kEvents), the clock64 stamps the calls since the last read left (0 where none wrote); reading
// clears it.
at::Tensor forward_timeline(int64_t head_dim) {
  const int kernel_hdim = head_dim > 0 && head_dim <= 256
                              ? kernel_head_dim<Direction::kForward, KernelPath::kSm90>(static_cast<int>(head_dim))
                              : 0;
  FLASH_CHECK(kernel_hdim != 0, "head_dim ", head_dim, " has no Hopper-path forward kernel in this build");
  FLASH_CHECK(compiled::kTimeline, "forward_timeline needs a build with FLASH_CUTLASS_TIMELINE=1");
  at::Tensor timeline =
      at::zeros({FwdTimeline::kCtas, FwdTimeline::kSteps, FwdTimeline::kWarpgroups, FwdTimeline::kEvents}, at::kLong);
#ifdef FLASH_CUTLASS_TIMELINE
  C10_CUDA_CHECK(read_fwd_sm90_timeline(kernel_hdim, reinterpret_cast<unsigned long long*>(timeline.data_ptr<int64_t>())));
#endif
  return timeline;
}

std::vector<std::string> compiled_dtypes() {
  std::vector<std::string> names;
  if (dtype_compiled(DType::kFloat16)) names.emplace_back("float16");
  if (dtype_compiled(DType::kBFloat16)) names.emplace_back("bfloat16");
  return names;
}

}  // namespace
}  // namespace flash_cutlass

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace fc = flash_cutlass;
  m.doc() = "flash_cutlass CUDA kernels (internal; use the flash_cutlass package)";
  m.def("forward", &fc::forward,
        "Attention forward into preallocated out and lse (and the drawn dropout state into drawn_rng_state)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("drawn_rng_state"), pybind11::arg("options"));
  m.def("kvcache_forward", &fc::kvcache_forward,
        "Append new tokens to a KV cache and attend over it, into preallocated out and lse",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("cache_seqlens"), pybind11::arg("cache_seqlen"), pybind11::arg("block_table"),
        pybind11::arg("cache_batch_idx"), pybind11::arg("rotary_cos"), pybind11::arg("rotary_sin"),
        pybind11::arg("rotary_interleaved"), pybind11::arg("rotary_q_per_row"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("num_splits"), pybind11::arg("options"));
  m.def("compiled_kvcache_head_dims", &fc::compiled_kvcache_head_dims);
  m.def("backward", &fc::backward, "Attention backward into preallocated dq, dk and dv", pybind11::arg("dout"),
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("dq"), pybind11::arg("dk"), pybind11::arg("dv"), pybind11::arg("options"),
        pybind11::arg("dsoftmax_sum") = pybind11::none());
  using fc::Direction;
  using fc::KernelPath;
  // The sm80 path's head dims are the build's: each direction has every one of them (or none).
  m.def("compiled_head_dims", &fc::compiled_head_dims<Direction::kForward, KernelPath::kSm80>);
  m.def("compiled_sm90_head_dims", &fc::compiled_head_dims<Direction::kForward, KernelPath::kSm90>);
  m.def("compiled_sm90_backward_head_dims", &fc::compiled_head_dims<Direction::kBackward, KernelPath::kSm90>);
  m.def("compiled_dtypes", &fc::compiled_dtypes);
  m.attr("compiled_window") = fc::compiled::kWindow;
  m.attr("compiled_backward") = fc::compiled::kBackward;
  m.attr("compiled_softcap") = fc::compiled::kSoftcap;
  m.attr("compiled_alibi") = fc::compiled::kAlibi;
  m.attr("compiled_dropout") = fc::compiled::kDropout;
  m.attr("compiled_kvcache") = fc::compiled::kKVCache;
  m.attr("compiled_sm80_small_tiles_on_hopper") = fc::compiled::kSm80SmallTilesOnHopper;
  m.attr("compiled_sm80_every_head_dim_on_hopper") = fc::compiled::kSm80EveryHeadDimOnHopper;
  m.attr("compiled_archs") = std::string(fc::compiled::kArchs);
  m.def("forward_timeline", &fc::forward_timeline,
        "The Hopper forward's developer timeline of one head dim's kernels (FLASH_CUTLASS_TIMELINE=1)",
        pybind11::arg("head_dim"));
  m.attr("compiled_timeline") = fc::compiled::kTimeline;
}

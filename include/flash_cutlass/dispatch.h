// Runtime values -> compile-time instantiations. Each head dim and dtype is present only when
// the build defined FLASH_CUTLASS_HDIM_<N> / FLASH_CUTLASS_DTYPE_<NAME> (see setup.py), so a
// pruned build links only what it compiled.
#pragma once

#include <type_traits>

#include <cuda_runtime_api.h>

#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The compiled head dims, ascending. A call runs in the smallest one >= its head_dim.
inline constexpr int kCompiledHeadDims[] = {
#ifdef FLASH_CUTLASS_HDIM_32
    32,
#endif
#ifdef FLASH_CUTLASS_HDIM_64
    64,
#endif
#ifdef FLASH_CUTLASS_HDIM_96
    96,
#endif
#ifdef FLASH_CUTLASS_HDIM_128
    128,
#endif
#ifdef FLASH_CUTLASS_HDIM_192
    192,
#endif
#ifdef FLASH_CUTLASS_HDIM_256
    256,
#endif
    0  // end marker, keeps the array non-empty
};

inline constexpr bool kCompiledFloat16 =
#ifdef FLASH_CUTLASS_DTYPE_FP16
    true;
#else
    false;
#endif
inline constexpr bool kCompiledBFloat16 =
#ifdef FLASH_CUTLASS_DTYPE_BF16
    true;
#else
    false;
#endif

// The sliding-window kernels (MaskKind::kLocal), built unless FLASH_CUTLASS_WINDOW=0.
inline constexpr bool kCompiledWindow =
#ifdef FLASH_CUTLASS_WINDOW
    true;
#else
    false;
#endif
inline constexpr bool kCompiledTimeline =
#ifdef FLASH_CUTLASS_TIMELINE
    true;
#else
    false;
#endif

// The backward kernels, built unless FLASH_CUTLASS_BACKWARD=0 (a forward-only build for inference).
inline constexpr bool kCompiledBackward =
#ifdef FLASH_CUTLASS_BACKWARD
    true;
#else
    false;
#endif

// The options of the extended instantiations (Extension) this build accepts: the soft cap unless
// FLASH_CUTLASS_SOFTCAP=0, ALiBi unless FLASH_CUTLASS_ALIBI=0, dropout unless
// FLASH_CUTLASS_DROPOUT=0. setup.py compiles the score-options instantiation
// (FLASH_CUTLASS_SCORE_MODS) when the soft cap or ALiBi is on, and the dropout one (which carries the
// score options too) with dropout.
inline constexpr bool kCompiledSoftcap =
#ifdef FLASH_CUTLASS_SOFTCAP
    true;
#else
    false;
#endif
inline constexpr bool kCompiledAlibi =
#ifdef FLASH_CUTLASS_ALIBI
    true;
#else
    false;
#endif
inline constexpr bool kCompiledDropout =
#ifdef FLASH_CUTLASS_DROPOUT
    true;
#else
    false;
#endif

// Smallest head dim of a 0-terminated compiled list that is >= head_dim, or 0 when none is.
template <int kCount>
inline int smallest_compiled_at_least(const int (&compiled)[kCount], int head_dim) {
  for (int d : compiled) {
    if (d != 0 && d >= head_dim) return d;
  }
  return 0;
}

// The sm80-path kernel a head dim runs in.
inline int kernel_head_dim(int head_dim) { return smallest_compiled_at_least(kCompiledHeadDims, head_dim); }

// The compiled head dims of the Hopper path (built with FLASH_CUTLASS_SM90), ascending.
inline constexpr int kCompiledSm90HeadDims[] = {
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_64)
    64,
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_96)
    96,
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_128)
    128,
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_192)
    192,
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_256)
    256,
#endif
    0  // end marker, keeps the array non-empty
};

// The Hopper-path kernel a head dim runs in.
inline int sm90_kernel_head_dim(int head_dim) { return smallest_compiled_at_least(kCompiledSm90HeadDims, head_dim); }

// The compiled head dims of the Hopper-path backward (head dims up to 128), ascending.
inline constexpr int kCompiledSm90BwdHeadDims[] = {
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_64)
    64,
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_128)
    128,
#endif
    0  // end marker, keeps the array non-empty
};

// The Hopper-path backward kernel a head dim runs in (0: none).
inline int sm90_bwd_kernel_head_dim(int head_dim) {
  return smallest_compiled_at_least(kCompiledSm90BwdHeadDims, head_dim);
}

inline bool dtype_compiled(DType dtype) {
  return dtype == DType::kFloat16 ? kCompiledFloat16 : kCompiledBFloat16;
}

namespace detail {
template <int kHeadDim, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd_sm80_dtype(FwdParams const& params, DType dtype, cudaStream_t stream) {
#ifdef FLASH_CUTLASS_DTYPE_FP16
  if (dtype == DType::kFloat16) return sm80::run_fwd<kHeadDim, DType::kFloat16, kMaskKind, kExtension>(params, stream);
#endif
#ifdef FLASH_CUTLASS_DTYPE_BF16
  if (dtype == DType::kBFloat16) return sm80::run_fwd<kHeadDim, DType::kBFloat16, kMaskKind, kExtension>(params, stream);
#endif
  return cudaErrorNotSupported;
}

template <int kHeadDim, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd_sm90_dtype(FwdParams const& params, DType dtype, cudaStream_t stream) {
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_DTYPE_FP16)
  if (dtype == DType::kFloat16) return sm90::run_fwd<kHeadDim, DType::kFloat16, kMaskKind, kExtension>(params, stream);
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_DTYPE_BF16)
  if (dtype == DType::kBFloat16) return sm90::run_fwd<kHeadDim, DType::kBFloat16, kMaskKind, kExtension>(params, stream);
#endif
  return cudaErrorNotSupported;
}

template <int kHeadDim, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd_sm80_dtype(BwdParams const& params, DType dtype, cudaStream_t stream) {
#if defined(FLASH_CUTLASS_BACKWARD) && defined(FLASH_CUTLASS_DTYPE_FP16)
  if (dtype == DType::kFloat16) return sm80::run_bwd<kHeadDim, DType::kFloat16, kMaskKind, kExtension>(params, stream);
#endif
#if defined(FLASH_CUTLASS_BACKWARD) && defined(FLASH_CUTLASS_DTYPE_BF16)
  if (dtype == DType::kBFloat16) return sm80::run_bwd<kHeadDim, DType::kBFloat16, kMaskKind, kExtension>(params, stream);
#endif
  return cudaErrorNotSupported;
}

template <int kHeadDim, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd_sm90_dtype(BwdParams const& params, DType dtype, cudaStream_t stream) {
#if defined(FLASH_CUTLASS_BACKWARD) && defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_DTYPE_FP16)
  if (dtype == DType::kFloat16) return sm90::run_bwd<kHeadDim, DType::kFloat16, kMaskKind, kExtension>(params, stream);
#endif
#if defined(FLASH_CUTLASS_BACKWARD) && defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_DTYPE_BF16)
  if (dtype == DType::kBFloat16) return sm90::run_bwd<kHeadDim, DType::kBFloat16, kMaskKind, kExtension>(params, stream);
#endif
  return cudaErrorNotSupported;
}

// Calls run(std::integral_constant<MaskKind, params.mask>{}): the instantiation of the call's
// mask kind (the window's only when the build compiled it).
template <class Run>
cudaError_t with_mask_kind(FwdParams const& params, Run&& run) {
  switch (params.mask) {
    case MaskKind::kNone:
      return run(std::integral_constant<MaskKind, MaskKind::kNone>{});
    case MaskKind::kCausal:
      return run(std::integral_constant<MaskKind, MaskKind::kCausal>{});
    case MaskKind::kLocal:
#ifdef FLASH_CUTLASS_WINDOW
      return run(std::integral_constant<MaskKind, MaskKind::kLocal>{});
#else
      return cudaErrorNotSupported;
#endif
  }
  return cudaErrorInvalidValue;
}

// Calls run(mask kind, extension): an extended instantiation (kLocal; with dropout where the call
// drops, else with the score options; only where the build compiled it) for calls that set any
// option, else the instantiation of the call's mask kind.
template <class Run>
cudaError_t with_instantiation(FwdParams const& params, Run&& run) {
  using Local = std::integral_constant<MaskKind, MaskKind::kLocal>;
  if (params.dropout_threshold != 0) {
#ifdef FLASH_CUTLASS_DROPOUT
    return run(Local{}, std::integral_constant<Extension, Extension::kDropout>{});
#else
    return cudaErrorNotSupported;
#endif
  }
  if (uses_extension(params)) {
#ifdef FLASH_CUTLASS_SCORE_MODS
    return run(Local{}, std::integral_constant<Extension, Extension::kScoreMods>{});
#else
    return cudaErrorNotSupported;
#endif
  }
  return with_mask_kind(params, [&](auto kind) { return run(kind, std::integral_constant<Extension, Extension::kNone>{}); });
}

// run_<direction>_<path>_dtype for the call's instantiation.
#define FLASH_CUTLASS_RUN_INSTANTIATION(run_dtype)                                                 \
  with_instantiation(params, [&](auto kind, auto extension) {                                        \
    return run_dtype<kHeadDim, decltype(kind)::value, decltype(extension)::value>(params, dtype, stream); \
  })

template <int kHeadDim>
cudaError_t run_fwd_sm80_mask(FwdParams const& params, DType dtype, cudaStream_t stream) {
  return FLASH_CUTLASS_RUN_INSTANTIATION(run_fwd_sm80_dtype);
}

template <int kHeadDim>
cudaError_t run_fwd_sm90_mask(FwdParams const& params, DType dtype, cudaStream_t stream) {
  return FLASH_CUTLASS_RUN_INSTANTIATION(run_fwd_sm90_dtype);
}

template <int kHeadDim>
cudaError_t run_bwd_sm80_mask(BwdParams const& params, DType dtype, cudaStream_t stream) {
  return FLASH_CUTLASS_RUN_INSTANTIATION(run_bwd_sm80_dtype);
}

template <int kHeadDim>
cudaError_t run_bwd_sm90_mask(BwdParams const& params, DType dtype, cudaStream_t stream) {
  return FLASH_CUTLASS_RUN_INSTANTIATION(run_bwd_sm90_dtype);
}
#undef FLASH_CUTLASS_RUN_INSTANTIATION
}  // namespace detail

namespace detail {
// Calls run(std::integral_constant<int, kernel_hdim>{}) for a compiled head dim of the sm80 path.
template <class Run>
cudaError_t with_sm80_head_dim(int kernel_hdim, Run&& run) {
  switch (kernel_hdim) {
#ifdef FLASH_CUTLASS_HDIM_32
    case 32: return run(std::integral_constant<int, 32>{});
#endif
#ifdef FLASH_CUTLASS_HDIM_64
    case 64: return run(std::integral_constant<int, 64>{});
#endif
#ifdef FLASH_CUTLASS_HDIM_96
    case 96: return run(std::integral_constant<int, 96>{});
#endif
#ifdef FLASH_CUTLASS_HDIM_128
    case 128: return run(std::integral_constant<int, 128>{});
#endif
#ifdef FLASH_CUTLASS_HDIM_192
    case 192: return run(std::integral_constant<int, 192>{});
#endif
#ifdef FLASH_CUTLASS_HDIM_256
    case 256: return run(std::integral_constant<int, 256>{});
#endif
    default: return cudaErrorNotSupported;
  }
}

// The same for the Hopper path: the forward's head dims (kForward), or the backward's (64, 128).
template <bool kForward, class Run>
cudaError_t with_sm90_head_dim(int kernel_hdim, Run&& run) {
  switch (kernel_hdim) {
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_64)
    case 64: return run(std::integral_constant<int, 64>{});
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_96)
    case 96:
      if constexpr (kForward) return run(std::integral_constant<int, 96>{});
      return cudaErrorNotSupported;
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_128)
    case 128: return run(std::integral_constant<int, 128>{});
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_192)
    case 192:
      if constexpr (kForward) return run(std::integral_constant<int, 192>{});
      return cudaErrorNotSupported;
#endif
#if defined(FLASH_CUTLASS_SM90) && defined(FLASH_CUTLASS_HDIM_256)
    case 256:
      if constexpr (kForward) return run(std::integral_constant<int, 256>{});
      return cudaErrorNotSupported;
#endif
    default: return cudaErrorNotSupported;
  }
}
}  // namespace detail

// Launches the sm80-path forward kernel compiled for `kernel_hdim` (one of kCompiledHeadDims).
inline cudaError_t run_fwd_sm80(FwdParams const& params, DType dtype, int kernel_hdim, cudaStream_t stream) {
  return detail::with_sm80_head_dim(kernel_hdim, [&](auto hdim) {
    return detail::run_fwd_sm80_mask<decltype(hdim)::value>(params, dtype, stream);
  });
}

// Launches the Hopper-path forward kernel compiled for `kernel_hdim` (one of kCompiledSm90HeadDims).
inline cudaError_t run_fwd_sm90(FwdParams const& params, DType dtype, int kernel_hdim, cudaStream_t stream) {
  return detail::with_sm90_head_dim<true>(kernel_hdim, [&](auto hdim) {
    return detail::run_fwd_sm90_mask<decltype(hdim)::value>(params, dtype, stream);
  });
}

#ifdef FLASH_CUTLASS_TIMELINE
// Copies the developer timeline of the Hopper-path forward kernels compiled for `kernel_hdim` to
// host (FwdTimeline::kEntries values), then clears it.
inline cudaError_t read_fwd_sm90_timeline(int kernel_hdim, unsigned long long* host) {
  return detail::with_sm90_head_dim<true>(
      kernel_hdim, [&](auto hdim) { return sm90::read_fwd_timeline<decltype(hdim)::value>(host); });
}
#endif

// Launches the sm80-path backward kernel compiled for `kernel_hdim` (one of kCompiledHeadDims).
inline cudaError_t run_bwd_sm80(BwdParams const& params, DType dtype, int kernel_hdim, cudaStream_t stream) {
  return detail::with_sm80_head_dim(kernel_hdim, [&](auto hdim) {
    return detail::run_bwd_sm80_mask<decltype(hdim)::value>(params, dtype, stream);
  });
}

// Launches the Hopper-path backward compiled for `kernel_hdim` (one of kCompiledSm90BwdHeadDims).
inline cudaError_t run_bwd_sm90(BwdParams const& params, DType dtype, int kernel_hdim, cudaStream_t stream) {
  return detail::with_sm90_head_dim<false>(kernel_hdim, [&](auto hdim) {
    return detail::run_bwd_sm90_mask<decltype(hdim)::value>(params, dtype, stream);
  });
}

}  // namespace flash_cutlass

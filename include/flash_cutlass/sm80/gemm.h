// Warp-level GEMM loops of the sm80 path: operands come from shared memory through ldmatrix
// (or already sit in registers), and the ldmatrix of k-slice k+1 is issued before the MMAs of k.
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass::sm80 {

// The ldmatrix copies of one GEMM's A and B operands out of shared memory (atoms AtomA and AtomB,
// laid out for TiledMma), and one thread's slices of them.
template <class AtomA, class AtomB, class TiledMma>
struct OperandCopies {
  using CopyA = decltype(cute::make_tiled_copy_A(AtomA{}, TiledMma{}));
  using CopyB = decltype(cute::make_tiled_copy_B(AtomB{}, TiledMma{}));
  CopyA a;
  CopyB b;
  decltype(CopyA{}.get_thread_slice(0)) thread_a;
  decltype(CopyB{}.get_thread_slice(0)) thread_b;
};

template <class AtomA, class AtomB, class TiledMma>
__device__ __forceinline__ OperandCopies<AtomA, AtomB, TiledMma> operand_copies(TiledMma const& tiled_mma,
                                                                                int thread_idx) {
  auto a = cute::make_tiled_copy_A(AtomA{}, tiled_mma);
  auto b = cute::make_tiled_copy_B(AtomB{}, tiled_mma);
  return {a, b, a.get_thread_slice(thread_idx), b.get_thread_slice(thread_idx)};
}

// acc += A * B with both operands in shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemA, class SmemB,
          class CopyA, class ThrCopyA, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_smem_smem(TiledMma& tiled_mma, Acc& acc, FragA& frag_a, FragB& frag_b,
                                               SmemA const& smem_a, SmemB const& smem_b,
                                               CopyA const& copy_a, ThrCopyA const& thr_copy_a,
                                               CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_a_view = thr_copy_a.retile_D(frag_a);
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  constexpr int kSlices = decltype(size<2>(frag_a))::value;
  copy(copy_a, smem_a(_, _, 0), frag_a_view(_, _, 0));
  copy(copy_b, smem_b(_, _, 0), frag_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) {
      copy(copy_a, smem_a(_, _, k + 1), frag_a_view(_, _, k + 1));
      copy(copy_b, smem_b(_, _, k + 1), frag_b_view(_, _, k + 1));
    }
    gemm(tiled_mma, frag_a(_, _, k), frag_b(_, _, k), acc);
  }
}

// The same with the copies of one OperandCopies.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemA, class SmemB, class Copies>
__device__ __forceinline__ void gemm_smem_smem(TiledMma& tiled_mma, Acc& acc, FragA& frag_a, FragB& frag_b,
                                               SmemA const& smem_a, SmemB const& smem_b, Copies const& copies) {
  gemm_smem_smem(tiled_mma, acc, frag_a, frag_b, smem_a, smem_b, copies.a, copies.thread_a, copies.b,
                 copies.thread_b);
}

// acc += A * B with A already in registers and B in shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_regs_smem(TiledMma& tiled_mma, Acc& acc, FragA const& frag_a, FragB& frag_b,
                                               SmemB const& smem_b, CopyB const& copy_b,
                                               ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  constexpr int kSlices = decltype(size<2>(frag_a))::value;
  copy(copy_b, smem_b(_, _, 0), frag_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) copy(copy_b, smem_b(_, _, k + 1), frag_b_view(_, _, k + 1));
    gemm(tiled_mma, frag_a(_, _, k), frag_b(_, _, k), acc);
  }
}

}  // namespace flash_cutlass::sm80

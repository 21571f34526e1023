// How many L2 sectors a global -> shared copy pattern requests: one kernel launch per pattern,
// to be read with Nsight Compute (no torch, no extension). Each warp copies 16-row chunks of
// 256-byte rows (a head-dim-128 bf16 K tile, as the KV-cache kernel does) through a 3-stage
// pipeline; 1 GiB a pattern, so the compulsory traffic is 33.6 M sectors.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/copy_sectors tools/copy_sectors.cu
//   ncu --metrics lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,gpu__time_duration.sum /tmp/copy_sectors
//
// The launches, in order (CopyPattern; the kernel's template argument is its number):
//   0 kPaddedZeroFill      cp.async.cg with the zero-fill operand into rows padded to 272 bytes
//                          (the KV-cache kernel's stages)
//   1 kUnpaddedZeroFill    the same into unpadded 256-byte rows
//   2 kPadded              cp.async.cg without the zero-fill operand, padded rows
//   3 kPaddedCached        cp.async.ca (through L1), padded rows
//   4 kPaddedThroughRegs   ld.global.v4 then st.shared.v4, padded rows
//   5 kUnpaddedWideRows    16 lanes a row (two whole rows an instruction), unpadded rows
//   6 kUnpaddedContiguous  lane l copies bytes 16 l of each 512-byte piece, unpadded rows
//   7 kPaddedStrided       as 0, rows 2,048 bytes apart in global memory (8 kv heads)
//   8 kSwizzled            as 1, each line's 16-byte chunks permuted (chunk c of row r at c ^ r % 8)
//   9 kUnpaddedWithReads   as 1, and each chunk then read by ldmatrix as the KV-cache kernel reads
//                          K (8 rows at one column: 8-way bank conflicts on unpadded rows)
//  10 kPaddedWithReads     as 0, with the same ldmatrix reads (conflict-free on padded rows)
//  then pattern 0 twice more with 106 KiB and 200 KiB of shared memory a CTA (2 and 1 CTAs an SM).
//
// Measured on the H200 (2026-12-03): 0, 2, 7 and 10 request 1.5x the compulsory sectors, 1, 3-6,
// 8 and 9 exactly them: padded rows alone make the excess (a swizzled chunk order and ldmatrix
// reads do not).
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

namespace {

enum CopyPattern : int {
  kPaddedZeroFill = 0,
  kUnpaddedZeroFill = 1,
  kPadded = 2,
  kPaddedCached = 3,
  kPaddedThroughRegs = 4,
  kUnpaddedWideRows = 5,
  kUnpaddedContiguous = 6,
  kPaddedStrided = 7,
  kSwizzled = 8,
  kUnpaddedWithReads = 9,
  kPaddedWithReads = 10,
};

constexpr int kRowBytes = 256;
constexpr int kRowsPerChunk = 16;
constexpr int kStages = 3;
constexpr int kWarps = 4;
constexpr int kCtas = 1024;
constexpr int kChunksPerWarp = 64;

__host__ __device__ constexpr bool is_padded(int pattern) {
  return pattern == kPaddedZeroFill || pattern == kPadded || pattern == kPaddedCached ||
         pattern == kPaddedThroughRegs || pattern == kPaddedStrided || pattern == kPaddedWithReads;
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kPattern>
__device__ __forceinline__ void copy_16(char* dst, const char* src) {
  if constexpr (kPattern == kPadded) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src));
  } else if constexpr (kPattern == kPaddedCached) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src));
  } else if constexpr (kPattern == kPaddedThroughRegs) {
    *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(dst)), "l"(src), "r"(16));
  }
}

template <int kPattern>
__global__ void __launch_bounds__(kWarps * 32) copy_chunks(const char* __restrict__ src, int64_t row_stride,
                                                           int* __restrict__ sink) {
  extern __shared__ __align__(128) char smem[];
  constexpr int kSmemRow = is_padded(kPattern) ? kRowBytes + 16 : kRowBytes;
  constexpr int kLanesPerRow = kPattern == kUnpaddedWideRows ? 16 : 8;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  constexpr int kPasses = kRowsPerChunk / kRowsPerPass;
  constexpr int kColPasses = kRowBytes / (kLanesPerRow * 16);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  char* warp_smem = smem + warp * kStages * kRowsPerChunk * kSmemRow;
  const int64_t first_chunk = (int64_t(blockIdx.x) * kWarps + warp) * kChunksPerWarp;
  const int copy_row = lane / kLanesPerRow;
  const int copy_col = (lane % kLanesPerRow) * 16;
  uint32_t checksum = 0;
  for (int t = 0; t < kChunksPerWarp; ++t) {
    const char* chunk = src + (first_chunk + t) * kRowsPerChunk * row_stride;
    char* stage = warp_smem + (t % kStages) * kRowsPerChunk * kSmemRow;
    if constexpr (kPattern == kUnpaddedContiguous) {
      for (int piece = 0; piece < kRowsPerChunk * kRowBytes / 512; ++piece) {
        const int offset = piece * 512 + lane * 16;
        copy_16<kPattern>(stage + offset, chunk + (offset / kRowBytes) * row_stride + offset % kRowBytes);
      }
    } else {
      for (int p = 0; p < kPasses; ++p) {
        const int row = copy_row + p * kRowsPerPass;
        for (int c = 0; c < kColPasses; ++c) {
          const int col = copy_col + c * kLanesPerRow * 16;
          int dst_col = col;
          if constexpr (kPattern == kSwizzled) dst_col = (col & ~127) | ((((col >> 4) & 7) ^ (row & 7)) << 4);
          copy_16<kPattern>(stage + row * kSmemRow + dst_col, chunk + row * row_stride + col);
        }
      }
    }
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
    __syncwarp();
    // The chunk copied kStages - 1 steps ago has landed: read it.
    const char* landed = warp_smem + ((t + 1) % kStages) * kRowsPerChunk * kSmemRow;
    if constexpr (kPattern == kUnpaddedWithReads || kPattern == kPaddedWithReads) {
      // ldmatrix.x4 over the chunk's 16 rows, 16 bytes each, column block by column block:
      // lanes 0-15 give rows 0-15 at one column, lanes 16-31 the same rows 16 bytes further.
      for (int col = 0; col < kRowBytes; col += 32) {
        const uint32_t address = smem_address(landed + (lane % 16) * kSmemRow + col + (lane / 16) * 16);
        uint32_t r0, r1, r2, r3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(address));
        checksum += r0 ^ r1 ^ r2 ^ r3;
      }
    } else {
      checksum += reinterpret_cast<const uint32_t*>(landed)[lane];
    }
  }
  asm volatile("cp.async.wait_group 0;");
  if (checksum == 0x12345678u) *sink = int(checksum);
}

template <int kPattern>
void launch(const char* src, int64_t row_stride, int* sink, int smem_bytes) {
  cudaFuncSetAttribute(copy_chunks<kPattern>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  copy_chunks<kPattern><<<kCtas, kWarps * 32, smem_bytes>>>(src, row_stride, sink);
}

}  // namespace

int main() {
  const int64_t rows = int64_t(kCtas) * kWarps * kChunksPerWarp * kRowsPerChunk;
  const int64_t bytes = rows * kRowBytes;  // 1 GiB a pattern
  constexpr int64_t kStridedRowBytes = 2048;
  char* src = nullptr;
  int* sink = nullptr;
  if (cudaMalloc(&src, rows * kStridedRowBytes) != cudaSuccess || cudaMalloc(&sink, sizeof(int)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed: needs %lld bytes\n", static_cast<long long>(rows * kStridedRowBytes));
    return 1;
  }
  cudaMemset(src, 1, rows * kStridedRowBytes);
  const int smem = kWarps * kStages * kRowsPerChunk * (kRowBytes + 16);
  launch<kPaddedZeroFill>(src, kRowBytes, sink, smem);
  launch<kUnpaddedZeroFill>(src, kRowBytes, sink, smem);
  launch<kPadded>(src, kRowBytes, sink, smem);
  launch<kPaddedCached>(src, kRowBytes, sink, smem);
  launch<kPaddedThroughRegs>(src, kRowBytes, sink, smem);
  launch<kUnpaddedWideRows>(src, kRowBytes, sink, smem);
  launch<kUnpaddedContiguous>(src, kRowBytes, sink, smem);
  launch<kPaddedStrided>(src, kStridedRowBytes, sink, smem);
  launch<kSwizzled>(src, kRowBytes, sink, smem);
  launch<kUnpaddedWithReads>(src, kRowBytes, sink, smem);
  launch<kPaddedWithReads>(src, kRowBytes, sink, smem);
  launch<kPaddedZeroFill>(src, kRowBytes, sink, 106 * 1024);
  launch<kPaddedZeroFill>(src, kRowBytes, sink, 200 * 1024);
  const cudaError_t status = cudaDeviceSynchronize();
  std::printf("%lld bytes a launch: %s\n", static_cast<long long>(bytes), cudaGetErrorString(status));
  return status == cudaSuccess ? 0 : 1;
}

// Runs one forward instantiation of each kernel path (sm80 and Hopper) on the same inputs, checks
// both against a float64 reference on sampled rows, and times both on the benchmark's shapes:
// a quick loop for kernel work that needs no extension build and no torch.
//
// Build and run with tools/compare_paths.sh HEAD_DIM (64, 128 or 256; needs an sm_90 GPU).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>

#include "flash_cutlass/sm80/fwd_launch.h"
#include "flash_cutlass/sm90/fwd_launch.h"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=64, 128 or 256"
#endif

namespace {

using flash_cutlass::DType;
using flash_cutlass::Extension;
using flash_cutlass::FwdParams;
using flash_cutlass::MaskKind;
using Element = __nv_bfloat16;

constexpr double kMaxAbsError = 2e-2;  // bf16 output against the float64 reference
constexpr int kSampledRows = 24;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(2);
  }
}

// Uniform values in [-1.7, 1.7] from a hash of the index: the same inputs on every run.
__global__ void fill_uniform(Element* data, size_t count, unsigned seed) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  unsigned x = unsigned(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  data[i] = __float2bfloat16((float(x & 0xffff) / 65536.f - 0.5f) * 3.4f);
}

struct Shape {
  int batch, seqlen_q, seqlen_k, heads, heads_k, head_dim;
  bool causal;
};

template <MaskKind kMaskKind>
cudaError_t launch(bool hopper, FwdParams const& params) {
  return hopper ? flash_cutlass::sm90::run_fwd<HEAD_DIM, DType::kBFloat16, kMaskKind, Extension::kNone>(params, nullptr)
                : flash_cutlass::sm80::run_fwd<HEAD_DIM, DType::kBFloat16, kMaskKind, Extension::kNone>(params, nullptr);
}

cudaError_t launch(bool hopper, FwdParams const& params) {
  return params.mask == MaskKind::kCausal ? launch<MaskKind::kCausal>(hopper, params)
                                          : launch<MaskKind::kNone>(hopper, params);
}

// Largest |kernel - reference| over the sampled rows, or infinity if the kernel wrote a NaN there.
double sampled_error(Shape const& s, std::vector<Element> const& q, std::vector<Element> const& k,
                     std::vector<Element> const& v, std::vector<Element> const& out, float scale) {
  const int d = HEAD_DIM;
  double worst = 0;
  for (int sample = 0; sample < kSampledRows; ++sample) {
    const int b = sample % s.batch, h = (sample * 7) % s.heads, row = (sample * 997) % s.seqlen_q;
    const int hk = h / (s.heads / s.heads_k);
    const int keys = s.causal ? std::min(s.seqlen_k, row + 1 + s.seqlen_k - s.seqlen_q) : s.seqlen_k;
    auto at = [&](std::vector<Element> const& t, int seqlen, int heads, int r, int head, int c) {
      return double(__bfloat162float(t[((size_t(b) * seqlen + r) * heads + head) * d + c]));
    };
    std::vector<double> p(std::max(keys, 0));
    double max_score = -INFINITY, sum = 0;
    for (int j = 0; j < keys; ++j) {
      double dot = 0;
      for (int c = 0; c < s.head_dim; ++c) dot += at(q, s.seqlen_q, s.heads, row, h, c) * at(k, s.seqlen_k, s.heads_k, j, hk, c);
      p[j] = dot * scale;
      max_score = std::max(max_score, p[j]);
    }
    for (int j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - max_score));
    for (int c = 0; c < s.head_dim; ++c) {
      double expected = 0;
      for (int j = 0; j < keys; ++j) expected += p[j] * at(v, s.seqlen_k, s.heads_k, j, hk, c);
      expected = keys > 0 ? expected / sum : 0;
      const double actual = at(out, s.seqlen_q, s.heads, row, h, c);
      if (std::isnan(actual)) return INFINITY;
      worst = std::max(worst, std::fabs(actual - expected));
    }
  }
  return worst;
}

// Checks both paths on one shape; with `time_it`, also prints the median of 25 timed launches.
bool run_shape(Shape const& s, bool time_it) {
  const int d = HEAD_DIM;
  const size_t q_count = size_t(s.batch) * s.seqlen_q * s.heads * d;
  const size_t kv_count = size_t(s.batch) * s.seqlen_k * s.heads_k * d;
  Element *q, *k, *v, *out;
  float* lse;
  check(cudaMalloc(&q, q_count * sizeof(Element)), "cudaMalloc");
  check(cudaMalloc(&k, kv_count * sizeof(Element)), "cudaMalloc");
  check(cudaMalloc(&v, kv_count * sizeof(Element)), "cudaMalloc");
  check(cudaMalloc(&out, q_count * sizeof(Element)), "cudaMalloc");
  check(cudaMalloc(&lse, size_t(s.batch) * s.heads * s.seqlen_q * sizeof(float)), "cudaMalloc");
  fill_uniform<<<unsigned((q_count + 255) / 256), 256>>>(q, q_count, 1);
  fill_uniform<<<unsigned((kv_count + 255) / 256), 256>>>(k, kv_count, 2);
  fill_uniform<<<unsigned((kv_count + 255) / 256), 256>>>(v, kv_count, 3);

  FwdParams params;
  params.q = q;
  params.k = k;
  params.v = v;
  params.out = out;
  params.lse = lse;
  params.q_batch_stride = params.out_batch_stride = int64_t(s.seqlen_q) * s.heads * d;
  params.k_batch_stride = params.v_batch_stride = int64_t(s.seqlen_k) * s.heads_k * d;
  params.q_row_stride = params.out_row_stride = int64_t(s.heads) * d;
  params.k_row_stride = params.v_row_stride = int64_t(s.heads_k) * d;
  params.q_head_stride = params.k_head_stride = params.v_head_stride = params.out_head_stride = d;
  params.batch = s.batch;
  params.seqlen_q = s.seqlen_q;
  params.seqlen_k = s.seqlen_k;
  params.heads = s.heads;
  params.heads_k = s.heads_k;
  params.head_dim = s.head_dim;
  params.softmax_scale = 1.f / std::sqrt(float(s.head_dim));
  params.exp2_scale = params.softmax_scale * 1.4426950408889634f;
  params.mask = s.causal ? MaskKind::kCausal : MaskKind::kNone;

  std::vector<Element> host_q(q_count), host_k(kv_count), host_v(kv_count), host_out(q_count);
  check(cudaMemcpy(host_q.data(), q, q_count * sizeof(Element), cudaMemcpyDeviceToHost), "copy q");
  check(cudaMemcpy(host_k.data(), k, kv_count * sizeof(Element), cudaMemcpyDeviceToHost), "copy k");
  check(cudaMemcpy(host_v.data(), v, kv_count * sizeof(Element), cudaMemcpyDeviceToHost), "copy v");
  bool ok = true;
  for (bool hopper : {false, true}) {
    check(cudaMemset(out, 0xff, q_count * sizeof(Element)), "poison out");  // NaN in bf16
    check(launch(hopper, params), "launch");
    check(cudaDeviceSynchronize(), "kernel");
    check(cudaMemcpy(host_out.data(), out, q_count * sizeof(Element), cudaMemcpyDeviceToHost), "copy out");
    const double error = sampled_error(s, host_q, host_k, host_v, host_out, params.softmax_scale);
    const bool passed = error <= kMaxAbsError;
    ok = ok && passed;
    std::printf("%-6s b%-2d sq%-5d sk%-5d h%d/%d d%-3d %-10s max error %.2e %s", hopper ? "hopper" : "sm80", s.batch,
                s.seqlen_q, s.seqlen_k, s.heads, s.heads_k, s.head_dim, s.causal ? "causal" : "non-causal", error,
                passed ? "ok" : "FAILED");
    if (time_it && passed) {
      cudaEvent_t start, stop;
      check(cudaEventCreate(&start), "event");
      check(cudaEventCreate(&stop), "event");
      std::vector<float> ms;
      for (int i = 0; i < 30; ++i) {
        check(cudaEventRecord(start), "event");
        check(launch(hopper, params), "launch");
        check(cudaEventRecord(stop), "event");
        check(cudaEventSynchronize(stop), "kernel");
        float elapsed;
        check(cudaEventElapsedTime(&elapsed, start, stop), "event");
        if (i >= 5) ms.push_back(elapsed);
      }
      std::sort(ms.begin(), ms.end());
      const double median = ms[ms.size() / 2];
      const double flops = 4.0 * s.batch * s.heads * double(s.seqlen_q) * s.seqlen_k * s.head_dim * (s.causal ? 0.5 : 1.0);
      std::printf("  %.3f ms %6.1f TFLOPS", median, flops / median / 1e9);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
    std::printf("\n");
  }
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(out);
  cudaFree(lse);
  return ok;
}

}  // namespace

int main() {
  const int d = HEAD_DIM;
  bool ok = true;
  // Odd shapes: tails, seqlen_q != seqlen_k both ways, GQA and MQA, a head dim below the kernel's.
  for (Shape s : {Shape{2, 1000, 1000, 8, 8, d, false}, Shape{2, 1000, 1000, 8, 8, d, true},
                  Shape{2, 300, 1000, 8, 2, d, true}, Shape{2, 1000, 300, 8, 1, d, true},
                  Shape{1, 1, 17, 4, 4, d, false}, Shape{3, 129, 255, 4, 2, d - 8, false}}) {
    ok = run_shape(s, false) && ok;
  }
  // The benchmark's shapes: 16k tokens per batch, hidden 2048.
  for (bool causal : {false, true}) {
    for (int seqlen : {1024, 4096, 16384}) {
      ok = run_shape(Shape{16384 / seqlen, seqlen, seqlen, 2048 / d, 2048 / d, d, causal}, true) && ok;
    }
  }
  std::printf(ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}

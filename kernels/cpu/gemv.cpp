// The CPU matmul for a few rows against weights whose columns are contiguous (nn.Linear's weight as
// x @ W.t()): each output is a dot product of a source row with a weight column, streamed once from
// memory, with the bias and the epilogue applied while the result is in registers.
//
// Why not oneDNN or MKL: with one to seven rows the work is reading the weights, and neither spreads that
// over threads well while the weights lie as they are (packed ones go to oneDNN: matmul_kernel.cpp). On
// the 2-core AMD EPYC (Zen 4) CI host, one 1x1024 @ 1024x1024 (4 MB of weights, in L3): ATen's addmm (MKL)
// 77-82 us on one thread or two, oneDNN 105 us, this loop 29-36 us on two threads (about 130 GB/s).
//
// Plain C++ with intrinsics, no ATen headers: built once per instruction set next to the interpreter
// (CMakeLists.txt), in well under a second. Threads are OpenMP's, the runtime torch already loaded, so
// torch.set_num_threads applies; inside a parallel region it runs on the calling thread.
#include "kernels/cpu/gemv.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

namespace ember::cpu::EMBER_CPU_ISA {
namespace {

#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kLanes = 16;
constexpr int kMaxRows = 4;  // 4 rows x 4 columns of accumulators: 16 of the 32 registers
VecF vzero() { return _mm512_setzero_ps(); }
VecF vload(const float* p) { return _mm512_loadu_ps(p); }
VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
float vsum(VecF a) { return _mm512_reduce_add_ps(a); }
#else
using VecF = __m256;
constexpr int kLanes = 8;
constexpr int kMaxRows = 2;  // 2 x 4 accumulators leave room in AVX2's 16 registers
VecF vzero() { return _mm256_setzero_ps(); }
VecF vload(const float* p) { return _mm256_loadu_ps(p); }
VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
float vsum(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int kCols = 4;  // weight columns streamed together

float epilogue(float y, const MatmulConfig& config, const MatmulCall& call, int64_t m, int64_t n) {
  size_t a = 0, full = 0;  // Add steps so far; those with a [M, N] addend (addend_row_stride has one each)
  for (const PostOp& op : config.post_ops) {
    switch (op.kind) {
      case PostOp::Kind::Relu: y = y < 0.f ? 0.f : y; break;  // NaN stays NaN, as in ATen
      case PostOp::Kind::GeluErf: y = 0.5f * y * (1.f + std::erf(y * float(M_SQRT1_2))); break;
      case PostOp::Kind::GeluTanh:
        y = 0.5f * y * (1.f + std::tanh(float(M_2_SQRTPI * M_SQRT1_2) * (y + 0.044715f * y * y * y)));
        break;
      case PostOp::Kind::Silu: y = y / (1.f + std::exp(-y)); break;
      case PostOp::Kind::Sigmoid: y = 1.f / (1.f + std::exp(-y)); break;
      case PostOp::Kind::Tanh: y = std::tanh(y); break;
      case PostOp::Kind::Hardswish: y = y * std::min(std::max(y + 3.f, 0.f), 6.f) / 6.f; break;
      case PostOp::Kind::Clamp: y = y < op.alpha ? op.alpha : y > op.beta ? op.beta : y; break;  // NaN stays NaN
      case PostOp::Kind::Linear: y = op.alpha * y + op.beta; break;
      case PostOp::Kind::Add: {
        const float* addend = static_cast<const float*>(call.addends[a]);
        y += op.row ? addend[n] : addend[m * call.addend_row_stride[full++] + n];
        ++a;
        break;
      }
    }
  }
  return y;
}

// dst[m0 .. m0+R) x [n0 .. n0+C): R source rows against C weight columns, K in vectors then a scalar tail.
template <int R, int C>
void block(const MatmulConfig& config, const MatmulCall& call, int64_t m0, int64_t n0) {
  const float* src = static_cast<const float*>(call.src);
  const float* weights = static_cast<const float*>(call.weights);
  const int64_t K = call.K, ls = call.src_stride[0], lw = call.weights_stride[1];
  const float* x[R];
  const float* w[C];
  for (int r = 0; r < R; ++r) x[r] = src + (m0 + r) * ls;
  for (int c = 0; c < C; ++c) w[c] = weights + (n0 + c) * lw;
  VecF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    VecF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(w[c] + k);
    for (int r = 0; r < R; ++r) {
      VecF xv = vload(x[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(wv[c], xv, acc[r][c]);
    }
  }
  const float* bias = static_cast<const float*>(call.bias);
  float* dst = static_cast<float*>(call.dst);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float y = vsum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) y += x[r][kk] * w[c][kk];
      const int64_t m = m0 + r, n = n0 + c;
      if (bias) y += bias[n];
      dst[m * call.dst_stride + n] = epilogue(y, config, call, m, n);
    }
  }
}

template <int R>
void rows(const MatmulConfig& config, const MatmulCall& call, int64_t m0, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kCols <= n_end; n += kCols) block<R, kCols>(config, call, m0, n);
  switch (n_end - n) {
    case 3: block<R, 3>(config, call, m0, n); break;
    case 2: block<R, 2>(config, call, m0, n); break;
    case 1: block<R, 1>(config, call, m0, n); break;
    default: break;
  }
}

// Every row against columns [n_begin, n_end): the weights stream through once per kMaxRows rows.
void columns(const MatmulConfig& config, const MatmulCall& call, int64_t n_begin, int64_t n_end) {
  for (int64_t m = 0; m < call.M; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, call.M - m)) {
      case 1: rows<1>(config, call, m, n_begin, n_end); break;
      case 2: rows<2>(config, call, m, n_begin, n_end); break;
#if defined(__AVX512F__)
      case 3: rows<3>(config, call, m, n_begin, n_end); break;
      case 4: rows<4>(config, call, m, n_begin, n_end); break;
#endif
      default: break;
    }
  }
}

}  // namespace

void gemv(const MatmulConfig& config, const MatmulCall& call) {
  // A thread per 64 KiB of weights at least: below that the fork costs more than it saves.
  constexpr int64_t kBytesPerThread = 64 << 10;
  const int64_t bytes = call.N * call.K * int64_t(sizeof(float));
  int64_t threads = omp_in_parallel() ? 1 : std::min<int64_t>(omp_get_max_threads(), bytes / kBytesPerThread);
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, (call.N + kCols - 1) / kCols));
  if (threads == 1) {
    columns(config, call, 0, call.N);
    return;
  }
  const int64_t blocks = (call.N + kCols - 1) / kCols;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = blocks * t / nt * kCols, end = std::min(call.N, blocks * (t + 1) / nt * kCols);
    if (begin < end) columns(config, call, begin, end);
  }
}

}  // namespace ember::cpu::EMBER_CPU_ISA

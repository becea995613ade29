// ember's own GEMM kernels for small problems, compiled ahead of time by nvcc into a fatbin that libember
// embeds (CMakeLists.txt) and loads with cuModuleLoadData: no NVRTC at run time, so a graph's first call
// does not wait for a compiler. kernels/cuda/gemm.cpp offers them as one more route beside cuBLASLt and
// times them against it (see its header for why: a cuBLASLt call costs ~10 us of host time, a launch of
// these ~2 us).
//
// out[m, n] = act(sum_k A[m, k] * B[k, n] + bias[n]), A and B with any strides, out contiguous [M, N],
// bias optional (contiguous, N elements), act none, ReLU or tanh-GELU (cuBLASLt's epilogues). Elements
// are f32, f16 or bf16 and the sums are f32 (as cuBLAS's default compute type, TF32 off): the result is
// rounded once.
//  - tile<BM, BN, TM, TN>: a BM x BN block of outputs per thread block, TM x TN per thread (rows ty + i*TY,
//    columns tx + j*TX, so a warp's shared-memory reads are broadcasts or consecutive words and its
//    stores consecutive), K in chunks of 32 through shared memory, the next chunk loading into registers
//    while this one is multiplied. Each operand is loaded with consecutive threads on its contiguous
//    dimension, whichever that is.
//  - k16, k32: the 16x32 and 32x64 tiles with K split over 4 and 2 groups of threads in the block, for
//    long K over few tiles (a batch-64 linear layer of 1024 inputs: 32 chunks of K per tile).
//  - skinny<RM>: M <= RM rows (a batch-1 or batch-16 linear layer), B stored K-contiguous (a weight
//    W[N, K] read as W^T): each warp computes all rows of two columns, lanes split K (16-byte loads where
//    the operands allow) and the sums meet through warp shuffles; each lane then stores one output.
//    Weight-bandwidth bound, as such GEMMs are; one warp per two columns keeps every SM reading.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;

struct GemmParams {
  const void* a;
  const void* b;
  const void* bias;  // null: none
  void* out;
  i64 m, n, k;
  i64 sa0, sa1, sb0, sb1;
  int act;  // 0 none, 1 ReLU, 2 tanh-GELU
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The epilogue: bias, then the activation (NaN stays NaN through ReLU, as ATen's relu).
template <class T>
__device__ __forceinline__ float finish(const GemmParams& p, float v, i64 col) {
  if (p.bias) v += to_f(static_cast<const T*>(p.bias)[col]);
  if (p.act == 1) v = v < 0.f ? 0.f : v;
  else if (p.act == 2) v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  return v;
}

// One operand's share of a K-chunk, loaded into registers: element e of the R x BK chunk (R rows of A or
// columns of B) is (e / BK, e % BK) where the operand runs along K in memory, else (e % R, e / R), so
// consecutive threads read consecutive addresses either way. Out of range reads as 0.
template <class T, int R, int BK, int NT>
struct Chunk {
  static constexpr int kPer = R * BK / NT;
  float v[kPer];
  // `t`: this thread's index among the NT that share the chunk.
  __device__ __forceinline__ void load(const T* base, i64 r0, i64 rows, i64 k0, i64 k, i64 s_row, i64 s_k, bool along_k,
                                       int t) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = t + i * NT;
      const int r = along_k ? e / BK : e % R, kk = along_k ? e % BK : e / R;
      const i64 gr = r0 + r, gk = k0 + kk;
      v[i] = gr < rows && gk < k ? to_f(base[gr * s_row + gk * s_k]) : 0.f;
    }
  }
  __device__ __forceinline__ void store(float (*smem)[R + 1], bool along_k, int t) const {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = t + i * NT;
      const int r = along_k ? e / BK : e % R, kk = along_k ? e % BK : e / R;
      smem[kk][r] = v[i];
    }
  }
};

// Each K-chunk's loads are issued together and the next chunk's are in flight while this one is
// multiplied: small GEMMs are bound by memory latency, not arithmetic. With S > 1 the block is S groups
// of NT threads, each taking every S-th chunk of K for the same tile (S times the loads in flight where
// K is long and the tiles few), their sums added in group order through shared memory at the end.
template <class T, int BM, int BN, int TM, int TN, int S>
__device__ __forceinline__ void tile(const GemmParams& p) {
  constexpr int BK = 32, TX = BN / TN, TY = BM / TM, NT = TX * TY;
  static_assert(BM * BK % NT == 0 && BN * BK % NT == 0, "a chunk must split evenly over the threads");
  __shared__ float As[S][BK][BM + 1];
  __shared__ float Bs[S][BK][BN + 1];
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const int g = threadIdx.x / NT, t = threadIdx.x % NT, tx = t % TX, ty = t / TX;
  const i64 m0 = static_cast<i64>(blockIdx.y) * BM, n0 = static_cast<i64>(blockIdx.x) * BN;
  const bool a_along_k = p.sa1 == 1, b_along_k = p.sb0 == 1;
  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
  Chunk<T, BM, BK, NT> a;
  Chunk<T, BN, BK, NT> b;
  constexpr i64 kStep = static_cast<i64>(S) * BK;
  const i64 rounds = (p.k + kStep - 1) / kStep;  // the same for every group: all reach each barrier
  i64 k0 = static_cast<i64>(g) * BK;
  a.load(A, m0, p.m, k0, p.k, p.sa0, p.sa1, a_along_k, t);
  b.load(B, n0, p.n, k0, p.k, p.sb1, p.sb0, b_along_k, t);
  for (i64 r = 0; r < rounds; ++r, k0 += kStep) {
    a.store(As[g], a_along_k, t);
    b.store(Bs[g], b_along_k, t);
    __syncthreads();
    if (r + 1 < rounds) {
      a.load(A, m0, p.m, k0 + kStep, p.k, p.sa0, p.sa1, a_along_k, t);
      b.load(B, n0, p.n, k0 + kStep, p.k, p.sb1, p.sb0, b_along_k, t);
    }
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float x[TM], y[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) x[i] = As[g][kk][ty + i * TY];
#pragma unroll
      for (int j = 0; j < TN; ++j) y[j] = Bs[g][kk][tx + j * TX];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
    }
    __syncthreads();
  }
  if constexpr (S > 1) {
    __shared__ float part[S - 1][TM * TN][NT];
    if (g > 0) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) part[g - 1][i * TN + j][t] = acc[i][j];
    }
    __syncthreads();
    if (g > 0) return;
#pragma unroll
    for (int h = 0; h < S - 1; ++h)
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += part[h][i * TN + j][t];
  }
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i64 gm = m0 + ty + i * TY;
    if (gm >= p.m) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const i64 gn = n0 + tx + j * TX;
      if (gn < p.n) out[gm * p.n + gn] = from_f<T>(finish<T>(p, acc[i][j], gn));
    }
  }
}

// 16 bytes of T as floats.
template <class T>
__device__ __forceinline__ void load16(const T* at, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(at);
  if constexpr (sizeof(T) == 4) {
    v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y), v[2] = __uint_as_float(raw.z), v[3] = __uint_as_float(raw.w);
  } else {
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f(h[i]);
  }
}

constexpr int kSkinnyWarps = 4;
constexpr int kSkinnyCols = 2;

template <class T, int RM>
__device__ __forceinline__ void skinny(const GemmParams& p) {
  constexpr int RN = kSkinnyCols, V = 16 / sizeof(T);
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const int lane = threadIdx.x & 31;
  const i64 n0 = (static_cast<i64>(blockIdx.x) * kSkinnyWarps + (threadIdx.x >> 5)) * RN;
  if (n0 >= p.n) return;  // the whole warp: nothing below synchronizes the block
  float acc[RM][RN];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int c = 0; c < RN; ++c) acc[r][c] = 0.f;
  const T* col[RN];
#pragma unroll
  for (int c = 0; c < RN; ++c) col[c] = B + (n0 + c < p.n ? n0 + c : n0) * p.sb1;  // a missing column rereads one
  const bool vector = p.sa1 == 1 && p.sb0 == 1 && p.k % V == 0 && (RM == 1 || p.m == 1 || p.sa0 % V == 0) &&
                      p.sb1 % V == 0 && reinterpret_cast<unsigned long long>(A) % 16 == 0 &&
                      reinterpret_cast<unsigned long long>(B) % 16 == 0;
  if (vector) {
#pragma unroll 4
    for (i64 k = static_cast<i64>(lane) * V; k < p.k; k += 32 * V) {
      float b[RN][V];
#pragma unroll
      for (int c = 0; c < RN; ++c) load16(col[c] + k, b[c]);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        if (r >= p.m) break;
        float a[V];
        load16(A + r * p.sa0 + k, a);
#pragma unroll
        for (int c = 0; c < RN; ++c)
#pragma unroll
          for (int v = 0; v < V; ++v) acc[r][c] = fmaf(a[v], b[c][v], acc[r][c]);
      }
    }
  } else {
#pragma unroll 4
    for (i64 k = lane; k < p.k; k += 32) {
      float b[RN];
#pragma unroll
      for (int c = 0; c < RN; ++c) b[c] = to_f(col[c][k * p.sb0]);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        if (r >= p.m) break;
        const float a = to_f(A[r * p.sa0 + k * p.sa1]);
#pragma unroll
        for (int c = 0; c < RN; ++c) acc[r][c] = fmaf(a, b[c], acc[r][c]);
      }
    }
  }
  float mine = 0.f;  // lane r * RN + c keeps output (r, c)
#pragma unroll
  for (int r = 0; r < RM; ++r) {
#pragma unroll
    for (int c = 0; c < RN; ++c) {
      float v = acc[r][c];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == r * RN + c) mine = v;
    }
  }
  const int r = lane / RN, c = lane % RN;
  if (lane < RM * RN && r < p.m && n0 + c < p.n)
    static_cast<T*>(p.out)[r * p.n + n0 + c] = from_f<T>(finish<T>(p, mine, n0 + c));
}

// Entry points: ember_gemm_<config>_<dtype>; gemm.cpp's kKernelConfigs lists the configs and their
// launch shapes.
#define EMBER_GEMM_ENTRIES(suffix, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(256) ember_gemm_t64_##suffix(GemmParams p) { tile<T, 64, 64, 4, 4, 1>(p); } \
  extern "C" __global__ void __launch_bounds__(256) ember_gemm_t32_##suffix(GemmParams p) { tile<T, 32, 64, 2, 4, 1>(p); } \
  extern "C" __global__ void __launch_bounds__(128) ember_gemm_t16_##suffix(GemmParams p) { tile<T, 16, 32, 2, 2, 1>(p); } \
  extern "C" __global__ void __launch_bounds__(128) ember_gemm_s4_##suffix(GemmParams p) { skinny<T, 4>(p); }              \
  extern "C" __global__ void __launch_bounds__(128) ember_gemm_s16_##suffix(GemmParams p) { skinny<T, 16>(p); }            \
  extern "C" __global__ void __launch_bounds__(512) ember_gemm_k16_##suffix(GemmParams p) { tile<T, 16, 32, 2, 2, 4>(p); } \
  extern "C" __global__ void __launch_bounds__(512) ember_gemm_k32_##suffix(GemmParams p) { tile<T, 32, 64, 2, 4, 2>(p); }

EMBER_GEMM_ENTRIES(f32, float)
EMBER_GEMM_ENTRIES(f16, __half)
EMBER_GEMM_ENTRIES(bf16, __nv_bfloat16)

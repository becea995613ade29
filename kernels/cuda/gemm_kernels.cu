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

// act 0 none, 1 ReLU (NaN stays NaN, as ATen's relu), 2 tanh-GELU: cuBLASLt's epilogues.
__device__ __forceinline__ float activate(float v, int act) {
  if (act == 1) return v < 0.f ? 0.f : v;
  if (act == 2) return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  return v;
}

// The epilogue: bias, then the activation.
template <class T>
__device__ __forceinline__ float finish(const GemmParams& p, float v, i64 col) {
  if (p.bias) v += to_f(static_cast<const T*>(p.bias)[col]);
  return activate(v, p.act);
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

// ---- Linear chains (passes/linear_chain.cpp; launched by kernels/cuda/linear_chain.cpp) ----
// y = act_l(y @ B_l + bias_l) for l = 0..layers-1, y = x first: each block takes R rows through every layer.
// Its 256 threads are 128 columns x 2 row groups (RT rows each), so a layer is at most 128 wide and reads
// at most 128 inputs. Activations live in shared memory as f32 (rounded to T after each layer, as each
// GEMM's result is in eager), rows padded with zeros to a multiple of 4 so products read 4 at a time. A
// layer's weights are copied into shared memory as they lie where one dimension is contiguous (cp.async,
// sm_80 and aligned rows): rows of B^T (a linear layer's weight, one row per output column; read 4 at a
// time, rows spaced so that 8 lanes' 16-byte reads meet no bank twice) or rows of B (one per input, read a
// column per lane); otherwise the threads load them and store rows of B^T. The next layer's copy is in
// flight while this one multiplies (buffers = 2; 1 where shared memory holds one layer only: the copy then
// follows the products). A softmax or log_softmax over the last layer's rows (softmax = 1, 2) runs on them
// in shared memory, a warp per row.
#define EMBER_CHAIN_MAX_LAYERS 32

struct ChainLayer {
  const void* w;     // B [K, N]: element (k, j) at w[k * s0 + j * s1]
  const void* bias;  // null: none
  i64 s0, s1;
  int k, n;
  int act;     // 0 none, 1 ReLU, 2 tanh-GELU
  int copy;    // its weights' way into shared memory: 2 cp.async of 16 bytes, 1 of 4 bytes, 0 loads and stores
  int b_rows;  // shared memory holds rows of B (k-major) rather than rows of B^T
  int ws;      // elements between those rows in shared memory (a 16-byte multiple)
};

struct ChainParams {
  const void* x;  // [M, K0], strides (sx0, sx1)
  void* out;      // [M, N_last], contiguous
  i64 m, sx0, sx1;
  int layers;
  int wsize;    // elements of one weight buffer: the largest layer's rows x ws
  int astride;  // floats between activation rows (multiple of 4)
  int buffers;  // weight buffers, 1 or 2
  int softmax;  // after the last layer: 0 nothing, 1 softmax, 2 log_softmax over each row
  ChainLayer layer[EMBER_CHAIN_MAX_LAYERS];
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src));
#endif
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Starts copying layer `l`'s weights into `wb` and zeroes what the products read past K (a multiple of 4).
template <class T>
__device__ void chain_load_weights(const ChainLayer& l, T* wb) {
  const T* w = static_cast<const T*>(l.w);
  int copy = l.copy;
#if __CUDA_ARCH__ < 800
  copy = 0;
#endif
  // rows of memory: rows of B (k) where b_rows, else rows of B^T (j); `len` contiguous elements each
  const int rows = l.b_rows ? l.k : l.n, len = l.b_rows ? l.n : l.k;
  const i64 step = l.b_rows ? l.s0 : l.s1;
  if (copy == 2 || copy == 1) {
    const int bytes = copy == 2 ? 16 : 4, per_row = len * static_cast<int>(sizeof(T)) / bytes;
    for (int c = threadIdx.x; c < rows * per_row; c += blockDim.x) {
      const int r = c / per_row, q = c - r * per_row;
      char* dst = reinterpret_cast<char*>(wb + r * l.ws) + q * bytes;
      const char* src = reinterpret_cast<const char*>(w + r * step) + q * bytes;
      if (copy == 2) cp_async16(dst, src);
      else cp_async4(dst, src);
    }
  } else {  // 8 loads in flight per thread before their stores (one at a time, each waits out L2's latency)
    const bool along_k = l.s0 == 1;  // consecutive threads on consecutive addresses
    const int total = l.n * l.k, stride = blockDim.x;
    for (int base = threadIdx.x; base < total; base += 8 * stride) {
      T v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int e = base + u * stride;
        const int j = along_k ? e / l.k : e % l.n, kk = along_k ? e % l.k : e / l.n;
        if (e < total) v[u] = w[kk * l.s0 + j * l.s1];
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int e = base + u * stride;
        const int j = along_k ? e / l.k : e % l.n, kk = along_k ? e % l.k : e / l.n;
        if (e < total) wb[l.b_rows ? kk * l.ws + j : j * l.ws + kk] = v[u];
      }
    }
  }
  const int tail = ((l.k + 3) & ~3) - l.k;  // B's rows k..k4 (b_rows), or each B^T row's last elements
  for (int e = threadIdx.x; e < l.n * tail; e += blockDim.x) {
    const int j = e / tail, kk = l.k + e % tail;
    wb[l.b_rows ? kk * l.ws + j : j * l.ws + kk] = from_f<T>(0.f);
  }
}

__device__ __forceinline__ void load4(const float* p, float& a, float& b, float& c, float& d) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  a = v.x, b = v.y, c = v.z, d = v.w;
}
__device__ __forceinline__ void load4(const __half* p, float& a, float& b, float& c, float& d) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  a = lo.x, b = lo.y, c = hi.x, d = hi.y;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float& a, float& b, float& c, float& d) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  a = __uint_as_float(v.x << 16), b = __uint_as_float(v.x & 0xffff0000u);
  c = __uint_as_float(v.y << 16), d = __uint_as_float(v.y & 0xffff0000u);
}

// One layer's products for a thread's RT rows and column: rows of B^T (wr = row j, 4 elements per read) or
// rows of B (wr = column j of row 0, ws apart).
template <class T, int RT, bool B_ROWS>
__device__ __forceinline__ void chain_products(const T* wr, int ws, const float* a0, int astride, int k,
                                               float (&acc)[RT][4]) {
#pragma unroll 4
  for (int kk = 0; kk < k; kk += 4) {
    float w0, w1, w2, w3;
    if (B_ROWS) {
      w0 = to_f(wr[kk * ws]), w1 = to_f(wr[(kk + 1) * ws]), w2 = to_f(wr[(kk + 2) * ws]), w3 = to_f(wr[(kk + 3) * ws]);
    } else {
      load4(wr + kk, w0, w1, w2, w3);
    }
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const float4 a = *reinterpret_cast<const float4*>(a0 + i * astride + kk);
      acc[i][0] = fmaf(a.x, w0, acc[i][0]);
      acc[i][1] = fmaf(a.y, w1, acc[i][1]);
      acc[i][2] = fmaf(a.z, w2, acc[i][2]);
      acc[i][3] = fmaf(a.w, w3, acc[i][3]);
    }
  }
}

template <class T, int RT>
__device__ void linear_chain(const ChainParams& p) {
  constexpr int R = 2 * RT;
  extern __shared__ float4 chain_smem[];
  T* wbuf = reinterpret_cast<T*>(chain_smem);
  const int wsize = p.wsize;
  float* act_in = reinterpret_cast<float*>(wbuf + p.buffers * wsize);
  float* act_out = act_in + R * p.astride;
  const int j = threadIdx.x & 127, g = threadIdx.x >> 7;
  const i64 row0 = static_cast<i64>(blockIdx.x) * R;

  chain_load_weights<T>(p.layer[0], wbuf);
  cp_async_commit();
  {  // the block's rows of x, 4 loads in flight per thread
    const T* x = static_cast<const T*>(p.x);
    const int k0 = p.layer[0].k, k4 = (k0 + 3) & ~3, total = R * k4, stride = blockDim.x;
    for (int base = threadIdx.x; base < total; base += 4 * stride) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = base + u * stride, r = e / k4, kk = e - r * k4;
        const i64 row = row0 + r;
        v[u] = e < total && row < p.m && kk < k0 ? to_f(x[row * p.sx0 + kk * p.sx1]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = base + u * stride, r = e / k4, kk = e - r * k4;
        if (e < total) act_in[r * p.astride + kk] = v[u];
      }
    }
  }
  for (int l = 0; l < p.layers; ++l) {
    const ChainLayer& cl = p.layer[l];
    T* w = wbuf + (p.buffers == 2 ? (l & 1) * wsize : 0);
    if (p.buffers == 2) {
      if (l + 1 < p.layers) chain_load_weights<T>(p.layer[l + 1], wbuf + ((l + 1) & 1) * wsize);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      if (l > 0) {
        chain_load_weights<T>(cl, w);
        cp_async_commit();
      }
      cp_async_wait<0>();
    }
    __syncthreads();
    const bool last = l + 1 == p.layers;
    if (j < cl.n) {
      float acc[RT][4] = {};  // four partial sums per row: independent FMAs, not a chain of four per step
      const float* a0 = act_in + g * RT * p.astride;
      if (cl.b_rows) chain_products<T, RT, true>(w + j, cl.ws, a0, p.astride, cl.k, acc);
      else chain_products<T, RT, false>(w + j * cl.ws, cl.ws, a0, p.astride, cl.k, acc);
      const float b = cl.bias ? to_f(static_cast<const T*>(cl.bias)[j]) : 0.f;
#pragma unroll
      for (int i = 0; i < RT; ++i) {
        const float v = activate((acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]) + b, cl.act);
        const T rounded = from_f<T>(v);
        const int r = g * RT + i;
        if (!last || p.softmax) act_out[r * p.astride + j] = to_f(rounded);
        else if (row0 + r < p.m) static_cast<T*>(p.out)[(row0 + r) * cl.n + j] = rounded;
      }
    } else if (!last && j < ((cl.n + 3) & ~3)) {
#pragma unroll
      for (int i = 0; i < RT; ++i) act_out[(g * RT + i) * p.astride + j] = 0.f;
    }
    __syncthreads();
    float* t = act_in;
    act_in = act_out;
    act_out = t;
  }
  if (p.softmax) {  // the last layer's rows (now act_in), one warp per row: max, sum of exponentials, result
    const int n = p.layer[p.layers - 1].n, lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < R; r += blockDim.x >> 5) {
      if (row0 + r >= p.m) break;
      const float* v = act_in + r * p.astride;
      float mx = -INFINITY;
      for (int c = lane; c < n; c += 32) mx = fmaxf(mx, v[c]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      float sum = 0.f;
      for (int c = lane; c < n; c += 32) sum += expf(v[c] - mx);
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      T* out = static_cast<T*>(p.out) + (row0 + r) * n;
      if (p.softmax == 1) {
        for (int c = lane; c < n; c += 32) out[c] = from_f<T>(expf(v[c] - mx) / sum);
      } else {
        const float log_sum = logf(sum);
        for (int c = lane; c < n; c += 32) out[c] = from_f<T>(v[c] - mx - log_sum);
      }
    }
  }
}

#define EMBER_CHAIN_ENTRIES(suffix, T)                                                                               \
  extern "C" __global__ void __launch_bounds__(256) ember_chain_r4_##suffix(ChainParams p) { linear_chain<T, 2>(p); } \
  extern "C" __global__ void __launch_bounds__(256) ember_chain_r16_##suffix(ChainParams p) { linear_chain<T, 8>(p); }

EMBER_CHAIN_ENTRIES(f32, float)
EMBER_CHAIN_ENTRIES(f16, __half)
EMBER_CHAIN_ENTRIES(bf16, __nv_bfloat16)

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

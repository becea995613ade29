// The device code every generated module starts with: 16-bit float conversions (bit-exact with
// ATen's rounding), NaN-propagating max/min as eager's, GELU forms, warp and block reductions, and
// 16-byte vector loads and stores. NVRTC sources include no headers, so this is all they see.
#pragma once

namespace ember::cuda {

inline constexpr const char* kPrelude = R"(
typedef long long i64;
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
// bf16 rounding (to nearest even) of f, as the high half of a float's bits, with eager's NaN: its CUDA
// kernels convert through c10::BFloat16, which on sm_80+ is __float2bfloat16 (cvt.rn.bf16.f32: every NaN
// to 0x7fff, as seen on an H200) and before sm_80 the integer form below (every NaN to 0x7fc0).
__device__ __forceinline__ unsigned bf_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short b; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f)); return ((unsigned)b) << 16;
#else
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc00000u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
#endif
}
__device__ __forceinline__ unsigned short f2bf(float f) { return (unsigned short)(bf_bits(f) >> 16); }
// bf2f(f2bf(f)), the rounding eager applies between two bf16 ops: from sm_80 on one cvt instruction
// instead of the integer form's seven (GPT-2's bf16 gelu_new, eight roundings per element, took 84 us per
// call on the H100 so, against 105 us; inductor, which does not round between ops: 54 us).
__device__ __forceinline__ float bf_round(float f) { return __uint_as_float(bf_bits(f)); }
// bf_round of two values with one conversion (sm_80+: cvt.rn.bf16x2.f32 packs a in the high half, b in
// the low), where the conversion unit is what limits a kernel.
__device__ __forceinline__ void bf_round2(float a, float b, float& ra, float& rb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b));
  ra = __uint_as_float(r & 0xffff0000u); rb = __uint_as_float(r << 16);
#else
  ra = bf_round(a); rb = bf_round(b);
#endif
}
// A vector's 2 * W floats f as bf16 into words w (element 2i the low half, 2i + 1 the high), rounded as f2bf.
// From sm_80 on ptxas pairs the two conversions of a word into one F2FP.BF16.F32.PACK_AB; the integer
// form per element was a third of bf16 softmax(x / 8)'s instructions (over 32768 x 1024 on the H200 48.5 ->
// 39.7 us, a copy of its bytes 34.4). An explicit cvt.rn.bf16x2.f32 per pair gives the same pairs but made
// ptxas spill the row index of bf16 softmax's 64-register w4 variant.
template <int W> __device__ __forceinline__ void f2bf_words(const float* f, unsigned* w) {
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = (bf_bits(f[2 * i]) >> 16) | (bf_bits(f[2 * i + 1]) & 0xffff0000u);
}
// i % period for the vector path's inputs that repeat along the trailing dimensions (a bias, a batch
// norm's per-channel values): 32-bit where both fit, as they almost always do; a 64-bit remainder is
// several times the instructions, and resnet50's fused batch norms take four per vector.
__device__ __forceinline__ i64 period_offset(i64 i, i64 period) {
  return ((unsigned long long)(i | period) >> 32) == 0 ? (i64)((unsigned)i % (unsigned)period) : i % period;
}
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }
__device__ __forceinline__ float nan_min(float a, float b) { return a != a ? a : (b != b ? b : fminf(a, b)); }
// The hardware tanh (sm_75+, one MUFU instruction, relative error about 2^-11) for values eager rounds
// to bfloat16 next (8 significant bits): the rounding dominates its error, and tanhf's accurate sequence
// made GPT-2's bf16 gelu_new issue-bound (Printer::approx_tanh_ in cuda_source.cpp).
__device__ __forceinline__ float tanh_approx(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
#else
  return tanhf(x);
#endif
}
// Fast forms for values eager rounds to bf16 or f16 next (Printer::mark_rounded_values in
// cuda_source.cpp says where): the hardware exp2 (relative error about 2^-22, plus |x| * 2^-24 from
// scaling x) and reciprocal, and the full-range approximate division (2 ulp). None flushes subnormals.
// div_row divides by a value shared by a whole row: the reciprocal is the same expression for every
// element, so the compiler computes it once per row; a divisor below 2^-126 is scaled first, so that its
// reciprocal does not overflow.
__device__ __forceinline__ float exp_fast(float x) {
  float y; asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f)); return y;
}
__device__ __forceinline__ float rcp_fast(float x) { float y; asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float div_fast(float a, float b) { float y; asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ float div_row(float a, float b) {
  const float s = fabsf(b) < 1.17549435e-38f ? 18446744073709551616.f : 1.f;
  return (a * s) * (1.f / (b * s));
}
// sinf and cosf with their long-argument reduction (Payne-Hanek, a loop over a table) out of line:
// under the guard the compiler drops it from the inlined copy, so an unrolled kernel holds one copy of
// it, not one per element (sin().cos().exp()'s vector entry: 16 copies, 0.44 s of NVRTC on the 2-core
// host). Both sides compute sinf, so the bits are sinf's. The bound is below where sinf's own inline
// path ends; where a library's is lower, its copies keep the reduction (slower to compile, still exact).
static __device__ __noinline__ float sin_far(float x) { return sinf(x); }
static __device__ __noinline__ float cos_far(float x) { return cosf(x); }
__device__ __forceinline__ float sin_near(float x) { return fabsf(x) < 48039.f ? sinf(x) : sin_far(x); }
__device__ __forceinline__ float cos_near(float x) { return fabsf(x) < 48039.f ? cosf(x) : cos_far(x); }
__device__ __forceinline__ float gelu_erf(float x) { return x * 0.5f * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_tanh(float x) { return x * 0.5f * (1.f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x))); }
__device__ __forceinline__ float gelu_backward(float g, float x) {
  float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;
  return g * (cdf + x * pdf);
}
template <int OP> __device__ __forceinline__ float combine(float a, float b) {
  return OP == 0 ? a + b : (OP == 1 ? nan_max(a, b) : nan_min(a, b));
}
template <int OP> __device__ __forceinline__ float warp_reduce(float v) {
  for (int o = 16; o > 0; o >>= 1) v = combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// 16-byte (or narrower) loads and stores of V elements of T; the pointer is aligned to V * sizeof(T).
struct alignas(16) ember_u4 { unsigned x, y, z, w; };
struct alignas(8) ember_u2 { unsigned x, y; };
template <class W, class T, int N> union ember_pack { W w; T t[N]; };
template <class T, int V> __device__ __forceinline__ void ld_vec(const T* p, T* r) {
  constexpr int B = V * (int)sizeof(T);
  if constexpr (B >= 16) {
    constexpr int N = 16 / (int)sizeof(T);
#pragma unroll
    for (int c = 0; c < B / 16; ++c) {
      ember_pack<ember_u4, T, N> x; x.w = ((const ember_u4*)p)[c];
#pragma unroll
      for (int e = 0; e < N; ++e) r[c * N + e] = x.t[e];
    }
  } else if constexpr (B == 8) {
    ember_pack<ember_u2, T, V> x; x.w = *(const ember_u2*)p;
#pragma unroll
    for (int e = 0; e < V; ++e) r[e] = x.t[e];
  } else if constexpr (B == 4) {
    ember_pack<unsigned, T, V> x; x.w = *(const unsigned*)p;
#pragma unroll
    for (int e = 0; e < V; ++e) r[e] = x.t[e];
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) r[e] = p[e];
  }
}
template <class T, int V> __device__ __forceinline__ void st_vec(T* p, const T* r) {
  constexpr int B = V * (int)sizeof(T);
  if constexpr (B >= 16) {
    constexpr int N = 16 / (int)sizeof(T);
#pragma unroll
    for (int c = 0; c < B / 16; ++c) {
      ember_pack<ember_u4, T, N> x;
#pragma unroll
      for (int e = 0; e < N; ++e) x.t[e] = r[c * N + e];
      ((ember_u4*)p)[c] = x.w;
    }
  } else if constexpr (B == 8) {
    ember_pack<ember_u2, T, V> x;
#pragma unroll
    for (int e = 0; e < V; ++e) x.t[e] = r[e];
    *(ember_u2*)p = x.w;
  } else if constexpr (B == 4) {
    ember_pack<unsigned, T, V> x;
#pragma unroll
    for (int e = 0; e < V; ++e) x.t[e] = r[e];
    *(unsigned*)p = x.w;
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) p[e] = r[e];
  }
}
// Vectors held as 32-bit words: a 16-bit vector of 8 stays in 4 registers until each element is used,
// instead of 8 (one per element) or 8 floats. Inputs are never written by the kernel that reads them
// (outputs are fresh allocations), so loads take the read-only path (ld.global.nc), which the compiler
// may also move ahead of stores. W words (1, 2 or 4) at a 4 * W-byte aligned address.
// The asm is volatile: the compiler takes a plain asm for a pure function of its operands, free to run
// where the source does not. A single row's load (its address the same on every trip of the row loop)
// was hoisted out of the loop and out of the vector-mask and column checks that guard it: a bf16 row one
// element into its storage faulted with "misaligned address" (fuzz seed 200718), and lanes past the
// row's end read past the tensor.
template <int W> __device__ __forceinline__ void ld_words(const void* p, unsigned* w) {
  if constexpr (W == 4)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  else if constexpr (W == 2)
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  else
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
}
template <int W> __device__ __forceinline__ void st_words(void* p, const unsigned* w) {
  if constexpr (W == 4) *(ember_u4*)p = ember_u4{w[0], w[1], w[2], w[3]};
  else if constexpr (W == 2) *(ember_u2*)p = ember_u2{w[0], w[1]};
  else *(unsigned*)p = w[0];
}
// Element e of the words (T: float, unsigned short or unsigned char), and setting it (words start at 0).
template <class T> __device__ __forceinline__ T get_elem(const unsigned* w, int e) {
  if constexpr (sizeof(T) == 4) return __uint_as_float(w[e]);
  else if constexpr (sizeof(T) == 2) return (T)(w[e >> 1] >> ((e & 1) * 16));
  else return (T)(w[e >> 2] >> ((e & 3) * 8));
}
template <class T> __device__ __forceinline__ void set_elem(unsigned* w, int e, T v) {
  if constexpr (sizeof(T) == 4) w[e] = __float_as_uint(v);
  else if constexpr (sizeof(T) == 2) w[e >> 1] |= (unsigned)v << ((e & 1) * 16);
  else w[e >> 2] |= (unsigned)v << ((e & 3) * 8);
}
// Words whose every element is v.
template <class T> __device__ __forceinline__ unsigned splat(T v) {
  if constexpr (sizeof(T) == 4) return __float_as_uint(v);
  else if constexpr (sizeof(T) == 2) return (unsigned)v * 0x10001u;
  else return (unsigned)v * 0x1010101u;
}
// A vector of V elements from i0 of an input read by channel (NCHW's per-channel values): element i
// reads ptr[(i / span) % count]. One load and a splat where the vector lies in one channel, else one
// load per element.
template <class T, int W> __device__ __forceinline__ void ld_channel(const T* ptr, i64 i0, i64 span, i64 count, unsigned* w) {
  constexpr int V = W * 4 / (int)sizeof(T);
  if (((unsigned long long)((i0 + V) | span | count) >> 32) == 0) {
    const unsigned q = (unsigned)i0 / (unsigned)span, r = (unsigned)i0 - q * (unsigned)span;
    if (r + V <= (unsigned)span) {
      const unsigned s = splat<T>(ptr[q % (unsigned)count]);
#pragma unroll
      for (int x = 0; x < W; ++x) w[x] = s;
      return;
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) set_elem<T>(w, v, ptr[((i0 + v) / span) % count]);
}
template <int OP> __device__ float block_reduce(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float identity = OP == 0 ? 0.f : (OP == 1 ? __int_as_float(0xff800000) : __int_as_float(0x7f800000));
    v = lane < (int)(blockDim.x >> 5) ? shared[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}
)";

}  // namespace ember::cuda

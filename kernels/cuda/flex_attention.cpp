// ember::flex_attention (made by python_bindings/ember/flex.py from a flex_attention call) as one NVRTC kernel:
// flash attention with the call's score_mod and mask_mod compiled in, visiting only the key blocks its
// BlockMask lists.
//  1. A block of 4 or 8 warps owns 64 or 128 query rows of one (batch, head), 16 per warp. Per step of 64 keys
//     the block stages K and V in shared memory (cp.async, two stages: the next step's tiles load while this
//     one computes; fragments read by ldmatrix); each warp computes its 16 x 64 scores with m16n8k16 MMAs
//     (f16/bf16 operands, f32 sums), applies scale, mask_mod (partial blocks only) and score_mod in registers,
//     and folds them into a running max and sum (online softmax, base 2).
//     The probabilities, rounded to the inputs' type as eager's dense form rounds them, go straight from the
//     score registers into the A operand of the P @ V MMAs. No score reaches memory.
//     On Hopper (sm_90) prefill takes both products from wgmma instead (compiled for sm_90a): a warpgroup's 64
//     rows at once, K and V read by the tensor cores from 128-byte swizzled tiles that the TMA loads (three or
//     four stages, mbarriers instead of block-wide barriers); each step issues its scores and the previous
//     step's P @ V together. At head dims over 64 the two warpgroups of a block take turns at the tensor cores,
//     so that one's softmax runs during the other's products, a third warpgroup issues the loads, and a step
//     takes 128 keys. The registers and the softmax are the same.
//  2. Where the query tiles are fewer than the SMs (decoding), each tile's keys are dealt out to up to 16 blocks
//     that write unnormalized partial results; a second kernel merges them (split-KV). Where a block's rows
//     outnumber the query rows and heads are grouped, a block takes the query heads of one key-value head
//     (p.pack), so each key and value tile is read once per group.
//  3. Key blocks come from the BlockMask: its partial blocks (kv_num_blocks / kv_indices) with mask_mod, then
//     its full blocks without it. Keys past the sequence and positions no block lists are masked.
//  4. Outputs match the higher-order op: the attention in the query's dimension order, the log-sum-exp and
//     the row maximum in base 2 ([B, H, L] float32), fully masked rows giving zeros and -inf.
//  5. A fast path of the plan (runtime.h), compiled when the plan is built; where it cannot be (NVRTC missing,
//     a GPU before sm_80) the op's own CUDA implementation (flex.py: the dense form) runs instead.
#include "ember/config.h"
#include "ember/error.h"
#include "ember/ir.h"
#include "ember/runtime.h"
#include "kernels/cuda/driver.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <limits>
#include <atomic>
#include <cstdlib>
#include <numeric>

namespace ember::cuda {
namespace {

constexpr int kTile = 64;        // query rows per row tile of the warps, keys per step
constexpr int kBuffers = 8;      // captured buffers the mods may read
constexpr int64_t kMaxSplits = 16;  // blocks per query tile at most when its keys are split (decoding)

// The kernel's by-value argument, written once for the host and once (as text) for the device.
#define EMBER_FLEX_PARAMS                                                                                    \
  alignas(64) unsigned long long kmap[16]; unsigned long long vmap[16];                                        \
  const unsigned short* q; const unsigned short* k; const unsigned short* v; unsigned short* out;             \
  float* lse; float* mx; long long qs[3]; long long ks[3]; long long vs[3]; long long os[4];                  \
  const int* kvn; const int* kvi; const int* fkvn; const int* fkvi;                                           \
  long long kvns[3]; long long kvis[4]; long long fkvns[3]; long long fkvis[4];                               \
  const void* buf[8]; long long bs[8][4];                                                                      \
  long long qblock; long long kvblock; int B; int H; int HKV; int L; int S; float scale;                       \
  int splits; int pack; float* part_o; float* part_ml;
#define EMBER_FLEX_TEXT2(...) #__VA_ARGS__
#define EMBER_FLEX_TEXT(x) EMBER_FLEX_TEXT2(x)

struct Params {
  EMBER_FLEX_PARAMS
};

// Device functions wgmma_<n>[t](d, a, desc, accumulate), issuing one wgmma.mma_async of 64 x n x 16: A from registers
// (each warp's rows as an m16n8k16 A fragment), B from shared memory by descriptor (`trans_b`: B's rows are its
// k dimension, the values' layout), D the n / 2 float registers a warp's m16n8k16 C fragments hold for n columns.
// `accumulate` 0 overwrites D. The instruction returns before D is written: wgmma_wait_<n> makes it so.
std::string wgmma_functions(int n, bool trans_b) {
  const std::string suffix = std::to_string(n) + (trans_b ? "t" : "");
  std::string regs, operands;
  for (int i = 0; i < n / 2; ++i) {
    regs += (i ? "," : "") + std::string("%") + std::to_string(i);
    operands += (i ? ", " : "") + std::string("\"+f\"(d[") + std::to_string(i) + "])";
  }
  const int a = n / 2;
  auto op = [](int i) { return "%" + std::to_string(i); };
  std::string s = "__device__ __forceinline__ void wgmma_" + suffix +
                  "(float* d, const unsigned* a, unsigned long long desc, int accumulate) {\n"
                  "  asm volatile(\"{ .reg .pred p; setp.ne.b32 p, " + op(a + 5) + ", 0; wgmma.mma_async.sync.aligned.m64n" +
                  std::to_string(n) + "k16.f32.\" MMA_TYPE \".\" MMA_TYPE \" {" + regs + "}, {" + op(a) + "," + op(a + 1) + "," +
                  op(a + 2) + "," + op(a + 3) + "}, " + op(a + 4) + ", p, 1, 1, " + (trans_b ? "1" : "0") + "; }\"\n"
                  "    : " + operands + "\n"
                  "    : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), \"r\"(accumulate));\n}\n";
  // Waits for every wgmma this warpgroup issued; D's registers pass through it, so that no read of them moves
  // above the wait.
  s += "__device__ __forceinline__ void wgmma_wait_" + suffix + "(float* d) {\n"
       "  asm volatile(\"wgmma.wait_group.sync.aligned 0;\" : " + operands + " :: \"memory\");\n}\n";
  return s;
}

// Score columns of 8 per key step (NT): the wgmma kernel with two computing warpgroups (head dims over 64) takes 128
// keys per step, as two tiles of 64, so that the per-step work (hand-overs, waits, row maxima, rescales) counts
// half as often; the others take one tile of 64.
int score_tiles(bool wgmma, int warps) { return wgmma && warps == 8 ? 16 : 8; }
// Shared-memory stages of the wgmma kernel: four of 64 keys, or three of 128 (a stage of K and V at head dim
// 128 is 64 KB).
int wgmma_stages(int warps) { return score_tiles(true, warps) == 16 ? 3 : 4; }

std::string flex_source(bool bf16, int ek, int ev, int mt, int min_blocks, int warps, const std::string& score_mod,
                        const std::string& mask_mod, bool wgmma, bool plain_scores) {
  std::string s;
  s += "typedef long long i64; typedef unsigned short u16;\n";
  s += "struct Params { " EMBER_FLEX_TEXT(EMBER_FLEX_PARAMS) " };\n";
  s += "#define EK " + std::to_string(ek) + "\n#define EV " + std::to_string(ev) + "\n#define MT " + std::to_string(mt) + "\n#define MIN_BLOCKS " + std::to_string(min_blocks) +
       "\n#define WARPS " + std::to_string(warps) + "\n#define WGMMA " + (wgmma ? "1" : "0") +
       "\n#define PLAIN_SCORES " + (plain_scores ? "1" : "0") + "\n#define NT " + std::to_string(score_tiles(wgmma, warps)) +
       "\n";
  s += bf16 ? "#define MMA_TYPE \"bf16\"\n#define CVT_X2 \"cvt.rn.bf16x2.f32\"\n"
            : "#define MMA_TYPE \"f16\"\n#define CVT_X2 \"cvt.rn.f16x2.f32\"\n";
  if (wgmma) {
    const int keys = 8 * score_tiles(wgmma, warps);
    s += wgmma_functions(keys, false) + "#define WGMMA_S wgmma_" + std::to_string(keys) + "\n#define WGMMA_WAIT_S wgmma_wait_" +
         std::to_string(keys) + "\n";
    s += wgmma_functions(ev, true) + "#define WGMMA_O wgmma_" + std::to_string(ev) + "t\n#define WGMMA_WAIT_O wgmma_wait_" + std::to_string(ev) + "t\n";
  }
  s += R"(
__device__ __forceinline__ float ld_f32(const void* p, i64 i) { return ((const float*)p)[i]; }
__device__ __forceinline__ float ld_bf16(const void* p, i64 i) { return __uint_as_float(((unsigned)((const u16*)p)[i]) << 16); }
__device__ __forceinline__ float ld_f16(const void* p, i64 i) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const u16*)p)[i])); return f; }
__device__ __forceinline__ int ld_i32(const void* p, i64 i) { return ((const int*)p)[i]; }
__device__ __forceinline__ i64 ld_i64(const void* p, i64 i) { return ((const i64*)p)[i]; }
__device__ __forceinline__ int ld_i16(const void* p, i64 i) { return ((const short*)p)[i]; }
__device__ __forceinline__ int ld_i8(const void* p, i64 i) { return ((const signed char*)p)[i]; }
__device__ __forceinline__ int ld_u8(const void* p, i64 i) { return ((const unsigned char*)p)[i]; }
__device__ __forceinline__ i64 py_floordiv(i64 a, i64 b) { i64 q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
__device__ __forceinline__ i64 py_mod(i64 a, i64 b) { i64 r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
__device__ __forceinline__ float py_fmod(float a, float b) { float r = fmodf(a, b); return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r; }
template <class T> __device__ __forceinline__ T py_abs(T a) { return a < 0 ? -a : a; }
)";
  s += "__device__ __forceinline__ float score_mod(float score, int b, int h, int q, int kv, const Params& p) { " +
       score_mod + " }\n";
  s += "__device__ __forceinline__ bool mask_mod(int b, int h, int q, int kv, const Params& p) { " + mask_mod + " }\n";
  s += R"(
#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ unsigned pack2(float lo, float hi) { unsigned r; asm(CVT_X2 " %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}
// 16 bytes global -> shared (at shared address dst) without passing through registers; `valid` false writes zeros.
__device__ __forceinline__ void copy16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
#if WGMMA
// wgmma (sm_90a): a warpgroup's MMA with B read from shared memory by the tensor cores themselves. K and V
// tiles lie as wgmma's 128-byte swizzle: per 64 columns a slab of 64 rows x 128 bytes (8 KB, 1 KB aligned),
// 16-byte chunk c of row r at chunk c ^ (r % 8), as the tensor memory accelerator (TMA) writes them. A
// descriptor gives the start (a shared address), the distance between slabs (lbo: along n for V, unused for
// K) and between groups of 8 rows (sbo: 1 KB).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// mbarriers (shared addresses): a stage's `full` completes when its tiles have landed (one arrival that
// expects their bytes, then the TMA's writes); its `empty` when every warp is done reading it.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// One box of 64 x 64 16-bit values (a swizzled slab) of a 4-D tensor (map: a CUtensorMap in the kernel's
// parameters) into shared memory at dst; rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load(unsigned dst, const void* map, unsigned bar, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
               :: "r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Named barriers 1 and 2 order the two warpgroups' products (see the kernel).
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;" :: "r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;" :: "r"(id) : "memory"); }
#define STAGES (NT == 16 ? 3 : 4)  // key steps of K and V in shared memory (wgmma_stages)
#define AHEAD 3   // steps requested ahead of the one computed, by a producer that also computes (one warpgroup:
                  // it releases a stage before it requests the step STAGES - 1 ahead into it)
#define PRODUCER_WARPGROUP (WARPS == 8)  // a third warpgroup that only requests tiles (one thread of it)
#define SLAB (NT * 8 * 128)         // bytes of a swizzled slab: a step's keys x 64 columns
#define THREADS (WARPS * 32 + (PRODUCER_WARPGROUP ? 128 : 0))
#else
#define THREADS (WARPS * 32)
#endif

// The key tiles a query tile visits, in order: each partial block of its BlockMask row (mask_mod applies),
// then each full block, 64 keys at a time. Tile n of that order is tile n % per of block n / per (per: a
// block's tiles), so a split reaches its own tiles (n = split, split + splits, ...) with one index read each,
// not by walking every tile before them. A tile past the sequence's end (the tail of a last block) is visited
// with every key masked: nothing waits on the index read until the tile's loads are issued, a step later.
struct Tiles {
  const Params* p; int b, h, qb;
  int partial, per;  // partial blocks in the row; tiles per block
  int n, total;      // this tile's place in the order; tiles in the order
  int pass, kv0, end;  // key positions fit an int (p->S is one)
  __device__ void start(int split) {
    const int* full = p->fkvn;
    partial = p->kvn ? p->kvn[b * p->kvns[0] + h * p->kvns[1] + qb * p->kvns[2]] : 0;
    const int fulls = full ? full[b * p->fkvns[0] + h * p->fkvns[1] + qb * p->fkvns[2]] : 0;
    per = (int)(p->kvblock / 64);
    total = (partial + fulls) * per;
    n = split, pass = 0, kv0 = 0, end = 0;
    seek();
  }
  __device__ void next() {
    n += p->splits;
    seek();
  }
  __device__ bool valid() const { return n < total; }

 private:
  __device__ void seek() {
    if (n >= total) return;
    const int ordinal = n / per;
    pass = ordinal < partial ? 0 : 1;
    const int j = pass == 0 ? ordinal : ordinal - partial;
    const int* idxp = pass == 0 ? p->kvi : p->fkvi;
    const i64* is = pass == 0 ? p->kvis : p->fkvis;
    const int first = idxp[b * is[0] + h * is[1] + qb * is[2] + j * is[3]] * (int)p->kvblock;
    kv0 = first + (n % per) * 64;
    end = min(p->S, first + (int)p->kvblock);
  }
};

// Each warp owns MT tiles of 16 query rows; a thread holds rows g and g + 8 of each (half 2m and 2m + 1).
// With p.pack > 1 (decoding with grouped heads) a block serves the p.pack query heads that share a key-value
// head: its rows are (query row, head) pairs, row R being query row R / pack of head group * pack + R % pack,
// so that each K and V tile loaded serves every head of the group.
//
// With WGMMA (sm_90a) each warpgroup's 64 rows take their scores and P @ V from wgmma: K and V tiles swizzled
// (wgmma_desc), Q and P in the registers of the same fragments; the rest of the kernel is unchanged, since
// wgmma's accumulators lie in the registers of m16n8k16's.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) ember_flex_attention(const __grid_constant__ Params p) {
#if WGMMA
  // STAGES stages, each K's then V's (E + 63) / 64 swizzled slabs of NT * 8 keys x 64 columns from the first 1 KB
  // boundary; then the stages' full and empty mbarriers and the key ranges of the tiles each holds.
  const int KP = (EK + 63) / 64 * 64, VP = (EV + 63) / 64 * 64;
  extern __shared__ __align__(16) u16 smem_raw[];
  u16* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) / 2;
  const unsigned stage0 = smem_addr(smem), stage_bytes = NT * 8 * (KP + VP) * 2;
  const unsigned bars = stage0 + STAGES * stage_bytes;  // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s)
  // kv0, end, pass of each 64-key tile of stage s at 8 s + 3 * tile
  int* const ranges = (int*)(smem + STAGES * NT * 8 * (KP + VP)) + 4 * STAGES;
#else
  const int KP = EK + 8, VP = EV + 8;  // padded pitches: fragment loads hit distinct banks
  extern __shared__ __align__(16) u16 smem[];
  u16* const ks0 = smem;                    // 2 stages of K [64][KP], then 2 of V [64][VP]
  u16* const vs0 = smem + 2 * 64 * KP;
  const unsigned ks0_addr = smem_addr(ks0), vs0_addr = smem_addr(vs0);
#endif
  const int groups = p.H / p.pack, b = blockIdx.y / groups, h = (blockIdx.y % groups) * p.pack, hk = h / (p.H / p.HKV);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // The longest query tiles first: under a causal mask they visit the most keys, and starting them last
  // would leave the GPU waiting on a few blocks at the end.
  // With splits > 1 (few blocks for the SMs: decoding), blocks x = tile * splits + split share a query tile's
  // keys, each writing unnormalized partial results that ember_flex_combine merges.
  const int split = blockIdx.x % p.splits, tiles = gridDim.x / p.splits;
  const int q0 = (tiles - 1 - (int)(blockIdx.x / p.splits)) * (16 * WARPS * MT);
  int rows[2 * MT], heads[2 * MT];  // each row's query row and head
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    const int packed = q0 + warp * 16 * MT + (r >> 1) * 16 + (r & 1) * 8 + g;
    rows[r] = packed / p.pack, heads[r] = h + packed % p.pack;
  }
  Tiles it{&p, b, h, (int)(q0 / p.pack / p.qblock)};
  it.start(split);
#if WGMMA
  // A producer requests step n's K and V slabs (one or two 64-key tiles) from the TMA into stage n % STAGES
  // once every warp has released that stage's previous step, and writes the tiles' key ranges beside them:
  // with two computing warpgroups a warpgroup of its own, as far ahead as the stages allow, else the block's
  // first thread, AHEAD steps ahead. Each step of a warpgroup then waits for its stage and issues, as one
  // group of wgmmas, this step's scores (S = Q K^T) and the previous step's P @ V; past one wait for both, it
  // releases the previous step's stage and turns the scores into probabilities, which stay in registers (pa)
  // for the next step's product.
  // With two warpgroups, named barriers hand the tensor cores from one to the other: a warpgroup issues its
  // products only after the other has issued its own, so that each one's softmax runs while the other's
  // products do (the ping-pong of FlashAttention-3), where before both multiplied, then both waited.
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1), mbar_init(bars + 8 * (STAGES + s), WARPS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  int requested = 0;  // steps the producer has requested (it walks `it`)
  auto request = [&]() {
    if (!it.valid()) return;
    const int s = requested % STAGES;
    if (requested >= STAGES) mbar_wait(bars + 8 * (STAGES + s), ((requested / STAGES) - 1) & 1);
    mbar_expect(bars + 8 * s, stage_bytes);
    const unsigned ks = stage0 + s * stage_bytes, vs = ks + NT * 8 * KP * 2;
#pragma unroll
    for (int i = 0; i < NT / 8; ++i) {  // a step's tiles; one past the last is loaded past the keys (zeros), masked
      const bool valid = it.valid();
      const int kv0 = valid ? it.kv0 : p.S;
      ranges[8 * s + 3 * i] = kv0, ranges[8 * s + 3 * i + 1] = valid ? it.end : p.S, ranges[8 * s + 3 * i + 2] = 1;
      if (valid) ranges[8 * s + 3 * i + 2] = it.pass, it.next();
#pragma unroll
      for (int c = 0; c < KP / 64; ++c) tma_load(ks + c * SLAB + i * 8192, p.kmap, bars + 8 * s, c * 64, kv0, hk, b);
#pragma unroll
      for (int c = 0; c < VP / 64; ++c) tma_load(vs + c * SLAB + i * 8192, p.vmap, bars + 8 * s, c * 64, kv0, hk, b);
    }
    ++requested;
  };
  const int tiles_of_split = it.total > split ? (it.total - split + p.splits - 1) / p.splits : 0;
  const int steps = (tiles_of_split + NT / 8 - 1) / (NT / 8);
#if PRODUCER_WARPGROUP
  // Registers move from the producer's warpgroup to the two that compute (setmaxnreg: 24 + 2 x 240 per
  // thread of each, 64512 of the SM's 65536).
  if (warp >= WARPS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (warp == WARPS && lane == 0)
      while (it.valid()) request();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
#else
  if (threadIdx.x == 0)
    for (int n = 0; n < AHEAD; ++n) request();
#endif
#endif
  const u16* qp = p.q + b * p.qs[0];
#if !WGMMA
  // A warp whose rows all lie past the queries (a decode step fills one warp's rows at most) takes its share
  // of the loads and barriers and computes nothing: the busy warps get the SM's issue slots.
  const bool idle = (q0 + warp * 16 * MT) / p.pack >= p.L;
#endif
  const bool rows_inside = (q0 + (warp + 1) * 16 * MT - 1) / p.pack < p.L;  // every row of the warp's is a query
  unsigned qa[MT][EK / 16][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int ra = rows[2 * m], rb = rows[2 * m + 1];
#pragma unroll
    for (int kt = 0; kt < EK / 16; ++kt) {
      const int c = kt * 16 + t * 2;
      const u16* qa_row = qp + heads[2 * m] * p.qs[1] + ra * p.qs[2] + c;
      const u16* qb_row = qp + heads[2 * m + 1] * p.qs[1] + rb * p.qs[2] + c;
      qa[m][kt][0] = ra < p.L ? *(const unsigned*)qa_row : 0u;
      qa[m][kt][1] = rb < p.L ? *(const unsigned*)qb_row : 0u;
      qa[m][kt][2] = ra < p.L ? *(const unsigned*)(qa_row + 8) : 0u;
      qa[m][kt][3] = rb < p.L ? *(const unsigned*)(qb_row + 8) : 0u;
    }
  }
  float o[MT][EV / 8][4];
  float mx[2 * MT], sum[2 * MT];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int d = 0; d < EV / 8; ++d) o[m][d][0] = o[m][d][1] = o[m][d][2] = o[m][d][3] = 0.0f;
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) mx[r] = NEG_INF, sum[r] = 0.0f;
  const float LOG2E = 1.4426950408889634f;
  float sc[MT][NT][4];  // a step's scores, then its probabilities
  // Scale, mods and the tile's row maxima; then the online softmax: maxima and sums updated, the
  // accumulators rescaled, sc made probabilities (not yet rounded). A tile of a full block that lies wholly
  // inside the keys and the warp's queries checks nothing per score (most tiles of a long causal attention);
  // the others mask keys past the block or the sequence and rows past the queries, and apply mask_mod in
  // partial blocks. With PLAIN_SCORES (score_mod the identity, a positive scale) the scores stay as the MMA
  // left them: the maxima compare them unscaled, and the exponent's FMA applies scale * log2(e).
  // `range`: kv0, end, pass of each 64-key tile of the step.
  auto softmax = [&](const int* range) {
    float tile[2 * MT];
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) tile[r] = NEG_INF;
    auto mod_scores = [&](const bool checked) {  // called with constants: each call inlines one form
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int kv0 = range[3 * (nt >> 3)], end = range[3 * (nt >> 3) + 1], pass = range[3 * (nt >> 3) + 2];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = rows[2 * m + (e >> 1)], head = heads[2 * m + (e >> 1)];
            const int col = kv0 + (nt & 7) * 8 + t * 2 + (e & 1);
            if (checked) {
              bool keep = col < end && row < p.L;
              if (keep && pass == 0) keep = mask_mod(b, head, row, col, p);
#if PLAIN_SCORES
              if (!keep) sc[m][nt][e] = NEG_INF;
#else
              sc[m][nt][e] = keep ? score_mod(sc[m][nt][e] * p.scale, b, head, row, col, p) * LOG2E : NEG_INF;
#endif
            } else if (!PLAIN_SCORES) {
              sc[m][nt][e] = score_mod(sc[m][nt][e] * p.scale, b, head, row, col, p) * LOG2E;
            }
          }
          tile[2 * m] = fmaxf(tile[2 * m], fmaxf(sc[m][nt][0], sc[m][nt][1]));
          tile[2 * m + 1] = fmaxf(tile[2 * m + 1], fmaxf(sc[m][nt][2], sc[m][nt][3]));
        }
    };
    bool plain = rows_inside;  // every tile of the step in a full block, inside the keys
#pragma unroll
    for (int i = 0; i < NT / 8; ++i) plain = plain && range[3 * i + 2] == 1 && range[3 * i] + 64 <= range[3 * i + 1];
    if (plain) mod_scores(false);
    else mod_scores(true);
    const float to_log2 = PLAIN_SCORES ? p.scale * LOG2E : 1.0f;
    float base[2 * MT], rescale[2 * MT];
    bool moved = false;  // some row's maximum grew
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      tile[r] = fmaxf(tile[r], __shfl_xor_sync(0xffffffffu, tile[r], 1));
      tile[r] = fmaxf(tile[r], __shfl_xor_sync(0xffffffffu, tile[r], 2));
      tile[r] = fmaxf(mx[r], tile[r] * to_log2);
      base[r] = tile[r] == NEG_INF ? 0.0f : tile[r];  // a row with no key yet: 2^(-inf - 0) = 0, scale 1
      rescale[r] = ex2(mx[r] - base[r]);
      mx[r] = tile[r];
      sum[r] *= rescale[r];
      moved = moved || rescale[r] != 1.0f;
    }
    // The accumulators scale only in a warp where some row's maximum grew: past a long row's first tiles most
    // steps leave every maximum where it was.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) {
        const int m = r >> 1, e = (r & 1) * 2;
#pragma unroll
        for (int d = 0; d < EV / 8; ++d) o[m][d][e] *= rescale[r], o[m][d][e + 1] *= rescale[r];
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        sc[m][nt][0] = ex2(fmaf(sc[m][nt][0], to_log2, -base[2 * m])), sc[m][nt][1] = ex2(fmaf(sc[m][nt][1], to_log2, -base[2 * m]));
        sc[m][nt][2] = ex2(fmaf(sc[m][nt][2], to_log2, -base[2 * m + 1]));
        sc[m][nt][3] = ex2(fmaf(sc[m][nt][3], to_log2, -base[2 * m + 1]));
        sum[2 * m] += sc[m][nt][0] + sc[m][nt][1], sum[2 * m + 1] += sc[m][nt][2] + sc[m][nt][3];
      }
  };
#if WGMMA
  // Every warpgroup computes, an idle one's rows masked: a branch around the wgmmas makes ptxas serialize them.
  const int wg = warp >> 2;
  const bool pingpong = WARPS == 8;
  unsigned pa[NT / 2][4];  // the previous step's probabilities, read by the tensor cores until the wait
  auto scores = [&](const int n) {  // issues step n's S = Q K^T
    const unsigned ks = stage0 + (n % STAGES) * stage_bytes;
#pragma unroll
    for (int kt = 0; kt < EK / 16; ++kt)
      WGMMA_S(&sc[0][0][0], qa[0][kt], wgmma_desc(ks + (kt >> 2) * SLAB + (kt & 3) * 32, 16), kt > 0);
  };
  auto values = [&](const int n) {  // issues O += P V of step n
    const unsigned vs = stage0 + (n % STAGES) * stage_bytes + NT * 8 * KP * 2;
#pragma unroll
    for (int kt = 0; kt < NT / 2; ++kt) WGMMA_O(&o[0][0][0], pa[kt], wgmma_desc(vs + kt * 2048, SLAB), 1);
  };
  auto probabilities = [&](const int n) {  // step n's softmax; its probabilities, rounded, into pa
    int range[3 * NT / 8];  // in registers: mask_mod's loads come between their uses
#pragma unroll
    for (int i = 0; i < 3 * NT / 8; ++i) range[i] = ranges[8 * (n % STAGES) + i];
    softmax(range);
#pragma unroll
    for (int kt = 0; kt < NT / 2; ++kt) {
      pa[kt][0] = pack2(sc[0][2 * kt][0], sc[0][2 * kt][1]), pa[kt][1] = pack2(sc[0][2 * kt][2], sc[0][2 * kt][3]);
      pa[kt][2] = pack2(sc[0][2 * kt + 1][0], sc[0][2 * kt + 1][1]);
      pa[kt][3] = pack2(sc[0][2 * kt + 1][2], sc[0][2 * kt + 1][3]);
    }
  };
  if (steps > 0) {
    // Named barrier 1 + w: warpgroup w's turn to issue. Each warpgroup's turns are steps + 1 (the first step's
    // scores alone, then scores and the previous P @ V, then the last P @ V alone); the second warpgroup's
    // first hand-over starts the first's turns, so it skips its last one.
    if (pingpong && wg == 1) bar_arrive(1);
    mbar_wait(bars, 0);
    if (pingpong) bar_sync(1 + wg);
    wgmma_fence();
    scores(0);
    wgmma_commit();
    if (pingpong) bar_arrive(2 - wg);
    WGMMA_WAIT_S(&sc[0][0][0]);
    if (!PRODUCER_WARPGROUP && threadIdx.x == 0) request();
    probabilities(0);
    for (int n = 1; n < steps; ++n) {
      mbar_wait(bars + 8 * (n % STAGES), (n / STAGES) & 1);
      if (pingpong) bar_sync(1 + wg);
      wgmma_fence();
      scores(n);
      values(n - 1);
      wgmma_commit();
      if (pingpong) bar_arrive(2 - wg);
      WGMMA_WAIT_S(&sc[0][0][0]);
      WGMMA_WAIT_O(&o[0][0][0]);
      if (lane == 0) mbar_arrive(bars + 8 * (STAGES + (n - 1) % STAGES));
      if (!PRODUCER_WARPGROUP && threadIdx.x == 0) request();
      probabilities(n);
    }
    if (pingpong) bar_sync(1 + wg);
    wgmma_fence();
    values(steps - 1);
    wgmma_commit();
    if (pingpong && wg == 0) bar_arrive(2);
    WGMMA_WAIT_O(&o[0][0][0]);
  }
#else
  const u16* kp = p.k + b * p.ks[0] + hk * p.ks[1];
  const u16* vp = p.v + b * p.vs[0] + hk * p.vs[1];
  // Neighbouring threads copy neighbouring 16 bytes of a row.
  auto load = [&](int stage, int kv0) {
    const unsigned ks = ks0_addr + stage * 64 * KP * 2, vs = vs0_addr + stage * 64 * VP * 2;
    for (int i = threadIdx.x; i < 64 * EK / 8; i += WARPS * 32) {
      const int row = i / (EK / 8), c = i % (EK / 8);
      const bool ok = kv0 + row < p.S;
      copy16(ks + (row * KP + c * 8) * 2, kp + (ok ? (kv0 + row) * p.ks[2] + c * 8 : 0), ok);
    }
    for (int i = threadIdx.x; i < 64 * EV / 8; i += WARPS * 32) {
      const int row = i / (EV / 8), c = i % (EV / 8);
      const bool ok = kv0 + row < p.S;
      copy16(vs + (row * VP + c * 8) * 2, vp + (ok ? (kv0 + row) * p.vs[2] + c * 8 : 0), ok);
    }
    asm volatile("cp.async.commit_group;");
  };
  // One barrier per step: past it, this step's tile has landed (each thread waited for its own copies) and
  // every warp is done with the previous step's, whose stage the next tile's copies then fill while this one
  // computes. The iterator runs a tile ahead of the loads, so that its index read has a step to arrive.
  int stage = 0;
  if (it.valid()) load(0, it.kv0);
  int next_kv0 = it.kv0, next_end = it.end, next_pass = it.pass;
  bool more = it.valid();
  it.next();
  while (more) {
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
    const int kv0 = next_kv0, end = next_end, pass = next_pass, this_stage = stage;
    more = it.valid();
    stage ^= 1;
    if (more) {
      load(stage, it.kv0);
      next_kv0 = it.kv0, next_end = it.end, next_pass = it.pass;
    }
    it.next();
    if (idle) continue;
    const u16* ks = ks0 + this_stage * 64 * KP;
    const u16* vs = vs0 + this_stage * 64 * VP;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int m = 0; m < MT; ++m) sc[m][nt][0] = sc[m][nt][1] = sc[m][nt][2] = sc[m][nt][3] = 0.0f;
#pragma unroll
      for (int kt = 0; kt < EK / 16; kt += 2) {  // K fragments of two 16-wide steps by one ldmatrix
        const u16* kr = ks + (nt * 8 + (lane & 7)) * KP + kt * 16 + (lane >> 3) * 8;
        unsigned kb[4];
        if (kt + 1 < EK / 16) ldmatrix_x4(kb, kr);
        else ldmatrix_x2(kb, kr);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma(sc[m][nt], qa[m][kt], kb[0], kb[1]);
          if (kt + 1 < EK / 16) mma(sc[m][nt], qa[m][kt + 1], kb[2], kb[3]);
        }
      }
    }
    const int range[3] = {kv0, end, pass};
    softmax(range);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      unsigned pa[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        pa[m][0] = pack2(sc[m][2 * kt][0], sc[m][2 * kt][1]), pa[m][1] = pack2(sc[m][2 * kt][2], sc[m][2 * kt][3]);
        pa[m][2] = pack2(sc[m][2 * kt + 1][0], sc[m][2 * kt + 1][1]);
        pa[m][3] = pack2(sc[m][2 * kt + 1][2], sc[m][2 * kt + 1][3]);
      }
#pragma unroll
      for (int d = 0; d < EV / 8; d += 2) {  // V^T fragments of two 8-wide column tiles by one ldmatrix
        unsigned vb[4];
        ldmatrix_x4_trans(vb, vs + (kt * 16 + (lane & 15)) * VP + (d + (lane >> 4)) * 8);
#pragma unroll
        for (int m = 0; m < MT; ++m) mma(o[m][d], pa[m], vb[0], vb[1]), mma(o[m][d + 1], pa[m], vb[2], vb[3]);
      }
    }
  }
#endif
  u16* op = p.out + b * p.os[0];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    float l = sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = rows[r], bh = b * p.H + heads[r], m = r >> 1, e = (r & 1) * 2;
    if (row >= p.L) continue;
    if (p.splits > 1) {
      const i64 at = ((i64)split * p.B * p.H + bh) * p.L + row;
#pragma unroll
      for (int d = 0; d < EV / 8; ++d) {
        p.part_o[at * EV + d * 8 + t * 2] = o[m][d][e];
        p.part_o[at * EV + d * 8 + t * 2 + 1] = o[m][d][e + 1];
      }
      if (t == 0) p.part_ml[at * 2] = mx[r], p.part_ml[at * 2 + 1] = l;
      continue;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    u16* const orow = op + heads[r] * p.os[1] + row * p.os[2];
#pragma unroll
    for (int d = 0; d < EV / 8; ++d) {
      const i64 c = (d * 8 + t * 2) * p.os[3];
      const unsigned w = pack2(o[m][d][e] * inv, o[m][d][e + 1] * inv);
      if (p.os[3] == 1) {  // the pair as one word (the output's strides are even: at::empty's, E a multiple of 16)
        *(unsigned*)(orow + c) = w;
      } else {
        orow[c] = (u16)(w & 0xffffu);
        orow[c + p.os[3]] = (u16)(w >> 16);
      }
    }
    if (t == 0) {
      const i64 at = (i64)bh * p.L + row;
      p.lse[at] = l > 0.0f ? mx[r] + log2f(l) : NEG_INF;
      p.mx[at] = mx[r];
    }
  }
}

// Merges the splits' partial results: one thread per output element.
extern "C" __global__ void ember_flex_combine(Params p) {
  const i64 rows = (i64)p.B * p.H * p.L;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < rows * EV; i += (i64)gridDim.x * blockDim.x) {
    const i64 row = i / EV;
    const int d = (int)(i % EV);
    float top = NEG_INF;
    for (int s = 0; s < p.splits; ++s) top = fmaxf(top, p.part_ml[(s * rows + row) * 2]);
    const float base = top == NEG_INF ? 0.0f : top;
    float l = 0.0f, acc = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
      const float w = ex2(p.part_ml[(s * rows + row) * 2] - base);
      l += w * p.part_ml[(s * rows + row) * 2 + 1];
      acc += w * p.part_o[(s * rows + row) * EV + d];
    }
    const int bh = (int)(row / p.L), r = (int)(row % p.L), b = bh / p.H, h = bh % p.H;
    const float value = l > 0.0f ? acc / l : 0.0f;
    p.out[b * p.os[0] + h * p.os[1] + r * p.os[2] + d * p.os[3]] = (u16)(pack2(value, 0.0f) & 0xffffu);
    if (d == 0) p.lse[row] = l > 0.0f ? top + log2f(l) : NEG_INF, p.mx[row] = top;
  }
}
)";
  return s;
}

// A 16-bit operand as the kernel reads it: last dimension contiguous, 16-byte rows and aligned base.
at::Tensor readable(const at::Tensor& x) {
  bool ok = x.stride(3) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) ok = ok && (x.stride(d) % 8 == 0 || x.size(d) == 1);
  return ok ? x : x.contiguous();
}

// The TMA's map of K or V ([B, H, S, E], readable) for the wgmma kernel's 64 x 64 swizzled slabs. A size-1
// dimension's stride is any the TMA takes: the one a contiguous tensor would have.
bool tile_map(unsigned long long* map, const at::Tensor& x) {
  uint64_t dims[4], strides[3];
  int64_t inner = ((x.size(3) + 7) / 8) * 8;  // elements a step of dimension 2 spans where its size is 1
  for (int d = 2; d >= 0; --d) {
    const int64_t stride = x.size(d) == 1 ? inner : x.stride(d);
    strides[2 - d] = static_cast<uint64_t>(stride) * 2;
    inner = stride * x.size(d);
  }
  for (int d = 0; d < 4; ++d) dims[d] = static_cast<uint64_t>(x.size(3 - d));
  return tile_map_16bit(map, x.data_ptr(), dims, strides);
}

// Strides of a block-mask tensor with its size-1 (broadcast) dimensions at stride 0.
void mask_strides(const at::Tensor& t, long long* out) {
  for (int64_t d = 0; d < t.dim(); ++d) out[d] = t.size(d) == 1 ? 0 : t.stride(d);
}

class FlexAttention final : public FastPath {
 public:
  FlexAttention(void* function, void* combine, std::vector<int32_t> inputs, const ListSlot* buffers, std::vector<int32_t> outputs,
                float scale, int64_t q_block, int64_t kv_block, int ev, int rows, int threads, unsigned shared_bytes, bool wgmma,
                bool plain_scores)
      : function_(function), combine_(combine), inputs_(std::move(inputs)), outputs_(std::move(outputs)), scale_(scale),
        q_block_(q_block), kv_block_(kv_block), ev_(ev), rows_(rows), threads_(threads), shared_bytes_(shared_bytes),
        wgmma_(wgmma), plain_scores_(plain_scores) {
    if (buffers) buffers_ = *buffers;
  }

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* in[7] = {};
    for (int i = 0; i < 7; ++i)
      if (inputs_[i] >= 0) in[i] = buffer_tensor(buffers, static_cast<uint32_t>(inputs_[i]));
    if (!in[0] || !in[1] || !in[2] || !in[3] || !in[4] || in[0]->dim() != 4) return false;
    const at::Tensor& query = *in[0];
    const at::Tensor q = readable(query);
    at::Tensor k = readable(*in[1]), v = readable(*in[2]);
    const int64_t B = q.size(0), H = q.size(1), L = q.size(2), HKV = k.size(1), S = k.size(2);
    if (HKV == 0 || H % HKV != 0 || v.size(3) != ev_ || B * H > 65535) return false;  // grid.y holds B * H
    // The output in the query's dimension order (as flex_attention and the op's fake give it).
    std::array<int64_t, 4> order{0, 1, 2, 3};
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return query.stride(a) > query.stride(b); });
    std::array<int64_t, 4> sizes{B, H, L, ev_}, permuted{};
    for (int d = 0; d < 4; ++d) permuted[d] = sizes[order[d]];
    at::Tensor raw = at::empty(permuted, q.options());
    std::array<int64_t, 4> inverse{};
    for (int d = 0; d < 4; ++d) inverse[order[d]] = d;
    at::Tensor out = raw.permute(inverse);
    at::Tensor lse = at::empty({B, H, L}, q.options().dtype(at::kFloat));
    at::Tensor mx = at::empty({B, H, L}, q.options().dtype(at::kFloat));
    if (out.numel() > 0) {
      Params p{};
      // A layout the TMA takes no map of (a stride 0: keys broadcast over a dimension) is copied first.
      if (wgmma_ && !tile_map(p.kmap, k) && !tile_map(p.kmap, k = k.contiguous())) return false;
      if (wgmma_ && !tile_map(p.vmap, v) && !tile_map(p.vmap, v = v.contiguous())) return false;
      p.q = static_cast<const unsigned short*>(q.data_ptr());
      p.k = static_cast<const unsigned short*>(k.data_ptr());
      p.v = static_cast<const unsigned short*>(v.data_ptr());
      p.out = static_cast<unsigned short*>(out.data_ptr());
      p.lse = lse.data_ptr<float>();
      p.mx = mx.data_ptr<float>();
      for (int d = 0; d < 3; ++d) p.qs[d] = q.stride(d), p.ks[d] = k.stride(d), p.vs[d] = v.stride(d);
      for (int d = 0; d < 4; ++d) p.os[d] = out.stride(d);
      p.kvn = in[3]->data_ptr<int>();
      p.kvi = in[4]->data_ptr<int>();
      mask_strides(*in[3], p.kvns);
      mask_strides(*in[4], p.kvis);
      if (in[5] && in[6]) {
        p.fkvn = in[5]->data_ptr<int>();
        p.fkvi = in[6]->data_ptr<int>();
        mask_strides(*in[5], p.fkvns);
        mask_strides(*in[6], p.fkvis);
      }
      for (size_t i = 0; i < buffers_.items.size() && i < kBuffers; ++i) {
        const int32_t b = buffers_.item_buffer[i];
        const at::Tensor* t = b >= 0 ? buffer_tensor(buffers, static_cast<uint32_t>(b))
                                     : (buffers_.items[i].isTensor() ? &buffers_.items[i].toTensor() : nullptr);
        if (!t) return false;
        p.buf[i] = t->data_ptr();
        for (int64_t d = 0; d < t->dim() && d < 4; ++d) p.bs[i][d] = t->stride(d);
      }
      p.qblock = q_block_, p.kvblock = kv_block_;
      p.B = static_cast<int>(B), p.H = static_cast<int>(H), p.HKV = static_cast<int>(HKV);
      p.L = static_cast<int>(L), p.S = static_cast<int>(S);
      p.scale = scale_;
      // Decoding with grouped heads (fewer query rows than a block's): a block takes the query heads that
      // share a key-value head (pack), so each key and value is read once per group instead of once per head.
      // The BlockMask must then be the same for every head (its head dimension 1), and the group must divide
      // the block's rows.
      const int64_t group = H / HKV;
      bool pack = group > 1 && L < rows_ && rows_ % group == 0;
      for (int i = 3; i < 7 && pack; ++i) pack = !in[i] || in[i]->size(1) == 1;
      p.pack = pack ? static_cast<int>(group) : 1;
      const int device = q.get_device();
      c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
      c10::DeviceGuard guard(dev);
      void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(dev).native_handle();
      // Fewer query tiles than SMs (decoding: one query row, a long cache): split each tile's keys over up to
      // 16 blocks, about 8 blocks per SM in all, whose partial results ember_flex_combine merges.
      const int64_t tiles = (L * p.pack + rows_ - 1) / rows_, heads = H / p.pack;
      const int64_t sms = multiprocessor_count(device);
      int64_t splits = 1;
      if (tiles * B * heads < sms && S >= 4 * kTile)
        splits = std::min<int64_t>({kMaxSplits, (8 * sms) / (tiles * B * heads), (S + kTile - 1) / kTile});
      at::Tensor part_o, part_ml;
      p.splits = static_cast<int>(std::max<int64_t>(1, splits));
      if (p.splits > 1) {
        part_o = at::empty({p.splits, B * H, L, ev_}, q.options().dtype(at::kFloat));
        part_ml = at::empty({p.splits, B * H, L, 2}, q.options().dtype(at::kFloat));
        p.part_o = part_o.data_ptr<float>();
        p.part_ml = part_ml.data_ptr<float>();
      }
      launch(function_, static_cast<unsigned>(tiles * p.splits), static_cast<unsigned>(threads_), stream, &p, device,
             static_cast<unsigned>(B * heads), shared_bytes_);
      if (p.splits > 1) {
        const int64_t total = B * H * L * ev_;
        const int64_t blocks = std::min<int64_t>((total + 255) / 256, sms * 8);
        launch(combine_, static_cast<unsigned>(blocks), 256, stream, &p, device);
      }
    } else if (lse.numel() > 0) {
      lse.fill_(-std::numeric_limits<float>::infinity());
      mx.fill_(-std::numeric_limits<float>::infinity());
    }
    const at::Tensor* results[3] = {&out, &lse, &mx};
    for (int i = 0; i < 3; ++i)
      if (outputs_[i] >= 0) buffers[outputs_[i]] = *results[i];
    calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::string describe() const override {
    return std::string("cuda flex attention kernel (") + (wgmma_ ? "wgmma, " : "mma.sync, ") +
           (plain_scores_ ? "plain scores, " : "") + std::to_string(calls_.load(std::memory_order_relaxed)) + " calls)";
  }

 private:
  void* function_;
  void* combine_;  // merges split blocks' partial results
  std::vector<int32_t> inputs_;  // query, key, value, kv_num_blocks, kv_indices, full ones: buffer or -1
  ListSlot buffers_;
  std::vector<int32_t> outputs_;
  float scale_;
  int64_t q_block_, kv_block_;
  int ev_;
  int rows_;     // query rows per block: 16 per row tile of each warp
  int threads_;  // per block, 32 per warp (the wgmma kernel's producer warpgroup included)
  unsigned shared_bytes_;  // two stages of K and V tiles
  bool wgmma_;             // the products by wgmma (sm_90a), else by m16n8k16 MMAs
  bool plain_scores_;      // no score_mod: the scale applied in the exponent
  mutable std::atomic<uint64_t> calls_{0};
};

const std::string* string_arg(const Node& n, size_t i, const char* name) {
  const Arg* a = n.arg(i, name);
  return a && a->kind == Arg::Kind::String ? &a->s : nullptr;
}

std::shared_ptr<const FastPath> make_flex_attention(const Node& n, const Step& step, const Tuning&) {
  if (n.op != "ember::flex_attention" || step.outputs.size() != 3) return nullptr;
  const std::string* score_mod = string_arg(n, 12, "score_mod");
  const std::string* mask_mod = string_arg(n, 13, "mask_mod");
  const Arg* scale = n.arg(9, "scale");
  const Arg* q_block = n.arg(10, "q_block");
  const Arg* kv_block = n.arg(11, "kv_block");
  if (!score_mod || !mask_mod || !scale || !q_block || !kv_block || q_block->kind != Arg::Kind::Int ||
      kv_block->kind != Arg::Kind::Int || (q_block->i % kTile) || (kv_block->i % kTile))
    return nullptr;
  const Value* query = n.args[0].is_value() ? n.args[0].value : nullptr;
  const Value* value = n.args[2].is_value() ? n.args[2].value : nullptr;
  if (!query || !value || !query->type.is_tensor() || !value->type.is_tensor()) return nullptr;
  const TensorType& qt = query->type.tensor;
  const TensorType& vt = value->type.tensor;
  if (!qt.device.is_cuda() || qt.sizes.size() != 4 || !qt.sizes[3].is_constant() || !vt.sizes[3].is_constant() ||
      (qt.dtype != c10::kHalf && qt.dtype != c10::kBFloat16))
    return nullptr;
  const int ek = static_cast<int>(qt.sizes[3].value), ev = static_cast<int>(vt.sizes[3].value);
  auto head_dim = [](int e) { return e > 0 && e <= 128 && e % 16 == 0; };  // 16-wide MMA steps, registers
  if (!head_dim(ek) || !head_dim(ev)) return nullptr;
  std::vector<int32_t> inputs(7, -1);
  for (uint32_t slot = 0; slot < 7; ++slot)
    if (std::optional<uint32_t> b = slot_buffer(step, slot)) inputs[slot] = static_cast<int32_t>(*b);
  const ListSlot* list = nullptr;
  for (const ListSlot& l : step.lists)
    if (l.slot == 7) list = &l;
  if (list && list->items.size() > static_cast<size_t>(kBuffers)) return nullptr;
  const Arg* buffers = n.arg(7, "buffers");
  if (!list && buffers && buffers->kind == Arg::Kind::List && !buffers->list.empty()) return nullptr;
  const int device = qt.device.has_index() ? qt.device.index() : 0;
  try {
    std::string why;
    if (!available(&why)) return nullptr;
    const std::string target = arch(device);
    if (std::stoi(target.substr(3)) < 80) return nullptr;  // m16n8k16 16-bit MMAs
    // One 16-row tile per warp. Two (flex_source's mt = 2; head dims up to 64) let each K and V fragment feed
    // two MMAs but spill and halve the blocks per SM: on the H100, bench/hops.py's flex 0.195 -> 0.189 ms,
    // flex_long 0.474 -> 0.712 ms.
    constexpr int mt = 1;
    // Head dims up to 64: 4 warps, registers for 3 blocks per SM. Wider: 2 blocks per SM (3 spill), and 8
    // warps where the BlockMask's query blocks hold 128 rows, so that each K and V tile serves twice the rows.
    const bool narrow = ek <= 64 && ev <= 64;
    // A few query rows (decoding) take 4 warps: the rows past them are computed and dropped.
    const bool few_rows = qt.sizes[2].is_constant() && qt.sizes[2].value <= 4 * 16;
    const int warps = !narrow && !few_rows && q_block->i % (8 * 16 * mt) == 0 ? 8 : 4;
    const int min_blocks = narrow ? 3 : (warps == 8 ? 1 : 2);
    // On Hopper (sm_90) prefill takes its two products from wgmma, compiled for sm_90a; decoding keeps the
    // m16n8k16 kernel (a warpgroup computes 64 rows). EMBER_FLEX_WGMMA=0 keeps it everywhere (tests run both).
    const bool wgmma_off = config_is("EMBER_FLEX_WGMMA", "0");  // read per plan built: tests switch it
    const bool wgmma = target == "sm_90" && !few_rows && mt == 1 && !wgmma_off;
    const double s = scale->kind == Arg::Kind::Float ? scale->f : static_cast<double>(scale->i);
    const bool plain_scores = *score_mod == "return (float)(score);" && s > 0;  // flex.py's text of the identity
    const std::vector<void*> functions =
        compile(flex_source(qt.dtype == c10::kBFloat16, ek, ev, mt, min_blocks, warps, *score_mod, *mask_mod, wgmma,
                            plain_scores),
                std::vector<std::string>{"ember_flex_attention", "ember_flex_combine"}, device, nullptr, wgmma);
    void* function = functions.at(0);
    // Two stages of K and V tiles in padded rows; or (wgmma) wgmma_stages() of whole swizzled slabs from a 1 KB
    // boundary, then their barriers and key ranges.
    const auto slabs = [](int e) { return (e + 63) / 64 * 64; };
    const unsigned shared_bytes =
        wgmma ? wgmma_stages(warps) * 8 * score_tiles(true, warps) * (slabs(ek) + slabs(ev)) * 2 + 1024 + 48 * wgmma_stages(warps)
              : 2 * kTile * (ek + ev + 16) * 2;
    if (shared_bytes > 48 * 1024) {
      if (static_cast<int>(shared_bytes) > max_shared_memory_optin(device)) return nullptr;
      set_max_dynamic_shared_memory(function, static_cast<int>(shared_bytes));
    }
    return std::make_shared<FlexAttention>(function, functions.at(1), std::move(inputs), list, step.outputs, static_cast<float>(s),
                                           q_block->i, kv_block->i, ev, 16 * warps * mt,
                                           32 * warps + (wgmma && warps == 8 ? 128 : 0), shared_bytes, wgmma,
                                           plain_scores);
  } catch (const std::exception&) {
    return nullptr;  // the op's dense implementation runs
  }
}

const bool registered = (register_fast_path(&make_flex_attention), true);

}  // namespace
}  // namespace ember::cuda

// Matmul epilogues: the epilogue pass (IR text in, IR text out), canonicalize, and the oneDNN kernel
// against ATen on random inputs (odd sizes, strided operands, residuals, weights changed between calls);
// the few-rows loop (kernels/cpu/gemv.cpp) in each instruction set this CPU runs, against ATen.
#include "ember/compiler.h"
#include "ember/config.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/onednn.h"
#include "passes/passes.h"

#include <ATen/ATen.h>
#include <cstdlib>
#include <gtest/gtest.h>
#include <limits>

namespace ember {
namespace {

std::string run_pass(void (*pass)(Graph&, PassContext&), const std::string& in) {
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  pass(g, ctx);
  g.verify();
  return print(g);
}

std::shared_ptr<CompiledGraph> compile_text(const std::string& text, std::vector<std::string> disabled = {}) {
  CompileOptions options;
  options.disabled_passes = std::move(disabled);
  return compile(parse(text), {}, options);
}

int onednn_steps(const CompiledGraph& g) {
  int n = 0;
  for (const Step& s : g.plan().steps)
    if (s.kernel && s.kernel->describe().rfind("onednn", 0) == 0) ++n;
  return n;
}

at::Tensor t(const c10::IValue& v) { return v.toTensor(); }

const char* kLinearRelu =
    "graph(%x: f32[7, 13]{13, 1}@cpu, %w: f32[5, 13]{13, 1}@cpu, %b: f32[5]{1}@cpu):\n"
    "  %wt: f32[13, 5]{1, 13}@cpu = aten::permute(%w, [1, 0])\n"
    "  %y: f32[7, 5]{5, 1}@cpu = aten::addmm(%b, %x, %wt)\n"
    "  %r: f32[7, 5]{5, 1}@cpu = aten::relu(%y)\n"
    "  %s: f32[7, 5]{5, 1}@cpu = aten::mul.Tensor(%r, 0.5)\n"
    "  %e: f32[7, 5]{5, 1}@cpu = aten::exp(%s)\n"
    "  return (%e)\n";

TEST(EpiloguePass, ClaimsMatmulAndItsPointwiseChain) {
  const std::string expected =
      "graph(%x: f32[7, 13]{13, 1}@cpu, %w: f32[5, 13]{13, 1}@cpu, %b: f32[5]{1}@cpu):\n"
      "  %wt: f32[13, 5]{1, 13}@cpu = aten::permute(%w, [1, 0])\n"
      "  %y: f32[7, 5]{5, 1}@cpu = aten::addmm(%b, %x, %wt) #0\n"
      "  %r: f32[7, 5]{5, 1}@cpu = aten::relu(%y) #0\n"
      "  %s: f32[7, 5]{5, 1}@cpu = aten::mul.Tensor(%r, 0.5) #0\n"
      "  %e: f32[7, 5]{5, 1}@cpu = aten::exp(%s)\n"
      "  return (%e)\n";
  EXPECT_EQ(run_pass(claim_matmul_epilogues, kLinearRelu), expected);
}

TEST(EpiloguePass, StopsAtSharedValuesLateAddendsAndBroadcastingUp) {
  // %y is read twice: the matmul stands alone (its weights a parameter of an inference graph: claimed for
  // packing). %late is made after the matmul: the add stays out.
  const std::string in =
      "graph(%x: f32[4, 3]{3, 1}@cpu, %w: f32[3, 6]{6, 1}@cpu, %c: f32[4, 6]{6, 1}@cpu):\n"
      "  %y: f32[4, 6]{6, 1}@cpu = aten::mm(%x, %w)\n"
      "  %a: f32[4, 6]{6, 1}@cpu = aten::relu(%y)\n"
      "  %b: f32[4, 6]{6, 1}@cpu = aten::sigmoid(%y)\n"
      "  %m: f32[4, 6]{6, 1}@cpu = aten::mm(%x, %w)\n"
      "  %late: f32[4, 6]{6, 1}@cpu = aten::cos(%c)\n"
      "  %z: f32[4, 6]{6, 1}@cpu = aten::add.Tensor(%m, %late)\n"
      "  return (%a, %b, %z)\n";
  const std::string expected =
      "graph(%x: f32[4, 3]{3, 1}@cpu, %w: f32[3, 6]{6, 1}@cpu, %c: f32[4, 6]{6, 1}@cpu):\n"
      "  %y: f32[4, 6]{6, 1}@cpu = aten::mm(%x, %w) #0\n"
      "  %a: f32[4, 6]{6, 1}@cpu = aten::relu(%y)\n"
      "  %b: f32[4, 6]{6, 1}@cpu = aten::sigmoid(%y)\n"
      "  %m: f32[4, 6]{6, 1}@cpu = aten::mm(%x, %w) #1\n"
      "  %late: f32[4, 6]{6, 1}@cpu = aten::cos(%c)\n"
      "  %z: f32[4, 6]{6, 1}@cpu = aten::add.Tensor(%m, %late)\n"
      "  return (%a, %b, %z)\n";
  Graph g = parse(in);
  CompileOptions options;
  options.cached_inputs = {false, true, false};
  PassContext ctx{options};
  claim_matmul_epilogues(g, ctx);
  EXPECT_EQ(print(g), expected);
}

TEST(EpiloguePass, LoneMatmulsAreClaimedOnlyForParameterWeights) {
  // softmax(a @ b) with both operands passed by the caller, in an inference graph whose parameters are known
  // (CompileOptions::cached_inputs): nothing to pack, the matmul stays ATen's. With %b a parameter it is
  // claimed for packing. With the parameters unknown (a training graph, whose backward reads activations as
  // inputs) it stays ATen's, unless EMBER_TRAINING_MATMULS=onednn.
  const std::string in =
      "graph(%a: f32[4, 3]{3, 1}@cpu, %b: f32[3, 6]{6, 1}@cpu):\n"
      "  %y: f32[4, 6]{6, 1}@cpu = aten::mm(%a, %b)\n"
      "  %s: f32[4, 6]{6, 1}@cpu = aten::_softmax(%y, -1, false)\n"
      "  return (%s)\n";
  auto claimed = [&](std::vector<bool> cached) {
    Graph g = parse(in);
    CompileOptions options;
    options.cached_inputs = std::move(cached);
    PassContext ctx{options};
    claim_matmul_epilogues(g, ctx);
    return print(g).find("aten::mm(%a, %b) #0") != std::string::npos;
  };
  EXPECT_FALSE(claimed({false, false}));
  EXPECT_TRUE(claimed({false, true}));
  EXPECT_FALSE(claimed({}));
  config_set("EMBER_TRAINING_MATMULS", "onednn");
  const bool forced = claimed({});
  config_set("EMBER_TRAINING_MATMULS", std::nullopt);
  EXPECT_TRUE(forced);
}

TEST(EpiloguePass, LeavesCudaAndDoubleMatmulsAlone) {
  const std::string in =
      "graph(%x: f64[4, 3]{3, 1}@cpu, %w: f64[3, 6]{6, 1}@cpu, %u: f32[4, 3]{3, 1}@cuda:0, %v: f32[3, 6]{6, 1}@cuda:0):\n"
      "  %y: f64[4, 6]{6, 1}@cpu = aten::mm(%x, %w)\n"
      "  %a: f64[4, 6]{6, 1}@cpu = aten::relu(%y)\n"
      "  %g: f32[4, 6]{6, 1}@cuda:0 = aten::mm(%u, %v)\n"
      "  %h: f32[4, 6]{6, 1}@cuda:0 = aten::relu(%g)\n"
      "  return (%a, %h)\n";
  EXPECT_EQ(run_pass(claim_matmul_epilogues, in), in);
}

TEST(Canonicalize, DropsNoOpClonesAliasesAndPermutePairs) {
  const std::string in =
      "graph(%x: f32[4, 3]{3, 1}@cpu):\n"
      "  %c: f32[4, 3]{3, 1}@cpu = aten::clone(%x)\n"
      "  %a: f32[4, 3]{3, 1}@cpu = aten::alias(%c)\n"
      "  %p: f32[3, 4]{1, 3}@cpu = aten::permute(%a, [1, 0])\n"
      "  %q: f32[4, 3]{3, 1}@cpu = aten::permute(%p, [1, 0])\n"
      "  %pc: f32[3, 4]{4, 1}@cpu = aten::clone(%p, memory_format=contiguous_format)\n"
      "  %s: f32[4, 3]{3, 1}@cpu = aten::sin(%q)\n"
      "  %o: f32[4, 3]{3, 1}@cpu = aten::clone(%s)\n"
      "  return (%o, %pc)\n";
  const std::string expected =
      "graph(%x: f32[4, 3]{3, 1}@cpu):\n"
      "  %c: f32[4, 3]{3, 1}@cpu = aten::clone(%x)\n"
      "  %a: f32[4, 3]{3, 1}@cpu = aten::alias(%x)\n"
      "  %p: f32[3, 4]{1, 3}@cpu = aten::permute(%x, [1, 0])\n"
      "  %q: f32[4, 3]{3, 1}@cpu = aten::permute(%p, [1, 0])\n"
      "  %pc: f32[3, 4]{4, 1}@cpu = aten::clone(%p, memory_format=contiguous_format)\n"
      "  %s: f32[4, 3]{3, 1}@cpu = aten::sin(%x)\n"
      "  %o: f32[4, 3]{3, 1}@cpu = aten::clone(%s)\n"
      "  return (%o, %pc)\n";
  EXPECT_EQ(run_pass(canonicalize, in), expected);
  // With an in-place write anywhere, nothing is touched.
  const std::string mutating =
      "graph(%x: f32[4]{1}@cpu, %buf: f32[4]{1}@cpu):\n"
      "  %c: f32[4]{1}@cpu = aten::clone(%x)\n"
      "  %d: f32[4]{1}@cpu = aten::copy_(%buf, %c)\n"
      "  return (%d)\n";
  EXPECT_EQ(run_pass(canonicalize, mutating), mutating);
  // A clone whose view is returned stays: the caller must not get a view of the input.
  const std::string returned_view =
      "graph(%x: f32[4, 3]{3, 1}@cpu):\n"
      "  %c: f32[4, 3]{3, 1}@cpu = aten::clone(%x)\n"
      "  %v: f32[12]{1}@cpu = aten::view(%c, [12])\n"
      "  return (%v)\n";
  EXPECT_EQ(run_pass(canonicalize, returned_view), returned_view);
}

TEST(Canonicalize, ViewChainsBackToAnEarlierTypeReadThatValue) {
  // The CPU's channels-last ReLU and batch-norm backwards (decompositions.py) compute over [N * H * W, C] rows and
  // hand on [N, C, H, W]: the next one's rows are view(permute(view(permute(t)))), t itself. %p2 is %u again;
  // %b, a graph output, stays; %f, a view to a type the chain never had, stays.
  const std::string in =
      "graph(%x: f32[2, 3, 4, 5]{60, 1, 15, 3}@cpu):\n"
      "  %p: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::permute(%x, [0, 2, 3, 1])\n"
      "  %r: f32[40, 3]{3, 1}@cpu = aten::view(%p, [40, 3])\n"
      "  %t: f32[40, 3]{3, 1}@cpu = aten::threshold_backward(%r, %r, 0)\n"
      "  %u: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::view(%t, [2, 4, 5, 3])\n"
      "  %b: f32[2, 3, 4, 5]{60, 1, 15, 3}@cpu = aten::permute(%u, [0, 3, 1, 2])\n"
      "  %p2: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::permute(%b, [0, 2, 3, 1])\n"
      "  %r2: f32[40, 3]{3, 1}@cpu = aten::view(%p2, [40, 3])\n"
      "  %s: f32[3]{1}@cpu = aten::sum.dim_IntList(%r2, [0])\n"
      "  %f: f32[6, 20]{20, 1}@cpu = aten::view(%r2, [6, 20])\n"
      "  return (%s, %b, %f)\n";
  const std::string expected =
      "graph(%x: f32[2, 3, 4, 5]{60, 1, 15, 3}@cpu):\n"
      "  %p: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::permute(%x, [0, 2, 3, 1])\n"
      "  %r: f32[40, 3]{3, 1}@cpu = aten::view(%p, [40, 3])\n"
      "  %t: f32[40, 3]{3, 1}@cpu = aten::threshold_backward(%r, %r, 0)\n"
      "  %u: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::view(%t, [2, 4, 5, 3])\n"
      "  %b: f32[2, 3, 4, 5]{60, 1, 15, 3}@cpu = aten::permute(%u, [0, 3, 1, 2])\n"
      "  %p2: f32[2, 4, 5, 3]{60, 15, 3, 1}@cpu = aten::permute(%b, [0, 2, 3, 1])\n"
      "  %r2: f32[40, 3]{3, 1}@cpu = aten::view(%u, [40, 3])\n"
      "  %s: f32[3]{1}@cpu = aten::sum.dim_IntList(%t, [0])\n"
      "  %f: f32[6, 20]{20, 1}@cpu = aten::view(%t, [6, 20])\n"
      "  return (%s, %b, %f)\n";
  EXPECT_EQ(run_pass(canonicalize, in), expected);
}

TEST(Canonicalize, IndexByWholeAranges) {
  // bias[h, q, k] over every position (vmap's form of a flex_attention score_mod reading a buffer): the index
  // copies %b element for element, and its reader reads %b. Kept: indices that do not each vary along their
  // own dim (%t: %h broadcasts against %qv's dim 0, a transpose), and an arange with a step (%u).
  const std::string in =
      "graph(%b: f32[3, 5, 6]{30, 6, 1}@cpu, %c: f32[3, 10, 6]{60, 6, 1}@cpu):\n"
      "  %h: i64[3]{1}@cpu = aten::arange.start_step(0, 3, layout=strided, device=cpu, pin_memory=false)\n"
      "  %q: i64[5]{1}@cpu = aten::arange.start_step(0, 5, layout=strided, device=cpu, pin_memory=false)\n"
      "  %k: i64[6]{1}@cpu = aten::arange.start_step(0, 6, layout=strided, device=cpu, pin_memory=false)\n"
      "  %e: i64[5]{1}@cpu = aten::arange.start_step(0, 10, 2, layout=strided, device=cpu, pin_memory=false)\n"
      "  %hv: i64[3, 1, 1]{1, 1, 1}@cpu = aten::view(%h, [3, 1, 1])\n"
      "  %qv: i64[5, 1]{1, 1}@cpu = aten::view(%q, [5, 1])\n"
      "  %ev: i64[5, 1]{1, 1}@cpu = aten::view(%e, [5, 1])\n"
      "  %g: f32[3, 5, 6]{30, 6, 1}@cpu = aten::index.Tensor(%b, [%hv, %qv, %k])\n"
      "  %s: f32[3, 5, 6]{30, 6, 1}@cpu = aten::sin(%g)\n"
      "  %t: f32[5, 3, 6]{18, 6, 1}@cpu = aten::index.Tensor(%b, [%h, %qv])\n"
      "  %u: f32[3, 5, 6]{30, 6, 1}@cpu = aten::index.Tensor(%c, [%hv, %ev, %k])\n"
      "  return (%s, %t, %u)\n";
  const std::string expected =
      "graph(%b: f32[3, 5, 6]{30, 6, 1}@cpu, %c: f32[3, 10, 6]{60, 6, 1}@cpu):\n"
      "  %h: i64[3]{1}@cpu = aten::arange.start_step(0, 3, layout=strided, device=cpu, pin_memory=false)\n"
      "  %q: i64[5]{1}@cpu = aten::arange.start_step(0, 5, layout=strided, device=cpu, pin_memory=false)\n"
      "  %k: i64[6]{1}@cpu = aten::arange.start_step(0, 6, layout=strided, device=cpu, pin_memory=false)\n"
      "  %e: i64[5]{1}@cpu = aten::arange.start_step(0, 10, 2, layout=strided, device=cpu, pin_memory=false)\n"
      "  %hv: i64[3, 1, 1]{1, 1, 1}@cpu = aten::view(%h, [3, 1, 1])\n"
      "  %qv: i64[5, 1]{1, 1}@cpu = aten::view(%q, [5, 1])\n"
      "  %ev: i64[5, 1]{1, 1}@cpu = aten::view(%e, [5, 1])\n"
      "  %g: f32[3, 5, 6]{30, 6, 1}@cpu = aten::index.Tensor(%b, [%hv, %qv, %k])\n"
      "  %s: f32[3, 5, 6]{30, 6, 1}@cpu = aten::sin(%b)\n"
      "  %t: f32[5, 3, 6]{18, 6, 1}@cpu = aten::index.Tensor(%b, [%h, %qv])\n"
      "  %u: f32[3, 5, 6]{30, 6, 1}@cpu = aten::index.Tensor(%c, [%hv, %ev, %k])\n"
      "  return (%s, %t, %u)\n";
  EXPECT_EQ(run_pass(canonicalize, in), expected);
}

TEST(OneDnnMatmul, LinearReluScaleMatchesAten) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  auto g = compile_text(kLinearRelu);
  EXPECT_EQ(onednn_steps(*g), 1) << g->describe();
  at::Tensor w = at::randn({5, 13}), b = at::randn({5});
  for (int call = 0; call < 3; ++call) {  // the second and third calls use packed weights
    at::Tensor x = at::randn({7, 13});
    at::Tensor expected = (at::relu(at::addmm(b, x, w.t())) * 0.5).exp();
    EXPECT_TRUE(at::allclose(t(g->run({x, w, b})[0]), expected, 1e-4, 1e-5)) << "call " << call;
    if (call == 1) w.add_(1.0);  // in place: the version counter moves, the packing is redone
  }
}

// A tensor subclass's inner tensor is written below the subclass (a DTensor's local shard by the optimizer's
// step): its version counter stays put, so its weights must never be packed (CompileOptions::unversioned_inputs).
TEST(OneDnnMatmul, UnversionedWeightsAreReadAtEveryCall) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  CompileOptions options;
  options.unversioned_inputs = {false, true, false};
  auto g = compile(parse(kLinearRelu), {}, options);
  EXPECT_EQ(onednn_steps(*g), 1) << g->describe();
  at::Tensor w = at::randn({5, 13}), b = at::randn({5});
  for (int call = 0; call < 4; ++call) {
    at::Tensor x = at::randn({7, 13});
    at::Tensor expected = (at::relu(at::addmm(b, x, w.t())) * 0.5).exp();
    EXPECT_TRUE(at::allclose(t(g->run({x, w, b})[0]), expected, 1e-4, 1e-5)) << "call " << call;
    const uint32_t version = w._version();
    {
      at::AutoDispatchBelowADInplaceOrView below;  // as a subclass's __torch_dispatch__ writes its inner tensor
      w.add_(0.25);
    }
    ASSERT_EQ(w._version(), version);
  }
}

TEST(OneDnnMatmul, ResidualRowAddGeluViewsAndOddSizes) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  const std::string text =
      "graph(%x: f32[3, 5, 17]{85, 17, 1}@cpu, %w: f32[9, 17]{17, 1}@cpu, %r: f32[3, 5, 9]{45, 9, 1}@cpu, "
      "%row: f32[9]{1}@cpu):\n"
      "  %v: f32[15, 17]{17, 1}@cpu = aten::view(%x, [15, 17])\n"
      "  %wt: f32[17, 9]{1, 17}@cpu = aten::permute(%w, [1, 0])\n"
      "  %m: f32[15, 9]{9, 1}@cpu = aten::mm(%v, %wt)\n"
      "  %a: f32[15, 9]{9, 1}@cpu = aten::add.Tensor(%m, %row)\n"
      "  %g: f32[15, 9]{9, 1}@cpu = aten::gelu(%a, approximate=\"tanh\")\n"
      "  %u: f32[3, 5, 9]{45, 9, 1}@cpu = aten::view(%g, [3, 5, 9])\n"
      "  %o: f32[3, 5, 9]{45, 9, 1}@cpu = aten::add.Tensor(%r, %u)\n"
      "  %s: f32[3, 5, 9]{45, 9, 1}@cpu = aten::silu(%o)\n"
      "  return (%s)\n";
  auto g = compile_text(text);
  EXPECT_EQ(onednn_steps(*g), 1) << g->describe();
  at::Tensor w = at::randn({9, 17}), row = at::randn({9});
  for (int call = 0; call < 3; ++call) {  // the first call runs through ATen, later ones through oneDNN
    at::Tensor x = at::randn({3, 5, 17}), r = at::randn({3, 5, 9});
    at::Tensor expected = at::silu(r + at::gelu(at::matmul(x, w.t()) + row, "tanh"));
    at::Tensor out = t(g->run({x, w, r, row})[0]);
    EXPECT_EQ(out.sizes(), expected.sizes());
    EXPECT_TRUE(at::allclose(out, expected, 1e-4, 1e-5)) << "call " << call;
  }
}

// The oneDNN wrapper called directly with a row addend before a [M, N] one: each [M, N] addend's row stride
// is its own (MatmulCall::addend_row_stride holds one per [M, N] addend), not the Add step's position. Taken
// by position, the primitive's setup threw and every call fell back to ATen unseen.
TEST(OneDnnMatmul, RowThenFullAddendsRunInOneDnn) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  onednn::MatmulConfig config;
  onednn::PostOp row, full;
  row.kind = full.kind = onednn::PostOp::Kind::Add;
  row.row = true;
  config.post_ops = {row, full};
  std::string why;
  auto mm = onednn::Matmul::create(config, &why);
  ASSERT_TRUE(mm) << why;
  at::Tensor x = at::randn({9, 13}), w = at::randn({13, 5}), r = at::randn({5}), f = at::randn({9, 5});
  at::Tensor out = at::empty({9, 5});
  onednn::MatmulCall call;
  call.M = 9, call.N = 5, call.K = 13;
  call.src = x.data_ptr(), call.src_stride[0] = 13, call.src_stride[1] = 1;
  call.weights = w.data_ptr(), call.weights_stride[0] = 5, call.weights_stride[1] = 1;
  call.dst = out.data_ptr(), call.dst_stride = 5;
  call.addends = {r.data_ptr(), f.data_ptr()};
  call.addend_row_stride = {5};
  ASSERT_NO_THROW(mm->run(call, 0));
  EXPECT_TRUE(at::allclose(out, at::mm(x, w) + r + f, 1e-4, 1e-5));
  EXPECT_EQ(mm->primitives(), 1u);
}

TEST(OneDnnMatmul, StridedAndEmptyOperandsAndNoOneDnnAgree) {
  const std::string text =
      "graph(%x: f32[s0, 6]{1, s0}@cpu, %w: f32[6, 4]{4, 1}@cpu):\n"
      "  %m: f32[s0, 4]{4, 1}@cpu = aten::mm(%x, %w)\n"
      "  %t: f32[s0, 4]{4, 1}@cpu = aten::tanh(%m)\n"
      "  return (%t)\n";
  auto g = compile_text(text);
  auto plain = compile_text(text, {"epilogue"});
  EXPECT_EQ(onednn_steps(*plain), 0);
  at::Tensor w = at::randn({6, 4});
  for (int64_t rows : {1, 11, 0}) {
    at::Tensor x = at::randn({6, rows}).t();  // columns contiguous
    at::Tensor expected = at::tanh(at::mm(x, w));
    EXPECT_TRUE(at::allclose(t(g->run({x, w})[0]), expected, 1e-4, 1e-5)) << rows;
    EXPECT_TRUE(at::allclose(t(plain->run({x, w})[0]), expected, 1e-4, 1e-5)) << rows;
  }
  // Neither rows nor columns contiguous: the kernel computes it through ATen.
  at::Tensor x = at::randn({8, 12}).slice(1, 0, 12, 2).slice(0, 0, 8, 2);  // [4, 6], strides (24, 2)
  EXPECT_TRUE(at::allclose(t(g->run({x, w})[0]), at::tanh(at::mm(x, w)), 1e-4, 1e-5));
}

TEST(OneDnnMatmul, PackedWeightsFollowBatchSizesAndInPlaceWrites) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  const std::string text =
      "graph(%x: f32[s0, 40]{40, 1}@cpu, %w: f32[24, 40]{40, 1}@cpu):\n"
      "  %wt: f32[40, 24]{1, 40}@cpu = aten::permute(%w, [1, 0])\n"
      "  %m: f32[s0, 24]{24, 1}@cpu = aten::mm(%x, %wt)\n"
      "  %r: f32[s0, 24]{24, 1}@cpu = aten::relu(%m)\n"
      "  return (%r)\n";
  auto g = compile_text(text);
  at::Tensor w = at::randn({24, 40});
  // Batch sizes share one packed copy per layout; a write to the weights repacks it for every size.
  for (int64_t rows : {9, 9, 12, 12, -1, 12, 12, 9, 16, 9}) {
    if (rows < 0) {
      w.mul_(-2.0);
      continue;
    }
    at::Tensor x = at::randn({rows, 40});
    EXPECT_TRUE(at::allclose(t(g->run({x, w})[0]), at::relu(at::mm(x, w.t())), 1e-4, 1e-5)) << rows;
  }
}

// Two matmuls reading the same weights under one generation (ALBERT's layers share a weight; a recompile reads
// the same parameters) share one packed copy: the second makes none. A new generation makes a new copy, and both
// read it right; the stale one goes when neither holds it.
TEST(OneDnnMatmul, KernelsReadingTheSameWeightsShareOnePackedCopy) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  onednn::MatmulConfig config;
  std::string why;
  auto first = onednn::Matmul::create(config, &why), second = onednn::Matmul::create(config, &why);
  ASSERT_TRUE(first && second) << why;
  at::Tensor w = at::randn({96, 80});  // [K, N]
  static uint64_t generation = uint64_t{1} << 60;  // far from weights_generation()'s numbers
  auto run = [&](onednn::Matmul& m, int64_t rows, uint64_t gen) {
    at::Tensor x = at::randn({rows, 96}), y = at::empty({rows, 80});
    onednn::MatmulCall c;
    c.M = rows, c.N = 80, c.K = 96;
    c.src = x.data_ptr(), c.src_stride[0] = 96, c.src_stride[1] = 1;
    c.weights = w.data_ptr(), c.weights_stride[0] = 80, c.weights_stride[1] = 1;
    c.dst = y.data_ptr(), c.dst_stride = 80;
    m.run(c, gen);
    EXPECT_TRUE(at::allclose(y, at::mm(x, w), 1e-4, 1e-5)) << rows;
  };
  const uint64_t g1 = ++generation;
  run(*first, 32, g1);
  const size_t packed = first->packings();
  if (packed == 0) GTEST_SKIP() << "this CPU's primitive reads the weights as they lie: nothing is packed";
  run(*second, 32, g1);
  run(*second, 17, g1);  // another shape, the same layout
  EXPECT_EQ(second->packings(), 0u) << "first made " << packed;
  w.mul_(-1.0);
  const uint64_t g2 = ++generation;
  run(*second, 32, g2);
  run(*first, 32, g2);
  EXPECT_EQ(first->packings(), packed) << "the second made the new copy, the first reads it";
  EXPECT_EQ(second->packings(), packed);
}

TEST(OneDnnMatmul, BFloat16) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  const std::string text =
      "graph(%x: bf16[6, 32]{32, 1}@cpu, %w: bf16[32, 16]{16, 1}@cpu, %b: bf16[16]{1}@cpu):\n"
      "  %m: bf16[6, 16]{16, 1}@cpu = aten::addmm(%b, %x, %w)\n"
      "  %r: bf16[6, 16]{16, 1}@cpu = aten::relu(%m)\n"
      "  return (%r)\n";
  auto g = compile_text(text);
  EXPECT_EQ(onednn_steps(*g), 1);
  at::Tensor x = at::randn({6, 32}).to(at::kBFloat16), w = at::randn({32, 16}).to(at::kBFloat16);
  at::Tensor b = at::randn({16}).to(at::kBFloat16);
  at::Tensor expected = at::relu(at::addmm(b.to(at::kFloat), x.to(at::kFloat), w.to(at::kFloat)));
  for (int call = 0; call < 2; ++call)
    EXPECT_TRUE(at::allclose(t(g->run({x, w, b})[0]).to(at::kFloat), expected, 5e-2, 5e-2)) << "call " << call;
}

// conv (stride 2, padding 1, groups 2) + residual + relu, then a scale when `scaled`: the graph and its check
// on fresh inputs in both layouts, the weights rewritten in place before the third call of each.
const char* conv_residual_relu(bool scaled) {
  return scaled ? "graph(%x: f32[2, 4, 9, 7]{252, 63, 7, 1}@cpu, %w: f32[6, 2, 3, 3]{18, 9, 3, 1}@cpu, %b: f32[6]{1}@cpu, "
                  "%r: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu):\n"
                  "  %c: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::convolution(%x, %w, %b, [2, 2], [1, 1], [1, 1], false, [0, 0], 2)\n"
                  "  %a: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::add.Tensor(%c, %r)\n"
                  "  %o: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::relu(%a)\n"
                  "  %s: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::mul.Tensor(%o, 0.5)\n"
                  "  return (%s)\n"
                : "graph(%x: f32[2, 4, 9, 7]{252, 63, 7, 1}@cpu, %w: f32[6, 2, 3, 3]{18, 9, 3, 1}@cpu, %b: f32[6]{1}@cpu, "
                  "%r: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu):\n"
                  "  %c: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::convolution(%x, %w, %b, [2, 2], [1, 1], [1, 1], false, [0, 0], 2)\n"
                  "  %a: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::add.Tensor(%c, %r)\n"
                  "  %o: f32[2, 6, 5, 4]{120, 20, 4, 1}@cpu = aten::relu(%a)\n"
                  "  return (%o)\n";
}

void check_conv_residual_relu(CompiledGraph& g, bool scaled) {
  const double scale = scaled ? 0.5 : 1.0;
  at::Tensor b = at::randn({6});
  for (bool channels_last : {false, true}) {
    at::Tensor w = at::randn({6, 2, 3, 3});
    if (channels_last) w = w.contiguous(at::MemoryFormat::ChannelsLast);
    for (int call = 0; call < 4; ++call) {
      at::Tensor x = at::randn({2, 4, 9, 7}), r = at::randn({2, 6, 5, 4});
      if (channels_last) {
        x = x.contiguous(at::MemoryFormat::ChannelsLast);
        r = r.contiguous(at::MemoryFormat::ChannelsLast);
      }
      if (call == 2) w.mul_(-1.5);  // in place: packed weights from before are stale
      at::Tensor expected = at::relu(at::conv2d(x, w, b, {2, 2}, {1, 1}, {1, 1}, 2) + r) * scale;
      at::Tensor out = t(g.run({x, w, b, r})[0]);
      EXPECT_TRUE(at::allclose(out, expected, 1e-4, 1e-5)) << channels_last << " call " << call;
      EXPECT_EQ(out.strides(), expected.strides()) << channels_last << " call " << call;
    }
  }
}

std::string first_kernel(const CompiledGraph& g) {
  for (const Step& s : g.plan().steps)
    if (s.kernel) return s.kernel->describe();
  return "";
}

TEST(OneDnnConv2d, BiasReluResidualBothLayouts) {
  if (!onednn::available()) GTEST_SKIP() << "built without oneDNN";
  config_set("EMBER_ONEDNN_CONV", "1");  // convolutions go through ember's oneDNN only when asked (matmul_epilogue.cpp)
  struct Unset {
    ~Unset() { config_set("EMBER_ONEDNN_CONV", std::nullopt); }
  } unset;
  auto g = compile_text(conv_residual_relu(false));
  EXPECT_EQ(first_kernel(*g), "onednn conv2d f32 +bias add relu") << g->describe();
  check_conv_residual_relu(*g, false);
}

// The default route (kernels/cpu/conv_kernel.cpp): torch's own mkldnn::_convolution_pointwise, residual add
// and relu applied by the call, the weights packed from the second call on for channels-last sources; the
// chain cut where the call applies no more (the scale).
TEST(TorchConv2d, ResidualReluBothLayoutsAndTheChainStopsAtAScale) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "torch built without mkldnn";
  auto g = compile_text(conv_residual_relu(true));
  EXPECT_EQ(first_kernel(*g), "onednn conv2d f32 +bias add relu via torch") << g->describe();
  check_conv_residual_relu(*g, true);
}

// Each build of the few-rows loop this CPU can run, called directly: 1-7 rows (blocks of 4 or 2 and their
// tails), K around the vector widths, N around the 4-column blocks, source rows apart by more than K, weights
// as nn.Linear's transposed, bias, every post-op kind, and NaN/inf carried through.
TEST(Gemv, EveryBuildMatchesAtenOnOddShapesAndEpilogues) {
  using Kind = onednn::PostOp::Kind;
  std::vector<std::pair<const char*, void (*)(const cpu::MatmulConfig&, const cpu::MatmulCall&)>> builds;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) builds.push_back({"avx2", &cpu::avx2::gemv});
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    builds.push_back({"avx512", &cpu::avx512::gemv});
  if (builds.empty()) GTEST_SKIP() << "no AVX2 on this CPU";
  auto post = [](Kind k, bool row = false) {
    onednn::PostOp p;
    p.kind = k;
    p.row = row;
    if (k == Kind::Linear) p.alpha = 0.5f, p.beta = -1.f;
    return p;
  };
  const std::vector<std::vector<onednn::PostOp>> epilogues = {
      {}, {post(Kind::Relu)}, {post(Kind::GeluErf)}, {post(Kind::GeluTanh)}, {post(Kind::Silu)}, {post(Kind::Sigmoid)},
      {post(Kind::Tanh)}, {post(Kind::Linear), post(Kind::Add, true), post(Kind::Add, false)}};
  int checked = 0;
  for (auto [name, gemv_of] : builds) {
    for (int64_t M : {1, 2, 3, 4, 5, 7}) {
      for (int64_t K : {1, 7, 16, 17, 33, 300}) {
        for (int64_t N : {1, 3, 4, 5, 70}) {
          const auto& ops = epilogues[(M * 7 + K + N) % epilogues.size()];
          at::Tensor src = at::randn({M, K + 3}).narrow(1, 1, K);  // rows K + 3 apart
          at::Tensor w = at::randn({N, K}), bias = at::randn({N});
          at::Tensor row = at::randn({N}), full = at::randn({M, N});
          if (M > 1 && K > 2) src[1][2] = std::numeric_limits<float>::quiet_NaN();
          at::Tensor expected = at::addmm(bias, src, w.t());
          cpu::MatmulConfig config;
          config.bias = true;
          cpu::MatmulCall call;
          call.M = M, call.N = N, call.K = K;
          call.src = src.data_ptr(), call.src_stride[0] = K + 3, call.src_stride[1] = 1;
          call.weights = w.data_ptr(), call.weights_stride[0] = 1, call.weights_stride[1] = K;
          call.bias = bias.data_ptr();
          for (const onednn::PostOp& p : ops) {
            config.post_ops.push_back(p);
            switch (p.kind) {
              case Kind::Relu: expected = at::relu(expected); break;
              case Kind::GeluErf: expected = at::gelu(expected); break;
              case Kind::GeluTanh: expected = at::gelu(expected, "tanh"); break;
              case Kind::Silu: expected = at::silu(expected); break;
              case Kind::Sigmoid: expected = at::sigmoid(expected); break;
              case Kind::Tanh: expected = at::tanh(expected); break;
              case Kind::Linear: expected = expected * p.alpha + p.beta; break;
              case Kind::Add:
                expected = expected + (p.row ? row : full);
                call.addends.push_back(p.row ? row.data_ptr() : full.data_ptr());
                if (!p.row) call.addend_row_stride.push_back(N);
                break;
            }
          }
          ASSERT_TRUE(cpu::gemv_takes(call));
          at::Tensor out = at::full({M, N}, 12345.f);
          call.dst = out.data_ptr(), call.dst_stride = N;
          gemv_of(config, call);
          EXPECT_TRUE(at::allclose(out, expected, 1e-4, 1e-4, /*equal_nan=*/true))
              << name << " M" << M << " K" << K << " N" << N << " with " << ops.size() << " post-ops\n"
              << out << "\n" << expected;
          ++checked;
        }
      }
    }
  }
  EXPECT_GE(checked, 180);
}

}  // namespace
}  // namespace ember

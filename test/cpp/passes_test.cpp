// Pass tests: IR text in, one pass, IR text out (checked line for line), plus a numeric check that the
// rewritten graph computes what the original did.
#include "ember/compiler.h"
#include "ember/error.h"
#include "ember/op_table.h"
#include "passes/passes.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <set>

namespace ember {
namespace {

using Pass = void (*)(Graph&, PassContext&);

// `in` parsed, the passes run on it in order, the result verified and printed.
std::string run_passes(std::initializer_list<Pass> passes, const std::string& in) {
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  for (Pass pass : passes) pass(g, ctx);
  g.verify();
  return print(g);
}

std::string run_pass(Pass pass, const std::string& in) { return run_passes({pass}, in); }

std::vector<c10::IValue> run_text(const std::string& text, std::vector<c10::IValue> inputs,
                                  std::vector<std::string> disabled = {}) {
  CompileOptions options;
  options.disabled_passes = std::move(disabled);
  auto compiled = compile(parse(text), {}, options);
  return compiled->run(std::move(inputs));
}

TEST(DeadCodeElimination, RemovesUnusedChainsKeepsEffects) {
  const std::string in =
      "graph(%x: f32[4]{1}@cpu, %buf: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %b: f32[4]{1}@cpu = aten::cos(%a)\n"
      "  %c: f32[4]{1}@cpu = aten::exp(%x)\n"
      "  %r: f32[4]{1}@cpu = aten::rand_like(%x)\n"
      "  %d: f32[4]{1}@cpu = aten::copy_(%buf, %c)\n"
      "  aten::_assert_scalar(true, \"ok\")\n"
      "  return (%x)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu, %buf: f32[4]{1}@cpu):\n"
      "  %c: f32[4]{1}@cpu = aten::exp(%x)\n"
      "  %d: f32[4]{1}@cpu = aten::copy_(%buf, %c)\n"
      "  aten::_assert_scalar(true, \"ok\")\n"
      "  return (%x)\n";
  EXPECT_EQ(run_pass(eliminate_dead_code, in), expected);
}

TEST(DeadCodeElimination, KeepsMultiOutputNodeWhenAnyOutputIsUsed) {
  const std::string in =
      "graph(%x: f32[3, 5]{5, 1}@cpu):\n"
      "  %m: f32[3]{1}@cpu, %i: i64[3]{1}@cpu = aten::max.dim(%x, 1)\n"
      "  return (%i)\n";
  EXPECT_EQ(run_pass(eliminate_dead_code, in), in);
}

TEST(CommonSubexpressionElimination, MergesEqualNodesTransitively) {
  const std::string in =
      "graph(%x: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %b: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %c: f32[4]{1}@cpu = aten::mul.Tensor(%a, 2.0)\n"
      "  %d: f32[4]{1}@cpu = aten::mul.Tensor(%b, 2.0)\n"
      "  %e: f32[4]{1}@cpu = aten::mul.Tensor(%b, 2)\n"
      "  %f: f32[4]{1}@cpu = aten::add.Tensor(%c, %d)\n"
      "  return (%f, %e, %d)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %c: f32[4]{1}@cpu = aten::mul.Tensor(%a, 2.0)\n"
      "  %e: f32[4]{1}@cpu = aten::mul.Tensor(%a, 2)\n"
      "  %f: f32[4]{1}@cpu = aten::add.Tensor(%c, %c)\n"
      "  return (%f, %e, %c)\n";
  EXPECT_EQ(run_pass(eliminate_common_subexpressions, in), expected);
}

TEST(CommonSubexpressionElimination, NeverMergesRandomOrMutatedReads) {
  // The two reads of %v straddle a write into %x, which %v views: they must stay apart.
  const std::string in =
      "graph(%x: f32[4]{1}@cpu, %y: f32[4]{1}@cpu):\n"
      "  %r1: f32[4]{1}@cpu = aten::rand_like(%x)\n"
      "  %r2: f32[4]{1}@cpu = aten::rand_like(%x)\n"
      "  %v: f32[4]{1}@cpu = aten::view(%x, [4])\n"
      "  %s1: f32[4]{1}@cpu = aten::sin(%v)\n"
      "  %w: f32[4]{1}@cpu = aten::copy_(%x, %y)\n"
      "  %s2: f32[4]{1}@cpu = aten::sin(%v)\n"
      "  %t1: f32[4]{1}@cpu = aten::cos(%y)\n"
      "  %t2: f32[4]{1}@cpu = aten::cos(%y)\n"
      "  %u: f32[4]{1}@cpu = aten::add.Tensor(%t1, %t2)\n"
      "  return (%r1, %r2, %s1, %s2, %u)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu, %y: f32[4]{1}@cpu):\n"
      "  %r1: f32[4]{1}@cpu = aten::rand_like(%x)\n"
      "  %r2: f32[4]{1}@cpu = aten::rand_like(%x)\n"
      "  %v: f32[4]{1}@cpu = aten::view(%x, [4])\n"
      "  %s1: f32[4]{1}@cpu = aten::sin(%v)\n"
      "  %w: f32[4]{1}@cpu = aten::copy_(%x, %y)\n"
      "  %s2: f32[4]{1}@cpu = aten::sin(%v)\n"
      "  %t1: f32[4]{1}@cpu = aten::cos(%y)\n"
      "  %u: f32[4]{1}@cpu = aten::add.Tensor(%t1, %t1)\n"
      "  return (%r1, %r2, %s1, %s2, %u)\n";
  EXPECT_EQ(run_pass(eliminate_common_subexpressions, in), expected);

  // And the numbers: s1 is sin of the old x, s2 sin of y.
  at::Tensor x = at::randn({4}), y = at::randn({4});
  at::Tensor x0 = x.clone();
  auto out = run_text(in, {x, y});
  EXPECT_TRUE(at::allclose(out[2].toTensor(), x0.sin()));
  EXPECT_TRUE(at::allclose(out[3].toTensor(), y.sin()));
  EXPECT_TRUE(at::equal(x, y));
  EXPECT_FALSE(at::equal(out[0].toTensor(), out[1].toTensor()));
}

TEST(CommonSubexpressionElimination, KeepsTwoGraphOutputsDistinct) {
  // The caller may mutate one returned tensor; the other must not change with it.
  const std::string in =
      "graph(%x: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::clone(%x)\n"
      "  %b: f32[4]{1}@cpu = aten::clone(%x)\n"
      "  %c: f32[4]{1}@cpu = aten::neg(%x)\n"
      "  %d: f32[4]{1}@cpu = aten::neg(%x)\n"
      "  %e: f32[4]{1}@cpu = aten::mul.Tensor(%d, 2)\n"
      "  return (%a, %b, %c, %e)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::clone(%x)\n"
      "  %b: f32[4]{1}@cpu = aten::clone(%x)\n"
      "  %c: f32[4]{1}@cpu = aten::neg(%x)\n"
      "  %e: f32[4]{1}@cpu = aten::mul.Tensor(%c, 2)\n"
      "  return (%a, %b, %c, %e)\n";
  EXPECT_EQ(run_pass(eliminate_common_subexpressions, in), expected);
}

TEST(PassManager, DisabledPassesAreSkippedAndResultsAgree) {
  const std::string text =
      "graph(%x: f32[5, 3]{3, 1}@cpu):\n"
      "  %a: f32[5, 3]{3, 1}@cpu = aten::exp(%x)\n"
      "  %b: f32[5, 3]{3, 1}@cpu = aten::exp(%x)\n"
      "  %dead: f32[5, 3]{3, 1}@cpu = aten::neg(%x)\n"
      "  %c: f32[5, 3]{3, 1}@cpu = aten::sub.Tensor(%a, %b, alpha=0.5)\n"
      "  return (%c)\n";
  at::Tensor x = at::randn({5, 3});
  at::Tensor expected = x.exp() * 0.5;
  CompileOptions all;
  all.disabled_passes = {"fuse"};  // count the nodes dce and cse leave, one step each
  auto optimized = compile(parse(text), {}, all);
  EXPECT_EQ(optimized->plan().steps.size(), 2u);
  CompileOptions none;
  none.disabled_passes = {"dce", "cse", "fuse"};
  auto plain = compile(parse(text), {}, none);
  EXPECT_EQ(plain->plan().steps.size(), 4u);
  EXPECT_TRUE(at::allclose(optimized->run({x})[0].toTensor(), expected));
  EXPECT_TRUE(at::allclose(plain->run({x})[0].toTensor(), expected));
}

TEST(FoldConstantSteps, StepsOnConstantsRunOnceAtCompileTime) {
  // arange -> mul -> view read by an add with the input: the three run at compile time, the add per call.
  const std::string text =
      "graph(%x: f32[2, 3]{3, 1}@cpu):\n"
      "  %r: f32[6]{1}@cpu = aten::arange(6, dtype=f32, device=cpu)\n"
      "  %m: f32[6]{1}@cpu = aten::mul.Tensor(%r, 2.0)\n"
      "  %v: f32[2, 3]{3, 1}@cpu = aten::view(%m, [2, 3])\n"
      "  %y: f32[2, 3]{3, 1}@cpu = aten::add.Tensor(%x, %v)\n"
      "  return (%y)\n";
  CompileOptions options;
  options.disabled_passes = {"fuse"};
  auto compiled = compile(parse(text), {}, options);
  EXPECT_EQ(compiled->plan().steps.size(), 1u) << compiled->describe();
  EXPECT_EQ(compiled->plan().folded_steps, 3u);
  EXPECT_NE(compiled->describe().find("3 more folded into constants"), std::string::npos);
  for (int call = 0; call < 3; ++call) {
    at::Tensor x = at::randn({2, 3});
    at::Tensor y = compiled->run({x})[0].toTensor();
    EXPECT_TRUE(at::equal(y, x + at::arange(6, at::kFloat).mul(2).view({2, 3})));
  }
  // Not folded: a value the caller receives (or receives a view of), a random op, a graph that writes in place.
  const std::string kept[] = {
      "graph(%x: f32[6]{1}@cpu):\n"
      "  %r: f32[6]{1}@cpu = aten::arange(6, dtype=f32, device=cpu)\n"
      "  %y: f32[6]{1}@cpu = aten::add.Tensor(%x, %r)\n"
      "  return (%y, %r)\n",
      "graph(%x: f32[6]{1}@cpu):\n"
      "  %r: f32[6]{1}@cpu = aten::arange(6, dtype=f32, device=cpu)\n"
      "  %v: f32[2, 3]{3, 1}@cpu = aten::view(%r, [2, 3])\n"
      "  return (%v)\n",
      "graph(%x: f32[6]{1}@cpu):\n"
      "  %r: f32[6]{1}@cpu = aten::rand(6, dtype=f32, device=cpu)\n"
      "  %y: f32[6]{1}@cpu = aten::add.Tensor(%x, %r)\n"
      "  return (%y)\n",
      "graph(%x: f32[6]{1}@cpu):\n"
      "  %r: f32[6]{1}@cpu = aten::arange(6, dtype=f32, device=cpu)\n"
      "  %y: f32[6]{1}@cpu = aten::add.Tensor(%x, %r)\n"
      "  %c: f32[6]{1}@cpu = aten::copy_(%x, %y)\n"
      "  return (%y)\n",
  };
  for (const std::string& k : kept) {
    auto c = compile(parse(k), {}, options);
    EXPECT_EQ(c->plan().folded_steps, 0u) << k;
  }
}

TEST(CacheParameterSteps, StepsOverParametersRunAgainOnlyWhenOneChanges) {
  // %w (a parameter) scaled and transposed into a copy: cached; the matmul with %x runs per call.
  const std::string text =
      "graph(%x: f32[4, 3]{3, 1}@cpu, %w: f32[5, 3]{3, 1}@cpu):\n"
      "  %m: f32[5, 3]{3, 1}@cpu = aten::mul.Tensor(%w, 2.0)\n"
      "  %t: f32[3, 5]{1, 3}@cpu = aten::permute(%m, [1, 0])\n"
      "  %c: f32[3, 5]{5, 1}@cpu = aten::clone(%t, memory_format=contiguous_format)\n"
      "  %y: f32[4, 5]{5, 1}@cpu = aten::mm(%x, %c)\n"
      "  return (%y)\n";
  CompileOptions options;
  options.disabled_passes = {"fuse"};
  auto compiled = compile(parse(text), {}, options);
  EXPECT_EQ(compiled->cache_parameter_steps({false, true}), 3u) << compiled->describe();
  EXPECT_EQ(compiled->plan().steps.size(), 1u);
  at::Tensor w = at::randn({5, 3});
  auto expect = [&](const at::Tensor& x) { return at::mm(x, (w * 2).t()); };
  at::Tensor first_cached;
  for (int call = 0; call < 6; ++call) {
    if (call == 2) w.mul_(-1);             // in place: the version counter moves
    if (call == 4) w = at::randn({5, 3});  // another tensor
    at::Tensor x = at::randn({4, 3});
    at::Tensor y = compiled->run({x, w})[0].toTensor();
    EXPECT_TRUE(at::allclose(y, expect(x), 1e-5, 1e-5)) << "call " << call;
  }
  // An input that is not pinned keeps its steps in the plan; so does a step whose result is returned.
  auto unpinned = compile(parse(text), {}, options);
  EXPECT_EQ(unpinned->cache_parameter_steps({false, false}), 0u);
  const std::string returned =
      "graph(%x: f32[5, 3]{3, 1}@cpu, %w: f32[5, 3]{3, 1}@cpu):\n"
      "  %m: f32[5, 3]{3, 1}@cpu = aten::mul.Tensor(%w, 2.0)\n"
      "  %y: f32[5, 3]{3, 1}@cpu = aten::add.Tensor(%x, %m)\n"
      "  return (%y, %m)\n";
  auto r = compile(parse(returned), {}, options);
  EXPECT_EQ(r->cache_parameter_steps({false, true}), 0u) << r->describe();
}

// resnet's batch norm -> relu, bf16 channels_last on CUDA, over inputs %x, %w, %b, %m, %v.
std::string bn_relu_graph() {
  const std::string t = "bf16[2, 8, 5, 5]{200, 1, 40, 8}@cuda:0", c = "bf16[8]{1}@cuda:0";
  return "graph(%x: " + t + ", %w: " + c + ", %b: " + c + ", %m: " + c + ", %v: " + c + "):\n"
         "  %y: " + t + ", %s1: bf16[0]{1}@cuda:0, %s2: bf16[0]{1}@cuda:0 = aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
         "  %r: " + t + " = aten::relu(%y)\n"
         "  return (%r)\n";
}

// batchnorm_pointwise, then dead-code elimination, on `g`; the result verified.
void bn_pointwise_then_dce(Graph& g, PassContext& ctx) {
  batchnorm_pointwise(g, ctx);
  eliminate_dead_code(g, ctx);
  g.verify();
}

TEST(BatchnormPointwise, CachedParametersGiveAPerChannelScaleAndShift) {
  // The same batch norm with its four tensors cached by the runtime (an inference graph's parameters):
  // scale and shift over [8] in float32 (their own group), then one multiply-add per element in the relu's
  // kernel; no rsqrt there. With one of them not cached, the per-element form stays.
  const std::string in = bn_relu_graph();
  Graph g = parse(in);
  CompileOptions options;
  options.cached_inputs = {false, true, true, true, true};
  PassContext ctx{options};
  bn_pointwise_then_dce(g, ctx);
  const std::string after = print(g);
  EXPECT_NE(after.find("f32[8]{1}@cuda:0 = aten::rsqrt"), std::string::npos) << after;
  EXPECT_NE(after.find("_shift: f32[8]{1}@cuda:0 = aten::sub.Tensor"), std::string::npos) << after;
  EXPECT_EQ(after.find("f32[2, 8, 5, 5]{200, 1, 40, 8}@cuda:0 = aten::sub.Tensor"), std::string::npos) << after;
  fuse(g, ctx);
  std::set<int> full_groups;
  for (const auto& n : g.nodes())
    if (n->outputs[0]->type.tensor.sizes.size() == 4 && n->op != "aten::view") full_groups.insert(n->group);
  EXPECT_EQ(full_groups.size(), 1u) << print(g);
  EXPECT_EQ(full_groups.count(-1), 0u) << print(g);
  Graph partly = parse(in);
  CompileOptions some;
  some.cached_inputs = {false, true, true, true, false};
  PassContext some_ctx{some};
  batchnorm_pointwise(partly, some_ctx);
  EXPECT_NE(print(partly).find("f32[2, 8, 5, 5]{200, 1, 40, 8}@cuda:0 = aten::rsqrt"), std::string::npos) << print(partly);
}

TEST(BatchnormPointwise, CudaBatchNormJoinsTheReluKernel) {
  // resnet's conv -> batch norm -> relu, bf16 channels_last on CUDA: the batch norm becomes float32
  // pointwise ops over per-channel columns, rounded once, and the fuse pass puts all of it and the relu
  // in one group.
  const std::string in = bn_relu_graph();
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  bn_pointwise_then_dce(g, ctx);
  const std::string after = print(g);
  EXPECT_EQ(after.find("_native_batch_norm"), std::string::npos) << after;
  EXPECT_NE(after.find("aten::rsqrt"), std::string::npos) << after;
  EXPECT_NE(after.find("f32[2, 8, 5, 5]{200, 1, 40, 8}@cuda:0 = aten::sub.Tensor"), std::string::npos) << after;
  fuse(g, ctx);
  std::set<int> groups;
  for (const auto& n : g.nodes())
    if (n->op != "aten::view" && n->op != "aten::expand") groups.insert(n->group);
  EXPECT_EQ(groups.size(), 1u) << print(g);
  EXPECT_EQ(groups.count(-1), 0u) << print(g);
  // f32 NCHW, two batch norms of one shape with a convolution between them: each batch norm with its relu
  // is one group (the second's variance chain joins the second group, not the first one that precedes it).
  const std::string r = "f32[2, 8, 5, 5]{200, 25, 5, 1}@cuda:0", p = "f32[8]{1}@cuda:0";
  auto bn = [&](const std::string& y, const std::string& x) {
    return "  %" + y + ": " + r + ", %" + y + "s1: f32[0]{1}@cuda:0, %" + y + "s2: f32[0]{1}@cuda:0 = "
           "aten::_native_batch_norm_legit_no_training(%" + x + ", %w, %b, %m, %v, 0.1, 1e-05)\n";
  };
  Graph two = parse("graph(%x: " + r + ", %k: f32[8, 8, 3, 3]{72, 9, 3, 1}@cuda:0, %w: " + p + ", %b: " + p + ", %m: " + p +
                    ", %v: " + p + "):\n" + bn("y1", "x") + "  %r1: " + r + " = aten::relu(%y1)\n"
                    "  %c: " + r + " = aten::convolution(%r1, %k, None, [1, 1], [1, 1], [1, 1], false, [0, 0], 1)\n" +
                    bn("y2", "c") + "  %r2: " + r + " = aten::relu(%y2)\n  return (%r2)\n");
  bn_pointwise_then_dce(two, ctx);
  fuse(two, ctx);
  std::map<int, int> members;
  int conv_seen = 0;
  for (const auto& n : two.nodes()) {
    if (n->op == "aten::convolution") ++conv_seen;
    if (n->op == "aten::view" || n->op == "aten::expand" || n->op == "aten::convolution") continue;
    EXPECT_GE(n->group, 0) << print(two);
    ++members[n->group];
    if (n->op == "aten::rsqrt") EXPECT_EQ(n->group, conv_seen ? 1 : 0) << print(two);
  }
  EXPECT_EQ(members.size(), 2u) << print(two);
  // Left alone: the CPU, used saved statistics.
  const std::string cpu = "graph(%x: f32[2, 8, 5, 5]{200, 25, 5, 1}@cpu, %w: f32[8]{1}@cpu, %b: f32[8]{1}@cpu, %m: f32[8]{1}@cpu, %v: f32[8]{1}@cpu):\n"
      "  %y: f32[2, 8, 5, 5]{200, 25, 5, 1}@cpu, %s1: f32[0]{1}@cpu, %s2: f32[0]{1}@cpu = aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
      "  return (%y)\n";
  EXPECT_EQ(run_pass(batchnorm_pointwise, cpu), cpu);
}

TEST(BatchnormPointwise, CpuRowsWithCachedParametersBecomeAMultiplyAdd) {
  // A CPU batch norm over [N, C] (after a Linear) whose tensors the runtime caches: scale and shift over [C], one
  // multiply-add per element that fuses with the hardswish after it. Its tensors not cached, or a 4-d input (a
  // convolution's, which fold_batchnorm takes), it stays whole.
  auto graph = [](const std::string& x) {
    const std::string c = "f32[8]{1}@cpu";
    return "graph(%x: " + x + ", %w: " + c + ", %b: " + c + ", %m: " + c + ", %v: " + c + "):\n"
           "  %y: " + x + ", %s1: f32[0]{1}@cpu, %s2: f32[0]{1}@cpu = aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
           "  %r: " + x + " = aten::hardswish(%y)\n"
           "  return (%r)\n";
  };
  const std::string rows = graph("f32[6, 8]{8, 1}@cpu");
  CompileOptions options;
  options.cached_inputs = {false, true, true, true, true};
  PassContext ctx{options};
  Graph g = parse(rows);
  bn_pointwise_then_dce(g, ctx);
  std::string after = print(g);
  EXPECT_EQ(after.find("_native_batch_norm"), std::string::npos) << after;
  EXPECT_NE(after.find("f32[8]{1}@cpu = aten::rsqrt"), std::string::npos) << after;
  fuse(g, ctx);
  std::set<int> full_groups;
  for (const auto& n : g.nodes())
    if (n->outputs[0]->type.tensor.sizes.size() == 2) full_groups.insert(n->group);
  EXPECT_EQ(full_groups.size(), 1u) << print(g);
  EXPECT_EQ(full_groups.count(-1), 0u) << print(g);
  EXPECT_EQ(run_pass(batchnorm_pointwise, rows), rows);  // nothing cached
  const std::string image = graph("f32[2, 8, 5, 5]{200, 25, 5, 1}@cpu");
  Graph conv_out = parse(image);
  batchnorm_pointwise(conv_out, ctx);
  EXPECT_EQ(print(conv_out), image);
}

TEST(BatchnormPointwise, CudaSymbolicRowsWithCachedParametersBecomeAMultiplyAdd) {
  // The same norm on CUDA under a symbolic batch: rule 4's form, whose per-channel part needs only C. Not cached,
  // the symbolic norm stays whole (the general form is for static sizes).
  const std::string c = "f32[8]{1}@cuda:0", x = "f32[s0, 8]{8, 1}@cuda:0";
  const std::string rows = "graph(%x: " + x + ", %w: " + c + ", %b: " + c + ", %m: " + c + ", %v: " + c + "):\n"
                           "  %y: " + x + ", %s1: f32[0]{1}@cuda:0, %s2: f32[0]{1}@cuda:0 = aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
                           "  return (%y)\n";
  CompileOptions options;
  options.cached_inputs = {false, true, true, true, true};
  PassContext ctx{options};
  Graph g = parse(rows);
  bn_pointwise_then_dce(g, ctx);
  const std::string after = print(g);
  EXPECT_EQ(after.find("_native_batch_norm"), std::string::npos) << after;
  EXPECT_NE(after.find("f32[8]{1}@cuda:0 = aten::rsqrt"), std::string::npos) << after;
  EXPECT_EQ(run_pass(batchnorm_pointwise, rows), rows);  // nothing cached
}

TEST(PassManager, UnknownDisabledPassIsAnError) {
  CompileOptions options;
  options.disabled_passes = {"no_such_pass"};
  EXPECT_THROW(compile(parse("graph(%x: f32[1]{1}@cpu):\n  return (%x)\n"), {}, options), Error);
}


}  // namespace
}  // namespace ember

namespace ember {
namespace {

// fold_batched_matmul: IR text in, IR text out, then the folded graph against ATen's bmm.
TEST(FoldBatchedMatmul, BroadcastWeightBatchBecomesOneMm) {
  const std::string in =
      "graph(%x: f32[2, 64, 16]{1024, 16, 1}@cpu, %w: f32[24, 16]{16, 1}@cpu):\n"
      "  %xt: f32[64, 2, 16]{16, 1024, 1}@cpu = aten::permute(%x, [1, 0, 2])\n"
      "  %wt: f32[16, 24]{1, 16}@cpu = aten::permute(%w, [1, 0])\n"
      "  %we: f32[64, 16, 24]{0, 1, 16}@cpu = aten::expand(%wt, [64, 16, 24])\n"
      "  %b: f32[64, 2, 24]{48, 24, 1}@cpu = aten::bmm(%xt, %we)\n"
      "  return (%b)\n";
  const std::string expected =
      "graph(%x: f32[2, 64, 16]{1024, 16, 1}@cpu, %w: f32[24, 16]{16, 1}@cpu):\n"
      "  %xt: f32[64, 2, 16]{16, 1024, 1}@cpu = aten::permute(%x, [1, 0, 2])\n"
      "  %wt: f32[16, 24]{1, 16}@cpu = aten::permute(%w, [1, 0])\n"
      "  %b_fold_a: f32[64, 2, 16]{32, 16, 1}@cpu = aten::clone(%xt, memory_format=contiguous_format)\n"
      "  %b_fold_rows: f32[128, 16]{16, 1}@cpu = aten::view(%b_fold_a, [128, 16])\n"
      "  %b_fold_mm: f32[128, 24]{24, 1}@cpu = aten::mm(%b_fold_rows, %wt)\n"
      "  %b_fold: f32[64, 2, 24]{48, 24, 1}@cpu = aten::view(%b_fold_mm, [64, 2, 24])\n"
      "  return (%b_fold)\n";
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  fold_batched_matmul(g, ctx);
  eliminate_dead_code(g, ctx);
  EXPECT_EQ(print(g), expected);

  options.disabled_passes = {"fuse", "epilogue"};
  auto compiled = compile(parse(in), {}, options);
  at::Tensor x = at::randn({2, 64, 16}), w = at::randn({24, 16});
  at::Tensor out = compiled->run({x, w})[0].toTensor();
  at::Tensor ref = at::bmm(x.permute({1, 0, 2}), w.t().expand({64, 16, 24}));
  EXPECT_TRUE(at::allclose(out, ref, 1e-5, 1e-5));
  EXPECT_EQ(out.strides(), ref.strides());
}

TEST(FoldBatchedMatmul, LeavesRealBatchesAlone) {
  const std::string batched =
      "graph(%a: f32[4, 3, 5]{15, 5, 1}@cpu, %b: f32[4, 5, 2]{10, 2, 1}@cpu):\n"
      "  %c: f32[4, 3, 2]{6, 2, 1}@cpu = aten::bmm(%a, %b)\n"
      "  return (%c)\n";
  Graph g = parse(batched);
  CompileOptions options;
  PassContext ctx{options};
  fold_batched_matmul(g, ctx);
  EXPECT_EQ(print(g), batched);
}

// A linear on a transposed 3-D CUDA input (nn.MultiheadAttention's input projection, batch_first=True):
// the batched product folds to one mm, its bias add becomes an addmm and the relu after it cuBLASLt's
// epilogue, each through the views the decomposition left between them.
TEST(AddmmActivation, CudaLinearOnTransposedInputBecomesOneAddmmActivation) {
  const std::string in =
      "graph(%x: f32[2, 8, 16]{128, 16, 1}@cuda:0, %w: f32[24, 16]{16, 1}@cuda:0, %b: f32[24]{1}@cuda:0):\n"
      "  %xt: f32[8, 2, 16]{16, 128, 1}@cuda:0 = aten::permute(%x, [1, 0, 2])\n"
      "  %wt: f32[16, 24]{1, 16}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %we: f32[8, 16, 24]{0, 1, 16}@cuda:0 = aten::expand(%wt, [8, 16, 24])\n"
      "  %p: f32[8, 2, 24]{48, 24, 1}@cuda:0 = aten::bmm(%xt, %we)\n"
      "  %v: f32[8, 2, 24]{48, 24, 1}@cuda:0 = aten::view(%p, [8, 2, 24])\n"
      "  %y: f32[8, 2, 24]{48, 24, 1}@cuda:0 = aten::add.Tensor(%v, %b)\n"
      "  %r: f32[8, 2, 24]{48, 24, 1}@cuda:0 = aten::relu(%y)\n"
      "  return (%r)\n";
  const std::string expected =
      "graph(%x: f32[2, 8, 16]{128, 16, 1}@cuda:0, %w: f32[24, 16]{16, 1}@cuda:0, %b: f32[24]{1}@cuda:0):\n"
      "  %xt: f32[8, 2, 16]{16, 128, 1}@cuda:0 = aten::permute(%x, [1, 0, 2])\n"
      "  %wt: f32[16, 24]{1, 16}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %p_fold_a: f32[8, 2, 16]{32, 16, 1}@cuda:0 = aten::clone(%xt, memory_format=contiguous_format)\n"
      "  %p_fold_rows: f32[16, 16]{16, 1}@cuda:0 = aten::view(%p_fold_a, [16, 16])\n"
      "  %r_gemm: f32[16, 24]{24, 1}@cuda:0 = aten::_addmm_activation(%b, %p_fold_rows, %wt, use_gelu=false)\n"
      "  %r_view: f32[8, 2, 24]{48, 24, 1}@cuda:0 = aten::view(%r_gemm, [8, 2, 24])\n"
      "  return (%r_view)\n";
  EXPECT_EQ(run_passes({fold_batched_matmul, fuse_addmm_activation, eliminate_dead_code}, in), expected);
}

TEST(AddmmActivation, CudaMmPlusRowBiasBecomesAddmm) {
  const std::string in =
      "graph(%x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0, %b: f32[8]{1}@cuda:0):\n"
      "  %m: f32[4, 8]{8, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %y: f32[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%b, %m)\n"
      "  return (%y)\n";
  const std::string expected =
      "graph(%x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0, %b: f32[8]{1}@cuda:0):\n"
      "  %y: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  return (%y)\n";
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  fuse_addmm_activation(g, ctx);
  eliminate_dead_code(g, ctx);
  EXPECT_EQ(print(g), expected);
  // Left alone: a bias that is not one row, alpha != 1, an mm whose result is used twice, the CPU.
  const std::string alone[] = {
      "graph(%x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0, %b: f32[4, 8]{8, 1}@cuda:0):\n"
      "  %m: f32[4, 8]{8, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %y: f32[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%m, %b)\n"
      "  return (%y)\n",
      "graph(%x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0, %b: f32[8]{1}@cuda:0):\n"
      "  %m: f32[4, 8]{8, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %y: f32[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%m, %b, alpha=2)\n"
      "  return (%y)\n",
      "graph(%x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0, %b: f32[8]{1}@cuda:0):\n"
      "  %m: f32[4, 8]{8, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %y: f32[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%m, %b)\n"
      "  return (%y, %m)\n",
      "graph(%x: f32[4, 16]{16, 1}@cpu, %w: f32[16, 8]{8, 1}@cpu, %b: f32[8]{1}@cpu):\n"
      "  %m: f32[4, 8]{8, 1}@cpu = aten::mm(%x, %w)\n"
      "  %y: f32[4, 8]{8, 1}@cpu = aten::add.Tensor(%m, %b)\n"
      "  return (%y)\n"};
  for (const std::string& text : alone) {
    Graph h = parse(text);
    fuse_addmm_activation(h, ctx);
    EXPECT_EQ(print(h), text);
  }
}

TEST(PadMatmul, SixteenBitLmHeadComputesPaddedRowsAndReturnsAStridedView) {
  // GPT-2's LM head in bf16: 50257 columns are no 16-byte multiple. The weight is padded to 50264 rows,
  // the product is computed that wide, and the view on its way out reads rows 50264 apart.
  const std::string in =
      "graph(%x: bf16[2048, 768]{768, 1}@cuda:0, %w: bf16[50257, 768]{768, 1}@cuda:0):\n"
      "  %p: bf16[768, 50257]{1, 768}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %m: bf16[2048, 50257]{50257, 1}@cuda:0 = aten::mm(%x, %p)\n"
      "  %v: bf16[4, 512, 50257]{25731584, 50257, 1}@cuda:0 = aten::view(%m, [4, 512, 50257])\n"
      "  return (%v)\n";
  const std::string expected =
      "graph(%x: bf16[2048, 768]{768, 1}@cuda:0, %w: bf16[50257, 768]{768, 1}@cuda:0):\n"
      "  %p: bf16[768, 50257]{1, 768}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %m_w: bf16[50257, 768]{768, 1}@cuda:0 = aten::permute(%p, [1, 0])\n"
      "  %m_wpad: bf16[50264, 768]{768, 1}@cuda:0 = aten::constant_pad_nd(%m_w, [0, 0, 0, 7], 0.0)\n"
      "  %m_wpad_t: bf16[768, 50264]{1, 768}@cuda:0 = aten::permute(%m_wpad, [1, 0])\n"
      "  %m_padded: bf16[2048, 50264]{50264, 1}@cuda:0 = aten::mm(%x, %m_wpad_t)\n"
      "  %m_cols: bf16[2048, 50257]{50264, 1}@cuda:0 = aten::slice.Tensor(%m_padded, 1, 0, 50257, 1)\n"
      "  %m: bf16[2048, 50257]{50257, 1}@cuda:0 = aten::mm(%x, %p)\n"
      "  %v: bf16[4, 512, 50257]{25735168, 50264, 1}@cuda:0 = aten::view(%m_cols, [4, 512, 50257])\n"
      "  return (%v)\n";
  EXPECT_EQ(run_pass(pad_matmul, in), expected);
  // Left alone: f32, a width of 16-byte rows, a small problem, a product read by a pointwise op.
  const std::string alone[] = {
      "graph(%x: f32[2048, 768]{768, 1}@cuda:0, %w: f32[768, 50257]{50257, 1}@cuda:0):\n"
      "  %m: f32[2048, 50257]{50257, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  return (%m)\n",
      "graph(%x: bf16[2048, 768]{768, 1}@cuda:0, %w: bf16[768, 50264]{50264, 1}@cuda:0):\n"
      "  %m: bf16[2048, 50264]{50264, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  return (%m)\n",
      "graph(%x: bf16[64, 64]{64, 1}@cuda:0, %w: bf16[64, 45]{45, 1}@cuda:0):\n"
      "  %m: bf16[64, 45]{45, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  return (%m)\n",
      "graph(%x: bf16[2048, 768]{768, 1}@cuda:0, %w: bf16[768, 50257]{50257, 1}@cuda:0):\n"
      "  %m: bf16[2048, 50257]{50257, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %t: bf16[2048, 50257]{50257, 1}@cuda:0 = aten::mul.Tensor(%m, 0.5)\n"
      "  return (%t, %m)\n",
  };
  for (const std::string& text : alone) EXPECT_EQ(run_pass(pad_matmul, text), text);
  // A row-major right operand is padded in its columns; the product may be returned as well.
  const std::string row_major = run_pass(pad_matmul,
      "graph(%x: f16[2048, 768]{768, 1}@cuda:0, %w: f16[768, 50257]{50257, 1}@cuda:0):\n"
      "  %m: f16[2048, 50257]{50257, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  return (%m)\n");
  EXPECT_NE(row_major.find("%m_bpad: f16[768, 50264]{50264, 1}@cuda:0 = aten::constant_pad_nd(%w, [0, 7], 0.0)"),
            std::string::npos) << row_major;
  EXPECT_NE(row_major.find("return (%m_cols)"), std::string::npos) << row_major;
}

// A stack of transformer-like layers on CUDA: each layer's mm + bias + tanh-GELU becomes one
// _addmm_activation and its second linear's bias moves into the residual add's kernel, in every layer.
std::string deep_stack(int layers) {
  std::string text = "graph(%h0: f32[8, 16]{16, 1}@cuda:0, %w1: f32[16, 64]{64, 1}@cuda:0, %b1: f32[64]{1}@cuda:0, "
                     "%w2: f32[64, 16]{16, 1}@cuda:0, %b2: f32[16]{1}@cuda:0, %r0: f32[2, 4, 16]{64, 16, 1}@cuda:0):\n";
  for (int i = 1; i <= layers; ++i) {
    const std::string p = std::to_string(i - 1), s = std::to_string(i);
    text += "  %ma" + s + ": f32[8, 64]{64, 1}@cuda:0 = aten::mm(%h" + p + ", %w1)\n";
    text += "  %va" + s + ": f32[2, 4, 64]{256, 64, 1}@cuda:0 = aten::view(%ma" + s + ", [2, 4, 64])\n";
    text += "  %a" + s + ": f32[2, 4, 64]{256, 64, 1}@cuda:0 = aten::add.Tensor(%va" + s + ", %b1)\n";
    text += "  %g" + s + ": f32[2, 4, 64]{256, 64, 1}@cuda:0 = aten::gelu(%a" + s + ", approximate=\"tanh\")\n";
    text += "  %u" + s + ": f32[8, 64]{64, 1}@cuda:0 = aten::view(%g" + s + ", [8, 64])\n";
    text += "  %mb" + s + ": f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b2, %u" + s + ", %w2)\n";
    text += "  %vb" + s + ": f32[2, 4, 16]{64, 16, 1}@cuda:0 = aten::view(%mb" + s + ", [2, 4, 16])\n";
    text += "  %r" + s + ": f32[2, 4, 16]{64, 16, 1}@cuda:0 = aten::add.Tensor(%vb" + s + ", %r" + p + ")\n";
    text += "  %h" + s + ": f32[8, 16]{16, 1}@cuda:0 = aten::view(%r" + s + ", [8, 16])\n";
  }
  return text + "  return (%h" + std::to_string(layers) + ")\n";
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(AddmmActivation, EveryLayerOfADeepStackInOnePass) {
  const std::string out = run_passes({fuse_addmm_activation, eliminate_dead_code}, deep_stack(24));
  EXPECT_EQ(count(out, "= aten::_addmm_activation("), 24u) << out;
  EXPECT_EQ(count(out, "_biased: "), 24u) << out;
  EXPECT_EQ(count(out, "= aten::addmm("), 0u) << out;
  // The same as each layer alone: the first layer's lines of the stack are the one-layer stack's.
  const std::string one = run_passes({fuse_addmm_activation, eliminate_dead_code}, deep_stack(1));
  const std::string first_layer = one.substr(one.find('\n') + 1, one.find("  return") - one.find('\n') - 1);
  EXPECT_NE(out.find(first_layer), std::string::npos) << one << "\n" << out;
}

// A layer over a length Dynamo made symbolic ([2, s0, 16]): the same rewrites as with constant sizes. The
// view back to the activation's shape reuses the shape list the graph's own view was given.
TEST(AddmmActivation, SymbolicSizesTakeTheSameRewrites) {
  const std::string in =
      "graph(%n: int, %x: f32[2, s0, 16]{16*s0, 16, 1}@cuda:0, %w1: f32[16, 64]{64, 1}@cuda:0, %b1: f32[64]{1}@cuda:0, "
      "%w2: f32[64, 16]{16, 1}@cuda:0, %b2: f32[16]{1}@cuda:0):\n"
      "  %rows: int = prim::mul(2, %n)\n"
      "  %u: f32[2*s0, 16]{16, 1}@cuda:0 = aten::view(%x, [%rows, 16])\n"
      "  %ma: f32[2*s0, 64]{64, 1}@cuda:0 = aten::mm(%u, %w1)\n"
      "  %va: f32[2, s0, 64]{64*s0, 64, 1}@cuda:0 = aten::view(%ma, [2, %n, 64])\n"
      "  %a: f32[2, s0, 64]{64*s0, 64, 1}@cuda:0 = aten::add.Tensor(%va, %b1)\n"
      "  %g: f32[2, s0, 64]{64*s0, 64, 1}@cuda:0 = aten::gelu(%a, approximate=\"tanh\")\n"
      "  %ug: f32[2*s0, 64]{64, 1}@cuda:0 = aten::view(%g, [%rows, 64])\n"
      "  %mb: f32[2*s0, 16]{16, 1}@cuda:0 = aten::addmm(%b2, %ug, %w2)\n"
      "  %vb: f32[2, s0, 16]{16*s0, 16, 1}@cuda:0 = aten::view(%mb, [2, %n, 16])\n"
      "  %r: f32[2, s0, 16]{16*s0, 16, 1}@cuda:0 = aten::add.Tensor(%vb, %x)\n"
      "  return (%r)\n";
  const std::string out = run_passes({fuse_addmm_activation, eliminate_dead_code}, in);
  EXPECT_NE(out.find("%g_gemm: f32[2*s0, 64]{64, 1}@cuda:0 = aten::_addmm_activation(%b1, %u, %w1, use_gelu=true)\n"
                     "  %g_view: f32[2, s0, 64]{64*s0, 64, 1}@cuda:0 = aten::view(%g_gemm, [2, %n, 64])\n"),
            std::string::npos) << out;
  EXPECT_NE(out.find("%mb: f32[2*s0, 16]{16, 1}@cuda:0 = aten::mm("), std::string::npos) << out;
  EXPECT_NE(out.find("%vb_biased: f32[2, s0, 16]{16*s0, 16, 1}@cuda:0 = aten::add.Tensor(%vb, %b2)"), std::string::npos) << out;
  EXPECT_EQ(count(out, "= aten::addmm("), 0u) << out;
}

TEST(AddmmActivation, CudaBiasMovesIntoTheKernelOfItsReaders) {
  // A linear on a 3-D input followed by a residual add and a layer norm: the bias add goes after the view,
  // where the fuse pass puts it in one group with the residual add and the layer norm.
  const std::string in =
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0, %r: f32[2, 4, 32]{128, 32, 1}@cuda:0):\n"
      "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %v: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::view(%m, [2, 4, 32])\n"
      "  %s: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::add.Tensor(%v, %r)\n"
      "  %t: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::mul.Tensor(%v, 0.5)\n"
      "  return (%s, %t)\n";
  const std::string expected =
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0, %r: f32[2, 4, 32]{128, 32, 1}@cuda:0):\n"
      "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %v: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::view(%m, [2, 4, 32])\n"
      "  %v_biased: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::add.Tensor(%v, %b)\n"
      "  %s: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::add.Tensor(%v_biased, %r)\n"
      "  %t: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::mul.Tensor(%v_biased, 0.5)\n"
      "  return (%s, %t)\n";
  EXPECT_EQ(run_pass(fuse_addmm_activation, in), expected);
  // A dead reader (eval-mode dropout's clone, as in GPT-2's blocks) changes nothing; dce drops it later.
  std::string with_dead = in, expected_with_dead = expected;
  with_dead.insert(with_dead.find("  %s:"), "  %c: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::clone(%v)\n");
  expected_with_dead.insert(expected_with_dead.find("  %s:"), "  %c: f32[2, 4, 32]{128, 32, 1}@cuda:0 = aten::clone(%v_biased)\n");
  EXPECT_EQ(run_pass(fuse_addmm_activation, with_dead), expected_with_dead);
  // Left alone: the result is a graph output, a reader that does not fuse (a permute, a row sum), the CPU.
  const std::string alone[] = {
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0):\n"
      "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %t: f32[8, 32]{32, 1}@cuda:0 = aten::mul.Tensor(%m, 0.5)\n"
      "  return (%t, %m)\n",
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0):\n"
      "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %p: f32[32, 8]{1, 32}@cuda:0 = aten::permute(%m, [1, 0])\n"
      "  return (%p)\n",
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0):\n"
      "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %s: f32[8]{1}@cuda:0 = aten::sum.dim_IntList(%m, [-1])\n"
      "  return (%s)\n",
      "graph(%x: f32[8, 16]{16, 1}@cpu, %w: f32[16, 32]{32, 1}@cpu, %b: f32[32]{1}@cpu, %r: f32[8, 32]{32, 1}@cpu):\n"
      "  %m: f32[8, 32]{32, 1}@cpu = aten::addmm(%b, %x, %w)\n"
      "  %s: f32[8, 32]{32, 1}@cpu = aten::add.Tensor(%m, %r)\n"
      "  return (%s)\n",
  };
  for (const std::string& text : alone) EXPECT_EQ(run_pass(fuse_addmm_activation, text), text);
  // erf GELU (no cuBLASLt epilogue): the bias joins the gelu's kernel.
  EXPECT_EQ(run_pass(fuse_addmm_activation,
                     "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0):\n"
                     "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
                     "  %g: f32[4, 8]{8, 1}@cuda:0 = aten::gelu(%a)\n"
                     "  return (%g)\n"),
            "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0):\n"
            "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::mm(%x, %w)\n"
            "  %a_biased: f32[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%a, %b)\n"
            "  %g: f32[4, 8]{8, 1}@cuda:0 = aten::gelu(%a_biased)\n"
            "  return (%g)\n");
  // Relu keeps its cuBLASLt epilogue.
  const std::string relu = run_pass(fuse_addmm_activation,
                                    "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 32]{32, 1}@cuda:0, %b: f32[32]{1}@cuda:0):\n"
                                    "  %m: f32[8, 32]{32, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
                                    "  %t: f32[8, 32]{32, 1}@cuda:0 = aten::relu(%m)\n"
                                    "  return (%t)\n");
  EXPECT_NE(relu.find("aten::_addmm_activation"), std::string::npos) << relu;
}

TEST(AddmmActivation, ReluAndTanhGeluAfterCudaAddmmBecomeOneOp) {
  const std::string in =
      "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[8, 16]{16, 1}@cuda:0):\n"
      "  %wt: f32[16, 8]{1, 16}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %wt)\n"
      "  %r: f32[4, 8]{8, 1}@cuda:0 = aten::relu(%a)\n"
      "  %a2: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %wt)\n"
      "  %g: f32[4, 8]{8, 1}@cuda:0 = aten::gelu(%a2, approximate=\"tanh\")\n"
      "  return (%r, %g)\n";
  const std::string expected =
      "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[8, 16]{16, 1}@cuda:0):\n"
      "  %wt: f32[16, 8]{1, 16}@cuda:0 = aten::permute(%w, [1, 0])\n"
      "  %r: f32[4, 8]{8, 1}@cuda:0 = aten::_addmm_activation(%b, %x, %wt, use_gelu=false)\n"
      "  %g: f32[4, 8]{8, 1}@cuda:0 = aten::_addmm_activation(%b, %x, %wt, use_gelu=true)\n"
      "  return (%r, %g)\n";
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  fuse_addmm_activation(g, ctx);
  eliminate_dead_code(g, ctx);
  EXPECT_EQ(print(g), expected);
}

TEST(AddmmActivation, LeavesCpuSharedAndScaledAddmmAlone) {
  const std::string cases[] = {
      // on the CPU (oneDNN's epilogue pass handles these there)
      "graph(%b: f32[8]{1}@cpu, %x: f32[4, 16]{16, 1}@cpu, %w: f32[16, 8]{8, 1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::addmm(%b, %x, %w)\n"
      "  %r: f32[4, 8]{8, 1}@cpu = aten::relu(%a)\n"
      "  return (%r)\n",
      // the addmm's result is also a graph output
      "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0):\n"
      "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %r: f32[4, 8]{8, 1}@cuda:0 = aten::relu(%a)\n"
      "  return (%a, %r)\n",
      // beta != 1
      "graph(%b: f32[8]{1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0):\n"
      "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %w, beta=2)\n"
      "  %r: f32[4, 8]{8, 1}@cuda:0 = aten::relu(%a)\n"
      "  return (%r)\n",
      // a bias that is a full matrix
      "graph(%b: f32[4, 8]{8, 1}@cuda:0, %x: f32[4, 16]{16, 1}@cuda:0, %w: f32[16, 8]{8, 1}@cuda:0):\n"
      "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
      "  %r: f32[4, 8]{8, 1}@cuda:0 = aten::relu(%a)\n"
      "  return (%r)\n"};
  for (const std::string& text : cases) {
    Graph g = parse(text);
    CompileOptions options;
    PassContext ctx{options};
    fuse_addmm_activation(g, ctx);
    EXPECT_EQ(print(g), text);
  }
}

// A conv -> eval batch norm -> relu block as AOTAutograd hands it over: parameters and buffers are inputs.
const char* kConvBnRelu =
    "graph(%w: f32[5, 3, 3, 3]{27, 9, 3, 1}@cpu, %x: f32[2, 3, 7, 7]{147, 49, 7, 1}@cpu, %mean: f32[5]{1}@cpu, "
    "%var: f32[5]{1}@cpu, %gamma: f32[5]{1}@cpu, %beta: f32[5]{1}@cpu):\n"
    "  %conv: f32[2, 5, 7, 7]{245, 49, 7, 1}@cpu = aten::convolution(%x, %w, None, [1, 1], [1, 1], [1, 1], false, [0, 0], 1)\n"
    "  %bn: f32[2, 5, 7, 7]{245, 49, 7, 1}@cpu, %bn_1: f32[0]{1}@cpu, %bn_2: f32[0]{1}@cpu = "
    "aten::_native_batch_norm_legit_no_training(%conv, %gamma, %beta, %mean, %var, 0.1, 1e-05)\n"
    "  %relu: f32[2, 5, 7, 7]{245, 49, 7, 1}@cpu = aten::relu(%bn)\n"
    "  return (%relu)\n";

TEST(FoldBatchNorm, ConvBatchNormBecomesConvWithFoldedWeights) {
  const std::string expected =
      "graph(%w: f32[5, 3, 3, 3]{27, 9, 3, 1}@cpu, %x: f32[2, 3, 7, 7]{147, 49, 7, 1}@cpu, %mean: f32[5]{1}@cpu, "
      "%var: f32[5]{1}@cpu, %gamma: f32[5]{1}@cpu, %beta: f32[5]{1}@cpu):\n"
      "  %bn_w: f32[5, 3, 3, 3]{27, 9, 3, 1}@cpu, %bn_b: f32[5]{1}@cpu = ember::fold_batchnorm(%w, None, %gamma, %beta, "
      "%mean, %var, 1e-05) #0\n"
      "  %bn_conv: f32[2, 5, 7, 7]{245, 49, 7, 1}@cpu = aten::convolution(%x, %bn_w, %bn_b, [1, 1], [1, 1], [1, 1], "
      "false, [0, 0], 1)\n"
      "  %relu: f32[2, 5, 7, 7]{245, 49, 7, 1}@cpu = aten::relu(%bn_conv)\n"
      "  return (%relu)\n";
  EXPECT_EQ(run_pass(fold_batchnorm, kConvBnRelu), expected);

  // The whole pipeline, against the graph with the pass off, on several calls (the fold is cached, the
  // convolution packs its weights from the second call on), and after a parameter changes in place.
  at::Tensor w = at::randn({5, 3, 3, 3}), x = at::randn({2, 3, 7, 7}), mean = at::randn({5}),
             var = at::rand({5}) + 0.5, gamma = at::randn({5}), beta = at::randn({5});
  auto eager = [&] { return at::relu(at::batch_norm(at::conv2d(x, w, {}, 1, 1), gamma, beta, mean, var, false, 0.1, 1e-5, false)); };
  CompileOptions options;
  auto compiled = compile(parse(kConvBnRelu), {}, options);
  for (int call = 0; call < 4; ++call) {
    if (call == 3) gamma.mul_(2);  // moves the version counter: the fold must be redone
    auto out = compiled->run({w, x, mean, var, gamma, beta});
    EXPECT_TRUE(at::allclose(out[0].toTensor(), eager(), 1e-4, 1e-5)) << "call " << call;
  }
  EXPECT_NE(compiled->describe().find("fold_batchnorm"), std::string::npos);
}

TEST(FoldBatchNorm, LeavesBatchNormAloneWhenTheConvResultIsUsedElsewhere) {
  std::string shared = kConvBnRelu;
  shared.replace(shared.find("return (%relu)"), 14, "return (%relu, %conv)");
  std::string computed_weights = kConvBnRelu;  // weights computed in the graph: not a parameter
  computed_weights.replace(computed_weights.find("  %conv"), 0,
                           "  %w2: f32[5, 3, 3, 3]{27, 9, 3, 1}@cpu = aten::neg(%w)\n");
  computed_weights.replace(computed_weights.find("(%x, %w,"), 8, "(%x, %w2,");
  std::string stats_used = kConvBnRelu;
  stats_used.replace(stats_used.find("return (%relu)"), 14, "return (%relu, %bn_1)");
  std::string on_double = kConvBnRelu;
  for (size_t at = on_double.find("f32"); at != std::string::npos; at = on_double.find("f32", at)) on_double.replace(at, 3, "f64");
  for (const std::string& text : {shared, computed_weights, stats_used, on_double}) {
    std::string canonical = print(parse(text));
    EXPECT_EQ(run_pass(fold_batchnorm, text), canonical);
  }
}

// resnet's bottleneck end on CUDA, bf16 channels_last: conv -> eval batch norm -> add residual -> relu.
std::string cuda_residual_block(bool residual) {
  const std::string t = "bf16[2, 8, 5, 5]{200, 1, 40, 8}@cuda:0", c = "bf16[8]{1}@cuda:0";
  std::string g = "graph(%x: " + t + ", %w: bf16[8, 8, 1, 1]{8, 1, 8, 8}@cuda:0, %g: " + c + ", %b: " + c + ", %m: " + c +
                  ", %v: " + c + ", %z: " + t + "):\n"
                  "  %conv: " + t + " = aten::convolution(%x, %w, None, [1, 1], [0, 0], [1, 1], false, [0, 0], 1)\n"
                  "  %bn: " + t + ", %s1: bf16[0]{1}@cuda:0, %s2: bf16[0]{1}@cuda:0 = "
                  "aten::_native_batch_norm_legit_no_training(%conv, %g, %b, %m, %v, 0.1, 1e-05)\n";
  if (residual) g += "  %sum: " + t + " = aten::add.Tensor(%bn, %z)\n  %r: " + t + " = aten::relu(%sum)\n";
  else g += "  %r: " + t + " = aten::relu(%bn)\n";
  return g + "  return (%r)\n";
}

std::string fold_with_cache(const std::string& text, std::vector<bool> cached) {
  Graph g = parse(text);
  CompileOptions options;
  options.cached_inputs = std::move(cached);
  PassContext ctx{options};
  fold_batchnorm(g, ctx);
  g.verify();
  return print(g);
}

TEST(FoldBatchNorm, CudaConvBatchNormAddReluBecomesOneCudnnCall) {
  // With the parameters cached: the fold (bf16 bias, in the weights' dtype), then one cuDNN call with the
  // bias, the residual and the relu fused, where the relu was; the convolution, batch norm, add and relu go.
  const std::vector<bool> cached = {false, true, true, true, true, true, false};
  std::string after = fold_with_cache(cuda_residual_block(true), cached);
  EXPECT_NE(after.find("%bn_b: bf16[8]{1}@cuda:0 = ember::fold_batchnorm(%w, None, %g, %b, %m, %v, 1e-05)"), std::string::npos) << after;
  EXPECT_NE(after.find("= aten::cudnn_convolution_add_relu(%x, %bn_w, %z, 1.0, %bn_b, [1, 1], [0, 0], [1, 1], 1)"), std::string::npos)
      << after;
  for (const char* gone : {"aten::convolution(", "_no_training", "aten::add.Tensor", "aten::relu("})
    EXPECT_EQ(after.find(gone), std::string::npos) << gone << "\n" << after;
  after = fold_with_cache(cuda_residual_block(false), cached);
  EXPECT_NE(after.find("= aten::cudnn_convolution_relu(%x, %bn_w, %bn_b, [1, 1], [0, 0], [1, 1], 1)"), std::string::npos) << after;

  // A weight copied into another layout in the graph (layout.py's channels_last copies) stays put too.
  std::string copied = cuda_residual_block(false);
  copied.replace(copied.find("  %conv"), 0, "  %wc: bf16[8, 8, 1, 1]{8, 1, 8, 8}@cuda:0 = aten::clone(%w, memory_format=channels_last)\n");
  copied.replace(copied.find("(%x, %w,"), 8, "(%x, %wc,");
  EXPECT_NE(fold_with_cache(copied, cached).find("aten::cudnn_convolution_relu(%x, %bn_w,"), std::string::npos);
}

TEST(FoldBatchNorm, CudaLeavesBatchNormsWithoutAReluOrCachedParameters) {
  // Not cached (a training graph's parameters), a batch norm that ends the graph, an add that broadcasts,
  // and cuDNN switched off: all left for bn_pointwise.
  const std::vector<bool> cached = {false, true, true, true, true, true, false};
  std::string bare = cuda_residual_block(true);
  EXPECT_EQ(fold_with_cache(bare, {false, false, true, true, true, true, false}), print(parse(bare)));
  std::string ends = cuda_residual_block(false);
  ends.replace(ends.find("  %r:"), ends.find("  return") - ends.find("  %r:"), "");
  ends.replace(ends.find("return (%r)"), 11, "return (%bn)");
  EXPECT_EQ(fold_with_cache(ends, cached), print(parse(ends)));
  std::string broadcast = cuda_residual_block(true);
  const std::string full_z = "%z: bf16[2, 8, 5, 5]{200, 1, 40, 8}";
  broadcast.replace(broadcast.find(full_z), full_z.size(), "%z: bf16[8, 1, 1]{1, 1, 1}");
  EXPECT_EQ(fold_with_cache(broadcast, cached), print(parse(broadcast)));
  auto replaced = [](std::string text, const std::string& from, const std::string& to) {
    return text.replace(text.find(from), from.size(), to);
  };
  // A grouped (ResNeXt) or dilated convolution: not tried with cuDNN's fused engines.
  const std::string grouped = replaced(replaced(bare, "bf16[8, 8, 1, 1]{8, 1, 8, 8}", "bf16[8, 4, 1, 1]{4, 1, 4, 4}"),
                                       "[0, 0], 1)", "[0, 0], 2)");
  EXPECT_EQ(fold_with_cache(grouped, cached), print(parse(grouped)));
  const std::string dilated = replaced(bare, "[0, 0], [1, 1], false", "[0, 0], [2, 2], false");
  EXPECT_EQ(fold_with_cache(dilated, cached), print(parse(dilated)));
  // Both are folded where nothing else differs (the checks above are not vacuous).
  EXPECT_NE(fold_with_cache(bare, cached), print(parse(bare)));
  at::globalContext().setUserEnabledCuDNN(false);
  std::string off = fold_with_cache(bare, cached);
  at::globalContext().setUserEnabledCuDNN(true);
  EXPECT_EQ(off, print(parse(bare)));
}

// Consecutive small CUDA linear layers (passes/linear_chain.cpp): one ember::linear_chain node in the last
// layer's place, the others left for dce.
TEST(LinearChain, ConsecutiveSmallCudaLinearsBecomeOneChain) {
  const std::string in =
      "graph(%x: f32[32, 100]{100, 1}@cuda:0, %w0: f32[100, 100]{100, 1}@cuda:0, %b0: f32[100]{1}@cuda:0, "
      "%w1: f32[64, 100]{100, 1}@cuda:0, %b1: f32[64]{1}@cuda:0, %w2: f32[64, 10]{10, 1}@cuda:0, %b2: f32[10]{1}@cuda:0, %w3: f32[10, 10]{1, 10}@cuda:0):\n"
      "  %t0: f32[100, 100]{1, 100}@cuda:0 = aten::permute(%w0, [1, 0])\n"
      "  %a0: f32[32, 100]{100, 1}@cuda:0 = aten::addmm(%b0, %x, %t0)\n"
      "  %t1: f32[100, 64]{1, 100}@cuda:0 = aten::permute(%w1, [1, 0])\n"
      "  %a1: f32[32, 64]{64, 1}@cuda:0 = aten::_addmm_activation(%b1, %a0, %t1, use_gelu=false)\n"
      "  %a2: f32[32, 10]{10, 1}@cuda:0 = aten::_addmm_activation(%b2, %a1, %w2, beta=1, alpha=1, use_gelu=true)\n"
      "  %a3: f32[32, 10]{10, 1}@cuda:0 = aten::mm(%a2, %w3)\n"
      "  return (%a3)\n";
  const std::string expected =
      "graph(%x: f32[32, 100]{100, 1}@cuda:0, %w0: f32[100, 100]{100, 1}@cuda:0, %b0: f32[100]{1}@cuda:0, "
      "%w1: f32[64, 100]{100, 1}@cuda:0, %b1: f32[64]{1}@cuda:0, %w2: f32[64, 10]{10, 1}@cuda:0, %b2: f32[10]{1}@cuda:0, %w3: f32[10, 10]{1, 10}@cuda:0):\n"
      "  %t0: f32[100, 100]{1, 100}@cuda:0 = aten::permute(%w0, [1, 0])\n"
      "  %t1: f32[100, 64]{1, 100}@cuda:0 = aten::permute(%w1, [1, 0])\n"
      "  %a3: f32[32, 10]{10, 1}@cuda:0 = ember::linear_chain(%x, [%t0, %t1, %w2, %w3], [%b0, %b1, %b2, None], [0, 1, 2, 0])\n"
      "  return (%a3)\n";
  EXPECT_EQ(run_passes({fuse_linear_chains, eliminate_dead_code}, in), expected);
}

TEST(LinearChain, LeavesLayersWhoseResultsAreReadElsewhereOrTooWide) {
  const std::string head =
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 16]{16, 1}@cuda:0, %b: f32[16]{1}@cuda:0):\n";
  const std::string alone[] = {
      // the first result is also returned
      head + "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
             "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
             "  return (%c, %a)\n",
      // the first result is read by something else too
      head + "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
             "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
             "  %d: f32[8, 16]{16, 1}@cuda:0 = aten::add.Tensor(%c, %a)\n"
             "  return (%d)\n",
      // the first result is the right operand of the next GEMM
      head + "  %a: f32[16, 16]{16, 1}@cuda:0 = aten::addmm(%b, %w, %w)\n"
             "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::mm(%x, %a)\n"
             "  return (%c)\n",
      // alpha != 1
      head + "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %x, %w, alpha=2)\n"
             "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
             "  return (%c)\n",
      // a layer wider than 128
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 200]{200, 1}@cuda:0, %v: f32[200, 16]{16, 1}@cuda:0):\n"
      "  %a: f32[8, 200]{200, 1}@cuda:0 = aten::mm(%x, %w)\n"
      "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::mm(%a, %v)\n"
      "  return (%c)\n",
      // the CPU (oneDNN takes its linears with their epilogues)
      "graph(%x: f32[8, 16]{16, 1}@cpu, %w: f32[16, 16]{16, 1}@cpu, %b: f32[16]{1}@cpu):\n"
      "  %a: f32[8, 16]{16, 1}@cpu = aten::addmm(%b, %x, %w)\n"
      "  %c: f32[8, 16]{16, 1}@cpu = aten::addmm(%b, %a, %w)\n"
      "  return (%c)\n",
      // a graph that writes in place
      head + "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %x, %w)\n"
             "  %c: f32[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
             "  %m: f32[16]{1}@cuda:0 = aten::mul_.Tensor(%b, 2)\n"
             "  return (%c)\n",
  };
  for (const std::string& text : alone) EXPECT_EQ(run_pass(fuse_linear_chains, text), text);
}

TEST(LinearChain, LongChainsSplitAtThirtyTwoLayers) {
  std::string text = "graph(%x: bf16[4, 8]{8, 1}@cuda:0, %w: bf16[8, 8]{8, 1}@cuda:0):\n";
  std::string prev = "%x";
  for (int i = 0; i < 34; ++i) {
    text += "  %y" + std::to_string(i) + ": bf16[4, 8]{8, 1}@cuda:0 = aten::mm(" + prev + ", %w)\n";
    prev = "%y" + std::to_string(i);
  }
  text += "  return (" + prev + ")\n";
  Graph g = parse(text);
  CompileOptions options;
  PassContext ctx{options};
  fuse_linear_chains(g, ctx);
  eliminate_dead_code(g, ctx);
  const std::string out = print(g);
  ASSERT_EQ(g.nodes().size(), 2u) << out;
  EXPECT_EQ(g.nodes()[0]->op, "ember::linear_chain");
  EXPECT_EQ(g.nodes()[0]->args[1].list.size(), 32u);
  EXPECT_EQ(g.nodes()[1]->args[1].list.size(), 2u);
  EXPECT_EQ(g.nodes()[1]->args[0].value, g.nodes()[0]->outputs[0]);
}

TEST(LinearChain, SoftmaxOverTheLastLayerJoinsAsItsEpilogue) {
  // A single GEMM with a row softmax: a chain of one layer, softmax=1.
  EXPECT_EQ(run_pass(fuse_linear_chains,
                     "graph(%a: f32[100, 100]{100, 1}@cuda:0, %b: f32[100, 100]{100, 1}@cuda:0):\n"
                     "  %mm: f32[100, 100]{100, 1}@cuda:0 = aten::mm(%a, %b)\n"
                     "  %s: f32[100, 100]{100, 1}@cuda:0 = aten::_softmax(%mm, -1, false)\n"
                     "  return (%s)\n"),
            "graph(%a: f32[100, 100]{100, 1}@cuda:0, %b: f32[100, 100]{100, 1}@cuda:0):\n"
            "  %mm: f32[100, 100]{100, 1}@cuda:0 = aten::mm(%a, %b)\n"
            "  %s: f32[100, 100]{100, 1}@cuda:0 = ember::linear_chain(%a, [%b], [None], [0], 1)\n"
            "  return (%s)\n");
  // Two layers and a log_softmax over dim 1 of the 2-D result.
  EXPECT_EQ(run_pass(fuse_linear_chains,
                     "graph(%x: bf16[8, 16]{16, 1}@cuda:0, %w: bf16[16, 16]{16, 1}@cuda:0, %b: bf16[16]{1}@cuda:0):\n"
                     "  %a: bf16[8, 16]{16, 1}@cuda:0 = aten::_addmm_activation(%b, %x, %w, use_gelu=false)\n"
                     "  %c: bf16[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
                     "  %s: bf16[8, 16]{16, 1}@cuda:0 = aten::_log_softmax(%c, 1, false)\n"
                     "  return (%s)\n"),
            "graph(%x: bf16[8, 16]{16, 1}@cuda:0, %w: bf16[16, 16]{16, 1}@cuda:0, %b: bf16[16]{1}@cuda:0):\n"
            "  %a: bf16[8, 16]{16, 1}@cuda:0 = aten::_addmm_activation(%b, %x, %w, use_gelu=false)\n"
            "  %c: bf16[8, 16]{16, 1}@cuda:0 = aten::addmm(%b, %a, %w)\n"
            "  %s: bf16[8, 16]{16, 1}@cuda:0 = ember::linear_chain(%x, [%w, %w], [%b, %b], [1, 0], 2)\n"
            "  return (%s)\n");
  // Left alone: a softmax over dim 0, one whose input is read elsewhere too, one that changes dtype.
  const std::string alone[] = {
      "graph(%a: f32[100, 100]{100, 1}@cuda:0, %b: f32[100, 100]{100, 1}@cuda:0):\n"
      "  %mm: f32[100, 100]{100, 1}@cuda:0 = aten::mm(%a, %b)\n"
      "  %s: f32[100, 100]{100, 1}@cuda:0 = aten::_softmax(%mm, 0, false)\n"
      "  return (%s)\n",
      "graph(%a: f32[100, 100]{100, 1}@cuda:0, %b: f32[100, 100]{100, 1}@cuda:0):\n"
      "  %mm: f32[100, 100]{100, 1}@cuda:0 = aten::mm(%a, %b)\n"
      "  %s: f32[100, 100]{100, 1}@cuda:0 = aten::_softmax(%mm, -1, false)\n"
      "  return (%s, %mm)\n",
      "graph(%a: f16[100, 100]{100, 1}@cuda:0, %b: f16[100, 100]{100, 1}@cuda:0):\n"
      "  %mm: f16[100, 100]{100, 1}@cuda:0 = aten::mm(%a, %b)\n"
      "  %s: f32[100, 100]{100, 1}@cuda:0 = aten::_softmax(%mm, -1, true)\n"
      "  return (%s)\n",
  };
  for (const std::string& text : alone) EXPECT_EQ(run_pass(fuse_linear_chains, text), text);
}

}  // namespace
}  // namespace ember

// overlap_collectives: IR text only; running a collective needs a process group, which the gloo worlds of
// test/python/test_distributed.py provide (results against eager with the pass on and off).
namespace ember {
namespace {

// %ar rises above %s, %ag above %o (the wait it would not pass is still above the cosine then); %w sinks to
// %o, and %w2, read by the graph's outputs alone, to the end.
TEST(OverlapCollectives, StartsRiseToTheirInputsWaitsSinkToTheirFirstReader) {
  const std::string in =
      "graph(%x: f32[4]{1}@cpu, %y: f32[4]{1}@cpu):\n"
      "  %m: f32[4]{1}@cpu = aten::mul.Tensor(%x, 2)\n"
      "  %s: f32[4]{1}@cpu = aten::sin(%y)\n"
      "  %ar: f32[4]{1}@cpu = _c10d_functional::all_reduce(%m, \"sum\", \"0\")\n"
      "  %w: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar)\n"
      "  %c: f32[4]{1}@cpu = aten::cos(%s)\n"
      "  %e: f32[4]{1}@cpu = aten::exp(%c)\n"
      "  %o: f32[4]{1}@cpu = aten::add.Tensor(%w, %e)\n"
      "  %ag: f32[8]{1}@cpu = _c10d_functional::all_gather_into_tensor(%e, 2, \"0\")\n"
      "  %w2: f32[8]{1}@cpu = _c10d_functional::wait_tensor(%ag)\n"
      "  %t: f32[4]{1}@cpu = aten::tanh(%o)\n"
      "  return (%t, %w2)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu, %y: f32[4]{1}@cpu):\n"
      "  %m: f32[4]{1}@cpu = aten::mul.Tensor(%x, 2)\n"
      "  %ar: f32[4]{1}@cpu = _c10d_functional::all_reduce(%m, \"sum\", \"0\")\n"
      "  %s: f32[4]{1}@cpu = aten::sin(%y)\n"
      "  %c: f32[4]{1}@cpu = aten::cos(%s)\n"
      "  %e: f32[4]{1}@cpu = aten::exp(%c)\n"
      "  %ag: f32[8]{1}@cpu = _c10d_functional::all_gather_into_tensor(%e, 2, \"0\")\n"
      "  %w: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar)\n"
      "  %o: f32[4]{1}@cpu = aten::add.Tensor(%w, %e)\n"
      "  %t: f32[4]{1}@cpu = aten::tanh(%o)\n"
      "  %w2: f32[8]{1}@cpu = _c10d_functional::wait_tensor(%ag)\n"
      "  return (%t, %w2)\n";
  EXPECT_EQ(run_pass(overlap_collectives, in), expected);
  // A second run finds nothing to move.
  EXPECT_EQ(run_pass(overlap_collectives, expected), expected);
}

TEST(OverlapCollectives, InPlaceWritesGroupsAndOtherCollectivesHoldNodesBack) {
  // The second all_reduce's start stays behind the first one's wait (collectives keep their order) and behind
  // the copy_ (nothing moves across a write); the first wait stops at the copy_; the second wait's reader %r is
  // in group 0, which runs where %q stands.
  const std::string in =
      "graph(%x: f32[4]{1}@cpu, %buf: f32[4]{1}@cpu):\n"
      "  %ar: f32[4]{1}@cpu = _c10d_functional::all_reduce(%x, \"sum\", \"0\")\n"
      "  %w: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar)\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %d: f32[4]{1}@cpu = aten::copy_(%buf, %a)\n"
      "  %ar2: f32[4]{1}@cpu = _c10d_functional::all_reduce(%x, \"sum\", \"0\")\n"
      "  %w2: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar2)\n"
      "  %q: f32[4]{1}@cpu = aten::cos(%a) #0\n"
      "  %b: f32[4]{1}@cpu = aten::exp(%a)\n"
      "  %r: f32[4]{1}@cpu = aten::add.Tensor(%q, %w2) #0\n"
      "  %o: f32[4]{1}@cpu = aten::add.Tensor(%w, %r)\n"
      "  return (%o, %b)\n";
  const std::string expected =
      "graph(%x: f32[4]{1}@cpu, %buf: f32[4]{1}@cpu):\n"
      "  %ar: f32[4]{1}@cpu = _c10d_functional::all_reduce(%x, \"sum\", \"0\")\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %w: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar)\n"
      "  %d: f32[4]{1}@cpu = aten::copy_(%buf, %a)\n"
      "  %ar2: f32[4]{1}@cpu = _c10d_functional::all_reduce(%x, \"sum\", \"0\")\n"
      "  %w2: f32[4]{1}@cpu = _c10d_functional::wait_tensor(%ar2)\n"
      "  %q: f32[4]{1}@cpu = aten::cos(%a) #0\n"
      "  %b: f32[4]{1}@cpu = aten::exp(%a)\n"
      "  %r: f32[4]{1}@cpu = aten::add.Tensor(%q, %w2) #0\n"
      "  %o: f32[4]{1}@cpu = aten::add.Tensor(%w, %r)\n"
      "  return (%o, %b)\n";
  EXPECT_EQ(run_pass(overlap_collectives, in), expected);
}

// A rotary embedding as LLaMA's graphs hold it: q a transposed projection, rotate_half(q) a cat of its negated
// upper half and its lower half.
std::string rotary_graph() {
  const std::string q = "f32[1, 2, 3, 8]{48, 8, 16, 1}@cpu", half = "f32[1, 2, 3, 4]{48, 8, 16, 1}@cpu";
  const std::string row = "f32[1, 2, 3, 8]{48, 24, 8, 1}@cpu", table = "f32[1, 1, 3, 8]{24, 24, 8, 1}@cpu";
  return "graph(%q: " + q + ", %cos: " + table + ", %sin: " + table + "):\n"
         "  %lo: " + half + " = aten::slice.Tensor(%q, 3, 0, 4)\n"
         "  %hi: " + half + " = aten::slice.Tensor(%q, 3, 4, 9223372036854775807)\n"
         "  %neg: f32[1, 2, 3, 4]{24, 4, 8, 1}@cpu = aten::neg(%hi)\n"
         "  %cat: " + row + " = aten::cat([%neg, %lo], -1)\n"
         "  %a: " + q + " = aten::mul.Tensor(%q, %cos)\n"
         "  %b: " + row + " = aten::mul.Tensor(%cat, %sin)\n"
         "  %y: " + q + " = aten::add.Tensor(%a, %b)\n"
         "  return (%y)\n";
}

TEST(RotateHalf, TheRotationAndItsMultipliesMoveToTheSplitLastDim) {
  // q's last dim 8 split into [2, 4]: the rotation is where(second half, q's lower half, -(q's upper half)), both
  // halves spread over the split dim with stride 0; cos, sin and the multiplies and add follow, and the result is
  // flattened back to q's layout. After fuse, everything but views is one group.
  const std::string expected =
      "graph(%q: f32[1, 2, 3, 8]{48, 8, 16, 1}@cpu, %cos: f32[1, 1, 3, 8]{24, 24, 8, 1}@cpu, %sin: f32[1, 1, 3, 8]{24, 24, 8, 1}@cpu):\n"
      "  %cat_rh0_q_halves: f32[1, 2, 3, 2, 4]{48, 8, 16, 4, 1}@cpu = aten::unflatten.int(%q, -1, [2, 4])\n"
      "  %cat_rh1_cos_halves: f32[1, 1, 3, 2, 4]{24, 24, 8, 4, 1}@cpu = aten::unflatten.int(%cos, -1, [2, 4])\n"
      "  %cat_rh2_sin_halves: f32[1, 1, 3, 2, 4]{24, 24, 8, 4, 1}@cpu = aten::unflatten.int(%sin, -1, [2, 4])\n"
      "  %cat_rh3_half_index: i64[2]{1}@cpu = aten::arange(2, device=cpu)\n"
      "  %cat_rh4_second_half: b8[2]{1}@cpu = aten::eq.Scalar(%cat_rh3_half_index, 1)\n"
      "  %cat_rh5_second_half_col: b8[2, 1]{1, 1}@cpu = aten::unsqueeze(%cat_rh4_second_half, 1)\n"
      "  %cat_rh6_lo: f32[1, 2, 3, 1, 4]{48, 8, 16, 4, 1}@cpu = aten::slice.Tensor(%cat_rh0_q_halves, 3, 0, 1)\n"
      "  %cat_rh7_lo_spread: f32[1, 2, 3, 2, 4]{48, 8, 16, 0, 1}@cpu = aten::expand(%cat_rh6_lo, [-1, -1, -1, 2, -1])\n"
      "  %cat_rh8_hi: f32[1, 2, 3, 1, 4]{48, 8, 16, 4, 1}@cpu = aten::slice.Tensor(%cat_rh0_q_halves, 3, 1, 2)\n"
      "  %cat_rh9_hi_spread: f32[1, 2, 3, 2, 4]{48, 8, 16, 0, 1}@cpu = aten::expand(%cat_rh8_hi, [-1, -1, -1, 2, -1])\n"
      "  %cat_rh10_hi_neg: f32[1, 2, 3, 2, 4]{48, 24, 8, 4, 1}@cpu = aten::neg(%cat_rh9_hi_spread)\n"
      "  %cat_rh11_rotated: f32[1, 2, 3, 2, 4]{48, 24, 8, 4, 1}@cpu = aten::where.self(%cat_rh5_second_half_col, %cat_rh7_lo_spread, %cat_rh10_hi_neg)\n"
      "  %cat_rh12_a: f32[1, 2, 3, 2, 4]{48, 8, 16, 4, 1}@cpu = aten::mul.Tensor(%cat_rh0_q_halves, %cat_rh1_cos_halves)\n"
      "  %cat_rh13_b: f32[1, 2, 3, 2, 4]{48, 24, 8, 4, 1}@cpu = aten::mul.Tensor(%cat_rh11_rotated, %cat_rh2_sin_halves)\n"
      "  %cat_rh14_y: f32[1, 2, 3, 2, 4]{48, 8, 16, 4, 1}@cpu = aten::add.Tensor(%cat_rh12_a, %cat_rh13_b)\n"
      "  %cat_rh15_y_flat: f32[1, 2, 3, 8]{48, 8, 16, 1}@cpu = aten::flatten.using_ints(%cat_rh14_y, -2, -1)\n"
      "  return (%cat_rh15_y_flat)\n";
  EXPECT_EQ(run_passes({rotate_half, eliminate_dead_code}, rotary_graph()), expected);
  Graph g = parse(expected);
  CompileOptions options;
  PassContext ctx{options};
  fuse(g, ctx);
  std::set<int> groups;
  for (const auto& n : g.nodes())
    if (n->outputs[0]->type.tensor.sizes.size() == 5 && op_info(n->op).has(kFusible)) groups.insert(n->group);
  EXPECT_EQ(groups, std::set<int>{0}) << print(g);
}

TEST(RotateHalf, ComputesWhatTheCatDid) {
  const std::string text = rotary_graph();
  for (int seed = 0; seed < 3; ++seed) {
    at::manual_seed(seed);
    at::Tensor q = at::randn({1, 3, 2, 8}).transpose(1, 2), cos = at::randn({1, 1, 3, 8}), sin = at::randn({1, 1, 3, 8});
    at::Tensor want = q * cos + at::cat({-q.slice(3, 4), q.slice(3, 0, 4)}, -1) * sin;
    auto with = run_text(text, {q, cos, sin});
    auto without = run_text(text, {q, cos, sin}, {"rotate_half"});
    EXPECT_TRUE(at::allclose(with[0].toTensor(), want, 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(without[0].toTensor(), want, 1e-6, 1e-6));
    EXPECT_TRUE(with[0].toTensor().transpose(1, 2).is_contiguous());  // q's layout, as eager's
  }
}

TEST(RotateHalf, AChannelsLastCloneStaysInTheOriginalRank) {
  // A channels_last clone (what a CPU convolution's input gets) names a 4-D layout: it does not move to the 5-D
  // split space, and the rotation it reads is flattened back for it (fuzz seed 1911335).
  const std::string in =
      "graph(%x: f32[2, 2, 3, 4]{24, 12, 4, 1}@cpu):\n"
      "  %lo: f32[2, 2, 3, 2]{24, 12, 4, 1}@cpu = aten::slice.Tensor(%x, 3, 0, 2)\n"
      "  %hi: f32[2, 2, 3, 2]{24, 12, 4, 1}@cpu = aten::slice.Tensor(%x, 3, 2, 9223372036854775807)\n"
      "  %neg: f32[2, 2, 3, 2]{12, 6, 2, 1}@cpu = aten::neg(%hi)\n"
      "  %cat: f32[2, 2, 3, 4]{24, 12, 4, 1}@cpu = aten::cat([%neg, %lo], -1)\n"
      "  %c: f32[2, 2, 3, 4]{24, 1, 8, 2}@cpu = aten::clone(%cat, memory_format=channels_last)\n"
      "  return (%c)\n";
  const std::string out = run_passes({rotate_half, eliminate_dead_code}, in);
  EXPECT_NE(out.find("= aten::clone(%cat_rh"), std::string::npos) << out;
  EXPECT_EQ(out.find("f32[2, 2, 3, 2, 2]{24, 1, 8"), std::string::npos) << out;  // no 5-D channels_last clone
  at::manual_seed(0);
  at::Tensor x = at::randn({2, 2, 3, 4});
  auto got = run_text(in, {x});
  at::Tensor want = at::cat({-x.slice(3, 2), x.slice(3, 0, 2)}, -1).contiguous(at::MemoryFormat::ChannelsLast);
  EXPECT_TRUE(at::allclose(got[0].toTensor(), want, 0, 0));
  EXPECT_TRUE(got[0].toTensor().is_contiguous(at::MemoryFormat::ChannelsLast));
}

}  // namespace
}  // namespace ember

// Fusion: the fuse pass as IR text in / IR text out, and fused CPU kernels against ATen on random
// inputs: odd sizes, broadcast, non-contiguous, half/bfloat16, NaN and Inf, empty tensors.
#include "ember/compiler.h"
#include "kernels/cuda/call_plan.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/program.h"
#include "passes/passes.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <set>

namespace ember {
namespace {

std::string fuse_text(const std::string& in) {
  Graph g = parse(in);
  CompileOptions options;
  PassContext ctx{options};
  fuse(g, ctx);
  return print(g);
}

TEST(FusePass, PointwiseChainBecomesOneGroup) {
  const std::string in =
      "graph(%x: f32[4, 8]{8, 1}@cpu, %w: f32[8]{1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::sin(%x)\n"
      "  %b: f32[4, 8]{8, 1}@cpu = aten::mul.Tensor(%a, %w)\n"
      "  %c: f32[4, 8]{8, 1}@cpu = aten::exp(%b)\n"
      "  return (%c)\n";
  const std::string expected =
      "graph(%x: f32[4, 8]{8, 1}@cpu, %w: f32[8]{1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::sin(%x) #0\n"
      "  %b: f32[4, 8]{8, 1}@cpu = aten::mul.Tensor(%a, %w) #0\n"
      "  %c: f32[4, 8]{8, 1}@cpu = aten::exp(%b) #0\n"
      "  return (%c)\n";
  EXPECT_EQ(fuse_text(in), expected);
}

// Symbolic strides are proven contiguous as products: dynamic=True gives [s0, s1, s2, s2] the outer
// strides "s1*s2**2" and "s2**2" (it was left unfused while only "s2*s2" matched). A stride that is
// not the product stays unproven.
TEST(FusePass, SymbolicStridesWithPowersAreContiguous) {
  const std::string t = "f32[s0, s1, s2, s2]{s1*s2**2, s2**2, s2, 1}@cpu";
  const std::string in = "graph(%x: " + t + ", %w: f32[s1, 1, 1]{1, 1, 1}@cpu, %b: f32[s2]{1}@cpu, %s0: int, %s1: int, %s2: int):\n"
                         "  %m: " + t + " = aten::mul.Tensor(%x, %w)\n"
                         "  %a: " + t + " = aten::add.Tensor(%m, %b)\n"
                         "  %e: " + t + " = aten::exp(%a)\n"
                         "  return (%e)\n";
  const std::string out = fuse_text(in);
  EXPECT_NE(out.find("aten::mul.Tensor(%x, %w) #0"), std::string::npos) << out;
  EXPECT_NE(out.find("aten::exp(%a) #0"), std::string::npos) << out;
  for (const std::string& wrong : {"s1*s2**3", "2*s1*s2**2", "s1**2*s2"}) {
    std::string bad = in;
    for (size_t p = bad.find("{s1*s2**2"); p != std::string::npos; p = bad.find("{s1*s2**2", p + 1)) bad.replace(p + 1, 8, wrong);
    EXPECT_EQ(fuse_text(bad).find("#0"), std::string::npos) << wrong;
  }
}

// channels_last under dynamic shapes: the batch alone symbolic (strides constant), or every dim symbolic
// (strides products of symbols). memory_order finds the layout either way, so CUDA pointwise groups over
// them are permuted groups as with static shapes; a stride that breaks the chain leaves them unfused.
TEST(FusePass, SymbolicChannelsLastGroupsArePermuted) {
  for (const std::string t : {std::string("f32[s0, 8, 5, 5]{200, 1, 40, 8}@cuda:0"),
                              std::string("f32[s0, s1, s2, s2]{s1*s2**2, 1, s1*s2, s1}@cuda:0"),
                              std::string("f32[s0, s1, s2, s2]{s1*s2**2, 1, s1*s2, 2*s1}@cuda:0")}) {
    const std::string in = "graph(%x: " + t + ", %s0: int, %s1: int, %s2: int):\n"
                           "  %r: " + t + " = aten::relu(%x)\n"
                           "  %m: " + t + " = aten::mul.Tensor(%r, 2.0)\n"
                           "  return (%m)\n";
    const bool dense = t.find("2*s1}") == std::string::npos;
    EXPECT_EQ(fuse_text(in).find("aten::mul.Tensor(%r, 2.0) #0") != std::string::npos, dense) << t;
  }
  TensorType cl = parse("graph(%x: f32[s0, s1, s2, s3]{s1*s2*s3, 1, s1*s3, s1}@cuda:0):\n  return (%x)\n").inputs()[0]->type.tensor;
  EXPECT_EQ(memory_order(cl), (std::vector<int>{0, 2, 3, 1}));
  TensorType rm = parse("graph(%x: f32[2, s0, 1, 3]{3*s0, 3, 7, 1}@cpu):\n  return (%x)\n").inputs()[0]->type.tensor;
  EXPECT_EQ(memory_order(rm), (std::vector<int>{0, 1, 3}));  // the size-1 dim left out, whatever its stride
}

TEST(FusePass, SiblingsReadingOneInputShareAGroup) {
  // GPT-2's gelu_new on CUDA: 0.5*x and x^3 both start from x; one group, x read once.
  const std::string in =
      "graph(%x: bf16[4, 8]{8, 1}@cuda:0):\n"
      "  %h: bf16[4, 8]{8, 1}@cuda:0 = aten::mul.Tensor(%x, 0.5)\n"
      "  %p: bf16[4, 8]{8, 1}@cuda:0 = aten::pow.Tensor_Scalar(%x, 3.0)\n"
      "  %q: bf16[4, 8]{8, 1}@cuda:0 = aten::mul.Tensor(%p, 0.044715)\n"
      "  %r: bf16[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%x, %q)\n"
      "  %t: bf16[4, 8]{8, 1}@cuda:0 = aten::tanh(%r)\n"
      "  %u: bf16[4, 8]{8, 1}@cuda:0 = aten::add.Tensor(%t, 1.0)\n"
      "  %y: bf16[4, 8]{8, 1}@cuda:0 = aten::mul.Tensor(%h, %u)\n"
      "  return (%y)\n";
  std::string out = fuse_text(in);
  for (const char* name : {"%h", "%p", "%q", "%r", "%t", "%u", "%y"})
    EXPECT_NE(out.find(std::string("  ") + name + ":"), std::string::npos);
  size_t members = 0;
  for (size_t at = out.find(" #0\n"); at != std::string::npos; at = out.find(" #0\n", at + 1)) ++members;
  EXPECT_EQ(members, 7u) << out;
  // A sibling of another shape, or a reduction, stays out of it.
  const std::string other =
      "graph(%x: f32[4, 8]{8, 1}@cuda:0, %w: f32[8]{1}@cuda:0):\n"
      "  %a: f32[4, 8]{8, 1}@cuda:0 = aten::mul.Tensor(%x, 2)\n"
      "  %b: f32[4, 8]{8, 1}@cuda:0 = aten::exp(%a)\n"
      "  %s: f32[4]{1}@cuda:0 = aten::sum.dim_IntList(%x, [-1])\n"
      "  %c: f32[8]{1}@cuda:0 = aten::neg(%w)\n"
      "  %d: f32[8]{1}@cuda:0 = aten::exp(%w)\n"
      "  return (%b, %s, %c, %d)\n";
  std::string o = fuse_text(other);
  EXPECT_NE(o.find("aten::exp(%a) #0"), std::string::npos) << o;
  EXPECT_EQ(o.find("aten::sum.dim_IntList(%x, [-1]) #0"), std::string::npos) << o;
  EXPECT_NE(o.find("aten::neg(%w) #1"), std::string::npos) << o;
  EXPECT_NE(o.find("aten::exp(%w) #1"), std::string::npos) << o;
  // Nothing joins a group across an in-place write: b would read x before the copy_.
  const std::string written =
      "graph(%x: f32[4]{1}@cpu, %y: f32[4]{1}@cpu):\n"
      "  %a: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  %w: f32[4]{1}@cpu = aten::copy_(%x, %y)\n"
      "  %b: f32[4]{1}@cpu = aten::add.Tensor(%a, %x)\n"
      "  %c: f32[4]{1}@cpu = aten::cos(%x)\n"
      "  return (%b, %c)\n";
  std::string wo = fuse_text(written);
  EXPECT_NE(wo.find("aten::sin(%x)\n"), std::string::npos) << wo;  // alone: b and c group after the write
  EXPECT_NE(wo.find("aten::add.Tensor(%a, %x) #0\n"), std::string::npos) << wo;
}

TEST(FusePass, ReductionJoinsItsPrologueAndEpilogue) {
  // The entropy scorer: softmax, log, multiply, row sum, negate: one group.
  const std::string in =
      "graph(%f: f32[6, 10]{10, 1}@cpu):\n"
      "  %p: f32[6, 10]{10, 1}@cpu = aten::_softmax(%f, -1, false)\n"
      "  %q: f32[6, 10]{10, 1}@cpu = aten::add.Tensor(%p, 1e-08)\n"
      "  %l: f32[6, 10]{10, 1}@cpu = aten::log(%q)\n"
      "  %m: f32[6, 10]{10, 1}@cpu = aten::mul.Tensor(%p, %l)\n"
      "  %s: f32[6]{1}@cpu = aten::sum.dim_IntList(%m, [-1])\n"
      "  %n: f32[6]{1}@cpu = aten::neg(%s)\n"
      "  return (%n)\n";
  std::string out = fuse_text(in);
  EXPECT_NE(out.find("aten::_softmax(%f, -1, false) #0"), std::string::npos) << out;
  EXPECT_NE(out.find("aten::neg(%s) #0"), std::string::npos) << out;
}

TEST(FusePass, BoundariesAtViewsExternOpsAndLateInputs) {
  const std::string in =
      "graph(%x: f32[4, 8]{8, 1}@cpu, %w: f32[8, 8]{8, 1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::sin(%x)\n"
      "  %m: f32[4, 8]{8, 1}@cpu = aten::mm(%a, %w)\n"
      "  %b: f32[4, 8]{8, 1}@cpu = aten::add.Tensor(%a, %m)\n"
      "  %c: f32[4, 8]{8, 1}@cpu = aten::relu(%b)\n"
      "  %s: f32[8]{1}@cpu = aten::sum.dim_IntList(%c, [0])\n"
      "  %t: f32[8, 4]{1, 8}@cpu = aten::t(%c)\n"
      "  %e: f32[8, 4]{1, 8}@cpu = aten::exp(%t)\n"
      "  return (%s, %e)\n";
  // %b reads %m, made after group 0 (%a) starts: %b starts group 1 with %c. The sum over dim 0 joins
  // it as a column reduction (on the CPU); the view moves up to what it reads (rule 7) and stays out, and %e
  // alone is no group.
  const std::string expected =
      "graph(%x: f32[4, 8]{8, 1}@cpu, %w: f32[8, 8]{8, 1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::sin(%x)\n"
      "  %m: f32[4, 8]{8, 1}@cpu = aten::mm(%a, %w)\n"
      "  %b: f32[4, 8]{8, 1}@cpu = aten::add.Tensor(%a, %m) #0\n"
      "  %c: f32[4, 8]{8, 1}@cpu = aten::relu(%b) #0\n"
      "  %t: f32[8, 4]{1, 8}@cpu = aten::t(%c)\n"
      "  %s: f32[8]{1}@cpu = aten::sum.dim_IntList(%c, [0]) #0\n"
      "  %e: f32[8, 4]{1, 8}@cpu = aten::exp(%t)\n"
      "  return (%s, %e)\n";
  EXPECT_EQ(fuse_text(in), expected);
  EXPECT_EQ(print(parse(expected)), expected);  // group marks round-trip
}

TEST(FusePass, NodesReadingNoInputMoveUpSoTheirReadersJoinGroups) {
  // flex_attention's dense form: the mask compared from aranges and the scalar_tensor of the row zeroing come
  // after the scores' first pointwise op. Moved to the top, the wheres join the softmax's group. The random
  // draw reads no input either but stays where it is (its place among draws is the RNG's); the exp sinks below
  // it to its consumer (rule 8), and the add, which reads the draw, stays out of group 0 and alone is no group.
  const std::string in =
      "graph(%s: f32[2, 4, 4]{16, 4, 1}@cpu):\n"
      "  %m: f32[2, 4, 4]{16, 4, 1}@cpu = aten::mul.Tensor(%s, 0.5)\n"
      "  %r: i64[4]{1}@cpu = aten::arange.start_step(0, 4, layout=strided, device=cpu, pin_memory=false)\n"
      "  %c: i64[4, 1]{1, 1}@cpu = aten::view(%r, [4, 1])\n"
      "  %k: b8[4, 4]{4, 1}@cpu = aten::ge.Tensor(%c, %r)\n"
      "  %w: f32[2, 4, 4]{16, 4, 1}@cpu = aten::where.self(%k, %m, -inf)\n"
      "  %x: f32[2, 4, 1]{4, 1, 1}@cpu = aten::amax(%w, [-1], true)\n"
      "  %p: f32[2, 4, 4]{16, 4, 1}@cpu = aten::_softmax(%w, -1, false)\n"
      "  %z: f32[]{}@cpu = aten::scalar_tensor(0.0, dtype=f32, layout=strided, device=cpu)\n"
      "  %n: b8[2, 4, 1]{4, 1, 1}@cpu = aten::ne.Scalar(%x, -inf)\n"
      "  %o: f32[2, 4, 4]{16, 4, 1}@cpu = aten::where.self(%n, %p, %z)\n"
      "  %e: f32[2, 4, 4]{16, 4, 1}@cpu = aten::exp(%o)\n"
      "  %t: f32[2, 4, 4]{16, 4, 1}@cpu = aten::rand([2, 4, 4], dtype=f32, layout=strided, device=cpu, pin_memory=false)\n"
      "  %u: f32[2, 4, 4]{16, 4, 1}@cpu = aten::add.Tensor(%e, %t)\n"
      "  return (%u)\n";
  const std::string expected =
      "graph(%s: f32[2, 4, 4]{16, 4, 1}@cpu):\n"
      "  %r: i64[4]{1}@cpu = aten::arange.start_step(0, 4, layout=strided, device=cpu, pin_memory=false)\n"
      "  %c: i64[4, 1]{1, 1}@cpu = aten::view(%r, [4, 1])\n"
      "  %k: b8[4, 4]{4, 1}@cpu = aten::ge.Tensor(%c, %r)\n"
      "  %z: f32[]{}@cpu = aten::scalar_tensor(0.0, dtype=f32, layout=strided, device=cpu)\n"
      "  %m: f32[2, 4, 4]{16, 4, 1}@cpu = aten::mul.Tensor(%s, 0.5) #0\n"
      "  %w: f32[2, 4, 4]{16, 4, 1}@cpu = aten::where.self(%k, %m, -inf) #0\n"
      "  %x: f32[2, 4, 1]{4, 1, 1}@cpu = aten::amax(%w, [-1], true) #0\n"
      "  %p: f32[2, 4, 4]{16, 4, 1}@cpu = aten::_softmax(%w, -1, false) #0\n"
      "  %n: b8[2, 4, 1]{4, 1, 1}@cpu = aten::ne.Scalar(%x, -inf) #0\n"
      "  %o: f32[2, 4, 4]{16, 4, 1}@cpu = aten::where.self(%n, %p, %z) #0\n"
      "  %t: f32[2, 4, 4]{16, 4, 1}@cpu = aten::rand([2, 4, 4], dtype=f32, layout=strided, device=cpu, pin_memory=false)\n"
      "  %e: f32[2, 4, 4]{16, 4, 1}@cpu = aten::exp(%o) #0\n"
      "  %u: f32[2, 4, 4]{16, 4, 1}@cpu = aten::add.Tensor(%e, %t)\n"
      "  return (%u)\n";
  EXPECT_EQ(fuse_text(in), expected);
}

TEST(FusePass, ReductionsOverLeadingDimsMakeColumnGroups) {
  // A bias gradient: relu's backward, its sum over the batch (keepdim) scaled; beside it a sum over
  // [0, 1] that must not join (other dims), and a full node reading the column sum (it would broadcast
  // back) stays out.
  auto graph_on = [](const std::string& dev) {
    return "graph(%g: f32[6, 4, 8]{32, 8, 1}@" + dev + ", %y: f32[6, 4, 8]{32, 8, 1}@" + dev + "):\n"
           "  %m: b8[6, 4, 8]{32, 8, 1}@" + dev + " = aten::le.Scalar(%y, 0)\n"
           "  %d: f32[6, 4, 8]{32, 8, 1}@" + dev + " = aten::where.self(%m, 0.0, %g)\n"
           "  %s: f32[1, 4, 8]{32, 8, 1}@" + dev + " = aten::sum.dim_IntList(%d, [0], true)\n"
           "  %h: f32[1, 4, 8]{32, 8, 1}@" + dev + " = aten::mul.Tensor(%s, 0.5)\n"
           "  %u: f32[8]{1}@" + dev + " = aten::sum.dim_IntList(%d, [0, 1])\n"
           "  %b: f32[6, 4, 8]{32, 8, 1}@" + dev + " = aten::sub.Tensor(%d, %s)\n"
           "  return (%d, %h, %u, %b)\n";
  };
  // Both kernel generators run column groups.
  for (const std::string dev : {"cpu", "cuda:0"}) {
    const std::string out = fuse_text(graph_on(dev));
    EXPECT_NE(out.find("aten::where.self(%m, 0.0, %g) #0"), std::string::npos) << out;
    EXPECT_NE(out.find("aten::sum.dim_IntList(%d, [0], true) #0"), std::string::npos) << out;
    EXPECT_NE(out.find("aten::mul.Tensor(%s, 0.5) #0"), std::string::npos) << out;
    EXPECT_EQ(out.find("aten::sum.dim_IntList(%d, [0, 1]) #0"), std::string::npos) << out;
    EXPECT_EQ(out.find("aten::sub.Tensor(%d, %s) #0"), std::string::npos) << out;
    Graph g = parse(out);
    std::string why;
    std::optional<Program> p = lower_group(g, 0, &why);
    ASSERT_TRUE(p) << dev << ": " << why;
    EXPECT_EQ(p->outer, 1u) << dev;
    EXPECT_NE(p->text().find("(columns: reduces the first 1 dims)"), std::string::npos) << p->text();
  }
}

TEST(FusePass, ChannelsLastBatchNormBackwardIsOneColumnGroupOnCpu) {
  // decompositions.py's eval batch norm backward after a ReLU backward, over [N * H * W, C] rows, in the trace's
  // order: the per-channel scale (%a, %i, %sc) and the input's rows (%xp, %xr) come after the ReLU backward
  // began a group. They move up (rule 7); input - mean joins where it meets the gradient (rule 6), the gradient's
  // sum joins the group reading the gradient (rule 5): every [16, 8] node and both sums in one column group.
  auto graph = [](const std::string& grad) {
    const std::string f = "f32[16, 8]{8, 1}@cpu", c = "f32[8]{1}@cpu";
    return "graph(%gy: " + f + ", %y: " + f + ", %x4: f32[1, 8, 4, 4]{128, 1, 32, 8}@cpu, %var: " + c + ", %w: " + c +
           ", %mean: " + c + "):\n" + grad +
           "  %a: " + c + " = aten::add.Tensor(%var, 1e-05)\n"
           "  %i: " + c + " = aten::rsqrt(%a)\n"
           "  %sc: " + c + " = aten::mul.Tensor(%i, %w)\n"
           "  %gi: " + f + " = aten::mul.Tensor(%t, %sc)\n"
           "  %xp: f32[1, 4, 4, 8]{128, 32, 8, 1}@cpu = aten::permute(%x4, [0, 2, 3, 1])\n"
           "  %xr: " + f + " = aten::view(%xp, [16, 8])\n"
           "  %cx: " + f + " = aten::sub.Tensor(%xr, %mean)\n"
           "  %d: " + f + " = aten::mul.Tensor(%t, %cx)\n"
           "  %s1: " + c + " = aten::sum.dim_IntList(%d, [0])\n"
           "  %gw: " + c + " = aten::mul.Tensor(%s1, %i)\n"
           "  %gb: " + c + " = aten::sum.dim_IntList(%t, [0])\n"
           "  return (%gi, %gw, %gb)\n";
  };
  // With the ReLU backward, and with the gradient as an input (the first batch norm of a backward).
  for (const std::string grad : {"  %t: f32[16, 8]{8, 1}@cpu = aten::threshold_backward(%gy, %y, 0)\n",
                                 "  %t: f32[16, 8]{8, 1}@cpu = aten::view(%gy, [16, 8])\n"}) {
    Graph g = parse(fuse_text(graph(grad)));
    g.verify();
    std::set<int> groups;
    size_t in_group = 0;
    for (const auto& n : g.nodes()) {
      const std::string& name = n->outputs[0]->name;
      if (name == "gi" || name == "cx" || name == "d" || name == "s1" || name == "gw" || name == "gb" ||
          (name == "t" && n->op != "aten::view")) {
        groups.insert(n->group);
        ++in_group;
      }
    }
    EXPECT_EQ(groups.size(), 1u) << print(g);
    EXPECT_EQ(groups.count(-1), 0u) << print(g);
    std::string why;
    std::optional<Program> p = lower_group(g, *groups.begin(), &why);
    ASSERT_TRUE(p) << why;
    EXPECT_EQ(p->outer, 1u);
    EXPECT_GE(in_group, 6u);
  }
  // On CUDA nothing moves (rule 7 is the CPU's).
  std::string cuda = graph("  %t: f32[16, 8]{8, 1}@cpu = aten::threshold_backward(%gy, %y, 0)\n");
  for (size_t at; (at = cuda.find("@cpu")) != std::string::npos;) cuda.replace(at, 4, "@cuda:0");
  const std::string out = fuse_text(cuda);
  EXPECT_LT(out.find("%t: "), out.find("%a: ")) << out;
  EXPECT_LT(out.find("%t: "), out.find("%xr: ")) << out;
}

TEST(FusePass, ColumnGroupsAtAnySizeAndLoneOnesOnCuda) {
  // The CUDA column kernel splits the rows over blocks where the columns are few: any shape fuses. A
  // column sum alone stays a group on CUDA (the kernel beats ATen's reduction), not on the CPU.
  auto graph_of = [](int64_t rows, int64_t cols, const std::string& dev, bool lone) {
    const std::string f = "f32[" + std::to_string(rows) + ", " + std::to_string(cols) + "]{" + std::to_string(cols) + ", 1}@" + dev;
    const std::string k = "f32[" + std::to_string(cols) + "]{1}@" + dev;
    if (lone) return "graph(%a: " + f + "):\n  %s: " + k + " = aten::sum.dim_IntList(%a, [0])\n  return (%s)\n";
    return "graph(%x: " + f + "):\n  %a: " + f + " = aten::mul.Tensor(%x, 2.0)\n  %s: " + k +
           " = aten::sum.dim_IntList(%a, [0])\n  return (%s)\n";
  };
  auto fused = [&](int64_t rows, int64_t cols, const std::string& dev, bool lone = false) {
    return fuse_text(graph_of(rows, cols, dev, lone)).find("aten::sum.dim_IntList(%a, [0]) #0") != std::string::npos;
  };
  EXPECT_TRUE(fused(20000, 12, "cuda:0"));
  EXPECT_TRUE(fused(1000, 12, "cuda:0"));
  EXPECT_TRUE(fused(8193, 4096, "cuda:0"));
  EXPECT_TRUE(fused(20000, 12, "cpu"));
  EXPECT_TRUE(fused(1024, 768, "cuda:0", true));
  EXPECT_FALSE(fused(1024, 768, "cpu", true));
}

TEST(FusePass, ColumnReductionsOfAReshapeReadItsInput) {
  // A bias gradient: gelu's backward over [B, S, H], viewed as [B*S, H] for the weight gradient's
  // matmul and the bias gradient's sum over dim 0. The sum reads gelu's backward over [0, 1] instead and
  // joins its group; a view gives back the [1, H] keepdim shape. A reshape that changes the kept dims
  // ([B, S*H]) stays as it is.
  const std::string in =
      "graph(%g: f32[2, 3, 8]{24, 8, 1}@cuda:0, %x: f32[2, 3, 8]{24, 8, 1}@cuda:0, %w: f32[8, 4]{4, 1}@cuda:0):\n"
      "  %d: f32[2, 3, 8]{24, 8, 1}@cuda:0 = aten::gelu_backward(%g, %x)\n"
      "  %v: f32[6, 8]{8, 1}@cuda:0 = aten::view(%d, [6, 8])\n"
      "  %m: f32[6, 4]{4, 1}@cuda:0 = aten::mm(%v, %w)\n"
      "  %s: f32[1, 8]{8, 1}@cuda:0 = aten::sum.dim_IntList(%v, [0], true)\n"
      "  %f: f32[2, 24]{24, 1}@cuda:0 = aten::view(%d, [2, 24])\n"
      "  %t: f32[24]{1}@cuda:0 = aten::sum.dim_IntList(%f, [0])\n"
      "  return (%m, %s, %t)\n";
  const std::string out = fuse_text(in);
  EXPECT_NE(out.find("aten::gelu_backward(%g, %x) #0"), std::string::npos) << out;
  EXPECT_NE(out.find("%s_lead: f32[1, 1, 8]{8, 8, 1}@cuda:0 = aten::sum.dim_IntList(%d, [0, 1], true) #0"), std::string::npos) << out;
  EXPECT_NE(out.find("%s_lead_view: f32[1, 8]{8, 1}@cuda:0 = aten::view(%s_lead, [1, 8])"), std::string::npos) << out;
  EXPECT_NE(out.find("return (%m, %s_lead_view, %t)"), std::string::npos) << out;
  EXPECT_NE(out.find("aten::sum.dim_IntList(%f, [0]) #1"), std::string::npos) << out;  // alone, on CUDA
  Graph g = parse(out);
  g.verify();
  std::string why;
  std::optional<Program> p = lower_group(g, 0, &why);
  ASSERT_TRUE(p) << why;
  EXPECT_EQ(p->outer, 2u);
}

TEST(FusePass, ResidualGradientAddsMoveToOneKernel) {
  // A residual's gradient summed as each matmul makes a term: the adds sit between the matmuls, each
  // reading a value made after the previous add. They move down to their consumers and fuse as one
  // group; an add across an in-place write stays.
  auto graph_with = [](const std::string& between) {
    const std::string t = "f32[4, 8]{8, 1}@cuda:0";
    return "graph(%g: " + t + ", %a: " + t + ", %w: f32[8, 8]{8, 1}@cuda:0, %buf: " + t + "):\n"
           "  %m1: " + t + " = aten::mm(%a, %w)\n"
           "  %s1: " + t + " = aten::add.Tensor(%g, %m1)\n" + between +
           "  %m2: " + t + " = aten::mm(%m1, %w)\n"
           "  %s2: " + t + " = aten::add.Tensor(%s1, %m2)\n"
           "  %m3: " + t + " = aten::mm(%m2, %w)\n"
           "  %s3: " + t + " = aten::add.Tensor(%s2, %m3)\n"
           "  return (%s3)\n";
  };
  const std::string out = fuse_text(graph_with(""));
  for (const char* add : {"aten::add.Tensor(%g, %m1) #0", "aten::add.Tensor(%s1, %m2) #0", "aten::add.Tensor(%s2, %m3) #0"})
    EXPECT_NE(out.find(add), std::string::npos) << out;
  EXPECT_LT(out.find("%m3:"), out.find("%s1:")) << out;
  parse(out).verify();
  const std::string written = fuse_text(graph_with("  %c: f32[4, 8]{8, 1}@cuda:0 = aten::copy_(%buf, %a)\n"));
  EXPECT_LT(written.find("%s1:"), written.find("%m2:")) << written;
}

TEST(FusePass, TensorsFromAnotherDeviceKeepNodesOut) {
  const std::string in =
      "graph(%x: f32[5]{1}@cuda:0, %c: f32[]{}@cpu):\n"
      "  %a: f32[5]{1}@cuda:0 = aten::mul.Tensor(%x, %c)\n"
      "  %b: f32[5]{1}@cuda:0 = aten::exp(%a)\n"
      "  %d: f32[5]{1}@cuda:0 = aten::sin(%b)\n"
      "  return (%d)\n";
  // %a reads a CPU tensor: it stays with ATen; %b and %d fuse.
  const std::string expected =
      "graph(%x: f32[5]{1}@cuda:0, %c: f32[]{}@cpu):\n"
      "  %a: f32[5]{1}@cuda:0 = aten::mul.Tensor(%x, %c)\n"
      "  %b: f32[5]{1}@cuda:0 = aten::exp(%a) #0\n"
      "  %d: f32[5]{1}@cuda:0 = aten::sin(%b) #0\n"
      "  return (%d)\n";
  EXPECT_EQ(fuse_text(in), expected);
}

TEST(FusePass, IntegerAndDoubleOutputsAreNotFused) {
  const std::string in =
      "graph(%x: i64[5]{1}@cpu, %y: f64[5]{1}@cpu):\n"
      "  %a: i64[5]{1}@cpu = aten::add.Tensor(%x, 1)\n"
      "  %b: i64[5]{1}@cpu = aten::mul.Tensor(%a, 3)\n"
      "  %c: f64[5]{1}@cpu = aten::exp(%y)\n"
      "  %d: f64[5]{1}@cpu = aten::sin(%c)\n"
      "  return (%b, %d)\n";
  EXPECT_EQ(fuse_text(in), in);
}

// Runs `text` with and without fusion on the same inputs and expects matching outputs.
void expect_fused_matches(const std::string& text, std::vector<c10::IValue> inputs, double tol = 1e-5,
                          bool expect_kernel = true) {
  CompileOptions off;
  off.disabled_passes = {"fuse"};
  auto plain = compile(parse(text), {}, off);
  auto fused = compile(parse(text), {}, CompileOptions{});
  if (expect_kernel) {
    bool has_kernel = false;
    for (const Step& s : fused->plan().steps) has_kernel = has_kernel || s.kernel != nullptr;
    EXPECT_TRUE(has_kernel) << fused->describe();
  }
  std::vector<c10::IValue> a = inputs, b = inputs;
  auto want = plain->run(a);
  auto got = fused->run(b);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    at::Tensor w = want[i].toTensor(), g = got[i].toTensor();
    ASSERT_EQ(w.sizes(), g.sizes()) << "output " << i;
    ASSERT_EQ(w.scalar_type(), g.scalar_type()) << "output " << i;
    EXPECT_TRUE(at::allclose(g.to(at::kFloat), w.to(at::kFloat), tol, tol, /*equal_nan=*/true))
        << "output " << i << " max diff " << (g.to(at::kFloat) - w.to(at::kFloat)).abs().nan_to_num(0).max().item<float>()
        << "\n" << fused->describe();
  }
}

TEST(FusePass, GeluAndTanhStayWithAtenOnCpu) {
  const std::string in =
      "graph(%x: f32[4, 8]{8, 1}@cpu):\n"
      "  %a: f32[4, 8]{8, 1}@cpu = aten::mul.Tensor(%x, 2)\n"
      "  %g: f32[4, 8]{8, 1}@cpu = aten::gelu(%a)\n"
      "  %t: f32[4, 8]{8, 1}@cpu = aten::tanh(%g)\n"
      "  %b: f32[4, 8]{8, 1}@cpu = aten::add.Tensor(%t, 1)\n"
      "  return (%b)\n";
  EXPECT_EQ(fuse_text(in), in);
}

TEST(FusedCpuKernel, PointwiseBroadcastOddSizesNonContiguous) {
  const std::string text =
      "graph(%x: f32[37, 129]{1, 37}@cpu, %w: f32[129]{1}@cpu, %c: f32[37, 1]{1, 1}@cpu):\n"
      "  %a: f32[37, 129]{129, 1}@cpu = aten::mul.Tensor(%x, %w)\n"
      "  %b: f32[37, 129]{129, 1}@cpu = aten::sub.Tensor(%a, %c, alpha=0.5)\n"
      "  %g: f32[37, 129]{129, 1}@cpu = aten::gelu(%b)\n"
      "  %t: f32[37, 129]{129, 1}@cpu = aten::gelu(%g, approximate=\"tanh\")\n"
      "  %s: f32[37, 129]{129, 1}@cpu = aten::sigmoid(%t)\n"
      "  %r: f32[37, 129]{129, 1}@cpu = aten::rsub.Scalar(%s, 2.0)\n"
      "  %p: f32[37, 129]{129, 1}@cpu = aten::pow.Tensor_Scalar(%r, 3)\n"
      "  %q: f32[37, 129]{129, 1}@cpu = aten::clamp(%p, -0.5, 4.0)\n"
      "  return (%q, %a)\n";
  at::Tensor x = at::randn({129, 37}).t();  // non-contiguous
  expect_fused_matches(text, {x, at::randn({129}), at::randn({37, 1})});
}

TEST(FusedCpuKernel, ComparisonsWhereMasksAndBackwardOps) {
  const std::string text =
      "graph(%x: f32[3, 5, 70]{350, 70, 1}@cpu, %g: f32[3, 5, 70]{350, 70, 1}@cpu, %m: b8[5, 1]{1, 1}@cpu):\n"
      "  %gt: b8[3, 5, 70]{350, 70, 1}@cpu = aten::gt.Scalar(%x, 0.25)\n"
      "  %w: f32[3, 5, 70]{350, 70, 1}@cpu = aten::where.self(%m, %x, %g)\n"
      "  %tb: f32[3, 5, 70]{350, 70, 1}@cpu = aten::threshold_backward(%g, %w, 0)\n"
      "  %sb: f32[3, 5, 70]{350, 70, 1}@cpu = aten::sigmoid_backward(%tb, %x)\n"
      "  %gb: f32[3, 5, 70]{350, 70, 1}@cpu = aten::gelu_backward(%sb, %x)\n"
      "  %sl: f32[3, 5, 70]{350, 70, 1}@cpu = aten::silu_backward(%gb, %g)\n"
      "  %lr: f32[3, 5, 70]{350, 70, 1}@cpu = aten::leaky_relu(%sl, 0.2)\n"
      "  %mx: f32[3, 5, 70]{350, 70, 1}@cpu = aten::maximum(%lr, %g)\n"
      "  return (%gt, %mx)\n";
  expect_fused_matches(text, {at::randn({3, 5, 70}), at::randn({3, 5, 70}), at::rand({5, 1}) > 0.5});
}

TEST(FusedCpuKernel, HalfAndBFloat16InOut) {
  const std::string text =
      "graph(%x: f16[33, 65]{65, 1}@cpu, %y: bf16[65]{1}@cpu):\n"
      "  %a: f32[33, 65]{65, 1}@cpu = aten::_to_copy(%x, dtype=f32)\n"
      "  %b: f32[33, 65]{65, 1}@cpu = aten::add.Tensor(%a, %y)\n"
      "  %c: f32[33, 65]{65, 1}@cpu = aten::tanh(%b)\n"
      "  %d: bf16[33, 65]{65, 1}@cpu = aten::_to_copy(%c, dtype=bf16)\n"
      "  %e: bf16[33, 65]{65, 1}@cpu = aten::mul.Tensor(%d, 3)\n"
      "  return (%e)\n";
  expect_fused_matches(text, {at::randn({33, 65}).to(at::kHalf), at::randn({65}).to(at::kBFloat16)}, 2e-2);
}

TEST(FusedCpuKernel, RowReductionsSoftmaxLayerNorm) {
  const std::string text =
      "graph(%x: f32[7, 3, 301]{903, 301, 1}@cpu, %w: f32[301]{1}@cpu, %b: f32[301]{1}@cpu):\n"
      "  %e: f32[7, 3, 301]{903, 301, 1}@cpu = aten::exp(%x)\n"
      "  %s: f32[7, 3]{3, 1}@cpu = aten::sum.dim_IntList(%e, [-1])\n"
      "  %mx: f32[7, 3, 1]{3, 1, 1}@cpu = aten::amax(%x, [2], true)\n"
      "  %mn: f32[7, 3]{3, 1}@cpu = aten::amin(%x, [-1])\n"
      "  %me: f32[7, 3, 1]{3, 1, 1}@cpu = aten::mean.dim(%x, [-1], true)\n"
      "  %d: f32[7, 3, 301]{903, 301, 1}@cpu = aten::sub.Tensor(%x, %mx)\n"
      "  %sm: f32[7, 3, 301]{903, 301, 1}@cpu = aten::_softmax(%d, -1, false)\n"
      "  %ls: f32[7, 3, 301]{903, 301, 1}@cpu = aten::_log_softmax(%x, 2, false)\n"
      "  %y: f32[7, 3, 301]{903, 301, 1}@cpu, %mu: f32[7, 3, 1]{3, 1, 1}@cpu, %rs: f32[7, 3, 1]{3, 1, 1}@cpu = "
      "aten::native_layer_norm(%x, [301], %w, %b, 1e-05)\n"
      "  %ns: f32[7, 3]{3, 1}@cpu = aten::neg(%s)\n"
      "  %sc: f32[7, 3, 1]{3, 1, 1}@cpu = aten::mul.Tensor(%me, 2)\n"
      "  return (%ns, %mn, %sm, %ls, %y, %mu, %rs, %sc)\n";
  expect_fused_matches(text, {at::randn({7, 3, 301}), at::randn({301}), at::randn({301})}, 1e-4);
}

TEST(FusedCpuKernel, MaskedSoftmaxOverBroadcastInputsOfOtherDtypes) {
  // flex_attention's dense form: scaled scores, a per-head bias, a mask broadcast over batch and heads, and
  // fully masked rows zeroed, in one group. The row maximum is asked twice (amax, and softmax's own) and
  // computed once. The bf16 bias, the bool mask and the strided f16 offsets are read through broadcasts and
  // strides, and converted a run at a time.
  const std::string t = "f32[2, 4, 33, 150]{19800, 4950, 150, 1}@cpu";
  const std::string text =
      "graph(%x: " + t + ", %bias: bf16[4, 1, 1]{1, 1, 1}@cpu, %m: b8[33, 150]{150, 1}@cpu, %off: f16[150]{2}@cpu, "
      "%ninf: f32[]{}@cpu, %zero: f32[]{}@cpu):\n"
      "  %s: " + t + " = aten::mul.Tensor(%x, 0.125)\n"
      "  %b: " + t + " = aten::add.Tensor(%s, %bias)\n"
      "  %p: " + t + " = aten::add.Tensor(%b, %off)\n"
      "  %w: " + t + " = aten::where.self(%m, %p, %ninf)\n"
      "  %mx: f32[2, 4, 33, 1]{132, 33, 1, 1}@cpu = aten::amax(%w, [-1], true)\n"
      "  %sm: " + t + " = aten::_softmax(%w, -1, false)\n"
      "  %ne: b8[2, 4, 33, 1]{132, 33, 1, 1}@cpu = aten::ne.Scalar(%mx, -inf)\n"
      "  %o: " + t + " = aten::where.self(%ne, %sm, %zero)\n"
      "  return (%o)\n";
  const std::string fused = fuse_text(text);
  EXPECT_EQ(fused.find(" #1"), std::string::npos) << fused;
  Graph g = parse(fused);
  std::string why;
  std::optional<Program> p = lower_group(g, 0, &why);
  ASSERT_TRUE(p) << why;
  const std::string listing = p->text();
  const size_t first = listing.find("row_max");
  ASSERT_NE(first, std::string::npos) << listing;
  EXPECT_EQ(listing.find("row_max", first + 1), std::string::npos) << listing;
  at::Tensor mask = at::rand({33, 150}) > 0.5;
  mask[5].fill_(false);  // a fully masked row
  at::Tensor off = at::randn({300}).to(at::kHalf).slice(0, 0, 300, 2);
  expect_fused_matches(text, {at::randn({2, 4, 33, 150}), at::randn({4, 1, 1}).to(at::kBFloat16), mask, off,
                              at::scalar_tensor(-INFINITY), at::scalar_tensor(0.0)}, 1e-5);
}

TEST(FusedCpuKernel, NanInfPropagateAndEmptyTensors) {
  const std::string text =
      "graph(%x: f32[4, 40]{40, 1}@cpu):\n"
      "  %a: f32[4, 40]{40, 1}@cpu = aten::relu(%x)\n"
      "  %b: f32[4, 40]{40, 1}@cpu = aten::mul.Tensor(%a, 2)\n"
      "  %m: f32[4]{1}@cpu = aten::amax(%b, [-1])\n"
      "  %s: f32[4]{1}@cpu = aten::sum.dim_IntList(%b, [-1])\n"
      "  return (%b, %m, %s)\n";
  at::Tensor x = at::randn({4, 40});
  x[1][3] = NAN;
  x[2][7] = INFINITY;
  x[3][0] = -INFINITY;
  expect_fused_matches(text, {x});
  const std::string empty =
      "graph(%x: f32[0, 9]{9, 1}@cpu):\n"
      "  %a: f32[0, 9]{9, 1}@cpu = aten::sin(%x)\n"
      "  %b: f32[0, 9]{9, 1}@cpu = aten::mul.Tensor(%a, 2)\n"
      "  return (%b)\n";
  expect_fused_matches(empty, {at::randn({0, 9})});
}

// relu and the clamps keep -0.0 as ATen's clamp kernels do (the bound is max's / min's first operand), and
// NaN: atan2(y, relu(x)) tells -0.0 from +0.0 (the fuzzer's repro mismatch_31041).
TEST(FusedCpuKernel, ReluAndClampsKeepNegativeZeroAndNan) {
  const std::string t = "f32[3, 37]{37, 1}@cpu";
  const std::string text =
      "graph(%x: " + t + "):\n"
      "  %m: " + t + " = aten::mul.Tensor(%x, 1.0)\n"
      "  %r: " + t + " = aten::relu(%m)\n"
      "  %a: " + t + " = aten::clamp_min(%m, 0.0)\n"
      "  %b: " + t + " = aten::clamp_max(%m, 0.0)\n"
      "  %c: " + t + " = aten::clamp(%m, 0.0, 0.5)\n"
      "  %h: " + t + " = aten::hardtanh(%m, 0.0, 0.0)\n"
      "  return (%r, %a, %b, %c, %h)\n";
  CompileOptions off;
  off.disabled_passes = {"fuse"};
  auto plain = compile(parse(text), {}, off);
  auto fused = compile(parse(text), {}, CompileOptions{});
  at::Tensor x = at::randn({3, 37});
  x.index_put_({at::indexing::Slice(), at::indexing::Slice(0, 37, 3)}, -0.0);
  x[1][4] = NAN;
  x[2][5] = 0.0;
  auto want = plain->run({x});
  auto got = fused->run({x});
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    at::Tensor w = want[i].toTensor(), g = got[i].toTensor();
    at::Tensor number = ~at::isnan(w);  // (a NaN's sign says nothing)
    EXPECT_TRUE(at::equal(at::signbit(g).masked_select(number), at::signbit(w).masked_select(number)))
        << "output " << i << "\n" << fused->describe();
    EXPECT_TRUE(at::allclose(g, w, 0, 0, /*equal_nan=*/true)) << "output " << i;
  }
}

// A row over no column: a sum is 0 and a mean NaN, whatever the (NaN) value the row's register holds: the
// normalized values of an empty layer_norm or softmax row are 0 / 0.
TEST(FusedCpuKernel, ReductionsOverEmptyRowsGiveTheirIdentity) {
  const std::string norm =
      "graph(%x: f32[0]{1}@cpu, %w: f32[0]{1}@cpu, %b: f32[0]{1}@cpu):\n"
      "  %y: f32[0]{1}@cpu, %mu: f32[1]{1}@cpu, %rs: f32[1]{1}@cpu = aten::native_layer_norm(%x, [0], %w, %b, 1e-05)\n"
      "  %s: f32[1]{1}@cpu = aten::sum.dim_IntList(%y, [0], true)\n"
      "  return (%s)\n";
  expect_fused_matches(norm, {at::randn({0}), at::randn({0}), at::randn({0})});
  const std::string rows =
      "graph(%x: f32[0]{1}@cpu):\n"
      "  %y: f32[0]{1}@cpu, %mu: f32[1]{1}@cpu, %rs: f32[1]{1}@cpu = aten::native_layer_norm(%x, [0], None, None, 1e-05)\n"
      "  %s: f32[]{}@cpu = aten::sum.dim_IntList(%y, [-1])\n"
      "  %m: f32[1]{1}@cpu = aten::mean.dim(%y, [-1], true)\n"
      "  %sm: f32[0]{1}@cpu = aten::_softmax(%x, -1, false)\n"
      "  %t: f32[1]{1}@cpu = aten::sum.dim_IntList(%sm, [0], true)\n"
      "  return (%s, %m, %t)\n";
  expect_fused_matches(rows, {at::randn({0})});
}

// add(x, 3, alpha=2): alpha * 3 reads no register. In a group that reduces over leading dims (columns) it
// must be computed with the full values that read it, not after the reduction (where row values are).
TEST(FusedCpuKernel, ConstantOperandsScaledByAlphaInColumnAndRowGroups) {
  const std::string columns =
      "graph(%x: f32[6, 5, 9]{45, 9, 1}@cpu):\n"
      "  %a: f32[6, 5, 9]{45, 9, 1}@cpu = aten::add.Tensor(%x, 3, alpha=2)\n"
      "  %s: f32[6, 5, 9]{45, 9, 1}@cpu = aten::sub.Tensor(%a, 0.5, alpha=3)\n"
      "  %m: f32[1, 1, 9]{9, 9, 1}@cpu = aten::amax(%s, [0, 1], true)\n"
      "  %k: f32[1, 1, 9]{9, 9, 1}@cpu = aten::add.Tensor(%m, 1.5, alpha=-2)\n"
      "  return (%k)\n";
  Graph g = parse(fuse_text(columns));
  std::string why;
  std::optional<Program> p = lower_group(g, 0, &why);
  ASSERT_TRUE(p) << why;
  EXPECT_EQ(p->outer, 2u) << p->text();
  expect_fused_matches(columns, {at::randn({6, 5, 9})});
  const std::string rows =
      "graph(%x: f32[7, 33]{33, 1}@cpu):\n"
      "  %a: f32[7, 33]{33, 1}@cpu = aten::add.Tensor(%x, 3, alpha=2)\n"
      "  %m: f32[7, 1]{1, 1}@cpu = aten::amax(%a, [-1], true)\n"
      "  %k: f32[7, 1]{1, 1}@cpu = aten::add.Tensor(%m, 1.5, alpha=-2)\n"
      "  %d: f32[7, 33]{33, 1}@cpu = aten::sub.Tensor(%a, %k)\n"
      "  return (%k, %d)\n";
  expect_fused_matches(rows, {at::randn({7, 33})});
}

TEST(FusedCpuKernel, SymIntScalarsAndDynamicSizes) {
  const std::string text =
      "graph(%x: f32[s0, 6]{6, 1}@cpu, %s0: int):\n"
      "  %a: f32[s0, 6]{6, 1}@cpu = aten::mul.Tensor(%x, %s0)\n"
      "  %b: f32[s0, 6]{6, 1}@cpu = aten::exp(%a)\n"
      "  return (%b)\n";
  for (int64_t n : {1, 5, 4099}) expect_fused_matches(text, {at::randn({n, 6}) * 0.01, c10::IValue(n)}, 1e-5);
}

// Group marks in IR text reach the kernel generator even with the fuse pass off, so opcodes the CPU
// pass never groups (gelu, tanh) are still checked against ATen.
TEST(FusedCpuKernel, PreMarkedGroupsWithFusePassOff) {
  const std::string body =
      "graph(%x: f32[9, 130]{130, 1}@cpu, %g: f32[9, 130]{130, 1}@cpu):\n"
      "  %a: f32[9, 130]{130, 1}@cpu = aten::gelu(%x)@\n"
      "  %b: f32[9, 130]{130, 1}@cpu = aten::gelu(%a, approximate=\"tanh\")@\n"
      "  %c: f32[9, 130]{130, 1}@cpu = aten::tanh(%b)@\n"
      "  %d: f32[9, 130]{130, 1}@cpu = aten::gelu_backward(%g, %x)@\n"
      "  %e: f32[9, 130]{130, 1}@cpu = aten::silu(%d)@\n"
      "  %f: f32[9, 130]{130, 1}@cpu = aten::add.Tensor(%c, %e)@\n"
      "  return (%f)\n";
  auto with = [&](const std::string& mark) {
    std::string t = body;
    for (size_t p = t.find(")@"); p != std::string::npos; p = t.find(")@")) t.replace(p, 2, ")" + mark);
    return t;
  };
  CompileOptions off;
  off.disabled_passes = {"fuse"};
  auto plain = compile(parse(with("")), {}, off);
  auto fused = compile(parse(with(" #0")), {}, off);
  ASSERT_EQ(fused->plan().steps.size(), 1u) << fused->describe();
  at::Tensor x = at::randn({9, 130}) * 3, g = at::randn({9, 130});
  x[0][0] = 0.01f;  // tanh's small-argument branch
  at::Tensor want = plain->run({x, g})[0].toTensor(), got = fused->run({x, g})[0].toTensor();
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max().item<float>();
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

// The CUDA generator's source, checked without a GPU: every program shape family must compile with
// nvcc for sm_90 when nvcc is on the PATH (CI has it); the GPU machine runs the kernels against ATen.
// Programs point into their graph's values: the graphs live as long as the test binary.
std::vector<Program> cuda_programs(const std::string& text) {
  static std::deque<Graph> graphs;
  Graph& g = graphs.emplace_back(parse(text));
  CompileOptions options;
  PassContext ctx{options};
  batchnorm_pointwise(g, ctx);
  eliminate_dead_code(g, ctx);
  fuse(g, ctx);
  std::vector<Program> out;
  for (int group = 0;; ++group) {
    std::string why;
    auto p = lower_group(g, group, &why);
    if (!p) break;
    out.push_back(std::move(*p));
  }
  return out;
}

// One graph per kernel family; groups with a symbolic last dimension print every row variant, those
// with a constant one only the variant chosen for it.
std::vector<std::pair<std::string, std::string>> codegen_graphs() {
  auto pointwise = [](const std::string& t) {
    return "graph(%x: " + t + "[s0, 1023]{1023, 1}@cuda:0, %b: " + t + "[1023]{1}@cuda:0, %y: " + t +
           "[s0, 1023]{1, s0}@cuda:0, %s0: int):\n"
           "  %n: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::neg(%x)\n"
           "  %e: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::exp(%n)\n"
           "  %d: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::add.Tensor(%e, 1)\n"
           "  %sg: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::div.Tensor(%x, %d)\n"
           "  %a: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::add.Tensor(%sg, %b)\n"
           "  %c: " + t + "[s0, 1023]{1023, 1}@cuda:0 = aten::mul.Tensor(%a, %y)\n"
           "  return (%c)\n";
  };
  auto rows = [](const std::string& t, const std::string& cols, const std::string& body) {
    std::string shape = t + "[s0, " + cols + "]{" + cols + ", 1}@cuda:0";
    std::string text = "graph(%x: " + shape + ", %w: " + t + "[" + cols + "]{1}@cuda:0, %bb: " + t + "[" + cols +
                       "]{1}@cuda:0, %s0: int" + (cols == "s1" ? ", %s1: int" : "") + "):\n" + body;
    for (size_t p = text.find("$S"); p != std::string::npos; p = text.find("$S")) text.replace(p, 2, shape);
    for (size_t p = text.find("$T"); p != std::string::npos; p = text.find("$T")) text.replace(p, 2, t);
    for (size_t p = text.find("$C"); p != std::string::npos; p = text.find("$C")) text.replace(p, 2, cols);
    const std::string list = cols == "s1" ? "%s1" : cols;
    for (size_t p = text.find("$L"); p != std::string::npos; p = text.find("$L")) text.replace(p, 2, list);
    return text;
  };
  // A lone reduction is left to ATen (fuse dissolves groups of one node): each family starts with a scale.
  const std::string scale = "  %a: $S = aten::mul.Tensor(%x, 0.5)\n";
  const std::string softmax = scale + "  %sm: $S = aten::_softmax(%a, -1, false)\n  return (%sm)\n";
  const std::string log_softmax = scale + "  %ls: $S = aten::_log_softmax(%a, -1, false)\n  return (%ls)\n";
  const std::string layer_norm = scale +
      "  %ln: $S, %mu: f32[s0, 1]{1, 1}@cuda:0, %rs: f32[s0, 1]{1, 1}@cuda:0 = "
      "aten::native_layer_norm(%a, [$L], %w, %bb, 1e-05)\n  return (%ln, %mu, %rs)\n";
  const std::string entropy =
      "  %p: $S = aten::_softmax(%x, -1, false)\n"
      "  %q: $S = aten::add.Tensor(%p, 1e-08)\n"
      "  %l: $S = aten::log(%q)\n"
      "  %m: $S = aten::mul.Tensor(%p, %l)\n"
      "  %s: $T[s0]{1}@cuda:0 = aten::sum.dim_IntList(%m, [-1])\n"
      "  %n: $T[s0]{1}@cuda:0 = aten::neg(%s)\n"
      "  return (%n)\n";
  std::vector<std::pair<std::string, std::string>> graphs;
  for (std::string t : {"f32", "f16", "bf16"}) {
    graphs.push_back({"pointwise_" + t, pointwise(t)});
    graphs.push_back({"silu_add_" + t, "graph(%x: " + t + "[s0]{1}@cuda:0, %y: " + t + "[s0]{1}@cuda:0, %s0: int):\n"
                                       "  %g: " + t + "[s0]{1}@cuda:0 = aten::sigmoid(%x)\n"
                                       "  %m: " + t + "[s0]{1}@cuda:0 = aten::mul.Tensor(%x, %g)\n"
                                       "  %a: " + t + "[s0]{1}@cuda:0 = aten::add.Tensor(%m, %y)\n"
                                       "  return (%a)\n"});
    // GPT-2's gelu_new after its projection's bias (passes/addmm_activation.cpp moves the bias here; siblings
    // of %v share the group): one kernel, %v read once.
    const std::string g = t + "[s0, 3072]{3072, 1}@cuda:0";
    graphs.push_back({"gelu_new_" + t, "graph(%x: " + g + ", %b: " + t + "[3072]{1}@cuda:0, %s0: int):\n"
                                       "  %v: " + g + " = aten::add.Tensor(%x, %b)\n"
                                       "  %h: " + g + " = aten::mul.Tensor(%v, 0.5)\n"
                                       "  %p: " + g + " = aten::pow.Tensor_Scalar(%v, 3.0)\n"
                                       "  %q: " + g + " = aten::mul.Tensor(%p, 0.044715)\n"
                                       "  %r: " + g + " = aten::add.Tensor(%v, %q)\n"
                                       "  %u: " + g + " = aten::mul.Tensor(%r, 0.7978845608028654)\n"
                                       "  %th: " + g + " = aten::tanh(%u)\n"
                                       "  %o: " + g + " = aten::add.Tensor(%th, 1.0)\n"
                                       "  %y: " + g + " = aten::mul.Tensor(%h, %o)\n"
                                       "  return (%y)\n"});
    // GPT-2's residual add + projection bias + layer norm over 768 columns (the bias move puts the bias
    // here): five full inputs, three in the first phase, the weight and bias in the last.
    const std::string r = t + "[s0, 768]{768, 1}@cuda:0", c = t + "[768]{1}@cuda:0";
    graphs.push_back({"residual_ln_768_" + t, "graph(%x: " + r + ", %b: " + c + ", %h: " + r + ", %w: " + c + ", %lb: " + c + ", %s0: int):\n"
                                              "  %xb: " + r + " = aten::add.Tensor(%x, %b)\n"
                                              "  %a: " + r + " = aten::add.Tensor(%xb, %h)\n"
                                              "  %n: " + r + ", %m: f32[s0, 1]{1, 1}@cuda:0, %rs: f32[s0, 1]{1, 1}@cuda:0 = aten::native_layer_norm(%a, [768], %w, %lb, 1e-05)\n"
                                              "  return (%a, %n)\n"});
    // resnet's eval batch norm + residual add + relu, channels_last (bn_pointwise rewrites the batch norm).
    const std::string cl = t + "[8, 256, 14, 14]{50176, 1, 3584, 256}@cuda:0", pc = t + "[256]{1}@cuda:0";
    graphs.push_back({"bn_add_relu_cl_" + t, "graph(%x: " + cl + ", %w: " + pc + ", %b: " + pc + ", %m: " + pc + ", %v: " + pc + ", %r: " + cl + "):\n"
                                             "  %y: " + cl + ", %s1: " + t + "[0]{1}@cuda:0, %s2: " + t + "[0]{1}@cuda:0 = "
                                             "aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
                                             "  %a: " + cl + " = aten::add.Tensor(%y, %r)\n"
                                             "  %o: " + cl + " = aten::relu(%a)\n"
                                             "  return (%o)\n"});
    const std::string nchw = t + "[8, 256, 14, 14]{50176, 196, 14, 1}@cuda:0";
    graphs.push_back({"bn_relu_nchw_" + t, "graph(%x: " + nchw + ", %w: " + pc + ", %b: " + pc + ", %m: " + pc + ", %v: " + pc + "):\n"
                                           "  %y: " + nchw + ", %s1: " + t + "[0]{1}@cuda:0, %s2: " + t + "[0]{1}@cuda:0 = "
                                           "aten::_native_batch_norm_legit_no_training(%x, %w, %b, %m, %v, 0.1, 1e-05)\n"
                                           "  %o: " + nchw + " = aten::relu(%y)\n"
                                           "  return (%o)\n"});
    graphs.push_back({"softmax_" + t, rows(t, "s1", softmax)});
    graphs.push_back({"softmax_1024_" + t, rows(t, "1024", softmax)});
    graphs.push_back({"log_softmax_" + t, rows(t, "s1", log_softmax)});
    graphs.push_back({"layer_norm_" + t, rows(t, "s1", layer_norm)});
    graphs.push_back({"layer_norm_768_" + t, rows(t, "768", layer_norm)});
    graphs.push_back({"layer_norm_3000_" + t, rows(t, "3000", layer_norm)});
    graphs.push_back({"entropy_" + t, rows(t, "s1", entropy)});
    if (t == "f32") {
      // LN-GELU-Linear-LN's two norms over 1024 columns: the layer norm + GELU, and the Linear's bias + the
      // layer norm (three rows every row shares, hoisted: the most registers a bounded variant holds).
      const std::string r = "f32[s0, 1024]{1024, 1}@cuda:0", c = "f32[1024]{1}@cuda:0";
      const std::string stats = ", %m: f32[s0, 1]{1, 1}@cuda:0, %rs: f32[s0, 1]{1, 1}@cuda:0";
      graphs.push_back({"ln_gelu_1024_f32", "graph(%x: " + r + ", %w: " + c + ", %lb: " + c + ", %s0: int):\n"
                                            "  %n: " + r + stats + " = aten::native_layer_norm(%x, [1024], %w, %lb, 1e-05)\n"
                                            "  %g: " + r + " = aten::gelu(%n)\n"
                                            "  return (%g)\n"});
      graphs.push_back({"bias_ln_1024_f32", "graph(%x: " + r + ", %b: " + c + ", %w: " + c + ", %lb: " + c + ", %s0: int):\n"
                                            "  %a: " + r + " = aten::add.Tensor(%x, %b)\n"
                                            "  %n: " + r + stats + " = aten::native_layer_norm(%a, [1024], %w, %lb, 1e-05)\n"
                                            "  return (%n)\n"});
    }
    // Column groups (reductions over leading dims): relu's backward through a bool mask, a bias over
    // the kept dims, a sum (its epilogue reads a column input), a keepdim amax, a keepdim mean with an
    // epilogue, and an amin; all of [s0, 12, 40] down its first dim.
    const std::string f = t + "[s0, 12, 40]{480, 40, 1}@cuda:0", k = t + "[12, 40]{40, 1}@cuda:0",
                      kk = t + "[1, 12, 40]{480, 40, 1}@cuda:0";
    graphs.push_back({"columns_" + t, "graph(%g: " + f + ", %m: b8[s0, 12, 40]{480, 40, 1}@cuda:0, %b: " + t + "[40]{1}@cuda:0, %w: " + k +
                                      ", %s0: int):\n"
                                      "  %d: " + f + " = aten::where.self(%m, 0.0, %g)\n"
                                      "  %a: " + f + " = aten::add.Tensor(%d, %b)\n"
                                      "  %s: " + k + " = aten::sum.dim_IntList(%a, [0])\n"
                                      "  %h: " + k + " = aten::mul.Tensor(%s, %w)\n"
                                      "  %mx: " + kk + " = aten::amax(%d, [0], true)\n"
                                      "  %me: " + kk + " = aten::mean.dim(%a, [0], true)\n"
                                      "  %r: " + kk + " = aten::sqrt(%me)\n"
                                      "  %mn: " + k + " = aten::amin(%d, [0])\n"
                                      "  %n: " + k + " = aten::neg(%mn)\n"
                                      "  return (%a, %h, %mx, %r, %n)\n"});
    // A layer norm's weight and bias gradients: sums over [0, 1] of [s0, s1, 64], the weight's reading
    // a keepdim column input.
    const std::string l = t + "[s0, s1, 64]{64*s1, 64, 1}@cuda:0", h = t + "[64]{1}@cuda:0";
    graphs.push_back({"columns_2d_" + t, "graph(%g: " + l + ", %xh: " + l + ", %sc: " + t + "[1, 1, 64]{64, 64, 1}@cuda:0, %s0: int, %s1: int):\n"
                                         "  %p: " + l + " = aten::mul.Tensor(%g, %xh)\n"
                                         "  %dw: " + h + " = aten::sum.dim_IntList(%p, [0, 1])\n"
                                         "  %db: " + t + "[1, 1, 64]{64, 64, 1}@cuda:0 = aten::sum.dim_IntList(%g, [0, 1], true)\n"
                                         "  %ds: " + t + "[1, 1, 64]{64, 64, 1}@cuda:0 = aten::mul.Tensor(%db, %sc)\n"
                                         "  return (%dw, %ds)\n"});
  }
  // bench/harness.py's first two workloads as their static shapes give them: x.sin().cos().exp() on
  // 1000x1000, and the entropy scorer's row kernel over a fixed 768 columns.
  graphs.push_back({"sin_cos_exp_1000", "graph(%x: f32[1000, 1000]{1000, 1}@cuda:0):\n"
      "  %a: f32[1000, 1000]{1000, 1}@cuda:0 = aten::sin(%x)\n"
      "  %b: f32[1000, 1000]{1000, 1}@cuda:0 = aten::cos(%a)\n"
      "  %c: f32[1000, 1000]{1000, 1}@cuda:0 = aten::exp(%b)\n"
      "  return (%c)\n"});
  graphs.push_back({"entropy_768_f32", rows("f32", "768", entropy)});
  for (std::string t : {"f32", "bf16"}) graphs.push_back({"vit_softmax_197_" + t, rows(t, "197", softmax)});  // ViT's keys
  // channels_last with a symbolic batch (dynamic shapes): a permuted group, its per-channel bias a period.
  const std::string cl = "f32[s0, 64, 7, 7]{3136, 1, 448, 64}@cuda:0";
  graphs.push_back({"cl_dynamic_f32", "graph(%x: " + cl + ", %b: f32[64, 1, 1]{1, 1, 1}@cuda:0, %r: " + cl + ", %s0: int):\n"
      "  %a: " + cl + " = aten::add.Tensor(%x, %b)\n"
      "  %c: " + cl + " = aten::add.Tensor(%a, %r)\n"
      "  %o: " + cl + " = aten::relu(%c)\n"
      "  return (%o)\n"});
  graphs.push_back({"mixed",
      "graph(%x: f16[s0, 301]{301, 1}@cuda:0, %w: f32[301]{1}@cuda:0, %b: f32[301]{1}@cuda:0, %m: b8[301]{1}@cuda:0, "
      "%y: bf16[7, 5]{1, 7}@cuda:0, %s0: int):\n"
      "  %a: f32[s0, 301]{301, 1}@cuda:0 = aten::_to_copy(%x, dtype=f32)\n"
      "  %g: f32[s0, 301]{301, 1}@cuda:0 = aten::gelu(%a)\n"
      "  %t: f32[s0, 301]{301, 1}@cuda:0 = aten::where.self(%m, %g, %w)\n"
      "  %sm: f32[s0, 301]{301, 1}@cuda:0 = aten::_softmax(%t, -1, false)\n"
      "  %ln: f32[s0, 301]{301, 1}@cuda:0, %mu: f32[s0, 1]{1, 1}@cuda:0, %rs: f32[s0, 1]{1, 1}@cuda:0 = "
      "aten::native_layer_norm(%sm, [301], %w, %b, 1e-05)\n"
      "  %mx: f32[s0]{1}@cuda:0 = aten::amax(%ln, [-1])\n"
      "  %ng: f32[s0]{1}@cuda:0 = aten::mul.Tensor(%mx, %s0)\n"
      "  %e: bf16[7, 5]{1, 7}@cuda:0 = aten::exp(%y)\n"
      "  return (%ln, %mu, %ng, %e)\n"});
  return graphs;
}

TEST(CudaCodegen, EntryPointsPerFamily) {
  for (const auto& [label, text] : codegen_graphs()) {
    std::vector<Program> programs = cuda_programs(text);
    ASSERT_GE(programs.size(), 1u) << label;
    for (const Program& program : programs) {
      cuda::CudaSource src = cuda::generate(program, "k");
      EXPECT_NE(src.text.find("extern \"C\" __global__ void k(Params p)"), std::string::npos) << label;
      if (!program.has_reduction) {
        EXPECT_EQ(src.vector_entry, "k_vec") << label;
        EXPECT_NE(src.text.find("void k_vec(Params p)"), std::string::npos) << label;
        EXPECT_EQ(src.strided_vector_entry, "k_vec_strided") << label;
        // The strided entry is its own module, compiled on first use: the main one does not carry it.
        EXPECT_EQ(src.text.find("void k_vec_strided(Params p)"), std::string::npos) << label;
        EXPECT_NE(src.strided_text.find("void k_vec_strided(Params p)"), std::string::npos) << label;
        EXPECT_EQ(src.strided_text.find("void k_vec(Params p)"), std::string::npos) << label;
        // Where the innermost size is a multiple of the vector width, an input read through its strides
        // takes one offset per vector (a row piece), in 32-bit divisions (below 2^32 elements).
        if (program.rank >= 1) {
          EXPECT_NE(src.strided_text.find("const bool rows = p.size["), std::string::npos) << label;
          EXPECT_NE(src.strided_text.find("{ unsigned rest = (unsigned)(chunk * V);"), std::string::npos) << label;
        }
      }
      for (const cuda::RowVariant& v : src.rows)
        EXPECT_NE(src.text.find(" " + v.entry + "(Params p)"), std::string::npos) << label;
      if (label.rfind("columns_", 0) == 0) {  // the general entry alone
        EXPECT_GT(program.outer, 0u) << label;
        EXPECT_TRUE(src.rows.empty()) << label;
        EXPECT_TRUE(src.vector_entry.empty() && src.strided_text.empty()) << label;
      }
      bool f32 = label.find("f32") != std::string::npos;
      if (label.rfind("softmax_", 0) == 0 && label.find("1024") == std::string::npos)
        EXPECT_EQ(src.rows.size(), 6u) << label;  // w1 b1 w2 b2 w4 w8
      if (label.rfind("softmax_1024", 0) == 0) {
        ASSERT_EQ(src.rows.size(), 1u) << label;
        EXPECT_EQ(src.rows[0].entry, f32 ? "k_w8" : "k_w4") << label;
      }
      if (label.rfind("layer_norm_768", 0) == 0 || label.rfind("residual_ln_768", 0) == 0) {
        // The rows read before the output phase fit the registers of a warp variant (f32 w8, 16-bit w4)
        // bounded to 6 blocks of 128 threads. f32's rows of 768 columns use 6 of w8's 8 chunks, so GPT-2's
        // block end, two such rows, holds 48 registers of them (counted as 64 before: b1). 16-bit weight
        // and bias load a vector at a time; f32's w8 hoists them (and the bias before the norm) out of
        // the row loop, under a looser bound (3 blocks of 128).
        ASSERT_GE(src.rows.size(), 1u) << label;
        const std::string warp = f32 ? "k_w8" : "k_w4";
        EXPECT_EQ(src.rows[0].entry, warp) << label;
        const std::string bound = f32 ? "__launch_bounds__(128, 3) " : "__launch_bounds__(128, 6) ";
        EXPECT_NE(src.text.find(bound + warp + "("), std::string::npos) << label;
        EXPECT_NE(src.text.find(f32 ? "rows_cached<8, true, true, false>" : "rows_cached<4, true, false, false>"), std::string::npos) << label;
        // A row length the types fix compiles the chosen variant alone.
        EXPECT_EQ(src.rows.size(), 1u) << label;
        EXPECT_NE(src.text.find("c, v)"), std::string::npos) << label;  // get_elem(x<k>c, v)
      }
      if (label == "bias_ln_1024_f32" || label == "ln_gelu_1024_f32") {
        // One row held per row, the others shared: w8, hoisting them (b1 before, for the bias + norm).
        ASSERT_EQ(src.rows.size(), 1u) << label;
        EXPECT_EQ(src.rows[0].entry, "k_w8") << label;
        EXPECT_NE(src.text.find("__launch_bounds__(128, 3) k_w8(Params p) { rows_cached<8, true, true, false>"), std::string::npos) << label;
        EXPECT_NE(src.text.find("unsigned x2h[HOIST ? J : 1]"), std::string::npos) << label;
      }
      if (label.rfind("layer_norm_3000", 0) == 0) {
        // b1 needs 750 (f32) or 375 threads, which its registers may not allow: b2 backs it up.
        ASSERT_EQ(src.rows.size(), 2u) << label;
        EXPECT_EQ(src.rows[0].entry, "k_b1") << label;
        EXPECT_EQ(src.rows[1].entry, "k_b2") << label;
      }
    }
  }
  std::vector<cuda::RowVariant> all = {{cuda::RowVariant::Mode::Warp, 1, "w1"}, {cuda::RowVariant::Mode::Block, 1, "b1"},
                                       {cuda::RowVariant::Mode::Block, 2, "b2"}};
  EXPECT_EQ(cuda::choose_row_variant(100, 4, all)->entry, "w1");
  EXPECT_EQ(cuda::choose_row_variant(4096, 4, all)->entry, "b1");
  EXPECT_EQ(cuda::choose_row_variant(4097, 4, all)->entry, "b2");
  EXPECT_EQ(cuda::choose_row_variant(8193, 4, all), std::nullopt);
  auto no_b1 = [](const cuda::RowVariant& v) { return v.entry != "b1"; };
  EXPECT_EQ(cuda::choose_row_variant(4096, 4, all, no_b1)->entry, "b2");
  EXPECT_EQ(cuda::block_threads(all[1], 4096, 4), 1024);
  EXPECT_EQ(cuda::block_threads(all[2], 33, 4), 32);
}

// Every variant of every family through nvcc (PTX for sm_90); NVRTC sources include nothing, so nvcc
// sees exactly what NVRTC compiles. The f32 vector kernel must use 16-byte global loads and stores.
// What keeps NVRTC's time down: flat groups whose elements compile to much code take fewer vectors per
// thread (each unrolled copy is ptxas's work), sin and cos inline only their short-argument path, row
// variants whose length is known compile it as a constant, and costly row variants may compile in the
// background.
TEST(CudaCodegen, SourceSizedForCompileTime) {
  auto flat = [](const std::string& t, const std::string& body) {
    std::vector<Program> programs = cuda_programs("graph(%x: " + t + "[s0]{1}@cuda:0, %s0: int):\n" + body);
    EXPECT_EQ(programs.size(), 1u);
    return cuda::generate(programs.at(0), "k");
  };
  cuda::CudaSource trig = flat("f32", "  %a: f32[s0]{1}@cuda:0 = aten::sin(%x)\n  %b: f32[s0]{1}@cuda:0 = aten::cos(%a)\n"
                                      "  %c: f32[s0]{1}@cuda:0 = aten::exp(%b)\n  return (%c)\n");
  EXPECT_EQ(trig.flat_unroll, 1);
  EXPECT_NE(trig.text.find("= sin_near(v"), std::string::npos);
  EXPECT_NE(trig.text.find("= cos_near(v"), std::string::npos);
  cuda::CudaSource silu = flat("f32", "  %a: f32[s0]{1}@cuda:0 = aten::sigmoid(%x)\n  %b: f32[s0]{1}@cuda:0 = aten::mul.Tensor(%x, %a)\n"
                                      "  return (%b)\n");
  EXPECT_EQ(silu.flat_unroll, 4);
  cuda::CudaSource gelu = flat("bf16", "  %a: bf16[s0]{1}@cuda:0 = aten::gelu(%x)\n  %b: bf16[s0]{1}@cuda:0 = aten::mul.Tensor(%a, 2.0)\n"
                                       "  return (%b)\n");
  EXPECT_EQ(gelu.vector_width, 8);
  EXPECT_EQ(gelu.flat_unroll, 1);  // an erff per element: bound by instruction issue (flat_unroll)

  // Rows of a fixed length that is no multiple of the vector width are never vector-loaded: no such branch.
  for (const auto& [label, text] : codegen_graphs()) {
    if (label.rfind("vit_softmax_197", 0) != 0 && label != "softmax_1024_f32") continue;
    const cuda::CudaSource src = cuda::generate(cuda_programs(text).at(0), "k");
    EXPECT_EQ(src.entries_text.find("p.vec") == std::string::npos, label != "softmax_1024_f32") << label;
  }

  for (const auto& [label, text] : codegen_graphs()) {
    if (label.rfind("layer_norm", 0) != 0 || label.find("bf16") != std::string::npos || label.find("f16") != std::string::npos) continue;
    const std::string source = cuda::generate(cuda_programs(text).at(0), "k").text;
    const bool fixed = label != "layer_norm_f32";  // [s0, s1] has no fixed length; [s0, 768] and [s0, 3000] do
    const std::string cols = label == "layer_norm_768_f32" ? "768" : "3000";
    EXPECT_EQ(source.find(fixed ? "constexpr int cols = " + cols + ";" : "const int cols = (int)p.cols;") != std::string::npos, true)
        << label;
  }
}

TEST(CudaCodegen, FastMathOnlyWhereEagerRoundsTo16Bits) {
  // exp, sigmoid and division take the hardware approximations only where every use of their result ends
  // in a 16-bit rounding (cuda_source.cpp, mark_rounded_values): a bf16 softmax (its exp through the row
  // sum, its division by the row's sum as one reciprocal per row) and a bf16 silu, but not the f32 forms,
  // nor an exp that is added to before the rounding.
  auto source = [](const std::string& text) {
    std::vector<Program> programs = cuda_programs(text);
    EXPECT_EQ(programs.size(), 1u) << text;
    return programs.empty() ? std::string() : cuda::generate(programs[0], "k").text;
  };
  auto softmax = [](const std::string& t) {
    const std::string x = t + "[s0, 100]{100, 1}@cuda:0";
    return "graph(%x: " + x + ", %s0: int):\n  %a: " + x + " = aten::mul.Tensor(%x, 0.5)\n  %sm: " + x +
           " = aten::_softmax(%a, -1, false)\n  return (%sm)\n";
  };
  auto silu = [](const std::string& t) {
    const std::string x = t + "[64, 100]{100, 1}@cuda:0";
    return "graph(%x: " + x + ", %y: " + x + "):\n  %a: " + x + " = aten::silu(%x)\n  %b: " + x +
           " = aten::add.Tensor(%a, %y)\n  return (%b)\n";
  };
  const std::string bf16_softmax = source(softmax("bf16")), f32_softmax = source(softmax("f32"));
  EXPECT_NE(bf16_softmax.find("= exp_fast(v"), std::string::npos) << bf16_softmax;
  EXPECT_NE(bf16_softmax.find("= div_row(v"), std::string::npos) << bf16_softmax;
  EXPECT_EQ(f32_softmax.find("= exp_fast(v"), std::string::npos);
  EXPECT_EQ(f32_softmax.find("= div_row(v"), std::string::npos);
  EXPECT_NE(f32_softmax.find("= expf(v"), std::string::npos);
  EXPECT_NE(source(silu("f16")).find("rcp_fast(1.f + exp_fast(-v"), std::string::npos);
  EXPECT_EQ(source(silu("f32")).find("rcp_fast(1.f + exp_fast(-v"), std::string::npos);
  const std::string x = "bf16[64, 100]{100, 1}@cuda:0", f = "f32[64, 100]{100, 1}@cuda:0";
  const std::string upcast = source("graph(%x: " + x + "):\n  %a: " + f + " = aten::_to_copy(%x, dtype=f32)\n  %e: " + f +
                                    " = aten::exp(%a)\n  %s: " + f + " = aten::add.Tensor(%e, %a)\n  %o: " + x +
                                    " = aten::_to_copy(%s, dtype=bf16)\n  return (%o)\n");
  EXPECT_NE(upcast.find("= expf(v"), std::string::npos) << upcast;
  EXPECT_EQ(upcast.find("= exp_fast(v"), std::string::npos) << upcast;
}

TEST(CudaCodegen, GeneratedSourceCompilesWithNvcc) {
  if (std::system("command -v nvcc > /dev/null 2>&1") != 0) GTEST_SKIP() << "nvcc not on PATH";
  for (const auto& [label, text] : codegen_graphs()) {
    std::vector<Program> programs = cuda_programs(text);
    for (size_t i = 0; i < programs.size(); ++i) {
      std::string path = ::testing::TempDir() + "ember_codegen_" + label + "_" + std::to_string(i);
      cuda::CudaSource generated = cuda::generate(programs[i], "k");
      {
        std::ofstream f(path + ".cu");
        f << generated.text;
      }
      std::string cmd = "nvcc -std=c++17 -arch=sm_90 --ptx -x cu -o " + path + ".ptx " + path + ".cu > " + path + ".log 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << "nvcc rejected " << path << ".cu (log in " << path << ".log)";
      // The modules compiled apart: the strided entry (on first use), and the general entry beside the
      // others (make_fused_kernel compiles the two at once). Each holds its entries and no other.
      auto entry = [](const std::string& name) { return "__global__ void " + name + "(Params p)"; };
      std::vector<std::pair<std::string, std::string>> parts;  // (suffix, text)
      if (!generated.strided_text.empty()) {
        parts.emplace_back("_strided", generated.strided_text);
        EXPECT_NE(generated.strided_text.find(entry(generated.strided_vector_entry)), std::string::npos);
        EXPECT_EQ(generated.strided_text.find(entry("k")), std::string::npos) << label;
      }
      if (!generated.entries_text.empty()) {
        parts.emplace_back("_general", generated.general_text);
        parts.emplace_back("_entries", generated.entries_text);
        EXPECT_NE(generated.general_text.find(entry("k")), std::string::npos) << label;
        EXPECT_EQ(generated.entries_text.find(entry("k")), std::string::npos) << label;
        if (!generated.vector_entry.empty()) {
          EXPECT_NE(generated.entries_text.find(entry(generated.vector_entry)), std::string::npos) << label;
          EXPECT_EQ(generated.general_text.find(entry(generated.vector_entry)), std::string::npos) << label;
        }
        for (const cuda::RowVariant& v : generated.rows)
          EXPECT_NE(generated.entries_text.find(v.entry + "(Params p)"), std::string::npos) << label;
      } else {
        EXPECT_TRUE(generated.vector_entry.empty() && generated.rows.empty()) << label;
      }
      for (const auto& [suffix, module] : parts) {
        {
          std::ofstream f(path + suffix + ".cu");
          f << module;
        }
        cmd = "nvcc -std=c++17 -arch=sm_90 --ptx -x cu -o " + path + suffix + ".ptx " + path + suffix + ".cu > " + path +
              suffix + ".log 2>&1";
        ASSERT_EQ(std::system(cmd.c_str()), 0) << "nvcc rejected " << path << suffix << ".cu";
      }
      if (label == "pointwise_f32") {
        std::ifstream f(path + ".ptx");
        std::string ptx((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        EXPECT_NE(ptx.find("ld.global.nc.v4"), std::string::npos) << path << ".ptx";
        EXPECT_NE(ptx.find("st.global.v4"), std::string::npos) << path << ".ptx";
      }
    }
  }
}

// Limits of an H100-like device (132 multiprocessors) whose entries hold `resident_at_256` blocks of
// 256 threads per multiprocessor.
cuda::LaunchLimits limits_with(size_t entries, int resident_at_256) {
  cuda::LaunchLimits limits;
  limits.multiprocessors = 132;
  for (size_t e = 0; e < entries; ++e) {
    limits.max_threads.push_back(e == 0 ? 1024 : 256);
    std::vector<int>& r = limits.resident.emplace_back();
    for (int threads = 32; threads <= 1024; threads += 32) r.push_back(threads <= 256 ? resident_at_256 * (256 / threads) : 1);
  }
  return limits;
}

// The plan of one call with `inputs` in the program's input order (scalars: inputs[0]'s first size).
cuda::CallPlan call(const Program& program, const cuda::CudaSource& source, std::vector<at::Tensor> inputs,
                    const cuda::LaunchLimits& limits) {
  std::vector<c10::IValue> buffers;
  std::vector<uint32_t> reads;
  for (at::Tensor& t : inputs) {
    reads.push_back(static_cast<uint32_t>(buffers.size()));
    buffers.emplace_back(t);
  }
  for (size_t s = 0; s < program.scalars.size(); ++s) {
    reads.push_back(static_cast<uint32_t>(buffers.size()));
    buffers.emplace_back(int64_t{inputs[0].size(0)});
  }
  std::vector<c10::ScalarType> out_dtypes;
  for (const ProgramOutput& o : program.outputs) out_dtypes.push_back(o.value->type.tensor.dtype);
  return cuda::plan_call(program, source, out_dtypes, buffers, reads, c10::Device(c10::kCPU), limits);
}

// The host side of a call, without a GPU (outputs land on the CPU): which entry point and what grid.
// Flat grids take every block their work fills; row grids stay within one wave of the entry's resident
// blocks, as the driver reports them.
TEST(CudaLaunch, EntryAndGrid) {
  const std::string silu_add =
      "graph(%x: f32[s0]{1}@cuda:0, %y: f32[s0]{1}@cuda:0, %s0: int):\n"
      "  %g: f32[s0]{1}@cuda:0 = aten::sigmoid(%x)\n"
      "  %m: f32[s0]{1}@cuda:0 = aten::mul.Tensor(%x, %g)\n"
      "  %a: f32[s0]{1}@cuda:0 = aten::add.Tensor(%m, %y)\n"
      "  return (%a)\n";
  std::vector<Program> flat = cuda_programs(silu_add);
  ASSERT_EQ(flat.size(), 1u);
  cuda::CudaSource flat_source = cuda::generate(flat[0], "k");
  ASSERT_EQ(flat_source.flat_unroll, 4);
  const cuda::LaunchLimits flat_limits = limits_with(3, 3);
  const int64_t n = int64_t{1} << 24;
  at::Tensor x = at::randn({n}), y = at::randn({n});
  cuda::CallPlan plan = call(flat[0], flat_source, {x, y}, flat_limits);
  EXPECT_EQ(plan.entry, 1u);  // every input vector-loaded: the entry without strided loads
  EXPECT_EQ(plan.threads, 256u);
  EXPECT_EQ(plan.blocks, 4096u);  // 4M vectors: blocks of 256 threads x 4 vectors, past one wave (132 x 3)
  plan = call(flat[0], flat_source, {x, at::randn({n + 1}).narrow(0, 1, n)}, flat_limits);
  EXPECT_EQ(plan.entry, 2u);  // a misaligned input: the strided vector entry
  plan = call(flat[0], flat_source, {at::randn({4096}), at::randn({4096})}, flat_limits);
  EXPECT_EQ(plan.blocks, 1u);  // 1024 vectors: one block's 256 threads x 4 vectors
  // NCHW per-channel values ([C, 1, 1] over [N, C, H, W]) are read by channel, in the entry without
  // strided inputs, whether H * W is a multiple of the vector width (6x6) or not (7x7).
  for (int64_t hw : {6, 7}) {
    const std::string t = "f32[4, 8, " + std::to_string(hw) + ", " + std::to_string(hw) + "]{" + std::to_string(8 * hw * hw) + ", " +
                          std::to_string(hw * hw) + ", " + std::to_string(hw) + ", 1}@cuda:0";
    std::vector<Program> per_channel = cuda_programs("graph(%x: " + t + ", %w: f32[8, 1, 1]{1, 1, 1}@cuda:0):\n"
                                                     "  %m: " + t + " = aten::mul.Tensor(%x, %w)\n"
                                                     "  %r: " + t + " = aten::relu(%m)\n"
                                                     "  return (%r)\n");
    ASSERT_EQ(per_channel.size(), 1u);
    cuda::CudaSource channel_source = cuda::generate(per_channel[0], "k");
    ASSERT_EQ(per_channel[0].inputs[0].value->name, "w");  // the program's inputs in its own order
    plan = call(per_channel[0], channel_source, {at::randn({8, 1, 1}), at::randn({4, 8, hw, hw})}, flat_limits);
    EXPECT_EQ(plan.entry, 1u) << hw;
  }

  const std::string softmax =
      "graph(%x: bf16[s0, 1024]{1024, 1}@cuda:0, %s0: int):\n"
      "  %a: bf16[s0, 1024]{1024, 1}@cuda:0 = aten::mul.Tensor(%x, 0.125)\n"
      "  %sm: bf16[s0, 1024]{1024, 1}@cuda:0 = aten::_softmax(%a, -1, false)\n"
      "  return (%sm)\n";
  std::vector<Program> rows = cuda_programs(softmax);
  ASSERT_EQ(rows.size(), 1u);
  cuda::CudaSource row_source = cuda::generate(rows[0], "k");
  ASSERT_EQ(row_source.rows.size(), 1u);
  EXPECT_NE(row_source.text.find("__launch_bounds__(256, 4) k_w4"), std::string::npos);
  plan = call(rows[0], row_source, {at::randn({32768, 1024}).to(at::kBFloat16)}, limits_with(2, 4));
  EXPECT_EQ(plan.entry, 1u);
  EXPECT_EQ(plan.threads, 256u);
  EXPECT_EQ(plan.blocks, 132u * 4);  // 4096 blocks of 8 rows' worth, one wave of 4 per SM
  plan = call(rows[0], row_source, {at::randn({20, 1024}).to(at::kBFloat16)}, limits_with(2, 4));
  EXPECT_EQ(plan.blocks, 3u);  // 20 rows, 8 warps (rows) per block

  // channels_last with a symbolic batch: iterated in memory order, the vector entry, the output written
  // channels_last, the per-channel bias read as a repeating period.
  for (const auto& [label, text] : codegen_graphs()) {
    if (label != "cl_dynamic_f32") continue;
    std::vector<Program> cl = cuda_programs(text);
    ASSERT_EQ(cl.size(), 1u);
    cuda::CudaSource cl_source = cuda::generate(cl[0], "k");
    EXPECT_EQ(cl_source.iteration_order, (std::vector<int>{0, 2, 3, 1}));
    std::map<std::string, at::Tensor> by_name{{"x", at::randn({3, 64, 7, 7}).contiguous(at::MemoryFormat::ChannelsLast)},
                                              {"r", at::randn({3, 64, 7, 7}).contiguous(at::MemoryFormat::ChannelsLast)},
                                              {"b", at::randn({64, 1, 1})}};
    std::vector<at::Tensor> inputs;
    for (const ProgramInput& in : cl[0].inputs) inputs.push_back(by_name.at(in.value->name));
    cuda::CallPlan cl_plan = call(cl[0], cl_source, inputs, flat_limits);
    EXPECT_EQ(cl_plan.entry, 1u);
    ASSERT_EQ(cl_plan.outputs.size(), 1u);
    EXPECT_TRUE(cl_plan.outputs[0].is_contiguous(at::MemoryFormat::ChannelsLast));
  }
}

// A column group (a sum and an amax down the first dim of [R, 8, 4], an epilogue reading a transposed
// keepdim column input): its one entry, a block per 32 columns up to one wave, outputs in the full and
// the kept shapes, and every input's strides by full dimension, the column input's aligned to the kept
// shape by its trailing dims.
TEST(CudaLaunch, ColumnGroupsTileColumnsAndAlignColumnInputsToTheKeptShape) {
  std::vector<Program> programs = cuda_programs(
      "graph(%x: f32[s0, 8, 4]{32, 4, 1}@cuda:0, %c: f32[1, 8, 4]{32, 1, 8}@cuda:0, %s0: int):\n"
      "  %a: f32[s0, 8, 4]{32, 4, 1}@cuda:0 = aten::mul.Tensor(%x, 2.0)\n"
      "  %s: f32[1, 8, 4]{32, 4, 1}@cuda:0 = aten::sum.dim_IntList(%a, [0], true)\n"
      "  %h: f32[1, 8, 4]{32, 4, 1}@cuda:0 = aten::add.Tensor(%s, %c)\n"
      "  %m: f32[8, 4]{4, 1}@cuda:0 = aten::amax(%a, [0])\n"
      "  return (%a, %h, %m)\n");
  ASSERT_EQ(programs.size(), 1u);
  const Program& program = programs[0];
  ASSERT_EQ(program.outer, 1u);
  ASSERT_EQ(program.inputs.size(), 2u);
  ASSERT_EQ(program.outputs.size(), 3u);
  cuda::CudaSource source = cuda::generate(program, "k");
  EXPECT_TRUE(source.rows.empty());
  EXPECT_TRUE(source.vector_entry.empty());
  const size_t c = program.inputs[0].value->name == "c" ? 0 : 1;
  ASSERT_TRUE(program.inputs[c].row);
  const int64_t R = 1000;
  std::vector<at::Tensor> inputs(2);
  inputs[1 - c] = at::randn({R, 8, 4});
  inputs[c] = at::randn({1, 4, 8}).transpose(1, 2);  // [1, 8, 4] with strides {32, 1, 8}
  cuda::CallPlan plan = call(program, source, inputs, limits_with(1, 8));
  ASSERT_TRUE(plan.launch);
  EXPECT_EQ(plan.entry, 0u);
  EXPECT_EQ(plan.threads, 256u);
  EXPECT_EQ(plan.blocks, 1u);  // 32 columns: one tile
  ASSERT_EQ(plan.outputs.size(), 3u);
  const std::vector<std::vector<int64_t>> shapes{{R, 8, 4}, {1, 8, 4}, {8, 4}};
  for (size_t o = 0; o < 3; ++o) {
    const std::string name = program.outputs[o].value->name;
    const size_t want = name == "a" ? 0 : name == "h" ? 1 : 2;
    EXPECT_EQ(plan.outputs[o].sizes().vec(), shapes[want]) << name;
  }
  // Params: in[2], out[3], size[3], stride[2][3], numel, rows, cols.
  const std::vector<int64_t>& w = plan.params;
  const size_t size_at = 2 + 3, stride_at = size_at + 3, counts_at = stride_at + 2 * 3;
  EXPECT_EQ(std::vector<int64_t>(w.begin() + size_at, w.begin() + stride_at), (std::vector<int64_t>{R, 8, 4}));
  const size_t x = 1 - c;
  EXPECT_EQ(std::vector<int64_t>(w.begin() + stride_at + 3 * x, w.begin() + stride_at + 3 * x + 3), (std::vector<int64_t>{32, 4, 1}));
  EXPECT_EQ(std::vector<int64_t>(w.begin() + stride_at + 3 * c, w.begin() + stride_at + 3 * c + 3), (std::vector<int64_t>{0, 1, 8}));
  EXPECT_EQ(w[counts_at], R * 32);  // numel
  EXPECT_EQ(w[counts_at + 1], 32);  // rows: the kept positions (columns)
  EXPECT_EQ(w[counts_at + 2], R);   // cols: the reduction's length

  // A wide one: tiles of 32 columns up to one wave (132 SMs x 8 blocks); an empty reduction still runs.
  std::vector<Program> wide = cuda_programs(
      "graph(%x: f32[s0, s1]{s1, 1}@cuda:0, %s0: int, %s1: int):\n"
      "  %a: f32[s0, s1]{s1, 1}@cuda:0 = aten::mul.Tensor(%x, 2.0)\n"
      "  %s: f32[s1]{1}@cuda:0 = aten::sum.dim_IntList(%a, [0])\n"
      "  return (%s)\n");
  ASSERT_EQ(wide.size(), 1u);
  cuda::CudaSource wide_source = cuda::generate(wide[0], "k");
  EXPECT_EQ(call(wide[0], wide_source, {at::randn({4, 100000})}, limits_with(1, 8)).blocks, 132u * 8);
  EXPECT_EQ(call(wide[0], wide_source, {at::randn({4, 33})}, limits_with(1, 8)).blocks, 2u);
  plan = call(wide[0], wide_source, {at::randn({0, 33})}, limits_with(1, 8));
  EXPECT_TRUE(plan.launch);  // a sum of nothing is 0, written by the kernel
  ASSERT_EQ(plan.outputs.size(), 1u);
  EXPECT_EQ(plan.outputs[0].sizes().vec(), (std::vector<int64_t>{33}));
  EXPECT_FALSE(call(wide[0], wide_source, {at::randn({5, 0})}, limits_with(1, 8)).launch);
  EXPECT_EQ(plan.splits, 1u);

  // A bias gradient's 768 columns make 24 tiles: the 1024 rows split into 16 chunks of 64 (one wave
  // would take 44); the chunks' sums go to a workspace of 16 x 768 floats, counted per tile (24
  // counters). Params end with part, count, splits, chunk.
  plan = call(wide[0], wide_source, {at::randn({1024, 768})}, limits_with(1, 8));
  EXPECT_EQ(plan.blocks, 24u);
  EXPECT_EQ(plan.splits, 16u);
  EXPECT_EQ(plan.workspace_floats, 16 * 768);
  EXPECT_EQ(plan.counters, 24);
  float part_at = 0;
  unsigned count_at = 0;
  cuda::set_workspace(plan, &part_at, &count_at);
  const std::vector<int64_t>& ws = plan.params;
  const float* part = &part_at;
  const unsigned* count = &count_at;
  EXPECT_EQ(std::memcmp(&ws[ws.size() - 4], &part, sizeof(part)), 0);
  EXPECT_EQ(std::memcmp(&ws[ws.size() - 3], &count, sizeof(count)), 0);
  EXPECT_EQ(ws[ws.size() - 2], 16);
  EXPECT_EQ(ws[ws.size() - 1], 64);
  plan = call(wide[0], wide_source, {at::randn({1000, 768})}, limits_with(1, 8));
  EXPECT_EQ(plan.splits, 15u);  // 1000 rows: 15 chunks of at least 64 (67 each, the last 62)
  EXPECT_EQ(plan.params.back(), 67);
  plan = call(wide[0], wide_source, {at::randn({100, 768})}, limits_with(1, 8));
  EXPECT_EQ(plan.splits, 1u);  // too few rows to split
  EXPECT_EQ(plan.workspace_floats, 0);
  EXPECT_EQ(plan.params.back(), 100);
}

// The register bound warp variants carry (cuda_source.cpp, min_resident_blocks) must not make ptxas
// spill; nor may the column kernels, which hold an accumulator per reduction and an offset per input.
TEST(CudaCodegen, BoundedVariantsAndColumnKernelsDoNotSpill) {
  if (std::system("command -v nvcc > /dev/null 2>&1") != 0) GTEST_SKIP() << "nvcc not on PATH";
  int bounded = 0, columns = 0;
  for (const auto& [label, text] : codegen_graphs()) {
    std::vector<Program> programs = cuda_programs(text);
    for (size_t i = 0; i < programs.size(); ++i) {
      std::string source = cuda::generate_source(programs[i], "k");
      if (programs[i].outer > 0) ++columns;
      else if (source.find("__launch_bounds__") != std::string::npos) ++bounded;
      else continue;
      std::string path = ::testing::TempDir() + "ember_bounded_" + label + "_" + std::to_string(i);
      {
        std::ofstream f(path + ".cu");
        f << source;
      }
      std::string cmd = "nvcc -std=c++17 -arch=sm_90 -cubin -Xptxas -v -x cu -o " + path + ".cubin " + path + ".cu > " + path +
                        ".log 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << "nvcc rejected " << path << ".cu";
      std::ifstream f(path + ".log");
      for (std::string line; std::getline(f, line);)
        if (line.find("bytes spill") != std::string::npos)
          EXPECT_NE(line.find(" 0 bytes spill stores, 0 bytes spill loads"), std::string::npos) << path << ".log: " << line;
    }
  }
  EXPECT_GT(bounded, 0);
  EXPECT_EQ(columns, 9);  // columns_ (one group) and columns_2d_ (two), in f32, f16 and bf16
}


}  // namespace
}  // namespace ember

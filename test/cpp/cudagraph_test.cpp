// Which plan steps reduce-overhead mode captures (cudagraph/segments): IR text in, parts out. The
// analysis needs no GPU, so CI checks it; capture and replay themselves are tested on the GPU machine
// (test/python/test_cudagraphs.py).
#include "cudagraph/segments.h"
#include "ember/compiler.h"

#include <gtest/gtest.h>

namespace ember::cudagraph {
namespace {

struct Split {
  std::shared_ptr<CompiledGraph> graph;
  Segmentation seg;
};

Split split_text(const std::string& text, std::vector<bool> pinned = {}) {
  CompileOptions options;
  options.disabled_passes = {"fuse"};  // one step per node keeps step numbers readable
  auto graph = compile(parse(text), {}, options);
  pinned.resize(graph->plan().num_inputs, false);
  return {graph, split_plan(graph->plan(), pinned)};
}

// "C0-2 E3-4 C5-5": captured / eager parts with their step ranges.
std::string shape(const Segmentation& seg) {
  std::string out;
  for (const Part& p : seg.parts)
    out += (out.empty() ? "" : " ") + std::string(p.captured ? "C" : "E") + std::to_string(p.first) + "-" +
           std::to_string(p.last - 1);
  return out;
}

TEST(CudaGraphSegments, AllDeviceWorkIsOnePart) {
  auto s = split_text(
      "graph(%x: f32[8, 16]{16, 1}@cuda:0, %w: f32[16, 4]{4, 1}@cuda:0):\n"
      "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::sin(%x)\n"
      "  %m: f32[8, 4]{4, 1}@cuda:0 = aten::mm(%a, %w)\n"
      "  %r: f32[8, 4]{4, 1}@cuda:0 = aten::relu(%m)\n"
      "  return (%r)\n");
  EXPECT_EQ(shape(s.seg), "C0-2");
  EXPECT_EQ(s.seg.device, 0);
  const Part& p = s.seg.parts[0];
  EXPECT_EQ(p.inputs.size(), 2u);   // x, w
  EXPECT_EQ(p.exports.size(), 1u);  // r
}

TEST(CudaGraphSegments, ItemInTheMiddleSplitsThePlan) {
  // .item() syncs; the multiply reads its host value, which differs per call: both run eagerly, the
  // device work around them is captured.
  auto s = split_text(
      "graph(%x: f32[8, 16]{16, 1}@cuda:0):\n"
      "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::exp(%x)\n"
      "  %s: f32[]{}@cuda:0 = aten::sum(%a)\n"
      "  %v: float = aten::_local_scalar_dense(%s)\n"
      "  %m: f32[8, 16]{16, 1}@cuda:0 = aten::mul.Scalar(%a, %v)\n"
      "  %r: f32[8, 16]{16, 1}@cuda:0 = aten::relu(%m)\n"
      "  return (%r, %v)\n");
  EXPECT_EQ(shape(s.seg), "C0-1 E2-3 C4-4");
  EXPECT_NE(s.seg.parts[1].why.find("aten::_local_scalar_dense"), std::string::npos) << s.seg.parts[1].why;
  EXPECT_NE(s.seg.parts[1].why.find("host sync"), std::string::npos) << s.seg.parts[1].why;
  // The first part leaves %a and %s (read by the eager steps) behind; the last reads %m from the eager step.
  EXPECT_EQ(s.seg.parts[0].exports.size(), 2u);
  EXPECT_EQ(s.seg.parts[2].inputs.size(), 1u);
}

TEST(CudaGraphSegments, HostValuesNothingReadsDoNotSplit) {
  // cuDNN attention returns its sequence lengths as host ints: unread, the step is captured with the rest;
  // read by a later step, it splits the plan as any host value does.
  auto attention = [](const std::string& tail) {
    return "graph(%q: f16[2, 4, 8, 16]{512, 128, 16, 1}@cuda:0):\n"
           "  %a: f16[2, 4, 8, 16]{512, 128, 16, 1}@cuda:0 = aten::sin(%q)\n"
           "  %o: f16[2, 4, 8, 16]{512, 128, 16, 1}@cuda:0, %l: f32[2, 4, 8]{32, 8, 1}@cuda:0, "
           "%c1: i64[0]{1}@cuda:0, %c2: i64[0]{1}@cuda:0, %mq: int, %mk: int, %ps: i64[]{}@cuda:0, "
           "%po: i64[]{}@cuda:0, %dm: f16[0]{1}@cuda:0 = "
           "aten::_scaled_dot_product_cudnn_attention(%a, %a, %a, None, false, 0.0, true, false)\n" +
           tail;
  };
  auto unread = split_text(attention("  %r: f16[2, 4, 8, 16]{512, 128, 16, 1}@cuda:0 = aten::relu(%o)\n"
                                     "  return (%r)\n"));
  EXPECT_EQ(shape(unread.seg), "C0-2") << unread.seg.describe();
  auto read = split_text(attention("  %r: f16[2, 4, 8, 16]{512, 128, 16, 1}@cuda:0 = aten::mul.Scalar(%o, %mq)\n"
                                   "  return (%r)\n"));
  EXPECT_NE(shape(read.seg), "C0-2") << read.seg.describe();
  EXPECT_NE(read.seg.describe().find("returns a host value"), std::string::npos) << read.seg.describe();
}

TEST(CudaGraphSegments, DataDependentShapesStayEagerUntilShapesAreStaticAgain) {
  auto s = split_text(
      "graph(%x: f32[64]{1}@cuda:0):\n"
      "  %g: b8[64]{1}@cuda:0 = aten::gt.Scalar(%x, 0)\n"
      "  %i: i64[u0, 1]{1, 1}@cuda:0 = aten::nonzero(%g)\n"
      "  %f: f32[u0, 1]{1, 1}@cuda:0 = aten::_to_copy(%i, dtype=f32)\n"
      "  %s: f32[]{}@cuda:0 = aten::sum(%f)\n"
      "  %r: f32[64]{1}@cuda:0 = aten::add.Tensor(%x, %s)\n"
      "  return (%r)\n");
  EXPECT_EQ(shape(s.seg), "C0-0 E1-3 C4-4");
  EXPECT_NE(s.seg.parts[1].why.find("aten::nonzero"), std::string::npos) << s.seg.parts[1].why;
  // The steps after nonzero run eagerly because their shapes come from data.
  auto after = split_text(
      "graph(%i: i64[u0, 1]{1, 1}@cuda:0):\n"
      "  %f: f32[u0, 1]{1, 1}@cuda:0 = aten::_to_copy(%i, dtype=f32)\n"
      "  return (%f)\n");
  EXPECT_EQ(shape(after.seg), "E0-0");
  EXPECT_NE(after.seg.why_none.find("shape comes from data"), std::string::npos) << after.seg.why_none;
}

TEST(CudaGraphSegments, CpuTensorsRunEagerly) {
  auto s = split_text(
      "graph(%x: f32[8]{1}@cuda:0, %c: f32[8]{1}@cpu):\n"
      "  %a: f32[8]{1}@cuda:0 = aten::cos(%x)\n"
      "  %b: f32[8]{1}@cpu = aten::sin(%c)\n"
      "  %d: f32[8]{1}@cuda:0 = aten::_to_copy(%b, device=cuda:0)\n"
      "  %e: f32[8]{1}@cuda:0 = aten::add.Tensor(%a, %d)\n"
      "  return (%e)\n");
  EXPECT_EQ(shape(s.seg), "C0-0 E1-2 C3-3");
  EXPECT_NE(s.seg.parts[1].why.find("on cpu"), std::string::npos) << s.seg.parts[1].why;
}

TEST(CudaGraphSegments, InPlaceWritesOnlyIntoPinnedMemory) {
  const std::string text =
      "graph(%x: f32[8]{1}@cuda:0, %stat: f32[8]{1}@cuda:0):\n"
      "  %a: f32[8]{1}@cuda:0 = aten::exp(%x)\n"
      "  %s: f32[8]{1}@cuda:0 = aten::add_.Tensor(%stat, %a)\n"
      "  %r: f32[8]{1}@cuda:0 = aten::mul.Tensor(%a, %a)\n"
      "  return (%r)\n";
  // A running statistic (a buffer: pinned) is updated inside the graph...
  EXPECT_EQ(shape(split_text(text, {false, true}).seg), "C0-2");
  // ...but an input the runner copies is not the caller's memory: writing it runs eagerly.
  auto s = split_text(text, {false, false});
  EXPECT_EQ(shape(s.seg), "C0-0 E1-1 C2-2");
  EXPECT_NE(s.seg.parts[1].why.find("in place"), std::string::npos) << s.seg.parts[1].why;
}

TEST(CudaGraphSegments, NothingOnTheDeviceMeansNothingCaptured) {
  auto cpu = split_text(
      "graph(%x: f32[8]{1}@cpu):\n"
      "  %a: f32[8]{1}@cpu = aten::exp(%x)\n"
      "  return (%a)\n");
  EXPECT_EQ(cpu.seg.captured_parts(), 0u);
  EXPECT_EQ(cpu.seg.device, -1);
  EXPECT_FALSE(cpu.seg.why_none.empty());
  // Views alone do no device work: not worth a graph.
  auto views = split_text(
      "graph(%x: f32[8, 2]{2, 1}@cuda:0):\n"
      "  %v: f32[16]{1}@cuda:0 = aten::view(%x, [16])\n"
      "  return (%v)\n");
  EXPECT_EQ(shape(views.seg), "E0-0");
  EXPECT_EQ(views.seg.captured_parts(), 0u);
}

TEST(CudaGraphSegments, DescribeNamesEveryPart) {
  auto s = split_text(
      "graph(%x: f32[8]{1}@cuda:0):\n"
      "  %s: f32[]{}@cuda:0 = aten::sum(%x)\n"
      "  %v: float = aten::_local_scalar_dense(%s)\n"
      "  return (%v)\n");
  std::string text = s.seg.describe();
  EXPECT_NE(text.find("steps 0-0: captured"), std::string::npos) << text;
  EXPECT_NE(text.find("steps 1-1: eager: step 1 aten::_local_scalar_dense"), std::string::npos) << text;
}

TEST(CudaGraphSegments, ControlFlowRunsBetweenCapturedParts) {
  // The cond's predicate is read on the host: its step runs eagerly, the work around it is captured.
  CompileOptions sub;
  sub.disabled_passes = {"fuse"};
  const char* branch =
      "graph(%a: f32[8, 16]{16, 1}@cuda:0):\n"
      "  %y: f32[8, 16]{16, 1}@cuda:0 = aten::sin(%a)\n"
      "  return (%y)\n";
  CompileOptions options;
  options.disabled_passes = {"fuse"};
  options.subgraphs = {{"t", compile(parse(branch), {}, sub)}, {"f", compile(parse(branch), {}, sub)}};
  auto graph = compile(parse("graph(%x: f32[8, 16]{16, 1}@cuda:0):\n"
                             "  %a: f32[8, 16]{16, 1}@cuda:0 = aten::exp(%x)\n"
                             "  %s: f32[]{}@cuda:0 = aten::sum(%a)\n"
                             "  %p: b8[]{}@cuda:0 = aten::gt.Scalar(%s, 1)\n"
                             "  %c: f32[8, 16]{16, 1}@cuda:0 = ember::cond(%p, \"t\", \"f\", [%a])\n"
                             "  %r: f32[8, 16]{16, 1}@cuda:0 = aten::relu(%c)\n"
                             "  return (%r)\n"),
                       {}, options);
  Segmentation seg = split_plan(graph->plan(), std::vector<bool>(1, false));
  EXPECT_EQ(shape(seg), "C0-2 E3-3 C4-4");
  EXPECT_NE(seg.parts[1].why.find("control flow (cond)"), std::string::npos) << seg.parts[1].why;
}

}  // namespace
}  // namespace ember::cudagraph

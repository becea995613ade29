// The IR text form: exact round trips, every literal kind, clear parse errors.
#include "ember/error.h"
#include "ember/ir.h"

#include <gtest/gtest.h>

namespace ember {
namespace {

void expect_roundtrip(const std::string& text) {
  Graph g = parse(text);
  EXPECT_EQ(print(g), text);
  EXPECT_EQ(print(parse(print(g))), text);
}

TEST(IrText, RoundTripsEveryArgumentKind) {
  expect_roundtrip(
      "graph(%x: f32[s0, 8]{8, 1}@cpu, %s0: int, %w: bf16[8]{1}@cuda:0):\n"
      "  %y: f32[s0, 8]{8, 1}@cpu = aten::add.Tensor(%x, 1.0, alpha=2)\n"
      "  %z: f32[s0, 8]{8, 1}@cpu = aten::_to_copy(%y, dtype=f32, layout=strided, device=cpu, pin_memory=false, "
      "memory_format=preserve_format)\n"
      "  %v: f32[8, s0]{1, 8}@cpu = aten::view(%z, [8, %s0])\n"
      "  %m: f32[s0]{1}@cpu, %i: i64[s0]{1}@cpu = aten::max.dim(%y, 1)\n"
      "  %g: f32[s0, 8]{8, 1}@cpu = aten::gelu(%y, approximate=\"tanh\")\n"
      "  %e: f32[s0, 8]{8, 1}@cpu = aten::clamp(%g, -inf, nan)\n"
      "  %n: int = prim::mul(%s0, 2)\n"
      "  %c: f32[]{}@cpu = prim::constant(\"_tensor_constant0\")\n"
      "  aten::_assert_scalar(true, \"msg with \\\"quotes\\\"\")\n"
      "  return (%y, %m, %n, None, 3, 2.5e-07)\n");
}

TEST(IrText, OpaqueObjectsPassThrough) {
  // A DTensor's DeviceMesh, carried from an input to the outputs beside the local tensor.
  expect_roundtrip(
      "graph(%x: f32[4]{1}@cpu, %mesh: object):\n"
      "  %y: f32[4]{1}@cpu = aten::sin(%x)\n"
      "  return (%y, %mesh, %mesh)\n");
}

TEST(IrText, SymbolicDimsKeepTheirExpression) {
  const std::string text =
      "graph(%x: f16[2*s0, ((s1-1)//2)+1, Max(1,s2)]{s1*s2, s2, 1}@cpu):\n"
      "  return (%x)\n";
  Graph g = parse(text);
  const TensorType& t = g.inputs()[0]->type.tensor;
  ASSERT_EQ(t.sizes.size(), 3u);
  EXPECT_EQ(t.sizes[0].expr, "2*s0");
  EXPECT_EQ(t.sizes[1].expr, "((s1-1)//2)+1");
  EXPECT_EQ(t.sizes[2].expr, "Max(1,s2)");
  EXPECT_TRUE(t.strides[2].is_constant());
  EXPECT_EQ(print(g), text);
}

TEST(IrText, FloatsPrintShortestAndStayFloats) {
  expect_roundtrip("graph():\n  return (1.0, 0.1, 1e-05, 1e+300, -0.0, 3)\n");
  Graph g = parse("graph():\n  return (1.0, 1)\n");
  EXPECT_EQ(g.outputs()[0].kind, Arg::Kind::Float);
  EXPECT_EQ(g.outputs()[1].kind, Arg::Kind::Int);
}

TEST(IrText, NodesWithoutOutputsAndEmptyLists) {
  expect_roundtrip(
      "graph(%x: i64[0]{1}@cpu):\n"
      "  aten::_foreach_zero_([%x])\n"
      "  %s: i64[]{}@cpu = aten::sum(%x, dtype=None)\n"
      "  return ()\n");
}

TEST(IrText, ParseErrorsNameTheLine) {
  auto expect_error = [](const std::string& text, const std::string& fragment) {
    try {
      parse(text);
      FAIL() << "expected a parse error for: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::sin(%z)\n  return (%y)\n", "line 2");
  expect_error("graph(%x: q99[2]{1}@cpu):\n  return (%x)\n", "unknown dtype");
  expect_error("graph(%x: f32[2]{1}@cpu):\n  %x: f32[2]{1}@cpu = aten::sin(%x)\n  return (%x)\n", "twice");
  expect_error("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::sin(%x)\n", "return");
  expect_error("graph(%x: f32[2]{1}@cpu):\n  return (%x) junk\n", "after 'return'");
  expect_error("graph(%x: f32[2]{1}@nowhere):\n  return (%x)\n", "unknown literal");
  expect_error("graph(%x: f32[4]{}@cpu):\n  return (%x)\n", "1 sizes and 0 strides");
  expect_error("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2, 3]{3}@cpu = aten::sin(%x)\n  return (%y)\n", "2 sizes and 1 strides");
  expect_error("graph(", "line 1");
  expect_error("", "expected 'graph'");
}

}  // namespace
}  // namespace ember

// Runtime tests: graphs built in C++ or from IR text, compiled and run through the Plan, compared with
// ATen on fresh random inputs (odd sizes, non-contiguous, broadcast, empty).
#include "backend/runtime/size_buckets.h"
#include "ember/compiler.h"
#include "ember/error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace ember {
namespace {

// Fusion is off here: these tests check the node-by-node runtime (fusion has its own tests).
std::shared_ptr<CompiledGraph> compile_text(const std::string& text,
                                            const std::unordered_map<std::string, at::Tensor>& constants = {}) {
  CompileOptions options;
  options.disabled_passes = {"fuse"};
  return compile(parse(text), constants, options);
}

at::Tensor t(const c10::IValue& v) { return v.toTensor(); }

TensorType tensor_type(const at::Tensor& x) {
  TensorType tt;
  tt.dtype = x.scalar_type();
  for (int64_t s : x.sizes()) tt.sizes.push_back(Dim::constant(s));
  for (int64_t s : x.strides()) tt.strides.push_back(Dim::constant(s));
  tt.device = x.device();
  return tt;
}

TEST(Runtime, GraphBuiltInCppMatchesAten) {
  at::Tensor x = at::randn({7, 13}), w = at::randn({13, 5}), b = at::randn({5});
  Graph g;
  Value* vx = g.add_input("x", Type::of_tensor(tensor_type(x)));
  Value* vw = g.add_input("w", Type::of_tensor(tensor_type(w)));
  Value* vb = g.add_input("b", Type::of_tensor(tensor_type(b)));
  at::Tensor mm = at::addmm(b, x, w);
  Node* n1 = g.add_node("aten::addmm", {Arg::of(vb), Arg::of(vx), Arg::of(vw)}, {},
                        {{"mm", Type::of_tensor(tensor_type(mm))}});
  Node* n2 = g.add_node("aten::relu", {Arg::of(n1->outputs[0])}, {}, {{"r", Type::of_tensor(tensor_type(mm))}});
  g.set_outputs({Arg::of(n2->outputs[0])});
  auto compiled = compile(std::move(g), {}, CompileOptions{});
  auto out = compiled->run({x, w, b});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(at::allclose(t(out[0]), at::relu(mm), 1e-5, 1e-5));
}

// Every node is checked against its op's schema before any pass reads it: the fuse pass read a missing second
// operand of an add and crashed (a damaged or hand-written graph; lowering never writes one).
TEST(Runtime, ArgumentsAreCheckedAgainstTheSchemaBeforeThePasses) {
  auto expect_error = [](const std::string& body, const std::string& fragment) {
    const std::string text = "graph(%x: f32[4]{1}@cpu):\n" + body + "  return (%z)\n";
    try {
      compile(parse(text), {}, CompileOptions{});  // every pass on, fuse included
      FAIL() << "expected an error for: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("  %y: f32[4]{1}@cpu = aten::add.Tensor(%x)\n  %z: f32[4]{1}@cpu = aten::mul.Tensor(%y, %y)\n",
               "%y = aten::add.Tensor: missing argument 'other'");
  expect_error("  %z: f32[4]{1}@cpu = aten::neg(%x, %x)\n", "2 arguments, its schema has 1");
  expect_error("  %z: f32[4]{1}@cpu = aten::add.Tensor(%x, %x, other=%x)\n", "argument 'other' given twice");
  expect_error("  %z: f32[4]{1}@cpu = aten::add.Tensor(%x, %x, beta=2)\n", "no argument 'beta'");
  // Keywords and defaults that the schema has still compile.
  compile(parse("graph(%x: f32[4]{1}@cpu):\n  %z: f32[4]{1}@cpu = aten::add.Tensor(%x, other=%x)\n  return (%z)\n"), {},
          CompileOptions{});
}

TEST(Runtime, KeywordsDefaultsAndLiteralCoercion) {
  // keepdim comes from the schema default; an int literal feeds a float argument (leaky_relu slope).
  auto g = compile_text(
      "graph(%x: f32[6, 9]{9, 1}@cpu):\n"
      "  %s: f32[6]{1}@cpu = aten::sum.dim_IntList(%x, [1])\n"
      "  %k: f32[1, 9]{9, 1}@cpu = aten::sum.dim_IntList(%x, [0], keepdim=true)\n"
      "  %e: f32[6, 9]{9, 1}@cpu = aten::elu(%x, 1)\n"
      "  %c: f64[6, 9]{9, 1}@cpu = aten::_to_copy(%x, dtype=f64)\n"
      "  return (%s, %k, %e, %c)\n");
  at::Tensor x = at::randn({6, 9});
  auto out = g->run({x});
  EXPECT_TRUE(at::allclose(t(out[0]), x.sum(1)));
  EXPECT_TRUE(at::allclose(t(out[1]), x.sum(0, true)));
  EXPECT_TRUE(at::allclose(t(out[2]), at::elu(x, 1.0)));
  EXPECT_EQ(t(out[3]).scalar_type(), at::kDouble);
}

TEST(Runtime, MultipleOutputsListReturnsAndTensorLists) {
  auto g = compile_text(
      "graph(%x: f32[5, 8]{8, 1}@cpu, %w: f32[8]{1}@cpu, %b: f32[8]{1}@cpu):\n"
      "  %y: f32[5, 8]{8, 1}@cpu, %mean: f32[5, 1]{1, 1}@cpu, %rstd: f32[5, 1]{1, 1}@cpu = "
      "aten::native_layer_norm(%x, [8], %w, %b, 1e-05)\n"
      "  %p0: f32[5, 3]{8, 1}@cpu, %p1: f32[5, 5]{8, 1}@cpu = aten::split_with_sizes(%y, [3, 5], 1)\n"
      "  %c: f32[5, 8]{8, 1}@cpu = aten::cat([%p1, %p0], 1)\n"
      "  return (%c, %mean, %rstd)\n");
  at::Tensor x = at::randn({5, 8}), w = at::randn({8}), b = at::randn({8});
  auto out = g->run({x, w, b});
  auto [y, mean, rstd] = at::native_layer_norm(x, {8}, w, b, 1e-5);
  EXPECT_TRUE(at::allclose(t(out[0]), at::cat({y.narrow(1, 3, 5), y.narrow(1, 0, 3)}, 1), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(t(out[1]), mean));
  EXPECT_TRUE(at::allclose(t(out[2]), rstd));
}

TEST(Runtime, SymIntShapesFromSizeQueriesAndArithmetic) {
  auto g = compile_text(
      "graph(%x: f32[s0, 6]{6, 1}@cpu, %s0: int):\n"
      "  %n: int = aten::sym_size.int(%x, 0)\n"
      "  %m: int = prim::mul(%n, 3)\n"
      "  %h: int = prim::floordiv(%m, 2)\n"
      "  %v: f32[2*s0, 3]{3, 1}@cpu = aten::view(%x, [%h, -1])\n"
      "  %q: float = prim::truediv(%s0, 4)\n"
      "  return (%v, %h, %q)\n");
  for (int64_t n : {2, 4, 10}) {
    at::Tensor x = at::randn({n, 6});
    auto out = g->run({x, n});
    EXPECT_TRUE(at::equal(t(out[0]), x.view({n * 3 / 2, -1})));
    EXPECT_EQ(out[1].toInt(), n * 3 / 2);
    EXPECT_DOUBLE_EQ(out[2].toDouble(), n / 4.0);
  }
}

// pad_to_buckets' runtime half: the size padded up to a bucket before the plan runs, outputs sliced back. A softmax
// over the padded dim shows the padding (zeros up to the bucket); the relu rows and the size match the call's.
TEST(Runtime, SizeBucketsPadInputsAndSliceOutputs) {
  auto g = compile_text(
      "graph(%s0: int, %x: f32[s0, 5]{5, 1}@cpu):\n"
      "  %r: f32[s0, 5]{5, 1}@cpu = aten::relu(%x)\n"
      "  %p: f32[s0, 5]{5, 1}@cpu = aten::_softmax(%x, 0, false)\n"
      "  %m: f32[s0, 5]{5, 1}@cpu = aten::mul.Tensor(%r, %p)\n"
      "  return (%r, %s0, %m)\n");
  g->set_size_buckets(std::make_shared<SizeBuckets>(
      std::vector<int64_t>{4, 8}, std::vector<SizeBuckets::Symbol>{{"s0", 1, 0}},
      std::vector<SizeBuckets::Use>{{0, -1, 0}, {1, 0, 0}},
      std::vector<SizeBuckets::Use>{{0, 0, 0}, {1, -1, 0}, {2, 0, 0}}, 2, 3));
  for (int64_t n : {3, 4, 5, 8, 11}) {
    at::Tensor x = at::randn({n, 5});
    const int64_t bucket = n <= 4 ? 4 : n <= 8 ? 8 : n;
    auto out = g->run({n, x});
    ASSERT_EQ(t(out[0]).size(0), n);
    EXPECT_TRUE(at::equal(t(out[0]), at::relu(x)));
    EXPECT_EQ(out[1].toInt(), n);
    at::Tensor padded = at::cat({x, at::zeros({bucket - n, 5})});
    EXPECT_TRUE(at::allclose(t(out[2]), (at::relu(padded) * at::softmax(padded, 0)).narrow(0, 0, n)));
  }
  const auto calls = g->size_buckets()->calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0], (std::vector<std::pair<int64_t, uint64_t>>{{4, 2}, {8, 2}, {-1, 1}}));
  EXPECT_THROW(SizeBuckets({8, 4}, {{"s0", 1, 0}}, {}, {}, 2, 3), Error);          // not ascending
  EXPECT_THROW(SizeBuckets({4}, {{"s0", 1, 0}}, {{5, 0, 0}}, {}, 2, 3), Error);     // no input 5
}

TEST(Runtime, IndexWithOptionalTensorListAndIndexPut) {
  auto g = compile_text(
      "graph(%x: f32[6, 7]{7, 1}@cpu, %i: i64[4]{1}@cpu, %v: f32[4]{1}@cpu):\n"
      "  %a: f32[6, 4]{4, 1}@cpu = aten::index.Tensor(%x, [None, %i])\n"
      "  %p: f32[6, 7]{7, 1}@cpu = aten::index_put(%x, [%i, %i], %v, true)\n"
      "  return (%a, %p)\n");
  at::Tensor x = at::randn({6, 7}), i = at::randint(0, 6, {4}), v = at::randn({4});
  auto out = g->run({x, i, v});
  EXPECT_TRUE(at::equal(t(out[0]), x.index_select(1, i)));
  c10::List<std::optional<at::Tensor>> idx;
  idx.push_back(i);
  idx.push_back(i);
  EXPECT_TRUE(at::allclose(t(out[1]), at::index_put(x, idx, v, true)));
}

TEST(Runtime, NoneForANonOptionalTensorIsAnUndefinedTensor) {
  // FX passes None for a plain Tensor argument (attn_bias of the attention backwards); Python's argument
  // parser turns that into an undefined tensor, and the plan must bind the same.
  auto g = compile_text(
      "graph(%x: f32[3]{1}@cpu):\n"
      "  %y: f32[3]{1}@cpu = aten::add.Tensor(%x, None)\n"
      "  return (%y)\n");
  ASSERT_EQ(g->plan().steps.size(), 1u);
  const c10::IValue& bound = g->plan().steps[0].stack[1];
  ASSERT_TRUE(bound.isTensor());
  EXPECT_FALSE(bound.toTensor().defined());
}

TEST(Runtime, InputMutationAndNonContiguousInputs) {
  auto g = compile_text(
      "graph(%x: f32[5, 3]{1, 5}@cpu, %buf: f32[5, 3]{3, 1}@cpu):\n"
      "  %y: f32[5, 3]{3, 1}@cpu = aten::mul.Tensor(%x, %x)\n"
      "  %w: f32[5, 3]{3, 1}@cpu = aten::copy_(%buf, %y)\n"
      "  %z: f32[5, 3]{3, 1}@cpu = aten::add.Tensor(%y, 1)\n"
      "  return (%z)\n");
  at::Tensor x = at::randn({3, 5}).t();  // non-contiguous
  at::Tensor buf = at::zeros({5, 3});
  auto out = g->run({x, buf});
  EXPECT_TRUE(at::allclose(buf, x * x));
  EXPECT_TRUE(at::allclose(t(out[0]), x * x + 1));
}

// Views over statically shaped tensors take StaticView's fast path (geometry precomputed on a meta tensor);
// an input whose strides differ from the IR's takes the op's own path. Both must give ATen's views: same
// values, sizes, strides, storage offset and storage.
TEST(Runtime, StaticViewsMatchAtenAndFallBackOnOtherStrides) {
  const std::string text =
      "graph(%x: f32[4, 6, 5]{30, 5, 1}@cpu):\n"
      "  %p: f32[6, 4, 5]{5, 30, 1}@cpu = aten::permute(%x, [1, 0, 2])\n"
      "  %s: f32[4, 5]{30, 1}@cpu = aten::select.int(%p, 0, -2)\n"
      "  %l: f32[4, 3]{30, 1}@cpu = aten::slice.Tensor(%s, 1, 1, 4)\n"
      "  %u: f32[4, 1, 3]{30, 3, 1}@cpu = aten::unsqueeze(%l, 1)\n"
      "  %e: f32[4, 7, 3]{30, 0, 1}@cpu = aten::expand(%u, [4, 7, 3])\n"
      "  %v: f32[24, 5]{5, 1}@cpu = aten::view(%x, [24, 5])\n"
      "  %t: f32[5, 24]{1, 5}@cpu = aten::t(%v)\n"
      "  return (%e, %t)\n";
  auto g = compile_text(text);
  auto reference = [](const at::Tensor& x) {
    return std::vector<at::Tensor>{x.permute({1, 0, 2}).select(0, -2).slice(1, 1, 4).unsqueeze(1).expand({4, 7, 3}),
                                   x.view({24, 5}).t()};
  };
  at::Tensor base = at::randn({40, 6, 5});
  at::Tensor other = at::randn({5, 6, 4}).permute({2, 1, 0});  // same sizes, other strides: the op's path
  for (const at::Tensor& x : {base.narrow(0, 3, 4), other}) {
    bool viewable = x.is_contiguous();
    std::vector<c10::IValue> outs;
    if (viewable) {
      outs = g->run({x});
    } else {
      // view() on these strides is an error in ATen; the plan must report it the same way, not build a view.
      EXPECT_THROW(g->run({x}), std::exception);
      continue;
    }
    std::vector<at::Tensor> ref = reference(x);
    for (size_t i = 0; i < ref.size(); ++i) {
      at::Tensor o = t(outs[i]);
      EXPECT_TRUE(at::equal(o, ref[i])) << i;
      EXPECT_EQ(o.sizes(), ref[i].sizes()) << i;
      EXPECT_EQ(o.strides(), ref[i].strides()) << i;
      EXPECT_EQ(o.storage_offset(), ref[i].storage_offset()) << i;
      EXPECT_TRUE(o.is_alias_of(x)) << i;
    }
  }
  // Other strides where every op is still a valid view: permute/select/slice of a transposed input.
  const std::string strided =
      "graph(%x: f32[4, 6, 5]{30, 5, 1}@cpu):\n"
      "  %p: f32[6, 4, 5]{5, 30, 1}@cpu = aten::permute(%x, [1, 0, 2])\n"
      "  %s: f32[4, 5]{30, 1}@cpu = aten::select.int(%p, 0, 2)\n"
      "  return (%s)\n";
  auto h = compile_text(strided);
  at::Tensor y = at::randn({5, 6, 4}).permute({2, 1, 0});
  at::Tensor o = t(h->run({y})[0]), ref = y.permute({1, 0, 2}).select(0, 2);
  EXPECT_TRUE(at::equal(o, ref));
  EXPECT_EQ(o.strides(), ref.strides());
  EXPECT_EQ(o.storage_offset(), ref.storage_offset());
}

// as_strided's storage offset is the view's own, not added to its input's (every other view is placed
// relative to its input): on an input that is itself a view at an offset, and on one at offset 0. Without
// an offset, as_strided keeps the input's.
TEST(Runtime, StaticAsStridedOffsetsAreAbsolute) {
  const std::string text =
      "graph(%x: f32[4, 5]{5, 1}@cpu):\n"
      "  %a: f32[2, 3]{3, 1}@cpu = aten::as_strided(%x, [2, 3], [3, 1], 2)\n"
      "  %b: f32[3, 2]{1, 3}@cpu = aten::as_strided(%a, [3, 2], [1, 3], 1)\n"
      "  %c: f32[2, 2]{5, 1}@cpu = aten::as_strided(%x, [2, 2], [5, 1])\n"
      "  %s: f32[3, 5]{5, 1}@cpu = aten::slice.Tensor(%x, 0, 1, 4)\n"
      "  %d: f32[4]{1}@cpu = aten::as_strided(%s, [4], [1], 3)\n"
      "  return (%a, %b, %c, %d)\n";
  auto g = compile_text(text);
  at::Tensor base = at::randn({40, 5});
  for (const at::Tensor& x : {base.narrow(0, 7, 4), at::randn({4, 5})}) {
    std::vector<at::Tensor> ref = {x.as_strided({2, 3}, {3, 1}, 2), x.as_strided({2, 3}, {3, 1}, 2).as_strided({3, 2}, {1, 3}, 1),
                                   x.as_strided({2, 2}, {5, 1}), x.slice(0, 1, 4).as_strided({4}, {1}, 3)};
    auto outs = g->run({x});
    for (size_t i = 0; i < ref.size(); ++i) {
      at::Tensor o = t(outs[i]);
      EXPECT_TRUE(at::equal(o, ref[i])) << i;
      EXPECT_EQ(o.storage_offset(), ref[i].storage_offset()) << i;
      EXPECT_EQ(o.strides(), ref[i].strides()) << i;
    }
  }
  // An offset past the end of the input's storage is ATen's error, never a read out of bounds.
  auto past = compile_text(
      "graph(%x: f32[4, 5]{5, 1}@cpu):\n"
      "  %a: f32[4, 5]{5, 1}@cpu = aten::as_strided(%x, [4, 5], [5, 1], 3)\n"
      "  return (%a)\n");
  EXPECT_THROW(past->run({at::randn({4, 5})}), std::exception);
  at::Tensor roomy = at::randn({30});
  at::Tensor x = roomy.narrow(0, 0, 20).view({4, 5});
  EXPECT_TRUE(at::equal(t(past->run({x})[0]), x.as_strided({4, 5}, {5, 1}, 3)));
}

TEST(Runtime, TypePromotionBroadcastAndEmpty) {
  auto g = compile_text(
      "graph(%a: i32[4, 1]{1, 1}@cpu, %b: f16[5]{1}@cpu, %m: b8[4, 5]{5, 1}@cpu, %e: f32[0, 3]{3, 1}@cpu):\n"
      "  %s: f16[4, 5]{5, 1}@cpu = aten::add.Tensor(%a, %b)\n"
      "  %w: f16[4, 5]{5, 1}@cpu = aten::where.self(%m, %s, %b)\n"
      "  %z: f32[0, 3]{3, 1}@cpu = aten::exp(%e)\n"
      "  %r: f32[3]{1}@cpu = aten::sum.dim_IntList(%e, [0])\n"
      "  return (%w, %z, %r)\n");
  at::Tensor a = at::randint(-5, 5, {4, 1}, at::kInt), b = at::randn({5}, at::kHalf);
  at::Tensor m = at::rand({4, 5}) > 0.5, e = at::randn({0, 3});
  auto out = g->run({a, b, m, e});
  EXPECT_EQ(t(out[0]).scalar_type(), at::kHalf);
  EXPECT_TRUE(at::allclose(t(out[0]).to(at::kFloat), at::where(m, a + b, b).to(at::kFloat), 1e-3, 1e-3));
  EXPECT_EQ(t(out[1]).numel(), 0);
  EXPECT_TRUE(at::equal(t(out[2]), at::zeros({3})));
}

TEST(Runtime, ConstantsLiteralOutputsAndPassThroughInputs) {
  at::Tensor c = at::randn({3});
  auto g = compile_text(
      "graph(%x: f32[3]{1}@cpu):\n"
      "  %c: f32[3]{1}@cpu = prim::constant(\"weight\")\n"
      "  %y: f32[3]{1}@cpu = aten::mul.Tensor(%x, %c)\n"
      "  return (%y, None, 7, %x, %x)\n",
      {{"weight", c}});
  at::Tensor x = at::randn({3});
  auto out = g->run({x});
  EXPECT_TRUE(at::allclose(t(out[0]), x * c));
  EXPECT_TRUE(out[1].isNone());
  EXPECT_EQ(out[2].toInt(), 7);
  EXPECT_TRUE(t(out[3]).is_same(x));
  EXPECT_TRUE(t(out[4]).is_same(x));
}

// An opaque object (a DTensor's DeviceMesh; Python hands it in as a PyObject IValue, here a string stands in)
// goes from its input to the outputs untouched; a node reading one is refused when the plan is built.
TEST(Runtime, OpaqueObjectsPassThroughAndNoOpReadsThem) {
  auto g = compile_text(
      "graph(%x: f32[3]{1}@cpu, %mesh: object):\n"
      "  %y: f32[3]{1}@cpu = aten::sin(%x)\n"
      "  return (%y, %mesh, %mesh)\n");
  at::Tensor x = at::randn({3});
  auto out = g->run({x, c10::IValue(std::string("mesh"))});
  EXPECT_TRUE(at::allclose(t(out[0]), x.sin()));
  EXPECT_EQ(out[1].toStringRef(), "mesh");
  EXPECT_EQ(out[2].toStringRef(), "mesh");
  try {
    compile_text(
        "graph(%x: f32[3]{1}@cpu, %mesh: object):\n"
        "  %y: f32[3]{1}@cpu = aten::add.Tensor(%x, %mesh)\n"
        "  return (%y)\n");
    FAIL() << "expected the plan to refuse a node reading an object";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("opaque object"), std::string::npos) << e.what();
  }
}

TEST(Runtime, BuffersAreReleasedAfterTheirLastUse) {
  auto g = compile_text(
      "graph(%x: f32[64]{1}@cpu):\n"
      "  %a: f32[64]{1}@cpu = aten::sin(%x)\n"
      "  %b: f32[64]{1}@cpu = aten::cos(%a)\n"
      "  %c: f32[64]{1}@cpu = aten::exp(%b)\n"
      "  return (%c)\n");
  // Each step frees what it read last: x after sin, a after cos, b after exp.
  const Plan& plan = g->plan();
  ASSERT_EQ(plan.steps.size(), 3u);
  for (const Step& s : plan.steps) EXPECT_EQ(s.frees.size(), 1u);
  // An input handed over by move is gone once the plan no longer needs it.
  at::Tensor x = at::randn({64});
  c10::weak_intrusive_ptr<c10::TensorImpl> weak(x.getIntrusivePtr());
  std::vector<c10::IValue> in;
  in.emplace_back(std::move(x));
  auto out = g->run(std::move(in));
  EXPECT_TRUE(weak.expired());
  EXPECT_EQ(out.size(), 1u);
}

// A CPU add/sub/mul/div whose operand dies at that step writes into it (plan.cpp, point 5): only where that
// operand is a step's result of the result's dtype and sizes and, per call, no one else holds it or its storage.
TEST(Runtime, DyingOperandsTakeTheResultInPlace) {
  auto g = compile_text(
      "graph(%x: f32[5, 7]{7, 1}@cpu, %y: f32[7]{1}@cpu, %z: f64[5, 7]{7, 1}@cpu, %y5: f32[7, 5]{5, 1}@cpu):\n"
      "  %a: f32[5, 7]{7, 1}@cpu = aten::exp(%x)\n"
      "  %b: f32[5, 7]{7, 1}@cpu = aten::add.Tensor(%a, %y, alpha=2)\n"        // a dies: in place, y broadcast
      "  %c: f32[5, 7]{7, 1}@cpu = aten::sin(%x)\n"
      "  %v: f32[35]{1}@cpu = aten::view(%c, [35])\n"
      "  %d: f32[5, 7]{7, 1}@cpu = aten::mul.Tensor(%c, %b)\n"                  // c dies, but v shares its storage
      "  %e: f32[5, 7]{7, 1}@cpu = aten::cos(%x)\n"
      "  %f: f32[5, 7]{7, 1}@cpu = aten::sub.Tensor(%x, %e)\n"                  // e dies, second: sub does not swap
      "  %h: f32[5, 7]{7, 1}@cpu = aten::tanh(%x)\n"
      "  %k: f32[5, 7]{7, 1}@cpu = aten::mul.Tensor(%f, %h)\n"                  // f dies: in place
      "  %m: f32[5, 7]{7, 1}@cpu = aten::div.Tensor(%d, %k)\n"                  // d dies: in place
      "  %n: f32[5, 7]{7, 1}@cpu = aten::neg(%x)\n"
      "  %p: f64[5, 7]{7, 1}@cpu = aten::add.Tensor(%n, %z)\n"                  // promoted to f64: not in place
      "  %q: f32[5, 7]{7, 1}@cpu = aten::sigmoid(%x)\n"
      "  %u: f32[7, 5]{1, 7}@cpu = aten::permute(%q, [1, 0])\n"
      "  %w: f32[7, 5]{5, 1}@cpu = aten::mul.Tensor(%y5, %u)\n"                 // u dies, but its strides differ
      "  return (%m, %v, %p, %w)\n");
  const std::string listing = g->describe();
  size_t in_place = 0;
  for (size_t at = listing.find(" in place"); at != std::string::npos; at = listing.find(" in place", at + 1)) ++in_place;
  EXPECT_EQ(in_place, 4u) << listing;  // add, mul (c: refused per call), mul (f), div
  EXPECT_EQ(listing.find("sub.Tensor in place"), std::string::npos) << listing;
  for (int call = 0; call < 2; ++call) {
    at::Tensor x = at::randn({5, 7}), y = at::randn({7}), z = at::randn({5, 7}, at::kDouble), y5 = at::randn({7, 5});
    auto out = g->run({x, y, z, y5});
    at::Tensor b = x.exp() + 2 * y, d = x.sin() * b, k = (x - x.cos()) * x.tanh();
    EXPECT_TRUE(at::allclose(t(out[0]), d / k, 1e-5, 1e-5));
    EXPECT_TRUE(at::equal(t(out[1]), x.sin().view({35})));  // the view kept c from being written
    EXPECT_EQ(t(out[2]).scalar_type(), at::kDouble);
    EXPECT_TRUE(at::allclose(t(out[2]), -x.to(at::kDouble) + z));
    at::Tensor w = y5 * x.sigmoid().t();  // eager's layout: row-major (the first operand's), as the IR says
    EXPECT_TRUE(at::allclose(t(out[3]), w));
    EXPECT_EQ(t(out[3]).strides(), w.strides());
  }
}

TEST(Runtime, ClearErrorsForBadGraphsAndInputs) {
  EXPECT_THROW(compile_text("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::no_such_op(%x)\n  return (%y)\n"),
               Error);
  EXPECT_THROW(compile_text("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::sin(%x, %x)\n  return (%y)\n"),
               Error);
  EXPECT_THROW(
      compile_text("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::add.Tensor(%x, %x, beta=1)\n  return (%y)\n"),
      Error);
  EXPECT_THROW(compile_text("graph():\n  %c: f32[2]{1}@cpu = prim::constant(\"missing\")\n  return (%c)\n"), Error);
  auto g = compile_text("graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::sin(%x)\n  return (%y)\n");
  EXPECT_THROW(g->run({}), Error);
  // A kernel error names the node that raised it.
  auto bad = compile_text(
      "graph(%x: f32[2, 3]{3, 1}@cpu, %y: f32[4, 5]{5, 1}@cpu):\n"
      "  %z: f32[2, 5]{5, 1}@cpu = aten::mm(%x, %y)\n"
      "  return (%z)\n");
  try {
    bad->run({at::randn({2, 3}), at::randn({4, 5})});
    FAIL() << "expected a shape error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("%z = aten::mm"), std::string::npos) << e.what();
  }
}

// torch.cond / while_loop / scan: subgraphs compiled first, named by the control flow node (with fusion on,
// as the backend compiles them), run by its kernel step on each call's values.
std::shared_ptr<CompiledGraph> compile_with(const std::string& text, const Subgraphs& subgraphs) {
  CompileOptions options;
  options.subgraphs = subgraphs;
  return compile(parse(text), {}, options);
}

TEST(Runtime, CondRunsTheBranchItsPredicatePicks) {
  Subgraphs subs = {
      {"t", compile_with("graph(%a: f32[5, 7]{7, 1}@cpu, %b: f32[7]{1}@cpu):\n"
                         "  %s: f32[5, 7]{7, 1}@cpu = aten::sin(%a)\n"
                         "  %y: f32[5, 7]{7, 1}@cpu = aten::add.Tensor(%s, %b)\n"
                         "  return (%y)\n", {})},
      {"f", compile_with("graph(%a: f32[5, 7]{7, 1}@cpu, %b: f32[7]{1}@cpu):\n"
                         "  %y: f32[5, 7]{7, 1}@cpu = aten::mul.Tensor(%a, %b)\n"
                         "  return (%y)\n", {})}};
  auto g = compile_with(
      "graph(%x: f32[5, 7]{7, 1}@cpu, %b: f32[7]{1}@cpu):\n"
      "  %s: f32[]{}@cpu = aten::sum(%x)\n"
      "  %p: b8[]{}@cpu = aten::gt.Scalar(%s, 0)\n"
      "  %c: f32[5, 7]{7, 1}@cpu = ember::cond(%p, \"t\", \"f\", [%x, %b])\n"
      "  %r: f32[5, 7]{7, 1}@cpu = aten::mul.Tensor(%c, 2)\n"
      "  return (%r)\n",
      subs);
  for (double sign : {1.0, -1.0}) {
    at::Tensor x = (at::rand({5, 7}) + 0.1) * sign, b = at::randn({7});
    at::Tensor want = sign > 0 ? (x.sin() + b) * 2 : x * b * 2;
    EXPECT_TRUE(at::allclose(t(g->run({x, b})[0]), want, 1e-5, 1e-6)) << "sign " << sign;
  }
  // Without its subgraphs the node cannot run: a clear error at compile time, naming the op.
  try {
    compile_with("graph(%p: b8[]{}@cpu, %x: f32[3]{1}@cpu):\n"
                 "  %y: f32[3]{1}@cpu = ember::cond(%p, \"t\", \"f\", [%x])\n"
                 "  return (%y)\n", {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ember::cond runs only with the subgraphs"), std::string::npos) << e.what();
  }
}

TEST(Runtime, WhileLoopAndScanRunTheirBodiesOnTheHost) {
  Subgraphs loop = {
      {"c", compile_with("graph(%i: i64[]{}@cpu, %y: f32[4]{1}@cpu, %n: i64[]{}@cpu):\n"
                         "  %p: b8[]{}@cpu = aten::lt.Tensor(%i, %n)\n"
                         "  return (%p)\n", {})},
      {"b", compile_with("graph(%i: i64[]{}@cpu, %y: f32[4]{1}@cpu, %n: i64[]{}@cpu):\n"
                         "  %j: i64[]{}@cpu = aten::add.Tensor(%i, 1)\n"
                         "  %z: f32[4]{1}@cpu = aten::cos(%y)\n"
                         "  return (%j, %z)\n", {})}};
  auto w = compile_with(
      "graph(%i: i64[]{}@cpu, %y: f32[4]{1}@cpu, %n: i64[]{}@cpu):\n"
      "  %k: i64[]{}@cpu, %z: f32[4]{1}@cpu = ember::while_loop(\"c\", \"b\", [%i, %y], [%n])\n"
      "  return (%k, %z)\n",
      loop);
  at::Tensor y = at::randn({4});
  for (int64_t n : {0, 1, 5}) {
    auto out = w->run({at::zeros({}, at::kLong), y, at::full({}, n, at::kLong)});
    at::Tensor want = y;
    for (int64_t k = 0; k < n; ++k) want = want.cos();
    EXPECT_EQ(t(out[0]).item<int64_t>(), n);
    EXPECT_TRUE(at::allclose(t(out[1]), want, 1e-6, 1e-6)) << n << " steps";
  }

  Subgraphs combine = {{"f", compile_with("graph(%h: f32[3]{1}@cpu, %x: f32[3]{1}@cpu, %w: f32[3]{1}@cpu):\n"
                                          "  %m: f32[3]{1}@cpu = aten::mul.Tensor(%h, %w)\n"
                                          "  %n: f32[3]{1}@cpu = aten::add.Tensor(%m, %x)\n"
                                          "  %s: f32[]{}@cpu = aten::sum(%n)\n"
                                          "  return (%n, %s)\n", {})}};
  auto s = compile_with(
      "graph(%h: f32[3]{1}@cpu, %xs: f32[6, 3]{3, 1}@cpu, %w: f32[3]{1}@cpu):\n"
      "  %last: f32[3]{1}@cpu, %ys: f32[6]{1}@cpu = ember::scan(\"f\", [%h], [%xs], [%w])\n"
      "  return (%last, %ys)\n",
      combine);
  at::Tensor h = at::randn({3}), xs = at::randn({6, 3}), wv = at::randn({3});
  auto out = s->run({h, xs, wv});
  at::Tensor carry = h;
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < 6; ++i) {
    carry = carry * wv + xs[i];
    ys.push_back(carry.sum());
  }
  EXPECT_TRUE(at::allclose(t(out[0]), carry, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(t(out[1]), at::stack(ys), 1e-5, 1e-6));
}

TEST(Runtime, RandomOpsDrawFreshNumbersEachCall) {
  auto g = compile_text(
      "graph(%x: f32[1000]{1}@cpu):\n"
      "  %d: f32[1000]{1}@cpu, %mask: b8[1000]{1}@cpu = aten::native_dropout(%x, 0.25, true)\n"
      "  return (%d, %mask)\n");
  at::Tensor x = at::ones({1000});
  auto a = g->run({x});
  auto b = g->run({x});
  EXPECT_FALSE(at::equal(t(a[1]), t(b[1])));
  double kept = t(a[1]).to(at::kFloat).mean().item<double>();
  EXPECT_NEAR(kept, 0.75, 0.06);
  // Kept elements are scaled by 1 / (1 - p); the mask says which.
  EXPECT_TRUE(at::allclose(t(a[0]), t(a[1]).to(at::kFloat) / 0.75));
}

// A kernel still compiling (a deferred CUDA kernel: Kernel::compiling): its step runs the group's nodes as
// ATen steps instead (Step::stand_in), freeing the group's intermediates, until the kernel is ready. The
// kernel here writes zeros, so the results say which ran.
class CompilingKernel final : public Kernel {
 public:
  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    ++runs;
    buffers[writes[0]] = at::zeros_like(buffers[reads[0]].toTensor());
  }
  std::string describe() const override { return "compiling kernel"; }
  bool compiling() const override { return still_compiling; }
  bool still_compiling = true;
  mutable int runs = 0;
};

TEST(Runtime, KernelsStillCompilingRunTheirGroupsAtenOps) {
  const std::string text =
      "graph(%x: f32[s0, 6]{6, 1}@cpu, %s0: int):\n"
      "  %n: int = prim::mul(%s0, 6)\n"
      "  %a: f32[s0, 6]{6, 1}@cpu = aten::mul.Tensor(%x, 2.0) #0\n"
      "  %b: f32[s0, 6]{6, 1}@cpu = aten::exp(%a) #0\n"
      "  %v: f32[6*s0]{1}@cpu = aten::view(%b, [%n]) #0\n"
      "  %c: f32[6*s0]{1}@cpu = aten::neg(%v)\n"
      "  return (%c)\n";
  Graph g = parse(text);
  auto kernel = std::make_shared<CompilingKernel>();
  auto kernels_for = [&](const Graph& graph, std::vector<std::string> writes) {
    GroupKernel gk;
    gk.kernel = kernel;
    for (const Value* v : graph.inputs())
      if (v->name == "x") gk.reads.push_back(v);
    for (const auto& n : graph.nodes())
      for (const Value* v : n->outputs)
        if (std::find(writes.begin(), writes.end(), v->name) != writes.end()) gk.writes.push_back(v);
    return std::unordered_map<int, GroupKernel>{{0, gk}};
  };
  Plan plan = build_plan(g, {}, kernels_for(g, {"v"}));
  CompiledGraph run_it(std::move(g), std::move(plan));  // the graph's nodes keep their addresses
  const Graph& graph = run_it.graph();
  const Step* step = nullptr;
  for (const Step& s : run_it.plan().steps)
    if (s.kernel) step = &s;
  ASSERT_NE(step, nullptr);
  ASSERT_TRUE(step->stand_in);
  EXPECT_EQ(step->stand_in->size(), 3u);
  ASSERT_EQ(step->stand_in_reads.size(), 1u);  // %n, the view's size, which the kernel does not read
  at::Tensor x = at::randn({5, 6});
  std::vector<c10::IValue> buffers = run_it.start({x, int64_t{5}});
  run_it.execute(buffers, 0, run_it.plan().steps.size());
  EXPECT_TRUE(at::allclose(t(run_it.finish(buffers)[0]), -at::exp(x * 2).view({30})));
  EXPECT_EQ(kernel->runs, 0);
  size_t live = 0;
  for (const c10::IValue& b : buffers) live += b.isTensor();
  EXPECT_EQ(live, 1u);  // %c alone: %a and %b freed inside the stand-in, %x and %v after their last readers
  // Once compiled, the kernel runs.
  kernel->still_compiling = false;
  auto out = run_it.run({at::randn({5, 6}), int64_t{5}});
  EXPECT_EQ(kernel->runs, 1);
  EXPECT_EQ(t(out[0]).abs().sum().item<float>(), 0.f);

  // No stand-in where the kernel was ready when the plan was built, nor where the group's ATen ops would free
  // a value read outside it that the kernel does not write (%b, here read by %d).
  kernel->still_compiling = false;
  EXPECT_FALSE(build_plan(graph, {}, kernels_for(graph, {"v"})).steps[1].stand_in);
  kernel->still_compiling = true;
  Graph g2 = parse(
      "graph(%x: f32[4, 6]{6, 1}@cpu):\n"
      "  %a: f32[4, 6]{6, 1}@cpu = aten::mul.Tensor(%x, 2.0) #0\n"
      "  %b: f32[4, 6]{6, 1}@cpu = aten::exp(%a) #0\n"
      "  %d: f32[4, 6]{6, 1}@cpu = aten::add.Tensor(%b, %a)\n"
      "  return (%d)\n");
  for (const Step& s : build_plan(g2, {}, kernels_for(g2, {"a"})).steps)
    if (s.kernel) EXPECT_FALSE(s.stand_in);
}

}  // namespace
}  // namespace ember

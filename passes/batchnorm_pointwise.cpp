// batchnorm_pointwise ("bn_pointwise"): eval-mode batch norm on CUDA as pointwise ops the fuse pass can
// put in one kernel with what follows (ReLU, the residual add), as inductor does.
//  1. Why: ATen runs aten::_native_batch_norm_legit_no_training as its own kernel, a full pass over the
//     convolution's output; resnet50 b64 bf16 channels_last on the H100 ran at 1.12x eager in ember
//     against inductor's 1.67x, its batch norms, ReLUs and adds each a separate pass.
//  2. Rewrites y = bn(x, w, b, mean, var, eps) (its saved-statistics outputs unused) to
//        (x - mean) * rsqrt(var + eps) * w + b
//     with the per-channel tensors viewed as [C, 1, ..., 1] so they broadcast over dimension 1. 16-bit
//     inputs are computed in float32 and rounded once at the end, as ATen's kernel does (its result may
//     differ from eager's in the last bit: ATen folds the scale and shift first).
//  3. On CUDA, for static sizes and float tensors dense in some order (NCHW or channels_last), and for an [N, C]
//     input with N symbolic in rule 4's form (LeViT's norms after a Linear under dynamic shapes). On the CPU
//     for a float32 [N, C] input whose per-channel tensors stay put (rule 4): a norm after a Linear (LeViT's 60
//     per call ran as ATen calls, 0.67 ms of 7.5 on the 2-core host), where the multiply-add broadcast along
//     rows is the interpreter's fast case; and for channels_last ones (rule 5). Other CPU convolutions' norms
//     stay whole (fold_batchnorm folds f32 ones of inference graphs into the convolution).
//  4. Where the four per-channel tensors stay put between calls (constants, or inputs whose steps the
//     runtime caches: CompileOptions::cached_inputs, an inference graph's parameters and buffers), the
//     per-channel part becomes nodes of its own over [C]:
//        scale = w * rsqrt(var + eps)    shift = b - mean * scale    y = x * scale + shift
//     so it runs once (cached or folded), and each element costs one multiply-add and two per-channel
//     loads instead of the four loads, the rsqrt and four operations of the form above (resnet50 b64
//     bf16 on the H100: its 53 fused batch norms took 1544 us per call that way, inductor's ~1100).
//  5. On the CPU also for float32 [N, C, H, W] tensors of static sizes laid out channels_last, in rule 4's form
//     whether or not the per-channel tensors stay (then its [C] part runs per call, a few hundred values):
//     CPU training graphs run their convolutions so (python_bindings/ember/layout.py), and there the norm's
//     backward no longer reads the saved statistics (decompositions.py), so the forward's norm and its
//     ReLU become one pass over [N * H * W, C] rows, a per-channel multiply-add along each (timm
//     regnetx_002's training step on the 2-core host: 44 norms and 40 ReLUs, 1.3 ms of ATen calls).
#include "passes/passes.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

namespace ember {
namespace {

bool is_16bit(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

TensorType like(const TensorType& t, c10::ScalarType dtype) {
  TensorType r = t;
  r.dtype = dtype;
  return r;
}

}  // namespace

void batchnorm_pointwise(Graph& graph, PassContext& ctx) {
  // Values that stay put between calls: constants, and inputs whose steps the runtime caches.
  std::unordered_map<const Value*, bool> cached_input;
  const std::vector<bool>& cached = ctx.options.cached_inputs;
  for (size_t i = 0; i < graph.inputs().size() && i < cached.size(); ++i) cached_input[graph.inputs()[i]] = cached[i];
  auto stays = [&](const Value* v) {
    if (v->producer) return v->producer->op == "prim::constant";
    auto it = cached_input.find(v);
    return it != cached_input.end() && it->second;
  };
  std::unordered_map<const Value*, int> uses;
  for (const auto& n : graph.nodes()) n->for_each_input([&](const Value* v) { ++uses[v]; });
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { ++uses[v]; });
  std::vector<Node*> norms;
  for (const auto& n : graph.nodes())
    if (n->op == "aten::_native_batch_norm_legit_no_training" && n->group < 0 && n->outputs.size() == 3 &&
        n->args.size() == 7 && n->kwargs.empty())
      norms.push_back(n.get());
  int fresh = 0;
  for (Node* bn : norms) {
    if (uses[bn->outputs[1]] || uses[bn->outputs[2]]) continue;
    Value* out = bn->outputs[0];
    if (!bn->args[0].is_value() || !out->type.is_tensor()) continue;
    Value* x = bn->args[0].value;
    const TensorType& xt = x->type.tensor;
    bool static_sizes = true;
    for (const Dim& d : xt.sizes) static_sizes = static_sizes && d.is_constant();
    // (the rows of an [N, C] input may be a symbol: rule 4's form needs only the channels' count)
    const bool rows = xt.sizes.size() == 2 && xt.sizes[1].is_constant();
    const bool cpu_rows = xt.device.is_cpu() && rows && xt.dtype == c10::kFloat;
    const std::vector<int> order = memory_order(xt);
    const bool cpu_channels_last = xt.device.is_cpu() && xt.dtype == c10::kFloat && xt.sizes.size() == 4 && static_sizes &&
                                   !order.empty() && !std::is_sorted(order.begin(), order.end());
    if (!(xt.device.is_cuda() || cpu_rows || cpu_channels_last) || xt.sizes.size() < 2 || !(static_sizes || rows) ||
        (xt.dtype != c10::kFloat && !is_16bit(xt.dtype)) || !(out->type.tensor == xt))
      continue;
    // Dense in some order (row-major or channels_last): the fuse pass keeps all of it in one kernel (its
    // rule 6 takes the variance chain in).
    if (order.empty()) continue;
    const int64_t channels = xt.sizes[1].value;
    Value* params[4];  // weight, bias, mean, var
    bool ok = bn->args[6].kind == Arg::Kind::Float;
    for (int i = 0; i < 4 && ok; ++i) {
      const Arg& a = bn->args[1 + i];
      ok = a.is_value() && a.value->type.is_tensor() && a.value->type.tensor.sizes.size() == 1 &&
           a.value->type.tensor.sizes[0] == xt.sizes[1] && a.value->type.tensor.device == xt.device &&
           (a.value->type.tensor.dtype == c10::kFloat || a.value->type.tensor.dtype == xt.dtype);
      if (ok) params[i] = a.value;
    }
    if (!ok) continue;
    const bool all_stay = stays(params[0]) && stays(params[1]) && stays(params[2]) && stays(params[3]);
    if ((cpu_rows || !static_sizes) && !all_stay) continue;  // rule 3; symbolic rows take rule 4's form only
    const bool per_channel_first = all_stay || cpu_channels_last;  // rule 4's form (rule 5 on the CPU)
    const double eps = bn->args[6].f;
    const std::string base = out->name + "_bn" + std::to_string(fresh++);
    size_t added = 0;
    auto add = [&](const std::string& op, std::vector<Arg> args, std::vector<std::pair<std::string, Arg>> kwargs,
                   const std::string& name, TensorType type) {
      ++added;
      return graph.add_node(op, std::move(args), std::move(kwargs), {{base + "_" + name, Type::of_tensor(std::move(type))}})
          ->outputs[0];
    };
    // [C] -> [C, 1, ..., 1]: read as they are (a 16-bit one converts exactly on load); the variance, which
    // takes arithmetic before it meets x, expanded to x's shape first so that it stays in x's kernel.
    std::vector<Arg> shape{Arg::of_int(channels)};
    for (size_t d = 2; d < xt.sizes.size(); ++d) shape.push_back(Arg::of_int(1));
    const char* names[4] = {"w", "b", "mean", "var"};
    const TensorType full = like(xt, c10::kFloat);
    if (per_channel_first) {
      // Rule 4: scale and shift over [C] in float32, then one multiply-add per element.
      TensorType per_channel = params[0]->type.tensor;
      per_channel.dtype = c10::kFloat;
      per_channel.sizes = {Dim::constant(channels)};
      per_channel.strides = {Dim::constant(1)};
      Value* f32[4];
      for (int i = 0; i < 4; ++i) {
        f32[i] = params[i]->type.tensor.dtype == c10::kFloat
                     ? params[i]
                     : add("aten::_to_copy", {Arg::of(params[i])}, {{"dtype", Arg::of_dtype(c10::kFloat)}},
                           std::string(names[i]) + "_f32", per_channel);
      }
      Value* var_eps = add("aten::add.Tensor", {Arg::of(f32[3]), Arg::of_float(eps)}, {}, "var_eps", per_channel);
      Value* inv = add("aten::rsqrt", {Arg::of(var_eps)}, {}, "invstd", per_channel);
      Value* scale = add("aten::mul.Tensor", {Arg::of(inv), Arg::of(f32[0])}, {}, "scale", per_channel);
      Value* moved = add("aten::mul.Tensor", {Arg::of(f32[2]), Arg::of(scale)}, {}, "mean_scaled", per_channel);
      Value* shift = add("aten::sub.Tensor", {Arg::of(f32[1]), Arg::of(moved)}, {}, "shift", per_channel);
      TensorType c = per_channel;
      for (size_t d = 2; d < xt.sizes.size(); ++d) {
        c.sizes.push_back(Dim::constant(1));
        c.strides.push_back(Dim::constant(1));
      }
      Value* scale_col = add("aten::view", {Arg::of(scale), Arg::of_list(shape)}, {}, "scale_col", c);
      Value* shift_col = add("aten::view", {Arg::of(shift), Arg::of_list(shape)}, {}, "shift_col", c);
      Value* v = x;
      if (xt.dtype != c10::kFloat) v = add("aten::_to_copy", {Arg::of(v)}, {{"dtype", Arg::of_dtype(c10::kFloat)}}, "x_f32", full);
      Value* scaled = add("aten::mul.Tensor", {Arg::of(v), Arg::of(scale_col)}, {}, "scaled", full);
      Value* y = add("aten::add.Tensor", {Arg::of(scaled), Arg::of(shift_col)}, {}, "y", full);
      if (xt.dtype != c10::kFloat) y = add("aten::_to_copy", {Arg::of(y)}, {{"dtype", Arg::of_dtype(xt.dtype)}}, "out", xt);
      graph.move_last_before(added, bn);
      graph.replace_uses({{out, y}});
      continue;
    }
    Value* col[4];
    for (int i = 0; i < 4; ++i) {
      TensorType c = params[i]->type.tensor;
      c.sizes = {Dim::constant(channels)};
      c.strides = {Dim::constant(1)};
      for (size_t d = 2; d < xt.sizes.size(); ++d) {
        c.sizes.push_back(Dim::constant(1));
        c.strides.push_back(Dim::constant(1));
      }
      col[i] = add("aten::view", {Arg::of(params[i]), Arg::of_list(shape)}, {}, names[i], c);
    }
    std::vector<Arg> sizes;
    TensorType expanded = col[3]->type.tensor;
    expanded.sizes = xt.sizes;
    expanded.strides.clear();
    for (size_t d = 0; d < xt.sizes.size(); ++d) {
      sizes.push_back(Arg::of_int(xt.sizes[d].value));
      expanded.strides.push_back(Dim::constant(d == 1 ? 1 : 0));
    }
    // x's chain first: it starts the group, and the variance chain after it joins that group (rule 6).
    // Before it, the variance chain would join the previous batch norm's group when the shapes match and
    // be written out in full.
    // (The views all stand before the group, which reads them.)
    Value* var = add("aten::expand", {Arg::of(col[3]), Arg::of_list(sizes)}, {}, "var_full", expanded);
    Value* v = x;
    if (xt.dtype != c10::kFloat) v = add("aten::_to_copy", {Arg::of(v)}, {{"dtype", Arg::of_dtype(c10::kFloat)}}, "x_f32", full);
    Value* centered = add("aten::sub.Tensor", {Arg::of(v), Arg::of(col[2])}, {}, "centered", full);
    if (expanded.dtype != c10::kFloat)
      var = add("aten::_to_copy", {Arg::of(var)}, {{"dtype", Arg::of_dtype(c10::kFloat)}}, "var_f32", full);
    Value* shifted_var = add("aten::add.Tensor", {Arg::of(var), Arg::of_float(eps)}, {}, "var_eps", full);
    Value* inv = add("aten::rsqrt", {Arg::of(shifted_var)}, {}, "invstd", full);
    Value* scaled = add("aten::mul.Tensor", {Arg::of(centered), Arg::of(inv)}, {}, "normed", full);
    Value* weighted = add("aten::mul.Tensor", {Arg::of(scaled), Arg::of(col[0])}, {}, "weighted", full);
    Value* y = add("aten::add.Tensor", {Arg::of(weighted), Arg::of(col[1])}, {}, "y", full);
    if (xt.dtype != c10::kFloat) y = add("aten::_to_copy", {Arg::of(y)}, {{"dtype", Arg::of_dtype(xt.dtype)}}, "out", xt);
    graph.move_last_before(added, bn);
    graph.replace_uses({{out, y}});
  }
}

}  // namespace ember

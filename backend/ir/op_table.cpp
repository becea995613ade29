// Op traits, read from the dispatcher's schema and tags and cached per op name.
#include "ember/op_table.h"

#include "ember/error.h"
#include "ember/ir.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace ember {
namespace {

// ember's primitives: graph constants, shape queries and SymInt arithmetic that the runtime evaluates
// without a dispatcher round trip.
constexpr const char* kPrimOps[] = {
    "prim::constant", "prim::add",  "prim::sub", "prim::mul", "prim::floordiv", "prim::mod",
    "prim::truediv",  "prim::neg",  "prim::pow", "prim::eq",  "prim::ne",       "prim::lt",
    "prim::le",       "prim::gt",   "prim::ge",  "prim::sym_float", "prim::sym_int", "prim::sym_max",
    "prim::sym_min",  "prim::sym_not", "prim::ceil", "prim::floor", "prim::round", "prim::abs", "aten::sym_size.int", "aten::sym_stride.int", "aten::sym_numel",
    "aten::sym_storage_offset",
};

// Ops that stay library calls even once fusion exists: vendor libraries beat generated code here.
constexpr const char* kExternOps[] = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
    "aten::convolution_backward", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_addmm_activation",
    "aten::cudnn_convolution_relu", "aten::cudnn_convolution_add_relu",
};

// Ops ember's generated kernels implement (kernels/cpu, kernels/cuda). Pointwise ones fuse in any
// chain; the reductions fuse when they reduce over the last dimension only (the fuse pass checks).
constexpr const char* kFusibleOps[] = {
    "aten::add.Tensor", "aten::add.Scalar", "aten::sub.Tensor", "aten::sub.Scalar", "aten::rsub.Scalar",
    "aten::mul.Tensor", "aten::mul.Scalar", "aten::div.Tensor", "aten::div.Scalar", "aten::neg", "aten::exp",
    "aten::log", "aten::log1p", "aten::expm1", "aten::sin", "aten::cos", "aten::tanh", "aten::sigmoid",
    "aten::relu", "aten::gelu", "aten::silu", "aten::sqrt", "aten::rsqrt", "aten::abs", "aten::reciprocal",
    "aten::pow.Tensor_Scalar", "aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::maximum",
    "aten::minimum", "aten::where.self", "aten::erf", "aten::leaky_relu", "aten::threshold_backward",
    "aten::sigmoid_backward", "aten::tanh_backward", "aten::gelu_backward", "aten::silu_backward", "aten::gt.Scalar", "aten::gt.Tensor",
    "aten::lt.Scalar", "aten::lt.Tensor", "aten::ge.Scalar", "aten::ge.Tensor", "aten::le.Scalar",
    "aten::le.Tensor", "aten::eq.Scalar", "aten::eq.Tensor", "aten::ne.Scalar", "aten::ne.Tensor",
    "aten::_to_copy", "aten::clone", "aten::hardtanh", "aten::hardswish", "aten::hardsigmoid", "aten::logical_not", "aten::logical_and", "aten::logical_or",
    // the bitwise ones on bool tensors only (the fuse pass checks): hardtanh's (ReLU6's) backward masks by
    // bitwise_or(x <= 0, x >= 6), which split its kernel in two around an ATen bitwise_or and left the where
    // to ATen (mobilenet_v2's CPU training step, 2-core host: aten::where 9.7 ms of its 67)
    "aten::logical_xor", "aten::bitwise_and.Tensor", "aten::bitwise_or.Tensor", "aten::bitwise_xor.Tensor",
    // reductions over the last dimension
    "aten::sum.dim_IntList", "aten::mean.dim", "aten::amax", "aten::amin", "aten::_softmax",
    "aten::_log_softmax", "aten::native_layer_norm",
};

// Fusible ops that ember leaves to ATen on the CPU: ATen runs gelu through oneDNN's JIT and tanh
// through MKL's VML, about 2x faster per element than the Sleef math ember's interpreter uses
// (measured on AVX-512, one thread: gelu 1.5 vs 3.0 ms, tanh 1.25 vs 2.3 ms per 1M floats).
// gelu_backward fuses: ATen's own kernel is no faster than the interpreter's (1.2M floats, two threads:
// 0.54 ms against 0.59 ms, Dynamo's call included), and fused it folds into the bias gradient's column sum.
constexpr const char* kCpuKeepAtenOps[] = {"aten::gelu", "aten::tanh"};

// Ops whose result the host must read before going on.
constexpr const char* kCpuSyncOps[] = {
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
    "aten::unique_consecutive", "aten::_unique2", "aten::equal", "aten::is_nonzero",
};

// torch.cond, while_loop and scan (torch.ops.higher_order), their subgraphs compiled beside the graph.
constexpr const char* kSubgraphOps[] = {"ember::cond", "ember::while_loop", "ember::scan"};

bool listed(const char* const* begin, const char* const* end, const std::string& s) {
  for (auto it = begin; it != end; ++it)
    if (s == *it) return true;
  return false;
}

std::unique_ptr<OpInfo> resolve(const std::string& name) {
  auto info = std::make_unique<OpInfo>();
  info->name = name;
  if (listed(std::begin(kPrimOps), std::end(kPrimOps), name)) {
    info->traits = kPrim | kCapturable;
    return info;
  }
  if (listed(std::begin(kSubgraphOps), std::end(kSubgraphOps), name)) {
    info->traits = kSubgraphs | kRandom;
    return info;
  }
  auto [base, overload] = split_op_name(name);
  auto handle = c10::Dispatcher::singleton().findSchema({base, overload});
  if (!handle.has_value())
    throw Error("op '" + name + "' is not registered with the dispatcher (ember can only run ops it can resolve)");
  info->handle = new c10::OperatorHandle(*handle);  // lives as long as the table
  const c10::FunctionSchema& schema = handle->schema();
  uint32_t t = 0;
  if (handle->hasTag(at::Tag::pointwise)) t |= kPointwise;
  if (handle->hasTag(at::Tag::reduction)) t |= kReduction;
  if (handle->hasTag(at::Tag::nondeterministic_seeded)) t |= kRandom;
  if (handle->hasTag(at::Tag::dynamic_output_shape) || handle->hasTag(at::Tag::data_dependent_output))
    t |= kDynamicShape;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& arg = schema.arguments()[i];
    info->arg_names.push_back(arg.name());
    info->arg_has_default.push_back(arg.default_value().has_value());
    if (arg.alias_info() && arg.alias_info()->isWrite()) {
      t |= kMutates;
      info->written_args.emplace_back(static_cast<int>(i), arg.name());
    }
  }
  for (const auto& ret : schema.returns())
    if (ret.alias_info() && !ret.alias_info()->isWrite()) t |= kView;
  if (listed(std::begin(kExternOps), std::end(kExternOps), base)) t |= kExternOnly;
  if (listed(std::begin(kCpuSyncOps), std::end(kCpuSyncOps), base)) t |= kCpuSync;
  if (listed(std::begin(kFusibleOps), std::end(kFusibleOps), name)) t |= kFusible;
  if (listed(std::begin(kCpuKeepAtenOps), std::end(kCpuKeepAtenOps), name)) t |= kCpuKeepAten;
  if (name == "aten::_softmax" || name == "aten::_log_softmax" || name == "aten::native_layer_norm") t |= kReduction;
  if (!(t & (kCpuSync | kDynamicShape)) && !handle->hasTag(at::Tag::cudagraph_unsafe)) t |= kCapturable;
  info->traits = t;
  return info;
}

}  // namespace

std::pair<std::string, std::string> split_op_name(const std::string& name) {
  size_t ns = name.find("::");
  size_t dot = name.find('.', ns == std::string::npos ? 0 : ns + 2);
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

void check_arguments(const Node& n) {
  const OpInfo& info = op_info(n.op);
  if (!info.handle) return;  // ember's own ops and prims: their kernels check what they read
  const size_t count = info.arg_names.size();
  auto where = [&] { return (n.outputs.empty() ? std::string() : "%" + n.outputs[0]->name + " = ") + n.op; };
  if (n.args.size() > count)
    throw Error(where() + ": " + std::to_string(n.args.size()) + " arguments, its schema has " + std::to_string(count));
  std::vector<bool> given(count, false);
  for (size_t i = 0; i < n.args.size(); ++i) given[i] = true;
  for (const auto& [name, arg] : n.kwargs) {
    auto it = std::find(info.arg_names.begin(), info.arg_names.end(), name);
    if (it == info.arg_names.end()) throw Error(where() + ": no argument '" + name + "'");
    const size_t i = static_cast<size_t>(it - info.arg_names.begin());
    if (given[i]) throw Error(where() + ": argument '" + name + "' given twice");
    given[i] = true;
  }
  for (size_t i = 0; i < count; ++i)
    if (!given[i] && !info.arg_has_default[i]) throw Error(where() + ": missing argument '" + info.arg_names[i] + "'");
}

bool is_control_flow(const std::string& name) {
  return listed(std::begin(kSubgraphOps), std::end(kSubgraphOps), name);
}

const OpInfo& op_info(const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<OpInfo>> table;
  std::lock_guard<std::mutex> lock(mu);
  auto it = table.find(name);
  if (it != table.end()) return *it->second;
  return *table.emplace(name, resolve(name)).first->second;
}

}  // namespace ember

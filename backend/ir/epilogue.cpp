// as_epilogue / as_matmul: the op-by-op meaning of matmul epilogues (see ember/epilogue.h).
#include "ember/epilogue.h"

#include "ember/config.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ember {
namespace {

std::optional<double> number(const Arg* a) {
  if (!a) return std::nullopt;
  if (a->kind == Arg::Kind::Int) return static_cast<double>(a->i);
  if (a->kind == Arg::Kind::Float) return a->f;
  return std::nullopt;
}

// The op's `alpha` (add/sub) or `beta`/`alpha` (addmm): absent means 1.
double number_or_one(const Node& n, size_t position, const char* name) {
  const Arg* a = n.arg(position, name);
  return a ? number(a).value_or(std::nan("")) : 1.0;
}

bool is(const Arg* a, const Value* v) { return a && a->is_value() && a->value == v; }

}  // namespace

std::optional<EpilogueOp> as_epilogue(const Node& n, const Value* in) {
  using K = EpilogueOp::Kind;
  if (n.outputs.size() != 1) return std::nullopt;
  const Arg* self = n.arg(0, "self");
  const Arg* other = n.arg(1, "other");
  auto unary = [&](K k) -> std::optional<EpilogueOp> {
    if (!is(self, in)) return std::nullopt;
    return EpilogueOp{k};
  };
  const std::string& op = n.op;
  if (op == "aten::relu") return unary(K::Relu);
  if (op == "aten::silu") return unary(K::Silu);
  if (op == "aten::sigmoid") return unary(K::Sigmoid);
  if (op == "aten::tanh") return unary(K::Tanh);
  if (op == "aten::hardswish") return unary(K::Hardswish);
  if (op == "aten::hardtanh" || op == "aten::clamp") {
    // Both bounds numbers (relu6 is hardtanh(x, 0, 6)); hardtanh's default bounds are [-1, 1].
    const bool hard = op == "aten::hardtanh";
    const Arg* lo_arg = n.arg(1, hard ? "min_val" : "min");
    const Arg* hi_arg = n.arg(2, hard ? "max_val" : "max");
    auto lo = hard && !lo_arg ? std::optional<double>(-1.0) : number(lo_arg);
    auto hi = hard && !hi_arg ? std::optional<double>(1.0) : number(hi_arg);
    if (!is(self, in) || !lo || !hi || !(*lo <= *hi)) return std::nullopt;
    return EpilogueOp{K::Clamp, static_cast<float>(*lo), static_cast<float>(*hi)};
  }
  if (op == "aten::clamp_min") {
    auto min = number(n.arg(1, "min"));
    if (!is(self, in) || !min || *min != 0.0) return std::nullopt;
    return EpilogueOp{K::Relu};
  }
  if (op == "aten::gelu") {
    const Arg* approximate = n.arg(1, "approximate");
    std::string how = approximate && approximate->kind == Arg::Kind::String ? approximate->s : "none";
    if (!is(self, in) || (how != "none" && how != "tanh")) return std::nullopt;
    return EpilogueOp{how == "tanh" ? K::GeluTanh : K::GeluErf};
  }
  if (op == "aten::view" || op == "aten::_unsafe_view" || op == "aten::reshape") return unary(K::View);
  if (op == "aten::mul.Tensor" || op == "aten::mul.Scalar" || op == "aten::div.Tensor" || op == "aten::div.Scalar") {
    bool div = op.rfind("aten::div", 0) == 0;
    const Arg* scale_arg = is(self, in) ? other : (!div && is(other, in) ? self : nullptr);
    auto scale = number(scale_arg);
    if (!scale || (div && *scale == 0.0)) return std::nullopt;
    if (div && n.arg(2, "rounding_mode") && n.arg(2, "rounding_mode")->kind != Arg::Kind::None)
      return std::nullopt;
    return EpilogueOp{K::Linear, static_cast<float>(div ? 1.0 / *scale : *scale), 0.f};
  }
  if (op == "aten::add.Tensor" || op == "aten::add.Scalar" || op == "aten::sub.Tensor" || op == "aten::sub.Scalar") {
    bool sub = op.rfind("aten::sub", 0) == 0;
    double alpha = number_or_one(n, 2, "alpha");
    const Arg* rest = is(self, in) ? other : (!sub && is(other, in) ? self : nullptr);
    if (!rest) return std::nullopt;
    if (auto c = number(rest)) {
      double shift = (sub ? -1.0 : 1.0) * alpha * *c;
      if (std::isnan(shift)) return std::nullopt;
      return EpilogueOp{K::Linear, 1.f, static_cast<float>(shift)};
    }
    if (!rest->is_value() || !rest->value->type.is_tensor() || rest->value == in || sub || alpha != 1.0)
      return std::nullopt;
    EpilogueOp e{K::Add};
    e.addend = rest->value;
    return e;
  }
  return std::nullopt;
}

bool as_matmul(const Node& n, const Value** src, const Value** weights, const Value** bias) {
  auto value = [&](size_t pos, const char* name) -> const Value* {
    const Arg* a = n.arg(pos, name);
    return a && a->is_value() && a->value->type.is_tensor() ? a->value : nullptr;
  };
  if (n.outputs.size() != 1) return false;
  if (n.op == "aten::mm") {
    *src = value(0, "self"), *weights = value(1, "mat2"), *bias = nullptr;
  } else if (n.op == "aten::addmm") {
    if (number_or_one(n, 3, "beta") != 1.0 || number_or_one(n, 4, "alpha") != 1.0) return false;
    *bias = value(0, "self"), *src = value(1, "mat1"), *weights = value(2, "mat2");
    if (!*bias) return false;
  } else {
    return false;
  }
  return *src && *weights;
}

bool as_conv2d(const Node& n, const Value** src, const Value** weights, const Value** bias) {
  if (n.op != "aten::convolution" || n.args.size() != 9 || n.outputs.size() != 1) return false;
  auto tensor = [&](size_t i) -> const Value* {
    const Arg& a = n.args[i];
    return a.is_value() && a.value->type.is_tensor() && a.value->type.tensor.sizes.size() == 4 ? a.value : nullptr;
  };
  auto pair = [&](size_t i) {
    const Arg& a = n.args[i];
    return a.kind == Arg::Kind::List && a.list.size() == 2 && a.list[0].kind == Arg::Kind::Int &&
           a.list[1].kind == Arg::Kind::Int;
  };
  if (!pair(3) || !pair(4) || !pair(5) || n.args[6].kind != Arg::Kind::Bool || n.args[6].b ||
      n.args[8].kind != Arg::Kind::Int)
    return false;
  *src = tensor(0), *weights = tensor(1);
  *bias = n.args[2].is_value() ? n.args[2].value : nullptr;
  if (n.args[2].kind != Arg::Kind::None && !*bias) return false;
  return *src && *weights;
}

bool torch_conv_takes(const std::vector<EpilogueOp>& ops) {
  using K = EpilogueOp::Kind;
  auto activation = [](K k) {
    return k == K::Relu || k == K::GeluErf || k == K::GeluTanh || k == K::Silu || k == K::Sigmoid || k == K::Tanh ||
           k == K::Hardswish || k == K::Clamp;
  };
  if (ops.empty()) return true;
  if (ops.size() == 1) return activation(ops[0].kind) || ops[0].kind == K::Add;
  return ops.size() == 2 && ops[0].kind == K::Add && ops[1].kind == K::Relu;
}

bool onednn_convolutions_requested() {
  return config_is("EMBER_ONEDNN_CONV", "1");
}

const Value* input_behind(const Value* v) {
  // Batch-norm-folded weights are handed back as the same tensor while the parameters are unchanged
  // (kernels/cpu/fold_batchnorm_kernel.cpp): as good as a parameter for packing.
  if (v->producer && v->producer->op == "ember::fold_batchnorm" && v == v->producer->outputs[0]) return v;
  for (int depth = 0; depth < 4 && v->producer; ++depth) {
    const Node& p = *v->producer;
    if (p.op != "aten::permute" && p.op != "aten::t" && p.op != "aten::transpose.int") return nullptr;
    if (p.args.empty() || !p.args[0].is_value()) return nullptr;
    v = p.args[0].value;
  }
  return v->producer == nullptr ? v : nullptr;
}

}  // namespace ember

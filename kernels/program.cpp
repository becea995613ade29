// lower_group: fusion group -> Program. One function per op family; each reads its arguments by
// position or keyword, as the FX graph gave them.
#include "kernels/program.h"

#include "ember/error.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

namespace ember {
namespace {

class Unsupported : public std::exception {
 public:
  explicit Unsupported(std::string why) : why_(std::move(why)) {}
  const char* what() const noexcept override { return why_.c_str(); }

 private:
  std::string why_;
};

class Lowering {
 public:
  Lowering(const Graph& g, int group) : graph_(g) { program_.group = group; }

  Program run() {
    for (const auto& n : graph_.nodes())
      if (n->group == program_.group) members_.push_back(n.get());
    if (members_.empty()) throw Unsupported("empty group");
    const Node& first = *members_.front();
    program_.device = first.outputs[0]->type.tensor.device;
    program_.has_reduction = false;
    full_rank_ = 0;
    for (const Node* n : members_) {
      bool reduction = is_reduction(*n);
      const auto& sizes = reduction ? n->args[0].value->type.tensor.sizes : n->outputs[0]->type.tensor.sizes;
      if (reduction) {
        program_.has_reduction = true;
        const size_t outer = reduced_leading_dims(*n);
        if (outer_seen_ && program_.outer != outer) throw Unsupported("rows and columns in one group");
        program_.outer = outer;
        outer_seen_ = true;
      }
      full_rank_ = std::max(full_rank_, sizes.size());
      if (reduction && full_sizes_.empty()) full_sizes_ = sizes;
    }
    program_.rank = full_rank_;
    for (const Node* n : members_) lower(*n);
    collect_outputs();
    program_.members = members_;
    return std::move(program_);
  }

 private:
  static bool is_reduction(const Node& n) {
    return n.op == "aten::sum.dim_IntList" || n.op == "aten::mean.dim" || n.op == "aten::amax" ||
           n.op == "aten::amin" || n.op == "aten::_softmax" || n.op == "aten::_log_softmax" ||
           n.op == "aten::native_layer_norm";
  }

  bool in_group(const Value* v) const { return v->producer && v->producer->group == program_.group; }

  int new_reg(bool row) {
    program_.reg_is_row.push_back(row);
    return static_cast<int>(program_.reg_is_row.size()) - 1;
  }

  bool is_row(const Operand& o) const { return o.kind != Operand::Kind::Reg || program_.reg_is_row[o.index]; }
  bool is_reg(const Operand& o) const { return o.kind == Operand::Kind::Reg; }

  // The operand for an argument of `node`: a register, a loaded input, a runtime scalar or a constant.
  Operand operand(const Arg& a, const Node& node) {
    switch (a.kind) {
      case Arg::Kind::Int: return Operand::constant(static_cast<float>(a.i));
      case Arg::Kind::Float: return Operand::constant(static_cast<float>(a.f));
      case Arg::Kind::Bool: return Operand::constant(a.b ? 1.f : 0.f);
      case Arg::Kind::Value: break;
      default: throw Unsupported("argument kind of " + node.op);
    }
    const Value* v = a.value;
    if (!v->type.is_tensor()) {
      auto it = scalar_index_.find(v);
      if (it != scalar_index_.end()) return Operand::scalar(it->second);
      program_.scalars.push_back(v);
      int s = static_cast<int>(program_.scalars.size()) - 1;
      scalar_index_[v] = s;
      return Operand::scalar(s);
    }
    if (in_group(v)) return Operand::reg(reg_of_.at(v));
    bool row = node_is_row(node);
    auto key = std::make_pair(v, row);
    auto it = input_reg_.find(key);
    if (it != input_reg_.end()) return Operand::reg(it->second);
    int r = new_reg(row);
    program_.inputs.push_back({v, row, r});
    input_reg_[key] = r;
    return Operand::reg(r);
  }

  // The dtype a comparison runs in: torch's result_type of its two operands. Tensors with dimensions decide it;
  // a 0-dim tensor, then a Python number, changes it only when its category (bool < integer < floating) is
  // higher. So ne(x, s) for a bfloat16 x and a float32 0-dim s (or the number 1.541) compares in bfloat16: s is
  // rounded first, and 1.5391 == 1.541 there, as eager finds.
  static c10::ScalarType comparison_dtype(const Node& n) {
    enum Tier { Dimensioned, ZeroDim, Number };
    c10::ScalarType tier[3] = {c10::ScalarType::Undefined, c10::ScalarType::Undefined, c10::ScalarType::Undefined};
    auto join = [&](Tier t, c10::ScalarType d) {
      tier[t] = tier[t] == c10::ScalarType::Undefined ? d : c10::promoteTypes(tier[t], d);
    };
    for (size_t i = 0; i < 2; ++i) {
      const Arg* a = n.arg(i, i == 0 ? "self" : "other");
      if (!a) continue;
      if (a->kind == Arg::Kind::Value && a->value->type.is_tensor()) {
        const TensorType& t = a->value->type.tensor;
        join(t.sizes.empty() ? ZeroDim : Dimensioned, t.dtype);
      } else {
        join(Number, operand_dtype(*a));
      }
    }
    auto category = [](c10::ScalarType d) {
      return d == c10::ScalarType::Undefined ? -1 : d == c10::kBool ? 0 : c10::isFloatingType(d) ? 2 : 1;
    };
    c10::ScalarType result = tier[Dimensioned];
    for (Tier t : {ZeroDim, Number}) {
      if (category(tier[t]) <= category(result)) continue;
      // A Python float joins as the default dtype; a 0-dim tensor as its own.
      result = result == c10::ScalarType::Undefined || category(tier[t]) == 2 ? tier[t] : c10::promoteTypes(result, tier[t]);
    }
    return result;
  }
  // The dtype an argument holds: a tensor's own, or a Python number's (float as float32, the default dtype).
  static c10::ScalarType operand_dtype(const Arg& a) {
    if (a.kind == Arg::Kind::Value && a.value->type.is_tensor()) return a.value->type.tensor.dtype;
    Type::Kind k = a.kind == Arg::Kind::Value ? a.value->type.kind : Type::Kind::None;
    if (a.kind == Arg::Kind::Bool || k == Type::Kind::Bool) return c10::kBool;
    if (a.kind == Arg::Kind::Int || k == Type::Kind::Int) return c10::kLong;
    return c10::kFloat;
  }
  // `v` rounded to the 16-bit `t`.
  static float rounded(float v, c10::ScalarType t) {
    return t == c10::kHalf ? static_cast<float>(c10::Half(v)) : static_cast<float>(c10::BFloat16(v));
  }
  // An operand held in a wider dtype than `common` takes `common`'s rounding (a constant is rounded now).
  Operand round_to(Operand o, c10::ScalarType held, c10::ScalarType common) {
    if (held == common || held == c10::kBool) return o;
    if (o.kind == Operand::Kind::Imm) {
      o.imm = rounded(o.imm, common);
      return o;
    }
    return emit(common == c10::kHalf ? OpCode::RoundHalf : OpCode::RoundBFloat16, o);
  }

  // An operand of a 16-bit add, sub or rsub: one held wider (a float32 0-dim tensor, a Python number) is rounded
  // to the result's dtype first, as torch's add kernel reads such a scalar (TensorIterator's scalar_value, on the CPU
  // and CUDA alike); mul and div read its unrounded value (original_scalar_value), so they take it as it is. A
  // bfloat16 x - s with s a float32 sum near 262.6 subtracts 262 in eager; unrounded, a softmax over two such
  // differences gave 0.5 where eager gives 0.119 (fuzz seed 1800875).
  Operand added(const Node& n, size_t index, const char* name) {
    Operand o = operand(*n.arg(index, name), n);
    const c10::ScalarType result = n.outputs[0]->type.tensor.dtype;
    if (result != c10::kHalf && result != c10::kBFloat16) return o;
    return round_to(o, operand_dtype(*n.arg(index, name)), result);
  }

  // A number torch's CPU kernels of a 16-bit add, sub or rsub (its alpha) and pow (its scalar exponent) take in the
  // tensor's dtype (Scalar::to<scalar_t>): `v` rounded to the result's dtype there, else as it is. bfloat16
  // x.abs() ** 1.7 raises to 1.703125 in eager, and torch.add(x, y, alpha=0.3) scales by 0.30078125 (on the 2-core
  // host, every element equal so; unrounded, 30-50% of them an ulp off). CUDA's kernels are left as they were: how
  // they take these numbers was not checked there.
  double cpu_scalar(const Node& n, double v) const {
    const c10::ScalarType result = n.outputs[0]->type.tensor.dtype;
    if (!program_.device.is_cpu() || (result != c10::kHalf && result != c10::kBFloat16)) return v;
    return rounded(static_cast<float>(v), result);
  }

  // A node is a row node when its output has fewer elements per row than the full shape: it follows
  // a reduction and works on reduced values only. A keepdim-shaped output ([..., 1], or [1, ..., 1, kept...]
  // for columns) is a row unless the full shape has that shape too; then it is one only where it reads rows.
  // (A [1, 1] comparison of two [1, 1] inputs in a group over [1, 4] rows, reading no register, was lowered
  // as a full node and stored [1, 4]: a minimum's gradient came back 4 times too large.)
  bool node_is_row(const Node& n) const {
    if (is_reduction(n) || !program_.has_reduction) return false;
    const auto& sizes = n.outputs[0]->type.tensor.sizes;
    if (sizes.size() < full_rank_) return true;
    auto one = [](const Dim& d) { return d.is_constant() && d.value == 1; };
    if (program_.outer > 0) {  // keepdim columns: [1, ..., 1, kept...]
      bool full_is_keepdim = full_sizes_.size() == sizes.size();
      for (size_t d = 0; d < program_.outer; ++d) {
        if (!one(sizes[d])) return false;
        full_is_keepdim = full_is_keepdim && one(full_sizes_[d]);
      }
      return !full_is_keepdim || row_consumer(n);
    }
    if (sizes.empty() || !one(sizes.back())) return false;
    const bool full_is_keepdim = full_sizes_.size() == sizes.size() && one(full_sizes_.back());
    return !full_is_keepdim || row_consumer(n);
  }

  // A keepdim-shaped ([..., 1]) pointwise node is a row node only when all its register inputs are rows.
  bool row_consumer(const Node& n) const {
    bool all_rows = true, any_reg = false;
    n.for_each_input([&](const Value* v) {
      if (!v->type.is_tensor() || !in_group(v)) return;
      any_reg = true;
      if (!program_.reg_is_row[reg_of_.at(v)]) all_rows = false;
    });
    return any_reg && all_rows;
  }

  Operand arg_operand(const Node& n, size_t position, const char* name, float fallback) {
    const Arg* a = n.arg(position, name);
    if (!a || a->kind == Arg::Kind::None) return Operand::constant(fallback);
    return operand(*a, n);
  }
  double arg_number(const Node& n, size_t position, const char* name, double fallback) const {
    const Arg* a = n.arg(position, name);
    if (!a || a->kind == Arg::Kind::None) return fallback;
    if (a->kind == Arg::Kind::Int) return static_cast<double>(a->i);
    if (a->kind == Arg::Kind::Float) return a->f;
    throw Unsupported("non-constant argument '" + std::string(name) + "' of " + n.op);
  }
  std::string arg_string(const Node& n, size_t position, const char* name, const char* fallback) const {
    const Arg* a = n.arg(position, name);
    if (!a || a->kind == Arg::Kind::None) return fallback;
    if (a->kind != Arg::Kind::String) throw Unsupported("argument '" + std::string(name) + "' of " + n.op);
    return a->s;
  }

  // Appends an instruction, or returns the register of an earlier one that computes the same (every opcode is
  // a pure function of its operands): a softmax after an amax of the same scores (flex_attention's dense form)
  // asks for the row maximum twice, and each is a pass over the row.
  // A row instruction is one whose register operands are all rows. One that reads no register (alpha * 3 of
  // add(x, 3, alpha=2)) is the same number everywhere and is filed as the node it serves is: a row in a row
  // node, else full, as its reader will be. Filed as a row under a full node, a column group (Program::outer)
  // would compute it after the reduction, where the full instructions that read it have already run.
  Operand emit(OpCode op, Operand a, Operand b = {}, Operand c = {}, std::optional<bool> row = std::nullopt) {
    const bool reads_reg = is_reg(a) || is_reg(b) || is_reg(c);
    bool r = row.value_or(reads_reg ? is_row(a) && is_row(b) && is_row(c) : lowering_row_);
    if (op == OpCode::RowSum || op == OpCode::RowMean || op == OpCode::RowMax || op == OpCode::RowMin) r = true;
    InstrKey key{static_cast<int64_t>(op), r};
    for (const Operand& o : {a, b, c}) {
      uint32_t bits = 0;
      std::memcpy(&bits, &o.imm, sizeof bits);
      key.push_back(static_cast<int64_t>(o.kind)), key.push_back(o.index), key.push_back(bits);
    }
    if (auto it = computed_.find(key); it != computed_.end()) return Operand::reg(it->second);
    int dst = new_reg(r);
    program_.code.push_back({op, dst, a, b, c});
    computed_.emplace(std::move(key), dst);
    return Operand::reg(dst);
  }

  // Registers a node output; a constant operand is first materialized with Copy. A half or bfloat16
  // value is rounded to its dtype here, so later members see what eager sees (overflow to inf too).
  void define(const Value* v, Operand o) {
    if (o.kind != Operand::Kind::Reg || program_.reg_is_row[o.index] != value_is_row(v)) o = emit(OpCode::Copy, o, {}, {}, value_is_row(v));
    c10::ScalarType t = v->type.tensor.dtype;
    if (t == c10::kHalf) o = emit(OpCode::RoundHalf, o, {}, {}, value_is_row(v));
    if (t == c10::kBFloat16) o = emit(OpCode::RoundBFloat16, o, {}, {}, value_is_row(v));
    if (t == c10::kBool) o = emit(OpCode::ToBool, o, {}, {}, value_is_row(v));
    reg_of_[v] = o.index;
  }
  bool value_is_row(const Value* v) const {
    return program_.has_reduction && (v->type.tensor.sizes.size() < full_rank_ ||
                                      (v->producer && node_is_row(*v->producer)) || reduced_.count(v));
  }

  void lower(const Node& n) {
    lowering_row_ = node_is_row(n);
    const std::string& op = n.op;
    auto x = [&](size_t i, const char* name) { return operand(*n.arg(i, name), n); };
    auto out = [&](Operand o) { define(n.outputs[0], o); };
    static const std::unordered_map<std::string, OpCode> unary = {
        {"aten::neg", OpCode::Neg},       {"aten::exp", OpCode::Exp},         {"aten::log", OpCode::Log},
        {"aten::log1p", OpCode::Log1p},   {"aten::expm1", OpCode::Expm1},     {"aten::sin", OpCode::Sin},
        {"aten::cos", OpCode::Cos},       {"aten::tanh", OpCode::Tanh},       {"aten::sigmoid", OpCode::Sigmoid},
        {"aten::relu", OpCode::Relu},     {"aten::sqrt", OpCode::Sqrt},       {"aten::rsqrt", OpCode::Rsqrt},
        {"aten::abs", OpCode::Abs},       {"aten::reciprocal", OpCode::Reciprocal}, {"aten::erf", OpCode::Erf},
    };
    static const std::unordered_map<std::string, OpCode> compare = {
        {"aten::gt", OpCode::Gt}, {"aten::lt", OpCode::Lt}, {"aten::ge", OpCode::Ge},
        {"aten::le", OpCode::Le}, {"aten::eq", OpCode::Eq}, {"aten::ne", OpCode::Ne},
    };
    if (auto it = unary.find(op); it != unary.end()) return out(emit(it->second, x(0, "self")));
    std::string base = op.substr(0, op.find('.', 6));
    if (auto it = compare.find(base); it != compare.end()) {
      Operand a = x(0, "self"), b = x(1, "other");
      c10::ScalarType common = comparison_dtype(n);
      if (common == c10::kHalf || common == c10::kBFloat16) {
        a = round_to(a, operand_dtype(*n.arg(0, "self")), common);
        b = round_to(b, operand_dtype(*n.arg(1, "other")), common);
      }
      return out(emit(it->second, a, b));
    }

    if (op == "aten::add.Tensor" || op == "aten::add.Scalar" || op == "aten::sub.Tensor" || op == "aten::sub.Scalar") {
      Operand a = added(n, 0, "self"), b = added(n, 1, "other");
      double alpha = cpu_scalar(n, arg_number(n, 2, "alpha", 1.0));
      if (alpha != 1.0) b = emit(OpCode::Mul, b, Operand::constant(static_cast<float>(alpha)));
      return out(emit(op[6] == 'a' ? OpCode::Add : OpCode::Sub, a, b));
    }
    if (op == "aten::rsub.Scalar") {
      Operand a = added(n, 0, "self");
      double alpha = cpu_scalar(n, arg_number(n, 2, "alpha", 1.0));
      if (alpha != 1.0) a = emit(OpCode::Mul, a, Operand::constant(static_cast<float>(alpha)));
      return out(emit(OpCode::Sub, added(n, 1, "other"), a));
    }
    if (op == "aten::mul.Tensor" || op == "aten::mul.Scalar") return out(emit(OpCode::Mul, x(0, "self"), x(1, "other")));
    if (op == "aten::div.Tensor" || op == "aten::div.Scalar") {
      // x / 2^k is x * 2^-k exactly (both are the rounded value of one real number), and a product is cheaper
      // than a division: softmax(x / 8)'s row kernel no longer keeps the quotient (cuda/row_phases.cpp: costly).
      Operand d = x(1, "other");
      int e = 0;
      if (d.kind == Operand::Kind::Imm && std::isnormal(d.imm) && std::fabs(std::frexp(d.imm, &e)) == 0.5f &&
          std::isnormal(1.f / d.imm))
        return out(emit(OpCode::Mul, x(0, "self"), Operand::constant(1.f / d.imm)));
      return out(emit(OpCode::Div, x(0, "self"), d));
    }
    if (op == "aten::maximum") return out(emit(OpCode::Max, x(0, "self"), x(1, "other")));
    if (op == "aten::minimum") return out(emit(OpCode::Min, x(0, "self"), x(1, "other")));
    if (op == "aten::where.self") return out(emit(OpCode::Where, x(0, "condition"), x(1, "self"), x(2, "other")));
    if (op == "aten::logical_not") return out(emit(OpCode::Eq, x(0, "self"), Operand::constant(0.f)));
    // Bool values are 0 or 1 (define() rounds every bool result so): or is max, and is min, xor is ne.
    if (op == "aten::bitwise_or.Tensor") return out(emit(OpCode::Max, x(0, "self"), x(1, "other")));
    if (op == "aten::bitwise_and.Tensor") return out(emit(OpCode::Min, x(0, "self"), x(1, "other")));
    if (op == "aten::bitwise_xor.Tensor") return out(emit(OpCode::Ne, x(0, "self"), x(1, "other")));
    if (op == "aten::logical_or" || op == "aten::logical_and" || op == "aten::logical_xor") {
      Operand a = emit(OpCode::Ne, x(0, "self"), Operand::constant(0.f));
      Operand b = emit(OpCode::Ne, x(1, "other"), Operand::constant(0.f));
      return out(emit(op == "aten::logical_or" ? OpCode::Max : op == "aten::logical_and" ? OpCode::Min : OpCode::Ne, a, b));
    }
    if (op == "aten::pow.Tensor_Scalar") {
      Operand a = x(0, "self");
      double e = cpu_scalar(n, arg_number(n, 1, "exponent", 1.0));
      if (e == 2.0) return out(emit(OpCode::Mul, a, a));
      if (e == 1.0) return out(a);
      if (e == 0.5) return out(emit(OpCode::Sqrt, a));
      if (e == -1.0) return out(emit(OpCode::Reciprocal, a));
      if (e == 3.0) return out(emit(OpCode::Mul, emit(OpCode::Mul, a, a), a));
      return out(emit(OpCode::Pow, a, Operand::constant(static_cast<float>(e))));
    }
    if (op == "aten::clamp" || op == "aten::hardtanh") {
      bool hard = op == "aten::hardtanh";
      Operand v = x(0, "self");
      const Arg* lo = n.arg(1, hard ? "min_val" : "min");
      const Arg* hi = n.arg(2, hard ? "max_val" : "max");
      // The bound first, as ATen's clamp kernels take it: max / min give their second operand where both are
      // equal, so clamp_min(-0.0, 0) stays -0.0 (atan2 and division tell the zeros apart).
      if (hard || (lo && lo->kind != Arg::Kind::None)) v = emit(OpCode::Max, lo ? operand(*lo, n) : Operand::constant(-1.f), v);
      if (hard || (hi && hi->kind != Arg::Kind::None)) v = emit(OpCode::Min, hi ? operand(*hi, n) : Operand::constant(1.f), v);
      return out(v);
    }
    if (op == "aten::clamp_min") return out(emit(OpCode::Max, x(1, "min"), x(0, "self")));
    if (op == "aten::clamp_max") return out(emit(OpCode::Min, x(1, "max"), x(0, "self")));
    if (op == "aten::leaky_relu") {
      Operand v = x(0, "self");
      Operand slope = arg_operand(n, 1, "negative_slope", 0.01f);
      return out(emit(OpCode::Where, emit(OpCode::Gt, v, Operand::constant(0.f)), v, emit(OpCode::Mul, v, slope)));
    }
    if (op == "aten::silu") return out(emit(OpCode::Silu, x(0, "self")));
    if (op == "aten::hardswish" || op == "aten::hardsigmoid") {
      // ATen's form: relu6(x + 3) / 6, times x for hardswish (a division, as ATen's kernels divide). Kept whole by
      // the decompositions (ATen's one kernel beat the pointwise nodes run one by one); here they fuse with the
      // convolution's or matmul's neighbours instead (mobilenet_v3's and LeViT's activations).
      Operand v = x(0, "self");
      Operand r6 = emit(OpCode::Min, Operand::constant(6.f), emit(OpCode::Max, Operand::constant(0.f), emit(OpCode::Add, v, Operand::constant(3.f))));
      return out(op == "aten::hardswish" ? emit(OpCode::Div, emit(OpCode::Mul, v, r6), Operand::constant(6.f))
                                         : emit(OpCode::Div, r6, Operand::constant(6.f)));
    }
    if (op == "aten::gelu") {
      std::string approximate = arg_string(n, 1, "approximate", "none");
      if (approximate != "none" && approximate != "tanh") throw Unsupported("gelu approximate=" + approximate);
      return out(emit(approximate == "tanh" ? OpCode::GeluTanh : OpCode::Gelu, x(0, "self")));
    }
    if (op == "aten::gelu_backward") {
      if (arg_string(n, 2, "approximate", "none") != "none") throw Unsupported("tanh gelu_backward");
      return out(emit(OpCode::GeluBackward, x(0, "grad_output"), x(1, "self")));
    }
    if (op == "aten::silu_backward") {  // ATen's formula: grad * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
      Operand v = x(1, "self");
      Operand s = emit(OpCode::Sigmoid, v);
      Operand slope = emit(OpCode::Add, Operand::constant(1.f), emit(OpCode::Mul, v, emit(OpCode::Sub, Operand::constant(1.f), s)));
      return out(emit(OpCode::Mul, emit(OpCode::Mul, x(0, "grad_output"), s), slope));
    }
    if (op == "aten::threshold_backward") {
      Operand mask = emit(OpCode::Le, x(1, "self"), x(2, "threshold"));
      return out(emit(OpCode::Where, mask, Operand::constant(0.f), x(0, "grad_output")));
    }
    if (op == "aten::sigmoid_backward") {
      Operand y = x(1, "output");
      return out(emit(OpCode::Mul, x(0, "grad_output"), emit(OpCode::Mul, y, emit(OpCode::Sub, Operand::constant(1.f), y))));
    }
    if (op == "aten::tanh_backward") {
      Operand y = x(1, "output");
      return out(emit(OpCode::Mul, x(0, "grad_output"), emit(OpCode::Sub, Operand::constant(1.f), emit(OpCode::Mul, y, y))));
    }
    if (op == "aten::_to_copy") return out(x(0, "self"));  // define() rounds to the output dtype
    // A copy into the layout the fuse pass checked (row-major, or a permuted group's order): alone it stays
    // ATen's (a group of one dissolves); with what reads it, the kernel reads the strided source once. LeViT's
    // attention output, clone(permute(bmm)) -> reshape -> hardswish, was a copy and a hardswish apart.
    if (op == "aten::clone") return out(x(0, "self"));
    if (is_reduction(n)) return lower_reduction(n);
    throw Unsupported("no lowering for " + op);
  }

  void lower_reduction(const Node& n) {
    Operand in = operand(n.args[0], n);
    if (is_row(in)) throw Unsupported("reduction of a reduced value");
    auto reduced = [&](const Value* v, Operand o) {
      reduced_[v] = true;
      define(v, o);
    };
    if (n.op == "aten::sum.dim_IntList") return reduced(n.outputs[0], emit(OpCode::RowSum, in));
    if (n.op == "aten::mean.dim") return reduced(n.outputs[0], emit(OpCode::RowMean, in));
    if (n.op == "aten::amax") return reduced(n.outputs[0], emit(OpCode::RowMax, in));
    if (n.op == "aten::amin") return reduced(n.outputs[0], emit(OpCode::RowMin, in));
    if (n.op == "aten::_softmax" || n.op == "aten::_log_softmax") {
      Operand shifted = emit(OpCode::Sub, in, emit(OpCode::RowMax, in));
      Operand e = emit(OpCode::Exp, shifted);
      Operand sum = emit(OpCode::RowSum, e);
      if (n.op == "aten::_softmax") return define(n.outputs[0], emit(OpCode::Div, e, sum));
      return define(n.outputs[0], emit(OpCode::Sub, shifted, emit(OpCode::Log, sum)));
    }
    if (n.op == "aten::native_layer_norm") {
      Operand mean = emit(OpCode::RowMean, in);
      Operand d = emit(OpCode::Sub, in, mean);
      Operand var = emit(OpCode::RowMean, emit(OpCode::Mul, d, d));
      Operand eps = Operand::constant(static_cast<float>(arg_number(n, 4, "eps", 1e-5)));
      Operand rstd = emit(OpCode::Rsqrt, emit(OpCode::Add, var, eps));
      Operand y = emit(OpCode::Mul, d, rstd);
      const Arg* w = n.arg(2, "weight");
      const Arg* b = n.arg(3, "bias");
      bool has_w = w && w->kind != Arg::Kind::None, has_b = b && b->kind != Arg::Kind::None;
      if (has_w && has_b) y = emit(OpCode::MulAdd, y, operand(*w, n), operand(*b, n));
      else if (has_w) y = emit(OpCode::Mul, y, operand(*w, n));
      else if (has_b) y = emit(OpCode::Add, y, operand(*b, n));
      define(n.outputs[0], y);
      if (n.outputs.size() > 1) reduced(n.outputs[1], mean);
      if (n.outputs.size() > 2) reduced(n.outputs[2], rstd);
      return;
    }
    throw Unsupported("no lowering for " + n.op);
  }

  // Values made in the group and read outside it (or returned) are the group's outputs.
  void collect_outputs() {
    std::unordered_map<const Value*, bool> used_outside;
    for (const auto& n : graph_.nodes()) {
      if (n->group == program_.group) continue;
      n->for_each_input([&](const Value* v) { if (in_group(v)) used_outside[v] = true; });
    }
    for (const Arg& a : graph_.outputs()) a.for_each_value([&](const Value* v) { if (in_group(v)) used_outside[v] = true; });
    for (const Node* n : members_)
      for (const Value* v : n->outputs) {
        if (!used_outside.count(v)) continue;
        int r = reg_of_.at(v);
        bool row = program_.reg_is_row[r];
        bool keepdim = row && v->type.tensor.sizes.size() == full_rank_;
        program_.outputs.push_back({v, r, row, keepdim});
      }
  }

  const Graph& graph_;
  Program program_;
  std::vector<const Node*> members_;
  size_t full_rank_ = 0;
  std::vector<Dim> full_sizes_;  // the first reduction's input: the group's full shape
  bool outer_seen_ = false;  // a reduction has set program_.outer
  bool lowering_row_ = false;  // the node lower() is at is a row node (emit)
  std::unordered_map<const Value*, int> reg_of_;
  std::unordered_map<const Value*, int> scalar_index_;
  std::unordered_map<const Value*, bool> reduced_;
  std::map<std::pair<const Value*, bool>, int> input_reg_;
  using InstrKey = std::vector<int64_t>;  // opcode, row, then each operand's kind, index and constant bits
  std::map<InstrKey, int> computed_;      // the register each distinct instruction wrote (emit)
};

}  // namespace

const char* opcode_name(OpCode op) {
  static const char* names[] = {"copy", "neg", "exp", "log", "log1p", "expm1", "sin", "cos", "tanh", "sigmoid",
                                "relu", "sqrt", "rsqrt", "abs", "reciprocal", "erf", "round_f16", "round_bf16",
                                "to_bool", "gelu", "gelu_tanh", "silu", "add", "sub", "mul", "div", "max", "min",
                                "pow", "gt", "lt", "ge", "le", "eq", "ne", "gelu_backward", "where", "mul_add",
                                "row_sum", "row_mean", "row_max", "row_min"};
  return names[static_cast<int>(op)];
}

std::string Program::text() const {
  auto reg = [&](int r) { return std::string(reg_is_row[r] ? "r" : "f") + std::to_string(r); };
  auto opnd = [&](const Operand& o) -> std::string {
    switch (o.kind) {
      case Operand::Kind::Reg: return reg(o.index);
      case Operand::Kind::Imm: {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", o.imm);
        return buf;
      }
      case Operand::Kind::Scalar: return "%" + scalars[o.index]->name;
      case Operand::Kind::None: return "";
    }
    return "";
  };
  std::string kind = !has_reduction ? " (flat)" : outer ? " (columns: reduces the first " + std::to_string(outer) + " dims)" : " (rows)";
  std::string s = "group " + std::to_string(group) + " on " + device.str() + kind + "\n";
  for (const ProgramInput& in : inputs)
    s += "  " + reg(in.reg) + " = load %" + in.value->name + (in.row ? (outer ? " per column" : " per row") : "") + "\n";
  for (const Instr& i : code) {
    s += "  " + reg(i.dst) + " = " + opcode_name(i.op) + " " + opnd(i.a);
    if (i.b.kind != Operand::Kind::None) s += ", " + opnd(i.b);
    if (i.c.kind != Operand::Kind::None) s += ", " + opnd(i.c);
    s += "\n";
  }
  for (const ProgramOutput& o : outputs) s += "  store %" + o.value->name + " = " + reg(o.reg) + "\n";
  return s;
}

std::optional<Program> lower_group(const Graph& graph, int group, std::string* why_not) {
  try {
    return Lowering(graph, group).run();
  } catch (const Unsupported& e) {
    if (why_not) *why_not = e.what();
    return std::nullopt;
  }
}

}  // namespace ember

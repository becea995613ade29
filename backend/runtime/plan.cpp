// build_plan: binds every node of a Graph to a Step.
//  1. Each ATen node gets its OperatorHandle and a full argument stack laid out by the schema:
//     positional arguments, then keywords by name, then the schema's defaults; literals are converted
//     to the exact IValue kind the schema asks for (an int literal for a float argument is a double).
//  2. Values live in a buffer table: inputs first, then one buffer per defined value.
//  3. Every buffer that is not a graph output is released right after the step that reads it last.
//  4. ATen steps may get a FastPath (runtime.h). Views over statically shaped tensors get their geometry
//     precomputed (StaticView, below): a view step costs the executor one TensorImpl instead of a boxed
//     dispatcher call. In TransformerEncoderLayer's plan 25 of 45 steps are views; host time per call is
//     what such plans pay. Views whose sizes are symbols compute theirs per call from the input and the
//     symbols' values (SymbolicView). Other makers register themselves (kernels/cuda/gemm.cpp).
//  5. A CPU add / sub / mul / div of two tensors whose first operand (or, for add with alpha 1 and mul, the
//     second) dies at that step writes its result into that operand (InPlaceBinary, below), where no one
//     else holds the tensor or its storage. Why: a backward sums the gradients of a parameter used twice
//     (BART's shared 50265 x 256 embedding: 51 MB) where eager accumulates into the first in place. A fresh
//     51 MB result is a fresh mmap that faults in every page: ATen's add took 14.5 ms per step on the 2-core
//     host, eager's add_ 3.9 ms.
#include "ember/error.h"
#include "ember/op_table.h"
#include "ember/runtime.h"

#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sub.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <limits>
#include <unordered_map>
#include <unordered_set>

namespace ember {
namespace {

// The ops whose result is always a view of their first argument (reshape and contiguous may copy).
bool is_view_op(const std::string& op) {
  static const std::unordered_set<std::string> views = {
      "aten::view", "aten::_unsafe_view", "aten::permute", "aten::expand", "aten::unsqueeze",
      "aten::squeeze", "aten::squeeze.dim", "aten::squeeze.dims", "aten::select.int", "aten::slice.Tensor",
      "aten::transpose.int", "aten::t", "aten::alias", "aten::as_strided", "aten::unflatten.int",
      "aten::narrow", "aten::diagonal", "aten::unfold"};
  return views.count(op) > 0;
}

std::vector<FastPathMaker>& fast_path_makers() {
  static std::vector<FastPathMaker> makers;
  return makers;
}

// A view over a tensor whose sizes and strides the IR knows: the geometry comes from running the op once
// on a meta tensor, and run() builds the view as ATen's own view kernels do below the ADInplaceOrView key
// (where the executor runs): one TensorImpl on the input's storage. Any input that is not the plain strided
// tensor of the expected sizes and strides takes the op's own path.
// Most views place their result relative to the input's storage offset; as_strided with an offset places
// it at that offset of the storage, whatever the input's. Which one an op does is seen, not listed: the op
// runs on inputs at two storage offsets (static_view).
class StaticView final : public FastPath {
 public:
  uint32_t input = 0;
  int32_t output = -1;
  std::vector<int64_t> in_sizes, in_strides, out_sizes, out_strides;
  int64_t offset = 0;     // the view's storage offset minus its input's, or (absolute) the view's own
  bool absolute = false;
  int64_t out_extent = 0;  // absolute: elements of storage from `offset` that the view reaches

  bool run(std::vector<c10::IValue>& buffers) const override {
    const c10::IValue& in = buffers[input];
    if (!in.isTensor()) return false;
    const at::Tensor& t = in.toTensor();
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (t.layout() != at::kStrided || !impl->has_storage() || impl->is_nested() ||
        impl->has_symbolic_sizes_strides() || impl->is_python_dispatch() || t.sizes() != at::IntArrayRef(in_sizes) ||
        t.strides() != at::IntArrayRef(in_strides))
      return false;
    // A relative view stays inside its input; an absolute one may lie past this storage (as_strided raises).
    if (absolute && (offset + out_extent) * int64_t(t.dtype().itemsize()) > int64_t(t.storage().nbytes())) return false;
    at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()),
                                                               t.key_set(), t.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(out_sizes, out_strides, absolute ? offset : t.storage_offset() + offset);
    buffers[output] = std::move(out);
    return true;
  }
  std::string describe() const override { return "view"; }
};

// A view whose geometry the IR knows only as symbols (a graph Dynamo made dynamic): per call, the result's
// sizes, strides and offset follow from the input's and the op's integer arguments (constants, or buffers
// holding a symbol's value) by the rules ATen's view kernels apply, and the view is built as StaticView
// builds it. Where an argument is not what the rule expects (an index out of range, a size that does not
// view) run() returns false and the op runs, raising its own error.
class SymbolicView final : public FastPath {
 public:
  enum class Kind : uint8_t { View, Permute, Unsqueeze, Expand, Slice, Transpose, Squeeze, Select, Alias };
  // An integer argument: a constant, or the buffer holding it per call. `none`: an optional one left out.
  struct Int {
    int64_t value = 0;
    int32_t buffer = -1;
    bool none = false;
  };
  Kind kind = Kind::Alias;
  uint32_t input = 0;
  int32_t output = -1;
  std::vector<Int> ints;  // the op's integer arguments after the tensor, a list's items flattened

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* in = buffer_tensor(buffers, input);
    if (!in) return false;
    const at::Tensor& t = *in;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (t.layout() != at::kStrided || !impl->has_storage() || impl->is_nested() || impl->has_symbolic_sizes_strides() ||
        impl->is_python_dispatch())
      return false;
    at::DimVector v;  // the integer arguments' values
    for (const Int& i : ints) {
      if (i.buffer < 0) {
        v.push_back(i.none ? kNone : i.value);
        continue;
      }
      const c10::IValue& b = buffers[static_cast<size_t>(i.buffer)];
      if (!b.isInt()) return false;
      v.push_back(b.toInt());
    }
    at::DimVector sizes(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end());
    int64_t offset = t.storage_offset();
    if (!geometry(v, sizes, strides, offset)) return false;
    at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()),
                                                               t.key_set(), t.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
    buffers[output] = std::move(out);
    return true;
  }
  std::string describe() const override { return "symbolic view"; }

  static constexpr int64_t kNone = std::numeric_limits<int64_t>::min();

 private:
  // A dimension index as ATen wraps it (negative counts from the end); false when out of range.
  static bool wrap(int64_t& d, int64_t rank) {
    if (d < 0) d += rank;
    return d >= 0 && d < rank;
  }

  bool geometry(const at::DimVector& v, at::DimVector& sizes,
                at::DimVector& strides, int64_t& offset) const {
    const int64_t rank = static_cast<int64_t>(sizes.size());
    switch (kind) {
      case Kind::Alias: return true;
      case Kind::Permute: {
        if (static_cast<int64_t>(v.size()) != rank) return false;
        at::DimVector s(rank), st(rank);
        uint64_t seen = 0;
        for (int64_t i = 0; i < rank; ++i) {
          int64_t d = v[i];
          if (rank > 64 || !wrap(d, rank) || (seen >> d & 1)) return false;
          seen |= uint64_t{1} << d;
          s[i] = sizes[d];
          st[i] = strides[d];
        }
        sizes = s;
        strides = st;
        return true;
      }
      case Kind::Transpose: {
        if (v.size() != 2) return false;
        int64_t a = v[0], b = v[1];
        if (rank == 0) return (a == 0 || a == -1) && (b == 0 || b == -1);
        if (!wrap(a, rank) || !wrap(b, rank)) return false;
        std::swap(sizes[a], sizes[b]);
        std::swap(strides[a], strides[b]);
        return true;
      }
      case Kind::Unsqueeze: {  // the new dim's stride: 1 at the end, else what stepping over the next one takes
        if (v.size() != 1) return false;
        int64_t d = v[0];
        if (!wrap(d, rank + 1)) return false;
        const int64_t stride = d >= rank ? 1 : sizes[d] * strides[d];
        sizes.insert(sizes.begin() + d, 1);
        strides.insert(strides.begin() + d, stride);
        return true;
      }
      case Kind::Squeeze: {
        if (v.size() != 1) return false;
        int64_t d = v[0];
        if (rank == 0) return d == 0 || d == -1;
        if (!wrap(d, rank)) return false;
        if (sizes[d] == 1) {
          sizes.erase(sizes.begin() + d);
          strides.erase(strides.begin() + d);
        }
        return true;
      }
      case Kind::Select: {
        if (v.size() != 2 || rank == 0) return false;
        int64_t d = v[0], index = v[1];
        if (!wrap(d, rank)) return false;
        if (index < 0) index += sizes[d];
        if (index < 0 || index >= sizes[d]) return false;
        offset += index * strides[d];
        sizes.erase(sizes.begin() + d);
        strides.erase(strides.begin() + d);
        return true;
      }
      case Kind::Slice: {  // (dim, start, end, step), start and end clamped into the dimension
        if (v.size() != 4 || rank == 0) return false;
        int64_t d = v[0], step = v[3];
        if (!wrap(d, rank) || step <= 0) return false;
        const int64_t size = sizes[d];
        int64_t start = v[1] == kNone ? 0 : v[1], end = v[2] == kNone ? size : v[2];
        if (start < 0) start += size;
        if (end < 0) end += size;
        start = std::clamp<int64_t>(start, 0, size);
        end = std::clamp<int64_t>(end, start, size);
        offset += start * strides[d];
        sizes[d] = (end - start + step - 1) / step;
        strides[d] *= step;
        return true;
      }
      case Kind::Expand: {  // new leading dims and size-1 dims broadcast with stride 0; -1 keeps a size
        const int64_t out_rank = static_cast<int64_t>(v.size());
        if (out_rank < rank) return false;
        at::DimVector s(out_rank), st(out_rank);
        for (int64_t i = out_rank - 1; i >= 0; --i) {
          const int64_t j = i - (out_rank - rank);
          int64_t size = v[i];
          if (j < 0) {
            if (size < 0) return false;
            s[i] = size;
            st[i] = 0;
            continue;
          }
          if (size == -1) size = sizes[j];
          if (sizes[j] == size) {
            s[i] = size;
            st[i] = strides[j];
          } else if (sizes[j] == 1 && size >= 0) {
            s[i] = size;
            st[i] = 0;
          } else {
            return false;
          }
        }
        sizes = s;
        strides = st;
        return true;
      }
      case Kind::View: {  // one -1 takes what the others leave; strides where the memory allows such a view
        int64_t numel = 1, known = 1, infer = -1;
        for (int64_t s : sizes) numel *= s;
        at::DimVector shape(v.begin(), v.end());
        for (size_t i = 0; i < shape.size(); ++i) {
          if (shape[i] == -1) {
            if (infer >= 0) return false;
            infer = static_cast<int64_t>(i);
          } else if (shape[i] < 0) {
            return false;
          } else {
            known *= shape[i];
          }
        }
        if (infer >= 0) {
          if (known == 0 || numel % known != 0) return false;
          shape[infer] = numel / known;
        } else if (known != numel) {
          return false;
        }
        std::optional<at::DimVector> st = at::detail::computeStride(sizes, strides, shape);
        if (!st) return false;
        sizes = shape;
        strides = *st;
        return true;
      }
    }
    return false;
  }
};

// An elementwise ATen op of two tensors run into an operand that dies at this step (point 5 above). Per call
// the operand must be held by its buffer alone (the TensorImpl and its storage each referenced once: no view,
// alias or caller shares it), dense without overlap, of the result's dtype and sizes (the other operand
// broadcasts to it); otherwise the op runs as usual, into a new tensor.
class InPlaceBinary final : public FastPath {
 public:
  using Out = at::Tensor& (*)(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::Scalar&);
  Out out_fn = nullptr;  // add_out-like: (out, self, other, alpha); sub / mul / div wrap theirs
  std::string name;
  uint32_t self = 0, other = 0;  // buffers of the op's two operands
  int32_t output = -1;
  bool swap = false;  // the second operand dies: the result is written there (commutative ops only)
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Scalar alpha = 1;

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* a = buffer_tensor(buffers, self);
    const at::Tensor* b = buffer_tensor(buffers, other);
    if (!a || !b) return false;
    const at::Tensor& dst = swap ? *b : *a;
    const at::Tensor& src = swap ? *a : *b;
    if (dst.use_count() != 1 || !dst.has_storage() || dst.storage().use_count() != 1 || dst.scalar_type() != dtype ||
        !dst.device().is_cpu() || dst.requires_grad() || !dst.is_non_overlapping_and_dense() || src.dim() > dst.dim() ||
        dst.is_conj() || dst.is_neg())  // an out= result would keep the lazy conjugate or negation bit
      return false;
    for (int64_t d = 1; d <= src.dim(); ++d) {
      const int64_t s = src.size(-d);
      if (s != 1 && s != dst.size(-d)) return false;
    }
    at::Tensor target = dst;  // a second reference, for the output buffer
    if (swap) out_fn(target, src, target, alpha);
    else out_fn(target, target, src, alpha);
    buffers[output] = std::move(target);
    return true;
  }
  std::string describe() const override { return name + " in place"; }
};

at::Tensor& add_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
  return at::add_out(out, a, b, alpha);
}
at::Tensor& sub_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
  return at::sub_out(out, a, b, alpha);
}
at::Tensor& mul_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const c10::Scalar&) {
  return at::mul_out(out, a, b);
}
at::Tensor& div_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const c10::Scalar&) {
  return at::div_out(out, a, b);
}

PrimOp prim_of(const std::string& op) {
  static const std::unordered_map<std::string, PrimOp> table = {
      {"aten::sym_size.int", PrimOp::SymSize}, {"aten::sym_stride.int", PrimOp::SymStride},
      {"aten::sym_numel", PrimOp::SymNumel},   {"aten::sym_storage_offset", PrimOp::SymStorageOffset},
      {"prim::add", PrimOp::Add},             {"prim::sub", PrimOp::Sub},
      {"prim::mul", PrimOp::Mul},             {"prim::floordiv", PrimOp::FloorDiv},
      {"prim::mod", PrimOp::Mod},             {"prim::truediv", PrimOp::TrueDiv},
      {"prim::neg", PrimOp::Neg},             {"prim::pow", PrimOp::Pow},
      {"prim::eq", PrimOp::Eq},               {"prim::ne", PrimOp::Ne},
      {"prim::lt", PrimOp::Lt},               {"prim::le", PrimOp::Le},
      {"prim::gt", PrimOp::Gt},               {"prim::ge", PrimOp::Ge},
      {"prim::sym_float", PrimOp::SymFloat},  {"prim::sym_int", PrimOp::SymInt},
      {"prim::sym_max", PrimOp::SymMax},      {"prim::sym_min", PrimOp::SymMin},
      {"prim::sym_not", PrimOp::SymNot},     {"prim::ceil", PrimOp::Ceil},
      {"prim::floor", PrimOp::Floor},         {"prim::round", PrimOp::Round},
      {"prim::abs", PrimOp::Abs},
  };
  auto it = table.find(op);
  return it == table.end() ? PrimOp::None : it->second;
}

c10::IValue literal(const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::None: return c10::IValue();
    case Arg::Kind::Bool: return c10::IValue(a.b);
    case Arg::Kind::Int: return c10::IValue(a.i);
    case Arg::Kind::Float: return c10::IValue(a.f);
    case Arg::Kind::String: return c10::IValue(a.s);
    case Arg::Kind::Dtype:
    case Arg::Kind::Layout:
    case Arg::Kind::MemoryFormat: return c10::IValue(a.i);
    case Arg::Kind::Device: return c10::IValue(a.device);
    case Arg::Kind::Value:
    case Arg::Kind::List: break;
  }
  throw Error("internal: literal() on a value or list");
}

class PlanBuilder {
 public:
  PlanBuilder(const Graph& g, const std::unordered_map<std::string, at::Tensor>& constants,
              const std::unordered_map<int, GroupKernel>& kernels, const Tuning& tuning)
      : graph_(g), constants_(constants), kernels_(kernels), tuning_(tuning) {}

  Plan build() {
    plan_.num_inputs = graph_.inputs().size();
    for (const Value* v : graph_.inputs()) buffer_of(v);
    for (const auto& n : graph_.nodes()) {
      node_ = n.get();
      // An object is carried, not read: the dispatcher would want it as its schema's class, not as the
      // Python object the call holds (ember/ir.h, Type::Kind::Object).
      n->for_each_input([&](const Value* v) {
        if (v->type.kind == Type::Kind::Object) fail("reads %" + v->name + ", an opaque object");
      });
      if (n->op == "prim::constant") {
        bind_constant(*n);
        continue;
      }
      if (n->group >= 0 && kernels_.count(n->group)) {
        // The whole group runs as one kernel where its first member stands.
        if (emitted_groups_.insert(n->group).second) {
          plan_.steps.push_back(bind_kernel(*n, kernels_.at(n->group)));
          if (plan_.steps.back().kernel->compiling()) bind_stand_in(n->group, plan_.steps.back());
        }
        continue;
      }
      plan_.steps.push_back(bind(*n));
    }
    for (const Arg& a : graph_.outputs()) {
      PlanOutput out;
      if (a.is_value()) out.buffer = static_cast<int32_t>(buffer_of(a.value));
      else if (a.kind == Arg::Kind::List) throw Error("graph outputs must be values or literals, not lists");
      else out.constant = literal(a);
      plan_.outputs.push_back(std::move(out));
    }
    drop_unfit_stand_ins();
    plan_.num_buffers = buffers_.size();
    plan_.buffer_values.assign(buffers_.size(), nullptr);
    for (const auto& [value, buffer] : buffers_) plan_.buffer_values[buffer] = value;
    schedule_frees();
    // Registered fast paths, asked once frees are known: a step's output freed by the step itself is one
    // nothing reads (kernels/cuda/pool.cpp skips the indices no one reads).
    for (Step& step : plan_.steps) {
      if (step.op && !step.fast && step.node) step.fast = in_place_binary(*step.node, step);
      if (step.op && !step.fast && step.node)
        for (FastPathMaker make : fast_path_makers())
          if (!step.fast) step.fast = make(*step.node, step, tuning_);
      if (tuning_.exhaustive && step.op && step.node && is_cuda_convolution(*step.node)) step.benchmark_cudnn = true;
      if (step.kernel) step.label = "ember::" + step.kernel->describe();
      else if (step.fast && step.node) step.label = "ember::fast path " + step.node->op;
    }
    return std::move(plan_);
  }

 private:
  uint32_t buffer_of(const Value* v) {
    auto [it, inserted] = buffers_.emplace(v, static_cast<uint32_t>(buffers_.size()));
    return it->second;
  }

  [[noreturn]] void fail(const std::string& msg) const {
    std::string where = node_ ? " at node " + describe_node(*node_) : std::string();
    throw Error(msg + where);
  }
  static std::string describe_node(const Node& n) {
    std::string s = n.outputs.empty() ? std::string() : "%" + n.outputs[0]->name + " = ";
    return s + n.op;
  }

  void bind_constant(const Node& n) {
    if (n.args.size() != 1 || n.args[0].kind != Arg::Kind::String || n.outputs.size() != 1)
      fail("prim::constant takes one string naming the constant");
    auto it = constants_.find(n.args[0].s);
    if (it == constants_.end()) fail("constant '" + n.args[0].s + "' was not provided");
    plan_.constants.emplace_back(buffer_of(n.outputs[0]), c10::IValue(it->second));
  }

  Step bind_kernel(const Node& first, const GroupKernel& gk) {
    Step step;
    step.node = &first;
    step.kernel = gk.kernel;
    for (const Value* v : gk.reads) step.reads.push_back(buffer_of(v));
    for (const Value* v : gk.writes) step.writes.push_back(buffer_of(v));
    for (uint32_t b : step.writes) step.outputs.push_back(static_cast<int32_t>(b));
    return step;
  }

  // The group's nodes as ATen steps, in graph order, for a kernel step whose kernel is still compiling
  // (Step::stand_in). None where a node does not bind or the steps do not write every value the kernel
  // writes: the kernel's call then waits for its compile.
  void bind_stand_in(int group, Step& step) {
    auto steps = std::make_shared<std::vector<Step>>();
    const Node* at = node_;
    try {
      for (const auto& n : graph_.nodes())
        if (n->group == group) {
          node_ = n.get();
          steps->push_back(bind(*n));
        }
    } catch (const std::exception&) {  // ember::Error from bind, c10::Error from a schema
      node_ = at;
      return;
    }
    node_ = at;
    // Buffers written inside, read from outside, and each one's last reader inside.
    std::unordered_map<uint32_t, size_t> written, last_read;
    std::vector<uint32_t> outside;
    for (size_t s = 0; s < steps->size(); ++s) {
      for (uint32_t b : step_reads((*steps)[s])) {
        if (written.count(b)) last_read[b] = s;
        else if (std::find(step.reads.begin(), step.reads.end(), b) == step.reads.end() &&
                 std::find(outside.begin(), outside.end(), b) == outside.end())
          outside.push_back(b);
      }
      for (int32_t b : (*steps)[s].outputs)
        if (b >= 0) written.emplace(static_cast<uint32_t>(b), s);
    }
    for (uint32_t b : step.writes)
      if (!written.count(b)) return;
    // The group's intermediates go after their last reader inside (or their writer, where none reads them).
    for (const auto& [b, writer] : written) {
      if (std::find(step.writes.begin(), step.writes.end(), b) != step.writes.end()) continue;
      auto it = last_read.find(b);
      (*steps)[it == last_read.end() ? writer : it->second].frees.push_back(b);
    }
    step.stand_in = std::move(steps);
    step.stand_in_reads = std::move(outside);
  }

  // Stand-ins are dropped (their kernel's call waits instead) where they would read a buffer no earlier
  // step, input or constant holds (a value the kernel's program no longer reads, made later in the graph),
  // or free one that another step or the graph's outputs read (a value the program does not write).
  void drop_unfit_stand_ins() {
    std::vector<char> held(buffers_.size(), 0), read(buffers_.size(), 0);
    for (size_t i = 0; i < plan_.num_inputs; ++i) held[i] = 1;
    for (const auto& [b, value] : plan_.constants) held[b] = 1;
    for (const PlanOutput& o : plan_.outputs)
      if (o.buffer >= 0) read[o.buffer] = 1;
    for (const Step& step : plan_.steps)
      for (uint32_t b : step_reads(step)) read[b] = 1;
    for (Step& step : plan_.steps) {
      bool fits = true;
      if (step.stand_in) {
        for (uint32_t b : step.stand_in_reads) fits = fits && held[b];
        for (const Step& inner : *step.stand_in)
          for (uint32_t b : inner.frees) fits = fits && !read[b];
      }
      if (!fits) {
        step.stand_in.reset();
        step.stand_in_reads.clear();
      }
      for (int32_t b : step.outputs)
        if (b >= 0) held[b] = 1;
    }
  }

  Step bind(const Node& n) {
    Step step;
    step.node = &n;
    const OpInfo& info = op_info(n.op);  // throws for unknown ops
    step.prim = prim_of(n.op);
    if (step.prim != PrimOp::None) {
      if (!n.kwargs.empty()) fail("keyword arguments are not accepted by " + n.op);
      for (size_t i = 0; i < n.args.size(); ++i) {
        const Arg& a = n.args[i];
        if (a.is_value()) {
          step.stack.emplace_back();
          step.from_buffer.emplace_back(static_cast<uint32_t>(i), buffer_of(a.value));
        } else if (a.kind == Arg::Kind::List) {
          fail("list argument to " + n.op);
        } else {
          step.stack.push_back(literal(a));
        }
      }
    } else {
      if (info.has(kSubgraphs)) fail(n.op + " runs only with the subgraphs it names, compiled with the graph");
      if (info.handle == nullptr) fail("no runtime implementation for " + n.op);
      step.op = info.handle;
      bind_schema(n, step);
    }
    bind_outputs(n, step);
    if (step.op) step.fast = static_view(n, step);
    if (step.op && !step.fast) step.fast = symbolic_view(n, step);
    return step;
  }

  // Point 5: an InPlaceBinary for a CPU add/sub/mul/div.Tensor whose operand (a step's result, not a graph
  // input) is freed by this step and has the result's dtype, sizes and strides; null otherwise.
  std::shared_ptr<const FastPath> in_place_binary(const Node& n, const Step& step) const {
    static const std::unordered_map<std::string, std::pair<InPlaceBinary::Out, bool>> ops = {
        {"aten::add.Tensor", {&add_into, true}}, {"aten::sub.Tensor", {&sub_into, false}},
        {"aten::mul.Tensor", {&mul_into, true}}, {"aten::div.Tensor", {&div_into, false}}};
    auto it = ops.find(n.op);
    if (it == ops.end() || step.from_buffer.size() != 2 || !step.scalar_from_buffer.empty() || !step.lists.empty() ||
        step.outputs.size() != 1 || step.outputs[0] < 0 || n.outputs.size() != 1 || n.args.size() < 2 ||
        !n.args[0].is_value() || !n.args[1].is_value() || !n.outputs[0]->type.is_tensor())
      return nullptr;
    const TensorType& out = n.outputs[0]->type.tensor;
    if (out.device.type() != c10::kCPU) return nullptr;
    c10::Scalar alpha = 1;
    if (n.op == "aten::add.Tensor" || n.op == "aten::sub.Tensor") {
      if (step.stack.size() < 3 || !step.stack[2].isScalar()) return nullptr;
      alpha = step.stack[2].toScalar();
    }
    const auto [slot0, buf0] = step.from_buffer[0];
    const auto [slot1, buf1] = step.from_buffer[1];
    const uint32_t self = slot0 == 0 ? buf0 : buf1, other = slot0 == 0 ? buf1 : buf0;
    if (std::min(slot0, slot1) != 0 || std::max(slot0, slot1) != 1 || buffer_of_value(n.args[0].value) != self ||
        buffer_of_value(n.args[1].value) != other)
      return nullptr;
    auto candidate = [&](size_t arg) {
      const Value* v = n.args[arg].value;
      // Same strides too: the result then has the layout the IR gives it (a view after it may rely on that).
      if (!v->producer || !v->type.is_tensor() || v->type.tensor.dtype != out.dtype || v->type.tensor.sizes != out.sizes ||
          v->type.tensor.strides != out.strides)
        return false;
      const uint32_t b = arg == 0 ? self : other;
      return std::find(step.frees.begin(), step.frees.end(), b) != step.frees.end();
    };
    const bool commutative = it->second.second && (n.op != "aten::add.Tensor" || (alpha.isIntegral(false) && alpha.toLong() == 1));
    const bool first = candidate(0), second = !first && commutative && candidate(1);
    if (!first && !second) return nullptr;
    auto f = std::make_shared<InPlaceBinary>();
    f->out_fn = it->second.first;
    f->name = n.op.substr(6);  // after "aten::"
    f->self = self;
    f->other = other;
    f->output = step.outputs[0];
    f->swap = second;
    f->dtype = out.dtype;
    f->alpha = alpha;
    return f;
  }

  uint32_t buffer_of_value(const Value* v) const { return buffers_.at(v); }

  // A convolution (forward or backward) that ATen runs through cuDNN: one on CUDA tensors.
  static bool is_cuda_convolution(const Node& n) {
    static const std::unordered_set<std::string> ops = {"aten::convolution", "aten::_convolution",
                                                        "aten::cudnn_convolution", "aten::convolution_backward"};
    if (!ops.count(n.op) || n.outputs.empty()) return false;
    for (const Value* v : n.outputs)
      if (v->type.is_tensor() && v->type.tensor.device.is_cuda()) return true;
    return false;
  }

  static bool static_geometry(const Value* v) {
    if (!v->type.is_tensor()) return false;
    const TensorType& t = v->type.tensor;
    if (t.sizes.size() != t.strides.size()) return false;
    for (size_t d = 0; d < t.sizes.size(); ++d)
      if (!t.sizes[d].is_constant() || !t.strides[d].is_constant()) return false;
    return true;
  }

  // Elements of storage a tensor of these sizes and strides reaches from its offset (0 when it is empty).
  static int64_t extent_of(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
    int64_t last = 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 0) return 0;
      last += (sizes[d] - 1) * strides[d];
    }
    return last + 1;
  }

  static std::vector<int64_t> values_of(const std::vector<Dim>& dims) {
    std::vector<int64_t> out;
    for (const Dim& d : dims) out.push_back(d.value);
    return out;
  }

  // The view's geometry from running the op once on a meta tensor of the input's IR type; null where the
  // op is not a view, an argument is computed per call, or the result disagrees with the IR's type.
  std::shared_ptr<const FastPath> static_view(const Node& n, const Step& step) const {
    if (!step.op || !is_view_op(n.op) || step.from_buffer.size() != 1 || !step.scalar_from_buffer.empty() ||
        !step.lists.empty() || step.expand_list || step.outputs.size() != 1 || step.outputs[0] < 0 ||
        n.outputs.size() != 1 || !n.args[0].is_value())
      return nullptr;
    const Value* in = n.args[0].value;
    const Value* out = n.outputs[0];
    if (!static_geometry(in) || !static_geometry(out)) return nullptr;
    auto view = std::make_shared<StaticView>();
    view->input = step.from_buffer[0].second;
    view->output = step.outputs[0];
    view->in_sizes = values_of(in->type.tensor.sizes);
    view->in_strides = values_of(in->type.tensor.strides);
    view->out_sizes = values_of(out->type.tensor.sizes);
    view->out_strides = values_of(out->type.tensor.strides);
    try {
      // Compilation may run under Python dispatch modes (fake tensors): this call must reach ATen's meta kernels.
      c10::impl::ExcludeDispatchKeyGuard plain(c10::DispatchKeySet({c10::DispatchKey::Python,
                                                                    c10::DispatchKey::PythonTLSSnapshot}) |
                                               c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      // The op on meta inputs at storage offsets 0 and kShift: a relative view moves with its input, an
      // absolute one stays; one that does neither is left to the op.
      constexpr int64_t kShift = 1024;
      const at::TensorOptions meta = at::TensorOptions().dtype(in->type.tensor.dtype).device(at::kMeta);
      int64_t at_offset[2] = {0, 0};
      for (int probe = 0; probe < 2; ++probe) {
        const int64_t shift = probe * kShift;
        at::Tensor storage = at::empty({shift + extent_of(view->in_sizes, view->in_strides)}, meta);
        std::vector<c10::IValue> stack = step.stack;
        stack[step.from_buffer[0].first] = storage.as_strided(view->in_sizes, view->in_strides, shift);
        step.op->callBoxed(stack);
        if (stack.size() != 1 || !stack[0].isTensor()) return nullptr;
        const at::Tensor& r = stack[0].toTensor();
        if (r.sizes() != at::IntArrayRef(view->out_sizes) || r.strides() != at::IntArrayRef(view->out_strides)) return nullptr;
        at_offset[probe] = r.storage_offset() - shift;
      }
      if (at_offset[0] == at_offset[1]) {
        view->offset = at_offset[0];
      } else if (at_offset[0] == at_offset[1] + kShift) {
        view->absolute = true;
        view->offset = at_offset[0];
        view->out_extent = extent_of(view->out_sizes, view->out_strides);
      } else {
        return nullptr;
      }
    } catch (const std::exception&) {
      return nullptr;  // the op's own path will say what is wrong, per call
    }
    return view;
  }

  // A SymbolicView for a view op that static_view cannot precompute; null for other ops, or where an argument
  // is not an integer (or integer list) known as a constant or a buffer.
  static std::shared_ptr<const FastPath> symbolic_view(const Node& n, const Step& step) {
    using Kind = SymbolicView::Kind;
    // Per op: its kind and the stack slots of its integer arguments (-1: slot 1 is a list of them).
    static const std::unordered_map<std::string, std::pair<Kind, std::vector<int>>> ops = {
        {"aten::view", {Kind::View, {-1}}},           {"aten::_unsafe_view", {Kind::View, {-1}}},
        {"aten::permute", {Kind::Permute, {-1}}},     {"aten::expand", {Kind::Expand, {-1}}},
        {"aten::unsqueeze", {Kind::Unsqueeze, {1}}},  {"aten::squeeze.dim", {Kind::Squeeze, {1}}},
        {"aten::select.int", {Kind::Select, {1, 2}}}, {"aten::slice.Tensor", {Kind::Slice, {1, 2, 3, 4}}},
        {"aten::transpose.int", {Kind::Transpose, {1, 2}}}, {"aten::alias", {Kind::Alias, {}}}};
    auto it = ops.find(n.op);
    if (it == ops.end() || !step.op || !step.scalar_from_buffer.empty() || step.expand_list || step.outputs.size() != 1 ||
        step.outputs[0] < 0 || n.outputs.size() != 1 || n.args.empty() || !n.args[0].is_value() || step.from_buffer.empty() ||
        step.from_buffer[0].first != 0)
      return nullptr;
    if (n.op == "aten::expand" && step.stack.size() > 2 && !(step.stack[2].isBool() && !step.stack[2].toBool()))
      return nullptr;  // implicit=True: only autograd reads it, but keep to the plain form
    auto view = std::make_shared<SymbolicView>();
    view->kind = it->second.first;
    view->input = step.from_buffer[0].second;
    view->output = step.outputs[0];
    auto from_buffer = [&](uint32_t slot) -> int32_t {
      for (size_t i = 1; i < step.from_buffer.size(); ++i)
        if (step.from_buffer[i].first == slot) return static_cast<int32_t>(step.from_buffer[i].second);
      return -1;
    };
    size_t used = 1;  // from_buffer entries accounted for
    for (int slot : it->second.second) {
      if (slot < 0) {  // the list at slot 1
        const ListSlot* list = nullptr;
        for (const ListSlot& l : step.lists)
          if (l.slot == 1) list = &l;
        if (list) {
          if (list->elem != ListSlot::Elem::Int || list->item_buffer.size() != list->items.size()) return nullptr;
          for (size_t i = 0; i < list->items.size(); ++i) {
            if (list->item_buffer[i] >= 0) view->ints.push_back({0, list->item_buffer[i], false});
            else if (list->items[i].isInt()) view->ints.push_back({list->items[i].toInt(), -1, false});
            else return nullptr;
          }
        } else if (step.stack.size() > 1 && step.stack[1].isIntList()) {
          for (int64_t x : step.stack[1].toIntVector()) view->ints.push_back({x, -1, false});
        } else {
          return nullptr;
        }
        continue;
      }
      const auto s = static_cast<uint32_t>(slot);
      if (const int32_t b = from_buffer(s); b >= 0) {
        view->ints.push_back({0, b, false});
        ++used;
      } else if (s < step.stack.size() && step.stack[s].isInt()) {
        view->ints.push_back({step.stack[s].toInt(), -1, false});
      } else if (s < step.stack.size() && step.stack[s].isNone()) {
        view->ints.push_back({0, -1, true});
      } else {
        return nullptr;
      }
    }
    if (used != step.from_buffer.size()) return nullptr;  // a buffer argument this rule does not read
    if (step.lists.size() > (it->second.second == std::vector<int>{-1} ? 1u : 0u)) return nullptr;
    return view;
  }

  void bind_schema(const Node& n, Step& step) {
    const c10::FunctionSchema& schema = step.op->schema();
    const auto& params = schema.arguments();
    if (n.args.size() > params.size())
      fail("too many arguments (" + std::to_string(n.args.size()) + ") for " + schema.name());
    std::vector<const Arg*> bound(params.size(), nullptr);
    for (size_t i = 0; i < n.args.size(); ++i) bound[i] = &n.args[i];
    for (const auto& [name, arg] : n.kwargs) {
      auto idx = schema.argumentIndexWithName(name);
      if (!idx) fail("unknown keyword argument '" + name + "' for " + n.op);
      if (bound[*idx]) fail("argument '" + name + "' given twice");
      bound[*idx] = &arg;
    }
    step.stack.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const c10::Argument& p = params[i];
      if (!bound[i]) {
        if (!p.default_value()) fail("missing argument '" + p.name() + "' for " + n.op);
        step.stack[i] = *p.default_value();
        continue;
      }
      bind_arg(*bound[i], p, static_cast<uint32_t>(i), step);
    }
  }

  void bind_arg(const Arg& a, const c10::Argument& param, uint32_t slot, Step& step) {
    c10::TypePtr type = param.real_type();
    if (auto opt = type->cast<c10::OptionalType>()) {
      if (a.kind == Arg::Kind::None) {
        step.stack[slot] = c10::IValue();
        return;
      }
      type = opt->getElementType();
    }
    if (a.kind == Arg::Kind::None && type->kind() == c10::TypeKind::TensorType) {
      // None for a non-optional Tensor (attn_bias of the attention backwards): Python's argument parser
      // passes an undefined tensor, and so does ember.
      step.stack[slot] = at::Tensor();
      return;
    }
    if (a.is_value()) {
      bool scalar_into_tensor = type->kind() == c10::TypeKind::TensorType && !a.value->type.is_tensor();
      (scalar_into_tensor ? step.scalar_from_buffer : step.from_buffer).emplace_back(slot, buffer_of(a.value));
      return;
    }
    if (auto list = type->cast<c10::ListType>()) {
      bind_list(a, param, list->getElementType(), slot, step);
      return;
    }
    if (a.kind == Arg::Kind::List) fail("list given for non-list argument '" + param.name() + "'");
    c10::IValue v = literal(a);
    if (type->kind() == c10::TypeKind::FloatType && v.isInt()) v = c10::IValue(static_cast<double>(v.toInt()));
    if (type->kind() == c10::TypeKind::TensorType && (v.isInt() || v.isDouble() || v.isBool())) v = wrap_scalar(v);
    step.stack[slot] = std::move(v);
  }

  void bind_list(const Arg& a, const c10::Argument& param, const c10::TypePtr& elem_type, uint32_t slot,
                 Step& step) {
    ListSlot list;
    list.slot = slot;
    c10::TypePtr elem = elem_type;
    if (auto opt = elem->cast<c10::OptionalType>()) {
      if (opt->getElementType()->kind() != c10::TypeKind::TensorType) fail("unsupported list type for " + param.name());
      list.elem = ListSlot::Elem::OptionalTensor;
    } else {
      switch (elem->kind()) {
        case c10::TypeKind::IntType:
        case c10::TypeKind::SymIntType: list.elem = ListSlot::Elem::Int; break;
        case c10::TypeKind::FloatType: list.elem = ListSlot::Elem::Float; break;
        case c10::TypeKind::BoolType: list.elem = ListSlot::Elem::Bool; break;
        case c10::TypeKind::TensorType: list.elem = ListSlot::Elem::Tensor; break;
        default: fail("unsupported list element type " + elem->str() + " for '" + param.name() + "'");
      }
    }
    std::vector<Arg> items;
    if (a.kind == Arg::Kind::List) {
      items = a.list;
    } else if (list.elem == ListSlot::Elem::Int && a.kind == Arg::Kind::Int) {
      items.assign(param.N().value_or(1), a);  // int[2] stride=1 means [1, 1]
    } else {
      fail("expected a list for '" + param.name() + "'");
    }
    bool has_values = false;
    for (size_t i = 0; i < items.size(); ++i) {
      const Arg& item = items[i];
      if (item.is_value()) {
        list.items.emplace_back();
        list.item_buffer.push_back(static_cast<int32_t>(buffer_of(item.value)));
        has_values = true;
      } else if (item.kind == Arg::Kind::List) {
        fail("nested list in '" + param.name() + "'");
      } else {
        c10::IValue v = literal(item);
        if (list.elem == ListSlot::Elem::Float && v.isInt()) v = c10::IValue(static_cast<double>(v.toInt()));
        list.items.push_back(std::move(v));
        list.item_buffer.push_back(-1);
      }
    }
    if (!has_values) {
      step.stack[slot] = assemble_list(list, nullptr);  // fully constant: build once now
      return;
    }
    step.lists.push_back(std::move(list));
  }

  void bind_outputs(const Node& n, Step& step) {
    size_t returns = step.op ? step.op->schema().returns().size() : 1;
    if (step.op && returns == 1 && step.op->schema().returns()[0].type()->kind() == c10::TypeKind::ListType) {
      step.expand_list = true;
    } else if (n.outputs.size() != returns) {
      fail("node has " + std::to_string(n.outputs.size()) + " outputs but the op returns " + std::to_string(returns));
    }
    for (const Value* v : n.outputs) step.outputs.push_back(static_cast<int32_t>(buffer_of(v)));
    if (step.outputs.empty() && returns > 0 && !step.expand_list) step.outputs.assign(returns, -1);
  }

  // Releases each buffer after the last step that reads it, unless a graph output holds it.
  void schedule_frees() {
    std::vector<int64_t> last_use(buffers_.size(), -1);  // -1: never read
    std::vector<bool> is_output(buffers_.size(), false);
    for (const PlanOutput& o : plan_.outputs)
      if (o.buffer >= 0) is_output[o.buffer] = true;
    for (size_t s = 0; s < plan_.steps.size(); ++s) {
      const Step& step = plan_.steps[s];
      for (auto [slot, buf] : step.from_buffer) last_use[buf] = static_cast<int64_t>(s);
      for (auto [slot, buf] : step.scalar_from_buffer) last_use[buf] = static_cast<int64_t>(s);
      for (uint32_t buf : step.reads) last_use[buf] = static_cast<int64_t>(s);
      for (uint32_t buf : step.stand_in_reads) last_use[buf] = static_cast<int64_t>(s);
      for (const ListSlot& l : step.lists)
        for (int32_t buf : l.item_buffer)
          if (buf >= 0) last_use[buf] = static_cast<int64_t>(s);
    }
    for (size_t b = 0; b < buffers_.size(); ++b) {
      if (is_output[b]) continue;
      if (last_use[b] >= 0) plan_.steps[last_use[b]].frees.push_back(static_cast<uint32_t>(b));
      else if (b < plan_.num_inputs) plan_.unused_inputs.push_back(static_cast<uint32_t>(b));
    }
    // Step outputs nobody reads are released right after their step.
    for (size_t s = 0; s < plan_.steps.size(); ++s)
      for (int32_t b : plan_.steps[s].outputs)
        if (b >= 0 && last_use[b] < 0 && !is_output[b]) plan_.steps[s].frees.push_back(static_cast<uint32_t>(b));
  }

 private:
  const Graph& graph_;
  const std::unordered_map<std::string, at::Tensor>& constants_;
  const std::unordered_map<int, GroupKernel>& kernels_;
  const Tuning& tuning_;
  std::unordered_set<int> emitted_groups_;
  Plan plan_;
  std::unordered_map<const Value*, uint32_t> buffers_;
  const Node* node_ = nullptr;
};

}  // namespace

void register_fast_path(FastPathMaker maker) { fast_path_makers().push_back(maker); }

std::optional<uint32_t> slot_buffer(const Step& step, uint32_t slot) {
  for (auto [s, b] : step.from_buffer)
    if (s == slot) return b;
  return std::nullopt;
}

namespace {
thread_local bool warming = false;
}  // namespace
bool warming_for_graphs() { return warming; }
WarmingForGraphs::WarmingForGraphs() : before_(warming) { warming = true; }
WarmingForGraphs::~WarmingForGraphs() { warming = before_; }

bool TuningBudget::left() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spent_ < seconds_;
}

void TuningBudget::spend(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  spent_ += seconds;
}

Plan build_plan(const Graph& graph, const std::unordered_map<std::string, at::Tensor>& constants,
                const std::unordered_map<int, GroupKernel>& kernels, const Tuning& tuning) {
  // Tensors made here (wrapped scalars) must be real even when the caller traces under a fake or other
  // Python dispatch mode, as AOTAutograd does while it calls its compilers.
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return PlanBuilder(graph, constants, kernels, tuning).build();
}

namespace {

// Steps whose result may alias an input (the views, and ops that may return a view or the input
// itself): a folded value they read would reach their reader as the constant's own memory.
bool may_alias(const std::string& op) {
  static const std::unordered_set<std::string> sometimes = {
      "aten::reshape", "aten::contiguous", "aten::split.Tensor", "aten::split_with_sizes", "aten::unbind.int",
      "aten::chunk", "aten::expand_as", "aten::view_as", "aten::detach", "aten::lift_fresh", "aten::to.dtype",
      "aten::to.device", "aten::to.dtype_layout", "aten::type_as", "aten::real"};
  return is_view_op(op) || sometimes.count(op) > 0;
}

bool foldable_op(const Step& st) {
  if (st.kernel || !st.node || (!st.op && st.prim == PrimOp::None)) return false;
  try {
    const OpInfo& info = op_info(st.node->op);
    return !info.has(kRandom) && !info.has(kMutates);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

namespace {

// Whether a plan holds an in-place write: one could change a folded or cached value after the fact.
bool writes_in_place(const Plan& plan) {
  for (const Step& st : plan.steps) {
    if (!st.node) continue;
    try {
      if (op_info(st.node->op).has(kMutates)) return true;
    } catch (const std::exception&) {
      return true;
    }
  }
  return false;
}

// Per step: whether it reads nothing but `known` buffers (and results of such steps) and `may_take(step)`.
// A taken value must not reach the caller, directly or through steps that may hand it on as an alias:
// the caller could write to it, and every later call would see that. With `own_results`, a taken step that may return an
// alias of what it reads (a view of a parameter) is taken only when every reader is taken too: the
// values later steps read must be tensors of their own.
template <class MayTake>
std::vector<char> steps_over(const Plan& plan, const std::vector<char>& seed, MayTake may_take, bool own_results) {
  const size_t n = plan.steps.size();
  std::vector<int64_t> producer(plan.num_buffers, -1);
  for (size_t s = 0; s < n; ++s)
    for (int32_t b : plan.steps[s].outputs)
      if (b >= 0) producer[static_cast<size_t>(b)] = static_cast<int64_t>(s);
  // What the caller may receive: the graph outputs and, through steps that may return an alias of what
  // they read (a view, a reshape), whatever those read.
  std::vector<char> escapes(plan.num_buffers, 0);
  for (const PlanOutput& o : plan.outputs)
    if (o.buffer >= 0) escapes[static_cast<size_t>(o.buffer)] = 1;
  for (size_t s = n; s-- > 0;) {
    const Step& st = plan.steps[s];
    if (!st.node || !may_alias(st.node->op)) continue;
    bool out = false;
    for (int32_t b : st.outputs) out = out || (b >= 0 && escapes[static_cast<size_t>(b)]);
    if (out)
      for (uint32_t b : step_reads(st)) escapes[b] = 1;
  }
  std::vector<char> blocked(n, 0), taken(n, 0), known(plan.num_buffers, 0);
  for (bool changed = true; changed;) {
    changed = false;
    known = seed;
    std::fill(taken.begin(), taken.end(), 0);
    for (size_t s = 0; s < n; ++s) {
      const Step& st = plan.steps[s];
      if (blocked[s] || !may_take(st)) continue;
      bool all_known = true;
      for (uint32_t b : step_reads(st)) all_known = all_known && known[b];
      if (!all_known) continue;
      taken[s] = 1;
      for (int32_t b : st.outputs)
        if (b >= 0) known[static_cast<size_t>(b)] = 1;
    }
    auto block = [&](int64_t b) {
      const int64_t s = b >= 0 ? producer[static_cast<size_t>(b)] : -1;
      if (s >= 0 && taken[static_cast<size_t>(s)] && !blocked[static_cast<size_t>(s)]) {
        blocked[static_cast<size_t>(s)] = 1;
        changed = true;
      }
    };
    for (size_t b = 0; b < plan.num_buffers; ++b)
      if (escapes[b]) block(static_cast<int64_t>(b));
    if (own_results)
      for (size_t s = 0; s < n; ++s) {
        if (taken[s] || !plan.steps[s].node) continue;
        for (uint32_t b : step_reads(plan.steps[s])) {
          const int64_t p = producer[b];
          if (p >= 0 && plan.steps[static_cast<size_t>(p)].node && may_alias(plan.steps[static_cast<size_t>(p)].node->op))
            block(b);
        }
      }
  }
  return taken;
}

// Buffers written by `taken` steps and read by the others.
std::vector<uint32_t> results_of(const Plan& plan, const std::vector<char>& taken) {
  std::vector<char> read_later(plan.num_buffers, 0);
  for (size_t s = 0; s < plan.steps.size(); ++s)
    if (!taken[s])
      for (uint32_t b : step_reads(plan.steps[s])) read_later[b] = 1;
  std::vector<uint32_t> out;
  for (size_t s = 0; s < plan.steps.size(); ++s)
    if (taken[s])
      for (int32_t b : plan.steps[s].outputs)
        if (b >= 0 && read_later[static_cast<size_t>(b)]) out.push_back(static_cast<uint32_t>(b));
  return out;
}

// Moves the taken steps out of plan.steps, in order, into *moved (or drops them).
size_t remove_steps(Plan& plan, const std::vector<char>& taken, std::vector<Step>* moved) {
  std::vector<Step> kept;
  kept.reserve(plan.steps.size());
  size_t count = 0;
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    if (!taken[s]) {
      kept.push_back(std::move(plan.steps[s]));
      continue;
    }
    ++count;
    if (moved) moved->push_back(std::move(plan.steps[s]));
  }
  plan.steps = std::move(kept);
  return count;
}

}  // namespace

size_t fold_constant_steps(Plan& plan) {
  if (writes_in_place(plan)) return 0;
  std::vector<char> seed(plan.num_buffers, 0);
  for (const auto& c : plan.constants) seed[c.first] = 1;
  std::vector<char> folded = steps_over(plan, seed, foldable_op, false);
  if (std::find(folded.begin(), folded.end(), 1) == folded.end()) return 0;

  std::vector<c10::IValue> buffers(plan.num_buffers), stack;
  for (const auto& [b, v] : plan.constants) buffers[b] = v;
  try {
    c10::impl::ExcludeDispatchKeyGuard real(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}) |
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      if (!folded[s]) continue;
      Step once = plan.steps[s];
      once.frees.clear();  // frees were planned for every step's reads: the kept steps' too
      run_step(once, buffers, stack);
    }
  } catch (const std::exception&) {
    return 0;  // left to run per call, where an error names its node
  }
  for (uint32_t b : results_of(plan, folded)) plan.constants.emplace_back(b, buffers[b]);
  const size_t count = remove_steps(plan, folded, nullptr);
  plan.folded_steps += count;
  return count;
}

size_t hoist_parameter_steps(Plan& plan, const std::vector<bool>& pinned) {
  if (!plan.cached_steps.empty() || writes_in_place(plan)) return 0;
  std::vector<char> seed(plan.num_buffers, 0);
  for (const auto& c : plan.constants) seed[c.first] = 1;
  bool any = false;
  for (size_t i = 0; i < plan.num_inputs && i < pinned.size(); ++i) {
    seed[i] = pinned[i] ? 1 : 0;
    any = any || pinned[i];
  }
  if (!any) return 0;
  // Generated kernels and ATen ops; not shape arithmetic (host values are as cheap to recompute as to check).
  auto may_take = [](const Step& st) { return st.kernel != nullptr || (st.op != nullptr && foldable_op(st)); };
  std::vector<char> taken = steps_over(plan, seed, may_take, true);
  // Worth it only where a step does device work: views alone cost nothing to run.
  bool work = false;
  for (size_t s = 0; s < plan.steps.size(); ++s)
    work = work || (taken[s] && (plan.steps[s].kernel || !is_view_op(plan.steps[s].node->op)));
  if (!work) return 0;
  plan.cached_results = results_of(plan, taken);
  std::vector<char> key(plan.num_buffers, 0);
  for (size_t s = 0; s < plan.steps.size(); ++s)
    if (taken[s])
      for (uint32_t b : step_reads(plan.steps[s]))
        if (b < plan.num_inputs && !key[b]) {
          key[b] = 1;
          plan.cached_keys.push_back(b);
        }
  std::sort(plan.cached_keys.begin(), plan.cached_keys.end());
  const size_t moved = remove_steps(plan, taken, &plan.cached_steps);
  // Their frees were planned for the original order: a parameter whose last use was a cached step may be
  // read by steps that now run after it (GPT-2's embedding reads the weight the padded LM head is made of).
  for (Step& st : plan.cached_steps) st.frees.clear();
  return moved;
}

at::Tensor wrap_scalar(const c10::IValue& v) {
  at::Tensor t;
  if (v.isBool()) t = at::scalar_tensor(v.toBool(), at::TensorOptions().dtype(at::kBool));
  else if (v.isInt()) t = at::scalar_tensor(v.toInt(), at::TensorOptions().dtype(at::kLong));
  else t = at::scalar_tensor(v.toDouble(), at::TensorOptions().dtype(at::kDouble));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

c10::IValue assemble_list(const ListSlot& l, const std::vector<c10::IValue>* buffers) {
  auto item = [&](size_t i) -> const c10::IValue& {
    return l.item_buffer[i] >= 0 ? (*buffers)[l.item_buffer[i]] : l.items[i];
  };
  size_t n = l.items.size();
  switch (l.elem) {
    case ListSlot::Elem::Int: {
      c10::List<int64_t> out;
      out.reserve(n);
      for (size_t i = 0; i < n; ++i) out.push_back(item(i).toInt());
      return c10::IValue(std::move(out));
    }
    case ListSlot::Elem::Float: {
      c10::List<double> out;
      out.reserve(n);
      for (size_t i = 0; i < n; ++i) out.push_back(item(i).toDouble());
      return c10::IValue(std::move(out));
    }
    case ListSlot::Elem::Bool: {
      c10::List<bool> out;
      out.reserve(n);
      for (size_t i = 0; i < n; ++i) out.push_back(item(i).toBool());
      return c10::IValue(std::move(out));
    }
    case ListSlot::Elem::Tensor: {
      c10::List<at::Tensor> out;
      out.reserve(n);
      for (size_t i = 0; i < n; ++i) out.push_back(item(i).toTensor());
      return c10::IValue(std::move(out));
    }
    case ListSlot::Elem::OptionalTensor: {
      c10::List<std::optional<at::Tensor>> out;
      out.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        const c10::IValue& v = item(i);
        out.push_back(v.isNone() ? std::nullopt : std::optional<at::Tensor>(v.toTensor()));
      }
      return c10::IValue(std::move(out));
    }
  }
  return c10::IValue();
}

}  // namespace ember

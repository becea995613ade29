// ember's graph IR: a Graph owns Nodes in topological order and the SSA Values they define.
//
// Ops are named by their ATen schema name with overload ("aten::add.Tensor", "aten::sin") or by an
// ember primitive ("prim::constant", "prim::add"). Arguments are kept as the FX graph gave them:
// positional, then keyword; the runtime binds them to the op's schema. Sizes and strides are Dims,
// which may be symbolic ("s0", "2*s0") from the start, so nothing here assumes static shapes.
//
// The text form (ir_text.cpp) round-trips exactly: print(parse(text)) == text.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Layout.h>
#include <c10/core/MemoryFormat.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember {

// A size or stride: a constant, or an expression over named symbols kept in canonical text form.
struct Dim {
  int64_t value = 0;
  std::string expr;  // empty for a constant

  static Dim constant(int64_t v) { return Dim{v, {}}; }
  static Dim symbolic(std::string e) { return Dim{0, std::move(e)}; }
  bool is_constant() const { return expr.empty(); }
  bool operator==(const Dim& o) const { return value == o.value && expr == o.expr; }
};

struct TensorType {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<Dim> sizes;
  std::vector<Dim> strides;
  c10::Device device{c10::kCPU};
  bool operator==(const TensorType& o) const {
    return dtype == o.dtype && sizes == o.sizes && strides == o.strides && device == o.device;
  }
};

// A 2-D type whose sizes and strides are all constants (what the GEMM rewrites and fast paths need).
inline bool static_matrix(const TensorType& t) {
  if (t.sizes.size() != 2 || t.strides.size() != 2) return false;
  for (int d = 0; d < 2; ++d)
    if (!t.sizes[d].is_constant() || !t.strides[d].is_constant()) return false;
  return true;
}

// Object: an opaque object the graph only carries, from an input to outputs (a DTensor's DeviceMesh, which
// AOTAutograd flattens beside its local tensor); no op may read one (build_plan refuses).
struct Type {
  enum class Kind { Tensor, Int, Float, Bool, None, Object };
  Kind kind = Kind::None;
  TensorType tensor;  // meaningful for Kind::Tensor only

  static Type of_tensor(TensorType t) { return Type{Kind::Tensor, std::move(t)}; }
  static Type of(Kind k) { return Type{k, {}}; }
  bool is_tensor() const { return kind == Kind::Tensor; }
};

class Node;

class Value {
 public:
  std::string name;
  Type type;
  Node* producer = nullptr;  // nullptr for graph inputs
  int output_index = 0;
};

// One argument of a node or one graph output: a value reference, a literal, or a list of these.
struct Arg {
  enum class Kind { Value, None, Bool, Int, Float, String, Dtype, Device, Layout, MemoryFormat, List };
  Kind kind = Kind::None;
  Value* value = nullptr;
  bool b = false;
  int64_t i = 0;  // Int, and the enum value of Dtype / Layout / MemoryFormat
  double f = 0.0;
  std::string s;
  c10::Device device{c10::kCPU};
  std::vector<Arg> list;

  static Arg none() { return Arg{}; }
  static Arg of(Value* v) { Arg a; a.kind = Kind::Value; a.value = v; return a; }
  static Arg of_bool(bool v) { Arg a; a.kind = Kind::Bool; a.b = v; return a; }
  static Arg of_int(int64_t v) { Arg a; a.kind = Kind::Int; a.i = v; return a; }
  static Arg of_float(double v) { Arg a; a.kind = Kind::Float; a.f = v; return a; }
  static Arg of_string(std::string v) { Arg a; a.kind = Kind::String; a.s = std::move(v); return a; }
  static Arg of_dtype(c10::ScalarType t) { Arg a; a.kind = Kind::Dtype; a.i = static_cast<int64_t>(t); return a; }
  static Arg of_device(c10::Device d) { Arg a; a.kind = Kind::Device; a.device = d; return a; }
  static Arg of_layout(c10::Layout l) { Arg a; a.kind = Kind::Layout; a.i = static_cast<int64_t>(l); return a; }
  static Arg of_memory_format(c10::MemoryFormat m) {
    Arg a; a.kind = Kind::MemoryFormat; a.i = static_cast<int64_t>(m); return a;
  }
  static Arg of_list(std::vector<Arg> items) { Arg a; a.kind = Kind::List; a.list = std::move(items); return a; }

  bool is_value() const { return kind == Kind::Value; }
  // Calls f(Value*&) on every value referenced, lists included.
  template <class F> void for_each_value(F&& f) {
    if (kind == Kind::Value) f(value);
    for (Arg& a : list) a.for_each_value(f);
  }
  template <class F> void for_each_value(F&& f) const {
    if (kind == Kind::Value) f(static_cast<const Value*>(value));
    for (const Arg& a : list) a.for_each_value(f);
  }
};

class Node {
 public:
  std::string op;  // "aten::add.Tensor", "prim::constant", ...
  std::vector<Arg> args;
  std::vector<std::pair<std::string, Arg>> kwargs;
  std::vector<Value*> outputs;
  int group = -1;  // fusion group set by the fuse pass ("#3" in the text form); -1: none

  // The argument at schema position `position`, given positionally or as the keyword `name`; null if absent.
  const Arg* arg(size_t position, const char* name) const {
    if (position < args.size()) return &args[position];
    for (const auto& [k, v] : kwargs)
      if (k == name) return &v;
    return nullptr;
  }

  template <class F> void for_each_input(F&& f) {
    for (Arg& a : args) a.for_each_value(f);
    for (auto& kv : kwargs) kv.second.for_each_value(f);
  }
  template <class F> void for_each_input(F&& f) const {
    for (const Arg& a : args) a.for_each_value(f);
    for (const auto& kv : kwargs) kv.second.for_each_value(f);
  }
};

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&&) = default;
  Graph& operator=(Graph&&) = default;

  Value* add_input(std::string name, Type type);
  // Appends a node; its outputs are created from (name, type) pairs.
  Node* add_node(std::string op, std::vector<Arg> args, std::vector<std::pair<std::string, Arg>> kwargs,
                 std::vector<std::pair<std::string, Type>> outputs);
  void set_outputs(std::vector<Arg> outputs) { outputs_ = std::move(outputs); }

  const std::vector<Value*>& inputs() const { return inputs_; }
  const std::vector<std::unique_ptr<Node>>& nodes() const { return nodes_; }
  const std::vector<Arg>& outputs() const { return outputs_; }
  std::vector<Arg>& mutable_outputs() { return outputs_; }

  // Drops the nodes for which drop(node) is true. Their outputs must no longer be used.
  template <class Pred> void remove_nodes_if(Pred drop) {
    std::vector<std::unique_ptr<Node>> kept;
    kept.reserve(nodes_.size());
    for (auto& n : nodes_)
      if (!drop(*n)) kept.push_back(std::move(n));
    nodes_ = std::move(kept);
  }
  // Moves the last `count` nodes, in their order, to just before `anchor` (which must precede them).
  void move_last_before(size_t count, const Node* anchor);
  // Puts the nodes in `order`, which must hold each of them once.
  void reorder(const std::vector<const Node*>& order);
  // Rewrites every use (node arguments and graph outputs) through `map`; entries map old -> new.
  void replace_uses(const std::vector<std::pair<const Value*, Value*>>& map);

  // Checks SSA form, unique names and definition before use; throws ember::Error if broken.
  void verify() const;

 private:
  std::vector<std::unique_ptr<Value>> values_;
  std::vector<Value*> inputs_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<Arg> outputs_;
};

// Text form. print() is canonical; parse() accepts exactly what print() writes (and throws ember::Error
// with a line number on anything else).
std::string print(const Graph& g);
Graph parse(const std::string& text);
// The right-hand side of one node's line without its group: "aten::add.Tensor(%x, 1.0)".
std::string print_call(const Node& n);

// A size or stride as a product of an integer and symbols, as sympy prints it ("2*s0*s1**2"): its constant
// and its symbols, a power repeated, sorted, so that equal products compare equal however printed.
// Anything else (a sum, a quotient, parentheses) is one opaque factor, its text in parentheses, which
// only the same text matches.
struct DimProduct {
  int64_t constant = 1;
  std::vector<std::string> factors;
  static DimProduct of(const Dim& d);
  DimProduct& operator*=(const DimProduct& o);
  bool operator==(const DimProduct& o) const { return constant == o.constant && factors == o.factors; }
};

// Whether a tensor type is row-major contiguous, proven from the type: constant strides compare exactly,
// symbolic ones as products (sympy prints [s0, s1, s1]'s outer stride "s1**2"). Size-1 dimensions take any
// stride. Unprovable means no.
bool row_major(const TensorType& t);

// The element count as a product (DimProduct): equal counts of symbolic types compare equal.
DimProduct element_count(const TensorType& t);

// The dimensions of a dense tensor type, from the outermost in memory to the innermost (size-1 dimensions
// left out); empty where the strides are no permutation of a contiguous layout. Symbolic sizes and strides
// compare as products (DimProduct), so dynamic shapes keep their layout. Row-major types give their
// dimensions in order; channels_last [N, C, H, W] gives N, H, W, C.
std::vector<int> memory_order(const TensorType& t);

// For a sum / mean / amax / amin over a prefix [0, k) of its input's dimensions (k below the rank,
// dtype unchanged, not every reduced dim a constant 1): k. Else 0. A bias gradient (a sum over the batch)
// and a layer norm's weight gradient ([0, 1] of [B, S, H]) are such reductions, which fused kernels
// run as columns (kernels/program.h).
size_t reduced_leading_dims(const Node& n);

// Short dtype names used by the text form ("f32", "bf16", "i64", "b8", ...).
const char* dtype_name(c10::ScalarType t);

}  // namespace ember

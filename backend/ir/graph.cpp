// Graph construction, use rewriting and the verifier.
#include "ember/error.h"
#include "ember/ir.h"

#include <algorithm>
#include <cctype>

#include <unordered_map>
#include <unordered_set>

namespace ember {

Value* Graph::add_input(std::string name, Type type) {
  auto v = std::make_unique<Value>();
  v->name = std::move(name);
  v->type = std::move(type);
  inputs_.push_back(v.get());
  values_.push_back(std::move(v));
  return inputs_.back();
}

Node* Graph::add_node(std::string op, std::vector<Arg> args, std::vector<std::pair<std::string, Arg>> kwargs,
                      std::vector<std::pair<std::string, Type>> outputs) {
  auto n = std::make_unique<Node>();
  n->op = std::move(op);
  n->args = std::move(args);
  n->kwargs = std::move(kwargs);
  int index = 0;
  for (auto& [name, type] : outputs) {
    auto v = std::make_unique<Value>();
    v->name = std::move(name);
    v->type = std::move(type);
    v->producer = n.get();
    v->output_index = index++;
    n->outputs.push_back(v.get());
    values_.push_back(std::move(v));
  }
  nodes_.push_back(std::move(n));
  return nodes_.back().get();
}

void Graph::move_last_before(size_t count, const Node* anchor) {
  auto at = std::find_if(nodes_.begin(), nodes_.end(), [&](const std::unique_ptr<Node>& n) { return n.get() == anchor; });
  if (at == nodes_.end() || count > static_cast<size_t>(nodes_.end() - at)) throw Error("internal: move_last_before");
  std::rotate(at, nodes_.end() - static_cast<std::ptrdiff_t>(count), nodes_.end());
}

void Graph::reorder(const std::vector<const Node*>& order) {
  if (order.size() != nodes_.size()) throw Error("internal: reorder");
  std::unordered_map<const Node*, size_t> at;
  for (size_t i = 0; i < nodes_.size(); ++i) at[nodes_[i].get()] = i;
  std::vector<std::unique_ptr<Node>> out;
  out.reserve(nodes_.size());
  for (const Node* n : order) {
    auto it = at.find(n);
    if (it == at.end() || !nodes_[it->second]) throw Error("internal: reorder");
    out.push_back(std::move(nodes_[it->second]));
  }
  nodes_ = std::move(out);
}

void Graph::replace_uses(const std::vector<std::pair<const Value*, Value*>>& map) {
  if (map.empty()) return;
  std::unordered_map<const Value*, Value*> m(map.begin(), map.end());
  auto rewrite = [&](Value*& v) {
    auto it = m.find(v);
    while (it != m.end()) {  // follow chains a -> b -> c
      v = it->second;
      it = m.find(v);
    }
  };
  for (auto& n : nodes_) n->for_each_input(rewrite);
  for (Arg& a : outputs_) a.for_each_value(rewrite);
}

size_t reduced_leading_dims(const Node& n) {
  const bool sum_or_mean = n.op == "aten::sum.dim_IntList" || n.op == "aten::mean.dim";
  if (!sum_or_mean && n.op != "aten::amax" && n.op != "aten::amin") return 0;
  const Value* in = n.args.empty() || !n.args[0].is_value() ? nullptr : n.args[0].value;
  if (!in || !in->type.is_tensor()) return 0;
  const int64_t rank = static_cast<int64_t>(in->type.tensor.sizes.size());
  if (sum_or_mean) {
    const Arg* dtype = n.arg(3, "dtype");
    if (dtype && dtype->kind != Arg::Kind::None) return 0;
  }
  const Arg* dims = n.arg(1, "dim");
  if (!dims || dims->kind != Arg::Kind::List || dims->list.empty()) return 0;
  std::vector<int64_t> d;
  for (const Arg& a : dims->list) {
    if (a.kind != Arg::Kind::Int) return 0;
    d.push_back(a.i < 0 ? a.i + rank : a.i);
  }
  std::sort(d.begin(), d.end());
  const int64_t k = static_cast<int64_t>(d.size());
  if (k >= rank) return 0;
  bool trivial = true;
  for (int64_t i = 0; i < k; ++i) {
    if (d[i] != i) return 0;
    const Dim& s = in->type.tensor.sizes[i];
    trivial = trivial && s.is_constant() && s.value == 1;
  }
  return trivial ? 0 : static_cast<size_t>(k);
}

DimProduct DimProduct::of(const Dim& d) {
  DimProduct p;
  if (d.is_constant()) {
    p.constant = d.value;
    return p;
  }
  const std::string& expr = d.expr;
  const DimProduct opaque{1, {"(" + expr + ")"}};
  if (expr.find_first_of("+-/() ") != std::string::npos) return opaque;
  for (size_t a = 0, b; a <= expr.size(); a = b + 1) {
    b = expr.find('*', a);
    while (b != std::string::npos && b + 1 < expr.size() && expr[b + 1] == '*') b = expr.find('*', b + 2);  // past "**"
    if (b == std::string::npos) b = expr.size();
    std::string f = expr.substr(a, b - a);
    int64_t times = 1;
    if (const size_t pow = f.find("**"); pow != std::string::npos) {
      const std::string e = f.substr(pow + 2);
      if (e.empty() || e.size() > 2 || !std::all_of(e.begin(), e.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
        return opaque;
      times = std::stoll(e);
      f = f.substr(0, pow);
    }
    if (f.empty()) return opaque;
    for (int64_t t = 0; t < times; ++t) {
      if (std::isdigit(static_cast<unsigned char>(f[0]))) p.constant *= std::stoll(f);
      else p.factors.push_back(f);
    }
  }
  std::sort(p.factors.begin(), p.factors.end());
  return p;
}

DimProduct& DimProduct::operator*=(const DimProduct& o) {
  constant *= o.constant;
  factors.insert(factors.end(), o.factors.begin(), o.factors.end());
  std::sort(factors.begin(), factors.end());
  return *this;
}

bool row_major(const TensorType& t) {
  DimProduct expected;
  for (size_t i = t.sizes.size(); i-- > 0;) {
    const Dim& size = t.sizes[i];
    if (size.is_constant() && size.value == 1) continue;
    if (i >= t.strides.size() || !(DimProduct::of(t.strides[i]) == expected)) return false;
    expected *= DimProduct::of(size);
  }
  return true;
}

DimProduct element_count(const TensorType& t) {
  DimProduct n;
  for (const Dim& d : t.sizes) n *= DimProduct::of(d);
  return n;
}

std::vector<int> memory_order(const TensorType& t) {
  // Innermost first: the dimension whose stride is the product of the sizes inside it, from stride 1 out.
  std::vector<int> dims;
  for (size_t d = 0; d < t.sizes.size() && d < t.strides.size(); ++d)
    if (!(t.sizes[d].is_constant() && t.sizes[d].value == 1)) dims.push_back(static_cast<int>(d));
  std::vector<int> inner_first;
  std::vector<bool> placed(t.sizes.size(), false);
  DimProduct expected;
  while (inner_first.size() < dims.size()) {
    int found = -1;
    for (int d : dims)
      if (!placed[d] && DimProduct::of(t.strides[d]) == expected) {
        found = d;
        break;
      }
    if (found < 0) return {};
    placed[found] = true;
    inner_first.push_back(found);
    expected *= DimProduct::of(t.sizes[found]);
  }
  return {inner_first.rbegin(), inner_first.rend()};
}

void Graph::verify() const {
  std::unordered_set<const Value*> defined;
  std::unordered_set<std::string> names;
  auto define = [&](const Value* v) {
    if (!names.insert(v->name).second) throw Error("IR verify: value %" + v->name + " is defined twice");
    defined.insert(v);
  };
  for (const Value* v : inputs_) define(v);
  for (const auto& n : nodes_) {
    n->for_each_input([&](const Value* v) {
      if (!defined.count(v))
        throw Error("IR verify: " + n->op + " uses %" + v->name + " before it is defined");
    });
    for (const Value* v : n->outputs) {
      if (v->producer != n.get()) throw Error("IR verify: %" + v->name + " has the wrong producer");
      define(v);
    }
  }
  for (const Arg& a : outputs_)
    a.for_each_value([&](const Value* v) {
      if (!defined.count(v)) throw Error("IR verify: graph output %" + v->name + " is not defined");
    });
}

}  // namespace ember

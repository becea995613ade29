// rotate_half: the rotary embedding's rotate_half(x) = cat([-x[..., h:], x[..., :h]], -1) (LLaMA, Mistral,
// Qwen, Phi and the other Hugging Face decoders) as pointwise ops, so that the fuse pass makes the rotation, the
// multiplies by sin and cos and their sum one kernel.
//  1. Why: ATen ran the neg and the cat as two kernels per rotated tensor, and the cat's result was written
//     and read back by the kernel that multiplies it by sin: eight launches and four intermediates per layer
//     of a decoder (q and k) beside its one fused kernel per tensor.
//  2. Matches cat([neg(slice(x, -1, h, 2h)), slice(x, -1, 0, h)], -1) where x's last dim is a constant 2h.
//     Over x's last dim split in two, [..., 2, h] (x2 = unflatten(x, -1, [2, h])), position [..., s, i] of the
//     rotation reads x2[..., 1 - s, i], negated where s is 0:
//        where(s == 1, expand(x2[..., 0:1, :]), neg(expand(x2[..., 1:2, :])))
//     s == 1 is a [2, 1] mask, unsqueeze(arange(2) == 1, 1), that CSE shares between a graph's rotations.
//  3. The pointwise nodes around a rotation move to the split space with it: those reading it, and what they
//     read that only they read (q * cos beside rotate_half(q) * sin), where all their tensors have the
//     rotation's sizes, or broadcast to them with a last dim of 1 or none. Their inputs from outside are
//     unflattened (last dim 2h) or unsqueezed (last dim 1); their results that anything else reads are
//     flattened back, which costs nothing: the split types are the originals' with the last stride s
//     replaced by [h * s, s].
//  4. The inputs' views are placed before the first moved node where what they view is made by then, so
//     that the moved nodes can share one group (the fuse pass's rule 2). The replaced nodes are left to
//     dead code elimination.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ember {
namespace {

const Value* tensor_arg(const Node& n, size_t i) {
  return i < n.args.size() && n.args[i].is_value() && n.args[i].value->type.is_tensor() ? n.args[i].value : nullptr;
}

bool is_last_dim(const Arg* a, size_t rank) {
  return a && a->kind == Arg::Kind::Int && (a->i == -1 || a->i == static_cast<int64_t>(rank) - 1);
}

// slice(x, last, start, end) with step 1: x, or null.
const Value* last_dim_slice(const Value* v, int64_t start, int64_t end) {
  const Node* n = v->producer;
  if (!n || n->op != "aten::slice.Tensor" || n->outputs.size() != 1) return nullptr;
  const Value* x = tensor_arg(*n, 0);
  if (!x || !is_last_dim(n->arg(1, "dim"), x->type.tensor.sizes.size())) return nullptr;
  auto bound = [](const Arg* a, int64_t want, bool open_end) {
    if (!a || a->kind == Arg::Kind::None) return want == 0 || open_end;
    return a->kind == Arg::Kind::Int && (a->i == want || (open_end && a->i > want));
  };
  const Arg* step = n->arg(4, "step");
  if (step && !(step->kind == Arg::Kind::Int && step->i == 1)) return nullptr;
  const bool open_end = end == x->type.tensor.sizes.back().value;
  return bound(n->arg(2, "start"), start, false) && bound(n->arg(3, "end"), end, open_end) ? x : nullptr;
}

// The x of rotate_half(x) that `n` computes, with half its last dim in *h; null if n is none.
const Value* rotated(const Node& n, int64_t* h) {
  if (n.op != "aten::cat" || n.outputs.size() != 1 || n.args.empty() || n.args[0].kind != Arg::Kind::List ||
      n.args[0].list.size() != 2 || !n.outputs[0]->type.is_tensor())
    return nullptr;
  const TensorType& t = n.outputs[0]->type.tensor;
  const Arg* dim = n.arg(1, "dim");
  if ((t.dtype != c10::kFloat && t.dtype != c10::kHalf && t.dtype != c10::kBFloat16) || t.sizes.empty() ||
      !t.sizes.back().is_constant() || !t.strides.back().is_constant() || t.sizes.back().value % 2 || t.sizes.back().value < 2 ||
      !(dim ? is_last_dim(dim, t.sizes.size()) : t.sizes.size() == 1))
    return nullptr;
  const std::vector<Arg>& parts = n.args[0].list;
  if (!parts[0].is_value() || !parts[1].is_value()) return nullptr;
  const Node* neg = parts[0].value->producer;
  if (!neg || neg->op != "aten::neg" || !tensor_arg(*neg, 0)) return nullptr;
  const int64_t half = t.sizes.back().value / 2;
  const Value* x = last_dim_slice(tensor_arg(*neg, 0), half, 2 * half);
  if (!x || x != last_dim_slice(parts[1].value, 0, half) || x->type.tensor.sizes != t.sizes ||
      !x->type.tensor.strides.back().is_constant() || x->type.tensor.dtype != t.dtype)
    return nullptr;
  *h = half;
  return x;
}

class RotateHalf {
 public:
  explicit RotateHalf(Graph& g) : graph_(g) {}

  void run() {
    std::vector<Node*> seeds;
    for (const auto& n : graph_.nodes()) {
      int64_t h = 0;
      if (n->group < 0 && rotated(*n, &h)) seeds.push_back(n.get());
    }
    for (Node* seed : seeds)
      if (!moved_.count(seed)) rewrite(*seed);
  }

 private:
  // A node the split space can take, for a rotation of sizes `full` and half `h`.
  bool movable(const Node& n, const std::vector<Dim>& full, int64_t h) const {
    if (n.group >= 0 || n.outputs.size() != 1 || !n.outputs[0]->type.is_tensor() || moved_.count(&n)) return false;
    const TensorType& t = n.outputs[0]->type.tensor;
    if (t.sizes != full || !t.strides.back().is_constant()) return false;
    int64_t hn = 0;
    if (rotated(n, &hn)) return hn == h;
    const OpInfo* info = nullptr;
    try {
      info = &op_info(n.op);
    } catch (const std::exception&) {
      return false;
    }
    if (!info->has(kFusible) || info->has(kReduction) || info->has(kRandom) || info->has(kMutates)) return false;
    // Tensors only as whole arguments: the rewrite maps those, not tensors inside lists.
    auto in_list = [](const Arg& a) {
      bool found = false;
      if (a.kind == Arg::Kind::List) a.for_each_value([&](const Value*) { found = true; });
      return found;
    };
    // A memory format other than contiguous or preserve names a layout of the original rank (channels_last's 4-D,
    // a clone for a convolution): the split space has one dim more (fuzz seed 1911335).
    auto rank_bound = [](const Arg& a) {
      return a.kind == Arg::Kind::MemoryFormat && a.i != static_cast<int64_t>(c10::MemoryFormat::Preserve) &&
             a.i != static_cast<int64_t>(c10::MemoryFormat::Contiguous);
    };
    for (const Arg& a : n.args)
      if (in_list(a) || rank_bound(a)) return false;
    for (const auto& kv : n.kwargs)
      if (in_list(kv.second) || rank_bound(kv.second)) return false;
    bool ok = true;
    n.for_each_input([&](const Value* v) {
      if (!v->type.is_tensor()) return;
      const TensorType& in = v->type.tensor;
      if (in.sizes.size() > full.size() || in.device != t.device) ok = false;
      else if (!in.sizes.empty() && !(in.sizes.back() == Dim::constant(1)) &&
               !(in.sizes.back() == full.back() && in.strides.back().is_constant()))
        ok = false;
    });
    return ok;
  }

  void rewrite(Node& seed) {
    int64_t h = 0;
    rotated(seed, &h);
    const std::vector<Dim> full = seed.outputs[0]->type.tensor.sizes;
    std::unordered_map<const Value*, std::vector<Node*>> readers;
    std::unordered_set<const Value*> graph_outputs;
    for (const auto& n : graph_.nodes()) n->for_each_input([&](const Value* v) { readers[v].push_back(n.get()); });
    for (const Arg& a : graph_.outputs()) a.for_each_value([&](const Value* v) { graph_outputs.insert(v); });
    // Rule 3: grow from the rotation through readers, and through producers only members read.
    std::unordered_set<const Node*> members{&seed};
    for (bool grew = true; grew;) {
      grew = false;
      for (const auto& n : graph_.nodes()) {
        if (members.count(n.get()) || !movable(*n, full, h)) continue;
        bool reads_member = false;
        n->for_each_input([&](const Value* v) { reads_member = reads_member || (v->producer && members.count(v->producer)); });
        bool feeds_members_only = !graph_outputs.count(n->outputs[0]) && readers.count(n->outputs[0]);
        if (feeds_members_only)
          for (const Node* r : readers[n->outputs[0]]) feeds_members_only = feeds_members_only && members.count(r);
        if (reads_member || feeds_members_only) {
          members.insert(n.get());
          grew = true;
        }
      }
    }
    std::vector<Node*> order;
    std::unordered_map<const Node*, size_t> pos;
    for (const auto& n : graph_.nodes()) {
      const size_t at = pos.size();
      pos[n.get()] = at;
      if (members.count(n.get())) order.push_back(n.get());
    }
    const size_t first = pos[order.front()];
    base_ = seed.outputs[0]->name + "_rh";

    // Rule 4: views of what the members read from outside, before the first member where possible.
    std::unordered_map<const Value*, Value*> split;
    auto made_early = [&](const Value* v) { return !v->producer || pos[v->producer] < first; };
    size_t added = 0;
    auto view_inputs = [&](const Node& n, bool early) {
      auto visit = [&](const Value* v) {
        if (!v->type.is_tensor() || split.count(v) || (v->producer && members.count(v->producer)) || made_early(v) != early) return;
        split[v] = split_view(v, &added);
      };
      int64_t hn = 0;
      if (const Value* x = rotated(n, &hn)) visit(x);  // (not the halves it cats)
      else n.for_each_input(visit);
    };
    for (const Node* n : order) view_inputs(*n, true);
    Value* second_half = mask(seed.outputs[0]->type.tensor.device, &added);
    if (added) graph_.move_last_before(added, order.front());

    std::vector<std::pair<const Value*, Value*>> replace;
    for (Node* n : order) {
      added = 0;
      view_inputs(*n, false);
      const Value* out = n->outputs[0];
      const TensorType type = split_type(out->type.tensor, h);
      Value* result = nullptr;
      int64_t hn = 0;
      if (const Value* x = rotated(*n, &hn)) {
        result = rotation(split.at(x), second_half, type, &added);
      } else {
        auto map = [&](const Arg& a) {
          Arg m = a;
          if (a.is_value() && a.value->type.is_tensor()) m.value = split.at(a.value);
          return m;
        };
        std::vector<Arg> args;
        for (const Arg& a : n->args) args.push_back(map(a));
        std::vector<std::pair<std::string, Arg>> kwargs;
        for (const auto& [k, a] : n->kwargs) kwargs.emplace_back(k, map(a));
        result = add(n->op, std::move(args), std::move(kwargs), out->name, type, &added);
      }
      split[out] = result;
      bool outside = graph_outputs.count(out) > 0;
      for (const Node* r : readers[out]) outside = outside || !members.count(r);
      if (outside) {
        Value* flat = add("aten::flatten.using_ints", {Arg::of(result), Arg::of_int(-2), Arg::of_int(-1)}, {},
                          out->name + "_flat", out->type.tensor, &added);
        replace.emplace_back(out, flat);
      }
      graph_.move_last_before(added, n);
      moved_.insert(n);
    }
    graph_.replace_uses(replace);
  }

  // T with its last dim (size 2h, stride s) split into [2, h] with strides [h * s, s].
  static TensorType split_type(TensorType t, int64_t h) {
    const int64_t s = t.strides.back().value;
    t.sizes.back() = Dim::constant(2);
    t.strides.back() = Dim::constant(h * s);
    t.sizes.push_back(Dim::constant(h));
    t.strides.push_back(Dim::constant(s));
    return t;
  }

  // v in the split space: unflattened (last dim 2h), unsqueezed (last dim 1) or as it is (0-dim).
  Value* split_view(const Value* v, size_t* added) {
    TensorType t = v->type.tensor;
    if (t.sizes.empty()) return const_cast<Value*>(v);
    if (t.sizes.back() == Dim::constant(1)) {
      t.sizes.push_back(Dim::constant(1));
      t.strides.push_back(Dim::constant(1));
      return add("aten::unsqueeze", {Arg::of(const_cast<Value*>(v)), Arg::of_int(-1)}, {}, v->name + "_col", t, added);
    }
    const int64_t h = t.sizes.back().value / 2;
    return add("aten::unflatten.int", {Arg::of(const_cast<Value*>(v)), Arg::of_int(-1), Arg::of_list({Arg::of_int(2), Arg::of_int(h)})},
               {}, v->name + "_halves", split_type(t, h), added);
  }

  // Rule 2's mask: [2, 1], true in its second row.
  Value* mask(c10::Device device, size_t* added) {
    TensorType t;
    t.device = device;
    t.dtype = c10::kLong;
    t.sizes = {Dim::constant(2)};
    t.strides = {Dim::constant(1)};
    Value* index = add("aten::arange", {Arg::of_int(2)}, {{"device", Arg::of_device(device)}}, "half_index", t, added);
    t.dtype = c10::kBool;
    Value* second = add("aten::eq.Scalar", {Arg::of(index), Arg::of_int(1)}, {}, "second_half", t, added);
    t.sizes.push_back(Dim::constant(1));
    t.strides.push_back(Dim::constant(1));
    return add("aten::unsqueeze", {Arg::of(second), Arg::of_int(1)}, {}, "second_half_col", t, added);
  }

  // Rule 2: the rotation of x2 (x split) as a value of type `type`, `second_half` the mask.
  Value* rotation(Value* x2, Value* second_half, const TensorType& type, size_t* added) {
    const TensorType& xt = x2->type.tensor;
    const int64_t two = static_cast<int64_t>(xt.sizes.size()) - 2;
    std::vector<Arg> keep;
    for (size_t d = 0; d < xt.sizes.size(); ++d) keep.push_back(Arg::of_int(static_cast<int64_t>(d) == two ? 2 : -1));
    TensorType half = xt, spread = xt;
    half.sizes[two] = Dim::constant(1);
    spread.strides[two] = Dim::constant(0);
    Value* halves[2];
    for (int s = 0; s < 2; ++s) {
      const std::string name = s ? "hi" : "lo";
      Value* slice = add("aten::slice.Tensor", {Arg::of(x2), Arg::of_int(two), Arg::of_int(s), Arg::of_int(s + 1)}, {},
                         name, half, added);
      halves[s] = add("aten::expand", {Arg::of(slice), Arg::of_list(keep)}, {}, name + "_spread", spread, added);
    }
    Value* negated = add("aten::neg", {Arg::of(halves[1])}, {}, "hi_neg", type, added);
    return add("aten::where.self", {Arg::of(second_half), Arg::of(halves[0]), Arg::of(negated)}, {},
               "rotated", type, added);
  }

  Value* add(const std::string& op, std::vector<Arg> args, std::vector<std::pair<std::string, Arg>> kwargs,
             const std::string& name, TensorType type, size_t* added) {
    ++*added;
    return graph_.add_node(op, std::move(args), std::move(kwargs),
                           {{base_ + std::to_string(fresh_++) + "_" + name, Type::of_tensor(std::move(type))}})
        ->outputs[0];
  }

  Graph& graph_;
  std::unordered_set<const Node*> moved_;
  std::string base_;
  int fresh_ = 0;
};

}  // namespace

void rotate_half(Graph& graph, PassContext&) { RotateHalf(graph).run(); }

}  // namespace ember

// fuse
//  1. Marks fusion groups (Node::group): chains of fusible pointwise ops, and reductions over the last
//     dimension together with the pointwise ops before and after them (softmax, layer norm, the entropy
//     scorer), each become one group that a kernel generator may turn into one kernel.
//  2. A group runs where its first node stands. A node joins a group only if each of its inputs is made
//     inside the group or before the group's first node, so groups never form cycles and every value
//     a group reads exists when it runs; and nothing joins a group across an in-place write (the node
//     would read, at the group's place, memory the write had not yet changed).
//  3. Every member shares the group's iteration space: a "full" member has the group's shape; after a
//     reduction, a "row" member has the row shape (the full shape without its last dimension, with or
//     without a trailing 1). Inputs may broadcast into either.
//     Reductions over leading dimensions instead (ember/ir.h, reduced_leading_dims: a bias gradient's sum
//     over the batch) make column groups: their "row" members have the kept shape (without the k leading
//     dims, or with k leading 1s), all reductions of a group reduce the same k dims, and no full member
//     reads a reduced value (nothing broadcasts back). Both kernel generators run them (outer_fused).
//  4. Only f32/f16/bf16/bool tensors on one device are fused, and only nodes whose outputs are
//     row-major contiguous (eager's layout for them, which fused kernels write) or, in pointwise groups, all
//     dense in one other order (channels_last: the kernel iterates in memory order); a group
//     of a single node is dissolved, since ATen's kernel is as good for one op (but for CUDA column
//     reductions, see dissolve_singletons). Ops whose ATen CPU kernel beats ember's (kCpuKeepAten:
//     gelu, tanh) are not fused on the CPU.
//  5. Siblings: a pointwise node that no producer's group takes joins a pointwise group that already reads
//     one of its inputs (same space, rule 2 permitting), so one kernel reads the shared input once. GPT-2's
//     gelu_new is 0.5*x * (1 + tanh(c*(x + 0.044715*x^3))): 0.5*x and x^3 both start from x, and without
//     this 0.5*x stayed a group of one, ran as its own ATen kernel and was read back by the rest. On the
//     CPU a column reduction joins a column group so too (a batch norm backward's sum of the gradient).
//  6. A pointwise node reading nothing made in a group joins the latest group it fits if that group is
//     permuted (channels_last), or is a CUDA pointwise group and the node only reads broadcasts, so the
//     independent chains of one batch norm share its kernel. On the CPU it joins a group that makes or reads
//     another input of a node reading its result, where the two chains meet (a batch norm backward's
//     input - mean, multiplied with the gradient the ReLU backward's group makes).
//  7. Before grouping: a reduction over the leading dims of a reshape reads the reshape's input
//     (reduce_through_reshapes), a pointwise node reading one reshaped value reads the value before the
//     reshape, the reshape moving after it (lift_over_reshapes), a pointwise node whose readers all write one other
//     dense order takes it (adopt_consumer_layouts), pointwise nodes move down to consumers that could not join
//     them (sink_into_consumers), nodes that read no graph input, and scalar reads of graph inputs, move to the
//     top (hoist_constant_nodes), and on the CPU views and per-channel math move up to what they read
//     (hoist_views_and_channel_math).
// The group marks are advice: a kernel generator that declines a group leaves its nodes to ATen.
// Nodes already in a group (claimed by passes/matmul_epilogue.cpp) are left as they are.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <unordered_map>
#include <unordered_set>

namespace ember {
namespace {

bool fusible_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16 || t == c10::kBool;
}

// Float32 computation represents these exactly enough to match eager; int64/int32 (above 2**24),
// float64 and the float8/unsigned types do not, so their tensors keep groups away.
bool fusible_input_dtype(c10::ScalarType t) { return fusible_dtype(t); }

bool same_dims(const std::vector<Dim>& a, const std::vector<Dim>& b) { return a == b; }

std::vector<Dim> drop_last(const std::vector<Dim>& d) { return {d.begin(), d.end() - 1}; }

std::vector<Dim> with_trailing_one(std::vector<Dim> d) {
  d.push_back(Dim::constant(1));
  return d;
}

// The last-dimension reduction a node performs, if it is one ember fuses.
bool reduces_last_dim(const Node& n) {
  const Value* in = n.args.empty() || !n.args[0].is_value() ? nullptr : n.args[0].value;
  if (!in || !in->type.is_tensor() || in->type.tensor.sizes.empty()) return false;
  int64_t last = static_cast<int64_t>(in->type.tensor.sizes.size()) - 1;
  auto is_last = [&](const Arg* a) {
    if (!a) return false;
    if (a->kind == Arg::Kind::Int) return a->i == -1 || a->i == last;
    if (a->kind == Arg::Kind::List && a->list.size() == 1 && a->list[0].kind == Arg::Kind::Int)
      return a->list[0].i == -1 || a->list[0].i == last;
    return false;
  };
  if (n.op == "aten::_softmax" || n.op == "aten::_log_softmax") return is_last(n.arg(1, "dim"));
  if (n.op == "aten::native_layer_norm") {
    const Arg* shape = n.arg(1, "normalized_shape");
    return shape && shape->kind == Arg::Kind::List && shape->list.size() == 1;
  }
  if (n.op == "aten::sum.dim_IntList" || n.op == "aten::mean.dim") {
    const Arg* dtype = n.arg(3, "dtype");
    if (dtype && dtype->kind != Arg::Kind::None) return false;
  }
  return is_last(n.arg(1, "dim"));
}

bool in_dim_order(const std::vector<int>& order) { return std::is_sorted(order.begin(), order.end()); }

// Where kernels run column groups (kernels/program.h, Program::outer): the CPU interpreter and the
// CUDA generator's column kernel, at any size. The CPU's splits rows and columns over its threads; the
// CUDA kernel splits the rows into chunks over blocks where the columns alone would leave the device
// idle (kernels/cuda/call_plan.h), so few columns over many rows ([1M, 4]) run as well as a bias
// gradient's [1024, 768].
bool outer_fused(const Node& n, const c10::Device& d) {
  return reduced_leading_dims(n) > 0 && (d.is_cpu() || d.is_cuda());
}

std::vector<Dim> drop_leading(const std::vector<Dim>& d, size_t k) { return {d.begin() + static_cast<int64_t>(k), d.end()}; }

std::vector<Dim> with_leading_ones(const std::vector<Dim>& d, size_t k) {
  std::vector<Dim> out(k, Dim::constant(1));
  out.insert(out.end(), d.begin(), d.end());
  return out;
}

struct Group {
  int id = 0;
  size_t first = 0;  // index of the first member in the node list
  std::vector<Dim> full;
  c10::Device device{c10::kCPU};
  bool has_reduction = false;
  size_t outer = 0;         // > 0: its reductions are over the first `outer` dims (a column group)
  int members = 0;
  bool permuted = false;    // outputs dense in another order than row-major (pointwise groups only)
  std::vector<int> order;   // that order (memory_order)
};

class Fuser {
 public:
  explicit Fuser(Graph& g) : graph_(g) {}

  void run() {
    reduce_through_reshapes();
    lift_over_reshapes();
    adopt_consumer_layouts();
    sink_into_consumers();
    hoist_constant_nodes();
    hoist_views_and_channel_math();
    const auto& nodes = graph_.nodes();
    // Groups claimed by an earlier pass (matmul epilogues) stay as they are; this pass numbers after them.
    for (const auto& n : nodes) base_ = std::max(base_, n->group + 1);
    for (const auto& n : nodes) n->for_each_input([&](const Value* v) { users_[v].push_back(n.get()); });
    for (size_t i = 0; i < nodes.size(); ++i) {
      Node& n = *nodes[i];
      for (const Value* v : n.outputs) position_[v] = i;
      if (mutates(n)) last_write_ = static_cast<int64_t>(i);
      if (n.group >= 0 || !eligible(n)) continue;
      Group* g = pick_group(n, i);
      if (!g) g = start_group(n, i);
      join(n, *g);
    }
    dissolve_singletons();
  }

 private:
  bool eligible(const Node& n) {
    if (n.outputs.empty()) return false;
    const OpInfo* info = nullptr;
    try {
      info = &op_info(n.op);
    } catch (const std::exception&) {
      return false;  // unknown ops fail later, in build_plan, with a clear error
    }
    if (!info->has(kFusible)) return false;
    const c10::Device device = device_of(n);
    if (device.is_cpu() && info->has(kCpuKeepAten)) return false;
    // ember's programs compute in float registers: bitwise ops only on bool values (0 or 1)
    if (n.op.rfind("aten::bitwise_", 0) == 0) {
      bool all_bool = true;
      n.for_each_input([&](const Value* v) { all_bool = all_bool && v->type.is_tensor() && v->type.tensor.dtype == c10::kBool; });
      if (!all_bool) return false;
    }
    for (const Value* v : n.outputs) {
      if (!v->type.is_tensor() || !fusible_dtype(v->type.tensor.dtype) || v->type.tensor.device != device) return false;
      if (!row_major(v->type.tensor) && !((device.is_cuda() || device.is_cpu()) && !info->has(kReduction) && permuted_layout(v->type.tensor)))
        return false;
    }
    bool ok = true;
    n.for_each_input([&](const Value* v) {
      if (!v->type.is_tensor()) return;
      if (!fusible_input_dtype(v->type.tensor.dtype)) ok = false;
      // Every tensor on the group's device: a CPU 0-dim tensor beside CUDA ones would hand a host pointer
      // to a GPU kernel.
      if (v->type.tensor.device != device) ok = false;
    });
    if (!ok) return false;
    if (n.op == "aten::_to_copy") {
      for (const auto& [k, a] : n.kwargs)
        if (k != "dtype" && a.kind != Arg::Kind::None && !(k == "device" && a.kind == Arg::Kind::Device && a.device == device) &&
            !(k == "layout" && a.kind == Arg::Kind::Layout))
          return false;
    }
    if (info->has(kReduction)) return reduces_last_dim(n) || outer_fused(n, device);
    return true;
  }

  // Rule 7: a reduction over the leading dims of a reshape that keeps the trailing (kept) dims (a bias
  // gradient: the sum over [B*S, H] of a [B, S, H] gradient) reduces the reshape's input over its leading
  // dims instead, so it joins the group that makes that input (gelu's backward); a view restores the
  // keepdim shape where it differs. Both tensors contiguous: the same elements, in the same order.
  void reduce_through_reshapes() {
    std::vector<Node*> reductions;
    for (const auto& n : graph_.nodes())
      if (n->group < 0 && n->outputs.size() == 1 && reduced_leading_dims(*n) > 0) reductions.push_back(n.get());
    std::vector<std::pair<const Value*, Value*>> replaced;
    std::unordered_set<const Node*> dropped;
    for (Node* n : reductions) {
      const Value* v = n->args[0].value;
      const Node* view = v->producer;
      // A view inside a group (a matmul's epilogue with the view after it): its input is the group's
      // own, never written to a buffer; the reduction keeps reading the view.
      if (!view || (view->op != "aten::view" && view->op != "aten::_unsafe_view" && view->op != "aten::reshape") ||
          view->group >= 0 || view->args.empty() || !view->args[0].is_value() || !view->args[0].value->type.is_tensor())
        continue;
      Value* x = view->args[0].value;
      // On the CPU only where x is made by a node that fuses: the reduction then joins its group; else it stays
      // with the other readers of the reshape (a channels-last batch norm's backward over [N * H * W, C] rows).
      // (CUDA keeps the rewrite for any x: its lone column sums are kernels either way, and its tests ran so.)
      if (x->type.is_tensor() && x->type.tensor.device.is_cpu() &&
          (!x->producer || x->producer->group >= 0 || !eligible(*x->producer)))
        continue;
      const TensorType &xt = x->type.tensor, &vt = v->type.tensor, &ot = n->outputs[0]->type.tensor;
      const size_t k = reduced_leading_dims(*n), kept = vt.sizes.size() - k;
      if (xt.dtype != vt.dtype || xt.device != vt.device || xt.sizes.size() <= kept || !row_major(xt) || !row_major(vt) ||
          !std::equal(vt.sizes.end() - static_cast<std::ptrdiff_t>(kept), vt.sizes.end(), xt.sizes.end() - static_cast<std::ptrdiff_t>(kept)))
        continue;
      const size_t m = xt.sizes.size() - kept;
      const Arg* keep = n->arg(2, "keepdim");
      const bool keepdim = keep && keep->kind == Arg::Kind::Bool && keep->b;
      TensorType rt = ot;
      if (keepdim && m != k) {
        if (!std::all_of(ot.sizes.begin(), ot.sizes.end(), [](const Dim& d) { return d.is_constant(); })) continue;
        rt.sizes.assign(m, Dim::constant(1));
        rt.strides.assign(m, ot.strides[0]);
        rt.sizes.insert(rt.sizes.end(), ot.sizes.begin() + static_cast<std::ptrdiff_t>(k), ot.sizes.end());
        rt.strides.insert(rt.strides.end(), ot.strides.begin() + static_cast<std::ptrdiff_t>(k), ot.strides.end());
      }
      std::vector<Arg> dims;
      for (size_t d = 0; d < m; ++d) dims.push_back(Arg::of_int(static_cast<int64_t>(d)));
      std::vector<Arg> args = n->args;
      std::vector<std::pair<std::string, Arg>> kwargs = n->kwargs;
      args[0] = Arg::of(x);
      if (args.size() > 1) args[1] = Arg::of_list(dims);
      for (auto& [name, a] : kwargs)
        if (name == "dim") a = Arg::of_list(dims);
      const std::string base = n->outputs[0]->name + "_lead";
      Value* result = graph_.add_node(n->op, std::move(args), std::move(kwargs), {{base, Type::of_tensor(rt)}})->outputs[0];
      size_t added = 1;
      if (!(rt == ot)) {
        std::vector<Arg> shape;
        for (const Dim& d : ot.sizes) shape.push_back(Arg::of_int(d.value));
        result = graph_.add_node("aten::view", {Arg::of(result), Arg::of_list(shape)}, {}, {{base + "_view", Type::of_tensor(ot)}})
                     ->outputs[0];
        ++added;
      }
      graph_.move_last_before(added, n);
      replaced.emplace_back(n->outputs[0], result);
      dropped.insert(n);
    }
    graph_.replace_uses(replaced);
    graph_.remove_nodes_if([&](const Node& n) { return dropped.count(&n) > 0; });
  }

  // Rule 7: f(view(x, S)), for a pointwise f of one tensor, becomes view(f(x), S) where x, the view and f's
  // result are all row-major contiguous (a reshape then keeps every element's flat position, so f over x is
  // f over the view) and x is made by a node that fuses: f then joins the group making x instead of running
  // alone behind the view. LeViT's Linear -> BatchNorm1d -> hardswish reshapes [N*S, C] to [N, S, C] between
  // the batch norm's multiply-add and the hardswish, which ran as one ATen call per block.
  void lift_over_reshapes() {
    std::vector<Node*> order;
    for (const auto& n : graph_.nodes()) order.push_back(n.get());
    std::vector<std::pair<const Value*, Value*>> replaced;
    std::unordered_set<const Node*> dropped;
    std::unordered_map<const Value*, Value*> now;  // values replaced so far (the rewrite chains)
    std::vector<const Node*> views;                 // the reshapes lifted over
    auto current = [&](Value* v) {
      auto it = now.find(v);
      return it == now.end() ? v : it->second;
    };
    for (Node* n : order) {
      if (n->group >= 0 || n->outputs.size() != 1 || !eligible(*n) || is_reduction(*n)) continue;
      Value* v = nullptr;
      bool one = true;
      for (const Arg& a : n->args) {
        if (a.kind == Arg::Kind::List) a.for_each_value([&](const Value*) { one = false; });
        if (!a.is_value()) continue;
        if (v && current(a.value) != v) one = false;
        v = current(a.value);
      }
      for (const auto& [name, a] : n->kwargs) a.for_each_value([&](const Value*) { one = false; });
      if (!v || !one || !v->type.is_tensor()) continue;
      const Node* view = v->producer;
      if (!view || (view->op != "aten::view" && view->op != "aten::_unsafe_view" && view->op != "aten::reshape") ||
          view->group >= 0 || view->args.size() != 2 || !view->args[0].is_value())
        continue;
      Value* x = view->args[0].value;
      const Value* out = n->outputs[0];
      if (!x->type.is_tensor() || !x->producer || x->producer->group >= 0 || !eligible(*x->producer) ||
          !row_major(x->type.tensor) || !row_major(v->type.tensor) ||
          !row_major(out->type.tensor) || x->type.tensor.dtype != v->type.tensor.dtype)
        continue;
      std::vector<Arg> args = n->args;
      for (Arg& a : args)
        if (a.is_value()) a = Arg::of(x);
      TensorType lifted = x->type.tensor;
      lifted.dtype = out->type.tensor.dtype;
      const std::string base = out->name + "_lifted";
      Value* f = graph_.add_node(n->op, std::move(args), n->kwargs, {{base, Type::of_tensor(lifted)}})->outputs[0];
      Value* result = graph_.add_node("aten::view", {Arg::of(f), view->args[1]}, {}, {{base + "_view", out->type}})->outputs[0];
      graph_.move_last_before(2, n);
      replaced.emplace_back(out, result);
      now[out] = result;
      dropped.insert(n);
      views.push_back(view);
    }
    graph_.replace_uses(replaced);
    graph_.remove_nodes_if([&](const Node& n) { return dropped.count(&n) > 0; });
    // A reshape read by nothing else now goes too.
    std::unordered_set<const Value*> read;
    for (const auto& n : graph_.nodes()) n->for_each_input([&](const Value* v) { read.insert(v); });
    for (const Arg& a : graph_.outputs()) a.for_each_value([&](const Value* v) { read.insert(v); });
    std::unordered_set<const Node*> unread;
    for (const Node* view : views)
      if (!read.count(view->outputs[0])) unread.insert(view);
    graph_.remove_nodes_if([&](const Node& n) { return unread.count(&n) > 0; });
  }

  // Rule 10: a pointwise node whose result only pointwise nodes read, all writing one other dense order of the
  // same sizes, takes that order: what it writes is then the layout its readers' group iterates in, and the node
  // can join that group (rule 4 keeps one layout per group). LLaMA's rotary embedding adds q * cos, laid out as
  // the permuted projection it reads, and rotate_half(q) * sin, row-major behind the cat: the two multiplies and
  // the add were three ATen calls per q and k. Walking from the end, a chain takes the order whole (the
  // rotation that passes/rotate_half.cpp writes as a neg and a where before that multiply). A node ATen runs
  // instead still writes its own layout, which only pointwise readers see, through their strides.
  void adopt_consumer_layouts() {
    std::unordered_map<const Value*, std::vector<Node*>> readers;
    std::unordered_set<const Value*> outputs;
    for (const auto& n : graph_.nodes()) n->for_each_input([&](const Value* v) { readers[v].push_back(n.get()); });
    for (const Arg& a : graph_.outputs()) a.for_each_value([&](const Value* v) { outputs.insert(v); });
    auto pointwise = [&](const Node& n) {
      return n.group < 0 && n.outputs.size() == 1 && n.outputs[0]->type.is_tensor() && eligible(n) && !is_reduction(n);
    };
    for (auto it = graph_.nodes().rbegin(); it != graph_.nodes().rend(); ++it) {
      const auto& n = *it;
      if (!pointwise(*n) || outputs.count(n->outputs[0])) continue;
      TensorType& t = n->outputs[0]->type.tensor;
      auto r = readers.find(n->outputs[0]);
      if (r == readers.end() || !row_major(t)) continue;
      const TensorType* layout = nullptr;
      bool ok = true;
      for (const Node* u : r->second) {
        ok = pointwise(*u);
        if (!ok) break;
        const TensorType& ut = u->outputs[0]->type.tensor;
        ok = ut.sizes == t.sizes && permuted_layout(ut) && (!layout || layout->strides == ut.strides);
        if (!ok) break;
        layout = &ut;
      }
      if (ok && layout) t.strides = layout->strides;
    }
  }

  // Rule 8: a pointwise node moves down to just before its first consumer where that consumer, fusible
  // too, also reads a value that an unfusible node (a matmul, a view) made after the node, directly or through
  // up to two fusible nodes: rule 2 kept them apart, and no group could hold that node. Not across a write in
  // place. Backward graphs sum a residual's gradient terms as each matmul makes one:
  // add(add(add(g, mm1), mm2), mm3) with the matmuls between the adds; moved, the three adds are one
  // kernel. Walking from the end moves a whole chain.
  void sink_into_consumers() {
    std::vector<const Node*> order;
    for (const auto& n : graph_.nodes()) order.push_back(n.get());
    const std::vector<const Node*> original = order;
    std::unordered_map<const Value*, std::vector<const Node*>> users;
    for (const Node* n : order) n->for_each_input([&](const Value* v) { users[v].push_back(n); });
    std::unordered_map<const Node*, size_t> pos;
    auto index = [&] {
      for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = i;
    };
    index();
    bool moved = false;
    for (size_t i = original.size(); i-- > 0;) {
      const Node* x = original[i];
      if (x->group >= 0 || x->outputs.size() != 1 || !eligible(*x) || is_reduction(*x)) continue;
      auto u = users.find(x->outputs[0]);
      if (u == users.end()) continue;
      const Node* first = nullptr;
      for (const Node* user : u->second)
        if (!first || pos[user] < pos[first]) first = user;
      const size_t from = pos[x], to = pos[first];
      if (to <= from + 1 || first->group >= 0 || !eligible(*first)) continue;
      // Made after x by a node that fuses but reads what an unfusible node made after x (the rotary
      // embedding's rotate_half(q) * sin behind its cat): rule 2 keeps that node out of a group x starts too.
      std::function<bool(const Value*, int)> after_unfusible = [&](const Value* v, int depth) {
        if (v == x->outputs[0] || !v->producer || pos[v->producer] <= from) return false;
        if (!eligible(*v->producer)) return true;
        bool found = false;
        if (depth > 0) v->producer->for_each_input([&](const Value* w) { found = found || after_unfusible(w, depth - 1); });
        return found;
      };
      bool blocked = false;
      first->for_each_input([&](const Value* v) { blocked = blocked || after_unfusible(v, 2); });
      if (!blocked) continue;
      bool write = false;
      for (size_t j = from + 1; j < to && !write; ++j) write = mutates(*order[j]);
      if (write) continue;
      order.erase(order.begin() + static_cast<std::ptrdiff_t>(from));
      order.insert(order.begin() + static_cast<std::ptrdiff_t>(to - 1), x);
      index();
      moved = true;
    }
    if (moved) graph_.reorder(order);
  }

  // Rule 9: nodes that read no graph input, directly or through each other (aranges, the masks compared
  // from them, scalar_tensor, full), move to the top of the graph, keeping their order (where the graph
  // writes nothing in place, the plan folds them into constants anyway: fold_constant_steps). Made where the trace put them, after a group's first node,
  // rule 2 kept their readers out of that group: flex_attention's dense form applies its mask_mod as
  // where(mask, score, -inf) and zeroes fully masked rows with where(row_max != -inf, softmax,
  // scalar_tensor(0)), and those wheres ran apart from the softmax's kernel, each one more pass over the
  // scores. Random, writing and control-flow ops stay where they are.
  // So do the scalar reads of graph inputs before any write in place: under dynamic=True Dynamo passes a
  // module's floats (a norm's eps, a rotary scaling) as 0-dim tensors that the graph reads with
  // _local_scalar_dense where it uses them, and rule 2 then kept the rest of an RMSNorm out of the group its
  // mean began (LLaMA's 4 layers: 32 fused kernels against 14 static). At the top they are a kernel's runtime
  // scalars like any other.
  void hoist_constant_nodes() {
    std::unordered_set<const Value*> constant;
    std::vector<const Node*> first, rest;
    bool written = false;
    for (const auto& n : graph_.nodes()) {
      bool hoist = !n->outputs.empty();
      try {
        const OpInfo& info = op_info(n->op);
        hoist = hoist && !info.has(kRandom) && !info.has(kMutates) && !info.has(kSubgraphs);
      } catch (const std::exception&) {
        hoist = false;
      }
      const bool scalar_read = !written && n->op == "aten::_local_scalar_dense" && n->args.size() == 1 &&
                               n->args[0].is_value() && !n->args[0].value->producer;
      n->for_each_input([&](const Value* v) { hoist = hoist && constant.count(v) > 0; });
      if (hoist)
        for (const Value* v : n->outputs) constant.insert(v);
      written = written || mutates(*n);
      (hoist || scalar_read ? first : rest).push_back(n.get());
    }
    size_t lead = 0;  // nothing moves where the hoisted nodes already lead
    while (lead < first.size() && graph_.nodes()[lead].get() == first[lead]) ++lead;
    if (lead == first.size()) return;
    first.insert(first.end(), rest.begin(), rest.end());
    graph_.reorder(first);
  }

  // Rule 7 (CPU): views (no work, no memory) and pointwise nodes with a small 1-D result that read only graph
  // inputs (per-channel math on parameters: a batch norm's rsqrt(var + eps) * weight) move up to just after
  // the last value they read, where the graph writes nothing in place. Made where the trace put them, inside
  // the span of a group that reads them, rule 2 kept that group's later members out: the CPU's channels-last
  // batch-norm backward (decompositions.py) views its input as [N * H * W, C] rows and computes its
  // per-channel scale after the ReLU backward before it began the group.
  void hoist_views_and_channel_math() {
    const auto& nodes = graph_.nodes();
    for (const auto& n : nodes)
      if (mutates(*n)) return;
    // A view anywhere; per-channel math only where all it reads are graph inputs, directly or through other
    // moved nodes (it then goes to the top): rule 8 moved other small pointwise nodes down on purpose.
    auto cheap = [&](const Node& n, int64_t anchor) {
      if (n.outputs.size() != 1 || !n.outputs[0]->type.is_tensor()) return false;
      const OpInfo* info = nullptr;
      try {
        info = &op_info(n.op);
      } catch (const std::exception&) {
        return false;
      }
      const TensorType& t = n.outputs[0]->type.tensor;
      if (info->has(kRandom) || info->has(kSubgraphs) || !t.device.is_cpu()) return false;
      if (info->has(kView)) return true;
      return anchor < 0 && t.sizes.size() == 1 && t.sizes[0].is_constant() && t.sizes[0].value <= 65536 && eligible(n) &&
             !is_reduction(n);
    };
    // Each moved node hangs after an anchor: the node (index in the original order, -1: the top) after which
    // its last input is made; a moved input's anchor is its own, and the node follows it there.
    std::unordered_map<const Value*, int64_t> anchor_of;
    std::vector<std::vector<const Node*>> after(nodes.size() + 1);  // after[i + 1]: moved behind node i
    std::vector<bool> moved(nodes.size(), false);
    bool any = false;
    for (size_t i = 0; i < nodes.size(); ++i) {
      const Node& n = *nodes[i];
      int64_t anchor = -1;
      n.for_each_input([&](const Value* v) {
        auto it = anchor_of.find(v);
        if (it != anchor_of.end()) anchor = std::max(anchor, it->second);
      });
      const bool move = cheap(n, anchor) && anchor + 1 < static_cast<int64_t>(i);
      if (move) {
        after[static_cast<size_t>(anchor + 1)].push_back(&n);
        moved[i] = true;
        any = true;
      } else {
        anchor = static_cast<int64_t>(i);
      }
      for (const Value* v : n.outputs) anchor_of[v] = anchor;
    }
    if (!any) return;
    std::vector<const Node*> order(after[0].begin(), after[0].end());
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (moved[i]) continue;
      order.push_back(nodes[i].get());
      order.insert(order.end(), after[i + 1].begin(), after[i + 1].end());
    }
    graph_.reorder(order);
  }

  // Dense in an order other than row-major (channels_last): pointwise groups iterate in that order and write
  // their outputs so (kernels/cuda/call_plan.cpp, kernels/cpu/interpreter.cpp), as eager lays them out.
  static bool permuted_layout(const TensorType& t) {
    std::vector<int> order = memory_order(t);
    return !order.empty() && !in_dim_order(order);
  }

  bool is_reduction(const Node& n) const { return op_info(n.op).has(kReduction); }

  static c10::Device device_of(const Node& n) {
    return !n.outputs.empty() && n.outputs[0]->type.is_tensor() ? n.outputs[0]->type.tensor.device : c10::Device(c10::kCPU);
  }

  // The shape a node iterates over: its reduced input for reductions, else its output.
  static const std::vector<Dim>& space_of(const Node& n, bool reduction) {
    return reduction ? n.args[0].value->type.tensor.sizes : n.outputs[0]->type.tensor.sizes;
  }

  Group* pick_group(const Node& n, size_t index) {
    bool reduction = is_reduction(n);
    Group* best = nullptr;
    n.for_each_input([&](const Value* v) {
      auto it = group_of_.find(v);
      if (it == group_of_.end()) return;
      Group* g = &groups_[it->second - base_];
      if (!best || g->first > best->first)
        if (fits(n, *g, reduction)) best = g;
    });
    if (best) return best;
    // Rule 5; on the CPU also a column reduction, into a column group reducing the same dims.
    const bool cpu_column = reduction && device_of(n).is_cpu() && !reduces_last_dim(n);
    if (reduction && !cpu_column) return best;
    n.for_each_input([&](const Value* v) {
      auto it = reader_of_.find(v);
      if (it == reader_of_.end()) return;
      Group* g = &groups_[it->second - base_];
      if ((cpu_column || !g->has_reduction) && (!best || g->first > best->first) && fits(n, *g, reduction)) best = g;
    });
    if (best || reduction) return best;
    // Rule 6 on the CPU: where the chains meet.
    if (device_of(n).is_cpu() && !n.outputs.empty()) {
      bool reads_group = false;
      n.for_each_input([&](const Value* v) { reads_group = reads_group || group_of_.count(v); });
      auto users = users_.find(n.outputs[0]);
      if (!reads_group && users != users_.end())
        for (const Node* u : users->second)
          u->for_each_input([&](const Value* v) {
            for (const auto* of : {&group_of_, &reader_of_}) {
              auto it = of->find(v);
              if (it == of->end()) continue;
              Group* g = &groups_[it->second - base_];
              if ((!best || g->first > best->first) && fits(n, *g, false)) best = g;
            }
          });
      if (best) return best;
    }
    // Rule 6: in a permuted group, a pointwise node reading nothing made in a group joins the latest such
    // group it fits (its inputs all exist where the group runs): bn_pointwise's variance chain starts from
    // the expanded parameter alone, and would otherwise be a kernel writing a full-size intermediate.
    // In a row-major CUDA group only a node whose inputs all broadcast into it (NCHW batch norm's
    // variance) joins: computing it beside the group's reads is cheaper than writing it out in full.
    if (!best && !groups_.empty()) {
      bool reads_group = false;
      n.for_each_input([&](const Value* v) { reads_group = reads_group || group_of_.count(v); });
      Group* latest = &groups_.back();
      const bool eligible_here = latest->permuted ? permuted_layout(n.outputs[0]->type.tensor)
                                                  : latest->device.is_cuda() && !latest->has_reduction && reads_broadcasts_only(n);
      if (!reads_group && eligible_here && fits(n, *latest, false)) best = latest;
    }
    return best;
  }

  // Every tensor input has fewer elements than the output or a stride-0 dimension of size > 1.
  static bool reads_broadcasts_only(const Node& n) {
    const std::vector<Dim>& out = n.outputs[0]->type.tensor.sizes;
    bool any = false, all = true;
    n.for_each_input([&](const Value* v) {
      if (!v->type.is_tensor()) return;
      any = true;
      const TensorType& t = v->type.tensor;
      bool broadcast = t.sizes.size() < out.size();
      for (size_t d = 0; d < t.sizes.size() && !broadcast; ++d) {
        const Dim& s = t.sizes[d];
        const Dim& o = out[out.size() - t.sizes.size() + d];
        broadcast = (s.is_constant() && s.value == 1 && !(o.is_constant() && o.value == 1)) ||
                    (t.strides[d].is_constant() && t.strides[d].value == 0 && !(s.is_constant() && s.value == 1));
      }
      all = all && broadcast;
    });
    return any && all;
  }

  static bool mutates(const Node& n) {
    try {
      return op_info(n.op).has(kMutates);
    } catch (const std::exception&) {
      return true;  // unknown: assume the worst
    }
  }

  bool fits(const Node& n, const Group& g, bool reduction) const {
    if (n.outputs[0]->type.tensor.device != g.device) return false;  // (inputs were checked in eligible)
    // The group runs at its first member: a write in place since then could change what the node reads.
    if (last_write_ >= static_cast<int64_t>(g.first)) return false;
    // One layout per group: every output of a permuted group in its order; none in a row-major one.
    const bool permuted = permuted_layout(n.outputs[0]->type.tensor);
    if (permuted != g.permuted || (permuted && (reduction || g.has_reduction || memory_order(n.outputs[0]->type.tensor) != g.order)))
      return false;
    // Rows and columns do not mix: every reduction of a group reduces the same dims.
    const size_t outer = reduction && !reduces_last_dim(n) ? reduced_leading_dims(n) : 0;
    if (reduction && g.has_reduction && outer != g.outer) return false;
    const std::vector<Dim>& space = space_of(n, reduction);
    bool full = same_dims(space, g.full);
    bool row = false;
    if (!reduction && g.has_reduction && !g.full.empty()) {
      row = g.outer > 0 ? same_dims(space, drop_leading(g.full, g.outer)) || same_dims(space, with_leading_ones(drop_leading(g.full, g.outer), g.outer))
                        : same_dims(space, drop_last(g.full)) || same_dims(space, with_trailing_one(drop_last(g.full)));
    }
    if (!full && !row) return false;
    bool ok = true;
    n.for_each_input([&](const Value* v) {
      auto it = group_of_.find(v);
      if (it != group_of_.end() && it->second == g.id) {
        // A reduced value broadcasts over full rows only in its keepdim form ([..., 1]); in column groups
        // not at all; no reduction reads one.
        if (full && row_values_.count(v) &&
            (reduction || g.outer > 0 || !same_dims(v->type.tensor.sizes, with_trailing_one(drop_last(g.full)))))
          ok = false;
        return;
      }
      auto pos = position_.find(v);
      if (pos != position_.end() && pos->second >= g.first) ok = false;  // made after the group starts
    });
    return ok;
  }

  Group* start_group(const Node& n, size_t index) {
    Group g;
    g.id = base_ + static_cast<int>(groups_.size());
    g.first = index;
    g.full = space_of(n, is_reduction(n));
    g.device = n.outputs[0]->type.tensor.device;
    g.permuted = permuted_layout(n.outputs[0]->type.tensor);
    if (g.permuted) g.order = memory_order(n.outputs[0]->type.tensor);
    groups_.push_back(g);
    return &groups_.back();
  }

  void join(Node& n, Group& g) {
    n.group = g.id;
    ++g.members;
    bool reduction = is_reduction(n);
    if (reduction) {
      g.has_reduction = true;
      g.outer = reduces_last_dim(n) ? 0 : reduced_leading_dims(n);
    }
    for (const Value* v : n.outputs) {
      group_of_[v] = g.id;
      if (!same_dims(v->type.tensor.sizes, g.full)) row_values_[v] = true;
    }
    n.for_each_input([&](const Value* v) { reader_of_[v] = g.id; });
  }

  // A CUDA column reduction alone stays a group: the column kernel beats ATen's reduction there (H100,
  // f32, kernel time: a bias gradient's sum over [1024, 768] 3.7 us against ATen's 5.7 us plus a 0.7 us
  // memset; [1024, 3072] 5.4 against 7.3 + 0.8; [8192, 1024] 8.4 against 16.7 + 0.7).
  void dissolve_singletons() {
    std::vector<int> renumber(groups_.size(), -1);
    int next = base_;
    for (const Group& g : groups_)
      if (g.members > 1 || (g.outer > 0 && g.device.is_cuda())) renumber[g.id - base_] = next++;
    for (const auto& n : graph_.nodes())
      if (n->group >= base_) n->group = renumber[n->group - base_];
  }

  Graph& graph_;
  int base_ = 0;  // the first group id this pass hands out
  std::vector<Group> groups_;
  std::unordered_map<const Value*, int> group_of_;
  std::unordered_map<const Value*, bool> row_values_;
  std::unordered_map<const Value*, int> reader_of_;  // the latest group reading each value (rule 5)
  int64_t last_write_ = -1;  // index of the last node that writes a tensor in place
  std::unordered_map<const Value*, std::vector<const Node*>> users_;  // the nodes reading each value
  std::unordered_map<const Value*, size_t> position_;
};

}  // namespace

void fuse(Graph& graph, PassContext&) { Fuser(graph).run(); }

}  // namespace ember

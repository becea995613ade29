// overlap_collectives ("overlap_comm")
//  1. Each functional collective's wait (_c10d_functional::wait_tensor) moves down to just before the first
//     node that reads its result or the collective's; where that node is in a fusion group, before the group's
//     first node, where the group runs. Only graph outputs reading it: to the end. The work in between then
//     runs while the collective is in flight (the collectives of DTensor, FSDP2 and compiled DDP each come
//     with their wait right after them).
//  2. Each collective start moves up to just after the last node making one of its inputs.
//  3. Neither moves past a node that writes in place or has no outputs (an assert), so no write a collective
//     might see or miss changes side; a start never passes another collective's start or wait, so every rank
//     issues its collectives in the order the graph gives them.
//  4. Runs last, after fuse: no node joins or leaves a group, and a group's first node stays where it was.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace ember {
namespace {

constexpr const char* kWait = "_c10d_functional::wait_tensor";

bool is_c10d(const Node& n) { return n.op.rfind("_c10d_functional::", 0) == 0; }
bool is_wait(const Node& n) { return n.op == kWait; }

// A node nothing moves across: it writes in place, or it is kept for its effect alone.
bool is_barrier(const Node& n) {
  if (n.outputs.empty()) return true;
  try {
    return op_info(n.op).has(kMutates);
  } catch (const std::exception&) {
    return true;  // an op the table does not know: assume the worst
  }
}

class Scheduler {
 public:
  explicit Scheduler(Graph& graph) : graph_(graph) {
    for (const auto& n : graph.nodes()) order_.push_back(n.get());
    for (const Node* n : order_) n->for_each_input([&](const Value* v) { readers_[v].push_back(n); });
  }

  void run() {
    bool moved = false;
    // Starts first (top down), so that each wait then sinks from where its collective now stands.
    const std::vector<const Node*> nodes = order_;
    for (const Node* n : nodes)
      if (is_c10d(*n) && !is_wait(*n)) moved |= hoist_start(n);
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it)
      if (is_wait(**it)) moved |= sink_wait(*it);
    if (moved) graph_.reorder(order_);
  }

 private:
  size_t position(const Node* n) const {
    return static_cast<size_t>(std::find(order_.begin(), order_.end(), n) - order_.begin());
  }

  void move(size_t from, size_t to) {  // the node at `from` ends up at index `to` (indices before the move)
    const Node* n = order_[from];
    order_.erase(order_.begin() + static_cast<std::ptrdiff_t>(from));
    order_.insert(order_.begin() + static_cast<std::ptrdiff_t>(to > from ? to - 1 : to), n);
  }

  bool hoist_start(const Node* start) {
    const size_t at = position(start);
    size_t to = at;
    while (to > 0) {
      const Node* before = order_[to - 1];
      bool feeds = false;
      for (const Value* v : before->outputs) {
        start->for_each_input([&](const Value* in) { feeds = feeds || in == v; });
      }
      if (feeds || is_barrier(*before) || is_c10d(*before)) break;
      --to;
    }
    if (to == at) return false;
    move(at, to);
    return true;
  }

  bool sink_wait(const Node* wait) {
    const size_t at = position(wait);
    // Where each group runs: its first node.
    std::unordered_map<int, size_t> group_start;
    for (size_t i = 0; i < order_.size(); ++i)
      if (order_[i]->group >= 0) group_start.emplace(order_[i]->group, i);
    size_t to = order_.size();
    auto bound_by = [&](const Value* v) {
      auto it = readers_.find(v);
      if (it == readers_.end()) return;
      for (const Node* r : it->second) {
        if (r == wait) continue;
        const size_t p = r->group >= 0 ? group_start.at(r->group) : position(r);
        if (p > at) to = std::min(to, p);
      }
    };
    for (const Value* v : wait->outputs) bound_by(v);
    wait->for_each_input(bound_by);
    for (size_t i = at + 1; i < to; ++i)
      if (is_barrier(*order_[i])) to = i;
    if (to <= at + 1) return false;
    move(at, to);
    return true;
  }

  Graph& graph_;
  std::vector<const Node*> order_;
  std::unordered_map<const Value*, std::vector<const Node*>> readers_;
};

}  // namespace

void overlap_collectives(Graph& graph, PassContext&) { Scheduler(graph).run(); }

}  // namespace ember

// split_plan
//  1. Classifies each step in plan order (a step's verdict can depend on its producers' verdicts: a host
//     value computed by an eager `.item()` is different on every call, so its readers run eagerly too).
//  2. Groups neighbouring captured steps into parts; a run without device work stays eager, since a
//     graph of views and shape arithmetic saves nothing.
//  3. For each captured part lists the buffers it reads from outside (copied into static buffers or
//     pinned at replay), the buffers it leaves behind for later steps and outputs (read from the graph's
//     memory after a replay) and the buffers its steps release.
#include "cudagraph/segments.h"

#include "ember/op_table.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cctype>

namespace ember::cudagraph {
namespace {

// Unbacked symbols (u0, u1, ...) stand for sizes that come from data (nonzero, .item()).
bool has_unbacked(const std::string& expr) {
  for (size_t i = 0; i + 1 < expr.size(); ++i) {
    bool starts = i == 0 || !(std::isalnum(static_cast<unsigned char>(expr[i - 1])) || expr[i - 1] == '_');
    if (starts && expr[i] == 'u' && std::isdigit(static_cast<unsigned char>(expr[i + 1]))) return true;
  }
  return false;
}

bool data_dependent_shape(const Value* v) {
  if (!v || !v->type.is_tensor()) return false;
  for (const Dim& d : v->type.tensor.sizes)
    if (has_unbacked(d.expr)) return true;
  for (const Dim& d : v->type.tensor.strides)
    if (has_unbacked(d.expr)) return true;
  return false;
}

std::string name_of(const Value* v) { return v ? "%" + v->name : std::string("a value"); }

class Splitter {
 public:
  Splitter(const Plan& plan, const std::vector<bool>& pinned)
      : plan_(plan), pinned_(pinned), root_(plan.num_buffers), eager_made_(plan.num_buffers, false),
        runtime_host_(plan.num_buffers, false) {
    for (size_t b = 0; b < plan.num_buffers; ++b) root_[b] = static_cast<uint32_t>(b);
    read_.assign(plan.num_buffers, false);
    for (const Step& st : plan.steps)
      for (uint32_t b : step_reads(st)) read_[b] = true;
    for (const PlanOutput& o : plan.outputs)
      if (o.buffer >= 0) read_[static_cast<size_t>(o.buffer)] = true;
  }

  Segmentation run() {
    std::vector<std::string> why(plan_.steps.size());
    std::vector<bool> device_work(plan_.steps.size(), false);
    for (size_t s = 0; s < plan_.steps.size(); ++s) {
      const Step& step = plan_.steps[s];
      bool work = false;
      why[s] = classify(step, &work);
      device_work[s] = work;
      if (!why[s].empty()) why[s] = "step " + std::to_string(s) + " " + what(step) + ": " + why[s];
      record(step, why[s].empty());
    }
    group(why, device_work);
    if (seg_.device < 0 && seg_.why_none.empty()) seg_.why_none = "no step runs on a CUDA device";
    return std::move(seg_);
  }

 private:
  static std::string what(const Step& step) { return step.kernel ? std::string("fused kernel") : step.node->op; }

  const Value* value(uint32_t b) const { return b < plan_.buffer_values.size() ? plan_.buffer_values[b] : nullptr; }

  // "" when the step can be captured; else why not.
  std::string classify(const Step& step, bool* device_work) {
    std::vector<uint32_t> reads = step_reads(step);
    std::vector<uint32_t> writes;
    for (int32_t b : step.outputs)
      if (b >= 0) writes.push_back(static_cast<uint32_t>(b));
    for (uint32_t b : reads) {
      if (runtime_host_[b]) return "reads " + name_of(value(b)) + ", a host value computed at run time";
      if (data_dependent_shape(value(b))) return "reads " + name_of(value(b)) + ", whose shape comes from data";
    }
    if (!step.op && !step.kernel) return "";  // shape arithmetic on the host, same for every replay

    if (step.op) {
      const OpInfo& info = op_info(step.node->op);
      if (info.has(kCpuSync)) return "waits for the device (host sync)";
      if (info.has(kDynamicShape)) return "data-dependent output shape";
      if (!info.has(kCapturable)) return "tagged cudagraph_unsafe";
      const auto& returns = step.op->schema().returns();
      for (size_t i = 0; i < returns.size(); ++i) {
        c10::TypeKind k = returns[i].type()->kind();
        bool tensorish = k == c10::TypeKind::TensorType || (k == c10::TypeKind::ListType && returns[i].type()->containedType(0)->kind() == c10::TypeKind::TensorType) ||
                         (k == c10::TypeKind::OptionalType && returns[i].type()->containedType(0)->kind() == c10::TypeKind::TensorType);
        // A host value nothing reads may stay whatever the capture saw: cuDNN attention returns its
        // sequence lengths, which no inference plan reads, and splitting there cost GPT-2 a part per
        // layer and a copy of each attention output into the next part's static buffer.
        const bool read = step.expand_list || (i < step.outputs.size() && step.outputs[i] >= 0 && read_[static_cast<size_t>(step.outputs[i])]);
        if (!tensorish && read) return "returns a host value";
      }
      // as_strided places its view by absolute storage offset, so it may read the storage of its input
      // outside the input's own elements (x[1::2].as_strided(..., 1) reads x[0]). A captured part sees a
      // copied input as a static buffer of the input's elements alone: the view runs eagerly on the
      // caller's tensor, and the next part copies the view itself.
      if (step.node->op == "aten::as_strided")
        for (uint32_t b : reads)
          if (value(b) && value(b)->type.is_tensor() && !stable(b))
            return "views " + name_of(value(b)) + " by storage offset, memory a replay sees as a static copy";
      if (!info.has(kView)) *device_work = true;
      // In-place writes must land in memory that keeps its address between calls.
      for (auto [slot, buf] : step.from_buffer) {
        const auto& args = step.op->schema().arguments();
        if (slot < args.size() && info.writes(static_cast<int>(slot), args[slot].name()) && !stable(buf))
          return "writes " + name_of(value(buf)) + " in place, memory that is new on every call";
      }
    } else {
      std::string why = step.kernel->why_not_captured();
      if (!why.empty()) return why;
      *device_work = true;
    }
    for (const auto* list : {&reads, &writes})
      for (uint32_t b : *list) {
        const Value* v = value(b);
        if (!v || !v->type.is_tensor()) continue;
        const c10::Device& d = v->type.tensor.device;
        if (!d.is_cuda()) return "uses " + name_of(v) + " on " + d.str();
        int index = d.has_index() ? d.index() : 0;
        if (seg_.device >= 0 && seg_.device != index) return "uses a second CUDA device (" + name_of(v) + ")";
        seg_.device = index;
      }
    return "";
  }

  // Memory a captured step may write: its address is the same at every replay.
  bool stable(uint32_t b) const {
    uint32_t r = root_[b];
    if (r < plan_.num_inputs) return r < pinned_.size() && pinned_[r];
    return !eager_made_[r];
  }

  void record(const Step& step, bool captured) {
    bool is_view = step.op && op_info(step.node->op).has(kView);
    uint32_t base = 0;
    bool has_base = false;
    if (is_view) {
      for (uint32_t b : step_reads(step)) {
        const Value* v = value(b);
        if (v && v->type.is_tensor()) {
          base = root_[b];
          has_base = true;
          break;
        }
      }
    }
    bool host_from_data = step.op && !captured;  // an eager ATen op returning a host value (.item())
    bool reads_runtime = false;
    for (uint32_t b : step_reads(step)) reads_runtime = reads_runtime || runtime_host_[b] || data_dependent_shape(value(b));
    for (int32_t o : step.outputs) {
      if (o < 0) continue;
      const Value* v = value(static_cast<uint32_t>(o));
      bool tensor = v && v->type.is_tensor();
      if (has_base && tensor) root_[o] = base;
      eager_made_[o] = !captured;
      if (!tensor && (host_from_data || reads_runtime)) runtime_host_[o] = true;
    }
  }

  void group(const std::vector<std::string>& why, const std::vector<bool>& device_work) {
    size_t n = why.size();
    for (size_t s = 0; s < n;) {
      size_t e = s + 1;
      bool captured = why[s].empty();
      while (e < n && why[e].empty() == captured) ++e;
      Part part;
      part.first = s;
      part.last = e;
      part.captured = captured && std::any_of(device_work.begin() + s, device_work.begin() + e, [](bool w) { return w; });
      part.why = captured ? (part.captured ? "" : "no device work") : why[s];
      if (!part.captured && !seg_.parts.empty() && !seg_.parts.back().captured) {
        seg_.parts.back().last = e;  // neighbouring eager runs merge
      } else {
        seg_.parts.push_back(std::move(part));
      }
      s = e;
    }
    if (seg_.captured_parts() == 0) {
      seg_.why_none = seg_.parts.empty() ? "the plan has no steps" : seg_.parts.front().why;
      seg_.device = -1;
    }
    for (Part& p : seg_.parts)
      if (p.captured) describe_buffers(p);
  }

  void describe_buffers(Part& p) const {
    std::vector<bool> defined(plan_.num_buffers, false), listed(plan_.num_buffers, false);
    for (size_t s = p.first; s < p.last; ++s) {
      const Step& step = plan_.steps[s];
      for (uint32_t b : step_reads(step))
        if (!defined[b] && !listed[b]) {
          listed[b] = true;
          p.inputs.push_back(b);
        }
      for (int32_t o : step.outputs)
        if (o >= 0) defined[o] = true;
      p.frees.insert(p.frees.end(), step.frees.begin(), step.frees.end());
    }
    std::vector<bool> needed_later(plan_.num_buffers, false);
    for (size_t s = p.last; s < plan_.steps.size(); ++s)
      for (uint32_t b : step_reads(plan_.steps[s])) needed_later[b] = true;
    for (const PlanOutput& o : plan_.outputs)
      if (o.buffer >= 0) needed_later[o.buffer] = true;
    for (uint32_t b = 0; b < plan_.num_buffers; ++b)
      if (defined[b] && needed_later[b]) p.exports.push_back(b);
  }

  const Plan& plan_;
  const std::vector<bool>& pinned_;
  std::vector<uint32_t> root_;       // the buffer whose memory a buffer shares (views)
  std::vector<bool> eager_made_;     // made by a step that runs eagerly: new memory every call
  std::vector<bool> runtime_host_;   // a host value that can differ between calls of one signature
  std::vector<bool> read_;           // read by some step or returned
  Segmentation seg_;
};

}  // namespace

size_t Segmentation::captured_parts() const {
  return static_cast<size_t>(std::count_if(parts.begin(), parts.end(), [](const Part& p) { return p.captured; }));
}

std::string Segmentation::describe() const {
  std::string out;
  for (const Part& p : parts) {
    out += "  steps " + std::to_string(p.first) + "-" + std::to_string(p.last - 1) + ": ";
    if (p.captured) {
      out += "captured (" + std::to_string(p.inputs.size()) + " inputs, " + std::to_string(p.exports.size()) +
             " kept)\n";
    } else {
      out += "eager: " + p.why + "\n";
    }
  }
  return out;
}

Segmentation split_plan(const Plan& plan, const std::vector<bool>& pinned) { return Splitter(plan, pinned).run(); }

}  // namespace ember::cudagraph

// CompiledGraph::run, the per-call path: fill argument slots from the buffer table, call the kernel
// through its resolved OperatorHandle, store results, release dead buffers. Nothing here allocates
// beyond the argument stack and what the kernels themselves allocate.
//
// Kernels run below the autograd and ADInplaceOrView dispatch keys: AOTAutograd has already split
// forward from backward, so the graph's ops must not record autograd history, and skipping those keys
// removes their per-op cost.
#include "ember/error.h"
#include "ember/runtime.h"

#include "backend/runtime/size_buckets.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

namespace ember {

namespace {

bool is_floating(const c10::IValue& v) { return v.isDouble(); }

double as_double(const c10::IValue& v) {
  if (v.isDouble()) return v.toDouble();
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  return static_cast<double>(v.toInt());
}

int64_t floordiv(int64_t a, int64_t b) {
  TORCH_CHECK(b != 0, "ember: integer division by zero");
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

int64_t py_mod(int64_t a, int64_t b) {
  TORCH_CHECK(b != 0, "ember: integer modulo by zero");
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

template <class IntOp, class FloatOp>
c10::IValue arith(const c10::IValue& a, const c10::IValue& b, IntOp iop, FloatOp fop) {
  if (is_floating(a) || is_floating(b)) return c10::IValue(fop(as_double(a), as_double(b)));
  return c10::IValue(iop(a.toInt(), b.toInt()));
}

template <class Cmp>
c10::IValue compare(const c10::IValue& a, const c10::IValue& b, Cmp cmp) {
  if (is_floating(a) || is_floating(b)) return c10::IValue(cmp(as_double(a), as_double(b)));
  return c10::IValue(cmp(a.toInt(), b.toInt()));
}

c10::IValue run_prim(PrimOp op, const std::vector<c10::IValue>& s) {
  switch (op) {
    case PrimOp::SymSize: return c10::IValue(s[0].toTensor().size(s[1].toInt()));
    case PrimOp::SymStride: return c10::IValue(s[0].toTensor().stride(s[1].toInt()));
    case PrimOp::SymNumel: return c10::IValue(s[0].toTensor().numel());
    case PrimOp::SymStorageOffset: return c10::IValue(s[0].toTensor().storage_offset());
    case PrimOp::Add: return arith(s[0], s[1], std::plus<int64_t>(), std::plus<double>());
    case PrimOp::Sub: return arith(s[0], s[1], std::minus<int64_t>(), std::minus<double>());
    case PrimOp::Mul: return arith(s[0], s[1], std::multiplies<int64_t>(), std::multiplies<double>());
    case PrimOp::FloorDiv:
      return arith(s[0], s[1], floordiv, [](double a, double b) { return std::floor(a / b); });
    case PrimOp::Mod:
      return arith(s[0], s[1], py_mod, [](double a, double b) { return a - std::floor(a / b) * b; });
    case PrimOp::TrueDiv: return c10::IValue(as_double(s[0]) / as_double(s[1]));
    case PrimOp::Neg: return is_floating(s[0]) ? c10::IValue(-s[0].toDouble()) : c10::IValue(-s[0].toInt());
    case PrimOp::Pow:
      if (!is_floating(s[0]) && !is_floating(s[1]) && s[1].toInt() >= 0) {
        int64_t r = 1, b = s[0].toInt();
        for (int64_t e = s[1].toInt(); e > 0; --e) r *= b;
        return c10::IValue(r);
      }
      return c10::IValue(std::pow(as_double(s[0]), as_double(s[1])));
    case PrimOp::Eq: return compare(s[0], s[1], std::equal_to<>());
    case PrimOp::Ne: return compare(s[0], s[1], std::not_equal_to<>());
    case PrimOp::Lt: return compare(s[0], s[1], std::less<>());
    case PrimOp::Le: return compare(s[0], s[1], std::less_equal<>());
    case PrimOp::Gt: return compare(s[0], s[1], std::greater<>());
    case PrimOp::Ge: return compare(s[0], s[1], std::greater_equal<>());
    case PrimOp::SymFloat: return c10::IValue(as_double(s[0]));
    case PrimOp::SymInt:
      return s[0].isDouble() ? c10::IValue(static_cast<int64_t>(s[0].toDouble())) : c10::IValue(s[0].toInt());
    case PrimOp::SymMax:
      return arith(s[0], s[1], [](int64_t a, int64_t b) { return std::max(a, b); },
                   [](double a, double b) { return std::max(a, b); });
    case PrimOp::SymMin:
      return arith(s[0], s[1], [](int64_t a, int64_t b) { return std::min(a, b); },
                   [](double a, double b) { return std::min(a, b); });
    case PrimOp::SymNot: return c10::IValue(!s[0].toBool());
    // Python's math.ceil / math.floor / round return ints; round() with ndigits is not lowered.
    case PrimOp::Ceil: return c10::IValue(static_cast<int64_t>(std::ceil(as_double(s[0]))));
    case PrimOp::Floor: return c10::IValue(static_cast<int64_t>(std::floor(as_double(s[0]))));
    case PrimOp::Round: return c10::IValue(static_cast<int64_t>(std::nearbyint(as_double(s[0]))));  // half to even
    case PrimOp::Abs: return is_floating(s[0]) ? c10::IValue(std::fabs(s[0].toDouble())) : c10::IValue(std::abs(s[0].toInt()));
    case PrimOp::None: break;
  }
  throw Error("internal: unknown prim op");
}

void check_input_count(size_t got, size_t expected) {
  if (got != expected)
    throw Error("compiled graph expects " + std::to_string(expected) + " inputs, got " + std::to_string(got));
}

}  // namespace

std::vector<c10::IValue> CompiledGraph::run_borrowed(const std::vector<c10::IValue>& inputs, bool guarded) const {
  check_input_count(inputs.size(), plan_.num_inputs);
  if (buckets_) {
    if (auto padded = buckets_->pad(inputs)) {
      // Fresh tensors: nobody else holds them, so the plan may take them.
      std::vector<c10::IValue> outputs = run_plan(std::move(padded->inputs));
      buckets_->slice(outputs, padded->real);
      return outputs;
    }
  }
  return run_plan_borrowed(inputs, guarded);
}

std::vector<c10::IValue> CompiledGraph::run(std::vector<c10::IValue> inputs) const {
  check_input_count(inputs.size(), plan_.num_inputs);
  if (buckets_) {
    if (auto padded = buckets_->pad(inputs)) {
      inputs.clear();  // the caller's tensors go as early as they would have
      std::vector<c10::IValue> outputs = run_plan(std::move(padded->inputs));
      buckets_->slice(outputs, padded->real);
      return outputs;
    }
  }
  return run_plan(std::move(inputs));
}

std::vector<c10::IValue> CompiledGraph::run_plan_borrowed(const std::vector<c10::IValue>& inputs, bool guarded) const {
  if (runner_) {
    c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    if (auto outputs = runner_->replay_borrowed(inputs, guarded)) return std::move(*outputs);
  }
  return run_plan(inputs);
}

std::vector<c10::IValue> CompiledGraph::run_plan(std::vector<c10::IValue> inputs) const {
  c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  if (runner_) return runner_->run(std::move(inputs));
  std::vector<c10::IValue> buffers = start(std::move(inputs));
  execute(buffers, 0, plan_.steps.size());
  return finish(buffers);
}

std::vector<c10::IValue> CompiledGraph::start(std::vector<c10::IValue> inputs) const {
  std::vector<c10::IValue> buffers(plan_.num_buffers);
  for (size_t i = 0; i < inputs.size(); ++i) buffers[i] = std::move(inputs[i]);
  for (const auto& [buf, value] : plan_.constants) buffers[buf] = value;
  if (cache_) refresh_cached(buffers);  // before unused inputs go: a parameter only cached steps read is one
  for (uint32_t b : plan_.unused_inputs) buffers[b] = c10::IValue();
  return buffers;
}

// The cached results per generation of the parameters and, for a symbolic graph that caches steps over its sizes
// too (cache_parameter_steps' `sizes`), per value of the int inputs they read: one entry each, the most recently
// used first, at most kSizeEntries (LLaMA's rotary cos/sin computed from the length, per length seen).
struct CompiledGraph::ParameterCache {
  struct Seen {
    at::Tensor tensor;  // kept alive, so no other tensor takes its address while the cache trusts it
    uint32_t version = 0;
    const void* data = nullptr;
    int64_t value = 0;  // an int key
  };
  struct Entry {
    std::vector<Seen> seen;            // per key, when every key could be checked; else empty
    std::vector<c10::IValue> results;  // per cached result; empty before the first run
  };
  static constexpr size_t kSizeEntries = 8;
  std::mutex mu;
  std::vector<bool> int_key;  // per key: an int input (compared by value) rather than a tensor
  bool sized = false;         // some key is an int: one entry per value of the ints
  std::vector<Entry> entries;  // most recently used first; one unless int keys
};

size_t CompiledGraph::cache_parameter_steps(const std::vector<bool>& pinned, bool sizes) {
  if (runner_ || cache_) return 0;
  std::vector<bool> seed = pinned;
  if (sizes)  // an int input (a symbolic size) is as fixed as a parameter, per value
    for (size_t i = 0; i < graph_.inputs().size() && i < plan_.num_inputs; ++i)
      if (graph_.inputs()[i]->type.kind == Type::Kind::Int) {
        if (seed.size() <= i) seed.resize(i + 1, false);
        seed[i] = true;
      }
  const size_t moved = hoist_parameter_steps(plan_, seed);
  if (!moved) return 0;
  cache_ = std::make_shared<ParameterCache>();
  for (uint32_t b : plan_.cached_keys) {
    cache_->int_key.push_back(b < graph_.inputs().size() && graph_.inputs()[b]->type.kind == Type::Kind::Int);
    cache_->sized = cache_->sized || cache_->int_key.back();
  }
  return moved;
}

namespace {

// Whether `e`'s int keys have the values in `buffers`.
template <class Cache, class Entry>
bool same_sizes(const Cache& c, const Entry& e, const std::vector<uint32_t>& keys,
                const std::vector<c10::IValue>& buffers) {
  if (e.seen.size() != keys.size()) return false;
  for (size_t i = 0; i < keys.size(); ++i)
    if (c.int_key[i] && !(buffers[keys[i]].isInt() && buffers[keys[i]].toInt() == e.seen[i].value)) return false;
  return true;
}

// Whether `e`'s results were computed from the parameters in `buffers` (or the inputs: the keys are input
// buffers): the same TensorImpls, version counters and data pointers, and the same int values. Under c.mu.
template <class Cache, class Entry>
bool same_parameters(const Cache& c, const Entry& e, const std::vector<uint32_t>& keys,
                     const std::vector<c10::IValue>& buffers) {
  if (e.results.empty() || !same_sizes(c, e, keys, buffers)) return false;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (c.int_key[i]) continue;
    const c10::IValue& v = buffers[keys[i]];
    const auto& s = e.seen[i];
    if (!(v.isTensor() && v.toTensor().unsafeGetTensorImpl() == s.tensor.unsafeGetTensorImpl() &&
          v.toTensor()._version() == s.version && v.toTensor().data_ptr() == s.data))
      return false;
  }
  return true;
}

}  // namespace

void CompiledGraph::set_runner(std::unique_ptr<PlanRunner> runner) {
  if (runner && cache_ && cache_->sized)
    throw Error("internal: a graph whose cached steps are kept per size cannot be replayed as CUDA graphs");
  runner_ = std::move(runner);
}

bool CompiledGraph::cache_current(const std::vector<c10::IValue>& inputs) const {
  if (!cache_) return true;
  std::lock_guard<std::mutex> lock(cache_->mu);
  return !cache_->entries.empty() && same_parameters(*cache_, cache_->entries.front(), plan_.cached_keys, inputs);
}

void CompiledGraph::refresh_cached(std::vector<c10::IValue>& buffers) const {
  ParameterCache& c = *cache_;
  std::lock_guard<std::mutex> lock(c.mu);
  // The entry for these int values (the only one where there are none), moved to the front.
  size_t at = 0;
  if (c.sized)
    while (at < c.entries.size() && !same_sizes(c, c.entries[at], plan_.cached_keys, buffers)) ++at;
  if (at == c.entries.size()) {
    if (c.entries.size() >= ParameterCache::kSizeEntries) c.entries.pop_back();  // (no CUDA graph reads them)
    c.entries.insert(c.entries.begin(), ParameterCache::Entry{});
  } else if (at > 0) {
    std::rotate(c.entries.begin(), c.entries.begin() + static_cast<std::ptrdiff_t>(at),
                c.entries.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  ParameterCache::Entry& e = c.entries.front();
  if (!same_parameters(c, e, plan_.cached_keys, buffers)) {
    e.seen.clear();
    for (size_t i = 0; i < plan_.cached_keys.size(); ++i) {
      const c10::IValue& v = buffers[plan_.cached_keys[i]];
      if (c.int_key[i]) {
        if (!v.isInt()) {
          e.seen.clear();
          break;
        }
        e.seen.push_back({at::Tensor(), 0, nullptr, v.toInt()});
        continue;
      }
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().is_inference()) {
        e.seen.clear();  // unchecked: run again next time
        break;
      }
      const at::Tensor& t = v.toTensor();
      e.seen.push_back({t, t._version(), t.data_ptr(), 0});
    }
    std::vector<c10::IValue> stack;
    for (const Step& st : plan_.cached_steps) run_step(st, buffers, stack);
    if (e.results.empty()) {
      for (uint32_t b : plan_.cached_results) e.results.push_back(buffers[b]);
    } else {
      // In place: captured CUDA graphs read these tensors where they are.
      for (size_t j = 0; j < plan_.cached_results.size(); ++j) {
        c10::IValue& held = e.results[j];
        const c10::IValue& fresh = buffers[plan_.cached_results[j]];
        if (held.isTensor() && fresh.isTensor() && held.toTensor().sizes().equals(fresh.toTensor().sizes()) &&
            held.toTensor().strides().equals(fresh.toTensor().strides()) &&
            held.toTensor().dtype() == fresh.toTensor().dtype()) {
          held.toTensor().copy_(fresh.toTensor());
          // Below autograd the copy leaves the version counter alone; kernels that packed this tensor (weights
          // folded with a batch norm, kernels/cpu/epilogue_support.h) know it changed by that counter.
          if (!held.toTensor().is_inference()) held.toTensor().unsafeGetTensorImpl()->bump_version();
        } else if (!(held.isTensor() || fresh.isTensor()))
          held = fresh;
        else
          throw Error("a step over parameters produced a result of another shape than on its first run; "
                      "set ember.config.parameter_cache = False (EMBER_PARAMETER_CACHE=0)");
      }
    }
  }
  for (size_t j = 0; j < plan_.cached_results.size(); ++j) buffers[plan_.cached_results[j]] = e.results[j];
}

void CompiledGraph::execute(std::vector<c10::IValue>& buffers, size_t first, size_t last) const {
  std::vector<c10::IValue> stack;
  for (size_t s = first; s < last; ++s) run_step(plan_.steps[s], buffers, stack);
}

// cuDNN's benchmark search on for one call (Step::benchmark_cudnn), the caller's setting back after it.
class BenchmarkCuDNN {
 public:
  BenchmarkCuDNN() : before_(at::globalContext().benchmarkCuDNN()) { at::globalContext().setBenchmarkCuDNN(true); }
  ~BenchmarkCuDNN() { at::globalContext().setBenchmarkCuDNN(before_); }
  BenchmarkCuDNN(const BenchmarkCuDNN&) = delete;
  BenchmarkCuDNN& operator=(const BenchmarkCuDNN&) = delete;

 private:
  bool before_;
};

void run_step(const Step& step, std::vector<c10::IValue>& buffers, std::vector<c10::IValue>& stack) {
  if (step.kernel || step.fast) {
    // Named for torch.profiler while it records (one check of its callbacks otherwise).
    std::optional<at::RecordFunction> record;
    if (auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE); C10_UNLIKELY(callbacks.has_value())) {
      record.emplace(std::move(*callbacks));
      record->before(step.label.c_str());
    }
    if (step.kernel) {
      if (step.stand_in && step.kernel->compiling()) {
        for (const Step& s : *step.stand_in) run_step(s, buffers, stack);
      } else {
        step.kernel->run_then_free(buffers, step.reads, step.writes, step.frees);
      }
      for (uint32_t b : step.frees) buffers[b] = c10::IValue();
      return;
    }
    if (step.fast->run(buffers)) {
      for (uint32_t b : step.frees) buffers[b] = c10::IValue();
      return;
    }
  }
  stack.assign(step.stack.begin(), step.stack.end());
  for (auto [slot, buf] : step.from_buffer) stack[slot] = buffers[buf];
  for (auto [slot, buf] : step.scalar_from_buffer) stack[slot] = wrap_scalar(buffers[buf]);
  for (const ListSlot& l : step.lists) stack[l.slot] = assemble_list(l, &buffers);
  try {
    if (step.op) {
      std::optional<BenchmarkCuDNN> benchmark;
      if (C10_UNLIKELY(step.benchmark_cudnn)) benchmark.emplace();
      step.op->callBoxed(stack);
    } else {
      c10::IValue r = run_prim(step.prim, stack);
      stack.clear();
      stack.push_back(std::move(r));
    }
  } catch (c10::Error& e) {
    // The same error, named by the step: its type (IndexError, LinAlgError, OutOfMemoryError, ...) is the
    // Python exception eager raises.
    std::string where = step.node->outputs.empty() ? step.node->op
                                                   : "%" + step.node->outputs[0]->name + " = " + step.node->op;
    e.add_context("ember: while running " + where);
    throw;
  }
  if (step.expand_list) {
    c10::List<c10::IValue> list = stack[0].toList();
    size_t n = std::min(list.size(), step.outputs.size());
    for (size_t i = 0; i < n; ++i) buffers[step.outputs[i]] = list.get(i);
  } else {
    for (size_t i = 0; i < step.outputs.size() && i < stack.size(); ++i)
      if (step.outputs[i] >= 0) buffers[step.outputs[i]] = std::move(stack[i]);
  }
  for (uint32_t b : step.frees) buffers[b] = c10::IValue();
}

std::vector<c10::IValue> CompiledGraph::finish(std::vector<c10::IValue>& buffers) const {
  std::vector<c10::IValue> outputs;
  outputs.reserve(plan_.outputs.size());
  for (const PlanOutput& o : plan_.outputs) outputs.push_back(o.buffer >= 0 ? buffers[o.buffer] : o.constant);
  return outputs;
}

std::vector<uint32_t> step_reads(const Step& st) {
  std::vector<uint32_t> reads = st.reads;
  reads.insert(reads.end(), st.stand_in_reads.begin(), st.stand_in_reads.end());
  for (auto [slot, buf] : st.from_buffer) reads.push_back(buf);
  for (auto [slot, buf] : st.scalar_from_buffer) reads.push_back(buf);
  for (const ListSlot& l : st.lists)
    for (int32_t buf : l.item_buffer)
      if (buf >= 0) reads.push_back(static_cast<uint32_t>(buf));
  return reads;
}

std::string CompiledGraph::describe() const {
  std::string out;
  auto list = [](const std::vector<uint32_t>& v) {
    std::string s;
    for (uint32_t b : v) s += (s.empty() ? "" : ",") + std::to_string(b);
    return s;
  };
  out += "plan: " + std::to_string(plan_.num_inputs) + " inputs, " + std::to_string(plan_.num_buffers) +
         " buffers, " + std::to_string(plan_.steps.size()) + " steps";
  if (plan_.folded_steps) out += " (" + std::to_string(plan_.folded_steps) + " more folded into constants at compile time)";
  out += "\n";
  if (!plan_.cached_steps.empty())
    out += "  cached over parameters (run again only when one changes): " + std::to_string(plan_.cached_steps.size()) +
           " steps writing [" + list(plan_.cached_results) + "]\n";
  for (const Step& st : plan_.cached_steps)
    out += "    " + (st.kernel ? st.kernel->describe() : "aten " + st.node->op) + " reads [" + list(step_reads(st)) + "]\n";
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& st = plan_.steps[s];
    std::vector<uint32_t> reads = step_reads(st);
    std::string writes;
    for (int32_t b : st.outputs) writes += (writes.empty() ? "" : ",") + std::to_string(b);
    std::string what = st.kernel ? st.kernel->describe() : (st.op ? "aten " : "prim ") + st.node->op;
    out += "  " + std::to_string(s) + ": " + what + " reads [" + list(reads) +
           "] writes [" + writes + "]";
    if (!st.frees.empty()) out += " frees [" + list(st.frees) + "]";
    if (st.fast) out += " fast path: " + st.fast->describe();
    if (st.stand_in) out += " (while it compiles: " + std::to_string(st.stand_in->size()) + " ATen steps)";
    out += "\n";
  }
  if (runner_) out += runner_->describe();
  return out;
}

}  // namespace ember

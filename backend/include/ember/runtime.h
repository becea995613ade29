// The runtime: a Plan is a flat list of steps over a buffer table, built once from a Graph with every
// operator handle resolved, every argument stack laid out and every buffer's last use known. Running
// it does no hashing, no string work and no Python: it fills argument slots, calls kernels and frees
// buffers after their last use.
#pragma once

#include "ember/ir.h"

#include <ATen/core/ivalue.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace c10 {
class OperatorHandle;
}

namespace ember {

// Runtime primitives: shape queries and SymInt arithmetic evaluated in place.
enum class PrimOp : uint8_t {
  None, SymSize, SymStride, SymNumel, SymStorageOffset, Add, Sub, Mul, FloorDiv, Mod, TrueDiv, Neg, Pow,
  Eq, Ne, Lt, Le, Gt, Ge, SymFloat, SymInt, SymMax, SymMin, SymNot, Ceil, Floor, Round, Abs,
};

// A list argument with some elements read from buffers (Tensor[], int[] with SymInt values, ...).
struct ListSlot {
  enum class Elem : uint8_t { Int, Float, Bool, Tensor, OptionalTensor };
  uint32_t slot = 0;
  Elem elem = Elem::Int;
  std::vector<c10::IValue> items;    // constant items (placeholders where item_buffer is set)
  std::vector<int32_t> item_buffer;  // per item: the buffer it reads, or -1 for a constant
};

// A Python number in a Tensor argument (add.Tensor(x, 1)) becomes a 0-dim "wrapped number" tensor,
// which type promotion treats as a scalar, as the Python argument parser does.
at::Tensor wrap_scalar(const c10::IValue& v);

// Builds the list a ListSlot describes, reading value items from `buffers` (may be null when the
// list is all constants).
c10::IValue assemble_list(const ListSlot& list, const std::vector<c10::IValue>* buffers);

// A generated kernel: reads buffers, writes buffers. The plan hands it the buffer indices of the
// values it declared (GroupKernel::reads / writes), in that order.
class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                   const std::vector<uint32_t>& writes) const = 0;
  // run() for a step that frees the buffers `frees` right after it: a kernel may then write its result into the
  // tensor of a read among them that nothing else holds (kernels/cpu/matmul_kernel.cpp: a matmul accumulating
  // into a sum of gradients). The executor calls this one.
  virtual void run_then_free(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                             const std::vector<uint32_t>& writes, const std::vector<uint32_t>& frees) const {
    (void)frees;
    run(buffers, reads, writes);
  }
  virtual std::string describe() const = 0;
  // Why reduce-overhead mode must run this kernel's step outside CUDA graphs; empty: it may be captured.
  virtual std::string why_not_captured() const { return {}; }
  // True while the kernel's code is still compiling in the background, so that run() would wait for it: a
  // step with a stand-in (Step::stand_in) then runs that instead. False on a stream being captured into a
  // CUDA graph, where run() waits (a graph keeps what it captures); true for good where the compile failed.
  virtual bool compiling() const { return false; }
  // What it timed to choose how it runs, one line per problem (ember.explain; max-autotune's fused CUDA kernels:
  // kernels/cuda/launch_tuning.h, fused CPU kernels: kernels/cpu/thread_tuning.h); empty where it timed nothing.
  virtual std::vector<std::string> tuning() const { return {}; }
};

// What code generation hands the plan for one fusion group: the kernel and the values it reads and writes.
struct GroupKernel {
  std::shared_ptr<const Kernel> kernel;
  std::vector<const Value*> reads;
  std::vector<const Value*> writes;
};

// A cheaper way to run one ATen step, chosen when the plan is built: run() writes the step's result and
// returns true, or returns false for an input it was not made for, and the step calls its op as usual.
//  - views over statically shaped tensors (runtime/plan.cpp): the view built directly;
//  - CUDA GEMMs (kernels/cuda/gemm.cpp, CUDA builds): one cuBLASLt call with a plan made once.
class FastPath {
 public:
  virtual ~FastPath() = default;
  virtual bool run(std::vector<c10::IValue>& buffers) const = 0;
  virtual std::string describe() const = 0;  // for the plan's listing
  // What it timed to make its choice, one line per problem (ember.explain); empty where it timed nothing.
  virtual std::vector<std::string> tuning() const { return {}; }
};

// How hard the fast paths and kernels that time their choices at a step's first call (the CUDA GEMMs,
// kernels/cuda/gemm.cpp; under max-autotune the fused CUDA kernels' launches, kernels/cuda/launch_tuning.h, and the
// fused CPU kernels' threads, kernels/cpu/thread_tuning.h) tune. Default: a few candidates per problem, each problem
// within a small budget of its own. Exhaustive (mode="max-autotune"): every candidate, while the graph's budget
// lasts; problems met after it is spent get the default's choice. A plan's steps share one budget.
class TuningBudget {
 public:
  explicit TuningBudget(double seconds) : seconds_(seconds) {}
  bool left() const;
  void spend(double seconds);

 private:
  const double seconds_;
  mutable std::mutex mu_;
  double spent_ = 0;
};
struct Tuning {
  bool exhaustive = false;
  std::shared_ptr<TuningBudget> budget;  // exhaustive only; null: nothing is tuned beyond the default
};

// True on a thread while it runs a plan to warm up for CUDA graph capture (cudagraph/replay.cpp, through
// WarmingForGraphs): a fast path that weighs host time against GPU time when it chooses (the GEMM timing
// in kernels/cuda/gemm.cpp) weighs GPU time alone then, since replays launch no host work per kernel.
bool warming_for_graphs();
class WarmingForGraphs {
 public:
  WarmingForGraphs();
  ~WarmingForGraphs();
  WarmingForGraphs(const WarmingForGraphs&) = delete;
  WarmingForGraphs& operator=(const WarmingForGraphs&) = delete;

 private:
  bool before_;
};

struct Step;
// Makes a fast path for node `n` bound as `step`, or null. Makers registered here are asked for every ATen
// step, in registration order, once the plan's frees are scheduled (an output in the step's own frees is
// one nothing reads); the first non-null answer wins. `tuning`: the plan's (build_plan).
using FastPathMaker = std::shared_ptr<const FastPath> (*)(const Node& n, const Step& step, const Tuning& tuning);
void register_fast_path(FastPathMaker maker);

// For fast paths: the buffer bound to `step`'s argument slot `slot`, if a buffer is (at plan time), and
// the defined tensor buffer `b` holds, or null (per call).
std::optional<uint32_t> slot_buffer(const Step& step, uint32_t slot);
inline const at::Tensor* buffer_tensor(const std::vector<c10::IValue>& buffers, uint32_t b) {
  const c10::IValue& v = buffers[b];
  return v.isTensor() && v.toTensor().defined() ? &v.toTensor() : nullptr;
}

struct Step {
  const c10::OperatorHandle* op = nullptr;  // null for a prim or kernel step
  std::shared_ptr<const Kernel> kernel;     // a generated kernel replacing a whole fusion group
  std::vector<uint32_t> reads, writes;      // kernel steps: buffers, in the kernel's declared order
  // Kernel steps whose kernel was still compiling when the plan was built: the group's nodes as ATen steps,
  // run in its place while kernel->compiling() (a first call need not wait for NVRTC), with the buffers
  // they read beyond `reads` (a view's symbolic sizes) and frees of their own for the group's intermediates.
  std::shared_ptr<const std::vector<Step>> stand_in;
  std::vector<uint32_t> stand_in_reads;
  PrimOp prim = PrimOp::None;
  std::vector<c10::IValue> stack;                         // arguments with constants in place
  std::vector<std::pair<uint32_t, uint32_t>> from_buffer; // (stack slot, buffer)
  std::vector<std::pair<uint32_t, uint32_t>> scalar_from_buffer;  // a SymInt/float value feeding a Tensor slot
  std::vector<ListSlot> lists;
  std::vector<int32_t> outputs;  // buffer for each return; -1 drops it
  bool expand_list = false;      // the op returns one Tensor[] spread over `outputs`
  std::shared_ptr<const FastPath> fast;  // tried before the op (FastPath)
  // Exhaustive tuning (max-autotune) of a CUDA convolution: the op runs with cuDNN's benchmark search on, which
  // times its algorithms at a shape's first call and keeps the fastest for the process (ATen's cache).
  bool benchmark_cudnn = false;
  std::vector<uint32_t> frees;   // buffers whose last use is this step
  const Node* node = nullptr;    // for error messages only; valid while the owning Graph lives
  // A kernel or fast-path step's name in torch.profiler ("ember::" and what runs), made with the plan; ATen
  // calls are recorded by the dispatcher.
  std::string label;
};

struct PlanOutput {
  int32_t buffer = -1;  // -1: `constant`
  c10::IValue constant;
};

struct Plan {
  size_t num_buffers = 0;
  size_t num_inputs = 0;  // inputs occupy buffers [0, num_inputs)
  std::vector<std::pair<uint32_t, c10::IValue>> constants;  // graph constants, set before the first step
  std::vector<uint32_t> unused_inputs;                       // freed before the first step
  std::vector<Step> steps;
  std::vector<PlanOutput> outputs;
  std::vector<const Value*> buffer_values;  // the IR value each buffer holds; valid while the Graph lives
  size_t folded_steps = 0;                  // steps run once at compile time (fold_constant_steps)
  // Steps over parameters alone (hoist_parameter_steps): run by CompiledGraph::start when a parameter
  // changed, else their results are the cached ones.
  std::vector<Step> cached_steps;
  std::vector<uint32_t> cached_keys;     // the input buffers they read (pinned: parameters, buffers)
  std::vector<uint32_t> cached_results;  // their buffers that later steps read
};

// Another way to run a CompiledGraph's plan, installed on it after compilation (cudagraph/: capture
// the plan's capturable segments once, replay them). It may keep state across calls.
class PlanRunner {
 public:
  virtual ~PlanRunner() = default;
  virtual std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) = 0;
  // The call's outputs where it is a replay that needs no input of its own (taking neither a reference
  // nor the inputs' memory); nullopt where run() must take the call. `guarded`: the caller has checked
  // that every tensor input has the sizes, strides, dtype and device of the graph's example inputs
  // (Dynamo's guards on a graph without symbolic shapes), so the runner need not check them again for
  // the inputs it reads in place.
  virtual std::optional<std::vector<c10::IValue>> replay_borrowed(const std::vector<c10::IValue>& inputs,
                                                                  bool guarded) {
    (void)inputs;
    (void)guarded;
    return std::nullopt;
  }
  // What the runner does with the plan (segments, why steps are not captured) and what it has done.
  virtual std::string describe() const = 0;
};

// Every buffer a step reads: kernel reads, argument slots, scalars, list items.
std::vector<uint32_t> step_reads(const Step& step);

class SizeBuckets;  // backend/runtime/size_buckets.h

class CompiledGraph {
 public:
  CompiledGraph(Graph graph, Plan plan) : graph_(std::move(graph)), plan_(std::move(plan)) {}

  // Runs the plan, through the installed runner if there is one. Inputs are taken by value and released
  // after their last use, so a caller that moves them in lets their memory go early (AOTAutograd's
  // boxed calling convention).
  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) const;
  // The same call on inputs the caller keeps: a replay reads them where they are, anything else runs on
  // a copy (DirectCall: a replayed call then takes no reference to any input).
  // `guarded`: see PlanRunner::replay_borrowed.
  std::vector<c10::IValue> run_borrowed(const std::vector<c10::IValue>& inputs, bool guarded = false) const;

  // The plain plan, in three pieces a runner can interleave with its own work: the buffer table with
  // the inputs and constants in place; steps [first, last) over it; the graph outputs read from it.
  std::vector<c10::IValue> start(std::vector<c10::IValue> inputs) const;
  void execute(std::vector<c10::IValue>& buffers, size_t first, size_t last) const;
  std::vector<c10::IValue> finish(std::vector<c10::IValue>& buffers) const;

  // Runs the steps over parameters once and then only when a parameter changed (hoist_parameter_steps):
  // at the start of a call, each parameter they read is compared with the one they last ran on (the
  // same TensorImpl, version counter and data pointer). On a change they run again and their results
  // are copied into the cached tensors, which keep their addresses for captured CUDA graphs. A
  // parameter written through `.data` (which has a version counter of its own) is not seen: set
  // ember.config.parameter_cache = False (backend.py) for models changed that way. Inference tensors carry no
  // version counter, so with one among the parameters the steps run on every call. Call before
  // set_runner. Returns the number of steps moved.
  // `sizes`: the int inputs (a symbolic graph's sizes) count as pinned too, and the results are kept per value
  // of those the steps read, for the most recent few: a symbolic LLaMA's rotary cos/sin, made from the length
  // by 15 steps per call where a static compile folds them. Not for graphs a runner replays as CUDA graphs
  // (set_runner refuses): an evicted entry's tensors would be freed under a captured graph.
  size_t cache_parameter_steps(const std::vector<bool>& pinned, bool sizes = false);
  // Whether the cached results are those of `inputs`' parameters, so a call may skip start() and its
  // check (true where nothing is cached).
  bool cache_current(const std::vector<c10::IValue>& inputs) const;

  void set_runner(std::unique_ptr<PlanRunner> runner);
  const PlanRunner* runner() const { return runner_.get(); }

  // Symbolic sizes padded up to buckets around every call, before the runner sees the inputs, and outputs sliced
  // back (the pad_to_buckets option; backend/runtime/size_buckets.h). Null: calls run at their own sizes.
  void set_size_buckets(std::shared_ptr<const SizeBuckets> buckets) { buckets_ = std::move(buckets); }
  const SizeBuckets* size_buckets() const { return buckets_.get(); }

  const Graph& graph() const { return graph_; }
  const Plan& plan() const { return plan_; }
  size_t num_inputs() const { return plan_.num_inputs; }
  // One line per step: what runs, reading and writing which buffers, freeing which.
  std::string describe() const;

  // Compile-time breakdown in milliseconds: each pass, then "plan".
  std::vector<std::pair<std::string, double>> timings;

 private:
  Graph graph_;  // the optimized IR the plan was built from (kept for describe() and debugging)
  Plan plan_;
  std::unique_ptr<PlanRunner> runner_;  // null: run() executes the plan directly
  std::shared_ptr<const SizeBuckets> buckets_;

  // run() and run_borrowed() once the inputs are at their buckets.
  std::vector<c10::IValue> run_plan(std::vector<c10::IValue> inputs) const;
  std::vector<c10::IValue> run_plan_borrowed(const std::vector<c10::IValue>& inputs, bool guarded) const;

  struct ParameterCache;  // executor.cpp
  void refresh_cached(std::vector<c10::IValue>& buffers) const;
  std::shared_ptr<ParameterCache> cache_;  // set by cache_parameter_steps
};

// Runs once, at compile time, the steps that read nothing but constants and results of such steps (an
// arange; the causal mask HF's GPT-2 builds from shapes alone, some twenty small ATen kernels per call),
// and makes their results that later steps read plan constants; the steps go. Not random ops, nor in a
// plan with any in-place write, nor values that reach graph outputs or steps that may return them as
// aliases (a caller could write to them). Returns the number of steps folded; 0, changing nothing,
// where running them fails.
size_t fold_constant_steps(Plan& plan);
// Moves out of plan.steps, into plan.cached_steps, the steps that read nothing but pinned inputs
// (`pinned[i]`: input i is a parameter or buffer), constants and results of such steps: a convolution
// weight put in channels_last, an LM head's weight padded for the GEMM. The same exclusions as
// fold_constant_steps, and a step that may return an alias of a parameter is moved only with all its
// readers (the cached results are tensors of their own, refreshed in place). Returns the number of steps
// moved; none unless one of them does device work.
size_t hoist_parameter_steps(Plan& plan, const std::vector<bool>& pinned);
// One step over the buffer table, as CompiledGraph::execute runs it; `stack` is scratch.
void run_step(const Step& step, std::vector<c10::IValue>& buffers, std::vector<c10::IValue>& stack);

// The compiled subgraphs a graph's control flow nodes name (CompileOptions::subgraphs).
using Subgraphs = std::unordered_map<std::string, std::shared_ptr<const CompiledGraph>>;
// The kernel of one ember::cond / ember::while_loop / ember::scan node (runtime/control_flow.cpp): reads
// its operands, runs the subgraphs it names from `subgraphs`, writes its outputs. Throws ember::Error where
// a subgraph is missing or does not fit the call.
GroupKernel make_control_flow_kernel(const Node& n, const Subgraphs& subgraphs);

// Builds the plan for `graph`. Throws ember::Error naming the node for anything it cannot bind
// (unknown op, argument that does not fit the schema, missing constant).
// `kernels` maps fusion group ids to generated kernels; groups without one run node by node.
// `tuning` goes to the fast path makers.
Plan build_plan(const Graph& graph, const std::unordered_map<std::string, at::Tensor>& constants,
                const std::unordered_map<int, GroupKernel>& kernels = {}, const Tuning& tuning = {});

}  // namespace ember

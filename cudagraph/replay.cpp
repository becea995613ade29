// Capture and replay of a plan's captured parts (mode="reduce-overhead").
//
// Per call: find the entry for the inputs' signature (shapes, strides, dtypes, host values; a short
// linear scan, no hashing); a new signature runs eagerly `warmup` times (on the capture stream, so lazily
// created library state such as cuBLAS workspaces exists before capture), then its parts are captured;
// after that each call copies the inputs that changed address into static buffers, replays the parts
// and runs the eager parts between them.
//
// Ownership of graph memory, the rule that keeps outputs from being silently overwritten:
//  1. Every tensor a replay leaves behind (outputs, values later eager steps read) lives in memory the
//     graph owns (a Slot); callers get aliases of it (new TensorImpls on the same storage).
//  2. Before anything writes a slot (a replay, an input copy), holders other than ember are detected
//     (storage use count above ember's own references) and given a private copy: their storage's
//     DataPtr is swapped with a fresh allocation holding the same bytes, and the graph keeps its memory.
//     A caller's old output keeps its value and costs one device copy, only while it is still alive; in
//     the usual loops (backward consumed the activations, the loss was reduced and dropped) nothing is
//     alive and a replay copies nothing. Inductor raises in that case; cloning every output would
//     cost a copy on every call.
//  3. Which slots a replay may write: every graph on a device shares one private pool, so a graph
//     captured later may own memory that an earlier graph used for temporaries. A replay of graph G
//     writes G's slots and, through its temporaries, possibly the slots of any graph captured after G,
//     never those of graphs captured before G (allocated, hence untouchable, while G was captured). So
//     a replay of G protects the slots of G and of every later graph in capture order.
//  4. After torch.compiler.cudagraph_mark_step_begin(), slots handed out before it are not protected:
//     the caller has declared them dead.
// Inputs: parameters and buffers (pinned) and tensors living in another graph's slots (a forward's
// activations reaching its backward) are used in place and their addresses are part of the entry; a
// pinned input found at a new address is captured again at the new address once, then copied.
// Input copies: a contiguous input is copied into its static buffer by a memcpy node captured at the head
// of the graph; per call the node's source is pointed at the caller's tensor (cudaGraphExecMemcpyNodeSet-
// Params1D, only when the address changed, which affects later launches only) or the node is disabled when
// the caller passes the static buffer itself. On the H100 a cudaMemcpyAsync before each launch cost 5.2 us
// of the 8.2 us a replayed 3-op graph spent in ember (input of 16 floats). Other inputs (strided, or a torch
// that cannot keep the captured graph for node updates) are copied before the launch, as copy_ does.
// Launch: a part whose steps draw no random numbers is launched with cudaGraphLaunch on the graph's
// executable (where this torch exposes it); CUDAGraph::replay() would first refresh the CUDA
// generator's seed and offset tensors with two fill_ launches, which only RNG consumers need. Parts
// that may draw random numbers go through replay(), so each replay gets fresh ones.
#include "cudagraph/runner.h"

#include "ember/error.h"
#include "ember/runtime.h"
#include "kernels/cuda/driver.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>

namespace ember::cudagraph {
namespace {

constexpr int kMaxRecaptures = 8;  // per entry: pinned inputs that keep moving end in eager calls

uint64_t generation() { return step_generation.load(std::memory_order_relaxed); }

// One preformatted string: c10::str's stream formatting of integers crashed inside the Python process on
// the GPU machine (the same locale problem kernels/cuda/cuda_kernel.cpp avoids).
void warn(const std::string& message) { TORCH_WARN(message); }

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("ember cudagraph: ") + what + ": " + cudaGetErrorString(e));
}

// One storage of memory a graph writes, with ember's own tensors on it.
struct Slot {
  std::deque<at::Tensor> mine;  // a deque: exports keep pointers to its elements while later parts add more
  uint64_t handed = 0;  // step generation when it was last handed out

  // Gives every holder besides ember a private copy of the memory, so the next write cannot change
  // what they see (rule 2 above).
  void release_holders(const c10::cuda::CUDAStream& stream) {
    const at::Storage& storage = mine.front().storage();
    if (static_cast<size_t>(storage.use_count()) <= mine.size() || handed < generation()) return;
    c10::StorageImpl* held = storage.unsafeGetStorageImpl();
    size_t nbytes = held->nbytes();
    at::Tensor copy = at::empty({static_cast<int64_t>(nbytes)}, mine.front().options().dtype(at::kByte));
    if (nbytes > 0)
      check(cudaMemcpyAsync(copy.data_ptr(), held->data(), nbytes, cudaMemcpyDeviceToDevice, stream.stream()),
            "copying a held output");
    c10::StorageImpl* fresh = copy.storage().unsafeGetStorageImpl();
    at::DataPtr copied = fresh->set_data_ptr(at::DataPtr());
    at::DataPtr graph_memory = held->set_data_ptr(std::move(copied));
    fresh->set_data_ptr(std::move(graph_memory));
    for (at::Tensor& t : mine) t.unsafeGetTensorImpl()->set_storage_keep_dtype(copy.storage());
  }
};

// Groups tensors by storage into slots.
std::vector<Slot> slots_of(const std::vector<at::Tensor>& tensors, std::vector<std::pair<size_t, size_t>>* where) {
  std::vector<Slot> slots;
  std::map<const c10::StorageImpl*, size_t> index;
  for (const at::Tensor& t : tensors) {
    auto [it, fresh] = index.emplace(t.storage().unsafeGetStorageImpl(), slots.size());
    if (fresh) slots.emplace_back();
    where->emplace_back(it->second, slots[it->second].mine.size());
    slots[it->second].mine.push_back(t);
  }
  return slots;
}

// A new TensorImpl on the same memory: what callers and eager steps get of a slot.
at::Tensor alias(const at::Tensor& t) {
  return at::Tensor(t.unsafeGetTensorImpl()->shallow_copy_and_detach(c10::VariableVersion(0), false));
}

// Bytes from a tensor's first element to its last. An input with stride-0 dims (an expand) has fewer
// elements in memory than numel(), and copy_ refuses to write into such a tensor: its static copy keeps
// the caller's strides over a buffer of this span, and the span is copied as raw bytes.
size_t span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return size_t(last + 1) * t.element_size();
}

// An uninitialised tensor of t's sizes and strides, for a captured part to read t's values from.
at::Tensor static_buffer_like(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return at::empty_strided(t.sizes(), t.strides(), t.options());
  at::Tensor span = at::empty({int64_t(span_bytes(t) / t.element_size())}, t.options());
  return span.as_strided(t.sizes(), t.strides());
}

// Writes src's values into dst, a static_buffer_like of a tensor of src's sizes.
void copy_to_static(at::Tensor& dst, const at::Tensor& src, cudaStream_t stream) {
  if (dst.is_non_overlapping_and_dense()) {
    dst.copy_(src, true);
    return;
  }
  TORCH_CHECK(src.strides().equals(dst.strides()) && src.scalar_type() == dst.scalar_type(),
              "ember cudagraph: internal: an overlapping input of a captured part changed its strides");
  check(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), span_bytes(src), cudaMemcpyDeviceToDevice, stream),
        "copying an overlapping input");
}

// Drops c10 warnings raised in its scope.
class QuietWarnings : public c10::WarningHandler {
 public:
  QuietWarnings() : previous_(c10::WarningUtils::get_warning_handler()) { c10::WarningUtils::set_warning_handler(this); }
  ~QuietWarnings() override { c10::WarningUtils::set_warning_handler(previous_); }
  void process(const c10::Warning&) override {}

 private:
  c10::WarningHandler* previous_;
};

// Whether a part's steps may draw from the CUDA generator (conservatively, by op name; ember's own
// kernels draw nothing).
bool draws_random_numbers(const Plan& plan, const Part& p) {
  static const char* const kRandom[] = {"rand",    "bernoulli", "dropout",   "normal",   "uniform",
                                        "multinomial", "exponential", "geometric", "cauchy", "poisson",
                                        "rrelu",   "gamma",     "dirichlet", "binomial", "attention"};
  for (size_t s = p.first; s < p.last; ++s) {
    const Step& step = plan.steps[s];
    if (step.kernel || step.prim != PrimOp::None) continue;
    if (!step.node) return true;
    const std::string& name = step.node->op;
    for (const char* word : kRandom)
      if (name.find(word) != std::string::npos) return true;
  }
  return false;
}

// A graph that keeps its cudaGraph_t after capture (so its nodes can be found and updated), where this
// torch can (CUDAGraph(keep_graph) and instantiate(), torch >= 2.8); else a plain one.
template <class G>
auto kept_graph(int) -> decltype(G(true).instantiate(), std::declval<G&>().raw_cuda_graph(), std::unique_ptr<G>()) {
  return std::make_unique<G>(true);
}
template <class G>
std::unique_ptr<G> kept_graph(long) {
  return nullptr;
}
template <class G>
auto instantiate_kept(G& graph, int) -> decltype(graph.instantiate(), graph.raw_cuda_graph()) {
  graph.instantiate();
  return graph.raw_cuda_graph();
}
template <class G>
cudaGraph_t instantiate_kept(G&, long) {
  return nullptr;
}

// The memcpy node of `graph` writing `dst` from `src`; null if there is none.
cudaGraphNode_t find_copy_node(cudaGraph_t graph, const void* dst, const void* src) {
  size_t count = 0;
  if (!graph || cudaGraphGetNodes(graph, nullptr, &count) != cudaSuccess) return nullptr;
  std::vector<cudaGraphNode_t> nodes(count);
  if (cudaGraphGetNodes(graph, nodes.data(), &count) != cudaSuccess) return nullptr;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    cudaMemcpy3DParms params{};
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeMemcpy) continue;
    if (cudaGraphMemcpyNodeGetParams(node, &params) != cudaSuccess) continue;
    if (params.dstPtr.ptr == dst && params.srcPtr.ptr == src) return node;
  }
  return nullptr;
}

// The graph's executable, for launching it without replay(); null where this torch does not expose it.
template <class G>
auto executable_of(G& graph, int) -> decltype(graph.raw_cuda_graph_exec()) {
  return graph.raw_cuda_graph_exec();
}
template <class G>
cudaGraphExec_t executable_of(G&, long) {
  return nullptr;
}

// One captured part of one entry.
struct Segment {
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  cudaGraphExec_t exec = nullptr;    // the graph's executable (null where this torch hides it)
  cudaGraphExec_t launch = nullptr;  // set for parts that draw no random numbers: launched directly
  uint64_t seq = 0;                                        // capture order on the device
  struct Copied {          // an input buffer copied into a static buffer
    uint32_t buffer = 0;
    Slot slot;             // the static buffer
    cudaGraphNode_t node = nullptr;  // the memcpy node at the head of the graph that copies it; null: copied before the launch
    size_t nbytes = 0;
    const void* source = nullptr;    // where the node copies from now
    bool enabled = true;
  };
  std::vector<Copied> copied;
  std::vector<Slot> kept;                                  // graph memory the exports live in
  struct Export {
    uint32_t buffer;
    const at::Tensor* master;  // in a Slot's `mine` or in `borrowed`; stable once the capture is done
    bool in_table;             // eager steps or the outputs read it (else only later captured parts, by address)
  };
  std::vector<Export> exports;
  std::vector<at::Tensor> borrowed;  // exports on memory no replay writes (views of parameters, constants)
  std::vector<std::pair<uint32_t, c10::IValue>> values;    // host values the part computed
};

// Per device: the private pool every ember graph shares, the stream captures run on, the captured
// segments in capture order, and the lock that serializes capture and replay on the device.
class DevicePool {
 public:
  static DevicePool& of(c10::DeviceIndex device) {
    static std::mutex m;
    static std::map<c10::DeviceIndex, DevicePool*> pools;  // never freed: outlives every runner
    std::lock_guard<std::mutex> lock(m);
    DevicePool*& p = pools[device];
    if (!p) p = new DevicePool(device);
    return *p;
  }

  std::recursive_mutex mutex;
  at::cuda::MempoolId_t id;
  c10::cuda::CUDAStream side;
  uint64_t next_seq = 1;

  void add(Segment* s) { segments_.push_back(s); }
  void remove(Segment* s) { segments_.erase(std::remove(segments_.begin(), segments_.end(), s), segments_.end()); }

  // Rule 3: before a replay of the segment captured at `seq`.
  void protect(uint64_t seq, const c10::cuda::CUDAStream& stream) {
    auto it = std::lower_bound(segments_.begin(), segments_.end(), seq, [](Segment* s, uint64_t q) { return s->seq < q; });
    for (; it != segments_.end(); ++it)
      for (Slot& slot : (*it)->kept) slot.release_holders(stream);
  }

  // True when `t` lives in a slot of a captured segment.
  bool owns(const at::Tensor& t) const {
    const void* data = t.storage().data();
    for (const Segment* s : segments_)
      for (const Slot& slot : s->kept)
        if (slot.mine.front().storage().data() == data) return true;
    return false;
  }

 private:
  explicit DevicePool(c10::DeviceIndex device)
      : id(at::cuda::graph_pool_handle()), side(c10::cuda::getStreamFromPool(false, device)) {
    // The allocator frees a private pool once no graph uses it, and a pool id reused after that is
    // undefined: an empty graph captured into the pool and never freed keeps it alive (inductor's
    // cudagraph trees do the same).
    c10::cuda::CUDAGuard device_guard(device);
    c10::cuda::CUDAStreamGuard stream_guard(side);
    // The capture registers the device's RNG state, which allocates its seed and offset tensors: they
    // must be real even if a Python dispatch mode (a fake tensor mode) is active on this thread.
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    QuietWarnings quiet;  // "the CUDA graph is empty": on purpose here
    keep_alive_ = std::make_unique<at::cuda::CUDAGraph>();
    keep_alive_->capture_begin(id, cudaStreamCaptureModeThreadLocal);
    keep_alive_->capture_end();
  }
  std::vector<Segment*> segments_;  // ascending seq
  std::unique_ptr<at::cuda::CUDAGraph> keep_alive_;
};

struct InputKey {
  bool tensor = false;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device{c10::kCPU};
  c10::IValue value;  // non-tensor inputs: the value itself

  explicit InputKey(const c10::IValue& v) {
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();
      tensor = true;
      sizes.assign(t.sizes().begin(), t.sizes().end());
      strides.assign(t.strides().begin(), t.strides().end());
      dtype = t.scalar_type();
      device = t.device();
    } else if (!v.isTensor()) {
      value = v;
    }
  }
  bool matches(const c10::IValue& v) const {
    if (tensor) {
      if (!v.isTensor()) return false;
      const at::Tensor& t = v.toTensor();
      return t.defined() && t.scalar_type() == dtype && t.device() == device && t.sizes().equals(sizes) &&
             t.strides().equals(strides);
    }
    if (v.isTensor()) return value.isNone() && !v.toTensor().defined();
    if (v.isInt()) return value.isInt() && value.toInt() == v.toInt();
    if (v.isDouble()) return value.isDouble() && value.toDouble() == v.toDouble();
    if (v.isBool()) return value.isBool() && value.toBool() == v.toBool();
    return v.isNone() && value.isNone();
  }
};

// How a whole-plan replay (Runner::replay_whole) makes each graph output: an alias of an export's
// master, an input or host value passed through, or the same object as an earlier output.
struct OutputRecipe {
  enum class Kind : uint8_t { Export, Input, Value, Same } kind = Kind::Value;
  const at::Tensor* master = nullptr;
  uint32_t index = 0;  // Input: the input; Same: the earlier output
  c10::IValue value;
};

struct Entry {
  enum class State { Warming, Captured, Eager };
  std::vector<InputKey> key;
  State state = State::Warming;
  int calls = 0, recaptures = 0;
  uint64_t used = 0;                  // the runner's call count at this signature's last call (eviction)
  std::vector<bool> pin;              // per input: used in place at `pointer`
  std::vector<const void*> pointer;
  std::vector<int> moved;             // per input: times a pinned input came at a new address
  std::vector<uint32_t> pinned, loose;  // the inputs with pin set, and the others
  std::vector<std::unique_ptr<Segment>> segments;  // one per captured part, in order
  // Set once captured, where one captured part is the whole plan and every output has a recipe: replays
  // then skip the buffer table (replay_whole).
  bool whole = false;
  std::vector<OutputRecipe> outputs;
};

class Runner final : public PlanRunner {
 public:
  Runner(const CompiledGraph& graph, Segmentation seg, std::vector<bool> pinned, const CudaGraphOptions& options)
      : graph_(graph), seg_(std::move(seg)), hint_(std::move(pinned)), options_(options),
        device_(static_cast<c10::DeviceIndex>(seg_.device)) {
    const Plan& plan = graph_.plan();
    source_.assign(plan.num_buffers, Source::Eager);
    for (size_t b = 0; b < plan.num_inputs; ++b) source_[b] = Source::Input;
    for (const auto& [b, v] : plan.constants) source_[b] = Source::Constant;
    for (uint32_t b : plan.cached_results) source_[b] = Source::Constant;  // refreshed in place (runtime.h)
    std::vector<bool> read_eagerly(plan.num_buffers, false);
    for (const Part& p : seg_.parts)
      if (!p.captured)
        for (size_t s = p.first; s < p.last; ++s)
          for (uint32_t b : step_reads(plan.steps[s])) read_eagerly[b] = true;
    for (const PlanOutput& o : plan.outputs)
      if (o.buffer >= 0) read_eagerly[o.buffer] = true;
    for (const Part& p : seg_.parts)
      if (p.captured)
        for (uint32_t b : p.exports) {
          source_[b] = Source::Captured;
          in_table_.push_back(read_eagerly[b]);
        }
  }

  ~Runner() override {
    if (!pool_) return;
    try {
      std::lock_guard<std::recursive_mutex> lock(pool_->mutex);
      for (auto& e : entries_) drop_segments(*e);
    } catch (...) {  // at interpreter exit CUDA may be gone; the process frees everything anyway
    }
  }

  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) override {
    if (!pool_) pool_ = &DevicePool::of(device_);
    std::lock_guard<std::recursive_mutex> lock(pool_->mutex);
    c10::cuda::CUDAGuard device_guard(device_);
    Entry* e = nullptr;
    bool same_addresses = false;
    for (auto& candidate : entries_)
      if (key_matches(*candidate, inputs)) {
        e = candidate.get();
        same_addresses = e->state != Entry::State::Captured || addresses_match(*e, inputs);
        break;
      }
    if (!e) {
      if (static_cast<int>(entries_.size()) >= options_.max_graphs) evict();
      entries_.push_back(std::make_unique<Entry>());
      e = entries_.back().get();
      for (const c10::IValue& v : inputs) e->key.emplace_back(v);
      size_t n = inputs.size();
      e->pin.assign(n, false);
      e->pointer.assign(n, nullptr);
      e->moved.assign(n, 0);
    }
    e->used = ++calls_;
    switch (e->state) {
      case Entry::State::Eager: return eager(std::move(inputs));
      case Entry::State::Warming:
        if (++e->calls <= options_.warmup) return warm_up(std::move(inputs));
        return capture(*e, std::move(inputs));
      case Entry::State::Captured:
        if (same_addresses && e->whole && graph_.cache_current(inputs)) return replay_whole(*e, inputs);
        if (same_addresses) return replay(*e, std::move(inputs));
        if (++e->recaptures > kMaxRecaptures) {
          warn("ember: inputs the CUDA graphs use in place keep moving; this input signature runs without CUDA graphs");
          drop_segments(*e);
          e->state = Entry::State::Eager;
          return eager(std::move(inputs));
        }
        return capture(*e, std::move(inputs));
    }
    return eager(std::move(inputs));
  }

  void launch_exec(cudaGraphExec_t exec, const c10::cuda::CUDAStream& stream) const {
    cuda::launch_graph(exec, stream.stream(), device_);
  }

  // run()'s replay_whole branch without taking the inputs: the common replayed call.
  std::optional<std::vector<c10::IValue>> replay_borrowed(const std::vector<c10::IValue>& inputs, bool guarded) override {
    if (!pool_) return std::nullopt;
    std::lock_guard<std::recursive_mutex> lock(pool_->mutex);
    const bool quick = guarded && entries_.size() == 1;
    for (auto& candidate : entries_) {
      if (quick ? !loose_keys_match(*candidate, inputs) : !key_matches(*candidate, inputs)) continue;
      Entry& e = *candidate;
      if (e.state != Entry::State::Captured || !e.whole || !addresses_match(e, inputs)) return std::nullopt;
      if (!graph_.cache_current(inputs)) return std::nullopt;
      e.used = ++calls_;
      std::optional<c10::cuda::CUDAGuard> device_guard;
      if (!cuda::is_current(device_)) device_guard.emplace(device_);
      return replay_whole(e, inputs);
    }
    return std::nullopt;
  }

  std::string describe() const override {
    std::unique_lock<std::recursive_mutex> lock;
    if (pool_) lock = std::unique_lock<std::recursive_mutex>(pool_->mutex);
    size_t captured = 0, warming = 0, eager_entries = 0;
    for (const auto& e : entries_)
      (e->state == Entry::State::Captured ? captured : e->state == Entry::State::Warming ? warming : eager_entries)++;
    std::string out = "cuda graphs on cuda:" + std::to_string(device_) + ": " + std::to_string(seg_.captured_parts()) +
                      " of " + std::to_string(seg_.parts.size()) + " parts captured\n" + seg_.describe();
    out += "  signatures: " + std::to_string(captured) + " captured, " + std::to_string(warming) + " warming up, " +
           std::to_string(eager_entries) + " eager; calls: " + std::to_string(stats_.replays) + " replayed, " +
           std::to_string(stats_.captures) + " captured, " + std::to_string(stats_.eager) + " eager; inputs copied: " +
           std::to_string(stats_.input_copies) + " (" + std::to_string(stats_.node_copies) + " by the graphs' own copy nodes)" +
           (stats_.evictions ? "; " + std::to_string(stats_.evictions) + " signatures evicted" : "") + "\n";
    // Which sizes hold graphs: the shapes of the inputs each captured signature copies (not parameters).
    std::string sizes;
    size_t shown = 0;
    for (const auto& e : entries_) {
      if (e->state != Entry::State::Captured) continue;
      if (shown++ == 8) {
        sizes += " ...";
        break;
      }
      std::string shapes;
      for (uint32_t i : e->loose) {
        const InputKey& k = e->key[i];
        if (!k.tensor) continue;
        std::string dims;
        for (int64_t d : k.sizes) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
        shapes += (shapes.empty() ? "[" : " [") + dims + "]";
      }
      sizes += (sizes.empty() ? "" : "; ") + (shapes.empty() ? std::string("no copied inputs") : shapes);
    }
    if (!sizes.empty()) out += "  sizes captured: " + sizes + "\n";
    return out;
  }

 private:
  enum class Source : uint8_t { Input, Constant, Captured, Eager };

  // Makes room for a new signature at the cap (options_.max_graphs): the least recently used signature still
  // warming up goes first (a size seen once, as in a serving run whose sizes never repeat, then never displaces
  // a captured one), else the least recently used captured one, else one given up to eager calls. Its graphs
  // are dropped as a recapture drops them: a caller still holding one of their outputs keeps its value.
  void evict() {
    auto victim = entries_.end();
    auto rank = [](const Entry& e) { return e.state == Entry::State::Warming ? 0 : e.state == Entry::State::Captured ? 1 : 2; };
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (victim == entries_.end() || rank(**it) < rank(**victim) ||
          (rank(**it) == rank(**victim) && (*it)->used < (*victim)->used))
        victim = it;
    if (victim == entries_.end()) return;
    if (!warned_limit_) {
      warned_limit_ = true;
      warn("ember: a compiled graph met more than " + std::to_string(options_.max_graphs) +
           " input signatures (shapes, strides, dtypes, scalar values) in reduce-overhead mode; the least recently "
           "used give up their CUDA graphs (option cudagraph_max_graphs or EMBER_CUDAGRAPH_MAX_GRAPHS raises the limit)");
    }
    drop_segments(**victim);
    entries_.erase(victim);
    ++stats_.evictions;
  }

  bool key_matches(const Entry& e, const std::vector<c10::IValue>& inputs) const {
    for (size_t i = 0; i < inputs.size(); ++i)
      if (!e.key[i].matches(inputs[i])) return false;
    return true;
  }
  // key_matches for a caller whose guards fixed every tensor input's signature (PlanRunner::replay_borrowed):
  // the inputs the graphs copy still have theirs checked, as a wrong size there would copy out of bounds.
  bool loose_keys_match(const Entry& e, const std::vector<c10::IValue>& inputs) const {
    for (uint32_t i : e.loose)
      if (!e.key[i].matches(inputs[i])) return false;
    return true;
  }
  bool addresses_match(const Entry& e, const std::vector<c10::IValue>& inputs) const {
    for (uint32_t i : e.pinned)
      if (inputs[i].toTensor().data_ptr() != e.pointer[i]) return false;
    return true;
  }

  std::vector<c10::IValue> eager(std::vector<c10::IValue> inputs) {
    ++stats_.eager;
    std::vector<c10::IValue> buffers = graph_.start(std::move(inputs));
    graph_.execute(buffers, 0, graph_.plan().steps.size());
    return graph_.finish(buffers);
  }

  // Runs `work` on the capture stream, ordered after the caller's stream and before its later work.
  template <class F>
  std::vector<c10::IValue> on_side_stream(F work) {
    c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_);
    at::cuda::CUDAEvent before, after;
    before.record(current);
    before.block(pool_->side);
    std::vector<c10::IValue> out;
    {
      c10::cuda::CUDAStreamGuard guard(pool_->side);
      out = work();
    }
    after.record(pool_->side);
    after.block(current);
    return out;
  }

  std::vector<c10::IValue> warm_up(std::vector<c10::IValue> inputs) {
    WarmingForGraphs for_graphs;  // choices made now serve replays
    return on_side_stream([&] { return eager(std::move(inputs)); });
  }

  void drop_segments(Entry& e) {
    c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_);
    for (auto& s : e.segments) {
      // Holders of the memory keep their values: the pool may hand it to a later capture.
      try {
        for (Slot& slot : s->kept) slot.release_holders(current);
      } catch (...) {
      }
      pool_->remove(s.get());
    }
    e.segments.clear();
  }

  std::vector<c10::IValue> capture(Entry& e, std::vector<c10::IValue> inputs) {
    drop_segments(e);
    for (size_t i = 0; i < inputs.size(); ++i) {
      e.pin[i] = false;
      if (!inputs[i].isTensor() || !inputs[i].toTensor().defined() || !inputs[i].toTensor().is_cuda()) continue;
      const at::Tensor& t = inputs[i].toTensor();
      const void* p = t.data_ptr();
      if (e.pointer[i] && e.pointer[i] != p) ++e.moved[i];
      e.pin[i] = (i < hint_.size() && hint_[i] && e.moved[i] < 2) || pool_->owns(t);
      e.pointer[i] = p;
    }
    e.pinned.clear();
    e.loose.clear();
    for (size_t i = 0; i < inputs.size(); ++i) (e.pin[i] ? e.pinned : e.loose).push_back(static_cast<uint32_t>(i));
    ++stats_.captures;
    caller_stream_ = c10::cuda::getCurrentCUDAStream(device_);
    return on_side_stream([&] { return capture_parts(e, std::move(inputs)); });
  }

  std::vector<c10::IValue> capture_parts(Entry& e, std::vector<c10::IValue> inputs) {
    const Plan& plan = graph_.plan();
    std::vector<c10::IValue> buffers = graph_.start(std::move(inputs));
    bool failed = false;
    size_t export_index = 0;
    for (const Part& p : seg_.parts) {
      if (!p.captured || failed) {
        graph_.execute(buffers, p.first, p.last);
        continue;
      }
      auto sg = std::make_unique<Segment>();
      sg->graph = graph_copies_ ? kept_graph<at::cuda::CUDAGraph>(0) : nullptr;
      const bool in_graph = sg->graph != nullptr;  // input copies as memcpy nodes (see the head of this file)
      if (!sg->graph) sg->graph = std::make_unique<at::cuda::CUDAGraph>();
      std::vector<std::pair<uint32_t, c10::IValue>> originals;  // caller tensors replaced by static copies
      for (uint32_t b : p.inputs) {
        if (!buffers[b].isTensor()) continue;
        const at::Tensor& t = buffers[b].toTensor();
        bool copy = t.defined() && t.is_cuda() &&
                    ((source_[b] == Source::Input && !e.pin[b]) || source_[b] == Source::Eager);
        if (!copy) continue;
        originals.emplace_back(b, buffers[b]);
        at::Tensor fixed = static_buffer_like(t);
        Segment::Copied c;
        c.buffer = b;
        if (in_graph && t.is_contiguous() && t.nbytes() > 0) {  // copied by a node captured below
          c.nbytes = t.nbytes();
          c.source = t.data_ptr();
        } else {
          copy_to_static(fixed, t, c10::cuda::getCurrentCUDAStream(device_).stream());
        }
        // Allocated on the capture stream, written on the caller's stream at every replay: the allocator
        // must wait for both before it reuses the block.
        c10::cuda::CUDACachingAllocator::recordStream(fixed.storage().data_ptr(), caller_stream_);
        buffers[b] = fixed;
        c.slot.mine.push_back(fixed);
        sg->copied.push_back(std::move(c));
      }
      std::vector<std::pair<uint32_t, c10::IValue>> saved;
      for (uint32_t b : p.inputs) saved.emplace_back(b, buffers[b]);
      // Eager steps after the part must see the caller's tensors, not the static copies (an input
      // mutation written back by an eager copy_ must reach the caller).
      auto restore_originals = [&] {
        for (auto& [b, original] : originals)
          if (!buffers[b].isNone()) buffers[b] = original;
      };
      try {
        sg->graph->capture_begin(pool_->id, cudaStreamCaptureModeThreadLocal);
        try {
          cudaStream_t capture_stream = c10::cuda::getCurrentCUDAStream(device_).stream();
          for (const Segment::Copied& c : sg->copied)
            if (c.source)
              check(cudaMemcpyAsync(c.slot.mine.front().data_ptr(), c.source, c.nbytes, cudaMemcpyDeviceToDevice,
                                    capture_stream),
                    "capturing an input copy");
          graph_.execute(buffers, p.first, p.last);
        } catch (...) {
          abandon(*sg->graph);
          throw;
        }
        sg->graph->capture_end();
        if (in_graph) {
          cudaGraph_t raw = instantiate_kept(*sg->graph, 0);
          const bool updatable = executable_of(*sg->graph, 0) != nullptr;
          for (Segment::Copied& c : sg->copied) {
            if (!c.source) continue;
            c.node = updatable ? find_copy_node(raw, c.slot.mine.front().data_ptr(), c.source) : nullptr;
            if (!c.node) {  // every later replay would copy from a stale address: give the signature up
              graph_copies_ = false;
              throw Error("the captured input copy was not found among the graph's nodes");
            }
          }
        }
      } catch (const std::exception& ex) {
        warn("ember: CUDA graph capture of plan steps " + std::to_string(p.first) + "-" + std::to_string(p.last - 1) +
             " failed; this input signature runs without CUDA graphs: " + ex.what());
        (void)cudaGetLastError();
        failed = true;
        for (auto& [b, v] : saved) buffers[b] = v;
        restore_originals();
        graph_.execute(buffers, p.first, p.last);
        continue;
      }
      sg->exec = executable_of(*sg->graph, 0);
      if (!draws_random_numbers(plan, p)) sg->launch = sg->exec;
      sg->graph->replay();
      keep_exports(e, *sg, p, buffers, inputs_of_part(saved), &export_index);
      restore_originals();
      uint64_t now = generation();
      for (Slot& s : sg->kept) s.handed = now;
      sg->seq = pool_->next_seq++;
      pool_->add(sg.get());
      e.segments.push_back(std::move(sg));
    }
    if (failed) {
      drop_segments(e);
      e.state = Entry::State::Eager;
    } else {
      e.state = Entry::State::Captured;
      plan_whole_replay(e);
    }
    return graph_.finish(buffers);
  }

  // Whether replays of `e` may take replay_whole, and its output recipes: one captured part runs every
  // step (no eager step reads or writes the buffer table), the parts' input copies are of graph inputs,
  // and each output is an export, a host value the part computed, an input, a constant or an earlier
  // output.
  void plan_whole_replay(Entry& e) {
    const Plan& plan = graph_.plan();
    e.whole = false;
    e.outputs.clear();
    if (seg_.parts.size() != 1 || !seg_.parts[0].captured || seg_.parts[0].first != 0 ||
        seg_.parts[0].last != plan.steps.size() || e.segments.size() != 1)
      return;
    const Segment& sg = *e.segments[0];
    for (const Segment::Copied& c : sg.copied)
      if (c.buffer >= plan.num_inputs) return;
    std::vector<const c10::IValue*> constant(plan.num_buffers, nullptr);
    for (const auto& [b, v] : plan.constants) constant[b] = &v;
    for (size_t k = 0; k < plan.outputs.size(); ++k) {
      const PlanOutput& o = plan.outputs[k];
      OutputRecipe r;
      if (o.buffer < 0) {
        r.value = o.constant;
        e.outputs.push_back(std::move(r));
        continue;
      }
      const uint32_t b = static_cast<uint32_t>(o.buffer);
      bool found = false;
      for (size_t j = 0; j < k && !found; ++j)
        if (plan.outputs[j].buffer == o.buffer) {
          r.kind = OutputRecipe::Kind::Same;
          r.index = static_cast<uint32_t>(j);
          found = true;
        }
      for (const Segment::Export& x : sg.exports)
        if (!found && x.buffer == b) {
          r.kind = OutputRecipe::Kind::Export;
          r.master = x.master;
          found = true;
        }
      for (const auto& [vb, v] : sg.values)
        if (!found && vb == b) {
          r.value = v;
          found = true;
        }
      if (!found && b < plan.num_inputs) {
        r.kind = OutputRecipe::Kind::Input;
        r.index = b;
        found = true;
      }
      if (!found && constant[b]) {
        r.value = *constant[b];
        found = true;
      }
      if (!found) {  // a cached result, say: the general replay reads it from the table
        e.outputs.clear();
        return;
      }
      e.outputs.push_back(std::move(r));
    }
    e.whole = true;
  }

  static std::vector<at::Tensor> inputs_of_part(const std::vector<std::pair<uint32_t, c10::IValue>>& saved) {
    std::vector<at::Tensor> out;
    for (const auto& [b, v] : saved)
      if (v.isTensor() && v.toTensor().defined()) out.push_back(v.toTensor());
    return out;
  }

  // After the first replay of a freshly captured part: records what it leaves behind. A kept tensor on
  // memory the capture allocated belongs to one of the segment's new slots; one on memory that existed
  // before (a view of a static input copy, of an earlier part's slot, of a parameter) joins that
  // memory's owner, so each slot's count of ember's own references stays exact.
  void keep_exports(Entry& e, Segment& sg, const Part& p, std::vector<c10::IValue>& buffers,
                    const std::vector<at::Tensor>& part_inputs, size_t* export_index) {
    std::map<const c10::StorageImpl*, Slot*> owners;
    std::map<const c10::StorageImpl*, bool> unowned;
    for (auto& seg : e.segments) {
      for (auto& c : seg->copied) owners[c.slot.mine.front().storage().unsafeGetStorageImpl()] = &c.slot;
      for (Slot& slot : seg->kept) owners[slot.mine.front().storage().unsafeGetStorageImpl()] = &slot;
    }
    for (auto& c : sg.copied) owners[c.slot.mine.front().storage().unsafeGetStorageImpl()] = &c.slot;
    for (const at::Tensor& t : part_inputs)
      if (!owners.count(t.storage().unsafeGetStorageImpl())) unowned[t.storage().unsafeGetStorageImpl()] = true;

    struct Pending {
      uint32_t buffer;
      bool in_table;
      Slot* owner;     // existing memory with an owner
      bool borrowed;   // existing memory without one
      size_t index;    // position in owner->mine / sg.borrowed / new tensors
    };
    std::vector<Pending> pending;
    std::vector<at::Tensor> fresh;
    for (uint32_t b : p.exports) {
      bool in_table = in_table_[(*export_index)++];
      if (!buffers[b].isTensor() || !buffers[b].toTensor().defined()) {
        sg.values.emplace_back(b, buffers[b]);
        continue;
      }
      at::Tensor t = buffers[b].toTensor();
      const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
      auto owner = owners.find(impl);
      if (owner != owners.end()) {
        pending.push_back({b, in_table, owner->second, false, owner->second->mine.size()});
        owner->second->mine.push_back(t);
      } else if (unowned.count(impl)) {
        pending.push_back({b, in_table, nullptr, true, sg.borrowed.size()});
        sg.borrowed.push_back(t);
      } else {
        pending.push_back({b, in_table, nullptr, false, fresh.size()});
        fresh.push_back(t);
      }
    }
    std::vector<std::pair<size_t, size_t>> where;
    sg.kept = slots_of(fresh, &where);
    for (const Pending& x : pending) {
      const at::Tensor* master = x.owner      ? &x.owner->mine[x.index]
                                 : x.borrowed ? &sg.borrowed[x.index]
                                              : &sg.kept[where[x.index].first].mine[where[x.index].second];
      sg.exports.push_back({x.buffer, master, x.in_table});
      buffers[x.buffer] = alias(*master);
    }
  }

  // Ends a capture that an exception interrupted, leaving the stream and the allocator usable.
  void abandon(at::cuda::CUDAGraph& graph) {
    try {
      graph.capture_end();
    } catch (...) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, pool_->id);
      } catch (...) {
      }
    }
    (void)cudaGetLastError();
  }

  std::vector<c10::IValue> replay(Entry& e, std::vector<c10::IValue> inputs) {
    ++stats_.replays;
    c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device_);
    std::vector<c10::IValue> buffers = graph_.start(std::move(inputs));
    uint64_t now = generation();
    size_t k = 0;
    for (const Part& p : seg_.parts) {
      if (!p.captured) {
        graph_.execute(buffers, p.first, p.last);
        continue;
      }
      Segment& sg = *e.segments[k++];
      copy_inputs(sg, buffers, stream, now);
      pool_->protect(sg.seq, stream);
      if (sg.launch) launch_exec(sg.launch, stream);
      else sg.graph->replay();
      for (const Segment::Export& x : sg.exports)
        if (x.in_table) buffers[x.buffer] = alias(*x.master);
      for (const auto& [b, v] : sg.values) buffers[b] = v;
      for (Slot& s : sg.kept) s.handed = now;
      for (uint32_t b : p.frees) buffers[b] = c10::IValue();
    }
    return graph_.finish(buffers);
  }

  // A replay where one captured part is the whole plan (Entry::whole): the inputs stay where the caller
  // put them (the graph reads pinned ones in place and copies the others, as replay does), and the
  // outputs come from their recipes, so no buffer table is filled and emptied. On 20 x Linear (41
  // inputs) the table's 80 entries took 6 us of an 11.8 us call to release (H100 host).
  std::vector<c10::IValue> replay_whole(Entry& e, const std::vector<c10::IValue>& inputs) {
    ++stats_.replays;
    c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device_);
    const uint64_t now = generation();
    Segment& sg = *e.segments[0];
    copy_inputs(sg, inputs, stream, now);
    pool_->protect(sg.seq, stream);
    if (sg.launch) launch_exec(sg.launch, stream);
    else sg.graph->replay();
    for (Slot& s : sg.kept) s.handed = now;
    std::vector<c10::IValue> out;
    out.reserve(e.outputs.size());
    for (const OutputRecipe& r : e.outputs) {
      switch (r.kind) {
        case OutputRecipe::Kind::Export: out.emplace_back(alias(*r.master)); break;
        case OutputRecipe::Kind::Input: out.push_back(inputs[r.index]); break;
        case OutputRecipe::Kind::Same: out.push_back(out[r.index]); break;
        case OutputRecipe::Kind::Value: out.push_back(r.value); break;
      }
    }
    return out;
  }

  // Before a replay of `sg`: each input it copies (`table` holds them by buffer) reaches its static
  // buffer, through the graph's own memcpy node where it has one.
  void copy_inputs(Segment& sg, const std::vector<c10::IValue>& table, c10::cuda::CUDAStream stream, uint64_t now) {
    for (Segment::Copied& c : sg.copied) {
      const at::Tensor& src = table[c.buffer].toTensor();
      Slot& slot = c.slot;
      at::Tensor& dst = slot.mine.front();
      if (c.node) {  // the graph copies it: point its node at the caller's tensor, or switch it off
        const void* from = src.data_ptr();
        const bool copy = from != dst.data_ptr();
        if (copy != c.enabled) {
          check(cudaGraphNodeSetEnabled(sg.exec, c.node, copy ? 1 : 0), "switching an input copy");
          c.enabled = copy;
        }
        if (!copy) continue;
        if (from != c.source) {
          check(cudaGraphExecMemcpyNodeSetParams1D(sg.exec, c.node, dst.data_ptr(), from, c.nbytes,
                                                   cudaMemcpyDeviceToDevice),
                "pointing an input copy at a new tensor");
          c.source = from;
        }
        slot.release_holders(stream);
        ++stats_.input_copies;
        ++stats_.node_copies;
        slot.handed = now;
        continue;
      }
      if (src.data_ptr() == dst.data_ptr()) continue;
      TORCH_CHECK(src.sizes().equals(dst.sizes()), "ember cudagraph: internal: input of a captured part changed shape");
      slot.release_holders(stream);
      ++stats_.input_copies;
      if (src.is_contiguous() && dst.is_contiguous() && src.scalar_type() == dst.scalar_type()) {
        check(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice, stream.stream()),
              "copying an input");
      } else {
        copy_to_static(dst, src, stream.stream());
      }
      slot.handed = now;
    }
  }

  const CompiledGraph& graph_;
  Segmentation seg_;
  std::vector<bool> hint_;
  CudaGraphOptions options_;
  c10::DeviceIndex device_;
  DevicePool* pool_ = nullptr;  // made at the first call: never while AOTAutograd traces under a fake mode
  std::vector<Source> source_;   // per buffer: where a captured part's input comes from
  std::vector<bool> in_table_;   // per export of every captured part, in order
  std::vector<std::unique_ptr<Entry>> entries_;
  c10::cuda::CUDAStream caller_stream_ = c10::cuda::getDefaultCUDAStream(device_);  // during a capture
  bool warned_limit_ = false;
  uint64_t calls_ = 0;  // calls so far, the clock of Entry::used
  bool graph_copies_ = true;  // input copies as memcpy nodes (off after a failed lookup)
  struct {
    uint64_t replays = 0, captures = 0, eager = 0, input_copies = 0, node_copies = 0, evictions = 0;
  } stats_;
};

}  // namespace

std::unique_ptr<PlanRunner> make_runner(const CompiledGraph& graph, Segmentation seg, std::vector<bool> pinned,
                                        const CudaGraphOptions& options) {
  return std::make_unique<Runner>(graph, std::move(seg), std::move(pinned), options);
}

}  // namespace ember::cudagraph

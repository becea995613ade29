// The CPU kernel for a claimed matmul group: one oneDNN matmul with the epilogue as post-ops.
//  1. Per call it reads the operands' sizes and strides and hands oneDNN pointers (kernels/cpu/onednn.h); the
//     primitive for that shape was made on first sight.
//  2. Weights that are a graph input (a parameter, or a transposing view of one) and come back unmodified
//     are packed once into oneDNN's layout on their second sight and reused (WeightsPacking).
//  3. Fewer than 8 float32 rows against weights as they lie, with contiguous columns (nn.Linear's), run
//     ember's own loop (kernels/cpu/gemv.cpp): reading the weights is the work, and it spreads that over
//     the threads, where oneDNN's plain-layout kernels and MKL do not.
//  4. Operands neither takes as they are (neither rows nor columns contiguous, an empty dimension, an
//     addend that is not contiguous) run the same computation through ATen, so every input is correct; so
//     do a few bfloat16 rows, or rows against row-major weights, unless the weights are packed.
//  5. Problems of at least kTimedMacs multiply-adds (every problem under max-autotune) are timed once per shape,
//     oneDNN (its epilogue fused) against ATen (MKL, then the epilogue as ATen ops) and, for nn.Linear's layout,
//     torch's own oneDNN (point 6), and run by the fastest from then on (Library). oneDNN is not always the faster: Debian's
//     oneDNN 2.6 runs f32 matmuls on an AVX2-only host as `gemm:jit`, which took 12.4-12.9 ms for
//     [197, 768] @ [768, 3072] on the 2-core Zen host where ATen's addmm took 6.8-8.5 ms (bench/zoo.py's
//     4-layer ViT at batch 1 ran 0.87-0.99x of eager). The choice is process-wide by shape, layout and
//     epilogue, and kept in <cache_dir>/cpu (choice_record.h) for later processes, which read it instead of
//     timing; per call a kernel looks it up in its own short list.
//     EMBER_CPU_MATMUL=onednn|aten|torch, read when a plan is made, takes that library for every size oneDNN
//     would run, untimed (tests run each; torch where the call takes the operands, else oneDNN);
//     cpu_matmul_timings() (ember._C.cpu_matmul_timings) lists what each timing saw.
//  6. Torch's own oneDNN (3.x, bundled in its wheel) through mkldnn::_linear_pointwise, the op inductor's CPU
//     backend calls, with the epilogue's first op as its post-op where it is an activation other than relu
//     (its plain form) or a full-size residual add (its .binary form), the rest as ATen ops.
//  7. A relu, and what follows it, runs through ATen after either oneDNN's call: their relu maps NaN to 0
//     (epilogue_support.h, library_exact_ops). ember's loop applies the whole epilogue itself. It takes weights in nn.Linear's
//     layout ([N, K] rows contiguous, read where they lie: nothing to repack when they change) and a
//     contiguous source. torch's CPU wheel exports no oneDNN C API, so this op is the way to that copy.
//  8. A float32 matmul plus a full-size addend of at least kInPlaceBytes that dies at this step, held by nothing
//     else, against weights not packed (packed ones, a parameter's, keep the library chosen): one ATen addmm_
//     into the addend (MKL's GEMM with beta 1), untimed. A backward summing the gradients of a weight several
//     layers share (ALBERT's) does this. A new result that size comes from a fresh mmap whose pages all fault in.
//     2-core host, [64, N]^T @ [64, M] into an [N, M] sum, addmm_ in place against ATen's addmm to a new result:
//     4 MiB 1.04 / 1.83 ms, 16 MiB 3.3 / 5.0, 64 MiB 16 / 38 (oneDNN with its add post-op: 29 ms at 64 MiB).
//     Below 1 MiB the two are within noise of each other ([49, 768] rows: 0.79 / 0.71 ms).
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/choice_record.h"
#include "ember/config.h"
#include "ember/error.h"
#include "kernels/cpu/epilogue_support.h"
#include "kernels/cpu/gemv.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace ember::cpu {
namespace {

// A matrix's (stride0, stride1) as oneDNN's fast kernels take it: rows or columns contiguous. A dimension
// of size 1 takes the stride that makes the layout plain, whatever the tensor says.
bool plain_strides(const at::Tensor& t, int64_t out[2]) {
  int64_t rows = t.size(0), cols = t.size(1);
  int64_t s0 = rows == 1 ? cols : t.stride(0), s1 = cols == 1 ? rows : t.stride(1);
  if (rows == 1 && cols == 1) s0 = s1 = 1;
  if (s1 == 1 && s0 >= cols) { out[0] = s0, out[1] = 1; return true; }
  if (s0 == 1 && s1 >= rows) { out[0] = 1, out[1] = s1; return true; }
  return false;
}

// Which library runs a problem of at least kTimedMacs multiply-adds (point 5).
enum class Library : uint8_t { OneDnn, Aten, Torch };
constexpr double kTimedMacs = double(int64_t{1} << 22);  // ~60 us of f32 work on the 2-core host

// EMBER_CPU_MATMUL, read when a kernel is made: nothing times each shape, else the library forced.
std::optional<Library> forced_library() {
  const std::string s = config_value("EMBER_CPU_MATMUL").value_or("");
  if (s == "onednn") return Library::OneDnn;
  if (s == "aten") return Library::Aten;
  if (s == "torch") return Library::Torch;
  return std::nullopt;
}

const char* library_name(Library library) {
  return library == Library::Aten ? "aten" : library == Library::Torch ? "torch" : "onednn";
}

// Torch's call (point 6): the operator handles, how many of the epilogue's ops the call applies (0 or 1), and
// the arguments that never change. Null where this torch has no such op.
struct TorchLinear {
  c10::OperatorHandle unary, binary;
  size_t fused = 0;
  bool add = false;  // the .binary form: ops[0] is a full-size residual add
  c10::IValue attr, scalars, algorithm;
};

std::optional<TorchLinear> torch_linear(const EpilogueGroup& m) {
  auto find = [](const char* overload) {
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", overload});
  };
  auto unary = find(""), binary = find("binary");
  // (X, W, B, attr, scalars, algorithm) and (X, other, W, B, attr), as torch has declared them for years; a
  // torch that changed them gets no torch candidate rather than a call on the wrong arguments.
  if (!unary || !binary || unary->schema().arguments().size() != 6 || binary->schema().arguments().size() != 5)
    return std::nullopt;
  TorchLinear t{*unary, *binary};
  const char* algorithm = nullptr;
  const char* activation = m.ops.empty() ? nullptr : torch_activation(m.ops[0].kind, &algorithm);
  std::string attr = "none";  // a scale, a row added, or no op: all of the epilogue as ATen ops
  if (activation) {
    attr = activation, t.fused = 1;
  } else if (!m.ops.empty() && m.ops[0].kind == EpilogueOp::Kind::Add && !m.addend_is_row[0]) {
    attr = "add", t.fused = 1, t.add = true;
  }
  t.attr = c10::IValue(attr);
  t.scalars = c10::IValue(c10::List<std::optional<at::Scalar>>());
  t.algorithm = algorithm ? c10::IValue(std::string(algorithm)) : c10::IValue();
  return t;
}

// A problem as the timing saw it: sizes, the operands' strides, packed weights or not, and the epilogue.
using ProblemKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, std::string>;

std::mutex& chosen_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<ProblemKey, Library>& chosen() {
  static auto* choices = new std::map<ProblemKey, Library>();  // never freed: outlives every plan
  return *choices;
}

// What each timing saw, in the order problems were timed (under chosen_mutex; cpu_matmul_timings).
std::vector<std::string>& timings() {
  static auto* lines = new std::vector<std::string>();
  return *lines;
}

double elapsed_us(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - since).count();
}

class MatmulKernel final : public Kernel {
 public:
  MatmulKernel(const EpilogueGroup& m, std::unique_ptr<onednn::Matmul> dnnl, onednn::MatmulConfig config,
               bool exhaustive)
      : exhaustive_(exhaustive), dnnl_(std::move(dnnl)), config_(std::move(config)),
        library_ops_(library_exact_ops(m)), dtype_(m.dtype),
        bias_(m.bias != nullptr), ops_(m.ops),
        addend_is_row_(m.addend_is_row), pack_(m.weights_input != nullptr), text_(m.text()),
        where_("%" + m.members.front()->outputs[0]->name + " = " + m.members.front()->op), forced_(forced_library()),
        torch_(torch_linear(m)),
        accumulates_(!bias_ && ops_.size() == 1 && ops_[0].kind == EpilogueOp::Kind::Add && !addend_is_row_[0] &&
                     dtype_ == c10::kFloat) {
    for (const auto& [constant, value] : m.out_shape) out_shape_.emplace_back(constant, value != nullptr);
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    run_step(buffers, reads, writes, nullptr);
  }

  void run_then_free(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                     const std::vector<uint32_t>& writes, const std::vector<uint32_t>& frees) const override {
    run_step(buffers, reads, writes, &frees);
  }

  std::string describe() const override { return "onednn " + text_; }

 private:
  // Whether the addend (point 8) dies at this step and nothing but its buffer holds it or its storage.
  bool addend_dies(const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                   const std::vector<uint32_t>* frees) const {
    if (!accumulates_ || !frees) return false;
    const uint32_t b = reads[2];  // src, weights, then the addend (no bias)
    if (std::find(frees->begin(), frees->end(), b) == frees->end()) return false;
    const at::Tensor* a = buffer_tensor(buffers, b);
    return a && a->use_count() == 1 && a->has_storage() && a->storage().use_count() == 1 && !a->requires_grad() &&
           !a->is_conj() && !a->is_neg();
  }

  void run_step(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                const std::vector<uint32_t>& writes, const std::vector<uint32_t>* frees) const {
    const bool dying = addend_dies(buffers, reads, frees);
    size_t r = 0;
    GroupOperands g = read_operands(buffers, reads, bias_, addend_is_row_.size(), &r);
    const at::Tensor &src = *g.src, &weights = *g.weights, &bias = g.bias;
    const std::vector<at::Tensor>& addends = g.addends;
    std::vector<int64_t> shape;
    for (const auto& [constant, from_buffer] : out_shape_) shape.push_back(from_buffer ? buffers[reads[r++]].toInt() : constant);
    const at::Tensor* weights_input = pack_ ? &buffers[reads[r++]].toTensor() : nullptr;

    at::Tensor out;
    if (!run_onednn(src, weights, weights_input, bias, addends, dying, &out)) {
      try {
        out = run_aten(src, weights, bias, addends);
      } catch (const c10::Error& e) {
        rethrow_naming(e, where_);
      }
    }
    buffers[writes[0]] = shape.empty() ? std::move(out) : out.view(shape);
  }

  bool run_onednn(const at::Tensor& src, const at::Tensor& weights, const at::Tensor* weights_input, const at::Tensor& bias,
                  const std::vector<at::Tensor>& addends, bool addend_dies, at::Tensor* out) const {
    if (src.dim() != 2 || weights.dim() != 2 || src.size(1) != weights.size(0)) return false;
    if (src.scalar_type() != dtype_ || weights.scalar_type() != dtype_) return false;
    onednn::MatmulCall call;
    call.M = src.size(0), call.N = weights.size(1), call.K = src.size(1);
    if (call.M == 0 || call.N == 0 || call.K == 0) return false;
    if (!plain_strides(src, call.src_stride) || !plain_strides(weights, call.weights_stride)) return false;
    if (bias.defined()) {
      if (bias.dim() != 1 || bias.size(0) != call.N || bias.stride(0) != 1 || bias.scalar_type() != dtype_) return false;
      call.bias = bias.data_ptr();
    }
    for (size_t i = 0; i < addends.size(); ++i) {
      const at::Tensor& a = addends[i];
      if (a.scalar_type() != dtype_ || !a.is_contiguous()) return false;
      if (a.numel() != (addend_is_row_[i] ? call.N : call.M * call.N)) return false;
      call.addends.push_back(a.data_ptr());
      if (!addend_is_row_[i]) call.addend_row_stride.push_back(call.N);
    }
    bool first = weights_input && packing_.first_sight();
    uint64_t packing = weights_input ? packing_.generation(*weights_input, weights) : 0;
    call.src = src.data_ptr();
    call.weights = weights.data_ptr();
    // A few rows against weights as they lie (not packed: not a parameter, changed, or seen once) run
    // ember's loop where it applies, else ATen: oneDNN reads plain weights slowly there. 2-core Zen 4 host,
    // [M, 1024] @ [1024, 1024] + bias, relu, min of 7 x 300 calls (this host's timings vary up to 2x):
    //   M = 1 / 2 / 4 / 7, us   oneDNN plain 105 / 110 / 118 / 138, ATen (MKL) 77 / 147 / 305 / 302,
    //                           ember's loop 33 / 38 / 56 / 105, oneDNN packed 33 / 37 / 44 / 72.
    // Packed weights go to oneDNN at any M, as their first sight goes to the loop: no primitive until the
    // second call, when the weights can be packed.
    if (call.M < kFewRows && packing == 0) {
      if (dtype_ != c10::kFloat || !gemv_takes(call)) return false;
      *out = at::empty({call.M, call.N}, src.options());
      call.dst = out->data_ptr();
      call.dst_stride = call.N;
      gemv(config_, call);
      return true;
    }
    if (first) return false;
    if (addend_dies && packing == 0 && call.M * call.N * int64_t{sizeof(float)} >= kInPlaceBytes) {
      at::Tensor sum = addends[0].view({call.M, call.N});  // point 8
      try {
        sum.addmm_(src, weights);
      } catch (const c10::Error& e) {
        rethrow_naming(e, where_);  // (ATen checks the operands before it writes)
      }
      *out = std::move(sum);
      return true;
    }
    const bool timed = forced_ || exhaustive_ || double(call.M) * double(call.N) * double(call.K) >= kTimedMacs;
    const std::optional<Library> library = timed ? library_for(call, packing != 0) : std::nullopt;
    if (library == Library::Aten) return false;
    if (library == Library::Torch && torch_takes(src, weights)) {
      try {
        *out = run_torch(src, weights, bias, addends);
        return true;
      } catch (const std::exception&) {  // (oneDNN's own errors come through as they are, not as c10::Error)
        exception_handled();
        torch_failed_ = true;  // for good: a rejected problem would be rejected again
        return false;          // the ATen path computes the same thing, and raises what it raises
      }
    }
    const at::Tensor dst = at::empty({call.M, call.N}, src.options());
    call.dst = dst.data_ptr();
    call.dst_stride = call.N;
    try {
      run_library(call, packing, dst, addends, out);
    } catch (const std::exception&) {
      return false;  // the ATen path computes the same thing
    }
    if (timed && !library) choose_library(call, packing, src, weights, bias, addends, dst, out);
    return true;
  }

  // oneDNN's call into dst (call.dst), then in *out what its post-ops leave to ATen (library_ops_): dst itself,
  // or a new tensor where an op after a relu is not in place.
  void run_library(const onednn::MatmulCall& call, uint64_t packing, const at::Tensor& dst,
                   const std::vector<at::Tensor>& addends, at::Tensor* out) const {
    dnnl_->run(call, packing);
    *out = library_ops_ < ops_.size() ? apply_epilogue_with_aten(dst, ops_, addends, addend_is_row_, library_ops_) : dst;
  }

  // The library this kernel took for the problem, or none where none was taken yet (point 5).
  std::optional<Library> library_for(const onednn::MatmulCall& c, bool packed) const {
    if (forced_) return forced_;
    std::lock_guard<std::mutex> lock(libraries_mu_);
    for (const Shape& s : libraries_)
      if (s.m == c.M && s.n == c.N && s.k == c.K && s.src_stride[0] == c.src_stride[0] &&
          s.src_stride[1] == c.src_stride[1] && s.weights_stride[0] == c.weights_stride[0] &&
          s.weights_stride[1] == c.weights_stride[1] && s.packed == packed)
        return s.library;
    return std::nullopt;
  }

  // After oneDNN ran the call (its first run for this shape: primitive made, weights packed), the process's
  // choice for the problem, or else a timing of the libraries; kept in this kernel's list. oneDNN's timed runs
  // write the call's result again (dst, then *out).
  void choose_library(const onednn::MatmulCall& c, uint64_t packing, const at::Tensor& src, const at::Tensor& weights,
                      const at::Tensor& bias, const std::vector<at::Tensor>& addends, const at::Tensor& dst,
                      at::Tensor* out) const {
    ProblemKey key{c.M, c.N, c.K, c.src_stride[0], c.src_stride[1], c.weights_stride[0], c.weights_stride[1],
                   packing != 0, text_};
    Library library = Library::OneDnn;
    std::unique_lock<std::mutex> lock(chosen_mutex());
    auto it = chosen().find(key);
    if (it != chosen().end()) {
      library = it->second;
    } else {
      lock.unlock();  // the record is read, or the libraries timed, outside the lock: other kernels go on
      std::string line;
      std::optional<Library> found = stored_library(c, packing, src, weights, &line);
      if (!found) found = time_libraries(c, packing, src, weights, bias, addends, dst, out, &line);
      if (!found) return;  // none is chosen; the next call times again
      lock.lock();
      const auto [kept, fresh] = chosen().try_emplace(key, *found);
      if (fresh) timings().emplace_back(line);
      library = kept->second;
    }
    lock.unlock();
    std::lock_guard<std::mutex> mine(libraries_mu_);
    if (libraries_.size() >= kMaxShapes) libraries_.erase(libraries_.begin());  // a stream of new shapes
    libraries_.push_back({c.M, c.N, c.K, {c.src_stride[0], c.src_stride[1]}, {c.weights_stride[0], c.weights_stride[1]},
                          packing != 0, library});
  }

  // Point 5's timing of the libraries on this call's operands (oneDNN's runs write the call's result again: dst,
  // then *out), its choice kept on disk; in *line what timings() lists. Null where a library failed to run.
  std::optional<Library> time_libraries(const onednn::MatmulCall& c, uint64_t packing, const at::Tensor& src,
                                        const at::Tensor& weights, const at::Tensor& bias,
                                        const std::vector<at::Tensor>& addends, const at::Tensor& dst, at::Tensor* out,
                                        std::string* line) const {
    // The others' first runs untimed (their first results' pages are new; torch's makes its primitive),
    // then each twice in turns, the faster run of each counting: single runs on a busy 2-core host were off
    // by up to 1.6x. Torch's call is a candidate where it takes the operands and runs (it rejects bf16
    // on hosts without bf16 instructions).
    Library library = Library::OneDnn;
    double onednn_us = 1e300, aten_us = 1e300, torch_us = 1e300;
    bool torch = torch_takes(src, weights);
    try {
      run_aten(src, weights, bias, addends);
    } catch (const std::exception&) {
      exception_handled();
      return std::nullopt;  // none is chosen; the next call times again
    }
    try {
      if (torch) run_torch(src, weights, bias, addends);
    } catch (const std::exception&) {
      exception_handled();
      torch = false;
    }
    try {
      for (int round = 0; round < 2; ++round) {
        auto start = std::chrono::steady_clock::now();
        run_library(c, packing, dst, addends, out);
        onednn_us = std::min(onednn_us, elapsed_us(start));
        start = std::chrono::steady_clock::now();
        run_aten(src, weights, bias, addends);
        aten_us = std::min(aten_us, elapsed_us(start));
        if (!torch) continue;
        start = std::chrono::steady_clock::now();
        run_torch(src, weights, bias, addends);
        torch_us = std::min(torch_us, elapsed_us(start));
      }
    } catch (const std::exception&) {
      exception_handled();
      return std::nullopt;
    }
    // Another library only where clearly faster: oneDNN keeps ties (its epilogue reads the result once).
    const double best = std::min(aten_us, torch_us);
    if (best < 0.9 * onednn_us) library = torch_us < aten_us ? Library::Torch : Library::Aten;
    char torch_text[48] = "";
    if (torch) std::snprintf(torch_text, sizeof torch_text, ", torch %.0f us", torch_us);
    char text[256];
    std::snprintf(text, sizeof text, "%lldx%lldx%lld %s%s: onednn %.0f us, aten %.0f us%s -> %s",
                  static_cast<long long>(c.M), static_cast<long long>(c.N), static_cast<long long>(c.K),
                  text_.c_str(), packing ? " (packed)" : "", onednn_us, aten_us, torch_text, library_name(library));
    cpu_tuning_counters().timed.fetch_add(1);
    ChoiceRecord record{record_key(c, packing), static_cast<int64_t>(library), {{"onednn", float(onednn_us / 1000)},
                                                                               {"aten", float(aten_us / 1000)}}};
    if (torch) record.timings.emplace_back("torch", float(torch_us / 1000));
    choice_record_store(record);
    *line = text;
    return library;
  }

  at::Tensor run_aten(const at::Tensor& src, const at::Tensor& weights, const at::Tensor& bias,
                      const std::vector<at::Tensor>& addends) const {
    at::Tensor y = bias.defined() ? at::addmm(bias, src, weights) : at::mm(src, weights);
    return apply_epilogue_with_aten(std::move(y), ops_, addends, addend_is_row_);
  }

  // Whether torch's call (point 6) takes these operands: weights in nn.Linear's layout and a contiguous source
  // (run_onednn checked the rest: a contiguous bias, contiguous addends of the result's size).
  // Point 5's disk record (choice_record.h): the key names the problem as chosen() does, and the host.
  std::string record_key(const onednn::MatmulCall& c, uint64_t packing) const {
    char problem[160];
    std::snprintf(problem, sizeof problem, "matmul %lld %lld %lld src %lld %lld weights %lld %lld%s ",
                  static_cast<long long>(c.M), static_cast<long long>(c.N), static_cast<long long>(c.K),
                  static_cast<long long>(c.src_stride[0]), static_cast<long long>(c.src_stride[1]),
                  static_cast<long long>(c.weights_stride[0]), static_cast<long long>(c.weights_stride[1]),
                  packing ? " packed" : "");
    return choice_record_host() + problem + text_;
  }

  // The library an earlier process chose for this problem, where it can run this call, and in *line what
  // timings() lists for it.
  std::optional<Library> stored_library(const onednn::MatmulCall& c, uint64_t packing, const at::Tensor& src,
                                        const at::Tensor& weights, std::string* line) const {
    if (forced_) return std::nullopt;
    const std::optional<ChoiceRecord> r = choice_record_find(record_key(c, packing));
    if (!r) return std::nullopt;
    const int64_t n = r->choice;
    if (n != int64_t(Library::OneDnn) && n != int64_t(Library::Aten) && !(n == int64_t(Library::Torch) && torch_takes(src, weights))) {
      cpu_tuning_counters().refused.fetch_add(1);
      return std::nullopt;
    }
    const Library library = static_cast<Library>(n);
    *line = std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + " " + text_ +
            (packing ? " (packed)" : "") + ":";
    for (size_t i = 0; i < r->timings.size(); ++i) {
      char time[96];
      std::snprintf(time, sizeof time, "%s %s %.0f us", i ? "," : "", r->timings[i].first.c_str(), r->timings[i].second * 1000.0);
      *line += time;
    }
    *line += std::string(" -> ") + library_name(library) + " (from disk)";
    cpu_tuning_counters().from_disk.fetch_add(1);
    return library;
  }

  bool torch_takes(const at::Tensor& src, const at::Tensor& weights) const {
    const bool linear_layout = weights.stride(0) == 1 && (weights.size(1) == 1 || weights.stride(1) == weights.size(0));
    return torch_ && !torch_failed_ && linear_layout && src.is_contiguous();
  }

  at::Tensor run_torch(const at::Tensor& src, const at::Tensor& weights, const at::Tensor& bias,
                       const std::vector<at::Tensor>& addends) const {
    const TorchLinear& t = *torch_;
    c10::IValue b = bias.defined() ? c10::IValue(bias) : c10::IValue();
    torch::jit::Stack stack;
    if (t.add) {
      stack = {c10::IValue(src), c10::IValue(addends[0].reshape({src.size(0), weights.size(1)})),
               c10::IValue(weights.t()), std::move(b), t.attr};
      t.binary.callBoxed(&stack);
    } else {
      stack = {c10::IValue(src), c10::IValue(weights.t()), std::move(b), t.attr, t.scalars, t.algorithm};
      t.unary.callBoxed(&stack);
    }
    return apply_epilogue_with_aten(std::move(stack[0]).toTensor(), ops_, addends, addend_is_row_, t.fused);
  }

  static constexpr int64_t kFewRows = 8;
  static constexpr int64_t kInPlaceBytes = int64_t{1} << 20;  // point 8
  bool exhaustive_;  // max-autotune: every problem timed (point 5)
  std::unique_ptr<onednn::Matmul> dnnl_;
  onednn::MatmulConfig config_;  // all of the epilogue as post-ops, for gemv() (it keeps NaN through relu)
  size_t library_ops_;           // dnnl_ applies ops_[0, library_ops_) as post-ops, ATen the rest
  c10::ScalarType dtype_;
  bool bias_;
  std::vector<EpilogueOp> ops_;
  std::vector<bool> addend_is_row_;
  std::vector<std::pair<int64_t, bool>> out_shape_;  // (constant, read from a buffer instead)
  bool pack_;
  std::string text_;
  std::string where_;  // "%addmm = aten::addmm", for error messages
  std::optional<Library> forced_;  // forced_library() when the kernel was made
  std::optional<TorchLinear> torch_;
  mutable std::atomic<bool> torch_failed_{false};  // torch's call raised (bf16 on a host without bf16 support)
  bool accumulates_;  // f32, no bias, the epilogue one full-size add: a candidate for point 8

  WeightsPacking packing_;

  // The libraries this kernel took, by shape (point 5): a short list, as a kernel sees few shapes.
  struct Shape {
    int64_t m, n, k, src_stride[2], weights_stride[2];
    bool packed;
    Library library;
  };
  static constexpr size_t kMaxShapes = 16;
  mutable std::mutex libraries_mu_;
  mutable std::vector<Shape> libraries_;
};

}  // namespace

uint64_t weights_generation(const at::Tensor& input, uint32_t version, const at::Tensor& w) {
  struct Known {
    c10::weak_intrusive_ptr<c10::TensorImpl> input;  // expired: the input is gone, and so is its number
    uint32_t version;
    const void* data;
    std::vector<int64_t> sizes, strides;
    uint64_t generation;
  };
  static std::mutex mu;
  static auto* known = new std::vector<Known>();  // never freed: outlives every kernel
  static uint64_t next = 0;
  std::lock_guard<std::mutex> lock(mu);
  // Gone: inputs no longer alive, and this input's earlier versions (a version counter only moves forward; under
  // gradient accumulation every optimizer step brings a new one).
  const c10::TensorImpl* impl = input.unsafeGetTensorImpl();
  known->erase(std::remove_if(known->begin(), known->end(),
                              [&](const Known& k) {
                                return k.input.expired() || (k.input._unsafe_get_target() == impl && k.version != version);
                              }),
               known->end());
  for (const Known& k : *known)
    if (k.input._unsafe_get_target() == impl && k.version == version && k.data == w.data_ptr() &&
        w.sizes().equals(k.sizes) && w.strides().equals(k.strides))
      return k.generation;
  known->push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(input.getIntrusivePtr()), version, w.data_ptr(),
                    w.sizes().vec(), w.strides().vec(), ++next});
  return next;
}

std::shared_ptr<const Kernel> make_matmul_kernel(const EpilogueGroup& m, std::string* why_not, bool exhaustive) {
  if (!m.device.is_cpu()) {
    if (why_not) *why_not = "not a CPU matmul";
    return nullptr;
  }
  if (m.dtype != c10::kFloat && m.dtype != c10::kBFloat16) {
    if (why_not) *why_not = std::string("oneDNN matmul for ") + dtype_name(m.dtype);
    return nullptr;
  }
  onednn::MatmulConfig config;
  config.dtype = onednn_dtype(m.dtype);
  config.bias = m.bias != nullptr;
  config.post_ops = post_ops_of(m, m.ops.size());
  onednn::MatmulConfig library = config;
  library.post_ops = post_ops_of(m, library_exact_ops(m));
  auto dnnl = onednn::Matmul::create(library, why_not);
  if (!dnnl) return nullptr;
  return std::make_shared<MatmulKernel>(m, std::move(dnnl), std::move(config), exhaustive);
}

std::vector<std::string> cpu_matmul_timings() {
  std::lock_guard<std::mutex> lock(chosen_mutex());
  return timings();
}

}  // namespace ember::cpu

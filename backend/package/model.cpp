// ember::load and ember::Model (backend/include/ember/model.h).
//
// load: map the file, read and verify the container (format.cpp), check that the package fits the
// device (kind, GPU architecture of its kernels), wrap the weights (CPU: tensors over the mapping;
// CUDA: one copy to the device), then compile the stored IR with the package's kernel images.
// Every input check of Model::run is decided here and kept as a flat list of rules, so a run only
// compares integers: no strings, no parsing.
#include "ember/model.h"

#include "ember/cudagraph.h"

#include "backend/package/export.h"
#include "backend/package/format.h"
#include "ember/compiler.h"
#include "kernels/cuda/driver.h"

#include <ATen/Context.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <functional>
#include <climits>
#include <cstdlib>

namespace ember {

namespace {

// A sum of products over symbols: 2*s0*s1 - s2 + 3. Sizes in the IR are sympy's canonical text.
struct Polynomial {
  struct Term {
    int64_t coefficient = 1;
    std::vector<int> symbols;
  };
  std::vector<Term> terms;
};

// One check of Model::run on dimension `dim` of input `input`.
struct DimRule {
  enum class Kind : uint8_t { Constant, Bind, Polynomial };
  Kind kind = Kind::Constant;
  uint32_t input = 0, dim = 0;
  int64_t value = 0;  // Constant: the size; Bind: the symbol index
  Polynomial poly;
  std::string text;  // the IR spelling, for messages
};

bool is_identifier(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

// Parses "2*s0+s1*s2-3" with symbols already bound by `index_of`; false for anything else (floor,
// division, ...), which is then left to the runtime to reject.
template <class IndexOf>
bool parse_polynomial(const std::string& text, IndexOf index_of, Polynomial* out) {
  size_t pos = 0;
  while (pos < text.size()) {
    Polynomial::Term term;
    if (text[pos] == '+' || text[pos] == '-') {
      if (text[pos] == '-') term.coefficient = -1;
      ++pos;
    } else if (pos != 0) {
      return false;
    }
    size_t end = text.find_first_of("+-", pos);
    std::string body = text.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? text.size() : end;
    if (body.empty()) return false;
    for (size_t start = 0; start <= body.size();) {
      size_t star = body.find('*', start);
      std::string factor = body.substr(start, star == std::string::npos ? std::string::npos : star - start);
      start = star == std::string::npos ? body.size() + 1 : star + 1;
      if (factor.empty()) return false;
      if (std::isdigit(static_cast<unsigned char>(factor[0]))) {
        char* stop = nullptr;
        long long v = std::strtoll(factor.c_str(), &stop, 10);
        if (*stop != '\0') return false;
        term.coefficient *= v;
      } else {
        int index = index_of(factor);
        if (index < 0) return false;
        term.symbols.push_back(index);
      }
    }
    out->terms.push_back(std::move(term));
  }
  return !out->terms.empty();
}

// A read-only view of a package file, kept alive by every tensor that reads from it.
class Mapping {
 public:
  explicit Mapping(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot open ember package '" + path + "'");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error("ember package '" + path + "' is not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      throw Error("not an ember package: '" + path + "' is empty");
    }
    // Private and writable: a caller who writes into a returned weight gets its own page, never a
    // fault, and never a change to the file.
    data_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (data_ == MAP_FAILED) throw Error("cannot map ember package '" + path + "' into memory");
  }
  ~Mapping() { ::munmap(data_, size_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Moves every `from`-kind device in the graph (value types, device arguments) to `to`: a package
// exported on cuda:0 runs on cuda:1 once its IR says so. CPU values in a CUDA graph stay where they are.
void retarget(Graph& graph, c10::Device from, c10::Device to) {
  auto move_type = [&](Value* v) {
    if (v->type.is_tensor() && v->type.tensor.device == from) v->type.tensor.device = to;
  };
  std::function<void(Arg&)> move_arg = [&](Arg& a) {
    if (a.kind == Arg::Kind::Device && a.device == from) a.device = to;
    for (Arg& item : a.list) move_arg(item);
  };
  for (Value* v : graph.inputs()) move_type(v);
  for (const auto& n : graph.nodes()) {
    for (Value* v : n->outputs) move_type(v);
    for (Arg& a : n->args) move_arg(a);
    for (auto& kv : n->kwargs) move_arg(kv.second);
  }
}

std::string describe_input(const std::vector<TensorSpec>& specs, uint32_t i) {
  return "input " + std::to_string(i) + " (" + specs[i].name + ")";
}

}  // namespace

struct Model::State {
  std::shared_ptr<CompiledGraph> graph;
  c10::Device device{c10::kCPU};
  std::vector<TensorSpec> inputs, outputs;
  std::vector<SymbolRange> symbols;
  std::vector<std::pair<std::string, std::string>> meta;
  std::vector<DimRule> rules;  // Constant and Bind rules first, then Polynomial ones
};

std::string TensorSpec::str() const {
  std::string s = name + ": " + dtype_name(type.dtype) + "[";
  for (size_t d = 0; d < type.sizes.size(); ++d)
    s += (d ? ", " : "") + (type.sizes[d].is_constant() ? std::to_string(type.sizes[d].value) : type.sizes[d].expr);
  return s + "]@" + type.device.str();
}

namespace {

std::shared_ptr<Model::State> load_state(std::shared_ptr<const void> owner, size_t size, c10::Device device,
                                         const LoadOptions& options) {
  const auto* bytes = static_cast<const uint8_t*>(owner.get());
  package::View view = package::read(bytes, size, options.verify_checksum);

  auto state = std::make_shared<Model::State>();
  state->meta = view.meta;
  c10::Device exported(c10::kCPU);
  try {
    exported = c10::Device(view.meta_value("device"));
  } catch (const std::exception&) {
    throw Error("corrupt ember package: bad device '" + view.meta_value("device") + "'");
  }
  if (device.type() != exported.type())
    throw Error("this ember package was exported for " + exported.str() + " and cannot run on " + device.str() +
                " (export it again with device=\"" + c10::DeviceTypeName(device.type(), true) + "\")");
  if (device.is_cuda()) {
    if (!at::hasCUDA()) throw Error("ember::load: " + device.str() + " requested, but this process has no CUDA device");
    if (!device.has_index()) device = c10::Device(c10::kCUDA, 0);
    if (device.index() >= c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount())
      throw Error("ember::load: there is no " + device.str());
    std::string why;
    if (!view.kernels.empty() && !cuda::available(&why)) throw Error("ember::load: " + why);
    std::string arch = view.kernels.empty() ? "" : cuda::arch(device.index());
    for (const cuda::KernelImage& k : view.kernels)
      if (k.arch != arch)
        throw Error("this ember package's CUDA kernels were compiled for " + k.arch + ", but " + device.str() +
                    " is " + arch + " (export the model again on this GPU)");
  } else if (device.has_index() && device.index() != 0) {
    device = c10::Device(device.type());
  }
  state->device = device;

  // The graph, then the control flow subgraphs its IR section carries (package/export.h).
  auto [graph_text, subgraph_texts] = package::split_graphs(std::string(view.ir));
  Graph graph = parse(graph_text);
  std::vector<std::pair<std::string, Graph>> subgraphs;
  for (const auto& [path, text] : subgraph_texts) subgraphs.emplace_back(path, parse(text));
  if (exported != device && exported.is_cuda()) {
    retarget(graph, exported, device);
    for (auto& [path, sub] : subgraphs) retarget(sub, exported, device);
  }

  // Each weight goes where the IR declares it: CPU ones (and CPU scalars in a CUDA graph) are read in
  // place from the mapping, which each of them keeps alive; the others are copied to the device once,
  // and the mapping goes when load() returns unless a CPU weight still reads from it.
  std::unordered_map<std::string, c10::Device> declared;
  auto declare = [&](const Graph& g) {
    for (const auto& n : g.nodes())
      if (n->op == "prim::constant" && n->args.size() == 1 && n->args[0].kind == Arg::Kind::String &&
          n->outputs.size() == 1 && n->outputs[0]->type.is_tensor())
        declared.emplace(n->args[0].s, n->outputs[0]->type.tensor.device);
  };
  declare(graph);
  for (const auto& [path, sub] : subgraphs) declare(sub);
  std::unordered_map<std::string, at::Tensor> constants;
  for (const package::ConstantEntry& e : view.constants) {
    void* ptr = const_cast<uint8_t*>(view.data + e.offset);
    at::Tensor t = at::from_blob(ptr, e.sizes, e.strides, [keep = owner](void*) {},
                                 at::TensorOptions().dtype(e.dtype).device(c10::kCPU));
    auto where = declared.find(e.name);
    if (where != declared.end() && !where->second.is_cpu()) {
      if (where->second != device)
        throw Error("corrupt ember package: constant " + e.name + " is declared on " + where->second.str());
      t = at::empty_strided(e.sizes, e.strides, at::TensorOptions().dtype(e.dtype).device(device)).copy_(t);
    }
    constants.emplace(e.name, std::move(t));
  }
  // Input specs and the checks of Model::run, from the graph's declared input types.
  std::vector<std::string> symbol_names;
  auto symbol_index = [&](const std::string& name, bool add) {
    for (size_t i = 0; i < symbol_names.size(); ++i)
      if (symbol_names[i] == name) return static_cast<int>(i);
    if (!add) return -1;
    symbol_names.push_back(name);
    return static_cast<int>(symbol_names.size() - 1);
  };
  std::vector<DimRule> polynomials;
  for (const Value* v : graph.inputs()) {
    if (!v->type.is_tensor())
      throw Error("ember::load: graph input %" + v->name + " is not a tensor; ember::Model takes tensors only");
    uint32_t i = static_cast<uint32_t>(state->inputs.size());
    state->inputs.push_back(TensorSpec{v->name, v->type.tensor});
    const std::vector<Dim>& sizes = v->type.tensor.sizes;
    for (uint32_t d = 0; d < sizes.size(); ++d) {
      DimRule rule;
      rule.input = i;
      rule.dim = d;
      rule.text = sizes[d].is_constant() ? std::to_string(sizes[d].value) : sizes[d].expr;
      if (sizes[d].is_constant()) {
        rule.value = sizes[d].value;
        state->rules.push_back(std::move(rule));
      } else if (is_identifier(sizes[d].expr)) {
        rule.kind = DimRule::Kind::Bind;
        rule.value = symbol_index(sizes[d].expr, true);
        state->rules.push_back(std::move(rule));
      } else {
        rule.kind = DimRule::Kind::Polynomial;
        polynomials.push_back(std::move(rule));
      }
    }
  }
  for (DimRule& rule : polynomials)
    if (parse_polynomial(rule.text, [&](const std::string& s) { return symbol_index(s, false); }, &rule.poly))
      state->rules.push_back(std::move(rule));
  state->symbols.resize(symbol_names.size());
  for (size_t i = 0; i < symbol_names.size(); ++i) state->symbols[i].name = symbol_names[i];
  for (const auto& [key, value] : view.meta) {  // "symbol s0 <min> <max> <example>"
    if (key != "symbol") continue;
    char name[128] = {};
    long long lo = 0, hi = -1, example = 1;
    if (std::sscanf(value.c_str(), "%127s %lld %lld %lld", name, &lo, &hi, &example) != 4)
      throw Error("corrupt ember package: bad symbol line '" + value + "'");
    int index = symbol_index(name, false);
    if (index >= 0) state->symbols[index] = SymbolRange{name, lo, hi, example};
  }
  for (const auto& out : graph.outputs()) {
    TensorSpec spec;
    spec.name = out.is_value() ? out.value->name : "output " + std::to_string(state->outputs.size());
    if (out.is_value() && out.value->type.is_tensor()) spec.type = out.value->type.tensor;
    state->outputs.push_back(std::move(spec));
  }

  CompileOptions compile_options;
  compile_options.graph_name = "package";
  compile_options.kernel_images = std::make_shared<cuda::ImageStore>();
  for (cuda::KernelImage& k : view.kernels) compile_options.kernel_images->add(std::move(k));
  try {
    compile_options.subgraphs = package::compile_subgraphs(std::move(subgraphs), constants, compile_options);
    state->graph = compile(std::move(graph), constants, compile_options);
  } catch (const Error& e) {
    throw Error(std::string("ember::load: the package's graph does not compile here: ") + e.what());
  } catch (const std::exception& e) {
    throw Error(std::string("ember::load: the package's graph does not compile here: ") + e.what());
  }
  if (options.reduce_overhead) {
    if (!device.is_cuda()) throw Error("ember::load: reduce_overhead (CUDA graphs) needs a CUDA device, not " + device.str());
    if (!cuda_graphs_supported())
      throw Error("ember::load: reduce_overhead: this libember was built against a torch without CUDA");
    // Weights are graph constants here, fixed for the model's life; every input is copied into the
    // graphs' static buffers. A graph with nothing to capture simply runs as before.
    enable_cuda_graphs(*state->graph, {}, CudaGraphOptions{});
  }
  return state;
}

// Whatever goes wrong below load() (ATen, the CUDA runtime, memory) reaches the caller as ember::Error.
template <class F>
auto as_ember_error(F f) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("ember::load failed: ") + e.what());
  }
}

}  // namespace

Model load_from_memory(std::shared_ptr<const void> owner, size_t size, c10::Device device, const LoadOptions& options) {
  return Model(as_ember_error([&] { return load_state(std::move(owner), size, device, options); }));
}

Model load(const std::string& path, c10::Device device, const LoadOptions& options) {
  return Model(as_ember_error([&] {
    auto mapping = std::make_shared<Mapping>(path);
    std::shared_ptr<const void> owner(mapping, mapping->data());  // aliasing: points at the bytes, owns the mapping
    return load_state(std::move(owner), mapping->size(), device, options);
  }));
}

std::vector<at::Tensor> Model::run(const std::vector<at::Tensor>& inputs) const {
  const State& s = *state_;
  if (inputs.size() != s.inputs.size())
    throw Error("the model takes " + std::to_string(s.inputs.size()) + " inputs, got " + std::to_string(inputs.size()));
  for (uint32_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    const TensorType& want = s.inputs[i].type;
    if (!x.defined()) throw Error(describe_input(s.inputs, i) + " is an undefined tensor");
    if (x.scalar_type() != want.dtype)
      throw Error(describe_input(s.inputs, i) + " must be " + c10::toString(want.dtype) + ", got " +
                  c10::toString(x.scalar_type()));
    if (x.device() != s.device)
      throw Error(describe_input(s.inputs, i) + " must be on " + s.device.str() + ", got " + x.device().str());
    if (static_cast<size_t>(x.dim()) != want.sizes.size())
      throw Error(describe_input(s.inputs, i) + " must have " + std::to_string(want.sizes.size()) +
                  " dimensions (" + s.inputs[i].str() + "), got " + std::to_string(x.dim()));
  }
  constexpr int64_t kUnbound = INT64_MIN;
  std::vector<int64_t> values(s.symbols.size(), kUnbound);
  std::vector<uint32_t> bound_at(s.symbols.size(), 0);
  for (const DimRule& r : s.rules) {
    int64_t size = inputs[r.input].size(r.dim);
    auto where = [&] { return describe_input(s.inputs, r.input) + " dimension " + std::to_string(r.dim); };
    if (r.kind == DimRule::Kind::Constant) {
      if (size != r.value) throw Error(where() + " must be " + std::to_string(r.value) + ", got " + std::to_string(size));
    } else if (r.kind == DimRule::Kind::Bind) {
      int64_t& v = values[r.value];
      const SymbolRange& range = s.symbols[r.value];
      if (v == kUnbound) {
        if (size < range.min || (range.max >= 0 && size > range.max))
          throw Error(where() + " is " + std::to_string(size) + ", outside the range [" + std::to_string(range.min) +
                      ", " + (range.max >= 0 ? std::to_string(range.max) : "inf") + "] the model was exported for (" +
                      range.name + ")");
        v = size;
        bound_at[r.value] = r.input;
      } else if (v != size) {
        throw Error(where() + " is " + std::to_string(size) + ", but " + range.name + " is " + std::to_string(v) +
                    " in " + describe_input(s.inputs, bound_at[r.value]));
      }
    } else {
      int64_t expected = 0;
      for (const Polynomial::Term& t : r.poly.terms) {
        int64_t product = t.coefficient;
        for (int sym : t.symbols) product *= values[sym];
        expected += product;
      }
      if (size != expected)
        throw Error(where() + " must be " + r.text + " = " + std::to_string(expected) + ", got " + std::to_string(size));
    }
  }

  std::vector<c10::IValue> args;
  args.reserve(inputs.size());
  for (const at::Tensor& x : inputs) args.emplace_back(x.is_contiguous() ? x : x.contiguous());
  std::vector<c10::IValue> results;
  try {
    results = s.graph->run(std::move(args));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("running the ember model failed: ") + e.what());
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(results.size());
  for (c10::IValue& v : results) {
    if (v.isTensor()) outputs.push_back(std::move(v).toTensor());
    else if (v.isInt() || v.isDouble() || v.isBool()) outputs.push_back(at::scalar_tensor(v.toScalar()));
    else outputs.emplace_back();  // None
  }
  return outputs;
}

const std::vector<TensorSpec>& Model::inputs() const { return state_->inputs; }
const std::vector<TensorSpec>& Model::outputs() const { return state_->outputs; }
const std::vector<SymbolRange>& Model::symbols() const { return state_->symbols; }
c10::Device Model::device() const { return state_->device; }
const std::vector<std::pair<std::string, std::string>>& Model::metadata() const { return state_->meta; }
std::string Model::describe() const { return state_->graph->describe(); }

}  // namespace ember

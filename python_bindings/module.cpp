// ember._C (built as ember._native, see python_bindings/ember/_C.py): the boundary between Python and
// the C++ compiler and runtime.
//
// The object handed to AOTAutograd is a CompiledGraph itself: its __call__ is this file's `call`, a C++
// function that unpacks the boxed argument list (tensors by pointer, no copies), clears the list so
// inputs can be freed early, runs the plan with the GIL released and wraps the results.
//
// DirectCall is the same call for Dynamo itself: when AOTAutograd's runtime wrapper would do nothing
// for an inference graph (no input mutations, no aliased outputs, no subclasses; backend.py checks),
// Dynamo calls it with the graph's inputs as positional arguments through CPython's vectorcall, so a
// call goes from Dynamo's guards to the plan without a Python frame in between. A training graph's
// DirectCall runs the forward plan with grad mode off and hands its results to attach_backward
// (training_graph.h), which stands in for AOTAutograd's autograd.Function.
#include "backend/package/export.h"
#include "backend/runtime/size_buckets.h"
#include "ember/compiler.h"
#include "ember/config.h"
#include "ember/cudagraph.h"
#include "ember/error.h"
#include "ember/model.h"
#include "ember/op_table.h"
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cuda/cuda_kernel.h"
#include "kernels/cuda/driver.h"
#include "kernels/cuda/gemm_record.h"
#include "kernels/cpu/choice_record.h"
#include "kernels/cuda/launch_record.h"
#include "python_bindings/training_graph.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <map>
#include <optional>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace ember {
namespace {

// A Python object as an IValue, for graph inputs of kind Object (a DeviceMesh, ember/ir.h): the plan only
// moves it from an input to outputs, so it needs nothing but a reference, let go with the GIL (a plan frees its
// buffers without it). (torch's ConcretePyObjectHolder would do, but its methods call functions torch_python
// does not export.)
struct CarriedObject final : c10::ivalue::PyObjectHolder {
  explicit CarriedObject(PyObject* obj) : obj(obj) { Py_INCREF(obj); }
  ~CarriedObject() override {
    py::gil_scoped_acquire gil;
    Py_DECREF(obj);
  }
  PyObject* getPyObject() override { return obj; }
  c10::InferredType tryToInferType() override { return c10::InferredType("an object ember carries"); }
  c10::IValue toIValue(const c10::TypePtr& type, std::optional<int32_t>) override {
    throw Error("an object ember carries has no value of type " + type->str());
  }
  std::string toStr() override { return "object"; }
  std::vector<at::Tensor> extractTensors() override { return {}; }
  PyObject* obj;
};

// A tensor subclass (a DTensor) reaches a graph only unwrapped, through AOTAutograd's wrapper (backend.py): as
// it is, the plan would read the wrapper as a plain tensor's memory.
const at::Tensor& plain_tensor(PyObject* obj, size_t index) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.key_set().has(c10::DispatchKey::Python))
    throw Error("input " + std::to_string(index) + " is a tensor subclass (" + Py_TYPE(obj)->tp_name +
                "); the compiled graph takes plain tensors");
  return t;
}

// Argument `index` of a call, which is graph input `input`; an input of kind Object takes any object.
c10::IValue to_ivalue(PyObject* obj, size_t index, const CompiledGraph& graph, size_t input) {
  if (THPVariable_Check(obj)) return c10::IValue(plain_tensor(obj, index));
  if (obj == Py_None) return c10::IValue();
  if (PyBool_Check(obj)) return c10::IValue(obj == Py_True);
  if (PyLong_Check(obj)) return c10::IValue(static_cast<int64_t>(PyLong_AsLongLong(obj)));
  if (PyFloat_Check(obj)) return c10::IValue(PyFloat_AS_DOUBLE(obj));
  const auto& inputs = graph.graph().inputs();
  if (input < inputs.size() && inputs[input]->type.kind == Type::Kind::Object)
    return c10::IValue(c10::intrusive_ptr<c10::ivalue::PyObjectHolder>(c10::make_intrusive<CarriedObject>(obj)));
  throw Error("input " + std::to_string(index) + " has unsupported type " + Py_TYPE(obj)->tp_name);
}

PyObject* to_python(c10::IValue&& v) {
  if (v.isTensor()) return THPVariable_Wrap(std::move(v).toTensor());
  if (v.isNone()) Py_RETURN_NONE;
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isPyObject()) {  // an object input the graph returns
    PyObject* obj = v.toPyObject();
    Py_INCREF(obj);
    return obj;
  }
  throw Error(std::string("graph output of unsupported kind ") + v.tagKind());
}

py::list call(CompiledGraph& graph, py::handle args) {
  std::vector<c10::IValue> inputs;
  PyObject* seq = args.ptr();
  if (PyList_Check(seq)) {
    Py_ssize_t n = PyList_GET_SIZE(seq);
    inputs.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) inputs.push_back(to_ivalue(PyList_GET_ITEM(seq, i), i, graph, i));
    PyList_SetSlice(seq, 0, n, nullptr);  // boxed convention: the callee owns the inputs now
  } else if (PyTuple_Check(seq)) {
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    inputs.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) inputs.push_back(to_ivalue(PyTuple_GET_ITEM(seq, i), i, graph, i));
  } else {
    throw Error("compiled graph takes a list of inputs");
  }
  std::vector<c10::IValue> outputs;
  {
    // Warnings raised while running (the CUDA graph runner's, ATen's) reach Python's warnings module,
    // where filters apply, instead of stderr.
    torch::PyWarningHandler warnings;
    try {
      py::gil_scoped_release no_gil;
      outputs = graph.run(std::move(inputs));
    } catch (...) {
      warnings.set_in_exception();
      throw;
    }
  }
  py::list result(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) PyList_SET_ITEM(result.ptr(), i, to_python(std::move(outputs[i])));
  return result;
}

// ---- DirectCall: a plain CPython type with vectorcall (pybind11's argument parsing costs more than
// the rest of a replayed CUDA graph call).
struct DirectCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  std::shared_ptr<CompiledGraph> graph;
  std::vector<c10::IValue> prefix;  // parameters and buffers AOTAutograd would put before the inputs
  // keep[i]: input i comes back call after call (a parameter or buffer).
  std::vector<bool> keep;
  // The argument vector a call hands the plan, kept between calls: a kept input found here again (the
  // same tensor) is neither referenced nor released, so a replayed call touches no reference count of
  // a parameter and allocates nothing; the other inputs are released once the call returns. Kept
  // tensors stay referenced while this callable lives (Dynamo's cache entry for the frame), as the module
  // holds them anyway and the plan's parameter cache already holds those its cached steps read
  // (CompiledGraph::cache_parameter_steps). Taking a first C++ reference to a tensor Python holds also
  // costs a GIL-guarded incref of its PyObject, and dropping it a decref: for a kept input that happens
  // once, not per call. `busy` while a call runs (with the GIL released): a second thread's call, or one
  // from inside the plan, builds a vector of its own.
  std::vector<c10::IValue> args;
  std::vector<uint32_t> released;  // the positions in `args` emptied after a call (those not kept)
  bool busy = false;
  // Dynamo's guards have checked every tensor input's sizes, strides, dtype and device before a call: the
  // graph has no symbolic shapes (see PlanRunner::replay_borrowed).
  bool guarded = false;
  // Set for a training graph: `graph` is its forward, and the call wires the results into autograd.
  std::shared_ptr<const TrainingGraph> training;
  // Inputs the graph writes in place: their version counters are bumped per call, as AOTAutograd's
  // wrapper does (a fused kernel writing into an input does not), so autograd sees the change.
  std::vector<uint32_t> bump;
};

py::handle ember_error_type;

// Fills `out` (positions prefix.size() onward) from Python's arguments; kept inputs already there stay.
void read_arguments(const DirectCall& self, PyObject* const* args, Py_ssize_t n, std::vector<c10::IValue>& out) {
  const size_t base = self.prefix.size();
  for (Py_ssize_t i = 0; i < n; ++i) {
    const size_t at = static_cast<size_t>(i);
    c10::IValue& slot = out[base + at];
    if (at < self.keep.size() && self.keep[at] && THPVariable_Check(args[i])) {
      const at::Tensor& t = THPVariable_Unpack(args[i]);
      if (!slot.isTensor() || slot.toTensor().unsafeGetTensorImpl() != t.unsafeGetTensorImpl())
        slot = plain_tensor(args[i], at);
    } else {
      slot = to_ivalue(args[i], i, *self.graph, base + at);
    }
  }
}

PyObject* direct_call(PyObject* self_obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<DirectCall*>(self_obj);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  HANDLE_TH_ERRORS
  try {
    if (kwnames && PyTuple_GET_SIZE(kwnames) > 0) throw Error("compiled graph takes positional inputs only");
    const size_t total = self->prefix.size() + static_cast<size_t>(n);
    std::vector<c10::IValue> own;  // a call made while another runs
    const bool shared = !self->busy;
    std::vector<c10::IValue>& inputs = shared ? self->args : own;
    if (inputs.size() != total) {
      inputs.assign(self->prefix.begin(), self->prefix.end());
      inputs.resize(total);
      if (shared) {
        self->released.clear();
        for (size_t i = 0; i < static_cast<size_t>(n); ++i)
          if (i >= self->keep.size() || !self->keep[i]) self->released.push_back(static_cast<uint32_t>(self->prefix.size() + i));
      }
    }
    // Whatever happens, the inputs that are not kept go when the call ends (with the GIL held: a tensor
    // whose last C++ reference goes decrefs its PyObject).
    struct Release {
      DirectCall& self;
      std::vector<c10::IValue>& inputs;
      bool shared;
      ~Release() {
        if (!shared) return;
        for (uint32_t i : self.released) inputs[i] = c10::IValue();
        self.busy = false;
      }
    } release{*self, inputs, shared};
    if (shared) self->busy = true;
    read_arguments(*self, args, n, inputs);
    for (uint32_t i : self->bump) {
      if (self->prefix.size() + i >= inputs.size()) continue;  // too few arguments: the plan says so
      const c10::IValue& v = inputs[self->prefix.size() + i];
      if (v.isTensor() && !v.toTensor().is_inference()) v.toTensor().unsafeGetTensorImpl()->bump_version();
    }
    std::vector<c10::IValue> outputs;
    {
      // The plan runs on a copy (a CUDA graph replay on `inputs` themselves), and `inputs` is released
      // after the GIL is back (see `args` above; releasing an input's last C++ reference in there
      // would take the GIL again: 20 x Linear's 41 inputs took 9.8 us per call on a 2-core CPU host
      // through a one-op plan, 1 input 2.5 us).
      pybind11::gil_scoped_release no_gil;
      std::optional<c10::AutoGradMode> no_grad;
      if (self->training) no_grad.emplace(false);  // as in an autograd.Function's forward
      outputs = self->graph->run_borrowed(inputs, self->guarded);
    }
    if (self->training) outputs = attach_backward(self->training, inputs, std::move(outputs));
    py::list result(outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i) PyList_SET_ITEM(result.ptr(), i, to_python(std::move(outputs[i])));
    return result.release().ptr();
  } catch (const Error& e) {
    // Thrown on rather than returned: the warnings the call raised (HANDLE_TH_ERRORS buffers them) are
    // then flushed around the pending error. Returning nullptr here would flush them into Python with the
    // error already set, which Python reports as a SystemError that hides this one.
    PyErr_SetString(ember_error_type.ptr(), e.what());
    throw python_error();
  }
  END_HANDLE_TH_ERRORS
}

void direct_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<DirectCall*>(self_obj);
  self->graph.~shared_ptr<CompiledGraph>();
  self->prefix.~vector<c10::IValue>();
  self->keep.~vector<bool>();
  self->args.~vector<c10::IValue>();
  self->released.~vector<uint32_t>();
  self->training.~shared_ptr<const TrainingGraph>();
  self->bump.~vector<uint32_t>();
  Py_TYPE(self_obj)->tp_free(self_obj);
}

PyTypeObject direct_call_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "ember._C.DirectCall";
  t.tp_basicsize = sizeof(DirectCall);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = offsetof(DirectCall, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_dealloc = direct_dealloc;
  t.tp_doc = "A compiled graph called with positional inputs (Dynamo's convention), straight into C++.";
  return t;
}();

py::object make_direct_call(std::shared_ptr<CompiledGraph> graph, const std::vector<at::Tensor>& prefix,
                            std::vector<bool> keep, bool guarded, std::vector<uint32_t> bump,
                            std::shared_ptr<TrainingGraph> training) {
  auto* self = PyObject_New(DirectCall, &direct_call_type);
  if (!self) throw py::error_already_set();
  self->vectorcall = direct_call;
  new (&self->graph) std::shared_ptr<CompiledGraph>(std::move(graph));
  new (&self->prefix) std::vector<c10::IValue>(prefix.begin(), prefix.end());
  new (&self->keep) std::vector<bool>(std::move(keep));
  new (&self->args) std::vector<c10::IValue>();
  new (&self->released) std::vector<uint32_t>();
  self->busy = false;
  self->guarded = guarded;
  new (&self->training) std::shared_ptr<const TrainingGraph>(std::move(training));
  new (&self->bump) std::vector<uint32_t>(std::move(bump));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(self));
}

std::shared_ptr<CompiledGraph> compile_text(const std::string& ir, const std::unordered_map<std::string, at::Tensor>& constants,
                                            std::vector<std::string> disabled_passes, std::string debug_dir,
                                            std::string graph_name, std::vector<bool> cached_inputs,
                                            const std::unordered_map<std::string, std::shared_ptr<CompiledGraph>>& subgraphs,
                                            bool autotune, double autotune_budget_s, std::vector<bool> unversioned_inputs) {
  CompileOptions options;
  options.autotune = autotune;
  options.autotune_budget_s = autotune_budget_s;
  options.unversioned_inputs = std::move(unversioned_inputs);
  for (const auto& [name, g] : subgraphs) options.subgraphs.emplace(name, g);
  options.cached_inputs = std::move(cached_inputs);
  options.disabled_passes = std::move(disabled_passes);
  options.debug_dir = std::move(debug_dir);
  options.graph_name = std::move(graph_name);
  return compile(parse(ir), constants, options);
}

}  // namespace
}  // namespace ember

PYBIND11_MODULE(_native, m) {
  using namespace ember;
  m.doc() = "ember's C++ compiler and runtime";

  // ember::Error becomes the Python package's EmberError (defined in Python so that importing ember
  // never needs this module).
  py::object ember_error = py::module_::import("ember.errors").attr("EmberError");
  ember_error_type = ember_error.release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(ember_error_type.ptr(), e.what());
    }
  });
  // A failed ATen call that ember handles itself may have come through Python: its error goes into the exception
  // (python_error::persist), which then drops it, rather than staying set (ember/error.h).
  set_exception_handled([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (python_error& e) {
      e.persist();
    } catch (...) {
    }
  });
  if (PyType_Ready(&direct_call_type) < 0) throw py::error_already_set();
  Py_INCREF(&direct_call_type);
  m.add_object("DirectCall", reinterpret_cast<PyObject*>(&direct_call_type));

  py::class_<CompiledGraph, std::shared_ptr<CompiledGraph>>(m, "CompiledGraph", py::dynamic_attr())
      .def("__call__", &call, py::arg("args"))
      .def("describe", &CompiledGraph::describe)
      .def("ir", [](const CompiledGraph& g) { return print(g.graph()); })
      .def_property_readonly("num_inputs", &CompiledGraph::num_inputs)
      .def_property_readonly("num_steps", [](const CompiledGraph& g) { return g.plan().steps.size(); })
      .def_readonly("timings", &CompiledGraph::timings)
      .def("enable_cuda_graphs",
           [](CompiledGraph& g, std::vector<bool> pinned, int warmup, int max_graphs) {
             CudaGraphOptions options;
             options.warmup = warmup;
             options.max_graphs = max_graphs;
             return enable_cuda_graphs(g, std::move(pinned), options);
           },
           py::arg("pinned"), py::arg("warmup"), py::arg("max_graphs"),
           "Captures the plan's capturable parts into CUDA graphs after warm-up; returns '' or why not.")
      .def("cache_parameter_steps", &CompiledGraph::cache_parameter_steps, py::arg("pinned"), py::arg("sizes") = false,
           "Runs the steps over parameters alone once, and again only when a parameter changes; returns their count. "
           "sizes: over the int inputs too, kept per value (not for graphs replayed as CUDA graphs).")
      .def("set_size_buckets",
           [](CompiledGraph& g, std::vector<int64_t> sizes,
              const std::vector<std::tuple<std::string, uint32_t, int32_t>>& symbols,
              const std::vector<std::tuple<uint32_t, int32_t, uint32_t>>& inputs,
              const std::vector<std::tuple<uint32_t, int32_t, uint32_t>>& outputs) {
             std::vector<SizeBuckets::Symbol> syms;
             for (const auto& [name, input, dim] : symbols) syms.push_back({name, input, dim});
             auto uses = [](const std::vector<std::tuple<uint32_t, int32_t, uint32_t>>& all) {
               std::vector<SizeBuckets::Use> out;
               for (const auto& [index, dim, symbol] : all) out.push_back({index, dim, symbol});
               return out;
             };
             g.set_size_buckets(std::make_shared<SizeBuckets>(std::move(sizes), std::move(syms), uses(inputs),
                                                              uses(outputs), g.num_inputs(), g.plan().outputs.size()));
           },
           py::arg("sizes"), py::arg("symbols"), py::arg("inputs"), py::arg("outputs"),
           "Pads symbolic sizes up to buckets around every call (backend/runtime/size_buckets.h): `sizes` ascending "
           "(empty: powers of two); symbols (name, input, dim) where a call's size is read (dim -1: an int input); "
           "inputs and outputs (index, dim, symbol) carrying one (dim -1: an int that is the size).")
      .def("size_buckets",
           [](const CompiledGraph& g) {
             return g.size_buckets() ? g.size_buckets()->describe() : std::vector<std::string>{};
           },
           "One line per padded symbol: what it pads and slices, and the calls run at each size; empty: no padding.")
      .def("size_bucket_calls",
           [](const CompiledGraph& g) {
             return g.size_buckets() ? g.size_buckets()->calls()
                                     : std::vector<std::vector<std::pair<int64_t, uint64_t>>>{};
           },
           "Per padded symbol, (size run at, calls) for each size that ran; -1: above the largest bucket, unpadded.")
      .def_property_readonly("cuda_graphs", [](const CompiledGraph& g) { return g.runner() != nullptr; })
      .def("cuda_graph_report", [](const CompiledGraph& g) { return g.runner() ? g.runner()->describe() : std::string(); })
      .def("tuning", [](const CompiledGraph& g) {
        // What the steps' fast paths and kernels timed to choose (FastPath::tuning, Kernel::tuning), one line per
        // problem, in step order, and the convolutions that cuDNN's benchmark search chooses for
        // (Step::benchmark_cudnn).
        std::vector<std::string> out;
        size_t convolutions = 0;
        for (const auto* steps : {&g.plan().cached_steps, &g.plan().steps})
          for (const Step& s : *steps) {
            if (s.fast)
              for (std::string& line : s.fast->tuning()) out.push_back(std::move(line));
            if (s.kernel)
              for (std::string& line : s.kernel->tuning()) out.push_back(std::move(line));
            convolutions += s.benchmark_cudnn ? 1 : 0;
          }
        if (convolutions)
          out.push_back(std::to_string(convolutions) + " convolution(s): cuDNN's benchmark search picks each shape's "
                        "algorithm at its first call (max-autotune)");
        return out;
      })
      .def("steps", [](const CompiledGraph& g) {
        // (kind, what) per step, ("kernel", description) / ("aten" or "prim", op name), an ember op run by its
        // fast path (ember::linear_chain) as a kernel, control flow over subgraphs as ("control", description):
        // the cached steps over parameters first (runtime.h), then the plan's.
        std::vector<std::pair<std::string, std::string>> out;
        std::vector<const Step*> all;
        for (const Step& s : g.plan().cached_steps) all.push_back(&s);
        for (const Step& s : g.plan().steps) all.push_back(&s);
        for (const Step* step : all) {
          const Step& s = *step;
          if (s.kernel && s.node && is_control_flow(s.node->op))
            out.emplace_back("control", s.kernel->describe());
          else if (s.kernel) out.emplace_back("kernel", s.kernel->describe());
          else if (s.fast && s.node->op.rfind("ember::", 0) == 0) out.emplace_back("kernel", s.fast->describe());
          else out.emplace_back(s.op ? "aten" : "prim", s.node->op);
        }
        return out;
      });

  m.def("compile", &compile_text, py::arg("ir"), py::arg("constants"), py::arg("disabled_passes"),
        py::arg("debug_dir"), py::arg("graph_name"), py::arg("cached_inputs") = std::vector<bool>{},
        py::arg("subgraphs") = std::unordered_map<std::string, std::shared_ptr<CompiledGraph>>{},
        py::arg("autotune") = false, py::arg("autotune_budget_s") = 30.0,
        py::arg("unversioned_inputs") = std::vector<bool>{});
  m.def("direct_call", &make_direct_call, py::arg("graph"), py::arg("prefix"), py::arg("keep") = std::vector<bool>{},
        py::arg("guarded") = false, py::arg("bump") = std::vector<uint32_t>{}, py::arg("training") = nullptr,
        "The graph as a callable taking its inputs positionally, after `prefix`; `keep[i]`: input i comes back "
        "call after call (a parameter), so its reference is held; `guarded`: the caller's guards fix every tensor "
        "input's sizes, strides, dtype and device; `bump`: inputs the graph writes in place; `training`: the graph is "
        "that TrainingGraph's forward. See DirectCall.");
  py::class_<TrainingGraph, std::shared_ptr<TrainingGraph>>(m, "TrainingGraph");
  m.def("training_graph",
        [](std::shared_ptr<CompiledGraph> forward, std::shared_ptr<CompiledGraph> backward,
           std::vector<bool> output_requires_grad, size_t saved_checked, size_t saved_unchecked,
           const std::vector<std::tuple<int, std::vector<int64_t>, std::vector<int64_t>>>& tangents,
           std::vector<bool> no_edge, int deterministic) {
          auto g = std::make_shared<TrainingGraph>();
          g->forward = std::move(forward);
          g->backward = std::move(backward);
          g->output_requires_grad = std::move(output_requires_grad);
          g->saved_checked = saved_checked;
          g->saved_unchecked = saved_unchecked;
          for (const auto& [format, sizes, strides] : tangents) g->tangents.push_back({format, sizes, strides});
          g->no_edge = std::move(no_edge);
          g->deterministic = deterministic;
          // EmberBackward::apply reads one tangent per output that requires grad: a spec short of one would
          // read past the list (a damaged cache entry reached this; cache.py checks entries too).
          const auto needed = static_cast<size_t>(
              std::count(g->output_requires_grad.begin(), g->output_requires_grad.end(), true));
          if (g->tangents.size() != needed)
            throw Error("training graph: " + std::to_string(g->tangents.size()) + " tangent layouts for " +
                        std::to_string(needed) + " outputs that require grad");
          if (deterministic < -1 || deterministic > 1) throw Error("training graph: deterministic must be -1, 0 or 1");
          return g;
        },
        py::arg("forward"), py::arg("backward"), py::arg("output_requires_grad"), py::arg("saved_checked"),
        py::arg("saved_unchecked"), py::arg("tangents"), py::arg("no_edge"), py::arg("deterministic"),
        "A training graph's forward and backward for DirectCall's `training` (python_bindings/training_graph.h); "
        "tangents: (memory format or -1, sizes, strides) per differentiable output.");
  m.def("set_config", &config_set, py::arg("name"), py::arg("value"),
        "Sets the C++ value of the setting named by its environment variable (\"EMBER_GEMM_ROUTE\"; None: unset). "
        "ember.config calls it whenever a setting changes; set settings there instead.");
  m.def("get_config", &config_value, py::arg("name"), "The value C++ reads for a setting (backend/config.cpp).");
  m.def("cpu_matmul_timings", &cpu::cpu_matmul_timings,
        "One line per problem the CPU matmul kernels timed, in order (kernels/cpu/cpu_kernel.h).");
  m.def("gemm_tuning_stats", [] {
    const cuda::GemmTuningCounters& c = cuda::gemm_tuning_counters();
    return std::map<std::string, uint64_t>{{"timed", c.timed.load()},         {"autotuned", c.autotuned.load()},
                                           {"from_disk", c.from_disk.load()}, {"refused", c.refused.load()},
                                           {"over_budget", c.over_budget.load()}};
  }, "What the CUDA GEMMs' tuning did in this process (kernels/cuda/gemm_record.h): problems timed, autotuned, "
     "read from disk, records refused, problems past the autotuning budget.");
  m.def("launch_tuning_stats", [] {
    const cuda::LaunchTuningCounters& c = cuda::launch_tuning_counters();
    return std::map<std::string, uint64_t>{{"timed", c.timed.load()}, {"from_disk", c.from_disk.load()},
                                           {"refused", c.refused.load()}, {"over_budget", c.over_budget.load()}};
  }, "What max-autotune's launch tuning of fused CUDA kernels did in this process (kernels/cuda/launch_record.h): "
     "call shapes timed, choices read from disk, records refused, shapes past the autotuning budget.");
  m.def("cpu_tuning_stats", [] {
    const cpu::CpuTuningCounters& c = cpu::cpu_tuning_counters();
    return std::map<std::string, uint64_t>{{"timed", c.timed.load()}, {"from_disk", c.from_disk.load()},
                                           {"refused", c.refused.load()}};
  }, "What the CPU timings did in this process (kernels/cpu/choice_record.h: matmul libraries, and fused kernels' "
     "threads under max-autotune): problems timed, choices read from disk, records refused.");
  m.def("cuda_graphs_supported", &cuda_graphs_supported);
  m.def("warm_up_cuda_compiler", &cuda::warm_up_async,
        "Starts loading NVRTC and its first compile on a thread of its own (see kernels/cuda/driver.h).");
  m.def("wait_for_kernel_compiles", &cuda::wait_for_background_compiles, py::call_guard<py::gil_scoped_release>(),
        "Waits for the CUDA kernels compiling in the background (see kernels/cuda/cuda_kernel.h).");
  m.def("mark_step_begin", &mark_step_begin);
  m.def("roundtrip", [](const std::string& text) { return print(parse(text)); },
        "Parses IR text and prints it back (the canonical form).");
  m.def("pass_names", [] {
    std::vector<std::string> names;
    for (const Pass& p : default_passes()) names.emplace_back(p.name);
    return names;
  });

  // ---- deployment packages (ember.export / ember.load): the same C++ a deployed app calls.
  m.def("export_package",
        [](const std::string& path, const std::string& ir, const std::unordered_map<std::string, at::Tensor>& constants,
           std::vector<std::pair<std::string, std::string>> meta, std::vector<std::string> disabled_passes,
           const package::GraphTexts& subgraphs) {
          CompileOptions options;
          options.disabled_passes = std::move(disabled_passes);
          options.graph_name = "export";
          package::ExportResult r;
          {
            py::gil_scoped_release no_gil;
            r = package::export_package(path, ir, constants, std::move(meta), options, subgraphs);
          }
          py::dict info;
          info["bytes"] = r.bytes;
          info["kernel_images"] = r.kernel_images;
          info["timings"] = r.compiled->timings;
          info["num_steps"] = r.compiled->plan().steps.size();
          return info;
        },
        py::arg("path"), py::arg("ir"), py::arg("constants"), py::arg("meta"), py::arg("disabled_passes"),
        py::arg("subgraphs") = package::GraphTexts{});
  py::class_<Model>(m, "Model")
      .def("run",
           [](const Model& model, const std::vector<at::Tensor>& inputs) {
             py::gil_scoped_release no_gil;
             return model.run(inputs);
           })
      .def("describe", &Model::describe)
      .def_property_readonly("device", [](const Model& model) { return model.device().str(); })
      .def_property_readonly("inputs", [](const Model& model) {
        std::vector<std::string> out;
        for (const TensorSpec& s : model.inputs()) out.push_back(s.str());
        return out;
      })
      .def_property_readonly("outputs", [](const Model& model) {
        std::vector<std::string> out;
        for (const TensorSpec& s : model.outputs()) out.push_back(s.str());
        return out;
      })
      .def_property_readonly("metadata", &Model::metadata);
  m.def("load_package",
        [](const std::string& path, const std::string& device, bool verify_checksum, bool reduce_overhead) {
          LoadOptions options;
          options.verify_checksum = verify_checksum;
          options.reduce_overhead = reduce_overhead;
          py::gil_scoped_release no_gil;
          return load(path, c10::Device(device), options);
        },
        py::arg("path"), py::arg("device"), py::arg("verify_checksum") = true, py::arg("reduce_overhead") = false);
}

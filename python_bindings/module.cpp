// ember._C: the boundary between Python and the C++ compiler and runtime.
//
// The object handed to AOTAutograd is a CompiledGraph itself: its __call__ is this file's `call`, a C++
// function that unpacks the boxed argument list (tensors by pointer, no copies), clears the list so
// inputs can be freed early, runs the plan with the GIL released and wraps the results.
#include "backend/package/export.h"
#include "ember/compiler.h"
#include "ember/cudagraph.h"
#include "ember/error.h"
#include "ember/model.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace ember {
namespace {

c10::IValue to_ivalue(PyObject* obj, size_t index) {
  if (THPVariable_Check(obj)) return c10::IValue(THPVariable_Unpack(obj));
  if (obj == Py_None) return c10::IValue();
  if (PyBool_Check(obj)) return c10::IValue(obj == Py_True);
  if (PyLong_Check(obj)) return c10::IValue(static_cast<int64_t>(PyLong_AsLongLong(obj)));
  if (PyFloat_Check(obj)) return c10::IValue(PyFloat_AS_DOUBLE(obj));
  throw Error("input " + std::to_string(index) + " has unsupported type " + Py_TYPE(obj)->tp_name);
}

PyObject* to_python(c10::IValue&& v) {
  if (v.isTensor()) return THPVariable_Wrap(std::move(v).toTensor());
  if (v.isNone()) Py_RETURN_NONE;
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  throw Error(std::string("graph output of unsupported kind ") + v.tagKind());
}

py::list call(CompiledGraph& graph, py::handle args) {
  std::vector<c10::IValue> inputs;
  PyObject* seq = args.ptr();
  if (PyList_Check(seq)) {
    Py_ssize_t n = PyList_GET_SIZE(seq);
    inputs.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) inputs.push_back(to_ivalue(PyList_GET_ITEM(seq, i), i));
    PyList_SetSlice(seq, 0, n, nullptr);  // boxed convention: the callee owns the inputs now
  } else if (PyTuple_Check(seq)) {
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    inputs.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) inputs.push_back(to_ivalue(PyTuple_GET_ITEM(seq, i), i));
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

std::shared_ptr<CompiledGraph> compile_text(const std::string& ir, const std::unordered_map<std::string, at::Tensor>& constants,
                                            std::vector<std::string> disabled_passes, std::string debug_dir,
                                            std::string graph_name) {
  CompileOptions options;
  options.disabled_passes = std::move(disabled_passes);
  options.debug_dir = std::move(debug_dir);
  options.graph_name = std::move(graph_name);
  return compile(parse(ir), constants, options);
}

}  // namespace
}  // namespace ember

PYBIND11_MODULE(_C, m) {
  using namespace ember;
  m.doc() = "ember's C++ compiler and runtime";

  // ember::Error becomes the Python package's EmberError (defined in Python so that importing ember
  // never needs this module).
  py::object ember_error = py::module_::import("ember.errors").attr("EmberError");
  static py::handle error_type = ember_error.release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_type.ptr(), e.what());
    }
  });

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
      .def_property_readonly("cuda_graphs", [](const CompiledGraph& g) { return g.runner() != nullptr; })
      .def("cuda_graph_report", [](const CompiledGraph& g) { return g.runner() ? g.runner()->describe() : std::string(); })
      .def("steps", [](const CompiledGraph& g) {
        // (kind, what) per step: ("kernel", description) / ("aten", op name) / ("prim", op name)
        std::vector<std::pair<std::string, std::string>> out;
        for (const Step& s : g.plan().steps) {
          if (s.kernel) out.emplace_back("kernel", s.kernel->describe());
          else out.emplace_back(s.op ? "aten" : "prim", s.node->op);
        }
        return out;
      });

  m.def("compile", &compile_text, py::arg("ir"), py::arg("constants"), py::arg("disabled_passes"),
        py::arg("debug_dir"), py::arg("graph_name"));
  m.def("cuda_graphs_supported", &cuda_graphs_supported);
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
           std::vector<std::pair<std::string, std::string>> meta, std::vector<std::string> disabled_passes) {
          CompileOptions options;
          options.disabled_passes = std::move(disabled_passes);
          options.graph_name = "export";
          package::ExportResult r;
          {
            py::gil_scoped_release no_gil;
            r = package::export_package(path, ir, constants, std::move(meta), options);
          }
          py::dict info;
          info["bytes"] = r.bytes;
          info["kernel_images"] = r.kernel_images;
          info["timings"] = r.compiled->timings;
          info["num_steps"] = r.compiled->plan().steps.size();
          return info;
        },
        py::arg("path"), py::arg("ir"), py::arg("constants"), py::arg("meta"), py::arg("disabled_passes"));
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

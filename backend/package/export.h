// The C++ half of ember.export: compile the lowered IR once (which proves it compiles and collects the
// CUDA images NVRTC produced) and write the package. python_bindings/ember/export.py does the rest.
#pragma once

#include "ember/compiler.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ember::package {

struct ExportResult {
  uint64_t bytes = 0;       // size of the package file
  size_t kernel_images = 0; // CUDA images embedded
  std::shared_ptr<CompiledGraph> compiled;  // what the export compiled (plan, timings)
};

// `meta` gets "arch" and "nvrtc" added for a CUDA graph. Throws ember::Error when the graph does not
// compile or the file cannot be written.
ExportResult export_package(const std::string& path, const std::string& ir,
                            const std::unordered_map<std::string, at::Tensor>& constants,
                            std::vector<std::pair<std::string, std::string>> meta, CompileOptions options);

}  // namespace ember::package

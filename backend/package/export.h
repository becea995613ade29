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

// Control flow subgraphs (torch.cond's branches, ...) travel in the IR section after the graph's own text,
// each after a line `subgraph "<path>"`: a subgraph of the graph has the name its node gives as path, one of
// a subgraph its parent's path, '/', its name. Their constants share the package's table under "<path>/" names.
using GraphTexts = std::vector<std::pair<std::string, std::string>>;  // (path, IR text)
std::string join_graphs(const std::string& ir, const GraphTexts& subgraphs);
// The graph's text and its subgraphs' from an IR section. Throws ember::Error for a malformed marker line.
std::pair<std::string, GraphTexts> split_graphs(const std::string& section);
// Compiles every subgraph (parsed, by path), the deepest first, each with its own subgraphs; returns those the
// graph names (CompileOptions::subgraphs). `options` as for the graph (kernel images, disabled passes).
Subgraphs compile_subgraphs(std::vector<std::pair<std::string, Graph>> subgraphs,
                            const std::unordered_map<std::string, at::Tensor>& constants, const CompileOptions& options);

// `meta` gets "arch" and "nvrtc" added for a CUDA graph. Throws ember::Error when the graph does not
// compile or the file cannot be written.
ExportResult export_package(const std::string& path, const std::string& ir,
                            const std::unordered_map<std::string, at::Tensor>& constants,
                            std::vector<std::pair<std::string, std::string>> meta, CompileOptions options,
                            const GraphTexts& subgraphs = {});

}  // namespace ember::package

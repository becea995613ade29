// export_package: IR text + weights -> compiled once (collecting CUDA images) -> package file.
#include "backend/package/export.h"

#include "backend/package/format.h"
#include "ember/error.h"
#include "kernels/cuda/driver.h"

#include <algorithm>
#include <optional>

namespace ember::package {

namespace {
constexpr const char* kMarker = "subgraph \"";
}  // namespace

std::string join_graphs(const std::string& ir, const GraphTexts& subgraphs) {
  std::string out = ir;
  for (const auto& [path, text] : subgraphs) {
    if (path.empty() || path.find_first_of("\"\n") != std::string::npos) throw Error("bad subgraph path '" + path + "'");
    if (!out.empty() && out.back() != '\n') out += '\n';
    out += kMarker + path + "\"\n" + text;
  }
  return out;
}

std::pair<std::string, GraphTexts> split_graphs(const std::string& section) {
  std::pair<std::string, GraphTexts> out;
  std::string* current = &out.first;
  size_t start = 0;
  while (start < section.size()) {
    size_t end = section.find('\n', start);
    end = end == std::string::npos ? section.size() : end + 1;
    std::string_view line(section.data() + start, end - start);
    if (line.rfind(kMarker, 0) == 0) {
      size_t close = line.find('"', std::char_traits<char>::length(kMarker));
      if (close == std::string_view::npos || close == std::char_traits<char>::length(kMarker))
        throw Error("corrupt ember package: bad subgraph line '" + std::string(line) + "'");
      out.second.emplace_back(std::string(line.substr(std::char_traits<char>::length(kMarker),
                                                      close - std::char_traits<char>::length(kMarker))),
                              std::string());
      current = &out.second.back().second;
    } else {
      current->append(line);
    }
    start = end;
  }
  return out;
}

Subgraphs compile_subgraphs(std::vector<std::pair<std::string, Graph>> subgraphs,
                            const std::unordered_map<std::string, at::Tensor>& constants, const CompileOptions& options) {
  auto depth = [](const std::string& path) { return std::count(path.begin(), path.end(), '/'); };
  std::vector<std::pair<std::string, Graph>*> order;
  for (auto& entry : subgraphs) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(), [&](auto* a, auto* b) { return depth(a->first) > depth(b->first); });
  std::unordered_map<std::string, std::shared_ptr<const CompiledGraph>> compiled;  // by path
  // The subgraphs `parent` names (by their last path component); "" is the graph itself.
  auto children = [&](const std::string& parent) {
    Subgraphs named;
    const std::string prefix = parent.empty() ? "" : parent + "/";
    for (const auto& [path, graph] : compiled)
      if (path.rfind(prefix, 0) == 0 && path.find('/', prefix.size()) == std::string::npos)
        named.emplace(path.substr(prefix.size()), graph);
    return named;
  };
  for (auto* entry : order) {
    CompileOptions sub = options;
    sub.graph_name = options.graph_name + "_" + entry->first;
    sub.cached_inputs.clear();
    sub.subgraphs = children(entry->first);
    if (!compiled.emplace(entry->first, compile(std::move(entry->second), constants, sub)).second)
      throw Error("two subgraphs at path '" + entry->first + "'");
  }
  return children("");
}

ExportResult export_package(const std::string& path, const std::string& ir,
                            const std::unordered_map<std::string, at::Tensor>& constants,
                            std::vector<std::pair<std::string, std::string>> meta, CompileOptions options,
                            const GraphTexts& subgraphs) {
  Graph graph = parse(ir);
  // The first CUDA device the graph declares is the one its kernels are compiled for.
  std::optional<c10::Device> cuda_device;
  for (const Value* v : graph.inputs())
    if (!cuda_device && v->type.is_tensor() && v->type.tensor.device.is_cuda()) cuda_device = v->type.tensor.device;
  for (const auto& n : graph.nodes())
    for (const Value* v : n->outputs)
      if (!cuda_device && v->type.is_tensor() && v->type.tensor.device.is_cuda()) cuda_device = v->type.tensor.device;

  auto images = std::make_shared<cuda::ImageStore>();
  options.kernel_images = images;
  std::vector<std::pair<std::string, Graph>> parsed;
  for (const auto& [sub_path, text] : subgraphs) parsed.emplace_back(sub_path, parse(text));
  options.subgraphs = compile_subgraphs(std::move(parsed), constants, options);  // their kernels land in `images` too
  ExportResult result;
  result.compiled = compile(std::move(graph), constants, options);

  Contents contents;
  contents.ir = join_graphs(ir, subgraphs);
  contents.meta = std::move(meta);
  if (cuda_device) {
    std::string why;
    if (cuda::available(&why)) {
      contents.meta.emplace_back("arch", cuda::arch(cuda_device->has_index() ? cuda_device->index() : 0));
      try {
        contents.meta.emplace_back("nvrtc", cuda::nvrtc_version());
      } catch (const Error&) {
        contents.meta.emplace_back("nvrtc", "none");
      }
    }
  }
  contents.kernels = images->entries();
  contents.meta.emplace_back("kernel_images", std::to_string(contents.kernels.size()));
  for (const auto& kv : constants) contents.constants.emplace_back(kv.first, kv.second);
  std::sort(contents.constants.begin(), contents.constants.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  result.bytes = write(path, contents);
  result.kernel_images = contents.kernels.size();
  return result;
}

}  // namespace ember::package

// export_package: IR text + weights -> compiled once (collecting CUDA images) -> package file.
#include "backend/package/export.h"

#include "backend/package/format.h"
#include "ember/error.h"
#include "kernels/cuda/driver.h"

#include <algorithm>
#include <optional>

namespace ember::package {

ExportResult export_package(const std::string& path, const std::string& ir,
                            const std::unordered_map<std::string, at::Tensor>& constants,
                            std::vector<std::pair<std::string, std::string>> meta, CompileOptions options) {
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
  ExportResult result;
  result.compiled = compile(std::move(graph), constants, options);

  Contents contents;
  contents.ir = ir;
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

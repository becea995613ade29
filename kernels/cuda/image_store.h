// Compiled CUDA images (cubins), each kept with the source and architecture it was compiled from.
//
// driver.cpp looks a kernel up here before it runs NVRTC and adds what NVRTC produced, so the same
// store serves both directions of deployment: ember.export compiles into an empty store and writes
// its entries into the package; ember::load fills a store from the package and compiles against it,
// which loads every image without NVRTC. The key is the full (architecture, source) pair, not a hash
// of it, so a lookup can never return an image built from different code.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ember::cuda {

struct KernelImage {
  std::string arch;           // "sm_90"
  std::string source;         // the CUDA C++ the image was compiled from
  std::string image;          // cubin bytes, as cuModuleLoadData takes them
  std::string nvrtc_version;  // "13.0" (what compiled it; informational)
};

class ImageStore {
 public:
  // The image for `source` on `arch`, or null. Entries are never removed, so the pointer stays valid
  // as long as the store lives.
  const KernelImage* find(const std::string& arch, const std::string& source) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = images_.find({arch, source});
    return it == images_.end() ? nullptr : &it->second;
  }
  void add(KernelImage image) {
    std::lock_guard<std::mutex> lock(mu_);
    std::pair<std::string, std::string> key{image.arch, image.source};
    images_.emplace(std::move(key), std::move(image));  // a racing compile of the same source keeps the first
  }
  // Every entry, in key order (packages come out byte-identical for the same model).
  std::vector<KernelImage> entries() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<KernelImage> out;
    for (const auto& kv : images_) out.push_back(kv.second);
    return out;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return images_.size();
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, KernelImage> images_;
};

}  // namespace ember::cuda

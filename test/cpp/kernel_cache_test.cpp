// The CUDA kernel disk cache (kernels/cuda/disk_cache.h) without a GPU: what is stored is found again
// under exactly its key, and a damaged, truncated or foreign entry is a miss, never a wrong image.
#include "kernels/cuda/disk_cache.h"
#include "ember/config.h"

#include <gtest/gtest.h>

#include <dirent.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include <unistd.h>

namespace ember::cuda {
namespace {

// POSIX directory handling: std::filesystem calls bind to the copy torch 2.11's libtorch.so exports, and
// its remove_all crashed on the GPU machine (see kernels/cuda/disk_cache.cpp).
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.push_back(dir + "/" + e->d_name);
    ::closedir(d);
  }
  return out;
}

void remove_tree(const std::string& dir) {  // the cache directory holds files only
  for (const std::string& f : entries(dir)) ::unlink(f.c_str());
  ::rmdir(dir.c_str());
}

class KernelCache : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    dir_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/ember_kernel_cache_test_" + std::to_string(::getpid());
    remove_tree(dir_);
  }
  void TearDown() override { remove_tree(dir_); }

  // The one entry file in the cache directory.
  std::string only_entry() const {
    std::vector<std::string> files = entries(dir_);
    EXPECT_EQ(files.size(), 1u);
    return files.at(0);
  }

  std::string dir_;
  KernelImage image_{"sm_90", "extern \"C\" __global__ void ember_fused() {}", std::string("\x7f" "ELF\0cubin", 9), "13.0"};
};

TEST_F(KernelCache, StoredImageIsFoundUnderItsExactKeyOnly) {
  ASSERT_TRUE(disk_cache_store(dir_, image_));
  auto found = disk_cache_find(dir_, "sm_90", "13.0", image_.source);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->image, image_.image);
  EXPECT_EQ(found->source, image_.source);
  EXPECT_FALSE(disk_cache_find(dir_, "sm_80", "13.0", image_.source));
  EXPECT_FALSE(disk_cache_find(dir_, "sm_90", "12.8", image_.source));
  EXPECT_FALSE(disk_cache_find(dir_, "sm_90", "13.0", image_.source + " "));
  EXPECT_FALSE(disk_cache_find("", "sm_90", "13.0", image_.source));
}

TEST_F(KernelCache, DamagedEntriesAreMissesAndGetRewritten) {
  ASSERT_TRUE(disk_cache_store(dir_, image_));
  auto path = only_entry();
  std::string good;
  {
    std::ifstream f(path, std::ios::binary);
    good.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  for (size_t n : {size_t(0), size_t(5), size_t(20), good.size() / 2, good.size() - 1}) {
    write(good.substr(0, n));
    EXPECT_FALSE(disk_cache_find(dir_, "sm_90", "13.0", image_.source)) << "truncated to " << n;
  }
  for (size_t bit = 0; bit < good.size() * 8; bit += 7) {
    std::string flipped = good;
    flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    write(flipped);
    EXPECT_FALSE(disk_cache_find(dir_, "sm_90", "13.0", image_.source)) << "bit " << bit;
  }
  ASSERT_TRUE(disk_cache_store(dir_, image_));  // a recompile overwrites the damaged entry
  EXPECT_TRUE(disk_cache_find(dir_, "sm_90", "13.0", image_.source));
}

TEST_F(KernelCache, DirectoryComesFromTheSetting) {
  const std::optional<std::string> saved = config_value("EMBER_CACHE_DIR");
  config_set("EMBER_CACHE_DIR", "off");
  EXPECT_EQ(disk_cache_dir(), "");
  config_set("EMBER_CACHE_DIR", dir_);
  EXPECT_EQ(disk_cache_dir(), dir_);
  config_set("EMBER_CACHE_DIR", std::nullopt);
  if (std::getenv("HOME")) EXPECT_EQ(disk_cache_dir(), std::string(std::getenv("HOME")) + "/.cache/ember");
  config_set("EMBER_CACHE_DIR", saved);
}

}  // namespace
}  // namespace ember::cuda

// The on-disk cache of compiled CUDA images (issue #3): one file per (architecture, NVRTC version,
// ember version, source) under EMBER_CACHE_DIR (default ~/.cache/ember; EMBER_CACHE_DIR=off disables
// it), so a second process skips NVRTC for kernels it has compiled before. A file is trusted only
// after its checksum and an exact comparison of everything in its key: a damaged, truncated or
// colliding entry is a miss and is compiled and written again. Writes go through a temporary file and
// a rename, so concurrent processes never see half an entry; any I/O failure is a miss, not an error.
#pragma once

#include "kernels/cuda/image_store.h"

#include <optional>
#include <string>

namespace ember::cuda {

// The cache directory, or "" when disabled.
std::string disk_cache_dir();

// The entry for (arch, nvrtc_version, source) under `dir`, if one verifies.
std::optional<KernelImage> disk_cache_find(const std::string& dir, const std::string& arch,
                                           const std::string& nvrtc_version, const std::string& source);

// Writes `image` under `dir` (created if missing). Best effort: returns false when it could not.
bool disk_cache_store(const std::string& dir, const KernelImage& image);

// For the caches under `dir` (this one, gemm_record.cpp): the bytes of the file at `path`, nullopt where it cannot
// be read; and `bytes` written to `dir`/`name` (`dir` created if missing) through a temporary file and a rename, so
// that concurrent processes never see half a file. Best effort: false where it could not.
std::optional<std::string> read_cache_file(const std::string& path);
bool write_cache_file(const std::string& dir, const std::string& name, const std::string& bytes);

}  // namespace ember::cuda

// The deployment package file (ember.export writes it, ember::load reads it). One file, little-endian:
//
//   header (64 bytes)   magic "EMBERPKG", u32 format version, u32 section count, u64 file size,
//                       u64 checksum, u64 section table offset, zero padding
//   sections            each starts on a 64-byte boundary:
//     meta              text, one "key value" line each (versions, device, arch, input/output specs,
//                       symbol ranges)
//     ir                the graph's IR text, as lowered from torch.export (compiled again at load)
//     constants         u32 count; per constant: name, u32 dtype, u32 rank, i64 sizes[rank],
//                       i64 strides[rank], u64 offset into `data`, u64 byte count
//     kernels           u32 count; per CUDA image: arch, source, cubin, NVRTC version
//     data              the weights, each 64-byte aligned: a mmap of the file backs CPU tensors
//   section table       per section: char[16] name, u64 offset, u64 size
//   (strings are u64 length + bytes)
//
// The checksum (64-bit xxHash of the whole file, with its own field read as zero) is verified before
// any offset inside the file is trusted; every read is bounds-checked anyway, so even an unverified
// file (fuzzing) can only produce ember::Error.
#pragma once

#include "kernels/cuda/image_store.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ember::package {

constexpr uint32_t kFormatVersion = 1;
constexpr size_t kHeaderSize = 64;
constexpr size_t kAlignment = 64;

// What a package holds, for writing. Constants may live on any device; they are written from the CPU.
struct Contents {
  std::vector<std::pair<std::string, std::string>> meta;  // keys and values without newlines
  std::string ir;
  std::vector<std::pair<std::string, at::Tensor>> constants;
  std::vector<cuda::KernelImage> kernels;
};

// The package file's bytes.
std::string serialize(const Contents& contents);
// Writes serialize(contents) to `path` through a temporary file and a rename, so a reader never sees
// half a package; returns its size. Throws ember::Error when the file cannot be written.
uint64_t write(const std::string& path, const Contents& contents);

struct ConstantEntry {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes, strides;  // dense and non-overlapping (checked)
  uint64_t offset = 0;                  // into the data section, 64-byte aligned
  uint64_t nbytes = 0;
};

// A parsed package over bytes the caller keeps alive.
struct View {
  std::vector<std::pair<std::string, std::string>> meta;
  std::string_view ir;
  std::vector<ConstantEntry> constants;
  const uint8_t* data = nullptr;  // the data section
  uint64_t data_size = 0;
  std::vector<cuda::KernelImage> kernels;

  // The value of the first meta line with `key`, or "" if there is none.
  std::string meta_value(const std::string& key) const;
};

// Parses and validates `bytes`. Throws ember::Error naming what is wrong (truncated, corrupt, another
// format version). `verify_checksum` false skips only the checksum (for fuzzing the parser).
View read(const uint8_t* bytes, size_t size, bool verify_checksum = true);

// The package checksum of a complete file image (the checksum field counts as zero).
uint64_t checksum(const uint8_t* bytes, size_t size);

}  // namespace ember::package

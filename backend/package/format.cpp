// Reading and writing the package container (layout in format.h). The reader treats the file as
// hostile: every length and offset is checked against what remains before it is used, sizes are
// multiplied with overflow checks, and each constant must be a dense, non-overlapping tensor lying
// inside the data section, so a bad file yields ember::Error and never an out-of-bounds read.
#include "backend/package/format.h"

#include "backend/package/xxhash.h"

#include "ember/error.h"
#include "ember/ir.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>

namespace ember::package {

static_assert(std::endian::native == std::endian::little, "the package format is little-endian");

namespace {

uint64_t load64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
uint32_t load32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'P', 'K', 'G'};
constexpr size_t kChecksumOffset = 24;
constexpr size_t kSectionNameSize = 16;
constexpr uint32_t kMaxSections = 64;
constexpr uint32_t kMaxRank = 64;

// ---- writing

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void put_string(std::string& out, std::string_view s) { put_u64(out, s.size()); out.append(s); }
void pad_to_alignment(std::string& out) { out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, '\0'); }

// A CPU tensor whose bytes are one dense, non-overlapping block in the constant's own strides (kept
// so that the IR's declared strides still hold at load), or a contiguous copy when it has none.
at::Tensor dense_cpu(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.cpu();
  if (!c.is_non_overlapping_and_dense()) c = c.contiguous();
  return c;
}

// ---- reading

// A bounds-checked reader over [begin, end) of the file.
class Cursor {
 public:
  Cursor(const uint8_t* base, uint64_t begin, uint64_t end, const char* what)
      : base_(base), pos_(begin), end_(end), what_(what) {}

  template <class T>
  T read() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view bytes(uint64_t n) {
    need(n);
    std::string_view s(reinterpret_cast<const char*>(base_ + pos_), n);
    pos_ += n;
    return s;
  }
  std::string_view string() { return bytes(read<uint64_t>()); }

 private:
  void need(uint64_t n) const {
    if (n > end_ - pos_)
      throw Error(std::string("corrupt ember package: ") + what_ + " section ends before its contents do");
  }
  const uint8_t* base_;
  uint64_t pos_, end_;
  const char* what_;
};

[[noreturn]] void corrupt(const std::string& why) { throw Error("corrupt ember package: " + why); }

// The dtypes the IR can name; anything else in a constant entry is corruption.
c10::ScalarType checked_dtype(uint32_t v) {
  if (v >= static_cast<uint32_t>(c10::ScalarType::NumOptions)) corrupt("constant has unknown dtype " + std::to_string(v));
  auto t = static_cast<c10::ScalarType>(v);
  try {
    dtype_name(t);
  } catch (const Error&) {
    corrupt("constant has unsupported dtype " + std::to_string(v));
  }
  return t;
}

// Checks that sizes/strides describe a dense, non-overlapping block (a permutation of a contiguous
// layout) and returns its element count.
uint64_t dense_numel(const ConstantEntry& c) {
  uint64_t numel = 1;
  for (int64_t s : c.sizes) {
    if (s < 0) corrupt("constant " + c.name + " has a negative size");
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel)) corrupt("constant " + c.name + " is too large");
  }
  if (numel == 0) return 0;
  std::vector<size_t> order(c.sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return c.strides[a] < c.strides[b]; });
  uint64_t expected = 1;
  for (size_t d : order) {
    if (c.sizes[d] == 1) continue;
    if (c.strides[d] < 0 || static_cast<uint64_t>(c.strides[d]) != expected)
      corrupt("constant " + c.name + " is not a dense tensor");
    expected *= static_cast<uint64_t>(c.sizes[d]);
  }
  return numel;
}

}  // namespace

uint64_t checksum(const uint8_t* bytes, size_t size) {
  // The header with its checksum field zeroed seeds the hash of everything after it.
  uint8_t header[kHeaderSize];
  std::memcpy(header, bytes, kHeaderSize);
  std::memset(header + kChecksumOffset, 0, 8);
  return xxh64(bytes + kHeaderSize, size - kHeaderSize, xxh64(header, kHeaderSize, 0));
}

std::string serialize(const Contents& contents) {
  std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> sections;
  std::string out(kHeaderSize, '\0');
  auto section = [&](const char* name, const std::string& body) {
    pad_to_alignment(out);
    sections.push_back({name, {out.size(), body.size()}});
    out += body;
  };

  std::string meta;
  for (const auto& [key, value] : contents.meta) {
    if (key.find_first_of(" \n") != std::string::npos || value.find('\n') != std::string::npos)
      throw Error("package meta key '" + key + "' or its value has a space or newline where it may not");
    meta += key + " " + value + "\n";
  }
  section("meta", meta);
  section("ir", contents.ir);

  // Constants: the table first, then each tensor's bytes in the data section.
  std::vector<at::Tensor> dense;
  std::string table, data;
  put_u32(table, static_cast<uint32_t>(contents.constants.size()));
  for (const auto& [name, tensor] : contents.constants) {
    at::Tensor c = dense_cpu(tensor);
    dtype_name(c.scalar_type());  // throws for a dtype the IR cannot name
    uint64_t nbytes = c.numel() * c.element_size();
    pad_to_alignment(data);
    put_string(table, name);
    put_u32(table, static_cast<uint32_t>(c.scalar_type()));
    put_u32(table, static_cast<uint32_t>(c.dim()));
    for (int64_t s : c.sizes()) put_u64(table, static_cast<uint64_t>(s));
    for (int64_t s : c.strides()) put_u64(table, static_cast<uint64_t>(s));
    put_u64(table, data.size());
    put_u64(table, nbytes);
    if (nbytes) data.append(static_cast<const char*>(c.data_ptr()), nbytes);
  }
  section("constants", table);

  std::string kernels;
  put_u32(kernels, static_cast<uint32_t>(contents.kernels.size()));
  for (const cuda::KernelImage& k : contents.kernels) {
    put_string(kernels, k.arch);
    put_string(kernels, k.source);
    put_string(kernels, k.image);
    put_string(kernels, k.nvrtc_version);
  }
  section("kernels", kernels);
  section("data", data);

  pad_to_alignment(out);
  uint64_t table_offset = out.size();
  for (const auto& [name, range] : sections) {
    char padded[kSectionNameSize] = {};
    std::memcpy(padded, name.data(), std::min(name.size(), kSectionNameSize - 1));
    out.append(padded, kSectionNameSize);
    put_u64(out, range.first);
    put_u64(out, range.second);
  }

  char* h = out.data();
  uint32_t version = kFormatVersion, count = static_cast<uint32_t>(sections.size());
  uint64_t file_size = out.size();
  std::memcpy(h, kMagic, 8);
  std::memcpy(h + 8, &version, 4);
  std::memcpy(h + 12, &count, 4);
  std::memcpy(h + 16, &file_size, 8);
  std::memcpy(h + 32, &table_offset, 8);
  uint64_t sum = checksum(reinterpret_cast<const uint8_t*>(out.data()), out.size());
  std::memcpy(h + kChecksumOffset, &sum, 8);
  return out;
}

uint64_t write(const std::string& path, const Contents& contents) {
  std::string bytes = serialize(contents);
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("cannot write ember package '" + path + "'");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) throw Error("writing ember package '" + path + "' failed (disk full?)");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot move the ember package into place at '" + path + "'");
  }
  return bytes.size();
}

std::string View::meta_value(const std::string& key) const {
  for (const auto& [k, v] : meta)
    if (k == key) return v;
  return "";
}

View read(const uint8_t* bytes, size_t size, bool verify_checksum) {
  if (size < kHeaderSize || std::memcmp(bytes, kMagic, 8) != 0)
    throw Error(size < kHeaderSize ? "not an ember package: the file is " + std::to_string(size) + " bytes"
                                   : "not an ember package: wrong magic bytes");
  uint32_t version = load32(bytes + 8), count = load32(bytes + 12);
  uint64_t file_size = load64(bytes + 16), stored_sum = load64(bytes + kChecksumOffset),
           table_offset = load64(bytes + 32);
  if (version != kFormatVersion)
    throw Error("ember package has format version " + std::to_string(version) + "; this ember reads version " +
                std::to_string(kFormatVersion) + " (export the model again with this ember)");
  if (file_size != size)
    throw Error("corrupt ember package: it should be " + std::to_string(file_size) + " bytes but is " +
                std::to_string(size) + " (truncated?)");
  if (verify_checksum && checksum(bytes, size) != stored_sum)
    throw Error("corrupt ember package: checksum mismatch (the file was modified or damaged)");
  if (count > kMaxSections || table_offset < kHeaderSize || table_offset > size ||
      uint64_t(count) * (kSectionNameSize + 16) > size - table_offset)
    corrupt("bad section table");

  View view;
  struct Range { uint64_t offset = 0, size = 0; bool found = false; };
  Range meta, ir, constants, kernels, data;
  Cursor table(bytes, table_offset, size, "section table");
  for (uint32_t i = 0; i < count; ++i) {
    std::string_view raw = table.bytes(kSectionNameSize);
    std::string name(raw.data(), strnlen(raw.data(), kSectionNameSize));
    Range r{table.read<uint64_t>(), table.read<uint64_t>(), true};
    if (r.offset < kHeaderSize || r.offset > size || r.size > size - r.offset) corrupt("section " + name + " lies outside the file");
    if (name == "meta") meta = r;
    else if (name == "ir") ir = r;
    else if (name == "constants") constants = r;
    else if (name == "kernels") kernels = r;
    else if (name == "data") data = r;  // unknown names are skipped: a later minor addition
  }
  for (auto [r, name] : {std::pair{&meta, "meta"}, {&ir, "ir"}, {&constants, "constants"}, {&kernels, "kernels"}, {&data, "data"}})
    if (!r->found) corrupt(std::string("no ") + name + " section");
  if (data.offset % kAlignment != 0) corrupt("data section is not aligned");

  std::string_view meta_text(reinterpret_cast<const char*>(bytes + meta.offset), meta.size);
  for (size_t pos = 0; pos < meta_text.size();) {
    size_t eol = meta_text.find('\n', pos);
    if (eol == std::string_view::npos) corrupt("meta section does not end with a newline");
    std::string_view line = meta_text.substr(pos, eol - pos);
    size_t space = line.find(' ');
    if (space == std::string_view::npos) corrupt("meta line without a value");
    view.meta.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
    pos = eol + 1;
  }
  view.ir = std::string_view(reinterpret_cast<const char*>(bytes + ir.offset), ir.size);
  view.data = bytes + data.offset;
  view.data_size = data.size;

  Cursor c(bytes, constants.offset, constants.offset + constants.size, "constants");
  uint32_t n = c.read<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    ConstantEntry e;
    e.name = std::string(c.string());
    e.dtype = checked_dtype(c.read<uint32_t>());
    uint32_t rank = c.read<uint32_t>();
    if (rank > kMaxRank) corrupt("constant " + e.name + " has rank " + std::to_string(rank));
    for (uint32_t d = 0; d < rank; ++d) e.sizes.push_back(c.read<int64_t>());
    for (uint32_t d = 0; d < rank; ++d) e.strides.push_back(c.read<int64_t>());
    e.offset = c.read<uint64_t>();
    e.nbytes = c.read<uint64_t>();
    uint64_t expected = 0;
    if (__builtin_mul_overflow(dense_numel(e), c10::elementSize(e.dtype), &expected) || expected != e.nbytes)
      corrupt("constant " + e.name + " has " + std::to_string(e.nbytes) + " bytes for its shape");
    if (e.offset % kAlignment != 0 || e.offset > data.size || e.nbytes > data.size - e.offset)
      corrupt("constant " + e.name + " lies outside the data section");
    view.constants.push_back(std::move(e));
  }

  Cursor k(bytes, kernels.offset, kernels.offset + kernels.size, "kernels");
  uint32_t nk = k.read<uint32_t>();
  for (uint32_t i = 0; i < nk; ++i) {
    cuda::KernelImage image;
    image.arch = std::string(k.string());
    image.source = std::string(k.string());
    image.image = std::string(k.string());
    image.nvrtc_version = std::string(k.string());
    view.kernels.push_back(std::move(image));
  }
  return view;
}

}  // namespace ember::package
